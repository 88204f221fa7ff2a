//! Where a backup's archive may go, decided before anything is read or written. Pure.
//!
//! A location is a `file://` URL of a directory, or an `s3://bucket/prefix` URL. The
//! operator writes archives only under its backup directory, and a backup of namespace `ns`
//! only under `<backup dir>/ns/`: a namespace user names a location, and may not make the
//! operator write or read anywhere else on its machine, nor in another namespace's
//! directory. In S3, what a namespace may reach is what its own credentials may (see
//! [`super::s3`]); its bucket and key are checked here to be plain.

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

/// Where archives go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A directory on the operator's machine.
    Dir(PathBuf),
    /// A bucket, and a prefix (empty, or ending in `/`).
    S3 { bucket: String, prefix: String },
}

/// One archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Archive {
    /// A file on the operator's machine.
    File(PathBuf),
    /// An object.
    S3 { bucket: String, key: String },
}

impl Location {
    /// The archive of backup `name` here.
    pub fn archive(&self, name: &str) -> Archive {
        match self {
            Location::Dir(dir) => Archive::File(archive_path(dir, name)),
            Location::S3 { bucket, prefix } => Archive::S3 {
                bucket: bucket.clone(),
                key: format!("{prefix}{name}{ARCHIVE_SUFFIX}"),
            },
        }
    }
}

impl Archive {
    /// Delta segment `sequence` of this archive's backup, beside it:
    /// `<name>.d000001.npdelta`.
    pub fn segment(&self, sequence: u64) -> Archive {
        let named = |name: &str| {
            format!(
                "{}.d{sequence:06}{}",
                name.strip_suffix(ARCHIVE_SUFFIX).unwrap_or(name),
                super::delta::SEGMENT_SUFFIX
            )
        };
        match self {
            Archive::File(p) => Archive::File(
                p.with_file_name(named(&p.file_name().unwrap_or_default().to_string_lossy())),
            ),
            Archive::S3 { bucket, key } => Archive::S3 {
                bucket: bucket.clone(),
                key: named(key),
            },
        }
    }

    /// Its URL (`file:///…` or `s3://bucket/key`).
    pub fn url(&self) -> String {
        match self {
            Archive::File(p) => url_of(p),
            Archive::S3 { bucket, key } => format!("s3://{bucket}/{key}"),
        }
    }
}

/// Whether `s` is a plain bucket name: 3 to 63 of `a-z0-9.-`, a letter or digit at each end.
fn plain_bucket(s: &str) -> bool {
    (3..=63).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
        && !s.contains("..")
}

/// `s3://bucket[/a/b/]` as a bucket and a prefix (`""` or `"a/b/"`): every segment of
/// `A-Za-z0-9-._`, none empty, `.` or `..`.
fn parse_s3(given: &str) -> Result<(String, String), String> {
    let rest = given
        .strip_prefix("s3://")
        .ok_or_else(|| "an S3 location is s3://bucket[/prefix]".to_string())?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if !plain_bucket(bucket) {
        return Err(format!(
            "{bucket:?} is not a bucket name (3 to 63 of a-z, 0-9, `.` and `-`)"
        ));
    }
    let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
    if prefix.is_empty() {
        return Ok((bucket.to_string(), String::new()));
    }
    for s in prefix.split('/') {
        if s.is_empty()
            || s == "."
            || s == ".."
            || !s
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        {
            return Err(
                "an S3 prefix's segments are of A-Z, a-z, 0-9, `-`, `.` and `_`, and none is empty, `.` or `..`"
                    .into(),
            );
        }
    }
    Ok((bucket.to_string(), format!("{prefix}/")))
}

/// Where `location` is: [`resolve`] for a directory, or an `s3://` bucket and prefix.
pub fn locate(location: Option<&str>, root: &Path, namespace: &str) -> Result<Location, Refused> {
    match location {
        Some(given) if given.starts_with("s3://") => {
            if given.len() > MAX_LEN {
                return Err(Refused {
                    given: nestplane_api::conditions::cut(given, 200),
                    why: format!("longer than {MAX_LEN} bytes"),
                });
            }
            parse_s3(given)
                .map(|(bucket, prefix)| Location::S3 { bucket, prefix })
                .map_err(|why| Refused {
                    given: nestplane_api::conditions::cut(given, 200),
                    why,
                })
        }
        _ => resolve(location, root, namespace).map(Location::Dir),
    }
}

