//! The API server's egress selector in the process runtime: its `cluster` traffic (kubelets,
//! the `proxy` subresources, webhooks, aggregated APIs) goes as HTTP `CONNECT` to a Unix
//! socket in its working directory, where nestplane connects it from inside the cluster's
//! network (`nestplane_nodes::egress`). Pure.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{SecretVolumeSource, Volume, VolumeMount};

use crate::Rendered;

/// The socket, as the API server reaches it: in its working directory, the one place of its
/// tenant's directory it may enter.
pub const SOCKET: &str = "/proc/self/cwd/egress.sock";
/// The socket's file name in each API server replica's directory.
pub const SOCKET_FILE: &str = "egress.sock";
/// The key of the configuration file in the volume.
pub const CONFIG_KEY: &str = "egress-selector.yaml";
const MOUNT: &str = "/etc/nestplane/egress-selector";
const VOLUME: &str = "egress-selector";

/// The `EgressSelectorConfiguration`: `cluster` traffic through `socket`; the control
/// plane's own and etcd's traffic stay direct.
pub fn config(socket: &str) -> String {
    format!(
        "apiVersion: apiserver.k8s.io/v1beta1\n\
         kind: EgressSelectorConfiguration\n\
         egressSelections:\n\
         - name: cluster\n  \
           connection:\n    \
             proxyProtocol: HTTPConnect\n    \
             transport:\n      \
               uds:\n        \
                 udsName: {socket}\n"
    )
}

/// The name under which the process runtime is handed the configuration file (its files come
/// by the name of the Secret a volume names; this one is never an object).
pub fn data_name(rendered: &Rendered) -> String {
    format!("{}-{VOLUME}", rendered.workload_name)
}

/// Point a rendered API server at the egress socket: a volume with the configuration, and
/// the flag that reads it. Returns the volume's data, by [`data_name`].
pub fn apply(rendered: &mut Rendered) -> (String, BTreeMap<String, Vec<u8>>) {
    let name = data_name(rendered);
    if let Some(spec) = rendered.pod_template.spec.as_mut() {
        spec.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: VOLUME.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(name.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        for c in &mut spec.containers {
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: VOLUME.into(),
                    mount_path: MOUNT.into(),
                    read_only: Some(true),
                    ..Default::default()
                });
            c.args.get_or_insert_with(Vec::new).push(format!(
                "--egress-selector-config-file={MOUNT}/{CONFIG_KEY}"
            ));
        }
    }
    let data = BTreeMap::from([(CONFIG_KEY.to_string(), config(SOCKET).into_bytes())]);
    (name, data)
}

/// The `kubernetes` runtime's proxy: a container beside the API server, from the operator's
/// image, serving the socket in a volume the two share and the tunnel port that the cluster's
/// nodes dial out to (`nestplane_nodes::tunnel`).
pub const SIDECAR: &str = "egress-proxy";
/// Where the sidecar's socket is, in both containers.
const RUN_DIR: &str = "/run/nestplane/egress";
const RUN_VOLUME: &str = "egress-run";
/// The pod annotation that holds the configuration (read by a downward API volume: no other
/// object to make, and a change rolls the pods like any change of the template).
pub const CONFIG_ANNOTATION: &str = "nestplane.io/egress-selector";
/// The tunnel port (konnectivity's agent port), on the pod and on the API server's Service.
pub const TUNNEL_PORT: i32 = 8132;
/// The tunnel port's name.
pub const TUNNEL_PORT_NAME: &str = "tunnel";

