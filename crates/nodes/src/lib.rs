//! Real Kubernetes nodes on this machine: containerd + kubelet + kube-proxy.
//!
//! A node ([`node::Node`]) lives in its own network namespace (its own bridge, pod range,
//! routes and iptables, joined to the host by a veth pair), its own mount namespace (its pod
//! logs, pod network namespaces and shim sockets stay with it), its own cgroup root and its
//! own directory. It joins a cluster by TLS bootstrap with a bootstrap token ([`join`]); the
//! API server is reached through a node-local proxy at [`config::NODE_LOCAL_APISERVER`].
//! Removing a node removes all of it.
//!
//! Pure parts: [`config`] (addresses and configuration files), [`images::catalog`]. IO:
//! [`node`], [`net`], [`images::build`], [`join::prepare`].

pub mod config;
pub mod egress;
pub mod entry;
pub mod guard;
pub mod images;
pub mod join;
pub mod net;
pub mod node;
mod proxy;
pub mod timeline;
pub mod tunnel;

/// Errors making, running or removing nodes and images.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Filesystem or process trouble.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{what} failed: {output}")]
    Command {
        /// The command.
        what: String,
        /// Its standard error.
        output: String,
    },
    /// A binary is missing.
    #[error(transparent)]
    MissingBinary(#[from] nestplane_runtime::binaries::MissingBinary),
    /// No free node slot on this machine.
    #[error("all {0} node slots on this machine are taken")]
    NoSlot(u8),
    /// The cluster side of joining failed.
    #[error("join: {0}")]
    Join(String),
    /// A node process did not come up.
    #[error("{process} did not start: {reason}\n--- last lines of {log} ---\n{tail}")]
    Start {
        /// Which process.
        process: String,
        /// Why.
        reason: String,
        /// Its log.
        log: String,
        /// The end of its log.
        tail: String,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The hint printed when a node's programs are missing.
pub const INSTALL_HINT: &str = "run scripts/install-deps.sh (installs containerd, runc, the CNI plugins, buildah, busybox-static, iptables, conntrack, curl, bind9-dnsutils and netcat-openbsd, and builds kubelet, kube-proxy and the end-to-end suite's servers)";

/// Check that everything a node needs is installed; the error names what is missing and how
/// to install it.
pub fn check_prerequisites(version: &str) -> Result<(), Error> {
    let mut missing = Vec::new();
    for p in [
        "containerd",
        "ctr",
        "runc",
        "containerd-shim-runc-v2",
        "ip",
        "nsenter",
        "unshare",
        "iptables",
        "conntrack",
        "buildah",
    ] {
        if nestplane_runtime::binaries::on_path(p).is_err() {
            missing.push(p.to_string());
        }
    }
    if !std::path::Path::new("/usr/lib/cni/bridge").exists() {
        missing.push("/usr/lib/cni/bridge".into());
    }
    for b in ["kubelet", "kube-proxy"] {
        if nestplane_runtime::binaries::kubernetes(b, version).is_err() {
            missing.push(format!("{b} {version}"));
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Command {
            what: "checking node prerequisites".into(),
            output: format!("missing: {}; {INSTALL_HINT}", missing.join(", ")),
        })
    }
}
