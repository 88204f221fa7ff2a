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

use std::sync::{Arc, OnceLock};

use kube::api::Api;
use kube::runtime::reflector::Store;
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
}

crate::context::wing_context!(HostedContext);

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
        }
    }

    /// A HostedCluster from the cache, else from the API server.
    pub async fn hosted_cluster(
        &self,
        ns: &str,
        name: &str,
    ) -> Result<Option<HostedCluster>, kube::Error> {
        crate::tenant::cached_or_get(self.clusters.get(), &self.client, ns, name).await
    }

    /// The NodePools of HostedCluster `ns/name`, listed live (a teardown must not miss one
    /// that a cache has not seen yet).
    pub async fn pools_of(&self, ns: &str, name: &str) -> Result<Vec<NodePool>, kube::Error> {
        let mine = |p: &NodePool| p.spec.cluster_name == name;
        Ok(Api::<NodePool>::namespaced(self.client.clone(), ns)
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(mine)
            .collect())
    }
}

/// Set condition `c` in `list` at `obj`'s generation.
pub(crate) fn set_condition<K: kube::Resource>(
    list: &mut Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>,
    obj: &K,
    c: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition,
    now: k8s_openapi::jiff::Timestamp,
) {
    nestplane_api::conditions::set(list, c, obj.meta().generation, now);
}
