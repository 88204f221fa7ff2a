//! The `kubernetes` runtime: a component becomes a StatefulSet (etcd) or a Deployment plus
//! Services in the control plane's namespace, built from the same rendering the process
//! runtime runs, patched by the component's `spec.patches`, applied server-side, and Ready
//! when the workload reports every replica updated and ready.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeClaim, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use nestplane_api::names::{self, Component, ports};
use nestplane_api::{ApiEndpoint, NestedControlPlane, NestedEtcdAddress};
use nestplane_render::{KubeVersion, Network, RenderInput, SECRETS_CHECKSUM_ANNOTATION, policy};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::applied::Applied;
use crate::error::Error;
use crate::runtime::{Observation, Pass, Runtime};
use crate::tenant::{ComponentKind, Lookup, Tenant};

/// Settings of the `kubernetes` runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesSettings {
    /// Registry the component images come from.
    pub image_registry: String,
    /// Size of each etcd member's volume.
    pub etcd_storage: String,
    /// The image of the API server's egress proxy (the operator's own image, which holds
    /// `nestplane egress-proxy`).
    pub egress_image: String,
}

/// The operator's image as the install manifests name it.
pub const DEFAULT_EGRESS_IMAGE: &str = "nestplane:latest";

impl Default for KubernetesSettings {
    fn default() -> Self {
        KubernetesSettings {
            image_registry: nestplane_render::DEFAULT_IMAGE_REGISTRY.into(),
            etcd_storage: nestplane_render::workload::DEFAULT_ETCD_STORAGE.into(),
            egress_image: DEFAULT_EGRESS_IMAGE.into(),
        }
    }
}

/// The render input of a tenant on the Cluster network.
pub fn render_input(
    t: &Tenant,
    version: KubeVersion,
    settings: &KubernetesSettings,
) -> RenderInput {
    let mut input = t.render_input(version, Network::Cluster);
    input.image_registry = settings.image_registry.clone();
    input.apiserver_service_type = t
        .apiserver
        .found()
        .and_then(|a| a.spec.service_type)
        .unwrap_or_default()
        .as_str()
        .into();
    input
}

fn owner_of(t: &Tenant, c: Component) -> Option<OwnerReference> {
    fn o<K: ComponentKind>(l: &Lookup<K>) -> Option<OwnerReference> {
        l.found().and_then(|k| k.controller_owner_ref(&()))
    }
    match c {
        Component::Etcd => o(&t.etcd),
        Component::ApiServer => o(&t.apiserver),
        Component::ControllerManager => o(&t.controller_manager),
        Component::Scheduler => o(&t.scheduler),
    }
}

/// Where the control plane is reached, as its API server Service says: a LoadBalancer's
/// ingress address once it has one, otherwise the cluster IP; the port is 6443 (a NodePort
/// Service's node port is reported on the Service, the node addresses are the platform's).
pub fn service_endpoint(svc: &Service) -> Option<ApiEndpoint> {
    let spec = svc.spec.as_ref()?;
    let lb = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .and_then(|i| i.first())
        .and_then(|i| i.ip.clone().or_else(|| i.hostname.clone()));
    let host = match spec.type_.as_deref() {
        Some("LoadBalancer") => lb,
        _ => spec.cluster_ip.clone().filter(|ip| ip != "None"),
    }?;
    Some(ApiEndpoint {
        host,
        port: ports::APISERVER,
    })
}

/// Every address the API server Service is reached at (for the serving certificate).
fn service_addresses(svc: &Service) -> Vec<String> {
    let mut out: Vec<String> = service_endpoint(svc).map(|e| e.host).into_iter().collect();
    if let Some(ip) = svc.spec.as_ref().and_then(|s| s.cluster_ip.clone())
        && ip != "None"
        && !out.contains(&ip)
    {
        out.push(ip);
    }
    out
}

