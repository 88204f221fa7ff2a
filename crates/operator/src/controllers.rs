//! The operator's controllers, wired to their watches: one function per controller. Every
//! kind is watched once ([`Watches`], see [`crate::shared`]) and each controller subscribes
//! to what it follows; a controller that `--controllers` switches off does not subscribe.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use nestplane_api::{
    HostedCluster, NestedAPIServer, NestedBackup, NestedBackupSchedule, NestedControlPlane,
    NestedControllerManager, NestedDatastore, NestedEtcd, NestedRestore, NestedScheduler, NodePool,
    PostCreateConfig,
};
use tokio_util::sync::CancellationToken;

use crate::context::{self, Context, Error};
use crate::shared::{self, Shared};
use crate::{Config, Mode, backup, component, datastore, hosted, ncp, postcreate, tenant};

/// How many reconciles of one controller run at once: enough to keep the API server busy
/// while a thousand control planes are created, few enough that a burst does not open a
/// connection and hold a pass's memory per object.
pub const CONCURRENCY: u16 = 32;

/// How long the control plane controller waits after an event for more.
pub const NCP_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(50);

fn controller_config() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(CONCURRENCY)
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

fn error_policy<K, C>(obj: Arc<K>, err: &Error, ctx: Arc<C>) -> Action
where
    K: kube::Resource<DynamicType = ()>,
    C: AsRef<Context>,
{
    let ctx = (*ctx).as_ref();
    let delay = ctx.pacing.error(&context::object_key(obj.as_ref()));
    ctx.metrics
        .reconcile_failed(&K::kind(&()), err.step(), err.label());
    tracing::warn!(object = %kube::ResourceExt::name_any(obj.as_ref()), step = err.step(), error = %err, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// What a controller's stream yields, made visible: a failed watch (an RBAC refusal, a lost
/// connection) is logged, counted, and fails `/readyz` (an expired watch that relists is only
/// counted); reconcile errors are already counted and backed off by the error policy.
fn report<T, E: std::fmt::Display>(
    controller: &str,
    ctx: &Arc<Context>,
) -> impl FnMut(Result<T, kube::runtime::controller::Error<E, watcher::Error>>) -> std::future::Ready<()>
+ use<T, E> {
    let controller = controller.to_string();
    let ctx = ctx.clone();
    move |r| {
        if let Err(kube::runtime::controller::Error::QueueError(e)) = r {
            ctx.metrics.watch_error(&ctx.health, &controller, &e);
        }
        std::future::ready(())
    }
}

/// A controller, ready to run.
pub type Running = BoxFuture<'static, ()>;

/// One watch per kind, and the settings every controller reads.
pub struct Watches {
    client: kube::Client,
    namespace: Option<String>,
    watch_filter: Option<String>,
    /// The kubernetes runtime's workloads are watched.
    workloads: bool,
    shutdown: CancellationToken,
    ncps: Shared<NestedControlPlane>,
    etcds: Shared<NestedEtcd>,
    apiservers: Shared<NestedAPIServer>,
    controller_managers: Shared<NestedControllerManager>,
    schedulers: Shared<NestedScheduler>,
    datastores: Shared<NestedDatastore>,
    /// nestplane's own secrets: a pass reads certificates from here.
    secrets: Shared<Secret>,
    /// The kubernetes runtime's workloads and Services: a pass that would apply the same
    /// object again reads it from here instead (see `applied`).
    statefulsets: Shared<StatefulSet>,
    deployments: Shared<Deployment>,
    services: Shared<Service>,
    hosted_clusters: Shared<HostedCluster>,
    pools: Shared<NodePool>,
    /// Where backups go.
    backup_dir: std::path::PathBuf,
    /// What one namespace's archives may take.
    backup_quota: u64,
    /// The S3 servers backups may go to.
    backup_s3_endpoints: Vec<String>,
}

impl Watches {
    /// What the backup, restore and schedule controllers have.
    fn backup_context(&self, ctx: &Arc<Context>) -> Arc<backup::controller::BackupContext> {
        Arc::new(backup::controller::BackupContext {
            core: ctx.clone(),
            dir: self.backup_dir.clone(),
            quota: self.backup_quota,
            s3_endpoints: self.backup_s3_endpoints.clone(),
            tailers: Default::default(),
            shutdown: self.shutdown.clone(),
        })
    }

    /// The watches of an operator with `config`, their caches put where passes read them.
    pub fn new(
        client: &kube::Client,
        config: &Config,
        ctx: &Context,
        hosted: &hosted::HostedContext,
        shutdown: &CancellationToken,
    ) -> Watches {
        let w = Watches {
            client: client.clone(),
            namespace: config.namespace.clone(),
            watch_filter: config.watch_filter.clone(),
            workloads: matches!(config.mode, Mode::Kubernetes(_)),
            shutdown: shutdown.clone(),
            ncps: Shared::new("NestedControlPlane"),
            etcds: Shared::new("NestedEtcd"),
            apiservers: Shared::new("NestedAPIServer"),
            controller_managers: Shared::new("NestedControllerManager"),
            schedulers: Shared::new("NestedScheduler"),
            datastores: Shared::new("NestedDatastore"),
            secrets: Shared::new("Secret"),
            statefulsets: Shared::new("StatefulSet"),
            deployments: Shared::new("Deployment"),
            services: Shared::new("Service"),
            hosted_clusters: Shared::new("HostedCluster"),
            pools: Shared::new("NodePool"),
            backup_dir: config.backup_dir(),
            backup_quota: config
                .backup_namespace_quota
                .unwrap_or(backup::controller::NAMESPACE_QUOTA),
            backup_s3_endpoints: config.backup_s3_endpoints.clone(),
        };
        w.ncps.store_into(&ctx.caches.ncps);
        w.etcds.store_into(&ctx.caches.etcds);
        w.apiservers.store_into(&ctx.caches.apiservers);
        w.controller_managers
            .store_into(&ctx.caches.controller_managers);
        w.schedulers.store_into(&ctx.caches.schedulers);
        w.datastores.store_into(&ctx.caches.datastores);
        w.secrets.store_into(&ctx.caches.secrets);
        if w.workloads {
            w.statefulsets.store_into(&ctx.applied.statefulsets);
            w.deployments.store_into(&ctx.applied.deployments);
            w.services.store_into(&ctx.applied.services);
        }
        w.hosted_clusters.store_into(&hosted.clusters);
        w
    }

    fn stop(&self) -> impl std::future::Future<Output = ()> + Send + 'static + use<> {
        self.shutdown.clone().cancelled_owned()
    }

    /// Start every watch (once every controller has subscribed).
    pub fn run(self, ctx: &Arc<Context>) -> Running {
        if !ctx.controllers.reads_shared_watches() {
            return futures::future::ready(()).boxed();
        }
        let wc = watcher::Config::default;
        let mut ncp_watch = wc();
        if let Some(f) = &self.watch_filter {
            ncp_watch = ncp_watch.labels(&format!("{}={f}", context::WATCH_FILTER_LABEL));
        }
        // nestplane's own objects (secrets, workloads, Services) carry this label.
        let managed = || {
            wc().labels(&format!(
                "{}={}",
                nestplane_api::names::MANAGED_BY_LABEL,
                nestplane_api::names::MANAGED_BY
            ))
        };
        let (client, ns, stop) = (&self.client, &self.namespace, &self.shutdown);
        let mut all = vec![
            self.ncps
                .run(ctx, api(client, ns), ncp_watch, shared::whole, stop),
            self.etcds
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.apiservers
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.controller_managers
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.schedulers
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.datastores
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.secrets
                .run(ctx, api(client, ns), managed(), shared::whole, stop),
            self.hosted_clusters
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
            self.pools
                .run(ctx, api(client, ns), wc(), shared::whole, stop),
        ];
        if self.workloads {
            // Nor is the pod template read (the rollout is in the status).
            all.push(self.statefulsets.run(
                ctx,
                api(client, ns),
                managed(),
                |s| {
                    if let Some(spec) = s.spec.as_mut() {
                        spec.template = Default::default();
                        spec.volume_claim_templates = None;
                    }
                },
                stop,
            ));
            all.push(self.deployments.run(
                ctx,
                api(client, ns),
                managed(),
                |d| {
                    if let Some(spec) = d.spec.as_mut() {
                        spec.template = Default::default();
                    }
                },
                stop,
            ));
            all.push(
                self.services
                    .run(ctx, api(client, ns), managed(), shared::whole, stop),
            );
        }
        futures::future::join_all(all).map(|_| ()).boxed()
    }
}

/// Every controller `--controllers` keeps, subscribed to `w`.
pub fn all(
    w: &mut Watches,
    ctx: &Arc<Context>,
    hosted: &Arc<hosted::HostedContext>,
) -> Vec<Running> {
    let on = |name: &str| {
        let runs = ctx.controllers.runs_named(name);
        if !runs {
            tracing::info!(
                controller = name,
                "controller not run by this operator (--controllers)"
            );
        }
        runs
    };
    let mut running = Vec::new();
    if on("NestedControlPlane") {
        running.push(control_planes(w, ctx));
    }
    if on("NestedDatastore") {
        running.push(datastores(w, ctx));
    }
    running.extend(components(w, ctx));
    if on("PostCreateConfig") {
        running.push(post_create_configs(w, ctx));
    }
    if on("HostedCluster") {
        running.push(hosted_clusters(w, ctx, hosted));
    }
    if on("NodePool") {
        running.push(node_pools(w, ctx, hosted));
    }
    if on("NestedBackup") {
        running.push(backups(w, ctx));
    }
    if on("NestedRestore") {
        running.push(restores(w, ctx));
    }
    if on("NestedBackupSchedule") {
        running.push(backup_schedules(w, ctx));
    }
    if on("NestplaneConfig") {
        running.push(bootstrap_configs(w, ctx));
    } else if !w.workloads {
        // This operator's door judges agents, but another process gives the blocks: follow
        // them from the configs' statuses.
        running.push(follow_blocks(w, ctx));
    } else {
        // No door here (the kubernetes runtime's agents reach their API server's own
        // egress proxy, and machines do not come in yet).
        ctx.assigned.load(&[]);
    }
    running
}

/// The address blocks a bootstrap provider in another process gives, followed read-only
/// (its configs' statuses): the door admits by them as it would by its own. Where no
/// NestplaneConfig CRD is installed there is no provider, and a node joined by hand may take
/// any block.
fn follow_blocks(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    use kube::runtime::watcher::Event;
    let api = api::<nestplane_api::bootstrap::NestplaneConfig>(&w.client, &w.namespace);
    let (ctx, stop) = (ctx.clone(), w.stop());
    async move {
        let mut listed = Vec::new();
        let events = watcher(api, watcher::Config::default())
            .default_backoff()
            .take_until(stop);
        futures::pin_mut!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(Event::Init) => listed.clear(),
                Ok(Event::InitApply(c)) => listed.push(c),
                Ok(Event::InitDone) => ctx.assigned.replace(&std::mem::take(&mut listed)),
                Ok(Event::Apply(c)) => ctx.assigned.note(&c, false),
                Ok(Event::Delete(c)) => ctx.assigned.note(&c, true),
                Err(watcher::Error::InitialListFailed(kube::Error::Api(e))) if e.code == 404 => {
                    ctx.assigned.load(&[]);
                }
                Err(e) => ctx.metrics.watch_error(&ctx.health, "NestplaneConfig", &e),
            }
        }
    }
    .boxed()
}

