//! The DNS server: answers from watch caches of Services and Endpoints (no API call per
//! query), over UDP and TCP, with `/healthz` and `/readyz`.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use hickory_proto::op::{Header, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, PTR, SOA, TXT};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_server::ServerFuture;
use hickory_server::authority::MessageResponseBuilder;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::records::{self, Answer, Kind, View};

/// Time to live of every answer (seconds): short, so changes show quickly.
pub const TTL: u32 = 5;

/// Errors running the server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A socket could not be opened.
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    /// The zone is not a DNS name.
    #[error("zone {0:?} is not a DNS name")]
    Zone(String),
}

/// The cluster as the watch caches see it.
#[derive(Clone)]
pub struct Caches {
    services: Store<Service>,
    endpoints: Store<Endpoints>,
}

impl View for Caches {
    fn service(&self, ns: &str, name: &str) -> Option<Arc<Service>> {
        self.services.get(&ObjectRef::new(name).within(ns))
    }
    fn endpoints(&self, ns: &str, name: &str) -> Option<Arc<Endpoints>> {
        self.endpoints.get(&ObjectRef::new(name).within(ns))
    }
    fn all_services(&self) -> Vec<Arc<Service>> {
        self.services.state()
    }
    fn all_endpoints(&self) -> Vec<Arc<Endpoints>> {
        self.endpoints.state()
    }
}

impl Caches {
    /// Start watching Services and Endpoints in every namespace.
    pub fn watch(client: &kube::Client) -> Caches {
        let (services, w) = reflector::store();
        let stream = reflector::reflector(
            w,
            watcher(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(stream.for_each(|_| async {}));
        let (endpoints, w) = reflector::store();
        let stream = reflector::reflector(
            w,
            watcher(
                Api::<Endpoints>::all(client.clone()),
                watcher::Config::default(),
            ),
        )
        .default_backoff()
        .applied_objects();
        tokio::spawn(stream.for_each(|_| async {}));
        Caches {
            services,
            endpoints,
        }
    }

    /// Wait until both caches have listed once.
    pub async fn ready(&self) {
        let _ = self.services.wait_until_ready().await;
        let _ = self.endpoints.wait_until_ready().await;
    }
}

/// Answers queries in `zone` from a [`View`].
pub struct Handler<V> {
    view: V,
    zone: String,
    soa: Record,
}

impl<V: View + Send + Sync + Unpin + 'static> Handler<V> {
    /// A handler for `zone` (`cluster.local`).
    pub fn new(view: V, zone: &str) -> Result<Handler<V>, Error> {
        let zone = zone.trim_end_matches('.').to_ascii_lowercase();
        let origin = Name::from_str(&format!("{zone}.")).map_err(|_| Error::Zone(zone.clone()))?;
        let ns =
            Name::from_str(&format!("ns.dns.{zone}.")).map_err(|_| Error::Zone(zone.clone()))?;
        let mbox = Name::from_str(&format!("hostmaster.{zone}."))
            .map_err(|_| Error::Zone(zone.clone()))?;
        let soa = Record::from_rdata(
            origin,
            TTL,
            RData::SOA(SOA::new(ns, mbox, 1, 7200, 1800, 86400, TTL)),
        );
        Ok(Handler { view, zone, soa })
    }
}

#[async_trait::async_trait]
impl<V: View + Send + Sync + Unpin + 'static> RequestHandler for Handler<V> {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let builder = MessageResponseBuilder::from_message_request(request);
        let mut header = Header::response_from_request(request.header());
        let Ok(info) = request.request_info() else {
            header.set_response_code(ResponseCode::FormErr);
            let msg = builder.build_no_records(header);
            return response.send_response(msg).await.unwrap_or(header.into());
        };
        let name = info.query.original().name().clone();
        let kind = match info.query.query_type() {
            RecordType::A => Kind::A,
            RecordType::AAAA => Kind::Aaaa,
            RecordType::TXT => Kind::Txt,
            RecordType::PTR => Kind::Ptr,
            _ => Kind::Other,
        };
        let answer = records::lookup(&self.view, &self.zone, &name.to_ascii(), kind);
        let mut answers = Vec::new();
        let mut soa = Vec::new();
        header.set_authoritative(true);
        match answer {
            Answer::Addresses(ips) => {
                for ip in ips {
                    let rdata = match ip {
                        IpAddr::V4(v4) => RData::A(A(v4)),
                        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
                    };
                    answers.push(Record::from_rdata(name.clone(), TTL, rdata));
                }
            }
            Answer::Text(t) => {
                answers.push(Record::from_rdata(
                    name.clone(),
                    TTL,
                    RData::TXT(TXT::new(vec![t])),
                ));
            }
            Answer::Names(names) => {
                for n in names {
                    if let Ok(target) = Name::from_str(&format!("{n}.")) {
                        answers.push(Record::from_rdata(
                            name.clone(),
                            TTL,
                            RData::PTR(PTR(target)),
                        ));
                    }
                }
            }
            Answer::NoData => soa.push(self.soa.clone()),
            Answer::NxDomain => {
                header.set_response_code(ResponseCode::NXDomain);
                soa.push(self.soa.clone());
            }
            Answer::NotInZone => {
                header.set_authoritative(false);
                header.set_response_code(ResponseCode::Refused);
            }
        }
        let msg = builder.build(header, answers.iter(), [], soa.iter(), []);
        response.send_response(msg).await.unwrap_or(header.into())
    }
}

/// Serve `zone` on `dns` (UDP and TCP) from the cluster `client` talks to, with `/healthz`
/// and `/readyz` (ready once the caches have listed) on `health`. Runs until the process ends.
pub async fn serve(
    client: kube::Client,
    zone: &str,
    dns: SocketAddr,
    health: SocketAddr,
) -> Result<(), Error> {
    let caches = Caches::watch(&client);
    let ready = Arc::new(AtomicBool::new(false));
    let health_listener = tokio::net::TcpListener::bind(health)
        .await
        .map_err(|e| Error::Io(format!("binding {health}"), e))?;
    tokio::spawn(serve_health(health_listener, ready.clone()));
    let mut server = ServerFuture::new(Handler::new(caches.clone(), zone)?);
    let udp = tokio::net::UdpSocket::bind(dns)
        .await
        .map_err(|e| Error::Io(format!("binding {dns}/udp"), e))?;
    let tcp = tokio::net::TcpListener::bind(dns)
        .await
        .map_err(|e| Error::Io(format!("binding {dns}/tcp"), e))?;
    server.register_socket(udp);
    server.register_listener(tcp, Duration::from_secs(5));
    caches.ready().await;
    ready.store(true, Ordering::Relaxed);
    tracing::info!(%dns, zone, "serving cluster DNS");
    server
        .block_until_done()
        .await
        .map_err(|e| Error::Io("serving".into(), std::io::Error::other(e.to_string())))
}

async fn serve_health(listener: tokio::net::TcpListener, ready: Arc<AtomicBool>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let ready = ready.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let ok = match path {
                "/healthz" | "/livez" => true,
                "/readyz" => ready.load(Ordering::Relaxed),
                _ => false,
            };
            let (status, body) = if ok {
                ("200 OK", "ok")
            } else {
                ("503 Service Unavailable", "not ready")
            };
            let _ = sock
                .write_all(
                    format!(
                        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        });
    }
}
