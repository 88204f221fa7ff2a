//! The `NestedBackup` controller: one backup of one control plane, taken once.
//!
//! A pass checks what a user can get wrong before anything is read (the control plane, the
//! location, the key), then reads the tenant's keys at one revision with the tenant's own
//! etcd credentials ([`engine::export`]), seals them with its CAs and service-account key
//! ([`archive::encode_with`], [`TRUST`]), writes the
//! archive under a temporary name (0600), links it to its own name (never over another
//! file), reads it back and opens it. Only then is the backup `Completed`; a completed
//! backup is never taken again.
//!
//! An operator stopped at any step takes the backup again from the start; one stopped after
//! the archive got its name finds the archive its own (the header carries the backup's UID)
//! and completes with it.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::backup::{
    KEY_KEY, KEY_LEN, MAX_NAME, NestedBackup, NestedBackupStatus, default_key_secret, phases,
    reasons, types,
};
use nestplane_api::conditions;
use nestplane_api::names::{self, Component, SecretPurpose};
use ring::rand::{SecureRandom, SystemRandom};

use super::{archive, engine, location, s3, store};
use crate::context::{Context, Error};
use crate::datastore::etcd;
use crate::tenant::Tenant;

/// How often a backup that waits (for its control plane, datastore or key) looks again.
pub const RECHECK: Duration = Duration::from_secs(10);
/// Backups taken at once by one operator: each holds a tenant's keys in memory.
pub const CONCURRENCY: u16 = 2;
/// The label on a key Secret made by nestplane, naming the control plane it was made for.
pub const KEY_FOR_LABEL: &str = "backup.nestplane.io/control-plane";

/// What the backup controller has: the operator's [`Context`] and its backup directory.
pub struct BackupContext {
    /// What every controller shares.
    pub core: Arc<Context>,
    /// The operator's backup directory: archives of namespace `ns` go under `<dir>/ns/`.
    pub dir: PathBuf,
    /// What the files under `<dir>/ns/` may take in all, for each namespace `ns`.
    pub quota: u64,
    /// The S3 servers an `s3://` location may name (`--backup-s3-endpoint`).
    pub s3_endpoints: Vec<String>,
    /// The tasks writing schedules' delta segments.
    pub tailers: super::tail::Tailers,
    /// Cancelled when the operator stops: the tasks end with it.
    pub shutdown: tokio_util::sync::CancellationToken,
}

/// How often a backup refused by its namespace's quota after reading the keys looks again
/// (reading them is the expensive part).
pub const QUOTA_RECHECK: Duration = Duration::from_secs(60);
/// Checking a namespace's quota and writing an archive are one step: two backups of one
/// namespace cannot both pass the check and go past the quota together. One lock for every
/// namespace: at most [`CONCURRENCY`] backups wait for it, each for a write.
static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What one namespace's archives may take in all, by default: 10 GiB.
pub const NAMESPACE_QUOTA: u64 = 10 << 30;
/// The most entries [`used_under`] looks at in one namespace's directory.
pub const MAX_ENTRIES: usize = 100_000;

/// The bytes of the regular files under `dir` (0 when it does not exist), never following a
/// link; an error past [`MAX_ENTRIES`] entries.
pub fn used_under(dir: &Path) -> Result<u64, String> {
    let mut used = 0u64;
    let mut seen = 0usize;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", d.display())),
        };
        for entry in entries {
            let entry = entry.map_err(|e| format!("{}: {e}", d.display()))?;
            let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
            seen += 1;
            if seen > MAX_ENTRIES {
                return Err(format!(
                    "{} has more than {MAX_ENTRIES} entries",
                    dir.display()
                ));
            }
            // `file_type` does not follow links.
            // (A file removed meanwhile, another backup's temporary one, counts nothing.)
            let kind = match entry.file_type() {
                Ok(k) => k,
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(format!("{}: {e}", entry.path().display())),
            };
            if kind.is_dir() {
                todo.push(entry.path());
            } else if kind.is_file() {
                match entry.metadata() {
                    Ok(m) => used = used.saturating_add(m.len()),
                    Err(e) if gone(&e) => {}
                    Err(e) => return Err(format!("{}: {e}", entry.path().display())),
                }
            }
        }
    }
    Ok(used)
}

/// Why namespace `ns`'s archives (`used` bytes) leave no room for `more` under `quota`.
fn over_quota(ns: &str, used: u64, more: u64, quota: u64) -> Option<String> {
    (used.saturating_add(more) > quota).then(|| {
        format!(
            "the archives of namespace {ns} take {used} bytes{}; its quota is {quota} bytes (a schedule's smaller keep, or the operator's --backup-namespace-quota, makes room)",
            if more > 0 { format!(", and this one needs {more}") } else { String::new() }
        )
    })
}

crate::context::wing_context!(BackupContext);

