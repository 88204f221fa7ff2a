//! One controller per component kind (`NestedEtcd`, `NestedAPIServer`,
//! `NestedControllerManager`, `NestedScheduler`), all running this reconciler.
//!
//! Order through status, as seed 000 says: the API server waits until etcd is Ready,
//! controller-manager and scheduler until the API server is Ready. A component is Ready only
//! when every replica answers its health endpoint.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Service};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use nestplane_api::conditions::{self, reasons, types};
use nestplane_api::names::{self, Component, SecretPurpose, ports};
use nestplane_api::{ComponentStatus, NestedControlPlane, NestedEtcdAddress};
use nestplane_pki::{LeafSpec, Usage};
use nestplane_render::{Network, RenderInput, Sans};
use nestplane_runtime::process::{RuntimeError, TenantKey};

use crate::context::{Context, Error, Mode};
use crate::crds::FIELD_MANAGER;
use crate::secrets::{ClusterSecrets, KubeconfigSpec, Leaf};
use crate::tenant::{self, ComponentKind, Tenant};

/// How often a Ready component's health is re-checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(10);
/// How often a component that is starting is re-checked.
pub const STARTING_INTERVAL: Duration = Duration::from_millis(500);

/// The outcome of one pass, before it becomes status.
pub(crate) struct Outcome {
    pub(crate) ready: bool,
    pub(crate) ready_replicas: i32,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    pub(crate) version: Option<String>,
    pub(crate) addresses: Vec<NestedEtcdAddress>,
    pub(crate) service: Option<ObjectReference>,
    pub(crate) requeue: Option<Duration>,
    pub(crate) event: Option<EventType>,
    /// Why the replicas the spec asks for are not what runs (etcd after bootstrap).
    pub(crate) scale_refused: Option<String>,
}

impl Outcome {
    pub(crate) fn waiting(
        reason: &'static str,
        message: String,
        requeue: Option<Duration>,
        event: Option<EventType>,
    ) -> Self {
        Outcome {
            ready: false,
            ready_replicas: 0,
            reason,
            message,
            version: None,
            addresses: vec![],
            service: None,
            requeue,
            event,
            scale_refused: None,
        }
    }
}

/// Reconcile one component object.
pub async fn reconcile<K: ComponentKind>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(tenant::kind_of(K::COMPONENT));
    let ns = obj.namespace().unwrap_or_default();
    let Some(owner) = tenant::controller_of(obj.as_ref()) else {
        let out = Outcome::waiting(
            reasons::WAITING_FOR_OWNER,
            "no NestedControlPlane references and owns this component yet".into(),
            None,
            None,
        );
        write_status::<K>(&ctx, &obj, out.to_status(obj.as_ref()), &out).await?;
        return Ok(Action::await_change());
    };
    let ncps: Api<NestedControlPlane> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(ncp) = ncps.get_opt(&owner.name).await? else {
        return Ok(Action::await_change());
    };
    if ncp.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let tenant = Tenant::load(&ctx.client, ncp).await?;
    let key = crate::context::object_key(obj.as_ref());
    let was_ready = obj.common_status().is_some_and(|s| s.ready);
    let out = match run::<K>(&ctx, &tenant, &key).await {
        Ok(out) => out,
        Err(Error::Runtime(e @ RuntimeError::MissingBinary(_))) => Outcome::waiting(
            reasons::VERSION_UNAVAILABLE,
            e.to_string(),
            Some(ctx.pacing.error(&key)),
            Some(EventType::Warning),
        ),
        // A spec a person must fix: said once, looked at again when something changes.
        Err(e @ (Error::Patch(_) | Error::Render(_))) => Outcome::waiting(
            reasons::INVALID_SPEC,
            e.to_string(),
            None,
            Some(EventType::Warning),
        ),
        Err(Error::Secret(e @ crate::secrets::SecretError::Invalid { .. })) => Outcome::waiting(
            reasons::INVALID_SPEC,
            e.to_string(),
            Some(ctx.pacing.error(&key)),
            Some(EventType::Warning),
        ),
        // A transient failure (the management API, the filesystem) does not make a Ready
        // component not Ready: its status stays, and the pass is retried with backoff.
        Err(e) if was_ready => {
            ctx.metrics
                .reconcile_failed(tenant::kind_of(K::COMPONENT), e.label());
            return Err(e);
        }
        Err(e) => {
            ctx.metrics
                .reconcile_failed(tenant::kind_of(K::COMPONENT), e.label());
            Outcome::waiting(
                reasons::RECONCILE_ERROR,
                e.to_string(),
                Some(ctx.pacing.error(&key)),
                Some(EventType::Warning),
            )
        }
    };
    if out.reason != reasons::RECONCILE_ERROR && out.reason != reasons::VERSION_UNAVAILABLE {
        ctx.pacing.succeeded(&key);
    }
    let status = out.to_status(obj.as_ref());
    write_status::<K>(&ctx, &obj, status, &out).await?;
    Ok(match out.requeue {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    })
}

