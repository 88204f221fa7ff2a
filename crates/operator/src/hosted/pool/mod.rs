//! The `NodePool` controller: a pool's `replicas` as real nodes that join their hosted
//! cluster with a bootstrap token made for each node. nestplane approves a kubelet's client
//! certificate request only when it comes with the token made for that very node; anyone
//! else's stays pending. Scaling down cordons and drains (evictions honour
//! PodDisruptionBudgets, up to `nodeDrainTimeout`), deletes the Node and removes the node. A
//! change of anything the pool says about its nodes ([`plan::node_spec`]) replaces nodes one
//! by one within `maxSurge`/`maxUnavailable`.
//!
//! A pass, in order: the HostedCluster → admission (validation, version skew, pod security,
//! pause) → a node runtime that can make nodes → finalizer → the hosted cluster serving →
//! converging nodes → status. Where nodes run is the [`machines::NodeRuntime`] seam.

pub mod capi;
pub mod csr;
pub mod drain;
pub mod machines;
pub mod plan;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node as KubeNode};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::conditions;
use nestplane_api::hosted::{
    DnsProvider, HostedCluster, NodeInfo, NodePool, NodePoolStatus, PodSecurityLevel, types,
};
use nestplane_nodes::config::{ClusterSettings, NodeSpec};
use nestplane_nodes::join::{self, BootstrapToken};
use rand::RngExt;

use super::HostedContext;
use super::target::Target;
use crate::context::Error;
use crate::error::AtStep;
pub use machines::{LocalNodes, NodeSettings};
use machines::{Machine, NodeRequest, NodeRuntime};
pub use plan::{POD_SECURITY, POOL_LABEL};

/// The finalizer on a NodePool.
pub const FINALIZER: &str = "nestplane.io/nodepool";
/// How long a bootstrap token is valid (it is deleted once its node has joined).
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);
/// The label on a namespace (set by whoever administers the management cluster, not by its
/// users) that allows its NodePools `podSecurity: Privileged`.
pub const PRIVILEGED_ALLOWED_LABEL: &str = "nestplane.io/pod-security-privileged";

fn pool_key(pool: &NodePool) -> String {
    format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    )
}

/// Why a pass stops: `Ready` False with `reason` and `message`; a Warning Event when
/// `warning` and new; looked at again after `again` (else on a change).
struct Halt {
    reason: &'static str,
    message: String,
    warning: bool,
    again: Option<Duration>,
}

impl Halt {
    fn warn(reason: &'static str, message: String) -> Halt {
        Halt {
            reason,
            message,
            warning: true,
            again: None,
        }
    }
    fn wait(reason: &'static str, message: String) -> Halt {
        Halt {
            reason,
            message,
            warning: false,
            again: None,
        }
    }
    fn again(mut self, d: Duration) -> Halt {
        self.again = Some(d);
        self
    }
}

/// A step's outcome: go on with `T`, or stop the pass ([`Halt`]).
type Step<T> = Result<T, Halt>;

/// One pass over one pool: what every step reads and the status it builds.
struct Pass<'a> {
    ctx: &'a HostedContext,
    pool: &'a NodePool,
    api: Api<NodePool>,
    key: String,
    status: NodePoolStatus,
    now: Timestamp,
}

impl Pass<'_> {
    fn set(&mut self, c: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition) {
        super::set_condition(&mut self.status.conditions, self.pool, c, self.now);
    }

    async fn event(&self, type_: EventType, reason: &str, note: &str) {
        let on = self.pool.object_ref(&());
        self.ctx.event(on, type_, reason, note).await;
    }

    /// A refusal or a wait: nothing touched.
    async fn stop(mut self, halt: Halt) -> Result<Action, Error> {
        let before = conditions::get(&self.status.conditions, types::READY)
            .map(|c| (c.reason.clone(), c.message.clone()));
        self.set(conditions::new(
            types::READY,
            false,
            halt.reason,
            &halt.message,
        ));
        let cut = conditions::cut(&halt.message, conditions::MAX_MESSAGE);
        if halt.warning && before != Some((halt.reason.to_string(), cut)) {
            self.event(EventType::Warning, halt.reason, &halt.message)
                .await;
        }
        self.write().await?;
        Ok(halt
            .again
            .map(Action::requeue)
            .unwrap_or_else(Action::await_change))
    }

    async fn write(&self) -> Result<(), Error> {
        crate::status::write(
            &self.api,
            self.pool,
            self.pool.status.as_ref(),
            &self.status,
        )
        .await
    }
}

