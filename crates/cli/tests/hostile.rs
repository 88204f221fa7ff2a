//! A hostile tenant admin (issue 22, hole 3): with nothing but their hosted cluster's admin
//! kubeconfig, they try every way out of a pod onto the machine that was tried by hand
//! (`privileged` + `hostPID` + `hostPath: /` gave root on the host). The node guard enforces
//! the pool's pod security level below the tenant, so each attempt is refused where the
//! tenant sees why (the pod's events), or runs harmlessly (the log shows the confinement).
//! A second hosted cluster's data is untouched throughout. Nothing here writes what a kubelet
//! or controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const IMAGE: &str = "docker.io/library/busybox:1.35";

/// How an attempt must end.
enum Expect {
    /// The node guard refuses it; its events name `.0`.
    Guard(&'static str),
    /// The kubelet refuses it; its events (or its status) name `.0`.
    Kubelet(&'static str),
    /// It runs; its log holds `.0` (what proves it is confined).
    Harmless(&'static str),
}

/// The command of a harmless attempt: prints what confines it.
const PROBE: &str = "grep Seccomp: /proc/self/status; echo kcore=$(head -c 16 /proc/kcore 2>/dev/null | wc -c); unshare -U true 2>&1 || echo unshare-refused; ls /host 2>&1 | head -1; echo done; sleep 3600";

fn pod(name: &str, spec: &str, container: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  terminationGracePeriodSeconds: 1\n{spec}  containers:\n  - name: c\n    image: {IMAGE}\n    imagePullPolicy: Never\n    command: [sh, -c, {probe:?}]\n{container}---\n",
        probe = PROBE
    )
}

fn attempts() -> Vec<(&'static str, String, Expect)> {
    let host_path =
        |path: &str| format!("  volumes: [{{name: h, hostPath: {{path: {path:?}}}}}]\n");
    let mount = "    volumeMounts: [{name: h, mountPath: /host}]\n";
    let caps = |c: &str| format!("    securityContext: {{capabilities: {{add: [{c}]}}}}\n");
    let sandbox = "refused by the node's pod security level Baseline";
    vec![
        (
            "privileged",
            pod("privileged", "", "    securityContext: {privileged: true}\n"),
            Expect::Guard(sandbox),
        ),
        (
            "host-network",
            pod("host-network", "  hostNetwork: true\n", ""),
            Expect::Guard("hostNetwork"),
        ),
        ("host-pid", pod("host-pid", "  hostPID: true\n", ""), Expect::Guard("hostPID")),
        ("host-ipc", pod("host-ipc", "  hostIPC: true\n", ""), Expect::Guard("hostIPC")),
        (
            "root-of-everything",
            pod(
                "root-of-everything",
                &format!("  hostPID: true\n{}", host_path("/")),
                &format!("    securityContext: {{privileged: true}}\n{mount}"),
            ),
            Expect::Guard(sandbox),
        ),
        (
            "hostpath-root",
            pod("hostpath-root", &host_path("/"), mount),
            Expect::Guard("a bind mount of / at /host"),
        ),
        (
            "hostpath-var-lib",
            pod("hostpath-var-lib", &host_path("/var/lib"), mount),
            Expect::Guard("a bind mount of /var/lib at /host"),
        ),
        (
            "hostpath-containerd",
            pod("hostpath-containerd", &host_path("/run/containerd"), mount),
            Expect::Guard("outside the node's pod directories"),
        ),
        (
            "cap-sys-admin",
            pod("cap-sys-admin", "", &caps("SYS_ADMIN")),
            Expect::Guard("CAP_SYS_ADMIN"),
        ),
        (
            "cap-sys-ptrace",
            pod("cap-sys-ptrace", "", &caps("SYS_PTRACE")),
            Expect::Guard("CAP_SYS_PTRACE"),
        ),
        (
            "cap-net-admin",
            pod("cap-net-admin", "", &caps("NET_ADMIN")),
            Expect::Guard("CAP_NET_ADMIN"),
        ),
        (
            "seccomp-unconfined",
            pod(
                "seccomp-unconfined",
                "  securityContext: {seccompProfile: {type: Unconfined}}\n",
                "",
            ),
            Expect::Harmless("Seccomp:\t2"),
        ),
        (
            "apparmor-unconfined",
            pod("apparmor-unconfined", "", "").replace(
                "namespace: default}",
                "namespace: default, annotations: {container.apparmor.security.beta.kubernetes.io/c: unconfined}}",
            ),
            Expect::Harmless("unshare-refused"),
        ),
        (
            "proc-unmasked",
            pod(
                "proc-unmasked",
                "",
                "    securityContext: {procMount: Unmasked}\n",
            ),
            Expect::Harmless("kcore=0"),
        ),
        (
            "host-port",
            pod(
                "host-port",
                "",
                "    ports: [{containerPort: 8080, hostPort: 18080}]\n",
            ),
            Expect::Harmless("done"),
        ),
        (
            "unsafe-sysctl",
            pod(
                "unsafe-sysctl",
                "  securityContext: {sysctls: [{name: kernel.msgmax, value: '1'}]}\n",
                "",
            ),
            Expect::Kubelet("SysctlForbidden"),
        ),
        (
            "subpath-symlink",
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: subpath-symlink, namespace: default}}\nspec:\n  terminationGracePeriodSeconds: 1\n  volumes: [{{name: v, emptyDir: {{}}}}]\n  initContainers:\n  - {{name: link, image: {IMAGE}, imagePullPolicy: Never, command: [ln, -s, /, /v/escape], volumeMounts: [{{name: v, mountPath: /v}}]}}\n  containers:\n  - name: c\n    image: {IMAGE}\n    imagePullPolicy: Never\n    command: [sh, -c, 'ls /host/etc; sleep 3600']\n    volumeMounts: [{{name: v, mountPath: /host, subPath: escape}}]\n---\n"
            ),
            Expect::Kubelet("subpath"),
        ),
    ]
}

