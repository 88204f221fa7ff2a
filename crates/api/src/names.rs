//! Well-known names, labels and keys shared by every crate.
//!
//! Secret names follow Cluster API's conventions (`<cluster>-ca`, `<cluster>-etcd`,
//! `<cluster>-proxy`, `<cluster>-sa`, `<cluster>-kubeconfig`); the leaf certificates and the
//! component kubeconfigs nestplane adds are named `<cluster>-<purpose>`.

/// Label Cluster API uses to find every object of a cluster.
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";

/// Annotation recording the cluster name a control plane's objects are named after, fixed when
/// it is first provisioned (so a Cluster owner reference that arrives later renames nothing).
pub const CLUSTER_IDENTITY_ANNOTATION: &str = "nestplane.io/cluster-name";

/// Annotation on a component object recording the version nestplane last rendered it at,
/// once it changes the version of a component that ran: a refused change keeps what was
/// rendered (which may be ahead of the last version that became Ready).
pub const RENDERED_VERSION_ANNOTATION: &str = "nestplane.io/rendered-version";

/// Annotation on a control plane (or its HostedCluster) asking for a rotation of the
/// service-account key; its value names the request (`nestplane rotate sa-key` writes the
/// time). A new value starts a new rotation once the last one completed.
pub const ROTATE_SA_KEY_ANNOTATION: &str = "nestplane.io/rotate-sa-key";
/// Annotation completing the service-account key rotation whose request it names: the old
/// key is no longer trusted.
pub const ROTATE_SA_KEY_COMPLETE_ANNOTATION: &str = "nestplane.io/rotate-sa-key-complete";
/// Annotation completing a service-account key rotation by itself this long after it reached
/// `Started` (`24h`, `2d`, …).
pub const ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION: &str =
    "nestplane.io/rotate-sa-key-complete-after";
/// Annotation on a control plane (or its HostedCluster) asking for a rotation of the cluster
/// CA (`nestplane rotate ca`); its value names the request, as for the service-account key.
pub const ROTATE_CA_ANNOTATION: &str = "nestplane.io/rotate-ca";
/// Annotation completing the cluster CA rotation whose request it names: the old CA is no
/// longer trusted.
pub const ROTATE_CA_COMPLETE_ANNOTATION: &str = "nestplane.io/rotate-ca-complete";
/// Annotation completing a cluster CA rotation by itself this long after it reached
/// `Started`.
pub const ROTATE_CA_COMPLETE_AFTER_ANNOTATION: &str = "nestplane.io/rotate-ca-complete-after";
/// Annotation on a control plane (or its HostedCluster) asking for a rotation of the
/// front-proxy CA (`nestplane rotate front-proxy-ca`): what the API server's client
/// certificate to aggregated API servers is signed by, and what it trusts request headers
/// (`X-Remote-User`) from.
pub const ROTATE_FRONT_PROXY_CA_ANNOTATION: &str = "nestplane.io/rotate-front-proxy-ca";
/// Annotation completing the front-proxy CA rotation whose request it names.
pub const ROTATE_FRONT_PROXY_CA_COMPLETE_ANNOTATION: &str =
    "nestplane.io/rotate-front-proxy-ca-complete";
/// Annotation completing a front-proxy CA rotation by itself this long after it reached
/// `Started`.
pub const ROTATE_FRONT_PROXY_CA_COMPLETE_AFTER_ANNOTATION: &str =
    "nestplane.io/rotate-front-proxy-ca-complete-after";
/// Key, in the `<cluster>-ca` secret, of the certificate of the CA that signs alone (the first
/// of `tls.crt`): the controller manager's `--cluster-signing-cert-file`, which must hold
/// exactly one certificate. Derived from `tls.crt`; nestplane keeps it so.
pub const SIGNER_CRT: &str = "signer.crt";
/// Key, in the `<cluster>-ca` secret during a rotation's `Signing` and `Started` phases, of
/// the CA being replaced: serving certificates it signed are kept until the rotation is
/// completed (a client that trusts only it keeps verifying the API server).
pub const PREVIOUS_CRT: &str = "previous.crt";
/// Key, in the `<cluster>-sa` or `<cluster>-ca` secret, of the new private key while it is
/// trusted but does not sign yet (a rotation's `Trusting` phase).
pub const NEXT_KEY: &str = "next.key";

