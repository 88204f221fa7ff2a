//! A TLS-passthrough router: many tenants' API servers behind one address and port. It reads
//! the server name of each connection's ClientHello ([`sni`]) without terminating TLS and
//! forwards the connection, bytes untouched, to an API server of that tenant; clients verify
//! the tenant's own certificate end to end (their kubeconfig's `tls-server-name`).
//!
//! - An unknown name, a hello without one, or anything that is not TLS is reset: the client
//!   never sees another tenant's certificate.
//! - Backends are tried in turn from a rotating start; one that refuses the connection (a
//!   replica being replaced) is skipped before any byte is forwarded, so a rolling restart
//!   drops no new connection while another replica serves.
//! - A hello is read within [`HELLO_DEADLINE`] and [`sni::MAX_HELLO`] bytes, parsed only when
//!   a record is complete; at most [`MAX_CONNECTIONS`] connections are open at once (more are
//!   reset at once), so a flood cannot take the process's descriptors.
//! - No one client address holds more than [`MAX_PER_CLIENT`] of them, and no one server
//!   name (one tenant, its users, nodes and pods together) more than [`MAX_PER_NAME`]
//!   ([`Limits`]): a client or a tenant that opens connections without end is reset beyond
//!   its share, and everyone else still gets through.

pub mod sni;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a client has to send its ClientHello.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// Connections open at once (each forwarded one holds two descriptors).
pub const MAX_CONNECTIONS: usize = 2048;

/// How long connecting to one backend may take before the next is tried.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Connections one client address may hold open at once (a machine's node carries each of
/// its kubelet's, kube-proxy's and pods' API connections as one of its own).
pub const MAX_PER_CLIENT: usize = 256;

/// Connections one server name (one tenant) may hold open at once.
pub const MAX_PER_NAME: usize = 1024;

/// How many connections are forwarded at once: in all, per client address, per server name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub connections: usize,
    pub per_client: usize,
    pub per_name: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections: MAX_CONNECTIONS,
            per_client: MAX_PER_CLIENT,
            per_name: MAX_PER_NAME,
        }
    }
}

/// Open connections by key (a client address, a server name).
struct Counts<K>(std::sync::Mutex<HashMap<K, usize>>);

/// One connection counted under its key until dropped.
struct Counted<K: std::hash::Hash + Eq + Clone> {
    counts: Arc<Counts<K>>,
    key: K,
}

impl<K: std::hash::Hash + Eq + Clone> Counts<K> {
    fn new() -> Arc<Self> {
        Arc::new(Counts(std::sync::Mutex::new(HashMap::new())))
    }

    /// Count one more under `key`, unless it holds `max` already.
    fn take(self: &Arc<Self>, key: &K, max: usize) -> Option<Counted<K>> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(key.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Counted {
            counts: self.clone(),
            key: key.clone(),
        })
    }
}

