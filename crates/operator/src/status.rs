//! The `NestedControlPlane` status, computed as data from its components (pure).

use k8s_openapi::jiff::Timestamp;
use nestplane_api::conditions::{self, reasons, types};
use nestplane_api::names::{CLUSTER_NAME_LABEL, COMPONENT_LABEL, Component};
use nestplane_api::{ComponentStatus, Initialization, NestedControlPlaneStatus};

/// What the control-plane controller observed about one component.
#[derive(Clone, Debug, PartialEq)]
pub enum Observed {
    /// The referenced object does not exist (yet).
    Missing(String),
    /// The component object and its status.
    Present {
        /// Its status (`None` before its controller wrote any).
        status: Option<ComponentStatus>,
        /// Desired replicas of the component.
        desired: i32,
    },
}

impl Observed {
    fn ready(&self) -> bool {
        matches!(self, Observed::Present { status: Some(s), .. } if s.ready)
    }

    fn summary(&self) -> (String, String) {
        match self {
            Observed::Missing(msg) => (reasons::REFERENCE_NOT_FOUND.into(), msg.clone()),
            Observed::Present { status: None, .. } => {
                (reasons::PROVISIONING.into(), "no status yet".into())
            }
            Observed::Present {
                status: Some(s), ..
            } => match conditions::get(&s.conditions, types::READY) {
                Some(c) => (c.reason.clone(), c.message.clone()),
                None => (
                    reasons::PROVISIONING.into(),
                    "no Ready condition yet".into(),
                ),
            },
        }
    }
}

/// Write `status` to `obj`'s status subresource (a merge patch) unless it is what `obj`
/// already reports: a pass that changes nothing writes nothing. The one status writer of the
/// controllers whose status is a plain struct.
pub async fn write<K, S>(
    api: &kube::Api<K>,
    obj: &K,
    current: Option<&S>,
    status: &S,
) -> Result<(), crate::error::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: PartialEq + serde::Serialize,
{
    if current == Some(status) {
        return Ok(());
    }
    api.patch_status(
        &kube::ResourceExt::name_any(obj),
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({ "status": status })),
    )
    .await?;
    Ok(())
}

/// The condition type reporting a component's readiness on the control plane.
pub fn component_condition(c: Component) -> &'static str {
    match c {
        Component::Etcd => "EtcdReady",
        Component::ApiServer => "APIServerReady",
        Component::ControllerManager => "ControllerManagerReady",
        Component::Scheduler => "SchedulerReady",
    }
}

/// The label selector (string form) of a control plane's API server replicas.
pub fn selector(cluster: &str) -> String {
    format!(
        "{CLUSTER_NAME_LABEL}={cluster},{COMPONENT_LABEL}={}",
        Component::ApiServer.short_name()
    )
}

/// Inputs of [`compute`].
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    /// The control plane's name.
    pub cluster: &'a str,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// The current status (kept: `initialized` is sticky, transition times are kept).
    pub previous: Option<&'a NestedControlPlaneStatus>,
    /// The four components, in [`Component::ALL`] order.
    pub components: [(Component, Observed); 4],
    /// A problem with the control plane itself (invalid spec), as (reason, message).
    pub problem: Option<(String, String)>,
    /// Whether reconciliation is paused.
    pub paused: bool,
    /// Now.
    pub now: Timestamp,
}

