//! Reading decision-log segments back, for `quiver log dump` (one JSON
//! object per row, or the rows of one request id), `quiver log inspect`
//! (schema, counts, time range) and `quiver log replay` ([`decisions`]:
//! each decision's input rows and scores, for `replay.rs`): Quiver's own
//! reader of the files pandas, Polars and DuckDB read as Arrow IPC.
//!
//! A segment is read whole ([`Segment`]), after [`check_layout`] has held
//! what arrow-ipc's reader takes on trust against the file: every block and
//! buffer within the file, no negative length, and no compressed buffer
//! that claims to expand past what LZ4 can. That reader unwraps a negative
//! length, slices a buffer without a bounds check, and allocates a
//! buffer's stated size whole, so a corrupt file (a bit flip, a copy cut
//! short) would otherwise panic or abort the process. A panic left in it
//! is caught and reported as [`ReadError::ReaderPanicked`], still an
//! error, never a crash; the fuzz tests fail on one.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int64Type, TimestampNanosecondType, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_ipc::reader::FileReader;
use arrow_schema::{ArrowError, DataType, SchemaRef, TimeUnit};

/// An LZ4 frame expands its input at most about 255-fold: a compressed
/// buffer that says it holds more is corrupt.
const LZ4_EXPANSION_MAX: u64 = 256;
/// A block's metadata (one record batch's flatbuffer message) is a few
/// kilobytes for the widest layout the writer makes.
const METADATA_BYTES_MAX: u64 = 16 << 20;
/// A footer lists the schema and one block per batch.
const FOOTER_BYTES_MAX: u64 = 64 << 20;

/// A segment that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{path}: {source}")]
    Open { path: String, source: io::Error },
    #[error("{path}: not a readable Arrow IPC file: {source}")]
    Arrow { path: String, source: ArrowError },
    #[error("{path}: not a whole Arrow IPC file: {why}")]
    Corrupt { path: String, why: String },
    #[error("{path}: the Arrow IPC reader failed on this file ({what}); the file is corrupt")]
    ReaderPanicked { path: String, what: String },
    #[error("{path}: column '{column}' has type {kind}, which the decision log does not write")]
    Column { path: String, column: String, kind: String },
    #[error("writing the output: {0}")]
    Output(#[from] io::Error),
}

/// A segment read whole: its schema and record batches, and the name its
/// errors give (the path).
#[derive(Debug)]
pub struct Segment {
    pub name: String,
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
}

impl Segment {
    /// The segment at `path`.
    pub fn open(path: &Path) -> Result<Segment, ReadError> {
        let name = path.display().to_string();
        let file = File::open(path).map_err(|source| ReadError::Open { path: name.clone(), source })?;
        Segment::read(BufReader::new(file), name)
    }

    /// The segment in `reader` (a file, or bytes in memory), called `name`
    /// in errors.
    pub fn read<R: Read + Seek>(mut reader: R, name: String) -> Result<Segment, ReadError> {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check_layout(&mut reader)?;
            let r = FileReader::try_new(&mut reader, None).map_err(Failed::Arrow)?;
            let schema = r.schema();
            let batches = r.collect::<Result<Vec<_>, _>>().map_err(Failed::Arrow)?;
            Ok((schema, batches))
        }));
        match outcome {
            Ok(Ok((schema, batches))) => Ok(Segment { name, schema, batches }),
            Ok(Err(Failed::Io(source))) => Err(ReadError::Open { path: name, source }),
            Ok(Err(Failed::Arrow(source))) => Err(ReadError::Arrow { path: name, source }),
            Ok(Err(Failed::Corrupt(why))) => Err(ReadError::Corrupt { path: name, why }),
            Err(panic) => {
                let what = (panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Err(ReadError::ReaderPanicked { path: name, what })
            }
        }
    }
}

enum Failed {
    Io(io::Error),
    Arrow(ArrowError),
    Corrupt(String),
}

impl From<io::Error> for Failed {
    fn from(e: io::Error) -> Failed {
        Failed::Io(e)
    }
}

fn read_at<R: Read + Seek>(r: &mut R, at: u64, buf: &mut [u8]) -> Result<(), Failed> {
    r.seek(SeekFrom::Start(at))?;
    r.read_exact(buf)?;
    Ok(())
}

