//! The Cluster API bootstrap provider (`NestplaneConfig`): for the Machine that references a
//! config, a short-lived bootstrap token in the Machine's cluster and the bootstrap data
//! Secret ([`data::script`]), which runs `nestplane node join` on the machine. The machine
//! comes in through the tenant's door behind the gateway ([`nestplane_nodes::entry`]): it
//! is dialled by nobody. Its kubelet's certificates are approved here (the client certificate
//! for the token made for it, the serving certificate for its own name and address), and the
//! token is deleted once its Node has registered.
//!
//! The cluster: the `NestedControlPlane` of the Machine's `spec.clusterName` (owned by that
//! Cluster, or so named), once it is Ready and reached through the operator's gateway.

pub mod data;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::bootstrap::{
    BootstrapInitialization, GROUP, NestplaneConfig, NestplaneConfigStatus, reasons,
};
use nestplane_api::conditions;
use nestplane_api::names::{self, SecretPurpose};
use nestplane_nodes::join::{self, BootstrapToken};

use crate::context::{Context, Error};
use crate::hosted::pool::csr;
use crate::hosted::pool::machines::Machine as Made;
use crate::hosted::target;
use crate::tenant;

const MANAGER: &str = "nestplane-bootstrap";
/// The slots given to machines, highest first (nodes on the operator's own machine take
/// theirs from 1 up: the two meet only past this many nodes in one cluster).
pub const MACHINE_SLOTS: std::ops::RangeInclusive<u8> = 101..=250;

/// The slot (address block, [`nestplane_nodes::config::Addresses::of`]) the provider gave
/// each machine of each cluster: what their tunnel agents may announce. Read whole from the
/// configs' statuses when the provider starts ([`Assigned::load_from`]); until then every
/// announcement is refused (agents retry), so nothing is admitted that the blocks would not
/// allow.
#[derive(Default)]
pub struct Assigned {
    blocks: Mutex<HashMap<(String, String), HashMap<String, u8>>>,
    loaded: std::sync::atomic::AtomicBool,
}

impl Assigned {
    fn set(&self, ns: &str, cluster: &str, node: &str, slot: u8) {
        let mut map = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((ns.to_string(), cluster.to_string()))
            .or_default()
            .insert(node.to_string(), slot);
    }

    /// The node's block is given back (its config is deleted).
    fn forget(&self, ns: &str, cluster: &str, node: &str) {
        let mut map = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(nodes) = map.get_mut(&(ns.to_string(), cluster.to_string())) {
            nodes.remove(node);
        }
    }

