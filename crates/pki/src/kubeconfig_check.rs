//! The one check every reader of a kubeconfig that a user could have written applies before
//! using it: such a kubeconfig may carry inline credentials and addresses only. Anything that
//! would run a command (`exec`, `auth-provider`), read a file (certificate, key or token
//! paths), or send traffic elsewhere (`proxy-url`) on the reader's machine is refused. It is
//! an allow-list: a field it does not know is refused too. Pure.

use serde_json::Value;

use crate::CertKey;

/// Fields a `users[].user` entry may hold.
const USER_FIELDS: &[&str] = &[
    "client-certificate-data",
    "client-key-data",
    "token",
    "username",
    "password",
];
/// Fields a `clusters[].cluster` entry may hold.
const CLUSTER_FIELDS: &[&str] = &[
    "server",
    "certificate-authority-data",
    "tls-server-name",
    "insecure-skip-tls-verify",
];
/// Fields a `contexts[].context` entry may hold.
const CONTEXT_FIELDS: &[&str] = &["cluster", "user", "namespace"];
/// Top-level fields.
const TOP_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "clusters",
    "users",
    "contexts",
    "current-context",
    "preferences",
];

/// How YAML that a user wrote is read (kubeconfigs in their Secrets, addon manifests): a
/// budget that stops alias bombs and deep nesting early (a manifest nests a few dozen levels,
/// names a few anchors), merge keys (`<<`) kept as ordinary keys so a check sees them (a reader
/// that expands them, as Kubernetes' does, sets `merge_keys` back), no snippet of the text in
/// an error (it is a Secret's), and duplicate keys refused.
pub fn untrusted_yaml() -> serde_saphyr::Options {
    serde_saphyr::options! {
        budget: serde_saphyr::budget! {
            max_depth: 64,
            flow_nesting_limit: 64,
            max_nodes: 200_000,
            max_aliases: 10_000,
            max_anchors: 10_000,
            max_total_scalar_bytes: 8 << 20,
            max_recorded_anchor_bytes: 8 << 20,
        },
        alias_limits: serde_saphyr::alias_limits! {
            max_total_replayed_events: 100_000,
        },
        merge_keys: serde_saphyr::MergeKeyPolicy::AsOrdinary,
        duplicate_keys: serde_saphyr::DuplicateKeyPolicy::Error,
        with_snippet: false,
    }
}

/// Whether `yaml` is a kubeconfig of inline credentials only; the error names every field
/// that is refused (never a value: kubeconfigs hold secrets).
pub fn check_kubeconfig(yaml: &str) -> Result<(), String> {
    let doc: Value = serde_saphyr::from_str_with_options(yaml, untrusted_yaml()).map_err(|e| {
        format!(
            "the kubeconfig is not YAML: {}",
            e.to_string().lines().next().unwrap_or_default()
        )
    })?;
    let Value::Object(top) = &doc else {
        return Err("the kubeconfig is not a mapping".into());
    };
    let mut bad = Vec::new();
    // A YAML merge key (`<<`) is applied by client-go's parser; it is read here as an ordinary
    // key (see `untrusted_yaml`) and refused wherever it stands, so what it would bring in is
    // never unseen.
    if has_merge_key(&doc) {
        bad.push("a YAML merge key (<<)".to_string());
    }
    for (k, v) in top {
        let k = k.as_str();
        if !TOP_FIELDS.contains(&k) {
            bad.push(format!("field {k:?}"));
            continue;
        }
        let (inner, allowed) = match k {
            "users" => ("user", USER_FIELDS),
            "clusters" => ("cluster", CLUSTER_FIELDS),
            "contexts" => ("context", CONTEXT_FIELDS),
            _ => continue,
        };
        for entry in v.as_array().into_iter().flatten() {
            let name = entry
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            for f in entry.as_object().into_iter().flat_map(|m| m.keys()) {
                let f = f.as_str();
                if f != "name" && f != inner {
                    bad.push(format!("{inner} entry {name:?} has field {f:?}"));
                }
            }
            let Some(Value::Object(fields)) = entry.get(inner) else {
                continue;
            };
            for f in fields.keys() {
                let f = f.as_str();
                if !allowed.contains(&f) {
                    bad.push(format!("{inner} {name:?} uses {f}"));
                }
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the kubeconfig is refused: {} (only inline credentials are used: nothing may run, be read or be reached through it on the reader's machine)",
            bad.join(", ")
        ))
    }
}

/// A kubeconfig a user could have written, as `kube` reads it, once [`check_kubeconfig`]
/// passed it. Read with the same limits (not `Kubeconfig::from_yaml`, whose errors quote the
/// text around a mistake: a key or a token); an error says where, never what.
pub fn read_kubeconfig(yaml: &str) -> Result<kube::config::Kubeconfig, String> {
    check_kubeconfig(yaml)?;
    serde_saphyr::from_str_with_options(yaml, untrusted_yaml()).map_err(|e| match e.location() {
        Some(at) => format!(
            "the kubeconfig is not a kubeconfig: a field has the wrong type (line {}, column {})",
            at.line(),
            at.column()
        ),
        None => "the kubeconfig is not a kubeconfig: a field has the wrong type".to_string(),
    })
}

fn has_merge_key(v: &Value) -> bool {
    match v {
        Value::Object(m) => m.iter().any(|(k, v)| k == "<<" || has_merge_key(v)),
        Value::Array(s) => s.iter().any(has_merge_key),
        _ => false,
    }
}

/// The client certificate and key of a kubeconfig's first user, when it has inline ones.
pub fn kubeconfig_client(yaml: &str) -> Option<CertKey> {
    use base64::Engine as _;
    let doc: Value = serde_saphyr::from_str_with_options(yaml, untrusted_yaml()).ok()?;
    let user = doc.get("users")?.as_array()?.first()?.get("user")?;
    let decode = |field: &str| -> Option<String> {
        let b64 = user.get(field)?.as_str()?;
        let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        String::from_utf8(raw).ok()
    };
    Some(CertKey {
        cert_pem: decode("client-certificate-data")?,
        key_pem: decode("client-key-data")?,
    })
}

/// What a kubeconfig nestplane issued is made of (see [`verify_issued_kubeconfig`]).
#[derive(Clone, Copy, Debug)]
pub struct Issued<'a> {
    /// The cluster's name in the kubeconfig.
    pub cluster: &'a str,
    /// The API server URL.
    pub server: &'a str,
    /// Its `tls-server-name`, if any.
    pub server_name: Option<&'a str>,
    /// The CA that signs the client certificate and verifies the server.
    pub ca_pem: &'a str,
    /// The user (the client certificate's common name).
    pub user: &'a str,
    /// The client certificate's organizations (groups).
    pub groups: &'a [String],
}

