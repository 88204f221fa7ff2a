//! A tenant as the controllers see it: the control plane, its four components, and the
//! values derived from them (versions, replicas, the render input).

use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use nestplane_api::names::{self, Component};
use nestplane_api::{
    ComponentStatus, NestedAPIServer, NestedComponentSpec, NestedControlPlane,
    NestedControllerManager, NestedEtcd, NestedScheduler,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::OnceLock;

/// The component kinds, handled generically.
pub trait ComponentKind:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + DeserializeOwned
    + Serialize
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// Which component this kind describes.
    const COMPONENT: Component;
    /// The common component spec.
    fn component_spec(&self) -> &NestedComponentSpec;
    /// The common part of the status.
    fn common_status(&self) -> Option<&ComponentStatus>;
    /// A component object with default spec.
    fn with_defaults(name: &str, namespace: &str) -> Self;
    /// Where this kind's watch cache is kept.
    fn cache_slot(c: &Caches) -> &OnceLock<Store<Self>>;
    /// Where a tenant holds this kind's component.
    fn lookup_mut(t: &mut Tenant) -> &mut Lookup<Self>;
    /// This kind's watch cache, once its controller runs.
    fn cache(c: &Caches) -> Option<&Store<Self>> {
        Self::cache_slot(c).get()
    }
}

/// The controllers' watch caches, shared so that a reconcile reads what the watches already
/// hold instead of asking the API server (a miss, such as an object created a moment ago,
/// falls back to a GET).
#[derive(Default)]
pub struct Caches {
    /// Control planes.
    pub ncps: OnceLock<Store<NestedControlPlane>>,
    /// etcd components.
    pub etcds: OnceLock<Store<NestedEtcd>>,
    /// API server components.
    pub apiservers: OnceLock<Store<NestedAPIServer>>,
    /// Controller-manager components.
    pub controller_managers: OnceLock<Store<NestedControllerManager>>,
    /// Scheduler components.
    pub schedulers: OnceLock<Store<NestedScheduler>>,
    /// Shared datastores.
    pub datastores: OnceLock<Store<nestplane_api::NestedDatastore>>,
    /// Secrets nestplane manages (label `app.kubernetes.io/managed-by=nestplane`).
    pub secrets: OnceLock<Store<k8s_openapi::api::core::v1::Secret>>,
}

impl Caches {
    /// A control plane from the cache, else from the API server.
    pub async fn ncp(
        &self,
        client: &kube::Client,
        ns: &str,
        name: &str,
    ) -> Result<Option<NestedControlPlane>, kube::Error> {
        cached_or_get(self.ncps.get(), client, ns, name).await
    }
}

/// `ns/name` from `cache` when it has it, else from the API server (an object created a
/// moment ago, or one the cache does not select).
pub async fn cached_or_get<K>(
    cache: Option<&Store<K>>,
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<Option<K>, kube::Error>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    if let Some(hit) = cache.and_then(|s| s.get(&ObjectRef::new(name).within(ns))) {
        return Ok(Some((*hit).clone()));
    }
    Api::<K>::namespaced(client.clone(), ns).get_opt(name).await
}

macro_rules! component_kind {
    ($ty:ty, $spec:ident, $c:expr, $status:expr, $cache:expr, $lookup:expr) => {
        impl ComponentKind for $ty {
            const COMPONENT: Component = $c;
            fn component_spec(&self) -> &NestedComponentSpec {
                &self.spec.component
            }
            fn common_status(&self) -> Option<&ComponentStatus> {
                let f: fn(&Self) -> Option<&ComponentStatus> = $status;
                f(self)
            }
            fn with_defaults(name: &str, namespace: &str) -> Self {
                let mut o = <$ty>::new(name, nestplane_api::$spec::default());
                o.metadata.namespace = Some(namespace.to_string());
                o
            }
            fn cache_slot(c: &Caches) -> &OnceLock<Store<Self>> {
                let f: fn(&Caches) -> &OnceLock<Store<Self>> = $cache;
                f(c)
            }
            fn lookup_mut(t: &mut Tenant) -> &mut Lookup<Self> {
                let f: fn(&mut Tenant) -> &mut Lookup<Self> = $lookup;
                f(t)
            }
        }
    };
}

component_kind!(
    NestedEtcd,
    NestedEtcdSpec,
    Component::Etcd,
    |o| o.status.as_ref().map(|s| &s.common),
    |c| &c.etcds,
    |t| &mut t.etcd
);
component_kind!(
    NestedAPIServer,
    NestedAPIServerSpec,
    Component::ApiServer,
    |o| o.status.as_ref().map(|s| &s.common),
    |c| &c.apiservers,
    |t| &mut t.apiserver
);
component_kind!(
    NestedControllerManager,
    NestedControllerManagerSpec,
    Component::ControllerManager,
    |o| o.status.as_ref(),
    |c| &c.controller_managers,
    |t| &mut t.controller_manager
);
component_kind!(
    NestedScheduler,
    NestedSchedulerSpec,
    Component::Scheduler,
    |o| o.status.as_ref(),
    |c| &c.schedulers,
    |t| &mut t.scheduler
);

/// The reference field of the control plane that points at a component.
pub fn reference(ncp: &NestedControlPlane, c: Component) -> Option<&ObjectReference> {
    match c {
        Component::Etcd => ncp.spec.etcd.as_ref(),
        Component::ApiServer => ncp.spec.apiserver.as_ref(),
        Component::ControllerManager => ncp.spec.controller_manager.as_ref(),
        Component::Scheduler => ncp.spec.scheduler.as_ref(),
    }
}

/// The JSON field name of a component reference in the control plane's spec.
pub fn reference_field(c: Component) -> &'static str {
    match c {
        Component::Etcd => "etcd",
        Component::ApiServer => "apiserver",
        Component::ControllerManager => "controllerManager",
        Component::Scheduler => "scheduler",
    }
}

/// The kind name of a component.
pub fn kind_of(c: Component) -> &'static str {
    match c {
        Component::Etcd => "NestedEtcd",
        Component::ApiServer => "NestedAPIServer",
        Component::ControllerManager => "NestedControllerManager",
        Component::Scheduler => "NestedScheduler",
    }
}

/// A controller owner reference to `ncp`.
pub fn owner_ref(ncp: &NestedControlPlane) -> OwnerReference {
    let mut r = ncp.controller_owner_ref(&()).unwrap_or_default();
    r.block_owner_deletion = Some(true);
    r
}

/// The control plane that controls `obj`, by its controller owner reference.
pub fn controller_of<K: Resource>(obj: &K) -> Option<&OwnerReference> {
    obj.meta().owner_references.iter().flatten().find(|r| {
        r.controller == Some(true)
            && r.kind == "NestedControlPlane"
            && r.api_version
                .starts_with(nestplane_api::controlplane::GROUP)
    })
}

