//! The `NestedRestore` controller: a control plane's keys made exactly an archive's, without
//! a half state anyone can see.
//!
//! 1. **Pending.** The archive is found (a completed `NestedBackup`'s, or a `file://` URL under
//!    the namespace's directory), opened with the key Secret (never made by a restore), and
//!    checked whole: its keys, and that it is this control plane's.
//! 2. **Stopping.** The control plane is annotated [`RESTORE_HOLD_ANNOTATION`]; its API
//!    server, controller manager and scheduler controllers stop every replica and say so
//!    ([`HELD_FOR_RESTORE`]). etcd keeps running. Nothing is written until all three say so.
//! 3. **Restoring.** The keys are replaced ([`engine::restore`]: bounded transactions, keys
//!    the archive does not have deleted, the digest verified) with the tenant's own etcd
//!    credentials.
//! 4. **Starting.** The annotation goes; they start again with a new watch cache, so every
//!    client (kubelets, controllers) that cached the old state is told its resource version
//!    is too old and lists again. **Completed** once the control plane is ready.
//!
//! Each phase is in the status before it is acted on, and each step can be taken again, so an
//! operator stopped at any point resumes and finishes. A hold lasts only while its restore
//! exists and is `Stopping` or `Restoring`: deleting the restore releases it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::backup::{
    HELD_FOR_RESTORE, KEY_KEY, KEY_LEN, NestedBackup, NestedRestore, NestedRestoreStatus,
    RESTORE_HOLD_ANNOTATION, default_key_secret, phases, reasons, restore_phases as rp,
    restore_reasons as rr, types,
};
use nestplane_api::conditions;
use nestplane_api::names::Component;

use super::controller::{BackupContext, datastore_access, read_archive};
use super::{archive, engine, location};
use crate::context::{Context, Error};
use crate::tenant::Tenant;

/// How often a restore that waits for components to stop or start looks again.
pub const STEP: Duration = Duration::from_secs(1);
/// How often a restore that waits for its control plane, archive or key looks again.
pub const RECHECK: Duration = Duration::from_secs(10);

/// The restore that holds `ncp`'s API server, controller manager and scheduler stopped, if
/// any: the one its annotation names, while it exists, is for this control plane, and is
/// `Stopping` or `Restoring`.
pub async fn holding(
    client: &kube::Client,
    ncp: &NestedControlPlane,
) -> Result<Option<String>, Error> {
    let Some(name) = ncp.annotations().get(RESTORE_HOLD_ANNOTATION) else {
        return Ok(None);
    };
    if !plain_name(name) {
        return Ok(None);
    }
    let api: Api<NestedRestore> =
        Api::namespaced(client.clone(), &ncp.namespace().unwrap_or_default());
    let held = api.get_opt(name).await?.is_some_and(|r| {
        r.spec.control_plane_ref.name == ncp.name_any()
            && r.metadata.deletion_timestamp.is_none()
            && matches!(
                r.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some(rp::STOPPING | rp::RESTORING)
            )
    });
    Ok(held.then(|| name.clone()))
}

