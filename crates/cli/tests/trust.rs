//! The trust boundary, attacked as a namespace user would (issue 22): everything such a user
//! can write — Secrets in their namespace, annotations, HostedClusters — is hostile input that
//! may never run code on the host, name a path outside its tenant's directory, or touch
//! another namespace's objects. Each test performs the attack against a real management plane
//! and real tenants, and checks what a person would: the marker file, the directory, the
//! other team's control plane.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::*;

const READY: Duration = Duration::from_secs(120);

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn secret_value(kc: &std::path::Path, name: &str) -> String {
    let out = jsonpath(kc, &["secret", name], "{.data.value}");
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(out.trim())
            .unwrap_or_default(),
    )
    .unwrap_or_default()
}

/// Hole 1: editing `<cluster>-controller-manager-kubeconfig` so its user runs an `exec`
/// plugin used to make the process runtime restart kube-controller-manager with it, and the
/// plugin ran as root. Now the edit is reissued (Event) and never reaches a process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_kubeconfig_secret_is_reissued_never_executed() {
    let env = Env::start(true).await;
    env.create_ncp("default", "victim").await;
    env.wait_ready("default", "victim", READY).await;
    let kc = env.kubeconfig().to_path_buf();
    let secret = "victim-controller-manager-kubeconfig";
    let genuine = secret_value(&kc, secret);
    assert!(genuine.contains("client-certificate-data"), "{genuine}");
    let pid = env
        .pid("default", "victim", "controller-manager", 0)
        .unwrap();

    let marker = env.state.path().join("owned");
    let hostile = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: victim\n  cluster: {{server: 'https://{server}', insecure-skip-tls-verify: true}}\nusers:\n- name: x\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1beta1\n      command: /bin/sh\n      args: ['-c', 'id > {marker}']\ncontexts:\n- name: x\n  context: {{cluster: victim, user: x}}\ncurrent-context: x\n",
        server = jsonpath(&kc, &["ncp", "victim"], "{.spec.controlPlaneEndpoint.host}") + ":6443",
        marker = marker.display()
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "secret",
            secret,
            "--type",
            "merge",
            "-p",
            &serde_json::json!({"data": {"value": b64(&hostile)}}).to_string(),
        ],
    );
    eventually(
        "the edited kubeconfig is reissued",
        Duration::from_secs(90),
        || {
            let v = secret_value(&kc, secret);
            (!v.contains("exec") && v.contains("client-certificate-data")).then_some(())
        },
    );
    eventually(
        "a Warning event says the secret was reissued",
        Duration::from_secs(30),
        || {
            events_for(&kc, "default", "victim")
                .contains(&format!(
                    "SecretReissued: secret {secret} held a kubeconfig"
                ))
                .then_some(())
        },
    );
    // Give a wrongly used kubeconfig time to run its plugin, then look.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        !marker.exists(),
        "the edited kubeconfig's exec plugin ran on the host"
    );
    // No file a tenant process is handed holds the hostile kubeconfig.
    let tenant_dir = env.operator_dir().join("tenants/default/victim");
    let mut stack = vec![tenant_dir.clone()];
    let mut kubeconfigs = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let kind = e.file_type().unwrap();
            if kind.is_dir() {
                stack.push(p);
            } else if kind.is_file() && e.metadata().unwrap().len() < 65536 {
                let text = String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned();
                kubeconfigs += usize::from(text.contains("client-certificate-data"));
                assert!(
                    !text.contains(&marker.display().to_string()),
                    "the hostile kubeconfig reached {}",
                    p.display()
                );
            }
        }
    }
    assert!(
        kubeconfigs > 0,
        "no kubeconfig found under {}",
        tenant_dir.display()
    );
    // The tenant keeps working.
    env.wait_ready("default", "victim", READY).await;
    let tenant = env.tenant_kubeconfig("default", "victim").await;
    kubectl_ok(&tenant, &["get", "ns", "default"]);
    assert!(
        alive(pid)
            || env
                .pid("default", "victim", "controller-manager", 0)
                .is_some()
    );
}

