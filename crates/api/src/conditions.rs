//! metav1 conditions computed as data: `lastTransitionTime` only moves when the status flips.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// Condition types used across nestplane.
pub mod types {
    /// v1beta2 contract: the control plane serves requests.
    pub const AVAILABLE: &str = "Available";
    /// Reconciliation is paused.
    pub const PAUSED: &str = "Paused";
    /// A component's replicas answer their health endpoints.
    pub const READY: &str = "Ready";
    /// Certificates and kubeconfigs exist and are current.
    pub const CERTIFICATES_READY: &str = "CertificatesReady";
    /// The deletion of the object is in progress.
    pub const DELETING: &str = "Deleting";
    /// A component runs the replicas its spec asks for (False: the change was refused).
    pub const SCALED: &str = "Scaled";
    /// A control plane's version change: True while its components move to the asked-for
    /// version, False when the change is refused (nothing moved); absent when none is pending.
    pub const UPGRADING: &str = "Upgrading";
}

/// Condition reasons used across nestplane.
pub mod reasons {
    /// Everything is as desired.
    pub const AS_EXPECTED: &str = "AsExpected";
    /// A dependency (another component) is not ready yet.
    pub const WAITING_FOR_DEPENDENCIES: &str = "WaitingForDependencies";
    /// Processes or workloads are starting.
    pub const PROVISIONING: &str = "Provisioning";
    /// The spec cannot be acted on.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A certificate or kubeconfig secret held content nestplane did not issue (it was
    /// edited); it was reissued and the edited content never used (an Event's reason).
    pub const SECRET_REISSUED: &str = "SecretReissued";
    /// The requested version is not available (no binaries, unsupported).
    pub const VERSION_UNAVAILABLE: &str = "VersionUnavailable";
    /// A version change to an older minor was refused.
    pub const DOWNGRADE_REFUSED: &str = "DowngradeRefused";
    /// A version change of more than one minor at once was refused.
    pub const MINOR_SKIP_REFUSED: &str = "MinorSkipRefused";
    /// A component's version would break the version skew policy with its API server.
    pub const UNSUPPORTED_SKEW: &str = "UnsupportedSkew";
    /// A control plane's components are moving to a new version.
    pub const UPGRADING: &str = "Upgrading";
    /// A version change's step was reached by every part (an Event's reason).
    pub const UPGRADE_STEP_REACHED: &str = "UpgradeStepReached";
    /// Every part of a control plane runs the version asked for (an Event's reason).
    pub const UPGRADE_COMPLETED: &str = "UpgradeCompleted";
    /// A referenced object does not exist.
    pub const REFERENCE_NOT_FOUND: &str = "ReferenceNotFound";
    /// Paused by annotation or by the Cluster.
    pub const PAUSED: &str = "Paused";
    /// Not paused.
    pub const NOT_PAUSED: &str = "NotPaused";
    /// Replicas do not answer their health endpoints.
    pub const UNHEALTHY: &str = "Unhealthy";
    /// The object is being deleted.
    pub const DELETING: &str = "Deleting";
    /// A component is not owned by this control plane yet.
    pub const WAITING_FOR_OWNER: &str = "WaitingForOwner";
    /// An error talking to the management cluster or the runtime.
    pub const RECONCILE_ERROR: &str = "ReconcileError";
    /// etcd's membership cannot change after bootstrap; the replica change was refused.
    pub const MEMBERSHIP_CHANGE_REFUSED: &str = "MembershipChangeRefused";
}

/// Longest condition message nestplane writes (characters); longer ones are cut.
pub const MAX_MESSAGE: usize = 2000;

/// `s` cut to at most `max` characters (never inside a character), with `…` marking a cut.
/// Control characters become spaces, so a hostile spec cannot forge log or event lines.
pub fn cut(s: &str, max: usize) -> String {
    let clean = |c: char| if c.is_control() { ' ' } else { c };
    if s.chars().count() <= max {
        return s.chars().map(clean).collect();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).map(clean).collect();
    out.push('…');
    out
}

