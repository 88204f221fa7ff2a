//! The `HostedCluster` controller, in seed 002's order: finalizer → control-plane namespace
//! `<namespace>-<name>` → the control plane (a `NestedControlPlane`, HyperShift's
//! `HostedControlPlane`) → `ExternalInfraCluster` → a Cluster API `Cluster` referencing both
//! (where the kind is served) → the initial `NodePool`. Status bubbles up from the control
//! plane. Teardown: NodePools (drained) → Cluster → control plane → namespace → finalizer,
//! each step named in the `Deleting` condition; a step whose object is already gone is done.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::conditions;
use nestplane_api::hosted::{
    ClusterVersionStatus, DnsProvider, DnsStatus, ExternalInfraCluster, HostedCluster,
    HostedClusterStatus, NodePool, NodePoolManagement, NodePoolSpec, Release, SecretKeyRef,
    UpdateHistory, types,
};
use nestplane_api::names;
use nestplane_api::{
    ApiEndpoint, ClusterNetwork, NestedAPIServer, NestedAPIServerSpec, NestedControlPlane,
    NestedControlPlaneSpec, NestedControlPlaneStatus, NetworkRanges,
};

use super::claim::{self, control_plane_namespace, key, made_for};
pub use super::claim::{HOSTED_CLUSTER_ANNOTATION, HOSTED_CLUSTER_UID_ANNOTATION};
use super::{HostedContext, plan};
use crate::context::Error;
use crate::error::AtStep;

/// The finalizer on a HostedCluster.
pub const FINALIZER: &str = "nestplane.io/hostedcluster";
/// The key of the admin kubeconfig copied into the HostedCluster's namespace.
pub const KUBECONFIG_KEY: &str = "kubeconfig";
/// How often a cluster that is not Available yet, or a teardown, is looked at again.
pub const PROGRESS_RECHECK: Duration = Duration::from_secs(3);

/// The name of the admin kubeconfig copy in the HostedCluster's namespace.
pub fn admin_kubeconfig(hc: &HostedCluster) -> String {
    format!("{}-admin-kubeconfig", hc.name_any())
}

fn cluster_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, "v1beta1", "Cluster"),
        "clusters",
    )
}

/// One pass over one HostedCluster: what every step reads and the status it builds.
struct Pass<'a> {
    ctx: &'a HostedContext,
    hc: &'a HostedCluster,
    api: Api<HostedCluster>,
    status: HostedClusterStatus,
    now: Timestamp,
    /// The control plane's namespace and name.
    cp_ns: String,
    name: String,
}

impl Pass<'_> {
    fn set(&mut self, c: Condition) {
        super::set_condition(&mut self.status.conditions, self.hc, c, self.now);
    }

    async fn event(&self, type_: EventType, reason: &str, note: &str) {
        let on = self.hc.object_ref(&());
        self.ctx.event(on, type_, reason, note).await;
    }

    async fn write(&self) -> Result<(), Error> {
        crate::status::write(&self.api, self.hc, self.hc.status.as_ref(), &self.status).await
    }

    /// A refusal: `ValidConfiguration` False and `Degraded` with `reason`, an Event when new,
    /// the status written; nothing else is touched.
    async fn refuse(mut self, reason: &str, message: String) -> Result<Action, Error> {
        // Against what the object reports (this pass may have set the condition already).
        let before = self
            .hc
            .status
            .as_ref()
            .and_then(|s| conditions::get(&s.conditions, types::VALID_CONFIGURATION))
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()));
        self.set(conditions::new(
            types::VALID_CONFIGURATION,
            false,
            reason,
            &message,
        ));
        self.set(conditions::new(types::DEGRADED, true, reason, &message));
        let now = Some((
            "False".to_string(),
            reason.to_string(),
            conditions::cut(&message, conditions::MAX_MESSAGE),
        ));
        if before != now {
            self.event(EventType::Warning, reason, &message).await;
        }
        self.write().await?;
        Ok(Action::await_change())
    }

    fn ncps(&self) -> Api<NestedControlPlane> {
        Api::namespaced(self.ctx.client.clone(), &self.cp_ns)
    }

    /// Metadata of an object made for this HostedCluster in its control plane's namespace.
    fn meta(&self, name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(self.cp_ns.clone()),
            annotations: Some(claim::annotations(self.hc)),
            ..Default::default()
        }
    }
}

/// What already exists under this HostedCluster's control-plane name, claimed.
struct Claimed {
    namespace: Option<Namespace>,
    ncp: Option<NestedControlPlane>,
}

