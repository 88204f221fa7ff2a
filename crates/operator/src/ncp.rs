//! The `NestedControlPlane` controller: adopts or creates its components, owns the endpoint,
//! computes the Cluster API contract status, and cleans up on deletion (finalizer).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::conditions::{self, reasons, types};
use nestplane_api::names::{self, Component};

use crate::context::{Context, Error};
use crate::error::AtStep;
use crate::status::{self, Observed};
use crate::tenant::{self, ComponentKind, Lookup, Tenant};

/// How often a control plane is looked at without a change.
pub const RESYNC: Duration = Duration::from_secs(60);

/// Reconcile one control plane: provision (finalizer, components, endpoint, etcd CA where
/// etcd is someone else's) unless paused or invalid → status from what the components
/// report → write it when it changed, with an Event when `Available` changes.
#[tracing::instrument(name = "NestedControlPlane", skip_all, fields(namespace = ncp.metadata.namespace.as_deref().unwrap_or_default(), controlplane = ncp.metadata.name.as_deref().unwrap_or_default()))]
pub async fn reconcile(ncp: Arc<NestedControlPlane>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("NestedControlPlane");
    let ncp = ctx.written.latest(ncp);
    let ns = ncp.namespace().unwrap_or_default();
    let api: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    if ncp.metadata.deletion_timestamp.is_some() {
        return cleanup(&ncp, &ctx, &api).await.at("teardown");
    }

    let mut tenant = Tenant::load(&ctx.client, &ctx.caches, (*ncp).clone())
        .await
        .at("load")?;
    let mut problem = tenant
        .name_problem()
        .map(|m| (reasons::INVALID_SPEC.to_string(), m));
    let paused = tenant.paused(None);
    let mut binding = None;
    if problem.is_none() && !paused {
        binding = provision(&ctx, &api, &ncp, &mut tenant)
            .await
            .at("provision")?;
        if let Some(p) = report_problems(&ctx, &ncp, &tenant, binding.as_ref()).await {
            problem.get_or_insert(p);
        }
    }
    // A change of datastore moves the data, one step per pass (its own requeue).
    let migration;
    let mut moving = None;
    if problem.is_none() && !paused && matches!(binding, Some(crate::datastore::Binding::Bound(_)))
    {
        let step = crate::datastore::migrate::advance(&ctx, &tenant)
            .await
            .at("migration")?;
        if let Some(b) = step.binding {
            binding = Some(b);
        }
        migration = step.status;
        moving = step.requeue;
    } else {
        migration = crate::datastore::migrate::lift(&ctx, &tenant)
            .await
            .at("migration")?;
    }
    // A minor step about to start reads which APIs it removes the tenant's clients use.
    let mut checking = false;
    if problem.is_none() && !paused {
        let change = crate::component::planned(&ctx, &tenant);
        // (a failure to read is no reason to stop the pass: the change waits, as it says)
        checking = crate::removed::refresh(&ctx, &tenant, &change)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "reading the API server's requests of removed APIs");
                true
            });
    }
    // A rotation (of the service-account key, of the CA) goes one phase further when it can.
    let mut rotating = None;
    let mut rotations = Vec::new();
    if problem.is_none() && !paused {
        (rotations, rotating) = crate::rotation::advance(&ctx, &tenant).await;
    }
    let mut new_status = next_status(&ctx, &ncp, &tenant, binding.as_ref(), &problem, paused)
        .await
        .at("status")?;
    new_status.rotations = ncp
        .status
        .as_ref()
        .map(|s| s.rotations.clone())
        .unwrap_or_default();
    for r in rotations {
        new_status.rotations.retain(|o| o.target != r.target);
        new_status.rotations.push(r);
    }
    match &migration {
        Some(m) => conditions::set(
            &mut new_status.conditions,
            crate::datastore::migrate::condition(m),
            ncp.metadata.generation,
            k8s_openapi::jiff::Timestamp::now(),
        ),
        None => new_status
            .conditions
            .retain(|c| c.type_ != crate::datastore::migrate::CONDITION),
    }
    new_status.migration = migration;
    ctx.metrics
        .set_tenant_ready(&ns, &ncp.name_any(), new_status.ready);
    if ncp.status.as_ref() != Some(&new_status) {
        write_status(&ctx, &api, &ncp, &mut tenant, new_status, problem.is_some())
            .await
            .at("status")?;
    }
    Ok(if let Some(after) = moving {
        Action::requeue(after)
    } else if checking {
        Action::requeue(REMOVED_APIS_RECHECK)
    } else if let Some(after) = rotating {
        Action::requeue(after)
    } else if problem.is_none() && tenant.cluster_paused {
        // A Cluster's pause is not watched: look again shortly.
        Action::requeue(crate::component::CLUSTER_PAUSE_RECHECK)
    } else if problem.is_some() || paused {
        Action::await_change()
    } else {
        Action::requeue(RESYNC)
    })
}

