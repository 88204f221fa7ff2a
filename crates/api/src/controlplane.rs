//! `controlplane.cluster.x-k8s.io/v1alpha1`: `NestedControlPlane` and its components.

use k8s_openapi::api::core::v1::{ObjectReference, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of the control-plane kinds.
pub const GROUP: &str = "controlplane.cluster.x-k8s.io";
/// The served (and stored) version.
pub const VERSION: &str = "v1alpha1";

/// The common specification of every control-plane component (seed 000's
/// `NestedComponentSpec`: `CommonSpec` + `PatchSpec` + resources + replicas).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedComponentSpec {
    /// The exact Kubernetes version of the component, e.g. `v1.20.2` (a missing `v` is
    /// added). Wins over `channel`. When neither is set, the control plane's version is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// A channel resolving to a version (for example `stable`); ignored when `version` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
    /// Patches applied to the rendered objects of the component.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "crate::schema::preserve_unknown_list")]
    pub patches: Vec<serde_json::Value>,
    /// Compute resources of each replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Number of replicas of the component (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 7))]
    pub replicas: Option<i32>,
}

/// Status fields shared by every component (seed 000's `CommonStatus`, plus conditions).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ComponentStatus {
    /// Whether every replica answers its health endpoint.
    #[serde(default)]
    pub ready: bool,
    /// A one-word summary: `Pending`, `WaitingForDependencies`, `Provisioning`, `Ready`,
    /// `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The version the component runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Replicas that answer their health endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions (`Ready`, `Paused`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The trust this component runs with, once Ready and rolled out: a fingerprint of each
    /// CA or service-account key secret it mounts, by the secret's suffix (`ca`, `etcd`,
    /// `proxy`, `sa`). A rotation moves on when every consumer runs the new one.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub credentials: std::collections::BTreeMap<String, String>,
}

/// How one etcd member is reached.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedEtcdAddress {
    /// IP address of the member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// Host name of the member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Client port of the member.
    pub port: i32,
}

/// etcd of a nested control plane.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedEtcd",
    namespaced,
    status = "NestedEtcdStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedEtcdSpec {
    /// Version, channel, patches, resources, replicas.
    #[serde(flatten)]
    pub component: NestedComponentSpec,
}

/// Which `NestedDatastore` a control plane uses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreRef {
    /// The datastore's name.
    pub name: String,
    /// Its namespace (the control plane's when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The bytes (keys and values) the tenant may store there: at most the datastore's
    /// `quota.tenantMax`; its `quota.tenantDefault` when unset. At the quota the tenant's API
    /// server refuses writes (reads keep working) until it is under again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

/// Observed state of a `NestedEtcd`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedEtcdStatus {
    /// How to reach each etcd member.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<NestedEtcdAddress>,
    /// Readiness, version, conditions.
    #[serde(flatten)]
    pub common: ComponentStatus,
}

/// kube-apiserver of a nested control plane.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedAPIServer",
    plural = "nestedapiservers",
    namespaced,
    status = "NestedAPIServerStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedAPIServerSpec {
    /// Version, channel, patches, resources, replicas.
    #[serde(flatten)]
    pub component: NestedComponentSpec,
    /// Type of the API server's Service in the `kubernetes` runtime: `ClusterIP` (default),
    /// `NodePort` or `LoadBalancer`. The control plane's endpoint follows the Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_type: Option<ApiServerServiceType>,
}

/// How the API server is exposed in the `kubernetes` runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ApiServerServiceType {
    /// Reachable inside the management cluster (the default).
    #[default]
    ClusterIP,
    /// On a port of every node.
    NodePort,
    /// Through the management cluster's load balancer.
    LoadBalancer,
}

impl ApiServerServiceType {
    /// The Service `type` value.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiServerServiceType::ClusterIP => "ClusterIP",
            ApiServerServiceType::NodePort => "NodePort",
            ApiServerServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

/// Observed state of a `NestedAPIServer`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedAPIServerStatus {
    /// The Service (or, for the process runtime, the address) exposing the apiserver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apiserver_service: Option<ObjectReference>,
    /// Readiness, version, conditions.
    #[serde(flatten)]
    pub common: ComponentStatus,
}

/// kube-controller-manager of a nested control plane.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedControllerManager",
    namespaced,
    status = "ComponentStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedControllerManagerSpec {
    /// Version, channel, patches, resources, replicas.
    #[serde(flatten)]
    pub component: NestedComponentSpec,
}

