//! `nestplane backup create|list|restore|schedule`: thin clients of `NestedBackup`,
//! `NestedRestore` and `NestedBackupSchedule` objects. `create` makes a backup and waits for the operator to take it;
//! its last line is the archive's own URL. `restore` makes a restore and waits until the
//! control plane holds the archive's keys and is ready again. What they do is visible, and
//! repeatable, with `kubectl get nestedbackups,nestedrestores`.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use nestplane_api::NestedControlPlane;
use nestplane_api::backup::{
    LocalRef, NestedBackup, NestedBackupSpec, RESTORE_HOLD_ANNOTATION, phases, types,
};
use nestplane_api::conditions;
use nestplane_operator::context::WATCH_FILTER_LABEL;
use serde::Serialize;

use crate::tenants::{Format, Target, age, age_of, aligned, locate};

/// `nestplane backup`.
#[derive(Args, Debug)]
pub struct BackupArgs {
    #[command(subcommand)]
    pub command: BackupCommand,
}

/// What `nestplane backup` does.
#[derive(Subcommand, Debug)]
pub enum BackupCommand {
    /// Back up a hosted cluster's (or a control plane's) keys: make a NestedBackup and wait
    /// for it. The last line printed is the archive's URL.
    Create(CreateArgs),
    /// List backups: name, cluster, phase, keys, size, revision, age, URL (`-o json|yaml`
    /// too).
    List(ListArgs),
    /// Restore a hosted cluster's (or a control plane's) keys from an archive: its API
    /// server, controller manager and scheduler stop, its keys become the archive's, and
    /// they start again; with `--as NEW`, into a new control plane (a clone, with the
    /// archive's CA and service-account key). Makes a NestedRestore and waits.
    Restore(RestoreArgs),
    /// Back up a hosted cluster (or a control plane) every period, keeping the newest
    /// completed backups: make or change its NestedBackupSchedule (named after the cluster
    /// unless `--name`), and say what the operator made of it.
    Schedule(ScheduleArgs),
}

/// How to reach an `s3://` location.
#[derive(Args, Debug, Default, Clone)]
pub struct S3Flags {
    /// The S3 server of an `s3://bucket/prefix` location (`http[s]://host:port`; one the
    /// operator allows with --backup-s3-endpoint).
    #[arg(long, requires = "s3_credentials")]
    pub s3_endpoint: Option<String>,
    /// A Secret of the namespace holding AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
    #[arg(long, requires = "s3_endpoint")]
    pub s3_credentials: Option<String>,
    /// The region requests are signed for (default us-east-1).
    #[arg(long, requires = "s3_endpoint")]
    pub s3_region: Option<String>,
}

impl S3Flags {
    /// The spec's `s3`, when an endpoint is given.
    pub fn access(&self) -> Option<nestplane_api::backup::S3Access> {
        Some(nestplane_api::backup::S3Access {
            endpoint: self.s3_endpoint.clone()?,
            region: self.s3_region.clone(),
            credentials_secret_ref: LocalRef {
                name: self.s3_credentials.clone()?,
            },
        })
    }
}

/// Arguments of `nestplane backup schedule`.
#[derive(Args, Debug)]
pub struct ScheduleArgs {
    /// The HostedCluster or NestedControlPlane.
    pub cluster: String,
    /// How often: a number and s, m, h or d (`30m`, `6h`, `1d`).
    #[arg(long)]
    pub every: String,
    /// How many completed backups are kept (default 7).
    #[arg(long)]
    pub keep: Option<i32>,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Where the archives go (as `backup create --to`).
    #[arg(long)]
    pub to: Option<String>,
    /// The key Secret (as `backup create --key-secret`).
    #[arg(long)]
    pub key_secret: Option<String>,
    /// The schedule's name (default: the control plane's, cut to 63 characters); its backups
    /// are named `<name>-<UTC time>`.
    #[arg(long)]
    pub name: Option<String>,
    /// Make and delete nothing until `--resume`.
    #[arg(long, conflicts_with = "resume")]
    pub suspend: bool,
    /// Make and delete again after `--suspend`.
    #[arg(long)]
    pub resume: bool,
    /// The backups' deletionPolicy (as `backup create --deletion-policy`).
    #[arg(long, value_parser = ["Retain", "Delete"])]
    pub deletion_policy: Option<String>,
    /// Point in time: follow the cluster's changes after each backup and write them beside
    /// it as delta segments, one every this period (10s to 1h), so that `backup restore
    /// --to-time` / `--to-revision` can reach any point since.
    #[arg(long)]
    pub deltas_every: Option<String>,
    #[command(flatten)]
    pub s3: S3Flags,
    #[command(flatten)]
    pub target: Target,
}

