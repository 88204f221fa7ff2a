//! nestplane's PKI: CAs, leaf certificates, service-account keys, kubeconfigs, and the renewal
//! policy. Pure: values in, values out; the clock is an argument. Keys are ECDSA P-256.

use std::fmt;
use std::net::IpAddr;

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
pub use time::OffsetDateTime;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// CAs are valid 10 years.
pub const CA_VALIDITY: time::Duration = time::Duration::days(3650);
/// Leaf and client certificates are valid 1 year.
pub const LEAF_VALIDITY: time::Duration = time::Duration::days(365);
/// Certificates are valid from a little before "now", for clocks that disagree slightly.
const BACKDATE: time::Duration = time::Duration::minutes(5);

/// A PEM certificate and its PEM (PKCS#8) private key.
#[derive(Clone, PartialEq, Eq)]
pub struct CertKey {
    /// The certificate (for a service-account key pair: the public key).
    pub cert_pem: String,
    /// The private key. Never printed.
    pub key_pem: String,
}

impl fmt::Debug for CertKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertKey")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// PKI errors. Messages never contain key material.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// Generating or signing failed.
    #[error("cannot create a certificate: {0}")]
    Generate(String),
    /// A PEM could not be parsed.
    #[error("cannot parse {what}: {reason}")]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
    /// The kubeconfig could not be serialized.
    #[error("cannot write a kubeconfig: {0}")]
    Kubeconfig(String),
}

fn gen_err(e: rcgen::Error) -> PkiError {
    PkiError::Generate(e.to_string())
}

/// What a leaf certificate is for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Usage {
    /// TLS server (`serverAuth`).
    Server,
    /// TLS client (`clientAuth`).
    #[default]
    Client,
    /// Both (etcd members, which are servers and peers' clients).
    ServerAndClient,
}

/// Subject and SANs of a leaf certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeafSpec {
    /// Subject common name (a Kubernetes user name for client certificates).
    pub common_name: String,
    /// Subject organizations (Kubernetes groups for client certificates).
    pub organizations: Vec<String>,
    /// DNS SANs.
    pub dns_names: Vec<String>,
    /// IP SANs.
    pub ips: Vec<IpAddr>,
    /// Server, client or both.
    pub usage: Usage,
}

fn new_key() -> Result<KeyPair, PkiError> {
    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(gen_err)
}

