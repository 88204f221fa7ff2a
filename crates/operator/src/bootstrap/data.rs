//! The bootstrap data a `NestplaneConfig` produces: a script that joins its machine. Pure.
//!
//! Every value in it may come from a namespace user (labels, taints, DNS settings, the
//! Machine's name) and the script runs as root on the machine: each is checked for what it
//! is, and written single-quoted, so that nothing in it is ever read by the shell.

use std::collections::BTreeMap;

use nestplane_api::bootstrap::{
    DEFAULT_TOKEN_TTL_SECONDS, MAX_TOKEN_TTL_SECONDS, NestplaneConfigSpec,
};

/// The shortest token life accepted (seconds).
pub const MIN_TOKEN_TTL_SECONDS: u32 = 60;

/// What the script joins with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Join {
    /// The gateway, `HOST:PORT`.
    pub server: String,
    /// The cluster's name at the gateway.
    pub server_name: String,
    /// The bootstrap token, `<id>.<secret>`.
    pub token: String,
    /// `sha256:<hex>` of the cluster CA's public key.
    pub ca_cert_hash: String,
    /// The kubelet's version.
    pub version: String,
    /// The Node's name (the Machine's).
    pub node_name: String,
    /// The port of the cluster's `kubernetes` Service endpoints.
    pub api_port: u16,
    /// When the token expires (RFC 3339), for the comment.
    pub expires: String,
    /// The Machine, `namespace/name`, for the comment.
    pub machine: String,
    /// The node's address block in its cluster.
    pub slot: u8,
}

/// A value single-quoted for `sh`: nothing in it is expanded.
fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

/// The script (cloud-init runs user data that begins with `#!`).
pub fn script(j: &Join, spec: &NestplaneConfigSpec) -> String {
    let mut args = vec![
        ("--server", j.server.clone()),
        ("--server-name", j.server_name.clone()),
        ("--ca-cert-hash", j.ca_cert_hash.clone()),
        ("--kubernetes-version", j.version.clone()),
        ("--name", j.node_name.clone()),
        ("--api-port", j.api_port.to_string()),
        ("--slot", j.slot.to_string()),
    ];
    for d in &spec.cluster_dns {
        args.push(("--cluster-dns", d.clone()));
    }
    if let Some(d) = &spec.cluster_domain {
        args.push(("--cluster-domain", d.clone()));
    }
    for (k, v) in &spec.node_labels {
        args.push(("--node-label", format!("{k}={v}")));
    }
    for t in &spec.node_taints {
        args.push(("--node-taint", t.clone()));
    }
    if let Some(m) = spec.max_pods {
        args.push(("--max-pods", m.to_string()));
    }
    if let Some(l) = &spec.pod_security {
        args.push(("--pod-security", l.clone()));
    }
    let mut out = String::from("#!/bin/sh\n");
    out.push_str(&format!(
        "# nestplane bootstrap data: machine {} joins as node {}.\n# The token expires at {} and is deleted once the node has joined.\nset -eu\n",
        comment(&j.machine),
        comment(&j.node_name),
        comment(&j.expires)
    ));
    // In the environment, not on the command line (where any user of the machine reads it).
    out.push_str(&format!("NESTPLANE_JOIN_TOKEN={}\n", quote(&j.token)));
    out.push_str("export NESTPLANE_JOIN_TOKEN\n");
    out.push_str("exec nestplane node join");
    for (flag, value) in args {
        out.push_str(&format!(" \\\n  {flag} {}", quote(&value)));
    }
    out.push('\n');
    out
}