/// Reconcile one HostedCluster, in seed 002's order: validate → claim → pause → finalizer →
/// namespace → control plane → infrastructure → Cluster → initial pool → kubeconfig →
/// cluster DNS → status.
#[tracing::instrument(name = "HostedCluster", skip_all, fields(hostedcluster = %key(&hc)))]
pub async fn reconcile(hc: Arc<HostedCluster>, ctx: Arc<HostedContext>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("HostedCluster");
    let ns = hc.namespace().unwrap_or_default();
    let mut pass = Pass {
        ctx: &ctx,
        hc: &hc,
        api: Api::namespaced(ctx.client.clone(), &ns),
        status: hc.status.clone().unwrap_or_default(),
        now: Timestamp::now(),
        cp_ns: control_plane_namespace(&hc),
        name: hc.name_any(),
    };
    if hc.metadata.deletion_timestamp.is_some() {
        return teardown(pass).await.at("teardown");
    }
    let networking = plan::networking(&hc.spec);
    let paused = match validate(&pass, &networking) {
        Ok(p) => p,
        Err(msg) => return pass.refuse("InvalidConfiguration", msg).await,
    };
    let claimed = match claim(&pass).await.at("claim")? {
        Ok(c) => c,
        Err(msg) => return pass.refuse("NamespaceTaken", msg).await,
    };
    // Set once both checks hold (setting it True and then False in one pass would make
    // every pass a new transition, and a write).
    pass.set(conditions::new(
        types::VALID_CONFIGURATION,
        true,
        "AsExpected",
        "",
    ));
    if let Some(action) = pause(&mut pass, claimed.ncp.as_ref(), paused)
        .await
        .at("pause")?
    {
        return Ok(action);
    }
    crate::finalizer::add(&pass.api, hc.as_ref(), FINALIZER)
        .await
        .at("finalizer")?;
    if claimed.namespace.is_none() {
        create_namespace(&pass).await.at("namespace")?;
    }
    let asked = plan::version(&hc.spec.release.version);
    let (version, held) = version_to_pass(&pass, claimed.ncp.as_ref(), &asked)
        .await
        .at("node pools")?;
    let ncp = control_plane(&pass, claimed.ncp, &networking, &version)
        .await
        .at("control plane")?;
    pass.status.networking = Some(networking.clone());
    pass.status.control_plane_namespace = Some(pass.cp_ns.clone());
    keep_ranges_unreachable(&pass, &networking);
    let ready = ncp.status.as_ref().is_some_and(|s| s.ready);
    let endpoint = infrastructure(&pass, &ncp, ready)
        .await
        .at("infrastructure")?;
    cluster_api_cluster(&pass, &networking)
        .await
        .at("Cluster")?;
    initial_pool(&mut pass).await.at("initial pool")?;
    copy_kubeconfig(&mut pass).await.at("kubeconfig")?;
    let provider = plan::dns_provider(&hc.spec, ctx.dns.default_provider, ctx.nodes.is_some());
    let pass_ctx = pass.ctx;
    let dns_available = keep_dns(
        pass_ctx,
        &hc,
        &mut pass.status,
        ready,
        provider,
        &networking,
        &version,
    )
    .await;
    pass.status.control_plane_endpoint = endpoint;
    upgradeable(&mut pass, held).await;
    report(pass, &ncp, &asked, dns_available).await.at("status")
}

/// The configuration is valid and networking unchanged since creation; returns the pause.
fn validate(
    pass: &Pass<'_>,
    networking: &nestplane_api::hosted::ClusterNetworking,
) -> Result<Option<Option<Timestamp>>, String> {
    plan::validate(&pass.hc.spec)?;
    if let Some(recorded) = pass
        .status
        .networking
        .as_ref()
        .filter(|recorded| *recorded != networking)
    {
        return Err(format!(
            "networking is immutable: the control plane was created with clusterNetwork {} and serviceNetwork {}; set them back",
            recorded
                .cluster_network
                .first()
                .map(|e| e.cidr.as_str())
                .unwrap_or_default(),
            recorded
                .service_network
                .first()
                .map(|e| e.cidr.as_str())
                .unwrap_or_default()
        ));
    }
    plan::paused(pass.hc.spec.paused_until.as_deref(), pass.now)
}

/// Claim before touching: a control-plane namespace (or control plane) that was not made for
/// this HostedCluster is refused before any finalizer, patch or delete.
async fn claim(pass: &Pass<'_>) -> Result<Result<Claimed, String>, Error> {
    let (cp_ns, name) = (&pass.cp_ns, &pass.name);
    let namespace = Api::<Namespace>::all(pass.ctx.client.clone())
        .get_opt(cp_ns)
        .await?;
    if let Some(n) = &namespace
        && !made_for(&n.metadata, pass.hc)
    {
        return Ok(Err(format!(
            "namespace {cp_ns} exists and was not made for this HostedCluster; nothing is created, changed or deleted in it"
        )));
    }
    // Read live: what is claimed here is patched next.
    let ncp = match &namespace {
        Some(_) => pass.ncps().get_opt(name).await?,
        None => None,
    };
    if let Some(ncp) = &ncp
        && !made_for(&ncp.metadata, pass.hc)
    {
        return Ok(Err(format!(
            "NestedControlPlane {cp_ns}/{name} exists and was not made for this HostedCluster; it is left alone"
        )));
    }
    Ok(Ok(Claimed { namespace, ncp }))
}

/// `ReconciliationActive`, and the control plane paused with the HostedCluster. While paused
/// nothing else changes: returns when to look again.
async fn pause(
    pass: &mut Pass<'_>,
    ncp: Option<&NestedControlPlane>,
    paused: Option<Option<Timestamp>>,
) -> Result<Option<Action>, Error> {
    pass.set(match &paused {
        Some(Some(t)) => conditions::new(
            types::RECONCILIATION_ACTIVE,
            false,
            "ReconciliationPaused",
            format!("paused until {t}"),
        ),
        Some(None) => conditions::new(
            types::RECONCILIATION_ACTIVE,
            false,
            "ReconciliationPaused",
            "paused (pausedUntil: \"true\")",
        ),
        None => conditions::new(types::RECONCILIATION_ACTIVE, true, "AsExpected", ""),
    });
    let pause_value = paused.as_ref().map(|_| "true");
    if let Some(ncp) = ncp
        && ncp
            .annotations()
            .get(names::PAUSED_ANNOTATION)
            .map(String::as_str)
            != pause_value
    {
        pass.ncps()
            .patch(
                &pass.name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"metadata": {"annotations": {names::PAUSED_ANNOTATION: pause_value}}})),
            )
            .await?;
    }
    let Some(until) = paused else {
        return Ok(None);
    };
    pass.write().await?;
    Ok(Some(match until {
        Some(t) => Action::requeue(
            Duration::try_from(t.duration_since(pass.now)).unwrap_or(Duration::from_secs(1)),
        ),
        None => Action::await_change(),
    }))
}

