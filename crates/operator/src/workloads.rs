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
    /// The Service of the shared gateway (`nestplane gateway`), as `namespace/name`: every
    /// tenant is reached there by its server name, and it is the endpoint of each whose API
    /// server Service is a ClusterIP one.
    pub gateway_service: Option<String>,
    /// The Gateway (`namespace/name`) that the tenants' `TLSRoute`s attach to, where the
    /// Gateway API is installed (none: they attach to what their owners add).
    pub tls_route_parent: Option<String>,
}

/// The operator's image as the install manifests name it.
pub const DEFAULT_EGRESS_IMAGE: &str = "nestplane:latest";

impl Default for KubernetesSettings {
    fn default() -> Self {
        KubernetesSettings {
            image_registry: nestplane_render::DEFAULT_IMAGE_REGISTRY.into(),
            etcd_storage: nestplane_render::workload::DEFAULT_ETCD_STORAGE.into(),
            egress_image: DEFAULT_EGRESS_IMAGE.into(),
            gateway_service: None,
            tls_route_parent: None,
        }
    }
}

/// Where the shared gateway is reached, from its Service: its load balancer's address when it
/// has one, else its cluster address; the Service's first port. Pure.
pub fn gateway_endpoint(svc: &Service) -> Option<ApiEndpoint> {
    let port = svc.spec.as_ref()?.ports.as_ref()?.first()?.port;
    let at = service_endpoint(svc)?;
    Some(ApiEndpoint {
        host: at.host,
        port,
    })
}

/// How long the gateway's address is taken as read.
const GATEWAY_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// The Gateway API's `TLSRoute` of a tenant's API server, for users who bring their own
/// gateway: the tenant's server name there to its API server Service, TLS passed through;
/// attached to `parent` (`namespace/name` of a Gateway) when given, else to whatever Gateway
/// its owner adds with a field manager of their own. Pure.
pub fn tls_route(cluster: &str, ns: &str, parent: Option<&str>) -> Value {
    let name = Component::ApiServer.workload_name(cluster);
    let mut route = json!({
        "apiVersion": format!("{TLS_ROUTE_GROUP}/{TLS_ROUTE_VERSION}"),
        "kind": "TLSRoute",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": nestplane_render::pod_labels(cluster, Component::ApiServer),
        },
        "spec": {
            "hostnames": [names::gateway_server_name(cluster, ns)],
            "rules": [{"backendRefs": [{"name": name, "port": ports::APISERVER}]}],
        },
    });
    if let Some((gns, gname)) = parent.and_then(|p| p.split_once('/')) {
        route["spec"]["parentRefs"] = json!([{
            "group": TLS_ROUTE_GROUP,
            "kind": "Gateway",
            "namespace": gns,
            "name": gname,
        }]);
    }
    route
}

/// The Gateway API's group, and the version of `TLSRoute` a route is made in (the one the
/// cluster prefers is written: `v1` from Gateway API 1.5, `v1alpha2` before).
pub const TLS_ROUTE_GROUP: &str = "gateway.networking.k8s.io";
/// See [`TLS_ROUTE_GROUP`].
pub const TLS_ROUTE_VERSION: &str = "v1alpha2";
/// How long what the cluster serves of `TLSRoute` is taken as read.
const TLS_ROUTES_TTL: std::time::Duration = std::time::Duration::from_secs(300);

/// The `TLSRoute` resource the management cluster serves (the Gateway API's CRDs are
/// installed), as last discovered.
#[derive(Default)]
pub struct TlsRoutes(
    std::sync::Mutex<Option<(std::time::Instant, Option<kube::core::ApiResource>)>>,
);

