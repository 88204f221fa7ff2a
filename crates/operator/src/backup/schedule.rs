//! The `NestedBackupSchedule` controller: a `NestedBackup` of one control plane every period,
//! the newest `keep` completed ones kept and older ones deleted with their archives.
//!
//! What to make and what to delete is decided by [`plan`] (pure) from the schedule's backups
//! (those it made: their UIDs are in its status, which only the operator writes; a label or
//! a name proves nothing, since anyone who may edit a backup can give it one); a pass only
//! carries it out, reading the schedule afresh first.
//! A backup is not made while the schedule's previous one is still being taken (nothing piles
//! up behind a control plane that cannot be backed up), missed periods are not made up, and a
//! backup that an unfinished restore names is never deleted. An archive is deleted only when
//! its header names the backup being deleted (its UID): a file of that name that is another's
//! is left as it is. Deleting the schedule leaves its backups.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::backup::{
    DEFAULT_KEEP, MAX_EVERY_SECONDS, MAX_KEEP, MAX_SCHEDULE_NAME, MIN_EVERY_SECONDS,
    NestedBackupScheduleStatus, SCHEDULE_LABEL, phases, reasons, restore_phases,
    schedule_reasons as sr, types,
};
use nestplane_api::names;
use nestplane_api::{
    NestedBackup, NestedBackupSchedule, NestedBackupSpec, NestedControlPlane, NestedRestore,
    conditions,
};

use super::controller::{BackupContext, RECHECK};
use super::{archive, location};
use crate::context::Error;

/// Where one of a schedule's backups is, as [`plan`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Taken {
    /// Made, waiting or being taken.
    Taking,
    Completed,
    Failed,
}

/// One of a schedule's backups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub name: String,
    /// When it was made (seconds since the epoch).
    pub created: i64,
    pub taken: Taken,
    /// An unfinished restore names it: never deleted.
    pub in_use: bool,
}

/// What a pass does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// A backup to make, by name.
    pub make: Option<String>,
    /// Backups to delete, with their archives, oldest first.
    pub delete: Vec<String>,
    /// When the next backup is due (seconds since the epoch); in the past while one is due
    /// but the previous one is still being taken.
    pub next: i64,
    /// The completed backups left.
    pub kept: usize,
}

/// The name of the backup a schedule `name` makes at `now` (seconds since the epoch):
/// `<name>-<YYYYMMDDhhmmss>`, UTC.
pub fn backup_name(name: &str, now: i64) -> String {
    let at = Timestamp::from_second(now).unwrap_or(Timestamp::UNIX_EPOCH);
    format!("{name}-{}", at.strftime("%Y%m%d%H%M%S"))
}

/// What schedule `name` does at `now`, made every `every` seconds, keeping `keep` completed
/// backups, last made at `last_made` (its status), with `seen` its backups. Pure.
pub fn plan(
    name: &str,
    now: i64,
    every: i64,
    keep: usize,
    suspended: bool,
    last_made: Option<i64>,
    seen: &[Seen],
) -> Plan {
    plan_due(name, now, every, keep, suspended, last_made, seen, false)
}

/// [`plan`], with a backup due `now` whatever the period says when `due_now` (the delta
/// segments of the newest backup stopped: a new backup starts a new chain).
#[allow(clippy::too_many_arguments)]
pub fn plan_due(
    name: &str,
    now: i64,
    every: i64,
    keep: usize,
    suspended: bool,
    last_made: Option<i64>,
    seen: &[Seen],
    due_now: bool,
) -> Plan {
    let mut seen: Vec<&Seen> = seen.iter().collect();
    seen.sort_by(|a, b| (b.created, &b.name).cmp(&(a.created, &a.name)));
    let latest = seen.first().map(|s| s.created).max(last_made);
    let mut next = latest.map_or(now, |l| l.saturating_add(every));
    if due_now {
        next = next.min(now);
    }
    let busy = seen.iter().any(|s| s.taken == Taken::Taking);
    let mut plan = Plan::default();
    if !suspended && !busy && now >= next {
        let made = backup_name(name, now);
        if !seen.iter().any(|s| s.name == made) {
            plan.make = Some(made);
            next = now.saturating_add(every);
        }
    }
    plan.next = next;
    let completed: Vec<&&Seen> = seen
        .iter()
        .filter(|s| s.taken == Taken::Completed)
        .collect();
    let newest_completed = completed.first().map(|s| s.created);
    let mut delete: Vec<&Seen> = Vec::new();
    if !suspended {
        delete.extend(completed.iter().skip(keep).map(|s| **s));
        let mut failed_kept = false;
        for s in seen.iter().filter(|s| s.taken == Taken::Failed) {
            if newest_completed.is_some_and(|c| s.created < c) || failed_kept {
                delete.push(s);
            } else {
                failed_kept = true;
            }
        }
    }
    delete.retain(|s| !s.in_use);
    delete.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    plan.kept = completed.len()
        - delete
            .iter()
            .filter(|s| s.taken == Taken::Completed)
            .count();
    plan.delete = delete.into_iter().map(|s| s.name.clone()).collect();
    plan
}

