//! Per-shard metrics, and how they cross to the admin thread.
//!
//! Each shard records stage latencies into its own HdrHistograms and counts
//! into plain integers: nothing on the request path is shared or locked.
//! Once per `PUBLISH_INTERVAL` a shard timer (off the request path) hands
//! its interval to the collector thread over a bounded channel
//! ([`ShardPublisher`]) and takes an empty set of histograms back from it:
//! the shard never merges, allocates or waits, and takes no lock. The
//! collector folds each interval into that shard's [`Publication`] (totals
//! and a sliding window); the admin thread merges the slots on read. Those
//! slot mutexes are taken only by the collector and the admin side, so a
//! scrape can never hold up a shard. Drift counts (`crate::drift`) travel
//! the same way: per served version, one interval a publication.

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::drift::{self, Interval, VersionWindow, WindowTotals};
use crate::model::Model;

/// Priority bands: by bit length, 0 and 1 alone, then 2–3 … 128–255. The
/// shed-by-band counters' label set, so it lives with the counters and
/// `request::shed` (which re-exports it) sits above them, not beside.
pub const BANDS: usize = 9;

/// The band of `priority`.
pub fn band(priority: u8) -> usize {
    (u8::BITS - priority.leading_zeros()) as usize
}

/// A band's priorities, for metric labels.
pub fn band_name(band: usize) -> &'static str {
    ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255"][band.min(BANDS - 1)]
}

/// How often shards publish their interval.
pub const PUBLISH_INTERVAL: Duration = Duration::from_secs(1);
/// Intervals in the sliding window behind the percentile gauges.
pub const WINDOW_INTERVALS: usize = 10;

/// Stages of the request path that are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// From the frame's read to a verified request (includes waiting behind
    /// earlier frames of the same read).
    Decode,
    /// Feature lookups and assembling the model input.
    Lookup,
    /// Waiting in the inference stage's queue (hand-off mode only).
    Queue,
    /// A shadow version's forward pass, after the response was written.
    Shadow,
    /// The backend's forward pass.
    Kernel,
    /// Encoding the response.
    Respond,
    /// From the frame's read to the encoded response.
    EndToEnd,
    /// Before the frame's read: from the kernel's receive of the newest
    /// bytes of that read to the read, for a sample of reads
    /// (`reactor.socket_wait_every_reads`).
    SocketWait,
}

pub const STAGES: [Stage; 8] = [
    Stage::SocketWait,
    Stage::Decode,
    Stage::Lookup,
    Stage::Queue,
    Stage::Kernel,
    Stage::Respond,
    Stage::EndToEnd,
    Stage::Shadow,
];

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Decode => "decode",
            Stage::Lookup => "lookup",
            Stage::Queue => "queue",
            Stage::Shadow => "shadow",
            Stage::Kernel => "kernel",
            Stage::Respond => "respond",
            Stage::EndToEnd => "end_to_end",
            Stage::SocketWait => "socket_wait",
        }
    }
}

/// Latency histograms record nanoseconds, 100 ns to 10 s, 2 significant
/// digits (1% resolution): about 22 KB each, so a shard's whole set is
/// cheap to hand over and to merge. Shorter values count as 100 ns, longer
/// ones as 10 s.
pub fn stage_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(100, 10_000_000_000, 2).expect("static bounds are valid")
}

/// Index of the reactor-stall lengths in a set of histograms, after the
/// stages (each shard's stall detector measures them; they are not a
/// request stage).
pub const STALL: usize = STAGES.len();
/// Histograms in one set: the stages, then stalls.
pub const HISTOGRAMS: usize = STAGES.len() + 1;

fn histogram_set() -> Vec<Histogram<u64>> {
    (0..HISTOGRAMS).map(|_| stage_histogram()).collect()
}

/// A shard's stage timings for the current interval. Shard-local: it lives
/// inside the shard's `RequestPath`, which is `!Send`.
pub struct StageTimes {
    interval: Vec<Histogram<u64>>,
}

impl Default for StageTimes {
    fn default() -> Self {
        StageTimes { interval: histogram_set() }
    }
}

