//! The node-local API proxy: a TCP listener inside the node's network namespace, at
//! [`NODE_LOCAL_APISERVER`](crate::config::NODE_LOCAL_APISERVER), whose connections are
//! forwarded from the host to the cluster's API servers (which may listen on loopback
//! addresses a node cannot route to). TLS passes through untouched: the kubelet, kube-proxy
//! and pods authenticate to the API server themselves. A node on another machine wraps each
//! connection in TLS to its control plane's door for nodes ([`crate::entry`]).

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::Error;

/// Bind `addr` inside the network namespace at `netns` (the socket stays in that namespace).
fn bind_in_netns(netns: PathBuf, addr: SocketAddr) -> Result<TcpListener, Error> {
    crate::net::in_netns(netns, move || {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .map_err(|e| Error::io(format!("binding {addr} in the node"), e))
}

/// How connections leave for the API servers.
#[derive(Clone)]
pub(crate) enum Upstream {
    /// As they are (TCP to an API server this machine reaches).
    Plain,
    /// Each inside a TLS connection to the control plane's door for nodes
    /// ([`crate::entry`]) under this name, checked with this connector (the cluster CA).
    Wrapped(tokio_rustls::TlsConnector, ServerName<'static>),
}

/// Start forwarding `listen` (inside `netns`) to `upstreams` (from the host), trying them in
/// turn from a rotating start. Returns the task; aborting it closes the listener.
pub(crate) fn start(
    netns: PathBuf,
    listen: SocketAddr,
    upstreams: Vec<SocketAddr>,
    how: Upstream,
) -> Result<JoinHandle<()>, Error> {
    let std_listener = bind_in_netns(netns, listen)?;
    let listener = tokio::net::TcpListener::from_std(std_listener)
        .map_err(|e| Error::io("registering the proxy listener", e))?;
    let next = Arc::new(AtomicUsize::new(0));
    Ok(tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            };
            let upstreams = upstreams.clone();
            let start = next.fetch_add(1, Ordering::Relaxed);
            let how = how.clone();
            tokio::spawn(async move {
                for i in 0..upstreams.len() {
                    let up = upstreams[(start + i) % upstreams.len()];
                    let Ok(mut outbound) = TcpStream::connect(up).await else {
                        continue;
                    };
                    // A connection that ends in an error has ended: each side sees it.
                    match &how {
                        Upstream::Plain => {
                            let _ =
                                tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                        }
                        Upstream::Wrapped(tls, name) => {
                            let _ = outbound.set_nodelay(true);
                            match tls.connect(name.clone(), outbound).await {
                                Ok(mut wrapped) => {
                                    let _ =
                                        tokio::io::copy_bidirectional(&mut inbound, &mut wrapped)
                                            .await;
                                }
                                Err(e) => {
                                    tracing::warn!(upstream = %up, error = %e, "TLS with the control plane's door for nodes failed");
                                    continue;
                                }
                            }
                        }
                    }
                    return;
                }
            });
        }
    }))
}
