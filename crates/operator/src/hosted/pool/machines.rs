//! The node seam: where a pool's nodes run. The NodePool controller decides how many nodes
//! of which [`NodeSpec`] a pool has, makes each one's bootstrap token and approves its
//! certificates; a [`NodeRuntime`] only starts, lists and removes nodes. [`LocalNodes`]
//! runs them on this machine (containerd + kubelet + kube-proxy, `nestplane_nodes`); nodes on
//! other machines are another implementation of the same trait, with the pool's logic
//! unchanged.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use nestplane_nodes::config::{ClusterSettings, NodeSpec};
use nestplane_nodes::egress::Route;
use nestplane_nodes::join::BootstrapToken;
use nestplane_nodes::node::{Node, NodeConfig};

/// A node a runtime made for a pool, as the pool's controller tracks it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// The Node's name.
    pub name: String,
    /// The id of the bootstrap token made for it.
    pub token_id: String,
    /// [`NodeSpec::hash`] of what it was made from.
    pub hash: String,
    /// Its kubelet's version.
    pub version: String,
    /// The address it serves on (what its serving certificate may name), once known.
    pub ip: Option<Ipv4Addr>,
    /// Whether its bootstrap token is gone (deleted once the node has registered).
    pub token_deleted: bool,
}

/// What a runtime needs to make one node that joins its cluster by itself.
pub struct NodeRequest {
    /// The pool's `namespace/name`.
    pub pool: String,
    /// The Node's name.
    pub name: String,
    /// What the node is; hashed whole.
    pub spec: NodeSpec,
    /// Its bootstrap token (made in the cluster already).
    pub token: BootstrapToken,
    /// The cluster's CA certificate (PEM).
    pub ca_pem: String,
    /// The cluster's API server as this machine reaches it.
    pub apiserver: SocketAddr,
    /// Its other replicas, if known: the node's proxy tries each in turn.
    pub replicas: Vec<SocketAddr>,
    /// The cluster's DNS settings.
    pub cluster: ClusterSettings,
    /// The cluster's isolation group ([`crate::hosted::target::isolation_group`]).
    pub group: u32,
    /// The uid of the cluster's control-plane processes on this machine, if any.
    pub control_plane_user: Option<u32>,
    /// Whether the node runs the built-in DNS server's image.
    pub builtin_dns: bool,
}

/// Where nodes run. Implementations keep their own record of what they made.
pub trait NodeRuntime: Send + Sync {
    /// Why nodes of `version` cannot be made now (a condition reason and a message).
    fn check(&self, version: &str, builtin_dns: bool) -> Result<(), (&'static str, String)>;
    /// Make a node and start it; it registers with its cluster by itself.
    fn start(&self, request: NodeRequest) -> BoxFuture<'_, Result<Machine, String>>;
    /// The nodes of a pool (`namespace/name`).
    fn list(&self, pool: &str) -> Vec<Machine>;
    /// Record that a node's bootstrap token was deleted.
    fn token_deleted(&self, pool: &str, name: &str);
    /// Remove a node (drained already, or its cluster is gone).
    fn remove<'a>(&'a self, pool: &'a str, name: &'a str) -> BoxFuture<'a, ()>;
    /// Remove every node (the operator is stopping).
    fn remove_all(&self) -> BoxFuture<'_, ()>;
    /// How the API server of the cluster whose isolation group is `group` reaches into its
    /// network: through its running nodes here ([`nestplane_nodes::egress`]).
    fn routes(&self, group: u32) -> Vec<Route>;
}

/// Where nodes live on this machine and what they are given.
#[derive(Clone, Debug)]
pub struct NodeSettings {
    /// Nodes' directories go under `<dir>/<namespace>/<pool>/<node>`.
    pub dir: PathBuf,
    /// Where `nestplane images build` put its archives.
    pub images: PathBuf,
    /// The `nestplane` binary whose `runc-guard` command judges every container on the
    /// nodes (the node guard, [`nestplane_nodes::guard`]).
    pub guard: PathBuf,
    /// Images every node imports besides the pause, shell and DNS images (by name; those
    /// whose archive exists).
    pub extra_images: Vec<String>,
}

/// The pause image every node runs pods with.
pub const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.2";

/// A node this runtime made: its record, the node itself while it runs, and its cluster's
/// isolation group.
struct Held {
    machine: Machine,
    node: Option<Node>,
    group: u32,
    /// The node's network namespace, held open from its start (what the API server's
    /// egress connects inside).
    netns: Option<Arc<OwnedFd>>,
}

/// A pool's nodes.
type PoolNodes = Vec<Held>;

/// Nodes on this machine, as children of this process: an operator that stops takes them
/// with it, and its successor makes new ones.
pub struct LocalNodes {
    settings: NodeSettings,
    pools: Mutex<HashMap<String, PoolNodes>>,
}

impl LocalNodes {
    /// Nodes under `settings`.
    pub fn new(settings: NodeSettings) -> LocalNodes {
        LocalNodes {
            settings,
            pools: Default::default(),
        }
    }

    fn with<T>(&self, pool: &str, f: impl FnOnce(&mut PoolNodes) -> T) -> T {
        let mut map = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        let v = map.entry(pool.to_string()).or_default();
        let out = f(v);
        if v.is_empty() {
            // A pool without nodes leaves nothing behind.
            map.remove(pool);
        }
        out
    }

