//! A hosted cluster's API server reaches its own cluster's network, as users' tools need: an
//! admission webhook served by a pod denies an object, a CRD conversion webhook converts, an
//! aggregated API served by a pod is `Available` and answers, and the `proxy` subresources of
//! Services and pods answer over https. It reaches only its own: a second hosted cluster that
//! points a Service, a webhook and an `APIService` at the first cluster's pod gets nothing
//! from it. The servers are the upstream end-to-end suite's own (agnhost, sample-apiserver),
//! built here from the Kubernetes source tree; the nodes are real.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::network::{self, NS, clients, stderr_of};
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_reaches_its_own_cluster_network_and_no_other() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let mut env = Env::start(false).await;
    env.start_operator_with(
        nestplane_operator::Controllers::default(),
        network::IMAGES.map(String::from).to_vec(),
    );
    let kc = env.kubeconfig().to_path_buf();
    env.install_cluster_crd();
    for name in ["alpha", "beta"] {
        env.apply(&format!(
            "apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  release: {{version: 1.20.2}}\n  initialNodes: 1\n"
        ));
    }
    for name in ["alpha", "beta"] {
        eventually(
            &format!("NodePool {name} Ready"),
            Duration::from_secs(300),
            || (condition(&kc, &["nodepool", name], "Ready") == "True").then_some(()),
        );
    }
    let alpha = hosted_kubeconfig(&kc, "alpha", env.state.path());
    let beta = hosted_kubeconfig(&kc, "beta", env.state.path());

    let ca = network::serve_and_reach(&alpha);

    // Beta points a Service of its own at alpha's webhook pod, and its webhook, conversion
    // and APIService at that Service: its API server reaches none of it. (Its Service
    // address is beta's own, so the egress proxy connects it inside beta's node, whose
    // kube-proxy sends it to alpha's pod: the machine drops it, beta's nodes reach no other
    // cluster's. The proxy subresources, which connect to the pod's address directly, are
    // refused by the proxy itself: `hostile.rs`.)
    let pod_ip = jsonpath(&alpha, &["pod", "webhook", "-n", NS], "{.status.podIP}");
    assert!(!pod_ip.is_empty());
    kubectl_apply(
        &beta,
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: steal, namespace: default}}\nspec:\n  ports: [{{port: 443, targetPort: 8443}}]\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: steal, namespace: default}}\nsubsets:\n- addresses: [{{ip: {pod_ip}}}]\n  ports: [{{port: 8443}}]\n"
        ),
    );
    kubectl_apply(&beta, &clients(&ca, "default", Some("steal")));
    let failed = eventually("beta's webhook call fails", Duration::from_secs(60), || {
        stderr_of(&beta, &["create", "configmap", "c1", "-n", "denied"])
            .filter(|e| e.contains("failed calling webhook"))
    });
    assert!(
        !failed.contains("this webhook denies all requests"),
        "{failed}"
    );
    // Seen long enough to be sure: the APIService never becomes Available.
    std::thread::sleep(Duration::from_secs(5));
    let available = condition(
        &beta,
        &["apiservice", "v1alpha1.wardle.example.com"],
        "Available",
    );
    assert_eq!(available, "False");

    // Alpha's own calls still work after all of that.
    eventually(
        "alpha's webhook still denies",
        Duration::from_secs(30),
        || {
            stderr_of(&alpha, &["create", "configmap", "c2", "-n", "denied"])
                .filter(|e| e.contains("this webhook denies all requests"))
        },
    );

    // Then alpha's front-proxy CA, with its aggregated API in use.
    rotate_the_front_proxy_ca(&env, &alpha).await;
    env.operator.take().unwrap().stop().await.unwrap();
}

/// PEM of key `key` of Secret `name` in `ns` of the management plane.
fn secret_pem(kc: &Path, ns: &str, name: &str, key: &str) -> String {
    use base64::Engine as _;
    let v = kubectl_ok(
        kc,
        &[
            "get",
            "secret",
            "-n",
            ns,
            name,
            "-o",
            &format!("jsonpath={{.data.{}}}", key.replace('.', "\\.")),
        ],
    );
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(v.trim())
            .unwrap(),
    )
    .unwrap()
}

fn ids(pem: &str) -> Vec<String> {
    nestplane_pki::certificates(pem)
        .unwrap()
        .iter()
        .map(|c| nestplane_pki::certificate_id(c).unwrap())
        .collect()
}