/// How soon a change waiting for its API server's metric is looked at again.
const REMOVED_APIS_RECHECK: std::time::Duration = std::time::Duration::from_secs(3);

/// The finalizer (its own write first: the identity is fixed with it, see
/// `finalizer_patch`), components created or adopted, the endpoint, the etcd CA where etcd is
/// someone else's, the endpoint published. Returns the datastore binding, if on one.
async fn provision(
    ctx: &Context,
    api: &Api<NestedControlPlane>,
    ncp: &NestedControlPlane,
    tenant: &mut Tenant,
) -> Result<Option<crate::datastore::Binding>, Error> {
    let name = ncp.name_any();
    if !crate::finalizer::has(ncp, names::FINALIZER) {
        let written = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(finalizer_patch(ncp, true)),
            )
            .await?;
        ctx.written.remember(&tenant.ncp, written.clone());
        tenant.ncp = written;
    }
    let on_datastore = tenant.on_datastore();
    // Default components are created first, then referenced; what the spec must gain
    // (those references, the endpoint the provider owns) is written in one patch, and what
    // was created or adopted is used as written, without reading it back.
    let mut spec = serde_json::Map::new();
    let binding = if on_datastore {
        Some(crate::datastore::bind(ctx, tenant).await?)
    } else {
        None
    };
    adopt_all(ctx, tenant, !on_datastore, &mut spec).await?;
    let want = ctx.runtime.endpoint(&ctx.client, ncp).await?;
    if let Some(want) = &want
        && tenant.ncp.spec.control_plane_endpoint.as_ref() != Some(want)
    {
        spec.insert(
            "controlPlaneEndpoint".into(),
            serde_json::to_value(want).map_err(|e| Error::Internal(e.to_string()))?,
        );
    }
    if !spec.is_empty() {
        let written = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": spec })),
            )
            .await?;
        ctx.written.remember(&tenant.ncp, written.clone());
        tenant.ncp = written;
    }
    // An etcd run by someone else serves with a certificate from the tenant's etcd CA, which
    // must therefore exist before the API server does (a provisioner may also bring its own
    // by creating `<cluster>-etcd` first: it is then used as it is).
    if !on_datastore && !ctx.runs_here(tenant, Component::Etcd) {
        crate::secrets::ClusterSecrets::new(
            ctx.client.clone(),
            &ncp.namespace().unwrap_or_default(),
            &tenant.cluster(),
            tenant::owner_ref(ncp),
            ctx.clock.clone(),
        )
        .with_cache(ctx.caches.secrets.get().cloned())
        .ca(names::SecretPurpose::EtcdCa)
        .await?;
    }
    // Seed 003: the endpoint is published as a ClusterEndpoint as soon as it is known.
    if let Some(endpoint) = want
        .as_ref()
        .or(tenant.ncp.spec.control_plane_endpoint.as_ref())
        .filter(|e| !e.host.is_empty())
    {
        crate::endpoint::publish(ctx, ncp, &tenant.cluster(), endpoint).await?;
    }
    Ok(binding)
}

/// Each component created (a default) or adopted, and referenced in `spec`; etcd too when
/// `with_etcd` (not on a shared datastore).
async fn adopt_all(
    ctx: &Context,
    tenant: &mut Tenant,
    with_etcd: bool,
    spec: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), Error> {
    if with_etcd && let Some(e) = adopt(ctx, tenant, &tenant.etcd, spec).await? {
        tenant.etcd = Lookup::Found(e);
    }
    if let Some(a) = adopt(ctx, tenant, &tenant.apiserver, spec).await? {
        tenant.apiserver = Lookup::Found(a);
    }
    if let Some(c) = adopt(ctx, tenant, &tenant.controller_manager, spec).await? {
        tenant.controller_manager = Lookup::Found(c);
    }
    if let Some(s) = adopt(ctx, tenant, &tenant.scheduler, spec).await? {
        tenant.scheduler = Lookup::Found(s);
    }
    Ok(())
}