/// `Running` when the pod's container runs (a container that is refused over and over still
/// leaves its pod in phase `Running`: the kubelet counts it as restarting), else the phase.
fn phase(kc: &Path, name: &str) -> String {
    let p = jsonpath(
        kc,
        &["pod", name],
        "{.status.phase}/{.status.containerStatuses[0].state.running.startedAt}",
    );
    match p.split_once('/') {
        Some(("Running", started)) if !started.is_empty() => "Running".into(),
        Some(("Running", _)) => "NotStarted".into(),
        Some((phase, _)) => phase.into(),
        None => p,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_admin_cannot_leave_their_pods() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: red, namespace: default}\nspec:\n  release: {version: 1.20.2}\n  initialNodes: 1\n---\napiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: blue, namespace: default}\nspec:\n  release: {version: 1.20.2}\n  initialNodes: 1\n");
    eventually("blue Available", Duration::from_secs(180), || {
        (condition(&kc, &["hostedcluster", "blue"], "Available") == "True").then_some(())
    });
    let blue = hosted_kubeconfig(&kc, "blue", env.state.path());
    kubectl_ok(
        &blue,
        &[
            "create",
            "configmap",
            "ledger",
            "--from-literal=balance=1000",
        ],
    );
    eventually("red's node Ready", Duration::from_secs(240), || {
        (condition(&kc, &["nodepool", "red"], "Ready") == "True").then_some(())
    });
    assert_eq!(
        jsonpath(
            &kc,
            &["nodepool", "red"],
            "{.status.conditions[?(@.type==\"PodSecurity\")].reason}"
        ),
        "Baseline"
    );
    let red = hosted_kubeconfig(&kc, "red", env.state.path());
    // The node's bootstrap token was deleted once it joined: nobody can join with it again.
    eventually(
        "the used bootstrap token deleted",
        Duration::from_secs(60),
        || {
            let types = jsonpath(&red, &["secrets", "-n", "kube-system"], "{.items[*].type}");
            (!types.contains("bootstrap.kubernetes.io/token")).then_some(())
        },
    );

    let attempts = attempts();
    assert!(attempts.len() >= 15);
    let all: String = attempts.iter().map(|(_, y, _)| y.as_str()).collect();
    kubectl_apply(&red, &all);
    // Every attempt is judged as a person would: its phase, its events, its log.
    let judge = |name: &str, expect: &Expect| -> Result<String, String> {
        let events = events_for(&red, "default", name);
        let p = phase(&red, name);
        let seen = || format!("{name}: phase {p:?}, events:\n{events}");
        match expect {
            Expect::Guard(named) => (p != "Running"
                && events.contains("refused by the node's pod security level Baseline")
                && events.contains(named))
            .then(|| {
                format!(
                    "{name}: refused: {}",
                    events.lines().last().unwrap_or_default()
                )
            })
            .ok_or_else(seen),
            Expect::Kubelet(named) => {
                let status = jsonpath(&red, &["pod", name], "{.status}");
                (p != "Running"
                    && (events.to_lowercase().contains(named)
                        || status.to_lowercase().contains(&named.to_lowercase())))
                .then(|| format!("{name}: refused by the kubelet"))
                .ok_or_else(|| format!("{}\nstatus: {status}", seen()))
            }
            Expect::Harmless(shows) => {
                let log =
                    String::from_utf8_lossy(&kubectl(&red, &["logs", name]).stdout).into_owned();
                if p != "Running" || !log.contains("done") {
                    return Err(format!("{}\nlog: {log}", seen()));
                }
                // Whatever it asked for, it runs under the node's seccomp profile, with
                // /proc masked and no host directory.
                for want in [
                    *shows,
                    "Seccomp:\t2",
                    "kcore=0",
                    "unshare-refused",
                    "ls: /host: No such file",
                ] {
                    assert!(
                        log.contains(want),
                        "{name}: {want:?} missing from its log:\n{log}"
                    );
                }
                Ok(format!("{name}: runs confined"))
            }
        }
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let outcomes = loop {
        let results: Vec<Result<String, String>> =
            attempts.iter().map(|(n, _, e)| judge(n, e)).collect();
        if results.iter().all(Result::is_ok) {
            break results.into_iter().map(Result::unwrap).collect::<Vec<_>>();
        }
        if std::time::Instant::now() > deadline {
            let bad: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            panic!("attempts not judged as expected:\n{}", bad.join("\n\n"));
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    };
    // The host port is the node's, in the node's own network namespace: nothing on the
    // machine's own addresses.
    let host_nat = String::from_utf8_lossy(
        &std::process::Command::new("iptables")
            .args(["-t", "nat", "-S"])
            .output()
            .unwrap()
            .stdout,
    )
    .into_owned();
    assert!(!host_nat.contains("18080"), "{host_nat}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", 18080)).is_err());

    let reached = reach_into_blue(&red, &blue).await;

    // The other hosted cluster is untouched.
    assert_eq!(
        jsonpath(&blue, &["configmap", "ledger"], "{.data.balance}"),
        "1000"
    );
    eprintln!("{}\n{}", outcomes.join("\n"), reached.join("\n"));
    assert!(!env.operator.as_ref().unwrap().is_finished());
}

