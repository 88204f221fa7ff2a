//! The `process` runtime: the rendered pod template of each component runs as supervised
//! local processes.
//!
//! Per replica: secret volumes become directories of files (mode 0600), emptyDir volumes
//! become persistent directories (etcd data survives restarts), `$(VAR)` references in the
//! arguments are expanded from the container's env (with `POD_NAME` and `POD_IP` set as a
//! kubelet would), every mount path in the arguments is rewritten to its local directory, and
//! the container command runs with the binaries for the requested version. Crashed processes
//! restart with exponential backoff; each replica logs to its own file.
//!
//! Each tenant gets its own loopback block `127.a.b.0/24` (replica `i` listens on
//! `127.a.b.(i+1)` with the components' standard ports), chosen once and stored in the
//! tenant's state directory, so addresses never clash between tenants and stay the same across
//! operator restarts.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodTemplateSpec};
use nestplane_api::names::{self, Component};
use nestplane_render::Rendered;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::binaries::{self, MissingBinary};
use crate::child;
use crate::egress::User;

/// Most replicas a component may have (the size of a tenant's address block that is used).
pub const MAX_REPLICAS: u8 = 7;

/// Errors of the process runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A binary for the requested version is missing.
    #[error(transparent)]
    MissingBinary(#[from] MissingBinary),
    /// The rendered template cannot be run as processes.
    #[error("cannot run {component} as a process: {reason}")]
    Unsupported {
        /// Which component.
        component: String,
        /// Why.
        reason: String,
    },
    /// A secret the template mounts was not provided.
    #[error("secret {0} is not available yet")]
    MissingSecret(String),
    /// The tenant was removed; it runs again only after [`ProcessRuntime::revive`].
    #[error("tenant {0} is being deleted")]
    Removed(String),
    /// The host's packet filter refused a tenant's egress rules.
    #[error("confining the tenant's egress: {0}")]
    Egress(#[from] crate::egress::EgressError),
    /// Filesystem trouble.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The IO error.
        source: std::io::Error,
    },
}

impl RuntimeError {
    /// A short stable label (metrics, condition reasons).
    pub fn label(&self) -> &'static str {
        match self {
            RuntimeError::MissingBinary(_) => "MissingBinary",
            RuntimeError::Unsupported { .. } => "Unsupported",
            RuntimeError::MissingSecret(_) => "MissingSecret",
            RuntimeError::Removed(_) => "Removed",
            RuntimeError::Egress(_) => "Egress",
            RuntimeError::Io { .. } => "Io",
        }
    }
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RuntimeError {
    let context = context.into();
    move |source| RuntimeError::Io { context, source }
}

/// Identifies a tenant control plane.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantKey {
    /// Namespace of the `NestedControlPlane`.
    pub namespace: String,
    /// Name of the `NestedControlPlane`.
    pub cluster: String,
}

impl std::fmt::Display for TenantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.cluster)
    }
}

/// The file in a tenant's directory naming the tenant it was made for (see
/// [`ProcessRuntime::remove`]).
pub const TENANT_MARKER: &str = ".nestplane-tenant";

/// Secret contents by secret name, then key.
pub type SecretData = BTreeMap<String, BTreeMap<String, Vec<u8>>>;

struct Replica {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    pid: Arc<Mutex<Option<u32>>>,
    restarts: Arc<Mutex<u32>>,
}

#[derive(Default)]
struct Group {
    /// Hash of the pod template and the program: a change restarts every replica.
    template: String,
    /// Hash of the mounted secrets: a change rewrites the files, and restarts the replicas
    /// of components that read their certificates only at start.
    secrets: String,
    /// Hash of the mounted secrets the component reads only at start even when it reloads
    /// its certificates (the API server's service-account keys): a change restarts it.
    start: String,
    replicas: Vec<Replica>,
}

type GroupKey = (TenantKey, Component);

/// How the runtime checks one replica's health while it rolls replicas one at a time.
#[derive(Clone, Debug, Default)]
pub struct Probe {
    /// One endpoint per replica, in replica order.
    pub endpoints: Vec<nestplane_render::HealthEndpoint>,
    /// The CA that verifies HTTPS endpoints.
    pub ca_pem: Option<String>,
    /// Told when a replica being replaced stops serving and when its replacement serves.
    pub serving: Option<Serving>,
}

/// Called with (replica, serving): `false` just before a running replica is stopped to be
/// replaced, `true` once its replacement answers the probe or the wait for it ended (a
/// router keeps its routes with it, so no new connection goes to a replica that is stopping
/// or still starting).
#[derive(Clone)]
pub struct Serving(pub Arc<dyn Fn(usize, bool) + Send + Sync>);

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Serving(..)")
    }
}

/// How long a rolling restart waits for a restarted replica to become healthy before it
/// goes on to the next one.
pub const ROLL_WAIT: Duration = Duration::from_secs(60);

/// Supervises the processes of every tenant.
pub struct ProcessRuntime {
    state_dir: PathBuf,
    /// One lock per component: a slow stop or a rolling restart of one component never holds
    /// up another (the map itself is locked only to find or remove a group).
    groups: Mutex<HashMap<GroupKey, Arc<tokio::sync::Mutex<Group>>>>,
    hosts_cache: Mutex<HashMap<TenantKey, Vec<Ipv4Addr>>>,
    alloc: Mutex<()>,
    startups: Mutex<HashMap<(TenantKey, Component), Startup>>,
    /// Tenants removed in this process's life: a reconcile already in flight must not bring
    /// their processes or directory back.
    removed: Mutex<std::collections::HashSet<TenantKey>>,
    /// Whether each tenant's processes run as a user of its own ([`crate::egress`]): when the
    /// operator runs as root.
    users: bool,
    /// Tenants whose user had no process left when this operator first ran one of theirs.
    cleaned: Mutex<std::collections::HashSet<TenantKey>>,
}

/// When a component's processes were started, and how long they took to become healthy.
type Startup = (std::time::Instant, Option<Duration>);

impl std::fmt::Debug for ProcessRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessRuntime")
            .field("state_dir", &self.state_dir)
            .finish()
    }
}

/// What happened in [`ProcessRuntime::ensure`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensured {
    /// Already running with this template and these secrets.
    Unchanged,
    /// Processes were started or restarted (one replica at a time when they ran before).
    Started,
    /// Only certificates changed, and the component reloads them from its files: the files
    /// were rewritten and nothing was restarted.
    Reloaded,
}

