//! Where the Kubernetes and etcd binaries come from.
//!
//! Kubernetes server binaries are looked up, for version `vX.Y.Z`, in
//! `$NESTPLANE_BIN_DIR/vX.Y.Z/`, then `$NESTPLANE_BIN_DIR/` (a user's own binaries of any
//! version), then the cache the install script fills
//! (`$NESTPLANE_CACHE_DIR` or `~/.cache/nestplane`, `kubernetes/vX.Y.Z/bin/`). etcd is looked
//! up in `$NESTPLANE_BIN_DIR` and then on `PATH`.

use std::path::{Path, PathBuf};

/// The hint printed whenever a binary is missing.
pub const INSTALL_HINT: &str = "run scripts/install-deps.sh (builds and caches the Kubernetes binaries), or point NESTPLANE_BIN_DIR at a directory holding them";

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

/// Find a Kubernetes server binary (`kube-apiserver`, …) for `version`.
pub fn kubernetes(name: &str, version: &str) -> Result<PathBuf, MissingBinary> {
    let searched = candidates(name, version);
    match searched.iter().find(|p| is_executable(p)) {
        Some(p) => Ok(p.clone()),
        None => Err(MissingBinary {
            name: name.into(),
            version: version.into(),
            searched,
        }),
    }
}

/// Find a binary on `NESTPLANE_BIN_DIR` or `PATH` (etcd, etcdctl).
pub fn on_path(name: &str) -> Result<PathBuf, MissingBinary> {
    let mut searched = Vec::new();
    if let Some(dir) = std::env::var_os("NESTPLANE_BIN_DIR") {
        searched.push(PathBuf::from(dir).join(name));
    }
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
