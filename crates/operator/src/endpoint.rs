//! The `ClusterEndpoint` (seed 003) a control plane publishes: `<cluster>-apiserver`, type
//! `apiserver`, labelled with the cluster's name and controlled by the `NestedControlPlane`
//! (so it goes when the control plane goes). Created as soon as the endpoint is known, kept
//! current when it changes, and skipped quietly where the kind is not served.

use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::conditions::reasons;
use nestplane_api::names;
use nestplane_api::{ApiEndpoint, ClusterEndpoint, ClusterEndpointSpec, NestedControlPlane};

use crate::context::{Context, Error};
use crate::tenant;

/// The name of a cluster's API server endpoint object.
pub fn name(cluster: &str) -> String {
    format!("{cluster}-apiserver")
}

/// The endpoint object `ncp` publishes for `endpoint`. Pure.
pub fn desired(
    ncp: &NestedControlPlane,
    cluster: &str,
    endpoint: &ApiEndpoint,
    server_name: Option<&str>,
) -> ClusterEndpoint {
    let mut e = ClusterEndpoint::new(
        &name(cluster),
        ClusterEndpointSpec {
            host: endpoint.host.clone(),
            port: endpoint.port,
            server_name: server_name.map(str::to_string),
            cluster: cluster.to_string(),
            type_: Default::default(),
        },
    );
    e.metadata.namespace = ncp.namespace();
    e.metadata.labels = Some(
        [
            (names::CLUSTER_NAME_LABEL.to_string(), cluster.to_string()),
            (
                names::MANAGED_BY_LABEL.to_string(),
                names::MANAGED_BY.to_string(),
            ),
        ]
        .into(),
    );
    e.metadata.owner_references = Some(vec![tenant::owner_ref(ncp)]);
    e
}

/// Whether `current` already says what `want` says (spec, label, controller).
fn current(have: &ClusterEndpoint, want: &ClusterEndpoint) -> bool {
    have.spec == want.spec
        && have.labels().get(names::CLUSTER_NAME_LABEL)
            == want.labels().get(names::CLUSTER_NAME_LABEL)
        && tenant::controller_of(have).map(|r| &r.uid)
            == tenant::controller_of(want).map(|r| &r.uid)
}

/// Create or update the control plane's `ClusterEndpoint`. One read when nothing changed; a
/// management cluster without the kind is not an error.
pub async fn publish(
    ctx: &Context,
    ncp: &NestedControlPlane,
    cluster: &str,
    endpoint: &ApiEndpoint,
) -> Result<(), Error> {
    let ns = ncp.namespace().unwrap_or_default();
    let api: Api<ClusterEndpoint> = Api::namespaced(ctx.client.clone(), &ns);
    // At the shared gateway, the name the cluster is asked for there.
    let gateway = ctx.runtime.gateway(ncp);
    let server_name = gateway
        .as_ref()
        .filter(|g| {
            let host = match endpoint.host.parse::<std::net::Ipv6Addr>() {
                Ok(v6) => format!("[{v6}]"),
                Err(_) => endpoint.host.clone(),
            };
            g.server.trim_start_matches("https://") == format!("{host}:{}", endpoint.port)
        })
        .map(|g| g.server_name.as_str());
    let want = desired(ncp, cluster, endpoint, server_name);
    let name = want.name_any();
    if let Some(have) = api.get_opt(&name).await? {
        if current(&have, &want) {
            return Ok(());
        }
        if let Some(other) = tenant::controller_of(&have)
            && Some(&other.uid) != ncp.metadata.uid.as_ref()
        {
            ctx.event(
                ncp.object_ref(&()),
                EventType::Warning,
                reasons::INVALID_SPEC,
                &format!(
                    "ClusterEndpoint {ns}/{name} is controlled by {} {}; not taking it over",
                    other.kind, other.name
                ),
            )
            .await;
            return Ok(());
        }
    }
    let pp = PatchParams::apply(crate::crds::FIELD_MANAGER).force();
    match api.patch(&name, &pp, &Patch::Apply(&want)).await {
        Ok(_) => {
            tracing::info!(namespace = %ns, %cluster, host = %endpoint.host, port = endpoint.port, "ClusterEndpoint published");
            Ok(())
        }
        // The kind is not served here (its CRD is not installed).
        Err(kube::Error::Api(e)) if e.code == 404 => {
            tracing::debug!(namespace = %ns, %cluster, "ClusterEndpoint not served; skipped");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_named_labelled_and_controlled_by_the_control_plane() {
        let ncp: NestedControlPlane = serde_json::from_value(serde_json::json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
            "kind": "NestedControlPlane",
            "metadata": {"name": "foo-control-plane", "namespace": "ns", "uid": "u-1"},
            "spec": {}
        }))
        .unwrap();
        let e = desired(
            &ncp,
            "foo",
            &ApiEndpoint {
                host: "10.0.0.7".into(),
                port: 6443,
            },
            None,
        );
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["apiVersion"], "cluster.x-k8s.io/v1beta1");
        assert_eq!(v["metadata"]["name"], "foo-apiserver");
        assert_eq!(
            v["metadata"]["labels"]["cluster.x-k8s.io/cluster-name"],
            "foo"
        );
        assert_eq!(
            v["spec"],
            serde_json::json!({"cluster": "foo", "host": "10.0.0.7", "port": 6443, "type": "apiserver"})
        );
        let owner = &v["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "NestedControlPlane");
        assert_eq!(owner["uid"], "u-1");
        assert_eq!(owner["controller"], true);
        assert!(current(&e, &e));
        let mut moved = e.clone();
        moved.spec.port = 31443;
        assert!(!current(&moved, &e));
        // At a shared gateway: the name the cluster is asked for there.
        let at_gateway = desired(
            &ncp,
            "foo",
            &ApiEndpoint {
                host: "127.0.0.1".into(),
                port: 7443,
            },
            Some("foo.ns.nestplane.internal"),
        );
        let v = serde_json::to_value(&at_gateway).unwrap();
        assert_eq!(v["spec"]["serverName"], "foo.ns.nestplane.internal");
        assert!(!current(&at_gateway, &e));
    }
}
