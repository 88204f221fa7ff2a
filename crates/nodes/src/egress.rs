//! The API server's way into its own cluster's network: what its egress selector sends as
//! `cluster` traffic (kubelets, `pods/proxy` and `services/proxy`, admission and conversion
//! webhooks, aggregated APIs) arrives here as an HTTP `CONNECT` on a Unix socket, and is
//! connected from inside one of that cluster's nodes, as a pod of the node would connect:
//! the node's routes reach its pods and nodes, its kube-proxy turns a Service address into a
//! pod's, and the host's isolation of the cluster's nodes applies. This is konnectivity's
//! shape (the API server asks a proxy; the connection starts on the cluster's side), so the
//! same socket serves nodes that this machine cannot dial, once they carry the connection.
//!
//! Only addresses of the cluster's own nodes, pod ranges and Service ranges are accepted; a
//! cluster with no node on this machine is connected from the host as its control plane's
//! own user, confined as that user's packets are ([`nestplane_runtime::egress`]).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ipnet::Ipv4Net;
use nestplane_runtime::egress::User;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

/// The longest `CONNECT` request head accepted.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client has to send its request, and a connection to be made.
const TIMEOUT: Duration = Duration::from_secs(10);
/// How long one direction of a tunnel may stay open after the other has ended.
const HALF_CLOSED: Duration = Duration::from_secs(30);
/// Tunnels one cluster may have open (or being made) at once: each holds two descriptors of
/// the operator's, which every cluster shares.
pub const MAX_TUNNELS: usize = 512;

/// One node of the cluster on this machine, as the proxy reaches through it.
#[derive(Clone, Debug)]
pub struct Route {
    /// The node's address.
    pub node_ip: Ipv4Addr,
    /// The node's pod range.
    pub pod_cidr: Ipv4Net,
    /// The node's network namespace, held open (never looked up by a path that a later
    /// node may reuse).
    pub netns: Arc<OwnedFd>,
}

/// Where a connection starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Inside the network namespace of this route's node (an index into the routes).
    Node(usize),
    /// On the host, as the control plane's user.
    Host,
}

/// Why `ip` is never a target, whatever a cluster's ranges say (a Service range is the
/// user's choice): not a unicast address of a network, loopback, link-local, the nodes'
/// API address, or the machine's end of a node's link. Pure.
pub fn never(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if o[0] == 0 || ip.is_broadcast() || ip.is_multicast() || o[0] >= 240 {
        Some("not a unicast address")
    } else if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_link_local() {
        Some("a link-local address")
    } else if ip == crate::config::NODE_LOCAL_APISERVER {
        Some("the nodes' API address")
    } else if o[0] == 10 && o[1] == 201 && o[3] == 1 {
        Some("the machine's end of a node's link")
    } else {
        None
    }
}

/// Where a connection to `target` starts, for a cluster whose nodes here are `routes` and
/// whose Service ranges are `services`; `Err` says why it is refused. Pure.
pub fn choose(routes: &[Route], services: &[Ipv4Net], target: Ipv4Addr) -> Result<Via, String> {
    if let Some(why) = never(target) {
        return Err(format!("{target} is {why}"));
    }
    if routes.is_empty() {
        return Ok(Via::Host);
    }
    if let Some(i) = routes
        .iter()
        .position(|r| r.node_ip == target || r.pod_cidr.contains(&target))
    {
        return Ok(Via::Node(i));
    }
    if services.iter().any(|s| s.contains(&target)) {
        // Any node's kube-proxy knows every Service of its cluster.
        return Ok(Via::Node(0));
    }
    Err(format!(
        "{target} is not an address of this cluster's nodes, pods or Services"
    ))
}

/// The IPv4 ranges of a comma-separated Service CIDR list (IPv6 ones are not served). Pure.
pub fn service_ranges(cidrs: &str) -> Vec<Ipv4Net> {
    cidrs
        .split(',')
        .filter_map(|c| c.trim().parse::<Ipv4Net>().ok())
        .map(|n| n.trunc())
        .collect()
}

/// A refused request: its status code and reason.
#[derive(Debug, PartialEq, Eq)]
pub struct Refusal(pub u16, pub String);

/// The target of a `CONNECT` request head (`CONNECT 10.244.1.5:443 HTTP/1.1`, then headers).
/// Only an IPv4 address and port: the API server resolves names itself. Pure.
pub fn parse_connect(head: &str) -> Result<SocketAddrV4, Refusal> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Refusal(400, "malformed request line".into()));
    };
    if method != "CONNECT" {
        return Err(Refusal(405, "only CONNECT is served".into()));
    }
    if !version.starts_with("HTTP/1.") {
        return Err(Refusal(400, "HTTP/1 only".into()));
    }
    target
        .parse::<SocketAddrV4>()
        .map_err(|_| Refusal(400, "the target must be an IPv4 address and port".into()))
}

