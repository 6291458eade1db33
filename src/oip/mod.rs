//! The Open Inference Protocol (KServe v2) front end: gRPC and HTTP/REST
//! listeners beside the FlatBuffers port, so Triton's clients, perf_analyzer
//! and KServe drive Quiver unchanged.
//!
//! It runs on threads of its own (a tokio runtime of `[oip] threads`
//! workers, on the housekeeping cores), never on a shard: parsing HTTP/2,
//! protobuf and JSON costs more than a shard's whole request does, and a
//! shard's reactor must not wait on a client's slow bytes. Each inference
//! request is checked against the model's signature here (`tensors.rs`),
//! turned into a FlatBuffers `ScoreRequest` and sent to a shard over the
//! shard's own listener (`upstream.rs`, multiplexed connections on
//! loopback), so admission, deadlines, the ladder, the cache and every
//! metric are the FlatBuffers request path's, untouched. The response's
//! tier, reason, version and feature counts come back as response
//! parameters. docs/ARCHITECTURE.md ("The v2 front end") gives the choice
//! and its measured cost.
//!
//! `grpc.rs` is the gRPC service (tonic, over the protocol's own
//! `proto/oip/grpc_service.proto`); `rest.rs` the HTTP/1 REST API with JSON
//! and the binary tensor extension (hyper); `config.rs` the answer to
//! Triton's `ModelConfig` call, which the protocol lacks and perf_analyzer
//! needs, rendered by both. Both bound what a client can
//! hold: connections, concurrent streams, message bytes, tensor elements.

pub mod config;
pub mod grpc;
pub mod rest;
pub mod tensors;
pub mod upstream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::metrics::Readiness;
use crate::registry::Registry;
use crate::request::SharedGroup;

/// Most worker threads the front end may run.
pub const THREADS_MAX: usize = 64;
/// Most connections a front end keeps to the shards.
pub const UPSTREAM_CONNECTIONS_MAX: usize = 1024;
/// The largest message either listener accepts, whatever the config says.
pub const MESSAGE_BYTES_LIMIT: usize = 64 << 20;

/// `[oip]`: the v2 listeners and their limits. Off unless a listener is set.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OipConfig {
    /// The gRPC listener (`GRPCInferenceService`); "off" disables it.
    pub grpc_listen: String,
    /// The HTTP/REST listener (`/v2/...`); "off" disables it.
    pub http_listen: String,
    /// Worker threads of the front end's runtime, shared by both listeners.
    pub threads: usize,
    /// Connections each listener holds at once; one more is closed at once.
    pub connections_max: usize,
    /// Concurrent gRPC streams on one connection (HTTP/2
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub streams_per_connection_max: u32,
    /// The largest request message: a gRPC message, or an HTTP body.
    pub message_bytes_max: usize,
    /// The most elements one input tensor may hold.
    pub tensor_elements_max: usize,
    /// Connections to the shards; 0: two per shard.
    pub upstream_connections: usize,
    /// Requests in flight to the shards, over all connections; one more is
    /// answered UNAVAILABLE at once.
    pub in_flight_max: usize,
    /// How long a request waits for its shard's answer beyond its budget
    /// (`budget_us`, or `limits.budget_us_default`) before it is answered
    /// DEADLINE_EXCEEDED.
    pub grace_ms: u64,
}

impl Default for OipConfig {
    fn default() -> Self {
        OipConfig {
            grpc_listen: "off".into(),
            http_listen: "off".into(),
            threads: 1,
            connections_max: 256,
            streams_per_connection_max: 128,
            message_bytes_max: 4 << 20,
            tensor_elements_max: 65_536,
            upstream_connections: 0,
            in_flight_max: 4096,
            grace_ms: 100,
        }
    }
}

impl OipConfig {
    /// Whether either listener is on.
    pub fn enabled(&self) -> bool {
        self.grpc_listen != "off" || self.http_listen != "off"
    }