/// A component object read through the control plane's reference.
#[derive(Clone, Debug)]
pub enum Lookup<K> {
    /// No reference in the control plane's spec.
    Unreferenced,
    /// Referenced, but the object does not exist.
    NotFound(String),
    /// Referenced in another namespace (not supported).
    OtherNamespace(String),
    /// Found.
    Found(K),
}

impl<K: ComponentKind> Lookup<K> {
    /// The object, when found.
    pub fn found(&self) -> Option<&K> {
        match self {
            Lookup::Found(k) => Some(k),
            _ => None,
        }
    }

    /// Whether the component reports Ready.
    pub fn ready(&self) -> bool {
        self.found()
            .and_then(|k| k.common_status())
            .is_some_and(|s| s.ready)
    }
}

/// Read the component `K` that `ncp` references.
pub async fn lookup<K: ComponentKind>(
    client: &kube::Client,
    caches: &Caches,
    ncp: &NestedControlPlane,
) -> Result<Lookup<K>, kube::Error> {
    let ns = ncp.namespace().unwrap_or_default();
    let Some(r) = reference(ncp, K::COMPONENT) else {
        return Ok(Lookup::Unreferenced);
    };
    let name = r.name.clone().unwrap_or_default();
    if let Some(other) = r.namespace.as_deref().filter(|n| !n.is_empty() && *n != ns) {
        return Ok(Lookup::OtherNamespace(format!(
            "{} {other}/{name} is in another namespace; components must live in the control plane's namespace {ns}",
            kind_of(K::COMPONENT)
        )));
    }
    let cached = K::cache(caches).and_then(|s| s.get(&ObjectRef::new(&name).within(&ns)));
    let found = match cached {
        Some(hit) => Some((*hit).clone()),
        None => {
            Api::<K>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await?
        }
    };
    Ok(match found {
        Some(k) => Lookup::Found(k),
        None => Lookup::NotFound(format!(
            "{} {ns}/{name} referenced by the control plane does not exist",
            kind_of(K::COMPONENT)
        )),
    })
}

/// The Cluster API `Cluster` that owns `ncp`: a controller or plain owner reference of kind
/// `Cluster` in `cluster.x-k8s.io`, else the `cluster.x-k8s.io/cluster-name` label. Pure.
pub fn owning_cluster(ncp: &NestedControlPlane) -> Option<String> {
    let by_ref = ncp.owner_references().iter().find(|r| {
        r.kind == "Cluster" && r.api_version.split('/').next() == Some(names::CLUSTER_API_GROUP)
    });
    by_ref.map(|r| r.name.clone()).or_else(|| {
        ncp.labels()
            .get(names::CLUSTER_NAME_LABEL)
            .filter(|v| !v.is_empty())
            .cloned()
    })
}

/// The name a tenant's objects (secrets `<name>-kubeconfig`, `<name>-ca`, …, workloads,
/// processes) are named after: the one recorded in its status when it was first provisioned
/// (it never changes afterwards), else its annotation (written with the finalizer), else the
/// owning Cluster's, else the control plane's own. Not validated: see [`name_problem`]. Pure.
pub fn cluster_name(ncp: &NestedControlPlane) -> String {
    ncp.status
        .as_ref()
        .and_then(|s| s.cluster_name.clone())
        .filter(|v| !v.is_empty())
        .or_else(|| {
            ncp.annotations()
                .get(names::CLUSTER_IDENTITY_ANNOTATION)
                .filter(|v| !v.is_empty())
                .cloned()
        })
        .or_else(|| owning_cluster(ncp))
        .unwrap_or_else(|| ncp.name_any())
}

/// Why `ncp`'s cluster name cannot be used, or `None`: it must be a DNS label short enough for
/// every derived name (it becomes object names, labels and a directory), and once recorded in
/// the status, the annotation may not name another. Pure.
pub fn name_problem(ncp: &NestedControlPlane) -> Option<String> {
    let name = cluster_name(ncp);
    if let Some(p) = names::dns_label_problem(&name, names::MAX_CLUSTER_NAME_LEN) {
        return Some(if name.len() > names::MAX_CLUSTER_NAME_LEN {
            format!(
                "the control plane name {name:?} has {} characters; at most {} fit in derived names such as {name}-controller-manager-kubeconfig (63-character DNS labels)",
                name.len(),
                names::MAX_CLUSTER_NAME_LEN
            )
        } else {
            format!("the cluster name: {p}")
        });
    }
    let recorded = ncp.status.as_ref().and_then(|s| s.cluster_name.as_deref());
    let annotated = ncp
        .annotations()
        .get(names::CLUSTER_IDENTITY_ANNOTATION)
        .map(String::as_str);
    match (recorded, annotated) {
        (Some(r), Some(a)) if r != a => Some(format!(
            "annotation {} is {a:?}, but this control plane was provisioned as {r:?} and its name is fixed; set the annotation back to {r:?}",
            names::CLUSTER_IDENTITY_ANNOTATION
        )),
        _ => None,
    }
}

/// Whether the owning Cluster says `spec.paused` (a Cluster that does not exist, or a
/// management cluster without the `Cluster` kind, pauses nothing).
pub async fn cluster_paused(client: &kube::Client, ncp: &NestedControlPlane) -> bool {
    use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
    let Some(name) = owning_cluster(ncp) else {
        return false;
    };
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, "v1beta1", "Cluster"),
        "clusters",
    );
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ncp.namespace().unwrap_or_default(), &ar);
    match api.get_opt(&name).await {
        Ok(Some(c)) => c.data["spec"]["paused"].as_bool().unwrap_or(false),
        _ => false,
    }
}

/// Every component of a tenant.
#[derive(Clone, Debug)]
pub struct Tenant {
    /// The control plane.
    pub ncp: NestedControlPlane,
    /// etcd.
    pub etcd: Lookup<NestedEtcd>,
    /// kube-apiserver.
    pub apiserver: Lookup<NestedAPIServer>,
    /// kube-controller-manager.
    pub controller_manager: Lookup<NestedControllerManager>,
    /// kube-scheduler.
    pub scheduler: Lookup<NestedScheduler>,
    /// The owning Cluster's `spec.paused`.
    pub cluster_paused: bool,
    /// Client URLs of an etcd run by someone else (see [`Tenant::etcd_status_urls`]);
    /// `None` when nestplane runs it.
    pub external_etcd: Option<Vec<String>>,
    /// Who owns what is made for this tenant when it is not the control plane itself (a
    /// `NestedDatastore`'s own etcd runs as a tenant of its own).
    pub owner: Option<OwnerReference>,
    /// Whether this tenant's etcd compacts itself (a shared datastore's: its tenants' API
    /// servers do not compact).
    pub etcd_compacts_itself: bool,
    /// etcd's space quota, for a shared datastore's etcd.
    pub etcd_quota_backend_bytes: Option<i64>,
    /// The `NestedRestore` that holds the API server, controller manager and scheduler
    /// stopped while it replaces the keys (see [`Tenant::held`]).
    pub held_by: Option<String>,
}

