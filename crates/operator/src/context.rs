//! What every reconciler shares: the client, the runtime, events, metrics; and the error type.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use nestplane_api::names::Component;
use nestplane_runtime::process::ProcessRuntime;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

pub use crate::error::Error;

/// Cluster API's label for running several providers side by side (`--watch-filter`).
pub const WATCH_FILTER_LABEL: &str = "cluster.x-k8s.io/watch-filter";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabel {
    kind: String,
    step: String,
    error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabel {
    method: String,
    resource: String,
}

/// The resource (and subresource) a request to the API server is about, from its path:
/// `/api/v1/namespaces/a/secrets/b` is `secrets`, `/apis/g/v1/namespaces/a/xs/b/status` is
/// `xs/status`, `/api/v1/namespaces/a` is `namespaces`. Bounded by the kinds the operator
/// uses, so it is safe as a metric label.
pub fn request_resource(path: &str) -> String {
    let parts: Vec<&str> = path
        .split('?')
        .next()
        .unwrap_or("")
        .split('/')
        .filter(|p| !p.is_empty())
        .collect();
    // Skip the group and version: `api/v1` or `apis/<group>/<version>`.
    let rest = match parts.first() {
        Some(&"api") => parts.get(2..),
        Some(&"apis") => parts.get(3..),
        _ => None,
    }
    .unwrap_or(&[]);
    let rest = match rest {
        ["namespaces", _, more @ ..] if !more.is_empty() => more,
        _ => rest,
    };
    match rest {
        [] => "other".into(),
        [resource] | [resource, _] => (*resource).to_string(),
        [resource, _, sub, ..] => format!("{resource}/{sub}"),
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    namespace: String,
    cluster: String,
}

/// The operator's Prometheus metrics.
#[derive(Clone)]
pub struct Metrics {
    reconciles: Family<KindLabel, Counter>,
    failures: Family<FailureLabel, Counter>,
    duration: Family<KindLabel, Histogram>,
    tenant_ready: Family<TenantLabel, Gauge<i64, AtomicI64>>,
    datastore_keys: Family<TenantLabel, Gauge<i64, AtomicI64>>,
    datastore_bytes: Family<TenantLabel, Gauge<i64, AtomicI64>>,
    datastore_quota: Family<TenantLabel, Gauge<i64, AtomicI64>>,
    watch_failures: Family<KindLabel, Counter>,
    watch_relists: Family<KindLabel, Counter>,
    api_requests: Family<RequestLabel, Counter>,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        let reconciles = Family::<KindLabel, Counter>::default();
        let failures = Family::<FailureLabel, Counter>::default();
        let duration = Family::<KindLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
        });
        let tenant_ready = Family::<TenantLabel, Gauge<i64, AtomicI64>>::default();
        let datastore_keys = Family::<TenantLabel, Gauge<i64, AtomicI64>>::default();
        let datastore_bytes = Family::<TenantLabel, Gauge<i64, AtomicI64>>::default();
        let datastore_quota = Family::<TenantLabel, Gauge<i64, AtomicI64>>::default();
        let watch_failures = Family::<KindLabel, Counter>::default();
        let watch_relists = Family::<KindLabel, Counter>::default();
        let api_requests = Family::<RequestLabel, Counter>::default();
        let mut registry = Registry::with_prefix("nestplane");
        registry.register("reconciles", "Reconcile passes by kind", reconciles.clone());
        registry.register(
            "reconcile_failures",
            "Failed reconcile passes by kind, the step that failed and the error",
            failures.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconcile duration by kind",
            duration.clone(),
        );
        registry.register(
            "tenant_ready",
            "1 when a tenant control plane is Ready",
            tenant_ready.clone(),
        );
        registry.register(
            "datastore_tenant_keys",
            "Keys a tenant on a shared datastore stores",
            datastore_keys.clone(),
        );
        registry.register(
            "datastore_tenant_bytes",
            "Bytes (keys and values) a tenant on a shared datastore stores",
            datastore_bytes.clone(),
        );
        registry.register(
            "datastore_tenant_quota_bytes",
            "The bytes a tenant on a shared datastore may store",
            datastore_quota.clone(),
        );
        registry.register(
            "watch_failures",
            "Failed watches (list or watch refused, connection lost) by controller",
            watch_failures.clone(),
        );
        registry.register(
            "watch_relists",
            "Watches that expired (410 Gone: the API server no longer had their resource version) and listed again, by controller; normal after bursts of writes",
            watch_relists.clone(),
        );
        registry.register(
            "api_requests",
            "Requests sent to the management cluster's API server, by HTTP method (POST, PUT, PATCH and DELETE are writes) and resource",
            api_requests.clone(),
        );
        Metrics {
            reconciles,
            failures,
            duration,
            tenant_ready,
            datastore_keys,
            datastore_bytes,
            datastore_quota,
            watch_failures,
            watch_relists,
            api_requests,
            registry: Arc::new(registry),
        }
    }
}

