//! The decision-log writer: one thread on the housekeeping cores that
//! drains every shard's ring and writes segment files in the Arrow IPC
//! file format, one row per candidate. Arrow IPC for its write cost: the
//! same decisions took 3.7 times the CPU to encode as Parquet (for 0.46
//! times the bytes; docs/BENCHMARKS.md, "the file format's cost"), and
//! `quiver log parquet` makes the Parquet copy off the serving machine.
//!
//! A segment belongs to one shard and one layout (the input row's spans and
//! the key groups: the schema's columns); it is written as
//! `decisions-<UTC time>-shard<N>-<seq>.arrow.tmp`, in LZ4-compressed
//! batches of at most [`BATCH_ROWS_MAX`] rows, and closed once it holds
//! `segment_bytes_max` bytes, is `segment_age_s` old, sees another layout
//! or the server stops: the footer is written, the file fsynced, renamed
//! without `.tmp` and the directory fsynced. A reader never sees a torn
//! segment, and a `kill -9` loses the open ones (at most `segment_age_s`
//! of each shard's decisions) as `.tmp` files, which the next start
//! deletes. After each close the oldest segments are deleted while the
//! closed ones hold more than `retention_bytes_max`.
//!
//! A failing disk or directory costs the open segment's decisions, counted
//! in [`LogStatus`] and logged at most every [`WARN_EVERY_S`]; the writer
//! then waits [`RETRY_AFTER_MS`] (dropping, counted, what arrives) before
//! it opens another. The shards never see it.
//!
//! The writer yields to the shards, even on a shard's core (a machine with
//! no housekeeping core to spare): it runs as `SCHED_IDLE`
//! (`writer_priority = "idle"`, the default), so it only gets the time
//! every other thread of its core leaves, and a waking shard preempts it
//! instead of waiting out its scheduler slice (milliseconds under CFS and
//! EEVDF, which is what a writer of the default policy cost a shard's p99
//! on a shared core). What it cannot write in that time stays in the
//! rings, and what no longer fits there is dropped and counted, never
//! waited for. On a kernel without full preemption a waking shard still
//! waits for the writer's system call in progress, so those are short:
//! a segment's bytes go to the kernel [`WRITE_BYTES`] at a time. A
//! refused `SCHED_IDLE` is a warning (`cores::IdleRefused`) and
//! `quiver_log_writer_idle` 0; the writer then runs at the default
//! priority. Yielding is not vanishing: the kernel still gives an idle
//! thread a sliver of a busy core, and on a core a shard kept 95% busy
//! that raised the shard's p99, as a busy loop under `SCHED_IDLE` did too
//! (docs/OPERATING.md, "Decision logs"): where logging matters, the
//! writer belongs on a housekeeping core of its own.
//!
//! Every batch's columns, and the Arrow IPC writer's compressed copy of
//! them, are allocated and freed again (Arrow arrays own their buffers).
//! glibc's malloc would hand those megabytes back to the kernel after each
//! batch and fault them in afresh for the next (`cargo bench --bench
//! decision_log` reports the writer's page faults per decision). So
//! starting a writer asks malloc, process-wide, to keep freed memory up
//! to [`KEEP_FREED_BYTES`] and to serve requests below [`MMAP_BYTES_MIN`]
//! from its heap (what a server that allocates at start-up never needed
//! returned anyway).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow_array::builder::{
    BooleanBuilder, Float32Builder, NullBufferBuilder, StringBuilder, TimestampNanosecondBuilder, UInt16Builder,
    UInt32Builder, UInt64Builder,
};
use arrow_array::{ArrayRef, Float32Array, RecordBatch};
use arrow_ipc::writer::{FileWriter, IpcWriteOptions};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef, TimeUnit};

use super::record::{why, Decision, Floats, Keys};
use super::{Consumer, LogConfig, LogStatus, WriterPriority};
use crate::wire::{self, Reason, Status, Tier};

