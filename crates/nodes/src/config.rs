//! What a node is made of, as values: its addresses, and the configuration files of its
//! containerd, CNI network, kubelet and kube-proxy. Pure; [`crate::node`] writes and runs them.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The kubelet's `maxPods` when a pool does not say (the kubelet's own default).
pub const DEFAULT_MAX_PODS: u32 = 110;

/// What one node is, as its pool says: every field reaches the node ([`kubelet_config`],
/// the kubelet's flags, the node guard), and the whole of it is hashed ([`NodeSpec::hash`]),
/// so a field added here replaces the pool's nodes when it changes without anyone having to
/// remember to hash it. Where a node runs and how it joins are not here (see
/// [`crate::node::NodeConfig`]). Pure.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// Kubernetes version of the kubelet and kube-proxy (`v1.20.2`).
    pub version: String,
    /// Labels of the Node.
    pub labels: BTreeMap<String, String>,
    /// Taints of the Node (`key=value:Effect` or `key:Effect`).
    pub taints: Vec<String>,
    /// The kubelet's `maxPods` ([`DEFAULT_MAX_PODS`] when unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_pods: Option<u32>,
    /// The pod security level the node guard enforces below the tenant.
    pub pod_security: crate::guard::Level,
}

impl NodeSpec {
    /// A short hash of the whole spec: nodes whose hash differs from their pool's are
    /// replaced.
    pub fn hash(&self) -> String {
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        format!("{:x}", Sha256::digest(&bytes))[..10].to_string()
    }
}

/// The address every node's API proxy listens on, inside the node's network namespace (as
/// HyperShift's per-node proxy does): [`nestplane_api::names::NODE_LOCAL_APISERVER`].
/// Kubelets, kube-proxies and pods reach their cluster's API server here.
pub const NODE_LOCAL_APISERVER: Ipv4Addr = Ipv4Addr::new(172, 20, 0, 1);

/// Node slots on this machine: slot `n` owns `10.201.n.0/24` (the link to the host) and
/// `10.244.n.0/24` (its pods).
pub const MAX_SLOT: u8 = 250;

/// All pods of all nodes on this machine are in this range (each node has a /24 of it).
pub const POD_NETWORK: &str = "10.244.0.0/16";

/// A node's addresses and names on this machine, from its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Addresses {
    /// The slot (1..=[`MAX_SLOT`]).
    pub slot: u8,
    /// Network namespace name (`nestplane-n<slot>`).
    pub netns: String,
    /// Host end of the veth pair (`npn<slot>`).
    pub host_veth: String,
    /// The host's address on the link (`10.201.<slot>.1`).
    pub host_ip: Ipv4Addr,
    /// The node's address (`10.201.<slot>.2`), its `InternalIP`.
    pub node_ip: Ipv4Addr,
    /// The node's pod range (`10.244.<slot>.0/24`).
    pub pod_cidr: String,
}

impl Addresses {
    /// The addresses of `slot`.
    pub fn of(slot: u8) -> Addresses {
        Addresses {
            slot,
            netns: format!("nestplane-n{slot}"),
            host_veth: format!("npn{slot}"),
            host_ip: Ipv4Addr::new(10, 201, slot, 1),
            node_ip: Ipv4Addr::new(10, 201, slot, 2),
            pod_cidr: format!("10.244.{slot}.0/24"),
        }
    }
}

/// The files of a node, all under its directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The node's directory.
    pub dir: PathBuf,
}

