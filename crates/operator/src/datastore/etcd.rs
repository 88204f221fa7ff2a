//! Talking to a shared etcd as its `root` user (client-certificate authentication): turn
//! authentication on, give each tenant a user and a role confined to its key prefix, take them
//! away with the tenant's keys, and ask each member how it is.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, Identity, Permission, TlsOptions,
    UserAddOptions,
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

fn not_found(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.message().contains("not found"))
}

impl Admin {
    /// Connect to `endpoints` with `creds`.
    pub async fn connect(endpoints: &[String], creds: &Credentials) -> Result<Admin, EtcdError> {
        let tls = TlsOptions::new()
            .ca_certificate(Certificate::from_pem(&creds.ca_pem))
            .identity(Identity::from_pem(&creds.cert_pem, &creds.key_pem));
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

    /// Give tenant `user` a role of the same name that may read and write `prefix` and
    /// nothing else (idempotent).
    pub async fn ensure_tenant(&mut self, user: &str, prefix: &str) -> Result<(), EtcdError> {
        if let Err(e) = self.client.role_add(user).await
            && !already_exists(&e)
        {
            return Err(self.fail("adding the tenant's role")(e));
        }
        let permission = Permission::read_write(prefix).with_prefix();
        let granted = self
            .client
            .role_get(user)
            .await
            .map_err(self.fail("reading the tenant's role"))?
            .permissions();
        let exact = granted.len() == 1
            && granted[0].key() == prefix.as_bytes()
            && granted[0].range_end() == permission.range_end();
        if !exact {
            // Anything else granted to this role (by hand, say) is taken away: the role is
            // the tenant's confinement.
            for p in &granted {
                let opts =
                    etcd_client::RoleRevokePermissionOptions::new().with_range_end(p.range_end());
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
        if let Err(e) = self
            .client
            .user_add(user, "", Some(UserAddOptions::new().with_no_pwd()))
            .await
            && !already_exists(&e)
        {
            return Err(self.fail("adding the tenant's user")(e));
        }
        self.client
            .user_grant_role(user, user)
            .await
            .map_err(self.fail("granting the tenant's role"))?;
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
