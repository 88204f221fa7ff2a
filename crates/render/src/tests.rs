#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1::{Container, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use nestplane_api::names::{
    CLUSTER_NAME_LABEL, COMPONENT_LABEL, Component, MANAGED_BY_LABEL, SecretPurpose, TLS_KEY,
};

use crate::*;

fn hosts(n: u8) -> Vec<Ipv4Addr> {
    (1..=n).map(|i| Ipv4Addr::new(127, 64, 3, i)).collect()
}

fn v(minor: u32) -> KubeVersion {
    KubeVersion::new(1, minor, 2)
}

fn loopback(minor: u32, n: u8) -> RenderInput {
    RenderInput::new(
        "demo",
        "tenants",
        v(minor),
        Network::Loopback { hosts: hosts(n) },
    )
}

fn cluster(minor: u32) -> RenderInput {
    RenderInput::new("demo", "tenants", v(minor), Network::Cluster)
}

fn all_minors() -> impl Iterator<Item = u32> {
    MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR
}

fn container(r: &Rendered) -> &Container {
    &r.pod_template.spec.as_ref().unwrap().containers[0]
}

fn args(r: &Rendered) -> &[String] {
    container(r).args.as_deref().unwrap()
}

/// Flag name → value.
fn flags(r: &Rendered) -> BTreeMap<String, String> {
    args(r)
        .iter()
        .map(|a| {
            let (k, v) = a.strip_prefix("--").unwrap().split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn flag(r: &Rendered, name: &str) -> Option<String> {
    flags(r).get(name).cloned()
}

/// Every input shape the tests sweep: both networks, 1 and 3 replicas, every version.
fn every_input() -> Vec<RenderInput> {
    let mut out = Vec::new();
    for minor in all_minors() {
        out.push(loopback(minor, 1));
        out.push(
            loopback(minor, 3)
                .with_replicas(Component::Etcd, 3)
                .with_replicas(Component::ApiServer, 3)
                .with_replicas(Component::ControllerManager, 2),
        );
        out.push(cluster(minor));
        out.push(cluster(minor).with_replicas(Component::Etcd, 3));
    }
    out
}

// ---------------------------------------------------------------- versions

#[test]
fn version_parses_with_and_without_v() {
    let a = KubeVersion::parse("1.20.2").unwrap();
    let b = KubeVersion::parse("v1.20.2").unwrap();
    assert_eq!(a, b);
    assert_eq!(a, KubeVersion::new(1, 20, 2));
    assert_eq!(a.to_string(), "v1.20.2");
    assert_eq!("v1.34.0".parse::<KubeVersion>().unwrap().minor, 34);
    assert_eq!(
        KubeVersion::parse(" v1.27.11 ").unwrap(),
        v(27).with_patch(11)
    );
}

impl KubeVersion {
    fn with_patch(mut self, p: u32) -> Self {
        self.patch = p;
        self
    }
}

#[test]
fn version_rejects_unsupported_minors_with_the_range() {
    for s in ["1.19.9", "v1.35.0", "v2.20.0", "0.20.0"] {
        let e = KubeVersion::parse(s).unwrap_err();
        assert!(
            matches!(e, RenderError::UnsupportedVersion { .. }),
            "{s}: {e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("v1.20.0 through v1.34.x"), "{msg}");
        assert!(
            msg.contains(&format!("v{}", s.trim_start_matches('v'))),
            "{msg}"
        );
    }
}

#[test]
fn version_rejects_garbage_with_a_reason() {
    for s in [
        "",
        "garbage",
        "1.20",
        "1.20.2.1",
        "v1.x.2",
        "1.20.2-rc.0",
        "vv1.20.2",
        "1..2",
        "+1.20.2",
    ] {
        let e = KubeVersion::parse(s).unwrap_err();
        assert!(
            matches!(e, RenderError::InvalidVersion { .. }),
            "{s}: {e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("not a Kubernetes version"), "{msg}");
        assert!(
            msg.contains("v1.20.2"),
            "the message shows an example: {msg}"
        );
    }
}

#[test]
fn etcd_versions_follow_kubeadm() {
    assert_eq!(etcd_version_for(&v(20)), "3.4.13-0");
    assert_eq!(etcd_version_for(&v(21)), "3.4.13-0");
    assert_eq!(etcd_version_for(&v(22)), "3.5.0-0");
    assert_eq!(etcd_version_for(&v(33)), "3.5.21-0");
    assert!(etcd_version_for(&v(34)).starts_with("3.6."));
    // Never goes backwards as Kubernetes moves forward; always an image tag `X.Y.Z-N`.
    let parse = |s: &str| -> Vec<u32> {
        s.split(['.', '-'])
            .map(|p| p.parse::<u32>().unwrap())
            .collect()
    };
    let mut last = vec![0];
    for minor in all_minors() {
        let tag = etcd_version_for(&v(minor));
        let parsed = parse(tag);
        assert_eq!(parsed.len(), 4, "{tag}");
        assert!(parsed >= last, "1.{minor}: {tag}");
        last = parsed;
    }
}

// ---------------------------------------------------------------- flags per version

#[test]
fn apiserver_insecure_port_only_before_1_24() {
    for minor in all_minors() {
        for input in [loopback(minor, 1), cluster(minor)] {
            let r = render(Component::ApiServer, &input).unwrap();
            assert_eq!(
                flag(&r, "insecure-port").as_deref(),
                (minor < 24).then_some("0"),
                "1.{minor}"
            );
        }
    }
}

#[test]
fn controller_manager_and_scheduler_port_only_where_it_has_effect() {
    for minor in all_minors() {
        for c in [Component::ControllerManager, Component::Scheduler] {
            let r = render(c, &loopback(minor, 1)).unwrap();
            assert_eq!(
                flag(&r, "port").as_deref(),
                (minor < 22).then_some("0"),
                "{c:?} 1.{minor}"
            );
            assert!(flag(&r, "address").is_none());
        }
    }
}

#[test]
fn etcd_flags_follow_the_paired_etcd_release() {
    for minor in all_minors() {
        let r = render(Component::Etcd, &loopback(minor, 1)).unwrap();
        let f = flags(&r);
        let etcd = etcd_version_for(&v(minor));
        let experimental = f.contains_key("experimental-initial-corrupt-check");
        let gate = f.get("feature-gates").map(String::as_str);
        if etcd.starts_with("3.4.") {
            assert!(!experimental && gate.is_none(), "1.{minor}");
            assert!(!f.contains_key("experimental-watch-progress-notify-interval"));
        } else if etcd.starts_with("3.5.") {
            assert!(experimental && gate.is_none(), "1.{minor}");
            assert_eq!(f["experimental-watch-progress-notify-interval"], "5s");
        } else {
            assert!(!experimental, "1.{minor}");
            assert_eq!(gate, Some("InitialCorruptCheck=true"));
            assert_eq!(f["watch-progress-notify-interval"], "5s");
        }
    }
}

#[test]
fn required_flags_are_present_for_every_version() {
    let required: [(Component, &[&str]); 4] = [
        (
            Component::Etcd,
            &[
                "name",
                "data-dir",
                "client-cert-auth",
                "peer-client-cert-auth",
                "trusted-ca-file",
                "peer-trusted-ca-file",
                "cert-file",
                "key-file",
                "peer-cert-file",
                "peer-key-file",
                "listen-client-urls",
                "advertise-client-urls",
                "listen-peer-urls",
                "initial-advertise-peer-urls",
                "listen-metrics-urls",
                "initial-cluster",
                "initial-cluster-state",
                "initial-cluster-token",
                "snapshot-count",
            ],
        ),
        (
            Component::ApiServer,
            &[
                "advertise-address",
                "bind-address",
                "secure-port",
                "allow-privileged",
                "authorization-mode",
                "client-ca-file",
                "enable-admission-plugins",
                "enable-bootstrap-token-auth",
                "etcd-servers",
                "etcd-cafile",
                "etcd-certfile",
                "etcd-keyfile",
                "kubelet-client-certificate",
                "kubelet-client-key",
                "kubelet-preferred-address-types",
                "proxy-client-cert-file",
                "proxy-client-key-file",
                "requestheader-allowed-names",
                "requestheader-client-ca-file",
                "requestheader-extra-headers-prefix",
                "requestheader-group-headers",
                "requestheader-username-headers",
                "service-account-issuer",
                "service-account-key-file",
                "service-account-signing-key-file",
                "service-cluster-ip-range",
                "tls-cert-file",
                "tls-private-key-file",
            ],
        ),
        (
            Component::ControllerManager,
            &[
                "kubeconfig",
                "authentication-kubeconfig",
                "authorization-kubeconfig",
                "bind-address",
                "secure-port",
                "tls-cert-file",
                "tls-private-key-file",
                "client-ca-file",
                "requestheader-client-ca-file",
                "cluster-name",
                "cluster-signing-cert-file",
                "cluster-signing-key-file",
                "root-ca-file",
                "service-account-private-key-file",
                "service-cluster-ip-range",
                "use-service-account-credentials",
                "controllers",
                "leader-elect",
            ],
        ),
        (
            Component::Scheduler,
            &[
                "kubeconfig",
                "authentication-kubeconfig",
                "authorization-kubeconfig",
                "bind-address",
                "secure-port",
                "tls-cert-file",
                "tls-private-key-file",
                "leader-elect",
            ],
        ),
    ];
    for input in every_input() {
        for (c, names) in &required {
            let f = flags(&render(*c, &input).unwrap());
            for name in *names {
                assert!(f.contains_key(*name), "{c:?} {}: --{name}", input.version);
            }
        }
    }
}

#[test]
fn well_known_flag_values() {
    let input = loopback(20, 1);
    let api = render(Component::ApiServer, &input).unwrap();
    assert_eq!(flag(&api, "secure-port").unwrap(), "6443");
    assert_eq!(flag(&api, "authorization-mode").unwrap(), "Node,RBAC");
    assert_eq!(
        flag(&api, "service-account-issuer").unwrap(),
        "https://kubernetes.default.svc.cluster.local"
    );
    assert_eq!(
        flag(&api, "service-cluster-ip-range").unwrap(),
        "10.96.0.0/12"
    );
    assert_eq!(
        flag(&api, "requestheader-allowed-names").unwrap(),
        "front-proxy-client"
    );
    let kcm = render(Component::ControllerManager, &input).unwrap();
    assert_eq!(flag(&kcm, "secure-port").unwrap(), "10257");
    assert_eq!(flag(&kcm, "cluster-name").unwrap(), "demo");
    assert_eq!(
        flag(&kcm, "controllers").unwrap(),
        "*,bootstrapsigner,tokencleaner"
    );
    let sched = render(Component::Scheduler, &input).unwrap();
    assert_eq!(flag(&sched, "secure-port").unwrap(), "10259");
    let etcd = render(Component::Etcd, &input).unwrap();
    assert_eq!(flag(&etcd, "name").unwrap(), "$(POD_NAME)");
    assert_eq!(flag(&etcd, "data-dir").unwrap(), "/var/lib/etcd/data");
    assert_eq!(flag(&etcd, "initial-cluster-token").unwrap(), "demo");
    assert_eq!(flag(&etcd, "initial-cluster-state").unwrap(), "new");
    assert_eq!(
        flag(&etcd, "listen-metrics-urls").unwrap(),
        "http://$(POD_IP):2381"
    );
}

#[test]
fn args_are_sorted_unique_flags_and_command_is_the_bare_binary() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            let c = container(&r);
            assert_eq!(c.command.as_deref().unwrap(), [r.component.binary()]);
            assert_eq!(c.name, r.component.binary());
            let names: Vec<&str> = args(&r)
                .iter()
                .map(|a| {
                    assert!(a.starts_with("--") && a.contains('='), "{a}");
                    a[2..].split('=').next().unwrap()
                })
                .collect();
            let mut sorted = names.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(names, sorted, "{:?}: sorted and unique", r.component);
        }
    }
}

// ---------------------------------------------------------------- network-specific flags

#[test]
fn loopback_binds_to_the_replica_address_and_cluster_to_all() {
    let lo = loopback(25, 1);
    let cl = cluster(25);
    for c in [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ] {
        assert_eq!(
            flag(&render(c, &lo).unwrap(), "bind-address").unwrap(),
            "$(POD_IP)"
        );
        assert_eq!(
            flag(&render(c, &cl).unwrap(), "bind-address").unwrap(),
            "0.0.0.0"
        );
    }
    let api_lo = render(Component::ApiServer, &lo).unwrap();
    let api_cl = render(Component::ApiServer, &cl).unwrap();
    // Process runtime: the node-local proxy address is the `kubernetes` endpoint.
    assert_eq!(flag(&api_lo, "advertise-address").unwrap(), "172.20.0.1");
    assert_eq!(flag(&api_cl, "advertise-address").unwrap(), "$(POD_IP)");
    assert_eq!(flag(&api_lo, "endpoint-reconciler-type"), None);
    assert_eq!(flag(&api_cl, "endpoint-reconciler-type"), None);

    let etcd_lo = render(Component::Etcd, &lo).unwrap();
    assert_eq!(
        flag(&etcd_lo, "listen-client-urls").unwrap(),
        "https://$(POD_IP):2379"
    );
    assert_eq!(
        flag(&etcd_lo, "listen-peer-urls").unwrap(),
        "https://$(POD_IP):2380"
    );
    let etcd_cl = render(Component::Etcd, &cl).unwrap();
    assert_eq!(
        flag(&etcd_cl, "listen-client-urls").unwrap(),
        "https://0.0.0.0:2379"
    );
    assert_eq!(
        flag(&etcd_cl, "advertise-client-urls").unwrap(),
        "https://$(POD_NAME).demo-etcd-peer.tenants.svc:2379"
    );
    assert_eq!(
        flag(&etcd_cl, "initial-advertise-peer-urls").unwrap(),
        "https://$(POD_NAME).demo-etcd-peer.tenants.svc:2380"
    );
}

#[test]
fn initial_cluster_lists_every_replica_in_both_networks() {
    let lo = loopback(20, 3).with_replicas(Component::Etcd, 3);
    let r = render(Component::Etcd, &lo).unwrap();
    assert_eq!(
        flag(&r, "initial-cluster").unwrap(),
        "demo-etcd-0=https://127.64.3.1:2380,demo-etcd-1=https://127.64.3.2:2380,demo-etcd-2=https://127.64.3.3:2380"
    );
    assert_eq!(r.replicas, 3);

    let cl = cluster(30).with_replicas(Component::Etcd, 3);
    let r = render(Component::Etcd, &cl).unwrap();
    assert_eq!(
        flag(&r, "initial-cluster").unwrap(),
        "demo-etcd-0=https://demo-etcd-0.demo-etcd-peer.tenants.svc:2380,\
         demo-etcd-1=https://demo-etcd-1.demo-etcd-peer.tenants.svc:2380,\
         demo-etcd-2=https://demo-etcd-2.demo-etcd-peer.tenants.svc:2380"
    );

    // More host addresses than replicas: only the replicas are members.
    let r = render(Component::Etcd, &loopback(20, 7)).unwrap();
    assert_eq!(
        flag(&r, "initial-cluster").unwrap(),
        "demo-etcd-0=https://127.64.3.1:2380"
    );
}

#[test]
fn apiserver_etcd_servers_match_etcd_client_urls() {
    let lo = loopback(20, 3).with_replicas(Component::Etcd, 3);
    assert_eq!(
        etcd_client_urls(&lo),
        [
            "https://127.64.3.1:2379",
            "https://127.64.3.2:2379",
            "https://127.64.3.3:2379"
        ]
    );
    let r = render(Component::ApiServer, &lo).unwrap();
    assert_eq!(
        flag(&r, "etcd-servers").unwrap(),
        etcd_client_urls(&lo).join(",")
    );
    let cl = cluster(20).with_replicas(Component::Etcd, 3);
    assert_eq!(
        etcd_client_urls(&cl),
        ["https://demo-etcd.tenants.svc:2379"]
    );
    let r = render(Component::ApiServer, &cl).unwrap();
    assert_eq!(
        flag(&r, "etcd-servers").unwrap(),
        "https://demo-etcd.tenants.svc:2379"
    );
}

#[test]
fn an_external_etcd_is_reached_at_the_addresses_it_reports_and_bad_ones_are_refused() {
    for mut input in [loopback(20, 3), cluster(20)] {
        input.external_etcd = Some(vec![
            "https://127.0.0.1:32379".into(),
            "https://etcd-0.example:2379".into(),
        ]);
        let r = render(Component::ApiServer, &input).unwrap();
        assert_eq!(
            flag(&r, "etcd-servers").unwrap(),
            "https://127.0.0.1:32379,https://etcd-0.example:2379"
        );
    }
    for bad in [
        vec![],
        vec!["http://127.0.0.1:2379".to_string()],
        vec!["https://127.0.0.1".to_string()],
        vec!["https://127.0.0.1:0".to_string()],
        vec!["https://a b:2379".to_string()],
        vec!["https://a,--x=y:2379".to_string()],
    ] {
        let mut input = loopback(20, 3);
        input.external_etcd = Some(bad.clone());
        let err = render(Component::ApiServer, &input).expect_err(&format!("{bad:?}"));
        assert!(err.to_string().contains("etcd addresses"), "{err}");
    }
}

#[test]
fn apiserver_internal_url_per_network() {
    assert_eq!(
        apiserver_internal_url(&loopback(20, 3)),
        "https://127.64.3.1:6443"
    );
    assert_eq!(
        apiserver_internal_url(&cluster(20)),
        "https://demo-apiserver.tenants.svc:6443"
    );
}

// ---------------------------------------------------------------- volumes and secrets

/// Every absolute path in an argument value (comma-separated lists are split).
fn paths_in_args(r: &Rendered) -> Vec<String> {
    flags(r)
        .values()
        .flat_map(|v| v.split(',').map(str::to_string).collect::<Vec<_>>())
        .filter(|p| p.starts_with('/'))
        .collect()
}

#[test]
fn every_path_in_args_is_under_a_mount_whose_volume_exists() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            let spec = r.pod_template.spec.as_ref().unwrap();
            let volumes: BTreeSet<&str> = spec
                .volumes
                .iter()
                .flatten()
                .map(|v| v.name.as_str())
                .collect();
            let mounts = container(&r).volume_mounts.as_deref().unwrap();
            for m in mounts {
                let claim_template = r.component == Component::Etcd
                    && input.network == Network::Cluster
                    && m.name == ETCD_DATA_VOLUME;
                assert!(
                    volumes.contains(m.name.as_str()) || claim_template,
                    "{:?}: mount {} has no volume",
                    r.component,
                    m.name
                );
                assert!(
                    m.mount_path.starts_with("/etc/nestplane/") || m.mount_path == ETCD_DATA_MOUNT,
                    "{}",
                    m.mount_path
                );
            }
            let paths = paths_in_args(&r);
            assert!(!paths.is_empty());
            for p in paths {
                assert!(
                    mounts
                        .iter()
                        .any(|m| p.starts_with(&format!("{}/", m.mount_path))),
                    "{:?}: {p} is under no mount",
                    r.component
                );
            }
            // And every mount is used by some argument (nothing mounted for nothing).
            let f = flags(&r);
            for m in mounts {
                assert!(
                    f.values()
                        .any(|v| v.contains(&format!("{}/", m.mount_path))),
                    "{:?}: {} is mounted but unused",
                    r.component,
                    m.mount_path
                );
            }
        }
    }
}

