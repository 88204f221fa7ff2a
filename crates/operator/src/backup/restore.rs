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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::backup::{
    CLONED_BY_ANNOTATION, HELD_FOR_RESTORE, KEY_KEY, KEY_LEN, NestedBackup, NestedRestore,
    NestedRestoreStatus, RESTORE_HOLD_ANNOTATION, default_key_secret, phases, reasons,
    restore_phases as rp, restore_reasons as rr, types,
};
use nestplane_api::conditions;
use nestplane_api::names::{self, Component, SecretPurpose};

use super::controller::{BackupContext, datastore_access};
use super::store;
use super::{archive, delta, engine, location};
use crate::context::{Context, Error};
use crate::tenant::Tenant;

/// How often a restore that waits for components to stop or start looks again.
pub const STEP: Duration = Duration::from_secs(1);
/// How often a restore that waits for its control plane, archive or key looks again.
pub const RECHECK: Duration = Duration::from_secs(10);
/// The API server leases under a key root: each names an API server's address.
const MASTER_LEASES: &[u8] = b"masterleases/";

/// The trust a clone takes from its archive: the CA (kubeconfigs, client certificates), the
/// front-proxy CA and the service-account key (tokens). Its etcd CA is its own: a shared
/// datastore's CA certificate is no use to an etcd of the clone's own, and the other way
/// round.
const CLONED_TRUST: [SecretPurpose; 3] = [
    SecretPurpose::ClusterCa,
    SecretPurpose::FrontProxyCa,
    SecretPurpose::ServiceAccount,
];

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
    let clone_of = r.spec.clone_of.as_ref().map(|c| c.name.clone());
    if clone_of.as_deref() == Some(cp.as_str()) {
        return settle(
            &ctx,
            &r,
            Stop::Refused(
                reasons::INVALID_SPEC,
                format!("cloneOf names {cp}, the control plane restored into: a restore into the control plane the archive was taken of leaves cloneOf out"),
            ),
        )
        .await;
    }
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    // A clone's control plane is made once its trust is written: until then, the restore
    // itself says whether this operator is the one (its watch-filter label).
    let ncp = match ncps.get_opt(&cp).await? {
        Some(ncp) if !ctx.selects(&ncp) => return Ok(Action::await_change()),
        Some(ncp) => Some(ncp),
        None if clone_of.is_some() && ctx.selects_labels(r.metadata.labels.as_ref()) => None,
        None if clone_of.is_some() => return Ok(Action::await_change()),
        // Held, and deleted since: what was written went with it.
        None if matches!(phase.as_str(), rp::STOPPING | rp::RESTORING | rp::STARTING)
            && status.control_plane_uid.is_some() =>
        {
            return replaced(&ctx, &r, &format!("{ns}/{cp}")).await;
        }
        None => {
            return settle(
                &ctx,
                &r,
                Stop::Waiting(
                    reasons::CONTROL_PLANE_NOT_FOUND,
                    format!("NestedControlPlane {ns}/{cp} not found"),
                ),
            )
            .await;
        }
    };
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
    let live = matches!(phase.as_str(), rp::STOPPING | rp::RESTORING | rp::STARTING);
    let held_uid = status.control_plane_uid.clone();
    match &ncp {
        // Held, and deleted since: whatever was written went to the one deleted.
        None if live && held_uid.is_some() => {
            return replaced(&ctx, &r, &format!("{ns}/{cp}")).await;
        }
        // A clone whose trust is written waits for its control plane to be made (its watch
        // brings the restore back then) without opening the archive again.
        None if phase == rp::STOPPING => return Ok(Action::requeue(RECHECK)),
        None if live => {
            return settle(
                &ctx,
                &r,
                Stop::Waiting(
                    reasons::CONTROL_PLANE_NOT_FOUND,
                    format!("NestedControlPlane {ns}/{cp} not found"),
                ),
            )
            .await;
        }
        // The control plane this restore held, or another of the same name since?
        Some(ncp)
            if live
                && held_uid
                    .as_deref()
                    .is_some_and(|uid| ncp.metadata.uid.as_deref() != Some(uid)) =>
        {
            return replaced(&ctx, &r, &format!("{ns}/{cp}")).await;
        }
        _ => {}
    }
    // Starting: the hold goes first, whatever else happened since (an archive or key gone).
    if phase == rp::STARTING
        && let Some(ncp) = &ncp
        && !hold(&ctx, ncp, &r.name_any(), false).await?
    {
        return Ok(Action::requeue(STEP));
    }
    // Every pass opens the archive whole: nothing is stopped or written for one that would
    // not restore.
    let (url, mut opened) = match open_archive(&ctx, &r).await? {
        Ok(found) => found,
        Err(stop) => return settle(&ctx, &r, stop).await,
    };
    let ours = format!("{ns}/{cp}");
    let original = format!("{ns}/{}", clone_of.as_deref().unwrap_or(&cp));
    if opened.header.tenant != original {
        let hint = if clone_of.is_some() {
            ""
        } else {
            "; to make a new control plane of them, restore with cloneOf (nestplane backup restore --as)"
        };
        return settle(
            &ctx,
            &r,
            Stop::Refused(
                rr::OTHER_CONTROL_PLANE,
                format!(
                    "the archive holds the keys of {}, not of {original}{hint}",
                    opened.header.tenant
                ),
            ),
        )
        .await;
    }
    if clone_of.is_some() {
        // The original's API server leases name its addresses: the clone's API server
        // writes its own, and no client of the clone is sent to the original.
        leave_out_leases_of_others(&mut opened.records);
    }
    let mut s = status;
    s.url = Some(url);
    s.revision = Some(opened.header.revision);
    s.keys = Some(opened.records.len() as i64);
    // Where to go on: a restore refused before (its spec changed since) starts over.
    let mut phase = match phase.as_str() {
        rp::STOPPING | rp::RESTORING | rp::STARTING => phase,
        _ => rp::PENDING.to_string(),
    };

    // A clone: its control plane is one made for it, and its trust is the archive's before
    // it is made, or it is refused.
    if clone_of.is_some() && phase != rp::STARTING {
        if let Some(ncp) = &ncp
            && let Some(why) = not_made_for(ncp, &r, phase == rp::PENDING)
        {
            // Made for it after its trust was written, but this pass's copy of the restore
            // is older than its own Stopping: read it again.
            if phase == rp::PENDING
                && ncp.annotations().get(RESTORE_HOLD_ANNOTATION) == Some(&r.name_any())
                && Api::<NestedRestore>::namespaced(ctx.client.clone(), &ns)
                    .get(&r.name_any())
                    .await?
                    .status
                    .and_then(|s| s.phase)
                    .is_some_and(|p| p == rp::STOPPING)
            {
                return Ok(Action::requeue(STEP));
            }
            return settle(&ctx, &r, Stop::Refused(rr::NOT_A_NEW_CONTROL_PLANE, why)).await;
        }
        if let Err(stop) = clone_trust(&ctx, &r, &cp, &opened.trust).await? {
            return settle(&ctx, &r, stop).await;
        }
    }
    let Some(ncp) = ncp else {
        // Made meanwhile (while the archive was read), before the restore was Stopping: the
        // next pass refuses it, unless the restore is Stopping already.
        if phase == rp::PENDING && ncps.get_opt(&cp).await?.is_some() {
            return Ok(Action::requeue(STEP));
        }
        // Not made yet: the restore is Stopping from now on, so a control plane made with
        // its hold annotation is held from its first pass.
        phase = rp::STOPPING.into();
        s.phase = Some(phase.clone());
        s.stopped_at = None;
        s.control_plane_uid = None;
        progress(
            &mut s,
            &r,
            &format!(
                "the trust is written: create NestedControlPlane {ours} with the annotation {RESTORE_HOLD_ANNOTATION}: {}",
                r.name_any()
            ),
        );
        write_status(&ctx, &r, &s).await?;
        ctx.event(
            r.object_ref(&()),
            EventType::Normal,
            rp::STOPPING,
            &format!(
                "{ours}'s CA, front-proxy CA and service-account key are {original}'s from the archive; waiting for {ours} to be made to restore {} keys of revision {}",
                opened.records.len(),
                opened.header.revision
            ),
        )
        .await;
        return Ok(Action::requeue(RECHECK));
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
            s.control_plane_uid = ncp.metadata.uid.clone();
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
                    opened.records.len(),
                    opened.header.revision
                ),
            )
            .await;
        }
        // A clone's control plane, made since: held from its first pass, from now on.
        if clone_of.is_some() && s.control_plane_uid.is_none() {
            s.stopped_at = Some(Time(Timestamp::now()));
            s.control_plane_uid = ncp.metadata.uid.clone();
            write_status(&ctx, &r, &s).await?;
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
        // A control plane just made (a clone) may not have its etcd yet.
        if let Err(why) = datastore_access(&ctx, &t).await? {
            progress(&mut s, &r, &format!("waiting for the datastore: {why}"));
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
        "{ours} holds the {} keys of revision {}{} and is ready ({:.1} s without its API server)",
        opened.records.len(),
        opened.header.revision,
        if clone_of.is_some() {
            format!(", {original}'s,")
        } else {
            " again".into()
        },
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
    // Not made yet, or never started (a clone's controller manager and scheduler wait for
    // its API server, which the hold keeps from being ready): nothing of it runs.
    if t.meta_of(c).is_none()
        || t.status_of(c).is_some_and(|st| {
            !st.ready && st.version.is_none() && st.ready_replicas.unwrap_or_default() == 0
        })
    {
        return true;
    }
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
    // A hold left by a restore that holds no more (deleted, done) is taken over.
    let stale = match (set, current.as_deref()) {
        (true, Some(c)) if c != name => holding(&ctx.client, ncp).await?.is_none(),
        _ => false,
    };
    let value = match (set, current.as_deref()) {
        (true, Some(_)) if stale => serde_json::Value::String(name.to_string()),
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

/// A clone's records: without the original's API server leases (each names an address of
/// the original, which would be an endpoint of the clone's `kubernetes` Service until it
/// expired). The clone's API servers write their own.
fn leave_out_leases_of_others(records: &mut Vec<archive::Record>) {
    records.retain(|rec| !rec.key.starts_with(MASTER_LEASES));
}

/// Make `cluster`'s [`CLONED_TRUST`] Secrets the archive's: each one absent is created (owned
/// by nothing, like a CA a user brings: deleting the clone leaves it); one there already
/// must hold exactly the archive's data, or the clone is refused, and nothing is written.
async fn clone_trust(
    ctx: &Context,
    r: &NestedRestore,
    cluster: &str,
    trust: &archive::Trust,
) -> Result<Result<(), Stop>, Error> {
    let ns = r.namespace().unwrap_or_default();
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let mut wanted = Vec::new();
    for purpose in CLONED_TRUST {
        let name = purpose.secret_name(cluster);
        let Some(texts) = trust.get(purpose.suffix()) else {
            return Ok(Err(Stop::Refused(
                rr::INVALID_ARCHIVE,
                format!("the archive holds no `{}` trust to clone", purpose.suffix()),
            )));
        };
        let data: BTreeMap<String, ByteString> = texts
            .iter()
            .map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes())))
            .collect();
        match api.get_opt(&name).await? {
            // The archive's keys, as written (a signer certificate may be added since).
            Some(have)
                if data
                    .iter()
                    .all(|(k, v)| have.data.as_ref().and_then(|d| d.get(k)) == Some(v))
                    && have.annotations().get(CLONED_BY_ANNOTATION) == r.metadata.uid.as_ref() => {}
            Some(_) => return Ok(Err(not_new(&ns, &name, cluster))),
            None => wanted.push((name, data)),
        }
    }
    // Checked whole before any is written.
    for (name, data) in wanted {
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(BTreeMap::from([
                    (names::CLUSTER_NAME_LABEL.to_string(), cluster.to_string()),
                    (
                        names::MANAGED_BY_LABEL.to_string(),
                        names::MANAGED_BY.to_string(),
                    ),
                ])),
                annotations: Some(BTreeMap::from([(
                    CLONED_BY_ANNOTATION.to_string(),
                    r.metadata.uid.clone().unwrap_or_default(),
                )])),
                ..ObjectMeta::default()
            },
            type_: Some(names::CAPI_SECRET_TYPE.to_string()),
            data: Some(data),
            ..Secret::default()
        };
        match api.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            // Made meanwhile, by someone else.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                return Ok(Err(not_new(&ns, &name, cluster)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Ok(()))
}

