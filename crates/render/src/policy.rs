//! What a user patch may change, per runtime.
//!
//! Patches come from whoever may edit a component object. The operator holds every tenant's
//! CA keys, so a patch must never run code on the host, read another tenant's files or
//! secrets, or widen a pod's privileges. [`check`] compares a patched object set with the
//! rendered one and refuses what a runtime cannot allow; [`apply_checked`] applies patches one
//! at a time so the refusal names the patch that did it.
//!
//! Both runtimes refuse, in the pod template: any change to the pod's or a container's
//! `securityContext`; `hostNetwork`, `hostPID`, `hostIPC`; volumes other than the rendered ones
//! except `emptyDir` and `configMap` (so no `hostPath`, no other Secret, no projected token);
//! `envFrom` and `valueFrom` that the renderer did not write; a different `serviceAccountName`,
//! `automountServiceAccountToken`, `nodeName`; init and ephemeral containers; and
//! `externalIPs` on Services. Where the API server's cluster traffic goes through a sidecar
//! (the `kubernetes` runtime), the sidecar, its configuration and the API server's flag and
//! mounts that point at it ([`crate::egress::kept`]).
//!
//! The `process` runtime runs the template on the host, so it also keeps, byte for byte, the
//! command, the volumes and mounts, the working directory and the list of containers. Of the
//! arguments, a patch may only set, change or drop the tunable flags of
//! [`tunable_flags`] (`--name=value` form, values that are not paths), and environment
//! variables only when they are not loader or locale variables (`LD_*`, `GCONV_PATH`, …).

use serde_json::Value;

use crate::patch::{PatchError, apply, kind_name};

/// Where the patched objects will run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// Local processes on the operator's host.
    Process,
    /// Pods in the management cluster.
    Kubernetes,
}

/// Flags a patch may set in the `process` runtime, by the binary they belong to. None of
/// them names a file, a directory, a listening address or a credential.
pub fn tunable_flags(command: &str) -> &'static [&'static str] {
    match command {
        "etcd" => &[
            "--quota-backend-bytes",
            "--snapshot-count",
            "--heartbeat-interval",
            "--election-timeout",
            "--auto-compaction-mode",
            "--auto-compaction-retention",
            "--max-request-bytes",
            "--max-snapshots",
            "--max-wals",
            "--grpc-keepalive-min-time",
            "--grpc-keepalive-interval",
            "--grpc-keepalive-timeout",
            "--log-level",
            "--logger",
            "--enable-pprof",
        ],
        "kube-apiserver" => &[
            "--v",
            "--vmodule",
            "--feature-gates",
            "--profiling",
            "--max-requests-inflight",
            "--max-mutating-requests-inflight",
            "--min-request-timeout",
            "--request-timeout",
            "--default-watch-cache-size",
            "--watch-cache",
            "--watch-cache-sizes",
            "--event-ttl",
            "--enable-admission-plugins",
            "--disable-admission-plugins",
            "--runtime-config",
            "--service-node-port-range",
            "--goaway-chance",
            "--delete-collection-workers",
            "--default-not-ready-toleration-seconds",
            "--default-unreachable-toleration-seconds",
            "--enable-aggregator-routing",
            "--allow-privileged",
            "--storage-media-type",
            "--etcd-compaction-interval",
            "--etcd-count-metric-poll-period",
            "--shutdown-delay-duration",
            "--livez-grace-period",
        ],
        "kube-controller-manager" => &[
            "--v",
            "--vmodule",
            "--feature-gates",
            "--profiling",
            "--controllers",
            "--kube-api-qps",
            "--kube-api-burst",
            "--concurrent-deployment-syncs",
            "--concurrent-endpoint-syncs",
            "--concurrent-gc-syncs",
            "--concurrent-namespace-syncs",
            "--concurrent-replicaset-syncs",
            "--concurrent-service-syncs",
            "--concurrent-serviceaccount-token-syncs",
            "--concurrent-statefulset-syncs",
            "--node-monitor-period",
            "--node-monitor-grace-period",
            "--pod-eviction-timeout",
            "--terminated-pod-gc-threshold",
            "--horizontal-pod-autoscaler-sync-period",
            "--cluster-signing-duration",
            "--leader-elect",
            "--leader-elect-lease-duration",
            "--leader-elect-renew-deadline",
            "--leader-elect-retry-period",
        ],
        "kube-scheduler" => &[
            "--v",
            "--vmodule",
            "--feature-gates",
            "--profiling",
            "--kube-api-qps",
            "--kube-api-burst",
            "--leader-elect",
            "--leader-elect-lease-duration",
            "--leader-elect-renew-deadline",
            "--leader-elect-retry-period",
        ],
        _ => &[],
    }
}

