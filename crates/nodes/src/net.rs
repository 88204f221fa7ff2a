//! A node's network on this machine: a slot (its addresses), its network namespace, the veth
//! pair joining it to the host, and the host's route to its pods. Everything is on this
//! machine; nothing is routed off it (the addresses are private ranges reached only through
//! the host's veths).

use ipnet::Ipv4Net;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;
use crate::config::{Addresses, MAX_SLOT, NODE_LOCAL_APISERVER};

/// Machine-wide slot claims (`/run` is emptied on boot, like network namespaces).
pub fn slots_dir() -> PathBuf {
    PathBuf::from("/run/nestplane/node-slots")
}

/// A claimed slot; [`release`](Slot::release) gives it back.
#[derive(Debug)]
pub struct Slot {
    /// The slot number.
    pub number: u8,
    path: PathBuf,
}

impl Slot {
    /// Give the slot back.
    pub fn release(self) {
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The owner a claim file names: `<pid> <node dir>`.
fn claim_owner(path: &Path) -> Option<(u32, PathBuf)> {
    let text = std::fs::read_to_string(path).ok()?;
    let (pid, dir) = text.trim().split_once(' ')?;
    Some((pid.parse().ok()?, PathBuf::from(dir)))
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Machine-wide claims of management planes that have nodes (each gets its own service
/// range, routed from the host through its first node).
pub fn plane_slots_dir() -> PathBuf {
    PathBuf::from("/run/nestplane/plane-slots")
}

/// Claim a management-plane slot (1..=60) for the plane in `dir`.
pub fn claim_plane(dir: &Path) -> Result<Slot, Error> {
    claim_in(&plane_slots_dir(), 1..=60, dir, |_, _| {})
}

/// The service range of management plane slot `p`: `10.<128+p>.0.0/16`.
pub fn plane_service_cidr(p: u8) -> String {
    format!("10.{}.0.0/16", 128 + u16::from(p))
}

/// Claim the first free slot for the node in `dir`. A claim whose process is gone is stale:
/// `stale(slot, its node's directory)` removes what that node left, and the slot is reused.
pub fn claim(dir: &Path, stale: impl Fn(u8, &Path)) -> Result<Slot, Error> {
    claim_in(&slots_dir(), 1..=MAX_SLOT, dir, stale)
}

/// Claim slot `n` and no other (a node whose addresses its cluster assigned: a machine that
/// joins); taken already is [`Error::NoSlot`].
pub fn claim_exactly(dir: &Path, n: u8, stale: impl Fn(u8, &Path)) -> Result<Slot, Error> {
    if !(1..=MAX_SLOT).contains(&n) {
        return Err(Error::NoSlot(n));
    }
    claim_in(&slots_dir(), n..=n, dir, stale)
}

fn claim_in(
    sd: &Path,
    slots: std::ops::RangeInclusive<u8>,
    dir: &Path,
    stale: impl Fn(u8, &Path),
) -> Result<Slot, Error> {
    let max = *slots.end();
    std::fs::create_dir_all(sd).map_err(|e| Error::io(format!("creating {}", sd.display()), e))?;
    // One claimer at a time on this machine. Without it, two that found the same stale claim
    // both cleaned it up: the second removed the network namespace (and the claim) the first
    // had just made its own, and both used the slot. The lock goes when the file closes, also
    // when a claimer dies.
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(sd.join(".lock"))
        .map_err(|e| Error::io("opening the slot lock", e))?;
    lock.lock()
        .map_err(|e| Error::io("taking the slot lock", e))?;
    for n in slots {
        let path = sd.join(n.to_string());
        if let Some((pid, old)) = claim_owner(&path) {
            if pid_alive(pid) {
                continue;
            }
            stale(n, &old);
            // Best effort: what cannot be removed now is left for the next cleanup.
            let _ = std::fs::remove_file(&path);
        }
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut f) => {
                writeln!(f, "{} {}", std::process::id(), dir.display())
                    .map_err(|e| Error::io("writing a slot claim", e))?;
                return Ok(Slot { number: n, path });
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io("claiming a node slot", e)),
        }
    }
    Err(Error::NoSlot(max))
}

pub(crate) fn run(args: &[&str]) -> Result<(), Error> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| Error::io(format!("running {}", args[0]), e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            what: args.join(" "),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// The path of a named network namespace.
pub fn netns_path(a: &Addresses) -> PathBuf {
    PathBuf::from("/run/netns").join(&a.netns)
}

/// Move the calling thread into the network namespace `ns`. Only for a thread of its own
/// that ends with its work.
fn enter_netns(ns: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    rustix::thread::move_into_link_name_space(
        ns,
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?;
    Ok(())
}

/// Run `f` on a thread of its own that has entered the network namespace at `netns`: the
/// sockets it makes stay in that namespace. Only that thread enters it, and it ends with `f`
/// (never a pooled thread, which would carry the namespace into unrelated work).
pub fn in_netns<T: Send + 'static>(
    netns: PathBuf,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    std::thread::spawn(move || {
        use std::os::fd::AsFd;
        let ns = std::fs::File::open(&netns)?;
        enter_netns(ns.as_fd())?;
        f()
    })
    .join()
    .unwrap_or_else(|_| Err(std::io::Error::other("the namespace thread panicked")))
}

/// A node's network namespace, held open: the namespace it names stays the same one however
/// its path is reused.
pub fn open_netns(a: &Addresses) -> std::io::Result<std::sync::Arc<std::os::fd::OwnedFd>> {
    Ok(std::sync::Arc::new(
        std::fs::File::open(netns_path(a))?.into(),
    ))
}

/// Connect to `addr` from inside the network namespace `netns` (as a pod of that node would:
/// the node's routes, its kube-proxy's Service rules and its filter apply), within
/// `timeout`. A thread of its own enters the namespace to make the socket and ends; the
/// connect happens on the caller's runtime.
pub async fn connect_in_netns(
    netns: std::sync::Arc<std::os::fd::OwnedFd>,
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<tokio::net::TcpStream> {
    use nestplane_runtime::egress::{connect_within, on_own_thread};
    let socket = on_own_thread(move || {
        use std::os::fd::AsFd;
        enter_netns(netns.as_fd())?;
        tokio::net::TcpSocket::new_v4()
    })
    .await?;
    connect_within(socket, addr, timeout).await
}

/// Create the node's network namespace and link: `eth0` in the namespace with the node
/// address, the host end with the host address, a default route through the host, the
/// node-local API address on the namespace's loopback, forwarding on, and a host route to the
/// node's pods.
pub fn setup(a: &Addresses) -> Result<(), Error> {
    let ns = a.netns.as_str();
    let host_cidr = format!("{}/24", a.host_ip);
    let node_cidr = format!("{}/24", a.node_ip);
    let host_ip = a.host_ip.to_string();
    let node_ip = a.node_ip.to_string();
    let api = format!("{NODE_LOCAL_APISERVER}/32");
    run(&["ip", "netns", "add", ns])?;
    let steps: Vec<Vec<&str>> = vec![
        vec![
            "ip",
            "link",
            "add",
            &a.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            ns,
        ],
        vec!["ip", "addr", "add", &host_cidr, "dev", &a.host_veth],
        vec!["ip", "link", "set", &a.host_veth, "up"],
        vec!["ip", "-n", ns, "link", "set", "lo", "up"],
        vec!["ip", "-n", ns, "addr", "add", &api, "dev", "lo"],
        vec!["ip", "-n", ns, "addr", "add", &node_cidr, "dev", "eth0"],
        vec!["ip", "-n", ns, "link", "set", "eth0", "up"],
        vec!["ip", "-n", ns, "route", "add", "default", "via", &host_ip],
        vec![
            "ip",
            "route",
            "add",
            &a.pod_cidr,
            "via",
            &node_ip,
            "dev",
            &a.host_veth,
        ],
    ];
    for s in steps {
        if let Err(e) = run(&s) {
            teardown(a);
            return Err(e);
        }
    }
    let nsp = netns_path(a);
    let nsp = nsp.to_string_lossy();
    let net = format!("--net={nsp}");
    for key in [
        "net.ipv4.ip_forward=1",
        "net.bridge.bridge-nf-call-iptables=1",
    ] {
        // The bridge setting is per namespace on recent kernels; where it is not, the
        // machine's value (on by default) applies.
        let _ = run(&["nsenter", &net, "sysctl", "-q", "-w", key]);
    }
    // Nothing leaves the machine: from the node's namespace only the node links and pod
    // ranges on this machine are reachable through the host.
    for chain in ["FORWARD", "OUTPUT"] {
        for rule in [
            vec!["-o", "eth0", "-d", "10.201.0.0/16", "-j", "ACCEPT"],
            vec![
                "-o",
                "eth0",
                "-d",
                crate::config::POD_NETWORK,
                "-j",
                "ACCEPT",
            ],
            vec!["-o", "eth0", "-j", "DROP"],
        ] {
            let mut args = vec!["nsenter", net.as_str(), "iptables", "-w", "-A", chain];
            args.extend(rule);
            if let Err(e) = run(&args) {
                teardown(a);
                return Err(e);
            }
        }
    }
    // Forwarding between nodes' links (pods of one cluster on different nodes).
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .map_err(|e| Error::io("turning on IPv4 forwarding", e))?;
    Ok(())
}

/// Remove the node's network namespace (its veth pair, bridge, iptables rules and routes go
/// with it). Idempotent.
pub fn teardown(a: &Addresses) {
    unisolate(a);
    if netns_path(a).exists() {
        // Best effort: a rule, link or setting that is not there needs no undoing.
        let _ = run(&["ip", "netns", "delete", &a.netns]);
    }
    // Deleting the namespace deletes the pair; a half-made setup may have left the host end.
    if Path::new("/sys/class/net").join(&a.host_veth).exists() {
        // Best effort: a rule, link or setting that is not there needs no undoing.
        let _ = run(&["ip", "link", "delete", &a.host_veth]);
    }
}

/// Keep nodes of other groups out: packets entering this machine from the node are marked
/// with `group`, and only packets so marked are forwarded to it. Nodes of one hosted cluster
/// share a group, so its pods reach each other across nodes, and no other cluster's pods or
/// nodes reach them.
pub fn isolate(a: &Addresses, group: u32) -> Result<(), Error> {
    let mark = format!("{:#x}", group.max(1));
    let steps: [Vec<&str>; 2] = [
        vec![
            "iptables",
            "-w",
            "-t",
            "mangle",
            "-A",
            "PREROUTING",
            "-i",
            &a.host_veth,
            "-j",
            "MARK",
            "--set-mark",
            &mark,
        ],
        vec![
            "iptables",
            "-w",
            "-A",
            "FORWARD",
            "-o",
            &a.host_veth,
            "-m",
            "mark",
            "!",
            "--mark",
            &mark,
            "-j",
            "DROP",
        ],
    ];
    for s in steps {
        if let Err(e) = run(&s) {
            unisolate(a);
            return Err(e);
        }
    }
    Ok(())
}

/// Remove [`isolate`]'s rules (whatever group they name). Idempotent.
pub fn unisolate(a: &Addresses) {
    for (table, chain, flag) in [("mangle", "PREROUTING", "-i"), ("filter", "FORWARD", "-o")] {
        let Ok(out) = Command::new("iptables")
            .args(["-w", "-t", table, "-S", chain])
            .output()
        else {
            continue;
        };
        let needle = format!(" {flag} {} ", a.host_veth);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(rule) = line.strip_prefix(&format!("-A {chain} ")) else {
                continue;
            };
            if !format!(" {rule} ").contains(&needle) {
                continue;
            }
            let mut args = vec!["iptables", "-w", "-t", table, "-D", chain];
            args.extend(rule.split_whitespace());
            // Best effort: a rule, link or setting that is not there needs no undoing.
            let _ = run(&args);
        }
    }
    nestplane_runtime::egress::disallow_node(&a.host_veth);
}

/// Route `cidr` (a management plane's service range) from this machine through `node_ip`,
/// whose kube-proxy turns Service addresses into pod addresses. The route goes when the
/// node's link does.
pub fn route_services(cidr: &str, node_ip: std::net::Ipv4Addr) -> Result<(), Error> {
    run(&["ip", "route", "replace", cidr, "via", &node_ip.to_string()])
}

/// Every range nestplane hands out on this machine: management planes' service ranges
/// (`10.0.0.0/16` without nodes, `10.<128+p>.0.0/16` with), hosted clusters' default service
/// range, node links and pods. Live ones have more specific routes (a node's link and pods, a
/// plane's services through its node); everything else in them is unreachable, so that no
/// packet for an address nestplane handed out (a Service address a host process calls, a
/// gone node's pod) goes to the default gateway and off the machine.
pub const HANDED_OUT: &[&str] = &[
    "10.0.0.0/16",
    "10.96.0.0/12",
    "10.128.0.0/10",
    "10.201.0.0/16",
    "10.244.0.0/16",
];

/// The private ranges: nestplane makes nothing else unreachable (a user's HostedCluster could
/// name a public range, whose traffic must keep flowing for everyone on the machine).
pub const PRIVATE: &[&str] = &["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"];

/// The metric of nestplane's unreachable routes: a route of the same prefix with a lower one
/// (anyone's real route) wins, and every more specific route wins anyway.
pub const UNREACHABLE_METRIC: &str = "4242";

/// An IPv4 range (`a.b.c.d/n`, host bits allowed as routes print them; a bare address is a
/// `/32`).
fn parse_v4(cidr: &str) -> Option<Ipv4Net> {
    match cidr.parse::<Ipv4Net>() {
        Ok(net) => Some(net.trunc()),
        Err(_) => cidr.parse::<std::net::Ipv4Addr>().ok().map(Ipv4Net::from),
    }
}

/// Whether two IPv4 ranges share an address. Pure.
pub fn overlaps(a: &str, b: &str) -> bool {
    match (parse_v4(a), parse_v4(b)) {
        (Some(a), Some(b)) => a.contains(&b.network()) || b.contains(&a.network()),
        _ => false,
    }
}

/// Whether range `outer` holds every address of range `inner`. Pure.
pub fn holds(outer: &str, inner: &str) -> bool {
    match (parse_v4(outer), parse_v4(inner)) {
        (Some(outer), Some(inner)) => outer.contains(&inner),
        _ => false,
    }
}

/// Which of `ranges` may be made unreachable, given the machine's routes (`ip -4 route show`):
/// a range is left alone, with the reason, when a route that nestplane did not make (not the
/// default route, not an unreachable route, not a node's link or a route through a node)
/// overlaps it: that network is someone's, and must keep working. Pure.
pub fn unreachable_plan(routes: &str, ranges: &[&str]) -> Vec<(String, Option<String>)> {
    let foreign: Vec<&str> = routes
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with("default")
                && !l.starts_with("unreachable")
                && !l.contains(" dev npn")
        })
        .collect();
    ranges
        .iter()
        .map(|r| {
            let clash = foreign.iter().find(|l| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|prefix| overlaps(prefix, r))
            });
            let public = (!PRIVATE.iter().any(|p| holds(p, r)))
                .then(|| "it is not a private range (10/8, 172.16/12, 192.168/16)".to_string());
            (
                r.to_string(),
                public.or_else(|| clash.map(|l| format!("the machine's route {l:?} overlaps it"))),
            )
        })
        .collect()
}