/// Approve the kubelet certificates of `machines`, nodes this pool made ([`csr::approve`]).
async fn approve(pass: &Pass<'_>, n: &Nodes<'_>, machines: &[Machine]) {
    let owner = format!("NodePool {}", pass.key);
    csr::approve(&n.target.client, &owner, "NestplaneNodePool", machines).await;
}

/// Reconcile one NodePool.
#[tracing::instrument(name = "NodePool", skip_all, fields(nodepool = %pool_key(&pool)))]
pub async fn reconcile(pool: Arc<NodePool>, ctx: Arc<HostedContext>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("NodePool");
    let ns = pool.namespace().unwrap_or_default();
    let hc = ctx
        .hosted_cluster(&ns, &pool.spec.cluster_name)
        .await
        .at("HostedCluster")?;
    if pool.metadata.deletion_timestamp.is_some() {
        return teardown(&ctx, &pool, hc.as_ref()).await.at("teardown");
    }
    let mut pass = Pass {
        ctx: &ctx,
        pool: &pool,
        api: Api::namespaced(ctx.client.clone(), &ns),
        key: pool_key(&pool),
        status: pool.status.clone().unwrap_or_default(),
        now: Timestamp::now(),
    };
    let Some(hc) = hc else {
        let missing = format!(
            "HostedCluster {ns}/{} does not exist",
            pool.spec.cluster_name
        );
        return pass
            .stop(Halt::warn("HostedClusterNotFound", missing).again(Duration::from_secs(30)))
            .await;
    };
    let (version, held) = match admit(&mut pass, &hc).await.at("admit")? {
        Ok(v) => v,
        Err(halt) => return pass.stop(halt).await,
    };
    if let Some(platform) = plan::cluster_api(&pool) {
        // Machines Cluster API makes: nothing runs on this machine.
        crate::finalizer::add(&pass.api, pool.as_ref(), FINALIZER)
            .await
            .at("finalizer")?;
        let target = ctx.targets.get(&ctx, &hc).await.at("target")?;
        let spec = plan::node_spec(&pool, &pool.name_any(), &version);
        return capi::converge(
            pass,
            &hc,
            platform,
            &version,
            &spec,
            &cluster_settings(&hc),
            target.as_ref().map(|t| &t.client),
        )
        .await
        .at("ClusterAPI");
    }
    let builtin_dns =
        super::plan::dns_provider(&hc.spec, ctx.dns.default_provider, true) == DnsProvider::Builtin;
    let runtime = match node_runtime(&ctx, &version, builtin_dns) {
        Ok(r) => r,
        Err(halt) => return pass.stop(halt).await,
    };
    // Finalizer, before any node exists.
    crate::finalizer::add(&pass.api, pool.as_ref(), FINALIZER)
        .await
        .at("finalizer")?;
    let Some(target) = ctx.targets.get(&ctx, &hc).await.at("target")? else {
        let waiting = format!(
            "waiting for HostedCluster {ns}/{}'s control plane to be Ready",
            hc.name_any()
        );
        return pass
            .stop(Halt::wait("WaitingForControlPlane", waiting).again(Duration::from_secs(3)))
            .await;
    };
    let spec = plan::node_spec(&pool, &pool.name_any(), &version);
    let nodes = Nodes {
        runtime,
        target: &target,
        spec: &spec,
        cluster: cluster_settings(&hc),
        builtin_dns,
    };
    let listed = match converge(&pass, &nodes).await.at("converge")? {
        Ok(l) => l,
        Err(halt) => return pass.stop(halt).await,
    };
    report(pass, runtime, &listed, &spec, held)
        .await
        .at("status")
}

