//! The DNS server: answers from watch caches of Services and Endpoints (no API call per
//! query), over UDP and TCP; forwards names outside the zone to upstream resolvers; serves
//! `/healthz`, `/readyz` and Prometheus `/metrics`.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hickory_proto::op::{Header, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, PTR, SOA, SRV, TXT};
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

/// How long an upstream resolver has to answer a forwarded query.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);

/// Answers queries in `zone` from a [`View`]; forwards everything else to `upstreams`.
pub struct Handler<V> {
    view: V,
    zone: String,
    soa: Record,
    upstreams: Vec<SocketAddr>,
    metrics: Arc<Metrics>,
    next_id: AtomicU16,
}

impl<V: View + Send + Sync + Unpin + 'static> Handler<V> {
    /// A handler for `zone` (`cluster.local`) forwarding other names to `upstreams` (none:
    /// other names are refused).
    pub fn new(
        view: V,
        zone: &str,
        upstreams: Vec<SocketAddr>,
        metrics: Arc<Metrics>,
    ) -> Result<Handler<V>, Error> {
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
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u16)
            .unwrap_or(1);
        Ok(Handler {
            view,
            zone,
            soa,
            upstreams,
            metrics,
            next_id: AtomicU16::new(seed),
        })
    }

    /// Ask the upstream resolvers, one after the other, for `name` (`rtype`): the first
    /// answer wins. `None` when none answers.
    async fn forward(&self, name: &Name, rtype: RecordType) -> Option<Message> {
        for upstream in &self.upstreams {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let mut m = Message::new();
            m.set_id(id)
                .set_message_type(MessageType::Query)
                .set_op_code(OpCode::Query)
                .set_recursion_desired(true)
                .add_query(Query::query(name.clone(), rtype));
            let Ok(bytes) = m.to_vec() else {
                return None;
            };
            let local: SocketAddr = if upstream.is_ipv4() {
                ([0, 0, 0, 0], 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let Ok(sock) = tokio::net::UdpSocket::bind(local).await else {
                continue;
            };
            if sock.send_to(&bytes, upstream).await.is_err() {
                continue;
            }
            let mut buf = vec![0u8; 4096];
            let answer = tokio::time::timeout(UPSTREAM_TIMEOUT, async {
                loop {
                    let (n, from) = sock.recv_from(&mut buf).await.ok()?;
                    if from != *upstream {
                        continue;
                    }
                    match Message::from_vec(&buf[..n]) {
                        Ok(r) if r.id() == id => return Some(r),
                        _ => continue,
                    }
                }
            })
            .await;
            match answer {
                Ok(Some(r)) => return Some(r),
                _ => tracing::debug!(%upstream, %name, "upstream resolver did not answer"),
            }
        }
        None
    }

    /// The answer records of `answer` for `name`, and the response code and authority
    /// section that go with it.
    async fn answer(
        &self,
        name: &Name,
        rtype: RecordType,
        answer: Answer,
    ) -> (ResponseCode, bool, Vec<Record>, Vec<Record>) {
        let mut records = Vec::new();
        match answer {
            Answer::Addresses(ips) => {
                records.extend(ips.into_iter().map(|ip| address(name, ip)));
            }
            Answer::Text(t) => {
                records.push(Record::from_rdata(
                    name.clone(),
                    TTL,
                    RData::TXT(TXT::new(vec![t])),
                ));
            }
            Answer::Names(names) => {
                for n in names {
                    if let Ok(target) = Name::from_str(&format!("{n}.")) {
                        records.push(Record::from_rdata(
                            name.clone(),
                            TTL,
                            RData::PTR(PTR(target)),
                        ));
                    }
                }
            }
            Answer::Locations(locations) => {
                for l in locations {
                    if let Ok(target) = Name::from_str(&format!("{}.", l.target)) {
                        records.push(Record::from_rdata(
                            name.clone(),
                            TTL,
                            RData::SRV(SRV::new(0, l.weight, l.port, target)),
                        ));
                    }
                }
            }
            Answer::Alias(target) => {
                let Ok(target) = Name::from_str(&format!("{target}.")) else {
                    return (ResponseCode::ServFail, true, records, vec![]);
                };
                records.push(Record::from_rdata(
                    name.clone(),
                    TTL,
                    RData::CNAME(CNAME(target.clone())),
                ));
                // The alias's own records, as a recursive resolver would give them.
                if matches!(rtype, RecordType::A | RecordType::AAAA) {
                    let kind = kind_of(rtype);
                    match records::lookup(&self.view, &self.zone, &target.to_ascii(), kind) {
                        Answer::NotInZone => {
                            if let Some(r) = self.forward(&target, rtype).await {
                                records.extend(r.answers().iter().cloned());
                            }
                        }
                        Answer::Addresses(ips) => {
                            records.extend(ips.into_iter().map(|ip| address(&target, ip)));
                        }
                        _ => {}
                    }
                }
            }
            Answer::NoData => {
                return (ResponseCode::NoError, true, records, vec![self.soa.clone()]);
            }
            Answer::NxDomain => {
                return (
                    ResponseCode::NXDomain,
                    true,
                    records,
                    vec![self.soa.clone()],
                );
            }
            Answer::NotInZone => {
                if self.upstreams.is_empty() {
                    return (ResponseCode::Refused, false, records, vec![]);
                }
                return match self.forward(name, rtype).await {
                    Some(r) => (
                        r.response_code(),
                        false,
                        r.answers().to_vec(),
                        r.name_servers().to_vec(),
                    ),
                    None => (ResponseCode::ServFail, false, records, vec![]),
                };
            }
        }
        (ResponseCode::NoError, true, records, vec![])
    }
}

/// An `A` or `AAAA` record of `name`.
fn address(name: &Name, ip: IpAddr) -> Record {
    let rdata = match ip {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    };
    Record::from_rdata(name.clone(), TTL, rdata)
}

fn kind_of(rtype: RecordType) -> Kind {
    match rtype {
        RecordType::A => Kind::A,
        RecordType::AAAA => Kind::Aaaa,
        RecordType::TXT => Kind::Txt,
        RecordType::PTR => Kind::Ptr,
        RecordType::SRV => Kind::Srv,
        RecordType::CNAME => Kind::Cname,
        _ => Kind::Other,
    }
}

#[async_trait::async_trait]
impl<V: View + Send + Sync + Unpin + 'static> RequestHandler for Handler<V> {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let started = Instant::now();
        let builder = MessageResponseBuilder::from_message_request(request);
        let mut header = Header::response_from_request(request.header());
        let Ok(info) = request.request_info() else {
            header.set_response_code(ResponseCode::FormErr);
            self.metrics
                .observe("other", ResponseCode::FormErr, started.elapsed());
            let msg = builder.build_no_records(header);
            return response.send_response(msg).await.unwrap_or(header.into());
        };
        let name = info.query.original().name().clone();
        let rtype = info.query.query_type();
        let answer = records::lookup(&self.view, &self.zone, &name.to_ascii(), kind_of(rtype));
        let (code, authoritative, answers, authority) = self.answer(&name, rtype, answer).await;
        header.set_response_code(code);
        header.set_authoritative(authoritative);
        header.set_recursion_available(!self.upstreams.is_empty());
        self.metrics.observe(
            &rtype.to_string().to_ascii_lowercase(),
            code,
            started.elapsed(),
        );
        let msg = builder.build(header, answers.iter(), [], authority.iter(), []);
        response.send_response(msg).await.unwrap_or(header.into())
    }
}