/// Arguments of `nestplane backup restore`.
#[derive(Args, Debug)]
pub struct RestoreArgs {
    /// The HostedCluster or NestedControlPlane (the one the archive was taken of).
    pub cluster: String,
    /// The archive's URL (what `backup create` printed last), or the name of a completed
    /// backup of the cluster's namespace. With --to-time and no --from: the newest backup of
    /// the cluster completed by then.
    #[arg(long, required_unless_present = "to_time")]
    pub from: Option<String>,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// The key Secret (default: the backup's, else `<cluster>-backup-key`).
    #[arg(long)]
    pub key_secret: Option<String>,
    /// The restore's name (default: `<cluster>-restore-<UTC time>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Clone: restore into a new NestedControlPlane of this name (the cluster's version,
    /// replicas and networks; the archive's CA, front-proxy CA and service-account key, so
    /// that the cluster's kubeconfigs and tokens work on it), instead of into the cluster.
    #[arg(long = "as", value_name = "NEW_CLUSTER")]
    pub as_: Option<String>,
    /// With --as: the clone runs an etcd of its own (default: the cluster's datastore).
    #[arg(long, requires = "as_", conflicts_with = "datastore")]
    pub own_etcd: bool,
    /// With --as: the clone stores on this NestedDatastore of the namespace.
    #[arg(long, requires = "as_")]
    pub datastore: Option<String>,
    /// Stop waiting after this many seconds (the restore goes on).
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// With an `s3://` archive URL: its server (default: that of the namespace's backup
    /// whose archive it is).
    #[command(flatten)]
    pub s3: S3Flags,
    /// Point in time: the backup, then its delta segments' changes seen at or before this
    /// time (RFC 3339, `2026-11-29T10:15:00Z`). Needs a schedule with --deltas-every.
    #[arg(long, conflicts_with = "to_revision")]
    pub to_time: Option<String>,
    /// Point in time: the backup, then its delta segments' changes up to this datastore
    /// revision (an object's resourceVersion).
    #[arg(long)]
    pub to_revision: Option<i64>,
    #[command(flatten)]
    pub target: Target,
}

/// Arguments of `nestplane backup create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// The HostedCluster or NestedControlPlane.
    pub cluster: String,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Where the archive goes: a `file://` directory under the operator's backup directory
    /// for the control plane's namespace (the default: that directory), or
    /// `s3://bucket[/prefix]` with --s3-endpoint and --s3-credentials.
    #[arg(long)]
    pub to: Option<String>,
    /// The backup's name (default: `<cluster>-<UTC time>`).
    #[arg(long)]
    pub name: Option<String>,
    /// A Secret (in the control plane's namespace) whose `key` holds the 32-byte archive key
    /// (default: `<cluster>-backup-key`, made with a random key the first time).
    #[arg(long)]
    pub key_secret: Option<String>,
    /// What deleting the NestedBackup does to its archive: Retain (the default: the archive
    /// outlives it) or Delete (the archive goes with it).
    #[arg(long, value_parser = ["Retain", "Delete"])]
    pub deletion_policy: Option<String>,
    /// Stop waiting after this many seconds (the backup goes on).
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    #[command(flatten)]
    pub s3: S3Flags,
    #[command(flatten)]
    pub target: Target,
}

/// Arguments of `nestplane backup list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only this namespace (all namespaces when unset).
    #[arg(short, long)]
    pub namespace: Option<String>,
    /// How to print.
    #[arg(short, long, value_enum, default_value_t = Format::Table)]
    pub output: Format,
    #[command(flatten)]
    pub target: Target,
}

/// `nestplane backup`.
pub async fn run(args: BackupArgs) -> anyhow::Result<()> {
    match args.command {
        BackupCommand::Create(a) => create(a).await,
        BackupCommand::List(a) => list(a).await,
        BackupCommand::Restore(a) => restore(a).await,
        BackupCommand::Schedule(a) => schedule(a).await,
    }
}