/// A schedule's period in seconds, or why it is not one.
pub fn every_seconds(every: &str) -> Result<i64, String> {
    match crate::rotation::parse_duration(every) {
        Some(s) if (MIN_EVERY_SECONDS..=MAX_EVERY_SECONDS).contains(&s) => Ok(s),
        Some(_) => Err(format!(
            "every: {every:?} is not between {MIN_EVERY_SECONDS}s and {}d",
            MAX_EVERY_SECONDS / 86_400
        )),
        None => Err(format!(
            "every: {every:?} is not a period (a number and s, m, h or d: 30m, 6h, 1d)"
        )),
    }
}

/// `deltas.every` in seconds, if it is a period of [`super::tail::EVERY`].
pub fn delta_seconds(every: &str) -> Result<u64, String> {
    let (min, max) = super::tail::EVERY;
    match crate::rotation::parse_duration(every) {
        Some(s) if s >= 0 && (min..=max).contains(&(s as u64)) => Ok(s as u64),
        _ => Err(format!(
            "deltas.every: {every:?} is not a period between {min}s and {}h",
            max / 3600
        )),
    }
}

/// Reconcile one schedule.
pub async fn reconcile(
    s: Arc<NestedBackupSchedule>,
    ctx: Arc<BackupContext>,
) -> Result<Action, Error> {
    if s.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = s.namespace().unwrap_or_default();
    let name = s.name_any();
    // Read again: the status (which backups it made, when) must be its last write, never a
    // cache's older copy (that would make a backup twice, or forget one it made).
    let Some(s) = Api::<NestedBackupSchedule>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&name)
        .await?
        .map(Arc::new)
    else {
        return Ok(Action::await_change());
    };
    let cp = &s.spec.control_plane_ref.name;
    let mut status = s.status.clone().unwrap_or_default();
    status.observed_generation = s.metadata.generation;

    let invalid = if name.len() > MAX_SCHEDULE_NAME {
        Some(format!(
            "a schedule's backups are named <schedule>-<time>: its name may have at most {MAX_SCHEDULE_NAME} characters"
        ))
    } else {
        match (every_seconds(&s.spec.every), s.spec.keep) {
            (Err(why), _) => Some(why),
            (Ok(_), Some(k)) if !(1..=MAX_KEEP).contains(&k) => {
                Some(format!("keep: {k} is not between 1 and {MAX_KEEP}"))
            }
            _ => s
                .spec
                .deltas
                .as_ref()
                .and_then(|d| delta_seconds(&d.every).err()),
        }
    };
    if let Some(why) = invalid {
        ctx.tailers.stop(&s.uid().unwrap_or_default());
        settle(&ctx, &s, status, false, reasons::INVALID_SPEC, &why).await?;
        return Ok(Action::await_change());
    }
    let every = every_seconds(&s.spec.every).unwrap_or(MAX_EVERY_SECONDS);
    let keep = s.spec.keep.unwrap_or(DEFAULT_KEEP) as usize;

    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    match ncps.get_opt(cp).await? {
        // Another operator's (`--watch-filter`); looked at again in case that changes.
        Some(ncp) if !ctx.selects(&ncp) => return Ok(Action::requeue(RECHECK)),
        Some(_) => {}
        None => {
            let msg = format!("NestedControlPlane {ns}/{cp} not found");
            settle(
                &ctx,
                &s,
                status,
                false,
                reasons::CONTROL_PLANE_NOT_FOUND,
                &msg,
            )
            .await?;
            return Ok(Action::requeue(RECHECK));
        }
    }

    let backups: Api<NestedBackup> = Api::namespaced(ctx.client.clone(), &ns);
    // Every backup of the namespace: one it made is its own whatever labels it has now.
    let all = backups.list(&ListParams::default()).await?.items;
    // Its own: those it made (by UID), still there.
    status
        .made
        .retain(|uid| all.iter().any(|b| b.uid().as_deref() == Some(uid)));
    let mine: Vec<NestedBackup> = all
        .into_iter()
        .filter(|b| {
            &b.spec.control_plane_ref.name == cp
                && b.uid().is_some_and(|uid| status.made.contains(&uid))
                // Being deleted already (its archive's finalizer): gone, as far as it goes.
                && b.metadata.deletion_timestamp.is_none()
        })
        .collect();
    let in_use = in_use(&ctx, &ns).await?;
    let seen: Vec<Seen> = mine
        .iter()
        .map(|b| Seen {
            name: b.name_any(),
            created: created(b),
            taken: match b.status.as_ref().and_then(|s| s.phase.as_deref()) {
                Some(phases::COMPLETED) => Taken::Completed,
                // Failed, and its spec changed since: it is being taken again.
                Some(phases::FAILED)
                    if b.status.as_ref().and_then(|s| s.observed_generation)
                        == b.metadata.generation =>
                {
                    Taken::Failed
                }
                _ => Taken::Taking,
            },
            in_use: in_use.names(&ctx, &ns, b),
        })
        .collect();
    let now = Timestamp::now().as_second();
    let suspended = s.spec.suspend == Some(true);
    let last_made = status.last_schedule_time.as_ref().map(|t| t.0.as_second());
    // The delta segments of the newest backup stopped (the watch fell behind compaction):
    // the next backup is due now, and starts a new chain. (Said in the backup's status, so
    // an operator that starts again knows it too.)
    // (Once: not again after a backup made since, whatever became of it.)
    let due_now = s.spec.deltas.is_some()
        && status.last_backup.is_some()
        && status.last_backup == status.last_completed
        && status
            .last_completed
            .as_ref()
            .and_then(|n| mine.iter().find(|b| &b.name_any() == n))
            .and_then(|b| b.status.as_ref()?.point_in_time.as_ref()?.stopped.as_ref())
            .is_some();
    let p = plan_due(
        &name, now, every, keep, suspended, last_made, &seen, due_now,
    );

    for gone in &p.delete {
        if let Some(b) = mine.iter().find(|b| &b.name_any() == gone) {
            // A restore made since the list above names it: it stays.
            if !self::in_use(&ctx, &ns).await?.names(&ctx, &ns, b) && prune(&ctx, &s, b).await? {
                status.made.retain(|uid| b.uid().as_ref() != Some(uid));
            }
        }
    }
    let made = match &p.make {
        Some(made) => match make(&ctx, &s, made).await? {
            Some(uid) => {
                // Recorded at once: a later error in this pass must not leave it unrecorded.
                status.made.push(uid);
                let api: Api<NestedBackupSchedule> = Api::namespaced(ctx.client.clone(), &ns);
                api.patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"status": {
                        "made": status.made,
                        "lastBackup": made,
                        "lastScheduleTime": Time(Timestamp::from_second(now).unwrap_or(Timestamp::UNIX_EPOCH)),
                    }})),
                )
                .await?;
                Some(made)
            }
            None => None,
        },
        None => None,
    };
    if let Some(made) = made {
        status.last_backup = Some(made.clone());
        status.last_schedule_time = Some(Time(
            Timestamp::from_second(now).unwrap_or(Timestamp::UNIX_EPOCH),
        ));
    } else if let Some(b) = seen
        .iter()
        .filter(|b| !p.delete.contains(&b.name))
        .max_by_key(|b| (b.created, &b.name))
        .filter(|b| last_made.is_none_or(|t| b.created >= t))
    {
        // The newest there (this pass's copy of the status may be older than the last make).
        status.last_backup = Some(b.name.clone());
        status.last_schedule_time = Timestamp::from_second(b.created).ok().map(Time);
    }
    status.next_schedule_time = (!suspended)
        .then(|| Timestamp::from_second(p.next).ok().map(Time))
        .flatten();
    status.kept = Some(p.kept as i32);
    let newest_completed = mine
        .iter()
        .filter(|b| !p.delete.contains(&b.name_any()))
        .filter(|b| b.status.as_ref().and_then(|s| s.phase.as_deref()) == Some(phases::COMPLETED))
        .max_by_key(|b| {
            (
                b.metadata.creation_timestamp.clone().map(|t| t.0),
                b.name_any(),
            )
        });
    status.last_completed = newest_completed.map(|b| b.name_any());
    // Ready tells of the newest backup: its wait or refusal, else the newest completed one.
    let newest = mine
        .iter()
        .filter(|b| !p.delete.contains(&b.name_any()))
        .max_by_key(|b| {
            (
                b.metadata.creation_timestamp.clone().map(|t| t.0),
                b.name_any(),
            )
        });
    let trouble = newest.filter(|_| made.is_none()).and_then(|b| {
        let st = b.status.as_ref()?;
        let c = conditions::get(&st.conditions, types::READY)?;
        let waits_or_failed = st.phase.as_deref() == Some(phases::FAILED)
            || (st.phase.as_deref() == Some(phases::PENDING) && c.status == "False")
            || (st.phase.as_deref() == Some(phases::RUNNING) && c.reason == reasons::BACKUP_FAILED);
        waits_or_failed.then(|| (c.reason.clone(), format!("{}: {}", b.name_any(), c.message)))
    });
    let next_at = status
        .next_schedule_time
        .as_ref()
        .map(|t| t.0.to_string())
        .unwrap_or_default();
    let (ok, reason, msg) = if suspended {
        (
            false,
            sr::SUSPENDED.to_string(),
            "suspend is true: no backup is made or deleted".to_string(),
        )
    } else if let Some((reason, msg)) = trouble {
        (false, reason, msg)
    } else if let Some(b) = newest_completed {
        (
            true,
            sr::BACKED_UP.to_string(),
            format!(
                "{} completed; {} kept (keep {keep}); next at {next_at}",
                b.name_any(),
                p.kept
            ),
        )
    } else {
        (
            false,
            sr::WAITING_FOR_FIRST.to_string(),
            format!(
                "{} is being taken",
                status.last_backup.clone().unwrap_or_default()
            ),
        )
    };
    settle(&ctx, &s, status, ok, &reason, &msg).await?;
    // Once the status names the newest completed backup (its follower reads it there).
    match (&s.spec.deltas, newest_completed) {
        (Some(d), Some(b)) if !suspended => {
            let every = delta_seconds(&d.every).unwrap_or(super::tail::EVERY.1);
            if let Err(why) = ctx.tailers.ensure(&ctx, &s, b, Duration::from_secs(every)) {
                ctx.event(
                    s.object_ref(&()),
                    EventType::Warning,
                    sr::DELTAS_REFUSED,
                    &why,
                )
                .await;
            }
        }
        _ => ctx.tailers.stop(&s.uid().unwrap_or_default()),
    }

    // Looked at again when a backup of it changes (its watch), when the next is due, and
    // while one is being taken (or a made one is not there yet), every RECHECK.
    if suspended {
        return Ok(Action::await_change());
    }
    let busy = seen.iter().any(|b| b.taken == Taken::Taking) || p.make.is_some();
    let until = (p.next - Timestamp::now().as_second()).max(1) as u64;
    Ok(Action::requeue(if busy {
        RECHECK
    } else {
        Duration::from_secs(until)
    }))
}

