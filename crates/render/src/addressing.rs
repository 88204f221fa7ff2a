//! Addresses, URLs and certificate SANs, all derived from the same [`Network`] so that
//! certificates match the addresses the components use.

use std::net::{IpAddr, Ipv4Addr};

use nestplane_api::names::{Component, NODE_LOCAL_APISERVER, ports};

use crate::{Network, RenderInput, first_service_ip};

/// Subject alternative names of a certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sans {
    /// DNS names (in a stable order, no duplicates).
    pub dns: Vec<String>,
    /// IP addresses (in a stable order, no duplicates).
    pub ips: Vec<IpAddr>,
}

impl Sans {
    fn dns(&mut self, name: impl Into<String>) {
        let name = name.into();
        if !self.dns.contains(&name) {
            self.dns.push(name);
        }
    }

    fn ip(&mut self, ip: impl Into<IpAddr>) {
        let ip = ip.into();
        if !self.ips.contains(&ip) {
            self.ips.push(ip);
        }
    }

    fn localhost(&mut self) {
        self.dns("localhost");
        self.ip(Ipv4Addr::LOCALHOST);
    }

    fn loopback_hosts(&mut self, input: &RenderInput) {
        if let Network::Loopback { hosts } = &input.network {
            for h in hosts {
                self.ip(*h);
            }
        }
    }
}

/// Headless Service giving etcd members stable DNS names: `<cluster>-etcd-peer`.
pub fn etcd_peer_service_name(cluster: &str) -> String {
    format!("{cluster}-etcd-peer")
}

/// Service etcd clients use: `<cluster>-etcd`.
pub fn etcd_client_service_name(cluster: &str) -> String {
    format!("{cluster}-etcd")
}

/// Service in front of the API servers: `<cluster>-apiserver`.
pub fn apiserver_service_name(cluster: &str) -> String {
    format!("{cluster}-apiserver")
}

/// `<cluster>-etcd-<i>.<cluster>-etcd-peer.<ns>.svc`: replica `i` of etcd on the Cluster network.
fn etcd_member_dns(input: &RenderInput, i: u32) -> String {
    format!(
        "{}-{i}.{}.{}.svc",
        Component::Etcd.workload_name(&input.cluster),
        etcd_peer_service_name(&input.cluster),
        input.namespace
    )
}

/// The address replica `i` of `c` listens on (Loopback: the host address; Cluster: etcd's
/// stable DNS name, `None` for components without one).
fn replica_host(c: Component, input: &RenderInput, i: u32) -> Option<String> {
    match &input.network {
        Network::Loopback { hosts } => hosts.get(i as usize).map(|h| h.to_string()),
        Network::Cluster => (c == Component::Etcd).then(|| etcd_member_dns(input, i)),
    }
}

