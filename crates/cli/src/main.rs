//! `nestplane`: the operator, and the commands around it.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

mod backup;
mod images;
mod node;
mod rotate;
mod tenants;
mod up;

/// nestplane runs many isolated Kubernetes control planes on shared infrastructure.
#[derive(Parser, Debug)]
#[command(name = "nestplane", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print every CRD as one multi-document YAML (`nestplane crds | kubectl apply -f -`).
    Crds {
        /// Only one provider's: `control-plane` (what `control-plane-components.yaml`
        /// installs) or `bootstrap` (`bootstrap-components.yaml`).
        #[arg(long, value_parser = ["control-plane", "bootstrap"])]
        provider: Option<String>,
    },
    /// Start a local management plane, the operator and a tenant control plane; print the
    /// tenant's kubeconfig; stay in the foreground until Ctrl-C or SIGTERM.
    Up(up::UpArgs),
    /// Delete the tenant control plane `nestplane up` created (its processes, data and
    /// secrets).
    Down(up::DownArgs),
    /// Run the controllers against the cluster of the current kubeconfig.
    Operator(Box<OperatorArgs>),
    /// Serve cluster DNS (`<service>.<namespace>.svc.<zone>`, …) from watch caches of the
    /// cluster this runs in; what the `kube-dns` Deployment nestplane installs runs.
    Dns {
        /// The cluster domain.
        #[arg(long, default_value = "cluster.local")]
        zone: String,
        /// Address for DNS over UDP and TCP.
        #[arg(long, default_value = "0.0.0.0:5353")]
        listen: std::net::SocketAddr,
        /// Address of `/healthz`, `/readyz` and `/metrics` (loopback by default; the
        /// `kube-dns` Deployment gives its pod's address).
        #[arg(long, default_value = "127.0.0.1:8081")]
        health: std::net::SocketAddr,
        /// Resolvers for names outside the zone (repeat for more; `none` for no forwarding);
        /// by default the name servers of /etc/resolv.conf (a pod with `dnsPolicy: Default`
        /// gets its node's).
        #[arg(long = "upstream")]
        upstreams: Vec<String>,
    },
    /// Container images built on this machine (nothing is pulled).
    Images {
        #[command(subcommand)]
        command: images::ImagesCommand,
    },
    /// The egress proxy beside an API server of the `kubernetes` runtime: the API server's
    /// `cluster` traffic (HTTP CONNECT on `--socket`) is carried by the agents its cluster's
    /// nodes connect to `--listen` with their kubelets' client certificates.
    EgressProxy(EgressProxyArgs),
    /// The shared gateway of the `kubernetes` runtime (a Deployment): every tenant's API
    /// server at one address, chosen by the TLS server name `<cluster>.<namespace>.nestplane.internal`
    /// without terminating TLS, routed to the tenant's Ready API server pods.
    Gateway {
        /// Where to listen.
        #[arg(long, default_value = "0.0.0.0:7443")]
        bind_address: std::net::SocketAddr,
        /// Route only the tenants of this namespace (all namespaces when unset).
        #[arg(long)]
        namespace: Option<String>,
        /// Connections one client address may hold open at once; beyond it a client is reset
        /// (raise it where clients reach the gateway through a NAT that gives many one
        /// address, such as a load balancer that does not keep their source).
        #[arg(long, default_value_t = nestplane_operator::gateway::MAX_PER_CLIENT)]
        max_connections_per_client: usize,
    },
    /// Create a hosted cluster (a HostedCluster with `--nodes` real nodes) in the management
    /// plane of a running `nestplane up` (or `--kubeconfig`'s), and wait until it is ready.
    Create(tenants::CreateArgs),
    /// List the hosted clusters and control planes: name, kind, version, ready, nodes, age,
    /// endpoint (`-o json|yaml` too).
    List(tenants::ListArgs),
    /// Delete a hosted cluster (or a NestedControlPlane) and wait until it is gone.
    Delete(tenants::DeleteArgs),
    /// Print the admin kubeconfig of a hosted cluster or a tenant control plane.
    Kubeconfig(tenants::KubeconfigArgs),
    /// Rotate a hosted cluster's (or control plane's) service-account key, cluster CA or
    /// front-proxy CA without an outage: the new one is trusted everywhere, then signs (phase
    /// Started); `--complete` drops the old one. Waits for each.
    Rotate(rotate::RotateArgs),
    /// Back up a hosted cluster's (or a control plane's) keys (`backup create`, which waits
    /// and prints the archive's URL last), list backups (`backup list`), and restore one
    /// (`backup restore NAME --from URL [--as NEW]`, which waits).
    Backup(backup::BackupArgs),
    /// This machine as a node of a cluster: `node join --server … --server-name …
    /// --token … --ca-cert-hash sha256:… --kubernetes-version …` (what a NestplaneConfig's
    /// bootstrap data runs; like `kubeadm join`).
    Node {
        #[command(subcommand)]
        command: node::NodeCommand,
    },
}

