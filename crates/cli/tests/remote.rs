//! End to end: a machine on "another host" becomes a node through Cluster API's bootstrap
//! contract. The test plays the infrastructure provider (and Cluster API's Machine
//! controller): it creates the `Machine` that references a `NestplaneConfig`, and runs the
//! bootstrap data nestplane wrote on a machine of its own making — a network namespace whose
//! one link reaches the operator's gateway and lets nothing in, its own mount namespace and
//! filesystem root, its own cgroup tree (`fixtures/machine.sh`). The machine joins, runs a
//! pod, and serves `kubectl logs` and `exec` although the control plane cannot dial it; the
//! pod calls its own API server, through the gateway (the machine's only way out).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const READY: Duration = Duration::from_secs(120);

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The machine: its network namespace and link, its root and cgroup; all removed on drop.
struct RemoteMachine {
    netns: String,
    link: String,
    cgroup: String,
    root: tempfile::TempDir,
    scratch: tempfile::TempDir,
    host_ip: Ipv4Addr,
    ip: Ipv4Addr,
    running: Option<KillOnDrop>,
    log: PathBuf,
}

impl RemoteMachine {
    /// A machine whose link to this host is `10.252.<k>.0/30`: the host is `.1`, the
    /// machine `.2`, `k` the first from `first` whose names are free (another run's machine
    /// is never touched). No default route; a firewall that lets in only what answers the
    /// machine's own connections.
    fn create(first: u8, log: PathBuf) -> RemoteMachine {
        let k = (0..200u8)
            .map(|i| first.wrapping_add(i).max(1))
            .find(|k| {
                Command::new("ip")
                    .args(["netns", "add", &format!("np-machine-{k}")])
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
            .expect("a free machine name");
        let m = RemoteMachine {
            netns: format!("np-machine-{k}"),
            link: format!("npm{k}"),
            cgroup: format!("nestplane-machine-{k}"),
            root: tempfile::tempdir().unwrap(),
            scratch: tempfile::tempdir().unwrap(),
            host_ip: Ipv4Addr::new(10, 252, k, 1),
            ip: Ipv4Addr::new(10, 252, k, 2),
            running: None,
            log,
        };
        let ns = m.netns.as_str();
        run(&[
            "ip", "link", "add", &m.link, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/30", m.host_ip),
            "dev",
            &m.link,
        ]);
        run(&["ip", "link", "set", &m.link, "up"]);
        run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        run(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            &format!("{}/30", m.ip),
            "dev",
            "eth0",
        ]);
        run(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        let net = format!("--net=/run/netns/{ns}");
        for chain in ["INPUT", "FORWARD"] {
            run(&[
                "nsenter",
                &net,
                "iptables",
                "-w",
                "-A",
                chain,
                "-i",
                "eth0",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ]);
            run(&[
                "nsenter", &net, "iptables", "-w", "-A", chain, "-i", "eth0", "-j", "DROP",
            ]);
        }
        m
    }

    /// Run `script` as the machine's bootstrap data, in the background.
    fn boot(&mut self, script: &str) {
        // Where the provider keeps the machine's user data (it holds the token): gone with
        // the machine.
        let file = self.scratch.path().join("bootstrap.sh");
        std::fs::write(&file, script).unwrap();
        let log = std::fs::File::create(&self.log).unwrap();
        let kubebin = nestplane_runtime::binaries::kubernetes("kubelet", "v1.20.2")
            .expect("kubelet v1.20.2: run scripts/install-deps.sh");
        let child = Command::new("sh")
            .arg(repo().join("crates/cli/tests/fixtures/machine.sh"))
            .args([&self.netns])
            .arg(self.root.path())
            .arg(&self.cgroup)
            .arg(env!("CARGO_BIN_EXE_nestplane"))
            .arg(kubebin.parent().unwrap())
            .arg(nestplane_nodes::images::default_dir())
            .arg(&file)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.running = Some(KillOnDrop(child));
    }

    /// The end of the machine's log and of its node's.
    fn logs(&self) -> String {
        let mut out = format!(
            "--- machine ---\n{}\n",
            nestplane_runtime::child::log_tail(&self.log, 40)
        );
        let node = self.root.path().join("var/lib/nestplane/node/logs");
        for p in ["kubelet", "containerd", "kube-proxy"] {
            out.push_str(&format!(
                "--- {p} ---\n{}\n",
                nestplane_runtime::child::log_tail(&node.join(format!("{p}.log")), 25)
            ));
        }
        out
    }

    /// Stop the join (SIGTERM: it removes its node), then everything of the machine.
    fn stop(&mut self) {
        if let Some(mut c) = self.running.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.0.id().to_string()])
                .output();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !c.exited() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }

