//! Rotations of a hosted cluster's credentials, one after the other on one cluster (2 API
//! server replicas behind the gateway, a real node, a running pod):
//!
//! - the service-account key (`nestplane rotate sa-key`): nothing issued before is refused
//!   until it is completed, the pod's token Secret is re-signed in place, a client through the
//!   gateway with the kubeconfig from before never fails, and after completion what the old
//!   key signed is refused;
//! - then the cluster CA (`nestplane rotate ca`): kubeconfigs from before keep working, pods
//!   are given both CAs, the API servers' handshakes show both, the pool's node is given both
//!   and a kubelet certificate of the new CA; completion waits while the cluster has a node
//!   nestplane does not run, or a machine may be joining it (a bootstrap token), and says so;
//!   once neither is left it completes with the node in place, and what the old CA signed is
//!   refused.
//!
//! Nothing here writes what a kubelet or controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

/// The pod calls its API every second with its projected token (minted before the
/// rotation) and with its legacy token Secret's, and says what each call got.
const CALLER: &str = r#"apiVersion: v1
kind: Pod
metadata: {name: caller, namespace: default}
spec:
  containers:
  - name: caller
    image: docker.io/library/busybox:1.35
    command:
    - sh
    - -c
    - |
      while true; do
        for t in projected legacy; do
          if [ $t = projected ]; then f=/var/run/secrets/tokens/api; else f=/var/run/secrets/kubernetes.io/serviceaccount/token; fi
          if out=$(wget -q -O /dev/null --no-check-certificate --header "Authorization: Bearer $(cat $f)" https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/default/pods/caller 2>&1); then
            echo "$(date +%s) $t ok"
          else
            echo "$(date +%s) $t fail $(cut -d. -f1 $f) $out"
          fi
        done
        sleep 1
      done
    volumeMounts:
    - {name: tokens, mountPath: /var/run/secrets/tokens}
  volumes:
  - name: tokens
    projected:
      sources:
      - serviceAccountToken: {path: api, expirationSeconds: 3600}
"#;

