//! `nestplane up` and `nestplane down`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use nestplane_api::conditions::{self, types};
use nestplane_api::names::SecretPurpose;
use nestplane_api::{NestedControlPlane, NestedControlPlaneSpec};
use nestplane_localplane::{LocalPlane, Options};
use nestplane_operator::Operator;

/// Arguments of `nestplane up`.
#[derive(Args, Debug)]
pub struct UpArgs {
    /// Where certificates, data, logs and kubeconfigs live (kept across runs).
    #[arg(long, env = "NESTPLANE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The tenant control plane's name.
    #[arg(long, default_value = "demo")]
    pub name: String,
    /// The tenant's Kubernetes version.
    #[arg(long)]
    pub version: Option<String>,
    /// Exit once the tenant is ready (benchmarks, scripts) instead of staying in the
    /// foreground.
    #[arg(long)]
    pub exit_when_ready: bool,
    /// Give up when the tenant is not ready after this many seconds.
    #[arg(long, default_value_t = 180)]
    pub timeout: u64,
    /// Where the tenant's components run. `process`: supervised processes on this machine,
    /// the operator in this process. `kubernetes`: pods on a real node of the management
    /// plane (images built here), the operator installed in-cluster from the release
    /// manifest; state under `<state-dir>/kubernetes`.
    #[arg(long, default_value = "process", value_parser = ["process", "kubernetes"])]
    pub runtime: String,
    /// Real worker nodes for the tenant (`process` runtime): the tenant is then a
    /// `HostedCluster` whose NodePool has this many nodes (containerd + kubelet + kube-proxy
    /// on this machine), so `kubectl run` works against it.
    #[arg(long, default_value_t = 0)]
    pub nodes: u32,
    /// An image the nodes import besides nestplane's own, by name, from `nestplane images
    /// build`'s archives (the end-to-end suite's, for `make conformance`); repeatable.
    #[arg(long = "node-image")]
    pub node_images: Vec<String>,
    /// The pod security level enforced on the nodes (`Baseline`, `Restricted`, `Privileged`;
    /// unset: a new pool is `Baseline`, an existing one keeps its level). `Privileged` lets
    /// the tenant admin become root on this machine: `up` then labels the namespace
    /// `nestplane.io/pod-security-privileged=allowed` as a platform team would, and the label
    /// stays until removed by hand (Kubernetes' conformance specs need host networking and
    /// host paths).
    #[arg(long, value_parser = ["Baseline", "Restricted", "Privileged"])]
    pub pod_security: Option<String>,
}

/// Arguments of `nestplane down`.
#[derive(Args, Debug)]
pub struct DownArgs {
    /// The state directory `nestplane up` used.
    #[arg(long, env = "NESTPLANE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The tenant control plane's name.
    #[arg(long, default_value = "demo")]
    pub name: String,
    /// Also remove the management plane's state (the whole state directory).
    #[arg(long)]
    pub purge: bool,
    /// The runtime `nestplane up` used.
    #[arg(long, default_value = "process", value_parser = ["process", "kubernetes"])]
    pub runtime: String,
}

/// Where a runtime's management plane and tenants live: the state directory (given, or the
/// default), under `kubernetes/` for the kubernetes runtime.
fn runtime_root(state_dir: &Option<PathBuf>, runtime: &str) -> PathBuf {
    let dir = state_dir.clone().unwrap_or_else(crate::default_state_dir);
    match runtime {
        "kubernetes" => dir.join("kubernetes"),
        _ => dir,
    }
}

const NAMESPACE: &str = "default";

struct Running {
    plane: LocalPlane,
    /// The in-process operator (`process` runtime); in-cluster for `kubernetes`.
    operator: Option<Operator>,
}

/// The release manifest (`make release-manifests`): what `clusterctl` and
/// `kubectl apply -k config/default` install.
const RELEASE_MANIFEST: &str = include_str!("../../../control-plane-components.yaml");

/// Images for the management plane's node: built here (only what changed), the operator's
/// from this binary.
fn node_options() -> anyhow::Result<nestplane_localplane::NodeOptions> {
    let built = build_images(false)?;
    Ok(nestplane_localplane::NodeOptions {
        count: 1,
        images: built.into_iter().map(|b| b.archive).collect(),
        dns_image: Some(nestplane_nodes::images::OPERATOR_IMAGE.into()),
    })
}

