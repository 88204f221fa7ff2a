//! Many tenants from the command line: `nestplane create`, `list`, `delete` and `kubeconfig`,
//! thin clients of the management plane's API. They make, read and delete the same objects a
//! user could apply (`HostedCluster`, and the `NestedControlPlane`s made without one), so
//! what they do is visible, and undoable, with `kubectl`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Resource, ResourceExt};
use nestplane_api::NestedControlPlane;
use nestplane_api::conditions;
use nestplane_api::hosted::{HostedCluster, NodePool};
use serde::Serialize;

/// Which management plane: `--kubeconfig`; else the `nestplane up` of `--state-dir` (or
/// `$NESTPLANE_STATE_DIR`), which must have one; else `$KUBECONFIG`; else the `nestplane up`
/// of the default state directory, if it answers; else `~/.kube/config`.
#[derive(Args, Debug, Clone)]
pub struct Target {
    /// The management plane's kubeconfig.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The state directory of the `nestplane up` to talk to (its management plane is found
    /// there when neither `--kubeconfig` nor `$KUBECONFIG` says otherwise).
    #[arg(long, env = "NESTPLANE_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
}

impl Target {
    /// Where to look, in order. `Err` when an explicit state directory holds no management
    /// plane. Pure but for what exists.
    fn candidates(&self, env_kubeconfig: bool) -> anyhow::Result<Vec<Source>> {
        if let Some(k) = &self.kubeconfig {
            return Ok(vec![Source::File(k.clone())]);
        }
        let ups = |state: &std::path::Path| -> Vec<PathBuf> {
            [state.to_path_buf(), state.join("kubernetes")]
                .into_iter()
                .map(|d| d.join("management.kubeconfig"))
                .filter(|p| p.is_file())
                .collect()
        };
        if let Some(state) = &self.state_dir {
            let found = ups(state);
            if found.is_empty() {
                bail!(
                    "no `nestplane up` in {} (no management.kubeconfig there)",
                    state.display()
                );
            }
            return Ok(found.into_iter().map(Source::File).collect());
        }
        if env_kubeconfig {
            return Ok(vec![Source::Default]);
        }
        let mut found: Vec<Source> = ups(&crate::default_state_dir())
            .into_iter()
            .map(Source::File)
            .collect();
        found.push(Source::Default);
        Ok(found)
    }

    /// A client of the management plane: the first candidate that answers. Refuses a
    /// cluster without nestplane's CRDs.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        let mut last = None;
        for source in self.candidates(std::env::var_os("KUBECONFIG").is_some())? {
            let (client, what) = match &source {
                Source::Default => (
                    kube::Client::try_default().await,
                    "the current kubeconfig".to_string(),
                ),
                Source::File(path) => (client_of(path).await, path.display().to_string()),
            };
            let answered = match client {
                Ok(c) => c.apiserver_version().await.map(|_| c),
                Err(e) => Err(e),
            };
            match answered {
                Ok(c) => return with_crds(c, &what).await,
                Err(e) => last = Some(anyhow::Error::new(e).context(format!(
                    "the management plane of {what} does not answer (is `nestplane up` running?)"
                ))),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no management plane to talk to")))
    }
}

/// Where a client comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Source {
    /// This kubeconfig file.
    File(PathBuf),
    /// kube's defaults (`$KUBECONFIG`, `~/.kube/config`, in-cluster).
    Default,
}

