//! Rotation of a tenant's service-account key, and of its cluster CA ([`Target`]), in phases,
//! with no moment at which a token or certificate in use is refused. The CA goes through the
//! same phases (docs/operations.md, "Rotating the cluster CA"); what follows is the key's.
//!
//! Asked for with annotation [`names::ROTATE_SA_KEY_ANNOTATION`] on the control plane (or its
//! HostedCluster; `nestplane rotate sa-key`), completed with
//! [`names::ROTATE_SA_KEY_COMPLETE_ANNOTATION`] naming the same request. The `<cluster>-sa`
//! secret is the rotation's only state (its annotations say which request and which phase),
//! so an operator stopped at any point goes on from what the secret holds:
//!
//! 1. `Trusting`: a new key is made; `tls.crt` lists the old and the new public keys, the old
//!    one still signs, the new private key waits in `next.key`. Once every API server runs
//!    this (each replica restarted in turn), a token signed by either key is accepted
//!    everywhere.
//! 2. `Signing`: the new key signs (`tls.key`); both still verify. Once every API server and
//!    controller manager runs it:
//! 3. `Started`: nothing issued before is refused, nothing the user holds has changed; the
//!    rotation waits to be completed.
//! 4. On completion, first the tenant's legacy service-account token Secrets that the old key
//!    signed are emptied, and its tokens controller fills them again with the new key (the
//!    same Secret, so pods that mount them get the new token in place; each such pod is
//!    annotated so that its kubelet writes the new token at once: the API server accepts a
//!    legacy token only while it equals its Secret's). Then `Completing`: only the new public
//!    key verifies. Once every API server runs that:
//! 5. `Completed`. A token the old key signed is refused from then on.
//!
//! [`decide`] is the pure core; [`advance`] reads and writes.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use nestplane_api::names::{self, Component, SecretPurpose};
use nestplane_api::{NestedControlPlane, RotationStatus};
use nestplane_pki as pki;

use crate::context::Context;
use crate::error::Error;
use std::time::Duration;

use crate::handshake::Presented;
use crate::tenant::{self, Tenant};

/// The rotation target of the service-account key (`status.rotations[].target`).
pub const SA_KEY: &str = "sa-key";
/// The rotation target of the cluster CA (`status.rotations[].target`).
pub const CA: &str = "ca";
/// The rotation target of the front-proxy CA (`status.rotations[].target`).
pub const FRONT_PROXY_CA: &str = "front-proxy-ca";
/// Annotation on the `<cluster>-sa` secret: the request its rotation answers.
pub const ID_ANNOTATION: &str = "nestplane.io/rotation-id";
/// Annotation on the `<cluster>-sa` secret: the rotation's phase.
pub const PHASE_ANNOTATION: &str = "nestplane.io/rotation-phase";
/// Annotation on the `<cluster>-sa` secret: when the rotation reached `Started`.
pub const STARTED_AT_ANNOTATION: &str = "nestplane.io/rotation-started-at";
/// Annotation on the rotated CA secret: the fingerprint of the CA being replaced.
pub const RETIRING_ANNOTATION: &str = "nestplane.io/rotation-retiring";
/// Annotation on the rotated CA secret: when every component was seen running it as it is in
/// its phase.
pub const SINCE_ANNOTATION: &str = "nestplane.io/rotation-phase-since";
/// How long a CA file change takes to reach a running API server at most: Kubernetes re-reads
/// `--client-ca-file` (and kubelets their `clientCAFile`) once a minute, so a reported rollout
/// of the new file is not yet proof that the API server verifies with it. Once every component
/// runs the bundle, a CA rotation goes on when every API server's TLS handshake shows the
/// files in use ([`serves`]), or this long after, whichever comes first.
pub const CA_FILE_RELOAD_SECONDS: i64 = 65;
/// Reason of the Events of a rotation's phases.
pub const ROTATION_PROGRESSING: &str = "RotationProgressing";
/// Reason of the Event of a rotation that reached `Started`.
pub const ROTATION_STARTED: &str = "RotationStarted";
/// Reason of the Event of a completed rotation.
pub const ROTATION_COMPLETED: &str = "RotationCompleted";
/// Reason of the Event of a rotation that cannot go on (the secret is not what it should be).
pub const ROTATION_BLOCKED: &str = "RotationBlocked";

/// What a rotation replaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// The service-account key pair (`<cluster>-sa`).
    SaKey,
    /// The cluster CA (`<cluster>-ca`): what API server clients and kubelets present
    /// certificates of, and what verifies the API server.
    Ca,
    /// The front-proxy CA (`<cluster>-proxy`): what signs the API server's client certificate
    /// to aggregated API servers, and what the API server and controller manager trust
    /// request headers (`X-Remote-User`) from. Aggregated API servers read it from
    /// `kube-system/extension-apiserver-authentication`, which the API server publishes.
    FrontProxyCa,
}

impl Target {
    /// Every target, in the order a pass looks at them.
    pub const ALL: [Target; 3] = [Target::SaKey, Target::Ca, Target::FrontProxyCa];

    /// A CA (not a key pair): its bundle holds certificates, the first of which signs.
    fn is_ca(self) -> bool {
        self != Target::SaKey
    }

    /// The name users give it (`nestplane rotate NAME`, `status.rotations[].target`).
    pub fn as_str(self) -> &'static str {
        match self {
            Target::SaKey => SA_KEY,
            Target::Ca => CA,
            Target::FrontProxyCa => FRONT_PROXY_CA,
        }
    }

    /// The secret it lives in.
    pub fn purpose(self) -> SecretPurpose {
        match self {
            Target::SaKey => SecretPurpose::ServiceAccount,
            Target::Ca => SecretPurpose::ClusterCa,
            Target::FrontProxyCa => SecretPurpose::FrontProxyCa,
        }
    }

    /// The annotation asking for a rotation.
    pub fn start_annotation(self) -> &'static str {
        match self {
            Target::SaKey => names::ROTATE_SA_KEY_ANNOTATION,
            Target::Ca => names::ROTATE_CA_ANNOTATION,
            Target::FrontProxyCa => names::ROTATE_FRONT_PROXY_CA_ANNOTATION,
        }
    }

    /// The annotation completing a rotation.
    pub fn complete_annotation(self) -> &'static str {
        match self {
            Target::SaKey => names::ROTATE_SA_KEY_COMPLETE_ANNOTATION,
            Target::Ca => names::ROTATE_CA_COMPLETE_ANNOTATION,
            Target::FrontProxyCa => names::ROTATE_FRONT_PROXY_CA_COMPLETE_ANNOTATION,
        }
    }

    /// The annotation completing a rotation by itself after a while.
    pub fn complete_after_annotation(self) -> &'static str {
        match self {
            Target::SaKey => names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION,
            Target::Ca => names::ROTATE_CA_COMPLETE_AFTER_ANNOTATION,
            Target::FrontProxyCa => names::ROTATE_FRONT_PROXY_CA_COMPLETE_AFTER_ANNOTATION,
        }
    }

    /// The components that read the secret, whose `status.credentials` say which version of
    /// it they run.
    fn consumers(self) -> &'static [Component] {
        match self {
            Target::SaKey => &[Component::ApiServer, Component::ControllerManager],
            Target::Ca => &[
                Component::ApiServer,
                Component::ControllerManager,
                Component::Scheduler,
            ],
            // `--requestheader-client-ca-file`; the API server's client certificate.
            Target::FrontProxyCa => &[Component::ApiServer, Component::ControllerManager],
        }
    }

    /// What it is, in a sentence.
    fn what(self) -> &'static str {
        match self {
            Target::SaKey => "service-account key",
            Target::Ca => "cluster CA",
            Target::FrontProxyCa => "front-proxy CA",
        }
    }

    /// One of what it holds, in a sentence.
    fn noun(self) -> &'static str {
        match self {
            Target::SaKey => "key",
            Target::Ca | Target::FrontProxyCa => "CA",
        }
    }

    /// The public items of a bundle (`tls.crt`): public keys, or CA certificates.
    fn items(self, bundle: &str) -> Result<Vec<String>, pki::PkiError> {
        match self {
            Target::SaKey => pki::public_keys(bundle),
            Target::Ca | Target::FrontProxyCa => pki::certificates(bundle),
        }
    }

    /// The name of a public item: a key's `kid`, a CA certificate's fingerprint.
    fn ident(self, item: &str) -> Option<String> {
        match self {
            Target::SaKey => pki::service_account_key_id(item).ok(),
            Target::Ca | Target::FrontProxyCa => pki::certificate_id(item).ok(),
        }
    }

    /// The name of the public item among `items` that private key `key` belongs to
    /// (`None`: the key does not parse, or none of them is its own).
    fn ident_of_key(self, key: &str, items: &[String]) -> Option<String> {
        match self {
            Target::SaKey => pki::service_account_public_key(key)
                .ok()
                .and_then(|p| pki::service_account_key_id(&p).ok())
                .filter(|k| items.iter().any(|i| self.ident(i).as_ref() == Some(k))),
            Target::Ca | Target::FrontProxyCa => items
                .iter()
                .find(|c| pki::key_matches(c, key).unwrap_or(false))
                .and_then(|c| self.ident(c)),
        }
    }
}

/// A rotation's phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Trusting,
    Signing,
    Started,
    Completing,
    Completed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Trusting => "Trusting",
            Phase::Signing => "Signing",
            Phase::Started => "Started",
            Phase::Completing => "Completing",
            Phase::Completed => "Completed",
        }
    }

    fn parse(s: &str) -> Option<Phase> {
        [
            Phase::Trusting,
            Phase::Signing,
            Phase::Started,
            Phase::Completing,
            Phase::Completed,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
    }
}

/// The service-account key secret, as a rotation reads and writes it (its `Debug` shows no
/// private key).
#[derive(Clone, PartialEq, Eq)]
pub struct Keys {
    /// `tls.crt`: the public keys that verify (PEM, one or more).
    pub verify: String,
    /// `tls.key`: the private key that signs.
    pub signing: String,
    /// `next.key`: the new private key while it is trusted but does not sign.
    pub next: Option<String>,
    /// The request the last or current rotation answers.
    pub id: Option<String>,
    /// Its phase (`None`: never rotated, or an unknown value).
    pub phase: Option<Phase>,
    /// When it reached `Started` (seconds since the epoch).
    pub started_at: Option<i64>,
    /// When every consumer was seen running the secret of this phase (seconds since the
    /// epoch; a CA rotation waits for the API servers to re-read their CA file after).
    pub since: Option<i64>,
    /// `previous.crt` of a CA rotation in `Signing` and `Started`: the CA replaced, whose
    /// serving certificates are kept meanwhile.
    pub previous: Option<String>,
    /// The fingerprint of the CA a CA rotation drops once its serving certificates have been
    /// reissued (from `Signing` until `Completed`: after it is dropped from the bundle, the
    /// API servers may trust it until they re-read the file).
    pub retiring: Option<String>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("verify", &self.verify)
            .field("signing", &"<redacted>")
            .field("next", &self.next.as_ref().map(|_| "<redacted>"))
            .field("id", &self.id)
            .field("phase", &self.phase)
            .field("started_at", &self.started_at)
            .field("since", &self.since)
            .field("previous", &self.previous)
            .field("retiring", &self.retiring)
            .finish()
    }
}

