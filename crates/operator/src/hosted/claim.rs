//! Which objects belong to which HostedCluster: the control plane's namespace, and the claim
//! (annotations) a HostedCluster checks before it patches or deletes anything. Pure; shared
//! by the HostedCluster and NodePool controllers.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use nestplane_api::hosted::HostedCluster;

/// `namespace/name` of the HostedCluster an object was made for (cross-namespace, so not an
/// owner reference).
pub const HOSTED_CLUSTER_ANNOTATION: &str = "nestplane.io/hosted-cluster";
/// The UID of the HostedCluster an object was made for: with [`HOSTED_CLUSTER_ANNOTATION`],
/// the claim a HostedCluster checks before it patches or deletes anything (see [`made_for`]).
pub const HOSTED_CLUSTER_UID_ANNOTATION: &str = "nestplane.io/hosted-cluster-uid";

/// The namespace of a hosted cluster's control plane.
pub fn control_plane_namespace(hc: &HostedCluster) -> String {
    format!("{}-{}", hc.namespace().unwrap_or_default(), hc.name_any())
}

/// `namespace/name` of `hc`.
pub fn key(hc: &HostedCluster) -> String {
    format!("{}/{}", hc.namespace().unwrap_or_default(), hc.name_any())
}

/// The claim on an object made for `hc`.
pub fn annotations(hc: &HostedCluster) -> BTreeMap<String, String> {
    BTreeMap::from([
        (HOSTED_CLUSTER_ANNOTATION.to_string(), key(hc)),
        (
            HOSTED_CLUSTER_UID_ANNOTATION.to_string(),
            hc.uid().unwrap_or_default(),
        ),
    ])
}

/// Whether the object of `meta` was made for this very HostedCluster (its namespace/name and
/// its UID, so neither a same-named one in another namespace whose control-plane namespace
/// collides, nor a deleted and recreated one, nor anyone else's object qualifies). A
/// HostedCluster never patches, deletes or finalizes anything else.
pub fn made_for(meta: &ObjectMeta, hc: &HostedCluster) -> bool {
    let a = meta.annotations.as_ref();
    let get = |k: &str| a.and_then(|a| a.get(k));
    // Objects made before the UID annotation existed carry the namespace/name only.
    get(HOSTED_CLUSTER_ANNOTATION) == Some(&key(hc))
        && hc.uid().is_some()
        && get(HOSTED_CLUSTER_UID_ANNOTATION).is_none_or(|u| Some(u) == hc.uid().as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hc(ns: &str, name: &str, uid: &str) -> HostedCluster {
        let mut hc = HostedCluster::new(name, Default::default());
        hc.metadata.namespace = Some(ns.into());
        hc.metadata.uid = Some(uid.into());
        hc
    }

    #[test]
    fn only_what_was_made_for_this_very_hosted_cluster_is_claimed() {
        let a = hc("team", "a", "u1");
        let meta = ObjectMeta {
            annotations: Some(annotations(&a)),
            ..Default::default()
        };
        assert!(made_for(&meta, &a));
        assert_eq!(control_plane_namespace(&a), "team-a");
        // Recreated under the same name: another UID, not its object.
        assert!(!made_for(&meta, &hc("team", "a", "u2")));
        // "team-a" + "x" collides with "team" + "a-x" as a namespace, never as a claim.
        assert_eq!(
            control_plane_namespace(&hc("team-a", "x", "u3")),
            control_plane_namespace(&hc("team", "a-x", "u4"))
        );
        assert!(!made_for(&meta, &hc("team-a", "x", "u1")));
        assert!(!made_for(&ObjectMeta::default(), &a));
    }
}
