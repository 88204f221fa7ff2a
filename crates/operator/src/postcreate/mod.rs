//! The `PostCreateConfig` controller (seed 001): resources held in Secrets, applied once to
//! every cluster its selector matches in its namespace — Cluster API `Cluster`s, and
//! `NestedControlPlane`s that no Cluster owns (so it works with `nestplane up` too).
//!
//! All or nothing: every Secret must exist and parse before anything is applied anywhere.
//! Each cluster is applied to on its own (concurrently, with per-cluster backoff and jitter),
//! with the cluster's admin kubeconfig: Namespaces and CRDs first (waiting until the CRDs are
//! established), then the rest; objects that exist are left as they are. A cluster enters
//! `clusterRefList` only once everything succeeded.

pub mod plan;

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::KubeConfigOptions;
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::conditions;
use nestplane_api::names;
use nestplane_api::postcreate::{ADDON_KEY, PostCreateConfig, reasons, types};

use crate::context::{Context, Error};
use crate::error::AtStep;
use crate::tenant;
use plan::{Pass, SecretView, Step, Target};

/// The field manager of resources applied with `strategy: Reconcile`.
pub const FIELD_MANAGER: &str = "nestplane-postcreate";
/// How long one cluster may take (all of its objects).
pub const APPLY_TIMEOUT: Duration = Duration::from_secs(90);
/// How often clusters that are not ready for the resources yet are looked at again.
pub const WAITING_RECHECK: Duration = Duration::from_secs(15);
/// How often a PostCreateConfig whose Secrets cannot be read is looked at again (their
/// watch brings it back sooner).
pub const PROBLEM_RECHECK: Duration = Duration::from_secs(60);

/// What the PostCreateConfig controller has: the operator's [`Context`] and its per-cluster
/// retries.
pub struct AddonContext {
    /// What every controller shares.
    pub core: std::sync::Arc<Context>,
    /// Per-cluster retries.
    pub retries: Retries,
}

impl AddonContext {
    /// The addon controller's context on `core`.
    pub fn new(core: std::sync::Arc<Context>) -> AddonContext {
        AddonContext {
            core,
            retries: Retries::default(),
        }
    }
}

crate::context::wing_context!(AddonContext);

/// Per-cluster retries: exponential backoff (2 s … 5 min) with ±20 % jitter, and the last
/// error, so that a broken cluster is retried on its own schedule and never delays others.
#[derive(Default)]
pub struct Retries(Mutex<HashMap<String, (u32, Instant, String)>>);

impl Retries {
    /// The wait left and the last error, when `key` is backing off.
    fn pending(&self, key: &str) -> Option<(Duration, String)> {
        let map = self.0.lock().ok()?;
        let (_, next, err) = map.get(key)?;
        let left = next.saturating_duration_since(Instant::now());
        (!left.is_zero()).then(|| (left, err.clone()))
    }

    fn failed(&self, key: &str, error: &str) -> Duration {
        let Ok(mut map) = self.0.lock() else {
            return Duration::from_secs(2);
        };
        let n = map.get(key).map_or(0, |e| e.0) + 1;
        let base = crate::pacing::backoff(n - 1, Duration::from_secs(2), Duration::from_secs(300));
        let jitter = 0.8
            + (std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
                % 400) as f64
                / 1000.0;
        let wait = base.mul_f64(jitter);
        map.insert(
            key.to_string(),
            (n, Instant::now() + wait, error.to_string()),
        );
        wait
    }

    fn succeeded(&self, key: &str) {
        if let Ok(mut map) = self.0.lock() {
            map.remove(key);
        }
    }
}

fn clusters_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, "v1beta1", "Cluster"),
        "clusters",
    )
}

