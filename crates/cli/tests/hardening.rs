//! Defects a review found, each shown against a real management plane and real tenants:
//! patches that would run code on the host, etcd scaling that split the cluster, hostile
//! input that crashed the operator, lost finalizer updates.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{Env, KillOnDrop, alive, events_for, eventually, kubectl, kubectl_ok};
use kube::api::{Api, Patch, PatchParams};
use nestplane_api::{NestedControlPlane, NestedEtcd};

const READY: Duration = Duration::from_secs(120);
const NCP: &str = "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane";

/// `{.status.conditions[?(@.type==T)]}` as `reason|message`.
fn condition(kc: &Path, kind: &str, name: &str, type_: &str) -> String {
    let out = kubectl(
        kc,
        &[
            "get",
            kind,
            name,
            "-n",
            "default",
            "-o",
            &format!(
                "jsonpath={{.status.conditions[?(@.type==\"{type_}\")].reason}}|{{.status.conditions[?(@.type==\"{type_}\")].message}}"
            ),
        ],
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_never_runs_code_on_the_host_and_what_runs_keeps_running() {
    let env = Env::start(true).await;
    env.create_ncp("default", "victim").await;
    env.wait_ready("default", "victim", READY).await;
    let kc = env.kubeconfig().to_path_buf();
    let pid = env.pid("default", "victim", "apiserver", 0).unwrap();
    let marker = env.state.path().join("owned");
    let patch = serde_json::json!({"spec": {"patches": [{
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "victim-apiserver"},
        "spec": {"template": {"spec": {"containers": [{
            "name": "kube-apiserver",
            "command": ["/bin/sh", "-c", format!("touch {}; sleep 3600", marker.display())]
        }]}}}
    }]}});
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedapiserver",
            "victim-apiserver",
            "--type",
            "merge",
            "-p",
            &patch.to_string(),
        ],
    );
    let got = eventually(
        "the patch is refused with InvalidSpec",
        Duration::from_secs(60),
        || {
            let c = condition(&kc, "nestedapiserver", "victim-apiserver", "Ready");
            c.starts_with("InvalidSpec|").then_some(c)
        },
    );
    assert!(
        got.contains("patch 0") && got.contains("command may not be changed"),
        "{got}"
    );
    eventually(
        "a Warning event names the patch",
        Duration::from_secs(30),
        || {
            events_for(&kc, "default", "victim-apiserver")
                .contains("Warning InvalidSpec: patch 0")
                .then_some(())
        },
    );
    // Give a wrongly accepted patch time to run, then look.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!marker.exists(), "the patch's command ran on the host");
    assert!(alive(pid), "the running API server was left alone");
    assert_eq!(env.pid("default", "victim", "apiserver", 0), Some(pid));
    let tenant = env.tenant_kubeconfig("default", "victim").await;
    kubectl_ok(&tenant, &["get", "ns", "default"]);

    // A hostPath volume is refused the same way; removing the patches heals.
    let host_path = serde_json::json!({"spec": {"patches": [{
        "kind": "StatefulSet", "metadata": {"name": "victim-etcd"},
        "spec": {"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}}
    }]}});
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedetcd",
            "victim-etcd",
            "--type",
            "merge",
            "-p",
            &host_path.to_string(),
        ],
    );
    eventually("hostPath is refused", Duration::from_secs(60), || {
        let c = condition(&kc, "nestedetcd", "victim-etcd", "Ready");
        (c.starts_with("InvalidSpec|") && c.contains("volume \"root\"")).then_some(())
    });
    for kind in ["nestedetcd/victim-etcd", "nestedapiserver/victim-apiserver"] {
        kubectl_ok(
            &kc,
            &[
                "patch",
                kind,
                "--type",
                "merge",
                "-p",
                r#"{"spec":{"patches":null}}"#,
            ],
        );
    }
    env.wait_ready("default", "victim", READY).await;
    assert_eq!(env.pid("default", "victim", "apiserver", 0), Some(pid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_membership_changes_are_refused_after_bootstrap_and_no_data_is_lost() {
    let env = Env::start(true).await;
    env.create_ncp("default", "solo").await;
    env.wait_ready("default", "solo", READY).await;
    let kc = env.kubeconfig().to_path_buf();
    let tenant = env.tenant_kubeconfig("default", "solo").await;
    kubectl_ok(&tenant, &["create", "namespace", "precious"]);

    let etcds: Api<NestedEtcd> = Api::namespaced(env.client(), "default");
    let scale = |n: i32| {
        let etcds = etcds.clone();
        async move {
            etcds
                .patch(
                    "solo-etcd",
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {"replicas": n}})),
                )
                .await
                .unwrap();
        }
    };
    scale(3).await;
    let got = eventually(
        "the membership change is refused",
        Duration::from_secs(60),
        || {
            let c = condition(&kc, "nestedetcd", "solo-etcd", "Scaled");
            c.starts_with("MembershipChangeRefused|").then_some(c)
        },
    );
    assert!(got.contains("1 member") && got.contains("3"), "{got}");
    eventually("a Warning event", Duration::from_secs(30), || {
        events_for(&kc, "default", "solo-etcd")
            .contains("Warning MembershipChangeRefused")
            .then_some(())
    });
    // Give a wrongly started member time to appear.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        env.pid("default", "solo", "etcd", 1).is_none(),
        "no second member process was started"
    );

    // One cluster with one member, and the data is there.
    let etcd = etcds.get("solo-etcd").await.unwrap();
    let addr = &etcd.status.as_ref().unwrap().addresses;
    assert_eq!(addr.len(), 1, "{addr:?}");
    let endpoint = format!(
        "https://{}:{}",
        addr[0].ip.as_deref().unwrap(),
        addr[0].port
    );
    let (ok, members, err) = env
        .etcdctl("default", "solo", vec![endpoint])
        .await
        .run(&["member", "list"]);
    assert!(ok, "{members}{err}");
    assert_eq!(members.lines().count(), 1, "{members}");
    kubectl_ok(&tenant, &["get", "namespace", "precious"]);
    let ncp = env.ncps("default").get("solo").await.unwrap();
    assert!(ncp.status.unwrap().ready, "the control plane stayed ready");

    // Back to the formed size: accepted again.
    scale(1).await;
    eventually("Scaled is True again", Duration::from_secs(60), || {
        condition(&kc, "nestedetcd", "solo-etcd", "Scaled")
            .starts_with("AsExpected|")
            .then_some(())
    });
    kubectl_ok(&tenant, &["get", "namespace", "precious"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_finalizer_write_never_drops_another_writers_entry() {
    let env = Env::start(false).await;
    env.create_ncp("default", "shared").await;
    let api = env.ncps("default");
    let stale = api.get("shared").await.unwrap();
    // Another controller adds its finalizer after we read.
    api.patch(
        "shared",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": ["example.com/keep"]}})),
    )
    .await
    .unwrap();
    let err = api
        .patch(
            "shared",
            &PatchParams::default(),
            &Patch::Merge(nestplane_operator::ncp::finalizer_patch(&stale, true)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(e) if e.code == 409),
        "{err}"
    );
    // The operator, starting from fresh reads, ends with both.
    let mut env = env;
    env.start_operator();
    let fins = eventually_finalizers(&api, 2).await;
    assert!(fins.contains(&"example.com/keep".to_string()), "{fins:?}");
    assert!(
        fins.contains(&nestplane_api::names::FINALIZER.to_string()),
        "{fins:?}"
    );
}

async fn eventually_finalizers(api: &Api<NestedControlPlane>, n: usize) -> Vec<String> {
    for _ in 0..300 {
        let o = api.get("shared").await.unwrap();
        let f = o.metadata.finalizers.unwrap_or_default();
        if f.len() >= n {
            return f;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("finalizers did not converge");
}

/// One hostile case: YAML to apply, and which object must carry a condition about it.
struct Case {
    yaml: String,
    /// (`kind`, `name`, condition type) that must report a problem, unless the API server
    /// refused the YAML.
    target: (&'static str, String, &'static str),
}

fn ncp_case(i: usize, spec: &str) -> Case {
    let name = format!("bad-{i}");
    Case {
        yaml: format!("{NCP}\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n{spec}\n"),
        target: ("ncp", name, "Available"),
    }
}

/// A control plane whose other components cannot run (an unavailable version), and one
/// component of `kind` with a hostile `spec` (plus its own runnable version unless the spec
/// sets one).
fn component_case(i: usize, kind: &'static str, spec: &str) -> Case {
    let name = format!("bad-{i}");
    let (short, field) = match kind {
        "NestedEtcd" => ("etcd", "etcd"),
        "NestedAPIServer" => ("apiserver", "apiserver"),
        "NestedControllerManager" => ("controller-manager", "controllerManager"),
        _ => ("scheduler", "scheduler"),
    };
    let comp = format!("{name}-{short}");
    let version = if spec.contains("version:") || spec.contains("channel:") {
        String::new()
    } else {
        "  version: v1.20.2\n".to_string()
    };
    Case {
        yaml: format!(
            "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: {kind}\nmetadata:\n  name: {comp}\n  namespace: default\nspec:\n{version}{spec}\n---\n{NCP}\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  version: v1.99.0\n  {field}:\n    apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\n    kind: {kind}\n    name: {comp}\n"
        ),
        target: (
            match kind {
                "NestedEtcd" => "nestedetcd",
                "NestedAPIServer" => "nestedapiserver",
                "NestedControllerManager" => "nestedcontrollermanager",
                _ => "nestedscheduler",
            },
            comp,
            "Ready",
        ),
    }
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn corpus() -> Vec<Case> {
    let kinds = [
        "NestedEtcd",
        "NestedAPIServer",
        "NestedControllerManager",
        "NestedScheduler",
    ];
    let accents = format!("x{}", "é".repeat(600));
    let huge = "v".repeat(200_000);
    let mut cases = Vec::new();
    let mut i = 0;
    let mut next = || {
        i += 1;
        i
    };
    // The string that crashed the operator, on every kind, as channel and as version.
    for k in kinds {
        cases.push(component_case(
            next(),
            k,
            &format!("  channel: {}", json_str(&accents)),
        ));
        cases.push(component_case(
            next(),
            k,
            &format!("  version: {}", json_str(&accents)),
        ));
    }
    // Versions: empty-ish, control characters, bidi overrides, shell, huge, unsupported.
    for v in [
        "v",
        "1.20.2\u{0}",
        "v1.20.2\u{7}\u{1b}[31m",
        "v1.20.2\u{202e}",
        "v1.20.2; rm -rf /",
        "$(touch /tmp/x)",
        "v999.0.0",
        "v1.19.0",
        "-1",
        "v1.20.2-😀",
        huge.as_str(),
        "v1.20.2\r\nX-Injected: 1",
    ] {
        cases.push(ncp_case(next(), &format!("  version: {}", json_str(v))));
    }
    // Replica counts: negative, zero, too many, enormous, on every kind and the control plane.
    for n in ["-1", "0", "8", "2147483647", "-2147483648"] {
        cases.push(component_case(
            next(),
            "NestedEtcd",
            &format!("  replicas: {n}"),
        ));
    }
    for n in ["-5", "0", "99", "2147483647"] {
        cases.push(ncp_case(
            next(),
            &format!("  version: v1.99.0\n  replicas: {n}"),
        ));
    }
    cases.push(component_case(
        next(),
        "NestedScheduler",
        "  replicas: 9999",
    ));
    // Patches: malformed, unknown targets, and everything the policy refuses.
    let patches = [
        r#""just a string""#,
        "42",
        "[1, 2]",
        "{}",
        r#"{"kind": "Deployment"}"#,
        r#"{"kind": "Nope", "metadata": {"name": "x"}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "command": ["/bin/sh", "-c", "id"]}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/etc"}}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"hostNetwork": true}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "securityContext": {"privileged": true}}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "args": ["--data-dir=/etc"]}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "$patch": "delete"}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "volumeMounts": [{"name": "data", "mountPath": "/x", "subPath": "../../.."}]}]}}}}"#,
        r#"{"kind": "StatefulSet", "metadata": {"name": "TARGET"}, "spec": {"template": {"spec": {"containers": [{"name": "etcd", "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-ca", "key": "tls.key"}}}]}]}}}}"#,
    ];
    for p in patches {
        let n = next();
        let p = p.replace("TARGET", &format!("bad-{n}-etcd"));
        cases.push(component_case(
            n,
            "NestedEtcd",
            &format!("  patches:\n  - {p}"),
        ));
    }
    // A deeply nested patch that also asks for the host's network.
    let n = next();
    let deep = format!(
        r#"{{"kind": "StatefulSet", "metadata": {{"name": "bad-{n}-etcd"}}, "spec": {{"template": {{"spec": {{"hostNetwork": true, "a": {}}}}}}}}}"#,
        "{\"a\": ".repeat(60) + "1" + &"}".repeat(60)
    );
    cases.push(component_case(
        n,
        "NestedEtcd",
        &format!("  patches:\n  - {deep}"),
    ));
    // Names at every length limit: 34 (one past what derived names allow), 63, 253.
    for len in [34, 63, 253] {
        let name: String = "n".repeat(len);
        cases.push(Case {
            yaml: format!("{NCP}\nmetadata:\n  name: {name}\n  namespace: default\nspec: {{}}\n"),
            target: ("ncp", name, "Available"),
        });
    }
    // A reference into another namespace and a component name at the limit that is missing.
    let n = next();
    cases.push(ncp_case(
        n,
        "  etcd:\n    apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\n    kind: NestedEtcd\n    name: x\n    namespace: kube-system",
    ));
    let n = next();
    cases.push(ncp_case(
        n,
        &format!(
            "  etcd:\n    apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\n    kind: NestedEtcd\n    name: {}",
            "e".repeat(253)
        ),
    ));
    // An unknown service type.
    cases.push(component_case(
        next(),
        "NestedAPIServer",
        "  serviceType: Bogus",
    ));
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_hostile_specs_never_crash_the_operator_or_touch_other_tenants() {
    let env = Env::start(false).await;
    let mut op = env.spawn_operator();
    env.create_ncp("default", "bystander").await;
    env.wait_ready("default", "bystander", READY).await;
    let pid = env.pid("default", "bystander", "etcd", 0).unwrap();
    let ca = kubectl_ok(
        env.kubeconfig(),
        &["get", "secret", "bystander-ca", "-o", "jsonpath={.data}"],
    );

    let cases = corpus();
    assert!(cases.len() >= 50, "{} cases", cases.len());
    let kc = env.kubeconfig().to_path_buf();
    let mut refused = Vec::new();
    let mut accepted = Vec::new();
    for case in &cases {
        let out = common::kubectl_stdin(&kc, &["apply", "-f", "-"], Some(&case.yaml));
        if out.status.success() {
            accepted.push(case);
        } else {
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                !err.trim().is_empty(),
                "a refusal says why: {}",
                case.target.1
            );
            refused.push((case.target.1.clone(), err));
        }
    }
    for case in &accepted {
        let (kind, name, type_) = &case.target;
        let got = eventually(
            &format!("a condition on {kind}/{}", &name[..name.len().min(40)]),
            Duration::from_secs(90),
            || {
                let c = condition(&kc, kind, name, type_);
                let reason = c.split('|').next().unwrap_or_default().to_string();
                (!reason.is_empty() && reason != "AsExpected").then_some(c)
            },
        );
        assert!(
            got.split('|').nth(1).is_some_and(|m| !m.is_empty()),
            "{kind}/{name}: {got}"
        );
    }
    assert!(
        !op.exited(),
        "the operator exited: {}",
        std::fs::read_to_string(env.state.path().join("operator.log")).unwrap_or_default()
    );
    let log = std::fs::read_to_string(env.state.path().join("operator.log")).unwrap();
    assert!(!log.contains("panicked"), "{log}");
    // The bystander never noticed.
    assert!(alive(pid));
    assert_eq!(env.pid("default", "bystander", "etcd", 0), Some(pid));
    let ncp = env.ncps("default").get("bystander").await.unwrap();
    assert!(ncp.status.unwrap().ready);
    assert_eq!(
        kubectl_ok(
            env.kubeconfig(),
            &["get", "secret", "bystander-ca", "-o", "jsonpath={.data}"]
        ),
        ca
    );
    eprintln!(
        "{} hostile specs: {} refused by the API server, {} reported by conditions",
        cases.len(),
        refused.len(),
        accepted.len()
    );
    op.kill();
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_probe_is_not_an_outage() {
    let env = Env::start(true).await;
    env.create_ncp("default", "steady").await;
    env.wait_ready("default", "steady", READY).await;
    let etcd_pid = env.pid("default", "steady", "etcd", 0).unwrap();
    let api_pid = env.pid("default", "steady", "apiserver", 0).unwrap();
    let etcds: Api<NestedEtcd> = Api::namespaced(env.client(), "default");
    // etcd stops answering for 5 seconds, and its controller looks right then (an annotation
    // change makes it reconcile at once).
    signal(etcd_pid, "-STOP");
    etcds
        .patch(
            "steady-etcd",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"poke": "1"}}})),
        )
        .await
        .unwrap();
    let ncps = env.ncps("default");
    let mut saw_tolerated = false;
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(12) {
        if start.elapsed() > Duration::from_secs(5) {
            signal(etcd_pid, "-CONT");
        }
        let ncp = ncps.get("steady").await.unwrap();
        let st = ncp.status.unwrap();
        assert!(
            st.ready,
            "a 5-second blip made the control plane not ready: {:#?}",
            st.conditions
        );
        let etcd = etcds.get("steady-etcd").await.unwrap();
        let c = etcd.status.unwrap().common;
        assert!(c.ready, "{:#?}", c.conditions);
        saw_tolerated |= c
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.message.contains("tolerated"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    signal(etcd_pid, "-CONT");
    assert!(saw_tolerated, "the failed probe was seen and tolerated");
    assert_eq!(env.pid("default", "steady", "apiserver", 0), Some(api_pid));
    assert_eq!(env.pid("default", "steady", "etcd", 0), Some(etcd_pid));

    // Sustained failure is reported: etcd stopped for good becomes not Ready.
    signal(etcd_pid, "-STOP");
    etcds
        .patch(
            "steady-etcd",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"poke": "2"}}})),
        )
        .await
        .unwrap();
    let got = eventually(
        "sustained failure makes etcd not Ready",
        Duration::from_secs(60),
        || {
            let c = condition(env.kubeconfig(), "nestedetcd", "steady-etcd", "Ready");
            c.starts_with("Provisioning|").then_some(c)
        },
    );
    signal(etcd_pid, "-CONT");
    assert!(got.contains("0/1"), "{got}");
    env.wait_ready("default", "steady", READY).await;
}

