//! The `process` runtime behind the [`Runtime`] seam: the rendered, patched pod template runs
//! as supervised local processes ([`ProcessRuntime`]); a component is healthy when every
//! replica answers its health endpoint.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{ObjectReference, Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use nestplane_api::names::{self, Component, SecretPurpose, ports};
use nestplane_api::{ApiEndpoint, NestedControlPlane, NestedEtcdAddress};
use nestplane_nodes::entry;
use nestplane_render::{KubeVersion, Network, RenderInput, policy};
use nestplane_runtime::process::{self, ProcessRuntime, RuntimeError, TenantKey};

use crate::crds::FIELD_MANAGER;
use crate::error::Error;
use crate::runtime::{Observation, Pass, Runtime};
use crate::tenant::Tenant;

/// Components as local processes.
pub struct Processes {
    processes: Arc<ProcessRuntime>,
    /// Where API servers' cluster traffic goes, when this operator makes nodes.
    egress: Option<Arc<crate::egress::Egress>>,
    /// The shared gateway, when this operator runs one.
    gateway: Option<Gateway>,
}

/// The shared gateway ([`nestplane_gateway`]): its address and the routes the API servers'
/// passes keep.
#[derive(Clone, Debug)]
pub struct Gateway {
    /// Where it listens.
    pub address: std::net::SocketAddr,
    /// Where it is published, when not where it listens (`--gateway-advertise-address`).
    pub advertised: Option<std::net::SocketAddr>,
    /// Server name → API server replicas.
    pub routes: Arc<nestplane_gateway::Routes>,
    /// Whether it is the tenants' endpoint: its port was given (`--gateway-bind-address
    /// HOST:PORT`), so it stays across the operator's restarts. One picked at start (port
    /// 0) is still every tenant's `status.gateway`, but endpoints stay at the API servers.
    pub published: bool,
}

impl Processes {
    /// Components run by `processes`.
    pub fn new(processes: Arc<ProcessRuntime>) -> Self {
        Processes {
            processes,
            egress: None,
            gateway: None,
        }
    }

    /// Every tenant is reached through `gateway` too: its API server's certificate names it
    /// there, and its passes keep the gateway's route to its replicas.
    pub fn with_gateway(mut self, gateway: Gateway) -> Self {
        self.gateway = Some(gateway);
        self
    }

    /// The endpoint every tenant is published at when the gateway runs at a port of its own
    /// ([`Gateway::published`]): the gateway's address, shared by all tenants, each named
    /// there by its server name.
    fn at_gateway(&self) -> Option<ApiEndpoint> {
        self.gateway
            .as_ref()
            .filter(|g| g.published)
            .and_then(|_| self.gateway_address())
    }

    /// The gateway's address, if it runs: as advertised, else where it listens (its
    /// loopback address when it listens on every address).
    fn gateway_address(&self) -> Option<ApiEndpoint> {
        let gateway = self.gateway.as_ref()?;
        let address = gateway.advertised.unwrap_or(gateway.address);
        let ip = match address.ip() {
            IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        Some(ApiEndpoint {
            host: ip.to_string(),
            port: i32::from(address.port()),
        })
    }

    /// API servers send their cluster traffic (kubelets, proxies, webhooks, aggregated APIs)
    /// to `egress`, which connects it from inside their clusters' nodes.
    pub fn with_egress(mut self, egress: Arc<crate::egress::Egress>) -> Self {
        self.egress = Some(egress);
        self
    }
}

fn tenant_key(ncp: &NestedControlPlane) -> TenantKey {
    TenantKey {
        namespace: ncp.namespace().unwrap_or_default(),
        cluster: crate::tenant::cluster_name(ncp),
    }
}

impl Runtime for Processes {
    fn patch_policy(&self) -> policy::Runtime {
        policy::Runtime::Process
    }

    fn check_input(&self, t: &Tenant, version: KubeVersion) -> RenderInput {
        let hosts = (1..=process::MAX_REPLICAS)
            .map(|i| Ipv4Addr::new(127, 0, 0, i))
            .collect();
        t.render_input(version, Network::Loopback { hosts })
    }

    fn can_run(&self, c: Component, version: &KubeVersion) -> Result<(), Error> {
        process::binary_for(c, &version.to_string()).map_err(RuntimeError::from)?;
        Ok(())
    }

    fn newest_patch(&self, minor: u32) -> Option<u32> {
        nestplane_runtime::binaries::newest_patch(minor)
    }