/// Observes a reconcile's duration when dropped.
pub struct Timer {
    start: Instant,
    hist: Histogram,
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.hist.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Metrics {
    /// Count a reconcile of `kind`; the returned timer records its duration.
    pub fn reconcile_started(&self, kind: &str) -> Timer {
        let l = KindLabel { kind: kind.into() };
        self.reconciles.get_or_create(&l).inc();
        Timer {
            start: Instant::now(),
            hist: self.duration.get_or_create(&l).clone(),
        }
    }

    /// Count a failed reconcile.
    pub fn reconcile_failed(&self, kind: &str, step: &str, error: &str) {
        self.failures
            .get_or_create(&FailureLabel {
                kind: kind.into(),
                step: step.into(),
                error: error.into(),
            })
            .inc();
    }

    /// Record a tenant's readiness.
    pub fn set_tenant_ready(&self, namespace: &str, cluster: &str, ready: bool) {
        self.tenant_ready
            .get_or_create(&TenantLabel {
                namespace: namespace.into(),
                cluster: cluster.into(),
            })
            .set(i64::from(ready));
    }

    /// Record what a tenant on a shared datastore stores, and its quota.
    pub fn set_datastore_usage(
        &self,
        namespace: &str,
        cluster: &str,
        keys: i64,
        bytes: i64,
        quota: i64,
    ) {
        let l = TenantLabel {
            namespace: namespace.into(),
            cluster: cluster.into(),
        };
        self.datastore_keys.get_or_create(&l).set(keys);
        self.datastore_bytes.get_or_create(&l).set(bytes);
        self.datastore_quota.get_or_create(&l).set(quota);
    }

    /// Forget a tenant's datastore usage (it left its datastore).
    pub fn forget_datastore_usage(&self, namespace: &str, cluster: &str) {
        let l = TenantLabel {
            namespace: namespace.into(),
            cluster: cluster.into(),
        };
        self.datastore_keys.remove(&l);
        self.datastore_bytes.remove(&l);
        self.datastore_quota.remove(&l);
    }

    /// Count a failed watch of a controller.
    pub fn watch_failed(&self, controller: &str) {
        self.watch_failures
            .get_or_create(&KindLabel {
                kind: controller.into(),
            })
            .inc();
    }

    /// What to make of a watch's error: an expired watch (410 Gone) that the watcher answers
    /// by listing again is counted and logged as the routine it is; anything else is a
    /// failure, logged as an error, counted, and fails `/readyz` for a while.
    pub fn watch_error(&self, health: &Health, controller: &str, e: &watcher::Error) {
        if expired(e) {
            tracing::info!(controller, "watch expired; listing again");
            self.watch_relists
                .get_or_create(&KindLabel {
                    kind: controller.into(),
                })
                .inc();
        } else {
            tracing::error!(controller, error = %e, "watch failed");
            self.watch_failed(controller);
            health.watch_failed(controller, e.to_string());
        }
    }

    /// `client`, counting every request it sends in
    /// `nestplane_api_requests_total{method,resource}` (watches count once, when they start).
    pub fn counted(&self, client: kube::Client) -> kube::Client {
        let requests = self.api_requests.clone();
        let namespace = client.default_namespace().to_string();
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            requests
                .get_or_create(&RequestLabel {
                    method: req.method().as_str().to_string(),
                    resource: request_resource(req.uri().path()),
                })
                .inc();
            let client = client.clone();
            async move { client.send(req).await }
        });
        kube::Client::new(service, namespace)
    }

    /// Forget a deleted tenant.
    pub fn remove_tenant(&self, namespace: &str, cluster: &str) {
        self.tenant_ready.remove(&TenantLabel {
            namespace: namespace.into(),
            cluster: cluster.into(),
        });
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Whether a watch error is a watch (or a paginated list's continue token) that expired (410
/// Gone), which the watcher recovers from by listing again. Pure.
pub fn expired(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        // Only these two make the watcher list again; a failed watch start or stream keeps
        // its resource version, so a 410 there repeats until it is a failure.
        watcher::Error::InitialListFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

/// What `/readyz` reports: the operator is not ready while one of its watches failed
/// recently (an RBAC refusal, a lost connection): it would act on a stale view.
#[derive(Clone, Default)]
pub struct Health {
    failures: Arc<std::sync::Mutex<std::collections::BTreeMap<String, (Instant, String)>>>,
}

/// How long a watch failure keeps `/readyz` failing (the watchers retry with backoff, so a
/// failure that persists is seen again well within this window).
pub const WATCH_FAILURE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

impl Health {
    /// Record a failed watch of `controller`.
    pub fn watch_failed(&self, controller: &str, message: String) {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(controller.to_string(), (Instant::now(), message));
    }

    /// Recent failures, one line each; empty when ready.
    pub fn problems(&self) -> Vec<String> {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, (at, _))| at.elapsed() < WATCH_FAILURE_WINDOW)
            .map(|(c, (at, m))| {
                format!(
                    "{c}: watch failed {}s ago: {}",
                    at.elapsed().as_secs(),
                    nestplane_api::conditions::cut(m, 500)
                )
            })
            .collect()
    }
}

/// Where tenant components run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Supervised local processes ([`ProcessRuntime`]).
    #[default]
    Process,
    /// Workloads (StatefulSet, Deployments, Services) in the management cluster.
    Kubernetes(KubernetesSettings),
}