/// Environment variables the dynamic loader, libc or Go's runtime read to load code or files:
/// never settable by a patch in the `process` runtime.
fn dangerous_env(name: &str) -> bool {
    const EXACT: &[&str] = &[
        "GCONV_PATH",
        "GETCONF_DIR",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TMPDIR",
        "TZDIR",
        "PATH",
        "HOME",
        "KUBECONFIG",
        "ETCDCTL_API",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
    ];
    name.starts_with("LD_")
        || name.starts_with("ETCD_")
        || name.starts_with("GODEBUG")
        || EXACT.contains(&name)
        || name.is_empty()
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A flag value that could name a file or escape a directory.
fn path_like(value: &str) -> bool {
    value.starts_with('/')
        || value.starts_with('~')
        || value.contains("..")
        || value.chars().any(char::is_control)
        || value.split(',').any(|v| {
            let v = v.split_once('=').map(|(_, r)| r).unwrap_or(v);
            v.starts_with('/') || v.starts_with("file:") || v.starts_with("unix:")
        })
}

/// Apply `patches` one at a time and [`check`] after each, so an error names the first patch
/// that crosses the line. `objects` is left as the last accepted state on error.
pub fn apply_checked<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    patches: &[Value],
    runtime: Runtime,
) -> Result<(), PatchError> {
    let mut objects: Vec<&mut Value> = objects.into_iter().collect();
    let rendered: Vec<Value> = objects.iter().map(|o| (**o).clone()).collect();
    for (index, patch) in patches.iter().enumerate() {
        let mut next: Vec<Value> = objects.iter().map(|o| (**o).clone()).collect();
        apply(next.iter_mut(), std::slice::from_ref(patch)).map_err(|mut e| {
            e.index = index;
            e
        })?;
        check(&rendered, &next, runtime).map_err(|(target, reason)| PatchError {
            index,
            target,
            reason,
        })?;
        for (o, n) in objects.iter_mut().zip(next) {
            **o = n;
        }
    }
    Ok(())
}

/// Compare `patched` with `rendered` (same objects, same order); `Err((target, reason))` names
/// the object and what may not change.
pub fn check(
    rendered: &[Value],
    patched: &[Value],
    runtime: Runtime,
) -> Result<(), (String, String)> {
    for (before, after) in rendered.iter().zip(patched) {
        let target = kind_name(before);
        let fail = |reason: String| Err((target.clone(), reason));
        if after.get("kind") != before.get("kind") {
            return fail("a patch may not change an object's kind".into());
        }
        if after
            .pointer("/spec/externalIPs")
            .is_some_and(|v| !v.is_null())
            && after.pointer("/spec/externalIPs") != before.pointer("/spec/externalIPs")
        {
            return fail("spec.externalIPs may not be set (it captures other traffic)".into());
        }
        let (Some(b), Some(a)) = (
            before.pointer("/spec/template/spec"),
            after.pointer("/spec/template/spec"),
        ) else {
            continue;
        };
        if let Err(reason) = check_pod(b, a, runtime) {
            return fail(reason);
        }
        if let (Some(b), Some(a)) = (
            before.pointer("/spec/template"),
            after.pointer("/spec/template"),
        ) && let Err(reason) = crate::egress::kept(b, a)
        {
            return fail(reason);
        }
    }
    Ok(())
}