/// Rows buffered before a batch is written to the open segment.
pub const BATCH_ROWS_MAX: usize = 8192;
/// Records taken from one ring before the writer turns to the next.
const DRAIN_RECORDS_MAX: usize = 4096;
/// How long the writer sleeps when every ring was empty.
const IDLE_SLEEP_MS: u64 = 5;
/// After a failure, how long before the writer opens another segment.
pub const RETRY_AFTER_MS: u64 = 1000;
/// At most one warning per this many seconds for write failures.
pub const WARN_EVERY_S: u64 = 10;
/// Bytes buffered before the open segment's bytes go to the kernel: one
/// `write` copies this much into the page cache, a few tens of
/// microseconds in which a shard sharing the core cannot preempt it.
pub const WRITE_BYTES: usize = 128 * 1024;
/// Freed memory glibc's malloc keeps for reuse before it trims its heap
/// (`M_TRIM_THRESHOLD`): past a 64 MiB arena heap, so a thread's arena is
/// never trimmed.
pub const KEEP_FREED_BYTES: i32 = 64 << 20;
/// Allocations from this size up are mapped and unmapped on their own
/// (`M_MMAP_THRESHOLD`, at glibc's largest); below, malloc's heap serves
/// them and keeps them when freed.
pub const MMAP_BYTES_MIN: i32 = 32 << 20;
/// Segment file names: `<PREFIX><time>-shard<N>-<seq><SUFFIX>`.
pub const PREFIX: &str = "decisions-";
pub const SUFFIX: &str = ".arrow";
const TMP_SUFFIX: &str = ".arrow.tmp";

