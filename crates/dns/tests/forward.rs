//! Names outside the cluster's zone, forwarded to a real resolver on loopback (dnsmasq): an
//! answer larger than 512 bytes reaches the client whole, over UDP when the client sends EDNS,
//! else truncated with TC set and whole over TCP; one too large for UDP at all (which the
//! upstream also truncates: the forwarder asks it again over TCP) comes whole over TCP;
//! answers are cached for their TTL (at most 30 s); a name the upstream does not know is
//! NXDOMAIN, not a server failure.
#![allow(clippy::unwrap_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use k8s_openapi::api::core::v1::{Endpoints, Service};
use nestplane_dns::records::View;
use nestplane_dns::server::{Handler, Metrics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A cluster with no Services: every name here is outside the zone.
struct Nothing;

impl View for Nothing {
    fn service(&self, _: &str, _: &str) -> Option<Arc<Service>> {
        None
    }
    fn endpoints(&self, _: &str, _: &str) -> Option<Arc<Endpoints>> {
        None
    }
    fn all_services(&self) -> Vec<Arc<Service>> {
        vec![]
    }
    fn all_endpoints(&self) -> Vec<Arc<Endpoints>> {
        vec![]
    }
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    // A port free for both UDP and TCP on loopback.
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// dnsmasq on `127.0.0.1:port` answering `big.test` with 40 addresses and `huge.test` with
/// 120 (TTL 60 s), and NXDOMAIN for other names under `test`.
fn upstream(dir: &std::path::Path, port: u16) -> KillOnDrop {
    let hosts = dir.join("hosts");
    let mut lines: String = (1..=40)
        .map(|i| format!("10.77.0.{i} big.test\n"))
        .collect();
    lines.extend((1..=120).map(|i| format!("10.78.0.{i} huge.test\n")));
    std::fs::write(&hosts, lines).unwrap();
    // dnsmasq reads the file as the unprivileged user it switches to.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&hosts, std::fs::Permissions::from_mode(0o644)).unwrap();
    let child = Command::new("dnsmasq")
        .args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--conf-file=/dev/null",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            "--local=/test/",
            "--local-ttl=60",
        ])
        .arg(format!("--port={port}"))
        .arg(format!("--addn-hosts={}", hosts.display()))
        .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()))
        .spawn()
        .expect("dnsmasq not found: run scripts/install-deps.sh (Debian package dnsmasq-base)");
    KillOnDrop(child)
}

fn query(name: &str, edns: bool) -> Vec<u8> {
    let mut m = Message::query();
    m.add_query(hickory_proto::op::Query::query(
        Name::from_str(name).unwrap(),
        RecordType::A,
    ));
    m.metadata.recursion_desired = true;
    if edns {
        let mut e = Edns::new();
        e.set_max_payload(4096);
        m.set_edns(e);
    }
    m.to_vec().unwrap()
}

async fn over_udp(server: SocketAddr, name: &str, edns: bool) -> (Message, usize) {
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.send_to(&query(name, edns), server).await.unwrap();
    let mut buf = vec![0u8; 65535];
    let (n, _) = tokio::time::timeout(Duration::from_secs(10), sock.recv_from(&mut buf))
        .await
        .expect("an answer over UDP within 10 s")
        .unwrap();
    (Message::from_vec(&buf[..n]).unwrap(), n)
}

async fn over_tcp(server: SocketAddr, name: &str) -> Message {
    let mut s = tokio::net::TcpStream::connect(server).await.unwrap();
    let q = query(name, false);
    s.write_all(&(q.len() as u16).to_be_bytes()).await.unwrap();
    s.write_all(&q).await.unwrap();
    let mut len = [0u8; 2];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut len))
        .await
        .expect("an answer over TCP within 10 s")
        .unwrap();
    let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).await.unwrap();
    Message::from_vec(&buf).unwrap()
}

fn addresses(m: &Message) -> Vec<Ipv4Addr> {
    let mut out: Vec<Ipv4Addr> = m
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn answers_larger_than_512_bytes_from_upstream_arrive_whole() {
    let dir = tempfile::tempdir().unwrap();
    let upstream_port = free_port();
    let mut resolver = Some(upstream(dir.path(), upstream_port));
    let want: Vec<Ipv4Addr> = (1..=40).map(|i| Ipv4Addr::new(10, 77, 0, i)).collect();

    let metrics = Arc::new(Metrics::default());
    let handler = Handler::new(
        Nothing,
        "cluster.local",
        vec![SocketAddr::from(([127, 0, 0, 1], upstream_port))],
        metrics.clone(),
    )
    .unwrap();
    let port = free_port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut server = hickory_server::Server::new(handler);
    server.register_socket(tokio::net::UdpSocket::bind(addr).await.unwrap());
    server.register_listener(
        tokio::net::TcpListener::bind(addr).await.unwrap(),
        Duration::from_secs(5),
        16,
    );

    // dnsmasq takes a moment to listen: ask until it answers.
    let mut first = None;
    for _ in 0..50 {
        let (m, _) = over_udp(addr, "big.test.", true).await;
        if m.metadata.response_code == ResponseCode::NoError && !m.answers.is_empty() {
            first = Some(m);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = first.expect("big.test answered through the forwarder");

    // With EDNS the whole answer comes over UDP.
    assert!(!first.metadata.truncation, "{first:?}");
    assert_eq!(addresses(&first), want);
    let (m, size) = over_udp(addr, "big.test.", true).await;
    assert!(size > 512, "the answer is {size} bytes");
    assert_eq!(addresses(&m), want);

    // Without EDNS the client is told the answer was cut (TC), and TCP gives all of it.
    let (cut, size) = over_udp(addr, "big.test.", false).await;
    assert!(size <= 512, "a UDP answer without EDNS is {size} bytes");
    assert!(
        cut.metadata.truncation,
        "TC is set on a cut answer: {cut:?}"
    );
    let whole = over_tcp(addr, "big.test.").await;
    assert!(!whole.metadata.truncation);
    assert_eq!(addresses(&whole), want);

    // 120 addresses are more than UDP carries (1232 bytes at most, whatever the client's EDNS
    // says): the upstream cut them too, and the forwarder asked it again over TCP.
    let huge: Vec<Ipv4Addr> = (1..=120).map(|i| Ipv4Addr::new(10, 78, 0, i)).collect();
    let (cut, size) = over_udp(addr, "huge.test.", true).await;
    assert!(size <= 1232, "a UDP answer is {size} bytes");
    assert!(
        cut.metadata.truncation,
        "TC is set on a cut answer: {cut:?}"
    );
    let whole = over_tcp(addr, "huge.test.").await;
    assert_eq!(addresses(&whole), huge);

    // A name the upstream does not know does not exist; it is not a server failure.
    let (m, _) = over_udp(addr, "nothing-here.test.", true).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain, "{m:?}");

    // Answers are kept for the TTL they carry (at most 30 s): with the upstream gone, big.test
    // still resolves, and its TTL counts down.
    drop(resolver.take());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (m, _) = over_udp(addr, "big.test.", true).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{m:?}");
    assert_eq!(addresses(&m), want);
    let ttl = m.answers[0].ttl;
    assert!(
        ttl > 0 && ttl < 30,
        "the cached answer's TTL counts down: {ttl}"
    );

    let text = metrics.render();
    for series in [
        "nestplane_dns_forwarded_total{outcome=\"answered\"}",
        "nestplane_dns_forwarded_total{outcome=\"negative\"} 1",
        "nestplane_dns_queries_total{type=\"a\",rcode=\"NXDOMAIN\"} 1",
    ] {
        assert!(text.contains(series), "{series} in\n{text}");
    }
}
