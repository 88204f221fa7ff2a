//! `nestplane rotate`: ask for a rotation of a key or a CA, or its completion, on a hosted
//! cluster or a control plane, and wait until the operator has carried it out. A thin client:
//! it writes the annotation a user could write (`nestplane.io/rotate-sa-key`,
//! `nestplane.io/rotate-ca`, `nestplane.io/rotate-front-proxy-ca`, `…-complete`) and reads the control plane's `status.rotations`.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use kube::api::{Api, Patch, PatchParams};
use nestplane_api::hosted::HostedCluster;
use nestplane_api::{NestedControlPlane, RotationStatus};
use nestplane_operator::rotation::Target as Rotated;

use crate::tenants::Target;

/// What to rotate.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    /// The service-account signing key.
    SaKey,
    /// The cluster CA (client certificates, kubeconfigs, the API server's serving
    /// certificate).
    Ca,
    /// The front-proxy CA (the API server's client certificate to aggregated API servers;
    /// what request headers naming a user are trusted from).
    FrontProxyCa,
}

impl What {
    fn target(self) -> Rotated {
        match self {
            What::SaKey => Rotated::SaKey,
            What::Ca => Rotated::Ca,
            What::FrontProxyCa => Rotated::FrontProxyCa,
        }
    }

    fn what(self) -> &'static str {
        match self {
            What::SaKey => "service-account key",
            What::Ca => "cluster CA",
            What::FrontProxyCa => "front-proxy CA",
        }
    }
}

/// Arguments of `nestplane rotate`.
#[derive(Args, Debug)]
pub struct RotateArgs {
    /// What to rotate.
    #[arg(value_enum)]
    pub what: What,
    /// The cluster's name (a HostedCluster's, or a NestedControlPlane's).
    pub name: String,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Complete the rotation that was started: the old key or CA is no longer trusted (tokens
    /// or certificates it signed are refused from then on).
    #[arg(long)]
    pub complete: bool,
    /// With a new rotation: complete it by itself this long after it reached `Started`
    /// (`24h`, `2d`, …; pods' projected tokens are refreshed by their kubelets within 24 h).
    #[arg(long, value_name = "DURATION")]
    pub complete_after: Option<String>,
    /// Return once asked, without waiting.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (the rotation goes on).
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    #[command(flatten)]
    pub target: Target,
}

fn rotation(ncp: &NestedControlPlane, target: Rotated) -> Option<RotationStatus> {
    ncp.status
        .as_ref()?
        .rotations
        .iter()
        .find(|r| r.target == target.as_str())
        .cloned()
}

/// `nestplane rotate`.
pub async fn rotate(args: RotateArgs) -> anyhow::Result<()> {
    let (target, what) = (args.what.target(), args.what.what());
    let cmd = target.as_str();
    let client = args.target.client().await?;
    let (ns, name) = (&args.namespace, &args.name);
    let located = crate::tenants::locate(&client, ns, name).await?;
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), &located.ncp.0);
    let ncp = ncps
        .get_opt(&located.ncp.1)
        .await?
        .with_context(|| format!("{} {ns}/{name} has no control plane yet", located.kind))?;
    let current = rotation(&ncp, target);
    let mut fresh = false;
    let (annotation, id, until) = if args.complete {
        let Some(r) = current.filter(|r| r.phase == "Started" || r.phase == "Completing") else {
            bail!(
                "no {what} rotation of {ns}/{name} waits to be completed (`nestplane rotate {cmd} {name}` starts one; it must reach phase Started first)"
            );
        };
        (target.complete_annotation(), r.id, "Completed")
    } else {
        match current.filter(|r| r.phase != "Completed") {
            Some(r) => {
                eprintln!(
                    "a {what} rotation of {ns}/{name} is in progress ({:?}, phase {}); waiting for it",
                    r.id, r.phase
                );
                (target.start_annotation(), r.id, "Started")
            }
            None => {
                fresh = true;
                (
                    target.start_annotation(),
                    k8s_openapi::jiff::Timestamp::now()
                        .round(k8s_openapi::jiff::Unit::Second)
                        .map(|t| t.to_string())
                        .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now().to_string()),
                    "Started",
                )
            }
        }
    };
    let mut annotations = serde_json::json!({ annotation: id });
    if let Some(after) = &args.complete_after {
        if args.complete {
            bail!("--complete-after is for a new rotation; --complete completes now");
        }
        if until != "Started" || !fresh {
            bail!(
                "a rotation of {ns}/{name} is in progress; --complete-after is for a new one (`--complete` completes this one now)"
            );
        }
        if nestplane_operator::rotation::parse_duration(after).is_none() {
            bail!("--complete-after {after:?} is not a duration like 90s, 30m, 24h or 2d");
        }
    }
    // A new rotation completes by itself only when this one asks it to (a delay asked for an
    // earlier rotation does not stick).
    if fresh {
        annotations[target.complete_after_annotation()] = args.complete_after.clone().into();
    }
    let patch = serde_json::json!({"metadata": {"annotations": annotations}});
    let pp = PatchParams::default();
    if located.kind == "HostedCluster" {
        let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), ns);
        hcs.patch(name, &pp, &Patch::Merge(&patch)).await?;
    } else {
        ncps.patch(name, &pp, &Patch::Merge(&patch)).await?;
    }
    eprintln!("{} {ns}/{name}: {annotation}={id}", located.kind);
    if args.no_wait {
        return Ok(());
    }
    let asked = Instant::now();
    let deadline = asked + Duration::from_secs(args.timeout);
    let mut said = None;
    loop {
        let ncp = ncps.get(&located.ncp.1).await?;
        if let Some(r) = rotation(&ncp, target).filter(|r| r.id == id) {
            let line = format!(
                "{}{}",
                r.phase,
                r.message
                    .as_deref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            );
            if said.as_ref() != Some(&line) {
                // Seconds since it was asked for, as seen here: when each step began.
                eprintln!("[{:>3} s] {line}", asked.elapsed().as_secs());
                said = Some(line);
            }
            if r.phase == until || r.phase == "Completed" {
                println!(
                    "{}/{name}: {what} rotation {id} {}; {} {}",
                    ns,
                    r.phase,
                    target_noun(target),
                    r.key_id.unwrap_or_default()
                );
                return Ok(());
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "the rotation did not reach {until} within {} s (it goes on; `kubectl get ncp -n {} {} -o jsonpath='{{.status.rotations}}'`)",
                args.timeout,
                located.ncp.0,
                located.ncp.1
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn target_noun(target: Rotated) -> &'static str {
    match target {
        Rotated::SaKey => "key",
        Rotated::Ca | Rotated::FrontProxyCa => "CA",
    }
}