/// NestplaneConfigs (the bootstrap provider): each looked at again on its own timer while
/// its machine joins ([`crate::bootstrap`]).
fn bootstrap_configs(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let controller = Controller::new(
        api::<nestplane_api::bootstrap::NestplaneConfig>(&w.client, &w.namespace),
        watcher::Config::default(),
    )
    .graceful_shutdown_on(w.stop())
    .run(crate::bootstrap::reconcile, error_policy, ctx.clone())
    .for_each(report("NestplaneConfig", ctx));
    let (namespace, ctx) = (w.namespace.clone(), ctx.clone());
    async move {
        // The blocks given so far, before any agent is judged.
        ctx.assigned.load_from(&ctx, namespace.as_deref()).await;
        controller.await;
    }
    .boxed()
}

/// Control planes. Debounced: the events of one control plane's creation (its own patches,
/// four components, their first status) come in a burst and make one pass. A component
/// change reaches every control plane that references it, owned or not (so creating a
/// component that a reference was waiting for heals the control plane); a datastore's change
/// the control planes that use it.
fn control_planes(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let ncps = w.ncps.store();
    let users_of = {
        let ncps = ncps.clone();
        move |ds: Arc<NestedDatastore>| {
            let key = (ds.namespace().unwrap_or_default(), ds.name_any());
            ncps.state()
                .iter()
                .filter(|ncp| datastore::referenced(ncp).as_ref() == Some(&key))
                .map(|ncp| ObjectRef::from_obj(ncp.as_ref()))
                .collect::<Vec<_>>()
        }
    };
    Controller::for_shared_stream(w.ncps.subscribe(), ncps.clone())
        .with_config(controller_config().debounce(NCP_DEBOUNCE))
        .watches_shared_stream(w.etcds.subscribe(), referencing(&ncps))
        .watches_shared_stream(w.datastores.subscribe(), users_of)
        .watches_shared_stream(w.apiservers.subscribe(), referencing(&ncps))
        .watches_shared_stream(w.controller_managers.subscribe(), referencing(&ncps))
        .watches_shared_stream(w.schedulers.subscribe(), referencing(&ncps))
        .graceful_shutdown_on(w.stop())
        .run(ncp::reconcile, error_policy, ctx.clone())
        .for_each(report("NestedControlPlane", ctx))
        .boxed()
}

