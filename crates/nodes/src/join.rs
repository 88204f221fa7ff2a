//! The cluster's side of a node joining: a bootstrap token and the RBAC that lets a kubelet
//! holding it ask for a client certificate, have that request approved, and renew it (as
//! `kubeadm` sets up). A node is given the token and the cluster CA, never an admin
//! credential.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{Patch, PatchParams};
use rand::RngExt;

use crate::Error;

const MANAGER: &str = "nestplane-nodes";

/// The group bootstrap tokens made here put their kubelets in (besides
/// `system:bootstrappers`).
pub const BOOTSTRAP_GROUP: &str = "system:bootstrappers:nestplane:nodes";

/// A bootstrap token (`<id>.<secret>`, `[a-z0-9]{6}.[a-z0-9]{16}`).
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken {
    /// The public part.
    pub id: String,
    /// The secret part.
    pub secret: String,
}

impl std::fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BootstrapToken({}.<redacted>)", self.id)
    }
}

impl BootstrapToken {
    /// A new random token.
    pub fn generate() -> BootstrapToken {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let mut rng = rand::rng();
        let mut pick = |n: usize| -> String {
            (0..n)
                .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
                .collect()
        };
        BootstrapToken {
            id: pick(6),
            secret: pick(16),
        }
    }

    /// A token as written (`<id>.<secret>`); the error never repeats the secret.
    pub fn parse(s: &str) -> Result<BootstrapToken, String> {
        let ok = |p: &str, n: usize| {
            p.len() == n
                && p.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        };
        match s.trim().split_once('.') {
            Some((id, secret)) if ok(id, 6) && ok(secret, 16) => Ok(BootstrapToken {
                id: id.into(),
                secret: secret.into(),
            }),
            _ => Err("a bootstrap token is [a-z0-9]{6}.[a-z0-9]{16}".into()),
        }
    }

    /// `<id>.<secret>`, what the kubelet presents.
    pub fn token(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }

    /// The Secret that makes the token valid until `expires` (RFC 3339).
    pub fn secret_object(&self, expires: &str) -> Secret {
        let data: BTreeMap<String, String> = [
            ("token-id", self.id.as_str()),
            ("token-secret", self.secret.as_str()),
            ("usage-bootstrap-authentication", "true"),
            ("usage-bootstrap-signing", "true"),
            ("auth-extra-groups", BOOTSTRAP_GROUP),
            ("expiration", expires),
            ("description", "nestplane node join"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        Secret {
            metadata: ObjectMeta {
                name: Some(format!("bootstrap-token-{}", self.id)),
                namespace: Some("kube-system".into()),
                ..ObjectMeta::default()
            },
            type_: Some("bootstrap.kubernetes.io/token".into()),
            string_data: Some(data),
            ..Secret::default()
        }
    }
}

/// The binding that has the controller-manager approve any bootstrap client certificate
/// request.
pub const AUTO_APPROVE_BOOTSTRAP: &str = "nestplane:node-autoapprove-bootstrap";

/// The bindings that let bootstrapping kubelets join and renew, and kube-proxy (which uses the
/// kubelet's credentials) watch Services and endpoints: `(binding, cluster role, group)`.
pub fn bindings() -> Vec<(&'static str, &'static str, &'static str)> {
    vec![
        (
            "nestplane:kubelet-bootstrap",
            "system:node-bootstrapper",
            "system:bootstrappers",
        ),
        (
            AUTO_APPROVE_BOOTSTRAP,
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            "system:bootstrappers",
        ),
        (
            "nestplane:node-autoapprove-certificate-rotation",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            "system:nodes",
        ),
        (
            "nestplane:node-proxier",
            "system:node-proxier",
            "system:nodes",
        ),
    ]
}

/// Make `token` valid for `ttl` on the cluster `client` talks to (with an admin credential),
/// and make sure the join bindings exist, including automatic approval of every bootstrap
/// client certificate request (kubeadm's setup, for clusters whose tokens only nestplane
/// holds). Idempotent.
pub async fn prepare(
    client: &kube::Client,
    token: &BootstrapToken,
    ttl: Duration,
) -> Result<(), Error> {
    create_token(client, token, ttl).await?;
    ensure_bindings(client, true).await
}

/// Make `token` valid for `ttl` (its Secret in `kube-system`).
pub async fn create_token(
    client: &kube::Client,
    token: &BootstrapToken,
    ttl: Duration,
) -> Result<(), Error> {
    let pp = PatchParams::apply(MANAGER).force();
    let expires = time_after(ttl);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "kube-system");
    let secret = token.secret_object(&expires);
    let name = secret.metadata.name.clone().unwrap_or_default();
    let mut value = serde_json::to_value(&secret).map_err(|e| Error::Join(e.to_string()))?;
    value["apiVersion"] = "v1".into();
    value["kind"] = "Secret".into();
    secrets
        .patch(&name, &pp, &Patch::Apply(value))
        .await
        .map_err(|e| Error::Join(format!("creating the bootstrap token: {e}")))?;
    Ok(())
}

/// Remove a token (a node that has joined, or was removed, needs it no more).
pub async fn delete_token(client: &kube::Client, id: &str) -> Result<(), Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "kube-system");
    match secrets
        .delete(&format!("bootstrap-token-{id}"), &Default::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(Error::Join(format!("deleting bootstrap token {id}: {e}"))),
    }
}