/// Arguments of `nestplane egress-proxy`.
#[derive(clap::Args, Debug)]
struct EgressProxyArgs {
    /// The Unix socket the API server's egress selector names (made 0600).
    #[arg(long)]
    socket: PathBuf,
    /// Where nodes' agents connect.
    #[arg(long, default_value = "0.0.0.0:8132")]
    listen: std::net::SocketAddr,
    /// The serving certificate (PEM): the API server's.
    #[arg(long)]
    cert: PathBuf,
    /// Its key.
    #[arg(long)]
    key: PathBuf,
    /// The CA of the agents' client certificates: the cluster CA.
    #[arg(long)]
    client_ca: PathBuf,
    /// The cluster's Service ranges (comma-separated), reached through any node.
    #[arg(long, default_value = "")]
    service_cidr: String,
    /// The API server's replicas (agents keep connections at each).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// This replica's id, told to agents (default: the host name, a pod's name).
    #[arg(long)]
    id: Option<String>,
}

/// Arguments of `nestplane operator`.
#[derive(clap::Args, Debug)]
struct OperatorArgs {
    /// Where tenant components run. `process`: supervised local processes on this machine;
    /// `kubernetes`: StatefulSet/Deployments and Services in the management cluster.
    #[arg(long, default_value = "process", value_parser = ["process", "kubernetes"])]
    runtime: String,
    /// Registry of the component images (`kubernetes` runtime).
    #[arg(long, default_value = nestplane_render::DEFAULT_IMAGE_REGISTRY)]
    image_registry: String,
    /// Cluster DNS of HostedClusters whose spec names none: `Builtin` or `CoreDNS` (default:
    /// `Builtin` when NodePools make nodes on this machine, from images built here, which
    /// cannot pull; `CoreDNS` otherwise). CoreDNS images come from `--image-registry`.
    #[arg(long, value_parser = ["Builtin", "CoreDNS"])]
    default_dns_provider: Option<String>,
    /// Size of each etcd member's volume (`kubernetes` runtime).
    #[arg(long, default_value = nestplane_render::workload::DEFAULT_ETCD_STORAGE)]
    etcd_storage: String,
    /// Image of the egress proxy beside each API server (`kubernetes` runtime): the
    /// operator's own; set it where kustomize sets the operator's.
    #[arg(long, default_value = nestplane_operator::workloads::DEFAULT_EGRESS_IMAGE)]
    egress_image: String,
    /// Watch only this namespace (all namespaces when unset).
    #[arg(long)]
    namespace: Option<String>,
    /// Only reconcile control planes labelled `cluster.x-k8s.io/watch-filter=<value>`.
    #[arg(long)]
    watch_filter: Option<String>,
    /// Where the process runtime keeps tenant data.
    #[arg(long, env = "NESTPLANE_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, default_value = "127.0.0.1:8080")]
    metrics_bind_address: std::net::SocketAddr,
    /// Reconcile only while holding a Lease, so that one of several replicas acts. Default:
    /// on inside a cluster (`KUBERNETES_SERVICE_HOST` set), off elsewhere.
    #[arg(long)]
    leader_elect: Option<bool>,
    /// Namespace of the leader election Lease (default: `$POD_NAMESPACE`, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Name of the leader election Lease.
    #[arg(long, default_value = "nestplane-leader")]
    leader_election_id: String,
    /// Controllers to run, as kube-controller-manager lists them: `*` for all, `-etcd` to
    /// leave etcd to an out-of-tree controller (names: etcd, apiserver, controller-manager,
    /// scheduler, or a kind: NestedControlPlane, NestedDatastore, PostCreateConfig,
    /// HostedCluster, NodePool, NestedBackup). nestplane then only reads that kind's objects.
    #[arg(long, default_value = "*", value_parser = nestplane_operator::Controllers::parse)]
    controllers: nestplane_operator::Controllers,
    /// An image every node of a NodePool imports besides nestplane's own (the pause, shell
    /// and DNS images), by name, from `nestplane images build`'s archives; repeatable.
    #[arg(long = "node-image")]
    node_images: Vec<String>,
    /// Run the shared gateway at this address (`process` runtime): every tenant reached there
    /// by its server name, `<cluster>.<namespace>.nestplane.internal` (each control plane's
    /// `status.gateway` says how: `server` with `tls-server-name`).
    #[arg(long)]
    gateway_bind_address: Option<std::net::SocketAddr>,
    /// The gateway's address as published (`process` runtime): tenants' endpoints, their
    /// kubeconfigs, `status.gateway`. For a gateway that listens on every address
    /// (`0.0.0.0:7443`): an address of this host that users and machines dial (without it,
    /// the loopback address is published). The port is the gateway's.
    #[arg(long, requires = "gateway_bind_address")]
    gateway_advertise_address: Option<std::net::IpAddr>,
    /// The Service of the shared gateway (`kubernetes` runtime), `NAMESPACE/NAME`: the
    /// Deployment `nestplane gateway` runs behind it. Every tenant is then reached there by
    /// its server name (`status.gateway`), and it is the endpoint of each whose API server
    /// Service is a ClusterIP one (its load balancer's address, else its cluster address).
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_namespaced)]
    gateway_service: Option<String>,
    /// Where the Gateway API's CRDs are installed (`kubernetes` runtime), each tenant gets a
    /// `TLSRoute` `<cluster>-apiserver` (its server name to its API server Service); this
    /// Gateway, `NAMESPACE/NAME`, is its parent (none: add your own `parentRefs`).
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_namespaced)]
    tls_route_parent: Option<String>,
    /// Where `NestedBackup`s are written (default: `backups` in the state directory). A
    /// backup of namespace NS goes under `<dir>/NS/` and nowhere else; a location outside it
    /// is refused.
    #[arg(long)]
    backup_dir: Option<PathBuf>,
    /// What one namespace's archives may take in all: bytes, or with Ki, Mi, Gi or Ti
    /// (default 10Gi). A backup that would go past it waits (`QuotaExceeded`).
    #[arg(long, value_parser = parse_bytes)]
    backup_namespace_quota: Option<u64>,
    /// An S3 server (`http[s]://host[:port]`) that an `s3://` backup location may name;
    /// repeat for several. None by default: a namespace user names the server, and the
    /// operator sends requests to it.
    #[arg(long = "backup-s3-endpoint", value_name = "URL")]
    backup_s3_endpoints: Vec<String>,
}

