//! Flags, ports and probes of each component, per Kubernetes version and network.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ContainerPort;
use nestplane_api::names::{
    Component, KUBECONFIG_KEY, NODE_LOCAL_APISERVER, SecretPurpose, TLS_CRT, TLS_KEY, ports,
};

use crate::addressing::{etcd_initial_cluster, etcd_peer_service_name};
use crate::pod::{DataVolume, ETCD_DATA_DIR, Mounts, Probes, port, probes};
use crate::version::etcd_minor_for;
use crate::{Network, RenderInput, etcd_client_urls};

/// Command-line flags, kept sorted by name.
#[derive(Debug, Default)]
pub(crate) struct Flags(BTreeMap<&'static str, String>);

impl Flags {
    fn set(&mut self, name: &'static str, value: impl Into<String>) {
        self.0.insert(name, value.into());
    }

    /// `--name=value`, sorted by name.
    pub(crate) fn into_args(self) -> Vec<String> {
        self.0
            .into_iter()
            .map(|(k, v)| format!("--{k}={v}"))
            .collect()
    }
}

/// Everything component-specific of a container.
pub(crate) struct Part {
    pub(crate) flags: Flags,
    pub(crate) mounts: Mounts,
    pub(crate) ports: Vec<ContainerPort>,
    pub(crate) probes: Probes,
    pub(crate) image: String,
}

/// The address a component binds to: its own address on the Loopback network (tenants share
/// the host), every address in a pod.
fn bind_address(input: &RenderInput) -> &'static str {
    match input.network {
        Network::Loopback { .. } => "$(POD_IP)",
        Network::Cluster => "0.0.0.0",
    }
}

pub(crate) fn part(c: Component, input: &RenderInput) -> Part {
    match c {
        Component::Etcd => etcd(input),
        Component::ApiServer => apiserver(input),
        Component::ControllerManager => controller_manager(input),
        Component::Scheduler => scheduler(input),
    }
}

fn kube_image(c: Component, input: &RenderInput) -> String {
    input.image(c.binary(), &input.version.to_string())
}

fn etcd(input: &RenderInput) -> Part {
    let mut m = Mounts::new(&input.cluster);
    let mut f = Flags::default();
    let cluster = &input.cluster;

    let (listen, advertise) = match &input.network {
        Network::Loopback { .. } => ("$(POD_IP)".to_string(), "$(POD_IP)".to_string()),
        Network::Cluster => (
            "0.0.0.0".to_string(),
            format!(
                "$(POD_NAME).{}.{}.svc",
                etcd_peer_service_name(cluster),
                input.namespace
            ),
        ),
    };
    m.data(match input.network {
        Network::Loopback { .. } => DataVolume::EmptyDir,
        Network::Cluster => DataVolume::ClaimTemplate,
    });

    f.set("name", "$(POD_NAME)");
    f.set("data-dir", ETCD_DATA_DIR);
    f.set(
        "listen-client-urls",
        format!("https://{listen}:{}", ports::ETCD_CLIENT),
    );
    f.set(
        "advertise-client-urls",
        format!("https://{advertise}:{}", ports::ETCD_CLIENT),
    );
    f.set(
        "listen-peer-urls",
        format!("https://{listen}:{}", ports::ETCD_PEER),
    );
    f.set(
        "initial-advertise-peer-urls",
        format!("https://{advertise}:{}", ports::ETCD_PEER),
    );
    f.set(
        "listen-metrics-urls",
        format!("http://{listen}:{}", ports::ETCD_METRICS),
    );
    f.set("initial-cluster", etcd_initial_cluster(input));
    f.set("initial-cluster-state", "new");
    f.set("initial-cluster-token", cluster.clone());
    f.set("snapshot-count", "10000");
    if let Some(retention) = &input.etcd_auto_compaction {
        f.set("auto-compaction-mode", "periodic");
        f.set("auto-compaction-retention", retention.clone());
    }
    if let Some(bytes) = input.etcd_quota_backend_bytes {
        f.set("quota-backend-bytes", bytes.to_string());
    }

    f.set("client-cert-auth", "true");
    f.set("trusted-ca-file", m.file(SecretPurpose::EtcdCa, TLS_CRT));
    f.set("cert-file", m.file(SecretPurpose::EtcdServer, TLS_CRT));
    f.set("key-file", m.file(SecretPurpose::EtcdServer, TLS_KEY));
    f.set("peer-client-cert-auth", "true");
    f.set(
        "peer-trusted-ca-file",
        m.file(SecretPurpose::EtcdCa, TLS_CRT),
    );
    f.set("peer-cert-file", m.file(SecretPurpose::EtcdPeer, TLS_CRT));
    f.set("peer-key-file", m.file(SecretPurpose::EtcdPeer, TLS_KEY));

    // What kubeadm sets for the etcd it pairs with the version: 3.5 has the checks as
    // experimental flags, 3.6 turned them into a feature gate and a stable flag.
    match etcd_minor_for(&input.version) {
        5 => {
            f.set("experimental-initial-corrupt-check", "true");
            f.set("experimental-watch-progress-notify-interval", "5s");
        }
        m if m >= 6 => {
            f.set("feature-gates", "InitialCorruptCheck=true");
            f.set("watch-progress-notify-interval", "5s");
        }
        _ => {}
    }

    Part {
        flags: f,
        mounts: m,
        ports: vec![
            port("client", ports::ETCD_CLIENT),
            port("peer", ports::ETCD_PEER),
            port("metrics", ports::ETCD_METRICS),
        ],
        probes: probes("metrics", false, "/health", "/health"),
        image: input.image("etcd", crate::etcd_version_for(&input.version)),
    }
}