#[test]
fn every_secret_path_names_a_key_the_volume_projects() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            let spec = r.pod_template.spec.as_ref().unwrap();
            let mounts = container(&r).volume_mounts.as_deref().unwrap();
            for p in paths_in_args(&r) {
                if p.starts_with(ETCD_DATA_MOUNT) {
                    continue;
                }
                let m = mounts
                    .iter()
                    .find(|m| p.starts_with(&format!("{}/", m.mount_path)))
                    .unwrap();
                let file = &p[m.mount_path.len() + 1..];
                let vol = spec
                    .volumes
                    .iter()
                    .flatten()
                    .find(|v| v.name == m.name)
                    .unwrap();
                let items = vol.secret.as_ref().unwrap().items.as_ref().unwrap();
                assert!(
                    items.iter().any(|i| i.path == file),
                    "{:?}: {p} is not projected",
                    r.component
                );
            }
        }
    }
}

#[test]
fn secrets_list_matches_the_secret_volumes() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            let spec = r.pod_template.spec.as_ref().unwrap();
            let mounted: BTreeSet<String> = spec
                .volumes
                .iter()
                .flatten()
                .filter_map(|v| v.secret.as_ref())
                .map(|s| s.secret_name.clone().unwrap())
                .collect();
            let listed: BTreeSet<String> = r
                .secrets
                .iter()
                .map(|p| p.secret_name(&input.cluster))
                .collect();
            assert_eq!(mounted, listed, "{:?}", r.component);
            let mut sorted = r.secrets.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted, r.secrets);
        }
    }
}