impl TlsRoutes {
    /// The served `TLSRoute`, in the version the cluster prefers; `None` where the Gateway
    /// API is not installed. Discovered again after [`TLS_ROUTES_TTL`].
    async fn resource(&self, client: &kube::Client) -> Option<kube::core::ApiResource> {
        if let Some((at, ar)) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref()
            && at.elapsed() < TLS_ROUTES_TTL
        {
            return ar.clone();
        }
        let ar = match kube::discovery::group(client, TLS_ROUTE_GROUP).await {
            Ok(g) => g.recommended_kind("TLSRoute").map(|(ar, _)| ar),
            Err(_) => None,
        };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), ar.clone()));
        ar
    }

    /// Apply the tenant's route where the cluster serves `TLSRoute`. Best effort: a route is
    /// an extra for users who bring their own gateway, so a failure is logged and the tenant's
    /// pass goes on.
    async fn apply(&self, client: &kube::Client, route: &Value, owner: &OwnerReference) {
        let Some(ar) = self.resource(client).await else {
            return;
        };
        let ns = route["metadata"]["namespace"].as_str().unwrap_or_default();
        let name = route["metadata"]["name"].as_str().unwrap_or_default();
        let mut route = route.clone();
        route["apiVersion"] = json!(ar.api_version);
        route["metadata"]["ownerReferences"] = json!([owner]);
        let api: Api<kube::core::DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
        let pp = kube::api::PatchParams::apply(crate::crds::FIELD_MANAGER).force();
        if let Err(e) = api.patch(name, &pp, &kube::api::Patch::Apply(&route)).await {
            tracing::warn!(route = %format!("{ns}/{name}"), error = %e, "writing the tenant's TLSRoute failed");
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

/// `host:port`, with an IPv6 address in brackets.
fn host_port(e: &ApiEndpoint) -> String {
    match e.host.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("[{v6}]:{}", e.port),
        Err(_) => format!("{}:{}", e.host, e.port),
    }
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
    /// The gateway's address as last read, and when.
    gateway: std::sync::Mutex<Option<(std::time::Instant, Option<ApiEndpoint>)>>,
    /// Whether `TLSRoute`s can be written.
    routes: TlsRoutes,
}

impl Workloads {
    /// Workloads with these settings, applied through `applied` (which the operator fills
    /// with its watch caches).
    pub fn new(settings: KubernetesSettings, applied: Arc<Applied>) -> Self {
        Workloads {
            settings,
            applied,
            gateway: Default::default(),
            routes: Default::default(),
        }
    }

    /// The gateway's address as last read (`None` without a gateway, or before its Service
    /// has an address).
    fn gateway_now(&self) -> Option<ApiEndpoint> {
        self.gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|(_, e)| e.clone())
    }

    /// Read the gateway's Service again when the last reading is old.
    async fn refresh_gateway(&self, client: &kube::Client) -> Result<(), Error> {
        let Some((ns, name)) = self
            .settings
            .gateway_service
            .as_deref()
            .and_then(|s| s.split_once('/'))
        else {
            return Ok(());
        };
        let fresh = self
            .gateway
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < GATEWAY_TTL);
        if fresh {
            return Ok(());
        }
        let svc = Api::<Service>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await?;
        let at = svc.as_ref().and_then(gateway_endpoint);
        if at.is_none() {
            tracing::warn!(service = %format!("{ns}/{name}"), "the gateway's Service has no address yet");
        }
        *self.gateway.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), at));
        Ok(())
    }

    /// The tenant's API server Service, from the watch cache.
    fn apiserver_service(&self, ncp: &NestedControlPlane) -> Option<Service> {
        let ns = ncp.namespace().unwrap_or_default();
        let name = Component::ApiServer.workload_name(&crate::tenant::cluster_name(ncp));
        self.applied.service(&ns, &name)
    }
}