/// What the front-proxy client certificate `cert`/`key` gets from the API server at `server`
/// (trusting `ca`) when it vouches, in request headers, for user `mallory` of group
/// `system:masters`: the HTTP status of reading `kube-system`'s Secrets. This is what a leaked
/// front-proxy key is worth, and what a rotation's completion takes away.
async fn vouching(server: &str, ca: &str, cert: &str, key: &str) -> u16 {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}],
        "users": [{"name": "u", "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    });
    let kc: kube::config::Kubeconfig = serde_json::from_value(kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(cfg).unwrap();
    let req = http::Request::get("/api/v1/namespaces/kube-system/secrets?limit=1")
        .header("X-Remote-User", "mallory")
        .header("X-Remote-Group", "system:masters")
        .body(Vec::new())
        .unwrap();
    match client.request_text(req).await {
        Ok(_) => 200,
        Err(kube::Error::Api(e)) => e.code,
        Err(e) => panic!("the API server did not answer: {e}"),
    }
}

/// The front-proxy CA of HostedCluster `alpha` (its aggregated API in use all along) rotated
/// with `nestplane rotate front-proxy-ca`: the aggregated API never fails; the API servers
/// vouch for users with a certificate from the new CA; aggregated API servers are told both
/// CAs, then the new one alone; a certificate the old CA signed vouches for a user until
/// completion and is refused after it.
async fn rotate_the_front_proxy_ca(env: &Env, alpha: &Path) {
    let kc = env.kubeconfig().to_path_buf();
    let (ns, cluster) = ("default-alpha", "alpha");
    let server = format!("https://{}:6443", first_replica(&kc, ns, cluster));
    let cluster_ca = secret_pem(&kc, ns, "alpha-ca", "tls.crt");
    let client = |what: &str| {
        (
            secret_pem(&kc, ns, &format!("alpha-{what}"), "tls.crt"),
            secret_pem(&kc, ns, &format!("alpha-{what}"), "tls.key"),
        )
    };
    let (old_cert, old_key) = client("front-proxy-client");
    let old_ca = secret_pem(&kc, ns, "alpha-proxy", "tls.crt");
    let old_id = ids(&old_ca)[0].clone();
    assert_eq!(
        vouching(&server, &cluster_ca, &old_cert, &old_key).await,
        200,
        "the front-proxy certificate vouches for users before the rotation"
    );
    let published = || {
        let pem = jsonpath(
            alpha,
            &[
                "configmap",
                "extension-apiserver-authentication",
                "-n",
                "kube-system",
            ],
            "{.data.requestheader-client-ca-file}",
        );
        ids(&pem)
    };
    assert_eq!(published(), vec![old_id.clone()]);

    // The aggregated API is asked all along.
    const FLUNDERS: &[&str] = &[
        "--request-timeout=20s",
        "get",
        "flunders.wardle.example.com",
        "-n",
        network::NS,
        "-o",
        "name",
    ];
    let asking = Asking::start(alpha, FLUNDERS, Duration::from_millis(300));
    let run = |args: &[&str]| {
        let asked = std::time::Instant::now();
        let out = nestplane()
            .args(["rotate", "front-proxy-ca", "alpha", "-n", "default"])
            .args(args)
            .args(["--timeout", "400", "--kubeconfig", kc.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            env.tenant_logs(ns, cluster)
        );
        let said = String::from_utf8_lossy(&out.stderr).to_string();
        eprintln!(
            "front-proxy CA rotation {args:?} in {:?}:\n{said}",
            asked.elapsed()
        );
        said
    };
    let said = run(&[]);
    assert!(
        said.contains("Trusting") && said.contains("Started"),
        "{said}"
    );
    // Each phase has its Event (the CLI, looking every second, may miss a short one).
    let events = events_for(&kc, ns, cluster);
    for step in [
        "front-proxy CA rotation",
        "the new CA signs the API server's client certificate",
        "RotationStarted",
    ] {
        assert!(events.contains(step), "{step}: {events}");
    }
    let rotation = || {
        jsonpath(
            &kc,
            &["ncp", cluster, "-n", ns],
            "{.status.rotations[?(@.target==\"front-proxy-ca\")].phase}|{.status.rotations[?(@.target==\"front-proxy-ca\")].keyId}|{.status.rotations[?(@.target==\"front-proxy-ca\")].previousKeyId}",
        )
    };
    let started = rotation();
    let parts: Vec<&str> = started.split('|').collect();
    assert_eq!(parts[0], "Started", "{started}");
    assert_eq!(parts[2], old_id, "{started}");
    let new_id = parts[1].to_string();
    assert_ne!(new_id, old_id);
    let bundle = secret_pem(&kc, ns, "alpha-proxy", "tls.crt");
    assert_eq!(ids(&bundle), vec![new_id.clone(), old_id.clone()]);
    // The API servers vouch with a certificate the new CA signed; aggregated API servers are
    // told both CAs; what the old CA signed still vouches.
    let (new_cert, new_key) = client("front-proxy-client");
    let new_ca = nestplane_pki::certificates(&bundle).unwrap()[0].clone();
    assert!(nestplane_pki::verify_signed_by(&new_cert, &new_ca).unwrap());
    let mut told = published();
    told.sort();
    let mut both = vec![new_id.clone(), old_id.clone()];
    both.sort();
    assert_eq!(told, both);
    assert_eq!(
        vouching(&server, &cluster_ca, &old_cert, &old_key).await,
        200
    );
    // The cluster CA was not touched.
    assert_eq!(secret_pem(&kc, ns, "alpha-ca", "tls.crt"), cluster_ca);

    let said = run(&["--complete"]);
    assert!(said.contains("Completed"), "{said}");
    assert!(
        rotation().starts_with(&format!("Completed|{new_id}|")),
        "{}",
        rotation()
    );
    assert_eq!(
        ids(&secret_pem(&kc, ns, "alpha-proxy", "tls.crt")),
        vec![new_id.clone()]
    );
    // Aggregated API servers are told the new CA alone (the API servers never drop one from
    // there by themselves), and a certificate the old CA signed vouches for nobody.
    assert_eq!(published(), vec![new_id.clone()]);
    let refused = vouching(&server, &cluster_ca, &old_cert, &old_key).await;
    assert!(
        refused == 401 || refused == 403,
        "the old front-proxy certificate: {refused}"
    );
    assert_eq!(
        vouching(&server, &cluster_ca, &new_cert, &new_key).await,
        200
    );
    // The aggregated API answered all along, and still does.
    kubectl_ok(alpha, FLUNDERS);
    asking.stop_all_answered("front-proxy CA rotation: the aggregated API", 20);
    let events = events_for(&kc, ns, cluster);
    assert!(
        events
            .lines()
            .any(|l| l.contains("RotationCompleted") && l.contains("front-proxy CA")),
        "{events}"
    );
}
