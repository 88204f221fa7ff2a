//! CoreDNS for clusters that can pull it: the manifests kubeadm installs (ServiceAccount,
//! ClusterRole and binding, a ConfigMap with the Corefile, a Deployment and the `kube-dns`
//! Service), with the CoreDNS release of the cluster's Kubernetes version. Pure.

use serde_json::Value;

/// How CoreDNS is deployed in a cluster.
#[derive(Clone, Debug)]
pub struct CoreDns {
    /// The registry images come from (`registry.k8s.io`, or a mirror).
    pub registry: String,
    /// The cluster's Kubernetes minor version (`20` for 1.20).
    pub kubernetes_minor: u32,
    /// The `kube-dns` Service's address (the tenth address of the service range).
    pub service_ip: String,
    /// The cluster domain (`cluster.local`).
    pub zone: String,
    /// Replicas.
    pub replicas: i32,
}

/// The CoreDNS release kubeadm installs with a Kubernetes minor version.
pub fn version_for(kubernetes_minor: u32) -> &'static str {
    match kubernetes_minor {
        0..=20 => "1.7.0",
        21 => "v1.8.0",
        22 => "v1.8.4",
        23..=24 => "v1.8.6",
        25 => "v1.9.3",
        26..=27 => "v1.10.1",
        28..=29 => "v1.11.1",
        30..=31 => "v1.11.3",
        32 => "v1.11.3",
        33 => "v1.12.0",
        _ => "v1.12.1",
    }
}

/// The image: `<registry>/coredns:1.7.0` up to Kubernetes 1.20, `<registry>/coredns/coredns:vX`
/// after (the path kubeadm uses).
pub fn image(registry: &str, kubernetes_minor: u32) -> String {
    let v = version_for(kubernetes_minor);
    let registry = registry.trim_end_matches('/');
    if kubernetes_minor <= 20 {
        format!("{registry}/coredns:{v}")
    } else {
        format!("{registry}/coredns/coredns:{v}")
    }
}

/// The Corefile: the cluster zone and reverse zones from the `kubernetes` plugin, everything
/// else forwarded to the node's resolvers, a cache, health and readiness endpoints, metrics.
pub fn corefile(zone: &str) -> String {
    format!(
        ".:53 {{\n    errors\n    health {{\n       lameduck 5s\n    }}\n    ready\n    kubernetes {zone} in-addr.arpa ip6.arpa {{\n       pods insecure\n       fallthrough in-addr.arpa ip6.arpa\n       ttl 30\n    }}\n    prometheus :9153\n    forward . /etc/resolv.conf {{\n       max_concurrent 1000\n    }}\n    cache 30\n    loop\n    reload\n    loadbalance\n}}\n"
    )
}

/// Every object, in the order to apply them.
pub fn manifests(c: &CoreDns) -> Vec<Value> {
    use crate::objects::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    let (role, binding) = cluster_role(
        "system:coredns",
        vec![
            rule(
                "",
                &["endpoints", "services", "pods", "namespaces"],
                &["list", "watch"],
            ),
            rule("discovery.k8s.io", &["endpointslices"], &["list", "watch"]),
        ],
        "coredns",
    );
    let config = ConfigMap {
        metadata: meta("coredns", None),
        data: Some([("Corefile".to_string(), corefile(&c.zone))].into()),
        ..ConfigMap::default()
    };
    let mut service_meta = meta(
        "kube-dns",
        Some(labels(&[
            ("k8s-app", "kube-dns"),
            ("kubernetes.io/name", "CoreDNS"),
        ])),
    );
    service_meta.annotations = Some(labels(&[
        ("prometheus.io/port", "9153"),
        ("prometheus.io/scrape", "true"),
    ]));
    let service = kube_dns_service(
        &c.service_ip,
        service_meta,
        vec![
            service_port("dns", 53, None, "UDP"),
            service_port("dns-tcp", 53, None, "TCP"),
            service_port("metrics", 9153, None, "TCP"),
        ],
    );
    vec![
        value(&service_account("coredns")),
        value(&role),
        value(&binding),
        value(&config),
        value(&workload(c)),
        value(&service),
    ]
}