fn not_new(ns: &str, secret: &str, cluster: &str) -> Stop {
    Stop::Refused(
        rr::NOT_A_NEW_CONTROL_PLANE,
        format!(
            "the Secret {ns}/{secret} was not written by this clone: a clone goes into a new control plane (nestplane never replaces a CA); delete {ns}/{cluster} and its Secrets, or clone under another name"
        ),
    )
}

/// Why `ncp` is not a control plane made for the clone `r`, or `None`. It is named by its own
/// name (no cluster-name annotation or label, no owning Cluster of another name: its Secrets
/// and keys are under that name), and it was made after `r` wrote its trust (`r` is not
/// `pending`) with `r`'s hold annotation, so none of its components ran before. Pure.
fn not_made_for(ncp: &NestedControlPlane, r: &NestedRestore, pending: bool) -> Option<String> {
    let ns = ncp.namespace().unwrap_or_default();
    let ours = ncp.name_any();
    let cluster = crate::tenant::cluster_name(ncp);
    let annotation = format!("{RESTORE_HOLD_ANNOTATION}: {}", r.name_any());
    if cluster != ours {
        return Some(format!(
            "NestedControlPlane {ns}/{ours} keeps its Secrets and keys under the name {cluster} (a cluster-name annotation or label, or an owning Cluster): a clone goes into a new control plane named by its own name"
        ));
    }
    if pending {
        return Some(format!(
            "NestedControlPlane {ns}/{ours} exists already: a clone's control plane is made once the restore has written its trust (phase Stopping), with the annotation {annotation}"
        ));
    }
    if ncp.annotations().get(RESTORE_HOLD_ANNOTATION) != Some(&r.name_any()) {
        return Some(format!(
            "NestedControlPlane {ns}/{ours} was not made for this clone: it lacks the annotation {annotation}"
        ));
    }
    None
}