#[test]
fn each_component_mounts_exactly_its_secrets() {
    use SecretPurpose::*;
    let input = loopback(20, 1);
    let secrets = |c| render(c, &input).unwrap().secrets;
    assert_eq!(secrets(Component::Etcd), [EtcdCa, EtcdServer, EtcdPeer]);
    assert_eq!(
        secrets(Component::ApiServer),
        [
            ClusterCa,
            EtcdCa,
            FrontProxyCa,
            ServiceAccount,
            ApiServerEtcdClient,
            ApiServer,
            ApiServerKubeletClient,
            FrontProxyClient
        ]
    );
    assert_eq!(
        secrets(Component::ControllerManager),
        [
            ClusterCa,
            FrontProxyCa,
            ServiceAccount,
            ControllerManagerKubeconfig,
            ControllerManagerServing
        ]
    );
    assert_eq!(
        secrets(Component::Scheduler),
        [SchedulerKubeconfig, SchedulerServing]
    );
}

#[test]
fn ca_private_keys_are_mounted_only_where_needed() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            for vol in r
                .pod_template
                .spec
                .as_ref()
                .unwrap()
                .volumes
                .iter()
                .flatten()
            {
                let Some(s) = &vol.secret else { continue };
                let name = s.secret_name.clone().unwrap();
                let keys: Vec<&str> = s.items.iter().flatten().map(|i| i.key.as_str()).collect();
                let has_key = keys.contains(&TLS_KEY);
                if name == SecretPurpose::ClusterCa.secret_name("demo") {
                    assert_eq!(has_key, r.component == Component::ControllerManager);
                }
                if name == SecretPurpose::EtcdCa.secret_name("demo")
                    || name == SecretPurpose::FrontProxyCa.secret_name("demo")
                {
                    assert!(!has_key, "{:?} mounts {name} key", r.component);
                }
                if name == SecretPurpose::ServiceAccount.secret_name("demo")
                    && r.component == Component::ControllerManager
                {
                    assert_eq!(keys, [TLS_KEY], "KCM needs only the signing key");
                }
                assert_eq!(s.default_mode, Some(0o600));
                assert_eq!(s.default_mode, Some(384));
            }
        }
    }
}

