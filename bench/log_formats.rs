//! The decision log's file format, measured: the same decisions (the
//! batches of real segments, read back) encoded in memory as Arrow IPC,
//! LZ4-compressed as the writer writes them and uncompressed, and as
//! Parquet, Snappy-compressed and uncompressed: the CPU time per decision
//! of each encoding and the bytes per decision it makes. What the writer
//! does besides encoding (draining the rings, building the columns,
//! writing and syncing the file) is the same for any format and is not in
//! these times.
//!
//! Each format encodes every batch of every segment given, `--repeat` times
//! (5 by default); the fastest pass is kept, as the least disturbed by the
//! machine. `bench/log_formats.sh` runs it on the segments of a server that
//! logged the demo's real auction-32 features.
//!
//!     cargo bench --bench log_formats -- SEGMENT... [--repeat N] [--json]

use std::path::PathBuf;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_ipc::writer::{FileWriter, IpcWriteOptions};
use arrow_ipc::CompressionType;
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;
use quiver::decision_log::read::Segment;

#[derive(Clone, Copy)]
enum Format {
    IpcLz4,
    Ipc,
    ParquetSnappy,
    Parquet,
}

impl Format {
    const ALL: [Format; 4] = [Format::IpcLz4, Format::Ipc, Format::ParquetSnappy, Format::Parquet];

    fn name(self) -> &'static str {
        match self {
            Format::IpcLz4 => "arrow_ipc_lz4",
            Format::Ipc => "arrow_ipc",
            Format::ParquetSnappy => "parquet_snappy",
            Format::Parquet => "parquet",
        }
    }

    /// One segment's batches in this format, in memory; its bytes.
    fn encode(self, schema: &SchemaRef, batches: &[RecordBatch]) -> usize {
        match self {
            Format::IpcLz4 | Format::Ipc => {
                let compression = matches!(self, Format::IpcLz4).then_some(CompressionType::LZ4_FRAME);
                let options = IpcWriteOptions::default().try_with_compression(compression).expect("lz4 is built in");
                let mut w = FileWriter::try_new_with_options(Vec::new(), schema, options).expect("an IPC writer");
                for b in batches {
                    w.write(b).expect("IPC encodes a segment's batch");
                }
                w.into_inner().expect("IPC finishes").len()
            }
            Format::ParquetSnappy | Format::Parquet => {
                let compression =
                    if matches!(self, Format::ParquetSnappy) { Compression::SNAPPY } else { Compression::UNCOMPRESSED };
                let props = WriterProperties::builder().set_compression(compression).build();
                let mut w = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props)).expect("a Parquet writer");
                for b in batches {
                    w.write(b).expect("Parquet encodes a segment's batch");
                }
                w.into_inner().expect("Parquet finishes").len()
            }
        }
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut files = Vec::new();
    let (mut repeat, mut json) = (5usize, false);
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--repeat" => repeat = it.next().and_then(|v| v.parse().ok()).expect("--repeat takes a number"),
            "--json" => json = true,
            // What cargo passes to every bench.
            "--bench" => {}
            other => files.push(PathBuf::from(other)),
        }
    }
    assert!(!files.is_empty(), "usage: log_formats SEGMENT... [--repeat N] [--json]");
    let segments: Vec<Segment> =
        files.iter().map(|f| Segment::open(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()))).collect();
    let (mut decisions, mut rows) = (0u64, 0u64);
    for s in &segments {
        let summary = s.summary();
        decisions += summary.decisions;
        rows += summary.rows;
    }
    assert!(decisions > 0, "the segments hold no decision");
    let mut results = Vec::new();
    for format in Format::ALL {
        let mut best_ns = u128::MAX;
        let mut bytes = 0;
        for _ in 0..repeat.max(1) {
            let t = Instant::now();
            bytes = segments.iter().map(|s| format.encode(&s.schema, &s.batches)).sum::<usize>();
            best_ns = best_ns.min(t.elapsed().as_nanos());
        }
        let us_per_decision = best_ns as f64 / 1e3 / decisions as f64;
        let bytes_per_decision = bytes as f64 / decisions as f64;
        let mb_per_s = bytes as f64 / (best_ns as f64 / 1e9) / 1e6;
        if !json {
            println!(
                "{:>15}: {us_per_decision:8.2} µs and {bytes_per_decision:8.0} bytes per decision ({mb_per_s:.0} MB/s out)",
                format.name()
            );
        }
        results.push(serde_json::json!({
            "format": format.name(),
            "us_per_decision": us_per_decision,
            "bytes_per_decision": bytes_per_decision,
            "mb_per_s": mb_per_s,
        }));
    }
    if json {
        let out = serde_json::json!({
            "segments": segments.len(),
            "decisions": decisions,
            "rows": rows,
            "columns": segments[0].schema.fields().len(),
            "repeat": repeat,
            "formats": results,
        });
        println!("{out}");
    } else {
        println!("{} segments, {decisions} decisions, {rows} rows; fastest of {repeat} passes", segments.len());
    }
}