/// The control plane this restore held was deleted (and perhaps another of its name made
/// since): whatever was written went with the one deleted, and nothing more is written. Failed.
async fn replaced(ctx: &BackupContext, r: &NestedRestore, ours: &str) -> Result<Action, Error> {
    let mut s = r.status.clone().unwrap_or_default();
    s.phase = Some(rp::FAILED.into());
    let msg = format!(
        "{ours} was deleted while this restore held it: what was written went with it, and nothing is written to one made since; restore again"
    );
    conditions::set(
        &mut s.conditions,
        conditions::new(types::READY, false, reasons::CONTROL_PLANE_NOT_FOUND, &msg),
        r.metadata.generation,
        Timestamp::now(),
    );
    s.observed_generation = r.metadata.generation;
    write_status(ctx, r, &s).await?;
    ctx.event(
        r.object_ref(&()),
        EventType::Warning,
        reasons::CONTROL_PLANE_NOT_FOUND,
        &msg,
    )
    .await;
    Ok(Action::await_change())
}

/// The archive and its URL, opened with its key; `Err` says why not.
async fn open_archive(
    ctx: &BackupContext,
    r: &NestedRestore,
) -> Result<Result<(String, archive::Opened), Stop>, Error> {
    let ns = r.namespace().unwrap_or_default();
    let cp = &r.spec.control_plane_ref.name;
    // How far the backup's delta segments reach, as its status says.
    let mut pit: Option<nestplane_api::backup::PointInTime> = None;
    let (url, backup_key, access) = match (&r.spec.backup_ref, &r.spec.from) {
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
                .clone()
                .map(|k| k.name)
                .unwrap_or_else(|| default_key_secret(&backup.spec.control_plane_ref.name));
            pit = backup.status.as_ref().and_then(|s| s.point_in_time.clone());
            (url, Some(key), backup.spec.s3)
        }
        (None, Some(from)) => (from.clone(), None, r.spec.s3.clone()),
        _ => {
            return Ok(Err(Stop::Refused(
                reasons::INVALID_SPEC,
                "a restore names either a backup (backupRef) or an archive (from)".into(),
            )));
        }
    };
    let archive = match location::locate_archive(&url, &ctx.dir, &ns) {
        Ok(a) => a,
        Err(refused) => {
            return Ok(Err(Stop::Refused(
                reasons::LOCATION_REFUSED,
                refused.to_string(),
            )));
        }
    };
    let bucket = match store::reach(ctx, &ns, &archive, access.as_ref()).await? {
        Ok(b) => b,
        Err(store::Unusable::Refused(reason, why)) => return Ok(Err(Stop::Refused(reason, why))),
        Err(store::Unusable::Waiting(reason, why)) => return Ok(Err(Stop::Waiting(reason, why))),
    };
    let secret = r
        .spec
        .key_secret_ref
        .as_ref()
        .map(|k| k.name.clone())
        .or(backup_key)
        .unwrap_or_else(|| default_key_secret(r.spec.clone_of.as_ref().map_or(cp, |c| &c.name)));
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
    let shown = archive.url();
    let bytes = match store::read(&archive, bucket.as_ref(), None).await {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            return Ok(Err(Stop::Refused(
                rr::INVALID_ARCHIVE,
                format!("{shown}: there is no such archive"),
            )));
        }
        // Its server refuses the credentials, or cannot be reached: looked at again.
        Err(store::ReadError::Denied(why)) => {
            return Ok(Err(Stop::Waiting(reasons::INVALID_CREDENTIALS, why)));
        }
        Err(store::ReadError::TooLarge(why)) => {
            return Ok(Err(Stop::Refused(rr::INVALID_ARCHIVE, why)));
        }
        Err(store::ReadError::Failed(why)) if bucket.is_some() => {
            return Ok(Err(Stop::Waiting(reasons::LOCATION_UNAVAILABLE, why)));
        }
        Err(why) => return Ok(Err(Stop::Refused(rr::INVALID_ARCHIVE, why.to_string()))),
    };
    let point = match (r.spec.to_revision, &r.spec.to_time) {
        (None, None) => None,
        (Some(rev), None) => Some(delta::Point::Revision(rev)),
        (None, Some(t)) => Some(delta::Point::Time(t.0.as_millisecond())),
        (Some(_), Some(_)) => {
            return Ok(Err(Stop::Refused(
                reasons::INVALID_SPEC,
                "a restore goes to a revision (toRevision) or a time (toTime), not both".into(),
            )));
        }
    };
    let key_for_segments = key.clone();
    let opened = tokio::task::spawn_blocking(move || {
        archive::decode_all(&bytes, &key, &archive::Limits::default())
            .map_err(|e| format!("{shown}: {e}"))
            .map(|o| (shown, o))
    })
    .await
    .map_err(|e| Error::Internal(e.to_string()))?;
    let (shown, mut opened) = match opened {
        Ok(o) => o,
        Err(why) => return Ok(Err(Stop::Refused(rr::INVALID_ARCHIVE, why))),
    };
    if let Some(point) = point
        && let Err(stop) = to_point(
            &archive,
            bucket.as_ref(),
            &key_for_segments,
            &mut opened,
            point,
            pit.as_ref(),
        )
        .await
    {
        return Ok(Err(stop));
    }
    Ok(Ok((shown, opened)))
}

