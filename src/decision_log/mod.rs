//! The decision log (`[log]`): a sample of decisions, each with what the
//! kernel saw (the assembled input rows), the keys, the scores and how the
//! decision was made (model version, tier, reason, status, times), written
//! as Arrow IPC files a data team reads without Quiver (docs/OPERATING.md,
//! "Decision logs").
//!
//! Named `decision_log` so it is never taken for the process's tracing log.
//!
//! Off the request path by construction: a shard decides per request
//! whether to log it ([`Sampler`]: keyed by a group's key, so a sampled
//! card has all its decisions logged, or by request id; always for the
//! rules in `always`), encodes the record straight into its own bounded
//! byte ring (`byte_ring.rs`, allocated at start-up) and goes on; a full ring
//! drops the record and counts it. The writer thread (`writer/`, on the
//! housekeeping cores) drains every ring and writes rotating segment files;
//! its failures (a full disk, an unwritable directory) are counted and
//! logged, and never reach a shard. `read.rs` reads segments back for
//! `quiver log dump` and `quiver log inspect`; `replay.rs` scores their
//! rows again for `quiver log replay`; `to_parquet.rs` rewrites them as
//! Parquet for `quiver log parquet`.
//!
//! The sampling can change while serving (`sampling.rs`: `POST /log`,
//! [`Sampling`]): each shard loads the sampler in force per decision it
//! may log.

pub mod byte_ring;
pub mod read;
pub mod record;
pub mod replay;
pub mod sampling;
pub mod to_parquet;
pub mod writer;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::deadline::{Clock, MonotonicClock};

pub use byte_ring::{Consumer, Producer, Refused, Ring, RING_BYTES_MAX, RING_BYTES_MIN};
pub use sampling::{
    check_key_group, parse_change, LogChange, RateChange, Rates, SampleKey, Sampler, Sampling, CHANGE_USAGE,
    SAMPLE_BUCKETS,
};

/// Smallest segment before it is closed by size.
pub const SEGMENT_BYTES_MIN: u64 = 64 * 1024;
/// Largest segment: the writer buffers at most a batch of it in memory,
/// and a reader takes a whole file.
pub const SEGMENT_BYTES_MAX: u64 = 16 << 30;
/// Longest a segment stays open (and so the most a `kill -9` loses, in time).
pub const SEGMENT_AGE_S_MAX: u64 = 24 * 3600;
/// Models, and clients, with a rate of their own.
pub const RATES_MAX: usize = 256;

/// Decisions logged whatever the sample says.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Always {
    /// Answered `Ok` by a rung below the primary (cached, fallback, default).
    NonPrimary,
    /// Answered with a status other than `Ok`, once the request was
    /// decoded and its model chosen.
    Errors,
}

/// How the writer thread is scheduled (`writer_priority`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WriterPriority {
    /// `SCHED_IDLE`: the writer runs only on time no other thread of its
    /// core wants, and a waking shard (or any thread) preempts it at once.
    #[default]
    Idle,
    /// The default policy, at the process's priority: the writer competes
    /// for its core as an equal (for housekeeping cores so busy that an
    /// idle writer would fall behind), and may hold a core a shard shares
    /// for a scheduler slice, milliseconds.
    Normal,
}

