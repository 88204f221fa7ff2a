#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use nestplane_api::postcreate::PostCreateConfig;

fn pcc(resources: serde_json::Value, strategy: Option<&str>) -> PostCreateConfig {
    let mut spec = serde_json::json!({
        "clusterSelector": {"matchLabels": {"cni": "calico"}},
        "resources": resources,
    });
    if let Some(s) = strategy {
        spec["strategy"] = s.into();
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "postcreate.cluster.x-k8s.io/v1alpha3",
        "kind": "PostCreateConfig",
        "metadata": {"name": "p", "namespace": "default", "generation": 1},
        "spec": spec,
    }))
    .unwrap()
}

fn secrets<'a>(
    list: &'a [(&'a str, &'a str, Option<&'a str>, bool)],
) -> impl Fn(&str, &str) -> Option<SecretView> + 'a {
    move |ns, name| {
        list.iter()
            .find(|(n, m, _, _)| *n == ns && *m == name)
            .map(|(_, _, yaml, shared)| SecretView {
                labels: if *shared {
                    [(SHARED_LABEL.to_string(), "true".to_string())].into()
                } else {
                    Default::default()
                },
                addon: yaml.map(str::to_string),
            })
    }
}

const CM: &str = "kind: ConfigMap\napiVersion: v1\nmetadata:\n name: calico-conf\n";

#[test]
fn every_secret_must_exist_and_parse_before_anything_is_applied() {
    let p = pcc(
        serde_json::json!([{"name": "a", "namespace": "default"}, {"name": "b", "namespace": "default"}]),
        None,
    );
    let cm = CM.to_string();
    let only_a = [("default", "a", Some(cm.as_str()), false)];
    let err = documents(&p, secrets(&only_a)).unwrap_err();
    assert_eq!(err.reason, reasons::SECRET_NOT_FOUND);
    assert_eq!(err.secret, "default/b");
    assert!(err.message.contains("default/b"), "{}", err.message);

    let bad =
        "kind: ConfigMap\napiVersion: v1\nmetadata: {name: ok}\n---\nkind: [unclosed\n".to_string();
    let with_bad = [
        ("default", "a", Some(cm.as_str()), false),
        ("default", "b", Some(bad.as_str()), false),
    ];
    let err = documents(&p, secrets(&with_bad)).unwrap_err();
    assert_eq!(err.reason, reasons::INVALID_RESOURCE);
    assert!(err.message.contains("document 1"), "{}", err.message);

    let no_key = [
        ("default", "a", Some(cm.as_str()), false),
        ("default", "b", None, false),
    ];
    let err = documents(&p, secrets(&no_key)).unwrap_err();
    assert!(err.message.contains("addon.yaml"), "{}", err.message);
}

#[test]
fn secrets_of_other_namespaces_need_the_shared_label() {
    let p = pcc(
        serde_json::json!([{"name": "np", "namespace": "nw-system"}]),
        None,
    );
    let cm = CM.to_string();
    let unshared = [("nw-system", "np", Some(cm.as_str()), false)];
    let err = documents(&p, secrets(&unshared)).unwrap_err();
    assert_eq!(err.reason, reasons::SECRET_NOT_SHARED);
    let shared = [("nw-system", "np", Some(cm.as_str()), true)];
    assert_eq!(documents(&p, secrets(&shared)).unwrap().docs.len(), 1);
}

#[test]
fn namespaces_and_crds_go_first_and_the_hash_follows_the_content() {
    let p = pcc(serde_json::json!([{"name": "a"}]), None);
    let yaml = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d, namespace: addons}\n---\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: addons}\n---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: widgets.example.com}\n";
    let list = [("default", "a", Some(yaml), false)];
    let d = documents(&p, secrets(&list)).unwrap();
    let kinds: Vec<_> = d
        .docs
        .iter()
        .map(|d| d.object["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        ["Namespace", "CustomResourceDefinition", "Deployment"]
    );
    assert_eq!(d.first, 2);
    assert_eq!(d.docs[0].index, 2, "empty documents still count");
    assert_eq!(d.docs[2].describe(), "Deployment addons/d");
    let changed = yaml.replace("name: d,", "name: e,");
    let list2 = [("default", "a", Some(changed.as_str()), false)];
    assert_ne!(documents(&p, secrets(&list2)).unwrap().hash, d.hash);
}

