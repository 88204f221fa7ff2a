//! The pure core of hosted clusters: validation, pause, version skew, the names of what a
//! HostedCluster makes, and how a NodePool rolls its nodes. No IO.

use ipnet::Ipv4Net;
use std::net::Ipv4Addr;

use k8s_openapi::jiff::Timestamp;
use nestplane_api::hosted::{
    ClusterNetworking, DnsProvider, HostedCluster, HostedClusterSpec, NetworkEntry, POD_NETWORK,
    SERVICE_NETWORK,
};
use nestplane_render::KubeVersion;

/// A version with its `v`.
pub fn version(v: &str) -> String {
    let v = v.trim();
    if v.starts_with('v') {
        v.to_string()
    } else {
        format!("v{v}")
    }
}

/// An IPv4 CIDR (on `ipnet`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr(Ipv4Net);

impl Cidr {
    /// Parse `a.b.c.d/n` (the address must be the network's first).
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let net: Ipv4Net = s
            .parse()
            .map_err(|_| format!("{s:?} is not an IPv4 CIDR (a.b.c.d/n, the prefix 0-32)"))?;
        if net != net.trunc() {
            return Err(format!(
                "{s:?}: host bits are set (the network is {})",
                net.trunc()
            ));
        }
        Ok(Cidr(net))
    }

    /// The `n`th address of the network (`None` past its end).
    pub fn nth(&self, n: u32) -> Option<Ipv4Addr> {
        let size = 1u64 << (32 - u32::from(self.0.prefix_len()));
        (u64::from(n) < size).then(|| Ipv4Addr::from(u32::from(self.0.network()).wrapping_add(n)))
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.0.prefix_len()
    }

    /// Whether two networks share an address.
    pub fn overlaps(&self, other: &Cidr) -> bool {
        self.0.contains(&other.0.network()) || other.0.contains(&self.0.network())
    }
}

/// The networking a HostedCluster asks for, defaults filled in.
pub fn networking(spec: &HostedClusterSpec) -> ClusterNetworking {
    let mut n = spec.networking.clone();
    if n.cluster_network.is_empty() {
        n.cluster_network = vec![NetworkEntry {
            cidr: POD_NETWORK.into(),
        }];
    }
    if n.service_network.is_empty() {
        n.service_network = vec![NetworkEntry {
            cidr: SERVICE_NETWORK.into(),
        }];
    }
    n
}

/// The cluster DNS Service's address: the tenth address of the service network (the
/// convention kubeadm and every installer follow).
pub fn dns_service_ip(networking: &ClusterNetworking) -> Result<Ipv4Addr, String> {
    let cidr = networking
        .service_network
        .first()
        .map(|e| e.cidr.as_str())
        .unwrap_or(SERVICE_NETWORK);
    Cidr::parse(cidr)?
        .nth(10)
        .ok_or_else(|| format!("the service network {cidr} has no tenth address"))
}

/// The cluster DNS of a HostedCluster: what its spec asks for, else the operator's default,
/// else `Builtin` where nodes are made on this machine (they cannot pull images) and
/// `CoreDNS` elsewhere.
pub fn dns_provider(
    spec: &HostedClusterSpec,
    operator_default: Option<DnsProvider>,
    nodes_made_here: bool,
) -> DnsProvider {
    spec.dns
        .as_ref()
        .and_then(|d| d.provider)
        .or(operator_default)
        .unwrap_or(if nodes_made_here {
            DnsProvider::Builtin
        } else {
            DnsProvider::CoreDns
        })
}

/// The publishing types nestplane knows for the API server.
pub const PUBLISHING_TYPES: [&str; 3] = ["ClusterIP", "NodePort", "LoadBalancer"];

