//! The Redis feed: how features get into Redis, the source of truth replicas follow.
//!
//! - [`resp`]: a blocking RESP2 connection (the only code that speaks the wire format),
//!   through `crate::tls` for `rediss://`;
//! - [`cluster`]: Redis Cluster routing over those connections: key slots, the
//!   topology, `MOVED`, `ASK` and `TRYAGAIN`, pipelines per master;
//! - [`contract`]: the key and stream layouts writers and replicas agree on (plain, or
//!   hash-tagged buckets for a cluster), and the [`contract::Publisher`] that writes
//!   through the atomic publish script on one node or a cluster;
//! - [`load`]: the bulk loader behind `quiver features load`;
//! - [`config`]: the `[feed]` section;
//! - [`sync`]: one full copy of a group, and whether its source was settled;
//! - [`refresher`]: the thread that keeps each replica equal to Redis (full
//!   sync, stream replay, resync on gaps), and [`start`], which opens,
//!   repairs or first syncs the replicas before serving;
//! - [`status`]: the atomics through which the refresher reports position and
//!   staleness to shards and the admin endpoint.

pub mod contract;
pub mod load;
pub mod redis_cluster;
pub mod refresher;
pub mod resp;
pub mod settings;
pub mod start;
pub mod status;
pub mod sync;

pub use contract::{ContractError, PublishError, Publisher};
pub use resp::{RedisConfig, RedisConn, RedisError, Reply, ReplyLimits, UrlError};
pub use settings::FeedConfig;
pub use start::{start, Feed, GroupSpec};
pub use status::{FeedStatus, GroupStatus, StalePolicy};
pub use sync::RefreshError;

/// Anything the feed tools can fail with, each with a message fit for one line on stderr.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(transparent)]
    Redis(#[from] RedisError),
    #[error(transparent)]
    Cluster(#[from] redis_cluster::ClusterError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {what}")]
    Input { path: String, line: usize, what: String },
}
