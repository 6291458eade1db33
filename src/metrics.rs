//! Per-shard metrics, and how they cross to the admin thread.
//!
//! Each shard records stage latencies into its own HdrHistograms and counts
//! into plain integers: nothing on the request path is shared or locked.
//! Once per `PUBLISH_INTERVAL` a shard timer (off the request path) folds
//! the interval into the shard's [`Publication`], the one cross-thread type
//! here: a mutex that only the publishing shard and the admin thread's
//! scrape ever take. The admin thread merges all shards on read. Drift counts
//! (`crate::drift`) travel the same way: per served version, one interval a
//! publication, kept in the slot as a sliding window.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::drift::{self, Interval, VersionWindow, WindowTotals};
use crate::model::Model;
use crate::shed::BANDS;

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
}

pub const STAGES: [Stage; 7] =
    [Stage::Decode, Stage::Lookup, Stage::Queue, Stage::Kernel, Stage::Respond, Stage::EndToEnd, Stage::Shadow];

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
        }
    }
}

/// Latency histograms record nanoseconds, 1 ns to 100 s, 3 significant digits.
pub fn stage_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static bounds are valid")
}

/// A shard's stage timings for the current interval. `!Send` by ownership:
/// it lives inside the shard's `RequestPath`.
pub struct StageTimes {
    interval: Vec<Histogram<u64>>,
}

impl Default for StageTimes {
    fn default() -> Self {
        StageTimes { interval: STAGES.iter().map(|_| stage_histogram()).collect() }
    }
}

impl StageTimes {
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
    /// Requests by served version: (model, version, canary, count).
    pub versions: Vec<(String, u32, bool, u64)>,
    /// Drift counts of the calibrated versions served, the last
    /// `drift.window_s` intervals each.
    pub drift: Vec<VersionWindow>,
}

/// What a shard publishes about the versions it serves.
#[derive(Debug, Default)]
pub struct VersionReport {
    /// Requests by served version: (model, version, canary, count).
    pub counts: Vec<(String, u32, bool, u64)>,
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
            total: STAGES.iter().map(|_| stage_histogram()).collect(),
            window: VecDeque::with_capacity(WINDOW_INTERVALS + 1),
            connections_active: 0,
            breaker_open: false,
            versions: Vec::new(),
            drift: Vec::new(),
        }
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
    feed: std::sync::OnceLock<Arc<crate::feed::FeedStatus>>,
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

    pub fn attach_feed(&self, feed: Arc<crate::feed::FeedStatus>) {
        let _ = self.feed.set(feed);
    }

    pub fn feed(&self) -> Option<&crate::feed::FeedStatus> {
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

/// The publication slots of all shards, shared with the admin thread.
pub type Board = Arc<Vec<Mutex<Publication>>>;

pub fn board(shards: usize) -> Board {
    Arc::new((0..shards).map(|s| Mutex::new(Publication::new(s))).collect())
}

/// Folds a shard's interval into its slot and starts a new interval.
/// Called from the shard's timer, never from the request path.
pub fn publish(
    times: &mut StageTimes,
    counters: &Counters,
    connections_active: u64,
    breaker_open: bool,
    versions: VersionReport,
    slot: &Mutex<Publication>,
) {
    let mut p = slot.lock().unwrap_or_else(|e| e.into_inner());
    for (total, h) in p.total.iter_mut().zip(&times.interval) {
        total.add(h).expect("same bounds");
    }
    if p.window.len() == WINDOW_INTERVALS {
        let mut reuse = p.window.pop_front().expect("window is full");
        for (dst, src) in reuse.iter_mut().zip(times.interval.iter_mut()) {
            std::mem::swap(dst, src);
            src.reset();
        }
        p.window.push_back(reuse);
    } else {
        let fresh: Vec<_> = STAGES.iter().map(|_| stage_histogram()).collect();
        let taken = std::mem::replace(&mut times.interval, fresh);
        p.window.push_back(taken);
    }
    p.counters = counters.clone();
    p.connections_active = connections_active;
    p.breaker_open = breaker_open;
    p.versions = versions.counts;
    drift::push_intervals(&mut p.drift, versions.drift, versions.drift_intervals);
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
    /// Drift windows summed over shards, per calibrated version.
    pub drift: Vec<WindowTotals>,
}

pub fn merge(board: &Board) -> Merged {
    let mut m = Merged {
        counters: Counters::default(),
        total: STAGES.iter().map(|_| stage_histogram()).collect(),
        window: STAGES.iter().map(|_| stage_histogram()).collect(),
        connections_active: 0,
        shards: board.len(),
        breakers_open: 0,
        versions: Default::default(),
        drift: Vec::new(),
    };
    for slot in board.iter() {
        let p = slot.lock().unwrap_or_else(|e| e.into_inner());
        m.counters.add(&p.counters);
        m.connections_active += p.connections_active;
        m.breakers_open += usize::from(p.breaker_open);
        for (name, version, canary, n) in &p.versions {
            *m.versions.entry((name.clone(), *version, *canary)).or_default() += n;
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
        self.shadow_requests += other.shadow_requests;
        self.shadow_abs_diff_ppm += other.shadow_abs_diff_ppm;
        self.shadow_rank_corr_ppm += other.shadow_rank_corr_ppm;
        self.cache_hits += other.cache_hits;
        self.cache_misses += other.cache_misses;
        for (a, b) in self.shed_by_band.iter_mut().zip(&other.shed_by_band) {
            *a += b;
        }
        self.shed_level_milli = self.shed_level_milli.max(other.shed_level_milli);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_keeps_totals_and_a_bounded_window() {
        let b = board(2);
        let mut t = StageTimes::default();
        let mut c = Counters::default();
        for i in 0..(WINDOW_INTERVALS as u64 + 5) {
            t.record_us(Stage::Kernel, 100 + i);
            t.record_ns(Stage::Decode, 500);
            c.requests += 1;
            publish(&mut t, &c, 3, false, VersionReport::default(), &b[0]);
        }
        let p = b[0].lock().unwrap();
        assert_eq!(p.window.len(), WINDOW_INTERVALS);
        assert_eq!(p.total[Stage::Kernel as usize].len(), WINDOW_INTERVALS as u64 + 5);
        assert_eq!(p.counters.requests, WINDOW_INTERVALS as u64 + 5);
        drop(p);
        let m = merge(&b);
        assert_eq!(m.window[Stage::Kernel as usize].len(), WINDOW_INTERVALS as u64);
        // The window holds only the most recent intervals.
        assert!(m.window[Stage::Kernel as usize].min() >= 105_000 - 100);
        assert_eq!(m.connections_active, 3);
        assert_eq!(m.counters.requests, WINDOW_INTERVALS as u64 + 5);
    }
}
