//! `quiver log parquet`: closed segments rewritten as Parquet files, for the
//! readers that take Parquet and not Arrow IPC files: Spark, Hive and the
//! warehouses' loaders. The same columns, in the same order, and the same
//! rows; only the receive time changes unit, to microseconds, as Spark reads
//! no nanosecond timestamps. Snappy-compressed, Spark's default codec.
//!
//! Off the serving path: a command run on closed segments, never by the
//! writer. Each output is written beside its final name as `.tmp`, synced
//! and renamed, so a job reading the directory never sees half a file.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampNanosecondType;
use arrow_array::{Array, ArrayRef, RecordBatch, TimestampMicrosecondArray};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef, TimeUnit};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::errors::ParquetError;
use parquet::file::properties::WriterProperties;

use super::read::Segment;

/// Why a segment could not be written as Parquet.
#[derive(Debug, thiserror::Error)]
pub enum ToParquetError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: writing Parquet: {source}")]
    Parquet { path: String, source: ParquetError },
    #[error("{path}: a batch that does not take the Parquet schema: {source}")]
    Convert { path: String, source: ArrowError },
}

/// The schema a segment's rows take in Parquet: nanosecond timestamps
/// become microsecond ones, in the same time zone; every other field is
/// kept as it is.
fn parquet_schema(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = (schema.fields().iter())
        .map(|f| match f.data_type() {
            DataType::Timestamp(TimeUnit::Nanosecond, tz) => {
                f.as_ref().clone().with_data_type(DataType::Timestamp(TimeUnit::Microsecond, tz.clone()))
            }
            _ => f.as_ref().clone(),
        })
        .collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// `column` in microseconds where it is a nanosecond timestamp (floored, so
/// that a time before the epoch rounds the way one after it does); `None`
/// where it stays as it is.
fn to_micros(column: &ArrayRef) -> Option<ArrayRef> {
    let DataType::Timestamp(TimeUnit::Nanosecond, tz) = column.data_type() else {
        return None;
    };
    let ns = column.as_primitive::<TimestampNanosecondType>();
    let us: TimestampMicrosecondArray = ns.unary(|v| v.div_euclid(1_000));
    Some(Arc::new(us.with_timezone_opt(tz.clone())))
}

/// Writes `segment`'s rows to `out` as Parquet (through `out` + `.tmp`,
/// synced, then renamed); returns the rows written.
pub fn write_parquet(segment: &Segment, out: &Path) -> Result<u64, ToParquetError> {
    let path = out.display().to_string();
    let io = |source| ToParquetError::Io { path: path.clone(), source };
    let pq = |source| ToParquetError::Parquet { path: path.clone(), source };
    let schema = parquet_schema(&segment.schema);
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let file = File::create(&tmp).map_err(io)?;
    let props = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
    let written = (|| {
        let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(props)).map_err(pq)?;
        let mut rows = 0u64;
        for batch in &segment.batches {
            let mut columns = Vec::with_capacity(batch.num_columns());
            for c in batch.columns() {
                columns.push(to_micros(c).unwrap_or_else(|| c.clone()));
            }
            let batch = RecordBatch::try_new(schema.clone(), columns)
                .map_err(|source| ToParquetError::Convert { path: path.clone(), source })?;
            writer.write(&batch).map_err(pq)?;
            rows += batch.num_rows() as u64;
        }
        let mut file = writer.into_inner().map_err(pq)?;
        file.flush().map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(rows)
    })();
    match written {
        Ok(rows) => {
            std::fs::rename(&tmp, out).map_err(io)?;
            Ok(rows)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Where `segment`'s Parquet copy goes in `dir`: its name with `.parquet`
/// for `.arrow`.
pub fn parquet_name(segment: &Path, dir: &Path) -> PathBuf {
    let name = segment.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = name.strip_suffix(".arrow").unwrap_or(&name);
    dir.join(format!("{stem}.parquet"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{BooleanArray, Float32Array, StringArray, TimestampNanosecondArray, UInt32Array, UInt64Array};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    /// A segment of two batches with the log's column types, a null in
    /// each column that may hold one, a receive time before the epoch and
    /// one not a whole microsecond.
    fn segment() -> Segment {
        let schema = Arc::new(Schema::new(vec![
            Field::new("request_id", DataType::UInt64, false),
            Field::new("client_id", DataType::UInt32, false),
            Field::new("received", DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())), false),
            Field::new("tier", DataType::Utf8, true),
            Field::new("sampled", DataType::Boolean, false),
            Field::new("score", DataType::Float32, true),
            Field::new("user[0]", DataType::Float32, true),
        ]));
        let batch = |ids: [u64; 2], received: [i64; 2]| {
            let columns: Vec<ArrayRef> = vec![
                Arc::new(UInt64Array::from(ids.to_vec())),
                Arc::new(UInt32Array::from(vec![7, u32::MAX])),
                Arc::new(TimestampNanosecondArray::from(received.to_vec()).with_timezone("UTC")),
                Arc::new(StringArray::from(vec![Some("primary"), None])),
                Arc::new(BooleanArray::from(vec![true, false])),
                Arc::new(Float32Array::from(vec![Some(0.25), None])),
                Arc::new(Float32Array::from(vec![Some(f32::NAN), Some(-1.5)])),
            ];
            RecordBatch::try_new(schema.clone(), columns).unwrap()
        };
        Segment {
            name: "s.arrow".into(),
            schema: schema.clone(),
            batches: vec![
                batch([u64::MAX, 1], [1_764_000_000_123_456_789, 5_999]),
                batch([2, 3], [-1_500, 1_764_000_000_000_000_000]),
            ],
        }
    }

    #[test]
    fn a_segment_reads_back_from_parquet_with_every_value_and_times_in_microseconds() {
        let dir = std::env::temp_dir().join(format!("quiver-parquet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = parquet_name(Path::new("/logs/decisions-x-shard000-000001.arrow"), &dir);
        assert_eq!(out, dir.join("decisions-x-shard000-000001.parquet"));
        let s = segment();
        assert_eq!(write_parquet(&s, &out).unwrap(), 4);
        assert!(!dir.join("decisions-x-shard000-000001.parquet.tmp").exists());
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&out).unwrap()).unwrap().build().unwrap();
        let back: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
        let rows: usize = back.iter().map(RecordBatch::num_rows).sum();
        assert_eq!(rows, 4);
        let schema = back[0].schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["request_id", "client_id", "received", "tier", "sampled", "score", "user[0]"]);
        assert_eq!(schema.field(2).data_type(), &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())));
        let column = |i: usize| -> Vec<ArrayRef> { back.iter().map(|b| b.column(i).clone()).collect() };
        let ids: Vec<u64> = column(0)
            .iter()
            .flat_map(|c| c.as_primitive::<arrow_array::types::UInt64Type>().values().to_vec())
            .collect();
        assert_eq!(ids, [u64::MAX, 1, 2, 3]);
        let received: Vec<i64> = (column(2).iter())
            .flat_map(|c| c.as_primitive::<arrow_array::types::TimestampMicrosecondType>().values().to_vec())
            .collect();
        assert_eq!(received, [1_764_000_000_123_456, 5, -2, 1_764_000_000_000_000]);
        // Every other column is the segment's, value for value and null
        // for null (NaN kept, bit for bit), whatever the batches' bounds.
        let cells = |cs: Vec<ArrayRef>| {
            cs.iter().flat_map(|c| (0..c.len()).map(|r| c.slice(r, 1).to_data())).collect::<Vec<_>>()
        };
        for i in [1, 3, 4, 5, 6] {
            let want = cells(s.batches.iter().map(|b| b.column(i).clone()).collect());
            assert_eq!(cells(column(i)), want, "column {}", names[i]);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
