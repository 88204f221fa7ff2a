//! The `ClusterAPI` platform of a NodePool: its nodes are machines Cluster API makes. The pool
//! owns a `MachineDeployment` of the hosted cluster's Cluster (in the control-plane
//! namespace, where that Cluster is) with the pool's replicas, version and rollout settings,
//! the user's infrastructure machine template, and a `NestplaneConfigTemplate` made from what
//! the pool says about its nodes ([`config_template`]): a change of those makes a new
//! template (its name carries their hash), so the MachineDeployment rolls its machines as
//! Cluster API rolls any template change. Each machine joins through its `NestplaneConfig`
//! ([`crate::bootstrap`]).

use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use nestplane_api::bootstrap::{NestplaneConfigSpec, NestplaneConfigTemplate};
use nestplane_api::conditions;
use nestplane_api::hosted::{ClusterApiPlatform, HostedCluster, NodeInfo, NodePool, types};
use nestplane_api::names;
use nestplane_nodes::config::{ClusterSettings, NodeSpec};
use sha2::{Digest, Sha256};
use std::time::Duration;

use super::{Halt, Pass, plan};
use crate::context::Error;
use crate::hosted::claim;

const MANAGER: &str = "nestplane-nodepool";
/// How often a pool whose machines are not all ready is looked at.
const ROLLING: Duration = Duration::from_secs(10);
/// How often one whose machines are is.
const STEADY: Duration = Duration::from_secs(60);

fn machine_deployments() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, "v1beta2", "MachineDeployment"),
        "machinedeployments",
    )
}

/// The bootstrap config every machine of the pool is made from: the pool's labels (with
/// [`plan::POOL_LABEL`]), taints, `maxPods` and pod security, and the cluster's DNS. Its name
/// is the pool's and a hash of the spec. Pure.
pub fn config_template(
    pool: &str,
    spec: &NodeSpec,
    cluster: &ClusterSettings,
) -> (String, NestplaneConfigSpec) {
    let config = NestplaneConfigSpec {
        node_labels: spec.labels.clone(),
        node_taints: spec.taints.clone(),
        cluster_dns: cluster.cluster_dns.clone(),
        cluster_domain: Some(cluster.cluster_domain.clone()).filter(|d| !d.is_empty()),
        max_pods: spec.max_pods.map(|m| m as i32),
        pod_security: Some(spec.pod_security.name().to_string()),
        token_ttl_seconds: None,
    };
    let bytes = serde_json::to_vec(&config).unwrap_or_default();
    let hash = format!("{:x}", Sha256::digest(&bytes));
    (format!("{pool}-{}", &hash[..10]), config)
}

/// The pool's MachineDeployment (`cluster.x-k8s.io/v1beta2`), named after the pool, in the
/// Cluster `cluster`'s namespace. Pure.
pub fn machine_deployment(
    pool: &NodePool,
    cluster: &str,
    version: &str,
    template: &str,
    platform: &ClusterApiPlatform,
) -> serde_json::Value {
    let name = pool.name_any();
    let selector = serde_json::json!({ "cluster.x-k8s.io/deployment-name": name });
    let rolling = pool
        .spec
        .management
        .replace
        .as_ref()
        .and_then(|r| r.rolling_update.as_ref());
    let max_surge = rolling.and_then(|r| r.max_surge).unwrap_or(1).max(0);
    let max_unavailable = rolling.and_then(|r| r.max_unavailable).unwrap_or(0).max(0);
    let infra = &platform.infrastructure_ref;
    serde_json::json!({
        "clusterName": cluster,
        "replicas": pool.spec.replicas.unwrap_or(0).max(0),
        "selector": { "matchLabels": selector },
        "rollout": { "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": { "maxSurge": max_surge, "maxUnavailable": max_unavailable },
        }},
        "template": {
            "metadata": { "labels": selector },
            "spec": {
                "clusterName": cluster,
                "version": version,
                "bootstrap": { "configRef": {
                    "apiGroup": nestplane_api::bootstrap::GROUP,
                    "kind": "NestplaneConfigTemplate",
                    "name": template,
                }},
                "infrastructureRef": {
                    "apiGroup": infra.api_group,
                    "kind": infra.kind,
                    "name": infra.name,
                },
                "deletion": { "nodeDrainTimeoutSeconds": plan::drain_timeout(pool).as_secs() },
            },
        },
    })
}