#[test]
fn mount_paths_are_distinct_and_none_is_a_prefix_of_another() {
    let mut paths: Vec<String> = SecretPurpose::ALL
        .iter()
        .map(|p| secret_mount_path(*p))
        .collect();
    paths.push(ETCD_DATA_MOUNT.into());
    for a in &paths {
        for b in &paths {
            if a != b {
                assert!(!b.starts_with(a.as_str()), "{a} is a prefix of {b}");
            }
        }
    }
    let names: BTreeSet<&str> = SecretPurpose::ALL
        .iter()
        .map(|p| secret_volume_name(*p))
        .collect();
    assert_eq!(names.len(), SecretPurpose::ALL.len());
    assert!(!names.contains(ETCD_DATA_VOLUME));
}

#[test]
fn etcd_data_is_an_empty_dir_on_loopback_and_a_claim_in_the_cluster() {
    let r = render(Component::Etcd, &loopback(20, 1)).unwrap();
    let vols = r
        .pod_template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .clone()
        .unwrap();
    let data = vols.iter().find(|v| v.name == "data").unwrap();
    assert!(data.empty_dir.is_some());

    let r = render(Component::Etcd, &cluster(20)).unwrap();
    let vols = r
        .pod_template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .clone()
        .unwrap();
    assert!(vols.iter().all(|v| v.name != "data"));
    let m = container(&r)
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.name == "data")
        .unwrap();
    assert_eq!(m.mount_path, "/var/lib/etcd");
    assert_ne!(m.read_only, Some(true));
}