/// The client certificate of `value` when `value` is, byte for byte, the kubeconfig
/// [`crate::kubeconfig`] writes for `want` with a client certificate `want.ca_pem` signed for
/// `want.user` and `want.groups` and the key that belongs to it; `None` for anything else
/// (a kubeconfig someone else wrote or edited is never used, whatever it holds). Pure.
pub fn verify_issued_kubeconfig(value: &str, want: &Issued<'_>) -> Option<CertKey> {
    let client = kubeconfig_client(value)?;
    let again = crate::kubeconfig(
        want.cluster,
        want.server,
        want.server_name,
        want.ca_pem,
        want.user,
        &client,
    )
    .ok()?;
    if again != value
        || !crate::key_matches(&client.cert_pem, &client.key_pem).ok()?
        || !crate::verify_signed_by(&client.cert_pem, want.ca_pem).ok()?
    {
        return None;
    }
    let info = crate::inspect(&client.cert_pem).ok()?;
    let mut have = info.organizations.clone();
    have.sort();
    let mut groups = want.groups.to_vec();
    groups.sort();
    (info.subject_cn == want.user && have == groups && info.client_auth).then_some(client)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const INLINE: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:6443', certificate-authority-data: Y2E=}\nusers:\n- name: u\n  user: {client-certificate-data: Y2VydA==, client-key-data: a2V5}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n";

    #[test]
    fn inline_credentials_pass_and_anything_that_runs_reads_or_reaches_is_refused() {
        check_kubeconfig(INLINE).unwrap();
        for (hostile, named) in [
            (
                "user: {exec: {apiVersion: client.authentication.k8s.io/v1beta1, command: /bin/sh, args: ['-c', 'id > /tmp/m']}}",
                "uses exec",
            ),
            ("user: {auth-provider: {name: gcp}}", "uses auth-provider"),
            ("user: {tokenFile: /etc/shadow}", "uses tokenFile"),
            (
                "user: {client-certificate: /root/key, client-key: /root/key}",
                "uses client-certificate",
            ),
            ("user: {as: system:admin}", "uses as"),
        ] {
            let yaml = INLINE.replace(
                "user: {client-certificate-data: Y2VydA==, client-key-data: a2V5}",
                hostile,
            );
            let err = check_kubeconfig(&yaml).unwrap_err();
            assert!(err.contains(named), "{hostile}: {err}");
            assert!(
                !err.contains("/tmp/m") && !err.contains("/etc/shadow"),
                "{err}"
            );
        }
        for (hostile, named) in [
            (
                "cluster: {server: 'https://127.0.0.1:6443', certificate-authority: /etc/ssl/ca.pem}",
                "uses certificate-authority",
            ),
            (
                "cluster: {server: 'https://127.0.0.1:6443', proxy-url: 'http://10.1.1.1:3128'}",
                "uses proxy-url",
            ),
        ] {
            let yaml = INLINE.replace(
                "cluster: {server: 'https://127.0.0.1:6443', certificate-authority-data: Y2E=}",
                hostile,
            );
            let err = check_kubeconfig(&yaml).unwrap_err();
            assert!(err.contains(named), "{hostile}: {err}");
        }
        assert!(check_kubeconfig("- a\n").is_err());
        // A merge key brings in what this parser does not apply and client-go does.
        let merged = INLINE.replace(
            "- name: u\n  user: {client-certificate-data: Y2VydA==, client-key-data: a2V5}",
            "- name: u\n  <<: {user: {exec: {command: /bin/sh}}}",
        );
        assert_ne!(merged, INLINE);
        let err = check_kubeconfig(&merged).unwrap_err();
        assert!(err.contains("merge key"), "{err}");
        assert!(check_kubeconfig(&format!("{INLINE}extensions: []\n")).is_err());
        // A field of the wrong type passes the allow-list and is refused when read, without
        // a word of the text (the next line holds a key).
        read_kubeconfig(INLINE).unwrap();
        let wrong = INLINE.replace(
            "cluster: {server: 'https://127.0.0.1:6443', certificate-authority-data: Y2E=}",
            "cluster: {server: [secretish], certificate-authority-data: Y2E=}",
        );
        let err = read_kubeconfig(&wrong).unwrap_err();
        assert!(err.contains("line 5"), "{err}");
        assert!(!err.contains("secretish") && !err.contains("a2V5"), "{err}");
        // kube merges the documents of a kubeconfig: a second one could bring in an exec
        // user, so a kubeconfig of several documents is refused whole.
        let second =
            format!("{INLINE}---\nusers:\n- name: u\n  user: {{exec: {{command: /bin/sh}}}}\n");
        assert!(check_kubeconfig(&second).is_err());
        // Duplicate keys (a reader that keeps the last one would see another user).
        let dup = INLINE.replace(
            "client-key-data: a2V5}",
            "client-key-data: a2V5, client-key-data: a2V5}",
        );
        assert!(check_kubeconfig(&dup).is_err());
        // An alias bomb stops the parser early.
        let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
        for i in 1..10 {
            let p = i - 1;
            bomb.push_str(&format!(
                "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
            ));
        }
        assert!(check_kubeconfig(&bomb).unwrap_err().contains("not YAML"));
    }

    #[test]
    fn only_the_kubeconfig_nestplane_would_write_verifies() {
        let now = time::OffsetDateTime::now_utc();
        let ca = crate::generate_ca("t-ca", now).unwrap();
        let groups = vec!["system:masters".to_string()];
        let spec = crate::LeafSpec {
            common_name: "admin".into(),
            organizations: groups.clone(),
            usage: crate::Usage::Client,
            ..Default::default()
        };
        let client = crate::issue(&ca, &spec, now).unwrap();
        let value = crate::kubeconfig(
            "t",
            "https://127.0.0.1:6443",
            None,
            &ca.cert_pem,
            "admin",
            &client,
        )
        .unwrap();
        let want = Issued {
            cluster: "t",
            server: "https://127.0.0.1:6443",
            server_name: None,
            ca_pem: &ca.cert_pem,
            user: "admin",
            groups: &groups,
        };
        assert!(verify_issued_kubeconfig(&value, &want).is_some());
        // An exec plugin added to the user, another server, another CA's certificate, a
        // certificate for someone else: each is not what nestplane issued.
        let exec = value.replace(
            "  user:\n",
            "  user:\n    exec: {command: /bin/sh, args: ['-c', 'id']}\n",
        );
        assert_ne!(exec, value);
        assert!(verify_issued_kubeconfig(&exec, &want).is_none());
        let elsewhere = Issued {
            server: "https://10.0.0.1:6443",
            ..want
        };
        assert!(verify_issued_kubeconfig(&value, &elsewhere).is_none());
        // Behind a gateway: the server name is part of what was issued, both ways.
        let named = Issued {
            server_name: Some("t.ns.nestplane.internal"),
            ..want
        };
        assert!(verify_issued_kubeconfig(&value, &named).is_none());
        let behind = crate::kubeconfig(
            "t",
            "https://127.0.0.1:6443",
            named.server_name,
            &ca.cert_pem,
            "admin",
            &client,
        )
        .unwrap();
        assert!(
            behind.contains("tls-server-name: t.ns.nestplane.internal"),
            "{behind}"
        );
        assert!(verify_issued_kubeconfig(&behind, &named).is_some());
        assert!(verify_issued_kubeconfig(&behind, &want).is_none());
        let other_ca = crate::generate_ca("other", now).unwrap();
        let foreign = crate::issue(&other_ca, &spec, now).unwrap();
        let forged = crate::kubeconfig(
            "t",
            "https://127.0.0.1:6443",
            None,
            &ca.cert_pem,
            "admin",
            &foreign,
        )
        .unwrap();
        assert!(verify_issued_kubeconfig(&forged, &want).is_none());
        let nobody = crate::issue(
            &ca,
            &crate::LeafSpec {
                common_name: "nobody".into(),
                ..spec.clone()
            },
            now,
        )
        .unwrap();
        let swapped = crate::kubeconfig(
            "t",
            "https://127.0.0.1:6443",
            None,
            &ca.cert_pem,
            "admin",
            &nobody,
        )
        .unwrap();
        assert!(verify_issued_kubeconfig(&swapped, &want).is_none());
    }

    #[test]
    fn the_client_of_a_kubeconfig_is_read_back() {
        let ck = kubeconfig_client(INLINE).unwrap();
        assert_eq!((ck.cert_pem.as_str(), ck.key_pem.as_str()), ("cert", "key"));
        assert!(kubeconfig_client("users: []").is_none());
    }
}
