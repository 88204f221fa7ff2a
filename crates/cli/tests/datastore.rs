//! Shared datastores: many tenants in one etcd, each confined to its own key prefix by an
//! etcd user and role of its own. Proved with `etcdctl` and the tenant's own certificate (it
//! reads and writes its prefix and nothing else), with two tenants' namespaces of the same
//! name, and by deleting a tenant (its keys, user and role go; nothing else does). Real
//! tenants in the process runtime, on a datastore nestplane runs and on one run by hand.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use nestplane_api::{NestedDatastore, NestedEtcd};

fn datastore_ready(kc: &Path, name: &str) -> bool {
    jsonpath(kc, &["nesteddatastore", name], "{.status.ready}") == "true"
}

fn ncp_on(name: &str, datastore: &str) -> String {
    format!(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  version: v1.20.2\n  datastoreRef: {{name: {datastore}}}\n"
    )
}

/// The message of condition `type_` of WHAT.
fn message(kc: &Path, what: &[&str], type_: &str) -> String {
    jsonpath(
        kc,
        what,
        &format!("{{.status.conditions[?(@.type==\"{type_}\")].message}}"),
    )
}

fn gone(kc: &Path, what: &[&str]) -> bool {
    let mut args = vec!["get"];
    args.extend_from_slice(what);
    let out = kubectl(kc, &args);
    !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("NotFound")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_on_a_managed_datastore_see_only_their_own_keys() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: shared, namespace: default}\nspec: {managed: {replicas: 1}}\n",
    );
    eventually("the datastore Ready", Duration::from_secs(90), || {
        datastore_ready(&kc, "shared").then_some(())
    });
    assert_eq!(
        jsonpath(&kc, &["nesteddatastore", "shared"], "{.status.type}"),
        "Managed"
    );
    assert_eq!(
        jsonpath(
            &kc,
            &["nesteddatastore", "shared"],
            "{.status.healthyMembers}"
        ),
        "1/1"
    );
    // Its etcd is current, as its status and the process both say.
    assert_current_etcd(
        "the datastore's status",
        &jsonpath(
            &kc,
            &["nesteddatastore", "shared"],
            "{.status.members[0].version}",
        ),
    );
    let pid = env
        .pid("default", "shared-datastore", "etcd", 0)
        .expect("the datastore's etcd runs");
    let exe = std::path::PathBuf::from(format!("/proc/{pid}/exe"));
    assert_current_etcd("the datastore's etcd", &etcd_version_of(&exe));
    // Its etcd is a NestedEtcd the datastore controls, Ready like any other.
    let etcd = Api::<NestedEtcd>::namespaced(env.client(), "default")
        .get("shared-datastore-etcd")
        .await
        .unwrap();
    assert!(etcd.status.as_ref().unwrap().common.ready);
    assert!(
        etcd.metadata
            .owner_references
            .unwrap()
            .iter()
            .any(|r| r.kind == "NestedDatastore" && r.name == "shared")
    );

    env.apply(&(ncp_on("alpha", "shared") + "---\n" + &ncp_on("beta", "shared")));
    let alpha = env
        .wait_ready("default", "alpha", Duration::from_secs(120))
        .await;
    env.wait_ready("default", "beta", Duration::from_secs(120))
        .await;
    // No etcd of their own; status says where their data is.
    for t in ["alpha", "beta"] {
        assert!(gone(&kc, &["nestedetcd", &format!("{t}-etcd")]), "{t}-etcd");
        assert_eq!(env.pid("default", t, "etcd", 0), None);
    }
    let bound = alpha.status.unwrap().datastore.unwrap();
    assert_eq!(bound.name, "shared");
    assert_eq!(bound.user, "nestplane:default:alpha");
    assert_eq!(bound.prefix, "/nestplane/default/alpha/");
    eventually(
        "the datastore lists both tenants",
        Duration::from_secs(60),
        || {
            (jsonpath(&kc, &["nesteddatastore", "shared"], "{.status.tenantCount}") == "2"
                && jsonpath(
                    &kc,
                    &["nesteddatastore", "shared"],
                    "{.status.tenants[*].name}",
                ) == "alpha beta")
                .then_some(())
        },
    );

    // Consent: a control plane of another namespace that references the datastore is
    // refused, gets no certificate, and is no tenant of it (holds no deletion) ...
    env.apply("apiVersion: v1\nkind: Namespace\nmetadata: {name: attacker}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {name: a1, namespace: attacker}\nspec:\n  version: v1.20.2\n  datastoreRef: {name: shared, namespace: default}\n");
    eventually("a1 refused", Duration::from_secs(60), || {
        jsonpath(
            &kc,
            &["ncp", "a1", "-n", "attacker"],
            "{.status.conditions[?(@.type==\"Available\")].reason}",
        )
        .contains("NotAllowed")
        .then_some(())
    });
    assert!(
        events_for(&kc, "default", "shared").contains("NestedControlPlane attacker/a1 refused")
    );
    assert!(gone(
        &kc,
        &["secret", "a1-apiserver-etcd-client", "-n", "attacker"]
    ));
    assert_eq!(
        jsonpath(&kc, &["nesteddatastore", "shared"], "{.status.tenantCount}"),
        "2"
    );
    // ... until the datastore's owner allows that namespace.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nesteddatastore",
            "shared",
            "--type=merge",
            "-p",
            r#"{"spec":{"allowedNamespaces":{"names":["attacker"]}}}"#,
        ],
    );
    env.wait_ready("attacker", "a1", Duration::from_secs(120))
        .await;
    kubectl_ok(
        &kc,
        &["delete", "ncp", "a1", "-n", "attacker", "--timeout=90s"],
    );

    // A steady datastore and its tenants cost no writes to etcd's auth store (each would
    // make the requests then in flight of every tenant fail once): passes of both control
    // planes (an annotation wakes them) and a health check of the datastore later, etcd's
    // auth revision is what it was.
    let endpoint = jsonpath(
        &kc,
        &["nesteddatastore", "shared"],
        "{.status.endpoints[0]}",
    );
    let host = endpoint
        .trim_start_matches("https://")
        .trim_end_matches(":2379")
        .to_string();
    let before = auth_revision(&host);
    for (i, t) in ["alpha", "beta"].into_iter().enumerate() {
        kubectl_ok(
            &kc,
            &[
                "annotate",
                "ncp",
                t,
                &format!("bench/touch={i}"),
                "--overwrite",
            ],
        );
    }
    tokio::time::sleep(Duration::from_secs(35)).await;
    assert_eq!(
        auth_revision(&host),
        before,
        "auth store written at steady state"
    );

    // Two tenants' namespaces of the same name do not see each other.
    let a = env.tenant_kubeconfig("default", "alpha").await;
    let b = env.tenant_kubeconfig("default", "beta").await;
    for k in [&a, &b] {
        kubectl_ok(k, &["create", "namespace", "same"]);
    }
    kubectl_ok(
        &a,
        &[
            "-n",
            "same",
            "create",
            "configmap",
            "only-in-alpha",
            "--from-literal=k=a",
        ],
    );
    kubectl_ok(
        &b,
        &[
            "-n",
            "same",
            "create",
            "configmap",
            "only-in-beta",
            "--from-literal=k=b",
        ],
    );
    let in_b = kubectl_ok(&b, &["-n", "same", "get", "configmaps", "-o", "name"]);
    assert!(!in_b.contains("only-in-alpha"), "{in_b}");
    assert!(in_b.contains("only-in-beta"), "{in_b}");
    let in_a = kubectl_ok(&a, &["-n", "same", "get", "configmaps", "-o", "name"]);
    assert!(in_a.contains("only-in-alpha") && !in_a.contains("only-in-beta"));

    // etcdctl with alpha's own certificate: its prefix, and nothing else.
    let endpoints: Vec<String> = jsonpath(
        &kc,
        &["nesteddatastore", "shared"],
        "{.status.endpoints[*]}",
    )
    .split_whitespace()
    .map(String::from)
    .collect();
    let as_alpha = env.etcdctl("default", "alpha", endpoints.clone()).await;
    let (ok, keys, err) = as_alpha.run(&[
        "get",
        "/nestplane/default/alpha/",
        "--prefix",
        "--keys-only",
    ]);
    assert!(ok, "{err}");
    assert!(
        keys.contains("/nestplane/default/alpha/registry/configmaps/same/only-in-alpha"),
        "{keys}"
    );
    assert!(!keys.contains("only-in-beta"));
    let denied = |(ok, out, err): (bool, String, String)| {
        assert!(!ok, "allowed: {out}");
        assert!(err.contains("permission denied"), "{err}");
    };
    denied(as_alpha.run(&["get", "/nestplane/default/beta/", "--prefix", "--keys-only"]));
    denied(as_alpha.run(&[
        "get",
        "/nestplane/default/beta/registry/configmaps/same/only-in-beta",
    ]));
    denied(as_alpha.run(&["put", "/nestplane/default/beta/registry/planted", "x"]));
    denied(as_alpha.run(&["del", "/nestplane/default/beta/", "--prefix"]));
    denied(as_alpha.run(&["get", "/", "--prefix", "--keys-only"]));
    // A prefix that merely starts like alpha's is not alpha's.
    denied(as_alpha.run(&["put", "/nestplane/default/alphabet", "x"]));
    denied(as_alpha.run(&["user", "list"]));

    // The backup engine needs nothing but the tenant's own credentials: alpha's keys at one
    // revision, leases and all, restored under a prefix of alpha's own that its API server
    // does not read; beta's prefix refused.
    {
        use nestplane_operator::backup::{archive, engine};
        let mut grpc = as_alpha.client().await;
        let snap = engine::export(
            &mut grpc,
            &engine::key_root(Some("/nestplane/default/alpha/")),
            100,
            &archive::Limits::default(),
        )
        .await
        .expect("alpha exports its own keys");
        let names: Vec<String> = snap
            .records
            .iter()
            .map(|r| String::from_utf8_lossy(&r.key).into_owned())
            .collect();
        assert!(
            names.contains(&"configmaps/same/only-in-alpha".to_string()),
            "{names:?}"
        );
        assert!(!names.iter().any(|n| n.contains("only-in-beta")));
        let aside = "/nestplane/default/alpha/restore-check/";
        let done = engine::restore(&mut grpc, aside, &snap.records, &archive::Limits::default())
            .await
            .expect("alpha restores under its own prefix");
        assert_eq!(done.written as usize, snap.records.len());
        // Some of the tenant's keys are on leases (its API server's own entry under
        // `masterleases/`, its Events): granting them takes no more than alpha's role either.
        assert!(done.leases >= 1, "{done:?}");
        grpc.delete(aside, Some(etcd_client::DeleteOptions::new().with_prefix()))
            .await
            .unwrap();
        let err = engine::export(
            &mut grpc,
            &engine::key_root(Some("/nestplane/default/beta/")),
            100,
            &archive::Limits::default(),
        )
        .await
        .expect_err("alpha exported beta's keys");
        assert!(err.to_string().contains("permission denied"), "{err}");
        let err = engine::restore(
            &mut grpc,
            "/nestplane/default/beta/",
            &snap.records,
            &archive::Limits::default(),
        )
        .await
        .expect_err("alpha restored into beta's prefix");
        assert!(err.to_string().contains("permission denied"), "{err}");
    }

    // Known bypasses of older etcds, tried with alpha's own certificate. A lease's keys: a
    // lease holding a key of beta's (granted by root, so that it outlives the test) ...
    let as_root = env
        .etcdctl_as("default", "shared-datastore-root", endpoints.clone())
        .await;
    let (ok, granted, err) = as_root.run(&["lease", "grant", "3600"]);
    assert!(ok, "{err}");
    let lease_id = granted
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("no lease id in {granted:?}"))
        .to_string();
    let (ok, _, err) = as_root.run(&[
        "put",
        "/nestplane/default/beta/registry/leased-by-root",
        "x",
        &format!("--lease={lease_id}"),
    ]);
    assert!(ok, "{err}");
    let (ok, keys, err) = as_root.run(&["lease", "timetolive", &lease_id, "--keys"]);
    assert!(
        ok && keys.contains("/nestplane/default/beta/"),
        "{keys}{err}"
    );
    // ... asked for by alpha: refused, and no key name of beta's in the answer.
    let (ok, out, err) = as_alpha.run(&["lease", "timetolive", &lease_id, "--keys"]);
    assert!(
        !out.contains("/nestplane/default/beta") && !err.contains("/nestplane/default/beta"),
        "alpha read beta's key names through a lease: {out}{err}"
    );
    assert!(!ok && err.contains("permission denied"), "{out}{err}");
    // Nested transactions: a read, a write, a delete of beta's keys, a put whose previous
    // value is returned, and a put of alpha's own key onto beta's lease: all refused, beta's
    // keys as they were.
    let beta_key = "/nestplane/default/beta/registry/configmaps/same/only-in-beta";
    let lease = i64::from_str_radix(&lease_id, 16).unwrap();
    let mut grpc = as_alpha.client().await;
    use etcd_client::{DeleteOptions, PutOptions, Txn, TxnOp};
    let nested = |op: TxnOp| Txn::new().and_then([TxnOp::txn(Txn::new().and_then([op]))]);
    for (what, txn) in [
        ("a nested read", nested(TxnOp::get(beta_key, None))),
        (
            "a nested write",
            nested(TxnOp::put(beta_key, "planted", None)),
        ),
        (
            "a nested delete",
            nested(TxnOp::delete(
                "/nestplane/default/beta/",
                Some(DeleteOptions::new().with_prefix()),
            )),
        ),
        (
            "a nested put returning the previous value",
            nested(TxnOp::put(
                beta_key,
                "planted",
                Some(PutOptions::new().with_prev_key()),
            )),
        ),
        (
            "a nested put onto beta's lease",
            nested(TxnOp::put(
                "/nestplane/default/alpha/on-betas-lease",
                "x",
                Some(PutOptions::new().with_lease(lease)),
            )),
        ),
    ] {
        match grpc.txn(txn).await {
            Err(e) => assert!(e.to_string().contains("permission denied"), "{what}: {e}"),
            Ok(r) => panic!("{what} was allowed: {r:?}"),
        }
    }
    let (ok, value, err) = as_root.run(&["get", beta_key, "--print-value-only"]);
    assert!(ok, "{err}");
    assert!(!value.contains("planted"), "{value}");
    let (_, attached, _) = as_root.run(&["lease", "timetolive", &lease_id, "--keys"]);
    assert!(!attached.contains("on-betas-lease"), "{attached}");
    let (ok, _, err) = as_alpha.run(&["put", "/nestplane/default/alpha/written-by-hand", "x"]);
    assert!(ok, "{err}");

    // Deleting beta deletes its keys, user and role, and nothing else, even when beta's
    // status was edited to name alpha's prefix and user: with the operator stopped, so that
    // the deletion is the first thing it sees of the edited status.
    let mut env = env;
    env.operator.take().unwrap().stop().await.unwrap();
    env.ncps("default")
        .patch_status(
            "beta",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"datastore": {
                "name": "shared", "namespace": "default",
                "user": "nestplane:default:alpha", "prefix": "/nestplane/default/alpha/"}}})),
        )
        .await
        .unwrap();
    env.ncps("default")
        .delete("beta", &DeleteParams::default())
        .await
        .unwrap();
    env.start_operator();
    eventually("beta gone", Duration::from_secs(90), || {
        gone(&kc, &["nestedcontrolplane", "beta"]).then_some(())
    });
    // The restarted operator started alpha again.
    eventually("alpha answers again", Duration::from_secs(120), || {
        kubectl(&a, &["get", "namespace", "same"])
            .status
            .success()
            .then_some(())
    });
    let (ok, keys, err) =
        as_root.run(&["get", "/nestplane/default/beta/", "--prefix", "--keys-only"]);
    assert!(ok, "{err}");
    assert!(keys.trim().is_empty(), "beta's keys are left: {keys}");
    let (ok, users, err) = as_root.run(&["user", "list"]);
    assert!(ok, "{err}");
    assert!(!users.contains("nestplane:default:beta"), "{users}");
    assert!(users.contains("nestplane:default:alpha"), "{users}");
    let (_, roles, _) = as_root.run(&["role", "list"]);
    assert!(!roles.contains("nestplane:default:beta"), "{roles}");
    let (ok, keys, _) = as_root.run(&[
        "get",
        "/nestplane/default/alpha/",
        "--prefix",
        "--keys-only",
    ]);
    assert!(ok && keys.contains("only-in-alpha") && keys.contains("written-by-hand"));
    let cm = kubectl_ok(
        &a,
        &[
            "-n",
            "same",
            "get",
            "configmap",
            "only-in-alpha",
            "-o",
            "name",
        ],
    );
    assert_eq!(cm.trim(), "configmap/only-in-alpha");

    // A datastore in use is not deleted: it says why, and keeps serving alpha.
    Api::<NestedDatastore>::namespaced(env.client(), "default")
        .delete("shared", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the datastore says it is in use",
        Duration::from_secs(60),
        || {
            message(&kc, &["nesteddatastore", "shared"], "Deleting")
                .contains("default/alpha")
                .then_some(())
        },
    );
    assert!(events_for(&kc, "default", "shared").contains("InUse"));
    kubectl_ok(&a, &["-n", "same", "create", "configmap", "after-delete"]);
    // … and goes once alpha is gone, with its etcd.
    env.ncps("default")
        .delete("alpha", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the datastore gone", Duration::from_secs(90), || {
        (gone(&kc, &["nesteddatastore", "shared"])
            && gone(&kc, &["nestedetcd", "shared-datastore-etcd"]))
        .then_some(())
    });
    assert_eq!(env.pid("default", "shared-datastore", "etcd", 0), None);
}

