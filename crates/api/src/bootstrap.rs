//! The Cluster API bootstrap provider: a `NestplaneConfig` turns the machine of the `Machine`
//! that references it into a node of the Machine's cluster. For it nestplane makes a
//! short-lived bootstrap token in the cluster and writes the bootstrap data Secret: a script
//! (cloud-init runs user data that starts with `#!`) that runs `nestplane node join` with
//! the token, the hash of the cluster CA's public key and the gateway's address; once the
//! Node has registered, the token is deleted. Contract: `status.dataSecretName` with
//! `status.ready` (v1beta1) and `status.initialization.dataSecretCreated` (v1beta2).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The bootstrap provider's API group (Cluster API's).
pub const GROUP: &str = "bootstrap.cluster.x-k8s.io";

/// The token's life when the spec names none (seconds).
pub const DEFAULT_TOKEN_TTL_SECONDS: u32 = 900;
/// The longest a token may live (seconds).
pub const MAX_TOKEN_TTL_SECONDS: u32 = 86_400;

/// A bootstrap configuration for one Machine: how its machine becomes a node.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestplaneConfig",
    plural = "nestplaneconfigs",
    namespaced,
    status = "NestplaneConfigStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']"
    ),
    printcolumn(name = "Data", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(name = "Node", type_ = "string", json_path = ".status.nodeName"),
    printcolumn(
        name = "Joined",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Joined\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestplaneConfigSpec {
    /// Labels of the Node.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// Taints of the Node (`key=value:Effect` or `key:Effect`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_taints: Vec<String>,
    /// The cluster's DNS servers the kubelet gives pods (none by default).
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "clusterDNS")]
    pub cluster_dns: Vec<String>,
    /// The cluster's domain (`cluster.local` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_domain: Option<String>,
    /// Pods the node runs at most (the kubelet's `maxPods`; 110 when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 250))]
    pub max_pods: Option<i32>,
    /// The pod security level enforced on the node below the tenant: `Baseline` (the
    /// default) or `Restricted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_security: Option<String>,
    /// How long the bootstrap token lives, in seconds (900 by default, at most 86400); one
    /// that expires before its machine joins is replaced, and the data Secret with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ttl_seconds: Option<u32>,
}

/// `status.initialization` (the v1beta2 contract).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapInitialization {
    /// The bootstrap data Secret exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_created: Option<bool>,
}

/// What nestplane made for the Machine, and how its join went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestplaneConfigStatus {
    /// The bootstrap data Secret exists (the v1beta1 contract).
    #[serde(default)]
    pub ready: bool,
    /// The bootstrap data Secret (key `value`, format in `format`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
    /// The v1beta2 contract's initialization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<BootstrapInitialization>,
    /// The id of the bootstrap token (its secret is only in the data Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_id: Option<String>,
    /// When the token expires (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_expires: Option<String>,
    /// The token was deleted (its machine joined, so no one may join with it again). Always
    /// written: a merge patch must be able to say `false` again.
    #[serde(default)]
    pub token_deleted: bool,
    /// The machine's address block in its cluster (node `10.201.SLOT.2`, pods
    /// `10.244.SLOT.0/24`): given once, unique among the namespace's configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u8>,
    /// The cluster its token is in (the name its control plane's Secrets carry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    /// The Node the machine registered as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (the data Secret is there), `Joined` (the Node registered), `Paused`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// A template of `NestplaneConfig`s (what a `MachineDeployment` names: one config per
/// Machine).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestplaneConfigTemplate",
    plural = "nestplaneconfigtemplates",
    namespaced,
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestplaneConfigTemplateSpec {
    /// What each config is.
    pub template: NestplaneConfigTemplateResource,
}

/// A template's config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestplaneConfigTemplateResource {
    /// Its spec.
    pub spec: NestplaneConfigSpec,
}

/// Condition types and reasons.
pub mod reasons {
    /// Waiting: no Machine references this config yet.
    pub const WAITING_FOR_MACHINE: &str = "WaitingForMachine";
    /// Waiting: the Machine's cluster has no control plane of nestplane's, or it is not
    /// ready, or it has no gateway address.
    pub const WAITING_FOR_CONTROL_PLANE: &str = "WaitingForControlPlane";
    /// The data Secret is there.
    pub const DATA_SECRET_AVAILABLE: &str = "DataSecretAvailable";
    /// The spec cannot be used.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The machine has not registered its Node yet.
    pub const WAITING_FOR_NODE: &str = "WaitingForNode";
    /// The Node registered; the token is gone.
    pub const NODE_JOINED: &str = "NodeJoined";
    /// The token expired before the machine joined; a new one is in the data Secret.
    pub const TOKEN_REFRESHED: &str = "TokenRefreshed";
    /// More than one Machine references the config.
    pub const AMBIGUOUS_MACHINE: &str = "AmbiguousMachine";
    /// A Secret of the data Secret's name exists and is not this config's.
    pub const DATA_SECRET_NAME_TAKEN: &str = "DataSecretNameTaken";
    /// Every address block of the namespace is given.
    pub const NO_ADDRESS_BLOCK: &str = "NoAddressBlock";
}
