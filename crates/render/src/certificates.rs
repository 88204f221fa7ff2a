//! Which certificates and kubeconfigs a component needs, as data (pure). The operator walks
//! the plan in order: CAs first (created once, never regenerated), then leaves and kubeconfigs
//! signed by them (reissued when half their life is gone, their SANs change or their CA
//! changed).

use std::net::IpAddr;

use nestplane_api::names::{Component, SecretPurpose, ports};
use nestplane_pki::{LeafSpec, Usage};

use crate::{RenderInput, Sans};

/// One thing to keep current.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Issue {
    /// A CA (or the service-account key pair): created when missing, never replaced.
    Ca(SecretPurpose),
    /// A leaf certificate signed by `ca`.
    Leaf {
        /// Which secret.
        purpose: SecretPurpose,
        /// Which CA signs it.
        ca: SecretPurpose,
        /// Subject, SANs, usage.
        spec: LeafSpec,
    },
    /// A kubeconfig with a client certificate signed by the cluster CA.
    Kubeconfig {
        /// Which secret.
        purpose: SecretPurpose,
        /// The API server URL.
        server: String,
        /// The name the server is asked for there (`tls-server-name`): a shared gateway's.
        server_name: Option<String>,
        /// Client certificate subject.
        user: String,
        /// Client certificate organizations (groups).
        groups: Vec<String>,
    },
}

/// The certificates of one component, and which CA verifies its health endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// In order: every CA before what it signs.
    pub items: Vec<Issue>,
    /// The CA that verifies the component's HTTPS health endpoint (`None`: etcd's health is
    /// served over plain HTTP on its metrics port).
    pub health_ca: Option<SecretPurpose>,
}

/// Whether `c` picks up renewed certificates from its files without a restart. etcd reads its
/// serving, peer and client certificates on every TLS handshake; kube-apiserver re-reads its
/// serving certificate and client CA files once a minute (1.20 polls them), and its etcd
/// client (etcd's transport) reads its certificate on every new connection. kube-controller-manager and kube-scheduler load their
/// kubeconfig's client certificate once, so they are restarted (one replica at a time).
pub fn reloads_certificates(c: Component) -> bool {
    matches!(c, Component::Etcd | Component::ApiServer)
}

/// The secrets a component that [reloads its certificates](reloads_certificates) still reads
/// only when it starts: the API server's service-account keys (`--service-account-key-file`,
/// `--service-account-signing-key-file`). A change of one restarts it, one replica at a time
/// (a rotation of the key).
pub fn read_at_start(c: Component) -> &'static [SecretPurpose] {
    match c {
        Component::ApiServer => &[SecretPurpose::ServiceAccount],
        _ => &[],
    }
}

fn leaf(cn: &str, orgs: &[&str], sans: Sans, usage: Usage) -> LeafSpec {
    LeafSpec {
        common_name: cn.into(),
        organizations: orgs.iter().map(|s| s.to_string()).collect(),
        dns_names: sans.dns,
        ips: sans.ips,
        usage,
    }
}

/// Where the admin kubeconfig points: the control plane's `spec.controlPlaneEndpoint`, and the
/// name the tenant is served under there when that address is shared by tenants (a gateway
/// that routes by server name; it must be among the API server's SANs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint<'a> {
    /// Host or address.
    pub host: &'a str,
    /// Port.
    pub port: i32,
    /// The kubeconfig's `tls-server-name`.
    pub server_name: Option<&'a str>,
}

/// The plan for component `c`. `hosts` are the addresses the API server is reached at (the
/// first is the endpoint; the others are added to its SANs); `endpoint` is the control plane's
/// `spec.controlPlaneEndpoint` when set (the admin kubeconfig points there).
pub fn plan(
    c: Component,
    input: &RenderInput,
    hosts: &[String],
    endpoint: Option<Endpoint<'_>>,
) -> Plan {
    match c {
        Component::Etcd => etcd_plan(input),
        Component::ApiServer => apiserver_plan(input, hosts, endpoint),
        Component::ControllerManager | Component::Scheduler => client_component_plan(c, input),
    }
}

/// etcd: its CA, a server and a peer certificate.
fn etcd_plan(input: &RenderInput) -> Plan {
    let cluster = &input.cluster;
    let sans = crate::etcd_sans(input);
    Plan {
        items: vec![
            Issue::Ca(SecretPurpose::EtcdCa),
            Issue::Leaf {
                purpose: SecretPurpose::EtcdServer,
                ca: SecretPurpose::EtcdCa,
                spec: leaf(
                    &format!("{cluster}-etcd"),
                    &[],
                    sans.clone(),
                    Usage::ServerAndClient,
                ),
            },
            Issue::Leaf {
                purpose: SecretPurpose::EtcdPeer,
                ca: SecretPurpose::EtcdCa,
                spec: leaf(
                    &format!("{cluster}-etcd-peer"),
                    &[],
                    sans,
                    Usage::ServerAndClient,
                ),
            },
        ],
        health_ca: None,
    }
}

