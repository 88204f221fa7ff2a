//! A node's join as its cluster sees it: when the kubelet's certificate request appeared, was
//! approved and was signed, when the Node registered, and when it became `Ready` (with the
//! reasons it gave while it was not). For benchmarks and `nestplane up --exit-when-ready`:
//! where the seconds go, measured rather than guessed.
//!
//! The cluster is polled every 100 ms (two list requests); a step's time is when it was first
//! seen, so each is at most that much late.

use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;

/// Steps seen, in the order they were first seen, from `since`.
pub type Steps = Vec<(String, Duration)>;

/// Which nodes to follow.
#[derive(Clone, Debug)]
pub enum Nodes {
    /// The node of this name.
    Named(String),
    /// Any nodes, until this many are `Ready`.
    Count(usize),
}

impl Nodes {
    fn matches(&self, node: &str) -> bool {
        match self {
            Nodes::Named(n) => n == node,
            Nodes::Count(_) => true,
        }
    }

    fn wanted(&self) -> usize {
        match self {
            Nodes::Named(_) => 1,
            Nodes::Count(n) => *n,
        }
    }
}

/// Whether `csr` is a node's kubelet's request for `signer`
/// (`kubernetes.io/kube-apiserver-client-kubelet` or `kubernetes.io/kubelet-serving`): its
/// request names `system:node:<node>`, for a node `nodes` follows.
fn of_node(csr: &CertificateSigningRequest, nodes: &Nodes, signer: &str) -> bool {
    csr.spec.signer_name == signer
        && std::str::from_utf8(&csr.spec.request.0)
            .ok()
            .and_then(|pem| nestplane_pki::csr_subject(pem).ok())
            .and_then(|(cn, _)| cn.strip_prefix("system:node:").map(|n| nodes.matches(n)))
            .unwrap_or(false)
}

fn approved(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Approved"))
}

fn signed(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.certificate.as_ref())
        .is_some_and(|c| !c.0.is_empty())
}

/// The Node's `Ready` condition: its status and reason.
fn ready(node: &Node) -> Option<(String, String)> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| {
            let why = c.message.as_deref().or(c.reason.as_deref()).unwrap_or("");
            // The first clause names what is missing; the rest repeats it.
            let why = why.trim_start_matches('[');
            let why = why.split([',', ';']).next().unwrap_or(why).trim();
            (c.status.clone(), why.to_string())
        })
}

/// Follow `nodes` joining through `client` until they are `Ready` or `timeout` passes;
/// returns the steps seen (each the first time any followed node reached it, and `node
/// Ready` when all are).
pub async fn observe(
    client: kube::Client,
    nodes: Nodes,
    since: Instant,
    timeout: Duration,
) -> Steps {
    let csrs: Api<CertificateSigningRequest> = Api::all(client.clone());
    let node_api: Api<Node> = Api::all(client);
    let mut steps: Steps = Vec::new();
    let see = |steps: &mut Steps, what: String| {
        if !steps.iter().any(|(w, _)| *w == what) {
            steps.push((what, since.elapsed()));
        }
    };
    while since.elapsed() < timeout {
        if let Ok(list) = csrs.list(&ListParams::default()).await {
            for (signer, short) in [
                ("kubernetes.io/kube-apiserver-client-kubelet", "client"),
                ("kubernetes.io/kubelet-serving", "serving"),
            ] {
                for csr in list.items.iter().filter(|c| of_node(c, &nodes, signer)) {
                    see(&mut steps, format!("{short} certificate requested"));
                    if approved(csr) {
                        see(&mut steps, format!("{short} certificate approved"));
                    }
                    if signed(csr) {
                        see(&mut steps, format!("{short} certificate signed"));
                    }
                }
            }
        }
        if let Ok(list) = node_api.list(&ListParams::default()).await {
            let mut ready = 0;
            for node in list
                .items
                .iter()
                .filter(|n| nodes.matches(n.metadata.name.as_deref().unwrap_or_default()))
            {
                see(&mut steps, "node registered".into());
                match self::ready(node) {
                    Some((status, _)) if status == "True" => ready += 1,
                    Some((_, why)) if !why.is_empty() => {
                        see(&mut steps, format!("not ready: {why}"));
                    }
                    _ => {}
                }
            }
            if ready >= nodes.wanted() {
                see(&mut steps, "node Ready".into());
                return steps;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    steps
}

/// `step=seconds` pairs on one line, in time order.
pub fn format(steps: &[(String, Duration)]) -> String {
    let mut sorted: Vec<_> = steps.iter().collect();
    sorted.sort_by_key(|(_, d)| *d);
    sorted
        .iter()
        .map(|(w, d)| format!("{w}={:.2}", d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_reads_in_time_order() {
        let steps = vec![
            ("node Ready".to_string(), Duration::from_millis(8140)),
            ("files".to_string(), Duration::from_millis(10)),
            ("node registered".to_string(), Duration::from_millis(6020)),
        ];
        assert_eq!(
            format(&steps),
            "files=0.01, node registered=6.02, node Ready=8.14"
        );
    }

    #[test]
    fn a_named_node_is_followed_alone_and_a_count_follows_any() {
        let one = Nodes::Named("a".into());
        assert!(one.matches("a") && !one.matches("b"));
        assert_eq!(one.wanted(), 1);
        let any = Nodes::Count(3);
        assert!(any.matches("a") && any.matches("b"));
        assert_eq!(any.wanted(), 3);
    }
}
