//! Tenant backups (issue #28): the archive format ([`archive`], pure), the engine that
//! reads a tenant's keys at one revision and writes them back under any prefix ([`engine`]),
//! where archives may go ([`location`], pure), and the `NestedBackup` and `NestedRestore`
//! controllers ([`controller`], [`restore`]).
//! `docs/backup.md` describes both.

pub mod archive;
pub mod controller;
pub mod engine;
pub mod location;
pub mod restore;

#[cfg(test)]
mod tests;
