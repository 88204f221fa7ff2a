//! Live moves of a tenant from one shared datastore to another: a change of
//! `spec.datastoreRef` on a control plane that is bound to a datastore already.
//!
//! A move copies the tenant's prefix at one revision of the source ([`engine::export`],
//! [`engine::restore`]), then follows the source with a watch from the next revision,
//! applying each change to the destination in bounded transactions. Once the watch reports
//! it has caught up (its progress answers come within [`CAUGHT_UP`]), the control plane
//! records `Freezing` and the tenant's role on the source is made read-only (its API server keeps serving reads; writes fail at once).
//! The last changes are applied (a progress request of the watch says when every change up
//! to the source's revision after the freeze has arrived), both prefixes' digests are
//! compared, and only then are the tenant's etcd credentials issued for the destination and
//! `status.datastore` changed: the API server restarts onto the destination one replica at
//! a time. The source keeps the tenant's keys, read-only, for a retention period (the way
//! back), and deletes them after it.
//!
//! The state is `status.migration`, written only by the control plane's own pass; the copy
//! and the watch run in a task ([`Migrations`]) whose progress that pass reads. An operator
//! that stops at any point starts the task again from the status: a copy before the freeze
//! is taken again; a frozen source is copied again (it no longer changes) and the move goes
//! on; after the cut-over only the API server's restart is waited for.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, EventType as WatchEventType, GetOptions, PutOptions, Txn, TxnOp};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::MigrationStatus;
use nestplane_api::datastore::{TenantDatastoreStatus, tenant_prefix, tenant_user};
use nestplane_api::names::SecretPurpose;

use super::{Access, Binding, access, admission, allowed, etcd, get, issue_credentials};
use crate::backup::{archive, engine};
use crate::context::{Context, Error};
use crate::tenant::Tenant;

/// `status.migration.phase`.
pub mod phases {
    pub const PENDING: &str = "Pending";
    pub const COPYING: &str = "Copying";
    pub const FOLLOWING: &str = "Following";
    pub const FREEZING: &str = "Freezing";
    pub const CUTTING_OVER: &str = "CuttingOver";
    pub const COMPLETED: &str = "Completed";
    pub const CANCELLED: &str = "Cancelled";
}

/// The condition a control plane on the move carries.
pub const CONDITION: &str = "DatastoreMigration";
/// Events.
pub const STARTED: &str = "MigrationStarted";
pub const PENDING: &str = "MigrationPending";
pub const FROZEN: &str = "MigrationFrozen";
pub const CUT_OVER: &str = "MigrationCutOver";
pub const COMPLETED: &str = "MigrationCompleted";
pub const CANCELLED: &str = "MigrationCancelled";
pub const RETRYING: &str = "MigrationRetrying";
pub const SOURCE_REMOVED: &str = "MigrationSourceRemoved";

/// The copy is caught up when the watch's last progress answer (sent only by a watch that
/// has delivered everything up to the source's revision) is this recent.
pub const CAUGHT_UP: Duration = Duration::from_millis(600);
/// The longest a freeze may last before the move gives up on it (the source is writable
/// again, and the move copies and follows again).
pub const FREEZE_LIMIT: i64 = 30;
/// Where a move raises the destination's revision (a key outside every tenant's prefix: a
/// namespace name has no dot).
const BUMP_ROOT: &str = "/nestplane/.moves/";
/// Moves that copy and follow at once (each holds a tenant's keys in memory while it
/// copies); the others wait as `Pending`.
pub const MAX_MOVES: usize = 2;
/// The most revisions a move raises its destination by (one write each) to get above the
/// source's: a destination further behind is refused (`Pending`).
pub const MAX_BUMP: i64 = 1_000_000;
/// How far above the source's revision the destination is kept while following: the
/// source's revisions in this long at its measured rate, and at least [`MIN_MARGIN`] (so that
/// what the old API servers hand out during the cut-over's roll stays below it).
const ROLL_ALLOWANCE_SECONDS: i64 = 120;
const MIN_MARGIN: i64 = 1000;
/// Pause before a move freezes again after a freeze was lifted (doubling per lift, at most
/// [`MAX_REFREEZE`] seconds).
const REFREEZE: i64 = 60;
const MAX_REFREEZE: i64 = 1800;
/// The key a move of tenant `namespace/cluster` raises its destination's revision with.
pub fn bump_key(namespace: &str, cluster: &str) -> String {
    format!("{BUMP_ROOT}{namespace}/{cluster}")
}

/// Writes in flight at once while raising the destination's revision.
const BUMP_BATCH: usize = 64;
/// How long the source keeps the tenant's keys after a move, unless the control plane's
/// [`RETENTION_ANNOTATION`] says otherwise (at most [`MAX_RETENTION`]).
pub const RETENTION: i64 = 24 * 3600;
pub const MAX_RETENTION: i64 = 30 * 24 * 3600;
pub const RETENTION_ANNOTATION: &str = "nestplane.io/migration-retention";
/// How often the task asks the watch for its progress and measures the lag.
const TICK: Duration = Duration::from_millis(200);
/// How often the control plane's pass looks while a move runs.
const LOOK: Duration = Duration::from_millis(250);
/// Digest comparisons after the freeze before the task gives up and copies again.
const COMPARISONS: u32 = 50;

/// What the task has done so far (read by the control plane's pass).
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// The copy is done and the watch applies changes.
    pub following: bool,
    /// The source revision of the copy.
    pub revision: Option<i64>,
    pub keys: Option<i64>,
    /// Revisions of the source not yet seen applied (of every tenant of the source: the
    /// watch's progress is the datastore's revision).
    pub lag: Option<i64>,
    /// The watch has caught up (see [`CAUGHT_UP`]).
    pub caught_up: bool,
    /// After the freeze: every change applied and both digests equal.
    pub drained: Option<Drained>,
    /// The last error (the task starts again after a pause).
    pub error: Option<String>,
}

#[derive(Clone, Debug)]
pub struct Drained {
    pub revision: i64,
    /// The destination's revision then: what an API server writes there afterwards is above.
    pub destination_revision: i64,
    pub digest: String,
    pub keys: i64,
}