    /// Every block the configs' statuses record (`clusterName`, `nodeName`, `slot`); from
    /// then on announcements are judged.
    pub fn load(&self, configs: &[NestplaneConfig]) {
        for c in configs {
            let Some(s) = &c.status else { continue };
            if let (Some(cluster), Some(node), Some(slot)) = (&s.cluster_name, &s.node_name, s.slot)
            {
                self.set(&c.namespace().unwrap_or_default(), cluster, node, slot);
            }
        }
        self.loaded
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Exactly the blocks `configs` record: what a follower of another process's provider
    /// holds after (re)listing them.
    pub fn replace(&self, configs: &[NestplaneConfig]) {
        self.blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.load(configs);
    }

    /// The block `config` records (given, or given back when `deleted`).
    pub fn note(&self, config: &NestplaneConfig, deleted: bool) {
        let Some(s) = &config.status else { return };
        let ns = config.namespace().unwrap_or_default();
        match (&s.cluster_name, &s.node_name, s.slot) {
            (Some(cluster), Some(node), _) if deleted => self.forget(&ns, cluster, node),
            (Some(cluster), Some(node), Some(slot)) => self.set(&ns, cluster, node, slot),
            _ => {}
        }
    }

    /// Read every config's block, and start judging (the provider's first step; a failure
    /// is retried, and fails `/readyz` meanwhile: nothing is bootstrapped until it is read).
    pub async fn load_from(&self, ctx: &Context, namespace: Option<&str>) {
        let api: Api<NestplaneConfig> = match namespace {
            Some(ns) => Api::namespaced(ctx.client.clone(), ns),
            None => Api::all(ctx.client.clone()),
        };
        loop {
            match api.list(&Default::default()).await {
                Ok(l) => return self.load(&l.items),
                Err(e) => {
                    tracing::warn!(error = %e, "reading the machines' address blocks; retrying");
                    ctx.metrics.watch_failed("NestplaneConfig");
                    ctx.health.watch_failed(
                        "NestplaneConfig",
                        format!("reading the machines' address blocks: {e}"),
                    );
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        }
    }

    /// What node `node` of cluster `ns/cluster` may announce: its assigned block exactly
    /// (`Ok(true)`); a node the provider did not make (joined by hand) anything that touches
    /// no assigned block (`Ok(false)`). Pure but for the lookup.
    pub fn check(
        &self,
        ns: &str,
        cluster: &str,
        node: &str,
        ip: std::net::Ipv4Addr,
        cidr: Option<ipnet::Ipv4Net>,
    ) -> Result<bool, String> {
        if !self.loaded.load(std::sync::atomic::Ordering::Acquire) {
            return Err("the operator is still reading the machines' address blocks".into());
        }
        let map = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        let empty = HashMap::new();
        let nodes = map
            .get(&(ns.to_string(), cluster.to_string()))
            .unwrap_or(&empty);
        let block = |slot: u8| {
            let a = nestplane_nodes::config::Addresses::of(slot);
            (a.node_ip, a.pod_cidr.parse::<ipnet::Ipv4Net>().ok())
        };
        if let Some(slot) = nodes.get(node) {
            let (want_ip, want_cidr) = block(*slot);
            if ip != want_ip || cidr.is_some_and(|c| Some(c) != want_cidr) {
                return Err(format!(
                    "node {node} was given {want_ip} and its pods {}, not {ip}",
                    want_cidr.map(|c| c.to_string()).unwrap_or_default()
                ));
            }
            return Ok(true);
        }
        for (other, slot) in nodes {
            let (oip, ocidr) = block(*slot);
            let overlaps = ip == oip
                || cidr.is_some_and(|c| c.contains(&oip))
                || ocidr.is_some_and(|o| {
                    o.contains(&ip)
                        || cidr
                            .is_some_and(|c| c.contains(&o.network()) || o.contains(&c.network()))
                });
            if overlaps {
                return Err(format!("{ip} or its pod range is node {other}'s"));
            }
        }
        Ok(false)
    }
}

/// How often a config whose machine has not joined (or whose Node is not Ready yet: its
/// serving certificate waits for approval) is looked at.
const JOINING: Duration = Duration::from_secs(3);
/// How often one that waits for something else is.
const WAITING: Duration = Duration::from_secs(10);
/// How often one whose node runs is (its kubelet's certificate renewals are approved).
const JOINED: Duration = Duration::from_secs(60);

/// The Machine that references a config, as far as the provider reads it.
#[derive(Clone, Debug)]
struct MachineView {
    name: String,
    cluster: String,
    version: Option<String>,
    paused: bool,
}

fn machines_resource(version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, version, "Machine"),
        "machines",
    )
}

/// Whether `m` references the config `name` (v1beta2 `apiGroup`, v1beta1 `apiVersion`).
fn references(m: &DynamicObject, name: &str) -> bool {
    let r = &m.data["spec"]["bootstrap"]["configRef"];
    let group = r["apiGroup"]
        .as_str()
        .map(str::to_string)
        .or_else(|| {
            r["apiVersion"]
                .as_str()
                .and_then(|v| v.split('/').next())
                .map(str::to_string)
        })
        .unwrap_or_default();
    group == GROUP && r["kind"] == "NestplaneConfig" && r["name"] == name
}

/// Which Machine a config is for.
enum Found {
    /// None references it (or Machines are not served).
    None,
    /// More than one does: none is served.
    Ambiguous(Vec<String>),
    /// This one.
    Machine(MachineView),
}

/// The Machine of `cfg`: the one in its namespace whose `configRef` names it, and, where the
/// config has a Machine for owner (Cluster API's Machine controller sets it), that very one.
async fn machine_of(ctx: &Context, cfg: &NestplaneConfig) -> Result<Found, Error> {
    let ns = cfg.namespace().unwrap_or_default();
    let name = cfg.name_any();
    for version in ["v1beta2", "v1beta1"] {
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &ns, &machines_resource(version));
        let listed = match api.list(&Default::default()).await {
            Ok(l) => l.items,
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(e) => return Err(e.into()),
        };
        let owner = cfg
            .owner_references()
            .iter()
            .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
            .map(|o| o.uid.clone());
        let found: Vec<DynamicObject> = listed
            .into_iter()
            .filter(|m| {
                references(m, &name)
                    && owner
                        .as_deref()
                        .is_none_or(|u| m.metadata.uid.as_deref() == Some(u))
            })
            .collect();
        return Ok(match found.as_slice() {
            [] => Found::None,
            [m] => Found::Machine(MachineView {
                name: m.name_any(),
                cluster: m.data["spec"]["clusterName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                version: m.data["spec"]["version"].as_str().map(str::to_string),
                paused: m.annotations().contains_key(names::PAUSED_ANNOTATION),
            }),
            many => Found::Ambiguous(many.iter().map(|m| m.name_any()).collect()),
        });
    }
    Ok(Found::None)
}

/// One allocation at a time in this operator: two configs never get one block.
static ALLOCATING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The config's address block: the one it has, else the highest of [`MACHINE_SLOTS`] no other
/// config of the namespace has, recorded in its status before it is used.
async fn slot_of(ctx: &Context, cfg: &NestplaneConfig) -> Result<Option<u8>, Error> {
    if let Some(s) = cfg.status.as_ref().and_then(|s| s.slot) {
        return Ok(Some(s));
    }
    let _one = ALLOCATING.lock().await;
    let api: Api<NestplaneConfig> =
        Api::namespaced(ctx.client.clone(), &cfg.namespace().unwrap_or_default());
    let listed = api.list(&Default::default()).await?.items;
    // The cache may be behind: a block already given is this config's for good.
    if let Some(own) = listed
        .iter()
        .find(|c| c.uid() == cfg.uid())
        .and_then(|c| c.status.as_ref()?.slot)
    {
        return Ok(Some(own));
    }
    let used: std::collections::HashSet<u8> = listed
        .into_iter()
        .filter(|c| c.uid() != cfg.uid())
        .filter_map(|c| c.status.and_then(|s| s.slot))
        .collect();
    let Some(slot) = MACHINE_SLOTS.rev().find(|s| !used.contains(s)) else {
        return Ok(None);
    };
    api.patch_status(
        &cfg.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": { "slot": slot } })),
    )
    .await?;
    Ok(Some(slot))
}

/// The control plane of the cluster `cluster` in `ns`: owned by that Cluster, else named so
/// and owned by no Cluster.
async fn control_plane_of(
    ctx: &Context,
    ns: &str,
    cluster: &str,
) -> Result<Option<NestedControlPlane>, Error> {
    let all = Api::<NestedControlPlane>::namespaced(ctx.client.clone(), ns)
        .list(&Default::default())
        .await?
        .items;
    let owned = all
        .iter()
        .find(|n| tenant::owning_cluster(n).as_deref() == Some(cluster));
    Ok(owned
        .or_else(|| {
            all.iter()
                .find(|n| n.name_any() == cluster && tenant::owning_cluster(n).is_none())
        })
        .cloned())
}

/// The config's status with `cond` set.
fn with_condition(
    cfg: &NestplaneConfig,
    mut status: NestplaneConfigStatus,
    cond: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition,
) -> NestplaneConfigStatus {
    conditions::set(
        &mut status.conditions,
        cond,
        cfg.metadata.generation,
        k8s_openapi::jiff::Timestamp::now(),
    );
    status.observed_generation = cfg.metadata.generation;
    status
}

async fn write_status(
    ctx: &Context,
    cfg: &NestplaneConfig,
    status: NestplaneConfigStatus,
) -> Result<(), Error> {
    if cfg.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<NestplaneConfig> =
        Api::namespaced(ctx.client.clone(), &cfg.namespace().unwrap_or_default());
    let body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    api.patch_status(
        &cfg.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": body })),
    )
    .await?;
    Ok(())
}

/// Say why the config waits (a condition, and an Event when the reason is new).
async fn wait(
    ctx: &Context,
    cfg: &NestplaneConfig,
    type_: &str,
    reason: &str,
    message: String,
    warning: bool,
) -> Result<Action, Error> {
    let before = cfg
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, type_))
        .map(|c| c.reason.clone());
    let status = with_condition(
        cfg,
        cfg.status.clone().unwrap_or_default(),
        conditions::new(type_, false, reason, message.clone()),
    );
    write_status(ctx, cfg, status).await?;
    if before.as_deref() != Some(reason) {
        let kind = if warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        ctx.event(cfg.object_ref(&()), kind, reason, &message).await;
    }
    Ok(Action::requeue(WAITING))
}