fn same(b: &Value, a: &Value, field: &str) -> bool {
    b.get(field) == a.get(field)
}

/// A field's list, or an empty one.
fn list(v: &Value, f: &str) -> Vec<Value> {
    v.get(f)
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn check_pod(b: &Value, a: &Value, runtime: Runtime) -> Result<(), String> {
    for f in [
        "securityContext",
        "hostNetwork",
        "hostPID",
        "hostIPC",
        "hostUsers",
        "serviceAccountName",
        "serviceAccount",
        "automountServiceAccountToken",
        "nodeName",
        "initContainers",
        "ephemeralContainers",
        "shareProcessNamespace",
        // Priority preempts other tenants' pods; a runtime class picks another runtime.
        "priorityClassName",
        "priority",
        "preemptionPolicy",
        "runtimeClassName",
    ] {
        if !same(b, a, f) {
            return Err(format!(
                "spec.template.spec.{f} may not be changed by a patch"
            ));
        }
    }
    check_volumes(b, a, runtime)?;
    let bcs = list(b, "containers");
    let acs = list(a, "containers");
    if runtime == Runtime::Process {
        let names = |cs: &[Value]| -> Vec<Value> {
            cs.iter()
                .map(|c| c.get("name").cloned().unwrap_or(Value::Null))
                .collect()
        };
        if names(&bcs) != names(&acs) {
            return Err("the process runtime runs only the rendered containers".into());
        }
    }
    for c in &acs {
        let name = c.get("name").and_then(Value::as_str).unwrap_or("?");
        let rendered = bcs.iter().find(|r| r.get("name") == c.get("name"));
        check_container(rendered.unwrap_or(&Value::Null), c, runtime)
            .map_err(|e| format!("container {name:?}: {e}"))?;
    }
    Ok(())
}

/// Volumes: the rendered ones unchanged; in the kubernetes runtime, new emptyDir and
/// configMap volumes too.
fn check_volumes(b: &Value, a: &Value, runtime: Runtime) -> Result<(), String> {
    let bvols = list(b, "volumes");
    for v in list(a, "volumes") {
        if bvols.contains(&v) {
            continue;
        }
        let name = v.get("name").and_then(Value::as_str).unwrap_or("?");
        let harmless = v.as_object().is_some_and(|m| {
            m.keys()
                .all(|k| k == "name" || k == "emptyDir" || k == "configMap")
        });
        if runtime == Runtime::Process || !harmless {
            return Err(format!(
                "volume {name:?} is not one nestplane rendered; {}",
                if runtime == Runtime::Process {
                    "the process runtime runs only the rendered volumes"
                } else {
                    "a patch may add only emptyDir and configMap volumes"
                }
            ));
        }
    }
    if runtime == Runtime::Process && list(a, "volumes").len() != bvols.len() {
        return Err("the process runtime runs only the rendered volumes".into());
    }
    Ok(())
}

/// One patched container `c` against its rendered self `r` (`null` when the patch added it).
fn check_container(r: &Value, c: &Value, runtime: Runtime) -> Result<(), String> {
    let empty = Vec::new();
    if c.get("securityContext") != r.get("securityContext") {
        return Err("securityContext may not be changed by a patch".into());
    }
    if c.get("envFrom").is_some_and(|v| !v.is_null()) && c.get("envFrom") != r.get("envFrom") {
        return Err("envFrom may not be set by a patch".into());
    }
    let rports = r.get("ports").and_then(Value::as_array).unwrap_or(&empty);
    for p in c.get("ports").and_then(Value::as_array).unwrap_or(&empty) {
        if p.get("hostPort").is_some_and(|v| !v.is_null()) && !rports.contains(p) {
            return Err(
                "ports: hostPort may not be set by a patch (it takes the node's port)".into(),
            );
        }
    }
    check_env(r, c, runtime)?;
    // Mounts may only use volumes of the pod (the API server checks names; a subPath must
    // stay inside its volume).
    for m in c
        .get("volumeMounts")
        .and_then(Value::as_array)
        .unwrap_or(&empty)
    {
        let sub = m.get("subPath").and_then(Value::as_str).unwrap_or("");
        if sub.starts_with('/') || sub.split('/').any(|p| p == "..") {
            return Err(format!("volumeMount subPath {sub:?} leaves its volume"));
        }
    }
    if runtime == Runtime::Process {
        for f in ["command", "volumeMounts", "workingDir", "volumeDevices"] {
            if c.get(f) != r.get(f) {
                return Err(format!(
                    "{f} may not be changed in the process runtime (it runs on the operator's host)"
                ));
            }
        }
        check_args(r, c)?;
    }
    Ok(())
}

/// A patched container's environment: nestplane's own variables (POD_IP, POD_NAME, …,
/// expanded into listen addresses and names) unchanged, no `valueFrom`, and in the process
/// runtime nothing the loader, libc or the component reads code or files from.
fn check_env(r: &Value, c: &Value, runtime: Runtime) -> Result<(), String> {
    let empty = Vec::new();
    let renv = r.get("env").and_then(Value::as_array).unwrap_or(&empty);
    for e in c.get("env").and_then(Value::as_array).unwrap_or(&empty) {
        let ename = e.get("name").and_then(Value::as_str).unwrap_or("");
        if renv.iter().any(|r| {
            r.get("name") == e.get("name") && r.get("valueFrom").is_some_and(|v| !v.is_null())
        }) && !renv.contains(e)
        {
            return Err(format!(
                "env {ename:?} is set by nestplane (it becomes addresses and names) and may not be changed by a patch"
            ));
        }
        if e.get("valueFrom").is_some_and(|v| !v.is_null()) && !renv.contains(e) {
            return Err(format!(
                "env {ename:?}: valueFrom may not be set by a patch (it reads other objects)"
            ));
        }
        if runtime == Runtime::Process && !renv.contains(e) && dangerous_env(ename) {
            return Err(format!(
                "env {ename:?} may not be set in the process runtime (the loader, libc or the component reads files or code from it)"
            ));
        }
    }
    Ok(())
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| s.to_string())
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `--name=value` → (`--name`, value); `--name` → (`--name`, "").
fn split_flag(arg: &str) -> (&str, &str) {
    arg.split_once('=').unwrap_or((arg, ""))
}

fn check_args(rendered: &Value, patched: &Value) -> Result<(), String> {
    let command = strings(rendered.get("command"));
    let program = command.first().map(String::as_str).unwrap_or("");
    let tunable = tunable_flags(program);
    // Every argument the process will get: the command's tail, then args.
    let all = |c: &Value| -> Vec<String> {
        let mut v: Vec<String> = strings(c.get("command")).into_iter().skip(1).collect();
        v.extend(strings(c.get("args")));
        v
    };
    let before = all(rendered);
    let after = all(patched);
    for arg in &after {
        if before.contains(arg) {
            continue;
        }
        if !arg.starts_with("--") {
            return Err(format!(
                "argument {arg:?} is not one nestplane rendered; in the process runtime a patch may set only --flag=value arguments from the tunable list"
            ));
        }
        let (flag, value) = split_flag(arg);
        if !tunable.contains(&flag) {
            return Err(format!(
                "flag {flag} may not be set by a patch in the process runtime (tunable flags of {program}: {})",
                tunable.join(", ")
            ));
        }
        if path_like(value) {
            return Err(format!("flag {flag}: value {value:?} looks like a path"));
        }
    }
    for arg in &before {
        if after.contains(arg) {
            continue;
        }
        let (flag, _) = split_flag(arg);
        if !arg.starts_with("--") || !tunable.contains(&flag) {
            return Err(format!(
                "argument {arg:?} is required by nestplane and may not be removed or changed in the process runtime"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deployment() -> Value {
        json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "c-apiserver"},
            "spec": {"template": {"spec": {
                "securityContext": {"runAsNonRoot": true},
                "volumes": [{"name": "apiserver-serving", "secret": {"secretName": "c-apiserver"}}],
                "containers": [{
                    "name": "kube-apiserver",
                    "command": ["kube-apiserver"],
                    "args": ["--secure-port=6443", "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt", "--profiling=false"],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "volumeMounts": [{"name": "apiserver-serving", "mountPath": "/etc/nestplane/apiserver-serving"}],
                    "securityContext": {"allowPrivilegeEscalation": false}
                }]
            }}}
        })
    }

    fn service() -> Value {
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "c-apiserver"}, "spec": {"ports": []}})
    }

    fn run(patch: Value, runtime: Runtime) -> Result<Vec<Value>, PatchError> {
        let mut objs = vec![deployment(), service()];
        apply_checked(objs.iter_mut(), &[patch], runtime).map(|_| objs)
    }

    fn container_patch(container: Value) -> Value {
        let mut c = container;
        c["name"] = json!("kube-apiserver");
        json!({"kind": "Deployment", "metadata": {"name": "c-apiserver"},
               "spec": {"template": {"spec": {"containers": [c]}}}})
    }

    fn pod_patch(spec: Value) -> Value {
        json!({"kind": "Deployment", "metadata": {"name": "c-apiserver"},
               "spec": {"template": {"spec": spec}}})
    }

    #[test]
    fn a_shell_command_never_runs_on_the_host() {
        let p = container_patch(json!({"command": ["/bin/sh", "-c", "touch /tmp/x"]}));
        let e = run(p.clone(), Runtime::Process).unwrap_err();
        assert_eq!(e.index, 0);
        assert!(e.reason.contains("command may not be changed"), "{e}");
        // In a pod it is the pod's own business.
        assert!(run(p, Runtime::Kubernetes).is_ok());
    }

    #[test]
    fn host_paths_and_escaping_volumes_are_refused_in_both_runtimes() {
        for rt in [Runtime::Process, Runtime::Kubernetes] {
            let p = pod_patch(json!({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}));
            assert!(run(p, rt).unwrap_err().reason.contains("volume \"root\""));
            let p = pod_patch(
                json!({"volumes": [{"name": "other", "secret": {"secretName": "other-tenant-ca"}}]}),
            );
            assert!(run(p, rt).is_err(), "another tenant's secret");
            let p = container_patch(
                json!({"volumeMounts": [{"name": "apiserver-serving", "mountPath": "/x", "subPath": "../../.."}]}),
            );
            assert!(run(p, rt).unwrap_err().reason.contains("subPath"));
        }
        // emptyDir is fine in a pod.
        let p = pod_patch(json!({"volumes": [{"name": "scratch", "emptyDir": {}}]}));
        assert!(run(p.clone(), Runtime::Kubernetes).is_ok());
        assert!(run(p, Runtime::Process).is_err());
    }

    #[test]
    fn privileges_never_widen() {
        for rt in [Runtime::Process, Runtime::Kubernetes] {
            for spec in [
                json!({"hostNetwork": true}),
                json!({"hostPID": true}),
                json!({"hostIPC": true}),
                json!({"securityContext": {"runAsUser": 0}}),
                json!({"serviceAccountName": "nestplane-operator"}),
                json!({"initContainers": [{"name": "x", "image": "busybox"}]}),
            ] {
                assert!(run(pod_patch(spec.clone()), rt).is_err(), "{spec} {rt:?}");
            }
            for c in [
                json!({"securityContext": {"privileged": true}}),
                json!({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}),
                json!({"envFrom": [{"secretRef": {"name": "other"}}]}),
                json!({"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-ca", "key": "tls.key"}}}]}),
            ] {
                assert!(run(container_patch(c.clone()), rt).is_err(), "{c} {rt:?}");
            }
        }
        let svc = json!({"kind": "Service", "metadata": {"name": "c-apiserver"}, "spec": {"externalIPs": ["1.2.3.4"]}});
        assert!(run(svc, Runtime::Kubernetes).is_err());
    }

    #[test]
    fn node_ports_priority_and_nestplanes_own_env_stay_as_rendered() {
        for rt in [Runtime::Process, Runtime::Kubernetes] {
            let e = run(
                container_patch(json!({"ports": [{"containerPort": 6443, "hostPort": 6443}]})),
                rt,
            )
            .unwrap_err();
            assert!(e.reason.contains("hostPort"), "{e}");
            for spec in [
                json!({"priorityClassName": "system-node-critical"}),
                json!({"priority": 2000001000}),
                json!({"runtimeClassName": "other"}),
            ] {
                let e = run(pod_patch(spec.clone()), rt).unwrap_err();
                assert!(e.reason.contains("may not be changed"), "{spec}: {e}");
            }
            // POD_IP becomes the listen address: a patch cannot point it elsewhere.
            let e = run(
                container_patch(json!({"env": [{"name": "POD_IP", "value": "0.0.0.0"}]})),
                rt,
            )
            .unwrap_err();
            assert!(
                e.reason.contains("env \"POD_IP\" is set by nestplane"),
                "{e}"
            );
        }
        // Other environment variables (GOGC, …) are still a patch's to change.
        assert!(
            run(
                container_patch(json!({"env": [{"name": "GOGC", "value": "50"}]})),
                Runtime::Kubernetes
            )
            .is_ok()
        );
    }

    #[test]
    fn process_runtime_allows_tunable_flags_and_nothing_else() {
        let args = |a: &[&str]| container_patch(json!({"args": a}));
        let base = [
            "--secure-port=6443",
            "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt",
        ];
        // Change a tunable flag, add another.
        let mut ok: Vec<&str> = base.to_vec();
        ok.extend([
            "--profiling=true",
            "--v=4",
            "--feature-gates=A=true,B=false",
        ]);
        let objs = run(args(&ok), Runtime::Process).unwrap();
        assert!(objs[0].to_string().contains("--v=4"));
        // Paths, unknown flags, positional arguments and removals of required flags fail.
        for bad in [
            vec![
                "--secure-port=6443",
                "--tls-cert-file=/etc/passwd",
                "--profiling=false",
            ],
            vec![
                "--secure-port=6443",
                "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt",
                "--audit-log-path=/tmp/x",
            ],
            vec![
                "--secure-port=6443",
                "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt",
                "--v=../x",
            ],
            vec![
                "--secure-port=6443",
                "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt",
                "evil",
            ],
            vec!["--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt"],
            vec![
                "--secure-port=7443",
                "--tls-cert-file=/etc/nestplane/apiserver-serving/tls.crt",
            ],
        ] {
            assert!(run(args(&bad), Runtime::Process).is_err(), "{bad:?}");
            // Inside a pod, arguments are the pod's business.
            assert!(run(args(&bad), Runtime::Kubernetes).is_ok(), "{bad:?}");
        }
        for env in ["LD_PRELOAD", "GCONV_PATH", "PATH", "a-b", "ETCD_DATA_DIR"] {
            let p = container_patch(json!({"env": [{"name": env, "value": "/tmp/x"}]}));
            assert!(run(p, Runtime::Process).is_err(), "{env}");
        }
        let p = container_patch(json!({"env": [{"name": "GOMAXPROCS", "value": "2"}]}));
        assert!(run(p, Runtime::Process).is_ok());
        // Resources, labels and annotations are always fine.
        let p = json!({"kind": "Deployment", "metadata": {"name": "c-apiserver", "labels": {"team": "a"}},
            "spec": {"template": {"metadata": {"annotations": {"a": "b"}}, "spec": {"containers": [
                {"name": "kube-apiserver", "resources": {"limits": {"memory": "1Gi"}}}]}}}});
        assert!(run(p, Runtime::Process).is_ok());
    }

    #[test]
    fn the_refusal_names_the_patch_that_crossed_the_line() {
        let mut objs = [deployment(), service()];
        let patches = [
            container_patch(json!({"resources": {"limits": {"cpu": "1"}}})),
            pod_patch(json!({"hostPID": true})),
        ];
        let e = apply_checked(objs.iter_mut(), &patches, Runtime::Kubernetes).unwrap_err();
        assert_eq!(e.index, 1);
        assert_eq!(e.target, "Deployment/c-apiserver");
    }
}
