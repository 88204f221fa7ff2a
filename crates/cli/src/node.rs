//! `nestplane node join`: make this machine a node of a cluster, like `kubeadm join`. What a
//! `NestplaneConfig`'s bootstrap data runs, and usable by hand.
//!
//! 1. Discovery: the control plane's door for nodes ([`nestplane_nodes::entry`], `nodes.<the
//!    cluster's gateway name>` at the gateway) is asked for its certificate chain, trusting
//!    nothing; the cluster CA is the certificate in it whose public key has the hash given
//!    (`--ca-cert-hash`), and the door's own certificate must be the CA's for that name.
//! 2. A node on this machine: containerd, kubelet and kube-proxy in a network namespace of
//!    their own, the kubelet joining by TLS bootstrap with the token (`--token`, or
//!    `NESTPLANE_JOIN_TOKEN` so that it stays out of the process list); its API traffic and
//!    its tunnel agent both go out through the door: the control plane never dials this
//!    machine.
//! 3. It runs until SIGTERM or Ctrl-C, then removes the node (the Node object stays in the
//!    cluster, NotReady, as after a machine's shutdown).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use nestplane_nodes::config::{ClusterSettings, NodeSpec};
use nestplane_nodes::node::{Node, NodeConfig};

/// The environment variable the join token may come in (kept out of the process list).
pub const TOKEN_ENV: &str = "NESTPLANE_JOIN_TOKEN";

/// `nestplane node …`.
#[derive(clap::Subcommand, Debug)]
pub enum NodeCommand {
    /// Join this machine to a cluster as a node; runs in the foreground until SIGTERM.
    Join(JoinArgs),
}

/// Arguments of `nestplane node join`.
#[derive(clap::Args, Debug)]
pub struct JoinArgs {
    /// The control plane's gateway, as this machine reaches it (`HOST:PORT`).
    #[arg(long)]
    pub server: String,
    /// The cluster's name at the gateway (its control plane's `status.gateway.serverName`).
    #[arg(long)]
    pub server_name: String,
    /// A bootstrap token of the cluster (`<id>.<secret>`).
    #[arg(long, env = "NESTPLANE_JOIN_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The hash of the cluster CA's public key (`sha256:<hex>`): the CA this machine trusts.
    #[arg(long)]
    pub ca_cert_hash: String,
    /// The kubelet's and kube-proxy's version (binaries of it must be on this machine).
    #[arg(long)]
    pub kubernetes_version: String,
    /// The Node's name (default: this machine's host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Where the node keeps its files.
    #[arg(long, default_value = "/var/lib/nestplane/node")]
    pub dir: PathBuf,
    /// The container images this machine has (OCI archives, `*.oci.tar`); all are imported.
    #[arg(long, default_value = "/var/lib/nestplane/images")]
    pub images: PathBuf,
    /// The port the cluster's `kubernetes` Service sends its API clients to.
    #[arg(long, default_value_t = 6443)]
    pub api_port: u16,
    /// The cluster's DNS server (repeat for more).
    #[arg(long = "cluster-dns")]
    pub cluster_dns: Vec<String>,
    /// The cluster's domain.
    #[arg(long, default_value = "cluster.local")]
    pub cluster_domain: String,
    /// A label of the Node (`key=value`; repeat for more).
    #[arg(long = "node-label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// A taint of the Node (`key=value:Effect` or `key:Effect`; repeat for more).
    #[arg(long = "node-taint")]
    pub taints: Vec<String>,
    /// The node's address block in its cluster (`10.201.SLOT.2`, pods `10.244.SLOT.0/24`), as
    /// the cluster assigned it (a NestplaneConfig's bootstrap data names it; by hand, pick one
    /// no other node of the cluster has). The control plane lets the node announce only
    /// those addresses.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=250))]
    pub slot: Option<u8>,
    /// Pods the node runs at most (the kubelet's `maxPods`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=250))]
    pub max_pods: Option<u32>,
    /// The pod security level enforced on this machine below the tenant: `Baseline` or
    /// `Restricted` (`Privileged`, nothing enforced, must be asked for by hand).
    #[arg(long, default_value = "Baseline", value_parser = parse_level)]
    pub pod_security: nestplane_nodes::guard::Level,
}

