//! Talking to a shared etcd as its `root` user (client-certificate authentication): turn
//! authentication on, give each tenant a user and a role confined to its key prefix, take them
//! away with the tenant's keys, and ask each member how it is.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, GetOptions, Identity, Permission,
    TlsOptions, UserAddOptions,
};
use nestplane_api::datastore::DatastoreMember;

/// etcd's administrative user: the one that may manage users and roles once authentication is
/// on (its certificate's common name is `root`).
pub const ROOT: &str = "root";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong talking to etcd.
#[derive(Debug, thiserror::Error)]
#[error("etcd at {endpoints}: {what}: {source}")]
pub struct EtcdError {
    endpoints: String,
    what: &'static str,
    #[source]
    source: Box<etcd_client::Error>,
}

/// Keys read per request when a tenant's usage is measured.
pub const USAGE_PAGE: i64 = 500;

/// What a tenant stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Its keys.
    pub keys: i64,
    /// Their keys' and values' bytes.
    pub bytes: i64,
}

/// A root client of one datastore.
pub struct Admin {
    client: Client,
    endpoints: Vec<String>,
    tls: TlsOptions,
}

/// The client certificate a connection presents, and the CA that verifies etcd.
#[derive(Clone)]
pub struct Credentials {
    /// The CA certificate (PEM) that signed etcd's serving certificate.
    pub ca_pem: String,
    /// The client certificate (PEM).
    pub cert_pem: String,
    /// Its key (PEM).
    pub key_pem: String,
}

fn already_exists(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("already exists"))
}

/// An answer larger than the client takes (tonic's 4 MiB limit on a decoded message).
fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("message length too large"))
}

fn not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("not found"))
}

impl Admin {
    /// Connect to `endpoints` with `creds`.
    pub async fn connect(endpoints: &[String], creds: &Credentials) -> Result<Admin, EtcdError> {
        let tls = tls_of(creds);
        let client = connect(endpoints, tls.clone()).await?;
        Ok(Admin {
            client,
            endpoints: endpoints.to_vec(),
            tls,
        })
    }

