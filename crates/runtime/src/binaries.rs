//! Where the Kubernetes and etcd binaries come from.
//!
//! Kubernetes server binaries are looked up, for version `vX.Y.Z`, in
//! `$NESTPLANE_BIN_DIR/vX.Y.Z/`, then `$NESTPLANE_BIN_DIR/` (a user's own binaries of any
//! version), then the cache the install script fills
//! (`$NESTPLANE_CACHE_DIR` or `~/.cache/nestplane`, `kubernetes/vX.Y.Z/bin/`). etcd is looked
//! up in `$NESTPLANE_BIN_DIR`, then in the cache (`etcd/bin/`, where the install script puts
//! a current one), then on `PATH`.

use std::path::{Path, PathBuf};

/// The hint printed whenever a binary is missing.
pub const INSTALL_HINT: &str = "run scripts/install-deps.sh (builds and caches the Kubernetes binaries and a current etcd), or point NESTPLANE_BIN_DIR at a directory holding them";

/// A binary that could not be found.
#[derive(Debug, thiserror::Error)]
#[error("{name} {version}: not found (looked in {searched}); {hint}", searched = .searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "), hint = INSTALL_HINT)]
pub struct MissingBinary {
    /// The binary's name.
    pub name: String,
    /// The version asked for (empty for etcd).
    pub version: String,
    /// Every place looked at.
    pub searched: Vec<PathBuf>,
}

/// The cache directory (`$NESTPLANE_CACHE_DIR` or `~/.cache/nestplane`).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("NESTPLANE_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache").join("nestplane")
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Candidate paths for a Kubernetes binary of `version` (`v1.20.2`).
pub fn candidates(name: &str, version: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(dir) = std::env::var_os("NESTPLANE_BIN_DIR") {
        let dir = PathBuf::from(dir);
        out.push(dir.join(version).join(name));
        out.push(dir.join(name));
    }
    out.push(
        cache_dir()
            .join("kubernetes")
            .join(version)
            .join("bin")
            .join(name),
    );
    out
}

/// The version a Kubernetes binary reports (`kube-apiserver --version` prints
/// `Kubernetes v1.20.2`), cached per path.
pub fn reported_version(path: &Path) -> Option<String> {
    type Cache = std::collections::HashMap<PathBuf, Option<String>>;
    static CACHE: std::sync::Mutex<Option<Cache>> = std::sync::Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(Default::default);
    if let Some(v) = cache.get(path) {
        return v.clone();
    }
    let v = std::process::Command::new(path)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find(|w| w.starts_with('v'))
                .map(str::to_string)
        });
    cache.insert(path.to_path_buf(), v.clone());
    v
}

/// Find a Kubernetes server binary (`kube-apiserver`, …) for `version`. A binary directly in
/// `$NESTPLANE_BIN_DIR` is used only when it reports that version: running 1.20 binaries with
/// 1.33 flags would fail in confusing ways.
pub fn kubernetes(name: &str, version: &str) -> Result<PathBuf, MissingBinary> {
    let loose_dir = std::env::var_os("NESTPLANE_BIN_DIR").map(PathBuf::from);
    let mut searched = Vec::new();
    for p in candidates(name, version) {
        if !is_executable(&p) {
            searched.push(p);
            continue;
        }
        if p.parent() != loose_dir.as_deref() {
            return Ok(p);
        }
        match reported_version(&p) {
            Some(v) if v == version => return Ok(p),
            Some(v) => searched.push(PathBuf::from(format!("{} (which is {v})", p.display()))),
            None => searched.push(PathBuf::from(format!(
                "{} (reports no version)",
                p.display()
            ))),
        }
    }
    Err(MissingBinary {
        name: name.into(),
        version: version.into(),
        searched,
    })
}

