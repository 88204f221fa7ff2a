//! Start-up overhead of nestplane against starting the same components by hand (`make
//! bench`, or `cargo build --release -p nestplane-cli --example startup_bench &&
//! target/release/examples/startup_bench [RUNS]`; 11 runs by default: on 2 cores, 5 runs gave
//! ratios as far apart as 1.03 and 1.18). Needs `NESTPLANE_BIN_DIR` (or the binaries on
//! `PATH`) like `nestplane up`.
//!
//! One management plane and one operator (process runtime, in this process) for the whole
//! run; each run does, one after the other:
//!
//! 1. nestplane: a `NestedControlPlane` is created; `nestplane_seconds` is the time from the
//!    create to `status.ready` (seen through a watch). The operator orders the start through
//!    the components' status (seed 000): API server after etcd is Ready, controller-manager
//!    and scheduler after the API server is Ready.
//! 2. The command line, environment and working directory of each of the tenant's four
//!    processes are taken from `/proc`, and its directory (certificates, kubeconfigs; not
//!    etcd's data) is copied; the tenant is deleted.
//! 3. by hand: the same binaries with the same flags and files (etcd on an empty data
//!    directory), started in the same order, each waiting until the previous one answers its
//!    health endpoint (etcd `/health`, API server `/readyz`, controller-manager and scheduler
//!    `/healthz`), polled every 50 ms with the same probe nestplane uses; `bare_seconds` is
//!    etcd's start to the last one healthy.
//!
//! Prints each run's figures, then the medians and `ratio` = median nestplane / median bare.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use nestplane_api::NestedControlPlane;
use nestplane_api::names::Component;
use nestplane_localplane::{LocalPlane, Options};
use nestplane_render::HealthEndpoint;
use nestplane_runtime::process::{TenantKey, healthy_count};

const NS: &str = "default";

/// One process as nestplane started it.
struct Captured {
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
}

fn capture(pid: u32) -> Captured {
    let split = |path: String| -> Vec<String> {
        std::fs::read(path)
            .unwrap()
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    };
    let cmdline = split(format!("/proc/{pid}/cmdline"));
    let env = split(format!("/proc/{pid}/environ"))
        .into_iter()
        .filter_map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    Captured {
        program: std::fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
        args: cmdline.into_iter().skip(1).collect(),
        env,
        cwd: std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap(),
    }
}

fn copy_dir(from: &Path, to: &Path, skip: &[PathBuf]) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if skip.iter().any(|s| p.starts_with(s)) {
            continue;
        }
        let dest = to.join(e.file_name());
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            copy_dir(&p, &dest, skip);
        } else if ft.is_file() {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

/// The value of `--flag=value`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(&format!("--{name}=")))
}

fn endpoint(c: Component, args: &[String]) -> HealthEndpoint {
    let url = match c {
        Component::Etcd => {
            let m = flag(args, "listen-metrics-urls").expect("etcd --listen-metrics-urls");
            format!("{}/health", m.split(',').next().unwrap())
        }
        Component::ApiServer => format!(
            "https://{}:{}/readyz",
            flag(args, "bind-address").expect("--bind-address"),
            flag(args, "secure-port").unwrap_or("6443")
        ),
        Component::ControllerManager | Component::Scheduler => format!(
            "https://{}:{}/healthz",
            flag(args, "bind-address").expect("--bind-address"),
            flag(args, "secure-port").expect("--secure-port")
        ),
    };
    HealthEndpoint {
        scheme_https: url.starts_with("https"),
        url,
    }
}

struct Bare(Vec<Child>);