/// How much history a shared datastore's etcd keeps (what kube-apiserver's own compactor
/// keeps by default).
pub const ETCD_RETENTION: &str = "5m";

/// Who manages a component object instead of nestplane: the value of its
/// `cluster.x-k8s.io/managed-by` annotation (any value but `nestplane`; an empty value is
/// "someone"). Pure.
pub fn managed_elsewhere(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<String> {
    let v = meta
        .annotations
        .as_ref()?
        .get(names::EXTERNALLY_MANAGED_ANNOTATION)?;
    (v != names::MANAGED_BY).then(|| {
        if v.is_empty() {
            "an out-of-tree controller".to_string()
        } else {
            v.clone()
        }
    })
}

impl Tenant {
    /// Read the control plane's components.
    pub async fn load(
        client: &kube::Client,
        caches: &Caches,
        ncp: NestedControlPlane,
    ) -> Result<Tenant, kube::Error> {
        Ok(Tenant {
            etcd: lookup(client, caches, &ncp).await?,
            apiserver: lookup(client, caches, &ncp).await?,
            controller_manager: lookup(client, caches, &ncp).await?,
            scheduler: lookup(client, caches, &ncp).await?,
            cluster_paused: cluster_paused(client, &ncp).await,
            external_etcd: None,
            owner: None,
            etcd_compacts_itself: false,
            etcd_quota_backend_bytes: None,
            held_by: None,
            ncp,
        })
    }

    /// The controller owner reference of everything made for this tenant.
    pub fn owner(&self) -> OwnerReference {
        self.owner.clone().unwrap_or_else(|| owner_ref(&self.ncp))
    }

    /// The shared datastore this tenant is bound to (its user, role and prefix exist there
    /// and its etcd credentials are issued), as its status says. It stays bound there when
    /// `spec.datastoreRef` is removed (refused: its data is there).
    pub fn datastore(&self) -> Option<&nestplane_api::datastore::TenantDatastoreStatus> {
        self.ncp.status.as_ref()?.datastore.as_ref()
    }

    /// Whether the tenant's data is (or is to be) on a shared datastore rather than an etcd
    /// of its own.
    pub fn on_datastore(&self) -> bool {
        self.ncp.spec.datastore_ref.is_some() || self.datastore().is_some()
    }

    /// Who manages component `c` instead of nestplane, per its annotation.
    pub fn managed_elsewhere(&self, c: Component) -> Option<String> {
        fn by<K: ComponentKind>(l: &Lookup<K>) -> Option<String> {
            l.found().and_then(|k| managed_elsewhere(k.meta()))
        }
        match c {
            Component::Etcd => by(&self.etcd),
            Component::ApiServer => by(&self.apiserver),
            Component::ControllerManager => by(&self.controller_manager),
            Component::Scheduler => by(&self.scheduler),
        }
    }

    /// The client URLs the etcd's status reports (`https://<hostname or ip>:<port>` per
    /// address): how the API server reaches an etcd that nestplane does not run.
    pub fn etcd_status_urls(&self) -> Vec<String> {
        let Some(status) = self.etcd.found().and_then(|e| e.status.as_ref()) else {
            return Vec::new();
        };
        status
            .addresses
            .iter()
            .filter_map(|a| {
                let host = a.hostname.clone().filter(|h| !h.is_empty()).or_else(|| {
                    a.ip.as_ref()
                        .map(|ip| match ip.parse::<std::net::Ipv6Addr>() {
                            Ok(_) => format!("[{ip}]"),
                            Err(_) => ip.clone(),
                        })
                })?;
                Some(format!("https://{host}:{}", a.port))
            })
            .collect()
    }

    /// Whether component `c` is held stopped by a restore: it runs no replica (its
    /// certificates, Services and everything else stay as they are).
    pub fn held(&self, c: Component) -> bool {
        self.held_by.is_some() && c != Component::Etcd
    }

    /// The cluster name every derived object is named after ([`cluster_name`]).
    pub fn cluster(&self) -> String {
        cluster_name(&self.ncp)
    }

    /// The control plane's namespace.
    pub fn namespace(&self) -> String {
        self.ncp.namespace().unwrap_or_default()
    }

    /// The component spec of `c`, when found.
    pub fn spec_of(&self, c: Component) -> Option<&NestedComponentSpec> {
        match c {
            Component::Etcd => self.etcd.found().map(|k| k.component_spec()),
            Component::ApiServer => self.apiserver.found().map(|k| k.component_spec()),
            Component::ControllerManager => {
                self.controller_manager.found().map(|k| k.component_spec())
            }
            Component::Scheduler => self.scheduler.found().map(|k| k.component_spec()),
        }
    }

    /// The object metadata of `c`, when found.
    pub fn meta_of(
        &self,
        c: Component,
    ) -> Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta> {
        match c {
            Component::Etcd => self.etcd.found().map(|k| k.meta()),
            Component::ApiServer => self.apiserver.found().map(|k| k.meta()),
            Component::ControllerManager => self.controller_manager.found().map(|k| k.meta()),
            Component::Scheduler => self.scheduler.found().map(|k| k.meta()),
        }
    }

    /// The status of `c`, when found and written.
    pub fn status_of(&self, c: Component) -> Option<&ComponentStatus> {
        match c {
            Component::Etcd => self.etcd.found().and_then(|k| k.common_status()),
            Component::ApiServer => self.apiserver.found().and_then(|k| k.common_status()),
            Component::ControllerManager => self
                .controller_manager
                .found()
                .and_then(|k| k.common_status()),
            Component::Scheduler => self.scheduler.found().and_then(|k| k.common_status()),
        }
    }

    /// Whether `c` reports Ready.
    pub fn ready(&self, c: Component) -> bool {
        match c {
            // On a shared datastore, etcd is ready for the tenant once it is bound there.
            Component::Etcd if self.on_datastore() => self.datastore().is_some(),
            Component::Etcd => self.etcd.ready(),
            Component::ApiServer => self.apiserver.ready(),
            Component::ControllerManager => self.controller_manager.ready(),
            Component::Scheduler => self.scheduler.ready(),
        }
    }

    /// The replicas the spec of `c` asks for. The API server follows the control plane's
    /// `spec.replicas` (the Cluster API scale subresource) when set.
    pub fn wanted_replicas(&self, c: Component) -> Option<i32> {
        let from_spec = self.spec_of(c).and_then(|s| s.replicas);
        match c {
            Component::ApiServer => self.ncp.spec.replicas.or(from_spec),
            _ => from_spec,
        }
    }

    /// Replicas that `c` runs: what its spec asks for, except for a bootstrapped etcd, which
    /// keeps the members it was formed with (see [`Tenant::etcd_scale_refused`]). Out-of-range
    /// values are reported by [`Tenant::replicas_problem`]; until fixed, 1 is used.
    pub fn replicas(&self, c: Component) -> u32 {
        if c == Component::Etcd
            && let Some(members) = self.etcd_members()
        {
            return members;
        }
        match self.wanted_replicas(c) {
            Some(n) if (1..=i32::from(nestplane_runtime::process::MAX_REPLICAS)).contains(&n) => {
                n as u32
            }
            _ => 1,
        }
    }

    /// A replica count outside 1..=7, said for a person.
    pub fn replicas_problem(&self, c: Component) -> Option<String> {
        let n = self.wanted_replicas(c)?;
        let max = i32::from(nestplane_runtime::process::MAX_REPLICAS);
        (!(1..=max).contains(&n)).then(|| {
            format!(
                "{} replicas {n} is out of range: a component runs 1 to {max} replicas",
                kind_of(c)
            )
        })
    }

    /// How many members the tenant's etcd was formed with, once it has been Ready (its status
    /// keeps the member addresses and the version it became Ready with).
    pub fn etcd_members(&self) -> Option<u32> {
        let etcd = self.etcd.found()?;
        let st = etcd.status.as_ref()?;
        (st.common.version.is_some() && !st.addresses.is_empty())
            .then_some(st.addresses.len() as u32)
    }

    /// `(members, wanted)` when the etcd spec asks for a different member count after
    /// bootstrap. Membership changes are not supported: starting new members with
    /// `initial-cluster-state=new` would form a second cluster beside the first and lose the
    /// tenant's data, so the change is refused and the existing members keep running.
    pub fn etcd_scale_refused(&self) -> Option<(u32, i32)> {
        let members = self.etcd_members()?;
        let wanted = self.wanted_replicas(Component::Etcd).unwrap_or(1);
        (wanted != members as i32).then_some((members, wanted))
    }

    /// Whether the control plane or the component carries the pause annotation.
    pub fn paused(&self, c: Option<Component>) -> bool {
        let annotated = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
            m.annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(names::PAUSED_ANNOTATION))
        };
        self.cluster_paused
            || annotated(&self.ncp.metadata)
            || match c {
                Some(Component::Etcd) => self.etcd.found().is_some_and(|k| annotated(&k.metadata)),
                Some(Component::ApiServer) => self
                    .apiserver
                    .found()
                    .is_some_and(|k| annotated(&k.metadata)),
                Some(Component::ControllerManager) => self
                    .controller_manager
                    .found()
                    .is_some_and(|k| annotated(&k.metadata)),
                Some(Component::Scheduler) => self
                    .scheduler
                    .found()
                    .is_some_and(|k| annotated(&k.metadata)),
                None => false,
            }
    }

    /// The version `c` runs: its own `version`, else its `channel`, else the control plane's
    /// `version`, else the default. Returns (reason, message) for a person when it cannot.
    pub fn version(&self, c: Component) -> Result<nestplane_render::KubeVersion, (String, String)> {
        use nestplane_api::conditions::reasons;
        let spec = self.spec_of(c);
        let (raw, source) = if let Some(v) = spec
            .and_then(|s| s.version.clone())
            .filter(|v| !v.is_empty())
        {
            (v, format!("{}.spec.version", kind_of(c)))
        } else if let Some(ch) = spec
            .and_then(|s| s.channel.clone())
            .filter(|v| !v.is_empty())
        {
            match nestplane_render::channels::resolve(&ch) {
                Some(v) => (v, format!("channel {ch}")),
                None => {
                    let known: Vec<String> = nestplane_render::channels::all()
                        .into_iter()
                        .map(|(n, _)| n)
                        .collect();
                    return Err((
                        reasons::INVALID_SPEC.into(),
                        format!(
                            "{}.spec.channel {ch:?} is not a known channel (known: {})",
                            kind_of(c),
                            known.join(", ")
                        ),
                    ));
                }
            }
        } else if let Some(v) = self.ncp.spec.version.clone().filter(|v| !v.is_empty()) {
            (v, "NestedControlPlane.spec.version".into())
        } else {
            (
                names::DEFAULT_KUBERNETES_VERSION.into(),
                "the default".into(),
            )
        };
        nestplane_render::KubeVersion::parse(&raw).map_err(|e| {
            (
                reasons::VERSION_UNAVAILABLE.into(),
                format!("version {raw:?} from {source}: {e}"),
            )
        })
    }

    /// The version component `c` runs now (its status, once it has run one).
    pub fn running_version(&self, c: Component) -> Option<nestplane_render::KubeVersion> {
        self.status_of(c)
            .and_then(|s| s.version.as_deref())
            .and_then(|v| nestplane_render::KubeVersion::parse(v).ok())
    }

    /// The version `c` was last rendered at: its [`names::RENDERED_VERSION_ANNOTATION`],
    /// else the version it runs. What a refused change keeps.
    /// The annotation is a namespace user's to edit: it is believed only where it names a
    /// version the running one may step to (so it can never carry a refused move).
    pub fn rendered_version(&self, c: Component) -> Option<nestplane_render::KubeVersion> {
        let running = self.running_version(c)?;
        self.meta_of(c)
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(names::RENDERED_VERSION_ANNOTATION))
            .and_then(|v| nestplane_render::KubeVersion::parse(v).ok())
            .filter(|r| version_step_refused(c, running, *r).is_none())
            // The controller manager and scheduler never pass the API server that runs.
            .filter(|r| match c {
                Component::ControllerManager | Component::Scheduler => self
                    .running_version(Component::ApiServer)
                    .is_none_or(|a| (r.major, r.minor) <= (a.major, a.minor)),
                _ => true,
            })
            .or(Some(running))
    }

    /// The control plane's version change, judged as a whole before any component moves
    /// ([`VersionChange`]), and planned: a jump of several minors is one step per minor (the
    /// newest patch `newest_patch` names for each intermediate minor), and the step under way
    /// is the first one after the oldest version a part runs, so that every part reaches a
    /// step before any goes on to the next. `parts` are the tenant's component objects;
    /// `can_run` says why a component cannot run a version here (asked for every step before
    /// the first starts).
    pub fn version_change(
        &self,
        parts: &[Component],
        can_run: impl Fn(Component, &nestplane_render::KubeVersion) -> Result<(), String>,
        newest_patch: impl Fn(u32) -> Option<u32>,
    ) -> VersionChange {
        use nestplane_api::conditions::reasons;
        use nestplane_render::KubeVersion;
        use nestplane_render::upgrade::{self, Part, skew};
        let nothing_runs = parts.iter().all(|&c| self.running_version(c).is_none());
        // (component, running, asked for)
        let mut finals: Vec<(Component, Option<KubeVersion>, KubeVersion)> = Vec::new();
        for &c in parts {
            let running = self.running_version(c);
            match self.version(c) {
                Ok(v) => finals.push((c, running, v)),
                // What runs keeps running its version; a new component reports it itself.
                Err((reason, msg)) if running.is_some() => {
                    let reason = if reason == reasons::INVALID_SPEC {
                        reasons::INVALID_SPEC
                    } else {
                        reasons::VERSION_UNAVAILABLE
                    };
                    return VersionChange::Refused(reason, msg);
                }
                Err(_) => {}
            }
        }
        let Some(to) = finals
            .iter()
            .find(|(c, _, _)| *c == Component::ApiServer)
            .or_else(|| finals.iter().max_by_key(|(_, _, v)| *v))
            .map(|(_, _, v)| *v)
        else {
            return VersionChange::None;
        };
        // The plane is where its oldest moving part is; the steps go from there. A part that
        // runs what it is asked for (its own version pinned, say) is not moving.
        let from = finals
            .iter()
            .filter_map(|(_, r, want)| r.filter(|r| r != want))
            .min();
        let steps = match from {
            None => vec![],
            Some(from) => match upgrade::steps(from, to, &newest_patch) {
                Ok(steps) => steps,
                // Going down: no steps; whether each part may go back is judged per part below
                // (the API server never a minor, etcd never a minor of etcd).
                Err(upgrade::Refusal::MinorDowngrade { .. }) => vec![],
                Err(upgrade::Refusal::NoStepVersion { minor, .. }) => {
                    let between: Vec<String> = (from.minor + 1..=to.minor)
                        .map(|m| format!("1.{m}"))
                        .collect();
                    return VersionChange::Refused(
                        reasons::MINOR_SKIP_REFUSED,
                        format!(
                            "{} runs {from}; {to} is {} minor steps away ({}) and no 1.{minor} version can run here to step through: set a 1.{} version first",
                            kind_of(Component::ApiServer),
                            between.len(),
                            between.join(", "),
                            from.minor + 1
                        ),
                    );
                }
            },
        };
        // A part goes to the step's version, or to its own if that is older.
        let capped = |want: KubeVersion, step: KubeVersion| {
            if (want.major, want.minor) > (step.major, step.minor) {
                step
            } else {
                want
            }
        };
        let step = steps.first().copied().unwrap_or(to);
        let mut planned = Vec::new();
        let mut unavailable = None;
        let minor = |v: KubeVersion| (v.major, v.minor);
        for &(c, running, want) in &finals {
            // A part never goes below the minor it runs: one already at or past the step's
            // minor, going further, waits there for the others.
            let at_step = match running {
                Some(r) if r == want => want,
                Some(r) if minor(want) > minor(step) && minor(r) >= minor(step) => r,
                _ => capped(want, step),
            };
            planned.push((c, running, at_step));
            if let Some(from) = running.filter(|r| *r != at_step)
                && let Some(refused) = version_step_refused(c, from, at_step)
            {
                return refused;
            }
            // A component that never ran, beside others that run, says so itself and holds
            // nobody else's change; before anything runs, nothing starts unless all can.
            if running.is_none() && !nothing_runs {
                continue;
            }
            let every_step = steps.iter().map(|s| capped(want, *s));
            for v in std::iter::once(at_step).chain(every_step) {
                if unavailable.is_none()
                    && let Err(e) = can_run(c, &v)
                {
                    unavailable = Some(e);
                }
            }
        }
        // The controller manager and the scheduler never pass the API server, nor lag it by
        // more than a minor: at this step, and where the change ends.
        for list in [&planned, &finals] {
            let Some(api) = list
                .iter()
                .find(|p| p.0 == Component::ApiServer)
                .map(|p| p.2)
                .or_else(|| self.running_version(Component::ApiServer))
            else {
                continue;
            };
            for &(c, running, want) in list.iter() {
                let part = match c {
                    Component::ControllerManager => Part::ControllerManager,
                    Component::Scheduler => Part::Scheduler,
                    _ => continue,
                };
                // A new component beside others that run is judged when it runs.
                if running.is_none() && !nothing_runs {
                    continue;
                }
                if let Err(e) = skew(part, want, api) {
                    return VersionChange::Refused(
                        reasons::UNSUPPORTED_SKEW,
                        format!("{}: {e}", kind_of(c)),
                    );
                }
            }
        }
        if let Some(e) = unavailable {
            return VersionChange::Refused(reasons::VERSION_UNAVAILABLE, e);
        }
        let plan = Plan {
            from: from.unwrap_or(to),
            to,
            steps,
            parts: planned,
        };
        if plan.moves().next().is_none() {
            VersionChange::None
        } else {
            VersionChange::Moving(plan)
        }
    }

    /// What keeps `c` from moving to its version of the plan's step: the first part it
    /// depends on (etcd for the API server, the API server for the others) that does not yet
    /// run its own version of the step, Ready. A part `steps_here` says another controller
    /// runs (which knows nothing of steps) need only be Ready. `None`: `c` may move.
    pub fn held_by(
        &self,
        plan: &Plan,
        c: Component,
        steps_here: impl Fn(Component) -> bool,
    ) -> Option<(Component, nestplane_render::KubeVersion)> {
        c.dependencies().iter().find_map(|&d| {
            let step = plan.step_version(d)?;
            let behind = steps_here(d) && self.running_version(d) != Some(step);
            (behind || !self.ready(d)).then_some((d, step))
        })
    }

    /// Validate the cluster name (see [`name_problem`]).
    pub fn name_problem(&self) -> Option<String> {
        name_problem(&self.ncp)
    }

    /// The render input for this tenant on `network`.
    pub fn render_input(
        &self,
        version: nestplane_render::KubeVersion,
        network: nestplane_render::Network,
    ) -> nestplane_render::RenderInput {
        let mut input =
            nestplane_render::RenderInput::new(self.cluster(), self.namespace(), version, network);
        let mut replicas = BTreeMap::new();
        let mut resources = BTreeMap::new();
        for c in Component::ALL {
            replicas.insert(c, self.replicas(c));
            if let Some(r) = self.spec_of(c).and_then(|s| s.resources.clone()) {
                resources.insert(c, r);
            }
        }
        input.replicas = replicas;
        input.resources = resources;
        input.external_etcd = self.external_etcd.clone();
        if self.etcd_compacts_itself {
            input.etcd_auto_compaction = Some(ETCD_RETENTION.into());
        }
        input.etcd_quota_backend_bytes = self.etcd_quota_backend_bytes;
        if let Some(d) = self.datastore() {
            input.external_etcd = Some(d.endpoints.clone());
            input.datastore_prefix = Some(d.prefix.clone());
        }
        if let Some(net) = &self.ncp.spec.cluster_network {
            if let Some(cidr) = net.services.as_ref().and_then(|s| s.cidr_blocks.first()) {
                input.service_cidr = cidr.clone();
            }
            if let Some(domain) = net.service_domain.as_ref().filter(|d| !d.is_empty()) {
                input.cluster_domain = domain.clone();
            }
        }
        input
    }
}