fn apiserver(input: &RenderInput) -> Part {
    let mut m = Mounts::new(&input.cluster);
    let mut f = Flags::default();
    let v = &input.version;

    match input.network {
        // Loopback addresses cannot be endpoints of the `kubernetes` Service, and nodes could
        // not reach them: every node has a proxy at the node-local address instead.
        Network::Loopback { .. } => f.set("advertise-address", NODE_LOCAL_APISERVER),
        Network::Cluster => f.set("advertise-address", "$(POD_IP)"),
    }
    f.set("bind-address", bind_address(input));
    f.set("secure-port", ports::APISERVER.to_string());
    if !v.at_least(24) {
        // Removed in 1.24; before, 0 is the only value that keeps plain HTTP off.
        f.set("insecure-port", "0");
    }
    f.set("allow-privileged", "true");
    f.set("authorization-mode", "Node,RBAC");
    f.set("enable-admission-plugins", "NodeRestriction");
    f.set("enable-bootstrap-token-auth", "true");
    f.set("service-cluster-ip-range", input.service_cidr.clone());
    f.set(
        "service-account-issuer",
        format!("https://kubernetes.default.svc.{}", input.cluster_domain),
    );
    f.set(
        "service-account-key-file",
        m.file(SecretPurpose::ServiceAccount, TLS_CRT),
    );
    f.set(
        "service-account-signing-key-file",
        m.file(SecretPurpose::ServiceAccount, TLS_KEY),
    );

    f.set("client-ca-file", m.file(SecretPurpose::ClusterCa, TLS_CRT));
    f.set("tls-cert-file", m.file(SecretPurpose::ApiServer, TLS_CRT));
    f.set(
        "tls-private-key-file",
        m.file(SecretPurpose::ApiServer, TLS_KEY),
    );

    f.set("etcd-servers", etcd_client_urls(input).join(","));
    f.set("etcd-cafile", m.file(SecretPurpose::EtcdCa, TLS_CRT));
    f.set(
        "etcd-certfile",
        m.file(SecretPurpose::ApiServerEtcdClient, TLS_CRT),
    );
    f.set(
        "etcd-keyfile",
        m.file(SecretPurpose::ApiServerEtcdClient, TLS_KEY),
    );

    if let Some(prefix) = &input.datastore_prefix {
        // A shared datastore: every key under the tenant's own prefix (its etcd user may
        // touch nothing else), and no compaction from here: the API server's compactor
        // writes a key outside any prefix, and the datastore compacts itself.
        f.set("etcd-prefix", format!("{prefix}registry"));
        f.set("etcd-compaction-interval", "0");
    }

    f.set(
        "kubelet-client-certificate",
        m.file(SecretPurpose::ApiServerKubeletClient, TLS_CRT),
    );
    f.set(
        "kubelet-client-key",
        m.file(SecretPurpose::ApiServerKubeletClient, TLS_KEY),
    );
    f.set(
        "kubelet-preferred-address-types",
        "InternalIP,ExternalIP,Hostname",
    );

    f.set(
        "proxy-client-cert-file",
        m.file(SecretPurpose::FrontProxyClient, TLS_CRT),
    );
    f.set(
        "proxy-client-key-file",
        m.file(SecretPurpose::FrontProxyClient, TLS_KEY),
    );
    f.set("requestheader-allowed-names", "front-proxy-client");
    f.set(
        "requestheader-client-ca-file",
        m.file(SecretPurpose::FrontProxyCa, TLS_CRT),
    );
    f.set("requestheader-extra-headers-prefix", "X-Remote-Extra-");
    f.set("requestheader-group-headers", "X-Remote-Group");
    f.set("requestheader-username-headers", "X-Remote-User");

    Part {
        flags: f,
        mounts: m,
        ports: vec![port("https", ports::APISERVER)],
        probes: probes("https", true, "/livez", "/readyz"),
        image: kube_image(Component::ApiServer, input),
    }
}