/// Build a condition (the transition time is filled in by [`set`]).
///
/// The message is never empty: an empty one becomes `"<type> is True|False (<reason>)"`. Some
/// kube-apiserver builds (1.20 built with Go 1.19, as Debian ships it) decode an empty string in
/// a custom resource as null and refuse the object.
pub fn new(type_: &str, status: bool, reason: &str, message: impl Into<String>) -> Condition {
    let status = if status { "True" } else { "False" };
    let mut message = cut(&message.into(), MAX_MESSAGE);
    if message.is_empty() {
        message = format!("{type_} is {status} ({reason})");
    }
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: None,
        last_transition_time: Time(Timestamp::UNIX_EPOCH),
    }
}

/// Insert or update `cond` in `conditions`, keeping `lastTransitionTime` unless the status
/// changed, and setting `observedGeneration`. Conditions stay sorted by type.
pub fn set(
    conditions: &mut Vec<Condition>,
    mut cond: Condition,
    generation: Option<i64>,
    now: Timestamp,
) {
    cond.observed_generation = generation;
    match conditions.iter_mut().find(|c| c.type_ == cond.type_) {
        Some(existing) => {
            cond.last_transition_time = if existing.status == cond.status {
                existing.last_transition_time.clone()
            } else {
                Time(now)
            };
            *existing = cond;
        }
        None => {
            cond.last_transition_time = Time(now);
            conditions.push(cond);
            conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
        }
    }
}

/// The condition of `type_`, if present.
pub fn get<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present and `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("valid timestamp")
    }

    #[test]
    fn transition_time_moves_only_on_status_change() {
        let mut conds = Vec::new();
        set(
            &mut conds,
            new("Ready", false, "Provisioning", "starting"),
            Some(1),
            at(100),
        );
        assert_eq!(conds[0].last_transition_time.0, at(100));
        set(
            &mut conds,
            new("Ready", false, "WaitingForDependencies", "etcd"),
            Some(2),
            at(200),
        );
        assert_eq!(
            conds[0].last_transition_time.0,
            at(100),
            "same status keeps the time"
        );
        assert_eq!(conds[0].reason, "WaitingForDependencies");
        assert_eq!(conds[0].observed_generation, Some(2));
        set(
            &mut conds,
            new("Ready", true, "AsExpected", ""),
            Some(2),
            at(300),
        );
        assert_eq!(conds[0].last_transition_time.0, at(300));
        assert!(is_true(&conds, "Ready"));
    }

    #[test]
    fn messages_are_never_empty() {
        let c = new("Ready", true, "AsExpected", "");
        assert_eq!(c.message, "Ready is True (AsExpected)");
        assert_eq!(new("Ready", false, "X", "why").message, "why");
    }

    #[test]
    fn conditions_stay_sorted_by_type() {
        let mut conds = Vec::new();
        set(
            &mut conds,
            new("Paused", false, "NotPaused", ""),
            None,
            at(1),
        );
        set(
            &mut conds,
            new("Available", false, "Provisioning", ""),
            None,
            at(1),
        );
        let types: Vec<_> = conds.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Available", "Paused"]);
        assert!(!is_true(&conds, "Available"));
        assert!(get(&conds, "Missing").is_none());
    }

    #[test]
    fn cutting_never_splits_a_character() {
        let hostile = format!("x{}", "é".repeat(600));
        for max in [0, 1, 2, 3, 500, 601, 602, 1000] {
            let c = cut(&hostile, max);
            assert!(c.chars().count() <= max.max(1), "{max}");
        }
        assert_eq!(cut("ab\u{7}c\nd", 10), "ab c d");
        assert_eq!(cut("abcdef", 4), "abc…");
        let long = new("Ready", false, "X", "é".repeat(5000));
        assert_eq!(long.message.chars().count(), MAX_MESSAGE);
    }
}
