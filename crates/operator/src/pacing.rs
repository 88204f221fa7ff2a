//! How often each object is looked at again, and how much evidence turns a Ready component
//! not Ready. Per object, in memory (a restarted operator starts afresh, which only means one
//! quick look at everything).
//!
//! - Exponential backoff with a cap, per object: a component that is starting is re-checked
//!   after 0.5 s, 1 s, 2 s … up to [`STARTING_CAP`]; a failing reconcile is retried after
//!   1 s, 2 s … up to [`ERROR_CAP`]. Success resets both.
//! - Where nothing announces readiness (the process runtime: a process that starts answering
//!   its health endpoint sends no event), a starting component is probed every
//!   [`PROBE_INTERVAL`] for its first [`FAST_PROBES`] looks, then with the backoff above: a
//!   component is Ready within a tenth of a second of answering, and one that never answers
//!   costs little after a few seconds. Where readiness arrives through a watch (a workload's
//!   rollout in the kubernetes runtime), the backoff alone is the safety net.
//! - Hysteresis: once a component has been Ready, only [`FAILURES_BEFORE_NOT_READY`]
//!   consecutive failed probes make it not Ready; one blip changes nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// Consecutive failed health probes after which a Ready component is reported not Ready.
pub const FAILURES_BEFORE_NOT_READY: u32 = 3;
/// Longest wait between two looks at a component that is starting.
pub const STARTING_CAP: Duration = Duration::from_secs(10);
/// Longest wait before retrying a failed reconcile.
pub const ERROR_CAP: Duration = Duration::from_secs(300);
/// How often a starting component whose readiness no watch announces is probed at first.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// How many looks at [`PROBE_INTERVAL`] before the backoff takes over (10 s).
pub const FAST_PROBES: u32 = 100;
/// How soon a Ready component that failed a probe is probed again.
pub const RECHECK: Duration = Duration::from_secs(2);

/// `base · 2^attempt`, at most `cap`.
pub fn backoff(attempt: u32, base: Duration, cap: Duration) -> Duration {
    base.saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
        .min(cap)
}

/// The verdict on one health probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the component is to be reported Ready.
    pub ready: bool,
    /// Consecutive failed probes so far (0 after a good one).
    pub failures: u32,
}

/// Pure hysteresis: `was_ready` is what the status says now, `ok` this probe's result.
pub fn judge(was_ready: bool, ok: bool, failures_before: u32) -> Verdict {
    if ok {
        return Verdict {
            ready: true,
            failures: 0,
        };
    }
    let failures = failures_before.saturating_add(1);
    Verdict {
        ready: was_ready && failures < FAILURES_BEFORE_NOT_READY,
        failures,
    }
}

fn fast_then_backoff(looks: &mut u32) -> Duration {
    let d = match looks.checked_sub(FAST_PROBES) {
        None => PROBE_INTERVAL,
        Some(n) => backoff(n, Duration::from_millis(500), STARTING_CAP),
    };
    *looks = looks.saturating_add(1);
    d
}

#[derive(Default)]
struct Entry {
    starting: u32,
    waiting: u32,
    errors: u32,
    failures: u32,
}

/// Per-object pacing state.
#[derive(Default)]
pub struct Pacing {
    objects: Mutex<HashMap<String, Entry>>,
}

impl Pacing {
    fn with<T>(&self, key: &str, f: impl FnOnce(&mut Entry) -> T) -> T {
        let mut m = self.objects.lock().unwrap_or_else(|e| e.into_inner());
        f(m.entry(key.to_string()).or_default())
    }

    /// The next delay for a component that is still starting.
    pub fn starting(&self, key: &str) -> Duration {
        self.with(key, |e| {
            let d = backoff(e.starting, Duration::from_millis(500), STARTING_CAP);
            e.starting = e.starting.saturating_add(1);
            d
        })
    }

