//! Tenant backups (issue #28): the archive format ([`archive`], pure) and the engine that
//! reads a tenant's keys at one revision and writes them back under any prefix ([`engine`]).
//! `docs/backup.md` describes both.

pub mod archive;
pub mod engine;

#[cfg(test)]
mod tests;
