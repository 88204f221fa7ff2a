//! nestplane's controllers: `NestedControlPlane` and one per component kind, running
//! components through one [`runtime::Runtime`] seam (`process` or `kubernetes`).
//!
//! Each controller reads, calls the pure core (`render`, `pki`, [`status`]), applies, and
//! writes status only when it changed.

pub mod applied;
pub mod clock;
pub mod component;
pub mod context;
pub mod crds;
pub mod datastore;
pub mod endpoint;
pub mod error;
pub mod hosted;
pub mod leader;
pub mod ncp;
pub mod pacing;
pub mod postcreate;
pub mod process;
pub mod runtime;
pub mod secrets;
pub mod server;
pub mod shared;
pub mod status;
pub mod tenant;
pub mod workloads;
pub mod written;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use nestplane_api::{
    NestedAPIServer, NestedControlPlane, NestedControllerManager, NestedEtcd, NestedScheduler,
};
use nestplane_runtime::process::ProcessRuntime;
use shared::Shared;
use tokio_util::sync::CancellationToken;

pub use context::{Context, Controllers, Error, KubernetesSettings, Metrics, Mode};

/// How the operator runs.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// Watch only this namespace (clusterctl's `--namespace`); all namespaces when `None`.
    pub namespace: Option<String>,
    /// Only reconcile control planes labelled `cluster.x-k8s.io/watch-filter=<value>`.
    pub watch_filter: Option<String>,
    /// Where the process runtime keeps tenant data.
    pub state_dir: PathBuf,
    /// Serve `/metrics`, `/healthz`, `/readyz` here.
    pub metrics_addr: Option<SocketAddr>,
    /// Where components run.
    pub mode: Mode,
    /// Reconcile only while holding this Lease (several replicas: one leads).
    pub leader_election: Option<leader::LeaderElection>,
    /// When certificates are due (the system clock unless a test moves it).
    pub clock: clock::Clock,
    /// Which component controllers run here (all by default).
    pub controllers: Controllers,
    /// Where NodePools make nodes on this machine (`None`: no nodes are made).
    pub nodes: Option<hosted::pool::NodeSettings>,
    /// How hosted clusters get cluster DNS.
    pub dns: hosted::dns::DnsSettings,
}

fn api<K>(client: &kube::Client, ns: &Option<String>) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

