//! Backups as a user takes them: `nestplane backup create` makes a `NestedBackup`, the
//! operator reads the tenant's keys with the tenant's own etcd credentials (a tenant on a
//! shared datastore, and one with an etcd of its own), and seals them into an archive that
//! the key Secret opens. What a namespace user controls (the location, the key Secret, the
//! control plane named, a file in the way) is tried as an attacker would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::*;
use nestplane_operator::backup::archive;

fn backup_yaml(ns: &str, name: &str, cluster: &str, extra: &str) -> String {
    format!(
        "apiVersion: backup.nestplane.io/v1alpha1\nkind: NestedBackup\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  controlPlaneRef: {{name: {cluster}}}\n{extra}"
    )
}

fn field(kc: &Path, ns: &str, name: &str, path: &str) -> String {
    jsonpath(kc, &["nestedbackup", "-n", ns, name], path)
}

/// Wait until backup `ns/name` is in `phase` with a `Ready` reason of `reason`.
fn wait_phase(kc: &Path, ns: &str, name: &str, phase: &str, reason: &str) {
    let started = std::time::Instant::now();
    loop {
        let got = field(
            kc,
            ns,
            name,
            "{.status.phase} {.status.conditions[?(@.type==\"Ready\")].reason}",
        );
        if got == format!("{phase} {reason}") {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "NestedBackup {ns}/{name} is not {phase} ({reason}) after 120 s: {got}: {}",
            field(kc, ns, name, "{.status.conditions[0].message}")
        );
        std::thread::sleep(poll_pause(started));
    }
}

/// ConfigMaps `cm-<i>` of `default` for each `i` of `range`, each holding `n: value(i)`, as
/// one YAML stream.
fn config_map_list(range: std::ops::Range<usize>, value: &dyn Fn(usize) -> String) -> String {
    range
        .map(|i| {
            format!(
                "---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: cm-{i}, namespace: default}}\ndata: {{\"n\": \"{}\"}}\n",
                value(i)
            )
        })
        .collect()
}

/// The archive key of `ns/secret`.
async fn key_of(env: &Env, ns: &str, secret: &str) -> Vec<u8> {
    env.secret(ns, secret)
        .await
        .expect("the key Secret")
        .data
        .unwrap()["key"]
        .0
        .clone()
}