/// The archive at `url`: [`resolve_archive`] for a file, or an `s3://bucket/prefix/name`
/// object of a plain name.
pub fn locate_archive(url: &str, root: &Path, namespace: &str) -> Result<Archive, Refused> {
    if !url.starts_with("s3://") {
        return resolve_archive(url, root, namespace).map(Archive::File);
    }
    let refuse = |why: String| Refused {
        given: nestplane_api::conditions::cut(url, 200),
        why,
    };
    let Some((dir, name)) = url.rsplit_once('/').filter(|(d, _)| *d != "s3:/") else {
        return Err(refuse(
            "an archive is s3://bucket/[prefix/]name.npbackup".into(),
        ));
    };
    if !plain_name(name) {
        return Err(refuse(format!(
            "an archive's name is a plain file name ending in {ARCHIVE_SUFFIX}"
        )));
    }
    let stem = &name[..name.len() - ARCHIVE_SUFFIX.len()];
    match locate(Some(dir), root, namespace)? {
        l @ Location::S3 { .. } => Ok(l.archive(stem)),
        Location::Dir(_) => Err(refuse("not an s3:// URL".into())),
    }
}

/// Whether `name` is a plain archive file name.
fn plain_name(name: &str) -> bool {
    name.strip_suffix(ARCHIVE_SUFFIX)
        .is_some_and(|stem| !stem.is_empty() && !stem.starts_with('.'))
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
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
            "a location is a file:// or s3:// URL, not {scheme}://"
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
    if !plain_name(name) {
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

    #[test]
    fn s3_locations_name_a_plain_bucket_and_prefix() {
        let root = Path::new(ROOT);
        let loc = locate(Some("s3://backups/team-a/nightly/"), root, "team-a").unwrap();
        assert_eq!(
            loc,
            Location::S3 {
                bucket: "backups".into(),
                prefix: "team-a/nightly/".into()
            }
        );
        let a = loc.archive("alpha-1");
        assert_eq!(a.url(), "s3://backups/team-a/nightly/alpha-1.npbackup");
        assert_eq!(
            a.segment(12).url(),
            "s3://backups/team-a/nightly/alpha-1.d000012.npdelta"
        );
        assert_eq!(
            Location::Dir(PathBuf::from("/b/ns"))
                .archive("x")
                .segment(1),
            Archive::File(PathBuf::from("/b/ns/x.d000001.npdelta"))
        );
        assert_eq!(locate_archive(&a.url(), root, "team-a").unwrap(), a);
        assert_eq!(
            locate(Some("s3://backups"), root, "team-a")
                .unwrap()
                .archive("x")
                .url(),
            "s3://backups/x.npbackup"
        );
        for hostile in [
            "s3://",
            "s3://Backups/x",
            "s3://ab/x",
            "s3://-backups/x",
            "s3://back..ups/x",
            "s3://backups/../x",
            "s3://backups/a//b",
            "s3://backups/./b",
            "s3://backups/a b",
            "s3://backups/a%2e%2e",
            "s3://backups/a?x",
            "s3://backups/a#x",
            "s3://backups/a\\b",
        ] {
            assert!(locate(Some(hostile), root, "team-a").is_err(), "{hostile}");
        }
        for hostile in [
            "s3://backups/x",
            "s3://backups/.npbackup",
            "s3://backups/../x.npbackup",
            "s3://x.npbackup",
            "s3:///x.npbackup",
        ] {
            assert!(
                locate_archive(hostile, root, "team-a").is_err(),
                "{hostile}"
            );
        }
        // A file:// URL still goes through the directory's rules.
        assert!(locate_archive("file:///etc/x.npbackup", root, "team-a").is_err());
    }
}