/// The writer thread; stopping it drains the rings and closes every open
/// segment.
pub struct Writer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    /// Starts the thread over `consumers` (shard order). Fails only when
    /// the thread cannot be started; an unusable directory is the writer's
    /// to report while it runs.
    pub fn start(config: &LogConfig, consumers: Vec<Consumer>, status: Arc<LogStatus>) -> io::Result<Writer> {
        let dir = config.dir.clone().unwrap_or_default();
        let limits = Limits {
            segment_bytes_max: config.segment_bytes_max,
            segment_age: Duration::from_secs(config.segment_age_s),
            retention_bytes_max: config.retention_bytes_max,
        };
        let priority = config.writer_priority;
        keep_freed_memory();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name("quiver-declog".into()).spawn(move || {
                if priority == WriterPriority::Idle {
                    match crate::cores::make_current_thread_idle() {
                        Ok(()) => status.writer_idle.store(true, Ordering::Relaxed),
                        Err(e) => tracing::warn!(
                            error = %e,
                            "the decision-log writer runs at the default priority: on a core it shares with a \
                             shard it can delay responses by a scheduler slice"
                        ),
                    }
                }
                let mut rings = consumers;
                let mut w = Work {
                    dir,
                    limits,
                    status,
                    last_warn: None,
                    warnings_held: 0,
                    seq: 0,
                    shards: (0..rings.len()).map(|shard| ShardOut { shard, open: None, blocked_until: None }).collect(),
                };
                w.prepare();
                w.run(&mut rings, &stop);
            })?
        };
        Ok(Writer { stop, thread: Some(thread) })
    }

    /// Drains what the shards left in the rings, closes the open segments
    /// and joins the thread. Call after the shards stopped (dropping the
    /// writer does the same).
    pub fn stop(self) {}
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sets glibc malloc's trim and mmap thresholds (the module's header says
/// why). A refusal is a warning: the writer only runs slower.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only sets malloc's parameters, under malloc's own
    // lock: any thread may call it at any time.
    let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_FREED_BYTES) };
    // SAFETY: as above.
    let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_BYTES_MIN) };
    if trim != 1 || mmap != 1 {
        tracing::warn!("malloc refused its trim or mmap threshold: the decision-log writer faults its batches in anew");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory() {}

#[derive(Clone, Copy)]
struct Limits {
    segment_bytes_max: u64,
    segment_age: Duration,
    retention_bytes_max: u64,
}

struct Work {
    dir: PathBuf,
    limits: Limits,
    status: Arc<LogStatus>,
    last_warn: Option<Instant>,
    warnings_held: u64,
    /// Segments opened by this writer, for unique names.
    seq: u64,
    shards: Vec<ShardOut>,
}

/// One shard's open segment.
struct ShardOut {
    shard: usize,
    open: Option<Segment>,
    /// Set after a failure: decisions arriving before it are dropped.
    blocked_until: Option<Instant>,
}

/// What a segment's columns are made of: a decision of another layout
/// closes it.
#[derive(Clone, Debug, PartialEq)]
struct Layout {
    row_dim: u32,
    spans: Vec<(String, u32, u32)>,
    /// Group name, and whether its keys are strings.
    keys: Vec<(String, bool)>,
}

impl Layout {
    fn of(d: &Decision<'_>) -> Layout {
        Layout {
            row_dim: d.row_dim,
            spans: d.spans.clone(),
            keys: d.keys.iter().map(|(name, k)| (name.clone(), matches!(k, Keys::Strs(_)))).collect(),
        }
    }

    /// Whether `d` is of this layout (what `Layout::of(d) == *self` says,
    /// without building one per decision).
    fn matches(&self, d: &Decision<'_>) -> bool {
        self.row_dim == d.row_dim
            && self.spans == d.spans
            && self.keys.len() == d.keys.len()
            && self
                .keys
                .iter()
                .zip(&d.keys)
                .all(|((n, strs), (name, k))| n == name && *strs == matches!(k, Keys::Strs(_)))
    }

    /// Whether `d`, of another layout, can go in a segment of this one: it
    /// has no input rows and reads no other spans (a request refused before
    /// a model was chosen), and its keys are groups this layout has, of the
    /// same kind. Its feature columns are then null, and so are the key
    /// columns it lacks; an error between decisions does not close the
    /// segment.
    fn admits(&self, d: &Decision<'_>) -> bool {
        d.x.is_none()
            && (d.spans.is_empty() || d.spans == self.spans)
            && d.keys
                .iter()
                .all(|(name, k)| self.keys.iter().any(|(n, strs)| n == name && *strs == matches!(k, Keys::Strs(_))))
    }

    /// The spans that are feature groups (not the context): each has a
    /// `<group>_position` column.
    fn groups(&self) -> impl Iterator<Item = &str> {
        self.spans.iter().map(|(name, _, _)| name.as_str()).filter(|n| !matches!(*n, "context" | "context_id"))
    }

    /// The feature columns' names: `<span>[i]` for each float of a span,
    /// `x[i]` for one no span names.
    fn feature_names(&self) -> Vec<String> {
        let mut names: Vec<String> = (0..self.row_dim).map(|i| format!("x[{i}]")).collect();
        for (name, offset, dim) in &self.spans {
            for i in 0..*dim {
                if let Some(slot) = names.get_mut((offset + i) as usize) {
                    *slot = format!("{name}[{i}]");
                }
            }
        }
        names
    }

    fn schema(&self) -> SchemaRef {
        let mut fields = vec![
            Field::new("request_id", DataType::UInt64, false),
            Field::new("client_id", DataType::UInt32, false),
            Field::new("received", DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())), false),
            Field::new("model", DataType::Utf8, false),
            Field::new("model_version", DataType::UInt32, false),
            Field::new("status", DataType::Utf8, false),
            Field::new("tier", DataType::Utf8, true),
            Field::new("reason", DataType::Utf8, true),
            Field::new("budget_us", DataType::UInt32, false),
            Field::new("server_us", DataType::UInt32, false),
            Field::new("features_missing", DataType::UInt16, false),
            Field::new("features_stale", DataType::Boolean, false),
            Field::new("candidate", DataType::UInt32, true),
            Field::new("score", DataType::Float32, true),
            Field::new("sampled", DataType::Boolean, false),
            Field::new("always", DataType::Utf8, true),
            Field::new("shadow_version", DataType::UInt32, true),
            Field::new("shadow_score", DataType::Float32, true),
        ];
        for (name, strs) in &self.keys {
            let t = if *strs { DataType::Utf8 } else { DataType::UInt64 };
            fields.push(Field::new(format!("{name}_key"), t, true));
        }
        for name in self.groups() {
            fields.push(Field::new(format!("{name}_position"), DataType::UInt64, true));
        }
        for name in self.feature_names() {
            fields.push(Field::new(name, DataType::Float32, true));
        }
        Arc::new(Schema::new(fields))
    }
}