/// Hole 2: a `nestplane.io/cluster-name` annotation set to an absolute path (or a `..` path)
/// named the directory that deleting the control plane removed. Now a name that is no DNS
/// label is `InvalidSpec` before anything is made, and the annotation cannot move a
/// provisioned tenant onto another's directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_name_annotation_never_names_a_path_or_another_tenant() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.create_ncp("default", "victim").await;
    env.wait_ready("default", "victim", READY).await;
    let victim_dir = env.operator_dir().join("tenants/default/victim");
    assert!(victim_dir.is_dir());
    let victim_pid = env.pid("default", "victim", "etcd", 0).unwrap();

    let scratch = env.state.path().join("scratch");
    std::fs::create_dir_all(scratch.join("keep")).unwrap();
    let hostile = [
        ("abs", scratch.display().to_string()),
        ("dotdot", "../default/victim".to_string()),
    ];
    for (name, value) in &hostile {
        env.apply(&format!(
            "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: {name}\n  namespace: default\n  annotations: {{nestplane.io/cluster-name: {value:?}}}\nspec: {{version: v1.20.2}}\n"
        ));
    }
    for (name, _) in &hostile {
        eventually(
            &format!("{name}: InvalidSpec"),
            Duration::from_secs(60),
            || {
                let c = condition(&kc, &["ncp", name], "Available");
                let m = jsonpath(
                    &kc,
                    &["ncp", name],
                    "{.status.conditions[?(@.type==\"Available\")].message}",
                );
                (c == "False" && m.contains("not a DNS label")).then_some(())
            },
        );
        assert_eq!(
            jsonpath(&kc, &["ncp", name], "{.metadata.finalizers}"),
            "",
            "{name}: no finalizer on a refused name"
        );
    }
    for (name, _) in &hostile {
        kubectl_ok(&kc, &["delete", "ncp", name, "--timeout=60s"]);
    }
    assert!(
        scratch.join("keep").is_dir(),
        "the scratch directory survived"
    );
    assert!(victim_dir.is_dir(), "the other tenant's directory survived");

    // A provisioned tenant whose annotation is moved onto another tenant's name keeps its
    // own; deleting it removes its own directory only.
    env.create_ncp("default", "mover").await;
    env.wait_ready("default", "mover", READY).await;
    assert_eq!(
        jsonpath(&kc, &["ncp", "mover"], "{.status.clusterName}"),
        "mover"
    );
    kubectl_ok(
        &kc,
        &[
            "annotate",
            "--overwrite",
            "ncp",
            "mover",
            "nestplane.io/cluster-name=victim",
        ],
    );
    eventually(
        "the moved annotation is refused",
        Duration::from_secs(60),
        || {
            jsonpath(
                &kc,
                &["ncp", "mover"],
                "{.status.conditions[?(@.type==\"Available\")].message}",
            )
            .contains("set the annotation back to \"mover\"")
            .then_some(())
        },
    );
    kubectl_ok(&kc, &["delete", "ncp", "mover", "--timeout=90s"]);
    assert!(!env.operator_dir().join("tenants/default/mover").exists());
    assert!(
        victim_dir.join("victim-etcd-0").is_dir(),
        "victim's data is kept"
    );
    assert!(alive(victim_pid), "victim's etcd still runs");
    env.wait_ready("default", "victim", READY).await;
    let tenant = env.tenant_kubeconfig("default", "victim").await;
    kubectl_ok(&tenant, &["get", "ns", "default"]);
}