/// Check a HostedCluster's spec; the message says what to fix.
pub fn validate(spec: &HostedClusterSpec) -> Result<(), String> {
    KubeVersion::parse(&version(&spec.release.version))
        .and_then(|v| v.check_supported().map(|_| v))
        .map_err(|e| format!("release.version {:?}: {e}", spec.release.version))?;
    let n = networking(spec);
    if n.cluster_network.len() != 1 || n.service_network.len() != 1 {
        return Err("networking: one clusterNetwork and one serviceNetwork entry (IPv4)".into());
    }
    let pods = Cidr::parse(&n.cluster_network[0].cidr)
        .map_err(|e| format!("networking.clusterNetwork: {e}"))?;
    let services = Cidr::parse(&n.service_network[0].cidr)
        .map_err(|e| format!("networking.serviceNetwork: {e}"))?;
    if pods.overlaps(&services) {
        return Err(format!(
            "networking: clusterNetwork {} and serviceNetwork {} overlap",
            n.cluster_network[0].cidr, n.service_network[0].cidr
        ));
    }
    if pods != Cidr::parse(POD_NETWORK)? {
        return Err(format!(
            "networking.clusterNetwork must be {POD_NETWORK}: nestplane's nodes on this machine take their pod ranges from it"
        ));
    }
    if !(12..=24).contains(&services.prefix_len()) {
        return Err(format!(
            "networking.serviceNetwork {}: the prefix must be from /12 to /24",
            n.service_network[0].cidr
        ));
    }
    for s in &spec.services {
        if s.service != "APIServer" {
            return Err(format!(
                "services: {:?} is not a service nestplane publishes (APIServer)",
                s.service
            ));
        }
        let t = &s.service_publishing_strategy.type_;
        if !PUBLISHING_TYPES.contains(&t.as_str()) {
            return Err(format!(
                "services[APIServer]: type {t:?} is not one of {}",
                PUBLISHING_TYPES.join(", ")
            ));
        }
    }
    if let Some(t) = spec
        .etcd
        .as_ref()
        .and_then(|e| e.management_type.as_deref())
        && !t.is_empty()
        && t != "Managed"
    {
        return Err(format!(
            "etcd.managementType {t:?}: only Managed is offered"
        ));
    }
    Ok(())
}

/// Whether `paused_until` pauses now: `Some(None)` paused with no end, `Some(Some(t))`
/// paused until `t`, `None` not paused (an unparsable value is an error).
pub fn paused(
    paused_until: Option<&str>,
    now: Timestamp,
) -> Result<Option<Option<Timestamp>>, String> {
    let Some(v) = paused_until.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    if v == "true" {
        return Ok(Some(None));
    }
    let t: Timestamp = v
        .parse()
        .map_err(|e| format!("pausedUntil {v:?} is neither \"true\" nor an RFC 3339 time: {e}"))?;
    Ok((t > now).then_some(Some(t)))
}

/// Whether a pool's version is allowed with its control plane's: not newer (not even by a
/// patch), and within Kubernetes' kubelet skew policy
/// ([`nestplane_render::upgrade::skew`]: at most three minors older, two below 1.25).
pub fn version_skew(pool: &str, control_plane: &str) -> Result<(), String> {
    let p =
        KubeVersion::parse(&version(pool)).map_err(|e| format!("release.version {pool:?}: {e}"))?;
    let c = KubeVersion::parse(&version(control_plane))
        .map_err(|e| format!("the control plane's version {control_plane:?}: {e}"))?;
    if p > c {
        return Err(format!(
            "the pool's version {} is newer than its control plane's {}",
            version(pool),
            version(control_plane)
        ));
    }
    nestplane_render::upgrade::skew(nestplane_render::upgrade::Part::Kubelet, p, c)
        .map_err(|e| format!("the pool's version does not fit its control plane's: {e}"))
}

/// The first pool that a control plane at `asked` would leave outside the kubelet skew
/// policy, said for a person: its nodes run `(name, version)`, the version its last rollout
/// reached (else the one it is pinned to; a pool with neither has no nodes to break).
/// Such a change is held before the control plane takes a step of it.
pub fn pool_blocking(asked: &str, pools: &[(String, Option<String>)]) -> Option<String> {
    pools.iter().find_map(|(name, running)| {
        let running = running.as_deref()?;
        version_skew(running, asked).err().map(|why| {
            format!(
                "NodePool {name} runs {}, and a control plane at {} would leave it behind ({why}): upgrade the pool first, or ask for a version it fits",
                version(running),
                version(asked)
            )
        })
    })
}

/// The newest version the control plane has reached (its newest `Completed` history entry).
pub fn reached_version(hc: &HostedCluster) -> Option<String> {
    hc.status
        .as_ref()?
        .version
        .as_ref()?
        .history
        .iter()
        .find(|h| h.state == "Completed")
        .map(|h| version(&h.version))
}

