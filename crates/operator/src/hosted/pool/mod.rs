//! The `NodePool` controller: a pool's `replicas` as real nodes (containerd + kubelet +
//! kube-proxy on this machine, `nestplane_nodes`) that join their hosted cluster with a
//! bootstrap token made for each node. nestplane approves a kubelet's client certificate
//! request only when it comes with the token made for that very node; anyone else's stays
//! pending. Scaling down cordons and drains (evictions honour PodDisruptionBudgets, up to
//! `nodeDrainTimeout`), deletes the Node and removes the node. A change of version, labels
//! or taints replaces nodes one by one within `maxSurge`/`maxUnavailable`.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::conditions;
use nestplane_api::hosted::{
    DnsProvider, HostedCluster, NodeInfo, NodePool, NodePoolStatus, PodSecurityLevel, types,
};
use nestplane_api::names;
use nestplane_nodes::join::{self, BootstrapToken};
use nestplane_nodes::node::{Node, NodeConfig};
use rand::RngExt;
use sha2::{Digest, Sha256};

use super::{cluster, plan};
use crate::context::{Context, Error};

/// The finalizer on a NodePool.
pub const FINALIZER: &str = "nestplane.io/nodepool";
/// The label on a pool's Nodes (the NodePool's name).
pub const POOL_LABEL: &str = "nestplane.io/nodepool";
/// How long a node is drained when the pool does not say.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a bootstrap token is valid (it is deleted once its node has joined).
pub const TOKEN_TTL: Duration = Duration::from_secs(3600);

/// Where nodes live and what they are given.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    /// Nodes' directories go under `<dir>/<namespace>/<pool>/<node>`.
    pub dir: PathBuf,
    /// Where `nestplane images build` put its archives.
    pub images: PathBuf,
    /// The `nestplane` binary whose `runc-guard` command judges every container on the
    /// nodes (the node guard, [`nestplane_nodes::guard`]).
    pub guard: PathBuf,
}

/// A node this operator made.
pub struct Managed {
    /// The Node's name.
    pub name: String,
    /// The id of the bootstrap token made for it.
    pub token_id: String,
    /// Hash of what it was built from (version, labels, taints).
    pub hash: String,
    /// Its kubelet's version.
    pub version: String,
    /// Whether its bootstrap token is gone (deleted once the node has registered).
    pub token_deleted: bool,
    node: Option<Node>,
}

/// The nodes of every pool, by `namespace/name` of the pool. Nodes are this process's
/// children: an operator that stops takes them with it, and its successor makes new ones.
#[derive(Default)]
pub struct Nodes(Mutex<HashMap<String, Vec<Managed>>>);

impl Nodes {
    fn with<T>(&self, pool: &str, f: impl FnOnce(&mut Vec<Managed>) -> T) -> T {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        f(map.entry(pool.to_string()).or_default())
    }

    /// The names of a pool's nodes.
    pub fn names(&self, pool: &str) -> Vec<String> {
        self.with(pool, |v| v.iter().map(|m| m.name.clone()).collect())
    }

    /// Remove every node (the operator is stopping): no drain, the cluster keeps its Node
    /// objects, which the next operator replaces.
    pub async fn remove_all(&self) {
        let all: Vec<Managed> = {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            map.drain().flat_map(|(_, v)| v).collect()
        };
        for mut m in all {
            if let Some(n) = m.node.take()
                && let Err(e) = n.remove().await
            {
                tracing::warn!(node = %m.name, error = %e, "removing a node left something behind");
            }
        }
    }

    fn take(&self, pool: &str, name: &str) -> Option<Managed> {
        self.with(pool, |v| {
            let i = v.iter().position(|m| m.name == name)?;
            Some(v.remove(i))
        })
    }
}

/// Hash of what a node is built from.
pub fn node_hash(version: &str, pool: &NodePool) -> String {
    let mut h = Sha256::new();
    h.update(version.as_bytes());
    // Baseline is the unset default, so pools made before the field hash as they did.
    let level = pool.spec.pod_security.unwrap_or_default();
    if level != PodSecurityLevel::Baseline {
        h.update(format!("\0s{}", level.as_str()).as_bytes());
    }
    for (k, v) in &pool.spec.node_labels {
        h.update(format!("\0l{k}={v}").as_bytes());
    }
    for t in &pool.spec.taints {
        h.update(
            format!(
                "\0t{}={}:{}",
                t.key,
                t.value.as_deref().unwrap_or_default(),
                t.effect
            )
            .as_bytes(),
        );
    }
    format!("{:x}", h.finalize())[..10].to_string()
}

/// The node guard's level for a pool's level.
pub fn guard_level(level: PodSecurityLevel) -> nestplane_nodes::guard::Level {
    use nestplane_nodes::guard::Level;
    match level {
        PodSecurityLevel::Baseline => Level::Baseline,
        PodSecurityLevel::Restricted => Level::Restricted,
        PodSecurityLevel::Privileged => Level::Privileged,
    }
}