enum KeyColumn {
    Ids(UInt64Builder),
    Strs(StringBuilder),
}

/// The rows of a segment not yet written, column by column.
struct Batch {
    rows: usize,
    request_id: UInt64Builder,
    client_id: UInt32Builder,
    received: TimestampNanosecondBuilder,
    model: StringBuilder,
    model_version: UInt32Builder,
    status: StringBuilder,
    tier: StringBuilder,
    reason: StringBuilder,
    budget_us: UInt32Builder,
    server_us: UInt32Builder,
    features_missing: UInt16Builder,
    features_stale: BooleanBuilder,
    candidate: UInt32Builder,
    score: Float32Builder,
    sampled: BooleanBuilder,
    always: StringBuilder,
    shadow_version: UInt32Builder,
    shadow_score: Float32Builder,
    keys: Vec<KeyColumn>,
    /// Each group span's replica position, by span index.
    positions: Vec<(usize, UInt64Builder)>,
    /// The feature columns' values, column by column (most of a batch's
    /// bytes: filled by a strided copy per column, not one append per
    /// value), and which rows have them: a row has every feature or none.
    features: Vec<Vec<f32>>,
    features_valid: NullBufferBuilder,
    /// The decision being pushed's input rows as floats, row-major: the
    /// record's bytes copied once, then read a column at a time.
    x: Vec<f32>,
}

impl Batch {
    fn new(layout: &Layout) -> Batch {
        Batch {
            rows: 0,
            request_id: UInt64Builder::new(),
            client_id: UInt32Builder::new(),
            received: TimestampNanosecondBuilder::new(),
            model: StringBuilder::new(),
            model_version: UInt32Builder::new(),
            status: StringBuilder::new(),
            tier: StringBuilder::new(),
            reason: StringBuilder::new(),
            budget_us: UInt32Builder::new(),
            server_us: UInt32Builder::new(),
            features_missing: UInt16Builder::new(),
            features_stale: BooleanBuilder::new(),
            candidate: UInt32Builder::new(),
            score: Float32Builder::new(),
            sampled: BooleanBuilder::new(),
            always: StringBuilder::new(),
            shadow_version: UInt32Builder::new(),
            shadow_score: Float32Builder::new(),
            keys: layout
                .keys
                .iter()
                .map(
                    |(_, strs)| {
                        if *strs {
                            KeyColumn::Strs(StringBuilder::new())
                        } else {
                            KeyColumn::Ids(UInt64Builder::new())
                        }
                    },
                )
                .collect(),
            positions: (layout.spans.iter().enumerate())
                .filter(|(_, (name, _, _))| !matches!(name.as_str(), "context" | "context_id"))
                .map(|(i, _)| (i, UInt64Builder::new()))
                .collect(),
            features: (0..layout.row_dim).map(|_| Vec::new()).collect(),
            features_valid: NullBufferBuilder::new(0),
            x: Vec::new(),
        }
    }

