//! `quiver plot`: PNG plots drawn from benchmark output files (percentile
//! distributions, rate sweeps, the scale bench's JSON lines).

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::loadgen;
use quiver::Error;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Latency by percentile, one line per LABEL=FILE.hgrm, overlaid.
    Percentiles {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "Latency by percentile")]
        title: String,
        #[arg(required = true)]
        runs: Vec<String>,
    },
    /// p99 against offered rate, one line per LABEL=FILE.json from `bench --sweep --json`.
    Sweep {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "p99 latency against offered rate")]
        title: String,
        #[arg(required = true)]
        sweeps: Vec<String>,
    },
    /// Measures against entity count (log-log), from `cargo bench --bench
    /// scale`'s JSON lines: one line per storage and LABEL=FIELD, where FIELD
    /// is a dotted path into each line (e.g. `lookup_uniform.p99_ns`).
    Scale {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "Replica costs against entity count")]
        title: String,
        /// The y axis's name, with its unit.
        #[arg(long)]
        y_desc: String,
        /// Each field's value is divided by this (1e3: ns to µs, 1e9: bytes to GB).
        #[arg(long, default_value_t = 1.0)]
        divide_by: f64,
        /// The bench's output, one JSON object per line.
        #[arg(long)]
        results: PathBuf,
        #[arg(required = true)]
        fields: Vec<String>,
    },
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    let split = |arg: &str| -> Result<(String, PathBuf), Error> {
        let (label, file) = arg.split_once('=').ok_or_else(|| Error::Setup(format!("'{arg}': expected LABEL=FILE")))?;
        Ok((label.to_string(), PathBuf::from(file)))
    };
    let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| Error::Setup(format!("{}: {e}", p.display())));
    match cmd {
        Command::Percentiles { out, title, runs } => {
            let mut series = Vec::new();
            for r in &runs {
                let (label, file) = split(r)?;
                series.push((label, loadgen::parse_percentiles(&read(&file)?)));
            }
            quiver::loadgen::plot::percentiles(&out, &title, &series).map_err(Error::Setup)?;
        }
        Command::Sweep { out, title, sweeps } => {
            let mut series = Vec::new();
            for s in &sweeps {
                let (label, file) = split(s)?;
                let report: loadgen::SweepReport = serde_json::from_str(&read(&file)?)
                    .map_err(|e| Error::Setup(format!("{}: {e}", file.display())))?;
                let points =
                    report.steps.iter().filter_map(|r| Some((r.offered_rate?, r.latency.p99_us as f64))).collect();
                series.push((label, points));
            }
            quiver::loadgen::plot::sweep(&out, &title, &series).map_err(Error::Setup)?;
        }
        Command::Scale { out, title, y_desc, divide_by, results, fields } => {
            let text = read(&results)?;
            let mut lines = Vec::new();
            for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| Error::Setup(format!("{}:{}: {e}", results.display(), n + 1)))?;
                lines.push(v);
            }
            let mut storages: Vec<String> = Vec::new();
            for s in lines.iter().filter_map(|v| v.get("storage")?.as_str()) {
                if !storages.iter().any(|t| t == s) {
                    storages.push(s.to_string());
                }
            }
            let mut series = Vec::new();
            for f in &fields {
                let (label, field) = split(f)?;
                for storage in &storages {
                    let points: Vec<(f64, f64)> = lines
                        .iter()
                        .filter(|v| v.get("storage").and_then(|s| s.as_str()) == Some(storage))
                        .filter_map(|v| {
                            let y = field.to_string_lossy().split('.').try_fold(v, |v, k| v.get(k))?.as_f64()?;
                            Some((v.get("entities")?.as_f64()?, y / divide_by))
                        })
                        .collect();
                    if !points.is_empty() {
                        series.push((format!("{label}, {storage}"), points));
                    }
                }
            }
            if series.is_empty() {
                return Err(Error::Setup(format!("{}: no line has the fields asked for", results.display())));
            }
            quiver::loadgen::plot::scale(&out, &title, &y_desc, &series).map_err(Error::Setup)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
