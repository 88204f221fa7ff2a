//! Benchmark of the built-in cluster DNS server (`make bench`, or `cargo run --release
//! --example dns_bench` after `cargo build --release`). A management plane gets 1,000
//! Services: 200 with a cluster IP (its service range is a /24) and 800 headless ones with an
//! endpoint each; `nestplane dns` serves them on loopback; Debian's `dnsperf` asks for in-zone
//! names (A for both kinds and for endpoint hostnames, SRV for named ports, names that do not
//! exist). Prints:
//!
//! - `dns_queries_per_second`: dnsperf's figure over 15 s, 20 queries in flight;
//! - `dns_p99_latency_ms`: the 99th percentile of every answer's latency in a second run;
//! - `dns_rss_mib`: the server's resident memory with the 1,000 Services (after the runs);
//! - `dns_lost_queries`: queries dnsperf got no answer for;
//! - `dns_response_codes`: what the answers were (NXDOMAIN for the names that do not exist,
//!   NOERROR for the rest).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use kube::Api;
use kube::api::PostParams;
use nestplane_localplane::{LocalPlane, Options};

const SERVICES: usize = 1000;
/// Of which have a cluster IP.
const CLUSTER_IP: usize = 200;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
    serde_json::from_value(v).unwrap()
}

fn dnsperf(port: u16, queries: &std::path::Path, verbose: bool) -> String {
    let mut cmd = Command::new("dnsperf");
    cmd.args(["-s", "127.0.0.1", "-p", &port.to_string(), "-l", "15"])
        .args(["-c", "4", "-q", "20", "-T", "1"])
        .arg("-d")
        .arg(queries);
    if verbose {
        cmd.arg("-v");
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .expect("dnsperf not found: run scripts/install-deps.sh");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn figure<'a>(report: &'a str, label: &str) -> &'a str {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .map(str::trim)
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or("?")
}

/// Whether `/readyz` on `port` answers 200.
async fn ready(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").await.is_err() {
        return false;
    }
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf).await;
    buf.starts_with("HTTP/1.1 200")
}

#[tokio::main]
async fn main() {
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: false,
        disabled_controllers: vec![],
        nodes: None,
        crds: vec![],
    })
    .await
    .expect("management plane");
    let client = plane.client();
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &obj(serde_json::json!({"metadata": {"name": "bench"}})),
        )
        .await
        .unwrap();
    let services: Api<Service> = Api::namespaced(client.clone(), "bench");
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "bench");
    let started = Instant::now();
    // 16 at a time.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..SERVICES {
        let (services, endpoints) = (services.clone(), endpoints.clone());
        tasks.spawn(async move {
            let ports = serde_json::json!([{"name": "http", "port": 80, "protocol": "TCP"}]);
            if i < CLUSTER_IP {
                services
                    .create(
                        &PostParams::default(),
                        &obj(serde_json::json!({
                            "metadata": {"name": format!("svc-{i}")},
                            "spec": {"ports": ports}})),
                    )
                    .await
                    .unwrap();
                return;
            }
            services
                .create(
                    &PostParams::default(),
                    &obj(serde_json::json!({
                        "metadata": {"name": format!("hl-{i}")},
                        "spec": {"clusterIP": "None", "ports": ports}})),
                )
                .await
                .unwrap();
            endpoints
                .create(
                    &PostParams::default(),
                    &obj(serde_json::json!({
                        "metadata": {"name": format!("hl-{i}")},
                        "subsets": [{
                            "addresses": [{"ip": format!("10.244.{}.{}", i / 250, i % 250 + 2), "hostname": "p-0"}],
                            "ports": [{"name": "http", "port": 8080}]
                        }]})),
                )
                .await
                .unwrap();
        });
        if tasks.len() >= 16 {
            tasks
                .join_next()
                .await
                .unwrap()
                .expect("creating a Service");
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("creating a Service");
    }
    eprintln!(
        "dns_bench: {SERVICES} Services made in {:.1}s",
        started.elapsed().as_secs_f64()
    );

    let (port, health) = (free_port(), free_port());
    // target/<profile>/examples/dns_bench → target/<profile>/nestplane
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|p| p.parent())
        .unwrap()
        .join("nestplane");
    let mut server = Command::new(&bin)
        .args(["dns", "--zone", "cluster.local", "--upstream", "none"])
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--health=127.0.0.1:{health}"))
        .env("KUBECONFIG", plane.kubeconfig_path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nestplane dns");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready(health).await {
        assert!(Instant::now() < deadline, "the DNS server is not ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let dir = tempfile::tempdir().unwrap();
    let queries = dir.path().join("queries");
    let mut f = std::fs::File::create(&queries).unwrap();
    for i in 0..SERVICES {
        if i < CLUSTER_IP {
            writeln!(f, "svc-{i}.bench.svc.cluster.local A").unwrap();
            writeln!(f, "_http._tcp.svc-{i}.bench.svc.cluster.local SRV").unwrap();
        } else {
            writeln!(f, "hl-{i}.bench.svc.cluster.local A").unwrap();
            writeln!(f, "p-0.hl-{i}.bench.svc.cluster.local A").unwrap();
        }
        if i % 10 == 0 {
            writeln!(f, "nope-{i}.bench.svc.cluster.local A").unwrap();
        }
    }
    drop(f);

    let report = dnsperf(port, &queries, false);
    let qps = figure(&report, "Queries per second:");
    let lost = figure(&report, "Queries lost:");
    let verbose = dnsperf(port, &queries, true);
    let mut latencies: Vec<f64> = verbose
        .lines()
        .filter(|l| l.starts_with("> "))
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect();
    latencies.sort_by(|a, b| a.total_cmp(b));
    let p99 = latencies
        .get(latencies.len() * 99 / 100)
        .copied()
        .unwrap_or(f64::NAN);
    let rss = rss_kib(server.id());
    let _ = server.kill();
    let _ = server.wait();
    println!("dns_queries_per_second {qps}");
    println!("dns_p99_latency_ms {:.3}", p99 * 1000.0);
    println!("dns_rss_mib {:.1}", rss as f64 / 1024.0);
    println!("dns_lost_queries {lost}");
    let codes = report
        .lines()
        .find_map(|l| l.trim().strip_prefix("Response codes:"))
        .unwrap_or("?")
        .trim();
    println!("dns_response_codes {codes}");
    println!("dns_services {SERVICES}");
}