/// Whether the pool may have nodes now; returns their version now, and why it is not yet the
/// pool's own (the control plane has not reached it). Sets `SupportedVersionSkew` and
/// `PodSecurity`.
async fn admit(
    pass: &mut Pass<'_>,
    hc: &HostedCluster,
) -> Result<Step<(String, Option<String>)>, Error> {
    let pool = pass.pool;
    let ns = pool.namespace().unwrap_or_default();
    if let Err(msg) = plan::validate_pool(pool) {
        return Ok(Err(Halt::warn("InvalidConfiguration", msg)));
    }
    // Where the nodes run is fixed: a change would leave the other platform's nodes behind.
    let platform = plan::platform_name(pool);
    match pass.status.platform.as_deref() {
        Some(was) if was != platform => {
            return Ok(Err(Halt::warn(
                "InvalidConfiguration",
                format!(
                    "platform.type is {platform}, but the pool's nodes run on {was}: the platform cannot change (set it back, or make another pool)"
                ),
            )));
        }
        Some(_) => {}
        None => pass.status.platform = Some(platform.to_string()),
    }
    let cp_version = super::plan::version(&hc.spec.release.version);
    let version = pool
        .spec
        .release
        .as_ref()
        .map(|r| super::plan::version(&r.version))
        .unwrap_or_else(|| cp_version.clone());
    if let Err(msg) = super::plan::version_skew(&version, &cp_version) {
        pass.set(conditions::new(
            types::SUPPORTED_VERSION_SKEW,
            false,
            "UnsupportedSkew",
            &msg,
        ));
        return Ok(Err(Halt::warn("UnsupportedSkew", msg)));
    }
    pass.set(conditions::new(
        types::SUPPORTED_VERSION_SKEW,
        true,
        "AsExpected",
        "",
    ));
    // The control plane first: until it has reached the pool's version, nodes are made at the
    // version the pool reached last (else the control plane's), so nothing is replaced twice;
    // scaling and replacing unhealthy nodes go on meanwhile.
    let reached = super::plan::reached_version(hc);
    let (version, held) = match (
        super::plan::nodes_may_move(&version, reached.as_deref()),
        reached,
    ) {
        (Err(msg), Some(reached)) => {
            let nodes_at = pool
                .status
                .as_ref()
                .and_then(|s| s.version.clone())
                .filter(|v| super::plan::nodes_may_move(v, Some(&reached)).is_ok());
            (nodes_at.unwrap_or(reached), Some(msg))
        }
        _ => (version, None),
    };
    let level = pool.spec.pod_security.unwrap_or_default();
    if level == PodSecurityLevel::Privileged && !privileged_allowed(pass.ctx, &ns).await? {
        let why = format!(
            "podSecurity Privileged lets the tenant's admins become root on this machine; the platform team allows it per namespace by labelling namespace {ns} {PRIVILEGED_ALLOWED_LABEL}=allowed"
        );
        // Namespaces are not watched: look again for the label.
        return Ok(Err(
            Halt::warn("PrivilegedNotAllowed", why).again(Duration::from_secs(15))
        ));
    }
    let security = plan::pod_security_condition(level);
    let was = conditions::get(&pass.status.conditions, POD_SECURITY).map(|c| c.reason.clone());
    if security.status == "False" && was.as_deref() != Some(security.reason.as_str()) {
        pass.event(EventType::Warning, &security.reason, &security.message)
            .await;
    }
    pass.set(security);
    match super::plan::paused(pool.spec.paused_until.as_deref(), pass.now) {
        Err(msg) => Ok(Err(Halt::warn("InvalidConfiguration", msg))),
        Ok(Some(_)) => Ok(Err(Halt::wait(
            "ReconciliationPaused",
            "paused (pausedUntil)".into(),
        )
        .again(Duration::from_secs(30)))),
        Ok(None) => Ok(Ok((version, held))),
    }
}