/// Whether component `c` may go from `from` to `want` in one step. The API server decides
/// for the control plane (its stored objects take its version's form): no minor down, one
/// minor at a time (no intermediate version is offered yet). etcd's own data never goes back
/// a minor of etcd (the one kubeadm pairs with each version). The controller manager and the
/// scheduler follow the API server.
fn version_step_refused(
    c: Component,
    from: nestplane_render::KubeVersion,
    want: nestplane_render::KubeVersion,
) -> Option<VersionChange> {
    use nestplane_api::conditions::reasons;
    use nestplane_render::{etcd_version_for, upgrade};
    match c {
        Component::ApiServer => match upgrade::steps(from, want, |_| None) {
            Ok(_) => None,
            Err(r @ upgrade::Refusal::MinorDowngrade { .. }) => Some(VersionChange::Refused(
                reasons::DOWNGRADE_REFUSED,
                format!("{}: {r}", kind_of(c)),
            )),
            Err(upgrade::Refusal::NoStepVersion { .. }) => {
                let between: Vec<String> = (from.minor + 1..=want.minor)
                    .map(|m| format!("1.{m}"))
                    .collect();
                Some(VersionChange::Refused(
                    reasons::MINOR_SKIP_REFUSED,
                    format!(
                        "{} runs {from}; {want} is {} minor steps away ({}) and nestplane moves a control plane one minor at a time: set a 1.{} version first",
                        kind_of(c),
                        between.len(),
                        between.join(", "),
                        from.minor + 1
                    ),
                ))
            }
        },
        Component::Etcd => {
            let minor_of = |v: &str| -> (u32, u32) {
                let mut it = v.split(['.', '-']).map(|p| p.parse().unwrap_or(0));
                (it.next().unwrap_or(0), it.next().unwrap_or(0))
            };
            let (old, new) = (etcd_version_for(&from), etcd_version_for(&want));
            (minor_of(new) < minor_of(old)).then(|| {
                VersionChange::Refused(
                    reasons::DOWNGRADE_REFUSED,
                    format!(
                        "{}: etcd {old} runs (paired with {from}) and {want} pairs etcd {new}; etcd's data never goes back a minor"
                    , kind_of(c)),
                )
            })
        }
        Component::ControllerManager | Component::Scheduler => None,
    }
}

