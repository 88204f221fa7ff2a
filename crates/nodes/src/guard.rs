//! The container policy of nestplane's nodes, enforced below the tenant.
//!
//! A tenant admin controls everything inside their cluster, admission included, so a pod
//! security level inside it protects nothing from them. Here it is enforced on the node:
//! containerd's runc shim runs a per-node wrapper instead of runc (`BinaryName`), which reads
//! each OCI bundle's `config.json` before `runc create` and refuses what would reach the host
//! — privileged containers, host namespaces, bind mounts from outside the node's pod
//! directories, added capabilities, host devices, unmasked `/proc`, writable `/sys`, unsafe
//! sysctls — then execs runc. A container without a seccomp profile gets the node's default
//! (explicit `Unconfined` included: at this level the two look the same). A refusal is written
//! where the shim reads runc's errors, so the tenant sees it in the pod's events.
//!
//! [`judge`] is pure; [`main`] is the wrapper (`nestplane runc-guard POLICY RUNC-ARGS…`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Pod Security Standards' levels, as a NodePool names them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Level {
    /// Nothing is refused (an explicit choice; the NodePool shows a Warning).
    Privileged,
    /// Nothing that reaches the host: the default.
    #[default]
    Baseline,
    /// Baseline, and containers run as non-root, without privilege escalation, with no
    /// capability but `NET_BIND_SERVICE`.
    Restricted,
}

impl Level {
    /// The level's name (`Baseline`, …).
    pub fn name(self) -> &'static str {
        match self {
            Level::Privileged => "Privileged",
            Level::Baseline => "Baseline",
            Level::Restricted => "Restricted",
        }
    }
}

/// What one node's guard enforces (written next to the node's containerd configuration).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// The level.
    pub level: Level,
    /// The kubelet's pod directory (`<kubelet root>/pods`, canonical): bind mounts may come
    /// from a pod's `etc-hosts`, `containers/<name>/<id>` (termination log),
    /// `volumes/<plugin>/<volume>` and `volume-subpaths/…` there, nothing deeper or else.
    pub kubelet_pods: PathBuf,
    /// containerd's directories of pod sandboxes (`/etc/hostname`, `/etc/resolv.conf`,
    /// `/dev/shm`), canonical.
    pub sandbox_dirs: Vec<PathBuf>,
    /// The real runc.
    pub runc: PathBuf,
}

/// Capabilities a container may hold at Baseline: containerd's default set (what a
/// container without `capabilities.add` gets) and what Pod Security Standards' Baseline
/// allows to be added.
const BASELINE_CAPS: &[&str] = &[
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_MKNOD",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
];
/// Paths containerd masks in every unprivileged container; all must stay masked.
const MASKED: &[&str] = &[
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/sys/firmware",
];
/// Paths containerd makes read-only in every unprivileged container.
const READ_ONLY: &[&str] = &["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"];
/// Namespaces every container has of its own (or its pod's): without one, it shares the
/// node's (`hostNetwork`, `hostPID`, `hostIPC`).
const NAMESPACES: &[(&str, &str)] = &[
    ("network", "the node's network namespace (hostNetwork)"),
    ("pid", "the node's PID namespace (hostPID)"),
    ("ipc", "the node's IPC namespace (hostIPC)"),
    ("uts", "the node's UTS namespace"),
    ("mount", "the node's mount namespace"),
];
/// Sysctls Pod Security Standards call safe.
const SAFE_SYSCTLS: &[&str] = &[
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
];
/// System calls the node's default seccomp profile refuses (what escapes and kernel
/// attacks use; none of them is needed by an ordinary workload).
const DENIED_SYSCALLS: &[&str] = &[
    "acct",
    "add_key",
    "bpf",
    "clock_adjtime",
    "clock_settime",
    "create_module",
    "delete_module",
    "finit_module",
    "fsconfig",
    "fsmount",
    "fsopen",
    "fspick",
    "get_kernel_syms",
    "init_module",
    "io_uring_enter",
    "io_uring_register",
    "io_uring_setup",
    "ioperm",
    "iopl",
    "kcmp",
    "kexec_file_load",
    "kexec_load",
    "keyctl",
    "lookup_dcookie",
    "mount",
    "move_mount",
    "name_to_handle_at",
    "open_by_handle_at",
    "open_tree",
    "perf_event_open",
    "pivot_root",
    "process_vm_readv",
    "process_vm_writev",
    "ptrace",
    "quotactl",
    "reboot",
    "request_key",
    "setns",
    "settimeofday",
    "swapoff",
    "swapon",
    "syslog",
    "umount2",
    "unshare",
    "uselib",
    "userfaultfd",
    "vhangup",
];