/// Whether namespace `ns` allows Privileged pools ([`PRIVILEGED_ALLOWED_LABEL`]`=allowed`).
async fn privileged_allowed(ctx: &HostedContext, ns: &str) -> Result<bool, Error> {
    let namespace = Api::<Namespace>::all(ctx.client.clone())
        .get_opt(ns)
        .await?;
    Ok(namespace.is_some_and(|n| {
        n.labels().get(PRIVILEGED_ALLOWED_LABEL).map(String::as_str) == Some("allowed")
    }))
}

/// The node runtime, if this operator has one that can make nodes of `version` now.
fn node_runtime<'a>(
    ctx: &'a HostedContext,
    version: &str,
    builtin_dns: bool,
) -> Step<&'a dyn NodeRuntime> {
    let Some(runtime) = ctx.nodes.as_deref() else {
        return Err(Halt::warn(
            "NodesNeedAHostOperator",
            "this operator does not run on a machine it may make nodes on (nodes need the process runtime, as root)".into(),
        ));
    };
    runtime
        .check(version, builtin_dns)
        .map_err(|(reason, message)| Halt::warn(reason, message).again(Duration::from_secs(60)))?;
    Ok(runtime)
}

/// What nodes of this cluster are built with: its cluster DNS (the address pods get, the
/// host's end of the link for names outside) and serving certificates from its CA.
fn cluster_settings(hc: &HostedCluster) -> ClusterSettings {
    ClusterSettings {
        cluster_dns: super::plan::dns_service_ip(&super::plan::networking(&hc.spec))
            .map(|ip| vec![ip.to_string()])
            .unwrap_or_default(),
        cluster_domain: super::dns::ZONE.into(),
        serving_certificates_from_cluster: true,
        resolver_on_host: true,
    }
}

/// Where and what the pass's nodes are.
struct Nodes<'a> {
    runtime: &'a dyn NodeRuntime,
    target: &'a Target,
    spec: &'a NodeSpec,
    cluster: ClusterSettings,
    builtin_dns: bool,
}

/// Make the pool's nodes what it says: strays gone, certificates approved, nodes started and
/// removed as the rollout says, used bootstrap tokens deleted. Returns the pool's Nodes as
/// its cluster lists them.
async fn converge(pass: &Pass<'_>, n: &Nodes<'_>) -> Result<Step<Vec<KubeNode>>, Error> {
    let name = pass.pool.name_any();
    let kube_nodes: Api<KubeNode> = Api::all(n.target.client.clone());
    let listed = match kube_nodes
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            return Ok(Err(Halt::warn(
                "ClusterUnreachable",
                format!("listing the hosted cluster's Nodes: {e}"),
            )
            .again(Duration::from_secs(5))));
        }
    };
    let machines = n.runtime.list(&pass.key);
    // Nodes of this pool that no node of this operator backs (a predecessor's): gone.
    for stray in listed
        .iter()
        .filter(|k| !machines.iter().any(|m| m.name == k.name_any()))
    {
        if let Err(e) = drain::delete_node(&n.target.client, &stray.name_any()).await {
            tracing::warn!(node = %stray.name_any(), error = %e, "deleting a Node no node backs failed; next pass");
        }
    }
    let hash = n.spec.hash();
    let members: Vec<super::plan::Member> = machines
        .iter()
        .map(|m| super::plan::Member {
            name: m.name.clone(),
            current: m.hash == hash,
            ready: ready(&listed, &m.name),
        })
        .collect();
    let rolling = pass
        .pool
        .spec
        .management
        .replace
        .as_ref()
        .and_then(|r| r.rolling_update.clone())
        .unwrap_or_default();
    let actions = super::plan::rollout(
        pass.pool.spec.replicas.unwrap_or(0).max(0) as u32,
        rolling.max_surge.unwrap_or(1).max(0) as u32,
        rolling.max_unavailable.unwrap_or(0).max(0) as u32,
        &members,
    );
    // Approve the certificates of the nodes we made (and nobody else's).
    approve(pass, n, &machines).await;
    // The cluster's side of joining, kept in place (a deleted binding comes back).
    if let Err(e) = join::ensure_bindings(&n.target.client, false).await {
        tracing::warn!(error = %e, "keeping the join bindings failed; next pass");
    }
    start_nodes(pass, n, actions.create).await;
    let timeout = plan::drain_timeout(pass.pool);
    for node in &actions.remove {
        pass.event(EventType::Normal, "DrainingNode", &format!("node {node}"))
            .await;
        remove_node(
            pass.ctx,
            pass.pool,
            n.runtime,
            Some(&n.target.client),
            node,
            timeout,
        )
        .await;
    }
    delete_used_tokens(pass, n, &listed).await;
    Ok(Ok(listed))
}