#[test]
fn documents_without_kind_or_name_are_refused_with_their_index() {
    assert_eq!(parse("").unwrap(), vec![]);
    assert_eq!(parse("a: [1\n").unwrap_err().0, 0);
    let e = parse("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nmetadata: {name: b}\n").unwrap_err();
    assert_eq!(e, (1, "no kind".to_string()));
    assert_eq!(parse("- 1\n- 2\n").unwrap_err().0, 0);
    // Documents are cut and counted as kubectl cuts them: a leading `---` starts the first,
    // `---` alone (or with a comment) makes an empty one, and a `---` inside an indented block
    // scalar is text.
    let stream = "# addons\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata:\n  x: |\n    ---\n    y\n--- # empty\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n...\n";
    let docs = parse(stream).unwrap();
    let seen: Vec<_> = docs
        .iter()
        .map(|(i, v)| (*i, v["metadata"]["name"].as_str().unwrap()))
        .collect();
    assert_eq!(seen, [(0, "a"), (2, "b")]);
    assert_eq!(docs[0].1["data"]["x"], "---\ny\n");
}

/// What kubectl would show a reviewer differently, or not at all, is refused: a document on
/// its `---` line, one hidden after a `...`, and a merge key (kubectl lets a later `<<` win
/// over an explicit key; serde-saphyr the reverse).
#[test]
fn documents_kubectl_would_read_otherwise_are_refused() {
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n";
    let inline = format!("{cm}--- {{apiVersion: v1, kind: ConfigMap, metadata: {{name: c}}}}\n");
    let (index, why) = parse(&inline).unwrap_err();
    assert_eq!(index, 1);
    assert!(why.contains("after the document's `---`"), "{why}");

    let hidden = format!(
        "{cm}...\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {{name: x}}\n"
    );
    assert_eq!(parse(&hidden).unwrap_err().0, 0);

    let merged = "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: x}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cluster-admin, <<: {name: view}}\n";
    let (index, why) = parse(merged).unwrap_err();
    assert_eq!(index, 0);
    assert!(why.contains("merge"), "{why}");
}

/// Each document has its own parse budget, so one Secret of many small documents, each
/// multiplying itself through aliases, is stopped by what they weigh together.
#[test]
fn many_small_alias_bombs_are_stopped_together() {
    let mut doc = String::from(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: m}\nx: &a0 [xxxxxxxxxxxxxxxx, xxxxxxxxxxxxxxxx, xxxxxxxxxxxxxxxx, xxxxxxxxxxxxxxxx]\n",
    );
    for i in 1..5 {
        let p = i - 1;
        doc.push_str(&format!(
            "y{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
        ));
    }
    let one = parse(&doc).unwrap();
    let weight = serde_json::to_vec(&one[0].1).unwrap().len();
    assert!(weight > 10 * doc.len(), "each document expands: {weight}");
    let stream = vec![doc.as_str(); MAX_READ_BYTES / weight + 2].join("---\n");
    assert!(stream.len() < 1 << 20, "fits in a Secret: {}", stream.len());
    let (_, why) = parse(&stream).unwrap_err();
    assert!(why.contains("MiB"), "{why}");
}

/// An addon Secret is written by a namespace user: YAML that expands aliases into billions
/// of nodes, or nests deeper than any manifest does, is refused with its document's index,
/// quickly and in little memory, before anything is applied.
#[test]
fn yaml_bombs_in_an_addon_secret_are_refused() {
    let mut laughs = String::from(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: lol}\n---\na0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n",
    );
    for i in 1..10 {
        let p = i - 1;
        laughs.push_str(&format!(
            "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
        ));
    }
    laughs.push_str("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: boom}\ndata: {x: *a9}\n");
    let started = std::time::Instant::now();
    let (index, why) = parse(&laughs).unwrap_err();
    assert_eq!(index, 1);
    assert!(why.contains("alias replay limit"), "{why}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));

    let deep = format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: deep}}\ndata: {{x: {}{}}}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let (index, why) = parse(&deep).unwrap_err();
    assert_eq!(index, 0);
    assert!(why.contains("recursion limit"), "{why}");
}

