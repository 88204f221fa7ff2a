//! Nodes the control plane cannot dial still carry its cluster traffic: each node runs an
//! agent that dials *out* to its control plane's tunnel port and keeps a few connections
//! waiting there; the API server's egress proxy ([`crate::egress`]), asked to `CONNECT` to an
//! address of the cluster, takes one, says `DIAL <ip>:<port>`, and the agent connects from
//! the node, as a pod of the node would (konnectivity's shape: the connection starts on the
//! cluster's side). It is how an API server that runs as a pod of a management cluster (the
//! `kubernetes` runtime) reaches the cluster it serves, and how any API server reaches a
//! node behind NAT.
//!
//! The protocol is one line each way over TLS, then the bytes of the tunnel:
//!
//! ```text
//! agent → proxy   NODE <node-ip> <pod-cidr or ->      (once the TLS session is up)
//! proxy → agent   PROXY <id> <replicas>               (which API server replica this is)
//! proxy → agent   DIAL <ip>:<port>                    (when the connection is taken)
//! agent → proxy   OK | ERR <reason>
//! ```
//!
//! An API server may have several replicas behind one Service address: the agent keeps
//! [`WAITING`] connections at each, by their ids (a connection that lands on a replica that
//! has its share is closed, and the next one tried after a pause).
//!
//! Trust: the proxy serves the control plane's serving certificate and asks every agent for a
//! client certificate of *its cluster's* CA with the subject a kubelet's client certificate
//! has (`system:node:<name>`, `system:nodes`); the agent presents its kubelet's (no credential
//! of its own), and checks the proxy against the cluster CA. An agent of another cluster
//! (another CA) or a certificate of anyone else is refused before a byte of the protocol.
//! What an agent announces only chooses among that cluster's own agents; the address dialled
//! is still checked by both ends ([`crate::egress::never`]).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use ipnet::Ipv4Net;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::egress::{Refusal, never};

/// The tunnel port of a control plane (konnectivity's agent port).
pub const PORT: u16 = 8132;
/// Connections each agent keeps waiting at the proxy.
pub const WAITING: usize = 2;
/// Waiting connections kept per node (an agent that restarts leaves its old ones; the oldest
/// go first).
const MAX_WAITING_PER_NODE: usize = 8;
/// Waiting connections kept in all.
const MAX_WAITING: usize = 1024;
/// The longest protocol line.
const MAX_LINE: u64 = 256;
/// How long a handshake, a line or a dial may take.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(10);
/// How long the proxy waits for an agent's answer: longer than the agent's own dial.
const ANSWER: Duration = Duration::from_secs(15);
/// Waiting connections found dead that one dial tries past before it gives up.
const DEAD_TRIES: usize = 4;
/// Connections the proxy holds before they have said who they are (TLS and the NODE line):
/// more are closed at once.
pub(crate) const MAX_WELCOMING: usize = 128;
/// How long an agent's connection waits before it is made anew (its certificate is read
/// again: the kubelet rotates it).
const MAX_WAIT: Duration = Duration::from_secs(600);
/// Replicas of one API server an agent keeps connections at, at most.
const MAX_REPLICAS: usize = 16;
/// The read buffer of a protocol stream (the tunnel's bytes pass it by when it is empty).
pub(crate) const BUFFER: usize = 1024;

/// A stream a tunnel runs over.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

pub(crate) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(crate) fn roots(ca_pem: &str) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let c = c.map_err(|e| format!("reading the CA: {e}"))?;
        roots
            .add(c)
            .map_err(|e| format!("adding the CA to the roots: {e}"))?;
    }
    if roots.is_empty() {
        return Err("no CA certificate".into());
    }
    Ok(roots)
}

pub(crate) fn cert_and_key(
    cert_pem: &str,
    key_pem: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("reading a certificate: {e}"))?;
    if certs.is_empty() {
        return Err("no certificate".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| format!("reading a private key: {e}"))?;
    Ok((certs, key))
}

/// The proxy's TLS: `cert_pem`/`key_pem` served; clients must present a certificate of
/// `client_ca_pem`.
pub fn server_tls(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    acceptor(cert_pem, key_pem, client_ca_pem, true)
}

/// A TLS server serving `cert_pem` (a chain) and `key_pem` that asks for a client certificate
/// of `client_ca_pem`, and refuses a client without one when `required`.
pub(crate) fn acceptor(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
    required: bool,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    let builder = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(client_ca_pem)?),
        provider(),
    );
    let builder = if required {
        builder
    } else {
        builder.allow_unauthenticated()
    };
    let verifier = builder
        .build()
        .map_err(|e| format!("client verification: {e}"))?;
    let (certs, key) = cert_and_key(cert_pem, key_pem)?;
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| format!("the serving certificate: {e}"))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// The node a client certificate names: `system:node:<name>` in `system:nodes`, as a
/// kubelet's client certificate is. Pure.
pub fn node_of(der: &[u8]) -> Result<String, String> {
    let info = nestplane_pki::inspect_der(der).map_err(|e| e.to_string())?;
    let name = info
        .subject_cn
        .strip_prefix("system:node:")
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("{:?} is not a node", info.subject_cn))?;
    if !info.organizations.iter().any(|o| o == "system:nodes") {
        return Err(format!("{:?} is not in system:nodes", info.subject_cn));
    }
    if !info.client_auth {
        return Err("not a client certificate".into());
    }
    Ok(name.to_string())
}

