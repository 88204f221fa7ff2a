//! `s3://bucket/key` archives: path-style requests to an S3-compatible server, signed with
//! AWS Signature Version 4 ([`sign`], pure), with the credentials of a Secret of the
//! backup's own namespace.
//!
//! The server is hostile input too: a namespace user names it. The operator sends requests
//! only to servers its administrator allows (`--backup-s3-endpoint`, [`allowed_endpoint`]):
//! without that, a `NestedBackup` could make the operator send requests to any address it
//! reaches (the management API server, another tenant's, a metadata service). No redirect is
//! followed, no answer is read past a limit, and the secret key is in no message.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use nestplane_api::backup::{S3Access, reasons, s3_keys};
use ring::hmac;
use sha2::{Digest, Sha256};

use crate::context::Error;

/// The region signed for when a spec names none.
pub const DEFAULT_REGION: &str = "us-east-1";
/// How long one request may take, answer included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest error answer read from a server.
const ERROR_BODY: usize = 8 * 1024;

/// A server the operator allows, as `scheme://host[:port]` (lower case, no path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    scheme: String,
    authority: String,
}

impl Endpoint {
    /// `given` as an endpoint: `http` or `https`, a host, no user, path, query or fragment.
    pub fn parse(given: &str) -> Result<Endpoint, String> {
        let bad = |why: &str| format!("endpoint {given:?}: {why}");
        let uri: hyper::Uri = given.parse().map_err(|_| bad("not a URL"))?;
        let scheme = uri.scheme_str().unwrap_or_default().to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err(bad("an endpoint is an http:// or https:// URL"));
        }
        let Some(authority) = uri.authority() else {
            return Err(bad("an endpoint names a host"));
        };
        if authority.as_str().contains('@') {
            return Err(bad("an endpoint carries no user name"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() || given.contains('#') {
            return Err(bad(
                "an endpoint has no path or query (requests are path-style)",
            ));
        }
        Ok(Endpoint {
            scheme,
            authority: authority.as_str().to_ascii_lowercase(),
        })
    }

    /// `scheme://authority`.
    pub fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.authority)
    }
}

/// The endpoint `given` if it is one of `allowed` (the operator's `--backup-s3-endpoint`s),
/// compared as scheme, host and port; why not otherwise.
pub fn allowed_endpoint(given: &str, allowed: &[String]) -> Result<Endpoint, String> {
    let e = Endpoint::parse(given)?;
    if allowed
        .iter()
        .any(|a| Endpoint::parse(a).is_ok_and(|a| a == e))
    {
        return Ok(e);
    }
    // (Which servers are allowed is not said: their names are the administrator's.)
    Err(if allowed.is_empty() {
        format!(
            "endpoint {given:?} refused: this operator sends backups to no S3 server (its administrator allows them with --backup-s3-endpoint)"
        )
    } else {
        format!(
            "endpoint {given:?} refused: it is not one of the S3 servers this operator's administrator allows (--backup-s3-endpoint)"
        )
    })
}

/// An access key, its secret and the region requests are signed for.
#[derive(Clone)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub region: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .field("secret_key", &"<redacted>")
            .field("region", &self.region)
            .finish()
    }
}

/// What a request says, to be signed: the method, the host, the path (encoded), the
/// canonical query, the headers signed besides `host` (lower-case names), the payload's
/// SHA-256 (hex), and when (`YYYYMMDDThhmmssZ`).
pub struct Request<'a> {
    pub method: &'a str,
    pub host: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub payload_sha256: &'a str,
    pub amz_date: &'a str,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hmac_sha256(key: &[u8], data: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data)
        .as_ref()
        .to_vec()
}

/// The `Authorization` header of `r` signed with `c` (Signature Version 4, service `s3`).
/// `x-amz-date` and `x-amz-content-sha256` must be among `r.headers`, as S3 wants.
pub fn sign(r: &Request<'_>, c: &Credentials) -> String {
    let mut headers: Vec<(String, String)> = r
        .headers
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_string()))
        .chain([("host".to_string(), r.host.to_string())])
        .collect();
    headers.sort();
    let canonical_headers: String = headers.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
    let signed: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    let signed = signed.join(";");
    let canonical = format!(
        "{}\n{}\n{}\n{canonical_headers}\n{signed}\n{}",
        r.method, r.path, r.query, r.payload_sha256
    );
    let date = &r.amz_date[..r.amz_date.len().min(8)];
    let scope = format!("{date}/{}/s3/aws4_request", c.region);
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{}\n{scope}\n{}",
        r.amz_date,
        sha256_hex(canonical.as_bytes())
    );
    let key = [date, c.region.as_str(), "s3", "aws4_request"]
        .iter()
        .fold(format!("AWS4{}", c.secret_key).into_bytes(), |k, part| {
            hmac_sha256(&k, part.as_bytes())
        });
    let signature = hex(&hmac_sha256(&key, to_sign.as_bytes()));
    format!(
        "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
        c.access_key
    )
}

