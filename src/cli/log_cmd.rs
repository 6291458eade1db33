//! `quiver log`: decision-log segments read back without a server: `dump`
//! prints every row as JSON (or one request's), `inspect` the schema,
//! counts and time range, `replay` scores the logged rows again with a
//! model file and reports any score that differs (exit 1), `parquet`
//! rewrites segments as Parquet files for Spark and the warehouses.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use quiver::decision_log::{read, replay, to_parquet, writer::utc_stamp};
use quiver::model::Model;
use quiver::score::BackendKind;
use quiver::Error;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print every row of a segment (one per candidate).
    Dump {
        /// A closed segment (`decisions-*.arrow`).
        file: PathBuf,
        /// One JSON object per line, columns by name; the only output form.
        #[arg(long, required = true)]
        json: bool,
        /// Only the rows of this request id (a decision found by its id).
        #[arg(long, value_name = "ID")]
        request_id: Option<u64>,
    },
    /// Print a segment's columns, row and decision counts, and time range.
    Inspect {
        /// A closed segment (`decisions-*.arrow`).
        file: PathBuf,
    },
    /// Score the logged input rows again and compare with the logged
    /// scores, bit for bit; exit 1 on any difference (or nothing to
    /// compare).
    Replay {
        /// A closed segment (`decisions-*.arrow`).
        file: PathBuf,
        /// The model file that served them: only its name's and version's
        /// primary answers are compared.
        #[arg(long, value_name = "M.qm")]
        model: PathBuf,
        /// The backend the server ran (`backend` in its config).
        #[arg(long, value_enum, default_value = "int8")]
        backend: BackendKind,
        /// Only the decision of this request id.
        #[arg(long, value_name = "ID")]
        request_id: Option<u64>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Rewrite closed segments as Parquet files (Snappy; the receive time
    /// in microseconds), one per segment, for readers of Parquet alone
    /// (Spark, Hive, warehouse loaders).
    Parquet {
        /// Closed segments (`decisions-*.arrow`).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Where to write them, as `<segment name>.parquet` (created if
        /// absent; a file of that name is replaced).
        #[arg(long, value_name = "DIR")]
        out_dir: PathBuf,
    },
}

fn stamp(ns: i64) -> String {
    utc_stamp(Duration::from_nanos(u64::try_from(ns).unwrap_or(0)))
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    let failed = |e: read::ReadError| Error::Setup(e.to_string());
    match cmd {
        Command::Dump { file, json: _, request_id } => {
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            read::dump_json_of(&file, request_id, &mut out).map_err(failed)?;
        }
        Command::Inspect { file } => {
            let s = read::inspect(&file).map_err(failed)?;
            println!("file: {}", file.display());
            println!("rows: {} (decisions: {}, batches: {})", s.rows, s.decisions, s.batches);
            match s.received_ns {
                Some((first, last)) => println!("received: {} .. {}", stamp(first), stamp(last)),
                None => println!("received: (no rows)"),
            }
            println!("columns: {}", s.columns.len());
            for (name, kind) in &s.columns {
                println!("  {name}: {kind}");
            }
        }
        Command::Replay { file, model, backend, request_id, json } => {
            let model = Arc::new(Model::load(&model)?);
            let r = replay::replay(&file, &model, backend, request_id).map_err(|e| Error::Setup(e.to_string()))?;
            if json {
                println!("{}", serde_json::to_string(&r).map_err(|e| Error::Setup(e.to_string()))?);
            } else {
                println!("model: {} v{} on {backend:?}", model.name, model.version);
                println!("decisions: {} (replayed {}, rows {})", r.decisions, r.replayed, r.rows);
                println!("equal: {}, differing: {}", r.equal, r.differing);
                println!(
                    "skipped: failed {}, lower tier {}, other model or version {}, no rows {}, score error {}",
                    r.skipped_failed,
                    r.skipped_lower_tier,
                    r.skipped_other_model,
                    r.skipped_no_rows,
                    r.skipped_score_error
                );
                for d in &r.differences {
                    println!(
                        "  request {} candidate {}: logged {} ({:#010x}), replayed {} ({:#010x})",
                        d.request_id,
                        d.candidate,
                        d.logged,
                        d.logged.to_bits(),
                        d.replayed,
                        d.replayed.to_bits()
                    );
                }
            }
            if !r.matched() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Parquet { files, out_dir } => {
            std::fs::create_dir_all(&out_dir)
                .map_err(|e| Error::Setup(format!("creating {}: {e}", out_dir.display())))?;
            for file in &files {
                let segment = read::Segment::open(file).map_err(failed)?;
                let out = to_parquet::parquet_name(file, &out_dir);
                let rows = to_parquet::write_parquet(&segment, &out).map_err(|e| Error::Setup(e.to_string()))?;
                println!("{} -> {} ({rows} rows)", file.display(), out.display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