// ---------------------------------------------------------------- pod template

#[test]
fn containers_declare_pod_name_and_pod_ip_and_use_them() {
    for input in every_input() {
        for r in render_all(&input).unwrap() {
            let env = container(&r).env.clone().unwrap();
            let field = |name: &str| {
                env.iter()
                    .find(|e| e.name == name)
                    .and_then(|e| e.value_from.as_ref())
                    .and_then(|f| f.field_ref.as_ref())
                    .map(|f| f.field_path.clone())
            };
            assert_eq!(field("POD_NAME").as_deref(), Some("metadata.name"));
            assert_eq!(field("POD_IP").as_deref(), Some("status.podIP"));
            let joined = args(&r).join(" ");
            if matches!(input.network, Network::Loopback { .. }) {
                assert!(joined.contains("$(POD_IP)"), "{:?}", r.component);
            }
            // Only the declared variables are referenced.
            for part in joined.split("$(").skip(1) {
                let var = part.split(')').next().unwrap();
                assert!(var == "POD_IP" || var == "POD_NAME", "$({var})");
            }
        }
        let etcd = render(Component::Etcd, &input).unwrap();
        assert!(args(&etcd).join(" ").contains("$(POD_NAME)"));
    }
}

#[test]
fn labels_images_ports_probes_and_security() {
    let mut input = loopback(20, 1);
    input.image_registry = "mirror.example/k8s/".into();
    for r in render_all(&input).unwrap() {
        let labels = r
            .pod_template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .clone()
            .unwrap();
        assert_eq!(labels[CLUSTER_NAME_LABEL], "demo");
        assert_eq!(labels[COMPONENT_LABEL], r.component.short_name());
        assert_eq!(labels[MANAGED_BY_LABEL], "nestplane");
        assert_eq!(
            r.workload_name,
            format!("demo-{}", r.component.short_name())
        );

        let c = container(&r);
        let image = c.image.clone().unwrap();
        match r.component {
            Component::Etcd => assert_eq!(image, "mirror.example/k8s/etcd:3.4.13-0"),
            other => assert_eq!(
                image,
                format!("mirror.example/k8s/{}:v1.20.2", other.binary())
            ),
        }

        let port_names: BTreeSet<String> = c
            .ports
            .iter()
            .flatten()
            .map(|p| p.name.clone().unwrap())
            .collect();
        for probe in [&c.startup_probe, &c.liveness_probe, &c.readiness_probe] {
            let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
            let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(name) = &get.port
            else {
                panic!("probe port by name")
            };
            assert!(port_names.contains(name), "{name}");
            let https = get.scheme.as_deref() == Some("HTTPS");
            assert_eq!(https, r.component != Component::Etcd);
        }
        // Ready about a second after it answers, with kubeadm's 4 minutes to start.
        let startup = c.startup_probe.as_ref().unwrap();
        assert_eq!(startup.initial_delay_seconds.unwrap_or(0), 0);
        assert_eq!(startup.period_seconds, Some(1));
        assert_eq!(startup.timeout_seconds, Some(5));
        assert_eq!(
            startup.period_seconds.unwrap() * startup.failure_threshold.unwrap(),
            240
        );
        let expected_ports: &[(&str, i32)] = match r.component {
            Component::Etcd => &[("client", 2379), ("peer", 2380), ("metrics", 2381)],
            Component::ApiServer => &[("https", 6443)],
            Component::ControllerManager => &[("https", 10257)],
            Component::Scheduler => &[("https", 10259)],
        };
        let actual: Vec<(String, i32)> = c
            .ports
            .iter()
            .flatten()
            .map(|p| (p.name.clone().unwrap(), p.container_port))
            .collect();
        let expected: Vec<(String, i32)> = expected_ports
            .iter()
            .map(|(n, p)| (n.to_string(), *p))
            .collect();
        assert_eq!(actual, expected);

        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.run_as_user, Some(RUN_AS_USER));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let psc = r
            .pod_template
            .spec
            .as_ref()
            .unwrap()
            .security_context
            .as_ref()
            .unwrap();
        assert_eq!(psc.fs_group, Some(RUN_AS_USER));
    }
    let etcd = render(Component::Etcd, &input).unwrap();
    let get = container(&etcd)
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .clone()
        .unwrap();
    assert_eq!(get.path.as_deref(), Some("/health"));
    let api = render(Component::ApiServer, &input).unwrap();
    let c = container(&api);
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap()
            .path
            .clone()
            .unwrap()
    };
    assert_eq!(path(&c.liveness_probe), "/livez");
    assert_eq!(path(&c.readiness_probe), "/readyz");
}

#[test]
fn resources_come_from_the_input_with_defaults() {
    let mut input = loopback(20, 1);
    let wanted = ResourceRequirements {
        limits: Some(BTreeMap::from([(
            "memory".to_string(),
            Quantity("2Gi".into()),
        )])),
        ..Default::default()
    };
    input.resources.insert(Component::ApiServer, wanted.clone());
    let api = render(Component::ApiServer, &input).unwrap();
    assert_eq!(container(&api).resources.as_ref(), Some(&wanted));
    let etcd = render(Component::Etcd, &input).unwrap();
    let requests = container(&etcd)
        .resources
        .clone()
        .unwrap()
        .requests
        .unwrap();
    assert_eq!(requests["cpu"], Quantity("100m".into()));
}

