//! Version changes as a plan (pure): which moves a running control plane may make, in which
//! steps, and the skew rules between its parts (Kubernetes' version skew policy).
//!
//! - A minor version never goes down (its stored objects may already be in a newer form);
//!   a patch may.
//! - A jump of several minors is one step per minor, in order; every step's version must be
//!   available before the first starts.
//! - API servers are within one minor of each other; the controller manager and the
//!   scheduler are never newer than the API server and at most one minor older; a kubelet is
//!   never newer than the API server and at most three minors older (two when the kubelet is
//!   older than 1.25).

use std::fmt;

use crate::KubeVersion;

/// Why a version change is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The target is an older minor than what runs.
    MinorDowngrade {
        /// What runs.
        from: KubeVersion,
        /// What was asked for.
        to: KubeVersion,
    },
    /// No version of an intermediate minor is available to step through.
    NoStepVersion {
        /// What runs.
        from: KubeVersion,
        /// What was asked for.
        to: KubeVersion,
        /// The minor with nothing to run.
        minor: u32,
    },
}

impl Refusal {
    /// The condition reason for this refusal.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::MinorDowngrade { .. } => "DowngradeRefused",
            Refusal::NoStepVersion { .. } => "VersionUnavailable",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::MinorDowngrade { from, to } => write!(
                f,
                "{from} runs and {to} is an older minor: a minor version never goes down (the stored objects may already be in {from}'s form); set {from} or newer"
            ),
            Refusal::NoStepVersion { from, to, minor } => write!(
                f,
                "from {from} to {to} steps through 1.{minor}, and no 1.{minor} version is available here"
            ),
        }
    }
}

/// The versions a control plane goes through from `from` to `to`, one per minor, the last
/// being `to` (empty when they are equal). An intermediate minor's step is the newest patch
/// `newest_patch(minor)` names, if any.
pub fn steps(
    from: KubeVersion,
    to: KubeVersion,
    newest_patch: impl Fn(u32) -> Option<u32>,
) -> Result<Vec<KubeVersion>, Refusal> {
    if to == from {
        return Ok(vec![]);
    }
    if (to.major, to.minor) < (from.major, from.minor) {
        return Err(Refusal::MinorDowngrade { from, to });
    }
    let mut out = Vec::new();
    for minor in from.minor + 1..to.minor {
        let patch = newest_patch(minor).ok_or(Refusal::NoStepVersion { from, to, minor })?;
        out.push(KubeVersion::new(to.major, minor, patch));
    }
    out.push(to);
    Ok(out)
}

/// The parts of a control plane whose versions the skew rules relate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Another kube-apiserver.
    ApiServer,
    /// kube-controller-manager.
    ControllerManager,
    /// kube-scheduler.
    Scheduler,
    /// A kubelet (and its node's kube-proxy).
    Kubelet,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Part::ApiServer => "an API server",
            Part::ControllerManager => "the controller manager",
            Part::Scheduler => "the scheduler",
            Part::Kubelet => "a kubelet",
        })
    }
}

/// How many minors `part` at `version` may be older than the API server.
pub fn max_minors_behind(part: Part, version: KubeVersion) -> u32 {
    match part {
        Part::ApiServer | Part::ControllerManager | Part::Scheduler => 1,
        Part::Kubelet if version.at_least(25) => 3,
        Part::Kubelet => 2,
    }
}