/// How the proxy reaches a cluster's network.
pub enum Reach {
    /// Through its nodes on this machine, read at each connection (none: from the host).
    Local(Box<dyn Fn() -> Vec<Route> + Send + Sync>),
    /// Through the agents its nodes connect ([`crate::tunnel`]), wherever they are.
    Agents(Arc<crate::tunnel::Agents>),
}

/// What the proxy knows of one cluster; every listener of the cluster shares it.
pub struct Cluster {
    /// Its control plane's user: the only peer served, and the identity of connections
    /// made from the host. `None` where this machine has no tenant users.
    pub user: Option<User>,
    /// Its Service ranges (updated in place when they change).
    pub services: RwLock<Vec<Ipv4Net>>,
    /// How its network is reached.
    pub reach: Reach,
    /// The agents of its nodes on other machines ([`crate::entry`]), beside those reached
    /// [`Reach::Local`]ly: a target one of them holds is reached through it.
    pub remote: Option<Arc<crate::tunnel::Agents>>,
    /// Its open tunnels ([`MAX_TUNNELS`]).
    pub tunnels: Arc<Semaphore>,
    /// When a connection beyond the limit was last logged.
    full_warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Cluster {
    fn warn_full(&self) {
        let mut last = self.full_warned.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            *last = Some(std::time::Instant::now());
            tracing::warn!(
                max = MAX_TUNNELS,
                "an API server has the most egress tunnels it may have; more are refused"
            );
        }
    }

    /// A cluster of `user`, with `services`, whose nodes here `routes` reads.
    pub fn new(
        user: Option<User>,
        services: Vec<Ipv4Net>,
        routes: Box<dyn Fn() -> Vec<Route> + Send + Sync>,
    ) -> Cluster {
        Cluster::reached(user, services, Reach::Local(routes))
    }

    /// This cluster with nodes on other machines too, whose agents wait in `agents`.
    pub fn with_remote(mut self, agents: Arc<crate::tunnel::Agents>) -> Cluster {
        self.remote = Some(agents);
        self
    }

    /// A cluster of `user`, with `services`, reached by `reach`.
    pub fn reached(user: Option<User>, services: Vec<Ipv4Net>, reach: Reach) -> Cluster {
        Cluster {
            user,
            services: RwLock::new(services),
            reach,
            remote: None,
            tunnels: Arc::new(Semaphore::new(MAX_TUNNELS)),
            full_warned: Default::default(),
        }
    }
}

/// Serve `listener` for `cluster` until this future is dropped (its task aborted), which
/// ends every tunnel it opened too. A connection beyond [`MAX_TUNNELS`] is closed at once.
pub async fn serve(listener: UnixListener, cluster: Arc<Cluster>) {
    let mut tunnels = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                if let Some(u) = cluster.user {
                    // The socket is the user's alone already; its peer is checked all the same.
                    match stream.peer_cred() {
                        Ok(c) if c.uid() == u.uid => {}
                        _ => continue,
                    }
                }
                let Ok(permit) = cluster.tunnels.clone().try_acquire_owned() else {
                    // Said to the API server (its error names it) and, at most once a
                    // minute, in the log; the answer waits for nothing.
                    let _ = stream
                        .try_write(b"HTTP/1.1 503 too many tunnels\r\nContent-Length: 0\r\n\r\n");
                    cluster.warn_full();
                    continue;
                };
                let cluster = cluster.clone();
                tunnels.spawn(async move {
                    let _permit = permit;
                    if let Err(e) = handle(stream, &cluster).await {
                        tracing::debug!(error = %e, "an egress connection ended");
                    }
                });
            }
            Some(_) = tunnels.join_next(), if !tunnels.is_empty() => {}
        }
    }
}

async fn read_head(stream: &mut UnixStream) -> std::io::Result<(String, Vec<u8>)> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((String::from_utf8_lossy(&buf).into_owned(), rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too long"));
        }
    }
}

async fn refuse(stream: &mut UnixStream, r: &Refusal) -> std::io::Result<()> {
    let reason: String = r.1.chars().filter(|c| !c.is_control()).collect();
    stream
        .write_all(format!("HTTP/1.1 {} {reason}\r\nContent-Length: 0\r\n\r\n", r.0).as_bytes())
        .await
}