/// Where a pass stopped, and why.
enum Outcome {
    /// Waiting for something that may appear by itself (looked at again).
    Waiting(&'static str, String),
    /// Refused until the spec changes.
    Refused(&'static str, String),
}

fn now() -> Timestamp {
    Timestamp::now()
}

/// Reconcile one backup.
pub async fn reconcile(b: Arc<NestedBackup>, ctx: Arc<BackupContext>) -> Result<Action, Error> {
    if let Some(action) = deletion_policy(&ctx, &b).await? {
        return Ok(action);
    }
    let status = b.status.clone().unwrap_or_default();
    let phase = status.phase.as_deref();
    if phase == Some(phases::COMPLETED)
        || (phase == Some(phases::FAILED) && status.observed_generation == b.metadata.generation)
        || b.metadata.deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    let ns = b.namespace().unwrap_or_default();
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    let cp = &b.spec.control_plane_ref.name;
    let Some(ncp) = ncps.get_opt(cp).await? else {
        return settle(
            &ctx,
            &b,
            Outcome::Waiting(
                reasons::CONTROL_PLANE_NOT_FOUND,
                format!("NestedControlPlane {ns}/{cp} not found"),
            ),
        )
        .await;
    };
    if !ctx.selects(&ncp) {
        // Another operator's control plane (`--watch-filter`): its operator takes it.
        return Ok(Action::await_change());
    }
    let loc = match location::locate(b.spec.location.as_deref(), &ctx.dir, &ns) {
        Ok(loc) => loc,
        Err(refused) => {
            return settle(
                &ctx,
                &b,
                Outcome::Refused(reasons::LOCATION_REFUSED, refused.to_string()),
            )
            .await;
        }
    };
    if b.name_any().len() > MAX_NAME {
        return settle(
            &ctx,
            &b,
            Outcome::Refused(
                reasons::INVALID_SPEC,
                format!(
                    "a backup's name is its archive's file name: at most {MAX_NAME} characters"
                ),
            ),
        )
        .await;
    }
    let archive = loc.archive(&b.name_any());
    let bucket = match store::reach(&ctx, &ns, &archive, b.spec.s3.as_ref()).await? {
        Ok(bucket) => bucket,
        Err(store::Unusable::Refused(reason, why)) => {
            return settle(&ctx, &b, Outcome::Refused(reason, why)).await;
        }
        Err(store::Unusable::Waiting(reason, why)) => {
            return settle(&ctx, &b, Outcome::Waiting(reason, why)).await;
        }
    };
    let key = match archive_key(&ctx, &b).await? {
        Ok(key) => key,
        Err(why) => return settle(&ctx, &b, Outcome::Waiting(reasons::INVALID_KEY, why)).await,
    };
    let uid = b.uid().unwrap_or_default();
    // An archive of this name is there already: this backup's, written by an operator that
    // stopped before saying so, or someone else's, which is left as it is.
    match existing(&archive, bucket.as_ref(), &uid, &key).await {
        Existing::None => {}
        Existing::Ours(header, size) => {
            return complete(&ctx, &b, &archive.url(), &header, size, None).await;
        }
        Existing::Other(why) => {
            return settle(&ctx, &b, Outcome::Refused(reasons::ARCHIVE_EXISTS, why)).await;
        }
        Existing::Unreadable(reason, why) => {
            return settle(&ctx, &b, Outcome::Waiting(reason, why)).await;
        }
    }
    // The namespace's archives leave no room for one as large as this control plane's last:
    // nothing is read. (An S3 location's space is its bucket owner's.)
    if matches!(archive, location::Archive::File(_)) {
        let last_size = Api::<NestedBackup>::namespaced(ctx.client.clone(), &ns)
            .list(&kube::api::ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|o| &o.spec.control_plane_ref.name == cp)
            .filter_map(|o| o.status)
            .filter(|s| s.phase.as_deref() == Some(phases::COMPLETED))
            .max_by_key(|s| s.completed_at.as_ref().map(|t| t.0))
            .and_then(|s| s.archive_bytes)
            .max(status.archive_bytes) // what this one needed when it did not fit
            .map_or(0, |b| b.max(0) as u64);
        let ns_dir = ctx.dir.join(&ns);
        let used = tokio::task::spawn_blocking(move || used_under(&ns_dir))
            .await
            .map_err(|e| Error::Internal(e.to_string()))?;
        match used.map(|used| over_quota(&ns, used, last_size, ctx.quota)) {
            Ok(None) => {}
            Ok(Some(why)) | Err(why) => {
                return settle(&ctx, &b, Outcome::Waiting(reasons::QUOTA_EXCEEDED, why)).await;
            }
        }
    }
    // A restore in progress: its keys are half written.
    if let Some(restore) = super::restore::holding(&ctx.client, &ncp).await? {
        return settle(
            &ctx,
            &b,
            Outcome::Waiting(
                reasons::DATASTORE_NOT_READY,
                format!("NestedRestore {ns}/{restore} is replacing the control plane's keys"),
            ),
        )
        .await;
    }
    let t = Tenant::load(&ctx.client, &ctx.caches, ncp.clone()).await?;
    let access = match datastore_access(&ctx, &t).await? {
        Ok(a) => a,
        Err(why) => {
            return settle(
                &ctx,
                &b,
                Outcome::Waiting(reasons::DATASTORE_NOT_READY, why),
            )
            .await;
        }
    };
    // The version its API server runs (what its stored objects' form is).
    let version = t
        .running_version(Component::ApiServer)
        .map(|v| v.to_string())
        .or_else(|| ncp.spec.version.clone())
        .unwrap_or_else(|| names::DEFAULT_KUBERNETES_VERSION.to_string());
    running(&ctx, &b).await?;
    let started = Instant::now();
    let taken = take(
        &ctx,
        &ncp,
        &version,
        &access,
        &key,
        &uid,
        (&archive, bucket.as_ref()),
    )
    .await;
    match taken {
        Ok((header, size, restarts)) => {
            complete(
                &ctx,
                &b,
                &archive.url(),
                &header,
                size,
                Some((started, restarts)),
            )
            .await
        }
        Err(Failure::Refused(reason, why)) => settle(&ctx, &b, Outcome::Refused(reason, why)).await,
        Err(Failure::OverQuota(why, needed)) => {
            // Kept, so that the next passes refuse it before reading the keys again.
            Api::<NestedBackup>::namespaced(ctx.client.clone(), &ns)
                .patch_status(
                    &b.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"status": {"archiveBytes": needed}})),
                )
                .await?;
            settle(&ctx, &b, Outcome::Waiting(reasons::QUOTA_EXCEEDED, why))
                .await
                .map(|_| Action::requeue(QUOTA_RECHECK))
        }
        Err(Failure::Retry(why)) => {
            // Said on the object, then retried with the controllers' backoff.
            let mut s = b.status.clone().unwrap_or_default();
            s.phase = Some(phases::RUNNING.into());
            set_ready(&mut s, &b, false, reasons::BACKUP_FAILED, &why);
            write_status(&ctx, &b, &s).await?;
            ctx.event(
                b.object_ref(&()),
                EventType::Warning,
                reasons::BACKUP_FAILED,
                &why,
            )
            .await;
            Err(Error::Unavailable(why))
        }
    }
}

