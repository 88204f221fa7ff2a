//! The CRDs: generated from the Rust types, checked in, and served by a real kube-apiserver.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use nestplane_localplane::{LocalPlane, Options};

/// `nestplane crds`, with its arguments.
fn crds_yaml(args: &[&str]) -> String {
    let out = nestplane().arg("crds").args(args).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// The kinds of a multi-document CRD YAML, in order.
fn kinds(yaml: &str) -> Vec<String> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml).unwrap();
    docs.iter()
        .map(|d| d["spec"]["names"]["kind"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn checked_in_crds_match_the_types() {
    // Each provider's CRDs are checked in where its kustomize tree reads them.
    for (provider, file) in [
        ("control-plane", "config/crd/nestplane.yaml"),
        ("bootstrap", "config/bootstrap/crds.yaml"),
    ] {
        let generated = crds_yaml(&["--provider", provider]);
        let path = repo().join(file);
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            generated == checked_in,
            "{} is out of date: run `make crds` and commit the result",
            path.display()
        );
    }
    let control_plane = kinds(&crds_yaml(&["--provider", "control-plane"]));
    for kind in [
        "NestedControlPlane",
        "NestedEtcd",
        "NestedAPIServer",
        "NestedControllerManager",
        "NestedScheduler",
    ] {
        assert!(control_plane.iter().any(|k| k == kind), "{kind} missing");
    }
    // clusterctl lets one provider own a CRD: no kind is in both, and `nestplane crds`
    // prints them all.
    let bootstrap = kinds(&crds_yaml(&["--provider", "bootstrap"]));
    assert_eq!(bootstrap, ["NestplaneConfig", "NestplaneConfigTemplate"]);
    assert!(control_plane.iter().all(|k| !bootstrap.contains(k)));
    let all = kinds(&crds_yaml(&[]));
    assert_eq!(all.len(), control_plane.len() + bootstrap.len());
}

#[tokio::test]
async fn crds_install_samples_apply_scale_and_validate() {
    let plane = LocalPlane::start(Options::default())
        .await
        .expect("management plane");
    let kc = plane.kubeconfig_path().to_path_buf();
    let crds = String::from_utf8(nestplane().arg("crds").output().unwrap().stdout).unwrap();

    // `nestplane crds | kubectl apply -f -` works against a real apiserver.
    let out = kubectl_stdin(&kc, &["apply", "-f", "-"], Some(&crds));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_all_established(&kc);

    // CAPI reads the contract labels on the CRD.
    let labels = kubectl_ok(
        &kc,
        &[
            "get",
            "crd",
            "nestedcontrolplanes.controlplane.cluster.x-k8s.io",
            "-o",
            "jsonpath={.metadata.labels}",
        ],
    );
    assert!(
        labels.contains(r#""cluster.x-k8s.io/v1beta1":"v1alpha1""#),
        "{labels}"
    );
    assert!(
        labels.contains(r#""cluster.x-k8s.io/v1beta2":"v1alpha1""#),
        "{labels}"
    );

    let samples = repo().join("config/samples/nestedcontrolplane.yaml");
    kubectl_ok(&kc, &["apply", "-f", samples.to_str().unwrap()]);
    let got = kubectl_ok(
        &kc,
        &[
            "get",
            "nestedetcds,nestedapiservers,nestedcontrollermanagers,nestedschedulers",
            "-o",
            "name",
        ],
    );
    assert_eq!(got.lines().count(), 4, "{got}");
    // Seed 001's sample PostCreateConfig applies unchanged.
    let pcc = repo().join("config/samples/postcreateconfig.yaml");
    kubectl_ok(&kc, &["apply", "-f", pcc.to_str().unwrap()]);
    let got = kubectl_ok(
        &kc,
        &[
            "get",
            "postcreateconfig",
            "postcreate-conf",
            "-o",
            "jsonpath={.spec.resources[1].namespace}",
        ],
    );
    assert_eq!(got, "nw-system");

    // The short name and the columns a person reads.
    let table = kubectl_ok(&kc, &["get", "ncp"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "READY",
            "INITIALIZED",
            "VERSION",
            "ENDPOINT",
            "REPLICAS",
            "AVAILABLE",
            "AGE"
        ]
    );
    let wide = kubectl_ok(&kc, &["get", "ncp", "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("REASON"), "{wide}");

    // The scale subresource drives spec.replicas.
    kubectl_ok(&kc, &["scale", "ncp", "sample", "--replicas=3"]);
    let replicas = kubectl_ok(
        &kc,
        &["get", "ncp", "sample", "-o", "jsonpath={.spec.replicas}"],
    );
    assert_eq!(replicas, "3");
    let scale = kubectl_ok(
        &kc,
        &[
            "get",
            "--raw",
            "/apis/controlplane.cluster.x-k8s.io/v1alpha1/namespaces/default/nestedcontrolplanes/sample/scale",
        ],
    );
    assert!(scale.contains(r#""replicas":3"#), "{scale}");

    // The schema rejects nonsense.
    let bad = "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: bad\n  namespace: default\nspec:\n  replicas: -1\n";
    let out = kubectl_stdin(&kc, &["apply", "-f", "-"], Some(bad));
    assert!(!out.status.success(), "negative replicas must be rejected");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spec.replicas"), "{err}");
    let bad_etcd = "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedEtcd\nmetadata:\n  name: bad\n  namespace: default\nspec:\n  replicas: 0\n";
    let out = kubectl_stdin(&kc, &["apply", "-f", "-"], Some(bad_etcd));
    assert!(
        !out.status.success(),
        "an etcd without members must be rejected"
    );
    let _ = Duration::from_secs(0);
}

/// A CRD that another one keeps from being served (it holds the same kind in the group) is
/// named by the install, which fails instead of going on as if it were served; the other
/// CRD is left as it was.
#[tokio::test]
async fn install_names_a_crd_that_another_keeps_from_being_served() {
    let plane = LocalPlane::start(Options::default())
        .await
        .expect("management plane");
    let kc = plane.kubeconfig_path().to_path_buf();
    let impostor = "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: impostors.controlplane.cluster.x-k8s.io}\nspec:\n  group: controlplane.cluster.x-k8s.io\n  scope: Namespaced\n  names: {plural: impostors, singular: impostor, kind: NestedControlPlane, listKind: ImpostorList}\n  versions:\n  - name: v1alpha1\n    served: true\n    storage: true\n    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}\n";
    let out = kubectl_stdin(&kc, &["apply", "-f", "-"], Some(impostor));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_established(&kc, "impostors.controlplane.cluster.x-k8s.io");

    let err = nestplane_operator::crds::install(&plane.client(), Duration::from_secs(5))
        .await
        .expect_err("installed although a CRD is not served");
    match &err {
        nestplane_operator::crds::InstallError::NotEstablished { names, .. } => {
            assert_eq!(
                names,
                &["nestedcontrolplanes.controlplane.cluster.x-k8s.io"]
            )
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("NamesAccepted"), "{err}");
    let accepted = kubectl_ok(
        &kc,
        &[
            "get",
            "crd",
            "nestedcontrolplanes.controlplane.cluster.x-k8s.io",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"NamesAccepted\")].reason}",
        ],
    );
    assert_eq!(accepted, "KindConflict");
    // The others are served, and the impostor is untouched.
    let served = kubectl_ok(
        &kc,
        &[
            "get",
            "crd",
            "nestedetcds.controlplane.cluster.x-k8s.io",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
        ],
    );
    assert_eq!(served, "True");
    kubectl_ok(
        &kc,
        &["get", "crd", "impostors.controlplane.cluster.x-k8s.io"],
    );
}

/// The README's test command ends with the run that counts every test, so the last summary
/// line CI reads is the real count (doc tests run first).
#[test]
fn the_test_command_ends_with_the_counting_run() {
    let script = std::fs::read_to_string(common::repo().join("scripts/test.sh")).unwrap();
    let runs: Vec<&str> = script
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo nextest run") || l.starts_with("cargo test"))
        .collect();
    let nextest = runs
        .iter()
        .position(|l| l.starts_with("cargo nextest run"))
        .expect("a nextest run");
    let doc = runs
        .iter()
        .position(|l| l.contains("--doc"))
        .expect("a doc-test run");
    assert!(
        doc < nextest,
        "doc tests run before the counting run: {runs:?}"
    );
}