impl ProcessRuntime {
    /// A runtime keeping tenant state under `state_dir/tenants`.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        ProcessRuntime {
            state_dir: state_dir.into(),
            groups: Default::default(),
            hosts_cache: Default::default(),
            alloc: Mutex::new(()),
            startups: Mutex::new(HashMap::new()),
            removed: Mutex::new(Default::default()),
            users: crate::egress::can_switch_users(),
            cleaned: Mutex::new(Default::default()),
        }
    }

    /// The user a tenant's processes run as, and whose packets are confined: `None` when the
    /// operator is not root (every process then runs as the operator's user, unconfined).
    pub fn user(&self, key: &TenantKey) -> Result<Option<User>, RuntimeError> {
        if !self.users {
            return Ok(None);
        }
        let user = User::for_host(self.hosts(key)?[0]);
        // Before the tenant's first process in this operator's life: nothing of its user may
        // be running (a process an earlier operator's tenant forked, with the same block).
        let _guard = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        let mut cleaned = self.cleaned.lock().unwrap_or_else(|e| e.into_inner());
        if !cleaned.contains(key) {
            crate::egress::kill_user(user).map_err(io(format!(
                "ending what is left of {key}'s user {}",
                user.uid
            )))?;
            cleaned.insert(key.clone());
        }
        Ok(Some(user))
    }

    /// The user a tenant's processes run as, if it has one already: never allocates, never
    /// kills (for those who only need to know, such as its nodes).
    pub fn existing_user(&self, key: &TenantKey) -> Result<Option<User>, RuntimeError> {
        if !self.users {
            return Ok(None);
        }
        if let Some(h) = self
            .hosts_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
        {
            return Ok(Some(User::for_host(h[0])));
        }
        Ok(read_block(&self.tenant_dir(key)?.join("network.json")).map(User::for_block))
    }

    /// Allow a removed tenant to run again (its control plane exists again).
    pub fn revive(&self, key: &TenantKey) {
        self.removed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }

    /// Whether the tenant was removed (and not revived since).
    pub fn is_removed(&self, key: &TenantKey) -> bool {
        self.removed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(key)
    }

    fn check_alive(&self, key: &TenantKey) -> Result<(), RuntimeError> {
        if self.is_removed(key) {
            return Err(RuntimeError::Removed(format!(
                "{}/{}",
                key.namespace, key.cluster
            )));
        }
        Ok(())
    }

    /// The directory of a tenant: `<state>/tenants/<namespace>/<cluster>`, both DNS labels
    /// (so never absolute, never `..`), joined with [`safe_join`]; any other key is refused.
    pub fn tenant_dir(&self, key: &TenantKey) -> Result<PathBuf, RuntimeError> {
        for (what, label) in [("namespace", &key.namespace), ("cluster", &key.cluster)] {
            if let Some(p) = names::dns_label_problem(label, 63) {
                return Err(RuntimeError::Unsupported {
                    component: key.to_string(),
                    reason: format!("the {what} name {p}; it cannot name a directory"),
                });
            }
        }
        safe_join(&self.state_dir.join("tenants"), &key.namespace)
            .and_then(|ns| safe_join(&ns, &key.cluster))
    }

    /// Mark `dir` as the directory of `key`, made by nestplane: [`ProcessRuntime::remove`]
    /// deletes only a directory that carries this marker naming the same tenant.
    fn mark(dir: &Path, key: &TenantKey) -> Result<(), RuntimeError> {
        let marker = dir.join(TENANT_MARKER);
        if std::fs::read_to_string(&marker).ok().as_deref() == Some(&key.to_string()) {
            return Ok(());
        }
        // Only the operator enters a tenant's directory: each process's working directory is
        // entered before it becomes the tenant's user.
        crate::files::mkdir_private(dir).map_err(io(format!("restricting {}", dir.display())))?;
        crate::files::write_private(&marker, key.to_string().as_bytes())
            .map_err(io(format!("writing {}", marker.display())))
    }

    /// The tenant's replica addresses as far as they were allocated already (never allocates).
    pub fn allocated_hosts(&self, key: &TenantKey) -> Option<Vec<Ipv4Addr>> {
        self.hosts_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    /// The tenant's replica addresses as allocated before (the cache, else the block its
    /// directory records, as after a restart); never allocates.
    pub fn stored_hosts(&self, key: &TenantKey) -> Option<Vec<Ipv4Addr>> {
        if let Some(h) = self.allocated_hosts(key) {
            return Some(h);
        }
        let block: [u8; 2] = read_block(&self.tenant_dir(key).ok()?.join("network.json"))?;
        Some(
            (1..=MAX_REPLICAS)
                .map(|i| Ipv4Addr::new(127, block[0], block[1], i))
                .collect(),
        )
    }

    /// The tenant's replica addresses (`127.a.b.1` … `127.a.b.7`), allocated on first use and
    /// stable afterwards.
    pub fn hosts(&self, key: &TenantKey) -> Result<Vec<Ipv4Addr>, RuntimeError> {
        let _guard = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
        self.check_alive(key)?;
        if let Some(h) = self
            .hosts_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
        {
            return Ok(h.clone());
        }
        let dir = self.tenant_dir(key)?;
        let file = dir.join("network.json");
        // Blocks (and so users) are shared by every operator on the machine: reserved under a
        // machine-wide lock.
        let _machine = self.users.then(crate::egress::lock);
        let block = match read_block(&file) {
            Some(b) => b,
            None => {
                let used = self.used_blocks();
                let b = pick_block(&used, |b| reserved_elsewhere(b, &dir)).ok_or_else(|| {
                    RuntimeError::Io {
                        context: "allocating a loopback block".into(),
                        source: std::io::Error::other("no free 127.x.y.0/24 block"),
                    }
                })?;
                std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
                Self::mark(&dir, key)?;
                std::fs::write(&file, serde_json::to_string(&b).unwrap_or_default())
                    .map_err(io(format!("writing {}", file.display())))?;
                b
            }
        };
        // A directory made before markers existed gets one now.
        Self::mark(&dir, key)?;
        if self.users {
            reserve(block, &dir);
        }
        let hosts: Vec<Ipv4Addr> = (1..=MAX_REPLICAS)
            .map(|i| Ipv4Addr::new(127, block[0], block[1], i))
            .collect();
        self.hosts_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), hosts.clone());
        Ok(hosts)
    }

    fn used_blocks(&self) -> Vec<[u8; 2]> {
        let mut used = Vec::new();
        let Ok(namespaces) = std::fs::read_dir(self.state_dir.join("tenants")) else {
            return used;
        };
        for ns in namespaces.flatten() {
            let Ok(clusters) = std::fs::read_dir(ns.path()) else {
                continue;
            };
            for c in clusters.flatten() {
                if let Some(b) = read_block(&c.path().join("network.json")) {
                    used.push(b);
                }
            }
        }
        used
    }

    fn group(&self, gk: &GroupKey) -> Arc<tokio::sync::Mutex<Group>> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(gk.clone())
            .or_default()
            .clone()
    }

    fn take_groups(&self, f: impl Fn(&GroupKey) -> bool) -> Vec<Arc<tokio::sync::Mutex<Group>>> {
        let mut m = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<GroupKey> = m.keys().filter(|k| f(k)).cloned().collect();
        keys.into_iter().filter_map(|k| m.remove(&k)).collect()
    }

    fn existing(&self, gk: &GroupKey) -> Option<Arc<tokio::sync::Mutex<Group>>> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(gk)
            .cloned()
    }

    /// Run `rendered` (for Kubernetes `version`) with `secrets`.
    ///
    /// - First start: every replica at once (an etcd cluster forms only with all members).
    /// - Template changed: replicas are replaced one at a time, each waiting (up to
    ///   [`ROLL_WAIT`]) until the new one answers `probe` before the next stops, so a
    ///   multi-replica component never loses more than one replica (etcd keeps quorum).
    /// - Only secrets changed: the files are rewritten in place; etcd and kube-apiserver
    ///   re-read their certificates from the files (the API server within a minute), so they
    ///   keep running
    ///   ([`Ensured::Reloaded`]), unless a secret they read only at start changed (the API
    ///   server's service-account keys); other components roll as above.
    /// - Replica count changed: missing replicas start, extra ones stop; the others stay.
    pub async fn ensure(
        &self,
        key: &TenantKey,
        rendered: &Rendered,
        version: &str,
        secrets: &SecretData,
        probe: &Probe,
    ) -> Result<Ensured, RuntimeError> {
        let hosts = self.hosts(key)?;
        let component = rendered.component;
        let container = rendered
            .pod_template
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .ok_or_else(|| RuntimeError::Unsupported {
                component: rendered.workload_name.clone(),
                reason: "no container".into(),
            })?
            .clone();
        let program = program_for(&container, version)?;
        let (template, secrets_hash, start_hash) = hashes(rendered, &program, secrets)?;

        let gk = (key.clone(), component);
        let group = self.group(&gk);
        let mut g = group.lock().await;
        // `remove` marks the tenant before it takes the groups.
        self.check_alive(key)?;
        let replicas = rendered.replicas as usize;
        if g.template == template && g.secrets == secrets_hash && g.replicas.len() == replicas {
            return Ok(Ensured::Unchanged);
        }
        if replicas > hosts.len() {
            return Err(RuntimeError::Unsupported {
                component: rendered.workload_name.clone(),
                reason: format!("at most {MAX_REPLICAS} replicas"),
            });
        }
        let specs = self
            .prepare(key, rendered, container, program, secrets, hosts)
            .await?;

        let first_start = g.replicas.is_empty();
        let template_changed = g.template != template;
        let secrets_changed = g.secrets != secrets_hash;
        let reloads = nestplane_render::certificates::reloads_certificates(component)
            && g.start == start_hash;
        let restart_running = template_changed || (secrets_changed && !reloads);
        // Extra replicas go first (from the highest index).
        while g.replicas.len() > replicas {
            if let Some(r) = g.replicas.pop() {
                stop_replica(r).await;
            }
        }
        let mut restarted = false;
        for (i, (spec, pidfile)) in specs.into_iter().enumerate() {
            if i < g.replicas.len() {
                if !restart_running {
                    continue;
                }
                // The old process must be gone before the new one binds its ports.
                let told = probe.serving.as_ref().filter(|_| !first_start);
                if let Some(s) = told {
                    (s.0)(i, false);
                }
                stop_replica(g.replicas.remove(i)).await;
                g.replicas.insert(i, supervise(spec, pidfile));
                restarted = true;
                if !first_start {
                    wait_healthy(probe, i).await;
                    // Back even when it did not answer in time: the component's next pass
                    // routes what answers then.
                    if let Some(s) = told {
                        (s.0)(i, true);
                    }
                }
            } else {
                g.replicas.push(supervise(spec, pidfile));
                restarted = true;
            }
        }
        g.template = template;
        g.secrets = secrets_hash;
        g.start = start_hash;
        if restarted {
            self.startups
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(gk, (std::time::Instant::now(), None));
            Ok(Ensured::Started)
        } else {
            Ok(Ensured::Reloaded)
        }
    }

    /// Directories, secret files and process specs of each replica: filesystem work, off the
    /// async workers.
    async fn prepare(
        &self,
        key: &TenantKey,
        rendered: &Rendered,
        container: k8s_openapi::api::core::v1::Container,
        program: PathBuf,
        secrets: &SecretData,
        hosts: Vec<std::net::Ipv4Addr>,
    ) -> Result<Vec<(crate::child::Spec, PathBuf)>, RuntimeError> {
        let user = self.user(key)?;
        let dir = self.tenant_dir(key)?;
        let workload = rendered.workload_name.clone();
        let template = rendered.pod_template.clone();
        let replicas = rendered.replicas as usize;
        let secrets = secrets.clone();
        tokio::task::spawn_blocking(move || {
            if user.is_some() {
                crate::egress::ensure_chain()?;
            }
            (0..replicas)
                .map(|i| {
                    let pod_name = format!("{workload}-{i}");
                    let rdir = dir.join(&pod_name);
                    let replica = Place {
                        dir: &rdir,
                        pod_name: &pod_name,
                        host: hosts[i],
                        user,
                    };
                    prepare_replica(&replica, &template, &container, &program, &secrets)
                        .map(|spec| (spec, rdir.join("pid")))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| RuntimeError::Io {
            context: "preparing replicas".into(),
            source: std::io::Error::other(e.to_string()),
        })?
    }

    /// Record that every replica of a component answered its health endpoint; the first time
    /// after a (re)start fixes the component's start-up duration.
    pub fn mark_healthy(&self, key: &TenantKey, component: Component) {
        let mut s = self.startups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((started, took @ None)) = s.get_mut(&(key.clone(), component)) {
            *took = Some(started.elapsed());
        }
    }

    /// How long each component took from process start to healthy (the last start).
    pub fn startup_times(&self, key: &TenantKey) -> BTreeMap<Component, Duration> {
        let s = self.startups.lock().unwrap_or_else(|e| e.into_inner());
        s.iter()
            .filter(|((k, _), _)| k == key)
            .filter_map(|((_, c), (_, took))| took.map(|t| (*c, t)))
            .collect()
    }

    /// Process ids of the running replicas of a component (index = replica).
    pub async fn pids(&self, key: &TenantKey, component: Component) -> Vec<Option<u32>> {
        let Some(g) = self.existing(&(key.clone(), component)) else {
            return vec![];
        };
        let g = g.lock().await;
        g.replicas
            .iter()
            .map(|r| *r.pid.lock().unwrap_or_else(|e| e.into_inner()))
            .collect()
    }

    /// How often the replicas of a component were restarted after exiting.
    pub async fn restarts(&self, key: &TenantKey, component: Component) -> u32 {
        let Some(g) = self.existing(&(key.clone(), component)) else {
            return 0;
        };
        let g = g.lock().await;
        g.replicas
            .iter()
            .map(|r| *r.restarts.lock().unwrap_or_else(|e| e.into_inner()))
            .sum()
    }

    /// Whether the component has supervised replicas.
    pub async fn is_running(&self, key: &TenantKey, component: Component) -> bool {
        match self.existing(&(key.clone(), component)) {
            Some(g) => !g.lock().await.replicas.is_empty(),
            None => false,
        }
    }

    /// Stop every process of a tenant and remove its data and address block.
    pub async fn remove(&self, key: &TenantKey) -> Result<(), RuntimeError> {
        {
            let _guard = self.alloc.lock().unwrap_or_else(|e| e.into_inner());
            self.removed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.clone());
            self.hosts_cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(key);
        }
        let groups = self.take_groups(|(k, _)| k == key);
        futures::future::join_all(groups.iter().map(|g| async move {
            stop_group(&mut *g.lock().await).await;
        }))
        .await;
        self.cleaned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        let dir = self.tenant_dir(key)?;
        if self.users
            && let Some(b) = read_block(&dir.join("network.json"))
        {
            // Whatever its processes forked goes too, before anyone else may get its uid.
            let user = User::for_block(b);
            let held = dir.clone();
            let killed = tokio::task::spawn_blocking(move || {
                let killed = crate::egress::kill_user(user);
                if killed.is_ok() {
                    let _machine = crate::egress::lock();
                    release(b, &held);
                }
                killed
            })
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
            killed.map_err(io(format!("ending the processes of {key}'s user")))?;
        }
        let owner = key.to_string();
        let context = format!("removing {}", dir.display());
        tokio::task::spawn_blocking(move || {
            // Only a directory nestplane made for this very tenant is deleted.
            // A directory made before markers existed has the address block's file only.
            let marked = std::fs::read_to_string(dir.join(TENANT_MARKER)).ok();
            let legacy = marked.is_none() && dir.join("network.json").is_file();
            if marked.as_deref() != Some(owner.as_str()) && !legacy {
                if dir.exists() {
                    tracing::warn!(dir = %dir.display(), tenant = %owner, "not removing a directory nestplane did not make for this tenant");
                }
                return Ok(());
            }
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            }
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r)
        .map_err(|source| RuntimeError::Io { context, source })
    }

    /// Stop every process of every tenant (data stays), all components at once, and whatever
    /// they forked.
    pub async fn shutdown(&self) {
        let groups = self.take_groups(|_| true);
        futures::future::join_all(groups.iter().map(|g| async move {
            stop_group(&mut *g.lock().await).await;
        }))
        .await;
        if !self.users {
            return;
        }
        let users: Vec<User> = self
            .hosts_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|h| User::for_host(h[0]))
            .collect();
        tokio::task::spawn_blocking(move || {
            for u in users {
                if let Err(e) = crate::egress::kill_user(u) {
                    tracing::warn!(uid = u.uid, error = %e, "cannot end a tenant user's processes");
                }
            }
        })
        .await
        .ok();
    }
}

