//! A control plane's door for nodes on other machines: one TLS name (`nodes.<tenant's
//! gateway name>`, [`server_name`]) behind the shared gateway, which routes it here by its
//! server name like any tenant's. Two kinds of connection come in:
//!
//! - **API traffic** of a node: its kubelet, kube-proxy and pods speak TLS to their API server
//!   without a server name (a kubelet of 1.20 keeps none in the kubeconfig it writes, and
//!   in-cluster clients dial an address), which the gateway could not route. The node's
//!   local proxy ([`crate::node`]) wraps each of their connections in a TLS connection to
//!   this door, checked against the cluster CA; here the wrapping ends and the bytes inside,
//!   still the client's own TLS to the API server, go to one of its replicas. Nothing here
//!   reads them: the API server authenticates the client as before.
//! - **Tunnel agents** ([`crate::tunnel`]) of those nodes, which begin with the `NODE` line and
//!   must present a node's client certificate of the cluster's CA: they wait here for the
//!   API server's connections into the cluster.
//!
//! The door serves a certificate of the cluster's CA for its name, with the CA after it: a
//! machine that joins checks the CA against the hash it was given (`--ca-cert-hash`), as
//! `kubeadm join` does, before it trusts anything else ([`discover`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::tunnel::{self, Agents, Replica, Stream};

/// The door's server name for a tenant whose gateway name is `gateway_name`.
pub fn server_name(gateway_name: &str) -> String {
    format!("nodes.{gateway_name}")
}

/// API connections carried at once.
pub const MAX_CARRIED: usize = 2048;

/// How long connecting to one API server replica may take before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The replicas API traffic goes to, read at each connection.
pub type Backends = Arc<dyn Fn() -> Vec<SocketAddr> + Send + Sync>;

/// The door's TLS: `chain_pem` (its certificate, then the CA) and `key_pem` served; a client
/// certificate of `client_ca_pem` is asked for but not required (API traffic comes without
/// one; an agent without one is refused when it says `NODE`).
pub fn server_tls(
    chain_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
) -> Result<tokio_rustls::TlsAcceptor, String> {
    tunnel::acceptor(chain_pem, key_pem, client_ca_pem, false)
}

/// Serve the door on `listener` until this future is dropped.
pub async fn serve(
    listener: TcpListener,
    tls: tokio_rustls::TlsAcceptor,
    agents: Arc<Agents>,
    replica: Replica,
    backends: Backends,
) {
    let welcoming = Arc::new(tokio::sync::Semaphore::new(tunnel::MAX_WELCOMING));
    let carried = Arc::new(tokio::sync::Semaphore::new(MAX_CARRIED));
    let replica = Arc::new(replica);
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (tcp, peer, permit) = tunnel::next_welcomed(&listener, &welcoming).await;
        let (tls, agents, replica, backends, carried, next) = (
            tls.clone(),
            agents.clone(),
            replica.clone(),
            backends.clone(),
            carried.clone(),
            next.clone(),
        );
        tokio::spawn(async move {
            let r = one(
                tcp, tls, &agents, &replica, &backends, permit, &carried, &next,
            )
            .await;
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "a connection at the nodes' door is refused");
            }
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn one(
    tcp: TcpStream,
    tls: tokio_rustls::TlsAcceptor,
    agents: &Agents,
    replica: &Replica,
    backends: &Backends,
    permit: tokio::sync::OwnedSemaphorePermit,
    carried: &Arc<tokio::sync::Semaphore>,
    next: &AtomicUsize,
) -> Result<(), String> {
    let _ = tcp.set_nodelay(true);
    tunnel::keepalive(&tcp);
    let stream = tokio::time::timeout(tunnel::TIMEOUT, tls.accept(tcp))
        .await
        .map_err(|_| "TLS handshake timed out".to_string())?
        .map_err(|e| format!("TLS: {e}"))?;
    let der = tunnel::peer_certificate(&stream).ok();
    let mut s = BufReader::with_capacity(tunnel::BUFFER, Box::new(stream) as Box<dyn Stream>);
    let first = tokio::time::timeout(tunnel::TIMEOUT, s.fill_buf())
        .await
        .map_err(|_| "nothing said in time".to_string())?
        .map_err(|e| e.to_string())?;
    if first.is_empty() {
        return Err("closed before a word".into());
    }
    if first.starts_with(b"NODE ") {
        let der = der.ok_or("an agent without a client certificate")?;
        return tunnel::admit(s, &der, agents, replica, permit).await;
    }
    // API traffic: the client's own TLS to its API server, carried to a replica.
    drop(permit);
    let Ok(_carrying) = carried.clone().try_acquire_owned() else {
        return Err(format!("{MAX_CARRIED} connections carried already"));
    };
    let replicas = backends();
    if replicas.is_empty() {
        return Err("no API server replica to carry to".into());
    }
    let start = next.fetch_add(1, Ordering::Relaxed);
    for i in 0..replicas.len() {
        let to = replicas[(start + i) % replicas.len()];
        let Ok(Ok(mut up)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to)).await
        else {
            continue;
        };
        let _ = up.set_nodelay(true);
        let buffered = s.buffer().to_vec();
        up.write_all(&buffered).await.map_err(|e| e.to_string())?;
        let n = buffered.len();
        s.consume(n);
        crate::egress::carry(s, up).await;
        return Ok(());
    }
    Err(format!("no API server replica answered ({replicas:?})"))
}