impl Layout {
    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }
    /// containerd's configuration.
    pub fn containerd_config(&self) -> PathBuf {
        self.dir.join("containerd.toml")
    }
    /// CNI configuration directory.
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/net.d")
    }
    /// The kubelet's root directory.
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    /// The kubelet's certificates (`--cert-dir`).
    pub fn kubelet_pki(&self) -> PathBuf {
        self.kubelet_root().join("pki")
    }
    /// The kubelet's current client certificate and key, as it rotates them.
    pub fn kubelet_client_certificate(&self) -> PathBuf {
        self.kubelet_pki().join("kubelet-client-current.pem")
    }
    /// The kubelet's current serving certificate and key, when the cluster issued it
    /// (`serverTLSBootstrap`).
    pub fn kubelet_serving_certificate(&self) -> PathBuf {
        self.kubelet_pki().join("kubelet-server-current.pem")
    }
    /// The kubelet's configuration file.
    pub fn kubelet_config(&self) -> PathBuf {
        self.dir.join("kubelet-config.json")
    }
    /// The bootstrap kubeconfig (bootstrap token).
    pub fn bootstrap_kubeconfig(&self) -> PathBuf {
        self.dir.join("bootstrap-kubelet.conf")
    }
    /// The kubeconfig the kubelet writes once its CSR is approved.
    pub fn kubelet_kubeconfig(&self) -> PathBuf {
        self.dir.join("kubelet.conf")
    }
    /// The cluster's CA certificate.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    /// kube-proxy's configuration.
    pub fn kube_proxy_config(&self) -> PathBuf {
        self.dir.join("kube-proxy-config.json")
    }
    /// The name servers of pods with `dnsPolicy: Default` (the kubelet's `resolvConf`).
    pub fn resolv_conf(&self) -> PathBuf {
        self.dir.join("resolv.conf")
    }
    /// Logs of the node's processes.
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }
    /// The node guard's policy ([`crate::guard::Policy`]).
    pub fn guard_policy(&self) -> PathBuf {
        self.dir.join("guard.json")
    }
    /// The script containerd runs instead of runc ([`crate::guard::wrapper_script`]).
    pub fn guard_wrapper(&self) -> PathBuf {
        self.dir.join("runc-guard")
    }
    /// The kubelet's pod directories (what bind mounts of pods come from, with
    /// [`Layout::sandbox_dirs`]).
    pub fn kubelet_pods(&self) -> PathBuf {
        self.kubelet_root().join("pods")
    }
    /// containerd's directories of pod sandboxes (`/etc/hostname`, `/etc/resolv.conf`,
    /// `/dev/shm` of every container come from there).
    pub fn sandbox_dirs(&self) -> Vec<PathBuf> {
        ["containerd/root", "containerd/state"]
            .iter()
            .map(|d| self.dir.join(d).join("io.containerd.grpc.v1.cri/sandboxes"))
            .collect()
    }
    /// What the node's mount namespace shows as `/var/log` (pod logs stay with the node).
    pub fn var_log(&self) -> PathBuf {
        self.dir.join("var-log")
    }
}

/// The cgroup (in every hierarchy) under which the node's pods run.
pub fn cgroup_root(addrs: &Addresses) -> String {
    format!("/nestplane/n{}", addrs.slot)
}

/// containerd's configuration (version 2): its own root, state and sockets under the node's
/// directory, the CRI plugin with the node's CNI directory and the locally built pause image.
pub fn containerd_toml(layout: &Layout, pause_image: &str, runc: Option<&Path>) -> String {
    let d = &layout.dir;
    let q = |p: &Path| toml_string(&p.to_string_lossy());
    format!(
        r#"version = 2
root = {root}
state = {state}

[grpc]
  address = {sock}

[ttrpc]
  address = {ttrpc}

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {pause}
  # Without this every sandbox fails: runc cannot lower the OOM score below its caller's.
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"{options}
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = {cni}
"#,
        root = q(&d.join("containerd/root")),
        state = q(&d.join("containerd/state")),
        sock = q(&layout.containerd_socket()),
        ttrpc = q(&d.join("containerd.sock.ttrpc")),
        opt = q(&d.join("containerd/opt")),
        pause = toml_string(pause_image),
        cni = q(&layout.cni_conf_dir()),
        options = runc
            .map(|r| format!(
                "\n      [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n        BinaryName = {}",
                q(r)
            ))
            .unwrap_or_default(),
    )
}

fn toml_string(s: &str) -> String {
    // A JSON string is a valid TOML basic string for the characters paths and names use.
    Value::String(s.to_string()).to_string()
}

/// The node's pod network: a bridge in the node's namespace with the node's /24, masquerading
/// traffic that leaves it, IP allocations kept in the node's directory.
pub fn cni_conflist(layout: &Layout, addrs: &Addresses) -> String {
    json!({
        "cniVersion": "0.4.0",
        "name": "nestplane",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": layout.dir.join("cni/ipam").to_string_lossy(),
                    "ranges": [[{"subnet": addrs.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}},
            {"type": "loopback"}
        ]
    })
    .to_string()
}