/// Where the machine records which tenant directory holds each loopback block: every
/// operator on the machine (each with its own state directory) shares the loopback addresses
/// and the users derived from them.
const BLOCKS_DIR: &str = "/run/nestplane/blocks";

fn reservation(b: [u8; 2]) -> PathBuf {
    Path::new(BLOCKS_DIR).join(format!("{}.{}", b[0], b[1]))
}

/// Whether another tenant directory that still holds block `b` reserved it (a reservation
/// whose directory is gone, or holds another block now, is stale).
fn reserved_elsewhere(b: [u8; 2], dir: &Path) -> bool {
    let Ok(holder) = std::fs::read_to_string(reservation(b)) else {
        return false;
    };
    let holder = Path::new(holder.trim());
    holder != dir && read_block(&holder.join("network.json")) == Some(b)
}

/// Reserve block `b` for `dir` machine-wide (under [`crate::egress::lock`]), unless another
/// live directory holds it (logged: two operators then share addresses and a user).
fn reserve(b: [u8; 2], dir: &Path) {
    if reserved_elsewhere(b, dir) {
        tracing::warn!(block = ?b, dir = %dir.display(), "another operator's tenant holds this loopback block");
        return;
    }
    let path = reservation(b);
    if std::fs::read_to_string(&path).ok().as_deref() == Some(&dir.display().to_string()) {
        return;
    }
    // Best effort: a missing directory shows up as the error of what follows.
    let _ = std::fs::create_dir_all(BLOCKS_DIR);
    if let Err(e) = crate::files::write_private(&path, dir.display().to_string().as_bytes()) {
        tracing::warn!(error = %e, "cannot record the loopback block {b:?}");
    }
}

