//! `/stats.json`: the merged board in the shape `quiver stats` prints.

use serde::{Deserialize, Serialize};

use std::sync::atomic::Ordering::Relaxed;

use crate::deadline::{Clock, MonotonicClock};
use crate::drift::{DriftConfig, DriftReport};
use crate::metrics::{self, Board, Readiness, StallTask, STAGES};
use crate::request::shed::{band_name, BANDS};
use crate::request::REASONS;
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
    /// The file opened at start-up is still being scanned in the background.
    #[serde(default)]
    pub verifying: bool,
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
    /// The backend scoring each served version, keyed as `by_version`
    /// (`cpu-int8`, `onnxruntime`, `unavailable`, …).
    pub backend_by_version: std::collections::BTreeMap<String, String>,
    /// The INT8 kernel the CPU INT8 backend runs (`amx`, `avx512-vnni`, …).
    pub int8_kernel: String,
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

pub(super) fn snapshot(board: &Board, readiness: &Readiness, drift: &DriftConfig, int8_kernel: &str) -> Stats {
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
        backend_by_version: m
            .backends
            .iter()
            .map(|((name, v, canary), b)| {
                (format!("{name}@{v}{}", if *canary { "+canary" } else { "" }), (*b).to_string())
            })
            .collect(),
        int8_kernel: int8_kernel.to_string(),
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
                    verifying: g.verifying.load(Relaxed),
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

/// `quiver stats`'s table for one snapshot: `rate` is the request rate
/// since the previous one (none for the first). Lines that would show
/// nothing (no feed, no stalls, no drift) are left out.
pub fn render(s: &Stats, rate: Option<f64>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    // Writing to a String cannot fail.
    macro_rules! w {
        ($($arg:tt)*) => { let _ = writeln!(out, $($arg)*); };
    }
    w!(
        "ready {}  shards {}  connections {}  requests {}{}  candidates {}  features missing {}",
        if s.ready { "yes" } else { "NO" },
        s.shards,
        s.connections_active,
        s.requests,
        rate.map_or(String::new(), |r| format!(" ({r:.0}/s)")),
        s.candidates_scored,
        s.features_missing
    );
    let nonzero = |m: &std::collections::BTreeMap<String, u64>| {
        m.iter().filter(|(_, v)| **v > 0).map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    };
    w!("status: {}", nonzero(&s.by_status));
    w!("tier:   {}", nonzero(&s.by_tier));
    if !s.backend_by_version.is_empty() {
        let served: Vec<String> = s
            .backend_by_version
            .iter()
            .map(|(v, b)| match b.as_str() {
                "cpu-int8" | "int8" if !s.int8_kernel.is_empty() => format!("{v} on {b} ({})", s.int8_kernel),
                _ => format!("{v} on {b}"),
            })
            .collect();
        w!("served: {}", served.join(", "));
    }
    let shed = nonzero(&s.shed_by_band);
    if !shed.is_empty() || s.shed_level > 0.0 {
        w!("shed:   level {:.2}  {shed}", s.shed_level);
    }
    for g in &s.feed {
        w!(
            "feed {:<5} rows {}  seq {}  stale {} ms  applied {}  skipped {}  resyncs {}  redis {}{}",
            g.group,
            g.rows,
            g.applied_seq,
            g.staleness_ms,
            g.applied,
            g.skipped,
            g.resyncs,
            if g.redis_connected { "up" } else { "DOWN" },
            if g.resync_held {
                format!("  RESYNC HELD (redis has {} rows; quiver replica accept --group {})", g.held_rows, g.group)
            } else if g.verifying {
                "  verifying the file opened at start-up (rows checked as read)".into()
            } else {
                String::new()
            }
        );
    }
    if s.stale_responses > 0 {
        w!("stale responses: {}", s.stale_responses);
    }
    if s.admission_wrong_source > 0 {
        w!("refused for a client_id bound to other networks: {}", s.admission_wrong_source);
    }
    if s.tls_handshakes + s.tls_handshake_failures > 0 {
        w!("TLS handshakes: {} completed, {} failed", s.tls_handshakes, s.tls_handshake_failures);
    }
    let stalls: u64 = s.stalls_by_task.values().sum();
    if stalls > 0 {
        let by: Vec<_> = s.stalls_by_task.iter().filter(|(_, &n)| n > 0).map(|(t, n)| format!("{t}={n}")).collect();
        let shards: Vec<_> = s.stalls_by_shard.iter().map(u64::to_string).collect();
        w!("reactor stalls: {stalls} ({})  by shard: {}", by.join(" "), shards.join(" "));
    }
    for d in &s.drift {
        let psi = d.psi.map_or_else(|| "n/a (too few scores)".to_string(), |p| format!("{p:.3}"));
        let worst = d.features.iter().map(|f| f.mean_shift).fold(0.0f64, f64::max);
        w!(
            "drift {}@{}: psi {psi}{}  scores {}  largest input mean shift {worst:.2}σ",
            d.model,
            d.version,
            if d.alert { " ALERT" } else { "" },
            d.scores
        );
    }
    w!(
        "{:<11} {:>9} {:>10} {:>10} {:>10} {:>10}   (last {} s)",
        "stage",
        "count",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "max µs",
        s.window_s
    );
    for st in &s.stages {
        w!(
            "{:<11} {:>9} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            st.stage,
            st.count,
            st.p50_us,
            st.p99_us,
            st.p999_us,
            st.max_us
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_what_there_is_and_leaves_out_the_rest() {
        let mut s = Stats { ready: true, shards: 2, requests: 1_000, window_s: 10, ..Stats::default() };
        s.by_status.insert("ok".into(), 990);
        s.by_status.insert("rate_limited".into(), 10);
        s.by_status.insert("bad_request".into(), 0);
        s.stages.push(StageStats { stage: "kernel".into(), count: 990, p50_us: 4.0, ..StageStats::default() });
        let table = render(&s, Some(250.0));
        assert!(table.starts_with("ready yes  shards 2  connections 0  requests 1000 (250/s)"), "{table}");
        assert!(table.contains("status: ok=990 rate_limited=10\n"), "{table}");
        assert!(table.contains("kernel"), "{table}");
        assert!(!table.contains("TLS") && !table.contains("feed ") && !table.contains("stalls"), "{table}");
        s.backend_by_version.insert("ctr@3".into(), "cpu-int8".into());
        s.backend_by_version.insert("trees@1".into(), "cpu-f32".into());
        s.int8_kernel = "amx".into();
        let table = render(&s, Some(250.0));
        assert!(table.contains("served: ctr@3 on cpu-int8 (amx), trees@1 on cpu-f32\n"), "{table}");
        s.tls_handshakes = 3;
        s.tls_handshake_failures = 1;
        s.stalls_by_task.insert("connection".into(), 2);
        s.stalls_by_shard = vec![2, 0];
        let table = render(&s, None);
        assert!(table.contains("TLS handshakes: 3 completed, 1 failed"), "{table}");
        assert!(table.contains("reactor stalls: 2 (connection=2)  by shard: 2 0"), "{table}");
        assert!(table.contains("requests 1000  candidates"), "no rate before a second snapshot: {table}");
    }
}
