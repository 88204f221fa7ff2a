//! The Cluster API bootstrap provider (`NestplaneConfig`): for the Machine that references a
//! config, a short-lived bootstrap token in the Machine's cluster and the bootstrap data
//! Secret ([`data::script`]), which runs `nestplane node join` on the machine. The machine
//! comes in through the tenant's door behind the gateway ([`nestplane_nodes::entry`]): it
//! is dialled by nobody. Its kubelet's certificates are approved here (the client certificate
//! for the token made for it, the serving certificate for its own name and address), and the
//! token is deleted once its Node has registered.
//!
//! The cluster: the `NestedControlPlane` of the Machine's `spec.clusterName` (owned by that
//! Cluster, or so named), once it is Ready and reached through the operator's gateway.

pub mod data;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::bootstrap::{
    BootstrapInitialization, GROUP, NestplaneConfig, NestplaneConfigStatus, reasons,
};
use nestplane_api::conditions;
use nestplane_api::names::{self, SecretPurpose};
use nestplane_nodes::join::{self, BootstrapToken};

use crate::context::{Context, Error};
use crate::hosted::pool::csr;
use crate::hosted::pool::machines::Machine as Made;
use crate::hosted::target;
use crate::tenant;

const MANAGER: &str = "nestplane-bootstrap";
/// How often a config whose machine has not joined (or whose Node is not Ready yet: its
/// serving certificate waits for approval) is looked at.
const JOINING: Duration = Duration::from_secs(3);
/// How often one that waits for something else is.
const WAITING: Duration = Duration::from_secs(10);
/// How often one whose node runs is (its kubelet's certificate renewals are approved).
const JOINED: Duration = Duration::from_secs(60);

/// The Machine that references a config, as far as the provider reads it.
#[derive(Clone, Debug)]
struct MachineView {
    name: String,
    cluster: String,
    version: Option<String>,
    paused: bool,
}

fn machines_resource(version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(names::CLUSTER_API_GROUP, version, "Machine"),
        "machines",
    )
}

/// Whether `m` references the config `name` (v1beta2 `apiGroup`, v1beta1 `apiVersion`).
fn references(m: &DynamicObject, name: &str) -> bool {
    let r = &m.data["spec"]["bootstrap"]["configRef"];
    let group = r["apiGroup"]
        .as_str()
        .map(str::to_string)
        .or_else(|| {
            r["apiVersion"]
                .as_str()
                .and_then(|v| v.split('/').next())
                .map(str::to_string)
        })
        .unwrap_or_default();
    group == GROUP && r["kind"] == "NestplaneConfig" && r["name"] == name
}