/// Every cluster in `ns`: `Cluster`s (when the kind is served) and control planes no Cluster
/// owns, with why each cannot take resources yet.
async fn targets(ctx: &Context, ns: &str) -> Result<Vec<Target>, Error> {
    let ncps: Vec<NestedControlPlane> = match ctx.caches.ncps.get() {
        Some(store) => store
            .state()
            .iter()
            .filter(|n| n.namespace().as_deref() == Some(ns))
            .map(|n| (**n).clone())
            .collect(),
        None => {
            Api::<NestedControlPlane>::namespaced(ctx.client.clone(), ns)
                .list(&Default::default())
                .await?
                .items
        }
    };
    let mut out = Vec::new();
    let clusters =
        Api::<DynamicObject>::namespaced_with(ctx.client.clone(), ns, &clusters_resource());
    let listed = match clusters.list(&Default::default()).await {
        Ok(l) => l.items,
        // The kind is not served (or not ours to read): only control planes count.
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 403 => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    for c in listed {
        let name = c.name_any();
        let owned = ncps
            .iter()
            .find(|n| tenant::owning_cluster(n).as_deref() == Some(name.as_str()));
        let status = &c.data["status"];
        let initialized = owned
            .and_then(|n| n.status.as_ref())
            .is_some_and(|s| s.initialized)
            || status["controlPlaneReady"].as_bool() == Some(true)
            || status["initialization"]["controlPlaneInitialized"].as_bool() == Some(true);
        let paused = c.data["spec"]["paused"].as_bool() == Some(true)
            || c.annotations().contains_key(names::PAUSED_ANNOTATION);
        out.push(Target {
            kind: "Cluster".into(),
            uid: c.uid().unwrap_or_default(),
            labels: c.labels().clone(),
            waiting: waiting(c.meta().deletion_timestamp.is_some(), paused, initialized),
            kubeconfig: format!("{name}-kubeconfig"),
            name,
        });
    }
    for n in ncps.iter().filter(|n| tenant::owning_cluster(n).is_none()) {
        let initialized = n.status.as_ref().is_some_and(|s| s.initialized);
        let paused = n.annotations().contains_key(names::PAUSED_ANNOTATION);
        out.push(Target {
            kind: "NestedControlPlane".into(),
            name: n.name_any(),
            uid: n.uid().unwrap_or_default(),
            labels: n.labels().clone(),
            waiting: waiting(n.meta().deletion_timestamp.is_some(), paused, initialized),
            kubeconfig: format!("{}-kubeconfig", tenant::cluster_name(n)),
        });
    }
    Ok(out)
}

fn waiting(deleting: bool, paused: bool, initialized: bool) -> Option<String> {
    if deleting {
        Some("being deleted".into())
    } else if paused {
        Some("paused".into())
    } else if !initialized {
        Some("its control plane is not initialized yet".into())
    } else {
        None
    }
}

/// The admin kubeconfig of a cluster, from nestplane's watched secrets, else the API.
async fn kubeconfig(ctx: &Context, ns: &str, name: &str) -> Result<Option<String>, Error> {
    let secret = match ctx
        .caches
        .secrets
        .get()
        .and_then(|s| s.get(&ObjectRef::new(name).within(ns)))
    {
        Some(s) => Some((*s).clone()),
        None => {
            Api::<Secret>::namespaced(ctx.client.clone(), ns)
                .get_opt(name)
                .await?
        }
    };
    Ok(secret.and_then(|s| {
        s.data?
            .get(names::KUBECONFIG_KEY)
            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
    }))
}

/// Apply `docs` to the cluster behind `kubeconfig`: Namespaces and CRDs first (then wait
/// until the CRDs are established), then the rest. Existing objects are left as they are,
/// unless `reconcile` (server-side apply; nothing is ever deleted).
async fn apply_to(
    kubeconfig: &str,
    docs: &plan::Documents,
    reconcile: bool,
) -> Result<usize, String> {
    let kc = nestplane_pki::read_kubeconfig(kubeconfig)?;
    let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| format!("its kubeconfig: {e}"))?;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(30));
    let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
    let mut resources: HashMap<(String, String), (ApiResource, bool)> = HashMap::new();
    for (i, doc) in docs.docs.iter().enumerate() {
        if i == docs.first {
            wait_established(&client, &docs.docs[..docs.first]).await?;
        }
        apply_one(&client, &mut resources, doc, reconcile)
            .await
            .map_err(|e| {
                format!(
                    "{} (Secret {}, document {}): {e}",
                    doc.describe(),
                    doc.secret,
                    doc.index
                )
            })?;
    }
    if docs.first == docs.docs.len() {
        wait_established(&client, &docs.docs).await?;
    }
    Ok(docs.docs.len())
}

