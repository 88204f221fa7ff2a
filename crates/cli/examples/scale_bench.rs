//! Benchmark of one operator with many control planes (`make bench`, or
//! `cargo build --release -p nestplane-cli --bin nestplane --example scale_bench &&
//! target/release/examples/scale_bench [TENANTS] [STEADY_SECONDS]`; 1,000 tenants and 60 s by
//! default).
//!
//! A local management plane (etcd, kube-apiserver, kube-controller-manager; no nodes) and the
//! release `nestplane operator --runtime kubernetes` as its own process. TENANTS
//! `NestedControlPlane`s are created (16 at a time) in namespace `scale`. There are no nodes,
//! so no pod runs and etcd never becomes Ready; the API server, controller-manager and
//! scheduler rightly wait for it (seed 000's order), so their workloads are never made. What
//! a tenant can have without nodes, and what is counted as "in place" here, per tenant:
//!
//! - its four component objects (`NestedEtcd`, `NestedAPIServer`, `NestedControllerManager`,
//!   `NestedScheduler`), created by the operator;
//! - the secrets etcd's certificate plan issues (the etcd CA, etcd's serving and peer
//!   certificates), counted by the tenant's cluster-name label;
//! - etcd's Services (client and headless peer) and its StatefulSet.
//!
//! Prints:
//!
//! - `objects_in_place_seconds`: first create to every tenant having all of the above (looked
//!   at every 0.5 s, in lists of metadata from the API server's watch cache);
//! - `operator_peak_rss_mib`: the operator's peak resident memory (`VmHWM`) over the whole
//!   run, and `operator_rss_mib` at the end;
//! - `settle_seconds`: after that, until the operator made no write for 10 s (at most 120 s);
//! - over the next STEADY_SECONDS: `operator_writes` (POST, PUT, PATCH, DELETE in the
//!   operator's own `nestplane_api_requests_total`), `operator_reads`, and
//!   `apiserver_writes` from the API server's `apiserver_request_total` (every client: the
//!   controller-manager's lease renewals are in it, hence the breakdown by verb and resource
//!   that follows).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use kube::api::{Api, ListParams, PostParams};
use kube::core::PartialObjectMeta;
use nestplane_api::names::{CLUSTER_NAME_LABEL, MANAGED_BY, MANAGED_BY_LABEL};
use nestplane_api::{
    NestedAPIServer, NestedControlPlane, NestedControllerManager, NestedEtcd, NestedScheduler,
};
use nestplane_localplane::{LocalPlane, Options};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NS: &str = "scale";
/// etcd's Services per tenant: client and headless peer.
const ETCD_SERVICES: usize = 2;
/// etcd's secrets per tenant: the etcd CA, the serving and the peer certificate (the names of
/// one tenant's are printed).
const ETCD_SECRETS: usize = 3;

struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// User + system CPU seconds of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which is in parentheses): utime and stime are 14th and 15th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // 100 ticks a second on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

async fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

/// Sum of a counter's samples by the values of `labels` (joined by a space), over the lines of
/// `metric`.
fn by_label(text: &str, metric: &str, labels: &[&str]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(metric) else {
            continue;
        };
        let Some(rest) = rest.strip_prefix('{') else {
            continue;
        };
        let Some((found, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(v) = value.split_whitespace().next().unwrap_or("").parse::<f64>() else {
            continue;
        };
        let key: Vec<String> = labels
            .iter()
            .map(|label| {
                found
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{label}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
                    .unwrap_or_default()
            })
            .collect();
        *out.entry(key.join(" ")).or_insert(0.0) += v;
    }
    out
}

/// apiserver_request_total by (verb, resource).
fn apiserver_requests(text: &str) -> BTreeMap<(String, String), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let get = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_string())
                .unwrap_or_default()
        };
        let mut resource = get("resource");
        let sub = get("subresource");
        if !sub.is_empty() {
            resource = format!("{resource}/{sub}");
        }
        *out.entry((get("verb"), resource)).or_insert(0.0) += v;
    }
    out
}

fn is_write(verb: &str) -> bool {
    matches!(
        verb,
        "POST" | "PUT" | "PATCH" | "DELETE" | "APPLY" | "CREATE" | "UPDATE" | "DELETECOLLECTION"
    )
}

fn writes(by_method: &BTreeMap<String, f64>) -> f64 {
    by_method
        .iter()
        .filter(|(m, _)| is_write(m))
        .map(|(_, v)| v)
        .sum()
}

fn reads(by_method: &BTreeMap<String, f64>) -> f64 {
    by_method
        .iter()
        .filter(|(m, _)| !is_write(m))
        .map(|(_, v)| v)
        .sum()
}