fn labels(pool: &str, cluster: &str) -> std::collections::BTreeMap<String, String> {
    [
        (plan::POOL_LABEL.to_string(), pool.to_string()),
        (names::CLUSTER_NAME_LABEL.to_string(), cluster.to_string()),
        (
            names::MANAGED_BY_LABEL.to_string(),
            names::MANAGED_BY.to_string(),
        ),
    ]
    .into()
}

/// Keep the pool's template and MachineDeployment as it says, and report what Cluster API
/// and the hosted cluster show.
pub(super) async fn converge(
    mut pass: Pass<'_>,
    hc: &HostedCluster,
    platform: &ClusterApiPlatform,
    version: &str,
    spec: &NodeSpec,
    cluster_settings: &ClusterSettings,
    tenant: Option<&kube::Client>,
) -> Result<Action, Error> {
    let pool = pass.pool;
    let name = pool.name_any();
    let cp_ns = claim::control_plane_namespace(hc);
    let cluster = hc.name_any();
    let client = pass.ctx.client.clone();
    let mds: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &cp_ns, &machine_deployments());
    let existing = match mds.get_opt(&name).await {
        Ok(e) => e,
        Err(kube::Error::Api(e)) if e.code == 404 => {
            return pass
                .stop(
                    Halt::warn(
                        "ClusterAPINotInstalled",
                        "platform ClusterAPI: Cluster API's MachineDeployment (cluster.x-k8s.io/v1beta2) is not served here; install Cluster API (clusterctl init)".into(),
                    )
                    .again(Duration::from_secs(60)),
                )
                .await;
        }
        Err(e) => return Err(e.into()),
    };
    if let Some(md) = &existing
        && !claim::made_for(&md.metadata, hc)
    {
        let why = format!(
            "MachineDeployment {cp_ns}/{name} exists and was not made for this pool; nothing is changed in it"
        );
        return pass
            .stop(Halt::warn("MachineDeploymentNotOurs", why).again(Duration::from_secs(60)))
            .await;
    }
    let (template, config) = config_template(&name, spec, cluster_settings);
    let templates: Api<NestplaneConfigTemplate> = Api::namespaced(client.clone(), &cp_ns);
    let mut t = NestplaneConfigTemplate::new(
        &template,
        nestplane_api::bootstrap::NestplaneConfigTemplateSpec {
            template: nestplane_api::bootstrap::NestplaneConfigTemplateResource { spec: config },
        },
    );
    t.metadata.namespace = Some(cp_ns.clone());
    t.metadata.labels = Some(labels(&name, &cluster));
    t.metadata.annotations = Some(claim::annotations(hc));
    let pp = PatchParams::apply(MANAGER).force();
    let mut body = serde_json::to_value(&t).map_err(|e| Error::Internal(e.to_string()))?;
    body["apiVersion"] = NestplaneConfigTemplate::api_version(&()).to_string().into();
    body["kind"] = "NestplaneConfigTemplate".into();
    templates.patch(&template, &pp, &Patch::Apply(body)).await?;

    let before = existing
        .as_ref()
        .and_then(|m| m.data["spec"]["template"]["spec"]["bootstrap"]["configRef"]["name"].as_str())
        .map(str::to_string);
    let md = serde_json::json!({
        "apiVersion": format!("{}/v1beta2", names::CLUSTER_API_GROUP),
        "kind": "MachineDeployment",
        "metadata": {
            "name": name,
            "namespace": cp_ns,
            "labels": labels(&name, &cluster),
            "annotations": claim::annotations(hc),
        },
        "spec": machine_deployment(pool, &cluster, version, &template, platform),
    });
    let applied = mds.patch(&name, &pp, &Patch::Apply(md)).await?;
    if before.as_deref() != Some(template.as_str()) {
        let (reason, note) = match &before {
            None => (
                "MachineDeploymentCreated",
                format!(
                    "MachineDeployment {cp_ns}/{name} made (machines join with NestplaneConfigTemplate {template})"
                ),
            ),
            Some(old) => (
                "RollingMachines",
                format!(
                    "the pool's node settings changed: MachineDeployment {cp_ns}/{name} rolls from NestplaneConfigTemplate {old} to {template}"
                ),
            ),
        };
        // Each template its own series: every rollout is seen.
        pass.ctx
            .event_as(
                pool.object_ref(&()),
                kube::runtime::events::EventType::Normal,
                reason,
                &template,
                &note,
            )
            .await;
    }
    remove_old_templates(&templates, hc, &name, &template, KEPT_TEMPLATES).await;

    // What Cluster API and the hosted cluster show.
    let status = &applied.data["status"];
    let count = |k: &str| status[k].as_i64().unwrap_or(0) as i32;
    let desired = pool.spec.replicas.unwrap_or(0).max(0);
    let nodes: Vec<KubeNode> = match tenant {
        Some(c) => Api::<KubeNode>::all(c.clone())
            .list(&ListParams::default().labels(&format!("{}={name}", plan::POOL_LABEL)))
            .await
            .map(|l| l.items)
            .unwrap_or_default(),
        None => vec![],
    };
    let infos: Vec<NodeInfo> = nodes
        .iter()
        .map(|n| NodeInfo {
            name: n.name_any(),
            version: n
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .map(|i| i.kubelet_version.clone())
                .unwrap_or_default(),
            ready: n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
            current: n
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .is_some_and(|i| i.kubelet_version == version),
        })
        .collect();
    let ready = infos.iter().filter(|i| i.ready).count() as i32;
    pass.status.replicas = ready;
    pass.status.nodes = infos;
    pass.status.observed_generation = pool.metadata.generation;
    let done = ready >= desired && count("upToDateReplicas") >= desired;
    if done {
        pass.status.version = Some(version.to_string());
    }
    let message = format!(
        "MachineDeployment {cp_ns}/{name}: {desired} asked, {} machines, {} up to date (template {template}); {ready} nodes Ready in the cluster",
        count("replicas"),
        count("upToDateReplicas"),
    );
    pass.set(conditions::new(
        types::READY,
        done,
        if done {
            "AsExpected"
        } else {
            "WaitingForMachines"
        },
        message,
    ));
    pass.write().await?;
    Ok(Action::requeue(if done { STEADY } else { ROLLING }))
}

