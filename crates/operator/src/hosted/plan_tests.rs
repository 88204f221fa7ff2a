#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use nestplane_api::hosted::Release;
use std::net::Ipv4Addr;

fn spec(pods: &str, services: &str) -> HostedClusterSpec {
    HostedClusterSpec {
        release: Release {
            version: "1.20.2".into(),
        },
        networking: ClusterNetworking {
            cluster_network: vec![NetworkEntry { cidr: pods.into() }],
            service_network: vec![NetworkEntry {
                cidr: services.into(),
            }],
        },
        ..Default::default()
    }
}

#[test]
fn networks_are_checked_for_shape_overlap_and_this_machines_pod_network() {
    assert_eq!(validate(&spec(POD_NETWORK, "10.96.0.0/12")), Ok(()));
    assert_eq!(
        validate(&HostedClusterSpec {
            release: Release {
                version: "v1.20.2".into()
            },
            ..Default::default()
        }),
        Ok(())
    );
    let overlap = validate(&spec(POD_NETWORK, "10.244.128.0/17")).unwrap_err();
    assert!(overlap.contains("overlap"), "{overlap}");
    let other = validate(&spec("10.132.0.0/14", "172.31.0.0/16")).unwrap_err();
    assert!(other.contains("must be 10.244.0.0/16"), "{other}");
    let bad = validate(&spec(POD_NETWORK, "10.96.0.1/12")).unwrap_err();
    assert!(bad.contains("host bits"), "{bad}");
    assert!(validate(&spec(POD_NETWORK, "nope")).is_err());
    let mut s = spec(POD_NETWORK, "10.96.0.0/12");
    s.release.version = "1.19.0".into();
    assert!(validate(&s).unwrap_err().contains("release.version"));
}

#[test]
fn cidrs_overlap_when_they_share_an_address() {
    let a = Cidr::parse("10.0.0.0/8").unwrap();
    assert!(a.overlaps(&Cidr::parse("10.96.0.0/12").unwrap()));
    assert!(!a.overlaps(&Cidr::parse("172.16.0.0/12").unwrap()));
    assert!(Cidr::parse("10.0.0.0/33").is_err());
    assert!(
        Cidr::parse("10.96.0.1/12")
            .unwrap_err()
            .contains("host bits")
    );
    let svc = Cidr::parse("10.96.0.0/12").unwrap();
    assert_eq!(svc.nth(10), Some(Ipv4Addr::new(10, 96, 0, 10)));
    let small = Cidr::parse("192.0.2.0/30").unwrap();
    assert_eq!(small.nth(3), Some(Ipv4Addr::new(192, 0, 2, 3)));
    assert_eq!(small.nth(4), None);
}

#[test]
fn paused_until_true_a_time_or_nothing() {
    let now: Timestamp = "2026-11-23T12:00:00Z".parse().unwrap();
    assert_eq!(paused(None, now), Ok(None));
    assert_eq!(paused(Some("true"), now), Ok(Some(None)));
    let later: Timestamp = "2026-11-23T13:00:00Z".parse().unwrap();
    assert_eq!(
        paused(Some("2026-11-23T13:00:00Z"), now),
        Ok(Some(Some(later)))
    );
    assert_eq!(paused(Some("2026-11-23T11:00:00Z"), now), Ok(None));
    assert!(paused(Some("tomorrow"), now).is_err());
}

#[test]
fn a_pool_is_never_newer_than_its_control_plane_nor_too_old() {
    assert_eq!(version_skew("v1.20.2", "v1.20.2"), Ok(()));
    assert_eq!(version_skew("1.20.2", "v1.22.0"), Ok(()));
    assert!(
        version_skew("v1.21.0", "v1.20.2")
            .unwrap_err()
            .contains("newer")
    );
    assert!(
        version_skew("v1.20.3", "v1.20.2")
            .unwrap_err()
            .contains("newer")
    );
    assert!(
        version_skew("v1.20.2", "v1.23.0")
            .unwrap_err()
            .contains("more than 2 minor versions older")
    );
    // From 1.25 on, a kubelet may be three minors older.
    assert_eq!(version_skew("v1.25.0", "v1.28.3"), Ok(()));
    assert!(
        version_skew("v1.25.0", "v1.29.0")
            .unwrap_err()
            .contains("more than 3 minor versions older")
    );
    assert!(
        version_skew("v1.24.9", "v1.27.0")
            .unwrap_err()
            .contains("more than 2")
    );
}

