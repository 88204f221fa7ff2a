//! One controller per component kind (`NestedEtcd`, `NestedAPIServer`,
//! `NestedControllerManager`, `NestedScheduler`), all running this reconciler.
//!
//! Order through status, as seed 000 says: the API server waits until etcd is Ready,
//! controller-manager and scheduler until the API server is Ready. A component is Ready only
//! when every replica answers its health endpoint.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use nestplane_api::conditions::{self, reasons, types};
use nestplane_api::names::Component;
use nestplane_api::{ComponentStatus, NestedEtcdAddress};
use nestplane_runtime::process::RuntimeError;

use crate::context::Context;
use crate::error::Error;
use crate::runtime::{Observation, Pass};
use crate::tenant::{self, ComponentKind, Tenant};

/// How often a component held stopped by a restore looks at whether it still is.
pub const HOLD_RECHECK: Duration = Duration::from_secs(5);

/// How often a Ready component's health is re-checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(10);

/// The outcome of one pass, before it becomes status.
pub(crate) struct Outcome {
    pub(crate) ready: bool,
    pub(crate) ready_replicas: i32,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    pub(crate) version: Option<String>,
    pub(crate) addresses: Vec<NestedEtcdAddress>,
    pub(crate) service: Option<ObjectReference>,
    pub(crate) requeue: Option<Duration>,
    pub(crate) event: Option<EventType>,
    /// Why the replicas the spec asks for are not what runs (etcd after bootstrap).
    pub(crate) scale_refused: Option<String>,
    /// The trust it runs with, once every replica runs the newest spec and secrets.
    pub(crate) credentials: Option<std::collections::BTreeMap<String, String>>,
}

impl Outcome {
    pub(crate) fn waiting(
        reason: &'static str,
        message: String,
        requeue: Option<Duration>,
        event: Option<EventType>,
    ) -> Self {
        Outcome {
            ready: false,
            ready_replicas: 0,
            reason,
            message,
            version: None,
            addresses: vec![],
            service: None,
            requeue,
            event,
            scale_refused: None,
            credentials: None,
        }
    }
}

