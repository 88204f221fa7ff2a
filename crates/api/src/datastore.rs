//! `NestedDatastore`: one etcd that many tenants' API servers share, each tenant confined to
//! its own key prefix by an etcd user and role of its own (Kamaji's shared datastore).

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// An etcd shared by many tenant control planes: one nestplane runs (`managed`) or one that
/// runs already (`external`). A `NestedControlPlane` uses it through `spec.datastoreRef`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "NestedDatastore",
    namespaced,
    status = "NestedDatastoreStatus",
    shortname = "nds",
    category = "cluster-api",
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(name = "Type", type_ = "string", json_path = ".status.type"),
    printcolumn(name = "Tenants", type_ = "integer", json_path = ".status.tenantCount"),
    printcolumn(
        name = "Healthy",
        type_ = "string",
        json_path = ".status.healthyMembers"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct NestedDatastoreSpec {
    /// An etcd nestplane runs (in the operator's runtime, persistent). The default when
    /// `external` is not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed: Option<ManagedDatastore>,
    /// An etcd that already runs, which nestplane only manages users and roles in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalDatastore>,
    /// The namespaces whose control planes may use this datastore, besides its own (the
    /// default: its own only). A control plane from elsewhere is refused and nothing is issued
    /// for it; withdrawing consent deletes nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_namespaces: Option<AllowedNamespaces>,
    /// What each tenant may store, and etcd's own space quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<DatastoreQuota>,
}

/// Space on a shared datastore: each tenant has a quota of bytes (its keys and values), so
/// that no tenant can fill etcd for the others.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreQuota {
    /// A tenant's quota when its control plane asks for none (default `256Mi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_default: Option<Quantity>,
    /// The most a control plane may ask for (`spec.datastoreRef.quota`; default:
    /// `tenantDefault`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_max: Option<Quantity>,
    /// etcd's own space quota (`--quota-backend-bytes`): set on a managed datastore's etcd
    /// (default `8Gi`); for an external one, what its etcd runs with (default `2Gi`, etcd's).
    /// Tenants are admitted while their quotas together stay within three quarters of it
    /// (the rest is for history not yet compacted and free pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<Quantity>,
}

/// Namespaces allowed to use a datastore: by name, or by their labels.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedNamespaces {
    /// Namespace names.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// Namespaces whose labels match (an empty selector matches none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

/// An etcd nestplane runs for the datastore.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ManagedDatastore {
    /// Members: 1 (default) or 3. Fixed once the etcd has formed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3))]
    pub replicas: Option<i32>,
    /// The Kubernetes version whose etcd runs (the operator's default when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// An etcd run by someone else.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalDatastore {
    /// Client URLs (`https://host:2379`).
    pub endpoints: Vec<String>,
    /// A Secret in the datastore's namespace holding the CA etcd trusts for clients:
    /// `tls.crt` and `tls.key` (the key signs each tenant's client certificate; it never
    /// leaves the datastore's namespace).
    pub ca_secret_name: String,
    /// A Secret in the datastore's namespace holding a client certificate of etcd's `root`
    /// user (`tls.crt`, `tls.key`): nestplane adds and removes tenants' users and roles with
    /// it, and enables authentication when it is off.
    pub root_secret_name: String,
}

