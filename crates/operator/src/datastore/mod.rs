//! Shared datastores: the `NestedDatastore` controller, and what a `NestedControlPlane` on one
//! needs from it (a user, a role and a key prefix of its own, and the credentials for them).
//!
//! - A **managed** datastore is an etcd nestplane runs: a `NestedEtcd` named
//!   `<datastore>-datastore-etcd`, controlled by the datastore, which the etcd controller runs
//!   like any tenant's (either runtime, persistent). nestplane keeps a client certificate of
//!   etcd's `root` user beside it (`<datastore>-datastore-root`).
//! - An **external** datastore is an etcd someone else runs: its endpoints, the CA etcd
//!   trusts for clients (certificate and key), and a `root` client certificate.
//!
//! For each tenant nestplane creates an etcd user and role `nestplane:<ns>:<cluster>` that may
//! read and write `/nestplane/<ns>/<cluster>/` only, a client certificate for that user signed
//! by the datastore's CA (the CA's key never leaves the datastore's namespace), and the API
//! server's `--etcd-prefix`. Deleting the tenant deletes its keys, user and role, and nothing
//! else. A datastore is not deleted while tenants use it.

pub mod etcd;
pub mod migrate;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use nestplane_api::conditions::{self, reasons, types};
use nestplane_api::datastore::{
    DatastoreTenant, Quotas, TenantDatastoreStatus, datastore_cluster, over_quota, tenant_prefix,
    tenant_user,
};
use nestplane_api::names::{self, Component, SecretPurpose};
use nestplane_api::{
    NestedControlPlane, NestedDatastore, NestedDatastoreStatus, NestedEtcd, NestedEtcdSpec,
};
use nestplane_pki::{CertKey, LeafSpec, Usage};

use crate::context::Context;
use crate::error::{AtStep, Error};
use crate::secrets::{ClusterSecrets, Leaf};
use crate::tenant::Tenant;

/// Kept on a datastore until no tenant uses it and what nestplane runs for it is gone.
pub const FINALIZER: &str = "controlplane.cluster.x-k8s.io/nestplane-datastore";
/// `status.type` of a datastore nestplane runs.
pub const MANAGED: &str = "Managed";
/// `status.type` of a datastore someone else runs.
pub const EXTERNAL: &str = "External";
/// Reason: the datastore's etcd is not Ready yet.
pub const WAITING_FOR_ETCD: &str = "WaitingForEtcd";
/// Reason: the datastore cannot be reached or refused nestplane's root user.
pub const UNREACHABLE: &str = "Unreachable";
/// Reason: tenants still use the datastore being deleted.
pub const IN_USE: &str = "InUse";
/// Reason: the datastore's etcd has published authorization bypasses; it is not shared.
pub const OUTDATED_ETCD: &str = "OutdatedEtcd";
/// Reason: a control plane waits for its datastore.
pub const WAITING_FOR_DATASTORE: &str = "WaitingForDatastore";

/// How often a Ready datastore without tenants is asked how it is.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(30);
/// How often a datastore's tenants are measured (and its members asked how they are).
pub const MEASURE_INTERVAL: Duration = Duration::from_secs(10);
/// How often they are measured while one of them stores half its quota or more: a tenant
/// writing `r` bytes a second passes its quota by at most about `2 s × r` (plus what
/// [`MEASURE_INTERVAL`] lets it write past half of it).
pub const QUOTA_NEAR_INTERVAL: Duration = Duration::from_secs(2);
/// Reason: a tenant stores its quota; its role may only read.
pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";
/// Reason: a tenant is under its quota again.
pub const WITHIN_QUOTA: &str = "WithinQuota";
/// Reason: the datastore cannot take a tenant's quota besides those it has.
pub const DATASTORE_FULL: &str = "DatastoreFull";
/// The condition of a control plane on a shared datastore that says whether it may write.
pub const QUOTA_CONDITION: &str = "DatastoreQuota";

/// The `(namespace, name)` of the datastore `ncp` uses, if any.
pub fn referenced(ncp: &NestedControlPlane) -> Option<(String, String)> {
    let r = ncp.spec.datastore_ref.as_ref()?;
    let ns = r
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| ncp.namespace())?;
    Some((ns, r.name.clone()))
}

/// The name of a managed datastore's `NestedEtcd`.
pub fn etcd_name(ds: &NestedDatastore) -> String {
    Component::Etcd.workload_name(&datastore_cluster(&ds.name_any()))
}

fn owner(ds: &NestedDatastore) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
    let mut r = ds.controller_owner_ref(&()).unwrap_or_default();
    r.block_owner_deletion = Some(true);
    r
}

/// A managed datastore's etcd as a tenant of its own: a control plane that exists only in
/// memory (named `<datastore>-datastore`, with the datastore's uid), whose only component is
/// the datastore's `NestedEtcd`, and whose objects the datastore owns.
pub fn etcd_tenant(ds: &NestedDatastore, etcd: NestedEtcd) -> Tenant {
    let mut ncp = NestedControlPlane::new(&ds.name_any(), Default::default());
    ncp.metadata.namespace = ds.namespace();
    ncp.metadata.uid = ds.uid();
    ncp.metadata.annotations = Some(
        [(
            names::CLUSTER_IDENTITY_ANNOTATION.to_string(),
            datastore_cluster(&ds.name_any()),
        )]
        .into(),
    );
    ncp.spec.version = ds.spec.managed.as_ref().and_then(|m| m.version.clone());
    Tenant {
        ncp,
        etcd: crate::tenant::Lookup::Found(etcd),
        apiserver: crate::tenant::Lookup::Unreferenced,
        controller_manager: crate::tenant::Lookup::Unreferenced,
        scheduler: crate::tenant::Lookup::Unreferenced,
        cluster_paused: false,
        external_etcd: None,
        owner: Some(owner(ds)),
        etcd_compacts_itself: true,
        etcd_quota_backend_bytes: Some(
            Quotas::of(&ds.spec)
                .map(|q| q.backend)
                .unwrap_or(nestplane_api::datastore::DEFAULT_MANAGED_BACKEND),
        ),
        held_by: None,
    }
}