    /// One row per candidate (one, without candidate or score, for a
    /// decision that has none: a failure), in the columns of `layout`. A
    /// value the decision's rows share is appended once for all of them.
    fn push(&mut self, layout: &Layout, d: &Decision<'_>) {
        let same_spans = d.spans == layout.spans;
        let ok = d.status == Status::Ok.0;
        let rows = (d.rows as usize).max(1);
        let row_dim = d.row_dim as usize;
        self.request_id.append_value_n(d.request_id, rows);
        self.client_id.append_value_n(d.client_id, rows);
        self.received.append_value_n(d.received_unix_ns, rows);
        self.model.append_value_n(&d.model, rows);
        self.model_version.append_value_n(d.model_version, rows);
        self.status.append_value_n(wire::status_name(Status(d.status)), rows);
        str_n(&mut self.tier, ok.then(|| wire::tier_name(Tier(d.tier))), rows);
        str_n(&mut self.reason, ok.then(|| wire::reason_name(Reason(d.reason))), rows);
        self.budget_us.append_value_n(d.budget_us, rows);
        self.server_us.append_value_n(d.server_us, rows);
        self.features_missing.append_value_n(d.features_missing, rows);
        self.features_stale.append_n(rows, d.features_stale);
        if d.rows == 0 {
            self.candidate.append_null();
        } else {
            self.candidate.extend((0..d.rows).map(Some));
        }
        floats_n(&mut self.score, d.scores, rows);
        self.sampled.append_n(rows, d.why & why::SAMPLE != 0);
        str_n(&mut self.always, why::always_name(d.why), rows);
        match d.shadow {
            Some((version, scores)) => {
                self.shadow_version.append_value_n(version, rows);
                floats_n(&mut self.shadow_score, Some(scores), rows);
            }
            None => {
                self.shadow_version.append_nulls(rows);
                self.shadow_score.append_nulls(rows);
            }
        }
        for (column, (name, _)) in self.keys.iter_mut().zip(&layout.keys) {
            // One key (a request-scope group) on every row; else the
            // candidate's own; none for a group the decision lacks.
            let keys = d.keys.iter().find(|(n, _)| n == name).map(|(_, k)| k);
            match (column, keys) {
                (KeyColumn::Ids(b), Some(Keys::Ids(v))) if v.len() == 1 => b.append_value_n(v[0], rows),
                (KeyColumn::Ids(b), Some(Keys::Ids(v))) => b.extend((0..rows).map(|i| v.get(i).copied())),
                (KeyColumn::Strs(b), Some(Keys::Strs(v))) if v.len() == 1 => b.append_value_n(&v[0], rows),
                (KeyColumn::Strs(b), Some(Keys::Strs(v))) => b.extend((0..rows).map(|i| v.get(i))),
                (KeyColumn::Ids(b), _) => b.append_nulls(rows),
                (KeyColumn::Strs(b), _) => b.append_nulls(rows),
            }
        }
        for (span, column) in &mut self.positions {
            match d.positions.get(*span).filter(|_| same_spans) {
                Some(&p) => column.append_value_n(p, rows),
                None => column.append_nulls(rows),
            }
        }
        // The input rows, when the decision has all of them in this
        // layout's width; else a null row per row written. Row-major in
        // the record, a column each here: float `j` of every row.
        let x = d.x.filter(|x| d.rows > 0 && row_dim == self.features.len() && x.len() >= rows * row_dim);
        match x {
            Some(x) => {
                x.copy_into(&mut self.x);
                let x = &self.x[..rows * row_dim];
                for (j, column) in self.features.iter_mut().enumerate() {
                    column.extend(x[j..].iter().step_by(row_dim));
                }
                self.features_valid.append_n_non_nulls(rows);
            }
            None => {
                for column in &mut self.features {
                    column.resize(column.len() + rows, 0.0);
                }
                self.features_valid.append_n_nulls(rows);
            }
        }
        self.rows += rows;
    }

