#![allow(clippy::unwrap_used)]

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Service;
use nestplane_api::names::Component;
use serde_json::{Value, json};

use crate::*;

fn cluster(minor: u32) -> RenderInput {
    RenderInput::new(
        "demo",
        "tenants",
        KubeVersion::new(1, minor, 2),
        Network::Cluster,
    )
}

fn objs(c: Component, input: &RenderInput) -> Objects {
    objects(&render(c, input).unwrap(), input, "sum", "2Gi")
}

#[test]
fn etcd_is_a_statefulset_with_a_claim_per_member_and_a_peer_service() {
    let input = cluster(20).with_replicas(Component::Etcd, 3);
    let o = objs(Component::Etcd, &input);
    let sts: StatefulSet = serde_json::from_value(o.workload.clone()).unwrap();
    let spec = sts.spec.unwrap();
    assert_eq!(spec.replicas, Some(3));
    assert_eq!(spec.service_name.as_deref(), Some("demo-etcd-peer"));
    assert_eq!(spec.pod_management_policy.as_deref(), Some("Parallel"));
    let claims = spec.volume_claim_templates.unwrap();
    assert_eq!(claims[0].metadata.name.as_deref(), Some(ETCD_DATA_VOLUME));
    let req = claims[0].spec.as_ref().unwrap().resources.as_ref().unwrap();
    assert_eq!(req.requests.as_ref().unwrap()["storage"].0, "2Gi");
    // The claim provides the data volume: the template must not also declare it.
    let pod = spec.template.spec.unwrap();
    assert!(
        pod.volumes
            .unwrap_or_default()
            .iter()
            .all(|v| v.name != ETCD_DATA_VOLUME)
    );
    let args = pod.containers[0].args.clone().unwrap().join(" ");
    for i in 0..3 {
        assert!(
            args.contains(&format!(
                "demo-etcd-{i}=https://demo-etcd-{i}.demo-etcd-peer.tenants.svc:2380"
            )),
            "{args}"
        );
    }
    // Every member name it advertises is covered by the certificate.
    let sans = etcd_sans(&input);
    assert!(
        sans.dns
            .contains(&"*.demo-etcd-peer.tenants.svc".to_string())
    );
    let names: Vec<String> = o
        .services
        .iter()
        .map(|s| s["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["demo-etcd-peer", "demo-etcd"]);
    for s in &o.services {
        let _: Service = serde_json::from_value(s.clone()).unwrap();
    }
}

#[test]
fn others_are_deployments_with_checksum_spread_and_non_root() {
    for c in [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ] {
        let input = cluster(28).with_replicas(c, 2);
        let o = objs(c, &input);
        let d: Deployment = serde_json::from_value(o.workload.clone()).unwrap();
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(2));
        let meta = spec.template.metadata.unwrap();
        assert_eq!(
            meta.annotations.unwrap()[SECRETS_CHECKSUM_ANNOTATION],
            "sum"
        );
        // The selector matches the pods it creates.
        let labels = meta.labels.unwrap();
        for (k, v) in spec.selector.match_labels.unwrap() {
            assert_eq!(labels.get(&k), Some(&v), "{c:?}: selector {k}");
        }
        let pod = spec.template.spec.unwrap();
        assert_eq!(pod.security_context.unwrap().run_as_non_root, Some(true));
        let spread = pod.topology_spread_constraints.unwrap();
        assert!(
            spread
                .iter()
                .any(|t| t.topology_key == "kubernetes.io/hostname")
        );
        assert!(
            pod.containers[0]
                .image
                .as_ref()
                .unwrap()
                .ends_with(":v1.28.2")
        );
    }
}

#[test]
fn apiserver_service_type_comes_from_the_input_and_is_checked() {
    let mut input = cluster(20);
    input.apiserver_service_type = "LoadBalancer".into();
    let o = objs(Component::ApiServer, &input);
    assert_eq!(o.services[0]["spec"]["type"], "LoadBalancer");
    input.apiserver_service_type = "Ingress".into();
    let err = render(Component::ApiServer, &input)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ClusterIP, NodePort, LoadBalancer"), "{err}");
}

#[test]
fn images_come_from_the_registry_with_etcd_chosen_by_version() {
    let mut input = cluster(20);
    input.image_registry = "mirror.example.com/k8s/".into();
    let o = objs(Component::Etcd, &input);
    let image = o
        .workload
        .pointer("/spec/template/spec/containers/0/image")
        .unwrap();
    assert_eq!(
        image.as_str().unwrap(),
        format!(
            "mirror.example.com/k8s/etcd:{}",
            etcd_version_for(&input.version)
        )
    );
}

#[test]
fn a_changed_secret_checksum_changes_only_the_annotation() {
    let input = cluster(20);
    let r = render(Component::ApiServer, &input).unwrap();
    let a = objects(&r, &input, "one", "1Gi");
    let b = objects(&r, &input, "two", "1Gi");
    assert_ne!(a.workload, b.workload);
    let mut b2 = b.workload.clone();
    b2["spec"]["template"]["metadata"]["annotations"][SECRETS_CHECKSUM_ANNOTATION] = json!("one");
    assert_eq!(a.workload, b2);
}

fn container_of(o: &Objects) -> Value {
    o.workload
        .pointer("/spec/template/spec/containers/0")
        .unwrap()
        .clone()
}

#[test]
fn patches_merge_lists_by_key() {
    let input = cluster(20);
    let mut o = objs(Component::ApiServer, &input);
    let before = container_of(&o);
    let patches = vec![json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "demo-apiserver", "labels": {"team": "a"}},
        "spec": {"template": {"spec": {
            "containers": [{
                "name": "kube-apiserver",
                "env": [{"name": "GODEBUG", "value": "x509sha1=1"}],
                "volumeMounts": [{"name": "audit", "mountPath": "/var/log/audit"}],
                "resources": {"limits": {"memory": "1Gi"}},
            }],
            "volumes": [{"name": "audit", "emptyDir": {}}],
            "nodeSelector": {"pool": "control-planes"},
        }}},
    })];
    patch::apply(o.all_mut(), &patches).unwrap();
    let after = container_of(&o);
    // Added, not replaced: the rendered env, mounts and args are all still there.
    let env = after["env"].as_array().unwrap();
    assert_eq!(env.len(), before["env"].as_array().unwrap().len() + 1);
    let mounts = after["volumeMounts"].as_array().unwrap();
    assert_eq!(
        mounts.len(),
        before["volumeMounts"].as_array().unwrap().len() + 1
    );
    assert_eq!(after["args"], before["args"]);
    assert_eq!(after["resources"]["limits"]["memory"], "1Gi");
    assert_eq!(
        after["resources"]["requests"],
        before["resources"]["requests"]
    );
    assert_eq!(o.workload["metadata"]["labels"]["team"], "a");
    assert_eq!(o.workload["metadata"]["name"], "demo-apiserver");
    let t = o.pod_template().unwrap();
    assert_eq!(
        t.spec.unwrap().node_selector.unwrap()["pool"],
        "control-planes"
    );
}