/// Holds the file's footer, blocks and buffers to what arrow-ipc's reader
/// assumes of them (the module's header says why).
fn check_layout<R: Read + Seek>(r: &mut R) -> Result<(), Failed> {
    let corrupt = |why: String| Failed::Corrupt(why);
    // "ARROW1" and padding at the start; the footer, its length and
    // "ARROW1" at the end.
    let file_bytes = r.seek(SeekFrom::End(0))?;
    if file_bytes < 8 + 10 {
        return Err(corrupt(format!("{file_bytes} bytes, too few for an Arrow IPC file")));
    }
    let mut tail = [0u8; 10];
    read_at(r, file_bytes - 10, &mut tail)?;
    if &tail[4..] != b"ARROW1" {
        return Err(corrupt("no footer at its end: cut short, or a segment still being written (.tmp)".into()));
    }
    let footer_bytes = arrow_ipc::reader::read_footer_length(tail).map_err(|e| corrupt(e.to_string()))? as u64;
    let footer_at = (file_bytes - 10)
        .checked_sub(footer_bytes)
        .filter(|&at| at >= 8 && footer_bytes <= FOOTER_BYTES_MAX)
        .ok_or_else(|| corrupt(format!("a footer of {footer_bytes} bytes in a file of {file_bytes}")))?;
    let mut footer = vec![0u8; footer_bytes as usize];
    read_at(r, footer_at, &mut footer)?;
    let footer = arrow_ipc::root_as_footer(&footer).map_err(|e| corrupt(format!("the footer: {e}")))?;
    let schema = footer.schema().ok_or_else(|| corrupt("a footer without a schema".into()))?;
    let schema = arrow_ipc::convert::try_fb_to_schema(schema).map_err(Failed::Arrow)?;
    let mut columns = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        let units = value_bytes(field.data_type()).ok_or_else(|| {
            corrupt(format!(
                "column '{}' has type {}, which the decision log does not write",
                field.name(),
                field.data_type()
            ))
        })?;
        columns.push((field.name().as_str(), units));
    }
    if footer.dictionaries().is_some_and(|d| !d.is_empty()) {
        return Err(corrupt("dictionary batches, which the decision log does not write".into()));
    }
    for (at, block) in footer.recordBatches().into_iter().flatten().enumerate() {
        check_block(r, block, footer_at, &columns).map_err(|why| corrupt(format!("batch {at}: {why}")))?;
    }
    Ok(())
}

/// The bytes of one value in each buffer of a column of type `t` after its
/// validity bitmap, for the types the decision log writes and [`cell`]
/// reads; `None` for any other. arrow-ipc's reader views a buffer as a slice of its values and
/// panics on a length that is not a whole number of them.
fn value_bytes(t: &DataType) -> Option<&'static [u64]> {
    Some(match t {
        DataType::UInt64 | DataType::Int64 | DataType::Float64 | DataType::Timestamp(TimeUnit::Nanosecond, _) => &[8],
        DataType::UInt32 | DataType::Float32 => &[4],
        DataType::UInt16 => &[2],
        // Bit-packed values.
        DataType::Boolean => &[1],
        // Offsets, then the bytes.
        DataType::Utf8 => &[4, 1],
        _ => return None,
    })
}