async fn dial(
    cluster: &Cluster,
    target: SocketAddrV4,
) -> Result<Box<dyn crate::tunnel::Stream>, Refusal> {
    let routes = match &cluster.reach {
        Reach::Local(routes) => routes(),
        Reach::Agents(agents) => return agents.dial(target).await,
    };
    let services = cluster
        .services
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    // A node on another machine, or its pods; or a Service of a cluster whose nodes are all
    // elsewhere: through an agent. The nodes here first: what they hold is theirs.
    let local = routes
        .iter()
        .any(|r| r.node_ip == *target.ip() || r.pod_cidr.contains(target.ip()));
    if let Some(agents) = &cluster.remote
        && !local
        && (agents.holds(*target.ip())
            || (routes.is_empty()
                && !agents.is_empty()
                && services.iter().any(|s| s.contains(target.ip()))))
    {
        return agents.dial(target).await;
    }
    let via = choose(&routes, &services, *target.ip()).map_err(|reason| Refusal(403, reason))?;
    let addr = SocketAddr::V4(target);
    let made = match via {
        Via::Node(i) => crate::net::connect_in_netns(routes[i].netns.clone(), addr, TIMEOUT).await,
        Via::Host => nestplane_runtime::egress::connect_as(cluster.user, addr, TIMEOUT).await,
    };
    made.map(|s| Box::new(s) as Box<dyn crate::tunnel::Stream>)
        .map_err(|e| Refusal(502, format!("connecting to {target}: {e}")))
}

/// Carry bytes both ways until both ends are done; once one direction has ended, the other
/// gets [`HALF_CLOSED`] to finish (a peer that never closes holds nothing for long).
pub(crate) async fn carry<A, B>(a: A, b: B)
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let up = async {
        let _ = tokio::io::copy(&mut ar, &mut bw).await;
        let _ = bw.shutdown().await;
    };
    let down = async {
        let _ = tokio::io::copy(&mut br, &mut aw).await;
        let _ = aw.shutdown().await;
    };
    tokio::pin!(up, down);
    tokio::select! {
        _ = &mut up => { let _ = tokio::time::timeout(HALF_CLOSED, down).await; }
        _ = &mut down => { let _ = tokio::time::timeout(HALF_CLOSED, up).await; }
    }
}