fn rotation(kc: &Path) -> String {
    jsonpath(
        kc,
        &["ncp", "rot", "-n", "default-rot"],
        "{.status.rotations[?(@.target==\"sa-key\")].phase}|{.status.rotations[?(@.target==\"sa-key\")].keyId}|{.status.rotations[?(@.target==\"sa-key\")].previousKeyId}",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_service_account_key_then_the_ca_refuses_nothing_from_before_until_each_completes()
 {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let mut env = Env::start(false).await;
    env.start_operator_with_gateway();
    env.install_cluster_crd();
    let kc = env.kubeconfig().to_path_buf();
    let dir = env.state.path().to_path_buf();

    // Two API server replicas before any node joins (its proxy tries each of them).
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: rot, namespace: default}\nspec:\n  release: {version: 1.20.2}\n");
    eventually("the control plane exists", Duration::from_secs(60), || {
        (jsonpath(
            &kc,
            &["ncp", "rot", "-n", "default-rot"],
            "{.metadata.name}",
        ) == "rot")
            .then_some(())
    });
    kubectl_ok(
        &kc,
        &[
            "patch",
            "ncp",
            "rot",
            "-n",
            "default-rot",
            "--type=merge",
            "-p",
            r#"{"spec":{"replicas":2}}"#,
        ],
    );
    eventually(
        "2 API servers and Available",
        Duration::from_secs(240),
        || {
            (condition(&kc, &["hostedcluster", "rot"], "Available") == "True"
                && jsonpath(
                    &kc,
                    &["nestedapiserver", "rot-apiserver", "-n", "default-rot"],
                    "{.status.readyReplicas}",
                ) == "2")
                .then_some(())
        },
    );
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: NodePool\nmetadata: {name: rot, namespace: default}\nspec: {clusterName: rot, replicas: 1}\n");
    eventually("the NodePool Ready", Duration::from_secs(240), || {
        (condition(&kc, &["nodepool", "rot"], "Ready") == "True").then_some(())
    });
    let hosted = hosted_kubeconfig(&kc, "rot", &dir);
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
    kubectl_apply(&hosted, CALLER);
    eventually("the pod calls its API", Duration::from_secs(120), || {
        let logs =
            String::from_utf8_lossy(&kubectl(&hosted, &["logs", "caller"]).stdout).to_string();
        (logs.contains("projected ok") && logs.contains("legacy ok")).then_some(())
    });
    let before = request_token(&hosted, &dir);
    assert!(authenticates(&hosted, &before, &dir));
    let legacy_kid = || {
        let token = kubectl_exec_ok(
            &hosted,
            &[
                "caller",
                "--",
                "cat",
                "/var/run/secrets/kubernetes.io/serviceaccount/token",
            ],
        );
        nestplane_pki::token_key_id(&token).expect("the legacy token names its key")
    };
    let old_kid = legacy_kid();
    assert_eq!(
        nestplane_pki::token_key_id(&before).as_deref(),
        Some(old_kid.as_str())
    );

    // A client asks through the gateway all along, with a kubeconfig from before
    // (`nestplane kubeconfig --gateway`: the gateway's address, the cluster's name there).
    let out = nestplane()
        .args(["kubeconfig", "rot", "-n", "default", "--gateway"])
        .args(["--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gateway_kc = dir.join("rot-gateway.kubeconfig");
    std::fs::write(&gateway_kc, &out.stdout).unwrap();
    let through = kube::config::Kubeconfig::read_from(&gateway_kc)
        .unwrap()
        .clusters[0]
        .cluster
        .clone()
        .unwrap();
    assert_eq!(
        format!(
            "{} {}",
            through.server.unwrap_or_default(),
            through.tls_server_name.unwrap_or_default()
        ),
        jsonpath(
            &kc,
            &["ncp", "rot", "-n", "default-rot"],
            "{.status.gateway.server} {.status.gateway.serverName}",
        )
    );
    const ASK: &[&str] = &[
        "--request-timeout=20s",
        "get",
        "ns",
        "default",
        "-o",
        "name",
    ];
    let client = Asking::start(&gateway_kc, ASK, Duration::ZERO);
    let pids_before: Vec<Option<u32>> = (0..2)
        .map(|i| env.pid("default-rot", "rot", "apiserver", i))
        .collect();

    // Start: the CLI waits until the new key signs everywhere and tokens are re-signed.
    let epoch = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };
    let asked_at = epoch();
    let asked = Instant::now();
    let out = nestplane()
        .args([
            "rotate",
            "sa-key",
            "rot",
            "-n",
            "default",
            "--timeout",
            "300",
        ])
        .args(["--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("rotation: asked → Started in {:?}", asked.elapsed());
    let started_at = epoch();
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        said.contains("Trusting") && said.contains("Started"),
        "{said}"
    );
    let started = rotation(&kc);
    let parts: Vec<&str> = started.split('|').collect();
    assert_eq!(parts[0], "Started", "{started}");
    let new_kid = parts[1].to_string();
    assert_eq!(parts[2], old_kid, "the old key is still trusted: {started}");
    assert_ne!(new_kid, old_kid);
    // Each API server replica was replaced (the keys are read at start).
    for (i, pid) in pids_before.iter().enumerate() {
        assert_ne!(
            env.pid("default-rot", "rot", "apiserver", i),
            *pid,
            "replica {i}"
        );
    }
    // What the old key signed still authenticates; what is minted now is the new key's.
    assert!(authenticates(&hosted, &before, &dir));
    let after = request_token(&hosted, &dir);
    assert_eq!(
        nestplane_pki::token_key_id(&after).as_deref(),
        Some(new_kid.as_str())
    );
    assert!(authenticates(&hosted, &after, &dir));
    // Nothing the user holds changed: the pod's legacy token Secret is as it was.
    let secret_token = || {
        let token = kubectl_ok(
            &hosted,
            &[
                "get",
                "secret",
                "-n",
                "default",
                "--field-selector",
                "type=kubernetes.io/service-account-token",
                "-o",
                "jsonpath={.items[0].data.token}",
            ],
        );
        use base64::Engine as _;
        let token = base64::engine::general_purpose::STANDARD
            .decode(token.trim())
            .unwrap_or_default();
        String::from_utf8_lossy(&token).into_owned()
    };
    assert_eq!(
        nestplane_pki::token_key_id(&secret_token()).as_deref(),
        Some(old_kid.as_str())
    );
    assert_eq!(legacy_kid(), old_kid);
    let events = events_for(&kc, "default-rot", "rot");
    assert!(events.contains("RotationStarted"), "{events}");

    // Complete: only the new key verifies.
    let completing = Instant::now();
    let out = nestplane()
        .args(["rotate", "sa-key", "rot", "--complete", "--timeout", "300"])
        .args(["--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "rotation: --complete → Completed in {:?}",
        completing.elapsed()
    );
    let done = rotation(&kc);
    assert_eq!(done, format!("Completed|{new_kid}|"));
    // The pod's token Secret was re-signed in place (by the cluster's tokens controller) before
    // the old key went, and the pod has the new token (nestplane had its kubelet sync it).
    assert_eq!(
        nestplane_pki::token_key_id(&secret_token()).as_deref(),
        Some(new_kid.as_str())
    );
    eventually(
        "the pod has its re-signed token",
        Duration::from_secs(60),
        || (legacy_kid() == new_kid).then_some(()),
    );
    client.stop_all_answered("rotation: through the gateway", 10);

    // The old key's token is refused; the new ones are not.
    assert!(!authenticates(&hosted, &before, &dir));
    assert!(authenticates(&hosted, &after, &dir));
    assert!(events_for(&kc, "default-rot", "rot").contains("RotationCompleted"));
    // The HostedCluster tells the same story.
    eventually(
        "the HostedCluster's rotations",
        Duration::from_secs(30),
        || {
            (jsonpath(
                &kc,
                &["hostedcluster", "rot"],
                "{.status.rotations[?(@.target==\"sa-key\")].phase}",
            ) == "Completed")
                .then_some(())
        },
    );

    // The pod: neither token was refused until completion; its legacy token (re-signed) works
    // after it; its projected token from before is refused after it.
    let logs = String::from_utf8_lossy(&kubectl(&hosted, &["logs", "caller"]).stdout).to_string();
    let completed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - completing.elapsed().as_secs();
    eprintln!(
        "rotation: asked at {asked_at}, Started at {started_at}, completion asked at {completed_at}"
    );
    assert!(
        jsonpath(&hosted, &["pod", "caller"], "{.metadata.annotations}")
            .contains("nestplane.io/service-account-token-resigned"),
        "the pod was told"
    );
    // Before completion was asked for, neither token was ever refused. After it, the pod's
    // old copy of its legacy token is refused from its Secret's re-signing until its kubelet
    // wrote the new one (the API server accepts a legacy token only while it equals its
    // Secret's): those calls are counted.
    let mut calls = std::collections::BTreeMap::<&str, (u32, u32)>::new();
    let mut window = 0;
    let mut unanswered = Vec::new();
    for line in logs.lines() {
        let mut w = line.split_whitespace();
        let (Some(at), Some(which), Some(result)) = (w.next(), w.next(), w.next()) else {
            continue;
        };
        let at: u64 = at.parse().unwrap_or(0);
        if at >= completed_at {
            if which == "legacy" && line.contains("401") {
                window += 1;
            }
            continue;
        }
        let c = calls.entry(which).or_default();
        if result == "ok" {
            c.0 += 1;
            continue;
        }
        c.1 += 1;
        assert!(
            !line.contains("401"),
            "a token was refused before completion: {line}\n{logs}"
        );
        unanswered.push(line);
    }
    eprintln!(
        "rotation: the pod's calls before completion (ok, not ok): {calls:?}, not answered: {unanswered:?}; its legacy token refused after completion until its kubelet wrote the re-signed one: {window} call(s)"
    );
    eventually(
        "the pod's legacy token after completion",
        Duration::from_secs(30),
        || {
            let logs = String::from_utf8_lossy(
                &kubectl(&hosted, &["logs", "--since=5s", "caller"]).stdout,
            )
            .to_string();
            (logs.contains("legacy ok") && logs.contains("projected fail")).then_some(())
        },
    );

    // Then the cluster CA, on the same cluster.
    rotate_the_ca_of_a_cluster_with_nodes(&env, &gateway_kc).await;

    // Torn down: the pool's node leaves nothing on the machine (its slot is free again).
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nodepool",
            "rot",
            "--ignore-not-found",
            "--timeout=240s",
        ],
    );
    kubectl_ok(&kc, &["delete", "hostedcluster", "rot", "--timeout=240s"]);
    let nodes = env.state.path().join("nodes");
    let claimed: Vec<String> = std::fs::read_dir(nestplane_nodes::net::slots_dir())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .filter(|claim| claim.contains(nodes.to_str().unwrap()))
        .collect();
    assert!(claimed.is_empty(), "node slots still held: {claimed:?}");
}

/// `phase|keyId|previousKeyId` of the cluster CA rotation of control plane `ns/name`.
fn ca_rotation(kc: &Path, ns: &str, name: &str) -> String {
    jsonpath(
        kc,
        &["ncp", name, "-n", ns],
        "{.status.rotations[?(@.target==\"ca\")].phase}|{.status.rotations[?(@.target==\"ca\")].keyId}|{.status.rotations[?(@.target==\"ca\")].previousKeyId}",
    )
}

/// Waits until the CA rotation of control plane `ns/name` says its completion is held by
/// `what` (its message names `needle`), and checks it is still `Started`.
fn held_by(kc: &Path, ns: &str, name: &str, what: &str, needle: &str, secs: u64) {
    let held = eventually(
        &format!("completion held by {what}"),
        Duration::from_secs(secs),
        || {
            let m = jsonpath(
                kc,
                &["ncp", name, "-n", ns],
                "{.status.rotations[?(@.target==\"ca\")].message}",
            );
            m.contains(needle).then_some(m)
        },
    );
    eprintln!("CA rotation: {held}");
    assert!(ca_rotation(kc, ns, name).starts_with("Started|"));
}

/// The certificates of a PEM bundle, by fingerprint.
fn ca_ids(pem: &str) -> Vec<String> {
    nestplane_pki::certificates(pem)
        .unwrap()
        .iter()
        .map(|c| nestplane_pki::certificate_id(c).unwrap())
        .collect()
}

/// What the server of `kubeconfig` presents, as the CA that signed it verifies: the issuer's
/// fingerprint among `cas`.
fn serving_issuer(env: &Env, ns: &str, name: &str, cas: &[String]) -> Option<String> {
    let _ = env;
    let secret = kubectl_ok(
        env.kubeconfig(),
        &[
            "get",
            "secret",
            "-n",
            ns,
            &format!("{name}-apiserver"),
            "-o",
            "jsonpath={.data.tls\\.crt}",
        ],
    );
    use base64::Engine as _;
    let cert = String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(secret.trim())
            .unwrap(),
    )
    .unwrap();
    cas.iter()
        .find(|ca| nestplane_pki::verify_signed_by(&cert, ca).unwrap())
        .map(|ca| nestplane_pki::certificate_id(ca).unwrap())
}

/// What the API server replicas of control plane `default-rot/rot` present in their TLS
/// handshakes: per replica, the CAs they ask client certificates of (by fingerprint, among
/// `cas`, or "other") and the fingerprint of the CA that signed their certificate.
async fn handshakes(env: &Env, cas: &[String]) -> Vec<(Vec<String>, Option<String>)> {
    // The replicas' addresses, `127.a.b.1` on (the control plane's endpoint is the gateway's).
    let first = first_replica(env.kubeconfig(), "default-rot", "rot");
    let mut out = Vec::new();
    for i in 0..2u8 {
        let o = first.octets();
        let addr = std::net::SocketAddr::from(([o[0], o[1], o[2], o[3] + i], 6443));
        let p = nestplane_operator::handshake::presented(addr, Duration::from_secs(5))
            .await
            .unwrap();
        let named = p
            .client_cas
            .iter()
            .map(|subject| {
                cas.iter()
                    .find(|ca| nestplane_pki::subjects(ca).unwrap()[0] == *subject)
                    .map(|ca| nestplane_pki::certificate_id(ca).unwrap())
                    .unwrap_or_else(|| "other".into())
            })
            .collect();
        use base64::Engine as _;
        let pem = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            base64::engine::general_purpose::STANDARD.encode(&p.certificate)
        );
        let issuer = cas
            .iter()
            .find(|ca| nestplane_pki::verify_signed_by(&pem, ca).unwrap())
            .map(|ca| nestplane_pki::certificate_id(ca).unwrap());
        out.push((named, issuer));
    }
    out
}