    fn gateway(&self, ncp: &NestedControlPlane) -> Option<nestplane_api::GatewayStatus> {
        let at = self.gateway_address()?;
        let key = tenant_key(ncp);
        let ip: IpAddr = at.host.parse().ok()?;
        let server_name = names::gateway_server_name(&key.cluster, &key.namespace);
        Some(nestplane_api::GatewayStatus {
            server: format!("https://{}", std::net::SocketAddr::new(ip, at.port as u16)),
            // The door opens where the API servers' egress runs (nodes are made here).
            machines: self
                .egress
                .as_ref()
                .map(|_| entry::server_name(&server_name)),
            server_name,
        })
    }

    fn run<'a>(&'a self, pass: Pass<'a>) -> BoxFuture<'a, Result<Observation, Error>> {
        self.run_pass(pass).boxed()
    }

    fn apiserver_replicas(&self, ncp: &NestedControlPlane) -> Vec<std::net::SocketAddr> {
        let n = ncp
            .status
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1)
            .max(1) as usize;
        self.processes
            .stored_hosts(&tenant_key(ncp))
            .unwrap_or_default()
            .into_iter()
            .take(n)
            .map(|h| std::net::SocketAddr::new(IpAddr::V4(h), ports::APISERVER as u16))
            .collect()
    }

    fn first_replica(&self, namespace: &str, cluster: &str) -> Option<std::net::SocketAddr> {
        let key = TenantKey {
            namespace: namespace.to_string(),
            cluster: cluster.to_string(),
        };
        let first = *self.processes.stored_hosts(&key)?.first()?;
        Some(std::net::SocketAddr::new(
            IpAddr::V4(first),
            ports::APISERVER as u16,
        ))
    }

    fn control_plane_user(&self, ncp: &NestedControlPlane) -> Result<Option<u32>, Error> {
        Ok(self
            .processes
            .existing_user(&tenant_key(ncp))?
            .map(|u| u.uid))
    }

    fn endpoint<'a>(
        &'a self,
        _client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<Option<ApiEndpoint>, Error>> {
        async move {
            let key = tenant_key(ncp);
            // A control plane of this name may have been deleted before; this one runs.
            self.processes.revive(&key);
            let hosts = self.processes.hosts(&key)?;
            // With the gateway, the endpoint outlives any one API server.
            if let Some(gateway) = self.at_gateway() {
                return Ok(Some(gateway));
            }
            Ok(hosts.first().map(|h| ApiEndpoint {
                host: h.to_string(),
                port: ports::APISERVER,
            }))
        }
        .boxed()
    }

    fn revive(&self, ncp: &NestedControlPlane) {
        self.processes.revive(&tenant_key(ncp));
    }

    fn remove<'a>(
        &'a self,
        _client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let key = tenant_key(ncp);
            if let Some(e) = &self.egress {
                e.remove(&key);
            }
            if let Some(g) = &self.gateway {
                let name = names::gateway_server_name(&key.cluster, &key.namespace);
                g.routes.set(&entry::server_name(&name), vec![]);
                g.routes.set(&name, vec![]);
            }
            // Marked removed first thing: a pass that serves the tenant meanwhile sees it, and
            // what it made goes below.
            let removed = self.processes.remove(&key).await;
            if let Some(g) = &self.gateway {
                let name = names::gateway_server_name(&key.cluster, &key.namespace);
                g.routes.set(&entry::server_name(&name), vec![]);
                g.routes.set(&name, vec![]);
            }
            if let Some(e) = &self.egress {
                e.remove(&key);
            }
            removed?;
            Ok(())
        }
        .boxed()
    }
}

