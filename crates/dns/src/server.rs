//! The DNS server: answers from watch caches of Services and Endpoints (no API call per
//! query), over UDP and TCP; forwards names outside the zone to upstream resolvers; serves
//! `/healthz`, `/readyz` and Prometheus `/metrics`.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hickory_proto::op::{Edns, Header, Metadata, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, PTR, SOA, SRV, TXT};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_resolver::Resolver;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig};
use hickory_resolver::net::runtime::{Time, TokioRuntimeProvider};
use hickory_resolver::net::{DnsError, NetError};
use hickory_server::Server;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use kube::Api;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

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
        // A store whose writer is gone never becomes ready; serving goes on without it.
        let _ = self.services.wait_until_ready().await;
        // A store whose writer is gone never becomes ready; serving goes on without it.
        let _ = self.endpoints.wait_until_ready().await;
    }
}

/// How long one upstream resolver has to answer one attempt of a forwarded query.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Forwarded answers kept, each for the TTL it carries up to [`CACHE_MAX_TTL`] (CoreDNS's
/// `cache 30`); few, because an answer fetched over TCP may be 64 KiB.
const CACHE_ENTRIES: u64 = 256;
const CACHE_MAX_TTL: Duration = Duration::from_secs(30);
/// The largest answer sent over UDP, whatever size a client's EDNS asks for (the DNS flag
/// day's 1232 bytes: no fragments, and little to amplify); larger answers go out truncated
/// and the client asks again over TCP.
const MAX_UDP_PAYLOAD: u16 = 1232;

/// What a forwarded query came back with.
struct Forwarded {
    code: ResponseCode,
    answers: Vec<Record>,
    authority: Vec<Record>,
}

/// The resolver that forwards names outside the zone to `upstreams`: `hickory-resolver`,
/// which sends EDNS, retries over TCP when an answer comes back truncated, caches answers
/// for the TTLs they carry, asks two upstreams at once and orders them by how they answer,
/// and uses random query IDs and source ports. `None` without upstreams.
fn forwarder(upstreams: &[SocketAddr]) -> Option<Resolver<TokioRuntimeProvider>> {
    if upstreams.is_empty() {
        return None;
    }
    let servers = upstreams
        .iter()
        .map(|u| {
            let mut udp = ConnectionConfig::udp();
            udp.port = u.port();
            let mut tcp = ConnectionConfig::tcp();
            tcp.port = u.port();
            let mut s = NameServerConfig::udp_and_tcp(u.ip());
            s.connections = vec![udp, tcp];
            s
        })
        .collect();
    let mut builder = Resolver::builder_with_config(
        ResolverConfig::from_parts(None, vec![], servers),
        TokioRuntimeProvider::default(),
    );
    let o = builder.options_mut();
    o.timeout = UPSTREAM_TIMEOUT;
    o.attempts = 2;
    o.cache_size = CACHE_ENTRIES;
    o.positive_max_ttl = Some(CACHE_MAX_TTL);
    o.negative_max_ttl = Some(CACHE_MAX_TTL);
    o.edns0 = true;
    // A forwarder passes on the aliases it followed (RFC 1034 4.3.2).
    o.preserve_intermediates = true;
    o.use_hosts_file = ResolveHosts::Never;
    o.ndots = 0;
    match builder.build() {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::error!(error = %e, "cannot build the forwarding resolver");
            None
        }
    }
}