/// SHA-256 over the mounted secrets' names, keys and values: a certificate change rolls
/// the pods.
fn checksum(data: &nestplane_runtime::process::SecretData) -> String {
    let mut h = Sha256::new();
    for (name, keys) in data {
        h.update(name.as_bytes());
        // `signer.crt` is derived from `tls.crt`, which is hashed: it adds nothing (and an
        // operator that began to write it restarts no workload for it).
        for (k, v) in keys.iter().filter(|(k, _)| *k != names::SIGNER_CRT) {
            h.update(b"\0");
            h.update(k.as_bytes());
            h.update(b"\0");
            h.update(v);
        }
        h.update(b"\n");
    }
    format!("{:x}", h.finalize())
}

/// Rolled out: the controller has seen the newest spec and every replica is updated and
/// ready. Returns (ready replicas, rolled out).
fn rollout(workload: &Value, desired: u32) -> (i32, bool) {
    let int = |p: &str| workload.pointer(p).and_then(Value::as_i64).unwrap_or(0);
    let generation = int("/metadata/generation");
    let observed = int("/status/observedGeneration");
    let ready = int("/status/readyReplicas");
    let updated = int("/status/updatedReplicas");
    let replicas = int("/status/replicas");
    let d = i64::from(desired);
    let done = observed >= generation && ready >= d && updated >= d && replicas <= d;
    (ready as i32, done)
}

/// Components as workloads in the management cluster.
pub struct Workloads {
    settings: KubernetesSettings,
    applied: Arc<Applied>,
}

impl Workloads {
    /// Workloads with these settings, applied through `applied` (which the operator fills
    /// with its watch caches).
    pub fn new(settings: KubernetesSettings, applied: Arc<Applied>) -> Self {
        Workloads { settings, applied }
    }
}

impl Runtime for Workloads {
    fn patch_policy(&self) -> policy::Runtime {
        policy::Runtime::Kubernetes
    }

    fn check_input(&self, t: &Tenant, version: KubeVersion) -> RenderInput {
        render_input(t, version, &self.settings)
    }

    fn readiness_is_watched(&self) -> bool {
        // The workloads are owned: every rollout change reconciles the component.
        true
    }

    fn can_run(&self, _c: Component, _version: &KubeVersion) -> Result<(), Error> {
        // Images are the platform's business: a missing one shows in the rollout.
        Ok(())
    }

    fn run<'a>(&'a self, pass: Pass<'a>) -> BoxFuture<'a, Result<Observation, Error>> {
        run(pass, &self.settings, &self.applied).boxed()
    }

    fn endpoint<'a>(
        &'a self,
        client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<Option<ApiEndpoint>, Error>> {
        async move {
            // The endpoint follows the API server's Service once it exists (read from the
            // watch cache; a GET only where there is none).
            let ns = ncp.namespace().unwrap_or_default();
            let name = Component::ApiServer.workload_name(&crate::tenant::cluster_name(ncp));
            let svc = match self.applied.services.get() {
                Some(_) => self.applied.service(&ns, &name),
                None => {
                    Api::<Service>::namespaced(client.clone(), &ns)
                        .get_opt(&name)
                        .await?
                }
            };
            Ok(svc.as_ref().and_then(service_endpoint))
        }
        .boxed()
    }

    fn remove<'a>(
        &'a self,
        client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            // etcd's volumes outlive its StatefulSet (Kubernetes keeps claims of deleted
            // StatefulSets); they are this tenant's data and go with it. Workloads and
            // Services go by garbage collection (owner chain).
            let ns = ncp.namespace().unwrap_or_default();
            self.applied
                .forget(&ns, &format!("{}-", crate::tenant::cluster_name(ncp)));
            let selector = format!(
                "{}={},{}={}",
                names::CLUSTER_NAME_LABEL,
                crate::tenant::cluster_name(ncp),
                names::MANAGED_BY_LABEL,
                names::MANAGED_BY
            );
            let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
            for pvc in claims
                .list(&ListParams::default().labels(&selector))
                .await?
                .items
            {
                claims
                    .delete(&pvc.name_any(), &DeleteParams::default())
                    .await?;
            }
            Ok(())
        }
        .boxed()
    }
}

