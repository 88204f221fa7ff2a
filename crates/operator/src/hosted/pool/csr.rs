//! Approving the certificates of a pool's kubelets, and nobody else's.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};

use super::machines::Machine;
use crate::hosted::plan;

/// Approve pending kubelet certificate requests of `machines` (the nodes `owner` made, as
/// `"NodePool <namespace/name>"`; `reason` is the approval's),
/// and nobody else's: a client certificate when the request comes with the bootstrap token
/// made for the node it names; a serving certificate when the node asks with its own
/// credential for its own name and address ([`plan::judge_serving_request`]). Every other
/// request stays pending. Failures are logged: the next pass tries again.
pub async fn approve(client: &kube::Client, owner: &str, reason: &str, machines: &[Machine]) {
    let tokens: HashMap<String, String> = machines
        .iter()
        .map(|m| (format!("system:bootstrap:{}", m.token_id), m.name.clone()))
        .collect();
    let addresses: HashMap<String, Ipv4Addr> = machines
        .iter()
        .filter_map(|m| Some((m.name.clone(), m.ip?)))
        .collect();
    if tokens.is_empty() {
        return;
    }
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let list = match api.list(&ListParams::default()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(%owner, error = %e, "listing certificate requests failed");
            return;
        }
    };
    for mut csr in list.items {
        let decided = csr
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| !c.is_empty());
        if decided {
            continue;
        }
        let Some((node, what)) = judge(&csr, &tokens, &addresses) else {
            continue;
        };
        let name = csr.name_any();
        let status = csr.status.get_or_insert_with(Default::default);
        status.conditions = Some(vec![CertificateSigningRequestCondition {
            type_: "Approved".into(),
            status: "True".into(),
            reason: Some(reason.into()),
            message: Some(format!("node {node} of {owner}, {what}")),
            ..Default::default()
        }]);
        match api
            .replace_subresource("approval", &name, &PostParams::default(), &csr)
            .await
        {
            Ok(_) => tracing::info!(csr = %name, %node, "approved"),
            Err(e) => tracing::warn!(csr = %name, error = %e, "approving failed"),
        }
    }
}

/// Which node of the pool a pending request is for, and why it may be approved; `None`
/// leaves it pending.
fn judge(
    csr: &CertificateSigningRequest,
    tokens: &HashMap<String, String>,
    addresses: &HashMap<String, Ipv4Addr>,
) -> Option<(String, &'static str)> {
    let requester = csr.spec.username.clone().unwrap_or_default();
    let pem = String::from_utf8_lossy(&csr.spec.request.0).into_owned();
    match csr.spec.signer_name.as_str() {
        plan::KUBELET_CLIENT_SIGNER => {
            let node = tokens.get(&requester)?;
            match nestplane_pki::csr_subject(&pem) {
                Ok((cn, orgs))
                    if cn == format!("system:node:{node}") && orgs == ["system:nodes"] =>
                {
                    Some((node.clone(), "joining with the token made for it"))
                }
                _ => {
                    tracing::warn!(csr = %csr.name_any(), %node, "a request with node {node}'s token asks for something else; not approved");
                    None
                }
            }
        }
        plan::KUBELET_SERVING_SIGNER => {
            let node = requester.strip_prefix("system:node:")?;
            let ip = *addresses.get(node)?;
            let usages = csr.spec.usages.clone().unwrap_or_default();
            let verdict = nestplane_pki::csr_info(&pem)
                .map_err(|e| e.to_string())
                .and_then(|info| plan::judge_serving_request(&requester, &usages, &info, node, ip));
            if let Err(why) = verdict {
                tracing::warn!(csr = %csr.name_any(), %node, reason = %why, "a serving certificate request of node {node} not approved");
                return None;
            }
            Some((node.to_string(), "serving on its own name and address"))
        }
        _ => None,
    }
}
