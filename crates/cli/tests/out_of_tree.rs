//! Out-of-tree component controllers (seed 000): a component handed to someone else —
//! by the `cluster.x-k8s.io/managed-by` annotation, or by running the operator without that
//! kind's controller (`--controllers=*,-etcd`) — is only read. The test plays the outside
//! provisioner for real: it runs an etcd itself, with a serving certificate from the tenant's
//! etcd CA, fills in the `NestedEtcd` status, and nestplane brings up an API server on it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use kube::api::{Api, Patch, PatchParams};
use nestplane_api::NestedEtcd;

/// Start an etcd the way an outside provisioner would: TLS with a certificate from `ca`,
/// client certificates required and checked against the same CA.
fn run_etcd(dir: &std::path::Path, ca: &nestplane_pki::CertKey, port: u16) -> KillOnDrop {
    let now = time::OffsetDateTime::now_utc();
    let serving = nestplane_pki::issue(
        ca,
        &nestplane_pki::LeafSpec {
            common_name: "outside-etcd".into(),
            organizations: vec![],
            dns_names: vec!["localhost".into()],
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
            .arg("--name=outside")
            .arg(format!("--data-dir={}", f("data")))
            .arg(format!("--listen-client-urls=https://127.0.0.1:{port}"))
            .arg(format!("--advertise-client-urls=https://127.0.0.1:{port}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=outside=http://127.0.0.1:{peer}"))
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

fn ca_from(secret: &k8s_openapi::api::core::v1::Secret) -> nestplane_pki::CertKey {
    let data = secret.data.as_ref().unwrap();
    let text = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    nestplane_pki::CertKey {
        cert_pem: text("tls.crt"),
        key_pem: text("tls.key"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outside_etcd_provisioner_fills_the_status_and_nestplane_builds_on_it() {
    let mut env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedEtcd\nmetadata:\n  name: ext-etcd\n  namespace: default\n  annotations: {cluster.x-k8s.io/managed-by: test-provisioner}\nspec: {}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {name: ext, namespace: default}\nspec:\n  version: v1.20.2\n  etcd: {apiVersion: controlplane.cluster.x-k8s.io/v1alpha1, kind: NestedEtcd, name: ext-etcd, namespace: default}\n",
    );
    let etcds: Api<NestedEtcd> = Api::namespaced(env.client(), "default");

    // nestplane issues the etcd CA the provisioner serves with, adopts the component (owner
    // reference), and otherwise leaves it alone: no status, no etcd process of its own. The
    // API server waits for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let ca = loop {
        if let Some(s) = env.secret("default", "ext-etcd").await {
            break ca_from(&s);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no etcd CA ext-etcd after 60s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eventually(
        "the API server waiting for the outside etcd",
        Duration::from_secs(60),
        || {
            let msg = kubectl_ok(
                &kc,
                &[
                    "get",
                    "nestedapiserver",
                    "ext-apiserver",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Ready\")].message}",
                ],
            );
            msg.contains("waiting for NestedEtcd default/ext-etcd")
                .then_some(())
        },
    );
    let etcd = etcds.get("ext-etcd").await.unwrap();
    assert!(etcd.status.is_none(), "nestplane wrote {:?}", etcd.status);
    assert!(
        etcd.metadata
            .owner_references
            .unwrap_or_default()
            .iter()
            .any(|r| r.kind == "NestedControlPlane" && r.name == "ext"),
        "adopted by its control plane"
    );
    assert_eq!(env.pid("default", "ext", "etcd", 0), None);

    // The provisioner runs etcd and reports it, as the status contract says.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _etcd = run_etcd(dir.path(), &ca, port);
    etcds
        .patch_status(
            "ext-etcd",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {
                "ready": true,
                "readyReplicas": 1,
                "version": "3.4.13",
                "phase": "Ready",
                "addresses": [{"ip": "127.0.0.1", "port": port}],
            }})),
        )
        .await
        .unwrap();

    // nestplane brings up the rest on it: a tenant that works and keeps its data there.
    env.wait_ready("default", "ext", Duration::from_secs(180))
        .await;
    let tenant = env.tenant_kubeconfig("default", "ext").await;
    kubectl_ok(&tenant, &["create", "namespace", "kept-outside"]);
    let etcdctl = env
        .etcdctl("default", "ext", vec![format!("https://127.0.0.1:{port}")])
        .await;
    let (ok, keys, err) = etcdctl.run(&["get", "/registry/namespaces/kept-outside", "--keys-only"]);
    assert!(ok, "{err}");
    assert!(
        keys.contains("/registry/namespaces/kept-outside"),
        "{keys:?}"
    );
    let etcd = etcds.get("ext-etcd").await.unwrap();
    let st = etcd.status.unwrap();
    assert!(
        st.common.conditions.is_empty() && st.common.phase.as_deref() == Some("Ready"),
        "the provisioner's status is left as it wrote it: {st:?}"
    );
    assert_eq!(env.pid("default", "ext", "etcd", 0), None);

    // The same without the annotation, by running the operator without the etcd controller:
    // nestplane still does not take etcd over, and the tenant stays up.
    env.operator.take().unwrap().stop().await.unwrap();
    env.start_operator_running(nestplane_operator::Controllers::parse("*,-etcd").unwrap());
    kubectl_ok(
        &kc,
        &[
            "annotate",
            "nestedetcd",
            "ext-etcd",
            "cluster.x-k8s.io/managed-by-",
        ],
    );
    // (Stopping the operator stopped the tenant's processes; the new one starts them again,
    // on the same outside etcd, where the namespace still is.)
    eventually(
        "the tenant back, with its data",
        Duration::from_secs(120),
        || {
            let out = kubectl(&tenant, &["get", "ns", "kept-outside", "-o", "name"]);
            (String::from_utf8_lossy(&out.stdout).trim() == "namespace/kept-outside").then_some(())
        },
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let st = etcds.get("ext-etcd").await.unwrap().status.unwrap();
    assert!(st.common.conditions.is_empty(), "{st:?}");
    assert_eq!(env.pid("default", "ext", "etcd", 0), None);
}
