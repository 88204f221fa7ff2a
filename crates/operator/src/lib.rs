//! nestplane's eleven controllers: `NestedControlPlane`, one per component kind (running
//! components through one [`runtime::Runtime`] seam, `process` or `kubernetes`),
//! `NestedDatastore`, `PostCreateConfig`, and the hosted wing's `HostedCluster` and
//! `NodePool` (nodes through the [`hosted::pool::machines::NodeRuntime`] seam). They are
//! wired to one watch per kind in [`controllers`].
//!
//! Each controller reads from caches, calls the pure core (`render`, `pki`, [`status`],
//! the wings' `plan` modules), applies, and writes status only when it changed.

pub mod applied;
pub mod backup;
pub mod bootstrap;
pub mod clock;
pub mod component;
pub mod context;
pub mod controllers;
pub mod crds;
pub mod datastore;
pub mod egress;
pub mod endpoint;
pub mod error;
pub mod finalizer;
pub mod gateway;
pub mod handshake;
pub mod hosted;
pub mod leader;
pub mod ncp;
pub mod pacing;
pub mod postcreate;
pub mod process;
pub mod removed;
pub mod rotation;
pub mod runtime;
pub mod secrets;
pub mod server;
pub mod shared;
pub mod status;
pub mod tenant;
pub mod workloads;
pub mod written;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use nestplane_runtime::process::ProcessRuntime;
use tokio_util::sync::CancellationToken;

pub use context::{Context, Controllers, Error, KubernetesSettings, Metrics, Mode};
pub use controllers::{CONCURRENCY, NCP_DEBOUNCE};

/// How the operator runs.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// Watch only this namespace (clusterctl's `--namespace`); all namespaces when `None`.
    pub namespace: Option<String>,
    /// Only reconcile control planes labelled `cluster.x-k8s.io/watch-filter=<value>`.
    pub watch_filter: Option<String>,
    /// Where the process runtime keeps tenant data.
    pub state_dir: PathBuf,
    /// Serve `/metrics`, `/healthz`, `/readyz` here.
    pub metrics_addr: Option<SocketAddr>,
    /// Where components run.
    pub mode: Mode,
    /// Reconcile only while holding this Lease (several replicas: one leads).
    pub leader_election: Option<leader::LeaderElection>,
    /// When certificates are due (the system clock unless a test moves it).
    pub clock: clock::Clock,
    /// Which component controllers run here (all by default).
    pub controllers: Controllers,
    /// Where NodePools make nodes on this machine (`None`: no nodes are made).
    pub nodes: Option<hosted::pool::NodeSettings>,
    /// How hosted clusters get cluster DNS.
    pub dns: hosted::dns::DnsSettings,
    /// Run the shared gateway here (process runtime): every tenant reached at this one
    /// address by its server name ([`nestplane_api::names::gateway_server_name`]).
    pub gateway: Option<SocketAddr>,
    /// The gateway's address as published (endpoints, kubeconfigs, `status.gateway`) when it
    /// is not where it listens (it listens on every address): an address of this host that
    /// clients dial; the port is the gateway's.
    pub gateway_advertise: Option<std::net::IpAddr>,
    /// Where backups are written (`<state_dir>/backups` when `None`): a backup of namespace
    /// `ns` goes under `<dir>/ns/` and nowhere else.
    pub backup_dir: Option<PathBuf>,
    /// What one namespace's archives may take in all, in bytes
    /// ([`backup::controller::NAMESPACE_QUOTA`] when `None`).
    pub backup_namespace_quota: Option<u64>,
    /// The S3 servers (`http[s]://host[:port]`) an `s3://` location may name; none by
    /// default (a namespace user names the server, and the operator sends requests to it).
    pub backup_s3_endpoints: Vec<String>,
}

impl Config {
    /// Where backups are written.
    pub fn backup_dir(&self) -> PathBuf {
        self.backup_dir
            .clone()
            .unwrap_or_else(|| self.state_dir.join("backups"))
    }
}