/// Whether a pool's nodes may be made at `version` now: not while the control plane has only
/// been asked for a version and not reached it, so that kubelets are never replaced before
/// the API server they must not outrun (`reached`: [`reached_version`]; `None` before the
/// control plane reached any, when no node exists yet and the pool waits for it anyway).
/// Meanwhile nodes are made at the reached version.
pub fn nodes_may_move(version: &str, reached: Option<&str>) -> Result<(), String> {
    let Some(reached) = reached else {
        return Ok(());
    };
    version_skew(version, reached).map_err(|why| {
        format!(
            "waiting for the control plane to reach {}: it runs {reached} ({why})",
            self::version(version)
        )
    })
}

/// A node of a pool, as the rollout sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The Node's name.
    pub name: String,
    /// Built from the current spec.
    pub current: bool,
    /// Ready.
    pub ready: bool,
}

/// What to do next with a pool's nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Actions {
    /// Nodes to start.
    pub create: u32,
    /// Nodes to drain and remove, in order.
    pub remove: Vec<String>,
}

/// The next step towards `replicas` current nodes, replacing outdated ones within
/// `max_surge` (nodes above `replicas`) and `max_unavailable` (Ready nodes below
/// `replicas`). With both 0, one node of surge is allowed (a rollout must move).
/// Scale-down removes nodes that are not Ready first, then the newest.
pub fn rollout(replicas: u32, max_surge: u32, max_unavailable: u32, nodes: &[Member]) -> Actions {
    let max_surge = if max_surge == 0 && max_unavailable == 0 {
        1
    } else {
        max_surge
    };
    let (new, old): (Vec<&Member>, Vec<&Member>) = nodes.iter().partition(|m| m.current);
    let mut out = Actions::default();
    if old.is_empty() {
        let n = new.len() as u32;
        if n < replicas {
            out.create = replicas - n;
        } else if n > replicas {
            let mut order: Vec<&Member> = new.iter().filter(|m| !m.ready).copied().collect();
            order.extend(new.iter().rev().filter(|m| m.ready));
            out.remove = order
                .into_iter()
                .take((n - replicas) as usize)
                .map(|m| m.name.clone())
                .collect();
        }
        return out;
    }
    // Rolling: more current nodes while the total stays within the surge …
    let total = nodes.len() as u32;
    let room = (replicas + max_surge).saturating_sub(total);
    out.create = room.min(replicas.saturating_sub(new.len() as u32));
    // … and fewer outdated ones while enough nodes stay Ready (outdated nodes that are not
    // Ready count for nothing and go first).
    let min_ready = replicas.saturating_sub(max_unavailable);
    let mut ready = nodes.iter().filter(|m| m.ready).count() as u32;
    out.remove
        .extend(old.iter().filter(|m| !m.ready).map(|m| m.name.clone()));
    for m in old.iter().filter(|m| m.ready) {
        if ready <= min_ready {
            break;
        }
        out.remove.push(m.name.clone());
        ready -= 1;
    }
    out
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;

/// The signer of kubelet client certificates.
pub const KUBELET_CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The signer of kubelet serving certificates.
pub const KUBELET_SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";

/// Whether a kubelet serving certificate request may be approved for `node`, whose address is
/// `ip`: it must come from that node's own credential (`requester`), name that node and
/// `system:nodes`, ask only for that node's name and address, and only for serving. Anything
/// else stays pending (the reason says why).
pub fn judge_serving_request(
    requester: &str,
    usages: &[String],
    info: &nestplane_pki::CsrInfo,
    node: &str,
    ip: Ipv4Addr,
) -> Result<(), String> {
    let me = format!("system:node:{node}");
    if requester != me {
        return Err(format!("requested by {requester}, not by {me}"));
    }
    if info.common_name != me || info.organizations != ["system:nodes"] {
        return Err(format!(
            "asks for {} in {:?}, not {me} in system:nodes",
            info.common_name, info.organizations
        ));
    }
    if info.dns_names.is_empty() && info.ips.is_empty() {
        return Err("names no address".into());
    }
    if let Some(d) = info.dns_names.iter().find(|d| *d != node) {
        return Err(format!("asks for the name {d}"));
    }
    if let Some(a) = info.ips.iter().find(|a| **a != std::net::IpAddr::V4(ip)) {
        return Err(format!("asks for the address {a}"));
    }
    if let Some(o) = info.other_names.first() {
        return Err(format!("asks for {o}"));
    }
    let allowed = ["digital signature", "key encipherment", "server auth"];
    if let Some(u) = usages.iter().find(|u| !allowed.contains(&u.as_str())) {
        return Err(format!("asks for the usage {u}"));
    }
    if !usages.iter().any(|u| u == "server auth") {
        return Err("does not ask for server auth".into());
    }
    Ok(())
}