/// Members of etcd as `--initial-cluster` lists them: `<c>-etcd-<i>=https://<host>:2380`.
pub(crate) fn etcd_initial_cluster(input: &RenderInput) -> String {
    (0..input.replicas_of(Component::Etcd))
        .filter_map(|i| {
            replica_host(Component::Etcd, input, i).map(|h| {
                format!(
                    "{}-{i}=https://{h}:{}",
                    Component::Etcd.workload_name(&input.cluster),
                    ports::ETCD_PEER
                )
            })
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// SANs of the etcd serving and peer certificates. Loopback: every host address of the
/// tenant (so scaling needs no new certificate), `127.0.0.1` and `localhost`. Cluster: the
/// members' names under the peer Service (wildcard), the client Service's names, `localhost`
/// and `127.0.0.1`.
pub fn etcd_sans(input: &RenderInput) -> Sans {
    let mut s = Sans::default();
    if input.network == Network::Cluster {
        let peer = etcd_peer_service_name(&input.cluster);
        let client = etcd_client_service_name(&input.cluster);
        let ns = &input.namespace;
        let domain = &input.cluster_domain;
        s.dns(format!("*.{peer}.{ns}.svc"));
        s.dns(format!("*.{peer}.{ns}.svc.{domain}"));
        s.dns(client.clone());
        s.dns(format!("{client}.{ns}"));
        s.dns(format!("{client}.{ns}.svc"));
        s.dns(format!("{client}.{ns}.svc.{domain}"));
    }
    s.loopback_hosts(input);
    s.localhost();
    s
}

/// SANs of the API server's serving certificate: the in-tenant names of the `kubernetes`
/// Service and its ClusterIP, `localhost`/`127.0.0.1`, every loopback host (Loopback) or the
/// `<c>-apiserver` Service's names (Cluster), and `endpoint_host` (an IP if it parses as one,
/// else a DNS name).
pub fn apiserver_sans(input: &RenderInput, endpoint_host: Option<&str>) -> Sans {
    let mut s = Sans::default();
    let domain = &input.cluster_domain;
    s.dns("kubernetes");
    s.dns("kubernetes.default");
    s.dns("kubernetes.default.svc");
    s.dns(format!("kubernetes.default.svc.{domain}"));
    if let Ok(ip) = first_service_ip(&input.service_cidr) {
        s.ip(ip);
    }
    // Nodes reach the API servers through their node-local proxy.
    if let Ok(ip) = NODE_LOCAL_APISERVER.parse::<IpAddr>() {
        s.ip(ip);
    }
    if input.network == Network::Cluster {
        let svc = apiserver_service_name(&input.cluster);
        let ns = &input.namespace;
        s.dns(svc.clone());
        s.dns(format!("{svc}.{ns}"));
        s.dns(format!("{svc}.{ns}.svc"));
        s.dns(format!("{svc}.{ns}.svc.{domain}"));
    }
    s.loopback_hosts(input);
    s.localhost();
    if let Some(host) = endpoint_host.map(str::trim).filter(|h| !h.is_empty()) {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<IpAddr>() {
            Ok(ip) => s.ip(ip),
            Err(_) => s.dns(host.to_ascii_lowercase()),
        }
    }
    s
}

/// SANs of kube-controller-manager's serving certificate: the addresses it binds to
/// (Loopback: every host of the tenant) and `localhost`/`127.0.0.1`.
pub fn controller_manager_sans(input: &RenderInput) -> Sans {
    let mut s = Sans::default();
    s.loopback_hosts(input);
    s.localhost();
    s
}

/// SANs of kube-scheduler's serving certificate: the addresses it binds to (Loopback: every
/// host of the tenant) and `localhost`/`127.0.0.1`.
pub fn scheduler_sans(input: &RenderInput) -> Sans {
    controller_manager_sans(input)
}

/// The API server URL kube-controller-manager and kube-scheduler use: Loopback
/// `https://<hosts[0]>:6443` (`127.0.0.1` if there is no host), Cluster
/// `https://<c>-apiserver.<ns>.svc:6443`.
pub fn apiserver_internal_url(input: &RenderInput) -> String {
    match &input.network {
        Network::Loopback { hosts } => format!(
            "https://{}:{}",
            hosts.first().copied().unwrap_or(Ipv4Addr::LOCALHOST),
            ports::APISERVER
        ),
        Network::Cluster => format!(
            "https://{}.{}.svc:{}",
            apiserver_service_name(&input.cluster),
            input.namespace,
            ports::APISERVER
        ),
    }
}

/// etcd client URLs the API server uses: those of an external etcd when given, else
/// Loopback `https://<hosts[i]>:2379` for each etcd replica, Cluster
/// `https://<c>-etcd.<ns>.svc:2379`.
pub fn etcd_client_urls(input: &RenderInput) -> Vec<String> {
    if let Some(urls) = &input.external_etcd {
        return urls.clone();
    }
    match &input.network {
        Network::Loopback { hosts } => hosts
            .iter()
            .take(input.replicas_of(Component::Etcd) as usize)
            .map(|h| format!("https://{h}:{}", ports::ETCD_CLIENT))
            .collect(),
        Network::Cluster => vec![format!(
            "https://{}.{}.svc:{}",
            etcd_client_service_name(&input.cluster),
            input.namespace,
            ports::ETCD_CLIENT
        )],
    }
}

/// An endpoint that answers when a replica is healthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthEndpoint {
    /// Full URL (`http://127.64.3.1:2381/health`).
    pub url: String,
    /// Whether the endpoint is HTTPS (verify with the tenant's cluster CA).
    pub scheme_https: bool,
}

/// Health endpoints of `c`, one per replica: etcd `http://<host>:2381/health`, API server
/// `https://<host>:6443/readyz`, controller-manager `https://<host>:10257/healthz`, scheduler
/// `https://<host>:10259/healthz`. Cluster network: etcd members through the peer Service's
/// DNS names, the API server once through its Service, nothing for the controller-manager
/// and scheduler (their pods have no stable names).
pub fn health_endpoints(c: Component, input: &RenderInput) -> Vec<HealthEndpoint> {
    let (scheme_https, port, path) = match c {
        Component::Etcd => (false, ports::ETCD_METRICS, "/health"),
        Component::ApiServer => (true, ports::APISERVER, "/readyz"),
        Component::ControllerManager => (true, ports::CONTROLLER_MANAGER, "/healthz"),
        Component::Scheduler => (true, ports::SCHEDULER, "/healthz"),
    };
    let scheme = if scheme_https { "https" } else { "http" };
    let endpoint = |host: &str| HealthEndpoint {
        url: format!("{scheme}://{host}:{port}{path}"),
        scheme_https,
    };
    match (&input.network, c) {
        (Network::Cluster, Component::ApiServer) => vec![endpoint(&format!(
            "{}.{}.svc",
            apiserver_service_name(&input.cluster),
            input.namespace
        ))],
        _ => (0..input.replicas_of(c))
            .filter_map(|i| replica_host(c, input, i))
            .map(|h| endpoint(&h))
            .collect(),
    }
}