pub use crate::workloads::KubernetesSettings;

/// Shared by every reconciler.
pub struct Context {
    /// The management cluster.
    pub client: kube::Client,
    /// Where components run.
    pub runtime: Arc<dyn crate::runtime::Runtime>,
    /// Events.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    /// The kubernetes runtime's watch caches of workloads and Services, and what it applied.
    pub applied: Arc<crate::applied::Applied>,
    /// Per-object backoff and health hysteresis.
    pub pacing: crate::pacing::Pacing,
    /// Watch failures, for `/readyz`.
    pub health: Health,
    /// Only control planes labelled `cluster.x-k8s.io/watch-filter=<value>`, and the
    /// components they control, are reconciled.
    pub watch_filter: Option<String>,
    /// When certificates are due.
    pub clock: crate::clock::Clock,
    /// The watches' caches, read instead of the API server.
    pub caches: crate::tenant::Caches,
    /// What this operator wrote, while the caches are behind (see `written`).
    pub written: crate::written::Written,
    /// Which component controllers run here.
    pub controllers: Controllers,
    /// The API servers' requests of APIs a pending minor step removes.
    pub removed_apis: crate::removed::Readings,
    /// The tasks of moves between shared datastores.
    pub migrations: crate::datastore::migrate::Migrations,
    /// The address blocks the bootstrap provider gave machines (their agents' announcements
    /// are checked against them).
    pub assigned: Arc<crate::bootstrap::Assigned>,
    /// Where NodePools make nodes on this machine (`None`: none are made here): a CA
    /// rotation gives them the new CA.
    pub nodes: Option<Arc<dyn crate::hosted::pool::machines::NodeRuntime>>,
}

