//! The cost of measuring tenants on a shared datastore (`make bench`, or
//! `cargo run --release -p nestplane-cli --example quota_bench`). One etcd (the one nestplane
//! runs: TLS, client certificates, authentication on) holds N tenants (default 100), each
//! with its user, role and prefix as nestplane makes them and K keys of V bytes (defaults: 600
//! keys of 1,500 bytes, about what a fresh 1.20 tenant stores). Then the datastore
//! controller's measuring pass (`Admin::usage` of every tenant, one after another) runs R times
//! (default 5), and it prints:
//!
//! - `round_ms`: the time of one pass over all tenants (median, and the slowest);
//! - `etcd_cpu_ms_per_round`: etcd's CPU time per pass (user + system, from /proc);
//! - `client_cpu_ms_per_round`: this process's CPU time per pass;
//! - `bytes_read_per_round`: keys and values read per pass.
//!
//! `QUOTA_BENCH_TENANTS`, `QUOTA_BENCH_KEYS`, `QUOTA_BENCH_VALUE_BYTES`, `QUOTA_BENCH_ROUNDS`
//! change them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nestplane_api::datastore::{tenant_prefix, tenant_user};
use nestplane_operator::datastore::etcd::{Admin, Credentials};

fn var(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// User + system CPU time of `pid`, in milliseconds.
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command.
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks * 1000.0 / 100.0
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let tenants = var("QUOTA_BENCH_TENANTS", 100);
    let keys = var("QUOTA_BENCH_KEYS", 600);
    let value_bytes = var("QUOTA_BENCH_VALUE_BYTES", 1500);
    let rounds = var("QUOTA_BENCH_ROUNDS", 5);

    let dir = tempfile::tempdir().unwrap();
    let now = time::OffsetDateTime::now_utc();
    let ca = nestplane_pki::generate_ca("bench-etcd-ca", now).unwrap();
    let leaf = |cn: &str, usage| {
        nestplane_pki::issue(
            &ca,
            &nestplane_pki::LeafSpec {
                common_name: cn.into(),
                organizations: vec![],
                dns_names: vec![],
                ips: vec!["127.0.0.1".parse().unwrap()],
                usage,
            },
            now,
        )
        .unwrap()
    };
    let serving = leaf("etcd", nestplane_pki::Usage::ServerAndClient);
    let root = leaf("root", nestplane_pki::Usage::Client);
    let (port, peer) = (free_port(), free_port());
    let etcd_bin = nestplane_runtime::binaries::etcd("etcd").unwrap_or_else(|e| panic!("{e}"));
    let mut etcd = Command::new(&etcd_bin)
        .arg("--name=bench")
        .arg(format!("--data-dir={}", dir.path().join("data").display()))
        .arg(format!("--listen-client-urls=https://127.0.0.1:{port}"))
        .arg(format!("--advertise-client-urls=https://127.0.0.1:{port}"))
        .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
        ))
        .arg(format!("--initial-cluster=bench=http://127.0.0.1:{peer}"))
        .arg(format!(
            "--cert-file={}",
            write(dir.path(), "s.crt", &serving.cert_pem)
        ))
        .arg(format!(
            "--key-file={}",
            write(dir.path(), "s.key", &serving.key_pem)
        ))
        .arg(format!(
            "--trusted-ca-file={}",
            write(dir.path(), "ca.crt", &ca.cert_pem)
        ))
        .arg("--client-cert-auth")
        .arg(format!("--quota-backend-bytes={}", 8i64 << 30))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd runs");
    let endpoints = vec![format!("https://127.0.0.1:{port}")];
    let creds = Credentials {
        ca_pem: ca.cert_pem.clone(),
        cert_pem: root.cert_pem,
        key_pem: root.key_pem,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut admin = loop {
        if let Ok(mut a) = Admin::connect(&endpoints, &creds).await
            && a.ensure_auth().await.is_ok()
        {
            break a;
        }
        assert!(Instant::now() < deadline, "etcd did not start");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let version = Command::new(&etcd_bin).arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&version.stdout);
    println!(
        "etcd: {}",
        version.lines().next().unwrap_or_default().trim()
    );

    // Fill: each tenant's user, role and keys, written in transactions of 100 puts as root.
    let mut client = etcd_client::Client::connect(
        &endpoints,
        Some(
            etcd_client::ConnectOptions::new().with_tls(
                etcd_client::TlsOptions::new()
                    .ca_certificate(etcd_client::Certificate::from_pem(&creds.ca_pem))
                    .identity(etcd_client::Identity::from_pem(
                        &creds.cert_pem,
                        &creds.key_pem,
                    )),
            ),
        ),
    )
    .await
    .unwrap();
    let value = "v".repeat(value_bytes);
    let fill = Instant::now();
    let mut prefixes = Vec::new();
    for t in 0..tenants {
        let ns = format!("team-{t}");
        let prefix = tenant_prefix(&ns, "cluster");
        admin
            .ensure_tenant(&tenant_user(&ns, "cluster"), &prefix)
            .await
            .unwrap();
        for chunk in (0..keys).collect::<Vec<_>>().chunks(100) {
            let ops: Vec<etcd_client::TxnOp> = chunk
                .iter()
                .map(|k| {
                    etcd_client::TxnOp::put(
                        format!("{prefix}registry/objects/{k:05}"),
                        value.clone(),
                        None,
                    )
                })
                .collect();
            client
                .txn(etcd_client::Txn::new().and_then(ops))
                .await
                .unwrap();
        }
        prefixes.push(prefix);
    }
    println!(
        "filled: {tenants} tenants x {keys} keys x {value_bytes} bytes in {:.1} s",
        fill.elapsed().as_secs_f64()
    );

    let me = std::process::id();
    let mut times = Vec::new();
    let (mut etcd_cpu, mut own_cpu, mut bytes) = (0.0, 0.0, 0i64);
    for _ in 0..rounds {
        let (e0, o0) = (cpu_ms(etcd.id()), cpu_ms(me));
        let start = Instant::now();
        let mut read = 0;
        for p in &prefixes {
            read += admin.usage(p).await.unwrap().bytes;
        }
        times.push(start.elapsed().as_secs_f64() * 1000.0);
        etcd_cpu += cpu_ms(etcd.id()) - e0;
        own_cpu += cpu_ms(me) - o0;
        bytes = read;
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "round_ms: median {:.0}, slowest {:.0} ({tenants} tenants, pages of {})",
        times[times.len() / 2],
        times[times.len() - 1],
        nestplane_operator::datastore::etcd::USAGE_PAGE
    );
    println!("etcd_cpu_ms_per_round: {:.0}", etcd_cpu / rounds as f64);
    println!("client_cpu_ms_per_round: {:.0}", own_cpu / rounds as f64);
    println!("bytes_read_per_round: {bytes}");
    let _ = etcd.kill();
    let _ = etcd.wait();
}