/// etcd's auth revision, from its metrics (plain HTTP on port 2381 of `host`).
fn auth_revision(host: &str) -> u64 {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect((host, 2381)).unwrap();
    write!(c, "GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut body = String::new();
    c.read_to_string(&mut body).unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix("etcd_debugging_auth_revision "))
        .and_then(|v| v.trim().parse().ok())
        .expect("etcd_debugging_auth_revision in etcd's metrics")
}

/// An etcd someone else runs: TLS from `ca`, client certificates required.
fn run_etcd(dir: &Path, ca: &nestplane_pki::CertKey, port: u16) -> KillOnDrop {
    let now = time::OffsetDateTime::now_utc();
    let serving = nestplane_pki::issue(
        ca,
        &nestplane_pki::LeafSpec {
            common_name: "their-etcd".into(),
            organizations: vec![],
            dns_names: vec![],
            ips: vec!["127.0.0.1".parse().unwrap()],
            usage: nestplane_pki::Usage::ServerAndClient,
        },
        now,
    )
    .unwrap();
    std::fs::write(dir.join("ca.crt"), &ca.cert_pem).unwrap();
    std::fs::write(dir.join("server.crt"), &serving.cert_pem).unwrap();
    std::fs::write(dir.join("server.key"), &serving.key_pem).unwrap();
    let peer = free_port();
    let f = |n: &str| dir.join(n).display().to_string();
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    KillOnDrop(
        etcd_tool("etcd")
            .arg("--name=theirs")
            .arg(format!("--data-dir={}", f("data")))
            .arg(format!("--listen-client-urls=https://127.0.0.1:{port}"))
            .arg(format!("--advertise-client-urls=https://127.0.0.1:{port}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=theirs=http://127.0.0.1:{peer}"))
            .arg(format!("--cert-file={}", f("server.crt")))
            .arg(format!("--key-file={}", f("server.key")))
            .arg(format!("--trusted-ca-file={}", f("ca.crt")))
            .arg("--client-cert-auth")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd runs"),
    )
}