/// `deletionPolicy: Delete`: the finalizer added before anything is written (and removed
/// when the policy goes back to `Retain`); on deletion, the backup's own archive deleted
/// (never another's file, never one a restore still to finish names), then the finalizer
/// removed. `Some`: the pass ends there.
async fn deletion_policy(ctx: &BackupContext, b: &NestedBackup) -> Result<Option<Action>, Error> {
    use nestplane_api::backup::{ARCHIVE_FINALIZER, DeletionPolicy};
    let ns = b.namespace().unwrap_or_default();
    let api: Api<NestedBackup> = Api::namespaced(ctx.client.clone(), &ns);
    let has = crate::finalizer::has(b, ARCHIVE_FINALIZER);
    let delete = b.spec.deletion_policy == Some(DeletionPolicy::Delete);
    if b.metadata.deletion_timestamp.is_none() {
        match (delete, has) {
            (true, false) => crate::finalizer::add(&api, b, ARCHIVE_FINALIZER).await?,
            (false, true) => crate::finalizer::remove(&api, b, ARCHIVE_FINALIZER).await?,
            _ => return Ok(None),
        }
        // The next pass sees the finalizer as written.
        return Ok(Some(Action::requeue(Duration::from_millis(200))));
    }
    if !has {
        return Ok(Some(Action::await_change()));
    }
    // Another operator's control plane (`--watch-filter`): its operator deletes the archive
    // (one that is gone is anyone's: at worst an archive in another directory is left).
    let cp = &b.spec.control_plane_ref.name;
    if let Some(ncp) = Api::<NestedControlPlane>::namespaced(ctx.client.clone(), &ns)
        .get_opt(cp)
        .await?
        && !ctx.selects(&ncp)
    {
        return Ok(Some(Action::await_change()));
    }
    // Read afresh: a backup deleted while it was taken has its archive's URL only in the
    // status written since.
    let Some(b) = api.get_opt(&b.name_any()).await? else {
        return Ok(Some(Action::await_change()));
    };
    let b = &b;
    if b.spec.deletion_policy != Some(DeletionPolicy::Delete) {
        // Retain (changed since, or a finalizer added by hand): the archive stays.
        crate::finalizer::remove(&api, b, ARCHIVE_FINALIZER).await?;
        return Ok(Some(Action::await_change()));
    }
    if super::schedule::in_use(ctx, &ns).await?.names(ctx, &ns, b) {
        let msg = "a restore still to finish names this backup: its archive is deleted once that restore is done".to_string();
        ctx.event(
            b.object_ref(&()),
            EventType::Warning,
            reasons::ARCHIVE_IN_USE,
            &msg,
        )
        .await;
        return Ok(Some(Action::requeue(RECHECK)));
    }
    let removed = match super::schedule::archive_of(ctx, &ns, b) {
        Some(a) => store::remove_own(ctx, &ns, b, &a).await,
        None => super::schedule::Removed::Nothing,
    };
    if let super::schedule::Removed::Failed(why) = removed {
        ctx.event(
            b.object_ref(&()),
            EventType::Warning,
            reasons::ARCHIVE_IN_USE,
            &format!("its archive could not be deleted: {why}"),
        )
        .await;
        return Ok(Some(Action::requeue(RECHECK)));
    }
    crate::finalizer::remove(&api, b, ARCHIVE_FINALIZER).await?;
    Ok(Some(Action::await_change()))
}