/// The controllers besides the four component controllers, by kind.
pub const WING_CONTROLLERS: [&str; 9] = [
    "NestedControlPlane",
    "NestedDatastore",
    "PostCreateConfig",
    "HostedCluster",
    "NodePool",
    "NestedBackup",
    "NestedRestore",
    "NestedBackupSchedule",
    "NestplaneConfig",
];

/// Which controllers an operator runs (`--controllers`), in kube-controller-manager's
/// syntax: a comma-separated list where `*` is every controller, `etcd` adds one and `-etcd`
/// removes one; without `*`, only the named ones run. Names are the components' short names
/// (`etcd`, `apiserver`, `controller-manager`, `scheduler`) or any controller's kind
/// (`NestedEtcd`, `NestedControlPlane`, `NestedDatastore`, `PostCreateConfig`,
/// `HostedCluster`, `NodePool`, `NestedBackup`, `NestedRestore`, `NestedBackupSchedule`, `NestplaneConfig`; any case). A list that names only component controllers
/// leaves the others running. A kind whose controller does not run here is someone else's:
/// it is only read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Controllers {
    on: std::collections::BTreeSet<Component>,
    wings: std::collections::BTreeSet<&'static str>,
}

impl Default for Controllers {
    fn default() -> Self {
        Controllers {
            on: Component::ALL.into_iter().collect(),
            wings: WING_CONTROLLERS.into_iter().collect(),
        }
    }
}

impl Controllers {
    /// Parse a `--controllers` value.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let items: Vec<&str> = spec
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() {
            return Ok(Controllers::default());
        }
        let wing = |name: &str| {
            WING_CONTROLLERS
                .iter()
                .any(|k| k.eq_ignore_ascii_case(name))
        };
        // A list of component controllers alone leaves the others running (as before they
        // could be named); naming one of them runs only those named.
        let names_wings = items.iter().any(|i| wing(i));
        let mut c = Controllers::default();
        if !items.contains(&"*") {
            c.on.clear();
            if names_wings {
                c.wings.clear();
            }
        }
        for item in items.iter().filter(|i| **i != "*") {
            let (add, name) = match item.strip_prefix('-') {
                Some(n) => (false, n),
                None => (true, *item),
            };
            if let Some(component) = Component::ALL.into_iter().find(|c| {
                c.short_name() == name || crate::tenant::kind_of(*c).eq_ignore_ascii_case(name)
            }) {
                if add {
                    c.on.insert(component);
                } else {
                    c.on.remove(&component);
                }
            } else if let Some(kind) = WING_CONTROLLERS
                .into_iter()
                .find(|k| k.eq_ignore_ascii_case(name))
            {
                if add {
                    c.wings.insert(kind);
                } else {
                    c.wings.remove(kind);
                }
            } else {
                return Err(format!(
                    "unknown controller {name:?}; the component controllers are {}, the others {}",
                    Component::ALL.map(|c| c.short_name()).join(", "),
                    WING_CONTROLLERS.join(", ")
                ));
            }
        }
        Ok(c)
    }

    /// Whether component `c`'s controller runs here.
    pub fn runs(&self, c: Component) -> bool {
        self.on.contains(&c)
    }

    /// Whether the controller of `kind` (one of [`WING_CONTROLLERS`]) runs here.
    pub fn runs_named(&self, kind: &str) -> bool {
        self.wings.contains(kind)
    }

    /// Whether a controller runs that reads the shared watches: any but the bootstrap
    /// provider's, which asks for the little it reads. An operator run as the bootstrap
    /// provider alone (`--controllers=NestplaneConfig`) then watches nothing else, and its
    /// role grants nothing else.
    pub fn reads_shared_watches(&self) -> bool {
        !self.on.is_empty() || self.wings.iter().any(|w| *w != "NestplaneConfig")
    }
}

/// `Kind/namespace/name`: the key of an object in per-object state.
pub fn object_key<K: kube::Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default()
    )
}