#[test]
fn patches_replace_and_delete_by_key() {
    let input = cluster(20);
    let mut o = objs(Component::ApiServer, &input);
    let env_before = container_of(&o)["env"].as_array().unwrap().len();
    let first_env = container_of(&o)["env"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let patches = vec![
        json!({
            "kind": "Deployment",
            "metadata": {"name": "demo-apiserver"},
            "spec": {"template": {"spec": {"containers": [{
                "name": "kube-apiserver",
                "image": "example.com/kube-apiserver:custom",
                "env": [{"name": first_env, "$patch": "delete"}],
                "startupProbe": null,
            }]}}},
        }),
        json!({
            "kind": "Service",
            "metadata": {"name": "demo-apiserver", "annotations": {"lb": "internal"}},
            "spec": {"ports": [{"port": 6443, "nodePort": 30443}]},
        }),
    ];
    patch::apply(o.all_mut(), &patches).unwrap();
    let c = container_of(&o);
    assert_eq!(c["image"], "example.com/kube-apiserver:custom");
    assert_eq!(c["env"].as_array().unwrap().len(), env_before - 1);
    assert!(c.get("startupProbe").is_none());
    let ports = o.services[0]["spec"]["ports"].as_array().unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0]["nodePort"], 30443);
    assert_eq!(ports[0]["name"], "https");
}

#[test]
fn bad_patches_name_themselves() {
    let input = cluster(20);
    let mut o = objs(Component::Scheduler, &input);
    let err = patch::apply(
        o.all_mut(),
        &[json!({"kind": "Deployment", "metadata": {"name": "nope"}})],
    )
    .unwrap_err();
    assert_eq!(err.index, 0);
    assert!(err.to_string().contains("Deployment/nope"), "{err}");
    assert!(
        err.to_string().contains("Deployment/demo-scheduler"),
        "{err}"
    );

    let err = patch::apply(o.all_mut(), &[json!({"kind": "Deployment"}), json!("x")]).unwrap_err();
    assert!(err.to_string().contains("kind and metadata.name"), "{err}");

    let err = patch::apply(
        o.all_mut(),
        &[
            json!({"kind": "Deployment", "metadata": {"name": "demo-scheduler"}, "spec": {"replicas": 2}}),
            json!({"kind": "Deployment", "metadata": {"name": "demo-scheduler"},
                   "spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}}),
        ],
    )
    .unwrap_err();
    assert_eq!(err.index, 1);
    assert!(err.to_string().contains("merge key name"), "{err}");

    let err = patch::apply(
        o.all_mut(),
        &[json!({"kind": "Deployment", "metadata": {"name": "demo-scheduler"}, "spec": "oops"})],
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("cannot replace an object with a string"),
        "{err}"
    );
}

#[test]
fn the_same_patches_reach_the_process_runtime() {
    let input = RenderInput::new(
        "demo",
        "tenants",
        KubeVersion::new(1, 20, 2),
        Network::Loopback {
            hosts: vec![std::net::Ipv4Addr::new(127, 64, 0, 1)],
        },
    );
    let r = render(Component::ApiServer, &input).unwrap();
    let mut o = process_objects(&r, &input);
    patch::apply(
        o.all_mut(),
        &[
            json!({"kind": "Deployment", "metadata": {"name": "demo-apiserver"},
                 "spec": {"template": {"spec": {"containers": [{"name": "kube-apiserver",
                   "args": ["--v=4"]}]}}}}),
        ],
    )
    .unwrap();
    let t = o.pod_template().unwrap();
    assert_eq!(
        t.spec.unwrap().containers[0].args.clone().unwrap(),
        ["--v=4"]
    );
}

#[test]
fn channels_resolve_from_the_shipped_file() {
    assert_eq!(channels::resolve("stable").as_deref(), Some("v1.20.2"));
    assert!(channels::resolve("rapid").is_some());
    assert_eq!(channels::resolve("nightly"), None);
    for (_, v) in channels::all() {
        let v = KubeVersion::parse(&v).unwrap();
        assert!(v.is_supported(), "{v} in channels.yaml is renderable");
    }
    let parsed =
        channels::parse("# c\nother:\n  x: 1\nchannels:\n  a: v1.2.3 # why\n\n  b: \"v1.3.0\"\n");
    assert_eq!(
        parsed,
        [
            ("a".to_string(), "v1.2.3".to_string()),
            ("b".to_string(), "v1.3.0".to_string())
        ]
    );
}
