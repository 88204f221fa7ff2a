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

/// The Kubernetes version of the management plane's binaries (the ones the install script
/// builds).
pub const DEFAULT_VERSION: &str = "v1.20.2";

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
    /// Controllers of kube-controller-manager to leave off (`deployment`, `statefulset`, …):
    /// a plane without nodes can then have workload status written by a test instead.
    pub disabled_controllers: Vec<String>,
}

/// A running management plane.
pub struct LocalPlane {
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

struct Pki {
    ca: CertKey,
    serving: CertKey,
    admin: CertKey,
    sa: CertKey,
}

fn ensure_pki(dir: &Path) -> Result<Pki, Error> {
    let now = time::OffsetDateTime::now_utc();
    let pki_dir = dir.join("pki");
    // The CA and the service-account key are kept across restarts; leaves are reissued every
    // start (cheap, and picks up any new address).
    let ca = load_or(&pki_dir.join("ca"), || {
        Ok(pki::generate_ca("nestplane-management-ca", now)?)
    })?;
    let sa = load_or(&pki_dir.join("sa"), || {
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
            ips: vec![
                "127.0.0.1"
                    .parse()
                    .map_err(|_| Error::Client("ip".into()))?,
            ],
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
    for (name, ck) in [("apiserver", &serving), ("admin", &admin)] {
        write_private(&pki_dir.join(format!("{name}.crt")), &ck.cert_pem)?;
        write_private(&pki_dir.join(format!("{name}.key")), &ck.key_pem)?;
    }
    Ok(Pki {
        ca,
        serving,
        admin,
        sa,
    })
}

impl LocalPlane {
    /// Start etcd and kube-apiserver (and kube-controller-manager if asked), wait for
    /// `/readyz`, and return a client.
    pub async fn start(opts: Options) -> Result<LocalPlane, Error> {
        let started = Instant::now();
        let (dir, temp) = match &opts.dir {
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
        let apiserver_bin = binaries::kubernetes("kube-apiserver", DEFAULT_VERSION)?;
        let kcm_bin = if opts.controller_manager {
            Some(binaries::kubernetes(
                "kube-controller-manager",
                DEFAULT_VERSION,
            )?)
        } else {
            None
        };
        let etcd_bin = binaries::on_path("etcd")?;
        let pki = ensure_pki(&dir)?;
        let p = |name: &str| dir.join("pki").join(name).display().to_string();
        let logs = dir.join("logs");

        let mut children = Vec::new();
        // etcd: plain HTTP, loopback only.
        let (etcd_client, etcd_peer) = (free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let etcd = Spec {
            name: "etcd".into(),
            program: etcd_bin,
            args: vec![
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=default=http://127.0.0.1:{etcd_peer}"),
                "--name=default".into(),
                "--quota-backend-bytes=4294967296".into(),
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
            log: logs.join("etcd.log"),
            ..Spec::default()
        };
        let mut etcd_child = Child::spawn(&etcd).map_err(io_err("starting etcd"))?;
        wait_tcp(&mut etcd_child, etcd_client, Duration::from_secs(30)).await?;
        children.push(etcd_child);

        let port = free_port()?;
        let server = format!("https://127.0.0.1:{port}");
        let apiserver = Spec {
            name: "kube-apiserver".into(),
            program: apiserver_bin,
            args: vec![
                "--advertise-address=127.0.0.1".into(),
                "--allow-privileged=true".into(),
                "--authorization-mode=RBAC".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--cert-dir={}", dir.join("pki").display()),
                format!("--client-ca-file={}", p("ca.crt")),
                "--endpoint-reconciler-type=none".into(),
                format!("--etcd-servers={etcd_url}"),
                "--insecure-port=0".into(),
                format!("--secure-port={port}"),
                "--service-account-issuer=https://kubernetes.default.svc".into(),
                format!("--service-account-key-file={}", p("sa.crt")),
                format!("--service-account-signing-key-file={}", p("sa.key")),
                "--service-cluster-ip-range=10.0.0.0/24".into(),
                format!("--tls-cert-file={}", p("apiserver.crt")),
                format!("--tls-private-key-file={}", p("apiserver.key")),
                "--v=1".into(),
            ],
            log: logs.join("kube-apiserver.log"),
            ..Spec::default()
        };
        let mut api_child = Child::spawn(&apiserver).map_err(io_err("starting kube-apiserver"))?;

        let kubeconfig = pki::kubeconfig(
            "nestplane-management",
            &server,
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
            let kcm = Spec {
                name: "kube-controller-manager".into(),
                program: kcm_bin,
                args: vec![
                    "--bind-address=127.0.0.1".into(),
                    format!("--cert-dir={}", dir.join("pki").join("kcm").display()),
                    std::iter::once("--controllers=*".to_string())
                        .chain(opts.disabled_controllers.iter().map(|c| format!("-{c}")))
                        .collect::<Vec<_>>()
                        .join(","),
                    format!("--kubeconfig={}", kubeconfig_path.display()),
                    "--leader-elect=false".into(),
                    "--port=0".into(),
                    format!("--root-ca-file={}", p("ca.crt")),
                    format!("--secure-port={kcm_port}"),
                    format!("--service-account-private-key-file={}", p("sa.key")),
                    "--use-service-account-credentials=true".into(),
                    "--concurrent-gc-syncs=5".into(),
                    "--v=1".into(),
                ],
                log: logs.join("kube-controller-manager.log"),
                ..Spec::default()
            };
            let mut kcm_child =
                Child::spawn(&kcm).map_err(io_err("starting kube-controller-manager"))?;
            wait_tcp(&mut kcm_child, kcm_port, Duration::from_secs(30)).await?;
            children.push(kcm_child);
        }
        let _ = (&pki.serving, &pki.sa);
        Ok(LocalPlane {
            dir,
            _temp: temp,
            children,
            kubeconfig_path,
            kubeconfig,
            server,
            ca_pem: pki.ca.cert_pem,
            client,
            startup: started.elapsed(),
        })
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
        let secret: Secret = serde_json::from_value(serde_json::json!({
            "metadata": {"name": secret_name, "annotations": {"kubernetes.io/service-account.name": name}},
            "type": "kubernetes.io/service-account-token"
        }))
        .map_err(|e| Error::Client(e.to_string()))?;
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
                let ca = base64_encode(self.ca_pem.as_bytes());
                return Ok(format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: management\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\nusers:\n- name: {name}\n  user:\n    token: {token}\ncontexts:\n- name: {name}@management\n  context:\n    cluster: management\n    user: {name}\n    namespace: {namespace}\ncurrent-context: {name}@management\n",
                    self.server
                ));
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

fn base64_encode(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
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

/// A GET request for `path` (health endpoints).
pub fn http_get(path: &str) -> Result<http::Request<Vec<u8>>, Error> {
    http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| Error::Client(e.to_string()))
}
