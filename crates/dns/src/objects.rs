//! The objects both DNS deployments are made of (the built-in server and CoreDNS), typed by
//! k8s-openapi; they become JSON only where they are applied. Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, HTTPGetAction, PodSpec, PodTemplateSpec, Probe, Service,
    ServiceAccount, ServicePort, ServiceSpec,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

/// Where DNS lives.
pub const NAMESPACE: &str = "kube-system";

/// Labels from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Metadata of an object in [`NAMESPACE`].
pub fn meta(name: &str, labels: Option<BTreeMap<String, String>>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some(NAMESPACE.into()),
        labels,
        ..ObjectMeta::default()
    }
}

/// The ServiceAccount the server runs as.
pub fn service_account(name: &str) -> ServiceAccount {
    ServiceAccount {
        metadata: meta(name, None),
        ..ServiceAccount::default()
    }
}

/// A rule: `verbs` on `resources` of API group `group`.
pub fn rule(group: &str, resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(resources.iter().map(|r| r.to_string()).collect()),
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        ..PolicyRule::default()
    }
}

/// A ClusterRole named `role` with `rules`, and its binding to ServiceAccount `account`.
pub fn cluster_role(
    role: &str,
    rules: Vec<PolicyRule>,
    account: &str,
) -> (ClusterRole, ClusterRoleBinding) {
    let metadata = ObjectMeta {
        name: Some(role.into()),
        ..ObjectMeta::default()
    };
    (
        ClusterRole {
            metadata: metadata.clone(),
            rules: Some(rules),
            ..ClusterRole::default()
        },
        ClusterRoleBinding {
            metadata,
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: role.into(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: account.into(),
                namespace: Some(NAMESPACE.into()),
                ..Subject::default()
            }]),
        },
    )
}

/// A container or Service port.
pub fn container_port(name: &str, port: i32, protocol: &str) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: port,
        protocol: Some(protocol.into()),
        ..ContainerPort::default()
    }
}

/// A Service port (`target`: the pod's port, when it is not `port`).
pub fn service_port(name: &str, port: i32, target: Option<i32>, protocol: &str) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: target.map(IntOrString::Int),
        protocol: Some(protocol.into()),
        ..ServicePort::default()
    }
}

/// An HTTP GET probe.
pub fn http_probe(path: &str, port: IntOrString) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port,
            ..HTTPGetAction::default()
        }),
        ..Probe::default()
    }
}

/// Resource amounts from pairs.
pub fn amounts(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect()
}

/// The `kube-dns` Service at `ip`, selecting pods labelled `k8s-app: kube-dns`.
pub fn kube_dns_service(ip: &str, metadata: ObjectMeta, ports: Vec<ServicePort>) -> Service {
    Service {
        metadata,
        spec: Some(ServiceSpec {
            cluster_ip: Some(ip.into()),
            selector: Some(labels(&[("k8s-app", "kube-dns")])),
            ports: Some(ports),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// Deployment `name` of `replicas` pods labelled `labels` (which hold `k8s-app: kube-dns`,
/// what it selects) running `spec`.
pub fn deployment(
    name: &str,
    labels: BTreeMap<String, String>,
    replicas: i32,
    spec: PodSpec,
) -> Deployment {
    Deployment {
        metadata: meta(name, Some(labels.clone())),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(self::labels(&[("k8s-app", "kube-dns")])),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..ObjectMeta::default()
                }),
                spec: Some(spec),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// The object as applied: JSON with its `apiVersion` and `kind`.
pub fn value<T: serde::Serialize>(object: &T) -> Value {
    serde_json::to_value(object).unwrap_or_default()
}

/// The container defaults both deployments share: the image pulled only when missing.
pub fn container(name: &str, image: &str) -> Container {
    Container {
        name: name.into(),
        image: Some(image.into()),
        image_pull_policy: Some("IfNotPresent".into()),
        ..Container::default()
    }
}