/// What the kubelet is told about its cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterSettings {
    /// Cluster DNS server addresses (empty: none yet).
    pub cluster_dns: Vec<String>,
    /// The cluster domain (`cluster.local`).
    pub cluster_domain: String,
    /// The kubelet asks the cluster for its serving certificate (`serverTLSBootstrap`: a
    /// `kubernetes.io/kubelet-serving` request that somebody must approve) instead of signing
    /// its own; `kubectl logs/exec` then reach a kubelet whose certificate the cluster's CA
    /// issued.
    pub serving_certificates_from_cluster: bool,
    /// Pods with `dnsPolicy: Default` (cluster DNS itself, for names outside the cluster's
    /// zone) resolve through the host's end of the node's link (`10.201.<slot>.1:53`), where
    /// the machine's owner may run a resolver; without it they get no name servers. Nothing
    /// is sent off the machine either way.
    pub resolver_on_host: bool,
}

/// The `resolv.conf` pods with `dnsPolicy: Default` get: the host's end of the node's link
/// when `cluster.resolver_on_host`, else none.
pub fn resolv_conf(addrs: &Addresses, cluster: &ClusterSettings) -> String {
    if cluster.resolver_on_host {
        format!("nameserver {}\n", addrs.host_ip)
    } else {
        String::new()
    }
}

/// The free disk space under which a node reports disk pressure.
pub const NODE_DISK_RESERVE: &str = "512Mi";

/// The kubelet's configuration: serving on the node address, client certificates checked
/// against the cluster CA (so `kubectl logs/exec` work), webhook authentication and
/// authorization, cgroupfs under the node's own cgroup root, certificate rotation, and no
/// image garbage collection (images here cannot be pulled again).
///
/// Disk-pressure thresholds are absolute amounts, not percentages: a node's filesystem is the
/// machine's, shared with everything else on it, so "10 % free" (the kubelet's default) or
/// even "1 %" of a large shared disk taints every node for reasons no tenant controls. The
/// node still evicts when the disk is really about to fill.
pub fn kubelet_config(
    layout: &Layout,
    addrs: &Addresses,
    cluster: &ClusterSettings,
    spec: &NodeSpec,
) -> String {
    let mut v = json!({
        "kind": "KubeletConfiguration",
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "address": addrs.node_ip.to_string(),
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": layout.ca().to_string_lossy()}
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root(addrs),
        "failSwapOn": false,
        "rotateCertificates": true,
        "podCIDR": addrs.pod_cidr,
        "resolvConf": if cluster.resolver_on_host { layout.resolv_conf().to_string_lossy().into_owned() } else { String::new() },
        "clusterDomain": if cluster.cluster_domain.is_empty() { "cluster.local" } else { cluster.cluster_domain.as_str() },
        "serializeImagePulls": false,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": NODE_DISK_RESERVE,
            "nodefs.inodesFree": "1%",
            "imagefs.available": NODE_DISK_RESERVE
        },
        "volumePluginDir": layout.dir.join("volume-plugins").to_string_lossy(),
        "maxPods": spec.max_pods.unwrap_or(DEFAULT_MAX_PODS),
        // The node's status is computed every 2 s (not 10 s), so a node is Ready about 2 s
        // after the kubelet's first checks pass rather than up to 10 s. It is still sent
        // only when it changed or every 5 minutes (the node's lease is its heartbeat), and
        // that 5 minutes must be said: it defaults to the update frequency when that is set.
        "nodeStatusUpdateFrequency": "2s",
        "nodeStatusReportFrequency": "5m"
    });
    if !cluster.cluster_dns.is_empty() {
        v["clusterDNS"] = json!(cluster.cluster_dns);
    }
    if cluster.serving_certificates_from_cluster {
        v["serverTLSBootstrap"] = json!(true);
    }
    serde_json::to_string_pretty(&v).unwrap_or_default()
}

/// kube-proxy's configuration: iptables mode, the node's name, no changes to machine-wide
/// conntrack settings (it runs in the node's network namespace but `nf_conntrack_max` is the
/// machine's), credentials from the kubelet's kubeconfig.
pub fn kube_proxy_config(layout: &Layout, node_name: &str) -> String {
    serde_json::to_string_pretty(&json!({
        "kind": "KubeProxyConfiguration",
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "mode": "iptables",
        "hostnameOverride": node_name,
        "clusterCIDR": POD_NETWORK,
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": "0.0.0.0:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "clientConnection": {"kubeconfig": layout.kubelet_kubeconfig().to_string_lossy()},
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s"
        }
    }))
    .unwrap_or_default()
}