/// Warning Events for a datastore that refuses the tenant and for references to components
/// that do not exist; returns the first as the control plane's problem.
async fn report_problems(
    ctx: &Context,
    ncp: &NestedControlPlane,
    tenant: &Tenant,
    binding: Option<&crate::datastore::Binding>,
) -> Option<(String, String)> {
    let mut problem = None;
    if let Some(crate::datastore::Binding::Problem(reason, msg)) = binding {
        ctx.event(ncp.object_ref(&()), EventType::Warning, reason, msg)
            .await;
        problem.get_or_insert((reason.to_string(), msg.clone()));
    }
    for (_, msg) in lookup_problems(tenant) {
        let (on, reason) = (ncp.object_ref(&()), reasons::REFERENCE_NOT_FOUND);
        ctx.event(on, EventType::Warning, reason, &msg).await;
        problem.get_or_insert((reasons::REFERENCE_NOT_FOUND.to_string(), msg));
    }
    problem
}

/// What the control plane sees of component `c`.
fn observed(
    ncp: &NestedControlPlane,
    tenant: &Tenant,
    binding: Option<&crate::datastore::Binding>,
    c: Component,
) -> Observed {
    fn obs<K: ComponentKind>(l: &Lookup<K>, desired: u32, c: Component) -> Observed {
        match l {
            Lookup::Found(k) => Observed::Present {
                status: k.common_status().cloned(),
                desired: desired as i32,
            },
            Lookup::NotFound(m) | Lookup::OtherNamespace(m) => Observed::Missing(m.clone()),
            Lookup::Unreferenced => {
                Observed::Missing(format!("creating a default {}", tenant::kind_of(c)))
            }
        }
    }
    let d = tenant.replicas(c);
    match c {
        Component::Etcd if tenant.on_datastore() => datastore_observed(ncp, binding),
        Component::Etcd => obs(&tenant.etcd, d, c),
        Component::ApiServer => obs(&tenant.apiserver, d, c),
        Component::ControllerManager => obs(&tenant.controller_manager, d, c),
        Component::Scheduler => obs(&tenant.scheduler, d, c),
    }
}

/// The status the control plane should report now ([`status::compute`], pure), with its
/// recorded name, its datastore binding and its quota condition.
async fn next_status(
    ctx: &Context,
    ncp: &NestedControlPlane,
    tenant: &Tenant,
    binding: Option<&crate::datastore::Binding>,
    problem: &Option<(String, String)>,
    paused: bool,
) -> Result<nestplane_api::NestedControlPlaneStatus, Error> {
    let now = k8s_openapi::jiff::Timestamp::now();
    let mut new_status = status::compute(&status::Inputs {
        cluster: &ncp.name_any(),
        generation: ncp.metadata.generation,
        previous: ncp.status.as_ref(),
        components: Component::ALL.map(|c| (c, observed(ncp, tenant, binding, c))),
        problem: problem.clone(),
        paused,
        now,
    });
    // The name is recorded once the finalizer holds it, and never changes afterwards.
    new_status.cluster_name = ncp
        .status
        .as_ref()
        .and_then(|s| s.cluster_name.clone())
        .or_else(|| {
            (crate::finalizer::has(&tenant.ncp, names::FINALIZER)
                && tenant.name_problem().is_none())
            .then(|| tenant.cluster())
        });
    // Once bound, a tenant stays bound to its datastore (its data is there) until deleted.
    new_status.datastore = match binding {
        Some(crate::datastore::Binding::Bound(b)) => Some(b.clone()),
        _ => ncp.status.as_ref().and_then(|s| s.datastore.clone()),
    };
    let (upgrading, upgrade) = upgrade_state(ctx, tenant, new_status.upgrade.as_ref());
    match upgrading {
        Some(c) => conditions::set(&mut new_status.conditions, c, ncp.metadata.generation, now),
        None => new_status
            .conditions
            .retain(|c| c.type_ != types::UPGRADING),
    }
    new_status.upgrade = upgrade;
    // Only a name that is routed: the API server runs here, under a name that is no problem.
    new_status.gateway = (tenant.name_problem().is_none()
        && ctx.runs_here(tenant, Component::ApiServer))
    .then(|| ctx.runtime.gateway(ncp))
    .flatten();
    match crate::datastore::quota_condition(ctx, ncp).await? {
        Some(c) => conditions::set(&mut new_status.conditions, c, ncp.metadata.generation, now),
        None => new_status
            .conditions
            .retain(|c| c.type_ != crate::datastore::QUOTA_CONDITION),
    }
    Ok(new_status)
}

