pub mod cluster;
pub mod dns;
pub mod plan;
pub mod pool;
