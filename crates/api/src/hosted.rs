//! `nestplane.io/v1alpha1` `HostedCluster` and `NodePool` (seed 002, HyperShift's shape with
//! a Kubernetes version instead of a release image), and
//! `infrastructure.cluster.x-k8s.io/v1alpha1` `ExternalInfraCluster`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ApiEndpoint;

/// The API group of `HostedCluster` and `NodePool`.
pub const GROUP: &str = "nestplane.io";
/// The pod network of nestplane's nodes: every node takes a `/24` of it.
pub const POD_NETWORK: &str = "10.244.0.0/16";
/// The default service network.
pub const SERVICE_NETWORK: &str = "10.96.0.0/12";

/// Condition types of a `HostedCluster`.
pub mod types {
    /// The control plane serves.
    pub const AVAILABLE: &str = "Available";
    /// Something is being created or changed.
    pub const PROGRESSING: &str = "Progressing";
    /// Something is wrong that will not fix itself.
    pub const DEGRADED: &str = "Degraded";
    /// The spec is valid (networking, version).
    pub const VALID_CONFIGURATION: &str = "ValidConfiguration";
    /// etcd serves.
    pub const ETCD_AVAILABLE: &str = "EtcdAvailable";
    /// The API server serves.
    pub const KUBE_APISERVER_AVAILABLE: &str = "KubeAPIServerAvailable";
    /// Reconciliation is not paused (`pausedUntil`).
    pub const RECONCILIATION_ACTIVE: &str = "ReconciliationActive";
    /// While deleting: the teardown step (reason) and what it waits for (message).
    pub const DELETING: &str = "Deleting";
    /// A HostedCluster's cluster DNS has an available replica.
    pub const CLUSTER_DNS_AVAILABLE: &str = "ClusterDNSAvailable";
    /// A NodePool's nodes are all Ready and as specified.
    pub const READY: &str = "Ready";
    /// Every node of a pool is Ready.
    pub const ALL_NODES_HEALTHY: &str = "AllNodesHealthy";
    /// A pool is replacing nodes for a new version.
    pub const UPDATING_VERSION: &str = "UpdatingVersion";
    /// A pool is replacing nodes for a new configuration (labels, taints).
    pub const UPDATING_CONFIG: &str = "UpdatingConfig";
    /// A pool's version is supported with its control plane's.
    pub const SUPPORTED_VERSION_SKEW: &str = "SupportedVersionSkew";
    /// A HostedCluster's version change can be made: False while a node pool would be left
    /// outside the kubelet skew policy by it (the control plane keeps its version).
    pub const CLUSTER_VERSION_UPGRADEABLE: &str = "ClusterVersionUpgradeable";
}

/// The Kubernetes version of a cluster or pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Release {
    /// Kubernetes version, semver (`v1.20.2`; a missing `v` is added).
    pub version: String,
}

/// A CIDR.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NetworkEntry {
    /// `a.b.c.d/n`.
    pub cidr: String,
}

/// The cluster's networks; immutable once the control plane exists.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworking {
    /// The pod network (nestplane's nodes use `10.244.0.0/16`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_network: Vec<NetworkEntry>,
    /// The service network (`10.96.0.0/12` by default).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_network: Vec<NetworkEntry>,
}

/// How a service of the control plane is published.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServicePublishingStrategyMapping {
    /// The service: `APIServer`.
    pub service: String,
    /// How it is published.
    pub service_publishing_strategy: ServicePublishingStrategy,
}

/// How a service is published: `ClusterIP` (default), `NodePort` or `LoadBalancer` (the
/// `kubernetes` runtime's Service type; the `process` runtime serves on a loopback address).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ServicePublishingStrategy {
    /// `ClusterIP`, `NodePort` or `LoadBalancer`.
    #[serde(rename = "type")]
    pub type_: String,
}

/// etcd of a hosted cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdSpec {
    /// `Managed`: nestplane runs the cluster's own etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub management_type: Option<String>,
}

/// The pod security level nestplane enforces on a pool's nodes, below the tenant (Pod
/// Security Standards' names): the tenant admin cannot switch it off from inside.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PodSecurityLevel {
    /// No privileged containers, host namespaces, host paths, added capabilities, host
    /// devices, unmasked `/proc` or unsafe sysctls; the node's seccomp profile by default.
    #[default]
    Baseline,
    /// Baseline, and containers run as non-root, without privilege escalation, with at most
    /// `NET_BIND_SERVICE`.
    Restricted,
    /// Nothing is enforced: a tenant admin can become root on this machine. Only as an
    /// explicit choice; the NodePool shows a Warning condition.
    Privileged,
}