    /// The archives every node gets: the pause image, the small shell image, and the
    /// built-in DNS server's where that is the provider; those that exist.
    fn images(&self, builtin_dns: bool) -> Vec<PathBuf> {
        let mut names = vec![PAUSE_IMAGE, nestplane_nodes::images::SHELL_IMAGE];
        if builtin_dns {
            names.push(nestplane_nodes::images::OPERATOR_IMAGE);
        }
        names.extend(self.settings.extra_images.iter().map(String::as_str));
        names
            .iter()
            .map(|n| nestplane_nodes::images::archive_path(&self.settings.images, n))
            .filter(|p| p.exists())
            .collect()
    }

    async fn start_local(&self, r: NodeRequest) -> Result<Machine, String> {
        let (ns, pool_name) = r.pool.split_once('/').unwrap_or(("", &r.pool));
        let dir = self.settings.dir.join(ns).join(pool_name).join(&r.name);
        let version = r.spec.version.clone();
        let hash = r.spec.hash();
        let node = Node::start(NodeConfig {
            name: r.name.clone(),
            dir,
            ca_pem: r.ca_pem,
            token: r.token.token(),
            apiservers: std::iter::once(r.apiserver)
                .chain(r.replicas.iter().copied().filter(|a| *a != r.apiserver))
                .collect(),
            api_port: r.apiserver.port(),
            images: self.images(r.builtin_dns),
            pause_image: PAUSE_IMAGE.into(),
            spec: r.spec,
            // Serving certificates from the cluster's CA are approved by the pool.
            cluster: r.cluster,
            // The group of the hosted cluster's control plane: its nodes reach each other,
            // and of the control planes on this machine only that one reaches them.
            group: Some(r.group),
            control_plane_user: r.control_plane_user,
            guard: Some(nestplane_nodes::guard::Setup {
                nestplane: self.settings.guard.clone(),
            }),
            // The operator connects from this machine itself.
            tunnel: None,
            entry: None,
            slot: None,
        })
        .await
        .map_err(|e| format!("node {}: {e}", r.name))?;
        let steps: Vec<_> = node
            .timeline()
            .iter()
            .map(|(w, d)| (w.to_string(), *d))
            .collect();
        tracing::info!(node = %r.name, steps = %nestplane_nodes::timeline::format(&steps), "node started");
        let machine = Machine {
            name: r.name,
            token_id: r.token.id,
            hash,
            version,
            ip: Some(node.ip()),
            token_deleted: false,
        };
        let netns = nestplane_nodes::net::open_netns(node.addresses())
            .map_err(|e| tracing::warn!(node = %machine.name, error = %e, "cannot hold the node's network namespace; its cluster's API server does not reach through it"))
            .ok();
        self.with(&r.pool, |v| {
            v.push(Held {
                machine: machine.clone(),
                node: Some(node),
                group: r.group,
                netns,
            })
        });
        Ok(machine)
    }
}

async fn remove_node(name: &str, node: Option<Node>) {
    if let Some(n) = node
        && let Err(e) = n.remove().await
    {
        tracing::warn!(node = %name, error = %e, "removing a node left something behind");
    }
}

impl NodeRuntime for LocalNodes {
    fn check(&self, version: &str, builtin_dns: bool) -> Result<(), (&'static str, String)> {
        nestplane_nodes::check_prerequisites(version)
            .map_err(|e| ("NodePrerequisitesMissing", e.to_string()))?;
        if self.images(builtin_dns).is_empty() {
            return Err((
                "ImagesMissing",
                format!(
                    "no node images under {}: run `nestplane images build`",
                    self.settings.images.display()
                ),
            ));
        }
        Ok(())
    }

    fn start(&self, request: NodeRequest) -> BoxFuture<'_, Result<Machine, String>> {
        Box::pin(self.start_local(request))
    }

    fn list(&self, pool: &str) -> Vec<Machine> {
        self.with(pool, |v| v.iter().map(|h| h.machine.clone()).collect())
    }

    fn token_deleted(&self, pool: &str, name: &str) {
        self.with(pool, |v| {
            for h in v.iter_mut().filter(|h| h.machine.name == name) {
                h.machine.token_deleted = true;
            }
        })
    }

    fn remove<'a>(&'a self, pool: &'a str, name: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let taken = self.with(pool, |v| {
                let i = v.iter().position(|h| h.machine.name == name)?;
                Some(v.remove(i))
            });
            if let Some(h) = taken {
                remove_node(&h.machine.name, h.node).await;
            }
        })
    }

    fn routes(&self, group: u32) -> Vec<Route> {
        let map = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        map.values()
            .flatten()
            .filter(|h| h.group == group)
            .filter_map(|h| {
                let a = h.node.as_ref()?.addresses();
                Some(Route {
                    node_ip: a.node_ip,
                    pod_cidr: a.pod_cidr.parse().ok()?,
                    netns: h.netns.clone()?,
                })
            })
            .collect()
    }

    /// No drain: the clusters keep their Node objects, which the next operator replaces.
    fn remove_all(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let all: PoolNodes = {
                let mut map = self.pools.lock().unwrap_or_else(|e| e.into_inner());
                map.drain().flat_map(|(_, v)| v).collect()
            };
            for h in all {
                remove_node(&h.machine.name, h.node).await;
            }
        })
    }
}
