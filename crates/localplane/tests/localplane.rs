//! The local management plane against real etcd and kube-apiserver processes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams, PostParams};
use nestplane_localplane::{LocalPlane, Options};

fn alive(pid: u32) -> bool {
    // A reaped process has no /proc entry; a zombie would show state Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat.split_whitespace().nth(2).is_none_or(|s| s != "Z"),
        Err(_) => false,
    }
}

#[tokio::test]
async fn starts_serves_and_stops_cleanly() {
    let mut plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: None,
        crds: vec![],
    })
    .await
    .expect("management plane starts");
    println!("management plane ready in {:?}", plane.startup_time());

    let ns: Api<Namespace> = Api::all(plane.client());
    let names: Vec<String> = ns
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(
        names.contains(&"default".to_string()),
        "namespaces: {names:?}"
    );

    let mode = std::fs::metadata(plane.kubeconfig_path())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the admin kubeconfig holds a key");
    for key in ["ca.key", "admin.key", "apiserver.key", "sa.key"] {
        let mode = std::fs::metadata(plane.dir().join("pki").join(key))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{key}");
    }

    // kubectl works with the kubeconfig, and RBAC is on (anonymous users may not list).
    let out = std::process::Command::new("kubectl")
        .args([
            "--kubeconfig",
            plane.kubeconfig_path().to_str().unwrap(),
            "auth",
            "can-i",
            "list",
            "pods",
            "--as=nobody",
        ])
        .output()
        .expect("kubectl is on PATH (scripts/install-deps.sh installs it)");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "no");

    let pids = plane.pids();
    let names: Vec<&str> = pids.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["etcd", "kube-apiserver", "kube-controller-manager"]);
    assert!(pids.iter().all(|(_, p)| alive(*p)));
    let dir = plane.dir().to_path_buf();
    plane.stop();
    for (name, pid) in &pids {
        assert!(!alive(*pid), "{name} ({pid}) still running after stop");
    }
    drop(plane);
    assert!(
        !Path::new(&dir).exists(),
        "the temporary directory is removed"
    );
}

#[tokio::test]
async fn two_planes_side_by_side_are_isolated() {
    let (a, b) = tokio::join!(
        LocalPlane::start(Options::default()),
        LocalPlane::start(Options::default())
    );
    let (a, b) = (a.expect("first plane"), b.expect("second plane"));
    assert_ne!(a.server(), b.server());
    let ns_a: Api<Namespace> = Api::all(a.client());
    let ns_b: Api<Namespace> = Api::all(b.client());
    let only_a: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "only-in-a"}})).unwrap();
    ns_a.create(&PostParams::default(), &only_a).await.unwrap();
    assert!(ns_a.get_opt("only-in-a").await.unwrap().is_some());
    assert!(ns_b.get_opt("only-in-a").await.unwrap().is_none());
}

#[tokio::test]
async fn data_and_ca_survive_a_restart_in_the_same_dir() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        dir: Some(dir.path().to_path_buf()),
        controller_manager: false,
        disabled_controllers: vec![],
        nodes: None,
        crds: vec![],
    };
    let first = LocalPlane::start(opts.clone()).await.unwrap();
    let ca = first.ca_pem().to_string();
    let ns: Api<Namespace> = Api::all(first.client());
    let keep: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "keep-me"}})).unwrap();
    ns.create(&PostParams::default(), &keep).await.unwrap();
    drop(first);

    let second = LocalPlane::start(opts).await.unwrap();
    assert_eq!(second.ca_pem(), ca, "the CA is never regenerated");
    let ns: Api<Namespace> = Api::all(second.client());
    assert!(
        ns.get_opt("keep-me").await.unwrap().is_some(),
        "etcd data survives"
    );
}

#[tokio::test]
async fn service_account_kubeconfig_is_subject_to_rbac() {
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec![],
        nodes: None,
        crds: vec![],
    })
    .await
    .unwrap();
    let sa: k8s_openapi::api::core::v1::ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "robot"}})).unwrap();
    Api::namespaced(plane.client(), "default")
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let kc = plane
        .service_account_kubeconfig("default", "robot")
        .await
        .unwrap();
    let client = nestplane_localplane::client_from_kubeconfig(&kc)
        .await
        .unwrap();
    let err = Api::<Namespace>::all(client)
        .list(&ListParams::default())
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(e) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("expected 403, got {other:?}"),
    }
}

