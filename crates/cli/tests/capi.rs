//! A Cluster API `Cluster` that owns a control plane is the source of the tenant's identity:
//! a Cluster `foo` whose control plane is `foo-control-plane` gets `foo-kubeconfig`, and
//! `Cluster.spec.paused` pauses reconciling; the endpoint is published as a `ClusterEndpoint`
//! (seed 003) owned by the control plane (process runtime, real tenants).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kube::api::{Api, ListParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};

fn clusters(env: &Env) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta1", "Cluster"),
        "clusters",
    );
    Api::namespaced_with(env.client(), "default", &ar)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_named_foo_gets_foo_kubeconfig_and_its_pause_pauses() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.install_cluster_crd();
    // A Cluster without infrastructureRef, and its control plane owned by it from the start
    // (as Cluster API's templates create them).
    env.apply(
        "apiVersion: cluster.x-k8s.io/v1beta1\nkind: Cluster\nmetadata: {name: foo, namespace: default}\nspec:\n  controlPlaneRef: {apiVersion: controlplane.cluster.x-k8s.io/v1alpha1, kind: NestedControlPlane, name: foo-control-plane}\n",
    );
    let foo = clusters(&env).get("foo").await.unwrap();
    let uid = foo.metadata.uid.clone().unwrap();
    env.apply(&format!(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: foo-control-plane\n  namespace: default\n  ownerReferences:\n  - {{apiVersion: cluster.x-k8s.io/v1beta1, kind: Cluster, name: foo, uid: {uid}, controller: true}}\nspec: {{version: v1.20.2, replicas: 1}}\n"
    ));
    env.wait_ready("default", "foo-control-plane", Duration::from_secs(120))
        .await;

    // The identity is the Cluster's: foo-kubeconfig (which works), foo-ca, …
    let kubeconfig = env.tenant_kubeconfig("default", "foo").await;
    let ns = kubectl_ok(&kubeconfig, &["get", "ns", "kube-system", "-o", "name"]);
    assert_eq!(ns.trim(), "namespace/kube-system");
    assert!(env.secret("default", "foo-ca").await.is_some());
    assert!(
        env.secret("default", "foo-control-plane-kubeconfig")
            .await
            .is_none()
    );
    let ncp = env.ncps("default").get("foo-control-plane").await.unwrap();
    assert_eq!(
        ncp.metadata.annotations.as_ref().unwrap()["nestplane.io/cluster-name"],
        "foo",
        "the identity is recorded"
    );

    // Seed 003: the endpoint is published as ClusterEndpoint foo-apiserver, controlled by the
    // control plane, labelled with the Cluster's name, and it reaches the tenant.
    let endpoint = Api::<nestplane_api::ClusterEndpoint>::namespaced(env.client(), "default")
        .get("foo-apiserver")
        .await
        .unwrap();
    assert_eq!(endpoint.spec.cluster, "foo");
    assert_eq!(
        serde_json::to_value(&endpoint.spec.type_).unwrap(),
        "apiserver"
    );
    assert_eq!(
        endpoint.metadata.labels.as_ref().unwrap()["cluster.x-k8s.io/cluster-name"],
        "foo"
    );
    let owner = endpoint
        .metadata
        .owner_references
        .as_ref()
        .unwrap()
        .iter()
        .find(|r| r.controller == Some(true))
        .unwrap();
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("NestedControlPlane", ncp.metadata.uid.as_deref().unwrap())
    );
    let published = ncp.spec.control_plane_endpoint.clone().unwrap();
    assert_eq!(
        (endpoint.spec.host.as_str(), endpoint.spec.port),
        (published.host.as_str(), published.port)
    );
    let server = format!("https://{}:{}", endpoint.spec.host, endpoint.spec.port);
    let ns = kubectl_ok(
        &kubeconfig,
        &["--server", &server, "get", "ns", "default", "-o", "name"],
    );
    assert_eq!(ns.trim(), "namespace/default");
    let columns = kubectl_ok(&kc, &["get", "clusterendpoints"]);
    assert!(
        columns.contains("CLUSTER") && columns.contains("HOST") && columns.contains("apiserver"),
        "{columns}"
    );

    // Cluster.spec.paused pauses: a new API server replica is not started while paused, and is
    // once the pause is lifted.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "cluster",
            "foo",
            "--type=merge",
            "-p",
            r#"{"spec":{"paused":true}}"#,
        ],
    );
    eventually(
        "the control plane reports Paused",
        Duration::from_secs(30),
        || {
            let st = kubectl_ok(
                &kc,
                &[
                    "get",
                    "ncp",
                    "foo-control-plane",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Paused\")].status}",
                ],
            );
            (st.trim() == "True").then_some(())
        },
    );
    kubectl_ok(&kc, &["scale", "ncp", "foo-control-plane", "--replicas=2"]);
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        env.pid("default", "foo", "apiserver", 1),
        None,
        "nothing starts while paused"
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "cluster",
            "foo",
            "--type=merge",
            "-p",
            r#"{"spec":{"paused":false}}"#,
        ],
    );
    eventually(
        "the second API server starts after the pause",
        Duration::from_secs(90),
        || {
            env.pid("default", "foo", "apiserver", 1)
                .filter(|p| alive(*p))
        },
    );

    // Deleting the control plane removes the Cluster-named secrets.
    kubectl_ok(
        &kc,
        &["delete", "ncp", "foo-control-plane", "--timeout=90s"],
    );
    let left = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(env.client(), "default")
        .list(&ListParams::default().labels("cluster.x-k8s.io/cluster-name=foo"))
        .await
        .unwrap();
    eventually(
        "the ClusterEndpoint goes with its control plane",
        Duration::from_secs(60),
        || {
            let out = kubectl(&kc, &["get", "clusterendpoint", "foo-apiserver"]);
            (!out.status.success()).then_some(())
        },
    );
    assert!(
        left.items.is_empty(),
        "{:?}",
        left.items
            .iter()
            .map(|s| s.metadata.name.clone())
            .collect::<Vec<_>>()
    );
}