/// `s` with every byte but the unreserved ones (`A-Za-z0-9-._~`) and `/` percent-encoded.
pub fn encode_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Why a request did not do what was asked.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum S3Error {
    /// `If-None-Match: *` failed: an object of that key exists.
    #[error("an object of that key exists")]
    Exists,
    /// The server answered with an error (its status, code and message).
    #[error("{0}")]
    Status(u16, String),
    /// The server could not be reached, or did not answer in time.
    #[error("{0}")]
    Transport(String),
    /// The object is larger than may be read.
    #[error("{0}")]
    TooLarge(String),
}

impl S3Error {
    /// Whether the server refused the credentials (they will not work on their own later).
    pub fn denied(&self) -> bool {
        matches!(self, S3Error::Status(401 | 403, _))
    }
}

type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// One server, with one namespace's credentials.
#[derive(Clone)]
pub struct Bucket {
    endpoint: Endpoint,
    creds: Credentials,
    client: Client,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bucket")
            .field("endpoint", &self.endpoint)
            .field("creds", &self.creds)
            .finish()
    }
}

fn amz_now() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// The `<Code>` and `<Message>` of an S3 error answer, cut short.
fn error_text(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let tag = |t: &str| {
        let open = format!("<{t}>");
        let start = text.find(&open)? + open.len();
        let end = text[start..].find("</")? + start;
        Some(nestplane_api::conditions::cut(&text[start..end], 200))
    };
    match (tag("Code"), tag("Message")) {
        (Some(c), Some(m)) => format!("HTTP {status}: {c}: {m}"),
        (Some(c), None) => format!("HTTP {status}: {c}"),
        _ => format!("HTTP {status}"),
    }
}

/// One client for every request (the platform's roots read once): connections time out
/// after [`CONNECT_TIMEOUT`]. An `https` endpoint needs the platform's roots; `http` does not.
fn client() -> Client {
    static CLIENT: std::sync::OnceLock<Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
            http.set_connect_timeout(Some(CONNECT_TIMEOUT));
            http.enforce_http(false);
            let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
            let builder = hyper_rustls::HttpsConnectorBuilder::new();
            let https = match builder.with_provider_and_native_roots(provider.clone()) {
                Ok(b) => b.https_or_http().enable_http1().wrap_connector(http),
                Err(e) => {
                    tracing::warn!("no platform TLS roots ({e}): https S3 endpoints will fail");
                    let tls = rustls::ClientConfig::builder_with_provider(provider)
                        .with_safe_default_protocol_versions()
                        .map(|b| {
                            b.with_root_certificates(rustls::RootCertStore::empty())
                                .with_no_client_auth()
                        });
                    match tls {
                        Ok(tls) => hyper_rustls::HttpsConnectorBuilder::new()
                            .with_tls_config(tls)
                            .https_or_http()
                            .enable_http1()
                            .wrap_connector(http),
                        Err(e) => unreachable!("ring's protocol versions: {e}"),
                    }
                }
            };
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(https)
        })
        .clone()
}

impl Bucket {
    /// A client of `endpoint` with `creds`.
    pub fn new(endpoint: Endpoint, creds: Credentials) -> Result<Bucket, String> {
        Ok(Bucket {
            endpoint,
            creds,
            client: client(),
        })
    }

