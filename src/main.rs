//! The `quiver` command line: serve, score, bench, and file tools.
//!
//! This file is the top of the command tree and nothing else: the
//! subcommands, logging and dispatch. Each subcommand's flags and body live
//! in its own module under `cli/`, so a change to one command is read and
//! reviewed in one file.

mod cli;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
#[cfg(feature = "cuda")]
use cli::gpu_check_cmd;
use cli::{
    bench_cmd, demo_cmd, export_onnx_cmd, feast_cmd, features_cmd, import_cmd, log_cmd, plot_cmd, replica_cmd,
    score_cmd, serve_cmd, stats_cmd, time_model_cmd,
};

#[derive(Parser)]
#[command(name = "quiver", version, about = "Real-time ML scoring server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve scoring requests.
    Serve(serve_cmd::Args),
    /// Send one scoring request and print the answer.
    Score(score_cmd::Args),
    /// Send load to a running server and print rate and latency percentiles.
    Bench(bench_cmd::Args),
    /// Import an ONNX, LightGBM or XGBoost model into a Quiver model file (.qm).
    Import(import_cmd::Args),
    /// Write a plain-MLP model file (.qm) as ONNX (input `x`, output
    /// `logit`), e.g. to run the same network on onnxruntime.
    ExportOnnx(export_onnx_cmd::Args),
    /// Time one backend's forward pass on a model file, single thread, at
    /// several batch sizes; one JSON line per batch size (for
    /// bench/ort_side_by_side.py).
    TimeModel(time_model_cmd::Args),
    /// Feature replica files.
    #[command(subcommand)]
    Replica(replica_cmd::Command),
    /// Write features to Redis, the source of truth that replicas follow.
    #[command(subcommand)]
    Features(features_cmd::Command),
    /// Read decision-log segments (`[log]`): dump rows as JSON, inspect.
    #[command(subcommand)]
    Log(log_cmd::Command),
    /// Serve a Feast repository's feature views: inspect what would be
    /// served, copy them from Feast's Redis online store.
    #[command(subcommand)]
    Feast(feast_cmd::Command),
    /// Watch a running server: per-stage latency, rates and tiers, every second.
    Stats(stats_cmd::Args),
    /// Draw PNG plots from benchmark output files.
    #[command(subcommand)]
    Plot(plot_cmd::Command),
    /// Write the auction-32 demo files (replicas and model) into a directory.
    Demo(demo_cmd::Args),
    /// Check the CUDA backend on this machine's GPU: versions, INT8 parity
    /// with the CPU reference, latency. Writes one JSON object.
    #[cfg(feature = "cuda")]
    GpuCheck(gpu_check_cmd::Args),
}

/// The exit status of a command whose standard output was closed under it
/// (`quiver log dump | head`): the status a shell reports for a process
/// ended by SIGPIPE, 128 + 13, as the Unix tools give.
const STDOUT_CLOSED_EXIT: i32 = 128 + 13;

/// Rust ignores SIGPIPE, so printing to a closed pipe is an error, and
/// `println!` turns it into a panic. A reader that stops early is not a
/// failure of the command: it ends quietly with `STDOUT_CLOSED_EXIT`
/// instead of a panic message. SIGPIPE stays ignored, so a socket whose
/// peer went away is still an error the command reports.
fn end_quietly_when_stdout_closes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(STDOUT_CLOSED_EXIT);
        }
        default(info);
    }));
}

fn main() -> ExitCode {
    end_quietly_when_stdout_closes();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve_cmd::run(args),
        Command::Score(args) => score_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Import(args) => import_cmd::run(args),
        Command::TimeModel(args) => time_model_cmd::run(args),
        Command::Replica(cmd) => replica_cmd::run(cmd),
        Command::Features(cmd) => features_cmd::run(cmd),
        Command::Feast(cmd) => feast_cmd::run(cmd),
        Command::Plot(cmd) => plot_cmd::run(cmd),
        Command::ExportOnnx(args) => export_onnx_cmd::run(args),
        Command::Stats(args) => stats_cmd::run(args),
        Command::Log(cmd) => log_cmd::run(cmd),
        Command::Demo(args) => demo_cmd::run(args),
        #[cfg(feature = "cuda")]
        Command::GpuCheck(args) => Ok(gpu_check_cmd::run(args)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("quiver: {e}");
            ExitCode::FAILURE
        }
    }
}