/// The datastore that controls `obj`, by its controller owner reference.
pub fn controller_of<K: Resource>(obj: &K) -> Option<String> {
    obj.meta()
        .owner_references
        .iter()
        .flatten()
        .find(|r| {
            r.controller == Some(true)
                && r.kind == "NestedDatastore"
                && r.api_version
                    .starts_with(nestplane_api::controlplane::GROUP)
        })
        .map(|r| r.name.clone())
}

/// A datastore from the cache, else from the API server.
pub async fn get(ctx: &Context, ns: &str, name: &str) -> Result<Option<NestedDatastore>, Error> {
    if let Some(hit) = ctx
        .caches
        .datastores
        .get()
        .and_then(|s| s.get(&ObjectRef::new(name).within(ns)))
    {
        return Ok(Some((*hit).clone()));
    }
    Ok(Api::<NestedDatastore>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await?)
}

/// How nestplane reaches a datastore as `root`, and the CA that signs tenants' certificates.
struct Access {
    endpoints: Vec<String>,
    creds: etcd::Credentials,
    ca: CertKey,
}

/// Why a datastore cannot be used yet: a reason and a message for a person.
type NotYet = (&'static str, String);

fn secret_text(s: &Secret, key: &str) -> Option<String> {
    s.data
        .as_ref()?
        .get(key)
        .map(|b| String::from_utf8_lossy(&b.0).into_owned())
}

/// Client URLs from an etcd's status: a DNS name when the address has one (a Service's),
/// else the IP.
fn etcd_urls(etcd: &NestedEtcd) -> Vec<String> {
    etcd.status
        .iter()
        .flat_map(|s| &s.addresses)
        .filter_map(|a| {
            let host = a
                .hostname
                .clone()
                .filter(|h| h.contains('.'))
                .or_else(|| a.ip.clone())
                .or_else(|| a.hostname.clone())?;
            Some(format!("https://{host}:{}", a.port))
        })
        .collect()
}

/// How to reach `ds`. A managed datastore's etcd must be Ready, unless `any_state` (a tenant
/// leaving uses whatever members are known).
async fn access(
    ctx: &Context,
    ds: &NestedDatastore,
    any_state: bool,
) -> Result<Result<Access, NotYet>, Error> {
    let ns = ds.namespace().unwrap_or_default();
    if let Some(ext) = &ds.spec.external {
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
        let read = |name: String| {
            let secrets = secrets.clone();
            async move {
                let s = secrets.get_opt(&name).await?;
                let pair = s.as_ref().map(|s| {
                    (
                        secret_text(s, names::TLS_CRT),
                        secret_text(s, names::TLS_KEY),
                    )
                });
                Ok::<_, Error>((name, pair))
            }
        };
        let mut pairs = Vec::new();
        for name in [ext.ca_secret_name.clone(), ext.root_secret_name.clone()] {
            match read(name).await? {
                (name, None) => {
                    return Ok(Err((
                        reasons::REFERENCE_NOT_FOUND,
                        format!("Secret {ns}/{name} not found"),
                    )));
                }
                (_, Some((Some(crt), Some(key)))) => pairs.push((crt, key)),
                (name, Some(_)) => {
                    return Ok(Err((
                        reasons::INVALID_SPEC,
                        format!("Secret {ns}/{name} must hold tls.crt and tls.key"),
                    )));
                }
            }
        }
        let (root_crt, root_key) = pairs.pop().unwrap_or_default();
        let (ca_crt, ca_key) = pairs.pop().unwrap_or_default();
        match nestplane_pki::key_matches(&ca_crt, &ca_key) {
            Ok(true) => {}
            _ => {
                return Ok(Err((
                    reasons::INVALID_SPEC,
                    format!(
                        "Secret {ns}/{}: tls.key does not belong to tls.crt",
                        ext.ca_secret_name
                    ),
                )));
            }
        }
        return Ok(Ok(Access {
            endpoints: ext.endpoints.clone(),
            creds: etcd::Credentials {
                ca_pem: ca_crt.clone(),
                cert_pem: root_crt,
                key_pem: root_key,
            },
            ca: CertKey {
                cert_pem: ca_crt,
                key_pem: ca_key,
            },
        }));
    }
    let name = etcd_name(ds);
    let Some(etcd) = Api::<NestedEtcd>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&name)
        .await?
    else {
        return Ok(Err((
            WAITING_FOR_ETCD,
            format!("NestedEtcd {ns}/{name} is being created"),
        )));
    };
    let ready = etcd.status.as_ref().is_some_and(|s| s.common.ready);
    let endpoints = etcd_urls(&etcd);
    if (!ready && !any_state) || endpoints.is_empty() {
        return Ok(Err((
            WAITING_FOR_ETCD,
            format!("waiting for NestedEtcd {ns}/{name} to be Ready"),
        )));
    }
    let secrets = ClusterSecrets::new(
        ctx.client.clone(),
        &ns,
        &datastore_cluster(&ds.name_any()),
        owner(ds),
        ctx.clock.clone(),
    )
    .with_cache(ctx.caches.secrets.get().cloned());
    let ca = secrets.ca(SecretPurpose::EtcdCa).await?;
    let root = secrets
        .leaf(
            &Leaf {
                purpose: SecretPurpose::DatastoreRoot,
                ca: SecretPurpose::EtcdCa,
                spec: LeafSpec {
                    common_name: etcd::ROOT.into(),
                    usage: Usage::Client,
                    ..LeafSpec::default()
                },
            },
            &ca,
        )
        .await?;
    Ok(Ok(Access {
        endpoints,
        creds: etcd::Credentials {
            ca_pem: ca.cert_pem.clone(),
            cert_pem: root.cert_pem,
            key_pem: root.key_pem,
        },
        ca,
    }))
}

/// Whether some of `ncp`'s keys are in datastore `key` without its spec naming it: it is
/// bound there, or a move ([`migrate`]) copies from or to it.
fn holds(ncp: &NestedControlPlane, key: &(String, String)) -> bool {
    let Some(status) = ncp.status.as_ref() else {
        return false;
    };
    let named = format!("{}/{}", key.0, key.1);
    status
        .datastore
        .as_ref()
        .is_some_and(|b| b.namespace == key.0 && b.name == key.1)
        || status
            .migration
            .as_ref()
            .is_some_and(|m| migrate::holding(m).contains(&named))
}

