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

mod balance;
mod mailbox;
mod shutdown;
mod stall;
mod stamped;
mod tls_stream;

use std::cell::{Cell, RefCell};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use futures_lite::io::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};

use serde::{Deserialize, Serialize};

use crate::deadline::{Clock, MonotonicClock};
use crate::infer::ShardEnd;
use crate::metrics::{self, ShardPublisher, StallTask};
use crate::request::ladder::BreakerState;
use crate::request::{response_frame_bytes_max, Counters, Handled, RequestPath, Shared};
use crate::wire::{self, FRAME_PREFIX_BYTES};
use balance::ShardBalance;
use mailbox::{Mailbox, Mailboxes, Notify};
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
    let watcher = glommio::spawn_local({
        let (shutdown, path, stalls) = (shutdown.clone(), path.clone(), stalls.clone());
        let clock = MonotonicClock::new();
        async move {
            while !stop.load(Ordering::Relaxed) {
                let due_ns = clock.now_ns() + SHUTDOWN_POLL.as_nanos() as u64;
                glommio::timer::sleep(SHUTDOWN_POLL).await;
                // This timer firing late is the one sign of a stall that no
                // task of ours caused.
                stalls.timer_fired(due_ns);
                // New model versions are usually picked up here, between
                // requests, rather than at the start of a read round; and
                // the shards trade configured clients' demand here (timed
                // with the model swap, as housekeeping).
                let t = stalls.start();
                refresh(&path, shard);
                path.borrow_mut().exchange_admission(clock.now_ns());
                stalls.end(StallTask::Refresh, t);
            }
            shutdown.trigger();
        }
    })
    .detach();

    let active = Rc::new(Cell::new(0usize));
    // Publish this shard's interval to the collector, off the request path.
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
    let publishing = glommio::spawn_local_into(
        {
            let (path, active, shutdown) = (path.clone(), active.clone(), shutdown.clone());
            let (publisher, stalls) = (publisher.clone(), stalls.clone());
            async move {
                while !shutdown.is_triggered() {
                    glommio::timer::sleep(crate::metrics::PUBLISH_INTERVAL).await;
                    let t = stalls.start();
                    let mut p = path.borrow_mut();
                    let mut counters = p.counters.clone();
                    let longest = stalls.drain_into(p.times_mut(), &mut counters);
                    let open = p.breaker_state() != BreakerState::Closed;
                    let versions = p.version_report();
                    if let Some(publisher) = publisher.borrow_mut().as_mut() {
                        publisher.publish(p.times_mut(), &counters, active.get() as u64, open, versions, longest);
                    }
                    drop(p);
                    stalls.end(StallTask::Publish, t);
                }
            }
        },
        background,
    )
    .map_err(|e| format!("shard {shard}: spawning the publisher: {e}"))?
    .detach();
    let report = Rc::new(RefCell::new(ShardReport { shard, core, ..ShardReport::default() }));
    let balance = Rc::new(balance);
    let shadow_wanted = Rc::new(Notify::default());
    let mailboxes = Rc::new(Mailboxes::default());
    let submitted = Rc::new(Notify::default());
    let stage_attached = stage.is_some();
    if let Some(end) = stage {
        path.borrow_mut().attach_stage(end);
    }
    // Hand-off mode: route completions to their connections. While requests
    // are in flight the poller yields between polls (bounded spinning: it
    // only spins while the stage owes this shard something); idle, it sleeps
    // until a connection submits.
    let poller = stage_attached.then(|| {
        let (path, mailboxes, submitted) = (path.clone(), mailboxes.clone(), submitted.clone());
        let stalls = stalls.clone();
        // Sharing its core with the stage, the poller sleeps on the stage's
        // bell instead of polling.
        let bell = if shares_stage { path.borrow_mut().take_stage_bell() } else { None };
        let mut bell = bell.map(|std| {
            // SAFETY: `into_raw_fd` hands over sole ownership of an open
            // socket, which the glommio stream now owns and closes.
            unsafe {
                <glommio::net::UnixStream as std::os::fd::FromRawFd>::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(
                    std,
                ))
            }
        });
        glommio::spawn_local(async move {
            let mut bytes = Vec::with_capacity(64 * 1024);
            let mut rung = [0u8; 64];
            let clock = MonotonicClock::new();
            let mut last_delivery_ns = 0;
            loop {
                let mut delivered = 0;
                let t = stalls.start();
                {
                    let mut p = path.borrow_mut();
                    while let Some((done, token)) = p.poll_stage() {
                        bytes.clear();
                        if let Some(conn) = p.complete(done, token, &mut bytes) {
                            mailboxes.deliver(conn, &bytes);
                            delivered += 1;
                        }
                    }
                    // Requests the stage is too slow for are answered from
                    // the lower rungs at their give-up time.
                    let now_ns = clock.now_ns();
                    p.give_up_overdue(now_ns, &mut |conn, response| {
                        mailboxes.deliver(conn, response);
                        delivered += 1;
                    });
                }
                stalls.end(StallTask::Poller, t);
                let now_ns = clock.now_ns();
                if delivered > 0 {
                    last_delivery_ns = now_ns;
                } else if path.borrow().in_flight() == 0 {
                    submitted.notified().await;
                    last_delivery_ns = clock.now_ns();
                } else if let Some(bell) = &mut bell {
                    if path.borrow().stage_will_wait() {
                        // Woken by the stage, or in time for the next give-up.
                        futures_lite::future::or(
                            async {
                                let _ = bell.read(&mut rung).await;
                            },
                            glommio::timer::sleep(BELL_WAIT_MAX),
                        )
                        .await;
                        path.borrow().stage_woke();
                    }
                } else if now_ns - last_delivery_ns < POLL_SPIN.as_nanos() as u64 {
                    futures_lite::future::yield_now().await;
                } else {
                    // The stage is slow to answer: stop spinning so a stage
                    // thread sharing this core gets to run.
                    glommio::timer::sleep(POLL_BACKOFF).await;
                }
            }
        })
        .detach()
    });
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
    // Sockets other shards handed over, adopted on a slow tick: connection
    // set-up is not latency-critical.
    // Shadow versions score sampled requests after their responses are out.
    let shadowing = glommio::spawn_local_into(
        {
            let (path, shadow_wanted, shutdown, stalls) =
                (path.clone(), shadow_wanted.clone(), shutdown.clone(), stalls.clone());
            async move {
                loop {
                    let wanted = futures_lite::future::or(
                        async {
                            shadow_wanted.notified().await;
                            true
                        },
                        async {
                            shutdown.wait().await;
                            false
                        },
                    )
                    .await;
                    if !wanted {
                        break;
                    }
                    let t = stalls.start();
                    path.borrow_mut().run_shadows();
                    stalls.end(StallTask::Shadow, t);
                }
            }
        },
        background,
    )
    .map_err(|e| format!("shard {shard}: spawning the shadow task: {e}"))?
    .detach();
    let adopter = glommio::spawn_local_into(
        {
            let (conns, balance, shutdown) = (conns.clone(), balance.clone(), shutdown.clone());
            async move {
                while !shutdown.is_triggered() {
                    glommio::timer::sleep(SHUTDOWN_POLL).await;
                    for balance::HandedOver { stream, source } in balance.adopt() {
                        // SAFETY: `into_raw_fd` hands over sole ownership of an
                        // open socket, which the glommio stream now owns.
                        let stream = unsafe { TcpStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(stream)) };
                        conns.spawn(stream, source);
                    }
                }
            }
        },
        background,
    )
    .map_err(|e| format!("shard {shard}: spawning the adopter: {e}"))?
    .detach();
    loop {
        // Once shutdown is triggered, connections already queued in the
        // backlog are still accepted (a client that saw the listening line
        // and connected gets its requests answered); then the listener closes.
        let closing = shutdown.is_triggered();
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            if closing {
                glommio::timer::sleep(QUEUED_WAIT).await;
            } else {
                shutdown.wait().await;
            }
            None
        })
        .await;
        let stream = match accepted {
            None if closing => break,
            None => continue,
            Some(Ok(s)) => s,
            Some(Err(e)) => {
                tracing::warn!(shard, error = %e, "accept failed");
                continue;
            }
        };
        if not_ready == NotReadyPolicy::Refuse && !readiness.is_ready() {
            report.borrow_mut().connections_refused += 1;
            drop(stream);
            continue;
        }
        let Ok(peer) = stream.peer_addr() else {
            // Reset before it was served: nothing to count.
            continue;
        };
        let source = balance::Source::of(peer.ip());
        match balance.place(source) {
            Err(refused) => {
                let mut path = path.borrow_mut();
                match refused {
                    balance::Refused::ShardFull => path.counters.connections_refused_shard_full += 1,
                    balance::Refused::SourceFull => path.counters.connections_refused_source_full += 1,
                }
                report.borrow_mut().connections_refused += 1;
                tracing::debug!(shard, ?refused, %peer, "connection limit reached; closing new connection");
                drop(stream);
            }
            Ok(balance::Placement::Here) => conns.spawn(stream, source),
            Ok(balance::Placement::There(to)) => {
                // SAFETY: dup of an open socket's fd; the new fd is owned
                // here and closed by its OwnedFd.
                let fd = unsafe { libc::dup(stream.as_raw_fd()) };
                if fd < 0 {
                    balance.keep_instead(to);
                    conns.spawn(stream, source);
                    continue;
                }
                // SAFETY: `fd` was just returned by dup and is owned by no one else.
                let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
                drop(stream);
                balance.hand_over(to, owned, source);
                report.borrow_mut().connections_handed_over += 1;
            }
        }
    }
    drop(listener);

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
    let mut counters = p.counters.clone();
    stalls.drain_into(p.times_mut(), &mut counters);
    let open = p.breaker_state() != BreakerState::Closed;
    let versions = p.version_report();
    let publisher = publisher.borrow_mut().take().expect("only the shard's end takes the publisher");
    publisher.publish_final(p.times_mut(), &counters, open, versions);
    let mut r = report.borrow().clone();
    r.counters = counters;
    Ok(r)
}