/// Reconcile one component object.
#[tracing::instrument(name = "component", skip_all, fields(kind = %<K as kube::Resource>::kind(&()), namespace = kube::Resource::meta(obj.as_ref()).namespace.as_deref().unwrap_or_default(), name = kube::Resource::meta(obj.as_ref()).name.as_deref().unwrap_or_default()))]
pub async fn reconcile<K: ComponentKind>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(tenant::kind_of(K::COMPONENT));
    let obj = ctx.written.latest(obj);
    let ns = obj.namespace().unwrap_or_default();
    // Handed to an out-of-tree controller: its status is that controller's to write, and
    // the control plane reads it from there (seed 000's ordering through status).
    if let Some(manager) = tenant::managed_elsewhere(obj.meta()) {
        tracing::debug!(object = %obj.name_any(), %manager, "managed elsewhere; not reconciled");
        return Ok(Action::await_change());
    }
    let tenant = match tenant::controller_of(obj.as_ref()) {
        Some(owner) => {
            let Some(ncp) = ctx.caches.ncp(&ctx.client, &ns, &owner.name).await? else {
                return Ok(Action::await_change());
            };
            let ncp = ctx.written.current(ncp);
            // Another operator's control plane (its watch filter): not a single write from
            // here.
            if ncp.metadata.deletion_timestamp.is_some() || !ctx.selects(&ncp) {
                return Ok(Action::await_change());
            }
            let mut tenant = Tenant::load(&ctx.client, &ctx.caches, ncp).await?;
            // Made by its control plane a moment ago, which references it in its next
            // write: it is this tenant's component already (its first status is then the
            // one it keeps, not "no owner yet" first).
            let cluster = tenant.cluster();
            let own = K::lookup_mut(&mut tenant);
            if matches!(own, tenant::Lookup::Unreferenced)
                && obj.name_any() == K::COMPONENT.workload_name(&cluster)
            {
                *own = tenant::Lookup::Found((*obj).clone());
            }
            if !ctx.runs_here(&tenant, Component::Etcd) {
                tenant.external_etcd = Some(tenant.etcd_status_urls());
            }
            if K::COMPONENT != Component::Etcd {
                tenant.held_by = crate::backup::restore::holding(&ctx.client, &tenant.ncp).await?;
            }
            // The tenant's data is frozen for a move's cut-over: the API server keeps what it
            // runs until its control plane switches datastores (its etcd credentials change
            // a moment before; both are taken together).
            if K::COMPONENT == Component::ApiServer
                && tenant
                    .ncp
                    .status
                    .as_ref()
                    .and_then(|s| s.migration.as_ref())
                    .is_some_and(|m| m.phase == crate::datastore::migrate::phases::FREEZING)
            {
                return Ok(Action::requeue(std::time::Duration::from_millis(250)));
            }
            Some(tenant)
        }
        None => datastore_tenant(&ctx, obj.as_ref(), &ns).await?,
    };
    let Some(tenant) = tenant else {
        // With a watch filter, an unowned component is nobody's business of this operator's.
        if ctx.watch_filter.is_some() {
            return Ok(Action::await_change());
        }
        let out = Outcome::waiting(
            reasons::WAITING_FOR_OWNER,
            "no NestedControlPlane references and owns this component yet".into(),
            None,
            None,
        );
        write_status::<K>(&ctx, &obj, out.to_status(obj.as_ref()), &out).await?;
        return Ok(Action::await_change());
    };
    let key = crate::context::object_key(obj.as_ref());
    let was_ready = obj.common_status().is_some_and(|s| s.ready);
    let out = match run::<K>(&ctx, &tenant, &key).await {
        Ok(out) => out,
        Err(Error::Runtime(e @ RuntimeError::MissingBinary(_))) => Outcome::waiting(
            reasons::VERSION_UNAVAILABLE,
            e.to_string(),
            Some(ctx.pacing.error(&key)),
            Some(EventType::Warning),
        ),
        // A spec a person must fix: said once, looked at again when something changes.
        Err(e @ (Error::Patch(_) | Error::Render(_))) => Outcome::waiting(
            reasons::INVALID_SPEC,
            e.to_string(),
            None,
            Some(EventType::Warning),
        ),
        Err(Error::Secret(e @ crate::secrets::SecretError::Invalid { .. })) => Outcome::waiting(
            reasons::INVALID_SPEC,
            e.to_string(),
            Some(ctx.pacing.error(&key)),
            Some(EventType::Warning),
        ),
        // A transient failure (the management API, the filesystem) does not make a Ready
        // component not Ready: its status stays, and the pass is retried with backoff.
        // (counted by the error policy).
        Err(e) if was_ready => return Err(e),
        Err(e) => {
            ctx.metrics
                .reconcile_failed(tenant::kind_of(K::COMPONENT), e.step(), e.label());
            Outcome::waiting(
                reasons::RECONCILE_ERROR,
                e.to_string(),
                Some(ctx.pacing.error(&key)),
                Some(EventType::Warning),
            )
        }
    };
    if out.reason != reasons::RECONCILE_ERROR && out.reason != reasons::VERSION_UNAVAILABLE {
        ctx.pacing.succeeded(&key);
    }
    let status = out.to_status(obj.as_ref());
    write_status::<K>(&ctx, &obj, status, &out).await?;
    Ok(match out.requeue {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    })
}

/// A `NestedEtcd` a shared datastore controls runs as the datastore's own tenant
/// ([`crate::datastore::etcd_tenant`]); `None` when no datastore controls it.
async fn datastore_tenant<K: ComponentKind>(
    ctx: &Context,
    obj: &K,
    ns: &str,
) -> Result<Option<Tenant>, Error> {
    if K::COMPONENT != Component::Etcd {
        return Ok(None);
    }
    let Some(name) = crate::datastore::controller_of(obj) else {
        return Ok(None);
    };
    let Some(ds) = crate::datastore::get(ctx, ns, &name).await? else {
        return Ok(None);
    };
    // A datastore being deleted keeps its etcd running until its last tenant has left.
    let etcd: nestplane_api::NestedEtcd = serde_json::to_value(obj)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::Internal(e.to_string()))?;
    Ok(Some(crate::datastore::etcd_tenant(&ds, etcd)))
}

