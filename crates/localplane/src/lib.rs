//! A real Kubernetes management plane on this machine: etcd, kube-apiserver and (on request)
//! kube-controller-manager as child processes on free loopback ports.
//!
//! Certificates come from nestplane's own `pki` crate; RBAC authorization is on; the admin
//! client certificate is in `system:masters`. Stopping or dropping a [`LocalPlane`] — or the
//! death of the process that started it — ends every child process.
//!
//! Used by the tests, the benchmarks and `nestplane up`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};
use nestplane_pki::{self as pki, CertKey, LeafSpec, Usage};
use nestplane_runtime::binaries;
use nestplane_runtime::child::{self, Child, Spec};

pub mod scratch;
pub mod seed;

/// The Kubernetes version of the management plane's binaries (the ones the install script
/// builds).
pub const DEFAULT_VERSION: &str = "v1.20.2";

/// The registry the locally built images are named under.
pub const DEFAULT_IMAGE_REGISTRY: &str = "registry.k8s.io";

/// Errors starting a management plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A binary is missing.
    #[error(transparent)]
    MissingBinary(#[from] binaries::MissingBinary),
    /// A process exited or never became ready.
    #[error("{process} failed to start: {reason}\n--- last lines of {log} ---\n{tail}")]
    ProcessFailed {
        /// Which process.
        process: String,
        /// What went wrong.
        reason: String,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
    /// Filesystem trouble.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The IO error.
        source: std::io::Error,
    },
    /// Certificates could not be made.
    #[error("certificates: {0}")]
    Pki(#[from] pki::PkiError),
    /// The kubeconfig could not be turned into a client.
    #[error("client: {0}")]
    Client(String),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// How to start a management plane.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Directory for certificates, data and logs. `None`: a temporary directory removed on
    /// stop. With a directory, data and certificates survive restarts (same CA, same objects).
    pub dir: Option<PathBuf>,
    /// Also run kube-controller-manager (garbage collection, service-account tokens).
    pub controller_manager: bool,
    /// Controllers of kube-controller-manager to leave off (`deployment`, `statefulset`, …).
    pub disabled_controllers: Vec<String>,
    /// Real nodes (containerd + kubelet + kube-proxy) joined to the plane; needs
    /// `controller_manager`.
    pub nodes: Option<NodeOptions>,
    /// CustomResourceDefinitions the API server serves from its first start: stored in etcd
    /// before it starts (those not stored yet), so that it builds its OpenAPI document once
    /// rather than once per CRD (see `seed`, and what it does not do). For planes as short-lived
    /// as a test.
    pub crds: Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>,
}

/// The management plane's nodes.
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// How many nodes (`node-0`, `node-1`, …).
    pub count: usize,
    /// OCI archives imported into every node (`nestplane images build`).
    pub images: Vec<PathBuf>,
    /// Run cluster DNS (`nestplane dns`, as `kube-dns`) from this image.
    pub dns_image: Option<String>,
}

/// The plane's cluster domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

pub mod volumes;
pub use volumes::STORAGE_CLASS;

/// A running management plane.
pub struct LocalPlane {
    nodes: Vec<nestplane_nodes::node::Node>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    plane_slot: Option<nestplane_nodes::net::Slot>,
    service_cidr: String,
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
    children: Vec<Child>,
    kubeconfig_path: PathBuf,
    kubeconfig: String,
    server: String,
    ca_pem: String,
    client: kube::Client,
    startup: Duration,
}

impl std::fmt::Debug for LocalPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPlane")
            .field("dir", &self.dir)
            .field("server", &self.server)
            .finish()
    }
}

fn free_port() -> Result<u16, Error> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io_err("finding a free port"))?;
    Ok(l.local_addr()
        .map_err(io_err("finding a free port"))?
        .port())
}

/// Write a file readable by its owner only (keys, kubeconfigs).
pub fn write_private(path: &Path, contents: &str) -> Result<(), Error> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    }
    nestplane_runtime::files::write_private(path, contents.as_bytes())
        .map_err(io_err(format!("writing {}", path.display())))
}