    fn cgroups(&self) -> Vec<PathBuf> {
        let base = Path::new("/sys/fs/cgroup");
        if base.join("cgroup.controllers").exists() {
            return vec![base.join(&self.cgroup)];
        }
        std::fs::read_dir(base)
            .unwrap()
            .flatten()
            .filter(|e| !e.file_type().unwrap().is_symlink())
            .map(|e| e.path().join(&self.cgroup))
            .filter(|p| p.exists())
            .collect()
    }

    fn remove_network(&self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .output();
        let _ = Command::new("ip")
            .args(["link", "delete", &self.link])
            .output();
    }
}

/// Every process in cgroup `dir` and below, and the directories, deepest first.
fn kill_and_remove(dir: &Path) {
    for _ in 0..50 {
        let mut pids = Vec::new();
        let mut dirs = vec![dir.to_path_buf()];
        let mut all = Vec::new();
        while let Some(d) = dirs.pop() {
            if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
                pids.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    dirs.push(e.path());
                }
            }
            all.push(d);
        }
        if !pids.is_empty() {
            let _ = Command::new("kill")
                .arg("-KILL")
                .args(pids.iter().map(|p| p.to_string()))
                .output();
        }
        all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for d in &all {
            let _ = std::fs::remove_dir(d);
        }
        if !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Drop for RemoteMachine {
    fn drop(&mut self) {
        self.stop();
        for cg in self.cgroups() {
            kill_and_remove(&cg);
        }
        self.remove_network();
    }
}

/// A NestplaneConfig `name` in `ns` whose spec is `spec` (flow YAML), and the Machine of
/// cluster `far` that references it (what Cluster API's MachineSet controller makes).
fn config_and_machine(ns: &str, name: &str, spec: &str) -> String {
    format!(
        r#"
apiVersion: bootstrap.cluster.x-k8s.io/v1alpha1
kind: NestplaneConfig
metadata: {{name: {name}, namespace: {ns}}}
spec: {spec}
---
apiVersion: cluster.x-k8s.io/v1beta2
kind: Machine
metadata: {{name: {name}, namespace: {ns}}}
spec:
  clusterName: far
  version: v1.20.2
  bootstrap:
    configRef: {{apiGroup: bootstrap.cluster.x-k8s.io, kind: NestplaneConfig, name: {name}}}
  infrastructureRef: {{apiGroup: infrastructure.cluster.x-k8s.io, kind: TestMachine, name: {name}}}
"#
    )
}

/// Wait until `field` (`reason` or `message`) of WHAT's `Ready` condition contains `needle`.
fn wait_ready_says(kc: &Path, what: &[&str], field: &str, needle: &str) {
    let path = format!("{{.status.conditions[?(@.type==\"Ready\")].{field}}}");
    eventually(
        &format!("{what:?}'s Ready {field} saying {needle:?}"),
        Duration::from_secs(60),
        || jsonpath(kc, what, &path).contains(needle).then_some(()),
    );
}

/// A merge patch of NodePool `name`'s spec.
fn patch_pool(kc: &Path, name: &str, spec: &str) {
    let patch = format!("{{\"spec\":{spec}}}");
    kubectl_ok(
        kc,
        &["patch", "nodepool", name, "--type=merge", "-p", &patch],
    );
}