async fn client_of(path: &std::path::Path) -> Result<kube::Client, kube::Error> {
    let kc = kube::config::Kubeconfig::read_from(path).map_err(kube::Error::InferKubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(kube::Error::InferKubeconfig)?;
    kube::Client::try_from(config)
}

/// `client`, if its cluster has nestplane's CRDs.
async fn with_crds(client: kube::Client, what: &str) -> anyhow::Result<kube::Client> {
    let hcs: Api<HostedCluster> = Api::all(client.clone());
    match hcs.list(&ListParams::default().limit(1)).await {
        Err(kube::Error::Api(e)) if e.code == 404 => bail!(
            "the cluster of {what} has no HostedCluster resource: nestplane's CRDs are not installed (`nestplane crds | kubectl apply -f -`)"
        ),
        Err(e) => Err(e).context(format!("listing HostedClusters in the cluster of {what}")),
        Ok(_) => Ok(client),
    }
}

/// Arguments of `nestplane create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// The cluster's name.
    pub name: String,
    /// Its namespace in the management plane.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Worker nodes (a NodePool of this many real nodes, made by the operator on its
    /// machine from images built there: `nestplane up --nodes` builds them); 0: the control
    /// plane alone, as `nestplane up` without `--nodes`.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=20))]
    pub nodes: u32,
    /// Its Kubernetes version (default: the newest this machine has binaries for).
    #[arg(long)]
    pub version: Option<String>,
    /// Return once the object is made, without waiting for the cluster.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    #[command(flatten)]
    pub target: Target,
}

/// A cluster named on the command line: the object the user named, and where its control
/// plane is.
pub struct Located {
    /// `HostedCluster` or `NestedControlPlane`.
    pub kind: &'static str,
    /// The control plane's namespace and name (a HostedCluster's is in `<ns>-<name>`).
    pub ncp: (String, String),
}

/// Find cluster `ns/name`: a HostedCluster of that name, else a NestedControlPlane.
pub async fn locate(client: &kube::Client, ns: &str, name: &str) -> anyhow::Result<Located> {
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), ns);
    if hcs.get_opt(name).await?.is_some() {
        return Ok(Located {
            kind: "HostedCluster",
            ncp: (format!("{ns}-{name}"), name.to_string()),
        });
    }
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), ns);
    if ncps.get_opt(name).await?.is_none() {
        bail!("no HostedCluster or NestedControlPlane {ns}/{name} (`nestplane list`)");
    }
    Ok(Located {
        kind: "NestedControlPlane",
        ncp: (ns.to_string(), name.to_string()),
    })
}

/// Output formats of `nestplane list`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A table, as `kubectl get` prints.
    Table,
    /// JSON: a list of objects with the table's columns.
    Json,
    /// YAML: the same.
    Yaml,
}

/// Arguments of `nestplane list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only this namespace (all namespaces when unset).
    #[arg(short, long)]
    pub namespace: Option<String>,
    /// How to print.
    #[arg(short, long, value_enum, default_value_t = Format::Table)]
    pub output: Format,
    #[command(flatten)]
    pub target: Target,
}

/// Arguments of `nestplane delete`.
#[derive(Args, Debug)]
pub struct DeleteArgs {
    /// The cluster's name.
    pub name: String,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Return once deletion has started.
    #[arg(long)]
    pub no_wait: bool,
    /// Stop waiting after this many seconds (deletion goes on; nodes are drained first, up
    /// to their pool's drain timeout).
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    #[command(flatten)]
    pub target: Target,
}

/// Arguments of `nestplane kubeconfig`.
#[derive(Args, Debug)]
pub struct KubeconfigArgs {
    /// The cluster's name (a HostedCluster's, or a NestedControlPlane's).
    pub name: String,
    /// Its namespace.
    #[arg(short, long, default_value = "default")]
    pub namespace: String,
    /// Reach the cluster through the operator's shared gateway (its `status.gateway`): the
    /// gateway's address as `server`, the cluster's name there as `tls-server-name`.
    #[arg(long)]
    pub gateway: bool,
    #[command(flatten)]
    pub target: Target,
}

/// One line of `nestplane list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `HostedCluster` or `NestedControlPlane`.
    pub kind: String,
    /// Kubernetes version asked for.
    pub version: String,
    /// Whether it is ready (HostedCluster: `Available`; NestedControlPlane: `status.ready`).
    pub ready: bool,
    /// Whether it is being deleted.
    pub deleting: bool,
    /// Ready nodes.
    pub nodes_ready: i32,
    /// Nodes asked for.
    pub nodes: i32,
    /// Seconds since it was made.
    pub age_seconds: i64,
    /// Where its API server is (`host:port`), once known.
    pub endpoint: String,
}

