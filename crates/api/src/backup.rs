//! `backup.nestplane.io/v1alpha1` `NestedBackup`: one backup of one control plane's keys,
//! taken once at one datastore revision and sealed into an archive at a location.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group.
pub const GROUP: &str = "backup.nestplane.io";
/// The longest backup name: it is the archive's file name, with `.npbackup`.
pub const MAX_NAME: usize = 200;
/// The key of a key Secret that holds the archive key (32 bytes).
pub const KEY_KEY: &str = "key";
/// How long an archive key is, in bytes.
pub const KEY_LEN: usize = 32;
/// The name of an archive file ends with this.
pub const ARCHIVE_SUFFIX: &str = ".npbackup";

/// The key Secret a backup of control plane `cluster` uses when its spec names none: made
/// with a new random key the first time, and never owned by anything (deleting the control
/// plane must not delete the only key that opens its backups).
pub fn default_key_secret(cluster: &str) -> String {
    format!("{cluster}-backup-key")
}

/// Condition types.
pub mod types {
    /// The archive is written and verified (True), is being taken (False, `Running`), or
    /// cannot be taken (False, with the reason).
    pub const READY: &str = "Ready";
}

/// Condition and Event reasons.
pub mod reasons {
    /// The backup is being taken.
    pub const RUNNING: &str = "Running";
    /// The archive is written (Event).
    pub const COMPLETED: &str = "Completed";
    /// The control plane does not exist (yet).
    pub const CONTROL_PLANE_NOT_FOUND: &str = "ControlPlaneNotFound";
    /// The control plane's datastore cannot be reached yet (no endpoints, no credentials).
    pub const DATASTORE_NOT_READY: &str = "DatastoreNotReady";
    /// The location is not one this operator writes to.
    pub const LOCATION_REFUSED: &str = "LocationRefused";
    /// The key Secret does not hold a key of 32 bytes.
    pub const INVALID_KEY: &str = "InvalidKey";
    /// An archive of that name exists already; it is left as it is.
    pub const ARCHIVE_EXISTS: &str = "ArchiveExists";
    /// Reading the keys or writing the archive failed (retried).
    pub const BACKUP_FAILED: &str = "BackupFailed";
    /// A key Secret was made with a new random key (Event).
    pub const KEY_CREATED: &str = "KeyCreated";
    /// The control plane holds what no archive may (more than the limits, a key that is not
    /// a plain key): not tried again until the spec changes.
    pub const CANNOT_ARCHIVE: &str = "CannotArchive";
    /// The spec cannot be acted on (a name too long for an archive's file name).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A `deletionPolicy: Delete` backup is deleted, but its archive is kept for now (a
    /// restore still to finish names it, or the file cannot be deleted).
    pub const ARCHIVE_IN_USE: &str = "ArchiveInUse";
    /// The namespace's archives fill its quota (the operator's `--backup-namespace-quota`):
    /// waits until there is room.
    pub const QUOTA_EXCEEDED: &str = "QuotaExceeded";
    /// An `s3://` location's server cannot be reached, or refuses the credentials: looked at
    /// again.
    pub const LOCATION_UNAVAILABLE: &str = "LocationUnavailable";
    /// An `s3://` location's credentials Secret is missing or incomplete, or its server
    /// refuses them: looked at again.
    pub const INVALID_CREDENTIALS: &str = "InvalidCredentials";
}

/// The keys of an S3 credentials Secret.
pub mod s3_keys {
    /// The access key ID.
    pub const ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
    /// The secret access key.
    pub const SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
}

/// How to reach an `s3://bucket/prefix` location: the server, and this namespace's own
/// credentials for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct S3Access {
    /// The server's URL (`http://host:port` or `https://host[:port]`, path-style requests):
    /// one the operator allows (its `--backup-s3-endpoint`); any other is refused.
    pub endpoint: String,
    /// The region requests are signed for (`us-east-1` when empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// A Secret of this namespace holding `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`.
    pub credentials_secret_ref: LocalRef,
}