/// Answers queries in `zone` from a [`View`]; forwards everything else to `upstreams`.
pub struct Handler<V> {
    view: V,
    zone: String,
    soa: Record,
    forwarder: Option<Resolver<TokioRuntimeProvider>>,
    metrics: Arc<Metrics>,
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
        Ok(Handler {
            view,
            zone,
            soa,
            forwarder: forwarder(&upstreams),
            metrics,
        })
    }

    /// Ask the upstream resolvers for `name` (`rtype`). `None` without upstreams.
    async fn forward(&self, name: &Name, rtype: RecordType) -> Option<Forwarded> {
        let resolver = self.forwarder.as_ref()?;
        let mut name = name.clone();
        name.set_fqdn(true);
        let (outcome, forwarded) = match resolver.lookup(name.clone(), rtype).await {
            Ok(lookup) => (
                "answered",
                Forwarded {
                    code: ResponseCode::NoError,
                    answers: lookup.answers().to_vec(),
                    authority: lookup.authorities().to_vec(),
                },
            ),
            Err(NetError::Dns(DnsError::NoRecordsFound(none))) => (
                "negative",
                Forwarded {
                    code: none.response_code,
                    answers: vec![],
                    authority: none
                        .soa
                        .map(|soa| vec![soa.into_record_of_rdata()])
                        .unwrap_or_default(),
                },
            ),
            Err(NetError::Dns(DnsError::ResponseCode(code))) => (
                "error",
                Forwarded {
                    code,
                    answers: vec![],
                    authority: vec![],
                },
            ),
            Err(e) => {
                tracing::debug!(%name, error = %e, "no upstream resolver answered");
                (
                    "failed",
                    Forwarded {
                        code: ResponseCode::ServFail,
                        answers: vec![],
                        authority: vec![],
                    },
                )
            }
        };
        self.metrics.forwarded(outcome);
        Some(forwarded)
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
                                records.extend(r.answers);
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
                return match self.forward(name, rtype).await {
                    Some(r) => (r.code, false, r.answers, r.authority),
                    None => (ResponseCode::Refused, false, records, vec![]),
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

/// The `type` label of a query: the common types by name, every other one `other` (a client
/// chooses the type; the label's values stay few).
fn qtype_label(rtype: RecordType) -> &'static str {
    match rtype {
        RecordType::A => "a",
        RecordType::AAAA => "aaaa",
        RecordType::SRV => "srv",
        RecordType::PTR => "ptr",
        RecordType::TXT => "txt",
        RecordType::CNAME => "cname",
        RecordType::SOA => "soa",
        RecordType::NS => "ns",
        RecordType::MX => "mx",
        RecordType::ANY => "any",
        _ => "other",
    }
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
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let started = Instant::now();
        // The client's EDNS decides how large an answer over UDP may be (512 bytes without
        // it); what does not fit is sent truncated, and the client asks again over TCP.
        let edns = request.edns.as_ref().map(|asked| {
            let mut e = Edns::new();
            e.set_max_payload(asked.max_payload().clamp(512, MAX_UDP_PAYLOAD));
            e
        });
        let mut builder = MessageResponseBuilder::from_message_request(request);
        if let Some(e) = &edns {
            builder.edns(e);
        }
        let mut meta = Metadata::response_from_request(&request.metadata);
        let Ok(info) = request.request_info() else {
            meta.response_code = ResponseCode::FormErr;
            self.metrics
                .observe("other", ResponseCode::FormErr, started.elapsed());
            let msg = builder.build_no_records(meta);
            return response.send_response(msg).await.unwrap_or_else(|_| {
                ResponseInfo::from(Header {
                    metadata: meta,
                    counts: Default::default(),
                })
            });
        };
        let name = info.query.original().name().clone();
        let rtype = info.query.query_type();
        let answer = records::lookup(&self.view, &self.zone, &name.to_ascii(), kind_of(rtype));
        let (code, authoritative, answers, authority) = self.answer(&name, rtype, answer).await;
        meta.response_code = code;
        meta.authoritative = authoritative;
        meta.recursion_available = self.forwarder.is_some();
        self.metrics
            .observe(qtype_label(rtype), code, started.elapsed());
        let msg = builder.build(meta, answers.iter(), [], authority.iter(), []);
        response.send_response(msg).await.unwrap_or_else(|_| {
            ResponseInfo::from(Header {
                metadata: meta,
                counts: Default::default(),
            })
        })
    }
}

/// Upper bounds (seconds) of the latency histogram's buckets.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0,
];

type Labels = Vec<(&'static str, String)>;

/// Prometheus metrics of the server (on `prometheus-client`): queries by type and response
/// code, latency, and how forwarded queries ended.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    queries: Family<Labels, Counter>,
    duration: Histogram,
    forwarded: Family<Labels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let queries = Family::<Labels, Counter>::default();
        registry.register(
            "nestplane_dns_queries",
            "DNS queries answered, by query type and response code",
            queries.clone(),
        );
        let duration = Histogram::new(BUCKETS);
        registry.register_with_unit(
            "nestplane_dns_request_duration",
            "Time to answer a query",
            Unit::Seconds,
            duration.clone(),
        );
        let forwarded = Family::<Labels, Counter>::default();
        registry.register(
            "nestplane_dns_forwarded",
            "Queries for names outside the zone, by how the upstream resolvers answered \
             (answered, negative, error, failed)",
            forwarded.clone(),
        );
        Metrics {
            registry,
            queries,
            duration,
            forwarded,
        }
    }
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
            ResponseCode::NotAuth => "NOTAUTH".into(),
            _ => "other".into(),
        };
        self.queries
            .get_or_create(&vec![("type", qtype.to_string()), ("rcode", rcode)])
            .inc();
        self.duration.observe(took.as_secs_f64());
    }

    /// Count one forwarded query by how it ended.
    fn forwarded(&self, outcome: &str) {
        self.forwarded
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// The metrics in the OpenMetrics text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }
}

/// The name servers of a `resolv.conf` (as `hickory-resolver` reads it; port 53), leaving
/// out `except` (this server's own address, so that it never forwards to itself). Pure.
pub fn upstreams_from_resolv_conf(text: &str, except: SocketAddr) -> Vec<SocketAddr> {
    let Ok((config, _)) = hickory_resolver::system_conf::parse_resolv_conf(text) else {
        return vec![];
    };
    config
        .name_servers()
        .iter()
        .map(|s| SocketAddr::new(s.ip, 53))
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
    tokio::spawn(nestplane_health::serve(
        health_listener,
        Arc::new(Probe {
            ready: ready.clone(),
            metrics: metrics.clone(),
        }),
        nestplane_health::Limits::default(),
        tokio_util::sync::CancellationToken::new(),
    ));
    let mut server = Server::new(Handler::new(
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
    server.register_listener(tcp, Duration::from_secs(5), 16);
    caches.ready().await;
    ready.store(true, Ordering::Relaxed);
    tracing::info!(%dns, zone, ?upstreams, "serving cluster DNS");
    server
        .block_until_done()
        .await
        .map_err(|e| Error::Io("serving".into(), std::io::Error::other(e.to_string())))
}

/// What the DNS server's `/readyz` and `/metrics` report.
struct Probe {
    ready: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

impl nestplane_health::Probe for Probe {
    fn metrics(&self) -> String {
        self.metrics.render()
    }
    fn problems(&self) -> Vec<String> {
        if self.ready.load(Ordering::Relaxed) {
            vec![]
        } else {
            vec!["the Service and Endpoints caches have not listed yet".into()]
        }
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
