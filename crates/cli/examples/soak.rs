//! Soak: kill the operator at random, many times, while tenants are being created; then
//! check that every tenant converges and that no CA was ever replaced.
//!
//! `make soak` (or `cargo run --release -p nestplane-cli --example soak -- [TENANTS] [KILLS]`,
//! default 20 tenants, 100 kills). Not part of the test suite: it takes minutes and most of
//! the machine. Needs the Kubernetes binaries (`scripts/install-deps.sh`) and a release build
//! of `nestplane` (`cargo build --release -p nestplane-cli`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use nestplane_api::NestedControlPlane;
use nestplane_localplane::{LocalPlane, Options};

/// A small deterministic generator (xorshift), seeded from the clock; the seed is printed so
/// a run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

const CA_SECRETS: [&str; 4] = ["ca", "etcd", "proxy", "sa"];

/// The operator process; killed (SIGKILL) and reaped when dropped.
struct Operator(Child);

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_operator(
    bin: &std::path::Path,
    kubeconfig: &std::path::Path,
    state: &std::path::Path,
) -> Operator {
    let child = Command::new(bin)
        .args([
            "operator",
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--state-dir",
        ])
        .arg(state)
        .env("KUBECONFIG", kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nestplane operator (build it: cargo build --release -p nestplane-cli)");
    Operator(child)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let tenants: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20);
    let kills: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(100);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64
        | 1;
    let mut rng = Rng(seed);
    let bin = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("nestplane"))
        .expect("target directory");
    anyhow::ensure!(
        bin.exists(),
        "{} is missing: cargo build --release -p nestplane-cli",
        bin.display()
    );
    println!("soak: {tenants} tenants, {kills} operator kills, seed {seed}");

    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: None,
        crds: nestplane_api::crds::all(),
    })
    .await?;
    nestplane_operator::crds::install(&plane.client(), Duration::from_secs(30)).await?;
    let work = tempfile::tempdir()?;
    let kubeconfig = work.path().join("management.kubeconfig");
    std::fs::write(&kubeconfig, plane.kubeconfig())?;
    let state = work.path().join("operator");
    let client = plane.client();
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), "default");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");

    let start = Instant::now();
    let mut op = spawn_operator(&bin, &kubeconfig, &state);
    for i in 0..tenants {
        let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
            "kind": "NestedControlPlane",
            "metadata": {"name": format!("soak-{i}"), "namespace": "default"},
            "spec": {"version": "v1.20.2"}
        }))?;
        ncps.create(&PostParams::default(), &ncp).await?;
    }

    // The first time each CA is seen, it is recorded; every later sighting must match.
    let mut first_seen: BTreeMap<String, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    let mut replaced = Vec::new();
    let check_cas = async |first_seen: &mut BTreeMap<String, BTreeMap<String, Vec<u8>>>,
                           replaced: &mut Vec<String>| {
        for i in 0..tenants {
            for ca in CA_SECRETS {
                let name = format!("soak-{i}-{ca}");
                let Ok(Some(s)) = secrets.get_opt(&name).await else {
                    continue;
                };
                let data: BTreeMap<String, Vec<u8>> = s
                    .data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect();
                match first_seen.get(&name) {
                    None => {
                        first_seen.insert(name, data);
                    }
                    Some(before) if *before != data => replaced.push(name),
                    Some(_) => {}
                }
            }
        }
    };

    for k in 1..=kills {
        tokio::time::sleep(Duration::from_millis(rng.between(200, 3000))).await;
        drop(op); // SIGKILL: no chance to clean up
        check_cas(&mut first_seen, &mut replaced).await;
        op = spawn_operator(&bin, &kubeconfig, &state);
        if k % 10 == 0 {
            println!(
                "  {k} kills after {:.0}s; {} CA secrets seen, {} replaced",
                start.elapsed().as_secs_f64(),
                first_seen.len(),
                replaced.len()
            );
        }
    }
    let kill_phase = start.elapsed();

    // Now let it run: every tenant must become ready.
    let deadline = Instant::now() + Duration::from_secs(900);
    let ready = loop {
        let list = ncps.list(&Default::default()).await?;
        let ready = list
            .items
            .iter()
            .filter(|n| n.status.as_ref().is_some_and(|s| s.ready))
            .count();
        if ready == tenants || Instant::now() > deadline {
            break ready;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let converged = start.elapsed() - kill_phase;
    check_cas(&mut first_seen, &mut replaced).await;
    drop(op);

    println!(
        "soak: {kills} kills in {:.0}s; then {ready}/{tenants} tenants ready after {:.0}s",
        kill_phase.as_secs_f64(),
        converged.as_secs_f64()
    );
    println!(
        "soak: {} CA secrets checked after every kill, {} replaced{}",
        first_seen.len(),
        replaced.len(),
        if replaced.is_empty() {
            String::new()
        } else {
            format!(": {replaced:?}")
        }
    );
    anyhow::ensure!(ready == tenants, "not every tenant converged");
    anyhow::ensure!(
        first_seen.len() == tenants * CA_SECRETS.len(),
        "not every CA was created"
    );
    anyhow::ensure!(replaced.is_empty(), "a CA was replaced");
    println!("soak: ok");
    Ok(())
}
