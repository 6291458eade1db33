//! Quiver: a real-time ML scoring server.
//!
//! A request names one user, a few dozen candidate items and some context
//! floats; Quiver answers with one score per candidate inside the request's
//! deadline. See `docs/ARCHITECTURE.md` for the map of this crate.

pub mod admin;
pub mod admission;
pub mod cache;
pub mod client;
pub mod cluster;
pub mod config;
pub mod cores;
pub mod deadline;
pub mod demo;
pub mod drift;
pub mod feed;
pub mod infer;
pub mod ladder;
pub mod loadgen;
pub mod metrics;
pub mod model;
pub mod plot;
pub mod registry;
pub mod replica;
pub mod request;
pub mod score;
pub mod seeded;
pub mod server;
pub mod shard;
pub mod shed;
pub mod tls;
pub mod wire;
pub mod zipf;

/// Start-up failures: anything that stops the server before it serves.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Replica(#[from] replica::ReplicaError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Onnx(#[from] model::onnx::OnnxError),
    #[error(transparent)]
    Gbdt(#[from] model::gbdt::GbdtError),
    #[error(transparent)]
    Calibration(#[from] model::calibrate::CalibrationError),
    #[error(transparent)]
    Layout(#[from] model::layout::LayoutError),
    #[error(transparent)]
    Registry(#[from] registry::RegistryError),
    #[error(transparent)]
    Refresh(#[from] feed::RefreshError),
    #[error(transparent)]
    Feed(#[from] feed::FeedError),
    #[error("{0}")]
    Setup(String),
}