/// Where a backup is.
pub mod phases {
    /// Not started: waiting for the control plane or its datastore.
    pub const PENDING: &str = "Pending";
    /// Being taken.
    pub const RUNNING: &str = "Running";
    /// Written and verified; never taken again.
    pub const COMPLETED: &str = "Completed";
    /// Refused (the spec cannot be acted on); taken when the spec changes.
    pub const FAILED: &str = "Failed";
}

/// An object in the backup's namespace, by name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LocalRef {
    /// Its name.
    pub name: String,
}

/// One backup of one `NestedControlPlane` of this namespace: its keys at one datastore
/// revision, sealed with a key from a Secret of this namespace, written once to a location.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "backup.nestplane.io",
    version = "v1alpha1",
    kind = "NestedBackup",
    plural = "nestedbackups",
    namespaced,
    status = "NestedBackupStatus",
    shortname = "nbk",
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".spec.controlPlaneRef.name"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Keys", type_ = "integer", json_path = ".status.keys"),
    printcolumn(name = "Size", type_ = "integer", json_path = ".status.archiveBytes"),
    printcolumn(name = "Revision", type_ = "integer", json_path = ".status.revision"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "URL",
        type_ = "string",
        json_path = ".status.url",
        priority = 1
    ),
    printcolumn(
        name = "Deltas Until",
        type_ = "date",
        json_path = ".status.pointInTime.until",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedBackupSpec {
    /// The control plane to back up: a `NestedControlPlane` of this namespace.
    pub control_plane_ref: LocalRef,
    /// Where the archive goes: a `file://` directory URL under this namespace's directory of
    /// the operator's backup directory (`file://<backup dir>/<namespace>/…`; that directory
    /// when empty), or `s3://bucket[/prefix]` (with `s3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// A Secret of this namespace whose `key` holds the archive key (32 bytes). When empty,
    /// `<cluster>-backup-key`, made with a random key if it does not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret_ref: Option<LocalRef>,
    /// What deleting this object does to its archive: `Retain` (the default: the archive
    /// outlives it) or `Delete` (the archive goes with it, once no restore still to finish
    /// names it; the object carries [`ARCHIVE_FINALIZER`] until then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_policy: Option<DeletionPolicy>,
    /// How to reach an `s3://` location: required with one, ignored otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Access>,
}

/// What deleting a `NestedBackup` does to its archive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DeletionPolicy {
    /// The archive outlives the object.
    #[default]
    Retain,
    /// The archive is deleted with the object.
    Delete,
}

/// The finalizer on a `NestedBackup` whose `deletionPolicy` is `Delete`: removed once its
/// archive is deleted.
pub const ARCHIVE_FINALIZER: &str = "backup.nestplane.io/archive";

/// What the backup holds, once taken.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedBackupStatus {
    /// `Pending`, `Running`, `Completed` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The archive's own URL (`file:///…/<name>.npbackup`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The datastore revision the keys were read at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<i64>,
    /// How many keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<i64>,
    /// Their keys' and values' bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<i64>,
    /// The archive file's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive_bytes: Option<i64>,
    /// The records' digest as the archive's header holds it (keyed: `hmac-sha256:…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The control plane's Kubernetes version when it was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes_version: Option<String>,
    /// How often the read started again because the datastore compacted its revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restarts: Option<i32>,
    /// When the taking started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the archive was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// How long reading, sealing and writing took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_seconds: Option<f64>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The delta segments written after this backup by its schedule (`deltas`): a restore
    /// of it can reach any revision up to `pointInTime.revision` and any time up to
    /// `pointInTime.until`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point_in_time: Option<PointInTime>,
}

/// How far a backup's delta segments reach.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PointInTime {
    /// Segments written (`<archive>.d000001.npdelta`, …).
    pub segments: i64,
    /// The newest revision they hold.
    pub revision: i64,
    /// Until when the control plane's keys are known: the last segment's cut, or the last
    /// time the watch saw no change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Time>,
    /// Why no more are written (the watch fell behind the datastore's compaction: the
    /// schedule's next backup starts a new chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
}

