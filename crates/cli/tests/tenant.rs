//! End to end: real tenant control planes from `NestedControlPlane` objects, run by the
//! process runtime, used with kubectl.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use nestplane_api::conditions;
use nestplane_api::{NestedAPIServer, NestedEtcd};

const READY: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_from_samples_works_with_kubectl_and_survives_kill_9() {
    let env = Env::start(true).await;
    let samples =
        std::fs::read_to_string(repo().join("config/samples/nestedcontrolplane.yaml")).unwrap();
    env.apply(&samples);
    let ncp = env.wait_ready("default", "sample", READY).await;

    // The contract, both generations.
    let st = ncp.status.clone().unwrap();
    assert!(st.ready && st.initialized && st.external_managed_control_plane);
    assert_eq!(
        st.initialization.unwrap().control_plane_initialized,
        Some(true)
    );
    assert_eq!(st.version.as_deref(), Some("v1.20.2"));
    assert_eq!(
        (
            st.replicas,
            st.ready_replicas,
            st.available_replicas,
            st.up_to_date_replicas,
            st.unavailable_replicas
        ),
        (Some(1), Some(1), Some(1), Some(1), Some(0))
    );
    assert!(conditions::is_true(&st.conditions, "Available"));
    let ep = ncp
        .spec
        .control_plane_endpoint
        .clone()
        .expect("the provider sets the endpoint");
    assert!(ep.host.starts_with("127.") && ep.port == 6443, "{ep:?}");

    // Components: owned by the control plane, Ready, with the seed's status fields.
    let etcd: NestedEtcd = Api::namespaced(env.client(), "default")
        .get("sample-etcd")
        .await
        .unwrap();
    assert_eq!(etcd.owner_references()[0].name, "sample");
    let es = etcd.status.unwrap();
    assert!(es.common.ready);
    assert_eq!(es.addresses.len(), 1);
    assert_eq!(es.addresses[0].port, 2379);
    let apiserver: NestedAPIServer = Api::namespaced(env.client(), "default")
        .get("sample-apiserver")
        .await
        .unwrap();
    let svc = apiserver
        .status
        .unwrap()
        .apiserver_service
        .expect("apiserverService");
    assert_eq!(svc.name.as_deref(), Some("sample-apiserver"));
    kubectl_ok(env.kubeconfig(), &["get", "service", "sample-apiserver"]);

    // Cluster API secrets.
    for suffix in ["ca", "etcd", "proxy", "sa", "kubeconfig"] {
        let s = env
            .secret("default", &format!("sample-{suffix}"))
            .await
            .unwrap_or_else(|| panic!("sample-{suffix}"));
        assert_eq!(
            s.type_.as_deref(),
            Some("cluster.x-k8s.io/secret"),
            "{suffix}"
        );
        assert_eq!(
            s.labels()
                .get("cluster.x-k8s.io/cluster-name")
                .map(String::as_str),
            Some("sample")
        );
        let owner = &s.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("NestedControlPlane", "sample", Some(true))
        );
        let keys: Vec<&String> = s.data.as_ref().unwrap().keys().collect();
        if suffix == "kubeconfig" {
            assert!(keys.contains(&&"value".to_string()));
        } else {
            assert!(
                keys.contains(&&"tls.crt".to_string()) && keys.contains(&&"tls.key".to_string()),
                "{suffix}: {keys:?}"
            );
        }
    }

    // The kubeconfig works with kubectl.
    let tkc = env.tenant_kubeconfig("default", "sample").await;
    let ns = kubectl_ok(&tkc, &["get", "ns", "-o", "name"]);
    assert!(ns.contains("namespace/kube-system"), "{ns}");
    kubectl_ok(&tkc, &["create", "namespace", "survivor"]);
    // The controller-manager and scheduler are really working: a ServiceAccount token
    // controller fills the default account in a new namespace.
    eventually(
        "the tenant controller-manager creates the default ServiceAccount",
        Duration::from_secs(30),
        || {
            kubectl(
                &tkc,
                &["get", "serviceaccount", "default", "-n", "survivor"],
            )
            .status
            .success()
            .then_some(())
        },
    );

    // A tenant's own etcd and the management plane's are current (older ones have published
    // authorization bypasses).
    let etcd = env.pid("default", "sample", "etcd", 0).expect("pid file");
    let exe = std::path::PathBuf::from(format!("/proc/{etcd}/exe"));
    assert_current_etcd("a tenant's own etcd", &etcd_version_of(&exe));
    let management = env
        .plane
        .pids()
        .into_iter()
        .find(|(n, _)| n == "etcd")
        .expect("the management plane's etcd")
        .1;
    let exe = std::path::PathBuf::from(format!("/proc/{management}/exe"));
    assert_current_etcd("the management plane's etcd", &etcd_version_of(&exe));

    // kill -9 the tenant apiserver and etcd: they come back, and so does the data.
    for component in ["apiserver", "etcd"] {
        let pid = env
            .pid("default", "sample", component, 0)
            .expect("pid file");
        assert!(alive(pid));
        kill9(pid);
        eventually(
            &format!("{component} restarted"),
            Duration::from_secs(30),
            || {
                env.pid("default", "sample", component, 0)
                    .filter(|p| *p != pid && alive(*p))
            },
        );
    }
    eventually(
        "the namespace is still there",
        Duration::from_secs(60),
        || {
            let out = kubectl(&tkc, &["get", "ns", "survivor", "-o", "name"]);
            out.status.success().then_some(())
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_member_etcd_is_a_real_cluster() {
    let env = Env::start(true).await;
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedEtcd\nmetadata:\n  name: ha-etcd\n  namespace: default\nspec:\n  replicas: 3\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: ha\n  namespace: default\nspec:\n  etcd:\n    apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\n    kind: NestedEtcd\n    name: ha-etcd\n",
    );
    env.wait_ready("default", "ha", READY).await;
    let etcd: NestedEtcd = Api::namespaced(env.client(), "default")
        .get("ha-etcd")
        .await
        .unwrap();
    let st = etcd.status.unwrap();
    assert_eq!(st.common.ready_replicas, Some(3));
    assert_eq!(st.addresses.len(), 3);

    // etcdctl with the apiserver's issued etcd client certificate.
    let endpoints: Vec<String> = st
        .addresses
        .iter()
        .map(|a| format!("https://{}:{}", a.ip.as_deref().unwrap(), a.port))
        .collect();
    let etcd = env.etcdctl("default", "ha", endpoints).await;
    let etcdctl = |args: &[&str]| {
        let (ok, out, err) = etcd.run(args);
        (ok, out + &err)
    };
    let (ok, members) = etcdctl(&["member", "list", "-w", "simple"]);
    assert!(ok, "{members}");
    assert_eq!(
        members.lines().filter(|l| l.contains("started")).count(),
        3,
        "{members}"
    );
    let (ok, health) = etcdctl(&["endpoint", "health"]);
    assert!(ok, "{health}");
    assert_eq!(health.matches("is healthy").count(), 3, "{health}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_are_isolated_and_deletion_cleans_up() {
    let env = Env::start(true).await;
    env.create_ncp("default", "red").await;
    env.create_ncp("default", "blue").await;
    let red = env.wait_ready("default", "red", READY).await;
    let blue = env.wait_ready("default", "blue", READY).await;
    assert_ne!(
        red.spec.control_plane_endpoint, blue.spec.control_plane_endpoint,
        "addresses never clash"
    );

    let red_kc = env.tenant_kubeconfig("default", "red").await;
    let blue_kc = env.tenant_kubeconfig("default", "blue").await;
    kubectl_ok(&red_kc, &["create", "namespace", "only-red"]);
    kubectl_ok(&blue_kc, &["create", "namespace", "only-blue"]);
    assert!(kubectl(&red_kc, &["get", "ns", "only-blue"]).status.code() != Some(0));
    assert!(kubectl(&blue_kc, &["get", "ns", "only-red"]).status.code() != Some(0));
    // One tenant's credentials are not accepted by the other.
    let red_server = red.spec.control_plane_endpoint.clone().unwrap();
    let out = kubectl(
        &blue_kc,
        &[
            "--server",
            &format!("https://{}:{}", red_server.host, red_server.port),
            "--insecure-skip-tls-verify",
            "get",
            "ns",
        ],
    );
    assert!(
        !out.status.success(),
        "blue's certificate must not work on red"
    );

    // Delete red: its processes stop, its secrets and data go; blue is untouched.
    let pids: Vec<u32> = ["etcd", "apiserver", "controller-manager", "scheduler"]
        .iter()
        .map(|c| {
            env.pid("default", "red", c, 0)
                .unwrap_or_else(|| panic!("{c} pid"))
        })
        .collect();
    env.ncps("default")
        .delete("red", &DeleteParams::default())
        .await
        .unwrap();
    eventually("red is gone", Duration::from_secs(60), || {
        let out = kubectl(env.kubeconfig(), &["get", "ncp", "red"]);
        (!out.status.success()).then_some(())
    });
    for pid in pids {
        assert!(!alive(pid), "process {pid} of red still runs");
    }
    let secrets: Api<Secret> = Api::namespaced(env.client(), "default");
    let left = secrets
        .list(&ListParams::default().labels("cluster.x-k8s.io/cluster-name=red"))
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "red's secrets remain: {:?}",
        left.items.iter().map(|s| s.name_any()).collect::<Vec<_>>()
    );
    assert!(
        !env.operator_dir().join("tenants/default/red").exists(),
        "red's data remains"
    );
    kubectl_ok(&blue_kc, &["get", "ns", "only-blue"]);
    assert!(env.secret("default", "blue-ca").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_conditions_and_events_and_others_keep_working() {
    let env = Env::start(true).await;
    // A version with no binaries.
    env.apply("apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: future\n  namespace: default\nspec:\n  version: \"1.33.0\"\n");
    // A name too long for derived names (40 characters; 33 fit).
    let long = "a-control-plane-name-that-is-far-too-lon";
    env.apply(&format!("apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: {long}\n  namespace: default\nspec: {{}}\n"));
    // A reference to a component that does not exist.
    env.apply("apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: dangling\n  namespace: default\nspec:\n  etcd:\n    apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\n    kind: NestedEtcd\n    name: no-such-etcd\n");
    // And a good one, which must become ready regardless.
    env.create_ncp("default", "good").await;
    env.wait_ready("default", "good", READY).await;

    let kc = env.kubeconfig().to_path_buf();
    let condition = |kind: &str, name: &str, type_: &str| {
        kubectl_ok(
            &kc,
            &[
                "get",
                kind,
                name,
                "-o",
                &format!(
                    "jsonpath={{.status.conditions[?(@.type==\"{type_}\")].reason}}|{{.status.conditions[?(@.type==\"{type_}\")].message}}"
                ),
            ],
        )
    };
    let got = eventually(
        "future's apiserver reports the missing binary",
        Duration::from_secs(60),
        || {
            let c = condition("nestedapiserver", "future-apiserver", "Ready");
            c.starts_with("VersionUnavailable|").then_some(c)
        },
    );
    assert!(
        got.contains("kube-apiserver")
            && got.contains("v1.33.0")
            && got.contains("NESTPLANE_BIN_DIR"),
        "{got}"
    );
    let ev = eventually(
        "an event for the missing binary",
        Duration::from_secs(30),
        || {
            let e = events_for(&kc, "default", "future-apiserver");
            e.contains("Warning VersionUnavailable").then_some(e)
        },
    );
    assert!(ev.contains("kube-apiserver"), "{ev}");

    let got = eventually("the long name is refused", Duration::from_secs(30), || {
        let c = condition("ncp", long, "Available");
        c.starts_with("InvalidSpec|").then_some(c)
    });
    assert!(got.contains("at most 33"), "{got}");
    let failure = kubectl_ok(
        &kc,
        &["get", "ncp", long, "-o", "jsonpath={.status.failureReason}"],
    );
    assert_eq!(failure, "InvalidSpec");
    eventually(
        "an event for the long name",
        Duration::from_secs(30),
        || {
            events_for(&kc, "default", long)
                .contains("Warning InvalidSpec")
                .then_some(())
        },
    );
    assert!(
        env.secret("default", &format!("{long}-ca")).await.is_none(),
        "nothing is created for an invalid control plane"
    );

    let got = eventually(
        "the dangling reference is reported",
        Duration::from_secs(30),
        || {
            let c = condition("ncp", "dangling", "Available");
            c.starts_with("ReferenceNotFound|").then_some(c)
        },
    );
    assert!(got.contains("no-such-etcd"), "{got}");
    // A reference that may still appear is not a terminal failure for Cluster API.
    let failure = kubectl_ok(
        &kc,
        &[
            "get",
            "ncp",
            "dangling",
            "-o",
            "jsonpath={.status.failureReason}",
        ],
    );
    assert_eq!(failure, "", "failureReason is for what a person must fix");
    eventually(
        "an event for the dangling reference",
        Duration::from_secs(30),
        || {
            events_for(&kc, "default", "dangling")
                .contains("Warning ReferenceNotFound")
                .then_some(())
        },
    );

    // Fixing the input heals it: create the missing etcd.
    env.apply("apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedEtcd\nmetadata:\n  name: no-such-etcd\n  namespace: default\nspec: {}\n");
    env.wait_ready("default", "dangling", READY).await;

    // A version change that cannot be made moves nothing: two minors at once, a patch with
    // no binaries here, a version out of range (a minor down needs a newer minor to run first,
    // which this machine has no binaries for: unit-tested in tenant.rs). Every process of
    // "good" keeps running (same pids, watched for 5 s after the refusal shows, while the
    // components' passes for the change run), every component stays Ready at v1.20.2, the
    // tenant answers, and its control plane says why in `Upgrading`, with a Warning Event.
    let parts = ["etcd", "apiserver", "controller-manager", "scheduler"];
    let pids = |env: &Env| -> Vec<Option<u32>> {
        parts
            .iter()
            .map(|p| env.pid("default", "good", p, 0))
            .collect()
    };
    let before = pids(&env);
    assert!(before.iter().all(Option::is_some), "{before:?}");
    let good_kc = env.tenant_kubeconfig("default", "good").await;
    let set_version = |version: &str| {
        let patch = format!("{{\"spec\":{{\"version\":\"{version}\"}}}}");
        kubectl_ok(&kc, &["patch", "ncp", "good", "--type=merge", "-p", &patch]);
    };
    // The attack: the namespace user writes the rendered-version annotation, naming a version
    // two minors ahead, to carry the refused changes below through the gate.
    kubectl_ok(
        &kc,
        &[
            "annotate",
            "nestedapiserver",
            "good-apiserver",
            "nestplane.io/rendered-version=v1.22.0",
        ],
    );
    for (version, reason, says) in [
        ("v1.22.0", "MinorSkipRefused", "set a 1.21 version first"),
        ("v1.20.9", "VersionUnavailable", "v1.20.9"),
        ("v1.19.0", "VersionUnavailable", "v1.19.0"),
    ] {
        set_version(version);
        let got = eventually(
            &format!("good refuses {version}"),
            Duration::from_secs(30),
            || {
                let c = condition("ncp", "good", "Upgrading");
                // (the message too: the change before may have had the same reason)
                (c.starts_with(&format!("{reason}|")) && c.contains(says)).then_some(c)
            },
        );
        assert!(
            got.contains(says) && got.contains("keeps the version it runs"),
            "{got}"
        );
        eventually(
            &format!("a Warning Event for {version}"),
            Duration::from_secs(30),
            || {
                events_for(&kc, "default", "good")
                    .contains(&format!("Warning {reason}"))
                    .then_some(())
            },
        );
        for _ in 0..10 {
            assert_eq!(pids(&env), before, "a process was restarted for {version}");
            std::thread::sleep(Duration::from_millis(500));
        }
        let recorded = kubectl_ok(
            &kc,
            &[
                "get",
                "ncp",
                "good",
                "-o",
                "jsonpath={.status.upgrade.phase}|{.status.upgrade.to}",
            ],
        );
        assert_eq!(recorded, format!("Refused|{version}"));
        kubectl_ok(&good_kc, &["get", "--raw", "/version"]);
        for (kind, part) in [
            ("nestedetcd", "etcd"),
            ("nestedapiserver", "apiserver"),
            ("nestedcontrollermanager", "controller-manager"),
            ("nestedscheduler", "scheduler"),
        ] {
            let got = kubectl_ok(
                &kc,
                &[
                    "get",
                    kind,
                    &format!("good-{part}"),
                    "-o",
                    "jsonpath={.status.ready}/{.status.version}",
                ],
            );
            assert_eq!(got, "true/v1.20.2", "{kind} with {version} asked for");
        }
        let available = kubectl_ok(
            &kc,
            &[
                "get",
                "ncp",
                "good",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Available\")].status}",
            ],
        );
        assert_eq!(available, "True", "good with {version} asked for");
    }
    // Asked for what runs again: nothing pending, nothing moved.
    set_version("v1.20.2");
    eventually("Upgrading is gone", Duration::from_secs(30), || {
        condition("ncp", "good", "Upgrading").eq("|").then_some(())
    });
    assert_eq!(pids(&env), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_killed_mid_creation_converges_with_the_same_ca() {
    let env = Env::start(false).await;
    std::fs::write(
        env.state.path().join("mgmt.kubeconfig"),
        env.plane.kubeconfig(),
    )
    .unwrap();
    let spawn_operator = || {
        nestplane()
            .args([
                "operator",
                "--metrics-bind-address",
                "127.0.0.1:0",
                "--state-dir",
            ])
            .arg(env.operator_dir())
            .env("KUBECONFIG", env.state.path().join("mgmt.kubeconfig"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map(KillOnDrop)
            .unwrap()
    };
    let op = spawn_operator();
    env.create_ncp("default", "phoenix").await;
    // Mid-creation: the CA exists, the tenant is not ready yet.
    let ca_before = eventually("the cluster CA is created", Duration::from_secs(60), || {
        let out = kubectl(
            env.kubeconfig(),
            &["get", "secret", "phoenix-ca", "-o", "jsonpath={.data}"],
        );
        (out.status.success() && !out.stdout.is_empty())
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    let etcd_ca_before = kubectl_ok(
        env.kubeconfig(),
        &["get", "secret", "phoenix-etcd", "-o", "jsonpath={.data}"],
    );
    let etcd_pid = env.pid("default", "phoenix", "etcd", 0);
    op.kill(); // SIGKILL
    if let Some(pid) = etcd_pid {
        eventually(
            "tenant processes die with the operator",
            Duration::from_secs(10),
            || (!alive(pid)).then_some(()),
        );
    }

    let op = spawn_operator();
    env.wait_ready("default", "phoenix", READY).await;
    let ca_after = kubectl_ok(
        env.kubeconfig(),
        &["get", "secret", "phoenix-ca", "-o", "jsonpath={.data}"],
    );
    let etcd_ca_after = kubectl_ok(
        env.kubeconfig(),
        &["get", "secret", "phoenix-etcd", "-o", "jsonpath={.data}"],
    );
    assert_eq!(ca_before, ca_after, "the cluster CA is byte-identical");
    assert_eq!(
        etcd_ca_before, etcd_ca_after,
        "the etcd CA is byte-identical"
    );
    let tkc = env.tenant_kubeconfig("default", "phoenix").await;
    // Status written before the kill may still say Ready for a moment: retry until the
    // restarted processes answer.
    eventually("the tenant accepts writes", Duration::from_secs(60), || {
        kubectl(&tkc, &["create", "namespace", "kept"])
            .status
            .success()
            .then_some(())
    });

    // Restart once more: same CA, same data.
    op.kill();
    let op = spawn_operator();
    env.wait_ready("default", "phoenix", READY).await;
    eventually(
        "data survives the operator restart",
        Duration::from_secs(60),
        || {
            kubectl(&tkc, &["get", "ns", "kept"])
                .status
                .success()
                .then_some(())
        },
    );
    op.kill();
}

/// Register `versions` as versions of Kubernetes backed by this machine's 1.20.2 binaries
/// (only 1.20.2 is built here): a bin directory with everything of `$NESTPLANE_BIN_DIR` and a
/// `vX.Y.Z/` directory of the three server binaries per version, made this process's
/// `NESTPLANE_BIN_DIR`. Called first thing in a test (nextest runs each test in its own
/// process), before anything reads the environment.
fn register_versions(versions: &[&str]) -> tempfile::TempDir {
    use std::os::unix::fs::{PermissionsExt, symlink};
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let real = std::env::var_os("NESTPLANE_BIN_DIR")
        .map(std::path::PathBuf::from)
        .expect("NESTPLANE_BIN_DIR (run scripts/install-deps.sh; scripts/test.sh sets it)");
    for entry in std::fs::read_dir(&real).unwrap().flatten() {
        symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    for version in versions {
        let versioned = dir.path().join(version);
        std::fs::create_dir(&versioned).unwrap();
        for name in [
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            let binary = nestplane_runtime::binaries::kubernetes(name, "v1.20.2")
                .unwrap_or_else(|e| panic!("{e}"));
            symlink(binary, versioned.join(name)).unwrap();
        }
    }
    // SAFETY: the test has not started anything that reads the environment yet.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("NESTPLANE_BIN_DIR", dir.path());
    }
    dir
}

/// When process `pid` started, in clock ticks since boot (`/proc/PID/stat`'s 22nd field).
fn started(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    after_name.split(' ').nth(19).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_moves_the_parts_in_order_drops_no_request_at_the_gateway_and_reports_its_steps()
{
    // v1.21.0 and v1.22.0 (backed by the same 1.20.2 binaries) are offered as steps; the
    // change to them is refused by the removed-API check before anything moves, so their
    // 1.21/1.22 renderings never run on 1.20 binaries.
    let _bin = register_versions(&["v1.20.3", "v1.21.0", "v1.22.0"]);
    let mut env = Env::start(false).await;
    env.start_operator_with_published_gateway("*");
    env.apply("apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: up\n  namespace: default\nspec:\n  version: v1.20.2\n  replicas: 2\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: other\n  namespace: default\nspec: {}\n");
    env.wait_ready("default", "up", READY).await;
    env.wait_ready("default", "other", READY).await;
    let kc = env.kubeconfig().to_path_buf();

    // Both tenants behind the gateway's one port, each reached by its own name with its own
    // kubeconfig; a name nobody has is reset; one tenant's name with the other's CA fails
    // verification (the gateway never terminates TLS: the named tenant's own certificate is
    // what the client sees).
    let gateway = |name: &str| -> (String, String) {
        let got = jsonpath(
            &kc,
            &["ncp", name],
            "{.status.gateway.server} {.status.gateway.serverName}",
        );
        let (server, sni) = got.split_once(' ').expect("status.gateway");
        (server.to_string(), sni.to_string())
    };
    let (server, up_name) = gateway("up");
    let (other_server, other_name) = gateway("other");
    assert_eq!(server, other_server, "one address for every tenant");
    assert_eq!(up_name, "up.default.nestplane.internal");
    let tkc = env.tenant_kubeconfig("default", "up").await;
    let okc = env.tenant_kubeconfig("default", "other").await;
    // The gateway is the endpoint Cluster API and users are given: `controlPlaneEndpoint`,
    // the ClusterEndpoint and the published kubeconfig (with the tenant's name there as
    // `tls-server-name`), which works as it is.
    let address = server.trim_start_matches("https://");
    for (name, kubeconfig, sni) in [("up", &tkc, &up_name), ("other", &okc, &other_name)] {
        let endpoint = jsonpath(
            &kc,
            &["ncp", name],
            "{.spec.controlPlaneEndpoint.host}:{.spec.controlPlaneEndpoint.port}",
        );
        assert_eq!(endpoint, address, "{name}");
        let published = jsonpath(
            &kc,
            &["clusterendpoint", &format!("{name}-apiserver")],
            "{.spec.host}:{.spec.port} {.spec.serverName}",
        );
        assert_eq!(published, format!("{address} {sni}"), "{name}");
        let text = std::fs::read_to_string(kubeconfig).unwrap();
        assert!(
            text.contains(server.as_str())
                && text.contains("tls-server-name:")
                && text.contains(sni.as_str()),
            "{text}"
        );
        let out = kubectl(kubeconfig, &["get", "ns", "default", "-o", "name"]);
        assert!(
            out.status.success(),
            "{name}'s kubeconfig as published: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let through = |kubeconfig: &std::path::Path, name: &str, args: &[&str]| {
        let mut all = vec!["--server", server.as_str(), "--tls-server-name", name];
        all.extend_from_slice(args);
        kubectl(kubeconfig, &all)
    };
    for (kubeconfig, name) in [(&tkc, &up_name), (&okc, &other_name)] {
        let out = through(kubeconfig, name, &["get", "ns", "default", "-o", "name"]);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let unknown = through(&tkc, "nobody.default.nestplane.internal", &["get", "ns"]);
    let said = String::from_utf8_lossy(&unknown.stderr).to_string();
    assert!(
        !unknown.status.success()
            && (said.contains("reset") || said.contains("EOF"))
            && !said.contains("x509"),
        "{said}"
    );
    let crossed = through(&tkc, &other_name, &["get", "ns"]);
    let said = String::from_utf8_lossy(&crossed.stderr).to_string();
    assert!(!crossed.status.success() && said.contains("x509"), "{said}");
    let upgrading = || {
        jsonpath(
            &kc,
            &["ncp", "up"],
            "{.status.conditions[?(@.type==\"Upgrading\")].status}|{.status.conditions[?(@.type==\"Upgrading\")].reason}|{.status.conditions[?(@.type==\"Upgrading\")].message}",
        )
    };
    let pid = |part: &str, i: usize| env.pid("default", "up", part, i).expect(part);
    let parts = [
        ("etcd", 0),
        ("apiserver", 0),
        ("apiserver", 1),
        ("controller-manager", 0),
        ("scheduler", 0),
    ];
    let before: Vec<u32> = parts.iter().map(|(p, i)| pid(p, *i)).collect();
    let set_version = |v: &str| {
        let patch = format!("{{\"spec\":{{\"version\":\"{v}\"}}}}");
        kubectl_ok(&kc, &["patch", "ncp", "up", "--type=merge", "-p", &patch]);
    };

    // A client uses an API that 1.22 removes, at the second API server replica: a change to
    // 1.22 (through 1.21) is refused before any step, naming it, as that replica counted it
    // (every replica is read, each at its own address: the gateway balances).
    let o = first_replica(&kc, "default", "up").octets();
    let second = std::net::Ipv4Addr::new(o[0], o[1], o[2], o[3] + 1);
    let second_kc = tkc.with_extension("second");
    kubeconfig_at(&tkc, &format!("https://{second}:6443"), &second_kc);
    kubectl_ok(
        &second_kc,
        &["get", "--raw", "/apis/extensions/v1beta1/ingresses"],
    );
    set_version("v1.22.0");
    let refused = eventually("RemovedAPIsInUse", Duration::from_secs(60), || {
        let c = upgrading();
        c.starts_with("False|RemovedAPIsInUse|").then_some(c)
    });
    assert!(
        refused.contains("extensions/v1beta1 ingresses (removed in 1.22)")
            && refused.contains("nestplane.io/upgrade-despite-removed-apis=v1.22.0"),
        "{refused}"
    );
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "up"],
            "{.status.upgrade.phase}|{.status.upgrade.to}"
        ),
        "Refused|v1.22.0"
    );
    // (watched for 3 s while the components' passes for the change run)
    for _ in 0..6 {
        let now: Vec<u32> = parts.iter().map(|(p, i)| pid(p, *i)).collect();
        assert_eq!(now, before, "a refused change moved a process");
        std::thread::sleep(Duration::from_millis(500));
    }

    // A client asks the tenant with its published kubeconfig (the gateway) all along, a new
    // connection per request: not one request fails while the API server replicas are
    // replaced.
    let done_flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = {
        let (done, tkc) = (done_flag.clone(), tkc.clone());
        std::thread::spawn(move || {
            let mut results = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) && results.len() < 2000 {
                let started = std::time::Instant::now();
                let out = kubectl(
                    &tkc,
                    &[
                        "--request-timeout=20s",
                        "get",
                        "ns",
                        "default",
                        "-o",
                        "name",
                    ],
                );
                let failed = (!out.status.success())
                    .then(|| String::from_utf8_lossy(&out.stderr).to_string());
                results.push((started.elapsed(), failed));
            }
            results
        })
    };
    // A patch takes no minor step: nothing to check.
    let asked = std::time::Instant::now();
    set_version("v1.20.3");
    // While it moves, the control plane says so, and what waits says for what.
    let moving = eventually("Upgrading=True", Duration::from_secs(30), || {
        let c = upgrading();
        c.starts_with("True|Upgrading|").then_some(c)
    });
    assert!(moving.contains("step 1 of 1 (v1.20.3)"), "{moving}");
    let done = eventually("the upgrade completes", Duration::from_secs(180), || {
        let got = jsonpath(
            &kc,
            &["ncp", "up"],
            "{.status.upgrade.phase}|{.status.upgrade.from}|{.status.upgrade.to}|{.status.upgrade.steps}",
        );
        got.starts_with("Completed|").then_some(got)
    });
    assert_eq!(done, r#"Completed|v1.20.2|v1.20.3|["v1.20.3"]"#);
    // (a figure for docs/operations.md, not an assertion)
    eprintln!("upgrade: patched → Completed in {:?}", asked.elapsed());
    done_flag.store(true, std::sync::atomic::Ordering::Relaxed);
    let results = client.join().unwrap();
    let failures: Vec<&String> = results.iter().filter_map(|(_, f)| f.as_ref()).collect();
    let worst = results.iter().map(|(d, _)| *d).max().unwrap_or_default();
    eprintln!(
        "upgrade: {} requests through the gateway, worst {worst:?}",
        results.len()
    );
    assert!(
        results.len() >= 10,
        "the client loop ran: {}",
        results.len()
    );
    assert!(
        failures.is_empty(),
        "requests failed during the upgrade: {failures:?}"
    );
    for (kind, part) in [
        ("nestedetcd", "etcd"),
        ("nestedapiserver", "apiserver"),
        ("nestedcontrollermanager", "controller-manager"),
        ("nestedscheduler", "scheduler"),
    ] {
        let got = jsonpath(
            &kc,
            &[kind, &format!("up-{part}")],
            "{.status.ready}/{.status.version}",
        );
        assert_eq!(got, "true/v1.20.3", "{kind}");
    }
    assert_eq!(upgrading(), "||", "Upgrading is gone once done");
    assert_eq!(
        jsonpath(&kc, &["ncp", "up"], "{.status.version}"),
        "v1.20.3"
    );
    eventually("an UpgradeCompleted Event", Duration::from_secs(30), || {
        events_for(&kc, "default", "up")
            .contains("Normal UpgradeCompleted")
            .then_some(())
    });

    // The order, from the processes themselves. etcd's pairing is the same for a patch, so
    // it keeps running; each API server replica is replaced in turn; the controller manager
    // and the scheduler start only after the last API server replica did.
    let after: Vec<u32> = parts.iter().map(|(p, i)| pid(p, *i)).collect();
    assert_eq!(
        after[0], before[0],
        "etcd restarted for a patch of Kubernetes"
    );
    for (i, (part, n)) in parts.iter().enumerate().skip(1) {
        assert_ne!(after[i], before[i], "{part}-{n} was not replaced");
    }
    let t: Vec<u64> = after.iter().map(|p| started(*p)).collect();
    eprintln!("upgrade: process start times (clock ticks) {parts:?} {t:?}");
    assert!(t[1] < t[2], "API server replica 0 first: {t:?}");
    assert!(
        t[3] > t[2] && t[4] > t[2],
        "the controller manager and scheduler after every API server: {t:?}"
    );
    // The tenant answers.
    kubectl_ok(&tkc, &["get", "ns", "default"]);
}

/// Twenty tenants behind the gateway's one loopback port: each reached with its own
/// published kubeconfig (the gateway's address, its own `tls-server-name`), each seeing only
/// itself; a name nobody has is reset. They share one datastore and run their API servers only
/// (their controller managers and schedulers are left to another controller): that is all the
/// gateway routes to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_tenants_behind_one_gateway_port_each_by_its_own_name() {
    const TENANTS: usize = 20;
    let mut env = Env::start(false).await;
    env.start_operator_with_published_gateway("*,-controller-manager,-scheduler");
    let kc = env.kubeconfig().to_path_buf();
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: shared, namespace: default}\nspec: {managed: {replicas: 1}}\n",
    );
    let mut all = String::new();
    for i in 0..TENANTS {
        all.push_str(&format!(
            "---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {{name: t{i}, namespace: default}}\nspec:\n  version: v1.20.2\n  datastoreRef: {{name: shared}}\n"
        ));
    }
    env.apply(&all);
    let mut servers = std::collections::BTreeSet::new();
    for i in 0..TENANTS {
        let name = format!("t{i}");
        // Its own name in the kubeconfig nestplane publishes, and a namespace only it has.
        let kubeconfig = eventually(
            &format!("{name} answering through the gateway"),
            Duration::from_secs(300),
            || {
                let server = jsonpath(&kc, &["ncp", &name], "{.status.gateway.server}");
                if server.is_empty() {
                    return None;
                }
                let s = kubectl(
                    &kc,
                    &[
                        "get",
                        "secret",
                        &format!("{name}-kubeconfig"),
                        "-o",
                        "jsonpath={.data.value}",
                    ],
                );
                use base64::Engine as _;
                let text = base64::engine::general_purpose::STANDARD
                    .decode(String::from_utf8_lossy(&s.stdout).trim())
                    .ok()?;
                let text = String::from_utf8(text).ok()?;
                if !text.contains(&format!(
                    "tls-server-name: {name}.default.nestplane.internal"
                )) {
                    return None;
                }
                let path = env.state.path().join(format!("{name}.kubeconfig"));
                std::fs::write(&path, &text).unwrap();
                let out = kubectl(&path, &["create", "namespace", &format!("only-{name}")]);
                (out.status.success()
                    || String::from_utf8_lossy(&out.stderr).contains("AlreadyExists"))
                .then_some((path, server))
            },
        );
        servers.insert(kubeconfig.1.clone());
        let (path, _) = kubeconfig;
        let mine = kubectl_ok(&path, &["get", "ns", "-o", "name"]);
        let only: Vec<&str> = mine.lines().filter(|l| l.contains("/only-")).collect();
        assert_eq!(only, [format!("namespace/only-{name}").as_str()], "{mine}");
    }
    assert_eq!(
        servers.len(),
        1,
        "one address for every tenant: {servers:?}"
    );
    // A name nobody has is reset, never answered by a tenant.
    let path = env.state.path().join("t0.kubeconfig");
    let out = kubectl(
        &path,
        &[
            "--tls-server-name",
            "t99.default.nestplane.internal",
            "get",
            "ns",
        ],
    );
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success()
            && (said.contains("reset") || said.contains("EOF"))
            && !said.contains("x509"),
        "{said}"
    );
}