async fn apply_one(
    client: &kube::Client,
    resources: &mut HashMap<(String, String), (ApiResource, bool)>,
    doc: &plan::Doc,
    reconcile: bool,
) -> Result<(), String> {
    let api_version = doc.object["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let kind = doc.object["kind"].as_str().unwrap_or_default().to_string();
    let key = (api_version.clone(), kind.clone());
    let (ar, namespaced) = match resources.get(&key) {
        Some(r) => r.clone(),
        None => {
            let (group, version) = match api_version.rsplit_once('/') {
                Some((g, v)) => (g.to_string(), v.to_string()),
                None => (String::new(), api_version.clone()),
            };
            let gvk = GroupVersionKind::gvk(&group, &version, &kind);
            // A kind from a CRD applied a moment ago may take a little to be discovered.
            let mut tries = 0;
            let (ar, caps) = loop {
                match kube::discovery::pinned_kind(client, &gvk).await {
                    Ok(found) => break found,
                    Err(_) if tries < 10 => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(format!("{api_version} {kind} is not served: {e}")),
                }
            };
            let namespaced = caps.scope == kube::discovery::Scope::Namespaced;
            resources.insert(key, (ar.clone(), namespaced));
            (ar, namespaced)
        }
    };
    let mut obj: DynamicObject =
        serde_json::from_value(doc.object.clone()).map_err(|e| e.to_string())?;
    let name = obj.name_any();
    let api: Api<DynamicObject> = if namespaced {
        let ns = obj.namespace().unwrap_or_else(|| "default".into());
        obj.metadata.namespace = Some(ns.clone());
        Api::namespaced_with(client.clone(), &ns, &ar)
    } else {
        obj.metadata.namespace = None;
        Api::all_with(client.clone(), &ar)
    };
    let result = if reconcile {
        api.patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&obj),
        )
        .await
        .map(|_| ())
    } else {
        api.create(&PostParams::default(), &obj).await.map(|_| ())
    };
    match result {
        Ok(()) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 && !reconcile => Ok(()),
        Err(kube::Error::Api(e)) => Err(e.message),
        Err(e) => Err(e.to_string()),
    }
}

async fn wait_established(client: &kube::Client, first: &[plan::Doc]) -> Result<(), String> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for doc in first
        .iter()
        .filter(|d| d.object["kind"] == "CustomResourceDefinition")
    {
        let name = doc.object["metadata"]["name"].as_str().unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let crd = api
                .get(name)
                .await
                .map_err(|e| format!("CRD {name}: {e}"))?;
            let established = crd
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("CRD {name} not established after 60s"));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
}

/// Reconcile one PostCreateConfig.
#[tracing::instrument(name = "PostCreateConfig", skip_all, fields(namespace = pcc.metadata.namespace.as_deref().unwrap_or_default(), postcreateconfig = pcc.metadata.name.as_deref().unwrap_or_default()))]
pub async fn reconcile(
    pcc: Arc<PostCreateConfig>,
    ctx: Arc<AddonContext>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("PostCreateConfig");
    if pcc.metadata.deletion_timestamp.is_some() {
        // Nothing here or in the clusters is deleted with it.
        return Ok(Action::await_change());
    }
    let ns = pcc.namespace().unwrap_or_default();
    // Read every Secret first (all or nothing).
    let views = read_secrets(&ctx, &pcc).await.at("read Secrets")?;
    let docs = plan::documents(&pcc, |ns, name| {
        views
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
            .flatten()
    });
    let all = targets(&ctx, &ns).await.at("list clusters")?;
    let mut pass = Pass {
        existing: all.iter().map(|t| t.uid.clone()).collect(),
        matched: all
            .iter()
            .filter(|t| plan::selects(&pcc.spec.cluster_selector, &t.labels))
            .cloned()
            .collect(),
        ..Default::default()
    };
    let mut requeue = Requeue::default();
    match docs {
        Err(p) => pass.problem = Some(p),
        Ok(docs) => apply_all(&ctx, &pcc, &mut pass, &docs, &mut requeue)
            .await
            .at("apply")?,
    }
    report(&ctx, &pcc, &pass).await.at("status")?;
    Ok(match (requeue.0, &pass.problem) {
        (Some(d), _) => Action::requeue(d),
        (None, Some(_)) => Action::requeue(PROBLEM_RECHECK),
        (None, None) => Action::await_change(),
    })
}