/// What the control plane's annotations ask for, and when.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ask {
    /// A rotation, named.
    pub start: Option<String>,
    /// The completion of the rotation so named.
    pub complete: Option<String>,
    /// Completion by itself this long after `Started` (`90s`, `30m`, `24h`, `2d`).
    pub complete_after: Option<String>,
    /// The time of this pass (seconds since the epoch).
    pub now: i64,
    /// What stops the rotation from completing, for now (it waits, saying so).
    pub hold: Option<String>,
    /// Every API server was seen serving the secrets as they are now, in its TLS handshake
    /// ([`serves`]): a CA rotation need not wait for them to re-read their files.
    pub served: bool,
}

/// `90s`, `30m`, `24h`, `2d` in seconds (`None`: not such a duration). Pure.
pub fn parse_duration(s: &str) -> Option<i64> {
    let s = s.trim();
    let last = s.chars().last()?;
    let n: i64 = s[..s.len() - last.len_utf8()]
        .parse()
        .ok()
        .filter(|n| *n >= 0)?;
    let unit = match last {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return None,
    };
    n.checked_mul(unit)
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing: no rotation asked for, or the one asked for is done.
    Idle,
    /// Write the secret so (the next phase).
    Write(Keys),
    /// Completion: re-sign the tenant's legacy tokens with the new key, then write this.
    Resign(Keys),
    /// Wait: the message says for what.
    Wait(String),
    /// The secret is not what a rotation wrote: nothing is changed.
    Blocked(String),
}

/// The longest name of a request (it goes into status, Events and pods' annotations).
pub const MAX_ID: usize = 128;

fn bundle(keys: &[String]) -> String {
    keys.concat()
}

/// A request's name as it may be shown (status, Events, messages, pods' annotations): at most
/// [`MAX_ID`] characters, none of them control characters. Pure.
pub fn clean(id: &str) -> String {
    id.chars()
        .filter(|c| !c.is_control())
        .take(MAX_ID)
        .collect()
}

fn valid(id: &str) -> bool {
    clean(id) == id && !id.is_empty()
}

/// The next step of rotation `target`, from its secret, the request, and which consumers (by
/// kind) do not run the secret as it is yet. `new` makes a key pair, or a CA (called only
/// when a rotation begins). Pure but for `new`.
pub fn decide(
    target: Target,
    keys: &Keys,
    ask: &Ask,
    lagging: &[String],
    new: impl FnOnce() -> Result<pki::CertKey, pki::PkiError>,
) -> Decision {
    // A CA file reaches a running API server within a minute of its rollout: the CA
    // rotation's phases that change what the API servers trust note when every consumer runs
    // the file, and wait until the API servers' handshakes show it in use, or that long.
    // The front-proxy CA's `Signing` too: the API servers re-read their client certificate to
    // aggregated API servers within that minute, and no handshake of theirs shows it.
    let reissued = target == Target::FrontProxyCa && keys.phase == Some(Phase::Signing);
    let settling = target.is_ca()
        && lagging.is_empty()
        && (matches!(keys.phase, Some(Phase::Trusting) | Some(Phase::Completing)) || reissued);
    if settling && (reissued || !ask.served) {
        match keys.since {
            None => {
                return Decision::Write(Keys {
                    since: Some(ask.now),
                    ..keys.clone()
                });
            }
            Some(since) => {
                let at = since.saturating_add(CA_FILE_RELOAD_SECONDS);
                if ask.now < at {
                    let t = k8s_openapi::jiff::Timestamp::from_second(at)
                        .map(|t| t.to_string())
                        .unwrap_or_default();
                    return Decision::Wait(if reissued {
                        format!(
                            "every component runs the new CA's client certificate; waiting for the API servers to re-read it (they do once a minute): going on at {t}"
                        )
                    } else {
                        format!(
                            "every component runs the CA bundle as it is now; waiting for the API servers to re-read it (they do once a minute; their TLS handshakes show when): going on at {t} at the latest"
                        )
                    });
                }
            }
        }
    }
    match decide_phase(target, keys, ask, lagging, new) {
        Decision::Write(k) => Decision::Write(Keys { since: None, ..k }),
        Decision::Resign(k) => Decision::Resign(Keys { since: None, ..k }),
        d => d,
    }
}

fn decide_phase(
    target: Target,
    keys: &Keys,
    ask: &Ask,
    lagging: &[String],
    new: impl FnOnce() -> Result<pki::CertKey, pki::PkiError>,
) -> Decision {
    let noun = target.noun();
    let waiting_for = || format!("waiting for {} to run it", lagging.join(" and "));
    // The bundle is rewritten whole: what it holds must be understood, and hold what signs,
    // or something in use could be dropped.
    let items = match target.items(&keys.verify) {
        Ok(v) if !v.is_empty() => v,
        Ok(_) => {
            return Decision::Blocked(format!("its tls.crt holds no {noun}; fix the secret"));
        }
        Err(e) => return Decision::Blocked(format!("its tls.crt: {e}")),
    };
    if pki::service_account_public_key(&keys.signing).is_err() {
        return Decision::Blocked("its tls.key does not parse".into());
    }
    let Some(signer) = target.ident_of_key(&keys.signing, &items) else {
        return Decision::Blocked(format!(
            "its tls.crt does not hold the {} of tls.key, which signs; fix the secret",
            match target {
                Target::SaKey => "public key",
                Target::Ca | Target::FrontProxyCa => "certificate",
            }
        ));
    };
    // Kubernetes signs with the first certificate of a CA file.
    if target.is_ca() && target.ident(&items[0]).as_ref() != Some(&signer) {
        return Decision::Blocked(
            "its tls.crt does not begin with the certificate of tls.key, which signs; fix the secret"
                .into(),
        );
    }
    let id = keys.id.as_deref().map(clean).unwrap_or_default();
    let (start_annotation, complete_annotation) =
        (target.start_annotation(), target.complete_annotation());
    match keys.phase {
        None | Some(Phase::Completed) => match &ask.start {
            Some(r) if Some(r) != keys.id.as_ref() => {
                if !valid(r) {
                    return Decision::Blocked(format!(
                        "annotation {start_annotation} names the request in at most {MAX_ID} printable characters"
                    ));
                }
                let new = match new() {
                    Ok(k) => k,
                    Err(e) => return Decision::Blocked(format!("cannot make a {noun}: {e}")),
                };
                let mut all = items;
                all.push(new.cert_pem.clone());
                Decision::Write(Keys {
                    verify: bundle(&all),
                    signing: keys.signing.clone(),
                    next: Some(new.key_pem),
                    id: Some(r.clone()),
                    phase: Some(Phase::Trusting),
                    started_at: None,
                    since: None,
                    previous: None,
                    retiring: None,
                })
            }
            _ => Decision::Idle,
        },
        Some(Phase::Trusting) => {
            let Some(next) = &keys.next else {
                return Decision::Blocked(format!(
                    "phase Trusting without {}; fix the secret or set its {PHASE_ANNOTATION} annotation to Completed",
                    names::NEXT_KEY
                ));
            };
            if pki::service_account_public_key(next).is_err() {
                return Decision::Blocked(format!("its {} does not parse", names::NEXT_KEY));
            }
            let Some(new_id) = target.ident_of_key(next, &items) else {
                return Decision::Blocked(format!(
                    "phase Trusting, but its tls.crt does not hold the {} of {}; fix the secret",
                    match target {
                        Target::SaKey => "public key",
                        Target::Ca | Target::FrontProxyCa => "certificate",
                    },
                    names::NEXT_KEY
                ));
            };
            if !lagging.is_empty() {
                return Decision::Wait(format!(
                    "the new {noun} is trusted beside the old one; {}",
                    waiting_for()
                ));
            }
            // The new one first (it signs), then every other one still trusted.
            let (new_items, others): (Vec<String>, Vec<String>) = items
                .into_iter()
                .partition(|i| target.ident(i).as_ref() == Some(&new_id));
            // A CA rotation keeps the serving certificates the old CA signed until it
            // completes (a client that trusts only the old CA verifies them).
            let old_item = others
                .iter()
                .find(|i| target.ident(i).as_ref() == Some(&signer))
                .cloned();
            let (previous, retiring) = match target {
                Target::SaKey => (None, None),
                Target::Ca => (old_item, Some(signer.clone())),
                // It signs no serving certificate: nothing to keep.
                Target::FrontProxyCa => (None, Some(signer.clone())),
            };
            Decision::Write(Keys {
                verify: bundle(&[new_items, others].concat()),
                signing: next.clone(),
                next: None,
                id: keys.id.clone(),
                phase: Some(Phase::Signing),
                started_at: None,
                since: None,
                previous,
                retiring,
            })
        }
        Some(Phase::Signing) => {
            if !lagging.is_empty() {
                return Decision::Wait(format!(
                    "the new {noun} signs, both are trusted; {}",
                    waiting_for()
                ));
            }
            Decision::Write(Keys {
                phase: Some(Phase::Started),
                started_at: Some(ask.now),
                ..keys.clone()
            })
        }
        Some(Phase::Started) => {
            let after = match ask.complete_after.as_deref().map(parse_duration) {
                None => None,
                Some(Some(d)) => Some(d),
                Some(None) => {
                    return Decision::Wait(format!(
                        "annotation {} is not a duration (like 24h); the rotation waits to be completed",
                        target.complete_after_annotation()
                    ));
                }
            };
            let due = after
                .zip(keys.started_at)
                .map(|(d, at)| at.saturating_add(d));
            let asked = ask.complete.is_some() && ask.complete == keys.id;
            if asked || due.is_some_and(|due| ask.now >= due) {
                if !lagging.is_empty() {
                    return Decision::Wait(format!(
                        "completing: the new {noun} signs, both are trusted; {}",
                        waiting_for()
                    ));
                }
                if let Some(hold) = &ask.hold {
                    return Decision::Wait(format!("cannot complete: {hold}"));
                }
                return match target {
                    // The legacy tokens the old key signed are re-signed first, then it goes.
                    Target::SaKey => {
                        let signer_item: Vec<String> = items
                            .into_iter()
                            .filter(|i| target.ident(i).as_ref() == Some(&signer))
                            .collect();
                        Decision::Resign(Keys {
                            verify: bundle(&signer_item),
                            phase: Some(Phase::Completing),
                            next: None,
                            ..keys.clone()
                        })
                    }
                    // The serving certificates the old CA signed are reissued from the new
                    // one first, while both are trusted; the old CA is dropped after.
                    Target::Ca | Target::FrontProxyCa => Decision::Write(Keys {
                        phase: Some(Phase::Completing),
                        next: None,
                        previous: None,
                        ..keys.clone()
                    }),
                };
            }
            let queued = match &ask.start {
                Some(r) if Some(r) != keys.id.as_ref() => format!(
                    "; the rotation asked for as {:?} waits until this one completes",
                    clean(r)
                ),
                _ => String::new(),
            };
            let by_itself = match (after, due) {
                (Some(_), None) => "; it cannot complete by itself: when it reached Started is not known (an operator before that was recorded); complete it with --complete".to_string(),
                _ => due
                    .and_then(|due| k8s_openapi::jiff::Timestamp::from_second(due).ok())
                    .map(|t| format!("; it completes by itself at {t}"))
                    .unwrap_or_default(),
            };
            let then = match target {
                Target::SaKey => format!(
                    "the new key signs and both verify; nothing issued before is refused until the rotation is completed (nestplane rotate sa-key --complete, or annotation {complete_annotation}={id}), which re-signs the cluster's legacy token Secrets and drops the old key: complete it once every token the old key signed has been replaced (kubelets refresh pods' projected tokens within 24 h)"
                ),
                Target::FrontProxyCa => format!(
                    "the new CA signs the API server's client certificate to aggregated API servers, and both CAs are trusted for request headers; a certificate the old CA signed still vouches for the user it names until the rotation is completed (nestplane rotate front-proxy-ca --complete, or annotation {complete_annotation}={id}), which drops the old CA: complete it once every aggregated API server of the cluster has read the new one from kube-system/extension-apiserver-authentication (they do within seconds)"
                ),
                Target::Ca => format!(
                    "the new CA signs client certificates and both CAs are trusted; every kubeconfig and certificate issued before keeps working until the rotation is completed (nestplane rotate ca --complete, or annotation {complete_annotation}={id}), which reissues the serving certificates from the new CA and drops the old one: complete it once every kubeconfig users hold trusts the new CA (nestplane kubeconfig gives one that trusts both)"
                ),
            };
            Decision::Wait(format!("{then}{by_itself}{queued}"))
        }
        Some(Phase::Completing) => {
            let retiring = keys
                .retiring
                .as_ref()
                .filter(|r| items.iter().any(|i| target.ident(i).as_ref() == Some(*r)));
            if !lagging.is_empty() {
                return Decision::Wait(match retiring {
                    Some(_) => format!(
                        "the serving certificates are reissued from the new CA while both are trusted; {}",
                        waiting_for()
                    ),
                    None => format!("the old {noun} is dropped; {}", waiting_for()),
                });
            }
            if let Some(r) = retiring {
                // Only the CA replaced goes: any other the bundle held before stays.
                let kept: Vec<String> = items
                    .into_iter()
                    .filter(|i| target.ident(i).as_ref() != Some(r))
                    .collect();
                // `retiring` stays until Completed: the API servers may trust the CA until
                // they re-read the file, and `serves` must know which one went.
                return Decision::Write(Keys {
                    verify: bundle(&kept),
                    ..keys.clone()
                });
            }
            Decision::Write(Keys {
                phase: Some(Phase::Completed),
                retiring: None,
                ..keys.clone()
            })
        }
    }
}