/// What a joining machine learns from the door before it trusts it: the cluster CA (PEM),
/// the one certificate the door sends after its own whose public key has the hash `pin`, and
/// which signed the door's certificate for `name`. Connects to `server` with TLS, trusting
/// nothing yet; then checks the door's certificate against the CA so found.
pub async fn discover(server: SocketAddr, name: &str, pin: &str) -> Result<String, String> {
    let pin = pin.trim().to_ascii_lowercase();
    if !pin.starts_with("sha256:") || pin.len() != 7 + 64 {
        return Err(format!(
            "--ca-cert-hash must be sha256:<64 hex digits>, not {pin:?}"
        ));
    }
    let seen = Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let config = rustls::ClientConfig::builder_with_provider(tunnel::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Recorder(seen.clone())))
        .with_no_client_auth();
    let sn = ServerName::try_from(name.to_string()).map_err(|e| format!("{name:?}: {e}"))?;
    let tcp = tokio::time::timeout(tunnel::TIMEOUT, TcpStream::connect(server))
        .await
        .map_err(|_| format!("connecting to {server}: timed out"))?
        .map_err(|e| format!("connecting to {server}: {e}"))?;
    let mut s = tokio::time::timeout(
        tunnel::TIMEOUT,
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(sn, tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS with {server}: {e}"))?;
    let _ = s.shutdown().await;
    let chain = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some((leaf, rest)) = chain.split_first() else {
        return Err(format!("{server} sent no certificate"));
    };
    let mut ca = None;
    for der in rest {
        if nestplane_pki::public_key_hash_der(der).map_err(|e| e.to_string())? == pin {
            ca = Some(der.clone());
        }
    }
    let ca = ca.ok_or_else(|| {
        format!("{server} ({name}) sent no CA whose public key has the hash {pin}: not the cluster that was meant")
    })?;
    let ca_pem = nestplane_pki::certificate_pem(&ca);
    let leaf_pem = nestplane_pki::certificate_pem(leaf);
    if !nestplane_pki::verify_signed_by_any(&leaf_pem, &ca_pem) {
        return Err(format!(
            "{server}'s certificate is not signed by the pinned CA"
        ));
    }
    // The name too, as any client of the door checks it from now on.
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(tunnel::roots(&ca_pem)?),
        tunnel::provider(),
    )
    .build()
    .map_err(|e| e.to_string())?;
    use rustls::client::danger::ServerCertVerifier as _;
    verifier
        .verify_server_cert(
            &CertificateDer::from(leaf.clone()),
            &[],
            &ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?,
            &[],
            rustls::pki_types::UnixTime::now(),
        )
        .map_err(|e| format!("{server}'s certificate for {name}: {e}"))?;
    Ok(ca_pem)
}

