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
pub mod status;
pub mod tenant;
pub mod workloads;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
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

/// A watch cache of `K` filling `slot`, until `shutdown`; a failed watch is logged, counted
/// and fails `/readyz`, and is retried with backoff.
fn cache<K>(
    ctx: &Arc<Context>,
    kind: &'static str,
    slot: &std::sync::OnceLock<Store<K>>,
    api: Api<K>,
    config: watcher::Config,
    slim: fn(&mut K),
    shutdown: &CancellationToken,
) -> impl std::future::Future<Output = ()> + use<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = kube::runtime::reflector::store();
    let _ = slot.set(reader);
    let ctx = ctx.clone();
    kube::runtime::reflector(
        writer,
        watcher(api, config)
            .default_backoff()
            .modify(move |o: &mut K| {
                // What a pass reads is the rollout and the markers (see `applied`): the field
                // managers are the largest part of an applied object and are never read.
                o.meta_mut().managed_fields = None;
                slim(o);
            }),
    )
    .take_until(shutdown.clone().cancelled_owned())
    .for_each(move |r| {
        if let Err(e) = r {
            tracing::error!(error = %e, kind, "watch failed");
            ctx.metrics.watch_failed(kind);
            ctx.health.watch_failed(kind, e.to_string());
        }
        std::future::ready(())
    })
}

/// [`ncp::reconcile`], looking again soon at a control plane that is not Ready yet.
///
/// A component's change reaches its control plane through a watch of its own, which may
/// deliver the event before the component controller's cache (which the pass reads) has the
/// change: the pass then computes the status from the older component. While the tenant is
/// not Ready, a look after [`pacing`]'s starting delay (fast at first where readiness is
/// probed, backed off where it is watched) bounds what that costs; a Ready tenant is looked
/// at as `ncp::reconcile` says.
async fn reconcile_ncp(ncp: Arc<NestedControlPlane>, ctx: Arc<Context>) -> Result<Action, Error> {
    let action = ncp::reconcile(ncp.clone(), ctx.clone()).await?;
    let key = format!("ready/{}", context::object_key(ncp.as_ref()));
    let ready = ctx
        .metrics
        .tenant_ready(&ncp.namespace().unwrap_or_default(), &ncp.name_any());
    if ready != Some(false) || ncp.metadata.deletion_timestamp.is_some() {
        ctx.pacing.forget(&key);
        return Ok(action);
    }
    // Only the periodic look is shortened: a paused or invalid control plane still waits for
    // a change.
    if action != Action::requeue(ncp::RESYNC) {
        return Ok(action);
    }
    Ok(Action::requeue(if ctx.runtime.readiness_is_watched() {
        ctx.pacing.starting(&key)
    } else {
        ctx.pacing.waiting(&key)
    }))
}

/// A dependency's change reaches the components of its control plane that wait for it at
/// once, rather than through the control plane's status (one write and one pass fewer on the
/// way from "etcd is Ready" to "the API server starts").
fn dependents<D, K>(
    ncps: &Store<NestedControlPlane>,
) -> impl Fn(D) -> Option<ObjectRef<K>> + Send + Sync + 'static
where
    D: tenant::ComponentKind,
    K: tenant::ComponentKind,
{
    let ncps = ncps.clone();
    move |d: D| {
        let ns = d.namespace()?;
        let owner = tenant::controller_of(&d)?;
        let ncp = ncps.get(&ObjectRef::new(&owner.name).within(&ns))?;
        let name = tenant::reference(&ncp, K::COMPONENT)?.name.clone()?;
        Some(ObjectRef::new(&name).within(&ns))
    }
}

/// The component controller of `K`, also watching what `K` waits for (seed 000's order).
fn with_dependencies<K: tenant::ComponentKind>(
    ctl: Controller<K>,
    client: &kube::Client,
    ns: &Option<String>,
    ncps: &Store<NestedControlPlane>,
) -> Controller<K> {
    use nestplane_api::names::Component;
    let wc = watcher::Config::default;
    match K::COMPONENT {
        Component::Etcd => ctl,
        Component::ApiServer => ctl.watches(
            api::<NestedEtcd>(client, ns),
            wc(),
            dependents::<NestedEtcd, K>(ncps),
        ),
        Component::ControllerManager | Component::Scheduler => ctl.watches(
            api::<NestedAPIServer>(client, ns),
            wc(),
            dependents::<NestedAPIServer, K>(ncps),
        ),
    }
}

