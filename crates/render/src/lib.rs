//! Per-component pod templates and Services of a tenant control plane, for Kubernetes
//! 1.20 through 1.34.
//!
//! Pure: values in, values out; no IO, no clock, no environment. The same input always gives
//! byte-identical serialized output (flags sorted by name, maps ordered).
//!
//! # One rendering, two runtimes
//!
//! Each component is rendered once as a [`PodTemplateSpec`] (plus Services). The Kubernetes
//! runtime puts it in a StatefulSet or Deployment; the process runtime runs the same template
//! as local processes. So that both work:
//!
//! - the container declares `POD_NAME` and `POD_IP` (downward API) and its arguments refer to
//!   them as `$(POD_NAME)` and `$(POD_IP)`;
//! - secrets are mounted under `/etc/nestplane/<volume>` ([`secret_mount_path`]) and etcd's data
//!   under `/var/lib/etcd`; arguments name files by their full path under those mounts;
//! - `command` is the bare binary name and every flag is an `--name=value` argument, sorted.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod addressing;
pub mod certificates;
pub mod channels;
mod components;
pub mod egress;
mod error;
mod input;
pub mod patch;
mod pod;
pub mod policy;
mod services;
pub mod upgrade;
mod version;
pub mod workload;

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod workload_tests;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, PodSpec, PodTemplateSpec, ResourceRequirements, Service,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nestplane_api::names::{Component, SecretPurpose};
use sha2::{Digest, Sha256};

pub use addressing::{
    HealthEndpoint, Sans, apiserver_internal_url, apiserver_sans, apiserver_service_name,
    controller_manager_sans, etcd_client_service_name, etcd_client_urls, etcd_peer_service_name,
    etcd_sans, health_endpoints, scheduler_sans,
};
pub use error::RenderError;
pub use input::{
    DEFAULT_CLUSTER_DOMAIN, DEFAULT_IMAGE_REGISTRY, DEFAULT_SERVICE_CIDR, Network, RenderInput,
    SERVICE_TYPES, first_service_ip,
};
pub use patch::PatchError;
pub use pod::{
    ETCD_DATA_DIR, ETCD_DATA_MOUNT, ETCD_DATA_VOLUME, POD_IP_ENV, POD_NAME_ENV, RUN_AS_USER,
    SECRET_FILE_MODE, SECRETS_ROOT, pod_labels, secret_file_name, secret_mount_path,
    secret_volume_name, selector_labels,
};
pub use version::{KubeVersion, MAX_SUPPORTED_MINOR, MIN_SUPPORTED_MINOR, etcd_version_for};
pub use workload::{Objects, SECRETS_CHECKSUM_ANNOTATION, objects, process_objects};

/// One component of a tenant, ready to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    /// The component.
    pub component: Component,
    /// `<cluster>-<short name>`: the StatefulSet / Deployment, or the process group; replica
    /// `i` is named `<workload_name>-<i>`.
    pub workload_name: String,
    /// Desired replicas.
    pub replicas: u32,
    /// The pod template (one container, named after the binary).
    pub pod_template: PodTemplateSpec,
    /// Services to create with it (Cluster network only): etcd's headless `<c>-etcd-peer`
    /// and client `<c>-etcd`, the API server's `<c>-apiserver`.
    pub services: Vec<Service>,
    /// The secrets the pod mounts, in [`SecretPurpose`] order; they must exist first.
    pub secrets: Vec<SecretPurpose>,
}

/// `GOGC` of the API server, controller-manager and scheduler (see [`render`]).
pub const GOGC: &str = "25";

/// Render component `c` of the tenant described by `input`.
pub fn render(c: Component, input: &RenderInput) -> Result<Rendered, RenderError> {
    input.validate()?;
    let part = components::part(c, input);
    let mut env = pod::downward_env();
    if c != Component::Etcd {
        // Density: Go's collector at 25% heap growth instead of 100%. An idle tenant's API
        // server keeps about 60 MiB less resident memory (anonymous memory 227 → 160 MiB,
        // measured on 1.20.2) at the same idle CPU; the price is more frequent collection
        // under churn. A patch of the container's env changes it per component.
        env.push(k8s_openapi::api::core::v1::EnvVar {
            name: "GOGC".into(),
            value: Some(GOGC.into()),
            value_from: None,
        });
    }
    env.sort_by(|a, b| a.name.cmp(&b.name));
    let container = Container {
        name: c.binary().into(),
        image: Some(part.image),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec![c.binary().into()]),
        args: Some(part.flags.into_args()),
        env: Some(env),
        ports: Some(part.ports),
        resources: Some(
            input
                .resources
                .get(&c)
                .cloned()
                .unwrap_or_else(|| default_resources(c)),
        ),
        volume_mounts: Some(part.mounts.volume_mounts()),
        startup_probe: Some(part.probes.startup),
        liveness_probe: Some(part.probes.liveness),
        readiness_probe: Some(part.probes.readiness),
        security_context: Some(pod::container_security()),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };
    let volumes = part.mounts.volumes();
    let pod_template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(pod_labels(&input.cluster, c)),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: (!volumes.is_empty()).then_some(volumes),
            security_context: Some(pod::pod_security()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            ..Default::default()
        }),
    };
    Ok(Rendered {
        component: c,
        workload_name: c.workload_name(&input.cluster),
        replicas: input.replicas_of(c),
        pod_template,
        services: services::services(c, input),
        secrets: part.mounts.purposes(),
    })
}

/// Render every component, in [`Component::ALL`] (dependency) order.
pub fn render_all(input: &RenderInput) -> Result<Vec<Rendered>, RenderError> {
    Component::ALL.iter().map(|c| render(*c, input)).collect()
}

/// kubeadm-like requests when the input gives no resources for a component.
fn default_resources(c: Component) -> ResourceRequirements {
    let cpu = match c {
        Component::Etcd => "100m",
        Component::ApiServer => "250m",
        Component::ControllerManager => "200m",
        Component::Scheduler => "100m",
    };
    let mut requests = BTreeMap::from([("cpu".to_string(), Quantity(cpu.into()))]);
    if c == Component::Etcd {
        requests.insert("memory".into(), Quantity("100Mi".into()));
    }
    ResourceRequirements {
        requests: Some(requests),
        ..Default::default()
    }
}

/// SHA-256 (lowercase hex) of the serialized pod template and the mounted secrets' names:
/// a checksum for a rollout annotation. It changes whenever what a replica runs changes
/// (version, flags — including etcd's member list, hence etcd's replicas — images, mounts),
/// but not with the component's own replica count, so scaling a Deployment does not roll it.
pub fn template_hash(r: &Rendered) -> String {
    let mut h = Sha256::new();
    // Serializing k8s-openapi types into a Vec cannot fail (no maps with non-string keys).
    h.update(serde_json::to_vec(&r.pod_template).unwrap_or_default());
    for p in &r.secrets {
        h.update(b"\0");
        h.update(p.suffix().as_bytes());
    }
    format!("{:x}", h.finalize())
}