fn tls_secret(name: &str, crt: &str, key: &str) -> String {
    let indent = |s: &str| s.lines().map(|l| format!("    {l}\n")).collect::<String>();
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: default}}\nstringData:\n  tls.crt: |\n{}  tls.key: |\n{}",
        indent(crt),
        indent(key)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_an_external_datastore_and_bad_input() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    // Bad input first: a datastore whose secrets do not exist says so, and a control plane
    // on a datastore that does not exist says so; nothing runs for either.
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: theirs, namespace: default}\nspec:\n  external: {endpoints: [\"https://127.0.0.1:1\"], caSecretName: their-ca, rootSecretName: their-root}\n",
    );
    eventually("a missing secret said", Duration::from_secs(60), || {
        let c = message(&kc, &["nesteddatastore", "theirs"], "Ready");
        c.contains("Secret default/their-ca not found")
            .then_some(())
    });
    assert!(events_for(&kc, "default", "theirs").contains("ReferenceNotFound"));
    env.apply(&ncp_on("lost", "nowhere"));
    eventually("a missing datastore said", Duration::from_secs(60), || {
        let c = message(&kc, &["nestedcontrolplane", "lost"], "Available");
        c.contains("NestedDatastore default/nowhere not found")
            .then_some(())
    });
    assert_eq!(env.pid("default", "lost", "apiserver", 0), None);

    // The etcd, run by hand with authentication off; nestplane turns it on.
    let now = time::OffsetDateTime::now_utc();
    let ca = nestplane_pki::generate_ca("their-etcd-ca", now).unwrap();
    let root = nestplane_pki::issue(
        &ca,
        &nestplane_pki::LeafSpec {
            common_name: "root".into(),
            usage: nestplane_pki::Usage::Client,
            ..Default::default()
        },
        now,
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _etcd = run_etcd(dir.path(), &ca, port);
    let endpoint = format!("https://127.0.0.1:{port}");
    env.apply(&tls_secret("their-ca", &ca.cert_pem, &ca.key_pem));
    env.apply(&tls_secret("their-root", &root.cert_pem, &root.key_pem));
    env.apply(&format!(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {{name: theirs, namespace: default}}\nspec:\n  external: {{endpoints: [\"{endpoint}\"], caSecretName: their-ca, rootSecretName: their-root}}\n"
    ));
    eventually(
        "the external datastore Ready",
        Duration::from_secs(60),
        || datastore_ready(&kc, "theirs").then_some(()),
    );
    assert_eq!(
        jsonpath(&kc, &["nesteddatastore", "theirs"], "{.status.type}"),
        "External"
    );
    env.apply(&ncp_on("gamma", "theirs"));
    env.wait_ready("default", "gamma", Duration::from_secs(120))
        .await;
    let g = env.tenant_kubeconfig("default", "gamma").await;
    kubectl_ok(&g, &["create", "namespace", "kept-in-theirs"]);

    // Authentication is on: a certificate of the same CA for a user etcd does not know gets
    // nothing; gamma's own reads its prefix only. The CA's key is not in gamma's secrets.
    let as_gamma = env
        .etcdctl("default", "gamma", vec![endpoint.clone()])
        .await;
    let (ok, keys, err) = as_gamma.run(&[
        "get",
        "/nestplane/default/gamma/",
        "--prefix",
        "--keys-only",
    ]);
    assert!(ok, "{err}");
    assert!(keys.contains("namespaces/kept-in-theirs"), "{keys}");
    let (ok, _, _) = as_gamma.run(&["get", "/", "--prefix", "--keys-only"]);
    assert!(!ok);
    let etcd_ca = env.secret("default", "gamma-etcd").await.unwrap();
    assert!(!etcd_ca.data.unwrap().contains_key("tls.key"));
    let stranger = nestplane_pki::issue(
        &ca,
        &nestplane_pki::LeafSpec {
            common_name: "stranger".into(),
            usage: nestplane_pki::Usage::Client,
            ..Default::default()
        },
        now,
    )
    .unwrap();
    let as_stranger = |args: &[&str]| etcdctl_with(dir.path(), &endpoint, &stranger, args);
    assert!(
        !as_stranger(&[
            "get",
            "/nestplane/default/gamma/",
            "--prefix",
            "--keys-only"
        ]),
        "a stranger read gamma's keys"
    );
    // Authentication turned off by hand is turned on again (looked at every 30 s).
    assert!(etcdctl_with(
        dir.path(),
        &endpoint,
        &root,
        &["auth", "disable"]
    ));
    assert!(as_stranger(&[
        "get",
        "/nestplane/default/gamma/",
        "--prefix",
        "--keys-only"
    ]));
    eventually("authentication on again", Duration::from_secs(90), || {
        (!as_stranger(&[
            "get",
            "/nestplane/default/gamma/",
            "--prefix",
            "--keys-only",
        ]))
        .then_some(())
    });
}

/// `etcdctl args…` as the holder of `cert`; whether it succeeded.
fn etcdctl_with(dir: &Path, endpoint: &str, cert: &nestplane_pki::CertKey, args: &[&str]) -> bool {
    let (crt, key) = (dir.join("client.crt"), dir.join("client.key"));
    std::fs::write(&crt, &cert.cert_pem).unwrap();
    std::fs::write(&key, &cert.key_pem).unwrap();
    let out = etcd_tool("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .arg(format!("--cacert={}", dir.join("ca.crt").display()))
        .arg(format!("--cert={}", crt.display()))
        .arg(format!("--key={}", key.display()))
        .args(args)
        .output()
        .expect("etcdctl runs");
    out.status.success()
}

/// Bytes (keys and values) stored under `prefix`, read as `client` in small pages.
async fn stored_bytes(client: &mut etcd_client::Client, prefix: &str) -> i64 {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let mut from = prefix.as_bytes().to_vec();
    let mut total = 0i64;
    loop {
        let page = client
            .get(
                from.clone(),
                Some(
                    etcd_client::GetOptions::new()
                        .with_range(end.clone())
                        .with_limit(4),
                ),
            )
            .await
            .unwrap();
        for kv in page.kvs() {
            total += (kv.key().len() + kv.value().len()) as i64;
        }
        match page.kvs().last() {
            Some(last) if page.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return total,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_quota_is_stopped_while_another_keeps_writing() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: small, namespace: default}\nspec:\n  managed: {replicas: 1}\n  quota: {tenantDefault: 24Mi, tenantMax: 64Mi}\n",
    );
    env.apply(&(ncp_on("hog", "small") + "---\n" + &ncp_on("calm", "small")));
    env.wait_ready("default", "hog", Duration::from_secs(150))
        .await;
    env.wait_ready("default", "calm", Duration::from_secs(150))
        .await;
    // The datastore's etcd has room for its tenants' quotas (etcd's default would be 2 GiB).
    let pid = env
        .pid("default", "small-datastore", "etcd", 0)
        .expect("the datastore's etcd runs");
    let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        cmdline.contains(&format!("--quota-backend-bytes={}", 8i64 << 30)),
        "{cmdline}"
    );
    eventually("hog's quota in the status", Duration::from_secs(60), || {
        (jsonpath(
            &kc,
            &["nesteddatastore", "small"],
            "{.status.tenants[?(@.name==\"hog\")].quotaBytes}",
        ) == (24i64 << 20).to_string())
        .then_some(())
    });

    // hog writes 900 kB ConfigMaps with nothing but its own admin kubeconfig, until refused.
    let hog = env.tenant_kubeconfig("default", "hog").await;
    let calm = env.tenant_kubeconfig("default", "calm").await;
    let big = env.state.path().join("big");
    std::fs::write(&big, "x".repeat(900_000)).unwrap();
    let from_file = format!("--from-file=data={}", big.display());
    // At most one write per 300 ms (about 3 MB/s), so that what passes the quota before a
    // measurement sees it stays within the bound below on a fast machine too.
    let mut refused = None;
    for i in 0..80 {
        let started = std::time::Instant::now();
        let out = kubectl(
            &hog,
            &["create", "configmap", &format!("big-{i}"), &from_file],
        );
        if !out.status.success() {
            refused = Some((i, String::from_utf8_lossy(&out.stderr).into_owned()));
            break;
        }
        std::thread::sleep(Duration::from_millis(300).saturating_sub(started.elapsed()));
    }
    let (written, error) = refused.expect("hog wrote 72 MB past a 24 MiB quota");
    assert!(written >= 10, "refused after {written} writes: {error}");
    assert!(error.contains("permission denied"), "{error}");
    // It is stopped at its quota (measured every 10 s, every 2 s past half of it), not far
    // past it: unchecked, its 80 writes would be 72 MB.
    let endpoints: Vec<String> =
        jsonpath(&kc, &["nesteddatastore", "small"], "{.status.endpoints[*]}")
            .split_whitespace()
            .map(String::from)
            .collect();
    let mut root = env
        .etcdctl_as("default", "small-datastore-root", endpoints.clone())
        .await
        .client()
        .await;
    let stored = stored_bytes(&mut root, "/nestplane/default/hog/").await;
    assert!(
        stored < 2 * (24 << 20),
        "hog stores {stored} bytes, far past its quota of 24 MiB"
    );
    // It is told why, on its control plane: a condition and an Event.
    eventually("hog's condition and Event", Duration::from_secs(30), || {
        (jsonpath(
            &kc,
            &["ncp", "hog"],
            "{.status.conditions[?(@.type==\"DatastoreQuota\")].reason}",
        ) == "QuotaExceeded"
            && message(&kc, &["ncp", "hog"], "DatastoreQuota").contains("refuses writes")
            && events_for(&kc, "default", "hog").contains("QuotaExceeded"))
        .then_some(())
    });
    // Its reads keep working; nothing it stored is lost.
    let names = kubectl_ok(&hog, &["get", "configmaps", "-o", "name"]);
    assert!(names.contains("configmap/big-0"), "{names}");
    // calm, on the same datastore, keeps writing, and so does hog's neighbour's API server.
    for i in 0..5 {
        kubectl_ok(
            &calm,
            &["create", "configmap", &format!("calm-{i}"), &from_file],
        );
    }
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "calm"],
            "{.status.conditions[?(@.type==\"DatastoreQuota\")].status}"
        ),
        "True"
    );

    // A larger quota, within the datastore's tenantMax, lets hog write again.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "ncp",
            "hog",
            "--type=merge",
            "-p",
            r#"{"spec":{"datastoreRef":{"quota":"64Mi"}}}"#,
        ],
    );
    eventually("hog may write again", Duration::from_secs(60), || {
        kubectl(&hog, &["create", "configmap", "after-raise", &from_file])
            .status
            .success()
            .then_some(())
    });
    eventually("hog's condition says so", Duration::from_secs(30), || {
        (jsonpath(
            &kc,
            &["ncp", "hog"],
            "{.status.conditions[?(@.type==\"DatastoreQuota\")].status}",
        ) == "True")
            .then_some(())
    });
    assert!(events_for(&kc, "default", "hog").contains("WithinQuota"));
}