/// The control plane's namespace, claimed for this HostedCluster.
async fn create_namespace(pass: &Pass<'_>) -> Result<(), Error> {
    let n = Namespace {
        metadata: ObjectMeta {
            name: Some(pass.cp_ns.clone()),
            annotations: Some(claim::annotations(pass.hc)),
            labels: Some(
                [(
                    names::MANAGED_BY_LABEL.to_string(),
                    names::MANAGED_BY.to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        ..Default::default()
    };
    create(&Api::all(pass.ctx.client.clone()), &n).await
}

/// The version the control plane is given: the one asked for, unless a node pool would be
/// left outside the kubelet skew policy by it ([`plan::pool_blocking`]); then the control
/// plane keeps its version and the reason is returned. Pools are read only while the asked
/// version is not the control plane's yet.
async fn version_to_pass(
    pass: &Pass<'_>,
    ncp: Option<&NestedControlPlane>,
    asked: &str,
) -> Result<(String, Option<String>), Error> {
    let Some(current) = ncp.and_then(|n| n.spec.version.clone()) else {
        return Ok((asked.to_string(), None));
    };
    if current == asked {
        return Ok((current, None));
    }
    let pools: Vec<(String, Option<String>)> = pass
        .ctx
        .pools_of(&pass.hc.namespace().unwrap_or_default(), &pass.name)
        .await?
        .into_iter()
        .map(|p| {
            let running = p
                .status
                .as_ref()
                .and_then(|s| s.version.clone())
                .or_else(|| p.spec.release.as_ref().map(|r| r.version.clone()));
            (p.name_any(), running)
        })
        .collect();
    Ok(match plan::pool_blocking(asked, &pools) {
        Some(why) => (current, Some(why)),
        None => (asked.to_string(), None),
    })
}

/// `ClusterVersionUpgradeable`: False while a node pool holds the version asked for (with a
/// Warning Event when it starts to), True otherwise.
async fn upgradeable(pass: &mut Pass<'_>, held: Option<String>) {
    let was_held = pass
        .hc
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, types::CLUSTER_VERSION_UPGRADEABLE))
        .is_some_and(|c| c.status == "False");
    match held {
        Some(why) => {
            if !was_held {
                pass.event(EventType::Warning, "NodePoolVersionSkew", &why)
                    .await;
            }
            pass.set(conditions::new(
                types::CLUSTER_VERSION_UPGRADEABLE,
                false,
                "NodePoolVersionSkew",
                why,
            ));
        }
        None => pass.set(conditions::new(
            types::CLUSTER_VERSION_UPGRADEABLE,
            true,
            "AsExpected",
            "",
        )),
    }
}

/// The control plane (HyperShift's `HostedControlPlane`): made once, its version kept.
async fn control_plane(
    pass: &Pass<'_>,
    existing: Option<NestedControlPlane>,
    networking: &nestplane_api::hosted::ClusterNetworking,
    version: &str,
) -> Result<NestedControlPlane, Error> {
    let ncps = pass.ncps();
    let name = &pass.name;
    if let Some(ncp) = existing {
        if ncp.spec.version.as_deref() != Some(version) {
            ncps.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"version": version}})),
            )
            .await?;
        }
        // A rotation asked of the HostedCluster is asked of its control plane.
        let rotations = rotation_annotations(&pass.hc.metadata, &ncp.metadata);
        // (a removed one is removed there too: `null` in the merge patch)
        if !rotations.is_empty() {
            ncps.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"metadata": {"annotations": rotations}})),
            )
            .await?;
        }
        return Ok(ncp);
    }
    let mut spec = NestedControlPlaneSpec {
        version: Some(version.to_string()),
        cluster_network: Some(cluster_network(networking)),
        ..Default::default()
    };
    if let Some(s) = pass
        .hc
        .spec
        .services
        .iter()
        .find(|s| s.service == "APIServer")
    {
        spec.apiserver = Some(api_server(pass, &s.service_publishing_strategy.type_).await?);
    }
    let mut meta = pass.meta(name);
    meta.labels = Some([(names::CLUSTER_NAME_LABEL.to_string(), name.clone())].into());
    let ncp = NestedControlPlane {
        metadata: meta,
        spec,
        status: None,
    };
    create(&ncps, &ncp).await?;
    let note = format!("NestedControlPlane {}/{name}", pass.cp_ns);
    pass.event(EventType::Normal, "ControlPlaneCreated", &note)
        .await;
    Ok(ncps.get(name).await?)
}

