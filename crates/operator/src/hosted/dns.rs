//! Cluster DNS kept in each hosted cluster (part of seed 002's "hosted cluster config"): the
//! chosen provider's objects are applied when missing or changed (a deleted one comes back;
//! a pass that finds them in place only reads), the other provider's Deployment is removed,
//! and availability is read from the Deployment's status.

use std::net::Ipv4Addr;

use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
};
use nestplane_api::hosted::DnsProvider;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The annotation holding a hash of what nestplane applied.
pub const APPLIED_ANNOTATION: &str = "nestplane.io/applied-hash";
/// The cluster domain of hosted clusters.
pub const ZONE: &str = "cluster.local";
/// Replicas of the DNS server.
pub const REPLICAS: i32 = 2;

/// How an operator chooses and deploys cluster DNS.
#[derive(Clone, Debug)]
pub struct DnsSettings {
    /// The provider of clusters whose spec names none (`None`: `Builtin` where nodes are made
    /// on this machine, `CoreDNS` elsewhere).
    pub default_provider: Option<DnsProvider>,
    /// Where CoreDNS images come from.
    pub registry: String,
}

impl Default for DnsSettings {
    fn default() -> Self {
        DnsSettings {
            default_provider: None,
            registry: nestplane_render::DEFAULT_IMAGE_REGISTRY.into(),
        }
    }
}

/// The DNS Deployment's name for a provider.
pub fn deployment_name(provider: DnsProvider) -> &'static str {
    match provider {
        DnsProvider::Builtin => "nestplane-dns",
        DnsProvider::CoreDns => "coredns",
    }
}

/// What a provider puts into a cluster of Kubernetes `minor` whose DNS Service is at
/// `service_ip`, each object annotated with the hash of its content. Pure.
pub fn manifests(
    provider: DnsProvider,
    service_ip: Ipv4Addr,
    minor: u32,
    settings: &DnsSettings,
) -> Vec<Value> {
    let objects = match provider {
        DnsProvider::Builtin => nestplane_dns::manifests(&nestplane_dns::Deployment {
            image: nestplane_nodes::images::OPERATOR_IMAGE.into(),
            service_ip: service_ip.to_string(),
            zone: ZONE.into(),
            replicas: REPLICAS,
        }),
        DnsProvider::CoreDns => {
            nestplane_dns::coredns::manifests(&nestplane_dns::coredns::CoreDns {
                registry: settings.registry.clone(),
                kubernetes_minor: minor,
                service_ip: service_ip.to_string(),
                zone: ZONE.into(),
                replicas: REPLICAS,
            })
        }
    };
    objects
        .into_iter()
        .map(|mut o| {
            let hash = format!(
                "{:x}",
                Sha256::digest(serde_json::to_vec(&o).unwrap_or_default())
            );
            o["metadata"]["annotations"][APPLIED_ANNOTATION] = Value::from(&hash[..16]);
            o
        })
        .collect()
}

/// The API of an object of these manifests (built-in kinds only).
fn api_for(client: &kube::Client, obj: &Value) -> (Api<DynamicObject>, String) {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default();
    let kind = obj["kind"].as_str().unwrap_or_default();
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let ar = ApiResource::from_gvk_with_plural(&gvk, &format!("{}s", kind.to_ascii_lowercase()));
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let api = match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    (api, name)
}

/// How the cluster DNS is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// An available replica serves.
    pub available: bool,
    /// What a person reads.
    pub message: String,
    /// How many objects this pass wrote (0 when all were in place).
    pub written: usize,
}

/// Keep `provider`'s cluster DNS in the cluster `client` talks to.
pub async fn keep(
    client: &kube::Client,
    provider: DnsProvider,
    service_ip: Ipv4Addr,
    minor: u32,
    settings: &DnsSettings,
) -> Result<Outcome, String> {
    let mut written = 0;
    for obj in manifests(provider, service_ip, minor, settings) {
        let (api, name) = api_for(client, &obj);
        let want = obj["metadata"]["annotations"][APPLIED_ANNOTATION].as_str();
        let current = api
            .get_opt(&name)
            .await
            .map_err(|e| format!("reading {} {name}: {e}", obj["kind"]))?;
        if current
            .as_ref()
            .and_then(|c| c.metadata.annotations.as_ref())
            .and_then(|a| a.get(APPLIED_ANNOTATION))
            .map(String::as_str)
            == want
        {
            continue;
        }
        api.patch(
            &name,
            &PatchParams::apply(crate::crds::FIELD_MANAGER).force(),
            &Patch::Apply(&obj),
        )
        .await
        .map_err(|e| format!("applying {} {name}: {e}", obj["kind"]))?;
        written += 1;
    }
    // The other provider's server goes (the Service is shared and was just re-applied).
    let other = match provider {
        DnsProvider::Builtin => DnsProvider::CoreDns,
        DnsProvider::CoreDns => DnsProvider::Builtin,
    };
    let deployments =
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(client.clone(), "kube-system");
    if deployments
        .get_opt(deployment_name(other))
        .await
        .map_err(|e| e.to_string())?
        .is_some()
    {
        deployments
            .delete(deployment_name(other), &DeleteParams::background())
            .await
            .map_err(|e| format!("removing {}: {e}", deployment_name(other)))?;
        written += 1;
    }
    let name = deployment_name(provider);
    let available = deployments
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .and_then(|d| d.status)
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    Ok(Outcome {
        available: available > 0,
        message: if available > 0 {
            format!(
                "{}: {available}/{REPLICAS} replicas of {name} available at {service_ip}",
                provider.as_str()
            )
        } else {
            format!(
                "{}: no replica of {name} available yet (it runs on the cluster's nodes)",
                provider.as_str()
            )
        },
        written,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_object_carries_the_hash_of_its_content() {
        let s = DnsSettings::default();
        let ip: Ipv4Addr = "10.96.0.10".parse().unwrap_or(Ipv4Addr::LOCALHOST);
        let a = manifests(DnsProvider::Builtin, ip, 20, &s);
        let b = manifests(DnsProvider::Builtin, ip, 20, &s);
        assert_eq!(a, b, "the same input, the same hashes");
        let other = manifests(
            DnsProvider::Builtin,
            "10.96.0.11".parse().unwrap_or(Ipv4Addr::LOCALHOST),
            20,
            &s,
        );
        let svc = |m: &[Value]| {
            m.iter()
                .find(|o| o["kind"] == "Service")
                .map(|o| o["metadata"]["annotations"][APPLIED_ANNOTATION].clone())
        };
        assert_ne!(svc(&a), svc(&other));
        let core = manifests(DnsProvider::CoreDns, ip, 20, &s);
        assert!(
            core.iter()
                .any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "coredns")
        );
        assert!(
            a.iter()
                .any(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "nestplane-dns")
        );
        for o in a.iter().chain(&core) {
            assert!(o["metadata"]["annotations"][APPLIED_ANNOTATION].is_string());
        }
    }
}