/// `5s`, `3m`, `2h`, `4d`, as `kubectl get` prints ages. Pure.
pub fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// The table of `rows`, columns aligned. Pure.
pub fn table(rows: &[Row], all_namespaces: bool) -> String {
    let mut lines: Vec<Vec<String>> = vec![];
    let mut head = vec![];
    if all_namespaces {
        head.push("NAMESPACE".to_string());
    }
    head.extend(
        [
            "NAME", "KIND", "VERSION", "READY", "NODES", "AGE", "ENDPOINT",
        ]
        .map(String::from),
    );
    lines.push(head);
    for r in rows {
        let mut l = vec![];
        if all_namespaces {
            l.push(r.namespace.clone());
        }
        l.extend([
            r.name.clone(),
            r.kind.clone(),
            r.version.clone(),
            if r.deleting {
                "Deleting"
            } else if r.ready {
                "True"
            } else {
                "False"
            }
            .to_string(),
            format!("{}/{}", r.nodes_ready, r.nodes),
            age(r.age_seconds),
            if r.endpoint.is_empty() {
                "<pending>".into()
            } else {
                r.endpoint.clone()
            },
        ]);
        lines.push(l);
    }
    aligned(lines)
}

/// `lines` (the first is the head) as columns aligned, as `kubectl get` prints. Pure.
pub fn aligned(lines: Vec<Vec<String>>) -> String {
    let widths: Vec<usize> = (0..lines.first().map_or(0, Vec::len))
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

pub fn age_of(meta: &kube::api::ObjectMeta) -> i64 {
    meta.creation_timestamp
        .as_ref()
        .map(|t| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or_default();
            now - t.0.as_second()
        })
        .unwrap_or_default()
}