/// `status.rotations[]` of the secret as it is (after `decide`'s write, when there was one).
/// Pure.
pub fn status(target: Target, keys: &Keys, message: Option<String>) -> Option<RotationStatus> {
    let (id, phase) = (clean(keys.id.as_deref()?), keys.phase?);
    let items = target.items(&keys.verify).unwrap_or_default();
    let key_id = target.ident_of_key(keys.next.as_deref().unwrap_or(&keys.signing), &items);
    let retiring = keys
        .retiring
        .clone()
        .filter(|_| matches!(phase, Phase::Signing | Phase::Started | Phase::Completing));
    let previous_key_id = retiring.or_else(|| {
        items
            .iter()
            .filter_map(|i| target.ident(i))
            .find(|k| Some(k) != key_id.as_ref())
    });
    Some(RotationStatus {
        target: target.as_str().into(),
        id,
        phase: phase.as_str().into(),
        message: message.filter(|m| !m.is_empty()),
        key_id,
        previous_key_id,
    })
}

fn text(s: &Secret, key: &str) -> Option<String> {
    s.data
        .as_ref()?
        .get(key)
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
}

/// The rotation's view of the secret (`None`: it lacks `tls.crt` or `tls.key`).
pub fn read(s: &Secret) -> Option<Keys> {
    let ann = |k: &str| s.metadata.annotations.as_ref()?.get(k).cloned();
    Some(Keys {
        verify: text(s, names::TLS_CRT)?,
        signing: text(s, names::TLS_KEY)?,
        next: text(s, names::NEXT_KEY),
        id: ann(ID_ANNOTATION),
        phase: ann(PHASE_ANNOTATION).and_then(|p| Phase::parse(&p)),
        started_at: ann(STARTED_AT_ANNOTATION)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_second()),
        since: ann(SINCE_ANNOTATION)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_second()),
        previous: text(s, names::PREVIOUS_CRT),
        retiring: ann(RETIRING_ANNOTATION),
    })
}

/// The request annotations of a control plane for rotation `target`.
pub fn ask(target: Target, ncp: &NestedControlPlane) -> Ask {
    let ann = |k: &str| {
        ncp.metadata
            .annotations
            .as_ref()?
            .get(k)
            .filter(|v| !v.is_empty())
            .cloned()
    };
    Ask {
        start: ann(target.start_annotation()),
        complete: ann(target.complete_annotation()),
        complete_after: ann(target.complete_after_annotation()),
        now: k8s_openapi::jiff::Timestamp::now().as_second(),
        hold: None,
        served: false,
    }
}

