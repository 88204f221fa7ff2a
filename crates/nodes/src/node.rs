//! A node: containerd, kubelet and kube-proxy as supervised processes in the node's own
//! network and mount namespaces, joined to a cluster by bootstrap token.
//!
//! Start: claim a slot ([`crate::net::claim`]), make the network ([`crate::net::setup`]), start
//! a mount-namespace holder (its `/var/log`, `/run/netns`, `/run/containerd` and
//! `/var/lib/cni` are the node's own directories), containerd, open the node-local API proxy,
//! start the kubelet, import the images while it starts, then write the pod network's
//! configuration (the node cannot be Ready before it, so nothing is scheduled there before its
//! images are), and start kube-proxy once the kubelet has its client certificate. A process
//! that exits is restarted.
//!
//! Remove: stop the processes, kill what runs in the node's cgroups and its containerd shims,
//! drop the namespaces, delete the cgroups and the directory, release the slot.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nestplane_runtime::binaries;
use nestplane_runtime::child::{self, Child, Spec};
use tokio::task::JoinHandle;

use crate::Error;
use crate::config::{self, Addresses, ClusterSettings, Layout, NODE_LOCAL_APISERVER, NodeSpec};
use crate::net::{self, Slot};

/// How to make a node.
#[derive(Clone)]
pub struct NodeConfig {
    /// The Node's name in its cluster.
    pub name: String,
    /// The node's directory (created; removed with the node).
    pub dir: PathBuf,
    /// The cluster's CA certificate (PEM).
    pub ca_pem: String,
    /// A bootstrap token `<id>.<secret>` ([`crate::join`]).
    pub token: String,
    /// Where the cluster's API servers are, as the host reaches them.
    pub apiservers: Vec<SocketAddr>,
    /// The port API clients on the node use at the node-local address (the port the
    /// cluster's `kubernetes` Service endpoints name).
    pub api_port: u16,
    /// OCI archives to import into the node's containerd.
    pub images: Vec<PathBuf>,
    /// The pause image (already among `images`).
    pub pause_image: String,
    /// What the node is (version, labels, taints, kubelet settings, pod security level).
    pub spec: NodeSpec,
    /// DNS settings.
    pub cluster: ClusterSettings,
    /// The isolation group: nodes of a group reach each other and no other node
    /// ([`crate::net::isolate`]); `None` for a node on its own terms (no rules).
    pub group: Option<u32>,
    /// The uid of the cluster's control-plane processes on this machine: only that user's
    /// packets (of all tenant users) reach the node ([`nestplane_runtime::egress`]).
    pub control_plane_user: Option<u32>,
    /// The container policy enforced below the tenant at `spec.pod_security`
    /// ([`crate::guard`]); `None` runs runc directly (a node only nestplane itself uses).
    pub guard: Option<crate::guard::Setup>,
    /// The control plane's tunnel port, as the host reaches it, and the name its certificate
    /// is checked for: the node then runs an agent that dials out to it and carries the API
    /// server's traffic into the cluster ([`crate::tunnel`]); `None` where the control plane
    /// connects from this machine itself.
    pub tunnel: Option<(SocketAddr, String)>,
    /// The server name of the control plane's door for nodes ([`crate::entry`]) behind
    /// `apiservers` (a gateway): the node-local proxy wraps each API connection in TLS to it,
    /// checked against `ca_pem`. `None`: `apiservers` are the API servers themselves.
    pub entry: Option<String>,
    /// The node's slot (its addresses, [`Addresses::of`]) when its cluster assigned one (a
    /// machine that joins); `None`: the first free one on this machine.
    pub slot: Option<u8>,
}

impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .field("apiservers", &self.apiservers)
            .finish_non_exhaustive()
    }
}

/// What a node trusts and presents ([`Node::trust`]), each if it has one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trust {
    /// Its cluster CA bundle (`ca.crt`): what its kubelet and kube-proxy verify the API
    /// server with, and what the kubelet verifies the API server's client certificate with.
    pub ca: Option<String>,
    /// Its kubelet's client certificate and key (PEM).
    pub client: Option<String>,
    /// Its kubelet's serving certificate and key, when the cluster issued it (PEM).
    pub serving: Option<String>,
}

