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
    /// Give every node of the cluster whose isolation group is `group` the CA bundle
    /// `ca_pem` and a kubelet client certificate that `signer` (its bundle's first
    /// certificate, and that CA's key) signed, a new one for the node's name where its own is
    /// not; without replacing the node (a CA rotation). A runtime that cannot reach its
    /// nodes' files moves none (they hold the rotation's completion).
    fn retrust(&self, group: u32, ca_pem: &str, signer: &nestplane_pki::CertKey) -> Retrusted {
        let _ = (group, ca_pem, signer);
        Retrusted::default()
    }
}

/// What [`NodeRuntime::retrust`] did for a cluster's nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Retrusted {
    /// The cluster's nodes this runtime runs, which follow its CA.
    pub nodes: Vec<String>,
    /// Their bootstrap tokens' ids.
    pub tokens: Vec<String>,
    /// Nodes that could not be given it, and why.
    pub failed: Vec<(String, String)>,
    /// When each node that was given a new trust was last given one (its kubelet restarted
    /// then).
    pub restarted: Vec<(String, std::time::SystemTime)>,
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
    /// When it was last given a new trust ([`NodeRuntime::retrust`]): its kubelet restarted
    /// then.
    retrusted: Option<std::time::SystemTime>,
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
                retrusted: None,
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

    fn retrust(&self, group: u32, ca_pem: &str, signer: &nestplane_pki::CertKey) -> Retrusted {
        let mut out = Retrusted::default();
        let bundle = nestplane_pki::certificate_ids(ca_pem).unwrap_or_default();
        let mut map = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        for held in map.values_mut().flatten().filter(|h| h.group == group) {
            let name = held.machine.name.clone();
            out.nodes.push(name.clone());
            out.tokens.push(held.machine.token_id.clone());
            let Some(node) = &held.node else { continue };
            let now = node.trust();
            // A rotation moves a node from a CA it trusts: a bundle that shares none with it
            // is another cluster's (isolation groups are a hash), and nothing is written.
            let shares = nestplane_pki::certificate_ids(now.ca.as_deref().unwrap_or_default())
                .unwrap_or_default()
                .iter()
                .any(|id| bundle.contains(id));
            if !shares {
                out.failed.push((
                    name,
                    "the CA it trusts is not in the cluster's CA bundle".into(),
                ));
                continue;
            }
            let signed = |pem: &Option<String>| {
                pem.as_deref().is_some_and(|c| {
                    nestplane_pki::verify_signed_by(c, &signer.cert_pem).unwrap_or(false)
                })
            };
            let issue = |usage, ips: Vec<std::net::IpAddr>| {
                let spec = nestplane_pki::LeafSpec {
                    common_name: format!("system:node:{name}"),
                    organizations: vec!["system:nodes".into()],
                    dns_names: match usage {
                        nestplane_pki::Usage::Client => vec![],
                        _ => vec![name.clone()],
                    },
                    ips,
                    usage,
                };
                nestplane_pki::issue(signer, &spec, time::OffsetDateTime::now_utc())
                    .map(|ck| format!("{}{}", ck.cert_pem, ck.key_pem))
            };
            let client = match signed(&now.client) {
                true => Ok(None),
                false => issue(nestplane_pki::Usage::Client, vec![]).map(Some),
            };
            // Only a serving certificate the cluster issued (`serverTLSBootstrap`) is
            // replaced; one the kubelet made for itself is no CA's.
            let serving = match now.serving.is_some() && !signed(&now.serving) {
                false => Ok(None),
                true => issue(nestplane_pki::Usage::Server, vec![node.ip().into()]).map(Some),
            };
            let (client, serving) = match (client, serving) {
                (Ok(c), Ok(s)) => (c, s),
                (Err(e), _) | (_, Err(e)) => {
                    out.failed.push((name, e.to_string()));
                    continue;
                }
            };
            match node.retrust(ca_pem, client.as_deref(), serving.as_deref()) {
                Ok(true) => {
                    held.retrusted = Some(std::time::SystemTime::now());
                    tracing::info!(node = %name, "gave the node its cluster's CA as it is now");
                }
                Ok(false) => {}
                Err(e) => out.failed.push((name.clone(), e.to_string())),
            }
            if let Some(at) = held.retrusted {
                out.restarted.push((name, at));
            }
        }
        out
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