/// `Upgrading` and `status.upgrade`, from the version change as judged now
/// ([`crate::component::version_change`]) and the last `status.upgrade`.
fn upgrade_state(
    ctx: &Context,
    tenant: &Tenant,
    previous: Option<&nestplane_api::UpgradeStatus>,
) -> (
    Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    Option<nestplane_api::UpgradeStatus>,
) {
    let change = crate::component::version_change(ctx, tenant);
    upgrade_of(tenant, &change, previous, &|d| ctx.runs_here(tenant, d))
}

/// [`upgrade_state`]'s pure part.
/// - Condition `Upgrading`: True while parts move (each `Kind from → to`, and what a part
///   that has not moved yet waits for), False when the change is refused as a whole (what
///   runs keeps its version), absent when no change is pending.
/// - `status.upgrade`: the change's from, to and steps, kept while it progresses; `Completed`
///   once the API server runs `to`; a refused change is recorded until it is withdrawn.
pub(crate) fn upgrade_of(
    tenant: &Tenant,
    change: &crate::tenant::VersionChange,
    previous: Option<&nestplane_api::UpgradeStatus>,
    steps_here: &dyn Fn(Component) -> bool,
) -> (
    Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    Option<nestplane_api::UpgradeStatus>,
) {
    use crate::tenant::VersionChange;
    use nestplane_api::UpgradeStatus;
    let oldest = Component::ALL
        .iter()
        .filter_map(|&c| tenant.running_version(c))
        .min();
    match change {
        VersionChange::None => {
            // A change in progress that is no longer pending has completed, if the API server
            // runs where it went; otherwise it was withdrawn, as is a refused one.
            let done = previous.filter(|p| {
                p.phase == "Progressing"
                    && tenant
                        .running_version(Component::ApiServer)
                        .is_some_and(|v| v.to_string() == p.to)
            });
            let done = done.or(previous.filter(|p| p.phase == "Completed"));
            (
                None,
                done.map(|p| UpgradeStatus {
                    phase: "Completed".into(),
                    current_step: None,
                    message: None,
                    ..p.clone()
                }),
            )
        }
        // Nothing runs yet: the components themselves say why they do not start.
        VersionChange::Refused(..) if oldest.is_none() => (None, None),
        VersionChange::Refused(reason, msg) => {
            let message = format!("{msg}; every component keeps the version it runs");
            let phase = if *reason == crate::removed::CHECKING {
                "Checking"
            } else {
                "Refused"
            };
            // What was asked for, as written when it is no version at all (never empty: the
            // 1.20 API server turns an empty string into a null, which the schema refuses).
            let to = tenant
                .version(Component::ApiServer)
                .map(|v| v.to_string())
                .unwrap_or_else(|_| {
                    tenant
                        .spec_of(Component::ApiServer)
                        .and_then(|s| s.version.clone().or(s.channel.clone()))
                        .or(tenant.ncp.spec.version.clone())
                        .filter(|v| !v.trim().is_empty())
                        .unwrap_or_else(|| "(unreadable)".into())
                });
            // What was planned is kept while the same change waits or is refused.
            let same = previous.filter(|p| p.phase != "Completed" && p.to == to);
            (
                Some(conditions::new(
                    types::UPGRADING,
                    false,
                    reason,
                    message.clone(),
                )),
                Some(UpgradeStatus {
                    from: same
                        .map(|p| p.from.clone())
                        .or(oldest.map(|v| v.to_string()))
                        .unwrap_or_default(),
                    to: conditions::cut(&to, 256),
                    steps: same.map(|p| p.steps.clone()).unwrap_or_default(),
                    current_step: None,
                    phase: phase.into(),
                    message: Some(conditions::cut(
                        &format!("{reason}: {message}"),
                        conditions::MAX_MESSAGE,
                    )),
                }),
            )
        }
        VersionChange::Moving(plan) => {
            let parts: Vec<String> = plan
                .moves()
                .map(|(c, from, to)| match tenant.held_by(plan, c, steps_here) {
                    Some((d, _)) if tenant.rendered_version(c) != Some(to) => format!(
                        "{} {from} → {to} (after {})",
                        tenant::kind_of(c),
                        tenant::kind_of(d)
                    ),
                    _ => format!("{} {from} → {to}", tenant::kind_of(c)),
                })
                .collect();
            let to = plan.to.to_string();
            // The same change goes on (a wait or a refusal in between does not make it new).
            let kept =
                previous.filter(|p| p.phase != "Completed" && p.to == to && !p.steps.is_empty());
            let step = plan.steps.first().copied().unwrap_or(plan.to);
            let steps = kept
                .map(|p| p.steps.clone())
                .unwrap_or_else(|| plan.steps.iter().map(ToString::to_string).collect());
            let position = steps
                .iter()
                .position(|s| *s == step.to_string())
                .map(|i| format!("step {} of {}", i + 1, steps.len()))
                .unwrap_or_else(|| "step".into());
            let message = format!("{position} ({step}): {}", parts.join(", "));
            (
                Some(conditions::new(
                    types::UPGRADING,
                    true,
                    reasons::UPGRADING,
                    message.clone(),
                )),
                Some(UpgradeStatus {
                    from: kept
                        .map(|p| p.from.clone())
                        .unwrap_or_else(|| plan.from.to_string()),
                    to,
                    steps,
                    current_step: Some(step.to_string()),
                    phase: "Progressing".into(),
                    message: Some(message),
                }),
            )
        }
    }
}

