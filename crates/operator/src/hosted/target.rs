//! A hosted cluster as its controllers reach it: an admin client, its CA and API server
//! address, and the isolation group of its nodes. One client per cluster is kept and shared
//! (NodePools, cluster DNS) until the admin kubeconfig changes; reads come from the caches.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use nestplane_api::hosted::HostedCluster;
use nestplane_api::names;
use sha2::{Digest, Sha256};

use super::claim;
use crate::context::{Context, Error};

/// The hosted cluster's admin client, CA and API server address, once its control plane
/// serves.
#[derive(Clone)]
pub struct Target {
    /// The admin client (no retries of its own: every pass is retried).
    pub client: kube::Client,
    /// The cluster's CA certificate (PEM).
    pub ca_pem: String,
    /// The API server as this machine reaches it.
    pub apiserver: SocketAddr,
    /// Every API server replica as this machine reaches it, where the runtime knows them.
    pub replicas: Vec<SocketAddr>,
    /// The isolation group of every node of the cluster.
    pub group: u32,
    /// The user the control plane's processes run as on this machine, if they do.
    pub user: Option<u32>,
}

/// The isolation group of a hosted cluster's nodes when its control plane has no user of its
/// own on this machine: 31 bits of a hash of the control plane's `namespace/name`, with the
/// top bit set (tenant users' uids, the other groups, are below 2^31). Pure.
pub fn isolation_group(namespace: &str, cluster: &str) -> u32 {
    let d = Sha256::digest(format!("{namespace}/{cluster}").as_bytes());
    u32::from_be_bytes([d[0], d[1], d[2], d[3]]) | 0x8000_0000
}

/// Clients of hosted clusters, by control-plane `namespace/name`, with a hash of the
/// kubeconfig each was made from.
#[derive(Default)]
pub struct Targets(Mutex<HashMap<String, (String, kube::Client)>>);

impl Targets {
    fn cached(&self, key: &str, hash: &str) -> Option<kube::Client> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key)
            .filter(|(h, _)| h == hash)
            .map(|(_, c)| c.clone())
    }

    fn keep(&self, key: &str, hash: String, client: kube::Client) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(key.to_string(), (hash, client));
    }

    /// Forget a hosted cluster's client (it is being deleted).
    pub fn forget(&self, hc: &HostedCluster) {
        let key = format!("{}/{}", claim::control_plane_namespace(hc), hc.name_any());
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
    }

    /// The hosted cluster `hc`, once its own control plane is Ready and serves; `None` before.
    pub async fn get(&self, ctx: &Context, hc: &HostedCluster) -> Result<Option<Target>, Error> {
        let cp_ns = claim::control_plane_namespace(hc);
        let name = hc.name_any();
        let Some(ncp) = ctx.caches.ncp(&ctx.client, &cp_ns, &name).await? else {
            return Ok(None);
        };
        // Only what this HostedCluster's own control plane made.
        if !claim::made_for(&ncp.metadata, hc) || !ncp.status.as_ref().is_some_and(|s| s.ready) {
            return Ok(None);
        }
        let Some(ep) = ncp.spec.control_plane_endpoint.as_ref() else {
            return Ok(None);
        };
        let Ok(ip) = ep.host.parse::<std::net::IpAddr>() else {
            return Ok(None);
        };
        let kubeconfig_name = names::SecretPurpose::AdminKubeconfig.secret_name(&name);
        let kubeconfig = secret_value(ctx, &cp_ns, &kubeconfig_name, names::KUBECONFIG_KEY).await?;
        let ca = secret_value(
            ctx,
            &cp_ns,
            &names::SecretPurpose::ClusterCa.secret_name(&name),
            names::TLS_CRT,
        )
        .await?;
        let (Some(kubeconfig), Some(ca_pem)) = (kubeconfig, ca) else {
            return Ok(None);
        };
        // Nodes, and this operator's client, dial the API servers themselves where the runtime
        // knows them: the endpoint may be the shared gateway, which routes by a server name a
        // kubelet does not send (not ready until they are known, then).
        let replicas = ctx.runtime.apiserver_replicas(&ncp);
        let at_gateway = ncp
            .status
            .as_ref()
            .and_then(|s| s.gateway.as_ref())
            .is_some_and(|g| {
                g.server == format!("https://{}", SocketAddr::new(ip, ep.port as u16))
            });
        let apiserver = match replicas.first() {
            Some(r) => *r,
            None if at_gateway => return Ok(None),
            None => SocketAddr::new(ip, ep.port as u16),
        };
        let key = format!("{cp_ns}/{name}");
        let hash = format!("{:x}", Sha256::digest(kubeconfig.as_bytes()));
        let client = match self.cached(&key, &hash) {
            Some(c) => c,
            None => {
                let c = client_of(&kubeconfig, &kubeconfig_name, Some(apiserver)).await?;
                self.keep(&key, hash, c.clone());
                c
            }
        };
        // The control plane's user, where it has one, is unique on this machine: it is the
        // group too. Otherwise a hash of the control plane's key.
        let user = ctx.runtime.control_plane_user(&ncp)?;
        let group = user.unwrap_or_else(|| isolation_group(&cp_ns, &name));
        Ok(Some(Target {
            client,
            ca_pem,
            apiserver,
            replicas,
            group,
            user,
        }))
    }
}

