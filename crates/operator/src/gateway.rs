//! `nestplane gateway`: the shared TLS-passthrough gateway as a Deployment of the kubernetes
//! runtime. It routes each tenant's server name (`<cluster>.<namespace>.nestplane.internal`)
//! to the Ready API server pods of that tenant, read from a watch of pods; the forwarding is
//! [`nestplane_gateway`]'s, as in the process runtime (from a rotating start, skipping a pod
//! that refuses). The operator learns the gateway's address from its Service
//! (`--gateway-service`).
//!
//! Pods, not a Service: where a Service's traffic goes is decided by its EndpointSlices, and a
//! namespace user can write one by hand that kube-proxy uses (any address, any port). A pod's
//! address is its status, which only the kubelet writes, so a backend is always a pod of the
//! tenant's own namespace, on the pod network, at the API server's port. A namespace user can
//! make a pod with nestplane's labels in their namespace; it then serves their own tenant's
//! name there and nothing else.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use nestplane_api::names::{self, Component, ports};
pub use nestplane_gateway::MAX_PER_CLIENT;
use tokio_util::sync::CancellationToken;

/// The server name a pod serves and its address there, or `None` when it is not a Ready API
/// server pod of a tenant on the pod network. Pure.
pub fn backend_of(pod: &Pod) -> Option<(String, SocketAddr)> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ns = pod.metadata.namespace.as_deref()?;
    let labels = pod.metadata.labels.as_ref()?;
    let cluster = labels.get(names::CLUSTER_NAME_LABEL)?;
    if labels.get(names::MANAGED_BY_LABEL).map(String::as_str) != Some(names::MANAGED_BY)
        || labels.get(names::COMPONENT_LABEL).map(String::as_str)
            != Some(Component::ApiServer.short_name())
        || pod.spec.as_ref()?.host_network == Some(true)
    {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    // A pod on its node's network (whatever its spec says) is not a backend.
    if !ready || status.host_ip.as_deref() == Some(&ip.to_string()) {
        return None;
    }
    Some((
        names::gateway_server_name(cluster, ns),
        SocketAddr::new(ip, ports::APISERVER as u16),
    ))
}

/// The routes `pods` make: each server name to its backends, in a stable order. Pure.
pub fn routes_of<'a>(pods: impl Iterator<Item = &'a Pod>) -> BTreeMap<String, Vec<SocketAddr>> {
    let mut routes: BTreeMap<String, BTreeSet<SocketAddr>> = BTreeMap::new();
    for (name, addr) in pods.filter_map(backend_of) {
        routes.entry(name).or_default().insert(addr);
    }
    routes
        .into_iter()
        .map(|(n, a)| (n, a.into_iter().collect()))
        .collect()
}

/// Keep `routes` as the pods of `api` say, until `stop`; `listed` is told once the first
/// list is in.
pub async fn follow(
    api: Api<Pod>,
    routes: Arc<nestplane_gateway::Routes>,
    listed: tokio::sync::watch::Sender<bool>,
    stop: CancellationToken,
) {
    let selector = format!(
        "{}={},{}={}",
        names::MANAGED_BY_LABEL,
        names::MANAGED_BY,
        names::COMPONENT_LABEL,
        Component::ApiServer.short_name()
    );
    let key = |p: &Pod| format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any());
    let mut pods: HashMap<String, Pod> = HashMap::new();
    let mut relisted: HashMap<String, Pod> = HashMap::new();
    let mut routed: BTreeMap<String, Vec<SocketAddr>> = BTreeMap::new();
    let events = watcher(api, watcher::Config::default().labels(&selector))
        .default_backoff()
        .take_until(stop.cancelled_owned());
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => relisted.clear(),
            Ok(Event::InitApply(p)) => {
                relisted.insert(key(&p), p);
            }
            Ok(Event::InitDone) => {
                pods = std::mem::take(&mut relisted);
                let _ = listed.send(true);
            }
            Ok(Event::Apply(p)) => {
                pods.insert(key(&p), p);
            }
            Ok(Event::Delete(p)) => {
                pods.remove(&key(&p));
            }
            Err(e) => {
                tracing::warn!(error = %e, "watching the API servers' pods");
                continue;
            }
        }
        if !*listed.borrow() {
            continue;
        }
        // Only what changed is touched: a route that stays is never briefly missing.
        let want = routes_of(pods.values());
        for (name, backends) in &want {
            if routed.get(name) != Some(backends) {
                tracing::info!(%name, ?backends, "gateway route");
                routes.set(name, backends.clone());
            }
        }
        for name in routed.keys().filter(|n| !want.contains_key(*n)) {
            tracing::info!(%name, "gateway route removed");
            routes.set(name, vec![]);
        }
        routed = want;
    }
}