/// Whether a tenant whose API server Service is `svc` is published at the gateway: unless
/// it asked for an address of its own (a LoadBalancer or NodePort Service).
fn published_at_gateway(svc: &Service) -> bool {
    matches!(
        svc.spec.as_ref().and_then(|s| s.type_.as_deref()),
        None | Some("ClusterIP")
    )
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
        async move {
            self.refresh_gateway(pass.client).await?;
            let gateway = self.gateway_now();
            run(
                pass,
                &self.settings,
                &self.applied,
                gateway.as_ref(),
                &self.routes,
            )
            .await
        }
        .boxed()
    }

    fn gateway(&self, ncp: &NestedControlPlane) -> Option<nestplane_api::GatewayStatus> {
        let at = self.gateway_now()?;
        Some(nestplane_api::GatewayStatus {
            server: format!("https://{}", host_port(&at)),
            server_name: names::gateway_server_name(
                &crate::tenant::cluster_name(ncp),
                &ncp.namespace().unwrap_or_default(),
            ),
            // No door for machines of other hosts in this runtime yet.
            machines: None,
        })
    }

    fn first_replica(&self, namespace: &str, cluster: &str) -> Option<std::net::SocketAddr> {
        // The API server's Service, once known (the gateway only when it is not).
        let svc = self
            .applied
            .service(namespace, &Component::ApiServer.workload_name(cluster))?;
        let ip = svc.spec?.cluster_ip?.parse().ok()?;
        Some(std::net::SocketAddr::new(ip, ports::APISERVER as u16))
    }

    fn apiserver_replicas(&self, ncp: &NestedControlPlane) -> Vec<std::net::SocketAddr> {
        // Where the endpoint is the gateway, what dials the API servers without a server name
        // (nodes, the removed-API check) dials their Service.
        if ncp.spec.control_plane_endpoint.is_none()
            || ncp.spec.control_plane_endpoint != self.gateway_now()
        {
            return vec![];
        }
        self.apiserver_service(ncp)
            .and_then(|s| s.spec?.cluster_ip?.parse().ok())
            .map(|ip| vec![std::net::SocketAddr::new(ip, ports::APISERVER as u16)])
            .unwrap_or_default()
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
            // With the gateway, a tenant on a cluster address is published there: no restart
            // of one API server pod is seen at its endpoint. While the gateway's address is
            // not known (its load balancer has none yet), the endpoint stays where it is.
            self.refresh_gateway(client).await?;
            if let Some(svc) = &svc
                && self.settings.gateway_service.is_some()
                && published_at_gateway(svc)
            {
                if let Some(gateway) = self.gateway_now() {
                    return Ok(Some(gateway));
                }
                if let Some(current) = &ncp.spec.control_plane_endpoint {
                    return Ok(Some(current.clone()));
                }
            }
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
    gateway: Option<&ApiEndpoint>,
    routes: &TlsRoutes,
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
    let mut hosts = api_service.map(service_addresses).unwrap_or_default();
    // Where the Gateway API is installed, the tenant's route for a gateway the user brings.
    if c == Component::ApiServer && !hosts.is_empty() {
        let route = tls_route(&t.cluster(), &ns, settings.tls_route_parent.as_deref());
        routes.apply(client, &route, &owner).await;
    }
    // The tenant's name at a gateway (nestplane's, or one a TLSRoute attaches to) is always in
    // its API server's certificate: a certificate that followed whether a gateway is
    // configured, or known yet, would change, and roll the API server, each time it did.
    let gateway_name = (c == Component::ApiServer && !hosts.is_empty())
        .then(|| names::gateway_server_name(&t.cluster(), &ns));
    hosts.extend(gateway_name.clone());
    // The admin kubeconfig names the tenant there when its endpoint is the gateway (as its
    // status recorded it, which holds while the gateway's address is being read again).
    let endpoint = t.ncp.spec.control_plane_endpoint.as_ref();
    let recorded = t
        .ncp
        .status
        .as_ref()
        .and_then(|s| s.gateway.as_ref())
        .is_some_and(|g| endpoint.is_some_and(|e| g.server == format!("https://{}", host_port(e))));
    let at_gateway = endpoint.is_some() && (endpoint == gateway || recorded);
    let server_name = gateway_name.as_deref().filter(|_| at_gateway);
    let (secrets, _) = pass.issue(&input, &hosts, server_name).await?;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_tls_route_sends_its_name_to_its_api_server_service() {
        let r = tls_route("demo", "tenants", None);
        assert_eq!(r["apiVersion"], "gateway.networking.k8s.io/v1alpha2");
        assert_eq!(r["kind"], "TLSRoute");
        assert_eq!(r["metadata"]["name"], "demo-apiserver");
        assert_eq!(r["metadata"]["namespace"], "tenants");
        assert_eq!(
            r["spec"]["hostnames"],
            json!(["demo.tenants.nestplane.internal"])
        );
        assert_eq!(
            r["spec"]["rules"],
            json!([{"backendRefs": [{"name": "demo-apiserver", "port": 6443}]}])
        );
        // No parent unless one is configured: an owner's own parentRefs stay theirs.
        assert!(r["spec"].get("parentRefs").is_none());
        let r = tls_route("demo", "tenants", Some("infra/edge"));
        assert_eq!(
            r["spec"]["parentRefs"],
            json!([{"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": "infra", "name": "edge"}])
        );
    }

    #[test]
    fn the_gateways_address_is_its_load_balancers_else_its_cluster_address() {
        let svc = |ty: &str, lb: Option<&str>| -> Service {
            serde_json::from_value(json!({
                "spec": {"type": ty, "clusterIP": "10.96.0.9", "ports": [{"port": 443}]},
                "status": {"loadBalancer": {"ingress": lb.map(|ip| vec![json!({"ip": ip})]).unwrap_or_default()}},
            }))
            .unwrap()
        };
        let at = |s: &Service| gateway_endpoint(s).map(|e| (e.host, e.port));
        assert_eq!(at(&svc("ClusterIP", None)), Some(("10.96.0.9".into(), 443)));
        assert_eq!(
            at(&svc("LoadBalancer", Some("192.0.2.7"))),
            Some(("192.0.2.7".into(), 443))
        );
        // A load balancer not given an address yet: none (nothing is published early).
        assert_eq!(at(&svc("LoadBalancer", None)), None);
        // Tenants of their own address keep it.
        assert!(published_at_gateway(&svc("ClusterIP", None)));
        assert!(!published_at_gateway(&svc("LoadBalancer", None)));
        assert!(!published_at_gateway(&svc("NodePort", None)));
    }
}