/// The API server's serving SANs: its own, and every address it is reached at.
fn apiserver_serving_sans(input: &RenderInput, hosts: &[String]) -> Sans {
    let mut sans = crate::apiserver_sans(input, hosts.first().map(String::as_str));
    for h in hosts.iter().skip(1) {
        match h.parse::<IpAddr>() {
            Ok(ip) if !sans.ips.contains(&ip) => sans.ips.push(ip),
            Ok(_) => {}
            Err(_) if !sans.dns.contains(h) => sans.dns.push(h.clone()),
            Err(_) => {}
        }
    }
    sans
}

/// The API server: every CA, its serving certificate, its clients of etcd and kubelets, the
/// front proxy's client, and the admin kubeconfig (pointing at the endpoint when set). On a
/// shared datastore the etcd CA (its certificate only) and the client certificate of the
/// tenant's etcd user are issued from the datastore's CA, whose key stays in the datastore's
/// namespace: they are not in the plan.
fn apiserver_plan(input: &RenderInput, hosts: &[String], endpoint: Option<Endpoint<'_>>) -> Plan {
    let none = Sans::default;
    let endpoint = endpoint.filter(|e| !e.host.is_empty());
    // An IPv6 address in brackets.
    let url = |host: &str, port: i32| match host.parse::<std::net::Ipv6Addr>() {
        Ok(v6) => format!("https://[{v6}]:{port}"),
        Err(_) => format!("https://{host}:{port}"),
    };
    let server = match (hosts.first(), endpoint) {
        (_, Some(e)) => url(e.host, e.port),
        (Some(h), _) => url(h, ports::APISERVER),
        _ => crate::apiserver_internal_url(input),
    };
    let server_name = endpoint.and_then(|e| e.server_name).map(str::to_string);
    let client = |cn: &str, orgs: &[&str]| leaf(cn, orgs, none(), Usage::Client);
    let mut plan = Plan {
        items: vec![
            Issue::Ca(SecretPurpose::ClusterCa),
            Issue::Ca(SecretPurpose::EtcdCa),
            Issue::Ca(SecretPurpose::FrontProxyCa),
            Issue::Ca(SecretPurpose::ServiceAccount),
            Issue::Leaf {
                purpose: SecretPurpose::ApiServer,
                ca: SecretPurpose::ClusterCa,
                spec: leaf(
                    "kube-apiserver",
                    &[],
                    apiserver_serving_sans(input, hosts),
                    Usage::Server,
                ),
            },
            Issue::Leaf {
                purpose: SecretPurpose::ApiServerEtcdClient,
                ca: SecretPurpose::EtcdCa,
                spec: client("kube-apiserver-etcd-client", &["system:masters"]),
            },
            Issue::Leaf {
                purpose: SecretPurpose::ApiServerKubeletClient,
                ca: SecretPurpose::ClusterCa,
                spec: client("kube-apiserver-kubelet-client", &["system:masters"]),
            },
            Issue::Leaf {
                purpose: SecretPurpose::FrontProxyClient,
                ca: SecretPurpose::FrontProxyCa,
                spec: client("front-proxy-client", &[]),
            },
            Issue::Kubeconfig {
                purpose: SecretPurpose::AdminKubeconfig,
                server,
                server_name,
                user: "kubernetes-admin".into(),
                groups: vec!["system:masters".into()],
            },
        ],
        health_ca: Some(SecretPurpose::ClusterCa),
    };
    if input.datastore_prefix.is_some() {
        plan.items.retain(|i| {
            !matches!(
                i,
                Issue::Ca(SecretPurpose::EtcdCa)
                    | Issue::Leaf {
                        purpose: SecretPurpose::ApiServerEtcdClient,
                        ..
                    }
            )
        });
    }
    plan
}

