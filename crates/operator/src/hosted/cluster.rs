//! The `HostedCluster` controller, in seed 002's order: finalizer → control-plane namespace
//! `<namespace>-<name>` → the control plane (a `NestedControlPlane`, HyperShift's
//! `HostedControlPlane`) → `ExternalInfraCluster` → a Cluster API `Cluster` referencing both
//! (where the kind is served) → the initial `NodePool`. Status bubbles up from the control
//! plane. Teardown: NodePools (drained) → Cluster → control plane → namespace → finalizer,
//! each step named in the `Deleting` condition; a step whose object is already gone is done.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::conditions;
use nestplane_api::hosted::{
    ClusterVersionStatus, DnsProvider, DnsStatus, ExternalInfraCluster, HostedCluster,
    HostedClusterStatus, NodePool, Release, SecretKeyRef, UpdateHistory, types,
};
use nestplane_api::names;

use super::plan;
use crate::context::{Context, Error};

/// The finalizer on a HostedCluster.
pub const FINALIZER: &str = "nestplane.io/hostedcluster";
/// `namespace/name` of the HostedCluster an object was made for (cross-namespace, so not an
/// owner reference).
pub const HOSTED_CLUSTER_ANNOTATION: &str = "nestplane.io/hosted-cluster";
/// The UID of the HostedCluster an object was made for: with [`HOSTED_CLUSTER_ANNOTATION`],
/// the claim a HostedCluster checks before it patches or deletes anything (see [`made_for`]).
pub const HOSTED_CLUSTER_UID_ANNOTATION: &str = "nestplane.io/hosted-cluster-uid";
/// The key of the admin kubeconfig copied into the HostedCluster's namespace.
pub const KUBECONFIG_KEY: &str = "kubeconfig";
/// How often a cluster that is not Available yet, or a teardown, is looked at again.
pub const PROGRESS_RECHECK: Duration = Duration::from_secs(3);

/// The namespace of a hosted cluster's control plane.
pub fn control_plane_namespace(hc: &HostedCluster) -> String {
    format!("{}-{}", hc.namespace().unwrap_or_default(), hc.name_any())
}

/// `namespace/name` of `hc`.
pub fn key(hc: &HostedCluster) -> String {
    format!("{}/{}", hc.namespace().unwrap_or_default(), hc.name_any())
}

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

fn annotated(hc: &HostedCluster) -> serde_json::Value {
    serde_json::json!({
        HOSTED_CLUSTER_ANNOTATION: key(hc),
        HOSTED_CLUSTER_UID_ANNOTATION: hc.uid().unwrap_or_default(),
    })
}

/// Whether the object of `meta` was made for this very HostedCluster (its namespace/name and
/// its UID, so neither a same-named one in another namespace whose control-plane namespace
/// collides, nor a deleted and recreated one, nor anyone else's object qualifies). A
/// HostedCluster never patches, deletes or finalizes anything else. Pure.
pub fn made_for(meta: &ObjectMeta, hc: &HostedCluster) -> bool {
    let a = meta.annotations.as_ref();
    let get = |k: &str| a.and_then(|a| a.get(k));
    // Objects made before the UID annotation existed carry the namespace/name only.
    get(HOSTED_CLUSTER_ANNOTATION) == Some(&key(hc))
        && hc.uid().is_some()
        && get(HOSTED_CLUSTER_UID_ANNOTATION).is_none_or(|u| Some(u) == hc.uid().as_ref())
}