/// How to reach a tenant's keys: its datastore's endpoints, its key root, and its own etcd
/// client certificate; and its trust, which goes into the archive with its keys.
pub(super) struct Access {
    pub(super) endpoints: Vec<String>,
    pub(super) root: String,
    pub(super) creds: etcd::Credentials,
    pub(super) trust: archive::Trust,
}

/// The Secrets whose data is a tenant's trust: its CAs and its service-account key (with
/// them, kubeconfigs and tokens issued before a backup verify after a restore).
pub const TRUST: [SecretPurpose; 4] = [
    SecretPurpose::ClusterCa,
    SecretPurpose::EtcdCa,
    SecretPurpose::FrontProxyCa,
    SecretPurpose::ServiceAccount,
];

pub(super) async fn datastore_access(
    ctx: &Context,
    t: &Tenant,
) -> Result<Result<Access, String>, Error> {
    let (endpoints, prefix) = match t.datastore() {
        Some(d) => (d.endpoints.clone(), Some(d.prefix.clone())),
        None => (own_etcd_urls(t), None),
    };
    let ns = t.namespace();
    if endpoints.is_empty() {
        return Ok(Err(format!(
            "the datastore of NestedControlPlane {ns}/{} reports no endpoints yet",
            t.ncp.name_any()
        )));
    }
    let cluster = t.cluster();
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let text = |s: &Option<Secret>, key: &str| {
        s.as_ref()
            .and_then(|s| s.data.as_ref()?.get(key))
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
    };
    let ca_name = SecretPurpose::EtcdCa.secret_name(&cluster);
    let client_name = SecretPurpose::ApiServerEtcdClient.secret_name(&cluster);
    let ca = secrets.get_opt(&ca_name).await?;
    let client = secrets.get_opt(&client_name).await?;
    let (Some(ca_pem), Some(cert_pem), Some(key_pem)) = (
        text(&ca, names::TLS_CRT),
        text(&client, names::TLS_CRT),
        text(&client, names::TLS_KEY),
    ) else {
        return Ok(Err(format!(
            "the etcd credentials of {ns}/{cluster} ({ca_name}, {client_name}) are not issued yet"
        )));
    };
    let mut trust = archive::Trust::new();
    for purpose in TRUST {
        let name = purpose.secret_name(&cluster);
        let Some(data) = secrets.get_opt(&name).await?.and_then(|s| s.data) else {
            return Ok(Err(format!(
                "the Secret {ns}/{name} of the control plane's trust is not issued yet"
            )));
        };
        let mut texts = std::collections::BTreeMap::new();
        for (k, v) in data {
            let Ok(text) = String::from_utf8(v.0) else {
                return Ok(Err(format!(
                    "the Secret {ns}/{name} holds {k:?}, which is not text (certificates and keys are PEM)"
                )));
            };
            texts.insert(k, text);
        }
        trust.insert(purpose.suffix().to_string(), texts);
    }
    Ok(Ok(Access {
        endpoints,
        root: engine::key_root(prefix.as_deref()),
        creds: etcd::Credentials {
            ca_pem,
            cert_pem,
            key_pem,
        },
        trust,
    }))
}

/// The client URLs of a tenant's own etcd as this operator reaches it: each member's IP where
/// its status has one (the process runtime's loopback addresses; their host names are not in
/// any resolver), else its host name (a Service's, in the kubernetes runtime).
fn own_etcd_urls(t: &Tenant) -> Vec<String> {
    let Some(status) = t.etcd.found().and_then(|e| e.status.as_ref()) else {
        return Vec::new();
    };
    status
        .addresses
        .iter()
        .filter_map(|a| {
            let host = match a.ip.as_deref().filter(|ip| !ip.is_empty()) {
                Some(ip) if ip.contains(':') => format!("[{ip}]"),
                Some(ip) => ip.to_string(),
                None => a.hostname.clone().filter(|h| !h.is_empty())?,
            };
            Some(format!("https://{host}:{}", a.port))
        })
        .collect()
}

/// How long the datastore has to answer a first request: an endpoint that cannot be reached
/// otherwise holds a request until a connection is made.
pub const FIRST_ANSWER: Duration = Duration::from_secs(15);

