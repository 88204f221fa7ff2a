//! What a NodePool asks for, as values: its validation, the one [`NodeSpec`] of its nodes
//! (hashed whole, so a new field cannot miss the rollout), durations, its pod security
//! condition, and the status its nodes add up to. Pure.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use nestplane_api::conditions;
use nestplane_api::hosted::{
    ClusterApiPlatform, NodeInfo, NodePool, PodSecurityLevel, platforms, types,
};
use nestplane_nodes::config::NodeSpec;

/// The label on a pool's Nodes (the NodePool's name).
pub const POOL_LABEL: &str = "nestplane.io/nodepool";
/// How long a node is drained when the pool does not say.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(300);
/// The condition type saying which pod security level a pool's nodes enforce.
pub const POD_SECURITY: &str = "PodSecurity";
/// The longest duration a spec may give (a drain timeout longer than this is a mistake).
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// What every node of `pool` at `version` is: labels (with [`POOL_LABEL`]), taints, kubelet
/// settings and pod security level. Everything a pool says about its nodes goes here.
pub fn node_spec(pool: &NodePool, name: &str, version: &str) -> NodeSpec {
    let mut labels = pool.spec.node_labels.clone();
    labels.insert(POOL_LABEL.into(), name.into());
    NodeSpec {
        version: version.into(),
        labels,
        taints: pool
            .spec
            .taints
            .iter()
            .map(|t| match &t.value {
                Some(v) if !v.is_empty() => format!("{}={v}:{}", t.key, t.effect),
                _ => format!("{}:{}", t.key, t.effect),
            })
            .collect(),
        max_pods: pool.spec.max_pods.map(|m| m.clamp(1, 250) as u32),
        pod_security: guard_level(pool.spec.pod_security.unwrap_or_default()),
    }
}

/// The node guard's level for a pool's level.
pub fn guard_level(level: PodSecurityLevel) -> nestplane_nodes::guard::Level {
    use nestplane_nodes::guard::Level;
    match level {
        PodSecurityLevel::Baseline => Level::Baseline,
        PodSecurityLevel::Restricted => Level::Restricted,
        PodSecurityLevel::Privileged => Level::Privileged,
    }
}

/// The `PodSecurity` condition of a pool at `level`: True when a level is enforced on its
/// nodes; False (a Warning) for `Privileged`, where a tenant admin can become root on the
/// machine.
pub fn pod_security_condition(level: PodSecurityLevel) -> Condition {
    match level {
        PodSecurityLevel::Privileged => conditions::new(
            POD_SECURITY,
            false,
            "Privileged",
            "no pod security is enforced on these nodes: the tenant's admins can run privileged pods and become root on this machine",
        ),
        l => conditions::new(
            POD_SECURITY,
            true,
            l.as_str(),
            format!(
                "{} is enforced on the nodes, below the tenant (its admins cannot switch it off)",
                l.as_str()
            ),
        ),
    }
}

/// The pool's `ClusterAPI` platform, if that is where its nodes run.
pub fn cluster_api(pool: &NodePool) -> Option<&ClusterApiPlatform> {
    let p = pool.spec.platform.as_ref()?;
    (p.type_ == platforms::CLUSTER_API)
        .then_some(p.cluster_api.as_ref())
        .flatten()
}

/// The name of the pool's platform (`Local` when it names none).
pub fn platform_name(pool: &NodePool) -> &'static str {
    if cluster_api(pool).is_some() {
        platforms::CLUSTER_API
    } else {
        platforms::LOCAL
    }
}