struct Running {
    to: String,
    progress: Arc<Mutex<Progress>>,
    freeze: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// The moves' tasks, one per control plane.
#[derive(Default)]
pub struct Migrations(Mutex<HashMap<String, Running>>);

impl Migrations {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The progress of `key`'s move to `to`, if its task runs.
    fn progress(&self, key: &str, to: &str) -> Option<(Progress, Arc<AtomicBool>)> {
        let running = self.lock();
        let r = running
            .get(key)
            .filter(|r| r.to == to && !r.task.is_finished())?;
        let p = r.progress.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Some((p, r.freeze.clone()))
    }

    /// Moves whose task runs, besides `key`'s.
    fn others(&self, key: &str) -> usize {
        self.lock()
            .iter()
            .filter(|(k, r)| k.as_str() != key && !r.task.is_finished())
            .count()
    }

    /// Start `key`'s task, unless [`MAX_MOVES`] others run (false).
    fn start(&self, key: &str, job: Job, freeze: bool) -> bool {
        let mut running = self.lock();
        let others = running
            .iter()
            .filter(|(k, r)| k.as_str() != key && !r.task.is_finished())
            .count();
        if others >= MAX_MOVES {
            return false;
        }
        let progress = Arc::new(Mutex::new(Progress::default()));
        let flag = Arc::new(AtomicBool::new(freeze));
        let to = job.to.clone();
        let task = tokio::spawn(run(job, progress.clone(), flag.clone()));
        if let Some(old) = running.insert(
            key.to_string(),
            Running {
                to,
                progress,
                freeze: flag,
                task,
            },
        ) {
            old.task.abort();
        }
        true
    }

    /// Stop `key`'s task, if one runs.
    pub fn stop(&self, key: &str) {
        if let Some(r) = self.lock().remove(key) {
            r.task.abort();
        }
    }
}

/// One move's copy and watch.
struct Job {
    to: String,
    /// `namespace/cluster`: names the key that raises the destination's revision.
    tenant: String,
    src: Access,
    dst: Access,
    user: String,
    prefix: String,
}

fn set(progress: &Mutex<Progress>, f: impl FnOnce(&mut Progress)) {
    f(&mut progress.lock().unwrap_or_else(|p| p.into_inner()));
}

async fn run(job: Job, progress: Arc<Mutex<Progress>>, freeze: Arc<AtomicBool>) {
    let mut pause = Duration::from_secs(1);
    loop {
        let err = job.once(&progress, &freeze).await;
        tracing::warn!(prefix = %job.prefix, to = %job.to, error = %err, "moving a tenant's keys; starting again");
        set(&progress, |p| {
            *p = Progress {
                error: Some(err),
                ..Progress::default()
            }
        });
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(30));
    }
}

impl Job {
    /// Copy, follow, and (once asked) freeze, drain and compare; returns only on an error.
    async fn once(&self, progress: &Mutex<Progress>, freeze: &AtomicBool) -> String {
        match self.inner(progress, freeze).await {
            Ok(never) => match never {},
            Err(e) => e,
        }
    }