/// Accepts any chain and keeps it (discovery only: nothing is sent over that connection).
#[derive(Debug)]
struct Recorder(Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

impl rustls::client::danger::ServerCertVerifier for Recorder {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *seen = std::iter::once(end_entity.as_ref().to_vec())
            .chain(intermediates.iter().map(|c| c.as_ref().to_vec()))
            .collect();
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &tunnel::provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &tunnel::provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        tunnel::provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The client side of the door for a node's local API proxy: TLS to `name`, checked against
/// `ca_pem`.
pub fn client_tls(ca_pem: &str) -> Result<tokio_rustls::TlsConnector, String> {
    let config = rustls::ClientConfig::builder_with_provider(tunnel::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(tunnel::roots(ca_pem)?)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use nestplane_pki::{CertKey, LeafSpec, Usage, generate_ca, issue};
    use tokio::io::AsyncReadExt;

    const NAME: &str = "nodes.demo.default.nestplane.internal";

    fn now() -> time::OffsetDateTime {
        time::OffsetDateTime::now_utc()
    }

    fn leaf(ca: &CertKey, cn: &str, orgs: &[&str], dns: &[&str], usage: Usage) -> CertKey {
        issue(
            ca,
            &LeafSpec {
                common_name: cn.into(),
                organizations: orgs.iter().map(|o| o.to_string()).collect(),
                dns_names: dns.iter().map(|d| d.to_string()).collect(),
                ips: vec![],
                usage,
            },
            now(),
        )
        .unwrap()
    }

    /// A backend that answers each connection with what it read, upper-cased.
    async fn backend() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    let n = s.read(&mut buf).await.unwrap();
                    s.write_all(&buf[..n].to_ascii_uppercase()).await.unwrap();
                });
            }
        });
        addr
    }

    /// A door of the cluster `ca` in front of `backends`; returns its address and agents.
    async fn door(ca: &CertKey, backends: Vec<SocketAddr>) -> (SocketAddr, Arc<Agents>) {
        let serving = leaf(ca, "kube-apiserver", &[], &[NAME], Usage::Server);
        let chain = format!("{}{}", serving.cert_pem, ca.cert_pem);
        let tls = server_tls(&chain, &serving.key_pem, &ca.cert_pem).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let agents = Arc::new(Agents::new(vec![]));
        tokio::spawn(serve(
            l,
            tls,
            agents.clone(),
            Replica {
                id: "operator".into(),
                count: 1,
            },
            Arc::new(move || backends.clone()),
        ));
        (addr, agents)
    }

    async fn wrapped(addr: SocketAddr, tls: tokio_rustls::TlsConnector) -> impl Stream {
        let tcp = TcpStream::connect(addr).await.unwrap();
        tls.connect(ServerName::try_from(NAME).unwrap(), tcp)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn api_traffic_is_carried_to_a_replica_inside_the_doors_tls() {
        let ca = generate_ca("kubernetes", now()).unwrap();
        let dead = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let (addr, _) = door(&ca, vec![dead, backend().await]).await;
        for _ in 0..3 {
            // A replica that refuses is passed by.
            let mut s = wrapped(addr, client_tls(&ca.cert_pem).unwrap()).await;
            s.write_all(b"\x16hello").await.unwrap();
            let mut out = vec![0u8; 6];
            s.read_exact(&mut out).await.unwrap();
            assert_eq!(&out, b"\x16HELLO");
        }
        // Another cluster's CA does not trust the door.
        let other = generate_ca("kubernetes", now()).unwrap();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let r = client_tls(&other.cert_pem)
            .unwrap()
            .connect(ServerName::try_from(NAME).unwrap(), tcp)
            .await;
        assert!(r.is_err(), "a door of another CA is not trusted");
    }

    #[tokio::test]
    async fn only_a_node_of_the_cluster_waits_as_an_agent() {
        let ca = generate_ca("kubernetes", now()).unwrap();
        let (addr, agents) = door(&ca, vec![]).await;
        // No client certificate: refused at its NODE line.
        let mut s = wrapped(addr, client_tls(&ca.cert_pem).unwrap()).await;
        s.write_all(b"NODE 10.201.1.2 10.244.1.0/24\n")
            .await
            .unwrap();
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "closed without a greeting");
        // A node's certificate of another cluster: refused in the handshake.
        let other = generate_ca("kubernetes", now()).unwrap();
        let stranger = leaf(
            &other,
            "system:node:w1",
            &["system:nodes"],
            &[],
            Usage::Client,
        );
        let conn = |cred: &CertKey| {
            let (certs, key) = tunnel::cert_and_key(&cred.cert_pem, &cred.key_pem).unwrap();
            let config = rustls::ClientConfig::builder_with_provider(tunnel::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(tunnel::roots(&ca.cert_pem).unwrap())
                .with_client_auth_cert(certs, key)
                .unwrap();
            tokio_rustls::TlsConnector::from(Arc::new(config))
        };
        let mut s = wrapped(addr, conn(&stranger)).await;
        let _ = s.write_all(b"NODE 10.201.1.2 -\n").await;
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0);
        assert!(agents.nodes().is_empty());
        // The cluster's own node: greeted, and waits.
        let node = leaf(&ca, "system:node:w1", &["system:nodes"], &[], Usage::Client);
        let mut s = wrapped(addr, conn(&node)).await;
        s.write_all(b"NODE 10.201.1.2 10.244.1.0/24\n")
            .await
            .unwrap();
        let mut line = vec![0u8; 17];
        s.read_exact(&mut line).await.unwrap();
        assert_eq!(&line, b"PROXY operator 1\n");
        assert_eq!(agents.nodes(), vec!["w1".to_string()]);
        assert!(agents.holds("10.244.1.7".parse().unwrap()));
        assert!(!agents.holds("10.244.2.7".parse().unwrap()));
        // Another node of the cluster cannot take w1's addresses (nor a network's worth).
        let w2 = leaf(&ca, "system:node:w2", &["system:nodes"], &[], Usage::Client);
        for claim in [
            "NODE 10.201.1.2 10.244.9.0/24
",
            "NODE 10.201.9.2 10.244.1.0/24
",
            "NODE 10.201.9.2 10.244.0.0/16
",
        ] {
            let mut s = wrapped(addr, conn(&w2)).await;
            s.write_all(claim.as_bytes()).await.unwrap();
            let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap()
                .unwrap_or(0);
            assert_eq!(n, 0, "{claim}");
        }
        assert_eq!(agents.nodes(), vec!["w1".to_string()]);
    }

    #[tokio::test]
    async fn a_joining_machine_trusts_only_the_pinned_ca() {
        let ca = generate_ca("kubernetes", now()).unwrap();
        let (addr, _) = door(&ca, vec![]).await;
        let pin = nestplane_pki::public_key_hash(&ca.cert_pem).unwrap();
        let found = discover(addr, NAME, &pin).await.unwrap();
        assert_eq!(
            nestplane_pki::certificate_der(&found).unwrap(),
            nestplane_pki::certificate_der(&ca.cert_pem).unwrap()
        );
        let other = generate_ca("kubernetes", now()).unwrap();
        let wrong = nestplane_pki::public_key_hash(&other.cert_pem).unwrap();
        let e = discover(addr, NAME, &wrong).await.unwrap_err();
        assert!(e.contains("no CA whose public key"), "{e}");
        // The right CA, but the door is asked for a name its certificate does not have.
        let e = discover(addr, "nodes.other.default.nestplane.internal", &pin)
            .await
            .unwrap_err();
        assert!(e.contains("certificate for"), "{e}");
        let e = discover(addr, NAME, "sha256:abc").await.unwrap_err();
        assert!(e.contains("64 hex digits"), "{e}");
    }
}
