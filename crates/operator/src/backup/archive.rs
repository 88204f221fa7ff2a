//! The backup archive: one tenant's keys at one revision, relative to the tenant's prefix,
//! compressed and sealed with a key the user holds. Pure: bytes in, values out.
//!
//! ```text
//! magic       "NPBACKUP1\n"                     10 bytes
//! header len  u32, big-endian                    4 bytes
//! header      JSON (Header), in the clear: a listing reads it without the key
//! nonce       12 random bytes
//! sealed      ChaCha20-Poly1305 over gzip(records, trust); the magic, length and header
//!             are its associated data, so changing any byte of the file fails the whole
//!             archive
//! ```
//!
//! A record is `u32 key length, key, u32 value length, value, i64 lease, i64 ttl` (big-endian;
//! `lease` is the etcd lease the key was attached to in the source, 0 for none, and `ttl` its
//! remaining seconds then). Keys are relative to the tenant's prefix, so an archive can be
//! restored under any prefix, and each one is checked before anything is written: an archive
//! is input its holder controls, and so is its key. What it may hold is bounded before it is
//! inflated ([`Limits`]).
//!
//! The trust (the tenant's CAs and service-account key, [`Trust`]) follows the records as
//! JSON of exactly the header's `trustBytes`, so that what was issued before a backup still
//! verifies after a restore; it is sealed like the records, never in the clear.

use std::io::{Read, Write};

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The first bytes of every archive (and its format version).
pub const MAGIC: &[u8] = b"NPBACKUP1\n";
/// The length of the key an archive is sealed with.
pub const KEY_LEN: usize = 32;
const NONCE_LEN: usize = 12;
/// The longest header accepted (a header is a few hundred bytes).
const MAX_HEADER: u32 = 64 * 1024;
/// How many of an archive's first bytes hold its header, at most ([`read_header`] of them).
pub const HEADER_SPAN: u64 = (MAGIC.len() + 4) as u64 + MAX_HEADER as u64;
/// What each record costs besides its key and value: two lengths, a lease and a TTL.
const RECORD_OVERHEAD: u64 = 4 + 4 + 8 + 8;
/// The longest key accepted (the API server's keys are well under 1 KiB).
pub const MAX_KEY: usize = 4096;
/// The most trust an archive may hold (a few CAs and a key: a few KiB).
pub const MAX_TRUST: u64 = 1 << 20;

/// A tenant's trust: the data of its CA and service-account key Secrets, by the Secret's
/// purpose (the suffix after the cluster name: `ca`, `etcd`, `proxy`, `sa`), each its keys
/// and their text (`tls.crt`, `tls.key`, …).
pub type Trust = std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>;

/// What an archive may hold, checked against its header before anything is inflated and
/// against its records as they are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Keys' and values' bytes (a tenant cannot store more than its datastore's quota).
    pub bytes: u64,
    /// Keys.
    pub keys: u64,
    /// Distinct leases: each costs a lease in the datastore on a restore. The API server puts
    /// Events on leases it reuses for a minute (`--lease-reuse-duration-seconds`), so an hour
    /// of Events (`--event-ttl`) needs about 60.
    pub leases: usize,
}

impl Default for Limits {
    /// 2 GiB (etcd's default backend quota), 2 million keys, 1,000 leases.
    fn default() -> Self {
        Limits {
            bytes: 2 << 30,
            keys: 2_000_000,
            leases: 1_000,
        }
    }
}

/// What the archive says about itself, readable without the key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Header {
    /// The control plane the keys came from (`namespace/name`).
    pub tenant: String,
    /// Its Kubernetes version then.
    pub kubernetes_version: String,
    /// The datastore revision the keys were read at.
    pub revision: i64,
    /// How many keys.
    pub keys: u64,
    /// Their keys' and values' bytes.
    pub bytes: u64,
    /// The records' [`digest`], keyed: HMAC-SHA-256 under a key derived from the archive's
    /// key (`hmac-sha256:` and 64 hex digits). Whoever holds the key can check it; whoever
    /// holds only the file learns nothing about the records from it (a plain hash would let
    /// them confirm a guess, or see that two archives hold the same data).
    pub digest: String,
    /// When it was taken (RFC 3339).
    pub created: String,
    /// The backup object it was taken for (its UID), so that an operator that wrote the
    /// file and stopped before saying so knows the file as its own. Authenticated like the
    /// rest of the header.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// The sealed trust's length (JSON after the records; 0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub trust_bytes: u64,
    /// Empty for a backup; `delta` for a delta segment ([`super::delta`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
    /// A delta segment's place in its backup's chain (from 1).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sequence: u64,
    /// The revision the chain stood at before a delta segment.
    #[serde(default, skip_serializing_if = "is_zero_i64")]
    pub since: i64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_i64(n: &i64) -> bool {
    *n == 0
}

