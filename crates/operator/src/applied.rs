//! What the `kubernetes` runtime applied, and the watch caches of what exists, so that a pass
//! that would send the same object again sends nothing.
//!
//! A pass renders every object of its component each time (cheap, pure); applying them each
//! time is not: a thousand starting tenants re-checked every few seconds would be hundreds of
//! server-side applies a second that change nothing. So an object is applied only when
//!
//! - what this operator would send differs from what it last sent (a digest of the body), or
//! - the object changed since then in a way only a writer of its spec causes (a workload's
//!   `metadata.generation`; any change of a Service, whose status rarely moves), or
//! - it is not in the watch cache (deleted, or not seen yet), or this operator has not applied
//!   it since it started (one apply per object after a restart).
//!
//! Otherwise the object is read from the watch cache, which is also where the rollout is
//! observed: no GET either.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::crds::FIELD_MANAGER;
use crate::error::Error;

/// The watch caches of nestplane's workloads and Services (label
/// `app.kubernetes.io/managed-by=nestplane`), and what was last applied.
#[derive(Default)]
pub struct Applied {
    /// StatefulSets (etcd).
    pub statefulsets: OnceLock<Store<StatefulSet>>,
    /// Deployments (API server, controller-manager, scheduler).
    pub deployments: OnceLock<Store<Deployment>>,
    /// Services.
    pub services: OnceLock<Store<Service>>,
    last: Mutex<HashMap<String, Sent>>,
}

#[derive(Clone, PartialEq, Eq)]
struct Sent {
    digest: [u8; 32],
    /// `metadata.generation` of a workload, `metadata.resourceVersion` of a Service, as the
    /// apply returned them.
    marker: String,
}

fn marker(kind: &str, obj: &Value) -> String {
    let field = if kind == "Service" {
        "/metadata/resourceVersion"
    } else {
        "/metadata/generation"
    };
    match obj.pointer(field) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

fn cached<K>(store: &OnceLock<Store<K>>, ns: &str, name: &str) -> Option<Value>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::Serialize + 'static,
{
    let hit = store.get()?.get(&ObjectRef::new(name).within(ns))?;
    let mut v = serde_json::to_value(hit.as_ref()).ok()?;
    // The cache holds typed objects without their type; the apply result has it.
    v["apiVersion"] = Value::String(K::api_version(&()).into_owned());
    v["kind"] = Value::String(K::kind(&()).into_owned());
    Some(v)
}

impl Applied {
    /// The object as the watch cache holds it.
    pub fn cached(&self, kind: &str, ns: &str, name: &str) -> Option<Value> {
        match kind {
            "StatefulSet" => cached(&self.statefulsets, ns, name),
            "Deployment" => cached(&self.deployments, ns, name),
            "Service" => cached(&self.services, ns, name),
            _ => None,
        }
    }

    /// A Service from the watch cache (`None` when there is no cache, or it lacks it).
    pub fn service(&self, ns: &str, name: &str) -> Option<Service> {
        self.services
            .get()?
            .get(&ObjectRef::new(name).within(ns))
            .map(|s| (*s).clone())
    }

    /// Server-side apply `obj` (forced, nestplane's field manager) unless it would change
    /// nothing (see the module's documentation); returns the object as it is.
    pub async fn apply(
        &self,
        client: &kube::Client,
        ns: &str,
        obj: &Value,
    ) -> Result<Value, Error> {
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let key = format!("{ns}/{name}/{kind}");
        let body = serde_json::to_vec(obj).map_err(|e| Error::Internal(e.to_string()))?;
        let digest: [u8; 32] = Sha256::digest(&body).into();
        if let Some(live) = self.cached(kind, ns, name) {
            let want = Sent {
                digest,
                marker: marker(kind, &live),
            };
            let same = self
                .last
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&key)
                == Some(&want);
            if same {
                return Ok(live);
            }
        }
        let out = send(client, ns, kind, name, obj).await?;
        self.last.lock().unwrap_or_else(|e| e.into_inner()).insert(
            key,
            Sent {
                digest,
                marker: marker(kind, &out),
            },
        );
        Ok(out)
    }

    /// Forget what was applied in namespace `ns` for objects named with `prefix` (a deleted
    /// tenant), so the memory does not grow with tenants that come and go.
    pub fn forget(&self, ns: &str, prefix: &str) {
        let start = format!("{ns}/{prefix}");
        self.last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k, _| !k.starts_with(&start));
    }
}

async fn send(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    name: &str,
    obj: &Value,
) -> Result<Value, Error> {
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let out = match kind {
        "StatefulSet" => {
            let api: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
            serde_json::to_value(api.patch(name, &pp, &Patch::Apply(obj)).await?)
        }
        "Deployment" => {
            let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
            serde_json::to_value(api.patch(name, &pp, &Patch::Apply(obj)).await?)
        }
        "Service" => {
            let api: Api<Service> = Api::namespaced(client.clone(), ns);
            serde_json::to_value(api.patch(name, &pp, &Patch::Apply(obj)).await?)
        }
        other => return Err(Error::Internal(format!("cannot apply a {other}"))),
    };
    out.map_err(|e| Error::Internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_is_marked_by_generation_and_a_service_by_resource_version() {
        let w = serde_json::json!({"metadata": {"generation": 3, "resourceVersion": "77"}});
        assert_eq!(marker("StatefulSet", &w), "3");
        assert_eq!(marker("Deployment", &w), "3");
        assert_eq!(marker("Service", &w), "77");
        assert_eq!(marker("Service", &serde_json::json!({})), "");
    }

    #[test]
    fn forgetting_a_tenant_keeps_the_others() {
        let a = Applied::default();
        let sent = Sent {
            digest: [0; 32],
            marker: "1".into(),
        };
        {
            let mut last = a.last.lock().unwrap_or_else(|e| e.into_inner());
            for k in [
                "ns/a-etcd/Service",
                "ns/a-etcd/StatefulSet",
                "ns/b-etcd/Service",
                "other/a-etcd/Service",
            ] {
                last.insert(k.into(), sent.clone());
            }
        }
        a.forget("ns", "a-");
        let mut left: Vec<String> = a
            .last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        left.sort();
        assert_eq!(left, ["ns/b-etcd/Service", "other/a-etcd/Service"]);
    }
}