/// Whether this host can open a connection to `addr` within a second.
fn dials(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_the_control_plane_cannot_dial_joins_through_bootstrap_data_and_serves_logs_and_exec()
 {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let images = images();
    let mut env = Env::start(false).await;
    let k = (std::process::id() % 200) as u8 + 20;
    let mut machine = RemoteMachine::create(k, env.state.path().join("machine.log"));
    // The gateway listens on the host's end of the machine's link: the one address the
    // machine reaches.
    env.start_operator_with_gateway_at(SocketAddr::new(machine.host_ip.into(), 0));
    env.install_crd("capi-machines-crd.yaml", "machines.cluster.x-k8s.io");
    env.create_ncp("default", "far").await;
    env.wait_ready("default", "far", READY).await;
    let tenant = env.tenant_kubeconfig("default", "far").await;
    let mgmt = env.kubeconfig().to_path_buf();

    // Bad input first: a label the shell would run is refused, and nothing is made.
    env.apply(
        r#"
apiVersion: bootstrap.cluster.x-k8s.io/v1alpha1
kind: NestplaneConfig
metadata: {name: bad, namespace: default}
spec:
  nodeLabels: {x: "$(reboot)"}
"#,
    );
    wait_ready_says(&mgmt, &["nestplaneconfig", "bad"], "reason", "InvalidSpec");
    assert!(events_for(&mgmt, "default", "bad").contains("InvalidSpec"));
    assert!(
        !kubectl_ok(&mgmt, &["get", "secrets", "-o", "name"]).contains("secret/bad"),
        "no bootstrap data for a config that cannot be used"
    );

    // A namespace user elsewhere names this cluster: nothing of it is theirs.
    kubectl_ok(&mgmt, &["create", "namespace", "other"]);
    env.apply(&config_and_machine("other", "steal", "{}"));
    wait_ready_says(
        &mgmt,
        &["nestplaneconfig", "steal", "-n", "other"],
        "message",
        "no NestedControlPlane in namespace other",
    );
    assert!(
        kubectl_ok(
            &mgmt,
            &[
                "get",
                "secrets",
                "-n",
                "other",
                "--field-selector",
                "type=cluster.x-k8s.io/secret",
                "-o",
                "name"
            ]
        )
        .trim()
        .is_empty(),
        "no bootstrap data, no token for another namespace's cluster"
    );

    // The provider's part: a config, and the Machine that references it.
    env.apply(&config_and_machine(
        "default",
        "far-m0",
        "{nodeLabels: {nestplane.io/where: far-away}, tokenTtlSeconds: 600}",
    ));
    let secret_name = eventually("the bootstrap data", Duration::from_secs(60), || {
        let ready = jsonpath(
            &mgmt,
            &["nestplaneconfig", "far-m0"],
            "{.status.initialization.dataSecretCreated}",
        );
        let name = jsonpath(
            &mgmt,
            &["nestplaneconfig", "far-m0"],
            "{.status.dataSecretName}",
        );
        (ready.trim() == "true" && !name.trim().is_empty()).then(|| name.trim().to_string())
    });
    assert_eq!(
        jsonpath(&mgmt, &["nestplaneconfig", "far-m0"], "{.status.ready}").trim(),
        "true",
        "the v1beta1 contract's field too"
    );
    let secret = env.secret("default", &secret_name).await.unwrap();
    assert_eq!(secret.type_.as_deref(), Some("cluster.x-k8s.io/secret"));
    assert_eq!(
        secret.metadata.labels.as_ref().unwrap()["cluster.x-k8s.io/cluster-name"],
        "far"
    );
    let data = secret.data.unwrap();
    assert_eq!(String::from_utf8_lossy(&data["format"].0), "cloud-config");
    let script = String::from_utf8_lossy(&data["value"].0).into_owned();
    assert!(script.starts_with("#!/bin/sh\n"), "{script}");

    // The only credential in it is a bootstrap token that expires within the TTL.
    let token_id = jsonpath(&mgmt, &["nestplaneconfig", "far-m0"], "{.status.tokenId}");
    let token_id = token_id.trim();
    assert!(script.contains(&format!("NESTPLANE_JOIN_TOKEN='{token_id}.")));
    assert!(!script.contains("PRIVATE KEY") && !script.contains("client-certificate"));
    let expiration = kubectl_ok(
        &tenant,
        &[
            "get",
            "secret",
            "-n",
            "kube-system",
            &format!("bootstrap-token-{token_id}"),
            "-o",
            "jsonpath={.data.expiration}",
        ],
    );
    let expiration = String::from_utf8(
        base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            expiration.trim(),
        )
        .unwrap(),
    )
    .unwrap();
    let expires: k8s_openapi::jiff::Timestamp = expiration.parse().unwrap();
    let left = expires.duration_since(k8s_openapi::jiff::Timestamp::now());
    assert!(
        left.as_secs() > 500 && left.as_secs() <= 600,
        "the token expires in the config's 600 s: {expiration}"
    );
    let token = script
        .split("NESTPLANE_JOIN_TOKEN='")
        .nth(1)
        .and_then(|s| s.split('\'').next())
        .unwrap()
        .to_string();

    // A config deleted before its machine ever ran takes its token with it.
    env.apply(&config_and_machine("default", "far-m1", "{}"));
    let unused = eventually(
        "the second machine's token",
        Duration::from_secs(60),
        || {
            let id = jsonpath(&mgmt, &["nestplaneconfig", "far-m1"], "{.status.tokenId}");
            (!id.trim().is_empty()).then(|| id.trim().to_string())
        },
    );
    let unused_secret = format!("bootstrap-token-{unused}");
    assert!(
        kubectl(
            &tenant,
            &["get", "secret", "-n", "kube-system", &unused_secret]
        )
        .status
        .success()
    );
    kubectl_ok(
        &mgmt,
        &[
            "delete",
            "nestplaneconfig",
            "far-m1",
            "--wait=true",
            "--timeout=60s",
        ],
    );
    assert!(
        !kubectl(
            &tenant,
            &["get", "secret", "-n", "kube-system", &unused_secret]
        )
        .status
        .success(),
        "the deleted config's token is deleted"
    );

    // The infrastructure provider's part: the machine runs its bootstrap data.
    machine.boot(&script);
    let joined = Instant::now();
    let deadline = joined + READY;
    loop {
        let ready = kubectl(
            &tenant,
            &[
                "get",
                "node",
                "far-m0",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ],
        );
        if String::from_utf8_lossy(&ready.stdout).trim() == "True" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node far-m0 not Ready after {READY:?}\n{}",
            machine.logs()
        );
        assert!(
            !machine.running.as_mut().unwrap().exited(),
            "the machine's bootstrap ended\n{}",
            machine.logs()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "the machine's node was Ready {:?} after boot",
        joined.elapsed()
    );
    let labels = kubectl_ok(
        &tenant,
        &["get", "node", "far-m0", "-o", "jsonpath={.metadata.labels}"],
    );
    assert!(labels.contains("far-away"), "{labels}");

    // Joined: the token is gone, and no one joins with it again.
    eventually("Joined", Duration::from_secs(30), || {
        let c = condition(&mgmt, &["nestplaneconfig", "far-m0"], "Joined");
        c.contains("True").then_some(())
    });
    assert!(events_for(&mgmt, "default", "far-m0").contains("NodeJoined"));
    let gone = kubectl(
        &tenant,
        &[
            "get",
            "secret",
            "-n",
            "kube-system",
            &format!("bootstrap-token-{token_id}"),
        ],
    );
    assert!(!gone.status.success(), "the token's Secret is deleted");
    let reuse = token_kubeconfig(&tenant, &token, env.state.path().join("reuse.kubeconfig"));
    eventually(
        "the used token no longer authenticates",
        Duration::from_secs(30),
        || {
            let out = kubectl(&reuse, &["get", "--raw", "/api"]);
            (!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Unauthorized"))
                .then_some(())
        },
    );

    // The control plane cannot dial the machine: neither its link address nor its node's.
    let node_ip: Ipv4Addr = kubectl_ok(
        &tenant,
        &[
            "get",
            "node",
            "far-m0",
            "-o",
            "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
        ],
    )
    .trim()
    .parse()
    .unwrap();
    // The address the provider gave the machine, and no other.
    let slot = jsonpath(&mgmt, &["nestplaneconfig", "far-m0"], "{.status.slot}");
    assert_eq!(node_ip.to_string(), format!("10.201.{}.2", slot.trim()));
    assert!(!dials(SocketAddr::new(machine.ip.into(), 10250)));
    assert!(!dials(SocketAddr::new(machine.ip.into(), 22)));
    let routed = Command::new("ip")
        .args(["route", "get", &node_ip.to_string()])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&routed.stdout).contains(&machine.link),
        "this host has no way to the machine's node: {}",
        String::from_utf8_lossy(&routed.stdout)
    );

    // A pod there: logs and exec reach it through the tunnel its node dialled out.
    kubectl_apply(
        &tenant,
        &format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: far-shell, namespace: default}}
