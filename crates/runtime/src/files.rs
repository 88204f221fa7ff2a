//! Files that hold keys: created with mode 0600 from the first byte (never written first and
//! restricted after), replaced atomically, and directories that hold them 0700.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::egress::User;

/// Write `data` to `path` so that no other user can ever read it: the bytes go to a temporary
/// file with a random name in the same directory, created with mode 0600 (`O_CREAT|O_EXCL`,
/// by `tempfile`), then renamed over `path`; two writers never share a temporary file.
/// Nothing is written when `path` already holds `data`.
pub fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    write_private_as(path, data, None)
}

/// [`write_private`], the file owned by `owner` (a tenant's user) from before it has its name;
/// a file that holds `data` already but has another owner changes owner only.
pub fn write_private_as(path: &Path, data: &[u8], owner: Option<User>) -> std::io::Result<()> {
    // The length first: a tenant's user owns its files and could make one huge (sparse).
    let same = std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.is_file() && m.len() == data.len() as u64)
        && std::fs::read(path).ok().as_deref() == Some(data);
    if same {
        let meta = std::fs::symlink_metadata(path)?;
        match owner {
            Some(u) if (meta.uid(), meta.gid()) != (u.uid, u.gid) => {
                return std::os::unix::fs::lchown(path, Some(u.uid), Some(u.gid));
            }
            _ => return Ok(()),
        }
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    // A short name: a Secret's key may itself be 253 bytes long.
    let mut tmp = tempfile::Builder::new()
        .prefix(".np-")
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)?;
    // The mode given to open() is masked by the umask; it can only lose bits, so 0600 stays
    // 0600 or less. Assert it rather than trust it.
    let mode = tmp.as_file().metadata()?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(std::io::Error::other(format!(
            "{} was created with mode {mode:o}",
            tmp.path().display()
        )));
    }
    if let Some(u) = owner {
        std::os::unix::fs::fchown(tmp.as_file(), Some(u.uid), Some(u.gid))?;
    }
    tmp.write_all(data)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map(|_| ()).map_err(|e| e.error)
}

/// Create `dir` (and its parents) and restrict it to its owner (0700).
pub fn mkdir_private(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Create `dir` owned by the caller, that `user` may enter and read but not change (group
/// `user`'s, mode 0750); without a user, [`mkdir_private`].
pub fn mkdir_readable_by(dir: &Path, user: Option<User>) -> std::io::Result<()> {
    mkdir_private(dir)?;
    if let Some(u) = user {
        // Owned by the caller again, whoever owned it before (a directory the user once
        // wrote in, e.g. an emptyDir that became a Secret's volume, is theirs no more).
        std::os::unix::fs::lchown(dir, Some(rustix::process::geteuid().as_raw()), Some(u.gid))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))?;
    }
    Ok(())
}

/// Create `dir` (0700) for `user` to write in: owned by the user, and so is everything in it
/// (what was there before belonged to the caller, e.g. an etcd data directory from before
/// tenants had users). Symbolic links are never followed.
pub fn mkdir_owned_by(dir: &Path, user: Option<User>) -> std::io::Result<()> {
    mkdir_private(dir)?;
    let Some(u) = user else { return Ok(()) };
    let meta = std::fs::symlink_metadata(dir)?;
    if (meta.uid(), meta.gid()) == (u.uid, u.gid) {
        return Ok(());
    }
    chown_tree(dir, u)
}

/// The directory itself last: a walk cut short is done again next time.
fn chown_tree(path: &Path, u: User) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path)?.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), u)?;
        }
    }
    std::os::unix::fs::lchown(path, Some(u.uid), Some(u.gid))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn key_files_are_0600_and_replaced_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tls.key");
        write_private(&path, b"one").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        write_private(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("tls.key")]);
    }

    #[test]
    fn two_writers_never_tear_each_others_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("admin.kubeconfig");
        let one = vec![b'1'; 64 * 1024];
        let two = vec![b'2'; 64 * 1024];
        std::thread::scope(|s| {
            for data in [&one, &two] {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..100 {
                        write_private(path, data).unwrap();
                    }
                });
            }
        });
        let got = std::fs::read(&path).unwrap();
        assert!(got == one || got == two, "a whole file from one writer");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn the_file_never_exists_with_a_wider_mode() {
        // An existing file with a wide mode is replaced by a new 0600 inode, not chmodded in
        // place after the write (a reader holding the old inode never sees the new bytes).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.key");
        std::fs::write(&path, b"old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut reader = std::fs::File::open(&path).unwrap();
        write_private(&path, b"secret").unwrap();
        let mut seen = String::new();
        std::io::Read::read_to_string(&mut reader, &mut seen).unwrap();
        assert_eq!(
            seen, "old",
            "the world-readable inode never held the new key"
        );
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}