/// The controller-manager or the scheduler: a kubeconfig for its user and a serving
/// certificate.
fn client_component_plan(c: Component, input: &RenderInput) -> Plan {
    let (kubeconfig, serving, user, sans) = if c == Component::ControllerManager {
        (
            SecretPurpose::ControllerManagerKubeconfig,
            SecretPurpose::ControllerManagerServing,
            "system:kube-controller-manager",
            crate::controller_manager_sans(input),
        )
    } else {
        (
            SecretPurpose::SchedulerKubeconfig,
            SecretPurpose::SchedulerServing,
            "system:kube-scheduler",
            crate::scheduler_sans(input),
        )
    };
    Plan {
        items: vec![
            Issue::Ca(SecretPurpose::ClusterCa),
            Issue::Kubeconfig {
                purpose: kubeconfig,
                server: crate::apiserver_internal_url(input),
                server_name: None,
                user: user.into(),
                groups: vec![],
            },
            Issue::Leaf {
                purpose: serving,
                ca: SecretPurpose::ClusterCa,
                spec: leaf(user, &[], sans, Usage::Server),
            },
        ],
        health_ca: Some(SecretPurpose::ClusterCa),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{KubeVersion, Network};
    use std::net::Ipv4Addr;

    fn input() -> RenderInput {
        RenderInput::new(
            "demo",
            "default",
            KubeVersion::new(1, 20, 2),
            Network::Loopback {
                hosts: vec![Ipv4Addr::new(127, 9, 9, 1), Ipv4Addr::new(127, 9, 9, 2)],
            },
        )
    }

    #[test]
    fn a_tenant_on_a_shared_datastore_issues_no_etcd_credentials_of_its_own() {
        let mut on_datastore = input();
        on_datastore.external_etcd = Some(vec!["https://127.9.8.1:2379".into()]);
        on_datastore.datastore_prefix = Some("/nestplane/default/demo/".into());
        let own = plan(Component::ApiServer, &input(), &["127.9.9.1".into()], None);
        let shared = plan(
            Component::ApiServer,
            &on_datastore,
            &["127.9.9.1".into()],
            None,
        );
        let etcd_items = |p: &Plan| {
            p.items
                .iter()
                .filter(|i| {
                    matches!(
                        i,
                        Issue::Ca(SecretPurpose::EtcdCa)
                            | Issue::Leaf {
                                ca: SecretPurpose::EtcdCa,
                                ..
                            }
                    )
                })
                .count()
        };
        assert_eq!(etcd_items(&own), 2);
        assert_eq!(etcd_items(&shared), 0);
        assert_eq!(shared.items.len(), own.items.len() - 2);
    }

    #[test]
    fn every_ca_comes_before_what_it_signs() {
        for c in Component::ALL {
            let p = plan(c, &input(), &["127.9.9.1".into()], None);
            let mut seen = Vec::new();
            for item in &p.items {
                match item {
                    Issue::Ca(ca) => seen.push(*ca),
                    Issue::Leaf { ca, .. } => assert!(seen.contains(ca), "{c:?}: {item:?}"),
                    Issue::Kubeconfig { .. } => {
                        assert!(seen.contains(&SecretPurpose::ClusterCa), "{c:?}")
                    }
                }
            }
        }
    }

    #[test]
    fn the_admin_kubeconfig_points_at_the_endpoint_and_extra_hosts_are_sans() {
        let hosts = [
            "127.9.9.1".to_string(),
            "10.96.0.7".into(),
            "api.example".into(),
        ];
        let p = plan(Component::ApiServer, &input(), &hosts, None);
        let serving = p
            .items
            .iter()
            .find_map(|i| match i {
                Issue::Leaf {
                    purpose: SecretPurpose::ApiServer,
                    spec,
                    ..
                } => Some(spec.clone()),
                _ => None,
            })
            .unwrap();
        assert!(serving.ips.contains(&"10.96.0.7".parse().unwrap()));
        assert!(serving.dns_names.contains(&"api.example".to_string()));
        let admin = |p: &Plan| {
            p.items
                .iter()
                .find_map(|i| match i {
                    Issue::Kubeconfig {
                        server,
                        server_name,
                        user,
                        ..
                    } if user == "kubernetes-admin" => Some((server.clone(), server_name.clone())),
                    _ => None,
                })
                .unwrap()
        };
        assert_eq!(admin(&p), ("https://127.9.9.1:6443".into(), None));
        let lb = Endpoint {
            host: "lb.example",
            port: 443,
            server_name: None,
        };
        let p = plan(Component::ApiServer, &input(), &hosts, Some(lb));
        assert_eq!(admin(&p), ("https://lb.example:443".into(), None));
        // Behind a shared gateway: its address, and the tenant's name there.
        let gateway = Endpoint {
            host: "127.0.0.1",
            port: 9443,
            server_name: Some("demo.default.nestplane.internal"),
        };
        let p = plan(Component::ApiServer, &input(), &hosts, Some(gateway));
        assert_eq!(
            admin(&p),
            (
                "https://127.0.0.1:9443".into(),
                Some("demo.default.nestplane.internal".into())
            )
        );
        let v6 = Endpoint {
            host: "::1",
            ..gateway
        };
        let p = plan(Component::ApiServer, &input(), &hosts, Some(v6));
        assert_eq!(admin(&p).0, "https://[::1]:9443");
        assert_eq!(p.health_ca, Some(SecretPurpose::ClusterCa));
        assert_eq!(plan(Component::Etcd, &input(), &[], None).health_ca, None);
    }
}