/// A self-signed CA valid from `now` (minus 5 minutes) for [`CA_VALIDITY`].
pub fn generate_ca(common_name: &str, now: OffsetDateTime) -> Result<CertKey, PkiError> {
    let key = new_key()?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_VALIDITY;
    let cert = params.self_signed(&key).map_err(gen_err)?;
    Ok(CertKey {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A leaf certificate signed by `ca`, valid from `now` (minus 5 minutes) for
/// [`LEAF_VALIDITY`] (never past the CA's own expiry).
pub fn issue(ca: &CertKey, spec: &LeafSpec, now: OffsetDateTime) -> Result<CertKey, PkiError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(|e| PkiError::Parse {
        what: "the CA key",
        reason: e.to_string(),
    })?;
    let ca_info = inspect(&ca.cert_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(gen_err)?;
    let key = new_key()?;
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, spec.common_name.as_str());
    for o in &spec.organizations {
        params
            .distinguished_name
            .push(DnType::OrganizationName, o.as_str());
    }
    let mut dns = spec.dns_names.clone();
    dns.sort();
    dns.dedup();
    let mut ips = spec.ips.clone();
    ips.sort();
    ips.dedup();
    for d in dns {
        let name = d
            .clone()
            .try_into()
            .map_err(|e: rcgen::Error| PkiError::Generate(format!("SAN {d:?}: {e}")))?;
        params.subject_alt_names.push(SanType::DnsName(name));
    }
    params
        .subject_alt_names
        .extend(ips.into_iter().map(SanType::IpAddress));
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = match spec.usage {
        Usage::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
        Usage::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
        Usage::ServerAndClient => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    };
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - BACKDATE;
    params.not_after = (now + LEAF_VALIDITY).min(ca_info.not_after);
    let cert = params.signed_by(&key, &issuer).map_err(gen_err)?;
    Ok(CertKey {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A service-account signing key pair: `cert_pem` holds the PUBLIC KEY PEM, `key_pem` the
/// private key.
pub fn generate_service_account_key() -> Result<CertKey, PkiError> {
    let key = new_key()?;
    Ok(CertKey {
        cert_pem: key.public_key_pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Facts read back from a certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// Subject common name.
    pub subject_cn: String,
    /// Subject organizations.
    pub organizations: Vec<String>,
    /// Issuer common name.
    pub issuer_cn: String,
    /// Start of validity.
    pub not_before: OffsetDateTime,
    /// End of validity.
    pub not_after: OffsetDateTime,
    /// Whether basicConstraints says CA.
    pub is_ca: bool,
    /// DNS SANs.
    pub dns_names: Vec<String>,
    /// IP SANs.
    pub ips: Vec<IpAddr>,
    /// Extended key usage serverAuth.
    pub server_auth: bool,
    /// Extended key usage clientAuth.
    pub client_auth: bool,
}

fn der_of(cert_pem: &str) -> Result<Vec<u8>, PkiError> {
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(cert_pem.as_bytes()).map_err(|e| PkiError::Parse {
            what: "a certificate PEM",
            reason: e.to_string(),
        })?;
    Ok(pem.contents)
}

fn with_cert<T>(
    cert_pem: &str,
    f: impl FnOnce(&X509Certificate<'_>) -> Result<T, PkiError>,
) -> Result<T, PkiError> {
    let der = der_of(cert_pem)?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| PkiError::Parse {
        what: "a certificate",
        reason: e.to_string(),
    })?;
    f(&cert)
}

/// Read a certificate's subject, issuer, validity, SANs and usages.
pub fn inspect(cert_pem: &str) -> Result<CertInfo, PkiError> {
    with_cert(cert_pem, info)
}

/// [`inspect`] of a certificate in DER (as TLS hands a peer's over).
pub fn inspect_der(der: &[u8]) -> Result<CertInfo, PkiError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| PkiError::Parse {
        what: "a certificate",
        reason: e.to_string(),
    })?;
    info(&cert)
}

fn info(c: &X509Certificate<'_>) -> Result<CertInfo, PkiError> {
    {
        let cn = |n: &x509_parser::x509::X509Name<'_>| {
            n.iter_common_name()
                .next()
                .and_then(|a| a.as_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let mut dns_names = Vec::new();
        let mut ips = Vec::new();
        if let Ok(Some(san)) = c.subject_alternative_name() {
            for n in &san.value.general_names {
                match n {
                    GeneralName::DNSName(d) => dns_names.push(d.to_string()),
                    GeneralName::IPAddress(b) => match b.len() {
                        4 => ips.push(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())),
                        16 => ips.push(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())),
                        _ => {}
                    },
                    _ => {}
                }
            }
        }
        let (server_auth, client_auth) = match c.extended_key_usage() {
            Ok(Some(eku)) => (eku.value.server_auth, eku.value.client_auth),
            _ => (false, false),
        };
        Ok(CertInfo {
            subject_cn: cn(c.subject()),
            organizations: c
                .subject()
                .iter_organization()
                .filter_map(|a| a.as_str().ok().map(str::to_string))
                .collect(),
            issuer_cn: cn(c.issuer()),
            not_before: c.validity().not_before.to_datetime(),
            not_after: c.validity().not_after.to_datetime(),
            is_ca: c.is_ca(),
            dns_names,
            ips,
            server_auth,
            client_auth,
        })
    }
}

/// What a certificate signing request asks for: subject and subject alternative names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CsrInfo {
    pub common_name: String,
    pub organizations: Vec<String>,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// Names of other kinds (e-mail, URI, …), as text: a kubelet never asks for them.
    pub other_names: Vec<String>,
}

/// Read a certificate signing request (PEM). The request's own signature must verify (it
/// proves the requester holds the key).
pub fn csr_info(csr_pem: &str) -> Result<CsrInfo, PkiError> {
    use x509_parser::certification_request::X509CertificationRequest;
    use x509_parser::extensions::ParsedExtension;
    let parse = |reason: String| PkiError::Parse {
        what: "a certificate signing request",
        reason,
    };
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(csr_pem.as_bytes()).map_err(|e| parse(e.to_string()))?;
    let (_, csr) =
        X509CertificationRequest::from_der(&pem.contents).map_err(|e| parse(e.to_string()))?;
    csr.verify_signature()
        .map_err(|e| parse(format!("its signature does not verify: {e}")))?;
    let subject = &csr.certification_request_info.subject;
    // Kubernetes' signer (Go) takes the last common name, this parser the first: a request
    // with several is ambiguous, and refused, so that both always judge the same name.
    if subject.iter_common_name().count() > 1 {
        return Err(parse(
            "its subject has more than one common name".to_string(),
        ));
    }
    let mut info = CsrInfo {
        common_name: subject
            .iter_common_name()
            .next()
            .and_then(|a| a.as_str().ok())
            .unwrap_or_default()
            .to_string(),
        organizations: subject
            .iter_organization()
            .filter_map(|a| a.as_str().ok().map(str::to_string))
            .collect(),
        ..Default::default()
    };
    for ext in csr.requested_extensions().into_iter().flatten() {
        let ParsedExtension::SubjectAlternativeName(san) = ext else {
            continue;
        };
        for n in &san.general_names {
            match n {
                GeneralName::DNSName(d) => info.dns_names.push(d.to_string()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => info
                        .ips
                        .push(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())),
                    16 => info
                        .ips
                        .push(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())),
                    _ => info.other_names.push(format!("{n:?}")),
                },
                other => info.other_names.push(format!("{other:?}")),
            }
        }
    }
    Ok(info)
}

/// The subject of a certificate signing request (PEM): its common name and organizations.
/// The request's own signature must verify (it proves the requester holds the key).
pub fn csr_subject(csr_pem: &str) -> Result<(String, Vec<String>), PkiError> {
    csr_info(csr_pem).map(|i| (i.common_name, i.organizations))
}

/// Whether `cert_pem`'s signature verifies with the public key of `ca_cert_pem`.
pub fn verify_signed_by(cert_pem: &str, ca_cert_pem: &str) -> Result<bool, PkiError> {
    with_cert(ca_cert_pem, |ca| {
        with_cert(cert_pem, |c| {
            Ok(c.verify_signature(Some(ca.public_key())).is_ok())
        })
    })
}

/// Each certificate of a CA bundle (what `--client-ca-file` reads: the CA that signs first,
/// during a rotation the others it trusts after it), as a PEM of its own. Any other block or
/// an unreadable one is an error: a rotation rewrites the bundle and must not drop what it
/// does not understand. Pure.
pub fn certificates(bundle: &str) -> Result<Vec<String>, PkiError> {
    let certs = sa::blocks(bundle, "CERTIFICATE", "a CA bundle")?;
    for c in &certs {
        with_cert(c, |_| Ok(()))?;
    }
    Ok(certs)
}

/// The first certificate of `bundle`, as a PEM of its own (what Kubernetes signs with, and
/// what [`issue`] signs as), whatever follows it. Pure.
pub fn first_certificate(bundle: &str) -> Result<String, PkiError> {
    let der = der_of(bundle)?;
    with_cert(bundle, |_| Ok(()))?;
    let body = base64(&der);
    let lines: Vec<&str> = body
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap_or_default())
        .collect();
    Ok(format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        lines.join("\n")
    ))
}