/// A version change under way, as planned by [`Tenant::version_change`].
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The oldest version a part of the control plane runs.
    pub from: nestplane_render::KubeVersion,
    /// Where the control plane goes (its API server's version).
    pub to: nestplane_render::KubeVersion,
    /// The versions still to go through from `from`, one per minor, the last being `to`; the
    /// first is the step under way.
    pub steps: Vec<nestplane_render::KubeVersion>,
    /// Each part: (component, the version it runs, its version at this step).
    pub parts: Vec<(
        Component,
        Option<nestplane_render::KubeVersion>,
        nestplane_render::KubeVersion,
    )>,
}

impl Plan {
    /// The parts that run one version and move to another at this step: (component, from,
    /// to), in the order they move.
    pub fn moves(
        &self,
    ) -> impl Iterator<
        Item = (
            Component,
            nestplane_render::KubeVersion,
            nestplane_render::KubeVersion,
        ),
    > + '_ {
        self.parts
            .iter()
            .filter_map(|&(c, running, step)| running.filter(|r| *r != step).map(|r| (c, r, step)))
    }

    /// Component `c`'s version at the step under way, if it is a part of the plan.
    pub fn step_version(&self, c: Component) -> Option<nestplane_render::KubeVersion> {
        self.parts.iter().find(|p| p.0 == c).map(|p| p.2)
    }
}