/// Whether a tenant whose spec names another datastore is still measured on `here`: it is
/// bound here and not frozen for a move's cut-over (a move that waits keeps its quota).
fn measured_here(ncp: &NestedControlPlane, here: &(String, String)) -> bool {
    let Some(status) = ncp.status.as_ref() else {
        return false;
    };
    status
        .datastore
        .as_ref()
        .is_some_and(|b| b.namespace == here.0 && b.name == here.1)
        && !status.migration.as_ref().is_some_and(|m| {
            m.phase == migrate::phases::FREEZING || m.phase == migrate::phases::CUTTING_OVER
        })
}

/// The control planes that use `ds`, from the control planes' cache.
fn tenants_of(ctx: &Context, ds: &NestedDatastore) -> Vec<Arc<NestedControlPlane>> {
    let key = (ds.namespace().unwrap_or_default(), ds.name_any());
    let Some(store) = ctx.caches.ncps.get() else {
        return Vec::new();
    };
    let mut out: Vec<_> = store
        .state()
        .into_iter()
        .filter(|ncp| referenced(ncp).as_ref() == Some(&key) || holds(ncp, &key))
        // A control plane the datastore refused is no tenant of it (and holds no deletion).
        .filter(|ncp| {
            let ns = ncp.namespace().unwrap_or_default();
            ns == key.0
                || ds
                    .spec
                    .allowed_namespaces
                    .as_ref()
                    .is_some_and(|a| a.names.contains(&ns))
                || ncp
                    .status
                    .as_ref()
                    .and_then(|s| s.datastore.as_ref())
                    .is_some_and(|b| b.namespace == key.0 && b.name == key.1)
        })
        .collect();
    out.sort_by_key(|n| (n.namespace(), n.name_any()));
    out
}