/// When to look again: the soonest of what the clusters ask.
#[derive(Default)]
struct Requeue(Option<Duration>);

impl Requeue {
    fn sooner(&mut self, d: Duration) {
        self.0 = Some(self.0.map_or(d, |r| r.min(d)));
    }
}

/// The Secrets a PostCreateConfig names, by `(namespace, name)` (`None`: missing).
async fn read_secrets(
    ctx: &Context,
    pcc: &PostCreateConfig,
) -> Result<BTreeMap<(String, String), Option<SecretView>>, Error> {
    let ns = pcc.namespace().unwrap_or_default();
    let mut views = BTreeMap::new();
    for r in &pcc.spec.resources {
        let rns = plan::resource_namespace(r, &ns);
        if views.contains_key(&(rns.clone(), r.name.clone())) {
            continue;
        }
        let got = Api::<Secret>::namespaced(ctx.client.clone(), &rns)
            .get_opt(&r.name)
            .await?
            .map(|s| SecretView {
                labels: s.labels().clone(),
                addon: s
                    .data
                    .as_ref()
                    .and_then(|d| d.get(ADDON_KEY))
                    .map(|b| String::from_utf8_lossy(&b.0).into_owned()),
            });
        views.insert((rns, r.name.clone()), got);
    }
    Ok(views)
}

/// Each matching cluster's step ([`plan::step`]); the clusters to apply to are applied to
/// concurrently, each with its own backoff, and what happened recorded in `pass`.
async fn apply_all(
    ctx: &AddonContext,
    pcc: &PostCreateConfig,
    pass: &mut Pass,
    docs: &plan::Documents,
    requeue: &mut Requeue,
) -> Result<(), Error> {
    let ns = pcc.namespace().unwrap_or_default();
    let strategy = pcc.spec.strategy.unwrap_or_default();
    let reconcile_changes = strategy == nestplane_api::postcreate::Strategy::Reconcile;
    let previous = pcc.status.clone().unwrap_or_default();
    let mut jobs = Vec::new();
    for t in &pass.matched {
        match plan::step(t, &previous.applied, &docs.hash, strategy) {
            Step::Done => {}
            Step::OutOfDate => pass.out_of_date.push(t.name.clone()),
            Step::Wait(why) => {
                pass.waiting.push((t.name.clone(), why));
                requeue.sooner(WAITING_RECHECK);
            }
            Step::Apply => {
                let key = format!("{ns}/{}/{}", pcc.name_any(), t.uid);
                if let Some((left, err)) = ctx.retries.pending(&key) {
                    pass.failed.push((t.name.clone(), err));
                    requeue.sooner(left);
                    continue;
                }
                let Some(kc) = kubeconfig(ctx, &ns, &t.kubeconfig).await? else {
                    pass.waiting
                        .push((t.name.clone(), format!("no Secret {}", t.kubeconfig)));
                    requeue.sooner(WAITING_RECHECK);
                    continue;
                };
                let t = t.clone();
                jobs.push(async move {
                    let r = match tokio::time::timeout(
                        APPLY_TIMEOUT,
                        apply_to(&kc, docs, reconcile_changes),
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(format!("not done after {APPLY_TIMEOUT:?}")),
                    };
                    (t, key, r)
                });
            }
        }
    }
    for (t, key, r) in futures::future::join_all(jobs).await {
        match r {
            Ok(n) => {
                ctx.retries.succeeded(&key);
                let note = format!("applied {n} object(s) to {} {}", t.kind, t.name);
                let on = pcc.object_ref(&());
                ctx.event(on, EventType::Normal, reasons::APPLIED, &note)
                    .await;
                pass.applied_now.push((t, docs.hash.clone()));
            }
            Err(e) => {
                requeue.sooner(ctx.retries.failed(&key, &e));
                tracing::warn!(cluster = %t.name, error = %e, "applying failed");
                let note = format!("{} {}: {e}", t.kind, t.name);
                let on = pcc.object_ref(&());
                ctx.event(on, EventType::Warning, reasons::APPLY_FAILED, &note)
                    .await;
                pass.failed.push((t.name.clone(), e));
            }
        }
    }
    Ok(())
}