/// What an agent announces: its node's address and pod range. Pure.
pub fn parse_hello(line: &str) -> Result<(Ipv4Addr, Option<Ipv4Net>), String> {
    let mut parts = line.trim_end().split(' ');
    let (Some("NODE"), Some(ip), Some(cidr), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("not a NODE line: {line:?}"));
    };
    let ip: Ipv4Addr = ip.parse().map_err(|_| format!("bad address {ip:?}"))?;
    if let Some(why) = never(ip) {
        return Err(format!("{ip} is {why}"));
    }
    let cidr = match cidr {
        "-" => None,
        c => {
            let c = c
                .parse::<Ipv4Net>()
                .map_err(|_| format!("bad range {c:?}"))?
                .trunc();
            // One node's pods (a node has a /24), not a network's.
            if c.prefix_len() < 24 {
                return Err(format!("{c} is wider than one node's pod range"));
            }
            Some(c)
        }
    };
    Ok((ip, cidr))
}

/// A connection an agent keeps waiting.
struct Waiting {
    node: String,
    node_ip: Ipv4Addr,
    pod_cidr: Option<Ipv4Net>,
    stream: Box<dyn Stream>,
}

/// Whether node `name` may announce address `ip` and pod range `cidr`: `Ok(true)` when its
/// cluster assigned them to it (its connections then replace any other node's that hold them:
/// those are stale), `Ok(false)` when nobody was assigned them (the first to hold them keeps
/// them), `Err` why not.
pub type Verify =
    Arc<dyn Fn(&str, Ipv4Addr, Option<Ipv4Net>) -> Result<bool, String> + Send + Sync>;

/// The agents connected to one control plane's proxy, and its Service ranges.
pub struct Agents {
    waiting: Mutex<Vec<Waiting>>,
    /// The cluster's Service ranges: reached through any node.
    pub services: RwLock<Vec<Ipv4Net>>,
    /// What nodes may announce, where the cluster assigned their addresses.
    verify: Option<Verify>,
}

impl Agents {
    /// No agent yet, for a cluster with Service ranges `services`.
    pub fn new(services: Vec<Ipv4Net>) -> Agents {
        Agents {
            waiting: Mutex::new(Vec::new()),
            services: RwLock::new(services),
            verify: None,
        }
    }

    /// Agents whose announcements `verify` checks.
    pub fn with_verify(mut self, verify: Verify) -> Agents {
        self.verify = Some(verify);
        self
    }

    /// Whether node `node` may announce `ip` and `cidr`: what the cluster assigned it (where
    /// it assigns), and nothing another node's waiting connections hold (the first holds).
    fn may_announce(&self, node: &str, ip: Ipv4Addr, cidr: Option<Ipv4Net>) -> Result<(), String> {
        let assigned = match &self.verify {
            Some(v) => v(node, ip, cidr)?,
            None => false,
        };
        let mut all = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let clashes = |w: &Waiting| {
            w.node != node
                && (w.node_ip == ip
                    || cidr.is_some_and(|c| c.contains(&w.node_ip))
                    || w.pod_cidr.is_some_and(|wc| {
                        wc.contains(&ip)
                            || cidr.is_some_and(|c| {
                                c.contains(&wc.network()) || wc.contains(&c.network())
                            })
                    }))
        };
        if assigned {
            // The addresses are this node's now: another node's connections that hold them
            // are left from a node that went (its block was given anew).
            all.retain(|w| !clashes(w));
            return Ok(());
        }
        match all.iter().find(|w| clashes(w)) {
            Some(w) => Err(format!(
                "{ip} or its pod range is node {}'s, which is connected",
                w.node
            )),
            None => Ok(()),
        }
    }

    fn push(&self, w: Waiting) {
        let mut all = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let of_node: Vec<usize> = all
            .iter()
            .enumerate()
            .filter(|(_, o)| o.node == w.node)
            .map(|(i, _)| i)
            .collect();
        if of_node.len() >= MAX_WAITING_PER_NODE {
            all.remove(of_node[0]);
        }
        if all.len() >= MAX_WAITING {
            all.remove(0);
        }
        all.push(w);
    }

    /// Whether an agent waits whose node is `ip` or holds it in its pod range (a node of this
    /// cluster that is reached through its agent, wherever it is).
    pub fn holds(&self, ip: Ipv4Addr) -> bool {
        let all = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        all.iter()
            .any(|w| w.node_ip == ip || w.pod_cidr.is_some_and(|c| c.contains(&ip)))
    }

