//! `quiver export-onnx`: a plain-MLP model file written back out as ONNX,
//! to run the same network on onnxruntime.

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::model::Model;
use quiver::Error;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    out: PathBuf,
}

pub fn run(Args { model, out }: Args) -> Result<ExitCode, Error> {
    let m = Model::load(&model)?;
    let bytes = quiver::model::onnx::export_mlp(&m)?;
    std::fs::write(&out, &bytes).map_err(|e| Error::Setup(format!("{}: {e}", out.display())))?;
    let inputs: Vec<String> =
        m.inputs.iter().map(|s| format!("{}:{}", quiver::model::onnx::source_name(s.source), s.dim)).collect();
    println!("wrote {} ({} bytes): input 'x' = {}, output 'logit'", out.display(), bytes.len(), inputs.join(","));
    Ok(ExitCode::SUCCESS)
}
