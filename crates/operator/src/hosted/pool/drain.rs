//! Taking a node out of its cluster: cordon, drain (evictions that PodDisruptionBudgets may
//! refuse, until a timeout; then the pods are deleted) and delete its Node.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams};

/// Whether a pod is left alone by a drain (a DaemonSet's, a static pod's, or finished). Pure.
pub fn drain_skips(p: &Pod) -> bool {
    let daemon = p
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet");
    let mirror = p.annotations().contains_key("kubernetes.io/config.mirror");
    let finished = p
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
    daemon || mirror || finished
}

/// Cordon and drain `node`; returns the pods the timeout deleted (`ns/name`). `on_block` is
/// told once which pods a PodDisruptionBudget kept. A Node that is gone is drained.
pub async fn drain<F, Fut>(
    client: &kube::Client,
    node: &str,
    timeout: Duration,
    on_block: F,
) -> Result<Vec<String>, String>
where
    F: FnOnce(Vec<String>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut on_block = Some(on_block);
    let nodes: Api<KubeNode> = Api::all(client.clone());
    match nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(vec![]),
        Err(e) => return Err(format!("cordoning: {e}")),
    }
    let deadline = Instant::now() + timeout;
    let mut forced = Vec::new();
    let pods: Api<Pod> = Api::all(client.clone());
    loop {
        let list = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|e| format!("listing pods: {e}"))?;
        let left: Vec<Pod> = list.items.into_iter().filter(|p| !drain_skips(p)).collect();
        if left.is_empty() {
            return Ok(forced);
        }
        let force = Instant::now() > deadline;
        let mut blocked = Vec::new();
        for p in &left {
            let ns = p.namespace().unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            if force {
                // A pod that could not be deleted is listed again on the next round.
                if api
                    .delete(&p.name_any(), &DeleteParams::default().grace_period(0))
                    .await
                    .is_ok()
                {
                    forced.push(format!("{ns}/{}", p.name_any()));
                }
            } else if p.metadata.deletion_timestamp.is_none() {
                // 429: a PodDisruptionBudget says not now; tried again below. Other failures
                // are tried again too.
                if let Err(kube::Error::Api(e)) =
                    api.evict(&p.name_any(), &EvictParams::default()).await
                    && e.code == 429
                {
                    blocked.push(format!("{ns}/{}", p.name_any()));
                }
            }
        }
        if !blocked.is_empty()
            && let Some(f) = on_block.take()
        {
            f(blocked).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Delete a Node object; one already gone is deleted.
pub async fn delete_node(client: &kube::Client, node: &str) -> Result<(), kube::Error> {
    match Api::<KubeNode>::all(client.clone())
        .delete(node, &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}