    fn finish(&mut self, schema: SchemaRef) -> Result<RecordBatch, ArrowError> {
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(self.request_id.finish()),
            Arc::new(self.client_id.finish()),
            Arc::new(self.received.finish().with_timezone("UTC")),
            Arc::new(self.model.finish()),
            Arc::new(self.model_version.finish()),
            Arc::new(self.status.finish()),
            Arc::new(self.tier.finish()),
            Arc::new(self.reason.finish()),
            Arc::new(self.budget_us.finish()),
            Arc::new(self.server_us.finish()),
            Arc::new(self.features_missing.finish()),
            Arc::new(self.features_stale.finish()),
            Arc::new(self.candidate.finish()),
            Arc::new(self.score.finish()),
            Arc::new(self.sampled.finish()),
            Arc::new(self.always.finish()),
            Arc::new(self.shadow_version.finish()),
            Arc::new(self.shadow_score.finish()),
        ];
        for k in &mut self.keys {
            columns.push(match k {
                KeyColumn::Ids(b) => Arc::new(b.finish()),
                KeyColumn::Strs(b) => Arc::new(b.finish()),
            });
        }
        for (_, p) in &mut self.positions {
            columns.push(Arc::new(p.finish()));
        }
        let valid = self.features_valid.finish();
        for f in &mut self.features {
            let values = std::mem::replace(f, Vec::with_capacity(self.rows));
            columns.push(Arc::new(Float32Array::new(values.into(), valid.clone())));
        }
        self.rows = 0;
        RecordBatch::try_new(schema, columns)
    }
}

/// `value` (or null) on `n` rows.
fn str_n(b: &mut StringBuilder, value: Option<&str>, n: usize) {
    match value {
        Some(v) => b.append_value_n(v, n),
        None => b.append_nulls(n),
    }
}

/// The first `n` of `floats` (null past their end), or `n` nulls.
fn floats_n(b: &mut Float32Builder, floats: Option<Floats<'_>>, n: usize) {
    match floats {
        Some(f) => b.extend((0..n).map(|i| f.get(i))),
        None => b.append_nulls(n),
    }
}

/// A file writer that counts what it was given: the segment's size.
struct Counted {
    file: BufWriter<File>,
    bytes: u64,
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// An open segment.
struct Segment {
    layout: Layout,
    schema: SchemaRef,
    writer: FileWriter<Counted>,
    batch: Batch,
    tmp: PathBuf,
    path: PathBuf,
    opened: Instant,
    /// Bytes of one row before compression, roughly.
    row_bytes: u64,
    /// Decisions and rows taken into it, written or still in `batch`.
    decisions: u64,
    rows: u64,
}

fn io_error(e: ArrowError) -> io::Error {
    match e {
        ArrowError::IoError(_, e) => e,
        other => io::Error::other(other.to_string()),
    }
}

/// `YYYYmmddTHHMMSS.mmmZ` of a time since the epoch (UTC, proleptic
/// Gregorian: Howard Hinnant's `civil_from_days`).
pub fn utc_stamp(since_epoch: Duration) -> String {
    let secs = since_epoch.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since_epoch.subsec_millis()
    )
}

impl Work {
    /// Makes the directory and deletes the `.tmp` segments a killed
    /// process left (torn: never readable).
    fn prepare(&mut self) {
        if let Err(e) = std::fs::create_dir_all(&self.dir) {
            self.failed("creating the decision-log directory", &e, 0);
            return;
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(PREFIX) && name.ends_with(TMP_SUFFIX) && std::fs::remove_file(entry.path()).is_ok() {
                tracing::info!(file = %name, "deleted a decision-log segment left open by a stopped process");
            }
        }
    }