impl Outcome {
    fn to_status<K: ComponentKind>(&self, obj: &K) -> ComponentStatus {
        let previous = obj.common_status().cloned().unwrap_or_default();
        let mut st = previous.clone();
        st.ready = self.ready;
        st.ready_replicas = Some(self.ready_replicas);
        st.observed_generation = obj.meta().generation;
        if self.version.is_some() {
            st.version = self.version.clone();
        }
        st.phase = Some(
            match self.reason {
                reasons::AS_EXPECTED => "Ready",
                reasons::WAITING_FOR_DEPENDENCIES | reasons::WAITING_FOR_OWNER => "Waiting",
                reasons::PROVISIONING | reasons::UNHEALTHY => "Provisioning",
                reasons::PAUSED => "Paused",
                _ => "Failed",
            }
            .to_string(),
        );
        let now = k8s_openapi::jiff::Timestamp::now();
        conditions::set(
            &mut st.conditions,
            conditions::new(types::READY, self.ready, self.reason, self.message.clone()),
            obj.meta().generation,
            now,
        );
        let (scaled, scaled_reason, scaled_message) = match &self.scale_refused {
            Some(m) => (false, reasons::MEMBERSHIP_CHANGE_REFUSED, m.clone()),
            None => (true, reasons::AS_EXPECTED, String::new()),
        };
        conditions::set(
            &mut st.conditions,
            conditions::new(types::SCALED, scaled, scaled_reason, scaled_message),
            obj.meta().generation,
            now,
        );
        let paused = self.reason == reasons::PAUSED;
        conditions::set(
            &mut st.conditions,
            conditions::new(
                types::PAUSED,
                paused,
                if paused {
                    reasons::PAUSED
                } else {
                    reasons::NOT_PAUSED
                },
                "",
            ),
            obj.meta().generation,
            now,
        );
        st
    }
}