/// The rows of the management plane's tenants: HostedClusters, and the NestedControlPlanes
/// no HostedCluster made.
pub async fn rows(client: &kube::Client, namespace: Option<&str>) -> anyhow::Result<Vec<Row>> {
    fn api<K>(client: &kube::Client, ns: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let lp = ListParams::default();
    let hcs = api::<HostedCluster>(client, namespace)
        .list(&lp)
        .await
        .context("listing HostedClusters")?;
    let pools = api::<NodePool>(client, namespace).list(&lp).await?;
    let ncps = api::<NestedControlPlane>(client, namespace)
        .list(&lp)
        .await
        .context("listing NestedControlPlanes")?;
    let mut rows = vec![];
    for hc in &hcs.items {
        let ns = hc.namespace().unwrap_or_default();
        let st = hc.status.clone().unwrap_or_default();
        let (mut ready_nodes, mut nodes) = (0, 0);
        for p in pools.items.iter().filter(|p| {
            p.namespace().as_deref() == Some(&ns) && p.spec.cluster_name == hc.name_any()
        }) {
            nodes += p.spec.replicas.unwrap_or(0);
            ready_nodes += p
                .status
                .as_ref()
                .map(|s| s.nodes.iter().filter(|n| n.ready).count() as i32)
                .unwrap_or(0);
        }
        rows.push(Row {
            namespace: ns,
            name: hc.name_any(),
            kind: "HostedCluster".into(),
            version: hc.spec.release.version.clone(),
            ready: conditions::is_true(&st.conditions, "Available"),
            deleting: hc.metadata.deletion_timestamp.is_some(),
            nodes_ready: ready_nodes,
            nodes,
            age_seconds: age_of(&hc.metadata),
            endpoint: st
                .control_plane_endpoint
                .map(|e| format!("{}:{}", e.host, e.port))
                .unwrap_or_default(),
        });
    }
    for ncp in &ncps.items {
        if ncp
            .annotations()
            .contains_key(nestplane_operator::hosted::claim::HOSTED_CLUSTER_ANNOTATION)
        {
            continue;
        }
        rows.push(Row {
            namespace: ncp.namespace().unwrap_or_default(),
            name: ncp.name_any(),
            kind: "NestedControlPlane".into(),
            // What runs, else what is asked, else what an unset version means.
            version: ncp
                .status
                .as_ref()
                .and_then(|s| s.version.clone())
                .or_else(|| ncp.spec.version.clone())
                .unwrap_or_else(|| nestplane_api::names::DEFAULT_KUBERNETES_VERSION.into()),
            ready: ncp.status.as_ref().is_some_and(|s| s.ready),
            deleting: ncp.metadata.deletion_timestamp.is_some(),
            nodes_ready: 0,
            nodes: 0,
            age_seconds: age_of(&ncp.metadata),
            endpoint: ncp
                .spec
                .control_plane_endpoint
                .as_ref()
                .filter(|e| !e.host.is_empty())
                .map(|e| format!("{}:{}", e.host, e.port))
                .unwrap_or_default(),
        });
    }
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(rows)
}

/// `nestplane list`.
pub async fn list(args: ListArgs) -> anyhow::Result<()> {
    let client = args.target.client().await?;
    let rows = rows(&client, args.namespace.as_deref()).await?;
    match args.output {
        Format::Table if rows.is_empty() => eprintln!("No clusters found."),
        Format::Table => print!("{}", table(&rows, args.namespace.is_none())),
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Format::Yaml => print!("{}", serde_saphyr::to_string(&rows)?),
    }
    Ok(())
}

/// `nestplane create`: a HostedCluster (its initial NodePool has `--nodes` nodes), waited for
/// unless `--no-wait`; prints where its kubeconfig comes from.
pub async fn create(args: CreateArgs) -> anyhow::Result<()> {
    let client = args.target.client().await?;
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), &args.namespace);
    let replicas = i32::try_from(args.nodes).context("--nodes is too large")?;
    if hcs.get_opt(&args.name).await?.is_some() {
        bail!(
            "HostedCluster {}/{} exists already (`nestplane list`)",
            args.namespace,
            args.name
        );
    }
    let mut hc = HostedCluster::new(
        &args.name,
        nestplane_api::hosted::HostedClusterSpec {
            release: nestplane_api::hosted::Release {
                version: args
                    .version
                    .clone()
                    .unwrap_or_else(|| nestplane_localplane::DEFAULT_VERSION.into()),
            },
            initial_nodes: Some(replicas),
            ..Default::default()
        },
    );
    hc.metadata.namespace = Some(args.namespace.clone());
    hcs.create(&PostParams::default(), &hc)
        .await
        .with_context(|| format!("creating HostedCluster {}/{}", args.namespace, args.name))?;
    eprintln!(
        "nestplane: created HostedCluster {}/{} with {} node(s)",
        args.namespace, args.name, args.nodes
    );
    if args.no_wait {
        return Ok(());
    }
    let started = Instant::now();
    wait_hosted(
        &client,
        &args.namespace,
        &args.name,
        args.nodes,
        started + Duration::from_secs(args.timeout),
    )
    .await?;
    eprintln!(
        "nestplane: {} ready in {:.1}s",
        args.name,
        started.elapsed().as_secs_f64()
    );
    println!(
        "nestplane kubeconfig {} -n {} > {}.kubeconfig",
        args.name, args.namespace, args.name
    );
    Ok(())
}