/// Hole 4: `HostedCluster prod` in namespace `team` maps to control-plane namespace
/// `team-prod`, where someone else's `NestedControlPlane prod` lived; it got a finalizer and
/// its deletion deleted that control plane. Now it claims before it touches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosted_cluster_never_touches_a_control_plane_it_did_not_make() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: team-prod}\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: prod\n  namespace: team-prod\n  annotations: {cluster.x-k8s.io/paused: \"true\"}\nspec: {version: v1.20.2}\n");
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: prod, namespace: team}\nspec:\n  release: {version: 1.20.2}\n");
    eventually("NamespaceTaken", Duration::from_secs(60), || {
        (jsonpath(
            &kc,
            &["hostedcluster", "prod", "-n", "team"],
            "{.status.conditions[?(@.type==\"ValidConfiguration\")].reason}",
        ) == "NamespaceTaken")
            .then_some(())
    });
    assert!(events_for(&kc, "team", "prod").contains("NamespaceTaken"));
    assert_eq!(
        jsonpath(
            &kc,
            &["hostedcluster", "prod", "-n", "team"],
            "{.metadata.finalizers}"
        ),
        "",
        "no finalizer on a HostedCluster that claimed nothing"
    );
    let before = jsonpath(
        &kc,
        &["ncp", "prod", "-n", "team-prod"],
        "{.metadata.resourceVersion}",
    );
    kubectl_ok(
        &kc,
        &[
            "delete",
            "hostedcluster",
            "prod",
            "-n",
            "team",
            "--timeout=60s",
        ],
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "prod", "-n", "team-prod"],
            "{.metadata.resourceVersion}/{.metadata.deletionTimestamp}"
        ),
        format!("{before}/"),
        "the other team's control plane is untouched"
    );
    assert!(!env.operator.as_ref().unwrap().is_finished());
}

/// A host process (a tenant API server calling a webhook's Service address, anything aiming at
/// a gone node's pods) used to send such packets to the default gateway, off the machine.
/// With the operator running, every range nestplane hands out is unreachable here unless a
/// live node or plane routes it: the packet fails on the machine, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_packet_for_a_range_nestplane_hands_out_never_leaves_the_machine() {
    let _env = Env::start(true).await;
    // The operator installs the routes as it starts.
    let addresses = [
        "10.96.0.10",   // a hosted cluster's DNS Service (default service range)
        "10.0.0.1",     // the management plane's first Service address
        "10.160.0.1",   // a management plane with nodes that is gone
        "10.201.250.2", // a node that is gone
        "10.244.250.7", // a pod of a node that is gone
    ];
    for addr in addresses {
        let route = eventually(
            &format!("{addr} unreachable"),
            Duration::from_secs(30),
            || {
                let out = std::process::Command::new("ip")
                    .args(["route", "get", addr])
                    .output()
                    .expect("ip (iproute2) not found: run scripts/install-deps.sh");
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                (!out.status.success() && text.contains("No route to host")).then_some(text)
            },
        );
        assert!(!route.contains("via"), "{addr}: {route}");
        let err = std::net::TcpStream::connect_timeout(
            &format!("{addr}:443").parse().unwrap(),
            Duration::from_secs(5),
        )
        .expect_err("nothing answers there");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::HostUnreachable,
            "{addr}: the connection must fail on this machine, not time out elsewhere: {err}"
        );
    }
}

/// The real, effective, saved and filesystem uids of `pid`, and its supplementary groups.
fn ids(pid: u32) -> (Vec<u32>, String) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let uids = field("Uid:")
        .split_whitespace()
        .map(|u| u.parse().unwrap())
        .collect();
    (uids, field("Groups:"))
}

/// Run `program args` as `user` in `cwd` (entered before the switch, as the runtime does):
/// whether it succeeded, and its output.
fn as_user(
    user: nestplane_runtime::egress::User,
    cwd: &std::path::Path,
    program: &str,
    args: &[&str],
) -> (bool, String) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let spec = nestplane_runtime::child::Spec {
        name: "attempt".into(),
        program: program.into(),
        args: args.iter().map(|a| a.to_string()).collect(),
        log: log.path().to_path_buf(),
        cwd: Some(cwd.to_path_buf()),
        user: Some(user),
        ..Default::default()
    };
    let (mut cmd, _exe) = nestplane_runtime::child::command(&spec).unwrap();
    let ok = cmd.status().unwrap().success();
    (ok, std::fs::read_to_string(log.path()).unwrap())
}

