//! Who a tenant's processes are, and where their packets may go.
//!
//! When the operator runs as root, each tenant's control-plane processes run as a user of
//! their own: uid (and gid) [`UID_BASE`] plus the tenant's loopback block, so two tenants never
//! share one. Their packets are confined on the host by an owner match:
//!
//! - `mangle OUTPUT`: packets of a tenant's uid carry its [`isolation_group`] as their mark;
//! - `filter OUTPUT` sends every packet of a tenant uid to the [`CHAIN`] chain, which lets
//!   through replies, loopback, and packets to a node whose group is the packet's mark (a node
//!   adds its rule with [`allow_node`]); everything else is rejected.
//!
//! So a tenant API server reaches its own nodes and pods, and loopback (where every tenant's
//! services require client certificates of that tenant's CA), and nothing else: not another
//! hosted cluster's nodes or pods, not the machine's other addresses, not the network outside.

use std::process::Command;

use sha2::{Digest, Sha256};

use crate::process::TenantKey;

/// The first uid (and gid) of tenant users; a tenant's is this plus its loopback block.
pub const UID_BASE: u32 = 0x4e50_0000;
/// How many uids tenant users may have.
pub const UID_COUNT: u32 = 1 << 16;
/// The filter chain every packet of a tenant user goes through.
pub const CHAIN: &str = "NESTPLANE-EGRESS";

/// A tenant's user and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct User {
    /// User id.
    pub uid: u32,
    /// Group id (the same number).
    pub gid: u32,
}

impl User {
    /// The user of the tenant whose loopback block is `127.a.b.0/24`.
    pub fn for_block(block: [u8; 2]) -> User {
        let id = UID_BASE + ((block[0] as u32) << 8 | block[1] as u32);
        User { uid: id, gid: id }
    }
}

/// Whether this process may switch users (it runs as root).
pub fn can_switch_users() -> bool {
    // SAFETY: geteuid has no preconditions.
    #[allow(unsafe_code)]
    unsafe {
        libc::geteuid() == 0
    }
}

/// The isolation group of a control plane's cluster: its nodes share it, its processes'
/// packets carry it. 31 bits of a hash of `namespace/name` of the `NestedControlPlane`,
/// never 0.
pub fn isolation_group(key: &TenantKey) -> u32 {
    let d = Sha256::digest(format!("{}/{}", key.namespace, key.cluster).as_bytes());
    (u32::from_be_bytes([d[0], d[1], d[2], d[3]]) & 0x7fff_ffff).max(1)
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

/// Make sure the chain exists with its closing rules, and that `OUTPUT` sends tenant users'
/// packets through it (IPv4 and IPv6; IPv6 lets only loopback and replies through).
/// Idempotent; rules nodes added stay.
pub fn ensure_chain() -> Result<(), EgressError> {
    let range = uid_range();
    for (program, lo) in [("iptables", "127.0.0.0/8"), ("ip6tables", "::1/128")] {
        if !ok(program, &["-S", CHAIN]) {
            run(program, &["-N", CHAIN])?;
        }
        let closing = ["-A", CHAIN, "-j", "REJECT"];
        if !ok(program, &["-C", CHAIN, "-j", "REJECT"]) {
            run(
                program,
                &[
                    "-A",
                    CHAIN,
                    "-m",
                    "conntrack",
                    "--ctstate",
                    "ESTABLISHED,RELATED",
                    "-j",
                    "RETURN",
                ],
            )?;
            run(program, &["-A", CHAIN, "-d", lo, "-j", "RETURN"])?;
            run(program, &closing)?;
        }
        let jump = ["OUTPUT", "-m", "owner", "--uid-owner", &range, "-j", CHAIN];
        if !ok(program, &[&["-C"][..], &jump].concat()) {
            run(
                program,
                &[&["-I"][..], &jump[..1], &["1"], &jump[1..]].concat(),
            )?;
        }
    }
    Ok(())
}

/// Mark the packets of `user` with the isolation group of `key`.
pub fn mark_tenant(user: User, key: &TenantKey) -> Result<(), EgressError> {
    ensure_chain()?;
    let (uid, mark) = (user.uid.to_string(), format!("{:#x}", isolation_group(key)));
    let rule = [
        "OUTPUT",
        "-m",
        "owner",
        "--uid-owner",
        &uid,
        "-j",
        "MARK",
        "--set-mark",
        &mark,
    ];
    if !ok("iptables", &[&["-t", "mangle", "-C"][..], &rule].concat()) {
        unmark_tenant(user);
        run("iptables", &[&["-t", "mangle", "-A"][..], &rule].concat())?;
    }
    Ok(())
}

/// Remove `user`'s mark rule. Idempotent.
pub fn unmark_tenant(user: User) {
    delete_matching("mangle", "OUTPUT", &format!(" --uid-owner {} ", user.uid));
}

/// Let packets marked `group` out to the node behind `host_veth` (its address and its pods).
pub fn allow_node(host_veth: &str, group: u32) -> Result<(), EgressError> {
    ensure_chain()?;
    let mark = format!("{group:#x}");
    let rule = [
        CHAIN, "-o", host_veth, "-m", "mark", "--mark", &mark, "-j", "RETURN",
    ];
    if !ok("iptables", &[&["-C"][..], &rule].concat()) {
        run(
            "iptables",
            &[&["-I"][..], &rule[..1], &["1"], &rule[1..]].concat(),
        )?;
    }
    Ok(())
}

/// Remove [`allow_node`]'s rule for `host_veth`. Idempotent.
pub fn disallow_node(host_veth: &str) {
    delete_matching("filter", CHAIN, &format!(" -o {host_veth} "));
}

/// Delete every rule of `table`/`chain` whose text contains `needle`.
fn delete_matching(table: &str, chain: &str, needle: &str) {
    let Ok(out) = Command::new("iptables")
        .args(["-w", "-t", table, "-S", chain])
        .output()
    else {
        return;
    };
    let prefix = format!("-A {chain} ");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(rule) = line.strip_prefix(&prefix) else {
            continue;
        };
        if !format!(" {rule} ").contains(needle) {
            continue;
        }
        let mut args = vec!["-t", table, "-D", chain];
        args.extend(rule.split_whitespace());
        let _ = run("iptables", &args);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ns: &str, c: &str) -> TenantKey {
        TenantKey {
            namespace: ns.into(),
            cluster: c.into(),
        }
    }

    #[test]
    fn each_control_plane_has_its_own_group_and_user() {
        let a = isolation_group(&key("default", "a"));
        assert_eq!(a, isolation_group(&key("default", "a")));
        assert_ne!(a, isolation_group(&key("default", "b")));
        assert_ne!(a, isolation_group(&key("other", "a")));
        assert!(a > 0 && a <= 0x7fff_ffff);
        assert_ne!(User::for_block([64, 1]), User::for_block([65, 0]));
        let top = User::for_block([255, 255]);
        assert!(top.uid < UID_BASE + UID_COUNT && top.uid > 65535);
    }
}