/// Serve the gateway at `address`, routing by the pods `api` sees, until `stop`. It listens
/// only once the pods are listed (so a new replica is not Ready while it knows no route), and
/// on `stop` it stops accepting and gives open connections [`DRAIN`] to finish.
pub async fn run(
    address: SocketAddr,
    per_client: usize,
    api: Api<Pod>,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let routes = Arc::new(nestplane_gateway::Routes::default());
    let (listed, mut is_listed) = tokio::sync::watch::channel(false);
    let following = tokio::spawn(follow(api, routes.clone(), listed, stop.clone()));
    tokio::select! {
        _ = is_listed.wait_for(|l| *l) => {}
        _ = stop.cancelled() => return Ok(()),
    }
    let listener = tokio::net::TcpListener::bind(address).await?;
    tracing::info!(%address, routes = routes.len(), "gateway listening");
    tokio::select! {
        _ = nestplane_gateway::serve_within(listener, routes, nestplane_gateway::Limits {
            per_client,
            ..Default::default()
        }) => {}
        _ = stop.cancelled() => {
            // The listener is closed (dropped with `serve`); connections already forwarded
            // run in their own tasks until they end or the process does.
            tokio::time::sleep(DRAIN).await;
        }
    }
    following.abort();
    Ok(())
}

/// How long open connections are given to finish once the gateway is told to stop.
pub const DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "namespace": "tenants",
                "labels": {
                    names::CLUSTER_NAME_LABEL: "demo",
                    names::COMPONENT_LABEL: Component::ApiServer.short_name(),
                    names::MANAGED_BY_LABEL: names::MANAGED_BY,
                },
            },
            "spec": {"containers": []},
            "status": {
                "podIP": ip,
                "hostIP": "192.168.7.2",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .unwrap()
    }

    #[test]
    fn a_name_goes_to_the_ready_api_server_pods_of_its_own_namespace_only() {
        let (name, addr) = backend_of(&pod("a", "10.244.1.5")).unwrap();
        assert_eq!(name, "demo.tenants.nestplane.internal");
        assert_eq!(addr, "10.244.1.5:6443".parse().unwrap());
        type Edit = Box<dyn Fn(&mut Pod)>;
        let refused: Vec<(&str, Edit)> = vec![
            (
                "not Ready",
                Box::new(|p: &mut Pod| {
                    p.status.as_mut().unwrap().conditions.as_mut().unwrap()[0].status =
                        "False".into();
                }),
            ),
            (
                "on its node's network",
                Box::new(|p: &mut Pod| p.spec.as_mut().unwrap().host_network = Some(true)),
            ),
            (
                "at its node's address",
                Box::new(|p: &mut Pod| {
                    p.status.as_mut().unwrap().pod_ip = Some("192.168.7.2".into());
                }),
            ),
            (
                "another component",
                Box::new(|p: &mut Pod| {
                    p.labels_mut().insert(
                        names::COMPONENT_LABEL.into(),
                        Component::Etcd.short_name().into(),
                    );
                }),
            ),
            (
                "not nestplane's",
                Box::new(|p: &mut Pod| {
                    p.labels_mut().remove(names::MANAGED_BY_LABEL);
                }),
            ),
            (
                "being deleted",
                Box::new(|p: &mut Pod| {
                    p.metadata.deletion_timestamp =
                        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                            k8s_openapi::jiff::Timestamp::now(),
                        ));
                }),
            ),
            (
                "no address yet",
                Box::new(|p: &mut Pod| p.status.as_mut().unwrap().pod_ip = None),
            ),
        ];
        for (what, edit) in refused {
            let mut p = pod("a", "10.244.1.5");
            edit(&mut p);
            assert_eq!(backend_of(&p), None, "{what}");
        }
        // A pod claiming another cluster's label serves that name in its own namespace only.
        let mut p = pod("a", "10.244.1.5");
        p.metadata.namespace = Some("elsewhere".into());
        assert_eq!(
            backend_of(&p).unwrap().0,
            "demo.elsewhere.nestplane.internal"
        );
        // Replicas make one route with every Ready pod.
        let pods = [pod("a", "10.244.1.5"), pod("b", "10.244.2.9")];
        let routes = routes_of(pods.iter());
        assert_eq!(
            routes["demo.tenants.nestplane.internal"],
            vec![
                "10.244.1.5:6443".parse().unwrap(),
                "10.244.2.9:6443".parse().unwrap()
            ]
        );
    }
}