fn error_policy<K>(obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action
where
    K: kube::Resource<DynamicType = ()>,
{
    let delay = ctx.pacing.error(&context::object_key(obj.as_ref()));
    tracing::warn!(object = %kube::ResourceExt::name_any(obj.as_ref()), error = %err, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// How many reconciles of one controller run at once: enough to keep the API server busy
/// while a thousand control planes are created, few enough that a burst does not open a
/// connection and hold a pass's memory per object.
pub const CONCURRENCY: u16 = 32;

/// How long the control plane controller waits after an event for more (see `run_with`).
pub const NCP_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(50);

fn controller_config() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(CONCURRENCY)
}

/// A dependency's change reaches the components of its control plane that wait for it at
/// once, rather than through the control plane's status (one write and one pass fewer on the
/// way from "etcd is Ready" to "the API server starts").
fn dependents<D, K>(
    ncps: &Store<NestedControlPlane>,
) -> impl Fn(Arc<D>) -> Option<ObjectRef<K>> + Send + Sync + 'static
where
    D: tenant::ComponentKind,
    K: tenant::ComponentKind,
{
    let ncps = ncps.clone();
    move |d: Arc<D>| {
        let ns = d.namespace()?;
        let owner = tenant::controller_of(d.as_ref())?;
        let ncp = ncps.get(&ObjectRef::new(&owner.name).within(&ns))?;
        let name = tenant::reference(&ncp, K::COMPONENT)?.name.clone()?;
        Some(ObjectRef::new(&name).within(&ns))
    }
}

/// How long reconciles in flight may take to finish after a stop was asked for.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// What a controller's stream yields, made visible: a failed watch (an RBAC refusal, a lost
/// connection) is logged, counted, and fails `/readyz` (an expired watch that relists is only
/// counted); reconcile errors are already counted
/// and backed off by the error policy.
fn report<T, E: std::fmt::Display>(
    controller: impl Into<String>,
    ctx: &Arc<Context>,
) -> impl FnMut(Result<T, kube::runtime::controller::Error<E, watcher::Error>>) -> std::future::Ready<()>
{
    let controller = controller.into();
    let ctx = ctx.clone();
    move |r| {
        if let Err(kube::runtime::controller::Error::QueueError(e)) = r {
            ctx.metrics.watch_error(&ctx.health, &controller, &e);
        }
        std::future::ready(())
    }
}

/// Run the controllers until `shutdown` is cancelled; then stop every tenant process.
pub async fn run(
    client: kube::Client,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let runtime = Arc::new(ProcessRuntime::new(&config.state_dir));
    run_with(client, config, runtime, shutdown).await
}

/// [`run`] with a given runtime.
pub async fn run_with(
    client: kube::Client,
    config: Config,
    runtime: Arc<ProcessRuntime>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if matches!(config.mode, Mode::Process) {
        // Tenant API servers run on this machine and call Service addresses (webhooks,
        // aggregated APIs): nothing for a range nestplane hands out may leave it.
        match nestplane_nodes::net::install_unreachable(nestplane_nodes::net::HANDED_OUT) {
            Ok(skipped) => {
                for s in skipped {
                    tracing::warn!("{s}");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot make nestplane's ranges unreachable"),
        }
    }
    let mut ctx = Context::new(client.clone(), runtime.clone(), config.mode.clone());
    ctx.watch_filter = config.watch_filter.clone();
    ctx.clock = config.clock.clone();
    ctx.controllers = config.controllers.clone();
    ctx.node_settings = config.nodes.clone();
    ctx.dns = config.dns.clone();
    let ctx = Arc::new(ctx);
    // Every request from here on, watches included, goes through the counting client.
    let client = ctx.client.clone();
    if let Some(addr) = config.metrics_addr {
        let metrics = ctx.metrics.clone();
        let health = ctx.health.clone();
        let token = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = server::serve(addr, metrics, health, token).await {
                tracing::error!(error = %e, %addr, "metrics server failed");
            }
        });
    }
    // With leader election, nothing below runs (no reconcile, no write) until this replica
    // leads, and everything stops the moment it does not.
    let stop = CancellationToken::new();
    let lost = CancellationToken::new();
    let release = CancellationToken::new();
    let mut keeper = None;
    if let Some(le) = &config.leader_election {
        if !leader::acquire(&client, le, &shutdown).await {
            return Ok(());
        }
        keeper = Some(tokio::spawn(leader::keep(
            client.clone(),
            le.clone(),
            lost.clone(),
            release.clone(),
        )));
    }
    {
        let (stop, lost, shutdown) = (stop.clone(), lost.clone(), shutdown.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = lost.cancelled() => {}
            }
            stop.cancel();
        });
    }
    let shutdown = stop;
    let ns = &config.namespace;
    let mut ncp_watch = watcher::Config::default();
    if let Some(f) = &config.watch_filter {
        ncp_watch = ncp_watch.labels(&format!("{}={f}", context::WATCH_FILTER_LABEL));
    }
    let wc = watcher::Config::default;
    let workloads = matches!(config.mode, Mode::Kubernetes(_));
    // nestplane's own objects (secrets, workloads, Services) carry this label.
    let managed = || {
        wc().labels(&format!(
            "{}={}",
            nestplane_api::names::MANAGED_BY_LABEL,
            nestplane_api::names::MANAGED_BY
        ))
    };
    // One watch and one cache per kind, whatever number of controllers follow it (see
    // `shared`). A subscription must be consumed: only running controllers subscribe.
    let mut ncps_w = Shared::<NestedControlPlane>::new("NestedControlPlane");
    let mut etcds_w = Shared::<NestedEtcd>::new("NestedEtcd");
    let mut apiservers_w = Shared::<NestedAPIServer>::new("NestedAPIServer");
    let mut cms_w = Shared::<NestedControllerManager>::new("NestedControllerManager");
    let mut schedulers_w = Shared::<NestedScheduler>::new("NestedScheduler");
    let mut datastores_w = Shared::<nestplane_api::NestedDatastore>::new("NestedDatastore");
    // nestplane's own secrets: a pass reads certificates from here.
    let secrets_w = Shared::<Secret>::new("Secret");
    // The kubernetes runtime's workloads and Services: a pass that would apply the same
    // object again reads it from here instead (see `applied`).
    let mut statefulsets_w = Shared::<StatefulSet>::new("StatefulSet");
    let mut deployments_w = Shared::<Deployment>::new("Deployment");
    let services_w = Shared::<Service>::new("Service");
    let ncps = ncps_w.store_into(&ctx.caches.ncps);
    etcds_w.store_into(&ctx.caches.etcds);
    apiservers_w.store_into(&ctx.caches.apiservers);
    cms_w.store_into(&ctx.caches.controller_managers);
    schedulers_w.store_into(&ctx.caches.schedulers);
    datastores_w.store_into(&ctx.caches.datastores);
    secrets_w.store_into(&ctx.caches.secrets);
    if workloads {
        statefulsets_w.store_into(&ctx.applied.statefulsets);
        deployments_w.store_into(&ctx.applied.deployments);
        services_w.store_into(&ctx.applied.services);
    }

    // Debounced: the events of one control plane's creation (its own patches, four
    // components, their first status) come in a burst and make one pass.
    let ncp_ctl = Controller::for_shared_stream(ncps_w.subscribe(), ncps.clone())
        .with_config(controller_config().debounce(NCP_DEBOUNCE));
    // A component change reaches every control plane that references it, owned or not (so
    // creating a component that a reference was waiting for heals the control plane).
    fn referencing<K: tenant::ComponentKind>(
        ncps: &Store<NestedControlPlane>,
    ) -> impl Fn(Arc<K>) -> Vec<ObjectRef<NestedControlPlane>> + Send + Sync + 'static {
        let ncps = ncps.clone();
        move |component: Arc<K>| {
            let (Some(cns), cname) = (component.namespace(), component.name_any()) else {
                return Vec::new();
            };
            ncps.state()
                .iter()
                .filter(|ncp| {
                    let ns = ncp.namespace().unwrap_or_default();
                    tenant::reference(ncp, K::COMPONENT).is_some_and(|r| {
                        r.name.as_deref() == Some(cname.as_str())
                            && r.namespace.as_deref().unwrap_or(ns.as_str()) == cns
                            && ns == cns
                    })
                })
                .map(|ncp| ObjectRef::from_obj(ncp.as_ref()))
                .collect()
        }
    }
    // Shared datastores: their etcd's status and their tenants bring them back; a datastore's
    // change brings back the control planes that use it.
    let ds_ctl = Controller::for_shared_stream(datastores_w.subscribe(), datastores_w.store())
        .owns_shared_stream(etcds_w.subscribe())
        .watches_shared_stream(ncps_w.subscribe(), |ncp: Arc<NestedControlPlane>| {
            let (ns, name) = datastore::referenced(&ncp)?;
            Some(ObjectRef::new(&name).within(&ns))
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(datastore::reconcile, error_policy, ctx.clone())
        .for_each(report("NestedDatastore", &ctx))
        .boxed();
    let users_of = {
        let ncps = ncps.clone();
        move |ds: Arc<nestplane_api::NestedDatastore>| {
            let key = (ds.namespace().unwrap_or_default(), ds.name_any());
            ncps.state()
                .iter()
                .filter(|ncp| datastore::referenced(ncp).as_ref() == Some(&key))
                .map(|ncp| ObjectRef::from_obj(ncp.as_ref()))
                .collect::<Vec<_>>()
        }
    };
    let ncp_ctl = ncp_ctl
        .watches_shared_stream(etcds_w.subscribe(), referencing(&ncps))
        .watches_shared_stream(datastores_w.subscribe(), users_of)
        .watches_shared_stream(apiservers_w.subscribe(), referencing(&ncps))
        .watches_shared_stream(cms_w.subscribe(), referencing(&ncps))
        .watches_shared_stream(schedulers_w.subscribe(), referencing(&ncps))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(ncp::reconcile, error_policy, ctx.clone())
        .for_each(report("NestedControlPlane", &ctx))
        .boxed();

    // A change of the control plane (version, replicas, pause) reaches its components.
    fn refs<K: tenant::ComponentKind>(ncp: Arc<NestedControlPlane>) -> Option<ObjectRef<K>> {
        let ns = kube::ResourceExt::namespace(ncp.as_ref())?;
        let name = tenant::reference(&ncp, K::COMPONENT)?.name.clone()?;
        Some(ObjectRef::new(&name).within(&ns))
    }
    // A kind whose controller does not run here (`--controllers`) is someone else's: its
    // objects are only read, from the cache. A component controller also watches what it
    // waits for (seed 000's order), and in the kubernetes runtime its workload's rollout:
    // etcd is a StatefulSet, the others are Deployments.
    macro_rules! component_controller {
        ($k:ty, $own:ident, $workload:ident $(, $dep:ty, $dep_w:ident)?) => {{
            let kind = <$k as kube::Resource>::kind(&()).to_string();
            let enabled = ctx
                .controllers
                .runs(<$k as tenant::ComponentKind>::COMPONENT);
            if !enabled {
                tracing::info!(%kind, "controller not run by this operator (--controllers)");
            }
            enabled.then(|| {
                let ctl = Controller::for_shared_stream($own.subscribe(), $own.store())
                    .with_config(controller_config())
                    .watches_shared_stream(ncps_w.subscribe(), refs::<$k>);
                $(let ctl = ctl.watches_shared_stream(
                    $dep_w.subscribe(),
                    dependents::<$dep, $k>(&ncps),
                );)?
                let ctl = if workloads {
                    ctl.owns_shared_stream($workload.subscribe())
                } else {
                    ctl
                };
                ctl.graceful_shutdown_on(shutdown.clone().cancelled_owned())
                    .run(component::reconcile::<$k>, error_policy, ctx.clone())
                    .for_each(report(kind, &ctx))
        .boxed()
            })
        }};
    }
    let etcd_ctl = component_controller!(NestedEtcd, etcds_w, statefulsets_w);
    let apiserver_ctl = component_controller!(
        NestedAPIServer,
        apiservers_w,
        deployments_w,
        NestedEtcd,
        etcds_w
    );
    let cm_ctl = component_controller!(
        NestedControllerManager,
        cms_w,
        deployments_w,
        NestedAPIServer,
        apiservers_w
    );
    let scheduler_ctl = component_controller!(
        NestedScheduler,
        schedulers_w,
        deployments_w,
        NestedAPIServer,
        apiservers_w
    );
    async fn maybe(f: Option<impl std::future::Future<Output = ()>>) {
        if let Some(f) = f {
            f.await
        }
    }
    // PostCreateConfigs: looked at again when a control plane in their namespace changes
    // (initialized, labelled), when a Secret they use or a kubeconfig appears or changes, and
    // when a Cluster changes (where the kind is served; a watch that cannot start is only
    // retried, quietly).
    let pcc_ctl = Controller::new(api::<nestplane_api::PostCreateConfig>(&client, ns), wc());
    let pccs = pcc_ctl.store();
    let secret_trigger = {
        let pccs = pccs.clone();
        watcher(
            api::<kube::core::PartialObjectMeta<Secret>>(&client, ns),
            wc(),
        )
        .default_backoff()
        .touched_objects()
        .filter_map(move |r| {
            let hit = r.ok().is_some_and(|s| {
                postcreate::secret_matters(&pccs, &s.namespace().unwrap_or_default(), &s.name_any())
            });
            std::future::ready(hit.then_some(()))
        })
    };
    let cluster_trigger = {
        let ar = kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk(
                nestplane_api::names::CLUSTER_API_GROUP,
                "v1beta1",
                "Cluster",
            ),
            "clusters",
        );
        let api: Api<kube::api::DynamicObject> = match ns {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
            None => Api::all_with(client.clone(), &ar),
        };
        watcher(api, wc())
            .default_backoff()
            .touched_objects()
            .filter_map(|r| std::future::ready(r.ok().map(|_| ())))
    };
    let pcc_ctl = pcc_ctl
        .watches_shared_stream(ncps_w.subscribe(), move |ncp: Arc<NestedControlPlane>| {
            postcreate::in_namespace(&pccs, ncp.namespace())
        })
        .reconcile_all_on(secret_trigger)
        .reconcile_all_on(cluster_trigger)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(postcreate::reconcile, error_policy, ctx.clone())
        .for_each(report("PostCreateConfig", &ctx))
        .boxed();
    // HostedClusters: their control plane (by annotation, across namespaces) and their
    // NodePools bring them back; NodePools follow their HostedCluster.
    let hc_ctl = Controller::new(api::<nestplane_api::HostedCluster>(&client, ns), wc());
    let pool_ctl = Controller::new(api::<nestplane_api::NodePool>(&client, ns), wc());
    let pools = pool_ctl.store();
    fn hosted_cluster_of(
        ncp: &NestedControlPlane,
    ) -> Option<ObjectRef<nestplane_api::HostedCluster>> {
        let v = ncp
            .annotations()
            .get(hosted::cluster::HOSTED_CLUSTER_ANNOTATION)?;
        let (ns, name) = v.split_once('/')?;
        Some(ObjectRef::new(name).within(ns))
    }
    // The shared watch sees what this operator selects; a HostedCluster's control plane may
    // be in another namespace or (made before the filter) unlabelled: then it watches its own.
    let hc_ctl = if ns.is_none() && config.watch_filter.is_none() {
        hc_ctl.watches_shared_stream(ncps_w.subscribe(), |ncp: Arc<NestedControlPlane>| {
            hosted_cluster_of(&ncp)
        })
    } else {
        hc_ctl.watches(
            Api::<NestedControlPlane>::all(client.clone()),
            wc(),
            |ncp| hosted_cluster_of(&ncp),
        )
    };
    let hc_ctl = hc_ctl
        .watches(api::<nestplane_api::NodePool>(&client, ns), wc(), |p| {
            Some(ObjectRef::new(&p.spec.cluster_name).within(&p.namespace()?))
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(hosted::cluster::reconcile, error_policy, ctx.clone())
        .for_each(report("HostedCluster", &ctx))
        .boxed();
    let pool_ctl = pool_ctl
        .watches(
            api::<nestplane_api::HostedCluster>(&client, ns),
            wc(),
            move |hc| {
                let ns = hc.namespace();
                pools
                    .state()
                    .iter()
                    .filter(|p| p.namespace() == ns && p.spec.cluster_name == hc.name_any())
                    .map(|p| ObjectRef::from_obj(p.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(hosted::pool::reconcile, error_policy, ctx.clone())
        .for_each(report("NodePool", &ctx))
        .boxed();
    // Every subscription is made: the watches can start.
    let watches = async {
        tokio::join!(
            ncps_w.run(&ctx, api(&client, ns), ncp_watch, shared::whole, &shutdown),
            etcds_w.run(&ctx, api(&client, ns), wc(), shared::whole, &shutdown),
            apiservers_w.run(&ctx, api(&client, ns), wc(), shared::whole, &shutdown),
            cms_w.run(&ctx, api(&client, ns), wc(), shared::whole, &shutdown),
            schedulers_w.run(&ctx, api(&client, ns), wc(), shared::whole, &shutdown),
            datastores_w.run(&ctx, api(&client, ns), wc(), shared::whole, &shutdown),
            secrets_w.run(&ctx, api(&client, ns), managed(), shared::whole, &shutdown),
        );
    };
    let workload_watches = workloads.then_some(async {
        tokio::join!(
            statefulsets_w.run(
                &ctx,
                api(&client, ns),
                managed(),
                |s| {
                    // Nor is the pod template read (the rollout is in the status).
                    if let Some(spec) = s.spec.as_mut() {
                        spec.template = Default::default();
                        spec.volume_claim_templates = None;
                    }
                },
                &shutdown,
            ),
            deployments_w.run(
                &ctx,
                api(&client, ns),
                managed(),
                |d| {
                    if let Some(spec) = d.spec.as_mut() {
                        spec.template = Default::default();
                    }
                },
                &shutdown,
            ),
            services_w.run(&ctx, api(&client, ns), managed(), shared::whole, &shutdown),
        );
    });
    let controllers = async {
        tokio::join!(
            watches,
            maybe(workload_watches),
            ncp_ctl,
            ds_ctl,
            pcc_ctl,
            hc_ctl,
            pool_ctl,
            maybe(etcd_ctl),
            maybe(apiserver_ctl),
            maybe(cm_ctl),
            maybe(scheduler_ctl),
        )
    };
    // Reconciles in flight get a grace period to finish; a controller whose watch keeps
    // failing does not end by itself, so it is dropped after that.
    tokio::select! {
        _ = controllers => {}
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!("controllers did not stop within {SHUTDOWN_GRACE:?}; stopping them"),
    }
    runtime.shutdown().await;
    ctx.nodes.remove_all().await;
    // Processes are down: the Lease can go to the next leader.
    release.cancel();
    if let Some(k) = keeper {
        let _ = k.await;
    }
    if lost.is_cancelled() {
        return Err(Error::Internal(
            "leadership lost: stopped reconciling so that the new leader alone writes".into(),
        ));
    }
    Ok(())
}

/// The operator running in the background of this process (used by `nestplane up` and tests).
pub struct Operator {
    token: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), Error>>,
    runtime: Arc<ProcessRuntime>,
}

impl Operator {
    /// Start the controllers.
    pub fn start(client: kube::Client, config: Config) -> Operator {
        let token = CancellationToken::new();
        let runtime = Arc::new(ProcessRuntime::new(&config.state_dir));
        let handle = tokio::spawn(run_with(client, config, runtime.clone(), token.clone()));
        Operator {
            token,
            handle,
            runtime,
        }
    }

    /// The process runtime (start-up times, pids).
    pub fn runtime(&self) -> &Arc<ProcessRuntime> {
        &self.runtime
    }

    /// Whether the controllers have stopped by themselves (leadership lost, a fatal error).
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Stop the controllers and every tenant process.
    pub async fn stop(self) -> Result<(), Error> {
        self.token.cancel();
        self.handle
            .await
            .map_err(|e| Error::Internal(e.to_string()))?
    }
}
