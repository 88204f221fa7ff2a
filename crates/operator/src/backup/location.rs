//! Where a backup's archive may go, decided before anything is read or written. Pure.
//!
//! A location is a `file://` URL of a directory. The operator writes archives only under
//! its backup directory, and a backup of namespace `ns` only under `<backup dir>/ns/`: a
//! namespace user names a location, and may not make the operator write (or, later, read)
//! anywhere else on its machine, nor in another namespace's directory.

use std::path::{Component, Path, PathBuf};

use nestplane_api::backup::ARCHIVE_SUFFIX;

/// The longest location accepted.
pub const MAX_LEN: usize = 1024;

/// Why a location is refused (a message for the user; names no host path but what they
/// gave and the directory they may use).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("location {given:?} refused: {why}")]
pub struct Refused {
    pub given: String,
    pub why: String,
}

/// The directory of `location` (the namespace's own directory when `None` or empty), which
/// must be `<root>/<namespace>` or under it. `root` is the operator's backup directory (an
/// absolute path it chose).
pub fn resolve(location: Option<&str>, root: &Path, namespace: &str) -> Result<PathBuf, Refused> {
    let own = root.join(namespace);
    let given = location.unwrap_or_default();
    if given.is_empty() {
        return Ok(own);
    }
    let refuse = |why: String| Refused {
        given: nestplane_api::conditions::cut(given, 200),
        why,
    };
    if given.len() > MAX_LEN {
        return Err(refuse(format!("longer than {MAX_LEN} bytes")));
    }
    if let Some(scheme) = given.split_once("://").map(|(s, _)| s)
        && scheme != "file"
    {
        return Err(refuse(format!(
            "only file:// locations are supported here, not {scheme}://"
        )));
    }
    let Some(rest) = given.strip_prefix("file://") else {
        return Err(refuse("a location is a file:// URL".into()));
    };
    let Some(path) = rest.strip_prefix('/') else {
        return Err(refuse(
            "a file:// location names a path on the operator's machine (file:///…), not a host"
                .into(),
        ));
    };
    if let Some(c) = path
        .chars()
        .find(|c| c.is_control() || matches!(c, '%' | '?' | '#' | '\\'))
    {
        return Err(refuse(format!("{c:?} is not allowed in a location")));
    }
    let mut dir = PathBuf::from("/");
    let segments: Vec<&str> = path.strip_suffix('/').unwrap_or(path).split('/').collect();
    for s in segments {
        if s.is_empty() || s == "." || s == ".." {
            return Err(refuse(
                "a location's path has no empty, `.` or `..` segment".into(),
            ));
        }
        dir.push(s);
    }
    // Lexically normal now (no `.`, `..` or doubled `/`): compare components.
    debug_assert!(dir.components().all(|c| !matches!(c, Component::ParentDir)));
    if !dir.starts_with(&own) {
        return Err(refuse(format!(
            "backups of namespace {namespace} go under file://{}/",
            own.display()
        )));
    }
    Ok(dir)
}

/// The archive at `url` (`file://<dir>/<name>.npbackup`), whose directory must be
/// `<root>/<namespace>` or under it (as [`resolve`] says) and whose name is a plain file name.
pub fn resolve_archive(url: &str, root: &Path, namespace: &str) -> Result<PathBuf, Refused> {
    let refuse = |why: String| Refused {
        given: nestplane_api::conditions::cut(url, 200),
        why,
    };
    let Some((dir, name)) = url.rsplit_once('/') else {
        return Err(refuse("an archive is a file:// URL".into()));
    };
    let plain = name
        .strip_suffix(ARCHIVE_SUFFIX)
        .is_some_and(|stem| !stem.is_empty() && !stem.starts_with('.'))
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    if !plain {
        return Err(refuse(format!(
            "an archive's name is a plain file name ending in {ARCHIVE_SUFFIX}"
        )));
    }
    // `file:///` alone names no directory to resolve.
    if !dir.starts_with("file:///") {
        return Err(refuse("an archive is a file:///… URL".into()));
    }
    Ok(resolve(Some(dir), root, namespace)?.join(name))
}