fn load_or(path: &Path, make: impl FnOnce() -> Result<CertKey, Error>) -> Result<CertKey, Error> {
    let crt = path.with_extension("crt");
    let key = path.with_extension("key");
    if let (Ok(cert_pem), Ok(key_pem)) =
        (std::fs::read_to_string(&crt), std::fs::read_to_string(&key))
    {
        return Ok(CertKey { cert_pem, key_pem });
    }
    let ck = make()?;
    write_private(&crt, &ck.cert_pem)?;
    write_private(&key, &ck.key_pem)?;
    Ok(ck)
}

/// What the plane keeps of its PKI in memory (everything is also under `<dir>/pki`).
struct Pki {
    ca: CertKey,
    admin: CertKey,
}

fn ensure_pki(dir: &Path, extra_ips: &[std::net::IpAddr]) -> Result<Pki, Error> {
    let now = time::OffsetDateTime::now_utc();
    let pki_dir = dir.join("pki");
    // The CA and the service-account key are kept across restarts; leaves are reissued every
    // start (cheap, and picks up any new address).
    let ca = load_or(&pki_dir.join("ca"), || {
        Ok(pki::generate_ca("nestplane-management-ca", now)?)
    })?;
    // Only its files are used (the API server's and controller-manager's flags).
    load_or(&pki_dir.join("sa"), || {
        Ok(pki::generate_service_account_key()?)
    })?;
    let serving = pki::issue(
        &ca,
        &LeafSpec {
            common_name: "kube-apiserver".into(),
            dns_names: vec![
                "localhost".into(),
                "kubernetes".into(),
                "kubernetes.default".into(),
                "kubernetes.default.svc".into(),
            ],
            ips: std::iter::once(std::net::IpAddr::from([127, 0, 0, 1]))
                .chain(extra_ips.iter().copied())
                .collect(),
            usage: Usage::Server,
            ..LeafSpec::default()
        },
        now,
    )?;
    let admin = pki::issue(
        &ca,
        &LeafSpec {
            common_name: "nestplane-admin".into(),
            organizations: vec!["system:masters".into()],
            usage: Usage::Client,
            ..LeafSpec::default()
        },
        now,
    )?;
    // etcd has a CA of its own: a client certificate the management CA signs (an admin's, a
    // node's from an approved request) must not open the datastore underneath RBAC.
    let etcd_ca = load_or(&pki_dir.join("etcd-ca"), || {
        Ok(pki::generate_ca("nestplane-management-etcd-ca", now)?)
    })?;
    let etcd_server = pki::issue(
        &etcd_ca,
        &LeafSpec {
            common_name: "etcd".into(),
            dns_names: vec!["localhost".into()],
            ips: vec![std::net::IpAddr::from([127, 0, 0, 1])],
            usage: Usage::ServerAndClient,
            ..LeafSpec::default()
        },
        now,
    )?;
    let etcd_client = pki::issue(
        &etcd_ca,
        &LeafSpec {
            common_name: "kube-apiserver-etcd-client".into(),
            usage: Usage::Client,
            ..LeafSpec::default()
        },
        now,
    )?;
    for (name, ck) in [
        ("apiserver", &serving),
        ("admin", &admin),
        ("etcd-server", &etcd_server),
        ("apiserver-etcd-client", &etcd_client),
    ] {
        write_private(&pki_dir.join(format!("{name}.crt")), &ck.cert_pem)?;
        write_private(&pki_dir.join(format!("{name}.key")), &ck.key_pem)?;
    }
    Ok(Pki { ca, admin })
}

/// The plane's directory: `dir`, or a temporary one removed with the plane.
fn work_dir(dir: Option<&PathBuf>) -> Result<(PathBuf, Option<tempfile::TempDir>), Error> {
    let (dir, temp) = match dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("nestplane-localplane-")
                .tempdir()
                .map_err(io_err("creating a temporary directory"))?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    Ok((dir, temp))
}

/// A file of the plane's PKI.
fn pki_path(dir: &Path, name: &str) -> String {
    dir.join("pki").join(name).display().to_string()
}

