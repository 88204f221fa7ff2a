//! The CustomResourceDefinitions nestplane serves, as one multi-document YAML.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

use crate::controlplane::{
    NestedAPIServer, NestedControlPlane, NestedControllerManager, NestedEtcd, NestedScheduler,
};

/// Every CRD, in a stable order: the control-plane provider's, then the bootstrap
/// provider's.
pub fn all() -> Vec<CustomResourceDefinition> {
    let mut all = control_plane();
    all.extend(bootstrap());
    all
}

/// What the control-plane provider installs (`control-plane-components.yaml`).
pub fn control_plane() -> Vec<CustomResourceDefinition> {
    vec![
        NestedControlPlane::crd(),
        NestedEtcd::crd(),
        NestedAPIServer::crd(),
        NestedControllerManager::crd(),
        NestedScheduler::crd(),
        crate::datastore::NestedDatastore::crd(),
        crate::endpoint::ClusterEndpoint::crd(),
        crate::postcreate::PostCreateConfig::crd(),
        crate::hosted::HostedCluster::crd(),
        crate::hosted::NodePool::crd(),
        crate::hosted::ExternalInfraCluster::crd(),
        crate::backup::NestedBackup::crd(),
        crate::backup::NestedRestore::crd(),
        crate::backup::NestedBackupSchedule::crd(),
    ]
}

/// What the bootstrap provider installs (`bootstrap-components.yaml`): clusterctl lets one
/// provider own a CRD, so each kind is in exactly one of the two.
pub fn bootstrap() -> Vec<CustomResourceDefinition> {
    vec![
        crate::bootstrap::NestplaneConfig::crd(),
        crate::bootstrap::NestplaneConfigTemplate::crd(),
    ]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn contract_labels_scale_and_short_name() {
        let crds = all();
        let control_plane: Vec<_> = crds
            .iter()
            .filter(|c| c.spec.group == crate::controlplane::GROUP)
            // Cluster API references the control plane and its components, not datastores.
            .filter(|c| c.spec.names.kind != "NestedDatastore")
            .collect();
        assert_eq!(control_plane.len(), 5);
        for crd in control_plane {
            let labels = crd.metadata.labels.clone().unwrap();
            assert_eq!(labels["cluster.x-k8s.io/v1beta1"], "v1alpha1");
            assert_eq!(labels["cluster.x-k8s.io/v1beta2"], "v1alpha1");
            let v = &crd.spec.versions[0];
            assert!(
                v.subresources.as_ref().unwrap().status.is_some(),
                "{} has a status subresource",
                crd.spec.names.kind
            );
        }
        let ncp = &crds[0];
        assert_eq!(
            ncp.spec.names.short_names.as_deref(),
            Some(&["ncp".to_string()][..])
        );
        let scale = ncp.spec.versions[0]
            .subresources
            .as_ref()
            .unwrap()
            .scale
            .clone()
            .unwrap();
        assert_eq!(scale.spec_replicas_path, ".spec.replicas");
        assert_eq!(scale.status_replicas_path, ".status.replicas");
        assert_eq!(
            scale.label_selector_path.as_deref(),
            Some(".status.selector")
        );
    }
}
