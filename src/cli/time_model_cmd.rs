//! `quiver time-model`: `score::timing::time_model`'s figures, one JSON line
//! per batch size, for bench/ort_side_by_side.py; with `--explain`, also
//! `time_explain`'s (reason codes per candidate).

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::model::Model;
use quiver::score::cpu::{configure_kernel, KernelChoice};
use quiver::score::BackendKind;
use quiver::Error;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value = "int8")]
    backend: BackendKind,
    /// The INT8 kernel: auto picks the fastest this CPU runs; one it
    /// lacks is an error.
    #[arg(long, value_enum, default_value = "auto")]
    kernel: KernelChoice,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,256,1024")]
    rows: Vec<usize>,
    /// Timed calls per batch size (after warm-up); the median is reported.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Rows are one request's candidates (the first row's user and
    /// context columns in every row), so what reads only those is
    /// computed once per call, as the server scores a request.
    #[arg(long)]
    one_request: bool,
    /// Rows to score instead of seeded normals: a float32 .npy
    /// [rows, >= input width] whose first columns are the input vector;
    /// each call scores the next window of rows (wrapping around).
    #[arg(long)]
    data: Option<PathBuf>,
    /// The onnxruntime library, for `--backend onnxruntime` or a model
    /// kept only for onnxruntime; default ORT_DYLIB_PATH.
    #[arg(long)]
    onnxruntime_lib: Option<PathBuf>,
    /// Also time explaining each batch's candidates (exact feature
    /// contributions); a model that cannot be explained is an error.
    #[arg(long)]
    explain: bool,
}

pub fn run(args: Args) -> Result<ExitCode, Error> {
    if let Some(lib) = args.onnxruntime_lib.clone().or_else(super::ort_dylib_path) {
        quiver::score::configure_onnxruntime(&lib);
    }
    // The backend logs the kernel it runs.
    configure_kernel(args.kernel).map_err(|e| Error::Setup(format!("--kernel: {e}")))?;
    let model = std::sync::Arc::new(Model::load(&args.model)?);
    let rows_from = match &args.data {
        None => None,
        Some(p) => {
            Some(quiver::model::calibrate::read_npy(p).map_err(|e| Error::Setup(format!("{}: {e}", p.display())))?)
        }
    };
    let timings = quiver::score::timing::time_model(
        &model,
        args.backend,
        &args.rows,
        args.iters,
        args.one_request,
        rows_from.as_ref(),
    )
    .map_err(|e| Error::Setup(format!("{}: {e}", args.data.as_ref().unwrap_or(&args.model).display())))?;
    for t in timings {
        println!("{}", serde_json::to_string(&t).expect("a timing serializes"));
    }
    if args.explain {
        let timings = quiver::score::timing::time_explain(&model, &args.rows, args.iters, rows_from.as_ref())
            .map_err(|e| Error::Setup(format!("--explain: {e}")))?;
        for t in timings {
            println!("{}", serde_json::to_string(&t).expect("a timing serializes"));
        }
    }
    Ok(ExitCode::SUCCESS)
}
