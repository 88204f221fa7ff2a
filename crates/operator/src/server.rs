//! `/metrics`, `/healthz` and `/readyz` over plain HTTP/1.1 (no framework needed).

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::context::{Health, Metrics};

/// Serve until `shutdown` is cancelled.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    health: Health,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    loop {
        let (mut sock, _) = tokio::select! {
            r = listener.accept() => r?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let metrics = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let (status, ctype, body) = match path {
                "/metrics" => (
                    "200 OK",
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    metrics.encode(),
                ),
                "/healthz" | "/livez" => ("200 OK", "text/plain", "ok".to_string()),
                "/readyz" => match health.problems() {
                    p if p.is_empty() => ("200 OK", "text/plain", "ok".to_string()),
                    p => (
                        "503 Service Unavailable",
                        "text/plain",
                        format!("not ready:\n{}\n", p.join("\n")),
                    ),
                },
                _ => ("404 Not Found", "text/plain", "not found".to_string()),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}
