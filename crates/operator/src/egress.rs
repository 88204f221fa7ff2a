//! Each process-runtime API server's way into its own cluster: one egress socket per replica
//! (in the replica's working directory, the tenant user's alone), served by
//! [`nestplane_nodes::egress`] through that cluster's nodes on this machine, which the node
//! runtime names by the cluster's isolation group (its control plane's uid).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ipnet::Ipv4Net;
use nestplane_nodes::egress::{Cluster, serve};
use nestplane_runtime::egress::User;
use nestplane_runtime::process::TenantKey;
use tokio::task::JoinHandle;

use crate::hosted::pool::machines::NodeRuntime;

struct Listening {
    path: PathBuf,
    task: JoinHandle<()>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The egress sockets of every tenant this operator runs.
pub struct Egress {
    nodes: Arc<dyn NodeRuntime>,
    tenants: Mutex<HashMap<TenantKey, Vec<Listening>>>,
}

/// The IPv4 ranges of a comma-separated Service CIDR list (IPv6 ones are not served). Pure.
pub fn service_ranges(cidrs: &str) -> Vec<Ipv4Net> {
    cidrs
        .split(',')
        .filter_map(|c| c.trim().parse::<Ipv4Net>().ok())
        .map(|n| n.trunc())
        .collect()
}

fn bind(path: &Path, user: Option<User>) -> std::io::Result<tokio::net::UnixListener> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = tokio::net::UnixListener::bind(path)?;
    if let Some(u) = user {
        std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

impl Egress {
    /// Sockets served through the nodes of `nodes`.
    pub fn new(nodes: Arc<dyn NodeRuntime>) -> Egress {
        Egress {
            nodes,
            tenants: Default::default(),
        }
    }

    /// Serve `<dir>/egress.sock` for each replica directory in `dirs` of the tenant `key`,
    /// whose control plane runs as `user` and whose Service ranges are `services`; a socket
    /// that is there and served stays, those of replicas no longer in `dirs` go.
    pub fn ensure(
        &self,
        key: &TenantKey,
        user: Option<User>,
        services: Vec<Ipv4Net>,
        dirs: &[PathBuf],
    ) -> std::io::Result<()> {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let held = tenants.entry(key.clone()).or_default();
        let paths: Vec<PathBuf> = dirs
            .iter()
            .map(|d| d.join(nestplane_render::egress::SOCKET_FILE))
            .collect();
        held.retain(|l| paths.contains(&l.path) && !l.task.is_finished() && l.path.exists());
        let nodes = self.nodes.clone();
        // The nodes of this cluster are those of its isolation group: its control plane's uid.
        let group = user.map(|u| u.uid);
        let cluster = Arc::new(Cluster {
            user,
            services,
            routes: Arc::new(move || group.map(|g| nodes.routes(g)).unwrap_or_default()),
        });
        for path in paths {
            if held.iter().any(|l| l.path == path) {
                continue;
            }
            let listener = bind(&path, user)?;
            let task = tokio::spawn(serve(listener, cluster.clone()));
            held.push(Listening { path, task });
        }
        Ok(())
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
}