/// etcd: TLS on loopback, clients and peers with certificates of its own CA only. Pure.
fn etcd_spec(program: PathBuf, dir: &Path, client: u16, peer: u16) -> Spec {
    let p = |name: &str| pki_path(dir, name);
    let url = format!("https://127.0.0.1:{client}");
    Spec {
        name: "etcd".into(),
        program,
        args: vec![
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls={url}"),
            format!("--advertise-client-urls={url}"),
            format!("--listen-peer-urls=https://127.0.0.1:{peer}"),
            format!("--initial-advertise-peer-urls=https://127.0.0.1:{peer}"),
            format!("--initial-cluster=default=https://127.0.0.1:{peer}"),
            format!("--cert-file={}", p("etcd-server.crt")),
            format!("--key-file={}", p("etcd-server.key")),
            format!("--trusted-ca-file={}", p("etcd-ca.crt")),
            "--client-cert-auth=true".into(),
            format!("--peer-cert-file={}", p("etcd-server.crt")),
            format!("--peer-key-file={}", p("etcd-server.key")),
            format!("--peer-trusted-ca-file={}", p("etcd-ca.crt")),
            "--peer-client-cert-auth=true".into(),
            "--name=default".into(),
            "--quota-backend-bytes=4294967296".into(),
            "--unsafe-no-fsync=true".into(),
            "--log-level=warn".into(),
        ],
        log: dir.join("logs").join("etcd.log"),
        ..Spec::default()
    }
}

/// kube-apiserver on loopback `port`. With nodes, pods reach it through their node's proxy
/// at the node-local address; kubelets join by bootstrap token and are authorized as nodes;
/// it reaches kubelets (logs, exec) with the admin certificate. Pure.
fn apiserver_spec(
    program: PathBuf,
    dir: &Path,
    port: u16,
    etcd_url: &str,
    service_cidr: &str,
    nodes: bool,
) -> Spec {
    let p = |name: &str| pki_path(dir, name);
    let mut args = vec![
        "--allow-privileged=true".into(),
        "--bind-address=127.0.0.1".into(),
        format!("--cert-dir={}", dir.join("pki").display()),
        format!("--client-ca-file={}", p("ca.crt")),
        format!("--etcd-servers={etcd_url}"),
        format!("--etcd-cafile={}", p("etcd-ca.crt")),
        format!("--etcd-certfile={}", p("apiserver-etcd-client.crt")),
        format!("--etcd-keyfile={}", p("apiserver-etcd-client.key")),
        "--insecure-port=0".into(),
        format!("--secure-port={port}"),
        "--service-account-issuer=https://kubernetes.default.svc".into(),
        format!("--service-account-key-file={}", p("sa.crt")),
        format!("--service-account-signing-key-file={}", p("sa.key")),
        format!("--service-cluster-ip-range={service_cidr}"),
        format!("--tls-cert-file={}", p("apiserver.crt")),
        format!("--tls-private-key-file={}", p("apiserver.key")),
        "--v=1".into(),
    ];
    if nodes {
        args.extend([
            format!(
                "--advertise-address={}",
                nestplane_nodes::config::NODE_LOCAL_APISERVER
            ),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--enable-bootstrap-token-auth=true".into(),
            format!("--kubelet-client-certificate={}", p("admin.crt")),
            format!("--kubelet-client-key={}", p("admin.key")),
            "--kubelet-preferred-address-types=InternalIP".into(),
        ]);
    } else {
        args.extend([
            "--advertise-address=127.0.0.1".into(),
            "--authorization-mode=RBAC".into(),
            "--endpoint-reconciler-type=none".into(),
        ]);
    }
    args.sort();
    Spec {
        name: "kube-apiserver".into(),
        program,
        args,
        log: dir.join("logs").join("kube-apiserver.log"),
        ..Spec::default()
    }
}