/// Why a datastore is not Ready: a reason, a message, and the Event it deserves.
type Verdict = Result<(), (&'static str, String, Option<EventType>)>;

/// Reconcile one datastore: finalizer → status from its tenants → (valid) its etcd kept,
/// reached, its members checked and its tenants measured → `Ready` written.
#[tracing::instrument(name = "NestedDatastore", skip_all, fields(namespace = ds.metadata.namespace.as_deref().unwrap_or_default(), datastore = ds.metadata.name.as_deref().unwrap_or_default()))]
pub async fn reconcile(ds: Arc<NestedDatastore>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started("NestedDatastore");
    let ns = ds.namespace().unwrap_or_default();
    let api: Api<NestedDatastore> = Api::namespaced(ctx.client.clone(), &ns);
    let key = crate::context::object_key(ds.as_ref());
    let tenants = tenants_of(&ctx, &ds);
    if ds.metadata.deletion_timestamp.is_some() {
        return delete(&ctx, &ds, &api, &tenants).await.at("teardown");
    }
    crate::finalizer::add(&api, ds.as_ref(), FINALIZER)
        .await
        .at("finalizer")?;
    let mut status = tenants_status(&ds, &tenants);
    let mut near_quota = false;
    let verdict = match problem(&ds) {
        Some(m) => Err((reasons::INVALID_SPEC, m, Some(EventType::Warning))),
        None => examine(&ctx, &ds, &tenants, &mut status, &mut near_quota)
            .await
            .at("examine")?,
    };
    write_ready(&ctx, &api, &ds, &mut status, &verdict)
        .await
        .at("status")?;
    Ok(match verdict {
        Ok(()) => {
            ctx.pacing.succeeded(&key);
            Action::requeue(if near_quota {
                QUOTA_NEAR_INTERVAL
            } else if status.tenants.is_empty() {
                HEALTH_INTERVAL
            } else {
                MEASURE_INTERVAL
            })
        }
        Err((OUTDATED_ETCD, ..)) => Action::requeue(HEALTH_INTERVAL),
        Err((reasons::INVALID_SPEC, ..)) => Action::await_change(),
        Err((WAITING_FOR_ETCD, ..)) => Action::requeue(ctx.pacing.starting(&key)),
        Err(_) => Action::requeue(ctx.pacing.error(&key)),
    })
}

/// The status's type and tenants (what the last measuring found stays until this pass
/// measures again). A tenant's user and prefix are computed from its namespace and name,
/// never read from its status (quotas act on them). Pure.
fn tenants_status(
    ds: &NestedDatastore,
    tenants: &[Arc<NestedControlPlane>],
) -> NestedDatastoreStatus {
    let kind = if ds.spec.external.is_some() {
        EXTERNAL
    } else {
        MANAGED
    };
    let mut status = NestedDatastoreStatus {
        r#type: Some(kind.into()),
        observed_generation: ds.metadata.generation,
        tenants: tenants
            .iter()
            .filter(|t| {
                t.status
                    .as_ref()
                    .and_then(|s| s.datastore.as_ref())
                    .is_some()
            })
            .filter_map(|t| {
                let ns = t.namespace().unwrap_or_default();
                let cluster = crate::tenant::cluster_name(t);
                names::dns_label_problem(&cluster, names::MAX_CLUSTER_NAME_LEN)
                    .is_none()
                    .then(|| DatastoreTenant {
                        user: tenant_user(&ns, &cluster),
                        prefix: tenant_prefix(&ns, &cluster),
                        namespace: ns,
                        name: t.name_any(),
                        ..Default::default()
                    })
            })
            .collect(),
        conditions: ds
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default(),
        ..Default::default()
    };
    status.tenant_count = status.tenants.len() as i32;
    for t in status.tenants.iter_mut() {
        if let Some(p) = ds
            .status
            .iter()
            .flat_map(|s| &s.tenants)
            .find(|p| p.namespace == t.namespace && p.name == t.name)
        {
            t.quota_bytes = p.quota_bytes;
            t.read_only = p.read_only;
        }
    }
    status
}

/// A valid datastore's etcd kept (managed), reached, its members checked and its tenants
/// measured; `near_quota` when a tenant is near its quota.
async fn examine(
    ctx: &Context,
    ds: &NestedDatastore,
    tenants: &[Arc<NestedControlPlane>],
    status: &mut NestedDatastoreStatus,
    near_quota: &mut bool,
) -> Result<Verdict, Error> {
    if ds.spec.external.is_none() {
        // A datastore of a name deleted before runs again.
        let placeholder = NestedEtcd::new(&etcd_name(ds), NestedEtcdSpec::default());
        ctx.runtime.revive(&etcd_tenant(ds, placeholder).ncp);
        ensure_etcd(ctx, ds).await?;
    }
    let a = match access(ctx, ds, false).await? {
        Err((reason, m)) => {
            let event = (reason != WAITING_FOR_ETCD).then_some(EventType::Warning);
            return Ok(Err((reason, m, event)));
        }
        Ok(a) => a,
    };
    status.endpoints = a.endpoints.clone();
    let members = match check(&a).await {
        Ok(m) => m,
        Err(e) => return Ok(Err((UNREACHABLE, e.to_string(), Some(EventType::Warning)))),
    };
    let healthy = members.iter().filter(|m| m.healthy).count();
    status.healthy_members = Some(format!("{healthy}/{}", members.len()));
    let all = healthy == members.len();
    let unhealthy: Vec<String> = members
        .iter()
        .filter(|m| !m.healthy)
        .map(|m| format!("{}: {}", m.endpoint, m.message.clone().unwrap_or_default()))
        .collect();
    let outdated = members.iter().find_map(|m| {
        let v = m.version.as_deref()?;
        nestplane_api::datastore::etcd_version_problem(v).map(|p| format!("{}: {p}", m.endpoint))
    });
    status.members = members;
    // Quotas hold whatever the admission verdict: a member down or an old etcd admits no new
    // tenant, but those on it are measured.
    let measured = enforce_quotas(ctx, ds, &a, tenants, status).await;
    if let Ok(near) = measured {
        *near_quota = near;
    }
    Ok(if let Some(problem) = outdated {
        Err((
            OUTDATED_ETCD,
            format!("{problem}; no new tenant is admitted, tenants already on it keep running"),
            Some(EventType::Warning),
        ))
    } else if !all {
        Err((
            reasons::UNHEALTHY,
            format!("unhealthy members: {}", unhealthy.join("; ")),
            Some(EventType::Warning),
        ))
    } else {
        measured.map(|_| ()).map_err(|e| {
            (
                UNREACHABLE,
                format!("measuring tenants: {e}"),
                Some(EventType::Warning),
            )
        })
    })
}

/// `Ready` from the verdict, the status written when it changed (a merge patch: lists that
/// became empty are sent as such, or the old ones would stay), an Event when `Ready` changes.
async fn write_ready(
    ctx: &Context,
    api: &Api<NestedDatastore>,
    ds: &NestedDatastore,
    status: &mut NestedDatastoreStatus,
    verdict: &Verdict,
) -> Result<(), Error> {
    status.ready = verdict.is_ok();
    let (reason, message, event) = match verdict {
        Ok(()) => (
            reasons::AS_EXPECTED,
            format!("{} tenant(s)", status.tenant_count),
            None,
        ),
        Err((r, m, e)) => (*r, m.clone(), *e),
    };
    let before = ds
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, types::READY))
        .map(|c| (c.status.clone(), c.reason.clone()));
    conditions::set(
        &mut status.conditions,
        conditions::new(types::READY, status.ready, reason, message.clone()),
        ds.metadata.generation,
        k8s_openapi::jiff::Timestamp::now(),
    );
    if ds.status.as_ref() == Some(&*status) {
        return Ok(());
    }
    let mut body = serde_json::to_value(&*status).map_err(|e| Error::Internal(e.to_string()))?;
    for list in ["tenants", "members", "endpoints"] {
        if body.get(list).is_none() {
            body[list] = serde_json::json!([]);
        }
    }
    api.patch_status(
        &ds.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": body })),
    )
    .await?;
    let after = (
        if status.ready { "True" } else { "False" }.to_string(),
        reason.to_string(),
    );
    if before != Some(after) {
        let note = if status.ready {
            format!("the datastore is ready ({message})")
        } else {
            message.clone()
        };
        ctx.event(
            ds.object_ref(&()),
            event.unwrap_or(EventType::Normal),
            reason,
            &note,
        )
        .await;
    }
    Ok(())
}

/// What is wrong with a datastore's spec, said for a person.
fn problem(ds: &NestedDatastore) -> Option<String> {
    if let Err(e) = Quotas::of(&ds.spec) {
        return Some(e);
    }
    match (&ds.spec.managed, &ds.spec.external) {
        (Some(_), Some(_)) => Some("set either managed or external, not both".into()),
        (_, Some(e)) if e.endpoints.is_empty() => {
            Some("external.endpoints is empty: give etcd's client URLs".into())
        }
        (_, Some(e)) => e
            .endpoints
            .iter()
            .find(|u| !u.starts_with("https://"))
            .map(|u| format!("external endpoint {u:?} is not an https:// URL")),
        (Some(m), None) => match m.replicas {
            Some(1) | Some(3) | None => None,
            Some(n) => Some(format!(
                "managed.replicas {n}: a datastore runs 1 or 3 members"
            )),
        },
        (None, None) => None,
    }
}

