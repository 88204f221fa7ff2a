//! The hosted wing: `HostedCluster` (a control plane, its infrastructure, a Cluster API
//! Cluster, cluster DNS) and `NodePool` (real nodes through the [`pool::machines`] seam),
//! in HyperShift's style. Its controllers share [`HostedContext`]: the operator's
//! [`Context`] and what only this wing needs.

pub mod claim;
pub mod cluster;
pub mod dns;
pub mod plan;
pub mod pool;
pub mod target;

use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use nestplane_api::hosted::{HostedCluster, NodePool};

use crate::context::Context;

/// What the HostedCluster and NodePool controllers share.
pub struct HostedContext {
    /// What every controller shares.
    pub core: Arc<Context>,
    /// Where NodePools make nodes (`None`: this operator makes none).
    pub nodes: Option<Arc<dyn pool::machines::NodeRuntime>>,
    /// How hosted clusters get cluster DNS.
    pub dns: dns::DnsSettings,
    /// One client per hosted cluster.
    pub targets: target::Targets,
    /// HostedClusters, from their shared watch.
    pub clusters: OnceLock<Store<HostedCluster>>,
    /// NodePools, from their shared watch.
    pub pools: OnceLock<Store<NodePool>>,
}

impl Deref for HostedContext {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.core
    }
}

impl AsRef<Context> for HostedContext {
    fn as_ref(&self) -> &Context {
        &self.core
    }
}

impl HostedContext {
    /// The wing's context on `core`.
    pub fn new(
        core: Arc<Context>,
        nodes: Option<Arc<dyn pool::machines::NodeRuntime>>,
        dns: dns::DnsSettings,
    ) -> HostedContext {
        HostedContext {
            core,
            nodes,
            dns,
            targets: Default::default(),
            clusters: OnceLock::new(),
            pools: OnceLock::new(),
        }
    }

    /// A HostedCluster from the cache, else from the API server.
    pub async fn hosted_cluster(
        &self,
        ns: &str,
        name: &str,
    ) -> Result<Option<HostedCluster>, kube::Error> {
        if let Some(hit) = self
            .clusters
            .get()
            .and_then(|s| s.get(&ObjectRef::new(name).within(ns)))
        {
            return Ok(Some((*hit).clone()));
        }
        Api::<HostedCluster>::namespaced(self.client.clone(), ns)
            .get_opt(name)
            .await
    }

    /// The NodePools of HostedCluster `ns/name`, from the cache, else from the API server.
    pub async fn pools_of(&self, ns: &str, name: &str) -> Result<Vec<NodePool>, kube::Error> {
        let mine = |p: &NodePool| {
            p.metadata.namespace.as_deref() == Some(ns) && p.spec.cluster_name == name
        };
        if let Some(store) = self.pools.get() {
            return Ok(store
                .state()
                .iter()
                .filter(|p| mine(p))
                .map(|p| (**p).clone())
                .collect());
        }
        Ok(Api::<NodePool>::namespaced(self.client.clone(), ns)
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(mine)
            .collect())
    }
}
