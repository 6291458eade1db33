//! The Redis feed: how features get into Redis, the source of truth replicas follow.
//!
//! - [`resp`]: a blocking RESP2 connection (the only code that speaks the wire format);
//! - [`contract`]: the key and stream layout writers and replicas agree on, and the
//!   [`contract::Publisher`] that writes through the atomic publish script;
//! - [`load`]: the bulk loader behind `quiver features load`.

pub mod contract;
pub mod load;
pub mod resp;

pub use contract::{ContractError, PublishError, Publisher};
pub use resp::{RedisConfig, RedisConn, RedisError, Reply, UrlError};

/// Anything the feed tools can fail with, each with a message fit for one line on stderr.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(transparent)]
    Redis(#[from] RedisError),
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