impl<K: std::hash::Hash + Eq + Clone> Drop for Counted<K> {
    fn drop(&mut self) {
        let mut m = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

/// Server name → the addresses of the API servers that serve it.
#[derive(Debug, Default)]
pub struct Routes(RwLock<HashMap<String, Vec<SocketAddr>>>);

impl Routes {
    /// Route `name` (any case) to `backends`; an empty list removes the route.
    pub fn set(&self, name: &str, backends: Vec<SocketAddr>) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if backends.is_empty() {
            map.remove(&name);
        } else {
            map.insert(name, backends);
        }
    }

    /// Change the backends of `name` in place (`f` sees an empty list for a name without a
    /// route; an empty list afterwards removes it).
    pub fn update(&self, name: &str, f: impl FnOnce(&mut Vec<SocketAddr>)) {
        let mut map = self.0.write().unwrap_or_else(|e| e.into_inner());
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let mut backends = map.remove(&name).unwrap_or_default();
        f(&mut backends);
        if !backends.is_empty() {
            map.insert(name, backends);
        }
    }

    /// The backends of `name`.
    pub fn get(&self, name: &str) -> Option<Vec<SocketAddr>> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// How many names are routed.
    pub fn len(&self) -> usize {
        self.0.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no name is routed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a connection was not forwarded.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// No ClientHello within the deadline, or the client went away.
    NoHello,
    /// Not TLS, or no usable server name.
    NoName,
    /// A name no tenant has.
    Unknown(String),
    /// Every backend of the name refused the connection.
    Unreachable(String),
    /// The client address holds its share of connections already.
    ClientLimit,
    /// The name holds its share of connections already.
    NameLimit(String),
}

/// Serve `listener` until the task is dropped: each connection forwarded by its server name,
/// within the default [`Limits`].
pub async fn serve(listener: TcpListener, routes: Arc<Routes>) {
    serve_within(listener, routes, Limits::default()).await
}

/// [`serve`] within `limits`.
pub async fn serve_within(listener: TcpListener, routes: Arc<Routes>, limits: Limits) {
    let next = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(tokio::sync::Semaphore::new(limits.connections));
    let (clients, names) = (Counts::new(), Counts::new());
    loop {
        let Ok((inbound, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "gateway at {} connections; reset", limits.connections);
            reset(inbound, Refused::NoHello);
            continue;
        };
        let Some(client) = clients.take(&peer.ip(), limits.per_client) else {
            tracing::debug!(%peer, "a client at {} connections; reset", limits.per_client);
            reset(inbound, Refused::ClientLimit);
            continue;
        };
        let (routes, next, names) = (routes.clone(), next.clone(), names.clone());
        tokio::spawn(async move {
            if let Err(why) = forward(inbound, &routes, &next, &names, limits.per_name).await {
                tracing::debug!(%peer, ?why, "gateway connection refused");
            }
            drop((permit, client));
        });
    }
}

/// Forward one connection (see the module's documentation), counted under its name in
/// `names`, at most `per_name` of them; on refusal it is reset.
async fn forward(
    mut inbound: TcpStream,
    routes: &Routes,
    next: &AtomicUsize,
    names: &Arc<Counts<String>>,
    per_name: usize,
) -> Result<(), Refused> {
    let hello = match tokio::time::timeout(HELLO_DEADLINE, read_hello(&mut inbound)).await {
        Ok(Some(h)) => h,
        _ => return Err(reset(inbound, Refused::NoHello)),
    };
    let (name, buffered) = match hello {
        (sni::Hello::Sni(name), bytes) => (name, bytes),
        _ => return Err(reset(inbound, Refused::NoName)),
    };
    let Some(backends) = routes.get(&name) else {
        return Err(reset(inbound, Refused::Unknown(name)));
    };
    // Names are counted as routed (lowercase): only names a tenant has take a count.
    let Some(_counted) = names.take(&name.to_ascii_lowercase(), per_name) else {
        return Err(reset(inbound, Refused::NameLimit(name)));
    };
    let start = next.fetch_add(1, Ordering::Relaxed);
    for i in 0..backends.len() {
        let up = backends[(start + i) % backends.len()];
        let Ok(Ok(mut outbound)) =
            tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(up)).await
        else {
            continue;
        };
        if outbound.write_all(&buffered).await.is_err() {
            continue;
        }
        // A connection that ends in an error has ended: each side sees it.
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        return Ok(());
    }
    Err(reset(inbound, Refused::Unreachable(name)))
}

/// Read until the ClientHello is complete: the verdict and every byte read.
async fn read_hello(inbound: &mut TcpStream) -> Option<(sni::Hello, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = inbound.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        // Parsed only once a record is complete (a client that trickles bytes costs nothing).
        if !sni::record_completed(&buf, n) {
            continue;
        }
        match sni::parse(&buf) {
            sni::Hello::Incomplete => continue,
            verdict => return Some((verdict, buf)),
        }
    }
}

/// Close `inbound` with a reset (no orderly close: the client learns nothing of any tenant).
fn reset(inbound: TcpStream, why: Refused) -> Refused {
    let _ = inbound.set_zero_linger();
    drop(inbound);
    why
}
