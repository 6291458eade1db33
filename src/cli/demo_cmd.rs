//! `quiver demo`: the auction-32 demo's replicas and model written into a
//! directory, and optionally published twice to a model registry so that
//! `serve --models-dir` has a hot swap to try.

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::loadgen::demo;
use quiver::Error;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "quiver-data")]
    data_dir: PathBuf,
    /// Also publish the demo model as versions 1 and 2 of auction-32 in
    /// this registry directory (for `serve --models-dir`: hot swaps to try).
    #[arg(long)]
    models_dir: Option<PathBuf>,
}

pub fn run(Args { data_dir, models_dir }: Args) -> Result<ExitCode, Error> {
    demo::ensure(&data_dir)?;
    if let Some(dir) = &models_dir {
        for version in [1, 2] {
            let model = quiver::model::Model { version, ..demo::model() };
            let path = quiver::registry::publish(dir, &model).map_err(|e| Error::Setup(e.to_string()))?;
            println!("published {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
