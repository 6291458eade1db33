//! `/stats.json`: the merged board in the shape `quiver stats` prints.

use serde::{Deserialize, Serialize};

use std::sync::atomic::Ordering::Relaxed;

use crate::deadline::{Clock, MonotonicClock};
use crate::drift::{DriftConfig, DriftReport};
use crate::metrics::{self, Board, Readiness, StallTask, STAGES};
use crate::request::REASONS;
use crate::shed::{band_name, BANDS};
use crate::wire::{reason_name, status_name, tier_name, Reason, Status, Tier};

/// The drift of every calibrated version served, over the window.
pub(super) fn drift_reports(m: &metrics::Merged, config: &DriftConfig) -> Vec<DriftReport> {
    m.drift.iter().map(|t| DriftReport::new(t, config)).collect()
}

/// Mean absolute score difference and mean rank correlation of the shadow
/// comparisons so far (0 and 1 before any).
pub(super) fn shadow_divergence(c: &crate::request::Counters) -> (f64, f64) {
    if c.shadow_requests == 0 {
        return (0.0, 1.0);
    }
    let n = c.shadow_requests as f64;
    (c.shadow_abs_diff_ppm as f64 / 1e6 / n, c.shadow_rank_corr_ppm as f64 / 1e6 / n)
}

/// One stage's window percentiles, for `/stats.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StageStats {
    pub stage: String,
    pub count: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

/// One feature group's feed state, for `/stats.json`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FeedGroupStats {
    pub group: String,
    pub rows: u64,
    pub applied_seq: u64,
    pub staleness_ms: u64,
    pub applied: u64,
    pub skipped: u64,
    pub resyncs: u64,
    pub redis_connected: bool,
    /// A resync is held: the replica serves its last-known-good rows.
    pub resync_held: bool,
    /// Rows in the held copy (what Redis has), while held.
    pub held_rows: u64,
    /// Copies begun again because Redis moved under them.
    pub resync_restarts: u64,
}

/// `/stats.json`: what `quiver stats` shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    pub ready: bool,
    pub shards: usize,
    pub connections_active: u64,
    pub requests: u64,
    pub by_status: std::collections::BTreeMap<String, u64>,
    pub by_tier: std::collections::BTreeMap<String, u64>,
    /// Ok responses from a lower rung, by reason.
    pub step_downs: std::collections::BTreeMap<String, u64>,
    pub breakers_open: usize,
    /// Requests by served version, keyed `name@version` (`+canary` for one).
    pub by_version: std::collections::BTreeMap<String, u64>,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Requests shed for load, by priority band ("0", "1", "2-3", … "128-255").
    pub shed_by_band: std::collections::BTreeMap<String, u64>,
    /// Priority bands being shed now, highest over shards (fractional).
    pub shed_level: f64,
    pub shadow_requests: u64,
    pub shadow_mean_abs_diff: f64,
    pub shadow_rank_correlation: f64,
    pub candidates_scored: u64,
    pub features_missing: u64,
    pub stale_responses: u64,
    /// Requests refused for naming a client bound to other source networks.
    pub admission_wrong_source: u64,
    /// TLS handshakes of the scoring port completed, and failed.
    #[serde(default)]
    pub tls_handshakes: u64,
    #[serde(default)]
    pub tls_handshake_failures: u64,
    /// Per feature group, when the replicas are fed from Redis.
    pub feed: Vec<FeedGroupStats>,
    /// Score and input drift per calibrated version served.
    pub drift: Vec<DriftReport>,
    /// The window the drift measures cover.
    pub drift_window_s: u64,
    pub window_s: u64,
    /// Stage latencies over the window, then a `stall` row: the lengths of
    /// the reactor stalls counted in it.
    pub stages: Vec<StageStats>,
    /// Reactor stalls since start, by the task that held the reactor.
    #[serde(default)]
    pub stalls_by_task: std::collections::BTreeMap<String, u64>,
    /// Reactor stalls since start, per shard.
    #[serde(default)]
    pub stalls_by_shard: Vec<u64>,
    /// Open connections per shard.
    #[serde(default)]
    pub connections_by_shard: Vec<u64>,
}

