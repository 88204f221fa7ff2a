//! The pure core of PostCreateConfig: which Secrets' documents are applied, in what order,
//! to which clusters, and the status that says so. No IO.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, Time};
use nestplane_api::conditions;
use nestplane_api::postcreate::{
    ADDON_KEY, AppliedResources, ClusterRef, PostCreateConfig, PostCreateConfigStatus,
    SHARED_LABEL, Strategy, reasons, types,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// A resource Secret as read: its labels and its `addon.yaml`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SecretView {
    /// The Secret's labels.
    pub labels: BTreeMap<String, String>,
    /// `addon.yaml`, when present.
    pub addon: Option<String>,
}

/// Why the resources cannot be applied anywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The condition and Event reason.
    pub reason: &'static str,
    /// What a person reads.
    pub message: String,
    /// The Secret at fault (`namespace/name`).
    pub secret: String,
}

/// One document to apply, with where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Doc {
    /// The object.
    pub object: Value,
    /// `namespace/name` of the Secret.
    pub secret: String,
    /// Its index among the Secret's documents (0-based).
    pub index: usize,
}

impl Doc {
    /// `Kind namespace/name` for messages.
    pub fn describe(&self) -> String {
        let name = self.object["metadata"]["name"].as_str().unwrap_or_default();
        let kind = self.object["kind"].as_str().unwrap_or_default();
        match self.object["metadata"]["namespace"].as_str() {
            Some(ns) => format!("{kind} {ns}/{name}"),
            None => format!("{kind} {name}"),
        }
    }

    /// Whether it goes first: a Namespace or a CustomResourceDefinition.
    pub fn goes_first(&self) -> bool {
        let kind = self.object["kind"].as_str().unwrap_or_default();
        let group = self.object["apiVersion"]
            .as_str()
            .unwrap_or_default()
            .rsplit_once('/')
            .map(|(g, _)| g)
            .unwrap_or_default();
        (kind == "Namespace" && group.is_empty())
            || (kind == "CustomResourceDefinition" && group == "apiextensions.k8s.io")
    }
}

/// Everything to apply, in order (Namespaces and CRDs first, then the rest in the order of
/// the Secrets and their documents), and the hash of the Secrets it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Documents {
    /// The objects, in order.
    pub docs: Vec<Doc>,
    /// How many of `docs` go first (Namespaces and CRDs).
    pub first: usize,
    /// SHA-256 over every Secret's name and `addon.yaml`, in the spec's order.
    pub hash: String,
}

/// The namespace of a resource's Secret: its own, or the PostCreateConfig's (`own`).
pub fn resource_namespace(r: &nestplane_api::postcreate::ResourceRef, own: &str) -> String {
    r.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| own.to_string())
}

/// Read every resource of `pcc`: all must exist, be allowed, and parse, or nothing is
/// applied anywhere (the seed's all-or-nothing). `get(namespace, name)` reads a Secret.
pub fn documents(
    pcc: &PostCreateConfig,
    get: impl Fn(&str, &str) -> Option<SecretView>,
) -> Result<Documents, Problem> {
    let own_ns = pcc.metadata.namespace.clone().unwrap_or_default();
    let mut hasher = Sha256::new();
    let (mut first, mut rest) = (Vec::new(), Vec::new());
    for r in &pcc.spec.resources {
        let ns = resource_namespace(r, &own_ns);
        let id = format!("{ns}/{}", r.name);
        let problem = |reason, message: String| Problem {
            reason,
            message,
            secret: id.clone(),
        };
        let Some(secret) = get(&ns, &r.name) else {
            return Err(problem(
                reasons::SECRET_NOT_FOUND,
                format!("Secret {id} does not exist; nothing is applied until it does"),
            ));
        };
        if ns != own_ns && secret.labels.get(SHARED_LABEL).map(String::as_str) != Some("true") {
            return Err(problem(
                reasons::SECRET_NOT_SHARED,
                format!(
                    "Secret {id} is in another namespace than this PostCreateConfig and is not labelled {SHARED_LABEL}=true; nothing is applied"
                ),
            ));
        }
        let Some(yaml) = secret.addon else {
            return Err(problem(
                reasons::INVALID_RESOURCE,
                format!("Secret {id} has no {ADDON_KEY}; nothing is applied"),
            ));
        };
        hasher.update(id.as_bytes());
        hasher.update(b"\0");
        hasher.update(yaml.as_bytes());
        hasher.update(b"\0");
        for (index, object) in parse(&yaml)
            .map_err(|(index, e)| {
                problem(
                    reasons::INVALID_RESOURCE,
                    format!(
                        "Secret {id}, document {index} of {ADDON_KEY}: {e}; nothing is applied"
                    ),
                )
            })?
            .into_iter()
        {
            let doc = Doc {
                object,
                secret: id.clone(),
                index,
            };
            if doc.goes_first() {
                first.push(doc);
            } else {
                rest.push(doc);
            }
        }
    }
    let n = first.len();
    first.extend(rest);
    Ok(Documents {
        docs: first,
        first: n,
        hash: format!("{:x}", hasher.finalize()),
    })
}

