//! Cluster DNS for clusters nestplane runs: a DNS server (built on `hickory-server`) that
//! answers the *Kubernetes DNS-Based Service Discovery* names of a cluster from watch caches,
//! and the manifests that run it in the cluster as `kube-dns`.
//!
//! Pure: [`records`] (what a name resolves to), [`manifests`], [`coredns`] (CoreDNS for
//! clusters that can pull it). IO: [`server`].

pub mod coredns;
pub mod records;
pub mod server;

use serde_json::{Value, json};

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
    let labels = json!({"k8s-app": "kube-dns", "app.kubernetes.io/name": "nestplane-dns"});
    vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "nestplane-dns", "namespace": "kube-system"}
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "nestplane:dns"},
            "rules": [{"apiGroups": [""], "resources": ["services", "endpoints"], "verbs": ["list", "watch"]}]
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "nestplane:dns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "nestplane:dns"},
            "subjects": [{"kind": "ServiceAccount", "name": "nestplane-dns", "namespace": "kube-system"}]
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "nestplane-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "replicas": d.replicas,
                "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": "nestplane-dns",
                        // The server itself must not ask itself.
                        "dnsPolicy": "Default",
                        "priorityClassName": "system-cluster-critical",
                        "securityContext": {"runAsNonRoot": true, "runAsUser": 65532},
                        "containers": [{
                            "name": "dns",
                            "image": d.image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["/nestplane"],
                            "args": [
                                "dns",
                                format!("--zone={}", d.zone),
                                format!("--listen=0.0.0.0:{POD_PORT}"),
                                // Probes come to the pod's address: not every address of
                                // the pod (the pod may have others) serves them.
                                format!("--health=$(POD_IP):{HEALTH_PORT}"),
                            ],
                            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                            "ports": [
                                {"name": "dns", "containerPort": POD_PORT, "protocol": "UDP"},
                                {"name": "dns-tcp", "containerPort": POD_PORT, "protocol": "TCP"},
                                {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}
                            ],
                            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "health"}, "periodSeconds": 2},
                            "livenessProbe": {"httpGet": {"path": "/healthz", "port": "health"}},
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "128Mi"}},
                            "securityContext": {
                                "allowPrivilegeEscalation": false,
                                "readOnlyRootFilesystem": true,
                                "capabilities": {"drop": ["ALL"]}
                            }
                        }]
                    }
                }
            }
        }),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "clusterIP": d.service_ip,
                "selector": {"k8s-app": "kube-dns"},
                "ports": [
                    {"name": "dns", "port": 53, "targetPort": POD_PORT, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "targetPort": POD_PORT, "protocol": "TCP"}
                ]
            }
        }),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

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
