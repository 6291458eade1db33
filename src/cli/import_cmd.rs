//! `quiver import`: an ONNX, LightGBM or XGBoost model compiled into a
//! Quiver model file, optionally calibrated on a `.npy` set, then read back
//! and compared with what was built before the summary is printed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use quiver::model::Model;
use quiver::Error;

use super::progress_bar;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["onnx", "lightgbm", "xgboost"])))]
pub struct Args {
    /// An ONNX file (MLPs, graph models, tree ensembles; docs/MODELS.md).
    #[arg(long)]
    onnx: Option<PathBuf>,
    /// A LightGBM text model (`Booster.save_model`).
    #[arg(long)]
    lightgbm: Option<PathBuf>,
    /// An XGBoost JSON model (`save_model("m.json")`).
    #[arg(long)]
    xgboost: Option<PathBuf>,
    /// The model file to write.
    #[arg(long)]
    out: PathBuf,
    /// Model name (what requests put in `model`).
    #[arg(long)]
    name: String,
    #[arg(long)]
    version: u32,
    /// Input layout: `user:32,item:32,context:16` takes the graph inputs in
    /// order (a single graph input, or a tree model's features, is split
    /// into consecutive segments); `user=u:32,item=i:32,context=c:16` names
    /// the graph input of each. Any feature group may be named: `card:16`
    /// is read once per request, `ad@candidate:12` once per candidate.
    #[arg(long)]
    inputs: quiver::model::onnx::InputMapping,
    /// The tensor holding the logit or the positive-class probability, when
    /// the graph has several outputs (e.g. label and probabilities).
    #[arg(long, requires = "onnx")]
    output: Option<String>,
    /// What the output is: `logit` (scores are its sigmoid; a final Sigmoid
    /// in the graph is dropped) or `raw` (a regression value, or a tree
    /// model's margin, returned as is). Default: logit for ONNX; what the
    /// objective says for LightGBM and XGBoost.
    #[arg(long, value_enum)]
    output_kind: Option<OutputKindArg>,
    /// Calibration set: a .npy file of float32 rows [rows, input width] in
    /// the model's input order. Sets static activation ranges and stores the
    /// set's score histogram; without it the INT8 backend quantizes
    /// activations per row (dynamic fallback).
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// How activation ranges are chosen: max-abs or percentile:P.
    #[arg(long, default_value = "max-abs", requires = "calibration")]
    calibration_method: quiver::model::calibrate::Method,
    /// The quantized path the import reports against f32 on the calibration
    /// set. The file serves both: pick one at serve time with `--backend`.
    #[arg(long, value_enum, default_value = "int8")]
    precision: Precision,
    /// Keep the ONNX graph in the model file beside the native network, so
    /// the version can also be served with `backend = "onnxruntime"`.
    #[arg(long, requires = "onnx", conflicts_with = "onnxruntime")]
    keep_onnx: bool,
    /// Store the ONNX graph whole and serve it through onnxruntime (a
    /// server built with `--features onnxruntime`), for a graph the native
    /// compiler refuses. The output is returned as the graph computes it
    /// when it is a probability; `--output-kind logit` applies the sigmoid.
    #[arg(long, requires = "onnx")]
    onnxruntime: bool,
    /// The onnxruntime library, to score the calibration set of a model
    /// imported with `--onnxruntime`; default ORT_DYLIB_PATH.
    #[arg(long, requires = "onnxruntime")]
    onnxruntime_lib: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OutputKindArg {
    Logit,
    Raw,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Precision {
    Int8,
    Fp8,
}

pub fn run(args: Args) -> Result<ExitCode, Error> {
    if let Some(lib) = args.onnxruntime_lib.clone().or_else(super::ort_dylib_path) {
        quiver::score::configure_onnxruntime(&lib);
    }
    let output_kind = args.output_kind.map(|k| match k {
        OutputKindArg::Logit => quiver::model::OutputKind::Logit,
        OutputKindArg::Raw => quiver::model::OutputKind::Raw,
    });
    let mut imported = if let Some(onnx) = &args.onnx {
        let opts = quiver::model::onnx::ImportOptions {
            name: args.name,
            version: args.version,
            inputs: args.inputs,
            output: args.output,
            output_kind: output_kind.unwrap_or(quiver::model::OutputKind::Logit),
            base_dir: None,
        };
        let keep = if args.onnxruntime {
            quiver::model::onnx::KeepOnnx::Only { output_kind }
        } else if args.keep_onnx {
            quiver::model::onnx::KeepOnnx::Beside
        } else {
            quiver::model::onnx::KeepOnnx::No
        };
        match quiver::model::onnx::import_file_keeping(onnx, &opts, keep) {
            Ok(imported) => imported,
            Err(e) if e.is_refusal() => {
                return Err(Error::Setup(format!(
                    "{}: the native compiler refuses this graph: {e}\n  it can still be served through \
                     onnxruntime: rerun with --onnxruntime (stores the graph whole; serve it with a binary built \
                     with --features onnxruntime)",
                    onnx.display()
                )))
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        let opts = quiver::model::gbdt::GbdtOptions {
            name: args.name,
            version: args.version,
            inputs: args.inputs,
            output_kind,
        };
        match (&args.lightgbm, &args.xgboost) {
            (Some(path), _) => quiver::model::gbdt::import_lightgbm_file(path, &opts)?,
            (_, Some(path)) => quiver::model::gbdt::import_xgboost_file(path, &opts)?,
            _ => unreachable!("clap requires one source"),
        }
    };
    let calibration_report = match &args.calibration {
        Some(path) => Some(calibrate_import(&mut imported.model, path, args.calibration_method, args.precision)?),
        None => None,
    };
    imported.model.save(&args.out)?;
    // Reading the file back checks what the server will load, not just what
    // was built in memory.
    let loaded = Model::load(&args.out)?;
    if loaded != imported.model {
        let _ = std::fs::remove_file(&args.out);
        return Err(Error::Setup(format!(
            "{}: the model file read back differs from the model written; not using it",
            args.out.display()
        )));
    }
    println!("wrote {}: {}", args.out.display(), imported.summary());
    match calibration_report {
        Some(report) => println!("{report}"),
        None if imported.model.is_native() => {
            println!("  uncalibrated: the INT8 backend quantizes activations per row (pass --calibration)")
        }
        None => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Calibrates `model` on the `.npy` set at `path` (with a progress bar) and
/// returns the summary lines (`score::accuracy::calibrate`).
fn calibrate_import(
    model: &mut Model,
    path: &Path,
    method: quiver::model::calibrate::Method,
    precision: Precision,
) -> Result<String, Error> {
    let set = quiver::model::calibrate::read_npy(path).map_err(quiver::model::calibrate::CalibrationError::from)?;
    let bar = progress_bar(0, &format!("calibrating on {} rows", set.rows));
    let also_fp8 = matches!(precision, Precision::Fp8);
    let report = quiver::score::accuracy::calibrate(model, &set, method, also_fp8, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let report = report?;
    eprintln!("calibrated on {} rows ({})", set.rows, method.name());
    Ok(report)
}
