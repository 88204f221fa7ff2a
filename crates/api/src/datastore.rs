//! `NestedDatastore`: one etcd that many tenants' API servers share, each tenant confined to
//! its own key prefix by an etcd user and role of its own (Kamaji's shared datastore).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// An etcd shared by many tenant control planes: one nestplane runs (`managed`) or one that
/// runs already (`external`). A `NestedControlPlane` uses it through `spec.datastoreRef`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedDatastore",
    namespaced,
    status = "NestedDatastoreStatus",
    shortname = "nds",
    category = "cluster-api",
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(name = "Type", type_ = "string", json_path = ".status.type"),
    printcolumn(name = "Tenants", type_ = "integer", json_path = ".status.tenantCount"),
    printcolumn(
        name = "Healthy",
        type_ = "string",
        json_path = ".status.healthyMembers"
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
pub struct NestedDatastoreSpec {
    /// An etcd nestplane runs (in the operator's runtime, persistent). The default when
    /// `external` is not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed: Option<ManagedDatastore>,
    /// An etcd that already runs, which nestplane only manages users and roles in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalDatastore>,
    /// The namespaces whose control planes may use this datastore, besides its own (the
    /// default: its own only). A control plane from elsewhere is refused and nothing is issued
    /// for it; withdrawing consent deletes nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_namespaces: Option<AllowedNamespaces>,
}

/// Namespaces allowed to use a datastore: by name, or by their labels.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedNamespaces {
    /// Namespace names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// Namespaces whose labels match (an empty selector matches none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

/// An etcd nestplane runs for the datastore.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ManagedDatastore {
    /// Members: 1 (default) or 3. Fixed once the etcd has formed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3))]
    pub replicas: Option<i32>,
    /// The Kubernetes version whose etcd runs (the operator's default when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// An etcd run by someone else.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalDatastore {
    /// Client URLs (`https://host:2379`).
    pub endpoints: Vec<String>,
    /// A Secret in the datastore's namespace holding the CA etcd trusts for clients:
    /// `tls.crt` and `tls.key` (the key signs each tenant's client certificate; it never
    /// leaves the datastore's namespace).
    pub ca_secret_name: String,
    /// A Secret in the datastore's namespace holding a client certificate of etcd's `root`
    /// user (`tls.crt`, `tls.key`): nestplane adds and removes tenants' users and roles with
    /// it, and enables authentication when it is off.
    pub root_secret_name: String,
}

/// What a tenant owns in a shared datastore.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreTenant {
    /// The control plane's namespace.
    pub namespace: String,
    /// The control plane's name.
    pub name: String,
    /// The etcd user and role (`nestplane:<namespace>:<cluster>`).
    pub user: String,
    /// The key prefix the user may read and write (`/nestplane/<namespace>/<cluster>/`).
    pub prefix: String,
}

/// The health of one etcd member as the datastore's client sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreMember {
    /// The member's client URL.
    pub endpoint: String,
    /// Whether it answered a status request.
    pub healthy: bool,
    /// etcd's version, as it reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Why it is not healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Observed state of a `NestedDatastore`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedDatastoreStatus {
    /// Every member healthy, authentication on, and nestplane able to manage users.
    #[serde(default)]
    pub ready: bool,
    /// `Managed` or `External`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r#type: Option<String>,
    /// Client URLs tenants' API servers use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Each member's health.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<DatastoreMember>,
    /// `healthy/all` members, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy_members: Option<String>,
    /// The tenants using this datastore.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<DatastoreTenant>,
    /// How many tenants use this datastore.
    #[serde(default)]
    pub tenant_count: i32,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions (`Ready`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Which datastore a control plane uses, and what it owns there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantDatastoreStatus {
    /// The `NestedDatastore`'s name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// The tenant's etcd user and role.
    pub user: String,
    /// The tenant's key prefix.
    pub prefix: String,
    /// The client URLs its API server uses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
}

/// The etcd user (and role) of a tenant: `nestplane:<namespace>:<cluster>` (a colon never
/// appears in a Kubernetes name, so no two tenants share one). Pure.
pub fn tenant_user(namespace: &str, cluster: &str) -> String {
    format!("nestplane:{namespace}:{cluster}")
}

/// The key prefix of a tenant: `/nestplane/<namespace>/<cluster>/` (the trailing slash keeps
/// tenant `a` out of tenant `ab`'s keys). Pure.
pub fn tenant_prefix(namespace: &str, cluster: &str) -> String {
    format!("/nestplane/{namespace}/{cluster}/")
}

/// The cluster name the objects of a managed datastore are named after (`<name>-datastore`:
/// its NestedEtcd `<name>-datastore-etcd`, its secrets `<name>-datastore-etcd…`).
pub fn datastore_cluster(name: &str) -> String {
    format!("{name}-datastore")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_of_different_tenants_never_nest() {
        let a = tenant_prefix("ns", "a");
        let ab = tenant_prefix("ns", "ab");
        assert!(!ab.starts_with(&a) && !a.starts_with(&ab));
        // A namespace/cluster split cannot be confused: '/' is not allowed in names.
        assert_ne!(tenant_prefix("a-b", "c"), tenant_prefix("a", "b-c"));
        assert_ne!(tenant_user("a-b", "c"), tenant_user("a", "b-c"));
    }
}
