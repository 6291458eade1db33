//! `/metrics`: what the board, the readiness flag, the registry and the
//! feed say, written in the Prometheus text format by `prometheus-client`.

use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;
use std::sync::atomic::Ordering::Relaxed;

use super::stats::{drift_reports, shadow_divergence};
use super::AdminState;
use crate::deadline::{Clock, MonotonicClock};
use crate::drift::{DriftReport, FeatureDrift};
use crate::features::feed::{FeedStatus, GroupStatus};
use crate::metrics::{self, Stage, StallTask, STAGES};
use crate::request::shed::band_name;
use crate::request::REASONS;
use crate::wire::{reason_name, status_name, tier_name, Reason, Status, Tier};

/// Upper bounds of the Prometheus histogram buckets, in seconds: fine enough
/// to tell 5 µs from 10 µs, wide enough to hold a 1 s outlier.
pub const BUCKETS_S: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
];

#[derive(Debug)]
pub(super) struct QuiverCollector {
    pub(super) state: Arc<AdminState>,
}

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// One counter with no labels.
fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> Result<(), std::fmt::Error> {
    encoder.encode_descriptor(name, help, None, MetricType::Counter)?.encode_counter::<NoLabelSet, _, u64>(&value, None)
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
        let AdminState { board, readiness, registry, backend, kernel, refusals, http, .. } = &*self.state;
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
        counter(
            &mut encoder,
            "quiver_shadow_requests",
            "Requests also scored by a shadow version after their response.",
            m.counters.shadow_requests,
        )?;
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
        counter(
            &mut encoder,
            "quiver_features_missing",
            "Feature lookups that fell back to the group default.",
            m.counters.features_missing,
        )?;
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
        counter(
            &mut encoder,
            "quiver_admin_unauthorized",
            "Control requests refused for a missing or wrong bearer token.",
            refusals.total(),
        )?;
        for (name, help, value) in [
            ("quiver_admin_connections_accepted", "Connections the admin and metrics listeners took.", &http.accepted),
            (
                "quiver_admin_connections_evicted",
                "Idle admin connections closed to admit a new one (all connections were held).",
                &http.evicted,
            ),
            (
                "quiver_admin_connections_refused",
                "New admin connections closed at once: every held one was inside a request.",
                &http.refused,
            ),
            (
                "quiver_admin_accept_errors",
                "Accepts that failed on the admin listeners (e.g. out of file descriptors).",
                &http.accept_errors,
            ),
            (
                "quiver_admin_requests_rejected",
                "Admin requests refused or cut off for size or time (408, 413, 431, slow heads and readers).",
                &http.rejected,
            ),
        ] {
            counter(&mut encoder, name, help, value.load(std::sync::atomic::Ordering::Relaxed))?;
        }
        counter(
            &mut encoder,
            "quiver_stale_responses",
            "Ok responses flagged features_stale.",
            m.counters.stale_responses,
        )?;
        counter(
            &mut encoder,
            "quiver_explained_candidates",
            "Candidates whose reason codes were returned (explain_top_k).",
            m.counters.explained_candidates,
        )?;
        counter(
            &mut encoder,
            "quiver_explain_skipped_budget",
            "Requests that asked for reason codes and got explain_skipped = budget.",
            m.counters.explain_skipped_budget,
        )?;
        counter(
            &mut encoder,
            "quiver_admission_wrong_source",
            "Requests refused for naming a client bound to other source networks.",
            m.counters.admission_wrong_source,
        )?;
        counter(
            &mut encoder,
            "quiver_tls_handshakes",
            "TLS handshakes completed on the scoring port.",
            m.counters.tls_handshakes,
        )?;
        counter(
            &mut encoder,
            "quiver_tls_handshake_failures",
            "TLS handshakes on the scoring port that failed or timed out.",
            m.counters.tls_handshake_failures,
        )?;
        counter(
            &mut encoder,
            "quiver_connections_refused_shard_full",
            "New scoring connections closed: the shard that would serve them was at connections_per_shard_max.",
            m.counters.connections_refused_shard_full,
        )?;
        counter(
            &mut encoder,
            "quiver_connections_refused_source_full",
            "New scoring connections closed: their source held connections_per_source_max already.",
            m.counters.connections_refused_source_full,
        )?;
        counter(
            &mut encoder,
            "quiver_frames_timed_out",
            "Scoring connections closed for a frame not complete within frame_timeout_ms of its first byte.",
            m.counters.frames_timed_out,
        )?;
        counter(
            &mut encoder,
            "quiver_writes_timed_out",
            "Scoring connections closed for responses not taken within write_timeout_ms.",
            m.counters.writes_timed_out,
        )?;
        counter(
            &mut encoder,
            "quiver_tls_handshakes_refused",
            "New TLS connections closed before their handshake: over the shard's tls.handshakes_per_s_max.",
            m.counters.tls_handshakes_refused,
        )?;
        counter(
            &mut encoder,
            "quiver_backends_prebuilt",
            "Backends of newly served model versions a shard took ready-built from the admin side.",
            m.counters.backends_prebuilt,
        )?;
        counter(
            &mut encoder,
            "quiver_backends_built_on_shard",
            "Backends a shard built on its own reactor (start-up, or a version not built ahead).",
            m.counters.backends_built_on_shard,
        )?;
        if let Some(feed) = readiness.feed() {
            encode_feed(&mut encoder, feed)?;
        }
        if let Some(log) = &self.state.decision_log {
            encode_decision_log(&mut encoder, &m.counters, log)?;
        }
        if let Some(feast) = &self.state.feast {
            encode_feast(&mut encoder, feast)?;
        }
        if let Some(oip) = &self.state.oip {
            let mut e = encoder.encode_descriptor(
                "quiver_oip_requests",
                "v2 (Open Inference Protocol) inference requests, by transport and outcome.",
                None,
                MetricType::Counter,
            )?;
            for (p, protocol) in crate::metrics::OIP_PROTOCOLS.iter().enumerate() {
                for (s, status) in crate::metrics::OIP_STATUSES.iter().enumerate() {
                    let labels = [("protocol", *protocol), ("status", *status)];
                    e.encode_family(&labels)?.encode_counter::<NoLabelSet, _, u64>(&oip.get(p, s), None)?;
                }
            }
        }
        encode_drift(&mut encoder, &drift_reports(&m, registry.drift()))?;
        let mut e =
            encoder.encode_descriptor("quiver_model", "Model versions being served.", None, MetricType::Info)?;
        for st in registry.status() {
            let version = st.version.to_string();
            // What the shards report scoring the version with; the
            // configured backend until a shard has published.
            let serving = m.backends.get(&(st.name.clone(), st.version, false)).copied().unwrap_or(backend.as_str());
            let labels = [("model", st.name.as_str()), ("version", version.as_str()), ("backend", serving)];
            e.encode_info(&labels)?;
        }
        let mut e = encoder.encode_descriptor(
            "quiver_kernel",
            "The INT8 kernel of each version scored by the CPU INT8 backend.",
            None,
            MetricType::Info,
        )?;
        for st in registry.status() {
            let serving = m.backends.get(&(st.name.clone(), st.version, false)).copied().unwrap_or(backend.as_str());
            if serving == "cpu-int8" || serving == "int8" {
                let version = st.version.to_string();
                e.encode_info(&[("model", st.name.as_str()), ("version", version.as_str()), ("kernel", *kernel)])?;
            }
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

/// `[feast]`: per served view (its group), the first sync (rows copied,
/// null or absent values, held), the rows now, bad data skipped, and the
/// follower's writes; then the follower's events, queue and reconciliation.
fn encode_feast(
    encoder: &mut DescriptorEncoder,
    feast: &crate::features::feast::FeastStatus,
) -> Result<(), std::fmt::Error> {
    use crate::features::feast::follow::ViewStatus;
    type Get = fn(&ViewStatus) -> u64;
    let gauges: [(&str, &str, Get); 5] = [
        ("quiver_feast_rows", "Entities the view's replica holds now.", |v| v.live_rows.load(Relaxed)),
        (
            "quiver_feast_values_missing",
            "Null or absent features among the rows the first sync copied (NaN in the replica).",
            |v| v.values_missing.load(Relaxed),
        ),
        (
            "quiver_feast_sync_held",
            "1 when start-up found Redis emptied, or the first sync's copy would have shrunk a populated replica \
             past feast.shrink_max: the file is kept.",
            |v| u64::from(v.held.load(Relaxed)),
        ),
        (
            "quiver_feast_resumed",
            "1 when start-up resumed from the view's file (written for these definitions) without a full copy.",
            |v| u64::from(v.resumed.load(Relaxed)),
        ),
        ("quiver_feast_rows_copied", "Entities the first sync copied into the view's replica (0: none ran).", |v| {
            v.rows_copied.load(Relaxed)
        }),
    ];
    for (name, help, get) in gauges {
        let mut e = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for v in &feast.views {
            e.encode_family(&[("group", v.name.as_str())])?.encode_gauge(&(get(v) as i64))?;
        }
    }
    let counters: [(&str, &str, Get); 4] = [
        (
            "quiver_feast_skipped",
            "Entities of the view skipped as bad data by the first sync and the follower (a key or value that does \
             not decode, another project's key, an unserved value type).",
            |v| v.skipped_total.load(Relaxed),
        ),
        ("quiver_feast_applied", "Rows the follower wrote in place after a keyspace event or a reconciliation.", |v| {
            v.applied_total.load(Relaxed)
        }),
        ("quiver_feast_deleted", "Rows the follower removed: the entity's key or the view's fields are gone.", |v| {
            v.deleted_total.load(Relaxed)
        }),
        (
            "quiver_feast_deletes_held",
            "Removals the follower held back: they would have shrunk the view past feast.shrink_max of the most \
             rows it held (a flushed or emptied Redis).",
            |v| v.deletes_held_total.load(Relaxed),
        ),
    ];
    for (name, help, get) in counters {
        let mut e = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for v in &feast.views {
            e.encode_family(&[("group", v.name.as_str())])?.encode_counter::<NoLabelSet, _, u64>(&get(v), None)?;
        }
    }
    if !feast.following.load(Relaxed) {
        return Ok(());
    }
    type GetAll = fn(&crate::features::feast::FeastStatus) -> u64;
    let totals: [(&str, &str, GetAll); 11] = [
        ("quiver_feast_events", "Keyspace events of the project's keys received.", |f| f.events_total.load(Relaxed)),
        (
            "quiver_feast_events_dropped",
            "Keyspace events dropped because feast.queue_keys_max keys were queued (a reconciliation pass finds \
             their changes).",
            |f| f.events_dropped_total.load(Relaxed),
        ),
        ("quiver_feast_reconciled_keys", "Keys the reconciliation compared with their rows.", |f| {
            f.reconciled_keys_total.load(Relaxed)
        }),
        ("quiver_feast_reconcile_rereads", "Keys the reconciliation re-read because their _ts: field moved.", |f| {
            f.reconcile_rereads_total.load(Relaxed)
        }),
        ("quiver_feast_reconcile_passes", "Whole passes of the reconciliation over the project's keys.", |f| {
            f.reconcile_passes_total.load(Relaxed)
        }),
        ("quiver_feast_reconcile_rounds", "Reconciliation rounds run.", |f| f.reconcile_rounds_total.load(Relaxed)),
        ("quiver_feast_swept_rows", "Replica rows the sweep checked against Redis (keys deleted unannounced).", |f| {
            f.swept_rows_total.load(Relaxed)
        }),
        ("quiver_feast_sweep_rereads", "Entities the sweep re-read because their view's _ts: field was gone.", |f| {
            f.sweep_rereads_total.load(Relaxed)
        }),
        ("quiver_feast_sweep_passes", "Whole passes of the sweep over every view's replica rows.", |f| {
            f.sweep_passes_total.load(Relaxed)
        }),
        ("quiver_feast_connect_failures", "Sessions of the follower with Redis that failed.", |f| {
            f.connect_failures_total.load(Relaxed)
        }),
        (
            "quiver_feast_topology_changes",
            "Times a Redis Cluster's topology changed and the follower subscribed to its masters again.",
            |f| f.topology_changes_total.load(Relaxed),
        ),
    ];
    for (name, help, get) in totals {
        encoder
            .encode_descriptor(name, help, None, MetricType::Counter)?
            .encode_counter::<NoLabelSet, _, u64>(&get(feast), None)?;
    }
    let gauges: [(&str, &str, GetAll); 4] = [
        (
            "quiver_feast_reconcile_round_keys_max",
            "The most keys one reconciliation round compared (at most feast.reconcile_keys_max).",
            |f| f.reconcile_round_keys_max.load(Relaxed),
        ),
        ("quiver_feast_connected", "1 while the follower is connected to Redis.", |f| {
            u64::from(f.connected.load(Relaxed))
        }),
        ("quiver_feast_queue_keys", "Keys queued for a read after their keyspace events.", |f| {
            f.queue_keys.load(Relaxed)
        }),
        (
            "quiver_feast_queue_wait_us",
            "The longest a key of the follower's last batch waited between its event and its read, in microseconds.",
            |f| f.queue_wait_us.load(Relaxed),
        ),
    ];
    for (name, help, get) in gauges {
        encoder.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_gauge(&(get(feast) as i64))?;
    }
    Ok(())
}

/// The Redis feed's state: per-group position, staleness and counts, and
/// the connection.
fn encode_feed(encoder: &mut DescriptorEncoder, feed: &FeedStatus) -> Result<(), std::fmt::Error> {
    let now_ns = MonotonicClock::new().now_ns();
    let now_unix_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let seconds = Unit::Seconds;
    type Get = fn(&GroupStatus, u64, u64) -> f64;
    let gauges: [(&str, &str, Option<&Unit>, Get); 8] = [
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
        (
            "quiver_replica_verifying",
            "1 while the file opened at start-up is scanned in the background; reads check row CRCs meanwhile.",
            None,
            |g, _, _| f64::from(u8::from(g.verifying.load(Relaxed))),
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
    let counters: [(&str, &str, Count); 7] = [
        ("quiver_replica_changes_applied", "Stream entries applied.", |g| g.applied_total.load(Relaxed)),
        ("quiver_replica_skipped", "Keys and stream entries skipped as bad data.", |g| g.skipped_total.load(Relaxed)),
        ("quiver_replica_resyncs", "Full resyncs from Redis.", |g| g.resyncs_total.load(Relaxed)),
        ("quiver_replica_resync_restarts", "Resync copies begun again because Redis moved under them.", |g| {
            g.resync_restarts_total.load(Relaxed)
        }),
        ("quiver_replica_torn_rows_repaired", "Rows found mid-write at open and dropped until replayed.", |g| {
            g.torn_rows_repaired.load(Relaxed)
        }),
        (
            "quiver_replica_key_collisions",
            "Reads of a string key that found another key under its hash (a miss, never the other key's row).",
            |g| g.key_collisions.load(Relaxed),
        ),
        (
            "quiver_replica_key_displacements",
            "String keys written over another key under the same hash (that key is then unknown).",
            |g| g.key_displacements.load(Relaxed),
        ),
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
    encoder
        .encode_descriptor(
            "quiver_feed_disk_errors",
            "Refresher sessions ended by the replica's files (a full disk, a read-only file system), not Redis.",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&feed.disk_errors_total.load(Relaxed), None)?;
    encoder
        .encode_descriptor(
            "quiver_feed_checkpoint_failures",
            "Replica checkpoints that failed to reach the disk.",
            None,
            MetricType::Counter,
        )?
        .encode_counter::<NoLabelSet, _, u64>(&feed.checkpoint_failures_total.load(Relaxed), None)?;
    Ok(())
}

/// The decision log: what the shards put in their rings or dropped, and
/// what the writer made of it.
fn encode_decision_log(
    encoder: &mut DescriptorEncoder,
    counters: &crate::metrics::Counters,
    log: &crate::decision_log::LogStatus,
) -> Result<(), std::fmt::Error> {
    let mut e = encoder.encode_descriptor(
        "quiver_log_dropped",
        "Decisions sampled for the log and lost: the shard's ring full (the writer behind) or too small for one, \
         a failed write (disk full, directory unwritable), a record the writer could not read.",
        None,
        MetricType::Counter,
    )?;
    for (reason, n) in [
        ("ring_full", counters.log_dropped_ring_full),
        ("too_large", counters.log_dropped_too_large),
        ("write_error", log.dropped_write_error.load(Relaxed)),
        ("bad_record", log.dropped_bad_record.load(Relaxed)),
    ] {
        e.encode_family(&[("reason", reason)])?.encode_counter::<NoLabelSet, _, u64>(&n, None)?;
    }
    for (name, help, n) in [
        ("quiver_log_records", "Decisions the shards put in their decision-log rings.", counters.log_records),
        ("quiver_log_decisions_written", "Logged decisions in closed segments.", log.decisions_written.load(Relaxed)),
        ("quiver_log_rows_written", "Rows (one per candidate) in closed segments.", log.rows_written.load(Relaxed)),
        (
            "quiver_log_segments",
            "Decision-log segments closed and renamed into place.",
            log.segments_closed.load(Relaxed),
        ),
        ("quiver_log_bytes", "Bytes of the segments closed.", log.bytes_closed.load(Relaxed)),
        (
            "quiver_log_write_errors",
            "Failed creates, writes, syncs, renames and deletes in the decision-log directory.",
            log.write_errors.load(Relaxed),
        ),
        (
            "quiver_log_segments_deleted",
            "Segments deleted by log.retention_bytes_max.",
            log.segments_deleted.load(Relaxed),
        ),
    ] {
        encoder
            .encode_descriptor(name, help, None, MetricType::Counter)?
            .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
    }
    encoder
        .encode_descriptor(
            "quiver_log_writer_idle",
            "1 while the decision-log writer runs as SCHED_IDLE (log.writer_priority = \"idle\"), so it never \
             delays a thread of its core; 0 at the default priority (asked for, or SCHED_IDLE refused: see the log).",
            None,
            MetricType::Gauge,
        )?
        .encode_gauge(&i64::from(log.writer_idle.load(Relaxed)))?;
    Ok(())
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
        ("quiver_input_mean", "Mean of a per-request input over the drift window.", |f| f.mean),
        ("quiver_input_variance", "Variance of a per-request input over the drift window.", |f| f.variance),
    ];
    for (name, help, get) in gauges {
        let mut e = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (i, r) in reports.iter().enumerate() {
            for f in &r.features {
                let [model, version] = labels(i);
                e.encode_family(&[model, version, ("feature", f.name.as_str())])?.encode_gauge(&get(f))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::auth;
    use crate::metrics::{board, fold, Readiness, Report};
    use crate::registry::Registry;
    use crate::request::Counters;
    use prometheus_client::registry::Registry as Registry_;

    #[test]
    fn feed_groups_export_string_key_collisions_and_displacements() {
        #[derive(Debug)]
        struct Feed(FeedStatus);
        impl prometheus_client::collector::Collector for Feed {
            fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
                encode_feed(&mut encoder, &self.0)
            }
        }
        let status = FeedStatus::new(&["user", "device"], 1000, crate::features::feed::StalePolicy::Flag, 0);
        status.groups[1].key_collisions.store(3, Relaxed);
        status.groups[1].key_displacements.store(2, Relaxed);
        let mut registry = Registry_::default();
        registry.register_collector(Box::new(Feed(status)));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("quiver_replica_key_collisions_total{group=\"device\"} 3"), "{text}");
        assert!(text.contains("quiver_replica_key_collisions_total{group=\"user\"} 0"), "{text}");
        assert!(text.contains("quiver_replica_key_displacements_total{group=\"device\"} 2"), "{text}");
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
        let fit = crate::registry::Fit::user_item(32, 32, 256);
        let mut model = crate::loadgen::demo::model();
        model.name = "m".into();
        model.version = 2;
        let models = Registry::from_models(vec![model], fit, crate::score::BackendKind::Int8, 8).unwrap();
        let mut registry = Registry_::default();
        let state = AdminState {
            board: b,
            readiness: Arc::new(Readiness::ready()),
            registry: Arc::new(models),
            backend: "cpu-int8".into(),
            kernel: "amx",
            faults: None,
            token: None,
            refusals: auth::Refusals::default(),
            http: Default::default(),
            groups: Vec::new(),
            decision_log: None,
            oip: None,
            feast: Some(Arc::new(crate::features::feast::FeastStatus {
                views: vec![crate::features::feast::follow::ViewStatus {
                    name: "user_stats".into(),
                    live_rows: 7.into(),
                    skipped_total: 2.into(),
                    held: true.into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
        };
        state.refusals.record(1, None, "POST", "/drain");
        registry.register_collector(Box::new(QuiverCollector { state: Arc::new(state) }));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("quiver_requests_total{status=\"ok\"} 4"), "{text}");
        assert!(text.contains("quiver_feast_rows{group=\"user_stats\"} 7"), "{text}");
        assert!(text.contains("quiver_feast_skipped_total{group=\"user_stats\"} 2"), "{text}");
        assert!(text.contains("quiver_feast_sync_held{group=\"user_stats\"} 1"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_count 4"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"1e-05\"} 1"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"0.001\"} 3"), "{text}");
        assert!(text.contains("quiver_request_duration_seconds_bucket{le=\"+Inf\"} 4"), "{text}");
        assert!(text.contains("quiver_model_info{model=\"m\",version=\"2\",backend=\"cpu-int8\"} 1"), "{text}");
        assert!(text.contains("quiver_kernel_info{model=\"m\",version=\"2\",kernel=\"amx\"} 1"), "{text}");
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