    /// Send one signed request for `bucket/key`; the answer's status and body (read up to
    /// `limit` bytes: past it an error, or with `truncate` the first `limit`).
    async fn send(
        &self,
        method: &str,
        bucket: &str,
        key: &str,
        extra: &[(&str, &str)],
        body: Bytes,
        (limit, truncate): (usize, bool),
    ) -> Result<(u16, Vec<u8>), S3Error> {
        let path = encode_path(&format!("/{bucket}/{key}"));
        let payload = sha256_hex(&body);
        let amz_date = amz_now();
        let mut headers: Vec<(&str, &str)> = vec![
            ("x-amz-content-sha256", payload.as_str()),
            ("x-amz-date", amz_date.as_str()),
        ];
        headers.extend_from_slice(extra);
        let authorization = sign(
            &Request {
                method,
                host: &self.endpoint.authority,
                path: &path,
                query: "",
                headers: &headers,
                payload_sha256: &payload,
                amz_date: &amz_date,
            },
            &self.creds,
        );
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.endpoint.url()))
            .header("host", &self.endpoint.authority)
            .header("authorization", authorization);
        for (k, v) in &headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| S3Error::Transport(e.to_string()))?;
        let shown = format!("{method} {}/{bucket}/{key}", self.endpoint.url());
        let answer = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| S3Error::Transport(format!("{shown}: {e}")))?;
            let status = resp.status().as_u16();
            let ok = (200..300).contains(&status);
            let cap = if ok { limit } else { ERROR_BODY };
            let length = resp
                .headers()
                .get(hyper::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if ok && !truncate && length.is_some_and(|n| n > cap as u64) {
                return Err(S3Error::TooLarge(format!(
                    "{shown}: the object is {} bytes; at most {cap} are read",
                    length.unwrap_or_default()
                )));
            }
            // Read up to `cap` bytes: past it, an error (or, for a ranged read whose server
            // sent more than asked, the first `cap` bytes and the connection dropped).
            let mut body = resp.into_body();
            let mut out: Vec<u8> = Vec::new();
            while let Some(frame) = body.frame().await {
                let frame = frame
                    .map_err(|e| S3Error::Transport(format!("{shown}: reading the answer: {e}")))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if out.len() + data.len() > cap {
                    if truncate || !ok {
                        out.extend_from_slice(&data[..cap - out.len()]);
                        break;
                    }
                    return Err(S3Error::TooLarge(format!(
                        "{shown}: the object is larger than the {cap} bytes that are read"
                    )));
                }
                out.extend_from_slice(&data);
            }
            Ok((status, out))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, answer)
            .await
            .map_err(|_| {
                S3Error::Transport(format!("{shown}: no answer within {REQUEST_TIMEOUT:?}"))
            })?
    }

    fn failed(&self, method: &str, bucket: &str, key: &str, status: u16, body: &[u8]) -> S3Error {
        S3Error::Status(
            status,
            format!(
                "{method} {}/{bucket}/{key}: {}",
                self.endpoint.url(),
                error_text(status, body)
            ),
        )
    }

    /// Write `bytes` to `bucket/key` unless an object of that key exists (`If-None-Match`).
    pub async fn put_new(&self, bucket: &str, key: &str, bytes: Vec<u8>) -> Result<(), S3Error> {
        let (status, body) = self
            .send(
                "PUT",
                bucket,
                key,
                &[("if-none-match", "*")],
                Bytes::from(bytes),
                (ERROR_BODY, true),
            )
            .await?;
        match status {
            200..=299 => Ok(()),
            412 => Err(S3Error::Exists),
            _ => Err(self.failed("PUT", bucket, key, status, &body)),
        }
    }

    /// The object `bucket/key` (its first `first` bytes, when given), `None` when there is
    /// none; an error past `limit` bytes.
    pub async fn get(
        &self,
        bucket: &str,
        key: &str,
        first: Option<u64>,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, S3Error> {
        let range = first.map(|n| format!("bytes=0-{}", n.saturating_sub(1)));
        let extra: Vec<(&str, &str)> = range.iter().map(|r| ("range", r.as_str())).collect();
        let cap = usize::try_from(limit).unwrap_or(usize::MAX);
        let (status, body) = self
            .send(
                "GET",
                bucket,
                key,
                &extra,
                Bytes::new(),
                (cap, first.is_some()),
            )
            .await?;
        match status {
            200..=299 => Ok(Some(body)),
            404 => Ok(None),
            // A range past the end of an object shorter than asked.
            416 => Ok(Some(Vec::new())),
            _ => Err(self.failed("GET", bucket, key, status, &body)),
        }
    }

    /// Delete `bucket/key` (nothing when there is none).
    pub async fn delete(&self, bucket: &str, key: &str) -> Result<(), S3Error> {
        let (status, body) = self
            .send("DELETE", bucket, key, &[], Bytes::new(), (ERROR_BODY, true))
            .await?;
        match status {
            200..=299 | 404 => Ok(()),
            _ => Err(self.failed("DELETE", bucket, key, status, &body)),
        }
    }

    /// `scheme://host[:port]` of the server.
    pub fn endpoint(&self) -> String {
        self.endpoint.url()
    }
}