/// The kubelet's bootstrap kubeconfig: the node-local API address, the cluster CA, and a
/// bootstrap token (the only credential a node is given).
pub fn bootstrap_kubeconfig(layout: &Layout, port: u16, token: &str) -> String {
    let ca = layout.ca();
    nestplane_pki::write_kubeconfig(&nestplane_pki::KubeconfigSpec {
        cluster: "cluster",
        server: &format!("https://{NODE_LOCAL_APISERVER}:{port}"),
        server_name: None,
        authority: nestplane_pki::Authority::File(&ca.to_string_lossy()),
        user: "kubelet-bootstrap",
        credential: nestplane_pki::Credential::Token(token),
        namespace: None,
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            dir: "/n/worker-0".into(),
        }
    }

    #[test]
    fn the_node_local_address_is_the_one_api_servers_advertise() {
        assert_eq!(
            NODE_LOCAL_APISERVER.to_string(),
            nestplane_api::names::NODE_LOCAL_APISERVER
        );
    }

    #[test]
    fn slots_give_disjoint_addresses_and_short_interface_names() {
        let a = Addresses::of(7);
        let b = Addresses::of(250);
        assert_eq!(a.node_ip, Ipv4Addr::new(10, 201, 7, 2));
        assert_eq!(a.pod_cidr, "10.244.7.0/24");
        assert_ne!(a.pod_cidr, b.pod_cidr);
        assert!(b.host_veth.len() <= 15, "{}", b.host_veth);
    }

    #[test]
    fn containerd_keeps_everything_in_the_node_directory() {
        let t = containerd_toml(&layout(), "registry.k8s.io/pause:3.2", None);
        assert!(!t.contains("BinaryName"), "{t}");
        let guarded = containerd_toml(
            &layout(),
            "registry.k8s.io/pause:3.2",
            Some(Path::new("/n/worker-0/runc-guard")),
        );
        assert!(
            guarded.contains(
                "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n        BinaryName = \"/n/worker-0/runc-guard\""
            ),
            "{guarded}"
        );
        for needle in [
            r#"root = "/n/worker-0/containerd/root""#,
            r#"address = "/n/worker-0/containerd.sock""#,
            r#"conf_dir = "/n/worker-0/cni/net.d""#,
            "restrict_oom_score_adj = true",
            r#"sandbox_image = "registry.k8s.io/pause:3.2""#,
        ] {
            assert!(t.contains(needle), "{needle} missing from\n{t}");
        }
    }

    #[test]
    fn the_kubelet_trusts_the_cluster_ca_and_asks_the_api_server() {
        let v: Value = serde_json::from_str(&kubelet_config(
            &layout(),
            &Addresses::of(3),
            &ClusterSettings {
                cluster_dns: vec!["10.96.0.10".into()],
                cluster_domain: "cluster.local".into(),
                ..Default::default()
            },
            &NodeSpec::default(),
        ))
        .expect("json");
        assert_eq!(
            v["serverTLSBootstrap"],
            Value::Null,
            "signs its own by default"
        );
        assert_eq!(
            v["authentication"]["x509"]["clientCAFile"],
            "/n/worker-0/ca.crt"
        );
        assert_eq!(v["authentication"]["anonymous"]["enabled"], false);
        assert_eq!(v["authorization"]["mode"], "Webhook");
        assert_eq!(v["address"], "10.201.3.2");
        assert_eq!(v["cgroupRoot"], "/nestplane/n3");
        assert_eq!(v["clusterDNS"][0], "10.96.0.10");
    }

    #[test]
    fn a_kubelet_can_ask_the_cluster_for_its_serving_certificate() {
        let v: Value = serde_json::from_str(&kubelet_config(
            &layout(),
            &Addresses::of(3),
            &ClusterSettings {
                serving_certificates_from_cluster: true,
                ..Default::default()
            },
            &NodeSpec::default(),
        ))
        .expect("json");
        assert_eq!(v["serverTLSBootstrap"], true);
        assert_eq!(v["rotateCertificates"], true);
        assert_eq!(v["resolvConf"], "", "no name servers unless asked");
    }

    #[test]
    fn pods_outside_cluster_dns_can_resolve_through_the_host_end_of_the_link() {
        let cluster = ClusterSettings {
            resolver_on_host: true,
            ..Default::default()
        };
        let v: Value = serde_json::from_str(&kubelet_config(
            &layout(),
            &Addresses::of(3),
            &cluster,
            &NodeSpec::default(),
        ))
        .expect("json");
        assert_eq!(v["resolvConf"], "/n/worker-0/resolv.conf");
        assert_eq!(
            resolv_conf(&Addresses::of(3), &cluster),
            "nameserver 10.201.3.1\n"
        );
        assert_eq!(
            resolv_conf(&Addresses::of(3), &ClusterSettings::default()),
            ""
        );
    }

    #[test]
    fn disk_pressure_is_an_absolute_reserve_not_a_share_of_the_machines_disk() {
        let v: Value = serde_json::from_str(&kubelet_config(
            &layout(),
            &Addresses::of(3),
            &ClusterSettings::default(),
            &NodeSpec::default(),
        ))
        .expect("json");
        for signal in ["nodefs.available", "imagefs.available"] {
            let threshold = v["evictionHard"][signal].as_str().expect(signal);
            assert!(!threshold.ends_with('%'), "{signal} is {threshold}");
        }
        assert_eq!(v["imageGCHighThresholdPercent"], 100);
    }

    #[test]
    fn the_bootstrap_kubeconfig_holds_a_token_and_the_node_local_address() {
        let v: Value = serde_saphyr::from_str(&bootstrap_kubeconfig(
            &layout(),
            6443,
            "abcdef.0123456789abcdef",
        ))
        .expect("yaml");
        assert_eq!(
            v["clusters"][0]["cluster"]["server"],
            "https://172.20.0.1:6443"
        );
        assert_eq!(v["users"][0]["user"]["token"], "abcdef.0123456789abcdef");
        assert!(v["users"][0]["user"].get("client-certificate").is_none());
        assert_eq!(
            v["clusters"][0]["cluster"]["certificate-authority"],
            layout().ca().to_string_lossy().as_ref()
        );
        assert_eq!(v["current-context"], "kubelet-bootstrap@cluster");
    }

    #[test]
    fn every_field_of_a_node_spec_reaches_its_hash_and_max_pods_the_kubelet() {
        let base = NodeSpec {
            version: "v1.20.2".into(),
            ..Default::default()
        };
        let changed = [
            NodeSpec {
                version: "v1.20.1".into(),
                ..base.clone()
            },
            NodeSpec {
                labels: [("tier".to_string(), "web".to_string())].into(),
                ..base.clone()
            },
            NodeSpec {
                taints: vec!["gpu:NoSchedule".into()],
                ..base.clone()
            },
            NodeSpec {
                max_pods: Some(20),
                ..base.clone()
            },
            NodeSpec {
                pod_security: crate::guard::Level::Restricted,
                ..base.clone()
            },
        ];
        assert_eq!(base.hash(), base.clone().hash());
        for c in &changed {
            assert_ne!(c.hash(), base.hash(), "{c:?}");
        }
        let kubelet = |spec: &NodeSpec| -> Value {
            serde_json::from_str(&kubelet_config(
                &layout(),
                &Addresses::of(3),
                &ClusterSettings::default(),
                spec,
            ))
            .expect("json")
        };
        assert_eq!(kubelet(&base)["maxPods"], DEFAULT_MAX_PODS);
        assert_eq!(kubelet(&changed[3])["maxPods"], 20);
    }

    #[test]
    fn the_kubelet_looks_at_its_status_often_and_sends_it_seldom() {
        let v: Value = serde_json::from_str(&kubelet_config(
            &layout(),
            &Addresses::of(3),
            &ClusterSettings::default(),
            &NodeSpec::default(),
        ))
        .expect("json");
        assert_eq!(v["nodeStatusUpdateFrequency"], "2s");
        // Left out, the report frequency would follow the update frequency: a status
        // write every 2 s per node.
        assert_eq!(v["nodeStatusReportFrequency"], "5m");
    }
}