/// Why a backup was not taken: something that may pass (tried again with backoff), or
/// something that will not until the spec changes. A message for the user (no secret in it).
#[derive(Debug)]
enum Failure {
    Retry(String),
    Refused(&'static str, String),
    /// The archive read (this many bytes) does not fit in the namespace's quota: waits
    /// (`Pending`, `QuotaExceeded`).
    OverQuota(String, i64),
}

impl From<String> for Failure {
    fn from(why: String) -> Self {
        Failure::Retry(why)
    }
}

/// Read, seal, write and verify.
async fn take(
    ctx: &BackupContext,
    ncp: &NestedControlPlane,
    version: &str,
    access: &Access,
    key: &[u8],
    uid: &str,
    (target, bucket): (&location::Archive, Option<&s3::Bucket>),
) -> Result<(archive::Header, u64, u32), Failure> {
    let mut client = etcd::connect_as(&access.endpoints, &access.creds)
        .await
        .map_err(|e| e.to_string())?;
    let first = client.get(
        access.root.as_str(),
        Some(
            etcd_client::GetOptions::new()
                .with_prefix()
                .with_count_only(),
        ),
    );
    match tokio::time::timeout(FIRST_ANSWER, first).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(format!("etcd at {}: {e}", access.endpoints.join(",")).into());
        }
        Err(_) => {
            return Err(Failure::Retry(format!(
                "etcd at {} did not answer within {FIRST_ANSWER:?}",
                access.endpoints.join(",")
            )));
        }
    }
    let limits = archive::Limits::default();
    let snap = engine::export(&mut client, &access.root, engine::PAGE, &limits)
        .await
        .map_err(|e| {
            let why = format!("reading the keys: {e}");
            match e {
                engine::EngineError::TooLargeToArchive(_)
                | engine::EngineError::UnarchivableKey(_) => {
                    Failure::Refused(reasons::CANNOT_ARCHIVE, why)
                }
                _ => Failure::Retry(why),
            }
        })?;
    let created = ctx
        .clock
        .now()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let tenant = format!("{}/{}", ncp.namespace().unwrap_or_default(), ncp.name_any());
    let mut header = archive::header_for(&tenant, version, snap.revision, &created, &snap.records);
    header.id = uid.to_string();
    let sealed = archive::encode_with(&header, &snap.records, &access.trust, key)
        .map_err(|e| Failure::Refused(reasons::CANNOT_ARCHIVE, e.to_string()))?;
    let restarts = snap.restarts;
    drop(snap);
    let path = match (target, bucket) {
        (location::Archive::File(path), _) => path,
        (
            location::Archive::S3 {
                bucket: name,
                key: object,
            },
            Some(bucket),
        ) => {
            // Written unless an object of its name exists, read back and opened.
            let size = sealed.len() as u64;
            bucket
                .put_new(name, object, sealed)
                .await
                .map_err(|e| match e {
                    s3::S3Error::Exists => Failure::Refused(
                        reasons::ARCHIVE_EXISTS,
                        format!(
                            "{} appeared while the backup was written; it is left as it is",
                            target.url()
                        ),
                    ),
                    e => Failure::Retry(format!("writing the archive: {e}")),
                })?;
            let back = store::read(target, Some(bucket), None)
                .await
                .map_err(|e| Failure::Retry(format!("reading the archive back: {e}")))?
                .ok_or_else(|| format!("{} is not there after it was written", target.url()))?;
            if back.len() as u64 != size {
                return Err(format!(
                    "{} holds {} bytes after {size} were written",
                    target.url(),
                    back.len()
                )
                .into());
            }
            let (header, _) = archive::decode(&back, key, &archive::Limits::default())
                .map_err(|e| format!("the archive written does not open: {e}"))?;
            return Ok((header, size, restarts));
        }
        (location::Archive::S3 { .. }, None) => {
            return Err("an s3:// archive needs its server".to_string().into());
        }
    };
    let (root, path, key, uid, quota) = (
        ctx.dir.clone(),
        path.to_path_buf(),
        key.to_vec(),
        uid.to_string(),
        (ncp.namespace().unwrap_or_default(), ctx.quota),
    );
    tokio::task::spawn_blocking(move || -> Result<_, Failure> {
        let (ns, quota) = quota;
        {
            // Held for the check and the write only (a write is short; reading the archive
            // back is not, and needs no lock).
            let _one_at_a_time = WRITING.lock().unwrap_or_else(|e| e.into_inner());
            let used = used_under(&root.join(&ns))?;
            if let Some(why) = over_quota(&ns, used, sealed.len() as u64, quota) {
                return Err(Failure::OverQuota(why, sealed.len() as i64));
            }
            write_new(&root, &path, &uid, &sealed)?;
        }
        drop(sealed);
        let (header, size) = open(&path, &key)?;
        Ok((header, size, restarts))
    })
    .await
    .map_err(|e| Failure::Retry(format!("writing the archive: {e}")))?
}