/// An archive, opened.
#[derive(Debug)]
pub struct Opened {
    pub header: Header,
    pub records: Vec<Record>,
    pub trust: Trust,
}

/// One key, relative to the tenant's prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The lease the key was attached to in the source (its ID there, and the seconds it had
    /// left), so that keys sharing a lease share one again after a restore.
    pub lease: Option<Lease>,
}

/// A lease as it was when the keys were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lease {
    pub id: i64,
    pub ttl: i64,
}

/// Why an archive was not read or a key not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArchiveError {
    #[error("not a nestplane backup archive (its first bytes are not {:?})", String::from_utf8_lossy(MAGIC).trim_end())]
    NotAnArchive,
    #[error("the archive ends early: {0}")]
    Truncated(&'static str),
    #[error("the archive's header is not valid: {0}")]
    Header(String),
    #[error(
        "the archive does not open with this key: the key is not the one it was sealed with, or the file was changed"
    )]
    Sealed,
    #[error("the archive's records are not valid: {0}")]
    Records(String),
    #[error(
        "the archive's records do not match its header: {what} is {found}, the header says {expected}"
    )]
    Mismatch {
        what: &'static str,
        found: String,
        expected: String,
    },
    #[error(
        "the archive holds a key that is not a plain key under the tenant's prefix ({key:?}): {why}"
    )]
    Key { key: String, why: &'static str },
    #[error("the key that seals archives must be {KEY_LEN} bytes, not {0}")]
    KeyLength(usize),
    #[error("the archive holds more than is allowed: {what} {found}, at most {limit}")]
    TooLarge {
        what: &'static str,
        found: u64,
        limit: u64,
    },
    #[error("no random nonce: the system's random source failed")]
    Random,
}

/// Accept `key` (relative to a tenant's prefix) only if prefixing it can name nothing but a
/// key of that tenant as its API server writes them: not empty, not absolute, no `.` or `..`
/// segment, no empty segment, no control characters, at most [`MAX_KEY`] bytes.
pub fn check_key(key: &[u8]) -> Result<(), ArchiveError> {
    let refuse = |why| {
        Err(ArchiveError::Key {
            key: String::from_utf8_lossy(&key[..key.len().min(200)]).into_owned(),
            why,
        })
    };
    if key.is_empty() {
        return refuse("it is empty");
    }
    if key.len() > MAX_KEY {
        return refuse("it is longer than any key an API server writes");
    }
    if key[0] == b'/' {
        return refuse("it is absolute");
    }
    if key.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return refuse("it holds a control character");
    }
    for segment in key.split(|&b| b == b'/') {
        match segment {
            b"" => return refuse("it has an empty segment"),
            b"." | b".." => return refuse("it has a `.` or `..` segment"),
            _ => {}
        }
    }
    Ok(())
}

/// Check `records` as a whole before any is written: every key (see [`check_key`]), keys in
/// strictly increasing order (so none appears twice), and no more than `limits` allow.
pub fn check_records(records: &[Record], limits: &Limits) -> Result<(), ArchiveError> {
    let mut bytes = 0u64;
    let mut leases = std::collections::BTreeSet::new();
    for (i, r) in records.iter().enumerate() {
        check_key(&r.key)?;
        if i > 0 && records[i - 1].key >= r.key {
            return Err(ArchiveError::Records(
                "keys are not in order, or one appears twice".into(),
            ));
        }
        bytes = bytes.saturating_add((r.key.len() + r.value.len()) as u64);
        if let Some(l) = r.lease {
            leases.insert(l.id);
        }
    }
    for (what, found, limit) in [
        ("keys", records.len() as u64, limits.keys),
        ("bytes", bytes, limits.bytes),
        ("leases", leases.len() as u64, limits.leases as u64),
    ] {
        if found > limit {
            return Err(ArchiveError::TooLarge { what, found, limit });
        }
    }
    Ok(())
}