// ---------------------------------------------------------------- services

#[test]
fn services_only_on_the_cluster_network() {
    for r in render_all(&loopback(20, 1)).unwrap() {
        assert!(r.services.is_empty(), "{:?}", r.component);
    }
    let input = cluster(20);
    let etcd = render(Component::Etcd, &input).unwrap();
    let names: Vec<String> = etcd
        .services
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["demo-etcd-peer", "demo-etcd"]);
    let peer = etcd.services[0].spec.as_ref().unwrap();
    assert_eq!(peer.cluster_ip.as_deref(), Some("None"));
    assert_eq!(peer.publish_not_ready_addresses, Some(true));
    assert_eq!(
        peer.selector.as_ref().unwrap(),
        &selector_labels("demo", Component::Etcd)
    );
    let client = etcd.services[1].spec.as_ref().unwrap();
    assert_eq!(client.ports.as_ref().unwrap()[0].port, 2379);

    let api = render(Component::ApiServer, &input).unwrap();
    assert_eq!(api.services.len(), 1);
    let svc = &api.services[0];
    assert_eq!(svc.metadata.name.as_deref(), Some("demo-apiserver"));
    assert_eq!(svc.metadata.namespace.as_deref(), Some("tenants"));
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_eq!(spec.ports.as_ref().unwrap()[0].port, 6443);
    // The selector matches the pods.
    let labels = api
        .pod_template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in spec.selector.as_ref().unwrap() {
        assert_eq!(labels.get(k), Some(v));
    }

    for c in [Component::ControllerManager, Component::Scheduler] {
        assert!(render(c, &input).unwrap().services.is_empty());
    }
}

// ---------------------------------------------------------------- SANs

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn etcd_sans_cover_every_loopback_host() {
    let input = loopback(20, 7).with_replicas(Component::Etcd, 3);
    let s = etcd_sans(&input);
    for h in hosts(7) {
        assert!(s.ips.contains(&IpAddr::V4(h)), "{h}");
    }
    assert!(s.ips.contains(&ip("127.0.0.1")));
    assert!(s.dns.contains(&"localhost".to_string()));
    // Every client URL and peer URL host is covered.
    for u in etcd_client_urls(&input) {
        let host = u.trim_start_matches("https://").split(':').next().unwrap();
        assert!(s.ips.contains(&ip(host)), "{u}");
    }
}

#[test]
fn etcd_sans_in_the_cluster_cover_service_names() {
    let s = etcd_sans(&cluster(20));
    for name in [
        "*.demo-etcd-peer.tenants.svc",
        "*.demo-etcd-peer.tenants.svc.cluster.local",
        "demo-etcd",
        "demo-etcd.tenants",
        "demo-etcd.tenants.svc",
        "demo-etcd.tenants.svc.cluster.local",
        "localhost",
    ] {
        assert!(s.dns.contains(&name.to_string()), "{name}");
    }
    assert_eq!(s.ips, [ip("127.0.0.1")]);
}

#[test]
fn apiserver_sans_cover_service_hosts_and_endpoint() {
    let mut input = loopback(20, 3);
    input.cluster_domain = "tenant.example".into();
    let s = apiserver_sans(&input, Some("127.64.3.1"));
    for name in [
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.tenant.example",
        "localhost",
    ] {
        assert!(s.dns.contains(&name.to_string()), "{name}");
    }
    for a in [
        "10.96.0.1",
        "127.0.0.1",
        "127.64.3.1",
        "127.64.3.2",
        "127.64.3.3",
    ] {
        assert!(s.ips.contains(&ip(a)), "{a}");
    }
    let unique: BTreeSet<&IpAddr> = s.ips.iter().collect();
    assert_eq!(unique.len(), s.ips.len(), "no duplicates");

    let s = apiserver_sans(&cluster(20), Some("API.Example.com"));
    for name in [
        "demo-apiserver",
        "demo-apiserver.tenants",
        "demo-apiserver.tenants.svc",
        "demo-apiserver.tenants.svc.cluster.local",
        "api.example.com",
    ] {
        assert!(s.dns.contains(&name.to_string()), "{name}");
    }
    let s = apiserver_sans(&cluster(20), Some("[fd00::10]"));
    assert!(s.ips.contains(&ip("fd00::10")));

    let mut input = cluster(20);
    input.service_cidr = "10.100.0.0/16".into();
    assert!(apiserver_sans(&input, None).ips.contains(&ip("10.100.0.1")));
    // The internal URL's host is covered.
    assert!(
        apiserver_sans(&input, None)
            .dns
            .contains(&"demo-apiserver.tenants.svc".to_string())
    );
}

#[test]
fn controller_sans_cover_their_bind_addresses() {
    let input = loopback(20, 3);
    for s in [controller_manager_sans(&input), scheduler_sans(&input)] {
        for h in hosts(3) {
            assert!(s.ips.contains(&IpAddr::V4(h)));
        }
        assert!(s.ips.contains(&ip("127.0.0.1")));
        assert!(s.dns.contains(&"localhost".to_string()));
    }
}

#[test]
fn first_service_ip_of_cidrs() {
    assert_eq!(first_service_ip("10.96.0.0/12").unwrap(), ip("10.96.0.1"));
    assert_eq!(first_service_ip("10.96.5.7/12").unwrap(), ip("10.96.0.1"));
    assert_eq!(first_service_ip("172.20.0.0/16").unwrap(), ip("172.20.0.1"));
    assert_eq!(first_service_ip("fd00:10::/108").unwrap(), ip("fd00:10::1"));
    for bad in [
        "10.96.0.0",
        "10.96.0.0/33",
        "10.96.0.0/31",
        "x/12",
        "10.96.0.0/x",
        "",
    ] {
        let e = first_service_ip(bad).unwrap_err();
        assert!(e.to_string().contains("service_cidr"), "{e}");
    }
}

