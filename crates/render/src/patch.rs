//! User patches (`spec.patches` of a component, kubebuilder-declarative-pattern's
//! `PatchSpec`): each patch is a partial object naming its target by `kind` and
//! `metadata.name`, merged into that rendered object with strategic-merge semantics for the
//! lists that matter (containers, env, volumes, volume mounts, ports: merged by their keys).
//! `$patch: delete` in a list element removes the element with that key; `null` removes a
//! field.

use serde_json::Value;

/// Why a patch cannot be applied; `index` is its position in `spec.patches`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("patch {index} ({target}): {reason}")]
pub struct PatchError {
    /// Position in `spec.patches`.
    pub index: usize,
    /// `Kind/name` as the patch names it (or what is missing).
    pub target: String,
    /// What is wrong.
    pub reason: String,
}

/// The merge key of a list field, by field name (as `kubectl patch --type strategic` uses
/// for these fields of core/v1 and apps/v1).
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "volumeClaimTemplates" => "name",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "ports" => "__port__",
        "hostAliases" => "ip",
        "topologySpreadConstraints" => "topologyKey",
        _ => return None,
    })
}

/// `Kind/name` of a rendered object (`?` for what is missing).
pub(crate) fn kind_name(v: &Value) -> String {
    format!(
        "{}/{}",
        v.get("kind").and_then(Value::as_str).unwrap_or("?"),
        v.pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("?")
    )
}

/// Apply `patches` in order to `objects` (each object has `kind` and `metadata.name`).
pub fn apply<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    patches: &[Value],
) -> Result<(), PatchError> {
    let mut objects: Vec<&mut Value> = objects.into_iter().collect();
    for (index, patch) in patches.iter().enumerate() {
        let err = |target: String, reason: String| PatchError {
            index,
            target,
            reason,
        };
        let Some(p) = patch.as_object() else {
            return Err(err(
                "?".into(),
                "a patch must be an object with kind and metadata.name".into(),
            ));
        };
        let kind = p.get("kind").and_then(Value::as_str).unwrap_or_default();
        let name = p
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if kind.is_empty() || name.is_empty() {
            return Err(err(
                format!("{kind}/{name}"),
                "a patch must name its target with kind and metadata.name".into(),
            ));
        }
        let target = format!("{kind}/{name}");
        let Some(obj) = objects.iter_mut().find(|o| {
            o.get("kind").and_then(Value::as_str) == Some(kind)
                && o.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
        }) else {
            let known: Vec<String> = objects.iter().map(|o| kind_name(o)).collect();
            return Err(err(
                target,
                format!(
                    "no rendered object has this kind and name (rendered: {})",
                    known.join(", ")
                ),
            ));
        };
        let mut body = p.clone();
        // The target's identity is not the patch's to change.
        for f in ["apiVersion", "kind"] {
            body.remove(f);
        }
        if let Some(Value::Object(m)) = body.get_mut("metadata") {
            m.remove("name");
            m.remove("namespace");
        }
        merge(obj, &Value::Object(body), "").map_err(|reason| err(target.clone(), reason))?;
    }
    Ok(())
}

fn merge(dst: &mut Value, patch: &Value, path: &str) -> Result<(), String> {
    match (dst, patch) {
        (Value::Object(d), Value::Object(p)) => {
            for (k, v) in p {
                let here = format!("{path}.{k}");
                if v.is_null() {
                    d.remove(k);
                    continue;
                }
                match (d.get_mut(k), merge_key(k), v) {
                    (Some(Value::Array(list)), Some(key), Value::Array(items)) => {
                        merge_list(list, items, key, &here)?
                    }
                    (Some(existing @ Value::Object(_)), _, Value::Object(_)) => {
                        merge(existing, v, &here)?
                    }
                    (Some(existing), _, _) => {
                        if existing.is_object() != v.is_object()
                            && (existing.is_object() || v.is_object())
                        {
                            return Err(format!(
                                "{here}: cannot replace {} with {}",
                                type_name(existing),
                                type_name(v)
                            ));
                        }
                        *existing = strip_directives(v.clone());
                    }
                    (None, _, _) => {
                        d.insert(k.clone(), strip_directives(v.clone()));
                    }
                }
            }
            Ok(())
        }
        (d, p) => {
            *d = p.clone();
            Ok(())
        }
    }
}

fn key_of<'a>(item: &'a Value, key: &str) -> Option<String> {
    let o = item.as_object()?;
    if key == "__port__" {
        // Container ports merge on containerPort, Service ports on port.
        let n = o.get("containerPort").or_else(|| o.get("port"))?;
        let proto = o.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
        return Some(format!("{n}/{proto}"));
    }
    let v: &'a Value = o.get(key)?;
    Some(match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

fn merge_list(list: &mut Vec<Value>, items: &[Value], key: &str, path: &str) -> Result<(), String> {
    for item in items {
        let Some(k) = key_of(item, key) else {
            let shown = if key == "__port__" {
                "containerPort or port"
            } else {
                key
            };
            return Err(format!("{path}: every element needs its merge key {shown}"));
        };
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        let pos = list
            .iter()
            .position(|e| key_of(e, key).as_deref() == Some(&k));
        match (pos, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => merge(&mut list[i], item, &format!("{path}[{k}]"))?,
            (None, false) => list.push(strip_directives(item.clone())),
        }
    }
    Ok(())
}

fn strip_directives(mut v: Value) -> Value {
    if let Value::Object(m) = &mut v {
        m.remove("$patch");
        let keys: Vec<String> = m.keys().cloned().collect();
        for k in keys {
            if let Some(x) = m.remove(&k)
                && !x.is_null()
            {
                m.insert(k, strip_directives(x));
            }
        }
    } else if let Value::Array(a) = &mut v {
        let items = std::mem::take(a);
        *a = items.into_iter().map(strip_directives).collect();
    }
    v
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
