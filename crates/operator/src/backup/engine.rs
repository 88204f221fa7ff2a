//! One engine for every datastore: read a tenant's keys at one pinned revision, page by page,
//! relative to its key root; write them back under any key root in bounded transactions.
//!
//! A tenant's key root is its API server's `--etcd-prefix` and a `/` ([`key_root`]):
//! `/nestplane/<namespace>/<name>/registry/` on a shared datastore, `/registry/` on an etcd
//! of its own. Archives hold keys relative to it (`pods/default/web-0`), so one taken from
//! either layout restores into the other. It needs
//! only a client that may read and write the tenant's prefix (the tenant's own etcd role is
//! enough), so it serves a tenant's own `NestedEtcd`, a shared `NestedDatastore` and an
//! external etcd alike.
//!
//! A paginated read at one revision is a consistent snapshot of the prefix: every page after
//! the first asks for the first page's revision. If the datastore compacts past it before the
//! last page, the read starts again at a newer revision and says how often it did.

use std::collections::{BTreeMap, BTreeSet};

use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp};

use super::archive::{self, ArchiveError, Lease, Limits, Record};
use crate::datastore::etcd::prefix_end;

/// Keys per page when reading (halved while an answer is larger than the client takes).
pub const PAGE: i64 = 500;
/// Operations per transaction when writing: well under etcd's default limit of 128
/// (`--max-txn-ops`), so a restore is many small writes rather than one the datastore refuses.
pub const TXN_OPS: usize = 64;
/// Keys' and values' bytes per transaction: under etcd's default request limit of 1.5 MiB
/// (`--max-request-bytes`). A single larger value goes alone.
pub const TXN_BYTES: usize = 1 << 20;
/// The shortest and longest life a restored lease gets, in seconds. At least a minute, so a
/// key whose lease was about to end (an Event) is still there when the restore is verified;
/// at most an hour (the API server's `--event-ttl`), so an archive cannot hold leases in a
/// shared datastore for longer than Kubernetes itself would.
pub const LEASE_TTL: (i64, i64) = (60, 3600);
/// Reads started again after a compaction before the engine gives up.
pub const ATTEMPTS: u32 = 5;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("revision {revision} was compacted while the keys were read")]
    Compacted { revision: i64 },
    #[error(
        "the datastore compacted past every read of {attempts} attempts; the last at revision {revision}"
    )]
    CompactedEveryTime { attempts: u32, revision: i64 },
    #[error("etcd: {what}: {source}")]
    Etcd {
        what: &'static str,
        #[source]
        source: Box<etcd_client::Error>,
    },
    #[error(transparent)]
    Archive(#[from] ArchiveError),
    #[error("after the restore the prefix holds {found}, the archive {expected}")]
    Verify { found: String, expected: String },
    #[error("the prefix {0:?} does not end with `/`")]
    Prefix(String),
    #[error("etcd answered without a header, so the read cannot be pinned to a revision")]
    NoRevision,
    #[error("the tenant's prefix holds a key no archive may hold: {0}")]
    UnarchivableKey(ArchiveError),
    #[error("the tenant's keys are more than an archive may hold: {0}")]
    TooLargeToArchive(ArchiveError),
    #[error("the datastore's answer is not valid: {0}")]
    Answer(String),
}

fn etcd(what: &'static str) -> impl FnOnce(etcd_client::Error) -> EngineError {
    move |source| EngineError::Etcd {
        what,
        source: Box::new(source),
    }
}

fn compacted(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("required revision has been compacted"))
}

fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("message length too large"))
}

fn check_prefix(prefix: &str) -> Result<(), EngineError> {
    if prefix.ends_with('/') && prefix.len() > 1 {
        Ok(())
    } else {
        Err(EngineError::Prefix(prefix.to_string()))
    }
}

/// The key root of a tenant whose API server stores under `datastore_prefix` on a shared
/// datastore (`None`: an etcd of its own): its `--etcd-prefix` (as `render` sets it) and `/`.
pub fn key_root(datastore_prefix: Option<&str>) -> String {
    match datastore_prefix {
        Some(p) => format!("{p}registry/"),
        None => "/registry/".to_string(),
    }
}

/// A key as read: relative to the prefix, its value, its lease (0 for none).
#[derive(Debug)]
pub struct Read {
    pub revision: i64,
    pub keys: Vec<(Vec<u8>, Vec<u8>, i64)>,
}