/// The annotation on a `NestedControlPlane` that holds its API server, controller manager
/// and scheduler stopped while the `NestedRestore` it names replaces its keys. It holds only
/// while that restore exists and is `Stopping` or `Restoring`.
pub const RESTORE_HOLD_ANNOTATION: &str = "backup.nestplane.io/restore";

/// The annotation on a clone's CA, front-proxy CA and service-account key Secrets: the
/// `NestedRestore` that wrote them from its archive.
pub const CLONED_BY_ANNOTATION: &str = "backup.nestplane.io/cloned-by";

/// The reason of a component's `Ready` condition while a restore holds it stopped.
pub const HELD_FOR_RESTORE: &str = "HeldForRestore";

/// Where a restore is.
pub mod restore_phases {
    /// Not started: waiting for the control plane, the archive or the key.
    pub const PENDING: &str = "Pending";
    /// The control plane's API server, controller manager and scheduler are being stopped.
    pub const STOPPING: &str = "Stopping";
    /// Its keys are being replaced by the archive's.
    pub const RESTORING: &str = "Restoring";
    /// They start again.
    pub const STARTING: &str = "Starting";
    /// The control plane holds the archive's keys and is ready again.
    pub const COMPLETED: &str = "Completed";
    /// Refused (the spec cannot be acted on); tried when the spec changes.
    pub const FAILED: &str = "Failed";
}

/// Restore reasons (besides the backup's).
pub mod restore_reasons {
    /// The archive does not open, or is not valid.
    pub const INVALID_ARCHIVE: &str = "InvalidArchive";
    /// The archive holds another control plane's keys than the restore names (its
    /// `controlPlaneRef`, or for a clone its `cloneOf`).
    pub const OTHER_CONTROL_PLANE: &str = "OtherControlPlane";
    /// A clone's control plane already has a CA or service-account key other than the
    /// archive's: a clone goes into a new control plane, and no one's CA is ever replaced.
    pub const NOT_A_NEW_CONTROL_PLANE: &str = "NotANewControlPlane";
    /// Another restore holds the control plane.
    pub const CONTROL_PLANE_BUSY: &str = "ControlPlaneBusy";
    /// The backup named is not completed (yet).
    pub const BACKUP_NOT_READY: &str = "BackupNotReady";
    /// Writing the keys failed (tried again; the control plane stays stopped).
    pub const RESTORE_FAILED: &str = "RestoreFailed";
    /// Stopping, restoring, starting (the phase says which).
    pub const IN_PROGRESS: &str = "InProgress";
    /// The point asked (`toTime`, `toRevision`) is past what the delta segments reach yet:
    /// looked at again.
    pub const POINT_NOT_REACHED: &str = "PointNotReached";
    /// The point asked is before the backup.
    pub const POINT_BEFORE_BACKUP: &str = "PointBeforeBackup";
}