/// Check that nodes can run here and build the images they use (only what changed); with
/// `suite`, the end-to-end suite's images too.
fn build_images(suite: bool) -> anyhow::Result<Vec<nestplane_nodes::images::Built>> {
    nestplane_nodes::check_prerequisites(nestplane_localplane::DEFAULT_VERSION)?;
    eprintln!("nestplane: building images (only what changed; about a minute the first time)");
    crate::images::build(&crate::images::BuildArgs {
        registry: nestplane_render::DEFAULT_IMAGE_REGISTRY.into(),
        version: nestplane_localplane::DEFAULT_VERSION.into(),
        dir: None,
        operator_binary: None,
        containerfile: None,
        suite,
    })
}

/// Install the operator from the release manifest and wait until its pod is available.
async fn install_operator(plane: &LocalPlane) -> anyhow::Result<()> {
    let mut objects = Vec::new();
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(RELEASE_MANIFEST).context("reading the release manifest")?;
    for v in docs {
        // The CRDs are installed (and established) already.
        if v.is_object() && v["kind"] != "CustomResourceDefinition" {
            objects.push(v);
        }
    }
    nestplane_localplane::apply_all(&plane.client(), &objects).await?;
    eprintln!("nestplane: operator installed in-cluster; waiting for its pod");
    let deploys: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(plane.client(), "nestplane-system");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let d = deploys.get_opt("nestplane-controller-manager").await?;
        if d.and_then(|d| d.status)
            .and_then(|s| s.available_replicas)
            .unwrap_or(0)
            >= 1
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the operator's pod is not available after 180s (kubectl -n nestplane-system describe pods)"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn start(
    state_dir: &Path,
    runtime: &str,
    node_images: Vec<String>,
) -> anyhow::Result<Running> {
    let kubernetes = runtime == "kubernetes";
    let nodes = if kubernetes {
        Some(node_options()?)
    } else {
        None
    };
    let plane = LocalPlane::start(Options {
        dir: Some(state_dir.join("management")),
        controller_manager: true,
        disabled_controllers: vec![],
        nodes,
        // Installed through the API below: this plane lives on, and its CRDs' fields stay
        // owned by nestplane's apply (see `nestplane_localplane::seed`).
        crds: vec![],
    })
    .await
    .context("starting the local management plane")?;
    nestplane_operator::crds::install(&plane.client(), Duration::from_secs(30))
        .await
        .context("installing CRDs")?;
    nestplane_localplane::write_private(
        &state_dir.join("management.kubeconfig"),
        plane.kubeconfig(),
    )?;
    let operator = if kubernetes {
        install_operator(&plane).await?;
        None
    } else {
        Some(Operator::start(
            plane.client(),
            nestplane_operator::Config {
                state_dir: state_dir.join("operator"),
                nodes: Some(nestplane_operator::hosted::pool::NodeSettings {
                    dir: state_dir.join("nodes"),
                    images: nestplane_nodes::images::default_dir(),
                    guard: std::env::current_exe()?,
                    extra_images: node_images,
                }),
                ..Default::default()
            },
        ))
    };
    Ok(Running { plane, operator })
}

async fn stop(r: Running) {
    let Running {
        mut plane,
        operator,
    } = r;
    if let Some(operator) = operator
        && let Err(e) = operator.stop().await
    {
        eprintln!("nestplane: operator: {e}");
    }
    plane.stop();
}

/// The admin kubeconfig of a tenant (`<name>-kubeconfig`, key `value`).
pub async fn tenant_kubeconfig(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> anyhow::Result<String> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let secret_name = SecretPurpose::AdminKubeconfig.secret_name(name);
    let s = secrets
        .get(&secret_name)
        .await
        .with_context(|| format!("reading secret {namespace}/{secret_name}"))?;
    let value = s
        .data
        .and_then(|d| d.get("value").cloned())
        .with_context(|| format!("secret {secret_name} has no key `value`"))?;
    Ok(String::from_utf8_lossy(&value.0).into_owned())
}

