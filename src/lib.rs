//! Quiver: a real-time ML scoring server.
//!
//! A request names one user, a few dozen candidate items and some context
//! floats; Quiver answers with one score per candidate inside the request's
//! deadline. See `docs/ARCHITECTURE.md` for the map of this crate.

pub mod admin;
pub mod config;
pub mod cores;
pub mod deadline;
pub mod decision_log;
pub mod drift;
pub mod features;
pub mod infer;
pub mod loadgen;
pub mod metrics;
pub mod model;
pub mod oip;
pub mod registry;
pub mod request;
pub mod score;
pub mod seeded;
pub mod server;
pub mod shard;
pub mod tls;

/// The wire codec and the clients live in the client crate (`clients/rust`),
/// which Rust callers use alone; the server uses the same code.
pub use quiver_client::{client, wire};

/// What stops the server before it serves, or a `quiver` command before it
/// is done. Modules return their own typed errors; this gathers them at the
/// edges that report them (`server::run` and the command line), so no
/// module below those names it. `Setup` is the edges' own refusals.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Replica(#[from] features::replica::ReplicaError),
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
    Refresh(#[from] features::feed::RefreshError),
    #[error(transparent)]
    Feed(#[from] features::feed::FeedError),
    #[error(transparent)]
    Feast(#[from] features::feast::FeastError),
    #[error(transparent)]
    Demo(#[from] loadgen::demo::DemoError),
    #[error(transparent)]
    Calibrate(#[from] score::accuracy::CalibrateError),
    #[error(transparent)]
    Admin(#[from] admin::AdminError),
    #[error(transparent)]
    Shard(#[from] shard::ShardError),
    #[error("{0}")]
    Setup(String),
}