/// Release `dir`'s reservation of block `b`.
fn release(b: [u8; 2], dir: &Path) {
    let path = reservation(b);
    if std::fs::read_to_string(&path).ok().as_deref() == Some(&dir.display().to_string()) {
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_file(path);
    }
}

fn pick_block(used: &[[u8; 2]], elsewhere: impl Fn([u8; 2]) -> bool) -> Option<[u8; 2]> {
    use rand::RngExt;
    let mut rng = rand::rng();
    for _ in 0..512 {
        let b = [rng.random_range(64..=126u8), rng.random_range(0..=255u8)];
        if used.contains(&b) || elsewhere(b) {
            continue;
        }
        // Another nestplane (another state dir, a test) may use the block: probe its ports.
        let free = [2379u16, 2380, 6443]
            .iter()
            .all(|p| std::net::TcpListener::bind((Ipv4Addr::new(127, b[0], b[1], 1), *p)).is_ok());
        if free {
            return Some(b);
        }
    }
    None
}

/// The binary that runs `component` at Kubernetes `version` (etcd comes from `PATH`, whatever
/// the Kubernetes version).
pub fn binary_for(component: Component, version: &str) -> Result<PathBuf, MissingBinary> {
    match component {
        Component::Etcd => binaries::etcd("etcd"),
        other => binaries::kubernetes(other.binary(), version),
    }
}

fn program_for(container: &Container, version: &str) -> Result<PathBuf, RuntimeError> {
    let cmd = container
        .command
        .as_ref()
        .and_then(|c| c.first())
        .ok_or_else(|| RuntimeError::Unsupported {
            component: container.name.clone(),
            reason: "the container has no command".into(),
        })?;
    // Only nestplane's own binaries run: a command that names a path (a patch's `/bin/sh`)
    // never reaches exec, whatever let it through.
    const PROGRAMS: [&str; 4] = [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ];
    if !PROGRAMS.contains(&cmd.as_str()) {
        return Err(RuntimeError::Unsupported {
            component: container.name.clone(),
            reason: format!("command {cmd:?} is not a Kubernetes or etcd binary name"),
        });
    }
    if cmd == "etcd" {
        Ok(binaries::etcd("etcd")?)
    } else {
        Ok(binaries::kubernetes(cmd, version)?)
    }
}
/// What a component's processes are made from: the hash of its template and program, the
/// hash of the secrets it mounts (a missing one is an error), and the hash of those of them
/// it reads only at start ([`nestplane_render::certificates::read_at_start`]). Pure.
fn hashes(
    rendered: &Rendered,
    program: &Path,
    secrets: &SecretData,
) -> Result<(String, String, String), RuntimeError> {
    let mut th = Sha256::new();
    th.update(nestplane_render::template_hash(rendered));
    th.update(program.display().to_string());
    let template = format!("{:x}", th.finalize());
    let at_start: Vec<&str> = nestplane_render::certificates::read_at_start(rendered.component)
        .iter()
        .map(|p| nestplane_render::secret_volume_name(*p))
        .collect();
    let (mut sh, mut start) = (Sha256::new(), Sha256::new());
    for (volume, name) in mounted_secrets(&rendered.pod_template) {
        let data = secrets
            .get(&name)
            .ok_or_else(|| RuntimeError::MissingSecret(name.clone()))?;
        let read_once = at_start.contains(&volume.as_str());
        sh.update(name.as_bytes());
        if read_once {
            start.update(name.as_bytes());
        }
        for (k, v) in data {
            sh.update(k.as_bytes());
            sh.update(v);
            if read_once {
                start.update(k.as_bytes());
                start.update(v);
            }
        }
    }
    Ok((
        template,
        format!("{:x}", sh.finalize()),
        format!("{:x}", start.finalize()),
    ))
}