/// Every field of both contract generations.
pub fn compute(i: &Inputs<'_>) -> NestedControlPlaneStatus {
    let mut st = i.previous.cloned().unwrap_or_default();
    st.observed_generation = i.generation;
    st.external_managed_control_plane = true;
    st.selector = Some(selector(i.cluster));

    let (_, apiserver) = &i.components[1];
    let (desired, ready_replicas, version) = match apiserver {
        Observed::Present { status, desired } => (
            *desired,
            status.as_ref().and_then(|s| s.ready_replicas).unwrap_or(0),
            status
                .as_ref()
                .filter(|s| s.ready)
                .and_then(|s| s.version.clone()),
        ),
        Observed::Missing(_) => (0, 0, None),
    };
    st.replicas = Some(desired);
    st.ready_replicas = Some(ready_replicas);
    st.available_replicas = Some(ready_replicas);
    st.updated_replicas = Some(ready_replicas);
    st.up_to_date_replicas = Some(ready_replicas);
    st.unavailable_replicas = Some((desired - ready_replicas).max(0));
    if version.is_some() {
        st.version = version;
    }

    let all_ready = i.components.iter().all(|(_, o)| o.ready());
    st.ready = all_ready;
    if apiserver.ready() {
        st.initialized = true;
    }
    st.initialization = Some(Initialization {
        control_plane_initialized: Some(st.initialized),
    });

    for (c, o) in &i.components {
        let (reason, message) = if o.ready() {
            (reasons::AS_EXPECTED.to_string(), String::new())
        } else {
            o.summary()
        };
        conditions::set(
            &mut st.conditions,
            conditions::new(component_condition(*c), o.ready(), &reason, message),
            i.generation,
            i.now,
        );
    }

    let available = if let Some((reason, message)) = &i.problem {
        conditions::new(types::AVAILABLE, false, reason, message.clone())
    } else if all_ready {
        conditions::new(
            types::AVAILABLE,
            true,
            reasons::AS_EXPECTED,
            "etcd, kube-apiserver, kube-controller-manager and kube-scheduler are ready",
        )
    } else {
        let waiting: Vec<String> = i
            .components
            .iter()
            .filter(|(_, o)| !o.ready())
            .map(|(c, o)| format!("{}: {}", component_condition(*c), o.summary().1))
            .collect();
        let first_reason = i
            .components
            .iter()
            .find(|(_, o)| !o.ready())
            .map(|(_, o)| o.summary().0)
            .unwrap_or_default();
        conditions::new(types::AVAILABLE, false, &first_reason, waiting.join("; "))
    };
    conditions::set(&mut st.conditions, available, i.generation, i.now);
    let paused = if i.paused {
        conditions::new(
            types::PAUSED,
            true,
            reasons::PAUSED,
            "reconciliation is paused",
        )
    } else {
        conditions::new(types::PAUSED, false, reasons::NOT_PAUSED, "reconciling")
    };
    conditions::set(&mut st.conditions, paused, i.generation, i.now);

    // Cluster API treats failureReason/failureMessage as terminal: only problems a person must
    // fix by hand set them (an invalid spec on the control plane or a component); anything
    // that heals by itself (a reference that does not exist yet, a component starting) never
    // does, and they are cleared as soon as the problem is gone.
    let component_problem = i.components.iter().find_map(|(c, o)| {
        let (reason, message) = o.summary();
        (!o.ready() && needs_a_person(&reason))
            .then(|| (reason, format!("{}: {message}", component_condition(*c))))
    });
    match i
        .problem
        .clone()
        .filter(|(reason, _)| needs_a_person(reason))
        .or(component_problem)
    {
        Some((reason, message)) => {
            st.failure_reason = Some(reason);
            st.failure_message = Some(message);
        }
        None => {
            st.failure_reason = None;
            st.failure_message = None;
        }
    }
    st
}