impl Drop for Bare {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn wait_healthy(ep: &HealthEndpoint, ca: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while healthy_count(std::slice::from_ref(ep), Some(ca)).await != 1 {
        assert!(
            Instant::now() < deadline,
            "{} not healthy (logs in the bare-* directory)",
            ep.url
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Start the captured processes by hand, in seed 000's order; returns the seconds from
/// etcd's start to all healthy.
async fn bare(procs: &[(Component, Captured)], from: &Path, to: &Path, ca: &str) -> f64 {
    let rewrite = |s: &str| s.replace(&from.display().to_string(), &to.display().to_string());
    let mut running = Bare(Vec::new());
    let start = |c: Component, running: &mut Bare| -> HealthEndpoint {
        let p = &procs.iter().find(|(pc, _)| *pc == c).unwrap().1;
        let args: Vec<String> = p.args.iter().map(|a| rewrite(a)).collect();
        let log = std::fs::File::create(to.join(format!("{}.log", c.short_name()))).unwrap();
        let child = Command::new(&p.program)
            .args(&args)
            .env_clear()
            .envs(p.env.iter().map(|(k, v)| (k.clone(), rewrite(v))))
            .current_dir(rewrite(&p.cwd.display().to_string()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        running.0.push(child);
        endpoint(c, &args)
    };
    let t = Instant::now();
    let etcd = start(Component::Etcd, &mut running);
    wait_healthy(&etcd, ca).await;
    let api = start(Component::ApiServer, &mut running);
    wait_healthy(&api, ca).await;
    let cm = start(Component::ControllerManager, &mut running);
    let sched = start(Component::Scheduler, &mut running);
    wait_healthy(&cm, ca).await;
    wait_healthy(&sched, ca).await;
    let took = t.elapsed().as_secs_f64();
    drop(running);
    took
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(11);
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
    let work = tempfile::tempdir()?;
    let operator = nestplane_operator::Operator::start(
        client.clone(),
        nestplane_operator::Config {
            state_dir: work.path().join("operator"),
            ..Default::default()
        },
    );
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let (mut bares, mut nests) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let name = format!("startup-{run}");
        let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
            "kind": "NestedControlPlane",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"version": "v1.20.2"}
        }))?;
        let t = Instant::now();
        let uid = ncps
            .create(&PostParams::default(), &ncp)
            .await?
            .metadata
            .uid
            .unwrap_or_default();
        let ready = await_condition(ncps.clone(), &name, |o: Option<&NestedControlPlane>| {
            o.and_then(|n| n.status.as_ref()).is_some_and(|s| s.ready)
        });
        tokio::time::timeout(Duration::from_secs(300), ready).await??;
        let nestplane_seconds = t.elapsed().as_secs_f64();
        // Where nestplane's time went: each component's process start to healthy, as the
        // process runtime measured it; the rest is outside the components.
        let startups = operator.runtime().startup_times(&TenantKey {
            namespace: NS.into(),
            cluster: name.clone(),
        });
        let s = |c: Component| startups.get(&c).map(Duration::as_secs_f64).unwrap_or(0.0);
        let critical = s(Component::Etcd)
            + s(Component::ApiServer)
            + s(Component::ControllerManager).max(s(Component::Scheduler));

        // What nestplane ran, to run it by hand.
        let key = TenantKey {
            namespace: NS.into(),
            cluster: name.clone(),
        };
        let mut procs = Vec::new();
        for c in Component::ALL {
            let pid = operator.runtime().pids(&key, c).await[0].expect("a running replica");
            procs.push((c, capture(pid)));
        }
        // Paths go through the process's working directory (`/proc/self/cwd/…`).
        let etcd_data = flag(&procs[0].1.args, "data-dir").expect("etcd --data-dir");
        let etcd_data = match Path::new(&etcd_data).strip_prefix("/proc/self/cwd") {
            Ok(rel) => procs[0].1.cwd.join(rel),
            Err(_) => procs[0].1.cwd.join(etcd_data),
        };
        let tenant_dir = operator.runtime().tenant_dir(&key)?;
        let copy = work.path().join(format!("bare-{run}"));
        copy_dir(&tenant_dir, &copy, std::slice::from_ref(&etcd_data));
        let ca = secrets.get(&format!("{name}-ca")).await?;
        let ca = String::from_utf8(ca.data.unwrap()["tls.crt"].0.clone())?;
        ncps.delete(&name, &DeleteParams::default()).await?;
        tokio::time::timeout(
            Duration::from_secs(120),
            await_condition(ncps.clone(), &name, conditions::is_deleted(&uid)),
        )
        .await??;
        // etcd starts on an empty data directory, as nestplane's did.
        let data = etcd_data.display().to_string().replace(
            &tenant_dir.display().to_string(),
            &copy.display().to_string(),
        );
        let _ = std::fs::remove_dir_all(&data);
        std::fs::create_dir_all(&data)?;
        std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let bare_seconds = bare(&procs, &tenant_dir, &copy, &ca).await;
        println!(
            "run {}: bare_seconds={bare_seconds:.2} nestplane_seconds={nestplane_seconds:.2} (components {critical:.2}: etcd {:.2}, apiserver {:.2}, controller-manager {:.2}, scheduler {:.2}; outside them {:.2})",
            run + 1,
            s(Component::Etcd),
            s(Component::ApiServer),
            s(Component::ControllerManager),
            s(Component::Scheduler),
            nestplane_seconds - critical,
        );
        bares.push(bare_seconds);
        nests.push(nestplane_seconds);
    }
    let (b, n) = (median(&bares), median(&nests));
    println!("bare_seconds={b:.2}");
    println!("nestplane_seconds={n:.2}");
    println!("ratio={:.2}", n / b);
    operator.stop().await?;
    Ok(())
}
