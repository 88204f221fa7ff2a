//! Volumes for the management plane's nodes: a small dynamic provisioner (as kind's
//! local-path provisioner) for the default storage class [`STORAGE_CLASS`]. A claim of that
//! class gets a directory under the plane's `volumes/` and a `local` PersistentVolume bound to
//! it (kubelets apply the pod's `fsGroup` to `local` volumes, unlike `hostPath`); a released
//! volume's directory and PersistentVolume are deleted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;

/// The default storage class of a plane with nodes.
pub const STORAGE_CLASS: &str = "nestplane-local";

/// The provisioner's name (the class's `provisioner`, the volumes' `provisioned-by`).
pub const PROVISIONER: &str = "nestplane.io/local";

const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// The storage class (default class of the plane).
pub fn storage_class() -> serde_json::Value {
    json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "annotations": {
            "storageclass.kubernetes.io/is-default-class": "true"}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate"
    })
}

/// The PersistentVolume for `claim` at `path`, usable on `nodes` (they share this machine's
/// filesystem). Pure.
pub fn volume_for(
    claim: &PersistentVolumeClaim,
    path: &Path,
    nodes: &[String],
) -> serde_json::Value {
    let ns = claim.namespace().unwrap_or_default();
    let spec = claim.spec.clone().unwrap_or_default();
    let size = spec
        .resources
        .and_then(|r| r.requests)
        .and_then(|r| r.get("storage").cloned())
        .map(|q| q.0)
        .unwrap_or_else(|| "1Gi".into());
    json!({
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {
            "name": format!("pvc-{}", claim.uid().unwrap_or_default()),
            "annotations": {PROVISIONED_BY: PROVISIONER}
        },
        "spec": {
            "capacity": {"storage": size},
            "accessModes": spec.access_modes.unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "local": {"path": path.to_string_lossy()},
            "claimRef": {
                "apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "namespace": ns, "name": claim.name_any(), "uid": claim.uid()
            },
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{
                "key": "kubernetes.io/hostname", "operator": "In", "values": nodes
            }]}]}}
        }
    })
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
        let pv: PersistentVolume = serde_json::from_value(volume_for(&c, &path, nodes))
            .map_err(kube::Error::SerdeError)?;
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