/// Point a rendered API server of the `kubernetes` runtime at a sidecar running `image` (the
/// operator's, which holds `nestplane egress-proxy`), which reaches the cluster through the
/// agents of its nodes; its Service gets the tunnel port. The sidecar presents the API
/// server's serving certificate and admits only client certificates of the cluster CA
/// (nodes').
pub fn apply_kubernetes(rendered: &mut Rendered, image: &str, service_cidr: &str) {
    use k8s_openapi::api::core::v1::{
        Container, ContainerPort, DownwardAPIVolumeFile, DownwardAPIVolumeSource,
        EmptyDirVolumeSource, ObjectFieldSelector, ResourceRequirements, ServicePort,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use nestplane_api::names::SecretPurpose;

    rendered
        .pod_template
        .metadata
        .get_or_insert_with(Default::default)
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            CONFIG_ANNOTATION.into(),
            config(&format!("{RUN_DIR}/{SOCKET_FILE}")),
        );
    let Some(spec) = rendered.pod_template.spec.as_mut() else {
        return;
    };
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    volumes.push(Volume {
        name: VOLUME.into(),
        downward_api: Some(DownwardAPIVolumeSource {
            items: Some(vec![DownwardAPIVolumeFile {
                path: CONFIG_KEY.into(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: format!("metadata.annotations['{CONFIG_ANNOTATION}']"),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    volumes.push(Volume {
        name: RUN_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: Some("Memory".into()),
            size_limit: Some(Quantity("1Mi".into())),
        }),
        ..Default::default()
    });
    let run_mount = VolumeMount {
        name: RUN_VOLUME.into(),
        mount_path: RUN_DIR.into(),
        ..Default::default()
    };
    // The API server alone: the rendered pod has one container.
    if let Some(c) = spec.containers.first_mut() {
        let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
        mounts.push(VolumeMount {
            name: VOLUME.into(),
            mount_path: MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        });
        mounts.push(run_mount.clone());
        c.args.get_or_insert_with(Vec::new).push(format!(
            "--egress-selector-config-file={MOUNT}/{CONFIG_KEY}"
        ));
    }
    let secret =
        |p: SecretPurpose, key: &str| format!("{}/{}", crate::pod::secret_mount_path(p), key);
    let secret_mount = |p: SecretPurpose| VolumeMount {
        name: crate::pod::secret_volume_name(p).into(),
        mount_path: crate::pod::secret_mount_path(p),
        read_only: Some(true),
        ..Default::default()
    };
    spec.containers.push(Container {
        name: SIDECAR.into(),
        image: Some(image.into()),
        image_pull_policy: Some("IfNotPresent".into()),
        command: Some(vec!["/nestplane".into()]),
        args: Some(vec![
            "egress-proxy".into(),
            format!("--socket={RUN_DIR}/{SOCKET_FILE}"),
            format!("--listen=0.0.0.0:{TUNNEL_PORT}"),
            format!("--cert={}", secret(SecretPurpose::ApiServer, "tls.crt")),
            format!("--key={}", secret(SecretPurpose::ApiServer, "tls.key")),
            format!(
                "--client-ca={}",
                secret(SecretPurpose::ClusterCa, "tls.crt")
            ),
            format!("--service-cidr={service_cidr}"),
            // Agents keep connections at every replica behind the Service's one address.
            format!("--replicas={}", rendered.replicas),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some(TUNNEL_PORT_NAME.into()),
            container_port: TUNNEL_PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
        volume_mounts: Some(vec![
            run_mount,
            secret_mount(SecretPurpose::ApiServer),
            secret_mount(SecretPurpose::ClusterCa),
        ]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), Quantity("10m".into())),
                ("memory".into(), Quantity("16Mi".into())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".into(),
                Quantity("128Mi".into()),
            )])),
            ..Default::default()
        }),
        security_context: Some(k8s_openapi::api::core::v1::SecurityContext {
            read_only_root_filesystem: Some(true),
            ..crate::pod::container_security()
        }),
        ..Default::default()
    });
    for svc in &mut rendered.services {
        if svc.metadata.name.as_deref() != Some(&*rendered.workload_name) {
            continue;
        }
        if let Some(ports) = svc.spec.as_mut().and_then(|s| s.ports.as_mut()) {
            ports.push(ServicePort {
                name: Some(TUNNEL_PORT_NAME.into()),
                port: TUNNEL_PORT,
                target_port: Some(IntOrString::String(TUNNEL_PORT_NAME.into())),
                protocol: Some("TCP".into()),
                ..Default::default()
            });
        }
    }
}

/// What a patch may not change of a pod template that [`apply_kubernetes`] made (`b`,
/// rendered; `a`, patched): the configuration annotation, the sidecar, the two volumes, the
/// API server's mounts of them and its flag (the last of its name wins); no container mounts
/// anything else at or under the configuration or socket directories. Templates without the
/// sidecar pass. Pure.
pub(crate) fn kept(b: &serde_json::Value, a: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    let containers = |t: &Value| -> Vec<Value> {
        t.pointer("/spec/containers")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let named = |cs: &[Value], n: &str| cs.iter().find(|c| c["name"] == n).cloned();
    let (bcs, acs) = (containers(b), containers(a));
    let Some(sidecar) = named(&bcs, SIDECAR) else {
        return Ok(());
    };
    let refuse = |what: &str| {
        Err(format!(
            "{what} may not be changed by a patch: the API server reaches its cluster only through its egress proxy"
        ))
    };
    let annotation = |t: &Value| {
        t.pointer("/metadata/annotations")
            .map(|m| m[CONFIG_ANNOTATION].clone())
    };
    if annotation(a) != annotation(b) {
        return refuse(&format!("the annotation {CONFIG_ANNOTATION}"));
    }
    if named(&acs, SIDECAR).as_ref() != Some(&sidecar) {
        return refuse(&format!("container {SIDECAR:?}"));
    }
    let volumes = |t: &Value| -> Vec<Value> {
        t.pointer("/spec/volumes")
            .and_then(Value::as_array)
            .map(|vs| {
                vs.iter()
                    .filter(|v| v["name"] == VOLUME || v["name"] == RUN_VOLUME)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    };
    if volumes(a) != volumes(b) {
        return refuse(&format!("volumes {VOLUME:?} and {RUN_VOLUME:?}"));
    }
    let Some(api) = bcs.first() else {
        return Ok(());
    };
    let Some(patched_api) = named(&acs, api["name"].as_str().unwrap_or_default()) else {
        return refuse("the API server container");
    };
    let flag = |c: &Value| {
        c["args"].as_array().and_then(|args| {
            args.iter()
                .rev()
                .find(|x| {
                    x.as_str()
                        .is_some_and(|x| x.starts_with("--egress-selector-config-file"))
                })
                .cloned()
        })
    };
    if flag(&patched_api) != flag(api) {
        return refuse("the API server's --egress-selector-config-file");
    }
    let mounts =
        |c: &Value| -> Vec<Value> { c["volumeMounts"].as_array().cloned().unwrap_or_default() };
    let ours: Vec<Value> = mounts(api)
        .into_iter()
        .chain(mounts(&sidecar))
        .filter(|m| m["name"] == VOLUME || m["name"] == RUN_VOLUME)
        .collect();
    if !ours
        .iter()
        .all(|m| mounts(&patched_api).contains(m) || mounts(&sidecar).contains(m))
    {
        return refuse("the API server's egress mounts");
    }
    let under = |path: &str, dir: &str| path == dir || path.starts_with(&format!("{dir}/"));
    for c in &acs {
        for m in mounts(c) {
            let path = m["mountPath"]
                .as_str()
                .unwrap_or_default()
                .trim_end_matches('/');
            if (under(path, MOUNT) || under(path, RUN_DIR)) && !ours.contains(&m) {
                return refuse(&format!(
                    "what is mounted at {path} (container {})",
                    c["name"]
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{KubeVersion, Network, RenderInput, render};
    use nestplane_api::names::Component;

    #[test]
    fn the_api_server_reads_a_config_that_sends_only_cluster_traffic_to_the_socket() {
        let input = RenderInput::new(
            "alpha",
            "ns",
            KubeVersion::parse("v1.20.2").unwrap(),
            Network::Loopback {
                hosts: vec!["127.0.0.1".parse().unwrap()],
            },
        );
        let mut r = render(Component::ApiServer, &input).unwrap();
        let (name, data) = apply(&mut r);
        assert_eq!(name, "alpha-apiserver-egress-selector");
        let spec = r.pod_template.spec.unwrap();
        let c = &spec.containers[0];
        assert!(
            c.args.iter().flatten().any(|a| a
                == "--egress-selector-config-file=/etc/nestplane/egress-selector/egress-selector.yaml"),
            "{:?}",
            c.args
        );
        let v = spec.volumes.unwrap();
        let vol = v.iter().find(|v| v.name == VOLUME).unwrap();
        assert_eq!(
            vol.secret.as_ref().unwrap().secret_name.as_deref(),
            Some(&*name)
        );
        let text = String::from_utf8(data[CONFIG_KEY].clone()).unwrap();
        let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(doc["kind"], "EgressSelectorConfiguration");
        let sel = doc["egressSelections"].as_array().unwrap();
        assert_eq!(sel.len(), 1, "{text}");
        assert_eq!(sel[0]["name"], "cluster");
        assert_eq!(sel[0]["connection"]["proxyProtocol"], "HTTPConnect");
        assert_eq!(
            sel[0]["connection"]["transport"]["uds"]["udsName"],
            "/proc/self/cwd/egress.sock"
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod kubernetes_tests {
    use super::*;
    use crate::{KubeVersion, Network, RenderInput, objects, render};
    use nestplane_api::names::Component;

    #[test]
    fn a_pod_api_server_sends_cluster_traffic_to_its_sidecar_which_nodes_dial() {
        let input = RenderInput::new(
            "alpha",
            "ns",
            KubeVersion::parse("v1.20.2").unwrap(),
            Network::Cluster,
        );
        let mut r = render(Component::ApiServer, &input).unwrap();
        apply_kubernetes(&mut r, "nestplane:latest", "10.96.0.0/12");
        let o = objects(&r, &input, "sum", "1Gi");
        let template = &o.workload["spec"]["template"];
        // The configuration travels in the template, and the API server reads it.
        let text = template["metadata"]["annotations"][CONFIG_ANNOTATION]
            .as_str()
            .unwrap();
        let doc: serde_json::Value = serde_saphyr::from_str(text).unwrap();
        assert_eq!(
            doc["egressSelections"][0]["connection"]["transport"]["uds"]["udsName"],
            "/run/nestplane/egress/egress.sock"
        );
        assert!(
            template["metadata"]["annotations"][crate::SECRETS_CHECKSUM_ANNOTATION].is_string()
        );
        let containers = template["spec"]["containers"].as_array().unwrap();
        assert_eq!(containers.len(), 2);
        let api = &containers[0];
        assert!(
            api["args"]
                .as_array()
                .unwrap()
                .iter()
                .any(|a| a == "--egress-selector-config-file=/etc/nestplane/egress-selector/egress-selector.yaml")
        );
        let proxy = &containers[1];
        assert_eq!(proxy["name"], SIDECAR);
        assert_eq!(proxy["image"], "nestplane:latest");
        let args: Vec<&str> = proxy["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(
            args.contains(&"--client-ca=/etc/nestplane/cluster-ca/tls.crt"),
            "{args:?}"
        );
        assert!(args.contains(&"--service-cidr=10.96.0.0/12"), "{args:?}");
        assert_eq!(proxy["securityContext"]["runAsNonRoot"], true);
        assert_eq!(proxy["securityContext"]["readOnlyRootFilesystem"], true);
        // Every volume the sidecar mounts is one of the pod's.
        let vols: Vec<&str> = template["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        for m in proxy["volumeMounts"].as_array().unwrap() {
            assert!(
                vols.contains(&m["name"].as_str().unwrap()),
                "{m} not in {vols:?}"
            );
        }
        // A patch leaves the way through the sidecar alone.
        let name = |i: usize| containers[i]["name"].as_str().unwrap().to_string();
        let api_name = name(0);
        let patch = |p: serde_json::Value| {
            let mut objs = objects(&r, &input, "sum", "1Gi");
            crate::policy::apply_checked(
                objs.all_mut(),
                &[{
                    let mut p = p;
                    p["kind"] = "Deployment".into();
                    p["metadata"]["name"] = "alpha-apiserver".into();
                    p
                }],
                crate::policy::Runtime::Kubernetes,
            )
        };
        for (what, p) in [
            (
                "annotation",
                serde_json::json!({"spec": {"template": {"metadata": {"annotations": {CONFIG_ANNOTATION: "kind: EgressSelectorConfiguration"}}}}}),
            ),
            (
                "sidecar image",
                serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": SIDECAR, "image": "evil:1"}]}}}}),
            ),
            (
                "sidecar gone",
                serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": SIDECAR, "$patch": "delete"}]}}}}),
            ),
            (
                "flag overridden",
                serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": api_name, "args": ["--egress-selector-config-file=/tmp/none.yaml"]}]}}}}),
            ),
            (
                "config shadowed",
                serde_json::json!({"spec": {"template": {"spec": {
                    "volumes": [{"name": "mine", "configMap": {"name": "mine"}}],
                    "containers": [{"name": api_name, "volumeMounts": [{"name": "mine", "mountPath": "/etc/nestplane/egress-selector"}]}]}}}}),
            ),
            (
                "socket volume replaced",
                serde_json::json!({"spec": {"template": {"spec": {"volumes": [{"name": RUN_VOLUME, "configMap": {"name": "mine"}}]}}}}),
            ),
        ] {
            let e = patch(p).expect_err(what);
            assert!(e.reason.contains("egress proxy"), "{what}: {}", e.reason);
        }
        // Other changes stay the user's.
        patch(serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": api_name, "resources": {"limits": {"memory": "1Gi"}}}]}}}}))
            .unwrap();

        // Nodes reach the tunnel port where they reach the API server.
        let svc = &o.services[0];
        let ports = svc["spec"]["ports"].as_array().unwrap();
        assert!(
            ports
                .iter()
                .any(|p| p["port"] == TUNNEL_PORT && p["targetPort"] == TUNNEL_PORT_NAME),
            "{ports:?}"
        );
    }
}