/// kube-controller-manager on loopback `port`, with the admin kubeconfig; with nodes, it
/// signs kubelet certificates and runs the bootstrap-token controllers. Pure.
fn controller_manager_spec(
    program: PathBuf,
    dir: &Path,
    port: u16,
    service_cidr: &str,
    nodes: bool,
    disabled: &[String],
) -> Spec {
    let p = |name: &str| pki_path(dir, name);
    let mut controllers = vec!["*".to_string()];
    let mut args = Vec::new();
    if nodes {
        controllers.extend(["bootstrapsigner".into(), "tokencleaner".into()]);
        args.extend([
            format!("--cluster-signing-cert-file={}", p("ca.crt")),
            format!("--cluster-signing-key-file={}", p("ca.key")),
            format!("--service-cluster-ip-range={service_cidr}"),
        ]);
    }
    controllers.extend(disabled.iter().map(|c| format!("-{c}")));
    args.extend([
        "--bind-address=127.0.0.1".into(),
        format!("--cert-dir={}", dir.join("pki").join("kcm").display()),
        format!("--controllers={}", controllers.join(",")),
        format!("--kubeconfig={}", dir.join("admin.kubeconfig").display()),
        "--leader-elect=false".into(),
        "--port=0".into(),
        format!("--root-ca-file={}", p("ca.crt")),
        format!("--secure-port={port}"),
        format!("--service-account-private-key-file={}", p("sa.key")),
        "--use-service-account-credentials=true".into(),
        "--concurrent-gc-syncs=5".into(),
        "--v=1".into(),
    ]);
    Spec {
        name: "kube-controller-manager".into(),
        program,
        args,
        log: dir.join("logs").join("kube-controller-manager.log"),
        ..Spec::default()
    }
}

/// kube-scheduler on loopback `port`, with the admin kubeconfig. Pure.
fn scheduler_spec(program: PathBuf, dir: &Path, port: u16) -> Spec {
    let kubeconfig = dir.join("admin.kubeconfig").display().to_string();
    Spec {
        name: "kube-scheduler".into(),
        program,
        args: vec![
            "--bind-address=127.0.0.1".into(),
            format!("--kubeconfig={kubeconfig}"),
            format!("--authentication-kubeconfig={kubeconfig}"),
            format!("--authorization-kubeconfig={kubeconfig}"),
            "--leader-elect=false".into(),
            "--port=0".into(),
            format!("--secure-port={port}"),
            format!("--cert-dir={}", dir.join("pki").join("scheduler").display()),
            "--v=1".into(),
        ],
        log: dir.join("logs").join("kube-scheduler.log"),
        ..Spec::default()
    }
}

