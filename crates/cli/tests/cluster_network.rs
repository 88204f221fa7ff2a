//! A hosted cluster's API server reaches its own cluster's network, as users' tools need: an
//! admission webhook served by a pod denies an object, a CRD conversion webhook converts, an
//! aggregated API served by a pod is `Available` and answers, and the `proxy` subresources of
//! Services and pods answer over https. It reaches only its own: a second hosted cluster that
//! points a Service, a webhook and an `APIService` at the first cluster's pod gets nothing
//! from it. The servers are the upstream end-to-end suite's own (agnhost, sample-apiserver),
//! built here from the Kubernetes source tree; the nodes are real.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::network::{self, NS, clients, stderr_of};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_reaches_its_own_cluster_network_and_no_other() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let mut env = Env::start(false).await;
    env.start_operator_with(
        nestplane_operator::Controllers::default(),
        network::IMAGES.map(String::from).to_vec(),
    );
    let kc = env.kubeconfig().to_path_buf();
    env.install_cluster_crd();
    for name in ["alpha", "beta"] {
        env.apply(&format!(
            "apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  release: {{version: 1.20.2}}\n  initialNodes: 1\n"
        ));
    }
    for name in ["alpha", "beta"] {
        eventually(
            &format!("NodePool {name} Ready"),
            Duration::from_secs(300),
            || (condition(&kc, &["nodepool", name], "Ready") == "True").then_some(()),
        );
    }
    let alpha = hosted_kubeconfig(&kc, "alpha", env.state.path());
    let beta = hosted_kubeconfig(&kc, "beta", env.state.path());

    let ca = network::serve_and_reach(&alpha);

    // Beta points a Service of its own at alpha's webhook pod, and its webhook, conversion
    // and APIService at that Service: its API server reaches none of it. (Its Service
    // address is beta's own, so the egress proxy connects it inside beta's node, whose
    // kube-proxy sends it to alpha's pod: the machine drops it, beta's nodes reach no other
    // cluster's. The proxy subresources, which connect to the pod's address directly, are
    // refused by the proxy itself: `hostile.rs`.)
    let pod_ip = jsonpath(&alpha, &["pod", "webhook", "-n", NS], "{.status.podIP}");
    assert!(!pod_ip.is_empty());
    kubectl_apply(
        &beta,
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: steal, namespace: default}}\nspec:\n  ports: [{{port: 443, targetPort: 8443}}]\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: steal, namespace: default}}\nsubsets:\n- addresses: [{{ip: {pod_ip}}}]\n  ports: [{{port: 8443}}]\n"
        ),
    );
    kubectl_apply(&beta, &clients(&ca, "default", Some("steal")));
    let failed = eventually("beta's webhook call fails", Duration::from_secs(60), || {
        stderr_of(&beta, &["create", "configmap", "c1", "-n", "denied"])
            .filter(|e| e.contains("failed calling webhook"))
    });
    assert!(
        !failed.contains("this webhook denies all requests"),
        "{failed}"
    );
    // Seen long enough to be sure: the APIService never becomes Available.
    std::thread::sleep(Duration::from_secs(5));
    let available = condition(
        &beta,
        &["apiservice", "v1alpha1.wardle.example.com"],
        "Available",
    );
    assert_eq!(available, "False");

    // Alpha's own calls still work after all of that.
    eventually(
        "alpha's webhook still denies",
        Duration::from_secs(30),
        || {
            stderr_of(&alpha, &["create", "configmap", "c2", "-n", "denied"])
                .filter(|e| e.contains("this webhook denies all requests"))
        },
    );
    env.operator.take().unwrap().stop().await.unwrap();
}