async fn handle(mut stream: UnixStream, cluster: &Cluster) -> std::io::Result<()> {
    let (head, early) = tokio::time::timeout(TIMEOUT, read_head(&mut stream))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let target = match parse_connect(&head) {
        Ok(t) => t,
        Err(r) => return refuse(&mut stream, &r).await,
    };
    let mut upstream = match dial(cluster, target).await {
        Ok(s) => s,
        Err(r) => {
            tracing::debug!(%target, status = r.0, reason = %r.1, "egress refused");
            return refuse(&mut stream, &r).await;
        }
    };
    stream
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    if !early.is_empty() {
        upstream.write_all(&early).await?;
    }
    carry(stream, upstream).await;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn route(slot: u8) -> Route {
        Route {
            node_ip: Ipv4Addr::new(10, 201, slot, 2),
            pod_cidr: format!("10.244.{slot}.0/24").parse().unwrap(),
            netns: Arc::new(std::fs::File::open("/dev/null").unwrap().into()),
        }
    }

    #[test]
    fn a_connection_starts_in_the_node_that_holds_its_target() {
        let routes = [route(3), route(7)];
        let services: Vec<Ipv4Net> = vec!["10.96.0.0/12".parse().unwrap()];
        let node = |i: usize| Ok(Via::Node(i));
        assert_eq!(
            choose(&routes, &services, "10.201.7.2".parse().unwrap()),
            node(1)
        );
        assert_eq!(
            choose(&routes, &services, "10.244.7.9".parse().unwrap()),
            node(1)
        );
        assert_eq!(
            choose(&routes, &services, "10.244.3.9".parse().unwrap()),
            node(0)
        );
        assert_eq!(
            choose(&routes, &services, "10.96.0.10".parse().unwrap()),
            node(0)
        );
    }

    #[test]
    fn anything_else_is_refused_and_no_node_means_the_host() {
        let routes = [route(3)];
        let services: Vec<Ipv4Net> = vec!["10.96.0.0/12".parse().unwrap()];
        for other in [
            "10.244.4.9",  // another node's pods (another cluster's)
            "10.201.4.2",  // another node
            "10.201.3.1",  // the host's end of this node's link
            "127.0.0.1",   // loopback
            "192.168.1.1", // beyond
        ] {
            let r = choose(&routes, &services, other.parse().unwrap());
            assert!(r.is_err(), "{other}: {r:?}");
        }
        assert_eq!(
            choose(&[], &services, "10.244.4.9".parse().unwrap()),
            Ok(Via::Host)
        );
        // Whatever the ranges say, with nodes or without.
        let wide: Vec<Ipv4Net> = vec!["0.0.0.0/0".parse().unwrap()];
        for never in [
            "127.0.0.1",
            "0.0.0.0",
            "169.254.169.254",
            "224.0.0.1",
            "255.255.255.255",
            "172.20.0.1",
            "10.201.3.1",
        ] {
            let ip = never.parse().unwrap();
            assert!(choose(&routes, &wide, ip).is_err(), "{never}");
            assert!(choose(&[], &wide, ip).is_err(), "{never}");
        }
    }

    #[test]
    fn only_connect_to_an_ipv4_address_and_port() {
        assert_eq!(
            parse_connect("CONNECT 10.244.1.5:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
            Ok("10.244.1.5:443".parse().unwrap())
        );
        for bad in [
            "GET / HTTP/1.1\r\n\r\n",
            "CONNECT example.com:443 HTTP/1.1\r\n\r\n",
            "CONNECT [::1]:443 HTTP/1.1\r\n\r\n",
            "CONNECT 10.244.1.5 HTTP/1.1\r\n\r\n",
            "CONNECT 10.244.1.5:443 HTTP/1.1 extra\r\n\r\n",
            "CONNECT 10.244.1.5:443 SPDY/3\r\n\r\n",
            "",
        ] {
            assert!(parse_connect(bad).is_err(), "{bad:?}");
        }
    }

    async fn ask(sock: &std::path::Path, target: &str) -> (String, UnixStream) {
        let mut c = UnixStream::connect(sock).await.unwrap();
        // (A server that closes at once may already have gone.)
        let _ = c
            .write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await;
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            // A connection closed (or reset) ends the answer.
            if !matches!(c.read(&mut b).await, Ok(n) if n > 0) {
                break;
            }
            head.push(b[0]);
        }
        (String::from_utf8_lossy(&head).into_owned(), c)
    }

    #[tokio::test]
    async fn a_connect_is_answered_and_carried_or_refused_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        // An address of this machine's own that is not loopback (which is never a target).
        let out = std::process::Command::new("ip")
            .args(["-4", "-o", "addr", "show", "scope", "global"])
            .output()
            .expect("ip (iproute2)");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let own: Ipv4Addr = text
            .split_whitespace()
            .skip_while(|w| *w != "inet")
            .nth(1)
            .and_then(|a| a.split('/').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no global IPv4 address on this machine: {text}"));
        let echo = tokio::net::TcpListener::bind((own, 0)).await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = echo.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
        // No node here: connected from the host (as this process: no tenant user).
        let open = dir.path().join("open.sock");
        let l = UnixListener::bind(&open).unwrap();
        tokio::spawn(serve(
            l,
            Arc::new(Cluster::new(None, vec![], Box::new(Vec::new))),
        ));
        let (head, mut c) = ask(&open, &echo_addr.to_string()).await;
        assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
        c.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        // A cluster with nodes: what is not its own is refused, with the reason.
        let closed = dir.path().join("closed.sock");
        let l = UnixListener::bind(&closed).unwrap();
        tokio::spawn(serve(
            l,
            Arc::new(Cluster::new(
                None,
                vec!["10.96.0.0/12".parse().unwrap()],
                Box::new(|| vec![route(3)]),
            )),
        ));
        let (head, _) = ask(&closed, &echo_addr.to_string()).await;
        assert!(
            head.starts_with(&format!(
                "HTTP/1.1 403 {own} is not an address of this cluster's"
            )),
            "{head}"
        );
        let (head, _) = ask(&closed, "example.com:443").await;
        assert!(head.starts_with("HTTP/1.1 400 "), "{head}");
        let (head, _) = ask(&closed, "127.0.0.1:10248").await;
        assert!(
            head.starts_with("HTTP/1.1 403 127.0.0.1 is a loopback address"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn a_peer_of_another_uid_gets_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("other.sock");
        let l = UnixListener::bind(&sock).unwrap();
        // Served for a user that is not this process's.
        let me = rustix::process::geteuid().as_raw();
        let other = User {
            uid: me.wrapping_add(4242),
            gid: me.wrapping_add(4242),
        };
        tokio::spawn(serve(
            l,
            Arc::new(Cluster::new(Some(other), vec![], Box::new(Vec::new))),
        ));
        let (head, _) = ask(&sock, "10.244.3.9:443").await;
        assert_eq!(head, "", "closed without an answer");
    }
}