impl LocalPlane {
    /// Start etcd and kube-apiserver (and kube-controller-manager if asked), wait for
    /// `/readyz`, and return a client.
    pub async fn start(opts: Options) -> Result<LocalPlane, Error> {
        let started = Instant::now();
        let (dir, temp) = work_dir(opts.dir.as_ref())?;
        let apiserver_bin = binaries::kubernetes("kube-apiserver", DEFAULT_VERSION)?;
        let kcm_bin = if opts.controller_manager {
            Some(binaries::kubernetes(
                "kube-controller-manager",
                DEFAULT_VERSION,
            )?)
        } else {
            None
        };
        let etcd_bin = binaries::etcd("etcd")?;
        // With nodes, the plane gets a service range of its own, routed from this machine
        // through its first node (several planes with nodes coexist).
        let plane_slot = match &opts.nodes {
            Some(_) => Some(nestplane_nodes::net::claim_plane(&dir).map_err(node_err)?),
            None => None,
        };
        let service_cidr = plane_slot
            .as_ref()
            .map(|s| nestplane_nodes::net::plane_service_cidr(s.number))
            // Without nodes nothing routes the range: a /16, so that a thousand tenants'
            // Services fit (each has several).
            .unwrap_or_else(|| "10.0.0.0/16".into());
        let first_service_ip = nth_address(&service_cidr, 1)?;
        let pki = ensure_pki(
            &dir,
            &[
                first_service_ip,
                nestplane_nodes::config::NODE_LOCAL_APISERVER.into(),
            ],
        )?;
        let mut children = Vec::new();
        let (etcd_client, etcd_peer) = (free_port()?, free_port()?);
        let mut etcd_child = Child::spawn(&etcd_spec(etcd_bin, &dir, etcd_client, etcd_peer))
            .map_err(io_err("starting etcd"))?;
        wait_tcp(&mut etcd_child, etcd_client, Duration::from_secs(30)).await?;
        if !opts.crds.is_empty() {
            seed::crds(
                &dir.join("pki"),
                etcd_client,
                &opts.crds,
                Duration::from_secs(30),
            )
            .await?;
        }
        children.push(etcd_child);

        let port = free_port()?;
        let server = format!("https://127.0.0.1:{port}");
        let apiserver = apiserver_spec(
            apiserver_bin,
            &dir,
            port,
            &format!("https://127.0.0.1:{etcd_client}"),
            &service_cidr,
            opts.nodes.is_some(),
        );
        let mut api_child = Child::spawn(&apiserver).map_err(io_err("starting kube-apiserver"))?;
        let kubeconfig = pki::kubeconfig(
            "nestplane-management",
            &server,
            None,
            &pki.ca.cert_pem,
            "nestplane-admin",
            &pki.admin,
        )?;
        let kubeconfig_path = dir.join("admin.kubeconfig");
        write_private(&kubeconfig_path, &kubeconfig)?;
        let client = client_from_kubeconfig(&kubeconfig).await?;
        wait_ready(&client, &mut api_child, Duration::from_secs(60)).await?;
        children.push(api_child);

        if let Some(kcm_bin) = kcm_bin {
            let kcm_port = free_port()?;
            let kcm = controller_manager_spec(
                kcm_bin,
                &dir,
                kcm_port,
                &service_cidr,
                opts.nodes.is_some(),
                &opts.disabled_controllers,
            );
            let mut kcm_child =
                Child::spawn(&kcm).map_err(io_err("starting kube-controller-manager"))?;
            wait_tcp(&mut kcm_child, kcm_port, Duration::from_secs(30)).await?;
            children.push(kcm_child);
        }
        if opts.nodes.is_some() {
            // Pods need a scheduler.
            let sched_port = free_port()?;
            let sched = scheduler_spec(
                binaries::kubernetes("kube-scheduler", DEFAULT_VERSION)?,
                &dir,
                sched_port,
            );
            let mut child = Child::spawn(&sched).map_err(io_err("starting kube-scheduler"))?;
            wait_tcp(&mut child, sched_port, Duration::from_secs(30)).await?;
            children.push(child);
        }
        let mut plane = LocalPlane {
            nodes: Vec::new(),
            tasks: Vec::new(),
            plane_slot,
            service_cidr,
            dir,
            _temp: temp,
            children,
            kubeconfig_path,
            kubeconfig,
            server,
            ca_pem: pki.ca.cert_pem,
            client,
            startup: started.elapsed(),
        };
        if let Some(n) = &opts.nodes {
            plane.start_nodes(n, port).await?;
            plane.startup = started.elapsed();
        }
        Ok(plane)
    }

    async fn start_nodes(&mut self, n: &NodeOptions, api_port: u16) -> Result<(), Error> {
        use nestplane_nodes::{join, node};
        let service_ip_dns = nth_address(&self.service_cidr, 10)?.to_string();
        for i in 0..n.count {
            let token = join::BootstrapToken::generate();
            join::prepare(&self.client, &token, Duration::from_secs(24 * 3600))
                .await
                .map_err(node_err)?;
            let name = format!("node-{i}");
            let started = node::Node::start(node::NodeConfig {
                name: name.clone(),
                dir: self.dir.join("nodes").join(&name),
                ca_pem: self.ca_pem.clone(),
                token: token.token(),
                apiservers: vec![std::net::SocketAddr::from(([127, 0, 0, 1], api_port))],
                api_port,
                images: n.images.clone(),
                pause_image: format!(
                    "{}/pause:{}",
                    DEFAULT_IMAGE_REGISTRY,
                    nestplane_nodes::images::PAUSE_TAG
                ),
                spec: nestplane_nodes::config::NodeSpec {
                    version: DEFAULT_VERSION.into(),
                    ..Default::default()
                },
                cluster: nestplane_nodes::config::ClusterSettings {
                    cluster_dns: vec![service_ip_dns.clone()],
                    cluster_domain: CLUSTER_DOMAIN.into(),
                    ..Default::default()
                },
                group: None,
                control_plane_user: None,
                guard: None,
                tunnel: None,
                entry: None,
                slot: None,
            })
            .await
            .map_err(node_err)?;
            if i == 0 {
                // This machine reaches the plane's Services through its first node.
                nestplane_nodes::net::route_services(&self.service_cidr, started.ip())
                    .map_err(node_err)?;
            }
            self.nodes.push(started);
        }
        let mut objects = vec![
            serde_json::to_value(volumes::storage_class())
                .map_err(|e| Error::Client(e.to_string()))?,
        ];
        self.tasks.push(tokio::spawn(volumes::run(
            self.client.clone(),
            self.dir.join("volumes"),
            self.nodes.iter().map(|n| n.name().to_string()).collect(),
        )));
        if let Some(image) = &n.dns_image {
            objects.extend(nestplane_dns::manifests(&nestplane_dns::Deployment {
                image: image.clone(),
                service_ip: service_ip_dns,
                zone: CLUSTER_DOMAIN.into(),
                replicas: 1,
            }));
        }
        apply_all(&self.client, &objects).await?;
        self.wait_nodes_ready(Duration::from_secs(120)).await
    }