/// The domain under which every tenant has a name at the shared gateway:
/// `<cluster>.<namespace>.nestplane.internal` (`.internal` is reserved for private use; no
/// DNS is needed: kubeconfigs carry the name as `tls-server-name`).
pub const GATEWAY_DOMAIN: &str = "nestplane.internal";

/// The name tenant `namespace/cluster` is reached by at the shared gateway (its ClientHello's
/// server name, and a name in its API server's certificate).
pub fn gateway_server_name(cluster: &str, namespace: &str) -> String {
    format!("{cluster}.{namespace}.{GATEWAY_DOMAIN}")
}

/// The API group of Cluster API's `Cluster`.
pub const CLUSTER_API_GROUP: &str = "cluster.x-k8s.io";
/// Cluster API's annotation for objects some other system manages. On a component object
/// (`NestedEtcd`, …) it hands the component to an out-of-tree controller: nestplane then
/// only reads its status. Its value names the manager (`nestplane` keeps it nestplane's).
pub const EXTERNALLY_MANAGED_ANNOTATION: &str = "cluster.x-k8s.io/managed-by";
/// Annotation that pauses reconciliation (on the control plane or on the Cluster).
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";
/// Secret type of every Cluster API secret.
pub const CAPI_SECRET_TYPE: &str = "cluster.x-k8s.io/secret";
/// Label naming the component an object belongs to.
pub const COMPONENT_LABEL: &str = "controlplane.cluster.x-k8s.io/component";
/// Label marking objects nestplane created (so cleanup never touches anything else).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "nestplane";
/// Finalizer on `NestedControlPlane` (stops processes and removes data on deletion).
pub const FINALIZER: &str = "controlplane.cluster.x-k8s.io/nestplane";

/// Key of a certificate in a TLS-style secret.
pub const TLS_CRT: &str = "tls.crt";
/// Key of a private key in a TLS-style secret.
pub const TLS_KEY: &str = "tls.key";
/// Key of the issuing CA certificate in a leaf-certificate secret.
pub const CA_CRT: &str = "ca.crt";
/// Key of a kubeconfig in a kubeconfig secret.
pub const KUBECONFIG_KEY: &str = "value";

/// Default Kubernetes version of a tenant when neither the control plane nor the component says.
pub const DEFAULT_KUBERNETES_VERSION: &str = "v1.20.2";

/// The longest cluster name nestplane accepts: every derived name (the longest is
/// `<cluster>-controller-manager-kubeconfig`, 33 more characters) must stay a valid
/// 63-character DNS label.
pub const MAX_CLUSTER_NAME_LEN: usize = 63 - "-controller-manager-kubeconfig".len();

/// Why `value` is not an RFC 1123 DNS label of at most `max` characters (lowercase letters,
/// digits and `-`, starting and ending with a letter or digit), or `None` when it is one.
/// Every name that becomes a path, a label or an object name passes this first: a label has
/// no `/`, no `.` and cannot be absolute, so it can never lead out of a directory. Pure.
pub fn dns_label_problem(value: &str, max: usize) -> Option<String> {
    if value.is_empty() {
        return Some("it is empty".into());
    }
    if value.len() > max {
        return Some(format!(
            "{value:?} has {} characters; at most {max} are allowed",
            value.len()
        ));
    }
    let ok_chars = value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let ok_ends = value
        .bytes()
        .next()
        .zip(value.bytes().last())
        .is_some_and(|(a, z)| a.is_ascii_alphanumeric() && z.is_ascii_alphanumeric());
    (!ok_chars || !ok_ends).then(|| {
        format!(
            "{value:?} is not a DNS label (lowercase letters, digits and '-', starting and ending with a letter or digit)"
        )
    })
}