/// How long reconciles in flight may take to finish after a stop was asked for.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// What a controller's stream yields, made visible: a failed watch (an RBAC refusal, a lost
/// connection) is logged, counted, and fails `/readyz`; reconcile errors are already counted
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
            tracing::error!(controller = %controller, error = %e, "watch failed");
            ctx.metrics.watch_failed(&controller);
            ctx.health.watch_failed(&controller, e.to_string());
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
    // Debounced: the events of one control plane's creation (its own patches, four
    // components, their first status) come in a burst and make one pass; and that pass reads
    // the components' caches after they had time to take the change that triggered it.
    let ncp_ctl = Controller::new(api::<NestedControlPlane>(&client, ns), ncp_watch)
        .with_config(controller_config().debounce(NCP_DEBOUNCE));
    let ncps = ncp_ctl.store();
    let _ = ctx.caches.ncps.set(ncps.clone());
    // A component change reaches every control plane that references it, owned or not (so
    // creating a component that a reference was waiting for heals the control plane).
    fn referencing<K: tenant::ComponentKind>(
        ncps: &Store<NestedControlPlane>,
    ) -> impl Fn(K) -> Vec<ObjectRef<NestedControlPlane>> + Send + Sync + 'static {
        let ncps = ncps.clone();
        move |component: K| {
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
    let ds_ctl = Controller::new(api::<nestplane_api::NestedDatastore>(&client, ns), wc());
    let _ = ctx.caches.datastores.set(ds_ctl.store());
    let ds_ctl = ds_ctl
        .owns(api::<NestedEtcd>(&client, ns), wc())
        .watches(api::<NestedControlPlane>(&client, ns), wc(), |ncp| {
            let (ns, name) = datastore::referenced(&ncp)?;
            Some(ObjectRef::new(&name).within(&ns))
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(datastore::reconcile, error_policy, ctx.clone())
        .for_each(report("NestedDatastore", &ctx));
    let users_of = {
        let ncps = ncps.clone();
        move |ds: nestplane_api::NestedDatastore| {
            let key = (ds.namespace().unwrap_or_default(), ds.name_any());
            ncps.state()
                .iter()
                .filter(|ncp| datastore::referenced(ncp).as_ref() == Some(&key))
                .map(|ncp| ObjectRef::from_obj(ncp.as_ref()))
                .collect::<Vec<_>>()
        }
    };
    let ncp_ctl = ncp_ctl
        .watches(api::<NestedEtcd>(&client, ns), wc(), referencing(&ncps))
        .watches(
            api::<nestplane_api::NestedDatastore>(&client, ns),
            wc(),
            users_of,
        )
        .watches(
            api::<NestedAPIServer>(&client, ns),
            wc(),
            referencing(&ncps),
        )
        .watches(
            api::<NestedControllerManager>(&client, ns),
            wc(),
            referencing(&ncps),
        )
        .watches(
            api::<NestedScheduler>(&client, ns),
            wc(),
            referencing(&ncps),
        )
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_ncp, error_policy, ctx.clone())
        .for_each(report("NestedControlPlane", &ctx));

    // A change of the control plane (version, replicas, pause) reaches its components.
    fn refs<K: tenant::ComponentKind>(ncp: NestedControlPlane) -> Option<ObjectRef<K>> {
        let ns = kube::ResourceExt::namespace(&ncp)?;
        let name = tenant::reference(&ncp, K::COMPONENT)?.name.clone()?;
        Some(ObjectRef::new(&name).within(&ns))
    }
    let workloads = matches!(config.mode, Mode::Kubernetes(_));
    // A kind whose controller does not run here (`--controllers`) is someone else's: its
    // objects are only read (through a GET, there being no cache of them).
    macro_rules! component_controller {
        ($k:ty) => {{
            let kind = <$k as kube::Resource>::kind(&()).to_string();
            let enabled = ctx
                .controllers
                .runs(<$k as tenant::ComponentKind>::COMPONENT);
            if !enabled {
                tracing::info!(%kind, "controller not run by this operator (--controllers)");
            }
            enabled.then(|| component_controller!(@run $k, kind))
        }};
        (@run $k:ty, $kind:expr) => {{
            let ctl = Controller::new(api::<$k>(&client, ns), wc()).with_config(controller_config());
            let _ = <$k as tenant::ComponentKind>::cache_slot(&ctx.caches).set(ctl.store());
            let ctl = ctl.watches(api::<NestedControlPlane>(&client, ns), wc(), refs::<$k>);
            let ctl = with_dependencies(ctl, &client, ns, &ncps);
            // In the kubernetes runtime a workload's rollout reaches its component: etcd is
            // a StatefulSet, the others are Deployments.
            let etcd = <$k as tenant::ComponentKind>::COMPONENT == nestplane_api::names::Component::Etcd;
            let ctl = match (workloads, etcd) {
                (true, true) => ctl.owns(api::<StatefulSet>(&client, ns), wc()),
                (true, false) => ctl.owns(api::<Deployment>(&client, ns), wc()),
                (false, _) => ctl,
            };
            ctl.graceful_shutdown_on(shutdown.clone().cancelled_owned())
                .run(component::reconcile::<$k>, error_policy, ctx.clone())
                .for_each(report($kind, &ctx))
        }};
    }
    async fn maybe(f: Option<impl std::future::Future<Output = ()>>) {
        if let Some(f) = f {
            f.await
        }
    }
    // nestplane's own secrets, cached: a pass reads certificates from here.
    let (secret_reader, secret_writer) = kube::runtime::reflector::store();
    let _ = ctx.caches.secrets.set(secret_reader);
    // With backoff: a watch that fails at once (the API server gone) must not spin.
    let secret_watch = kube::runtime::reflector(
        secret_writer,
        watcher(
            api::<k8s_openapi::api::core::v1::Secret>(&client, ns),
            wc().labels(&format!(
                "{}={}",
                nestplane_api::names::MANAGED_BY_LABEL,
                nestplane_api::names::MANAGED_BY
            )),
        )
        .default_backoff()
        .modify(|s: &mut k8s_openapi::api::core::v1::Secret| s.metadata.managed_fields = None),
    )
    .take_until(shutdown.clone().cancelled_owned())
    .for_each({
        let ctx = ctx.clone();
        move |r| {
            if let Err(e) = r {
                tracing::error!(error = %e, "secret watch failed");
                ctx.metrics.watch_failed("Secret");
                ctx.health.watch_failed("Secret", e.to_string());
            }
            std::future::ready(())
        }
    });
    // The kubernetes runtime's workloads and Services, cached: a pass that would apply the
    // same object again reads it from here instead (see `applied`).
    let managed = || {
        wc().labels(&format!(
            "{}={}",
            nestplane_api::names::MANAGED_BY_LABEL,
            nestplane_api::names::MANAGED_BY
        ))
    };
    let applied_watch = workloads.then(|| {
        futures::future::join3(
            cache(
                &ctx,
                "StatefulSet",
                &ctx.applied.statefulsets,
                api::<StatefulSet>(&client, ns),
                managed(),
                |s| {
                    // Nor is the pod template (the rollout is in the status).
                    if let Some(spec) = s.spec.as_mut() {
                        spec.template = Default::default();
                        spec.volume_claim_templates = None;
                    }
                },
                &shutdown,
            ),
            cache(
                &ctx,
                "Deployment",
                &ctx.applied.deployments,
                api::<Deployment>(&client, ns),
                managed(),
                |d| {
                    if let Some(spec) = d.spec.as_mut() {
                        spec.template = Default::default();
                    }
                },
                &shutdown,
            ),
            cache(
                &ctx,
                "Service",
                &ctx.applied.services,
                api::<k8s_openapi::api::core::v1::Service>(&client, ns),
                managed(),
                |_| {},
                &shutdown,
            ),
        )
        .map(|_| ())
    });
    // PostCreateConfigs: looked at again when a control plane in their namespace changes
    // (initialized, labelled), when a Secret they use or a kubeconfig appears or changes, and
    // when a Cluster changes (where the kind is served; a watch that cannot start is only
    // retried, quietly).
    let pcc_ctl = Controller::new(api::<nestplane_api::PostCreateConfig>(&client, ns), wc());
    let pccs = pcc_ctl.store();
    let secret_trigger = {
        let pccs = pccs.clone();
        watcher(
            api::<kube::core::PartialObjectMeta<k8s_openapi::api::core::v1::Secret>>(&client, ns),
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
        .watches(api::<NestedControlPlane>(&client, ns), wc(), move |ncp| {
            postcreate::in_namespace(&pccs, ncp.namespace())
        })
        .reconcile_all_on(secret_trigger)
        .reconcile_all_on(cluster_trigger)
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(postcreate::reconcile, error_policy, ctx.clone())
        .for_each(report("PostCreateConfig", &ctx));
    // HostedClusters: their control plane (by annotation, across namespaces) and their
    // NodePools bring them back; NodePools follow their HostedCluster.
    let hc_ctl = Controller::new(api::<nestplane_api::HostedCluster>(&client, ns), wc());
    let pool_ctl = Controller::new(api::<nestplane_api::NodePool>(&client, ns), wc());
    let pools = pool_ctl.store();
    let hc_ctl = hc_ctl
        .watches(
            Api::<NestedControlPlane>::all(client.clone()),
            wc(),
            |ncp| {
                let v = ncp
                    .annotations()
                    .get(hosted::cluster::HOSTED_CLUSTER_ANNOTATION)?;
                let (ns, name) = v.split_once('/')?;
                Some(ObjectRef::new(name).within(ns))
            },
        )
        .watches(api::<nestplane_api::NodePool>(&client, ns), wc(), |p| {
            Some(ObjectRef::new(&p.spec.cluster_name).within(&p.namespace()?))
        })
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(hosted::cluster::reconcile, error_policy, ctx.clone())
        .for_each(report("HostedCluster", &ctx));
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
        .for_each(report("NodePool", &ctx));
    let controllers = async {
        tokio::join!(
            secret_watch,
            maybe(applied_watch),
            ncp_ctl,
            ds_ctl,
            pcc_ctl,
            hc_ctl,
            pool_ctl,
            maybe(component_controller!(NestedEtcd)),
            maybe(component_controller!(NestedAPIServer)),
            maybe(component_controller!(NestedControllerManager)),
            maybe(component_controller!(NestedScheduler)),
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