/// The keys of `opened` (a backup) after its delta segments' changes up to `point`: every
/// segment opened with the backup's key and checked to continue its chain (its backup's
/// UID, its sequence, the revision before it, its events within its revisions), applied
/// one at a time. `pit`: how far the backup's status says the segments reach (with
/// `backupRef`; an archive named by URL has only its segments to tell).
async fn to_point(
    a: &location::Archive,
    bucket: Option<&super::s3::Bucket>,
    key: &[u8],
    opened: &mut archive::Opened,
    point: delta::Point,
    pit: Option<&nestplane_api::backup::PointInTime>,
) -> Result<(), Stop> {
    let base = opened.header.revision;
    let taken_ms = opened
        .header
        .created
        .parse::<Timestamp>()
        .map(|t| t.as_millisecond())
        .unwrap_or(i64::MIN);
    let shown = a.url();
    let until = pit
        .and_then(|p| p.until.as_ref())
        .map(|t| t.0.as_millisecond());
    match point {
        delta::Point::Revision(rev) if rev < base => {
            return Err(Stop::Refused(
                rr::POINT_BEFORE_BACKUP,
                format!(
                    "{shown} was taken at revision {base}, after revision {rev}: restore from an older backup"
                ),
            ));
        }
        delta::Point::Time(t) if t < taken_ms => {
            return Err(Stop::Refused(
                rr::POINT_BEFORE_BACKUP,
                format!(
                    "{shown} was taken at {}, after the time asked: restore from an older backup",
                    opened.header.created
                ),
            ));
        }
        _ => {}
    }
    // What the status says first: a point it does not reach is waited for (or, once the
    // chain stopped, refused) without reading a segment.
    if let Some(p) = pit {
        let reaches = match point {
            delta::Point::Revision(rev) => p.revision >= rev,
            delta::Point::Time(t) => until.is_some_and(|u| u >= t),
        };
        if !reaches {
            return Err(match &p.stopped {
                Some(why) => Stop::Refused(
                    rr::POINT_NOT_REACHED,
                    format!(
                        "{why}; the point asked is past what it reaches: restore from a newer backup"
                    ),
                ),
                None => not_reached(&shown, p.revision, until.unwrap_or(taken_ms)),
            });
        }
    }
    let records = std::mem::take(&mut opened.records);
    let mut replay = delta::Replay::new(records, base, point);
    let mut since = base;
    // When the last segment read was cut: every change seen by then is read.
    let mut cut_ms = taken_ms;
    let mut read = 0i64;
    for sequence in 1..=delta::MAX_SEGMENTS {
        let done = replay.passed
            || match point {
                delta::Point::Revision(rev) => since >= rev,
                delta::Point::Time(t) => cut_ms > t,
            };
        if done {
            break;
        }
        let seg = a.segment(sequence);
        let bytes = match store::read(&seg, bucket, None).await {
            Ok(Some(b)) => b,
            Ok(None) => {
                if pit.is_some_and(|p| p.segments >= sequence as i64) {
                    return Err(Stop::Refused(
                        rr::INVALID_ARCHIVE,
                        format!(
                            "{} is missing: the backup's status says {} segments were written",
                            seg.url(),
                            pit.map_or(0, |p| p.segments)
                        ),
                    ));
                }
                break;
            }
            Err(e) => return Err(Stop::Waiting(reasons::LOCATION_UNAVAILABLE, e.to_string())),
        };
        let (id, k, url) = (opened.header.id.clone(), key.to_vec(), seg.url());
        let segment = tokio::task::spawn_blocking(move || {
            let (h, records) = archive::decode(&bytes, &k, &archive::Limits::default())
                .map_err(|e| format!("{url}: {e}"))?;
            delta::check_link(&h, &id, sequence, since).map_err(|why| format!("{url}: {why}"))?;
            let events = delta::from_records(records).map_err(|e| format!("{url}: {e}"))?;
            delta::check_events(&events, h.since, h.revision)
                .map_err(|why| format!("{url}: {why}"))?;
            Ok::<_, String>((h, events))
        })
        .await
        .map_err(|e| Stop::Waiting(rr::RESTORE_FAILED, e.to_string()))?
        .map_err(|why| Stop::Refused(rr::INVALID_ARCHIVE, why))?;
        let (h, events) = segment;
        replay.feed(events);
        since = h.revision;
        read = sequence as i64;
        if let Ok(t) = h.created.parse::<Timestamp>() {
            cut_ms = cut_ms.max(t.as_millisecond());
        }
    }
    // `until` counts only when every segment the status names was read.
    let whole = pit.is_some_and(|p| p.segments == read && p.revision == since);
    let reach_ms = if whole {
        cut_ms.max(until.unwrap_or(i64::MIN))
    } else {
        cut_ms
    };
    let reached = replay.passed
        || match point {
            delta::Point::Revision(rev) => since >= rev,
            delta::Point::Time(t) => reach_ms >= t,
        };
    if !reached {
        return Err(not_reached(&shown, since, reach_ms));
    }
    let (records, revision) = replay.finish();
    opened.records = records;
    opened.header.revision = revision;
    Ok(())
}

