//! `postcreate.cluster.x-k8s.io/v1alpha3` `PostCreateConfig` (seed 001): resources held in
//! Secrets (YAML under `addon.yaml`), applied once to every cluster the selector matches.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group.
pub const GROUP: &str = "postcreate.cluster.x-k8s.io";
/// The key of a resource Secret that holds the YAML.
pub const ADDON_KEY: &str = "addon.yaml";
/// A Secret in another namespace than the PostCreateConfig is used only when it carries this
/// label with the value `true`: otherwise anyone who may create a PostCreateConfig could
/// copy any Secret into a cluster they control.
pub const SHARED_LABEL: &str = "postcreate.cluster.x-k8s.io/shared";

/// Condition types.
pub mod types {
    /// Every Secret exists, may be used and parses.
    pub const RESOURCES_AVAILABLE: &str = "ResourcesAvailable";
    /// Every matching cluster that is ready for it has everything applied.
    pub const RESOURCES_APPLIED: &str = "ResourcesApplied";
    /// The Secrets changed after some clusters got them (`ApplyOnce` does not apply again).
    pub const OUT_OF_DATE: &str = "OutOfDate";
    /// Resources available and applied.
    pub const READY: &str = "Ready";
}

/// Condition reasons and Event reasons.
pub mod reasons {
    /// A resource Secret does not exist.
    pub const SECRET_NOT_FOUND: &str = "SecretNotFound";
    /// A Secret in another namespace without the opt-in label.
    pub const SECRET_NOT_SHARED: &str = "SecretNotShared";
    /// A Secret without `addon.yaml`, or a document that does not parse.
    pub const INVALID_RESOURCE: &str = "InvalidResource";
    /// Applied to a cluster (Event).
    pub const APPLIED: &str = "Applied";
    /// Applying to a cluster failed (Event, condition).
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// Matching clusters are not ready for it yet (initializing, paused, deleting).
    pub const WAITING_FOR_CLUSTERS: &str = "WaitingForClusters";
    /// The Secrets changed after they were applied.
    pub const RESOURCES_CHANGED: &str = "ResourcesChanged";
    /// Nothing to report.
    pub const AS_EXPECTED: &str = "AsExpected";
}

/// How resources reach clusters that already got them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Strategy {
    /// Apply once per cluster (the seed's behaviour); later changes of the Secrets only set
    /// `OutOfDate`.
    #[default]
    ApplyOnce,
    /// Apply again (server-side apply) when the Secrets change; never deletes anything.
    Reconcile,
}

/// A Secret holding resources.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ResourceRef {
    /// Name of the Secret.
    pub name: String,
    /// Namespace of the Secret (the PostCreateConfig's when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Which clusters get which resources.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "postcreate.cluster.x-k8s.io",
    version = "v1alpha3",
    kind = "PostCreateConfig",
    plural = "postcreateconfigs",
    namespaced,
    status = "PostCreateConfigStatus",
    category = "cluster-api",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Matched",
        type_ = "integer",
        json_path = ".status.matchedClusters"
    ),
    printcolumn(
        name = "Applied",
        type_ = "integer",
        json_path = ".status.appliedClusters"
    ),
    printcolumn(
        name = "OutOfDate",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"OutOfDate\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct PostCreateConfigSpec {
    /// Clusters (in this namespace) whose labels match get the resources. An empty selector
    /// matches nothing.
    pub cluster_selector: LabelSelector,
    /// Secrets whose `addon.yaml` holds the resources (multi-document YAML), applied in
    /// this order after Namespaces and CRDs.
    pub resources: Vec<ResourceRef>,
    /// `ApplyOnce` (default) or `Reconcile`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<Strategy>,
}

/// A cluster the resources were applied to (the seed's `clusterRefList` entry).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ClusterRef {
    /// `Cluster`, or `NestedControlPlane` for a control plane no Cluster owns.
    pub kind: String,
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// UID: a cluster recreated with the same name is another cluster.
    pub uid: String,
}

/// What was applied to one cluster, and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AppliedResources {
    /// Name of the cluster.
    pub name: String,
    /// UID of the cluster.
    pub uid: String,
    /// SHA-256 over the Secrets' contents that were applied.
    pub hash: String,
    /// When they were applied.
    pub applied_at: Time,
}

/// What the controller did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PostCreateConfigStatus {
    /// Clusters that got every resource (never applied again under `ApplyOnce`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cluster_ref_list: Vec<ClusterRef>,
    /// Per cluster, the hash of what was applied and when.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied: Vec<AppliedResources>,
    /// Clusters the selector matches now.
    #[serde(default)]
    pub matched_clusters: i32,
    /// Matching clusters that got every resource.
    #[serde(default)]
    pub applied_clusters: i32,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `ResourcesAvailable`, `ResourcesApplied`, `OutOfDate`, `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_seeds_sample_reads_unchanged() {
        // Seed 001's sample PostCreateConfig, as written there.
        let pcc: PostCreateConfig = serde_json::from_value(serde_json::json!({
            "apiVersion": "postcreate.cluster.x-k8s.io/v1alpha3",
            "kind": "PostCreateConfig",
            "metadata": {"name": "postcreate-conf", "namespace": "default"},
            "spec": {
                "clusterSelector": {"matchLabels": {"postcreatelabelcni": "calico"}},
                "resources": [
                    {"name": "calico-addon", "namespace": "default"},
                    {"name": "network-policy-addon", "namespace": "nw-system"}
                ]
            }
        }))
        .unwrap();
        assert_eq!(pcc.spec.resources.len(), 2);
        assert_eq!(pcc.spec.strategy, None);
        let status: PostCreateConfigStatus = serde_json::from_value(serde_json::json!({
            "clusterRefList": [{"kind": "Cluster", "name": "postcreate-cluster", "namespace": "default", "uid": "6bfea78e-e305-48f0-9d74-7b521968e591"}]
        }))
        .unwrap();
        assert_eq!(status.cluster_ref_list[0].name, "postcreate-cluster");
    }
}