/// A wing's context (a struct with the shared [`Context`] as `core`) reads as the shared
/// one: `ctx.client`, `ctx.event(..)`, and the controllers' error policy.
macro_rules! wing_context {
    ($t:ty) => {
        impl std::ops::Deref for $t {
            type Target = $crate::context::Context;
            fn deref(&self) -> &$crate::context::Context {
                &self.core
            }
        }

        impl AsRef<$crate::context::Context> for $t {
            fn as_ref(&self) -> &$crate::context::Context {
                &self.core
            }
        }
    };
}
pub(crate) use wing_context;

impl AsRef<Context> for Context {
    fn as_ref(&self) -> &Context {
        self
    }
}

impl Context {
    /// A context for `client` and `runtime`.
    pub fn new(client: kube::Client, processes: Arc<ProcessRuntime>, mode: Mode) -> Self {
        let metrics = Metrics::default();
        let client = metrics.counted(client);
        let applied = Arc::new(crate::applied::Applied::default());
        let runtime: Arc<dyn crate::runtime::Runtime> = match mode {
            Mode::Process => Arc::new(crate::process::Processes::new(processes)),
            Mode::Kubernetes(settings) => {
                Arc::new(crate::workloads::Workloads::new(settings, applied.clone()))
            }
        };
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "nestplane".into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Context {
            client,
            runtime,
            recorder,
            metrics,
            applied,
            pacing: Default::default(),
            health: Health::default(),
            watch_filter: None,
            clock: Default::default(),
            caches: Default::default(),
            written: Default::default(),
            removed_apis: Default::default(),
            migrations: Default::default(),
            assigned: Default::default(),
            nodes: None,
            controllers: Controllers::default(),
        }
    }

    /// Whether this operator runs component `c` of `t`: its controller runs here and the
    /// component object names no other manager.
    pub fn runs_here(&self, t: &crate::tenant::Tenant, c: Component) -> bool {
        self.controllers.runs(c) && t.managed_elsewhere(c).is_none()
    }

    /// Whether this operator reconciles `ncp` (its watch filter matches).
    pub fn selects(&self, ncp: &nestplane_api::NestedControlPlane) -> bool {
        self.selects_labels(ncp.metadata.labels.as_ref())
    }

    /// Whether `labels` (of a control plane, or of what stands for one not made yet) match
    /// this operator's watch filter.
    pub fn selects_labels(
        &self,
        labels: Option<&std::collections::BTreeMap<String, String>>,
    ) -> bool {
        match &self.watch_filter {
            None => true,
            Some(f) => labels
                .and_then(|l| l.get(WATCH_FILTER_LABEL))
                .is_some_and(|v| v == f),
        }
    }

    /// Publish an Event (failures to publish are logged, never fatal).
    pub async fn event(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        self.event_as(reference, type_, reason, "Reconcile", note)
            .await;
    }

    /// An Event whose `action` is `action`. Events of one object, type, reason and action are
    /// one series (a later one counts, and its note is not shown): steps that must each be
    /// seen (a rotation's phases) each name their action.
    pub async fn event_as(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) {
        let note = nestplane_api::conditions::cut(note, 1000);
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note),
            action: nestplane_api::conditions::cut(action, 128),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %e, reason, "cannot publish event");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod controller_tests {
    use super::*;

    #[test]
    fn controllers_read_like_kube_controller_managers_list() {
        let all = Controllers::default();
        assert!(Component::ALL.iter().all(|c| all.runs(*c)));
        assert_eq!(Controllers::parse("").unwrap(), all);
        assert_eq!(Controllers::parse("*").unwrap(), all);
        let no_etcd = Controllers::parse("*,-etcd").unwrap();
        assert!(!no_etcd.runs(Component::Etcd));
        assert!(no_etcd.runs(Component::ApiServer));
        assert_eq!(Controllers::parse("*, -NestedEtcd").unwrap(), no_etcd);
        let only = Controllers::parse("apiserver,scheduler").unwrap();
        assert!(only.runs(Component::ApiServer) && only.runs(Component::Scheduler));
        assert!(!only.runs(Component::Etcd) && !only.runs(Component::ControllerManager));
        let no_pools = Controllers::parse("*,-nodepool,-HostedCluster").unwrap();
        assert!(!no_pools.runs_named("NodePool") && !no_pools.runs_named("HostedCluster"));
        assert!(no_pools.runs_named("NestedControlPlane") && no_pools.runs(Component::Etcd));
        let components_only = Controllers::parse("etcd").unwrap();
        assert!(
            components_only.runs_named("NestedControlPlane")
                && !components_only.runs(Component::Scheduler)
        );
        let only_pools = Controllers::parse("NodePool").unwrap();
        assert!(only_pools.runs_named("NodePool") && !only_pools.runs_named("PostCreateConfig"));
        assert!(!only_pools.runs(Component::Etcd));
        // The bootstrap provider's own Deployment runs its controller alone, and watches
        // nothing of the control planes'; anything else with it does.
        let bootstrap = Controllers::parse("NestplaneConfig").unwrap();
        assert!(bootstrap.runs_named("NestplaneConfig") && !bootstrap.runs_named("NodePool"));
        assert!(!bootstrap.reads_shared_watches());
        assert!(only_pools.reads_shared_watches() && components_only.reads_shared_watches());
        assert!(
            Controllers::parse("*,-NestplaneConfig")
                .unwrap()
                .reads_shared_watches()
        );
        let err = Controllers::parse("*,-etdc").unwrap_err();
        assert!(
            err.contains("etdc") && err.contains("controller-manager"),
            "{err}"
        );
    }
}

