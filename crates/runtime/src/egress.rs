//! Who a tenant's processes are, and where their packets may go.
//!
//! When the operator runs as root, each tenant's control-plane processes run as a user of
//! their own: uid (and gid) [`UID_BASE`] plus the tenant's loopback block, so no two live
//! tenants share one (a block is allocated under a lock, and a tenant's user has no process
//! left from before when its first process starts: [`kill_user`]). Their packets are confined
//! on the host by an owner match: the first rule of `filter OUTPUT` sends every packet of a
//! tenant uid to the [`CHAIN`] chain, which lets through replies, loopback (but not its DNS
//! port), and packets of the very uid a node's rule names to that node ([`allow_node`]);
//! everything else is rejected.
//!
//! So a tenant API server reaches its own nodes and pods, and loopback (where every tenant's
//! services require client certificates of that tenant's CA), and nothing else: not another
//! hosted cluster's nodes or pods, not the machine's other addresses, not the network outside.
//! Nothing here is derived from a name a user chose (no hash to collide with).

use std::process::Command;

pub use crate::user::{UID_BASE, UID_COUNT, User};

/// The filter chain every packet of a tenant user goes through.
pub const CHAIN: &str = "NESTPLANE-EGRESS";

/// Whether this process may switch users (it runs as root).
pub fn can_switch_users() -> bool {
    rustix::process::geteuid().is_root()
}

/// Kill every process of `user`: whatever a tenant's processes forked must not outlive the
/// tenant, nor be there when its uid is given to another tenant. A helper running as the user
/// sends `SIGKILL` to every process it may signal (`kill -KILL -1`: the kernel walks the
/// whole process list at once, so nothing forks past it), twice.
pub fn kill_user(user: User) -> std::io::Result<()> {
    for _ in 0..2 {
        let spec = crate::child::Spec {
            name: "kill-user".into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "kill -KILL -1 2>/dev/null; true".into()],
            log: std::path::PathBuf::from("/dev/null"),
            cwd: Some(std::path::PathBuf::from("/")),
            user: Some(user),
            ..Default::default()
        };
        let (mut cmd, _exe) = crate::child::command(&spec)?;
        let status = cmd.status()?;
        if !status.success() {
            return Err(std::io::Error::other(format!(
                "the helper as uid {} ended with {status}",
                user.uid
            )));
        }
    }
    Ok(())
}

/// Trouble with the host's packet filter.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {output}")]
pub struct EgressError {
    what: String,
    output: String,
}