/// The management plane's etcd holds every tenant's objects, Secrets included: a local user
/// must not read it. It serves TLS on loopback and answers only clients with a certificate of
/// its own CA (not the management CA's, which also signs admins' and nodes' certificates).
#[tokio::test]
async fn the_management_etcd_answers_only_its_own_clients() {
    let plane = LocalPlane::start(Options::default()).await.unwrap();
    let etcd = plane
        .pids()
        .into_iter()
        .find(|(n, _)| n == "etcd")
        .unwrap()
        .1;
    let cmdline = std::fs::read_to_string(format!("/proc/{etcd}/cmdline")).unwrap();
    let url = cmdline
        .split('\0')
        .find_map(|a| a.strip_prefix("--listen-client-urls="))
        .unwrap()
        .to_string();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let pki = plane.dir().join("pki");
    let etcdctl_bin =
        nestplane_runtime::binaries::etcd("etcdctl").unwrap_or_else(|e| panic!("{e}"));
    let etcdctl = |extra: &[String]| {
        let mut args = vec![
            format!("--endpoints={url}"),
            "--dial-timeout=3s".into(),
            "--command-timeout=5s".into(),
        ];
        args.extend_from_slice(extra);
        args.extend(["get", "/registry/namespaces/default", "--keys-only"].map(String::from));
        let out = std::process::Command::new(&etcdctl_bin)
            .env("ETCDCTL_API", "3")
            .args(&args)
            .output()
            .expect("etcdctl runs");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let file = |n: &str| pki.join(n).display().to_string();
    // Plain HTTP: refused.
    let plain = url.replace("https://", "http://");
    let out = std::process::Command::new(&etcdctl_bin)
        .env("ETCDCTL_API", "3")
        .args([
            format!("--endpoints={plain}"),
            "--dial-timeout=3s".into(),
            "--command-timeout=5s".into(),
            "get".into(),
            "/registry/namespaces/default".into(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "plain HTTP answered");
    // TLS without a client certificate, or with the management CA's admin certificate:
    // refused.
    assert!(!etcdctl(&[format!("--cacert={}", file("etcd-ca.crt"))]).0);
    assert!(
        !etcdctl(&[
            format!("--cacert={}", file("etcd-ca.crt")),
            format!("--cert={}", file("admin.crt")),
            format!("--key={}", file("admin.key")),
        ])
        .0,
        "a certificate of the management CA opened etcd"
    );
    // The API server's own client certificate: answered (so the refusals above mean it).
    let (ok, keys) = etcdctl(&[
        format!("--cacert={}", file("etcd-ca.crt")),
        format!("--cert={}", file("apiserver-etcd-client.crt")),
        format!("--key={}", file("apiserver-etcd-client.key")),
    ]);
    assert!(
        ok && keys.contains("/registry/namespaces/default"),
        "{keys}"
    );
    for key in [
        "etcd-ca.key",
        "etcd-server.key",
        "apiserver-etcd-client.key",
    ] {
        let mode = std::fs::metadata(pki.join(key))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{key}");
    }
}

/// The CRD a plane is asked to serve from its start.
fn widget_crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"kind": "Widget", "plural": "widgets"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                }}},
            }],
        },
    }))
    .unwrap()
}

async fn get_text(client: &kube::Client, path: &str) -> String {
    client
        .request_text(nestplane_localplane::http_get(path).unwrap())
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

#[tokio::test]
async fn crds_given_at_start_are_served_at_once_built_into_openapi_once_and_kept_on_restart() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        dir: Some(dir.path().to_path_buf()),
        controller_manager: false,
        disabled_controllers: vec![],
        nodes: None,
        crds: vec![widget_crd()],
    };
    let first = LocalPlane::start(opts.clone()).await.unwrap();
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("example.com", "v1", "Widget"));
    let widgets: Api<DynamicObject> = Api::namespaced_with(first.client(), "default", &resource);
    // Served without being installed through the API.
    let widget: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "example.com/v1", "kind": "Widget",
        "metadata": {"name": "w1"}, "spec": {"size": 3},
    }))
    .unwrap();
    let pp = PostParams::default();
    retry("creating a Widget", || widgets.create(&pp, &widget)).await;
    let crds: Api<CustomResourceDefinition> = Api::all(first.client());
    let stored_version = crds
        .get("widgets.example.com")
        .await
        .unwrap()
        .metadata
        .resource_version;
    // The aggregated OpenAPI document takes the CRDs' part within a few seconds (it polls
    // it); by then any rebuild for the CRD would have been counted.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !first
        .client()
        .request_text(nestplane_localplane::http_get("/openapi/v2").unwrap())
        .await
        .is_ok_and(|doc| doc.contains("com.example.v1.Widget"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "Widget never reached the OpenAPI document"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let metrics = get_text(&first.client(), "/metrics").await;
    let rebuilt: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("apiextensions_openapi_v2_regeneration_count"))
        .filter(|l| l.contains("widgets.example.com"))
        .collect();
    assert!(
        rebuilt.is_empty(),
        "OpenAPI rebuilt for the CRD: {rebuilt:?}"
    );
    // Stored as the API server's controllers would leave it: none of them wrote it again.
    let crd = crds.get("widgets.example.com").await.unwrap();
    assert_eq!(crd.metadata.resource_version, stored_version);
    let conditions: Vec<(String, String)> = crd
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .map(|c| (c.type_, c.status))
        .collect();
    for wanted in ["NamesAccepted", "Established"] {
        assert!(
            conditions.contains(&(wanted.to_string(), "True".to_string())),
            "{wanted}: {conditions:?}"
        );
    }

    // What the user changes in a CRD is theirs: a restart does not store it again.
    crds.patch(
        "widgets.example.com",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"names": {"shortNames": ["wdg"]}}})),
    )
    .await
    .unwrap();
    drop(first);
    let second = LocalPlane::start(opts).await.unwrap();
    let crd = Api::<CustomResourceDefinition>::all(second.client())
        .get("widgets.example.com")
        .await
        .unwrap();
    assert_eq!(crd.spec.names.short_names, Some(vec!["wdg".to_string()]));
    let widgets: Api<DynamicObject> = Api::namespaced_with(second.client(), "default", &resource);
    let kept = retry("reading the Widget after a restart", || widgets.get("w1")).await;
    assert_eq!(kept.data["spec"]["size"], serde_json::json!(3));
}

/// `call` until it succeeds, for up to 30 s; panics with its last error.
async fn retry<T, F: std::future::Future<Output = Result<T, kube::Error>>>(
    what: &str,
    mut call: impl FnMut() -> F,
) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match call().await {
            Ok(got) => return got,
            Err(e) if std::time::Instant::now() > deadline => panic!("{what}: {e}"),
            Err(e) => eprintln!("{what}: {e}; again"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
