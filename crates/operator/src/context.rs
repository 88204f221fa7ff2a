//! What every reconciler shares: the client, the runtime, events, metrics; and the error type.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;
use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use nestplane_runtime::process::ProcessRuntime;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Errors of a reconcile pass. None of them carries secret material.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The management API failed.
    #[error("management API: {0}")]
    Kube(#[from] kube::Error),
    /// Secrets could not be read or written.
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
    /// Rendering failed.
    #[error("rendering: {0}")]
    Render(#[from] nestplane_render::RenderError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] nestplane_runtime::process::RuntimeError),
    /// A user patch cannot be applied.
    #[error(transparent)]
    Patch(#[from] nestplane_render::PatchError),
    /// A bug.
    #[error("internal: {0}")]
    Internal(String),
}

impl Error {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Secret(_) => "secret",
            Error::Render(_) => "render",
            Error::Runtime(e) => e.label(),
            Error::Patch(_) => "patch",
            Error::Internal(_) => "internal",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabel {
    kind: String,
    error: String,
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
        let mut registry = Registry::with_prefix("nestplane");
        registry.register("reconciles", "Reconcile passes by kind", reconciles.clone());
        registry.register(
            "reconcile_failures",
            "Failed reconcile passes by kind and error",
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
        Metrics {
            reconciles,
            failures,
            duration,
            tenant_ready,
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
    pub fn reconcile_failed(&self, kind: &str, error: &str) {
        self.failures
            .get_or_create(&FailureLabel {
                kind: kind.into(),
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
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
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

/// Settings of the `kubernetes` runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesSettings {
    /// Registry the component images come from.
    pub image_registry: String,
    /// Size of each etcd member's volume.
    pub etcd_storage: String,
}

impl Default for KubernetesSettings {
    fn default() -> Self {
        KubernetesSettings {
            image_registry: nestplane_render::DEFAULT_IMAGE_REGISTRY.into(),
            etcd_storage: nestplane_render::workload::DEFAULT_ETCD_STORAGE.into(),
        }
    }
}

/// Shared by every reconciler.
pub struct Context {
    /// The management cluster.
    pub client: kube::Client,
    /// The process runtime (used in [`Mode::Process`]).
    pub runtime: Arc<ProcessRuntime>,
    /// Which runtime runs the components.
    pub mode: Mode,
    /// Events.
    pub recorder: Recorder,
    /// Metrics.
    pub metrics: Metrics,
    /// Per-object backoff and health hysteresis.
    pub pacing: crate::pacing::Pacing,
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

impl Context {
    /// A context for `client` and `runtime`.
    pub fn new(client: kube::Client, runtime: Arc<ProcessRuntime>, mode: Mode) -> Self {
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
            mode,
            recorder,
            metrics: Metrics::default(),
            pacing: Default::default(),
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
        let note = nestplane_api::conditions::cut(note, 1000);
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %e, reason, "cannot publish event");
        }
    }
}