/// One block (a batch's message and body) against the bytes before the
/// footer at `end` and the schema's `columns` (name, [`value_bytes`]).
fn check_block<R: Read + Seek>(
    r: &mut R,
    block: &arrow_ipc::Block,
    end: u64,
    columns: &[(&str, &[u64])],
) -> Result<(), String> {
    let (Ok(at), Ok(meta), Ok(body)) =
        (u64::try_from(block.offset()), u64::try_from(block.metaDataLength()), u64::try_from(block.bodyLength()))
    else {
        return Err("a negative offset or length".into());
    };
    let body_at = at.checked_add(meta).filter(|&b| b.checked_add(body).is_some_and(|e| e <= end));
    let Some(body_at) = body_at else {
        return Err(format!("{meta} + {body} bytes at {at}, past the file's {end} bytes of batches"));
    };
    if !(8..=METADATA_BYTES_MAX).contains(&meta) {
        return Err(format!("{meta} bytes of metadata"));
    }
    let mut message = vec![0u8; meta as usize];
    read_at(r, at, &mut message).map_err(|_| "its metadata cannot be read".to_string())?;
    // A continuation marker and a length, or (before format 0.15) a length.
    let skip = if message[..4] == [0xff; 4] { 8 } else { 4 };
    let message = arrow_ipc::root_as_message(&message[skip..]).map_err(|e| format!("its message: {e}"))?;
    let Some(batch) = message.header_as_record_batch() else {
        return Err("a message that is not a record batch".into());
    };
    // Every value takes a bit at least, of at most LZ4's expansion of the
    // file; a longer array is corrupt (and its validity buffer would be
    // allocated before any other check).
    let values_max = 8 * LZ4_EXPANSION_MAX * end;
    let within = |n: i64| u64::try_from(n).is_ok_and(|n| n <= values_max);
    if !within(batch.length()) {
        return Err(format!("a batch of {} rows", batch.length()));
    }
    let nodes = batch.nodes().map_or(0, |n| n.len());
    if nodes != columns.len() {
        return Err(format!("{nodes} arrays for {} columns", columns.len()));
    }
    for node in batch.nodes().into_iter().flatten() {
        if !within(node.length()) || !within(node.null_count()) || node.null_count() > node.length() {
            return Err(format!("an array of {} values, {} null", node.length(), node.null_count()));
        }
    }
    let compressed = batch.compression().is_some();
    let mut buffers = batch.buffers().into_iter().flatten();
    for (name, units) in columns {
        // The validity bitmap (bits: any length), then the values.
        for unit in std::iter::once(&1).chain(*units) {
            let buffer = buffers.next().ok_or_else(|| format!("column '{name}': fewer buffers than it has"))?;
            let bytes =
                buffer_bytes(r, buffer, body_at, body, compressed).map_err(|why| format!("column '{name}': {why}"))?;
            if bytes % unit != 0 {
                return Err(format!("column '{name}': a buffer of {bytes} bytes, not whole values of {unit}"));
            }
        }
    }
    if buffers.next().is_some() {
        return Err("more buffers than its columns have".into());
    }
    Ok(())
}

/// The bytes `buffer` holds once decompressed, after checking that it lies
/// within the body (`body` bytes at `body_at`) and, `compressed`, that its
/// stated size is one LZ4 could reach.
fn buffer_bytes<R: Read + Seek>(
    r: &mut R,
    buffer: &arrow_ipc::Buffer,
    body_at: u64,
    body: u64,
    compressed: bool,
) -> Result<u64, String> {
    let (Ok(offset), Ok(len)) = (u64::try_from(buffer.offset()), u64::try_from(buffer.length())) else {
        return Err("a buffer at a negative offset or of a negative length".into());
    };
    if offset.checked_add(len).is_none_or(|e| e > body) {
        return Err(format!("a buffer of {len} bytes at {offset}, past its body's {body}"));
    }
    if !compressed || len == 0 {
        return Ok(len);
    }
    // Its uncompressed length first, or -1: stored uncompressed.
    let mut prefix = [0u8; 8];
    if len < 8 || read_at(r, body_at + offset, &mut prefix).is_err() {
        return Err(format!("a compressed buffer of {len} bytes without its length"));
    }
    match i64::from_le_bytes(prefix) {
        -1 => Ok(len - 8),
        stated => match u64::try_from(stated) {
            Ok(n) if n <= LZ4_EXPANSION_MAX * (len - 8) => Ok(n),
            _ => Err(format!("a compressed buffer of {len} bytes that says it expands to {stated}")),
        },
    }
}

