//! Shards: one pinned glommio executor per core, each with its own
//! SO_REUSEPORT listener, connections, request path and counters.
//!
//! This is the only module that knows glommio. Everything after "a frame's
//! bytes were read at time T" lives in `src/request/` and is runtime-agnostic,
//! so the executor could be replaced by a direct io_uring loop by rewriting
//! this module alone.
//!
//! A connection is served in rounds: read what the socket has, answer every
//! complete frame in the buffer (pipelining), write all responses in one
//! write, repeat. A stream that cannot be split into frames (oversized or
//! zero length prefix) gets one `BadRequest` response and is closed; any
//! other bad request is answered and the connection goes on.
//!
//! With `[tls]`, a connection first completes a TLS handshake (bounded by
//! `tls.handshake_timeout_ms`) and is then served by the same rounds over
//! the decrypted bytes (`tls`).
//!
//! `run_shard` here wires one shard together and drains it; `accept.rs` is
//! its accept loop, `connection.rs` one connection's rounds, `tasks.rs` the
//! shard's other tasks (watcher, publisher, completion poller, shadow task,
//! adopter).

mod accept;
mod balance;
mod connection;
mod mailbox;
mod shutdown;
mod stall;
mod stamped;
mod tasks;
mod tls_stream;

use std::cell::{Cell, RefCell};
use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};

use serde::{Deserialize, Serialize};

use crate::deadline::{Clock, MonotonicClock};
use crate::infer::ShardEnd;
use crate::metrics::ShardPublisher;
use crate::request::ladder::BreakerState;
use crate::request::{Counters, RequestPath, Shared};
use balance::ShardBalance;
use connection::Conns;
use mailbox::{Mailboxes, Notify};
pub use shutdown::ShutdownSignal;
use stall::StallMeter;
pub use tls_stream::ListenerTls;

/// The background task queue's shares against the default queue's 1000.
const BACKGROUND_SHARES: usize = 50;
/// How often a shard looks at the process-wide shutdown flag.
const SHUTDOWN_POLL: Duration = Duration::from_millis(5);
/// How long the completion poller spins after its last delivery.
const POLL_SPIN: Duration = Duration::from_micros(50);
/// Its sleep between polls once spinning stopped paying.
const POLL_BACKOFF: Duration = Duration::from_micros(20);
/// Sharing a core with the stage, the longest the poller sleeps on the
/// stage's bell before it looks for requests to give up on.
const BELL_WAIT_MAX: Duration = Duration::from_micros(200);
/// After shutdown, how long accept and read wait for what a client already
/// sent (a queued connection, bytes in the socket) before giving up: such
/// data is there at once, so this only bounds the wait for nothing.
const QUEUED_WAIT: Duration = Duration::from_millis(3);
/// First read buffer size per connection; grows up to one maximal frame.
const READ_BUFFER_BYTES_MIN: usize = 16 * 1024;

/// How each shard's reactor (its glommio executor) runs. The defaults are
/// tuned for latency on small VMs; docs/BENCHMARKS.md has their measured
/// effect.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReactorConfig {
    /// How long an idle reactor polls before it parks in the kernel. A
    /// parked vCPU takes tens of microseconds to wake; spinning this long
    /// after the last event keeps a shard under steady load awake between
    /// requests, at the cost of that much CPU per idle gap. 0 parks at once.
    pub spin_before_park_us: u64,
    /// How long one task queue runs before the reactor checks for I/O and
    /// other queues (glommio's preemption timer).
    pub preempt_timer_us: u64,
    /// A reactor turn longer than this is a stall: counted in
    /// `quiver_shard_stalls_total`, timed, and logged (rate-limited) with
    /// the task queue that ran. 0 turns the detector off.
    pub stall_threshold_us: u64,
    /// Cores for the threads that are not shards (admin, refresher, flusher,
    /// model watcher). Default: the online cores no shard or inference
    /// stage uses, or unpinned when there are none.
    pub housekeeping_cores: Option<Vec<usize>>,
    /// Every this many reads of a connection, read with the kernel's receive
    /// timestamps (`SO_TIMESTAMPNS`), so the wait in the socket before the
    /// shard read it is measured for the frames of that read (`socket_wait`
    /// in the stage histograms). A stamped read costs an extra syscall or
    /// two; 1 stamps every read, 0 none.
    pub socket_wait_every_reads: u32,
    /// Spread connections evenly over the shards: a shard serving two more
    /// than the least-loaded one hands a newly accepted connection to it.
    pub balance_connections: bool,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        ReactorConfig {
            spin_before_park_us: 50,
            preempt_timer_us: 100_000,
            stall_threshold_us: 500,
            housekeeping_cores: None,
            socket_wait_every_reads: 8,
            balance_connections: true,
        }
    }
}