/// What woke a connection waiting between rounds.
enum Wake {
    /// Bytes read, and how long the newest of them waited in the socket.
    Read(std::io::Result<(usize, Option<u64>)>),
    Delivered,
    Shutdown,
    /// The frame partly read is not complete within `frame_timeout_ms`.
    FrameTimedOut,
}

/// Swaps in model versions the registry published, logging a failure.
fn refresh(path: &RefCell<RequestPath<MonotonicClock>>, shard: usize) {
    match path.borrow_mut().refresh_models() {
        Ok(true) => tracing::debug!(shard, "model versions refreshed"),
        Ok(false) => {}
        Err(e) => tracing::error!(shard, error = %e, "a published model cannot be served; keeping the old ones"),
    }
}

/// What a shard needs to start serving a connection, accepted or handed over.
struct Conns {
    shard: usize,
    mailboxes: Rc<Mailboxes>,
    submitted: Rc<Notify>,
    path: Rc<RefCell<RequestPath<MonotonicClock>>>,
    shutdown: Rc<ShutdownSignal>,
    limits: crate::request::Limits,
    report: Rc<RefCell<ShardReport>>,
    stalls: Rc<StallMeter>,
    socket_wait_every_reads: u32,
    active: Rc<Cell<usize>>,
    balance: Rc<ShardBalance>,
    /// Wakes the shard's shadow task.
    shadow_wanted: Rc<Notify>,
    tls: Option<ListenerTls>,
    /// With `tls`: the new handshakes this shard may start.
    handshakes: Option<tls_stream::HandshakeBudget>,
}

