//! Certificates and kubeconfigs of a tenant, stored as Cluster API secrets.
//!
//! CAs (`<cluster>-ca`, `-etcd`, `-proxy`, `-sa`) are created once and rewritten only by a
//! rotation a user asks for ([`crate::rotation`]): an existing CA secret is used as it is (a
//! user may bring their own), and a malformed one is an error, never a reason to generate a
//! new CA. Leaf certificates and kubeconfigs are reissued
//! when half their life has passed, when their SANs no longer match the addresses in use, or
//! when their CA changed. Secret contents never reach logs or Events.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, Patch, PatchParams, PostParams};
use nestplane_api::names::{self, SecretPurpose};
use nestplane_pki::{self as pki, CertKey, LeafSpec, Usage};
use sha2::{Digest, Sha256};

use crate::crds::FIELD_MANAGER;

/// Annotation recording the hash of the CA a leaf or kubeconfig was issued from.
pub const CA_HASH_ANNOTATION: &str = "nestplane.io/ca-sha256";
/// Annotation recording the server URL of a kubeconfig.
pub const SERVER_ANNOTATION: &str = "nestplane.io/server";
/// Annotation recording a kubeconfig's `tls-server-name`, when it has one.
pub const SERVER_NAME_ANNOTATION: &str = "nestplane.io/server-name";

/// Errors handling secrets.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The management API failed.
    #[error("secret {name}: {source}")]
    Kube {
        /// Which secret.
        name: String,
        /// The error.
        source: kube::Error,
    },
    /// A secret exists but cannot be used (and is left alone).
    #[error(
        "secret {name} is unusable: {reason}; fix or delete it (nestplane never overwrites a CA)"
    )]
    Invalid {
        /// Which secret.
        name: String,
        /// Why.
        reason: String,
    },
    /// Certificate generation failed.
    #[error("certificates: {0}")]
    Pki(#[from] pki::PkiError),
    /// A certificate plan named a CA after what it signs (a bug in the plan).
    #[error("certificate plan: {0:?} is used before it is issued")]
    Plan(SecretPurpose),
}

fn plan_order(p: SecretPurpose) -> SecretError {
    SecretError::Plan(p)
}

/// The secrets of one cluster.
#[derive(Clone)]
pub struct ClusterSecrets {
    api: Api<Secret>,
    cluster: String,
    owner: OwnerReference,
    clock: crate::clock::Clock,
    cache: Option<kube::runtime::reflector::Store<Secret>>,
    /// What this pass wrote: read before the cache, which may not have seen it yet.
    written: std::sync::Arc<std::sync::Mutex<BTreeMap<String, Secret>>>,
    /// Secrets found holding what nestplane did not issue, and reissued (for Events).
    replaced: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The kubeconfigs this pass verified or issued, by secret name: what [`Self::data`]
    /// hands out, whatever the cache holds by then.
    verified: std::sync::Arc<std::sync::Mutex<BTreeMap<String, String>>>,
    /// The fingerprints of the [`TRUST`] secrets this pass issued from, by suffix.
    used: std::sync::Arc<std::sync::Mutex<BTreeMap<String, String>>>,
    /// The CA a rotation replaces (`previous.crt` of a CA secret), by CA: serving
    /// certificates it signed are kept meanwhile.
    previous: std::sync::Arc<std::sync::Mutex<BTreeMap<SecretPurpose, String>>>,
}

/// What is known of a secret before asking the API server.
enum Known {
    /// This pass wrote it, or the cache holds it.
    Present(Box<Secret>),
    /// The cache (of the secrets nestplane manages) does not hold it.
    Absent,
    /// There is no cache to ask.
    Unknown,
}

/// A leaf certificate to keep current.
#[derive(Clone, Debug)]
pub struct Leaf {
    /// Which secret.
    pub purpose: SecretPurpose,
    /// Which CA signs it.
    pub ca: SecretPurpose,
    /// Subject and SANs.
    pub spec: LeafSpec,
}

/// A kubeconfig to keep current.
#[derive(Clone, Debug)]
pub struct KubeconfigSpec {
    /// Which secret.
    pub purpose: SecretPurpose,
    /// The API server URL.
    pub server: String,
    /// Its `tls-server-name` (a shared gateway's name for the tenant), if any.
    pub server_name: Option<String>,
    /// Client certificate subject.
    pub user: String,
    /// Client certificate organizations (groups).
    pub groups: Vec<String>,
}