impl Processes {
    async fn run_pass(&self, pass: Pass<'_>) -> Result<Observation, Error> {
        let Pass {
            client,
            tenant: t,
            component: c,
            version,
            patches,
            ..
        } = pass;
        let key = tenant_key(&t.ncp);
        let hosts = self.processes.hosts(&key)?;
        let input = t.render_input(
            version,
            Network::Loopback {
                hosts: hosts.clone(),
            },
        );
        let mut rendered = nestplane_render::render(c, &input)?;
        if t.held(c) {
            rendered.replicas = 0;
        }
        // The same patches as the workloads get; the process runtime runs the patched
        // template.
        if !patches.is_empty() {
            let mut objects = nestplane_render::process_objects(&rendered, &input);
            policy::apply_checked(objects.all_mut(), patches, policy::Runtime::Process)?;
            rendered.pod_template = objects.pod_template()?;
        }
        let mut endpoint_host: Vec<String> =
            hosts.first().map(|h| h.to_string()).into_iter().collect();
        // The gateway's name for the tenant is in its API server's certificate.
        let gateway_name = (c == Component::ApiServer)
            .then_some(self.gateway.as_ref())
            .flatten()
            .map(|_| names::gateway_server_name(&key.cluster, &key.namespace));
        if let Some(name) = &gateway_name {
            endpoint_host.push(name.clone());
        }
        // Published at the gateway: clients name the tenant there.
        let at_gateway = t.ncp.spec.control_plane_endpoint.as_ref() == self.at_gateway().as_ref();
        let server_name = gateway_name.as_deref().filter(|_| at_gateway);
        let (secrets, health_ca) = pass.issue(&input, &endpoint_host, server_name).await?;
        let mut data = secrets.data(&rendered.secrets).await?;
        let mut credentials = secrets.credentials(&data);
        // Which datastore an API server on a shared one runs against (a move's cut-over is
        // done when every replica runs the destination's).
        if c == Component::ApiServer
            && input.datastore_prefix.is_some()
            && let Some(endpoints) = &input.external_etcd
        {
            credentials.insert(
                crate::datastore::migrate::DATASTORE_CREDENTIAL.into(),
                crate::datastore::migrate::datastore_fingerprint(endpoints),
            );
        }
        let egress = self.egress.as_ref().filter(|_| c == Component::ApiServer);
        if egress.is_some() {
            let (name, files) = nestplane_render::egress::apply(&mut rendered);
            data.insert(name, files);
        }
        let endpoints = nestplane_render::health_endpoints(c, &input);
        // A replica being replaced leaves the gateway's route before it stops and comes back
        // once its replacement answers (rolling restarts drop no new connection there).
        let serving = self
            .gateway
            .as_ref()
            .zip(gateway_name.clone())
            .map(|(g, name)| {
                let (routes, hosts) = (g.routes.clone(), hosts.clone());
                process::Serving(Arc::new(move |i: usize, up: bool| {
                    let Some(h) = hosts.get(i) else { return };
                    let addr = std::net::SocketAddr::new(IpAddr::V4(*h), ports::APISERVER as u16);
                    routes.update(&name, |b| {
                        // The last backend stays (a name without one would be reset as
                        // unknown; a refused connection is no worse).
                        if !up && b.len() == 1 && b[0] == addr {
                            return;
                        }
                        b.retain(|a| *a != addr);
                        if up {
                            b.push(addr);
                        }
                    });
                }))
            });
        let probe = process::Probe {
            endpoints: endpoints.clone(),
            ca_pem: health_ca.clone(),
            serving,
        };
        self.processes
            .ensure(&key, &rendered, &version.to_string(), &data, &probe)
            .await?;
        if let Some(egress) = egress {
            let dir = self.processes.tenant_dir(&key)?;
            let dirs: Vec<_> = (0..rendered.replicas)
                .map(|i| dir.join(format!("{}-{i}", rendered.workload_name)))
                .collect();
            let user = self.processes.existing_user(&key)?;
            let services = crate::egress::service_ranges(&input.service_cidr);
            egress.ensure(&key, user, services, &dirs);
            // Nodes on other machines come in at the tenant's door behind the gateway.
            if let (Some(g), Some(name)) = (&self.gateway, &gateway_name) {
                let ca = secrets.ca(SecretPurpose::ClusterCa).await?;
                let door = entry::server_name(name);
                let (routes, api) = (g.routes.clone(), name.clone());
                let backends: entry::Backends =
                    Arc::new(move || routes.get(&api).unwrap_or_default());
                if let Some(addr) = egress.door(&key, &ca, &door, backends).await {
                    g.routes.update(&door, |b| {
                        *b = if self.processes.is_removed(&key) {
                            vec![]
                        } else {
                            vec![addr]
                        };
                    });
                }
            }
            if self.processes.is_removed(&key) {
                // Removed while this pass served it: what was just made goes too.
                egress.remove(&key);
            }
        }

        let service = if c == Component::ApiServer {
            Some(ensure_apiserver_service(client, t, &hosts).await?)
        } else {
            None
        };
        // Each replica's health, once: the count, and the gateway's route (the replicas that
        // answer, else all of them while none does; none for a tenant removed meanwhile).
        let desired = rendered.replicas;
        let answering: Vec<usize> = process::healthy_replicas(&endpoints, health_ca.as_deref())
            .await
            .into_iter()
            .enumerate()
            .filter_map(|(i, ok)| ok.then_some(i))
            .collect();
        let healthy = answering.len() as u32;
        if let (Some(g), Some(name)) = (&self.gateway, &gateway_name) {
            let addr = |i: usize| {
                hosts
                    .get(i)
                    .map(|h| std::net::SocketAddr::new(IpAddr::V4(*h), ports::APISERVER as u16))
            };
            let backends: Vec<_> = if answering.is_empty() {
                (0..desired as usize).filter_map(addr).collect()
            } else {
                answering.iter().filter_map(|&i| addr(i)).collect()
            };
            // Judged under the routes' lock: `remove` marks the tenant before it clears the
            // route, so a pass never brings back the route of a removed tenant.
            g.routes.update(name, |b| {
                *b = if self.processes.is_removed(&key) {
                    vec![]
                } else {
                    backends
                };
            });
        }
        let ok = healthy >= desired && desired > 0;
        if ok {
            self.processes.mark_healthy(&key, c);
        }
        let addresses = if c == Component::Etcd {
            hosts
                .iter()
                .take(desired as usize)
                .enumerate()
                .map(|(i, h)| NestedEtcdAddress {
                    ip: Some(h.to_string()),
                    hostname: Some(format!("{}-{i}", rendered.workload_name)),
                    port: ports::ETCD_CLIENT,
                })
                .collect()
        } else {
            vec![]
        };
        Ok(Observation {
            desired,
            healthy,
            ok,
            counting: "replicas answer their health endpoint".into(),
            addresses,
            service,
            credentials,
        })
    }
}