/// (volume name, secret name) of each secret volume of `t`.
fn mounted_secrets(t: &PodTemplateSpec) -> Vec<(String, String)> {
    t.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| {
            v.secret
                .as_ref()
                .and_then(|s| s.secret_name.clone())
                .map(|n| (v.name.clone(), n))
        })
        .collect()
}

/// Kubelet-style `$(VAR)` expansion (`$$` escapes; unknown references stay as written).
pub fn expand(s: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(s.len());
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' && i + 1 < b.len() {
            if b[i + 1] == b'$' {
                out.push('$');
                i += 2;
                continue;
            }
            if b[i + 1] == b'('
                && let Some(end) = s[i + 2..].find(')')
                && let Some(v) = env.get(&s[i + 2..i + 2 + end])
            {
                out.push_str(v);
                i += 3 + end;
                continue;
            }
        }
        let ch = s[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// Replace every mount path (at a path boundary) in `arg` with its local directory.
pub fn rewrite_paths(arg: &str, mounts: &[(String, PathBuf)]) -> String {
    let mut out = arg.to_string();
    for (mount, local) in mounts {
        let mut result = String::new();
        let mut rest = out.as_str();
        while let Some(pos) = rest.find(mount.as_str()) {
            let after = &rest[pos + mount.len()..];
            let boundary_before =
                pos == 0 || matches!(rest.as_bytes()[pos - 1], b'=' | b',' | b':' | b' ');
            let boundary_after =
                after.is_empty() || after.starts_with('/') || after.starts_with(',');
            result.push_str(&rest[..pos]);
            if boundary_before && boundary_after {
                result.push_str(&local.display().to_string());
            } else {
                result.push_str(mount);
            }
            rest = after;
        }
        result.push_str(rest);
        out = result;
    }
    out
}

/// `base/rel`, refused when `rel` is absolute, empty, or has a `..` (or `.`) component: a
/// volume name, key or subPath can never lead out of the tenant's directory.
pub fn safe_join(base: &Path, rel: &str) -> Result<PathBuf, RuntimeError> {
    use std::path::Component as C;
    let p = Path::new(rel);
    let ok = !rel.is_empty()
        && !rel.contains('\0')
        && p.components().all(|c| matches!(c, C::Normal(_)))
        && !rel.split('/').any(|s| s == "." || s == "..");
    if !ok {
        return Err(RuntimeError::Unsupported {
            component: base.display().to_string(),
            reason: format!("path {rel:?} would leave its volume"),
        });
    }
    Ok(base.join(p))
}

/// Where and as whom one replica runs.
struct Place<'a> {
    /// The replica's directory (its working directory).
    dir: &'a Path,
    pod_name: &'a str,
    host: Ipv4Addr,
    user: Option<User>,
}

/// The loopback block stored in a tenant's `network.json`.
fn read_block(file: &Path) -> Option<[u8; 2]> {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|s| serde_json::from_str::<[u8; 2]>(&s).ok())
}

/// Lay out one replica's directory and say how to run it.
///
/// With a tenant user: the replica's directory, `volumes/` and each secret volume belong to the
/// operator and are only readable by the user's group (the user cannot put a symbolic link
/// where the operator writes); key files are the user's, 0600; emptyDir and data volumes are
/// the user's. Paths in the arguments go through the working directory, the replica's
/// (`/proc/self/cwd/volumes/…`).
fn prepare_replica(
    place: &Place<'_>,
    template: &PodTemplateSpec,
    container: &Container,
    program: &Path,
    secrets: &SecretData,
) -> Result<child::Spec, RuntimeError> {
    let (dir, user) = (place.dir, place.user);
    let readable = |d: &Path| {
        crate::files::mkdir_readable_by(d, user).map_err(io(format!("creating {}", d.display())))
    };
    let owned = |d: &Path| {
        crate::files::mkdir_owned_by(d, user).map_err(io(format!("creating {}", d.display())))
    };
    let write = |path: &Path, data: &[u8]| {
        crate::files::write_private_as(path, data, user)
            .map_err(io(format!("writing {}", path.display())))
    };
    readable(dir)?;
    let volumes_dir = dir.join("volumes");
    readable(&volumes_dir)?;
    let mut local_volumes: BTreeMap<String, PathBuf> = BTreeMap::new();
    for v in template
        .spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
    {
        let vdir = safe_join(&volumes_dir, &v.name)?;
        if v.secret.is_some() {
            readable(&vdir)?;
        } else {
            owned(&vdir)?;
        }
        if let Some(sv) = &v.secret {
            let name = sv.secret_name.clone().unwrap_or_default();
            let data = secrets
                .get(&name)
                .ok_or_else(|| RuntimeError::MissingSecret(name.clone()))?;
            match &sv.items {
                Some(items) if !items.is_empty() => {
                    for item in items {
                        let value = data.get(&item.key).ok_or_else(|| {
                            RuntimeError::MissingSecret(format!("{name} (key {})", item.key))
                        })?;
                        write(&safe_join(&vdir, &item.path)?, value)?;
                    }
                }
                _ => {
                    for (k, value) in data {
                        write(&safe_join(&vdir, k)?, value)?;
                    }
                }
            }
        } else if v.empty_dir.is_none() && v.persistent_volume_claim.is_none() {
            return Err(RuntimeError::Unsupported {
                component: container.name.clone(),
                reason: format!("volume {} is neither a secret nor an emptyDir", v.name),
            });
        }
        local_volumes.insert(v.name.clone(), vdir);
    }
    let mut mounts: Vec<(String, PathBuf)> = Vec::new();
    for m in container.volume_mounts.iter().flatten() {
        let local = match local_volumes.get(&m.name) {
            Some(d) => d.clone(),
            // A volumeClaimTemplate volume (e.g. etcd `data`): a persistent local directory.
            None => {
                let d = safe_join(&volumes_dir, &m.name)?;
                owned(&d)?;
                d
            }
        };
        let local = match &m.sub_path {
            Some(sp) if !sp.is_empty() => safe_join(&local, sp)?,
            _ => local,
        };
        // Through the working directory: a tenant user cannot walk the path above it. An
        // absolute path through `/proc/self/cwd` rather than a relative one, since some
        // programs make their paths absolute before they open them (etcd 3.5 its data
        // directory), which would walk it.
        let local = match local.strip_prefix(dir) {
            Ok(rel) => Path::new("/proc/self/cwd").join(rel),
            Err(_) => local,
        };
        mounts.push((m.mount_path.trim_end_matches('/').to_string(), local));
    }
    mounts.sort_by_key(|m| std::cmp::Reverse(m.0.len()));

    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let pod_name = place.pod_name;
    env.insert("POD_NAME".into(), pod_name.to_string());
    env.insert("POD_IP".into(), place.host.to_string());
    env.insert("POD_NAMESPACE".into(), String::new());
    for e in container.env.iter().flatten() {
        if let Some(v) = &e.value {
            let expanded = expand(v, &env);
            env.insert(e.name.clone(), expanded);
        }
    }
    let args: Vec<String> = container
        .command
        .iter()
        .flatten()
        .skip(1)
        .chain(container.args.iter().flatten())
        .map(|a| rewrite_paths(&expand(a, &env), &mounts))
        .collect();
    // kube-apiserver stops listening at once on SIGTERM, then waits for its requests to end,
    // watches included, which do not by themselves: a replica being replaced would hold its
    // place for the whole grace. Its short requests end within a second or two; a delay
    // asked for (a patch) comes first, the server serving through it.
    let stop_grace = (container.name == "kube-apiserver")
        .then(|| API_SERVER_STOP_GRACE + shutdown_delay(&args).unwrap_or_default());
    Ok(child::Spec {
        name: pod_name.to_string(),
        program: program.to_path_buf(),
        args,
        env,
        log: dir.join(format!("{pod_name}.log")),
        cwd: Some(dir.to_path_buf()),
        user,
        stop_grace,
    })
}