/// Every key under `prefix` at `revision` (the current one when `None`), in key order,
/// `page` keys per request.
pub async fn read_at(
    client: &mut Client,
    prefix: &str,
    revision: Option<i64>,
    page: i64,
) -> Result<Read, EngineError> {
    let unbounded = Limits {
        bytes: u64::MAX,
        keys: u64::MAX,
        leases: usize::MAX,
    };
    read_within(client, prefix, revision, page, &unbounded).await
}

/// [`read_at`], holding no more than `limits`' keys and bytes: past them, what is read is
/// dropped and the read fails once it ends (memory stays bounded whatever the prefix holds).
async fn read_within(
    client: &mut Client,
    prefix: &str,
    revision: Option<i64>,
    page: i64,
    limits: &Limits,
) -> Result<Read, EngineError> {
    let mut keys = Vec::new();
    let (mut count, mut bytes) = (0u64, 0u64);
    let revision = scan(client, prefix, revision, page, false, |rel, kv| {
        count += 1;
        bytes = bytes.saturating_add((rel.len() + kv.value().len()) as u64);
        if count <= limits.keys && bytes <= limits.bytes {
            keys.push((rel.to_vec(), kv.value().to_vec(), kv.lease()));
        } else if !keys.is_empty() {
            keys = Vec::new();
        }
    })
    .await?;
    for (what, found, limit) in [("keys", count, limits.keys), ("bytes", bytes, limits.bytes)] {
        if found > limit {
            return Err(EngineError::TooLargeToArchive(ArchiveError::TooLarge {
                what,
                found,
                limit,
            }));
        }
    }
    Ok(Read { revision, keys })
}