/// Whether Node `name` is Ready, as its kubelet reports.
fn ready(listed: &[KubeNode], name: &str) -> bool {
    listed
        .iter()
        .find(|k| k.name_any() == name)
        .is_some_and(|k| {
            k.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
}

/// How often the certificates of nodes being started are looked at (they ask for their
/// client certificate while their kubelet starts; approving it is on their way to Ready).
const JOINING_APPROVAL_INTERVAL: Duration = Duration::from_millis(200);

/// Start `count` nodes at once, each with a bootstrap token made for it, approving their
/// client certificates meanwhile.
async fn start_nodes(pass: &Pass<'_>, n: &Nodes<'_>, count: u32) {
    if count == 0 {
        return;
    }
    let planned: Vec<(String, BootstrapToken)> = (0..count)
        .map(|_| (node_name(pass), BootstrapToken::generate()))
        .collect();
    // The new nodes' client certificates are approved as soon as they ask, not when every
    // start here has returned (a start includes importing images, while the kubelet is
    // already asking).
    let mut joining = n.runtime.list(&pass.key);
    joining.extend(planned.iter().map(|(name, token)| Machine {
        name: name.clone(),
        token_id: token.id.clone(),
        hash: String::new(),
        version: String::new(),
        ip: None,
        token_deleted: false,
    }));
    let starts = futures::future::join_all(
        planned
            .into_iter()
            .map(|(name, token)| start_node(pass, n, name, token)),
    );
    let approving = async {
        loop {
            tokio::time::sleep(JOINING_APPROVAL_INTERVAL).await;
            approve(pass, n, &joining).await;
        }
    };
    let results = tokio::select! {
        r = starts => r,
        () = approving => Vec::new(),
    };
    for r in results {
        match r {
            Ok(m) => {
                let note = format!("node {} ({})", m.name, m.version);
                pass.event(EventType::Normal, "NodeCreated", &note).await;
            }
            Err(e) => {
                pass.event(EventType::Warning, "NodeFailed", &e).await;
                tracing::warn!(error = %e, "starting a node failed");
            }
        }
    }
}

/// A new node's name: the pool's and a random suffix.
fn node_name(pass: &Pass<'_>) -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let suffix: String = (0..5)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect();
    format!("{}-{suffix}", pass.pool.name_any())
}

async fn start_node(
    pass: &Pass<'_>,
    n: &Nodes<'_>,
    name: String,
    token: BootstrapToken,
) -> Result<Machine, String> {
    join::create_token(&n.target.client, &token, TOKEN_TTL)
        .await
        .map_err(|e| format!("node {name}: {e}"))?;
    n.runtime
        .start(NodeRequest {
            pool: pass.key.clone(),
            name,
            spec: n.spec.clone(),
            token,
            ca_pem: n.target.ca_pem.clone(),
            apiserver: n.target.apiserver,
            replicas: n.target.replicas.clone(),
            cluster: n.cluster.clone(),
            group: n.target.group,
            control_plane_user: n.target.user,
            builtin_dns: n.builtin_dns,
        })
        .await
}

/// A node that has registered joined with its client certificate: its bootstrap token is
/// not needed again, and is deleted.
async fn delete_used_tokens(pass: &Pass<'_>, n: &Nodes<'_>, listed: &[KubeNode]) {
    let joined = n
        .runtime
        .list(&pass.key)
        .into_iter()
        .filter(|m| !m.token_deleted && listed.iter().any(|k| k.name_any() == m.name));
    for m in joined {
        match join::delete_token(&n.target.client, &m.token_id).await {
            Ok(()) => n.runtime.token_deleted(&pass.key, &m.name),
            Err(e) => tracing::warn!(error = %e, "cannot delete a used bootstrap token; next pass"),
        }
    }
}

/// The status the pool's nodes add up to, written; an Event when it becomes Ready.
async fn report(
    mut pass: Pass<'_>,
    runtime: &dyn NodeRuntime,
    listed: &[KubeNode],
    spec: &NodeSpec,
    held: Option<String>,
) -> Result<Action, Error> {
    let hash = spec.hash();
    let infos: Vec<NodeInfo> = runtime
        .list(&pass.key)
        .into_iter()
        .map(|m| NodeInfo {
            ready: ready(listed, &m.name),
            current: m.hash == hash,
            name: m.name,
            version: m.version,
        })
        .collect();
    let replicas = pass.pool.spec.replicas.unwrap_or(0).max(0) as u32;
    let r = plan::report(&infos, replicas, &spec.version);
    pass.status.replicas = r.ready;
    pass.status.nodes = infos;
    pass.status.observed_generation = pass.pool.metadata.generation;
    if r.done {
        pass.status.version = Some(spec.version.clone());
    }
    for c in r.conditions {
        pass.set(c);
    }
    if let Some(why) = held {
        pass.set(conditions::new(
            types::UPDATING_VERSION,
            false,
            "WaitingForControlPlane",
            why,
        ));
    }
    let before = pass.pool.status.as_ref().map(|s| &s.conditions[..]);
    let was_ready = conditions::is_true(before.unwrap_or_default(), types::READY);
    if r.done && !was_ready {
        let note = format!("{}/{replicas} nodes Ready", r.ready);
        pass.event(EventType::Normal, "Ready", &note).await;
    }
    pass.write().await?;
    Ok(Action::requeue(if r.done {
        Duration::from_secs(30)
    } else {
        recheck(listed, &pass.status.nodes, pass.now)
    }))
}

/// How soon a pool that is not done is looked at again: in [`ABOUT_TO_BE_READY`] when one of
/// its nodes registered within the last minute and is not Ready yet (its kubelet's next
/// status is at most 2 s away, and the pool's status should follow it closely), else in 2 s.
fn recheck(listed: &[KubeNode], nodes: &[NodeInfo], now: Timestamp) -> Duration {
    let joining = nodes.iter().filter(|n| !n.ready).any(|n| {
        listed
            .iter()
            .find(|k| k.name_any() == n.name)
            .and_then(|k| k.metadata.creation_timestamp.as_ref())
            .and_then(|t| Duration::try_from(now.duration_since(t.0)).ok())
            .is_some_and(|age| age < Duration::from_secs(60))
    });
    if joining {
        ABOUT_TO_BE_READY
    } else {
        Duration::from_secs(2)
    }
}

/// How often a pool with a node that has just registered is looked at.
const ABOUT_TO_BE_READY: Duration = Duration::from_millis(500);

/// Cordon and drain `node` (evictions, which PodDisruptionBudgets may refuse, until
/// `timeout`; then its pods are deleted), delete its Node and its bootstrap token, and
/// remove it. Events on the pool say when a budget held the drain and which pods the timeout
/// deleted. Without a client (the cluster is gone) the node is only removed.
async fn remove_node(
    ctx: &HostedContext,
    pool: &NodePool,
    runtime: &dyn NodeRuntime,
    client: Option<&kube::Client>,
    node: &str,
    timeout: Duration,
) {
    let key = pool_key(pool);
    if let Some(client) = client {
        let event = |type_, reason: &'static str, note: String| async move {
            ctx.event(pool.object_ref(&()), type_, reason, &note).await;
        };
        let on_block = |pods: Vec<String>| {
            let note = format!(
                "node {node}: a PodDisruptionBudget refuses evicting {} for now; retrying until the drain timeout ({}s)",
                pods.join(", "),
                timeout.as_secs()
            );
            event(EventType::Normal, "DrainBlocked", note)
        };
        match drain::drain(client, node, timeout, on_block).await {
            Ok(forced) if !forced.is_empty() => {
                let note = format!(
                    "node {node}: not drained within {}s; deleted {}",
                    timeout.as_secs(),
                    forced.join(", ")
                );
                event(EventType::Warning, "DrainTimedOut", note).await;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%node, error = %e, "draining failed; removing the node anyway");
            }
        }
        if let Err(e) = drain::delete_node(client, node).await {
            // The next pass deletes a Node that no node backs.
            tracing::warn!(%node, error = %e, "deleting the Node failed");
        }
        if let Some(m) = runtime.list(&key).into_iter().find(|m| m.name == node)
            && !m.token_deleted
            && let Err(e) = join::delete_token(client, &m.token_id).await
        {
            // It expires by itself (TOKEN_TTL).
            tracing::warn!(%node, error = %e, "deleting the node's bootstrap token failed");
        }
    }
    runtime.remove(&key, node).await;
}

