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