// ---------------------------------------------------------------- health

#[test]
fn health_endpoints_per_replica() {
    let input = loopback(20, 3)
        .with_replicas(Component::Etcd, 3)
        .with_replicas(Component::ApiServer, 2);
    let urls = |c| -> Vec<(String, bool)> {
        health_endpoints(c, &input)
            .into_iter()
            .map(|e| (e.url, e.scheme_https))
            .collect()
    };
    assert_eq!(
        urls(Component::Etcd),
        [
            ("http://127.64.3.1:2381/health".to_string(), false),
            ("http://127.64.3.2:2381/health".to_string(), false),
            ("http://127.64.3.3:2381/health".to_string(), false),
        ]
    );
    assert_eq!(
        urls(Component::ApiServer),
        [
            ("https://127.64.3.1:6443/readyz".to_string(), true),
            ("https://127.64.3.2:6443/readyz".to_string(), true),
        ]
    );
    assert_eq!(
        urls(Component::ControllerManager),
        [("https://127.64.3.1:10257/healthz".to_string(), true)]
    );
    assert_eq!(
        urls(Component::Scheduler),
        [("https://127.64.3.1:10259/healthz".to_string(), true)]
    );

    let input = cluster(20).with_replicas(Component::Etcd, 2);
    let etcd: Vec<String> = health_endpoints(Component::Etcd, &input)
        .into_iter()
        .map(|e| e.url)
        .collect();
    assert_eq!(
        etcd,
        [
            "http://demo-etcd-0.demo-etcd-peer.tenants.svc:2381/health",
            "http://demo-etcd-1.demo-etcd-peer.tenants.svc:2381/health"
        ]
    );
    assert_eq!(
        health_endpoints(Component::ApiServer, &input)[0].url,
        "https://demo-apiserver.tenants.svc:6443/readyz"
    );
    assert!(health_endpoints(Component::Scheduler, &input).is_empty());
}

// ---------------------------------------------------------------- determinism and hashes

#[test]
fn rendering_is_deterministic() {
    for input in every_input() {
        let a = serde_json::to_string(&serialize_all(&input)).unwrap();
        let b = serde_json::to_string(&serialize_all(&input.clone())).unwrap();
        assert_eq!(a, b);
    }
    // The order in which maps were filled does not matter.
    let mut x = loopback(28, 3);
    x.replicas.insert(Component::Scheduler, 2);
    x.replicas.insert(Component::Etcd, 3);
    let mut y = loopback(28, 3);
    y.replicas.insert(Component::Etcd, 3);
    y.replicas.insert(Component::Scheduler, 2);
    assert_eq!(
        serde_json::to_string(&serialize_all(&x)).unwrap(),
        serde_json::to_string(&serialize_all(&y)).unwrap()
    );
}

fn serialize_all(input: &RenderInput) -> Vec<serde_json::Value> {
    render_all(input)
        .unwrap()
        .into_iter()
        .map(|r| {
            serde_json::json!({
                "workload": r.workload_name,
                "replicas": r.replicas,
                "template": r.pod_template,
                "services": r.services,
                "secrets": r.secrets.iter().map(|p| p.suffix()).collect::<Vec<_>>(),
                "hash": template_hash(&r),
            })
        })
        .collect()
}

#[test]
fn template_hash_is_stable_and_tracks_changes() {
    let input = loopback(20, 3);
    let h = |c, i: &RenderInput| template_hash(&render(c, i).unwrap());
    let base = h(Component::Etcd, &input);
    assert_eq!(base.len(), 64);
    assert!(
        base.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    );
    assert_eq!(base, h(Component::Etcd, &input.clone()));

    // A new version changes every Kubernetes component; etcd changes with its paired release.
    let newer = loopback(21, 3);
    for c in [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ] {
        assert_ne!(h(c, &input), h(c, &newer), "{c:?}");
    }
    assert_eq!(etcd_version_for(&v(20)), etcd_version_for(&v(21)));
    assert_eq!(h(Component::Etcd, &input), h(Component::Etcd, &newer));
    assert_ne!(
        h(Component::Etcd, &input),
        h(Component::Etcd, &loopback(22, 3))
    );
    let patch = RenderInput {
        version: KubeVersion::new(1, 20, 3),
        ..input.clone()
    };
    assert_ne!(
        h(Component::ApiServer, &input),
        h(Component::ApiServer, &patch)
    );

    // etcd's replicas change its member list, and the API server's etcd servers.
    let three = input.clone().with_replicas(Component::Etcd, 3);
    assert_ne!(h(Component::Etcd, &input), h(Component::Etcd, &three));
    assert_ne!(
        h(Component::ApiServer, &input),
        h(Component::ApiServer, &three)
    );

    // A component's own replica count is not part of its template: scaling rolls nothing.
    let scaled = input.clone().with_replicas(Component::ApiServer, 3);
    assert_eq!(
        h(Component::ApiServer, &input),
        h(Component::ApiServer, &scaled)
    );
    assert_eq!(render(Component::ApiServer, &scaled).unwrap().replicas, 3);

    // Components differ from one another.
    let all: BTreeSet<String> = Component::ALL.iter().map(|c| h(*c, &input)).collect();
    assert_eq!(all.len(), 4);
}

// ---------------------------------------------------------------- validation