async fn write_status<K: ComponentKind>(
    ctx: &Context,
    obj: &K,
    status: ComponentStatus,
    out: &Outcome,
) -> Result<(), Error> {
    let previous = obj.common_status().cloned().unwrap_or_default();
    let mut body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    if K::COMPONENT == Component::Etcd {
        body["addresses"] =
            serde_json::to_value(&out.addresses).map_err(|e| Error::Internal(e.to_string()))?;
    }
    if K::COMPONENT == Component::ApiServer
        && let Some(svc) = &out.service
    {
        body["apiserverService"] =
            serde_json::to_value(svc).map_err(|e| Error::Internal(e.to_string()))?;
    }
    // Write only changes: our own status writes must not cause more reconciles.
    let current = serde_json::to_value(obj).map_err(|e| Error::Internal(e.to_string()))?;
    let unchanged = {
        let cur = &current["status"];
        let mut same = status == previous;
        if K::COMPONENT == Component::Etcd {
            same &= cur
                .get("addresses")
                .cloned()
                .unwrap_or(serde_json::json!([]))
                == body["addresses"];
        }
        if K::COMPONENT == Component::ApiServer && out.service.is_some() {
            same &= cur.get("apiserverService") == body.get("apiserverService");
        }
        same
    };
    if unchanged {
        return Ok(());
    }
    let old_ready = conditions::get(&previous.conditions, types::READY)
        .map(|c| (c.status.clone(), c.reason.clone()));
    let was_refused =
        conditions::get(&previous.conditions, types::SCALED).is_some_and(|c| c.status == "False");
    // A merge patch: server-side apply in Kubernetes 1.20 turns empty strings (a condition's
    // empty message) into nulls, which the schema rightly refuses.
    let patch = serde_json::json!({ "status": body });
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    api.patch_status(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    // An Event when the Ready condition changes (not on every pass).
    let new_ready = (
        if out.ready { "True" } else { "False" }.to_string(),
        out.reason.to_string(),
    );
    if old_ready.as_ref() != Some(&new_ready) {
        let type_ = out.event.unwrap_or(EventType::Normal);
        let note = if out.ready {
            format!("{} is ready", tenant::kind_of(K::COMPONENT))
        } else {
            out.message.clone()
        };
        ctx.event(obj.object_ref(&()), type_, out.reason, &note)
            .await;
    }
    if let Some(m) = &out.scale_refused
        && !was_refused
    {
        ctx.event(
            obj.object_ref(&()),
            EventType::Warning,
            reasons::MEMBERSHIP_CHANGE_REFUSED,
            m,
        )
        .await;
    }
    Ok(())
}

async fn run<K: ComponentKind>(ctx: &Context, t: &Tenant, key: &str) -> Result<Outcome, Error> {
    let c = K::COMPONENT;
    if let Some(msg) = t.name_problem() {
        return Ok(Outcome::waiting(
            reasons::INVALID_SPEC,
            msg,
            None,
            Some(EventType::Warning),
        ));
    }
    if t.paused(Some(c)) {
        return Ok(Outcome::waiting(
            reasons::PAUSED,
            "reconciliation is paused".into(),
            None,
            None,
        ));
    }
    let version = match t.version(c) {
        Ok(v) => v,
        Err((reason, msg)) => {
            let reason = if reason == reasons::INVALID_SPEC {
                reasons::INVALID_SPEC
            } else {
                reasons::VERSION_UNAVAILABLE
            };
            return Ok(Outcome::waiting(
                reason,
                msg,
                None,
                Some(EventType::Warning),
            ));
        }
    };
    if let Some(msg) = t
        .replicas_problem(c)
        .filter(|_| t.etcd_members().is_none() || c != Component::Etcd)
    {
        return Ok(Outcome::waiting(
            reasons::INVALID_SPEC,
            msg,
            None,
            Some(EventType::Warning),
        ));
    }
    // Say at once when this version cannot run here, rather than after the dependencies.
    if ctx.mode == Mode::Process {
        nestplane_runtime::process::binary_for(c, &version.to_string())
            .map_err(RuntimeError::from)?;
    }
    // Patches are judged before waiting for anything: a patch the runtime refuses is said at
    // once, on a rendering with placeholder addresses (the check compares the patched objects
    // with the same rendering, so addresses do not matter).
    let patches = t.spec_of(c).map(|s| s.patches.clone()).unwrap_or_default();
    if !patches.is_empty() {
        check_patches(ctx, t, c, version, &patches)?;
    }
    let waiting_for: Vec<String> = c
        .dependencies()
        .iter()
        .filter(|d| !t.ready(**d))
        .map(|d| {
            let name = tenant::reference(&t.ncp, *d)
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| "(unreferenced)".into());
            format!("{} {}/{}", tenant::kind_of(*d), t.namespace(), name)
        })
        .collect();
    // Dependencies order creation only: a component that has been Ready keeps running and
    // keeps its own readiness when a dependency blips (its own probes say whether it serves).
    let started_before = t
        .status_of(c)
        .is_some_and(|s| s.ready || s.version.is_some());
    if !waiting_for.is_empty() && !started_before {
        // A dependency's status change reaches this component through its control plane's
        // watch; the requeue is only a safety net, backed off.
        return Ok(Outcome::waiting(
            reasons::WAITING_FOR_DEPENDENCIES,
            format!("waiting for {} to be Ready", waiting_for.join(" and ")),
            Some(ctx.pacing.starting(key)),
            None,
        ));
    }

    let secrets = ClusterSecrets::new(
        ctx.client.clone(),
        &t.namespace(),
        &t.cluster(),
        tenant::owner_ref(&t.ncp),
    );
    if let Mode::Kubernetes(settings) = &ctx.mode {
        return crate::workloads::run::<K>(ctx, t, version, settings, &secrets, &patches, key)
            .await;
    }

    let tkey = TenantKey {
        namespace: t.namespace(),
        cluster: t.cluster(),
    };
    let hosts = ctx.runtime.hosts(&tkey)?;
    let input = t.render_input(
        version,
        Network::Loopback {
            hosts: hosts.clone(),
        },
    );
    let mut rendered = nestplane_render::render(c, &input)?;
    // The same patches as the workloads get; the process runtime runs the patched template.
    if !patches.is_empty() {
        let mut objects = nestplane_render::process_objects(&rendered, &input);
        nestplane_render::policy::apply_checked(
            objects.all_mut(),
            &patches,
            nestplane_render::policy::Runtime::Process,
        )?;
        rendered.pod_template = objects.pod_template()?;
    }
    let cluster_ca_pem = ensure_secrets(
        c,
        t,
        &input,
        endpoint_host(&input).into_iter().collect(),
        &secrets,
    )
    .await?;
    let data = secrets.data(&rendered.secrets).await?;
    ctx.runtime
        .ensure(&tkey, &rendered, &version.to_string(), &data)
        .await?;

    let mut service = None;
    if c == Component::ApiServer {
        service = Some(ensure_apiserver_service(ctx, t, &hosts).await?);
    }
    let endpoints = nestplane_render::health_endpoints(c, &input);
    let healthy =
        nestplane_runtime::process::healthy_count(&endpoints, cluster_ca_pem.as_deref()).await;
    let replicas = rendered.replicas as usize;
    let probe_ok = healthy >= replicas && replicas > 0;
    if probe_ok {
        ctx.runtime.mark_healthy(&tkey, c);
    }
    let verdict = ctx.pacing.probe(key, t.ready(c), probe_ok);
    let ready = verdict.ready;
    // While a failed probe is tolerated, the counts stay what they were (no flapping of the
    // contract's replica fields); the message says what was seen.
    let healthy = if ready && !probe_ok {
        t.status_of(c)
            .and_then(|s| s.ready_replicas)
            .unwrap_or(replicas as i32) as usize
    } else {
        healthy
    };
    let addresses = if c == Component::Etcd {
        hosts
            .iter()
            .take(replicas)
            .enumerate()
            .map(|(i, h)| NestedEtcdAddress {
                ip: Some(h.to_string()),
                hostname: Some(format!("{}-{i}", rendered.workload_name)),
                port: ports::ETCD_CLIENT,
            })
            .collect()
    } else {
        vec![]
    };
    Ok(Outcome {
        ready,
        ready_replicas: healthy as i32,
        reason: if ready {
            reasons::AS_EXPECTED
        } else {
            reasons::PROVISIONING
        },
        message: if ready && !probe_ok {
            format!(
                "{replicas}/{replicas} replicas answered their health endpoint; {} consecutive failed probe(s) tolerated (not Ready after {})",
                verdict.failures,
                crate::pacing::FAILURES_BEFORE_NOT_READY
            )
        } else if ready {
            format!("{replicas}/{replicas} replicas answer their health endpoint")
        } else {
            format!("{healthy}/{replicas} replicas answer their health endpoint")
        },
        version: ready.then(|| version.to_string()),
        addresses,
        service,
        requeue: Some(if probe_ok {
            HEALTH_INTERVAL
        } else if ready {
            crate::pacing::RECHECK
        } else {
            ctx.pacing.starting(key)
        }),
        event: None,
        scale_refused: scale_refusal(t, c),
    })
}