/// Whether `cert_pem` is signed by one of the certificates of `bundle`. Pure.
pub fn verify_signed_by_any(cert_pem: &str, bundle: &str) -> bool {
    certificates(bundle)
        .unwrap_or_default()
        .iter()
        .any(|ca| verify_signed_by(cert_pem, ca).unwrap_or(false))
}

/// A short fingerprint of a certificate: the first 16 hex digits of the SHA-256 of its DER
/// (what a CA rotation's status names a CA by). Pure.
pub fn certificate_id(cert_pem: &str) -> Result<String, PkiError> {
    use sha2::Digest as _;
    let der = der_of(cert_pem)?;
    Ok(format!("{:x}", sha2::Sha256::digest(&der))[..16].to_string())
}

/// The PEM blocks of `bundle` split as PEM only (not parsed as X.509, as Go's certificate
/// pool skips what it cannot use), each with its [`certificate_id`] when it is a
/// `CERTIFICATE` block. Err: `bundle` is not PEM. Pure.
fn pem_blocks(bundle: &str) -> Result<Vec<(String, Option<String>)>, PkiError> {
    use sha2::Digest as _;
    let mut out = Vec::new();
    for pem in x509_parser::pem::Pem::iter_from_buffer(bundle.as_bytes()) {
        let pem = pem.map_err(|e| PkiError::Parse {
            what: "a PEM bundle",
            reason: e.to_string(),
        })?;
        let body = base64(&pem.contents);
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap_or_default())
            .collect();
        let text = format!(
            "-----BEGIN {0}-----\n{1}\n-----END {0}-----\n",
            pem.label,
            lines.join("\n")
        );
        let id = (pem.label == "CERTIFICATE")
            .then(|| format!("{:x}", sha2::Sha256::digest(&pem.contents))[..16].to_string());
        out.push((text, id));
    }
    Ok(out)
}