/// The platform: `Local` (or none) or `ClusterAPI` with an infrastructure template.
fn validate_platform(pool: &NodePool) -> Result<(), String> {
    let Some(p) = &pool.spec.platform else {
        return Ok(());
    };
    match p.type_.as_str() {
        platforms::LOCAL => Ok(()),
        platforms::CLUSTER_API => {
            let r = &p
                .cluster_api
                .as_ref()
                .ok_or("platform ClusterAPI needs clusterAPI.infrastructureRef")?
                .infrastructure_ref;
            let dns = |s: &str| {
                !s.is_empty()
                    && s.len() <= 253
                    && s.chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'
                    })
            };
            let kind = !r.kind.is_empty()
                && r.kind.len() <= 63
                && r.kind.chars().all(|c| c.is_ascii_alphanumeric());
            if pool.spec.pod_security == Some(PodSecurityLevel::Privileged) {
                return Err(
                    "podSecurity Privileged is not offered on platform ClusterAPI: Baseline or Restricted".into(),
                );
            }
            if !dns(&r.api_group) || !kind || !dns(&r.name) {
                return Err(format!(
                    "platform.clusterAPI.infrastructureRef: {}/{} {:?} is not an API group, kind and name",
                    r.api_group, r.kind, r.name
                ));
            }
            Ok(())
        }
        t => Err(format!(
            "platform.type {t:?}: {} or {}",
            platforms::LOCAL,
            platforms::CLUSTER_API
        )),
    }
}

/// Check labels and taints (they reach the kubelet's flags), durations, the upgrade type and
/// the platform.
pub fn validate_pool(pool: &NodePool) -> Result<(), String> {
    validate_platform(pool)?;
    let label_ok = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    };
    for (k, v) in &pool.spec.node_labels {
        if !label_ok(k, 253) || !(v.is_empty() || label_ok(v, 63)) || v.contains('/') {
            return Err(format!("nodeLabels: {k:?}={v:?} is not a valid label"));
        }
        if k == POOL_LABEL {
            return Err(format!("nodeLabels: {POOL_LABEL} is set by nestplane"));
        }
    }
    for t in &pool.spec.taints {
        let value_ok = t
            .value
            .as_deref()
            .is_none_or(|v| v.is_empty() || label_ok(v, 63));
        if !label_ok(&t.key, 253) || !value_ok {
            return Err(format!("taints: {:?} is not a valid taint", t.key));
        }
        if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&t.effect.as_str()) {
            return Err(format!(
                "taints: effect {:?} is not NoSchedule, PreferNoSchedule or NoExecute",
                t.effect
            ));
        }
    }
    if let Some(m) = pool.spec.max_pods
        && !(1..=250).contains(&m)
    {
        return Err(format!(
            "maxPods {m}: a node's pods share its /24, so 1 to 250"
        ));
    }
    if let Some(d) = &pool.spec.node_drain_timeout {
        parse_duration(d)?;
    }
    if let Some(t) = pool.spec.management.upgrade_type.as_deref()
        && !t.is_empty()
        && t != "Replace"
    {
        return Err(format!(
            "management.upgradeType {t:?}: only Replace is offered"
        ));
    }
    Ok(())
}

/// How long a pool's nodes are drained.
pub fn drain_timeout(pool: &NodePool) -> Duration {
    pool.spec
        .node_drain_timeout
        .as_deref()
        .and_then(|d| parse_duration(d).ok())
        .unwrap_or(DEFAULT_DRAIN_TIMEOUT)
}

/// A Go duration as Kubernetes writes them (`90s`, `1m30s`, `300ms`, `1.5h`, `0`), read by
/// `kube::core::Duration`, at most [`MAX_DURATION`]. The text is checked first (at most four
/// parts of up to nine digits, a fraction of up to nine, and a unit; no sign), so nothing a
/// user writes can overflow the parser.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let bad = || format!("{s:?} is not a duration (like 90s, 5m, 1m30s, 300ms)");
    if !plain_duration(s) {
        return Err(bad());
    }
    let d: Duration = s.parse::<kube::core::Duration>().map_err(|_| bad())?.into();
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than {}h",
            MAX_DURATION.as_secs() / 3600
        ));
    }
    Ok(d)
}

/// Whether `s` is 1 to 4 parts `<digits>[.<digits>]<unit>` (1-9 digits each; units `ns`,
/// `us`, `µs`, `ms`, `s`, `m`, `h`).
fn plain_duration(s: &str) -> bool {
    let mut rest = s;
    let mut parts = 0;
    while !rest.is_empty() {
        parts += 1;
        if parts > 4 {
            return false;
        }
        let int = rest.chars().take_while(char::is_ascii_digit).count();
        if !(1..=9).contains(&int) {
            return false;
        }
        rest = &rest[int..];
        if let Some(r) = rest.strip_prefix('.') {
            let frac = r.chars().take_while(char::is_ascii_digit).count();
            if !(1..=9).contains(&frac) {
                return false;
            }
            rest = &r[frac..];
        }
        let Some(unit) = ["ns", "us", "µs", "ms", "s", "m", "h"]
            .iter()
            .find(|u| rest.starts_with(**u))
        else {
            return false;
        };
        rest = &rest[unit.len()..];
    }
    parts > 0
}