/// The `PodSecurity` condition of a pool at `level`: True when a level is enforced on its
/// nodes; False (a Warning) for `Privileged`, where a tenant admin can become root on the
/// machine.
pub fn pod_security_condition(
    level: PodSecurityLevel,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    match level {
        PodSecurityLevel::Privileged => conditions::new(
            POD_SECURITY,
            false,
            "Privileged",
            "no pod security is enforced on these nodes: the tenant's admins can run privileged pods and become root on this machine",
        ),
        l => conditions::new(
            POD_SECURITY,
            true,
            l.as_str(),
            format!(
                "{} is enforced on the nodes, below the tenant (its admins cannot switch it off)",
                l.as_str()
            ),
        ),
    }
}

/// The label on a namespace (set by whoever administers the management cluster, not by its
/// users) that allows its NodePools `podSecurity: Privileged`.
pub const PRIVILEGED_ALLOWED_LABEL: &str = "nestplane.io/pod-security-privileged";

/// Whether namespace `ns` allows Privileged pools ([`PRIVILEGED_ALLOWED_LABEL`]`=allowed`).
async fn privileged_allowed(ctx: &Context, ns: &str) -> Result<bool, Error> {
    let namespace = Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .get_opt(ns)
        .await?;
    Ok(namespace.is_some_and(|n| {
        n.labels().get(PRIVILEGED_ALLOWED_LABEL).map(String::as_str) == Some("allowed")
    }))
}

/// The condition type saying which pod security level a pool's nodes enforce.
pub const POD_SECURITY: &str = "PodSecurity";

/// Check labels and taints (they reach the kubelet's flags).
pub fn validate_pool(pool: &NodePool) -> Result<(), String> {
    let label_ok = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    };
    for (k, v) in &pool.spec.node_labels {
        if !label_ok(k, 253) || !(v.is_empty() || label_ok(v, 63)) || v.contains('/') {
            return Err(format!("nodeLabels: {k:?}={v:?} is not a valid label"));
        }
        if k == POOL_LABEL {
            return Err(format!("nodeLabels: {POOL_LABEL} is set by nestplane"));
        }
    }
    for t in &pool.spec.taints {
        let value_ok = t
            .value
            .as_deref()
            .is_none_or(|v| v.is_empty() || label_ok(v, 63));
        if !label_ok(&t.key, 253) || !value_ok {
            return Err(format!("taints: {:?} is not a valid taint", t.key));
        }
        if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&t.effect.as_str()) {
            return Err(format!(
                "taints: effect {:?} is not NoSchedule, PreferNoSchedule or NoExecute",
                t.effect
            ));
        }
    }
    if let Some(d) = &pool.spec.node_drain_timeout {
        parse_duration(d)?;
    }
    if let Some(t) = pool.spec.management.upgrade_type.as_deref()
        && !t.is_empty()
        && t != "Replace"
    {
        return Err(format!(
            "management.upgradeType {t:?}: only Replace is offered"
        ));
    }
    Ok(())
}

/// The longest duration a spec may give (a drain timeout longer than this is a mistake).
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// A Go duration as Kubernetes writes them (`90s`, `1m30s`, `300ms`, `1.5h`, `0`), read by
/// `kube::core::Duration`, at most [`MAX_DURATION`]. The text is checked first (at most four
/// parts of up to nine digits, a fraction of up to nine, and a unit; no sign), so nothing a
/// user writes can overflow the parser.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let bad = || format!("{s:?} is not a duration (like 90s, 5m, 1m30s, 300ms)");
    if !plain_duration(s) {
        return Err(bad());
    }
    let d: Duration = s.parse::<kube::core::Duration>().map_err(|_| bad())?.into();
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than {}h",
            MAX_DURATION.as_secs() / 3600
        ));
    }
    Ok(d)
}