    /// Drains `rings` (one per shard, in shard order) until `stop`.
    fn run(&mut self, rings: &mut [Consumer], stop: &AtomicBool) {
        loop {
            // Read before draining: once set, the shards have stopped and
            // a pass that finds the rings empty is the last.
            let stopping = stop.load(Ordering::Acquire);
            let mut took = 0;
            for (at, ring) in rings.iter_mut().enumerate() {
                for _ in 0..DRAIN_RECORDS_MAX {
                    // The record is read in place: it leaves the ring once
                    // its rows are in the batch.
                    let taken = ring.pop(|b| match Decision::decode(b) {
                        Ok(d) => self.take(at, &d),
                        Err(e) => {
                            LogStatus::add(&self.status.dropped_bad_record, 1);
                            tracing::warn!(error = %e, "unreadable decision-log record dropped");
                        }
                    });
                    if taken.is_none() {
                        break;
                    }
                    took += 1;
                }
                self.tick(at);
            }
            if took == 0 {
                if stopping {
                    break;
                }
                std::thread::sleep(Duration::from_millis(IDLE_SLEEP_MS));
            }
        }
        for at in 0..self.shards.len() {
            self.close(at);
        }
    }

    fn take(&mut self, at: usize, d: &Decision<'_>) {
        let now = Instant::now();
        if let Some(until) = self.shards[at].blocked_until {
            if now < until {
                LogStatus::add(&self.status.dropped_write_error, 1);
                return;
            }
            self.shards[at].blocked_until = None;
        }
        if self.shards[at].open.as_ref().is_some_and(|s| !s.layout.matches(d) && !s.layout.admits(d)) {
            self.close(at);
        }
        if self.shards[at].open.is_none() {
            match self.open(self.shards[at].shard, Layout::of(d)) {
                Ok(s) => self.shards[at].open = Some(s),
                Err(e) => {
                    self.failed("opening a decision-log segment", &e, 1);
                    self.shards[at].blocked_until = Some(now + Duration::from_millis(RETRY_AFTER_MS));
                    return;
                }
            }
        }
        let Some(s) = self.shards[at].open.as_mut() else { return };
        s.batch.push(&s.layout, d);
        s.decisions += 1;
        s.rows += u64::from(d.rows.max(1));
        // Batches of a quarter segment at most, so a segment closes near
        // its size.
        let batch_rows_max = (self.limits.segment_bytes_max / 4 / s.row_bytes).clamp(1, BATCH_ROWS_MAX as u64);
        if s.batch.rows as u64 >= batch_rows_max {
            if let Err(e) = write_batch(s) {
                self.abandon(at, "writing a decision-log segment", &e);
                return;
            }
            // Here, not only between drain passes: one pass may take
            // thousands of decisions.
            if s.writer.get_ref().bytes >= self.limits.segment_bytes_max {
                self.close(at);
            }
        }
    }

    /// Closes the shard's segment when it is big or old enough.
    fn tick(&mut self, at: usize) {
        let Some(s) = &self.shards[at].open else { return };
        if s.writer.get_ref().bytes >= self.limits.segment_bytes_max || s.opened.elapsed() >= self.limits.segment_age {
            self.close(at);
        }
    }

