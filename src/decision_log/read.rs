//! Reading decision-log segments back, for `quiver log dump` (one JSON
//! object per row) and `quiver log inspect` (schema, counts, time range):
//! Quiver's own reader of the files pandas, Polars and DuckDB read as
//! Arrow IPC.

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
    let (schema, batches) = batches(path)?;
    let mut rows = 0u64;
    for b in &batches {
        for i in 0..b.num_rows() {
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