struct Procs {
    holder: Option<Child>,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    kube_proxy: Option<Child>,
    stopping: bool,
}

/// A running node. [`Node::remove`] removes it; dropping it without removing stops its
/// processes (the parent-death signal) but leaves its namespaces for the next claim of its
/// slot to clean.
pub struct Node {
    name: String,
    addrs: Addresses,
    layout: Layout,
    slot: Option<Slot>,
    procs: Arc<Mutex<Procs>>,
    tasks: Vec<JoinHandle<()>>,
    started: Instant,
    timeline: Vec<(&'static str, Duration)>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("name", &self.name)
            .field("slot", &self.addrs.slot)
            .finish()
    }
}

fn mkdir(p: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(p).map_err(|e| Error::io(format!("creating {}", p.display()), e))
}

fn write(p: &Path, contents: &str) -> Result<(), Error> {
    nestplane_runtime::files::write_private(p, contents.as_bytes())
        .map_err(|e| Error::io(format!("writing {}", p.display()), e))
}

/// The node guard's policy at `level` and the wrapper containerd runs instead of runc;
/// returns the wrapper.
fn write_guard(
    layout: &Layout,
    g: &crate::guard::Setup,
    level: crate::guard::Level,
) -> Result<PathBuf, Error> {
    mkdir(&layout.kubelet_pods())?;
    let policy = crate::guard::Policy {
        level,
        kubelet_pods: layout.kubelet_pods(),
        sandbox_dirs: layout.sandbox_dirs(),
        runc: nestplane_runtime::binaries::on_path("runc")
            .map_err(|e| Error::io("finding runc", std::io::Error::other(e.to_string())))?,
    };
    write(
        &layout.guard_policy(),
        &serde_json::to_string(&policy).unwrap_or_default(),
    )?;
    let wrapper = layout.guard_wrapper();
    write(
        &wrapper,
        &crate::guard::wrapper_script(&g.nestplane, &layout.guard_policy()),
    )?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| Error::io(format!("making {} executable", wrapper.display()), e))?;
    Ok(wrapper)
}

