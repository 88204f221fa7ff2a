//! Custom resource types of nestplane, condition helpers, and well-known names.
//!
//! Pure: no IO. Every other crate builds on these types.
// kube-derive takes one `printcolumn(...)` per column; clippy reads the repeats as duplicates.
#![allow(clippy::duplicated_attributes)]

pub mod backup;
pub mod bootstrap;
pub mod conditions;
pub mod controlplane;
pub mod crds;
pub mod datastore;
pub mod endpoint;
pub mod hosted;
pub mod names;
pub mod postcreate;
mod schema;

pub use backup::{
    NestedBackup, NestedBackupSchedule, NestedBackupScheduleSpec, NestedBackupScheduleStatus,
    NestedBackupSpec, NestedBackupStatus, NestedRestore, NestedRestoreSpec, NestedRestoreStatus,
};
pub use controlplane::*;
pub use datastore::{NestedDatastore, NestedDatastoreSpec, NestedDatastoreStatus};
pub use endpoint::{ClusterEndpoint, ClusterEndpointSpec, ClusterEndpointType};
pub use hosted::{ExternalInfraCluster, HostedCluster, NodePool};
pub use postcreate::{PostCreateConfig, PostCreateConfigSpec, PostCreateConfigStatus};