/// The finalizer of a config that may have made a token: the token goes with the config.
pub const FINALIZER: &str = "bootstrap.nestplane.io/token";

/// A config is being deleted: the token it made (if its machine never joined) is deleted in
/// its cluster, then the finalizer goes. A cluster that cannot be reached (gone with its
/// Machine's Cluster) keeps nothing waiting: the token expires by itself there.
async fn release(ctx: &Context, cfg: &NestplaneConfig) -> Result<Action, Error> {
    if !crate::finalizer::has(cfg, FINALIZER) {
        return Ok(Action::await_change());
    }
    let ns = cfg.namespace().unwrap_or_default();
    let status = cfg.status.clone().unwrap_or_default();
    if let (Some(cluster), Some(node)) = (&status.cluster_name, &status.node_name) {
        ctx.assigned.forget(&ns, cluster, node);
    }
    let expired = status.token_expires.as_deref().is_none_or(|t| {
        t.parse::<k8s_openapi::jiff::Timestamp>()
            .map_or(true, |t| t <= k8s_openapi::jiff::Timestamp::now())
    });
    if let (Some(id), Some(cluster), false) = (
        status.token_id.as_deref(),
        status.cluster_name.as_deref(),
        status.token_deleted,
    ) {
        let deleted = match target::admin_client(ctx, &ns, cluster).await {
            Ok(Some(client)) => join::delete_token(&client, id)
                .await
                .map_err(|e| Some(e.to_string())),
            // The cluster is gone: its tokens with it.
            Ok(None) => Err(None),
            Err(e) => Err(Some(e.to_string())),
        };
        match deleted {
            Ok(()) => {
                ctx.event(
                    cfg.object_ref(&()),
                    EventType::Normal,
                    "TokenDeleted",
                    &format!("the config is deleted before its machine joined: its bootstrap token {id} is deleted in cluster {cluster}"),
                )
                .await;
            }
            // The cluster is there but failed: again, until the token would be gone anyway.
            Err(Some(e)) if !expired => {
                tracing::warn!(config = %cfg.name_any(), token = %id, error = %e, "cannot delete a deleted config's bootstrap token yet; trying again");
                return Ok(Action::requeue(WAITING));
            }
            Err(_) => {}
        }
    }
    let api: Api<NestplaneConfig> = Api::namespaced(ctx.client.clone(), &ns);
    crate::finalizer::remove(&api, cfg, FINALIZER).await?;
    Ok(Action::await_change())
}

