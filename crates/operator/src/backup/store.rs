//! Reading and deleting an archive wherever it is: a file under the operator's backup
//! directory, or an object of an `s3://` location.

use std::path::Path;

use kube::ResourceExt;
use nestplane_api::backup::{NestedBackup, S3Access, reasons};

use super::controller::{BackupContext, read_archive};
use super::location::Archive;
use super::s3::{self, Bucket};
use super::{archive, schedule::Removed};
use crate::context::Error;

/// Why an archive's server cannot be used.
#[derive(Debug)]
pub enum Unusable {
    /// Not until the spec changes (no `s3`, an endpoint the operator does not allow).
    Refused(&'static str, String),
    /// Not now (the credentials Secret is missing or incomplete).
    Waiting(&'static str, String),
}

/// How to reach `a`: nothing for a file, a client of its server for an object (`access`
/// says which server, with which credentials of namespace `ns`).
pub async fn reach(
    ctx: &BackupContext,
    ns: &str,
    a: &Archive,
    access: Option<&S3Access>,
) -> Result<Result<Option<Bucket>, Unusable>, Error> {
    if matches!(a, Archive::File(_)) {
        return Ok(Ok(None));
    }
    Ok(
        match s3::bucket_for(&ctx.client, ns, access, &ctx.s3_endpoints).await? {
            Ok(b) => Ok(Some(b)),
            Err((reason @ reasons::INVALID_CREDENTIALS, why)) => {
                Err(Unusable::Waiting(reason, why))
            }
            Err((reason, why)) => Err(Unusable::Refused(reason, why)),
        },
    )
}

/// Why an archive could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// Its server refuses the credentials.
    Denied(String),
    /// Something that is not a file is in its place.
    NotAFile(String),
    /// It is larger than an archive may be.
    TooLarge(String),
    /// It cannot be read now.
    Failed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Denied(why)
            | ReadError::NotAFile(why)
            | ReadError::TooLarge(why)
            | ReadError::Failed(why) => f.write_str(why),
        }
    }
}

/// The longest archive read: twice what an archive may hold.
fn read_limit() -> u64 {
    archive::Limits::default().bytes.saturating_mul(2)
}

/// Archive `a` (its first `first` bytes when given), `None` when there is none.
pub async fn read(
    a: &Archive,
    bucket: Option<&Bucket>,
    first: Option<u64>,
) -> Result<Option<Vec<u8>>, ReadError> {
    match (a, bucket) {
        (Archive::File(path), _) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || match std::fs::symlink_metadata(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(ReadError::Failed(format!("{}: {e}", path.display()))),
                Ok(m) if !m.is_file() => Err(ReadError::NotAFile(format!(
                    "{} exists and is not an archive; it is left as it is",
                    path.display()
                ))),
                Ok(_) => read_archive(&path)
                    .map(|mut b| {
                        if let Some(n) = first {
                            b.truncate(usize::try_from(n).unwrap_or(usize::MAX));
                        }
                        Some(b)
                    })
                    .map_err(ReadError::Failed),
            })
            .await
            .map_err(|e| ReadError::Failed(e.to_string()))?
        }
        (Archive::S3 { bucket: name, key }, Some(bucket)) => bucket
            .get(name, key, first, read_limit())
            .await
            .map_err(|e| match e {
                s3::S3Error::TooLarge(why) => ReadError::TooLarge(why),
                e if e.denied() => ReadError::Denied(e.to_string()),
                e => ReadError::Failed(e.to_string()),
            }),
        (Archive::S3 { .. }, None) => Err(ReadError::Failed(
            "an s3:// archive needs its server".into(),
        )),
    }
}

/// Write `bytes` as `a`, which must not exist (a file of namespace `ns` counted against its
/// quota, 0600, never through a link; an object written with `If-None-Match`).
pub async fn write_new(
    ctx: &BackupContext,
    ns: &str,
    a: &Archive,
    bucket: Option<&Bucket>,
    uid: &str,
    bytes: Vec<u8>,
) -> Result<(), String> {
    match (a, bucket) {
        (Archive::File(path), _) => {
            let (root, ns, quota, path, uid) = (
                ctx.dir.clone(),
                ns.to_string(),
                ctx.quota,
                path.clone(),
                uid.to_string(),
            );
            tokio::task::spawn_blocking(move || {
                super::controller::write_counted(&root, &ns, quota, &path, &uid, &bytes)
            })
            .await
            .map_err(|e| e.to_string())?
        }
        (Archive::S3 { bucket: name, key }, Some(bucket)) => {
            bucket.put_new(name, key, bytes).await.map_err(|e| match e {
                s3::S3Error::Exists => format!("{} exists already", a.url()),
                e => e.to_string(),
            })
        }
        (Archive::S3 { .. }, None) => Err("an s3:// archive needs its server".into()),
    }
}