fn m(name: &str, current: bool, ready: bool) -> Member {
    Member {
        name: name.into(),
        current,
        ready,
    }
}

#[test]
fn scaling_creates_or_removes_not_ready_nodes_first_then_the_newest() {
    assert_eq!(rollout(2, 1, 0, &[]).create, 2);
    let nodes = [m("a", true, true), m("b", true, false), m("c", true, true)];
    let a = rollout(1, 1, 0, &nodes);
    assert_eq!(a.create, 0);
    assert_eq!(a.remove, ["b", "c"]);
    assert_eq!(rollout(3, 1, 0, &nodes), Actions::default());
}

#[test]
fn a_rollout_surges_then_removes_outdated_nodes_one_at_a_time() {
    // replicas 2, maxSurge 1, maxUnavailable 0.
    let step1 = [m("a", false, true), m("b", false, true)];
    assert_eq!(
        rollout(2, 1, 0, &step1),
        Actions {
            create: 1,
            remove: vec![]
        }
    );
    let step2 = [
        m("a", false, true),
        m("b", false, true),
        m("c", true, false),
    ];
    assert_eq!(rollout(2, 1, 0, &step2), Actions::default(), "wait for c");
    let step3 = [m("a", false, true), m("b", false, true), m("c", true, true)];
    assert_eq!(rollout(2, 1, 0, &step3).remove, ["a"]);
    let step4 = [m("b", false, true), m("c", true, true)];
    assert_eq!(
        rollout(2, 1, 0, &step4),
        Actions {
            create: 1,
            remove: vec![]
        }
    );
    let step5 = [m("b", false, true), m("c", true, true), m("d", true, true)];
    assert_eq!(rollout(2, 1, 0, &step5).remove, ["b"]);
}

#[test]
fn without_surge_a_rollout_goes_below_size_within_max_unavailable() {
    let nodes = [m("a", false, true), m("b", false, true)];
    assert_eq!(
        rollout(2, 0, 1, &nodes),
        Actions {
            create: 0,
            remove: vec!["a".into()]
        }
    );
    let broken = [m("a", false, false), m("b", false, true)];
    assert_eq!(
        rollout(2, 1, 0, &broken).remove,
        ["a"],
        "a broken outdated node just goes"
    );
    // Both zero: one node of surge, so the rollout moves.
    assert_eq!(rollout(2, 0, 0, &nodes).create, 1);
}

#[test]
fn a_serving_request_is_approved_only_for_the_node_itself_and_its_own_address() {
    let ip: Ipv4Addr = "10.201.4.2".parse().unwrap();
    let good = nestplane_pki::CsrInfo {
        common_name: "system:node:p-abcde".into(),
        organizations: vec!["system:nodes".into()],
        dns_names: vec!["p-abcde".into()],
        ips: vec![ip.into()],
        other_names: vec![],
    };
    let usages: Vec<String> = ["digital signature", "key encipherment", "server auth"]
        .map(String::from)
        .to_vec();
    let judge = |requester: &str, usages: &[String], info: &nestplane_pki::CsrInfo| {
        judge_serving_request(requester, usages, info, "p-abcde", ip)
    };
    assert_eq!(judge("system:node:p-abcde", &usages, &good), Ok(()));
    // Another node's credential, or a stranger's.
    assert!(judge("system:node:p-zzzzz", &usages, &good).is_err());
    assert!(judge("system:bootstrap:abcdef", &usages, &good).is_err());
    // Another name or address than the node's.
    let mut other = good.clone();
    other.ips.push("127.0.0.1".parse().unwrap());
    assert!(
        judge("system:node:p-abcde", &usages, &other)
            .unwrap_err()
            .contains("127.0.0.1")
    );
    let mut other = good.clone();
    other.dns_names = vec!["kubernetes.default.svc".into()];
    assert!(judge("system:node:p-abcde", &usages, &other).is_err());
    let mut other = good.clone();
    other.organizations = vec!["system:masters".into()];
    assert!(judge("system:node:p-abcde", &usages, &other).is_err());
    let mut other = good.clone();
    other.other_names = vec!["URI(spiffe://x)".into()];
    assert!(judge("system:node:p-abcde", &usages, &other).is_err());
    let mut none = good.clone();
    none.dns_names.clear();
    none.ips.clear();
    assert!(judge("system:node:p-abcde", &usages, &none).is_err());
    // Client auth is not serving.
    let mut client = usages.clone();
    client.push("client auth".into());
    assert!(judge("system:node:p-abcde", &client, &good).is_err());
}