/// Templates of the pool kept besides the current one: the newest ones it replaced (a
/// rollout in progress, or a MachineSet of an earlier revision scaled up again, still makes
/// machines from them; a machine's own config is a copy, made when the machine is).
pub const KEPT_TEMPLATES: usize = 2;

/// Templates of the pool other than `current` and the [`KEPT_TEMPLATES`] newest others go
/// (`keep` 0: all but `current`).
async fn remove_old_templates(
    templates: &Api<NestplaneConfigTemplate>,
    hc: &HostedCluster,
    pool: &str,
    current: &str,
    keep: usize,
) {
    let list = match templates
        .list(&ListParams::default().labels(&format!("{}={pool}", plan::POOL_LABEL)))
        .await
    {
        Ok(l) => l,
        Err(e) => {
            // Old templates stay until a pass can list them (a refusal here is the role's).
            tracing::warn!(%pool, error = %e, "listing the pool's NestplaneConfigTemplates failed");
            return;
        }
    };
    let mut old: Vec<_> = list
        .items
        .into_iter()
        .filter(|t| t.name_any() != current && claim::made_for(&t.metadata, hc))
        .collect();
    // Newest first.
    old.sort_by_key(|t| std::cmp::Reverse(t.metadata.creation_timestamp.clone().map(|t| t.0)));
    for t in old.into_iter().skip(keep) {
        let n = t.name_any();
        if let Err(e) = templates.delete(&n, &DeleteParams::default()).await {
            tracing::debug!(template = %n, error = %e, "an old NestplaneConfigTemplate stays for now");
        }
    }
}