fn run(program: &str, args: &[&str]) -> Result<(), EgressError> {
    let out = Command::new(program)
        .arg("-w")
        .args(args)
        .output()
        .map_err(|e| EgressError {
            what: format!("running {program}"),
            output: format!("{e} (install iptables: apt-get install iptables)"),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(EgressError {
            what: format!("{program} {}", args.join(" ")),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn ok(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .arg("-w")
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn uid_range() -> String {
    format!("{}-{}", UID_BASE, UID_BASE + UID_COUNT - 1)
}

/// Make sure the chain holds its closing rules, last and in order, and that the first rule
/// of `OUTPUT` sends tenant users' packets through it (IPv4, and IPv6 where the machine has
/// it; IPv6 lets only loopback and replies through). The chain is rewritten in one
/// transaction (`iptables-restore --noflush`), keeping the nodes' rules: it is never open,
/// not even for a moment. One operator at a time (several may share a machine).
pub fn ensure_chain() -> Result<(), EgressError> {
    let _lock = lock();
    let range = uid_range();
    let families: &[(&str, &str)] = if std::path::Path::new("/proc/net/if_inet6").exists() {
        &[("iptables", "127.0.0.0/8"), ("ip6tables", "::1/128")]
    } else {
        &[("iptables", "127.0.0.0/8")]
    };
    for (program, lo) in families {
        let program = *program;
        let mut text = format!("*filter\n:{CHAIN} - [0:0]\n");
        // The nodes' rules stay, first.
        for line in list(program, CHAIN).lines() {
            if line.starts_with(&format!("-A {CHAIN} -o ")) && line.contains(" --uid-owner ") {
                text.push_str(line);
                text.push('\n');
            }
        }
        text.push_str(&format!(
            "-A {CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN\n"
        ));
        // The machine's resolver would carry anything anywhere.
        for proto in ["udp", "tcp"] {
            text.push_str(&format!(
                "-A {CHAIN} -d {lo} -p {proto} --dport 53 -j REJECT\n"
            ));
        }
        text.push_str(&format!(
            "-A {CHAIN} -d {lo} -j RETURN\n-A {CHAIN} -j REJECT\nCOMMIT\n"
        ));
        restore(program, &text)?;
        // First in OUTPUT: a rule someone inserts above it could let the packets out. The new
        // jump goes in before any old one goes.
        let jump = format!("-m owner --uid-owner {range} -j {CHAIN}");
        let rules: Vec<String> = list(program, "OUTPUT")
            .lines()
            .filter(|l| l.starts_with("-A OUTPUT "))
            .map(str::to_string)
            .collect();
        let ours = format!("-A OUTPUT {jump}");
        if rules.first() != Some(&ours) {
            let args: Vec<&str> = jump.split_whitespace().collect();
            run(program, &[&["-I", "OUTPUT", "1"][..], &args].concat())?;
            // Rule numbers of the old jumps, now one further down; from the last.
            for (i, r) in rules.iter().enumerate().rev() {
                if *r == ours {
                    run(program, &["-D", "OUTPUT", &(i + 2).to_string()])?;
                }
            }
        }
    }
    Ok(())
}

/// `program-restore --noflush` of `text`.
fn restore(program: &str, text: &str) -> Result<(), EgressError> {
    use std::io::Write as _;
    let what = format!("{program}-restore --noflush");
    let fail = |output: String| EgressError {
        what: what.clone(),
        output,
    };
    let mut child = Command::new(format!("{program}-restore"))
        .args(["-w", "--noflush"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("{e} (install iptables: apt-get install iptables)")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "{}\n{text}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// `program -S chain`.
fn list(program: &str, chain: &str) -> String {
    Command::new(program)
        .args(["-w", "-S", chain])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// An exclusive lock across the operators of this machine (the packet filter's rules, the
/// loopback blocks), held while the file lives; `None` where `/run` is not writable (not
/// root: no tenant users either).
pub(crate) fn lock() -> Option<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/run/nestplane-egress.lock")
        .ok()?;
    // Released when the file is closed.
    loop {
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive) {
            Err(rustix::io::Errno::INTR) => continue,
            _ => return Some(f),
        }
    }
}

/// Let packets of `uid` (the node's control plane's user) out to the node behind `host_veth`
/// (its address and its pods); any rule an earlier node on that interface left goes first.
pub fn allow_node(host_veth: &str, uid: u32) -> Result<(), EgressError> {
    ensure_chain()?;
    let uid = uid.to_string();
    let rule = [
        "-o",
        host_veth,
        "-m",
        "owner",
        "--uid-owner",
        &uid,
        "-j",
        "RETURN",
    ];
    let _lock = lock();
    if !ok("iptables", &[&["-C", CHAIN][..], &rule].concat()) {
        remove_node_rules(host_veth);
        run("iptables", &[&["-I", CHAIN, "1"][..], &rule].concat())?;
    }
    Ok(())
}

/// Remove [`allow_node`]'s rule for `host_veth`. Idempotent. Under the machine-wide lock:
/// [`ensure_chain`] rewrites the chain with the nodes' rules it listed, and would bring back a
/// rule deleted in between.
pub fn disallow_node(host_veth: &str) {
    let _lock = lock();
    remove_node_rules(host_veth);
}

/// [`disallow_node`] for a caller that holds the lock.
fn remove_node_rules(host_veth: &str) {
    let Ok(out) = Command::new("iptables").args(["-w", "-S", CHAIN]).output() else {
        return;
    };
    let prefix = format!("-A {CHAIN} ");
    let needle = format!(" -o {host_veth} ");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(rule) = line.strip_prefix(&prefix) else {
            continue;
        };
        if !format!(" {rule} ").contains(&needle) {
            continue;
        }
        let mut args = vec!["-D", CHAIN];
        args.extend(rule.split_whitespace());
        // Best effort: a rule, link or setting that is not there needs no undoing.
        let _ = run("iptables", &args);
    }
}

/// Run `f` on a thread of its own, which ends with it, and wait for it without blocking the
/// caller's thread: for work that changes the thread's identity (its filesystem uid, its
/// network namespace) to make a socket, so that no other thread ever carries the change.
pub async fn on_own_thread<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("nestplane-socket".into())
        .spawn(move || {
            // The receiver is gone only if the caller stopped waiting.
            let _ = tx.send(f());
        })?;
    rx.await
        .unwrap_or_else(|_| Err(std::io::Error::other("the socket thread ended")))
}

/// Connect `socket` to `addr` within `timeout`, on the caller's runtime (no thread waits).
pub async fn connect_within(
    socket: tokio::net::TcpSocket,
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<tokio::net::TcpStream> {
    let s = tokio::time::timeout(timeout, socket.connect(addr))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    s.set_nodelay(true)?;
    Ok(s)
}

/// Connect to `addr` as `user`'s packets would (`None`: as this process), within `timeout`:
/// the socket is made by a thread of its own whose filesystem uid is the user's, which is
/// what the [`CHAIN`]'s owner match reads (the socket's file keeps the credentials it was
/// made with), so the connection is confined exactly as the user's own would be. The thread
/// ends once the socket is made; the connect happens on the caller's runtime.
pub async fn connect_as(
    user: Option<User>,
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<tokio::net::TcpStream> {
    let socket = on_own_thread(move || {
        if let Some(u) = user {
            become_for_files(u.uid)?;
        }
        tokio::net::TcpSocket::new_v4()
    })
    .await?;
    connect_within(socket, addr, timeout).await
}

/// Raise this process's soft limit of open files to its hard limit: the operator holds two
/// descriptors per API-server tunnel, for every tenant (each is capped, the sum is not), and
/// the usual soft limit (1024) is far below the usual hard one. Returns the limit now.
pub fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        l.current = l.maximum;
        if setrlimit(Resource::Nofile, l).is_err() {
            return getrlimit(Resource::Nofile).current;
        }
    }
    l.current
}

/// Make `uid` the calling thread's filesystem uid (only that thread's: Linux keeps
/// credentials per thread, and `setfsuid` is not one of the calls the C library repeats on
/// every thread).
#[allow(unsafe_code)]
fn become_for_files(uid: u32) -> std::io::Result<()> {
    // SAFETY: plain system calls on integers; no memory is involved.
    unsafe { libc::setfsuid(uid) };
    // setfsuid answers with the previous value and never fails: an invalid id (-1) only
    // reads the current one back.
    // SAFETY: as above.
    let now = unsafe { libc::setfsuid(u32::MAX) } as u32;
    if now == uid {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "cannot take uid {uid} for a connection (this process is uid {})",
            rustix::process::geteuid().as_raw()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_block_has_its_own_user_in_the_range() {
        assert_ne!(User::for_block([64, 1]), User::for_block([65, 0]));
        let top = User::for_block([255, 255]);
        assert!(top.uid < UID_BASE + UID_COUNT && top.uid > 65535);
    }
}
