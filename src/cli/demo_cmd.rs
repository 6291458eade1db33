//! `quiver demo`: a built-in example's replicas and model written into a
//! directory (auction-32 by default, or the fraud or auction example with
//! its `quiver.toml`), optionally published twice to a model registry so that
//! `serve --models-dir` has a hot swap to try; or, for the fraud example,
//! the labelled training set its committed model was trained on.

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::loadgen::{auction, demo, fraud, DemoWorkload};
use quiver::Error;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "quiver-data")]
    data_dir: PathBuf,
    /// Which example: auction-32 (users and items, an MLP), fraud (card
    /// payments over five feature groups, a LightGBM model) or auction
    /// (ads joined to their campaign and advertiser through the replicas'
    /// links, six groups, an MLP).
    #[arg(long, value_enum, default_value = "auction-32")]
    workload: DemoWorkload,
    /// Also publish the demo model as versions 1 and 2 in this registry
    /// directory (for `serve --models-dir`: hot swaps to try).
    #[arg(long)]
    models_dir: Option<PathBuf>,
    /// Fraud only: write a labelled training set (CSV: the model's input
    /// columns in order, then `label`) to this file instead of the data
    /// directory; `bench/train_fraud.py` trains the committed model on it.
    #[arg(long, conflicts_with = "models_dir")]
    training_set: Option<PathBuf>,
    /// Rows in the training set.
    #[arg(long, default_value_t = 200_000, requires = "training_set")]
    rows: u64,
    /// The training set's seed.
    #[arg(long, default_value_t = fraud::TRAINING_SEED, requires = "training_set")]
    seed: u64,
}

fn setup(e: impl std::fmt::Display) -> Error {
    Error::Setup(e.to_string())
}

pub fn run(args: Args) -> Result<ExitCode, Error> {
    if let Some(path) = &args.training_set {
        if args.workload != DemoWorkload::Fraud {
            return Err(Error::Setup("--training-set is for --workload fraud".into()));
        }
        let positives = fraud::write_training_set(path, args.rows, args.seed).map_err(setup)?;
        println!("wrote {}: {} rows, {positives} labelled fraud", path.display(), args.rows);
        return Ok(ExitCode::SUCCESS);
    }
    let model = match args.workload {
        DemoWorkload::Fraud => {
            let files = fraud::ensure(&args.data_dir).map_err(setup)?;
            println!(
                "fraud example in {}: serve it with `quiver serve --demo --workload fraud --data-dir {}` or \
                 `quiver serve --config {}`",
                args.data_dir.display(),
                args.data_dir.display(),
                files.config.display()
            );
            fraud::model().map_err(setup)?
        }
        DemoWorkload::Auction => {
            let files = auction::ensure(&args.data_dir).map_err(setup)?;
            println!(
                "auction example in {}: serve it with `quiver serve --demo --workload auction --data-dir {}` or \
                 `quiver serve --config {}`",
                args.data_dir.display(),
                args.data_dir.display(),
                files.config.display()
            );
            auction::model()
        }
        DemoWorkload::Auction32 => {
            demo::ensure(&args.data_dir)?;
            demo::model()
        }
    };
    if let Some(dir) = &args.models_dir {
        for version in [1, 2] {
            let model = quiver::model::Model { version, ..model.clone() };
            let path = quiver::registry::publish(dir, &model).map_err(setup)?;
            println!("published {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