/// How an `addon.yaml` is read: as YAML a user wrote ([`nestplane_pki::untrusted_yaml`]:
/// alias bombs and deep nesting stop the parser, not the operator; nothing of the text in an
/// error). A merge key (`<<`) is refused: readers disagree on which of a merged key and an
/// explicit one wins (kubectl's takes the later one, serde-saphyr the explicit one), so what a
/// reviewer sees with kubectl and what is applied could differ.
fn addon_yaml() -> serde_saphyr::Options {
    let mut options = nestplane_pki::untrusted_yaml();
    options.merge_keys = serde_saphyr::MergeKeyPolicy::Error;
    options
}

/// The most one Secret's documents may weigh once read (as JSON): a Secret holds at most
/// 1 MiB, and aliases, each document within its own budget, may not multiply that past here.
pub const MAX_READ_BYTES: usize = 8 << 20;

/// A YAML stream cut where kubectl cuts it: at every line that starts with `---`, which may be
/// followed by blanks and a comment only (kubectl refuses anything else, and YAML forbids such
/// a line inside a scalar: rule 206 `c-forbidden`). Each piece keeps its `---` line; a piece is
/// `counted` unless it precedes the first `---` (where a blank piece is no document). A `...`
/// is no cut: a piece with a document after one is refused when read, where kubectl would drop
/// that document unseen. Pure.
fn pieces(yaml: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut piece = Piece {
        text: "",
        counted: false,
        marker_ok: true,
    };
    let (mut start, mut at) = (0, 0);
    for line in yaml.split_inclusive('\n') {
        if let Some(rest) = line.strip_prefix("---") {
            let rest = rest.trim();
            out.push(Piece {
                text: &yaml[start..at],
                ..piece
            });
            piece.counted = true;
            piece.marker_ok = rest.is_empty() || rest.starts_with('#');
            start = at;
        }
        at += line.len();
    }
    out.push(Piece {
        text: &yaml[start..],
        ..piece
    });
    out
}

/// A document of a stream, as [`pieces`] cuts it.
#[derive(Clone, Copy)]
struct Piece<'a> {
    text: &'a str,
    counted: bool,
    /// Nothing but blanks and a comment follows its `---`.
    marker_ok: bool,
}

