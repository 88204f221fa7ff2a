//! PostCreateConfig (seed 001) against real tenants (process runtime): all or nothing per
//! cluster, applied once, to exactly the clusters the selector matches — control planes no
//! Cluster owns and Cluster API `Cluster`s alike.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

/// A JSONPath of PostCreateConfig `addons`.
fn field(kc: &Path, path: &str) -> String {
    kubectl_ok(
        kc,
        &[
            "get",
            "postcreateconfig",
            "addons",
            "-o",
            &format!("jsonpath={path}"),
        ],
    )
}

fn condition(kc: &Path, type_: &str) -> (String, String, String) {
    let get = |f: &str| {
        field(
            kc,
            &format!("{{.status.conditions[?(@.type==\"{type_}\")].{f}}}"),
        )
    };
    (get("status"), get("reason"), get("message"))
}

fn wait_condition(kc: &Path, type_: &str, status: &str, reason: &str) -> String {
    eventually(
        &format!("{type_}={status} ({reason})"),
        Duration::from_secs(90),
        || {
            let (s, r, m) = condition(kc, type_);
            (s == status && r == reason).then_some(m)
        },
    )
}

/// The ConfigMap's `data.cni` in a tenant, if it exists.
fn cni_in(tenant: &Path) -> Option<String> {
    let out = kubectl(
        tenant,
        &[
            "get",
            "configmap",
            "calico-conf",
            "-o",
            "jsonpath={.data.cni}",
        ],
    );
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn has_addons(tenant: &Path) -> bool {
    cni_in(tenant).is_some()
        && kubectl(tenant, &["get", "deployment", "web", "-n", "addons"])
            .status
            .success()
}

fn cni_secret(value: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: cni-addon, namespace: default}}\ntype: Opaque\nstringData:\n  addon.yaml: |-\n    kind: ConfigMap\n    apiVersion: v1\n    metadata:\n     name: calico-conf\n    data: {{cni: {value}}}\n"
    )
}