/// One cell as JSON: numbers as numbers (u64 exact), a timestamp as its
/// nanoseconds since the epoch, null as null.
fn cell(path: &str, name: &str, a: &dyn Array, i: usize) -> Result<serde_json::Value, ReadError> {
    use serde_json::Value;
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let float = |f: f64| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number);
    Ok(match a.data_type() {
        DataType::UInt64 => Value::from(a.as_primitive::<UInt64Type>().value(i)),
        DataType::UInt32 => Value::from(a.as_primitive::<UInt32Type>().value(i)),
        DataType::UInt16 => Value::from(a.as_primitive::<UInt16Type>().value(i)),
        DataType::Int64 => Value::from(a.as_primitive::<Int64Type>().value(i)),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => {
            Value::from(a.as_primitive::<TimestampNanosecondType>().value(i))
        }
        DataType::Float32 => float(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => Value::from(a.as_string::<i32>().value(i)),
        DataType::Boolean => Value::from(a.as_boolean().value(i)),
        other => return Err(ReadError::Column { path: path.into(), column: name.into(), kind: other.to_string() }),
    })
}

/// Writes every row of the segment at `path` to `out` as one JSON object
/// per line, columns in the file's order; returns the rows written.
pub fn dump_json(path: &Path, out: &mut dyn Write) -> Result<u64, ReadError> {
    dump_json_of(path, None, out)
}

/// As [`dump_json`], only the rows of `request_id` when given.
pub fn dump_json_of(path: &Path, request_id: Option<u64>, out: &mut dyn Write) -> Result<u64, ReadError> {
    Segment::open(path)?.dump_json(request_id, out)
}

impl Segment {
    /// As [`dump_json_of`].
    pub fn dump_json(&self, request_id: Option<u64>, out: &mut dyn Write) -> Result<u64, ReadError> {
        let schema = &self.schema;
        let mut rows = 0u64;
        let ids = schema.index_of("request_id").ok();
        for b in &self.batches {
            let ids = ids.and_then(|c| b.column(c).as_primitive_opt::<UInt64Type>());
            for i in 0..b.num_rows() {
                if let (Some(want), Some(ids)) = (request_id, ids) {
                    if ids.value(i) != want {
                        continue;
                    }
                }
                let mut row = serde_json::Map::with_capacity(schema.fields().len());
                for (field, column) in schema.fields().iter().zip(b.columns()) {
                    row.insert(field.name().clone(), cell(&self.name, field.name(), column.as_ref(), i)?);
                }
                serde_json::to_writer(&mut *out, &serde_json::Value::Object(row)).map_err(io::Error::from)?;
                out.write_all(b"\n")?;
                rows += 1;
            }
        }
        out.flush()?;
        Ok(rows)
    }
}

/// One logged decision's rows, as `quiver log replay` reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct Logged {
    pub request_id: u64,
    pub model: String,
    pub model_version: u32,
    pub status: String,
    /// Null for a failure.
    pub tier: Option<String>,
    /// The candidates' logged scores, in candidate order.
    pub scores: Vec<f32>,
    /// `scores.len() × row_dim` input floats, as the kernel saw them; empty
    /// when the decision has no assembled rows.
    pub x: Vec<f32>,
}

/// Column indices of what [`decisions`] reads.
struct Columns {
    request_id: usize,
    model: usize,
    model_version: usize,
    status: usize,
    tier: usize,
    candidate: usize,
    score: usize,
    /// The feature columns (`<span>[i]`, `x[i]`), in input-row order.
    features: Vec<usize>,
}

impl Columns {
    fn of(path: &str, schema: &arrow_schema::Schema) -> Result<Columns, ReadError> {
        let need = |name: &str, kind: DataType| -> Result<usize, ReadError> {
            let column = || ReadError::Column {
                path: path.into(),
                column: name.into(),
                kind: format!("(missing, or not {kind})"),
            };
            let at = schema.index_of(name).map_err(|_| column())?;
            (schema.field(at).data_type() == &kind).then_some(at).ok_or_else(column)
        };
        Ok(Columns {
            request_id: need("request_id", DataType::UInt64)?,
            model: need("model", DataType::Utf8)?,
            model_version: need("model_version", DataType::UInt32)?,
            status: need("status", DataType::Utf8)?,
            tier: need("tier", DataType::Utf8)?,
            candidate: need("candidate", DataType::UInt32)?,
            score: need("score", DataType::Float32)?,
            features: (schema.fields().iter().enumerate())
                .filter(|(_, f)| f.name().ends_with(']') && f.data_type() == &DataType::Float32)
                .map(|(i, _)| i)
                .collect(),
        })
    }
}