impl Conns {
    /// Serves `stream` on this shard until it closes. Its place in the
    /// balance counts was taken when it was placed here.
    fn spawn(self: &Rc<Self>, stream: TcpStream, source: balance::Source) {
        self.report.borrow_mut().connections_accepted += 1;
        self.active.set(self.active.get() + 1);
        let conn = Connection { shard: self.clone() };
        let this = self.clone();
        glommio::spawn_local(async move {
            if let Err(e) = conn.serve(stream).await {
                let mut path = this.path.borrow_mut();
                match e.get_ref().and_then(|inner| inner.downcast_ref::<TimedOut>()) {
                    Some(TimedOut::Frame) => path.counters.frames_timed_out += 1,
                    Some(TimedOut::Write) => path.counters.writes_timed_out += 1,
                    None => {}
                }
                tracing::debug!(shard = this.shard, error = %e, "connection closed");
            }
            this.active.set(this.active.get() - 1);
            this.balance.closed(source);
        })
        .detach();
    }
}

/// Why a connection was closed for time: a frame not complete within
/// `frame_timeout_ms` of its first byte, or a round's responses not taken
/// within `write_timeout_ms`.
#[derive(Debug, thiserror::Error)]
enum TimedOut {
    #[error("frame not complete within frame_timeout_ms of its first byte")]
    Frame,
    #[error("responses not taken within write_timeout_ms")]
    Write,
}

