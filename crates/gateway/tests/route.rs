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

/// A TLS server for `name` that answers every connection with its name; its certificate.
async fn backend(name: &str) -> (SocketAddr, CertificateDer<'static>) {
    let ck = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
    let cert = ck.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
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
                    let _ = tls.shutdown().await;
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