/// The cluster CA of HostedCluster `default/rot` (control plane `default-rot/rot`, a node, 2
/// API server replicas) rotated: kubeconfigs from before (direct, and `gateway_kc` through
/// the gateway) work all along the start; the pool's node follows the CA without being
/// replaced; completion waits while the cluster has a node nestplane does not run, or a
/// machine may be joining it, and goes on once neither is left; then what the old CA signed
/// is refused, and the node, trusting the new CA alone, still serves logs and exec.
async fn rotate_the_ca_of_a_cluster_with_nodes(env: &Env, gateway_kc: &Path) {
    let kc = env.kubeconfig().to_path_buf();
    let dir = env.state.path().to_path_buf();
    let (ns, hc) = ("default-rot", "rot");
    let before = dir.join("before-ca.kubeconfig");
    std::fs::rename(env.tenant_kubeconfig(ns, hc).await, &before).unwrap();
    kubectl_ok(&before, &["get", "ns", "default"]);
    let ca_secret = |env: &Env| {
        let v = kubectl_ok(
            env.kubeconfig(),
            &[
                "get",
                "secret",
                "-n",
                ns,
                "rot-ca",
                "-o",
                "jsonpath={.data.tls\\.crt}",
            ],
        );
        use base64::Engine as _;
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(v.trim())
                .unwrap(),
        )
        .unwrap()
    };
    let old_ca = ca_secret(env);
    let old_id = ca_ids(&old_ca)[0].clone();

    // Clients with kubeconfigs from before ask all along the start: one at the first API
    // server replica's own address, one through the gateway (the control plane's endpoint).
    let at_replica_kc = dir.join("before-ca-replica.kubeconfig");
    kubeconfig_at(
        &before,
        &format!("https://{}:6443", first_replica(&kc, ns, hc)),
        &at_replica_kc,
    );
    const ASK: &[&str] = &["--request-timeout=20s", "get", "ns", "default"];
    let direct = Asking::start(&at_replica_kc, ASK, Duration::from_millis(200));
    let through = Asking::start(gateway_kc, ASK, Duration::from_millis(200));
    let asked = Instant::now();
    let out = nestplane()
        .args(["rotate", "ca", "rot", "-n", "default", "--timeout", "400"])
        .args(["--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        env.tenant_logs(ns, hc)
    );
    let said = String::from_utf8_lossy(&out.stderr).to_string();
    eprintln!(
        "CA rotation: asked → Started in {:?}:\n{said}",
        asked.elapsed()
    );
    assert!(
        said.contains("Trusting") && said.contains("Signing") && said.contains("Started"),
        "{said}"
    );
    let started = ca_rotation(&kc, ns, hc);
    let parts: Vec<&str> = started.split('|').collect();
    assert_eq!(parts[0], "Started", "{started}");
    let new_id = parts[1].to_string();
    assert_eq!(parts[2], old_id, "the old CA is still trusted: {started}");
    assert_ne!(new_id, old_id);
    // Both CAs are trusted, the new one first (it signs).
    let bundle = ca_secret(env);
    assert_eq!(ca_ids(&bundle), vec![new_id.clone(), old_id.clone()]);
    let cas = nestplane_pki::certificates(&bundle).unwrap();
    // Each API server replica asks client certificates of both (and of the front-proxy CA),
    // and still presents what the old CA signed.
    for (i, (asks, issuer)) in handshakes(env, &cas).await.into_iter().enumerate() {
        let mut asks = asks;
        asks.sort();
        let mut want = vec![new_id.clone(), old_id.clone(), "other".to_string()];
        want.sort();
        assert_eq!(asks, want, "replica {i}");
        assert_eq!(issuer.as_deref(), Some(old_id.as_str()), "replica {i}");
    }
    // The published kubeconfig trusts both and holds a certificate the new CA signed; the
    // API server still presents what the old CA signed (a client trusting only it verifies).
    let now = env.tenant_kubeconfig(ns, hc).await;
    let kcfg = kube::config::Kubeconfig::read_from(&now).unwrap();
    use base64::Engine as _;
    let b64 = |s: &str| {
        String::from_utf8(base64::engine::general_purpose::STANDARD.decode(s).unwrap()).unwrap()
    };
    let trusted = b64(kcfg.clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .certificate_authority_data
        .as_deref()
        .unwrap());
    assert_eq!(ca_ids(&trusted), vec![new_id.clone(), old_id.clone()]);
    let client_cert = b64(kcfg.auth_infos[0]
        .auth_info
        .as_ref()
        .unwrap()
        .client_certificate_data
        .as_deref()
        .unwrap());
    assert!(nestplane_pki::verify_signed_by(&client_cert, &cas[0]).unwrap());
    assert_eq!(
        serving_issuer(env, ns, hc, &cas).as_deref(),
        Some(old_id.as_str())
    );
    kubectl_ok(&now, &["get", "ns", "default"]);
    // The HostedCluster's admin kubeconfig follows.
    eventually(
        "the HostedCluster's kubeconfig trusts both CAs",
        Duration::from_secs(60),
        || {
            let hosted = hosted_kubeconfig(&kc, hc, &dir);
            let kcfg = kube::config::Kubeconfig::read_from(&hosted).ok()?;
            let trusted = b64(kcfg.clusters[0]
                .cluster
                .as_ref()?
                .certificate_authority_data
                .as_deref()?);
            (ca_ids(&trusted) == vec![new_id.clone(), old_id.clone()]).then_some(())
        },
    );
    // Pods see both CAs: the controller manager (signing with the new CA, a file of one
    // certificate) runs and publishes kube-root-ca.crt, in a namespace made now too.
    kubectl_ok(&now, &["create", "ns", "fresh"]);
    for n in ["default", "fresh"] {
        eventually(
            &format!("kube-root-ca.crt in {n} holds both CAs"),
            Duration::from_secs(60),
            || {
                let out = kubectl(
                    &now,
                    &[
                        "get",
                        "cm",
                        "kube-root-ca.crt",
                        "-n",
                        n,
                        "-o",
                        "jsonpath={.data.ca\\.crt}",
                    ],
                );
                let root = String::from_utf8_lossy(&out.stdout).to_string();
                (!root.is_empty() && ca_ids(&root) == vec![new_id.clone(), old_id.clone()])
                    .then_some(())
            },
        );
    }
    kubectl_ok(&before, &["get", "ns", "default"]);
    direct.stop_all_answered("CA rotation start, with the kubeconfig from before", 20);
    through.stop_all_answered("CA rotation start, through the gateway", 20);

    // The pool's node follows the CA without being replaced: its kubelet trusts both and
    // holds a client certificate the new CA signed (read from the node's files).
    let node = jsonpath(&now, &["nodes"], "{.items[0].metadata.name}");
    let node_dir = dir.join("nodes/default/rot").join(&node);
    let node_trust = || {
        let ca = std::fs::read_to_string(node_dir.join("ca.crt")).unwrap_or_default();
        let client =
            std::fs::read_to_string(node_dir.join("kubelet/pki/kubelet-client-current.pem"))
                .unwrap_or_default();
        (ca, client)
    };
    eventually(
        "the node trusts both CAs and holds a certificate of the new one",
        Duration::from_secs(60),
        || {
            let (ca, client) = node_trust();
            (ca_ids(&ca) == vec![new_id.clone(), old_id.clone()]
                && nestplane_pki::verify_signed_by(&client, &cas[0]).unwrap_or(false))
            .then_some(())
        },
    );
    let node_uid = jsonpath(&now, &["node", &node], "{.metadata.uid}");

    // Completion waits while the cluster has a node nestplane does not run (a tenant admin's,
    // registered by hand: its kubelet would trust the old CA only), and says so; everything
    // keeps working.
    kubectl_apply(
        &now,
        "apiVersion: v1\nkind: Node\nmetadata: {name: hand-joined}\n",
    );
    let out = nestplane()
        .args([
            "rotate",
            "ca",
            "rot",
            "-n",
            "default",
            "--complete",
            "--no-wait",
        ])
        .args(["--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    held_by(
        &kc,
        ns,
        hc,
        "a node of the tenant admin's",
        "\"hand-joined\"",
        60,
    );
    kubectl_ok(&before, &["get", "ns", "default"]);
    assert_eq!(
        ca_ids(&ca_secret(env)),
        vec![new_id.clone(), old_id.clone()]
    );

    // A machine joining by a bootstrap token of the tenant admin's holds it too.
    kubectl_apply(
        &now,
        "apiVersion: v1\nkind: Secret\nmetadata: {name: bootstrap-token-abcdef, namespace: kube-system}\ntype: bootstrap.kubernetes.io/token\nstringData: {token-id: abcdef, token-secret: 0123456789abcdef, usage-bootstrap-authentication: 'true'}\n",
    );
    kubectl_ok(&now, &["delete", "node", "hand-joined"]);
    held_by(
        &kc,
        ns,
        hc,
        "the joining machine",
        "bootstrap-token-abcdef",
        120,
    );

    // Nothing joining, completion goes on with the pool's node in place: the serving
    // certificates are reissued from the new CA, the old one dropped, the node given the new
    // CA alone.
    kubectl_ok(
        &now,
        &[
            "delete",
            "secret",
            "-n",
            "kube-system",
            "bootstrap-token-abcdef",
        ],
    );
    let completing = Instant::now();
    let out = nestplane()
        .args(["rotate", "ca", "rot", "-n", "default", "--complete"])
        .args(["--timeout", "400", "--kubeconfig", kc.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "CA rotation: nothing joining → Completed in {:?}:\n{}",
        completing.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    let done = ca_rotation(&kc, ns, hc);
    assert!(done.starts_with(&format!("Completed|{new_id}|")), "{done}");
    assert_eq!(ca_ids(&ca_secret(env)), vec![new_id.clone()]);
    assert_eq!(
        serving_issuer(env, ns, hc, &cas).as_deref(),
        Some(new_id.as_str())
    );
    for (i, (asks, issuer)) in handshakes(env, &cas).await.into_iter().enumerate() {
        let mut asks = asks;
        asks.sort();
        let mut want = vec![new_id.clone(), "other".to_string()];
        want.sort();
        assert_eq!(asks, want, "replica {i}");
        assert_eq!(issuer.as_deref(), Some(new_id.as_str()), "replica {i}");
    }
    // The kubeconfig from before is refused (its certificate and its CA are the old one's);
    // a kubeconfig published now works, and trusts the new CA alone.
    let refused = kubectl(&before, &["--request-timeout=20s", "get", "ns", "default"]);
    assert!(!refused.status.success());
    let refused = kubectl(
        gateway_kc,
        &["--request-timeout=20s", "get", "ns", "default"],
    );
    assert!(!refused.status.success());
    let now = env.tenant_kubeconfig(ns, hc).await;
    kubectl_ok(&now, &["get", "ns", "default"]);
    let kcfg = kube::config::Kubeconfig::read_from(&now).unwrap();
    let trusted = b64(kcfg.clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .certificate_authority_data
        .as_deref()
        .unwrap());
    assert_eq!(ca_ids(&trusted), vec![new_id.clone()]);
    let root = kubectl_ok(
        &now,
        &[
            "get",
            "cm",
            "kube-root-ca.crt",
            "-o",
            "jsonpath={.data.ca\\.crt}",
        ],
    );
    assert_eq!(ca_ids(&root), vec![new_id.clone()]);
    // Aggregated API servers are told the new CA alone too, by the time it completed (the API
    // servers only ever add to what they publish there).
    let told = jsonpath(
        &now,
        &[
            "configmap",
            "extension-apiserver-authentication",
            "-n",
            "kube-system",
        ],
        "{.data.client-ca-file}",
    );
    assert_eq!(ca_ids(&told), vec![new_id.clone()]);
    // The old client certificate is refused by the API server itself, whatever the client
    // trusts.
    let mut old_client = kube::config::Kubeconfig::read_from(&before).unwrap();
    old_client.clusters = kcfg.clusters.clone();
    let old_client_path = dir.join("old-client.kubeconfig");
    std::fs::write(&old_client_path, serde_json::to_vec(&old_client).unwrap()).unwrap();
    let out = kubectl(
        &old_client_path,
        &["--request-timeout=20s", "get", "ns", "default"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unauthorized"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The node is the same node, Ready, and trusts the new CA alone: the API server reaches
    // its kubelet (logs, exec) with a certificate of the new CA, and its pod still calls its
    // API through it.
    assert_eq!(
        jsonpath(&now, &["node", &node], "{.metadata.uid}"),
        node_uid
    );
    eventually("the node Ready", Duration::from_secs(60), || {
        (condition(&now, &["node", &node], "Ready") == "True").then_some(())
    });
    let (ca, client) = node_trust();
    assert_eq!(ca_ids(&ca), vec![new_id.clone()]);
    assert!(nestplane_pki::verify_signed_by(&client, &cas[0]).unwrap());
    // Its kubelet serves a certificate of the new CA (what a client that verifies kubelets
    // with kube-root-ca.crt checks), and it renewed its Lease since the rotation completed.
    let node_ip = jsonpath(
        &now,
        &["node", &node],
        "{.status.addresses[?(@.type==\"InternalIP\")].address}",
    );
    let kubelet: std::net::SocketAddr = format!("{node_ip}:10250").parse().unwrap();
    let served = nestplane_operator::handshake::presented(kubelet, Duration::from_secs(5))
        .await
        .unwrap();
    let served = format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64::engine::general_purpose::STANDARD.encode(&served.certificate)
    );
    assert!(
        nestplane_pki::verify_signed_by(&served, &cas[0]).unwrap(),
        "the kubelet serves a certificate of the new CA"
    );
    let completed = k8s_openapi::jiff::Timestamp::now();
    eventually(
        "the node's Lease renewed after completion",
        Duration::from_secs(60),
        || {
            let renewed = jsonpath(
                &now,
                &["lease", &node, "-n", "kube-node-lease"],
                "{.spec.renewTime}",
            );
            renewed
                .parse::<k8s_openapi::jiff::Timestamp>()
                .ok()
                .filter(|r| *r > completed)
                .map(|_| ())
        },
    );
    eventually("logs and exec on the node", Duration::from_secs(60), || {
        let logs = kubectl(&now, &["logs", "--tail=1", "caller"]);
        let exec = kubectl(&now, &["exec", "caller", "--", "true"]);
        (logs.status.success() && exec.status.success()).then_some(())
    });
    eventually(
        "the pod calls its API after the CA rotation",
        Duration::from_secs(60),
        || {
            let logs =
                String::from_utf8_lossy(&kubectl(&now, &["logs", "--since=5s", "caller"]).stdout)
                    .to_string();
            logs.contains("legacy ok").then_some(())
        },
    );
    let events = events_for(&kc, ns, hc);
    assert!(
        events.contains("RotationStarted") && events.contains("RotationCompleted"),
        "{events}"
    );
    // Nothing nestplane reissued on the way was taken for an edit.
    assert!(!events.contains("SecretReissued"), "{events}");
    // The API servers were seen using the new files in their handshakes (no minute's wait):
    // when the new CA began to sign, and when the old one was gone.
    let seen = "every API server was seen using the CA files as they are now in its TLS handshake";
    for reason in ["RotationProgressing", "RotationCompleted"] {
        assert!(
            events
                .lines()
                .any(|l| l.contains(reason) && l.contains("CA rotation") && l.contains(seen)),
            "{reason}: {events}"
        );
    }
    eventually(
        "the HostedCluster's CA rotation",
        Duration::from_secs(30),
        || {
            (jsonpath(
                &kc,
                &["hostedcluster", hc],
                "{.status.rotations[?(@.target==\"ca\")].phase}",
            ) == "Completed")
                .then_some(())
        },
    );
}