impl PodSecurityLevel {
    /// The name in the API.
    pub fn as_str(&self) -> &'static str {
        match self {
            PodSecurityLevel::Baseline => "Baseline",
            PodSecurityLevel::Restricted => "Restricted",
            PodSecurityLevel::Privileged => "Privileged",
        }
    }
}

/// Which cluster DNS a hosted cluster gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DnsProvider {
    /// nestplane's own Kubernetes DNS server (`nestplane dns`, in the locally built
    /// `nestplane` image): for clusters that cannot pull images.
    Builtin,
    /// CoreDNS, the release of the cluster's Kubernetes version, from the image registry.
    #[serde(rename = "CoreDNS")]
    CoreDns,
}

impl DnsProvider {
    /// The name in the API (`Builtin`, `CoreDNS`).
    pub fn as_str(&self) -> &'static str {
        match self {
            DnsProvider::Builtin => "Builtin",
            DnsProvider::CoreDns => "CoreDNS",
        }
    }
}

/// Cluster DNS of a hosted cluster: a `kube-dns` Service in `kube-system` at the tenth
/// address of the service network, which every node's kubelet gives pods.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DnsSpec {
    /// `Builtin` or `CoreDNS`; unset: the operator's default (`Builtin` where nodes are made
    /// on the operator's machine from images built there, which cannot pull; else `CoreDNS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<DnsProvider>,
}

/// The cluster DNS a hosted cluster has.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DnsStatus {
    /// `Builtin` or `CoreDNS`.
    pub provider: String,
    /// The `kube-dns` Service's address.
    #[serde(rename = "serviceIP")]
    pub service_ip: String,
}

/// A hosted cluster: a control plane nestplane runs and worker pools of real nodes.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "nestplane.io",
    version = "v1alpha1",
    kind = "HostedCluster",
    plural = "hostedclusters",
    shortname = "hc",
    namespaced,
    status = "HostedClusterStatus",
    printcolumn(
        name = "Version",
        type_ = "string",
        json_path = ".status.version.history[0].version"
    ),
    printcolumn(
        name = "KubeConfig",
        type_ = "string",
        json_path = ".status.kubeconfig.name"
    ),
    printcolumn(
        name = "Progress",
        type_ = "string",
        json_path = ".status.version.history[0].state"
    ),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(
        name = "Progressing",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Progressing\")].status"
    ),
    printcolumn(name = "DNS", type_ = "string", json_path = ".status.dns.provider"),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].message"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct HostedClusterSpec {
    /// The Kubernetes version of the control plane.
    pub release: Release,
    /// Pod and service networks (validated; immutable).
    #[serde(default)]
    pub networking: ClusterNetworking,
    /// How the control plane's services are published.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<ServicePublishingStrategyMapping>,
    /// etcd (`Managed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdSpec>,
    /// Pause reconciling: `"true"`, or until an RFC 3339 time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<String>,
    /// Nodes of the NodePool created with the cluster (seed 002: "HostedCluster has initial
    /// nodes? → create NodePool"); none when 0 or unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 20))]
    pub initial_nodes: Option<i32>,
    /// Cluster DNS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsSpec>,
}

/// One version the cluster was at.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpdateHistory {
    /// `Completed` or `Partial`.
    pub state: String,
    /// The version.
    pub version: String,
    /// When it was asked for.
    pub started_time: Time,
    /// When it was reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
}

/// The version asked for and reached.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterVersionStatus {
    /// The version asked for.
    pub desired: Release,
    /// Newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<UpdateHistory>,
    /// The generation this describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A key of a Secret.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretKeyRef {
    /// The Secret (in the HostedCluster's namespace).
    pub name: String,
    /// The key.
    pub key: String,
}

/// What a HostedCluster reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostedClusterStatus {
    /// The version asked for, and the history of versions reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<ClusterVersionStatus>,
    /// The admin kubeconfig, copied into this namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<SecretKeyRef>,
    /// Where the API server is reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// The namespace of the control plane (`<namespace>-<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_namespace: Option<String>,
    /// Whether the initial NodePool was created (it is created once).
    #[serde(default)]
    pub initial_node_pool_created: bool,
    /// The networking the control plane was created with (immutable).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networking: Option<ClusterNetworking>,
    /// The cluster DNS nestplane keeps in the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsStatus>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Key rotations of the control plane (its `status.rotations`): asked for with annotation
    /// `nestplane.io/rotate-sa-key` here (`nestplane rotate sa-key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rotations: Vec<crate::RotationStatus>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Replacing nodes one by one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollingUpdate {
    /// Nodes above `replicas` during a rollout (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<i32>,
    /// Nodes below `replicas` during a rollout (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<i32>,
}

