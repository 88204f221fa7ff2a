#![allow(clippy::unwrap_used)]
use super::*;

const NODE: &str = "/var/lib/nestplane/nodes/n1";

fn policy(level: Level) -> Policy {
    Policy {
        level,
        kubelet_pods: PathBuf::from(format!("{NODE}/kubelet/pods")),
        sandbox_dirs: vec![
            PathBuf::from(format!(
                "{NODE}/containerd/root/io.containerd.grpc.v1.cri/sandboxes"
            )),
            PathBuf::from(format!(
                "{NODE}/containerd/state/io.containerd.grpc.v1.cri/sandboxes"
            )),
        ],
        runc: PathBuf::from("/usr/sbin/runc"),
    }
}

/// What containerd 1.6's CRI plugin writes for an ordinary container of a pod (abridged to
/// what the guard reads).
fn ordinary() -> Value {
    let caps = json!([
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE"
    ]);
    json!({
        "ociVersion": "1.0.2-dev",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh"],
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": false,
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
            {"destination": "/etc/hosts", "type": "bind", "source": format!("{NODE}/kubelet/pods/u1/etc-hosts"), "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/dev/termination-log", "type": "bind", "source": format!("{NODE}/kubelet/pods/u1/containers/c/0"), "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/etc/resolv.conf", "type": "bind", "source": format!("{NODE}/containerd/root/io.containerd.grpc.v1.cri/sandboxes/s1/resolv.conf"), "options": ["rbind", "rprivate", "rw"]},
            {"destination": "/dev/shm", "type": "bind", "source": format!("{NODE}/containerd/state/io.containerd.grpc.v1.cri/sandboxes/s1/shm"), "options": ["rbind", "rprivate", "rw"]},
        ],
        "annotations": {"io.kubernetes.cri.container-type": "container"},
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc", "path": "/proc/7/ns/ipc"},
                {"type": "uts", "path": "/proc/7/ns/uts"}, {"type": "mount"},
                {"type": "network", "path": "/proc/7/ns/net"}
            ],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        }
    })
}

fn same(p: &Path) -> Option<PathBuf> {
    Some(p.to_path_buf())
}

fn refusal(spec: &mut Value, level: Level) -> String {
    judge(spec, &policy(level), same).unwrap_err().join("; ")
}