/// Call `f` with each key under `prefix` (relative to it) at `revision` (the current one when
/// `None`), in key order, `page` keys per request (halved while an answer is too large for the
/// client), values left out with `keys_only`; returns the revision read. The datastore's
/// answers are checked, not trusted: every key under the prefix, each after the one before.
async fn scan(
    client: &mut Client,
    prefix: &str,
    revision: Option<i64>,
    page: i64,
    keys_only: bool,
    mut f: impl FnMut(&[u8], &etcd_client::KeyValue),
) -> Result<i64, EngineError> {
    check_prefix(prefix)?;
    let end = prefix_end(prefix);
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = revision;
    let mut page = page.max(1);
    let mut last: Option<Vec<u8>> = None;
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(page);
        if keys_only {
            opts = opts.with_keys_only();
        }
        if let Some(r) = revision {
            opts = opts.with_revision(r);
        }
        let resp = match client.get(from.clone(), Some(opts)).await {
            Ok(r) => r,
            Err(e) if too_large(&e) && page > 1 => {
                page /= 2;
                continue;
            }
            Err(e) if compacted(&e) => {
                return Err(EngineError::Compacted {
                    revision: revision.unwrap_or_default(),
                });
            }
            Err(e) => return Err(etcd("reading the tenant's keys")(e)),
        };
        if revision.is_none() {
            revision = Some(
                resp.header()
                    .map(|h| h.revision())
                    .ok_or(EngineError::NoRevision)?,
            );
        }
        for kv in resp.kvs() {
            let key = kv.key();
            if !key.starts_with(prefix.as_bytes())
                || key >= &end[..]
                || last.as_deref().is_some_and(|l| l >= key)
            {
                return Err(EngineError::Answer(format!(
                    "key {:?} is not under {prefix:?} after the one before",
                    String::from_utf8_lossy(&key[..key.len().min(200)])
                )));
            }
            f(&key[prefix.len()..], kv);
            last = Some(key.to_vec());
        }
        match resp.kvs().last() {
            Some(l) if resp.more() => {
                from = l.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    Ok(revision.unwrap_or_default())
}

/// A tenant's keys at one revision, ready for an archive.
#[derive(Debug)]
pub struct Snapshot {
    pub revision: i64,
    pub records: Vec<Record>,
    /// How many reads were started again because the datastore compacted past them.
    pub restarts: u32,
}

/// Read every key under `prefix` at one revision, with each lease's remaining TTL (read just
/// after; a lease that has ended since says 1 s). A key that no archive may hold (see
/// [`archive::check_key`]) fails the export rather than make an archive that cannot be
/// restored.
pub async fn export(
    client: &mut Client,
    prefix: &str,
    page: i64,
    limits: &Limits,
) -> Result<Snapshot, EngineError> {
    export_from(client, prefix, page, limits, None).await
}

/// [`export`], with the first read at `first` (the current revision when `None`); every read
/// after a compaction is at the current revision.
pub(crate) async fn export_from(
    client: &mut Client,
    prefix: &str,
    page: i64,
    limits: &Limits,
    first: Option<i64>,
) -> Result<Snapshot, EngineError> {
    let mut restarts = 0;
    let mut at = first;
    let read = loop {
        match read_within(client, prefix, at.take(), page, limits).await {
            Ok(r) => break r,
            Err(EngineError::Compacted { revision }) => {
                restarts += 1;
                if restarts >= ATTEMPTS {
                    return Err(EngineError::CompactedEveryTime {
                        attempts: restarts,
                        revision,
                    });
                }
                tracing::info!(
                    prefix,
                    revision,
                    "compacted during a backup's read; reading again"
                );
            }
            Err(e) => return Err(e),
        }
    };
    for (key, _, _) in &read.keys {
        archive::check_key(key).map_err(EngineError::UnarchivableKey)?;
    }
    let mut ttls = BTreeMap::new();
    for &(_, _, lease) in &read.keys {
        if lease != 0 && !ttls.contains_key(&lease) {
            // etcd answers -1 for a lease that has ended since: no time left.
            let ttl = client
                .lease_time_to_live(lease, None)
                .await
                .map_err(etcd("reading a lease's time to live"))?
                .ttl();
            ttls.insert(lease, ttl.max(1));
        }
    }
    let records: Vec<Record> = read
        .keys
        .into_iter()
        .map(|(key, value, lease)| Record {
            key,
            value,
            lease: (lease != 0).then(|| Lease {
                id: lease,
                ttl: ttls[&lease],
            }),
        })
        .collect();
    // What a restore would refuse is refused here, rather than found out then.
    archive::check_records(&records, limits).map_err(EngineError::TooLargeToArchive)?;
    Ok(Snapshot {
        revision: read.revision,
        records,
        restarts,
    })
}

/// What a restore did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub written: u64,
    pub deleted: u64,
    pub leases: u64,
    pub transactions: u64,
    /// The digest of the prefix afterwards (equal to the archive's).
    pub digest: String,
}

/// The digest of everything under `prefix` now (see [`archive::digest`]), and its key count.
pub async fn digest_of(client: &mut Client, prefix: &str) -> Result<(String, u64), EngineError> {
    let mut digest = archive::Digest::default();
    let mut keys = 0u64;
    scan(client, prefix, None, PAGE, false, |rel, kv| {
        digest.add(rel, kv.value());
        keys += 1;
    })
    .await?;
    Ok((digest.finish(), keys))
}

/// Make `prefix` hold exactly `records` (opened and verified by [`archive::decode`]). First,
/// before anything is read or written: the records as a whole ([`archive::check_records`] with
/// `limits`). Then the records are put and the keys the archive does not have are
/// deleted, at most [`TXN_OPS`] operations and [`TXN_BYTES`] per transaction; keys that
/// shared a lease share a new one, granted just before its first key is written, with the
/// TTL they had left within [`LEASE_TTL`] (keys on leases are written last, and their leases
/// renewed before the check). Then the prefix's digest must equal the records' own.
///
/// Its callers stop the tenant's API server first: a restore is not atomic to a reader, only
/// complete once it returns. Run again, it gives the same keys and values (the leases of the
/// run before end by themselves, within [`LEASE_TTL`]). On an error, the leases it granted
/// are revoked.
pub async fn restore(
    client: &mut Client,
    prefix: &str,
    records: &[Record],
    limits: &Limits,
) -> Result<Restored, EngineError> {
    check_prefix(prefix)?;
    archive::check_records(records, limits)?;
    let digest = archive::digest(records.iter().map(|r| (&r.key[..], &r.value[..])));
    let mut granted = BTreeMap::new();
    let result = write_and_verify(client, prefix, records, &digest, &mut granted).await;
    if result.is_err() {
        for id in granted.values() {
            let _ = client.lease_revoke(*id).await;
        }
    }
    result
}

async fn write_and_verify(
    client: &mut Client,
    prefix: &str,
    records: &[Record],
    digest: &str,
    granted: &mut BTreeMap<i64, i64>,
) -> Result<Restored, EngineError> {
    let keep: BTreeSet<&[u8]> = records.iter().map(|r| &r.key[..]).collect();
    let mut gone: Vec<Vec<u8>> = Vec::new();
    scan(client, prefix, None, PAGE, true, |rel, _| {
        if !keep.contains(rel) {
            gone.push(rel.to_vec());
        }
    })
    .await?;
    drop(keep);
    let mut out = Restored::default();
    let full_key = |rel: &[u8]| {
        let mut k = prefix.as_bytes().to_vec();
        k.extend_from_slice(rel);
        k
    };
    enum Op<'a> {
        Put(&'a Record),
        Delete(&'a [u8]),
    }
    // Keys on leases last, their leases granted just before them: the clock of a lease (the
    // API server's own is 15 s) starts as late as it can, whatever the size of the rest.
    let ops = records
        .iter()
        .filter(|r| r.lease.is_none())
        .map(Op::Put)
        .chain(gone.iter().map(|rel| Op::Delete(&rel[..])))
        .chain(records.iter().filter(|r| r.lease.is_some()).map(Op::Put));
    let mut chunk: Vec<TxnOp> = Vec::new();
    let mut chunk_bytes = 0usize;
    for op in ops {
        let size = match &op {
            Op::Put(r) => r.key.len() + r.value.len(),
            Op::Delete(rel) => rel.len(),
        } + prefix.len();
        if !chunk.is_empty() && (chunk.len() >= TXN_OPS || chunk_bytes + size > TXN_BYTES) {
            commit(client, std::mem::take(&mut chunk), &mut out).await?;
            chunk_bytes = 0;
        }
        chunk_bytes += size;
        match op {
            Op::Put(r) => {
                let opts = match r.lease {
                    Some(l) => Some(PutOptions::new().with_lease(lease(client, l, granted).await?)),
                    None => None,
                };
                chunk.push(TxnOp::put(full_key(&r.key), r.value.clone(), opts));
                out.written += 1;
            }
            Op::Delete(rel) => {
                chunk.push(TxnOp::delete(full_key(rel), None));
                out.deleted += 1;
            }
        }
    }
    if !chunk.is_empty() {
        commit(client, chunk, &mut out).await?;
    }
    out.leases = granted.len() as u64;

    // Renewed once more, so a long verification still finds every leased key there.
    for id in granted.values() {
        let (mut keeper, mut answers) = client
            .lease_keep_alive(*id)
            .await
            .map_err(etcd("renewing a lease"))?;
        keeper
            .keep_alive()
            .await
            .map_err(etcd("renewing a lease"))?;
        let _ = answers.message().await;
    }
    let (found, _) = digest_of(client, prefix).await?;
    if found != digest {
        return Err(EngineError::Verify {
            found,
            expected: digest.to_string(),
        });
    }
    out.digest = found;
    Ok(out)
}

/// The lease in the datastore for the source's lease `l`: granted the first time.
async fn lease(
    client: &mut Client,
    l: Lease,
    granted: &mut BTreeMap<i64, i64>,
) -> Result<i64, EngineError> {
    if let Some(id) = granted.get(&l.id) {
        return Ok(*id);
    }
    let ttl = l.ttl.clamp(LEASE_TTL.0, LEASE_TTL.1);
    let id = client
        .lease_grant(ttl, None)
        .await
        .map_err(etcd("granting a lease"))?
        .id();
    granted.insert(l.id, id);
    Ok(id)
}

async fn commit(
    client: &mut Client,
    ops: Vec<TxnOp>,
    out: &mut Restored,
) -> Result<(), EngineError> {
    client
        .txn(Txn::new().and_then(ops))
        .await
        .map_err(etcd("writing the tenant's keys"))?;
    out.transactions += 1;
    Ok(())
}

#[cfg(test)]
mod key_root_tests {
    use super::key_root;

    /// The API server's `--etcd-prefix` and a `/`: on a shared datastore under the tenant's
    /// prefix (`crates/render`, `components.rs`), else etcd's default `/registry`.
    #[test]
    fn a_key_root_is_where_the_api_server_keeps_its_objects() {
        assert_eq!(
            key_root(Some("/nestplane/ns/a/")),
            "/nestplane/ns/a/registry/"
        );
        assert_eq!(key_root(None), "/registry/");
    }
}