/// A control plane's version change, judged as a whole ([`Tenant::version_change`]).
#[derive(Clone, Debug, PartialEq)]
pub enum VersionChange {
    /// Every component runs (or will first run) the version asked for.
    None,
    /// Components that run one version and are asked for another: the plan.
    Moving(Plan),
    /// Refused: (reason, message). Components that run keep their version; none starts.
    Refused(&'static str, String),
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::expect_used)]
    use super::*;

    fn ncp(meta: serde_json::Value) -> NestedControlPlane {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
            "kind": "NestedControlPlane",
            "metadata": meta,
            "spec": {}
        }))
        .expect("ncp")
    }

    #[test]
    fn the_owning_cluster_names_the_tenant() {
        let owned = ncp(
            serde_json::json!({"name": "foo-control-plane", "ownerReferences": [
            {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Cluster", "name": "foo", "uid": "u"}]}),
        );
        assert_eq!(cluster_name(&owned), "foo");
        let labelled = ncp(
            serde_json::json!({"name": "bar-cp", "labels": {"cluster.x-k8s.io/cluster-name": "bar"}}),
        );
        assert_eq!(cluster_name(&labelled), "bar");
        let alone = ncp(serde_json::json!({"name": "demo"}));
        assert_eq!(cluster_name(&alone), "demo");
        assert_eq!(owning_cluster(&alone), None);
        // A Cluster of another API group is not Cluster API's.
        let other = ncp(serde_json::json!({"name": "x", "ownerReferences": [
            {"apiVersion": "example.com/v1", "kind": "Cluster", "name": "y", "uid": "u"}]}));
        assert_eq!(cluster_name(&other), "x");
    }

    #[test]
    fn the_recorded_identity_wins_over_a_later_owner() {
        let late = ncp(serde_json::json!({"name": "foo-control-plane",
            "annotations": {"nestplane.io/cluster-name": "foo-control-plane"},
            "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Cluster", "name": "foo", "uid": "u"}]}));
        assert_eq!(cluster_name(&late), "foo-control-plane");
    }

    #[test]
    fn a_name_that_is_no_dns_label_or_moved_after_provisioning_is_a_problem() {
        for bad in ["/tmp/scratch", "../other", "a/b", "A"] {
            let hostile = ncp(serde_json::json!({"name": "x",
                "annotations": {"nestplane.io/cluster-name": bad}}));
            assert!(name_problem(&hostile).is_some(), "{bad:?} accepted");
        }
        let mut moved = ncp(serde_json::json!({"name": "x",
            "annotations": {"nestplane.io/cluster-name": "other"}}));
        moved.status = Some(nestplane_api::NestedControlPlaneStatus {
            cluster_name: Some("x".into()),
            ..Default::default()
        });
        // The recorded name is used, and the edit is reported.
        assert_eq!(cluster_name(&moved), "x");
        let p = name_problem(&moved).expect("a moved name is refused");
        assert!(
            p.contains("\"other\"") && p.contains("set the annotation back to \"x\""),
            "{p}"
        );
        let fine = ncp(serde_json::json!({"name": "x",
            "annotations": {"nestplane.io/cluster-name": "x"}}));
        assert_eq!(name_problem(&fine), None);
    }
    /// A tenant asking for `asked` whose components run `running` (none: not started).
    pub(crate) fn running(asked: &str, running: [Option<&str>; 4]) -> Tenant {
        let mut n = ncp(serde_json::json!({"name": "t", "namespace": "default"}));
        n.spec.version = Some(asked.into());
        fn part<K: serde::de::DeserializeOwned>(kind: &str, v: Option<&str>) -> Lookup<K> {
            Lookup::Found(
                serde_json::from_value(serde_json::json!({
                    "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1",
                    "kind": kind,
                    "metadata": {"name": "t-part", "namespace": "default"},
                    "spec": {},
                    "status": {"ready": v.is_some(), "version": v},
                }))
                .expect("component"),
            )
        }
        Tenant {
            ncp: n,
            etcd: part("NestedEtcd", running[0]),
            apiserver: part("NestedAPIServer", running[1]),
            controller_manager: part("NestedControllerManager", running[2]),
            scheduler: part("NestedScheduler", running[3]),
            cluster_paused: false,
            external_etcd: None,
            owner: None,
            etcd_compacts_itself: false,
            etcd_quota_backend_bytes: None,
            held_by: None,
        }
    }

    /// Only 1.20.2 and 1.20.5 can run, as on a machine with those binaries.
    fn here(c: Component, v: &nestplane_render::KubeVersion) -> Result<(), String> {
        let ok = v.minor == 20 && [2, 5].contains(&v.patch);
        ok.then_some(())
            .ok_or(format!("no {} binary for {v}", c.binary()))
    }

    /// No intermediate minor can run here.
    fn no_steps(_: u32) -> Option<u32> {
        None
    }

    fn v(s: &str) -> nestplane_render::KubeVersion {
        nestplane_render::KubeVersion::parse(s).expect("version")
    }

    #[test]
    fn a_jump_of_minors_goes_step_by_step_in_order() {
        let all = Component::ALL;
        let any = |_: Component, _: &nestplane_render::KubeVersion| Ok(());
        let newest = |minor: u32| (minor == 21).then_some(4);
        let plan = |t: &Tenant| match t.version_change(&all, any, newest) {
            VersionChange::Moving(p) => p,
            other => panic!("{other:?}"),
        };
        // The first step: every part to 1.21.4; etcd first, the others after what they need.
        let t = running("v1.22.1", [Some("v1.20.2"); 4]);
        let p = plan(&t);
        assert_eq!(p.steps, vec![v("v1.21.4"), v("v1.22.1")]);
        assert_eq!(p.from, v("v1.20.2"));
        assert_eq!(p.to, v("v1.22.1"));
        for c in all {
            assert_eq!(p.step_version(c), Some(v("v1.21.4")), "{c:?}");
        }
        assert_eq!(t.held_by(&p, Component::Etcd, |_| true), None);
        assert_eq!(
            t.held_by(&p, Component::ApiServer, |_| true),
            Some((Component::Etcd, v("v1.21.4")))
        );
        assert_eq!(
            t.held_by(&p, Component::Scheduler, |_| true),
            Some((Component::ApiServer, v("v1.21.4")))
        );
        // etcd reached the step: the API servers go; nobody goes on to 1.22 yet.
        let t = running(
            "v1.22.1",
            [
                Some("v1.21.4"),
                Some("v1.20.2"),
                Some("v1.20.2"),
                Some("v1.20.2"),
            ],
        );
        let p = plan(&t);
        assert_eq!(p.step_version(Component::Etcd), Some(v("v1.21.4")));
        assert_eq!(p.moves().count(), 3);
        assert_eq!(t.held_by(&p, Component::ApiServer, |_| true), None);
        assert!(
            t.held_by(&p, Component::ControllerManager, |_| true)
                .is_some()
        );
        // The API server reached it: the controller manager and scheduler go.
        let t = running(
            "v1.22.1",
            [
                Some("v1.21.4"),
                Some("v1.21.4"),
                Some("v1.20.2"),
                Some("v1.20.2"),
            ],
        );
        let p = plan(&t);
        assert_eq!(t.held_by(&p, Component::ControllerManager, |_| true), None);
        assert_eq!(p.steps.len(), 2, "still the first step");
        // Every part at the first step: the second begins, with etcd.
        let t = running("v1.22.1", [Some("v1.21.4"); 4]);
        let p = plan(&t);
        assert_eq!(p.steps, vec![v("v1.22.1")]);
        assert_eq!(p.from, v("v1.21.4"));
        assert_eq!(t.held_by(&p, Component::Etcd, |_| true), None);
        assert!(t.held_by(&p, Component::ApiServer, |_| true).is_some());
        // A part that is not Ready at its step holds what depends on it.
        let mut t = running(
            "v1.22.1",
            [
                Some("v1.21.4"),
                Some("v1.20.2"),
                Some("v1.20.2"),
                Some("v1.20.2"),
            ],
        );
        if let Lookup::Found(e) = &mut t.etcd {
            e.status.as_mut().expect("status").common.ready = false;
        }
        let p = plan(&t);
        assert!(t.held_by(&p, Component::ApiServer, |_| true).is_some());

        // A step that some part cannot run is refused before anything starts.
        let no_121_scheduler = |c: Component, v: &nestplane_render::KubeVersion| {
            if c == Component::Scheduler && v.minor == 21 {
                Err("no kube-scheduler for v1.21.4".to_string())
            } else {
                Ok(())
            }
        };
        assert!(matches!(
            running("v1.22.1", [Some("v1.20.2"); 4]).version_change(&all, no_121_scheduler, newest),
            VersionChange::Refused("VersionUnavailable", m) if m.contains("v1.21.4")
        ));
        // A part pinned where the change would leave it too far behind: refused up front,
        // although the first step alone would be fine.
        let mut t = running("v1.22.1", [Some("v1.20.2"); 4]);
        if let Lookup::Found(cm) = &mut t.controller_manager {
            cm.spec.component.version = Some("v1.20.2".into());
        }
        assert!(matches!(
            t.version_change(&all, any, newest),
            VersionChange::Refused("UnsupportedSkew", m) if m.contains("NestedControllerManager")
        ));
        // A part pinned at what it runs is not moving: it neither sets the step nor is
        // planned below itself; the others go on to the end.
        let mut t = running(
            "v1.22.1",
            [
                Some("v1.20.2"),
                Some("v1.21.4"),
                Some("v1.21.4"),
                Some("v1.21.4"),
            ],
        );
        if let Lookup::Found(e) = &mut t.etcd {
            e.spec.component.version = Some("v1.20.2".into());
        }
        let p = plan(&t);
        assert_eq!(p.step_version(Component::Etcd), Some(v("v1.20.2")));
        assert_eq!(p.step_version(Component::ApiServer), Some(v("v1.22.1")));
        assert_eq!(p.from, v("v1.21.4"));
        let mut t = running(
            "v1.20.5",
            [
                Some("v1.22.0"),
                Some("v1.20.2"),
                Some("v1.20.2"),
                Some("v1.20.2"),
            ],
        );
        if let Lookup::Found(e) = &mut t.etcd {
            e.spec.component.version = Some("v1.22.0".into());
        }
        let p = plan(&t);
        assert_eq!(
            p.step_version(Component::Etcd),
            Some(v("v1.22.0")),
            "pinned newer, kept"
        );
        assert_eq!(p.moves().count(), 3);
        // A dependency another controller runs need only be Ready.
        let t = running("v1.22.1", [Some("v1.20.2"); 4]);
        let p = plan(&t);
        assert!(t.held_by(&p, Component::ApiServer, |_| true).is_some());
        assert_eq!(
            t.held_by(&p, Component::ApiServer, |d| d != Component::Etcd),
            None
        );
        // With nothing to step through, the jump is refused, naming the missing minor.
        assert!(matches!(
            running("v1.23.0", [Some("v1.20.2"); 4]).version_change(&all, any, newest),
            VersionChange::Refused("MinorSkipRefused", m) if m.contains("no 1.22 version")
        ));
    }

    #[test]
    fn a_version_change_moves_all_or_nothing() {
        let all = Component::ALL;
        let at = |v| [Some(v); 4];
        // Nothing to change.
        assert_eq!(
            running("v1.20.2", at("v1.20.2")).version_change(&all, here, no_steps),
            VersionChange::None
        );
        // A patch up, available for every component: they move.
        match running("v1.20.5", at("v1.20.2")).version_change(&all, here, no_steps) {
            VersionChange::Moving(p) => assert_eq!(p.moves().count(), 4, "{p:?}"),
            other => panic!("{other:?}"),
        }
        // A patch with no binaries: refused as a whole, naming what is missing.
        let VersionChange::Refused(reason, msg) =
            running("v1.20.9", at("v1.20.2")).version_change(&all, here, no_steps)
        else {
            panic!("unavailable accepted")
        };
        assert_eq!(reason, "VersionUnavailable");
        assert!(msg.contains("etcd") && msg.contains("v1.20.9"), "{msg}");
        // A minor down: refused, whatever is available.
        let VersionChange::Refused(reason, msg) =
            running("v1.20.2", at("v1.21.0")).version_change(&all, here, no_steps)
        else {
            panic!("downgrade accepted")
        };
        assert_eq!(reason, "DowngradeRefused");
        assert!(msg.contains("never goes down"), "{msg}");
        // Two minors up at once: refused, naming the step to take first.
        let VersionChange::Refused(reason, msg) =
            running("v1.22.0", at("v1.20.2")).version_change(&all, here, no_steps)
        else {
            panic!("skip accepted")
        };
        assert_eq!(reason, "MinorSkipRefused");
        assert!(
            msg.contains("1.21, 1.22") && msg.contains("set a 1.21"),
            "{msg}"
        );
        // A new tenant whose version cannot run: refused before anything starts.
        assert!(matches!(
            running("v1.33.0", [None; 4]).version_change(&all, here, no_steps),
            VersionChange::Refused("VersionUnavailable", _)
        ));
        // etcd reported the paired version of a change the API server never reached (its
        // etcd was the same): going back is no downgrade of anything.
        match running(
            "v1.20.2",
            [
                Some("v1.21.4"),
                Some("v1.20.2"),
                Some("v1.20.2"),
                Some("v1.20.2"),
            ],
        )
        .version_change(&all, |_, _| Ok(()), no_steps)
        {
            VersionChange::Moving(p) => assert_eq!(p.moves().count(), 1, "{p:?}"),
            other => panic!("{other:?}"),
        }
        // etcd 3.5 (paired with 1.22) does not go back to 3.4.
        assert!(matches!(
            running("v1.21.0", [Some("v1.22.0"), Some("v1.21.0"), Some("v1.21.0"), Some("v1.21.0")])
                .version_change(&all, |_, _| Ok(()), no_steps),
            VersionChange::Refused("DowngradeRefused", m) if m.contains("etcd 3.5.0-0")
        ));
        // The controller manager never passes the API server.
        let mut t = running("v1.20.2", at("v1.20.2"));
        if let Lookup::Found(cm) = &mut t.controller_manager {
            cm.spec.component.version = Some("v1.21.0".into());
        }
        assert!(matches!(
            t.version_change(&all, |_, _| Ok(()), no_steps),
            VersionChange::Refused("UnsupportedSkew", m) if m.contains("newer than the API server")
        ));
        // A new component that cannot run (beside ones that run) says so itself and holds
        // nobody else's change.
        let mut t = running(
            "v1.20.5",
            [Some("v1.20.2"), Some("v1.20.2"), Some("v1.20.2"), None],
        );
        if let Lookup::Found(s) = &mut t.scheduler {
            s.spec.component.version = Some("v1.20.9".into());
        }
        match t.version_change(&all, here, no_steps) {
            VersionChange::Moving(p) => assert_eq!(p.moves().count(), 3, "{p:?}"),
            other => panic!("{other:?}"),
        }
        let annotated = |rendered: &str| {
            let mut t = running("v1.22.0", at("v1.20.2"));
            if let Lookup::Found(a) = &mut t.apiserver {
                a.metadata.annotations = Some(
                    [(
                        names::RENDERED_VERSION_ANNOTATION.to_string(),
                        rendered.to_string(),
                    )]
                    .into(),
                );
            }
            t
        };
        // An annotation naming a move the rules refuse is not believed.
        assert_eq!(
            annotated("v1.34.0").rendered_version(Component::ApiServer),
            Some(nestplane_render::KubeVersion::new(1, 20, 2))
        );
        // What a refused change keeps is what was last rendered, which may be ahead of the
        // version that last became Ready.
        let t = annotated("v1.21.0");
        assert_eq!(
            t.rendered_version(Component::ApiServer),
            Some(nestplane_render::KubeVersion::new(1, 21, 0))
        );
        assert_eq!(
            t.rendered_version(Component::Etcd),
            Some(nestplane_render::KubeVersion::new(1, 20, 2))
        );
        // A part this operator does not run is not judged.
        assert_eq!(
            running(
                "v1.20.2",
                [
                    Some("v1.21.0"),
                    Some("v1.20.2"),
                    Some("v1.20.2"),
                    Some("v1.20.2")
                ]
            )
            .version_change(&all[1..], here, no_steps),
            VersionChange::None
        );
    }
}
