//! Rotation of a tenant's service-account key, in phases, with no moment at which a token in
//! use is refused.
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
use crate::tenant::{self, Tenant};

/// The rotation target of the service-account key (`status.rotations[].target`).
pub const SA_KEY: &str = "sa-key";
/// Annotation on the `<cluster>-sa` secret: the request its rotation answers.
pub const ID_ANNOTATION: &str = "nestplane.io/rotation-id";
/// Annotation on the `<cluster>-sa` secret: the rotation's phase.
pub const PHASE_ANNOTATION: &str = "nestplane.io/rotation-phase";
/// Annotation on the `<cluster>-sa` secret: when the rotation reached `Started`.
pub const STARTED_AT_ANNOTATION: &str = "nestplane.io/rotation-started-at";
/// Reason of the Events of a rotation's phases.
pub const ROTATION_PROGRESSING: &str = "RotationProgressing";
/// Reason of the Event of a rotation that reached `Started`.
pub const ROTATION_STARTED: &str = "RotationStarted";
/// Reason of the Event of a completed rotation.
pub const ROTATION_COMPLETED: &str = "RotationCompleted";
/// Reason of the Event of a rotation that cannot go on (the secret is not what it should be).
pub const ROTATION_BLOCKED: &str = "RotationBlocked";

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
pub struct SaKeys {
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
}

impl std::fmt::Debug for SaKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaKeys")
            .field("verify", &self.verify)
            .field("signing", &"<redacted>")
            .field("next", &self.next.as_ref().map(|_| "<redacted>"))
            .field("id", &self.id)
            .field("phase", &self.phase)
            .field("started_at", &self.started_at)
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
    Write(SaKeys),
    /// Completion: re-sign the tenant's legacy tokens with the new key, then write this.
    Resign(SaKeys),
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