/// The pool's `PodSecurity` condition as `status/reason`.
fn pod_security(kc: &Path, pool: &str) -> String {
    jsonpath(
        kc,
        &["nodepool", pool],
        "{.status.conditions[?(@.type==\"PodSecurity\")].status}/{.status.conditions[?(@.type==\"PodSecurity\")].reason}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privileged_is_an_explicit_choice_that_shows_a_warning() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: open, namespace: default}\nspec:\n  release: {version: 1.20.2}\n---\napiVersion: nestplane.io/v1alpha1\nkind: NodePool\nmetadata: {name: open, namespace: default}\nspec: {clusterName: open, replicas: 0, podSecurity: Privileged}\n");
    // A namespace user cannot choose it: the platform team allows it per namespace.
    eventually("PrivilegedNotAllowed", Duration::from_secs(120), || {
        events_for(&kc, "default", "open")
            .contains("PrivilegedNotAllowed")
            .then_some(())
    });
    assert_ne!(
        jsonpath(
            &kc,
            &["nodepool", "open"],
            "{.status.conditions[?(@.type==\"PodSecurity\")].reason}"
        ),
        "Privileged"
    );
    kubectl_ok(
        &kc,
        &[
            "label",
            "namespace",
            "default",
            "nestplane.io/pod-security-privileged=allowed",
        ],
    );
    eventually("the Warning condition", Duration::from_secs(120), || {
        (pod_security(&kc, "open") == "False/Privileged").then_some(())
    });
    assert!(
        events_for(&kc, "default", "open")
            .contains("Warning Privileged: no pod security is enforced")
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nodepool",
            "open",
            "--type=merge",
            "-p",
            r#"{"spec":{"podSecurity":"Restricted"}}"#,
        ],
    );
    eventually("Restricted enforced", Duration::from_secs(60), || {
        (pod_security(&kc, "open") == "True/Restricted").then_some(())
    });
    let bad = kubectl(
        &kc,
        &[
            "patch",
            "nodepool",
            "open",
            "--type=merge",
            "-p",
            r#"{"spec":{"podSecurity":"Anything"}}"#,
        ],
    );
    assert!(
        !bad.status.success(),
        "an unknown level is refused by the schema"
    );
}

