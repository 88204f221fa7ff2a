//! HostedCluster and NodePool (seed 002) end to end: a hosted control plane, worker pools of
//! real nodes (containerd + kubelet + kube-proxy on this machine) that run real pods, scale
//! down with a drain, refuse a stranger's certificate request, and a teardown in order that
//! leaves nothing behind. Nothing here writes what a kubelet or controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

/// The node slots this test's nodes hold (`/run/nestplane/node-slots`), with their dirs.
fn slots_under(dir: &Path) -> Vec<(u8, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(nestplane_nodes::net::slots_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(n) = e.file_name().to_string_lossy().parse::<u8>() else {
            continue;
        };
        let claim = std::fs::read_to_string(e.path()).unwrap_or_default();
        if let Some((_, d)) = claim.trim().split_once(' ')
            && Path::new(d).starts_with(dir)
        {
            out.push((n, PathBuf::from(d)));
        }
    }
    out
}

/// A merge patch of NodePool `default/demo`.
fn patch_pool(kc: &Path, patch: &str) {
    kubectl_ok(
        kc,
        &["patch", "nodepool", "demo", "--type=merge", "-p", patch],
    );
}

/// The nodes of the Running `app=web` pods, one entry per pod.
fn running_web_pods_nodes(kc: &Path) -> String {
    kubectl_ok(
        kc,
        &[
            "get",
            "pods",
            "-l",
            "app=web",
            "--field-selector=status.phase=Running",
            "-o",
            "jsonpath={.items[*].spec.nodeName}",
        ],
    )
}

/// The certificate a TLS server at `addr` presents (PEM), read with `openssl s_client`.
fn served_certificate(addr: &str) -> Option<String> {
    let out = std::process::Command::new("openssl")
        .args(["s_client", "-connect", addr])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl not found: run scripts/install-deps.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    let begin = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text.find("-----END CERTIFICATE-----")? + "-----END CERTIFICATE-----".len();
    Some(format!("{}\n", &text[begin..end]))
}