/// The message of a refused etcd membership change, if the spec asks for one.
pub(crate) fn scale_refusal(t: &Tenant, c: Component) -> Option<String> {
    if c != Component::Etcd {
        return None;
    }
    let (members, wanted) = t.etcd_scale_refused()?;
    Some(format!(
        "etcd was formed with {members} member(s) and keeps them: changing replicas to {wanted} after bootstrap is refused, because new members would form a second cluster and the tenant's data would be lost; set replicas back to {members}"
    ))
}

/// Render `c` the way its runtime will and apply the patches under the runtime's policy.
fn check_patches(
    ctx: &Context,
    t: &Tenant,
    c: Component,
    version: nestplane_render::KubeVersion,
    patches: &[serde_json::Value],
) -> Result<(), Error> {
    use nestplane_render::policy::{self, Runtime};
    let (input, runtime) = match &ctx.mode {
        Mode::Kubernetes(settings) => (
            crate::workloads::render_input(t, version, settings),
            Runtime::Kubernetes,
        ),
        Mode::Process => {
            let hosts = (1..=nestplane_runtime::process::MAX_REPLICAS)
                .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i))
                .collect();
            (
                t.render_input(version, Network::Loopback { hosts }),
                Runtime::Process,
            )
        }
    };
    let rendered = nestplane_render::render(c, &input)?;
    let mut objects = nestplane_render::process_objects(&rendered, &input);
    policy::apply_checked(objects.all_mut(), patches, runtime)?;
    Ok(())
}

