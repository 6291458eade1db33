//! The admin HTTP endpoint, on its own thread: `/metrics` (Prometheus text),
//! `/healthz`, `/readyz`, `/stats.json` (for `quiver stats`), and
//! `POST /drain` / `POST /undrain` to take the server out of rotation,
//! model loads and rollbacks, and `POST /replica/{group}/accept` to accept a
//! held resync.
//!
//! It reads only what shards publish (`metrics::Board`) and the readiness
//! flag; it never touches a shard. HTTP is served by `tiny_http` and the
//! exposition format written by `prometheus-client`. The same state can be
//! served twice: with its controls (`admin_listen`, behind a token where
//! configured, see [`auth`]) and read-only (`metrics_listen`).

pub mod auth;

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry as Registry_, Unit};
use serde::{Deserialize, Serialize};

use std::sync::atomic::Ordering::Relaxed;

use crate::deadline::{Clock, MonotonicClock};
use crate::drift::{DriftConfig, DriftReport, FeatureDrift};
use crate::feed::{FeedStatus, GroupStatus};
use crate::ladder::Faults;
use crate::metrics::{self, Board, Readiness, Stage, StallTask, STAGES};
use crate::registry::{Registry, RegistryError};
use crate::request::REASONS;
use crate::shed::{band_name, BANDS};
use crate::wire::{reason_name, status_name, tier_name, Reason, Status, Tier};

/// Upper bounds of the Prometheus histogram buckets, in seconds: fine enough
/// to tell 5 µs from 10 µs, wide enough to hold a 1 s outlier.
pub const BUCKETS_S: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
];

/// What both listeners serve from.
#[derive(Debug)]
pub struct AdminState {
    pub board: Board,
    pub readiness: Arc<Readiness>,
    pub registry: Arc<Registry>,
    /// The backend's name, for `quiver_model_info`.
    pub backend: String,
    /// The fault hooks, when `faults_endpoint` is set.
    pub faults: Option<Arc<Faults>>,
    /// Required on every control request when set.
    pub token: Option<auth::AdminToken>,
    pub refusals: auth::Refusals,
}

/// Which routes a listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Surface {
    /// Reads and controls (`admin_listen`).
    Control,
    /// Reads only (`metrics_listen`): metrics, health, readiness, stats, models.
    ReadOnly,
}

#[derive(Debug)]
struct QuiverCollector {
    state: Arc<AdminState>,
}

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

fn encode_hist(
    encoder: &mut prometheus_client::encoding::MetricEncoder<'_>,
    h: &hdrhistogram::Histogram<u64>,
) -> Result<(), std::fmt::Error> {
    let mut buckets = Vec::with_capacity(BUCKETS_S.len());
    let mut below = 0u64;
    for &le in &BUCKETS_S {
        let le_ns = (le * 1e9) as u64;
        let upto = if h.is_empty() { 0 } else { h.count_between(0, le_ns) };
        buckets.push((le, upto.saturating_sub(below)));
        below = upto.max(below);
    }
    let sum = h.mean() * h.len() as f64 / 1e9;
    encoder.encode_histogram::<NoLabelSet>(sum, h.len(), &buckets, None)
}