/// The archive file of backup `name` in `dir`.
pub fn archive_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}{ARCHIVE_SUFFIX}"))
}

/// The `file://` URL of `path` (an absolute path).
pub fn url_of(path: &Path) -> String {
    format!("file://{}", path.display())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const ROOT: &str = "/var/lib/nestplane/backups";

    fn resolved(location: Option<&str>) -> Result<PathBuf, Refused> {
        resolve(location, Path::new(ROOT), "team-a")
    }

    #[test]
    fn the_namespace_directory_is_the_default_and_its_subdirectories_are_allowed() {
        let own = PathBuf::from(format!("{ROOT}/team-a"));
        assert_eq!(resolved(None).unwrap(), own);
        assert_eq!(resolved(Some("")).unwrap(), own);
        assert_eq!(
            resolved(Some(&format!("file://{ROOT}/team-a"))).unwrap(),
            own
        );
        assert_eq!(
            resolved(Some(&format!("file://{ROOT}/team-a/nightly/"))).unwrap(),
            own.join("nightly")
        );
        assert_eq!(archive_path(&own, "alpha-1"), own.join("alpha-1.npbackup"));
        assert_eq!(
            url_of(&own.join("alpha-1.npbackup")),
            format!("file://{ROOT}/team-a/alpha-1.npbackup")
        );
    }

    #[test]
    fn every_way_out_of_the_namespace_directory_is_refused() {
        for hostile in [
            "file:///etc".to_string(),
            "file:///".to_string(),
            format!("file://{ROOT}"),
            format!("file://{ROOT}/"),
            // Another namespace's directory, and one whose name starts like this one's.
            format!("file://{ROOT}/team-b"),
            format!("file://{ROOT}/team-ab"),
            format!("file://{ROOT}/team-a/../team-b"),
            format!("file://{ROOT}/team-a/./x"),
            format!("file://{ROOT}/team-a//x"),
            format!("file://{ROOT}/team-a/%2e%2e/team-b"),
            format!("file://{ROOT}/team-a/x\ny"),
            format!("file://{ROOT}/team-a/x?y"),
            format!("file://{ROOT}/team-a\\..\\team-b"),
            // A host, a relative path, no scheme, another scheme.
            format!("file://localhost{ROOT}/team-a"),
            "file://team-a".to_string(),
            format!("{ROOT}/team-a"),
            "s3://bucket/team-a".to_string(),
            format!("file://{ROOT}/team-a/{}", "x".repeat(MAX_LEN)),
        ] {
            let err = resolved(Some(&hostile)).expect_err(&hostile);
            assert!(!err.why.is_empty(), "{hostile}");
        }
        let err = resolved(Some(&format!("file://{ROOT}/team-b"))).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "location \"file://{ROOT}/team-b\" refused: backups of namespace team-a go under file://{ROOT}/team-a/"
            )
        );
        // Archives: a plain name in an allowed directory.
        let ok = format!("file://{ROOT}/team-a/nightly/alpha-1.npbackup");
        assert_eq!(
            resolve_archive(&ok, Path::new(ROOT), "team-a").unwrap(),
            PathBuf::from(format!("{ROOT}/team-a/nightly/alpha-1.npbackup"))
        );
        for hostile in [
            format!("file://{ROOT}/team-b/alpha-1.npbackup"),
            format!("file://{ROOT}/team-a/../team-b/alpha-1.npbackup"),
            format!("file://{ROOT}/team-a/.npbackup"),
            format!("file://{ROOT}/team-a/.tmp-x.npbackup"),
            format!("file://{ROOT}/team-a/alpha-1"),
            format!("file://{ROOT}/team-a/../../etc/shadow"),
            format!("file://{ROOT}/team-a/a b.npbackup"),
            "file:///etc/x.npbackup".to_string(),
            "file://x.npbackup".to_string(),
            "x.npbackup".to_string(),
        ] {
            assert!(
                resolve_archive(&hostile, Path::new(ROOT), "team-a").is_err(),
                "{hostile}"
            );
        }
        assert!(
            resolved(Some("s3://bucket/x"))
                .unwrap_err()
                .why
                .contains("not s3://")
        );
    }
}