/// A managed datastore's `NestedEtcd`: created when missing, its version and replicas kept
/// to the datastore's spec (the etcd controller refuses a membership change after bootstrap,
/// and says so on the NestedEtcd).
async fn ensure_etcd(ctx: &Context, ds: &NestedDatastore) -> Result<(), Error> {
    let ns = ds.namespace().unwrap_or_default();
    let name = etcd_name(ds);
    let managed = ds.spec.managed.clone().unwrap_or_default();
    let api: Api<NestedEtcd> = Api::namespaced(ctx.client.clone(), &ns);
    let cached = ctx
        .caches
        .etcds
        .get()
        .and_then(|s| s.get(&ObjectRef::new(&name).within(&ns)));
    let existing = match cached {
        Some(e) => Some((*e).clone()),
        None => api.get_opt(&name).await?,
    };
    match existing {
        None => {
            let mut etcd = NestedEtcd::new(&name, NestedEtcdSpec::default());
            etcd.metadata.namespace = Some(ns.clone());
            etcd.metadata.owner_references = Some(vec![owner(ds)]);
            etcd.metadata.labels = Some(
                [(
                    names::CLUSTER_NAME_LABEL.to_string(),
                    datastore_cluster(&ds.name_any()),
                )]
                .into(),
            );
            etcd.spec.component.replicas = managed.replicas;
            etcd.spec.component.version = managed.version;
            match api.create(&PostParams::default(), &etcd).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(e.into()),
            }
        }
        Some(e) => {
            let spec = &e.spec.component;
            if spec.replicas != managed.replicas || spec.version != managed.version {
                api.patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {
                        "replicas": managed.replicas,
                        "version": managed.version,
                    }})),
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// Authentication on, and every member's health.
/// Authentication on (checked with a read as a user etcd does not know, which only succeeds
/// when it is off; turned on then), and every member's health. A steady datastore costs
/// reads only.
async fn check(a: &Access) -> Result<Vec<nestplane_api::datastore::DatastoreMember>, Error> {
    let mut admin = etcd::Admin::connect(&a.endpoints, &a.creds).await?;
    let stranger = nestplane_pki::issue(
        &a.ca,
        &LeafSpec {
            common_name: "nestplane-auth-probe".into(),
            usage: Usage::Client,
            ..LeafSpec::default()
        },
        time::OffsetDateTime::now_utc(),
    )?;
    let probe = etcd::Credentials {
        ca_pem: a.creds.ca_pem.clone(),
        cert_pem: stranger.cert_pem,
        key_pem: stranger.key_pem,
    };
    if etcd::Admin::anyone_may_read(&a.endpoints, &probe).await? {
        admin.ensure_auth().await?;
    }
    Ok(admin.members().await)
}

async fn delete(
    ctx: &Context,
    ds: &NestedDatastore,
    api: &Api<NestedDatastore>,
    tenants: &[Arc<NestedControlPlane>],
) -> Result<Action, Error> {
    if !crate::finalizer::has(ds, FINALIZER) {
        return Ok(Action::await_change());
    }
    if !tenants.is_empty() {
        let names: Vec<String> = tenants
            .iter()
            .map(|t| format!("{}/{}", t.namespace().unwrap_or_default(), t.name_any()))
            .collect();
        let message = format!(
            "{} control plane(s) still use this datastore: {}; it is deleted after them",
            names.len(),
            names.join(", ")
        );
        let mut status = ds.status.clone().unwrap_or_default();
        let had = conditions::get(&status.conditions, types::DELETING).map(|c| c.message.clone());
        if had.as_ref() != Some(&message) {
            conditions::set(
                &mut status.conditions,
                conditions::new(types::DELETING, true, IN_USE, message.clone()),
                ds.metadata.generation,
                k8s_openapi::jiff::Timestamp::now(),
            );
            api.patch_status(
                &ds.name_any(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "status": status })),
            )
            .await?;
            ctx.event(ds.object_ref(&()), EventType::Warning, IN_USE, &message)
                .await;
        }
        // Tenants leaving are seen through the control planes' watch.
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    if ds.spec.external.is_none() {
        // What owner references do not remove: processes and data, volume claims.
        let etcd = NestedEtcd::new(&etcd_name(ds), NestedEtcdSpec::default());
        let t = etcd_tenant(ds, etcd);
        ctx.runtime.remove(&ctx.client, &t.ncp).await?;
    }
    crate::finalizer::remove(api, ds, FINALIZER).await?;
    Ok(Action::await_change())
}

/// The quota a tenant holds: what it asks for (`spec.datastoreRef.quota`) when that is valid
/// and, if it is more than it held, the datastore can take it besides the others' quotas;
/// else what it held (`held`; the datastore's default for a tenant never measured). Pure.
pub fn granted_quota(
    quotas: &Quotas,
    asked: Option<&k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    held: Option<i64>,
    others: i64,
) -> i64 {
    let held = held.unwrap_or(quotas.tenant_default);
    match quotas.for_tenant(asked) {
        Ok(want) if want <= held || others.saturating_add(want) <= quotas.capacity() => want,
        _ => held,
    }
}

/// Measure each tenant of `ds` and make a tenant at its quota read-only (writable again once
/// it is under); records each tenant's quota and state in `status` and its usage in the
/// metrics. A tenant that cannot be measured is skipped (and said in the log), never the
/// others. Returns whether a tenant is near its quota (measured again sooner).
async fn enforce_quotas(
    ctx: &Context,
    ds: &NestedDatastore,
    a: &Access,
    ncps: &[Arc<NestedControlPlane>],
    status: &mut NestedDatastoreStatus,
) -> Result<bool, Error> {
    let Ok(quotas) = Quotas::of(&ds.spec) else {
        return Ok(false);
    };
    if status.tenants.is_empty() {
        return Ok(false);
    }
    let granted = granted_quotas(ds, &quotas, ncps, &status.tenants);
    let mut admin = etcd::Admin::connect(&a.endpoints, &a.creds).await?;
    let mut near = false;
    let mut done: Vec<String> = Vec::new();
    for i in 0..status.tenants.len() {
        let t = status.tenants[i].clone();
        // Two control planes naming one cluster share a prefix: the smaller quota holds.
        let quota = status
            .tenants
            .iter()
            .zip(&granted)
            .filter(|(o, _)| o.prefix == t.prefix)
            .map(|(_, q)| *q)
            .min()
            .unwrap_or(granted[i]);
        status.tenants[i].quota_bytes = Some(quota);
        if done.contains(&t.prefix) {
            continue;
        }
        // A tenant frozen for a move away is not measured here: the freeze holds its role.
        let here = (ds.namespace().unwrap_or_default(), ds.name_any());
        let Some(ncp) = ncps
            .iter()
            .find(|n| n.namespace().as_deref() == Some(&t.namespace) && n.name_any() == t.name)
            .filter(|n| n.metadata.deletion_timestamp.is_none())
            .filter(|n| referenced(n).as_ref() == Some(&here) || measured_here(n, &here))
        else {
            continue;
        };
        done.push(t.prefix.clone());
        let measured = async {
            let Some(writable) = admin.writable(&t.user, &t.prefix).await? else {
                return Ok::<_, etcd::EtcdError>(None);
            };
            let usage = admin.usage(&t.prefix).await?;
            let read_only = over_quota(usage.bytes, quota, !writable);
            if read_only == writable {
                admin.set_writable(&t.user, &t.prefix, !read_only).await?;
            }
            Ok(Some((usage, read_only, read_only == writable)))
        }
        .await;
        let (usage, read_only, changed) = match measured {
            Ok(Some(m)) => m,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(namespace = %t.namespace, cluster = %t.name, error = %e, "measuring a tenant failed");
                continue;
            }
        };
        ctx.metrics
            .set_datastore_usage(&t.namespace, &t.name, usage.keys, usage.bytes, quota);
        // A read-only tenant cannot grow: it does not need the fast cadence.
        near |= !read_only && usage.bytes >= quota / 2;
        for o in status.tenants.iter_mut().filter(|o| o.prefix == t.prefix) {
            o.read_only = read_only;
        }
        if changed {
            quota_changed(ctx, ds, ncp, &t, &usage, quota, read_only).await;
        }
    }
    Ok(near)
}