/// The status ([`plan::status`], pure) written when it changed; Events when the resources
/// become unreadable (or the reason changes), and when they become out of date.
async fn report(ctx: &Context, pcc: &PostCreateConfig, pass: &Pass) -> Result<(), Error> {
    let previous = pcc.status.clone().unwrap_or_default();
    let status = plan::status(pcc, pass, k8s_openapi::jiff::Timestamp::now());
    let changed = |type_: &str| {
        let old = conditions::get(&previous.conditions, type_).map(|c| (&c.status, &c.message));
        let new = conditions::get(&status.conditions, type_).map(|c| (&c.status, &c.message));
        old != new
    };
    if let Some(p) = &pass.problem
        && changed(types::RESOURCES_AVAILABLE)
    {
        ctx.event(
            pcc.object_ref(&()),
            EventType::Warning,
            p.reason,
            &p.message,
        )
        .await;
    }
    if !pass.out_of_date.is_empty() && changed(types::OUT_OF_DATE) {
        let c = conditions::get(&status.conditions, types::OUT_OF_DATE);
        ctx.event(
            pcc.object_ref(&()),
            EventType::Warning,
            types::OUT_OF_DATE,
            &c.map(|c| c.message.clone()).unwrap_or_default(),
        )
        .await;
    }
    let api = Api::<PostCreateConfig>::namespaced(
        ctx.client.clone(),
        &pcc.namespace().unwrap_or_default(),
    );
    crate::status::write(&api, pcc, pcc.status.as_ref(), &status).await
}

/// The PostCreateConfigs in the namespace of a changed cluster.
pub fn in_namespace(
    store: &kube::runtime::reflector::Store<PostCreateConfig>,
    ns: Option<String>,
) -> Vec<ObjectRef<PostCreateConfig>> {
    store
        .state()
        .iter()
        .filter(|p| p.namespace() == ns)
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// Whether a Secret matters to some PostCreateConfig: one of its resources, or a kubeconfig
/// (a cluster becoming reachable).
pub fn secret_matters(
    store: &kube::runtime::reflector::Store<PostCreateConfig>,
    ns: &str,
    name: &str,
) -> bool {
    name.ends_with("-kubeconfig")
        || store.state().iter().any(|p| {
            let own = p.namespace().unwrap_or_default();
            p.spec.resources.iter().any(|r| {
                r.name == name
                    && r.namespace
                        .as_deref()
                        .filter(|n| !n.is_empty())
                        .unwrap_or(&own)
                        == ns
            })
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_per_cluster_with_jitter() {
        let r = Retries::default();
        assert!(r.pending("a").is_none());
        let first = r.failed("a", "boom");
        assert!(first >= Duration::from_millis(1600) && first <= Duration::from_millis(2400));
        let (left, err) = r.pending("a").unwrap();
        assert!(left <= first);
        assert_eq!(err, "boom");
        assert!(r.pending("b").is_none(), "another cluster is not delayed");
        let second = r.failed("a", "boom");
        assert!(second >= Duration::from_millis(3200), "{second:?}");
        r.succeeded("a");
        assert!(r.pending("a").is_none());
    }
}