fn leaf(cn: &str, orgs: &[&str], sans: Sans, usage: Usage) -> LeafSpec {
    LeafSpec {
        common_name: cn.into(),
        organizations: orgs.iter().map(|s| s.to_string()).collect(),
        dns_names: sans.dns,
        ips: sans.ips,
        usage,
    }
}

fn no_sans() -> Sans {
    Sans {
        dns: vec![],
        ips: vec![],
    }
}

/// The endpoint host of the control plane (the first API server replica's address).
pub fn endpoint_host(input: &RenderInput) -> Option<String> {
    match &input.network {
        Network::Loopback { hosts } => hosts.first().map(|h| h.to_string()),
        Network::Cluster => None,
    }
}

/// Create or renew the secrets component `c` needs; returns the cluster CA (PEM) for
/// health checks over HTTPS.
pub(crate) async fn ensure_secrets(
    c: Component,
    t: &Tenant,
    input: &RenderInput,
    hosts: Vec<String>,
    s: &ClusterSecrets,
) -> Result<Option<String>, Error> {
    let cluster = t.cluster();
    match c {
        Component::Etcd => {
            let ca = s.ca(SecretPurpose::EtcdCa).await?;
            let sans = nestplane_render::etcd_sans(input);
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::EtcdServer,
                    ca: SecretPurpose::EtcdCa,
                    spec: leaf(
                        &format!("{cluster}-etcd"),
                        &[],
                        sans.clone(),
                        Usage::ServerAndClient,
                    ),
                },
                &ca,
            )
            .await?;
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::EtcdPeer,
                    ca: SecretPurpose::EtcdCa,
                    spec: leaf(
                        &format!("{cluster}-etcd-peer"),
                        &[],
                        sans,
                        Usage::ServerAndClient,
                    ),
                },
                &ca,
            )
            .await?;
            Ok(None)
        }
        Component::ApiServer => {
            let ca = s.ca(SecretPurpose::ClusterCa).await?;
            let etcd_ca = s.ca(SecretPurpose::EtcdCa).await?;
            let proxy_ca = s.ca(SecretPurpose::FrontProxyCa).await?;
            s.ca(SecretPurpose::ServiceAccount).await?;
            // The first address is the endpoint; the others are further names it answers to.
            let host = hosts.first().cloned();
            let mut sans = nestplane_render::apiserver_sans(input, host.as_deref());
            for h in hosts.iter().skip(1) {
                match h.parse::<IpAddr>() {
                    Ok(ip) if !sans.ips.contains(&ip) => sans.ips.push(ip),
                    Ok(_) => {}
                    Err(_) if !sans.dns.contains(h) => sans.dns.push(h.clone()),
                    Err(_) => {}
                }
            }
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::ApiServer,
                    ca: SecretPurpose::ClusterCa,
                    spec: leaf("kube-apiserver", &[], sans, Usage::Server),
                },
                &ca,
            )
            .await?;
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::ApiServerEtcdClient,
                    ca: SecretPurpose::EtcdCa,
                    spec: leaf(
                        "kube-apiserver-etcd-client",
                        &["system:masters"],
                        no_sans(),
                        Usage::Client,
                    ),
                },
                &etcd_ca,
            )
            .await?;
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::ApiServerKubeletClient,
                    ca: SecretPurpose::ClusterCa,
                    spec: leaf(
                        "kube-apiserver-kubelet-client",
                        &["system:masters"],
                        no_sans(),
                        Usage::Client,
                    ),
                },
                &ca,
            )
            .await?;
            s.leaf(
                &Leaf {
                    purpose: SecretPurpose::FrontProxyClient,
                    ca: SecretPurpose::FrontProxyCa,
                    spec: leaf("front-proxy-client", &[], no_sans(), Usage::Client),
                },
                &proxy_ca,
            )
            .await?;
            let server = match (&host, &t.ncp.spec.control_plane_endpoint) {
                (_, Some(ep)) if !ep.host.is_empty() => format!("https://{}:{}", ep.host, ep.port),
                (Some(h), _) => format!("https://{h}:{}", ports::APISERVER),
                _ => nestplane_render::apiserver_internal_url(input),
            };
            s.kubeconfig(
                &KubeconfigSpec {
                    purpose: SecretPurpose::AdminKubeconfig,
                    server,
                    user: "kubernetes-admin".into(),
                    groups: vec!["system:masters".into()],
                },
                &ca,
            )
            .await?;
            Ok(Some(ca.cert_pem))
        }
        Component::ControllerManager | Component::Scheduler => {
            let ca = s.ca(SecretPurpose::ClusterCa).await?;
            let server = nestplane_render::apiserver_internal_url(input);
            let (kc, serving, user, sans) = if c == Component::ControllerManager {
                (
                    SecretPurpose::ControllerManagerKubeconfig,
                    SecretPurpose::ControllerManagerServing,
                    "system:kube-controller-manager",
                    nestplane_render::controller_manager_sans(input),
                )
            } else {
                (
                    SecretPurpose::SchedulerKubeconfig,
                    SecretPurpose::SchedulerServing,
                    "system:kube-scheduler",
                    nestplane_render::scheduler_sans(input),
                )
            };
            s.kubeconfig(
                &KubeconfigSpec {
                    purpose: kc,
                    server,
                    user: user.into(),
                    groups: vec![],
                },
                &ca,
            )
            .await?;
            s.leaf(
                &Leaf {
                    purpose: serving,
                    ca: SecretPurpose::ClusterCa,
                    spec: leaf(user, &[], sans, Usage::Server),
                },
                &ca,
            )
            .await?;
            Ok(Some(ca.cert_pem))
        }
    }
}