/// What a server that is not ready does with traffic.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum NotReadyPolicy {
    /// Close new connections at once; requests on open ones get `Overloaded`.
    Refuse,
    /// Accept connections and answer every request `Overloaded`.
    Overloaded,
}

/// What one shard did, reported when it stops.
#[derive(Clone, Debug, Default)]
pub struct ShardReport {
    pub shard: usize,
    pub core: usize,
    pub connections_accepted: u64,
    pub connections_refused: u64,
    /// Accepted here and handed to a less loaded shard.
    pub connections_handed_over: u64,
    pub streams_rejected: u64,
    pub counters: Counters,
}

/// Where the server runs.
#[derive(Clone, Debug)]
pub struct ShardPlacement {
    pub listen: SocketAddr,
    pub cores: Vec<usize>,
    pub not_ready: NotReadyPolicy,
    pub reactor: ReactorConfig,
    /// Shard cores the inference thread also runs on. Such a shard never
    /// spins (not before parking, not waiting for completions): each cycle
    /// it spins is one the stage cannot use to answer it.
    pub stage_shares: Vec<usize>,
    /// The scoring port speaks TLS only, with this configuration.
    pub tls: Option<ListenerTls>,
}

/// Why the shards could not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("listen address '{listen}': {source}")]
    ListenAddress { listen: String, source: std::io::Error },
    #[error("listen address '{listen}' resolves to nothing")]
    ListenUnresolved { listen: String },
    /// Binding port 0 to learn which free port every shard will bind.
    #[error("{addr}: {source}")]
    FreePort { addr: SocketAddr, source: std::io::Error },
    #[error("starting shard {shard} on core {core}: {reason}")]
    Spawn { shard: usize, core: usize, reason: String },
    /// The first shard to fail (binding its listener, building its request
    /// path, starting its tasks, or while serving), in its own words, which
    /// name the shard.
    #[error("{reason}")]
    Shard { reason: String },
}

/// Resolves `listen`; a port of 0 is replaced by a free port, which every
/// shard then binds.
pub fn resolve_listen(listen: &str) -> Result<SocketAddr, ShardError> {
    let addr = listen
        .to_socket_addrs()
        .map_err(|source| ShardError::ListenAddress { listen: listen.to_string(), source })?
        .next()
        .ok_or_else(|| ShardError::ListenUnresolved { listen: listen.to_string() })?;
    if addr.port() != 0 {
        return Ok(addr);
    }
    let probe = std::net::TcpListener::bind(addr).map_err(|source| ShardError::FreePort { addr, source })?;
    probe.local_addr().map_err(|source| ShardError::FreePort { addr, source })
}