/// A restore of one `NestedControlPlane` of this namespace from an archive: its API server,
/// controller manager and scheduler stop, its keys become exactly the archive's, and they
/// start again (clients list again: the API server comes back with a new watch cache).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "backup.nestplane.io",
    version = "v1alpha1",
    kind = "NestedRestore",
    plural = "nestedrestores",
    namespaced,
    status = "NestedRestoreStatus",
    shortname = "nrs",
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".spec.controlPlaneRef.name"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Keys", type_ = "integer", json_path = ".status.keys"),
    printcolumn(
        name = "Downtime",
        type_ = "number",
        json_path = ".status.downtimeSeconds"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "From",
        type_ = "string",
        json_path = ".status.url",
        priority = 1
    ),
    printcolumn(
        name = "Clone Of",
        type_ = "string",
        json_path = ".spec.cloneOf.name",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedRestoreSpec {
    /// The control plane whose keys are replaced: a `NestedControlPlane` of this namespace,
    /// the one the archive was taken of (or, for a clone, the new one).
    pub control_plane_ref: LocalRef,
    /// A clone: the control plane of this namespace the archive was taken of, while
    /// `controlPlaneRef` names a new one. Before anything else the restore writes the new
    /// one's CA, front-proxy CA and service-account key Secrets from the archive (refused if
    /// it has others), so that kubeconfigs and tokens of the original verify on the clone;
    /// its etcd credentials are its own. Create the new control plane with the annotation
    /// `backup.nestplane.io/restore: <this restore>` and it never serves before it holds the
    /// archive's keys (`nestplane backup restore --as` does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_of: Option<LocalRef>,
    /// A completed `NestedBackup` of this namespace: its archive, and its key Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_ref: Option<LocalRef>,
    /// Or an archive's URL: `file://`, under this namespace's directory of the operator's
    /// backup directory, or `s3://bucket/key` (with `s3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// How to reach an `s3://` archive named by `from` (a backup's own is used with
    /// `backupRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Access>,
    /// Point in time: the archive, then its delta segments up to and including this
    /// datastore revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_revision: Option<i64>,
    /// Point in time: the archive, then its delta segments' changes seen at or before this
    /// time (RFC 3339). Waits while the segments do not reach it yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_time: Option<Time>,
    /// The key Secret (its `key`, 32 bytes). Default: the backup's, else
    /// `<control plane>-backup-key` (for a clone, the original's). Never made by a restore.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret_ref: Option<LocalRef>,
}

/// What the restore did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedRestoreStatus {
    /// `Pending`, `Stopping`, `Restoring`, `Starting`, `Completed` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The archive restored from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The revision the archive was taken at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<i64>,
    /// The archive's keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<i64>,
    /// Keys written, and keys deleted (there, not in the archive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted: Option<i64>,
    /// The digest of the control plane's keys after the restore: the archive's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// When the API server was told to stop (a clone's: when its control plane was made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_at: Option<Time>,
    /// The UID of the control plane held: one deleted and made again meanwhile is not
    /// written to (the restore fails).
    #[serde(
        default,
        rename = "controlPlaneUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub control_plane_uid: Option<String>,
    /// When the control plane was ready again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
    /// From the stop to ready again: how long the control plane did not serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_seconds: Option<f64>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The label on a `NestedBackup` made by a `NestedBackupSchedule`: the schedule's name. The
/// schedule keeps (and deletes) only the backups of its control plane that carry it.
pub const SCHEDULE_LABEL: &str = "backup.nestplane.io/schedule";

/// How many completed backups a schedule keeps when its spec does not say.
pub const DEFAULT_KEEP: i32 = 7;
/// The most a schedule may keep.
pub const MAX_KEEP: i32 = 1000;
/// The shortest period between a schedule's backups, in seconds.
pub const MIN_EVERY_SECONDS: i64 = 10;
/// The longest, in seconds (a year).
pub const MAX_EVERY_SECONDS: i64 = 366 * 86_400;
/// The longest schedule name: it is the value of its backups' [`SCHEDULE_LABEL`] (a label
/// value has at most 63 characters).
pub const MAX_SCHEDULE_NAME: usize = 63;

/// Schedule reasons (besides the backup's, which a schedule repeats when its newest backup
/// waits or is refused).
pub mod schedule_reasons {
    /// The newest backup completed (True).
    pub const BACKED_UP: &str = "BackedUp";
    /// No backup yet, or the newest is being taken (False).
    pub const WAITING_FOR_FIRST: &str = "WaitingForFirstBackup";
    /// `suspend: true`: nothing is made or deleted.
    pub const SUSPENDED: &str = "Suspended";
    /// A backup was made (Event).
    pub const CREATED: &str = "Created";
    /// A backup past the retention was deleted, with its archive (Event).
    pub const PRUNED: &str = "Pruned";
    /// A backup of the name the schedule was to give one exists and is not its (Event).
    pub const NAME_TAKEN: &str = "NameTaken";
    /// The watch behind the delta segments fell behind the datastore's compaction: a new
    /// backup is made at once to start a new chain (Event).
    pub const DELTAS_BEHIND: &str = "DeltasFellBehind";
    /// A delta segment could not be written (Event; tried again with a growing pause), or
    /// the chain stopped because the control plane holds what no segment may.
    pub const DELTAS_FAILED: &str = "DeltasFailed";
    /// A namespace already has as many delta followers as the operator allows: this
    /// schedule's deltas wait for one to end (Event).
    pub const DELTAS_REFUSED: &str = "DeltasRefused";
}

/// Backups of one `NestedControlPlane` of this namespace, one every period, the newest
/// `keep` completed ones kept: older ones are deleted with their archives. A backup is not
/// made while the schedule's previous one is still being taken, and missed periods are not
/// made up (one backup, then the next period). Deleting the schedule leaves its backups.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "backup.nestplane.io",
    version = "v1alpha1",
    kind = "NestedBackupSchedule",
    plural = "nestedbackupschedules",
    namespaced,
    status = "NestedBackupScheduleStatus",
    shortname = "nbks",
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".spec.controlPlaneRef.name"
    ),
    printcolumn(name = "Every", type_ = "string", json_path = ".spec.every"),
    printcolumn(name = "Deltas", type_ = "string", json_path = ".spec.deltas.every"),
    printcolumn(name = "Kept", type_ = "integer", json_path = ".status.kept"),
    printcolumn(
        name = "Last Backup",
        type_ = "string",
        json_path = ".status.lastBackup"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "Next",
        type_ = "date",
        json_path = ".status.nextScheduleTime",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedBackupScheduleSpec {
    /// The control plane to back up: a `NestedControlPlane` of this namespace.
    pub control_plane_ref: LocalRef,
    /// How often: a number and a unit, `s`, `m`, `h` or `d` (`30m`, `6h`, `1d`); at least
    /// `10s`, at most `366d`.
    pub every: String,
    /// How many completed backups are kept (default 7, at most 1000): once a newer one has
    /// completed, the oldest past that number is deleted, with its archive. Failed backups
    /// older than the newest completed one are deleted too; of the rest, the newest is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<i32>,
    /// The backups' location (a `NestedBackup`'s `location`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// The backups' key Secret (a `NestedBackup`'s `keySecretRef`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret_ref: Option<LocalRef>,
    /// The backups' `deletionPolicy` (what deleting one by hand does to its archive; the
    /// retention deletes archives either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_policy: Option<DeletionPolicy>,
    /// Make and delete nothing while true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend: Option<bool>,
    /// The backups' `s3` (how to reach an `s3://` location).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Access>,
    /// Point in time: after each backup completes, the control plane's changes are
    /// followed with a watch and written beside its archive as delta segments, one every
    /// period, so that a restore can reach any revision or time since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deltas: Option<Deltas>,
}

/// How delta segments are cut.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Deltas {
    /// How often a segment is cut: `10s` to `1h` (a restore to a time reaches what the
    /// segments written by then hold).
    pub every: String,
}

/// What the schedule did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedBackupScheduleStatus {
    /// The newest backup it made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_backup: Option<String>,
    /// When it made that backup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_schedule_time: Option<Time>,
    /// The newest of its backups that completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_completed: Option<String>,
    /// When the next backup is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_schedule_time: Option<Time>,
    /// Its completed backups there now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<i32>,
    /// The UIDs of the backups it made that are still there: only these are its own (a
    /// label or a name can be given to any backup by anyone who may edit it; this status
    /// only by the operator).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub made: Vec<String>,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: the newest backup completed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_backup_reads_and_defaults_nothing() {
        let b: NestedBackup = serde_json::from_value(serde_json::json!({
            "apiVersion": "backup.nestplane.io/v1alpha1",
            "kind": "NestedBackup",
            "metadata": {"name": "alpha-1", "namespace": "team-a"},
            "spec": {"controlPlaneRef": {"name": "alpha"}}
        }))
        .unwrap();
        assert_eq!(b.spec.control_plane_ref.name, "alpha");
        assert_eq!(b.spec.location, None);
        assert_eq!(b.spec.key_secret_ref, None);
        assert_eq!(default_key_secret("alpha"), "alpha-backup-key");
    }
}
