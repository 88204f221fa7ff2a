//! End to end: real nodes (containerd + kubelet + kube-proxy in their own namespaces) join a
//! tenant of the process runtime by bootstrap token and run pods; removing a node leaves
//! nothing on the machine.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;

const READY: Duration = Duration::from_secs(120);

const POD: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: shell
  namespace: default
spec:
  containers:
  - name: shell
    image: docker.io/library/busybox:1.35
    imagePullPolicy: Never
    command: ["sh", "-c", "echo hello-from-the-pod; mkdir -p /www; echo served-by-the-pod > /www/index.html; httpd -f -p 8080 -h /www"]
    ports:
    - containerPort: 8080
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: pod-reader
  namespace: default
rules:
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: default-reads-pods
  namespace: default
subjects:
- kind: ServiceAccount
  name: default
  namespace: default
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: pod-reader
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_a_process_tenant_by_bootstrap_token_and_runs_a_pod() {
    let env = Env::start(true).await;
    env.create_ncp("default", "nodes").await;
    let ncp = env.wait_ready("default", "nodes", READY).await;
    let ep = ncp.spec.control_plane_endpoint.clone().unwrap();
    let tenant = env.tenant_kubeconfig("default", "nodes").await;
    let admin = client_for(&tenant).await;
    let ca = env.secret("default", "nodes-ca").await.unwrap();
    let ca_pem = String::from_utf8(ca.data.unwrap()["tls.crt"].0.clone()).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let node_dir = dir.path().join("worker-0");
    let node = join_node(
        &admin,
        "worker-0",
        &node_dir,
        &ca_pem,
        vec![format!("{}:{}", ep.host, ep.port).parse().unwrap()],
        6443,
        &[
            "registry.k8s.io/pause:3.2",
            nestplane_nodes::images::SHELL_IMAGE,
        ],
        // The node of control plane default/nodes: its API server's user may reach it.
        Some(env.uid("default", "nodes")),
        None,
    )
    .await;
    wait_node_ready(&tenant, "worker-0", &node_dir, READY);

    // The kubelet's client certificate came from an approved CSR, not from an admin
    // credential: the CSR is there, approved and issued, for system:node:worker-0.
    let csrs = kubectl_ok(
        &tenant,
        &[
            "get",
            "csr",
            "-o",
            "jsonpath={range .items[*]}{.spec.username} {.status.conditions[0].type} {.status.certificate}{\"\\n\"}{end}",
        ],
    );
    assert!(
        csrs.lines().any(|l| l.starts_with("system:bootstrap:")
            && l.contains(" Approved ")
            && l.len() > 100),
        "no approved, issued bootstrap CSR: {csrs}"
    );
    let kubelet_conf = std::fs::read_to_string(node_dir.join("kubelet.conf")).unwrap();
    assert!(
        kubelet_conf.contains("kubelet-client-current.pem"),
        "{kubelet_conf}"
    );
    assert!(
        !kubelet_conf.contains("token"),
        "the kubelet keeps no token"
    );
    // The Node's address is on the node's own link, not loopback.
    let ip = kubectl_ok(
        &tenant,
        &[
            "get",
            "node",
            "worker-0",
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ],
    );
    assert_eq!(ip.trim(), node.ip().to_string());

    // A pod from the locally built image.
    kubectl_apply(&tenant, POD);
    // logs and exec (the API server reaches the kubelet, which trusts it), port-forward.
    wait_pod_running_and_logging(&tenant, "shell", "hello-from-the-pod");
    let mut pf = KillOnDrop(
        std::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&tenant)
            .args(["port-forward", "pod/shell", "18080:8080"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let body = eventually("port-forward", Duration::from_secs(30), || {
        let out = std::process::Command::new("busybox")
            .args(["wget", "-q", "-O", "-", "http://127.0.0.1:18080/"])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(body.trim(), "served-by-the-pod");
    assert!(!pf.exited());
    pf.kill();

    // The pod reaches its cluster's API through the `kubernetes` Service (kube-proxy on the
    // node, the node-local proxy) with its own service-account token.
    let api = pod_reads_itself_from_its_api(&tenant, "shell");
    assert!(api.contains("\"name\": \"shell\""), "{api}");
    let endpoints = kubectl_ok(
        &tenant,
        &[
            "get",
            "endpoints",
            "kubernetes",
            "-o",
            "jsonpath={.subsets[0].addresses[0].ip}",
        ],
    );
    assert_eq!(endpoints.trim(), nestplane_api::names::NODE_LOCAL_APISERVER);

    // Removing the node removes everything it made.
    let addrs = node.addresses().clone();
    let node_dir = node.dir().to_path_buf();
    node.remove().await.expect("node removed without leftovers");
    let left = node_leftovers(addrs.slot, &node_dir);
    assert!(left.is_empty(), "{left:?}");
}

/// Start and remove nodes 100 times (four at a time): every removal leaves nothing on the
/// machine (processes, mounts, network namespace, host interface and route, iptables rules,
/// cgroups, directory, slot claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_started_and_removed_100_times_leave_nothing_behind() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let dir = tempfile::tempdir().unwrap();
    let pause = images()["registry.k8s.io/pause:3.2"].clone();
    let mut cycle = 0;
    while cycle < 100 {
        let mut batch = Vec::new();
        for _ in 0..4 {
            let cfg = nestplane_nodes::node::NodeConfig {
                name: format!("cycle-{cycle}"),
                dir: dir.path().join(format!("cycle-{cycle}")),
                ca_pem: "unused".into(),
                token: "abcdef.0123456789abcdef".into(),
                // Nothing listens there: the kubelet keeps trying to bootstrap.
                apiservers: vec!["127.0.0.1:9".parse().unwrap()],
                api_port: 6443,
                images: if cycle % 25 == 0 {
                    vec![pause.clone()]
                } else {
                    vec![]
                },
                pause_image: "registry.k8s.io/pause:3.2".into(),
                spec: nestplane_nodes::config::NodeSpec {
                    version: "v1.20.2".into(),
                    ..Default::default()
                },
                cluster: Default::default(),
                // Two nodes of one group, one of another, one without: isolation rules come
                // and go with their nodes too.
                group: match cycle % 4 {
                    0 => None,
                    1 | 2 => Some(7),
                    _ => Some(9),
                },
                control_plane_user: (cycle % 4 == 1).then_some(0x4e50_0007),
                guard: None,
                tunnel: None,
                entry: None,
                slot: None,
            };
            batch.push(tokio::spawn(nestplane_nodes::node::Node::start(cfg)));
            cycle += 1;
        }
        let mut nodes = Vec::new();
        for b in batch {
            nodes.push(b.await.unwrap().expect("node starts"));
        }
        // Every node has its own namespace and its containerd answers.
        for n in &nodes {
            assert!(nestplane_nodes::net::netns_path(n.addresses()).exists());
            assert!(n.dir().join("containerd.sock").exists());
        }
        // Nodes of a group reach each other and no other node (checked once).
        if cycle == 4 {
            // Nothing leaves the machine from a node: through its link only the nodes' links
            // and pod ranges are let out, the rest is dropped in the node's own namespace.
            for chain in ["OUTPUT", "FORWARD"] {
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", &nodes[0].addresses().netns])
                    .args(["iptables", "-w", "-S", chain])
                    .output()
                    .unwrap();
                let rules: Vec<String> = String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| l.contains("-o eth0"))
                    .map(str::to_string)
                    .collect();
                assert_eq!(
                    rules,
                    [
                        format!("-A {chain} -d 10.201.0.0/16 -o eth0 -j ACCEPT"),
                        format!("-A {chain} -d 10.244.0.0/16 -o eth0 -j ACCEPT"),
                        format!("-A {chain} -o eth0 -j DROP"),
                    ],
                    "{chain}"
                );
            }
            let reaches = |from: usize, to: usize| {
                std::process::Command::new("ip")
                    .args(["netns", "exec", &nodes[from].addresses().netns])
                    .args(["busybox", "ping", "-c", "1", "-W", "1"])
                    .arg(nodes[to].ip().to_string())
                    .output()
                    .unwrap()
                    .status
                    .success()
            };
            assert!(reaches(1, 2) && reaches(2, 1), "one group");
            assert!(!reaches(1, 3) && !reaches(3, 2), "two groups");
            assert!(!reaches(0, 1) && !reaches(3, 0), "a group and no group");
        }
        for n in nodes {
            let (addrs, d) = (n.addresses().clone(), n.dir().to_path_buf());
            n.remove().await.expect("removed");
            let left = node_leftovers(addrs.slot, &d);
            assert!(left.is_empty(), "{}: {left:?}", d.display());
        }
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