/// `[log]`: which decisions are logged, where, and the sizes that bound it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Where segments are written; required when anything is logged.
    pub dir: Option<PathBuf>,
    /// Share of decisions logged, 0 to 1; 0 (the default) logs none but
    /// those `always` names.
    pub sample_rate: f64,
    /// A request-scope group whose key decides the sample (sticky: a key's
    /// decisions are all logged or none are); absent: the request id.
    pub key_group: Option<String>,
    /// A model's own share, 0 to 1, in place of `sample_rate`, by model name.
    pub model_sample_rates: BTreeMap<String, f64>,
    /// A client's own share, 0 to 1, by client id (in quotes: TOML keys are
    /// strings), in place of the model's and `sample_rate`.
    pub client_sample_rates: BTreeMap<String, f64>,
    /// Bytes of each shard's ring, allocated at start-up.
    pub ring_bytes: usize,
    /// A segment is closed once it holds this many bytes.
    pub segment_bytes_max: u64,
    /// A segment is closed once it is this old.
    pub segment_age_s: u64,
    /// The oldest segments are deleted while the closed ones hold more.
    pub retention_bytes_max: u64,
    /// Decisions logged whatever the sample says.
    pub always: Vec<Always>,
    /// A decision a shadow version also scored is logged whatever the
    /// sample says when, for some candidate, |returned score − shadow
    /// score| exceeds this (in the model's output units); absent, none is.
    /// Such a decision's record waits for the shadow's scores and holds
    /// them (`shadow_score`).
    pub always_log_shadow_diff: Option<f64>,
    /// How the writer thread is scheduled.
    pub writer_priority: WriterPriority,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            dir: None,
            sample_rate: 0.0,
            key_group: None,
            model_sample_rates: BTreeMap::new(),
            client_sample_rates: BTreeMap::new(),
            ring_bytes: 16 << 20,
            segment_bytes_max: 256 << 20,
            segment_age_s: 300,
            retention_bytes_max: 16 << 30,
            always: Vec::new(),
            always_log_shadow_diff: None,
            writer_priority: WriterPriority::Idle,
        }
    }
}

impl LogConfig {
    /// Whether the log runs: a directory is set (at rate 0 too, so that
    /// `POST /log` can turn sampling on later).
    pub fn runs(&self) -> bool {
        self.dir.is_some()
    }

    /// Whether any decision can be logged as configured.
    pub fn enabled(&self) -> bool {
        self.sample_rate > 0.0
            || !self.always.is_empty()
            || self.always_log_shadow_diff.is_some()
            || self.model_sample_rates.values().chain(self.client_sample_rates.values()).any(|&r| r > 0.0)
    }

    pub fn validate(&self) -> Result<(), String> {
        check_rate("log.sample_rate", self.sample_rate)?;
        for (name, rate) in &self.model_sample_rates {
            check_rate(&format!("log.model_sample_rates.{name}"), *rate)?;
        }
        for (client, rate) in &self.client_sample_rates {
            parse_client(client).map_err(|why| format!("log.client_sample_rates: {why}"))?;
            check_rate(&format!("log.client_sample_rates.{client}"), *rate)?;
        }
        for (what, n) in [("model", self.model_sample_rates.len()), ("client", self.client_sample_rates.len())] {
            if n > RATES_MAX {
                return Err(format!("log.{what}_sample_rates has {n} entries, at most {RATES_MAX}"));
            }
        }
        if let Some(diff) = self.always_log_shadow_diff {
            if !(diff.is_finite() && diff >= 0.0) {
                return Err(format!("log.always_log_shadow_diff = {diff} is not a finite number >= 0"));
            }
        }
        if self.enabled() && self.dir.is_none() {
            return Err(
                "log.dir is required when log.sample_rate > 0, log.always or log.always_log_shadow_diff is set".into(),
            );
        }
        if !(RING_BYTES_MIN..=RING_BYTES_MAX).contains(&self.ring_bytes) {
            return Err(format!("log.ring_bytes = {} is outside {RING_BYTES_MIN}..={RING_BYTES_MAX}", self.ring_bytes));
        }
        if !(SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&self.segment_bytes_max) {
            return Err(format!(
                "log.segment_bytes_max = {} is outside {SEGMENT_BYTES_MIN}..={SEGMENT_BYTES_MAX}",
                self.segment_bytes_max
            ));
        }
        if !(1..=SEGMENT_AGE_S_MAX).contains(&self.segment_age_s) {
            return Err(format!("log.segment_age_s = {} is outside 1..={SEGMENT_AGE_S_MAX}", self.segment_age_s));
        }
        if self.retention_bytes_max < self.segment_bytes_max {
            return Err(format!(
                "log.retention_bytes_max = {} is below log.segment_bytes_max = {}: not one segment would be kept",
                self.retention_bytes_max, self.segment_bytes_max
            ));
        }
        Ok(())
    }
}

/// A rate outside 0..=1 (or not a number), named.
pub fn check_rate(what: &str, rate: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&rate) {
        Ok(())
    } else {
        Err(format!("{what} = {rate} is outside 0..=1"))
    }
}

/// A client id as `client_sample_rates` and `POST /log` name it.
pub fn parse_client(text: &str) -> Result<u32, String> {
    text.parse().map_err(|_| format!("client '{text}' is not a client id (0..=4294967295)"))
}

