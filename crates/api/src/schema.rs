//! Schema helpers for fields kube-derive cannot describe structurally.

use schemars::{Schema, SchemaGenerator, json_schema};

/// A list of arbitrary objects (`x-kubernetes-preserve-unknown-fields` items).
pub fn preserve_unknown_list(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "array",
        "items": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": true
        }
    })
}
