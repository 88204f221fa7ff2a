//! `/metrics`, `/healthz` and `/readyz` of the operator, on the shared health server.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::context::{Health, Metrics};

struct Operator {
    metrics: Metrics,
    health: Health,
}

impl nestplane_health::Probe for Operator {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }
    fn problems(&self) -> Vec<String> {
        self.health.problems()
    }
}

/// Serve until `shutdown` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    nestplane_health::serve(
        listener,
        Arc::new(Operator { metrics, health }),
        nestplane_health::Limits::default(),
        shutdown,
    )
    .await;
    Ok(())
}
