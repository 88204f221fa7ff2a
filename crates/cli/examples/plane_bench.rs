//! What a management plane costs before nestplane's CRDs are served (`make bench`, or `cargo
//! build --release -p nestplane-cli --example plane_bench &&
//! target/release/examples/plane_bench [RUNS]`; 5 runs of each way by default). Every test
//! with a management plane pays it, as does `nestplane up`.
//!
//! Alternately, a plane is started (etcd, kube-apiserver, kube-controller-manager, as the
//! tests start it) and nestplane's CRDs are installed through the API, as a user would:
//!
//! - `installed`: the plane starts empty, the CRDs are created once it is ready;
//! - `stored`: the plane stores the CRDs in etcd before its API server starts
//!   (`Options::crds`), then the same install runs (it changes only the field owners).
//!
//! For each, `seconds` is the plane's start to every CRD Established, and `apiserver_cpu` the
//! kube-apiserver's CPU-seconds until then and until 10 s later (the OpenAPI work a CRD
//! causes goes on after the CRD is served). Prints each run, then the medians.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use nestplane_localplane::{LocalPlane, Options};

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One start: (seconds to the CRDs served, API server CPU then, API server CPU 10 s later).
async fn run(stored: bool) -> (f64, f64, f64) {
    let started = Instant::now();
    let mut plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: None,
        crds: if stored {
            nestplane_api::crds::all()
        } else {
            vec![]
        },
    })
    .await
    .expect("management plane");
    nestplane_operator::crds::install(&plane.client(), Duration::from_secs(60))
        .await
        .expect("CRDs");
    let seconds = started.elapsed().as_secs_f64();
    let apiserver = plane
        .pids()
        .into_iter()
        .find(|(name, _)| name == "kube-apiserver")
        .map(|(_, pid)| pid)
        .expect("the API server's pid");
    let served = cpu_seconds(apiserver);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let later = cpu_seconds(apiserver);
    plane.stop();
    (seconds, served, later)
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let mut figures: [Vec<(f64, f64, f64)>; 2] = [vec![], vec![]];
    for i in 0..runs {
        for (way, stored) in [(0, false), (1, true)] {
            let got = run(stored).await;
            println!(
                "run {i} {}: seconds {:.1} apiserver_cpu {:.1} (+10 s: {:.1})",
                if stored { "stored" } else { "installed" },
                got.0,
                got.1,
                got.2
            );
            figures[way].push(got);
        }
    }
    for (way, name) in [(0, "installed"), (1, "stored")] {
        let f = &figures[way];
        println!(
            "{name}: seconds {:.1} apiserver_cpu {:.1} apiserver_cpu_10s_later {:.1} (medians of {runs})",
            median(f.iter().map(|x| x.0).collect()),
            median(f.iter().map(|x| x.1).collect()),
            median(f.iter().map(|x| x.2).collect()),
        );
    }
}