/// The cgroup hierarchies of this machine (cgroup v1: one directory per controller; v2: the
/// one unified tree).
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base.to_path_buf()];
    }
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(base) {
        for e in rd.flatten() {
            let p = e.path();
            // Skip the comma-joined aliases (`cpu,cpuacct` links).
            if p.is_dir() && !e.file_type().map(|t| t.is_symlink()).unwrap_or(true) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

impl Node {
    /// Make and start a node. It registers with its cluster by itself; wait for its Node to be
    /// `Ready` with the cluster's client.
    pub async fn start(cfg: NodeConfig) -> Result<Node, Error> {
        let started = Instant::now();
        let kubelet_bin = binaries::kubernetes("kubelet", &cfg.spec.version)?;
        let proxy_bin = binaries::kubernetes("kube-proxy", &cfg.spec.version)?;
        mkdir(&cfg.dir)?;
        let dir = std::fs::canonicalize(&cfg.dir)
            .map_err(|e| Error::io(format!("resolving {}", cfg.dir.display()), e))?;
        let layout = Layout { dir: dir.clone() };
        let slot = match cfg.slot {
            Some(n) => net::claim_exactly(&dir, n, clean_stale)?,
            None => net::claim(&dir, clean_stale)?,
        };
        let addrs = Addresses::of(slot.number);
        let mut node = Node {
            name: cfg.name.clone(),
            addrs: addrs.clone(),
            layout: layout.clone(),
            slot: Some(slot),
            procs: Arc::new(Mutex::new(Procs {
                holder: None,
                containerd: None,
                kubelet: None,
                kube_proxy: None,
                stopping: false,
            })),
            tasks: Vec::new(),
            started,
            timeline: Vec::new(),
        };
        match node.bring_up(&cfg, kubelet_bin, proxy_bin).await {
            Ok(()) => Ok(node),
            Err(e) => {
                // What was set up goes; the start's own error is what is reported.
                if let Err(j) = tokio::task::spawn_blocking(move || node.teardown()).await {
                    tracing::warn!(error = %j, "cleaning up after a failed node start panicked");
                }
                Err(e)
            }
        }
    }

    /// Files → network → mount namespace → containerd → API proxy → kubelet → images →
    /// the pod network's configuration → kube-proxy (and all supervised).
    async fn bring_up(
        &mut self,
        cfg: &NodeConfig,
        kubelet_bin: PathBuf,
        proxy_bin: PathBuf,
    ) -> Result<(), Error> {
        self.write_files(cfg)?;
        self.mark("files");
        self.connect(cfg)?;
        self.mark("network");
        let hpid = self.mount_namespace().await?;
        self.mark("mount namespace");
        let containerd = self.start_containerd(hpid).await?;
        let listen = SocketAddr::new(NODE_LOCAL_APISERVER.into(), cfg.api_port);
        let how = match &cfg.entry {
            None => crate::proxy::Upstream::Plain,
            Some(name) => crate::proxy::Upstream::Wrapped(
                crate::entry::client_tls(&cfg.ca_pem).map_err(|e| Error::Join(e.to_string()))?,
                rustls::pki_types::ServerName::try_from(name.clone())
                    .map_err(|e| Error::Join(format!("server name {name:?}: {e}")))?,
            ),
        };
        self.tasks.push(crate::proxy::start(
            net::netns_path(&self.addrs),
            listen,
            cfg.apiservers.clone(),
            how,
        )?);
        if let Some((server, server_name)) = &cfg.tunnel {
            self.tasks.push(self.agent(cfg, *server, server_name)?);
        }
        let kubelet = self.kubelet_spec(cfg, hpid, kubelet_bin);
        let k = Child::spawn(&kubelet).map_err(|e| Error::io("starting the kubelet", e))?;
        self.procs.lock().map_err(poisoned)?.kubelet = Some(k);
        self.mark("kubelet started");
        // The images go in while the kubelet starts (it takes seconds before it registers).
        // The node's network configuration is written only once they are in: until then
        // the runtime reports its network not ready, so the node is not Ready and carries
        // the not-ready taint; only a pod that tolerates it or names the node could land
        // before its image is there (and would wait for it). containerd reloads its CNI
        // configuration on a write or rename in the directory, and `write` renames a
        // finished file into place.
        let sock = self.layout.containerd_socket();
        let archives = cfg.images.clone();
        tokio::task::spawn_blocking(move || archives.iter().try_for_each(|a| import(&sock, a)))
            .await
            .map_err(|e| Error::io("importing images", std::io::Error::other(e.to_string())))??;
        self.mark("images imported");
        write(
            &self.layout.cni_conf_dir().join("10-nestplane.conflist"),
            &config::cni_conflist(&self.layout, &self.addrs),
        )?;
        let proxy = self.kube_proxy_spec(hpid, proxy_bin);
        self.tasks.push(supervise(
            self.procs.clone(),
            containerd,
            kubelet,
            proxy,
            self.layout.kubelet_kubeconfig(),
        ));
        Ok(())
    }

    /// The node's tunnel agent: it dials out from this side with the kubelet's client
    /// certificate (once the kubelet has one) and connects inside the node's namespace, held
    /// open from now on.
    fn agent(
        &self,
        cfg: &NodeConfig,
        server: SocketAddr,
        server_name: &str,
    ) -> Result<JoinHandle<()>, Error> {
        let netns = net::open_netns(&self.addrs).map_err(|e| {
            Error::io(
                format!("opening {}", net::netns_path(&self.addrs).display()),
                e,
            )
        })?;
        let agent = crate::tunnel::AgentConfig {
            server,
            server_name: server_name.to_string(),
            ca_pem: cfg.ca_pem.clone(),
            credential: self.layout.kubelet_client_certificate(),
            node_ip: self.addrs.node_ip,
            pod_cidr: self.addrs.pod_cidr.parse().ok(),
            netns: Some(netns),
        };
        Ok(tokio::spawn(crate::tunnel::run_agent(agent)))
    }

    /// The node's directories, credentials and configuration files, and its cgroups.
    fn write_files(&self, cfg: &NodeConfig) -> Result<(), Error> {
        let layout = &self.layout;
        let addrs = &self.addrs;
        for d in [
            layout.cni_conf_dir(),
            layout.kubelet_root(),
            layout.logs(),
            layout.var_log(),
            layout.dir.join("netns"),
            layout.dir.join("run-containerd"),
            layout.dir.join("var-lib-cni"),
        ] {
            mkdir(&d)?;
        }
        // A directory used before may hold the pod network's configuration already; it is
        // written again once the images are in (see `bring_up`).
        let conflist = layout.cni_conf_dir().join("10-nestplane.conflist");
        if let Err(e) = std::fs::remove_file(&conflist)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(Error::io(format!("removing {}", conflist.display()), e));
        }
        write(&layout.ca(), &cfg.ca_pem)?;
        write(
            &layout.bootstrap_kubeconfig(),
            &config::bootstrap_kubeconfig(layout, cfg.api_port, &cfg.token),
        )?;
        let runc = match &cfg.guard {
            Some(g) => Some(write_guard(layout, g, cfg.spec.pod_security)?),
            None => None,
        };
        write(
            &layout.containerd_config(),
            &config::containerd_toml(layout, &cfg.pause_image, runc.as_deref()),
        )?;
        write(
            &layout.kubelet_config(),
            &config::kubelet_config(layout, addrs, &cfg.cluster, &cfg.spec),
        )?;
        write(
            &layout.resolv_conf(),
            &config::resolv_conf(addrs, &cfg.cluster),
        )?;
        write(
            &layout.kube_proxy_config(),
            &config::kube_proxy_config(layout, &cfg.name),
        )?;
        for h in cgroup_hierarchies() {
            let p = h.join(config::cgroup_root(addrs).trim_start_matches('/'));
            mkdir(&p)?;
        }
        Ok(())
    }

    /// The node's network: its namespace and link, its isolation group, and the cluster's
    /// control-plane user let in.
    fn connect(&self, cfg: &NodeConfig) -> Result<(), Error> {
        let addrs = &self.addrs;
        net::setup(addrs)?;
        if let Some(g) = cfg.group {
            net::isolate(addrs, g)?;
        }
        if let Some(uid) = cfg.control_plane_user {
            nestplane_runtime::egress::allow_node(&addrs.host_veth, uid).map_err(|e| {
                net::unisolate(addrs);
                Error::Command {
                    what: "letting the cluster's control plane reach the node".into(),
                    output: e.to_string(),
                }
            })?;
        }
        Ok(())
    }

    /// The mount namespace: a holder process keeps it; every node process joins it. The
    /// node's own /var/log (pod logs), /run/netns (pod network namespaces), /run/containerd
    /// (shim sockets) and /var/lib/cni (CNI's cache) are mounted there. Returns the holder's
    /// pid.
    async fn mount_namespace(&mut self) -> Result<u32, Error> {
        let layout = &self.layout;
        let holder = spawn(
            layout,
            "holder",
            Path::new("/usr/bin/nsenter"),
            vec![
                format!("--net={}", net::netns_path(&self.addrs).display()),
                "unshare".into(),
                "--mount".into(),
                "--propagation".into(),
                "slave".into(),
                "sleep".into(),
                "infinity".into(),
            ],
        )?;
        let hpid = holder.pid();
        self.procs.lock().map_err(poisoned)?.holder = Some(holder);
        wait_for(
            || {
                std::fs::read_link(format!("/proc/{hpid}/ns/mnt")).ok()
                    != std::fs::read_link("/proc/self/ns/mnt").ok()
            },
            Duration::from_secs(10),
            "the node's mount namespace",
            &layout.logs().join("holder.log"),
        )
        .await?;
        for (src, dst) in [
            (layout.var_log(), "/var/log"),
            (layout.dir.join("netns"), "/run/netns"),
            (layout.dir.join("run-containerd"), "/run/containerd"),
            (layout.dir.join("var-lib-cni"), "/var/lib/cni"),
        ] {
            mkdir(Path::new(dst))?;
            net::run(&[
                "nsenter",
                "-t",
                &hpid.to_string(),
                "-m",
                "mount",
                "--bind",
                &src.to_string_lossy(),
                dst,
            ])?;
        }
        Ok(hpid)
    }

    /// containerd in the node, answering; returns its spec (for the supervisor).
    async fn start_containerd(&mut self, hpid: u32) -> Result<Spec, Error> {
        let containerd = self.containerd_spec(hpid);
        let c = Child::spawn(&containerd).map_err(|e| Error::io("starting containerd", e))?;
        self.procs.lock().map_err(poisoned)?.containerd = Some(c);
        let sock = self.layout.containerd_socket();
        wait_for(
            || {
                std::process::Command::new("ctr")
                    .arg("--address")
                    .arg(&sock)
                    .arg("version")
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            },
            Duration::from_secs(30),
            "containerd",
            &containerd.log,
        )
        .await?;
        self.mark("containerd answers");
        Ok(containerd)
    }

    fn in_node(&self, hpid: u32, name: &str, program: &Path, args: Vec<String>) -> Spec {
        node_spec(&self.layout, hpid, name, program, args)
    }

    fn containerd_spec(&self, hpid: u32) -> Spec {
        self.in_node(
            hpid,
            "containerd",
            Path::new("/usr/bin/containerd"),
            vec![
                "--config".into(),
                self.layout
                    .containerd_config()
                    .to_string_lossy()
                    .into_owned(),
            ],
        )
    }

    fn kubelet_spec(&self, cfg: &NodeConfig, hpid: u32, bin: PathBuf) -> Spec {
        let l = &self.layout;
        let mut args = vec![
            format!("--config={}", l.kubelet_config().display()),
            format!(
                "--bootstrap-kubeconfig={}",
                l.bootstrap_kubeconfig().display()
            ),
            format!("--kubeconfig={}", l.kubelet_kubeconfig().display()),
            format!("--cert-dir={}", l.kubelet_pki().display()),
            format!("--root-dir={}", l.kubelet_root().display()),
            "--container-runtime=remote".into(),
            format!(
                "--container-runtime-endpoint=unix://{}",
                l.containerd_socket().display()
            ),
            format!("--hostname-override={}", cfg.name),
            format!("--node-ip={}", self.addrs.node_ip),
            format!("--pod-infra-container-image={}", cfg.pause_image),
            "--v=1".into(),
        ];
        if !cfg.spec.labels.is_empty() {
            let labels: Vec<String> = cfg
                .spec
                .labels
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            args.push(format!("--node-labels={}", labels.join(",")));
        }
        if !cfg.spec.taints.is_empty() {
            args.push(format!(
                "--register-with-taints={}",
                cfg.spec.taints.join(",")
            ));
        }
        let mut spec = self.in_node(hpid, "kubelet", &bin, args);
        // The kubelet's built-in ECR credential provider otherwise asks the EC2 metadata
        // address (169.254.169.254) for credentials at start: a packet meant to leave the
        // machine, and about 6 s of timeouts before the node registers.
        spec.env
            .insert("AWS_EC2_METADATA_DISABLED".into(), "true".into());
        spec
    }

    fn kube_proxy_spec(&self, hpid: u32, bin: PathBuf) -> Spec {
        self.in_node(
            hpid,
            "kube-proxy",
            &bin,
            vec![
                format!("--config={}", self.layout.kube_proxy_config().display()),
                "--v=1".into(),
            ],
        )
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's address (its `InternalIP`).
    pub fn ip(&self) -> std::net::Ipv4Addr {
        self.addrs.node_ip
    }

    /// The node's addresses on this machine.
    pub fn addresses(&self) -> &Addresses {
        &self.addrs
    }

    /// The node's directory.
    pub fn dir(&self) -> &Path {
        &self.layout.dir
    }

    /// When [`Node::start`] began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// How long each step of [`Node::start`] took to finish, from its beginning (files,
    /// network, mount namespace, containerd answers, images imported, kubelet started).
    pub fn timeline(&self) -> &[(&'static str, Duration)] {
        &self.timeline
    }

    fn mark(&mut self, step: &'static str) {
        self.timeline.push((step, self.started.elapsed()));
    }

    /// What the node trusts and presents now, each if it has one.
    pub fn trust(&self) -> Trust {
        let read = |p: &Path| std::fs::read_to_string(p).ok();
        Trust {
            ca: read(&self.layout.ca()),
            client: read(&self.layout.kubelet_client_certificate()),
            serving: read(&self.layout.kubelet_serving_certificate()),
        }
    }

    /// Give the node a new trust without replacing it: `ca_pem` as its CA bundle and, when
    /// given, `client` and `serving` (each a certificate and its key, PEM) as its kubelet's
    /// client and serving certificates (each a file of its own that the kubelet's `…-current.pem`
    /// is pointed at, as the kubelet's own rotation does). Then its kubelet and kube-proxy,
    /// which read their kubeconfig's CA file and their certificates at start, are restarted
    /// (the supervisor starts them again within a second; pods keep running). Nothing is
    /// written or restarted when nothing changes. Returns whether something did.
    pub fn retrust(
        &self,
        ca_pem: &str,
        client: Option<&str>,
        serving: Option<&str>,
    ) -> Result<bool, Error> {
        let now = self.trust();
        let mut changed = false;
        if now.ca.as_deref() != Some(ca_pem) {
            write(&self.layout.ca(), ca_pem)?;
            changed = true;
        }
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        for (given, current, kind, link) in [
            (
                client,
                &now.client,
                "client",
                self.layout.kubelet_client_certificate(),
            ),
            (
                serving,
                &now.serving,
                "server",
                self.layout.kubelet_serving_certificate(),
            ),
        ] {
            let Some(given) = given.filter(|g| current.as_deref() != Some(*g)) else {
                continue;
            };
            let pki = self.layout.kubelet_pki();
            let file = pki.join(format!("kubelet-{kind}-nestplane-{at}.pem"));
            write(&file, given)?;
            let next = pki.join(format!(".kubelet-{kind}-current.pem.next"));
            let _ = std::fs::remove_file(&next);
            std::os::unix::fs::symlink(&file, &next)
                .and_then(|()| std::fs::rename(&next, &link))
                .map_err(|e| Error::io("pointing the kubelet at its new certificate", e))?;
            changed = true;
        }
        if changed {
            let mut guard = self.procs.lock().map_err(poisoned)?;
            let p = &mut *guard;
            for c in [p.kubelet.as_mut(), p.kube_proxy.as_mut()]
                .into_iter()
                .flatten()
            {
                c.kill();
            }
        }
        Ok(changed)
    }

    /// Process ids of containerd, the kubelet and kube-proxy (for memory measurements).
    pub fn pids(&self) -> Vec<u32> {
        let Ok(p) = self.procs.lock() else {
            return Vec::new();
        };
        [&p.containerd, &p.kubelet, &p.kube_proxy]
            .into_iter()
            .flatten()
            .map(Child::pid)
            .collect()
    }

    /// Remove the node: its processes, containers, mounts, network namespace (bridge,
    /// iptables rules, routes), cgroups, directory and slot.
    pub async fn remove(self) -> Result<(), Error> {
        tokio::task::spawn_blocking(move || self.remove_now())
            .await
            .map_err(|e| Error::io("removing a node", std::io::Error::other(e.to_string())))?
    }

    /// [`Node::remove`], blocking the calling thread.
    pub fn remove_now(mut self) -> Result<(), Error> {
        self.teardown();
        let left = leftovers(&self.addrs, &self.layout.dir);
        if left.is_empty() {
            Ok(())
        } else {
            Err(Error::Command {
                what: format!("removing node {}", self.name),
                output: format!("left behind: {}", left.join("; ")),
            })
        }
    }

    fn teardown(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        let (holder, containerd, kubelet, kube_proxy) = match self.procs.lock() {
            Ok(mut p) => {
                p.stopping = true;
                (
                    p.holder.take(),
                    p.containerd.take(),
                    p.kubelet.take(),
                    p.kube_proxy.take(),
                )
            }
            Err(_) => (None, None, None, None),
        };
        let cgroup = config::cgroup_root(&self.addrs);
        let sock = self.layout.containerd_socket();
        for mut c in [kube_proxy, kubelet].into_iter().flatten() {
            c.stop(Duration::from_secs(5));
        }
        kill_cgroup_tree(&cgroup);
        kill_shims(&sock);
        if let Some(mut c) = containerd {
            c.stop(Duration::from_secs(5));
        }
        kill_shims(&sock);
        kill_cgroup_tree(&cgroup);
        if let Some(mut h) = holder {
            h.kill();
        }
        remove_cgroups(&cgroup);
        net::teardown(&self.addrs);
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_dir_all(&self.layout.dir);
        if let Some(s) = self.slot.take() {
            s.release();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

fn poisoned<T>(_: T) -> Error {
    Error::io("node state", std::io::Error::other("lock poisoned"))
}

fn node_spec(layout: &Layout, hpid: u32, name: &str, program: &Path, args: Vec<String>) -> Spec {
    let mut all = vec![
        "-t".to_string(),
        hpid.to_string(),
        "-m".into(),
        "-n".into(),
        "--".into(),
        program.to_string_lossy().into_owned(),
    ];
    all.extend(args);
    Spec {
        name: name.into(),
        program: PathBuf::from("/usr/bin/nsenter"),
        args: all,
        env: BTreeMap::new(),
        log: layout.logs().join(format!("{name}.log")),
        cwd: Some(layout.dir.clone()),
        user: None,
        stop_grace: None,
    }
}

fn spawn(layout: &Layout, name: &str, program: &Path, args: Vec<String>) -> Result<Child, Error> {
    let spec = Spec {
        name: name.into(),
        program: program.to_path_buf(),
        args,
        env: BTreeMap::new(),
        log: layout.logs().join(format!("{name}.log")),
        cwd: Some(layout.dir.clone()),
        user: None,
        stop_grace: None,
    };
    Child::spawn(&spec).map_err(|e| Error::io(format!("starting {name}"), e))
}

async fn wait_for(
    mut ok: impl FnMut() -> bool,
    timeout: Duration,
    what: &str,
    log: &Path,
) -> Result<(), Error> {
    let deadline = Instant::now() + timeout;
    loop {
        if ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Start {
                process: what.into(),
                reason: format!("not ready after {timeout:?}"),
                log: log.display().to_string(),
                tail: child::log_tail(log, 20),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Import one OCI archive into the node's containerd (namespace `k8s.io`, where the CRI
/// plugin looks).
pub fn import(socket: &Path, archive: &Path) -> Result<(), Error> {
    let out = std::process::Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["-n", "k8s.io", "images", "import", "--no-unpack=false"])
        .arg(archive)
        .output()
        .map_err(|e| Error::io("running ctr images import", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            what: format!("ctr images import {}", archive.display()),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Restart whichever of containerd and the kubelet exits; start kube-proxy once the kubelet
/// has its client certificate (its kubeconfig exists), restart it when it exits.
fn supervise(
    procs: Arc<Mutex<Procs>>,
    containerd: Spec,
    kubelet: Spec,
    kube_proxy: Spec,
    kubelet_kubeconfig: PathBuf,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let Ok(mut guard) = procs.lock() else { return };
            let p = &mut *guard;
            if p.stopping {
                return;
            }
            for (slot, spec) in [(&mut p.containerd, &containerd), (&mut p.kubelet, &kubelet)] {
                let exited = slot.as_mut().map(|c| c.exited().is_some()).unwrap_or(true);
                if exited {
                    tracing::warn!(process = %spec.name, "node process exited; restarting");
                    *slot = Child::spawn(spec).ok();
                }
            }
            let need_proxy = match p.kube_proxy.as_mut() {
                None => kubelet_kubeconfig.exists(),
                Some(c) => c.exited().is_some(),
            };
            if need_proxy {
                p.kube_proxy = Child::spawn(&kube_proxy).ok();
            }
        }
    })
}

fn cgroup_dirs(root: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for h in cgroup_hierarchies() {
        let top = h.join(root.trim_start_matches('/'));
        let mut stack = vec![top];
        while let Some(d) = stack.pop() {
            if !d.is_dir() {
                continue;
            }
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(e.path());
                    }
                }
            }
            out.push(d);
        }
    }
    out
}

/// SIGKILL every process in the cgroup tree `root` (pods' containers), in every hierarchy.
fn kill_cgroup_tree(root: &str) {
    for _ in 0..3 {
        let mut any = false;
        for d in cgroup_dirs(root) {
            if let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) {
                for pid in text.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                    child::kill_pid(pid);
                    any = true;
                }
            }
        }
        if !any {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Remove the cgroup tree `root` (deepest first) and the `/nestplane` parent when empty.
fn remove_cgroups(root: &str) {
    let mut dirs = cgroup_dirs(root);
    dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
    for _ in 0..20 {
        dirs.retain(|d| d.exists() && std::fs::remove_dir(d).is_err());
        if dirs.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for h in cgroup_hierarchies() {
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_dir(h.join("nestplane"));
    }
}

/// Remove what the node of a stale slot left when its owner died without removing it: its
/// processes and containers, cgroups, network namespace and directory.
fn clean_stale(slot: u8, dir: &Path) {
    let addrs = Addresses::of(slot);
    let cgroup = config::cgroup_root(&addrs);
    let d = dir.to_string_lossy();
    if !d.is_empty() && d != "/" {
        for pid in processes_naming(&d) {
            child::kill_pid(pid);
        }
    }
    kill_cgroup_tree(&cgroup);
    remove_cgroups(&cgroup);
    net::teardown(&addrs);
    if dir.join("containerd.toml").exists() {
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Processes whose command line names `needle` (the node's containerd socket or directory).
fn processes_naming(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let me = std::process::id();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if pid == me {
                continue;
            }
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains(needle) {
                    out.push(pid);
                }
            }
        }
    }
    out
}

/// Processes whose working directory is `dir` or under it (also when it was deleted).
fn processes_with_cwd_under(dir: &Path) -> Vec<u32> {
    let me = std::process::id();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cwd) = std::fs::read_link(e.path().join("cwd")) else {
            continue;
        };
        let cwd = cwd.to_string_lossy();
        let cwd = Path::new(cwd.strip_suffix(" (deleted)").unwrap_or(&cwd));
        if pid != me && cwd.starts_with(dir) {
            out.push(pid);
        }
    }
    out
}

/// Kill the containerd shims of the node's containerd (they outlive containerd by design).
fn kill_shims(socket: &Path) {
    for pid in processes_naming(&socket.to_string_lossy()) {
        child::kill_pid(pid);
    }
}

/// What a removed node left on this machine (empty when nothing): processes, mounts, the
/// network namespace, the host's veth, cgroups, the directory.
pub fn leftovers(addrs: &Addresses, dir: &Path) -> Vec<String> {
    let mut left = Vec::new();
    let d = dir.to_string_lossy().into_owned();
    let procs = processes_naming(&d);
    if !procs.is_empty() {
        left.push(format!("processes {procs:?}"));
    }
    // Processes started in the node's directory (the mount-namespace holder names it only
    // there), even once the directory is gone.
    let inside = processes_with_cwd_under(dir);
    if !inside.is_empty() {
        left.push(format!("processes working in it {inside:?}"));
    }
    if let Ok(m) = std::fs::read_to_string("/proc/self/mountinfo")
        && m.contains(&d)
    {
        left.push("mounts".into());
    }
    if net::netns_path(addrs).exists() {
        left.push(format!("network namespace {}", addrs.netns));
    }
    if Path::new("/sys/class/net").join(&addrs.host_veth).exists() {
        left.push(format!("interface {}", addrs.host_veth));
    }
    let cg = cgroup_dirs(&config::cgroup_root(addrs));
    if !cg.is_empty() {
        left.push(format!("cgroups {}", cg[0].display()));
    }
    if dir.exists() {
        left.push(format!("directory {d}"));
    }
    if let Ok(out) = std::process::Command::new("iptables-save").output() {
        let rules = String::from_utf8_lossy(&out.stdout);
        // Whole words: `npn1` is not `npn12`.
        let names = |w: &str| w == addrs.host_veth || w == addrs.pod_cidr;
        if rules.lines().any(|l| l.split_whitespace().any(names)) {
            left.push("rules in this machine's iptables".into());
        }
    }
    if let Ok(routes) = std::process::Command::new("ip")
        .args(["route", "show"])
        .output()
        && String::from_utf8_lossy(&routes.stdout).contains(&addrs.pod_cidr)
    {
        left.push(format!("route to {}", addrs.pod_cidr));
    }
    let claim = net::slots_dir().join(addrs.slot.to_string());
    if std::fs::read_to_string(&claim).is_ok_and(|c| c.contains(d.as_ref() as &str)) {
        left.push(format!("slot claim {}", claim.display()));
    }
    left
}
