//! Point in time: after a schedule's newest backup completes, its control plane's changes
//! are followed with a watch on its key root (from the backup's revision, with the
//! tenant's own etcd credentials) and written beside the archive as delta segments
//! ([`super::delta`]), one every `deltas.every` when there were changes. The backup's
//! `status.pointInTime` says how far they reach.
//!
//! One task per schedule, for its newest completed backup; a newer one completed replaces
//! it. The task looks at its schedule every period and ends when it is no longer wanted
//! (the schedule gone, suspended, without `deltas`, or with a newer backup). An operator
//! that starts again goes on from the last segment written (it looks for segments past the
//! status, so a segment written just before a stop is not written twice). A watch that falls
//! behind the datastore's compaction cannot go on: the backup says so, and the schedule makes
//! a new backup at once, which starts a new chain.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd_client::{EventType as WatchEventType, WatchOptions};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::backup::{
    NestedBackup, NestedBackupSchedule, PointInTime, phases, schedule_reasons as sr,
};
use nestplane_api::names::{self, Component};

use super::controller::{BackupContext, RECHECK, archive_key, datastore_access};
use super::delta::{self, Change, Event};
use super::{archive, store};
use crate::datastore::etcd;
use crate::tenant::Tenant;

/// A segment is cut early past this many bytes of events (keys, values, and
/// [`EVENT_OVERHEAD`] each).
pub const SEGMENT_BYTES: usize = 16 << 20;
/// What one event costs in memory besides its key and value.
pub const EVENT_OVERHEAD: usize = 128;
/// Why a chain ends when its tenant moves to another datastore.
const MOVED: &str = "the control plane moved to another datastore (its changes are there now)";
/// A segment is cut early past this many events, or this many distinct leases (what a
/// restore accepts of an archive is more).
pub const SEGMENT_EVENTS: usize = 100_000;
pub const SEGMENT_LEASES: usize = 500;
/// The longest pause between tries after an error.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// The shortest and longest `deltas.every`.
pub const EVERY: (u64, u64) = (10, 3600);

/// Delta followers one namespace may run at once: each holds a watch of a tenant's keys
/// and its unsealed changes (up to [`SEGMENT_BYTES`]) in the operator.
pub const MAX_FOLLOWERS_PER_NAMESPACE: usize = 8;

/// Whether a namespace whose other schedules have `others` followers may start one more.
/// Pure.
fn room(ns: &str, others: usize) -> Result<(), String> {
    if others < MAX_FOLLOWERS_PER_NAMESPACE {
        return Ok(());
    }
    Err(format!(
        "namespace {ns} has {others} schedules whose delta segments are followed already (at most {MAX_FOLLOWERS_PER_NAMESPACE}); this one's wait for one of them to end, and its backups go on"
    ))
}

#[cfg(test)]
mod room_tests {
    #[test]
    fn a_namespace_follows_at_most_eight_schedules_at_once() {
        assert!(super::room("a", 0).is_ok());
        assert!(super::room("a", super::MAX_FOLLOWERS_PER_NAMESPACE - 1).is_ok());
        let why = super::room("a", super::MAX_FOLLOWERS_PER_NAMESPACE).expect_err("a ninth");
        assert!(
            why.contains("namespace a has 8") && why.contains("backups go on"),
            "{why}"
        );
    }
}

struct Running {
    ns: String,
    base: String,
    task: tokio::task::JoinHandle<()>,
    behind: Arc<AtomicBool>,
}

/// The tasks following control planes, by schedule UID.
#[derive(Default)]
pub struct Tailers(std::sync::Mutex<HashMap<String, Running>>);

impl Drop for Tailers {
    fn drop(&mut self) {
        for r in self.0.lock().unwrap_or_else(|e| e.into_inner()).values() {
            r.task.abort();
        }
    }
}

