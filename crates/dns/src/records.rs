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
    /// The name exists but has no record of the asked type.
    NoData,
    /// The name is in the zone and does not exist.
    NxDomain,
    /// The name is not in the zone.
    NotInZone,
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
            if hostname.is_some_and(|h| a.hostname.as_deref() != Some(h)) {
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
                // CNAMEs come with the full server (issue: cluster DNS); no address here.
                return Answer::NoData;
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