/// A digest of keys and values, one at a time (see [`digest`]).
#[derive(Default)]
pub struct Digest(Sha256);

impl Digest {
    /// Add one key and its value.
    pub fn add(&mut self, key: &[u8], value: &[u8]) {
        self.0.update((key.len() as u64).to_be_bytes());
        self.0.update(key);
        self.0.update((value.len() as u64).to_be_bytes());
        self.0.update(value);
    }

    /// `sha256:` and 64 hex digits.
    pub fn finish(self) -> String {
        format!("sha256:{}", hex(&self.0.finalize()))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The digest of `records` (in the order given): SHA-256 over each key's and value's length
/// and bytes. Leases are left out: a restored key has a new lease with the same keys and
/// values, and the digest says the data is the same.
pub fn digest<'a>(records: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> String {
    let mut d = Digest::default();
    for (k, v) in records {
        d.add(k, v);
    }
    d.finish()
}

/// [`digest`] keyed for the header: HMAC-SHA-256 of it under a key derived from `key` (the
/// archive's own key is not used for two things).
pub fn keyed_digest(key: &[u8], digest: &str) -> String {
    let derive = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let derived = ring::hmac::sign(&derive, b"nestplane backup: header digest key v1");
    let mac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref());
    format!(
        "hmac-sha256:{}",
        hex(ring::hmac::sign(&mac, digest.as_bytes()).as_ref())
    )
}

/// The header for `records` read at `revision` from `tenant` (its digest is filled in by
/// [`encode`], with the key).
pub fn header_for(
    tenant: &str,
    kubernetes_version: &str,
    revision: i64,
    created: &str,
    records: &[Record],
) -> Header {
    Header {
        tenant: tenant.to_string(),
        kubernetes_version: kubernetes_version.to_string(),
        revision,
        keys: records.len() as u64,
        bytes: records
            .iter()
            .map(|r| (r.key.len() + r.value.len()) as u64)
            .sum(),
        digest: String::new(),
        created: created.to_string(),
        id: String::new(),
        trust_bytes: 0,
        kind: String::new(),
        sequence: 0,
        since: 0,
    }
}

fn sealing_key(key: &[u8]) -> Result<LessSafeKey, ArchiveError> {
    if key.len() != KEY_LEN {
        return Err(ArchiveError::KeyLength(key.len()));
    }
    let unbound =
        UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| ArchiveError::KeyLength(key.len()))?;
    Ok(LessSafeKey::new(unbound))
}

/// The archive of `records` under `header` (made by [`header_for`]), sealed with `key`
/// ([`KEY_LEN`] bytes) and a random nonce (so one key seals many archives safely).
pub fn encode(header: &Header, records: &[Record], key: &[u8]) -> Result<Vec<u8>, ArchiveError> {
    encode_with(header, records, &Trust::new(), key)
}

/// [`encode`], with the tenant's `trust` sealed after the records.
pub fn encode_with(
    header: &Header,
    records: &[Record],
    trust: &Trust,
    key: &[u8],
) -> Result<Vec<u8>, ArchiveError> {
    let trust_json = if trust.is_empty() {
        Vec::new()
    } else {
        serde_json::to_vec(trust).expect("a map of strings serializes")
    };
    check_trust_len(trust_json.len() as u64)?;
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| ArchiveError::Random)?;
    let mut header = header.clone();
    header.digest = keyed_digest(
        key,
        &digest(records.iter().map(|r| (&r.key[..], &r.value[..]))),
    );
    header.trust_bytes = trust_json.len() as u64;
    seal(&header, &compress(records, &trust_json), key, nonce)
}

fn check_trust_len(n: u64) -> Result<(), ArchiveError> {
    if n > MAX_TRUST {
        return Err(ArchiveError::TooLarge {
            what: "trust bytes",
            found: n,
            limit: MAX_TRUST,
        });
    }
    Ok(())
}

