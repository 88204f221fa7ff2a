//! Before a minor step: the APIs the tenant's clients requested that a minor of the change
//! removes, read from its API server's `apiserver_requested_deprecated_apis` metric. While
//! any is in use the change is refused (`RemovedAPIsInUse`, naming them) unless the control
//! plane carries [`FORCE_ANNOTATION`] naming the target version; until the metric has been
//! read the change waits (`CheckingRemovedAPIs`), moving nothing.
//!
//! The metric counts requests since the API server started, so a reading holds for the API
//! server version it was taken at; the next step (a restarted API server) is read again.

use std::collections::HashMap;
use std::sync::Mutex;

use nestplane_api::names::{self, Component};
use nestplane_render::KubeVersion;
use nestplane_render::upgrade::RemovedApi;

use crate::context::Context;
use crate::error::Error;
use crate::tenant::{Plan, Tenant, VersionChange};

/// Annotation on a `NestedControlPlane` that lets a change go although APIs it removes are in
/// use: its value is the target version (`v1.22.0`), so that it never carries a later change.
pub const FORCE_ANNOTATION: &str = "nestplane.io/upgrade-despite-removed-apis";

/// Condition reason: the change waits for the API server's metric to be read.
pub const CHECKING: &str = "CheckingRemovedAPIs";
/// Condition reason: APIs the change removes are in use.
pub const IN_USE: &str = "RemovedAPIsInUse";

/// How long a reading stands before it is taken again (while the change waits on it, so
/// that a refusal lifts once the API server no longer reports the APIs).
const READING_TTL: std::time::Duration = std::time::Duration::from_secs(60);

/// Readings per control plane (`namespace/name`): the API server version read at, when, and
/// what it said.
#[derive(Default)]
pub struct Readings(Mutex<HashMap<String, Reading>>);

type Reading = (KubeVersion, std::time::Instant, Vec<RemovedApi>);

impl Readings {
    fn get(&self, key: &str, apiserver: KubeVersion) -> Option<Vec<RemovedApi>> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key)
            .filter(|(v, _, _)| *v == apiserver)
            .map(|(_, _, apis)| apis.clone())
    }

    /// Whether a reading at `apiserver` is missing, or names APIs and is old (it still
    /// stands until the new one replaces it). A reading that named none is never taken again
    /// for that API server version: nothing can turn a change it let go into a refusal.
    fn due(&self, key: &str, apiserver: KubeVersion) -> bool {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        !map.get(key).is_some_and(|(v, at, apis)| {
            *v == apiserver && (apis.is_empty() || at.elapsed() < READING_TTL)
        })
    }

    fn put(&self, key: String, apiserver: KubeVersion, apis: Vec<RemovedApi>) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(key, (apiserver, std::time::Instant::now(), apis));
    }

    /// Forget a control plane (deleted).
    pub fn forget(&self, key: &str) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }
}

/// The minor step `plan` is about to take, if no part has started it: the version the API
/// server runs (whose metric counts) and the minors the rest of the change removes APIs in.
/// A step has started once a part runs it or the API server was rendered at it; from then on
/// it is never refused on these grounds (going back would be a downgrade for what moved).
pub fn pending_minor_step(
    t: &Tenant,
    plan: &Plan,
) -> Option<(KubeVersion, std::ops::RangeInclusive<u32>)> {
    let running = t.running_version(Component::ApiServer)?;
    let step = plan.step_version(Component::ApiServer)?;
    if step.minor <= running.minor {
        return None;
    }
    let rendered = t.rendered_version(Component::ApiServer).unwrap_or(running);
    let some_part_there = plan.parts.iter().any(|&(c, r, at_step)| {
        at_step.minor == step.minor && r.is_some_and(|r| r.minor == step.minor) && {
            // (a part that was there before the change is not the change's move)
            t.version(c).is_ok_and(|want| want.minor > running.minor)
        }
    });
    let started = rendered.minor != running.minor || some_part_there;
    (!started).then(|| (running, running.minor + 1..=plan.to.minor))
}

