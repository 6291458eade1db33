//! Feast: serve the feature views of a Feast repository straight from the
//! Redis online store `feast materialize` fills (issue 35), so a team that
//! keeps its features in Feast needs no second pipeline into Quiver.
//!
//! - [`protos`]: Feast's own protobuf messages, generated from its `.proto`
//!   files at build time, and [`group_guard`], the walk every outside byte
//!   passes before they decode it (protobuf 3.4.0's unbounded recursion);
//! - [`repo`]: `feature_store.yaml` and the registry, and the plan that
//!   makes each served feature view a feature group (what is refused, why);
//! - [`redis_layout`]: Feast's Redis keys, hash fields and values, read
//!   exactly, and the rule that makes each value an f32;
//! - [`copy`]: the first sync: every entity of the project's views copied
//!   from Redis into fresh replica files, swapped in only when the copy does
//!   not shrink a populated replica past the bound.

pub mod copy;
pub mod group_guard;
pub mod protos;
pub mod redis_layout;
pub mod repo;

pub use copy::{first_sync, SyncOptions, SyncReport, ViewReport};
pub use repo::{FeastRepo, Plan, Refusal, ServedView};

/// What reading a Feast repository or its Redis can fail with, each a line
/// fit for stderr.
#[derive(Debug, thiserror::Error)]
pub enum FeastError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("feast repository: {0}")]
    Repo(String),
    #[error("redis: {0}")]
    Redis(#[from] crate::features::feed::RedisError),
    #[error("redis replied to {command} with an unexpected shape: {what}")]
    Reply { command: &'static str, what: String },
    #[error(transparent)]
    Replica(#[from] crate::features::replica::ReplicaError),
    /// The copy would drop most of a populated replica (Redis emptied or
    /// flushed, the wrong project or database): the file is kept.
    #[error("view '{view}': the copy holds {copied} rows, {path} holds {served}; more than {shrink_max_percent}% fewer, so the file is kept (held). Run again with --accept-shrink if Redis really lost them")]
    Held { view: String, path: String, copied: u64, served: u64, shrink_max_percent: u32 },
}
