//! Where tenant components run. The `process` runtime executes the rendered pod templates as
//! supervised local processes; [`child`] and [`binaries`] are shared with the local
//! management plane.
pub mod binaries;
pub mod child;
pub mod egress;
pub mod files;
pub mod process;
pub mod user;
