//! Helpers shared by the CLI's integration tests: real binaries only.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod network;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Run `kubectl --kubeconfig <kc> args…`; fails the test with an install hint when kubectl is
/// missing.
pub fn kubectl(kubeconfig: &Path, args: &[&str]) -> Output {
    kubectl_stdin(kubeconfig, args, None)
}

/// Like [`kubectl`], feeding `stdin`.
pub fn kubectl_stdin(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(
            "kubectl not found on PATH: run scripts/install-deps.sh (installs kubernetes-client)",
        );
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

/// Run kubectl and require success; returns stdout.
pub fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> String {
    let out = kubectl(kubeconfig, args);
    assert!(
        out.status.success(),
        "kubectl {} failed:\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kubectl exec ARGS` (ARGS start after `exec`), requiring success; returns stdout.
///
/// One answer is retried for up to 30 s: the kubelet's `Authorization error`, its 500 when it
/// could not ask the API server whether the caller may exec. About 10 s after a kubelet starts
/// without a client certificate (a node joined by bootstrap token), it gets its first one from
/// the CSR and closes every connection to the API server to use it (kubelet 1.20: "certificate
/// rotation detected, shutting down client connections"); an authorization request in flight
/// at that moment fails, and the webhook authorizer does not retry a closed connection. Any
/// other failure fails at once.
pub fn kubectl_exec_ok(kubeconfig: &Path, args: &[&str]) -> String {
    let mut all = vec!["exec"];
    all.extend_from_slice(args);
    eventually("kubectl exec", Duration::from_secs(30), || {
        let out = kubectl(kubeconfig, &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            return Some(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        assert!(
            stderr.contains("Authorization error (user="),
            "kubectl {} failed:\n{}{stderr}",
            all.join(" "),
            String::from_utf8_lossy(&out.stdout),
        );
        None
    })
}

/// The `nestplane` binary built for these tests.
pub fn nestplane() -> Command {
    Command::new(env!("CARGO_BIN_EXE_nestplane"))
}

/// How long a poll that began at `started` waits before looking again: a tenth of the time
/// it has waited so far, between 100 ms and 1 s. Most looks run `kubectl`, about 0.1 s of CPU
/// each (measured with process accounting: 40% of a hosted-cluster test's CPU when every wait
/// looked every 100 ms), so a long wait looks once a second while a short one still ends
/// within a tenth of its length.
pub fn poll_pause(started: Instant) -> Duration {
    (started.elapsed() / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Poll `f` until it returns `Some`, or panic with `what` after `timeout`.
pub fn eventually<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let started = Instant::now();
    let deadline = started + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(poll_pause(started));
    }
}

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use nestplane_api::NestedControlPlane;
use nestplane_localplane::{LocalPlane, Options};

/// A management plane with the CRDs installed and (optionally) the operator running in this
/// process with the process runtime.
pub struct Env {
    pub plane: LocalPlane,
    pub operator: Option<nestplane_operator::Operator>,
    pub state: tempfile::TempDir,
}

impl Env {
    pub async fn start(with_operator: bool) -> Env {
        let plane = LocalPlane::start(Options {
            dir: None,
            controller_manager: true,
            disabled_controllers: vec![],
            nodes: None,
            crds: nestplane_api::crds::all(),
        })
        .await
        .expect("management plane");
        nestplane_operator::crds::install(&plane.client(), Duration::from_secs(30))
            .await
            .expect("CRDs");
        let state = tempfile::tempdir().unwrap();
        let mut env = Env {
            plane,
            operator: None,
            state,
        };
        if with_operator {
            env.start_operator();
        }
        env
    }

    pub fn start_operator(&mut self) {
        self.start_operator_running(nestplane_operator::Controllers::default());
    }

    /// Start the operator with only `controllers` (`--controllers`).
    pub fn start_operator_running(&mut self, controllers: nestplane_operator::Controllers) {
        self.start_operator_with(controllers, vec![]);
    }

    /// Start the operator with `controllers`, its nodes importing `node_images` too.
    pub fn start_operator_with(
        &mut self,
        controllers: nestplane_operator::Controllers,
        node_images: Vec<String>,
    ) {
        self.start_operator_configured(controllers, node_images, None, vec![]);
    }

    /// Start the operator allowing these S3 servers for backups (`--backup-s3-endpoint`).
    pub fn start_operator_with_s3(&mut self, endpoints: Vec<String>) {
        self.start_operator_configured(
            nestplane_operator::Controllers::default(),
            vec![],
            None,
            endpoints,
        );
    }

    /// Start the operator running the shared gateway on a free loopback port (each control
    /// plane's `status.gateway` says where).
    pub fn start_operator_with_gateway(&mut self) {
        self.start_operator_configured(
            nestplane_operator::Controllers::default(),
            vec![],
            Some("127.0.0.1:0".parse().unwrap()),
            vec![],
        );
    }

    /// Start the operator running the shared gateway at a loopback port given to it (so it
    /// is every tenant's endpoint), and only `controllers` (`--controllers`).
    pub fn start_operator_with_published_gateway(&mut self, controllers: &str) {
        self.start_operator_configured(
            nestplane_operator::Controllers::parse(controllers).unwrap(),
            vec![],
            Some(std::net::SocketAddr::from(([127, 0, 0, 1], free_port()))),
            vec![],
        );
    }

    /// Start the operator running the shared gateway at `address` (port 0: a free one).
    pub fn start_operator_with_gateway_at(&mut self, address: std::net::SocketAddr) {
        self.start_operator_configured(
            nestplane_operator::Controllers::default(),
            vec![],
            Some(address),
            vec![],
        );
    }

    fn start_operator_configured(
        &mut self,
        controllers: nestplane_operator::Controllers,
        node_images: Vec<String>,
        gateway: Option<std::net::SocketAddr>,
        backup_s3_endpoints: Vec<String>,
    ) {
        self.operator = Some(nestplane_operator::Operator::start(
            self.plane.client(),
            nestplane_operator::Config {
                state_dir: self.operator_dir(),
                controllers,
                nodes: Some(nestplane_operator::hosted::pool::NodeSettings {
                    dir: self.state.path().join("nodes"),
                    images: nestplane_nodes::images::default_dir(),
                    guard: env!("CARGO_BIN_EXE_nestplane").into(),
                    extra_images: node_images,
                }),
                gateway,
                backup_s3_endpoints,
                ..Default::default()
            },
        ));
    }

    /// `nestplane operator` as a process of its own on this management plane (killed when
    /// dropped), its log in `operator.log` of the state directory.
    pub fn spawn_operator(&self) -> KillOnDrop {
        self.spawn_operator_with(&[])
    }

    /// [`Env::spawn_operator`] with more arguments.
    pub fn spawn_operator_with(&self, extra: &[&str]) -> KillOnDrop {
        let kc = self.state.path().join("mgmt.kubeconfig");
        std::fs::write(&kc, self.plane.kubeconfig()).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.path().join("operator.log"))
            .unwrap();
        nestplane()
            .args([
                "operator",
                "--metrics-bind-address",
                "127.0.0.1:0",
                "--state-dir",
            ])
            .arg(self.operator_dir())
            .args(extra)
            .env("KUBECONFIG", kc)
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map(KillOnDrop)
            .unwrap()
    }

    pub fn operator_dir(&self) -> PathBuf {
        self.state.path().join("operator")
    }

    pub fn client(&self) -> kube::Client {
        self.plane.client()
    }

    pub fn kubeconfig(&self) -> &Path {
        self.plane.kubeconfig_path()
    }

    pub fn ncps(&self, ns: &str) -> Api<NestedControlPlane> {
        Api::namespaced(self.client(), ns)
    }

    /// Install the test fixture's Cluster API `Cluster` CRD and wait until it is served.
    pub fn install_cluster_crd(&self) {
        let crd =
            std::fs::read_to_string(repo().join("crates/cli/tests/fixtures/cluster-crd.yaml"))
                .unwrap();
        self.apply(&crd);
        wait_established(self.kubeconfig(), "clusters.cluster.x-k8s.io");
    }

    /// Apply the CRD fixture `file` (under `crates/cli/tests/fixtures`) and wait until `name`
    /// is served.
    pub fn install_crd(&self, file: &str, name: &str) {
        let crd =
            std::fs::read_to_string(repo().join("crates/cli/tests/fixtures").join(file)).unwrap();
        self.apply(&crd);
        wait_established(self.kubeconfig(), name);
    }

    /// Create a control plane from YAML via kubectl (what a user does).
    pub fn apply(&self, yaml: &str) {
        kubectl_apply(self.kubeconfig(), yaml);
    }

    pub async fn create_ncp(&self, ns: &str, name: &str) {
        let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
            "kind": "NestedControlPlane",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"version": "v1.20.2"}
        }))
        .unwrap();
        self.ncps(ns)
            .create(&PostParams::default(), &ncp)
            .await
            .unwrap();
    }

    /// Wait until the control plane reports `ready`; panics with its conditions otherwise.
    pub async fn wait_ready(&self, ns: &str, name: &str, timeout: Duration) -> NestedControlPlane {
        let deadline = Instant::now() + timeout;
        loop {
            let ncp = self.ncps(ns).get(name).await.unwrap();
            if ncp.status.as_ref().is_some_and(|s| s.ready) {
                return ncp;
            }
            if Instant::now() > deadline {
                let logs = self.tenant_logs(ns, name);
                panic!(
                    "{ns}/{name} not ready after {timeout:?}: {:#?}\n{logs}",
                    ncp.status
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The tails of a tenant's process logs (for failure messages).
    pub fn tenant_logs(&self, ns: &str, name: &str) -> String {
        let dir = self.operator_dir().join("tenants").join(ns).join(name);
        let mut out = String::new();
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let replica = entry.file_name().to_string_lossy().into_owned();
            let log = entry.path().join(format!("{replica}.log"));
            if log.exists() {
                out.push_str(&format!(
                    "--- {replica} ---\n{}\n",
                    nestplane_runtime::child::log_tail(&log, 15)
                ));
            }
        }
        out
    }

    /// The uid the processes of control plane `ns/name` run as (its API server's, from
    /// `/proc`, as `ps -o uid` shows it).
    pub fn uid(&self, ns: &str, name: &str) -> u32 {
        let pid = self
            .pid(ns, name, "apiserver", 0)
            .expect("the API server runs");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|u| u.split_whitespace().next())
            .and_then(|u| u.parse().ok())
            .expect("a Uid line")
    }

    /// The pid of replica `i` of `component` (`etcd`, `apiserver`, …), from its pid file.
    pub fn pid(&self, ns: &str, name: &str, component: &str, i: usize) -> Option<u32> {
        let f = self
            .operator_dir()
            .join("tenants")
            .join(ns)
            .join(name)
            .join(format!("{name}-{component}-{i}"))
            .join("pid");
        std::fs::read_to_string(f).ok()?.trim().parse().ok()
    }

    pub async fn secret(&self, ns: &str, name: &str) -> Option<Secret> {
        Api::<Secret>::namespaced(self.client(), ns)
            .get_opt(name)
            .await
            .unwrap()
    }

    /// Write the tenant's admin kubeconfig (from `<name>-kubeconfig`) to a file.
    pub async fn tenant_kubeconfig(&self, ns: &str, name: &str) -> PathBuf {
        let s = self
            .secret(ns, &format!("{name}-kubeconfig"))
            .await
            .expect("kubeconfig secret");
        let value = s.data.unwrap()["value"].0.clone();
        let path = self.state.path().join(format!("{ns}-{name}.kubeconfig"));
        std::fs::write(&path, value).unwrap();
        path
    }
}

/// Wait until CRD `name` is `Established`. (Not `kubectl wait`: a kubectl of 1.20 fails at
/// once on a CRD whose status has no conditions yet, as one just applied may not.)
pub fn wait_established(kc: &Path, name: &str) {
    eventually(
        &format!("CRD {name} established"),
        Duration::from_secs(60),
        || {
            let s = jsonpath(
                kc,
                &["crd", name],
                "{.status.conditions[?(@.type==\"Established\")].status}",
            );
            (s.trim() == "True").then_some(())
        },
    );
}

/// Wait until every CRD is `Established` ([`wait_established`]).
pub fn wait_all_established(kc: &Path) {
    eventually("every CRD established", Duration::from_secs(60), || {
        let s = jsonpath(
            kc,
            &["crd"],
            "{range .items[*]}{.metadata.name}={.status.conditions[?(@.type==\"Established\")].status}{\"\\n\"}{end}",
        );
        let lines: Vec<&str> = s.lines().filter(|l| !l.is_empty()).collect();
        (!lines.is_empty() && lines.iter().all(|l| l.ends_with("=True"))).then_some(())
    });
}

/// A child process (an operator the test runs) that is killed (SIGKILL) and reaped when
/// dropped, so a failing test never leaves it, and the tenants it supervises, running.
pub struct KillOnDrop(pub std::process::Child);

impl KillOnDrop {
    /// SIGKILL and reap now.
    pub fn kill(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Whether it has exited.
    pub fn exited(&mut self) -> bool {
        self.0.try_wait().ok().flatten().is_some()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What removed node `dir` (slot `slot`) left on this machine. Slots are the machine's: once a
/// node released its slot, a test running beside this one may start a node in it, whose
/// network namespace, interface, cgroups, rules and route are its own. While another
/// directory claims the slot (looked at before and after), only what names `dir` counts.
pub fn node_leftovers(slot: u8, dir: &Path) -> Vec<String> {
    let claimed_elsewhere = || {
        std::fs::read_to_string(nestplane_nodes::net::slots_dir().join(slot.to_string()))
            .ok()
            .and_then(|c| c.trim().split_once(' ').map(|(_, d)| PathBuf::from(d)))
            .is_some_and(|d| d != dir)
    };
    let before = claimed_elsewhere();
    let left = nestplane_nodes::node::leftovers(&nestplane_nodes::config::Addresses::of(slot), dir);
    if before || claimed_elsewhere() {
        let d = dir.to_string_lossy();
        left.into_iter()
            .filter(|l| l.starts_with("process") || l == "mounts" || l.contains(d.as_ref()))
            .collect()
    } else {
        left
    }
}

/// A command running one of etcd's binaries (`etcd`, `etcdctl`, `etcdutl`) as nestplane finds
/// them; fails the test with the install hint when it is missing.
pub fn etcd_tool(name: &str) -> Command {
    Command::new(nestplane_runtime::binaries::etcd(name).unwrap_or_else(|e| panic!("{e}")))
}

/// The version an etcd binary reports (`etcd --version`: `etcd Version: 3.5.30`), or of
/// `etcdctl version`.
pub fn etcd_version_of(binary: &std::path::Path) -> String {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", binary.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("etcd Version: "))
        .unwrap_or_else(|| panic!("{}: no version in {text:?}", binary.display()))
        .trim()
        .to_string()
}

/// Fails the test unless `version` (`3.5.30`) is at least 3.5.30: older etcds have published
/// authorization bypasses (issue 29).
pub fn assert_current_etcd(what: &str, version: &str) {
    if let Some(problem) = nestplane_api::datastore::etcd_version_problem(version) {
        panic!("{what}: {problem}");
    }
    let parts: Vec<u32> = version
        .split('.')
        .map(|p| {
            p.parse()
                .unwrap_or_else(|_| panic!("{what}: version {version:?}"))
        })
        .collect();
    assert!(
        parts.as_slice() >= [3, 5, 30].as_slice(),
        "{what} runs etcd {version}, older than 3.5.30"
    );
}

/// `etcdctl` against a tenant's etcd members, authenticated with the API server's etcd client
/// certificate (`<cluster>-apiserver-etcd-client`).
pub struct Etcdctl {
    dir: tempfile::TempDir,
    endpoints: Vec<String>,
}

impl Etcdctl {
    /// Run `etcdctl args…`; returns (success, stdout, stderr). Fails the test with an install
    /// hint when etcdctl is missing.
    pub fn run(&self, args: &[&str]) -> (bool, String, String) {
        let f = |n: &str| self.dir.path().join(n).display().to_string();
        let out = etcd_tool("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoints.join(",")))
            .arg(format!("--cacert={}", f("ca.crt")))
            .arg(format!("--cert={}", f("client.crt")))
            .arg(format!("--key={}", f("client.key")))
            .args(args)
            .output()
            .expect("etcdctl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

impl Env {
    /// [`Etcdctl`] for the etcd of `ns/cluster` at `endpoints` (`https://host:port`).
    pub async fn etcdctl(&self, ns: &str, cluster: &str, endpoints: Vec<String>) -> Etcdctl {
        self.etcdctl_as(ns, &format!("{cluster}-apiserver-etcd-client"), endpoints)
            .await
    }

    /// [`Etcdctl`] with the client certificate in secret `ns/secret` (`tls.crt`, `tls.key`,
    /// `ca.crt`).
    pub async fn etcdctl_as(&self, ns: &str, secret: &str, endpoints: Vec<String>) -> Etcdctl {
        let client = self
            .secret(ns, secret)
            .await
            .expect("etcd client certificate");
        let data = client.data.unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (k, file) in [
            ("tls.crt", "client.crt"),
            ("tls.key", "client.key"),
            ("ca.crt", "ca.crt"),
        ] {
            std::fs::write(dir.path().join(file), &data[k].0).unwrap();
        }
        Etcdctl { dir, endpoints }
    }
}

impl Etcdctl {
    /// A gRPC client with the same certificate, for what etcdctl cannot send (nested
    /// transactions).
    pub async fn client(&self) -> etcd_client::Client {
        let read = |n: &str| std::fs::read_to_string(self.dir.path().join(n)).unwrap();
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(read("ca.crt")))
            .identity(etcd_client::Identity::from_pem(
                read("client.crt"),
                read("client.key"),
            ));
        etcd_client::Client::connect(
            &self.endpoints,
            Some(etcd_client::ConnectOptions::new().with_tls(tls)),
        )
        .await
        .expect("connecting to etcd")
    }
}

/// Whether a process is alive (not reaped, not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            .is_none_or(|s| s != "Z"),
        Err(_) => false,
    }
}

/// kill -9.
pub fn kill9(pid: u32) {
    let ok = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -9 {pid}");
}

/// Events whose involved/regarding object has `name`, as "reason: note" lines.
pub fn events_for(kubeconfig: &Path, ns: &str, name: &str) -> String {
    kubectl_ok(
        kubeconfig,
        &[
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            &format!("involvedObject.name={name}"),
            "-o",
            "jsonpath={range .items[*]}{.type} {.reason}: {.message}{\"\\n\"}{end}",
        ],
    )
}

/// `kubectl apply -f -` of `yaml` to the cluster of `kubeconfig`; panics with kubectl's
/// error when it fails.
pub fn kubectl_apply(kubeconfig: &Path, yaml: &str) {
    let out = kubectl_stdin(kubeconfig, &["apply", "-f", "-"], Some(yaml));
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The locally built images (`nestplane images build`, which rebuilds only what changed), by
/// name.
pub fn images() -> std::collections::BTreeMap<String, PathBuf> {
    static BUILT: std::sync::OnceLock<std::collections::BTreeMap<String, PathBuf>> =
        std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = nestplane()
                .args(["images", "build"])
                .current_dir(repo())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "nestplane images build: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let dir = nestplane_nodes::images::default_dir();
            let mut map = std::collections::BTreeMap::new();
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let p = PathBuf::from(line.trim());
                for name in [
                    "registry.k8s.io/pause:3.2",
                    "registry.k8s.io/kube-apiserver:v1.20.2",
                    "registry.k8s.io/kube-controller-manager:v1.20.2",
                    "registry.k8s.io/kube-scheduler:v1.20.2",
                    "registry.k8s.io/kube-proxy:v1.20.2",
                    "registry.k8s.io/etcd:3.4.13-0",
                    nestplane_nodes::images::SHELL_IMAGE,
                    nestplane_nodes::images::OPERATOR_IMAGE,
                    nestplane_nodes::images::AGNHOST_IMAGE,
                    nestplane_nodes::images::SAMPLE_APISERVER_IMAGE,
                ] {
                    if nestplane_nodes::images::archive_path(&dir, name) == p {
                        map.insert(name.to_string(), p.clone());
                    }
                }
            }
            assert_eq!(map.len(), 10, "images built: {map:?}");
            map
        })
        .clone()
}

/// A client for the cluster of a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(cfg).unwrap()
}

/// Start a node that joins the cluster whose admin client is `admin` (a bootstrap token is
/// made for it), with the given images imported. A node of a `process`-runtime control plane
/// needs the uid its processes run as (`control_plane`: the node's isolation group too), or
/// its API server cannot reach the node.
#[allow(clippy::too_many_arguments)]
pub async fn join_node(
    admin: &kube::Client,
    name: &str,
    dir: &Path,
    ca_pem: &str,
    apiservers: Vec<std::net::SocketAddr>,
    api_port: u16,
    image_names: &[&str],
    control_plane: Option<u32>,
    tunnel: Option<(std::net::SocketAddr, String)>,
) -> nestplane_nodes::node::Node {
    use nestplane_nodes::{join, node};
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let all = images();
    let token = join::BootstrapToken::generate();
    join::prepare(admin, &token, Duration::from_secs(3600))
        .await
        .expect("bootstrap token");
    node::Node::start(node::NodeConfig {
        name: name.into(),
        dir: dir.to_path_buf(),
        ca_pem: ca_pem.into(),
        token: token.token(),
        apiservers,
        api_port,
        images: image_names.iter().map(|n| all[*n].clone()).collect(),
        pause_image: "registry.k8s.io/pause:3.2".into(),
        spec: nestplane_nodes::config::NodeSpec {
            version: "v1.20.2".into(),
            ..Default::default()
        },
        cluster: Default::default(),
        group: control_plane,
        control_plane_user: control_plane,
        guard: None,
        tunnel,
        entry: None,
        slot: None,
    })
    .await
    .expect("node starts")
}

/// Wait until the Node `name` is Ready (as its kubelet reports), printing the node's logs on
/// failure.
pub fn wait_node_ready(kubeconfig: &Path, name: &str, node_dir: &Path, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let out = kubectl(
            kubeconfig,
            &[
                "get",
                "node",
                name,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ],
        );
        if String::from_utf8_lossy(&out.stdout).trim() == "True" {
            return;
        }
        if Instant::now() > deadline {
            let mut logs = String::new();
            for p in ["kubelet", "containerd", "kube-proxy"] {
                logs.push_str(&format!(
                    "--- {p} ---\n{}\n",
                    nestplane_runtime::child::log_tail(&node_dir.join(format!("logs/{p}.log")), 25)
                ));
            }
            panic!("node {name} not Ready after {timeout:?}\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Wait until pod `name` (namespace `default`) runs and its log contains `log_line`; then
/// check that a command runs in it (`kubectl exec`).
pub fn wait_pod_running_and_logging(kubeconfig: &Path, name: &str, log_line: &str) {
    eventually("the pod runs", Duration::from_secs(120), || {
        let phase = kubectl_ok(
            kubeconfig,
            &["get", "pod", name, "-o", "jsonpath={.status.phase}"],
        );
        (phase.trim() == "Running").then_some(())
    });
    eventually("kubectl logs", Duration::from_secs(30), || {
        let out = kubectl(kubeconfig, &["logs", name]);
        String::from_utf8_lossy(&out.stdout)
            .contains(log_line)
            .then_some(())
    });
    let hostname = kubectl_exec_ok(kubeconfig, &[name, "--", "cat", "/etc/hostname"]);
    assert_eq!(hostname.trim(), name);
}

/// From inside pod `name` (namespace `default`, a busybox image), GET the pod itself from
/// its cluster's API through the `kubernetes` Service with the pod's own service-account
/// token; returns the JSON.
pub fn pod_reads_itself_from_its_api(kubeconfig: &Path, name: &str) -> String {
    pod_calls_its_api(
        kubeconfig,
        name,
        &format!("/api/v1/namespaces/default/pods/{name}"),
        "\"kind\": \"Pod\"",
    )
}

/// From inside pod `name` (namespace `default`, a busybox image), GET `path` from the
/// cluster's API with the pod's service-account token, through the `kubernetes` Service,
/// until the answer contains `expect`; returns it.
pub fn pod_calls_its_api(kubeconfig: &Path, name: &str, path: &str, expect: &str) -> String {
    let script = format!(
        "wget -q -O - --no-check-certificate --header \"Authorization: Bearer $(cat /var/run/secrets/kubernetes.io/serviceaccount/token)\" https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT{path}"
    );
    eventually("the pod calls its API", Duration::from_secs(60), || {
        let out = kubectl(kubeconfig, &["exec", name, "--", "sh", "-c", &script]);
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        s.contains(expect).then_some(s)
    })
}

/// `kubectl get WHAT -o jsonpath=PATH` (empty when it fails).
pub fn jsonpath(kc: &Path, what: &[&str], path: &str) -> String {
    let mut args = vec!["get"];
    args.extend_from_slice(what);
    let p = format!("jsonpath={path}");
    args.extend_from_slice(&["-o", &p]);
    String::from_utf8_lossy(&kubectl(kc, &args).stdout).into_owned()
}

/// The status of condition `type_` of WHAT (empty when there is none).
pub fn condition(kc: &Path, what: &[&str], type_: &str) -> String {
    jsonpath(
        kc,
        what,
        &format!("{{.status.conditions[?(@.type==\"{type_}\")].status}}"),
    )
}

/// The admin kubeconfig of HostedCluster `default/name` (its `<name>-admin-kubeconfig`
/// Secret), written under `dir`.
pub fn hosted_kubeconfig(kc: &Path, name: &str, dir: &Path) -> PathBuf {
    use base64::Engine as _;
    let secret = jsonpath(
        kc,
        &["secret", &format!("{name}-admin-kubeconfig")],
        "{.data.kubeconfig}",
    );
    let path = dir.join(format!("{name}.kubeconfig"));
    std::fs::write(
        &path,
        base64::engine::general_purpose::STANDARD
            .decode(secret.trim())
            .expect("the admin kubeconfig"),
    )
    .expect("writing the kubeconfig");
    path
}

/// A kubeconfig for the cluster of `admin` that authenticates with `token` alone.
pub fn token_kubeconfig(admin: &Path, token: &str, path: PathBuf) -> PathBuf {
    let mut kc = kube::config::Kubeconfig::read_from(admin).unwrap();
    for a in &mut kc.auth_infos {
        a.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.to_string().into()),
            ..Default::default()
        });
    }
    std::fs::write(&path, serde_json::to_vec(&kc).unwrap()).unwrap();
    path
}

/// A token of `default/default` from the TokenRequest API (valid an hour).
pub fn request_token(hosted: &Path, dir: &Path) -> String {
    let body = dir.join("token-request.json");
    std::fs::write(
        &body,
        r#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{"expirationSeconds":3600}}"#,
    )
    .unwrap();
    let out = kubectl_ok(
        hosted,
        &[
            "create",
            "--raw",
            "/api/v1/namespaces/default/serviceaccounts/default/token",
            "-f",
            body.to_str().unwrap(),
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["status"]["token"].as_str().unwrap().to_string()
}

/// Whether `token` authenticates: `Ok(true)` answered, `Ok(false)` refused as unauthorized.
pub fn authenticates(hosted: &Path, token: &str, dir: &Path) -> bool {
    let kc = token_kubeconfig(hosted, token, dir.join("token.kubeconfig"));
    let out = kubectl(&kc, &["get", "pods", "-n", "default", "-o", "name"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success() || err.contains("Unauthorized"),
        "neither answered nor unauthorized: {err}"
    );
    out.status.success()
}

/// The first API server replica of process-runtime control plane `cluster` in `ns`
/// (`127.a.b.1`): the address its API server Service stands for (`nestplane.io/endpoint`),
/// whatever the endpoint is (the gateway, when it runs).
pub fn first_replica(kc: &Path, ns: &str, cluster: &str) -> std::net::Ipv4Addr {
    let url = jsonpath(
        kc,
        &["service", &format!("{cluster}-apiserver"), "-n", ns],
        "{.metadata.annotations.nestplane\\.io/endpoint}",
    );
    url.trim_start_matches("https://")
        .trim_end_matches(":6443")
        .parse()
        .unwrap_or_else(|e| panic!("{url:?}: {e}"))
}

/// A copy of `kubeconfig` that dials `server` itself (no `tls-server-name`), at `out`.
pub fn kubeconfig_at(kubeconfig: &Path, server: &str, out: &Path) {
    let mut kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let cluster = kc.clusters[0].cluster.as_mut().unwrap();
    cluster.server = Some(server.to_string());
    cluster.tls_server_name = None;
    std::fs::write(out, serde_saphyr::to_string(&kc).unwrap()).unwrap();
}

/// A loopback port free at the time of asking.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A client that runs `kubectl --kubeconfig kubeconfig ARGS` again and again (every
/// `pause`) until told to stop; its results: how long each took, and what a failed one said.
pub struct Asking {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Duration, Option<String>)>>,
}

impl Asking {
    pub fn start(kubeconfig: &Path, args: &'static [&'static str], pause: Duration) -> Asking {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, kubeconfig) = (stop.clone(), kubeconfig.to_path_buf());
        let thread = std::thread::spawn(move || {
            let mut results = Vec::new();
            while !flag.load(Ordering::Relaxed) && results.len() < 3000 {
                let started = Instant::now();
                let out = kubectl(&kubeconfig, args);
                let failed = (!out.status.success())
                    .then(|| String::from_utf8_lossy(&out.stderr).to_string());
                results.push((started.elapsed(), failed));
                std::thread::sleep(pause);
            }
            results
        });
        Asking { stop, thread }
    }

    /// Stop; every request it made, which must number at least `at_least`, answered.
    pub fn stop_all_answered(self, what: &str, at_least: usize) {
        self.stop.store(true, Ordering::Relaxed);
        let results = self.thread.join().unwrap();
        let failures: Vec<&String> = results.iter().filter_map(|(_, f)| f.as_ref()).collect();
        let worst = results.iter().map(|(d, _)| *d).max().unwrap_or_default();
        eprintln!(
            "{what}: {} requests, {} failed, the worst {worst:?}",
            results.len(),
            failures.len()
        );
        assert!(
            results.len() >= at_least,
            "{what}: the client ran {} times",
            results.len()
        );
        assert!(failures.is_empty(), "{what}: requests failed: {failures:?}");
    }
}