/// Whether a condition reason means a person must change something before nestplane can
/// proceed (Cluster API's terminal failure), as opposed to a state that heals by itself.
pub fn needs_a_person(reason: &str) -> bool {
    reason == reasons::INVALID_SPEC
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ready(version: &str, replicas: i32) -> Observed {
        let mut status = ComponentStatus {
            ready: true,
            version: Some(version.into()),
            ready_replicas: Some(replicas),
            ..Default::default()
        };
        conditions::set(
            &mut status.conditions,
            conditions::new(types::READY, true, reasons::AS_EXPECTED, ""),
            None,
            Timestamp::UNIX_EPOCH,
        );
        Observed::Present {
            status: Some(status),
            desired: replicas,
        }
    }

    fn waiting(msg: &str) -> Observed {
        let mut status = ComponentStatus::default();
        conditions::set(
            &mut status.conditions,
            conditions::new(types::READY, false, reasons::WAITING_FOR_DEPENDENCIES, msg),
            None,
            Timestamp::UNIX_EPOCH,
        );
        Observed::Present {
            status: Some(status),
            desired: 1,
        }
    }

    fn inputs<'a>(
        components: [(Component, Observed); 4],
        previous: Option<&'a NestedControlPlaneStatus>,
    ) -> Inputs<'a> {
        Inputs {
            cluster: "demo",
            generation: Some(3),
            previous,
            components,
            problem: None,
            paused: false,
            now: Timestamp::from_second(1000).unwrap(),
        }
    }

    #[test]
    fn all_ready_fills_both_contracts() {
        let st = compute(&inputs(
            [
                (Component::Etcd, ready("v1.20.2", 1)),
                (Component::ApiServer, ready("v1.20.2", 2)),
                (Component::ControllerManager, ready("v1.20.2", 1)),
                (Component::Scheduler, ready("v1.20.2", 1)),
            ],
            None,
        ));
        assert!(st.ready && st.initialized && st.external_managed_control_plane);
        assert_eq!(
            st.initialization.unwrap().control_plane_initialized,
            Some(true)
        );
        assert_eq!(
            (
                st.replicas,
                st.ready_replicas,
                st.available_replicas,
                st.unavailable_replicas
            ),
            (Some(2), Some(2), Some(2), Some(0))
        );
        assert_eq!(st.up_to_date_replicas, Some(2));
        assert_eq!(st.version.as_deref(), Some("v1.20.2"));
        assert_eq!(
            st.selector.as_deref(),
            Some(
                "cluster.x-k8s.io/cluster-name=demo,controlplane.cluster.x-k8s.io/component=apiserver"
            )
        );
        assert!(conditions::is_true(&st.conditions, "Available"));
        assert!(!conditions::is_true(&st.conditions, "Paused"));
        assert_eq!(st.observed_generation, Some(3));
    }

    #[test]
    fn waiting_component_explains_itself_and_initialized_is_sticky() {
        let prev = NestedControlPlaneStatus {
            initialized: true,
            version: Some("v1.20.2".into()),
            ..Default::default()
        };
        let st = compute(&inputs(
            [
                (
                    Component::Etcd,
                    Observed::Missing("NestedEtcd default/x not found".into()),
                ),
                (
                    Component::ApiServer,
                    waiting("waiting for NestedEtcd default/x"),
                ),
                (
                    Component::ControllerManager,
                    waiting("waiting for NestedAPIServer"),
                ),
                (Component::Scheduler, waiting("waiting for NestedAPIServer")),
            ],
            Some(&prev),
        ));
        assert!(!st.ready);
        assert!(st.initialized, "initialized never goes back to false");
        assert_eq!(
            st.version.as_deref(),
            Some("v1.20.2"),
            "the last running version is kept"
        );
        assert_eq!(st.unavailable_replicas, Some(1));
        let avail = conditions::get(&st.conditions, "Available").unwrap();
        assert_eq!(avail.status, "False");
        assert_eq!(avail.reason, "ReferenceNotFound");
        assert!(
            avail.message.contains("NestedEtcd default/x not found"),
            "{}",
            avail.message
        );
        let api = conditions::get(&st.conditions, "APIServerReady").unwrap();
        assert_eq!(api.reason, "WaitingForDependencies");
    }

    #[test]
    fn problems_become_failure_fields_and_paused_is_reported() {
        let mut i = inputs(
            [
                (Component::Etcd, ready("v1.20.2", 1)),
                (Component::ApiServer, ready("v1.20.2", 1)),
                (Component::ControllerManager, ready("v1.20.2", 1)),
                (Component::Scheduler, ready("v1.20.2", 1)),
            ],
            None,
        );
        i.problem = Some(("InvalidSpec".into(), "name too long".into()));
        i.paused = true;
        let st = compute(&i);
        assert_eq!(st.failure_reason.as_deref(), Some("InvalidSpec"));
        assert!(!conditions::is_true(&st.conditions, "Available"));
        assert!(conditions::is_true(&st.conditions, "Paused"));
    }

    #[test]
    fn failure_fields_only_for_what_a_person_must_fix_and_cleared_when_fixed() {
        let waiting = || {
            let mut status = ComponentStatus::default();
            conditions::set(
                &mut status.conditions,
                conditions::new(types::READY, false, "InvalidSpec", "bad patch 0"),
                None,
                Timestamp::UNIX_EPOCH,
            );
            Observed::Present {
                status: Some(status),
                desired: 1,
            }
        };
        // A reference that does not exist yet heals by itself: not terminal.
        let mut i = inputs(
            [
                (Component::Etcd, Observed::Missing("not there yet".into())),
                (Component::ApiServer, ready("v1.20.2", 1)),
                (Component::ControllerManager, ready("v1.20.2", 1)),
                (Component::Scheduler, ready("v1.20.2", 1)),
            ],
            None,
        );
        i.problem = Some(("ReferenceNotFound".into(), "not there yet".into()));
        let st = compute(&i);
        assert_eq!(st.failure_reason, None);
        assert!(!conditions::is_true(&st.conditions, "Available"));
        // A component with an invalid spec needs a person.
        i.problem = None;
        i.components[0] = (Component::Etcd, waiting());
        let failed = compute(&i);
        assert_eq!(failed.failure_reason.as_deref(), Some("InvalidSpec"));
        assert!(
            failed
                .failure_message
                .as_deref()
                .is_some_and(|m| m.contains("bad patch 0"))
        );
        // Fixed: cleared.
        i.previous = Some(&failed);
        i.components[0] = (Component::Etcd, ready("v1.20.2", 1));
        let st = compute(&i);
        assert_eq!(st.failure_reason, None);
        assert_eq!(st.failure_message, None);
    }
}