/// Write `new_status` (a merge patch: server-side apply in 1.20 turns empty strings into
/// nulls; cleared optional fields are sent as explicit nulls so they disappear), with an
/// Event when `Available` changes. A new control plane's first state, while it is only on
/// its way (no problem), is in its status alone (see the components' Events).
async fn write_status(
    ctx: &Context,
    api: &Api<NestedControlPlane>,
    ncp: &NestedControlPlane,
    tenant: &mut Tenant,
    new_status: nestplane_api::NestedControlPlaneStatus,
    problem: bool,
) -> Result<(), Error> {
    let before = ncp
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, types::AVAILABLE))
        .map(|c| (c.status.clone(), c.reason.clone()));
    let after = conditions::get(&new_status.conditions, types::AVAILABLE).cloned();
    let mut body = serde_json::to_value(&new_status).map_err(|e| Error::Internal(e.to_string()))?;
    for field in ["failureReason", "failureMessage", "upgrade", "gateway"] {
        if body.get(field).is_none() {
            body[field] = serde_json::Value::Null;
        }
    }
    let patch = serde_json::json!({ "status": body });
    let written = api
        .patch_status(
            &ncp.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    ctx.written.remember(&tenant.ncp, written);
    let upgrading = |st: Option<&nestplane_api::NestedControlPlaneStatus>| {
        st.and_then(|s| conditions::get(&s.conditions, types::UPGRADING))
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    if let Some((status, reason, message)) = upgrading(Some(&new_status))
        && upgrading(ncp.status.as_ref()).map(|(s, r, _)| (s, r))
            != Some((status.clone(), reason.clone()))
    {
        let type_ = if status == "True" || reason == crate::removed::CHECKING {
            EventType::Normal
        } else {
            EventType::Warning
        };
        ctx.event(ncp.object_ref(&()), type_, &reason, &message)
            .await;
    }
    // A step every part reached, and the change's end: one Event each.
    let upgrade =
        |st: Option<&nestplane_api::NestedControlPlaneStatus>| st.and_then(|s| s.upgrade.clone());
    if let (Some(was), Some(now)) = (upgrade(ncp.status.as_ref()), upgrade(Some(&new_status)))
        && was.phase == "Progressing"
        && (now.phase == "Progressing" || now.phase == "Completed")
        && was.to == now.to
        && was.current_step != now.current_step
        && let Some(reached) = &was.current_step
    {
        let (reason, note) = if now.phase == "Completed" {
            (
                reasons::UPGRADE_COMPLETED,
                format!("every part runs {} (from {})", now.to, now.from),
            )
        } else {
            (
                reasons::UPGRADE_STEP_REACHED,
                format!(
                    "every part runs {reached}; next: {} (to {})",
                    now.current_step.as_deref().unwrap_or_default(),
                    now.to
                ),
            )
        };
        ctx.event(ncp.object_ref(&()), EventType::Normal, reason, &note)
            .await;
    }
    let first_wait = before.is_none() && !problem;
    if let Some(after) = after
        && before != Some((after.status.clone(), after.reason.clone()))
        && (after.status == "True" || !first_wait)
    {
        let (type_, note) = if after.status == "True" {
            (
                EventType::Normal,
                "the tenant control plane is available".to_string(),
            )
        } else if problem {
            (EventType::Warning, after.message.clone())
        } else {
            (EventType::Normal, after.message.clone())
        };
        ctx.event(ncp.object_ref(&()), type_, &after.reason, &note)
            .await;
    }
    Ok(())
}

/// A merge patch that adds (or removes) nestplane's finalizer. It carries the
/// resourceVersion it was computed from, so the API server refuses it (409) when another
/// writer changed the list meanwhile, instead of dropping that writer's entry.
pub fn finalizer_patch(ncp: &NestedControlPlane, add: bool) -> serde_json::Value {
    let mut patch = crate::finalizer::patch(ncp, names::FINALIZER, add);
    if add {
        // The identity is fixed with the finalizer, before anything is provisioned.
        patch["metadata"]["annotations"] =
            serde_json::json!({names::CLUSTER_IDENTITY_ANNOTATION: tenant::cluster_name(ncp)});
    }
    patch
}

/// etcd as a tenant on a shared datastore sees it: Ready once bound there.
fn datastore_observed(
    ncp: &NestedControlPlane,
    binding: Option<&crate::datastore::Binding>,
) -> Observed {
    use crate::datastore::Binding;
    let bound = ncp.status.as_ref().and_then(|s| s.datastore.as_ref());
    let (ready, reason, message) = match (binding, bound) {
        (Some(Binding::Bound(b)), _) | (None, Some(b)) => (
            true,
            reasons::AS_EXPECTED,
            format!(
                "on NestedDatastore {}/{} as etcd user {} under {}",
                b.namespace, b.name, b.user, b.prefix
            ),
        ),
        (Some(Binding::Waiting(m)), _) => {
            (false, crate::datastore::WAITING_FOR_DATASTORE, m.clone())
        }
        (Some(Binding::Problem(r, m)), _) => (false, *r, m.clone()),
        (None, None) => (
            false,
            crate::datastore::WAITING_FOR_DATASTORE,
            "not bound to its datastore yet".to_string(),
        ),
    };
    let mut status = nestplane_api::ComponentStatus {
        ready,
        ready_replicas: Some(i32::from(ready)),
        ..Default::default()
    };
    conditions::set(
        &mut status.conditions,
        conditions::new(types::READY, ready, reason, message),
        ncp.metadata.generation,
        k8s_openapi::jiff::Timestamp::now(),
    );
    Observed::Present {
        status: Some(status),
        desired: 1,
    }
}

fn lookup_problems(t: &Tenant) -> Vec<(Component, String)> {
    let mut out = Vec::new();
    let mut check = |c: Component, p: Option<String>| {
        if let Some(m) = p {
            out.push((c, m));
        }
    };
    fn p<K>(l: &Lookup<K>) -> Option<String> {
        match l {
            Lookup::NotFound(m) | Lookup::OtherNamespace(m) => Some(m.clone()),
            _ => None,
        }
    }
    check(Component::Etcd, p(&t.etcd));
    check(Component::ApiServer, p(&t.apiserver));
    check(Component::ControllerManager, p(&t.controller_manager));
    check(Component::Scheduler, p(&t.scheduler));
    out
}

/// Create a default component when unreferenced (its reference goes into `spec`, for the
/// control plane's one patch); take controller ownership of a referenced one. Returns the
/// component as created or changed, `None` when nothing changed.
async fn adopt<K: ComponentKind>(
    ctx: &Context,
    t: &Tenant,
    l: &Lookup<K>,
    spec: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<Option<K>, Error> {
    let ns = t.namespace();
    let cluster = t.cluster();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &ns);
    let owner = tenant::owner_ref(&t.ncp);
    match l {
        Lookup::Unreferenced => {
            let name = K::COMPONENT.workload_name(&cluster);
            let mut obj = K::with_defaults(&name, &ns);
            obj.meta_mut().owner_references = Some(vec![owner]);
            obj.meta_mut().labels =
                Some([(names::CLUSTER_NAME_LABEL.to_string(), cluster.clone())].into());
            let made = match api.create(&PostParams::default(), &obj).await {
                Ok(made) => made,
                // Made by an earlier pass whose reference did not get written.
                Err(kube::Error::Api(e)) if e.code == 409 => api.get(&name).await?,
                Err(e) => return Err(e.into()),
            };
            spec.insert(
                tenant::reference_field(K::COMPONENT).into(),
                serde_json::json!({
                    "apiVersion": K::api_version(&()),
                    "kind": K::kind(&()),
                    "name": name,
                    "namespace": ns,
                }),
            );
            Ok(Some(made))
        }
        Lookup::Found(k) => match tenant::controller_of(k) {
            Some(r) if r.uid == owner.uid => Ok(None),
            Some(r) => {
                ctx.event(
                    t.ncp.object_ref(&()),
                    EventType::Warning,
                    reasons::INVALID_SPEC,
                    &format!(
                        "{} {ns}/{} is controlled by NestedControlPlane {}; not adopting it",
                        K::kind(&()),
                        k.name_any(),
                        r.name
                    ),
                )
                .await;
                Ok(None)
            }
            None => {
                let mut refs = k.meta().owner_references.clone().unwrap_or_default();
                refs.push(owner);
                let mut labels = k.meta().labels.clone().unwrap_or_default();
                labels.insert(names::CLUSTER_NAME_LABEL.to_string(), cluster.clone());
                let adopted = api
                    .patch(
                        &k.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({"metadata": {
                            "ownerReferences": refs,
                            "labels": labels,
                            "resourceVersion": k.resource_version(),
                        }})),
                    )
                    .await?;
                Ok(Some(adopted))
            }
        },
        Lookup::NotFound(_) | Lookup::OtherNamespace(_) => Ok(None),
    }
}