fn created(b: &NestedBackup) -> i64 {
    b.metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_second())
}

/// Backup `b`'s archive: the URL its status names once written, else where its spec says.
pub(super) fn archive_of(
    ctx: &BackupContext,
    ns: &str,
    b: &NestedBackup,
) -> Option<location::Archive> {
    match b.status.as_ref().and_then(|s| s.url.as_deref()) {
        Some(url) => location::locate_archive(url, &ctx.dir, ns).ok(),
        None => location::locate(b.spec.location.as_deref(), &ctx.dir, ns)
            .ok()
            .map(|loc| loc.archive(&b.name_any())),
    }
}

/// What restores not yet done name: backups, and archives (resolved).
pub(super) struct InUse {
    backups: Vec<String>,
    urls: Vec<String>,
}

impl InUse {
    /// Whether they name backup `b` or its archive.
    pub(super) fn names(&self, ctx: &BackupContext, ns: &str, b: &NestedBackup) -> bool {
        let name = b.name_any();
        if self.backups.contains(&name) {
            return true;
        }
        let Some(archive) = archive_of(ctx, ns, b) else {
            return false;
        };
        // (Objects are compared by bucket and key, whatever server: one more archive kept.)
        self.urls
            .iter()
            .any(|u| location::locate_archive(u, &ctx.dir, ns).is_ok_and(|a| a == archive))
    }
}