/// An object name (a DNS subdomain: lower-case letters, digits, `-` and `.`).
fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Where a pass stopped.
enum Stop {
    Waiting(&'static str, String),
    Refused(&'static str, String),
}

/// Reconcile one restore.
pub async fn reconcile(r: Arc<NestedRestore>, ctx: Arc<BackupContext>) -> Result<Action, Error> {
    let status = r.status.clone().unwrap_or_default();
    let phase = status.phase.clone().unwrap_or_else(|| rp::PENDING.into());
    if phase == rp::COMPLETED
        || (phase == rp::FAILED && status.observed_generation == r.metadata.generation)
        || r.metadata.deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    let ns = r.namespace().unwrap_or_default();
    let cp = r.spec.control_plane_ref.name.clone();
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(ncp) = ncps.get_opt(&cp).await? else {
        return settle(
            &ctx,
            &r,
            Stop::Waiting(
                reasons::CONTROL_PLANE_NOT_FOUND,
                format!("NestedControlPlane {ns}/{cp} not found"),
            ),
        )
        .await;
    };
    if !ctx.selects(&ncp) {
        return Ok(Action::await_change());
    }
    // Restores change processes the operator runs on its own machine; the kubernetes
    // runtime's pods outlive their Deployment's scale-down by their grace period.
    if ctx.runtime.patch_policy() == nestplane_render::policy::Runtime::Kubernetes {
        return settle(
            &ctx,
            &r,
            Stop::Refused(
                reasons::INVALID_SPEC,
                "restores run in the process runtime only for now: in the kubernetes runtime, pods serve through their termination grace period after a scale-down".into(),
            ),
        )
        .await;
    }
    // Starting: the hold goes first, whatever else happened since (an archive or key gone).
    if phase == rp::STARTING && !hold(&ctx, &ncp, &r.name_any(), false).await? {
        return Ok(Action::requeue(STEP));
    }
    // Every pass opens the archive whole: nothing is stopped or written for one that would
    // not restore.
    let (url, opened) = match open_archive(&ctx, &r).await? {
        Ok(found) => found,
        Err(stop) => return settle(&ctx, &r, stop).await,
    };
    let ours = format!("{ns}/{cp}");
    if opened.header.tenant != ours {
        return settle(
            &ctx,
            &r,
            Stop::Refused(
                rr::OTHER_CONTROL_PLANE,
                format!(
                    "the archive holds the keys of {}, not of {ours}; restoring into another control plane (a clone) is not built yet",
                    opened.header.tenant
                ),
            ),
        )
        .await;
    }
    let mut s = status;
    s.url = Some(url);
    s.revision = Some(opened.header.revision);
    s.keys = Some(opened.header.keys as i64);
    // Where to go on: a restore refused before (its spec changed since) starts over.
    let mut phase = match phase.as_str() {
        rp::STOPPING | rp::RESTORING | rp::STARTING => phase,
        _ => rp::PENDING.to_string(),
    };

    if phase == rp::PENDING || phase == rp::STOPPING {
        if let Some(other) = holding(&ctx.client, &ncp).await?
            && other != r.name_any()
        {
            return settle(
                &ctx,
                &r,
                Stop::Waiting(
                    rr::CONTROL_PLANE_BUSY,
                    format!("NestedRestore {ns}/{other} is restoring {ours}"),
                ),
            )
            .await;
        }
        if phase == rp::PENDING {
            phase = rp::STOPPING.into();
            s.phase = Some(phase.clone());
            s.stopped_at = Some(Time(Timestamp::now()));
            progress(
                &mut s,
                &r,
                "stopping the API server, controller manager and scheduler",
            );
            write_status(&ctx, &r, &s).await?;
            ctx.event(
                r.object_ref(&()),
                EventType::Normal,
                rp::STOPPING,
                &format!(
                    "stopping {ours}'s API server, controller manager and scheduler to restore {} keys of revision {}",
                    opened.header.keys, opened.header.revision
                ),
            )
            .await;
        }
        if !hold(&ctx, &ncp, &r.name_any(), true).await? {
            progress(&mut s, &r, "waiting to hold the control plane");
            write_status(&ctx, &r, &s).await?;
            return Ok(Action::requeue(STEP));
        }
        let t = Tenant::load(&ctx.client, &ctx.caches, ncp.clone()).await?;
        let waiting: Vec<&str> = [
            Component::ApiServer,
            Component::ControllerManager,
            Component::Scheduler,
        ]
        .into_iter()
        .filter(|&c| !held_by(&t, c, &r.name_any()))
        .map(crate::tenant::kind_of)
        .collect();
        if !waiting.is_empty() {
            let msg = format!("waiting for {} to stop", waiting.join(", "));
            progress(&mut s, &r, &msg);
            write_status(&ctx, &r, &s).await?;
            return Ok(Action::requeue(STEP));
        }
        phase = rp::RESTORING.into();
        s.phase = Some(phase.clone());
        progress(&mut s, &r, "replacing the control plane's keys");
        write_status(&ctx, &r, &s).await?;
    }

    if phase == rp::RESTORING {
        // Held, by this restore, right now: nothing is written into a control plane that runs.
        let ncp = ncps.get(&cp).await?;
        let t = Tenant::load(&ctx.client, &ctx.caches, ncp.clone()).await?;
        let held = [
            Component::ApiServer,
            Component::ControllerManager,
            Component::Scheduler,
        ]
        .into_iter()
        .all(|c| held_by(&t, c, &r.name_any()));
        if holding(&ctx.client, &ncp).await?.as_deref() != Some(r.name_any().as_str()) || !held {
            s.phase = Some(rp::STOPPING.into());
            progress(
                &mut s,
                &r,
                "the control plane is not held any more; stopping it again",
            );
            write_status(&ctx, &r, &s).await?;
            return Ok(Action::requeue(STEP));
        }
        let access = match datastore_access(&ctx, &t).await? {
            Ok(a) => a,
            Err(why) => return failed(&ctx, &r, &s, why).await,
        };
        let mut client =
            match crate::datastore::etcd::connect_as(&access.endpoints, &access.creds).await {
                Ok(c) => c,
                Err(e) => return failed(&ctx, &r, &s, e.to_string()).await,
            };
        let done = match engine::restore(
            &mut client,
            &access.root,
            &opened.records,
            &archive::Limits::default(),
        )
        .await
        {
            Ok(done) => done,
            Err(e) => {
                let why = format!(
                    "replacing the keys: {e}; the control plane stays stopped and it is tried again"
                );
                return failed(&ctx, &r, &s, why).await;
            }
        };
        s.written = Some(done.written as i64);
        s.deleted = Some(done.deleted as i64);
        s.digest = Some(done.digest.clone());
        phase = rp::STARTING.into();
        s.phase = Some(phase.clone());
        progress(
            &mut s,
            &r,
            &format!(
                "{} keys written, {} deleted; starting the API server, controller manager and scheduler",
                done.written, done.deleted
            ),
        );
        write_status(&ctx, &r, &s).await?;
        ctx.event(
            r.object_ref(&()),
            EventType::Normal,
            "Restored",
            &format!(
                "{ours}'s keys are the archive's: {} written, {} deleted, digest verified",
                done.written, done.deleted
            ),
        )
        .await;
    }

    // Starting. Ready means ready since the hold: each of the three said it was held (not
    // ready) before the keys were written.
    // Read again: this very pass may have set the hold.
    let ncp = ncps.get(&cp).await?;
    if !hold(&ctx, &ncp, &r.name_any(), false).await? {
        return Ok(Action::requeue(STEP));
    }
    let t = Tenant::load(&ctx.client, &ctx.caches, ncp.clone()).await?;
    let started = [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ]
    .into_iter()
    .all(|c| t.ready(c));
    if !started || !ncp.status.as_ref().is_some_and(|st| st.ready) {
        progress(&mut s, &r, "waiting for the control plane to be ready");
        write_status(&ctx, &r, &s).await?;
        return Ok(Action::requeue(STEP));
    }
    let now = Timestamp::now();
    s.phase = Some(rp::COMPLETED.into());
    s.completed_at = Some(Time(now));
    s.downtime_seconds = s.stopped_at.as_ref().map(|t| {
        let ms = now.duration_since(t.0).as_millis() as f64;
        (ms / 10.0).round() / 100.0
    });
    let msg = format!(
        "{ours} holds the {} keys of revision {} again and is ready ({:.1} s without its API server)",
        opened.header.keys,
        opened.header.revision,
        s.downtime_seconds.unwrap_or_default()
    );
    conditions::set(
        &mut s.conditions,
        conditions::new(types::READY, true, phases::COMPLETED, &msg),
        r.metadata.generation,
        now,
    );
    s.observed_generation = r.metadata.generation;
    write_status(&ctx, &r, &s).await?;
    ctx.event(
        r.object_ref(&()),
        EventType::Normal,
        phases::COMPLETED,
        &msg,
    )
    .await;
    Ok(Action::await_change())
}

/// Say that writing the keys failed (the control plane stays stopped), and fail the pass so
/// that it is tried again with backoff.
async fn failed(
    ctx: &BackupContext,
    r: &NestedRestore,
    s: &NestedRestoreStatus,
    why: String,
) -> Result<Action, Error> {
    let mut f = s.clone();
    conditions::set(
        &mut f.conditions,
        conditions::new(types::READY, false, rr::RESTORE_FAILED, &why),
        r.metadata.generation,
        Timestamp::now(),
    );
    write_status(ctx, r, &f).await?;
    ctx.event(
        r.object_ref(&()),
        EventType::Warning,
        rr::RESTORE_FAILED,
        &why,
    )
    .await;
    Err(Error::Unavailable(why))
}

/// Whether component `c` of `t` says it is stopped for restore `name`.
fn held_by(t: &Tenant, c: Component, name: &str) -> bool {
    t.status_of(c).is_some_and(|st| {
        st.ready_replicas.unwrap_or_default() == 0
            && conditions::get(&st.conditions, types::READY).is_some_and(|cond| {
                cond.reason == HELD_FOR_RESTORE
                    && cond
                        .message
                        .contains(&format!("NestedRestore {}/{name} ", t.namespace()))
            })
    })
}

/// Set (`set`) or remove this restore's (`name`) hold on `ncp`, as read. Each is a merge
/// patch that carries the resource version read: it fails if the control plane changed since
/// (another restore's hold, any write). A hold is set only where there is none, and only
/// this restore's own hold is removed, never another's. `false` when not done: another holds,
/// or it changed (the next pass reads it again).
async fn hold(
    ctx: &Context,
    ncp: &NestedControlPlane,
    name: &str,
    set: bool,
) -> Result<bool, Error> {
    let current = ncp.annotations().get(RESTORE_HOLD_ANNOTATION).cloned();
    let value = match (set, current.as_deref()) {
        (true, Some(c)) => return Ok(c == name),
        (false, Some(c)) if c != name => return Ok(true),
        (false, None) => return Ok(true),
        (true, None) => serde_json::Value::String(name.to_string()),
        (false, Some(_)) => serde_json::Value::Null,
    };
    let api: Api<NestedControlPlane> =
        Api::namespaced(ctx.client.clone(), &ncp.namespace().unwrap_or_default());
    let patch = serde_json::json!({"metadata": {
        "resourceVersion": ncp.resource_version(),
        "annotations": {RESTORE_HOLD_ANNOTATION: value},
    }});
    match api
        .patch(
            &ncp.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The archive and its URL, opened with its key; `Err` says why not.
async fn open_archive(
    ctx: &BackupContext,
    r: &NestedRestore,
) -> Result<Result<(String, archive::Opened), Stop>, Error> {
    let ns = r.namespace().unwrap_or_default();
    let cp = &r.spec.control_plane_ref.name;
    let (url, backup_key) = match (&r.spec.backup_ref, &r.spec.from) {
        (Some(b), None) => {
            let backups: Api<NestedBackup> = Api::namespaced(ctx.client.clone(), &ns);
            let Some(backup) = backups.get_opt(&b.name).await? else {
                return Ok(Err(Stop::Waiting(
                    rr::BACKUP_NOT_READY,
                    format!("NestedBackup {ns}/{} not found", b.name),
                )));
            };
            let done = backup
                .status
                .as_ref()
                .filter(|s| s.phase.as_deref() == Some(phases::COMPLETED) && s.url.is_some());
            let Some(url) = done.and_then(|s| s.url.clone()) else {
                return Ok(Err(Stop::Waiting(
                    rr::BACKUP_NOT_READY,
                    format!("NestedBackup {ns}/{} is not completed", b.name),
                )));
            };
            let key = backup
                .spec
                .key_secret_ref
                .map(|k| k.name)
                .unwrap_or_else(|| default_key_secret(&backup.spec.control_plane_ref.name));
            (url, Some(key))
        }
        (None, Some(from)) => (from.clone(), None),
        _ => {
            return Ok(Err(Stop::Refused(
                reasons::INVALID_SPEC,
                "a restore names either a backup (backupRef) or an archive (from)".into(),
            )));
        }
    };
    let path: PathBuf = match location::resolve_archive(&url, &ctx.dir, &ns) {
        Ok(p) => p,
        Err(refused) => {
            return Ok(Err(Stop::Refused(
                reasons::LOCATION_REFUSED,
                refused.to_string(),
            )));
        }
    };
    let secret = r
        .spec
        .key_secret_ref
        .as_ref()
        .map(|k| k.name.clone())
        .or(backup_key)
        .unwrap_or_else(|| default_key_secret(cp));
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let key = secrets
        .get_opt(&secret)
        .await?
        .and_then(|s| s.data?.remove(KEY_KEY))
        .map(|k| k.0)
        .filter(|k| k.len() == KEY_LEN);
    let Some(key) = key else {
        return Ok(Err(Stop::Waiting(
            reasons::INVALID_KEY,
            format!("the key Secret {ns}/{secret} does not hold a `{KEY_KEY}` of {KEY_LEN} bytes"),
        )));
    };
    let shown = location::url_of(&path);
    let opened = tokio::task::spawn_blocking(move || {
        let bytes = read_archive(&path)?;
        archive::decode_all(&bytes, &key, &archive::Limits::default())
            .map_err(|e| format!("{}: {e}", path.display()))
    })
    .await
    .map_err(|e| Error::Internal(e.to_string()))?;
    Ok(match opened {
        Ok(o) => Ok((shown, o)),
        Err(why) => Err(Stop::Refused(rr::INVALID_ARCHIVE, why)),
    })
}

fn progress(s: &mut NestedRestoreStatus, r: &NestedRestore, msg: &str) {
    conditions::set(
        &mut s.conditions,
        conditions::new(types::READY, false, rr::IN_PROGRESS, msg),
        r.metadata.generation,
        Timestamp::now(),
    );
    s.observed_generation = r.metadata.generation;
}

async fn write_status(
    ctx: &Context,
    r: &NestedRestore,
    s: &NestedRestoreStatus,
) -> Result<(), Error> {
    if r.status.as_ref() == Some(s) {
        return Ok(());
    }
    let api: Api<NestedRestore> =
        Api::namespaced(ctx.client.clone(), &r.namespace().unwrap_or_default());
    api.patch_status(
        &r.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": s })),
    )
    .await?;
    Ok(())
}

/// Say that the restore waits or is refused (an Event when that is news). A restore that
/// has stopped the control plane keeps its phase: only one that has not started is refused.
async fn settle(ctx: &BackupContext, r: &NestedRestore, stop: Stop) -> Result<Action, Error> {
    let mut s = r.status.clone().unwrap_or_default();
    let started = s
        .phase
        .as_deref()
        .is_some_and(|p| p != rp::PENDING && p != rp::FAILED);
    let (reason, msg, action) = match stop {
        Stop::Waiting(reason, msg) => (reason, msg, Action::requeue(RECHECK)),
        Stop::Refused(reason, msg) if started => (reason, msg, Action::requeue(RECHECK)),
        Stop::Refused(reason, msg) => {
            s.phase = Some(rp::FAILED.into());
            (reason, msg, Action::await_change())
        }
    };
    if s.phase.is_none() {
        s.phase = Some(rp::PENDING.into());
    }
    let before =
        conditions::get(&s.conditions, types::READY).map(|c| (c.reason.clone(), c.message.clone()));
    conditions::set(
        &mut s.conditions,
        conditions::new(types::READY, false, reason, &msg),
        r.metadata.generation,
        Timestamp::now(),
    );
    s.observed_generation = r.metadata.generation;
    write_status(ctx, r, &s).await?;
    if before != Some((reason.to_string(), conditions::cut(&msg, 32 * 1024))) {
        ctx.event(r.object_ref(&()), EventType::Warning, reason, &msg)
            .await;
    }
    Ok(action)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_names_an_object() {
        assert!(plain_name("alpha-restore-1"));
        assert!(plain_name("a.b"));
        for bad in ["", "../x", "a/b", "A", "a?b=c", &"a".repeat(254)] {
            assert!(!plain_name(bad), "{bad}");
        }
    }
}
