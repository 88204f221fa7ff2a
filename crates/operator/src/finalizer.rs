//! One finalizer helper for every controller. The patch carries the resourceVersion it was
//! computed from, so the API server refuses it (409) when another writer changed the list
//! meanwhile, instead of dropping that writer's entry; the next pass computes it again.

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::error::Error;

/// Whether `obj` carries `finalizer`.
pub fn has<K: Resource>(obj: &K, finalizer: &str) -> bool {
    obj.finalizers().iter().any(|f| f == finalizer)
}

/// A merge patch that adds (`add`) or removes `finalizer`, keeping every other entry. Pure.
pub fn patch<K: Resource>(obj: &K, finalizer: &str, add: bool) -> serde_json::Value {
    let mut list: Vec<String> = obj
        .finalizers()
        .iter()
        .filter(|f| *f != finalizer)
        .cloned()
        .collect();
    if add {
        list.push(finalizer.to_string());
    }
    serde_json::json!({"metadata": {
        "finalizers": list,
        "resourceVersion": obj.resource_version(),
    }})
}

async fn write<K>(api: &Api<K>, obj: &K, finalizer: &str, add: bool) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch(obj, finalizer, add)),
    )
    .await?;
    Ok(())
}

/// Add `finalizer` unless it is there (before anything it guards is made).
pub async fn add<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    if has(obj, finalizer) {
        return Ok(());
    }
    write(api, obj, finalizer, true).await
}

/// Remove `finalizer` if it is there (once what it guards is gone).
pub async fn remove<K>(api: &Api<K>, obj: &K, finalizer: &str) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    if !has(obj, finalizer) {
        return Ok(());
    }
    write(api, obj, finalizer, false).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn a_finalizer_patch_keeps_other_writers_entries_and_names_its_version() {
        let mut o = ConfigMap::default();
        o.metadata.finalizers = Some(vec!["theirs".into(), "ours".into()]);
        o.metadata.resource_version = Some("42".into());
        assert!(has(&o, "ours") && !has(&o, "nobody"));
        let removed = patch(&o, "ours", false);
        assert_eq!(
            removed,
            serde_json::json!({"metadata": {"finalizers": ["theirs"], "resourceVersion": "42"}})
        );
        // Adding twice lists it once.
        let added = patch(&o, "ours", true);
        assert_eq!(
            added["metadata"]["finalizers"],
            serde_json::json!(["theirs", "ours"])
        );
    }
}