/// Whether a new tenant's quota fits: the datastore's quotas valid, the tenant's valid, and
/// all of them within what the datastore may hold; `None` admits it. Pure.
fn admission(ds: &NestedDatastore, t: &Tenant) -> Option<Binding> {
    let (ds_ns, ds_name) = (ds.namespace().unwrap_or_default(), ds.name_any());
    let quotas = match Quotas::of(&ds.spec) {
        Ok(q) => q,
        Err(e) => {
            return Some(Binding::Waiting(format!(
                "NestedDatastore {ds_ns}/{ds_name} has an invalid quota: {e}"
            )));
        }
    };
    let asked = t
        .ncp
        .spec
        .datastore_ref
        .as_ref()
        .and_then(|r| r.quota.as_ref());
    let own = match quotas.for_tenant(asked) {
        Ok(q) => q,
        Err(e) => return Some(Binding::Problem(reasons::INVALID_SPEC, e)),
    };
    let ns = t.namespace();
    let committed: i64 = ds
        .status
        .iter()
        .flat_map(|s| &s.tenants)
        .filter(|o| !(o.namespace == ns && o.name == t.ncp.name_any()))
        .map(|o| o.quota_bytes.unwrap_or(quotas.tenant_default))
        .fold(0, i64::saturating_add);
    (committed.saturating_add(own) > quotas.capacity()).then(|| {
        Binding::Problem(
            DATASTORE_FULL,
            format!(
                "NestedDatastore {ds_ns}/{ds_name} cannot take a quota of {own} bytes: its tenants' quotas hold {committed} of the {} bytes they may hold together (three quarters of its quota.backend)",
                quotas.capacity()
            ),
        )
    })
}

/// The datastore's CA as the tenant's etcd CA (certificate only) and a client certificate
/// for the tenant's etcd user.
async fn issue_credentials(ctx: &Context, t: &Tenant, a: &Access, user: &str) -> Result<(), Error> {
    let secrets = ClusterSecrets::new(
        ctx.client.clone(),
        &t.namespace(),
        &t.cluster(),
        t.owner(),
        ctx.clock.clone(),
    )
    .with_cache(ctx.caches.secrets.get().cloned());
    secrets.trust(SecretPurpose::EtcdCa, &a.ca.cert_pem).await?;
    secrets
        .leaf(
            &Leaf {
                purpose: SecretPurpose::ApiServerEtcdClient,
                ca: SecretPurpose::EtcdCa,
                spec: LeafSpec {
                    common_name: user.to_string(),
                    usage: Usage::Client,
                    ..LeafSpec::default()
                },
            },
            &a.ca,
        )
        .await?;
    Ok(())
}

/// Each tenant's quota: what it holds, raised only while the datastore can take it. Pure.
fn granted_quotas(
    ds: &NestedDatastore,
    quotas: &Quotas,
    ncps: &[Arc<NestedControlPlane>],
    tenants: &[DatastoreTenant],
) -> Vec<i64> {
    let held = |t: &DatastoreTenant| {
        ds.status
            .iter()
            .flat_map(|s| &s.tenants)
            .find(|p| p.namespace == t.namespace && p.name == t.name)
            .and_then(|p| p.quota_bytes)
    };
    let mut granted: Vec<i64> = tenants
        .iter()
        .map(|t| held(t).unwrap_or(quotas.tenant_default))
        .collect();
    for (i, t) in tenants.iter().enumerate() {
        let asked = ncps
            .iter()
            .find(|n| n.namespace().as_deref() == Some(&t.namespace) && n.name_any() == t.name)
            .and_then(|n| n.spec.datastore_ref.as_ref())
            .and_then(|r| r.quota.as_ref());
        let others = granted
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .fold(0i64, |sum, (_, q)| sum.saturating_add(*q));
        granted[i] = granted_quota(quotas, asked, held(t), others);
    }
    granted
}

/// A tenant became read-only at its quota, or writable again: said in the log and in Events
/// on its control plane and on the datastore.
async fn quota_changed(
    ctx: &Context,
    ds: &NestedDatastore,
    ncp: &NestedControlPlane,
    t: &DatastoreTenant,
    usage: &etcd::Usage,
    quota: i64,
    read_only: bool,
) {
    let (kind, reason, note) = if read_only {
        (
            EventType::Warning,
            QUOTA_EXCEEDED,
            format!(
                "the tenant stores {} bytes in {} keys, at its quota of {quota} bytes: its API server refuses writes until it stores less than {} bytes; reads keep working",
                usage.bytes,
                usage.keys,
                nestplane_api::datastore::quota_floor(quota)
            ),
        )
    } else {
        (
            EventType::Normal,
            WITHIN_QUOTA,
            format!(
                "the tenant stores {} bytes, under its quota of {quota} bytes: it may write again",
                usage.bytes
            ),
        )
    };
    tracing::info!(namespace = %t.namespace, cluster = %t.name, bytes = usage.bytes, quota, read_only, "tenant quota state changed");
    ctx.event(ncp.object_ref(&()), kind, reason, &note).await;
    ctx.event(
        ds.object_ref(&()),
        kind,
        reason,
        &format!("{}/{}: {note}", t.namespace, t.name),
    )
    .await;
}