spec:
  nodeName: far-m0
  containers:
  - name: shell
    image: {}
    imagePullPolicy: Never
    command: ["sh", "-c", "echo hello-from-far-away; sleep 3600"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: default-views, namespace: default}}
subjects: [{{kind: ServiceAccount, name: default, namespace: default}}]
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: view}}
"#,
            nestplane_nodes::images::SHELL_IMAGE
        ),
    );
    let _ = &images;
    wait_pod_running_and_logging(&tenant, "far-shell", "hello-from-far-away");
    // The pod calls its own API server (the `kubernetes` Service, with its service-account
    // token). The machine's one route is to the host's end of its link, where the gateway
    // listens, and the API servers listen on the host's loopback addresses: the call goes
    // through the gateway, by the door's name, and the door behind it.
    let api = pod_reads_itself_from_its_api(&tenant, "far-shell");
    assert!(api.contains("\"nodeName\": \"far-m0\""), "{api}");
    let routes = Command::new("ip")
        .args(["-n", &machine.netns, "route", "show"])
        .output()
        .unwrap();
    let routes = String::from_utf8_lossy(&routes.stdout).to_string();
    assert!(
        !routes.contains("default"),
        "the machine has no way but its link: {routes}"
    );

    // SIGTERM to the join removes the node from the machine.
    machine.stop();
    let leftovers: Vec<_> = std::fs::read_dir(machine.root.path().join("var/lib/nestplane"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "images")
        .collect();
    assert!(
        leftovers.is_empty(),
        "the node's directory is removed: {leftovers:?}\n{}",
        machine.logs()
    );
}