fn comment(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

/// The token's life the spec asks for, or why it cannot be had.
pub fn token_ttl(spec: &NestplaneConfigSpec) -> Result<u32, String> {
    match spec.token_ttl_seconds {
        None => Ok(DEFAULT_TOKEN_TTL_SECONDS),
        Some(s) if (MIN_TOKEN_TTL_SECONDS..=MAX_TOKEN_TTL_SECONDS).contains(&s) => Ok(s),
        Some(s) => Err(format!(
            "spec.tokenTtlSeconds is {s}: it must be between {MIN_TOKEN_TTL_SECONDS} and {MAX_TOKEN_TTL_SECONDS}"
        )),
    }
}

/// Why the Machine cannot be joined as it is, or `Ok`: its version is `vMAJOR.MINOR.PATCH`
/// (it names the binaries the machine runs) and its name a DNS subdomain (the Node's).
pub fn validate_machine(version: &str, node_name: &str) -> Result<(), String> {
    let numbers: Vec<&str> = version
        .strip_prefix('v')
        .map(|v| v.split('.').collect())
        .unwrap_or_default();
    if numbers.len() != 3
        || numbers
            .iter()
            .any(|n| n.is_empty() || n.len() > 4 || !n.chars().all(|c| c.is_ascii_digit()))
    {
        return Err(format!(
            "the Machine's version {version:?} is not vMAJOR.MINOR.PATCH"
        ));
    }
    if !dns_name(node_name) {
        return Err(format!(
            "the Machine's name {node_name:?} cannot be a Node's name"
        ));
    }
    Ok(())
}

/// Why the spec cannot make a node, or `Ok`: labels are Kubernetes labels, taints
/// `key[=value]:Effect`, DNS servers IPv4 addresses, the domain a DNS name.
pub fn validate(spec: &NestplaneConfigSpec) -> Result<(), String> {
    token_ttl(spec)?;
    check_labels(&spec.node_labels)?;
    for t in &spec.node_taints {
        check_taint(t)?;
    }
    for d in &spec.cluster_dns {
        d.parse::<std::net::Ipv4Addr>()
            .map_err(|_| format!("spec.clusterDNS: {d:?} is not an IPv4 address"))?;
    }
    if let Some(d) = &spec.cluster_domain
        && !dns_name(d)
    {
        return Err(format!("spec.clusterDomain: {d:?} is not a DNS name"));
    }
    if let Some(m) = spec.max_pods
        && !(1..=250).contains(&m)
    {
        return Err(format!(
            "spec.maxPods {m}: a node's pods share its /24, so 1 to 250"
        ));
    }
    if let Some(l) = &spec.pod_security
        && !matches!(l.as_str(), "Baseline" | "Restricted")
    {
        return Err(format!(
            "spec.podSecurity {l:?}: Baseline or Restricted (Privileged is not offered for machines)"
        ));
    }
    Ok(())
}

fn dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// A label name or value's characters: alphanumerics and `-_.`, alphanumeric at both ends.
fn label_part(s: &str, max: usize) -> bool {
    s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && s.chars().next().is_none_or(|c| c.is_ascii_alphanumeric())
        && s.chars().last().is_none_or(|c| c.is_ascii_alphanumeric())
}

fn label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    prefix.is_none_or(dns_name) && !name.is_empty() && label_part(name, 63)
}

fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), String> {
    for (k, v) in labels {
        if !label_key(k) {
            return Err(format!("spec.nodeLabels: {k:?} is not a label key"));
        }
        if !label_part(v, 63) {
            return Err(format!(
                "spec.nodeLabels: the value of {k:?} is not a label value"
            ));
        }
    }
    Ok(())
}

