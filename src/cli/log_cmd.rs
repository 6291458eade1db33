//! `quiver log`: decision-log segments read back without a server: `dump`
//! prints every row as JSON, `inspect` the schema, counts and time range.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use quiver::decision_log::{read, writer::utc_stamp};
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
    },
    /// Print a segment's columns, row and decision counts, and time range.
    Inspect {
        /// A closed segment (`decisions-*.arrow`).
        file: PathBuf,
    },
}

fn stamp(ns: i64) -> String {
    utc_stamp(Duration::from_nanos(u64::try_from(ns).unwrap_or(0)))
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    let failed = |e: read::ReadError| Error::Setup(e.to_string());
    match cmd {
        Command::Dump { file, json: _ } => {
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            read::dump_json(&file, &mut out).map_err(failed)?;
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
    }
    Ok(ExitCode::SUCCESS)
}