/// A value of one of nestplane's Secrets, from the cache, else from the API server.
pub(crate) async fn secret_value(
    ctx: &Context,
    ns: &str,
    name: &str,
    key: &str,
) -> Result<Option<String>, Error> {
    let cached = ctx
        .caches
        .secrets
        .get()
        .and_then(|s| s.get(&ObjectRef::new(name).within(ns)));
    let secret = match cached {
        Some(s) => Some((*s).clone()),
        None => {
            kube::Api::<Secret>::namespaced(ctx.client.clone(), ns)
                .get_opt(name)
                .await?
        }
    };
    Ok(secret.and_then(|s| s.data).and_then(|d| {
        d.get(key)
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
    }))
}

/// A client of tenant `cluster` in `ns` from its admin kubeconfig (`None` while there is
/// none), dialling its API servers where this operator knows them
/// ([`crate::runtime::Runtime::first_replica`]), not the endpoint: that may be the shared
/// gateway.
pub(crate) async fn admin_client(
    ctx: &Context,
    ns: &str,
    cluster: &str,
) -> Result<Option<kube::Client>, Error> {
    let secret = names::SecretPurpose::AdminKubeconfig.secret_name(cluster);
    match secret_value(ctx, ns, &secret, names::KUBECONFIG_KEY).await? {
        Some(kubeconfig) => client_of(&kubeconfig, &secret, ctx.runtime.first_replica(ns, cluster))
            .await
            .map(Some),
        None => Ok(None),
    }
}

/// Clients from the admin kubeconfig in Secret `ns/secret`, one for each API server replica
/// at `replicas` (dialled there, not at the endpoint): what one replica counted the endpoint
/// would not say when it balances (`None` while there is no kubeconfig).
pub(crate) async fn admin_clients_at(
    ctx: &Context,
    ns: &str,
    secret: &str,
    replicas: &[SocketAddr],
) -> Result<Option<Vec<kube::Client>>, Error> {
    let Some(kubeconfig) = secret_value(ctx, ns, secret, names::KUBECONFIG_KEY).await? else {
        return Ok(None);
    };
    let mut clients = Vec::new();
    for at in replicas {
        clients.push(client_of(&kubeconfig, secret, Some(*at)).await?);
    }
    Ok(Some(clients))
}

/// A client from the admin kubeconfig (inline credentials only; errors say where, not what);
/// at the replica `at` when given (verified by its address, which its certificate names).
async fn client_of(
    kubeconfig: &str,
    secret: &str,
    at: Option<SocketAddr>,
) -> Result<kube::Client, Error> {
    let invalid = |reason: String| crate::secrets::SecretError::Invalid {
        name: secret.to_string(),
        reason,
    };
    let kc = nestplane_pki::read_kubeconfig(kubeconfig).map_err(invalid)?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| invalid(e.to_string()))?;
    if let Some(at) = at {
        cfg.cluster_url = format!("https://{at}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| invalid(e.to_string()))?;
        cfg.tls_server_name = None;
    }
    cfg.connect_timeout = Some(Duration::from_secs(5));
    cfg.read_timeout = Some(Duration::from_secs(30));
    // A 429 from an eviction is a PodDisruptionBudget's answer, not a transient failure: the
    // drain wants it at once (it retries every second until its timeout), not after the
    // client's own backoff has retried it for a minute. Every pass here is retried anyway.
    cfg.default_retry = false;
    kube::Client::try_from(cfg).map_err(|e| invalid(e.to_string()).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_hosted_cluster_without_a_user_has_its_own_isolation_group() {
        let a = isolation_group("default", "a");
        assert_eq!(a, isolation_group("default", "a"));
        assert_ne!(a, isolation_group("default", "b"));
        assert_ne!(a, isolation_group("other", "a"));
        assert!(a >= 0x8000_0000, "never a tenant user's uid");
    }
}
