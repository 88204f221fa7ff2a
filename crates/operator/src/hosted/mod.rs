pub mod cluster;
pub mod plan;
pub mod pool;