/// Wait until HostedCluster `ns/name` is Available (for its current generation), its admin
/// kubeconfig is published and, with `nodes`, its NodePool has that many Ready nodes; print
/// each new state on the way. `bail!` with the last state at `deadline`.
pub async fn wait_hosted(
    client: &kube::Client,
    ns: &str,
    name: &str,
    nodes: u32,
    deadline: Instant,
) -> anyhow::Result<Vec<(String, Instant)>> {
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), ns);
    let pools: Api<NodePool> = Api::namespaced(client.clone(), ns);
    let mut last = String::new();
    let mut changes = Vec::new();
    loop {
        let hc = hcs.get(name).await?;
        let pool = pools.get_opt(name).await?;
        let st = hc.status.unwrap_or_default();
        // Status written for what is asked now (a status from before a restart or a
        // change of replicas does not count).
        let available = conditions::is_true(&st.conditions, "Available")
            && st.observed_generation == hc.metadata.generation;
        let pool_ready = nodes == 0
            || pool.as_ref().is_some_and(|p| {
                p.status.as_ref().is_some_and(|s| {
                    conditions::is_true(&s.conditions, "Ready")
                        && s.replicas == nodes as i32
                        && s.observed_generation == p.metadata.generation
                        && s.nodes.len() == nodes as usize
                        && s.nodes.iter().all(|n| n.ready)
                })
            });
        if available && pool_ready && st.kubeconfig.is_some() {
            changes.push(("ready".to_string(), Instant::now()));
            return Ok(changes);
        }
        // What waiting cannot mend: the operator refused the spec.
        if let Some(c) =
            conditions::get(&st.conditions, "ValidConfiguration").filter(|c| c.status == "False")
        {
            bail!("{ns}/{name} is refused: {}: {}", c.reason, c.message);
        }
        let line = if !available {
            conditions::get(&st.conditions, "Available")
                .map(|c| format!("control plane: {}: {}", c.reason, c.message))
                .unwrap_or_else(|| "waiting for the operator".into())
        } else {
            pool.and_then(|p| p.status)
                .and_then(|s| conditions::get(&s.conditions, "Ready").cloned())
                .map(|c| format!("nodes: {}: {}", c.reason, c.message))
                .unwrap_or_else(|| "nodes: starting".into())
        };
        if line != last {
            eprintln!("nestplane:   {line}");
            changes.push((line.clone(), Instant::now()));
            last = line;
        }
        if Instant::now() > deadline {
            bail!("{ns}/{name} is not ready in time; last state: {last}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `nestplane delete`: the HostedCluster of that name, or else the NestedControlPlane (and
/// the component objects it names); waited for until gone unless `--no-wait`.
pub async fn delete(args: DeleteArgs) -> anyhow::Result<()> {
    let client = args.target.client().await?;
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), &args.namespace);
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), &args.namespace);
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    if hcs.get_opt(&args.name).await?.is_some() {
        hcs.delete(&args.name, &DeleteParams::default()).await?;
        eprintln!(
            "nestplane: deleting HostedCluster {}/{}",
            args.namespace, args.name
        );
        if !args.no_wait {
            gone(&hcs, &args.name, deadline).await?;
        }
    } else if let Some(ncp) = ncps.get_opt(&args.name).await? {
        if ncp
            .annotations()
            .contains_key(nestplane_operator::hosted::claim::HOSTED_CLUSTER_ANNOTATION)
        {
            bail!(
                "{}/{} belongs to a HostedCluster: delete that one",
                args.namespace,
                args.name
            );
        }
        // Its components go with it (owner references), its data with them.
        ncps.delete(&args.name, &DeleteParams::default()).await?;
        eprintln!(
            "nestplane: deleting NestedControlPlane {}/{}",
            args.namespace, args.name
        );
        if !args.no_wait {
            gone(&ncps, &args.name, deadline).await?;
        }
    } else {
        bail!(
            "no HostedCluster or NestedControlPlane {}/{} (`nestplane list`)",
            args.namespace,
            args.name
        );
    }
    eprintln!("nestplane: deleted {}/{}", args.namespace, args.name);
    Ok(())
}