/// Write `bytes` to `path` as [`write_new`] does, if namespace `ns`'s files leave room for
/// them under `quota` (checked and written as one step, as a backup's archive is).
pub(super) fn write_counted(
    root: &Path,
    ns: &str,
    quota: u64,
    path: &Path,
    uid: &str,
    bytes: &[u8],
) -> Result<(), String> {
    let _one_at_a_time = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let used = used_under(&root.join(ns))?;
    if let Some(why) = over_quota(ns, used, bytes.len() as u64, quota) {
        return Err(why);
    }
    write_new(root, path, uid, bytes).map_err(|f| match f {
        Failure::Refused(_, why) | Failure::Retry(why) | Failure::OverQuota(why, _) => why,
    })
}

/// Make the operator's backup directory `root` (0700; it is the operator's to choose), and
/// every directory below it down to `dir` (0700), refusing one that is not a directory of its
/// own (a symbolic link).
fn ensure_dir(root: &Path, dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(root)
        .map_err(|e| format!("making {}: {e}", root.display()))?;
    let below = dir
        .strip_prefix(root)
        .map_err(|_| format!("{} is not under {}", dir.display(), root.display()))?;
    let mut at = root.to_path_buf();
    for c in below.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(format!("{} is not a directory", at.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&at)
                    .or_else(|e| match e.kind() {
                        std::io::ErrorKind::AlreadyExists => Ok(()),
                        _ => Err(e),
                    })
                    .map_err(|e| format!("making {}: {e}", at.display()))?;
            }
            Err(e) => return Err(format!("{}: {e}", at.display())),
        }
    }
    Ok(())
}

/// Write `bytes` to `path` (under `root`), which must not exist: under a temporary name first (0600, never
/// through a link), synced, then linked to its name, so a reader never sees half an archive
/// and no file is ever replaced.
fn write_new(root: &Path, path: &Path, uid: &str, bytes: &[u8]) -> Result<(), Failure> {
    let dir = path
        .parent()
        .ok_or_else(|| format!("{} has no directory", path.display()))?;
    ensure_dir(root, dir)?;
    room_for(dir, bytes.len() as u64)?;
    let tmp = dir.join(format!(".tmp-{uid}"));
    // Left by an operator that stopped while writing it.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("removing {}: {e}", tmp.display()).into()),
    }
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::hard_link(&tmp, path)
    })();
    let _ = std::fs::remove_file(&tmp);
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(Failure::Refused(
                reasons::ARCHIVE_EXISTS,
                format!(
                    "{} appeared while the backup was written; it is left as it is",
                    path.display()
                ),
            ));
        }
        Err(e) => return Err(format!("writing {}: {e}", path.display()).into()),
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("syncing {}: {e}", dir.display()).into())
}

/// What an archive leaves free on its filesystem, at least: a tenth of it, up to 2 GiB. The
/// backup directory is usually on the filesystem of every tenant's etcd, which must not run
/// out of space because of a backup.
pub const RESERVE: (u64, u64) = (10, 2 << 30);