impl StageTimes {
    /// A reactor stall of `ns`.
    #[inline]
    pub fn record_stall_ns(&mut self, ns: u64) {
        self.interval[STALL].saturating_record(ns.max(1));
    }

    /// Adds stall lengths measured elsewhere on the shard.
    pub fn add_stalls(&mut self, stalls: &Histogram<u64>) {
        self.interval[STALL].add(stalls).expect("same bounds");
    }

    #[inline]
    pub fn record_us(&mut self, stage: Stage, us: u64) {
        self.interval[stage as usize].saturating_record(us.saturating_mul(1_000).max(1));
    }

    #[inline]
    pub fn record_ns(&mut self, stage: Stage, ns: u64) {
        self.interval[stage as usize].saturating_record(ns.max(1));
    }
}

/// What one shard has published: totals since start, and a window of recent
/// intervals for percentiles.
#[derive(Debug)]
pub struct Publication {
    pub shard: usize,
    pub counters: Counters,
    pub total: Vec<Histogram<u64>>,
    pub window: VecDeque<Vec<Histogram<u64>>>,
    pub connections_active: u64,
    /// The shard's primary breaker is not closed.
    pub breaker_open: bool,
    /// Requests by served version: (model, version, canary, count, backend).
    pub versions: Vec<(String, u32, bool, u64, &'static str)>,
    /// Drift counts of the calibrated versions served, the last
    /// `drift.window_s` intervals each.
    pub drift: Vec<VersionWindow>,
}

/// What a shard publishes about the versions it serves.
#[derive(Debug, Default)]
pub struct VersionReport {
    /// Requests by served version: (model, version, canary, count, and the
    /// name of the backend that scores it on this shard).
    pub counts: Vec<(String, u32, bool, u64, &'static str)>,
    /// This interval's drift counts of each calibrated version served.
    pub drift: Vec<(Arc<Model>, Interval)>,
    /// How many intervals the drift window keeps.
    pub drift_intervals: usize,
}

impl Publication {
    pub fn new(shard: usize) -> Publication {
        Publication {
            shard,
            counters: Counters::default(),
            total: histogram_set(),
            window: VecDeque::with_capacity(WINDOW_INTERVALS + 1),
            connections_active: 0,
            breaker_open: false,
            versions: Vec::new(),
            drift: Vec::new(),
        }
    }
}

/// The transports of the v2 front end, as `quiver_oip_requests_total`
/// labels them.
pub const OIP_PROTOCOLS: [&str; 2] = ["grpc", "http"];
/// The outcomes of a v2 inference request: "ok", or the protocol's status
/// class of its error (gRPC's code names; HTTP maps them to 400, 404, 413 or
/// 429, 503, 504, 500).
pub const OIP_STATUSES: [&str; 7] =
    ["ok", "invalid_argument", "not_found", "resource_exhausted", "unavailable", "deadline_exceeded", "internal"];

/// The v2 front end's inference requests (`src/oip/`) by transport and
/// outcome, for `quiver_oip_requests_total{protocol,status}`: the front
/// end's threads count, `/metrics` reads. Only requests that reach the
/// handler are counted (one tonic refuses for its size is not).
#[derive(Debug, Default)]
pub struct OipCounters {
    by: [[std::sync::atomic::AtomicU64; OIP_STATUSES.len()]; OIP_PROTOCOLS.len()],
}

impl OipCounters {
    /// Counts one request of `protocol` (an index of [`OIP_PROTOCOLS`]) that
    /// ended with `status` (an index of [`OIP_STATUSES`]).
    pub fn count(&self, protocol: usize, status: usize) {
        if let Some(c) = self.by.get(protocol).and_then(|p| p.get(status)) {
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub fn get(&self, protocol: usize, status: usize) -> u64 {
        self.by.get(protocol).and_then(|p| p.get(status)).map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Whether the server takes traffic. Set once every shard listens; an
/// operator can take the server out of rotation (drain) and back through the
/// admin endpoint. Read on the request path with one relaxed load: it
/// changes rarely, so its cache line stays shared and clean.
#[derive(Debug)]
pub struct Readiness {
    ready: std::sync::atomic::AtomicBool,
    /// The Redis feed, when there is one: its staleness can fail `/readyz`
    /// (by config) without stopping the shards from serving.
    feed: std::sync::OnceLock<Arc<crate::features::feed::FeedStatus>>,
}

impl Readiness {
    pub fn not_ready() -> Readiness {
        Readiness { ready: std::sync::atomic::AtomicBool::new(false), feed: std::sync::OnceLock::new() }
    }

    pub fn ready() -> Readiness {
        Readiness { ready: std::sync::atomic::AtomicBool::new(true), feed: std::sync::OnceLock::new() }
    }

    #[inline]
    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set(&self, ready: bool) {
        self.ready.store(ready, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn attach_feed(&self, feed: Arc<crate::features::feed::FeedStatus>) {
        let _ = self.feed.set(feed);
    }

    pub fn feed(&self) -> Option<&crate::features::feed::FeedStatus> {
        self.feed.get().map(|f| &**f)
    }

    /// What `/readyz` answers: taking traffic, and features not stale past
    /// the bound when the feed's policy says that should fail readiness.
    pub fn probe(&self, now_ns: u64) -> Result<(), &'static str> {
        if !self.is_ready() {
            return Err("not ready");
        }
        if self.feed().is_some_and(|f| f.blocks_readiness(now_ns)) {
            return Err("not ready: features stale");
        }
        Ok(())
    }
}

/// The publication slots of all shards, shared by the collector and the
/// admin thread (never by a shard).
pub type Board = Arc<Vec<Mutex<Publication>>>;

pub fn board(shards: usize) -> Board {
    Arc::new((0..shards).map(|s| Mutex::new(Publication::new(s))).collect())
}

/// One shard's interval on its way to the collector.
pub struct Report {
    pub shard: usize,
    pub times: Vec<Histogram<u64>>,
    pub counters: Counters,
    pub connections_active: u64,
    pub breaker_open: bool,
    pub versions: VersionReport,
    /// The interval's longest stall, for the collector's log line.
    pub longest_stall: Option<(StallTask, u64)>,
}

/// Reports in flight to the collector, per shard: a collector that falls this
/// far behind makes shards skip publications (their intervals grow), never
/// wait.
const REPORTS_IN_FLIGHT_PER_SHARD: usize = 2;
/// Empty histogram sets a shard holds for its next publications: one is
/// swapped in at each, and the collector returns the window's oldest.
const SPARE_SETS_PER_SHARD: usize = 2;

/// A shard's end of the publication channel. Lives on the shard.
pub struct ShardPublisher {
    shard: usize,
    reports: SyncSender<Report>,
    spares: Receiver<Vec<Histogram<u64>>>,
    /// Publications skipped because the collector was behind or had not
    /// returned a histogram set yet.
    pub skipped: u64,
}

impl ShardPublisher {
    /// Hands the interval to the collector, swapping in an empty set. When
    /// no empty set is at hand or the channel is full the interval keeps
    /// growing until the next publication: nothing blocks, nothing is lost.
    pub fn publish(
        &mut self,
        times: &mut StageTimes,
        counters: &Counters,
        connections_active: u64,
        breaker_open: bool,
        versions: VersionReport,
        longest_stall: Option<(StallTask, u64)>,
    ) {
        let Ok(spare) = self.spares.try_recv() else {
            self.skipped += 1;
            return;
        };
        let taken = std::mem::replace(&mut times.interval, spare);
        let report = Report {
            shard: self.shard,
            times: taken,
            counters: counters.clone(),
            connections_active,
            breaker_open,
            versions,
            longest_stall,
        };
        match self.reports.try_send(report) {
            Ok(()) => {}
            Err(TrySendError::Full(r) | TrySendError::Disconnected(r)) => {
                // Put the interval back (the spare was empty): it carries on.
                let spare = std::mem::replace(&mut times.interval, r.times);
                debug_assert!(spare.iter().all(|h| h.is_empty()));
                self.skipped += 1;
            }
        }
    }

    /// The last publication, as a shard stops: waits for room, so the final
    /// counts reach the board.
    pub fn publish_final(
        self,
        times: &mut StageTimes,
        counters: &Counters,
        breaker_open: bool,
        versions: VersionReport,
    ) {
        let taken = std::mem::replace(&mut times.interval, histogram_set());
        let report = Report {
            shard: self.shard,
            times: taken,
            counters: counters.clone(),
            connections_active: 0,
            breaker_open,
            versions,
            longest_stall: None,
        };
        let _ = self.reports.send(report);
    }
}

/// The collector thread: folds shard reports into the board.
pub struct Collector {
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Collector {
    /// Starts the collector for `board` and returns one publisher per shard.
    pub fn start(board: Board) -> std::io::Result<(Collector, Vec<ShardPublisher>)> {
        let shards = board.len();
        let (reports_tx, reports_rx) = mpsc::sync_channel::<Report>(shards.max(1) * REPORTS_IN_FLIGHT_PER_SHARD);
        let mut publishers = Vec::with_capacity(shards);
        let mut spare_txs = Vec::with_capacity(shards);
        for shard in 0..shards {
            // Room for every set that can be away from the shard at once.
            let (tx, rx) = mpsc::sync_channel(SPARE_SETS_PER_SHARD + REPORTS_IN_FLIGHT_PER_SHARD + WINDOW_INTERVALS);
            for _ in 0..SPARE_SETS_PER_SHARD {
                tx.send(histogram_set()).expect("the receiver is alive");
            }
            spare_txs.push(tx);
            publishers.push(ShardPublisher { shard, reports: reports_tx.clone(), spares: rx, skipped: 0 });
        }
        drop(reports_tx);
        let thread = std::thread::Builder::new().name("quiver-metrics".into()).spawn(move || {
            // Ends when every shard's publisher is gone.
            for report in reports_rx {
                let shard = report.shard;
                // The shard only counts its stalls; saying so is I/O, done
                // here, at most one line per shard per publication.
                if let Some((task, ns)) = report.longest_stall {
                    let before = board[shard].lock().unwrap_or_else(|e| e.into_inner()).counters.stalls();
                    let stalls = report.counters.stalls().saturating_sub(before);
                    tracing::warn!(
                        shard,
                        stalls,
                        longest_us = ns / 1_000,
                        task = task.name(),
                        "reactor stalls in the last interval"
                    );
                }
                let back = fold(report, &board[shard]);
                // A shard that has stopped no longer takes sets back.
                let _ = spare_txs[shard].try_send(back);
            }
        })?;
        Ok((Collector { thread: Some(thread) }, publishers))
    }

    /// Waits until every publisher is dropped and the last report folded.
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Folds one report into its shard's slot and returns an empty histogram set
/// for the shard's next interval (the window's oldest, reset, once the
/// window is full).
pub fn fold(report: Report, slot: &Mutex<Publication>) -> Vec<Histogram<u64>> {
    let Report { times, counters, connections_active, breaker_open, versions, .. } = report;
    let mut p = slot.lock().unwrap_or_else(|e| e.into_inner());
    for (total, h) in p.total.iter_mut().zip(&times) {
        total.add(h).expect("same bounds");
    }
    p.window.push_back(times);
    let back = if p.window.len() > WINDOW_INTERVALS {
        let mut oldest = p.window.pop_front().expect("window is full");
        oldest.iter_mut().for_each(Histogram::reset);
        oldest
    } else {
        histogram_set()
    };
    p.counters = counters;
    p.connections_active = connections_active;
    p.breaker_open = breaker_open;
    p.versions = versions.counts;
    drift::push_intervals(&mut p.drift, versions.drift, versions.drift_intervals);
    back
}

/// All shards merged, as the admin thread sees them.
pub struct Merged {
    pub counters: Counters,
    pub total: Vec<Histogram<u64>>,
    pub window: Vec<Histogram<u64>>,
    pub connections_active: u64,
    pub shards: usize,
    pub breakers_open: usize,
    /// Requests by (model, version, canary), summed over shards.
    pub versions: std::collections::BTreeMap<(String, u32, bool), u64>,
    /// The backend scoring each served version (the last shard's, should
    /// shards differ: they build the same backend for a version).
    pub backends: std::collections::BTreeMap<(String, u32, bool), &'static str>,
    /// Drift windows summed over shards, per calibrated version.
    pub drift: Vec<WindowTotals>,
    /// Each shard's reactor stalls by task, in shard order.
    pub stalls_by_shard: Vec<[u64; STALL_TASKS]>,
    /// Each shard's open connections, in shard order.
    pub connections_by_shard: Vec<u64>,
}

pub fn merge(board: &Board) -> Merged {
    let mut m = Merged {
        counters: Counters::default(),
        total: histogram_set(),
        window: histogram_set(),
        connections_active: 0,
        shards: board.len(),
        breakers_open: 0,
        versions: Default::default(),
        backends: Default::default(),
        drift: Vec::new(),
        stalls_by_shard: Vec::with_capacity(board.len()),
        connections_by_shard: Vec::with_capacity(board.len()),
    };
    for slot in board.iter() {
        let p = slot.lock().unwrap_or_else(|e| e.into_inner());
        m.counters.add(&p.counters);
        m.stalls_by_shard.push(p.counters.stalls_by_task);
        m.connections_by_shard.push(p.connections_active);
        m.connections_active += p.connections_active;
        m.breakers_open += usize::from(p.breaker_open);
        for (name, version, canary, n, backend) in &p.versions {
            *m.versions.entry((name.clone(), *version, *canary)).or_default() += n;
            m.backends.insert((name.clone(), *version, *canary), backend);
        }
        for w in &p.drift {
            drift::add_window(&mut m.drift, w);
        }
        for (dst, src) in m.total.iter_mut().zip(&p.total) {
            dst.add(src).expect("same bounds");
        }
        for interval in &p.window {
            for (dst, src) in m.window.iter_mut().zip(interval) {
                dst.add(src).expect("same bounds");
            }
        }
    }
    m
}

/// Step-down reasons counted (`Reason` values 0..=4).
pub const REASONS: usize = 5;

/// Per-shard counters, plain integers: only the owning shard touches them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub requests: u64,
    /// Indexed by `Status.0`.
    pub by_status: [u64; 8],
    /// Indexed by `Tier.0`, for `Ok` responses.
    pub by_tier: [u64; 4],
    /// Indexed by `Reason.0`, for `Ok` responses.
    pub by_reason: [u64; REASONS],
    pub features_missing: u64,
    /// Ok responses flagged `features_stale`.
    pub stale_responses: u64,
    pub candidates_scored: u64,
    /// Reason codes: candidates explained, and requests that asked but
    /// whose time left could not fit the explainer's measured cost.
    pub explained_candidates: u64,
    pub explain_skipped_budget: u64,
    /// Requests also scored by a shadow version, with the sums of their mean
    /// absolute score difference and rank correlation, in millionths.
    pub shadow_requests: u64,
    pub shadow_abs_diff_ppm: u64,
    pub shadow_rank_corr_ppm: i64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Requests shed, by priority band (`shed::band`).
    pub shed_by_band: [u64; BANDS],
    /// The shed level in thousandths of a band: a gauge, merged as the
    /// highest over shards.
    pub shed_level_milli: u64,
    /// Reactor stalls over `reactor.stall_threshold_us`, by the task that
    /// ran (`StallTask`).
    pub stalls_by_task: [u64; STALL_TASKS],
    /// Requests refused for naming a client bound to other source networks.
    pub admission_wrong_source: u64,
    /// TLS handshakes of the scoring port completed, and failed (a bad or
    /// untrusted certificate, a plain-TCP client, a stalled handshake).
    pub tls_handshakes: u64,
    pub tls_handshake_failures: u64,
    /// New TLS connections closed before their handshake: over the shard's
    /// `tls.handshakes_per_s_max`.
    pub tls_handshakes_refused: u64,
    /// Backends of newly served versions: taken ready-built from the
    /// registry, and built on the shard's reactor (start-up, or a version
    /// the registry did not build ahead).
    pub backends_prebuilt: u64,
    pub backends_built_on_shard: u64,
    /// Decisions put in the shard's decision-log ring, and dropped before
    /// it: the ring full (the writer behind), or a record over half of it.
    pub log_records: u64,
    pub log_dropped_ring_full: u64,
    pub log_dropped_too_large: u64,
    /// New connections closed at once: the serving shard was at
    /// `connections_per_shard_max`, or the source at
    /// `connections_per_source_max`.
    pub connections_refused_shard_full: u64,
    pub connections_refused_source_full: u64,
    /// Connections closed for a frame not complete within
    /// `frame_timeout_ms`, or responses not taken within `write_timeout_ms`.
    pub frames_timed_out: u64,
    pub writes_timed_out: u64,
}

impl Counters {
    pub fn add(&mut self, other: &Counters) {
        self.requests += other.requests;
        for (a, b) in self.by_status.iter_mut().zip(&other.by_status) {
            *a += b;
        }
        for (a, b) in self.by_tier.iter_mut().zip(&other.by_tier) {
            *a += b;
        }
        for (a, b) in self.by_reason.iter_mut().zip(&other.by_reason) {
            *a += b;
        }
        self.features_missing += other.features_missing;
        self.stale_responses += other.stale_responses;
        self.candidates_scored += other.candidates_scored;
        self.explained_candidates += other.explained_candidates;
        self.explain_skipped_budget += other.explain_skipped_budget;
        self.shadow_requests += other.shadow_requests;
        self.shadow_abs_diff_ppm += other.shadow_abs_diff_ppm;
        self.shadow_rank_corr_ppm += other.shadow_rank_corr_ppm;
        self.cache_hits += other.cache_hits;
        self.cache_misses += other.cache_misses;
        for (a, b) in self.shed_by_band.iter_mut().zip(&other.shed_by_band) {
            *a += b;
        }
        self.shed_level_milli = self.shed_level_milli.max(other.shed_level_milli);
        self.admission_wrong_source += other.admission_wrong_source;
        self.tls_handshakes += other.tls_handshakes;
        self.tls_handshake_failures += other.tls_handshake_failures;
        self.tls_handshakes_refused += other.tls_handshakes_refused;
        self.backends_prebuilt += other.backends_prebuilt;
        self.backends_built_on_shard += other.backends_built_on_shard;
        self.log_records += other.log_records;
        self.log_dropped_ring_full += other.log_dropped_ring_full;
        self.log_dropped_too_large += other.log_dropped_too_large;
        self.connections_refused_shard_full += other.connections_refused_shard_full;
        self.connections_refused_source_full += other.connections_refused_source_full;
        self.frames_timed_out += other.frames_timed_out;
        self.writes_timed_out += other.writes_timed_out;
        for (a, b) in self.stalls_by_task.iter_mut().zip(&other.stalls_by_task) {
            *a += b;
        }
    }

    pub fn stalls(&self) -> u64 {
        self.stalls_by_task.iter().sum()
    }
}

/// Stall counts by task.
pub const STALL_TASKS: usize = 6;

/// What held a shard's reactor when it stalled: one of the shard's own
/// tasks running too long between two awaits, or, seen only as a late
/// timer, anything else (the runtime itself, a page fault, the vCPU paused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallTask {
    /// A connection's round: decode, score and encode its frames.
    Connection,
    /// Shadow versions scored after a round's responses were written.
    Shadow,
    /// The model watcher swapping in new versions.
    Refresh,
    /// The publisher handing an interval to the collector.
    Publish,
    /// The hand-off completion poller.
    Poller,
    /// None of the above: the shard's timer fired this late.
    Reactor,
}

impl StallTask {
    pub const ALL: [StallTask; STALL_TASKS] = [
        StallTask::Connection,
        StallTask::Shadow,
        StallTask::Refresh,
        StallTask::Publish,
        StallTask::Poller,
        StallTask::Reactor,
    ];

    pub fn name(self) -> &'static str {
        match self {
            StallTask::Connection => "connection",
            StallTask::Shadow => "shadow",
            StallTask::Refresh => "refresh",
            StallTask::Publish => "publish",
            StallTask::Poller => "poller",
            StallTask::Reactor => "reactor",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishes one interval through `publisher` and waits until the
    /// collector has folded it (its set comes back).
    fn publish_and_wait(publisher: &mut ShardPublisher, times: &mut StageTimes, counters: &Counters, active: u64) {
        let skipped = publisher.skipped;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            publisher.publish(times, counters, active, false, VersionReport::default(), None);
            if publisher.skipped == skipped {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the collector never returned a set");
            publisher.skipped = skipped;
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn publications_keep_totals_and_a_bounded_window() {
        let b = board(2);
        let (collector, mut publishers) = Collector::start(b.clone()).unwrap();
        let mut t = StageTimes::default();
        let mut c = Counters::default();
        for i in 0..(WINDOW_INTERVALS as u64 + 5) {
            t.record_us(Stage::Kernel, 100 + i);
            t.record_ns(Stage::Decode, 500);
            t.record_stall_ns(700_000);
            c.requests += 1;
            c.stalls_by_task[StallTask::Refresh as usize] += 1;
            publish_and_wait(&mut publishers[0], &mut t, &c, 3);
        }
        let mut publishers = publishers.into_iter();
        let last = publishers.next().unwrap();
        drop(publishers);
        last.publish_final(&mut t, &c, false, VersionReport::default());
        collector.join();
        let p = b[0].lock().unwrap();
        assert_eq!(p.window.len(), WINDOW_INTERVALS);
        assert_eq!(p.total[Stage::Kernel as usize].len(), WINDOW_INTERVALS as u64 + 5);
        assert_eq!(p.total[STALL].len(), WINDOW_INTERVALS as u64 + 5);
        assert_eq!(p.counters.requests, WINDOW_INTERVALS as u64 + 5);
        drop(p);
        let m = merge(&b);
        // The final publication was an empty interval: the window holds the
        // most recent ones.
        assert_eq!(m.window[Stage::Kernel as usize].len(), WINDOW_INTERVALS as u64 - 1);
        assert!(m.window[Stage::Kernel as usize].min() >= 106_000 - 1_000);
        assert_eq!(m.connections_active, 0, "a stopped shard has no connections");
        assert_eq!(m.counters.requests, WINDOW_INTERVALS as u64 + 5);
        assert_eq!(m.counters.stalls(), WINDOW_INTERVALS as u64 + 5);
    }

    #[test]
    fn a_collector_that_falls_behind_makes_the_shard_skip_not_wait_or_lose() {
        let b = board(1);
        let (collector, mut publishers) = Collector::start(b.clone()).unwrap();
        let mut publisher = publishers.pop().unwrap();
        // Hold the slot: the collector blocks on it, as under a long scrape.
        let held = b[0].lock().unwrap();
        let c = Counters::default();
        // On a thread of its own, so that a publish that waited on the held
        // slot fails this test (after a bound no busy machine reaches)
        // rather than hanging it.
        let (done, published) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut t, c) = (StageTimes::default(), Counters::default());
            for _ in 0..50 {
                t.record_us(Stage::EndToEnd, 10);
                publisher.publish(&mut t, &c, 1, false, VersionReport::default(), None);
            }
            done.send((publisher, t)).unwrap();
        });
        let (publisher, mut t) =
            published.recv_timeout(Duration::from_secs(30)).expect("publishing waited on the held slot");
        assert!(publisher.skipped >= 45, "skipped {}", publisher.skipped);
        drop(held);
        publisher.publish_final(&mut t, &c, false, VersionReport::default());
        collector.join();
        // Every recorded value reached the totals, skipped or not.
        assert_eq!(b[0].lock().unwrap().total[Stage::EndToEnd as usize].len(), 50);
    }

    #[test]
    fn histograms_are_small_and_keep_one_percent() {
        let mut h = stage_histogram();
        assert!(h.distinct_values() <= 4_096, "{} counters", h.distinct_values());
        h.record(123_456).unwrap();
        let v = h.value_at_quantile(0.5) as f64;
        assert!((v / 123_456.0 - 1.0).abs() < 0.01, "{v}");
        h.saturating_record(1);
        h.saturating_record(u64::MAX);
        assert_eq!(h.len(), 3);
    }
}
