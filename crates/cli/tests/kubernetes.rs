//! The `kubernetes` runtime and the install manifests, against a real management plane
//! (etcd, kube-apiserver, kube-controller-manager). The operator runs with the token of the
//! ServiceAccount that `config/default` installs, so the real apiserver enforces the shipped
//! RBAC. The plane has no nodes and its Deployment/StatefulSet controllers are off: this test
//! plays their part (and the kubelets') by writing workload status.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret, Service};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use nestplane_api::{NestedAPIServer, NestedControlPlane, NestedEtcd, NestedScheduler};
use nestplane_localplane::{LocalPlane, Options};

const NS: &str = "tenants";

fn config_default() -> String {
    repo().join("config/default").display().to_string()
}

/// Mark every StatefulSet and Deployment in `ns` as rolled out with all replicas ready, as
/// the workload controllers and kubelets of a real cluster would.
async fn play_the_nodes(client: kube::Client, ns: &str) {
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), ns);
    let deploys: Api<Deployment> = Api::namespaced(client, ns);
    loop {
        for s in sts.list(&ListParams::default()).await.unwrap().items {
            let n = s.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let status = serde_json::json!({"status": {
                "observedGeneration": s.metadata.generation, "replicas": n, "readyReplicas": n,
                "currentReplicas": n, "updatedReplicas": n}});
            let _ = sts
                .patch_status(
                    &s.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&status),
                )
                .await;
        }
        for d in deploys.list(&ListParams::default()).await.unwrap().items {
            let n = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let status = serde_json::json!({"status": {
                "observedGeneration": d.metadata.generation, "replicas": n, "readyReplicas": n,
                "availableReplicas": n, "updatedReplicas": n}});
            let _ = deploys
                .patch_status(
                    &d.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&status),
                )
                .await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn eventually_async<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn controlled_by<K: Resource<DynamicType = ()>>(meta: &kube::api::ObjectMeta, name: &str) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|r| r.controller == Some(true) && r.kind == K::kind(&()) && r.name == name)
}

fn container_of(d: &Deployment) -> k8s_openapi::api::core::v1::Container {
    d.spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .clone()
}