/// Whether `dir`'s filesystem has room for `bytes` and the reserve.
fn room_for(dir: &Path, bytes: u64) -> Result<(), Failure> {
    let st = rustix::fs::statvfs(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (free, total) = (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize);
    let reserve = (total / RESERVE.0).min(RESERVE.1);
    if free < bytes.saturating_add(reserve) {
        return Err(Failure::Retry(format!(
            "{} has {free} bytes free; the archive needs {bytes}, and {reserve} stay free for the tenants",
            dir.display()
        )));
    }
    Ok(())
}

/// Read the archive at `path` back and open it with `key`: its header (verified) and size.
fn open(path: &Path, key: &[u8]) -> Result<(archive::Header, u64), Failure> {
    let bytes = read_archive(path)?;
    let (header, _) = archive::decode(&bytes, key, &archive::Limits::default())
        .map_err(|e| format!("the archive written does not open: {e}"))?;
    Ok((header, bytes.len() as u64))
}

pub(super) fn read_archive(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    let limit = archive::Limits::default().bytes.saturating_mul(2);
    let mut bytes = Vec::new();
    f.take(limit)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    Ok(bytes)
}

enum Existing {
    None,
    /// This backup's archive (its header's id is the backup's UID), verified.
    Ours(archive::Header, u64),
    /// Something else, or this backup's archive that the key no longer opens.
    Other(String),
    /// It cannot be read now (a reason and why).
    Unreadable(&'static str, String),
}

#[allow(clippy::result_large_err)]
async fn existing(
    a: &location::Archive,
    bucket: Option<&s3::Bucket>,
    uid: &str,
    key: &[u8],
) -> Existing {
    let read = |first| store::read(a, bucket, first);
    let judge = |r: Result<Option<Vec<u8>>, store::ReadError>| match r {
        Ok(found) => Ok(found),
        Err(store::ReadError::Denied(why)) => {
            Err(Existing::Unreadable(reasons::INVALID_CREDENTIALS, why))
        }
        Err(store::ReadError::NotAFile(why) | store::ReadError::TooLarge(why)) => {
            Err(Existing::Other(why))
        }
        Err(store::ReadError::Failed(why)) => {
            Err(Existing::Unreadable(reasons::BACKUP_FAILED, why))
        }
    };
    let url = a.url();
    // Its header first: another's object is never read whole.
    let head = match judge(read(Some(archive::HEADER_SPAN)).await) {
        Ok(None) => return Existing::None,
        Ok(Some(head)) => head,
        Err(e) => return e,
    };
    match archive::read_header(&head) {
        Ok(h) if !uid.is_empty() && h.id == uid => {}
        _ => {
            return Existing::Other(format!(
                "{url} exists and is another backup's; it is left as it is (name this backup otherwise, or choose another location)"
            ));
        }
    }
    let bytes = match judge(read(None).await) {
        Ok(None) => return Existing::None,
        Ok(Some(b)) => b,
        Err(e) => return e,
    };
    match archive::decode(&bytes, key, &archive::Limits::default()) {
        Ok((header, _)) => Existing::Ours(header, bytes.len() as u64),
        Err(e) => Existing::Other(format!(
            "{url} is this backup's archive, but does not open with its key Secret's key ({e}); was the key changed?"
        )),
    }
}

/// The archive key from the backup's key Secret. A default key Secret that does not exist is
/// made, with a random key, owned by nothing (deleting the control plane must not delete the
/// only key that opens its backups). `Err`: why there is no key, for the user.
pub(super) async fn archive_key(
    ctx: &BackupContext,
    b: &NestedBackup,
) -> Result<Result<Vec<u8>, String>, Error> {
    let ns = b.namespace().unwrap_or_default();
    let cp = &b.spec.control_plane_ref.name;
    let named = b.spec.key_secret_ref.as_ref().map(|r| r.name.clone());
    let name = named.clone().unwrap_or_else(|| default_key_secret(cp));
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let found = match secrets.get_opt(&name).await? {
        Some(s) => s,
        None if named.is_some() => {
            return Ok(Err(format!("the key Secret {ns}/{name} does not exist")));
        }
        None => {
            let mut key = vec![0u8; KEY_LEN];
            SystemRandom::new()
                .fill(&mut key)
                .map_err(|_| Error::Internal("no random key".into()))?;
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    labels: Some(
                        [
                            (
                                names::MANAGED_BY_LABEL.to_string(),
                                names::MANAGED_BY.to_string(),
                            ),
                            (KEY_FOR_LABEL.to_string(), cp.clone()),
                        ]
                        .into(),
                    ),
                    ..Default::default()
                },
                data: Some([(KEY_KEY.to_string(), ByteString(key))].into()),
                ..Default::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(made) => {
                    ctx.event(
                        b.object_ref(&()),
                        EventType::Normal,
                        reasons::KEY_CREATED,
                        &format!(
                            "made Secret {ns}/{name} with a new random archive key; keep a copy: without it, backups sealed with it cannot be opened"
                        ),
                    )
                    .await;
                    made
                }
                Err(kube::Error::Api(e)) if e.code == 409 => secrets.get(&name).await?,
                Err(e) => return Err(e.into()),
            }
        }
    };
    match found.data.as_ref().and_then(|d| d.get(KEY_KEY)) {
        Some(k) if k.0.len() == KEY_LEN => Ok(Ok(k.0.clone())),
        Some(k) => Ok(Err(format!(
            "the key Secret {ns}/{name} holds a `{KEY_KEY}` of {} bytes; an archive key is {KEY_LEN} bytes",
            k.0.len()
        ))),
        None => Ok(Err(format!(
            "the key Secret {ns}/{name} has no `{KEY_KEY}` ({KEY_LEN} bytes)"
        ))),
    }
}

fn set_ready(s: &mut NestedBackupStatus, b: &NestedBackup, ok: bool, reason: &str, msg: &str) {
    conditions::set(
        &mut s.conditions,
        conditions::new(types::READY, ok, reason, msg),
        b.metadata.generation,
        now(),
    );
    s.observed_generation = b.metadata.generation;
}

async fn write_status(
    ctx: &Context,
    b: &NestedBackup,
    s: &NestedBackupStatus,
) -> Result<(), Error> {
    if b.status.as_ref() == Some(s) {
        return Ok(());
    }
    let api: Api<NestedBackup> =
        Api::namespaced(ctx.client.clone(), &b.namespace().unwrap_or_default());
    api.patch_status(
        &b.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": s })),
    )
    .await?;
    Ok(())
}

/// Say that the backup waits or is refused; an Event when that is news.
async fn settle(ctx: &BackupContext, b: &NestedBackup, o: Outcome) -> Result<Action, Error> {
    let (phase, reason, msg, action) = match o {
        Outcome::Waiting(r, m) => (phases::PENDING, r, m, Action::requeue(RECHECK)),
        Outcome::Refused(r, m) => (phases::FAILED, r, m, Action::await_change()),
    };
    let before = b
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, types::READY))
        .map(|c| (c.reason.clone(), c.message.clone()));
    let mut s = b.status.clone().unwrap_or_default();
    s.phase = Some(phase.into());
    set_ready(&mut s, b, false, reason, &msg);
    write_status(ctx, b, &s).await?;
    if before != Some((reason.to_string(), conditions::cut(&msg, 32 * 1024))) {
        ctx.event(b.object_ref(&()), EventType::Warning, reason, &msg)
            .await;
    }
    Ok(action)
}