/// Whether `part` at `version` may work with an API server at `apiserver`; the message says
/// why not.
pub fn skew(part: Part, version: KubeVersion, apiserver: KubeVersion) -> Result<(), String> {
    let behind = max_minors_behind(part, version);
    if part == Part::ApiServer {
        if version.major != apiserver.major || version.minor.abs_diff(apiserver.minor) > 1 {
            return Err(format!(
                "{part} at {version} and one at {apiserver} are more than one minor apart"
            ));
        }
        return Ok(());
    }
    if (version.major, version.minor) > (apiserver.major, apiserver.minor) {
        return Err(format!(
            "{part} at {version} would be newer than the API server at {apiserver}"
        ));
    }
    if version.major != apiserver.major || apiserver.minor > version.minor + behind {
        return Err(format!(
            "{part} at {version} would be more than {behind} minor version{} older than the API server at {apiserver}",
            if behind == 1 { "" } else { "s" }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MAX_SUPPORTED_MINOR, MIN_SUPPORTED_MINOR};

    fn v(minor: u32, patch: u32) -> KubeVersion {
        KubeVersion::new(1, minor, patch)
    }

    #[test]
    fn every_minor_up_steps_through_each_minor_between() {
        for from in MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR {
            for to in from..=MAX_SUPPORTED_MINOR {
                let s = steps(v(from, 3), v(to, 1), |m| Some(m + 100)).expect("an upgrade");
                if to == from {
                    // A patch change is one step.
                    assert_eq!(s, vec![v(to, 1)], "{from} -> {to}");
                    continue;
                }
                assert_eq!(s.len() as u32, to - from, "{from} -> {to}: {s:?}");
                for (i, step) in s.iter().enumerate() {
                    assert_eq!(step.minor, from + 1 + i as u32, "{from} -> {to}: {s:?}");
                }
                assert_eq!(s.last(), Some(&v(to, 1)));
                for step in &s[..s.len() - 1] {
                    assert_eq!(step.patch, step.minor + 100, "newest patch of each minor");
                }
            }
        }
    }

    #[test]
    fn a_minor_never_goes_down_and_a_patch_may() {
        for from in MIN_SUPPORTED_MINOR + 1..=MAX_SUPPORTED_MINOR {
            for to in MIN_SUPPORTED_MINOR..from {
                let r = steps(v(from, 0), v(to, 9), |_| Some(0));
                assert_eq!(
                    r,
                    Err(Refusal::MinorDowngrade {
                        from: v(from, 0),
                        to: v(to, 9)
                    })
                );
                let msg = r.expect_err("refused").to_string();
                assert!(msg.contains("never goes down"), "{msg}");
            }
            assert_eq!(
                steps(v(from, 5), v(from, 2), |_| None),
                Ok(vec![v(from, 2)])
            );
        }
        assert_eq!(steps(v(20, 2), v(20, 2), |_| None), Ok(vec![]));
    }

    #[test]
    fn a_missing_intermediate_minor_is_said_before_anything_moves() {
        let r = steps(v(20, 2), v(23, 0), |m| (m != 22).then_some(4));
        let e = r.expect_err("1.22 is missing");
        assert_eq!(e.reason(), "VersionUnavailable");
        assert!(e.to_string().contains("1.22"), "{e}");
        // A one-minor step needs nothing in between.
        assert_eq!(steps(v(20, 2), v(21, 0), |_| None), Ok(vec![v(21, 0)]));
    }

    #[test]
    fn kubelets_lag_two_minors_below_1_25_and_three_from_it() {
        for api in MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR {
            for kubelet in MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR {
                let ok = skew(Part::Kubelet, v(kubelet, 0), v(api, 0)).is_ok();
                let allowed = if kubelet >= 25 { 3 } else { 2 };
                let want = kubelet <= api && api - kubelet <= allowed;
                assert_eq!(ok, want, "kubelet 1.{kubelet} with API server 1.{api}");
            }
        }
        let e = skew(Part::Kubelet, v(24, 0), v(27, 0)).expect_err("3 behind at 1.24");
        assert!(e.contains("more than 2 minor versions older"), "{e}");
        let e = skew(Part::Kubelet, v(21, 0), v(20, 2)).expect_err("newer");
        assert!(e.contains("newer than the API server"), "{e}");
        // Patches do not count.
        assert_eq!(skew(Part::Kubelet, v(20, 9), v(20, 2)), Ok(()));
    }

    #[test]
    fn control_plane_parts_stay_within_one_minor_and_never_pass_the_api_server() {
        for api in MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR {
            for other in MIN_SUPPORTED_MINOR..=MAX_SUPPORTED_MINOR {
                let (a, o) = (v(api, 0), v(other, 0));
                assert_eq!(
                    skew(Part::ApiServer, o, a).is_ok(),
                    api.abs_diff(other) <= 1,
                    "API servers 1.{other} and 1.{api}"
                );
                for part in [Part::ControllerManager, Part::Scheduler] {
                    assert_eq!(
                        skew(part, o, a).is_ok(),
                        other <= api && api - other <= 1,
                        "{part} 1.{other} with API server 1.{api}"
                    );
                }
            }
        }
    }
}

/// An API a tenant's clients requested that a later Kubernetes minor removes (one series of
/// the API server's `apiserver_requested_deprecated_apis` metric).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovedApi {
    /// `group/version` (`v1` style for the core group).
    pub group_version: String,
    /// The resource, with `/subresource` when one was requested.
    pub resource: String,
    /// The minor of 1.x that removes it.
    pub removed_in: u32,
}

impl fmt::Display for RemovedApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} (removed in 1.{})",
            self.group_version, self.resource, self.removed_in
        )
    }
}

