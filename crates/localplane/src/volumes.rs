//! Volumes for the management plane's nodes: a small dynamic provisioner (as kind's
//! local-path provisioner) for the default storage class [`STORAGE_CLASS`]. A claim of that
//! class gets a directory under the plane's `volumes/` and a `local` PersistentVolume bound to
//! it (kubelets apply the pod's `fsGroup` to `local` volumes, unlike `hostPath`); a released
//! volume's directory and PersistentVolume are deleted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    LocalVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference,
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec, VolumeNodeAffinity,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

/// The default storage class of a plane with nodes.
pub const STORAGE_CLASS: &str = "nestplane-local";

/// The provisioner's name (the class's `provisioner`, the volumes' `provisioned-by`).
pub const PROVISIONER: &str = "nestplane.io/local";

const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// The storage class (default class of the plane).
pub fn storage_class() -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some(STORAGE_CLASS.into()),
            annotations: Some(
                [(
                    "storageclass.kubernetes.io/is-default-class".to_string(),
                    "true".to_string(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        provisioner: PROVISIONER.into(),
        reclaim_policy: Some("Delete".into()),
        volume_binding_mode: Some("Immediate".into()),
        ..StorageClass::default()
    }
}

/// The PersistentVolume for `claim` at `path`, usable on `nodes` (they share this machine's
/// filesystem). Pure.
pub fn volume_for(
    claim: &PersistentVolumeClaim,
    path: &Path,
    nodes: &[String],
) -> PersistentVolume {
    let spec = claim.spec.clone().unwrap_or_default();
    let size = spec
        .resources
        .and_then(|r| r.requests)
        .and_then(|r| r.get("storage").cloned())
        .unwrap_or_else(|| Quantity("1Gi".into()));
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(format!("pvc-{}", claim.uid().unwrap_or_default())),
            annotations: Some([(PROVISIONED_BY.to_string(), PROVISIONER.to_string())].into()),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some([("storage".to_string(), size)].into()),
            access_modes: Some(
                spec.access_modes
                    .unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
            ),
            persistent_volume_reclaim_policy: Some("Delete".into()),
            storage_class_name: Some(STORAGE_CLASS.into()),
            local: Some(LocalVolumeSource {
                path: path.to_string_lossy().into_owned(),
                ..LocalVolumeSource::default()
            }),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: claim.namespace(),
                name: Some(claim.name_any()),
                uid: claim.uid(),
                ..ObjectReference::default()
            }),
            node_affinity: Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: "kubernetes.io/hostname".into(),
                            operator: "In".into(),
                            values: Some(nodes.to_vec()),
                        }]),
                        ..NodeSelectorTerm::default()
                    }],
                }),
            }),
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    }
}

/// Provision and delete volumes until the task is aborted.
pub async fn run(client: kube::Client, dir: PathBuf, nodes: Vec<String>) {
    let claims: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let volumes: Api<PersistentVolume> = Api::all(client);
    loop {
        if let Err(e) = pass(&claims, &volumes, &dir, &nodes).await {
            tracing::debug!(error = %e, "volume provisioner");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn pass(
    claims: &Api<PersistentVolumeClaim>,
    volumes: &Api<PersistentVolume>,
    dir: &Path,
    nodes: &[String],
) -> Result<(), kube::Error> {
    for c in claims.list(&ListParams::default()).await?.items {
        let spec = c.spec.clone().unwrap_or_default();
        let pending = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
        if !pending
            || spec.volume_name.is_some()
            || spec.storage_class_name.as_deref() != Some(STORAGE_CLASS)
            || c.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        let path = dir.join(format!(
            "{}-{}-{}",
            c.namespace().unwrap_or_default(),
            c.name_any(),
            c.uid().unwrap_or_default()
        ));
        if std::fs::create_dir_all(&path).is_err() {
            continue;
        }
        let pv = volume_for(&c, &path, nodes);
        match volumes.create(&PostParams::default(), &pv).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    for v in volumes.list(&ListParams::default()).await?.items {
        let ours = v.annotations().get(PROVISIONED_BY).map(String::as_str) == Some(PROVISIONER);
        let released = matches!(
            v.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Released") | Some("Failed")
        );
        if !ours || !released {
            continue;
        }
        if let Some(path) = v
            .spec
            .as_ref()
            .and_then(|s| s.local.as_ref())
            .map(|l| PathBuf::from(&l.path))
            && path.starts_with(dir)
        {
            // Best effort: what cannot be removed now is left for the next cleanup.
            let _ = std::fs::remove_dir_all(&path);
        }
        match volumes
            .delete(&v.name_any(), &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