/// What a tenant owns in a shared datastore.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreTenant {
    /// The control plane's namespace.
    pub namespace: String,
    /// The control plane's name.
    pub name: String,
    /// The etcd user and role (`nestplane:<namespace>:<cluster>`).
    pub user: String,
    /// The key prefix the user may read and write (`/nestplane/<namespace>/<cluster>/`).
    pub prefix: String,
    /// The bytes it may store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota_bytes: Option<i64>,
    /// Whether it is at its quota: its role may only read until it is under again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// The health of one etcd member as the datastore's client sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DatastoreMember {
    /// The member's client URL.
    pub endpoint: String,
    /// Whether it answered a status request.
    pub healthy: bool,
    /// etcd's version, as it reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Why it is not healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Observed state of a `NestedDatastore`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NestedDatastoreStatus {
    /// Every member healthy, authentication on, and nestplane able to manage users.
    #[serde(default)]
    pub ready: bool,
    /// `Managed` or `External`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub r#type: Option<String>,
    /// Client URLs tenants' API servers use.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
    /// Each member's health.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<DatastoreMember>,
    /// `healthy/all` members, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthy_members: Option<String>,
    /// The tenants using this datastore.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<DatastoreTenant>,
    /// How many tenants use this datastore.
    #[serde(default)]
    pub tenant_count: i32,
    /// The generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Conditions (`Ready`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Which datastore a control plane uses, and what it owns there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantDatastoreStatus {
    /// The `NestedDatastore`'s name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
    /// The tenant's etcd user and role.
    pub user: String,
    /// The tenant's key prefix.
    pub prefix: String,
    /// The client URLs its API server uses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<String>,
}

/// The etcd user (and role) of a tenant: `nestplane:<namespace>:<cluster>` (a colon never
/// appears in a Kubernetes name, so no two tenants share one). Pure.
pub fn tenant_user(namespace: &str, cluster: &str) -> String {
    format!("nestplane:{namespace}:{cluster}")
}

/// The key prefix of a tenant: `/nestplane/<namespace>/<cluster>/` (the trailing slash keeps
/// tenant `a` out of tenant `ab`'s keys). Pure.
pub fn tenant_prefix(namespace: &str, cluster: &str) -> String {
    format!("/nestplane/{namespace}/{cluster}/")
}

/// The cluster name the objects of a managed datastore are named after (`<name>-datastore`:
/// its NestedEtcd `<name>-datastore-etcd`, its secrets `<name>-datastore-etcd…`).
pub fn datastore_cluster(name: &str) -> String {
    format!("{name}-datastore")
}

/// A tenant's default quota on a datastore that names none.
pub const DEFAULT_TENANT_QUOTA: i64 = 256 << 20;
/// A managed datastore's etcd space quota when the datastore names none.
pub const DEFAULT_MANAGED_BACKEND: i64 = 8 << 30;
/// etcd's own default space quota (an external datastore's, when it names none).
pub const DEFAULT_EXTERNAL_BACKEND: i64 = 2 << 30;

/// A quantity of bytes (`256Mi`, `1G`, `1048576`) as a number. Pure.
pub fn parse_bytes(q: &str) -> Result<i64, String> {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (digits, suffix) = q.split_at(split);
    let factor: i64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => {
            return Err(format!(
                "{q:?} is not a whole number of bytes (like 512Mi, 2Gi or 1000000)"
            ));
        }
    };
    digits
        .parse::<i64>()
        .ok()
        .and_then(|n| n.checked_mul(factor))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{q:?} is not a whole number of bytes (like 512Mi, 2Gi or 1000000)"))
}

/// A datastore's quotas, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quotas {
    /// A tenant's quota when it asks for none.
    pub tenant_default: i64,
    /// The most a tenant may ask for.
    pub tenant_max: i64,
    /// etcd's space quota.
    pub backend: i64,
}