/// [`VersionChange::Refused`] for `plan` on the grounds of removed APIs, given the reading
/// taken at the API server's version (`None`: not read yet). Pure.
pub fn verdict(
    t: &Tenant,
    plan: &Plan,
    reading: impl FnOnce(KubeVersion) -> Option<Vec<RemovedApi>>,
) -> Option<VersionChange> {
    let (apiserver, minors) = pending_minor_step(t, plan)?;
    let forced = t
        .ncp
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(FORCE_ANNOTATION))
        .is_some_and(|v| nestplane_render::KubeVersion::parse(v).ok() == Some(plan.to));
    if forced {
        return None;
    }
    let Some(apis) = reading(apiserver) else {
        return Some(VersionChange::Refused(
            CHECKING,
            format!(
                "reading which APIs removed on the way to {} the tenant's clients requested (the API server's apiserver_requested_deprecated_apis); annotate the control plane {FORCE_ANNOTATION}={} to go without",
                plan.to, plan.to
            ),
        ));
    };
    let in_use: Vec<String> = apis
        .iter()
        .filter(|a| minors.contains(&a.removed_in))
        .map(ToString::to_string)
        .collect();
    (!in_use.is_empty()).then(|| {
        VersionChange::Refused(
            IN_USE,
            format!(
                "clients of the tenant requested {} (counted since its API server started); move them to the APIs that replace these, or annotate the control plane {FORCE_ANNOTATION}={} to upgrade anyway",
                in_use.join(", "),
                plan.to
            ),
        )
    })
}

fn key(t: &Tenant) -> String {
    use kube::ResourceExt;
    format!("{}/{}", t.namespace(), t.ncp.name_any())
}

/// The verdict with this operator's readings. Where another operator runs the control
/// planes' controller (`--controllers`), nothing here reads the metric: no hold.
pub fn hold(ctx: &Context, t: &Tenant, plan: &Plan) -> Option<VersionChange> {
    if !ctx.controllers.runs_named("NestedControlPlane") {
        return None;
    }
    let key = key(t);
    verdict(t, plan, |v| ctx.removed_apis.get(&key, v))
}

/// Read the API server's metric when a minor step waits for it (from the control plane's
/// pass), and again while a refusal stands ([`READING_TTL`]). Returns true while the change
/// still waits for a first reading (look again soon).
pub async fn refresh(ctx: &Context, t: &Tenant, change: &VersionChange) -> Result<bool, Error> {
    let VersionChange::Moving(plan) = change else {
        return Ok(false);
    };
    let Some((apiserver, _)) = pending_minor_step(t, plan) else {
        return Ok(false);
    };
    let key = key(t);
    if !ctx.removed_apis.due(&key, apiserver) {
        return Ok(false);
    }
    let waiting = ctx.removed_apis.get(&key, apiserver).is_none();
    let secret = names::SecretPurpose::AdminKubeconfig.secret_name(&t.cluster());
    // Each replica counts the requests it served: every one is read where the runtime knows
    // them (the endpoint, a gateway or a Service, would answer for one of them).
    let replicas = ctx.runtime.apiserver_replicas(&t.ncp);
    let clients = if replicas.is_empty() {
        crate::hosted::target::admin_client(ctx, &t.namespace(), &t.cluster())
            .await?
            .map(|c| vec![c])
    } else {
        crate::hosted::target::admin_clients_at(ctx, &t.namespace(), &secret, &replicas).await?
    };
    let Some(clients) = clients else {
        return Ok(waiting);
    };
    let mut apis: Vec<RemovedApi> = Vec::new();
    for client in &clients {
        let request = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(|e| Error::Internal(e.to_string()))?;
        match read_metric(client, request).await {
            Ok(text) => {
                for api in nestplane_render::upgrade::requested_removed_apis(&text) {
                    if !apis.contains(&api) {
                        apis.push(api);
                    }
                }
            }
            Err(e) => {
                // Not judged on part of the replicas.
                tracing::warn!(tenant = %key, error = %e, "reading the API server's metrics");
                return Ok(waiting);
            }
        }
    }
    tracing::info!(tenant = %key, %apiserver, replicas = clients.len(), removed = apis.len(), "read the API servers' requests of removed APIs");
    ctx.removed_apis.put(key, apiserver, apis);
    Ok(false)
}