const WEB: &str = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: default}\nspec:\n  replicas: 2\n  selector: {matchLabels: {app: web}}\n  template:\n    metadata: {labels: {app: web}}\n    spec:\n      affinity:\n        podAntiAffinity:\n          preferredDuringSchedulingIgnoredDuringExecution:\n          - weight: 100\n            podAffinityTerm: {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: web}}}\n      containers:\n      - name: web\n        image: docker.io/library/busybox:1.35\n        command: [sh, -c, 'mkdir -p /www && echo hello-from-$(hostname) > /www/index.html && exec httpd -f -p 8080 -h /www']\n---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  selector: {app: web}\n  ports: [{port: 80, targetPort: 8080}]\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: client, namespace: default}\nspec:\n  containers:\n  - {name: client, image: 'docker.io/library/busybox:1.35', command: [sleep, '3600']}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosted_cluster_with_a_two_node_pool_runs_pods_scales_down_and_tears_down_cleanly() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    env.install_cluster_crd();
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: demo, namespace: default}\nspec:\n  release: {version: 1.20.2}\n  initialNodes: 2\n");

    // Available, with its objects in seed 002's order; the initial NodePool's two nodes Ready.
    eventually(
        "the HostedCluster Available",
        Duration::from_secs(180),
        || (condition(&kc, &["hostedcluster", "demo"], "Available") == "True").then_some(()),
    );
    let infra = jsonpath(
        &kc,
        &["externalinfracluster", "demo", "-n", "default-demo"],
        "{.status.ready} {.spec.controlPlaneEndpoint.host}",
    );
    assert!(infra.starts_with("true "), "{infra}");
    let refs = jsonpath(
        &kc,
        &["cluster", "demo", "-n", "default-demo"],
        "{.spec.controlPlaneRef.kind}/{.spec.infrastructureRef.kind}",
    );
    assert_eq!(refs, "NestedControlPlane/ExternalInfraCluster");
    eventually("the NodePool Ready", Duration::from_secs(240), || {
        (condition(&kc, &["nodepool", "demo"], "Ready") == "True").then_some(())
    });
    let hosted = hosted_kubeconfig(&kc, "demo", env.state.path());
    use base64::Engine as _;
    let nodes = kubectl_ok(
        &hosted,
        &[
            "get",
            "nodes",
            "-l",
            "nestplane.io/nodepool=demo",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ],
    );
    let nodes: Vec<String> = nodes.split_whitespace().map(str::to_string).collect();
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    let approved = kubectl_ok(
        &hosted,
        &[
            "get",
            "csr",
            "-o",
            "jsonpath={.items[*].status.conditions[*].reason}",
        ],
    );
    assert!(approved.contains("NestplaneNodePool"), "{approved}");

    // Each kubelet serves with a certificate the cluster's CA issued for that node (its
    // serving request approved by nestplane), not one it signed itself.
    let ca = kube::config::Kubeconfig::read_from(&hosted)
        .unwrap()
        .clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .certificate_authority_data
        .clone()
        .unwrap();
    let ca = String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(ca.trim())
            .unwrap(),
    )
    .unwrap();
    for node in &nodes {
        let ip = jsonpath(
            &hosted,
            &["node", node],
            "{.status.addresses[?(@.type==\"InternalIP\")].address}",
        );
        let served = eventually(
            &format!("node {node} serving with the cluster's certificate"),
            Duration::from_secs(90),
            || {
                let pem = served_certificate(&format!("{}:10250", ip.trim()))?;
                nestplane_pki::verify_signed_by(&pem, &ca)
                    .unwrap_or(false)
                    .then_some(pem)
            },
        );
        let info = nestplane_pki::inspect(&served).unwrap();
        assert_eq!(info.subject_cn, format!("system:node:{node}"));
        assert!(info.server_auth);
        assert_eq!(
            info.ips,
            [ip.trim().parse::<std::net::IpAddr>().unwrap()],
            "{info:?}"
        );
    }
    let serving = kubectl_ok(
        &hosted,
        &[
            "get",
            "csr",
            "-o",
            "jsonpath={range .items[?(@.spec.signerName==\"kubernetes.io/kubelet-serving\")]}{.spec.username} {.status.conditions[0].reason}{\"\\n\"}{end}",
        ],
    );
    for node in &nodes {
        assert!(
            serving.contains(&format!("system:node:{node} NestplaneNodePool")),
            "{serving}"
        );
    }

    // Pods: one web pod per node, reached through a ClusterIP Service from another pod; a
    // pod lists the cluster's namespaces with its service-account token.
    kubectl_apply(&hosted, WEB);
    kubectl_ok(
        &hosted,
        &[
            "create",
            "clusterrolebinding",
            "default-view",
            "--clusterrole=view",
            "--serviceaccount=default:default",
        ],
    );
    eventually("web pods on both nodes", Duration::from_secs(120), || {
        let placed = running_web_pods_nodes(&hosted);
        let mut on: Vec<&str> = placed.split_whitespace().collect();
        on.sort();
        on.dedup();
        (on.len() == 2).then_some(())
    });
    eventually("the client runs", Duration::from_secs(60), || {
        (jsonpath(&hosted, &["pod", "client"], "{.status.phase}") == "Running").then_some(())
    });
    // Each web pod directly (pod to pod, across nodes), then both through the Service.
    let pods = kubectl_ok(
        &hosted,
        &[
            "get",
            "pods",
            "-l",
            "app=web",
            "-o",
            "jsonpath={range .items[*]}{.status.podIP} {.spec.nodeName}{\"\\n\"}{end}",
        ],
    );
    let client_node = jsonpath(&hosted, &["pod", "client"], "{.spec.nodeName}");
    for line in pods.lines() {
        let pod_ip = line.split_whitespace().next().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut last = String::new();
        let out = eventually(
            &format!("web pod {line} from the client on {client_node}"),
            Duration::from_secs(3600),
            || {
                if std::time::Instant::now() > deadline {
                    let wide = kubectl_ok(&hosted, &["get", "pods", "-o", "wide"]);
                    let logs = kubectl(&hosted, &["logs", "-l", "app=web", "--tail=5"]);
                    let ifs = kubectl(&hosted, &["exec", "client", "--", "ip", "addr"]);
                    let routes = kubectl(&hosted, &["exec", "client", "--", "ip", "route"]);
                    panic!(
                        "web pod {line} unreachable from the client on {client_node}: {last}\n{wide}\n{}{}\n{}\n{}",
                        String::from_utf8_lossy(&logs.stdout),
                        String::from_utf8_lossy(&logs.stderr),
                        String::from_utf8_lossy(&ifs.stdout),
                        String::from_utf8_lossy(&routes.stdout)
                    );
                }
                let out = kubectl(
                    &hosted,
                    &[
                        "exec",
                        "client",
                        "--",
                        "timeout",
                        "5",
                        "wget",
                        "-q",
                        "-O",
                        "-",
                        &format!("http://{pod_ip}:8080/"),
                    ],
                );
                let body = String::from_utf8_lossy(&out.stdout).trim().to_string();
                last = String::from_utf8_lossy(&out.stderr).into_owned();
                body.starts_with("hello-from-web").then_some(body)
            },
        );
        assert!(out.starts_with("hello-from-web"));
    }
    let ip = kubectl_ok(
        &hosted,
        &["get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"],
    );
    let mut seen = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while seen.len() < 2 {
        let out = kubectl(
            &hosted,
            &[
                "exec",
                "client",
                "--",
                "timeout",
                "5",
                "wget",
                "-q",
                "-O",
                "-",
                &format!("http://{}/", ip.trim()),
            ],
        );
        let body = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let last = String::from_utf8_lossy(&out.stderr).into_owned();
        if body.starts_with("hello-from-web") {
            seen.insert(body);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "through Service {ip}: saw {seen:?}; last error {last}"
        );
    }
    let listed = pod_calls_its_api(
        &hosted,
        "client",
        "/api/v1/namespaces",
        "\"kind\": \"NamespaceList\"",
    );
    assert!(listed.contains("kube-system"), "{listed}");

    // A stranger holding a valid bootstrap token that nestplane did not make (so the
    // cluster's bootstrap RBAC lets it ask for a kubelet client certificate) asks for one for
    // a plausible node name of this pool: nobody approves it.
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("k.pem");
    let csr = dir.path().join("r.pem");
    let ok = std::process::Command::new("openssl")
        .args([
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/O=system:nodes/CN=system:node:demo-zzzzz",
            "-keyout",
        ])
        .arg(&key)
        .arg("-out")
        .arg(&csr)
        .status()
        .expect("openssl not found: run scripts/install-deps.sh")
        .success();
    assert!(ok);
    kubectl_apply(
        &hosted,
        "apiVersion: v1\nkind: Secret\nmetadata: {name: bootstrap-token-strngr, namespace: kube-system}\ntype: bootstrap.kubernetes.io/token\nstringData:\n  token-id: strngr\n  token-secret: 0123456789abcdef\n  usage-bootstrap-authentication: 'true'\n",
    );
    let token = "strngr.0123456789abcdef".to_string();
    let request = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&csr).unwrap());
    // The stranger's kubeconfig: the cluster's address and CA, the stranger's token only.
    let mut kc_stranger = kube::config::Kubeconfig::read_from(&hosted).unwrap();
    for a in &mut kc_stranger.auth_infos {
        a.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.trim().to_string().into()),
            ..Default::default()
        });
    }
    let stranger = env.state.path().join("stranger.kubeconfig");
    std::fs::write(&stranger, serde_saphyr::to_string(&kc_stranger).unwrap()).unwrap();
    let whoami = kubectl(&stranger, &["get", "nodes"]);
    assert!(!whoami.status.success(), "the stranger is not an admin");
    let out = kubectl_stdin(
        &stranger,
        &["create", "-f", "-"],
        Some(&format!(
            "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata: {{name: stranger}}\nspec:\n  signerName: kubernetes.io/kube-apiserver-client-kubelet\n  usages: [digital signature, key encipherment, client auth]\n  request: {request}\n"
        )),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        jsonpath(&hosted, &["csr", "stranger"], "{.spec.username}"),
        "system:bootstrap:strngr",
        "the request came with the stranger's bootstrap token"
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    let verdict = jsonpath(
        &hosted,
        &["csr", "stranger"],
        "{.status.conditions[*].type}",
    );
    assert_eq!(verdict.trim(), "", "the stranger's request stays pending");

    // Scale down: one node is drained (its pod moves to the other), its Node goes. A
    // PodDisruptionBudget that needs both web pods holds the eviction until the pool's
    // drain timeout; then the pod is deleted.
    kubectl_apply(
        &hosted,
        "apiVersion: policy/v1beta1\nkind: PodDisruptionBudget\nmetadata: {name: web, namespace: default}\nspec:\n  minAvailable: 2\n  selector: {matchLabels: {app: web}}\n",
    );
    eventually("the budget sees both pods", Duration::from_secs(30), || {
        (jsonpath(&hosted, &["pdb", "web"], "{.status.currentHealthy}") == "2").then_some(())
    });
    patch_pool(&kc, r#"{"spec":{"nodeDrainTimeout":"15s"}}"#);
    kubectl_ok(&kc, &["scale", "nodepool", "demo", "--replicas", "1"]);
    eventually("one Node left", Duration::from_secs(180), || {
        let left = kubectl_ok(
            &hosted,
            &["get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"],
        );
        (left.split_whitespace().count() == 1).then_some(left)
    });
    let left = kubectl_ok(
        &hosted,
        &["get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"],
    );
    eventually(
        "both web pods on the remaining node",
        Duration::from_secs(120),
        || {
            let placed = running_web_pods_nodes(&hosted);
            let on: Vec<&str> = placed.split_whitespace().collect();
            (on.len() == 2 && on.iter().all(|n| *n == left.trim())).then_some(())
        },
    );
    eventually(
        "the NodePool reports one node",
        Duration::from_secs(60),
        || (jsonpath(&kc, &["nodepool", "demo"], "{.status.replicas}") == "1").then_some(()),
    );
    let events = events_for(&kc, "default", "demo");
    assert!(events.contains("DrainingNode"), "{events}");
    assert!(
        events.contains("DrainBlocked") && events.contains("PodDisruptionBudget"),
        "{events}"
    );
    assert!(events.contains("Warning DrainTimedOut"), "{events}");
    kubectl_ok(&hosted, &["delete", "pdb", "web"]);

    // The hosted cluster's join configuration is kept: a deleted binding comes back.
    kubectl_ok(
        &hosted,
        &["delete", "clusterrolebinding", "nestplane:node-proxier"],
    );
    eventually(
        "the node-proxier binding back",
        Duration::from_secs(90),
        || {
            kubectl(
                &hosted,
                &["get", "clusterrolebinding", "nestplane:node-proxier"],
            )
            .status
            .success()
            .then_some(())
        },
    );

    // A new node configuration is a new node: the pool rolls (a new node first, then the old
    // one drained), and the label, the taint and the kubelet's pod limit reach the Node.
    patch_pool(
        &kc,
        r#"{"spec":{"nodeLabels":{"tier":"web"},"maxPods":30,"taints":[{"key":"dedicated","value":"web","effect":"PreferNoSchedule"}]}}"#,
    );
    let mut updating = false;
    let rolled = eventually(
        "the pool rolled to a labelled node",
        Duration::from_secs(240),
        || {
            updating |= condition(&kc, &["nodepool", "demo"], "UpdatingConfig") == "True";
            let names = kubectl_ok(
                &hosted,
                &[
                    "get",
                    "nodes",
                    "-l",
                    "tier=web",
                    "-o",
                    "jsonpath={.items[*].metadata.name}",
                ],
            );
            let all = kubectl_ok(
                &hosted,
                &["get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"],
            );
            let ready = condition(&kc, &["nodepool", "demo"], "Ready") == "True";
            (ready && all.split_whitespace().count() == 1 && names.trim() == all.trim())
                .then_some(all)
        },
    );
    assert!(updating, "UpdatingConfig was reported during the rollout");
    assert_ne!(rolled.trim(), left.trim(), "the node was replaced");
    let node = |path: &str| {
        kubectl_ok(
            &hosted,
            &[
                "get",
                "node",
                rolled.trim(),
                "-o",
                &format!("jsonpath={path}"),
            ],
        )
    };
    assert_eq!(
        node("{.status.capacity.pods}").trim(),
        "30",
        "maxPods reached the kubelet"
    );
    assert_eq!(
        node("{.spec.taints[?(@.key==\"dedicated\")].value}:{.spec.taints[?(@.key==\"dedicated\")].effect}").trim(),
        "web:PreferNoSchedule",
        "the taint reached the Node"
    );
    eventually("web pods on the new node", Duration::from_secs(120), || {
        let placed = running_web_pods_nodes(&hosted);
        let on: Vec<&str> = placed.split_whitespace().collect();
        (on.len() == 2 && on.iter().all(|n| *n == rolled.trim())).then_some(())
    });

    // Teardown in order, each step in status, and nothing left on the machine.
    let nodes_dir = env.state.path().join("nodes");
    let slots = slots_under(&nodes_dir);
    assert_eq!(slots.len(), 1, "{slots:?}");
    let out = kubectl(&kc, &["delete", "hostedcluster", "demo", "--wait=false"]);
    assert!(out.status.success());
    // The steps as status showed them while polling (each once, in the order seen).
    let mut steps: Vec<String> = Vec::new();
    eventually("the HostedCluster gone", Duration::from_secs(240), || {
        let r = jsonpath(
            &kc,
            &["hostedcluster", "demo"],
            "{.status.conditions[?(@.type==\"Deleting\")].reason}",
        );
        let r = r.trim();
        if !r.is_empty() && steps.last().map(String::as_str) != Some(r) {
            steps.push(r.to_string());
        }
        (!kubectl(&kc, &["get", "hostedcluster", "demo"])
            .status
            .success())
        .then_some(())
    });
    // Every step happened (each emits an Event once), and what status showed came in order.
    const ORDER: [&str; 4] = [
        "DeletingNodePools",
        "DeletingCluster",
        "DeletingControlPlane",
        "DeletingNamespace",
    ];
    let events = events_for(&kc, "default", "demo");
    for step in ORDER {
        assert!(
            events.contains(&format!("Normal {step}:")),
            "{step}: {events}"
        );
    }
    let rank = |s: &String| ORDER.iter().position(|o| o == s);
    let ranks: Vec<_> = steps.iter().map(rank).collect();
    assert!(
        ranks.iter().all(Option::is_some) && ranks.windows(2).all(|w| w[0] < w[1]),
        "the Deleting steps in order: {steps:?}"
    );
    assert_eq!(
        steps.first().map(String::as_str),
        Some("DeletingNodePools"),
        "the pool (a node to drain) is the first step: {steps:?}"
    );
    assert!(
        !kubectl(&kc, &["get", "namespace", "default-demo"])
            .status
            .success(),
        "the namespace is gone"
    );
    assert!(!kubectl(&kc, &["get", "nodepool", "demo"]).status.success());
    for (n, d) in slots {
        let left = node_leftovers(n, &d);
        assert!(left.is_empty(), "{left:?}");
    }
    assert!(slots_under(&nodes_dir).is_empty());
    assert!(!env.operator.as_ref().unwrap().is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hosted_input_gets_a_reason_and_an_event_and_touches_nothing() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    // Overlapping networks.
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: overlap, namespace: default}\nspec:\n  release: {version: 1.20.2}\n  networking:\n    clusterNetwork: [{cidr: 10.244.0.0/16}]\n    serviceNetwork: [{cidr: 10.244.128.0/20}]\n");
    eventually("ValidConfiguration False", Duration::from_secs(30), || {
        let m = jsonpath(
            &kc,
            &["hostedcluster", "overlap"],
            "{.status.conditions[?(@.type==\"ValidConfiguration\")].message}",
        );
        m.contains("overlap").then_some(())
    });
    assert!(events_for(&kc, "default", "overlap").contains("InvalidConfiguration"));
    assert!(
        !kubectl(&kc, &["get", "namespace", "default-overlap"])
            .status
            .success(),
        "nothing created"
    );
    // A NodePool for a cluster that does not exist.
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: NodePool\nmetadata: {name: orphan, namespace: default}\nspec: {clusterName: nowhere, replicas: 1}\n");
    eventually("HostedClusterNotFound", Duration::from_secs(30), || {
        (jsonpath(
            &kc,
            &["nodepool", "orphan"],
            "{.status.conditions[?(@.type==\"Ready\")].reason}",
        ) == "HostedClusterNotFound")
            .then_some(())
    });
    assert!(events_for(&kc, "default", "orphan").contains("HostedClusterNotFound"));
    // A NodePool newer than its control plane (the cluster itself is valid, and left alone).
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: ok, namespace: default}\nspec:\n  release: {version: 1.20.2}\n---\napiVersion: nestplane.io/v1alpha1\nkind: NodePool\nmetadata: {name: newer, namespace: default}\nspec: {clusterName: ok, replicas: 1, release: {version: 1.21.0}}\n");
    eventually("UnsupportedSkew", Duration::from_secs(30), || {
        (condition(&kc, &["nodepool", "newer"], "SupportedVersionSkew") == "False").then_some(())
    });
    assert!(events_for(&kc, "default", "newer").contains("newer than its control plane"));
    assert_eq!(
        jsonpath(&kc, &["nodepool", "newer"], "{.status.replicas}"),
        "0"
    );
    // A version that would leave a pool's kubelets three minors behind is held before the
    // control plane takes a step of it, naming the pool; asked back, it is released.
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: NodePool\nmetadata: {name: old, namespace: default}\nspec: {clusterName: ok, replicas: 0, release: {version: 1.20.2}}\n");
    eventually("the control plane exists", Duration::from_secs(30), || {
        (jsonpath(&kc, &["ncp", "ok", "-n", "default-ok"], "{.spec.version}") == "v1.20.2")
            .then_some(())
    });
    kubectl_ok(
        &kc,
        &[
            "patch",
            "hostedcluster",
            "ok",
            "--type=merge",
            "-p",
            r#"{"spec":{"release":{"version":"1.23.0"}}}"#,
        ],
    );
    let held = eventually("the pool holds the change", Duration::from_secs(30), || {
        let c = jsonpath(
            &kc,
            &["hostedcluster", "ok"],
            "{.status.conditions[?(@.type==\"ClusterVersionUpgradeable\")].status}|{.status.conditions[?(@.type==\"ClusterVersionUpgradeable\")].message}|{.status.conditions[?(@.type==\"Progressing\")].status}|{.status.conditions[?(@.type==\"Progressing\")].reason}",
        );
        c.starts_with("False|").then_some(c)
    });
    assert!(
        held.contains("NodePool old runs v1.20.2") && held.ends_with("|False|NodePoolVersionSkew"),
        "{held}"
    );
    assert!(events_for(&kc, "default", "ok").contains("Warning NodePoolVersionSkew"));
    assert_eq!(
        jsonpath(&kc, &["ncp", "ok", "-n", "default-ok"], "{.spec.version}"),
        "v1.20.2",
        "the control plane was given the held version"
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "hostedcluster",
            "ok",
            "--type=merge",
            "-p",
            r#"{"spec":{"release":{"version":"1.20.2"}}}"#,
        ],
    );
    eventually("released", Duration::from_secs(30), || {
        (condition(&kc, &["hostedcluster", "ok"], "ClusterVersionUpgradeable") == "True")
            .then_some(())
    });
    // Deleting the pools and the clusters works though nothing was made.
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nodepool",
            "orphan",
            "newer",
            "old",
            "--timeout=60s",
        ],
    );
    kubectl_ok(
        &kc,
        &["delete", "hostedcluster", "overlap", "ok", "--timeout=120s"],
    );
    assert!(!env.operator.as_ref().unwrap().is_finished());
}