    /// Wait until every node of the plane reports Ready.
    pub async fn wait_nodes_ready(&self, timeout: Duration) -> Result<(), Error> {
        use k8s_openapi::api::core::v1::Node;
        let nodes: kube::Api<Node> = kube::Api::all(self.client.clone());
        let deadline = Instant::now() + timeout;
        loop {
            let list = nodes
                .list(&Default::default())
                .await
                .map_err(|e| Error::Client(e.to_string()))?;
            let ready = list
                .items
                .iter()
                .filter(|n| {
                    n.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .count();
            if ready >= self.nodes.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let tail = self
                    .nodes
                    .first()
                    .map(|n| child::log_tail(&n.dir().join("logs/kubelet.log"), 20))
                    .unwrap_or_default();
                return Err(Error::ProcessFailed {
                    process: "kubelet".into(),
                    reason: format!(
                        "{ready} of {} nodes Ready after {timeout:?}",
                        self.nodes.len()
                    ),
                    log: "nodes/*/logs/kubelet.log".into(),
                    tail,
                });
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The plane's nodes.
    pub fn nodes(&self) -> &[nestplane_nodes::node::Node] {
        &self.nodes
    }

    /// The plane's service range.
    pub fn service_cidr(&self) -> &str {
        &self.service_cidr
    }

    /// A client with cluster-admin rights.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The admin kubeconfig file (mode 0600).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// The admin kubeconfig's contents.
    pub fn kubeconfig(&self) -> &str {
        &self.kubeconfig
    }

    /// The API server URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The management plane's CA certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long startup took, until `/readyz` answered.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// Process ids of the children (etcd, kube-apiserver, kube-controller-manager).
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.children
            .iter()
            .map(|c| (c.name().to_string(), c.pid()))
            .collect()
    }

    /// A kubeconfig for a service account: the token of `namespace/name` (a token secret
    /// created here, filled by kube-controller-manager), so the apiserver enforces that
    /// account's RBAC. Needs `controller_manager: true`.
    pub async fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<String, Error> {
        use k8s_openapi::api::core::v1::Secret;
        use kube::api::{Api, PostParams};
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let secret_name = format!("{name}-token-nestplane");
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(secret_name.clone()),
                annotations: Some(
                    [(
                        "kubernetes.io/service-account.name".to_string(),
                        name.to_string(),
                    )]
                    .into(),
                ),
                ..Default::default()
            },
            type_: Some("kubernetes.io/service-account-token".into()),
            ..Secret::default()
        };
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(Error::Client(e.to_string())),
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = secrets
                .get(&secret_name)
                .await
                .map_err(|e| Error::Client(e.to_string()))?;
            if let Some(token) = s.data.as_ref().and_then(|d| d.get("token")) {
                let token = String::from_utf8_lossy(&token.0).into_owned();
                return nestplane_pki::write_kubeconfig(&nestplane_pki::KubeconfigSpec {
                    cluster: "management",
                    server: &self.server,
                    server_name: None,
                    authority: nestplane_pki::Authority::Pem(&self.ca_pem),
                    user: name,
                    credential: nestplane_pki::Credential::Token(&token),
                    namespace: Some(namespace),
                })
                .map_err(|e| Error::Client(e.to_string()));
            }
            if Instant::now() > deadline {
                return Err(Error::Client(format!(
                    "no token for service account {namespace}/{name} after 30s (is kube-controller-manager running?)"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stop every child process (SIGTERM, then SIGKILL), last started first.
    pub fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        // Nodes first (their pods go with them), while the API server still answers.
        for n in self.nodes.drain(..) {
            let name = n.name().to_string();
            if let Err(e) = n.remove_now() {
                tracing::warn!(node = %name, error = %e, "removing a node");
            }
        }
        if let Some(s) = self.plane_slot.take() {
            s.release();
        }
        while let Some(mut c) = self.children.pop() {
            c.stop(Duration::from_secs(5));
        }
    }
}

impl Drop for LocalPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A `kube::Client` for a kubeconfig (YAML text).
pub async fn client_from_kubeconfig(kubeconfig: &str) -> Result<kube::Client, Error> {
    let kc = Kubeconfig::from_yaml(kubeconfig).map_err(|e| Error::Client(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| Error::Client(e.to_string()))?;
    kube::Client::try_from(config).map_err(|e| Error::Client(e.to_string()))
}

fn failed(child: &Child, reason: impl Into<String>) -> Error {
    Error::ProcessFailed {
        process: child.name().to_string(),
        reason: reason.into(),
        log: child.log().display().to_string(),
        tail: child::log_tail(child.log(), 20),
    }
}

async fn wait_tcp(child: &mut Child, port: u16, timeout: Duration) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.exited() {
            return Err(failed(child, format!("exited with {status}")));
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(failed(
                child,
                format!("port {port} not open after {timeout:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn wait_ready(
    client: &kube::Client,
    child: &mut Child,
    timeout: Duration,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        if let Some(status) = child.exited() {
            return Err(failed(child, format!("exited with {status}")));
        }
        match client.request_text(http_get("/readyz")?).await {
            Ok(body) if body.trim() == "ok" => return Ok(()),
            Ok(body) => last = body,
            Err(e) => last = e.to_string(),
        }
        if Instant::now() > deadline {
            return Err(failed(
                child,
                format!("/readyz not ok after {timeout:?}: {last}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn node_err(e: nestplane_nodes::Error) -> Error {
    Error::Client(format!("nodes: {e}"))
}

/// The `n`th address of an IPv4 range (`10.0.0.0/24`, 10 → `10.0.0.10`).
fn nth_address(cidr: &str, n: u32) -> Result<std::net::IpAddr, Error> {
    let base = cidr
        .split('/')
        .next()
        .and_then(|a| a.parse::<std::net::Ipv4Addr>().ok())
        .ok_or_else(|| Error::Client(format!("bad range {cidr}")))?;
    Ok(std::net::Ipv4Addr::from(u32::from(base) + n).into())
}

/// Server-side apply of plain objects (cluster-scoped or namespaced) with the admin client.
pub async fn apply_all(client: &kube::Client, objects: &[serde_json::Value]) -> Result<(), Error> {
    use kube::api::{Api, DynamicObject, Patch, PatchParams};
    use kube::core::{ApiResource, GroupVersionKind};
    for o in objects {
        let api_version = o["apiVersion"].as_str().unwrap_or_default();
        let kind = o["kind"].as_str().unwrap_or_default();
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let lower = kind.to_ascii_lowercase();
        let plural = if lower.ends_with("ss") {
            format!("{lower}es")
        } else {
            format!("{lower}s")
        };
        let ar = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, kind),
            &plural,
        );
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        let api: Api<DynamicObject> = match o["metadata"]["namespace"].as_str() {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        api.patch(
            name,
            &PatchParams::apply("nestplane-localplane").force(),
            &Patch::Apply(o),
        )
        .await
        .map_err(|e| Error::Client(format!("applying {kind}/{name}: {e}")))?;
    }
    Ok(())
}

/// A GET request for `path` (health endpoints).
pub fn http_get(path: &str) -> Result<http::Request<Vec<u8>>, Error> {
    http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| Error::Client(e.to_string()))
}