fn open(path: &Path, key: &[u8]) -> (archive::Header, Vec<String>) {
    let bytes = std::fs::read(path).unwrap();
    let (header, records) = archive::decode(&bytes, key, &archive::Limits::default())
        .expect("the archive opens with the key Secret's key");
    let keys = records
        .iter()
        .map(|r| String::from_utf8_lossy(&r.key).into_owned())
        .collect();
    (header, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backups_of_a_shared_datastore_tenant_and_an_own_etcd_tenant_open_with_their_key() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    let root = env.operator_dir().join("backups");
    env.apply(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {name: shared, namespace: default}\nspec: {managed: {replicas: 1}}\n---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {name: alpha, namespace: default}\nspec:\n  version: v1.20.2\n  datastoreRef: {name: shared}\n",
    );
    env.create_ncp("default", "gamma").await;
    env.wait_ready("default", "alpha", Duration::from_secs(180))
        .await;

    // 500 ConfigMaps in alpha.
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    kubectl_apply(&alpha, &config_map_list(0..500, &|i| i.to_string()));

    // `nestplane backup create`: waits, and its last line is the archive's own URL.
    let out = nestplane()
        .args([
            "backup",
            "create",
            "alpha",
            "--name",
            "alpha-1",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let url = stdout.lines().last().unwrap_or_default().to_string();
    let file = root.join("default/alpha-1.npbackup");
    assert_eq!(url, format!("file://{}", file.display()), "{stderr}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(&root.join("default")), 0o700);

    // The status tells the story, and `kubectl get` shows it.
    assert_eq!(
        field(&kc, "default", "alpha-1", "{.status.phase}"),
        "Completed"
    );
    assert_eq!(field(&kc, "default", "alpha-1", "{.status.url}"), url);
    let keys: u64 = field(&kc, "default", "alpha-1", "{.status.keys}")
        .parse()
        .unwrap();
    assert!(keys > 500, "{keys}");
    let table = kubectl_ok(&kc, &["get", "nestedbackups", "-n", "default"]);
    assert!(
        table.contains("alpha-1") && table.contains("Completed"),
        "{table}"
    );
    let events = events_for(&kc, "default", "alpha-1");
    assert!(events.contains("Normal KeyCreated"), "{events}");
    assert!(events.contains("Normal Completed"), "{events}");

    // The key Secret made for it is owned by nothing (deleting the control plane must not
    // take the only key of its backups), and opens the archive: alpha's keys, relative to
    // its prefix, the 500 ConfigMaps among them.
    let key_secret = env.secret("default", "alpha-backup-key").await.unwrap();
    assert!(key_secret.metadata.owner_references.is_none());
    let key = key_of(&env, "default", "alpha-backup-key").await;
    assert_eq!(key.len(), 32);
    let (header, names) = open(&file, &key);
    assert_eq!(header.tenant, "default/alpha");
    assert_eq!(header.keys, keys);
    assert_eq!(
        header.digest,
        field(&kc, "default", "alpha-1", "{.status.digest}")
    );
    assert_eq!(
        header.id,
        field(&kc, "default", "alpha-1", "{.metadata.uid}")
    );
    for i in [0, 250, 499] {
        assert!(
            names.contains(&format!("configmaps/default/cm-{i}")),
            "{names:?}"
        );
    }
    assert!(names.iter().all(|n| !n.starts_with('/')), "{names:?}");
    // The tenant's CAs and service-account key are sealed in with its keys, exactly as its
    // Secrets hold them (so what they issued verifies after a restore).
    let opened =
        archive::decode_all(&std::fs::read(&file).unwrap(), &key, &Default::default()).unwrap();
    for (purpose, secret) in [
        ("ca", "alpha-ca"),
        ("sa", "alpha-sa"),
        ("proxy", "alpha-proxy"),
    ] {
        let held = env.secret("default", secret).await.unwrap().data.unwrap();
        assert_eq!(
            opened.trust[purpose]["tls.key"].as_bytes(),
            &held["tls.key"].0[..],
            "{purpose}"
        );
    }
    // The shared datastore's CA is alpha's trust of its etcd: a certificate, never its key.
    assert!(opened.trust["etcd"].contains_key("tls.crt"));
    assert!(!opened.trust["etcd"].contains_key("tls.key"));
    // Another key does not open it.
    assert!(
        archive::decode(
            &std::fs::read(&file).unwrap(),
            &[7u8; 32],
            &Default::default()
        )
        .is_err()
    );

    // gamma has an etcd of its own: the same engine, its whole `/registry/`.
    env.wait_ready("default", "gamma", Duration::from_secs(120))
        .await;
    env.apply(&backup_yaml("default", "gamma-1", "gamma", ""));
    wait_phase(&kc, "default", "gamma-1", "Completed", "Completed");
    let gamma_key = key_of(&env, "default", "gamma-backup-key").await;
    assert_ne!(gamma_key, key);
    let (header, names) = open(&root.join("default/gamma-1.npbackup"), &gamma_key);
    assert_eq!(header.tenant, "default/gamma");
    assert!(
        names.contains(&"namespaces/default".to_string()),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains("cm-")), "{names:?}");

    // `nestplane backup list` lists both, as JSON too.
    let rows = backup_list_json(&kc);
    let listed: Vec<(&str, &str)> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), r["phase"].as_str().unwrap()))
        .collect();
    assert_eq!(
        listed,
        vec![("alpha-1", "Completed"), ("gamma-1", "Completed")]
    );

    // A schedule: a backup of gamma every 10 s, the newest 2 completed ones kept. It runs
    // while the rest of this test goes on; what it did is read at the end. gamma-1, a backup
    // a user took by hand, is given the schedule's label (as anyone who may edit backups
    // can): the schedule must not take it for its own and delete it.
    kubectl_ok(
        &kc,
        &[
            "label",
            "nestedbackup",
            "-n",
            "default",
            "gamma-1",
            &format!("{SCHEDULE}=gamma-every"),
        ],
    );
    let schedule = |args: &[&str]| {
        nestplane()
            .args(["backup", "schedule"])
            .args(args)
            .arg("--kubeconfig")
            .arg(&kc)
            .output()
            .unwrap()
    };
    let out = schedule(&[
        "gamma",
        "--every",
        "10s",
        "--keep",
        "2",
        "--name",
        "gamma-every",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "default/gamma-every"
    );
    // One of another namespace's control plane makes nothing; a period under 10 s is refused,
    // and the CLI says why.
    kubectl_ok(&kc, &["create", "namespace", "team-b"]);
    env.apply(&schedule_yaml("team-b", "steal-every", "alpha", "10s"));
    let out = schedule(&["alpha", "--every", "1s", "--name", "too-often"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("is not between 10s and 366d (InvalidSpec)"),
        "{stderr}"
    );
    wait_schedule(&kc, "team-b", "steal-every", "False ControlPlaneNotFound");
    wait_schedule(&kc, "default", "too-often", "False InvalidSpec");
    assert!(events_for(&kc, "default", "too-often").contains("Warning InvalidSpec"));

    // Hostile input. A location outside the namespace's own directory: refused, with a
    // reason, an Event and nothing written; the CLI says why and fails.
    let out = nestplane()
        .args([
            "backup",
            "create",
            "alpha",
            "--name",
            "etc",
            "--to",
            "file:///etc",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("backups of namespace default go under"),
        "{stderr}"
    );
    assert!(!Path::new("/etc/etc.npbackup").exists());
    assert_eq!(field(&kc, "default", "etc", "{.status.phase}"), "Failed");
    assert!(events_for(&kc, "default", "etc").contains("Warning LocationRefused"));
    for (name, location) in [
        ("other-ns", format!("file://{}/team-b", root.display())),
        (
            "dotdot",
            format!("file://{}/default/../team-b", root.display()),
        ),
        ("s3", "s3://bucket/x".to_string()),
    ] {
        env.apply(&backup_yaml(
            "default",
            name,
            "alpha",
            &format!("  location: \"{location}\"\n"),
        ));
        wait_phase(&kc, "default", name, "Failed", "LocationRefused");
    }
    assert!(!root.join("team-b").exists());

    // A control plane of another namespace cannot be named: a backup names one of its own.
    env.apply(&backup_yaml("team-b", "steal", "alpha", ""));
    wait_phase(&kc, "team-b", "steal", "Pending", "ControlPlaneNotFound");
    assert!(!root.join("team-b").exists());
    assert!(env.secret("team-b", "alpha-backup-key").await.is_none());

    // A key Secret that does not hold a key of 32 bytes: waits, and says so.
    kubectl_ok(
        &kc,
        &[
            "create",
            "secret",
            "generic",
            "short",
            "-n",
            "default",
            "--from-literal=key=0123456789",
        ],
    );
    env.apply(&backup_yaml(
        "default",
        "short-key",
        "alpha",
        "  keySecretRef: {name: short}\n",
    ));
    wait_phase(&kc, "default", "short-key", "Pending", "InvalidKey");
    assert!(!root.join("default/short-key.npbackup").exists());

    // A file in the way of an archive is never replaced; a link there is not written through.
    std::fs::write(root.join("default/taken.npbackup"), b"someone else's").unwrap();
    env.apply(&backup_yaml("default", "taken", "alpha", ""));
    wait_phase(&kc, "default", "taken", "Failed", "ArchiveExists");
    assert_eq!(
        std::fs::read(root.join("default/taken.npbackup")).unwrap(),
        b"someone else's"
    );
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("default/away")).unwrap();
    env.apply(&backup_yaml(
        "default",
        "through-link",
        "alpha",
        &format!("  location: \"file://{}/default/away\"\n", root.display()),
    ));
    wait_phase(&kc, "default", "through-link", "Running", "BackupFailed");
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);

    // The archive does not carry its own key.
    let alpha_1 = std::fs::read(&file).unwrap();
    assert_eq!(open(&file, &key).1.len() as u64, keys);
    assert!(!alpha_1.windows(32).any(|w| w == key.as_slice()));

    // The schedule, once it has made three backups: the first is deleted with its archive.
    // Then it is made to wait an hour, and once none of its backups is being taken, the
    // newest two are there and open with gamma's key, every older one is gone with its
    // archive, and gamma-1, labelled by hand, is untouched.
    let made = |kc: &Path| -> Vec<String> {
        let mut made: Vec<String> = events_for(kc, "default", "gamma-every")
            .lines()
            .filter_map(|l| l.strip_prefix("Normal Created: made NestedBackup default/"))
            .map(str::to_string)
            .collect();
        made.sort();
        made
    };
    let archive_of = |name: &str| root.join(format!("default/{name}.npbackup"));
    let first = eventually(
        "three backups made by the schedule, and the first pruned",
        Duration::from_secs(90),
        || {
            let made = made(&kc);
            (made.len() >= 3 && !archive_of(&made[0]).exists()).then(|| made[0].clone())
        },
    );
    kubectl_ok(
        &kc,
        &[
            "patch",
            "nestedbackupschedule",
            "-n",
            "default",
            "gamma-every",
            "--type=merge",
            "-p",
            r#"{"spec":{"every":"1h"}}"#,
        ],
    );
    let phases = |kc: &Path| {
        kubectl_ok(
            kc,
            &[
                "get",
                "nestedbackups",
                "-n",
                "default",
                "-l",
                &format!("{SCHEDULE}=gamma-every"),
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}={.status.phase}{\"\\n\"}{end}",
            ],
        )
    };
    let listed = eventually(
        "the schedule's backups all taken, and two of them kept",
        Duration::from_secs(90),
        || {
            let listed = phases(&kc);
            let kept = jsonpath(
                &kc,
                &["nestedbackupschedule", "-n", "default", "gamma-every"],
                "{.status.kept}",
            );
            let completed = listed
                .lines()
                .filter(|l| l.ends_with("=Completed") && !l.starts_with("gamma-1="))
                .count();
            (kept == "2"
                && completed == 2
                && !listed.contains("=Running")
                && !listed.lines().any(|l| l.ends_with('=')))
            .then_some(listed)
        },
    );
    let made = made(&kc);
    let newest: Vec<String> = made[made.len() - 2..].to_vec();
    let mut kept: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.strip_suffix("=Completed"))
        .filter(|n| *n != "gamma-1")
        .collect();
    kept.sort();
    assert_eq!(kept, newest, "{listed}");
    for name in &made[..made.len() - 2] {
        assert!(!archive_of(name).exists(), "{name}");
    }
    for name in &newest {
        let (header, _) = open(&archive_of(name), &gamma_key);
        assert_eq!(header.tenant, "default/gamma");
    }
    // Labelled by hand, not made by it: kept, with its archive.
    assert!(listed.contains("gamma-1=Completed"), "{listed}");
    assert!(archive_of("gamma-1").exists());
    let events = events_for(&kc, "default", "gamma-every");
    assert!(
        events.contains(&format!(
            "Normal Pruned: deleted NestedBackup default/{first} and its archive"
        )),
        "{events}"
    );
    assert!(!events.contains("default/gamma-1 "), "{events}");
    let table = kubectl_ok(&kc, &["get", "nbks", "-n", "default", "gamma-every"]);
    assert!(table.contains("1h") && table.contains("True"), "{table}");

    // A namespace's archives past its quota (10 GiB by default; a sparse file of that size
    // here): a new backup waits, saying so, and so does the schedule; once there is room, it
    // is taken.
    let filler = root.join("default/filler");
    std::fs::File::create(&filler)
        .unwrap()
        .set_len(nestplane_operator::backup::controller::NAMESPACE_QUOTA)
        .unwrap();
    env.apply(&backup_yaml("default", "over-quota", "alpha", ""));
    wait_phase(&kc, "default", "over-quota", "Pending", "QuotaExceeded");
    assert!(
        field(
            &kc,
            "default",
            "over-quota",
            "{.status.conditions[0].message}"
        )
        .contains("the archives of namespace default take"),
    );
    let out = schedule(&[
        "gamma",
        "--every",
        "10s",
        "--keep",
        "2",
        "--name",
        "gamma-every",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_schedule(&kc, "default", "gamma-every", "False QuotaExceeded");
    // Suspended from here on (it makes nothing more; what it made is kept), so that its
    // backups do not hold the backup slots below. Run again with --every alone, the CLI
    // keeps what it does not name: keep 2, and the suspension.
    let out = schedule(&[
        "gamma",
        "--every",
        "10s",
        "--name",
        "gamma-every",
        "--suspend",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = schedule(&["gamma", "--every", "1h", "--name", "gamma-every"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        jsonpath(
            &kc,
            &["nestedbackupschedule", "-n", "default", "gamma-every"],
            "{.spec.keep} {.spec.suspend} {.spec.every}"
        ),
        "2 true 1h"
    );
    assert!(!root.join("default/over-quota.npbackup").exists());
    std::fs::remove_file(&filler).unwrap();
    wait_phase(&kc, "default", "over-quota", "Completed", "Completed");

    // deletionPolicy: Delete: the archive goes with its backup; the default keeps it.
    let out = nestplane()
        .args([
            "backup",
            "create",
            "gamma",
            "--name",
            "disposable",
            "--deletion-policy",
            "Delete",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let disposable = root.join("default/disposable.npbackup");
    assert!(disposable.exists());
    assert_eq!(
        field(&kc, "default", "disposable", "{.metadata.finalizers}"),
        r#"["backup.nestplane.io/archive"]"#
    );
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nestedbackup",
            "-n",
            "default",
            "disposable",
            "--timeout=120s",
        ],
    );
    assert!(!disposable.exists());
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nestedbackup",
            "-n",
            "default",
            "over-quota",
            "--timeout=120s",
        ],
    );
    assert!(root.join("default/over-quota.npbackup").exists());

    // The schedule of another namespace's control plane made nothing.
    assert!(!root.join("team-b").exists());
    assert_eq!(
        kubectl_ok(
            &kc,
            &[
                "get",
                "nestedbackups",
                "-n",
                "team-b",
                "-l",
                &format!("{SCHEDULE}=steal-every"),
                "-o",
                "name"
            ]
        ),
        ""
    );
}

const SCHEDULE: &str = nestplane_api::backup::SCHEDULE_LABEL;

fn schedule_yaml(ns: &str, name: &str, cluster: &str, every: &str) -> String {
    format!(
        "apiVersion: backup.nestplane.io/v1alpha1\nkind: NestedBackupSchedule\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  controlPlaneRef: {{name: {cluster}}}\n  every: {every}\n  keep: 2\n"
    )
}

/// Wait until schedule `ns/name`'s `Ready` is `want` (`<status> <reason>`).
fn wait_schedule(kc: &Path, ns: &str, name: &str, want: &str) {
    eventually(
        &format!("NestedBackupSchedule {ns}/{name} {want}"),
        Duration::from_secs(60),
        || {
            (jsonpath(
                kc,
                &["nestedbackupschedule", "-n", ns, name],
                "{.status.conditions[?(@.type==\"Ready\")].status} {.status.conditions[?(@.type==\"Ready\")].reason}",
            ) == want)
                .then_some(())
        },
    );
}

fn restore_yaml(name: &str, cluster: &str, spec: &str) -> String {
    format!(
        "apiVersion: backup.nestplane.io/v1alpha1\nkind: NestedRestore\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  controlPlaneRef: {{name: {cluster}}}\n{spec}"
    )
}

fn restore_field(kc: &Path, name: &str, path: &str) -> String {
    jsonpath(kc, &["nestedrestore", "-n", "default", name], path)
}

/// The names of the `cm-` ConfigMaps of `default` in the cluster of `kc`, and what each holds.
fn config_maps(kc: &Path) -> std::collections::BTreeMap<String, String> {
    kubectl_ok(
        kc,
        &[
            "get",
            "configmaps",
            "-n",
            "default",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.data.n}{\"\\n\"}{end}",
        ],
    )
    .lines()
    .filter_map(|l| l.split_once('='))
    .filter(|(n, _)| n.starts_with("cm-") || *n == "after-backup")
    .map(|(n, v)| (n.to_string(), v.to_string()))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_gives_a_tenant_back_its_backup_and_leaves_its_neighbour_alone() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    let root = env.operator_dir().join("backups");
    let on_shared = |name: &str| {
        format!(
            "---\napiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedControlPlane\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  version: v1.20.2\n  datastoreRef: {{name: shared}}\n"
        )
    };
    env.apply(&format!(
        "apiVersion: controlplane.cluster.x-k8s.io/v1alpha1\nkind: NestedDatastore\nmetadata: {{name: shared, namespace: default}}\nspec: {{managed: {{replicas: 1}}}}\n{}{}",
        on_shared("alpha"),
        on_shared("beta")
    ));
    env.wait_ready("default", "alpha", Duration::from_secs(180))
        .await;
    env.wait_ready("default", "beta", Duration::from_secs(120))
        .await;
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    let beta = env.tenant_kubeconfig("default", "beta").await;
    let cms = config_map_list;
    kubectl_apply(&alpha, &cms(0..500, &|i| i.to_string()));
    kubectl_apply(&beta, &cms(0..3, &|i| format!("beta-{i}")));
    // Issued before the backup: a token of alpha's default service account.
    let dir = env.state.path().to_path_buf();
    eventually(
        "alpha's default service account",
        Duration::from_secs(60),
        || {
            kubectl(
                &alpha,
                &["get", "serviceaccount", "default", "-n", "default"],
            )
            .status
            .success()
            .then_some(())
        },
    );
    let alpha_token = request_token(&alpha, &dir);
    let backed_up = config_maps(&alpha);
    assert_eq!(backed_up.len(), 500);

    let out = nestplane()
        .args([
            "backup",
            "create",
            "alpha",
            "--name",
            "alpha-1",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let url = String::from_utf8_lossy(&out.stdout).trim().to_string();

    // After the backup: changed, deleted, added.
    kubectl_apply(&alpha, &cms(0..10, &|i| format!("changed-{i}")));
    let mut delete: Vec<String> = ["delete", "configmap", "-n", "default"]
        .map(String::from)
        .to_vec();
    delete.extend((10..20).map(|i| format!("cm-{i}")));
    kubectl_ok(
        &alpha,
        &delete.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    kubectl_apply(
        &alpha,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: after-backup, namespace: default}\ndata: {\"n\": new}\n",
    );
    assert_ne!(config_maps(&alpha), backed_up);
    let beta_before = config_maps(&beta);
    let beta_rv = jsonpath(
        &beta,
        &["configmap", "-n", "default", "cm-0"],
        "{.metadata.resourceVersion}",
    );
    let pid = |name: &str, c: &str| env.pid("default", name, c, 0).expect("it runs");
    let (alpha_api, beta_api, beta_cm, datastore_etcd) = (
        pid("alpha", "apiserver"),
        pid("beta", "apiserver"),
        pid("beta", "controller-manager"),
        pid("shared-datastore", "etcd"),
    );

    // Hostile archives first: each refused before anything stops.
    let bad = root.join("default/tampered.npbackup");
    let mut bytes = std::fs::read(root.join("default/alpha-1.npbackup")).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&bad, &bytes).unwrap();
    let key = key_of(&env, "default", "alpha-backup-key").await;
    // Sealed with alpha's own key, but holding a key that leaves alpha's prefix for beta's.
    let escape = vec![archive::Record {
        key: b"../../beta/registry/configmaps/default/cm-0".to_vec(),
        value: b"planted".to_vec(),
        lease: None,
    }];
    let header = archive::header_for("default/alpha", "v1.20.2", 1, "now", &escape);
    std::fs::write(
        root.join("default/escape.npbackup"),
        archive::encode(&header, &escape, &key).unwrap(),
    )
    .unwrap();
    for (name, spec, reason) in [
        (
            "tampered",
            format!("  from: \"file://{}\"\n", bad.display()),
            "InvalidArchive",
        ),
        (
            "escape",
            format!(
                "  from: \"file://{}/default/escape.npbackup\"\n",
                root.display()
            ),
            "InvalidArchive",
        ),
        (
            "passwd",
            "  from: \"file:///etc/passwd\"\n".to_string(),
            "LocationRefused",
        ),
        // alpha's archive into beta: another control plane's keys.
        (
            "into-beta",
            "  backupRef: {name: alpha-1}\n".to_string(),
            "OtherControlPlane",
        ),
    ] {
        let cluster = if name == "into-beta" { "beta" } else { "alpha" };
        env.apply(&restore_yaml(name, cluster, &spec));
        eventually(
            &format!("restore {name} refused"),
            Duration::from_secs(60),
            || {
                (restore_field(&kc, name, "{.status.phase} {.status.conditions[0].reason}")
                    == format!("Failed {reason}"))
                .then_some(())
            },
        );
        assert!(events_for(&kc, "default", name).contains(&format!("Warning {reason}")));
    }
    assert_eq!(
        pid("alpha", "apiserver"),
        alpha_api,
        "a refused restore stopped alpha"
    );
    assert_eq!(config_maps(&beta), beta_before);

    // The restore: the CLI waits, and says what it did.
    let out = nestplane()
        .args([
            "backup",
            "restore",
            "alpha",
            "--from",
            &url,
            "--name",
            "back",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The CLI prints the phases it saw; a short one can fall between two of its reads.
    assert!(
        stderr.contains("Stopping") && stderr.contains("Completed"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("restored default/alpha from "),
        "{stdout}"
    );
    eprintln!("{stderr}{stdout}");

    // alpha holds exactly what was backed up, and serves it.
    assert_eq!(config_maps(&alpha), backed_up);
    assert_eq!(restore_field(&kc, "back", "{.status.phase}"), "Completed");
    let deleted: u64 = restore_field(&kc, "back", "{.status.deleted}")
        .parse()
        .unwrap();
    assert!(deleted >= 1, "{deleted}");
    let downtime: f64 = restore_field(&kc, "back", "{.status.downtimeSeconds}")
        .parse()
        .unwrap();
    assert!(downtime > 0.0);
    let events = events_for(&kc, "default", "back");
    // Every phase said so in an Event.
    for e in ["Normal Stopping", "Normal Restored", "Normal Completed"] {
        assert!(events.contains(e), "no {e}: {events}");
    }
    // Its API server, controller manager and scheduler were stopped (each said so) and
    // started again; the hold is gone.
    assert_ne!(pid("alpha", "apiserver"), alpha_api);
    for c in ["apiserver", "controller-manager", "scheduler"] {
        let ev = events_for(&kc, "default", &format!("alpha-{c}"));
        assert!(ev.contains("HeldForRestore"), "alpha-{c}: {ev}");
    }
    let annotations = jsonpath(
        &kc,
        &["ncp", "-n", "default", "alpha"],
        "{.metadata.annotations}",
    );
    assert!(
        !annotations.contains("backup.nestplane.io/restore"),
        "{annotations}"
    );
    // A write after the restore works (its clients listed again).
    kubectl_apply(
        &alpha,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: after-restore, namespace: default}\n",
    );

    // beta, on the same datastore: its processes, keys and objects untouched.
    assert_eq!(pid("beta", "apiserver"), beta_api);
    assert_eq!(pid("beta", "controller-manager"), beta_cm);
    assert_eq!(pid("shared-datastore", "etcd"), datastore_etcd);
    assert_eq!(config_maps(&beta), beta_before);
    assert_eq!(
        jsonpath(
            &beta,
            &["configmap", "-n", "default", "cm-0"],
            "{.metadata.resourceVersion}"
        ),
        beta_rv
    );
    assert!(
        !kubectl(
            &beta,
            &["get", "configmap", "-n", "default", "after-restore"]
        )
        .status
        .success()
    );

    // A clone into beta, which has a CA of its own, is refused before anything is written.
    let beta_ca = env.secret("default", "beta-ca").await.unwrap().data;
    env.apply(&restore_yaml(
        "into-beta",
        "beta",
        &format!("  cloneOf: {{name: alpha}}\n  from: \"{url}\"\n"),
    ));
    eventually(
        "the clone into beta refused",
        Duration::from_secs(60),
        || {
            (restore_field(
                &kc,
                "into-beta",
                "{.status.phase} {.status.conditions[0].reason}",
            ) == "Failed NotANewControlPlane")
                .then_some(())
        },
    );
    assert_eq!(
        env.secret("default", "beta-ca").await.unwrap().data,
        beta_ca
    );
    assert_eq!(pid("beta", "apiserver"), beta_api);

    // A clone of alpha's archive as gamma, on an etcd of its own: the CLI makes the restore,
    // then gamma, held from its first pass, once the restore has written its trust.
    let out = nestplane()
        .args([
            "backup",
            "restore",
            "alpha",
            "--from",
            &url,
            "--as",
            "gamma",
            "--own-etcd",
            "--name",
            "clone",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("created NestedControlPlane default/gamma"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("restored default/gamma from "),
        "{stdout}"
    );
    eprintln!("{stderr}{stdout}");
    env.wait_ready("default", "gamma", Duration::from_secs(120))
        .await;
    let gamma = env.tenant_kubeconfig("default", "gamma").await;
    assert_eq!(config_maps(&gamma), backed_up);
    // Its API server never served before it held the archive's keys: it said it was held.
    let ev = events_for(&kc, "default", "gamma-apiserver");
    assert!(ev.contains("HeldForRestore"), "gamma-apiserver: {ev}");
    // Its own etcd, its own etcd CA; alpha's CA and service-account key.
    assert!(env.pid("default", "gamma", "etcd", 0).is_some());
    let secret = |name: &'static str| {
        let env = &env;
        async move { env.secret("default", name).await.unwrap().data.unwrap() }
    };
    assert_eq!(secret("gamma-ca").await, secret("alpha-ca").await);
    assert_eq!(secret("gamma-sa").await, secret("alpha-sa").await);
    assert_ne!(
        secret("gamma-etcd").await["tls.crt"],
        secret("alpha-etcd").await["tls.crt"]
    );
    // What alpha's users held before the backup works on gamma: alpha's admin client
    // certificate, and the token of alpha's service account.
    let mut with_alpha_user = kube::config::Kubeconfig::read_from(&alpha).unwrap();
    let gamma_cluster = kube::config::Kubeconfig::read_from(&gamma)
        .unwrap()
        .clusters[0]
        .cluster
        .clone();
    for c in &mut with_alpha_user.clusters {
        c.cluster = gamma_cluster.clone();
    }
    let alpha_user = dir.join("alpha-user-on-gamma.kubeconfig");
    std::fs::write(&alpha_user, serde_json::to_vec(&with_alpha_user).unwrap()).unwrap();
    assert_eq!(
        kubectl_ok(
            &alpha_user,
            &["get", "configmap", "-n", "default", "cm-0", "-o", "name"]
        )
        .trim(),
        "configmap/cm-0"
    );
    let answers = |token: &str| {
        let out = kubectl(
            &token_kubeconfig(&gamma, token, dir.join("token.kubeconfig")),
            &["get", "--raw", "/api"],
        );
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success() || err.contains("Unauthorized"),
            "neither answered nor unauthorized: {err}"
        );
        out.status.success()
    };
    assert!(answers(&alpha_token), "alpha's token on gamma");
    // A neighbour's is not: beta's service-account key is its own.
    assert!(
        !answers(&request_token(&beta, &dir)),
        "beta's token on gamma"
    );
    let events = events_for(&kc, "default", "clone");
    for e in ["Normal Stopping", "Normal Restored", "Normal Completed"] {
        assert!(events.contains(e), "no {e}: {events}");
    }
    assert!(
        !jsonpath(
            &kc,
            &["ncp", "-n", "default", "gamma"],
            "{.metadata.annotations}"
        )
        .contains("backup.nestplane.io/restore")
    );
    // A second clone into gamma, which exists now, is refused and changes nothing.
    let gamma_api = pid("gamma", "apiserver");
    env.apply(&restore_yaml(
        "again",
        "gamma",
        &format!("  cloneOf: {{name: alpha}}\n  from: \"{url}\"\n"),
    ));
    eventually("the second clone refused", Duration::from_secs(60), || {
        (restore_field(
            &kc,
            "again",
            "{.status.phase} {.status.conditions[0].reason}",
        ) == "Failed NotANewControlPlane")
            .then_some(())
    });
    assert_eq!(pid("gamma", "apiserver"), gamma_api);
    // alpha and beta run as they did.
    assert_eq!(pid("beta", "apiserver"), beta_api);
    assert_eq!(config_maps(&alpha), backed_up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_killed_during_a_restore_is_followed_by_one_that_finishes_it() {
    let env = Env::start(false).await;
    let kc = env.kubeconfig().to_path_buf();
    let operator = env.spawn_operator();
    env.create_ncp("default", "alpha").await;
    env.wait_ready("default", "alpha", Duration::from_secs(180))
        .await;
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    kubectl_apply(&alpha, &config_map_list(0..50, &|i| i.to_string()));
    let backed_up = config_maps(&alpha);
    let out = nestplane()
        .args([
            "backup",
            "create",
            "alpha",
            "--name",
            "alpha-1",
            "--kubeconfig",
        ])
        .arg(&kc)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    kubectl_ok(&alpha, &["delete", "configmaps", "-n", "default", "--all"]);
    kubectl_apply(
        &alpha,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: after-backup, namespace: default}\ndata: {\"n\": new}\n",
    );

    // The operator is killed (SIGKILL) once the restore has begun stopping alpha.
    env.apply(&restore_yaml(
        "back",
        "alpha",
        "  backupRef: {name: alpha-1}\n",
    ));
    let at = eventually("the restore under way", Duration::from_secs(60), || {
        let phase = restore_field(&kc, "back", "{.status.phase}");
        matches!(phase.as_str(), "Stopping" | "Restoring" | "Starting").then_some(phase)
    });
    operator.kill();
    eprintln!("operator killed while the restore was {at}");

    // Another operator finishes it: alpha holds the backup again, and nothing holds it.
    let _operator = env.spawn_operator();
    eventually("the restore completed", Duration::from_secs(180), || {
        (restore_field(&kc, "back", "{.status.phase}") == "Completed").then_some(())
    });
    env.wait_ready("default", "alpha", Duration::from_secs(60))
        .await;
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    assert_eq!(config_maps(&alpha), backed_up);
    let annotations = jsonpath(
        &kc,
        &["ncp", "-n", "default", "alpha"],
        "{.metadata.annotations}",
    );
    assert!(
        !annotations.contains("backup.nestplane.io/restore"),
        "{annotations}"
    );
}

/// An S3-compatible server over a directory (`s3s-fs`, installed by scripts/install-deps.sh)
/// on a free loopback port, with one access key; killed when dropped.
struct S3Server {
    _process: KillOnDrop,
    url: String,
    root: tempfile::TempDir,
}

const S3_ACCESS_KEY: &str = "team-a-access";
const S3_SECRET_KEY: &str = "team-a-secret-0123456789";

impl S3Server {
    fn start() -> S3Server {
        let cache = std::env::var_os("NESTPLANE_CACHE_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/nestplane")
            });
        let binary = cache.join("bin/s3s-fs");
        assert!(
            binary.exists(),
            "{} not found: run scripts/install-deps.sh (it builds s3s-fs from crates.io)",
            binary.display()
        );
        let root = tempfile::tempdir().unwrap();
        // A bucket is a directory.
        std::fs::create_dir(root.path().join("backups")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let process = KillOnDrop(
            std::process::Command::new(&binary)
                .args(["--host", "127.0.0.1", "--port", &port.to_string()])
                .args(["--access-key", S3_ACCESS_KEY, "--secret-key", S3_SECRET_KEY])
                .arg(root.path())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let url = format!("http://127.0.0.1:{port}");
        eventually("s3s-fs listening", Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        S3Server {
            _process: process,
            url,
            root,
        }
    }
}

fn s3_creds_yaml(name: &str, secret_key: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: default}}\nstringData:\n  AWS_ACCESS_KEY_ID: {S3_ACCESS_KEY}\n  AWS_SECRET_ACCESS_KEY: {secret_key}\n"
    )
}

/// `s3://` locations against a real S3-compatible server on loopback: the CLI backs up into
/// a bucket and restores from it, deleting a `Delete` backup deletes its object; a server the
/// operator does not allow, wrong credentials and missing ones are refused, and say why
/// without the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_location_takes_archives_that_restore_and_go_with_their_backup() {
    let s3 = S3Server::start();
    let mut env = Env::start(false).await;
    env.start_operator_with_s3(vec![s3.url.clone()]);
    let kc = env.kubeconfig().to_path_buf();
    env.create_ncp("default", "alpha").await;
    env.apply(&s3_creds_yaml("s3-creds", S3_SECRET_KEY));
    env.wait_ready("default", "alpha", Duration::from_secs(180))
        .await;
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    kubectl_apply(&alpha, &config_map_list(0..50, &|i| i.to_string()));
    let backed_up = config_maps(&alpha);

    // Into the bucket: the last line is the object's URL, and the object opens with the key.
    let out = nestplane()
        .args(["backup", "create", "alpha", "--name", "alpha-s3"])
        .args([
            "--to",
            "s3://backups/team-a/nightly",
            "--s3-endpoint",
            &s3.url,
        ])
        .args([
            "--s3-credentials",
            "s3-creds",
            "--deletion-policy",
            "Delete",
        ])
        .arg("--kubeconfig")
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let url = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert_eq!(url, "s3://backups/team-a/nightly/alpha-s3.npbackup");
    let object = s3
        .root
        .path()
        .join("backups/team-a/nightly/alpha-s3.npbackup");
    let key = key_of(&env, "default", "alpha-backup-key").await;
    let (header, keys) = open(&object, &key);
    assert_eq!(header.tenant, "default/alpha");
    assert!(keys.iter().any(|k| k.ends_with("configmaps/default/cm-49")));
    // The operator writes an object only where none is (`If-None-Match`): never over one.
    use nestplane_operator::backup::s3 as client;
    let bucket = client::Bucket::new(
        client::Endpoint::parse(&s3.url).unwrap(),
        client::Credentials {
            access_key: S3_ACCESS_KEY.into(),
            secret_key: S3_SECRET_KEY.into(),
            region: client::DEFAULT_REGION.into(),
        },
    )
    .unwrap();
    let before = std::fs::read(&object).unwrap();
    assert_eq!(
        bucket
            .put_new(
                "backups",
                "team-a/nightly/alpha-s3.npbackup",
                b"over".to_vec()
            )
            .await,
        Err(client::S3Error::Exists)
    );
    assert_eq!(std::fs::read(&object).unwrap(), before);
    // Nothing was written on the operator's machine.
    assert!(
        !env.operator_dir()
            .join("backups/default/alpha-s3.npbackup")
            .exists()
    );

    // A Retain backup beside it; and one whose name an object holds already (another
    // backup's archive): that object is left as it is.
    env.apply(&format!(
        "{}  location: s3://backups/team-a/nightly\n  s3: {{endpoint: \"{}\", credentialsSecretRef: {{name: s3-creds}}}}\n",
        backup_yaml("default", "copy", "alpha", ""),
        s3.url
    ));
    wait_phase(&kc, "default", "copy", "Completed", "Completed");
    std::fs::copy(
        &object,
        s3.root.path().join("backups/team-a/nightly/taken.npbackup"),
    )
    .unwrap();
    env.apply(&format!(
        "{}  location: s3://backups/team-a/nightly\n  s3: {{endpoint: \"{}\", credentialsSecretRef: {{name: s3-creds}}}}\n",
        backup_yaml("default", "taken", "alpha", ""),
        s3.url
    ));
    wait_phase(&kc, "default", "taken", "Failed", "ArchiveExists");

    // Hostile: a server the operator does not allow (here the management API server) is
    // never sent a request; wrong credentials and missing ones wait, and say why.
    let mgmt = kubectl_ok(
        &kc,
        &[
            "config",
            "view",
            "-o",
            "jsonpath={.clusters[0].cluster.server}",
        ],
    );
    env.apply(&format!(
        "{}  location: s3://backups/x\n  s3: {{endpoint: \"{}\", credentialsSecretRef: {{name: s3-creds}}}}\n",
        backup_yaml("default", "elsewhere", "alpha", ""),
        mgmt.replace("https://", "http://")
    ));
    wait_phase(&kc, "default", "elsewhere", "Failed", "LocationRefused");
    let why = field(
        &kc,
        "default",
        "elsewhere",
        "{.status.conditions[0].message}",
    );
    // (Which servers are allowed is the administrator's business: not said.)
    assert!(
        why.contains("refused") && why.contains("--backup-s3-endpoint") && !why.contains(&s3.url),
        "{why}"
    );
    env.apply(&s3_creds_yaml("wrong-creds", "not-the-secret-key-42"));
    for (name, creds) in [("wrong", "wrong-creds"), ("missing", "no-such-secret")] {
        env.apply(&format!(
            "{}  location: s3://backups/team-a\n  s3: {{endpoint: \"{}\", credentialsSecretRef: {{name: {creds}}}}}\n",
            backup_yaml("default", name, "alpha", ""),
            s3.url
        ));
        wait_phase(&kc, "default", name, "Pending", "InvalidCredentials");
        let said = format!(
            "{}{}",
            field(&kc, "default", name, "{.status}"),
            events_for(&kc, "default", name)
        );
        assert!(
            !said.contains("not-the-secret-key-42") && !said.contains(S3_SECRET_KEY),
            "{said}"
        );
    }
    assert!(
        !s3.root
            .path()
            .join("backups/team-a/wrong.npbackup")
            .exists()
    );

    // Changed since, then restored from the bucket: the CLI finds the server by the backup.
    kubectl_ok(
        &alpha,
        &["delete", "configmap", "-n", "default", "cm-0", "cm-1"],
    );
    kubectl_apply(&alpha, &config_map_list(2..3, &|_| "changed".into()));
    assert_ne!(config_maps(&alpha), backed_up);
    let out = nestplane()
        .args([
            "backup", "restore", "alpha", "--from", &url, "--name", "from-s3",
        ])
        .arg("--kubeconfig")
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(config_maps(&alpha), backed_up);
    assert_eq!(restore_field(&kc, "from-s3", "{.spec.s3.endpoint}"), s3.url);

    // deletionPolicy Delete: the object goes with the backup; a Retain one's stays.
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nestedbackup",
            "-n",
            "default",
            "alpha-s3",
            "copy",
            "--wait=true",
            "--timeout=60s",
        ],
    );
    assert!(!object.exists());
    assert!(
        s3.root
            .path()
            .join("backups/team-a/nightly/copy.npbackup")
            .exists()
    );
    assert!(
        s3.root
            .path()
            .join("backups/team-a/nightly/taken.npbackup")
            .exists()
    );
}

/// Point in time: a schedule with `deltas` follows the control plane after its backup and
/// writes what changes beside the archive; a restore reaches a time between two changes, and
/// a revision (an object's resourceVersion); deleting the backup deletes its segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_reaches_a_point_in_time_through_delta_segments() {
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    let root = env.operator_dir().join("backups/default");
    env.create_ncp("default", "alpha").await;
    env.wait_ready("default", "alpha", Duration::from_secs(180))
        .await;
    let alpha = env.tenant_kubeconfig("default", "alpha").await;
    kubectl_apply(&alpha, &config_map_list(0..20, &|i| i.to_string()));

    // The CLI makes the schedule; its first backup is the chain's base.
    let out = nestplane()
        .args([
            "backup", "schedule", "alpha", "--every", "1h", "--keep", "2",
        ])
        .args(["--deltas-every", "10s", "--deletion-policy", "Delete"])
        .arg("--kubeconfig")
        .arg(&kc)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_schedule(&kc, "default", "alpha", "True BackedUp");
    let base = jsonpath(
        &kc,
        &["nestedbackupschedule", "-n", "default", "alpha"],
        "{.status.lastCompleted}",
    );

    // Changes after the backup: cm-0 changed, then (after `between`) cm-1 deleted and a new one.
    kubectl_apply(&alpha, &config_map_list(0..1, &|_| "first".into()));
    std::thread::sleep(Duration::from_secs(2));
    let between = k8s_openapi::jiff::Timestamp::now();
    std::thread::sleep(Duration::from_secs(2));
    kubectl_ok(&alpha, &["delete", "configmap", "-n", "default", "cm-1"]);
    kubectl_apply(&alpha, &config_map_list(0..1, &|_| "second".into()));
    let second_rv = kubectl_ok(
        &alpha,
        &[
            "get",
            "configmap",
            "-n",
            "default",
            "cm-0",
            "-o",
            "jsonpath={.metadata.resourceVersion}",
        ],
    );
    kubectl_apply(&alpha, &config_map_list(20..21, &|_| "late".into()));
    let latest = config_maps(&alpha);
    let after = k8s_openapi::jiff::Timestamp::now();

    // The segments reach past the last change (the backup's status says so), 0600, beside
    // the archive.
    let waited = std::time::Instant::now();
    eventually(
        "the delta segments reach past the last change",
        Duration::from_secs(60),
        || {
            if waited.elapsed() > Duration::from_secs(55) {
                eprintln!(
                    "{}\n{}\n{:?}",
                    field(&kc, "default", &base, "{.status}"),
                    jsonpath(
                        &kc,
                        &["nestedbackupschedule", "-n", "default", "alpha"],
                        "{.status}"
                    ),
                    std::fs::read_dir(&root).map(|d| d
                        .filter_map(|e| e.ok())
                        .map(|e| e.file_name())
                        .collect::<Vec<_>>())
                );
            }
            let until = field(&kc, "default", &base, "{.status.pointInTime.until}");
            until
                .parse::<k8s_openapi::jiff::Timestamp>()
                .ok()
                .filter(|u| *u > after)
        },
    );
    // Both tables tell it: the schedule's period of segments, the backup's chain.
    let table = kubectl_ok(&kc, &["get", "nbks", "-n", "default", "alpha"]);
    assert!(table.contains("DELTAS") && table.contains("10s"), "{table}");
    let rows = backup_list_json(&kc);
    let deltas = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == base.as_str())
        .map(|r| r["deltas"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default();
    assert!(deltas.contains(" to rev "), "{deltas}");
    let first = root.join(format!("{base}.d000001.npdelta"));
    let mode = std::fs::metadata(&first).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let segments: i64 = field(&kc, "default", &base, "{.status.pointInTime.segments}")
        .parse()
        .unwrap();
    assert!(segments >= 1);

    // Everything is changed again, then restored to the time between the two changes.
    kubectl_apply(&alpha, &config_map_list(0..21, &|_| "wrecked".into()));
    let out = nestplane()
        // No --from: the newest backup completed by then.
        .args(["backup", "restore", "alpha", "--name", "to-time"])
        .args(["--to-time", &between.to_string()])
        .arg("--kubeconfig")
        .arg(&kc)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("restoring from {base}")),
        "{stderr}"
    );
    let mut want: std::collections::BTreeMap<String, String> = (0..20)
        .map(|i| (format!("cm-{i}"), i.to_string()))
        .collect();
    want.insert("cm-0".into(), "first".into());
    assert_eq!(config_maps(&alpha), want);

    // To the revision of cm-0's second change: cm-1 deleted, cm-20 not yet made.
    env.apply(&restore_yaml(
        "to-revision",
        "alpha",
        &format!("  backupRef: {{name: {base}}}\n  toRevision: {second_rv}\n"),
    ));
    eventually(
        "the restore to a revision completes",
        Duration::from_secs(120),
        || (restore_field(&kc, "to-revision", "{.status.phase}") == "Completed").then_some(()),
    );
    assert_eq!(
        restore_field(&kc, "to-revision", "{.status.revision}"),
        second_rv
    );
    want.remove("cm-1");
    want.insert("cm-0".into(), "second".into());
    assert_eq!(config_maps(&alpha), want);
    let mut at_latest = latest.clone();
    at_latest.retain(|k, _| k != "cm-20");
    assert_eq!(config_maps(&alpha), at_latest);

    // A point before the backup is refused; one the segments do not reach yet waits.
    env.apply(&restore_yaml(
        "too-early",
        "alpha",
        &format!("  backupRef: {{name: {base}}}\n  toRevision: 1\n"),
    ));
    eventually(
        "a point before the backup is refused",
        Duration::from_secs(60),
        || {
            (restore_field(&kc, "too-early", "{.status.conditions[0].reason}")
                == "PointBeforeBackup")
                .then_some(())
        },
    );
    env.apply(&restore_yaml(
        "too-late",
        "alpha",
        &format!("  backupRef: {{name: {base}}}\n  toRevision: 999999999\n"),
    ));
    eventually("a point not reached waits", Duration::from_secs(60), || {
        (restore_field(&kc, "too-late", "{.status.conditions[0].reason}") == "PointNotReached")
            .then_some(())
    });
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nestedrestore",
            "-n",
            "default",
            "too-late",
            "too-early",
        ],
    );

    // A chain with a segment missing is refused, not restored in part.
    std::fs::remove_file(&first).unwrap();
    env.apply(&restore_yaml(
        "gap",
        "alpha",
        &format!("  backupRef: {{name: {base}}}\n  toRevision: {second_rv}\n"),
    ));
    eventually(
        "a chain with a gap is refused",
        Duration::from_secs(60),
        || {
            (restore_field(&kc, "gap", "{.status.phase} {.status.conditions[0].reason}")
                == "Failed InvalidArchive")
                .then_some(())
        },
    );
    assert!(restore_field(&kc, "gap", "{.status.conditions[0].message}").contains("missing"));

    // Deleting the backup (deletionPolicy Delete) deletes its archive and its segments.
    kubectl_ok(
        &kc,
        &["delete", "nestedbackupschedule", "-n", "default", "alpha"],
    );
    kubectl_ok(
        &kc,
        &[
            "delete",
            "nestedbackup",
            "-n",
            "default",
            &base,
            "--wait=true",
            "--timeout=60s",
        ],
    );
    assert!(!root.join(format!("{base}.npbackup")).exists());
    let left: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&base))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// `nestplane backup list -n default -o json` against the management plane of `kc`.
fn backup_list_json(kc: &std::path::Path) -> serde_json::Value {
    let out = nestplane()
        .args([
            "backup",
            "list",
            "-n",
            "default",
            "-o",
            "json",
            "--kubeconfig",
        ])
        .arg(kc)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
