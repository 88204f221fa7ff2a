//! Generic pieces of a pod template: labels, secret volumes and their mounts, probes,
//! security context.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    Capabilities, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    KeyToPath, ObjectFieldSelector, PodSecurityContext, Probe, SeccompProfile, SecretVolumeSource,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nestplane_api::names::{
    CLUSTER_NAME_LABEL, COMPONENT_LABEL, Component, KUBECONFIG_KEY, MANAGED_BY, MANAGED_BY_LABEL,
    SecretPurpose,
};

/// Directory under which every secret volume is mounted (`/etc/nestplane/<volume>`).
pub const SECRETS_ROOT: &str = "/etc/nestplane";
/// Name of etcd's data volume: an emptyDir on the Loopback network (the process runtime keeps
/// it as a persistent directory), the StatefulSet's volumeClaimTemplate on the Cluster network.
pub const ETCD_DATA_VOLUME: &str = "data";
/// Where etcd's data volume is mounted.
pub const ETCD_DATA_MOUNT: &str = "/var/lib/etcd";
/// etcd's `--data-dir` (a directory inside the data volume, so etcd creates it 0700).
pub const ETCD_DATA_DIR: &str = "/var/lib/etcd/data";
/// User (and group, and fsGroup) every container runs as.
pub const RUN_AS_USER: i64 = 65532;
/// Mode of every file of a secret volume (0600).
pub const SECRET_FILE_MODE: i32 = 0o600;
/// Env var holding the pod's (replica's) name; referenced as `$(POD_NAME)`.
pub const POD_NAME_ENV: &str = "POD_NAME";
/// Env var holding the pod's (replica's) IP; referenced as `$(POD_IP)`.
pub const POD_IP_ENV: &str = "POD_IP";

/// Name of the volume that holds secret `p` (also the last part of its mount path). No name
/// is a prefix of another, so rewriting mount paths in arguments is unambiguous.
pub fn secret_volume_name(p: SecretPurpose) -> &'static str {
    match p {
        SecretPurpose::ClusterCa => "cluster-ca",
        SecretPurpose::EtcdCa => "etcd-ca",
        SecretPurpose::FrontProxyCa => "front-proxy-ca",
        SecretPurpose::ServiceAccount => "service-account",
        SecretPurpose::AdminKubeconfig => "admin-kubeconfig",
        SecretPurpose::EtcdServer => "etcd-server",
        SecretPurpose::EtcdPeer => "etcd-peer",
        SecretPurpose::ApiServerEtcdClient => "apiserver-etcd-client",
        SecretPurpose::ApiServer => "apiserver-serving",
        SecretPurpose::ApiServerKubeletClient => "apiserver-kubelet-client",
        SecretPurpose::FrontProxyClient => "front-proxy-client",
        SecretPurpose::ControllerManagerKubeconfig => "controller-manager-kubeconfig",
        SecretPurpose::SchedulerKubeconfig => "scheduler-kubeconfig",
        SecretPurpose::ControllerManagerServing => "controller-manager-serving",
        SecretPurpose::SchedulerServing => "scheduler-serving",
        SecretPurpose::DatastoreRoot => "datastore-root",
    }
}

/// Where secret `p` is mounted: `/etc/nestplane/<volume>`.
pub fn secret_mount_path(p: SecretPurpose) -> String {
    format!("{SECRETS_ROOT}/{}", secret_volume_name(p))
}

/// File name of a secret key inside its mount (the kubeconfig key `value` becomes
/// `kubeconfig`; other keys keep their names).
pub fn secret_file_name(key: &str) -> &str {
    if key == KUBECONFIG_KEY {
        "kubeconfig"
    } else {
        key
    }
}

/// Labels of every object of component `c` of `cluster`.
pub fn pod_labels(cluster: &str, c: Component) -> BTreeMap<String, String> {
    let mut l = selector_labels(cluster, c);
    l.insert(MANAGED_BY_LABEL.into(), MANAGED_BY.into());
    l
}

/// Labels selecting the pods of component `c` of `cluster` (for Services and workloads).
pub fn selector_labels(cluster: &str, c: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        (CLUSTER_NAME_LABEL.to_string(), cluster.to_string()),
        (COMPONENT_LABEL.to_string(), c.short_name().to_string()),
    ])
}

/// How etcd's data volume is provided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DataVolume {
    /// An emptyDir volume in the template.
    EmptyDir,
    /// Only the mount: the StatefulSet's volumeClaimTemplate provides the volume.
    ClaimTemplate,
}

/// Collects the secret files a container references and turns them into volumes and mounts.
#[derive(Debug)]
pub(crate) struct Mounts {
    cluster: String,
    secrets: BTreeMap<SecretPurpose, BTreeSet<&'static str>>,
    data: Option<DataVolume>,
}

impl Mounts {
    pub(crate) fn new(cluster: &str) -> Self {
        Mounts {
            cluster: cluster.to_string(),
            secrets: BTreeMap::new(),
            data: None,
        }
    }

    /// The path of `key` of secret `p`, mounting it.
    pub(crate) fn file(&mut self, p: SecretPurpose, key: &'static str) -> String {
        self.secrets.entry(p).or_default().insert(key);
        format!("{}/{}", secret_mount_path(p), secret_file_name(key))
    }