    pub fn validate(&self) -> Result<(), String> {
        let range = |key: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("oip.{key} = {v} is outside {lo}..={hi}"))
            }
        };
        range("threads", self.threads as u64, 1, THREADS_MAX as u64)?;
        range("connections_max", self.connections_max as u64, 1, 1 << 16)?;
        range("streams_per_connection_max", u64::from(self.streams_per_connection_max), 1, 1 << 16)?;
        range("message_bytes_max", self.message_bytes_max as u64, 1024, MESSAGE_BYTES_LIMIT as u64)?;
        range("tensor_elements_max", self.tensor_elements_max as u64, 1, 1 << 24)?;
        range("upstream_connections", self.upstream_connections as u64, 0, UPSTREAM_CONNECTIONS_MAX as u64)?;
        range("in_flight_max", self.in_flight_max as u64, 1, 1 << 20)?;
        range("grace_ms", self.grace_ms, 0, 60_000)?;
        for (key, listen) in [("grpc_listen", &self.grpc_listen), ("http_listen", &self.http_listen)] {
            if listen != "off" && listen.parse::<SocketAddr>().is_err() {
                return Err(format!("oip.{key} = {listen:?} is not an address (host:port) or \"off\""));
            }
        }
        Ok(())
    }

    /// Connections to the shards for `shards` shards.
    pub fn upstream_connections_for(&self, shards: usize) -> usize {
        match self.upstream_connections {
            0 => (2 * shards).clamp(1, UPSTREAM_CONNECTIONS_MAX),
            n => n,
        }
    }
}

/// Why the front end could not start.
#[derive(Debug, thiserror::Error)]
pub enum OipError {
    #[error("oip.{what}: cannot listen on {addr}: {source}")]
    Bind { what: &'static str, addr: String, source: std::io::Error },
    #[error("oip: starting the front end's runtime: {0}")]
    Runtime(std::io::Error),
}

/// What the front end needs from the server it fronts.
pub struct Context {
    pub registry: Arc<Registry>,
    pub readiness: Arc<Readiness>,
    pub groups: Vec<SharedGroup>,
    /// The scoring port, as the shards bound it.
    pub scoring: SocketAddr,
    pub shards: usize,
    pub candidates_max: usize,
    pub budget_us_default: u32,
    pub budget_us_max: u32,
    /// Where inference requests are counted, by transport and outcome.
    pub counters: Arc<crate::metrics::OipCounters>,
}

/// The running front end: its thread and how to stop it.
pub struct Frontend {
    stop: tokio::sync::watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

/// The listeners, bound (so start-up fails on an address in use, and
/// their addresses are known) but not yet served.
pub struct Bound {
    config: OipConfig,
    grpc: Option<std::net::TcpListener>,
    http: Option<std::net::TcpListener>,
}

impl Bound {
    /// Binds the listeners `config` names.
    pub fn bind(config: &OipConfig) -> Result<Bound, OipError> {
        let bind = |what: &'static str, listen: &str| -> Result<Option<std::net::TcpListener>, OipError> {
            if listen == "off" {
                return Ok(None);
            }
            let l = std::net::TcpListener::bind(listen)
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .map_err(|source| OipError::Bind { what, addr: listen.into(), source })?;
            Ok(Some(l))
        };
        Ok(Bound {
            config: config.clone(),
            grpc: bind("grpc_listen", &config.grpc_listen)?,
            http: bind("http_listen", &config.http_listen)?,
        })
    }

    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Serves both listeners on a runtime of its own until
    /// [`Frontend::stop`].
    pub fn serve(self, context: Context) -> Result<Frontend, OipError> {
        let Bound { config, grpc, http } = self;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.threads)
            .max_blocking_threads(1)
            .thread_name("quiver-oip")
            .enable_io()
            .enable_time()
            .build()
            .map_err(OipError::Runtime)?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("quiver-oip-main".into())
            .spawn(move || {
                runtime.block_on(serve(config, context, grpc, http, stopped));
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(OipError::Runtime)?;
        Ok(Frontend { stop, thread: Some(thread) })
    }
}

impl Frontend {
    /// Stops both listeners, ends their connections and joins the thread.
    pub fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    config: OipConfig,
    context: Context,
    grpc: Option<std::net::TcpListener>,
    http: Option<std::net::TcpListener>,
    mut stop: Stop,
) {
    let upstream = upstream::Upstream::start(
        context.scoring,
        config.upstream_connections_for(context.shards),
        config.in_flight_max,
    );
    let infer = Arc::new(tensors::Service::new(context, upstream, &config));
    let mut tasks = Vec::new();
    if let Some(l) = grpc {
        tasks.push(tokio::spawn(grpc::serve(l, infer.clone(), config.clone(), stop.clone())));
    }
    if let Some(l) = http {
        tasks.push(tokio::spawn(rest::serve(l, infer.clone(), config.clone(), stop.clone())));
    }
    stopping(&mut stop).await;
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
}

/// The front end's stop signal: `true` once it is stopping.
pub type Stop = tokio::sync::watch::Receiver<bool>;

/// Resolves once `stop` says stop (or its sender is gone).
pub async fn stopping(stop: &mut Stop) {
    let _ = stop.wait_for(|s| *s).await;
}