/// Upper bounds (seconds) of the latency histogram's buckets.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0,
];

/// Prometheus metrics of the server: queries by type and response code, and latency.
#[derive(Debug, Default)]
pub struct Metrics {
    queries: Mutex<BTreeMap<(String, String), u64>>,
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Metrics {
    /// Count one answered query.
    pub fn observe(&self, qtype: &str, code: ResponseCode, took: Duration) {
        let rcode = match code {
            ResponseCode::NoError => "NOERROR".to_string(),
            ResponseCode::FormErr => "FORMERR".into(),
            ResponseCode::ServFail => "SERVFAIL".into(),
            ResponseCode::NXDomain => "NXDOMAIN".into(),
            ResponseCode::NotImp => "NOTIMP".into(),
            ResponseCode::Refused => "REFUSED".into(),
            other => u16::from(other).to_string(),
        };
        if let Ok(mut q) = self.queries.lock() {
            *q.entry((qtype.to_string(), rcode)).or_default() += 1;
        }
        let secs = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// The metrics in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "# HELP nestplane_dns_queries_total DNS queries answered, by query type and response code.\n# TYPE nestplane_dns_queries_total counter\n",
        );
        if let Ok(q) = self.queries.lock() {
            for ((t, r), n) in q.iter() {
                out.push_str(&format!(
                    "nestplane_dns_queries_total{{type=\"{t}\",rcode=\"{r}\"}} {n}\n"
                ));
            }
        }
        out.push_str("# HELP nestplane_dns_request_duration_seconds Time to answer a query.\n# TYPE nestplane_dns_request_duration_seconds histogram\n");
        for (i, b) in BUCKETS.iter().enumerate() {
            out.push_str(&format!(
                "nestplane_dns_request_duration_seconds_bucket{{le=\"{b}\"}} {}\n",
                self.buckets[i].load(Ordering::Relaxed)
            ));
        }
        let count = self.count.load(Ordering::Relaxed);
        out.push_str(&format!(
            "nestplane_dns_request_duration_seconds_bucket{{le=\"+Inf\"}} {count}\nnestplane_dns_request_duration_seconds_sum {}\nnestplane_dns_request_duration_seconds_count {count}\n",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out
    }
}

/// The name servers of a `resolv.conf` (port 53), leaving out `except` (this server's own
/// address, so that it never forwards to itself). Pure.
pub fn upstreams_from_resolv_conf(text: &str, except: SocketAddr) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next())?
        })
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .filter(|a| *a != except)
        .collect()
}