impl Quotas {
    /// The quotas of `spec`, or what is wrong with them. Pure.
    pub fn of(spec: &NestedDatastoreSpec) -> Result<Quotas, String> {
        let q = spec.quota.clone().unwrap_or_default();
        let field = |name: &str, v: &Option<Quantity>| -> Result<Option<i64>, String> {
            v.as_ref()
                .map(|v| parse_bytes(&v.0).map_err(|e| format!("quota.{name}: {e}")))
                .transpose()
        };
        let tenant_default =
            field("tenantDefault", &q.tenant_default)?.unwrap_or(DEFAULT_TENANT_QUOTA);
        let tenant_max = field("tenantMax", &q.tenant_max)?.unwrap_or(tenant_default);
        let backend = field("backend", &q.backend)?.unwrap_or(if spec.external.is_some() {
            DEFAULT_EXTERNAL_BACKEND
        } else {
            DEFAULT_MANAGED_BACKEND
        });
        if tenant_max < tenant_default {
            return Err(format!(
                "quota.tenantMax ({tenant_max} bytes) is below quota.tenantDefault ({tenant_default} bytes)"
            ));
        }
        let quotas = Quotas {
            tenant_default,
            tenant_max,
            backend,
        };
        if tenant_max > quotas.capacity() {
            return Err(format!(
                "quota.tenantMax ({tenant_max} bytes) is more than tenants may hold together: three quarters of quota.backend ({backend} bytes)"
            ));
        }
        Ok(quotas)
    }

    /// What the tenants' quotas may add up to: three quarters of etcd's space quota.
    pub fn capacity(&self) -> i64 {
        self.backend / 4 * 3
    }

    /// The quota of a tenant that asks for `asked` (`spec.datastoreRef.quota`), or why it
    /// cannot have it. Pure.
    pub fn for_tenant(&self, asked: Option<&Quantity>) -> Result<i64, String> {
        let Some(asked) = asked else {
            return Ok(self.tenant_default);
        };
        let n = parse_bytes(&asked.0).map_err(|e| format!("spec.datastoreRef.quota: {e}"))?;
        if n > self.tenant_max {
            return Err(format!(
                "spec.datastoreRef.quota asks for {n} bytes; the datastore allows at most {} (its quota.tenantMax)",
                self.tenant_max
            ));
        }
        Ok(n)
    }
}

/// Whether a tenant storing `used` bytes under `quota` may only read: from its quota on, and
/// (once read-only) until it is below 95 % of it, so that it does not flap at the edge. Pure.
pub fn over_quota(used: i64, quota: i64, read_only_now: bool) -> bool {
    if read_only_now {
        used >= quota_floor(quota)
    } else {
        used >= quota
    }
}

/// What a read-only tenant must store less than to write again: 95 % of its quota. Pure.
pub fn quota_floor(quota: i64) -> i64 {
    quota - quota / 20
}

/// The first release of each etcd line without the published authorization bypasses that
/// break per-tenant roles (a lease's `TimeToLive` with keys, CVE-2023-32082; nested
/// transactions, GHSA-rfx7-8w68-q57q; `PrevKv` and leases in nested puts,
/// GHSA-x35m-3gp4-4fh5). Lines after these are newer than the advisories.
pub const ETCD_FIXED: [(u32, u32, u32); 3] = [(3, 4, 44), (3, 5, 30), (3, 6, 11)];