impl Outcome {
    fn to_status<K: ComponentKind>(&self, obj: &K) -> ComponentStatus {
        let previous = obj.common_status().cloned().unwrap_or_default();
        let mut st = previous.clone();
        st.ready = self.ready;
        st.ready_replicas = Some(self.ready_replicas);
        st.observed_generation = obj.meta().generation;
        if self.version.is_some() {
            st.version = self.version.clone();
        }
        if let Some(c) = &self.credentials {
            st.credentials = c.clone();
        }
        st.phase = Some(
            match self.reason {
                reasons::AS_EXPECTED => "Ready",
                reasons::WAITING_FOR_DEPENDENCIES | reasons::WAITING_FOR_OWNER => "Waiting",
                reasons::PROVISIONING | reasons::UNHEALTHY => "Provisioning",
                reasons::PAUSED => "Paused",
                nestplane_api::backup::HELD_FOR_RESTORE => "Held",
                _ => "Failed",
            }
            .to_string(),
        );
        let now = k8s_openapi::jiff::Timestamp::now();
        conditions::set(
            &mut st.conditions,
            conditions::new(types::READY, self.ready, self.reason, self.message.clone()),
            obj.meta().generation,
            now,
        );
        let (scaled, scaled_reason, scaled_message) = match &self.scale_refused {
            Some(m) => (false, reasons::MEMBERSHIP_CHANGE_REFUSED, m.clone()),
            None => (true, reasons::AS_EXPECTED, String::new()),
        };
        conditions::set(
            &mut st.conditions,
            conditions::new(types::SCALED, scaled, scaled_reason, scaled_message),
            obj.meta().generation,
            now,
        );
        let paused = self.reason == reasons::PAUSED;
        conditions::set(
            &mut st.conditions,
            conditions::new(
                types::PAUSED,
                paused,
                if paused {
                    reasons::PAUSED
                } else {
                    reasons::NOT_PAUSED
                },
                "",
            ),
            obj.meta().generation,
            now,
        );
        st
    }
}

