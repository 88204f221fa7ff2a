//! The workloads of the `kubernetes` runtime: a rendered component as a StatefulSet (etcd)
//! or Deployment (the others), plus its Services, as plain JSON objects so that user patches
//! apply to them the same way in both runtimes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use nestplane_api::names::{self, Component};
use serde_json::{Value, json};

use crate::pod::{ETCD_DATA_VOLUME, selector_labels};
use crate::{RenderError, RenderInput, Rendered};

/// Pod-template annotation carrying the checksum of the mounted secrets: a new certificate
/// changes it and so rolls the pods.
pub const SECRETS_CHECKSUM_ANNOTATION: &str = "nestplane.io/secrets-checksum";
/// Pod-template annotation carrying [`crate::template_hash`].
pub const TEMPLATE_HASH_ANNOTATION: &str = "nestplane.io/template-hash";
/// Default size of an etcd member's volume.
pub const DEFAULT_ETCD_STORAGE: &str = "1Gi";

/// The JSON objects of one component: the workload first, then its Services.
#[derive(Clone, Debug, PartialEq)]
pub struct Objects {
    /// `apps/v1` StatefulSet (etcd) or Deployment.
    pub workload: Value,
    /// `v1` Services.
    pub services: Vec<Value>,
}

impl Objects {
    /// Every object, workload first.
    pub fn all_mut(&mut self) -> impl Iterator<Item = &mut Value> {
        std::iter::once(&mut self.workload).chain(self.services.iter_mut())
    }

    /// The workload's pod template (after patches: what the process runtime runs too).
    pub fn pod_template(&self) -> Result<PodTemplateSpec, RenderError> {
        let t = self
            .workload
            .pointer("/spec/template")
            .cloned()
            .unwrap_or(Value::Null);
        serde_json::from_value(t).map_err(|e| {
            RenderError::invalid(
                "patches",
                format!("the patched pod template is no longer valid: {e}"),
            )
        })
    }
}

/// Build the objects of `r`. `secrets_checksum` goes into the pod template's annotations;
/// `etcd_storage` is the size of each etcd member's claim.
pub fn objects(
    r: &Rendered,
    input: &RenderInput,
    secrets_checksum: &str,
    etcd_storage: &str,
) -> Objects {
    let mut template = serde_json::to_value(&r.pod_template).unwrap_or(Value::Null);
    // The template's own annotations (the egress configuration) and the two of the rollout.
    let mut annotations = template["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    annotations.insert(SECRETS_CHECKSUM_ANNOTATION.into(), json!(secrets_checksum));
    annotations.insert(
        TEMPLATE_HASH_ANNOTATION.into(),
        json!(crate::template_hash(r)),
    );
    template["metadata"]["annotations"] = Value::Object(annotations);
    let selector = selector_labels(&input.cluster, r.component);
    // Spread replicas across nodes (and zones when there are several), softly: a small
    // management cluster must still be able to run three members.
    template["spec"]["topologySpreadConstraints"] = json!([
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
         "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": selector}},
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
         "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": selector}},
    ]);
    let labels = crate::pod_labels(&input.cluster, r.component);
    let metadata = json!({
        "name": r.workload_name,
        "namespace": input.namespace,
        "labels": labels,
    });
    let workload = if r.component == Component::Etcd {
        let claim_labels: BTreeMap<&str, String> = BTreeMap::from([
            (names::CLUSTER_NAME_LABEL, input.cluster.clone()),
            (
                names::COMPONENT_LABEL,
                Component::Etcd.short_name().to_string(),
            ),
            (names::MANAGED_BY_LABEL, names::MANAGED_BY.to_string()),
        ]);
        json!({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": metadata,
            "spec": {
                "replicas": r.replicas,
                "serviceName": crate::etcd_peer_service_name(&input.cluster),
                // Every member must start for the initial cluster to form.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": template,
                "updateStrategy": {"type": "RollingUpdate"},
                "volumeClaimTemplates": [{
                    "metadata": {"name": ETCD_DATA_VOLUME, "labels": claim_labels},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": etcd_storage}},
                    },
                }],
            },
        })
    } else {
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata,
            "spec": {
                "replicas": r.replicas,
                "selector": {"matchLabels": selector},
                "template": template,
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
            },
        })
    };
    let services = r
        .services
        .iter()
        .map(|s| {
            let mut v = serde_json::to_value(s).unwrap_or(Value::Null);
            v["apiVersion"] = json!("v1");
            v["kind"] = json!("Service");
            v
        })
        .collect();
    Objects { workload, services }
}

/// The objects of `r` for the process runtime: only the workload matters there (its pod
/// template is what runs), but building it the same way lets the same patches apply.
pub fn process_objects(r: &Rendered, input: &RenderInput) -> Objects {
    objects(r, input, "", DEFAULT_ETCD_STORAGE)
}
