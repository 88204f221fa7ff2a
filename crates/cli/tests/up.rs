//! The README's main command: `nestplane up`, Ctrl-C/SIGTERM, `up` again, `down`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

/// Start `nestplane up` and wait for the line with the kubectl command.
fn up(state: &std::path::Path) -> (Child, String) {
    up_with(state, &["--name", "demo"], Duration::from_secs(180))
}

/// Start `nestplane up ARGS --state-dir STATE` and wait up to `timeout` for the line with the
/// kubectl command.
fn up_with(state: &std::path::Path, args: &[&str], timeout: Duration) -> (Child, String) {
    let mut child = nestplane()
        .arg("up")
        .args(args)
        .arg("--state-dir")
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx
        .recv_timeout(timeout)
        .expect("nestplane up prints the kubectl command when ready");
    (child, line)
}

fn sigterm(mut child: Child) {
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = eventually(
        "nestplane up exits on SIGTERM",
        Duration::from_secs(30),
        || child.try_wait().unwrap(),
    );
    assert!(status.success(), "{status}");
}

fn running_under(dir: &std::path::Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .filter(|pid| alive(*pid))
        .collect()
}

#[test]
fn up_gives_a_working_tenant_and_comes_back_with_its_data() {
    let state = tempfile::tempdir().unwrap();
    let (child, line) = up(state.path());
    let kubeconfig = state.path().join("demo.kubeconfig");
    assert_eq!(
        line,
        format!("kubectl --kubeconfig {} get ns", kubeconfig.display())
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&kubeconfig).unwrap().permissions(),
    ) & 0o777;
    assert_eq!(mode, 0o600);
    let ns = kubectl_ok(&kubeconfig, &["get", "ns"]);
    assert!(ns.contains("kube-system") && ns.contains("default"), "{ns}");
    kubectl_ok(&kubeconfig, &["create", "namespace", "persisted"]);
    let mgmt = state.path().join("management.kubeconfig");
    let ca = kubectl_ok(
        &mgmt,
        &[
            "get",
            "secret",
            "demo-ca",
            "-o",
            "jsonpath={.data.tls\\.crt}",
        ],
    );
    assert!(!running_under(state.path()).is_empty());

    sigterm(child);
    eventually("every process stops", Duration::from_secs(15), || {
        running_under(state.path()).is_empty().then_some(())
    });

    // Again, on the same state directory: the same tenant with the same CA and its data.
    let (child, _) = up(state.path());
    let ca_again = kubectl_ok(
        &mgmt,
        &[
            "get",
            "secret",
            "demo-ca",
            "-o",
            "jsonpath={.data.tls\\.crt}",
        ],
    );
    assert_eq!(ca, ca_again, "the CA survives");
    eventually("the namespace survives", Duration::from_secs(60), || {
        kubectl(&kubeconfig, &["get", "ns", "persisted"])
            .status
            .success()
            .then_some(())
    });
    sigterm(child);

    // down removes the tenant.
    down(state.path(), "demo");
    assert!(!state.path().join("demo.kubeconfig").exists());
    assert!(!state.path().join("operator/tenants/default/demo").exists());
    assert!(running_under(state.path()).is_empty());
}

/// `nestplane up --runtime kubernetes`: a management plane with a real node, the operator
/// in-cluster, a tenant made of pods; its kubeconfig works; SIGTERM removes the node.
#[test]
fn up_with_the_kubernetes_runtime_gives_a_tenant_made_of_pods() {
    let state = tempfile::tempdir().unwrap();
    let (child, line) = up_with(
        state.path(),
        &[
            "--runtime",
            "kubernetes",
            "--name",
            "pods",
            "--timeout",
            "300",
        ],
        Duration::from_secs(480),
    );
    let root = state.path().join("kubernetes");
    let kubeconfig = root.join("pods.kubeconfig");
    assert_eq!(
        line,
        format!("kubectl --kubeconfig {} get ns", kubeconfig.display())
    );
    let ns = kubectl_ok(&kubeconfig, &["get", "ns"]);
    assert!(ns.contains("kube-system"), "{ns}");
    let mgmt = root.join("management.kubeconfig");
    let pods = kubectl_ok(
        &mgmt,
        &[
            "get",
            "pods",
            "-A",
            "-o",
            "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
        ],
    );
    for prefix in [
        "nestplane-system/nestplane-controller-manager-",
        "default/pods-etcd-0",
        "default/pods-apiserver-",
    ] {
        assert!(
            pods.lines()
                .any(|l| l.starts_with(prefix) && l.ends_with(" node-0 Running")),
            "{prefix}: {pods}"
        );
    }
    let slot_dir = root.join("management/nodes/node-0");
    assert!(slot_dir.join("containerd.sock").exists());
    sigterm(child);
    assert!(!slot_dir.exists(), "the node is removed on stop");
    assert!(running_under(state.path()).is_empty());
}