/// Why a datastore whose etcd reports `version` (`3.5.30`) must not be shared among tenants,
/// or `None` when it may. Pure.
pub fn etcd_version_problem(version: &str) -> Option<String> {
    let core = version.trim().trim_start_matches('v');
    let core = core.split(['-', '+']).next().unwrap_or_default();
    let parts: Vec<u32> = match core.split('.').map(str::parse).collect() {
        Ok(p) => p,
        Err(_) => {
            return Some(format!(
                "etcd reports version {version:?}, which nestplane cannot read"
            ));
        }
    };
    let [major, minor, patch] = parts[..] else {
        return Some(format!(
            "etcd reports version {version:?}, which nestplane cannot read"
        ));
    };
    let fixed = ETCD_FIXED
        .iter()
        .find(|(a, b, _)| (*a, *b) == (major, minor));
    let safe = match fixed {
        Some(&(_, _, first)) => patch >= first,
        None => (major, minor) > (3, 6),
    };
    (!safe).then(|| {
        let first = fixed
            .map(|(a, b, c)| format!("{a}.{b}.{c}"))
            .unwrap_or_else(|| "3.5.30".into());
        format!(
            "etcd {core} has published authorization bypasses that let one tenant read another's keys (a lease's keys, nested transactions); a shared datastore needs {first} or newer"
        )
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn byte_quantities() {
        assert_eq!(parse_bytes("256Mi"), Ok(256 << 20));
        assert_eq!(parse_bytes("2Gi"), Ok(2 << 30));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        for bad in ["", "0", "-1Mi", "1.5Gi", "12Mb", "Mi", "99999999999999Ti"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn quotas_have_defaults_and_limits() {
        let q = |d: Option<&str>, m: Option<&str>, b: Option<&str>, external: bool| {
            Quotas::of(&NestedDatastoreSpec {
                quota: Some(DatastoreQuota {
                    tenant_default: d.map(|s| Quantity(s.into())),
                    tenant_max: m.map(|s| Quantity(s.into())),
                    backend: b.map(|s| Quantity(s.into())),
                }),
                external: external.then(Default::default),
                ..Default::default()
            })
        };
        let managed = q(None, None, None, false).unwrap();
        assert_eq!(
            managed,
            Quotas {
                tenant_default: 256 << 20,
                tenant_max: 256 << 20,
                backend: 8 << 30
            }
        );
        assert_eq!(managed.capacity(), 6 << 30);
        assert_eq!(q(None, None, None, true).unwrap().backend, 2 << 30);
        assert!(q(Some("1Gi"), Some("512Mi"), None, false).is_err());
        assert!(
            q(None, Some("7Gi"), None, false)
                .expect_err("refused")
                .contains("three quarters")
        );
        assert!(
            q(Some("bad"), None, None, false)
                .expect_err("refused")
                .contains("tenantDefault")
        );

        let q = q(Some("64Mi"), Some("1Gi"), None, false).unwrap();
        assert_eq!(q.for_tenant(None), Ok(64 << 20));
        assert_eq!(q.for_tenant(Some(&Quantity("512Mi".into()))), Ok(512 << 20));
        let e = q
            .for_tenant(Some(&Quantity("2Gi".into())))
            .expect_err("refused");
        assert!(e.contains("at most 1073741824"), "{e}");
    }

    #[test]
    fn read_only_from_the_quota_until_well_under_it() {
        assert!(!over_quota(99, 100, false));
        assert!(over_quota(100, 100, false));
        assert!(over_quota(96, 100, true));
        assert!(!over_quota(94, 100, true));
        // Small quotas do not leave a tenant read-only for good.
        assert!(!over_quota(0, 10, true));
        assert_eq!(quota_floor(1), 1);
    }

    #[test]
    fn etcds_with_known_bypasses_may_not_be_shared() {
        for old in ["3.4.23", "3.5.9", "3.5.29", "3.6.10", "3.3.27", "2.3.8"] {
            assert!(etcd_version_problem(old).is_some(), "{old}");
        }
        for ok in [
            "3.4.44", "3.5.30", "3.5.33", "3.6.11", "3.7.0", "v3.5.30", "3.5.30-2",
        ] {
            assert_eq!(etcd_version_problem(ok), None, "{ok}");
        }
        let m = etcd_version_problem("3.4.23").unwrap();
        assert!(m.contains("3.4.44 or newer"), "{m}");
        assert!(etcd_version_problem("").is_some());
        assert!(etcd_version_problem("3.5").is_some());
    }

    #[test]
    fn prefixes_of_different_tenants_never_nest() {
        let a = tenant_prefix("ns", "a");
        let ab = tenant_prefix("ns", "ab");
        assert!(!ab.starts_with(&a) && !a.starts_with(&ab));
        // A namespace/cluster split cannot be confused: '/' is not allowed in names.
        assert_ne!(tenant_prefix("a-b", "c"), tenant_prefix("a", "b-c"));
        assert_ne!(tenant_user("a-b", "c"), tenant_user("a", "b-c"));
    }
}
