//! Cluster DNS for clusters nestplane runs: a DNS server (built on `hickory-server`) that
//! answers the *Kubernetes DNS-Based Service Discovery* names of a cluster from watch caches,
//! and the manifests that run it in the cluster as `kube-dns`.
//!
//! Pure: [`records`] (what a name resolves to), [`manifests`], [`coredns`] (CoreDNS for
//! clusters that can pull it). IO: [`server`].

pub mod coredns;
pub mod objects;
pub mod records;
pub mod server;

use k8s_openapi::api::core::v1::{Container, Probe};
use serde_json::Value;

/// How the DNS server is deployed in a cluster.
#[derive(Clone, Debug)]
pub struct Deployment {
    /// The image holding the `nestplane` binary (`nestplane dns` runs the server).
    pub image: String,
    /// The `kube-dns` Service's address (the tenth address of the service range).
    pub service_ip: String,
    /// The cluster domain (`cluster.local`).
    pub zone: String,
    /// Replicas of the server.
    pub replicas: i32,
}

/// The port the server listens on in its pod (unprivileged; the Service maps 53 to it).
pub const POD_PORT: i32 = 5353;
/// The health port (`/healthz`, `/readyz`).
pub const HEALTH_PORT: i32 = 8081;

/// ServiceAccount, ClusterRole and binding (read Services and Endpoints), Deployment and the
/// `kube-dns` Service, in `kube-system`. Pure.
pub fn manifests(d: &Deployment) -> Vec<Value> {
    use k8s_openapi::api::core::v1::{
        Capabilities, EnvVar, EnvVarSource, ObjectFieldSelector, PodSecurityContext, PodSpec,
        ResourceRequirements, SecurityContext,
    };
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use objects::*;

    let own = || {
        labels(&[
            ("k8s-app", "kube-dns"),
            ("app.kubernetes.io/name", "nestplane-dns"),
        ])
    };
    let (role, binding) = cluster_role(
        "nestplane:dns",
        vec![rule("", &["services", "endpoints"], &["list", "watch"])],
        "nestplane-dns",
    );
    let server = Container {
        command: Some(vec!["/nestplane".into()]),
        args: Some(vec![
            "dns".into(),
            format!("--zone={}", d.zone),
            format!("--listen=0.0.0.0:{POD_PORT}"),
            // Probes come to the pod's address: not every address of the pod (the pod may
            // have others) serves them.
            format!("--health=$(POD_IP):{HEALTH_PORT}"),
        ]),
        env: Some(vec![EnvVar {
            name: "POD_IP".into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: "status.podIP".into(),
                    ..ObjectFieldSelector::default()
                }),
                ..EnvVarSource::default()
            }),
            ..EnvVar::default()
        }]),
        ports: Some(vec![
            container_port("dns", POD_PORT, "UDP"),
            container_port("dns-tcp", POD_PORT, "TCP"),
            container_port("health", HEALTH_PORT, "TCP"),
        ]),
        readiness_probe: Some(Probe {
            period_seconds: Some(2),
            ..http_probe("/readyz", IntOrString::String("health".into()))
        }),
        liveness_probe: Some(http_probe("/healthz", IntOrString::String("health".into()))),
        resources: Some(ResourceRequirements {
            requests: Some(amounts(&[("cpu", "10m"), ("memory", "16Mi")])),
            limits: Some(amounts(&[("memory", "128Mi")])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        ..container("dns", &d.image)
    };
    let workload = deployment(
        "nestplane-dns",
        own(),
        d.replicas,
        PodSpec {
            service_account_name: Some("nestplane-dns".into()),
            // The server itself must not ask itself.
            dns_policy: Some("Default".into()),
            priority_class_name: Some("system-cluster-critical".into()),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(65532),
                ..PodSecurityContext::default()
            }),
            containers: vec![server],
            ..PodSpec::default()
        },
    );
    let service = kube_dns_service(
        &d.service_ip,
        meta("kube-dns", Some(own())),
        vec![
            service_port("dns", 53, Some(POD_PORT), "UDP"),
            service_port("dns-tcp", 53, Some(POD_PORT), "TCP"),
        ],
    );
    vec![
        value(&service_account("nestplane-dns")),
        value(&role),
        value(&binding),
        value(&workload),
        value(&service),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kube_dns_is_at_the_given_address_and_maps_port_53() {
        let m = manifests(&Deployment {
            image: "docker.io/library/nestplane:latest".into(),
            service_ip: "10.0.0.10".into(),
            zone: "cluster.local".into(),
            replicas: 2,
        });
        let svc = m.iter().find(|o| o["kind"] == "Service").expect("service");
        assert_eq!(svc["metadata"]["name"], "kube-dns");
        assert_eq!(svc["spec"]["clusterIP"], "10.0.0.10");
        assert_eq!(svc["spec"]["ports"][0]["port"], 53);
        let dep = m
            .iter()
            .find(|o| o["kind"] == "Deployment")
            .expect("deployment");
        assert_eq!(dep["spec"]["replicas"], 2);
        assert_eq!(dep["spec"]["template"]["spec"]["dnsPolicy"], "Default");
        let args = &dep["spec"]["template"]["spec"]["containers"][0]["args"];
        assert!(
            args.as_array()
                .expect("args")
                .contains(&json!(format!("--health=$(POD_IP):{HEALTH_PORT}"))),
            "{args}"
        );
    }
}