/// At most this much of an API server's `/metrics` is read (a tenant admin decides how many
/// series there are).
const MAX_METRICS_BYTES: u64 = 64 << 20;
/// And for at most this long.
const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// The `apiserver_requested_deprecated_apis` lines of the API server's metrics, read as a
/// stream within [`MAX_METRICS_BYTES`] and [`READ_DEADLINE`].
async fn read_metric(
    client: &kube::Client,
    request: http::Request<Vec<u8>>,
) -> Result<String, String> {
    use futures::{AsyncBufReadExt, AsyncReadExt, StreamExt};
    let read = async {
        let stream = client
            .request_stream(request)
            .await
            .map_err(|e| e.to_string())?;
        let mut lines = stream.take(MAX_METRICS_BYTES).lines();
        let mut kept = String::new();
        while let Some(line) = lines.next().await {
            let line = line.map_err(|e| e.to_string())?;
            if line.starts_with("apiserver_requested_deprecated_apis{") {
                kept.push_str(&line);
                kept.push('\n');
            }
        }
        Ok(kept)
    };
    tokio::time::timeout(READ_DEADLINE, read)
        .await
        .map_err(|_| format!("no answer within {READ_DEADLINE:?}"))?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]
    use super::*;
    use crate::tenant::tests::running;

    fn plan(t: &Tenant) -> Plan {
        match t.version_change(&Component::ALL, |_, _| Ok(()), |m| (m == 21).then_some(4)) {
            VersionChange::Moving(p) => p,
            other => panic!("{other:?}"),
        }
    }

    fn api(gv: &str, resource: &str, removed_in: u32) -> RemovedApi {
        RemovedApi {
            group_version: gv.into(),
            resource: resource.into(),
            removed_in,
        }
    }

    #[test]
    fn a_minor_step_waits_for_the_reading_and_is_refused_on_apis_it_removes() {
        let t = running("v1.22.1", [Some("v1.20.2"); 4]);
        let p = plan(&t);
        let (at, minors) = pending_minor_step(&t, &p).expect("a minor step is pending");
        assert_eq!(at.to_string(), "v1.20.2");
        assert_eq!(minors, 21..=22);
        // Not read yet: nothing moves.
        assert!(matches!(
            verdict(&t, &p, |_| None),
            Some(VersionChange::Refused(CHECKING, _))
        ));
        // Read at the version the API server runs.
        let mut asked_at = None;
        let ingress = vec![
            api("extensions/v1beta1", "ingresses", 22),
            api("policy/v1beta1", "podsecuritypolicies", 25),
        ];
        let Some(VersionChange::Refused(reason, msg)) = verdict(&t, &p, |v| {
            asked_at = Some(v);
            Some(ingress.clone())
        }) else {
            panic!("in use, yet let through")
        };
        assert_eq!(asked_at.map(|v| v.to_string()).as_deref(), Some("v1.20.2"));
        assert_eq!(reason, IN_USE);
        assert!(
            msg.contains("extensions/v1beta1 ingresses (removed in 1.22)")
                && !msg.contains("podsecuritypolicies")
                && msg.contains("nestplane.io/upgrade-despite-removed-apis=v1.22.1"),
            "{msg}"
        );
        // What this change does not reach is no reason; nor is an empty reading.
        let later = vec![api("policy/v1beta1", "podsecuritypolicies", 25)];
        assert_eq!(verdict(&t, &p, |_| Some(later.clone())), None);
        assert_eq!(verdict(&t, &p, |_| Some(vec![])), None);
        // Forced for this target only.
        let forced = |value: &str| {
            let mut t = running("v1.22.1", [Some("v1.20.2"); 4]);
            t.ncp.metadata.annotations =
                Some([(FORCE_ANNOTATION.to_string(), value.to_string())].into());
            t
        };
        let t2 = forced("v1.22.1");
        assert_eq!(verdict(&t2, &plan(&t2), |_| Some(ingress.clone())), None);
        let t3 = forced("v1.23.0");
        assert!(verdict(&t3, &plan(&t3), |_| Some(ingress.clone())).is_some());
        // A patch is no minor step; an API server that started the step is past the check.
        let t = running("v1.20.5", [Some("v1.20.2"); 4]);
        assert_eq!(pending_minor_step(&t, &plan(&t)), None);
        let mut t = running("v1.22.1", [Some("v1.20.2"); 4]);
        if let crate::tenant::Lookup::Found(a) = &mut t.apiserver {
            a.metadata.annotations = Some(
                [(
                    names::RENDERED_VERSION_ANNOTATION.to_string(),
                    "v1.21.4".to_string(),
                )]
                .into(),
            );
        }
        assert_eq!(pending_minor_step(&t, &plan(&t)), None);
    }
}