/// The backups (by name) and archives (by URL) that restores not yet done name.
pub(super) async fn in_use(ctx: &BackupContext, ns: &str) -> Result<InUse, Error> {
    let restores: Api<NestedRestore> = Api::namespaced(ctx.client.clone(), ns);
    let open: Vec<NestedRestore> = restores
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|r| {
            !matches!(
                r.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some(restore_phases::COMPLETED | restore_phases::FAILED)
            )
        })
        .collect();
    Ok(InUse {
        backups: open
            .iter()
            .filter_map(|r| r.spec.backup_ref.as_ref().map(|b| b.name.clone()))
            .collect(),
        urls: open.iter().filter_map(|r| r.spec.from.clone()).collect(),
    })
}

/// Make backup `made` of the schedule's control plane: its UID; `None` when a backup of
/// that name is in the way (said in an Event).
async fn make(
    ctx: &BackupContext,
    s: &NestedBackupSchedule,
    made: &str,
) -> Result<Option<String>, Error> {
    let ns = s.namespace().unwrap_or_default();
    let b = NestedBackup {
        metadata: ObjectMeta {
            name: Some(made.to_string()),
            namespace: Some(ns.clone()),
            labels: Some(
                [
                    (SCHEDULE_LABEL.to_string(), s.name_any()),
                    (
                        names::MANAGED_BY_LABEL.to_string(),
                        names::MANAGED_BY.to_string(),
                    ),
                ]
                .into(),
            ),
            ..Default::default()
        },
        spec: NestedBackupSpec {
            control_plane_ref: s.spec.control_plane_ref.clone(),
            location: s.spec.location.clone(),
            key_secret_ref: s.spec.key_secret_ref.clone(),
            deletion_policy: s.spec.deletion_policy,
            s3: s.spec.s3.clone(),
        },
        status: None,
    };
    match Api::<NestedBackup>::namespaced(ctx.client.clone(), &ns)
        .create(&PostParams::default(), &b)
        .await
    {
        Ok(b) => {
            ctx.event_as(
                s.object_ref(&()),
                EventType::Normal,
                sr::CREATED,
                made,
                &format!("made NestedBackup {ns}/{made}"),
            )
            .await;
            Ok(b.uid())
        }
        // Someone's, or made by a pass that stopped before recording it: not its own either
        // way (never deleted by it).
        Err(kube::Error::Api(e)) if e.code == 409 => {
            ctx.event(
                s.object_ref(&()),
                EventType::Warning,
                sr::NAME_TAKEN,
                &format!("NestedBackup {ns}/{made} exists and is not one this schedule made; a backup is made on the next pass"),
            )
            .await;
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// Delete backup `b` past the schedule's retention: its archive first (only if the archive
/// is its own), then the object, so that a pass stopped between the two finds the object
/// again and ends the job. True once it is gone.
async fn prune(
    ctx: &BackupContext,
    s: &NestedBackupSchedule,
    b: &NestedBackup,
) -> Result<bool, Error> {
    let ns = b.namespace().unwrap_or_default();
    let name = b.name_any();
    let uid = b.uid().unwrap_or_default();
    let what = match archive_of(ctx, &ns, b) {
        Some(a) => super::store::remove_own(ctx, &ns, b, &a).await,
        None => Removed::Nothing,
    };
    let note = match what {
        Removed::Archive(url) => format!("deleted NestedBackup {ns}/{name} and its archive {url}"),
        Removed::Nothing => format!("deleted NestedBackup {ns}/{name}; it had no archive"),
        Removed::Other(why) => format!("deleted NestedBackup {ns}/{name}; {why}"),
        Removed::Failed(why) => {
            // The object stays, so the archive is looked at again by the next pass.
            ctx.event_as(
                s.object_ref(&()),
                EventType::Warning,
                sr::PRUNED,
                &name,
                &format!("NestedBackup {ns}/{name} is past the retention, but its archive could not be deleted: {why}"),
            )
            .await;
            return Ok(false);
        }
    };
    let api: Api<NestedBackup> = Api::namespaced(ctx.client.clone(), &ns);
    let pre = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    };
    match api.delete(&name, &pre).await {
        Ok(_) => {}
        // Gone already (another object of its name is not it).
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => return Ok(true),
        Err(e) => return Err(e.into()),
    }
    ctx.event_as(
        s.object_ref(&()),
        EventType::Normal,
        sr::PRUNED,
        &name,
        &note,
    )
    .await;
    Ok(true)
}

/// What [`remove_own`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Removed {
    /// The backup's own archive, deleted (its URL).
    Archive(String),
    /// There was none.
    Nothing,
    /// A file of its name that is not its archive: left as it is (why).
    Other(String),
    /// It could not be read or deleted.
    Failed(String),
}

/// Delete the archive at `path` (under `root`) if its header names backup `uid`; never
/// through a link (the file's or any directory's below `root`), and never a file that is not
/// that backup's.
pub(super) fn remove_own(root: &Path, path: &Path, uid: &str) -> Removed {
    let removed = remove_archive(root, path, uid);
    // What an operator stopped while writing it left (it counts against the quota too).
    if !uid.is_empty() && !matches!(removed, Removed::Failed(_)) {
        let tmp = path.with_file_name(format!(".tmp-{uid}"));
        let dirs_own = path
            .parent()
            .and_then(|d| d.strip_prefix(root).ok())
            .is_some_and(|below| {
                let mut at = root.to_path_buf();
                below.components().all(|c| {
                    at.push(c);
                    std::fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir())
                })
            });
        if dirs_own && std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_file()) {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    removed
}

fn remove_archive(root: &Path, path: &Path, uid: &str) -> Removed {
    let Some(below) = path.parent().and_then(|d| d.strip_prefix(root).ok()) else {
        return Removed::Other(format!(
            "{} is not under {}",
            path.display(),
            root.display()
        ));
    };
    let mut at = root.to_path_buf();
    for c in below.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Removed::Other(format!(
                    "{} is not a directory of its own; {} is left as it is",
                    at.display(),
                    path.display()
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Removed::Nothing,
            Err(e) => return Removed::Failed(format!("{}: {e}", at.display())),
        }
    }
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Removed::Nothing,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Removed::Other(format!(
                "{} is a link, not its archive; it is left as it is",
                path.display()
            ));
        }
        Err(e) => return Removed::Failed(format!("{}: {e}", path.display())),
    };
    match f.metadata() {
        Ok(m) if m.is_file() => {}
        Ok(_) => {
            return Removed::Other(format!(
                "{} is not its archive; it is left as it is",
                path.display()
            ));
        }
        Err(e) => return Removed::Failed(format!("{}: {e}", path.display())),
    }
    let mut head = Vec::new();
    if let Err(e) = f.take(archive::HEADER_SPAN).read_to_end(&mut head) {
        return Removed::Failed(format!("{}: {e}", path.display()));
    }
    match archive::read_header(&head) {
        Ok(h) if !uid.is_empty() && h.id == uid => match std::fs::remove_file(path) {
            Ok(()) => Removed::Archive(location::url_of(path)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Removed::Nothing,
            Err(e) => Removed::Failed(format!("removing {}: {e}", path.display())),
        },
        _ => Removed::Other(format!(
            "{} is not its archive (another backup's, or not an archive); it is left as it is",
            path.display()
        )),
    }
}