/// The body and status line of `GET http://addr/path`.
fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A client that opens connections to a health endpoint and sends nothing cannot stop it
/// from answering a prober, even when the process has few file descriptors to spare: the
/// `nestplane dns` binary (health endpoints on loopback, no upstreams, an API server that is
/// not there), with 128 descriptors and 300 idle connections.
#[test]
fn idle_connections_cannot_stop_healthz_from_answering() {
    let state = tempfile::tempdir().unwrap();
    // A kubeconfig for an API server that is not there (loopback, nothing listens): the
    // health endpoints answer whether or not the caches ever fill.
    let kubeconfig = state.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: \"http://127.0.0.1:9\"}}]\nusers: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\ncurrent-context: c\n",
    )
    .unwrap();
    let (dns, health) = (free_addr(), free_addr());
    let mut cmd = std::process::Command::new("prlimit");
    cmd.arg("--nofile=128:128")
        .arg(env!("CARGO_BIN_EXE_nestplane"))
        .args(["dns", "--upstream", "none"])
        .arg(format!("--listen={dns}"))
        .arg(format!("--health={health}"))
        .env("KUBECONFIG", &kubeconfig)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _server = KillOnDrop(
        cmd.spawn()
            .expect("prlimit not found: apt-get install util-linux"),
    );
    eventually("/healthz answers", Duration::from_secs(30), || {
        http_get(health, "/healthz")
            .starts_with("HTTP/1.1 200")
            .then_some(())
    });
    // Not ready: its caches never list.
    assert!(
        http_get(health, "/readyz").starts_with("HTTP/1.1 503"),
        "readyz"
    );

    let held: Vec<std::net::TcpStream> = (0..300)
        .map(|_| std::net::TcpStream::connect(health).expect("connect"))
        .collect();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let r = http_get(health, "/healthz");
        assert!(
            r.starts_with("HTTP/1.1 200"),
            "/healthz with 300 idle connections held: {r:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_watch_fails_readyz_and_is_counted() {
    let env = Env::start(false).await;
    let kc = env.kubeconfig().to_path_buf();
    // The shipped role, less every permission on NestedSchedulers.
    let role = std::fs::read_to_string(common::repo().join("config/rbac/role.yaml"))
        .unwrap()
        .replace(", nestedschedulers/status", "")
        .replace(", nestedschedulers/finalizers", "")
        .replace(", nestedschedulers]", "]")
        .replace("name: manager-role", "name: limited");
    assert!(!role.contains("nestedschedulers"));
    common::kubectl_stdin(&kc, &["apply", "-f", "-"], Some(&role));
    kubectl_ok(
        &kc,
        &["create", "serviceaccount", "limited", "-n", "default"],
    );
    kubectl_ok(
        &kc,
        &[
            "create",
            "clusterrolebinding",
            "limited",
            "--clusterrole=limited",
            "--serviceaccount=default:limited",
        ],
    );
    let sa = env
        .plane
        .service_account_kubeconfig("default", "limited")
        .await
        .unwrap();
    let client = nestplane_localplane::client_from_kubeconfig(&sa)
        .await
        .unwrap();
    let addr = free_addr();
    let state = tempfile::tempdir().unwrap();
    // As config/manager runs it with that role: the kubernetes runtime, NestplaneConfigs
    // left to the bootstrap provider (whose role is its own).
    let op = nestplane_operator::Operator::start(
        client,
        nestplane_operator::Config {
            state_dir: state.path().to_path_buf(),
            metrics_addr: Some(addr),
            mode: nestplane_operator::Mode::Kubernetes(Default::default()),
            controllers: nestplane_operator::Controllers::parse("*,-NestplaneConfig").unwrap(),
            ..Default::default()
        },
    );
    let body = eventually("/readyz fails", Duration::from_secs(60), || {
        let r = http_get(addr, "/readyz");
        r.starts_with("HTTP/1.1 503").then_some(r)
    });
    assert!(
        body.contains("nestedschedulers") && body.contains("forbidden"),
        "{body}"
    );
    // The one watch of schedulers (shared by their controller and the control plane's) is
    // counted under its kind.
    eventually(
        "the failed watch of schedulers counted",
        Duration::from_secs(60),
        || {
            http_get(addr, "/metrics")
                .contains("nestplane_watch_failures_total{kind=\"NestedScheduler\"}")
                .then_some(())
        },
    );
    assert!(http_get(addr, "/healthz").starts_with("HTTP/1.1 200"));
    op.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_filtered_operators_never_touch_each_others_tenants() {
    let env = Env::start(false).await;
    let start = |filter: &str, dir: &Path| {
        nestplane_operator::Operator::start(
            env.client(),
            nestplane_operator::Config {
                state_dir: dir.to_path_buf(),
                watch_filter: Some(filter.into()),
                ..Default::default()
            },
        )
    };
    let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = start("a", a_dir.path());
    let b = start("b", b_dir.path());
    env.apply(&format!(
        "{NCP}\nmetadata:\n  name: alpha\n  namespace: default\n  labels:\n    cluster.x-k8s.io/watch-filter: a\nspec:\n  version: v1.20.2\n"
    ));
    env.apply(&format!(
        "{NCP}\nmetadata:\n  name: beta\n  namespace: default\n  labels:\n    cluster.x-k8s.io/watch-filter: b\nspec:\n  version: v1.20.2\n"
    ));
    env.wait_ready("default", "alpha", READY).await;
    env.wait_ready("default", "beta", READY).await;
    let tenant = |dir: &Path, name: &str| dir.join("tenants/default").join(name).exists();
    assert!(tenant(a_dir.path(), "alpha") && !tenant(a_dir.path(), "beta"));
    assert!(tenant(b_dir.path(), "beta") && !tenant(b_dir.path(), "alpha"));
    // Each tenant answers (no second set of processes fought over it).
    for name in ["alpha", "beta"] {
        let kc = env.tenant_kubeconfig("default", name).await;
        kubectl_ok(&kc, &["get", "ns", "default"]);
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

fn lease_holder(kc: &Path) -> String {
    let out = kubectl(
        kc,
        &[
            "get",
            "lease",
            "nestplane-test",
            "-n",
            "default",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_reconciles_and_a_standby_takes_over() {
    use nestplane_operator::leader::LeaderElection;
    let env = Env::start(false).await;
    let kc = env.kubeconfig().to_path_buf();
    let le = |id: &str| LeaderElection {
        lease_duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(3),
        retry_period: Duration::from_millis(500),
        ..LeaderElection::new("default", "nestplane-test", id)
    };
    let start = |id: &str, dir: &Path| {
        nestplane_operator::Operator::start(
            env.client(),
            nestplane_operator::Config {
                state_dir: dir.to_path_buf(),
                leader_election: Some(le(id)),
                ..Default::default()
            },
        )
    };
    // Both replicas on one host share the state directory (a rolling update of a host
    // operator): the tenant keeps its addresses and data across the hand-over.
    let dir = env.operator_dir();
    let a = start("a", &dir);
    eventually("a leads", Duration::from_secs(30), || {
        (lease_holder(&kc) == "a").then_some(())
    });
    let b = start("b", &dir);
    env.create_ncp("default", "led").await;
    env.wait_ready("default", "led", READY).await;
    let key = nestplane_runtime::process::TenantKey {
        namespace: "default".into(),
        cluster: "led".into(),
    };
    use nestplane_api::names::Component;
    assert!(a.runtime().is_running(&key, Component::Etcd).await);
    for c in Component::ALL {
        assert!(
            !b.runtime().is_running(&key, c).await,
            "the standby runs nothing"
        );
    }
    assert_eq!(lease_holder(&kc), "a");
    let ca = kubectl_ok(&kc, &["get", "secret", "led-ca", "-o", "jsonpath={.data}"]);
    let tenant_kc = env.tenant_kubeconfig("default", "led").await;
    kubectl_ok(&tenant_kc, &["create", "namespace", "kept"]);

    // The leader stops cleanly: it releases the Lease and the standby takes over at once.
    a.stop().await.unwrap();
    eventually("b leads", Duration::from_secs(15), || {
        (lease_holder(&kc) == "b").then_some(())
    });
    for _ in 0..600 {
        if b.runtime().is_running(&key, Component::ApiServer).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(b.runtime().is_running(&key, Component::ApiServer).await);
    eventually(
        "the tenant answers under b",
        Duration::from_secs(120),
        || {
            kubectl(&tenant_kc, &["get", "ns", "kept"])
                .status
                .success()
                .then_some(())
        },
    );
    assert_eq!(
        kubectl_ok(&kc, &["get", "secret", "led-ca", "-o", "jsonpath={.data}"]),
        ca,
        "the CA survived the hand-over byte for byte"
    );

    // A leader that finds the Lease taken stops reconciling by itself.
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    kubectl_ok(
        &kc,
        &[
            "patch",
            "lease",
            "nestplane-test",
            "-n",
            "default",
            "--type",
            "merge",
            "-p",
            &serde_json::json!({"spec": {
                "holderIdentity": "intruder",
                "renewTime": now,
                "leaseDurationSeconds": 3600
            }})
            .to_string(),
        ],
    );
    eventually("b gives up", Duration::from_secs(60), || {
        b.is_finished().then_some(())
    });
    let err = b.stop().await.unwrap_err();
    assert!(err.to_string().contains("leadership lost"), "{err}");
}

/// `tls.crt` (or, for kubeconfigs, `value`) of a secret.
fn cert_of(kc: &Path, secret: &str) -> String {
    let key = if secret.ends_with("kubeconfig") {
        "value"
    } else {
        "tls\\.crt"
    };
    let out = kubectl(
        kc,
        &[
            "get",
            "secret",
            secret,
            "-n",
            "default",
            "-o",
            &format!("jsonpath={{.data.{key}}}"),
        ],
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The certificate the API server at `host:6443` serves (PEM), by `openssl s_client`.
fn served_cert(host: &str) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {host}:6443 </dev/null 2>/dev/null | openssl x509"
        ))
        .output()
        .expect("openssl not found: apt-get install openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_reissues_client_certificates_without_an_outage_and_keeps_the_cas() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
    let mut env = Env::start(false).await;
    let offset = Arc::new(AtomicI64::new(0));
    env.operator = Some(nestplane_operator::Operator::start(
        env.client(),
        nestplane_operator::Config {
            state_dir: env.operator_dir(),
            clock: nestplane_operator::clock::Clock::offset(offset.clone()),
            ..Default::default()
        },
    ));
    env.create_ncp("default", "renew").await;
    let ncp = env.wait_ready("default", "renew", READY).await;
    let host = ncp.spec.control_plane_endpoint.unwrap().host;
    let kc = env.kubeconfig().to_path_buf();
    let cas = ["renew-ca", "renew-etcd", "renew-proxy", "renew-sa"];
    let ca_before: Vec<String> = cas
        .iter()
        .map(|s| kubectl_ok(&kc, &["get", "secret", s, "-o", "jsonpath={.data}"]))
        .collect();
    let renewed = [
        "renew-kubeconfig",
        "renew-apiserver",
        "renew-apiserver-etcd-client",
        "renew-controller-manager-kubeconfig",
        "renew-scheduler-kubeconfig",
    ];
    let before: Vec<String> = renewed.iter().map(|s| cert_of(&kc, s)).collect();
    let pid = |c: &str| env.pid("default", "renew", c, 0).unwrap();
    let (etcd, api, cm, sched) = (
        pid("etcd"),
        pid("apiserver"),
        pid("controller-manager"),
        pid("scheduler"),
    );

    // A client that keeps talking to the tenant the whole time, with the admin kubeconfig as
    // it was before the renewal.
    let tenant = env.tenant_kubeconfig("default", "renew").await;
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let client = {
        let (stop, ok, failed, tenant) = (stop.clone(), ok.clone(), failed.clone(), tenant.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let out = kubectl(&tenant, &["get", "--raw", "/api/v1/namespaces/default"]);
                if out.status.success() {
                    ok.fetch_add(1, Ordering::SeqCst);
                } else {
                    failed.fetch_add(1, Ordering::SeqCst);
                    errors.push(String::from_utf8_lossy(&out.stderr).into_owned());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            errors
        })
    };

    // 200 days later: every 1-year client certificate is past half its life.
    offset.store(200 * 86_400, Ordering::SeqCst);
    let poke = |n: &str| {
        for kind in [
            "nestedetcd/renew-etcd",
            "nestedapiserver/renew-apiserver",
            "nestedcontrollermanager/renew-controller-manager",
            "nestedscheduler/renew-scheduler",
        ] {
            kubectl_ok(
                &kc,
                &["annotate", "--overwrite", kind, &format!("poke={n}")],
            );
        }
    };
    poke("1");
    eventually(
        "every client certificate and kubeconfig is reissued",
        Duration::from_secs(90),
        || {
            renewed
                .iter()
                .zip(&before)
                .all(|(s, b)| cert_of(&kc, s) != *b)
                .then_some(())
        },
    );
    // Back to the real time: the new certificates are fresh.
    offset.store(0, Ordering::SeqCst);
    poke("2");
    eventually(
        "the API server serves its new certificate",
        Duration::from_secs(120),
        || {
            let secret = cert_of(&kc, "renew-apiserver");
            let pem = String::from_utf8(base64_decode(&secret)).unwrap_or_default();
            let served = served_cert(&host);
            (!served.is_empty() && pem.trim() == served).then_some(())
        },
    );
    eventually(
        "controller-manager and scheduler restarted with their new kubeconfigs",
        Duration::from_secs(120),
        || {
            (env.pid("default", "renew", "controller-manager", 0)
                .is_some_and(|p| p != cm)
                && env
                    .pid("default", "renew", "scheduler", 0)
                    .is_some_and(|p| p != sched))
            .then_some(())
        },
    );
    env.wait_ready("default", "renew", READY).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let errors = client.join().unwrap();
    assert!(ok.load(Ordering::SeqCst) > 20, "the client ran");
    assert_eq!(
        failed.load(Ordering::SeqCst),
        0,
        "the tenant API failed during renewal: {errors:?}"
    );
    assert_eq!(pid("etcd"), etcd, "etcd reloaded its certificates in place");
    assert_eq!(pid("apiserver"), api, "the API server reloaded in place");
    let ca_after: Vec<String> = cas
        .iter()
        .map(|s| kubectl_ok(&kc, &["get", "secret", s, "-o", "jsonpath={.data}"]))
        .collect();
    assert_eq!(ca_before, ca_after, "the CAs are byte-identical");
    // The reissued admin kubeconfig works too.
    let fresh = env.tenant_kubeconfig("default", "renew").await;
    kubectl_ok(&fresh, &["get", "ns", "default"]);
}

fn base64_decode(s: &str) -> Vec<u8> {
    let out = std::process::Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(s.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    out.stdout
}

/// GET requests the management API server has served for `resources`, from its metrics.
fn gets(kc: &Path, resources: &[&str]) -> u64 {
    let metrics = kubectl_ok(kc, &["get", "--raw", "/metrics"]);
    metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{") && l.contains("verb=\"GET\""))
        .filter(|l| {
            resources
                .iter()
                .any(|r| l.contains(&format!("resource=\"{r}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_tenant_is_watched_not_polled() {
    let env = Env::start(true).await;
    env.create_ncp("default", "quiet").await;
    env.wait_ready("default", "quiet", READY).await;
    let kc = env.kubeconfig().to_path_buf();
    let resources = [
        "nestedcontrolplanes",
        "nestedetcds",
        "nestedapiservers",
        "nestedcontrollermanagers",
        "nestedschedulers",
        "secrets",
    ];
    // Let start-up settle, then count over three health passes of every component.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = gets(&kc, &resources);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let during = gets(&kc, &resources) - before;
    assert!(
        during <= 2,
        "{during} GETs of control planes, components and secrets in 30s of steady state (reads must come from the watch caches)"
    );
    let ncp = env.ncps("default").get("quiet").await.unwrap();
    assert!(ncp.status.unwrap().ready);
}

/// Two replicas whose clocks differ by far more than the lease duration (two hours): the one
/// behind leads and renews, and the one ahead never takes the Lease from it; it does once
/// the leader stops renewing, after the record stood still for the lease duration by its own
/// clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_skewed_clock_never_takes_the_lease_from_a_healthy_leader() {
    use nestplane_operator::leader::{self, LeaderElection};
    use std::sync::Arc;
    use std::sync::atomic::AtomicI64;
    use tokio_util::sync::CancellationToken;
    let env = Env::start(false).await;
    let kc = env.kubeconfig().to_path_buf();
    let lease = Duration::from_secs(8);
    let le = |id: &str, skew: i64| LeaderElection {
        lease_duration: lease,
        renew_deadline: Duration::from_secs(6),
        retry_period: Duration::from_secs(1),
        clock: nestplane_operator::clock::Clock::offset(Arc::new(AtomicI64::new(skew))),
        ..LeaderElection::new("default", "skewed", id)
    };
    let holder = || {
        kubectl_ok(
            &kc,
            &[
                "get",
                "lease",
                "skewed",
                "-n",
                "default",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
        )
    };
    let shutdown = CancellationToken::new();
    assert!(leader::acquire(&env.client(), &le("a", -3_600), &shutdown).await);
    let (lost, release) = (CancellationToken::new(), CancellationToken::new());
    let keeper = tokio::spawn(leader::keep(
        env.client(),
        le("a", -3_600),
        lost.clone(),
        release.clone(),
    ));
    // b's clock is two hours ahead of a's: a's renewTime looks two hours old to it.
    let took = tokio::time::timeout(
        Duration::from_secs(20),
        leader::acquire(&env.client(), &le("b", 3_600), &shutdown),
    )
    .await;
    assert!(took.is_err(), "b took the lease from a healthy leader");
    assert!(!lost.is_cancelled(), "a lost its lease");
    assert_eq!(holder(), "a");
    // a stops renewing without releasing (as if it hung): b takes over, once the record stood
    // still for the lease duration by b's own clock.
    keeper.abort();
    let started = std::time::Instant::now();
    let took = tokio::time::timeout(
        Duration::from_secs(30),
        leader::acquire(&env.client(), &le("b", 3_600), &shutdown),
    )
    .await;
    assert!(matches!(took, Ok(true)), "b never took over: {took:?}");
    assert!(
        started.elapsed() >= lease,
        "b took over after {:?}",
        started.elapsed()
    );
    assert_eq!(holder(), "b");
}