/// Deletion: every node drained (when the cluster still answers) and removed, then the
/// finalizer. Works when the HostedCluster or its control plane is already gone.
async fn teardown(
    ctx: &HostedContext,
    pool: &NodePool,
    hc: Option<&HostedCluster>,
) -> Result<Action, Error> {
    if !crate::finalizer::has(pool, FINALIZER) {
        return Ok(Action::await_change());
    }
    if plan::cluster_api(pool).is_some()
        && let Some(hc) = hc
        && let Some(waiting) = capi::teardown(&ctx.client, pool, hc).await?
    {
        // Cluster API deletes the machines first; the pool says so meanwhile.
        let api: Api<NodePool> =
            Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
        let mut status = pool.status.clone().unwrap_or_default();
        let reason = "DeletingMachineDeployment";
        let before = conditions::get(&status.conditions, types::DELETING).map(|c| c.reason.clone());
        super::set_condition(
            &mut status.conditions,
            pool,
            conditions::new(types::DELETING, true, reason, &waiting),
            Timestamp::now(),
        );
        if before.as_deref() != Some(reason) {
            ctx.event(pool.object_ref(&()), EventType::Normal, reason, &waiting)
                .await;
        }
        crate::status::write(&api, pool, pool.status.as_ref(), &status).await?;
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let target = match hc {
        Some(hc) => match ctx.targets.get(ctx, hc).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "the hosted cluster cannot be reached; nodes are removed without a drain");
                None
            }
        },
        None => None,
    };
    if let Some(runtime) = ctx.nodes.as_deref() {
        let timeout = plan::drain_timeout(pool);
        let client = target.as_ref().map(|t| &t.client);
        for m in runtime.list(&pool_key(pool)) {
            remove_node(ctx, pool, runtime, client, &m.name, timeout).await;
        }
    }
    let api: Api<NodePool> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    crate::finalizer::remove(&api, pool, FINALIZER).await?;
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use k8s_openapi::jiff::SignedDuration;

    fn node(name: &str, registered: Timestamp) -> KubeNode {
        KubeNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                creation_timestamp: Some(Time(registered)),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn info(name: &str, ready: bool) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            version: "v1.20.2".into(),
            ready,
            current: true,
        }
    }

    #[test]
    fn a_pool_looks_again_soon_only_while_a_node_has_just_registered() {
        let now = Timestamp::now();
        let ago = |s: i64| now - SignedDuration::from_secs(s);
        // Registered 5 s ago, not Ready yet: about to be.
        assert_eq!(
            recheck(&[node("a", ago(5))], &[info("a", false)], now),
            ABOUT_TO_BE_READY
        );
        // Not registered yet, or registered long ago and still not Ready (something is
        // wrong; looking often would not mend it), or Ready: the usual pace.
        for (listed, nodes) in [
            (vec![], vec![info("a", false)]),
            (vec![node("a", ago(600))], vec![info("a", false)]),
            (vec![node("a", ago(5))], vec![info("a", true)]),
        ] {
            assert_eq!(recheck(&listed, &nodes, now), Duration::from_secs(2));
        }
    }
}