/// How a pool replaces nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplaceSpec {
    /// `RollingUpdate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// Surge and unavailability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolling_update: Option<RollingUpdate>,
}

/// How a pool changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolManagement {
    /// `Replace`: a changed node is replaced by a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade_type: Option<String>,
    /// Replace settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace: Option<ReplaceSpec>,
}

/// A taint of the pool's Nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Taint {
    /// Key.
    pub key: String,
    /// Value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// A pool of real worker nodes of a hosted cluster.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "nestplane.io",
    version = "v1alpha1",
    kind = "NodePool",
    plural = "nodepools",
    shortname = "np",
    namespaced,
    status = "NodePoolStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas"
    ),
    printcolumn(name = "Cluster", type_ = "string", json_path = ".spec.clusterName"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Current", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Updating",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"UpdatingConfig\")].status"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].message"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolSpec {
    /// The HostedCluster (same namespace).
    pub cluster_name: String,
    /// Nodes (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 50))]
    pub replicas: Option<i32>,
    /// The kubelet's version (the control plane's when unset; never newer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<Release>,
    /// How nodes are replaced when what they are built from changes.
    #[serde(default)]
    pub management: NodePoolManagement,
    /// Labels of the pool's Nodes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// Taints of the pool's Nodes. A change replaces the nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    /// Pods each node runs at most (the kubelet's `maxPods`; 110 when unset). A change
    /// replaces the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 250))]
    pub max_pods: Option<i32>,
    /// How long a node is drained before its pods are deleted anyway (`5m` when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_drain_timeout: Option<String>,
    /// Pause reconciling: `"true"`, or until an RFC 3339 time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_until: Option<String>,
    /// The pod security level enforced on the pool's nodes, below the tenant (`Baseline`
    /// when unset). A change replaces the nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security: Option<PodSecurityLevel>,
    /// Where the pool's nodes run: on the operator's machine (`Local`, the default), or on
    /// machines Cluster API makes (`ClusterAPI`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<NodePoolPlatform>,
}

/// Where a pool's nodes run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolPlatform {
    /// `Local` (nodes on the operator's machine) or `ClusterAPI` (a `MachineDeployment` of
    /// the hosted cluster's Cluster, whose machines join with a `NestplaneConfig`).
    #[serde(rename = "type")]
    pub type_: String,
    /// The `ClusterAPI` platform's settings.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "clusterAPI"
    )]
    pub cluster_api: Option<ClusterApiPlatform>,
}

/// The `ClusterAPI` platform: the infrastructure provider's machine template the pool's
/// machines are made from (in the hosted cluster's control-plane namespace, where its Cluster
/// is).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterApiPlatform {
    /// The infrastructure machine template (`apiGroup`, `kind`, `name`).
    pub infrastructure_ref: ContractReference,
}

/// A reference in Cluster API's v1beta2 form.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContractReference {
    /// The API group (`infrastructure.cluster.x-k8s.io`).
    pub api_group: String,
    /// The kind.
    pub kind: String,
    /// The name.
    pub name: String,
}

/// The platforms a pool's nodes run on.
pub mod platforms {
    /// Nodes on the operator's machine.
    pub const LOCAL: &str = "Local";
    /// Machines of a Cluster API `MachineDeployment`.
    pub const CLUSTER_API: &str = "ClusterAPI";
}

/// One node of a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeInfo {
    /// The Node's name.
    pub name: String,
    /// The kubelet's version.
    pub version: String,
    /// Whether the Node is Ready.
    pub ready: bool,
    /// Whether it is as the spec says (else it is being replaced).
    #[serde(default)]
    pub current: bool,
}

/// What a NodePool reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePoolStatus {
    /// Ready nodes.
    #[serde(default)]
    pub replicas: i32,
    /// The platform the pool's nodes run on (`Local` or `ClusterAPI`), fixed once the pool is
    /// first admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
    /// The version every node runs, once a rollout is complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Per node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<NodeInfo>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The infrastructure of a hosted cluster: nothing to provision, the control plane's
/// endpoint mirrored for Cluster API (seed 002).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ExternalInfraCluster",
    plural = "externalinfraclusters",
    namespaced,
    status = "ExternalInfraClusterStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".spec.controlPlaneEndpoint.host"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ExternalInfraClusterSpec {
    /// The control plane's endpoint, copied once it is Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
}

/// Whether the infrastructure is ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ExternalInfraClusterStatus {
    /// The hosted control plane is Ready.
    #[serde(default)]
    pub ready: bool,
}