/// Whether `s` is 1 to 4 parts `<digits>[.<digits>]<unit>` (1-9 digits each; units `ns`,
/// `us`, `µs`, `ms`, `s`, `m`, `h`). Pure.
fn plain_duration(s: &str) -> bool {
    let mut rest = s;
    let mut parts = 0;
    while !rest.is_empty() {
        parts += 1;
        if parts > 4 {
            return false;
        }
        let int = rest.chars().take_while(char::is_ascii_digit).count();
        if !(1..=9).contains(&int) {
            return false;
        }
        rest = &rest[int..];
        if let Some(r) = rest.strip_prefix('.') {
            let frac = r.chars().take_while(char::is_ascii_digit).count();
            if !(1..=9).contains(&frac) {
                return false;
            }
            rest = &r[frac..];
        }
        let Some(unit) = ["ns", "us", "µs", "ms", "s", "m", "h"]
            .iter()
            .find(|u| rest.starts_with(**u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    parts > 0
}

fn pool_key(pool: &NodePool) -> String {
    format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    )
}

async fn write_status(
    api: &Api<NodePool>,
    pool: &NodePool,
    status: NodePoolStatus,
) -> Result<(), Error> {
    if pool.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    api.patch_status(
        &pool.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": body })),
    )
    .await?;
    Ok(())
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

/// A refusal or a wait: nothing touched.
async fn stop(
    ctx: &Context,
    api: &Api<NodePool>,
    pool: &NodePool,
    mut status: NodePoolStatus,
    halt: Halt,
) -> Result<Action, Error> {
    let Halt {
        reason,
        message,
        warning,
        again: requeue,
    } = halt;
    let before = conditions::get(&status.conditions, types::READY)
        .map(|c| (c.reason.clone(), c.message.clone()));
    conditions::set(
        &mut status.conditions,
        conditions::new(types::READY, false, reason, &message),
        pool.metadata.generation,
        Timestamp::now(),
    );
    if warning
        && before
            != Some((
                reason.to_string(),
                conditions::cut(&message, conditions::MAX_MESSAGE),
            ))
    {
        ctx.event(pool.object_ref(&()), EventType::Warning, reason, &message)
            .await;
    }
    write_status(api, pool, status).await?;
    Ok(requeue
        .map(Action::requeue)
        .unwrap_or_else(Action::await_change))
}

/// The hosted cluster's admin client, CA and API server address, once its control plane
/// serves.
pub(super) struct Target {
    pub(super) client: kube::Client,
    ca_pem: String,
    apiserver: std::net::SocketAddr,
    /// The isolation group of every node of the cluster.
    group: u32,
    /// The user the control plane's processes run as on this machine, if they do.
    user: Option<u32>,
}

/// The isolation group of a hosted cluster's nodes when its control plane has no user of its
/// own on this machine: 31 bits of a hash of the control plane's `namespace/name`, with the
/// top bit set (tenant users' uids, the other groups, are below 2^31).
pub fn isolation_group(namespace: &str, cluster: &str) -> u32 {
    let d = Sha256::digest(format!("{namespace}/{cluster}").as_bytes());
    u32::from_be_bytes([d[0], d[1], d[2], d[3]]) | 0x8000_0000
}

pub(super) async fn target(ctx: &Context, hc: &HostedCluster) -> Result<Option<Target>, Error> {
    let cp_ns = cluster::control_plane_namespace(hc);
    let name = hc.name_any();
    let Some(ncp) = Api::<NestedControlPlane>::namespaced(ctx.client.clone(), &cp_ns)
        .get_opt(&name)
        .await?
    else {
        return Ok(None);
    };
    if !ncp.status.as_ref().is_some_and(|s| s.ready) {
        return Ok(None);
    }
    let Some(ep) = ncp.spec.control_plane_endpoint.as_ref() else {
        return Ok(None);
    };
    let Ok(ip) = ep.host.parse::<std::net::IpAddr>() else {
        return Ok(None);
    };
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ctx.client.clone(), &cp_ns);
    let read = |s: Option<k8s_openapi::api::core::v1::Secret>, key: &str| {
        s.and_then(|s| s.data).and_then(|d| {
            d.get(key)
                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
        })
    };
    let kubeconfig = read(
        secrets
            .get_opt(&names::SecretPurpose::AdminKubeconfig.secret_name(&name))
            .await?,
        names::KUBECONFIG_KEY,
    );
    let ca = read(
        secrets
            .get_opt(&names::SecretPurpose::ClusterCa.secret_name(&name))
            .await?,
        names::TLS_CRT,
    );
    let (Some(kubeconfig), Some(ca_pem)) = (kubeconfig, ca) else {
        return Ok(None);
    };
    // Only what this HostedCluster's own control plane made, and only inline credentials.
    if !cluster::made_for(&ncp.metadata, hc) {
        return Ok(None);
    }
    let kc = nestplane_pki::read_kubeconfig(&kubeconfig).map_err(|reason| {
        crate::secrets::SecretError::Invalid {
            name: names::SecretPurpose::AdminKubeconfig.secret_name(&name),
            reason,
        }
    })?;
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| Error::Internal(e.to_string()))?;
    cfg.connect_timeout = Some(Duration::from_secs(5));
    cfg.read_timeout = Some(Duration::from_secs(30));
    // A 429 from an eviction is a PodDisruptionBudget's answer, not a transient failure: the
    // drain wants it at once (it retries every second until its timeout), not after the
    // client's own backoff has retried it for a minute. Every pass here is retried anyway.
    cfg.default_retry = false;
    let client = kube::Client::try_from(cfg).map_err(|e| Error::Internal(e.to_string()))?;
    // The control plane's user, where it has one, is unique on this machine: it is the
    // group too. Otherwise a hash of the control plane's key.
    let user = ctx.runtime.control_plane_user(&ncp)?;
    let group = user.unwrap_or_else(|| isolation_group(&cp_ns, &name));
    Ok(Some(Target {
        client,
        ca_pem,
        apiserver: std::net::SocketAddr::new(ip, ep.port as u16),
        group,
        user,
    }))
}

/// Reconcile one NodePool.
pub async fn reconcile(pool: Arc<NodePool>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("NodePool");
    let ns = pool.namespace().unwrap_or_default();
    let name = pool.name_any();
    let api: Api<NodePool> = Api::namespaced(ctx.client.clone(), &ns);
    let status = pool.status.clone().unwrap_or_default();
    let hc = Api::<HostedCluster>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&pool.spec.cluster_name)
        .await?;
    if pool.metadata.deletion_timestamp.is_some() {
        return teardown(&pool, &ctx, &api, hc.as_ref()).await;
    }
    let Some(hc) = hc else {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn(
                "HostedClusterNotFound",
                format!(
                    "HostedCluster {ns}/{} does not exist",
                    pool.spec.cluster_name
                ),
            )
            .again(Duration::from_secs(30)),
        )
        .await;
    };
    if let Err(msg) = validate_pool(&pool) {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn("InvalidConfiguration", msg),
        )
        .await;
    }
    let cp_version = plan::version(&hc.spec.release.version);
    let version = pool
        .spec
        .release
        .as_ref()
        .map(|r| plan::version(&r.version))
        .unwrap_or_else(|| cp_version.clone());
    let now = Timestamp::now();
    let generation = pool.metadata.generation;
    let mut status = status;
    if let Err(msg) = plan::version_skew(&version, &cp_version) {
        conditions::set(
            &mut status.conditions,
            conditions::new(
                types::SUPPORTED_VERSION_SKEW,
                false,
                "UnsupportedSkew",
                &msg,
            ),
            generation,
            now,
        );
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn("UnsupportedSkew", msg),
        )
        .await;
    }
    conditions::set(
        &mut status.conditions,
        conditions::new(types::SUPPORTED_VERSION_SKEW, true, "AsExpected", ""),
        generation,
        now,
    );
    let level = pool.spec.pod_security.unwrap_or_default();
    if level == PodSecurityLevel::Privileged && !privileged_allowed(&ctx, &ns).await? {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn(
                "PrivilegedNotAllowed",
                format!(
                    "podSecurity Privileged lets the tenant's admins become root on this machine; the platform team allows it per namespace by labelling namespace {ns} {PRIVILEGED_ALLOWED_LABEL}=allowed"
                ),
            )
            // Namespaces are not watched: look again for the label.
            .again(Duration::from_secs(15)),
        )
        .await;
    }
    let security = pod_security_condition(level);
    let was = conditions::get(&status.conditions, POD_SECURITY).map(|c| c.reason.clone());
    if security.status == "False" && was.as_deref() != Some(security.reason.as_str()) {
        ctx.event(
            pool.object_ref(&()),
            EventType::Warning,
            &security.reason,
            &security.message,
        )
        .await;
    }
    conditions::set(&mut status.conditions, security, generation, now);
    match plan::paused(pool.spec.paused_until.as_deref(), now) {
        Err(msg) => {
            return stop(
                &ctx,
                &api,
                &pool,
                status,
                Halt::warn("InvalidConfiguration", msg),
            )
            .await;
        }
        Ok(Some(_)) => {
            return stop(
                &ctx,
                &api,
                &pool,
                status,
                Halt::wait("ReconciliationPaused", "paused (pausedUntil)".into())
                    .again(Duration::from_secs(30)),
            )
            .await;
        }
        Ok(None) => {}
    }
    let Some(settings) = ctx.node_settings.clone() else {
        return stop(&ctx, &api, &pool, status, Halt::warn("NodesNeedAHostOperator", "this operator does not run on a machine it may make nodes on (nodes need the process runtime, as root)".into()))
        .await;
    };
    if let Err(e) = nestplane_nodes::check_prerequisites(&version) {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn("NodePrerequisitesMissing", e.to_string()).again(Duration::from_secs(60)),
        )
        .await;
    }
    // What nodes of this cluster are built with: its cluster DNS (the address pods get, the
    // host's end of the link for names outside), serving certificates from its CA, and the
    // image of the built-in DNS server where that is the provider.
    let provider = plan::dns_provider(&hc.spec, ctx.dns.default_provider, true);
    let images = node_images(&settings, provider == DnsProvider::Builtin);
    let node_cluster = nestplane_nodes::config::ClusterSettings {
        cluster_dns: plan::dns_service_ip(&plan::networking(&hc.spec))
            .map(|ip| vec![ip.to_string()])
            .unwrap_or_default(),
        cluster_domain: super::dns::ZONE.into(),
        serving_certificates_from_cluster: true,
        resolver_on_host: true,
    };
    if images.is_empty() {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::warn(
                "ImagesMissing",
                format!(
                    "no node images under {}: run `nestplane images build`",
                    settings.images.display()
                ),
            )
            .again(Duration::from_secs(60)),
        )
        .await;
    }
    // Finalizer, before any node exists.
    if !pool.finalizers().iter().any(|f| f == FINALIZER) {
        let mut list = pool.finalizers().to_vec();
        list.push(FINALIZER.into());
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": list, "resourceVersion": pool.resource_version()}})),
        )
        .await?;
    }
    let Some(t) = target(&ctx, &hc).await? else {
        return stop(
            &ctx,
            &api,
            &pool,
            status,
            Halt::wait(
                "WaitingForControlPlane",
                format!(
                    "waiting for HostedCluster {ns}/{}'s control plane to be Ready",
                    hc.name_any()
                ),
            )
            .again(Duration::from_secs(3)),
        )
        .await;
    };
    let key = pool_key(&pool);
    let hash = node_hash(&version, &pool);
    let kube_nodes: Api<KubeNode> = Api::all(t.client.clone());
    let listed = match kube_nodes
        .list(&ListParams::default().labels(&format!("{POOL_LABEL}={name}")))
        .await
    {
        Ok(l) => l.items,
        Err(e) => {
            return stop(
                &ctx,
                &api,
                &pool,
                status,
                Halt::warn(
                    "ClusterUnreachable",
                    format!("listing the hosted cluster's Nodes: {e}"),
                )
                .again(Duration::from_secs(5)),
            )
            .await;
        }
    };
    let mine = ctx.nodes.names(&key);
    // Nodes of this pool that no node of this operator backs (a predecessor's): gone.
    for n in listed.iter().filter(|n| !mine.contains(&n.name_any())) {
        let _ = kube_nodes
            .delete(&n.name_any(), &DeleteParams::default())
            .await;
    }
    let ready_of = |n: &str| {
        listed.iter().find(|k| k.name_any() == n).is_some_and(|k| {
            k.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
    };
    let members: Vec<plan::Member> = ctx.nodes.with(&key, |v| {
        v.iter()
            .map(|m| plan::Member {
                name: m.name.clone(),
                current: m.hash == hash,
                ready: ready_of(&m.name),
            })
            .collect()
    });
    let replicas = pool.spec.replicas.unwrap_or(0).max(0) as u32;
    let rolling = pool
        .spec
        .management
        .replace
        .as_ref()
        .and_then(|r| r.rolling_update.clone())
        .unwrap_or_default();
    let actions = plan::rollout(
        replicas,
        rolling.max_surge.unwrap_or(1).max(0) as u32,
        rolling.max_unavailable.unwrap_or(0).max(0) as u32,
        &members,
    );

    // Approve the client certificates of the nodes we made (and nobody else's).
    approve(&ctx, &t.client, &key).await;

    // The cluster's side of joining, kept in place (a deleted binding comes back).
    if let Err(e) = join::ensure_bindings(&t.client, false).await {
        tracing::warn!(nodepool = %key, error = %e, "keeping the join bindings failed");
    }
    if actions.create > 0 {
        let starts = (0..actions.create).map(|_| {
            start_node(
                &settings,
                &t,
                &pool,
                &version,
                &hash,
                &images,
                &node_cluster,
            )
        });
        for r in futures::future::join_all(starts).await {
            match r {
                Ok(m) => {
                    ctx.event(
                        pool.object_ref(&()),
                        EventType::Normal,
                        "NodeCreated",
                        &format!("node {} ({version})", m.name),
                    )
                    .await;
                    ctx.nodes.with(&key, |v| v.push(m));
                }
                Err(e) => {
                    ctx.event(pool.object_ref(&()), EventType::Warning, "NodeFailed", &e)
                        .await;
                    tracing::warn!(nodepool = %key, error = %e, "starting a node failed");
                }
            }
        }
    }
    let drain_timeout = pool
        .spec
        .node_drain_timeout
        .as_deref()
        .and_then(|d| parse_duration(d).ok())
        .unwrap_or(DEFAULT_DRAIN_TIMEOUT);
    for n in &actions.remove {
        ctx.event(
            pool.object_ref(&()),
            EventType::Normal,
            "DrainingNode",
            &format!("node {n}"),
        )
        .await;
        remove_node(&ctx, &pool, Some(&t.client), n, drain_timeout).await;
    }

    // A node that has registered joined with its client certificate: its bootstrap token is
    // not needed again, and is deleted.
    let joined: Vec<String> = ctx.nodes.with(&key, |v| {
        v.iter()
            .filter(|m| !m.token_deleted && listed.iter().any(|k| k.name_any() == m.name))
            .map(|m| m.token_id.clone())
            .collect()
    });
    for id in joined {
        match join::delete_token(&t.client, &id).await {
            Ok(()) => ctx.nodes.with(&key, |v| {
                for m in v.iter_mut().filter(|m| m.token_id == id) {
                    m.token_deleted = true;
                }
            }),
            Err(e) => {
                tracing::warn!(nodepool = %key, error = %e, "cannot delete a used bootstrap token")
            }
        }
    }

    // Status.
    let names = ctx.nodes.names(&key);
    let infos: Vec<NodeInfo> = ctx.nodes.with(&key, |v| {
        v.iter()
            .map(|m| NodeInfo {
                name: m.name.clone(),
                version: m.version.clone(),
                ready: ready_of(&m.name),
                current: m.hash == hash,
            })
            .collect()
    });
    let ready = infos.iter().filter(|i| i.ready).count() as i32;
    let current = infos.iter().filter(|i| i.current).count() as u32;
    let old_versions = infos.iter().any(|i| i.version != version);
    let old_config = infos.iter().any(|i| !i.current) && !old_versions;
    let done = names.len() as u32 == replicas && current == replicas && ready as u32 == replicas;
    status.replicas = ready;
    status.nodes = infos;
    status.observed_generation = generation;
    if done {
        status.version = Some(version.clone());
    }
    let set = |st: &mut NodePoolStatus, c| conditions::set(&mut st.conditions, c, generation, now);
    set(
        &mut status,
        if done {
            conditions::new(
                types::READY,
                true,
                "AsExpected",
                format!("{ready}/{replicas} nodes Ready"),
            )
        } else {
            conditions::new(
                types::READY,
                false,
                "ScalingOrUpdating",
                format!("{ready}/{replicas} nodes Ready"),
            )
        },
    );
    let healthy = status.nodes.iter().all(|n| n.ready);
    let not_ready = status
        .nodes
        .iter()
        .filter(|n| !n.ready)
        .map(|n| n.name.clone())
        .collect::<Vec<_>>()
        .join(", ");
    set(
        &mut status,
        conditions::new(
            types::ALL_NODES_HEALTHY,
            healthy,
            if healthy {
                "AsExpected"
            } else {
                "NodesNotReady"
            },
            not_ready,
        ),
    );
    set(
        &mut status,
        conditions::new(
            types::UPDATING_VERSION,
            old_versions,
            if old_versions {
                "Replacing"
            } else {
                "AsExpected"
            },
            if old_versions {
                format!("replacing nodes for {version}")
            } else {
                String::new()
            },
        ),
    );
    set(
        &mut status,
        conditions::new(
            types::UPDATING_CONFIG,
            old_config,
            if old_config {
                "Replacing"
            } else {
                "AsExpected"
            },
            if old_config {
                "replacing nodes for new labels, taints or pod security level".to_string()
            } else {
                String::new()
            },
        ),
    );
    if done
        && !pool
            .status
            .as_ref()
            .is_some_and(|s| conditions::is_true(&s.conditions, types::READY))
    {
        ctx.event(
            pool.object_ref(&()),
            EventType::Normal,
            "Ready",
            &format!("{ready}/{replicas} nodes Ready"),
        )
        .await;
    }
    write_status(&api, &pool, status).await?;
    Ok(Action::requeue(if done {
        Duration::from_secs(30)
    } else {
        Duration::from_secs(2)
    }))
}

/// The archives every node gets: the pause image and the small shell image.
fn node_images(settings: &NodeSettings, builtin_dns: bool) -> Vec<PathBuf> {
    let mut names = vec![
        "registry.k8s.io/pause:3.2",
        nestplane_nodes::images::SHELL_IMAGE,
    ];
    if builtin_dns {
        names.push(nestplane_nodes::images::OPERATOR_IMAGE);
    }
    names
        .iter()
        .map(|n| nestplane_nodes::images::archive_path(&settings.images, n))
        .filter(|p| p.exists())
        .collect()
}

async fn start_node(
    settings: &NodeSettings,
    t: &Target,
    pool: &NodePool,
    version: &str,
    hash: &str,
    images: &[PathBuf],
    cluster: &nestplane_nodes::config::ClusterSettings,
) -> Result<Managed, String> {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let suffix: String = {
        let mut rng = rand::rng();
        (0..5)
            .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
            .collect()
    };
    let name = format!("{}-{suffix}", pool.name_any());
    let token = BootstrapToken::generate();
    join::create_token(&t.client, &token, TOKEN_TTL)
        .await
        .map_err(|e| format!("node {name}: {e}"))?;
    let mut labels: BTreeMap<String, String> = pool.spec.node_labels.clone();
    labels.insert(POOL_LABEL.into(), pool.name_any());
    let taints = pool
        .spec
        .taints
        .iter()
        .map(|t| match &t.value {
            Some(v) if !v.is_empty() => format!("{}={v}:{}", t.key, t.effect),
            _ => format!("{}:{}", t.key, t.effect),
        })
        .collect();
    let dir = settings
        .dir
        .join(pool.namespace().unwrap_or_default())
        .join(pool.name_any())
        .join(&name);
    let node = Node::start(NodeConfig {
        name: name.clone(),
        dir,
        ca_pem: t.ca_pem.clone(),
        token: token.token(),
        apiservers: vec![t.apiserver],
        api_port: t.apiserver.port(),
        images: images.to_vec(),
        pause_image: "registry.k8s.io/pause:3.2".into(),
        labels,
        taints,
        // Serving certificates from the cluster's CA are approved by [`approve`].
        cluster: cluster.clone(),
        version: version.into(),
        // The group of the hosted cluster's control plane: its nodes reach each other, and of
        // the control planes on this machine only that one reaches them.
        group: Some(t.group),
        control_plane_user: t.user,
        guard: Some(nestplane_nodes::guard::Setup {
            nestplane: settings.guard.clone(),
            level: guard_level(pool.spec.pod_security.unwrap_or_default()),
        }),
    })
    .await
    .map_err(|e| format!("node {name}: {e}"))?;
    Ok(Managed {
        name,
        token_id: token.id,
        hash: hash.into(),
        version: version.into(),
        token_deleted: false,
        node: Some(node),
    })
}

/// Approve pending kubelet certificate requests of the nodes this pool made, and nobody
/// else's: a client certificate when the request comes with the bootstrap token made for the
/// node it names; a serving certificate when the node asks with its own credential for its own
/// name and address ([`plan::judge_serving_request`]). Every other request stays pending.
async fn approve(ctx: &Context, client: &kube::Client, key: &str) {
    let (tokens, addresses): (HashMap<String, String>, HashMap<String, Ipv4Addr>) =
        ctx.nodes.with(key, |v| {
            (
                v.iter()
                    .map(|m| (format!("system:bootstrap:{}", m.token_id), m.name.clone()))
                    .collect(),
                v.iter()
                    .filter_map(|m| Some((m.name.clone(), m.node.as_ref()?.ip())))
                    .collect(),
            )
        });
    if tokens.is_empty() {
        return;
    }
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let Ok(list) = api.list(&ListParams::default()).await else {
        return;
    };
    for mut csr in list.items {
        let decided = csr
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| !c.is_empty());
        if decided {
            continue;
        }
        let requester = csr.spec.username.clone().unwrap_or_default();
        let pem = String::from_utf8_lossy(&csr.spec.request.0).into_owned();
        let (node, what) = match csr.spec.signer_name.as_str() {
            plan::KUBELET_CLIENT_SIGNER => {
                let Some(node) = tokens.get(&requester) else {
                    continue;
                };
                match nestplane_pki::csr_subject(&pem) {
                    Ok((cn, orgs))
                        if cn == format!("system:node:{node}") && orgs == ["system:nodes"] => {}
                    _ => {
                        tracing::warn!(csr = %csr.name_any(), %node, "a request with node {node}'s token asks for something else; not approved");
                        continue;
                    }
                }
                (node.clone(), "joining with the token made for it")
            }
            plan::KUBELET_SERVING_SIGNER => {
                let Some((node, ip)) = requester
                    .strip_prefix("system:node:")
                    .and_then(|n| Some((n.to_string(), *addresses.get(n)?)))
                else {
                    continue;
                };
                let usages = csr.spec.usages.clone().unwrap_or_default();
                let verdict = nestplane_pki::csr_info(&pem)
                    .map_err(|e| e.to_string())
                    .and_then(|info| {
                        plan::judge_serving_request(&requester, &usages, &info, &node, ip)
                    });
                if let Err(why) = verdict {
                    tracing::warn!(csr = %csr.name_any(), %node, reason = %why, "a serving certificate request of node {node} not approved");
                    continue;
                }
                (node, "serving on its own name and address")
            }
            _ => continue,
        };
        let name = csr.name_any();
        let status = csr.status.get_or_insert_with(Default::default);
        status.conditions = Some(vec![
            k8s_openapi::api::certificates::v1::CertificateSigningRequestCondition {
                type_: "Approved".into(),
                status: "True".into(),
                reason: Some("NestplaneNodePool".into()),
                message: Some(format!("node {node} of NodePool {key}, {what}")),
                ..Default::default()
            },
        ]);
        match api
            .replace_subresource("approval", &name, &PostParams::default(), &csr)
            .await
        {
            Ok(_) => tracing::info!(csr = %name, %node, "approved"),
            Err(e) => tracing::warn!(csr = %name, error = %e, "approving failed"),
        }
    }
}