/// CoreDNS's container: the Corefile mounted, DNS and metrics ports, health and readiness
/// probes, no privileges but binding port 53.
fn server(c: &CoreDns) -> k8s_openapi::api::core::v1::Container {
    use crate::objects::*;
    use k8s_openapi::api::core::v1::{
        Capabilities, Probe, ResourceRequirements, SecurityContext, VolumeMount,
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    let http = |path: &str, port: i32| {
        let mut p = http_probe(path, IntOrString::Int(port));
        if let Some(get) = p.http_get.as_mut() {
            get.scheme = Some("HTTP".into());
        }
        p
    };
    k8s_openapi::api::core::v1::Container {
        args: Some(vec!["-conf".into(), "/etc/coredns/Corefile".into()]),
        resources: Some(ResourceRequirements {
            limits: Some(amounts(&[("memory", "170Mi")])),
            requests: Some(amounts(&[("cpu", "100m"), ("memory", "70Mi")])),
            ..ResourceRequirements::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "config-volume".into(),
            mount_path: "/etc/coredns".into(),
            read_only: Some(true),
            ..VolumeMount::default()
        }]),
        ports: Some(vec![
            container_port("dns", 53, "UDP"),
            container_port("dns-tcp", 53, "TCP"),
            container_port("metrics", 9153, "TCP"),
        ]),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_BIND_SERVICE".into()]),
                drop: Some(vec!["all".into()]),
            }),
            read_only_root_filesystem: Some(true),
            ..SecurityContext::default()
        }),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(60),
            timeout_seconds: Some(5),
            success_threshold: Some(1),
            failure_threshold: Some(5),
            ..http("/health", 8080)
        }),
        readiness_probe: Some(http("/ready", 8181)),
        ..container("coredns", &image(&c.registry, c.kubernetes_minor))
    }
}

/// CoreDNS's Deployment: critical, on Linux nodes, tolerating control-plane taints, one
/// replica unavailable at most during a rollout.
fn workload(c: &CoreDns) -> k8s_openapi::api::apps::v1::Deployment {
    use crate::objects::*;
    use k8s_openapi::api::apps::v1::{DeploymentStrategy, RollingUpdateDeployment};
    use k8s_openapi::api::core::v1::{
        ConfigMapVolumeSource, KeyToPath, PodSpec, Toleration, Volume,
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    let toleration = |key: &str, operator: Option<&str>, effect: Option<&str>| Toleration {
        key: Some(key.into()),
        operator: operator.map(str::to_string),
        effect: effect.map(str::to_string),
        ..Toleration::default()
    };
    let mut workload = deployment(
        "coredns",
        labels(&[("k8s-app", "kube-dns")]),
        c.replicas,
        PodSpec {
            priority_class_name: Some("system-cluster-critical".into()),
            service_account_name: Some("coredns".into()),
            tolerations: Some(vec![
                toleration("CriticalAddonsOnly", Some("Exists"), None),
                toleration(
                    "node-role.kubernetes.io/control-plane",
                    None,
                    Some("NoSchedule"),
                ),
            ]),
            node_selector: Some(labels(&[("kubernetes.io/os", "linux")])),
            dns_policy: Some("Default".into()),
            volumes: Some(vec![Volume {
                name: "config-volume".into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: "coredns".into(),
                    items: Some(vec![KeyToPath {
                        key: "Corefile".into(),
                        path: "Corefile".into(),
                        ..KeyToPath::default()
                    }]),
                    ..ConfigMapVolumeSource::default()
                }),
                ..Volume::default()
            }]),
            containers: vec![server(c)],
            ..PodSpec::default()
        },
    );
    if let Some(spec) = workload.spec.as_mut() {
        spec.strategy = Some(DeploymentStrategy {
            type_: Some("RollingUpdate".into()),
            rolling_update: Some(RollingUpdateDeployment {
                max_unavailable: Some(IntOrString::Int(1)),
                ..RollingUpdateDeployment::default()
            }),
        });
    }
    workload
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coredns(minor: u32) -> CoreDns {
        CoreDns {
            registry: "registry.k8s.io".into(),
            kubernetes_minor: minor,
            service_ip: "10.96.0.10".into(),
            zone: "cluster.local".into(),
            replicas: 2,
        }
    }

    #[test]
    fn the_image_follows_the_kubernetes_version_and_the_registry() {
        assert_eq!(
            image("registry.k8s.io", 20),
            "registry.k8s.io/coredns:1.7.0"
        );
        assert_eq!(
            image("mirror.example/k8s/", 21),
            "mirror.example/k8s/coredns/coredns:v1.8.0"
        );
        assert_eq!(
            image("registry.k8s.io", 34),
            "registry.k8s.io/coredns/coredns:v1.12.1"
        );
    }

    #[test]
    fn kube_dns_at_the_given_address_serving_the_zone() {
        let m = manifests(&coredns(20));
        let kinds: Vec<&str> = m.iter().filter_map(|o| o["kind"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "ConfigMap",
                "Deployment",
                "Service"
            ]
        );
        let svc = &m[5];
        assert_eq!(svc["metadata"]["name"], "kube-dns");
        assert_eq!(svc["spec"]["clusterIP"], "10.96.0.10");
        let corefile = m[3]["data"]["Corefile"].as_str().expect("corefile");
        assert!(corefile.contains("kubernetes cluster.local in-addr.arpa ip6.arpa"));
        assert!(corefile.contains("forward . /etc/resolv.conf"));
        let dep = &m[4];
        assert_eq!(dep["spec"]["replicas"], 2);
        assert_eq!(
            dep["spec"]["template"]["spec"]["containers"][0]["image"],
            "registry.k8s.io/coredns:1.7.0"
        );
    }
}
