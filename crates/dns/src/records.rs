//! Which records a name has, from Services and Endpoints (Kubernetes DNS-Based Service
//! Discovery). Pure: [`lookup`] reads a [`View`] of the cluster and returns an answer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Endpoints, Service};

/// The version of the specification the answers follow (`dns-version.<zone>` TXT).
pub const SPEC_VERSION: &str = "1.1.0";

/// What the server knows about the cluster.
pub trait View {
    /// The Service `ns/name`.
    fn service(&self, ns: &str, name: &str) -> Option<Arc<Service>>;
    /// The Endpoints `ns/name`.
    fn endpoints(&self, ns: &str, name: &str) -> Option<Arc<Endpoints>>;
    /// Every Service (reverse lookups).
    fn all_services(&self) -> Vec<Arc<Service>>;
    /// Every Endpoints object (reverse lookups).
    fn all_endpoints(&self) -> Vec<Arc<Endpoints>>;
}

/// A query type the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// IPv4 address.
    A,
    /// IPv6 address.
    Aaaa,
    /// Text (`dns-version`).
    Txt,
    /// Pointer (reverse lookups under `in-addr.arpa`).
    Ptr,
    /// Service location (named ports).
    Srv,
    /// Canonical name.
    Cname,
    /// Anything else.
    Other,
}

/// An answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// The name has these addresses.
    Addresses(Vec<IpAddr>),
    /// The name has this text.
    Text(String),
    /// The name points to these names (fully qualified, without the trailing dot).
    Names(Vec<String>),
    /// The name is an alias of this name (an `ExternalName` Service), whatever the type asked.
    Alias(String),
    /// Service locations of a named port.
    Locations(Vec<Location>),
    /// The name exists but has no record of the asked type.
    NoData,
    /// The name is in the zone and does not exist.
    NxDomain,
    /// The name is not in the zone.
    NotInZone,
}

/// One SRV record's data: priority 0, `weight`, `port`, `target` (fully qualified, without
/// the trailing dot).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub weight: u16,
    pub port: u16,
    pub target: String,
}

/// The name of an endpoint within its Service: its hostname, or (without one) its address
/// with dashes (`10-244-1-5`), the system-assigned identifier the specification allows.
fn endpoint_label(hostname: Option<&str>, ip: &str) -> String {
    match hostname {
        Some(h) if !h.is_empty() => h.to_ascii_lowercase(),
        _ => ip.replace(['.', ':'], "-"),
    }
}

/// Lower-case labels of `qname` below `zone` (both without the trailing dot), or `None`
/// when `qname` is not in the zone.
fn labels_below<'a>(qname: &'a str, zone: &str) -> Option<Vec<&'a str>> {
    let q = qname.trim_end_matches('.');
    let zone = zone.trim_end_matches('.');
    if q.len() == zone.len() && q.eq_ignore_ascii_case(zone) {
        return Some(Vec::new());
    }
    let cut = q.len().checked_sub(zone.len() + 1)?;
    if !q.is_char_boundary(cut)
        || &q[cut..cut + 1] != "."
        || !q[cut + 1..].eq_ignore_ascii_case(zone)
    {
        return None;
    }
    Some(q[..cut].split('.').collect())
}

fn addresses(kind: Kind, ips: Vec<IpAddr>) -> Answer {
    let ips: Vec<IpAddr> = ips
        .into_iter()
        .filter(|ip| match kind {
            Kind::A => ip.is_ipv4(),
            Kind::Aaaa => ip.is_ipv6(),
            _ => false,
        })
        .collect();
    if ips.is_empty() {
        Answer::NoData
    } else {
        Answer::Addresses(ips)
    }
}

/// Addresses of the endpoints of `ns/svc`, all of them or only those with `hostname`.
fn endpoint_ips(view: &dyn View, ns: &str, svc: &str, hostname: Option<&str>) -> Vec<IpAddr> {
    let Some(ep) = view.endpoints(ns, svc) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for subset in ep.subsets.iter().flatten() {
        for a in subset.addresses.iter().flatten() {
            if hostname.is_some_and(|h| endpoint_label(a.hostname.as_deref(), &a.ip) != h) {
                continue;
            }
            if let Ok(ip) = a.ip.parse::<IpAddr>()
                && !out.contains(&ip)
            {
                out.push(ip);
            }
        }
    }
    out
}