    /// Whether no agent waits.
    pub fn is_empty(&self) -> bool {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// The nodes with a connection waiting (names, sorted, once each).
    pub fn nodes(&self) -> Vec<String> {
        let all = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        let mut n: Vec<String> = all.iter().map(|w| w.node.clone()).collect();
        n.sort();
        n.dedup();
        n
    }

    /// A waiting connection through which `target` is reached: its node's, or any node's for
    /// an address of the Service ranges. Taken out (used once).
    fn take(&self, target: Ipv4Addr) -> Result<Waiting, Refusal> {
        if let Some(why) = never(target) {
            return Err(Refusal(403, format!("{target} is {why}")));
        }
        let mut all = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if all.is_empty() {
            return Err(Refusal(
                503,
                "no node of this cluster is connected to its control plane".into(),
            ));
        }
        // The newest connection of the node that holds the target.
        if let Some(i) = all
            .iter()
            .rposition(|w| w.node_ip == target || w.pod_cidr.is_some_and(|c| c.contains(&target)))
        {
            return Ok(all.remove(i));
        }
        let services = self.services.read().unwrap_or_else(|e| e.into_inner());
        if services.iter().any(|s| s.contains(&target)) {
            // Any node's kube-proxy knows every Service of its cluster; the newest connection
            // is the likeliest alive.
            let last = all.len() - 1;
            return Ok(all.remove(last));
        }
        Err(Refusal(
            403,
            format!("{target} is not an address of this cluster's nodes, pods or Services"),
        ))
    }

    /// A tunnel to `target` through one of the agents; a connection found dead (closed
    /// before it answered) is dropped and the next one tried, [`DEAD_TRIES`] times at most.
    pub async fn dial(&self, target: SocketAddrV4) -> Result<Box<dyn Stream>, Refusal> {
        for _ in 0..DEAD_TRIES {
            let w = self.take(*target.ip())?;
            let node = w.node.clone();
            match ask(w.stream, target).await {
                Answer::Connected(s) => return Ok(s),
                Answer::Refused(reason) => {
                    return Err(Refusal(
                        502,
                        format!("node {node} connecting to {target}: {reason}"),
                    ));
                }
                Answer::Silent => {
                    return Err(Refusal(
                        504,
                        format!("node {node} did not answer for {target} in time"),
                    ));
                }
                // Gone meanwhile (the agent restarted, the network broke): try another.
                Answer::Dead(e) => tracing::debug!(%node, error = %e, "a waiting tunnel was dead"),
            }
        }
        Err(Refusal(
            502,
            format!("no live connection of this cluster's nodes reached {target}"),
        ))
    }
}

/// Read one line of at most [`MAX_LINE`] bytes, within `within`.
async fn read_line<S: AsyncRead + Unpin>(
    s: &mut BufReader<S>,
    within: Duration,
) -> std::io::Result<String> {
    let mut line = String::new();
    let mut limited = (&mut *s).take(MAX_LINE);
    let read = limited.read_line(&mut line);
    let n = tokio::time::timeout(within, read)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    if n == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    if !line.ends_with('\n') {
        return Err(std::io::Error::other("line too long"));
    }
    Ok(line.trim_end().to_string())
}

/// What a waiting connection said to a `DIAL`.
enum Answer {
    /// `OK`: the stream carries the tunnel.
    Connected(Box<dyn Stream>),
    /// `ERR <reason>` (or something unreadable).
    Refused(String),
    /// Nothing within [`ANSWER`].
    Silent,
    /// Closed or broken before an answer: the connection was dead.
    Dead(std::io::Error),
}

/// Ask a waiting agent connection for `target`.
async fn ask(stream: Box<dyn Stream>, target: SocketAddrV4) -> Answer {
    let mut s = BufReader::with_capacity(BUFFER, stream);
    let sent = async {
        s.get_mut()
            .write_all(format!("DIAL {target}\n").as_bytes())
            .await?;
        s.get_mut().flush().await
    };
    if let Err(e) = sent.await {
        return Answer::Dead(e);
    }
    let reply = match read_line(&mut s, ANSWER).await {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Answer::Silent,
        Err(e) => return Answer::Dead(e),
    };
    if reply == "OK" {
        // The reader itself carries on: what it read past the line is the tunnel's.
        return Answer::Connected(Box::new(s));
    }
    Answer::Refused(
        reply
            .strip_prefix("ERR ")
            .unwrap_or("an unreadable answer")
            .chars()
            .filter(|c| !c.is_control())
            .collect(),
    )
}

/// Which replica a proxy is: its id (the pod's name) and how many replicas its API server
/// has.
#[derive(Clone, Debug)]
pub struct Replica {
    /// This replica's id.
    pub id: String,
    /// The API server's replicas.
    pub count: usize,
}

/// Serve agents on `listener` for `agents`, with `tls`, as `replica`, until this future is
/// dropped. At most [`MAX_WELCOMING`] connections are served before they have said who they
/// are; more are closed at once.
pub async fn serve_agents(
    listener: TcpListener,
    tls: tokio_rustls::TlsAcceptor,
    agents: Arc<Agents>,
    replica: Replica,
) {
    let welcoming = Arc::new(tokio::sync::Semaphore::new(MAX_WELCOMING));
    let replica = Arc::new(replica);
    loop {
        let (tcp, peer, permit) = next_welcomed(&listener, &welcoming).await;
        let tls = tls.clone();
        let agents = agents.clone();
        let replica = replica.clone();
        tokio::spawn(async move {
            let welcomed = welcome(tcp, tls, &agents, &replica, permit).await;
            if let Err(e) = welcomed {
                tracing::debug!(%peer, error = %e, "an agent's connection is refused");
            }
        });
    }
}

/// The next connection on `listener` and its permit of `welcoming` (held until it has said
/// who it is); one beyond the permits is closed at once.
pub(crate) async fn next_welcomed(
    listener: &TcpListener,
    welcoming: &Arc<tokio::sync::Semaphore>,
) -> (TcpStream, SocketAddr, tokio::sync::OwnedSemaphorePermit) {
    loop {
        let Ok((tcp, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        match welcoming.clone().try_acquire_owned() {
            Ok(permit) => return (tcp, peer, permit),
            Err(_) => drop(tcp),
        }
    }
}

async fn welcome(
    tcp: TcpStream,
    tls: tokio_rustls::TlsAcceptor,
    agents: &Agents,
    replica: &Replica,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<(), String> {
    let _ = tcp.set_nodelay(true);
    keepalive(&tcp);
    let stream = tokio::time::timeout(TIMEOUT, tls.accept(tcp))
        .await
        .map_err(|_| "TLS handshake timed out".to_string())?
        .map_err(|e| format!("TLS: {e}"))?;
    let der = peer_certificate(&stream)?;
    admit(
        BufReader::with_capacity(BUFFER, Box::new(stream) as Box<dyn Stream>),
        &der,
        agents,
        replica,
        permit,
    )
    .await
}

/// The client certificate a TLS connection was made with.
pub(crate) fn peer_certificate<S>(
    stream: &tokio_rustls::server::TlsStream<S>,
) -> Result<Vec<u8>, String> {
    Ok(stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or("no client certificate")?
        .to_vec())
}

/// An agent's connection, its TLS made with the client certificate `der`: it says which node
/// it is and waits among `agents`.
pub(crate) async fn admit(
    mut s: BufReader<Box<dyn Stream>>,
    der: &[u8],
    agents: &Agents,
    replica: &Replica,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<(), String> {
    let node = node_of(der)?;
    let hello = read_line(&mut s, TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    let (node_ip, pod_cidr) = parse_hello(&hello)?;
    agents.may_announce(&node, node_ip, pod_cidr)?;
    let greeting = format!("PROXY {} {}\n", replica.id, replica.count);
    tokio::time::timeout(TIMEOUT, async {
        s.get_mut().write_all(greeting.as_bytes()).await?;
        s.get_mut().flush().await
    })
    .await
    .map_err(|_| "writing the greeting timed out".to_string())?
    .map_err(|e| e.to_string())?;
    drop(permit);
    tracing::debug!(%node, %node_ip, "an agent is waiting");
    agents.push(Waiting {
        node,
        node_ip,
        pod_cidr,
        stream: Box::new(s),
    });
    Ok(())
}

/// The egress proxy beside an API server that runs as a pod (`nestplane egress-proxy`):
/// the API server's `CONNECT`s on `socket` (made anew, 0600), carried by the agents that
/// connect to `listen` with client certificates of `client_ca_pem`; `services` are the
/// cluster's Service ranges. Runs until an error.
pub async fn run_proxy(
    socket: &std::path::Path,
    listen: SocketAddr,
    tls: tokio_rustls::TlsAcceptor,
    services: Vec<Ipv4Net>,
    replica: Replica,
) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::remove_file(socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let uds = tokio::net::UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    let tcp = TcpListener::bind(listen).await?;
    let agents = Arc::new(Agents::new(services.clone()));
    // Only this user's peers: the API server runs as the same user in its own container.
    let me = nestplane_runtime::egress::User {
        uid: rustix::process::geteuid().as_raw(),
        gid: rustix::process::getegid().as_raw(),
    };
    let cluster = Arc::new(crate::egress::Cluster::reached(
        Some(me),
        services,
        crate::egress::Reach::Agents(agents.clone()),
    ));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = serve_agents(tcp, tls, agents, replica) => {}
        _ = crate::egress::serve(uds, cluster) => {}
        // A pod that goes: its tunnels end with it, its agents find the next replica.
        _ = term.recv() => {}
    }
    Ok(())
}

/// TCP keepalive on a connection that waits: a peer gone without a word is found by the
/// kernel's probes within about a minute (and, at the latest, on use, when it is dropped).
pub(crate) fn keepalive(s: &TcpStream) {
    use rustix::net::sockopt;
    use std::os::fd::AsFd;
    let fd = s.as_fd();
    let _ = sockopt::set_socket_keepalive(fd, true);
    let _ = sockopt::set_tcp_keepidle(fd, Duration::from_secs(30));
    let _ = sockopt::set_tcp_keepintvl(fd, Duration::from_secs(10));
    let _ = sockopt::set_tcp_keepcnt(fd, 3);
}

/// An agent: where its control plane's proxy is and how the node reaches its cluster.
#[derive(Clone)]
pub struct AgentConfig {
    /// The proxy's address, as this side reaches it.
    pub server: SocketAddr,
    /// The name (or address) the proxy's certificate is checked for.
    pub server_name: String,
    /// The cluster CA (PEM).
    pub ca_pem: String,
    /// The kubelet's current client certificate and key (one PEM file, read at each
    /// connection: the kubelet rotates it).
    pub credential: PathBuf,
    /// The node's address.
    pub node_ip: Ipv4Addr,
    /// The node's pod range, if it has one of its own.
    pub pod_cidr: Option<Ipv4Net>,
    /// The node's network namespace, where tunnels are connected (`None`: here).
    pub netns: Option<Arc<OwnedFd>>,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server", &self.server)
            .field("node_ip", &self.node_ip)
            .finish_non_exhaustive()
    }
}

impl AgentConfig {
    fn client_tls(&self) -> Result<tokio_rustls::TlsConnector, String> {
        let pem = std::fs::read_to_string(&self.credential)
            .map_err(|e| format!("reading {}: {e}", self.credential.display()))?;
        let (certs, key) = cert_and_key(&pem, &pem)?;
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots(&self.ca_pem)?)
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("the client certificate: {e}"))?;
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    async fn connect_out(&self) -> Result<impl Stream + use<>, String> {
        let tls = self.client_tls()?;
        let name = ServerName::try_from(self.server_name.clone())
            .map_err(|e| format!("server name {:?}: {e}", self.server_name))?;
        let tcp = tokio::time::timeout(TIMEOUT, TcpStream::connect(self.server))
            .await
            .map_err(|_| format!("connecting to {}: timed out", self.server))?
            .map_err(|e| format!("connecting to {}: {e}", self.server))?;
        let _ = tcp.set_nodelay(true);
        keepalive(&tcp);
        let mut s = tokio::time::timeout(TIMEOUT, tls.connect(name, tcp))
            .await
            .map_err(|_| "TLS handshake timed out".to_string())?
            .map_err(|e| format!("TLS with {}: {e}", self.server))?;
        let cidr = self
            .pod_cidr
            .map(|c| c.to_string())
            .unwrap_or_else(|| "-".into());
        s.write_all(format!("NODE {} {cidr}\n", self.node_ip).as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        s.flush().await.map_err(|e| e.to_string())?;
        Ok(s)
    }

    async fn connect_target(&self, target: SocketAddrV4) -> std::io::Result<TcpStream> {
        if let Some(why) = never(*target.ip()) {
            return Err(std::io::Error::other(format!("{} is {why}", target.ip())));
        }
        let addr = SocketAddr::V4(target);
        match &self.netns {
            Some(ns) => crate::net::connect_in_netns(ns.clone(), addr, TIMEOUT).await,
            None => tokio::time::timeout(TIMEOUT, TcpStream::connect(addr))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?,
        }
    }
}

/// Which replicas an agent has connections waiting at.
#[derive(Default)]
struct Seen {
    /// The replicas the proxies say their API server has.
    count: usize,
    /// Connections waiting, by replica id.
    waiting: std::collections::HashMap<String, usize>,
}

/// Run an agent until this future is dropped: [`WAITING`] connections wait at each replica of
/// the API server; each one taken is replaced at once, and carries its tunnel on a task of its
/// own.
pub async fn run_agent(cfg: AgentConfig) {
    let cfg = Arc::new(cfg);
    let seen = Arc::new(Mutex::new(Seen {
        count: 1,
        ..Default::default()
    }));
    let more = Arc::new(tokio::sync::Notify::new());
    let mut lanes = tokio::task::JoinSet::new();
    loop {
        let want = {
            let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            WAITING * seen.count.clamp(1, MAX_REPLICAS)
        };
        while lanes.len() < want {
            lanes.spawn(lane(cfg.clone(), seen.clone(), more.clone()));
        }
        tokio::select! {
            _ = more.notified() => {}
            _ = lanes.join_next() => {}
        }
    }
}

/// A pause of `d` and a little more, so that lanes do not march in step.
async fn pause(d: Duration) {
    let jitter = Duration::from_millis(rand::random::<u64>() % 200);
    tokio::time::sleep(d + jitter).await;
}

/// One waiting connection after another.
async fn lane(cfg: Arc<AgentConfig>, seen: Arc<Mutex<Seen>>, more: Arc<tokio::sync::Notify>) {
    let mut tunnels = tokio::task::JoinSet::new();
    let mut backoff = Duration::from_millis(200);
    let grow = |b: Duration| (b * 2).min(Duration::from_secs(5));
    loop {
        while tunnels.try_join_next().is_some() {}
        let mut s = match cfg.connect_out().await {
            Ok(s) => BufReader::with_capacity(BUFFER, s),
            Err(e) => {
                tracing::debug!(error = %e, "the agent cannot reach its control plane yet");
                pause(backoff).await;
                backoff = grow(backoff);
                continue;
            }
        };
        // Which replica this is; a refusal (another CA, not a node) ends here too.
        let replica = match read_line(&mut s, TIMEOUT).await.map(|l| parse_greeting(&l)) {
            Ok(Ok(r)) => r,
            other => {
                tracing::debug!(result = ?other.err(), "the proxy did not greet the agent");
                pause(backoff).await;
                backoff = grow(backoff);
                continue;
            }
        };
        let kept = {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            if replica.count > seen.count {
                seen.count = replica.count.min(MAX_REPLICAS);
                more.notify_one();
            }
            let n = seen.waiting.entry(replica.id.clone()).or_default();
            let keep = *n < WAITING;
            if keep {
                *n += 1;
            }
            keep
        };
        if !kept {
            // That replica has its share: another one may be behind the same address.
            drop(s);
            pause(backoff).await;
            backoff = grow(backoff);
            continue;
        }
        let line = read_line(&mut s, MAX_WAIT).await;
        {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = seen.waiting.get_mut(&replica.id) {
                *n = n.saturating_sub(1);
            }
        }
        let target = match line {
            Ok(line) => line,
            // Waited long enough (made anew with the current certificate), or the proxy
            // went (restarted, dropped an old connection): wait again.
            Err(e) => {
                if e.kind() != std::io::ErrorKind::TimedOut {
                    pause(backoff).await;
                    backoff = grow(backoff);
                }
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        let cfg = cfg.clone();
        tunnels.spawn(async move {
            let Some(target) = target
                .strip_prefix("DIAL ")
                .and_then(|t| t.parse::<SocketAddrV4>().ok())
            else {
                return;
            };
            let mut s = s;
            match cfg.connect_target(target).await {
                Ok(upstream) => {
                    if s.write_all(b"OK\n").await.is_ok() && s.flush().await.is_ok() {
                        crate::egress::carry(s, upstream).await;
                    }
                }
                Err(e) => {
                    let reason: String =
                        e.to_string().chars().filter(|c| !c.is_control()).collect();
                    let _ = s.write_all(format!("ERR {reason}\n").as_bytes()).await;
                    let _ = s.shutdown().await;
                }
            }
        });
    }
}

/// The proxy's greeting: `PROXY <id> <replicas>`. Pure.
pub fn parse_greeting(line: &str) -> Result<Replica, String> {
    let mut parts = line.trim_end().split(' ');
    let (Some("PROXY"), Some(id), Some(count), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!("not a PROXY line: {line:?}"));
    };
    let count: usize = count
        .parse()
        .map_err(|_| format!("bad replica count {count:?}"))?;
    if id.is_empty() || count == 0 {
        return Err(format!("not a PROXY line: {line:?}"));
    }
    Ok(Replica {
        id: id.to_string(),
        count,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::egress::{Cluster, Reach, serve};
    use nestplane_pki::{CertKey, LeafSpec, Usage, generate_ca, issue};
    use tokio::net::{UnixListener, UnixStream};

    fn now() -> time::OffsetDateTime {
        time::OffsetDateTime::now_utc()
    }

    fn leaf(ca: &CertKey, cn: &str, orgs: &[&str], usage: Usage) -> CertKey {
        issue(
            ca,
            &LeafSpec {
                common_name: cn.into(),
                organizations: orgs.iter().map(|o| o.to_string()).collect(),
                dns_names: vec![],
                ips: vec!["127.0.0.1".parse().unwrap()],
                usage,
            },
            now(),
        )
        .unwrap()
    }

    /// An address of this machine's own that is not loopback (which is never a target).
    fn own_address() -> Ipv4Addr {
        let out = std::process::Command::new("ip")
            .args(["-4", "-o", "addr", "show", "scope", "global"])
            .output()
            .expect("ip (iproute2)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.split_whitespace()
            .skip_while(|w| *w != "inet")
            .nth(1)
            .and_then(|a| a.split('/').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no global IPv4 address on this machine: {text}"))
    }

    /// A control plane's proxy: the agents' port on loopback, the API server's socket in
    /// `dir`. Returns the port, the socket and the agents.
    async fn proxy(ca: &CertKey, dir: &std::path::Path) -> (SocketAddr, PathBuf, Arc<Agents>) {
        proxy_as(ca, dir, "proxy-0", 1).await
    }

    async fn proxy_as(
        ca: &CertKey,
        dir: &std::path::Path,
        id: &str,
        count: usize,
    ) -> (SocketAddr, PathBuf, Arc<Agents>) {
        let serving = leaf(ca, "kube-apiserver", &[], Usage::Server);
        let tls = server_tls(&serving.cert_pem, &serving.key_pem, &ca.cert_pem).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let agents = Arc::new(Agents::new(vec![]));
        tokio::spawn(serve_agents(
            listener,
            tls,
            agents.clone(),
            Replica {
                id: id.into(),
                count,
            },
        ));
        let sock = dir.join("egress.sock");
        let l = UnixListener::bind(&sock).unwrap();
        tokio::spawn(serve(
            l,
            Arc::new(Cluster::reached(
                None,
                vec![],
                Reach::Agents(agents.clone()),
            )),
        ));
        (addr, sock, agents)
    }

    /// An agent of a node at `node_ip` presenting `cred`, trusting `ca`.
    fn agent(
        dir: &std::path::Path,
        server: SocketAddr,
        ca: &CertKey,
        cred: &CertKey,
        node_ip: Ipv4Addr,
    ) -> tokio::task::JoinHandle<()> {
        let credential = dir.join(format!("cred-{}.pem", rand::random::<u32>()));
        std::fs::write(&credential, format!("{}{}", cred.cert_pem, cred.key_pem)).unwrap();
        tokio::spawn(run_agent(AgentConfig {
            server,
            server_name: "127.0.0.1".into(),
            ca_pem: ca.cert_pem.clone(),
            credential,
            node_ip,
            pod_cidr: None,
            netns: None,
        }))
    }

    async fn ask(sock: &std::path::Path, target: &str) -> (String, UnixStream) {
        let mut c = UnixStream::connect(sock).await.unwrap();
        c.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if !matches!(c.read(&mut b).await, Ok(n) if n > 0) {
                break;
            }
            head.push(b[0]);
        }
        (String::from_utf8_lossy(&head).into_owned(), c)
    }

    async fn wait_for_nodes(agents: &Agents, want: &[&str]) {
        for _ in 0..100 {
            if agents.nodes() == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("nodes waiting: {:?}, want {want:?}", agents.nodes());
    }

    #[test]
    fn only_a_nodes_client_certificate_names_a_node() {
        let ca = generate_ca("c", now()).unwrap();
        let der = |c: &CertKey| {
            CertificateDer::from_pem_slice(c.cert_pem.as_bytes())
                .unwrap()
                .to_vec()
        };
        let node = leaf(
            &ca,
            "system:node:worker-0",
            &["system:nodes"],
            Usage::Client,
        );
        assert_eq!(node_of(&der(&node)).unwrap(), "worker-0");
        for (cn, orgs, usage) in [
            ("kubernetes-admin", &["system:masters"][..], Usage::Client),
            ("system:node:worker-0", &[][..], Usage::Client),
            ("system:node:", &["system:nodes"][..], Usage::Client),
            ("system:node:worker-0", &["system:nodes"][..], Usage::Server),
        ] {
            let c = leaf(&ca, cn, orgs, usage);
            assert!(node_of(&der(&c)).is_err(), "{cn} {orgs:?}");
        }
    }

    #[test]
    fn an_agent_announces_an_address_and_maybe_a_range() {
        assert_eq!(
            parse_hello("NODE 10.0.0.5 10.244.3.0/24"),
            Ok((
                "10.0.0.5".parse().unwrap(),
                Some("10.244.3.0/24".parse().unwrap())
            ))
        );
        assert_eq!(
            parse_hello("NODE 10.0.0.5 -"),
            Ok(("10.0.0.5".parse().unwrap(), None))
        );
        for bad in [
            "",
            "NODE",
            "NODE x -",
            "NODE 10.0.0.5",
            "NODE 10.0.0.5 - x",
            "DIAL 1.2.3.4:5",
            // Not a node's: the whole network, loopback.
            "NODE 10.0.0.5 0.0.0.0/0",
            "NODE 10.0.0.5 10.0.0.0/8",
            "NODE 127.0.0.1 -",
        ] {
            assert!(parse_hello(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_greeting("PROXY trio-apiserver-5d9f-x2 3")
                .unwrap()
                .count,
            3
        );
        for bad in [
            "",
            "PROXY",
            "PROXY a",
            "PROXY a 0",
            "PROXY a b",
            "PROXY a 1 x",
            "NODE a 1",
        ] {
            assert!(parse_greeting(bad).is_err(), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn an_assigned_node_takes_its_block_from_a_node_that_went() {
        let agents =
            Agents::new(vec![]).with_verify(Arc::new(|node: &str, _, _| Ok(node == "new")));
        let ip: Ipv4Addr = "10.201.250.2".parse().unwrap();
        let cidr: Option<Ipv4Net> = Some("10.244.250.0/24".parse().unwrap());
        let (left, _right) = tokio::io::duplex(64);
        agents.push(Waiting {
            node: "old".into(),
            node_ip: ip,
            pod_cidr: cidr,
            stream: Box::new(left),
        });
        // Nobody was given the block: the node that holds it keeps it.
        assert!(agents.may_announce("other", ip, cidr).is_err());
        assert_eq!(agents.nodes(), ["old"]);
        // The node it was given to: the stale connections go.
        assert_eq!(agents.may_announce("new", ip, cidr), Ok(()));
        assert!(agents.nodes().is_empty());
    }

    #[tokio::test]
    async fn a_connect_is_carried_by_an_agent_that_dialled_out() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_ca("cluster-a", now()).unwrap();
        let (server, sock, agents) = proxy(&ca, dir.path()).await;

        // Nothing connected yet: said so.
        let own = own_address();
        let (head, _) = ask(&sock, &format!("{own}:1")).await;
        assert!(
            head.starts_with("HTTP/1.1 503 no node of this cluster is connected"),
            "{head}"
        );

        let echo = TcpListener::bind((own, 0)).await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let cred = leaf(
            &ca,
            "system:node:worker-0",
            &["system:nodes"],
            Usage::Client,
        );
        let _agent = agent(dir.path(), server, &ca, &cred, own);
        wait_for_nodes(&agents, &["worker-0"]).await;

        // More tunnels than connections wait: each one taken is replaced.
        for round in 0..(WAITING * 3) {
            let (head, mut c) = ask(&sock, &echo_addr.to_string()).await;
            assert!(head.starts_with("HTTP/1.1 200 "), "{round}: {head}");
            let msg = format!("ping {round}");
            c.write_all(msg.as_bytes()).await.unwrap();
            let mut got = vec![0u8; msg.len()];
            c.read_exact(&mut got).await.unwrap();
            assert_eq!(got, msg.as_bytes());
            wait_for_nodes(&agents, &["worker-0"]).await;
        }

        // What the agent cannot reach is said by the agent; what is not the cluster's is
        // never asked of it.
        let (head, _) = ask(&sock, &format!("{own}:1")).await;
        assert!(
            head.starts_with("HTTP/1.1 502 node worker-0 connecting to"),
            "{head}"
        );
        wait_for_nodes(&agents, &["worker-0"]).await;
        let (head, _) = ask(&sock, "192.0.2.7:443").await;
        assert!(
            head.starts_with("HTTP/1.1 403 192.0.2.7 is not an address of this cluster's"),
            "{head}"
        );
        let (head, _) = ask(&sock, "127.0.0.1:10250").await;
        assert!(
            head.starts_with("HTTP/1.1 403 127.0.0.1 is a loopback address"),
            "{head}"
        );
    }

    /// A round-robin forwarder on loopback: one address before several proxies, as a
    /// Service before the replicas of an API server.
    async fn balancer(backends: Vec<SocketAddr>) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            for i in 0.. {
                let (mut c, _) = l.accept().await.unwrap();
                let backend = backends[i % backends.len()];
                tokio::spawn(async move {
                    if let Ok(mut b) = TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut b).await;
                    }
                });
            }
        });
        addr
    }

    async fn echo_server(own: Ipv4Addr) -> SocketAddr {
        let echo = TcpListener::bind((own, 0)).await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = echo.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        echo_addr
    }

    #[tokio::test]
    async fn an_agent_waits_at_every_replica_behind_one_address() {
        let dir = tempfile::tempdir().unwrap();
        let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a_dir).unwrap();
        std::fs::create_dir_all(&b_dir).unwrap();
        let ca = generate_ca("cluster-a", now()).unwrap();
        let (a, a_sock, a_agents) = proxy_as(&ca, &a_dir, "apiserver-a", 2).await;
        let (b, b_sock, b_agents) = proxy_as(&ca, &b_dir, "apiserver-b", 2).await;
        // Most connections land on the first replica.
        let front = balancer(vec![a, a, a, b]).await;
        let own = own_address();
        let echo_addr = echo_server(own).await;
        let cred = leaf(
            &ca,
            "system:node:worker-0",
            &["system:nodes"],
            Usage::Client,
        );
        let _agent = agent(dir.path(), front, &ca, &cred, own);
        wait_for_nodes(&a_agents, &["worker-0"]).await;
        wait_for_nodes(&b_agents, &["worker-0"]).await;
        // Both replicas' API servers reach the cluster, again and again.
        for round in 0..3 {
            for sock in [&a_sock, &b_sock] {
                let (head, mut c) = ask(sock, &echo_addr.to_string()).await;
                assert!(head.starts_with("HTTP/1.1 200 "), "{round}: {head}");
                c.write_all(b"ping").await.unwrap();
                let mut got = [0u8; 4];
                c.read_exact(&mut got).await.unwrap();
                assert_eq!(&got, b"ping");
            }
            wait_for_nodes(&a_agents, &["worker-0"]).await;
            wait_for_nodes(&b_agents, &["worker-0"]).await;
        }
    }

    #[tokio::test]
    async fn a_node_that_never_answers_holds_no_request_for_long() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_ca("cluster-a", now()).unwrap();
        let (server, sock, agents) = proxy(&ca, dir.path()).await;
        let own = own_address();
        // A node that takes the DIAL and says nothing (its network drops the packets).
        let cred = leaf(&ca, "system:node:mute", &["system:nodes"], Usage::Client);
        let credential = dir.path().join("mute.pem");
        std::fs::write(&credential, format!("{}{}", cred.cert_pem, cred.key_pem)).unwrap();
        let cfg = AgentConfig {
            server,
            server_name: "127.0.0.1".into(),
            ca_pem: ca.cert_pem.clone(),
            credential,
            node_ip: own,
            pod_cidr: None,
            netns: None,
        };
        let mut conns = Vec::new();
        for _ in 0..DEAD_TRIES + 1 {
            conns.push(cfg.connect_out().await.unwrap());
        }
        wait_for_nodes(&agents, &["mute"]).await;
        let started = std::time::Instant::now();
        let (head, _) = ask(&sock, &format!("{own}:443")).await;
        assert!(
            head.starts_with("HTTP/1.1 504 node mute did not answer"),
            "{head}"
        );
        assert!(started.elapsed() < ANSWER * 2, "{:?}", started.elapsed());
        drop(conns);
    }

    #[tokio::test]
    async fn another_clusters_node_and_a_user_that_is_no_node_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_ca("cluster-a", now()).unwrap();
        let other = generate_ca("cluster-b", now()).unwrap();
        let (server, sock, agents) = proxy(&ca, dir.path()).await;
        let own = own_address();
        // A node of another cluster, trusting this proxy's CA so that only the proxy's check
        // of the client stands between them.
        let foreign = leaf(
            &other,
            "system:node:worker-0",
            &["system:nodes"],
            Usage::Client,
        );
        let _a = agent(dir.path(), server, &ca, &foreign, own);
        // This cluster's admin, whose certificate is no node's.
        let admin = leaf(&ca, "kubernetes-admin", &["system:masters"], Usage::Client);
        let _b = agent(dir.path(), server, &ca, &admin, own);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(agents.nodes().is_empty(), "{:?}", agents.nodes());
        let (head, _) = ask(&sock, &format!("{own}:1")).await;
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");

        // An agent never serves a proxy whose certificate is not of its cluster's CA.
        let other_dir = tempfile::tempdir().unwrap();
        let (other_server, _, other_agents) = proxy(&other, other_dir.path()).await;
        let ours = leaf(
            &ca,
            "system:node:worker-1",
            &["system:nodes"],
            Usage::Client,
        );
        let _c = agent(dir.path(), other_server, &ca, &ours, own);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            other_agents.nodes().is_empty(),
            "{:?}",
            other_agents.nodes()
        );
    }
}
