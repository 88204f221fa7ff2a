//! Services of the Cluster network.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use nestplane_api::names::{Component, ports};

use crate::addressing::{apiserver_service_name, etcd_client_service_name, etcd_peer_service_name};
use crate::pod::{pod_labels, selector_labels};
use crate::{Network, RenderInput};

fn service_port(name: &str, number: i32) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port: number,
        target_port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

fn service(input: &RenderInput, c: Component, name: String, spec: ServiceSpec) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(input.namespace.clone()),
            labels: Some(pod_labels(&input.cluster, c)),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            selector: Some(selector_labels(&input.cluster, c)),
            ..spec
        }),
        status: None,
    }
}

/// Services of component `c`: none on the Loopback network, none for the controller-manager
/// and scheduler; etcd gets a headless peer Service (members' DNS names, published before
/// they are ready so they can find each other) and a client Service; the API server gets a
/// ClusterIP Service on 6443.
pub(crate) fn services(c: Component, input: &RenderInput) -> Vec<Service> {
    if input.network != Network::Cluster {
        return Vec::new();
    }
    let cluster = &input.cluster;
    match c {
        Component::Etcd => vec![
            service(
                input,
                c,
                etcd_peer_service_name(cluster),
                ServiceSpec {
                    cluster_ip: Some("None".into()),
                    publish_not_ready_addresses: Some(true),
                    ports: Some(vec![
                        service_port("client", ports::ETCD_CLIENT),
                        service_port("peer", ports::ETCD_PEER),
                        service_port("metrics", ports::ETCD_METRICS),
                    ]),
                    ..Default::default()
                },
            ),
            service(
                input,
                c,
                etcd_client_service_name(cluster),
                ServiceSpec {
                    type_: Some("ClusterIP".into()),
                    ports: Some(vec![service_port("client", ports::ETCD_CLIENT)]),
                    ..Default::default()
                },
            ),
        ],
        Component::ApiServer => vec![service(
            input,
            c,
            apiserver_service_name(cluster),
            ServiceSpec {
                type_: Some(input.apiserver_service_type.clone()),
                ports: Some(vec![service_port("https", ports::APISERVER)]),
                ..Default::default()
            },
        )],
        Component::ControllerManager | Component::Scheduler => Vec::new(),
    }
}
