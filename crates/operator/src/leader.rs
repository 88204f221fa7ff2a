//! Leader election on a `coordination.k8s.io/v1` Lease, so that of several operator replicas
//! (a rolling update, or two replicas for availability) exactly one reconciles: only the
//! leader issues certificates, runs processes and writes status.
//!
//! The same protocol as client-go's leaderelection: a candidate takes the Lease when it is
//! free or when the record has not changed for `lease_duration` **as the candidate itself
//! timed it** (from when it first saw that record, on its own monotonic clock: the times in
//! the Lease are another machine's and are never compared with ours, so clock skew between
//! replicas cannot make a healthy leader look expired). The leader renews every
//! `retry_period` and gives up leadership (stops its controllers) when it could not renew for
//! `renew_deadline`. Every write carries the Lease's resourceVersion, so two candidates never
//! both win. A leader that stops cleanly releases the Lease so the next one takes over at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

/// Leader election settings.
#[derive(Clone, Debug)]
pub struct LeaderElection {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This candidate's identity (the pod name, or host and pid).
    pub identity: String,
    /// How long a Lease stays valid without renewal.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up leadership.
    pub renew_deadline: Duration,
    /// How often candidates retry and the leader renews.
    pub retry_period: Duration,
    /// The wall clock written into the Lease (`acquireTime`, `renewTime`) for people to
    /// read; no decision depends on it.
    pub clock: crate::clock::Clock,
}

impl LeaderElection {
    /// client-go's defaults (15 s, 10 s, 2 s) for a Lease `name` in `namespace`.
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        LeaderElection {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            clock: crate::clock::Clock::default(),
        }
    }
}

/// What a candidate does with the Lease as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No Lease: create it, holding it.
    Create,
    /// We hold it: renew.
    Renew,
    /// Free or expired: take it over.
    TakeOver,
    /// Someone else holds it and renewed it recently.
    Wait,
}

/// Pure: what `me` does with `spec`, a record unchanged for `unchanged_for` as this candidate
/// timed it (see [`Observed`]).
pub fn decide(spec: Option<&LeaseSpec>, me: &str, unchanged_for: Duration) -> Decision {
    let Some(spec) = spec else {
        return Decision::Create;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or("");
    if holder == me {
        return Decision::Renew;
    }
    if holder.is_empty() {
        return Decision::TakeOver;
    }
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64);
    if unchanged_for >= duration {
        Decision::TakeOver
    } else {
        Decision::Wait
    }
}

/// The Lease record a candidate last saw and when it first saw it, by its own monotonic
/// clock (client-go's `observedRecord` and `observedTime`).
#[derive(Debug, Default)]
pub struct Observed {
    record: Option<LeaseSpec>,
    since: Option<tokio::time::Instant>,
}

impl Observed {
    /// Record what was read at `now`; returns how long that record has been unchanged.
    pub fn see(&mut self, spec: Option<&LeaseSpec>, now: tokio::time::Instant) -> Duration {
        match self.since {
            Some(since) if self.record.as_ref() == spec => now.saturating_duration_since(since),
            _ => {
                self.record = spec.cloned();
                self.since = Some(now);
                Duration::ZERO
            }
        }
    }
}