#[cfg(test)]
mod request_tests {
    use super::request_resource;

    #[test]
    fn requests_are_labelled_by_resource_and_subresource() {
        for (path, want) in [
            ("/api/v1/namespaces/a/secrets/b", "secrets"),
            ("/api/v1/namespaces/a/secrets?labelSelector=x", "secrets"),
            ("/api/v1/namespaces/a", "namespaces"),
            ("/api/v1/namespaces", "namespaces"),
            ("/api/v1/nodes/n1/status", "nodes/status"),
            (
                "/apis/controlplane.cluster.x-k8s.io/v1alpha1/namespaces/a/nestedcontrolplanes/t0/status",
                "nestedcontrolplanes/status",
            ),
            ("/apis/apps/v1/statefulsets?watch=true", "statefulsets"),
            ("/version", "other"),
        ] {
            assert_eq!(request_resource(path), want, "{path}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch_error(code: u16) -> watcher::Error {
        watcher::Error::WatchError(Box::new(kube::core::Status {
            code,
            message: "too old resource version: 1 (300)".into(),
            reason: "Expired".into(),
            ..Default::default()
        }))
    }

    #[test]
    fn an_expired_watch_is_counted_as_a_relist_and_leaves_readyz_alone() {
        let (metrics, health) = (Metrics::default(), Health::default());
        metrics.watch_error(&health, "Cluster", &watch_error(410));
        assert!(health.problems().is_empty(), "{:?}", health.problems());
        let text = metrics.encode();
        assert!(
            text.contains("nestplane_watch_relists_total{kind=\"Cluster\"} 1"),
            "{text}"
        );
        assert!(!text.contains("nestplane_watch_failures_total{"), "{text}");

        // So is an expired continue token while listing.
        let list =
            watcher::Error::InitialListFailed(kube::Error::Api(Box::new(kube::core::Status {
                code: 410,
                reason: "Expired".into(),
                ..Default::default()
            })));
        metrics.watch_error(&health, "Cluster", &list);
        assert!(health.problems().is_empty());

        // A 410 on a watch that failed to start keeps its resource version (the watcher does
        // not list again), so it is a failure, not a relist.
        assert!(!expired(&watcher::Error::WatchStartFailed(
            kube::Error::Api(Box::new(kube::core::Status {
                code: 410,
                ..Default::default()
            }))
        )));

        // Anything else is a failure until the watch recovers.
        metrics.watch_error(&health, "Cluster", &watch_error(403));
        assert_eq!(health.problems().len(), 1);
        assert!(
            metrics
                .encode()
                .contains("nestplane_watch_failures_total{kind=\"Cluster\"} 1")
        );
    }
}
