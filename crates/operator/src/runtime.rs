//! Where components run: one seam, two implementations.
//!
//! The component reconciler decides *whether* a component may run (owner, pause, version,
//! patches, dependencies) and turns what it observes into status. A [`Runtime`] makes it run
//! and reports what it sees:
//!
//! - [`crate::process::Processes`]: the rendered pod template as supervised local processes;
//!   health from each replica's health endpoint;
//! - [`crate::workloads::Workloads`]: the same rendering as a StatefulSet or Deployment plus
//!   Services in the management cluster; health from the rollout.
//!
//! Both issue the component's certificates from the same pure plan
//! ([`nestplane_render::certificates::plan`]) and judge patches under their own policy
//! ([`nestplane_render::policy`]).

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use nestplane_api::names::Component;
use nestplane_api::{ApiEndpoint, NestedControlPlane, NestedEtcdAddress};
use nestplane_render::{KubeVersion, RenderInput, policy};
use serde_json::Value;

use crate::error::Error;
use crate::secrets::ClusterSecrets;
use crate::tenant::Tenant;

/// One pass of one component, as the reconciler hands it to the runtime.
pub struct Pass<'a> {
    /// The management cluster.
    pub client: &'a kube::Client,
    /// When certificates are due.
    pub clock: &'a crate::clock::Clock,
    /// nestplane's secrets as its watch holds them.
    pub secrets: Option<&'a kube::runtime::reflector::Store<k8s_openapi::api::core::v1::Secret>>,
    /// The tenant, with every component as read at the start of the pass.
    pub tenant: &'a Tenant,
    /// Which component.
    pub component: Component,
    /// The Kubernetes version it runs.
    pub version: KubeVersion,
    /// Its `spec.patches` (already judged acceptable by [`Runtime::patch_policy`]).
    pub patches: &'a [Value],
    /// Where [`Pass::issue`] notes secrets it found edited and reissued (for Events).
    pub replaced: &'a std::sync::Mutex<Vec<String>>,
}

impl Pass<'_> {
    /// Issue this component's certificates and kubeconfigs from the pure plan, for `input`
    /// and the addresses the API server is reached at (`hosts`, the endpoint first). When the
    /// endpoint is a gateway that tenants share, `server_name` is the tenant's name there
    /// (the admin kubeconfig's `tls-server-name`). Returns the tenant's secrets (to read what
    /// the pod template mounts) and the CA that verifies the component's health endpoint.
    pub async fn issue(
        &self,
        input: &RenderInput,
        hosts: &[String],
        server_name: Option<&str>,
    ) -> Result<(ClusterSecrets, Option<String>), Error> {
        let t = self.tenant;
        let secrets = ClusterSecrets::new(
            self.client.clone(),
            &t.namespace(),
            &t.cluster(),
            t.owner(),
            self.clock.clone(),
        )
        .with_cache(self.secrets.cloned());
        let endpoint = t.ncp.spec.control_plane_endpoint.as_ref().map(|e| {
            nestplane_render::certificates::Endpoint {
                host: &e.host,
                port: e.port,
                server_name,
            }
        });
        let plan = nestplane_render::certificates::plan(self.component, input, hosts, endpoint);
        let health_ca = secrets.issue(&plan).await;
        self.replaced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(secrets.take_replaced());
        Ok((secrets, health_ca?))
    }
}

/// What a runtime saw after making a component run.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    /// Replicas that should run.
    pub desired: u32,
    /// Replicas that are healthy (answer their health endpoint, or ready in the rollout).
    pub healthy: u32,
    /// The runtime's own verdict: every desired replica healthy (and, for workloads, the
    /// newest spec rolled out).
    pub ok: bool,
    /// What `healthy/desired` counts, for a person ("replicas answer their health endpoint").
    pub counting: String,
    /// etcd's member addresses.
    pub addresses: Vec<NestedEtcdAddress>,
    /// The API server's Service.
    pub service: Option<ObjectReference>,
    /// The trust handed to the component this pass ([`crate::secrets::credentials`]).
    pub credentials: std::collections::BTreeMap<String, String>,
}

/// Where components run.
pub trait Runtime: Send + Sync {
    /// Which patch policy applies.
    fn patch_policy(&self) -> policy::Runtime;

    /// The render input for judging patches early (addresses may be placeholders: the judge
    /// compares a rendering with its patched self).
    fn check_input(&self, t: &Tenant, version: KubeVersion) -> RenderInput;

    /// Whether a component's readiness reaches its controller through a watch (a workload's
    /// rollout), so that a starting component need not be probed often (see
    /// [`crate::pacing`]).
    fn readiness_is_watched(&self) -> bool {
        false
    }

    /// Fail at once when `version` of `c` cannot run here (a missing binary).
    fn can_run(&self, c: Component, version: &KubeVersion) -> Result<(), Error>;

    /// The newest patch of 1.`minor` that can run here, if this runtime knows (the step an
    /// upgrade through that minor takes); `None` refuses a jump through it.
    fn newest_patch(&self, _minor: u32) -> Option<u32> {
        None
    }

    /// Where `ncp` is reached through this operator's shared gateway, if it runs one.
    fn gateway(&self, _ncp: &NestedControlPlane) -> Option<nestplane_api::GatewayStatus> {
        None
    }

    /// Issue certificates, render, patch, apply or start, and observe.
    fn run<'a>(&'a self, pass: Pass<'a>) -> BoxFuture<'a, Result<Observation, Error>>;

    /// Where the control plane is reached, once known (the provider owns the endpoint).
    fn endpoint<'a>(
        &'a self,
        client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<Option<ApiEndpoint>, Error>>;

    /// Let a control plane of a name removed before run again (a new object of that name).
    fn revive(&self, _ncp: &NestedControlPlane) {}

    /// Where this operator dials the API servers of tenant `cluster` in `namespace` itself
    /// (its own calls do not depend on the shared gateway, which anyone who reaches it can
    /// fill): the first replica, or a Service in front of them; `None` to use the endpoint.
    fn first_replica(&self, _namespace: &str, _cluster: &str) -> Option<std::net::SocketAddr> {
        None
    }

    /// The uid the control plane's processes run as on this machine, if they run here as a
    /// user of their own (its nodes let that user's packets in). Only looks: never allocates.
    fn control_plane_user(&self, _ncp: &NestedControlPlane) -> Result<Option<u32>, Error> {
        Ok(None)
    }

    /// Every API server replica of the control plane as this machine reaches it, where the
    /// runtime knows them (a node's proxy tries each in turn, so that a replica being
    /// replaced is not its only way in). Empty: only the endpoint.
    fn apiserver_replicas(&self, _ncp: &NestedControlPlane) -> Vec<std::net::SocketAddr> {
        vec![]
    }

    /// Remove what this runtime made for a deleted control plane and that owner references
    /// do not remove (processes and data; etcd's volume claims).
    fn remove<'a>(
        &'a self,
        client: &'a kube::Client,
        ncp: &'a NestedControlPlane,
    ) -> BoxFuture<'a, Result<(), Error>>;
}
