//! `quiver gpu-check` (built with `--features cuda`): the CUDA backend on
//! this machine's GPU against the CPU reference, as one JSON object.

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Batch sizes (rows) to check and time.
    #[arg(long, value_delimiter = ',', default_value = "1,31,32,33,255,1024,4096")]
    batches: Vec<usize>,
    /// Timed calls per batch size, after 10 warm-up calls.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Write the JSON here instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `quiver gpu-check`: exit 0 when every output matched the CPU reference,
/// 1 when one did not or there is no GPU to check (the JSON says which).
pub fn run(Args { batches, iters, out }: Args) -> ExitCode {
    let (report, code) = match quiver::score::cuda::gpu_check(&batches, iters) {
        Ok(r) => {
            let ok = r["ok"].as_bool() == Some(true);
            (r, if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Err(e) => {
            eprintln!("quiver gpu-check: no GPU to check: {e}");
            (serde_json::json!({ "ok": false, "error": e.to_string() }), ExitCode::FAILURE)
        }
    };
    let text = report.to_string();
    match out {
        Some(path) => {
            if let Err(e) = std::fs::write(&path, text + "\n") {
                eprintln!("quiver gpu-check: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
        None => println!("{text}"),
    }
    code
}