/// The objects of a multi-document YAML, each with its index; empty documents are skipped
/// (and counted). An error names the index of the first bad document.
pub fn parse(yaml: &str) -> Result<Vec<(usize, Value)>, (usize, String)> {
    let mut out = Vec::new();
    let mut next = 0;
    let mut weight = 0;
    for piece in pieces(yaml) {
        if !piece.marker_ok {
            return Err((
                next,
                "text after the document's `---` (kubectl refuses it too; start the document on the next line)".into(),
            ));
        }
        let v: Value = serde_saphyr::from_str_with_options(piece.text, addon_yaml())
            .map_err(|e| (next, e.to_string()))?;
        if v.is_null() && !piece.counted {
            continue;
        }
        weight += serde_json::to_vec(&v).map_or(usize::MAX, |b| b.len());
        if weight > MAX_READ_BYTES {
            return Err((
                next,
                format!(
                    "the documents read so far pass {} MiB",
                    MAX_READ_BYTES >> 20
                ),
            ));
        }
        let index = next;
        next += 1;
        if v.is_null() {
            continue;
        }
        let Some(map) = v.as_object() else {
            return Err((
                index,
                "not a mapping (an object with apiVersion and kind)".into(),
            ));
        };
        for field in ["apiVersion", "kind"] {
            if map
                .get(field)
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                return Err((index, format!("no {field}")));
            }
        }
        if v["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            return Err((index, "no metadata.name".into()));
        }
        out.push((index, v));
    }
    Ok(out)
}

/// Whether `selector` matches `labels` (Kubernetes' rules, by `kube::core::Selector`). An
/// empty selector matches nothing (unlike Kubernetes' own selectors): a PostCreateConfig must
/// say which clusters it is for; nor does one with an operator Kubernetes does not know.
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    use kube::core::SelectorExt;
    match kube::core::Selector::try_from(selector.clone()) {
        Ok(s) if !s.selects_all() => s.matches(labels),
        _ => false,
    }
}

/// A cluster in the PostCreateConfig's namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// `Cluster`, or `NestedControlPlane` for a control plane no Cluster owns.
    pub kind: String,
    /// Name (its kubeconfig is `<name>-kubeconfig`, except for a control plane whose identity
    /// is recorded otherwise: see `kubeconfig`).
    pub name: String,
    /// UID.
    pub uid: String,
    /// Labels the selector is matched against.
    pub labels: BTreeMap<String, String>,
    /// Why it cannot take resources yet (deleting, paused, not initialized).
    pub waiting: Option<String>,
    /// The Secret holding its admin kubeconfig.
    pub kubeconfig: String,
}

/// What to do with one matching cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Apply everything now.
    Apply,
    /// Applied with this hash already.
    Done,
    /// Applied with another hash; `ApplyOnce` leaves it.
    OutOfDate,
    /// Not ready for it (the reason).
    Wait(String),
}

/// The step for `target`, given what was applied before and the current hash.
pub fn step(target: &Target, applied: &[AppliedResources], hash: &str, strategy: Strategy) -> Step {
    match applied.iter().find(|a| a.uid == target.uid) {
        Some(a) if a.hash == hash => Step::Done,
        Some(_) if strategy == Strategy::ApplyOnce => Step::OutOfDate,
        _ => match &target.waiting {
            Some(why) => Step::Wait(why.clone()),
            None => Step::Apply,
        },
    }
}

/// The outcome of one pass, before it becomes status.
#[derive(Clone, Debug, Default)]
pub struct Pass {
    /// The resources could not be read (nothing applied).
    pub problem: Option<Problem>,
    /// Every cluster (matching or not) that exists in the namespace, by UID.
    pub existing: BTreeSet<String>,
    /// Matching clusters.
    pub matched: Vec<Target>,
    /// Clusters applied to in this pass, with the hash.
    pub applied_now: Vec<(Target, String)>,
    /// Clusters that failed in this pass (name, error).
    pub failed: Vec<(String, String)>,
    /// Clusters waiting (name, why).
    pub waiting: Vec<(String, String)>,
    /// Clusters whose resources changed since (names).
    pub out_of_date: Vec<String>,
}