/// The pool is being deleted: its MachineDeployment goes (Cluster API drains and deletes its
/// machines), then its templates. `None` once both are gone, else what it waits for.
pub(super) async fn teardown(
    client: &kube::Client,
    pool: &NodePool,
    hc: &HostedCluster,
) -> Result<Option<String>, Error> {
    let name = pool.name_any();
    let cp_ns = claim::control_plane_namespace(hc);
    let mds: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &cp_ns, &machine_deployments());
    match mds.get_opt(&name).await {
        Ok(Some(md)) if claim::made_for(&md.metadata, hc) => {
            if md.metadata.deletion_timestamp.is_none() {
                mds.delete(&name, &DeleteParams::foreground()).await?;
            }
            let machines = md.data["status"]["replicas"].as_i64().unwrap_or(0);
            return Ok(Some(format!(
                "waiting for Cluster API to delete MachineDeployment {cp_ns}/{name} ({machines} machines left; they are drained and deleted first)"
            )));
        }
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    let templates: Api<NestplaneConfigTemplate> = Api::namespaced(client.clone(), &cp_ns);
    remove_old_templates(&templates, hc, &name, "", 0).await;
    Ok(None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use nestplane_api::hosted::{ContractReference, NodePoolSpec, RollingUpdate};

    fn spec(labels: &[(&str, &str)]) -> NodeSpec {
        NodeSpec {
            version: "v1.20.2".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_change_of_node_settings_is_a_new_template_and_a_version_is_not() {
        let cluster = ClusterSettings {
            cluster_dns: vec!["10.96.0.10".into()],
            cluster_domain: "cluster.local".into(),
            ..Default::default()
        };
        let (a, config) = config_template("edge", &spec(&[("tier", "a")]), &cluster);
        assert!(
            a.starts_with("edge-") && a.len() == "edge-".len() + 10,
            "{a}"
        );
        assert_eq!(config.node_labels["tier"], "a");
        assert_eq!(config.cluster_dns, ["10.96.0.10"]);
        assert_eq!(config.pod_security.as_deref(), Some("Baseline"));
        let (same, _) = config_template("edge", &spec(&[("tier", "a")]), &cluster);
        assert_eq!(a, same);
        let (b, _) = config_template("edge", &spec(&[("tier", "b")]), &cluster);
        assert_ne!(a, b);
        let mut newer = spec(&[("tier", "a")]);
        newer.version = "v1.21.0".into();
        assert_eq!(
            config_template("edge", &newer, &cluster).0,
            a,
            "the version is the Machine's, not the template's"
        );
    }

    #[test]
    fn the_machine_deployment_carries_replicas_version_rollout_and_both_templates() {
        let mut pool = NodePool::new(
            "edge",
            NodePoolSpec {
                cluster_name: "hc".into(),
                replicas: Some(3),
                node_drain_timeout: Some("90s".into()),
                ..Default::default()
            },
        );
        pool.spec.management.replace = Some(nestplane_api::hosted::ReplaceSpec {
            strategy: Some("RollingUpdate".into()),
            rolling_update: Some(RollingUpdate {
                max_surge: Some(2),
                max_unavailable: Some(1),
            }),
        });
        let platform = ClusterApiPlatform {
            infrastructure_ref: ContractReference {
                api_group: "infrastructure.cluster.x-k8s.io".into(),
                kind: "KubevirtMachineTemplate".into(),
                name: "small".into(),
            },
        };
        let md = machine_deployment(&pool, "hc", "v1.20.2", "edge-0123456789", &platform);
        assert_eq!(md["clusterName"], "hc");
        assert_eq!(md["replicas"], 3);
        assert_eq!(
            md["selector"]["matchLabels"],
            md["template"]["metadata"]["labels"]
        );
        assert_eq!(md["rollout"]["strategy"]["rollingUpdate"]["maxSurge"], 2);
        assert_eq!(
            md["rollout"]["strategy"]["rollingUpdate"]["maxUnavailable"],
            1
        );
        let t = &md["template"]["spec"];
        assert_eq!(t["version"], "v1.20.2");
        assert_eq!(
            t["bootstrap"]["configRef"]["kind"],
            "NestplaneConfigTemplate"
        );
        assert_eq!(t["bootstrap"]["configRef"]["name"], "edge-0123456789");
        assert_eq!(t["infrastructureRef"]["kind"], "KubevirtMachineTemplate");
        assert_eq!(t["deletion"]["nodeDrainTimeoutSeconds"], 90);
    }
}