/// Every secret nestplane creates for a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SecretPurpose {
    /// `<cluster>-ca`: cluster CA (`tls.crt`, `tls.key`).
    ClusterCa,
    /// `<cluster>-etcd`: etcd CA (`tls.crt`, `tls.key`).
    EtcdCa,
    /// `<cluster>-proxy`: front-proxy CA (`tls.crt`, `tls.key`).
    FrontProxyCa,
    /// `<cluster>-sa`: service-account key pair (`tls.crt` public key, `tls.key` private key).
    ServiceAccount,
    /// `<cluster>-kubeconfig`: admin kubeconfig (`value`).
    AdminKubeconfig,
    /// `<cluster>-etcd-server`: etcd serving certificate (`tls.crt`, `tls.key`, `ca.crt`).
    EtcdServer,
    /// `<cluster>-etcd-peer`: etcd peer certificate (`tls.crt`, `tls.key`, `ca.crt`).
    EtcdPeer,
    /// `<cluster>-apiserver-etcd-client`: the apiserver's etcd client certificate.
    ApiServerEtcdClient,
    /// `<cluster>-apiserver`: apiserver serving certificate (`tls.crt`, `tls.key`, `ca.crt`).
    ApiServer,
    /// `<cluster>-apiserver-kubelet-client`: apiserver → kubelet client certificate.
    ApiServerKubeletClient,
    /// `<cluster>-front-proxy-client`: aggregation-layer client certificate.
    FrontProxyClient,
    /// `<cluster>-controller-manager-kubeconfig`: kube-controller-manager kubeconfig (`value`).
    ControllerManagerKubeconfig,
    /// `<cluster>-scheduler-kubeconfig`: kube-scheduler kubeconfig (`value`).
    SchedulerKubeconfig,
    /// `<cluster>-controller-manager-serving`: kube-controller-manager serving certificate.
    ControllerManagerServing,
    /// `<cluster>-scheduler-serving`: kube-scheduler serving certificate.
    SchedulerServing,
    /// `<datastore>-datastore-root`: the client certificate of etcd's `root` user of a
    /// `NestedDatastore` nestplane runs (it manages the tenants' users and roles).
    DatastoreRoot,
}

impl SecretPurpose {
    /// All purposes, in creation order.
    pub const ALL: [SecretPurpose; 16] = [
        SecretPurpose::ClusterCa,
        SecretPurpose::EtcdCa,
        SecretPurpose::FrontProxyCa,
        SecretPurpose::ServiceAccount,
        SecretPurpose::AdminKubeconfig,
        SecretPurpose::EtcdServer,
        SecretPurpose::EtcdPeer,
        SecretPurpose::ApiServerEtcdClient,
        SecretPurpose::ApiServer,
        SecretPurpose::ApiServerKubeletClient,
        SecretPurpose::FrontProxyClient,
        SecretPurpose::ControllerManagerKubeconfig,
        SecretPurpose::SchedulerKubeconfig,
        SecretPurpose::ControllerManagerServing,
        SecretPurpose::SchedulerServing,
        SecretPurpose::DatastoreRoot,
    ];

    /// The suffix appended to the cluster name.
    pub fn suffix(self) -> &'static str {
        match self {
            SecretPurpose::ClusterCa => "ca",
            SecretPurpose::EtcdCa => "etcd",
            SecretPurpose::FrontProxyCa => "proxy",
            SecretPurpose::ServiceAccount => "sa",
            SecretPurpose::AdminKubeconfig => "kubeconfig",
            SecretPurpose::EtcdServer => "etcd-server",
            SecretPurpose::EtcdPeer => "etcd-peer",
            SecretPurpose::ApiServerEtcdClient => "apiserver-etcd-client",
            SecretPurpose::ApiServer => "apiserver",
            SecretPurpose::ApiServerKubeletClient => "apiserver-kubelet-client",
            SecretPurpose::FrontProxyClient => "front-proxy-client",
            SecretPurpose::ControllerManagerKubeconfig => "controller-manager-kubeconfig",
            SecretPurpose::SchedulerKubeconfig => "scheduler-kubeconfig",
            SecretPurpose::ControllerManagerServing => "controller-manager-serving",
            SecretPurpose::SchedulerServing => "scheduler-serving",
            SecretPurpose::DatastoreRoot => "root",
        }
    }

    /// The secret's name for `cluster`.
    pub fn secret_name(self, cluster: &str) -> String {
        format!("{cluster}-{}", self.suffix())
    }

    /// Whether the secret holds a certificate authority (never regenerated once it exists).
    pub fn is_ca(self) -> bool {
        matches!(
            self,
            SecretPurpose::ClusterCa
                | SecretPurpose::EtcdCa
                | SecretPurpose::FrontProxyCa
                | SecretPurpose::ServiceAccount
        )
    }
}