    /// Mount etcd's data volume at [`ETCD_DATA_MOUNT`].
    pub(crate) fn data(&mut self, how: DataVolume) {
        self.data = Some(how);
    }

    /// The secrets mounted, in [`SecretPurpose`] order.
    pub(crate) fn purposes(&self) -> Vec<SecretPurpose> {
        self.secrets.keys().copied().collect()
    }

    pub(crate) fn volumes(&self) -> Vec<Volume> {
        let mut out = Vec::new();
        if self.data == Some(DataVolume::EmptyDir) {
            out.push(Volume {
                name: ETCD_DATA_VOLUME.into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            });
        }
        for (p, keys) in &self.secrets {
            out.push(Volume {
                name: secret_volume_name(*p).into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some(p.secret_name(&self.cluster)),
                    default_mode: Some(SECRET_FILE_MODE),
                    items: Some(
                        keys.iter()
                            .map(|k| KeyToPath {
                                key: (*k).to_string(),
                                path: secret_file_name(k).to_string(),
                                mode: None,
                            })
                            .collect(),
                    ),
                    optional: Some(false),
                }),
                ..Default::default()
            });
        }
        out
    }

    pub(crate) fn volume_mounts(&self) -> Vec<VolumeMount> {
        let mut out = Vec::new();
        if self.data.is_some() {
            out.push(VolumeMount {
                name: ETCD_DATA_VOLUME.into(),
                mount_path: ETCD_DATA_MOUNT.into(),
                ..Default::default()
            });
        }
        for p in self.secrets.keys() {
            out.push(VolumeMount {
                name: secret_volume_name(*p).into(),
                mount_path: secret_mount_path(*p),
                read_only: Some(true),
                ..Default::default()
            });
        }
        out
    }
}

/// `POD_NAME` and `POD_IP` from the downward API.
pub(crate) fn downward_env() -> Vec<EnvVar> {
    let field = |name: &str, path: &str| EnvVar {
        name: name.into(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                api_version: Some("v1".into()),
                field_path: path.into(),
            }),
            ..Default::default()
        }),
    };
    vec![
        field(POD_NAME_ENV, "metadata.name"),
        field(POD_IP_ENV, "status.podIP"),
    ]
}

/// A named TCP container port.
pub(crate) fn port(name: &str, number: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: number,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// How long a component may take to answer its liveness endpoint after its container
/// started, before it is restarted (kubeadm's 4 minutes).
pub(crate) const STARTUP_SECONDS: i32 = 240;
/// How often a starting component is probed.
pub(crate) const STARTUP_PROBE_PERIOD: i32 = 1;
/// How long one startup probe may wait for its answer.
pub(crate) const STARTUP_PROBE_TIMEOUT: i32 = 5;

/// Probes of a container, kubeadm-like timings (but a startup probe that looks every second).
pub(crate) struct Probes {
    pub(crate) startup: Probe,
    pub(crate) liveness: Probe,
    pub(crate) readiness: Probe,
}

/// Startup, liveness and readiness probes over HTTP(S) GET to the named port.
pub(crate) fn probes(port_name: &str, https: bool, live: &str, ready: &str) -> Probes {
    let get = |path: &str| HTTPGetAction {
        path: Some(path.into()),
        port: IntOrString::String(port_name.into()),
        scheme: Some(if https { "HTTPS" } else { "HTTP" }.into()),
        ..Default::default()
    };
    Probes {
        // Looked at every second from the start, so a component is Ready about a second
        // after it answers rather than at the next of kubeadm's 10 s ticks; the same 4
        // minutes to start for an endpoint that refuses. An answer may take 5 s (a component
        // starting on a busy machine answers slowly; a 1 s timeout failed a scale-up under
        // the test suite's load), so one that hangs is given 240 looks of 5 s, 20 minutes
        // (probes of one container run one at a time). It stops once it passes.
        startup: Probe {
            http_get: Some(get(live)),
            period_seconds: Some(STARTUP_PROBE_PERIOD),
            timeout_seconds: Some(STARTUP_PROBE_TIMEOUT),
            failure_threshold: Some(STARTUP_SECONDS / STARTUP_PROBE_PERIOD),
            ..Default::default()
        },
        liveness: Probe {
            http_get: Some(get(live)),
            initial_delay_seconds: Some(10),
            period_seconds: Some(10),
            timeout_seconds: Some(15),
            failure_threshold: Some(8),
            ..Default::default()
        },
        readiness: Probe {
            http_get: Some(get(ready)),
            period_seconds: Some(1),
            timeout_seconds: Some(15),
            failure_threshold: Some(3),
            ..Default::default()
        },
    }
}

/// Container security context: non-root, no privilege escalation, no capabilities.
pub(crate) fn container_security() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS_USER),
        run_as_group: Some(RUN_AS_USER),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

/// Pod security context: the fsGroup makes secret files (0600) and etcd's volume readable and
/// writable by [`RUN_AS_USER`].
pub(crate) fn pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS_USER),
        run_as_group: Some(RUN_AS_USER),
        fs_group: Some(RUN_AS_USER),
        ..Default::default()
    }
}
