//! Cluster DNS in a hosted cluster with a real node: the built-in server (a locally built
//! image, 2 replicas) answers the *Kubernetes DNS-Based Service Discovery* names to a pod,
//! forwards other names to a resolver on this machine, counts what it answers, comes back
//! when deleted; the CoreDNS manifests pass a server-side dry run. Nothing here writes what a
//! kubelet or controller would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

const WORKLOADS: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  selector: {app: web}\n  ports: [{name: http, port: 80, targetPort: 8080}]\n---\napiVersion: v1\nkind: Service\nmetadata: {name: db, namespace: default}\nspec:\n  clusterIP: None\n  selector: {app: db}\n  ports: [{name: pg, port: 5432, targetPort: 8080}]\n---\napiVersion: apps/v1\nkind: StatefulSet\nmetadata: {name: db, namespace: default}\nspec:\n  serviceName: db\n  replicas: 2\n  podManagementPolicy: Parallel\n  selector: {matchLabels: {app: db}}\n  template:\n    metadata: {labels: {app: db}}\n    spec:\n      containers:\n      - {name: db, image: 'docker.io/library/busybox:1.35', command: [sh, -c, 'mkdir -p /w && exec httpd -f -p 8080 -h /w']}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: search, namespace: default}\nspec: {type: ExternalName, externalName: outside.test}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: client, namespace: default}\nspec:\n  containers:\n  - {name: client, image: 'docker.io/library/busybox:1.35', command: [sleep, '3600']}\n";