/// The next step of the rotation, from the secret, the request, and which consumers (the API
/// servers and controller managers, by kind) do not run the secret as it is yet. `new_key`
/// makes a key pair (called only when a rotation begins). Pure but for `new_key`.
pub fn decide(
    keys: &SaKeys,
    ask: &Ask,
    lagging: &[String],
    new_key: impl FnOnce() -> Result<pki::CertKey, pki::PkiError>,
) -> Decision {
    let waiting_for = || {
        format!(
            "waiting for {} to run it (each replica restarted in turn)",
            lagging.join(" and ")
        )
    };
    // The bundle is rewritten whole: what it holds must be understood, and hold the key that
    // signs, or a key in use could be dropped.
    let verify = match pki::public_keys(&keys.verify) {
        Ok(v) if !v.is_empty() => v,
        Ok(_) => {
            return Decision::Blocked("its tls.crt holds no public key; fix the secret".into());
        }
        Err(e) => return Decision::Blocked(format!("its tls.crt: {e}")),
    };
    let kid = |pem: &str| {
        pki::service_account_public_key(pem)
            .ok()
            .and_then(|p| pki::service_account_key_id(&p).ok())
    };
    let trusted: Vec<String> = verify
        .iter()
        .filter_map(|k| pki::service_account_key_id(k).ok())
        .collect();
    match kid(&keys.signing) {
        Some(k) if trusted.contains(&k) => {}
        Some(_) => {
            return Decision::Blocked(
                "its tls.crt does not hold the public key of tls.key, which signs; fix the secret"
                    .into(),
            );
        }
        None => return Decision::Blocked("its tls.key does not parse".into()),
    }
    let id = keys.id.as_deref().map(clean).unwrap_or_default();
    match keys.phase {
        None | Some(Phase::Completed) => match &ask.start {
            Some(r) if Some(r) != keys.id.as_ref() => {
                if !valid(r) {
                    return Decision::Blocked(format!(
                        "annotation {} names the request in at most {MAX_ID} printable characters",
                        names::ROTATE_SA_KEY_ANNOTATION
                    ));
                }
                let new = match new_key() {
                    Ok(k) => k,
                    Err(e) => return Decision::Blocked(format!("cannot make a key: {e}")),
                };
                let mut all = verify;
                all.push(new.cert_pem.clone());
                Decision::Write(SaKeys {
                    verify: bundle(&all),
                    signing: keys.signing.clone(),
                    next: Some(new.key_pem),
                    id: Some(r.clone()),
                    phase: Some(Phase::Trusting),
                    started_at: None,
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
            let Ok(new_pub) = pki::service_account_public_key(next) else {
                return Decision::Blocked(format!("its {} does not parse", names::NEXT_KEY));
            };
            if !kid(next).is_some_and(|k| trusted.contains(&k)) {
                return Decision::Blocked(format!(
                    "phase Trusting, but its tls.crt does not hold the public key of {}; fix the secret",
                    names::NEXT_KEY
                ));
            }
            if !lagging.is_empty() {
                return Decision::Wait(format!(
                    "the new key is trusted beside the old one; {}",
                    waiting_for()
                ));
            }
            // The new key first, then every other one still trusted.
            let mut all = vec![new_pub.clone()];
            all.extend(verify.into_iter().filter(|k| *k != new_pub));
            Decision::Write(SaKeys {
                verify: bundle(&all),
                signing: next.clone(),
                next: None,
                id: keys.id.clone(),
                phase: Some(Phase::Signing),
                started_at: None,
            })
        }
        Some(Phase::Signing) => {
            if !lagging.is_empty() {
                return Decision::Wait(format!(
                    "the new key signs, both verify; {}",
                    waiting_for()
                ));
            }
            Decision::Write(SaKeys {
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
                        names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION
                    ));
                }
            };
            let due = after
                .zip(keys.started_at)
                .map(|(d, at)| at.saturating_add(d));
            let asked = ask.complete.is_some() && ask.complete == keys.id;
            if asked || due.is_some_and(|due| ask.now >= due) {
                let Ok(new_pub) = pki::service_account_public_key(&keys.signing) else {
                    return Decision::Blocked("its tls.key does not parse".into());
                };
                if !lagging.is_empty() {
                    return Decision::Wait(format!(
                        "completing: the new key signs, both verify; {}",
                        waiting_for()
                    ));
                }
                // The legacy tokens the old key signed are re-signed first, then it goes.
                return Decision::Resign(SaKeys {
                    verify: new_pub,
                    phase: Some(Phase::Completing),
                    next: None,
                    ..keys.clone()
                });
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
            Decision::Wait(format!(
                "the new key signs and both verify; nothing issued before is refused until the rotation is completed (nestplane rotate sa-key --complete, or annotation {}={id}), which re-signs the cluster's legacy token Secrets and drops the old key: complete it once every token the old key signed has been replaced (kubelets refresh pods' projected tokens within 24 h){by_itself}{queued}",
                names::ROTATE_SA_KEY_COMPLETE_ANNOTATION,
            ))
        }
        Some(Phase::Completing) => {
            if !lagging.is_empty() {
                return Decision::Wait(format!("the old key is dropped; {}", waiting_for()));
            }
            Decision::Write(SaKeys {
                phase: Some(Phase::Completed),
                ..keys.clone()
            })
        }
    }
}

/// `status.rotations[]` of the secret as it is (after `decide`'s write, when there was one).
/// Pure.
pub fn status(keys: &SaKeys, message: Option<String>) -> Option<RotationStatus> {
    let (id, phase) = (clean(keys.id.as_deref()?), keys.phase?);
    let kid = |pem: &str| {
        pki::service_account_public_key(pem)
            .ok()
            .and_then(|p| pki::service_account_key_id(&p).ok())
    };
    let key_id = kid(keys.next.as_deref().unwrap_or(&keys.signing));
    let previous_key_id = pki::public_keys(&keys.verify)
        .unwrap_or_default()
        .iter()
        .filter_map(|k| pki::service_account_key_id(k).ok())
        .find(|k| Some(k) != key_id.as_ref());
    Some(RotationStatus {
        target: SA_KEY.into(),
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
pub fn read(s: &Secret) -> Option<SaKeys> {
    let ann = |k: &str| s.metadata.annotations.as_ref()?.get(k).cloned();
    Some(SaKeys {
        verify: text(s, names::TLS_CRT)?,
        signing: text(s, names::TLS_KEY)?,
        next: text(s, names::NEXT_KEY),
        id: ann(ID_ANNOTATION),
        phase: ann(PHASE_ANNOTATION).and_then(|p| Phase::parse(&p)),
        started_at: ann(STARTED_AT_ANNOTATION)
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_second()),
    })
}

/// The request annotations of a control plane.
pub fn ask(ncp: &NestedControlPlane) -> Ask {
    let ann = |k: &str| {
        ncp.metadata
            .annotations
            .as_ref()?
            .get(k)
            .filter(|v| !v.is_empty())
            .cloned()
    };
    Ask {
        start: ann(names::ROTATE_SA_KEY_ANNOTATION),
        complete: ann(names::ROTATE_SA_KEY_COMPLETE_ANNOTATION),
        complete_after: ann(names::ROTATE_SA_KEY_COMPLETE_AFTER_ANNOTATION),
        now: k8s_openapi::jiff::Timestamp::now().as_second(),
    }
}

/// The consumers of the service-account keys: the components that mount them.
const CONSUMERS: [Component; 2] = [Component::ApiServer, Component::ControllerManager];

/// The consumers (by kind) whose status does not say they run the secret `data` as it is (one
/// not made yet among them). `Err`: a consumer this operator does not run, which says nothing
/// of the keys it runs, so the rotation cannot move on.
fn lagging(
    ctx: &Context,
    t: &Tenant,
    data: &BTreeMap<String, Vec<u8>>,
) -> Result<Vec<String>, String> {
    let want = crate::secrets::fingerprint(data);
    let mut late = Vec::new();
    for c in CONSUMERS {
        let kind = tenant::kind_of(c);
        if let Some(m) = t.managed_elsewhere(c) {
            return Err(format!(
                "{kind} is run by {m}, which does not report the keys it runs (status.credentials.sa); the rotation cannot tell when it runs them"
            ));
        }
        if !ctx.runs_here(t, c) {
            return Err(format!(
                "{kind} is run by another operator (--controllers); the rotation cannot tell when it runs the keys"
            ));
        }
        if t.meta_of(c).is_none() {
            late.push(format!("{kind} (not made yet)"));
        } else if t
            .status_of(c)
            .and_then(|s| s.credentials.get(SecretPurpose::ServiceAccount.suffix()))
            != Some(&want)
        {
            late.push(kind.to_string());
        }
    }
    Ok(late)
}

/// One step of the tenant's service-account key rotation, if one was ever asked for. Returns
/// the rotation's status (`None`: none asked for; the last status stays), and whether it is in
/// progress (look again soon). A failure (the management or the tenant's API, a slow tenant)
/// is said in the status and tried again; it never stops the control plane's pass.
pub async fn advance(ctx: &Context, t: &Tenant) -> (Option<RotationStatus>, bool) {
    match step(ctx, t).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "rotating the service-account key");
            let last = t
                .ncp
                .status
                .as_ref()
                .and_then(|s| s.rotations.iter().find(|r| r.target == SA_KEY).cloned())
                .map(|mut r| {
                    r.message = Some(format!("cannot go on now (tried again shortly): {e}"));
                    r
                });
            (last, true)
        }
    }
}

async fn step(ctx: &Context, t: &Tenant) -> Result<(Option<RotationStatus>, bool), Error> {
    let ask = ask(&t.ncp);
    if ask.start.is_none() {
        return Ok((None, false));
    }
    let name = SecretPurpose::ServiceAccount.secret_name(&t.cluster());
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &t.namespace());
    let Some(secret) = api.get_opt(&name).await? else {
        // Made with the control plane's certificates: asked again once it exists.
        return Ok((None, true));
    };
    let blocked_status = |m: String| RotationStatus {
        target: SA_KEY.into(),
        id: ask.start.as_deref().map(clean).unwrap_or_default(),
        phase: "Blocked".into(),
        message: Some(m),
        ..Default::default()
    };
    let Some(keys) = read(&secret) else {
        let m = format!("secret {name} lacks tls.crt or tls.key; fix it");
        event_once(ctx, t, EventType::Warning, ROTATION_BLOCKED, &m).await;
        return Ok((Some(blocked_status(m)), false));
    };
    let data: BTreeMap<String, Vec<u8>> = secret
        .data
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect();
    let decision = match lagging(ctx, t, &data) {
        Ok(late) => decide(&keys, &ask, &late, pki::generate_service_account_key),
        Err(m) if keys.phase.is_some_and(|p| p != Phase::Completed) => Decision::Blocked(m),
        // Nothing begins that could not finish.
        Err(m) if ask.start.is_some() && ask.start != keys.id => Decision::Blocked(m),
        Err(_) => Decision::Idle,
    };
    match decision {
        Decision::Idle => Ok((status(&keys, None), false)),
        Decision::Wait(m) => Ok((status(&keys, Some(m)), keys.phase != Some(Phase::Started))),
        Decision::Blocked(m) => {
            let m = format!("secret {name}: {m}");
            event_once(ctx, t, EventType::Warning, ROTATION_BLOCKED, &m).await;
            let st = status(&keys, Some(m.clone())).unwrap_or_else(|| blocked_status(m));
            Ok((Some(st), false))
        }
        Decision::Write(next) => {
            write(&api, &secret, &next).await?;
            announce(ctx, t, &next).await;
            Ok((status(&next, None), next.phase != Some(Phase::Completed)))
        }
        Decision::Resign(next) => {
            let kid = pki::service_account_public_key(&next.signing)
                .ok()
                .and_then(|p| pki::service_account_key_id(&p).ok())
                .unwrap_or_default();
            let admin = SecretPurpose::AdminKubeconfig.secret_name(&t.cluster());
            let Some(client) =
                crate::hosted::target::admin_client(ctx, &t.namespace(), &admin).await?
            else {
                return Ok((
                    status(&keys, Some("waiting for the admin kubeconfig".into())),
                    true,
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
                return Ok((status(&keys, Some(m)), true));
            }
            write(&api, &secret, &next).await?;
            announce(ctx, t, &next).await;
            Ok((status(&next, None), true))
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
async fn write(api: &Api<Secret>, secret: &Secret, keys: &SaKeys) -> Result<(), Error> {
    let mut s = secret.clone();
    let data = s.data.get_or_insert_with(Default::default);
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
    s.metadata.managed_fields = None;
    api.replace(&secret.name_any(), &PostParams::default(), &s)
        .await?;
    Ok(())
}

async fn announce(ctx: &Context, t: &Tenant, keys: &SaKeys) {
    let id = clean(keys.id.as_deref().unwrap_or_default());
    let (reason, note) = match keys.phase {
        Some(Phase::Trusting) => (
            ROTATION_PROGRESSING,
            format!("service-account key rotation {id:?}: a new key is trusted beside the old one"),
        ),
        Some(Phase::Signing) => (
            ROTATION_PROGRESSING,
            format!("service-account key rotation {id:?}: the new key signs; both verify"),
        ),
        Some(Phase::Started) => (
            ROTATION_STARTED,
            format!(
                "service-account key rotation {id:?}: every API server and controller manager runs the new key, which signs; tokens the old key signed are accepted until the rotation is completed"
            ),
        ),
        Some(Phase::Completing) => (
            ROTATION_PROGRESSING,
            format!(
                "service-account key rotation {id:?}: the cluster's token Secrets are re-signed with the new key; the old key is being dropped"
            ),
        ),
        Some(Phase::Completed) | None => (
            ROTATION_COMPLETED,
            format!(
                "service-account key rotation {id:?} completed: only the new key verifies; tokens the old key signed are refused"
            ),
        ),
    };
    ctx.event(
        kube::Resource::object_ref(&t.ncp, &()),
        EventType::Normal,
        reason,
        &note,
    )
    .await;
}

/// A Warning once per message: a blocked rotation is looked at on every pass of its control
/// plane, and says so once.
async fn event_once(ctx: &Context, t: &Tenant, type_: EventType, reason: &str, note: &str) {
    let said = t
        .ncp
        .status
        .as_ref()
        .and_then(|s| s.rotations.iter().find(|r| r.target == SA_KEY))
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

    fn fresh() -> SaKeys {
        let k = pki::generate_service_account_key().unwrap();
        SaKeys {
            verify: k.cert_pem,
            signing: k.key_pem,
            next: None,
            id: None,
            phase: None,
            started_at: None,
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

    fn written(d: Decision) -> SaKeys {
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
            decide(&old, &Ask::default(), none, || unreachable!()),
            Decision::Idle
        );

        // Trusting: both public keys verify, the old key still signs.
        let t = written(decide(
            &old,
            &ask("r1", ""),
            none,
            pki::generate_service_account_key,
        ));
        assert_eq!(t.phase, Some(Phase::Trusting));
        assert_eq!(t.signing, old.signing);
        let new_kid = kid_of_private(t.next.as_deref().unwrap());
        assert_eq!(kids(&t.verify), vec![old_kid.clone(), new_kid.clone()]);
        let st = status(&t, None).unwrap();
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
        let Decision::Wait(m) = decide(&t, &ask("r1", ""), &late, || unreachable!()) else {
            panic!()
        };
        assert!(m.contains("NestedAPIServer"), "{m}");

        // Signing: the new key signs, both verify (new first); no key waits any more.
        let s = written(decide(&t, &ask("r1", ""), none, || unreachable!()));
        assert_eq!(s.phase, Some(Phase::Signing));
        assert_eq!(kid_of_private(&s.signing), new_kid);
        assert_eq!(s.next, None);
        assert_eq!(kids(&s.verify), vec![new_kid.clone(), old_kid.clone()]);

        // Once it runs everywhere: Started, nothing else changed.
        assert!(matches!(
            decide(&s, &ask("r1", ""), none, || unreachable!()),
            Decision::Write(_)
        ));
        let started = written(decide(&s, &ask("r1", ""), none, || unreachable!()));
        assert_eq!(started.phase, Some(Phase::Started));
        assert_eq!(started.verify, s.verify);

        // Started waits for its completion; a completion of another request is not it, and a
        // new request waits.
        for a in [ask("r1", ""), ask("r1", "r0"), ask("r2", "")] {
            let Decision::Wait(m) = decide(&started, &a, none, || unreachable!()) else {
                panic!()
            };
            assert!(m.contains("complete"), "{m}");
        }
        // Completion: the legacy tokens are re-signed first, then only the new key verifies.
        let d = decide(&started, &ask("r1", "r1"), none, || unreachable!());
        assert!(matches!(d, Decision::Resign(_)), "{d:?}");
        let c = written(d);
        assert_eq!(c.phase, Some(Phase::Completing));
        assert_eq!(kids(&c.verify), vec![new_kid.clone()]);
        let done = written(decide(&c, &ask("r1", "r1"), none, || unreachable!()));
        assert_eq!(done.phase, Some(Phase::Completed));
        let st = status(&done, None).unwrap();
        assert_eq!(st.previous_key_id, None);
        assert_eq!(st.key_id.as_deref(), Some(new_kid.as_str()));

        // Done is done: the same request again changes nothing; a new one starts over from
        // the new key.
        assert_eq!(
            decide(&done, &ask("r1", "r1"), none, || unreachable!()),
            Decision::Idle
        );
        let again = written(decide(
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
        let started = written(decide(&k, &at(1000, "1h"), &[], || unreachable!()));
        assert_eq!(started.started_at, Some(1000));
        // Before the delay it waits, saying when it completes; at it, it completes.
        let Decision::Wait(m) = decide(&started, &at(4599, "1h"), &[], || unreachable!()) else {
            panic!()
        };
        assert!(
            m.contains("completes by itself at 1970-01-01T01:16:40Z"),
            "{m}"
        );
        assert!(matches!(
            decide(&started, &at(4600, "1h"), &[], || unreachable!()),
            Decision::Resign(_)
        ));
        // No delay: it waits for ever; a delay that does not parse is said.
        assert!(matches!(
            decide(&started, &at(1_000_000, ""), &[], || unreachable!()),
            Decision::Wait(_)
        ));
        let Decision::Wait(m) = decide(&started, &at(1_000_000, "soon"), &[], || unreachable!())
        else {
            panic!()
        };
        assert!(m.contains("not a duration"), "{m}");
        // Started before the time was recorded: never by itself, and said so.
        let unknown = SaKeys {
            started_at: None,
            ..started.clone()
        };
        let Decision::Wait(m) = decide(&unknown, &at(1_000_000, "1h"), &[], || unreachable!())
        else {
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
            decide(&k, &ask("r1", ""), &[], || unreachable!()),
            Decision::Blocked(m) if m.contains("next.key")
        ));
        // A request's name goes into status, Events and pods: bounded and printable.
        for bad in ["x".repeat(MAX_ID + 1), "a\nb".to_string()] {
            assert!(matches!(
                decide(&fresh(), &ask(&bad, ""), &[], || unreachable!()),
                Decision::Blocked(m) if m.contains("printable")
            ));
        }
        // A bundle holding what a rotation does not understand, or not the key that signs, is
        // never rewritten (a key in use could be dropped).
        let mut k = fresh();
        let ca = pki::generate_ca("x", time::OffsetDateTime::now_utc()).unwrap();
        k.verify = format!("{}{}", k.verify, ca.cert_pem);
        assert!(matches!(
            decide(&k, &ask("r1", ""), &[], pki::generate_service_account_key),
            Decision::Blocked(m) if m.contains("CERTIFICATE")
        ));
        let mut k = fresh();
        k.verify = pki::generate_service_account_key().unwrap().cert_pem;
        assert!(matches!(
            decide(&k, &ask("r1", ""), &[], pki::generate_service_account_key),
            Decision::Blocked(m) if m.contains("public key of tls.key")
        ));
        let mut k = fresh();
        k.verify = "not a key".into();
        assert!(matches!(
            decide(&k, &ask("r1", ""), &[], pki::generate_service_account_key),
            Decision::Blocked(_)
        ));
    }
}
