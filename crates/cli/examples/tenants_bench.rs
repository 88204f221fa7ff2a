//! Memory per tenant (`make bench`, or `cargo run --release --example tenants_bench` after
//! `cargo build --release -p nestplane-cli --bin nestplane`). A local management plane and the
//! release operator (`nestplane operator --runtime process`, a process of its own) run N
//! tenants, N = 1, 10, 30 (added to those already running), first each with an etcd of its
//! own, then all on one shared `NestedDatastore`. Once every tenant is Ready and 20 s have
//! passed, it prints, per mode and N:
//!
//! - `tenant_rss_mib`: resident memory per tenant, the sum over its processes (etcd, API
//!   server, controller-manager, scheduler), averaged over the N tenants; on a shared
//!   datastore, the datastore's etcd is divided among them (`datastore_rss_mib` is its whole);
//! - `tenant_pss_mib`: the same as proportional set size, where pages shared between
//!   processes (the binaries' text) count once in all;
//! - `operator_rss_mib`: the operator's resident memory;
//! - `tenant_pss_mib by program`: what the tenant's PSS is made of (the datastore's etcd not
//!   included).
//!
//! `TENANTS_BENCH_SIZES=1,5` changes the sizes, `TENANTS_BENCH_MODES=shared` the modes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use nestplane_api::NestedControlPlane;
use nestplane_localplane::{LocalPlane, Options};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Proportional resident memory: pages shared with other processes (the binaries' text, which
/// every tenant's API server maps) are divided among them.
fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The processes of tenant `name` (its replicas' pid files).
fn tenant_pids(state: &Path, name: &str) -> Vec<u32> {
    let dir = state.join("tenants").join("default").join(name);
    std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("pid")).ok())
        .filter_map(|p| p.trim().parse::<u32>().ok())
        .collect()
}

/// Summed (RSS, PSS) of the processes of the named tenants.
fn memory_kib(state: &Path, names: &[String]) -> (u64, u64) {
    names
        .iter()
        .flat_map(|t| tenant_pids(state, t))
        .map(|p| (rss_kib(p), pss_kib(p)))
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// PSS of the named tenants' processes by program (`/proc/<pid>/comm`).
fn pss_by_program(state: &Path, names: &[String]) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for p in names.iter().flat_map(|t| tenant_pids(state, t)) {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        *out.entry(comm.trim().to_string()).or_insert(0) += pss_kib(p);
    }
    out
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        // SIGTERM: the operator stops its tenants' processes before it exits.
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

async fn wait_ready(ncps: &Api<NestedControlPlane>, names: &[String], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let list = ncps.list(&ListParams::default()).await.unwrap();
        let ready = list
            .items
            .iter()
            .filter(|n| names.contains(&n.metadata.name.clone().unwrap_or_default()))
            .filter(|n| n.status.as_ref().is_some_and(|s| s.ready))
            .count();
        if ready == names.len() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{ready}/{} tenants ready after {timeout:?}",
            names.len()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn wait_datastore_ready(client: &kube::Client) {
    let api: Api<nestplane_api::NestedDatastore> = Api::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !api
        .get_opt("bench")
        .await
        .unwrap()
        .and_then(|d| d.status)
        .is_some_and(|s| s.ready)
    {
        assert!(Instant::now() < deadline, "the datastore is not Ready");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::main]
async fn main() {
    let sizes: Vec<usize> = std::env::var("TENANTS_BENCH_SIZES")
        .unwrap_or_else(|_| "1,10,30".into())
        .split(',')
        .map(|s| s.trim().parse().expect("sizes: numbers"))
        .collect();
    let nestplane =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/nestplane");
    assert!(
        nestplane.exists(),
        "build it first: cargo build --release -p nestplane-cli --bin nestplane"
    );
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: false,
        disabled_controllers: vec![],
        nodes: None,
        crds: nestplane_api::crds::all(),
    })
    .await
    .expect("management plane");
    let client = plane.client();
    nestplane_operator::crds::install(&client, Duration::from_secs(30))
        .await
        .expect("CRDs");
    let state = tempfile::tempdir().unwrap();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let operator = Operator(
        Command::new(&nestplane)
            .args(["operator", "--runtime", "process", "--leader-elect=false"])
            .arg("--state-dir")
            .arg(state.path())
            .arg(format!("--metrics-bind-address={metrics}"))
            .env("KUBECONFIG", plane.kubeconfig_path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nestplane operator"),
    );
    let op_pid = operator.0.id();
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), "default");
    let modes = std::env::var("TENANTS_BENCH_MODES").unwrap_or_else(|_| "own,shared".into());
    for shared in [false, true] {
        if !modes
            .split(',')
            .any(|m| m.trim() == if shared { "shared" } else { "own" })
        {
            continue;
        }
        let mode = if shared { "shared" } else { "own" };
        let prefix = if shared { "s" } else { "o" };
        if shared {
            let ds: nestplane_api::NestedDatastore = serde_json::from_value(serde_json::json!({
                "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                "kind": "NestedDatastore",
                "metadata": {"name": "bench", "namespace": "default"},
                "spec": {"managed": {"replicas": 1}},
            }))
            .unwrap();
            Api::namespaced(client.clone(), "default")
                .create(&PostParams::default(), &ds)
                .await
                .unwrap();
            wait_datastore_ready(&client).await;
        }
        let mut names: Vec<String> = Vec::new();
        for &n in &sizes {
            let started = Instant::now();
            while names.len() < n {
                let name = format!("{prefix}{}", names.len());
                let mut spec = serde_json::json!({"version": "v1.20.2"});
                if shared {
                    spec["datastoreRef"] = serde_json::json!({"name": "bench"});
                }
                let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
                    "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                    "kind": "NestedControlPlane",
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": spec,
                }))
                .unwrap();
                ncps.create(&PostParams::default(), &ncp).await.unwrap();
                names.push(name);
            }
            wait_ready(&ncps, &names, Duration::from_secs(60 * 15)).await;
            let ready_s = started.elapsed().as_secs_f64();
            tokio::time::sleep(Duration::from_secs(20)).await;
            let (rss, pss) = memory_kib(state.path(), &names);
            let (ds_rss, ds_pss) = if shared {
                memory_kib(state.path(), &["bench-datastore".to_string()])
            } else {
                (0, 0)
            };
            let per = |kib: u64| mib(kib) / n as f64;
            println!(
                "mode={mode} tenants={n} tenant_rss_mib={:.1} tenant_pss_mib={:.1} datastore_rss_mib={:.1} operator_rss_mib={:.1} added_ready_seconds={ready_s:.1}",
                per(rss + ds_rss),
                per(pss + ds_pss),
                mib(ds_rss),
                mib(rss_kib(op_pid)),
            );
            // What the per-tenant figure is made of.
            let parts: Vec<String> = pss_by_program(state.path(), &names)
                .iter()
                .map(|(program, kib)| format!("{program}={:.1}", per(*kib)))
                .collect();
            println!("  tenant_pss_mib by program: {}", parts.join(" "));
        }
        // Make room for the next mode.
        for name in &names {
            let _ = ncps.delete(name, &DeleteParams::default()).await;
        }
        let deadline = Instant::now() + Duration::from_secs(300);
        while !ncps
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
        {
            assert!(Instant::now() < deadline, "tenants not deleted");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    drop(operator);
}