impl From<TimedOut> for std::io::Error {
    fn from(t: TimedOut) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::TimedOut, t)
    }
}

/// A connection's bytes: the socket's own, or decrypted from TLS.
enum Transport {
    Plain(TcpStream),
    Tls(Box<tls_stream::TlsStream>),
}

impl Transport {
    fn tcp(&self) -> &TcpStream {
        match self {
            Transport::Plain(s) => s,
            Transport::Tls(s) => s.tcp(),
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Transport::Plain(s) => s.write_all(buf).await,
            Transport::Tls(s) => s.write_all(buf).await,
        }
    }
}

/// One connection being served: what it needs is its shard's.
struct Connection {
    shard: Rc<Conns>,
}

impl Connection {
    async fn serve(self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nodelay(true)?;
        let mut stream = match &self.shard.tls {
            None => Transport::Plain(stream),
            Some(tls) => {
                let within = self.shard.handshakes.as_ref().is_none_or(|b| b.take(MonotonicClock::new().now_ns()));
                if !within {
                    self.shard.path.borrow_mut().counters.tls_handshakes_refused += 1;
                    return Err(std::io::Error::other("over tls.handshakes_per_s_max: closed before the handshake"));
                }
                let handshake = self.handshake(stream, tls).await;
                let mut path = self.shard.path.borrow_mut();
                match handshake {
                    Ok(s) => {
                        path.counters.tls_handshakes += 1;
                        Transport::Tls(Box::new(s))
                    }
                    Err(e) => {
                        path.counters.tls_handshake_failures += 1;
                        return Err(e);
                    }
                }
            }
        };
        let (id, mailbox) = self.shard.mailboxes.open();
        let result = self.serve_rounds(&mut stream, id, &mailbox).await;
        // Collect every response the stage still owes this connection (each
        // ends by its deadline), write what can be written, then close.
        let mut rest = Vec::new();
        mailbox.take_into(&mut rest);
        while mailbox.pending() > 0 {
            // `delivered` resolves while undelivered bytes wait in the
            // mailbox, so move them out before waiting for the next one.
            mailbox.delivered().await;
            mailbox.take_into(&mut rest);
        }
        self.shard.mailboxes.close(id);
        if result.is_ok() && !rest.is_empty() {
            self.write_within(&mut stream, &rest).await?;
        }
        result
    }

    /// Writes `buf` whole within `write_timeout_ms`, however slowly the
    /// client reads (the socket's own timeout is per write call).
    async fn write_within(&self, stream: &mut Transport, buf: &[u8]) -> std::io::Result<()> {
        let limit = Duration::from_millis(self.shard.limits.write_timeout_ms);
        futures_lite::future::or(stream.write_all(buf), async {
            glommio::timer::sleep(limit).await;
            Err(TimedOut::Write.into())
        })
        .await
    }