/// How long reconciles in flight may take to finish after a stop was asked for.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Run the controllers until `shutdown` is cancelled; then stop every tenant process.
pub async fn run(
    client: kube::Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let runtime = Arc::new(ProcessRuntime::new(&config.state_dir));
    run_with(client, config, runtime, shutdown).await
}

/// [`run`] with a given runtime.
pub async fn run_with(
    client: kube::Client,
    config: Config,
    runtime: Arc<ProcessRuntime>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if matches!(config.mode, Mode::Process) {
        // Tenant API servers run on this machine and call Service addresses (webhooks,
        // aggregated APIs): nothing for a range nestplane hands out may leave it.
        match nestplane_nodes::net::install_unreachable(nestplane_nodes::net::HANDED_OUT) {
            Ok(skipped) => {
                for s in skipped {
                    tracing::warn!("{s}");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot make nestplane's ranges unreachable"),
        }
    }
    let nodes = config.nodes.clone().map(|s| {
        Arc::new(hosted::pool::LocalNodes::new(s)) as Arc<dyn hosted::pool::machines::NodeRuntime>
    });
    let mut ctx = Context::new(client.clone(), runtime.clone(), config.mode.clone());
    ctx.nodes = nodes.clone();
    let gateway = match (&config.mode, config.gateway) {
        (Mode::Process, Some(addr)) => {
            Some(start_gateway(addr, config.gateway_advertise, &shutdown).await?)
        }
        _ => None,
    };
    if matches!(config.mode, Mode::Process) && (nodes.is_some() || gateway.is_some()) {
        let mut processes = process::Processes::new(runtime.clone());
        if let Some(nodes) = &nodes {
            // API servers reach their clusters through their nodes here, two descriptors per
            // connection.
            let limit = nestplane_runtime::egress::raise_open_files_limit();
            tracing::debug!(?limit, "open files");
            processes = processes.with_egress(Arc::new(egress::Egress::new(
                nodes.clone(),
                ctx.assigned.clone(),
            )));
        }
        if let Some(g) = gateway {
            processes = processes.with_gateway(g);
        }
        ctx.runtime = Arc::new(processes);
    }
    ctx.watch_filter = config.watch_filter.clone();
    ctx.clock = config.clock.clone();
    ctx.controllers = config.controllers.clone();
    let ctx = Arc::new(ctx);
    let hosted = Arc::new(hosted::HostedContext::new(
        ctx.clone(),
        nodes,
        config.dns.clone(),
    ));
    // Every request from here on, watches included, goes through the counting client.
    let client = ctx.client.clone();
    if let Some(addr) = config.metrics_addr {
        serve_metrics(addr, &ctx, &shutdown);
    }
    // With leader election, nothing below runs (no reconcile, no write) until this replica
    // leads, and everything stops the moment it does not.
    let Some(Leadership {
        stop,
        lost,
        release,
        keeper,
    }) = lead(&client, config.leader_election.as_ref(), &shutdown).await
    else {
        return Ok(());
    };
    let shutdown = stop;
    let mut watches = controllers::Watches::new(&client, &config, &ctx, &hosted, &shutdown);
    let running = controllers::all(&mut watches, &ctx, &hosted);
    // Every subscription is made: the watches can start.
    let watches = watches.run(&ctx);
    let controllers = async {
        tokio::join!(watches, futures::future::join_all(running));
    };
    // Reconciles in flight get a grace period to finish; a controller whose watch keeps
    // failing does not end by itself, so it is dropped after that.
    tokio::select! {
        _ = controllers => {}
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!("controllers did not stop within {SHUTDOWN_GRACE:?}; stopping them"),
    }
    runtime.shutdown().await;
    if let Some(nodes) = &hosted.nodes {
        nodes.remove_all().await;
    }
    // Processes are down: the Lease can go to the next leader.
    release.cancel();
    if let Some(k) = keeper
        && let Err(e) = k.await
    {
        tracing::warn!(error = %e, "the lease keeper ended abnormally");
    }
    if lost.is_cancelled() {
        return Err(Error::LeadershipLost);
    }
    Ok(())
}

/// Listen at `addr` and serve the shared gateway until `shutdown`; it is published at
/// `advertise` (at its port) when given.
async fn start_gateway(
    addr: SocketAddr,
    advertise: Option<std::net::IpAddr>,
    shutdown: &CancellationToken,
) -> Result<process::Gateway, Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Internal(format!("the gateway cannot listen at {addr}: {e}")))?;
    let address = listener
        .local_addr()
        .map_err(|e| Error::Internal(format!("the gateway's address: {e}")))?;
    // Each forwarded connection holds two descriptors.
    let limit = nestplane_runtime::egress::raise_open_files_limit();
    tracing::debug!(?limit, "open files");
    let routes = Arc::new(nestplane_gateway::Routes::default());
    let (serving, token) = (routes.clone(), shutdown.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = nestplane_gateway::serve(listener, serving) => {}
            _ = token.cancelled() => {}
        }
    });
    tracing::info!(%address, "gateway listening");
    Ok(process::Gateway {
        address,
        advertised: advertise.map(|ip| SocketAddr::new(ip, address.port())),
        routes,
        // A port picked at start moves at the next: nothing is published at it.
        published: addr.port() != 0,
    })
}