/// Make `ranges` unreachable on this machine (see [`HANDED_OUT`]); idempotent. Returns a line
/// per range left alone (see [`unreachable_plan`]).
pub fn install_unreachable(ranges: &[&str]) -> Result<Vec<String>, Error> {
    let out = Command::new("ip")
        .args(["-4", "route", "show"])
        .output()
        .map_err(|e| Error::io("running ip route show", e))?;
    if !out.status.success() {
        return Err(Error::Command {
            what: "ip -4 route show".into(),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let routes = String::from_utf8_lossy(&out.stdout);
    let mut skipped = Vec::new();
    for (range, clash) in unreachable_plan(&routes, ranges) {
        match clash {
            Some(why) => skipped.push(format!("{range} is not made unreachable: {why}")),
            None => run(&[
                "ip",
                "route",
                "replace",
                "unreachable",
                &range,
                "metric",
                UNREACHABLE_METRIC,
            ])?,
        }
    }
    Ok(skipped)
}

#[cfg(test)]
mod unreachable_tests {
    use super::*;

    /// Claimers side by side (tests, `up`, operators) that find the same stale claim each end
    /// with a slot of their own, and the stale node is cleaned up before its slot is reused.
    #[test]
    fn claimers_at_once_never_share_a_slot() {
        let sd = tempfile::tempdir().expect("a temporary directory");
        // A claim whose process is gone.
        let mut gone = Command::new("true").spawn().expect("true runs");
        let dead = gone.id();
        gone.wait().expect("true ends");
        std::fs::write(sd.path().join("1"), format!("{dead} /old-node\n")).expect("a claim");
        let cleanups = std::sync::atomic::AtomicU32::new(0);
        let slots: Vec<u8> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|i| {
                    let (sd, cleanups) = (sd.path(), &cleanups);
                    s.spawn(move || {
                        let dir = PathBuf::from(format!("/node-{i}"));
                        claim_in(sd, 1..=10, &dir, |n, old| {
                            assert_eq!((n, old), (1, Path::new("/old-node")));
                            cleanups.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            // A cleanup takes time (processes, namespaces, cgroups).
                            std::thread::sleep(std::time::Duration::from_millis(50));
                        })
                        .expect("a slot")
                        .number
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a claiming thread"))
                .collect()
        });
        let mut sorted = slots.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(
            sorted,
            [1, 2, 3, 4, 5, 6],
            "each claimer its own slot: {slots:?}"
        );
        assert_eq!(
            cleanups.into_inner(),
            1,
            "the stale node is cleaned up once"
        );
    }

    #[test]
    fn ranges_overlap_by_their_common_prefix() {
        assert!(overlaps("10.96.0.0/12", "10.96.0.10"));
        assert!(overlaps("10.96.0.0/12", "10.100.0.0/16"));
        assert!(overlaps("10.0.0.0/8", "10.244.0.0/16"));
        assert!(!overlaps("10.96.0.0/12", "10.112.0.0/12"));
        assert!(!overlaps("192.0.2.0/24", "10.0.0.0/16"));
        assert!(!overlaps("nonsense", "10.0.0.0/16"));
        assert!(holds("10.96.0.0/12", "10.100.0.0/16"));
        assert!(!holds("10.100.0.0/16", "10.96.0.0/12"));
        assert!(!holds("10.96.0.0/12", "172.16.0.0/16"));
    }

    #[test]
    fn only_ranges_no_one_else_routes_become_unreachable() {
        let routes = "default via 192.0.2.1 dev eth0\n\
            unreachable 10.96.0.0/12 metric 4242\n\
            10.201.1.0/24 dev npn1 proto kernel scope link src 10.201.1.1\n\
            10.244.1.0/24 via 10.201.1.2 dev npn1\n\
            10.129.0.0/16 via 10.201.3.2 dev npn3\n\
            10.0.0.0/8 dev eth1 proto kernel scope link src 10.1.2.3\n\
            192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2\n";
        let plan = unreachable_plan(routes, HANDED_OUT);
        assert_eq!(plan.len(), HANDED_OUT.len());
        // A LAN in 10.0.0.0/8 is someone's: every range inside it is left alone.
        assert!(
            plan.iter()
                .all(|(_, clash)| clash.as_deref().is_some_and(|c| c.contains("10.0.0.0/8")))
        );
        let without_lan: String = routes
            .lines()
            .filter(|l| !l.contains("eth1"))
            .collect::<Vec<_>>()
            .join("\n");
        let plan = unreachable_plan(&without_lan, HANDED_OUT);
        assert!(plan.iter().all(|(_, clash)| clash.is_none()), "{plan:?}");
        // A public range (a HostedCluster may name one) is never made unreachable: everyone
        // on the machine may need it.
        let plan = unreachable_plan(&without_lan, &["8.8.8.0/24", "169.254.0.0/16"]);
        assert!(
            plan.iter().all(|(_, c)| c
                .as_deref()
                .is_some_and(|c| c.contains("not a private range"))),
            "{plan:?}"
        );
    }
}