/// Run `nestplane up` until Ctrl-C or SIGTERM.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    if args.nodes == 0 && (args.pod_security.is_some() || !args.node_images.is_empty()) {
        bail!("--pod-security and --node-image are about nodes: give --nodes too");
    }
    if args.nodes > 0 {
        if args.runtime != "process" {
            bail!(
                "--nodes needs the process runtime (the operator makes the nodes on this machine)"
            );
        }
        let suite = args
            .node_images
            .iter()
            .any(|n| nestplane_nodes::images::SUITE_IMAGES.contains(&n.as_str()));
        build_images(suite)?;
    }
    let state_dir = runtime_root(&args.state_dir, &args.runtime);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    eprintln!("nestplane: state in {}", state_dir.display());
    let running = start(&state_dir, &args.runtime, args.node_images.clone()).await?;
    let mgmt_ready = started.elapsed();
    eprintln!(
        "nestplane: management plane ready ({:.1}s)",
        mgmt_ready.as_secs_f64()
    );

    let result = async {
        let client = running.plane.client();
        if args.nodes > 0 {
            let total = up_hosted(&client, &state_dir, &args, started).await?;
            return Ok::<_, anyhow::Error>((total, Default::default()));
        }
        let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), NAMESPACE);
        if ncps.get_opt(&args.name).await?.is_none() {
            let ncp = NestedControlPlane::new(
                &args.name,
                NestedControlPlaneSpec {
                    version: args.version.clone(),
                    replicas: Some(1),
                    ..Default::default()
                },
            );
            ncps.create(&PostParams::default(), &ncp)
                .await
                .context("creating the tenant control plane")?;
            eprintln!(
                "nestplane: created NestedControlPlane {NAMESPACE}/{}",
                args.name
            );
        } else {
            eprintln!(
                "nestplane: NestedControlPlane {NAMESPACE}/{} exists; bringing it back",
                args.name
            );
        }
        wait_ready(&ncps, &args.name, Duration::from_secs(args.timeout)).await?;
        let kc = tenant_kubeconfig(&client, NAMESPACE, &args.name).await?;
        let path = state_dir.join(format!("{}.kubeconfig", args.name));
        nestplane_localplane::write_private(&path, &kc)?;
        let total = started.elapsed();
        eprintln!(
            "nestplane: tenant {} ready in {:.1}s",
            args.name,
            total.as_secs_f64()
        );
        println!("kubectl --kubeconfig {} get ns", path.display());
        let key = nestplane_runtime::process::TenantKey {
            namespace: NAMESPACE.into(),
            cluster: args.name.clone(),
        };
        let startups = running
            .operator
            .as_ref()
            .map(|o| o.runtime().startup_times(&key))
            .unwrap_or_default();
        Ok::<_, anyhow::Error>((total, startups))
    }
    .await;
    match result {
        Ok((total, startups)) => {
            if args.exit_when_ready {
                use nestplane_api::names::Component;
                let t = |c: Component| startups.get(&c).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                // etcd, then the API server, then controller-manager and scheduler in parallel.
                let critical = t(Component::Etcd)
                    + t(Component::ApiServer)
                    + t(Component::ControllerManager).max(t(Component::Scheduler));
                let total = total.as_secs_f64();
                println!("ready_seconds={total:.2}");
                println!("management_plane_seconds={:.2}", mgmt_ready.as_secs_f64());
                if startups.is_empty() {
                    // The kubernetes runtime: start-ups happen in pods, not here.
                    println!("tenant_seconds={:.2}", total - mgmt_ready.as_secs_f64());
                    eprintln!("nestplane: stopping");
                    stop(running).await;
                    return Ok(());
                }
                for c in Component::ALL {
                    println!(
                        "startup_seconds{{component=\"{}\"}}={:.2}",
                        c.short_name(),
                        t(c)
                    );
                }
                println!("component_startup_seconds={critical:.2}");
                println!("outside_component_startup_seconds={:.2}", total - critical);
            } else {
                eprintln!(
                    "nestplane: running; Ctrl-C stops everything (`nestplane up` again brings it back)"
                );
                wait_for_signal().await;
            }
            eprintln!("nestplane: stopping");
            stop(running).await;
            Ok(())
        }
        Err(e) => {
            stop(running).await;
            Err(e)
        }
    }
}