/// The MachineDeployment of pool `name` of HostedCluster `default/hc`, as `jsonpath` reads it.
fn md(kc: &Path, name: &str, path: &str) -> String {
    jsonpath(kc, &["machinedeployment", name, "-n", "default-hc"], path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_api_node_pool_owns_a_machine_deployment_that_scales_and_rolls() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.install_crd(
        "capi-machinedeployments-crd.yaml",
        "machinedeployments.cluster.x-k8s.io",
    );
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: hc, namespace: default}\nspec:\n  release: {version: 1.20.2}\n");

    // Bad input: an unknown platform is refused, and nothing is made for it.
    env.apply(
        r#"
apiVersion: nestplane.io/v1alpha1
kind: NodePool
metadata: {name: nowhere, namespace: default}
spec:
  clusterName: hc
  replicas: 1
  platform: {type: Elsewhere}
"#,
    );
    wait_ready_says(&kc, &["nodepool", "nowhere"], "message", "platform.type");
    assert!(events_for(&kc, "default", "nowhere").contains("InvalidConfiguration"));

    // A pool on Cluster API's machines.
    env.apply(
        r#"
apiVersion: nestplane.io/v1alpha1
kind: NodePool
metadata: {name: edge, namespace: default}
spec:
  clusterName: hc
  replicas: 2
  nodeLabels: {tier: edge}
  nodeDrainTimeout: 2m
  management:
    upgradeType: Replace
    replace: {strategy: RollingUpdate, rollingUpdate: {maxSurge: 1, maxUnavailable: 0}}
  platform:
    type: ClusterAPI
    clusterAPI:
      infrastructureRef: {apiGroup: infrastructure.cluster.x-k8s.io, kind: TestMachineTemplate, name: small}
"#,
    );
    let first = eventually("the MachineDeployment", Duration::from_secs(120), || {
        let t = md(
            &kc,
            "edge",
            "{.spec.replicas} {.spec.template.spec.bootstrap.configRef.name}",
        );
        t.strip_prefix("2 ")
            .filter(|n| n.starts_with("edge-"))
            .map(str::to_string)
    });
    assert_eq!(
        md(
            &kc,
            "edge",
            "{.spec.clusterName} {.spec.template.spec.version} {.spec.template.spec.infrastructureRef.kind}/{.spec.template.spec.infrastructureRef.name} {.spec.template.spec.deletion.nodeDrainTimeoutSeconds}"
        ),
        "hc v1.20.2 TestMachineTemplate/small 120"
    );
    let labels = jsonpath(
        &kc,
        &["nestplaneconfigtemplate", &first, "-n", "default-hc"],
        "{.spec.template.spec.nodeLabels}",
    );
    assert!(
        labels.contains("\"tier\":\"edge\"")
            && labels.contains("\"nestplane.io/nodepool\":\"edge\""),
        "{labels}"
    );

    // Scale: the MachineDeployment follows.
    patch_pool(&kc, "edge", "{\"replicas\":3}");
    eventually("scaled", Duration::from_secs(60), || {
        (md(&kc, "edge", "{.spec.replicas}") == "3").then_some(())
    });

    // The platform cannot change under running machines.
    patch_pool(&kc, "edge", "{\"platform\":{\"type\":\"Local\"}}");
    wait_ready_says(&kc, &["nodepool", "edge"], "message", "cannot change");
    assert_eq!(
        md(&kc, "edge", "{.spec.replicas}"),
        "3",
        "the machines stay"
    );
    patch_pool(&kc, "edge", "{\"platform\":{\"type\":\"ClusterAPI\"}}");

    // A rolling change of the node settings: a new template, the old one kept for the
    // rollout.
    patch_pool(&kc, "edge", "{\"nodeLabels\":{\"tier\":\"edge-2\"}}");
    let second = eventually("a new template", Duration::from_secs(60), || {
        let t = md(
            &kc,
            "edge",
            "{.spec.template.spec.bootstrap.configRef.name}",
        );
        (t != first && t.starts_with("edge-")).then_some(t)
    });
    let labels = jsonpath(
        &kc,
        &["nestplaneconfigtemplate", &second, "-n", "default-hc"],
        "{.spec.template.spec.nodeLabels}",
    );
    assert!(labels.contains("edge-2"), "{labels}");
    assert!(
        kubectl(
            &kc,
            &["get", "nestplaneconfigtemplate", &first, "-n", "default-hc"]
        )
        .status
        .success(),
        "the template the rollout comes from stays"
    );
    assert!(events_for(&kc, "default", "edge").contains(&second));

    // The pool goes: its MachineDeployment and templates with it. Cluster API holds a
    // MachineDeployment with its finalizer while it deletes the machines (played here): the
    // pool says what it waits for meanwhile.
    let md_finalizers = |finalizers: &str| {
        let patch = format!(r#"{{"metadata":{{"finalizers":{finalizers}}}}}"#);
        kubectl_ok(
            &kc,
            &[
                "patch",
                "machinedeployment",
                "edge",
                "-n",
                "default-hc",
                "--type=merge",
                "-p",
                &patch,
            ],
        );
    };
    md_finalizers(r#"["cluster.x-k8s.io/machinedeployment"]"#);
    kubectl_ok(&kc, &["delete", "nodepool", "edge", "--wait=false"]);
    let deleting = |field: &str| {
        jsonpath(
            &kc,
            &["nodepool", "edge"],
            &format!("{{.status.conditions[?(@.type==\"Deleting\")].{field}}}"),
        )
    };
    eventually(
        "the pool to say it waits for its MachineDeployment",
        Duration::from_secs(30),
        || (deleting("reason") == "DeletingMachineDeployment").then_some(()),
    );
    assert!(
        deleting("message").contains("MachineDeployment default-hc/edge"),
        "{}",
        deleting("message")
    );
    assert!(events_for(&kc, "default", "edge").contains("Cluster API to delete"));
    md_finalizers("null");
    kubectl_ok(
        &kc,
        &["wait", "--for=delete", "nodepool/edge", "--timeout=60s"],
    );
    assert!(
        !kubectl(
            &kc,
            &["get", "machinedeployment", "edge", "-n", "default-hc"]
        )
        .status
        .success()
    );
    let left = kubectl_ok(
        &kc,
        &[
            "get",
            "nestplaneconfigtemplates",
            "-n",
            "default-hc",
            "-o",
            "name",
        ],
    );
    assert!(left.trim().is_empty(), "{left}");
}
