//! Each process-runtime API server's way into its own cluster: one egress socket per replica
//! (in the replica's working directory, the tenant user's alone), served by
//! [`nestplane_nodes::egress`] through that cluster's nodes on this machine, which the node
//! runtime names by the cluster's isolation group (its control plane's uid).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ipnet::Ipv4Net;
pub use nestplane_nodes::egress::service_ranges;
use nestplane_nodes::egress::{Cluster, serve};
use nestplane_nodes::entry::{self, Backends};
use nestplane_nodes::tunnel::{Agents, Replica};
use nestplane_pki::CertKey;
use nestplane_runtime::egress::User;
use nestplane_runtime::process::TenantKey;
use std::net::SocketAddr;
use tokio::task::JoinHandle;

use crate::hosted::pool::machines::NodeRuntime;

struct Listening {
    path: PathBuf,
    task: JoinHandle<()>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        // Aborting the listener ends its tunnels too.
        self.task.abort();
    }
}

/// One tenant's sockets and what they share.
struct Served {
    cluster: Arc<Cluster>,
    /// The agents of its nodes on other machines, waiting at its door.
    agents: Arc<Agents>,
    listening: Vec<Listening>,
    door: Option<Door>,
}

/// A tenant's door for nodes on other machines ([`nestplane_nodes::entry`]), on loopback
/// behind the gateway.
struct Door {
    address: SocketAddr,
    /// The certificate it serves (renewed at half its life, or when the CA changes).
    cert_pem: String,
    /// The CA that issued it.
    ca_pem: String,
    task: JoinHandle<()>,
}

