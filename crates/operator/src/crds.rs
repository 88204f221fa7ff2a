//! Installing nestplane's CRDs into a cluster and waiting until they are served.

use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

/// The field manager nestplane applies with.
pub const FIELD_MANAGER: &str = "nestplane";

/// Why the CRDs were not installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// Applied, but not served by the deadline: another CRD may hold one of their names
    /// (`kubectl get crd NAME -o yaml`: the `NamesAccepted` condition says which).
    #[error(
        "CRDs not established within {timeout:?} (is another CRD using their names? see their NamesAccepted condition): {}",
        names.join(", ")
    )]
    NotEstablished {
        names: Vec<String>,
        timeout: Duration,
    },
}

/// Server-side apply every CRD and wait until each is `Established`; an error names those that
/// are not by `timeout`.
pub async fn install(client: &kube::Client, timeout: Duration) -> Result<(), InstallError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let crds = nestplane_api::crds::all();
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &pp, &Patch::Apply(crd)).await?;
    }
    let deadline = Instant::now() + timeout;
    let mut late = Vec::new();
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        loop {
            let got = api.get(&name).await?;
            if established(&got) {
                break;
            }
            if Instant::now() > deadline {
                late.push(name);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    if late.is_empty() {
        Ok(())
    } else {
        Err(InstallError::NotEstablished {
            names: late,
            timeout,
        })
    }
}

/// Whether a CRD is served (its `Established` condition is `True`).
pub fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// CRDs as one multi-document YAML (what `nestplane crds` prints; `config/crd/` holds the
/// control-plane provider's, `config/bootstrap/` the bootstrap provider's).
pub fn yaml(crds: &[CustomResourceDefinition]) -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for crd in crds {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}