/// One pass of a component in the `kubernetes` runtime.
async fn run(
    pass: Pass<'_>,
    settings: &KubernetesSettings,
    applied: &Applied,
) -> Result<Observation, Error> {
    let Pass {
        client,
        tenant: t,
        component: c,
        version,
        patches,
        ..
    } = pass;
    let ns = t.namespace();
    let input = render_input(t, version, settings);
    let mut rendered = nestplane_render::render(c, &input)?;
    if t.held(c) {
        rendered.replicas = 0;
    }
    if c == Component::ApiServer {
        // Its cluster's traffic goes through the nodes' agents: this pod's own network is
        // the management cluster's.
        nestplane_render::egress::apply_kubernetes(
            &mut rendered,
            &settings.egress_image,
            &input.service_cidr,
        );
    }
    let mut objects = nestplane_render::objects(&rendered, &input, "", &settings.etcd_storage);
    policy::apply_checked(objects.all_mut(), patches, policy::Runtime::Kubernetes)?;
    let Some(owner) = owner_of(t, c) else {
        // The component object was created a moment ago and is not in the watch cache yet:
        // nothing to own the workload yet; its own event brings the next pass.
        return Ok(Observation {
            desired: rendered.replicas,
            healthy: 0,
            ok: false,
            counting: "the component object is not in the cache yet".into(),
            addresses: Vec::new(),
            service: None,
            credentials: Default::default(),
        });
    };
    for o in objects.all_mut() {
        o["metadata"]["ownerReferences"] = json!([owner]);
    }

    // Services first: the API server's address goes into its certificate.
    let mut applied_services = Vec::new();
    for s in &objects.services {
        let svc: Service = serde_json::from_value(applied.apply(client, &ns, s).await?)
            .map_err(|e| Error::Internal(e.to_string()))?;
        applied_services.push(svc);
    }
    let api_service = applied_services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some(&rendered.workload_name));
    let hosts = api_service.map(service_addresses).unwrap_or_default();
    let (secrets, _) = pass.issue(&input, &hosts, None).await?;
    let data = secrets.data(&rendered.secrets).await?;
    let credentials = secrets.credentials(&data);
    let annotations = &mut objects.workload["spec"]["template"]["metadata"]["annotations"];
    if !annotations.is_object() {
        *annotations = json!({});
    }
    annotations[SECRETS_CHECKSUM_ANNOTATION] = json!(checksum(&data));

    let desired = objects
        .workload
        .pointer("/spec/replicas")
        .and_then(Value::as_u64)
        .unwrap_or(u64::from(rendered.replicas)) as u32;
    let workload = applied.apply(client, &ns, &objects.workload).await?;
    let (ready_replicas, ok) = rollout(&workload, desired);
    let kind = workload
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or(if c == Component::Etcd {
            "StatefulSet"
        } else {
            "Deployment"
        })
        .to_string();

    let addresses = if c == Component::Etcd {
        (0..desired)
            .map(|i| NestedEtcdAddress {
                ip: None,
                hostname: Some(format!(
                    "{}-{i}.{}.{ns}.svc",
                    rendered.workload_name,
                    nestplane_render::etcd_peer_service_name(&input.cluster)
                )),
                port: ports::ETCD_CLIENT,
            })
            .collect()
    } else {
        vec![]
    };
    let service = api_service.map(|s| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: s.metadata.name.clone(),
        namespace: Some(ns.clone()),
        uid: s.metadata.uid.clone(),
        ..ObjectReference::default()
    });
    Ok(Observation {
        desired,
        healthy: ready_replicas.max(0) as u32,
        ok,
        counting: format!(
            "replicas of {kind} {} are updated and ready{}",
            rendered.workload_name,
            if ok {
                ""
            } else {
                " (rollout of the newest spec not complete)"
            }
        ),
        addresses,
        service,
        credentials,
    })
}