/// A shard's side of the log: its ring's producer and what to log.
/// `!Send` (through [`Producer`]): made and used on its shard.
pub struct ShardLog {
    producer: Producer,
    pub sampling: Arc<Sampling>,
    /// Wall-clock ns since the epoch at the shards' clock's zero
    /// ([`LogRings::new`]): a read time on that clock plus this is the
    /// receive time recorded, with no clock read on the shard.
    pub wall_offset_ns: i64,
    /// Records put in the ring, and dropped before it (full; too large
    /// for it), counted here and published with the shard's counters.
    pub records: u64,
    pub dropped_ring_full: u64,
    pub dropped_too_large: u64,
}

impl ShardLog {
    /// Encodes `decision` into the ring, or counts it dropped; never waits.
    pub fn put(&mut self, decision: &record::DecisionRef<'_>) {
        let len = decision.encoded_len();
        match self.producer.push(len, |out| decision.encode(out)) {
            Ok(()) => self.records += 1,
            Err(Refused::Full) => self.dropped_ring_full += 1,
            Err(Refused::TooLarge) => self.dropped_too_large += 1,
        }
    }
}

/// The rings of every shard and what each shard needs to log: shared by
/// the shards (each takes its own producer once, on its thread) and the
/// server, which hands the consumers to the writer.
#[derive(Clone)]
pub struct LogRings {
    rings: Vec<Ring>,
    pub sampling: Arc<Sampling>,
    wall_offset_ns: i64,
}

impl std::fmt::Debug for LogRings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogRings").field("shards", &self.rings.len()).field("sampler", &*self.sampling.load()).finish()
    }
}

impl LogRings {
    /// Allocates one ring of `config.ring_bytes` per shard, and reads the
    /// wall clock against the shards' clock (`MonotonicClock`, whose zero
    /// is process-wide) once; a later step of the wall clock is not seen.
    pub fn new(config: &LogConfig, shards: usize) -> LogRings {
        let wall_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        let mono_ns = i64::try_from(MonotonicClock::new().now_ns()).unwrap_or(i64::MAX);
        LogRings {
            rings: (0..shards).map(|_| Ring::new(config.ring_bytes)).collect(),
            sampling: Arc::new(Sampling::new(config)),
            wall_offset_ns: wall_ns.saturating_sub(mono_ns),
        }
    }

    /// Shard `shard`'s side, made on that shard's thread; `None` for a
    /// shard without a ring or whose producer was taken.
    pub fn shard(&self, shard: usize) -> Option<ShardLog> {
        let producer = self.rings.get(shard)?.producer()?;
        Some(ShardLog {
            producer,
            sampling: self.sampling.clone(),
            wall_offset_ns: self.wall_offset_ns,
            records: 0,
            dropped_ring_full: 0,
            dropped_too_large: 0,
        })
    }

    /// The popping ends, in shard order, for the writer: `None` once they
    /// were taken (there is one writer).
    pub fn consumers(&self) -> Option<Vec<Consumer>> {
        self.rings.iter().map(Ring::consumer).collect()
    }
}

/// What the writer did, for `/metrics`. Cross-thread: the writer thread
/// stores, the admin endpoint loads; plain counters, relaxed.
#[derive(Debug, Default)]
pub struct LogStatus {
    /// Decisions written into segments, and their rows (one per candidate).
    pub decisions_written: AtomicU64,
    pub rows_written: AtomicU64,
    /// Segments closed and renamed into place, and their bytes.
    pub segments_closed: AtomicU64,
    pub bytes_closed: AtomicU64,
    /// Failed creates, writes, syncs and renames (the disk, the directory).
    pub write_errors: AtomicU64,
    /// Decisions lost to those failures.
    pub dropped_write_error: AtomicU64,
    /// Decisions the writer could not read (never expected).
    pub dropped_bad_record: AtomicU64,
    /// Segments deleted by the retention limit.
    pub segments_deleted: AtomicU64,
    /// Whether the writer thread runs as `SCHED_IDLE` (false while it
    /// starts, under `writer_priority = "normal"`, or when it was refused).
    pub writer_idle: AtomicBool,
    /// The rates in force, which `POST /log` changes (set once at start-up).
    pub sampling: std::sync::OnceLock<Arc<Sampling>>,
}

