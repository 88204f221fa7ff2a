//! CoreDNS for clusters that can pull it: the manifests kubeadm installs (ServiceAccount,
//! ClusterRole and binding, a ConfigMap with the Corefile, a Deployment and the `kube-dns`
//! Service), with the CoreDNS release of the cluster's Kubernetes version. Pure.

use serde_json::{Value, json};

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
    let labels = json!({"k8s-app": "kube-dns"});
    vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "coredns", "namespace": "kube-system"}
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
            ]
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
            "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}]
        }),
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "coredns", "namespace": "kube-system"},
            "data": {"Corefile": corefile(&c.zone)}
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "coredns", "namespace": "kube-system", "labels": labels},
            "spec": {
                "replicas": c.replicas,
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "priorityClassName": "system-cluster-critical",
                        "serviceAccountName": "coredns",
                        "tolerations": [
                            {"key": "CriticalAddonsOnly", "operator": "Exists"},
                            {"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}
                        ],
                        "nodeSelector": {"kubernetes.io/os": "linux"},
                        "dnsPolicy": "Default",
                        "volumes": [{"name": "config-volume", "configMap": {"name": "coredns", "items": [{"key": "Corefile", "path": "Corefile"}]}}],
                        "containers": [{
                            "name": "coredns",
                            "image": image(&c.registry, c.kubernetes_minor),
                            "imagePullPolicy": "IfNotPresent",
                            "args": ["-conf", "/etc/coredns/Corefile"],
                            "resources": {"limits": {"memory": "170Mi"}, "requests": {"cpu": "100m", "memory": "70Mi"}},
                            "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": true}],
                            "ports": [
                                {"containerPort": 53, "name": "dns", "protocol": "UDP"},
                                {"containerPort": 53, "name": "dns-tcp", "protocol": "TCP"},
                                {"containerPort": 9153, "name": "metrics", "protocol": "TCP"}
                            ],
                            "securityContext": {
                                "allowPrivilegeEscalation": false,
                                "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["all"]},
                                "readOnlyRootFilesystem": true
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/health", "port": 8080, "scheme": "HTTP"},
                                "initialDelaySeconds": 60, "timeoutSeconds": 5,
                                "successThreshold": 1, "failureThreshold": 5
                            },
                            "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181, "scheme": "HTTP"}}
                        }]
                    }
                }
            }
        }),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {
                "name": "kube-dns", "namespace": "kube-system",
                "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
                "annotations": {"prometheus.io/port": "9153", "prometheus.io/scrape": "true"}
            },
            "spec": {
                "clusterIP": c.service_ip,
                "selector": labels,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                    {"name": "metrics", "port": 9153, "protocol": "TCP"}
                ]
            }
        }),
    ]
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