/// Whether every API server replica's handshake (`presented`, one per replica) shows it runs
/// the files as they are now: it presents `serving` (its certificate's DER), and asks client
/// certificates of exactly the CAs of `rotated` and `other` (its `--client-ca-file` and
/// `--requestheader-client-ca-file`, the one being rotated first: one name per certificate, a
/// certificate in both files named once, as Go's certificate pool keeps it). A CA rotation's
/// phase adds or drops a CA, so a server that has not re-read its file names one too many or
/// too few, unless the CA dropped (`retiring`, by fingerprint) is in the other file too: then
/// nothing can be told apart, and this says no. No replica: not seen. Pure.
pub fn serves(
    presented: &[Presented],
    rotated: &str,
    other: &str,
    serving: &str,
    retiring: Option<&str>,
) -> bool {
    let (Ok(cluster), Ok(proxy), Ok(cert)) = (
        pki::certificates(rotated),
        pki::certificates(other),
        pki::first_certificate(serving).and_then(|c| pki::certificate_der(&c)),
    ) else {
        return false;
    };
    let has = |bundle: &[String], id: &str| {
        bundle
            .iter()
            .any(|c| pki::certificate_id(c).ok().as_deref() == Some(id))
    };
    if retiring.is_some_and(|r| !has(&cluster, r) && has(&proxy, r)) {
        return false;
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut want = Vec::new();
    for c in cluster.iter().chain(&proxy) {
        let (Ok(der), Ok(subject)) = (pki::certificate_der(c), pki::subjects(c)) else {
            return false;
        };
        if seen.insert(der) {
            want.extend(subject);
        }
    }
    want.sort();
    !presented.is_empty()
        && presented.iter().all(|p| {
            let mut asked = p.client_cas.clone();
            asked.sort();
            p.certificate == cert && asked == want
        })
}

/// What every API server replica of `t` presents now ([`serves`]); `None` where one is not
/// known (a runtime that does not say where its replicas are) or does not answer.
async fn presented_by_api_servers(ctx: &Context, t: &Tenant) -> Option<Vec<Presented>> {
    let replicas = ctx.runtime.apiserver_replicas(&t.ncp);
    // Fewer than the spec asks for (a scale-up its status does not say yet): one unseen.
    if replicas.is_empty() || replicas.len() < t.replicas(Component::ApiServer) as usize {
        return None;
    }
    let shakes = futures::future::join_all(
        replicas
            .into_iter()
            .map(|a| crate::handshake::presented(a, std::time::Duration::from_secs(3))),
    )
    .await;
    let mut out = Vec::new();
    for shake in shakes {
        match shake {
            Ok(p) => out.push(p),
            Err(e) => {
                tracing::debug!(error = %e, "an API server's handshake");
                return None;
            }
        }
    }
    Some(out)
}

/// The consumers (by kind) whose status does not say they run the secret `data` as it is (one
/// not made yet among them). `Err`: a consumer this operator does not run, which says nothing
/// of what it runs, so the rotation cannot move on.
fn lagging(
    ctx: &Context,
    t: &Tenant,
    target: Target,
    data: &BTreeMap<String, Vec<u8>>,
) -> Result<Vec<String>, String> {
    let want = crate::secrets::fingerprint(data);
    let suffix = target.purpose().suffix();
    let mut late = Vec::new();
    for c in target.consumers().iter().copied() {
        let kind = tenant::kind_of(c);
        if let Some(m) = t.managed_elsewhere(c) {
            return Err(format!(
                "{kind} is run by {m}, which does not report what it runs (status.credentials.{suffix}); the rotation cannot tell when it runs the new {}",
                target.noun()
            ));
        }
        if !ctx.runs_here(t, c) {
            return Err(format!(
                "{kind} is run by another operator (--controllers); the rotation cannot tell when it runs the new {}",
                target.noun()
            ));
        }
        if t.meta_of(c).is_none() {
            late.push(format!("{kind} (not made yet)"));
        } else if t.status_of(c).and_then(|s| s.credentials.get(suffix)) != Some(&want) {
            late.push(kind.to_string());
        }
    }
    Ok(late)
}

/// How soon a rotation in progress is looked at again (its consumers' status changes bring
/// it back sooner).
pub const RECHECK: Duration = Duration::from_secs(5);
/// How soon a completion held by the tenant's nodes is looked at again (their removal is no
/// event here; each look lists the tenant's Nodes and bootstrap tokens).
pub const HELD_RECHECK: Duration = Duration::from_secs(15);

fn soonest(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One step of each of the tenant's rotations that was ever asked for. Returns their status
/// (a rotation never asked for has none; the last status of one stays), and whether one is in
/// progress (how soon to look again). A failure (the management or the tenant's API, a slow tenant)
/// is said in the status and tried again; it never stops the control plane's pass.
pub async fn advance(ctx: &Context, t: &Tenant) -> (Vec<RotationStatus>, Option<Duration>) {
    let mut out = Vec::new();
    let mut soon: Option<Duration> = None;
    for target in Target::ALL {
        match step(ctx, t, target).await {
            Ok((st, again)) => {
                out.extend(st);
                soon = soonest(soon, again);
            }
            Err(e) => {
                tracing::warn!(error = %e, target = target.as_str(), "rotating");
                let last = t
                    .ncp
                    .status
                    .as_ref()
                    .and_then(|s| {
                        s.rotations
                            .iter()
                            .find(|r| r.target == target.as_str())
                            .cloned()
                    })
                    .map(|mut r| {
                        r.message = Some(format!("cannot go on now (tried again shortly): {e}"));
                        r
                    });
                out.extend(last);
                soon = soonest(soon, Some(RECHECK));
            }
        }
    }
    (out, soon)
}

/// Whether the tenant's controller manager publishes `bundle` as `kube-root-ca.crt` (what pods
/// verify the API server with): read from `kube-system`, which it publishes to like every
/// namespace, once it leads. A cluster without one has nothing to wait for.
async fn root_ca_published(ctx: &Context, t: &Tenant, bundle: &str) -> Result<bool, Error> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let Some(client) =
        crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster()).await?
    else {
        return Ok(false);
    };
    let published = Api::<ConfigMap>::namespaced(client, "kube-system")
        .get_opt("kube-root-ca.crt")
        .await?
        .and_then(|c| c.data)
        .and_then(|d| d.get("ca.crt").cloned());
    let ids = |pem: &str| {
        pki::certificates(pem)
            .map(|c| {
                c.iter()
                    .filter_map(|c| pki::certificate_id(c).ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    // None at all: nothing publishes it (a controller manager without its publisher), and
    // nothing waits for it.
    Ok(published.is_none_or(|p| ids(&p) == ids(bundle)))
}

/// Whether every API server of `t` was seen, in its handshake, serving the bundle of CA
/// `target` as `keys` hold it, the other CA it asks client certificates of (the cluster CA,
/// the front-proxy CA) and the serving certificate as their secrets hold them now.
async fn api_servers_serve(
    ctx: &Context,
    t: &Tenant,
    target: Target,
    keys: &Keys,
) -> Result<bool, Error> {
    let other = match target {
        Target::Ca => SecretPurpose::FrontProxyCa,
        Target::FrontProxyCa => SecretPurpose::ClusterCa,
        Target::SaKey => return Ok(false),
    };
    let Some(presented) = presented_by_api_servers(ctx, t).await else {
        return Ok(false);
    };
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &t.namespace());
    let cluster = t.cluster();
    let crt = |s: Option<Secret>| s.as_ref().and_then(|s| text(s, names::TLS_CRT));
    let other = crt(api.get_opt(&other.secret_name(&cluster)).await?);
    let serving = crt(api
        .get_opt(&SecretPurpose::ApiServer.secret_name(&cluster))
        .await?);
    let (Some(other), Some(serving)) = (other, serving) else {
        return Ok(false);
    };
    Ok(serves(
        &presented,
        &keys.verify,
        &other,
        &serving,
        keys.retiring.as_deref(),
    ))
}

/// The ConfigMap of the tenant's `kube-system` in which its API servers publish the CAs they
/// trust to aggregated API servers (which read it to verify clients and the API server's
/// proxied requests). The API servers add what their files hold and never drop anything.
pub const AUTHENTICATION_CONFIG_MAP: &str = "extension-apiserver-authentication";

/// The key of [`AUTHENTICATION_CONFIG_MAP`] that publishes CA `target`'s bundle.
fn published_as(target: Target) -> Option<&'static str> {
    match target {
        Target::Ca => Some("client-ca-file"),
        Target::FrontProxyCa => Some("requestheader-client-ca-file"),
        Target::SaKey => None,
    }
}

/// What the API servers publish for aggregated API servers under `target`'s key: the
/// tenant's admin client, the ConfigMap's resourceVersion, and the bundle (`None`: nothing is
/// published). `None` at all: no admin kubeconfig yet.
async fn published(
    ctx: &Context,
    t: &Tenant,
    target: Target,
) -> Result<Option<(kube::Client, Option<String>, Option<String>)>, Error> {
    use k8s_openapi::api::core::v1::ConfigMap;
    let Some(client) =
        crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster()).await?
    else {
        return Ok(None);
    };
    let Some(key) = published_as(target) else {
        return Ok(Some((client, None, None)));
    };
    let cm = Api::<ConfigMap>::namespaced(client.clone(), "kube-system")
        .get_opt(AUTHENTICATION_CONFIG_MAP)
        .await?;
    let version = cm
        .as_ref()
        .and_then(|c| c.metadata.resource_version.clone());
    let pem = cm.and_then(|c| c.data).and_then(|d| d.get(key).cloned());
    Ok(Some((client, version, pem)))
}

/// What the API servers' publication for aggregated API servers lacks of `bundle` (`None`:
/// nothing; a cluster whose API servers publish nothing has nothing to wait for): said as
/// what the rotation waits for.
async fn aggregated_told(
    ctx: &Context,
    t: &Tenant,
    target: Target,
    bundle: &str,
) -> Result<Option<String>, Error> {
    let waiting = format!(
        "{} (to publish it in kube-system/{AUTHENTICATION_CONFIG_MAP} for aggregated API servers)",
        tenant::kind_of(Component::ApiServer)
    );
    let pem = match published(ctx, t, target).await? {
        None => return Ok(Some("the admin kubeconfig".into())),
        Some((_, _, None)) => return Ok(None),
        Some((_, _, Some(pem))) => pem,
    };
    // Split as PEM only: a block the tenant's admin added that is not a certificate hides
    // nothing.
    let Ok(have) = pki::certificate_ids(&pem) else {
        return Ok(Some(format!(
            "{waiting}: its {} is not PEM (a tenant admin's edit?)",
            published_as(target).unwrap_or_default()
        )));
    };
    let all = pki::certificate_ids(bundle).unwrap_or_default();
    Ok((!all.iter().all(|id| have.contains(id))).then_some(waiting))
}

/// Drops CA `retired` (a fingerprint) from what the API servers publish to aggregated API
/// servers, every other block as it is (`pki::without_certificate`). `None`: it is not
/// published (any more); otherwise what the rotation waits for (it was removed now, the
/// write lost a race, or the ConfigMap cannot be read as PEM): looked at again.
async fn unpublished(
    ctx: &Context,
    t: &Tenant,
    target: Target,
    retired: &str,
) -> Result<Option<String>, Error> {
    let Some(key) = published_as(target) else {
        return Ok(None);
    };
    let removing = format!(
        "the old {} is dropped; removing it from kube-system/{AUTHENTICATION_CONFIG_MAP}, where aggregated API servers read what to trust",
        target.noun()
    );
    let (client, version, pem) = match published(ctx, t, target).await? {
        None => {
            return Ok(Some(format!(
                "{removing}: waiting for the admin kubeconfig"
            )));
        }
        Some((_, _, None)) => return Ok(None),
        Some((client, version, Some(pem))) => (client, version, pem),
    };
    let kept = match pki::without_certificate(&pem, retired) {
        Ok(None) => return Ok(None),
        Ok(Some(kept)) => kept,
        Err(_) => {
            return Ok(Some(format!(
                "{removing}: its {key} is not PEM (a tenant admin's edit?); it is looked at again"
            )));
        }
    };
    // That one key, over the version read: the API servers add what they trust, and a write
    // between the read and this one is not overwritten (the next pass reads again).
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": version},
        "data": { key: kept },
    });
    match Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client, "kube-system")
        .patch(
            AUTHENTICATION_CONFIG_MAP,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    tracing::info!(
        namespace = %t.namespace(),
        cluster = %t.cluster(),
        target = target.as_str(),
        "dropped the retired CA from kube-system/{AUTHENTICATION_CONFIG_MAP}"
    );
    Ok(Some(removing))
}

/// Why a CA rotation may not complete yet (`None`: it may): the cluster's nodes that this
/// operator does not run (`moved` names those it does, which follow the CA phase by phase,
/// [`retrust_nodes`]), and the machines joining it. Their kubelets were given the old CA
/// only, and present certificates it signed, so dropping it would cut them off. A machine
/// that has not registered yet is seen by its bootstrap token (a NodePool makes one per node
/// and deletes it once the node has registered; a tenant admin joining a machine of their own
/// makes one too).
async fn nodes_hold(
    ctx: &Context,
    t: &Tenant,
    moved: &crate::hosted::pool::machines::Retrusted,
) -> Result<Option<String>, Error> {
    use k8s_openapi::api::core::v1::Node;
    let Some(client) =
        crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster()).await?
    else {
        return Ok(Some("waiting for the admin kubeconfig".into()));
    };
    const CUT_OFF: &str = "whose kubelets nestplane does not run (a machine joined by hand or through Cluster API): they trust only the old CA and present certificates it signed, so completing would cut them off (the rotation stays Started: everything keeps working)";
    // Tokens first: a node's token is deleted only once its Node exists, so a machine that
    // registers between the two lists is seen by one of them. A page: the nodes nestplane
    // runs here are few, so a page of them holds one it does not run, if there is one.
    let tokens = Api::<Secret>::namespaced(client.clone(), "kube-system")
        .list_metadata(
            &ListParams::default()
                .fields("type=bootstrap.kubernetes.io/token")
                .limit(500),
        )
        .await?;
    let nodes = Api::<Node>::all(client)
        .list_metadata(&ListParams::default().limit(500))
        .await?;
    if let Some(n) = nodes
        .items
        .iter()
        .find(|n| !moved.nodes.contains(&n.name_any()))
    {
        return Ok(Some(format!(
            "the cluster has nodes (node {:?} among them) {CUT_OFF}",
            clean(&n.name_any())
        )));
    }
    let ours = |s: &str| {
        moved
            .tokens
            .iter()
            .any(|id| s == format!("bootstrap-token-{id}"))
    };
    Ok(tokens
        .items
        .iter()
        .find(|s| !ours(&s.name_any()))
        .map(|s| {
            format!(
                "a machine may be joining the cluster (bootstrap token Secret kube-system/{:?}; a NodePool deletes a node's once it has registered, delete one that is not used) with the old CA, and so may become a node {CUT_OFF}",
                clean(&s.name_any())
            )
        }))
}

/// The nodes of `moved` whose kubelet has not renewed its Lease since it was restarted with
/// its new trust (it is not back, or cannot reach its API server with it), as what the
/// rotation waits for.
async fn kubelets_behind(
    ctx: &Context,
    t: &Tenant,
    moved: &crate::hosted::pool::machines::Retrusted,
) -> Result<Vec<String>, Error> {
    use k8s_openapi::api::coordination::v1::Lease;
    if moved.restarted.is_empty() {
        return Ok(Vec::new());
    }
    let Some(client) =
        crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster()).await?
    else {
        return Ok(vec!["the admin kubeconfig".into()]);
    };
    let leases: Api<Lease> = Api::namespaced(client, "kube-node-lease");
    let mut behind = Vec::new();
    for (node, at) in &moved.restarted {
        let renewed = leases
            .get_opt(node)
            .await?
            .and_then(|l| l.spec?.renew_time)
            .map(|t| t.0.as_millisecond());
        let at = at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        if renewed.is_none_or(|r| r < at) {
            behind.push(format!(
                "node {:?} (its kubelet, restarted with the CA as it is now, to renew its Lease)",
                clean(node)
            ));
        }
    }
    Ok(behind)
}