/// A veth pair whose one end holds an address of this machine that is not loopback; removed
/// on drop.
struct LocalAddress(&'static str);

impl LocalAddress {
    fn add(name: &'static str, cidr: &str) -> LocalAddress {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", name])
            .output();
        for args in [
            vec![
                "link",
                "add",
                name,
                "type",
                "veth",
                "peer",
                "name",
                "np-egress-p",
            ],
            vec!["addr", "add", cidr, "dev", name],
            vec!["link", "set", name, "up"],
            vec!["link", "set", "np-egress-p", "up"],
        ] {
            let out = std::process::Command::new("ip")
                .args(&args)
                .output()
                .expect("ip (iproute2) not found: run scripts/install-deps.sh");
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        }
        LocalAddress(name)
    }
}

impl Drop for LocalAddress {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", self.0])
            .output();
    }
}

/// Process-runtime control planes used to run as root: a tenant API server's `services/proxy`
/// or node proxy reached whatever the host reaches, and any of its processes could read every
/// tenant's keys. Now each tenant's processes run as a user of their own, own their key files
/// (0600), cannot read another tenant's or plant a link where the operator writes, and their
/// packets reach loopback and their own nodes only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenant_runs_as_its_own_user_and_reaches_only_its_own() {
    let env = Env::start(true).await;
    env.create_ncp("default", "alpha").await;
    env.create_ncp("default", "beta").await;
    env.wait_ready("default", "alpha", READY).await;
    env.wait_ready("default", "beta", READY).await;

    // Every process of a tenant runs as one unprivileged user with no extra groups; the two
    // tenants' users differ.
    let mut users = Vec::new();
    for cluster in ["alpha", "beta"] {
        let mut seen = std::collections::BTreeSet::new();
        for component in ["etcd", "apiserver", "controller-manager", "scheduler"] {
            let pid = env.pid("default", cluster, component, 0).unwrap();
            let (uids, groups) = ids(pid);
            assert!(
                uids.iter().all(|u| *u == uids[0] && *u != 0),
                "{cluster} {component}: uids {uids:?}"
            );
            assert_eq!(groups, "", "{cluster} {component}: supplementary groups");
            seen.insert(uids[0]);
        }
        assert_eq!(seen.len(), 1, "{cluster}: one user for all components");
        users.push(*seen.first().unwrap());
    }
    assert_ne!(users[0], users[1]);
    let alpha = nestplane_runtime::egress::User {
        uid: users[0],
        gid: users[0],
    };

    // Its key files are its own, 0600.
    let tenants = env.operator_dir().join("tenants").join("default");
    let mut keys = 0;
    let mut stack = vec![tenants.join("alpha")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            if meta.is_dir() {
                stack.push(e.path());
            } else if e.file_name().to_string_lossy().ends_with(".key") {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                assert_eq!(meta.uid(), alpha.uid, "{}", e.path().display());
                assert_eq!(meta.permissions().mode() & 0o777, 0o600);
                keys += 1;
            }
        }
    }
    assert!(keys >= 5, "{keys} key files");

    // Alpha's user, where its API server runs, cannot read beta's serving key (by either
    // path), nor put a link where the operator writes its certificates.
    let cwd = tenants.join("alpha").join("alpha-apiserver-0");
    let beta_key = tenants.join("beta/beta-apiserver-0/volumes/apiserver-serving/tls.key");
    assert!(beta_key.is_file(), "the attack aims at a real file");
    for path in [
        "../../beta/beta-apiserver-0/volumes/apiserver-serving/tls.key".to_string(),
        beta_key.display().to_string(),
    ] {
        let (ok, out) = as_user(alpha, &cwd, "/bin/cat", &[&path]);
        assert!(!ok && out.contains("Permission denied"), "{path}: {out}");
    }
    let (ok, out) = as_user(
        alpha,
        &cwd,
        "/bin/ln",
        &["-sf", "/etc/shadow", "volumes/apiserver-serving/tls.crt"],
    );
    assert!(!ok && out.contains("Permission denied"), "{out}");
    let (ok, out) = as_user(
        alpha,
        &cwd,
        "/bin/cat",
        &["volumes/apiserver-serving/tls.key"],
    );
    assert!(ok && out.contains("PRIVATE KEY"), "its own key: {out}");

    // Its packets reach loopback, and not an address of this machine outside it (nor,
    // therefore, anything beyond it). The listener is the test's own.
    let _dummy = LocalAddress::add("np-egress-t", "10.250.255.1/32");
    let outside = std::net::TcpListener::bind("10.250.255.1:0").unwrap();
    let inside = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let connect = |user: Option<nestplane_runtime::egress::User>, addr: std::net::SocketAddr| {
        let script = format!("exec 3<>/dev/tcp/{}/{}", addr.ip(), addr.port());
        match user {
            Some(u) => as_user(u, &cwd, "/bin/bash", &["-c", &script]),
            None => {
                let out = std::process::Command::new("/bin/bash")
                    .args(["-c", &script])
                    .output()
                    .unwrap();
                (
                    out.status.success(),
                    String::from_utf8_lossy(&out.stderr).into(),
                )
            }
        }
    };
    let (ok, out) = connect(None, outside.local_addr().unwrap());
    assert!(ok, "the operator's user reaches it: {out}");
    let (ok, out) = connect(Some(alpha), inside.local_addr().unwrap());
    assert!(ok, "alpha reaches loopback: {out}");
    let (ok, out) = connect(Some(alpha), outside.local_addr().unwrap());
    assert!(!ok && out.contains("refused"), "alpha is stopped: {out}");

    // Its API server's egress socket (its cluster traffic: this tenant has no node here, so
    // it is connected from the host as alpha's user) is alpha's alone, 0600; through it,
    // alpha reaches no more than its own packets do: not the outside address, not loopback.
    // Beta's user cannot even reach it (the proxy would also refuse a peer of another uid:
    // nestplane_nodes::egress's unit tests).
    let socket = cwd.join("egress.sock");
    {
        use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
        let meta = std::fs::symlink_metadata(&socket).expect("the egress socket");
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.uid(), alpha.uid);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }
    let ask = |user, target: &str| {
        let script = format!(
            "printf 'CONNECT {target} HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n' | socat -t 15 - UNIX-CONNECT:egress.sock"
        );
        as_user(user, &cwd, "/bin/bash", &["-c", &script])
    };
    let (_, out) = ask(alpha, &outside.local_addr().unwrap().to_string());
    assert!(
        out.starts_with("HTTP/1.1 502 ") && out.contains("refused"),
        "alpha's egress to the outside address: {out}"
    );
    let (_, out) = ask(alpha, &inside.local_addr().unwrap().to_string());
    assert!(
        out.starts_with("HTTP/1.1 403 127.0.0.1 is a loopback address"),
        "alpha's egress to loopback: {out}"
    );
    let beta = nestplane_runtime::egress::User {
        uid: users[1],
        gid: users[1],
    };
    let (ok, out) = as_user(
        beta,
        &std::path::PathBuf::from("/"),
        "/usr/bin/socat",
        &["-", &format!("UNIX-CONNECT:{}", socket.display())],
    );
    assert!(!ok && out.contains("Permission denied"), "beta: {out}");

    // A process a tenant's process forked away does not outlive the tenant (nor wait for its
    // uid to be handed to the next one).
    let (ok, out) = as_user(
        alpha,
        &cwd,
        "/bin/sh",
        &["-c", "setsid sleep 1000 </dev/null >/dev/null 2>&1 &"],
    );
    assert!(ok, "{out}");
    let of_alpha = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                // A zombie is dead already; a process may go while it is read.
                std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                    !s.contains("State:\tZ")
                        && s.lines()
                            .find_map(|l| l.strip_prefix("Uid:"))
                            .and_then(|u| u.split_whitespace().next())
                            == Some(alpha.uid.to_string().as_str())
                })
            })
            .count()
    };
    assert!(of_alpha() >= 5, "the components and the forked process");
    kubectl_ok(env.kubeconfig(), &["delete", "ncp", "alpha", "--wait=true"]);
    eventually(
        "nothing of alpha's user left",
        Duration::from_secs(60),
        || (of_alpha() == 0).then_some(()),
    );
}