/// Tenants (by cluster label) with every object in place, and the secrets' names of one.
async fn in_place(client: &kube::Client, tenants: usize) -> (usize, Vec<String>) {
    // Metadata from the API server's watch cache (`resourceVersion=0`): looking costs the API
    // server little, so the benchmark measures the operator rather than itself (a list from
    // etcd decodes every object: with 1,000 tenants, 9 % of the API server's CPU).
    let lp = ListParams::default()
        .labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"))
        .match_any();
    fn count<K>(items: Vec<PartialObjectMeta<K>>) -> BTreeMap<String, usize> {
        let mut m: BTreeMap<String, usize> = BTreeMap::new();
        for o in items {
            if let Some(c) = o
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(CLUSTER_NAME_LABEL))
            {
                *m.entry(c.clone()).or_default() += 1;
            }
        }
        m
    }
    async fn names<K>(client: &kube::Client) -> BTreeMap<String, usize>
    where
        K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(client.clone(), NS);
        let mut m = BTreeMap::new();
        for o in api
            .list_metadata(&ListParams::default().match_any())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            // Component objects are named <cluster>-<component>.
            if let Some(owner) = o
                .metadata
                .owner_references
                .iter()
                .flatten()
                .find(|r| r.kind == "NestedControlPlane")
            {
                *m.entry(owner.name.clone()).or_insert(0) += 1;
            }
        }
        m
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), NS)
        .list_metadata(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    let sample: Vec<String> = {
        let first = secrets
            .iter()
            .filter_map(|s| s.metadata.labels.as_ref()?.get(CLUSTER_NAME_LABEL).cloned())
            .min();
        let mut v: Vec<String> = secrets
            .iter()
            .filter(|s| {
                first.is_some()
                    && s.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get(CLUSTER_NAME_LABEL))
                        == first.as_ref()
            })
            .map(|s| s.metadata.name.clone().unwrap_or_default())
            .collect();
        v.sort();
        v
    };
    let secrets = count(secrets);
    let services = count(
        Api::<Service>::namespaced(client.clone(), NS)
            .list_metadata(&lp)
            .await
            .map(|l| l.items)
            .unwrap_or_default(),
    );
    let sets = count(
        Api::<StatefulSet>::namespaced(client.clone(), NS)
            .list_metadata(&lp)
            .await
            .map(|l| l.items)
            .unwrap_or_default(),
    );
    let components = [
        names::<NestedEtcd>(client).await,
        names::<NestedAPIServer>(client).await,
        names::<NestedControllerManager>(client).await,
        names::<NestedScheduler>(client).await,
    ];
    let done = (0..tenants)
        .filter(|i| {
            let c = format!("t{i}");
            secrets.get(&c).copied().unwrap_or(0) >= ETCD_SECRETS
                && services.get(&c).copied().unwrap_or(0) >= ETCD_SERVICES
                && sets.get(&c).copied().unwrap_or(0) >= 1
                && components
                    .iter()
                    .all(|m| m.get(&c).copied().unwrap_or(0) >= 1)
        })
        .count();
    (done, sample)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let tenants: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let steady: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(60);
    let bin = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("nestplane"))
        .expect("target directory");
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p nestplane-cli --bin nestplane",
        bin.display()
    );
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: None,
        crds: nestplane_api::crds::all(),
    })
    .await?;
    let client = plane.client();
    nestplane_operator::crds::install(&client, Duration::from_secs(30)).await?;
    let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": NS}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let work = tempfile::tempdir()?;
    let kubeconfig = work.path().join("management.kubeconfig");
    std::fs::write(&kubeconfig, plane.kubeconfig())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let log = std::fs::File::create(work.path().join("operator.log"))?;
    let op = Operator(
        Command::new(&bin)
            .args([
                "operator",
                "--runtime",
                "kubernetes",
                "--metrics-bind-address",
                &metrics_addr,
                "--state-dir",
            ])
            .arg(work.path().join("state"))
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
    );
    let pid = op.0.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(&metrics_addr, "/readyz")
        .await
        .as_deref()
        .map(str::trim)
        != Some("ok")
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the operator did not start in 30 s; its log:\n{}",
            std::fs::read_to_string(work.path().join("operator.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("scale: {tenants} NestedControlPlanes, kubernetes runtime, no nodes");

    let cpu_before: Vec<(String, u32, f64)> = plane
        .pids()
        .into_iter()
        .map(|(name, p)| (name, p, cpu_seconds(p)))
        .collect();
    let op_cpu_before = cpu_seconds(pid);
    let started = Instant::now();
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), NS);
    let gate = Arc::new(tokio::sync::Semaphore::new(16));
    let mut creates = tokio::task::JoinSet::new();
    for i in 0..tenants {
        let ncps = ncps.clone();
        let permit = gate.clone().acquire_owned().await?;
        creates.spawn(async move {
            let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
                "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                "kind": "NestedControlPlane",
                "metadata": {"name": format!("t{i}"), "namespace": NS},
                "spec": {"version": "v1.20.2"}
            }))
            .unwrap();
            let r = ncps.create(&PostParams::default(), &ncp).await;
            drop(permit);
            r.map(|_| ())
        });
    }
    while let Some(r) = creates.join_next().await {
        r??;
    }
    println!("created_seconds={:.2}", started.elapsed().as_secs_f64());
    let sample;
    loop {
        let (done, s) = in_place(&client, tenants).await;
        if done == tenants {
            sample = s;
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(1800),
            "only {done}/{tenants} tenants have every object after 30 minutes (operator log: {})",
            work.path().join("operator.log").display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "objects_in_place_seconds={:.2}",
        started.elapsed().as_secs_f64()
    );
    let text = http_get(&metrics_addr, "/metrics")
        .await
        .unwrap_or_default();
    let during = by_label(&text, "nestplane_api_requests_total", &["method"]);
    println!(
        "  operator requests until then: {}",
        during
            .iter()
            .map(|(m, v)| format!("{m}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "  of which by resource: {}",
        by_label(
            &text,
            "nestplane_api_requests_total",
            &["method", "resource"]
        )
        .iter()
        .map(|(m, v)| format!("{m}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
    );
    // What was busy meanwhile: CPU seconds of each process over the creation.
    let mut busy: Vec<String> = cpu_before
        .iter()
        .map(|(name, pid, before)| {
            format!(
                "{name}={:.0}%",
                (cpu_seconds(*pid) - before) * 100.0 / started.elapsed().as_secs_f64()
            )
        })
        .collect();
    busy.push(format!(
        "operator={:.0}%",
        (cpu_seconds(pid) - op_cpu_before) * 100.0 / started.elapsed().as_secs_f64()
    ));
    println!("  cpu (of one core) until then: {}", busy.join(" "));
    println!(
        "  (per tenant: 4 component objects, etcd's StatefulSet, {ETCD_SERVICES} Services, {ETCD_SECRETS} secrets: {})",
        sample.join(" ")
    );

    let operator_methods = async || {
        by_label(
            &http_get(&metrics_addr, "/metrics")
                .await
                .unwrap_or_default(),
            "nestplane_api_requests_total",
            &["method"],
        )
    };
    let apiserver = async || {
        apiserver_requests(
            &client
                .request_text(nestplane_localplane::http_get("/metrics").unwrap())
                .await
                .unwrap_or_default(),
        )
    };
    // Settle: until the operator made no write for 10 s.
    let settle_start = Instant::now();
    let mut last = writes(&operator_methods().await);
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < Duration::from_secs(10)
        && settle_start.elapsed() < Duration::from_secs(120)
    {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = writes(&operator_methods().await);
        if now != last {
            last = now;
            quiet_since = Instant::now();
        }
    }
    println!("settle_seconds={:.1}", settle_start.elapsed().as_secs_f64());

    let op_before = operator_methods().await;
    let api_before = apiserver().await;
    tokio::time::sleep(Duration::from_secs(steady)).await;
    let op_after = operator_methods().await;
    let api_after = apiserver().await;
    let delta = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| -> BTreeMap<String, f64> {
        a.iter()
            .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
            .collect()
    };
    let op_delta = delta(&op_after, &op_before);
    println!("steady_window_seconds={steady}");
    println!("operator_writes={}", writes(&op_delta));
    println!("operator_reads={}", reads(&op_delta));
    let mut api_writes = 0.0;
    let mut breakdown = Vec::new();
    for ((verb, resource), v) in &api_after {
        let d = v - api_before
            .get(&(verb.clone(), resource.clone()))
            .copied()
            .unwrap_or(0.0);
        if d > 0.0 && is_write(verb) {
            api_writes += d;
            breakdown.push(format!("{verb} {resource}: {d}"));
        }
    }
    println!("apiserver_writes={api_writes}");
    for b in breakdown {
        println!("  {b}");
    }
    println!(
        "operator_peak_rss_mib={:.1}",
        status_kib(pid, "VmHWM:") as f64 / 1024.0
    );
    println!(
        "operator_rss_mib={:.1}",
        status_kib(pid, "VmRSS:") as f64 / 1024.0
    );
    drop(op);
    Ok(())
}