/// Flags kube-controller-manager and kube-scheduler share: kubeconfigs, serving, and the
/// insecure port that only 1.20 and 1.21 still open by default.
fn common_controller_flags(
    input: &RenderInput,
    m: &mut Mounts,
    f: &mut Flags,
    kubeconfig: SecretPurpose,
    serving: SecretPurpose,
    secure_port: i32,
) {
    let kc = m.file(kubeconfig, KUBECONFIG_KEY);
    f.set("kubeconfig", kc.clone());
    f.set("authentication-kubeconfig", kc.clone());
    f.set("authorization-kubeconfig", kc);
    f.set("bind-address", bind_address(input));
    f.set("secure-port", secure_port.to_string());
    f.set("tls-cert-file", m.file(serving, TLS_CRT));
    f.set("tls-private-key-file", m.file(serving, TLS_KEY));
    f.set("leader-elect", "true");
    if !input.version.at_least(22) {
        // 1.20 and 1.21 serve plain HTTP on 10252/10251 unless --port=0; 1.22 made the flag a
        // no-op and later releases removed it.
        f.set("port", "0");
    }
}

fn controller_manager(input: &RenderInput) -> Part {
    let mut m = Mounts::new(&input.cluster);
    let mut f = Flags::default();
    common_controller_flags(
        input,
        &mut m,
        &mut f,
        SecretPurpose::ControllerManagerKubeconfig,
        SecretPurpose::ControllerManagerServing,
        ports::CONTROLLER_MANAGER,
    );
    f.set("client-ca-file", m.file(SecretPurpose::ClusterCa, TLS_CRT));
    f.set(
        "requestheader-client-ca-file",
        m.file(SecretPurpose::FrontProxyCa, TLS_CRT),
    );
    f.set("cluster-name", input.cluster.clone());
    // The signer alone: 1.20's signer refuses a file of more than one certificate, and
    // `tls.crt` holds two during a rotation of the CA.
    f.set(
        "cluster-signing-cert-file",
        m.file(SecretPurpose::ClusterCa, nestplane_api::names::SIGNER_CRT),
    );
    f.set(
        "cluster-signing-key-file",
        m.file(SecretPurpose::ClusterCa, TLS_KEY),
    );
    f.set("root-ca-file", m.file(SecretPurpose::ClusterCa, TLS_CRT));
    f.set(
        "service-account-private-key-file",
        m.file(SecretPurpose::ServiceAccount, TLS_KEY),
    );
    f.set("service-cluster-ip-range", input.service_cidr.clone());
    f.set("use-service-account-credentials", "true");
    f.set("controllers", "*,bootstrapsigner,tokencleaner");

    Part {
        flags: f,
        mounts: m,
        ports: vec![port("https", ports::CONTROLLER_MANAGER)],
        probes: probes("https", true, "/healthz", "/healthz"),
        image: kube_image(Component::ControllerManager, input),
    }
}

fn scheduler(input: &RenderInput) -> Part {
    let mut m = Mounts::new(&input.cluster);
    let mut f = Flags::default();
    common_controller_flags(
        input,
        &mut m,
        &mut f,
        SecretPurpose::SchedulerKubeconfig,
        SecretPurpose::SchedulerServing,
        ports::SCHEDULER,
    );
    Part {
        flags: f,
        mounts: m,
        ports: vec![port("https", ports::SCHEDULER)],
        probes: probes("https", true, "/healthz", "/healthz"),
        image: kube_image(Component::Scheduler, input),
    }
}