async fn schedule(args: ScheduleArgs) -> anyhow::Result<()> {
    use kube::api::{Patch, PatchParams};
    use nestplane_api::backup::{MAX_SCHEDULE_NAME, NestedBackupSchedule, reasons};
    let client = args.target.client().await?;
    let located = locate(&client, &args.namespace, &args.cluster).await?;
    let (ns, cp) = located.ncp;
    let name = args.name.clone().unwrap_or_else(|| {
        let cut: String = cp.chars().take(MAX_SCHEDULE_NAME).collect();
        cut.trim_end_matches(['-', '.']).to_string()
    });
    let api: Api<NestedBackupSchedule> = Api::namespaced(client.clone(), &ns);
    // Only what was given: a field left out keeps what the schedule has (run again with
    // `--every` alone, it keeps its `keep`, location, key and suspension).
    let mut spec = serde_json::json!({
        "controlPlaneRef": {"name": cp},
        "every": args.every,
    });
    for (field, value) in [
        ("keep", args.keep.map(serde_json::Value::from)),
        ("location", args.to.clone().map(serde_json::Value::from)),
        (
            "keySecretRef",
            args.key_secret
                .clone()
                .map(|n| serde_json::json!({ "name": n })),
        ),
        (
            "deletionPolicy",
            args.deletion_policy.clone().map(serde_json::Value::from),
        ),
        (
            "suspend",
            (args.suspend || args.resume).then_some(serde_json::Value::from(args.suspend)),
        ),
        (
            "s3",
            args.s3.access().and_then(|a| serde_json::to_value(a).ok()),
        ),
        (
            "deltas",
            args.deltas_every
                .clone()
                .map(|every| serde_json::json!({ "every": every })),
        ),
    ] {
        if let Some(v) = value {
            spec[field] = v;
        }
    }
    let applied = match api.get_opt(&name).await? {
        Some(there) if there.spec.control_plane_ref.name != cp => bail!(
            "NestedBackupSchedule {ns}/{name} backs up {}, not {cp}; give another --name",
            there.spec.control_plane_ref.name
        ),
        Some(_) => api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": spec })),
            )
            .await
            .with_context(|| format!("changing NestedBackupSchedule {ns}/{name}"))?,
        None => {
            let s: NestedBackupSchedule = serde_json::from_value(serde_json::json!({
                "apiVersion": "backup.nestplane.io/v1alpha1",
                "kind": "NestedBackupSchedule",
                "metadata": {"name": name, "namespace": ns},
                "spec": spec,
            }))?;
            api.create(&PostParams::default(), &s)
                .await
                .with_context(|| format!("creating NestedBackupSchedule {ns}/{name}"))?
        }
    };
    let keep = applied
        .spec
        .keep
        .unwrap_or(nestplane_api::backup::DEFAULT_KEEP);
    eprintln!(
        "nestplane: applied NestedBackupSchedule {ns}/{name}: a backup of {ns}/{cp} every {}, the newest {keep} kept{}",
        args.every,
        if applied.spec.suspend == Some(true) {
            " (suspended)"
        } else {
            ""
        }
    );
    // What the operator made of it (this generation).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = api.get(&name).await?;
        let status = s.status.clone().unwrap_or_default();
        if status.observed_generation.is_some()
            && status.observed_generation >= applied.metadata.generation
            && let Some(c) = conditions::get(&status.conditions, types::READY)
        {
            let line = format!("{}: {} ({})", c.status, c.message, c.reason);
            if c.reason == reasons::INVALID_SPEC || c.reason == reasons::CONTROL_PLANE_NOT_FOUND {
                bail!("NestedBackupSchedule {ns}/{name}: {line}");
            }
            eprintln!("nestplane: {name}: {line}");
            if let Some(next) = status.next_schedule_time {
                eprintln!("nestplane: {name}: next backup at {}", next.0);
            }
            println!("{ns}/{name}");
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "NestedBackupSchedule {ns}/{name} is not looked at by an operator after 60s (`kubectl get nestedbackupschedule -n {ns} {name}`)"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The newest completed backup of control plane `cluster` among `backups` that completed at
/// or before `at` (a point-in-time restore starts from it). Pure.
pub fn newest_before(
    backups: &[NestedBackup],
    cluster: &str,
    at: k8s_openapi::jiff::Timestamp,
) -> Option<String> {
    backups
        .iter()
        .filter(|b| b.spec.control_plane_ref.name == cluster)
        .filter_map(|b| {
            let s = b.status.as_ref()?;
            let done = s.completed_at.as_ref()?.0;
            (s.phase.as_deref() == Some(phases::COMPLETED) && done <= at)
                .then(|| (done, b.name_any()))
        })
        .max()
        .map(|(_, name)| name)
}

/// The default name of a backup of `cluster` taken at `unix` seconds: `<cluster>-YYYYMMDD-HHMMSS`
/// (UTC), cut to the longest name a backup may have. Pure.
pub fn default_name(cluster: &str, unix: i64) -> String {
    let t = k8s_openapi::jiff::Timestamp::from_second(unix)
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let stamp = t.strftime("%Y%m%d-%H%M%S").to_string();
    let keep = nestplane_api::backup::MAX_NAME - stamp.len() - 1;
    let base: String = cluster.chars().take(keep).collect();
    format!("{base}-{stamp}")
}

async fn create(args: CreateArgs) -> anyhow::Result<()> {
    let client = args.target.client().await?;
    let located = locate(&client, &args.namespace, &args.cluster).await?;
    let (ns, cp) = located.ncp;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| default_name(&args.cluster, unix_now()));
    let mut b = NestedBackup::new(
        &name,
        NestedBackupSpec {
            control_plane_ref: LocalRef { name: cp.clone() },
            location: args.to.clone(),
            key_secret_ref: args.key_secret.clone().map(|name| LocalRef { name }),
            deletion_policy: match args.deletion_policy.as_deref() {
                Some("Delete") => Some(nestplane_api::backup::DeletionPolicy::Delete),
                Some(_) => Some(nestplane_api::backup::DeletionPolicy::Retain),
                None => None,
            },
            s3: args.s3.access(),
        },
    );
    b.metadata.namespace = Some(ns.clone());
    let api: Api<NestedBackup> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &b)
        .await
        .with_context(|| format!("creating NestedBackup {ns}/{name}"))?;
    eprintln!("nestplane: created NestedBackup {ns}/{name} of {ns}/{cp}");
    if located.kind == "HostedCluster" {
        let secret = args
            .key_secret
            .clone()
            .unwrap_or_else(|| nestplane_api::backup::default_key_secret(&cp));
        eprintln!(
            "nestplane: the key Secret {ns}/{secret} is deleted with HostedCluster {}/{}; keep a copy (`kubectl get secret -n {ns} {secret} -o yaml`), or no restore can open this backup",
            args.namespace, args.cluster
        );
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.timeout);
    let mut said = String::new();
    loop {
        let b = api.get(&name).await?;
        let status = b.status.clone().unwrap_or_default();
        let ready = conditions::get(&status.conditions, types::READY);
        let phase = status.phase.clone().unwrap_or_else(|| "Pending".into());
        let line = match ready {
            Some(c) => format!("{phase}: {} ({})", c.message, c.reason),
            None => phase.clone(),
        };
        if line != said {
            eprintln!("nestplane: {name}: {line}");
            said = line;
        }
        match phase.as_str() {
            phases::COMPLETED => {
                eprintln!(
                    "nestplane: {name}: {} keys, {} bytes sealed, in {:.1}s",
                    status.keys.unwrap_or_default(),
                    status.archive_bytes.unwrap_or_default(),
                    started.elapsed().as_secs_f64()
                );
                println!("{}", status.url.unwrap_or_default());
                return Ok(());
            }
            phases::FAILED => bail!(
                "NestedBackup {ns}/{name} failed: {}",
                ready
                    .map(|c| c.message.as_str())
                    .unwrap_or("no reason given")
            ),
            _ => {}
        }
        if Instant::now() > deadline {
            bail!(
                "NestedBackup {ns}/{name} is not taken after {}s ({said}); it goes on (`kubectl get nestedbackup -n {ns} {name}`)",
                args.timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

async fn restore(args: RestoreArgs) -> anyhow::Result<()> {
    use nestplane_api::backup::{NestedRestore, NestedRestoreSpec, restore_phases as rp};
    let client = args.target.client().await?;
    let located = locate(&client, &args.namespace, &args.cluster).await?;
    let (ns, original) = located.ncp;
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), &ns);
    // A clone: its control plane, made once the restore has written its trust.
    let clone = match &args.as_ {
        None => None,
        Some(_) if located.kind == "HostedCluster" => bail!(
            "{} is a HostedCluster: cloning one is not built yet (its control plane {ns}/{original} can be restored in place)",
            args.cluster
        ),
        Some(new) => {
            if ncps.get_opt(new).await?.is_some() {
                bail!(
                    "NestedControlPlane {ns}/{new} exists: a clone makes a new control plane (its CA is the archive's)"
                );
            }
            let source = ncps.get(&original).await?;
            Some(clone_of(
                &source,
                new,
                args.datastore.as_deref(),
                args.own_etcd,
            ))
        }
    };
    let cp = args.as_.clone().unwrap_or_else(|| original.clone());
    let name = args.name.clone().unwrap_or_else(|| {
        let of = args.as_.as_ref().unwrap_or(&args.cluster);
        default_name(&format!("{of}-restore"), unix_now())
    });
    let to_time = match &args.to_time {
        Some(t) => Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            t.parse::<k8s_openapi::jiff::Timestamp>()
                .with_context(|| format!("--to-time {t:?} is not an RFC 3339 time"))?,
        )),
        None => None,
    };
    let from_arg = match (&args.from, &to_time) {
        (Some(f), _) => f.clone(),
        (None, Some(t)) => {
            let backups = Api::<NestedBackup>::namespaced(client.clone(), &ns)
                .list(&Default::default())
                .await?
                .items;
            let chosen = newest_before(&backups, &original, t.0).with_context(|| {
                format!(
                    "no backup of {ns}/{original} completed by {}: give --from",
                    t.0
                )
            })?;
            eprintln!(
                "nestplane: restoring from {chosen}, the newest backup of {ns}/{original} completed by {}",
                t.0
            );
            chosen
        }
        (None, None) => bail!("--from or --to-time"),
    };
    let from_arg = from_arg.as_str();
    let (backup_ref, from) = if from_arg.contains("://") {
        (None, Some(from_arg.to_string()))
    } else {
        (
            Some(LocalRef {
                name: from_arg.to_string(),
            }),
            None,
        )
    };
    // An `s3://` archive: its server is the one given, else that of the backup whose
    // archive it is.
    let s3 = match args.s3.access() {
        Some(a) => Some(a),
        None if from_arg.starts_with("s3://") => {
            Api::<NestedBackup>::namespaced(client.clone(), &ns)
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .find(|b| b.status.as_ref().and_then(|s| s.url.as_deref()) == Some(from_arg))
                .and_then(|b| b.spec.s3)
        }
        None => None,
    };
    if from_arg.starts_with("s3://") && s3.is_none() {
        bail!(
            "{from_arg} is an s3:// archive of no backup of namespace {ns}: give its server with --s3-endpoint and --s3-credentials"
        );
    }
    let mut r = NestedRestore::new(
        &name,
        NestedRestoreSpec {
            control_plane_ref: LocalRef { name: cp.clone() },
            clone_of: args.as_.as_ref().map(|_| LocalRef {
                name: original.clone(),
            }),
            backup_ref,
            from,
            key_secret_ref: args.key_secret.clone().map(|name| LocalRef { name }),
            s3,
            to_revision: args.to_revision,
            to_time,
        },
    );
    r.metadata.namespace = Some(ns.clone());
    r.metadata.labels = clone.as_ref().and_then(|c| c.metadata.labels.clone());
    let api: Api<NestedRestore> = Api::namespaced(client.clone(), &ns);
    api.create(&PostParams::default(), &r)
        .await
        .with_context(|| format!("creating NestedRestore {ns}/{name}"))?;
    match &clone {
        Some(_) => eprintln!(
            "nestplane: created NestedRestore {ns}/{name}: a clone of {ns}/{original} as {ns}/{cp} from {from_arg}",
        ),
        None => {
            eprintln!("nestplane: created NestedRestore {ns}/{name} of {ns}/{cp} from {from_arg}",)
        }
    }
    let mut clone = clone;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.timeout);
    let mut said = String::new();
    loop {
        let r = api.get(&name).await?;
        let status = r.status.clone().unwrap_or_default();
        let ready = conditions::get(&status.conditions, types::READY);
        let phase = status.phase.clone().unwrap_or_else(|| rp::PENDING.into());
        let line = match ready {
            Some(c) => format!("{phase}: {} ({})", c.message, c.reason),
            None => phase.clone(),
        };
        if line != said {
            eprintln!("nestplane: {name}: {line}");
            said = line;
        }
        // The clone's trust is written once the restore is past Pending: its control plane,
        // held by the restore from its first pass, is made now.
        if phase != rp::PENDING
            && phase != rp::FAILED
            && let Some(new) = clone.take()
        {
            let mut new = new;
            new.metadata
                .annotations
                .get_or_insert_default()
                .insert(RESTORE_HOLD_ANNOTATION.to_string(), name.clone());
            ncps.create(&PostParams::default(), &new)
                .await
                .with_context(|| format!("creating NestedControlPlane {ns}/{cp}"))?;
            eprintln!("nestplane: created NestedControlPlane {ns}/{cp}");
        }
        match phase.as_str() {
            rp::COMPLETED if args.as_.is_some() => {
                println!(
                    "restored {ns}/{cp} from {}: {} keys of revision {}, {ns}/{original}'s, in {:.1}s ({:.1}s from its making to ready)",
                    status.url.unwrap_or_default(),
                    status.keys.unwrap_or_default(),
                    status.revision.unwrap_or_default(),
                    started.elapsed().as_secs_f64(),
                    status.downtime_seconds.unwrap_or_default()
                );
                return Ok(());
            }
            rp::COMPLETED => {
                println!(
                    "restored {ns}/{cp} from {}: {} keys of revision {} ({} written, {} deleted) in {:.1}s, {:.1}s without its API server",
                    status.url.unwrap_or_default(),
                    status.keys.unwrap_or_default(),
                    status.revision.unwrap_or_default(),
                    status.written.unwrap_or_default(),
                    status.deleted.unwrap_or_default(),
                    started.elapsed().as_secs_f64(),
                    status.downtime_seconds.unwrap_or_default()
                );
                return Ok(());
            }
            rp::FAILED => bail!(
                "NestedRestore {ns}/{name} failed: {}",
                ready
                    .map(|c| c.message.as_str())
                    .unwrap_or("no reason given")
            ),
            _ => {}
        }
        if Instant::now() > deadline {
            bail!(
                "NestedRestore {ns}/{name} is not done after {}s ({said}); it goes on (`kubectl get nestedrestore -n {ns} {name}`)",
                args.timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The clone `new` of `source`: its version, replicas, networks and datastore (unless
/// `own_etcd`, or another `datastore`), its watch-filter label; not its endpoint or
/// components, which are its own. Pure.
pub fn clone_of(
    source: &NestedControlPlane,
    new: &str,
    datastore: Option<&str>,
    own_etcd: bool,
) -> NestedControlPlane {
    use nestplane_api::controlplane::{DatastoreRef, NestedControlPlaneSpec};
    let s = &source.spec;
    let datastore_ref = match (datastore, own_etcd) {
        (Some(name), _) => Some(DatastoreRef {
            name: name.to_string(),
            ..DatastoreRef::default()
        }),
        (None, true) => None,
        (None, false) => s.datastore_ref.clone(),
    };
    let mut ncp = NestedControlPlane::new(
        new,
        NestedControlPlaneSpec {
            version: s.version.clone(),
            replicas: s.replicas,
            cluster_network: s.cluster_network.clone(),
            datastore_ref,
            ..NestedControlPlaneSpec::default()
        },
    );
    ncp.metadata.namespace = source.metadata.namespace.clone();
    ncp.metadata.labels = source
        .labels()
        .get(WATCH_FILTER_LABEL)
        .map(|f| [(WATCH_FILTER_LABEL.to_string(), f.clone())].into());
    ncp
}

/// One backup, as `nestplane backup list` prints it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub namespace: String,
    pub name: String,
    pub cluster: String,
    pub phase: String,
    pub keys: i64,
    pub archive_bytes: i64,
    pub revision: i64,
    pub age_seconds: i64,
    pub url: String,
    /// Why, when it is not completed.
    pub reason: String,
    /// Its delta segments (point in time): how many, and the revision they reach.
    pub deltas: String,
}

/// The row of `b`. Pure.
pub fn row(b: &NestedBackup, age_seconds: i64) -> Row {
    let s = b.status.clone().unwrap_or_default();
    let reason = conditions::get(&s.conditions, types::READY)
        .filter(|c| c.status != "True")
        .map(|c| c.reason.clone())
        .unwrap_or_default();
    Row {
        namespace: b.namespace().unwrap_or_default(),
        name: b.name_any(),
        cluster: b.spec.control_plane_ref.name.clone(),
        phase: s.phase.unwrap_or_else(|| phases::PENDING.into()),
        keys: s.keys.unwrap_or_default(),
        archive_bytes: s.archive_bytes.unwrap_or_default(),
        revision: s.revision.unwrap_or_default(),
        age_seconds,
        url: s.url.unwrap_or_default(),
        reason,
        deltas: match &s.point_in_time {
            Some(p) if p.stopped.is_some() => format!("{} (stopped)", p.segments),
            Some(p) => format!("{} to rev {}", p.segments, p.revision),
            None => String::new(),
        },
    }
}

/// The table of `rows`. Pure.
pub fn table(rows: &[Row], all_namespaces: bool) -> String {
    let mut head = vec![];
    if all_namespaces {
        head.push("NAMESPACE");
    }
    head.extend([
        "NAME", "CLUSTER", "PHASE", "KEYS", "SIZE", "REVISION", "DELTAS", "AGE", "URL",
    ]);
    let mut lines = vec![head.into_iter().map(String::from).collect::<Vec<_>>()];
    for r in rows {
        let mut l = vec![];
        if all_namespaces {
            l.push(r.namespace.clone());
        }
        let phase = if r.reason.is_empty() {
            r.phase.clone()
        } else {
            format!("{} ({})", r.phase, r.reason)
        };
        l.extend([
            r.name.clone(),
            r.cluster.clone(),
            phase,
            r.keys.to_string(),
            r.archive_bytes.to_string(),
            r.revision.to_string(),
            if r.deltas.is_empty() {
                "-".into()
            } else {
                r.deltas.clone()
            },
            age(r.age_seconds),
            if r.url.is_empty() {
                "<none>".into()
            } else {
                r.url.clone()
            },
        ]);
        lines.push(l);
    }
    aligned(lines)
}

async fn list(args: ListArgs) -> anyhow::Result<()> {
    let client = args.target.client().await?;
    let api: Api<NestedBackup> = match &args.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let mut rows: Vec<Row> = api
        .list(&ListParams::default())
        .await
        .context("listing NestedBackups")?
        .items
        .iter()
        .map(|b| row(b, age_of(&b.metadata)))
        .collect();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    match args.output {
        Format::Table if rows.is_empty() => eprintln!("No backups found."),
        Format::Table => print!("{}", table(&rows, args.namespace.is_none())),
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Format::Yaml => print!("{}", serde_saphyr::to_string(&rows)?),
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_takes_the_originals_settings_but_not_its_endpoint_components_or_labels() {
        use nestplane_api::controlplane::{
            ApiEndpoint, ClusterNetwork, DatastoreRef, NestedControlPlaneSpec, NetworkRanges,
        };
        let mut source = NestedControlPlane::new(
            "alpha",
            NestedControlPlaneSpec {
                version: Some("v1.20.2".into()),
                replicas: Some(3),
                cluster_network: Some(ClusterNetwork {
                    services: Some(NetworkRanges {
                        cidr_blocks: vec!["10.96.0.0/16".into()],
                    }),
                    ..Default::default()
                }),
                control_plane_endpoint: Some(ApiEndpoint {
                    host: "127.84.17.1".into(),
                    port: 6443,
                }),
                datastore_ref: Some(DatastoreRef {
                    name: "shared".into(),
                    ..Default::default()
                }),
                etcd: Some(Default::default()),
                apiserver: Some(Default::default()),
                ..Default::default()
            },
        );
        source.metadata.namespace = Some("team-a".into());
        source.metadata.labels = Some(
            [
                (WATCH_FILTER_LABEL.to_string(), "blue".to_string()),
                ("team".to_string(), "a".to_string()),
            ]
            .into(),
        );
        let same = clone_of(&source, "gamma", None, false);
        assert_eq!(same.metadata.name.as_deref(), Some("gamma"));
        assert_eq!(same.metadata.namespace.as_deref(), Some("team-a"));
        assert_eq!(
            same.metadata.labels,
            Some([(WATCH_FILTER_LABEL.to_string(), "blue".to_string())].into())
        );
        assert_eq!(same.spec.version, source.spec.version);
        assert_eq!(same.spec.replicas, Some(3));
        assert_eq!(same.spec.cluster_network, source.spec.cluster_network);
        assert_eq!(same.spec.datastore_ref, source.spec.datastore_ref);
        assert_eq!(same.spec.control_plane_endpoint, None);
        assert_eq!(same.spec.etcd, None);
        assert_eq!(same.spec.apiserver, None);
        assert_eq!(clone_of(&source, "g", None, true).spec.datastore_ref, None);
        assert_eq!(
            clone_of(&source, "g", Some("other"), false)
                .spec
                .datastore_ref
                .map(|d| d.name),
            Some("other".into())
        );
    }

    #[test]
    fn a_point_in_time_starts_from_the_newest_backup_completed_by_then() {
        use k8s_openapi::jiff::Timestamp;
        let at = |s: i64| Timestamp::from_second(s).unwrap();
        let backup = |name: &str, cluster: &str, phase: &str, done: i64| {
            let mut b = NestedBackup::new(
                name,
                NestedBackupSpec {
                    control_plane_ref: LocalRef {
                        name: cluster.into(),
                    },
                    ..Default::default()
                },
            );
            b.status = Some(nestplane_api::NestedBackupStatus {
                phase: Some(phase.into()),
                completed_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(
                    done,
                ))),
                ..Default::default()
            });
            b
        };
        let all = [
            backup("a-1", "alpha", phases::COMPLETED, 100),
            backup("a-2", "alpha", phases::COMPLETED, 200),
            backup("a-3", "alpha", phases::FAILED, 250),
            backup("b-1", "beta", phases::COMPLETED, 260),
            backup("a-4", "alpha", phases::COMPLETED, 300),
        ];
        assert_eq!(
            newest_before(&all, "alpha", at(299)).as_deref(),
            Some("a-2")
        );
        assert_eq!(
            newest_before(&all, "alpha", at(300)).as_deref(),
            Some("a-4")
        );
        assert_eq!(newest_before(&all, "alpha", at(99)), None);
        assert_eq!(
            newest_before(&all, "beta", at(1000)).as_deref(),
            Some("b-1")
        );
    }

    #[test]
    fn a_default_name_is_the_cluster_and_the_utc_time() {
        assert_eq!(
            default_name("alpha", 1_795_837_800),
            "alpha-20261128-035000"
        );
        let long = "a".repeat(260);
        let n = default_name(&long, 0);
        assert_eq!(n.len(), nestplane_api::backup::MAX_NAME);
        assert!(n.ends_with("-19700101-000000"));
    }

    #[test]
    fn the_table_tells_phase_reason_and_url() {
        let mut b = NestedBackup::new(
            "alpha-1",
            NestedBackupSpec {
                control_plane_ref: LocalRef {
                    name: "alpha".into(),
                },
                ..Default::default()
            },
        );
        b.metadata.namespace = Some("team-a".into());
        let pending = row(&b, 5);
        b.status = Some(nestplane_api::NestedBackupStatus {
            phase: Some(phases::COMPLETED.into()),
            keys: Some(512),
            archive_bytes: Some(40_000),
            revision: Some(77),
            url: Some("file:///b/team-a/alpha-1.npbackup".into()),
            conditions: vec![conditions::new(types::READY, true, "Completed", "done")],
            point_in_time: Some(nestplane_api::backup::PointInTime {
                segments: 3,
                revision: 90,
                ..Default::default()
            }),
            ..Default::default()
        });
        let done = row(&b, 300);
        let t = table(&[pending, done], true);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NAMESPACE   NAME"), "{t}");
        assert!(
            lines[1].contains("Pending") && lines[1].contains("<none>"),
            "{t}"
        );
        assert!(
            lines[2].contains("Completed")
                && lines[2].contains("512")
                && lines[2].contains("5m")
                && lines[2].contains("3 to rev 90")
                && lines[2].ends_with("file:///b/team-a/alpha-1.npbackup"),
            "{t}"
        );
    }
}