/// Deletion: stop the tenant's processes, remove its data, delete the secrets and Service
/// nestplane created for it (and nothing else), then release the finalizer.
async fn cleanup(
    ncp: &NestedControlPlane,
    ctx: &Context,
    api: &Api<NestedControlPlane>,
) -> Result<Action, Error> {
    let ns = ncp.namespace().unwrap_or_default();
    let name = tenant::cluster_name(ncp);
    ctx.removed_apis.forget(&format!("{ns}/{}", ncp.name_any()));
    if !crate::finalizer::has(ncp, names::FINALIZER) {
        return Ok(Action::await_change());
    }
    if let Some(p) = names::dns_label_problem(&name, names::MAX_CLUSTER_NAME_LEN) {
        // Nothing is ever made under a name that is no DNS label: nothing to remove.
        tracing::warn!(namespace = %ns, problem = %p, "control plane deleted; its name was never used");
        api.patch(
            &ncp.name_any(),
            &PatchParams::default(),
            &Patch::Merge(finalizer_patch(ncp, false)),
        )
        .await?;
        return Ok(Action::await_change());
    }
    ctx.runtime.remove(&ctx.client, ncp).await?;
    crate::datastore::unbind(ctx, ncp).await?;
    let uid = ncp.uid().unwrap_or_default();
    let selector = format!(
        "{}={name},{}={}",
        names::CLUSTER_NAME_LABEL,
        names::MANAGED_BY_LABEL,
        names::MANAGED_BY
    );
    let owned = |meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        meta.owner_references.iter().flatten().any(|r| r.uid == uid)
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    for s in secrets
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        if owned(&s.metadata) {
            gone(
                secrets
                    .delete(&s.name_any(), &DeleteParams::default())
                    .await,
                &s.name_any(),
            );
        }
    }
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    for s in services
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
    {
        if owned(&s.metadata) {
            gone(
                services
                    .delete(&s.name_any(), &DeleteParams::default())
                    .await,
                &s.name_any(),
            );
        }
    }
    api.patch(
        &ncp.name_any(),
        &PatchParams::default(),
        &Patch::Merge(finalizer_patch(ncp, false)),
    )
    .await?;
    ctx.metrics.remove_tenant(&ns, &ncp.name_any());
    tracing::info!(namespace = %ns, cluster = %name, "tenant removed");
    Ok(Action::await_change())
}

