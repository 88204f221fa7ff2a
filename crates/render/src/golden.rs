//! Golden renderings: what a set of tenants renders to is pinned in `crates/render/golden/`,
//! so that a change of the operator that would restart running control planes (a process's
//! template hash, a workload's pod template) cannot pass unnoticed. An intended change is
//! written with `NESTPLANE_UPDATE_GOLDEN=1 cargo test -p nestplane-render golden`, and the
//! diff of the golden files is then part of the change for a reviewer to see (and for the
//! release notes: upgrading the operator restarts what it changes).

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde_json::{Value, json};

use crate::{
    Component, KubeVersion, Network, RenderInput, objects, process_objects, render, template_hash,
};

/// The tenants whose renderings are pinned: each runtime's default, replicas, a shared
/// datastore, resources, a non-default service network, the oldest and newest minors.
fn cases() -> Vec<(&'static str, RenderInput)> {
    let loopback = |n: u8| Network::Loopback {
        hosts: (1..=n).map(|i| Ipv4Addr::new(127, 64, 3, i)).collect(),
    };
    let v = |minor| KubeVersion::new(1, minor, 2);
    let mut out = vec![
        (
            "process-default",
            RenderInput::new("demo", "default", v(20), loopback(1)),
        ),
        (
            "kubernetes-default",
            RenderInput::new("demo", "tenants", v(20), Network::Cluster),
        ),
        (
            "kubernetes-1.34",
            RenderInput::new("demo", "tenants", v(34), Network::Cluster),
        ),
    ];
    let mut three = RenderInput::new("ha", "tenants", v(20), loopback(3))
        .with_replicas(Component::Etcd, 3)
        .with_replicas(Component::ApiServer, 3);
    three.service_cidr = "10.128.0.0/16".into();
    three.cluster_domain = "tenant.local".into();
    out.push(("process-three-replicas", three));
    let mut shared = RenderInput::new("onds", "team-a", v(20), Network::Cluster);
    shared.external_etcd = Some(vec!["https://10.0.0.9:2379".into()]);
    shared.datastore_prefix = Some("/nestplane/team-a/onds/".into());
    shared.apiserver_service_type = "NodePort".into();
    out.push(("kubernetes-shared-datastore", shared));
    let mut limits = RenderInput::new("small", "default", v(27), Network::Cluster);
    limits.etcd_auto_compaction = Some("5m".into());
    limits.etcd_quota_backend_bytes = Some(1 << 30);
    limits.resources.insert(
        Component::ApiServer,
        serde_json::from_value(json!({"requests": {"cpu": "50m", "memory": "128Mi"}}))
            .expect("resources"),
    );
    out.push(("kubernetes-limits", limits));
    out
}

/// What each case renders to: per component, the process runtime's template hash and the
/// objects of the runtime the case names.
fn rendered(input: &RenderInput) -> Value {
    let mut out = serde_json::Map::new();
    for c in Component::ALL {
        if c == Component::Etcd && input.external_etcd.is_some() {
            continue;
        }
        let r = render(c, input).expect("the golden cases render");
        let objs = match input.network {
            Network::Cluster => objects(&r, input, "secrets-checksum", "1Gi"),
            Network::Loopback { .. } => process_objects(&r, input),
        };
        out.insert(
            c.short_name().into(),
            json!({
                "templateHash": template_hash(&r),
                "workload": objs.workload,
                "services": objs.services,
            }),
        );
    }
    Value::Object(out)
}

#[test]
fn renderings_are_pinned_so_that_an_operator_upgrade_restarts_nothing_by_accident() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("golden");
    let update = std::env::var_os("NESTPLANE_UPDATE_GOLDEN").is_some();
    let mut changed = Vec::new();
    for (name, input) in cases() {
        let path = dir.join(format!("{name}.json"));
        let now = serde_json::to_string_pretty(&rendered(&input)).expect("json") + "\n";
        if update {
            std::fs::create_dir_all(&dir).expect("golden directory");
            std::fs::write(&path, &now).expect("golden file");
            continue;
        }
        let pinned = std::fs::read_to_string(&path).unwrap_or_default();
        if pinned != now {
            changed.push(format!(
                "{}: {}",
                path.display(),
                first_difference(&pinned, &now)
            ));
        }
    }
    assert!(
        changed.is_empty(),
        "the rendering changed, so upgrading the operator would restart these tenants' \
         components:\n{}\nIf that is intended, rewrite the golden files with \
         NESTPLANE_UPDATE_GOLDEN=1 cargo test -p nestplane-render golden and say so in the \
         change.",
        changed.join("\n")
    );
}

/// The first line that differs, as `line N: pinned … / now …`.
fn first_difference(pinned: &str, now: &str) -> String {
    if pinned.is_empty() {
        return "missing".into();
    }
    let (mut a, mut b) = (pinned.lines(), now.lines());
    for n in 1.. {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => continue,
            (None, None) => break,
            (x, y) => {
                return format!(
                    "line {n}: pinned {:?} / now {:?}",
                    x.unwrap_or("<end>").trim(),
                    y.unwrap_or("<end>").trim()
                );
            }
        }
    }
    "same lines, different ending".into()
}