fn parse_level(s: &str) -> Result<nestplane_nodes::guard::Level, String> {
    use nestplane_nodes::guard::Level;
    [Level::Baseline, Level::Restricted, Level::Privileged]
        .into_iter()
        .find(|l| l.name() == s)
        .ok_or_else(|| format!("{s:?} is Baseline, Restricted or Privileged"))
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not key=value"))?;
    if k.is_empty() {
        return Err(format!("{s:?} has no key"));
    }
    Ok((k.to_string(), v.to_string()))
}

/// Run `nestplane node …`.
pub async fn run(command: NodeCommand) -> anyhow::Result<()> {
    match command {
        NodeCommand::Join(a) => join(a).await,
    }
}

/// The image archives under `dir`, sorted; the pause image's must be among them.
fn archives(dir: &std::path::Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading the images in {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".oci.tar"))
        .collect();
    out.sort();
    let pause = nestplane_nodes::images::archive_path(dir, PAUSE_IMAGE);
    anyhow::ensure!(
        out.contains(&pause),
        "no pause image in {} (want {}): a node cannot run pods without it",
        dir.display(),
        pause.display()
    );
    Ok(out)
}

/// The pause image every node runs pods with.
const PAUSE_IMAGE: &str = "registry.k8s.io/pause:3.2";

async fn join(a: JoinArgs) -> anyhow::Result<()> {
    let token = nestplane_nodes::join::BootstrapToken::parse(&a.token)
        .map_err(|e| anyhow::anyhow!("--token: {e}"))?;
    nestplane_nodes::check_prerequisites(&a.kubernetes_version)?;
    let images = archives(&a.images)?;
    let server: SocketAddr = tokio::net::lookup_host(&a.server)
        .await
        .with_context(|| format!("resolving {}", a.server))?
        .find(SocketAddr::is_ipv4)
        .with_context(|| format!("{} has no IPv4 address", a.server))?;
    let door = nestplane_nodes::entry::server_name(&a.server_name);
    let ca_pem = nestplane_nodes::entry::discover(server, &door, &a.ca_cert_hash)
        .await
        .map_err(anyhow::Error::msg)
        .context("discovering the cluster")?;
    tracing::info!(%server, %door, "the cluster's CA is the one pinned");
    let name = match a.name {
        Some(n) => n,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the host name")?
            .trim()
            .to_string(),
    };
    let nestplane = std::env::current_exe().context("finding the nestplane binary")?;
    let node = Node::start(NodeConfig {
        name: name.clone(),
        dir: a.dir.clone(),
        ca_pem,
        token: token.token(),
        apiservers: vec![server],
        api_port: a.api_port,
        images,
        pause_image: PAUSE_IMAGE.into(),
        spec: NodeSpec {
            version: a.kubernetes_version.clone(),
            labels: a.labels.into_iter().collect::<BTreeMap<_, _>>(),
            taints: a.taints,
            max_pods: a.max_pods,
            pod_security: a.pod_security,
        },
        cluster: ClusterSettings {
            cluster_dns: a.cluster_dns,
            cluster_domain: a.cluster_domain,
            // Its serving certificate comes from the cluster (nestplane approves it).
            serving_certificates_from_cluster: true,
            resolver_on_host: false,
        },
        group: None,
        control_plane_user: None,
        guard: Some(nestplane_nodes::guard::Setup { nestplane }),
        // The control plane cannot dial this machine: its agent dials out, through the door.
        tunnel: Some((server, door.clone())),
        entry: Some(door),
        slot: a.slot,
    })
    .await
    .with_context(|| format!("starting node {name}"))?;
    let steps: Vec<_> = node
        .timeline()
        .iter()
        .map(|(w, d)| (w.to_string(), *d))
        .collect();
    tracing::info!(node = %name, ip = %node.ip(), steps = %nestplane_nodes::timeline::format(&steps), "node started; it registers by itself");
    println!("node {name} started; it joins as it registers (Ctrl-C or SIGTERM removes it)");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!(node = %name, "stopping: the node is removed from this machine");
    node.remove().await.context("removing the node")?;
    Ok(())
}