/// The `DatastoreQuota` condition of a control plane on a shared datastore: whether it may
/// write, from its datastore's status. `None` for a control plane on no datastore.
pub async fn quota_condition(
    ctx: &Context,
    ncp: &NestedControlPlane,
) -> Result<Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>, Error> {
    let Some((ds_ns, ds_name)) = referenced(ncp) else {
        return Ok(None);
    };
    if ncp
        .status
        .as_ref()
        .and_then(|s| s.datastore.as_ref())
        .is_none()
    {
        return Ok(None);
    }
    let Some(ds) = get(ctx, &ds_ns, &ds_name).await? else {
        return Ok(None);
    };
    let ns = ncp.namespace().unwrap_or_default();
    let Some(t) = ds
        .status
        .iter()
        .flat_map(|s| &s.tenants)
        .find(|t| t.namespace == ns && t.name == ncp.name_any())
    else {
        return Ok(None);
    };
    let Some(quota) = t.quota_bytes else {
        return Ok(None);
    };
    let asked = ncp
        .spec
        .datastore_ref
        .as_ref()
        .and_then(|r| r.quota.as_ref());
    let unmet = match Quotas::of(&ds.spec).map(|q| q.for_tenant(asked)) {
        Ok(Err(e)) => format!(" ({e}; the quota it held stays)"),
        Ok(Ok(want)) if want > quota => format!(
            " (spec.datastoreRef.quota asks for {want} bytes, more than the datastore can take besides its other tenants' quotas)"
        ),
        _ => String::new(),
    };
    Ok(Some(if t.read_only {
        conditions::new(
            QUOTA_CONDITION,
            false,
            QUOTA_EXCEEDED,
            format!(
                "the tenant stores its quota of {quota} bytes on NestedDatastore {ds_ns}/{ds_name}{unmet}: its API server refuses writes until it stores less than {} bytes; reads keep working; raise spec.datastoreRef.quota to write again",
                nestplane_api::datastore::quota_floor(quota)
            ),
        )
    } else {
        conditions::new(
            QUOTA_CONDITION,
            true,
            reasons::AS_EXPECTED,
            format!("under its quota of {quota} bytes on NestedDatastore {ds_ns}/{ds_name}{unmet}"),
        )
    }))
}

