//! `cluster.x-k8s.io/v1beta1` `ClusterEndpoint` (seed 003): a reachable Kubernetes API
//! endpoint of a cluster, created by the control-plane provider as soon as the endpoint is
//! known, owned by the control-plane object it comes from.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The function a cluster endpoint serves.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ClusterEndpointType {
    /// The cluster's Kubernetes API server.
    #[default]
    #[serde(rename = "apiserver")]
    ApiServer,
}

/// The desired state of a cluster endpoint (seed 003's `ClusterEndpointSpec`).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta1",
    kind = "ClusterEndpoint",
    plural = "clusterendpoints",
    namespaced,
    category = "cluster-api",
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.cluster"),
    printcolumn(name = "Host", type_ = "string", json_path = ".spec.host"),
    printcolumn(name = "Port", type_ = "integer", json_path = ".spec.port"),
    printcolumn(name = "Type", type_ = "string", json_path = ".spec.type"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterEndpointSpec {
    /// The DNS record or the IP address that the endpoint is reachable on.
    pub host: String,
    /// The port on which the endpoint is serving.
    pub port: i32,
    /// The TLS server name the cluster is asked for there, when the address is a gateway
    /// that clusters share (a kubeconfig's `tls-server-name`); absent for an address of the
    /// cluster's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// The name of the cluster that this endpoint is reachable on.
    pub cluster: String,
    /// The function that this cluster endpoint serves.
    #[serde(rename = "type")]
    pub type_: ClusterEndpointType,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn the_seeds_example_reads_and_the_type_is_apiserver_only() {
        let e: ClusterEndpoint = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta1",
            "kind": "ClusterEndpoint",
            "metadata": {"labels": {"cluster.x-k8s.io/cluster-name": "my-cluster-2"}},
            "spec": {"cluster": "my-cluster-2", "host": "10.40.85.102", "port": 1234, "type": "apiserver"}
        }))
        .unwrap();
        assert_eq!(e.spec.host, "10.40.85.102");
        assert_eq!(e.spec.port, 1234);
        assert_eq!(e.spec.type_, ClusterEndpointType::ApiServer);
        let crd = serde_json::to_value(ClusterEndpoint::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            spec["properties"]["type"]["enum"],
            serde_json::json!(["apiserver"])
        );
        let mut required: Vec<_> = spec["required"].as_array().unwrap().clone();
        required.sort_by_key(|v| v.to_string());
        assert_eq!(
            required,
            ["cluster", "host", "port", "type"].map(serde_json::Value::from)
        );
    }
}