/// `kubectl get --raw PATH`: whether it succeeded, and what it printed.
fn raw(kc: &Path, path: &str) -> (bool, String) {
    let out = kubectl(kc, &["get", "--raw", path, "-v=6"]);
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The attempts that go through red's API server itself. The API server proxies only to an
/// endpoint backed by a pod with that IP, so the tenant admin forges one: a Node object
/// `borrowed` naming blue's node, a pod bound to it whose status (no kubelet writes it) they
/// set to blue's pod's IP, and a Service with hand-written Endpoints naming that pod. Then
/// `services/proxy`, `pods/proxy` and the node proxy. Blue's own API server reaches the same
/// pod and node (so the addresses are right); red's API server, whose cluster traffic goes
/// through its egress proxy, is refused there: those are not red's addresses.
async fn reach_into_blue(red: &Path, blue: &Path) -> Vec<String> {
    eventually("blue's node Ready", Duration::from_secs(240), || {
        let ready = jsonpath(
            blue,
            &["nodes"],
            "{.items[*].status.conditions[?(@.type==\"Ready\")].status}",
        );
        (ready == "True").then_some(())
    });
    kubectl_apply(
        blue,
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: vault, namespace: default}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  - name: c\n    image: {IMAGE}\n    imagePullPolicy: Never\n    command: [sh, -c, 'mkdir /www && echo blue-secret > /www/index.html && exec httpd -f -p 8080 -h /www']\n"
        ),
    );
    let pod_ip = eventually("blue's vault pod", Duration::from_secs(120), || {
        let ip = jsonpath(blue, &["pod", "vault"], "{.status.podIP}");
        (phase(blue, "vault") == "Running" && !ip.is_empty()).then_some(ip)
    });
    let node = jsonpath(blue, &["nodes"], "{.items[0].metadata.name}");
    let node_ip = jsonpath(
        blue,
        &["node", &node],
        "{.status.addresses[?(@.type==\"InternalIP\")].address}",
    );
    // Blue's API server reaches its own pod and node.
    let shown = eventually("blue proxies to its pod", Duration::from_secs(60), || {
        let (ok, out) = raw(blue, "/api/v1/namespaces/default/pods/vault:8080/proxy/");
        (ok && out.contains("blue-secret")).then_some(out)
    });
    assert!(shown.contains("blue-secret"));
    let (ok, out) = raw(blue, &format!("/api/v1/nodes/{node}/proxy/healthz"));
    assert!(ok && out.contains("ok"), "blue's node proxy: {out}");

    kubectl_apply(
        red,
        &format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: borrowed}}\nstatus:\n  addresses: [{{type: InternalIP, address: {node_ip}}}]\n  daemonEndpoints: {{kubeletEndpoint: {{Port: 10250}}}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {{name: forged, namespace: default}}\nspec:\n  nodeName: borrowed\n  containers: [{{name: c, image: {IMAGE}}}]\n"
        ),
    );
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client_for(red).await, "default");
    pods.patch_status(
        "forged",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({
            "status": {"phase": "Running", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}]}
        })),
    )
    .await
    .expect("a tenant admin may write a pod's status");
    kubectl_apply(
        red,
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: steal, namespace: default}}\nspec:\n  ports: [{{port: 80, targetPort: 8080}}]\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: steal, namespace: default}}\nsubsets:\n- addresses: [{{ip: {pod_ip}, targetRef: {{kind: Pod, name: forged, namespace: default}}}}]\n  ports: [{{port: 8080}}]\n"
        ),
    );
    let mut outcomes = Vec::new();
    for (what, path) in [
        (
            "services/proxy to blue's pod",
            "/api/v1/namespaces/default/services/steal/proxy/",
        ),
        (
            "pods/proxy to blue's pod",
            "/api/v1/namespaces/default/pods/forged:8080/proxy/",
        ),
        (
            "node proxy to blue's node",
            "/api/v1/nodes/borrowed/proxy/healthz",
        ),
    ] {
        // The Endpoints may take a moment to reach the API server's cache.
        let (ok, out) = eventually(&format!("{what} tried"), Duration::from_secs(30), || {
            let (ok, out) = raw(red, path);
            (!out.contains("no endpoints available")).then_some((ok, out))
        });
        assert!(
            !ok && !out.contains("blue-secret")
                && out.contains("is not an address of this cluster's nodes, pods or Services"),
            "{what}: red's API server must be refused by its egress proxy:\n{out}"
        );
        outcomes.push(format!("{what}: refused by red's egress proxy"));
    }
    outcomes
}
