//! What a tenant is rendered from.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::ResourceRequirements;
use nestplane_api::names::{Component, MAX_CLUSTER_NAME_LEN};

use crate::{KubeVersion, RenderError};

/// Default image registry.
pub const DEFAULT_IMAGE_REGISTRY: &str = "registry.k8s.io";
/// Default service CIDR of a tenant.
pub const DEFAULT_SERVICE_CIDR: &str = "10.96.0.0/12";
/// Default cluster domain of a tenant.
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";

/// Service types the API server's Service may have.
pub const SERVICE_TYPES: &[&str] = &["ClusterIP", "NodePort", "LoadBalancer"];

/// Where the replicas of a tenant run and how they reach each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Network {
    /// Pods in the management cluster; peers and clients reach each other through Services'
    /// DNS names.
    Cluster,
    /// Local processes: replica `i` of every component of this tenant listens on `hosts[i]`
    /// (distinct loopback IPs, e.g. 127.64.3.1, 127.64.3.2, …) with the standard ports.
    Loopback {
        /// One address per replica index.
        hosts: Vec<Ipv4Addr>,
    },
}

/// Everything a tenant's control plane is rendered from.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderInput {
    /// Cluster (control plane) name; prefix of every object name.
    pub cluster: String,
    /// Namespace of the control plane in the management cluster.
    pub namespace: String,
    /// Kubernetes version of every component.
    pub version: KubeVersion,
    /// Where the replicas run.
    pub network: Network,
    /// Replicas per component; 1 when missing.
    pub replicas: BTreeMap<Component, u32>,
    /// Compute resources per component; kubeadm-like CPU/memory requests when missing.
    pub resources: BTreeMap<Component, ResourceRequirements>,
    /// Image registry (`registry.k8s.io`).
    pub image_registry: String,
    /// Service CIDR of the tenant (`10.96.0.0/12`).
    pub service_cidr: String,
    /// Cluster domain of the tenant (`cluster.local`).
    pub cluster_domain: String,
    /// Type of the API server's Service on the Cluster network: `ClusterIP` (default),
    /// `NodePort` or `LoadBalancer`.
    pub apiserver_service_type: String,
    /// Client URLs of an etcd that nestplane does not run (an out-of-tree provisioner's,
    /// read from the `NestedEtcd` status); `None` for the etcd nestplane renders.
    pub external_etcd: Option<Vec<String>>,
    /// The key prefix of a tenant on a shared datastore (`/nestplane/<ns>/<cluster>/`); its
    /// etcd CA and client certificate come from the datastore, not from the tenant's plan.
    /// `None` for an etcd of the tenant's own.
    pub datastore_prefix: Option<String>,
    /// etcd compacts its own history (`--auto-compaction-mode=periodic`, this retention):
    /// a shared datastore's etcd, whose tenants' API servers do not compact.
    pub etcd_auto_compaction: Option<String>,
    /// etcd's space quota (`--quota-backend-bytes`): a shared datastore's, sized for its
    /// tenants' quotas. etcd's default (2 GiB) when `None`.
    pub etcd_quota_backend_bytes: Option<i64>,
}

impl RenderInput {
    /// An input with one replica per component, default resources, `registry.k8s.io`,
    /// service CIDR `10.96.0.0/12` and domain `cluster.local`.
    pub fn new(
        cluster: impl Into<String>,
        namespace: impl Into<String>,
        version: KubeVersion,
        network: Network,
    ) -> Self {
        RenderInput {
            cluster: cluster.into(),
            namespace: namespace.into(),
            version,
            network,
            replicas: BTreeMap::new(),
            resources: BTreeMap::new(),
            image_registry: DEFAULT_IMAGE_REGISTRY.into(),
            service_cidr: DEFAULT_SERVICE_CIDR.into(),
            cluster_domain: DEFAULT_CLUSTER_DOMAIN.into(),
            apiserver_service_type: "ClusterIP".into(),
            external_etcd: None,
            datastore_prefix: None,
            etcd_auto_compaction: None,
            etcd_quota_backend_bytes: None,
        }
    }

    /// Replicas of `c` (1 when not given).
    pub fn replicas_of(&self, c: Component) -> u32 {
        self.replicas.get(&c).copied().unwrap_or(1)
    }

    /// Set the replicas of `c` (builder style).
    pub fn with_replicas(mut self, c: Component, n: u32) -> Self {
        self.replicas.insert(c, n);
        self
    }