/// A client of the server `access` names, with the credentials of its Secret in namespace
/// `ns`. `Err((reason, why))`: what the user has to change (the endpoint is not allowed,
/// the Secret is missing or incomplete).
pub async fn bucket_for(
    client: &kube::Client,
    ns: &str,
    access: Option<&S3Access>,
    allowed: &[String],
) -> Result<Result<Bucket, (&'static str, String)>, Error> {
    let Some(access) = access else {
        return Ok(Err((
            reasons::LOCATION_REFUSED,
            "an s3:// location needs `s3` in the spec: its endpoint and credentialsSecretRef"
                .into(),
        )));
    };
    let endpoint = match allowed_endpoint(&access.endpoint, allowed) {
        Ok(e) => e,
        Err(why) => return Ok(Err((reasons::LOCATION_REFUSED, why))),
    };
    let name = &access.credentials_secret_ref.name;
    let secret = Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await?;
    let Some(data) = secret.and_then(|s| s.data) else {
        return Ok(Err((
            reasons::INVALID_CREDENTIALS,
            format!("the S3 credentials Secret {ns}/{name} does not exist or is empty"),
        )));
    };
    let value = |k: &str| {
        data.get(k)
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_graphic()))
    };
    let (Some(access_key), Some(secret_key)) = (
        value(s3_keys::ACCESS_KEY_ID),
        value(s3_keys::SECRET_ACCESS_KEY),
    ) else {
        return Ok(Err((
            reasons::INVALID_CREDENTIALS,
            format!(
                "the S3 credentials Secret {ns}/{name} needs {} and {} (printable, no spaces)",
                s3_keys::ACCESS_KEY_ID,
                s3_keys::SECRET_ACCESS_KEY
            ),
        )));
    };
    let region = access
        .region
        .clone()
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| DEFAULT_REGION.to_string());
    if !region
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-')
        || region.len() > 64
    {
        return Ok(Err((
            reasons::INVALID_SPEC,
            format!(
                "region {:?} is not a region name",
                nestplane_api::conditions::cut(&region, 80)
            ),
        )));
    }
    let creds = Credentials {
        access_key,
        secret_key,
        region,
    };
    Ok(Bucket::new(endpoint, creds).map_err(|why| (reasons::LOCATION_UNAVAILABLE, why)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The example of AWS's S3 documentation ("Signature Calculations for the Authorization
    /// Header", GET Object): its published signature.
    #[test]
    fn signs_as_aws_documents() {
        let creds = Credentials {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            region: "us-east-1".into(),
        };
        let empty = sha256_hex(b"");
        assert_eq!(
            empty,
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let auth = sign(
            &Request {
                method: "GET",
                host: "examplebucket.s3.amazonaws.com",
                path: "/test.txt",
                query: "",
                headers: &[
                    ("range", "bytes=0-9"),
                    ("x-amz-content-sha256", &empty),
                    ("x-amz-date", "20130524T000000Z"),
                ],
                payload_sha256: &empty,
                amz_date: "20130524T000000Z",
            },
            &creds,
        );
        assert_eq!(
            auth,
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
        );
        assert!(!format!("{creds:?}").contains("EXAMPLEKEY"));
    }

    #[test]
    fn only_allowed_endpoints_are_reached() {
        let allowed = vec!["http://127.0.0.1:9000".to_string()];
        assert_eq!(
            allowed_endpoint("http://127.0.0.1:9000/", &allowed)
                .unwrap()
                .url(),
            "http://127.0.0.1:9000"
        );
        for hostile in [
            "http://127.0.0.1:9001",
            "https://127.0.0.1:9000",
            "http://127.0.0.2:9000",
            "http://user@127.0.0.1:9000",
            "http://127.0.0.1:9000/x",
            "http://127.0.0.1:9000?x=1",
            "http://169.254.169.254",
            "file:///etc",
            "127.0.0.1:9000",
            "",
        ] {
            assert!(allowed_endpoint(hostile, &allowed).is_err(), "{hostile}");
        }
        assert!(
            allowed_endpoint("http://127.0.0.1:9000", &[])
                .unwrap_err()
                .contains("--backup-s3-endpoint")
        );
        assert_eq!(encode_path("/b/a b+c"), "/b/a%20b%2Bc");
        assert_eq!(
            error_text(
                403,
                b"<Error><Code>SignatureDoesNotMatch</Code><Message>no</Message></Error>"
            ),
            "HTTP 403: SignatureDoesNotMatch: no"
        );
    }
}