/// Delete backup `b`'s archive `a`, and its delta segments, if they are its own (their
/// header names the backup's UID), never another's; a file never through a link. An object
/// whose server cannot be used (the endpoint no longer allowed, the credentials gone or
/// refused) is left, and said so. The segments go first, the last first: a pass stopped
/// midway finds the archive, and the rest, again.
pub(super) async fn remove_own(
    ctx: &BackupContext,
    ns: &str,
    b: &NestedBackup,
    a: &Archive,
) -> Removed {
    let uid = b.uid().unwrap_or_default();
    let bucket = match reach(ctx, ns, a, b.spec.s3.as_ref()).await {
        Ok(Ok(bucket)) => bucket,
        Ok(Err(Unusable::Refused(_, why) | Unusable::Waiting(_, why))) => {
            return Removed::Other(format!("{} is left as it is: {why}", a.url()));
        }
        Err(e) => return Removed::Failed(e.to_string()),
    };
    // The last first (as many as the status says, and any written past it), so that a pass
    // stopped midway leaves no segment behind a gap.
    let mut last = b
        .status
        .as_ref()
        .and_then(|s| s.point_in_time.as_ref())
        .map_or(0, |p| p.segments.max(0) as u64)
        .min(super::delta::MAX_SEGMENTS);
    while last < super::delta::MAX_SEGMENTS {
        match read(
            &a.segment(last + 1),
            bucket.as_ref(),
            Some(archive::HEADER_SPAN),
        )
        .await
        {
            Ok(Some(_)) => last += 1,
            Ok(None) => break,
            Err(e) => return Removed::Failed(e.to_string()),
        }
    }
    for sequence in (1..=last).rev() {
        if let failed @ Removed::Failed(_) =
            remove_one(ctx, &a.segment(sequence), bucket.as_ref(), &uid).await
        {
            return failed;
        }
    }
    remove_one(ctx, a, bucket.as_ref(), &uid).await
}

async fn remove_one(
    ctx: &BackupContext,
    a: &Archive,
    bucket: Option<&Bucket>,
    uid: &str,
) -> Removed {
    match (a, bucket) {
        (Archive::File(path), _) => {
            let (root, path, uid) = (ctx.dir.clone(), path.clone(), uid.to_string());
            tokio::task::spawn_blocking(move || {
                super::schedule::remove_own(Path::new(&root), &path, &uid)
            })
            .await
            .unwrap_or_else(|e| Removed::Failed(e.to_string()))
        }
        (Archive::S3 { .. }, None) => Removed::Nothing,
        (Archive::S3 { bucket: name, key }, Some(bucket)) => {
            let head = match bucket
                .get(name, key, Some(archive::HEADER_SPAN), archive::HEADER_SPAN)
                .await
            {
                Ok(Some(head)) => head,
                Ok(None) => return Removed::Nothing,
                // Refused for good (the credentials revoked): left, so that deleting a
                // namespace does not wait on it.
                Err(e) if e.denied() => {
                    return Removed::Other(format!("{} is left as it is: {e}", a.url()));
                }
                Err(e) => return Removed::Failed(e.to_string()),
            };
            match archive::read_header(&head) {
                Ok(h) if !uid.is_empty() && h.id == uid => match bucket.delete(name, key).await {
                    Ok(()) => Removed::Archive(a.url()),
                    Err(e) if e.denied() => {
                        Removed::Other(format!("{} is left as it is: {e}", a.url()))
                    }
                    Err(e) => Removed::Failed(e.to_string()),
                },
                _ => Removed::Other(format!(
                    "{} is not its archive (another backup's, or not an archive); it is left as it is",
                    a.url()
                )),
            }
        }
    }
}