/// The tenant as a HostedCluster with `--nodes` real nodes: created when missing, waited for
/// until it is Available and its NodePool Ready; its admin kubeconfig written next to the
/// state. Returns the time it took.
async fn up_hosted(
    client: &kube::Client,
    state_dir: &Path,
    args: &UpArgs,
    started: Instant,
) -> anyhow::Result<Duration> {
    use nestplane_api::hosted::{HostedCluster, NodePool};
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), NAMESPACE);
    let pools: Api<NodePool> = Api::namespaced(client.clone(), NAMESPACE);
    let version = args
        .version
        .clone()
        .unwrap_or_else(|| nestplane_localplane::DEFAULT_VERSION.into());
    let replicas = i32::try_from(args.nodes).context("--nodes is too large")?;
    let level = match args.pod_security.as_deref() {
        None => None,
        Some(l) => Some(
            serde_json::from_value::<nestplane_api::hosted::PodSecurityLevel>(
                serde_json::Value::String(l.into()),
            )
            .with_context(|| format!("--pod-security {l}"))?,
        ),
    };
    if level == Some(nestplane_api::hosted::PodSecurityLevel::Privileged) {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
        namespaces
            .patch(
                NAMESPACE,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"metadata": {"labels": {
                    nestplane_operator::hosted::pool::PRIVILEGED_ALLOWED_LABEL: "allowed"
                }}})),
            )
            .await
            .context("labelling the namespace for privileged pods")?;
        eprintln!(
            "nestplane: warning: the nodes enforce no pod security: the tenant admin can become root on this machine"
        );
    }
    if let Some(level) = level
        && pools.get_opt(&args.name).await?.is_none()
    {
        // The pool is made here, with its level, rather than from `initialNodes` (a pool
        // made at Baseline and changed would replace its nodes).
        let mut pool = NodePool::new(
            &args.name,
            nestplane_api::hosted::NodePoolSpec {
                cluster_name: args.name.clone(),
                replicas: Some(replicas),
                management: nestplane_api::hosted::NodePoolManagement {
                    upgrade_type: Some("Replace".into()),
                    ..Default::default()
                },
                pod_security: Some(level),
                ..Default::default()
            },
        );
        pool.metadata.namespace = Some(NAMESPACE.into());
        pools
            .create(&PostParams::default(), &pool)
            .await
            .context("creating the NodePool")?;
    }
    let applied = Instant::now();
    // What the benchmark prints: the tenant's nodes joining, seen from inside the tenant.
    let follow = (args.exit_when_ready && args.nodes > 0).then(|| {
        tokio::spawn(follow_nodes(
            client.clone(),
            args.name.clone(),
            args.nodes as usize,
            applied,
            Duration::from_secs(args.timeout + 120),
        ))
    });
    if hcs.get_opt(&args.name).await?.is_none() {
        let mut hc = HostedCluster::new(
            &args.name,
            nestplane_api::hosted::HostedClusterSpec {
                release: nestplane_api::hosted::Release { version },
                initial_nodes: if level.is_some() {
                    None
                } else {
                    Some(replicas)
                },
                ..Default::default()
            },
        );
        hc.metadata.namespace = Some(NAMESPACE.into());
        hcs.create(&PostParams::default(), &hc)
            .await
            .context("creating the HostedCluster")?;
        eprintln!(
            "nestplane: created HostedCluster {NAMESPACE}/{} with {} node(s)",
            args.name, args.nodes
        );
    } else if pools.get_opt(&args.name).await?.is_some() {
        pools
            .patch(
                &args.name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(match level {
                    Some(l) => {
                        serde_json::json!({"spec": {"replicas": args.nodes, "podSecurity": l}})
                    }
                    None => serde_json::json!({"spec": {"replicas": args.nodes}}),
                }),
            )
            .await?;
        eprintln!(
            "nestplane: HostedCluster {NAMESPACE}/{} exists; {} node(s)",
            args.name, args.nodes
        );
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout + 120);
    let changes =
        crate::tenants::wait_hosted(client, NAMESPACE, &args.name, args.nodes, deadline).await?;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
    let kc = secrets
        .get(&format!("{}-admin-kubeconfig", args.name))
        .await?
        .data
        .and_then(|d| d.get("kubeconfig").cloned())
        .context("the admin kubeconfig has no key `kubeconfig`")?;
    let path = state_dir.join(format!("{}.kubeconfig", args.name));
    nestplane_localplane::write_private(&path, &String::from_utf8_lossy(&kc.0))?;
    let total = started.elapsed();
    eprintln!(
        "nestplane: hosted cluster {} with {} node(s) ready in {:.1}s",
        args.name,
        args.nodes,
        total.as_secs_f64()
    );
    println!("kubectl --kubeconfig {} get nodes", path.display());
    if let Some(follow) = follow {
        let mut steps: Vec<(String, Duration)> = changes
            .into_iter()
            .map(|(what, at)| (what, at.saturating_duration_since(applied)))
            .collect();
        // The nodes are Ready by now: the observer has seen it, or cannot (a tenant API
        // this machine does not reach) and its steps are left out.
        if let Ok(Ok(seen)) = tokio::time::timeout(Duration::from_secs(5), follow).await {
            steps.extend(seen);
        }
        println!(
            "hosted_timeline: {}",
            nestplane_nodes::timeline::format(&steps)
        );
    }
    Ok(total)
}