/// The [`certificate_id`]s of the `CERTIFICATE` blocks of `bundle`, split as PEM only: a
/// block that is not a certificate, or one X.509 parsing would refuse, does not hide the
/// others. Err: `bundle` is not PEM. Pure.
pub fn certificate_ids(bundle: &str) -> Result<Vec<String>, PkiError> {
    Ok(pem_blocks(bundle)?
        .into_iter()
        .filter_map(|(_, id)| id)
        .collect())
}

/// `bundle` without the certificate whose [`certificate_id`] is `id`, every other block (of
/// any label, parsed or not) kept in order; `None` when it holds no such certificate. Err:
/// `bundle` is not PEM. Pure.
pub fn without_certificate(bundle: &str, id: &str) -> Result<Option<String>, PkiError> {
    let blocks = pem_blocks(bundle)?;
    if !blocks.iter().any(|(_, i)| i.as_deref() == Some(id)) {
        return Ok(None);
    }
    Ok(Some(
        blocks
            .into_iter()
            .filter(|(_, i)| i.as_deref() != Some(id))
            .map(|(text, _)| text)
            .collect(),
    ))
}

/// The hash a joining machine pins its cluster's CA by: the SHA-256 of the certificate's
/// public key (its DER `SubjectPublicKeyInfo`), as `sha256:<hex>` (kubeadm's
/// `--discovery-token-ca-cert-hash`). Pure.
pub fn public_key_hash(cert_pem: &str) -> Result<String, PkiError> {
    public_key_hash_der(&der_of(cert_pem)?)
}

/// [`public_key_hash`] of a certificate in DER. Pure.
pub fn public_key_hash_der(der: &[u8]) -> Result<String, PkiError> {
    use sha2::Digest as _;
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| PkiError::Parse {
        what: "a certificate",
        reason: e.to_string(),
    })?;
    Ok(format!(
        "sha256:{:x}",
        sha2::Sha256::digest(cert.tbs_certificate.subject_pki.raw)
    ))
}

/// A certificate in DER as PEM. Pure.
pub fn certificate_pem(der: &[u8]) -> String {
    let b64 = base64(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// The DER of a certificate (what a TLS server presents). Pure.
pub fn certificate_der(cert_pem: &str) -> Result<Vec<u8>, PkiError> {
    with_cert(cert_pem, |_| Ok(()))?;
    der_of(cert_pem)
}

/// The DER of each certificate's subject in `bundle`, in order: what a TLS server that trusts
/// `bundle` for client certificates names in its certificate request. Pure.
pub fn subjects(bundle: &str) -> Result<Vec<Vec<u8>>, PkiError> {
    certificates(bundle)?
        .iter()
        .map(|c| with_cert(c, |c| Ok(c.subject().as_raw().to_vec())))
        .collect()
}

/// Renewal policy: renew once half the lifetime has passed, when expired, or when the
/// certificate cannot be read.
pub fn needs_renewal(cert_pem: &str, now: OffsetDateTime) -> bool {
    match inspect(cert_pem) {
        Ok(info) => {
            let half = info.not_before + (info.not_after - info.not_before) / 2;
            now >= half || now >= info.not_after
        }
        Err(_) => true,
    }
}

/// Whether `key_pem` is the private key of `cert_pem`.
pub fn key_matches(cert_pem: &str, key_pem: &str) -> Result<bool, PkiError> {
    let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::Parse {
        what: "a private key",
        reason: e.to_string(),
    })?;
    with_cert(cert_pem, |c| {
        Ok(c.public_key().subject_public_key.data.as_ref() == key.public_key_raw())
    })
}

/// Base64 (standard alphabet, padded), as kubeconfigs use.
pub fn base64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

mod sa;
pub use sa::{public_keys, service_account_key_id, service_account_public_key, token_key_id};
mod kubeconfig;
pub use kubeconfig::{Authority, Credential, KubeconfigSpec, kubeconfig, write_kubeconfig};
mod kubeconfig_check;
pub use kubeconfig_check::{
    Issued, check_kubeconfig, kubeconfig_client, read_kubeconfig, untrusted_yaml,
    verify_issued_kubeconfig,
};

#[cfg(test)]
mod tests;