/// How long a stopping kube-apiserver may finish its requests before it is killed.
pub const API_SERVER_STOP_GRACE: Duration = Duration::from_secs(2);

/// kube-apiserver's `--shutdown-delay-duration` among `args` (a Go duration of whole `s`,
/// `m` or `h`; `None` when absent or not one of those). Pure.
fn shutdown_delay(args: &[String]) -> Option<Duration> {
    let v = args
        .iter()
        .find_map(|a| a.strip_prefix("--shutdown-delay-duration="))?;
    let (n, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "s" => n,
        "m" => n.checked_mul(60)?,
        "h" => n.checked_mul(3600)?,
        _ => return None,
    };
    Some(Duration::from_secs(secs.min(600)))
}

#[cfg(test)]
mod shutdown_delay_tests {
    use super::*;

    #[test]
    fn an_api_servers_shutdown_delay_lengthens_its_grace() {
        let a = |s: &str| vec!["--etcd-servers=x".to_string(), s.to_string()];
        assert_eq!(
            shutdown_delay(&a("--shutdown-delay-duration=5s")),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            shutdown_delay(&a("--shutdown-delay-duration=2m")),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            shutdown_delay(&a("--shutdown-delay-duration=1h")),
            Some(Duration::from_secs(600))
        );
        assert_eq!(shutdown_delay(&a("--shutdown-delay-duration=1.5s")), None);
        assert_eq!(shutdown_delay(&a("--v=2")), None);
    }
}

/// Whether process `pid` runs in directory `dir` (a replica's process left over from an
/// operator that was killed).
fn pid_runs_in(pid: u32, dir: &Path) -> bool {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd == dir)
}