/// The records and the trust, gzipped.
fn compress(records: &[Record], trust_json: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut put = |bytes: &[u8]| gz.write_all(bytes).expect("writing to memory");
    for r in records {
        put(&(r.key.len() as u32).to_be_bytes());
        put(&r.key);
        put(&(r.value.len() as u32).to_be_bytes());
        put(&r.value);
        let lease = r.lease.unwrap_or(Lease { id: 0, ttl: 0 });
        put(&lease.id.to_be_bytes());
        put(&lease.ttl.to_be_bytes());
    }
    put(trust_json);
    gz.finish().expect("writing to memory")
}

/// The archive of `header` and `compressed` sealed with `key` and `nonce`.
fn seal(
    header: &Header,
    compressed: &[u8],
    key: &[u8],
    nonce: [u8; NONCE_LEN],
) -> Result<Vec<u8>, ArchiveError> {
    let sealing = sealing_key(key)?;
    let mut sealed = compressed.to_vec();
    let header_json = serde_json::to_vec(header).expect("a header serializes");
    let mut out =
        Vec::with_capacity(MAGIC.len() + 4 + header_json.len() + NONCE_LEN + sealed.len() + 16);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header_json.len() as u32).to_be_bytes());
    out.extend_from_slice(&header_json);
    sealing
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&out[..]),
            &mut sealed,
        )
        .map_err(|_| ArchiveError::Sealed)?;
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    Ok(out)
}

/// The header of `archive` and where its nonce starts, without opening it.
fn split_header(archive: &[u8]) -> Result<(Header, usize), ArchiveError> {
    if !archive.starts_with(MAGIC) {
        return Err(ArchiveError::NotAnArchive);
    }
    let rest = &archive[MAGIC.len()..];
    let len = rest
        .get(..4)
        .ok_or(ArchiveError::Truncated("in the header's length"))?;
    let len = u32::from_be_bytes(len.try_into().expect("4 bytes"));
    if len > MAX_HEADER {
        return Err(ArchiveError::Header(format!(
            "{len} bytes long, more than {MAX_HEADER}"
        )));
    }
    let start = MAGIC.len() + 4;
    let end = start + len as usize;
    let json = archive
        .get(start..end)
        .ok_or(ArchiveError::Truncated("in the header"))?;
    let header: Header =
        serde_json::from_slice(json).map_err(|e| ArchiveError::Header(e.to_string()))?;
    Ok((header, end))
}

/// What `archive` says about itself (readable without the key; not yet verified: only
/// [`decode`] verifies it).
pub fn read_header(archive: &[u8]) -> Result<Header, ArchiveError> {
    split_header(archive).map(|(h, _)| h)
}

/// Open `archive` with `key`: its header and records, every record checked
/// ([`check_records`]), and the count, size and digest compared with the header's. Nothing
/// is inflated past what the header says, and the header may not say more than `limits`.
pub fn decode(
    archive: &[u8],
    key: &[u8],
    limits: &Limits,
) -> Result<(Header, Vec<Record>), ArchiveError> {
    decode_all(archive, key, limits).map(|o| (o.header, o.records))
}

