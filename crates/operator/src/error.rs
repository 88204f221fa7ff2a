//! The error of a reconcile pass.

/// Errors of a reconcile pass. None of them carries secret material.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The management API failed.
    #[error("management API: {0}")]
    Kube(#[from] kube::Error),
    /// Secrets could not be read or written.
    #[error(transparent)]
    Secret(#[from] crate::secrets::SecretError),
    /// Rendering failed.
    #[error("rendering: {0}")]
    Render(#[from] nestplane_render::RenderError),
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] nestplane_runtime::process::RuntimeError),
    /// A user patch cannot be applied.
    #[error(transparent)]
    Patch(#[from] nestplane_render::PatchError),
    /// A shared datastore's etcd failed.
    #[error(transparent)]
    Datastore(#[from] crate::datastore::etcd::EtcdError),
    /// Certificates could not be made.
    #[error(transparent)]
    Pki(#[from] nestplane_pki::PkiError),
    /// Something a pass needs cannot be reached now (it is tried again).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// This replica stopped leading: it stopped reconciling so that the new leader alone
    /// writes.
    #[error("leadership lost: stopped reconciling so that the new leader alone writes")]
    LeadershipLost,
    /// A bug.
    #[error("internal: {0}")]
    Internal(String),
    /// A step of a reconciler failed (the step names where: `control plane`, `converge`, …).
    #[error("{step}: {source}")]
    At {
        /// The reconciler's step.
        step: &'static str,
        /// What failed there.
        source: Box<Error>,
    },
}

/// Say which step of a reconciler a failure happened in.
pub trait AtStep<T> {
    /// The error, if any, as failing at `step`.
    fn at(self, step: &'static str) -> Result<T, Error>;
}

impl<T, E: Into<Error>> AtStep<T> for Result<T, E> {
    fn at(self, step: &'static str) -> Result<T, Error> {
        self.map_err(|e| Error::At {
            step,
            source: Box::new(e.into()),
        })
    }
}

impl Error {
    /// A short stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Secret(_) => "secret",
            Error::Render(_) => "render",
            Error::Runtime(e) => e.label(),
            Error::Patch(_) => "patch",
            Error::Datastore(_) => "datastore",
            Error::Pki(_) => "pki",
            Error::Unavailable(_) => "unavailable",
            Error::LeadershipLost => "leadership",
            Error::Internal(_) => "internal",
            Error::At { source, .. } => source.label(),
        }
    }

    /// The step that failed (`""` where no step was named).
    pub fn step(&self) -> &'static str {
        match self {
            Error::At { step, .. } => step,
            _ => "",
        }
    }
}