fn supervise(spec: child::Spec, pidfile: PathBuf) -> Replica {
    let (stop, mut stopped) = watch::channel(false);
    let pid = Arc::new(Mutex::new(None));
    let restarts = Arc::new(Mutex::new(0));
    let (pid2, restarts2) = (pid.clone(), restarts.clone());
    let grace = spec.stop_grace.unwrap_or(Duration::from_secs(5));
    let task = tokio::spawn(async move {
        // A process left over from an operator that was killed: end it before starting ours.
        if let Some(old) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            && spec.cwd.as_deref().is_some_and(|d| pid_runs_in(old, d))
        {
            child::kill_pid(old);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut backoff = Duration::from_millis(500);
        loop {
            if *stopped.borrow() {
                return;
            }
            let started = tokio::time::Instant::now();
            let (mut cmd, _exe) = match child::command(&spec) {
                Ok((c, exe)) => (tokio::process::Command::from(c), exe),
                Err(e) => {
                    tracing::warn!(process = %spec.name, error = %e, "cannot prepare process");
                    if sleep_or_stop(&mut stopped, backoff).await {
                        return;
                    }
                    continue;
                }
            };
            cmd.kill_on_drop(true);
            match cmd.spawn() {
                Ok(mut proc) => {
                    let id = proc.id();
                    *pid2.lock().unwrap_or_else(|e| e.into_inner()) = id;
                    if let Some(id) = id {
                        // Best effort: the process may be gone already.
                        let _ = std::fs::write(&pidfile, id.to_string());
                    }
                    tokio::select! {
                        status = proc.wait() => {
                            *pid2.lock().unwrap_or_else(|e| e.into_inner()) = None;
                            tracing::warn!(process = %spec.name, status = ?status.ok(), log = %spec.log.display(), "process exited; restarting");
                            *restarts2.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                        }
                        _ = stopped.changed() => {
                            if let Some(id) = id {
                                child::terminate(id);
                            }
                            if tokio::time::timeout(grace, proc.wait()).await.is_err() {
                                // Best effort: what cannot be removed now is left for the next cleanup.
                                let _ = proc.kill().await;
                            }
                            *pid2.lock().unwrap_or_else(|e| e.into_inner()) = None;
                            // Best effort: what cannot be removed now is left for the next cleanup.
                            let _ = std::fs::remove_file(&pidfile);
                            return;
                        }
                    }
                }
                Err(e) => tracing::warn!(process = %spec.name, error = %e, "cannot start process"),
            }
            if started.elapsed() > Duration::from_secs(60) {
                backoff = Duration::from_millis(500);
            }
            if sleep_or_stop(&mut stopped, backoff).await {
                return;
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    });
    Replica {
        stop,
        task,
        pid,
        restarts,
    }
}

/// Sleep for `d`; true when a stop was requested meanwhile.
async fn sleep_or_stop(stopped: &mut watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => *stopped.borrow(),
        _ = stopped.changed() => true,
    }
}

async fn stop_group(g: &mut Group) {
    for r in &g.replicas {
        // Best effort: a supervisor that already ended has nothing to stop.
        let _ = r.stop.send(true);
    }
    for r in g.replicas.drain(..) {
        // Best effort: a supervisor that already ended has nothing to stop.
        let _ = r.task.await;
    }
    g.template.clear();
    g.secrets.clear();
}

async fn stop_replica(r: Replica) {
    // Best effort: a supervisor that already ended has nothing to stop.
    let _ = r.stop.send(true);
    // Best effort: a supervisor that already ended has nothing to stop.
    let _ = r.task.await;
}

/// Wait until replica `i` answers its health endpoint (at most [`ROLL_WAIT`]).
/// Wait until replica `i` answers its probe (up to [`ROLL_WAIT`]); whether it did.
async fn wait_healthy(probe: &Probe, i: usize) -> bool {
    let Some(ep) = probe.endpoints.get(i) else {
        return true;
    };
    let deadline = tokio::time::Instant::now() + ROLL_WAIT;
    while tokio::time::Instant::now() < deadline {
        if healthy_count(std::slice::from_ref(ep), probe.ca_pem.as_deref()).await == 1 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tracing::warn!(endpoint = %ep.url, "replica not healthy after {ROLL_WAIT:?}; rolling on");
    false
}

/// A probe client: HTTP/1 on hyper with rustls, the stack kube's own client is built on.
type ProbeClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Empty<bytes::Bytes>,
>;

/// Probe clients, one per CA (the TLS configuration and its roots built once, not per
/// probe). At most [`PROBE_CLIENTS`] are kept: past that (CAs of deleted tenants, rotations),
/// the set starts over.
static CLIENTS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<Option<String>, ProbeClient>>,
> = std::sync::LazyLock::new(Default::default);
const PROBE_CLIENTS: usize = 1024;
/// How long one probe may take, answer read included.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of an answer a probe reads (`ok`, or etcd's `{"health":"true"}`).
const PROBE_BODY_LIMIT: usize = 64 * 1024;

/// The probe client that trusts `ca_pem` (none, or no certificate in it: no roots, for plain
/// HTTP endpoints).
fn probe_client(ca_pem: Option<&str>) -> Option<ProbeClient> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let key = ca_pem.map(str::to_string);
    let mut clients = CLIENTS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = clients.get(&key) {
        return Some(c.clone());
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in ca_pem
        .into_iter()
        .flat_map(|p| CertificateDer::pem_slice_iter(p.as_bytes()))
        .flatten()
    {
        roots.add(cert).ok()?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .ok()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    // Every probe opens its own connection, as a kubelet's does: a kept-alive one to a process
    // that was just replaced would fail a probe the new process passes.
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(https);
    if clients.len() >= PROBE_CLIENTS {
        clients.clear();
    }
    clients.insert(key, client.clone());
    Some(client)
}

/// Whether `url` answers a GET with a success status and a body that is not etcd's
/// `{"health":"false"}`, within [`PROBE_TIMEOUT`].
async fn probe(client: &ProbeClient, url: &str) -> bool {
    use http_body_util::BodyExt;
    let Ok(uri) = url.parse::<hyper::Uri>() else {
        return false;
    };
    let answer = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = http_body_util::Limited::new(resp.into_body(), PROBE_BODY_LIMIT)
            .collect()
            .await
            .ok()?
            .to_bytes();
        // etcd answers {"health":"true"}; Kubernetes components answer "ok".
        Some(!String::from_utf8_lossy(&body).contains("\"health\":\"false\""))
    };
    tokio::time::timeout(PROBE_TIMEOUT, answer)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Check the health endpoints of a component; returns how many answered healthy.
/// `ca_pem` verifies HTTPS endpoints.
pub async fn healthy_count(
    endpoints: &[nestplane_render::HealthEndpoint],
    ca_pem: Option<&str>,
) -> usize {
    healthy_replicas(endpoints, ca_pem)
        .await
        .into_iter()
        .filter(|ok| *ok)
        .count()
}

/// Whether each endpoint answers, in the endpoints' order.
pub async fn healthy_replicas(
    endpoints: &[nestplane_render::HealthEndpoint],
    ca_pem: Option<&str>,
) -> Vec<bool> {
    let Some(client) = probe_client(ca_pem) else {
        return vec![false; endpoints.len()];
    };
    // Every replica is probed at once: a component's check takes one timeout at most, not one
    // per replica.
    let mut checks = tokio::task::JoinSet::new();
    for (i, e) in endpoints.iter().enumerate() {
        let client = client.clone();
        let url = e.url.clone();
        checks.spawn(async move { (i, probe(&client, &url).await) });
    }
    let mut answers = vec![false; endpoints.len()];
    for (i, ok) in checks.join_all().await {
        answers[i] = ok;
    }
    answers
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_api_server_restarts_for_new_service_account_keys_and_reloads_other_certificates() {
        use nestplane_api::names::SecretPurpose;
        use nestplane_render::{KubeVersion, Network, RenderInput};
        let input = RenderInput::new(
            "demo",
            "default",
            KubeVersion::new(1, 20, 2),
            Network::Loopback {
                hosts: vec![Ipv4Addr::new(127, 64, 3, 1)],
            },
        );
        let program = Path::new("/bin/kube-apiserver");
        let data = |sa: &str, serving: &str| -> SecretData {
            let r = nestplane_render::render(Component::ApiServer, &input).unwrap();
            r.secrets
                .iter()
                .map(|p| {
                    let v = match p {
                        SecretPurpose::ServiceAccount => sa,
                        SecretPurpose::ApiServer => serving,
                        _ => "same",
                    };
                    (
                        p.secret_name("demo"),
                        BTreeMap::from([("tls.crt".to_string(), v.as_bytes().to_vec())]),
                    )
                })
                .collect()
        };
        let api = nestplane_render::render(Component::ApiServer, &input).unwrap();
        let (t, s, start) = hashes(&api, program, &data("k1", "c1")).unwrap();
        // A renewed serving certificate: the secrets changed, what is read at start did not.
        let (t2, s2, start2) = hashes(&api, program, &data("k1", "c2")).unwrap();
        assert_eq!((t.clone(), start.clone()), (t2, start2));
        assert_ne!(s, s2);
        // A new service-account key: read only at start.
        let (_, s3, start3) = hashes(&api, program, &data("k2", "c1")).unwrap();
        assert_ne!(s, s3);
        assert_ne!(start, start3);
        // etcd reads nothing only at start.
        let etcd = nestplane_render::render(Component::Etcd, &input).unwrap();
        let etcd_data: SecretData = etcd
            .secrets
            .iter()
            .map(|p| (p.secret_name("demo"), BTreeMap::new()))
            .collect();
        let (_, _, none) = hashes(&etcd, program, &etcd_data).unwrap();
        assert_eq!(none, format!("{:x}", Sha256::new().finalize()));
    }

    /// A server on loopback that answers every request with `body` (over TLS with `tls`).
    async fn serve(tls: Option<nestplane_pki::CertKey>, body: &'static str) -> String {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tls.as_ref().map(|ck| {
            let certs = vec![CertificateDer::from_pem_slice(ck.cert_pem.as_bytes()).unwrap()];
            let key = PrivateKeyDer::from_pem_slice(ck.key_pem.as_bytes()).unwrap();
            let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
            tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
        });
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let mut buf = [0u8; 1024];
                    match acceptor {
                        Some(a) => {
                            let Ok(mut s) = a.accept(tcp).await else {
                                return;
                            };
                            let _ = s.read(&mut buf).await;
                            let _ = s.write_all(answer.as_bytes()).await;
                            let _ = s.shutdown().await;
                        }
                        None => {
                            let mut s = tcp;
                            let _ = s.read(&mut buf).await;
                            let _ = s.write_all(answer.as_bytes()).await;
                        }
                    }
                });
            }
        });
        let scheme = if tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{addr}/healthz")
    }

    fn endpoint(url: &str) -> nestplane_render::HealthEndpoint {
        nestplane_render::HealthEndpoint {
            url: url.to_string(),
            scheme_https: url.starts_with("https"),
        }
    }

    /// A probe believes an HTTPS endpoint only when the tenant's CA signed its certificate,
    /// and an etcd that says it is unhealthy is not counted.
    #[tokio::test]
    async fn probes_verify_the_tenant_ca_and_read_the_answer() {
        let now = time::OffsetDateTime::now_utc();
        let ca = nestplane_pki::generate_ca("tenant-ca", now).unwrap();
        let other = nestplane_pki::generate_ca("other-ca", now).unwrap();
        let spec = nestplane_pki::LeafSpec {
            common_name: "kube-apiserver".into(),
            ips: vec!["127.0.0.1".parse().unwrap()],
            usage: nestplane_pki::Usage::Server,
            ..Default::default()
        };
        let serving = nestplane_pki::issue(&ca, &spec, now).unwrap();
        let https = endpoint(&serve(Some(serving), "ok").await);
        assert_eq!(
            healthy_count(std::slice::from_ref(&https), Some(&ca.cert_pem)).await,
            1
        );
        assert_eq!(
            healthy_count(std::slice::from_ref(&https), Some(&other.cert_pem)).await,
            0
        );
        assert_eq!(healthy_count(&[https], None).await, 0);

        let sick = endpoint(&serve(None, "{\"health\":\"false\"}").await);
        let well = endpoint(&serve(None, "{\"health\":\"true\"}").await);
        assert_eq!(healthy_count(&[sick, well], None).await, 1);
        // Nothing listens there.
        let closed = endpoint("http://127.0.0.1:1/healthz");
        assert_eq!(healthy_count(&[closed], None).await, 0);
    }

    #[test]
    fn expands_like_the_kubelet() {
        let env: BTreeMap<String, String> = [
            ("POD_IP".to_string(), "127.64.1.1".to_string()),
            ("POD_NAME".to_string(), "c-etcd-0".to_string()),
        ]
        .into();
        assert_eq!(
            expand("--listen=https://$(POD_IP):2379", &env),
            "--listen=https://127.64.1.1:2379"
        );
        assert_eq!(expand("--name=$(POD_NAME)", &env), "--name=c-etcd-0");
        assert_eq!(expand("$$(POD_IP)", &env), "$(POD_IP)");
        assert_eq!(expand("$(UNKNOWN)-x", &env), "$(UNKNOWN)-x");
    }

    #[test]
    fn rewrites_mount_paths_at_boundaries_only() {
        let mounts = vec![
            (
                "/etc/nestplane/etcd-ca".to_string(),
                PathBuf::from("/s/v/etcd-ca"),
            ),
            (
                "/etc/nestplane/etcd".to_string(),
                PathBuf::from("/s/v/etcd"),
            ),
        ];
        let mut sorted = mounts.clone();
        sorted.sort_by_key(|m| std::cmp::Reverse(m.0.len()));
        assert_eq!(
            rewrite_paths("--cert=/etc/nestplane/etcd/tls.crt", &sorted),
            "--cert=/s/v/etcd/tls.crt"
        );
        assert_eq!(
            rewrite_paths("--ca=/etc/nestplane/etcd-ca/tls.crt", &sorted),
            "--ca=/s/v/etcd-ca/tls.crt"
        );
        assert_eq!(
            rewrite_paths("--other=/etc/nestplane/etcdx/a", &sorted),
            "--other=/etc/nestplane/etcdx/a"
        );
    }

    #[test]
    fn joins_never_leave_the_base() {
        let base = Path::new("/state/tenants/ns/c/volumes");
        assert_eq!(safe_join(base, "etcd-ca").unwrap(), base.join("etcd-ca"));
        assert_eq!(safe_join(base, "a/b").unwrap(), base.join("a/b"));
        for bad in ["", "/etc", "../x", "a/../../x", ".", "./x", "a/.."] {
            assert!(safe_join(base, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_binary_names_are_executed() {
        let c = |cmd: &str| Container {
            name: "x".into(),
            command: Some(vec![cmd.into(), "-c".into()]),
            ..Default::default()
        };
        for bad in ["/bin/sh", "./sh", "../bin/sh", "bin/sh", "sh", "python3"] {
            assert!(
                matches!(
                    program_for(&c(bad), "1.20.2"),
                    Err(RuntimeError::Unsupported { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_block_another_live_tenant_reserved_is_never_picked_and_a_stale_one_is() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let block = [126u8, 251u8];
        std::fs::write(a.path().join("network.json"), "[126,251]").unwrap();
        reserve(block, a.path());
        assert!(
            reserved_elsewhere(block, b.path()),
            "another operator's tenant holds it"
        );
        assert!(!reserved_elsewhere(block, a.path()), "its own");
        assert_eq!(
            pick_block(&[], |x| x != block || reserved_elsewhere(x, b.path())).map(|_| ()),
            None,
            "only that block was left, and it is taken"
        );
        std::fs::remove_file(a.path().join("network.json")).unwrap();
        assert!(
            !reserved_elsewhere(block, b.path()),
            "stale once its holder let it go"
        );
        reserve(block, b.path());
        release(block, a.path());
        assert!(reservation(block).exists(), "only its holder releases it");
        release(block, b.path());
        assert!(!reservation(block).exists());
    }

    #[test]
    fn blocks_are_never_reused() {
        let used = vec![[64, 0], [64, 1]];
        let b = pick_block(&used, |_| false).unwrap();
        assert!(!used.contains(&b));
        assert!((64..=126).contains(&b[0]));
    }

    #[tokio::test]
    async fn a_removed_tenant_stays_removed_until_revived() {
        let dir = tempfile::tempdir().unwrap();
        let rt = ProcessRuntime::new(dir.path());
        let key = TenantKey {
            namespace: "ns".into(),
            cluster: "c".into(),
        };
        let first = rt.hosts(&key).unwrap();
        let tenant_dir = rt.tenant_dir(&key).unwrap();
        assert!(tenant_dir.join("network.json").exists());
        rt.remove(&key).await.unwrap();
        assert!(!tenant_dir.exists());
        // A reconcile that was in flight cannot bring the directory back.
        assert!(matches!(rt.hosts(&key), Err(RuntimeError::Removed(_))));
        assert!(!tenant_dir.exists());
        rt.revive(&key);
        assert_eq!(rt.hosts(&key).unwrap().len(), first.len());
    }

    #[tokio::test]
    async fn only_a_directory_made_for_the_tenant_is_ever_removed() {
        let dir = tempfile::tempdir().unwrap();
        let rt = ProcessRuntime::new(dir.path());
        let outside = dir.path().join("scratch");
        std::fs::create_dir_all(outside.join("keep")).unwrap();
        // Names that are no DNS labels never become paths.
        for cluster in [
            outside.display().to_string(),
            "..".into(),
            "a/b".into(),
            "".into(),
        ] {
            let key = TenantKey {
                namespace: "ns".into(),
                cluster,
            };
            assert!(rt.tenant_dir(&key).is_err(), "{key}");
            assert!(rt.hosts(&key).is_err(), "{key}");
            assert!(rt.remove(&key).await.is_err(), "{key}");
        }
        assert!(outside.join("keep").exists());
        // A directory at a tenant's place that nestplane did not make (no marker, or one
        // naming another tenant) is left alone.
        let key = TenantKey {
            namespace: "ns".into(),
            cluster: "c".into(),
        };
        let tenant_dir = rt.tenant_dir(&key).unwrap();
        std::fs::create_dir_all(tenant_dir.join("data")).unwrap();
        rt.remove(&key).await.unwrap();
        assert!(tenant_dir.join("data").exists());
        std::fs::write(tenant_dir.join(TENANT_MARKER), "ns/other").unwrap();
        rt.remove(&key).await.unwrap();
        assert!(tenant_dir.join("data").exists());
        // Its own, marked when first used, goes.
        rt.revive(&key);
        rt.hosts(&key).unwrap();
        assert_eq!(
            std::fs::read_to_string(tenant_dir.join(TENANT_MARKER)).unwrap(),
            "ns/c"
        );
        rt.remove(&key).await.unwrap();
        assert!(!tenant_dir.exists());
    }
}