/// `namespace/name`.
fn parse_namespaced(s: &str) -> Result<String, String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok(s.to_string())
        }
        _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
    }
}

/// `1048576`, `512Mi`, `10Gi`: a size in bytes.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let (digits, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size (bytes, or with Ki, Mi, Gi, Ti)"))?;
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        "Ti" => 40,
        _ => return Err(format!("{s:?}: the unit is one of Ki, Mi, Gi, Ti")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn main() -> anyhow::Result<()> {
    // The node guard runs for every container a node creates, in place of runc: no
    // argument parsing, no logging set-up, nothing but the judgement and an exec.
    let mut args = std::env::args();
    if args.nth(1).as_deref() == Some("runc-guard") {
        std::process::exit(nestplane_nodes::guard::main(args.collect()));
    }
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NESTPLANE_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("warn,kube_client::client::builder=off")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Crds { provider } => {
            let crds = match provider.as_deref() {
                Some("control-plane") => nestplane_api::crds::control_plane(),
                Some(_) => nestplane_api::crds::bootstrap(),
                None => nestplane_api::crds::all(),
            };
            print!(
                "{}",
                nestplane_operator::crds::yaml(&crds).context("serializing CRDs")?
            );
            Ok(())
        }
        Command::Up(args) => runtime()?.block_on(up::run(args)),
        Command::Down(args) => runtime()?.block_on(up::down(args)),
        Command::Operator(args) => runtime()?.block_on(operator(*args)),
        Command::Images { command } => images::run(command),
        Command::Dns {
            zone,
            listen,
            health,
            upstreams,
        } => runtime()?.block_on(async move {
            let upstreams = dns_upstreams(&upstreams, listen)?;
            let client = kube::Client::try_default()
                .await
                .context("connecting to the cluster")?;
            nestplane_dns::server::serve(client, &zone, listen, health, upstreams).await?;
            Ok(())
        }),
        Command::EgressProxy(a) => {
            let read = |p: &PathBuf| {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
            };
            let tls = nestplane_nodes::tunnel::server_tls(
                &read(&a.cert)?,
                &read(&a.key)?,
                &read(&a.client_ca)?,
            )
            .map_err(anyhow::Error::msg)?;
            let services = nestplane_nodes::egress::service_ranges(&a.service_cidr);
            let id = match a.id {
                Some(id) => id,
                None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .context("reading the host name")?
                    .trim()
                    .to_string(),
            };
            anyhow::ensure!(
                !id.is_empty() && !id.contains(char::is_whitespace),
                "a replica's id is one word: {id:?}"
            );
            let replica = nestplane_nodes::tunnel::Replica {
                id,
                count: a.replicas.max(1),
            };
            runtime()?.block_on(async move {
                nestplane_nodes::tunnel::run_proxy(&a.socket, a.listen, tls, services, replica)
                    .await
                    .with_context(|| format!("serving {} and {}", a.socket.display(), a.listen))
            })
        }
        Command::Gateway {
            bind_address,
            namespace,
            max_connections_per_client,
        } => runtime()?.block_on(async move {
            let client = kube::Client::try_default()
                .await
                .context("connecting to the cluster")?;
            let api: kube::Api<k8s_openapi::api::core::v1::Pod> = match &namespace {
                Some(ns) => kube::Api::namespaced(client, ns),
                None => kube::Api::all(client),
            };
            let stop = tokio_util::sync::CancellationToken::new();
            let on_term = stop.clone();
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                on_term.cancel();
            });
            nestplane_operator::gateway::run(bind_address, max_connections_per_client, api, stop)
                .await
                .with_context(|| format!("listening at {bind_address}"))?;
            Ok(())
        }),
        Command::Create(a) => runtime()?.block_on(tenants::create(a)),
        Command::List(a) => runtime()?.block_on(tenants::list(a)),
        Command::Delete(a) => runtime()?.block_on(tenants::delete(a)),
        Command::Rotate(a) => runtime()?.block_on(rotate::rotate(a)),
        Command::Backup(a) => runtime()?.block_on(backup::run(a)),
        Command::Node { command } => {
            // The token is read (clap took it from the environment): no process the node
            // starts (containerd, kubelet, kube-proxy, pods' shims) inherits it.
            // SAFETY: no other thread exists yet (the runtime starts below), so nothing reads
            // the environment while it changes.
            #[allow(unsafe_code)]
            unsafe {
                std::env::remove_var(node::TOKEN_ENV)
            };
            runtime()?.block_on(node::run(command))
        }
        Command::Kubeconfig(a) => runtime()?.block_on(async move {
            print!("{}", tenants::kubeconfig(a).await?);
            Ok(())
        }),
    }
}