/// Runs one shard per core until `stop` is set, then drains and returns
/// each shard's report. `ready` is called once every shard listens.
pub fn serve(
    shared: Shared,
    placement: ShardPlacement,
    publishers: Vec<ShardPublisher>,
    stage_ends: Vec<ShardEnd>,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(SocketAddr),
) -> Result<Vec<ShardReport>, ShardError> {
    assert!(stage_ends.is_empty() || stage_ends.len() == placement.cores.len(), "one stage end per shard");
    assert_eq!(publishers.len(), placement.cores.len(), "one publisher per shard");
    let mut publishers = publishers.into_iter();
    let mut balances = balance::sides(
        placement.cores.len(),
        placement.reactor.balance_connections,
        shared.limits.connections_per_shard_max,
        shared.limits.connections_per_source_max,
    )
    .into_iter();
    let mut stage_ends: Vec<Option<ShardEnd>> = stage_ends.into_iter().map(Some).collect();
    stage_ends.resize_with(placement.cores.len(), || None);
    let (bound_tx, bound_rx) = mpsc::channel::<Result<(), String>>();
    let mut handles = Vec::new();
    for (shard, &core) in placement.cores.iter().enumerate() {
        let shared = shared.clone();
        let stop = stop.clone();
        let bound_tx = bound_tx.clone();
        let publisher = publishers.next().expect("one publisher per shard");
        let balance = balances.next().expect("one balance side per shard");
        let stage = stage_ends[shard].take();
        let (listen, not_ready) = (placement.listen, placement.not_ready);
        let stall_threshold_us = placement.reactor.stall_threshold_us;
        let socket_wait_every_reads = placement.reactor.socket_wait_every_reads;
        let shares_stage = placement.stage_shares.contains(&core);
        let tls = placement.tls.clone();
        let spin_us = if shares_stage { 0 } else { placement.reactor.spin_before_park_us };
        let handle = LocalExecutorBuilder::new(Placement::Fixed(core))
            .name(&format!("quiver-shard-{shard}"))
            .spin_before_park(Duration::from_micros(spin_us))
            .preempt_timer(Duration::from_micros(placement.reactor.preempt_timer_us.max(10)))
            .spawn(move || async move {
                let place = ShardPlace {
                    shard,
                    core,
                    listen,
                    not_ready,
                    stall_threshold_us,
                    socket_wait_every_reads,
                    shares_stage,
                    tls,
                };
                run_shard(place, shared, (publisher, balance), stage, stop, bound_tx).await
            })
            .map_err(|e| ShardError::Spawn { shard, core, reason: e.to_string() })?;
        handles.push(handle);
    }
    drop(bound_tx);
    let mut failure = None;
    for _ in 0..handles.len() {
        match bound_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failure = failure.or(Some(e)),
            Err(_) => failure = failure.or(Some("a shard exited before binding".to_string())),
        }
    }
    if failure.is_some() {
        stop.store(true, Ordering::SeqCst);
    } else {
        ready(placement.listen);
    }
    let mut reports = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(r)) => reports.push(r),
            Ok(Err(e)) => failure = failure.or(Some(e)),
            Err(e) => failure = failure.or(Some(format!("shard failed: {e}"))),
        }
    }
    match failure {
        Some(reason) => Err(ShardError::Shard { reason }),
        None => Ok(reports),
    }
}

/// Where one shard runs.
struct ShardPlace {
    shard: usize,
    core: usize,
    listen: SocketAddr,
    not_ready: NotReadyPolicy,
    stall_threshold_us: u64,
    socket_wait_every_reads: u32,
    /// The inference thread runs on this shard's core too.
    shares_stage: bool,
    tls: Option<ListenerTls>,
}