#[test]
fn invalid_inputs_are_reported_clearly() {
    let e = render(
        Component::Etcd,
        &loopback(20, 2).with_replicas(Component::Etcd, 3),
    )
    .unwrap_err();
    assert_eq!(
        e,
        RenderError::NotEnoughHosts {
            component: Component::Etcd,
            replicas: 3,
            hosts: 2
        }
    );
    assert!(e.to_string().contains("3 replicas"), "{e}");

    let case = |f: &dyn Fn(&mut RenderInput), field: &str| {
        let mut input = loopback(20, 1);
        f(&mut input);
        let e = render(Component::ApiServer, &input).unwrap_err();
        assert!(
            matches!(&e, RenderError::InvalidInput { field: got, .. } if got.starts_with(field)),
            "{field}: {e:?}"
        );
        assert!(
            e.to_string().starts_with(&format!("invalid {field}")),
            "{e}"
        );
    };
    case(&|i| i.cluster = "Demo".into(), "cluster");
    case(&|i| i.cluster = String::new(), "cluster");
    case(&|i| i.cluster = "a".repeat(40), "cluster");
    case(&|i| i.namespace = "-x".into(), "namespace");
    case(&|i| i.service_cidr = "10.96.0.0".into(), "service_cidr");
    case(
        &|i| i.cluster_domain = "Cluster..local".into(),
        "cluster_domain",
    );
    case(&|i| i.image_registry = " ".into(), "image_registry");
    case(
        &|i| {
            i.replicas.insert(Component::Scheduler, 0);
        },
        "replicas[scheduler]",
    );
    case(
        &|i| i.network = Network::Loopback { hosts: vec![] },
        "network",
    );
    case(
        &|i| {
            i.network = Network::Loopback {
                hosts: vec![Ipv4Addr::new(10, 0, 0, 1)],
            }
        },
        "network",
    );
    case(
        &|i| {
            i.network = Network::Loopback {
                hosts: vec![Ipv4Addr::new(127, 9, 9, 1), Ipv4Addr::new(127, 9, 9, 1)],
            }
        },
        "network",
    );

    let mut input = loopback(20, 1);
    input.version = KubeVersion::new(1, 19, 0);
    assert!(matches!(
        render(Component::Etcd, &input),
        Err(RenderError::UnsupportedVersion { .. })
    ));
}

// ---------------------------------------------------------------- the process runtime's view

/// What the process runtime does to a template: expand `$(VAR)` from POD_NAME/POD_IP and
/// replace mount paths with local directories.
fn as_process(r: &Rendered, replica: u32, host: Ipv4Addr) -> Vec<String> {
    let pod_name = format!("{}-{replica}", r.workload_name);
    let mut mounts: Vec<(String, String)> = container(r)
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.mount_path.clone(),
                format!("/state/{pod_name}/volumes/{}", m.name),
            )
        })
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.0.len()));
    args(r)
        .iter()
        .map(|a| {
            let mut a = a
                .replace("$(POD_NAME)", &pod_name)
                .replace("$(POD_IP)", &host.to_string());
            for (m, local) in &mounts {
                a = a.replace(&format!("{m}/"), &format!("{local}/"));
            }
            a
        })
        .collect()
}

#[test]
fn the_same_template_runs_as_processes() {
    let input = loopback(20, 3).with_replicas(Component::Etcd, 3);
    let etcd = render(Component::Etcd, &input).unwrap();
    let a = as_process(&etcd, 1, hosts(3)[1]);
    assert!(a.contains(&"--name=demo-etcd-1".to_string()));
    assert!(a.contains(&"--listen-client-urls=https://127.64.3.2:2379".to_string()));
    assert!(a.contains(&"--initial-advertise-peer-urls=https://127.64.3.2:2380".to_string()));
    assert!(a.contains(&"--data-dir=/state/demo-etcd-1/volumes/data/data".to_string()));
    assert!(a.contains(&"--cert-file=/state/demo-etcd-1/volumes/etcd-server/tls.crt".to_string()));
    // The member's own entry in --initial-cluster matches what it advertises.
    let initial = a
        .iter()
        .find_map(|x| x.strip_prefix("--initial-cluster="))
        .unwrap();
    assert!(initial.contains("demo-etcd-1=https://127.64.3.2:2380"));

    for r in render_all(&input).unwrap() {
        for arg in as_process(&r, 0, hosts(3)[0]) {
            assert!(!arg.contains("$("), "{arg}");
            assert!(!arg.contains("/etc/nestplane"), "{arg}");
            assert!(!arg.contains("/var/lib/etcd"), "{arg}");
        }
    }
}

#[test]
fn a_tenant_on_a_shared_datastore_keeps_to_its_prefix() {
    let mut input = loopback(20, 1);
    let own = render(Component::ApiServer, &input).unwrap();
    assert_eq!(flag(&own, "etcd-prefix"), None);
    input.external_etcd = Some(vec!["https://127.9.8.1:2379".into()]);
    input.datastore_prefix = Some("/nestplane/ns/demo/".into());
    let shared = render(Component::ApiServer, &input).unwrap();
    assert_eq!(
        flag(&shared, "etcd-prefix").as_deref(),
        Some("/nestplane/ns/demo/registry")
    );
    assert_eq!(
        flag(&shared, "etcd-compaction-interval").as_deref(),
        Some("0")
    );
    assert_eq!(
        flag(&shared, "etcd-servers").as_deref(),
        Some("https://127.9.8.1:2379")
    );
    // The datastore's etcd compacts itself, a tenant's own does not.
    let etcd = |auto: Option<&str>| {
        let mut i = loopback(20, 1);
        i.etcd_auto_compaction = auto.map(String::from);
        let r = render(Component::Etcd, &i).unwrap();
        (
            flag(&r, "auto-compaction-mode"),
            flag(&r, "auto-compaction-retention"),
        )
    };
    assert_eq!(etcd(None), (None, None));
    assert_eq!(
        etcd(Some("5m")),
        (Some("periodic".into()), Some("5m".into()))
    );
    // A prefix that could cover another tenant's is refused.
    input.datastore_prefix = Some("/nestplane/ns/demo".into());
    assert!(render(Component::ApiServer, &input).is_err());
}

#[test]
fn go_collects_more_often_in_the_kubernetes_components_only() {
    let gogc = |c: Component| {
        let r = render(c, &loopback(20, 1)).unwrap();
        container(&r)
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "GOGC")
            .and_then(|e| e.value.clone())
    };
    for c in [
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
    ] {
        assert_eq!(gogc(c).as_deref(), Some(GOGC), "{c:?}");
    }
    assert_eq!(gogc(Component::Etcd), None);
}