/// The newest patch of Kubernetes 1.`minor` whose `kube-apiserver` is in a version directory
/// here (`$NESTPLANE_BIN_DIR/v1.MINOR.PATCH/` or the cache's `kubernetes/v1.MINOR.PATCH/bin/`):
/// the step an upgrade through that minor takes. Loose binaries are not offered as steps.
pub fn newest_patch(minor: u32) -> Option<u32> {
    let mut dirs: Vec<(PathBuf, &str)> = Vec::new();
    if let Some(dir) = std::env::var_os("NESTPLANE_BIN_DIR") {
        dirs.push((PathBuf::from(dir), ""));
    }
    dirs.push((cache_dir().join("kubernetes"), "bin"));
    newest_patch_in(&dirs, minor)
}

/// [`newest_patch`] over `dirs`: (directory of version directories, the binaries' directory
/// within each).
fn newest_patch_in(dirs: &[(PathBuf, &str)], minor: u32) -> Option<u32> {
    let prefix = format!("v1.{minor}.");
    let prefix = prefix.as_str();
    dirs.iter()
        .filter_map(|(dir, sub)| std::fs::read_dir(dir).ok().map(|r| (r, *sub)))
        .flat_map(|(entries, sub)| {
            entries.flatten().filter_map(move |e| {
                let name = e.file_name().into_string().ok()?;
                let patch: u32 = name.strip_prefix(prefix)?.parse().ok()?;
                is_executable(&e.path().join(sub).join("kube-apiserver")).then_some(patch)
            })
        })
        .max()
}

/// The directory the install script unpacks etcd, etcdctl and etcdutl into (3.5.30 or
/// newer, from Debian's newer suites): `<cache>/etcd/bin`.
pub fn etcd_dir() -> PathBuf {
    cache_dir().join("etcd").join("bin")
}

/// Find one of etcd's binaries (`etcd`, `etcdctl`, `etcdutl`): in `$NESTPLANE_BIN_DIR`, then
/// the cache the install script fills ([`etcd_dir`]), then on `PATH`.
pub fn etcd(name: &str) -> Result<PathBuf, MissingBinary> {
    find(name, Some(etcd_dir()))
}

/// Find a program on `NESTPLANE_BIN_DIR` or `PATH` (runc, conntrack, …).
pub fn on_path(name: &str) -> Result<PathBuf, MissingBinary> {
    find(name, None)
}

fn find(name: &str, cache: Option<PathBuf>) -> Result<PathBuf, MissingBinary> {
    let mut searched = Vec::new();
    if let Some(dir) = std::env::var_os("NESTPLANE_BIN_DIR") {
        searched.push(PathBuf::from(dir).join(name));
    }
    searched.extend(cache.map(|d| d.join(name)));
    if let Some(path) = std::env::var_os("PATH") {
        searched.extend(std::env::split_paths(&path).map(|d| d.join(name)));
    }
    searched.push(PathBuf::from("/usr/bin").join(name));
    match searched.iter().find(|p| is_executable(p)) {
        Some(p) => Ok(p.clone()),
        None => Err(MissingBinary {
            name: name.into(),
            version: String::new(),
            searched,
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_step_is_the_newest_patch_with_an_api_server() {
        use std::os::unix::fs::PermissionsExt;
        let loose = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let put = |dir: &Path, exec: bool| {
            std::fs::create_dir_all(dir).unwrap();
            let f = dir.join("kube-apiserver");
            std::fs::write(&f, "").unwrap();
            let mode = if exec { 0o755 } else { 0o644 };
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        put(&loose.path().join("v1.21.3"), true);
        put(&loose.path().join("v1.21.10"), true);
        put(&loose.path().join("v1.21.12"), false);
        put(&cache.path().join("v1.21.11").join("bin"), true);
        put(&cache.path().join("v1.22.1"), true);
        std::fs::create_dir_all(loose.path().join("v1.23.0")).unwrap();
        let dirs = [
            (loose.path().to_path_buf(), ""),
            (cache.path().to_path_buf(), "bin"),
        ];
        assert_eq!(newest_patch_in(&dirs, 21), Some(11));
        // A binary outside the layout, an empty directory, a minor with nothing: no step.
        assert_eq!(newest_patch_in(&dirs, 22), None);
        assert_eq!(newest_patch_in(&dirs, 23), None);
        assert_eq!(newest_patch_in(&dirs, 24), None);
    }
}