/// The rotation annotations where a HostedCluster (`from`) and its control plane (`to`)
/// differ, with the HostedCluster's values (`None`: removed there). Pure.
fn rotation_annotations(
    from: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    to: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> std::collections::BTreeMap<String, Option<String>> {
    let get = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta, k: &str| {
        m.annotations.as_ref().and_then(|a| a.get(k)).cloned()
    };
    crate::rotation::Target::ALL
        .into_iter()
        .flat_map(|t| {
            [
                t.start_annotation(),
                t.complete_annotation(),
                t.complete_after_annotation(),
            ]
        })
        .filter_map(|k| {
            let v = get(from, k);
            (get(to, k) != v).then(|| (k.to_string(), v))
        })
        .collect()
}

/// The API server component, published as the HostedCluster's `APIServer` service says;
/// returns the control plane's reference to it.
async fn api_server(pass: &Pass<'_>, publishing: &str) -> Result<ObjectReference, Error> {
    let name = format!("{}-apiserver", pass.name);
    // `plan::validate` accepted only the types the component knows.
    let service_type = serde_json::from_value(serde_json::Value::String(publishing.into()))
        .map_err(|e| Error::Internal(format!("publishing type {publishing:?}: {e}")))?;
    let obj = NestedAPIServer {
        metadata: pass.meta(&name),
        spec: NestedAPIServerSpec {
            service_type: Some(service_type),
            ..Default::default()
        },
        status: None,
    };
    create(&Api::namespaced(pass.ctx.client.clone(), &pass.cp_ns), &obj).await?;
    Ok(ObjectReference {
        api_version: Some(NestedAPIServer::api_version(&()).into()),
        kind: Some(NestedAPIServer::kind(&()).into()),
        name: Some(name),
        namespace: Some(pass.cp_ns.clone()),
        ..Default::default()
    })
}

/// The first service and pod network, as Cluster API writes them.
fn cluster_network(n: &nestplane_api::hosted::ClusterNetworking) -> ClusterNetwork {
    let first = |entries: Vec<String>| NetworkRanges {
        cidr_blocks: entries.into_iter().take(1).collect(),
    };
    ClusterNetwork {
        services: Some(first(
            n.service_network.iter().map(|e| e.cidr.clone()).collect(),
        )),
        pods: Some(first(
            n.cluster_network.iter().map(|e| e.cidr.clone()).collect(),
        )),
        service_domain: None,
    }
}

/// A service or pod network of the user's choosing is made unreachable on this machine too
/// (the defaults already are), so that the API server's calls to a Service address never
/// leave it. Only where this operator makes nodes (it runs as root there); failures are
/// logged.
fn keep_ranges_unreachable(pass: &Pass<'_>, networking: &nestplane_api::hosted::ClusterNetworking) {
    if pass.ctx.nodes.is_none() {
        return;
    }
    use nestplane_nodes::net::{HANDED_OUT, holds, install_unreachable};
    let own: Vec<&str> = networking
        .service_network
        .iter()
        .chain(&networking.cluster_network)
        .map(|n| n.cidr.as_str())
        .filter(|c| !HANDED_OUT.iter().any(|h| holds(h, c)))
        .collect();
    if own.is_empty() {
        return;
    }
    match install_unreachable(&own) {
        Ok(skipped) => {
            for s in skipped {
                tracing::warn!("{s}");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot make the cluster's ranges unreachable"),
    }
}

/// The infrastructure: nothing to provision; the endpoint mirrored once Ready. Returns the
/// control plane's endpoint.
async fn infrastructure(
    pass: &Pass<'_>,
    ncp: &NestedControlPlane,
    ready: bool,
) -> Result<Option<ApiEndpoint>, Error> {
    let name = &pass.name;
    let eics: Api<ExternalInfraCluster> = Api::namespaced(pass.ctx.client.clone(), &pass.cp_ns);
    let eic = match eics.get_opt(name).await? {
        Some(e) => e,
        None => {
            let obj = ExternalInfraCluster {
                metadata: pass.meta(name),
                spec: Default::default(),
                status: None,
            };
            create(&eics, &obj).await?;
            eics.get(name).await?
        }
    };
    let endpoint = ncp
        .spec
        .control_plane_endpoint
        .clone()
        .filter(|e| !e.host.is_empty());
    if ready && endpoint.is_some() && eic.spec.control_plane_endpoint != endpoint {
        eics.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"controlPlaneEndpoint": endpoint}})),
        )
        .await?;
    }
    if eic.status.as_ref().map(|s| s.ready) != Some(ready) {
        eics.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"ready": ready}})),
        )
        .await?;
    }
    Ok(endpoint)
}