/// The control planes that reference a component.
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

/// Shared datastores: their etcd's status and their tenants bring them back.
fn datastores(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    Controller::for_shared_stream(w.datastores.subscribe(), w.datastores.store())
        .owns_shared_stream(w.etcds.subscribe())
        .watches_shared_stream(w.ncps.subscribe(), |ncp: Arc<NestedControlPlane>| {
            let (ns, name) = datastore::referenced(&ncp)?;
            Some(ObjectRef::new(&name).within(&ns))
        })
        .graceful_shutdown_on(w.stop())
        .run(datastore::reconcile, error_policy, ctx.clone())
        .for_each(report("NestedDatastore", ctx))
        .boxed()
}

/// A change of the control plane (version, replicas, pause) reaches its components.
fn refs<K: tenant::ComponentKind>(ncp: Arc<NestedControlPlane>) -> Option<ObjectRef<K>> {
    let ns = kube::ResourceExt::namespace(ncp.as_ref())?;
    let name = tenant::reference(&ncp, K::COMPONENT)?.name.clone()?;
    Some(ObjectRef::new(&name).within(&ns))
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

/// The four component controllers. A kind whose controller does not run here
/// (`--controllers`) is someone else's: its objects are only read, from the cache. A
/// component controller also watches what it waits for (seed 000's order), and in the
/// kubernetes runtime its workload's rollout: etcd is a StatefulSet, the others are
/// Deployments.
fn components(w: &mut Watches, ctx: &Arc<Context>) -> Vec<Running> {
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
                let ctl = Controller::for_shared_stream(w.$own.subscribe(), w.$own.store())
                    .with_config(controller_config())
                    .watches_shared_stream(w.ncps.subscribe(), refs::<$k>);
                $(let ctl = ctl.watches_shared_stream(
                    w.$dep_w.subscribe(),
                    dependents::<$dep, $k>(&w.ncps.store()),
                );)?
                let ctl = if w.workloads {
                    ctl.owns_shared_stream(w.$workload.subscribe())
                } else {
                    ctl
                };
                ctl.graceful_shutdown_on(w.stop())
                    .run(component::reconcile::<$k>, error_policy, ctx.clone())
                    .for_each(report(&kind, ctx))
                    .boxed()
            })
        }};
    }
    [
        component_controller!(NestedEtcd, etcds, statefulsets),
        component_controller!(NestedAPIServer, apiservers, deployments, NestedEtcd, etcds),
        component_controller!(
            NestedControllerManager,
            controller_managers,
            deployments,
            NestedAPIServer,
            apiservers
        ),
        component_controller!(
            NestedScheduler,
            schedulers,
            deployments,
            NestedAPIServer,
            apiservers
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Backups: each taken once; one that waits for its control plane is looked at again when
/// that control plane changes.
fn backups(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let ctl = Controller::new(
        api::<NestedBackup>(&w.client, &w.namespace),
        watcher::Config::default(),
    )
    .with_config(
        kube::runtime::controller::Config::default().concurrency(backup::controller::CONCURRENCY),
    );
    let store = ctl.store();
    let bctx = w.backup_context(ctx);
    ctl.watches_shared_stream(w.ncps.subscribe(), move |ncp: Arc<NestedControlPlane>| {
        let ns = ncp.namespace();
        let name = ncp.name_any();
        store
            .state()
            .into_iter()
            .filter(|b| {
                b.namespace() == ns
                    && b.spec.control_plane_ref.name == name
                    && b.status.as_ref().and_then(|s| s.phase.as_deref())
                        != Some(nestplane_api::backup::phases::COMPLETED)
            })
            .map(|b| ObjectRef::from_obj(b.as_ref()))
            .collect::<Vec<_>>()
    })
    .graceful_shutdown_on(w.stop())
    .run(backup::controller::reconcile, error_policy, bctx)
    .for_each(report("NestedBackup", ctx))
    .boxed()
}

/// Restores: one step per pass; one that waits for its control plane is looked at again when
/// that control plane changes (ready again, its components held).
fn restores(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let ctl = Controller::new(
        api::<NestedRestore>(&w.client, &w.namespace),
        watcher::Config::default(),
    )
    .with_config(
        kube::runtime::controller::Config::default().concurrency(backup::controller::CONCURRENCY),
    );
    let store = ctl.store();
    let rctx = w.backup_context(ctx);
    ctl.watches_shared_stream(w.ncps.subscribe(), move |ncp: Arc<NestedControlPlane>| {
        let ns = ncp.namespace();
        let name = ncp.name_any();
        store
            .state()
            .into_iter()
            .filter(|r| {
                r.namespace() == ns
                    && r.spec.control_plane_ref.name == name
                    && r.status.as_ref().and_then(|s| s.phase.as_deref())
                        != Some(nestplane_api::backup::restore_phases::COMPLETED)
            })
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    })
    .graceful_shutdown_on(w.stop())
    .run(backup::restore::reconcile, error_policy, rctx)
    .for_each(report("NestedRestore", ctx))
    .boxed()
}

/// Backup schedules: looked at again when one of their backups changes (completed: the
/// oldest past the retention goes), and when the next backup is due.
fn backup_schedules(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let sctx = w.backup_context(ctx);
    Controller::new(
        api::<NestedBackupSchedule>(&w.client, &w.namespace),
        watcher::Config::default(),
    )
    .watches(
        api::<NestedBackup>(&w.client, &w.namespace),
        watcher::Config::default().labels(nestplane_api::backup::SCHEDULE_LABEL),
        |b: NestedBackup| {
            let schedule = b.labels().get(nestplane_api::backup::SCHEDULE_LABEL)?;
            Some(ObjectRef::new(schedule).within(&b.namespace()?))
        },
    )
    .graceful_shutdown_on(w.stop())
    .run(backup::schedule::reconcile, error_policy, sctx)
    .for_each(report("NestedBackupSchedule", ctx))
    .boxed()
}

/// PostCreateConfigs: looked at again when a control plane in their namespace changes
/// (initialized, labelled), when a Secret they use or a kubeconfig appears or changes, and
/// when a Cluster changes (where the kind is served; a watch that cannot start is only
/// retried, quietly).
fn post_create_configs(w: &mut Watches, ctx: &Arc<Context>) -> Running {
    let client = &w.client;
    let ns = &w.namespace;
    let wc = watcher::Config::default;
    let ctl = Controller::new(api::<PostCreateConfig>(client, ns), wc());
    let pccs = ctl.store();
    let secret_trigger = {
        let pccs = pccs.clone();
        watcher(
            api::<kube::core::PartialObjectMeta<Secret>>(client, ns),
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
    let addons = Arc::new(postcreate::AddonContext::new(ctx.clone()));
    ctl.watches_shared_stream(w.ncps.subscribe(), move |ncp: Arc<NestedControlPlane>| {
        postcreate::in_namespace(&pccs, ncp.namespace())
    })
    .reconcile_all_on(secret_trigger)
    .reconcile_all_on(cluster_trigger)
    .graceful_shutdown_on(w.stop())
    .run(postcreate::reconcile, error_policy, addons)
    .for_each(report("PostCreateConfig", ctx))
    .boxed()
}

/// The HostedCluster a control plane was made for (by annotation, across namespaces).
fn hosted_cluster_of(ncp: &NestedControlPlane) -> Option<ObjectRef<HostedCluster>> {
    let v = ncp
        .annotations()
        .get(hosted::claim::HOSTED_CLUSTER_ANNOTATION)?;
    let (ns, name) = v.split_once('/')?;
    Some(ObjectRef::new(name).within(ns))
}

/// HostedClusters: their control planes and their NodePools bring them back.
fn hosted_clusters(
    w: &mut Watches,
    ctx: &Arc<Context>,
    hosted: &Arc<hosted::HostedContext>,
) -> Running {
    // No limit on passes at once: a pass may wait on a hosted cluster.
    let ctl =
        Controller::for_shared_stream(w.hosted_clusters.subscribe(), w.hosted_clusters.store());
    // The shared watch sees what this operator selects; a HostedCluster's control plane may
    // be in another namespace or (made before the filter) unlabelled: then it watches its own.
    let ctl = if w.namespace.is_none() && w.watch_filter.is_none() {
        ctl.watches_shared_stream(w.ncps.subscribe(), |ncp: Arc<NestedControlPlane>| {
            hosted_cluster_of(&ncp)
        })
    } else {
        ctl.watches(
            Api::<NestedControlPlane>::all(w.client.clone()),
            watcher::Config::default(),
            |ncp| hosted_cluster_of(&ncp),
        )
    };
    ctl.watches_shared_stream(w.pools.subscribe(), |p: Arc<NodePool>| {
        Some(ObjectRef::new(&p.spec.cluster_name).within(&p.namespace()?))
    })
    .graceful_shutdown_on(w.stop())
    .run(hosted::cluster::reconcile, error_policy, hosted.clone())
    .for_each(report("HostedCluster", ctx))
    .boxed()
}

/// NodePools follow their HostedCluster.
fn node_pools(w: &mut Watches, ctx: &Arc<Context>, hosted: &Arc<hosted::HostedContext>) -> Running {
    let pools = w.pools.store();
    // No limit on passes at once: a pass drains nodes (up to each pool's nodeDrainTimeout),
    // and one pool's drain must not hold another pool's nodes from joining.
    Controller::for_shared_stream(w.pools.subscribe(), pools.clone())
        .watches_shared_stream(
            w.hosted_clusters.subscribe(),
            move |hc: Arc<HostedCluster>| {
                let ns = hc.namespace();
                pools
                    .state()
                    .iter()
                    .filter(|p| p.namespace() == ns && p.spec.cluster_name == hc.name_any())
                    .map(|p| ObjectRef::from_obj(p.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .graceful_shutdown_on(w.stop())
        .run(hosted::pool::reconcile, error_policy, hosted.clone())
        .for_each(report("NodePool", ctx))
        .boxed()
}