/// Calls `each` with every decision of the segment at `path` (only those
/// of `request_id` when given), in the file's order; returns the feature
/// columns' count (the logged row width). A decision's rows are
/// consecutive, candidate 0 first.
pub fn decisions(path: &Path, request_id: Option<u64>, each: &mut dyn FnMut(&Logged)) -> Result<usize, ReadError> {
    Segment::open(path)?.decisions(request_id, each)
}

impl Segment {
    /// As [`decisions`].
    pub fn decisions(&self, request_id: Option<u64>, each: &mut dyn FnMut(&Logged)) -> Result<usize, ReadError> {
        let c = Columns::of(&self.name, &self.schema)?;
        let mut open: Option<Logged> = None;
        for b in &self.batches {
            let ids = b.column(c.request_id).as_primitive::<UInt64Type>();
            let models = b.column(c.model).as_string::<i32>();
            let versions = b.column(c.model_version).as_primitive::<UInt32Type>();
            let statuses = b.column(c.status).as_string::<i32>();
            let tiers = b.column(c.tier).as_string::<i32>();
            let candidates = b.column(c.candidate).as_primitive::<UInt32Type>();
            let scores = b.column(c.score).as_primitive::<Float32Type>();
            let features: Vec<_> = c.features.iter().map(|&f| b.column(f).as_primitive::<Float32Type>()).collect();
            for i in 0..b.num_rows() {
                let id = ids.value(i);
                if request_id.is_some_and(|want| want != id) {
                    continue;
                }
                // A decision starts at candidate 0, or is a failure's one row.
                let first = candidates.is_null(i) || candidates.value(i) == 0;
                if first || open.as_ref().is_none_or(|d| d.request_id != id) {
                    if let Some(d) = open.take() {
                        each(&d);
                    }
                    open = Some(Logged {
                        request_id: id,
                        model: models.value(i).to_string(),
                        model_version: versions.value(i),
                        status: statuses.value(i).to_string(),
                        tier: (!tiers.is_null(i)).then(|| tiers.value(i).to_string()),
                        scores: Vec::new(),
                        x: Vec::new(),
                    });
                }
                let d = open.as_mut().expect("opened above");
                if candidates.is_null(i) || scores.is_null(i) {
                    continue;
                }
                d.scores.push(scores.value(i));
                if features.iter().all(|f| !f.is_null(i)) {
                    d.x.extend(features.iter().map(|f| f.value(i)));
                }
            }
        }
        if let Some(d) = open.take() {
            each(&d);
        }
        Ok(c.features.len())
    }
}

/// What `quiver log inspect` prints.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Each column's name and Arrow type.
    pub columns: Vec<(String, String)>,
    pub batches: usize,
    pub rows: u64,
    /// Distinct decisions (request ids, counted once per run of rows).
    pub decisions: u64,
    /// The earliest and latest `received`, ns since the epoch.
    pub received_ns: Option<(i64, i64)>,
}

pub fn inspect(path: &Path) -> Result<Summary, ReadError> {
    Ok(Segment::open(path)?.summary())
}

impl Segment {
    /// As [`inspect`].
    pub fn summary(&self) -> Summary {
        let schema = &self.schema;
        let columns = schema.fields().iter().map(|f| (f.name().clone(), f.data_type().to_string())).collect();
        let mut s = Summary { columns, batches: self.batches.len(), rows: 0, decisions: 0, received_ns: None };
        let at = |name: &str| schema.index_of(name).ok();
        let mut last_id = None;
        for b in &self.batches {
            s.rows += b.num_rows() as u64;
            if let Some(c) = at("request_id").filter(|&c| b.column(c).data_type() == &DataType::UInt64) {
                for id in b.column(c).as_primitive::<UInt64Type>().values().iter() {
                    if last_id != Some(*id) {
                        s.decisions += 1;
                        last_id = Some(*id);
                    }
                }
            }
            if let Some(c) = at("received")
                .filter(|&c| matches!(b.column(c).data_type(), DataType::Timestamp(TimeUnit::Nanosecond, _)))
            {
                for &t in b.column(c).as_primitive::<TimestampNanosecondType>().values().iter() {
                    s.received_ns = Some(s.received_ns.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
                }
            }
        }
        s
    }
}
