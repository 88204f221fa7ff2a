//! What a TLS server presents in its handshake, read without sending it anything: its
//! certificate, and the subjects of the CAs it asks client certificates of. A running API
//! server re-reads its CA and certificate files only now and then (Kubernetes 1.20: once a
//! minute); its handshake shows what it serves now, so a CA rotation need not wait longer
//! than it must (`rotation.rs`). Only the handshake is sent (with an empty client certificate
//! when one is asked for): no request, and the connection is closed once it is done.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// What one handshake showed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Presented {
    /// The server's certificate (DER).
    pub certificate: Vec<u8>,
    /// The subjects (DER) of the CAs it asks client certificates of, in its order.
    pub client_cas: Vec<Vec<u8>>,
}

/// Records what the server presents. Its certificate is taken as it is (what it is, not
/// whether to trust it, is the question), but the handshake's signatures are checked, so it
/// is the server that holds that certificate's key.
#[derive(Debug)]
struct Recorder {
    provider: Arc<rustls::crypto::CryptoProvider>,
    seen: Mutex<Presented>,
}

impl ServerCertVerifier for Recorder {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Ok(mut s) = self.seen.lock() {
            s.certificate = end_entity.to_vec();
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ResolvesClientCert for Recorder {
    fn resolve(
        &self,
        root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        if let Ok(mut s) = self.seen.lock() {
            s.client_cas = root_hint_subjects.iter().map(|h| h.to_vec()).collect();
        }
        None
    }

    fn has_certs(&self) -> bool {
        false
    }
}

/// One handshake with the TLS server at `addr`, within `timeout`.
pub async fn presented(addr: SocketAddr, timeout: Duration) -> Result<Presented, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let recorder = Arc::new(Recorder {
        provider: provider.clone(),
        seen: Mutex::new(Presented::default()),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(recorder.clone())
        .with_client_cert_resolver(recorder.clone());
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = ServerName::IpAddress(addr.ip().into());
    let shake = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting to {addr}: {e}"))?;
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {addr}: {e}"))?;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut tls).await;
        Ok::<_, String>(())
    };
    tokio::time::timeout(timeout, shake)
        .await
        .map_err(|_| format!("TLS with {addr}: no answer within {timeout:?}"))??;
    let seen = recorder
        .seen
        .lock()
        .map_err(|_| "a poisoned lock".to_string())?
        .clone();
    if seen.certificate.is_empty() {
        return Err(format!("{addr} presented no certificate"));
    }
    Ok(seen)
}