    fn open(&mut self, shard: usize, layout: Layout) -> io::Result<Segment> {
        let stamp = utc_stamp(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default());
        self.seq += 1;
        let name = format!("{PREFIX}{stamp}-shard{shard:03}-{:06}", self.seq);
        let path = self.dir.join(format!("{name}{SUFFIX}"));
        let tmp = self.dir.join(format!("{name}{TMP_SUFFIX}"));
        std::fs::create_dir_all(&self.dir)?;
        let file = File::create(&tmp)?;
        let schema = layout.schema();
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(arrow_ipc::CompressionType::LZ4_FRAME))
            .map_err(io_error)?;
        let counted = Counted { file: BufWriter::with_capacity(WRITE_BYTES, file), bytes: 0 };
        let writer = match FileWriter::try_new_with_options(counted, &schema, options) {
            Ok(w) => w,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io_error(e));
            }
        };
        let batch = Batch::new(&layout);
        let row_bytes = 64 + 4 * u64::from(layout.row_dim) + 16 * layout.keys.len() as u64;
        Ok(Segment {
            layout,
            schema,
            writer,
            batch,
            tmp,
            path,
            opened: Instant::now(),
            row_bytes,
            decisions: 0,
            rows: 0,
        })
    }

    /// Writes, syncs and renames the shard's open segment into place.
    fn close(&mut self, at: usize) {
        let Some(mut s) = self.shards[at].open.take() else { return };
        match finish(&mut s) {
            Ok(bytes) => {
                let st = &self.status;
                LogStatus::add(&st.segments_closed, 1);
                LogStatus::add(&st.bytes_closed, bytes);
                LogStatus::add(&st.decisions_written, s.decisions);
                LogStatus::add(&st.rows_written, s.rows);
                self.retain();
            }
            Err(e) => {
                let _ = std::fs::remove_file(&s.tmp);
                self.failed("closing a decision-log segment", &e, s.decisions);
                self.shards[at].blocked_until = Some(Instant::now() + Duration::from_millis(RETRY_AFTER_MS));
            }
        }
    }

    /// Drops the shard's open segment after a failed write.
    fn abandon(&mut self, at: usize, what: &str, e: &io::Error) {
        if let Some(s) = self.shards[at].open.take() {
            let _ = std::fs::remove_file(&s.tmp);
            self.failed(what, e, s.decisions);
        }
        self.shards[at].blocked_until = Some(Instant::now() + Duration::from_millis(RETRY_AFTER_MS));
    }

    /// Counts a failure and the decisions it lost; warns at most every
    /// `WARN_EVERY_S`.
    fn failed(&mut self, what: &str, e: &io::Error, lost: u64) {
        LogStatus::add(&self.status.write_errors, 1);
        LogStatus::add(&self.status.dropped_write_error, lost);
        let due = self.last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(WARN_EVERY_S));
        if due {
            tracing::warn!(
                dir = %self.dir.display(),
                error = %e,
                held = self.warnings_held,
                "{what} failed: decisions are dropped (quiver_log_dropped_total{{reason=\"write_error\"}}); serving \
                 goes on"
            );
            self.last_warn = Some(Instant::now());
            self.warnings_held = 0;
        } else {
            self.warnings_held += 1;
        }
    }

    /// Deletes the oldest closed segments while they hold more than the
    /// retention limit (names sort by time), all but the newest.
    fn retain(&mut self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        let mut segments: Vec<(String, u64)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let closed = name.starts_with(PREFIX) && name.ends_with(SUFFIX);
                closed.then(|| (name, e.metadata().map_or(0, |m| m.len())))
            })
            .collect();
        segments.sort();
        let mut total: u64 = segments.iter().map(|(_, n)| n).sum();
        // Never the newest: a segment larger than the limit (a last batch
        // past `segment_bytes_max`) is kept until the next one closes.
        segments.pop();
        for (name, bytes) in segments {
            if total <= self.limits.retention_bytes_max {
                break;
            }
            match std::fs::remove_file(self.dir.join(&name)) {
                Ok(()) => {
                    total -= bytes;
                    LogStatus::add(&self.status.segments_deleted, 1);
                }
                Err(e) => {
                    self.failed("deleting an old decision-log segment", &e, 0);
                    break;
                }
            }
        }
    }
}

fn write_batch(s: &mut Segment) -> io::Result<()> {
    if s.batch.rows == 0 {
        return Ok(());
    }
    let batch = s.batch.finish(s.schema.clone()).map_err(io_error)?;
    s.writer.write(&batch).map_err(io_error)
}

/// Writes the last batch and the footer, fsyncs, renames into place and
/// fsyncs the directory; returns the segment's bytes.
fn finish(s: &mut Segment) -> io::Result<u64> {
    write_batch(s)?;
    s.writer.finish().map_err(io_error)?;
    let bytes = s.writer.get_ref().bytes;
    // The buffered tail first, then the data and the metadata.
    let counted = s.writer.get_mut();
    counted.file.flush()?;
    counted.file.get_ref().sync_all()?;
    std::fs::rename(&s.tmp, &s.path)?;
    sync_dir(s.path.parent().unwrap_or(Path::new(".")))?;
    Ok(bytes)
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests;