pub(super) fn snapshot(board: &Board, readiness: &Readiness, drift: &DriftConfig) -> Stats {
    let m = metrics::merge(board);
    let us = |ns: u64| ns as f64 / 1e3;
    Stats {
        ready: readiness.is_ready(),
        shards: m.shards,
        connections_active: m.connections_active,
        requests: m.counters.requests,
        by_status: (0..=6u8).map(|c| (status_name(Status(c)).to_string(), m.counters.by_status[c as usize])).collect(),
        by_tier: (0..=3u8).map(|c| (tier_name(Tier(c)).to_string(), m.counters.by_tier[c as usize])).collect(),
        step_downs: (1..REASONS as u8)
            .map(|c| (reason_name(Reason(c)).to_string(), m.counters.by_reason[c as usize]))
            .collect(),
        breakers_open: m.breakers_open,
        cache_hits: m.counters.cache_hits,
        cache_misses: m.counters.cache_misses,
        shed_by_band: (0..BANDS).map(|b| (band_name(b).to_string(), m.counters.shed_by_band[b])).collect(),
        shed_level: m.counters.shed_level_milli as f64 / 1e3,
        shadow_requests: m.counters.shadow_requests,
        shadow_mean_abs_diff: shadow_divergence(&m.counters).0,
        shadow_rank_correlation: shadow_divergence(&m.counters).1,
        by_version: m
            .versions
            .iter()
            .map(|((name, v, canary), n)| (format!("{name}@{v}{}", if *canary { "+canary" } else { "" }), *n))
            .collect(),
        candidates_scored: m.counters.candidates_scored,
        features_missing: m.counters.features_missing,
        stale_responses: m.counters.stale_responses,
        admission_wrong_source: m.counters.admission_wrong_source,
        tls_handshakes: m.counters.tls_handshakes,
        tls_handshake_failures: m.counters.tls_handshake_failures,
        feed: readiness.feed().map_or_else(Vec::new, |f| {
            let now_ns = MonotonicClock::new().now_ns();
            f.groups
                .iter()
                .map(|g| FeedGroupStats {
                    group: g.name.clone(),
                    rows: g.live_rows.load(Relaxed),
                    applied_seq: g.applied_seq.load(Relaxed),
                    staleness_ms: g.staleness_ns(now_ns) / 1_000_000,
                    applied: g.applied_total.load(Relaxed),
                    skipped: g.skipped_total.load(Relaxed),
                    resyncs: g.resyncs_total.load(Relaxed),
                    redis_connected: f.connected.load(Relaxed),
                    resync_held: g.resync_held.load(Relaxed),
                    held_rows: g.held_rows.load(Relaxed),
                    resync_restarts: g.resync_restarts_total.load(Relaxed),
                })
                .collect()
        }),
        drift: drift_reports(&m, drift),
        drift_window_s: drift.window_s,
        window_s: (metrics::WINDOW_INTERVALS as u64) * metrics::PUBLISH_INTERVAL.as_secs(),
        stages: STAGES
            .iter()
            .map(|&s| (s.name(), s as usize))
            .chain([("stall", metrics::STALL)])
            .map(|(name, i)| {
                let h = &m.window[i];
                let q = |q: f64| if h.is_empty() { 0.0 } else { us(h.value_at_quantile(q)) };
                StageStats {
                    stage: name.into(),
                    count: h.len(),
                    p50_us: q(0.5),
                    p99_us: q(0.99),
                    p999_us: q(0.999),
                    max_us: if h.is_empty() { 0.0 } else { us(h.max()) },
                }
            })
            .collect(),
        stalls_by_task: StallTask::ALL
            .iter()
            .map(|&t| (t.name().to_string(), m.counters.stalls_by_task[t as usize]))
            .collect(),
        stalls_by_shard: m.stalls_by_shard.iter().map(|s| s.iter().sum()).collect(),
        connections_by_shard: m.connections_by_shard.clone(),
    }
}