/// [`decode`], with the trust sealed after the records.
pub fn decode_all(archive: &[u8], key: &[u8], limits: &Limits) -> Result<Opened, ArchiveError> {
    let sealing = sealing_key(key)?;
    let (header, end) = split_header(archive)?;
    check_trust_len(header.trust_bytes)?;
    for (what, found, limit) in [
        ("keys", header.keys, limits.keys),
        ("bytes", header.bytes, limits.bytes),
    ] {
        if found > limit {
            return Err(ArchiveError::TooLarge { what, found, limit });
        }
    }
    let nonce: [u8; NONCE_LEN] = archive
        .get(end..end + NONCE_LEN)
        .ok_or(ArchiveError::Truncated("in the nonce"))?
        .try_into()
        .expect("12 bytes");
    // The sealed part may not be longer than the records it may inflate to (and gzip's
    // framing, and the tag): refused before it is copied.
    let bound = header
        .bytes
        .saturating_add(header.keys.saturating_mul(RECORD_OVERHEAD))
        .saturating_add(header.trust_bytes);
    let sealed_len = (archive.len() - end - NONCE_LEN) as u64;
    if sealed_len > bound.saturating_add(bound / 1000).saturating_add(1024 + 16) {
        return Err(ArchiveError::Mismatch {
            what: "the sealed part's length",
            found: sealed_len.to_string(),
            expected: format!("about {bound} bytes at most"),
        });
    }
    let mut sealed = archive[end + NONCE_LEN..].to_vec();
    let plain = sealing
        .open_in_place(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&archive[..end]),
            &mut sealed,
        )
        .map_err(|_| ArchiveError::Sealed)?;
    // The header bounds what the records may inflate to: a file that claims little and
    // unpacks to much is refused rather than filling memory.
    let limit = header
        .bytes
        .saturating_add(header.keys.saturating_mul(RECORD_OVERHEAD))
        .saturating_add(header.trust_bytes);
    let mut raw = Vec::new();
    let mut gz = flate2::bufread::GzDecoder::new(&plain[..]);
    gz.by_ref()
        .take(limit.saturating_add(1))
        .read_to_end(&mut raw)
        .map_err(|e| ArchiveError::Records(format!("not gzip: {e}")))?;
    if raw.len() as u64 > limit {
        return Err(ArchiveError::Mismatch {
            what: "the records' size",
            found: format!("more than {limit} bytes"),
            expected: format!("{limit} bytes at most"),
        });
    }
    // One gzip member and nothing after it: every sealed byte is a record's.
    if !gz.into_inner().is_empty() {
        return Err(ArchiveError::Records(
            "bytes follow the compressed records".into(),
        ));
    }
    let Some(split) = raw.len().checked_sub(header.trust_bytes as usize) else {
        return Err(ArchiveError::Mismatch {
            what: "the sealed part's size",
            found: raw.len().to_string(),
            expected: format!("at least the header's {} trust bytes", header.trust_bytes),
        });
    };
    let (raw, trust_json) = raw.split_at(split);
    let trust = parse_trust(trust_json)?;
    let records = parse_records(raw, header.keys)?;
    check_records(&records, limits)?;
    let found = header_for(
        &header.tenant,
        &header.kubernetes_version,
        header.revision,
        &header.created,
        &records,
    );
    for (what, f, e) in [
        (
            "the key count",
            found.keys.to_string(),
            header.keys.to_string(),
        ),
        (
            "the size",
            found.bytes.to_string(),
            header.bytes.to_string(),
        ),
        (
            "the digest",
            keyed_digest(
                key,
                &digest(records.iter().map(|r| (&r.key[..], &r.value[..]))),
            ),
            header.digest.clone(),
        ),
    ] {
        if f != e {
            return Err(ArchiveError::Mismatch {
                what,
                found: f,
                expected: e,
            });
        }
    }
    Ok(Opened {
        header,
        records,
        trust,
    })
}

/// The trust's JSON: purposes and keys are short names of lower-case letters, digits, `-`
/// and `.` (what a Secret's suffix and data keys are).
fn parse_trust(json: &[u8]) -> Result<Trust, ArchiveError> {
    if json.is_empty() {
        return Ok(Trust::new());
    }
    let trust: Trust = serde_json::from_slice(json)
        .map_err(|e| ArchiveError::Records(format!("the trust is not valid: {e}")))?;
    let plain = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if let Some(bad) = trust
        .iter()
        .flat_map(|(p, data)| std::iter::once(p).chain(data.keys()))
        .find(|s| !plain(s))
    {
        return Err(ArchiveError::Records(format!(
            "the trust names {:?}, not a plain name",
            crate::backup::archive::cut(bad)
        )));
    }
    Ok(trust)
}

fn cut(s: &str) -> String {
    s.chars().take(64).collect()
}