const APP_SECRET: &str = "apiVersion: v1\nkind: Secret\nmetadata: {name: app-addon, namespace: default}\ntype: Opaque\nstringData:\n  addon.yaml: |\n    apiVersion: apps/v1\n    kind: Deployment\n    metadata: {name: web, namespace: addons}\n    spec:\n      replicas: 1\n      selector: {matchLabels: {app: web}}\n      template:\n        metadata: {labels: {app: web}}\n        spec:\n          containers: [{name: web, image: registry.k8s.io/pause:3.2}]\n    ---\n    apiVersion: v1\n    kind: Namespace\n    metadata: {name: addons}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addons_reach_exactly_the_selected_clusters_once_and_bad_input_applies_nothing() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.install_cluster_crd();
    // Three tenants: two control planes of their own and one owned by a Cluster, which is
    // labelled differently.
    for t in ["t1", "t2"] {
        env.apply(&format!(
            "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {{name: {t}, namespace: default, labels: {{cni: calico}}}}\nspec: {{version: v1.20.2}}\n"
        ));
    }
    env.apply("apiVersion: cluster.x-k8s.io/v1beta1\nkind: Cluster\nmetadata: {name: c3, namespace: default, labels: {cni: none}}\nspec: {}\n");
    let c3_uid = kubectl_ok(
        &kc,
        &["get", "cluster", "c3", "-o", "jsonpath={.metadata.uid}"],
    );
    env.apply(&format!(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: c3-control-plane\n  namespace: default\n  ownerReferences:\n  - {{apiVersion: cluster.x-k8s.io/v1beta1, kind: Cluster, name: c3, uid: {c3_uid}, controller: true}}\nspec: {{version: v1.20.2}}\n"
    ));

    // The seed's PostCreateConfig shape; one of its two Secrets does not exist yet.
    env.apply(&cni_secret("calico"));
    env.apply("apiVersion: postcreate.cluster.x-k8s.io/v1alpha3\nkind: PostCreateConfig\nmetadata: {name: addons, namespace: default}\nspec:\n  clusterSelector:\n    matchLabels: {cni: calico}\n  resources:\n  - {name: cni-addon, namespace: default}\n  - {name: app-addon, namespace: default}\n");
    for name in ["t1", "t2", "c3-control-plane"] {
        env.wait_ready("default", name, Duration::from_secs(240))
            .await;
    }
    let t1 = env.tenant_kubeconfig("default", "t1").await;
    let t2 = env.tenant_kubeconfig("default", "t2").await;
    let c3 = env.tenant_kubeconfig("default", "c3").await;

    // A missing Secret: nothing anywhere, a condition and an Event that name it.
    let msg = wait_condition(&kc, "ResourcesAvailable", "False", "SecretNotFound");
    assert!(msg.contains("default/app-addon"), "{msg}");
    eventually("the SecretNotFound Event", Duration::from_secs(30), || {
        events_for(&kc, "default", "addons")
            .contains("SecretNotFound")
            .then_some(())
    });
    assert_eq!(
        cni_in(&t1),
        None,
        "nothing is applied while a Secret is missing"
    );

    // A document with a syntax error: reported with its index, still nothing applied.
    env.apply(&APP_SECRET.replace("kind: Namespace", "kind: [Namespace"));
    let msg = wait_condition(&kc, "ResourcesAvailable", "False", "InvalidResource");
    assert!(
        msg.contains("default/app-addon") && msg.contains("document 1"),
        "{msg}"
    );
    assert_eq!(cni_in(&t1), None);
    assert_eq!(cni_in(&t2), None);

    // Fixed: exactly the two selected tenants get everything (the Namespace before the
    // Deployment in it), and are listed.
    env.apply(APP_SECRET);
    wait_condition(&kc, "Ready", "True", "AsExpected");
    assert!(has_addons(&t1) && has_addons(&t2));
    assert_eq!(cni_in(&t1).as_deref(), Some("calico"));
    assert!(
        !has_addons(&c3),
        "the Cluster labelled cni=none gets nothing"
    );
    let listed = field(
        &kc,
        "{range .status.clusterRefList[*]}{.kind}/{.name} {end}",
    );
    let mut listed: Vec<&str> = listed.split_whitespace().collect();
    listed.sort();
    assert_eq!(listed, ["NestedControlPlane/t1", "NestedControlPlane/t2"]);
    assert!(events_for(&kc, "default", "addons").contains("Applied"));

    // Labelling the Cluster later applies there too.
    kubectl_ok(
        &kc,
        &["label", "cluster", "c3", "cni=calico", "--overwrite"],
    );
    eventually(
        "the addons in the Cluster's tenant",
        Duration::from_secs(90),
        || has_addons(&c3).then_some(()),
    );
    eventually("the Cluster listed", Duration::from_secs(30), || {
        let listed = field(&kc, "{.status.clusterRefList[*].name}");
        let mut listed: Vec<&str> = listed.split_whitespace().collect();
        listed.sort();
        (listed == ["c3", "t1", "t2"]).then_some(())
    });
    let columns = kubectl_ok(&kc, &["get", "postcreateconfig", "addons"]);
    assert!(
        columns.contains("MATCHED") && columns.contains("APPLIED"),
        "{columns}"
    );

    // Editing a Secret afterwards changes nothing in the tenants (applied once) and says so.
    env.apply(&cni_secret("cilium"));
    let msg = wait_condition(&kc, "OutOfDate", "True", "ResourcesChanged");
    assert!(msg.contains("t1") && msg.contains("c3"), "{msg}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    for t in [&t1, &t2, &c3] {
        assert_eq!(cni_in(t).as_deref(), Some("calico"));
    }
    eventually("the OutOfDate Event", Duration::from_secs(30), || {
        events_for(&kc, "default", "addons")
            .contains("OutOfDate")
            .then_some(())
    });

    // Opting into Reconcile applies the change (server-side apply) everywhere.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "postcreateconfig",
            "addons",
            "--type=merge",
            "-p",
            r#"{"spec":{"strategy":"Reconcile"}}"#,
        ],
    );
    for t in [&t1, &t2, &c3] {
        eventually("the changed ConfigMap", Duration::from_secs(90), || {
            (cni_in(t).as_deref() == Some("cilium")).then_some(())
        });
    }
    wait_condition(&kc, "OutOfDate", "False", "AsExpected");
    assert!(
        !env.operator.as_ref().unwrap().is_finished(),
        "bad input never stops the operator"
    );
}
