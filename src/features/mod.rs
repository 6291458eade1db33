//! Features: the memory-mapped local replicas the request path reads, and
//! the feed that keeps them current from Redis, the source of truth.
//!
//! The two halves meet only through the replica files: the feed writes
//! them on its own threads, the shards read them without a lock, and the
//! request path never waits on Redis.

pub mod feast;
pub mod feed;
pub mod groups;
pub mod replica;