/// What a pool's nodes add up to: its `Ready`, `AllNodesHealthy`, `UpdatingVersion` and
/// `UpdatingConfig` conditions, and whether the pool is done (every node there, current and
/// Ready).
#[derive(Debug, PartialEq)]
pub struct Report {
    /// Ready nodes.
    pub ready: i32,
    /// Every node is there, current and Ready.
    pub done: bool,
    /// The conditions, in order.
    pub conditions: Vec<Condition>,
}

/// The [`Report`] of `nodes` for a pool of `replicas` at `version`.
pub fn report(nodes: &[NodeInfo], replicas: u32, version: &str) -> Report {
    let ready = nodes.iter().filter(|i| i.ready).count() as i32;
    let current = nodes.iter().filter(|i| i.current).count() as u32;
    let old_versions = nodes.iter().any(|i| i.version != version);
    let old_config = nodes.iter().any(|i| !i.current) && !old_versions;
    let done = nodes.len() as u32 == replicas && current == replicas && ready as u32 == replicas;
    let counted = format!("{ready}/{replicas} nodes Ready");
    let ready_condition = if done {
        conditions::new(types::READY, true, "AsExpected", counted)
    } else {
        conditions::new(types::READY, false, "ScalingOrUpdating", counted)
    };
    let healthy = nodes.iter().all(|n| n.ready);
    let not_ready = nodes
        .iter()
        .filter(|n| !n.ready)
        .map(|n| n.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let healthy = conditions::new(
        types::ALL_NODES_HEALTHY,
        healthy,
        if healthy {
            "AsExpected"
        } else {
            "NodesNotReady"
        },
        not_ready,
    );
    let replacing = |on: bool, ty: &str, why: String| {
        if on {
            conditions::new(ty, true, "Replacing", why)
        } else {
            conditions::new(ty, false, "AsExpected", "")
        }
    };
    Report {
        ready,
        done,
        conditions: vec![
            ready_condition,
            healthy,
            replacing(
                old_versions,
                types::UPDATING_VERSION,
                format!("replacing nodes for {version}"),
            ),
            replacing(
                old_config,
                types::UPDATING_CONFIG,
                "replacing nodes for a new node configuration (labels, taints, kubelet settings or pod security level)".into(),
            ),
        ],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn pool(spec: serde_json::Value) -> NodePool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "nestplane.io/v1alpha1", "kind": "NodePool",
            "metadata": {"name": "p", "namespace": "n"}, "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn labels_taints_and_durations_are_checked_before_they_reach_a_kubelet() {
        assert!(validate_pool(&pool(serde_json::json!({"clusterName": "c", "nodeLabels": {"tier": "web"}, "taints": [{"key": "gpu", "effect": "NoSchedule"}], "nodeDrainTimeout": "1m30s", "maxPods": 30}))).is_ok());
        assert!(
            validate_pool(&pool(
                serde_json::json!({"clusterName": "c", "nodeLabels": {"a": "b,--x=y"}})
            ))
            .is_err()
        );
        assert!(validate_pool(&pool(serde_json::json!({"clusterName": "c", "taints": [{"key": "gpu", "effect": "Maybe"}]}))).is_err());
        assert!(
            validate_pool(&pool(
                serde_json::json!({"clusterName": "c", "nodeLabels": {POOL_LABEL: "x"}})
            ))
            .is_err()
        );
        for bad in [0, 251, -1] {
            assert!(
                validate_pool(&pool(
                    serde_json::json!({"clusterName": "c", "maxPods": bad})
                ))
                .is_err(),
                "{bad}"
            );
        }
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("300ms"), Ok(Duration::from_millis(300)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("-5s").is_err());
        // Nothing a user writes panics the parser, or overflows a deadline.
        for bad in [
            "1s-1s",
            "6000000000000000h",
            &"9".repeat(400),
            "1e9h",
            "999999999h",
            "1h1h1h1h1h",
            "",
            ".5s",
            "5.s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_duration("720h"), Ok(MAX_DURATION));
    }

    #[test]
    fn what_a_node_is_built_from_changes_its_hash() {
        let hash =
            |spec: serde_json::Value, version: &str| node_spec(&pool(spec), "p", version).hash();
        let a = serde_json::json!({"clusterName": "c"});
        assert_eq!(hash(a.clone(), "v1.20.2"), hash(a.clone(), "v1.20.2"));
        assert_ne!(hash(a.clone(), "v1.20.2"), hash(a.clone(), "v1.20.1"));
        for changed in [
            serde_json::json!({"clusterName": "c", "nodeLabels": {"tier": "web"}}),
            serde_json::json!({"clusterName": "c", "taints": [{"key": "gpu", "effect": "NoSchedule"}]}),
            serde_json::json!({"clusterName": "c", "taints": [{"key": "gpu", "value": "a", "effect": "NoSchedule"}]}),
            serde_json::json!({"clusterName": "c", "maxPods": 20}),
            serde_json::json!({"clusterName": "c", "podSecurity": "Restricted"}),
        ] {
            assert_ne!(
                hash(a.clone(), "v1.20.2"),
                hash(changed.clone(), "v1.20.2"),
                "{changed}"
            );
        }
        // What only says how many nodes, or how they are drained, replaces none.
        let same = serde_json::json!({"clusterName": "c", "replicas": 5, "nodeDrainTimeout": "1m"});
        assert_eq!(hash(a, "v1.20.2"), hash(same, "v1.20.2"));
    }

    #[test]
    fn a_pool_spec_reaches_its_nodes_whole() {
        let spec = node_spec(
            &pool(
                serde_json::json!({"clusterName": "c", "nodeLabels": {"tier": "web"},
                "taints": [{"key": "gpu", "value": "a", "effect": "NoSchedule"}, {"key": "spot", "effect": "NoExecute"}],
                "maxPods": 20, "podSecurity": "Restricted"}),
            ),
            "p",
            "v1.20.2",
        );
        assert_eq!(spec.labels.get(POOL_LABEL).map(String::as_str), Some("p"));
        assert_eq!(spec.labels.get("tier").map(String::as_str), Some("web"));
        assert_eq!(spec.taints, ["gpu=a:NoSchedule", "spot:NoExecute"]);
        assert_eq!(spec.max_pods, Some(20));
        assert_eq!(spec.pod_security, nestplane_nodes::guard::Level::Restricted);
    }

    #[test]
    fn a_pool_is_ready_when_every_node_is_there_current_and_ready() {
        let node = |name: &str, version: &str, ready, current| NodeInfo {
            name: name.into(),
            version: version.into(),
            ready,
            current,
        };
        let done = report(&[node("a", "v1.20.2", true, true)], 1, "v1.20.2");
        assert!(done.done);
        assert_eq!(done.conditions[0].status, "True");
        assert_eq!(done.conditions[0].message, "1/1 nodes Ready");
        assert!(done.conditions[2..].iter().all(|c| c.status == "False"));

        let upgrading = report(
            &[
                node("a", "v1.20.1", true, false),
                node("b", "v1.20.2", false, true),
            ],
            1,
            "v1.20.2",
        );
        assert!(!upgrading.done);
        assert_eq!(upgrading.ready, 1);
        assert_eq!(upgrading.conditions[0].reason, "ScalingOrUpdating");
        assert_eq!(upgrading.conditions[1].message, "b");
        assert_eq!(upgrading.conditions[2].status, "True", "UpdatingVersion");
        assert_eq!(
            upgrading.conditions[3].status, "False",
            "not a config change"
        );

        let reconfiguring = report(&[node("a", "v1.20.2", true, false)], 1, "v1.20.2");
        assert_eq!(reconfiguring.conditions[3].status, "True", "UpdatingConfig");
        assert!(!reconfiguring.done);
    }
}
