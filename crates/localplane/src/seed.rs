//! CustomResourceDefinitions written to a new plane's etcd before its API server starts.
//!
//! Kubernetes 1.20 rebuilds and re-aggregates its whole OpenAPI document each time a CRD
//! becomes Established on a running API server (`apiextensions-apiserver`'s OpenAPI
//! controller, then the aggregator), one of the most expensive things it does. CRDs that are
//! already stored when it starts go into one initial build instead ("create initial spec to
//! avoid merging once per CRD on startup"). A plane asked for CRDs stores them, as the API
//! server itself would after accepting them, before starting it: JSON (the API server reads
//! JSON and protobuf alike, and applies its defaults on reading), with the names accepted and
//! the CRD established. A CRD already stored is left as it is: a restarted plane keeps what
//! its API server wrote, and installing CRDs through the API afterwards works as always.
//!
//! What the API server would check on a create is not checked here: the CRDs must be valid
//! (nestplane's own are created through the API by its tests and by every install). A stored
//! CRD has no `managedFields`, so the first server-side apply rewrites it once, naming a
//! `before-first-apply` manager that keeps its fields: fine for a plane that lives as long as
//! a test, which is why `nestplane up`, whose plane lives on, does not use this.

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};

use crate::Error;

/// Where kube-apiserver (default `--etcd-prefix`) keeps a CRD.
pub fn key(name: &str) -> String {
    format!("/registry/apiextensions.k8s.io/customresourcedefinitions/{name}")
}

/// The object the API server stores for `crd` once it has accepted its names and
/// established it: the same conditions, reasons and messages its naming and establishing
/// controllers write, so that neither has anything to change. Pure.
pub fn stored(crd: &CustomResourceDefinition, uid: &str, now: &str) -> Result<Value, Error> {
    let mut object = serde_json::to_value(crd).map_err(|e| Error::Client(e.to_string()))?;
    let kind = crd.spec.names.kind.clone();
    let names = &mut object["spec"]["names"];
    // What the API server defaults on reading, written out so that the accepted names
    // below equal the spec's exactly.
    if names
        .get("singular")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        names["singular"] = json!(kind.to_lowercase());
    }
    if names
        .get("listKind")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        names["listKind"] = json!(format!("{kind}List"));
    }
    let accepted = names.clone();
    let stored_versions: Vec<&str> = crd
        .spec
        .versions
        .iter()
        .filter(|v| v.storage)
        .map(|v| v.name.as_str())
        .collect();
    object["apiVersion"] = json!("apiextensions.k8s.io/v1");
    object["kind"] = json!("CustomResourceDefinition");
    let metadata = object["metadata"]
        .as_object_mut()
        .ok_or_else(|| Error::Client("a CRD without metadata".into()))?;
    metadata.insert("uid".into(), json!(uid));
    metadata.insert("creationTimestamp".into(), json!(now));
    metadata.insert("generation".into(), json!(1));
    metadata.remove("resourceVersion");
    object["status"] = json!({
        "acceptedNames": accepted,
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "NoConflicts",
                "message": "no conflicts found",
            },
            {
                "type": "Established",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
            },
        ],
        "storedVersions": stored_versions,
    });
    Ok(object)
}

/// Store `crds` in the etcd at `port` (client certificate: the API server's) unless stored
/// already; waits up to `timeout` for etcd to take writes (a new member elects itself first).
pub async fn crds(
    pki_dir: &Path,
    port: u16,
    crds: &[CustomResourceDefinition],
    timeout: Duration,
) -> Result<(), Error> {
    use etcd_client::{Compare, CompareOp, Txn, TxnOp};
    let read = |name: &str| {
        std::fs::read_to_string(pki_dir.join(name))
            .map_err(crate::io_err(format!("reading {name}")))
    };
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(read("etcd-ca.crt")?))
        .identity(etcd_client::Identity::from_pem(
            read("apiserver-etcd-client.crt")?,
            read("apiserver-etcd-client.key")?,
        ));
    let etcd_err = |e: etcd_client::Error| Error::Client(format!("etcd: {e}"));
    let deadline = Instant::now() + timeout;
    let options = etcd_client::ConnectOptions::new()
        .with_tls(tls)
        .with_timeout(Duration::from_secs(5));
    let mut client = loop {
        match etcd_client::Client::connect(
            [format!("https://127.0.0.1:{port}")],
            Some(options.clone()),
        )
        .await
        {
            Ok(client) => break client,
            Err(e) if Instant::now() > deadline => return Err(etcd_err(e)),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let now = time::OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .map_err(|e| Error::Client(e.to_string()))?
        .format(&time::format_description::well_known::Rfc3339)
        .map_err(|e| Error::Client(e.to_string()))?;
    for crd in crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let uid = uuid(rand::random());
        let value = serde_json::to_vec(&stored(crd, &uid, &now)?)
            .map_err(|e| Error::Client(e.to_string()))?;
        let txn = Txn::new()
            .when([Compare::create_revision(key(&name), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key(&name), value, None)]);
        loop {
            match client.txn(txn.clone()).await {
                Ok(_) => break,
                Err(e) if Instant::now() > deadline => return Err(etcd_err(e)),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    Ok(())
}

/// A random (version 4) UUID, as the API server gives objects.
fn uuid(n: u128) -> String {
    let n = (n & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn crd() -> CustomResourceDefinition {
        serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "widgets.example.com"},
            "spec": {
                "group": "example.com",
                "names": {"kind": "Widget", "plural": "widgets", "shortNames": ["wd"]},
                "scope": "Namespaced",
                "versions": [
                    {"name": "v1alpha1", "served": true, "storage": false,
                     "schema": {"openAPIV3Schema": {"type": "object"}}},
                    {"name": "v1", "served": true, "storage": true,
                     "schema": {"openAPIV3Schema": {"type": "object"}}},
                ],
            },
        }))
        .unwrap()
    }

    #[test]
    fn stored_as_accepted_and_established_with_the_defaulted_names() {
        let got = stored(&crd(), "u", "2026-11-27T22:00:00Z").unwrap();
        assert_eq!(got["kind"], "CustomResourceDefinition");
        assert_eq!(got["metadata"]["uid"], "u");
        let names = json!({"kind": "Widget", "plural": "widgets", "shortNames": ["wd"],
                           "singular": "widget", "listKind": "WidgetList"});
        assert_eq!(got["spec"]["names"], names);
        assert_eq!(got["status"]["acceptedNames"], names);
        assert_eq!(got["status"]["storedVersions"], json!(["v1"]));
        let conditions: Vec<(&str, &str)> = got["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["type"].as_str().unwrap(), c["status"].as_str().unwrap()))
            .collect();
        assert_eq!(
            conditions,
            [("NamesAccepted", "True"), ("Established", "True")]
        );
    }

    #[test]
    fn uids_look_like_the_api_servers() {
        let u = uuid(u128::MAX);
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_eq!(&u[19..20], "b");
        assert_ne!(uuid(1), uuid(2));
    }
}