/// The Machine of `cfg`: its controlling owner of kind Machine, else the Machine in its
/// namespace whose `configRef` names it. `None` when Cluster API's Machines are not served
/// or none references it.
async fn machine_of(ctx: &Context, cfg: &NestplaneConfig) -> Result<Option<MachineView>, Error> {
    let ns = cfg.namespace().unwrap_or_default();
    let name = cfg.name_any();
    for version in ["v1beta2", "v1beta1"] {
        let api: Api<DynamicObject> =
            Api::namespaced_with(ctx.client.clone(), &ns, &machines_resource(version));
        let listed = match api.list(&Default::default()).await {
            Ok(l) => l.items,
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(e) => return Err(e.into()),
        };
        let owner = cfg
            .owner_references()
            .iter()
            .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
            .map(|o| o.uid.clone());
        let found = listed
            .into_iter()
            .find(|m| owner.as_deref() == m.metadata.uid.as_deref() || references(m, &name));
        return Ok(found.map(|m| MachineView {
            name: m.name_any(),
            cluster: m.data["spec"]["clusterName"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            version: m.data["spec"]["version"].as_str().map(str::to_string),
            paused: m.annotations().contains_key(names::PAUSED_ANNOTATION),
        }));
    }
    Ok(None)
}

/// The control plane of the cluster `cluster` in `ns`: owned by that Cluster, else named so
/// and owned by no Cluster.
async fn control_plane_of(
    ctx: &Context,
    ns: &str,
    cluster: &str,
) -> Result<Option<NestedControlPlane>, Error> {
    let all = Api::<NestedControlPlane>::namespaced(ctx.client.clone(), ns)
        .list(&Default::default())
        .await?
        .items;
    let owned = all
        .iter()
        .find(|n| tenant::owning_cluster(n).as_deref() == Some(cluster));
    Ok(owned
        .or_else(|| {
            all.iter()
                .find(|n| n.name_any() == cluster && tenant::owning_cluster(n).is_none())
        })
        .cloned())
}

/// The config's status with `cond` set.
fn with_condition(
    cfg: &NestplaneConfig,
    mut status: NestplaneConfigStatus,
    cond: k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition,
) -> NestplaneConfigStatus {
    conditions::set(
        &mut status.conditions,
        cond,
        cfg.metadata.generation,
        k8s_openapi::jiff::Timestamp::now(),
    );
    status.observed_generation = cfg.metadata.generation;
    status
}

async fn write_status(
    ctx: &Context,
    cfg: &NestplaneConfig,
    status: NestplaneConfigStatus,
) -> Result<(), Error> {
    if cfg.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<NestplaneConfig> =
        Api::namespaced(ctx.client.clone(), &cfg.namespace().unwrap_or_default());
    let body = serde_json::to_value(&status).map_err(|e| Error::Internal(e.to_string()))?;
    api.patch_status(
        &cfg.name_any(),
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": body })),
    )
    .await?;
    Ok(())
}

/// Say why the config waits (a condition, and an Event when the reason is new).
async fn wait(
    ctx: &Context,
    cfg: &NestplaneConfig,
    type_: &str,
    reason: &str,
    message: String,
    warning: bool,
) -> Result<Action, Error> {
    let before = cfg
        .status
        .as_ref()
        .and_then(|s| conditions::get(&s.conditions, type_))
        .map(|c| c.reason.clone());
    let status = with_condition(
        cfg,
        cfg.status.clone().unwrap_or_default(),
        conditions::new(type_, false, reason, message.clone()),
    );
    write_status(ctx, cfg, status).await?;
    if before.as_deref() != Some(reason) {
        let kind = if warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        ctx.event(cfg.object_ref(&()), kind, reason, &message).await;
    }
    Ok(Action::requeue(WAITING))
}

/// One pass over a config.
pub async fn reconcile(cfg: Arc<NestplaneConfig>, ctx: Arc<Context>) -> Result<Action, Error> {
    if cfg.metadata.deletion_timestamp.is_some() {
        // Its data Secret goes with it (owned); its token expires.
        return Ok(Action::await_change());
    }
    let ns = cfg.namespace().unwrap_or_default();
    if let Err(why) = data::validate(&cfg.spec) {
        return wait(&ctx, &cfg, "Ready", reasons::INVALID_SPEC, why, true).await;
    }
    let Some(machine) = machine_of(&ctx, &cfg).await? else {
        return wait(
            &ctx,
            &cfg,
            "Ready",
            reasons::WAITING_FOR_MACHINE,
            "no Machine references this NestplaneConfig (spec.bootstrap.configRef)".into(),
            false,
        )
        .await;
    };
    let paused = machine.paused || cfg.annotations().contains_key(names::PAUSED_ANNOTATION);
    let status = with_condition(
        &cfg,
        cfg.status.clone().unwrap_or_default(),
        conditions::new(
            "Paused",
            paused,
            if paused { "Paused" } else { "NotPaused" },
            if paused {
                "paused: the Machine or the config carries cluster.x-k8s.io/paused"
            } else {
                "not paused"
            },
        ),
    );
    if paused {
        write_status(&ctx, &cfg, status).await?;
        return Ok(Action::requeue(WAITING));
    }
    let cfg_now = NestplaneConfig {
        status: Some(status),
        ..(*cfg).clone()
    };
    let cfg = &cfg_now;
    let Some(ncp) = control_plane_of(&ctx, &ns, &machine.cluster).await? else {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::WAITING_FOR_CONTROL_PLANE,
            format!(
                "cluster {:?} has no NestedControlPlane in namespace {ns}",
                machine.cluster
            ),
            false,
        )
        .await;
    };
    let ncp_status = ncp.status.clone().unwrap_or_default();
    let Some(gateway) = ncp_status.gateway.clone() else {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::WAITING_FOR_CONTROL_PLANE,
            format!(
                "control plane {} has no gateway address (status.gateway): machines of other hosts come in through the operator's gateway (--gateway-bind-address)",
                ncp.name_any()
            ),
            false,
        )
        .await;
    };
    if !ncp_status.ready {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::WAITING_FOR_CONTROL_PLANE,
            format!("control plane {} is not Ready yet", ncp.name_any()),
            false,
        )
        .await;
    }
    let cluster = tenant::cluster_name(&ncp);
    let kubeconfig = SecretPurpose::AdminKubeconfig.secret_name(&cluster);
    let ca_secret = SecretPurpose::ClusterCa.secret_name(&cluster);
    let (Some(client), Some(ca_bundle)) = (
        target::admin_client(&ctx, &ns, &kubeconfig).await?,
        target::secret_value(&ctx, &ns, &ca_secret, names::TLS_CRT).await?,
    ) else {
        return wait(
            &ctx,
            cfg,
            "Ready",
            reasons::WAITING_FOR_CONTROL_PLANE,
            format!(
                "control plane {} has no admin kubeconfig or CA yet",
                ncp.name_any()
            ),
            false,
        )
        .await;
    };
    let ca_pem = nestplane_pki::first_certificate(&ca_bundle)?;
    let version = machine
        .version
        .clone()
        .or_else(|| ncp_status.version.clone())
        .or_else(|| ncp.spec.version.clone())
        .unwrap_or_default();
    let node_name = machine.name.clone();
    let mut status = cfg.status.clone().unwrap_or_default();

    // The Node: once it has registered, its token goes.
    let node = Api::<Node>::all(client.clone())
        .get_opt(&node_name)
        .await
        .map_err(|e| Error::Unavailable(format!("cluster {cluster}: {e}")))?;
    let token_id = status.token_id.clone();
    if let Some(node) = &node {
        let ip = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
            .and_then(|a| a.address.parse().ok());
        let made = Made {
            name: node_name.clone(),
            token_id: token_id.clone().unwrap_or_default(),
            hash: String::new(),
            version: version.clone(),
            ip,
            token_deleted: status.token_deleted,
        };
        let owner = format!("NestplaneConfig {ns}/{}", cfg.name_any());
        csr::approve(&client, &owner, "NestplaneConfig", &[made]).await;
        if !status.token_deleted {
            if let Some(id) = &token_id {
                join::delete_token(&client, id)
                    .await
                    .map_err(|e| Error::Unavailable(e.to_string()))?;
            }
            status.token_deleted = true;
            status.node_name = Some(node_name.clone());
            ctx.event(
                cfg.object_ref(&()),
                EventType::Normal,
                reasons::NODE_JOINED,
                &format!(
                    "machine {} joined cluster {cluster} as node {node_name}; its bootstrap token is deleted",
                    machine.name
                ),
            )
            .await;
        }
        let status = with_condition(
            cfg,
            status,
            conditions::new(
                "Joined",
                true,
                reasons::NODE_JOINED,
                format!("node {node_name} registered; its bootstrap token is deleted"),
            ),
        );
        write_status(&ctx, cfg, status).await?;
        let ready = node
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        return Ok(Action::requeue(if ready { JOINED } else { JOINING }));
    }

    // Not joined: the data Secret with a live token.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let secret_name = cfg.name_any();
    let expired = status.token_expires.as_deref().is_some_and(|t| {
        t.parse::<k8s_openapi::jiff::Timestamp>()
            .is_ok_and(|t| t <= k8s_openapi::jiff::Timestamp::now())
    });
    let have = secrets.get_opt(&secret_name).await?.is_some() && token_id.is_some();
    if !have || expired {
        let ttl = data::token_ttl(&cfg.spec).map_err(Error::Internal)?;
        let token = BootstrapToken::generate();
        join::ensure_bindings(&client, false)
            .await
            .map_err(|e| Error::Unavailable(e.to_string()))?;
        join::create_token(&client, &token, Duration::from_secs(ttl.into()))
            .await
            .map_err(|e| Error::Unavailable(e.to_string()))?;
        let expires = (k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_secs(ttl.into()))
        .to_string();
        let script = data::script(
            &data::Join {
                server: gateway.server.trim_start_matches("https://").to_string(),
                server_name: gateway.server_name.clone(),
                token: token.token(),
                ca_cert_hash: nestplane_pki::public_key_hash(&ca_pem)?,
                version: version.clone(),
                node_name: node_name.clone(),
                api_port: ncp
                    .spec
                    .control_plane_endpoint
                    .as_ref()
                    .map(|e| e.port as u16)
                    .unwrap_or(names::ports::APISERVER as u16),
                expires: expires.clone(),
                machine: format!("{ns}/{}", machine.name),
            },
            &cfg.spec,
        );
        let mut owner = cfg.controller_owner_ref(&()).unwrap_or_default();
        owner.block_owner_deletion = Some(true);
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(secret_name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(
                    [
                        (
                            names::CLUSTER_NAME_LABEL.to_string(),
                            machine.cluster.clone(),
                        ),
                        (
                            names::MANAGED_BY_LABEL.to_string(),
                            names::MANAGED_BY.to_string(),
                        ),
                    ]
                    .into(),
                ),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            type_: Some(names::CAPI_SECRET_TYPE.into()),
            string_data: Some(
                [
                    ("value".to_string(), script),
                    ("format".to_string(), "cloud-config".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let mut body = serde_json::to_value(&secret).map_err(|e| Error::Internal(e.to_string()))?;
        body["apiVersion"] = "v1".into();
        body["kind"] = "Secret".into();
        secrets
            .patch(
                &secret_name,
                &PatchParams::apply(MANAGER).force(),
                &Patch::Apply(body),
            )
            .await?;
        if expired && let Some(old) = &token_id {
            // Gone by itself already (the cluster's token cleaner); made sure of.
            let _ = join::delete_token(&client, old).await;
        }
        let (reason, note) = if expired {
            (
                reasons::TOKEN_REFRESHED,
                format!(
                    "the bootstrap token expired before machine {} joined: a new one (until {expires}) is in Secret {secret_name}",
                    machine.name
                ),
            )
        } else {
            (
                reasons::DATA_SECRET_AVAILABLE,
                format!(
                    "bootstrap data for machine {} is in Secret {secret_name}; its token expires at {expires}",
                    machine.name
                ),
            )
        };
        ctx.event(cfg.object_ref(&()), EventType::Normal, reason, &note)
            .await;
        status.token_id = Some(token.id.clone());
        status.token_expires = Some(expires);
        status.token_deleted = false;
    }
    status.ready = true;
    status.data_secret_name = Some(secret_name.clone());
    status.initialization = Some(BootstrapInitialization {
        data_secret_created: Some(true),
    });
    let status = with_condition(
        cfg,
        status,
        conditions::new(
            "Ready",
            true,
            reasons::DATA_SECRET_AVAILABLE,
            format!("bootstrap data is in Secret {secret_name}"),
        ),
    );
    let status = with_condition(
        cfg,
        status,
        conditions::new(
            "Joined",
            false,
            reasons::WAITING_FOR_NODE,
            format!(
                "waiting for machine {} to register node {node_name}",
                machine.name
            ),
        ),
    );
    // The client certificate of the machine's kubelet, asked for with the token made for it.
    if let Some(id) = &status.token_id {
        let made = Made {
            name: node_name.clone(),
            token_id: id.clone(),
            hash: String::new(),
            version,
            ip: None,
            token_deleted: false,
        };
        let owner = format!("NestplaneConfig {ns}/{}", cfg.name_any());
        csr::approve(&client, &owner, "NestplaneConfig", &[made]).await;
    }
    write_status(&ctx, cfg, status).await?;
    Ok(Action::requeue(JOINING))
}