fn not_reached(shown: &str, revision: i64, at_ms: i64) -> Stop {
    let at = Timestamp::from_millisecond(at_ms)
        .map(|t| t.to_string())
        .unwrap_or_default();
    Stop::Waiting(
        rr::POINT_NOT_REACHED,
        format!("the delta segments of {shown} reach revision {revision} and {at} so far"),
    )
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
    let status =
        status_patch(r.status.as_ref(), s).map_err(|e| Error::Unavailable(e.to_string()))?;
    let api: Api<NestedRestore> =
        Api::namespaced(ctx.client.clone(), &r.namespace().unwrap_or_default());
    api.patch_status(
        &r.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await?;
    Ok(())
}

/// The merge patch that makes `old` status `new`. A merge patch leaves what it does not name:
/// a field `new` leaves out (a clone's `stoppedAt`, cleared) is named, as null. Pure.
pub(super) fn status_patch<S: serde::Serialize>(
    old: Option<&S>,
    new: &S,
) -> Result<serde_json::Value, serde_json::Error> {
    let mut patch = serde_json::to_value(new)?;
    if let (Some(fields), Some(old)) = (patch.as_object_mut(), old)
        && let serde_json::Value::Object(old) = serde_json::to_value(old)?
    {
        for k in old.keys() {
            fields.entry(k.clone()).or_insert(serde_json::Value::Null);
        }
    }
    Ok(patch)
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
        Stop::Waiting(reason, msg) => {
            // Failed, and its spec changed since (or it would not be here): it starts over.
            if s.phase.as_deref() == Some(rp::FAILED) {
                s.phase = Some(rp::PENDING.into());
            }
            (reason, msg, Action::requeue(RECHECK))
        }
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
    fn a_status_write_clears_what_it_leaves_out() {
        let old = NestedRestoreStatus {
            phase: Some(rp::FAILED.into()),
            control_plane_uid: Some("uid-1".into()),
            stopped_at: Some(Time(Timestamp::UNIX_EPOCH)),
            keys: Some(3),
            ..Default::default()
        };
        let new = NestedRestoreStatus {
            phase: Some(rp::STOPPING.into()),
            keys: Some(3),
            ..Default::default()
        };
        let patch = status_patch(Some(&old), &new).unwrap_or_default();
        assert_eq!(patch["phase"], "Stopping");
        assert_eq!(patch["keys"], 3);
        assert!(patch["controlPlaneUID"].is_null());
        assert!(patch["stoppedAt"].is_null());
        assert!(
            patch
                .as_object()
                .is_some_and(|o| o.contains_key("controlPlaneUID"))
        );
        // Nothing to clear in a first write.
        let first = status_patch(None, &new).unwrap_or_default();
        assert!(
            first
                .as_object()
                .is_some_and(|o| !o.contains_key("stoppedAt"))
        );
    }

    #[test]
    fn a_clone_leaves_out_the_originals_api_server_leases_only() {
        let rec = |k: &str| archive::Record {
            key: k.as_bytes().to_vec(),
            value: b"v".to_vec(),
            lease: None,
        };
        let mut records = vec![
            rec("configmaps/default/masterleases"),
            rec("leases/kube-system/kube-scheduler"),
            rec("masterleases/10.0.0.1"),
            rec("masterleases/172.20.0.1"),
            rec("services/endpoints/default/kubernetes"),
        ];
        leave_out_leases_of_others(&mut records);
        let kept: Vec<_> = records
            .iter()
            .map(|r| String::from_utf8_lossy(&r.key).into_owned())
            .collect();
        assert_eq!(
            kept,
            [
                "configmaps/default/masterleases",
                "leases/kube-system/kube-scheduler",
                "services/endpoints/default/kubernetes"
            ]
        );
    }

    #[test]
    fn a_clone_goes_only_into_a_control_plane_made_for_it() {
        let mut r = NestedRestore::new("clone", Default::default());
        r.metadata.namespace = Some("default".into());
        let made = |annotations: &[(&str, &str)]| {
            let mut ncp = NestedControlPlane::new("gamma", Default::default());
            ncp.metadata.namespace = Some("default".into());
            ncp.metadata.annotations = Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            );
            ncp
        };
        let held = made(&[(RESTORE_HOLD_ANNOTATION, "clone")]);
        assert_eq!(not_made_for(&held, &r, false), None);
        // Made before the trust was written.
        assert!(
            not_made_for(&held, &r, true)
                .unwrap_or_default()
                .contains("exists already")
        );
        // Without the hold, or another restore's.
        for other in [made(&[]), made(&[(RESTORE_HOLD_ANNOTATION, "other")])] {
            assert!(
                not_made_for(&other, &r, false)
                    .unwrap_or_default()
                    .contains("lacks the annotation")
            );
        }
        // Its Secrets and keys under another name: a neighbour's.
        let beta = made(&[
            (RESTORE_HOLD_ANNOTATION, "clone"),
            (names::CLUSTER_IDENTITY_ANNOTATION, "beta"),
        ]);
        assert!(
            not_made_for(&beta, &r, false)
                .unwrap_or_default()
                .contains("under the name beta")
        );
    }

    #[test]
    fn a_hold_names_an_object() {
        assert!(plain_name("alpha-restore-1"));
        assert!(plain_name("a.b"));
        for bad in ["", "../x", "a/b", "A", "a?b=c", &"a".repeat(254)] {
            assert!(!plain_name(bad), "{bad}");
        }
    }
}