#[test]
fn an_ordinary_container_runs_with_the_node_default_seccomp_profile() {
    let mut spec = ordinary();
    assert_eq!(judge(&mut spec, &policy(Level::Baseline), same), Ok(true));
    assert_eq!(spec["linux"]["seccomp"], default_seccomp());
    // Judged again (a retried create): unchanged.
    assert_eq!(judge(&mut spec, &policy(Level::Baseline), same), Ok(false));
    // Its own profile (RuntimeDefault, Localhost) is kept.
    let mut own = ordinary();
    own["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]});
    let before = own.clone();
    assert_eq!(judge(&mut own, &policy(Level::Baseline), same), Ok(false));
    assert_eq!(own, before);
    // An explicit allow-everything profile is no profile.
    let mut open = ordinary();
    open["linux"]["seccomp"] = json!({"defaultAction": "SCMP_ACT_ALLOW"});
    assert_eq!(judge(&mut open, &policy(Level::Baseline), same), Ok(true));
    assert_eq!(open["linux"]["seccomp"], default_seccomp());
}

#[test]
fn each_way_to_the_host_is_refused_at_baseline() {
    type Attack = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Attack, &str)> = vec![
        (
            "hostNetwork",
            Box::new(|s| drop_ns(s, "network")),
            "hostNetwork",
        ),
        ("hostPID", Box::new(|s| drop_ns(s, "pid")), "hostPID"),
        ("hostIPC", Box::new(|s| drop_ns(s, "ipc")), "hostIPC"),
        (
            "privileged",
            Box::new(|s| {
                s["process"]["capabilities"]["bounding"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("CAP_SYS_ADMIN"));
                s["linux"]["maskedPaths"] = json!([]);
                s["linux"]["readonlyPaths"] = json!([]);
                s["linux"]["devices"] =
                    json!([{"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}]);
            }),
            "CAP_SYS_ADMIN",
        ),
        (
            "CAP_SYS_PTRACE",
            Box::new(|s| {
                s["process"]["capabilities"]["effective"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("CAP_SYS_PTRACE"));
            }),
            "CAP_SYS_PTRACE",
        ),
        (
            "procMount Unmasked",
            Box::new(|s| s["linux"]["maskedPaths"] = json!([])),
            "unmasked /proc",
        ),
        (
            "hostPath /",
            Box::new(|s| add_bind(s, "/", "/host")),
            "a bind mount of / at /host",
        ),
        (
            "hostPath /var/lib",
            Box::new(|s| add_bind(s, "/var/lib", "/x")),
            "a bind mount of /var/lib",
        ),
        (
            "hostPath into another node",
            Box::new(|s| add_bind(s, "/var/lib/nestplane/nodes/n2/kubelet/pods", "/x")),
            "outside the node's pod directories",
        ),
        (
            "the node's own credentials",
            Box::new(|s| add_bind(s, &format!("{NODE}/kubelet.conf"), "/x")),
            "kubelet.conf",
        ),
        (
            "containerd's bundles",
            Box::new(|s| {
                add_bind(
                    s,
                    &format!("{NODE}/containerd/state/io.containerd.runtime.v2.task/k8s.io"),
                    "/x",
                )
            }),
            "io.containerd.runtime.v2.task",
        ),
        (
            "inside an emptyDir (a symlink can replace it later)",
            Box::new(|s| {
                add_bind(
                    s,
                    &format!("{NODE}/kubelet/pods/u2/volumes/kubernetes.io~empty-dir/v/x"),
                    "/x",
                )
            }),
            "empty-dir/v/x",
        ),
        (
            "writable /sys",
            Box::new(|s| {
                s["mounts"][2]["options"] = json!(["nosuid", "rw"]);
            }),
            "a writable sysfs at /sys",
        ),
        (
            "unsafe sysctl",
            Box::new(|s| s["linux"]["sysctl"] = json!({"kernel.core_pattern": "|/x"})),
            "kernel.core_pattern",
        ),
    ];
    for (what, attack, named) in cases {
        let mut spec = ordinary();
        attack(&mut spec);
        let why = refusal(&mut spec, Level::Baseline);
        assert!(why.contains(named), "{what}: {why}");
        // Privileged is an explicit choice: nothing is refused or changed.
        let mut spec = ordinary();
        attack(&mut spec);
        let before = spec.clone();
        assert_eq!(
            judge(&mut spec, &policy(Level::Privileged), same),
            Ok(false)
        );
        assert_eq!(spec, before);
    }
    // A symlink is judged by what it points at.
    let mut spec = ordinary();
    add_bind(
        &mut spec,
        &format!("{NODE}/kubelet/pods/u1/volumes/link"),
        "/x",
    );
    let why = judge(&mut spec, &policy(Level::Baseline), |p| {
        Some(if p.ends_with("link") {
            PathBuf::from("/etc")
        } else {
            p.to_path_buf()
        })
    })
    .unwrap_err()
    .join("; ");
    assert!(why.contains("a bind mount of /etc at /x"), "{why}");
    // A source that does not resolve is refused; one that does is mounted as resolved.
    let mut spec = ordinary();
    add_bind(
        &mut spec,
        &format!("{NODE}/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/gone"),
        "/x",
    );
    let why = judge(&mut spec, &policy(Level::Baseline), |p| {
        (!p.ends_with("gone")).then(|| p.to_path_buf())
    })
    .unwrap_err()
    .join("; ");
    assert!(why.contains("does not resolve"), "{why}");
    let mut spec = ordinary();
    add_bind(
        &mut spec,
        "/n1-link/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/v",
        "/x",
    );
    assert_eq!(
        judge(&mut spec, &policy(Level::Baseline), |p| {
            Some(PathBuf::from(p.to_string_lossy().replace("/n1-link", NODE)))
        }),
        Ok(true)
    );
    assert_eq!(
        spec["mounts"].as_array().unwrap().last().unwrap()["source"],
        format!("{NODE}/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/v")
    );
}

#[test]
fn only_the_exact_shapes_the_kubelet_and_containerd_make_are_mounted() {
    let ok = [
        "kubelet/pods/u1/volumes/kubernetes.io~csi/pv1/mount",
        "kubelet/pods/u1/volume-subpaths/v/c/0",
        "containerd/root/io.containerd.grpc.v1.cri/sandboxes/s1/hostname",
        "containerd/root/io.containerd.grpc.v1.cri/containers/c1/volumes/0b1c",
    ];
    for rel in ok {
        let mut spec = ordinary();
        add_bind(&mut spec, &format!("{NODE}/{rel}"), "/x");
        assert!(
            judge(&mut spec, &policy(Level::Baseline), same).is_ok(),
            "{rel}"
        );
    }
    let refused = [
        // Directories above what a tenant writes into: a component could become a symlink.
        "containerd/root/io.containerd.grpc.v1.cri/sandboxes",
        "containerd/state/io.containerd.grpc.v1.cri/sandboxes/s1",
        "kubelet/pods/u1/volume-subpaths/v",
        "kubelet/pods/u1/volumes",
        "kubelet/pods",
        "containerd/root/io.containerd.grpc.v1.cri/containers/c1",
    ];
    for rel in refused {
        let mut spec = ordinary();
        add_bind(&mut spec, &format!("{NODE}/{rel}"), "/x");
        assert!(
            judge(&mut spec, &policy(Level::Baseline), same).is_err(),
            "{rel}"
        );
    }
}

#[test]
fn the_default_profile_refuses_namespaces_through_clone_too() {
    let p = default_seccomp();
    let rules = p["syscalls"].as_array().unwrap();
    let clone_flags: Vec<u64> = rules
        .iter()
        .filter(|r| r["names"] == json!(["clone"]))
        .map(|r| r["args"][0]["value"].as_u64().unwrap())
        .collect();
    assert!(clone_flags.contains(&0x1000_0000), "CLONE_NEWUSER");
    assert!(clone_flags.contains(&0x4000_0000), "CLONE_NEWNET");
    assert!(
        rules
            .iter()
            .any(|r| r["names"] == json!(["clone3"]) && r["errnoRet"] == 38)
    );
    let denied = &rules[0]["names"];
    for call in [
        "unshare",
        "setns",
        "mount",
        "io_uring_setup",
        "bpf",
        "keyctl",
    ] {
        assert!(denied.as_array().unwrap().contains(&json!(call)), "{call}");
    }
}

#[test]
fn restricted_wants_non_root_without_escalation_or_capabilities() {
    let why = refusal(&mut ordinary(), Level::Restricted);
    for named in ["runs as root", "allowPrivilegeEscalation", "CAP_CHOWN"] {
        assert!(why.contains(named), "{why}");
    }
    let mut fine = ordinary();
    fine["process"]["user"]["uid"] = json!(1000);
    fine["process"]["noNewPrivileges"] = json!(true);
    fine["process"]["capabilities"] = json!({"bounding": ["CAP_NET_BIND_SERVICE"]});
    assert_eq!(judge(&mut fine, &policy(Level::Restricted), same), Ok(true));
    // The pod's sandbox (pause, chosen by the node) keeps the default capabilities.
    let mut sandbox = ordinary();
    sandbox["annotations"]["io.kubernetes.cri.container-type"] = json!("sandbox");
    assert!(judge(&mut sandbox, &policy(Level::Restricted), same).is_ok());
}

#[test]
fn runc_arguments_name_the_command_bundle_and_log() {
    let args: Vec<String> = "--root /run/containerd/runc/k8s.io --log /b/log.json --log-format json create --bundle /b --pid-file /b/init.pid abc"
        .split(' ')
        .map(str::to_string)
        .collect();
    assert_eq!(
        parse_runc_args(&args),
        RuncCall {
            command: Some("create".into()),
            bundle: Some("/b".into()),
            log: Some("/b/log.json".into()),
        }
    );
    let state: Vec<String> = ["--root", "/r", "state", "abc"]
        .map(str::to_string)
        .to_vec();
    assert_eq!(parse_runc_args(&state).command.as_deref(), Some("state"));
    assert_eq!(parse_runc_args(&state).bundle, None);
}

#[test]
fn the_wrapper_script_quotes_its_paths() {
    let s = wrapper_script(Path::new("/opt/it's/nestplane"), Path::new("/n/guard.json"));
    assert!(
        s.contains(r#"exec '/opt/it'\''s/nestplane' runc-guard '/n/guard.json' "$@""#),
        "{s}"
    );
}

fn drop_ns(spec: &mut Value, ty: &str) {
    spec["linux"]["namespaces"]
        .as_array_mut()
        .unwrap()
        .retain(|n| n["type"] != ty);
}

fn add_bind(spec: &mut Value, source: &str, dest: &str) {
    spec["mounts"].as_array_mut().unwrap().push(
        json!({"destination": dest, "type": "bind", "source": source, "options": ["rbind", "rprivate", "rw"]}),
    );
}