/// The config waits for its cluster's control plane, saying why.
async fn waiting_for_control_plane(
    ctx: &Context,
    cfg: &NestplaneConfig,
    why: String,
) -> Result<Action, Error> {
    wait(
        ctx,
        cfg,
        "Ready",
        reasons::WAITING_FOR_CONTROL_PLANE,
        why,
        false,
    )
    .await
}

/// One pass over a config.
pub async fn reconcile(cfg: Arc<NestplaneConfig>, ctx: Arc<Context>) -> Result<Action, Error> {
    if cfg.metadata.deletion_timestamp.is_some() {
        // Its data Secret goes with it (owned); its token is deleted here.
        return release(&ctx, &cfg).await;
    }
    let ns = cfg.namespace().unwrap_or_default();
    if let Err(why) = data::validate(&cfg.spec) {
        return wait(&ctx, &cfg, "Ready", reasons::INVALID_SPEC, why, true).await;
    }
    let machine = match machine_of(&ctx, &cfg).await? {
        Found::Machine(m) => m,
        Found::None => {
            return wait(
                &ctx,
                &cfg,
                "Ready",
                reasons::WAITING_FOR_MACHINE,
                "no Machine references this NestplaneConfig (spec.bootstrap.configRef)".into(),
                false,
            )
            .await;
        }
        Found::Ambiguous(names) => {
            return wait(
                &ctx,
                &cfg,
                "Ready",
                reasons::AMBIGUOUS_MACHINE,
                format!(
                    "Machines {} all reference this NestplaneConfig: a config bootstraps one Machine",
                    names.join(", ")
                ),
                true,
            )
            .await;
        }
    };
    // Before any token can exist.
    crate::finalizer::add(
        &Api::<NestplaneConfig>::namespaced(ctx.client.clone(), &ns),
        cfg.as_ref(),
        FINALIZER,
    )
    .await?;
    let paused = machine.paused || cfg.annotations().contains_key(names::PAUSED_ANNOTATION);
    let status = with_condition(
        &cfg,
        cfg.status.clone().unwrap_or_default(),
        conditions::new(
            "Paused",
            paused,
            if paused { "Paused" } else { "NotPaused" },
            if paused {
                "paused: the Machine or the config carries cluster.x-k8s.io/paused"
            } else {
                "not paused"
            },
        ),
    );
    // Written now (a no-op when unchanged), so that what follows compares with what is stored.
    write_status(&ctx, &cfg, status.clone()).await?;
    if paused {
        return Ok(Action::requeue(WAITING));
    }
    let cfg_now = NestplaneConfig {
        status: Some(status),
        ..(*cfg).clone()
    };
    let cfg = &cfg_now;
    let Some(ncp) = control_plane_of(&ctx, &ns, &machine.cluster).await? else {
        return waiting_for_control_plane(
            &ctx,
            cfg,
            format!(
                "cluster {:?} has no NestedControlPlane in namespace {ns}",
                machine.cluster
            ),
        )
        .await;
    };
    let ncp_status = ncp.status.clone().unwrap_or_default();
    let Some(gateway) = ncp_status.gateway.clone() else {
        return waiting_for_control_plane(&ctx, cfg, format!(
                "control plane {} has no gateway address (status.gateway): machines of other hosts come in through the operator's gateway (--gateway-bind-address)",
                ncp.name_any()
            )).await;
    };
    if gateway.machines.is_none() {
        return waiting_for_control_plane(&ctx, cfg, format!(
                "control plane {} takes no machines of other hosts: its runtime has no door behind the gateway (status.gateway.machines; the process runtime with nodes has one)",
                ncp.name_any()
            )).await;
    }
    if !ncp_status.ready {
        return waiting_for_control_plane(
            &ctx,
            cfg,
            format!("control plane {} is not Ready yet", ncp.name_any()),
        )
        .await;
    }
    let cluster = tenant::cluster_name(&ncp);
    let ca_secret = SecretPurpose::ClusterCa.secret_name(&cluster);
    let (Some(client), Some(ca_bundle)) = (
        target::admin_client(&ctx, &ns, &cluster).await?,
        target::secret_value(&ctx, &ns, &ca_secret, names::TLS_CRT).await?,
    ) else {
        return waiting_for_control_plane(
            &ctx,
            cfg,
            format!(
                "control plane {} has no admin kubeconfig or CA yet",
                ncp.name_any()
            ),
        )
        .await;
    };
    let ca_pem = nestplane_pki::first_certificate(&ca_bundle)?;
    let version = machine
        .version
        .clone()
        .or_else(|| ncp_status.version.clone())
        .or_else(|| ncp.spec.version.clone())
        .unwrap_or_default();
    let node_name = machine.name.clone();
    if let Err(why) = data::validate_machine(&version, &node_name) {
        return wait(&ctx, cfg, "Ready", reasons::INVALID_SPEC, why, true).await;
    }
    let Some(slot) = slot_of(&ctx, cfg).await? else {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::NO_ADDRESS_BLOCK,
            format!(
                "every address block for machines ({} of them) is given to another NestplaneConfig of namespace {ns}",
                MACHINE_SLOTS.len()
            ),
            true,
        )
        .await;
    };
    ctx.assigned.set(&ns, &cluster, &node_name, slot);
    let node_ip = nestplane_nodes::config::Addresses::of(slot).node_ip;
    let mut status = cfg.status.clone().unwrap_or_default();
    status.slot = Some(slot);
    status.cluster_name = Some(cluster.clone());
    status.node_name = Some(node_name.clone());

    // The Node: once it has registered, its token goes.
    let node = Api::<Node>::all(client.clone())
        .get_opt(&node_name)
        .await
        .map_err(|e| Error::Unavailable(format!("cluster {cluster}: {e}")))?;
    let token_id = status.token_id.clone();
    if let Some(node) = &node {
        // Its serving certificate names the address it was given, whatever its status says.
        let ip = Some(node_ip);
        let made = Made {
            name: node_name.clone(),
            token_id: token_id.clone().unwrap_or_default(),
            hash: String::new(),
            version: version.clone(),
            ip,
            token_deleted: status.token_deleted,
        };
        let owner = format!("NestplaneConfig {ns}/{}", cfg.name_any());
        csr::approve(&client, &owner, "NestplaneConfig", &[made]).await;
        if !status.token_deleted {
            if let Some(id) = &token_id {
                join::delete_token(&client, id)
                    .await
                    .map_err(|e| Error::Unavailable(e.to_string()))?;
            }
            status.token_deleted = true;
            status.node_name = Some(node_name.clone());
            ctx.event(
                cfg.object_ref(&()),
                EventType::Normal,
                reasons::NODE_JOINED,
                &format!(
                    "machine {} joined cluster {cluster} as node {node_name}; its bootstrap token is deleted",
                    machine.name
                ),
            )
            .await;
        }
        let status = with_condition(
            cfg,
            status,
            conditions::new(
                "Joined",
                true,
                reasons::NODE_JOINED,
                format!("node {node_name} registered; its bootstrap token is deleted"),
            ),
        );
        write_status(&ctx, cfg, status).await?;
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        return Ok(Action::requeue(if ready { JOINED } else { JOINING }));
    }

    // Not joined: the data Secret with a live token.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let secret_name = cfg.name_any();
    let expired = status.token_expires.as_deref().is_some_and(|t| {
        t.parse::<k8s_openapi::jiff::Timestamp>()
            .is_ok_and(|t| t <= k8s_openapi::jiff::Timestamp::now())
    });
    let existing = secrets.get_opt(&secret_name).await?;
    if let Some(e) = &existing
        && !e
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && Some(&o.uid) == cfg.metadata.uid.as_ref())
    {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::DATA_SECRET_NAME_TAKEN,
            format!(
                "Secret {ns}/{secret_name} exists and is not this config's: the bootstrap data is written under the config's name; rename the config or that Secret"
            ),
            true,
        )
        .await;
    }
    let have = existing.is_some() && token_id.is_some();
    if !have || expired {
        let ttl = data::token_ttl(&cfg.spec).map_err(Error::Internal)?;
        let token = BootstrapToken::generate();
        join::ensure_bindings(&client, false)
            .await
            .map_err(|e| Error::Unavailable(e.to_string()))?;
        let expires = (k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_secs(ttl.into()))
        .to_string();
        // Recorded before it exists: an operator that stops in between leaves no token that
        // its finalizer does not know of.
        Api::<NestplaneConfig>::namespaced(ctx.client.clone(), &ns)
            .patch_status(
                &cfg.name_any(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": {
                    "tokenId": token.id,
                    "tokenExpires": expires,
                    "tokenDeleted": false,
                    "clusterName": cluster,
                }})),
            )
            .await?;
        join::create_token(&client, &token, Duration::from_secs(ttl.into()))
            .await
            .map_err(|e| Error::Unavailable(e.to_string()))?;
        let script = data::script(
            &data::Join {
                server: gateway.server.trim_start_matches("https://").to_string(),
                server_name: gateway.server_name.clone(),
                token: token.token(),
                ca_cert_hash: nestplane_pki::public_key_hash(&ca_pem)?,
                version: version.clone(),
                node_name: node_name.clone(),
                // The API servers' own port (the `kubernetes` Service's), not the endpoint's:
                // that may be the gateway's.
                api_port: names::ports::APISERVER as u16,
                expires: expires.clone(),
                machine: format!("{ns}/{}", machine.name),
                slot,
            },
            &cfg.spec,
        );
        let mut owner = cfg.controller_owner_ref(&()).unwrap_or_default();
        owner.block_owner_deletion = Some(true);
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(secret_name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(
                    [
                        (
                            names::CLUSTER_NAME_LABEL.to_string(),
                            machine.cluster.clone(),
                        ),
                        (
                            names::MANAGED_BY_LABEL.to_string(),
                            names::MANAGED_BY.to_string(),
                        ),
                    ]
                    .into(),
                ),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            type_: Some(names::CAPI_SECRET_TYPE.into()),
            string_data: Some(
                [
                    ("value".to_string(), script),
                    ("format".to_string(), "cloud-config".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let mut body = serde_json::to_value(&secret).map_err(|e| Error::Internal(e.to_string()))?;
        body["apiVersion"] = "v1".into();
        body["kind"] = "Secret".into();
        secrets
            .patch(
                &secret_name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(body),
            )
            .await?;
        if let Some(old) = &token_id {
            // Replaced (expired, or made by a pass that stopped before its Secret was
            // written): gone, so that no token lives that no config names.
            let _ = join::delete_token(&client, old).await;
        }
        let (reason, note) = if expired {
            (
                reasons::TOKEN_REFRESHED,
                format!(
                    "the bootstrap token expired before machine {} joined: a new one (until {expires}) is in Secret {secret_name}",
                    machine.name
                ),
            )
        } else {
            (
                reasons::DATA_SECRET_AVAILABLE,
                format!(
                    "bootstrap data for machine {} is in Secret {secret_name}; its token expires at {expires}",
                    machine.name
                ),
            )
        };
        ctx.event(cfg.object_ref(&()), EventType::Normal, reason, &note)
            .await;
        status.token_id = Some(token.id.clone());
        status.token_expires = Some(expires);
        status.token_deleted = false;
    }
    status.ready = true;
    status.data_secret_name = Some(secret_name.clone());
    status.initialization = Some(BootstrapInitialization {
        data_secret_created: Some(true),
    });
    let status = with_condition(
        cfg,
        status,
        conditions::new(
            "Ready",
            true,
            reasons::DATA_SECRET_AVAILABLE,
            format!("bootstrap data is in Secret {secret_name}"),
        ),
    );
    let status = with_condition(
        cfg,
        status,
        conditions::new(
            "Joined",
            false,
            reasons::WAITING_FOR_NODE,
            format!(
                "waiting for machine {} to register node {node_name}",
                machine.name
            ),
        ),
    );
    // The client certificate of the machine's kubelet, asked for with the token made for it.
    if let Some(id) = &status.token_id {
        let made = Made {
            name: node_name.clone(),
            token_id: id.clone(),
            hash: String::new(),
            version,
            ip: None,
            token_deleted: false,
        };
        let owner = format!("NestplaneConfig {ns}/{}", cfg.name_any());
        csr::approve(&client, &owner, "NestplaneConfig", &[made]).await;
    }
    write_status(&ctx, cfg, status).await?;
    Ok(Action::requeue(JOINING))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_may_announce_its_block_and_nobody_else_may() {
        let a = Assigned::default();
        let check = |node: &str, ip: &str, cidr: &str| {
            a.check(
                "default",
                "far",
                node,
                ip.parse().unwrap(),
                Some(cidr.parse().unwrap()),
            )
        };
        assert!(
            check("m-0", "10.201.250.2", "10.244.250.0/24").is_err(),
            "nothing is admitted before the blocks are read"
        );
        a.load(&[]);
        a.set("default", "far", "m-0", 250);
        a.set("default", "far", "m-1", 249);
        assert_eq!(check("m-0", "10.201.250.2", "10.244.250.0/24"), Ok(true));
        // Another machine's block, or a range over it.
        assert!(check("m-0", "10.201.249.2", "10.244.249.0/24").is_err());
        assert!(check("m-1", "10.201.249.2", "10.244.250.0/24").is_err());
        // A node joined by hand: anything that touches no machine's block.
        assert_eq!(check("by-hand", "10.201.7.2", "10.244.7.0/24"), Ok(false));
        assert!(check("by-hand", "10.201.250.2", "10.244.7.0/24").is_err());
        assert!(check("by-hand", "10.201.7.2", "10.244.249.128/25").is_err());
        assert!(
            check("by-hand", "10.201.7.2", "10.201.250.0/24").is_err(),
            "a pod range over a machine's node address"
        );
        // Another cluster's blocks are its own.
        assert_eq!(
            a.check(
                "default",
                "near",
                "m-0",
                "10.201.249.2".parse().unwrap(),
                None
            ),
            Ok(false)
        );
        // A block given back is anyone's again.
        a.forget("default", "far", "m-1");
        assert_eq!(
            check("by-hand", "10.201.249.2", "10.244.249.0/24"),
            Ok(false)
        );
    }

    /// A config as its status records its machine's block.
    fn config(name: &str, node: &str, slot: u8) -> NestplaneConfig {
        let mut c = NestplaneConfig::new(name, Default::default());
        c.metadata.namespace = Some("default".into());
        c.status = Some(NestplaneConfigStatus {
            cluster_name: Some("far".into()),
            node_name: Some(node.into()),
            slot: Some(slot),
            ..Default::default()
        });
        c
    }

    #[test]
    fn a_follower_holds_exactly_the_blocks_the_configs_record() {
        let a = Assigned::default();
        let check = |node: &str, slot: u8| {
            a.check(
                "default",
                "far",
                node,
                format!("10.201.{slot}.2").parse().unwrap(),
                None,
            )
        };
        a.replace(&[config("a", "m-0", 250)]);
        assert_eq!(check("m-0", 250), Ok(true));
        // Given as the provider in the other process writes it; given back when deleted.
        a.note(&config("b", "m-1", 249), false);
        assert!(check("squatter", 249).is_err());
        a.note(&config("b", "m-1", 249), true);
        assert_eq!(check("squatter", 249), Ok(false));
        // A relist holds what is listed, and nothing from before.
        a.replace(&[config("b", "m-1", 249)]);
        assert_eq!(check("squatter", 250), Ok(false));
        assert_eq!(check("m-1", 249), Ok(true));
    }
}