/// Serve `zone` on `dns` (UDP and TCP) from the cluster `client` talks to, forwarding other
/// names to `upstreams`, with `/healthz`, `/readyz` (ready once the caches have listed) and
/// `/metrics` on `health`. Runs until the process ends.
pub async fn serve(
    client: kube::Client,
    zone: &str,
    dns: SocketAddr,
    health: SocketAddr,
    upstreams: Vec<SocketAddr>,
) -> Result<(), Error> {
    let caches = Caches::watch(&client);
    let ready = Arc::new(AtomicBool::new(false));
    let metrics = Arc::new(Metrics::default());
    let health_listener = tokio::net::TcpListener::bind(health)
        .await
        .map_err(|e| Error::Io(format!("binding {health}"), e))?;
    tokio::spawn(serve_health(
        health_listener,
        ready.clone(),
        metrics.clone(),
    ));
    let mut server = ServerFuture::new(Handler::new(
        caches.clone(),
        zone,
        upstreams.clone(),
        metrics,
    )?);
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
    tracing::info!(%dns, zone, ?upstreams, "serving cluster DNS");
    server
        .block_until_done()
        .await
        .map_err(|e| Error::Io("serving".into(), std::io::Error::other(e.to_string())))
}

async fn serve_health(
    listener: tokio::net::TcpListener,
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let ready = ready.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let n = sock.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let ok = match path {
                "/healthz" | "/livez" | "/metrics" => true,
                "/readyz" => ready.load(Ordering::Relaxed),
                _ => false,
            };
            let (status, body) = match (ok, path) {
                (true, "/metrics") => ("200 OK", metrics.render()),
                (true, _) => ("200 OK", "ok".to_string()),
                _ => ("503 Service Unavailable", "not ready".to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams_come_from_resolv_conf_without_this_server() {
        let me: SocketAddr = "10.96.0.10:53".parse().expect("addr");
        let got = upstreams_from_resolv_conf(
            "# a comment\nsearch x\nnameserver 10.201.3.1\nnameserver 10.96.0.10\nnameserver ::1\nnameserver bogus\noptions ndots:5\n",
            me,
        );
        assert_eq!(
            got,
            vec![
                "10.201.3.1:53".parse::<SocketAddr>().expect("addr"),
                "[::1]:53".parse().expect("addr")
            ]
        );
    }

    #[test]
    fn metrics_count_queries_by_type_and_code_with_latency() {
        let m = Metrics::default();
        m.observe("a", ResponseCode::NoError, Duration::from_micros(300));
        m.observe("a", ResponseCode::NoError, Duration::from_millis(3));
        m.observe("srv", ResponseCode::NXDomain, Duration::from_micros(50));
        let text = m.render();
        assert!(
            text.contains("nestplane_dns_queries_total{type=\"a\",rcode=\"NOERROR\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("nestplane_dns_queries_total{type=\"srv\",rcode=\"NXDOMAIN\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("nestplane_dns_request_duration_seconds_bucket{le=\"0.0005\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("nestplane_dns_request_duration_seconds_count 3"),
            "{text}"
        );
    }
}
