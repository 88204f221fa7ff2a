//! Errors of rendering.

use nestplane_api::names::Component;

/// Why a tenant cannot be rendered. Every message says what was wrong and what is accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// The text is not a Kubernetes version at all.
    #[error(
        "{input:?} is not a Kubernetes version: {reason}; expected MAJOR.MINOR.PATCH with an optional leading \"v\", for example v1.20.2"
    )]
    InvalidVersion {
        /// The text as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A well-formed version nestplane cannot render.
    #[error(
        "Kubernetes {version} is not supported: nestplane renders v1.{min}.0 through v1.{max}.x; choose a version in that range"
    )]
    UnsupportedVersion {
        /// The version as written (`v1.19.0`).
        version: String,
        /// Lowest supported minor.
        min: u32,
        /// Highest supported minor.
        max: u32,
    },
    /// A field of the input is invalid.
    #[error("invalid {field}: {reason}")]
    InvalidInput {
        /// The field (`cluster`, `service_cidr`, `replicas[etcd]`, …).
        field: String,
        /// What is wrong with it and what is accepted.
        reason: String,
    },
    /// The loopback network has fewer addresses than a component has replicas.
    #[error(
        "{component:?} wants {replicas} replicas but the loopback network has only {hosts} host addresses (one per replica); lower the replicas or allocate more addresses"
    )]
    NotEnoughHosts {
        /// The component.
        component: Component,
        /// Its desired replicas.
        replicas: u32,
        /// Addresses available.
        hosts: usize,
    },
}

impl RenderError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        RenderError::InvalidInput {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