/// What a control plane's pass learns from its datastore.
pub enum Binding {
    /// The tenant's user, role and credentials are in place.
    Bound(TenantDatastoreStatus),
    /// Not yet (the datastore is starting): a message for the tenant's status.
    Waiting(String),
    /// Something a person must fix: a reason and a message.
    Problem(&'static str, String),
}

/// The reason of a control plane refused by its datastore's `allowedNamespaces`.
pub const NOT_ALLOWED: &str = "NotAllowed";

/// Whether `ds` lets control planes of namespace `ns` use it: its own namespace always, else
/// by `spec.allowedNamespaces` (names, or a selector on the namespace's labels).
pub async fn allowed(ctx: &Context, ds: &NestedDatastore, ns: &str) -> Result<bool, Error> {
    if ds.namespace().as_deref() == Some(ns) {
        return Ok(true);
    }
    let Some(a) = &ds.spec.allowed_namespaces else {
        return Ok(false);
    };
    if a.names.iter().any(|n| n == ns) {
        return Ok(true);
    }
    let Some(selector) = &a.selector else {
        return Ok(false);
    };
    let namespace = Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
        .get_opt(ns)
        .await?;
    Ok(namespace.is_some_and(|n| crate::postcreate::plan::selects(selector, &n.labels().clone())))
}

/// Make sure tenant `t` has its user, role and prefix in its datastore and the credentials
/// for them: the datastore's CA certificate as `<cluster>-etcd` (no key) and a client
/// certificate of its user as `<cluster>-apiserver-etcd-client`.
pub async fn bind(ctx: &Context, t: &Tenant) -> Result<Binding, Error> {
    let Some((ds_ns, ds_name)) = referenced(&t.ncp) else {
        let msg = match t.datastore() {
            Some(b) => format!(
                "spec.datastoreRef was removed, but the tenant's data is on NestedDatastore {}/{}: it keeps running there (a move to an etcd of its own is not built yet); set spec.datastoreRef back",
                b.namespace, b.name
            ),
            None => "no datastore referenced".into(),
        };
        return Ok(Binding::Problem(reasons::INVALID_SPEC, msg));
    };
    if let Some(etcd) = t.etcd.found() {
        return Ok(Binding::Problem(
            reasons::INVALID_SPEC,
            format!(
                "this control plane has an etcd of its own (NestedEtcd {}); a datastore can only be chosen when a control plane is created",
                etcd.name_any()
            ),
        ));
    }
    // Another datastore than the one the data is in: the data moves there ([`migrate`]);
    // until the cut-over the tenant stays bound where it is.
    if let Some(b) = t
        .datastore()
        .filter(|b| b.name != ds_name || b.namespace != ds_ns)
    {
        return Ok(Binding::Bound(b.clone()));
    }
    let Some(ds) = get(ctx, &ds_ns, &ds_name).await? else {
        return Ok(Binding::Problem(
            reasons::REFERENCE_NOT_FOUND,
            format!("NestedDatastore {ds_ns}/{ds_name} not found"),
        ));
    };
    let ns = t.namespace();
    if !allowed(ctx, &ds, &ns).await? {
        let msg = format!(
            "NestedDatastore {ds_ns}/{ds_name} does not allow control planes of namespace {ns} (its spec.allowedNamespaces); nothing is issued, and nothing stored is deleted"
        );
        ctx.event(
            ds.object_ref(&()),
            EventType::Warning,
            NOT_ALLOWED,
            &format!(
                "NestedControlPlane {ns}/{} refused: {msg}",
                t.ncp.name_any()
            ),
        )
        .await;
        return Ok(Binding::Problem(NOT_ALLOWED, msg));
    }
    let bound = t.datastore();
    if ds.metadata.deletion_timestamp.is_some() && bound.is_none() {
        return Ok(Binding::Waiting(format!(
            "NestedDatastore {ds_ns}/{ds_name} is being deleted"
        )));
    }
    if bound.is_none()
        && let Some(refused) = admission(&ds, t)
    {
        return Ok(refused);
    }
    let ready = ds.status.as_ref().is_some_and(|s| s.ready);
    if !ready
        && bound.is_none()
        && let Some(c) = ds
            .status
            .as_ref()
            .and_then(|s| conditions::get(&s.conditions, types::READY))
            .filter(|c| c.reason == OUTDATED_ETCD)
    {
        return Ok(Binding::Problem(
            OUTDATED_ETCD,
            format!("NestedDatastore {ds_ns}/{ds_name}: {}", c.message),
        ));
    }
    let a = match access(ctx, &ds, false).await? {
        Ok(a) if ready || bound.is_some() => a,
        Ok(_) | Err(_) => {
            return Ok(Binding::Waiting(format!(
                "waiting for NestedDatastore {ds_ns}/{ds_name} to be Ready"
            )));
        }
    };
    let cluster = t.cluster();
    let want = TenantDatastoreStatus {
        name: ds_name,
        namespace: ds_ns,
        user: tenant_user(&ns, &cluster),
        prefix: tenant_prefix(&ns, &cluster),
        endpoints: a.endpoints.clone(),
    };
    let mut admin = etcd::Admin::connect(&a.endpoints, &a.creds).await?;
    admin.ensure_tenant(&want.user, &want.prefix).await?;
    issue_credentials(ctx, t, &a, &want.user).await?;
    Ok(Binding::Bound(want))
}

/// A deleted tenant leaves its datastores: its keys, user and role are deleted from the one
/// it is bound to, and from those a move copied to or from. A datastore that no longer
/// exists is said in an Event (its keys cannot be reached).
pub async fn unbind(ctx: &Context, ncp: &NestedControlPlane) -> Result<(), Error> {
    ctx.migrations.stop(&crate::context::object_key(ncp));
    // Only a tenant that was bound has keys there; what is deleted is computed from the
    // control plane's namespace and name, never read from its status.
    let Some(status) = ncp.status.as_ref() else {
        return Ok(());
    };
    let Some(bound) = status.datastore.as_ref() else {
        return Ok(());
    };
    let mut from: Vec<(String, String)> = referenced(ncp).into_iter().collect();
    from.push((bound.namespace.clone(), bound.name.clone()));
    for held in status.migration.iter().flat_map(migrate::holding) {
        if let Some((ns, name)) = held.split_once('/') {
            from.push((ns.to_string(), name.to_string()));
        }
    }
    from.sort();
    from.dedup();
    for (ds_ns, ds_name) in from {
        leave(ctx, ncp, &ds_ns, &ds_name).await?;
    }
    Ok(())
}

async fn leave(
    ctx: &Context,
    ncp: &NestedControlPlane,
    ds_ns: &str,
    ds_name: &str,
) -> Result<(), Error> {
    let ns = ncp.namespace().unwrap_or_default();
    let cluster = crate::tenant::cluster_name(ncp);
    if names::dns_label_problem(&cluster, names::MAX_CLUSTER_NAME_LEN).is_some() {
        return Ok(());
    }
    let (user, prefix) = (tenant_user(&ns, &cluster), tenant_prefix(&ns, &cluster));
    let Some(ds) = get(ctx, ds_ns, ds_name).await? else {
        ctx.event(
            ncp.object_ref(&()),
            EventType::Warning,
            reasons::REFERENCE_NOT_FOUND,
            &format!(
                "NestedDatastore {ds_ns}/{ds_name} is gone: the tenant's keys under {prefix} could not be deleted"
            ),
        )
        .await;
        return Ok(());
    };
    let a = match access(ctx, &ds, true).await? {
        Ok(a) => a,
        Err((_, m)) => return Err(Error::Unavailable(format!("datastore not reachable: {m}"))),
    };
    let mut admin = etcd::Admin::connect(&a.endpoints, &a.creds).await?;
    let deleted = admin.remove_tenant(&user, &prefix).await?;
    // And the key a move raised the revisions with, if one did.
    admin.remove_key(&migrate::bump_key(&ns, &cluster)).await?;
    ctx.metrics.forget_datastore_usage(&ns, &ncp.name_any());
    tracing::info!(
        namespace = %ns,
        cluster = %ncp.name_any(),
        datastore = %format!("{ds_ns}/{ds_name}"),
        keys = deleted,
        "tenant removed from a datastore"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    #[test]
    fn a_tenant_keeps_its_quota_unless_a_new_one_fits() {
        let q = Quotas {
            tenant_default: 100,
            tenant_max: 400,
            backend: 1000,
        };
        let ask = |s: &str| Quantity(s.into());
        // Nothing asked: the default, for a new tenant and one that held more.
        assert_eq!(granted_quota(&q, None, None, 0), 100);
        // Less than held: always.
        assert_eq!(granted_quota(&q, Some(&ask("50")), Some(300), 700), 50);
        // More: only while the others' quotas leave room (capacity 750).
        assert_eq!(granted_quota(&q, Some(&ask("300")), Some(100), 450), 300);
        assert_eq!(granted_quota(&q, Some(&ask("300")), Some(100), 451), 100);
        // Above tenantMax, or unreadable: what it held stays.
        assert_eq!(granted_quota(&q, Some(&ask("500")), Some(200), 0), 200);
        assert_eq!(granted_quota(&q, Some(&ask("junk")), Some(200), 0), 200);
        // Sums that would overflow do not.
        assert_eq!(
            granted_quota(&q, Some(&ask("300")), Some(100), i64::MAX),
            100
        );
    }
}