impl Tailers {
    /// Follow `base` (schedule `s`'s newest completed backup) every `every`, unless that is
    /// done already. Refused (why) while its namespace has [`MAX_FOLLOWERS_PER_NAMESPACE`]
    /// followers of other schedules.
    pub fn ensure(
        &self,
        ctx: &Arc<BackupContext>,
        s: &NestedBackupSchedule,
        base: &NestedBackup,
        every: Duration,
    ) -> Result<(), String> {
        let (Some(suid), Some(buid)) = (s.uid(), base.uid()) else {
            return Ok(());
        };
        let ns = s.namespace().unwrap_or_default();
        // Its chain stopped (fell behind compaction): the next backup starts a new one.
        if base
            .status
            .as_ref()
            .and_then(|st| st.point_in_time.as_ref())
            .is_some_and(|p| p.stopped.is_some())
        {
            self.stop(&suid);
            return Ok(());
        }
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = map.get(&suid) {
            if r.base == buid && !r.task.is_finished() {
                return Ok(());
            }
            if r.base == buid && r.behind.load(Ordering::Relaxed) {
                // Fell behind: a new backup starts a new chain; nothing to follow until then.
                return Ok(());
            }
            r.task.abort();
        }
        let others = map
            .iter()
            .filter(|(k, r)| **k != suid && r.ns == ns && !r.task.is_finished())
            .count();
        if let Err(why) = room(&ns, others) {
            map.remove(&suid);
            return Err(why);
        }
        let behind = Arc::new(AtomicBool::new(false));
        let follow = Follow {
            ctx: ctx.clone(),
            ns: ns.clone(),
            schedule: s.name_any(),
            schedule_uid: suid.clone(),
            base: base.name_any(),
            base_uid: buid.clone(),
            every,
            behind: behind.clone(),
        };
        let stop = ctx.shutdown.clone();
        let task = tokio::spawn(async move {
            tokio::select! {
                () = follow.run() => {}
                () = stop.cancelled() => {}
            }
        });
        map.insert(
            suid,
            Running {
                ns,
                base: buid,
                task,
                behind,
            },
        );
        Ok(())
    }

    /// Stop following for schedule `uid`.
    pub fn stop(&self, uid: &str) {
        if let Some(r) = self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(uid) {
            r.task.abort();
        }
    }
}

struct Follow {
    ctx: Arc<BackupContext>,
    ns: String,
    schedule: String,
    schedule_uid: String,
    base: String,
    base_uid: String,
    every: Duration,
    behind: Arc<AtomicBool>,
}

enum Stop {
    /// No longer wanted.
    Done,
    /// The watch's revision was compacted.
    Compacted(String),
    /// The control plane holds what no segment may (a key a restore would refuse).
    Cannot(String),
    /// Tried again after [`RECHECK`].
    Retry(String),
}

impl From<kube::Error> for Stop {
    fn from(e: kube::Error) -> Self {
        Stop::Retry(e.to_string())
    }
}

impl From<crate::context::Error> for Stop {
    fn from(e: crate::context::Error) -> Self {
        Stop::Retry(e.to_string())
    }
}