/// Cordon and drain `node` (evictions, which PodDisruptionBudgets may refuse, until
/// `timeout`; then its pods are deleted), delete its Node and remove it from this machine.
/// Events on the pool say when a budget held the drain and which pods the timeout deleted.
async fn remove_node(
    ctx: &Context,
    pool: &NodePool,
    client: Option<&kube::Client>,
    node: &str,
    timeout: Duration,
) {
    let key = &pool_key(pool);
    if let Some(client) = client {
        let on_block = |pods: Vec<String>| async move {
            ctx.event(
                pool.object_ref(&()),
                EventType::Normal,
                "DrainBlocked",
                &format!(
                    "node {node}: a PodDisruptionBudget refuses evicting {} for now; retrying until the drain timeout ({}s)",
                    pods.join(", "),
                    timeout.as_secs()
                ),
            )
            .await;
        };
        match drain(client, node, timeout, on_block).await {
            Ok(forced) if !forced.is_empty() => {
                ctx.event(
                    pool.object_ref(&()),
                    EventType::Warning,
                    "DrainTimedOut",
                    &format!(
                        "node {node}: not drained within {}s; deleted {}",
                        timeout.as_secs(),
                        forced.join(", ")
                    ),
                )
                .await;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(nodepool = %key, %node, error = %e, "draining failed; removing the node anyway");
            }
        }
        let _ = Api::<KubeNode>::all(client.clone())
            .delete(node, &DeleteParams::default())
            .await;
    }
    if let Some(mut m) = ctx.nodes.take(key, node) {
        if let Some(client) = client {
            let _ = join::delete_token(client, &m.token_id).await;
        }
        if let Some(n) = m.node.take()
            && let Err(e) = n.remove().await
        {
            tracing::warn!(nodepool = %key, %node, error = %e, "removing the node left something behind");
        }
    }
}

