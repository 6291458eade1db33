//! Reading decision-log segments back, for `quiver log dump` (one JSON
//! object per row, or the rows of one request id), `quiver log inspect`
//! (schema, counts, time range) and `quiver log replay` ([`decisions`]:
//! each decision's input rows and scores, for `replay.rs`): Quiver's own
//! reader of the files pandas, Polars and DuckDB read as Arrow IPC.

use std::fs::File;
use std::io::{self, BufReader, Write};
use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int64Type, TimestampNanosecondType, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_ipc::reader::FileReader;
use arrow_schema::{ArrowError, DataType, TimeUnit};

/// A segment that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{path}: {source}")]
    Open { path: String, source: io::Error },
    #[error("{path}: not a readable Arrow IPC file: {source}")]
    Arrow { path: String, source: ArrowError },
    #[error("{path}: column '{column}' has type {kind}, which the decision log does not write")]
    Column { path: String, column: String, kind: String },
    #[error("writing the output: {0}")]
    Output(#[from] io::Error),
}

fn reader(path: &Path) -> Result<FileReader<BufReader<File>>, ReadError> {
    let p = || path.display().to_string();
    let file = File::open(path).map_err(|source| ReadError::Open { path: p(), source })?;
    FileReader::try_new(BufReader::new(file), None).map_err(|source| ReadError::Arrow { path: p(), source })
}

fn batches(path: &Path) -> Result<(arrow_schema::SchemaRef, Vec<RecordBatch>), ReadError> {
    let r = reader(path)?;
    let schema = r.schema();
    let batches = r
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| ReadError::Arrow { path: path.display().to_string(), source })?;
    Ok((schema, batches))
}

/// One cell as JSON: numbers as numbers (u64 exact), a timestamp as its
/// nanoseconds since the epoch, null as null.
fn cell(path: &Path, name: &str, a: &dyn Array, i: usize) -> Result<serde_json::Value, ReadError> {
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
        other => {
            return Err(ReadError::Column {
                path: path.display().to_string(),
                column: name.into(),
                kind: other.to_string(),
            })
        }
    })
}

/// Writes every row of the segment at `path` to `out` as one JSON object
/// per line, columns in the file's order; returns the rows written.
pub fn dump_json(path: &Path, out: &mut dyn Write) -> Result<u64, ReadError> {
    dump_json_of(path, None, out)
}

/// As [`dump_json`], only the rows of `request_id` when given.
pub fn dump_json_of(path: &Path, request_id: Option<u64>, out: &mut dyn Write) -> Result<u64, ReadError> {
    let (schema, batches) = batches(path)?;
    let mut rows = 0u64;
    let ids = schema.index_of("request_id").ok();
    for b in &batches {
        let ids = ids.and_then(|c| b.column(c).as_primitive_opt::<UInt64Type>());
        for i in 0..b.num_rows() {
            if let (Some(want), Some(ids)) = (request_id, ids) {
                if ids.value(i) != want {
                    continue;
                }
            }
            let mut row = serde_json::Map::with_capacity(schema.fields().len());
            for (field, column) in schema.fields().iter().zip(b.columns()) {
                row.insert(field.name().clone(), cell(path, field.name(), column.as_ref(), i)?);
            }
            serde_json::to_writer(&mut *out, &serde_json::Value::Object(row)).map_err(io::Error::from)?;
            out.write_all(b"\n")?;
            rows += 1;
        }
    }
    out.flush()?;
    Ok(rows)
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
    fn of(path: &Path, schema: &arrow_schema::Schema) -> Result<Columns, ReadError> {
        let need = |name: &str, kind: DataType| -> Result<usize, ReadError> {
            let column = || ReadError::Column {
                path: path.display().to_string(),
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
    let r = reader(path)?;
    let schema = r.schema();
    let c = Columns::of(path, &schema)?;
    let arrow = |source| ReadError::Arrow { path: path.display().to_string(), source };
    let mut open: Option<Logged> = None;
    for batch in r {
        let b = batch.map_err(arrow)?;
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
    let (schema, batches) = batches(path)?;
    let columns = schema.fields().iter().map(|f| (f.name().clone(), f.data_type().to_string())).collect();
    let mut s = Summary { columns, batches: batches.len(), rows: 0, decisions: 0, received_ns: None };
    let at = |name: &str| schema.index_of(name).ok();
    let mut last_id = None;
    for b in &batches {
        s.rows += b.num_rows() as u64;
        if let Some(c) = at("request_id").filter(|&c| b.column(c).data_type() == &DataType::UInt64) {
            for id in b.column(c).as_primitive::<UInt64Type>().values().iter() {
                if last_id != Some(*id) {
                    s.decisions += 1;
                    last_id = Some(*id);
                }
            }
        }
        if let Some(c) =
            at("received").filter(|&c| matches!(b.column(c).data_type(), DataType::Timestamp(TimeUnit::Nanosecond, _)))
        {
            for &t in b.column(c).as_primitive::<TimestampNanosecondType>().values().iter() {
                s.received_ns = Some(s.received_ns.map_or((t, t), |(lo, hi)| (lo.min(t), hi.max(t))));
            }
        }
    }
    Ok(s)
}