/// The requested APIs that some release removes, from an API server's Prometheus text
/// (`/metrics`): the series of `apiserver_requested_deprecated_apis` whose value is not 0 and
/// that name a `removed_release`. Pure; anything it cannot read is skipped.
pub fn requested_removed_apis(metrics: &str) -> Vec<RemovedApi> {
    let mut out: Vec<RemovedApi> = metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("apiserver_requested_deprecated_apis{")?;
            let (labels, value) = rest.split_once('}')?;
            let value: f64 = value.trim().parse().ok()?;
            if value == 0.0 {
                return None;
            }
            let label = |name: &str| -> Option<&str> {
                labels.split(',').find_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    (k.trim() == name).then(|| v.trim().trim_matches('"'))
                })
            };
            let removed = label("removed_release")?;
            let removed_in = removed.strip_prefix("1.")?.parse().ok()?;
            let group = label("group").unwrap_or_default();
            let version = label("version")?;
            let resource = label("resource")?;
            let sub = label("subresource").unwrap_or_default();
            Some(RemovedApi {
                group_version: if group.is_empty() {
                    version.to_string()
                } else {
                    format!("{group}/{version}")
                },
                resource: if sub.is_empty() {
                    resource.to_string()
                } else {
                    format!("{resource}/{sub}")
                },
                removed_in,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        (a.removed_in, &a.group_version, &a.resource).cmp(&(
            b.removed_in,
            &b.group_version,
            &b.resource,
        ))
    });
    out.dedup();
    out
}

#[cfg(test)]
mod removed_tests {
    use super::*;

    #[test]
    fn requested_apis_that_a_release_removes_are_read_from_the_metric() {
        let text = r#"# HELP apiserver_requested_deprecated_apis [ALPHA] Gauge of deprecated APIs that have been requested, broken out by API group, version, resource, subresource, and removed_release.
# TYPE apiserver_requested_deprecated_apis gauge
apiserver_requested_deprecated_apis{group="extensions",removed_release="1.22",resource="ingresses",subresource="",version="v1beta1"} 1
apiserver_requested_deprecated_apis{group="policy",removed_release="1.25",resource="podsecuritypolicies",subresource="",version="v1beta1"} 1
apiserver_requested_deprecated_apis{group="",removed_release="1.99",resource="things",subresource="status",version="v1"} 1
apiserver_requested_deprecated_apis{group="batch",removed_release="",resource="cronjobs",subresource="",version="v2alpha1"} 1
apiserver_requested_deprecated_apis{group="apps",removed_release="1.16",resource="deployments",subresource="",version="v1beta1"} 0
apiserver_request_total{code="200"} 5
"#;
        let got = requested_removed_apis(text);
        let shown: Vec<String> = got.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "extensions/v1beta1 ingresses (removed in 1.22)",
                "policy/v1beta1 podsecuritypolicies (removed in 1.25)",
                "v1 things/status (removed in 1.99)",
            ]
        );
        assert!(requested_removed_apis("garbage{\n}{ 1").is_empty());
    }
}