/// The process runtime has no Service of its own: a selector-less Service named
/// `<cluster>-apiserver` stands for the tenant API server (annotated with its URL), so
/// `NestedAPIServer.status.apiserverService` points at a real object.
async fn ensure_apiserver_service(
    client: &kube::Client,
    t: &Tenant,
    hosts: &[Ipv4Addr],
) -> Result<ObjectReference, Error> {
    let name = Component::ApiServer.workload_name(&t.cluster());
    let ns = t.namespace();
    let url = hosts
        .first()
        .map(|h| format!("https://{}:{}", IpAddr::V4(*h), ports::APISERVER))
        .unwrap_or_default();
    let svc = Service {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([
                (names::CLUSTER_NAME_LABEL.to_string(), t.cluster()),
                (
                    names::COMPONENT_LABEL.to_string(),
                    Component::ApiServer.short_name().to_string(),
                ),
                (
                    names::MANAGED_BY_LABEL.to_string(),
                    names::MANAGED_BY.to_string(),
                ),
            ])),
            annotations: Some(BTreeMap::from([("nestplane.io/endpoint".to_string(), url)])),
            owner_references: Some(vec![t.owner()]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                name: Some("https".into()),
                port: ports::APISERVER,
                target_port: Some(IntOrString::Int(ports::APISERVER)),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    };
    let api: Api<Service> = Api::namespaced(client.clone(), &ns);
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&svc),
    )
    .await?;
    Ok(ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(name),
        namespace: Some(ns),
        ..ObjectReference::default()
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn at(address: &str, advertised: Option<&str>, published: bool) -> Processes {
        let dir = std::env::temp_dir().join("nestplane-process-gateway-test");
        Processes::new(Arc::new(ProcessRuntime::new(dir))).with_gateway(Gateway {
            address: address.parse().unwrap(),
            advertised: advertised.map(|a| a.parse().unwrap()),
            routes: Default::default(),
            published,
        })
    }

    fn endpoint(host: &str, port: i32) -> ApiEndpoint {
        ApiEndpoint {
            host: host.into(),
            port,
        }
    }

    #[test]
    fn the_gateway_is_published_where_it_is_advertised_else_where_it_listens() {
        let mut ncp = NestedControlPlane::new("c1", Default::default());
        ncp.metadata.namespace = Some("team".into());
        // On every address: the loopback one, unless another is advertised.
        let every = at("0.0.0.0:7443", None, true);
        assert_eq!(every.at_gateway(), Some(endpoint("127.0.0.1", 7443)));
        let advertised = at("0.0.0.0:7443", Some("192.0.2.10:7443"), true);
        assert_eq!(advertised.at_gateway(), Some(endpoint("192.0.2.10", 7443)));
        let status = advertised.gateway(&ncp).unwrap();
        assert_eq!(status.server, "https://192.0.2.10:7443");
        assert_eq!(status.server_name, names::gateway_server_name("c1", "team"));
        // At one address: that one.
        let one = at("127.0.0.5:7443", None, true);
        assert_eq!(one.at_gateway(), Some(endpoint("127.0.0.5", 7443)));
        // At a port picked at start: every tenant's status.gateway, nobody's endpoint.
        let picked = at("127.0.0.1:40001", None, false);
        assert_eq!(picked.at_gateway(), None);
        assert_eq!(
            picked.gateway(&ncp).unwrap().server,
            "https://127.0.0.1:40001"
        );
    }
}