/// kube-scheduler of a nested control plane.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedScheduler",
    namespaced,
    status = "ComponentStatus",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Replicas",
        type_ = "integer",
        json_path = ".status.readyReplicas"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedSchedulerSpec {
    /// Version, channel, patches, resources, replicas.
    #[serde(flatten)]
    pub component: NestedComponentSpec,
}

/// Where the tenant's API server is reached (Cluster API's `APIEndpoint`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// Host name or IP address.
    pub host: String,
    /// Port.
    pub port: i32,
}

/// A tenant Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager and
/// kube-scheduler, each described by its own resource.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedControlPlane",
    namespaced,
    status = "NestedControlPlaneStatus",
    shortname = "ncp",
    category = "cluster-api",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Initialized",
        type_ = "boolean",
        json_path = ".status.initialized"
    ),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.version"),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".spec.controlPlaneEndpoint.host"
    ),
    printcolumn(
        name = "Port",
        type_ = "integer",
        json_path = ".spec.controlPlaneEndpoint.port",
        priority = 1
    ),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(
        name = "Available",
        type_ = "integer",
        json_path = ".status.availableReplicas"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "Datastore",
        type_ = "string",
        json_path = ".status.datastore.name",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedControlPlaneSpec {
    /// Reference to the `NestedEtcd` (created with defaults when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<ObjectReference>,
    /// Reference to the `NestedAPIServer` (created with defaults when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apiserver: Option<ObjectReference>,
    /// Reference to the `NestedControllerManager` (created with defaults when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller_manager: Option<ObjectReference>,
    /// Reference to the `NestedScheduler` (created with defaults when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<ObjectReference>,
    /// Kubernetes version of the control plane (`v1.20.2`; a missing `v` is added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Desired API server replicas (the Cluster API scale subresource).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 7))]
    pub replicas: Option<i32>,
    /// The tenant's service network and DNS domain (Cluster API's `clusterNetwork` shape;
    /// `10.96.0.0/12` and `cluster.local` when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_network: Option<ClusterNetwork>,
    /// Where the tenant API server is reached. Set by nestplane: the provider owns the
    /// endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// A shared `NestedDatastore` that stores the tenant's data instead of an etcd of its own
    /// (the default): the tenant gets an etcd user and role confined to its own key prefix.
    /// Changing it to another datastore moves the tenant's data there, live
    /// (`status.migration`, docs/backup.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datastore_ref: Option<DatastoreRef>,
}

/// A tenant's networks (Cluster API's `Cluster.spec.clusterNetwork`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetwork {
    /// The service network (the first block is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<NetworkRanges>,
    /// The pod network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NetworkRanges>,
    /// The DNS domain of Services (`cluster.local`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_domain: Option<String>,
}

/// CIDR blocks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkRanges {
    /// `a.b.c.d/n` each.
    #[serde(default)]
    pub cidr_blocks: Vec<String>,
}

/// `status.initialization` of the v1beta2 contract.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Initialization {
    /// True once the tenant API server has answered at least once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_initialized: Option<bool>,
}

/// Observed state of a `NestedControlPlane`: every field of the Cluster API control-plane
/// contract, v1beta1 and v1beta2.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedControlPlaneStatus {
    // v1beta1 contract
    /// The control plane has been reachable at least once.
    #[serde(default)]
    pub initialized: bool,
    /// The tenant API server is ready to receive requests.
    #[serde(default)]
    pub ready: bool,
    /// Non-terminated API server replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Ready API server replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// API server replicas running the desired template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_replicas: Option<i32>,
    /// Desired minus ready replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable_replicas: Option<i32>,
    /// Label selector (string form) of the API server replicas, for the scale subresource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The Kubernetes version that actually runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Always true: tenant control planes have no Nodes.
    #[serde(default)]
    pub external_managed_control_plane: bool,
    /// A terminal problem that needs a person (v1beta1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Details of `failureReason` (v1beta1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    // v1beta2 contract
    /// Initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// API server replicas available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_replicas: Option<i32>,
    /// API server replicas up to date.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub up_to_date_replicas: Option<i32>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions: `Available`, `Paused`, `EtcdReady`, `APIServerReady`,
    /// `ControllerManagerReady`, `SchedulerReady`, `CertificatesReady`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The shared datastore the tenant's data is in, once its user and role exist there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datastore: Option<crate::datastore::TenantDatastoreStatus>,
    /// The name this tenant's secrets, workloads, processes and data directory are named
    /// after, recorded when it was first provisioned. It never changes afterwards: a later
    /// edit of the `nestplane.io/cluster-name` annotation is refused (`InvalidSpec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    /// The last version change of the control plane: the one in progress, refused, or done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgrade: Option<UpgradeStatus>,
    /// Where the control plane is reached through the operator's shared gateway, when it runs
    /// one: one address for every tenant, each told apart by its server name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewayStatus>,
    /// Rotations of the control plane's keys: the one in progress, or the last one done.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rotations: Vec<RotationStatus>,
    /// The move of the tenant's data to another shared datastore (a change of
    /// `spec.datastoreRef`): the one in progress, or the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<MigrationStatus>,
}

