//! Clients that connect and send nothing (or half a request), or ask and never read the
//! answer, cannot keep the health endpoints from answering others, and are closed once their
//! time is up.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use nestplane_health::{Limits, Probe};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

struct Ready;

impl Probe for Ready {
    fn metrics(&self) -> String {
        // Larger than what the kernel buffers for a client that never reads.
        format!("{}# EOF\n", "# padding\n".repeat(400_000))
    }
    fn problems(&self) -> Vec<String> {
        vec![]
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn idle_and_half_sent_requests_cannot_keep_a_prober_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = Limits {
        header_timeout: Duration::from_secs(2),
        connection_timeout: Duration::from_secs(10),
        max_connections: 8,
    };
    let stop = CancellationToken::new();
    tokio::spawn(nestplane_health::serve(
        listener,
        Arc::new(Ready),
        limits,
        stop.clone(),
    ));

    // Four times the connection limit: asking for /metrics and never reading the answer.
    let mut readers = Vec::new();
    for _ in 0..32 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        readers.push(s);
    }
    // Ten times the connection limit, half of them silent, half stuck mid-header.
    let mut held = Vec::new();
    for i in 0..80 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        if i % 2 == 1 {
            s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        held.push(s);
    }
    // A prober is answered at once, again and again.
    for _ in 0..3 {
        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(1), get(addr, "/healthz"))
            .await
            .expect("/healthz answered within a second while 80 clients hold connections");
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));

    // The idle connections are closed: by eviction, or at the latest when the header time is
    // up.
    for mut s in held {
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("an idle connection is closed within the header timeout");
        // Closed (0, or reset), or told its request timed out.
        if let Ok(n) = n {
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
        }
    }
    drop(readers);
    stop.cancel();
}