/// A Cluster API Cluster referencing the control plane and the infrastructure, where the
/// kind is served (Cluster API's own type, written as its documents give it).
async fn cluster_api_cluster(
    pass: &Pass<'_>,
    networking: &nestplane_api::hosted::ClusterNetworking,
) -> Result<(), Error> {
    let (cp_ns, name) = (&pass.cp_ns, &pass.name);
    let clusters =
        Api::<DynamicObject>::namespaced_with(pass.ctx.client.clone(), cp_ns, &cluster_resource());
    match clusters.get_opt(name).await {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {}
        // The kind is not served here.
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let mut obj = DynamicObject::new(name, &cluster_resource()).within(cp_ns);
    obj.metadata.annotations = Some(claim::annotations(pass.hc));
    let reference = |api_version: String, kind: String| serde_json::json!({"apiVersion": api_version, "kind": kind, "name": name, "namespace": cp_ns});
    obj.data = serde_json::json!({"spec": {
        "clusterNetwork": cluster_network(networking),
        "controlPlaneRef": reference(NestedControlPlane::api_version(&()).into(), NestedControlPlane::kind(&()).into()),
        "infrastructureRef": reference(ExternalInfraCluster::api_version(&()).into(), ExternalInfraCluster::kind(&()).into()),
    }});
    match clusters.create(&PostParams::default(), &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The initial NodePool (`initialNodes`), once: a pool deleted later is not made again.
async fn initial_pool(pass: &mut Pass<'_>) -> Result<(), Error> {
    let Some(n) = pass.hc.spec.initial_nodes.filter(|n| *n > 0) else {
        return Ok(());
    };
    if pass.status.initial_node_pool_created {
        return Ok(());
    }
    let ns = pass.hc.namespace().unwrap_or_default();
    let mut pool = NodePool::new(
        &pass.name,
        NodePoolSpec {
            cluster_name: pass.name.clone(),
            replicas: Some(n),
            management: NodePoolManagement {
                upgrade_type: Some("Replace".into()),
                ..Default::default()
            },
            ..Default::default()
        },
    );
    pool.metadata.namespace = Some(ns.clone());
    create(&Api::namespaced(pass.ctx.client.clone(), &ns), &pool).await?;
    pass.status.initial_node_pool_created = true;
    Ok(())
}

/// The admin kubeconfig, copied where the HostedCluster's users can read it (owned by the
/// HostedCluster, so it goes with it).
async fn copy_kubeconfig(pass: &mut Pass<'_>) -> Result<(), Error> {
    let source = names::SecretPurpose::AdminKubeconfig.secret_name(&pass.name);
    let cp_secrets: Api<Secret> = Api::namespaced(pass.ctx.client.clone(), &pass.cp_ns);
    let Some(value) = cp_secrets
        .get_opt(&source)
        .await?
        .and_then(|s| s.data)
        .and_then(|d| d.get(names::KUBECONFIG_KEY).cloned())
    else {
        return Ok(());
    };
    let ns = pass.hc.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(pass.ctx.client.clone(), &ns);
    let copy = admin_kubeconfig(pass.hc);
    let current = secrets
        .get_opt(&copy)
        .await?
        .and_then(|s| s.data)
        .and_then(|d| d.get(KUBECONFIG_KEY).cloned());
    if current.as_ref() != Some(&value) {
        let mut owner = pass.hc.controller_owner_ref(&()).unwrap_or_default();
        owner.block_owner_deletion = Some(true);
        let obj = Secret {
            metadata: ObjectMeta {
                name: Some(copy.clone()),
                namespace: Some(ns),
                owner_references: Some(vec![owner]),
                labels: Some(
                    [(
                        names::MANAGED_BY_LABEL.to_string(),
                        names::MANAGED_BY.to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some([(KUBECONFIG_KEY.to_string(), value)].into()),
            ..Default::default()
        };
        secrets
            .patch(
                &copy,
                &PatchParams::apply(crate::crds::FIELD_MANAGER).force(),
                &Patch::Apply(&obj),
            )
            .await?;
    }
    pass.status.kubeconfig = Some(SecretKeyRef {
        name: copy,
        key: KUBECONFIG_KEY.into(),
    });
    Ok(())
}

/// The conditions mirrored from the control plane (a pure step: the HostedCluster says what
/// its `NestedControlPlane` says, under HyperShift's names). Returns whether the cluster has
/// reached `version`.
pub fn mirror(
    status: &mut HostedClusterStatus,
    ncp: &NestedControlPlaneStatus,
    version: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> bool {
    let from = |t: &str| conditions::get(&ncp.conditions, t).cloned();
    let mut set = |c: Condition| conditions::set(&mut status.conditions, c, generation, now);
    for (ty, source) in [
        (types::ETCD_AVAILABLE, "EtcdReady"),
        (types::KUBE_APISERVER_AVAILABLE, "APIServerReady"),
        (types::AVAILABLE, "Available"),
    ] {
        set(match from(source) {
            Some(c) => conditions::new(ty, c.status == "True", &c.reason, &c.message),
            None => conditions::new(
                ty,
                false,
                "WaitingForControlPlane",
                "the control plane reports nothing yet",
            ),
        });
    }
    set(match &ncp.failure_reason {
        Some(reason) => conditions::new(
            types::DEGRADED,
            true,
            reason,
            ncp.failure_message.clone().unwrap_or_default(),
        ),
        None => conditions::new(types::DEGRADED, false, "AsExpected", ""),
    });
    let reached = ncp.version.as_deref() == Some(version) && ncp.ready;
    // Not moving towards the version asked for is not Progressing: a node pool holds the
    // change (set before this), or the control plane refused it; a change under way says
    // where it is.
    let held = conditions::get(&status.conditions, types::CLUSTER_VERSION_UPGRADEABLE)
        .filter(|c| c.status == "False")
        .cloned();
    let upgrading = from(nestplane_api::conditions::types::UPGRADING);
    let progressing = match (reached, held, upgrading) {
        (true, _, _) => conditions::new(
            types::PROGRESSING,
            false,
            "AsExpected",
            format!("at {version}"),
        ),
        (false, Some(h), _) => conditions::new(types::PROGRESSING, false, &h.reason, &h.message),
        (false, None, Some(u)) if u.status == "False" => {
            conditions::new(types::PROGRESSING, false, &u.reason, &u.message)
        }
        (false, None, Some(u)) => conditions::new(
            types::PROGRESSING,
            true,
            "Progressing",
            format!("on the way to {version}: {}", u.message),
        ),
        (false, None, None) => conditions::new(
            types::PROGRESSING,
            true,
            "Progressing",
            format!("on the way to {version}"),
        ),
    };
    let mut set = |c: Condition| conditions::set(&mut status.conditions, c, generation, now);
    set(progressing);
    status.version = Some(version_status(
        status.version.take(),
        version,
        reached,
        generation,
        now,
    ));
    status.observed_generation = generation;
    reached
}

/// Status from the control plane, written; an Event when the cluster becomes available.
async fn report(
    mut pass: Pass<'_>,
    ncp: &NestedControlPlane,
    version: &str,
    dns_available: bool,
) -> Result<Action, Error> {
    let ncp_status = ncp.status.clone().unwrap_or_default();
    pass.status.rotations = ncp_status.rotations.clone();
    let reached = mirror(
        &mut pass.status,
        &ncp_status,
        version,
        pass.hc.metadata.generation,
        pass.now,
    );
    let before = pass.hc.status.as_ref().map(|s| &s.conditions[..]);
    let was_available = conditions::is_true(before.unwrap_or_default(), types::AVAILABLE);
    if ncp_status.ready && !was_available {
        pass.event(
            EventType::Normal,
            "Available",
            "the hosted control plane is available",
        )
        .await;
    }
    pass.write().await?;
    Ok(if reached && dns_available {
        Action::requeue(Duration::from_secs(60))
    } else if reached {
        // Cluster DNS comes up with the nodes: look again soon.
        Action::requeue(Duration::from_secs(10))
    } else {
        Action::requeue(PROGRESS_RECHECK)
    })
}

/// Keep `provider`'s cluster DNS in the hosted cluster (once its control plane is ready) and
/// report it in `status.dns` and the `ClusterDNSAvailable` condition (an Event when it becomes
/// available, a Warning when keeping it fails). Returns whether it is available.
async fn keep_dns(
    ctx: &HostedContext,
    hc: &HostedCluster,
    status: &mut HostedClusterStatus,
    ready: bool,
    provider: DnsProvider,
    networking: &nestplane_api::hosted::ClusterNetworking,
    version: &str,
) -> bool {
    let generation = hc.metadata.generation;
    let now = Timestamp::now();
    let was = conditions::get(&status.conditions, types::CLUSTER_DNS_AVAILABLE).cloned();
    let outcome: Result<Option<super::dns::Outcome>, String> = async {
        if !ready {
            return Ok(None);
        }
        let ip = plan::dns_service_ip(networking)?;
        status.dns = Some(DnsStatus {
            provider: provider.as_str().into(),
            service_ip: ip.to_string(),
        });
        let minor = nestplane_render::KubeVersion::parse(version)
            .map(|v| v.minor)
            .map_err(|e| e.to_string())?;
        let Some(t) = ctx.targets.get(ctx, hc).await.map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        super::dns::keep(&t.client, provider, ip, minor, &ctx.dns)
            .await
            .map(Some)
    }
    .await;
    let (condition, available) = match &outcome {
        Ok(None) => (
            conditions::new(
                types::CLUSTER_DNS_AVAILABLE,
                false,
                "WaitingForControlPlane",
                "cluster DNS is installed once the control plane serves",
            ),
            false,
        ),
        Ok(Some(o)) if o.available => (
            conditions::new(types::CLUSTER_DNS_AVAILABLE, true, "AsExpected", &o.message),
            true,
        ),
        Ok(Some(o)) => (
            conditions::new(
                types::CLUSTER_DNS_AVAILABLE,
                false,
                "WaitingForReplicas",
                &o.message,
            ),
            false,
        ),
        Err(e) => (
            conditions::new(
                types::CLUSTER_DNS_AVAILABLE,
                false,
                "ApplyFailed",
                format!("keeping {} in the cluster: {e}", provider.as_str()),
            ),
            false,
        ),
    };
    let changed = was.as_ref().map(|c| (&c.status, &c.reason))
        != Some((&condition.status, &condition.reason));
    if changed && (available || outcome.is_err()) {
        ctx.event(
            hc.object_ref(&()),
            if available {
                EventType::Normal
            } else {
                EventType::Warning
            },
            if available {
                "ClusterDNSAvailable"
            } else {
                "ClusterDNSApplyFailed"
            },
            &condition.message,
        )
        .await;
    }
    if let Ok(Some(o)) = &outcome
        && o.written > 0
    {
        tracing::info!(hostedcluster = %key(hc), provider = provider.as_str(), written = o.written, "cluster DNS objects applied");
    }
    conditions::set(&mut status.conditions, condition, generation, now);
    available
}

/// The version status: a new desired version opens a `Partial` history entry (newest
/// first); reaching it completes the entry.
pub fn version_status(
    previous: Option<ClusterVersionStatus>,
    version: &str,
    reached: bool,
    generation: Option<i64>,
    now: Timestamp,
) -> ClusterVersionStatus {
    let mut v = previous.unwrap_or_default();
    v.desired = Release {
        version: version.into(),
    };
    if v.history.first().map(|h| h.version.as_str()) != Some(version) {
        v.history.insert(
            0,
            UpdateHistory {
                state: "Partial".into(),
                version: version.into(),
                started_time: Time(now),
                completion_time: None,
            },
        );
        // Ten entries, and always the newest one reached (node pools follow it).
        let reached = v.history.iter().position(|h| h.state == "Completed");
        let kept = reached.filter(|&i| i >= 10).map(|i| v.history[i].clone());
        v.history.truncate(10);
        v.history.extend(kept);
    }
    if reached
        && let Some(h) = v.history.first_mut()
        && h.state != "Completed"
    {
        h.state = "Completed".into();
        h.completion_time = Some(Time(now));
    }
    v.observed_generation = generation;
    v
}

async fn create<K>(api: &Api<K>, obj: &K) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Deletion, in order; each step is visible as the `Deleting` condition's reason, and a step
/// whose object is already gone is done.
async fn teardown(mut pass: Pass<'_>) -> Result<Action, Error> {
    let hc = pass.hc;
    if !crate::finalizer::has(hc, FINALIZER) {
        return Ok(Action::await_change());
    }
    if let Some((reason, message)) = next_deletion(&pass).await? {
        let previous =
            conditions::get(&pass.status.conditions, types::DELETING).map(|c| c.reason.clone());
        pass.set(conditions::new(types::DELETING, true, reason, &message));
        if previous.as_deref() != Some(reason) {
            pass.event(EventType::Normal, reason, &message).await;
        }
        pass.write().await?;
        return Ok(Action::requeue(PROGRESS_RECHECK));
    }
    pass.ctx.targets.forget(hc);
    crate::finalizer::remove(&pass.api, hc, FINALIZER).await?;
    tracing::info!("hosted cluster removed");
    Ok(Action::await_change())
}

/// Start the next step of the teardown: 1. NodePools (their controller drains and removes
/// the nodes), 2. the Cluster (where served), 3. the control plane, 4. the namespace; only
/// what was made for this HostedCluster (anything else is someone else's). Returns the step
/// waited for, `None` when all are done. A delete that fails is tried again on the next pass.
async fn next_deletion(pass: &Pass<'_>) -> Result<Option<(&'static str, String)>, Error> {
    let (hc, cp_ns, name) = (pass.hc, &pass.cp_ns, &pass.name);
    let ns = hc.namespace().unwrap_or_default();
    let client = &pass.ctx.client;
    let dp = DeleteParams::background();
    let pools = pass.ctx.pools_of(&ns, name).await?;
    if !pools.is_empty() {
        let api: Api<NodePool> = Api::namespaced(client.clone(), &ns);
        for p in pools
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            deleting(
                api.delete(&p.name_any(), &dp).await,
                "NodePool",
                &p.name_any(),
            );
        }
        let names: Vec<String> = pools.iter().map(|p| p.name_any()).collect();
        let message = format!(
            "waiting for NodePool(s) {} to drain and go",
            names.join(", ")
        );
        return Ok(Some(("DeletingNodePools", message)));
    }
    let clusters =
        Api::<DynamicObject>::namespaced_with(client.clone(), cp_ns, &cluster_resource());
    let cluster_left = match clusters.get_opt(name).await {
        Ok(c) => c.is_some_and(|c| made_for(&c.metadata, hc)),
        Err(kube::Error::Api(e)) if e.code == 404 => false,
        Err(e) => return Err(e.into()),
    };
    if cluster_left {
        deleting(clusters.delete(name, &dp).await, "Cluster", name);
        return Ok(Some((
            "DeletingCluster",
            format!("waiting for Cluster {cp_ns}/{name} to go"),
        )));
    }
    let ncps = pass.ncps();
    if ncps
        .get_opt(name)
        .await?
        .is_some_and(|n| made_for(&n.metadata, hc))
    {
        deleting(ncps.delete(name, &dp).await, "NestedControlPlane", name);
        return Ok(Some((
            "DeletingControlPlane",
            format!("waiting for NestedControlPlane {cp_ns}/{name} to stop and go"),
        )));
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    if let Some(n) = namespaces.get_opt(cp_ns).await?
        && made_for(&n.metadata, hc)
    {
        deleting(namespaces.delete(cp_ns, &dp).await, "namespace", cp_ns);
        return Ok(Some((
            "DeletingNamespace",
            format!("waiting for namespace {cp_ns} to go"),
        )));
    }
    Ok(None)
}

/// A teardown delete's outcome: gone or going is fine; a failure is logged, and the step
/// (still waiting for the object) deletes it again on the next pass.
fn deleting<T>(result: Result<T, kube::Error>, kind: &str, name: &str) {
    match result {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => tracing::warn!(%kind, %name, error = %e, "delete failed; next pass tries again"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn rotation_annotations_pass_to_the_control_plane_and_so_does_their_removal() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let meta = |pairs: &[(&str, &str)]| ObjectMeta {
            annotations: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        };
        let hc = meta(&[
            (names::ROTATE_SA_KEY_ANNOTATION, "r2"),
            (names::ROTATE_CA_COMPLETE_ANNOTATION, "c1"),
            ("unrelated", "x"),
        ]);
        let ncp = meta(&[
            (names::ROTATE_SA_KEY_ANNOTATION, "r1"),
            (names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION, "1h"),
        ]);
        let got = rotation_annotations(&hc, &ncp);
        assert_eq!(
            got,
            std::collections::BTreeMap::from([
                (
                    names::ROTATE_SA_KEY_ANNOTATION.to_string(),
                    Some("r2".to_string())
                ),
                (
                    names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION.to_string(),
                    None
                ),
                (
                    names::ROTATE_CA_COMPLETE_ANNOTATION.to_string(),
                    Some("c1".to_string())
                ),
            ])
        );
        // As a merge patch: the removal is a null.
        let patch = serde_json::json!({"metadata": {"annotations": got}});
        assert!(
            patch["metadata"]["annotations"][names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION]
                .is_null()
        );
        assert!(rotation_annotations(&hc, &hc).is_empty());
    }

    #[test]
    fn the_history_keeps_the_newest_version_reached_however_many_were_asked_for() {
        let now = Timestamp::now();
        let mut v = version_status(None, "v1.20.2", true, Some(1), now);
        for patch in 3..20 {
            v = version_status(Some(v), &format!("v1.20.{patch}"), false, Some(2), now);
        }
        assert_eq!(v.history.len(), 11);
        assert_eq!(v.history[0].version, "v1.20.19");
        let reached = v.history.iter().find(|h| h.state == "Completed").unwrap();
        assert_eq!(reached.version, "v1.20.2");
        // Once reached, the newest is the one.
        let v = version_status(Some(v), "v1.20.19", true, Some(3), now);
        assert_eq!(v.history[0].state, "Completed");
        let v = version_status(Some(v), "v1.20.20", false, Some(4), now);
        assert_eq!(v.history.len(), 10);
    }

    #[test]
    fn a_hosted_cluster_says_what_its_control_plane_says() {
        let mut status = HostedClusterStatus::default();
        let now = Timestamp::now();
        let ncp = NestedControlPlaneStatus {
            ready: true,
            version: Some("v1.20.2".into()),
            conditions: vec![
                conditions::new("EtcdReady", true, "AsExpected", ""),
                conditions::new("APIServerReady", false, "Starting", "waiting"),
            ],
            ..Default::default()
        };
        let reached = mirror(&mut status, &ncp, "v1.20.2", Some(3), now);
        assert!(reached);
        let get = |t: &str| conditions::get(&status.conditions, t).cloned().unwrap();
        assert_eq!(get(types::ETCD_AVAILABLE).status, "True");
        let api = get(types::KUBE_APISERVER_AVAILABLE);
        assert_eq!(
            (api.status.as_str(), api.reason.as_str()),
            ("False", "Starting")
        );
        assert_eq!(get(types::AVAILABLE).reason, "WaitingForControlPlane");
        assert_eq!(get(types::DEGRADED).status, "False");
        assert_eq!(get(types::PROGRESSING).message, "at v1.20.2");
        assert_eq!(status.observed_generation, Some(3));
        let history = &status.version.as_ref().unwrap().history;
        assert_eq!(history[0].state, "Completed");

        // Upgrading, and failing on the way.
        let failing = NestedControlPlaneStatus {
            failure_reason: Some("ControlPlaneFailed".into()),
            failure_message: Some("etcd lost quorum".into()),
            ..ncp
        };
        assert!(!mirror(&mut status, &failing, "v1.21.0", Some(4), now));
        let degraded = conditions::get(&status.conditions, types::DEGRADED).unwrap();
        assert_eq!(degraded.reason, "ControlPlaneFailed");
        let v = status.version.unwrap();
        assert_eq!(v.desired.version, "v1.21.0");
        assert_eq!(v.history[0].state, "Partial");
        assert_eq!(v.history[1].version, "v1.20.2");
    }

    #[test]
    fn progressing_tells_a_change_under_way_from_a_refused_or_held_one() {
        let now = Timestamp::now();
        let at = |upgrading: Option<Condition>| NestedControlPlaneStatus {
            ready: true,
            version: Some("v1.20.2".into()),
            conditions: upgrading.into_iter().collect(),
            ..Default::default()
        };
        let progressing = |status: &HostedClusterStatus| {
            let c = conditions::get(&status.conditions, types::PROGRESSING).unwrap();
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let mut status = HostedClusterStatus::default();
        let moving = conditions::new(
            "Upgrading",
            true,
            "Upgrading",
            "step 1 of 1 (v1.20.5): NestedEtcd v1.20.2 → v1.20.5",
        );
        mirror(&mut status, &at(Some(moving)), "v1.20.5", Some(1), now);
        assert_eq!(
            progressing(&status),
            (
                "True".into(),
                "Progressing".into(),
                "on the way to v1.20.5: step 1 of 1 (v1.20.5): NestedEtcd v1.20.2 → v1.20.5".into()
            )
        );
        let refused = conditions::new(
            "Upgrading",
            false,
            "MinorSkipRefused",
            "set a 1.21 version first",
        );
        mirror(&mut status, &at(Some(refused)), "v1.22.0", Some(2), now);
        assert_eq!(
            progressing(&status),
            (
                "False".into(),
                "MinorSkipRefused".into(),
                "set a 1.21 version first".into()
            )
        );
        let mut status = HostedClusterStatus::default();
        conditions::set(
            &mut status.conditions,
            conditions::new(
                types::CLUSTER_VERSION_UPGRADEABLE,
                false,
                "NodePoolVersionSkew",
                "NodePool old runs v1.20.2",
            ),
            Some(3),
            now,
        );
        mirror(&mut status, &at(None), "v1.23.0", Some(3), now);
        assert_eq!(
            progressing(&status),
            (
                "False".into(),
                "NodePoolVersionSkew".into(),
                "NodePool old runs v1.20.2".into()
            )
        );
    }
}