/// Write the schedule's status, Ready as given; an Event when a warning is news.
async fn settle(
    ctx: &BackupContext,
    s: &NestedBackupSchedule,
    mut status: NestedBackupScheduleStatus,
    ok: bool,
    reason: &str,
    msg: &str,
) -> Result<(), Error> {
    let before = s
        .status
        .as_ref()
        .and_then(|st| conditions::get(&st.conditions, types::READY))
        .map(|c| (c.reason.clone(), c.message.clone()));
    status.observed_generation = s.metadata.generation;
    conditions::set(
        &mut status.conditions,
        conditions::new(types::READY, ok, reason, msg),
        s.metadata.generation,
        Timestamp::now(),
    );
    if s.status.as_ref() != Some(&status) {
        Api::<NestedBackupSchedule>::namespaced(
            ctx.client.clone(),
            &s.namespace().unwrap_or_default(),
        )
        .patch_status(
            &s.name_any(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "status": super::restore::status_patch(s.status.as_ref(), &status)
                    .map_err(|e| Error::Internal(e.to_string()))?
            })),
        )
        .await?;
    }
    if !ok
        && reason != sr::WAITING_FOR_FIRST
        && before.as_ref().map(|(r, _)| r.as_str()) != Some(reason)
    {
        ctx.event(s.object_ref(&()), EventType::Warning, reason, msg)
            .await;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn seen(name: &str, created: i64, taken: Taken) -> Seen {
        Seen {
            name: name.into(),
            created,
            taken,
            in_use: false,
        }
    }

    const NOW: i64 = 1_800_000_000;

    #[test]
    fn the_first_backup_is_made_at_once_and_the_next_one_period_later() {
        let p = plan("nightly", NOW, 3600, 7, false, None, &[]);
        assert_eq!(p.make.as_deref(), Some("nightly-20270115080000"));
        assert_eq!(p.next, NOW + 3600);
        assert!(p.delete.is_empty());
        // Made: not again before the period is over, whatever its phase.
        let made = [seen("nightly-20270115080000", NOW, Taken::Completed)];
        let p = plan("nightly", NOW + 3599, 3600, 7, false, Some(NOW), &made);
        assert_eq!((p.make, p.next, p.kept), (None, NOW + 3600, 1));
        let p = plan("nightly", NOW + 3600, 3600, 7, false, Some(NOW), &made);
        assert_eq!(p.make.as_deref(), Some("nightly-20270115090000"));
        // The status's time counts even when the backup itself was deleted by hand.
        // Due now when the newest backup's delta segments stopped (once nothing is taken).
        let p = plan_due("nightly", NOW + 10, 3600, 7, false, Some(NOW), &made, true);
        assert_eq!(
            p.make.as_deref(),
            Some(backup_name("nightly", NOW + 10).as_str())
        );
        let p = plan("nightly", NOW + 10, 3600, 7, false, Some(NOW), &[]);
        assert_eq!((p.make, p.next), (None, NOW + 3600));
    }

    #[test]
    fn nothing_is_made_while_the_last_is_taken_and_missed_periods_are_not_made_up() {
        let taking = [seen("s-1", NOW - 7200, Taken::Taking)];
        let p = plan("s", NOW, 60, 7, false, Some(NOW - 7200), &taking);
        assert_eq!(p.make, None);
        assert_eq!(p.next, NOW - 7200 + 60, "due, and says so");
        // Done at last: one backup now, the next a period from now.
        let done = [seen("s-1", NOW - 7200, Taken::Completed)];
        let p = plan("s", NOW, 60, 7, false, Some(NOW - 7200), &done);
        assert!(p.make.is_some());
        assert_eq!(p.next, NOW + 60);
    }

    #[test]
    fn the_newest_completed_are_kept_and_older_ones_deleted_oldest_first() {
        let all: Vec<Seen> = (0..5)
            .map(|i| seen(&format!("s-{i}"), NOW - 100 + i, Taken::Completed))
            .collect();
        let p = plan("s", NOW, 3600, 2, false, Some(NOW - 96), &all);
        assert_eq!(p.delete, ["s-0", "s-1", "s-2"]);
        assert_eq!(p.kept, 2);
        // A backup being taken is not counted until it completes.
        let mut more = all.clone();
        more.push(seen("s-5", NOW - 1, Taken::Taking));
        let p = plan("s", NOW, 3600, 2, false, Some(NOW - 1), &more);
        assert_eq!(p.delete, ["s-0", "s-1", "s-2"]);
        // One a restore names stays, and counts as kept.
        let mut used = all.clone();
        used[0].in_use = true;
        let p = plan("s", NOW, 3600, 2, false, Some(NOW - 96), &used);
        assert_eq!(p.delete, ["s-1", "s-2"]);
        assert_eq!(p.kept, 3);
    }

    #[test]
    fn failures_older_than_a_success_go_and_only_the_newest_other_stays() {
        let all = [
            seen("s-0", NOW - 50, Taken::Failed),
            seen("s-1", NOW - 40, Taken::Completed),
            seen("s-2", NOW - 30, Taken::Failed),
            seen("s-3", NOW - 20, Taken::Failed),
        ];
        let p = plan("s", NOW, 3600, 7, false, Some(NOW - 20), &all);
        assert_eq!(p.delete, ["s-0", "s-2"]);
        assert_eq!(p.kept, 1);
        // Nothing ever completed: the newest failure is kept, to be read.
        let failed = [
            seen("s-0", NOW - 50, Taken::Failed),
            seen("s-1", NOW - 40, Taken::Failed),
        ];
        let p = plan("s", NOW, 3600, 7, false, Some(NOW - 40), &failed);
        assert_eq!(p.delete, ["s-0"]);
    }

    #[test]
    fn a_suspended_schedule_makes_and_deletes_nothing() {
        let all: Vec<Seen> = (0..5)
            .map(|i| seen(&format!("s-{i}"), NOW - 100 + i, Taken::Completed))
            .collect();
        let p = plan("s", NOW, 60, 1, true, Some(NOW - 96), &all);
        assert_eq!((p.make, p.delete.len(), p.kept), (None, 0, 5));
    }

    #[test]
    fn a_period_is_between_ten_seconds_and_a_year() {
        assert_eq!(every_seconds("10s"), Ok(10));
        assert_eq!(every_seconds("6h"), Ok(21_600));
        assert_eq!(every_seconds("1d"), Ok(86_400));
        for bad in [
            "9s",
            "0s",
            "367d",
            "",
            "1h30m",
            "-5m",
            "5",
            "99999999999999999999d",
        ] {
            assert!(every_seconds(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_the_backups_own_archive_is_deleted_never_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let key = [1u8; 32];
        let mut header = archive::header_for("ns/cp", "v1.20.2", 7, "2026-11-29T00:00:00Z", &[]);
        header.id = "uid-1".into();
        let bytes = archive::encode(&header, &[], &key).unwrap();
        let own = dir.path().join("b.npbackup");
        std::fs::write(&own, &bytes).unwrap();
        // Another backup's UID, a file that is not an archive, a link to an archive: left.
        assert!(matches!(
            remove_own(dir.path(), &own, "uid-2"),
            Removed::Other(_)
        ));
        assert!(matches!(
            remove_own(dir.path(), &own, ""),
            Removed::Other(_)
        ));
        let other = dir.path().join("other.npbackup");
        std::fs::write(&other, b"someone else's").unwrap();
        assert!(matches!(
            remove_own(dir.path(), &other, "uid-1"),
            Removed::Other(_)
        ));
        let link = dir.path().join("link.npbackup");
        std::os::unix::fs::symlink(&own, &link).unwrap();
        assert!(matches!(
            remove_own(dir.path(), &link, "uid-1"),
            Removed::Other(_)
        ));
        // An archive reached through a directory that is a link: left.
        let away = tempfile::tempdir().unwrap();
        std::fs::copy(&own, away.path().join("b.npbackup")).unwrap();
        std::os::unix::fs::symlink(away.path(), dir.path().join("away")).unwrap();
        let through = dir.path().join("away/b.npbackup");
        assert!(matches!(
            remove_own(dir.path(), &through, "uid-1"),
            Removed::Other(_)
        ));
        assert!(away.path().join("b.npbackup").exists());
        assert!(own.exists() && other.exists() && link.exists());
        // What a stopped write of it left goes with it; another backup's does not.
        std::fs::write(dir.path().join(".tmp-uid-1"), b"half").unwrap();
        std::fs::write(dir.path().join(".tmp-uid-2"), b"half").unwrap();
        // Its own: deleted; then there is nothing.
        assert_eq!(
            remove_own(dir.path(), &own, "uid-1"),
            Removed::Archive(location::url_of(&own))
        );
        assert!(!own.exists());
        assert!(!dir.path().join(".tmp-uid-1").exists());
        assert!(dir.path().join(".tmp-uid-2").exists());
        assert_eq!(remove_own(dir.path(), &own, "uid-1"), Removed::Nothing);
    }
}