/// `nslookup ARGS` in the client pod: what it printed (stdout and stderr).
fn nslookup(kc: &Path, args: &[&str]) -> String {
    let mut all = vec!["exec", "client", "--", "nslookup"];
    all.extend_from_slice(args);
    let out = kubectl(kc, &all);
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `nslookup ARGS` until its output contains `want`.
fn resolves(kc: &Path, args: &[&str], want: &str, timeout: Duration) -> String {
    let what = format!("nslookup {} showing {want}", args.join(" "));
    let started = std::time::Instant::now();
    let deadline = started + timeout;
    loop {
        let out = nslookup(kc, args);
        if out.contains(want) {
            return out;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}; last answer:\n{out}"
        );
        std::thread::sleep(common::poll_pause(started).max(Duration::from_millis(300)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_dns_answers_a_pod_on_a_real_node_by_the_specification() {
    nestplane_nodes::check_prerequisites("v1.20.2").expect("node prerequisites");
    let _ = images();
    let env = Env::start(true).await;
    let kc = env.kubeconfig().to_path_buf();
    // No provider named: nodes are made on this machine from images built here, so the
    // built-in server.
    env.apply("apiVersion: nestplane.io/v1alpha1\nkind: HostedCluster\nmetadata: {name: names, namespace: default}\nspec:\n  release: {version: 1.20.2}\n  initialNodes: 1\n");
    eventually(
        "the cluster DNS available",
        Duration::from_secs(360),
        || {
            (condition(&kc, &["hostedcluster", "names"], "ClusterDNSAvailable") == "True")
                .then_some(())
        },
    );
    assert_eq!(
        jsonpath(
            &kc,
            &["hostedcluster", "names"],
            "{.status.dns.provider} {.status.dns.serviceIP}"
        ),
        "Builtin 10.96.0.10"
    );
    let hosted = hosted_kubeconfig(&kc, "names", env.state.path());
    eventually("2 DNS replicas ready", Duration::from_secs(120), || {
        (jsonpath(
            &hosted,
            &["deployment", "nestplane-dns", "-n", "kube-system"],
            "{.status.readyReplicas}",
        ) == "2")
            .then_some(())
    });

    kubectl_apply(&hosted, WORKLOADS);
    eventually(
        "the client and db pods run",
        Duration::from_secs(120),
        || {
            let running = jsonpath(
                &hosted,
                &["pods", "--field-selector=status.phase=Running"],
                "{.items[*].metadata.name}",
            );
            ["client", "db-0", "db-1"]
                .iter()
                .all(|p| running.split_whitespace().any(|r| r == *p))
                .then_some(())
        },
    );
    let ip_of = |what: &[&str], path: &str| jsonpath(&hosted, what, path).trim().to_string();
    let web_ip = ip_of(&["service", "web"], "{.spec.clusterIP}");
    let db0 = ip_of(&["pod", "db-0"], "{.status.podIP}");
    let db1 = ip_of(&["pod", "db-1"], "{.status.podIP}");
    let client_ip = ip_of(&["pod", "client"], "{.status.podIP}");

    // The pod asks the cluster DNS, with the cluster's search path (so `kubernetes.default`
    // is `kubernetes.default.svc.cluster.local`; busybox's nslookup ignores search paths, so
    // the names below are written out).
    let resolv = kubectl_exec_ok(&hosted, &["client", "--", "cat", "/etc/resolv.conf"]);
    assert!(resolv.contains("nameserver 10.96.0.10"), "{resolv}");
    assert!(
        resolv.contains("search default.svc.cluster.local svc.cluster.local cluster.local"),
        "{resolv}"
    );
    let t = Duration::from_secs(30);
    resolves(
        &hosted,
        &["kubernetes.default.svc.cluster.local"],
        "Address: 10.96.0.1",
        t,
    );
    // A ClusterIP Service, and its named port.
    resolves(
        &hosted,
        &["web.default.svc.cluster.local"],
        &format!("Address: {web_ip}"),
        t,
    );
    resolves(
        &hosted,
        &["-type=SRV", "_http._tcp.web.default.svc.cluster.local"],
        "80 web.default.svc.cluster.local",
        t,
    );
    // A headless Service: every ready endpoint, each by its hostname, SRV per endpoint.
    let both = resolves(
        &hosted,
        &["db.default.svc.cluster.local"],
        &format!("Address: {db0}"),
        t,
    );
    assert!(both.contains(&format!("Address: {db1}")), "{both}");
    let one = resolves(
        &hosted,
        &["db-0.db.default.svc.cluster.local"],
        &format!("Address: {db0}"),
        t,
    );
    assert!(!one.contains(&format!("Address: {db1}")), "{one}");
    let srv = resolves(
        &hosted,
        &["-type=SRV", "_pg._tcp.db.default.svc.cluster.local"],
        "8080 db-0.db.default.svc.cluster.local",
        t,
    );
    assert!(
        srv.contains("8080 db-1.db.default.svc.cluster.local"),
        "{srv}"
    );
    // An ExternalName is an alias.
    resolves(
        &hosted,
        &["-type=CNAME", "search.default.svc.cluster.local"],
        "canonical name = outside.test",
        t,
    );
    // A pod record, reverse names of a Service and of a headless endpoint, the version.
    resolves(
        &hosted,
        &[&format!(
            "{}.default.pod.cluster.local",
            client_ip.replace('.', "-")
        )],
        &format!("Address: {client_ip}"),
        t,
    );
    resolves(
        &hosted,
        &[&web_ip],
        "name = web.default.svc.cluster.local",
        t,
    );
    resolves(
        &hosted,
        &[&db0],
        "name = db-0.db.default.svc.cluster.local",
        t,
    );
    resolves(
        &hosted,
        &["-type=TXT", "dns-version.cluster.local"],
        "1.1.0",
        t,
    );
    // A name in the zone that does not exist.
    resolves(&hosted, &["nope.default.svc.cluster.local"], "NXDOMAIN", t);

    // A Service created now resolves within a few seconds.
    kubectl_ok(
        &hosted,
        &["create", "service", "clusterip", "late", "--tcp=80:8080"],
    );
    let late_ip = ip_of(&["service", "late"], "{.spec.clusterIP}");
    resolves(
        &hosted,
        &["late.default.svc.cluster.local"],
        &format!("Address: {late_ip}"),
        Duration::from_secs(10),
    );

    // Names outside the zone go to the node's resolver: the host's end of the node's link,
    // where this test now runs one (dnsmasq, answering for `outside.test` only).
    let node_ip = jsonpath(
        &hosted,
        &["nodes"],
        "{.items[0].status.addresses[?(@.type==\"InternalIP\")].address}",
    );
    let node_ip: std::net::Ipv4Addr = node_ip.trim().parse().expect("the node's address");
    let [a, b, c, _] = node_ip.octets();
    let host_end = format!("{a}.{b}.{c}.1");
    let refused = nslookup(&hosted, &["outside.test"]);
    assert!(!refused.contains("127.0.0.53"), "{refused}");
    let _resolver = KillOnDrop(
        std::process::Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--conf-file=/dev/null",
                "--bind-interfaces",
                "--port=53",
                "--address=/outside.test/127.0.0.53",
            ])
            .arg(format!("--listen-address={host_end}"))
            .arg(format!(
                "--pid-file={}",
                env.state.path().join("dnsmasq.pid").display()
            ))
            .spawn()
            .expect("dnsmasq not found: run scripts/install-deps.sh"),
    );
    resolves(&hosted, &["outside.test"], "Address: 127.0.0.53", t);
    // …and an ExternalName's address comes with its alias.
    resolves(
        &hosted,
        &["search.default.svc.cluster.local"],
        "Address: 127.0.0.53",
        t,
    );

    // The server counts what it answered.
    let dns_pod = jsonpath(
        &hosted,
        &["pods", "-n", "kube-system", "-l", "k8s-app=kube-dns"],
        "{.items[0].status.podIP}",
    );
    let metrics = kubectl_exec_ok(
        &hosted,
        &[
            "client",
            "--",
            "wget",
            "-q",
            "-O",
            "-",
            &format!("http://{}:8081/metrics", dns_pod.trim()),
        ],
    );
    for series in [
        "nestplane_dns_queries_total{type=\"a\",rcode=\"NOERROR\"}",
        "nestplane_dns_request_duration_seconds_count",
    ] {
        assert!(metrics.contains(series), "{series} in\n{metrics}");
    }

    // A user who deletes the kube-dns Service gets it back, at the same address.
    kubectl_ok(
        &hosted,
        &["delete", "service", "kube-dns", "-n", "kube-system"],
    );
    eventually("kube-dns back", Duration::from_secs(120), || {
        (jsonpath(
            &hosted,
            &["service", "kube-dns", "-n", "kube-system"],
            "{.spec.clusterIP}",
        ) == "10.96.0.10")
            .then_some(())
    });
    resolves(
        &hosted,
        &["web.default.svc.cluster.local"],
        &format!("Address: {web_ip}"),
        Duration::from_secs(30),
    );

    // CoreDNS, for clusters that can pull it: its manifests pass a server-side dry run.
    let coredns = nestplane_operator::hosted::dns::manifests(
        nestplane_api::hosted::DnsProvider::CoreDns,
        "10.96.0.10".parse().unwrap(),
        20,
        &Default::default(),
    );
    let yaml: Vec<String> = coredns
        .iter()
        .map(|o| serde_saphyr::to_string(o).unwrap())
        .collect();
    let out = kubectl_stdin(
        &hosted,
        &["apply", "--dry-run=server", "-f", "-"],
        Some(&yaml.join("---\n")),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied = String::from_utf8_lossy(&out.stdout);
    assert!(
        applied.contains("deployment.apps/coredns created (server dry run)"),
        "{applied}"
    );

    kubectl_ok(&kc, &["delete", "hostedcluster", "names", "--timeout=240s"]);
    assert!(!env.operator.as_ref().unwrap().is_finished());
}