    fn fail(&self, what: &'static str) -> impl FnOnce(etcd_client::Error) -> EtcdError + '_ {
        move |source| EtcdError {
            endpoints: self.endpoints.join(","),
            what,
            source: Box::new(source),
        }
    }

    /// Make sure the `root` user and role exist and authentication is on (idempotent; an
    /// etcd that already has them is only read).
    pub async fn ensure_auth(&mut self) -> Result<(), EtcdError> {
        // With authentication on, only root may read users: a success means root exists.
        let root_ok = self
            .client
            .user_get(ROOT)
            .await
            .is_ok_and(|r| r.roles().iter().any(|x| x == ROOT));
        if !root_ok {
            if let Err(e) = self.client.role_add(ROOT).await
                && !already_exists(&e)
            {
                return Err(self.fail("adding the root role")(e));
            }
            if let Err(e) = self
                .client
                .user_add(ROOT, "", Some(UserAddOptions::new().with_no_pwd()))
                .await
                && !already_exists(&e)
            {
                return Err(self.fail("adding the root user")(e));
            }
            self.client
                .user_grant_role(ROOT, ROOT)
                .await
                .map_err(self.fail("granting root the root role"))?;
        }
        self.client
            .auth_enable()
            .await
            .map_err(self.fail("enabling authentication"))?;
        Ok(())
    }

    /// Whether a client whose certificate names a user etcd does not know may read (only when
    /// authentication is off).
    pub async fn anyone_may_read(
        endpoints: &[String],
        stranger: &Credentials,
    ) -> Result<bool, EtcdError> {
        let mut probe = Admin::connect(endpoints, stranger).await?;
        Ok(probe
            .client
            .get(
                "/nestplane/",
                Some(etcd_client::GetOptions::new().with_keys_only()),
            )
            .await
            .is_ok())
    }

    /// Give tenant `user` a role of the same name that may read and write `prefix` and
    /// nothing else (idempotent). A role confined to `prefix` but made read-only (the tenant
    /// is at its quota, see [`Admin::set_writable`]) is left read-only.
    pub async fn ensure_tenant(&mut self, user: &str, prefix: &str) -> Result<(), EtcdError> {
        // Read first, write only what is missing or wrong: every write to etcd's auth store
        // makes the requests then in flight of every tenant fail once (etcd compares auth
        // revisions), so a steady tenant must cost reads only.
        let permission = Permission::read_write(prefix).with_range_end(prefix_end(prefix));
        let granted = match self.client.role_get(user).await {
            Ok(r) => Some(r.permissions()),
            Err(e) if not_found(&e) => None,
            Err(e) => return Err(self.fail("reading the tenant's role")(e)),
        };
        let read_only = Permission::read(prefix).get_type();
        let exact = |g: &[Permission]| {
            g.len() == 1
                && g[0].key() == prefix.as_bytes()
                && g[0].range_end() == permission.range_end()
                && (g[0].get_type() == permission.get_type() || g[0].get_type() == read_only)
        };
        match granted {
            Some(g) if exact(&g) => {}
            Some(g) => {
                // Anything else granted to this role (by hand, say) is taken away: the role
                // is the tenant's confinement.
                for p in &g {
                    let opts = etcd_client::RoleRevokePermissionOptions::new()
                        .with_range_end(p.range_end());
                    self.client
                        .role_revoke_permission(user, p.key(), Some(opts))
                        .await
                        .map_err(self.fail("revoking a stray permission"))?;
                }
                self.client
                    .role_grant_permission(user, permission)
                    .await
                    .map_err(self.fail("granting the tenant's prefix"))?;
            }
            None => {
                self.client
                    .role_add(user)
                    .await
                    .map_err(self.fail("adding the tenant's role"))?;
                self.client
                    .role_grant_permission(user, permission)
                    .await
                    .map_err(self.fail("granting the tenant's prefix"))?;
            }
        }
        let roles = match self.client.user_get(user).await {
            Ok(u) => Some(u.roles().to_vec()),
            Err(e) if not_found(&e) => None,
            Err(e) => return Err(self.fail("reading the tenant's user")(e)),
        };
        let roles = match roles {
            Some(r) => r,
            None => {
                self.client
                    .user_add(user, "", Some(UserAddOptions::new().with_no_pwd()))
                    .await
                    .map_err(self.fail("adding the tenant's user"))?;
                Vec::new()
            }
        };
        // The user has its own role and no other.
        for other in roles.iter().filter(|r| *r != user) {
            self.client
                .user_revoke_role(user, other.as_str())
                .await
                .map_err(self.fail("revoking a stray role"))?;
        }
        if !roles.iter().any(|r| r == user) {
            self.client
                .user_grant_role(user, user)
                .await
                .map_err(self.fail("granting the tenant's role"))?;
        }
        Ok(())
    }

    /// What tenant `prefix` stores: its keys, and their bytes (keys and values), read at one
    /// revision in pages (linearizable: a lagging member answers only once it has caught up).
    /// A page starts at [`USAGE_PAGE`] keys and is halved while its answer is larger than the
    /// client takes (4 MiB: a tenant's large values cannot stop the measuring).
    pub async fn usage(&mut self, prefix: &str) -> Result<Usage, EtcdError> {
        let end = prefix_end(prefix);
        let mut from = prefix.as_bytes().to_vec();
        let mut usage = Usage::default();
        let mut limit = USAGE_PAGE;
        let mut revision = 0;
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(limit);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let page = match self.client.get(from.clone(), Some(options)).await {
                Ok(p) => p,
                Err(e) if too_large(&e) && limit > 1 => {
                    limit = (limit / 2).max(1);
                    continue;
                }
                Err(e) => return Err(self.fail("measuring the tenant's keys")(e)),
            };
            if revision == 0 {
                revision = page.header().map(|h| h.revision()).unwrap_or_default();
            }
            for kv in page.kvs() {
                usage.keys += 1;
                usage.bytes = usage
                    .bytes
                    .saturating_add((kv.key().len() + kv.value().len()) as i64);
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(usage),
            }
        }
    }

    /// Whether tenant `user`'s role may write `prefix` (`Some(false)`: read-only), or `None`
    /// when it has no such role (not a tenant, or one being removed).
    pub async fn writable(&mut self, user: &str, prefix: &str) -> Result<Option<bool>, EtcdError> {
        let granted = match self.client.role_get(user).await {
            Ok(r) => r.permissions(),
            Err(e) if not_found(&e) => return Ok(None),
            Err(e) => return Err(self.fail("reading the tenant's role")(e)),
        };
        let end = prefix_end(prefix);
        let read_only = Permission::read(prefix).get_type();
        Ok(granted
            .iter()
            .find(|p| p.key() == prefix.as_bytes() && p.range_end() == end.as_slice())
            .map(|p| p.get_type() != read_only))
    }