#[test]
fn release_manifest_is_generated_from_config_default() {
    let out = std::process::Command::new("kubectl")
        .args(["kustomize", &config_default()])
        .output()
        .expect("kubectl not found on PATH: run scripts/install-deps.sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let checked_in = std::fs::read_to_string(repo().join("control-plane-components.yaml")).unwrap();
    assert!(
        checked_in == String::from_utf8_lossy(&out.stdout),
        "control-plane-components.yaml is stale: run `make release-manifests`"
    );
    let metadata = std::fs::read_to_string(repo().join("metadata.yaml")).unwrap();
    assert!(metadata.contains("kind: Metadata") && metadata.contains("contract: v1beta1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_runtime_under_the_shipped_rbac() {
    let plane = LocalPlane::start(Options {
        dir: None,
        controller_manager: true,
        disabled_controllers: vec!["deployment".into(), "statefulset".into()],
    })
    .await
    .expect("management plane");
    let kc = plane.kubeconfig_path().to_path_buf();
    let admin = plane.client();

    // Install exactly as the README says, after a server-side dry run of the same tree.
    kubectl_ok(&kc, &["create", "namespace", "nestplane-system"]);
    kubectl_ok(&kc, &["apply", "-k", &config_default(), "--dry-run=server"]);
    kubectl_ok(&kc, &["apply", "-k", &config_default()]);
    kubectl_ok(
        &kc,
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ],
    );
    let deploy: Deployment = Api::namespaced(admin.clone(), "nestplane-system")
        .get("nestplane-controller-manager")
        .await
        .unwrap();
    let manager = container_of(&deploy);
    assert_eq!(manager.name, "manager");
    assert!(
        manager
            .args
            .unwrap()
            .contains(&"--runtime=kubernetes".to_string())
    );

    // The operator as that Deployment would run it: with its ServiceAccount's token only.
    let sa_kubeconfig = plane
        .service_account_kubeconfig("nestplane-system", "nestplane-controller-manager")
        .await
        .unwrap();
    let sa_client = nestplane_localplane::client_from_kubeconfig(&sa_kubeconfig)
        .await
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let operator = nestplane_operator::Operator::start(
        sa_client,
        nestplane_operator::Config {
            state_dir: state.path().to_path_buf(),
            mode: nestplane_operator::Mode::Kubernetes(Default::default()),
            ..Default::default()
        },
    );
    let nodes = tokio::spawn(play_the_nodes(admin.clone(), NS));

    kubectl_ok(&kc, &["create", "namespace", NS]);
    kubectl_stdin(
        &kc,
        &["apply", "-f", "-"],
        Some(
            "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata:\n  name: demo\n  namespace: tenants\nspec:\n  version: v1.20.2\n",
        ),
    );
    let ncps: Api<NestedControlPlane> = Api::namespaced(admin.clone(), NS);
    let ncp = eventually_async(
        "the control plane to be ready",
        Duration::from_secs(120),
        || {
            let ncps = ncps.clone();
            async move {
                let n = ncps.get("demo").await.unwrap();
                n.status.as_ref().is_some_and(|s| s.ready).then_some(n)
            }
        },
    )
    .await;

    // Workloads, Services and secrets, owned and accepted by the apiserver.
    let sts: Api<StatefulSet> = Api::namespaced(admin.clone(), NS);
    let deploys: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    let services: Api<Service> = Api::namespaced(admin.clone(), NS);
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let etcd = sts.get("demo-etcd").await.unwrap();
    assert!(controlled_by::<NestedEtcd>(&etcd.metadata, "demo-etcd"));
    let etcd_spec = etcd.spec.as_ref().unwrap();
    assert_eq!(etcd_spec.service_name.as_deref(), Some("demo-etcd-peer"));
    assert_eq!(etcd_spec.volume_claim_templates.as_ref().unwrap().len(), 1);
    for (name, binary) in [
        ("demo-apiserver", "kube-apiserver"),
        ("demo-controller-manager", "kube-controller-manager"),
        ("demo-scheduler", "kube-scheduler"),
    ] {
        let d = deploys.get(name).await.unwrap();
        assert!(
            d.owner_references()
                .iter()
                .any(|r| r.controller == Some(true)
                    && r.name == name
                    && r.kind.starts_with("Nested")),
            "{name} is controlled by its component object"
        );
        let t = d.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
        let sum = &t.annotations.as_ref().unwrap()[nestplane_render::SECRETS_CHECKSUM_ANNOTATION];
        assert_eq!(sum.len(), 64, "{name}: secrets checksum {sum}");
        assert_eq!(
            container_of(&d).image.unwrap(),
            format!("registry.k8s.io/{binary}:v1.20.2")
        );
    }
    for name in ["demo-etcd", "demo-etcd-peer", "demo-apiserver"] {
        let s = services.get(name).await.unwrap();
        assert!(
            s.owner_references()
                .iter()
                .any(|r| r.controller == Some(true)),
            "{name}"
        );
    }
    for name in [
        "demo-ca",
        "demo-etcd",
        "demo-proxy",
        "demo-sa",
        "demo-kubeconfig",
    ] {
        let s = secrets.get(name).await.unwrap();
        assert!(
            controlled_by::<NestedControlPlane>(&s.metadata, "demo"),
            "{name}"
        );
        assert_eq!(
            s.type_.as_deref(),
            Some("cluster.x-k8s.io/secret"),
            "{name}"
        );
    }

    // Contract fields, and an endpoint that follows the Service.
    let st = ncp.status.as_ref().unwrap();
    assert!(st.initialized && st.external_managed_control_plane);
    assert_eq!(st.version.as_deref(), Some("v1.20.2"));
    assert_eq!(st.ready_replicas, Some(1));
    let svc = services.get("demo-apiserver").await.unwrap();
    let cluster_ip = svc.spec.as_ref().unwrap().cluster_ip.clone().unwrap();
    let ep = ncp.spec.control_plane_endpoint.as_ref().unwrap();
    assert_eq!((ep.host.as_str(), ep.port), (cluster_ip.as_str(), 6443));
    let serving = secrets.get("demo-apiserver").await.unwrap();
    let cert = String::from_utf8(serving.data.unwrap()["tls.crt"].0.clone()).unwrap();
    let info = nestplane_pki::inspect(&cert).unwrap();
    assert!(
        info.ips.iter().any(|ip| ip.to_string() == cluster_ip),
        "the serving certificate covers the Service address: {:?}",
        info.ips
    );
    assert!(
        info.dns_names
            .contains(&"demo-apiserver.tenants.svc".to_string())
    );
    let apiserver: NestedAPIServer = Api::namespaced(admin.clone(), NS)
        .get("demo-apiserver")
        .await
        .unwrap();
    let svc_ref = apiserver.status.unwrap().apiserver_service.unwrap();
    assert_eq!(svc_ref.name.as_deref(), Some("demo-apiserver"));
    let etcd_obj: NestedEtcd = Api::namespaced(admin.clone(), NS)
        .get("demo-etcd")
        .await
        .unwrap();
    assert_eq!(
        etcd_obj.status.unwrap().addresses[0].hostname.as_deref(),
        Some("demo-etcd-0.demo-etcd-peer.tenants.svc")
    );

    // Scaling through the scale subresource reaches the Deployment; the status follows.
    kubectl_ok(&kc, &["scale", "ncp", "demo", "-n", NS, "--replicas=3"]);
    eventually_async(
        "apiserver Deployment with 3 replicas",
        Duration::from_secs(60),
        || {
            let deploys = deploys.clone();
            async move {
                let d = deploys.get("demo-apiserver").await.unwrap();
                (d.spec.unwrap().replicas == Some(3)).then_some(())
            }
        },
    )
    .await;
    eventually_async(
        "3 ready replicas in the contract status",
        Duration::from_secs(60),
        || {
            let ncps = ncps.clone();
            async move {
                let s = ncps.get("demo").await.unwrap().status.unwrap();
                (s.ready_replicas == Some(3) && s.replicas == Some(3) && s.ready).then_some(())
            }
        },
    )
    .await;

    // A new version updates every workload's image (etcd's chosen for that version).
    kubectl_ok(
        &kc,
        &[
            "patch",
            "ncp",
            "demo",
            "-n",
            NS,
            "--type=merge",
            "-p",
            r#"{"spec":{"version":"v1.21.4"}}"#,
        ],
    );
    eventually_async("images of v1.21.4", Duration::from_secs(60), || {
        let (deploys, sts) = (deploys.clone(), sts.clone());
        async move {
            for n in [
                "demo-apiserver",
                "demo-controller-manager",
                "demo-scheduler",
            ] {
                let image = container_of(&deploys.get(n).await.unwrap()).image.unwrap();
                if !image.ends_with(":v1.21.4") {
                    return None;
                }
            }
            let etcd = sts.get("demo-etcd").await.unwrap();
            let image = etcd.spec.unwrap().template.spec.unwrap().containers[0]
                .image
                .clone()
                .unwrap();
            let want =
                nestplane_render::etcd_version_for(&nestplane_render::KubeVersion::new(1, 21, 4));
            image.ends_with(&format!(":{want}")).then_some(())
        }
    })
    .await;
    eventually_async("status.version v1.21.4", Duration::from_secs(60), || {
        let ncps = ncps.clone();
        async move {
            let s = ncps.get("demo").await.unwrap().status.unwrap();
            (s.version.as_deref() == Some("v1.21.4") && s.ready).then_some(())
        }
    })
    .await;

    // Resources and patches of a component update its Deployment.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedcontrollermanager",
            "demo-controller-manager",
            "-n",
            NS,
            "--type=merge",
            "-p",
            r#"{"spec":{"resources":{"limits":{"memory":"512Mi"}}}}"#,
        ],
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedscheduler",
            "demo-scheduler",
            "-n",
            NS,
            "--type=merge",
            "-p",
            r#"{"spec":{"patches":[{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"demo-scheduler"},"spec":{"template":{"spec":{"nodeSelector":{"pool":"control-planes"},"containers":[{"name":"kube-scheduler","env":[{"name":"EXTRA","value":"1"}]}]}}}}]}}"#,
        ],
    );
    eventually_async(
        "resources and patch applied",
        Duration::from_secs(60),
        || {
            let deploys = deploys.clone();
            async move {
                let cm = container_of(&deploys.get("demo-controller-manager").await.unwrap());
                let limits = cm.resources.and_then(|r| r.limits).unwrap_or_default();
                let sched = deploys.get("demo-scheduler").await.unwrap();
                let pod = sched.spec.as_ref().unwrap().template.spec.clone().unwrap();
                let env = pod.containers[0].env.clone().unwrap_or_default();
                (limits.get("memory").map(|q| q.0.as_str()) == Some("512Mi")
                    && pod
                        .node_selector
                        .is_some_and(|n| n["pool"] == "control-planes")
                    && env.iter().any(|e| e.name == "EXTRA")
                    && env.iter().any(|e| e.name == "POD_IP"))
                .then_some(())
            }
        },
    )
    .await;

    // A patch aimed at nothing: a condition naming it; the workload stays as it was.
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedscheduler",
            "demo-scheduler",
            "-n",
            NS,
            "--type=merge",
            "-p",
            r#"{"spec":{"patches":[{"kind":"Deployment","metadata":{"name":"nope"}}]}}"#,
        ],
    );
    let schedulers: Api<NestedScheduler> = Api::namespaced(admin.clone(), NS);
    let cond = eventually_async(
        "InvalidSpec for the bad patch",
        Duration::from_secs(60),
        || {
            let schedulers = schedulers.clone();
            async move {
                let s = schedulers.get("demo-scheduler").await.unwrap();
                s.status?
                    .conditions
                    .into_iter()
                    .find(|c| c.type_ == "Ready" && c.reason == "InvalidSpec")
            }
        },
    )
    .await;
    assert!(
        cond.message.contains("patch 0 (Deployment/nope)"),
        "{}",
        cond.message
    );
    assert!(deploys.get_opt("demo-scheduler").await.unwrap().is_some());
    eventually(
        "a Warning event for the bad patch",
        Duration::from_secs(30),
        || {
            events_for(&kc, NS, "demo-scheduler")
                .contains("Warning InvalidSpec")
                .then_some(())
        },
    );

    // Deletion leaves nothing behind (real garbage collection by kube-controller-manager),
    // including etcd's claim, which Kubernetes keeps after its StatefulSet is gone.
    let claim: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "data-demo-etcd-0", "labels": {
            "cluster.x-k8s.io/cluster-name": "demo",
            "app.kubernetes.io/managed-by": "nestplane",
            "controlplane.cluster.x-k8s.io/component": "etcd"}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), NS);
    claims.create(&PostParams::default(), &claim).await.unwrap();
    kubectl_ok(&kc, &["delete", "ncp", "demo", "-n", NS, "--wait=false"]);
    eventually_async("nothing left", Duration::from_secs(90), || {
        let (sts, deploys, services, secrets, claims) = (
            sts.clone(),
            deploys.clone(),
            services.clone(),
            secrets.clone(),
            claims.clone(),
        );
        async move {
            let lp = ListParams::default().labels("cluster.x-k8s.io/cluster-name=demo");
            let left = sts.list(&lp).await.unwrap().items.len()
                + deploys
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
                    .len()
                + services
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
                    .len()
                + secrets.list(&lp).await.unwrap().items.len()
                + claims
                    .list(&ListParams::default())
                    .await
                    .unwrap()
                    .items
                    .len();
            (left == 0).then_some(())
        }
    })
    .await;
    let leftover = kubectl_ok(
        &kc,
        &[
            "get",
            "nestedetcds,nestedapiservers,nestedcontrollermanagers,nestedschedulers,ncp",
            "-n",
            NS,
            "-o",
            "name",
        ],
    );
    assert_eq!(
        leftover.trim(),
        "",
        "components are garbage-collected with their control plane"
    );

    nodes.abort();
    operator.stop().await.unwrap();
}