    /// Check every field; [`crate::render`] calls this first.
    pub fn validate(&self) -> Result<(), RenderError> {
        check_dns_label("cluster", &self.cluster, MAX_CLUSTER_NAME_LEN)?;
        check_dns_label("namespace", &self.namespace, 63)?;
        self.version.check_supported()?;
        if !SERVICE_TYPES.contains(&self.apiserver_service_type.as_str()) {
            return Err(RenderError::invalid(
                "apiserver service type",
                format!(
                    "{:?} is not one of {}",
                    self.apiserver_service_type,
                    SERVICE_TYPES.join(", ")
                ),
            ));
        }
        for (c, n) in &self.replicas {
            if *n == 0 {
                return Err(RenderError::invalid(
                    format!("replicas[{}]", c.short_name()),
                    "0 replicas cannot be rendered; use at least 1",
                ));
            }
        }
        if let Some(urls) = &self.external_etcd {
            check_etcd_urls(urls)?;
        }
        if let Some(p) = &self.datastore_prefix
            && (!p.starts_with('/') || !p.ends_with('/') || p.len() < 3)
        {
            return Err(RenderError::invalid(
                "datastore prefix",
                format!("{p:?} must start and end with '/' and name something in between"),
            ));
        }
        if self.datastore_prefix.is_some() && self.external_etcd.is_none() {
            return Err(RenderError::invalid(
                "datastore prefix",
                "a tenant on a shared datastore needs the datastore's client URLs",
            ));
        }
        if let Network::Loopback { hosts } = &self.network {
            if hosts.is_empty() {
                return Err(RenderError::invalid(
                    "network",
                    "the loopback network has no host addresses; give one per replica index",
                ));
            }
            let mut seen = BTreeSet::new();
            for h in hosts {
                if !h.is_loopback() {
                    return Err(RenderError::invalid(
                        "network",
                        format!("{h} is not a loopback address (127.0.0.0/8)"),
                    ));
                }
                if !seen.insert(*h) {
                    return Err(RenderError::invalid(
                        "network",
                        format!("{h} appears twice; every replica index needs its own address"),
                    ));
                }
            }
            for c in Component::ALL {
                let replicas = self.replicas_of(c);
                if replicas as usize > hosts.len() {
                    return Err(RenderError::NotEnoughHosts {
                        component: c,
                        replicas,
                        hosts: hosts.len(),
                    });
                }
            }
        }
        first_service_ip(&self.service_cidr)?;
        check_domain(&self.cluster_domain)?;
        if self.image_registry.trim().is_empty()
            || self.image_registry.chars().any(char::is_whitespace)
        {
            return Err(RenderError::invalid(
                "image_registry",
                format!(
                    "{:?} is not a registry; expected a host and optional path such as {DEFAULT_IMAGE_REGISTRY}",
                    self.image_registry
                ),
            ));
        }
        Ok(())
    }

    /// The image `<registry>/<name>:<tag>`.
    pub(crate) fn image(&self, name: &str, tag: &str) -> String {
        format!(
            "{}/{name}:{tag}",
            self.image_registry.trim().trim_end_matches('/')
        )
    }
}

fn check_dns_label(field: &str, s: &str, max: usize) -> Result<(), RenderError> {
    match nestplane_api::names::dns_label_problem(s, max) {
        Some(problem) => Err(RenderError::invalid(field, problem)),
        None => Ok(()),
    }
}

fn check_domain(s: &str) -> Result<(), RenderError> {
    if s.is_empty() || s.len() > 253 {
        return Err(RenderError::invalid(
            "cluster_domain",
            format!("{s:?} must have 1 to 253 characters, for example cluster.local"),
        ));
    }
    for label in s.split('.') {
        check_dns_label("cluster_domain", label, 63).map_err(|_| {
            RenderError::invalid(
                "cluster_domain",
                format!(
                    "{s:?} is not a DNS name: every dot-separated part must be a lowercase DNS label, for example cluster.local"
                ),
            )
        })?;
    }
    Ok(())
}

/// The first address of a service CIDR: the ClusterIP of the tenant's `kubernetes` Service
/// (`10.96.0.0/12` → `10.96.0.1`).
pub fn first_service_ip(cidr: &str) -> Result<IpAddr, RenderError> {
    let bad = |reason: String| RenderError::invalid("service_cidr", reason);
    let (addr, prefix) = cidr
        .split_once('/')
        .ok_or_else(|| bad(format!("{cidr:?} is not a CIDR such as 10.96.0.0/12")))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| bad(format!("{addr:?} in {cidr:?} is not an IP address")))?;
    let prefix: u32 = prefix
        .parse()
        .map_err(|_| bad(format!("{prefix:?} in {cidr:?} is not a prefix length")))?;
    match addr {
        IpAddr::V4(a) => {
            if prefix > 30 {
                return Err(bad(format!(
                    "{cidr:?} is too small; an IPv4 service CIDR needs a prefix of at most /30"
                )));
            }
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - prefix)
            };
            Ok(IpAddr::V4(Ipv4Addr::from((u32::from(a) & mask) + 1)))
        }
        IpAddr::V6(a) => {
            if prefix > 126 {
                return Err(bad(format!(
                    "{cidr:?} is too small; an IPv6 service CIDR needs a prefix of at most /126"
                )));
            }
            let mask = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - prefix)
            };
            Ok(IpAddr::V6(Ipv6Addr::from((u128::from(a) & mask) + 1)))
        }
    }
}

/// External etcd client URLs: at least one, each `https://<host>:<port>` with a plain host
/// (a DNS name, an IPv4 address or a bracketed IPv6 address) and a port.
fn check_etcd_urls(urls: &[String]) -> Result<(), RenderError> {
    if urls.is_empty() {
        return Err(RenderError::invalid(
            "etcd addresses",
            "the external etcd reports no addresses",
        ));
    }
    for u in urls {
        let bad = |why: &str| RenderError::invalid("etcd addresses", format!("{u:?}: {why}"));
        let Some(rest) = u.strip_prefix("https://") else {
            return Err(bad("not an https:// URL (etcd is reached with TLS)"));
        };
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err(bad("no port"));
        };
        if port.parse::<u16>().map_or(true, |p| p == 0) {
            return Err(bad("the port is not a number from 1 to 65535"));
        }
        let host_ok = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '[' | ']'));
        if !host_ok {
            return Err(bad("the host is not a DNS name or an IP address"));
        }
    }
    Ok(())
}