    /// Let tenant `user` write `prefix` again (`true`), or only read it (`false`: at its
    /// quota): one write to etcd's auth store, so call it only for a change ([`Admin::writable`]
    /// says what is granted). Granting the same range again replaces its type.
    pub async fn set_writable(
        &mut self,
        user: &str,
        prefix: &str,
        writable: bool,
    ) -> Result<(), EtcdError> {
        let want = if writable {
            Permission::read_write(prefix)
        } else {
            Permission::read(prefix)
        }
        .with_range_end(prefix_end(prefix));
        self.client
            .role_grant_permission(user, want)
            .await
            .map_err(self.fail("changing the tenant's permission"))?;
        Ok(())
    }

    /// Delete one key (there or not).
    pub async fn remove_key(&mut self, key: &str) -> Result<(), EtcdError> {
        self.client
            .delete(key, None)
            .await
            .map_err(self.fail("deleting a key"))?;
        Ok(())
    }

    /// Delete the tenant's keys, user and role; returns how many keys were deleted.
    pub async fn remove_tenant(&mut self, user: &str, prefix: &str) -> Result<i64, EtcdError> {
        let deleted = self
            .client
            .delete(prefix, Some(DeleteOptions::new().with_prefix()))
            .await
            .map_err(self.fail("deleting the tenant's keys"))?
            .deleted();
        if let Err(e) = self.client.user_delete(user).await
            && !not_found(&e)
        {
            return Err(self.fail("deleting the tenant's user")(e));
        }
        if let Err(e) = self.client.role_delete(user).await
            && !not_found(&e)
        {
            return Err(self.fail("deleting the tenant's role")(e));
        }
        Ok(deleted)
    }

    /// Each endpoint's health: a status request to that member alone.
    pub async fn members(&self) -> Vec<DatastoreMember> {
        let mut out = Vec::new();
        for endpoint in &self.endpoints {
            let answer = async {
                let mut c = connect(std::slice::from_ref(endpoint), self.tls.clone()).await?;
                c.status().await.map_err(|source| EtcdError {
                    endpoints: endpoint.clone(),
                    what: "asking for its status",
                    source: Box::new(source),
                })
            }
            .await;
            out.push(match answer {
                Ok(s) => DatastoreMember {
                    endpoint: endpoint.clone(),
                    healthy: true,
                    version: Some(s.version().to_string()),
                    message: None,
                },
                Err(e) => DatastoreMember {
                    endpoint: endpoint.clone(),
                    healthy: false,
                    version: None,
                    message: Some(e.to_string()),
                },
            });
        }
        out
    }
}

/// The end of the key range of everything under `prefix` (etcd's `--prefix`): the prefix
/// with its last byte incremented (a tenant's prefix ends with `/`, so this is `…0`).
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from `prefix` on.
    vec![0]
}

fn tls_of(creds: &Credentials) -> TlsOptions {
    TlsOptions::new()
        .ca_certificate(Certificate::from_pem(&creds.ca_pem))
        .identity(Identity::from_pem(&creds.cert_pem, &creds.key_pem))
}

/// A client of `endpoints` that presents `creds` (a tenant's own etcd client certificate:
/// what it may touch is what its etcd role allows).
pub async fn connect_as(endpoints: &[String], creds: &Credentials) -> Result<Client, EtcdError> {
    connect(endpoints, tls_of(creds)).await
}

async fn connect(endpoints: &[String], tls: TlsOptions) -> Result<Client, EtcdError> {
    Client::connect(
        endpoints,
        Some(
            ConnectOptions::new()
                .with_tls(tls)
                .with_connect_timeout(CONNECT_TIMEOUT)
                .with_timeout(REQUEST_TIMEOUT),
        ),
    )
    .await
    .map_err(|source| EtcdError {
        endpoints: endpoints.join(","),
        what: "connecting",
        source: Box::new(source),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_where_etcdctl_says() {
        assert_eq!(prefix_end("/nestplane/ns/a/"), b"/nestplane/ns/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }
}