/// Gives the cluster's nodes this operator runs the CA secret as `keys` hold it: the bundle
/// as what they trust, and a kubelet client certificate of the CA that signs now
/// ([`crate::hosted::pool::machines::NodeRuntime::retrust`]). Nothing where it makes none.
fn retrust_nodes(
    ctx: &Context,
    t: &Tenant,
    keys: &Keys,
) -> Result<crate::hosted::pool::machines::Retrusted, Error> {
    let Some(nodes) = &ctx.nodes else {
        return Ok(Default::default());
    };
    // Only a secret whose key is that of the certificate that signs (`decide` blocks any
    // other): a node given a certificate that does not verify would be cut off.
    let consistent = pki::first_certificate(&keys.verify)
        .and_then(|c| pki::key_matches(&c, &keys.signing))
        .unwrap_or(false);
    if !consistent {
        return Ok(Default::default());
    }
    let group = ctx
        .runtime
        .control_plane_user(&t.ncp)?
        .unwrap_or_else(|| crate::hosted::target::isolation_group(&t.namespace(), &t.cluster()));
    let signer = pki::CertKey {
        cert_pem: keys.verify.clone(),
        key_pem: keys.signing.clone(),
    };
    Ok(nodes.retrust(group, &keys.verify, &signer))
}

async fn step(
    ctx: &Context,
    t: &Tenant,
    target: Target,
) -> Result<(Option<RotationStatus>, Option<Duration>), Error> {
    let mut ask = ask(target, &t.ncp);
    if ask.start.is_none() {
        return Ok((None, None));
    }
    let name = target.purpose().secret_name(&t.cluster());
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &t.namespace());
    let Some(secret) = api.get_opt(&name).await? else {
        // Made with the control plane's certificates: asked again once it exists.
        return Ok((None, Some(RECHECK)));
    };
    let blocked_status = |m: String| RotationStatus {
        target: target.as_str().into(),
        id: ask.start.as_deref().map(clean).unwrap_or_default(),
        phase: "Blocked".into(),
        message: Some(m),
        ..Default::default()
    };
    let Some(keys) = read(&secret) else {
        let m = format!("secret {name} lacks tls.crt or tls.key; fix it");
        event_once(ctx, t, target, EventType::Warning, ROTATION_BLOCKED, &m).await;
        return Ok((Some(blocked_status(m)), None));
    };
    let data = crate::secrets::secret_bytes(&secret);
    let due = ask
        .complete_after
        .as_deref()
        .and_then(parse_duration)
        .zip(keys.started_at)
        .is_some_and(|(d, at)| ask.now >= at.saturating_add(d));
    let completing = keys.phase == Some(Phase::Started)
        && (ask.complete.is_some() && ask.complete == keys.id || due);
    // The nodes this operator runs follow the CA through every phase, without being
    // replaced: what they trust is the bundle, their kubelets' certificates come from the CA
    // that signs (kubelets and kube-proxies restart to read them; pods keep running).
    let moved = match (target, keys.phase) {
        (Target::Ca, Some(p)) if p != Phase::Completed => retrust_nodes(ctx, t, &keys)?,
        _ => Default::default(),
    };
    if target == Target::Ca && completing {
        ask.hold = nodes_hold(ctx, t, &moved).await?;
    }
    let cluster = t.cluster();
    let new = || match target {
        Target::SaKey => pki::generate_service_account_key(),
        Target::Ca | Target::FrontProxyCa => {
            let now = time::OffsetDateTime::now_utc();
            let suffix = target.purpose().suffix();
            pki::generate_ca(&format!("{cluster}-{suffix}-{}", now.unix_timestamp()), now)
        }
    };
    let decision = match lagging(ctx, t, target, &data) {
        Ok(mut late) => {
            let trust_changes = matches!(keys.phase, Some(Phase::Trusting | Phase::Completing));
            if target == Target::Ca
                && late.is_empty()
                && trust_changes
                && !root_ca_published(ctx, t, &keys.verify).await?
            {
                late.push(format!(
                    "{} (to publish it as kube-root-ca.crt)",
                    tenant::kind_of(Component::ControllerManager)
                ));
            }
            // Aggregated API servers learn a new CA from the API server's publication.
            if target.is_ca()
                && late.is_empty()
                && keys.phase == Some(Phase::Trusting)
                && let Some(waiting) = aggregated_told(ctx, t, target, &keys.verify).await?
            {
                late.push(waiting);
            }
            // The nodes nestplane runs: each given the secret as it is, its kubelet back.
            for (node, why) in &moved.failed {
                late.push(format!(
                    "node {:?} (it cannot be given the CA as it is now: {})",
                    clean(node),
                    clean(why)
                ));
            }
            if late.is_empty() {
                late.extend(kubelets_behind(ctx, t, &moved).await?);
            }
            if target.is_ca() && late.is_empty() && trust_changes {
                ask.served = api_servers_serve(ctx, t, target, &keys).await?;
            }
            decide(target, &keys, &ask, &late, new)
        }
        Err(m) if keys.phase.is_some_and(|p| p != Phase::Completed) => Decision::Blocked(m),
        // Nothing begins that could not finish.
        Err(m) if ask.start.is_some() && ask.start != keys.id => Decision::Blocked(m),
        Err(_) => Decision::Idle,
    };
    match decision {
        Decision::Idle => Ok((status(target, &keys, None), None)),
        // A held completion is looked at again too: what holds it (the tenant's nodes)
        // changes without an event here.
        Decision::Wait(m) => Ok((
            status(target, &keys, Some(m)),
            if keys.phase != Some(Phase::Started) {
                Some(RECHECK)
            } else {
                ask.hold.as_ref().map(|_| HELD_RECHECK)
            },
        )),
        Decision::Blocked(m) => {
            let m = format!("secret {name}: {m}");
            event_once(ctx, t, target, EventType::Warning, ROTATION_BLOCKED, &m).await;
            let st = status(target, &keys, Some(m.clone())).unwrap_or_else(|| blocked_status(m));
            Ok((Some(st), None))
        }
        Decision::Write(next) => {
            // Completed: the API servers publish CAs to aggregated API servers but never drop
            // one from there; the CA dropped goes from there too, first.
            if let (Some(retired), Some(Phase::Completed)) = (&keys.retiring, next.phase)
                && let Some(m) = unpublished(ctx, t, target, retired).await?
            {
                return Ok((status(target, &keys, Some(m)), Some(RECHECK)));
            }
            write(&api, &secret, target, &next).await?;
            if next.phase != keys.phase {
                let seen = if ask.served {
                    "; every API server was seen using the CA files as they are now in its TLS handshake"
                } else {
                    ""
                };
                announce(ctx, t, target, &next, seen).await;
            }
            Ok((
                status(target, &next, None),
                (next.phase != Some(Phase::Completed)).then_some(RECHECK),
            ))
        }
        Decision::Resign(next) => {
            let kid = pki::service_account_public_key(&next.signing)
                .ok()
                .and_then(|p| pki::service_account_key_id(&p).ok())
                .unwrap_or_default();
            let Some(client) =
                crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster()).await?
            else {
                return Ok((
                    status(
                        target,
                        &keys,
                        Some("waiting for the admin kubeconfig".into()),
                    ),
                    Some(RECHECK),
                ));
            };
            let id = clean(next.id.as_deref().unwrap_or_default());
            let left = tokio::time::timeout(RESIGN_BUDGET, resign(&client, &kid, &id))
                .await
                .map_err(|_| {
                    Error::Internal(format!(
                        "re-signing the cluster's token Secrets took longer than {RESIGN_BUDGET:?}"
                    ))
                })??;
            if left > 0 {
                let m = format!(
                    "completing: {left} service-account token Secret(s) of the cluster are being re-signed with the new key by its tokens controller; the old key is dropped after"
                );
                return Ok((status(target, &keys, Some(m)), Some(RECHECK)));
            }
            write(&api, &secret, target, &next).await?;
            announce(ctx, t, target, &next, "").await;
            Ok((status(target, &next, None), Some(RECHECK)))
        }
    }
}

/// Annotation nestplane puts on a tenant's pod that mounts a service-account token Secret it
/// had re-signed: the change makes the pod's kubelet sync it at once, and so write the new
/// token into its volume (the API server accepts a legacy token only while it equals its
/// Secret's, so until then the pod's calls are refused).
pub const RESIGNED_ANNOTATION: &str = "nestplane.io/service-account-token-resigned";

/// How long a pass waits for the tokens controller to fill the Secrets it emptied.
const REFILL_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
/// At most this long for a pass's re-signing (the rest is done by the next pass).
const RESIGN_BUDGET: std::time::Duration = std::time::Duration::from_secs(20);
/// Objects listed from a tenant per page, and at most in all (a tenant admin decides how many
/// there are).
const PAGE: u32 = 250;
const MAX_LISTED: usize = 20_000;

fn signed_by(s: &Secret, kid: &str) -> bool {
    let token = text(s, "token").unwrap_or_default();
    !token.is_empty() && pki::token_key_id(&token).as_deref() == Some(kid)
}

/// Every object `api` lists with `lp`, page by page, at most [`MAX_LISTED`].
async fn list_all<K>(api: &Api<K>, lp: &ListParams) -> Result<Vec<K>, Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut lp = lp.clone().limit(PAGE);
    loop {
        let page = api.list(&lp).await?;
        out.extend(page.items);
        if out.len() > MAX_LISTED {
            return Err(Error::Internal(format!(
                "the cluster has more than {MAX_LISTED} of them"
            )));
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => return Ok(out),
        }
    }
}

/// The tenant's service-account token Secrets not signed by key `kid` are emptied, so that
/// the tokens controller (which signs with the new key by now) fills each again in place;
/// then every pod that mounts one signed by `kid` is told (annotation [`RESIGNED_ANNOTATION`]
/// = `id`), so that its kubelet writes the new token at once. Returns how many Secrets are
/// not signed by `kid` yet.
async fn resign(client: &kube::Client, kid: &str, id: &str) -> Result<usize, Error> {
    let api: Api<Secret> = Api::all(client.clone());
    let lp = ListParams::default().fields("type=kubernetes.io/service-account-token");
    let mut emptied = Vec::new();
    for s in list_all(&api, &lp).await? {
        if signed_by(&s, kid) || text(&s, "token").unwrap_or_default().is_empty() {
            continue;
        }
        let (ns, name) = (s.namespace().unwrap_or_default(), s.name_any());
        let one: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": s.metadata.resource_version},
            "data": {"token": null}
        });
        match one
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => emptied.push((ns, name)),
            // Changed meanwhile (the tokens controller, a user): judged again next pass.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    // The tokens controller fills them within moments: the pods are told as soon as it has.
    let deadline = std::time::Instant::now() + REFILL_WAIT;
    for (ns, name) in &emptied {
        let one: Api<Secret> = Api::namespaced(client.clone(), ns);
        while std::time::Instant::now() < deadline {
            match one.get_opt(name).await? {
                Some(s) if !signed_by(&s, kid) => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await
                }
                _ => break,
            }
        }
    }
    let secrets = list_all(&api, &lp).await?;
    let left = secrets.iter().filter(|s| !signed_by(s, kid)).count();
    let resigned: std::collections::BTreeSet<(String, String)> = secrets
        .iter()
        .filter(|s| signed_by(s, kid))
        .map(|s| (s.namespace().unwrap_or_default(), s.name_any()))
        .collect();
    tell_pods(client, &resigned, id).await?;
    Ok(left)
}