/// The tenant's nodes joining, from `since`: once its admin kubeconfig is published, what
/// [`nestplane_nodes::timeline::observe`] sees inside the tenant until `nodes` are Ready.
async fn follow_nodes(
    client: kube::Client,
    name: String,
    nodes: usize,
    since: Instant,
    timeout: Duration,
) -> Vec<(String, Duration)> {
    let secrets: Api<Secret> = Api::namespaced(client, NAMESPACE);
    let tenant = loop {
        if since.elapsed() > timeout {
            return Vec::new();
        }
        let kc = secrets
            .get_opt(&format!("{name}-admin-kubeconfig"))
            .await
            .ok()
            .flatten()
            .and_then(|s| s.data)
            .and_then(|d| d.get("kubeconfig").cloned())
            .and_then(|kc| {
                kube::config::Kubeconfig::from_yaml(&String::from_utf8_lossy(&kc.0)).ok()
            });
        if let Some(kc) = kc
            && let Ok(config) = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await
            && let Ok(c) = kube::Client::try_from(config)
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut steps = vec![("admin kubeconfig published".to_string(), since.elapsed())];
    steps.extend(
        nestplane_nodes::timeline::observe(
            tenant,
            nestplane_nodes::timeline::Nodes::Count(nodes),
            since,
            timeout,
        )
        .await,
    );
    steps
}

async fn wait_ready(
    ncps: &Api<NestedControlPlane>,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let ncp = ncps.get(name).await?;
        let status = ncp.status.unwrap_or_default();
        if status.ready {
            return Ok(());
        }
        let line = conditions::get(&status.conditions, types::AVAILABLE)
            .map(|c| format!("{}: {}", c.reason, c.message))
            .unwrap_or_else(|| "waiting for the operator".into());
        if line != last {
            eprintln!("nestplane:   {line}");
            last = line;
        }
        if Instant::now() > deadline {
            bail!("the tenant control plane is not ready after {timeout:?}; last state: {last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `nestplane down`: delete the tenant (the operator stops its processes and removes its data
/// and secrets).
pub async fn down(args: DownArgs) -> anyhow::Result<()> {
    let state_dir = runtime_root(&args.state_dir, &args.runtime);
    if !state_dir.join("management").exists() {
        eprintln!("nestplane: nothing in {}", state_dir.display());
        return Ok(());
    }
    let running = start(&state_dir, &args.runtime, vec![]).await?;
    let result = async {
        let hcs: Api<nestplane_api::hosted::HostedCluster> =
            Api::namespaced(running.plane.client(), NAMESPACE);
        if hcs.get_opt(&args.name).await?.is_some() {
            hcs.delete(&args.name, &DeleteParams::default()).await?;
            let deadline = Instant::now() + Duration::from_secs(300);
            while hcs.get_opt(&args.name).await?.is_some() {
                if Instant::now() > deadline {
                    bail!(
                        "HostedCluster {NAMESPACE}/{} still exists after 300s",
                        args.name
                    );
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            eprintln!(
                "nestplane: deleted hosted cluster {} and its nodes",
                args.name
            );
        }
        let ncps: Api<NestedControlPlane> = Api::namespaced(running.plane.client(), NAMESPACE);
        if ncps.get_opt(&args.name).await?.is_some() {
            ncps.delete(&args.name, &DeleteParams::default()).await?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while ncps.get_opt(&args.name).await?.is_some() {
                if Instant::now() > deadline {
                    bail!(
                        "NestedControlPlane {NAMESPACE}/{} still exists after 60s",
                        args.name
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            eprintln!("nestplane: deleted tenant {}", args.name);
        } else {
            eprintln!("nestplane: no tenant {}", args.name);
        }
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_file(state_dir.join(format!("{}.kubeconfig", args.name)));
        Ok(())
    }
    .await;
    stop(running).await;
    result?;
    if args.purge {
        std::fs::remove_dir_all(&state_dir)
            .with_context(|| format!("removing {}", state_dir.display()))?;
        eprintln!("nestplane: removed {}", state_dir.display());
    }
    Ok(())
}

/// Wait for Ctrl-C or SIGTERM.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            // Without a signal handler, there is nothing to wait for.
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