/// A live move of a tenant's keys from one shared datastore to another
/// (`status.migration`). Its phases, in order: `Pending` (the destination cannot take the
/// tenant yet: the message says why), `Copying` (the keys at one revision of the source),
/// `Following` (the source's changes since, through a watch, until the copy is caught up),
/// `Freezing` (the tenant's role on the source made read-only: reads keep working, writes
/// fail; the last changes are applied and both sides' digests compared), `CuttingOver` (the
/// API server restarts onto the destination, one replica at a time), `Completed` (the source
/// keeps the tenant's keys read-only until `retainUntil`: the way back), and `Cancelled`
/// (the change was withdrawn before the cut-over: the source is writable again and the
/// partial copy deleted).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationStatus {
    /// The source: `<namespace>/<name>` of the NestedDatastore the data leaves.
    pub from: String,
    /// The destination: `<namespace>/<name>`.
    pub to: String,
    /// See the type's description.
    pub phase: String,
    /// The source revision the keys were first copied at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<i64>,
    /// Keys copied at that revision (after the freeze: the keys the tenant holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<i64>,
    /// How many revisions of the source the copy is behind, while following.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    /// The digest both sides had at the freeze.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// How long writes were refused, in seconds: from the freeze until the first API server
    /// on the destination wrote there (its lease; the others follow one at a time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_freeze_seconds: Option<f64>,
    /// The destination's revision at the cut-over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_revision: Option<i64>,
    /// Freezes lifted because they did not reach the cut-over in time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub thaws: i32,
    /// No new freeze before this (after a lifted one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Until when the source keeps the tenant's keys (read-only); they are deleted then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retain_until: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Whether the source's copy was deleted (after `retainUntil`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub source_removed: bool,
    /// What it waits for, or what went wrong and is tried again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One key's rotation (`status.rotations[]`), asked for with annotation
/// `nestplane.io/rotate-<target>` (`nestplane rotate`). Its phases, in order: `Trusting` (the
/// new key is trusted beside the old one everywhere), `Signing` (the new key signs), `Started`
/// (both are trusted and the new one signs: what was issued before keeps working; waits to be
/// completed), `Completing` (the legacy token Secrets were re-signed; the old key is dropped),
/// `Completed`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RotationStatus {
    /// What is rotated: `sa-key` (the service-account signing key) or `ca` (the cluster CA).
    pub target: String,
    /// The request this rotation answers (the annotation's value).
    pub id: String,
    /// `Trusting`, `Signing`, `Started`, `Completing` or `Completed`; `Blocked` when the key
    /// secret cannot be read (the message says why).
    pub phase: String,
    /// What happens now, or what the user may do next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The new key's ID (the `kid` of the tokens it signs), or the new CA's fingerprint (16
    /// hex digits of the SHA-256 of its certificate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// The old key's ID (or CA's fingerprint), while it is still trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_key_id: Option<String>,
}

/// `status.gateway`: a kubeconfig reaches the tenant through the gateway with `server` and
/// `tls-server-name: serverName` (the tenant's CA verifies the tenant's own certificate end to
/// end: the gateway never terminates TLS).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewayStatus {
    /// `https://HOST:PORT` of the gateway.
    pub server: String,
    /// The tenant's name there (`<cluster>.<namespace>.nestplane.internal`).
    pub server_name: String,
    /// The name machines of other hosts join at there (the tenant's door,
    /// `nodes.<serverName>`); absent where this runtime has no door yet, and machines then
    /// cannot join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machines: Option<String>,
}

/// `status.upgrade`: a version change as a plan of steps (one per minor), carried out in
/// order: etcd, then the API servers one replica at a time, then the controller manager and
/// the scheduler.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UpgradeStatus {
    /// The version the control plane ran when the change began (its oldest part's).
    pub from: String,
    /// The version asked for.
    pub to: String,
    /// The versions gone through, one per minor, the last being `to`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<String>,
    /// The step being carried out (absent once completed or refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<String>,
    /// `Progressing`, `Completed`, or `Refused` (what runs keeps its version).
    pub phase: String,
    /// What happens now, or why the change was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}