/// The etcd role of tenant `user` on a datastore may write (`Some(true)`), only read
/// (`Some(false)`), or is not there (`None`): `etcdctl role get` as the datastore's root.
fn role_writable(root: &Etcdctl, user: &str) -> Option<bool> {
    let (ok, out, err) = root.run(&["role", "get", user]);
    if !ok {
        assert!(err.contains("not found"), "{err}");
        return None;
    }
    let write = out.split("KV Write:").nth(1).unwrap_or_default();
    Some(write.contains('['))
}

/// The tenant's ConfigMaps as `name=value` lines, once every one of `w-0` … `w-<writes-1>`
/// is among them with its own value.
fn all_writes_there(kubeconfig: &Path, writes: usize) -> String {
    let values = kubectl_ok(
        kubeconfig,
        &[
            "get",
            "configmaps",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.data.n}{\"\\n\"}{end}",
        ],
    );
    for i in 0..writes {
        assert!(values.contains(&format!("w-{i}={i}\n")), "w-{i} is missing");
    }
    values
}

/// Keys under `prefix`, as `client` reads them.
async fn keys_under(client: &mut etcd_client::Client, prefix: &str) -> i64 {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    client
        .get(
            prefix,
            Some(
                etcd_client::GetOptions::new()
                    .with_range(end)
                    .with_count_only(),
            ),
        )
        .await
        .unwrap()
        .count()
}