/// `clone` flags that make namespaces: refused, as `unshare` is (a user namespace is where
/// unprivileged kernel exploits start).
const CLONE_NAMESPACE_FLAGS: &[u64] = &[
    0x0002_0000, // CLONE_NEWNS
    0x0200_0000, // CLONE_NEWCGROUP
    0x0400_0000, // CLONE_NEWUTS
    0x0800_0000, // CLONE_NEWIPC
    0x1000_0000, // CLONE_NEWUSER
    0x2000_0000, // CLONE_NEWPID
    0x4000_0000, // CLONE_NEWNET
];

/// The node's default seccomp profile: everything but [`DENIED_SYSCALLS`] (`EPERM`), `clone`
/// with a namespace flag (`EPERM`), and `clone3` (`ENOSYS`, so that the C library falls back
/// to `clone`, whose flags can be judged).
pub fn default_seccomp() -> Value {
    let mut rules = vec![
        json!({"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": 1}),
        json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}),
    ];
    for flag in CLONE_NAMESPACE_FLAGS {
        rules.push(json!({
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": 1,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }));
    }
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    })
}

/// Whether a bind mount from `real` (resolved) is one the kubelet or containerd makes for a
/// pod (see [`Policy`]): exact shapes only, so that no directory above a tenant-writable one
/// (where a component could be swapped for a symlink before runc mounts it) qualifies.
fn allowed_source(real: &Path, policy: &Policy) -> bool {
    fn parts(rest: &Path) -> Option<Vec<&str>> {
        rest.iter().map(|c| c.to_str()).collect()
    }
    for d in &policy.sandbox_dirs {
        if let Some(p) = real.strip_prefix(d).ok().and_then(parts) {
            // `<sandboxes>/<id>/{hostname,hosts,resolv.conf,shm}`.
            return matches!(
                p.as_slice(),
                [_, "hostname" | "hosts" | "resolv.conf" | "shm"]
            );
        }
    }
    if let Some(p) = policy
        .sandbox_dirs
        .first()
        .and_then(|d| d.parent())
        .map(|cri| cri.join("containers"))
        .and_then(|c| real.strip_prefix(c).ok().and_then(parts))
    {
        // Volumes an image declares: `<cri root>/containers/<id>/volumes/<uuid>`.
        return matches!(p.as_slice(), [_, "volumes", _]);
    }
    let Some(p) = real.strip_prefix(&policy.kubelet_pods).ok().and_then(parts) else {
        return false;
    };
    matches!(
        p.as_slice(),
        [_, "etc-hosts"]
            | [_, "containers", _, _]
            | [_, "volumes", _, _]
            | [_, "volumes", "kubernetes.io~csi", _, "mount"]
            | [_, "volume-subpaths", _, _, _]
    )
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

/// Judge an OCI runtime spec (`config.json`) under `policy`. `resolve` turns a mount's source
/// into the path it really names (symlinks followed; `None` when it cannot be resolved). A
/// bind mount's source is replaced by the resolved path, so runc mounts what was judged.
/// Returns whether the spec was changed (sources resolved, a default seccomp profile added),
/// or every reason it is refused.
pub fn judge(
    spec: &mut Value,
    policy: &Policy,
    resolve: impl Fn(&Path) -> Option<PathBuf>,
) -> Result<bool, Vec<String>> {
    if policy.level == Level::Privileged {
        return Ok(false);
    }
    let sandbox = spec
        .pointer("/annotations/io.kubernetes.cri.container-type")
        .and_then(Value::as_str)
        == Some("sandbox");
    let restricted = policy.level == Level::Restricted && !sandbox;
    let mut refused = isolation_refusals(spec, restricted);
    let changed = judge_mounts(spec, policy, &resolve, &mut refused);
    if restricted {
        refused.extend(restricted_refusals(spec));
    }
    if !refused.is_empty() {
        return Err(refused);
    }
    Ok(confine(spec) || changed)
}

/// What a spec shares with the host or adds to a container: namespaces, capabilities (only
/// `NET_BIND_SERVICE` when `restricted`), an unmasked /proc, devices, unsafe sysctls.
fn isolation_refusals(spec: &Value, restricted: bool) -> Vec<String> {
    let mut refused = Vec::new();
    let have: BTreeSet<String> = spec
        .pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|n| n.get("type").and_then(Value::as_str).map(str::to_string))
        .collect();
    for (ns, what) in NAMESPACES {
        if !have.contains(*ns) {
            refused.push(format!("it would share {what}"));
        }
    }
    let allowed: &[&str] = if restricted {
        &["CAP_NET_BIND_SERVICE"]
    } else {
        BASELINE_CAPS
    };
    let mut extra = BTreeSet::new();
    for set in [
        "bounding",
        "effective",
        "permitted",
        "inheritable",
        "ambient",
    ] {
        for c in strings(spec.pointer(&format!("/process/capabilities/{set}"))) {
            if !allowed.contains(&c.as_str()) {
                extra.insert(c);
            }
        }
    }
    if !extra.is_empty() {
        refused.push(format!(
            "privileged or added capabilities ({})",
            extra.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    let masked = strings(spec.pointer("/linux/maskedPaths"));
    let read_only = strings(spec.pointer("/linux/readonlyPaths"));
    if MASKED.iter().any(|p| !masked.iter().any(|m| m == p))
        || READ_ONLY.iter().any(|p| !read_only.iter().any(|m| m == p))
    {
        refused.push("an unmasked /proc (privileged, or procMount: Unmasked)".into());
    }
    if spec
        .pointer("/linux/devices")
        .and_then(Value::as_array)
        .is_some_and(|d| !d.is_empty())
    {
        refused.push("host devices".into());
    }
    if let Some(sysctls) = spec.pointer("/linux/sysctl").and_then(Value::as_object) {
        let unsafe_: Vec<&str> = sysctls
            .keys()
            .map(String::as_str)
            .filter(|k| !SAFE_SYSCTLS.contains(k))
            .collect();
        if !unsafe_.is_empty() {
            refused.push(format!("unsafe sysctls ({})", unsafe_.join(", ")));
        }
    }
    refused
}

/// Bind mounts only from the node's pod directories (each source replaced by the path it
/// resolves to, so runc mounts what was judged), and no writable sysfs or cgroup. Returns
/// whether a source was replaced; refusals go into `refused`.
fn judge_mounts(
    spec: &mut Value,
    policy: &Policy,
    resolve: &impl Fn(&Path) -> Option<PathBuf>,
    refused: &mut Vec<String>,
) -> bool {
    let mut changed = false;
    for m in spec
        .get_mut("mounts")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        let type_ = m.get("type").and_then(Value::as_str).unwrap_or_default();
        let options = strings(m.get("options"));
        let dest = m
            .get("destination")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let bind = type_ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        if !bind {
            if matches!(type_, "sysfs" | "cgroup" | "cgroup2") && !options.iter().any(|o| o == "ro")
            {
                refused.push(format!("a writable {type_} at {dest}"));
            }
            continue;
        }
        let source = m
            .get("source")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        match resolve(Path::new(&source)) {
            Some(real) if allowed_source(&real, policy) && real.to_str().is_some() => {
                let real = real.to_str().unwrap_or_default().to_string();
                if real != source {
                    m["source"] = Value::String(real);
                    changed = true;
                }
            }
            Some(real) => refused.push(format!(
                "a bind mount of {} at {dest} (hostPath, or a path outside the node's pod directories)",
                real.display()
            )),
            None => refused.push(format!(
                "a bind mount of {source} at {dest} that does not resolve"
            )),
        }
    }
    changed
}

/// What Restricted adds: not root, no privilege escalation.
fn restricted_refusals(spec: &Value) -> Vec<String> {
    let mut refused = Vec::new();
    if spec.pointer("/process/user/uid").and_then(Value::as_u64) == Some(0) {
        refused.push("it runs as root (Restricted needs runAsNonRoot)".into());
    }
    if spec
        .pointer("/process/noNewPrivileges")
        .and_then(Value::as_bool)
        != Some(true)
    {
        refused.push("privilege escalation is allowed (allowPrivilegeEscalation)".into());
    }
    refused
}

/// No seccomp profile, or one that allows everything: the node's default is put in. Returns
/// whether it was.
fn confine(spec: &mut Value) -> bool {
    let unconfined = match spec.pointer("/linux/seccomp") {
        None | Some(Value::Null) => true,
        Some(s) => {
            s.get("defaultAction").and_then(Value::as_str) == Some("SCMP_ACT_ALLOW")
                && s.get("syscalls")
                    .and_then(Value::as_array)
                    .is_none_or(|v| v.is_empty())
        }
    };
    if !unconfined {
        return false;
    }
    if let Some(linux) = spec.get_mut("linux").and_then(Value::as_object_mut) {
        linux.insert("seccomp".into(), default_seccomp());
    } else if let Some(obj) = spec.as_object_mut() {
        obj.insert("linux".into(), json!({"seccomp": default_seccomp()}));
    }
    true
}

/// Where runc's arguments put the subcommand, the bundle and the log file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RuncCall {
    /// `create`, `run`, `start`, `delete`, …
    pub command: Option<String>,
    /// `--bundle` (the working directory when unset).
    pub bundle: Option<PathBuf>,
    /// `--log` (where the shim reads runc's errors from).
    pub log: Option<PathBuf>,
}

/// Read runc's command line (without the program name). Pure.
pub fn parse_runc_args(args: &[String]) -> RuncCall {
    let mut call = RuncCall::default();
    let mut i = 0;
    // Global options that take a value.
    let valued = ["--root", "--log", "--log-format", "--criu", "--rootless"];
    while i < args.len() {
        let a = &args[i];
        if call.command.is_none() {
            if let Some((k, v)) = a.split_once('=') {
                if k == "--log" {
                    call.log = Some(PathBuf::from(v));
                }
            } else if valued.contains(&a.as_str()) {
                if a == "--log" {
                    call.log = args.get(i + 1).map(PathBuf::from);
                }
                i += 1;
            } else if !a.starts_with('-') {
                call.command = Some(a.clone());
            }
        } else if a == "--bundle" || a == "-b" {
            call.bundle = args.get(i + 1).map(PathBuf::from);
            i += 1;
        } else if let Some(v) = a.strip_prefix("--bundle=") {
            call.bundle = Some(PathBuf::from(v));
        }
        i += 1;
    }
    call
}

/// The wrapper: `args` are `POLICY-FILE` then runc's arguments. Judges the bundle of a
/// `create` or `run`, then execs runc; a refusal exits 1 with the reasons where the shim
/// reads them. Returns only on failure.
pub fn main(args: Vec<String>) -> i32 {
    let Some((policy_file, runc_args)) = args.split_first() else {
        eprintln!("usage: nestplane runc-guard POLICY-FILE RUNC-ARGS…");
        return 2;
    };
    let policy: Policy = match std::fs::read(policy_file)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("nestplane node guard: cannot read its policy {policy_file}: {e}");
            return 1;
        }
    };
    let call = parse_runc_args(runc_args);
    if matches!(call.command.as_deref(), Some("create" | "run")) {
        let bundle = call.bundle.clone().unwrap_or_else(|| PathBuf::from("."));
        let config = bundle.join("config.json");
        let verdict = std::fs::read(&config)
            .map_err(|e| vec![format!("cannot read {}: {e}", config.display())])
            .and_then(|b| {
                serde_json::from_slice::<Value>(&b)
                    .map_err(|e| vec![format!("bad config.json: {e}")])
            })
            .and_then(|mut spec| {
                let changed = judge(&mut spec, &policy, |p| std::fs::canonicalize(p).ok())?;
                if changed {
                    let body = serde_json::to_vec(&spec).map_err(|e| vec![e.to_string()])?;
                    std::fs::write(&config, body)
                        .map_err(|e| vec![format!("cannot write {}: {e}", config.display())])?;
                }
                Ok(())
            });
        if let Err(reasons) = verdict {
            let msg = format!(
                "refused by the node's pod security level {}: {}",
                policy.level.name(),
                reasons.join("; ")
            );
            if let Some(log) = &call.log {
                use std::io::Write as _;
                let line = json!({"level": "error", "msg": msg, "time": "1970-01-01T00:00:00Z"});
                if let Ok(mut f) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                {
                    // Best effort: a log line that cannot be written is not worth failing the container for.
                    let _ = writeln!(f, "{line}");
                }
            }
            eprintln!("{msg}");
            return 1;
        }
    }
    use std::os::unix::process::CommandExt as _;
    let err = std::process::Command::new(&policy.runc)
        .args(runc_args)
        .exec();
    eprintln!(
        "nestplane node guard: cannot run {}: {err}",
        policy.runc.display()
    );
    1
}

/// A node's guard: which `nestplane` binary judges (the level is the node's `spec.pod_security`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// The `nestplane` binary (its `runc-guard` command is the wrapper).
    pub nestplane: PathBuf,
}

/// The wrapper script containerd runs instead of runc for a node (`BinaryName`).
pub fn wrapper_script(nestplane: &Path, policy_file: &Path) -> String {
    let q = |p: &Path| format!("'{}'", p.display().to_string().replace('\'', r"'\''"));
    format!(
        "#!/bin/sh\n# nestplane's node guard: judges each container before runc runs it.\nexec {} runc-guard {} \"$@\"\n",
        q(nestplane),
        q(policy_file)
    )
}

#[cfg(test)]
mod tests;
