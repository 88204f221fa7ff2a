//! Tenant backups (issue #28): the archive format ([`archive`], pure), the engine that
//! reads a tenant's keys at one revision and writes them back under any prefix ([`engine`]),
//! where archives may go ([`location`], pure), `s3://` servers ([`s3`]), and the `NestedBackup`, `NestedRestore` and
//! `NestedBackupSchedule` controllers ([`controller`], [`restore`], [`schedule`]).
//! `docs/backup.md` describes them.

pub mod archive;
pub mod controller;
pub mod delta;
pub mod engine;
pub mod location;
pub mod restore;
pub mod s3;
pub mod schedule;
pub mod store;
pub mod tail;

#[cfg(test)]
mod tests;