fn check_taint(t: &str) -> Result<(), String> {
    let bad = || format!("spec.nodeTaints: {t:?} is not key[=value]:Effect");
    let (kv, effect) = t.rsplit_once(':').ok_or_else(bad)?;
    if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
        return Err(bad());
    }
    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
    if !label_key(k) || !label_part(v, 63) {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn join() -> Join {
        Join {
            server: "10.250.0.1:7443".into(),
            server_name: "w.default.nestplane.internal".into(),
            token: "abcdef.0123456789abcdef".into(),
            ca_cert_hash: format!("sha256:{}", "a".repeat(64)),
            version: "v1.20.2".into(),
            node_name: "m-0".into(),
            api_port: 6443,
            expires: "2026-11-29T16:00:00Z".into(),
            machine: "default/m-0".into(),
            slot: 250,
        }
    }

    /// Run `script` with a `nestplane` on PATH that prints its arguments and its token, one
    /// per line; returns them.
    fn run(script: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("nestplane");
        std::fs::write(
            &fake,
            "#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\nprintf 'token=%s\\n' \"$NESTPLANE_JOIN_TOKEN\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("PATH", format!("{}:/usr/bin:/bin", dir.path().display()))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Nothing but the fake was made where the script ran.
        let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
        assert_eq!(files.len(), 1, "the script wrote files: {files:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_script_joins_with_the_token_in_its_environment() {
        let s = script(&join(), &NestplaneConfigSpec::default());
        assert!(s.starts_with("#!/bin/sh\n"));
        let args = run(&s);
        assert_eq!(&args[..3], ["node", "join", "--server"]);
        assert!(args.contains(&"w.default.nestplane.internal".to_string()));
        assert_eq!(args.last().unwrap(), "token=abcdef.0123456789abcdef");
        assert!(
            !args[..args.len() - 1]
                .iter()
                .any(|a| a.contains("0123456789abcdef")),
            "the token is not an argument: {args:?}"
        );
    }

    #[test]
    fn values_a_user_wrote_reach_the_join_as_they_are_and_are_never_run() {
        // Whatever gets past validation is still never read by the shell.
        let mut spec = NestplaneConfigSpec::default();
        spec.node_labels
            .insert("x".into(), "$(touch pwned)`touch pwned2`".into());
        spec.node_taints
            .push("a';touch pwned3;'=b:NoSchedule".into());
        let mut j = join();
        j.node_name = "m'; touch pwned4; echo '".into();
        j.machine = "default/m\nrm -rf /".into();
        let args = run(&script(&j, &spec));
        assert!(args.contains(&"x=$(touch pwned)`touch pwned2`".to_string()));
        assert!(args.contains(&"a';touch pwned3;'=b:NoSchedule".to_string()));
        assert!(args.contains(&"m'; touch pwned4; echo '".to_string()));
        // And validation refuses them in the first place.
        assert!(validate(&spec).is_err());
    }

    #[test]
    fn what_validation_refuses_and_accepts() {
        let ok = NestplaneConfigSpec {
            node_labels: [("nestplane.io/pool".to_string(), "edge-1".to_string())].into(),
            node_taints: vec!["dedicated=edge:NoSchedule".into(), "gpu:NoExecute".into()],
            cluster_dns: vec!["10.96.0.10".into()],
            cluster_domain: Some("cluster.local".into()),
            token_ttl_seconds: Some(600),
            max_pods: Some(30),
            pod_security: Some("Restricted".into()),
        };
        assert_eq!(validate(&ok), Ok(()));
        for bad in [
            NestplaneConfigSpec {
                token_ttl_seconds: Some(10),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                token_ttl_seconds: Some(MAX_TOKEN_TTL_SECONDS + 1),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                node_labels: [("a b".to_string(), "c".to_string())].into(),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                node_labels: [("a".to_string(), "c\nd".to_string())].into(),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                node_taints: vec!["a=b:Sometimes".into()],
                ..ok.clone()
            },
            NestplaneConfigSpec {
                cluster_dns: vec!["ns.example".into()],
                ..ok.clone()
            },
            NestplaneConfigSpec {
                cluster_domain: Some("Cluster.Local;x".into()),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                max_pods: Some(0),
                ..ok.clone()
            },
            NestplaneConfigSpec {
                pod_security: Some("Privileged".into()),
                ..ok.clone()
            },
        ] {
            assert!(validate(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            token_ttl(&NestplaneConfigSpec::default()),
            Ok(DEFAULT_TOKEN_TTL_SECONDS)
        );
        assert_eq!(validate_machine("v1.20.2", "m-0"), Ok(()));
        for (v, n) in [
            ("1.20.2", "m-0"),
            ("/tmp/x", "m-0"),
            ("v1.20.2/../../x", "m-0"),
            ("v1.20", "m-0"),
            ("v1.20.2", "M_0"),
        ] {
            assert!(validate_machine(v, n).is_err(), "{v} {n}");
        }
    }
}