async fn write_status<K: ComponentKind>(
    ctx: &Context,
    obj: &K,
    status: ComponentStatus,
    out: &Outcome,
) -> Result<(), Error> {
    let previous = obj.common_status().cloned().unwrap_or_default();
    let mut body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    if K::COMPONENT == Component::Etcd {
        body["addresses"] =
            serde_json::to_value(&out.addresses).map_err(|e| Error::Internal(e.to_string()))?;
    }
    if K::COMPONENT == Component::ApiServer
        && let Some(svc) = &out.service
    {
        body["apiserverService"] =
            serde_json::to_value(svc).map_err(|e| Error::Internal(e.to_string()))?;
    }
    // Write only changes: our own status writes must not cause more reconciles.
    let current = serde_json::to_value(obj).map_err(|e| Error::Internal(e.to_string()))?;
    let unchanged = {
        let cur = &current["status"];
        let mut same = status == previous;
        if K::COMPONENT == Component::Etcd {
            same &= cur
                .get("addresses")
                .cloned()
                .unwrap_or(serde_json::json!([]))
                == body["addresses"];
        }
        if K::COMPONENT == Component::ApiServer && out.service.is_some() {
            same &= cur.get("apiserverService") == body.get("apiserverService");
        }
        same
    };
    if unchanged {
        return Ok(());
    }
    let old_ready = conditions::get(&previous.conditions, types::READY)
        .map(|c| (c.status.clone(), c.reason.clone()));
    let was_refused =
        conditions::get(&previous.conditions, types::SCALED).is_some_and(|c| c.status == "False");
    // A merge patch: server-side apply in Kubernetes 1.20 turns empty strings (a condition's
    // empty message) into nulls, which the schema rightly refuses.
    let patch = serde_json::json!({ "status": body });
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let written = api
        .patch_status(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    ctx.written.remember(obj, written);
    // An Event when the Ready condition changes (not on every pass). A new component's first
    // state is not a change: while it is only waiting (Normal), its status says so and no
    // Event is made (a thousand new tenants would otherwise make thousands of them).
    let new_ready = (
        if out.ready { "True" } else { "False" }.to_string(),
        out.reason.to_string(),
    );
    let type_ = out.event.unwrap_or(EventType::Normal);
    let first_wait = old_ready.is_none() && !out.ready && type_ == EventType::Normal;
    if old_ready.as_ref() != Some(&new_ready) && !first_wait {
        let note = if out.ready {
            format!("{} is ready", tenant::kind_of(K::COMPONENT))
        } else {
            out.message.clone()
        };
        ctx.event(obj.object_ref(&()), type_, out.reason, &note)
            .await;
    }
    if let Some(m) = &out.scale_refused
        && !was_refused
    {
        ctx.event(
            obj.object_ref(&()),
            EventType::Warning,
            reasons::MEMBERSHIP_CHANGE_REFUSED,
            m,
        )
        .await;
    }
    Ok(())
}

/// How often a control plane paused by its Cluster (`spec.paused`) is looked at again.
pub const CLUSTER_PAUSE_RECHECK: std::time::Duration = std::time::Duration::from_secs(5);

/// The pipeline of one pass: gate (name, pause, version, replicas, patches, dependencies) →
/// run (the runtime issues certificates, renders, applies or starts, observes) → judge
/// (hysteresis) → the outcome that becomes status.
async fn run<K: ComponentKind>(ctx: &Context, t: &Tenant, key: &str) -> Result<Outcome, Error> {
    let c = K::COMPONENT;
    let (version, patches) = match gate(ctx, t, c, key)? {
        Gate::Proceed { version, patches } => (version, patches),
        Gate::Stop(out) => return Ok(*out),
    };
    // A component that ran is about to be rendered at another version: recorded first, so
    // that a change refused later keeps this one rather than going back.
    if t.running_version(c).is_some()
        && t.rendered_version(c) != Some(version)
        && let Some(name) = t.meta_of(c).and_then(|m| m.name.clone())
    {
        let api: Api<K> = Api::namespaced(ctx.client.clone(), &t.namespace());
        let patch = serde_json::json!({"metadata": {"annotations": {
            nestplane_api::names::RENDERED_VERSION_ANNOTATION: version.to_string()}}});
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    let replaced = std::sync::Mutex::new(Vec::new());
    let seen = ctx
        .runtime
        .run(Pass {
            client: &ctx.client,
            clock: &ctx.clock,
            secrets: ctx.caches.secrets.get(),
            tenant: t,
            component: c,
            version,
            patches: &patches,
            replaced: &replaced,
        })
        .await;
    for note in replaced.into_inner().unwrap_or_else(|e| e.into_inner()) {
        ctx.event(
            kube::Resource::object_ref(&t.ncp, &()),
            EventType::Warning,
            reasons::SECRET_REISSUED,
            &note,
        )
        .await;
    }
    let seen = seen?;
    if let Some(restore) = t.held_by.as_ref().filter(|_| t.held(c)) {
        // Its replicas are stopped (the runtime returns once they are): what the restore
        // waits for.
        return Ok(Outcome::waiting(
            nestplane_api::backup::HELD_FOR_RESTORE,
            format!(
                "stopped while NestedRestore {}/{restore} replaces the control plane's keys",
                t.namespace()
            ),
            // Looked at again: a restore deleted meanwhile releases it.
            Some(HOLD_RECHECK),
            None,
        ));
    }
    Ok(judge(ctx, t, c, key, version, seen))
}

/// A tenant's version change as this operator judges it: every component object of the
/// tenant (a shared datastore's etcd is not the tenant's), whoever runs it; whether it can run
/// a version here is asked only of the components this operator runs.
pub(crate) fn version_change(ctx: &Context, t: &Tenant) -> crate::tenant::VersionChange {
    let change = planned(ctx, t);
    // A minor step waits for, or is refused on, the APIs it removes that clients use.
    match &change {
        crate::tenant::VersionChange::Moving(plan) => {
            crate::removed::hold(ctx, t, plan).unwrap_or(change)
        }
        _ => change,
    }
}

/// [`version_change`] by the version rules alone (before removed APIs are considered).
pub(crate) fn planned(ctx: &Context, t: &Tenant) -> crate::tenant::VersionChange {
    let parts: Vec<Component> = Component::ALL
        .into_iter()
        .filter(|&d| d != Component::Etcd || !t.on_datastore())
        .filter(|&d| t.meta_of(d).is_some())
        .collect();
    t.version_change(
        &parts,
        |d, v| {
            if ctx.runs_here(t, d) {
                ctx.runtime.can_run(d, v).map_err(|e| e.to_string())
            } else {
                Ok(())
            }
        },
        |minor| ctx.runtime.newest_patch(minor),
    )
}

/// How soon a component that a refused version change keeps from starting is looked at again
/// (a change of the spec brings it back at once).
const REFUSED_RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

enum Gate {
    Proceed {
        version: nestplane_render::KubeVersion,
        patches: Vec<serde_json::Value>,
    },
    Stop(Box<Outcome>),
}

/// Whether component `c` may run now; every refusal is an outcome a person can act on.
fn gate(ctx: &Context, t: &Tenant, c: Component, key: &str) -> Result<Gate, Error> {
    let stop = |reason, msg, requeue, event| {
        Ok(Gate::Stop(Box::new(Outcome::waiting(
            reason, msg, requeue, event,
        ))))
    };
    if let Some(msg) = t.name_problem() {
        return stop(reasons::INVALID_SPEC, msg, None, Some(EventType::Warning));
    }
    if t.paused(Some(c)) {
        // A Cluster's pause is not watched: look again shortly.
        let again = t.cluster_paused.then_some(CLUSTER_PAUSE_RECHECK);
        return stop(
            reasons::PAUSED,
            "reconciliation is paused".into(),
            again,
            None,
        );
    }
    let version = match (t.version(c), t.running_version(c)) {
        (Ok(v), _) => v,
        // What runs keeps what was rendered; its control plane's `Upgrading` says why.
        (Err(_), Some(running)) => t.rendered_version(c).unwrap_or(running),
        (Err((reason, msg)), None) => {
            let reason = if reason == reasons::INVALID_SPEC {
                reasons::INVALID_SPEC
            } else {
                reasons::VERSION_UNAVAILABLE
            };
            return stop(reason, msg, None, Some(EventType::Warning));
        }
    };
    if let Some(msg) = t
        .replicas_problem(c)
        .filter(|_| t.etcd_members().is_none() || c != Component::Etcd)
    {
        return stop(reasons::INVALID_SPEC, msg, None, Some(EventType::Warning));
    }
    // A version change is judged for the whole control plane before anything moves: when it
    // is refused, what runs keeps its version (its control plane says why) and nothing starts.
    let version = match version_change(ctx, t) {
        // What was rendered is kept (it may be ahead of the last version that became Ready).
        crate::tenant::VersionChange::Refused(reason, msg) => match t.rendered_version(c) {
            Some(rendered) => rendered,
            None => {
                // Its own missing binary is said first (the message names it).
                ctx.runtime.can_run(c, &version)?;
                // Waiting for a reading is no problem of the spec.
                let event = if reason == crate::removed::CHECKING {
                    EventType::Normal
                } else {
                    EventType::Warning
                };
                return stop(reason, msg, Some(REFUSED_RECHECK), Some(event));
            }
        },
        // Accepted: the parts move in order, each to its version of the step under way once
        // what it depends on runs its own, Ready (etcd, then the API servers, then the
        // controller manager and the scheduler); until then it keeps what it was rendered at.
        crate::tenant::VersionChange::Moving(plan) => match plan.step_version(c) {
            Some(step) => match (
                t.held_by(&plan, c, |d| ctx.runs_here(t, d)),
                t.rendered_version(c),
            ) {
                (None, _) => step,
                (Some(_), Some(rendered)) => rendered,
                (Some((d, v)), None) => {
                    return stop(
                        reasons::WAITING_FOR_DEPENDENCIES,
                        format!("waiting for {} to run {v}, Ready", tenant::kind_of(d)),
                        Some(ctx.pacing.waiting(key)),
                        None,
                    );
                }
            },
            None => version,
        },
        crate::tenant::VersionChange::None => version,
    };
    // Say at once when this version cannot run here, rather than after the dependencies.
    ctx.runtime.can_run(c, &version)?;
    // Patches are judged before waiting for anything: a patch the runtime refuses is said at
    // once, on a rendering with placeholder addresses (the judge compares the patched
    // objects with the same rendering, so addresses do not matter).
    let patches = t.spec_of(c).map(|s| s.patches.clone()).unwrap_or_default();
    if !patches.is_empty() {
        let input = ctx.runtime.check_input(t, version);
        let rendered = nestplane_render::render(c, &input)?;
        let mut objects = nestplane_render::process_objects(&rendered, &input);
        nestplane_render::policy::apply_checked(
            objects.all_mut(),
            &patches,
            ctx.runtime.patch_policy(),
        )?;
    }
    let waiting_for: Vec<String> = c
        .dependencies()
        .iter()
        .filter(|d| !t.ready(**d))
        .map(|d| {
            if *d == Component::Etcd && t.on_datastore() {
                let name = t
                    .ncp
                    .spec
                    .datastore_ref
                    .as_ref()
                    .map(|r| r.name.clone())
                    .or_else(|| t.datastore().map(|b| b.name.clone()))
                    .unwrap_or_default();
                return format!("the shared datastore {name}");
            }
            // Not referenced yet: its control plane is creating the default one (named so
            // here too, so that the message does not change when the reference is written).
            let name = tenant::reference(&t.ncp, *d)
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| d.workload_name(&t.cluster()));
            format!("{} {}/{}", tenant::kind_of(*d), t.namespace(), name)
        })
        .collect();
    // Dependencies order creation only: a component that has been Ready keeps running and
    // keeps its own readiness when a dependency blips (its own probes say whether it serves).
    let started_before = t
        .status_of(c)
        .is_some_and(|s| s.ready || s.version.is_some());
    if !waiting_for.is_empty() && !started_before {
        // A dependency's status change reaches this component through the watch of its kind
        // (and its control plane's); the requeue is only a safety net, since that event may
        // come before the dependency's own cache has the change.
        return stop(
            reasons::WAITING_FOR_DEPENDENCIES,
            format!("waiting for {} to be Ready", waiting_for.join(" and ")),
            Some(if ctx.runtime.readiness_is_watched() {
                ctx.pacing.starting(key)
            } else {
                ctx.pacing.waiting(key)
            }),
            None,
        );
    }
    Ok(Gate::Proceed { version, patches })
}

/// Turn what the runtime saw into an outcome: once Ready, only sustained failure (see
/// [`crate::pacing`]) makes a component not Ready, and while a failed probe is tolerated the
/// counts stay what they were (no flapping of the contract's replica fields).
fn judge(
    ctx: &Context,
    t: &Tenant,
    c: Component,
    key: &str,
    version: nestplane_render::KubeVersion,
    seen: Observation,
) -> Outcome {
    let verdict = ctx.pacing.probe(key, t.ready(c), seen.ok);
    let ready = verdict.ready;
    let desired = seen.desired;
    let healthy = if ready && !seen.ok {
        t.status_of(c)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(desired as i32)
    } else {
        seen.healthy as i32
    };
    let message = if ready && !seen.ok {
        format!(
            "{desired}/{desired} {} until now; {} consecutive failed probe(s) tolerated (not Ready after {})",
            seen.counting,
            verdict.failures,
            crate::pacing::FAILURES_BEFORE_NOT_READY
        )
    } else {
        format!("{}/{desired} {}", seen.healthy, seen.counting)
    };
    Outcome {
        ready,
        ready_replicas: healthy,
        reason: if ready {
            reasons::AS_EXPECTED
        } else {
            reasons::PROVISIONING
        },
        message,
        // A version is reported once it runs: a tolerated failed probe (a rollout that cannot
        // finish, say) keeps the component Ready but does not claim the new version.
        version: (ready && seen.ok).then(|| version.to_string()),
        credentials: (ready && seen.ok).then_some(seen.credentials),
        addresses: seen.addresses,
        service: seen.service,
        requeue: Some(if seen.ok {
            HEALTH_INTERVAL
        } else if ready {
            crate::pacing::RECHECK
        } else {
            starting_delay(ctx, key)
        }),
        event: None,
        scale_refused: scale_refusal(t, c),
    }
}

/// When to look again at a component that is starting (or waiting for a dependency): probed
/// often at first where nothing announces readiness, backed off where a watch does.
fn starting_delay(ctx: &Context, key: &str) -> Duration {
    if ctx.runtime.readiness_is_watched() {
        ctx.pacing.starting(key)
    } else {
        ctx.pacing.probing(key)
    }
}

/// The message of a refused etcd membership change, if the spec asks for one.
pub(crate) fn scale_refusal(t: &Tenant, c: Component) -> Option<String> {
    if c != Component::Etcd {
        return None;
    }
    let (members, wanted) = t.etcd_scale_refused()?;
    Some(format!(
        "etcd was formed with {members} member(s) and keeps them: changing replicas to {wanted} after bootstrap is refused, because new members would form a second cluster and the tenant's data would be lost; set replicas back to {members}"
    ))
}