fn ca_hash(ca_pem: &str) -> String {
    format!("{:x}", Sha256::digest(ca_pem.as_bytes()))
}

fn text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()?
        .get(key)
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
}

impl ClusterSecrets {
    /// Secrets of `cluster` in `namespace`, controller-owned by `owner` (the control plane).
    pub fn new(
        client: kube::Client,
        namespace: &str,
        cluster: &str,
        owner: OwnerReference,
        clock: crate::clock::Clock,
    ) -> Self {
        ClusterSecrets {
            api: Api::namespaced(client, namespace),
            cluster: cluster.to_string(),
            owner,
            clock,
            cache: None,
            written: Default::default(),
            replaced: Default::default(),
            verified: Default::default(),
            used: Default::default(),
            previous: Default::default(),
        }
    }

    /// Read through `cache` (nestplane's own secrets, watched) before asking the API server.
    pub fn with_cache(mut self, cache: Option<kube::runtime::reflector::Store<Secret>>) -> Self {
        self.cache = cache;
        self
    }

    /// The secrets this pass found holding a certificate or kubeconfig that nestplane did not
    /// issue (edited by someone), each reissued; a sentence per secret, for an Event.
    pub fn take_replaced(&self) -> Vec<String> {
        std::mem::take(&mut *self.replaced.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn note_replaced(&self, purpose: SecretPurpose, what: &str) {
        let name = purpose.secret_name(&self.cluster);
        tracing::warn!(secret = %name, "reissuing a {what} nestplane did not issue");
        self.replaced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(format!(
                "secret {name} held a {what} nestplane did not issue (it was edited); it is reissued and the edited content is never used"
            ));
    }

    fn remember(&self, s: Secret) {
        if let Some(name) = s.metadata.name.clone() {
            self.written
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name, s);
        }
    }

    fn meta(&self, purpose: SecretPurpose, annotations: BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(purpose.secret_name(&self.cluster)),
            labels: Some(BTreeMap::from([
                (names::CLUSTER_NAME_LABEL.to_string(), self.cluster.clone()),
                (
                    names::MANAGED_BY_LABEL.to_string(),
                    names::MANAGED_BY.to_string(),
                ),
            ])),
            annotations: if annotations.is_empty() {
                None
            } else {
                Some(annotations)
            },
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }

    fn secret(
        &self,
        purpose: SecretPurpose,
        data: BTreeMap<String, Vec<u8>>,
        annotations: BTreeMap<String, String>,
    ) -> Secret {
        Secret {
            metadata: self.meta(purpose, annotations),
            type_: Some(names::CAPI_SECRET_TYPE.to_string()),
            data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
            ..Secret::default()
        }
    }

    async fn get(&self, purpose: SecretPurpose) -> Result<Option<Secret>, SecretError> {
        match self.known(purpose) {
            Known::Present(s) => Ok(Some(*s)),
            Known::Absent | Known::Unknown => {
                self.get_fresh(&purpose.secret_name(&self.cluster)).await
            }
        }
    }

    /// What this pass wrote or the cache holds, without asking the API server.
    fn known(&self, purpose: SecretPurpose) -> Known {
        let name = purpose.secret_name(&self.cluster);
        if let Some(s) = self
            .written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
        {
            return Known::Present(Box::new(s.clone()));
        }
        let ns = self.api.namespace().unwrap_or_default().to_string();
        match &self.cache {
            Some(c) => match c.get(&kube::runtime::reflector::ObjectRef::new(&name).within(&ns)) {
                Some(hit) => Known::Present(Box::new((*hit).clone())),
                None => Known::Absent,
            },
            None => Known::Unknown,
        }
    }

    /// The secret of `purpose`, and whether to create it rather than apply it: one the cache
    /// does not know is not read first (see [`ClusterSecrets::put`]).
    async fn existing(
        &self,
        purpose: SecretPurpose,
    ) -> Result<(Option<Secret>, bool), SecretError> {
        match self.known(purpose) {
            Known::Present(s) => Ok((Some(*s), false)),
            Known::Absent => Ok((None, true)),
            Known::Unknown => Ok((
                self.get_fresh(&purpose.secret_name(&self.cluster)).await?,
                false,
            )),
        }
    }

    /// Write a certificate nestplane issues (a leaf, a kubeconfig): applied, or, when
    /// `create`, created. A create is refused when the secret exists after all (the cache is
    /// behind, or someone else made it): what is there is returned, to be judged again.
    async fn put(&self, secret: &Secret, create: bool) -> Result<Option<Secret>, SecretError> {
        if !create {
            return self.apply(secret).await.map(|_| None);
        }
        let name = secret.metadata.name.clone().unwrap_or_default();
        match self.api.create(&PostParams::default(), secret).await {
            Ok(created) => {
                self.remember(created);
                Ok(None)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => self.get_fresh(&name).await,
            Err(source) => Err(SecretError::Kube { name, source }),
        }
    }

    async fn apply(&self, secret: &Secret) -> Result<(), SecretError> {
        let name = secret.metadata.name.clone().unwrap_or_default();
        self.api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(secret),
            )
            .await
            .map(|s| self.remember(s))
            .map_err(|source| SecretError::Kube { name, source })
    }

    async fn get_fresh(&self, name: &str) -> Result<Option<Secret>, SecretError> {
        self.api
            .get_opt(name)
            .await
            .map_err(|source| SecretError::Kube {
                name: name.to_string(),
                source,
            })
    }

    /// The CA (or service-account key pair) of `purpose`: read if it exists, created once
    /// otherwise. Never regenerated.
    pub async fn ca(&self, purpose: SecretPurpose) -> Result<CertKey, SecretError> {
        let name = purpose.secret_name(&self.cluster);
        if let Some(existing) = self.get(purpose).await? {
            let ck = Self::read_ca(&name, purpose, &existing)?;
            self.note_used(purpose, &existing);
            if purpose == SecretPurpose::ClusterCa {
                self.keep_signer(&name, &existing, &ck).await?;
                if let Some(p) = text(&existing, names::PREVIOUS_CRT) {
                    self.previous
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(purpose, p);
                }
            }
            return Ok(ck);
        }
        let now = time::OffsetDateTime::now_utc();
        let ck = match purpose {
            SecretPurpose::ServiceAccount => pki::generate_service_account_key()?,
            _ => pki::generate_ca(&format!("{}-{}", self.cluster, purpose.suffix()), now)?,
        };
        let mut data = BTreeMap::from([
            (names::TLS_CRT.to_string(), ck.cert_pem.clone().into_bytes()),
            (names::TLS_KEY.to_string(), ck.key_pem.clone().into_bytes()),
        ]);
        if purpose == SecretPurpose::ClusterCa {
            data.insert(
                names::SIGNER_CRT.to_string(),
                ck.cert_pem.clone().into_bytes(),
            );
        }
        let secret = self.secret(purpose, data, BTreeMap::new());
        match self.api.create(&PostParams::default(), &secret).await {
            Ok(created) => {
                self.note_used(purpose, &created);
                self.remember(created);
                Ok(ck)
            }
            // Someone else created it meanwhile: theirs wins.
            Err(kube::Error::Api(e)) if e.code == 409 => match self.get_fresh(&name).await? {
                Some(s) => Self::read_ca(&name, purpose, &s),
                None => Err(SecretError::Invalid {
                    name,
                    reason: "vanished while being created".into(),
                }),
            },
            Err(source) => Err(SecretError::Kube { name, source }),
        }
    }

    /// Record the fingerprint of a [`TRUST`] secret this pass issues from.
    fn note_used(&self, purpose: SecretPurpose, s: &Secret) {
        if TRUST.contains(&purpose) {
            let data = secret_bytes(s);
            self.used
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(purpose.suffix().to_string(), fingerprint(&data));
        }
    }

    /// Keep `signer.crt` of the cluster CA secret the first certificate of its `tls.crt` (the
    /// controller manager signs with it; a file of one certificate). Only that key is written.
    async fn keep_signer(&self, name: &str, s: &Secret, ck: &CertKey) -> Result<(), SecretError> {
        // `read_ca` checked that the first certificate belongs to the key.
        let signer = pki::first_certificate(&ck.cert_pem)?;
        if text(s, names::SIGNER_CRT).as_deref() == Some(signer.as_str()) {
            return Ok(());
        }
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": s.metadata.resource_version},
            "data": {names::SIGNER_CRT: pki::base64(signer.as_bytes())}
        });
        match self
            .api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(written) => self.remember(written),
            // Changed meanwhile (another component's pass wrote it, most likely): what is
            // there now is what this pass hands out; judged again by the next pass.
            Err(kube::Error::Api(e)) if e.code == 409 => {
                if let Some(fresh) = self.get_fresh(name).await? {
                    self.remember(fresh);
                }
            }
            // A secret nestplane may not write (immutable, another owner): the controller
            // manager, which needs the key, says it is missing; nothing else stops.
            Err(e) => {
                tracing::warn!(secret = %name, error = %e, "cannot add signer.crt to the CA secret");
            }
        }
        Ok(())
    }

    fn read_ca(name: &str, purpose: SecretPurpose, s: &Secret) -> Result<CertKey, SecretError> {
        let (Some(cert_pem), Some(key_pem)) = (text(s, names::TLS_CRT), text(s, names::TLS_KEY))
        else {
            return Err(SecretError::Invalid {
                name: name.into(),
                reason: "it lacks tls.crt or tls.key".into(),
            });
        };
        if purpose != SecretPurpose::ServiceAccount {
            match pki::key_matches(&cert_pem, &key_pem) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(SecretError::Invalid {
                        name: name.into(),
                        reason: "tls.key does not belong to tls.crt".into(),
                    });
                }
                Err(e) => {
                    return Err(SecretError::Invalid {
                        name: name.into(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Ok(CertKey { cert_pem, key_pem })
    }

    /// Keep secret `purpose` holding only `cert_pem` as `tls.crt`: a CA this cluster trusts
    /// but whose key lives elsewhere (a shared datastore's). Written only when it differs.
    pub async fn trust(&self, purpose: SecretPurpose, cert_pem: &str) -> Result<(), SecretError> {
        if let Some(existing) = self.get(purpose).await?
            && text(&existing, names::TLS_CRT).as_deref() == Some(cert_pem)
            && text(&existing, names::TLS_KEY).is_none()
        {
            return Ok(());
        }
        let secret = self.secret(
            purpose,
            BTreeMap::from([(names::TLS_CRT.to_string(), cert_pem.as_bytes().to_vec())]),
            BTreeMap::new(),
        );
        // A secret with a key in it (this tenant's own CA) is not overwritten silently.
        if let Some(existing) = self.get(purpose).await?
            && text(&existing, names::TLS_KEY).is_some()
        {
            return Err(SecretError::Invalid {
                name: purpose.secret_name(&self.cluster),
                reason:
                    "it holds a CA of this cluster's own; a shared datastore's CA would replace it"
                        .into(),
            });
        }
        self.apply(&secret).await
    }

    /// Keep a leaf certificate current; returns it. `ca.cert_pem` is the CA secret's
    /// `tls.crt`: the CA that signs first, then (during a rotation) the others trusted.
    ///
    /// Every certificate must be signed by the CA that signs now (the bundle's first), but for
    /// one thing: while a rotation of the CA keeps `previous.crt` (its `Signing` and `Started`
    /// phases), a serving certificate (and the API server's client certificate to kubelets,
    /// which they verify) that the previous CA signed is kept, so that a client trusting only
    /// that CA keeps verifying the server until the rotation is completed; meanwhile only its
    /// `ca.crt` follows the bundle.
    pub async fn leaf(&self, leaf: &Leaf, ca: &CertKey) -> Result<CertKey, SecretError> {
        let bundle = &ca.cert_pem;
        let want_hash = ca_hash(bundle);
        // Serving certificates, and the API server's client certificate to kubelets (which
        // may trust the old CA alone until a rotation completes), are kept while trusted.
        let serving = leaf.spec.usage != Usage::Client
            || leaf.purpose == SecretPurpose::ApiServerKubeletClient;
        let same_ca = |s: &Secret| {
            s.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CA_HASH_ANNOTATION))
                == Some(&want_hash)
        };
        // The CA a rotation replaces, while its serving certificates are kept.
        let previous = self
            .previous
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&leaf.ca)
            .cloned()
            .filter(|_| serving);
        let signed = |cert_pem: &str| {
            pki::verify_signed_by(cert_pem, bundle).unwrap_or(false)
                || previous
                    .as_deref()
                    .is_some_and(|p| pki::verify_signed_by(cert_pem, p).unwrap_or(false))
        };
        // What nestplane issued: signed by the CA, with the key that belongs to it.
        let genuine = |s: &Secret| -> Option<CertKey> {
            let (cert_pem, key_pem) = (text(s, names::TLS_CRT)?, text(s, names::TLS_KEY)?);
            (signed(&cert_pem) && pki::key_matches(&cert_pem, &key_pem).ok()?)
                .then_some(CertKey { cert_pem, key_pem })
        };
        let trusts_bundle = |s: &Secret| text(s, names::CA_CRT).as_deref() == Some(bundle.as_str());
        let current = |s: &Secret| -> Option<CertKey> {
            genuine(s).filter(|ck| {
                (serving || (same_ca(s) && trusts_bundle(s)))
                    && !pki::needs_renewal(&ck.cert_pem, self.clock.now())
                    && sans_match(&ck.cert_pem, &leaf.spec)
            })
        };
        let written = |ck: &CertKey| {
            self.secret(
                leaf.purpose,
                BTreeMap::from([
                    (names::TLS_CRT.to_string(), ck.cert_pem.clone().into_bytes()),
                    (names::TLS_KEY.to_string(), ck.key_pem.clone().into_bytes()),
                    (names::CA_CRT.to_string(), bundle.clone().into_bytes()),
                ]),
                BTreeMap::from([(CA_HASH_ANNOTATION.to_string(), want_hash.clone())]),
            )
        };
        let (existing, create) = self.existing(leaf.purpose).await?;
        if let Some((s, ck)) = existing.as_ref().and_then(|s| Some((s, current(s)?))) {
            if !(same_ca(s) && trusts_bundle(s)) {
                // A serving certificate still valid under a changed bundle: only what it
                // says it is verified with follows.
                self.apply(&written(&ck)).await?;
            }
            return Ok(ck);
        }
        // Signed by a CA of the bundle with its own key is nestplane's, reissued as planned (a
        // rotation moving it to the CA that signs now); anything else was edited.
        let ours = |s: &Secret| {
            let (Some(cert_pem), Some(key_pem)) =
                (text(s, names::TLS_CRT), text(s, names::TLS_KEY))
            else {
                return false;
            };
            (signed(&cert_pem) || pki::verify_signed_by_any(&cert_pem, bundle))
                && pki::key_matches(&cert_pem, &key_pem).unwrap_or(false)
        };
        if existing.as_ref().is_some_and(|s| same_ca(s) && !ours(s)) {
            self.note_replaced(leaf.purpose, "certificate");
        }
        let ck = pki::issue(ca, &leaf.spec, time::OffsetDateTime::now_utc())?;
        let secret = written(&ck);
        if let Some(theirs) = self.put(&secret, create).await? {
            if let Some(ck) = current(&theirs)
                && same_ca(&theirs)
                && trusts_bundle(&theirs)
            {
                return Ok(ck);
            }
            self.apply(&secret).await?;
        }
        tracing::info!(secret = %leaf.purpose.secret_name(&self.cluster), "issued certificate");
        Ok(ck)
    }

    /// Keep a kubeconfig current (client certificate renewed at half-life, new CA or server
    /// picked up); returns its text.
    pub async fn kubeconfig(
        &self,
        spec: &KubeconfigSpec,
        ca: &CertKey,
    ) -> Result<String, SecretError> {
        let want_hash = ca_hash(&ca.cert_pem);
        let annotated = |s: &Secret| {
            s.metadata.annotations.as_ref().is_some_and(|ann| {
                ann.get(CA_HASH_ANNOTATION) == Some(&want_hash)
                    && ann.get(SERVER_ANNOTATION) == Some(&spec.server)
                    && ann.get(SERVER_NAME_ANNOTATION).map_or("", String::as_str)
                        == spec.server_name.as_deref().unwrap_or_default()
            })
        };
        // `value` is exactly what nestplane writes for this spec, with a client certificate
        // from the CA (so no `exec`, no files, no other server), and `tls.crt` is its
        // certificate. Anything else (an edit) is reissued, never handed to a process.
        let genuine = |s: &Secret| -> Option<String> {
            let value = text(s, names::KUBECONFIG_KEY)?;
            let issued = pki::Issued {
                cluster: &self.cluster,
                server: &spec.server,
                server_name: spec.server_name.as_deref(),
                ca_pem: &ca.cert_pem,
                user: &spec.user,
                groups: &spec.groups,
            };
            let client = pki::verify_issued_kubeconfig(&value, &issued)?;
            (text(s, names::TLS_CRT).as_deref() == Some(client.cert_pem.as_str())).then_some(value)
        };
        let current = |s: &Secret| -> Option<String> {
            let value = genuine(s)?;
            let cert_pem = text(s, names::TLS_CRT)?;
            (annotated(s) && !pki::needs_renewal(&cert_pem, self.clock.now())).then_some(value)
        };
        let (existing, create) = self.existing(spec.purpose).await?;
        let name = spec.purpose.secret_name(&self.cluster);
        let keep = |value: String| {
            self.verified
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(name.clone(), value.clone());
            value
        };
        if let Some(value) = existing.as_ref().and_then(current) {
            return Ok(keep(value));
        }
        if existing
            .as_ref()
            .is_some_and(|s| annotated(s) && genuine(s).is_none())
        {
            self.note_replaced(spec.purpose, "kubeconfig");
        }
        let client = pki::issue(
            ca,
            &LeafSpec {
                common_name: spec.user.clone(),
                organizations: spec.groups.clone(),
                usage: Usage::Client,
                ..LeafSpec::default()
            },
            time::OffsetDateTime::now_utc(),
        )?;
        let value = pki::kubeconfig(
            &self.cluster,
            &spec.server,
            spec.server_name.as_deref(),
            &ca.cert_pem,
            &spec.user,
            &client,
        )?;
        let secret = self.secret(
            spec.purpose,
            BTreeMap::from([
                (
                    names::KUBECONFIG_KEY.to_string(),
                    value.clone().into_bytes(),
                ),
                // The client certificate alone (no key), so renewal can be decided without
                // parsing the kubeconfig.
                (names::TLS_CRT.to_string(), client.cert_pem.into_bytes()),
            ]),
            // Always written (empty without a name): whoever wrote it first, the value is
            // this pass's.
            BTreeMap::from([
                (CA_HASH_ANNOTATION.to_string(), want_hash.clone()),
                (SERVER_ANNOTATION.to_string(), spec.server.clone()),
                (
                    SERVER_NAME_ANNOTATION.to_string(),
                    spec.server_name.clone().unwrap_or_default(),
                ),
            ]),
        );
        if let Some(theirs) = self.put(&secret, create).await? {
            if let Some(value) = current(&theirs) {
                return Ok(keep(value));
            }
            self.apply(&secret).await?;
        }
        tracing::info!(secret = %spec.purpose.secret_name(&self.cluster), "issued kubeconfig");
        Ok(keep(value))
    }

    /// Walk a certificate plan (CAs first, then what they sign); returns the PEM of the CA
    /// that verifies the component's health endpoint, when it has one.
    pub async fn issue(
        &self,
        plan: &nestplane_render::certificates::Plan,
    ) -> Result<Option<String>, SecretError> {
        use nestplane_render::certificates::Issue;
        let mut cas: std::collections::BTreeMap<SecretPurpose, CertKey> = Default::default();
        for item in &plan.items {
            match item {
                Issue::Ca(p) => {
                    let ca = self.ca(*p).await?;
                    cas.insert(*p, ca);
                }
                Issue::Leaf { purpose, ca, spec } => {
                    let signer = cas.get(ca).ok_or_else(|| plan_order(*ca))?;
                    let leaf = Leaf {
                        purpose: *purpose,
                        ca: *ca,
                        spec: spec.clone(),
                    };
                    self.leaf(&leaf, signer).await?;
                }
                Issue::Kubeconfig {
                    purpose,
                    server,
                    server_name,
                    user,
                    groups,
                } => {
                    let signer = cas
                        .get(&SecretPurpose::ClusterCa)
                        .ok_or_else(|| plan_order(SecretPurpose::ClusterCa))?;
                    let spec = KubeconfigSpec {
                        purpose: *purpose,
                        server: server.clone(),
                        server_name: server_name.clone(),
                        user: user.clone(),
                        groups: groups.clone(),
                    };
                    self.kubeconfig(&spec, signer).await?;
                }
            }
        }
        Ok(plan
            .health_ca
            .and_then(|p| cas.get(&p))
            .map(|ca| ca.cert_pem.clone()))
    }

    /// The trust a component is handed this pass (`status.credentials` once it runs it): the
    /// fingerprints of the [`TRUST`] secrets among `data` (what it mounts) and of those its
    /// certificates and kubeconfigs were issued from this pass (a kube-scheduler mounts no CA,
    /// but its kubeconfig carries the cluster CA's bundle and a certificate it signed).
    pub fn credentials(
        &self,
        data: &nestplane_runtime::process::SecretData,
    ) -> BTreeMap<String, String> {
        let mut out = self.used.lock().unwrap_or_else(|e| e.into_inner()).clone();
        out.extend(credentials(&self.cluster, data));
        out
    }

    /// The data of the named secrets (for mounting).
    pub async fn data(
        &self,
        purposes: &[SecretPurpose],
    ) -> Result<nestplane_runtime::process::SecretData, SecretError> {
        let mut out = BTreeMap::new();
        for p in purposes {
            let name = p.secret_name(&self.cluster);
            if let Some(s) = self.get(*p).await? {
                // A kubeconfig is handed out as this pass verified or issued it (an edit that
                // reached the cache since is not), and never runs or reads anything.
                let mut data = secret_bytes(&s);
                if let Some(v) = self
                    .verified
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&name)
                {
                    data.insert(names::KUBECONFIG_KEY.to_string(), v.clone().into_bytes());
                }
                if let Some(value) = data.get(names::KUBECONFIG_KEY) {
                    pki::check_kubeconfig(&String::from_utf8_lossy(value)).map_err(|reason| {
                        SecretError::Invalid {
                            name: name.clone(),
                            reason,
                        }
                    })?;
                }
                out.insert(name, data);
            }
        }
        Ok(out)
    }
}