#[test]
fn cluster_dns_is_the_tenth_address_of_the_service_network() {
    assert_eq!(
        dns_service_ip(&networking(&spec("10.244.0.0/16", "10.96.0.0/12"))),
        Ok("10.96.0.10".parse().unwrap())
    );
    assert_eq!(
        dns_service_ip(&networking(&spec("10.244.0.0/16", "172.30.4.0/24"))),
        Ok("172.30.4.10".parse().unwrap())
    );
    assert!(dns_service_ip(&networking(&spec("10.244.0.0/16", "172.30.4.0/29"))).is_err());
}

#[test]
fn the_dns_provider_is_the_specs_then_the_operators_then_where_nodes_are_made() {
    use nestplane_api::hosted::{DnsProvider, DnsSpec};
    let mut s = spec("10.244.0.0/16", "10.96.0.0/12");
    assert_eq!(dns_provider(&s, None, true), DnsProvider::Builtin);
    assert_eq!(dns_provider(&s, None, false), DnsProvider::CoreDns);
    assert_eq!(
        dns_provider(&s, Some(DnsProvider::CoreDns), true),
        DnsProvider::CoreDns
    );
    s.dns = Some(DnsSpec {
        provider: Some(DnsProvider::Builtin),
    });
    assert_eq!(
        dns_provider(&s, Some(DnsProvider::CoreDns), false),
        DnsProvider::Builtin
    );
}

#[test]
fn nodes_wait_for_the_control_plane_to_reach_their_version() {
    let hc = |history: &[(&str, &str)]| -> HostedCluster {
        let entries: Vec<serde_json::Value> = history
            .iter()
            .map(|(v, state)| serde_json::json!({"version": v, "state": state, "startedTime": "2026-01-01T00:00:00Z"}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "nestplane.io/v1alpha1",
            "kind": "HostedCluster",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {"release": {"version": "1.20.5"}},
            "status": {"version": {"desired": {"version": "1.20.5"}, "history": entries}}
        }))
        .expect("hosted cluster")
    };
    // Asked for 1.20.5, still at 1.20.2: a pool that follows its control plane waits.
    let moving = hc(&[("1.20.5", "Partial"), ("1.20.2", "Completed")]);
    let reached = reached_version(&moving);
    assert_eq!(reached.as_deref(), Some("v1.20.2"));
    let why = nodes_may_move("v1.20.5", reached.as_deref()).expect_err("kubelets first");
    assert!(
        why.contains("waiting for the control plane to reach v1.20.5"),
        "{why}"
    );
    // A pool pinned to what runs keeps going.
    assert_eq!(nodes_may_move("v1.20.2", reached.as_deref()), Ok(()));
    // Once reached, the pool follows.
    let done = hc(&[("1.20.5", "Completed"), ("1.20.2", "Completed")]);
    assert_eq!(
        nodes_may_move("v1.20.5", reached_version(&done).as_deref()),
        Ok(())
    );
    // A new cluster has reached nothing; its pool waits for the control plane to be Ready.
    assert_eq!(reached_version(&hc(&[("1.20.5", "Partial")])), None);
    assert_eq!(nodes_may_move("v1.20.5", None), Ok(()));
}

#[test]
fn a_pool_left_outside_the_skew_holds_the_change_and_is_named() {
    let pools = [
        ("fresh".to_string(), Some("v1.22.0".to_string())),
        ("empty".to_string(), None),
        ("old".to_string(), Some("v1.20.2".to_string())),
    ];
    // Two minors ahead of a 1.20 kubelet: allowed; three: held, naming the pool.
    assert_eq!(pool_blocking("v1.22.3", &pools), None);
    let why = pool_blocking("1.23.0", &pools).expect("held");
    assert!(
        why.starts_with("NodePool old runs v1.20.2, and a control plane at v1.23.0")
            && why.contains("upgrade the pool first"),
        "{why}"
    );
    // A control plane older than a pool's kubelets would make them newer: held too.
    let why = pool_blocking("v1.21.9", &pools).expect("held");
    assert!(why.starts_with("NodePool fresh"), "{why}");
    // From 1.25, three minors.
    let pools = [("p".to_string(), Some("v1.25.0".to_string()))];
    assert_eq!(pool_blocking("v1.28.0", &pools), None);
    assert!(pool_blocking("v1.29.0", &pools).is_some());
}