    /// A TLS handshake on `stream`, within the configured time (the whole
    /// handshake, however the client trickles its bytes).
    async fn handshake(&self, stream: TcpStream, tls: &ListenerTls) -> std::io::Result<tls_stream::TlsStream> {
        let timeout = tls.handshake_timeout;
        futures_lite::future::or(tls_stream::TlsStream::accept(stream, tls.config.clone()), async {
            glommio::timer::sleep(timeout).await;
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))
        })
        .await
    }

    /// Reads what the socket has, waiting for it if need be; with socket
    /// timestamps, also how long the newest bytes waited in the socket.
    async fn read(
        &self,
        stream: &mut Transport,
        buf: &mut [u8],
        stamps: bool,
    ) -> std::io::Result<(usize, Option<u64>)> {
        let stream = match stream {
            Transport::Plain(s) => s,
            Transport::Tls(s) => return s.read(buf).await.map(|n| (n, None)),
        };
        let waited = |stamp: Option<u64>| stamp.map(|s| stamped::realtime_ns().saturating_sub(s));
        if !stamps || buf.len() < 2 {
            return stream.read(buf).await.map(|n| (n, None));
        }
        if let Some((n, stamp)) = stamped::try_recv(stream, buf)? {
            return Ok((n, waited(stamp)));
        }
        // Wait through the runtime's own read path for one byte, then take
        // the rest of what arrived with its stamp. (Waiting by a peek costs
        // more: io_uring may hand a pending receive to a worker thread.)
        let n = stream.read(&mut buf[..1]).await?;
        if n == 0 {
            return Ok((0, None));
        }
        match stamped::try_recv(stream, &mut buf[1..])? {
            Some((m, stamp)) => Ok((1 + m, waited(stamp))),
            None => Ok((1, None)),
        }
    }

    async fn serve_rounds(&self, stream: &mut Transport, id: u32, mailbox: &Mailbox) -> std::io::Result<()> {
        // Admission binds client ids to it; an unknown peer matches no network.
        let source = stream.tcp().peer_addr().map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
        // And to the names of a verified client certificate (mutual TLS).
        let tls_names = match &*stream {
            Transport::Tls(s) => s.peer_names(),
            Transport::Plain(_) => Vec::new(),
        };
        let peer = crate::request::admission::Peer { addr: source, tls_names: &tls_names };
        let every = self.shard.socket_wait_every_reads;
        // The kernel's stamps would be of ciphertext: TLS reads go unstamped.
        let stamps = every > 0 && matches!(stream, Transport::Plain(_)) && stamped::enable(stream.tcp()).is_ok();
        // How long the bytes of the last read waited in the socket, when it
        // was a stamped one; reads since the last stamped one.
        let mut socket_wait_ns: Option<u64> = None;
        let mut reads = 0u32;
        // When the frame now partly buffered began to arrive: the read
        // time of the round that first held its bytes.
        let clock = MonotonicClock::new();
        let frame_timeout_ns = self.shard.limits.frame_timeout_ms * 1_000_000;
        let mut frame_started_ns: Option<u64> = None;
        let mut round_ns;
        stream.tcp().set_read_timeout(Some(Duration::from_millis(self.shard.limits.idle_timeout_ms)))?;
        // No per-call write timeout: `write_within` bounds each round's
        // write as a whole.
        let frame_bytes_max = self.shard.limits.frame_bytes_max;
        let read_bytes_max = frame_bytes_max + FRAME_PREFIX_BYTES;
        let mut inbuf = vec![0u8; READ_BUFFER_BYTES_MIN.min(read_bytes_max)];
        let mut filled = 0usize;
        let out_cap = self.shard.limits.output_bytes_max + response_frame_bytes_max(self.shard.limits.candidates_max);
        let mut out = Vec::with_capacity(out_cap.min(1 << 20));
        loop {
            // Answer the complete frames already buffered, up to the output
            // cap and `frames_per_round_max`.
            let mut consumed = 0;
            let mut frames = 0;
            let mut broken = false;
            let t = self.shard.stalls.start();
            refresh(&self.shard.path, self.shard.shard);
            self.shard.stalls.end(StallTask::Refresh, t);
            let mut handed_off = false;
            let t = self.shard.stalls.start();
            {
                let mut path = self.shard.path.borrow_mut();
                let read_at_ns = path.clock().now_ns();
                round_ns = read_at_ns;
                while out.len() < self.shard.limits.output_bytes_max && frames < self.shard.limits.frames_per_round_max
                {
                    match wire::split_frame(&inbuf[consumed..filled], frame_bytes_max) {
                        Ok(Some((payload, used))) => {
                            frames += 1;
                            if let Some(wait_ns) = socket_wait_ns {
                                path.times_mut().record_ns(metrics::Stage::SocketWait, wait_ns);
                            }
                            if path.handle(payload, read_at_ns, id, peer, &mut out) == Handled::Pending {
                                mailbox.expect();
                                handed_off = true;
                            }
                            consumed += used;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            path.reject_stream(&e, &mut out);
                            self.shard.report.borrow_mut().streams_rejected += 1;
                            broken = true;
                            break;
                        }
                    }
                }
            }
            if handed_off {
                self.shard.submitted.notify();
            }
            inbuf.copy_within(consumed..filled, 0);
            filled -= consumed;
            mailbox.take_into(&mut out);
            self.shard.stalls.end(StallTask::Connection, t);
            if !out.is_empty() {
                self.write_within(stream, &out).await?;
                out.clear();
            }
            // A partial frame's clock starts with the round that first held
            // it and keeps running until the frame is complete.
            frame_started_ns = match (filled, consumed) {
                (0, _) => None,
                (_, 0) => frame_started_ns.or(Some(round_ns)),
                _ => Some(round_ns),
            };
            if broken {
                return Ok(());
            }
            if consumed > 0 && wire::split_frame(&inbuf[..filled], frame_bytes_max).is_ok_and(|f| f.is_some()) {
                // More frames wait: let the shard's other work run first.
                futures_lite::future::yield_now().await;
                continue;
            }
            // Responses are written and no frame waits: shadows may run.
            if self.shard.path.borrow().shadows_pending() {
                self.shard.shadow_wanted.notify();
            }
            let closing = self.shard.shutdown.is_triggered();
            // Make room for the rest of a frame whose prefix we have seen.
            if filled == inbuf.len() {
                let grown = (inbuf.len() * 2).min(read_bytes_max);
                assert!(grown > inbuf.len(), "a complete frame always fits the buffer");
                inbuf.resize(grown, 0);
            }
            // Draining, the connection still reads what the client already
            // sent (it is in the socket at once) and answers it; it closes
            // when nothing more arrives within `QUEUED_WAIT`.
            let read = futures_lite::future::or(
                async {
                    Wake::Read(self.read(stream, &mut inbuf[filled..], stamps && reads.is_multiple_of(every)).await)
                },
                async {
                    futures_lite::future::or(
                        async {
                            if closing {
                                glommio::timer::sleep(QUEUED_WAIT).await;
                            } else {
                                self.shard.shutdown.wait().await;
                            }
                            Wake::Shutdown
                        },
                        futures_lite::future::or(
                            async {
                                mailbox.delivered().await;
                                Wake::Delivered
                            },
                            async {
                                let Some(started_ns) = frame_started_ns else {
                                    return std::future::pending().await;
                                };
                                let due_ns = started_ns + frame_timeout_ns;
                                glommio::timer::sleep(Duration::from_nanos(due_ns.saturating_sub(clock.now_ns())))
                                    .await;
                                Wake::FrameTimedOut
                            },
                        ),
                    )
                    .await
                },
            )
            .await;
            match read {
                // Responses the stage still owes are collected by `serve`.
                Wake::Shutdown if closing => return Ok(()),
                Wake::Shutdown => {}
                Wake::Delivered => {}
                Wake::Read(Ok((0, _))) => return Ok(()),
                Wake::FrameTimedOut => return Err(TimedOut::Frame.into()),
                Wake::Read(Ok((n, wait_ns))) => {
                    filled += n;
                    socket_wait_ns = wait_ns;
                    reads = reads.wrapping_add(1);
                }
                Wake::Read(Err(e)) => return Err(e),
            }
        }
    }
}