async fn running(ctx: &BackupContext, b: &NestedBackup) -> Result<(), Error> {
    let mut s = b.status.clone().unwrap_or_default();
    s.phase = Some(phases::RUNNING.into());
    s.started_at = Some(Time(now()));
    set_ready(
        &mut s,
        b,
        false,
        reasons::RUNNING,
        "reading the control plane's keys at one revision",
    );
    write_status(ctx, b, &s).await
}

async fn complete(
    ctx: &BackupContext,
    b: &NestedBackup,
    url: &str,
    h: &archive::Header,
    size: u64,
    timing: Option<(Instant, u32)>,
) -> Result<Action, Error> {
    let url = url.to_string();
    let mut s = b.status.clone().unwrap_or_default();
    s.phase = Some(phases::COMPLETED.into());
    s.url = Some(url.clone());
    s.revision = Some(h.revision);
    s.keys = Some(h.keys as i64);
    s.bytes = Some(h.bytes as i64);
    s.archive_bytes = Some(size as i64);
    s.digest = Some(h.digest.clone());
    s.kubernetes_version = Some(h.kubernetes_version.clone());
    s.completed_at = Some(Time(now()));
    if let Some((started, restarts)) = timing {
        s.duration_seconds = Some((started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0);
        s.restarts = Some(restarts as i32);
    }
    let msg = format!(
        "{} keys ({} bytes) at revision {}, sealed in {url} ({size} bytes)",
        h.keys, h.bytes, h.revision
    );
    set_ready(&mut s, b, true, reasons::COMPLETED, &msg);
    write_status(ctx, b, &s).await?;
    ctx.event(
        b.object_ref(&()),
        EventType::Normal,
        reasons::COMPLETED,
        &msg,
    )
    .await;
    Ok(Action::await_change())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn an_archive_is_written_once_0600_and_never_over_another_file() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("backups");
        let path = root.join("ns/deep/a.npbackup");
        write_new(&root, &path, "uid-1", b"first").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&root.join("ns")), 0o700);
        assert_eq!(mode(&root.join("ns/deep")), 0o700);
        match write_new(&root, &path, "uid-2", b"second") {
            Err(Failure::Refused(reason, why)) => {
                assert_eq!(reason, reasons::ARCHIVE_EXISTS);
                assert!(why.contains("left as it is"), "{why}");
            }
            _ => panic!("written over"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"first");
        // No temporary file is left behind either way.
        let left: Vec<_> = std::fs::read_dir(root.join("ns/deep"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
    }

    #[test]
    fn a_namespace_s_files_count_against_its_quota_and_links_do_not() {
        let d = tempfile::tempdir().unwrap();
        let ns = d.path().join("ns");
        assert_eq!(used_under(&ns), Ok(0), "none yet");
        std::fs::create_dir_all(ns.join("nightly")).unwrap();
        std::fs::write(ns.join("a.npbackup"), [0u8; 300]).unwrap();
        std::fs::write(ns.join("nightly/b.npbackup"), [0u8; 200]).unwrap();
        // A big file elsewhere, reached by links, is not the namespace's.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("big"), [0u8; 4096]).unwrap();
        std::os::unix::fs::symlink(outside.path().join("big"), ns.join("big.npbackup")).unwrap();
        std::os::unix::fs::symlink(outside.path(), ns.join("away")).unwrap();
        assert_eq!(used_under(&ns), Ok(500));
        assert_eq!(over_quota("ns", 500, 0, 500), None);
        assert_eq!(over_quota("ns", 500, 1, 1000), None);
        let why = over_quota("ns", 500, 501, 1000).unwrap();
        assert!(
            why.contains("namespace ns take 500 bytes, and this one needs 501"),
            "{why}"
        );
        assert!(over_quota("ns", 1001, 0, 1000).is_some());
    }

    #[test]
    fn a_link_in_the_way_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("ns")).unwrap();
        // A directory that is a link elsewhere.
        std::os::unix::fs::symlink(outside.path(), d.path().join("ns/away")).unwrap();
        let root = d.path();
        match write_new(root, &root.join("ns/away/a.npbackup"), "u", b"x") {
            Err(Failure::Retry(why)) => assert!(why.contains("not a directory"), "{why}"),
            _ => panic!("written through a link"),
        }
        // An archive name that is a link to a file elsewhere: not written through.
        let target = outside.path().join("victim");
        std::fs::write(&target, b"kept").unwrap();
        std::os::unix::fs::symlink(&target, d.path().join("ns/b.npbackup")).unwrap();
        assert!(write_new(root, &root.join("ns/b.npbackup"), "u", b"x").is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"kept");
        assert!(read_archive(&d.path().join("ns/b.npbackup")).is_err());
        assert!(std::fs::read_dir(outside.path()).unwrap().count() == 1);
    }
}