impl prometheus_client::collector::Collector for QuiverCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let AdminState { board, readiness, registry, backend, refusals, .. } = &*self.state;
        let m = metrics::merge(board);

        let mut e =
            encoder.encode_descriptor("quiver_requests", "Requests answered, by status.", None, MetricType::Counter)?;
        for code in 0..=6u8 {
            let labels = [("status", status_name(Status(code)))];
            e.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&m.counters.by_status[code as usize], None)?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_responses_by_tier",
            "Ok responses, by the ladder rung that answered.",
            None,
            MetricType::Counter,
        )?;
        for code in 0..=3u8 {
            let labels = [("tier", tier_name(Tier(code)))];
            e.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(&m.counters.by_tier[code as usize], None)?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_step_downs",
            "Ok responses from a lower rung, by reason.",
            None,
            MetricType::Counter,
        )?;
        for code in 1..REASONS as u8 {
            let labels = [("reason", reason_name(Reason(code)))];
            e.encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&m.counters.by_reason[code as usize], None)?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_model_requests",
            "Requests routed to each served model version (canaries apart).",
            None,
            MetricType::Counter,
        )?;
        for ((name, version, canary), n) in &m.versions {
            let version = version.to_string();
            let role = if *canary { "canary" } else { "current" };
            let labels = [("model", name.as_str()), ("version", version.as_str()), ("role", role)];
            e.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(n, None)?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_cache_lookups",
            "Score-cache lookups by result.",
            None,
            MetricType::Counter,
        )?;
        e.encode_family(&[("result", "hit")])?.encode_counter::<NoLabelSet, _, u64>(&m.counters.cache_hits, None)?;
        e.encode_family(&[("result", "miss")])?.encode_counter::<NoLabelSet, _, u64>(&m.counters.cache_misses, None)?;
        let mut e = encoder.encode_descriptor(
            "quiver_shed_requests",
            "Requests shed for load before lookup, by priority band.",
            None,
            MetricType::Counter,
        )?;
        for (b, n) in m.counters.shed_by_band.iter().enumerate() {
            e.encode_family(&[("band", band_name(b))])?.encode_counter::<NoLabelSet, _, u64>(n, None)?;
        }
        encoder
            .encode_descriptor(
                "quiver_shed_level",
                "Priority bands being shed, highest over shards; the fraction is the next band's shed share.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&(m.counters.shed_level_milli as f64 / 1e3))?;
        let shadow_n = m.counters.shadow_requests;
        encoder
            .encode_descriptor(
                "quiver_shadow_requests",
                "Requests also scored by a shadow version after their response.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&shadow_n, None)?;
        let (mad, rho) = shadow_divergence(&m.counters);
        encoder
            .encode_descriptor(
                "quiver_shadow_mean_abs_diff",
                "Mean absolute difference between shadow and returned scores, since start.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&mad)?;
        encoder
            .encode_descriptor(
                "quiver_shadow_rank_correlation",
                "Mean Spearman rank correlation of shadow and returned scores per request, since start.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&rho)?;
        encoder
            .encode_descriptor(
                "quiver_breakers_open",
                "Shards whose primary circuit breaker is open or half-open.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&(m.breakers_open as i64))?;
        encoder
            .encode_descriptor("quiver_candidates_scored", "Candidates scored.", None, MetricType::Counter)?
            .encode_counter::<NoLabelSet, _, u64>(&m.counters.candidates_scored, None)?;
        encoder
            .encode_descriptor(
                "quiver_features_missing",
                "Feature lookups that fell back to the group default.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&m.counters.features_missing, None)?;
        encoder
            .encode_descriptor("quiver_connections_active", "Open client connections.", None, MetricType::Gauge)?
            .encode_gauge(&(m.connections_active as i64))?;
        encoder
            .encode_descriptor("quiver_shards", "Shards serving.", None, MetricType::Gauge)?
            .encode_gauge(&(m.shards as i64))?;
        encoder
            .encode_descriptor(
                "quiver_ready",
                "1 when the server takes traffic, 0 while starting or drained.",
                None,
                MetricType::Gauge,
            )?
            .encode_gauge(&i64::from(readiness.probe(MonotonicClock::new().now_ns()).is_ok()))?;
        encoder
            .encode_descriptor(
                "quiver_admin_unauthorized",
                "Control requests refused for a missing or wrong bearer token.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&refusals.total(), None)?;
        encoder
            .encode_descriptor(
                "quiver_stale_responses",
                "Ok responses flagged features_stale.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&m.counters.stale_responses, None)?;
        encoder
            .encode_descriptor(
                "quiver_admission_wrong_source",
                "Requests refused for naming a client bound to other source networks.",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, u64>(&m.counters.admission_wrong_source, None)?;
        if let Some(feed) = readiness.feed() {
            encode_feed(&mut encoder, feed)?;
        }
        encode_drift(&mut encoder, &drift_reports(&m, registry.drift()))?;
        let mut e =
            encoder.encode_descriptor("quiver_model", "Model versions being served.", None, MetricType::Info)?;
        for m in registry.status() {
            let version = m.version.to_string();
            let labels = [("model", m.name.as_str()), ("version", version.as_str()), ("backend", backend.as_str())];
            e.encode_info(&labels)?;
        }

        let seconds = Unit::Seconds;
        let mut e = encoder.encode_descriptor(
            "quiver_request_duration",
            "Time from reading a request's frame to its encoded response.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        encode_hist(&mut e, &m.total[Stage::EndToEnd as usize])?;
        let mut e = encoder.encode_descriptor(
            "quiver_stage_duration",
            "Time spent in each stage of the request path.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        for stage in STAGES {
            let labels = [("stage", stage.name())];
            encode_hist(&mut e.encode_family(&labels)?, &m.total[stage as usize])?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_shard_stalls",
            "Times a shard's reactor was held longer than reactor.stall_threshold_us, by the task that held it \
             (reactor: a timer of the shard's fired that late, cause unseen).",
            None,
            MetricType::Counter,
        )?;
        for (shard, by_task) in m.stalls_by_shard.iter().enumerate() {
            let shard = shard.to_string();
            for task in StallTask::ALL {
                let labels = [("shard", shard.as_str()), ("task", task.name())];
                e.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(&by_task[task as usize], None)?;
            }
        }
        let mut e = encoder.encode_descriptor(
            "quiver_shard_stall_duration",
            "How long each counted reactor stall lasted.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        encode_hist(&mut e, &m.total[metrics::STALL])?;
        let mut e = encoder.encode_descriptor(
            "quiver_stage_duration_window",
            "Stage latency percentiles over the last 10 s (HdrHistogram).",
            Some(&seconds),
            MetricType::Gauge,
        )?;
        for stage in STAGES {
            let h = &m.window[stage as usize];
            for (q, label) in [(0.5, "0.5"), (0.99, "0.99"), (0.999, "0.999")] {
                let labels = [("stage", stage.name()), ("quantile", label)];
                let v = if h.is_empty() { 0.0 } else { ns_to_s(h.value_at_quantile(q)) };
                e.encode_family(&labels)?.encode_gauge(&v)?;
            }
        }
        Ok(())
    }
}

/// The Redis feed's state: per-group position, staleness and counts, and
/// the connection.
fn encode_feed(encoder: &mut DescriptorEncoder, feed: &FeedStatus) -> Result<(), std::fmt::Error> {
    let now_ns = MonotonicClock::new().now_ns();
    let now_unix_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let seconds = Unit::Seconds;
    type Get = fn(&GroupStatus, u64, u64) -> f64;
    let gauges: [(&str, &str, Option<&Unit>, Get); 7] = [
        ("quiver_replica_rows", "Keys in the group's replica.", None, |g, _, _| g.live_rows.load(Relaxed) as f64),
        ("quiver_replica_applied_seq", "Stream sequence number of the last applied change.", None, |g, _, _| {
            g.applied_seq.load(Relaxed) as f64
        }),
        (
            "quiver_replica_resync_held",
            "1 while a full resync that would shrink the replica past resync_shrink_max is held.",
            None,
            |g, _, _| f64::from(u8::from(g.resync_held.load(Relaxed))),
        ),
        ("quiver_replica_resync_held_rows", "Rows in the held resync's copy.", None, |g, _, _| {
            g.held_rows.load(Relaxed) as f64
        }),
        (
            "quiver_replica_staleness",
            "Time since the group was last known to hold everything Redis had.",
            Some(&seconds),
            |g, now_ns, _| g.staleness_ns(now_ns) as f64 / 1e9,
        ),
        (
            "quiver_replica_contact_age",
            "Time since the refresher last heard from Redis.",
            Some(&seconds),
            |g, now_ns, _| match g.contact_ns.load(Relaxed) {
                0 => f64::INFINITY,
                t => now_ns.saturating_sub(t) as f64 / 1e9,
            },
        ),
        (
            "quiver_replica_change_age",
            "Age of the last applied change (its write time in Redis).",
            Some(&seconds),
            |g, _, now_ms| match g.change_unix_ms.load(Relaxed) {
                0 => f64::INFINITY,
                t => now_ms.saturating_sub(t) as f64 / 1e3,
            },
        ),
    ];
    for (name, help, unit, get) in gauges {
        let mut e = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
        for g in &feed.groups {
            e.encode_family(&[("group", g.name.as_str())])?.encode_gauge(&get(g, now_ns, now_unix_ms))?;
        }
    }
    type Count = fn(&GroupStatus) -> u64;
    let counters: [(&str, &str, Count); 5] = [
        ("quiver_replica_changes_applied", "Stream entries applied.", |g| g.applied_total.load(Relaxed)),
        ("quiver_replica_skipped", "Keys and stream entries skipped as bad data.", |g| g.skipped_total.load(Relaxed)),
        ("quiver_replica_resyncs", "Full resyncs from Redis.", |g| g.resyncs_total.load(Relaxed)),
        ("quiver_replica_resync_restarts", "Resync copies begun again because Redis moved under them.", |g| {
            g.resync_restarts_total.load(Relaxed)
        }),
        ("quiver_replica_torn_rows_repaired", "Rows found mid-write at open and dropped until replayed.", |g| {
            g.torn_rows_repaired.load(Relaxed)
        }),
    ];
    for (name, help, get) in counters {
        let mut e = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for g in &feed.groups {
            e.encode_family(&[("group", g.name.as_str())])?.encode_counter::<NoLabelSet, _, u64>(&get(g), None)?;
        }
    }
    encoder
        .encode_descriptor(
            "quiver_redis_connected",
            "1 while the refresher holds a Redis connection.",
            None,
            MetricType::Gauge,
        )?
        .encode_gauge(&i64::from(feed.connected.load(Relaxed)))?;
    encoder
        .encode_descriptor(
            "quiver_redis_breaker_open",
            "1 while the Redis circuit breaker is open.",
            None,
            MetricType::Gauge,
        )?
        .encode_gauge(&i64::from(feed.breaker_open.load(Relaxed)))?;
    encoder
        .encode_descriptor(
            "quiver_redis_failures",
            "Failed Redis connections and sessions.",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&feed.connect_failures_total.load(Relaxed), None)?;
    Ok(())
}

/// The drift of every calibrated version served, over the window.
fn drift_reports(m: &metrics::Merged, config: &DriftConfig) -> Vec<DriftReport> {
    m.drift.iter().map(|t| DriftReport::new(t, config)).collect()
}

/// Drift gauges per calibrated version; a measure is absent while the window
/// holds fewer than `drift.min_count` rows, and for uncalibrated versions.
fn encode_drift(encoder: &mut DescriptorEncoder, reports: &[DriftReport]) -> Result<(), std::fmt::Error> {
    let versions: Vec<String> = reports.iter().map(|r| r.version.to_string()).collect();
    let labels = |i: usize| [("model", reports[i].model.as_str()), ("version", versions[i].as_str())];
    let mut e = encoder.encode_descriptor(
        "quiver_score_drift_window_scores",
        "Primary-tier scores in the drift window.",
        None,
        MetricType::Gauge,
    )?;
    for (i, r) in reports.iter().enumerate() {
        e.encode_family(&labels(i))?.encode_gauge(&(r.scores as i64))?;
    }
    let mut e = encoder.encode_descriptor(
        "quiver_score_psi",
        "Population stability index of the window's scores against the calibration histogram.",
        None,
        MetricType::Gauge,
    )?;
    for (i, r) in reports.iter().enumerate() {
        if let Some(psi) = r.psi {
            e.encode_family(&labels(i))?.encode_gauge(&psi)?;
        }
    }
    let mut e = encoder.encode_descriptor(
        "quiver_score_drift_alert",
        "1 while the score PSI is at least drift.psi_alert.",
        None,
        MetricType::Gauge,
    )?;
    for (i, r) in reports.iter().enumerate() {
        if r.psi.is_some() {
            e.encode_family(&labels(i))?.encode_gauge(&i64::from(r.alert))?;
        }
    }
    type Get = fn(&FeatureDrift) -> f64;
    let gauges: [(&str, &str, Get); 3] = [
        ("quiver_input_drift", "Shift of a context input's window mean, in calibration standard deviations.", |f| {
            f.mean_shift
        }),
        ("quiver_input_mean", "Mean of a context input over the drift window.", |f| f.mean),
        ("quiver_input_variance", "Variance of a context input over the drift window.", |f| f.variance),
    ];
    for (name, help, get) in gauges {
        let mut e = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (i, r) in reports.iter().enumerate() {
            for f in &r.features {
                let feature = format!("context_{}", f.feature);
                let [model, version] = labels(i);
                e.encode_family(&[model, version, ("feature", feature.as_str())])?.encode_gauge(&get(f))?;
            }
        }
    }
    Ok(())
}

/// Mean absolute score difference and mean rank correlation of the shadow
/// comparisons so far (0 and 1 before any).
fn shadow_divergence(c: &crate::request::Counters) -> (f64, f64) {
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

fn stats(board: &Board, readiness: &Readiness, drift: &DriftConfig) -> Stats {
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

/// A running admin endpoint.
pub struct Admin {
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
}

impl Admin {
    /// Binds `addr` and serves `surface` on a new thread. A control surface
    /// on an address that is not loopback needs a token.
    pub fn start(addr: &str, surface: Surface, state: Arc<AdminState>) -> Result<Admin, crate::Error> {
        let what = match surface {
            Surface::Control => "admin",
            Surface::ReadOnly => "metrics",
        };
        let server = tiny_http::Server::http(addr).map_err(|e| crate::Error::Setup(format!("{what} {addr}: {e}")))?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| crate::Error::Setup(format!("{what} {addr}: not an IP address")))?;
        if surface == Surface::Control {
            auth::check_exposure(addr, bound, state.token.is_some()).map_err(crate::Error::Setup)?;
        }
        let server = Arc::new(server);
        let mut prometheus = Registry_::default();
        prometheus.register_collector(Box::new(QuiverCollector { state: state.clone() }));
        let thread = std::thread::Builder::new()
            .name(format!("quiver-{what}"))
            .spawn({
                let server = server.clone();
                move || serve(&server, &prometheus, &state, surface)
            })
            .map_err(|e| crate::Error::Setup(format!("{what} thread: {e}")))?;
        Ok(Admin { server, thread: Some(thread), addr: bound })
    }

    /// Stops serving and joins the thread.
    pub fn stop(mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long `POST /replica/{group}/accept` waits for the refresher to act.
const ACCEPT_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// What an accept of a held resync answers: 200 when the refresher acted
/// (the copy swapped in, or the next copy to be taken whatever its size),
/// 202 when it has not yet (it may be copying or reconnecting), 404 for an
/// unknown group, 409 when nothing is held.
fn accept_resync(readiness: &Readiness, name: &str) -> (u16, String) {
    let json = |code: u16, v: serde_json::Value| (code, format!("{v}\n"));
    let err = |code: u16, why: String| json(code, serde_json::json!({ "error": why }));
    let Some(feed) = readiness.feed() else {
        return err(409, "no [feed]: the replicas do not follow redis".into());
    };
    let Some(g) = feed.group(name) else {
        return err(404, format!("no feature group '{name}'"));
    };
    if !g.resync_held.load(Relaxed) {
        return err(409, format!("nothing held for '{name}': its replica follows redis"));
    }
    let before = g.accepts_total.load(Relaxed);
    g.accept_requested.store(true, std::sync::atomic::Ordering::Release);
    tracing::warn!(group = name, "held resync accept requested on the admin endpoint");
    let until = std::time::Instant::now() + ACCEPT_WAIT;
    while g.accepts_total.load(Relaxed) == before {
        if std::time::Instant::now() >= until {
            return json(202, serde_json::json!({ "group": name, "accepted": false, "requested": true, "held": true }));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let held = g.resync_held.load(Relaxed);
    json(200, serde_json::json!({ "group": name, "accepted": true, "held": held, "rows": g.live_rows.load(Relaxed) }))
}

/// The HTTP status and text for a failed load or rollback.
fn registry_error(e: RegistryError) -> (u16, String) {
    let code = match e {
        RegistryError::UnknownModel(_) | RegistryError::UnknownVersion { .. } => 404,
        RegistryError::NoPrevious(_) | RegistryError::NoDirectory => 409,
        RegistryError::BadName(_) | RegistryError::BadFraction(_) | RegistryError::NoCanaryVersion => 400,
        _ => 422,
    };
    (code, e.to_string())
}

/// Whether `request` may use a control route: always on a loopback surface
/// without a token, else only with the token. Refusals are counted.
fn authorized(state: &AdminState, request: &tiny_http::Request, path: &str) -> bool {
    let Some(token) = &state.token else {
        return true;
    };
    let authorization = request.headers().iter().find(|h| h.field.equiv("Authorization")).map(|h| h.value.as_str());
    if token.admits(authorization) {
        return true;
    }
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    state.refusals.record(now_s, request.remote_addr().copied(), request.method().as_str(), path);
    false
}

/// What an admin request asks for, read from its method and URL alone:
/// the one place the admin endpoint parses what a client sent.
#[derive(Debug, PartialEq)]
pub enum Route {
    Metrics,
    Healthz,
    Readyz,
    Stats,
    Models,
    Drain,
    Undrain,
    /// `None`: the query did not say `stage_delay_us=N`.
    Faults {
        stage_delay_us: Option<u64>,
    },
    Model {
        name: String,
        action: ModelAction,
    },
    ReplicaAccept {
        group: String,
    },
    /// Answered with this status and text.
    Bad {
        code: u16,
        why: String,
    },
}

#[derive(Debug, PartialEq)]
pub enum ModelAction {
    Load { version: Option<u32> },
    Rollback,
    Canary { version: Option<u32>, fraction: f64 },
    Shadow { version: Option<u32>, fraction: f64 },
}

impl Route {
    /// Whether it changes what the server does (and so needs the token).
    pub fn is_control(&self) -> bool {
        !matches!(
            self,
            Route::Metrics | Route::Healthz | Route::Readyz | Route::Stats | Route::Models | Route::Bad { .. }
        )
    }
}

/// Parses a request line's method and URL into a [`Route`].
pub fn route(method: &str, url: &str) -> Route {
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    let param = |key: &str| query.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='));
    let not_found = || Route::Bad { code: 404, why: "not found".into() };
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => Route::Metrics,
        ("GET" | "HEAD", "/healthz") => Route::Healthz,
        ("GET" | "HEAD", "/readyz") => Route::Readyz,
        ("GET" | "HEAD", "/stats.json") => Route::Stats,
        ("GET" | "HEAD", "/models") => Route::Models,
        ("POST", "/drain") => Route::Drain,
        ("POST", "/undrain") => Route::Undrain,
        ("POST", "/faults") => Route::Faults { stage_delay_us: param("stage_delay_us").and_then(|v| v.parse().ok()) },
        ("POST", p) if p.starts_with("/replica/") => match p["/replica/".len()..].strip_suffix("/accept") {
            Some(group) if !group.is_empty() && !group.contains('/') => Route::ReplicaAccept { group: group.into() },
            _ => Route::Bad { code: 404, why: "use POST /replica/<group>/accept".into() },
        },
        ("POST", p) if p.starts_with("/models/") => {
            let usage = "use /models/<name>/load[?version=N] or /models/<name>/rollback";
            let Some((name, verb)) = p["/models/".len()..].rsplit_once('/') else {
                return Route::Bad { code: 404, why: usage.into() };
            };
            let version = match param("version").map(|v| v.parse::<u32>().map_err(|_| format!("bad version '{v}'"))) {
                Some(Err(why)) => return Route::Bad { code: 400, why },
                Some(Ok(v)) => Some(v),
                None => None,
            };
            let fraction = param("fraction").and_then(|f| f.parse::<f64>().ok());
            let action = match (verb, version, fraction) {
                ("load", version, _) => ModelAction::Load { version },
                ("rollback", None, _) => ModelAction::Rollback,
                ("canary", version, Some(fraction)) => ModelAction::Canary { version, fraction },
                ("shadow", version, Some(fraction)) => ModelAction::Shadow { version, fraction },
                (kind @ ("canary" | "shadow"), _, None) => {
                    return Route::Bad { code: 400, why: format!("use /models/<name>/{kind}?version=N&fraction=F") }
                }
                _ => return Route::Bad { code: 404, why: usage.into() },
            };
            Route::Model { name: name.into(), action }
        }
        _ => not_found(),
    }
}

fn serve(server: &tiny_http::Server, prometheus: &Registry_, state: &AdminState, surface: Surface) {
    use tiny_http::{Header, Response};
    let AdminState { board, readiness, registry, faults, .. } = state;
    let faults = faults.as_deref();
    let header = |v: &str| Header::from_bytes("Content-Type", v).expect("static header is valid");
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let route = route(request.method().as_str(), request.url());
        let control = route.is_control();
        if control && surface == Surface::ReadOnly {
            let body = "not found: this listener serves metrics, health, readiness and stats only\n";
            let _ = request.respond(Response::from_string(body).with_status_code(404));
            continue;
        }
        if control && !authorized(state, &request, &path) {
            let body = "unauthorized: control requests need Authorization: Bearer <the admin_token_file token>\n";
            let www = Header::from_bytes("WWW-Authenticate", "Bearer").expect("static header is valid");
            let _ = request.respond(Response::from_string(body).with_status_code(401).with_header(www));
            continue;
        }
        let json = |body: String| Response::from_string(body).with_header(header("application/json"));
        let response = match route {
            Route::Metrics => {
                let mut body = String::new();
                match prometheus_client::encoding::prometheus_text::encode(&mut body, prometheus) {
                    Ok(()) => {
                        Response::from_string(body).with_header(header("text/plain; version=0.0.4; charset=utf-8"))
                    }
                    Err(_) => Response::from_string("encoding failed\n").with_status_code(500),
                }
            }
            Route::Healthz => Response::from_string("ok\n"),
            Route::Readyz => match readiness.probe(MonotonicClock::new().now_ns()) {
                Ok(()) => Response::from_string("ready\n"),
                Err(why) => Response::from_string(format!("{why}\n")).with_status_code(503),
            },
            Route::Stats => {
                json(serde_json::to_string(&stats(board, readiness, registry.drift())).expect("stats serialise"))
            }
            Route::Models => json(serde_json::to_string(&registry.status()).expect("status serialises")),
            Route::Drain => {
                readiness.set(false);
                tracing::info!("drained: not ready until POST /undrain");
                Response::from_string("drained\n")
            }
            Route::Undrain => {
                readiness.set(true);
                tracing::info!("undrained: ready");
                Response::from_string("ready\n")
            }
            Route::Faults { stage_delay_us } => match (faults, stage_delay_us) {
                (None, _) => Response::from_string("not found\n").with_status_code(404),
                (Some(f), Some(us)) => {
                    f.set_stage_delay_us(us);
                    tracing::warn!(stage_delay_us = us, "fault injected");
                    Response::from_string(format!("stage_delay_us={us}\n"))
                }
                (Some(_), None) => Response::from_string("use /faults?stage_delay_us=N\n").with_status_code(400),
            },
            Route::ReplicaAccept { group } => {
                let (code, body) = accept_resync(readiness, &group);
                json(body).with_status_code(code)
            }
            Route::Model { name, action } => {
                let outcome = match action {
                    ModelAction::Load { version } => registry.load(&name, version),
                    ModelAction::Rollback => registry.rollback(&name),
                    ModelAction::Canary { version, fraction } => {
                        registry.canary(&name, version, fraction).map(|v| v.unwrap_or(0))
                    }
                    ModelAction::Shadow { version, fraction } => {
                        registry.shadow(&name, version, fraction).map(|v| v.unwrap_or(0))
                    }
                };
                match outcome.map_err(registry_error) {
                    Ok(version) => json(format!("{{\"version\":{version}}}")),
                    Err((code, why)) => Response::from_string(format!("{why}\n")).with_status_code(code),
                }
            }
            Route::Bad { code, why } => Response::from_string(format!("{why}\n")).with_status_code(code),
        };
        let _ = request.respond(response);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{board, fold, Report};
    use crate::request::Counters;

    #[test]
    fn routes_parse_what_the_controls_need() {
        assert_eq!(route("GET", "/metrics?x=1"), Route::Metrics);
        assert_eq!(route("POST", "/faults?stage_delay_us=7"), Route::Faults { stage_delay_us: Some(7) });
        assert_eq!(route("POST", "/faults?stage_delay_us=x"), Route::Faults { stage_delay_us: None });
        let canary = route("POST", "/models/m/canary?version=2&fraction=0.25");
        assert_eq!(
            canary,
            Route::Model { name: "m".into(), action: ModelAction::Canary { version: Some(2), fraction: 0.25 } }
        );
        assert!(canary.is_control() && !route("GET", "/stats.json").is_control());
        assert!(matches!(route("POST", "/models/m/load?version=-1"), Route::Bad { code: 400, .. }));
        assert!(matches!(route("POST", "/models/m/shadow"), Route::Bad { code: 400, .. }));
        assert!(matches!(route("POST", "/models/m/rollback?version=2"), Route::Bad { code: 404, .. }));
        assert_eq!(route("POST", "/replica/item/accept"), Route::ReplicaAccept { group: "item".into() });
        assert!(matches!(route("POST", "/replica//accept"), Route::Bad { code: 404, .. }));
        assert!(matches!(route("GET", "/drain"), Route::Bad { code: 404, .. }));
    }

    #[test]
    fn exposition_has_conventional_names_and_consistent_buckets() {
        let b = board(2);
        let mut times: Vec<_> = (0..metrics::HISTOGRAMS).map(|_| metrics::stage_histogram()).collect();
        let mut c = Counters::default();
        for us in [3u64, 30, 300, 3_000] {
            times[Stage::EndToEnd as usize].record(us * 1_000).unwrap();
        }
        c.requests = 4;
        c.by_status[0] = 4;
        c.shed_by_band[4] = 2;
        c.shed_level_milli = 1_500;
        c.stalls_by_task[StallTask::Refresh as usize] = 3;
        times[metrics::STALL].record(2_000_000).unwrap();
        let report = Report {
            shard: 1,
            times,
            counters: c,
            connections_active: 1,
            breaker_open: false,
            versions: Default::default(),
            longest_stall: None,
        };
        fold(report, &b[1]);
        let fit = crate::registry::Fit { user_dim: 32, item_dim: 32, context_len_max: 256 };
        let mut model = crate::demo::model();
        model.name = "m".into();
        model.version = 2;
        let models = Registry::from_models(vec![model], fit, crate::score::BackendKind::Int8, 8).unwrap();
        let mut registry = Registry_::default();
        let state = AdminState {
            board: b,
            readiness: Arc::new(Readiness::ready()),
            registry: Arc::new(models),
            backend: "cpu-int8".into(),
            faults: None,
            token: None,
            refusals: auth::Refusals::default(),
        };
        state.refusals.record(1, None, "POST", "/drain");
        registry.register_collector(Box::new(QuiverCollector { state: Arc::new(state) }));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("quiver_requests_total{status=\"ok\"} 4"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_count 4"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"1e-05\"} 1"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"0.001\"} 3"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"+Inf\"} 4"), "{text}");
        assert!(text.contains("quiver_model_info{model=\"m\",version=\"2\",backend=\"cpu-int8\"} 1"), "{text}");
        assert!(text.contains("quiver_ready 1"), "{text}");
        assert!(text.contains("quiver_admin_unauthorized_total 1"), "{text}");
        assert!(text.contains("quiver_shed_requests_total{band=\"8-15\"} 2"), "{text}");
        assert!(text.contains("quiver_shed_requests_total{band=\"0\"} 0"), "{text}");
        assert!(text.contains("quiver_shed_level 1.5"), "{text}");
        assert!(text.contains("quiver_shard_stalls_total{shard=\"1\",task=\"refresh\"} 3"), "{text}");
        assert!(text.contains("quiver_shard_stalls_total{shard=\"0\",task=\"connection\"} 0"), "{text}");
        assert!(text.contains("quiver_shard_stall_duration_seconds_count 1"), "{text}");
    }
}