/// Reconcile one HostedCluster.
pub async fn reconcile(hc: Arc<HostedCluster>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("HostedCluster");
    let ns = hc.namespace().unwrap_or_default();
    let api: Api<HostedCluster> = Api::namespaced(ctx.client.clone(), &ns);
    let mut status = hc.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    let generation = hc.metadata.generation;
    if hc.metadata.deletion_timestamp.is_some() {
        return teardown(&hc, &ctx, &api, status).await;
    }

    // Valid configuration, or nothing is touched.
    let networking = plan::networking(&hc.spec);
    let invalid = plan::validate(&hc.spec).err().or_else(|| {
        status
            .networking
            .as_ref()
            .filter(|recorded| **recorded != networking)
            .map(|recorded| {
                format!(
                    "networking is immutable: the control plane was created with clusterNetwork {} and serviceNetwork {}; set them back",
                    recorded.cluster_network.first().map(|e| e.cidr.as_str()).unwrap_or_default(),
                    recorded.service_network.first().map(|e| e.cidr.as_str()).unwrap_or_default()
                )
            })
    });
    let paused = plan::paused(hc.spec.paused_until.as_deref(), now);
    let invalid = invalid.or_else(|| paused.as_ref().err().cloned());
    if let Some(msg) = invalid {
        let before = conditions::get(&status.conditions, types::VALID_CONFIGURATION)
            .map(|c| (c.status.clone(), c.message.clone()));
        let set = |st: &mut HostedClusterStatus, c| {
            conditions::set(&mut st.conditions, c, generation, now)
        };
        set(
            &mut status,
            conditions::new(
                types::VALID_CONFIGURATION,
                false,
                "InvalidConfiguration",
                &msg,
            ),
        );
        set(
            &mut status,
            conditions::new(types::DEGRADED, true, "InvalidConfiguration", &msg),
        );
        if before
            != Some((
                "False".into(),
                conditions::cut(&msg, conditions::MAX_MESSAGE),
            ))
        {
            ctx.event(
                hc.object_ref(&()),
                EventType::Warning,
                "InvalidConfiguration",
                &msg,
            )
            .await;
        }
        write_status(&api, &hc, status).await?;
        return Ok(Action::await_change());
    }
    let set =
        |st: &mut HostedClusterStatus, c| conditions::set(&mut st.conditions, c, generation, now);
    set(
        &mut status,
        conditions::new(types::VALID_CONFIGURATION, true, "AsExpected", ""),
    );
    let cp_ns = control_plane_namespace(&hc);
    let name = hc.name_any();
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &cp_ns);

    // Claim before touching: a control-plane namespace (or control plane) that was not made
    // for this HostedCluster is refused before any finalizer, patch or delete.
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let existing_ns = namespaces.get_opt(&cp_ns).await?;
    let existing_ncp = match &existing_ns {
        Some(n) if made_for(&n.metadata, &hc) => ncps.get_opt(&name).await?,
        _ => None,
    };
    let taken = match (&existing_ns, &existing_ncp) {
        (Some(n), _) if !made_for(&n.metadata, &hc) => Some(format!(
            "namespace {cp_ns} exists and was not made for this HostedCluster; nothing is created, changed or deleted in it"
        )),
        (_, Some(ncp)) if !made_for(&ncp.metadata, &hc) => Some(format!(
            "NestedControlPlane {cp_ns}/{name} exists and was not made for this HostedCluster; it is left alone"
        )),
        _ => None,
    };
    if let Some(msg) = taken {
        set(
            &mut status,
            conditions::new(types::VALID_CONFIGURATION, false, "NamespaceTaken", &msg),
        );
        set(
            &mut status,
            conditions::new(types::DEGRADED, true, "NamespaceTaken", &msg),
        );
        let before = hc
            .status
            .as_ref()
            .and_then(|s| conditions::get(&s.conditions, types::VALID_CONFIGURATION))
            .map(|c| c.reason.clone());
        if before.as_deref() != Some("NamespaceTaken") {
            ctx.event(
                hc.object_ref(&()),
                EventType::Warning,
                "NamespaceTaken",
                &msg,
            )
            .await;
        }
        write_status(&api, &hc, status).await?;
        return Ok(Action::await_change());
    }

    // Paused: the control plane is paused too; nothing else changes.
    let paused = paused.unwrap_or_default();
    set(
        &mut status,
        match &paused {
            Some(until) => conditions::new(
                types::RECONCILIATION_ACTIVE,
                false,
                "ReconciliationPaused",
                match until {
                    Some(t) => format!("paused until {t}"),
                    None => "paused (pausedUntil: \"true\")".into(),
                },
            ),
            None => conditions::new(types::RECONCILIATION_ACTIVE, true, "AsExpected", ""),
        },
    );
    let pause_value = paused.as_ref().map(|_| "true");
    if let Some(ncp) = &existing_ncp
        && ncp
            .annotations()
            .get(names::PAUSED_ANNOTATION)
            .map(String::as_str)
            != pause_value
    {
        ncps.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {names::PAUSED_ANNOTATION: pause_value}}})),
        )
        .await?;
    }
    if let Some(until) = paused {
        write_status(&api, &hc, status).await?;
        return Ok(match until {
            Some(t) => Action::requeue(
                Duration::try_from(t.duration_since(now)).unwrap_or(Duration::from_secs(1)),
            ),
            None => Action::await_change(),
        });
    }

    // Finalizer.
    if !hc.finalizers().iter().any(|f| f == FINALIZER) {
        let mut list = hc.finalizers().to_vec();
        list.push(FINALIZER.into());
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": list, "resourceVersion": hc.resource_version()}})),
        )
        .await?;
    }

    // The control plane's namespace, claimed above.
    match existing_ns {
        Some(_) => {}
        None => {
            let n: Namespace = serde_json::from_value(serde_json::json!({
                "metadata": {"name": cp_ns, "annotations": annotated(&hc),
                             "labels": {names::MANAGED_BY_LABEL: names::MANAGED_BY}}
            }))
            .map_err(|e| Error::Internal(e.to_string()))?;
            create(&namespaces, &n).await?;
        }
    }

    // The control plane.
    let version = plan::version(&hc.spec.release.version);
    let ncp = match existing_ncp {
        Some(ncp) => {
            if ncp.spec.version.as_deref() != Some(version.as_str()) {
                ncps.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {"version": version}})),
                )
                .await?;
            }
            ncp
        }
        None => {
            let mut spec = serde_json::json!({
                "version": version,
                "clusterNetwork": {
                    "services": {"cidrBlocks": [networking.service_network[0].cidr]},
                    "pods": {"cidrBlocks": [networking.cluster_network[0].cidr]},
                },
            });
            if let Some(s) = hc.spec.services.iter().find(|s| s.service == "APIServer") {
                let apiserver = format!("{name}-apiserver");
                let obj: nestplane_api::NestedAPIServer = serde_json::from_value(serde_json::json!({
                    "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                    "kind": "NestedAPIServer",
                    "metadata": {"name": apiserver, "namespace": cp_ns, "annotations": annotated(&hc)},
                    "spec": {"serviceType": s.service_publishing_strategy.type_},
                }))
                .map_err(|e| Error::Internal(e.to_string()))?;
                create(&Api::namespaced(ctx.client.clone(), &cp_ns), &obj).await?;
                spec["apiserver"] = serde_json::json!({
                    "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                    "kind": "NestedAPIServer", "name": apiserver, "namespace": cp_ns,
                });
            }
            let obj: NestedControlPlane = serde_json::from_value(serde_json::json!({
                "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                "kind": "NestedControlPlane",
                "metadata": {"name": name, "namespace": cp_ns, "annotations": annotated(&hc),
                             "labels": {names::CLUSTER_NAME_LABEL: name}},
                "spec": spec,
            }))
            .map_err(|e| Error::Internal(e.to_string()))?;
            create(&ncps, &obj).await?;
            ctx.event(
                hc.object_ref(&()),
                EventType::Normal,
                "ControlPlaneCreated",
                &format!("NestedControlPlane {cp_ns}/{name}"),
            )
            .await;
            ncps.get(&name).await?
        }
    };
    status.networking = Some(networking.clone());
    // A service or pod network of the user's choosing is made unreachable on this machine
    // too (the defaults already are), so that the API server's calls to a Service address
    // never leave it.
    if ctx.node_settings.is_some() {
        use nestplane_nodes::net::{HANDED_OUT, holds, install_unreachable};
        let own: Vec<&str> = networking
            .service_network
            .iter()
            .chain(&networking.cluster_network)
            .map(|n| n.cidr.as_str())
            .filter(|c| !HANDED_OUT.iter().any(|h| holds(h, c)))
            .collect();
        if !own.is_empty() {
            match install_unreachable(&own) {
                Ok(skipped) => {
                    for s in skipped {
                        tracing::warn!(hostedcluster = %key(&hc), "{s}");
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot make the cluster's ranges unreachable")
                }
            }
        }
    }
    status.control_plane_namespace = Some(cp_ns.clone());
    let ncp_status = ncp.status.clone().unwrap_or_default();
    let ready = ncp_status.ready;

    // The infrastructure: nothing to provision; the endpoint mirrored once Ready.
    let eics: Api<ExternalInfraCluster> = Api::namespaced(ctx.client.clone(), &cp_ns);
    let eic = match eics.get_opt(&name).await? {
        Some(e) => e,
        None => {
            let obj: ExternalInfraCluster = serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "ExternalInfraCluster",
                "metadata": {"name": name, "namespace": cp_ns, "annotations": annotated(&hc)},
                "spec": {},
            }))
            .map_err(|e| Error::Internal(e.to_string()))?;
            create(&eics, &obj).await?;
            eics.get(&name).await?
        }
    };
    let endpoint = ncp
        .spec
        .control_plane_endpoint
        .clone()
        .filter(|e| !e.host.is_empty());
    if ready && endpoint.is_some() && eic.spec.control_plane_endpoint != endpoint {
        eics.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"controlPlaneEndpoint": endpoint}})),
        )
        .await?;
    }
    if eic.status.as_ref().map(|s| s.ready) != Some(ready) {
        eics.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"ready": ready}})),
        )
        .await?;
    }

    // A Cluster API Cluster referencing both, where the kind is served.
    let clusters =
        Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &cp_ns, &cluster_resource());
    match clusters.get_opt(&name).await {
        Ok(Some(_)) => {}
        Ok(None) => {
            let mut obj = DynamicObject::new(&name, &cluster_resource()).within(&cp_ns);
            obj.metadata.annotations = serde_json::from_value(annotated(&hc))
                .map_err(|e| Error::Internal(e.to_string()))?;
            obj.data = serde_json::json!({"spec": {
                "clusterNetwork": {
                    "services": {"cidrBlocks": [networking.service_network[0].cidr]},
                    "pods": {"cidrBlocks": [networking.cluster_network[0].cidr]},
                },
                "controlPlaneRef": {"apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1", "kind": "NestedControlPlane", "name": name, "namespace": cp_ns},
                "infrastructureRef": {"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "ExternalInfraCluster", "name": name, "namespace": cp_ns},
            }});
            match clusters.create(&PostParams::default(), &obj).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        // The kind is not served here.
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e.into()),
    }

    // The initial NodePool, once.
    if let Some(n) = hc.spec.initial_nodes.filter(|n| *n > 0)
        && !status.initial_node_pool_created
    {
        let pools: Api<NodePool> = Api::namespaced(ctx.client.clone(), &ns);
        let obj: NodePool = serde_json::from_value(serde_json::json!({
            "apiVersion": "nestplane.io/v1alpha1",
            "kind": "NodePool",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterName": name, "replicas": n, "management": {"upgradeType": "Replace"}},
        }))
        .map_err(|e| Error::Internal(e.to_string()))?;
        create(&pools, &obj).await?;
        status.initial_node_pool_created = true;
    }

    // The admin kubeconfig, copied where the HostedCluster's users can read it.
    let cp_secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &cp_ns);
    if let Some(value) = cp_secrets
        .get_opt(&names::SecretPurpose::AdminKubeconfig.secret_name(&name))
        .await?
        .and_then(|s| s.data)
        .and_then(|d| d.get(names::KUBECONFIG_KEY).cloned())
    {
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
        let copy = admin_kubeconfig(&hc);
        let current = secrets.get_opt(&copy).await?;
        if current
            .and_then(|s| s.data)
            .and_then(|d| d.get(KUBECONFIG_KEY).cloned())
            != Some(value.clone())
        {
            let mut owner = hc.controller_owner_ref(&()).unwrap_or_default();
            owner.block_owner_deletion = Some(true);
            let obj = serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": copy, "namespace": ns, "ownerReferences": [owner],
                             "labels": {names::MANAGED_BY_LABEL: names::MANAGED_BY}},
                "type": "Opaque",
                "data": {KUBECONFIG_KEY: value},
            });
            secrets
                .patch(
                    &copy,
                    &PatchParams::apply(crate::crds::FIELD_MANAGER).force(),
                    &Patch::Apply(obj),
                )
                .await?;
        }
        status.kubeconfig = Some(SecretKeyRef {
            name: copy,
            key: KUBECONFIG_KEY.into(),
        });
    }

    // Cluster DNS, kept in the cluster once its API serves.
    let provider = plan::dns_provider(
        &hc.spec,
        ctx.dns.default_provider,
        ctx.node_settings.is_some(),
    );
    let dns_available = keep_dns(
        &ctx,
        &hc,
        &mut status,
        ready,
        provider,
        &networking,
        &version,
    )
    .await;

    // Status from the control plane.
    status.control_plane_endpoint = endpoint;
    let from = |t: &str| conditions::get(&ncp_status.conditions, t).cloned();
    let mirror =
        |st: &mut HostedClusterStatus,
         ty: &str,
         src: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>| {
            let c = match src {
                Some(c) => conditions::new(ty, c.status == "True", &c.reason, &c.message),
                None => conditions::new(
                    ty,
                    false,
                    "WaitingForControlPlane",
                    "the control plane reports nothing yet",
                ),
            };
            conditions::set(&mut st.conditions, c, generation, now);
        };
    mirror(&mut status, types::ETCD_AVAILABLE, from("EtcdReady"));
    mirror(
        &mut status,
        types::KUBE_APISERVER_AVAILABLE,
        from("APIServerReady"),
    );
    let available = from("Available");
    mirror(&mut status, types::AVAILABLE, available.clone());
    let failing = ncp_status.failure_reason.is_some();
    set(
        &mut status,
        if failing {
            conditions::new(
                types::DEGRADED,
                true,
                ncp_status.failure_reason.as_deref().unwrap_or("Failed"),
                ncp_status.failure_message.clone().unwrap_or_default(),
            )
        } else {
            conditions::new(types::DEGRADED, false, "AsExpected", "")
        },
    );
    let reached = ncp_status.version.as_deref() == Some(version.as_str()) && ready;
    set(
        &mut status,
        if reached {
            conditions::new(
                types::PROGRESSING,
                false,
                "AsExpected",
                format!("at {version}"),
            )
        } else {
            conditions::new(
                types::PROGRESSING,
                true,
                "Progressing",
                format!("on the way to {version}"),
            )
        },
    );
    status.version = Some(version_status(
        status.version.take(),
        &version,
        reached,
        generation,
        now,
    ));
    status.observed_generation = generation;
    let was_available = hc
        .status
        .as_ref()
        .is_some_and(|s| conditions::is_true(&s.conditions, types::AVAILABLE));
    if ready && !was_available {
        ctx.event(
            hc.object_ref(&()),
            EventType::Normal,
            "Available",
            "the hosted control plane is available",
        )
        .await;
    }
    write_status(&api, &hc, status).await?;
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
    ctx: &Context,
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
        let Some(t) = super::pool::target(ctx, hc)
            .await
            .map_err(|e| e.to_string())?
        else {
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
        v.history.truncate(10);
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

async fn write_status(
    api: &Api<HostedCluster>,
    hc: &HostedCluster,
    status: HostedClusterStatus,
) -> Result<(), Error> {
    if hc.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    api.patch_status(
        &hc.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": body })),
    )
    .await?;
    Ok(())
}

/// Deletion, in order; each step is visible as the `Deleting` condition's reason, and a step
/// whose object is already gone is done.
async fn teardown(
    hc: &HostedCluster,
    ctx: &Context,
    api: &Api<HostedCluster>,
    mut status: HostedClusterStatus,
) -> Result<Action, Error> {
    if !hc.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let ns = hc.namespace().unwrap_or_default();
    let name = hc.name_any();
    let cp_ns = control_plane_namespace(hc);
    let now = Timestamp::now();
    let mut step = |reason: &str, message: String| {
        let previous =
            conditions::get(&status.conditions, types::DELETING).map(|c| c.reason.clone());
        conditions::set(
            &mut status.conditions,
            conditions::new(types::DELETING, true, reason, message),
            hc.metadata.generation,
            now,
        );
        previous.as_deref() != Some(reason)
    };
    let dp = DeleteParams::background();

    // 1. NodePools (their controller drains and removes the nodes).
    let pools: Api<NodePool> = Api::namespaced(ctx.client.clone(), &ns);
    let mine: Vec<NodePool> = pools
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| p.spec.cluster_name == name)
        .collect();
    if !mine.is_empty() {
        for p in mine
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            let _ = pools.delete(&p.name_any(), &dp).await;
        }
        let names: Vec<String> = mine.iter().map(|p| p.name_any()).collect();
        if step(
            "DeletingNodePools",
            format!(
                "waiting for NodePool(s) {} to drain and go",
                names.join(", ")
            ),
        ) {
            ctx.event(
                hc.object_ref(&()),
                EventType::Normal,
                "DeletingNodePools",
                &names.join(", "),
            )
            .await;
        }
        write_status(api, hc, status).await?;
        return Ok(Action::requeue(PROGRESS_RECHECK));
    }

    // 2. The Cluster (where served), 3. the control plane, 4. the namespace.
    let clusters =
        Api::<DynamicObject>::namespaced_with(ctx.client.clone(), &cp_ns, &cluster_resource());
    // Only what was made for this HostedCluster: anything else is someone else's.
    let cluster_left = match clusters.get_opt(&name).await {
        Ok(c) => c.is_some_and(|c| made_for(&c.metadata, hc)),
        Err(kube::Error::Api(e)) if e.code == 404 => false,
        Err(e) => return Err(e.into()),
    };
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &cp_ns);
    let namespaces: Api<Namespace> = Api::all(ctx.client.clone());
    let ncp_left = ncps
        .get_opt(&name)
        .await?
        .is_some_and(|n| made_for(&n.metadata, hc));
    let waiting: Option<(&str, String)> = if cluster_left {
        let _ = clusters.delete(&name, &dp).await;
        Some((
            "DeletingCluster",
            format!("waiting for Cluster {cp_ns}/{name} to go"),
        ))
    } else if ncp_left {
        let _ = ncps.delete(&name, &dp).await;
        Some((
            "DeletingControlPlane",
            format!("waiting for NestedControlPlane {cp_ns}/{name} to stop and go"),
        ))
    } else if let Some(n) = namespaces.get_opt(&cp_ns).await?
        && made_for(&n.metadata, hc)
    {
        let _ = namespaces.delete(&cp_ns, &dp).await;
        Some((
            "DeletingNamespace",
            format!("waiting for namespace {cp_ns} to go"),
        ))
    } else {
        None
    };
    if let Some((reason, message)) = waiting {
        if step(reason, message.clone()) {
            ctx.event(hc.object_ref(&()), EventType::Normal, reason, &message)
                .await;
        }
        write_status(api, hc, status).await?;
        return Ok(Action::requeue(PROGRESS_RECHECK));
    }

    // 5. The finalizer.
    let list: Vec<String> = hc
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    api.patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": list, "resourceVersion": hc.resource_version()}})),
    )
    .await?;
    tracing::info!(namespace = %ns, hostedcluster = %name, "hosted cluster removed");
    Ok(Action::await_change())
}