fn held_spec(cfg: &LeaderElection, previous: Option<&LeaseSpec>, now: Timestamp) -> LeaseSpec {
    let ours = previous.is_some_and(|p| p.holder_identity.as_deref() == Some(&cfg.identity));
    let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
    LeaseSpec {
        holder_identity: Some(cfg.identity.clone()),
        lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
        acquire_time: if ours {
            previous.and_then(|p| p.acquire_time.clone())
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(if ours || previous.is_none() {
            transitions
        } else {
            transitions + 1
        }),
        ..LeaseSpec::default()
    }
}

/// One attempt to acquire or renew; true when we hold the Lease afterwards.
async fn try_hold(
    api: &Api<Lease>,
    cfg: &LeaderElection,
    observed: &mut Observed,
) -> Result<bool, kube::Error> {
    let current = api.get_opt(&cfg.name).await?;
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let unchanged_for = observed.see(spec, tokio::time::Instant::now());
    let decision = decide(spec, &cfg.identity, unchanged_for);
    let now = to_timestamp(cfg.clock.now());
    match (decision, current) {
        (Decision::Wait, _) => Ok(false),
        (Decision::Create, _) => {
            let lease = Lease {
                metadata: kube::api::ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(held_spec(cfg, None, now)),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        (_, Some(mut lease)) => {
            // Replace with the resourceVersion we read: a concurrent candidate makes this 409.
            lease.spec = Some(held_spec(cfg, lease.spec.as_ref(), now));
            match api.replace(&cfg.name, &PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        (_, None) => Ok(false),
    }
}

/// Wait until this candidate leads (or `shutdown`); returns false on shutdown.
pub async fn acquire(
    client: &kube::Client,
    cfg: &LeaderElection,
    shutdown: &CancellationToken,
) -> bool {
    let api: Api<Lease> = Api::namespaced(client.clone(), &cfg.namespace);
    let mut waiting_logged = false;
    let mut observed = Observed::default();
    loop {
        match try_hold(&api, cfg, &mut observed).await {
            Ok(true) => {
                tracing::info!(lease = %cfg.name, identity = %cfg.identity, "became the leader");
                return true;
            }
            Ok(false) if !waiting_logged => {
                tracing::info!(lease = %cfg.name, "another replica leads; standing by");
                waiting_logged = true;
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(lease = %cfg.name, error = %e, "cannot read or write the lease")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.retry_period) => {}
            _ = shutdown.cancelled() => return false,
        }
    }
}

/// Renew while leading; cancels `lost` when renewal failed for `renew_deadline` (another
/// replica may take over: this one must stop writing at once). On `release` (the controllers
/// and processes have stopped) gives the Lease up and returns.
pub async fn keep(
    client: kube::Client,
    cfg: LeaderElection,
    lost: CancellationToken,
    release: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let mut last_renewal = tokio::time::Instant::now();
    let mut observed = Observed::default();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(cfg.retry_period) => {}
            _ = release.cancelled() => {
                give_up(&api, &cfg).await;
                return;
            }
        }
        // A renewal that hangs must not outlive the deadline: a standby takes over once the
        // record stood still for the lease duration, whatever this replica is waiting for.
        let left = (last_renewal + cfg.renew_deadline)
            .saturating_duration_since(tokio::time::Instant::now());
        let attempt = match tokio::time::timeout(left, try_hold(&api, &cfg, &mut observed)).await {
            Ok(r) => r,
            Err(_) => {
                tracing::error!(lease = %cfg.name, "could not renew the lease in time; stopping");
                lost.cancel();
                return;
            }
        };
        match attempt {
            Ok(true) => last_renewal = tokio::time::Instant::now(),
            Ok(false) => {
                tracing::error!(lease = %cfg.name, "another replica took the lease; stopping");
                lost.cancel();
                return;
            }
            Err(e) => tracing::warn!(lease = %cfg.name, error = %e, "cannot renew the lease"),
        }
        if last_renewal.elapsed() > cfg.renew_deadline {
            tracing::error!(lease = %cfg.name, "could not renew the lease in time; stopping");
            lost.cancel();
            return;
        }
    }
}

/// A `time` instant as the Lease's timestamp type.
fn to_timestamp(t: time::OffsetDateTime) -> Timestamp {
    Timestamp::from_nanosecond(t.unix_timestamp_nanos()).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Give the Lease up (holder cleared), so a standby takes over without waiting for expiry.
async fn give_up(api: &Api<Lease>, cfg: &LeaderElection) {
    let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await else {
        return;
    };
    let Some(spec) = lease.spec.as_mut() else {
        return;
    };
    if spec.holder_identity.as_deref() != Some(&cfg.identity) {
        return;
    }
    spec.holder_identity = None;
    spec.acquire_time = None;
    spec.renew_time = None;
    if let Err(e) = api.replace(&cfg.name, &PostParams::default(), &lease).await {
        tracing::warn!(lease = %cfg.name, error = %e, "cannot release the lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    fn held(by: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(by.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..Default::default()
        }
    }

    #[test]
    fn a_lease_of_another_is_taken_only_once_it_stood_still_for_its_duration() {
        let s = Duration::from_secs;
        assert_eq!(decide(None, "a", s(0)), Decision::Create);
        assert_eq!(decide(Some(&held("a", 90)), "a", s(0)), Decision::Renew);
        assert_eq!(decide(Some(&held("b", 90)), "a", s(14)), Decision::Wait);
        assert_eq!(decide(Some(&held("b", 90)), "a", s(15)), Decision::TakeOver);
        let released = LeaseSpec::default();
        assert_eq!(decide(Some(&released), "a", s(0)), Decision::TakeOver);
    }

    #[test]
    fn the_holders_clock_never_decides() {
        // A holder whose clock is an hour behind (or ahead) renews: each renewal is a new
        // record, so the lease never stands still long enough to be taken.
        let mut seen = Observed::default();
        let t0 = tokio::time::Instant::now();
        for i in 0..20u64 {
            let record = held("b", 1_000 - 3_600 + i as i64 * 2);
            let still = seen.see(Some(&record), t0 + Duration::from_secs(2 * i));
            assert_eq!(still, Duration::ZERO);
            assert_eq!(decide(Some(&record), "a", still), Decision::Wait);
        }
        // A record that stops changing is taken after the lease duration, by our own clock,
        // whatever its renewTime says (here: the future).
        let stuck = held("b", 10_000_000);
        let t1 = t0 + Duration::from_secs(100);
        assert_eq!(seen.see(Some(&stuck), t1), Duration::ZERO);
        let still = seen.see(Some(&stuck), t1 + Duration::from_secs(15));
        assert_eq!(decide(Some(&stuck), "a", still), Decision::TakeOver);
    }

    #[test]
    fn taking_over_counts_a_transition_and_renewing_keeps_the_acquire_time() {
        let cfg = LeaderElection::new("ns", "l", "a");
        let mut theirs = held("b", 10);
        theirs.lease_transitions = Some(4);
        let taken = held_spec(&cfg, Some(&theirs), at(100));
        assert_eq!(taken.lease_transitions, Some(5));
        assert_eq!(taken.acquire_time, Some(MicroTime(at(100))));
        let renewed = held_spec(&cfg, Some(&taken), at(102));
        assert_eq!(renewed.lease_transitions, Some(5));
        assert_eq!(renewed.acquire_time, Some(MicroTime(at(100))));
        assert_eq!(renewed.renew_time, Some(MicroTime(at(102))));
    }
}