#[test]
fn an_empty_selector_matches_nothing() {
    let labels: BTreeMap<String, String> = [("cni".to_string(), "calico".to_string())].into();
    assert!(!selects(&LabelSelector::default(), &labels));
    let s: LabelSelector =
        serde_json::from_value(serde_json::json!({"matchLabels": {"cni": "calico"}})).unwrap();
    assert!(selects(&s, &labels));
    assert!(!selects(&s, &BTreeMap::new()));
    let e: LabelSelector = serde_json::from_value(serde_json::json!({"matchExpressions": [
        {"key": "cni", "operator": "In", "values": ["calico", "cilium"]},
        {"key": "env", "operator": "DoesNotExist"}
    ]}))
    .unwrap();
    assert!(selects(&e, &labels));
    let mut prod = labels.clone();
    prod.insert("env".into(), "prod".into());
    assert!(!selects(&e, &prod));
    let odd: LabelSelector = serde_json::from_value(serde_json::json!({"matchExpressions": [
        {"key": "cni", "operator": "Resembles", "values": ["calico"]}
    ]}))
    .unwrap();
    assert!(!selects(&odd, &labels));
}

fn target(name: &str, uid: &str, waiting: Option<&str>) -> Target {
    Target {
        kind: "Cluster".into(),
        name: name.into(),
        uid: uid.into(),
        labels: Default::default(),
        waiting: waiting.map(str::to_string),
        kubeconfig: format!("{name}-kubeconfig"),
    }
}

fn record(name: &str, uid: &str, hash: &str) -> AppliedResources {
    AppliedResources {
        name: name.into(),
        uid: uid.into(),
        hash: hash.into(),
        applied_at: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    }
}

#[test]
fn applied_once_per_cluster_uid_and_changes_only_under_reconcile() {
    let done = [record("a", "u1", "h1")];
    let a = target("a", "u1", None);
    assert_eq!(step(&a, &done, "h1", Strategy::ApplyOnce), Step::Done);
    assert_eq!(step(&a, &done, "h2", Strategy::ApplyOnce), Step::OutOfDate);
    assert_eq!(step(&a, &done, "h2", Strategy::Reconcile), Step::Apply);
    let recreated = target("a", "u2", None);
    assert_eq!(
        step(&recreated, &done, "h1", Strategy::ApplyOnce),
        Step::Apply
    );
    let paused = target("b", "u3", Some("paused"));
    assert_eq!(
        step(&paused, &done, "h1", Strategy::ApplyOnce),
        Step::Wait("paused".into())
    );
}

#[test]
fn deleted_clusters_leave_the_list_and_unlabelled_ones_stay() {
    let mut p = pcc(serde_json::json!([{"name": "a"}]), None);
    p.status = Some(PostCreateConfigStatus {
        cluster_ref_list: vec![
            ClusterRef {
                kind: "Cluster".into(),
                name: "gone".into(),
                namespace: "default".into(),
                uid: "u-gone".into(),
            },
            ClusterRef {
                kind: "Cluster".into(),
                name: "unlabelled".into(),
                namespace: "default".into(),
                uid: "u-un".into(),
            },
        ],
        applied: vec![
            record("gone", "u-gone", "h"),
            record("unlabelled", "u-un", "h"),
        ],
        ..Default::default()
    });
    let new = target("new", "u-new", None);
    let pass = Pass {
        existing: ["u-un".to_string(), "u-new".to_string()].into(),
        matched: vec![new.clone()],
        applied_now: vec![(new, "h".into())],
        ..Default::default()
    };
    let st = status(&p, &pass, k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let names: Vec<_> = st
        .cluster_ref_list
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(names, ["unlabelled", "new"]);
    assert_eq!((st.matched_clusters, st.applied_clusters), (1, 1));
    assert!(conditions::is_true(&st.conditions, types::READY));
    assert!(!conditions::is_true(&st.conditions, types::OUT_OF_DATE));
}

#[test]
fn a_missing_secret_and_an_out_of_date_cluster_are_said_in_conditions() {
    let p = pcc(serde_json::json!([{"name": "a"}]), None);
    let pass = Pass {
        problem: Some(Problem {
            reason: reasons::SECRET_NOT_FOUND,
            message: "Secret default/a does not exist".into(),
            secret: "default/a".into(),
        }),
        out_of_date: vec!["x".into()],
        ..Default::default()
    };
    let st = status(&p, &pass, k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let ready = conditions::get(&st.conditions, types::READY).unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "SecretNotFound")
    );
    assert!(conditions::is_true(&st.conditions, types::OUT_OF_DATE));
    assert_eq!(st.observed_generation, Some(1));
}