#[test]
fn up_with_nodes_gives_a_cluster_where_kubectl_run_and_logs_work() {
    let _ = images();
    let state = tempfile::tempdir().unwrap();
    let (child, line) = up_with(
        state.path(),
        &["--name", "work", "--nodes", "1"],
        Duration::from_secs(400),
    );
    let kubeconfig = state.path().join("work.kubeconfig");
    assert_eq!(
        line,
        format!("kubectl --kubeconfig {} get nodes", kubeconfig.display())
    );
    let nodes = kubectl_ok(&kubeconfig, &["get", "nodes", "-o", "name"]);
    assert_eq!(nodes.lines().count(), 1, "{nodes}");
    kubectl_ok(
        &kubeconfig,
        &[
            "run",
            "hello",
            "--image=docker.io/library/busybox:1.35",
            "--restart=Never",
            "--",
            "sh",
            "-c",
            "echo hello from a real node; sleep 3600",
        ],
    );
    wait_pod_running_and_logging(&kubeconfig, "hello", "hello from a real node");
    more_clusters_from_the_command_line(state.path());
    sigterm(child);
    // `down` tears the hosted cluster down (its nodes went with `up`).
    down(state.path(), "work");
    assert!(
        running_under(state.path()).is_empty(),
        "nothing runs from the state directory"
    );
}

/// `nestplane create`, `list`, `kubeconfig` and `delete` against the running `nestplane up`
/// of `state` (found by its state directory, as a user's shell finds it): a second cluster is
/// made beside `work`, listed with `work`'s node, used with `kubectl`, and deleted.
fn more_clusters_from_the_command_line(state: &std::path::Path) {
    let cli = |args: &[&str]| {
        let out = nestplane()
            .args(args)
            .arg("--state-dir")
            .arg(state)
            .env_remove("KUBECONFIG")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = cli(&["create", "second", "--nodes", "0"]);
    assert!(ok, "{err}");
    assert_eq!(
        out.trim(),
        "nestplane kubeconfig second -n default > second.kubeconfig"
    );
    let (ok, _, err) = cli(&["create", "second", "--nodes", "0"]);
    assert!(!ok && err.contains("exists already"), "{err}");

    let (ok, out, err) = cli(&["list", "-o", "json"]);
    assert!(ok, "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let row = |name: &str| {
        rows.iter()
            .find(|r| r["name"] == name)
            .unwrap_or_else(|| panic!("{name} not listed: {out}"))
            .clone()
    };
    let work = row("work");
    assert_eq!(work["kind"], "HostedCluster");
    assert_eq!(work["ready"], true);
    assert_eq!(
        (work["nodesReady"].as_i64(), work["nodes"].as_i64()),
        (Some(1), Some(1))
    );
    assert!(work["endpoint"].as_str().unwrap().contains(':'), "{work}");
    let second = row("second");
    assert_eq!(
        (second["ready"].clone(), second["nodes"].clone()),
        (true.into(), 0.into())
    );
    assert_eq!(second["version"], "v1.20.2");
    let (ok, table, err) = cli(&["list"]);
    assert!(ok, "{err}");
    let head: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        head,
        [
            "NAMESPACE",
            "NAME",
            "KIND",
            "VERSION",
            "READY",
            "NODES",
            "AGE",
            "ENDPOINT"
        ]
    );
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().take(6).collect::<Vec<_>>()
                == ["default", "work", "HostedCluster", "v1.20.2", "True", "1/1"]),
        "{table}"
    );
    let (ok, yaml, err) = cli(&["list", "-n", "default", "-o", "yaml"]);
    assert!(ok && yaml.contains("name: second"), "{err}{yaml}");

    // Its kubeconfig works with kubectl.
    let (ok, kc, err) = cli(&["kubeconfig", "second"]);
    assert!(ok, "{err}");
    let path = state.join("second-from-cli.kubeconfig");
    std::fs::write(&path, kc).unwrap();
    let ns = kubectl_ok(&path, &["get", "namespace", "kube-system", "-o", "name"]);
    assert_eq!(ns.trim(), "namespace/kube-system");

    let (ok, _, err) = cli(&["delete", "second"]);
    assert!(ok, "{err}");
    let (ok, out, err) = cli(&["list", "-o", "json"]);
    assert!(ok, "{err}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["work"], "{out}");
    for again in [&["delete", "second"][..], &["kubeconfig", "second"]] {
        let (ok, _, err) = cli(again);
        assert!(
            !ok && err.contains("no HostedCluster or NestedControlPlane default/second"),
            "{again:?}: {err}"
        );
    }
    // A state directory without a management plane is said to be one, not passed over.
    let empty = tempfile::tempdir().unwrap();
    let out = nestplane()
        .args(["list", "--state-dir"])
        .arg(empty.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no `nestplane up` in"),
        "{err}"
    );
}

/// `nestplane down --name NAME --state-dir STATE`, which must succeed.
fn down(state: &std::path::Path, name: &str) {
    let out = nestplane()
        .args(["down", "--name", name, "--state-dir"])
        .arg(state)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn up_refuses_node_settings_without_nodes_and_starts_nothing() {
    let state = tempfile::tempdir().unwrap();
    for args in [
        &["--pod-security", "Privileged"][..],
        &["--node-image", "docker.io/library/busybox:1.29"][..],
    ] {
        let out = nestplane()
            .arg("up")
            .args(args)
            .arg("--state-dir")
            .arg(state.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} without --nodes is refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("give --nodes too"), "{err}");
    }
    assert_eq!(
        std::fs::read_dir(state.path()).unwrap().count(),
        0,
        "nothing is made"
    );
    let out = nestplane()
        .args(["up", "--nodes", "1", "--pod-security", "Everything"])
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Privileged"));
}