fn parse_records(mut raw: &[u8], keys: u64) -> Result<Vec<Record>, ArchiveError> {
    fn take<'a>(raw: &mut &'a [u8], n: usize, what: &str) -> Result<&'a [u8], ArchiveError> {
        if raw.len() < n {
            return Err(ArchiveError::Records(format!(
                "a record ends in its {what}"
            )));
        }
        let (head, tail) = raw.split_at(n);
        *raw = tail;
        Ok(head)
    }
    fn len(raw: &mut &[u8], what: &str) -> Result<usize, ArchiveError> {
        let b = take(raw, 4, what)?;
        Ok(u32::from_be_bytes(b.try_into().expect("4 bytes")) as usize)
    }
    fn int(raw: &mut &[u8], what: &str) -> Result<i64, ArchiveError> {
        let b = take(raw, 8, what)?;
        Ok(i64::from_be_bytes(b.try_into().expect("8 bytes")))
    }
    let mut records = Vec::new();
    while !raw.is_empty() {
        if records.len() as u64 >= keys {
            return Err(ArchiveError::Mismatch {
                what: "the key count",
                found: format!("more than {keys}"),
                expected: keys.to_string(),
            });
        }
        let n = len(&mut raw, "key length")?;
        let key = take(&mut raw, n, "key")?.to_vec();
        check_key(&key)?;
        let n = len(&mut raw, "value length")?;
        let value = take(&mut raw, n, "value")?.to_vec();
        let id = int(&mut raw, "lease")?;
        let ttl = int(&mut raw, "lease's TTL")?;
        let lease = (id != 0).then_some(Lease {
            id,
            ttl: ttl.max(1),
        });
        records.push(Record { key, value, lease });
    }
    Ok(records)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn rec(key: &str, value: &str, lease: Option<(i64, i64)>) -> Record {
        Record {
            key: key.as_bytes().to_vec(),
            value: value.as_bytes().to_vec(),
            lease: lease.map(|(id, ttl)| Lease { id, ttl }),
        }
    }

    fn sample() -> (Header, Vec<Record>) {
        let records = vec![
            rec("configmaps/default/a", "alpha", None),
            rec("events/default/e1", "seen", Some((7, 3600))),
            rec("secrets/default/s", "\u{0}binary\u{1}", None),
        ];
        let h = header_for("ns/a", "v1.20.2", 42, "2026-11-28T00:00:00Z", &records);
        (h, records)
    }

    const KEY: [u8; 32] = [9; 32];

    #[test]
    fn an_archive_opens_with_its_key_to_what_was_sealed() {
        let (h, records) = sample();
        let bytes = encode(&h, &records, &KEY).unwrap();
        assert!(bytes.starts_with(MAGIC));
        let plain = digest(records.iter().map(|r| (&r.key[..], &r.value[..])));
        let mut expected = h.clone();
        expected.digest = keyed_digest(&KEY, &plain);
        assert_eq!(read_header(&bytes).unwrap(), expected);
        let (h2, r2) = decode(&bytes, &KEY, &Limits::default()).unwrap();
        assert_eq!((h2.clone(), r2), (expected, records));
        assert_eq!(h2.keys, 3);
        assert!(h2.digest.starts_with("hmac-sha256:") && h2.digest.len() == 76);
        // The header's digest is keyed: the records' plain one, which anyone could compute
        // from a guess of the content, is nowhere in the file, and another key gives another.
        assert!(!bytes.windows(64).any(|w| w == &plain.as_bytes()[7..]));
        assert_ne!(keyed_digest(&[1; 32], &plain), h2.digest);
        // Values are sealed: not in the file in the clear.
        assert!(!bytes.windows(5).any(|w| w == b"alpha"));
    }

    #[test]
    fn another_key_or_any_changed_byte_opens_nothing() {
        let (h, records) = sample();
        let bytes = encode(&h, &records, &KEY).unwrap();
        assert_eq!(
            decode(&bytes, &[8; 32], &Limits::default()),
            Err(ArchiveError::Sealed)
        );
        assert_eq!(
            decode(&bytes, &[8; 16], &Limits::default()),
            Err(ArchiveError::KeyLength(16))
        );
        // Every byte after the magic and length: the header (associated data), the nonce, the
        // sealed records and the tag.
        for i in MAGIC.len() + 4..bytes.len() {
            let mut changed = bytes.clone();
            changed[i] ^= 0x01;
            assert!(
                decode(&changed, &KEY, &Limits::default()).is_err(),
                "byte {i} changed and it opened"
            );
        }
        // A header rewritten to say something else, however well-formed, does not open.
        let mut other = h.clone();
        other.tenant = "ns/b".into();
        let forged = {
            let json = serde_json::to_vec(&other).unwrap();
            let (_, end) = split_header(&bytes).unwrap();
            let mut f = MAGIC.to_vec();
            f.extend_from_slice(&(json.len() as u32).to_be_bytes());
            f.extend_from_slice(&json);
            f.extend_from_slice(&bytes[end..]);
            f
        };
        assert_eq!(read_header(&forged).unwrap().tenant, "ns/b");
        assert_eq!(
            decode(&forged, &KEY, &Limits::default()),
            Err(ArchiveError::Sealed)
        );
        assert_eq!(
            decode(b"PK\x03\x04", &KEY, &Limits::default()),
            Err(ArchiveError::NotAnArchive)
        );
        assert!(matches!(
            decode(&bytes[..MAGIC.len() + 6], &KEY, &Limits::default()),
            Err(ArchiveError::Truncated(_))
        ));
    }

    /// The holder of the key is not trusted either: a well-sealed archive whose keys would
    /// leave the tenant's prefix, or whose records say other than its header, is refused.
    #[test]
    fn the_trust_is_sealed_after_the_records_and_checked() {
        let (h, records) = sample();
        let mut trust = Trust::new();
        trust.insert(
            "ca".into(),
            [
                ("tls.crt".to_string(), "CERT".to_string()),
                ("tls.key".to_string(), "SECRET-KEY".to_string()),
            ]
            .into(),
        );
        let bytes = encode_with(&h, &records, &trust, &KEY).unwrap();
        assert!(!bytes.windows(10).any(|w| w == b"SECRET-KEY"));
        let opened = decode_all(&bytes, &KEY, &Limits::default()).unwrap();
        assert_eq!(opened.trust, trust);
        assert_eq!(opened.records, records);
        assert!(opened.header.trust_bytes > 0);
        // Without trust, the header says nothing of it.
        let bare = encode(&h, &records, &KEY).unwrap();
        assert!(read_header(&bare).unwrap().trust_bytes == 0);
        assert!(
            decode_all(&bare, &KEY, &Limits::default())
                .unwrap()
                .trust
                .is_empty()
        );

        // Sealed with the right key, but its trust is not what it may be.
        let mut header = h.clone();
        header.digest = keyed_digest(
            &KEY,
            &digest(records.iter().map(|r| (&r.key[..], &r.value[..]))),
        );
        let sealed = |header: &Header, json: &[u8]| {
            let mut header = header.clone();
            if header.trust_bytes == 0 {
                header.trust_bytes = json.len() as u64;
            }
            seal(&header, &compress(&records, json), &KEY, [3; NONCE_LEN]).unwrap()
        };
        for bad in [
            r#"{"../ca":{"tls.key":"k"}}"#,
            r#"{"ca":{"../../tls.key":"k"}}"#,
            r#"{"CA":{"tls.key":"k"}}"#,
            r#"{"":{"tls.key":"k"}}"#,
            r#"["ca"]"#,
        ] {
            let err =
                decode_all(&sealed(&header, bad.as_bytes()), &KEY, &Limits::default()).unwrap_err();
            assert!(matches!(err, ArchiveError::Records(_)), "{bad}: {err}");
        }
        // A header that claims more trust than there is, or more than any archive holds.
        let json = br#"{"ca":{"tls.key":"k"}}"#;
        let mut claims_more = header.clone();
        claims_more.trust_bytes = json.len() as u64 + 5;
        assert!(decode_all(&sealed(&claims_more, json), &KEY, &Limits::default()).is_err());
        let mut too_much = header.clone();
        too_much.trust_bytes = MAX_TRUST + 1;
        assert!(matches!(
            decode_all(&sealed(&too_much, json), &KEY, &Limits::default()),
            Err(ArchiveError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_sealed_archive_with_hostile_keys_or_a_false_header_is_refused() {
        for bad in [
            "",
            "/registry/secrets/kube-system/x",
            "../other-tenant/secrets/default/s",
            "configmaps/../../b/x",
            "configmaps/./x",
            "configmaps//x",
            "configmaps/x/..",
            "configmaps/a\nb",
        ] {
            let records = vec![rec(bad, "v", None)];
            let h = header_for("ns/a", "v1.20.2", 1, "t", &records);
            let bytes = encode(&h, &records, &KEY).unwrap();
            assert!(
                matches!(
                    decode(&bytes, &KEY, &Limits::default()),
                    Err(ArchiveError::Key { .. })
                ),
                "{bad:?} was accepted"
            );
        }
        assert!(check_key(&[b'a'; MAX_KEY + 1]).is_err());
        assert!(check_key(b"registry/pods/default/web-0").is_ok());

        // Records that do not match the header's count, size or digest.
        let (h, records) = sample();
        let mut lying = h.clone();
        lying.digest = keyed_digest(&KEY, &digest([(&b"x"[..], &b"y"[..])]));
        let bytes = seal(&lying, &compress(&records, &[]), &KEY, [3; 12]).unwrap();
        assert!(matches!(
            decode(&bytes, &KEY, &Limits::default()),
            Err(ArchiveError::Mismatch {
                what: "the digest",
                ..
            })
        ));
        // A header that claims little: the records may not inflate past it.
        let mut small = h.clone();
        small.bytes = 4;
        small.keys = 1;
        let bytes = encode(&small, &records, &KEY).unwrap();
        assert!(matches!(
            decode(&bytes, &KEY, &Limits::default()),
            Err(ArchiveError::Mismatch {
                what: "the records' size",
                ..
            })
        ));
        // Two records with one key (the second would silently win on a restore).
        let twice = vec![rec("a/b", "1", None), rec("a/b", "2", None)];
        let h = header_for("ns/a", "v", 1, "t", &twice);
        let bytes = encode(&h, &twice, &KEY).unwrap();
        assert!(matches!(
            decode(&bytes, &KEY, &Limits::default()),
            Err(ArchiveError::Records(_))
        ));
    }

    /// What an archive may hold is bounded by the reader, not by its header: a header that
    /// claims more than the limits is refused before anything is inflated; so are too many
    /// leases, and sealed bytes after the compressed records.
    #[test]
    fn an_archive_past_the_limits_is_refused_before_it_is_inflated() {
        let (h, records) = sample();
        let bytes = encode(&h, &records, &KEY).unwrap();
        let tight = Limits {
            bytes: 10,
            ..Limits::default()
        };
        assert!(matches!(
            decode(&bytes, &KEY, &tight),
            Err(ArchiveError::TooLarge { what: "bytes", .. })
        ));
        let mut huge = h.clone();
        huge.keys = u64::MAX;
        huge.bytes = u64::MAX;
        let bytes = encode(&huge, &records, &KEY).unwrap();
        assert!(matches!(
            decode(&bytes, &KEY, &Limits::default()),
            Err(ArchiveError::TooLarge { .. })
        ));
        // 256 KiB of zeros compress to a few hundred bytes; a header that says 3 keys of 20
        // bytes bounds what is inflated to that, whatever the sealed part unpacks to.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&vec![0u8; 256 << 10]).unwrap();
        let bomb = seal(&h, &gz.finish().unwrap(), &KEY, [6; 12]).unwrap();
        assert!(matches!(
            decode(&bomb, &KEY, &Limits::default()),
            Err(ArchiveError::Mismatch {
                what: "the records' size",
                ..
            })
        ));

        // A sealed part far longer than such records could be is refused before it is copied.
        let long = seal(&h, &vec![7u8; 64 << 10], &KEY, [8; 12]).unwrap();
        assert!(matches!(
            decode(&long, &KEY, &Limits::default()),
            Err(ArchiveError::Mismatch {
                what: "the sealed part's length",
                ..
            })
        ));

        let leased: Vec<Record> = (0..3)
            .map(|i| rec(&format!("events/default/e{i}"), "e", Some((i + 1, 60))))
            .collect();
        let h = header_for("ns/a", "v", 1, "t", &leased);
        let bytes = encode(&h, &leased, &KEY).unwrap();
        let two = Limits {
            leases: 2,
            ..Limits::default()
        };
        assert!(matches!(
            decode(&bytes, &KEY, &two),
            Err(ArchiveError::TooLarge { what: "leases", .. })
        ));
        assert!(decode(&bytes, &KEY, &Limits::default()).is_ok());

        let (h, records) = sample();
        let mut trailing = compress(&records, &[]);
        trailing.extend_from_slice(b"unparsed");
        let bytes = seal(&h, &trailing, &KEY, [7; 12]).unwrap();
        assert!(matches!(
            decode(&bytes, &KEY, &Limits::default()),
            Err(ArchiveError::Records(_))
        ));
    }

    #[test]
    fn one_key_seals_each_archive_with_a_new_nonce() {
        let (h, records) = sample();
        let a = encode(&h, &records, &KEY).unwrap();
        let b = encode(&h, &records, &KEY).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            decode(&a, &KEY, &Limits::default()),
            decode(&b, &KEY, &Limits::default())
        );
    }
}
