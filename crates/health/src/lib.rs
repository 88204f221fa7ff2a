//! One small HTTP server for every health and metrics endpoint nestplane serves (the
//! operator's, the cluster DNS server's): `/healthz`, `/livez`, `/readyz` and `/metrics`,
//! on `hyper`.
//!
//! What a hostile or broken client can do is bounded:
//! - a request's header must arrive within [`Limits::header_timeout`], and a connection lives
//!   at most [`Limits::connection_timeout`], writing its answer included (one request per
//!   connection);
//! - at most [`Limits::max_connections`] connections are open; when a new one arrives at the
//!   limit, the oldest connection of the address that holds the most is closed, whatever it is
//!   doing. A prober holds one connection for milliseconds, so a client that opens many and
//!   sends nothing, or never reads its answers, closes its own;
//! - a failed `accept` (no file descriptors left) waits a moment instead of spinning.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What the endpoints report.
pub trait Probe: Send + Sync + 'static {
    /// The body of `/metrics`, in the OpenMetrics text format.
    fn metrics(&self) -> String;
    /// Why the process is not ready (`/readyz` fails with these); empty when it is.
    fn problems(&self) -> Vec<String>;
}

/// Bounds on what one client may hold.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Time for a request's header to arrive.
    pub header_timeout: Duration,
    /// Time a connection may stay open in all.
    pub connection_timeout: Duration,
    /// Open connections at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(10),
            max_connections: 64,
        }
    }
}

/// The open connections, oldest first: an id, the peer's address, and what closes it.
#[derive(Default)]
struct Open {
    conns: Mutex<VecDeque<(u64, IpAddr, CancellationToken)>>,
}

impl Open {
    fn add(&self, id: u64, peer: IpAddr, token: CancellationToken) {
        self.lock().push_back((id, peer, token));
    }

    fn remove(&self, id: u64) {
        self.lock().retain(|(i, _, _)| *i != id);
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Close the oldest connection of the address that holds the most.
    fn evict(&self) {
        let mut conns = self.lock();
        let peers: Vec<IpAddr> = conns.iter().map(|(_, p, _)| *p).collect();
        if let Some((_, _, token)) = victim(&peers).and_then(|i| conns.remove(i)) {
            token.cancel();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, IpAddr, CancellationToken)>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Which of the open connections (their peers, oldest first) to close: the oldest of the
/// peer that holds the most. Pure.
fn victim(peers: &[IpAddr]) -> Option<usize> {
    let mut count: HashMap<IpAddr, usize> = HashMap::new();
    for p in peers {
        *count.entry(*p).or_default() += 1;
    }
    let most = count.values().copied().max()?;
    peers.iter().position(|p| count[p] == most)
}

/// The response to one request. Pure.
fn respond(probe: &dyn Probe, method: &Method, path: &str) -> Response<Full<Bytes>> {
    let text = "text/plain; charset=utf-8";
    let (status, ctype, body) = if method != Method::GET && method != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            text,
            "GET only\n".to_string(),
        )
    } else {
        match path {
            "/healthz" | "/livez" => (StatusCode::OK, text, "ok\n".to_string()),
            "/readyz" => match probe.problems() {
                p if p.is_empty() => (StatusCode::OK, text, "ok\n".to_string()),
                p => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    text,
                    format!("not ready:\n{}\n", p.join("\n")),
                ),
            },
            "/metrics" => (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                probe.metrics(),
            ),
            _ => (StatusCode::NOT_FOUND, text, "not found\n".to_string()),
        }
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(ctype) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// Serve the endpoints on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    probe: Arc<dyn Probe>,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let open = Arc::new(Open::default());
    let ids = AtomicU64::new(0);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.cancelled() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, most likely: give the open ones time to end.
                tracing::debug!(error = %e, "accepting a health connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.len() >= limits.max_connections {
            open.evict();
        }
        let id = ids.fetch_add(1, Ordering::Relaxed);
        let token = shutdown.child_token();
        open.add(id, peer.ip(), token.clone());
        let (probe, open) = (probe.clone(), open.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let r = respond(probe.as_ref(), req.method(), req.uri().path());
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "health connection");
                    }
                }
                _ = token.cancelled() => {}
                _ = tokio::time::sleep(limits.connection_timeout) => {}
            }
            open.remove(id);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Vec<String>);

    impl Probe for Fixed {
        fn metrics(&self) -> String {
            "# EOF\n".into()
        }
        fn problems(&self) -> Vec<String> {
            self.0.clone()
        }
    }

    #[test]
    fn the_address_holding_the_most_connections_loses_its_oldest() {
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        let prober: IpAddr = "10.0.0.9".parse().expect("ip");
        assert_eq!(victim(&[prober, a, b, a, a, b]), Some(1));
        assert_eq!(victim(&[prober, b, b, a]), Some(1));
        // All even: the oldest goes (a prober's connection is the newest).
        assert_eq!(victim(&[a, b, prober]), Some(0));
        assert_eq!(victim(&[]), None);
    }

    #[test]
    fn readyz_lists_the_problems_and_other_paths_are_not_found() {
        let bad = Fixed(vec!["watch of Foo failing".into()]);
        assert_eq!(
            respond(&bad, &Method::GET, "/readyz").status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            respond(&bad, &Method::GET, "/healthz").status(),
            StatusCode::OK
        );
        let good = Fixed(vec![]);
        assert_eq!(
            respond(&good, &Method::GET, "/readyz").status(),
            StatusCode::OK
        );
        assert_eq!(
            respond(&good, &Method::GET, "/metrics").headers()[hyper::header::CONTENT_TYPE],
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        assert_eq!(
            respond(&good, &Method::GET, "/secret").status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            respond(&good, &Method::POST, "/healthz").status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
    }
}