async fn operator(args: OperatorArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the management cluster")?;
    let state_dir = args
        .state_dir
        .unwrap_or_else(|| default_state_dir().join("operator"));
    let backup_dir = match args.backup_dir {
        Some(d) if d.is_relative() => Some(std::env::current_dir()?.join(d)),
        d => d,
    };
    let token = tokio_util::sync::CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        up::wait_for_signal().await;
        t.cancel();
    });
    let dns = nestplane_operator::hosted::dns::DnsSettings {
        default_provider: args.default_dns_provider.as_deref().map(|p| match p {
            "CoreDNS" => nestplane_api::hosted::DnsProvider::CoreDns,
            _ => nestplane_api::hosted::DnsProvider::Builtin,
        }),
        registry: args.image_registry.clone(),
    };
    let mode = match args.runtime.as_str() {
        "kubernetes" => {
            nestplane_operator::Mode::Kubernetes(nestplane_operator::KubernetesSettings {
                image_registry: args.image_registry,
                etcd_storage: args.etcd_storage,
                egress_image: args.egress_image,
                gateway_service: args.gateway_service,
                tls_route_parent: args.tls_route_parent,
            })
        }
        _ => nestplane_operator::Mode::Process,
    };
    // NodePools make nodes on this machine only when the operator runs on it (process
    // runtime); an operator in a pod makes none.
    let guard = std::env::current_exe().context("finding the nestplane binary (the node guard)")?;
    let nodes = matches!(mode, nestplane_operator::Mode::Process).then(|| {
        nestplane_operator::hosted::pool::NodeSettings {
            dir: state_dir.join("nodes"),
            images: nestplane_nodes::images::default_dir(),
            guard,
            extra_images: args.node_images.clone(),
        }
    });
    for e in &args.backup_s3_endpoints {
        nestplane_operator::backup::s3::Endpoint::parse(e)
            .map_err(|why| anyhow::anyhow!("--backup-s3-endpoint: {why}"))?;
    }
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let leader_election = args.leader_elect.unwrap_or(in_cluster).then(|| {
        let identity = std::env::var("POD_NAME").unwrap_or_else(|_| {
            format!(
                "{}-{}",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .unwrap_or_default()
                    .trim(),
                std::process::id()
            )
        });
        nestplane_operator::leader::LeaderElection::new(
            args.leader_election_namespace
                .as_deref()
                .unwrap_or("default"),
            &args.leader_election_id,
            &identity,
        )
    });
    nestplane_operator::run(
        client,
        nestplane_operator::Config {
            namespace: args.namespace,
            watch_filter: args.watch_filter,
            state_dir,
            metrics_addr: Some(args.metrics_bind_address),
            mode,
            leader_election,
            clock: Default::default(),
            controllers: args.controllers,
            nodes,
            dns,
            gateway: args.gateway_bind_address,
            gateway_advertise: args.gateway_advertise_address,
            backup_dir,
            backup_namespace_quota: args.backup_namespace_quota,
            backup_s3_endpoints: args.backup_s3_endpoints.clone(),
        },
        token,
    )
    .await?;
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting tokio")
}

/// The default state directory: `$NESTPLANE_STATE_DIR`, else `~/.local/state/nestplane`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NESTPLANE_STATE_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".local").join("state").join("nestplane")
}

/// The resolvers `nestplane dns` forwards to: those given (`IP` or `IP:PORT`; `none` for
/// none), else the name servers of /etc/resolv.conf.
fn dns_upstreams(
    given: &[String],
    listen: std::net::SocketAddr,
) -> anyhow::Result<Vec<std::net::SocketAddr>> {
    if given.is_empty() {
        let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
        return Ok(nestplane_dns::server::upstreams_from_resolv_conf(
            &text, listen,
        ));
    }
    let mut out = Vec::new();
    for g in given.iter().filter(|g| g.as_str() != "none") {
        let a = g
            .parse::<std::net::SocketAddr>()
            .or_else(|_| g.parse::<std::net::IpAddr>().map(|ip| (ip, 53).into()))
            .with_context(|| format!("--upstream {g:?} is neither an address nor address:port"))?;
        out.push(a);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn a_size_is_bytes_or_a_binary_unit_and_never_overflows() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("10Gi"), Ok(10 << 30));
        for bad in ["", "Gi", "10G", "10 Gi", "-1", "1.5Gi", "99999999999Ti"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