/// Whether a pod is left alone by a drain (a DaemonSet's, a static pod's, or finished).
pub fn drain_skips(p: &Pod) -> bool {
    let daemon = p
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet");
    let mirror = p.annotations().contains_key("kubernetes.io/config.mirror");
    let finished = p
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
    daemon || mirror || finished
}

/// Returns the pods the timeout deleted (`ns/name`); `on_block` is told once which pods a
/// PodDisruptionBudget kept.
async fn drain<F, Fut>(
    client: &kube::Client,
    node: &str,
    timeout: Duration,
    on_block: F,
) -> Result<Vec<String>, String>
where
    F: FnOnce(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut on_block = Some(on_block);
    let nodes: Api<KubeNode> = Api::all(client.clone());
    match nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(vec![]),
        Err(e) => return Err(format!("cordoning: {e}")),
    }
    let deadline = Instant::now() + timeout;
    let mut forced = Vec::new();
    let pods: Api<Pod> = Api::all(client.clone());
    loop {
        let list = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|e| format!("listing pods: {e}"))?;
        let left: Vec<Pod> = list.items.into_iter().filter(|p| !drain_skips(p)).collect();
        if left.is_empty() {
            return Ok(forced);
        }
        let force = Instant::now() > deadline;
        let mut blocked = Vec::new();
        for p in &left {
            let ns = p.namespace().unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            if force {
                if api
                    .delete(&p.name_any(), &DeleteParams::default().grace_period(0))
                    .await
                    .is_ok()
                {
                    forced.push(format!("{ns}/{}", p.name_any()));
                }
            } else if p.metadata.deletion_timestamp.is_none() {
                // 429: a PodDisruptionBudget says not now; tried again below.
                if let Err(kube::Error::Api(e)) =
                    api.evict(&p.name_any(), &EvictParams::default()).await
                    && e.code == 429
                {
                    blocked.push(format!("{ns}/{}", p.name_any()));
                }
            }
        }
        if !blocked.is_empty()
            && let Some(f) = on_block.take()
        {
            f(blocked).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Deletion: every node drained (when the cluster still answers) and removed, then the
/// finalizer. Works when the HostedCluster or its control plane is already gone.
async fn teardown(
    pool: &NodePool,
    ctx: &Context,
    api: &Api<NodePool>,
    hc: Option<&HostedCluster>,
) -> Result<Action, Error> {
    if !pool.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let key = pool_key(pool);
    let t = match hc {
        Some(hc) => target(ctx, hc).await.ok().flatten(),
        None => None,
    };
    let timeout = pool
        .spec
        .node_drain_timeout
        .as_deref()
        .and_then(|d| parse_duration(d).ok())
        .unwrap_or(DEFAULT_DRAIN_TIMEOUT);
    for n in ctx.nodes.names(&key) {
        remove_node(ctx, pool, t.as_ref().map(|t| &t.client), &n, timeout).await;
    }
    let list: Vec<String> = pool
        .finalizers()
        .iter()
        .filter(|f| *f != FINALIZER)
        .cloned()
        .collect();
    api.patch(
        &pool.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": list, "resourceVersion": pool.resource_version()}})),
    )
    .await?;
    Ok(Action::await_change())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pool(spec: serde_json::Value) -> NodePool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "nestplane.io/v1alpha1", "kind": "NodePool",
            "metadata": {"name": "p", "namespace": "n"}, "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn labels_taints_and_durations_are_checked_before_they_reach_a_kubelet() {
        assert!(validate_pool(&pool(serde_json::json!({"clusterName": "c", "nodeLabels": {"tier": "web"}, "taints": [{"key": "gpu", "effect": "NoSchedule"}], "nodeDrainTimeout": "1m30s"}))).is_ok());
        assert!(
            validate_pool(&pool(
                serde_json::json!({"clusterName": "c", "nodeLabels": {"a": "b,--x=y"}})
            ))
            .is_err()
        );
        assert!(validate_pool(&pool(serde_json::json!({"clusterName": "c", "taints": [{"key": "gpu", "effect": "Maybe"}]}))).is_err());
        assert!(
            validate_pool(&pool(
                serde_json::json!({"clusterName": "c", "nodeLabels": {POOL_LABEL: "x"}})
            ))
            .is_err()
        );
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("-5s").is_err());
        // Nothing a user writes panics the parser, or overflows a deadline.
        for bad in [
            "1s-1s",
            "6000000000000000h",
            &"9".repeat(400),
            "1e9h",
            "999999999h",
            "1h1h1h1h1h",
            "",
            ".5s",
            "5.s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_duration("720h"), Ok(MAX_DURATION));
    }

    #[test]
    fn each_hosted_cluster_without_a_user_has_its_own_isolation_group() {
        let a = isolation_group("default", "a");
        assert_eq!(a, isolation_group("default", "a"));
        assert_ne!(a, isolation_group("default", "b"));
        assert_ne!(a, isolation_group("other", "a"));
        assert!(a >= 0x8000_0000, "never a tenant user's uid");
    }

    #[test]
    fn what_a_node_is_built_from_changes_its_hash() {
        let a = pool(serde_json::json!({"clusterName": "c"}));
        let b = pool(serde_json::json!({"clusterName": "c", "nodeLabels": {"tier": "web"}}));
        assert_eq!(node_hash("v1.20.2", &a), node_hash("v1.20.2", &a));
        assert_ne!(node_hash("v1.20.2", &a), node_hash("v1.20.2", &b));
        assert_ne!(node_hash("v1.20.2", &a), node_hash("v1.20.1", &a));
        let replicas_only = pool(serde_json::json!({"clusterName": "c", "replicas": 5}));
        assert_eq!(
            node_hash("v1.20.2", &a),
            node_hash("v1.20.2", &replicas_only)
        );
    }
}