/// A teardown delete of an object the control plane owns: a failure is logged, and the
/// garbage collector removes the object with its owner.
fn gone<T>(result: Result<T, kube::Error>, name: &str) {
    match result {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => {
            tracing::warn!(%name, error = %e, "delete failed; the garbage collector removes it with its control plane")
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;
    use crate::tenant::tests::running;

    fn judged(t: &Tenant, newest: impl Fn(u32) -> Option<u32>) -> crate::tenant::VersionChange {
        t.version_change(&Component::ALL, |_, _| Ok(()), newest)
    }

    #[test]
    fn status_upgrade_tells_the_story_of_a_change() {
        let newest = |minor: u32| (minor == 21).then_some(4);
        // Begun: from, to and the steps; the parts that wait say for what.
        let t = running("v1.22.1", [Some("v1.20.2"); 4]);
        let (cond, up) = upgrade_of(&t, &judged(&t, newest), None, &|_| true);
        let cond = cond.expect("Upgrading");
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("True", "Upgrading")
        );
        assert!(
            cond.message
                .starts_with("step 1 of 2 (v1.21.4): NestedEtcd v1.20.2 → v1.21.4, ")
                && cond
                    .message
                    .contains("NestedAPIServer v1.20.2 → v1.21.4 (after NestedEtcd)"),
            "{}",
            cond.message
        );
        let up = up.expect("status.upgrade");
        assert_eq!(
            (up.from.as_str(), up.to.as_str(), up.phase.as_str()),
            ("v1.20.2", "v1.22.1", "Progressing")
        );
        assert_eq!(up.steps, ["v1.21.4", "v1.22.1"]);
        assert_eq!(up.current_step.as_deref(), Some("v1.21.4"));
        // The second step keeps where the change began and its steps.
        let t = running("v1.22.1", [Some("v1.21.4"); 4]);
        let (cond, next) = upgrade_of(&t, &judged(&t, newest), Some(&up), &|_| true);
        let next = next.expect("status.upgrade");
        assert_eq!(next.from, "v1.20.2");
        assert_eq!(next.steps, ["v1.21.4", "v1.22.1"]);
        assert_eq!(next.current_step.as_deref(), Some("v1.22.1"));
        assert!(cond.expect("Upgrading").message.starts_with("step 2 of 2"));
        // A refusal in the middle (a binary gone, say) keeps what was planned, and the
        // change picks up where it was.
        let refused_midway = crate::tenant::VersionChange::Refused(
            "VersionUnavailable",
            "no kube-apiserver for v1.22.1".into(),
        );
        let (_, midway) = upgrade_of(&t, &refused_midway, Some(&next), &|_| true);
        let midway = midway.expect("recorded");
        assert_eq!(midway.phase, "Refused");
        assert_eq!(midway.steps, ["v1.21.4", "v1.22.1"]);
        let (_, again) = upgrade_of(&t, &judged(&t, newest), Some(&midway), &|_| true);
        let again = again.expect("status.upgrade");
        assert_eq!(
            (again.from.as_str(), again.current_step.as_deref()),
            ("v1.20.2", Some("v1.22.1"))
        );
        // Done: the condition goes, the record stays, Completed.
        let t = running("v1.22.1", [Some("v1.22.1"); 4]);
        let (cond, done) = upgrade_of(&t, &judged(&t, newest), Some(&next), &|_| true);
        assert!(cond.is_none());
        let done = done.expect("kept");
        assert_eq!(
            (done.phase.as_str(), done.current_step.as_deref()),
            ("Completed", None)
        );
        assert_eq!(done.from, "v1.20.2");
        // ...and stays so on later passes.
        let (_, again) = upgrade_of(&t, &judged(&t, newest), Some(&done), &|_| true);
        assert_eq!(again.as_ref(), Some(&done));

        // Refused: False with the reason; recorded, and gone once withdrawn.
        let t = running("v1.23.0", [Some("v1.22.1"); 4]);
        let t = {
            let mut t = t;
            t.ncp.spec.version = Some("v1.20.2".into());
            t
        };
        let (cond, refused) = upgrade_of(&t, &judged(&t, newest), Some(&done), &|_| true);
        let cond = cond.expect("Upgrading");
        assert_eq!(
            (cond.status.as_str(), cond.reason.as_str()),
            ("False", "DowngradeRefused")
        );
        let refused = refused.expect("recorded");
        assert_eq!(
            (
                refused.from.as_str(),
                refused.to.as_str(),
                refused.phase.as_str()
            ),
            ("v1.22.1", "v1.20.2", "Refused")
        );
        let t = running("v1.22.1", [Some("v1.22.1"); 4]);
        assert_eq!(
            upgrade_of(&t, &judged(&t, newest), Some(&refused), &|_| true),
            (None, None)
        );
        // A change withdrawn half way (asked for what the API server still runs) is not
        // reported as completed.
        let t = running("v1.20.2", [Some("v1.20.2"); 4]);
        assert_eq!(
            upgrade_of(&t, &judged(&t, newest), Some(&up), &|_| true),
            (None, None)
        );
    }
}