/// Make sure the join bindings exist (a deleted one comes back). Without `approve_bootstrap`, the binding that lets the
/// cluster's controller-manager approve every bootstrap client certificate request is left
/// out (and removed if present): requests are then approved by whoever knows which node
/// each token was made for (nestplane's NodePool controller).
pub async fn ensure_bindings(client: &kube::Client, approve_bootstrap: bool) -> Result<(), Error> {
    let pp = PatchParams::apply(MANAGER).force();
    let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
    for (name, role, group) in bindings() {
        let current = crbs
            .get_opt(name)
            .await
            .map_err(|e| Error::Join(format!("reading {name}: {e}")))?;
        if !approve_bootstrap && name == AUTO_APPROVE_BOOTSTRAP {
            if current.is_some() {
                match crbs.delete(name, &Default::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(e) => return Err(Error::Join(format!("removing {name}: {e}"))),
                }
            }
            continue;
        }
        // Written only when missing or changed: a pass that finds them in place only reads.
        if let Some(c) = &current
            && c.role_ref.name == role
            && c.subjects
                .as_ref()
                .is_some_and(|s| s.len() == 1 && s[0].kind == "Group" && s[0].name == group)
        {
            continue;
        }
        let crb = ClusterRoleBinding {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: role.into(),
            },
            subjects: Some(vec![Subject {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "Group".into(),
                name: group.into(),
                namespace: None,
            }]),
        };
        let mut value = serde_json::to_value(&crb).map_err(|e| Error::Join(e.to_string()))?;
        value["apiVersion"] = "rbac.authorization.k8s.io/v1".into();
        value["kind"] = "ClusterRoleBinding".into();
        crbs.patch(name, &pp, &Patch::Apply(value))
            .await
            .map_err(|e| Error::Join(format!("binding {role} to {group}: {e}")))?;
    }
    Ok(())
}

fn time_after(ttl: Duration) -> String {
    let t = std::time::SystemTime::now() + ttl;
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    rfc3339(secs)
}

/// Seconds since the epoch as RFC 3339 UTC. Pure.
fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_have_the_bootstrap_format_and_never_print_their_secret() {
        let t = BootstrapToken::generate();
        assert_eq!(t.id.len(), 6);
        assert_eq!(t.secret.len(), 16);
        assert!(
            t.token()
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.')
        );
        assert!(!format!("{t:?}").contains(&t.secret));
        assert_ne!(t, BootstrapToken::generate());
        assert_eq!(BootstrapToken::parse(&t.token()), Ok(t.clone()));
        for bad in [
            "",
            "abcdef",
            "abcdef.0123",
            "ABCDEF.0123456789abcdef",
            "abcdef.0123456789abcdeg.x",
        ] {
            let e = BootstrapToken::parse(bad).expect_err(bad);
            assert!(!e.contains("0123"), "{e}");
        }
    }

    #[test]
    fn the_token_secret_is_what_the_bootstrap_authenticator_reads() {
        let t = BootstrapToken {
            id: "abcdef".into(),
            secret: "0123456789abcdef".into(),
        };
        let s = t.secret_object("2026-11-24T00:00:00Z");
        assert_eq!(s.metadata.name.as_deref(), Some("bootstrap-token-abcdef"));
        assert_eq!(s.type_.as_deref(), Some("bootstrap.kubernetes.io/token"));
        let d = s.string_data.expect("data");
        assert_eq!(d["usage-bootstrap-authentication"], "true");
        assert_eq!(d["expiration"], "2026-11-24T00:00:00Z");
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_392_000), "2026-11-23T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