/// The four control-plane components.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// etcd.
    Etcd,
    /// kube-apiserver.
    ApiServer,
    /// kube-controller-manager.
    ControllerManager,
    /// kube-scheduler.
    Scheduler,
}

impl Component {
    /// All components in creation order.
    pub const ALL: [Component; 4] = [
        Component::Etcd,
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ];

    /// Short name used in object names and labels (`etcd`, `apiserver`, …).
    pub fn short_name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "apiserver",
            Component::ControllerManager => "controller-manager",
            Component::Scheduler => "scheduler",
        }
    }

    /// The binary (and container) name.
    pub fn binary(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
            Component::Scheduler => "kube-scheduler",
        }
    }

    /// Name of the workload (StatefulSet / Deployment, or process group): `<cluster>-<short>`.
    pub fn workload_name(self, cluster: &str) -> String {
        format!("{cluster}-{}", self.short_name())
    }

    /// The components this one waits for before it is created.
    pub fn dependencies(self) -> &'static [Component] {
        match self {
            Component::Etcd => &[],
            Component::ApiServer => &[Component::Etcd],
            Component::ControllerManager | Component::Scheduler => &[Component::ApiServer],
        }
    }
}

/// The address at which every nestplane node reaches its cluster's API servers: a proxy on
/// each node listens here, inside the node's network namespace (HyperShift's per-node proxy
/// uses the same address). API server certificates carry it; API servers of the `process`
/// runtime, which listen on loopback addresses nodes cannot route to, advertise it as the
/// `kubernetes` Service's endpoint.
pub const NODE_LOCAL_APISERVER: &str = "172.20.0.1";

/// Well-known ports (the same for pods and for local processes, which get their own
/// loopback address per tenant and replica).
pub mod ports {
    /// etcd client port.
    pub const ETCD_CLIENT: i32 = 2379;
    /// etcd peer port.
    pub const ETCD_PEER: i32 = 2380;
    /// etcd metrics / health port (plain HTTP, `/health`).
    pub const ETCD_METRICS: i32 = 2381;
    /// kube-apiserver secure port.
    pub const APISERVER: i32 = 6443;
    /// kube-controller-manager secure port.
    pub const CONTROLLER_MANAGER: i32 = 10257;
    /// kube-scheduler secure port.
    pub const SCHEDULER: i32 = 10259;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_lead_out_of_a_directory_are_not_labels() {
        for bad in [
            "",
            "/tmp/scratch",
            "..",
            "../other",
            "a/b",
            "a.b",
            "-a",
            "a-",
            "A",
            "a b",
            "a\0b",
        ] {
            assert!(dns_label_problem(bad, 63).is_some(), "{bad:?} passed");
        }
        for good in ["a", "demo", "team-prod", "x1", "1x"] {
            assert_eq!(dns_label_problem(good, 63), None, "{good:?}");
        }
        assert!(dns_label_problem(&"a".repeat(34), MAX_CLUSTER_NAME_LEN).is_some());
        assert_eq!(
            dns_label_problem(&"a".repeat(MAX_CLUSTER_NAME_LEN), MAX_CLUSTER_NAME_LEN),
            None
        );
    }
}