/// The process runtime has no Service of its own: a selector-less Service named
/// `<cluster>-apiserver` stands for the tenant API server (annotated with its URL), so
/// `NestedAPIServer.status.apiserverService` points at a real object.
async fn ensure_apiserver_service(
    ctx: &Context,
    t: &Tenant,
    hosts: &[std::net::Ipv4Addr],
) -> Result<ObjectReference, Error> {
    let name = Component::ApiServer.workload_name(&t.cluster());
    let ns = t.namespace();
    let url = hosts
        .first()
        .map(|h| format!("https://{}:{}", IpAddr::V4(*h), ports::APISERVER))
        .unwrap_or_default();
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": BTreeMap::from([
                (names::CLUSTER_NAME_LABEL, t.cluster()),
                (names::COMPONENT_LABEL, Component::ApiServer.short_name().to_string()),
                (names::MANAGED_BY_LABEL, names::MANAGED_BY.to_string()),
            ]),
            "annotations": {"nestplane.io/endpoint": url},
            "ownerReferences": [tenant::owner_ref(&t.ncp)],
        },
        "spec": {"ports": [{"name": "https", "port": ports::APISERVER, "targetPort": ports::APISERVER, "protocol": "TCP"}]}
    }))
    .map_err(|e| Error::Internal(e.to_string()))?;
    let api: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&svc),
    )
    .await?;
    Ok(ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        name: Some(name),
        namespace: Some(ns),
        ..ObjectReference::default()
    })
}