async fn gone<K>(api: &Api<K>, name: &str, deadline: Instant) -> anyhow::Result<()>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    while api.get_opt(name).await?.is_some() {
        if Instant::now() > deadline {
            bail!(
                "{name} is still being deleted (deletion goes on; `nestplane list` and `kubectl describe` show where it is)"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// `nestplane kubeconfig`: a HostedCluster's admin kubeconfig (the Secret its status names),
/// or a NestedControlPlane's (`<name>-kubeconfig`); with `--gateway`, through the gateway.
pub async fn kubeconfig(args: KubeconfigArgs) -> anyhow::Result<String> {
    let client = args.target.client().await?;
    let value = admin_kubeconfig(&client, &args).await?;
    if !args.gateway {
        return Ok(value);
    }
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), &args.namespace);
    let (ns, name) = match hcs.get_opt(&args.name).await? {
        Some(hc) => (
            nestplane_operator::hosted::claim::control_plane_namespace(&hc),
            args.name.clone(),
        ),
        None => (args.namespace.clone(), args.name.clone()),
    };
    let ncps: Api<NestedControlPlane> = Api::namespaced(client, &ns);
    let Some(gw) = ncps
        .get_opt(&name)
        .await?
        .and_then(|n| n.status)
        .and_then(|s| s.gateway)
    else {
        bail!(
            "{}/{} is not reached through a gateway: the operator runs none (`nestplane operator --gateway-bind-address`), or the control plane is not routed yet",
            args.namespace,
            args.name
        );
    };
    through_gateway(&value, &gw.server, &gw.server_name)
}

/// `kubeconfig` with every cluster's `server` the gateway's and its `tls-server-name` the
/// cluster's name there (the cluster's CA still verifies its own API server's certificate).
/// Pure.
pub fn through_gateway(
    kubeconfig: &str,
    server: &str,
    server_name: &str,
) -> anyhow::Result<String> {
    let mut v: serde_json::Value =
        serde_saphyr::from_str_with_options(kubeconfig, nestplane_pki::untrusted_yaml())
            .context("reading the kubeconfig")?;
    let clusters = v
        .get_mut("clusters")
        .and_then(serde_json::Value::as_array_mut)
        .context("the kubeconfig has no clusters")?;
    for c in clusters {
        let cluster = c
            .get_mut("cluster")
            .and_then(serde_json::Value::as_object_mut)
            .context("a cluster entry without `cluster`")?;
        cluster.insert("server".into(), server.into());
        cluster.insert("tls-server-name".into(), server_name.into());
    }
    Ok(serde_saphyr::to_string(&v)?)
}

async fn admin_kubeconfig(client: &kube::Client, args: &KubeconfigArgs) -> anyhow::Result<String> {
    let client = client.clone();
    let hcs: Api<HostedCluster> = Api::namespaced(client.clone(), &args.namespace);
    if let Some(hc) = hcs.get_opt(&args.name).await? {
        let Some(r) = hc.status.and_then(|s| s.kubeconfig) else {
            bail!(
                "HostedCluster {}/{} has no kubeconfig yet (`nestplane list` shows whether it is ready)",
                args.namespace,
                args.name
            );
        };
        let secrets: Api<Secret> = Api::namespaced(client, &args.namespace);
        let s = secrets.get(&r.name).await?;
        let value = s
            .data
            .and_then(|d| d.get(&r.key).cloned())
            .with_context(|| format!("secret {} has no key {}", r.name, r.key))?;
        return Ok(String::from_utf8_lossy(&value.0).into_owned());
    }
    let ncps: Api<NestedControlPlane> = Api::namespaced(client.clone(), &args.namespace);
    if ncps.get_opt(&args.name).await?.is_none() {
        bail!(
            "no HostedCluster or NestedControlPlane {}/{} (`nestplane list`)",
            args.namespace,
            args.name
        );
    }
    crate::up::tenant_kubeconfig(&client, &args.namespace, &args.name).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_kubeconfig_through_the_gateway_names_the_gateway_and_the_cluster() {
        let kc = "apiVersion: v1\nkind: Config\nclusters:\n- name: demo\n  cluster:\n    server: https://127.64.3.1:6443\n    certificate-authority-data: Q0E=\nusers:\n- name: admin\n  user:\n    token: t\ncontexts:\n- name: demo\n  context: {cluster: demo, user: admin}\ncurrent-context: demo\n";
        let out = through_gateway(
            kc,
            "https://127.0.0.1:7443",
            "demo.default.nestplane.internal",
        )
        .unwrap();
        let v: serde_json::Value = serde_saphyr::from_str(&out).unwrap();
        let c = &v["clusters"][0]["cluster"];
        assert_eq!(c["server"], "https://127.0.0.1:7443");
        assert_eq!(c["tls-server-name"], "demo.default.nestplane.internal");
        assert_eq!(c["certificate-authority-data"], "Q0E=");
        assert_eq!(v["users"][0]["user"]["token"], "t");
        assert_eq!(v["current-context"], "demo");
        // What passes the check every reader applies.
        nestplane_pki::check_kubeconfig(&out).unwrap();
        assert!(through_gateway("kind: Config\n", "https://x", "y").is_err());
    }

    #[test]
    fn ages_read_as_kubectl_prints_them() {
        for (s, want) in [
            (0, "0s"),
            (119, "119s"),
            (120, "2m"),
            (7199, "119m"),
            (7200, "2h"),
            (172_800, "2d"),
            (-5, "0s"),
        ] {
            assert_eq!(age(s), want, "{s}");
        }
    }

    #[test]
    fn the_table_tells_each_clusters_story_in_aligned_columns() {
        let row = |name: &str, ready: bool, endpoint: &str| Row {
            namespace: "team-a".into(),
            name: name.into(),
            kind: "HostedCluster".into(),
            version: "1.20.2".into(),
            ready,
            deleting: false,
            nodes_ready: 1,
            nodes: 2,
            age_seconds: 300,
            endpoint: endpoint.into(),
        };
        let t = table(
            &[
                row("a", true, "127.0.0.1:6443"),
                row("longer-name", false, ""),
            ],
            true,
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            [
                "NAMESPACE",
                "NAME",
                "KIND",
                "VERSION",
                "READY",
                "NODES",
                "AGE",
                "ENDPOINT"
            ]
        );
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            [
                "team-a",
                "longer-name",
                "HostedCluster",
                "1.20.2",
                "False",
                "1/2",
                "5m",
                "<pending>"
            ]
        );
        // Every column starts where its header does.
        let col = |l: &str, what: &str| l.find(what).unwrap();
        assert_eq!(col(lines[0], "KIND"), col(lines[1], "HostedCluster"));
        assert_eq!(col(lines[0], "KIND"), col(lines[2], "HostedCluster"));
        // One namespace: no namespace column.
        assert!(!table(&[row("a", true, "")], false).contains("team-a"));
    }

    #[test]
    fn the_management_plane_is_the_flag_then_the_state_directory_then_kubeconfig() {
        let dir = tempfile::tempdir().unwrap();
        let t = |kubeconfig: Option<&str>, state: bool| Target {
            kubeconfig: kubeconfig.map(PathBuf::from),
            state_dir: state.then(|| dir.path().to_path_buf()),
        };
        // A state directory named without a management plane is an error, not a fallback.
        let e = t(None, true).candidates(true).unwrap_err().to_string();
        assert!(e.contains("no `nestplane up` in"), "{e}");
        std::fs::create_dir_all(dir.path().join("kubernetes")).unwrap();
        std::fs::write(dir.path().join("kubernetes/management.kubeconfig"), "").unwrap();
        std::fs::write(dir.path().join("management.kubeconfig"), "").unwrap();
        // Named, it wins over $KUBECONFIG; both runtimes' planes are tried.
        assert_eq!(
            t(None, true).candidates(true).unwrap(),
            [
                Source::File(dir.path().join("management.kubeconfig")),
                Source::File(dir.path().join("kubernetes/management.kubeconfig")),
            ]
        );
        assert_eq!(
            t(Some("/x/kc"), true).candidates(true).unwrap(),
            [Source::File(PathBuf::from("/x/kc"))]
        );
        // Not named: $KUBECONFIG wins over the default state directory.
        assert_eq!(t(None, false).candidates(true).unwrap(), [Source::Default]);
        assert_eq!(
            t(None, false).candidates(false).unwrap().last(),
            Some(&Source::Default)
        );
    }
}
