//! Benchmark of real nodes (`make bench`, or `cargo run --release --example nodes_bench`
//! after `nestplane images build`). Prints:
//!
//! - `node_ready_seconds`: a node's start (slot, namespaces, containerd, images, kubelet) to
//!   its Node being `Ready` in a management plane, by bootstrap token;
//! - `idle_node_rss_mib`: resident memory of one idle node (containerd + kubelet +
//!   kube-proxy), 20 s after it is Ready;
//! - `kubernetes_runtime_ready_seconds`: a `NestedControlPlane` applied to the tenant being
//!   Ready in the `kubernetes` runtime, its etcd, API server, controller-manager and scheduler
//!   pods on a real node.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;
use nestplane_api::NestedControlPlane;
use nestplane_localplane::{LocalPlane, NodeOptions, Options};
use nestplane_nodes::{join, node};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

async fn node_ready(client: &kube::Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    loop {
        if let Ok(Some(n)) = nodes.get_opt(name).await
            && n.status
                .and_then(|s| s.conditions)
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::main]
async fn main() {
    let dir = nestplane_nodes::images::default_dir();
    let images: Vec<_> = std::fs::read_dir(&dir)
        .expect("images (run `nestplane images build`)")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(".oci.tar"))
        .collect();
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: Some(NodeOptions {
            count: 1,
            images: images.clone(),
            dns_image: Some(nestplane_nodes::images::OPERATOR_IMAGE.into()),
        }),
        crds: nestplane_api::crds::all(),
    })
    .await
    .expect("management plane with a node");
    let client = plane.client();

    // A second node, timed from its start to Ready.
    let token = join::BootstrapToken::generate();
    join::prepare(&client, &token, Duration::from_secs(3600))
        .await
        .unwrap();
    let port: u16 = plane.server().rsplit(':').next().unwrap().parse().unwrap();
    let work = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let seen = tokio::spawn(nestplane_nodes::timeline::observe(
        client.clone(),
        nestplane_nodes::timeline::Nodes::Named("bench-node".into()),
        started,
        Duration::from_secs(300),
    ));
    let n = node::Node::start(node::NodeConfig {
        name: "bench-node".into(),
        dir: work.path().join("bench-node"),
        ca_pem: plane.ca_pem().into(),
        token: token.token(),
        apiservers: vec![std::net::SocketAddr::from(([127, 0, 0, 1], port))],
        api_port: port,
        images: images
            .iter()
            .filter(|p| p.to_string_lossy().contains("pause"))
            .cloned()
            .collect(),
        pause_image: "registry.k8s.io/pause:3.2".into(),
        spec: nestplane_nodes::config::NodeSpec {
            version: "v1.20.2".into(),
            // Nothing is scheduled here: the node is removed below.
            taints: vec!["nestplane.io/bench=true:NoSchedule".into()],
            ..Default::default()
        },
        cluster: Default::default(),
        group: None,
        control_plane_user: None,
        guard: None,
        tunnel: None,
        entry: None,
        slot: None,
    })
    .await
    .expect("node");
    node_ready(&client, "bench-node").await;
    println!("node_ready_seconds={:.2}", started.elapsed().as_secs_f64());
    let mut steps: Vec<(String, Duration)> = n
        .timeline()
        .iter()
        .map(|(w, d)| (w.to_string(), *d))
        .collect();
    steps.extend(seen.await.unwrap_or_default());
    println!(
        "node_ready_timeline: {}",
        nestplane_nodes::timeline::format(&steps)
    );
    tokio::time::sleep(Duration::from_secs(20)).await;
    let kib: u64 = n.pids().into_iter().map(rss_kib).sum();
    println!("idle_node_rss_mib={:.1}", kib as f64 / 1024.0);
    n.remove().await.expect("node removed");
    let _ = Api::<Node>::all(client.clone())
        .delete("bench-node", &Default::default())
        .await;

    // A tenant in the kubernetes runtime, on the plane's node.
    nestplane_operator::crds::install(&client, Duration::from_secs(30))
        .await
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let operator = nestplane_operator::Operator::start(
        client.clone(),
        nestplane_operator::Config {
            state_dir: state.path().to_path_buf(),
            mode: nestplane_operator::Mode::Kubernetes(Default::default()),
            ..Default::default()
        },
    );
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), "default");
    let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
        "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
        "kind": "NestedControlPlane",
        "metadata": {"name": "bench", "namespace": "default"},
        "spec": {"version": "v1.20.2"}
    }))
    .unwrap();
    let started = Instant::now();
    ncps.create(&PostParams::default(), &ncp).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let mut steps: Vec<(String, Duration)> = Vec::new();
    let mut see = |what: String| {
        if !steps.iter().any(|(w, _)| *w == what) {
            steps.push((what, started.elapsed()));
        }
    };
    loop {
        let n = ncps.get("bench").await.unwrap();
        // Each component's pods: scheduled, containers started, Ready.
        for pod in pods.list(&Default::default()).await.unwrap().items {
            let Some(component) = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(nestplane_api::names::COMPONENT_LABEL))
                .cloned()
            else {
                continue;
            };
            let st = pod.status.unwrap_or_default();
            let cond = |t: &str| {
                st.conditions
                    .as_ref()
                    .is_some_and(|c| c.iter().any(|c| c.type_ == t && c.status == "True"))
            };
            if cond("PodScheduled") {
                see(format!("{component} scheduled"));
            }
            if st.container_statuses.as_ref().is_some_and(|c| {
                c.iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            }) {
                see(format!("{component} running"));
            }
            if cond("Ready") {
                see(format!("{component} Ready"));
            }
        }
        if n.status.is_some_and(|s| s.ready) {
            see("control plane Ready".into());
            println!(
                "kubernetes_runtime_timeline: {}",
                nestplane_nodes::timeline::format(&steps)
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "tenant not ready"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "kubernetes_runtime_ready_seconds={:.2}",
        started.elapsed().as_secs_f64()
    );
    operator.stop().await.unwrap();
}