impl LogStatus {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn config(text: &str) -> Result<LogConfig, String> {
        let c: LogConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map(|()| c)
    }

    #[test]
    fn the_config_is_checked_with_clear_errors() {
        assert_eq!(config("").unwrap(), LogConfig::default());
        assert!(!LogConfig::default().enabled());
        let c = config("dir = \"/tmp/x\"\nsample_rate = 0.1\nkey_group = \"card\"\nalways = [\"errors\"]\n").unwrap();
        assert_eq!(
            (c.sample_rate, c.key_group.as_deref(), c.always.as_slice()),
            (0.1, Some("card"), &[Always::Errors][..])
        );
        for (text, want) in [
            ("sample_rate = 1.5\ndir = \"d\"\n", "log.sample_rate = 1.5 is outside 0..=1"),
            ("sample_rate = -0.1\ndir = \"d\"\n", "log.sample_rate = -0.1 is outside 0..=1"),
            (
                "sample_rate = 0.5\n",
                "log.dir is required when log.sample_rate > 0, log.always or log.always_log_shadow_diff is set",
            ),
            (
                "always = [\"errors\"]\n",
                "log.dir is required when log.sample_rate > 0, log.always or log.always_log_shadow_diff is set",
            ),
            (
                "always_log_shadow_diff = 0.1\n",
                "log.dir is required when log.sample_rate > 0, log.always or log.always_log_shadow_diff is set",
            ),
            (
                "always_log_shadow_diff = -0.1\ndir = \"d\"\n",
                "log.always_log_shadow_diff = -0.1 is not a finite number >= 0",
            ),
            (
                "always_log_shadow_diff = nan\ndir = \"d\"\n",
                "log.always_log_shadow_diff = NaN is not a finite number >= 0",
            ),
            ("ring_bytes = 1024\n", "log.ring_bytes = 1024 is outside 65536..=1073741824"),
            ("segment_bytes_max = 0\n", "log.segment_bytes_max = 0 is outside 65536..=17179869184"),
            ("segment_age_s = 0\n", "log.segment_age_s = 0 is outside 1..=86400"),
            (
                "segment_bytes_max = 1048576\nretention_bytes_max = 65536\n",
                "log.retention_bytes_max = 65536 is below log.segment_bytes_max = 1048576: not one segment would \
                 be kept",
            ),
        ] {
            assert_eq!(config(text).unwrap_err(), want, "{text}");
        }
        assert!(config("always = [\"shadows\"]\n").unwrap_err().contains("unknown variant"));
        assert!(config("rate = 1\n").unwrap_err().contains("unknown field"));
    }

    #[test]
    fn each_shard_takes_its_producer_once_and_drops_are_counted() {
        let rings = LogRings::new(&LogConfig { ring_bytes: RING_BYTES_MIN, ..LogConfig::default() }, 2);
        let mut log = rings.shard(0).unwrap();
        assert!(rings.shard(0).is_none());
        assert!(rings.shard(2).is_none());
        let x = vec![0.5f32; 16 * 64];
        let d = record::DecisionRef {
            request_id: 1,
            model: "m",
            model_version: 1,
            rows: 16,
            row_dim: 64,
            x: Some(&x),
            why: record::why::SAMPLE,
            ..record::DecisionRef::BLANK
        };
        for _ in 0..100 {
            log.put(&d);
        }
        // 4 KiB records: 15 fit in a 64 KiB ring, the rest are dropped.
        assert_eq!((log.records, log.dropped_ring_full), (15, 85));
        let mut consumers = rings.consumers().unwrap();
        let back =
            consumers[0].pop(|b| record::Decision::decode(b).map(|d| (d.request_id, d.rows, d.x.map(|x| x.len()))));
        assert_eq!(back, Some(Ok((1, 16, Some(1024)))));
        log.put(&d);
        assert_eq!(log.records, 16);
        let big = vec![0.0f32; RING_BYTES_MIN / 4];
        log.put(&record::DecisionRef { x: Some(&big), rows: 1, row_dim: big.len() as u32, ..d });
        assert_eq!(log.dropped_too_large, 1);
    }
}