/// The IPv4 address of a reverse name (`4.3.2.1.in-addr.arpa` → `1.2.3.4`).
fn reverse_v4(qname: &str) -> Option<Ipv4Addr> {
    let labels = labels_below(qname, "in-addr.arpa")?;
    if labels.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (i, l) in labels.iter().rev().enumerate() {
        octets[i] = l.parse().ok()?;
    }
    Some(Ipv4Addr::from(octets))
}

/// Names of `ip` in `zone`: `<svc>.<ns>.svc.<zone>` for a Service's cluster IP,
/// `<hostname>.<svc>.<ns>.svc.<zone>` for a headless endpoint with a hostname.
fn reverse(view: &dyn View, zone: &str, ip: Ipv4Addr) -> Vec<String> {
    let ip_s = ip.to_string();
    let mut out = Vec::new();
    for s in view.all_services() {
        let spec = s.spec.as_ref();
        if spec.and_then(|s| s.cluster_ip.as_deref()) == Some(ip_s.as_str()) {
            out.push(format!(
                "{}.{}.svc.{zone}",
                s.metadata.name.as_deref().unwrap_or_default(),
                s.metadata.namespace.as_deref().unwrap_or_default()
            ));
        }
    }
    for ep in view.all_endpoints() {
        for subset in ep.subsets.iter().flatten() {
            for a in subset.addresses.iter().flatten() {
                if a.ip == ip_s
                    && let Some(h) = &a.hostname
                {
                    out.push(format!(
                        "{h}.{}.{}.svc.{zone}",
                        ep.metadata.name.as_deref().unwrap_or_default(),
                        ep.metadata.namespace.as_deref().unwrap_or_default()
                    ));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Answer `qname` (`kind`) in `zone` from `view`.
pub fn lookup(view: &dyn View, zone: &str, qname: &str, kind: Kind) -> Answer {
    if let Some(ip) = reverse_v4(qname) {
        let names = reverse(view, zone.trim_end_matches('.'), ip);
        return match (names.is_empty(), kind) {
            (true, _) => Answer::NotInZone,
            (false, Kind::Ptr) => Answer::Names(names),
            (false, _) => Answer::NoData,
        };
    }
    let Some(labels) = labels_below(qname, zone) else {
        return Answer::NotInZone;
    };
    let labels: Vec<String> = labels.iter().map(|l| l.to_ascii_lowercase()).collect();
    let l: Vec<&str> = labels.iter().map(String::as_str).collect();
    match l.as_slice() {
        // The zone itself, `svc.<zone>`, `<ns>.svc.<zone>`, `pod.<zone>`: names without
        // records of their own.
        [] | ["svc"] | [_, "svc"] | ["pod"] | [_, "pod"] => Answer::NoData,
        ["dns-version"] => match kind {
            Kind::Txt => Answer::Text(SPEC_VERSION.into()),
            _ => Answer::NoData,
        },
        [svc, ns, "svc"] => {
            let Some(s) = view.service(ns, svc) else {
                return Answer::NxDomain;
            };
            let spec = s.spec.clone().unwrap_or_default();
            if spec.type_.as_deref() == Some("ExternalName") {
                return match spec.external_name.as_deref() {
                    Some(n) if !n.is_empty() => {
                        Answer::Alias(n.trim_end_matches('.').to_ascii_lowercase())
                    }
                    _ => Answer::NoData,
                };
            }
            let ips = match spec.cluster_ip.as_deref() {
                Some(ip) if ip != "None" && !ip.is_empty() => {
                    ip.parse::<IpAddr>().into_iter().collect()
                }
                _ => endpoint_ips(view, ns, svc, None),
            };
            addresses(kind, ips)
        }
        [host, svc, ns, "svc"] => {
            if view.service(ns, svc).is_none() {
                return Answer::NxDomain;
            }
            let ips = endpoint_ips(view, ns, svc, Some(host));
            if ips.is_empty() {
                Answer::NxDomain
            } else {
                addresses(kind, ips)
            }
        }
        [port, proto, svc, ns, "svc"] if port.starts_with('_') && proto.starts_with('_') => {
            locations(view, zone, &port[1..], &proto[1..], ns, svc, kind)
        }
        [ip, _ns, "pod"] => {
            if let Ok(v4) = ip.replace('-', ".").parse::<Ipv4Addr>() {
                addresses(kind, vec![IpAddr::V4(v4)])
            } else if let Ok(v6) = ip.replace('-', ":").parse::<Ipv6Addr>() {
                addresses(kind, vec![IpAddr::V6(v6)])
            } else {
                Answer::NxDomain
            }
        }
        _ => Answer::NxDomain,
    }
}

/// `_<port>._<proto>.<svc>.<ns>.svc.<zone>`: for a Service with a cluster IP, one location
/// (the Service's name and port); for a headless Service, one per ready endpoint that has the
/// port (the endpoint's name and its port).
fn locations(
    view: &dyn View,
    zone: &str,
    port: &str,
    proto: &str,
    ns: &str,
    svc: &str,
    kind: Kind,
) -> Answer {
    let zone = zone.trim_end_matches('.');
    let Some(s) = view.service(ns, svc) else {
        return Answer::NxDomain;
    };
    let spec = s.spec.clone().unwrap_or_default();
    let matches = |name: Option<&str>, protocol: Option<&str>| {
        name.is_some_and(|n| n.eq_ignore_ascii_case(port))
            && protocol.unwrap_or("TCP").eq_ignore_ascii_case(proto)
    };
    let Some(service_port) = spec
        .ports
        .iter()
        .flatten()
        .find(|p| matches(p.name.as_deref(), p.protocol.as_deref()))
    else {
        return Answer::NxDomain;
    };
    let headless = matches!(spec.cluster_ip.as_deref(), None | Some("None") | Some(""));
    let mut found = Vec::new();
    if !headless {
        found.push(Location {
            weight: 100,
            port: u16::try_from(service_port.port).unwrap_or_default(),
            target: format!("{svc}.{ns}.svc.{zone}"),
        });
    } else if let Some(ep) = view.endpoints(ns, svc) {
        for subset in ep.subsets.iter().flatten() {
            let Some(p) = subset
                .ports
                .iter()
                .flatten()
                .find(|p| matches(p.name.as_deref(), p.protocol.as_deref()))
            else {
                continue;
            };
            for a in subset.addresses.iter().flatten() {
                found.push(Location {
                    weight: 0,
                    port: u16::try_from(p.port).unwrap_or_default(),
                    target: format!(
                        "{}.{svc}.{ns}.svc.{zone}",
                        endpoint_label(a.hostname.as_deref(), &a.ip)
                    ),
                });
            }
        }
        let n = found.len().max(1) as u16;
        for l in &mut found {
            l.weight = (100 / n).max(1);
        }
    }
    match (kind, found.is_empty()) {
        (Kind::Srv, false) => Answer::Locations(found),
        _ => Answer::NoData,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[derive(Default)]
    struct Fake {
        services: BTreeMap<(String, String), Arc<Service>>,
        endpoints: BTreeMap<(String, String), Arc<Endpoints>>,
    }

    impl View for Fake {
        fn service(&self, ns: &str, name: &str) -> Option<Arc<Service>> {
            self.services.get(&(ns.into(), name.into())).cloned()
        }
        fn endpoints(&self, ns: &str, name: &str) -> Option<Arc<Endpoints>> {
            self.endpoints.get(&(ns.into(), name.into())).cloned()
        }
        fn all_services(&self) -> Vec<Arc<Service>> {
            self.services.values().cloned().collect()
        }
        fn all_endpoints(&self) -> Vec<Arc<Endpoints>> {
            self.endpoints.values().cloned().collect()
        }
    }

    fn view() -> Fake {
        let mut v = Fake::default();
        let svc = |ns: &str, name: &str, ip: &str| -> Arc<Service> {
            Arc::new(
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"clusterIP": ip}}))
                .expect("service"),
            )
        };
        v.services.insert(
            ("default".into(), "web".into()),
            svc("default", "web", "10.96.0.20"),
        );
        v.services.insert(
            ("t1".into(), "etcd-peer".into()),
            svc("t1", "etcd-peer", "None"),
        );
        v.endpoints.insert(
            ("t1".into(), "etcd-peer".into()),
            Arc::new(
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": "etcd-peer", "namespace": "t1"},
                    "subsets": [{"addresses": [
                    {"ip": "10.244.1.5", "hostname": "etcd-0"},
                    {"ip": "10.244.1.6", "hostname": "etcd-1"}
                ]}]}))
                .expect("endpoints"),
            ),
        );
        v
    }

    fn with_ports_and_an_alias(mut v: Fake) -> Fake {
        fn obj<T: k8s_openapi::serde::de::DeserializeOwned>(j: serde_json::Value) -> T {
            serde_json::from_value(j).expect("object")
        }
        v.services.insert(
            ("default".into(), "web".into()),
            Arc::new(obj(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"clusterIP": "10.96.0.20", "ports": [
                {"name": "http", "port": 80, "protocol": "TCP"},
                {"name": "dns", "port": 53, "protocol": "UDP"}
            ]}}))),
        );
        v.services.insert(
            ("default".into(), "db".into()),
            Arc::new(obj(serde_json::json!({
                "metadata": {"name": "db", "namespace": "default"},
                "spec": {"clusterIP": "None", "ports": [{"name": "pg", "port": 5432}]}}))),
        );
        v.endpoints.insert(
            ("default".into(), "db".into()),
            Arc::new(obj(serde_json::json!({
            "metadata": {"name": "db", "namespace": "default"},
            "subsets": [{
                "addresses": [{"ip": "10.244.2.7", "hostname": "db-0"}, {"ip": "10.244.2.8"}],
                "notReadyAddresses": [{"ip": "10.244.2.9"}],
                "ports": [{"name": "pg", "port": 15432, "protocol": "TCP"}]
            }]}))),
        );
        v.services.insert(
            ("default".into(), "search".into()),
            Arc::new(obj(serde_json::json!({
                "metadata": {"name": "search", "namespace": "default"},
                "spec": {"type": "ExternalName", "externalName": "Search.Example.Test."}}))),
        );
        v
    }

    #[test]
    fn named_ports_have_service_locations() {
        let v = with_ports_and_an_alias(view());
        let srv = |q: &str| lookup(&v, "cluster.local", q, Kind::Srv);
        assert_eq!(
            srv("_http._tcp.web.default.svc.cluster.local"),
            Answer::Locations(vec![Location {
                weight: 100,
                port: 80,
                target: "web.default.svc.cluster.local".into()
            }])
        );
        assert_eq!(
            srv("_dns._udp.web.default.svc.cluster.local"),
            Answer::Locations(vec![Location {
                weight: 100,
                port: 53,
                target: "web.default.svc.cluster.local".into()
            }])
        );
        // Headless: one per ready endpoint, with the endpoint's port; an endpoint without a
        // hostname is named by its address, and that name resolves.
        assert_eq!(
            srv("_pg._tcp.db.default.svc.cluster.local"),
            Answer::Locations(vec![
                Location {
                    weight: 50,
                    port: 15432,
                    target: "db-0.db.default.svc.cluster.local".into()
                },
                Location {
                    weight: 50,
                    port: 15432,
                    target: "10-244-2-8.db.default.svc.cluster.local".into()
                },
            ])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "10-244-2-8.db.default.svc.cluster.local",
                Kind::A
            ),
            a(&["10.244.2.8"])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "10-244-2-9.db.default.svc.cluster.local",
                Kind::A
            ),
            Answer::NxDomain,
            "not ready"
        );
        // A port that is not there, the wrong protocol, or the wrong type.
        assert_eq!(
            srv("_https._tcp.web.default.svc.cluster.local"),
            Answer::NxDomain
        );
        assert_eq!(
            srv("_http._udp.web.default.svc.cluster.local"),
            Answer::NxDomain
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "_http._tcp.web.default.svc.cluster.local",
                Kind::A
            ),
            Answer::NoData
        );
    }

    #[test]
    fn external_names_are_aliases() {
        let v = with_ports_and_an_alias(view());
        for kind in [Kind::A, Kind::Aaaa, Kind::Cname, Kind::Srv] {
            assert_eq!(
                lookup(
                    &v,
                    "cluster.local",
                    "search.default.svc.cluster.local",
                    kind
                ),
                Answer::Alias("search.example.test".into())
            );
        }
    }

    fn a(ips: &[&str]) -> Answer {
        Answer::Addresses(ips.iter().map(|i| i.parse().expect("ip")).collect())
    }

    #[test]
    fn cluster_ip_services_resolve_to_their_cluster_ip() {
        let v = view();
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "web.default.svc.cluster.local.",
                Kind::A
            ),
            a(&["10.96.0.20"])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "WEB.Default.svc.cluster.local",
                Kind::A
            ),
            a(&["10.96.0.20"])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "web.default.svc.cluster.local",
                Kind::Aaaa
            ),
            Answer::NoData
        );
    }

    #[test]
    fn headless_services_resolve_to_endpoints_and_their_hostnames() {
        let v = view();
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "etcd-peer.t1.svc.cluster.local",
                Kind::A
            ),
            a(&["10.244.1.5", "10.244.1.6"])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "etcd-1.etcd-peer.t1.svc.cluster.local",
                Kind::A
            ),
            a(&["10.244.1.6"])
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "etcd-9.etcd-peer.t1.svc.cluster.local",
                Kind::A
            ),
            Answer::NxDomain
        );
    }

    #[test]
    fn missing_names_in_the_zone_do_not_exist_and_others_are_not_ours() {
        let v = view();
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "nope.default.svc.cluster.local",
                Kind::A
            ),
            Answer::NxDomain
        );
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "web.default.svc.default.svc.cluster.local",
                Kind::A
            ),
            Answer::NxDomain
        );
        assert_eq!(
            lookup(&v, "cluster.local", "default.svc.cluster.local", Kind::A),
            Answer::NoData
        );
        assert_eq!(
            lookup(&v, "cluster.local", "example.org", Kind::A),
            Answer::NotInZone
        );
        assert_eq!(
            lookup(&v, "cluster.local", "xcluster.local", Kind::A),
            Answer::NotInZone
        );
    }

    #[test]
    fn reverse_lookups_name_services_and_headless_endpoints() {
        let v = view();
        assert_eq!(
            lookup(&v, "cluster.local", "6.1.244.10.in-addr.arpa.", Kind::Ptr),
            Answer::Names(vec!["etcd-1.etcd-peer.t1.svc.cluster.local".into()])
        );
        assert_eq!(
            lookup(&v, "cluster.local", "20.0.96.10.in-addr.arpa", Kind::Ptr),
            Answer::Names(vec!["web.default.svc.cluster.local".into()])
        );
        assert_eq!(
            lookup(&v, "cluster.local", "9.9.9.9.in-addr.arpa", Kind::Ptr),
            Answer::NotInZone
        );
    }

    #[test]
    fn pod_names_and_the_version_record() {
        let v = view();
        assert_eq!(
            lookup(
                &v,
                "cluster.local",
                "10-244-1-7.t1.pod.cluster.local",
                Kind::A
            ),
            a(&["10.244.1.7"])
        );
        assert_eq!(
            lookup(&v, "cluster.local", "dns-version.cluster.local", Kind::Txt),
            Answer::Text("1.1.0".into())
        );
    }
}