    async fn inner(
        &self,
        progress: &Mutex<Progress>,
        freeze: &AtomicBool,
    ) -> Result<std::convert::Infallible, String> {
        let s = |e: etcd::EtcdError| e.to_string();
        let mut src = etcd::connect_as(&self.src.endpoints, &self.src.creds)
            .await
            .map_err(s)?;
        let mut dst = etcd::connect_as(&self.dst.endpoints, &self.dst.creds)
            .await
            .map_err(s)?;
        // The tenant's user and role on the destination first: its quota measures the copy.
        etcd::Admin::connect(&self.dst.endpoints, &self.dst.creds)
            .await
            .map_err(s)?
            .ensure_tenant(&self.user, &self.prefix)
            .await
            .map_err(s)?;
        let limits = archive::Limits::default();
        let snap = engine::export(&mut src, &self.prefix, engine::PAGE, &limits)
            .await
            .map_err(|e| format!("copying from the source: {e}"))?;
        // Every write of the copy lands at a revision of the destination above the one it
        // was read at (and every change the watch applies, above its own; see `apply`): a
        // client's resourceVersion from the source is then never one after which the
        // destination holds a change the client has not seen.
        let bump_key = format!("{BUMP_ROOT}{}", self.tenant);
        bump(&mut dst, &bump_key, snap.revision + 1).await?;
        engine::restore(&mut dst, &self.prefix, &snap.records, &limits)
            .await
            .map_err(|e| format!("writing the copy: {e}"))?;
        let base = snap.revision;
        let keys = snap.records.len() as i64;
        drop(snap);
        set(progress, |p| {
            *p = Progress {
                following: true,
                revision: Some(base),
                keys: Some(keys),
                ..Progress::default()
            }
        });
        let stream = src
            .watch(
                self.prefix.as_str(),
                Some(
                    etcd_client::WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(base + 1),
                ),
            )
            .await
            .map_err(|e| format!("watching the source: {e}"))?;
        let (mut requests, mut answers) = stream.split();
        let mut leases = BTreeMap::new();
        // Every change of the source up to `synced` is applied to the destination.
        let mut synced = base;
        let mut frozen: Option<i64> = None;
        let mut comparisons = 0;
        let mut progressed: Option<tokio::time::Instant> = None;
        let following = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = answers.message() => {
                    let resp = msg
                        .map_err(|e| format!("the watch of the source: {e}"))?
                        .ok_or_else(|| "the watch of the source ended".to_string())?;
                    if resp.compact_revision() > 0 {
                        return Err(format!(
                            "the source was compacted at revision {} before the copy caught up",
                            resp.compact_revision()
                        ));
                    }
                    if resp.canceled() {
                        return Err(format!("the watch of the source was cancelled: {}", resp.cancel_reason()));
                    }
                    if resp.events().is_empty() {
                        // A progress answer: every change up to its revision has come.
                        if !resp.created() && let Some(h) = resp.header() {
                            synced = synced.max(h.revision());
                            progressed = Some(tokio::time::Instant::now());
                        }
                        continue;
                    }
                    if let Some(last) = resp.events().iter().filter_map(|e| e.kv()).map(|kv| kv.mod_revision()).max() {
                        bump(&mut dst, &bump_key, last).await?;
                    }
                    apply(&mut src, &mut dst, resp.events(), &mut leases).await?;
                    if let Some(last) = resp.events().iter().filter_map(|e| e.kv()).map(|kv| kv.mod_revision()).max() {
                        synced = synced.max(last);
                    }
                }
                _ = tick.tick() => {
                    requests
                        .request_progress()
                        .await
                        .map_err(|e| format!("asking the watch's progress: {e}"))?;
                    let now = revision(&mut src, &self.prefix).await?;
                    let lag = (now - synced).max(0);
                    let caught_up = progressed.is_some_and(|t| t.elapsed() <= CAUGHT_UP);
                    set(progress, |p| {
                        p.lag = Some(lag);
                        p.caught_up = caught_up;
                    });
                    // Kept above the source by what it may grow during the cut-over's roll.
                    let secs = following.elapsed().as_secs().max(1) as i64;
                    let margin = MIN_MARGIN.max((now - base) / secs * ROLL_ALLOWANCE_SECONDS);
                    if frozen.is_none() {
                        bump(&mut dst, &bump_key, now + margin).await?;
                    }
                    if frozen.is_none() && freeze.load(Ordering::Relaxed) && caught_up {
                        etcd::Admin::connect(&self.src.endpoints, &self.src.creds)
                            .await
                            .map_err(s)?
                            .set_writable(&self.user, &self.prefix, false)
                            .await
                            .map_err(s)?;
                        // Whatever the tenant wrote before is at or below this revision.
                        frozen = Some(revision(&mut src, &self.prefix).await?);
                    }
                    let drained = progress.lock().unwrap_or_else(|p| p.into_inner()).drained.is_some();
                    if let Some(target) = frozen && synced >= target && !drained {
                        let (sd, sk) = engine::digest_of(&mut src, &self.prefix)
                            .await
                            .map_err(|e| e.to_string())?;
                        let (dd, dk) = engine::digest_of(&mut dst, &self.prefix)
                            .await
                            .map_err(|e| e.to_string())?;
                        if sd == dd && sk == dk {
                            bump(&mut dst, &bump_key, target + margin).await?;
                            let _ = dst.delete(bump_key.as_str(), None).await;
                            let at = revision(&mut dst, &self.prefix).await?;
                            set(progress, |p| {
                                p.drained = Some(Drained { revision: target, destination_revision: at, digest: sd, keys: sk as i64 });
                                p.keys = Some(sk as i64);
                            });
                        } else {
                            // A lease of the source ended in between: its deletion comes.
                            comparisons += 1;
                            if comparisons >= COMPARISONS {
                                return Err(format!(
                                    "after the freeze the destination holds {dk} keys (digest {dd}), the source {sk} (digest {sd})"
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The source's revision now (a read of one key of the prefix: the answer's header).
async fn revision(client: &mut Client, prefix: &str) -> Result<i64, String> {
    let resp = client
        .get(
            prefix,
            Some(
                GetOptions::new()
                    .with_range(etcd::prefix_end(prefix))
                    .with_count_only(),
            ),
        )
        .await
        .map_err(|e| format!("reading the source's revision: {e}"))?;
    resp.header()
        .map(|h| h.revision())
        .ok_or_else(|| "etcd answered without a header".to_string())
}

/// Raise `client`'s revision to at least `to` with writes of `key` ([`BUMP_BATCH`] at once;
/// each write is a revision).
async fn bump(client: &mut Client, key: &str, to: i64) -> Result<(), String> {
    loop {
        let now = revision(client, key).await?;
        if now >= to {
            return Ok(());
        }
        let n = ((to - now) as usize).min(BUMP_BATCH);
        let writes = (0..n).map(|_| {
            let mut c = client.clone();
            async move { c.put(key, "", None).await }
        });
        for r in futures::future::join_all(writes).await {
            r.map_err(|e| format!("raising the destination's revision: {e}"))?;
        }
    }
}

/// The source's changes, applied to the destination in order, at most [`engine::TXN_OPS`]
/// operations and [`engine::TXN_BYTES`] per transaction, a key at most once in each (etcd
/// refuses a transaction that names a key twice). A key on a lease of the source gets a
/// lease of the destination with the time the source's has left.
async fn apply(
    src: &mut Client,
    dst: &mut Client,
    events: &[etcd_client::Event],
    leases: &mut BTreeMap<i64, i64>,
) -> Result<(), String> {
    let mut ops = Vec::new();
    let mut keys = BTreeSet::new();
    let mut bytes = 0usize;
    for e in events {
        let Some(kv) = e.kv() else { continue };
        let size = kv.key().len() + kv.value().len();
        if !ops.is_empty()
            && (ops.len() >= engine::TXN_OPS
                || bytes + size > engine::TXN_BYTES
                || keys.contains(kv.key()))
        {
            commit(dst, std::mem::take(&mut ops)).await?;
            keys.clear();
            bytes = 0;
        }
        let op = match e.event_type() {
            WatchEventType::Put => {
                let opts = match kv.lease() {
                    0 => None,
                    l => Some(PutOptions::new().with_lease(lease(src, dst, l, leases).await?)),
                };
                TxnOp::put(kv.key(), kv.value(), opts)
            }
            WatchEventType::Delete => TxnOp::delete(kv.key(), None),
        };
        keys.insert(kv.key().to_vec());
        bytes += size;
        ops.push(op);
    }
    if !ops.is_empty() {
        commit(dst, ops).await?;
    }
    Ok(())
}

async fn commit(dst: &mut Client, ops: Vec<TxnOp>) -> Result<(), String> {
    dst.txn(Txn::new().and_then(ops))
        .await
        .map(|_| ())
        .map_err(|e| format!("writing to the destination: {e}"))
}

async fn lease(
    src: &mut Client,
    dst: &mut Client,
    id: i64,
    leases: &mut BTreeMap<i64, i64>,
) -> Result<i64, String> {
    if let Some(l) = leases.get(&id) {
        return Ok(*l);
    }
    let ttl = src
        .lease_time_to_live(id, None)
        .await
        .map_err(|e| format!("reading a lease of the source: {e}"))?
        .ttl();
    let granted = dst
        .lease_grant(ttl.clamp(2, engine::LEASE_TTL.1), None)
        .await
        .map_err(|e| format!("granting a lease on the destination: {e}"))?
        .id();
    leases.insert(id, granted);
    Ok(granted)
}

/// What the control plane's pass does with a move.
#[derive(Default)]
pub struct Step {
    /// The binding the control plane reports (the destination's, from the cut-over on).
    pub binding: Option<Binding>,
    /// `status.migration`.
    pub status: Option<MigrationStatus>,
    /// Look again this soon.
    pub requeue: Option<Duration>,
}

fn ns_name(s: &str) -> (String, String) {
    let (ns, name) = s.split_once('/').unwrap_or_default();
    (ns.to_string(), name.to_string())
}

fn retention(t: &Tenant) -> i64 {
    t.ncp
        .annotations()
        .get(RETENTION_ANNOTATION)
        .and_then(|v| crate::rotation::parse_duration(v))
        .unwrap_or(RETENTION)
        .clamp(0, MAX_RETENTION)
}

fn before_freeze(phase: &str) -> bool {
    matches!(phase, phases::PENDING | phases::COPYING | phases::FOLLOWING)
}

/// Whether a move is under way (its source must stay).
pub fn active(m: &MigrationStatus) -> bool {
    before_freeze(&m.phase) || m.phase == phases::FREEZING || m.phase == phases::CUTTING_OVER
}

/// The datastores (`namespace/name`) that hold some of the tenant's keys because of a move:
/// the source until its copy is removed, the destination of a move not yet cut over.
pub fn holding(m: &MigrationStatus) -> Vec<String> {
    let mut out = Vec::new();
    if !m.source_removed && m.phase != phases::CANCELLED {
        out.push(m.from.clone());
    }
    if before_freeze(&m.phase) || m.phase == phases::FREEZING {
        out.push(m.to.clone());
    }
    out
}

/// One pass of the move `t` asks for, if any (see the module). `bound` is where the tenant's
/// data is (its `status.datastore`).
pub async fn advance(ctx: &Context, t: &Tenant) -> Result<Step, Error> {
    let prev = t.ncp.status.as_ref().and_then(|s| s.migration.clone());
    let Some(bound) = t.datastore().cloned() else {
        return Ok(Step {
            status: prev,
            ..Step::default()
        });
    };
    let Some((to_ns, to_name)) = super::referenced(&t.ncp) else {
        return Ok(Step {
            status: prev,
            ..Step::default()
        });
    };
    let key = crate::context::object_key(&t.ncp);
    let from = format!("{}/{}", bound.namespace, bound.name);
    let to = format!("{to_ns}/{to_name}");
    let now = Timestamp::now();
    match prev {
        // A move not yet cut over, to somewhere no longer asked for: withdrawn.
        Some(m) if (before_freeze(&m.phase) || m.phase == phases::FREEZING) && m.to != to => {
            let m = cancel(ctx, t, &key, m, &bound).await?;
            if from == to {
                return Ok(Step {
                    status: Some(m),
                    ..Step::default()
                });
            }
            start(ctx, t, &key, &from, &to, None).await
        }
        Some(m) if active(&m) && m.to == to => go_on(ctx, t, &key, m, &bound, now).await,
        Some(m) if m.phase == phases::CUTTING_OVER => go_on(ctx, t, &key, m, &bound, now).await,
        _ if from != to => start(ctx, t, &key, &from, &to, None).await,
        Some(m) if m.phase == phases::COMPLETED => retain(ctx, t, m, now).await,
        other => Ok(Step {
            status: other,
            ..Step::default()
        }),
    }
}

async fn say(ctx: &Context, t: &Tenant, type_: EventType, reason: &str, msg: &str) {
    ctx.event(t.ncp.object_ref(&()), type_, reason, msg).await;
}

/// Begin a move (or say why it waits: `Pending`). A copy of an earlier move's source still
/// retained is removed first: the way back is to the last source only.
async fn start(
    ctx: &Context,
    t: &Tenant,
    key: &str,
    from: &str,
    to: &str,
    pending: Option<MigrationStatus>,
) -> Result<Step, Error> {
    let now = Timestamp::now();
    let mut m = pending.unwrap_or_else(|| MigrationStatus {
        from: from.to_string(),
        to: to.to_string(),
        phase: phases::PENDING.into(),
        started_at: Some(Time(now)),
        ..MigrationStatus::default()
    });
    let prev = t.ncp.status.as_ref().and_then(|s| s.migration.clone());
    let bound = t.datastore().cloned().unwrap_or_default();
    let waiting = match ready_to_move(ctx, t, to).await? {
        Ok((src, dst)) => {
            if let Some(old) = prev.as_ref().filter(|o| {
                o.phase == phases::COMPLETED && !o.source_removed && o.from != from && o.from != to
            }) && !remove_copy(ctx, t, &old.from).await?
            {
                return Ok(Step {
                    status: prev,
                    requeue: Some(Duration::from_secs(10)),
                    ..Step::default()
                });
            }
            let started = ctx.migrations.start(
                key,
                Job {
                    to: to.to_string(),
                    tenant: format!("{}/{}", t.namespace(), t.cluster()),
                    src,
                    dst,
                    user: bound.user.clone(),
                    prefix: bound.prefix.clone(),
                },
                false,
            );
            if !started {
                return Ok(Step {
                    status: Some(MigrationStatus {
                        phase: phases::PENDING.into(),
                        message: Some(format!(
                            "{MAX_MOVES} other moves between datastores run now; this one waits its turn"
                        )),
                        ..m
                    }),
                    requeue: Some(Duration::from_secs(10)),
                    ..Step::default()
                });
            }
            m.phase = phases::COPYING.into();
            m.message = Some(format!("copying the tenant's keys from {from} to {to}"));
            say(
                ctx,
                t,
                EventType::Normal,
                STARTED,
                &format!(
                    "moving the tenant's data from NestedDatastore {from} to {to}: copy, follow, then a short write freeze for the cut-over"
                ),
            )
            .await;
            None
        }
        Err(why) => Some(why),
    };
    if let Some(why) = waiting {
        if m.message.as_deref() != Some(&why) {
            // One series per destination: a move asked anew elsewhere says why it waits (a
            // later note of one series is only counted).
            ctx.event_as(
                t.ncp.object_ref(&()),
                EventType::Warning,
                PENDING,
                &format!("Move/{to}"),
                &why,
            )
            .await;
        }
        m.phase = phases::PENDING.into();
        m.message = Some(why);
        return Ok(Step {
            status: Some(m),
            requeue: Some(Duration::from_secs(10)),
            ..Step::default()
        });
    }
    Ok(Step {
        status: Some(m),
        requeue: Some(LOOK),
        ..Step::default()
    })
}

/// Both datastores' access when the destination may take the tenant now; else why not.
async fn ready_to_move(
    ctx: &Context,
    t: &Tenant,
    to: &str,
) -> Result<Result<(Access, Access), String>, Error> {
    let running = ctx.migrations.others(&crate::context::object_key(&t.ncp));
    if running >= MAX_MOVES {
        return Ok(Err(format!(
            "{running} other moves between datastores run now (at most {MAX_MOVES} at once); this one waits its turn"
        )));
    }
    if ctx.runtime.patch_policy() == nestplane_render::policy::Runtime::Kubernetes {
        return Ok(Err(
            "moves between datastores run in the process runtime only for now; the tenant stays where it is".into(),
        ));
    }
    let Some(bound) = t.datastore().cloned() else {
        return Ok(Err("the tenant is not on a datastore yet".into()));
    };
    let (to_ns, to_name) = ns_name(to);
    let Some(dst) = get(ctx, &to_ns, &to_name).await? else {
        return Ok(Err(format!(
            "NestedDatastore {to} not found; the tenant stays on {}/{}",
            bound.namespace, bound.name
        )));
    };
    let ns = t.namespace();
    if !allowed(ctx, &dst, &ns).await? {
        return Ok(Err(format!(
            "NestedDatastore {to} does not allow control planes of namespace {ns} (its spec.allowedNamespaces); the tenant stays where it is"
        )));
    }
    if dst.metadata.deletion_timestamp.is_some() {
        return Ok(Err(format!("NestedDatastore {to} is being deleted")));
    }
    if let Some(Binding::Problem(_, why) | Binding::Waiting(why)) = admission(&dst, t) {
        return Ok(Err(why));
    }
    if !dst.status.as_ref().is_some_and(|s| s.ready) {
        return Ok(Err(format!("waiting for NestedDatastore {to} to be Ready")));
    }
    let Some(src) = get(ctx, &bound.namespace, &bound.name).await? else {
        return Ok(Err(format!(
            "the source NestedDatastore {}/{} is gone",
            bound.namespace, bound.name
        )));
    };
    let src = match access(ctx, &src, false).await? {
        Ok(a) => a,
        Err((_, why)) => return Ok(Err(format!("the source: {why}"))),
    };
    let dst = match access(ctx, &dst, false).await? {
        Ok(a) => a,
        Err((_, why)) => return Ok(Err(format!("the destination: {why}"))),
    };
    // A destination far behind the source in revisions would take a write per revision.
    let gap = async {
        let mut s = etcd::connect_as(&src.endpoints, &src.creds)
            .await
            .map_err(|e| e.to_string())?;
        let mut d = etcd::connect_as(&dst.endpoints, &dst.creds)
            .await
            .map_err(|e| e.to_string())?;
        Ok::<i64, String>(
            revision(&mut s, &bound.prefix).await? - revision(&mut d, &bound.prefix).await?,
        )
    }
    .await;
    match gap {
        Ok(g) if g > MAX_BUMP => {
            return Ok(Err(format!(
                "NestedDatastore {to} is {g} revisions behind the source: a move raises it above the source with a write per revision, at most {MAX_BUMP}"
            )));
        }
        Ok(_) => {}
        Err(why) => return Ok(Err(why)),
    }
    // Two datastores over one etcd: a copy onto itself, and a retention that ends by
    // deleting the keys in use.
    if let Some(e) = dst.endpoints.iter().find(|e| src.endpoints.contains(e)) {
        return Ok(Err(format!(
            "NestedDatastore {to} and {}/{} share the etcd at {e}: there is nothing to move",
            bound.namespace, bound.name
        )));
    }
    Ok(Ok((src, dst)))
}

/// A move under way, one step further when it can.
async fn go_on(
    ctx: &Context,
    t: &Tenant,
    key: &str,
    mut m: MigrationStatus,
    bound: &TenantDatastoreStatus,
    now: Timestamp,
) -> Result<Step, Error> {
    if m.phase == phases::PENDING {
        return start(ctx, t, key, &m.from.clone(), &m.to.clone(), Some(m)).await;
    }
    if m.phase == phases::CUTTING_OVER {
        return cutting_over(ctx, t, m, now).await;
    }
    let freezing = m.phase == phases::FREEZING;
    let progress = ctx.migrations.progress(key, &m.to);
    // A freeze that does not end in a cut-over soon is lifted: writes again, copy again.
    let held = m
        .frozen_at
        .as_ref()
        .map(|f| now.as_second() - f.0.as_second())
        .unwrap_or_default();
    // (drained too: a cut-over that cannot happen within the limit lifts the freeze as well)
    if freezing && held > FREEZE_LIMIT {
        let why = format!(
            "the copy did not catch up ({})",
            progress
                .as_ref()
                .and_then(|(p, _)| p.error.clone())
                .unwrap_or_else(|| "the destination could not be reached".into())
        );
        return thaw(ctx, t, key, m, bound, held, &why).await;
    }
    let Some((p, freeze)) = progress else {
        // No task (the operator started since): the copy is taken again (from a frozen
        // source, if it was frozen: it no longer changes).
        return match ready_to_move(ctx, t, &m.to).await? {
            Ok((src, dst)) => {
                let started = ctx.migrations.start(
                    key,
                    Job {
                        to: m.to.clone(),
                        tenant: format!("{}/{}", t.namespace(), t.cluster()),
                        src,
                        dst,
                        user: bound.user.clone(),
                        prefix: bound.prefix.clone(),
                    },
                    freezing,
                );
                if !freezing {
                    m.phase = phases::COPYING.into();
                }
                m.message = Some(if started {
                    "copying the tenant's keys again".into()
                } else {
                    format!(
                        "{MAX_MOVES} other moves between datastores run now; this one waits its turn"
                    )
                });
                Ok(Step {
                    status: Some(m),
                    requeue: Some(LOOK),
                    ..Step::default()
                })
            }
            Err(why) => {
                m.message = Some(why);
                Ok(Step {
                    status: Some(m),
                    requeue: Some(Duration::from_secs(5)),
                    ..Step::default()
                })
            }
        };
    };
    if p.revision.is_some() && m.revision.is_none() {
        m.revision = p.revision;
    }
    m.keys = p.keys.or(m.keys);
    m.lag = p.lag;
    if let Some(e) = &p.error {
        let msg = format!("{e}; trying again");
        if m.message.as_deref() != Some(&msg) {
            say(ctx, t, EventType::Warning, RETRYING, &msg).await;
        }
        m.message = Some(msg);
    }
    if freezing {
        freeze.store(true, Ordering::Relaxed);
        if let Some(d) = &p.drained {
            // Consent is asked again: a namespace no longer allowed is not moved in.
            let (to_ns, to_name) = ns_name(&m.to);
            let consent = match get(ctx, &to_ns, &to_name).await? {
                Some(dst) => allowed(ctx, &dst, &t.namespace()).await?,
                None => false,
            };
            if !consent {
                let m = cancel(ctx, t, key, m, bound).await?;
                return Ok(Step {
                    status: Some(m),
                    ..Step::default()
                });
            }
            return cut_over(ctx, t, key, m, d, now).await;
        }
        if p.error.is_none() {
            m.message = Some(
                "writes are frozen on the source: applying the last changes and comparing digests"
                    .into(),
            );
        }
        return Ok(Step {
            status: Some(m),
            requeue: Some(Duration::from_millis(100)),
            ..Step::default()
        });
    }
    if p.following {
        m.phase = phases::FOLLOWING.into();
        m.message = Some(format!(
            "following the source: {} revisions behind",
            p.lag.unwrap_or_default()
        ));
        let not_before = m.retry_after.as_ref().map(|r| r.0);
        if p.caught_up && not_before.is_none_or(|r| now >= r) {
            // Recorded before the role changes: a pass that finds `Freezing` freezes.
            m.phase = phases::FREEZING.into();
            m.frozen_at = Some(Time(now));
            m.message = Some("freezing writes on the source for the cut-over".into());
            return Ok(Step {
                status: Some(m),
                requeue: Some(Duration::from_millis(50)),
                ..Step::default()
            });
        }
    } else if p.error.is_none() {
        m.phase = phases::COPYING.into();
    }
    Ok(Step {
        status: Some(m),
        requeue: Some(LOOK),
        ..Step::default()
    })
}

/// The copy is whole and the source frozen: the tenant's credentials for the destination,
/// and `status.datastore` the destination's (the API server restarts onto it).
async fn cut_over(
    ctx: &Context,
    t: &Tenant,
    key: &str,
    mut m: MigrationStatus,
    d: &Drained,
    now: Timestamp,
) -> Result<Step, Error> {
    let (to_ns, to_name) = ns_name(&m.to);
    let Some(dst) = get(ctx, &to_ns, &to_name).await? else {
        m.message = Some(format!("NestedDatastore {} is gone", m.to));
        return Ok(Step {
            status: Some(m),
            requeue: Some(Duration::from_secs(5)),
            ..Step::default()
        });
    };
    let a = match access(ctx, &dst, false).await? {
        Ok(a) => a,
        Err((_, why)) => {
            m.message = Some(format!("the destination: {why}"));
            return Ok(Step {
                status: Some(m),
                requeue: Some(Duration::from_secs(2)),
                ..Step::default()
            });
        }
    };
    let ns = t.namespace();
    let cluster = t.cluster();
    let user = tenant_user(&ns, &cluster);
    // A role the destination kept read-only (the source of an earlier move, the way back)
    // may write again; the destination's quota judges it from now on.
    etcd::Admin::connect(&a.endpoints, &a.creds)
        .await?
        .set_writable(&user, &tenant_prefix(&ns, &cluster), true)
        .await?;
    issue_credentials(ctx, t, &a, &user).await?;
    ctx.migrations.stop(key);
    let frozen = m
        .frozen_at
        .as_ref()
        .map(|f| (now.as_millisecond() - f.0.as_millisecond()) as f64 / 1000.0)
        .unwrap_or_default();
    say(
        ctx,
        t,
        EventType::Normal,
        FROZEN,
        &format!(
            "the copy on {} equals the source ({} keys, digest {}) after {frozen:.1} s of frozen writes; the API server restarts onto it",
            m.to, d.keys, d.digest
        ),
    )
    .await;
    m.phase = phases::CUTTING_OVER.into();
    m.destination_revision = Some(d.destination_revision);
    m.digest = Some(d.digest.clone());
    m.keys = Some(d.keys);
    m.lag = Some(0);
    m.message = Some(format!(
        "the API server restarts onto {} one replica at a time",
        m.to
    ));
    Ok(Step {
        binding: Some(Binding::Bound(TenantDatastoreStatus {
            name: to_name,
            namespace: to_ns,
            user,
            prefix: tenant_prefix(&ns, &cluster),
            endpoints: a.endpoints,
        })),
        status: Some(m),
        requeue: Some(LOOK),
    })
}

/// The key of an API server's `status.credentials` that names the datastore it runs
/// against ([`datastore_fingerprint`] of its endpoints).
pub const DATASTORE_CREDENTIAL: &str = "datastore";

/// A fingerprint of a datastore's client URLs, as an API server is rendered with them. Pure.
pub fn datastore_fingerprint(endpoints: &[String]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for e in endpoints {
        h.update((e.len() as u64).to_be_bytes());
        h.update(e.as_bytes());
    }
    format!("{:x}", h.finalize())[..16].to_string()
}

/// Whether an API server of the tenant wrote its lease (`registry/masterleases/`) on the
/// destination after revision `after`.
async fn api_server_wrote(ctx: &Context, t: &Tenant, after: i64) -> Result<bool, Error> {
    let Some(bound) = t.datastore().cloned() else {
        return Ok(false);
    };
    let Some(ds) = get(ctx, &bound.namespace, &bound.name).await? else {
        return Ok(false);
    };
    let Ok(a) = access(ctx, &ds, false).await? else {
        return Ok(false);
    };
    let leases = format!("{}registry/masterleases/", bound.prefix);
    let mut client = etcd::connect_as(&a.endpoints, &a.creds).await?;
    // (etcd's count ignores a minimum revision: the keys themselves are looked at)
    let resp = client
        .get(
            leases.as_str(),
            Some(
                GetOptions::new()
                    .with_range(etcd::prefix_end(&leases))
                    .with_keys_only(),
            ),
        )
        .await
        .map_err(|e| Error::Unavailable(format!("reading the destination: {e}")))?;
    Ok(resp.kvs().iter().any(|kv| kv.mod_revision() > after))
}

/// Whether every API server replica runs against the destination with its etcd CA (its
/// status reports both once rolled out and Ready).
async fn on_destination(ctx: &Context, t: &Tenant, endpoints: &[String]) -> Result<bool, Error> {
    let Some(api) = t.apiserver.found() else {
        return Ok(false);
    };
    let at = datastore_fingerprint(endpoints);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &t.namespace());
    let Some(ca) = secrets
        .get_opt(&SecretPurpose::EtcdCa.secret_name(&t.cluster()))
        .await?
    else {
        return Ok(false);
    };
    let want = crate::secrets::fingerprint(&crate::secrets::secret_bytes(&ca));
    let replicas = t.replicas(nestplane_api::names::Component::ApiServer) as i32;
    Ok(api.status.as_ref().is_some_and(|s| {
        s.common.ready
            && s.common.ready_replicas.unwrap_or_default() >= replicas
            && s.common
                .credentials
                .get(SecretPurpose::EtcdCa.suffix())
                .is_some_and(|f| *f == want)
            && s.common
                .credentials
                .get(DATASTORE_CREDENTIAL)
                .is_some_and(|f| *f == at)
    }))
}

async fn cutting_over(
    ctx: &Context,
    t: &Tenant,
    mut m: MigrationStatus,
    now: Timestamp,
) -> Result<Step, Error> {
    let endpoints = t
        .datastore()
        .map(|d| d.endpoints.clone())
        .unwrap_or_default();
    let seconds_since_freeze = |at: Timestamp| {
        m.frozen_at
            .as_ref()
            .map(|f| ((at.as_millisecond() - f.0.as_millisecond()) as f64 / 100.0).round() / 10.0)
    };
    // Writes are taken again once an API server runs on the destination: the first one
    // there writes its lease.
    if m.write_freeze_seconds.is_none()
        && let Some(after) = m.destination_revision
        && api_server_wrote(ctx, t, after).await?
    {
        m.write_freeze_seconds = seconds_since_freeze(now);
    }
    if !on_destination(ctx, t, &endpoints).await? {
        return Ok(Step {
            status: Some(m),
            requeue: Some(LOOK),
            ..Step::default()
        });
    }
    let keep = retention(t);
    m.phase = phases::COMPLETED.into();
    m.completed_at = Some(Time(now));
    if m.write_freeze_seconds.is_none() {
        m.write_freeze_seconds = seconds_since_freeze(now);
    }
    let freeze = m.write_freeze_seconds;
    let rolled = seconds_since_freeze(now).unwrap_or_default();
    m.retain_until = now
        .checked_add(SignedDuration::from_secs(keep))
        .ok()
        .map(Time);
    m.lag = None;
    m.message = Some(format!(
        "the tenant runs on {}; {} keeps a read-only copy until {}",
        m.to,
        m.from,
        m.retain_until
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default()
    ));
    say(
        ctx,
        t,
        EventType::Normal,
        COMPLETED,
        &format!(
            "moved to NestedDatastore {} (writes refused for {:.1} s; every API server replica on it {rolled:.1} s after the freeze); {} keeps the tenant's keys read-only for {keep} s",
            m.to,
            freeze.unwrap_or_default(),
            m.from
        ),
    )
    .await;
    Ok(Step {
        status: Some(m),
        requeue: Some(Duration::from_secs(keep.clamp(1, 60) as u64)),
        ..Step::default()
    })
}

/// After a move: the source's copy is deleted once its retention ends.
async fn retain(
    ctx: &Context,
    t: &Tenant,
    mut m: MigrationStatus,
    now: Timestamp,
) -> Result<Step, Error> {
    if m.source_removed {
        return Ok(Step {
            status: Some(m),
            ..Step::default()
        });
    }
    let until = m.retain_until.as_ref().map(|u| u.0).unwrap_or(now);
    if until > now {
        let left = until.duration_since(now).as_secs().clamp(1, 60) as u64;
        return Ok(Step {
            status: Some(m),
            requeue: Some(Duration::from_secs(left)),
            ..Step::default()
        });
    }
    if remove_copy(ctx, t, &m.from).await? {
        m.source_removed = true;
        m.message = Some(format!(
            "the tenant runs on {}; its copy on {} was deleted after its retention",
            m.to, m.from
        ));
        return Ok(Step {
            status: Some(m),
            ..Step::default()
        });
    }
    Ok(Step {
        status: Some(m),
        requeue: Some(Duration::from_secs(30)),
        ..Step::default()
    })
}

/// Delete the tenant's keys, user and role on datastore `at` (`namespace/name`); `false`
/// when it cannot be reached now (said in an Event).
async fn remove_copy(ctx: &Context, t: &Tenant, at: &str) -> Result<bool, Error> {
    let (ns, name) = ns_name(at);
    let Some(ds) = get(ctx, &ns, &name).await? else {
        return Ok(true);
    };
    let a = match access(ctx, &ds, true).await? {
        Ok(a) => a,
        Err((_, why)) => {
            say(
                ctx,
                t,
                EventType::Warning,
                RETRYING,
                &format!("the tenant's copy on {at} cannot be deleted yet: {why}"),
            )
            .await;
            return Ok(false);
        }
    };
    let (tns, cluster) = (t.namespace(), t.cluster());
    let deleted = etcd::Admin::connect(&a.endpoints, &a.creds)
        .await?
        .remove_tenant(&tenant_user(&tns, &cluster), &tenant_prefix(&tns, &cluster))
        .await?;
    say(
        ctx,
        t,
        EventType::Normal,
        SOURCE_REMOVED,
        &format!("the tenant's {deleted} keys, user and role on {at} were deleted"),
    )
    .await;
    Ok(true)
}

/// A freeze that lasted [`FREEZE_LIMIT`] without the copy catching up: the source writable
/// again, the task stopped; the next pass copies again.
async fn thaw(
    ctx: &Context,
    t: &Tenant,
    key: &str,
    mut m: MigrationStatus,
    bound: &TenantDatastoreStatus,
    held: i64,
    why: &str,
) -> Result<Step, Error> {
    ctx.migrations.stop(key);
    writable_again(ctx, bound).await?;
    let msg = format!(
        "writes were frozen for {held} s; {why}: the source takes writes again, and the move to {} copies again",
        m.to
    );
    say(ctx, t, EventType::Warning, RETRYING, &msg).await;
    m.phase = phases::COPYING.into();
    m.frozen_at = None;
    m.thaws += 1;
    let pause = (REFREEZE << (m.thaws - 1).clamp(0, 10)).min(MAX_REFREEZE);
    m.retry_after = Timestamp::now()
        .checked_add(SignedDuration::from_secs(pause))
        .ok()
        .map(Time);
    m.message = Some(format!(
        "{msg}; the next freeze not before {pause} s from now"
    ));
    Ok(Step {
        status: Some(m),
        requeue: Some(Duration::from_secs(5)),
        ..Step::default()
    })
}

/// The tenant's role on its source datastore may write again.
async fn writable_again(ctx: &Context, bound: &TenantDatastoreStatus) -> Result<(), Error> {
    let Some(ds) = get(ctx, &bound.namespace, &bound.name).await? else {
        return Ok(());
    };
    match access(ctx, &ds, true).await? {
        Ok(a) => {
            etcd::Admin::connect(&a.endpoints, &a.creds)
                .await?
                .set_writable(&bound.user, &bound.prefix, true)
                .await?;
            Ok(())
        }
        Err((_, why)) => Err(Error::Unavailable(format!(
            "the source, to make it writable again: {why}"
        ))),
    }
}

/// A move withdrawn before its cut-over: its task stopped, the source writable again, the
/// destination's partial copy deleted.
async fn cancel(
    ctx: &Context,
    t: &Tenant,
    key: &str,
    mut m: MigrationStatus,
    bound: &TenantDatastoreStatus,
) -> Result<MigrationStatus, Error> {
    ctx.migrations.stop(key);
    if m.phase == phases::FREEZING {
        writable_again(ctx, bound).await?;
    }
    if m.phase != phases::PENDING && !remove_copy(ctx, t, &m.to).await? {
        return Err(Error::Unavailable(format!(
            "the partial copy on {} cannot be deleted yet",
            m.to
        )));
    }
    let msg = format!(
        "the move to {} was withdrawn before its cut-over; the tenant stays on {}/{}",
        m.to, bound.namespace, bound.name
    );
    say(ctx, t, EventType::Normal, CANCELLED, &msg).await;
    m.phase = phases::CANCELLED.into();
    m.lag = None;
    m.message = Some(msg);
    Ok(m)
}

/// A control plane paused, or with a problem, while its move is frozen: the freeze is lifted
/// (writes again) and the move starts over once it is reconciled again.
pub async fn lift(ctx: &Context, t: &Tenant) -> Result<Option<MigrationStatus>, Error> {
    let prev = t.ncp.status.as_ref().and_then(|s| s.migration.clone());
    let (Some(m), Some(bound)) = (prev.clone(), t.datastore().cloned()) else {
        return Ok(prev);
    };
    let key = crate::context::object_key(&t.ncp);
    if before_freeze(&m.phase) {
        // Copies again once reconciled (no task then).
        ctx.migrations.stop(&key);
        return Ok(prev);
    }
    if m.phase != phases::FREEZING {
        return Ok(prev);
    }
    let step = thaw(
        ctx,
        t,
        &key,
        m,
        &bound,
        0,
        "its control plane is paused or has a problem",
    )
    .await?;
    Ok(step.status)
}

/// The condition a control plane with `status.migration` carries: True while a move runs.
pub fn condition(m: &MigrationStatus) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    nestplane_api::conditions::new(
        CONDITION,
        active(m),
        &m.phase,
        m.message.clone().unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(phase: &str) -> MigrationStatus {
        MigrationStatus {
            from: "a/one".into(),
            to: "b/two".into(),
            phase: phase.into(),
            ..MigrationStatus::default()
        }
    }

    #[test]
    fn a_move_holds_the_source_until_its_copy_is_removed_and_the_destination_until_cut_over() {
        assert_eq!(holding(&m(phases::COPYING)), ["a/one", "b/two"]);
        assert_eq!(holding(&m(phases::FREEZING)), ["a/one", "b/two"]);
        assert_eq!(holding(&m(phases::CUTTING_OVER)), ["a/one"]);
        assert_eq!(holding(&m(phases::COMPLETED)), ["a/one"]);
        let mut done = m(phases::COMPLETED);
        done.source_removed = true;
        assert!(holding(&done).is_empty());
        assert!(holding(&m(phases::CANCELLED)).is_empty());
        assert!(active(&m(phases::CUTTING_OVER)) && !active(&m(phases::COMPLETED)));
    }
}