impl Drop for Door {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The egress sockets of every tenant this operator runs.
pub struct Egress {
    nodes: Arc<dyn NodeRuntime>,
    /// What machines' agents may announce.
    assigned: Arc<crate::bootstrap::Assigned>,
    tenants: Mutex<HashMap<TenantKey, Served>>,
}

/// Bind the socket in directory `dir`, owned by `user`, 0600. Through a descriptor of the
/// directory (`/proc/self/fd/<n>/egress.sock`): a socket's path may be 107 bytes at most,
/// which a state directory, a namespace and a cluster name can exceed, and the directory is
/// opened without following a link.
fn bind(dir: &Path, user: Option<User>) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::OpenOptionsExt;
    let d = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    let path = PathBuf::from(format!(
        "/proc/self/fd/{}/{}",
        std::os::fd::AsRawFd::as_raw_fd(&d),
        nestplane_render::egress::SOCKET_FILE
    ));
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = tokio::net::UnixListener::bind(&path)?;
    if let Some(u) = user {
        std::os::unix::fs::lchown(&path, Some(u.uid), Some(u.gid))?;
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

impl Egress {
    /// Sockets served through the nodes of `nodes`.
    pub fn new(nodes: Arc<dyn NodeRuntime>, assigned: Arc<crate::bootstrap::Assigned>) -> Egress {
        Egress {
            nodes,
            assigned,
            tenants: Default::default(),
        }
    }

    fn served(&self, key: &TenantKey, user: Option<User>, services: Vec<Ipv4Net>) -> Served {
        let nodes = self.nodes.clone();
        // The nodes of this cluster are those of its isolation group: its control plane's uid.
        let group = user.map(|u| u.uid);
        let (assigned, ns, cluster) = (
            self.assigned.clone(),
            key.namespace.clone(),
            key.cluster.clone(),
        );
        let agents = Arc::new(Agents::new(services.clone()).with_verify(Arc::new(
            move |node: &str, ip, cidr| assigned.check(&ns, &cluster, node, ip, cidr),
        )));
        let cluster = Cluster::new(
            user,
            services,
            Box::new(move || group.map(|g| nodes.routes(g)).unwrap_or_default()),
        )
        .with_remote(agents.clone());
        Served {
            cluster: Arc::new(cluster),
            agents,
            listening: vec![],
            door: None,
        }
    }

    /// Serve `<dir>/egress.sock` for each replica directory in `dirs` of the tenant `key`,
    /// whose control plane runs as `user` and whose Service ranges are `services`; a socket
    /// that is there and served stays (with the ranges given now), those of replicas no
    /// longer in `dirs` go. A socket that cannot be made is logged and tried again on the
    /// next pass: the API server runs without it (its cluster traffic fails, nothing else).
    pub fn ensure(
        &self,
        key: &TenantKey,
        user: Option<User>,
        services: Vec<Ipv4Net>,
        dirs: &[PathBuf],
    ) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let served = tenants
            .entry(key.clone())
            .or_insert_with(|| self.served(key, user, services.clone()));
        if served.cluster.user != user {
            // Another user is another tenant: nothing of the last one's is kept.
            *served = self.served(key, user, services.clone());
        }
        *served
            .cluster
            .services
            .write()
            .unwrap_or_else(|e| e.into_inner()) = services.clone();
        *served
            .agents
            .services
            .write()
            .unwrap_or_else(|e| e.into_inner()) = services;
        let paths: Vec<PathBuf> = dirs
            .iter()
            .map(|d| d.join(nestplane_render::egress::SOCKET_FILE))
            .collect();
        served
            .listening
            .retain(|l| paths.contains(&l.path) && !l.task.is_finished() && l.path.exists());
        for (dir, path) in dirs.iter().zip(paths) {
            if served.listening.iter().any(|l| l.path == path) {
                continue;
            }
            match bind(dir, user) {
                Ok(listener) => {
                    let task = tokio::spawn(serve(listener, served.cluster.clone()));
                    served.listening.push(Listening { path, task });
                }
                // A directory that is gone is a replica removed meanwhile.
                Err(_) if !dir.is_dir() => {}
                Err(e) => tracing::warn!(
                    tenant = %key,
                    socket = %path.display(),
                    error = %e,
                    "cannot serve the API server's egress socket; its cluster traffic fails until it can"
                ),
            }
        }
    }

    /// Open (or keep) the door of the tenant `key` for its nodes on other machines, named
    /// `name`, with a serving certificate of `ca` (the cluster CA); API traffic through it
    /// goes to `backends`. Returns its address (for the gateway's route), `None` for a tenant
    /// not served here ([`Egress::ensure`] first) or a door that cannot be opened (logged;
    /// tried again on the next pass).
    pub async fn door(
        &self,
        key: &TenantKey,
        ca: &CertKey,
        name: &str,
        backends: Backends,
    ) -> Option<SocketAddr> {
        {
            let tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
            let served = tenants.get(key)?;
            if let Some(d) = &served.door
                && !d.task.is_finished()
                && d.ca_pem == ca.cert_pem
                && !nestplane_pki::needs_renewal(&d.cert_pem, time::OffsetDateTime::now_utc())
            {
                return Some(d.address);
            }
        }
        let opened = async {
            let leaf = nestplane_pki::issue(
                ca,
                &nestplane_pki::LeafSpec {
                    common_name: "nestplane-nodes-door".into(),
                    dns_names: vec![name.to_string()],
                    usage: nestplane_pki::Usage::Server,
                    ..Default::default()
                },
                time::OffsetDateTime::now_utc(),
            )
            .map_err(|e| e.to_string())?;
            let chain = format!("{}{}", leaf.cert_pem, ca.cert_pem);
            let tls = entry::server_tls(&chain, &leaf.key_pem, &ca.cert_pem)?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            let address = listener.local_addr().map_err(|e| e.to_string())?;
            Ok::<_, String>((leaf.cert_pem, tls, listener, address))
        }
        .await;
        let (cert_pem, tls, listener, address) = match opened {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(tenant = %key, error = %e, "cannot open the door for nodes on other machines; tried again on the next pass");
                return None;
            }
        };
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let served = tenants.get_mut(key)?;
        let task = tokio::spawn(entry::serve(
            listener,
            tls,
            served.agents.clone(),
            Replica {
                id: "operator".into(),
                count: 1,
            },
            backends,
        ));
        served.door = Some(Door {
            address,
            cert_pem,
            ca_pem: ca.cert_pem.clone(),
            task,
        });
        Some(address)
    }

    /// The nodes of the tenant `key` whose agents wait at its door (names, sorted).
    pub fn remote_nodes(&self, key: &TenantKey) -> Vec<String> {
        let tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        tenants
            .get(key)
            .map(|s| s.agents.nodes())
            .unwrap_or_default()
    }

    /// Stop serving the tenant `key` (it is removed; its directory goes with it).
    pub fn remove(&self, key: &TenantKey) {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        tenants.remove(key);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn service_ranges_are_the_ipv4_ones_of_the_list() {
        assert_eq!(
            service_ranges("10.96.0.0/12, fd00::/108,10.100.3.7/16"),
            vec![
                "10.96.0.0/12".parse::<Ipv4Net>().unwrap(),
                "10.100.0.0/16".parse().unwrap()
            ]
        );
        assert!(service_ranges("").is_empty());
    }

    #[tokio::test]
    async fn a_socket_is_made_however_long_its_directory_path_is() {
        let base = tempfile::tempdir().unwrap();
        let mut dir = base.path().to_path_buf();
        for _ in 0..6 {
            dir.push("a-directory-name-of-twenty-four");
        }
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(nestplane_render::egress::SOCKET_FILE);
        assert!(path.as_os_str().len() > 108, "{}", path.display());
        let _listener = bind(&dir, None).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        use std::os::unix::fs::FileTypeExt;
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        // Made again over a stale one.
        drop(_listener);
        let _again = bind(&dir, None).unwrap();
    }
}