/// A change of `datastoreRef` moves the tenant's data while a client writes 20 ConfigMaps a
/// second and another reads through the gateway: every acknowledged write is there
/// afterwards, no read fails, writes are refused only while the source is frozen (the figure
/// is printed), the other tenant of the source is untouched, and the source keeps a
/// read-only copy. A move to a datastore that is not there waits and moves nothing. Then
/// the way back, with the operator killed during the move: the next one finishes it, and
/// the copy it left is deleted after its retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_moves_between_datastores_while_written_and_a_move_outlives_its_operator() {
    let env = Env::start(false).await;
    let kc = env.kubeconfig().to_path_buf();
    let gateway_args = ["--gateway-bind-address", "127.0.0.1:0"];
    let operator = env.spawn_operator_with(&gateway_args);
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: one, namespace: default}\nspec: {managed: {replicas: 1}}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: two, namespace: default}\nspec: {managed: {replicas: 1}}\n",
    );
    env.apply(
        &(ncp_on("mover", "one").replace("  version:", "  replicas: 2\n  version:")
            + "---\n"
            + &ncp_on("stay", "one")),
    );
    env.wait_ready("default", "mover", Duration::from_secs(180))
        .await;
    env.wait_ready("default", "stay", Duration::from_secs(180))
        .await;
    eventually("both datastores Ready", Duration::from_secs(60), || {
        (datastore_ready(&kc, "one") && datastore_ready(&kc, "two")).then_some(())
    });
    let endpoints = |ds: &str| -> Vec<String> {
        jsonpath(&kc, &["nesteddatastore", ds], "{.status.endpoints[*]}")
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let root_one = env
        .etcdctl_as("default", "one-datastore-root", endpoints("one"))
        .await;
    let root_two = env
        .etcdctl_as("default", "two-datastore-root", endpoints("two"))
        .await;
    let prefix = "/nestplane/default/mover/";
    let user = "nestplane:default:mover";
    let tkc = env.tenant_kubeconfig("default", "mover").await;
    let skc = env.tenant_kubeconfig("default", "stay").await;
    kubectl_ok(&skc, &["create", "configmap", "mine", "--from-literal=k=v"]);
    let stay_pids: Vec<Option<u32>> = ["apiserver", "controller-manager", "scheduler"]
        .iter()
        .map(|p| env.pid("default", "stay", p, 0))
        .collect();
    let phase = || jsonpath(&kc, &["ncp", "mover"], "{.status.migration.phase}");
    let move_to = |ds: &str| {
        let patch = format!("{{\"spec\":{{\"datastoreRef\":{{\"name\":\"{ds}\"}}}}}}");
        kubectl_ok(
            &kc,
            &["patch", "ncp", "mover", "--type=merge", "-p", &patch],
        );
    };

    // Bad input: a datastore that is not there. The move waits and says why; nothing moves.
    move_to("nowhere");
    let said = eventually("the move waits", Duration::from_secs(60), || {
        let got = jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.migration.phase}|{.status.migration.message}",
        );
        got.starts_with("Pending|").then_some(got)
    });
    assert!(
        said.contains("NestedDatastore default/nowhere not found"),
        "{said}"
    );
    assert!(events_for(&kc, "default", "mover").contains("MigrationPending"));
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.datastore.name}|{.status.ready}"
        ),
        "one|true"
    );
    assert_eq!(keys_under(&mut root_two.client().await, prefix).await, 0);
    // Hostile input: a move into another namespace's datastore, which does not admit this
    // one (a namespace user naming someone else's etcd). Refused before anything is copied.
    env.apply(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: infra}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: closed, namespace: infra}\nspec: {managed: {replicas: 1}}\n",
    );
    let closed = &["nesteddatastore", "closed", "-n", "infra"];
    eventually("infra/closed Ready", Duration::from_secs(60), || {
        (jsonpath(&kc, closed, "{.status.ready}") == "true").then_some(())
    });
    kubectl_ok(
        &kc,
        &[
            "patch",
            "ncp",
            "mover",
            "--type=merge",
            "-p",
            r#"{"spec":{"datastoreRef":{"name":"closed","namespace":"infra"}}}"#,
        ],
    );
    let said = eventually("the move refused", Duration::from_secs(60), || {
        let got = jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.migration.phase}|{.status.migration.message}",
        );
        (got.starts_with("Pending|") && got.contains("infra/closed")).then_some(got)
    });
    assert!(
        said.contains(
            "NestedDatastore infra/closed does not allow control planes of namespace default"
        ),
        "{said}"
    );
    assert!(
        events_for(&kc, "default", "mover").contains("does not allow control planes"),
        "an Event says so"
    );
    let root_closed = env
        .etcdctl_as(
            "infra",
            "closed-datastore-root",
            jsonpath(&kc, closed, "{.status.endpoints[*]}")
                .split_whitespace()
                .map(String::from)
                .collect(),
        )
        .await;
    assert_eq!(keys_under(&mut root_closed.client().await, prefix).await, 0);
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.datastore.name}|{.status.ready}"
        ),
        "one|true"
    );
    assert_eq!(jsonpath(&kc, closed, "{.status.tenantCount}"), "0");
    kubectl_ok(&tkc, &["get", "namespace", "default"]);
    // Removing datastoreRef (a move to an etcd of its own is not built) is refused: no etcd
    // of its own is made, the API server keeps running on its datastore, its data readable.
    let apiserver = env.pid("default", "mover", "apiserver", 0);
    kubectl_ok(
        &kc,
        &[
            "patch",
            "ncp",
            "mover",
            "--type=json",
            "-p",
            r#"[{"op":"remove","path":"/spec/datastoreRef"}]"#,
        ],
    );
    let said = eventually("the removal refused", Duration::from_secs(60), || {
        let m = message(&kc, &["ncp", "mover"], "Available");
        m.contains("spec.datastoreRef was removed").then_some(m)
    });
    assert!(said.contains("NestedDatastore default/one"), "{said}");
    assert!(gone(&kc, &["nestedetcd", "mover-etcd"]));
    assert_eq!(env.pid("default", "mover", "apiserver", 0), apiserver);
    kubectl_ok(&tkc, &["get", "namespace", "default"]);
    move_to("one");
    env.wait_ready("default", "mover", Duration::from_secs(60))
        .await;
    assert!(gone(&kc, &["nestedetcd", "mover-etcd"]));
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nesteddatastore",
            "closed",
            "-n",
            "infra",
            "--timeout=60s",
        ],
    );

    // The gateway: one address, the tenant's name.
    let got = jsonpath(
        &kc,
        &["ncp", "mover"],
        "{.status.gateway.server} {.status.gateway.serverName}",
    );
    let (server, sni) = got.split_once(' ').expect("status.gateway");
    let (server, sni) = (server.to_string(), sni.to_string());
    let writer_client = {
        let kubeconfig = kube::config::Kubeconfig::read_from(&tkc).unwrap();
        let mut cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        cfg.cluster_url = server.parse().unwrap();
        cfg.tls_server_name = Some(sni.clone());
        cfg.read_timeout = Some(Duration::from_secs(10));
        kube::Client::try_from(cfg).unwrap()
    };
    const WRITES: usize = 600;
    let started = std::time::Instant::now();
    // Writes, 20 a second: each created again until acknowledged (an AlreadyExists answer
    // means an earlier try was); the refused span is measured as the client saw it.
    let writer = tokio::spawn(async move {
        use k8s_openapi::api::core::v1::ConfigMap;
        let api: Api<ConfigMap> = Api::namespaced(writer_client, "default");
        let mut refused: Vec<(Duration, Duration)> = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        for i in 0..WRITES {
            tick.tick().await;
            let cm: ConfigMap = serde_json::from_value(serde_json::json!({
                "metadata": {"name": format!("w-{i}")},
                "data": {"n": i.to_string()},
            }))
            .unwrap();
            let mut first_refusal = None;
            loop {
                match api.create(&Default::default(), &cm).await {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 409 => break,
                    Err(_) => {
                        first_refusal.get_or_insert(started.elapsed());
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            if let Some(f) = first_refusal {
                refused.push((f, started.elapsed()));
            }
        }
        refused
    });
    // Reads through the gateway all along, a new connection each.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (done, tkc, server, sni) = (done.clone(), tkc.clone(), server.clone(), sni.clone());
        std::thread::spawn(move || {
            let mut results = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let out = kubectl(
                    &tkc,
                    &[
                        "--server",
                        &server,
                        "--tls-server-name",
                        &sni,
                        "--request-timeout=20s",
                        "get",
                        "namespace",
                        "default",
                        "-o",
                        "name",
                    ],
                );
                results.push((!out.status.success()).then(|| {
                    format!(
                        "{:?} {}",
                        started.elapsed(),
                        String::from_utf8_lossy(&out.stderr)
                    )
                }));
            }
            results
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    // What a client holds from the source: a list and its resourceVersion.
    let held = kubectl_ok(
        &tkc,
        &[
            "get",
            "configmaps",
            "-o",
            "jsonpath={.metadata.resourceVersion}|{.items[*].metadata.name}",
        ],
    );
    let (held_rv, held_names) = held.split_once('|').unwrap();
    let held_names: std::collections::BTreeSet<String> =
        held_names.split_whitespace().map(String::from).collect();
    move_to("two");
    eventually("the move completes", Duration::from_secs(180), || {
        (phase() == "Completed").then_some(())
    });
    let refused = writer.await.unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.join().unwrap();
    let failed: Vec<&String> = reads.iter().flatten().collect();
    let freeze = jsonpath(
        &kc,
        &["ncp", "mover"],
        "{.status.migration.writeFreezeSeconds}",
    );
    let worst = refused
        .iter()
        .map(|(a, b)| b.saturating_sub(*a))
        .max()
        .unwrap_or_default();
    // (figures for docs/backup.md and the note, not assertions)
    eprintln!(
        "migration: write freeze {freeze} s in status; the writer saw {} writes refused, the longest for {worst:?}; {} reads, none failed",
        refused.len(),
        reads.len()
    );
    assert!(reads.len() >= 10, "the reader ran: {}", reads.len());
    assert!(
        failed.is_empty(),
        "reads failed during the move: {failed:?}"
    );
    assert!(freeze.parse::<f64>().unwrap() > 0.0, "{freeze}");
    assert_eq!(
        jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.datastore.name}|{.status.migration.from}|{.status.migration.to}|{.status.conditions[?(@.type==\"DatastoreMigration\")].status}"
        ),
        "two|default/one|default/two|False"
    );
    let events = events_for(&kc, "default", "mover");
    for e in ["MigrationStarted", "MigrationFrozen", "MigrationCompleted"] {
        assert!(events.contains(e), "{e}: {events}");
    }
    // Every acknowledged write is there, each with its value, read from the destination.
    all_writes_there(&tkc, WRITES);
    assert!(
        keys_under(&mut root_two.client().await, prefix).await > WRITES as i64,
        "the destination holds the tenant's keys"
    );
    // A client that watches on from what it held misses nothing: it is told to list again
    // (410), or it is sent every change since (the destination's revisions of the copied
    // keys are all newer than the source's they came from).
    let watched = kubectl_ok(
        &tkc,
        &[
            "get",
            "--raw",
            &format!(
                "/api/v1/namespaces/default/configmaps?watch=1&resourceVersion={held_rv}&timeoutSeconds=2"
            ),
        ],
    );
    if !watched.contains("\"code\":410") {
        for i in 0..WRITES {
            let name = format!("w-{i}");
            assert!(
                held_names.contains(&name) || watched.contains(&format!("\"name\":\"{name}\"")),
                "a watch from {held_rv} did not send {name}"
            );
        }
    }
    // The tenant writes on the destination; the source keeps a read-only copy.
    kubectl_ok(
        &tkc,
        &["create", "configmap", "after-move", "--from-literal=n=1"],
    );
    assert_eq!(role_writable(&root_one, user), Some(false));
    assert_eq!(role_writable(&root_two, user), Some(true));
    // (what the tenant held at the freeze: the writes before the move began)
    let w0 = format!("{prefix}registry/configmaps/default/w-0");
    assert_eq!(keys_under(&mut root_one.client().await, &w0).await, 1);
    // The other tenant of the source: the same processes, its data, and it writes.
    let now: Vec<Option<u32>> = ["apiserver", "controller-manager", "scheduler"]
        .iter()
        .map(|p| env.pid("default", "stay", p, 0))
        .collect();
    assert_eq!(now, stay_pids, "the other tenant's processes");
    assert_eq!(
        kubectl_ok(
            &skc,
            &["get", "configmap", "mine", "-o", "jsonpath={.data.k}"]
        ),
        "v"
    );
    kubectl_ok(
        &skc,
        &["create", "configmap", "still", "--from-literal=k=v"],
    );
    assert_eq!(
        role_writable(&root_one, "nestplane:default:stay"),
        Some(true)
    );

    // The way back, its source's copy kept 5 s, with the operator killed during the move.
    kubectl_ok(
        &kc,
        &[
            "annotate",
            "ncp",
            "mover",
            "nestplane.io/migration-retention=5s",
        ],
    );
    let ncps = env.ncps("default");
    move_to("one");
    // Looked at every 20 ms, so that the kill falls within the move.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let at = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the move did not start"
        );
        let n = ncps.get("mover").await.unwrap();
        if let Some(m) = n.status.and_then(|s| s.migration)
            && m.to == "default/one"
            && ["Copying", "Following", "Freezing"].contains(&m.phase.as_str())
        {
            break m.phase;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    operator.kill();
    eprintln!("operator killed while the move was {at}");
    let _operator = env.spawn_operator_with(&gateway_args);
    eventually("the way back completes", Duration::from_secs(180), || {
        (jsonpath(
            &kc,
            &["ncp", "mover"],
            "{.status.migration.phase}|{.status.migration.to}",
        ) == "Completed|default/one")
            .then_some(())
    });
    assert_eq!(
        jsonpath(&kc, &["ncp", "mover"], "{.status.datastore.name}"),
        "one"
    );
    let values = all_writes_there(&tkc, WRITES);
    assert!(values.contains("after-move=1\n"), "{values}");
    kubectl_ok(
        &tkc,
        &["create", "configmap", "back-home", "--from-literal=n=2"],
    );
    assert_eq!(role_writable(&root_one, user), Some(true));
    // After 5 s, the copy on two is deleted: keys, user and role.
    eventually("the copy on two deleted", Duration::from_secs(60), || {
        (jsonpath(&kc, &["ncp", "mover"], "{.status.migration.sourceRemoved}") == "true")
            .then_some(())
    });
    assert_eq!(keys_under(&mut root_two.client().await, prefix).await, 0);
    assert_eq!(role_writable(&root_two, user), None);
}