async fn run_shard(
    place: ShardPlace,
    shared: Shared,
    (publisher, balance): (ShardPublisher, ShardBalance),
    stage: Option<ShardEnd>,
    stop: Arc<AtomicBool>,
    bound_tx: mpsc::Sender<Result<(), String>>,
) -> Result<ShardReport, String> {
    let ShardPlace { shard, core, listen, not_ready, stall_threshold_us, socket_wait_every_reads, shares_stage, tls } =
        place;
    let stalls = Rc::new(StallMeter::new(stall_threshold_us));
    let limits = shared.limits.clone();
    let readiness = shared.readiness.clone();
    let path = match RequestPath::new(shared, MonotonicClock::new()) {
        Ok(mut p) => {
            p.set_shard(shard);
            Rc::new(RefCell::new(p))
        }
        Err(e) => {
            let _ = bound_tx.send(Err(e.to_string()));
            return Err(e.to_string());
        }
    };
    let listener = match TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            let msg = format!("shard {shard}: binding {listen}: {e}");
            let _ = bound_tx.send(Err(msg.clone()));
            return Err(msg);
        }
    };
    let _ = bound_tx.send(Ok(()));
    tracing::debug!(shard, core, %listen, backend = path.borrow().backend_name(), "shard listening");

    let shutdown = Rc::new(ShutdownSignal::default());
    let watcher = tasks::watcher(shard, stop, &shutdown, &path, &stalls);
    let active = Rc::new(Cell::new(0usize));
    // Taken out for the final publication when the shard stops.
    let publisher = Rc::new(RefCell::new(Some(publisher)));
    // Work that is not a request runs in a low-share task queue: while
    // connections have work, it gets a small part of the reactor's time.
    // (The watcher stays in the default queue: its timer's lateness is the
    // stall detector's measure of the reactor, not of this queue's turn.)
    let background = glommio::executor().create_task_queue(
        glommio::Shares::Static(BACKGROUND_SHARES),
        glommio::Latency::NotImportant,
        "background",
    );
    let publishing = tasks::publisher(shard, background, &path, &active, &shutdown, &publisher, &stalls)?;
    let report = Rc::new(RefCell::new(ShardReport { shard, core, ..ShardReport::default() }));
    let balance = Rc::new(balance);
    let shadow_wanted = Rc::new(Notify::default());
    let mailboxes = Rc::new(Mailboxes::new(stage.as_ref().map_or(0, ShardEnd::slots)));
    let submitted = Rc::new(Notify::default());
    let stage_attached = stage.is_some();
    if let Some(end) = stage {
        path.borrow_mut().attach_stage(end);
    }
    let poller = stage_attached.then(|| tasks::poller(&path, &mailboxes, &submitted, &stalls, shares_stage));
    let conns = Rc::new(Conns {
        shard,
        mailboxes: mailboxes.clone(),
        submitted: submitted.clone(),
        path: path.clone(),
        shutdown: shutdown.clone(),
        limits: limits.clone(),
        report: report.clone(),
        stalls: stalls.clone(),
        socket_wait_every_reads,
        active: active.clone(),
        balance: balance.clone(),
        shadow_wanted: shadow_wanted.clone(),
        handshakes: tls.as_ref().map(|t| {
            tls_stream::HandshakeBudget::new(t.handshakes_per_s_max, t.handshake_burst, MonotonicClock::new().now_ns())
        }),
        tls,
    });
    let shadowing = tasks::shadowing(shard, background, &path, &shadow_wanted, &shutdown, &stalls)?;
    let adopter = tasks::adopter(shard, background, &conns, &balance, &shutdown)?;
    accept::accept(listener, &conns, not_ready, &readiness).await;

    // Drain: connections finish the frames they already read, then close.
    let grace_ms = limits.shutdown_grace_ms;
    let clock = MonotonicClock::new();
    let drain_start_us = clock.now_us();
    while active.get() > 0 && clock.now_us() - drain_start_us < grace_ms * 1_000 {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
    if active.get() > 0 {
        tracing::warn!(shard, open = active.get(), "shutdown grace elapsed; closing connections");
    }
    drop(watcher);
    drop(adopter);
    drop(shadowing);
    drop(publishing);
    drop(poller);
    let mut p = path.borrow_mut();
    let mut counters = p.telemetry.counters.clone();
    stalls.drain_into(p.times_mut(), &mut counters);
    let open = p.breaker_state() != BreakerState::Closed;
    let versions = p.version_report();
    let publisher = publisher.borrow_mut().take().expect("only the shard's end takes the publisher");
    publisher.publish_final(p.times_mut(), &counters, open, versions);
    let mut r = report.borrow().clone();
    r.counters = counters;
    Ok(r)
}

/// Swaps in model versions the registry published, logging a failure.
fn refresh(path: &RefCell<RequestPath<MonotonicClock>>, shard: usize) {
    match path.borrow_mut().refresh_models() {
        Ok(true) => tracing::debug!(shard, "model versions refreshed"),
        Ok(false) => {}
        Err(e) => tracing::error!(shard, error = %e, "a published model cannot be served; keeping the old ones"),
    }
}