/// Annotate each pod that mounts one of `secrets` (namespace, name), as a volume or a
/// projected source, and was not told about rotation `id` yet.
async fn tell_pods(
    client: &kube::Client,
    secrets: &std::collections::BTreeSet<(String, String)>,
    id: &str,
) -> Result<(), Error> {
    use k8s_openapi::api::core::v1::Pod;
    if secrets.is_empty() {
        return Ok(());
    }
    let pods: Api<Pod> = Api::all(client.clone());
    for pod in list_all(&pods, &ListParams::default()).await? {
        let ns = pod.namespace().unwrap_or_default();
        let told = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(RESIGNED_ANNOTATION))
            .is_some_and(|v| v == id);
        let mounts = pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .flat_map(|v| {
                let own = v.secret.as_ref().and_then(|s| s.secret_name.clone());
                let projected = v
                    .projected
                    .iter()
                    .flat_map(|p| p.sources.iter().flatten())
                    .filter_map(|s| s.secret.as_ref().map(|s| s.name.clone()));
                own.into_iter().chain(projected).collect::<Vec<_>>()
            })
            .any(|name| secrets.contains(&(ns.clone(), name)));
        if told || !mounts || pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let patch = serde_json::json!({"metadata": {"annotations": {RESIGNED_ANNOTATION: id}}});
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        match api
            .patch(
                &pod.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 || e.code == 422 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Replace the secret's keys and rotation annotations with `keys`, only if it is still the
/// version read (a concurrent writer makes the pass start again).
async fn write(
    api: &Api<Secret>,
    secret: &Secret,
    target: Target,
    keys: &Keys,
) -> Result<(), Error> {
    let mut s = secret.clone();
    let data = s.data.get_or_insert_with(Default::default);
    if target == Target::Ca {
        // The controller manager's signing file: the signer alone.
        if let Ok(first) = pki::first_certificate(&keys.verify) {
            data.insert(names::SIGNER_CRT.into(), ByteString(first.into_bytes()));
        }
        match &keys.previous {
            Some(p) => {
                data.insert(
                    names::PREVIOUS_CRT.into(),
                    ByteString(p.clone().into_bytes()),
                );
            }
            None => {
                data.remove(names::PREVIOUS_CRT);
            }
        }
    }
    data.insert(
        names::TLS_CRT.into(),
        ByteString(keys.verify.clone().into_bytes()),
    );
    data.insert(
        names::TLS_KEY.into(),
        ByteString(keys.signing.clone().into_bytes()),
    );
    match &keys.next {
        Some(n) => {
            data.insert(names::NEXT_KEY.into(), ByteString(n.clone().into_bytes()));
        }
        None => {
            data.remove(names::NEXT_KEY);
        }
    }
    let ann = s.metadata.annotations.get_or_insert_with(Default::default);
    if let Some(id) = &keys.id {
        ann.insert(ID_ANNOTATION.into(), id.clone());
    }
    if let Some(p) = keys.phase {
        ann.insert(PHASE_ANNOTATION.into(), p.as_str().into());
    }
    match keys
        .started_at
        .and_then(|t| k8s_openapi::jiff::Timestamp::from_second(t).ok())
    {
        Some(t) => {
            ann.insert(STARTED_AT_ANNOTATION.into(), t.to_string());
        }
        None => {
            ann.remove(STARTED_AT_ANNOTATION);
        }
    }
    match &keys.retiring {
        Some(r) => {
            ann.insert(RETIRING_ANNOTATION.into(), r.clone());
        }
        None => {
            ann.remove(RETIRING_ANNOTATION);
        }
    }
    match keys
        .since
        .and_then(|t| k8s_openapi::jiff::Timestamp::from_second(t).ok())
    {
        Some(t) => {
            ann.insert(SINCE_ANNOTATION.into(), t.to_string());
        }
        None => {
            ann.remove(SINCE_ANNOTATION);
        }
    }
    s.metadata.managed_fields = None;
    api.replace(&secret.name_any(), &PostParams::default(), &s)
        .await?;
    Ok(())
}

async fn announce(ctx: &Context, t: &Tenant, target: Target, keys: &Keys, then: &str) {
    let id = clean(keys.id.as_deref().unwrap_or_default());
    let what = target.what();
    let (reason, note) = match (target, keys.phase) {
        (_, Some(Phase::Trusting)) => (
            ROTATION_PROGRESSING,
            format!(
                "{what} rotation {id:?}: a new {} is trusted beside the old one",
                target.noun()
            ),
        ),
        (Target::SaKey, Some(Phase::Signing)) => (
            ROTATION_PROGRESSING,
            format!("{what} rotation {id:?}: the new key signs; both verify"),
        ),
        (Target::FrontProxyCa, Some(Phase::Signing)) => (
            ROTATION_PROGRESSING,
            format!(
                "{what} rotation {id:?}: the new CA signs the API server's client certificate to aggregated API servers, which is reissued; both CAs are trusted"
            ),
        ),
        (Target::FrontProxyCa, Some(Phase::Started)) => (
            ROTATION_STARTED,
            format!(
                "{what} rotation {id:?}: every API server and controller manager trusts both CAs, and the API servers present a certificate from the new one to aggregated API servers; certificates the old CA signed are accepted until the rotation is completed"
            ),
        ),
        (Target::FrontProxyCa, Some(Phase::Completing)) => (
            ROTATION_PROGRESSING,
            format!("{what} rotation {id:?}: the old CA is being dropped"),
        ),
        (Target::Ca, Some(Phase::Signing)) => (
            ROTATION_PROGRESSING,
            format!(
                "{what} rotation {id:?}: the new CA signs client certificates, which are reissued; both CAs are trusted"
            ),
        ),
        (Target::SaKey, Some(Phase::Started)) => (
            ROTATION_STARTED,
            format!(
                "{what} rotation {id:?}: every API server and controller manager runs the new key, which signs; tokens the old key signed are accepted until the rotation is completed"
            ),
        ),
        (Target::Ca, Some(Phase::Started)) => (
            ROTATION_STARTED,
            format!(
                "{what} rotation {id:?}: every component trusts both CAs and holds a client certificate from the new one; kubeconfigs from before are accepted until the rotation is completed"
            ),
        ),
        (Target::SaKey, Some(Phase::Completing)) => (
            ROTATION_PROGRESSING,
            format!(
                "{what} rotation {id:?}: the cluster's token Secrets are re-signed with the new key; the old key is being dropped"
            ),
        ),
        (Target::Ca, Some(Phase::Completing)) => (
            ROTATION_PROGRESSING,
            format!(
                "{what} rotation {id:?}: the old CA is being dropped; serving certificates are reissued from the new one"
            ),
        ),
        (Target::SaKey, Some(Phase::Completed) | None) => (
            ROTATION_COMPLETED,
            format!(
                "{what} rotation {id:?} completed: only the new key verifies; tokens the old key signed are refused"
            ),
        ),
        (Target::Ca | Target::FrontProxyCa, Some(Phase::Completed) | None) => (
            ROTATION_COMPLETED,
            format!(
                "{what} rotation {id:?} completed: only the new CA is trusted; certificates the old one signed are refused"
            ),
        ),
    };
    // One action per rotation and phase: a phase's Event is never folded into another's.
    let action = format!(
        "Rotate/{}/{}",
        target.as_str(),
        keys.phase.map(|p| p.as_str()).unwrap_or("Completed")
    );
    ctx.event_as(
        kube::Resource::object_ref(&t.ncp, &()),
        EventType::Normal,
        reason,
        &action,
        &format!("{note}{then}"),
    )
    .await;
}

/// A Warning once per message: a blocked rotation is looked at on every pass of its control
/// plane, and says so once.
async fn event_once(
    ctx: &Context,
    t: &Tenant,
    target: Target,
    type_: EventType,
    reason: &str,
    note: &str,
) {
    let said = t
        .ncp
        .status
        .as_ref()
        .and_then(|s| s.rotations.iter().find(|r| r.target == target.as_str()))
        .and_then(|r| r.message.as_deref())
        == Some(note);
    if !said {
        ctx.event(kube::Resource::object_ref(&t.ncp, &()), type_, reason, note)
            .await;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn fresh() -> Keys {
        let k = pki::generate_service_account_key().unwrap();
        Keys {
            verify: k.cert_pem,
            signing: k.key_pem,
            next: None,
            id: None,
            phase: None,
            started_at: None,
            since: None,
            previous: None,
            retiring: None,
        }
    }

    fn ask(start: &str, complete: &str) -> Ask {
        let s = |v: &str| (!v.is_empty()).then(|| v.to_string());
        Ask {
            start: s(start),
            complete: s(complete),
            ..Ask::default()
        }
    }

    fn kid_of_private(pem: &str) -> String {
        pki::service_account_key_id(&pki::service_account_public_key(pem).unwrap()).unwrap()
    }

    fn kids(bundle: &str) -> Vec<String> {
        pki::public_keys(bundle)
            .unwrap()
            .iter()
            .map(|k| pki::service_account_key_id(k).unwrap())
            .collect()
    }

    fn written(d: Decision) -> Keys {
        match d {
            Decision::Write(k) | Decision::Resign(k) => k,
            other => panic!("expected a write, got {other:?}"),
        }
    }

    #[test]
    fn a_rotation_trusts_then_signs_then_re_signs_then_waits_then_drops_the_old_key() {
        let old = fresh();
        let old_kid = kid_of_private(&old.signing);
        let none: &[String] = &[];
        assert_eq!(
            decide(
                Target::SaKey,
                &old,
                &Ask::default(),
                none,
                || unreachable!()
            ),
            Decision::Idle
        );

        // Trusting: both public keys verify, the old key still signs.
        let t = written(decide(
            Target::SaKey,
            &old,
            &ask("r1", ""),
            none,
            pki::generate_service_account_key,
        ));
        assert_eq!(t.phase, Some(Phase::Trusting));
        assert_eq!(t.signing, old.signing);
        let new_kid = kid_of_private(t.next.as_deref().unwrap());
        assert_eq!(kids(&t.verify), vec![old_kid.clone(), new_kid.clone()]);
        let st = status(Target::SaKey, &t, None).unwrap();
        assert_eq!(
            (
                st.phase.as_str(),
                st.key_id.as_deref(),
                st.previous_key_id.as_deref()
            ),
            ("Trusting", Some(new_kid.as_str()), Some(old_kid.as_str()))
        );

        // Not before every API server runs it.
        let late = vec!["NestedAPIServer".to_string()];
        let Decision::Wait(m) = decide(Target::SaKey, &t, &ask("r1", ""), &late, || unreachable!())
        else {
            panic!()
        };
        assert!(m.contains("NestedAPIServer"), "{m}");

        // Signing: the new key signs, both verify (new first); no key waits any more.
        let s = written(decide(
            Target::SaKey,
            &t,
            &ask("r1", ""),
            none,
            || unreachable!(),
        ));
        assert_eq!(s.phase, Some(Phase::Signing));
        assert_eq!(kid_of_private(&s.signing), new_kid);
        assert_eq!(s.next, None);
        assert_eq!(kids(&s.verify), vec![new_kid.clone(), old_kid.clone()]);

        // Once it runs everywhere: Started, nothing else changed.
        assert!(matches!(
            decide(Target::SaKey, &s, &ask("r1", ""), none, || unreachable!()),
            Decision::Write(_)
        ));
        let started = written(decide(
            Target::SaKey,
            &s,
            &ask("r1", ""),
            none,
            || unreachable!(),
        ));
        assert_eq!(started.phase, Some(Phase::Started));
        assert_eq!(started.verify, s.verify);

        // Started waits for its completion; a completion of another request is not it, and a
        // new request waits.
        for a in [ask("r1", ""), ask("r1", "r0"), ask("r2", "")] {
            let Decision::Wait(m) = decide(Target::SaKey, &started, &a, none, || unreachable!())
            else {
                panic!()
            };
            assert!(m.contains("complete"), "{m}");
        }
        // Completion: the legacy tokens are re-signed first, then only the new key verifies.
        let d = decide(
            Target::SaKey,
            &started,
            &ask("r1", "r1"),
            none,
            || unreachable!(),
        );
        assert!(matches!(d, Decision::Resign(_)), "{d:?}");
        let c = written(d);
        assert_eq!(c.phase, Some(Phase::Completing));
        assert_eq!(kids(&c.verify), vec![new_kid.clone()]);
        let done = written(decide(
            Target::SaKey,
            &c,
            &ask("r1", "r1"),
            none,
            || unreachable!(),
        ));
        assert_eq!(done.phase, Some(Phase::Completed));
        let st = status(Target::SaKey, &done, None).unwrap();
        assert_eq!(st.previous_key_id, None);
        assert_eq!(st.key_id.as_deref(), Some(new_kid.as_str()));

        // Done is done: the same request again changes nothing; a new one starts over from
        // the new key.
        assert_eq!(
            decide(
                Target::SaKey,
                &done,
                &ask("r1", "r1"),
                none,
                || unreachable!()
            ),
            Decision::Idle
        );
        let again = written(decide(
            Target::SaKey,
            &done,
            &ask("r2", ""),
            none,
            pki::generate_service_account_key,
        ));
        assert_eq!(again.phase, Some(Phase::Trusting));
        assert_eq!(kids(&again.verify)[0], new_kid);
    }

    #[test]
    fn a_rotation_may_complete_by_itself_a_while_after_it_started() {
        assert_eq!(parse_duration("90s"), Some(90));
        assert_eq!(parse_duration("24h"), Some(86_400));
        assert_eq!(parse_duration("2d"), Some(172_800));
        for bad in ["", "h", "5", "-1h", "1.5h", "3w", "1é", "é", "1hé"] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        let mut k = fresh();
        k.id = Some("r1".into());
        k.phase = Some(Phase::Signing);
        let at = |now: i64, after: &str| Ask {
            start: Some("r1".into()),
            complete_after: (!after.is_empty()).then(|| after.to_string()),
            now,
            ..Ask::default()
        };
        // Started records when.
        let started = written(decide(
            Target::SaKey,
            &k,
            &at(1000, "1h"),
            &[],
            || unreachable!(),
        ));
        assert_eq!(started.started_at, Some(1000));
        // Before the delay it waits, saying when it completes; at it, it completes.
        let Decision::Wait(m) = decide(
            Target::SaKey,
            &started,
            &at(4599, "1h"),
            &[],
            || unreachable!(),
        ) else {
            panic!()
        };
        assert!(
            m.contains("completes by itself at 1970-01-01T01:16:40Z"),
            "{m}"
        );
        assert!(matches!(
            decide(
                Target::SaKey,
                &started,
                &at(4600, "1h"),
                &[],
                || unreachable!()
            ),
            Decision::Resign(_)
        ));
        // No delay: it waits for ever; a delay that does not parse is said.
        assert!(matches!(
            decide(
                Target::SaKey,
                &started,
                &at(1_000_000, ""),
                &[],
                || unreachable!()
            ),
            Decision::Wait(_)
        ));
        let Decision::Wait(m) = decide(
            Target::SaKey,
            &started,
            &at(1_000_000, "soon"),
            &[],
            || unreachable!(),
        ) else {
            panic!()
        };
        assert!(m.contains("not a duration"), "{m}");
        // Started before the time was recorded: never by itself, and said so.
        let unknown = Keys {
            started_at: None,
            ..started.clone()
        };
        let Decision::Wait(m) = decide(
            Target::SaKey,
            &unknown,
            &at(1_000_000, "1h"),
            &[],
            || unreachable!(),
        ) else {
            panic!()
        };
        assert!(m.contains("cannot complete by itself"), "{m}");
    }

    #[test]
    fn a_secret_a_rotation_did_not_write_blocks_it_and_is_left_alone() {
        let mut k = fresh();
        k.phase = Some(Phase::Trusting);
        k.id = Some("r1".into());
        assert!(matches!(
            decide(Target::SaKey, &k, &ask("r1", ""), &[], || unreachable!()),
            Decision::Blocked(m) if m.contains("next.key")
        ));
        // A request's name goes into status, Events and pods: bounded and printable.
        for bad in ["x".repeat(MAX_ID + 1), "a\nb".to_string()] {
            assert!(matches!(
                decide(Target::SaKey, &fresh(), &ask(&bad, ""), &[], || unreachable!()),
                Decision::Blocked(m) if m.contains("printable")
            ));
        }
        // A bundle holding what a rotation does not understand, or not the key that signs, is
        // never rewritten (a key in use could be dropped).
        let mut k = fresh();
        let ca = pki::generate_ca("x", time::OffsetDateTime::now_utc()).unwrap();
        k.verify = format!("{}{}", k.verify, ca.cert_pem);
        assert!(matches!(
            decide(Target::SaKey, &k, &ask("r1", ""), &[], pki::generate_service_account_key),
            Decision::Blocked(m) if m.contains("CERTIFICATE")
        ));
        let mut k = fresh();
        k.verify = pki::generate_service_account_key().unwrap().cert_pem;
        assert!(matches!(
            decide(Target::SaKey, &k, &ask("r1", ""), &[], pki::generate_service_account_key),
            Decision::Blocked(m) if m.contains("public key of tls.key")
        ));
        let mut k = fresh();
        k.verify = "not a key".into();
        assert!(matches!(
            decide(
                Target::SaKey,
                &k,
                &ask("r1", ""),
                &[],
                pki::generate_service_account_key
            ),
            Decision::Blocked(_)
        ));
    }

    fn fresh_ca() -> Keys {
        let ca = pki::generate_ca("c-ca", time::OffsetDateTime::now_utc()).unwrap();
        Keys {
            verify: ca.cert_pem,
            signing: ca.key_pem,
            next: None,
            id: None,
            phase: None,
            started_at: None,
            since: None,
            previous: None,
            retiring: None,
        }
    }

    fn ca_ids(bundle: &str) -> Vec<String> {
        pki::certificates(bundle)
            .unwrap()
            .iter()
            .map(|c| pki::certificate_id(c).unwrap())
            .collect()
    }

    fn new_ca() -> Result<pki::CertKey, pki::PkiError> {
        pki::generate_ca("c-ca-2", time::OffsetDateTime::now_utc())
    }

    #[test]
    fn a_front_proxy_ca_rotation_keeps_no_serving_certificate_and_drops_only_the_old_ca() {
        let old = fresh_ca();
        let old_id = ca_ids(&old.verify)[0].clone();
        let none: &[String] = &[];
        let served = |a: Ask| Ask { served: true, ..a };
        let go = |k: &Keys, a: Ask| {
            written(decide(Target::FrontProxyCa, k, &a, none, || unreachable!()))
        };
        let t = written(decide(
            Target::FrontProxyCa,
            &old,
            &ask("p1", ""),
            none,
            new_ca,
        ));
        assert_eq!(t.phase, Some(Phase::Trusting));
        let new_id = ca_ids(&t.verify)[1].clone();
        // Its consumers: what reads `--requestheader-client-ca-file` (not the scheduler).
        assert_eq!(
            Target::FrontProxyCa.consumers(),
            &[Component::ApiServer, Component::ControllerManager]
        );
        let late = vec!["NestedControllerManager".to_string()];
        assert!(matches!(
            decide(Target::FrontProxyCa, &t, &ask("p1", ""), &late, || unreachable!()),
            Decision::Wait(m) if m.contains("NestedControllerManager")
        ));
        // Seen in the handshakes: no minute's wait.
        let s = go(&t, served(ask("p1", "")));
        assert_eq!(s.phase, Some(Phase::Signing));
        assert_eq!(ca_ids(&s.verify), vec![new_id.clone(), old_id.clone()]);
        assert!(pki::key_matches(&s.verify, &s.signing).unwrap());
        // It signs no serving certificate: none is kept; the old CA is the one to drop.
        assert_eq!(s.previous, None);
        assert_eq!(s.retiring.as_deref(), Some(old_id.as_str()));
        // The API servers re-read their client certificate within a minute, which no
        // handshake shows: `Signing` waits that long once every consumer runs it.
        let noted = go(&s, served(ask("p1", "")));
        assert_eq!((noted.phase, noted.since), (Some(Phase::Signing), Some(0)));
        assert!(matches!(
            decide(Target::FrontProxyCa, &noted, &served(ask("p1", "")), none, || unreachable!()),
            Decision::Wait(m) if m.contains("client certificate")
        ));
        let started = go(
            &noted,
            Ask {
                now: CA_FILE_RELOAD_SECONDS,
                ..ask("p1", "")
            },
        );
        assert_eq!(started.phase, Some(Phase::Started));
        let Decision::Wait(m) = decide(
            Target::FrontProxyCa,
            &started,
            &ask("p1", ""),
            none,
            || unreachable!(),
        ) else {
            panic!()
        };
        assert!(m.contains("rotate front-proxy-ca --complete"), "{m}");
        let st = status(Target::FrontProxyCa, &started, None).unwrap();
        assert_eq!(
            (
                st.target.as_str(),
                st.key_id.as_deref(),
                st.previous_key_id.as_deref()
            ),
            (
                "front-proxy-ca",
                Some(new_id.as_str()),
                Some(old_id.as_str())
            )
        );
        let completing = go(&started, ask("p1", "p1"));
        assert_eq!(completing.phase, Some(Phase::Completing));
        assert_eq!(
            ca_ids(&completing.verify),
            vec![new_id.clone(), old_id.clone()]
        );
        let dropped = go(&completing, served(ask("p1", "p1")));
        assert_eq!(ca_ids(&dropped.verify), vec![new_id.clone()]);
        assert_eq!(dropped.retiring.as_deref(), Some(old_id.as_str()));
        let done = go(&dropped, served(ask("p1", "p1")));
        assert_eq!((done.phase, done.retiring), (Some(Phase::Completed), None));
        assert_eq!(ca_ids(&done.verify), vec![new_id]);
    }

    #[test]
    fn a_ca_rotation_trusts_both_then_signs_with_the_new_one_first_then_drops_the_old_one() {
        let old = fresh_ca();
        let old_id = ca_ids(&old.verify)[0].clone();
        let none: &[String] = &[];
        let t = written(decide(Target::Ca, &old, &ask("r1", ""), none, new_ca));
        assert_eq!(t.phase, Some(Phase::Trusting));
        // The old CA still signs, so it stays first (Kubernetes signs with a CA file's first
        // certificate); the new one is trusted after it.
        let ids = ca_ids(&t.verify);
        assert_eq!(ids[0], old_id);
        assert_eq!(ids.len(), 2);
        let new_id = ids[1].clone();
        assert_eq!(t.signing, old.signing);
        let st = status(Target::Ca, &t, None).unwrap();
        assert_eq!(
            (
                st.target.as_str(),
                st.key_id.as_deref(),
                st.previous_key_id.as_deref()
            ),
            ("ca", Some(new_id.as_str()), Some(old_id.as_str()))
        );
        let late = vec!["NestedScheduler".to_string()];
        assert!(matches!(
            decide(Target::Ca, &t, &ask("r1", ""), &late, || unreachable!()),
            Decision::Wait(m) if m.contains("NestedScheduler")
        ));
        // Every consumer runs it (noted when), but the API servers re-read a CA file once a
        // minute.
        let seen = written(decide(
            Target::Ca,
            &t,
            &ask("r1", ""),
            none,
            || unreachable!(),
        ));
        assert_eq!((seen.phase, seen.since), (Some(Phase::Trusting), Some(0)));
        let t = seen;
        assert!(matches!(
            decide(Target::Ca, &t, &ask("r1", ""), none, || unreachable!()),
            Decision::Wait(m) if m.contains("re-read")
        ));
        let later = |a: Ask| Ask {
            now: CA_FILE_RELOAD_SECONDS,
            ..a
        };
        let s = written(decide(
            Target::Ca,
            &t,
            &later(ask("r1", "")),
            none,
            || unreachable!(),
        ));
        assert_eq!(s.phase, Some(Phase::Signing));
        assert_eq!(ca_ids(&s.verify), vec![new_id.clone(), old_id.clone()]);
        assert!(pki::key_matches(&s.verify, &s.signing).unwrap());
        // The old CA's serving certificates are kept; it is the one to drop.
        assert_eq!(ca_ids(s.previous.as_deref().unwrap()), vec![old_id.clone()]);
        assert_eq!(s.retiring.as_deref(), Some(old_id.as_str()));
        let started = written(decide(
            Target::Ca,
            &s,
            &ask("r1", ""),
            none,
            || unreachable!(),
        ));
        assert_eq!(started.phase, Some(Phase::Started));
        let Decision::Wait(m) = decide(
            Target::Ca,
            &started,
            &ask("r1", ""),
            none,
            || unreachable!(),
        ) else {
            panic!()
        };
        assert!(m.contains("rotate ca --complete"), "{m}");
        // Something that would be cut off holds the completion, and says what.
        let mut held = ask("r1", "r1");
        held.hold = Some("node n1".into());
        assert!(matches!(
            decide(Target::Ca, &started, &held, none, || unreachable!()),
            Decision::Wait(m) if m.contains("cannot complete: node n1")
        ));
        // Completion: first the serving certificates are reissued from the new CA while both
        // are trusted (no tokens to re-sign)...
        let d = decide(
            Target::Ca,
            &started,
            &ask("r1", "r1"),
            none,
            || unreachable!(),
        );
        assert!(matches!(d, Decision::Write(_)), "{d:?}");
        let c = written(d);
        assert_eq!(c.phase, Some(Phase::Completing));
        assert_eq!(ca_ids(&c.verify), vec![new_id.clone(), old_id.clone()]);
        assert_eq!(c.previous, None);
        let settle = |k: &Keys| {
            let k = written(decide(
                Target::Ca,
                k,
                &ask("r1", "r1"),
                none,
                || unreachable!(),
            ));
            assert_eq!((k.phase, k.since), (Some(Phase::Completing), Some(0)));
            assert!(matches!(
                decide(Target::Ca, &k, &ask("r1", "r1"), none, || unreachable!()),
                Decision::Wait(m) if m.contains("re-read")
            ));
            k
        };
        let c = settle(&c);
        // ... then the old CA, and only it, is dropped.
        let c = written(decide(
            Target::Ca,
            &c,
            &later(ask("r1", "r1")),
            none,
            || unreachable!(),
        ));
        assert_eq!(c.phase, Some(Phase::Completing));
        assert_eq!(ca_ids(&c.verify), vec![new_id.clone()]);
        // Which CA went is kept until Completed (the API servers may trust it until they
        // re-read the file).
        assert_eq!(c.retiring.as_deref(), Some(old_id.as_str()));
        let c = settle(&c);
        let done = written(decide(
            Target::Ca,
            &c,
            &later(ask("r1", "r1")),
            none,
            || unreachable!(),
        ));
        assert_eq!(done.phase, Some(Phase::Completed));
        assert_eq!(
            status(Target::Ca, &done, None).unwrap().previous_key_id,
            None
        );
    }

    #[test]
    fn an_api_server_seen_serving_the_bundle_ends_the_wait_for_its_reload() {
        let t = written(decide(Target::Ca, &fresh_ca(), &ask("r1", ""), &[], new_ca));
        let seen = written(decide(
            Target::Ca,
            &t,
            &ask("r1", ""),
            &[],
            || unreachable!(),
        ));
        assert_eq!(seen.since, Some(0));
        // Seen before the minute is up: it goes on at once.
        let served = Ask {
            served: true,
            ..ask("r1", "")
        };
        let s = written(decide(Target::Ca, &seen, &served, &[], || unreachable!()));
        assert_eq!((s.phase, s.since), (Some(Phase::Signing), None));
        // But never past a consumer that does not run it yet.
        let late = vec!["NestedAPIServer".to_string()];
        assert!(matches!(
            decide(Target::Ca, &t, &served, &late, || unreachable!()),
            Decision::Wait(m) if m.contains("NestedAPIServer")
        ));
    }

    #[test]
    fn a_handshake_shows_whether_an_api_server_reread_its_ca_and_certificate_files() {
        let now = time::OffsetDateTime::now_utc();
        let old = pki::generate_ca("c-ca", now).unwrap();
        let new = pki::generate_ca("c-ca-2", now).unwrap();
        let proxy = pki::generate_ca("c-proxy", now).unwrap();
        let serving = |ca: &pki::CertKey| {
            pki::issue(
                ca,
                &pki::LeafSpec {
                    common_name: "kube-apiserver".into(),
                    ..Default::default()
                },
                now,
            )
            .unwrap()
            .cert_pem
        };
        let (old_leaf, new_leaf) = (serving(&old), serving(&new));
        let shake = |cas: &[&pki::CertKey], leaf: &str| Presented {
            certificate: pki::certificate_der(leaf).unwrap(),
            client_cas: cas
                .iter()
                .flat_map(|c| pki::subjects(&c.cert_pem).unwrap())
                .collect(),
        };
        let both = format!("{}{}", old.cert_pem, new.cert_pem);
        // Trusting: the file holds both; a server still on the old file names one CA less.
        let before = shake(&[&old, &proxy], &old_leaf);
        let after = shake(&[&old, &new, &proxy], &old_leaf);
        assert!(!serves(
            std::slice::from_ref(&before),
            &both,
            &proxy.cert_pem,
            &old_leaf,
            None
        ));
        assert!(serves(
            std::slice::from_ref(&after),
            &both,
            &proxy.cert_pem,
            &old_leaf,
            None
        ));
        // Every replica must have: one that has not holds it back.
        assert!(!serves(
            &[after.clone(), before],
            &both,
            &proxy.cert_pem,
            &old_leaf,
            None
        ));
        // The serving certificate reissued: the server presents the one its secret holds.
        assert!(!serves(
            std::slice::from_ref(&after),
            &both,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        let reissued = shake(&[&new, &old, &proxy], &new_leaf);
        assert!(serves(
            std::slice::from_ref(&reissued),
            &both,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        // The old CA dropped: naming it still is not serving the file. Even if a CA of the
        // same subject were left, one too many is seen.
        assert!(!serves(
            &[reissued],
            &new.cert_pem,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        let twin = pki::generate_ca("c-ca-2", now).unwrap();
        let alike = shake(&[&new, &twin, &proxy], &new_leaf);
        assert!(!serves(
            &[alike],
            &new.cert_pem,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        let dropped = shake(&[&new, &proxy], &new_leaf);
        assert!(serves(
            &[dropped],
            &new.cert_pem,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        // Nothing seen is not served.
        assert!(!serves(
            &[],
            &new.cert_pem,
            &proxy.cert_pem,
            &new_leaf,
            None
        ));
        // A certificate in both files is named once (Go's pool keeps one of two alike).
        let shared = format!("{}{}", proxy.cert_pem, new.cert_pem);
        let once = shake(&[&new, &proxy], &new_leaf);
        assert!(serves(
            std::slice::from_ref(&once),
            &new.cert_pem,
            &shared,
            &new_leaf,
            None
        ));
        // The CA dropped is in the front-proxy file too (one CA brought for both): a server
        // that still trusts it names the same CAs as one that re-read, so it is not told.
        let old_for_both = format!("{}{}", proxy.cert_pem, old.cert_pem);
        let old_id = pki::certificate_id(&old.cert_pem).unwrap();
        let either = shake(&[&new, &old, &proxy], &new_leaf);
        assert!(serves(
            std::slice::from_ref(&either),
            &new.cert_pem,
            &old_for_both,
            &new_leaf,
            None
        ));
        assert!(!serves(
            &[either],
            &new.cert_pem,
            &old_for_both,
            &new_leaf,
            Some(&old_id)
        ));
        // Before it is dropped (the serving certificate's step), the certificate tells.
        let kept = shake(&[&new, &old, &proxy], &new_leaf);
        assert!(serves(
            &[kept],
            &format!("{}{}", new.cert_pem, old.cert_pem),
            &old_for_both,
            &new_leaf,
            Some(&old_id)
        ));
    }

    #[test]
    fn a_ca_bundle_that_does_not_begin_with_the_signer_or_holds_a_key_is_left_alone() {
        let mut k = fresh_ca();
        let other = new_ca().unwrap();
        k.verify = format!("{}{}", other.cert_pem, k.verify);
        assert!(matches!(
            decide(Target::Ca, &k, &ask("r1", ""), &[], new_ca),
            Decision::Blocked(m) if m.contains("does not begin with")
        ));
        let mut k = fresh_ca();
        k.verify = format!(
            "{}{}",
            k.verify,
            pki::generate_service_account_key().unwrap().cert_pem
        );
        assert!(matches!(
            decide(Target::Ca, &k, &ask("r1", ""), &[], new_ca),
            Decision::Blocked(m) if m.contains("PUBLIC KEY")
        ));
        let mut k = fresh_ca();
        k.signing = other.key_pem;
        assert!(matches!(
            decide(Target::Ca, &k, &ask("r1", ""), &[], new_ca),
            Decision::Blocked(m) if m.contains("certificate of tls.key")
        ));
    }
}