/// The new status: the previous records of clusters that still exist, the clusters applied
/// now, counts and conditions.
pub fn status(
    pcc: &PostCreateConfig,
    pass: &Pass,
    now: k8s_openapi::jiff::Timestamp,
) -> PostCreateConfigStatus {
    let previous = pcc.status.clone().unwrap_or_default();
    let ns = pcc.metadata.namespace.clone().unwrap_or_default();
    let generation = pcc.metadata.generation;
    // What is recorded of clusters that still exist.
    let mut refs: Vec<ClusterRef> = previous.cluster_ref_list.clone();
    refs.retain(|r| pass.existing.contains(&r.uid));
    let mut applied: Vec<AppliedResources> = previous.applied.clone();
    applied.retain(|a| pass.existing.contains(&a.uid));
    for (t, hash) in &pass.applied_now {
        if !refs.iter().any(|r| r.uid == t.uid) {
            refs.push(ClusterRef {
                kind: t.kind.clone(),
                name: t.name.clone(),
                namespace: ns.clone(),
                uid: t.uid.clone(),
            });
        }
        applied.retain(|a| a.uid != t.uid);
        applied.push(AppliedResources {
            name: t.name.clone(),
            uid: t.uid.clone(),
            hash: hash.clone(),
            applied_at: Time(now),
        });
    }
    let applied_uids: BTreeSet<&String> = applied.iter().map(|a| &a.uid).collect();
    let matched = pass.matched.len() as i32;
    let applied_count = pass
        .matched
        .iter()
        .filter(|t| applied_uids.contains(&t.uid))
        .count() as i32;
    let mut conds = previous.conditions.clone();
    for c in status_conditions(pcc, pass, applied_count, matched) {
        conditions::set(&mut conds, c, generation, now);
    }
    PostCreateConfigStatus {
        cluster_ref_list: refs,
        applied,
        matched_clusters: matched,
        applied_clusters: applied_count,
        observed_generation: generation,
        conditions: conds,
    }
}

/// `ResourcesAvailable`, `ResourcesApplied`, `OutOfDate` and `Ready`, in that order.
fn status_conditions(
    pcc: &PostCreateConfig,
    pass: &Pass,
    applied_count: i32,
    matched: i32,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    let available = match &pass.problem {
        Some(p) => conditions::new(types::RESOURCES_AVAILABLE, false, p.reason, &p.message),
        None => conditions::new(
            types::RESOURCES_AVAILABLE,
            true,
            reasons::AS_EXPECTED,
            format!("{} Secret(s) read", pcc.spec.resources.len()),
        ),
    };
    let list = |v: &[(String, String)]| {
        v.iter()
            .map(|(n, why)| format!("{n}: {why}"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let applied_cond = if let Some(p) = &pass.problem {
        conditions::new(
            types::RESOURCES_APPLIED,
            false,
            p.reason,
            "nothing is applied while the resources cannot be read",
        )
    } else if !pass.failed.is_empty() {
        conditions::new(
            types::RESOURCES_APPLIED,
            false,
            reasons::APPLY_FAILED,
            format!("retrying with backoff: {}", list(&pass.failed)),
        )
    } else if !pass.waiting.is_empty() {
        conditions::new(
            types::RESOURCES_APPLIED,
            false,
            reasons::WAITING_FOR_CLUSTERS,
            list(&pass.waiting),
        )
    } else {
        conditions::new(
            types::RESOURCES_APPLIED,
            true,
            reasons::AS_EXPECTED,
            format!("{applied_count}/{matched} matching cluster(s) have the resources"),
        )
    };
    let out_of_date = if pass.out_of_date.is_empty() {
        conditions::new(types::OUT_OF_DATE, false, reasons::AS_EXPECTED, "")
    } else {
        conditions::new(
            types::OUT_OF_DATE,
            true,
            reasons::RESOURCES_CHANGED,
            format!(
                "the Secrets changed after {} got them; strategy ApplyOnce applies nothing again (set strategy: Reconcile to apply changes)",
                pass.out_of_date.join(", ")
            ),
        )
    };
    let ready = available.status == "True" && applied_cond.status == "True";
    let ready = if ready {
        conditions::new(types::READY, true, reasons::AS_EXPECTED, "")
    } else if available.status != "True" {
        conditions::new(types::READY, false, &available.reason, &available.message)
    } else {
        conditions::new(
            types::READY,
            false,
            &applied_cond.reason,
            &applied_cond.message,
        )
    };
    vec![available, applied_cond, out_of_date, ready]
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