/// Serve `/metrics`, `/healthz` and `/readyz` at `addr` until `shutdown`.
fn serve_metrics(addr: SocketAddr, ctx: &Context, shutdown: &CancellationToken) {
    let metrics = ctx.metrics.clone();
    let health = ctx.health.clone();
    let token = shutdown.clone();
    tokio::spawn(async move {
        if let Err(e) = server::serve(addr, metrics, health, token).await {
            tracing::error!(error = %e, %addr, "metrics server failed");
        }
    });
}

/// This replica's leadership: `stop` ends the controllers (shutdown or leadership `lost`);
/// `release` gives the Lease up once processes are down.
struct Leadership {
    stop: CancellationToken,
    lost: CancellationToken,
    release: CancellationToken,
    keeper: Option<tokio::task::JoinHandle<()>>,
}

/// Lead (with `election`) or simply run; `None` when `shutdown` came first.
async fn lead(
    client: &kube::Client,
    election: Option<&leader::LeaderElection>,
    shutdown: &CancellationToken,
) -> Option<Leadership> {
    let stop = CancellationToken::new();
    let lost = CancellationToken::new();
    let release = CancellationToken::new();
    let mut keeper = None;
    if let Some(le) = election {
        if !leader::acquire(client, le, shutdown).await {
            return None;
        }
        keeper = Some(tokio::spawn(leader::keep(
            client.clone(),
            le.clone(),
            lost.clone(),
            release.clone(),
        )));
    }
    {
        let (stop, lost, shutdown) = (stop.clone(), lost.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = lost.cancelled() => {}
            }
            stop.cancel();
        });
    }
    Some(Leadership {
        stop,
        lost,
        release,
        keeper,
    })
}

/// The operator running in the background of this process (used by `nestplane up` and tests).
pub struct Operator {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), Error>>,
    runtime: Arc<ProcessRuntime>,
}

impl Operator {
    /// Start the controllers.
    pub fn start(client: kube::Client, config: Config) -> Operator {
        let token = CancellationToken::new();
        let runtime = Arc::new(ProcessRuntime::new(&config.state_dir));
        let handle = tokio::spawn(run_with(client, config, runtime.clone(), token.clone()));
        Operator {
            token,
            handle,
            runtime,
        }
    }

    /// The process runtime (start-up times, pids).
    pub fn runtime(&self) -> &Arc<ProcessRuntime> {
        &self.runtime
    }

    /// Whether the controllers have stopped by themselves (leadership lost, a fatal error).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Stop the controllers and every tenant process.
    pub async fn stop(self) -> Result<(), Error> {
        self.token.cancel();
        self.handle
            .await
            .map_err(|e| Error::Internal(e.to_string()))?
    }
}
