//! Who a tenant's processes are: a user of their own per tenant (see [`crate::egress`] for
//! where their packets may go). Pure.

/// The first uid (and gid) of tenant users; a tenant's is this plus its loopback block.
pub const UID_BASE: u32 = 0x4e50_0000;
/// How many uids tenant users may have.
pub const UID_COUNT: u32 = 1 << 16;

/// A tenant's user and group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct User {
    /// User id.
    pub uid: u32,
    /// Group id (the same number).
    pub gid: u32,
}

impl User {
    /// The user of the tenant whose loopback block is `127.a.b.0/24`.
    pub fn for_block(block: [u8; 2]) -> User {
        let id = UID_BASE + ((block[0] as u32) << 8 | block[1] as u32);
        User { uid: id, gid: id }
    }

    /// The user of the tenant one of whose replica addresses (`127.a.b.i`) is `host`.
    pub fn for_host(host: std::net::Ipv4Addr) -> User {
        let o = host.octets();
        User::for_block([o[1], o[2]])
    }
}
