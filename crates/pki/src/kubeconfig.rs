//! The one kubeconfig writer, on `kube::config::Kubeconfig`: every kubeconfig nestplane hands
//! out (tenant admins and components, the management plane's service accounts, a node's
//! bootstrap) has one cluster, one user and one current context `<user>@<cluster>`. Pure.

use kube::config::{
    AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
};

use crate::{CertKey, PkiError, base64};

/// How the server's certificate is verified.
#[derive(Clone, Copy, Debug)]
pub enum Authority<'a> {
    /// The CA certificate, inline (PEM).
    Pem(&'a str),
    /// A CA file on the reader's machine (for a node's own components).
    File(&'a str),
}

/// Who the kubeconfig speaks as.
#[derive(Clone, Copy)]
pub enum Credential<'a> {
    /// A client certificate and its key, inline.
    ClientCert(&'a CertKey),
    /// A bearer token (a service account's, or a bootstrap token).
    Token(&'a str),
}

impl std::fmt::Debug for Credential<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key or the token.
        f.write_str(match self {
            Credential::ClientCert(_) => "ClientCert",
            Credential::Token(_) => "Token",
        })
    }
}

/// What a kubeconfig is made of.
#[derive(Clone, Copy, Debug)]
pub struct KubeconfigSpec<'a> {
    /// The cluster's name in the kubeconfig.
    pub cluster: &'a str,
    /// The API server URL.
    pub server: &'a str,
    /// The name the server is asked for and verified as (`tls-server-name`), when it is not
    /// the URL's host: a gateway that routes by server name.
    pub server_name: Option<&'a str>,
    /// How the server is verified.
    pub authority: Authority<'a>,
    /// The user's name in the kubeconfig.
    pub user: &'a str,
    /// The user's credential.
    pub credential: Credential<'a>,
    /// The context's namespace, if any.
    pub namespace: Option<&'a str>,
}

impl KubeconfigSpec<'_> {
    /// The kubeconfig as `kube` models it.
    pub fn build(&self) -> Kubeconfig {
        let context = format!("{}@{}", self.user, self.cluster);
        let (certificate_authority, certificate_authority_data) = match self.authority {
            Authority::Pem(pem) => (None, Some(base64(pem.as_bytes()))),
            Authority::File(path) => (Some(path.to_string()), None),
        };
        let auth = match self.credential {
            Credential::ClientCert(c) => AuthInfo {
                client_certificate_data: Some(base64(c.cert_pem.as_bytes())),
                client_key_data: Some(base64(c.key_pem.as_bytes()).into()),
                ..AuthInfo::default()
            },
            Credential::Token(t) => AuthInfo {
                token: Some(t.to_string().into()),
                ..AuthInfo::default()
            },
        };
        Kubeconfig {
            api_version: Some("v1".into()),
            kind: Some("Config".into()),
            clusters: vec![NamedCluster {
                name: self.cluster.into(),
                cluster: Some(Cluster {
                    server: Some(self.server.into()),
                    tls_server_name: self.server_name.map(str::to_string),
                    certificate_authority,
                    certificate_authority_data,
                    ..Cluster::default()
                }),
                ..NamedCluster::default()
            }],
            auth_infos: vec![NamedAuthInfo {
                name: self.user.into(),
                auth_info: Some(auth),
                ..NamedAuthInfo::default()
            }],
            contexts: vec![NamedContext {
                name: context.clone(),
                context: Some(Context {
                    cluster: self.cluster.into(),
                    user: Some(self.user.into()),
                    namespace: self.namespace.map(str::to_string),
                    ..Context::default()
                }),
                ..NamedContext::default()
            }],
            current_context: Some(context),
            ..Kubeconfig::default()
        }
    }
}

/// The kubeconfig as YAML. Deterministic for the same input.
pub fn write_kubeconfig(spec: &KubeconfigSpec<'_>) -> Result<String, PkiError> {
    serde_saphyr::to_string(&spec.build()).map_err(|e| PkiError::Kubeconfig(e.to_string()))
}

/// A kubeconfig with one cluster (its CA inline, and `tls-server-name` when `server_name` is
/// given), one client-certificate user and one current context (`<user>@<cluster>`).
/// Deterministic for the same input.
pub fn kubeconfig(
    cluster_name: &str,
    server: &str,
    server_name: Option<&str>,
    ca_pem: &str,
    user_name: &str,
    client: &CertKey,
) -> Result<String, PkiError> {
    write_kubeconfig(&KubeconfigSpec {
        cluster: cluster_name,
        server,
        server_name,
        authority: Authority::Pem(ca_pem),
        user: user_name,
        credential: Credential::ClientCert(client),
        namespace: None,
    })
}