/// The secrets whose fingerprint a component reports as the trust it runs with.
pub const TRUST: [SecretPurpose; 4] = [
    SecretPurpose::ClusterCa,
    SecretPurpose::EtcdCa,
    SecretPurpose::FrontProxyCa,
    SecretPurpose::ServiceAccount,
];

/// A Secret's data as bytes by key (none: empty). Pure.
pub fn secret_bytes(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    s.data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect()
}

/// A fingerprint of a CA or service-account key secret: its `tls.crt`, the public key of its
/// `tls.key` (what a component trusts and signs with; public material only), and during a CA
/// rotation its `previous.crt`. Pure.
pub fn fingerprint(data: &BTreeMap<String, Vec<u8>>) -> String {
    let text = |k: &str| {
        String::from_utf8_lossy(data.get(k).map(Vec::as_slice).unwrap_or_default()).into_owned()
    };
    let signer = pki::service_account_public_key(&text(names::TLS_KEY)).unwrap_or_default();
    let mut h = Sha256::new();
    for v in [text(names::TLS_CRT), signer] {
        h.update((v.len() as u64).to_be_bytes());
        h.update(v.as_bytes());
    }
    // The CA whose serving certificates a rotation keeps: its removal reissues them, and a
    // component runs the secret as it is only once it runs those.
    if data.contains_key(names::PREVIOUS_CRT) {
        let v = text(names::PREVIOUS_CRT);
        h.update(names::PREVIOUS_CRT.as_bytes());
        h.update((v.len() as u64).to_be_bytes());
        h.update(v.as_bytes());
    }
    format!("{:x}", h.finalize())[..16].to_string()
}

/// The fingerprints of the [`TRUST`] secrets among `data` (what a pass hands a component),
/// by secret suffix (`status.credentials` of the component). Pure.
pub fn credentials(
    cluster: &str,
    data: &nestplane_runtime::process::SecretData,
) -> BTreeMap<String, String> {
    TRUST
        .iter()
        .filter_map(|p| {
            data.get(&p.secret_name(cluster))
                .map(|d| (p.suffix().to_string(), fingerprint(d)))
        })
        .collect()
}

fn sans_match(cert_pem: &str, spec: &LeafSpec) -> bool {
    let Ok(info) = pki::inspect(cert_pem) else {
        return false;
    };
    let mut want_dns = spec.dns_names.clone();
    want_dns.sort();
    want_dns.dedup();
    let mut have_dns = info.dns_names.clone();
    have_dns.sort();
    let mut want_ips = spec.ips.clone();
    want_ips.sort();
    want_ips.dedup();
    let mut have_ips = info.ips.clone();
    have_ips.sort();
    want_dns == have_dns && want_ips == have_ips && info.subject_cn == spec.common_name
}