    /// The next delay for a component that is still starting and whose readiness must be
    /// probed: [`PROBE_INTERVAL`] for the first [`FAST_PROBES`] looks, then as [`Self::starting`].
    pub fn probing(&self, key: &str) -> Duration {
        self.with(key, |e| fast_then_backoff(&mut e.starting))
    }

    /// Like [`Self::probing`], for a component waiting for a dependency, counted apart: a
    /// component that waited long is still probed fast once it starts.
    pub fn waiting(&self, key: &str) -> Duration {
        self.with(key, |e| fast_then_backoff(&mut e.waiting))
    }

    /// The next delay after a failed reconcile.
    pub fn error(&self, key: &str) -> Duration {
        self.with(key, |e| {
            let d = backoff(e.errors, Duration::from_secs(1), ERROR_CAP);
            e.errors = e.errors.saturating_add(1);
            d
        })
    }

    /// A reconcile succeeded: errors are forgotten.
    pub fn succeeded(&self, key: &str) {
        self.with(key, |e| e.errors = 0);
    }

    /// Record a probe and judge it (see [`judge`]). Ready resets the starting backoff.
    pub fn probe(&self, key: &str, was_ready: bool, ok: bool) -> Verdict {
        self.with(key, |e| {
            let v = judge(was_ready, ok, e.failures);
            e.failures = v.failures;
            if ok {
                e.starting = 0;
                e.waiting = 0;
            }
            v
        })
    }

    /// Forget an object (deleted).
    pub fn forget(&self, key: &str) {
        self.objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_blip_does_not_make_a_ready_component_not_ready() {
        let mut failures = 0;
        let mut ready = true;
        let mut seen = Vec::new();
        for ok in [true, false, true, false, false, false, true] {
            let v = judge(ready, ok, failures);
            failures = v.failures;
            ready = v.ready;
            seen.push(ready);
        }
        assert_eq!(seen, [true, true, true, true, true, false, true]);
    }

    #[test]
    fn a_component_that_never_was_ready_is_not_ready_on_a_failed_probe() {
        assert!(!judge(false, false, 0).ready);
        assert!(judge(false, true, 7).ready);
    }

    #[test]
    fn probing_is_fast_at_first_then_backs_off() {
        let p = Pacing::default();
        let delays: Vec<Duration> = (0..FAST_PROBES + 6).map(|_| p.probing("etcd/a")).collect();
        assert!(
            delays[..FAST_PROBES as usize]
                .iter()
                .all(|d| *d == PROBE_INTERVAL)
        );
        assert_eq!(delays[FAST_PROBES as usize], Duration::from_millis(500));
        assert_eq!(delays[FAST_PROBES as usize + 5], STARTING_CAP);
        // Waiting is counted apart.
        assert_eq!(p.waiting("etcd/a"), PROBE_INTERVAL);
        // Ready resets it.
        p.probe("etcd/a", false, true);
        assert_eq!(p.probing("etcd/a"), PROBE_INTERVAL);
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = Pacing::default();
        let delays: Vec<Duration> = (0..8).map(|_| p.starting("etcd/a")).collect();
        assert_eq!(delays[0], Duration::from_millis(500));
        assert_eq!(delays[1], Duration::from_secs(1));
        assert_eq!(delays[4], Duration::from_secs(8));
        assert_eq!(delays[7], STARTING_CAP);
        // Another object has its own count.
        assert_eq!(p.starting("etcd/b"), Duration::from_millis(500));
        // Ready resets it.
        p.probe("etcd/a", false, true);
        assert_eq!(p.starting("etcd/a"), Duration::from_millis(500));
        let errors: Vec<Duration> = (0..12).map(|_| p.error("x")).collect();
        assert_eq!(errors[0], Duration::from_secs(1));
        assert_eq!(errors[11], ERROR_CAP);
        p.succeeded("x");
        assert_eq!(p.error("x"), Duration::from_secs(1));
        assert_eq!(
            backoff(u32::MAX, Duration::from_secs(1), ERROR_CAP),
            ERROR_CAP
        );
    }
}