impl Follow {
    async fn run(self) {
        let mut backoff = RECHECK;
        let mut said = String::new();
        loop {
            match self.follow().await {
                Stop::Done => return,
                Stop::Cannot(why) => {
                    let msg = format!(
                        "the delta segments of NestedBackup {}/{} stop: {why}",
                        self.ns, self.base
                    );
                    return self.stopped(sr::DELTAS_FAILED, &msg).await;
                }
                Stop::Compacted(why) => {
                    self.behind.store(true, Ordering::Relaxed);
                    let msg = format!(
                        "the delta segments of NestedBackup {}/{} stop: {why}; a new backup starts a new chain",
                        self.ns, self.base
                    );
                    return self.stopped(sr::DELTAS_BEHIND, &msg).await;
                }
                Stop::Retry(why) => {
                    let msg = format!(
                        "the delta segments of NestedBackup {}/{}: {why}; tried again in {backoff:?}",
                        self.ns, self.base
                    );
                    tracing::warn!("{msg}");
                    // Said once for each new reason (an Event on the schedule).
                    if why != said {
                        self.warn(sr::DELTAS_FAILED, &msg).await;
                        said = why;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// The chain ends: said in the backup's `pointInTime.stopped`, and in an Event of
    /// `reason` on the schedule.
    async fn stopped(&self, reason: &str, msg: &str) {
        let _ = self.patch(serde_json::json!({ "stopped": msg })).await;
        self.warn(reason, msg).await;
    }

    /// A Warning Event on the schedule, if it is still there.
    async fn warn(&self, reason: &str, msg: &str) {
        if let Ok(Some(s)) = self.schedules().get_opt(&self.schedule).await {
            self.ctx
                .event(s.object_ref(&()), EventType::Warning, reason, msg)
                .await;
        }
    }

    fn schedules(&self) -> Api<NestedBackupSchedule> {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }

    fn backups(&self) -> Api<NestedBackup> {
        Api::namespaced(self.ctx.client.clone(), &self.ns)
    }

    /// The base backup, read afresh, while the schedule still wants it followed.
    async fn wanted(&self) -> Result<Option<NestedBackup>, Stop> {
        let Some(s) = self.schedules().get_opt(&self.schedule).await? else {
            return Ok(None);
        };
        let still = s.uid().as_deref() == Some(&self.schedule_uid)
            && s.spec.deltas.is_some()
            && s.spec.suspend != Some(true)
            && s.metadata.deletion_timestamp.is_none()
            && s.status
                .as_ref()
                .and_then(|st| st.last_completed.as_deref())
                == Some(self.base.as_str());
        if !still {
            return Ok(None);
        }
        Ok(self.backups().get_opt(&self.base).await?.filter(|b| {
            b.uid().as_deref() == Some(&self.base_uid)
                && b.metadata.deletion_timestamp.is_none()
                && b.status.as_ref().and_then(|st| st.phase.as_deref()) == Some(phases::COMPLETED)
        }))
    }

    /// When control plane `name`'s data stopped changing on datastore `at`, if it is bound
    /// to another one now: its move's freeze (the source took no write of the tenant's
    /// after it), else now.
    async fn moved(
        &self,
        name: &str,
        at: &Option<(String, String)>,
    ) -> Result<Option<Timestamp>, Stop> {
        let Some(ncp) = Api::<NestedControlPlane>::namespaced(self.ctx.client.clone(), &self.ns)
            .get_opt(name)
            .await?
        else {
            return Ok(None);
        };
        let status = ncp.status.unwrap_or_default();
        let now = status
            .datastore
            .as_ref()
            .map(|d| (d.namespace.clone(), d.name.clone()));
        if now == *at {
            return Ok(None);
        }
        let frozen = status
            .migration
            .filter(|m| {
                at.as_ref()
                    .is_some_and(|(ns, n)| m.from == format!("{ns}/{n}"))
            })
            .and_then(|m| m.frozen_at)
            .map(|f| f.0);
        Ok(Some(frozen.unwrap_or_else(Timestamp::now)))
    }

    async fn patch(&self, pit: serde_json::Value) -> Result<(), kube::Error> {
        self.backups()
            .patch_status(
                &self.base,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": { "pointInTime": pit } })),
            )
            .await
            .map(|_| ())
    }

    async fn follow(&self) -> Stop {
        match self.follow_inner().await {
            Ok(()) => Stop::Done,
            Err(stop) => stop,
        }
    }

    async fn follow_inner(&self) -> Result<(), Stop> {
        let ctx = &self.ctx;
        let Some(base) = self.wanted().await? else {
            return Ok(());
        };
        let ncp = Api::<NestedControlPlane>::namespaced(ctx.client.clone(), &self.ns)
            .get_opt(&base.spec.control_plane_ref.name)
            .await?
            .ok_or_else(|| Stop::Retry("its control plane is not there".into()))?;
        let t = Tenant::load(&ctx.client, &ctx.caches, ncp.clone()).await?;
        let access = datastore_access(ctx, &t).await?.map_err(Stop::Retry)?;
        // Where the tenant's data is: a move to another datastore ends the chain (the source
        // no longer changes; the next backup is taken where the tenant runs).
        let bound_at = t.datastore().map(|d| (d.namespace.clone(), d.name.clone()));
        let key = archive_key(ctx, &base).await?.map_err(Stop::Retry)?;
        let archive = super::schedule::archive_of(ctx, &self.ns, &base)
            .ok_or_else(|| Stop::Retry("its archive's URL is not one to write beside".into()))?;
        let bucket = match store::reach(ctx, &self.ns, &archive, base.spec.s3.as_ref()).await? {
            Ok(b) => b,
            Err(store::Unusable::Refused(_, why) | store::Unusable::Waiting(_, why)) => {
                return Err(Stop::Retry(why));
            }
        };
        let status = base.status.clone().unwrap_or_default();
        let pit = status.point_in_time.clone().unwrap_or_default();
        let mut sequence = pit.segments.max(0) as u64 + 1;
        let mut since = if pit.segments > 0 {
            pit.revision
        } else {
            status.revision.unwrap_or_default()
        };
        // Segments written past what the status says (a stop between the two writes):
        // opened with the key, so that only this chain's are taken as written.
        loop {
            let seg = archive.segment(sequence);
            let bytes = store::read(&seg, bucket.as_ref(), None)
                .await
                .map_err(|e| Stop::Retry(e.to_string()))?;
            let Some(bytes) = bytes else { break };
            let k = key.clone();
            let opened = tokio::task::spawn_blocking(move || {
                archive::decode(&bytes, &k, &archive::Limits::default()).map(|(h, _)| h)
            })
            .await
            .map_err(|e| Stop::Retry(e.to_string()))?;
            match opened {
                Ok(h) if delta::check_link(&h, &self.base_uid, sequence, since).is_ok() => {
                    since = h.revision;
                    sequence += 1;
                }
                _ => {
                    return Err(Stop::Retry(format!(
                        "{} is in the way of the next segment",
                        seg.url()
                    )));
                }
            }
        }
        let start = since
            .checked_add(1)
            .ok_or_else(|| Stop::Retry(format!("revision {since} cannot be followed")))?;
        let version = t
            .running_version(Component::ApiServer)
            .map(|v| v.to_string())
            .or_else(|| ncp.spec.version.clone())
            .unwrap_or_else(|| names::DEFAULT_KUBERNETES_VERSION.to_string());
        let tenant = format!("{}/{}", self.ns, ncp.name_any());

        let mut client = etcd::connect_as(&access.endpoints, &access.creds)
            .await
            .map_err(|e| Stop::Retry(e.to_string()))?;
        let mut stream = client
            .watch(
                access.root.as_str(),
                Some(WatchOptions::new().with_prefix().with_start_revision(start)),
            )
            .await
            .map_err(|e| Stop::Retry(format!("watching: {e}")))?;
        let mut events: Vec<Event> = Vec::new();
        let mut bytes = 0usize;
        let mut leases = std::collections::BTreeSet::new();
        let mut moved: Option<Timestamp> = None;
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let cut = tokio::select! {
                msg = stream.message() => {
                    let resp = match msg {
                        Ok(Some(r)) => r,
                        Ok(None) => return Err(Stop::Retry("the watch ended".into())),
                        Err(e) => return Err(Stop::Retry(format!("the watch: {e}"))),
                    };
                    if resp.compact_revision() > 0 {
                        return Err(Stop::Compacted(format!(
                            "the datastore was compacted at revision {}, past revision {} the segments reach",
                            resp.compact_revision(),
                            since
                        )));
                    }
                    if resp.canceled() {
                        return Err(Stop::Retry(format!("the watch was cancelled: {}", resp.cancel_reason())));
                    }
                    let seen_ms = Timestamp::now().as_millisecond();
                    for e in resp.events() {
                        let Some(kv) = e.kv() else { continue };
                        let Some(rel) = kv.key().strip_prefix(access.root.as_bytes()) else {
                            continue;
                        };
                        let change = match e.event_type() {
                            WatchEventType::Put => Change::Put {
                                value: kv.value().to_vec(),
                                lease: (kv.lease() != 0).then_some(archive::Lease {
                                    id: kv.lease(),
                                    ttl: crate::backup::engine::LEASE_TTL.1,
                                }),
                            },
                            WatchEventType::Delete => Change::Delete,
                        };
                        // What a restore would refuse is never written: the chain stops.
                        archive::check_key(rel).map_err(|e| Stop::Cannot(e.to_string()))?;
                        bytes += rel.len() + kv.value().len() + EVENT_OVERHEAD;
                        if kv.lease() != 0 {
                            leases.insert(kv.lease());
                        }
                        events.push(Event {
                            revision: kv.mod_revision(),
                            seen_ms,
                            key: rel.to_vec(),
                            change,
                        });
                    }
                    bytes > SEGMENT_BYTES
                        || events.len() >= SEGMENT_EVENTS
                        || leases.len() >= SEGMENT_LEASES
                }
                _ = tick.tick() => {
                    if self.wanted().await?.is_none() {
                        return Ok(());
                    }
                    moved = self.moved(&ncp.name_any(), &bound_at).await?;
                    true
                }
            };
            if !cut {
                continue;
            }
            // After a move, the segments reach until its freeze, not until now.
            let now = moved.unwrap_or_else(Timestamp::now);
            if events.is_empty() {
                // Nothing changed: the segments reach until now.
                self.patch(serde_json::json!({
                    "segments": sequence - 1,
                    "revision": since,
                    "until": Time(now),
                }))
                .await?;
                if moved.is_some() {
                    return Err(Stop::Compacted(MOVED.into()));
                }
                continue;
            }
            let last = events.last().map_or(since, |e| e.revision);
            let created = now.to_string();
            let (tenant_name, version_name, id, k) = (
                tenant.clone(),
                version.clone(),
                self.base_uid.clone(),
                key.clone(),
            );
            let batch = std::mem::take(&mut events);
            let sealed = tokio::task::spawn_blocking(move || {
                let records = delta::to_records(&batch);
                drop(batch);
                let mut header =
                    archive::header_for(&tenant_name, &version_name, last, &created, &records);
                header.id = id;
                header.kind = delta::KIND.into();
                header.sequence = sequence;
                header.since = since;
                archive::encode(&header, &records, &k)
            })
            .await
            .map_err(|e| Stop::Retry(e.to_string()))?
            .map_err(|e| Stop::Cannot(format!("sealing a segment: {e}")))?;
            // Not written for a backup deleted (or replaced) since the last look.
            if self.wanted().await?.is_none() {
                return Ok(());
            }
            let seg = archive.segment(sequence);
            store::write_new(ctx, &self.ns, &seg, bucket.as_ref(), &self.base_uid, sealed)
                .await
                .map_err(|why| Stop::Retry(format!("writing {}: {why}", seg.url())))?;
            self.patch(
                serde_json::to_value(PointInTime {
                    segments: sequence as i64,
                    revision: last,
                    until: Some(Time(now)),
                    stopped: None,
                })
                .unwrap_or_default(),
            )
            .await?;
            if moved.is_some() {
                return Err(Stop::Compacted(MOVED.into()));
            }
            since = last;
            sequence += 1;
            bytes = 0;
            leases.clear();
        }
    }
}
