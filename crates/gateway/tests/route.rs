//! The router against real TLS: servers with their own certificates behind one listener,
//! clients that verify them by name.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use nestplane_gateway::Routes;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A TLS acceptor with a self-signed certificate for `name`; the certificate.
fn acceptor(name: &str) -> (tokio_rustls::TlsAcceptor, CertificateDer<'static>) {
    let ck = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), cert)
}

/// A TLS server for `name` that answers every connection with its name; its certificate.
async fn backend(name: &str) -> (SocketAddr, CertificateDer<'static>) {
    serve_name(name, false).await
}

/// A TLS server for `name` that says its name and keeps each connection open until the
/// client closes it; its certificate.
async fn holding_backend(name: &str) -> (SocketAddr, CertificateDer<'static>) {
    serve_name(name, true).await
}

/// A TLS server for `name` that says its name on every connection, then closes it, or
/// (`hold`) keeps it until the client closes it; its certificate.
async fn serve_name(name: &str, hold: bool) -> (SocketAddr, CertificateDer<'static>) {
    let (acceptor, cert) = acceptor(name);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = name.to_string();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, answer) = (acceptor.clone(), answer.clone());
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let _ = tls.write_all(answer.as_bytes()).await;
                    if hold {
                        let _ = tls.flush().await;
                        let mut sink = Vec::new();
                        let _ = tls.read_to_end(&mut sink).await;
                    } else {
                        let _ = tls.shutdown().await;
                    }
                }
            });
        }
    });
    (addr, cert)
}

/// Connect through `gateway` asking for `name`, trusting `trusted`: what the server said.
async fn ask(
    gateway: SocketAddr,
    name: &str,
    trusted: &CertificateDer<'static>,
) -> Result<String, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(gateway)
        .await
        .map_err(|e| e.to_string())?;
    let server = ServerName::try_from(name.to_string()).unwrap();
    let mut tls = connector
        .connect(server, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    tls.read_to_string(&mut out)
        .await
        .map_err(|e| e.to_string())?;
    Ok(out)
}

#[tokio::test]
async fn each_name_reaches_its_own_server_and_no_other() {
    let mut certs = Vec::new();
    let routes = Arc::new(Routes::default());
    for i in 0..20 {
        let name = format!("t{i}.default.nestplane.internal");
        let (addr, cert) = backend(&name).await;
        routes.set(&name, vec![addr]);
        certs.push((name, cert));
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    tokio::spawn(nestplane_gateway::serve(listener, routes.clone()));

    // Twenty names behind one port, each answered by its own server, verified by name.
    for (name, cert) in &certs {
        assert_eq!(ask(gateway, name, cert).await.as_deref(), Ok(name.as_str()));
    }
    // A name nobody has is reset before any certificate is sent.
    let err = ask(gateway, "nobody.default.nestplane.internal", &certs[0].1)
        .await
        .unwrap_err();
    assert!(
        err.contains("reset") || err.contains("eof") || err.contains("closed"),
        "{err}"
    );
    // Asking for one tenant while trusting another's certificate fails verification: the
    // gateway never terminates TLS, so it cannot hand out anyone's certificate but the
    // named tenant's.
    let wrong = ask(gateway, &certs[1].0, &certs[0].1).await.unwrap_err();
    assert!(wrong.contains("certificate"), "{wrong}");
    // Not TLS at all: reset.
    let mut plain = TcpStream::connect(gateway).await.unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: t0\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let got = plain.read_to_end(&mut buf).await;
    assert!(got.is_err() || buf.is_empty(), "{got:?} {buf:?}");
}

#[tokio::test]
async fn a_backend_that_refuses_is_skipped_before_any_byte_is_sent() {
    let name = "ha.default.nestplane.internal";
    let (live, cert) = backend(name).await;
    // An address nobody listens on (a replica being replaced).
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let routes = Arc::new(Routes::default());
    routes.set(name, vec![dead, live]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    tokio::spawn(nestplane_gateway::serve(listener, routes.clone()));
    // Whichever backend the rotation starts with, every connection gets through.
    for _ in 0..6 {
        assert_eq!(ask(gateway, name, &cert).await.as_deref(), Ok(name));
    }
    // A route removed is a name nobody has.
    routes.set(name, vec![]);
    assert!(ask(gateway, name, &cert).await.is_err());
    assert!(routes.is_empty());
}

/// Connect through `gateway` from address `from` asking for `name`, trusting `trusted`; the
/// open connection once the server said its name.
async fn hold(
    gateway: SocketAddr,
    from: [u8; 4],
    name: &str,
    trusted: &CertificateDer<'static>,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    let tcp = socket.connect(gateway).await.map_err(|e| e.to_string())?;
    let server = ServerName::try_from(name.to_string()).unwrap();
    let mut tls = connector
        .connect(server, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let mut said = vec![0u8; name.len()];
    tls.read_exact(&mut said).await.map_err(|e| e.to_string())?;
    assert_eq!(said, name.as_bytes());
    Ok(tls)
}

#[tokio::test]
async fn one_client_or_one_tenant_cannot_take_every_connection() {
    let (a, b) = (
        "a.default.nestplane.internal",
        "b.default.nestplane.internal",
    );
    let routes = Arc::new(Routes::default());
    let (addr_a, cert_a) = holding_backend(a).await;
    let (addr_b, cert_b) = holding_backend(b).await;
    routes.set(a, vec![addr_a]);
    routes.set(b, vec![addr_b]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway = listener.local_addr().unwrap();
    let limits = nestplane_gateway::Limits {
        connections: 64,
        per_client: 4,
        per_name: 6,
    };
    tokio::spawn(nestplane_gateway::serve_within(
        listener,
        routes.clone(),
        limits,
    ));

    // One client holds its share; its next connection is reset before any TLS byte.
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(hold(gateway, [127, 0, 0, 1], a, &cert_a).await.unwrap());
    }
    let err = hold(gateway, [127, 0, 0, 1], a, &cert_a).await.unwrap_err();
    assert!(
        err.contains("reset") || err.contains("eof") || err.contains("closed"),
        "{err}"
    );
    // Other clients still get through, to the same tenant.
    held.push(hold(gateway, [127, 0, 0, 2], a, &cert_a).await.unwrap());
    held.push(hold(gateway, [127, 0, 0, 3], a, &cert_a).await.unwrap());
    // The tenant holds its share: a new client of it is reset; another tenant's is not.
    assert!(hold(gateway, [127, 0, 0, 4], a, &cert_a).await.is_err());
    let other = hold(gateway, [127, 0, 0, 4], b, &cert_b).await.unwrap();
    // A connection closed is a share back.
    drop(held.remove(0));
    let mut again = None;
    for _ in 0..50 {
        if let Ok(c) = hold(gateway, [127, 0, 0, 1], a, &cert_a).await {
            again = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "a closed connection's share comes back");
    drop((held, other, again));
}
