//! `quiver feast`: a Feast repository's feature views as Quiver's feature
//! groups: `inspect` says what would be served (groups, widths, key types)
//! and what is refused and why; `sync` copies the views from the Redis
//! online store `feast materialize` filled into replica files.

use std::path::PathBuf;
use std::process::ExitCode;

use quiver::features::feast::{self, repo, FeastRepo};
use quiver::features::feed::redis_cluster::RedisSource;
use quiver::Error;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Print what serving a Feast repository comes to: its project, registry
    /// and online store, then each served feature view as a group (key
    /// type, width, ttl, features in column order), and what is refused and
    /// why. Exits 0 when nothing named is refused, 2 otherwise.
    Inspect {
        /// The Feast repository (the directory of its feature_store.yaml).
        #[arg(long)]
        repo: PathBuf,
        /// A feature service or feature view to serve; repeat for more.
        /// Default: every feature service of the project.
        #[arg(long)]
        serve: Vec<String>,
        /// Also print the served views as `[[groups]]` entries for quiver.toml.
        #[arg(long)]
        toml: bool,
    },
    /// Copy the served views from Feast's Redis online store into replica
    /// files `<data-dir>/<view>.qrep` (SCAN and pipelined HGETALL). A file
    /// is replaced only if the copy keeps enough of its rows (see
    /// --shrink-max); otherwise it is kept and the command exits 3.
    Sync {
        #[arg(long)]
        repo: PathBuf,
        #[arg(long)]
        serve: Vec<String>,
        /// redis://host:port[/db], or redis+cluster://host:port[,host:port...]
        /// for a Redis Cluster; default: the online store's
        /// connection_string (and redis_type) in feature_store.yaml.
        #[arg(long)]
        redis: Option<String>,
        #[arg(long)]
        data_dir: PathBuf,
        /// Keys per SCAN and per pipeline of HGETALL.
        #[arg(long, default_value_t = 1000)]
        batch_keys: usize,
        /// The largest fraction of a populated file's rows a copy may drop
        /// and still replace it.
        #[arg(long, default_value_t = 0.5)]
        shrink_max: f64,
        /// Replace the files whatever the copy drops.
        #[arg(long)]
        accept_shrink: bool,
    },
}

pub fn run(cmd: Command) -> Result<ExitCode, Error> {
    match cmd {
        Command::Inspect { repo, serve, toml } => inspect(&repo, &serve, toml),
        Command::Sync { repo, serve, redis, data_dir, batch_keys, shrink_max, accept_shrink } => {
            if !(0.0..=1.0).contains(&shrink_max) {
                return Err(Error::Setup(format!("--shrink-max {shrink_max} is outside 0..=1")));
            }
            let options = feast::SyncOptions { data_dir, batch_keys, shrink_max, accept_shrink };
            sync(&repo, &serve, redis.as_deref(), &options)
        }
    }
}

fn inspect(dir: &std::path::Path, serve: &[String], toml: bool) -> Result<ExitCode, Error> {
    let repo = FeastRepo::open(dir)?;
    let plan = repo.plan(serve)?;
    println!(
        "project {}, registry {}, entity key serialization version {}",
        repo.project,
        repo.registry_path.display(),
        repo.key_version.number()
    );
    match &repo.online_store {
        Some(s) => println!("online store: redis {} ({})", s.connection_string, s.redis_type),
        None => println!("online store: none configured (sync needs --redis)"),
    }
    println!("feature services: {}", list(&repo.service_names()));
    println!("feature views: {}", list(&repo.view_names()));
    let named = if serve.is_empty() { repo.service_names() } else { serve.to_vec() };
    println!("serving: {}", list(&named));
    println!("{} groups:", plan.views.len());
    for v in &plan.views {
        let ttl = if v.ttl_s == 0 { "none".to_string() } else { format!("{} s", v.ttl_s) };
        if v.join_keys.len() > 1 {
            let types: Vec<&str> = v.join_keys.iter().map(|(_, t)| t.name()).collect();
            let form: Vec<String> = v.join_keys.iter().map(|(k, _)| format!("<{k}>")).collect();
            println!(
                "  {}: entities {} by {} (composite key of {}; group key string \"{}\": the values in this order \
                 joined by '|', an integer in decimal, '|' and '\\' in a string escaped by '\\'), width {}, ttl {ttl}",
                v.name,
                v.entity,
                v.join_key,
                types.join(", "),
                form.join("|"),
                v.features.len()
            );
        } else {
            println!(
                "  {}: entity {} by {} ({} key, group key {}), width {}, ttl {ttl}",
                v.name,
                v.entity,
                v.join_key,
                v.key.name(),
                match v.key {
                    feast::redis_layout::JoinKeyType::String { .. } => "string",
                    _ => "u64",
                },
                v.features.len()
            );
        }
        for (i, f) in v.features.iter().enumerate() {
            println!("    {i:>4}  {} ({})", f.name, f.kind.name());
        }
    }
    if !plan.views.is_empty() {
        // What a model trained on these views passes to `quiver import`.
        let inputs: Vec<String> = plan.views.iter().map(|v| format!("{}:{}", v.name, v.features.len())).collect();
        println!(
            "model inputs (quiver import --inputs, in the order the model reads them; VIEW@candidate:WIDTH for a \
             view keyed once per candidate): {}",
            inputs.join(",")
        );
    }
    if plan.refused.is_empty() {
        println!("refused: nothing");
    } else {
        println!("refused:");
        for r in &plan.refused {
            println!("  {}: {}", r.what, r.why);
        }
    }
    if toml {
        println!();
        for v in &plan.views {
            let key = match v.key {
                feast::redis_layout::JoinKeyType::String { bytes_max } => {
                    format!("key = \"string\"\nkey_bytes_max = {bytes_max}\n")
                }
                _ => String::new(),
            };
            println!("[[groups]]\nname = {:?}\n{key}width = {}", v.name, v.features.len());
        }
    }
    Ok(if plan.refused.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

fn sync(
    dir: &std::path::Path,
    serve: &[String],
    redis: Option<&str>,
    options: &feast::SyncOptions,
) -> Result<ExitCode, Error> {
    let repo = FeastRepo::open(dir)?;
    let plan = repo.plan(serve)?;
    if let Some(r) = plan.refused.first() {
        return Err(Error::Setup(format!(
            "{}: {} (quiver feast inspect --repo {} lists what is refused)",
            r.what,
            r.why,
            dir.display()
        )));
    }
    let url = match (redis, &repo.online_store) {
        (Some(url), _) => url.to_string(),
        (None, Some(store)) => repo::redis_url(store)?,
        (None, None) => return Err(Error::Setup("feature_store.yaml names no online store: pass --redis".into())),
    };
    let source = RedisSource::from_url(&url).map_err(quiver::features::feed::FeedError::from)?;
    let mut conn = feast::Store::connect(&source)?;
    std::fs::create_dir_all(&options.data_dir)
        .map_err(|e| Error::Setup(format!("{}: {e}", options.data_dir.display())))?;
    let report = feast::first_sync(&mut conn, &repo, &plan, options)?;
    println!("{} keys scanned, {} of no served entity", report.keys_scanned, report.keys_other);
    for v in &report.views {
        let state = if v.held { "HELD (file kept)" } else { "written" };
        println!(
            "{}: {} rows ({} before), {} skipped as bad data, {} values missing: {} {state}",
            v.view,
            v.rows,
            v.rows_before,
            v.skipped,
            v.values_missing,
            v.path.display()
        );
    }
    Ok(if report.views.iter().any(|v| v.held) { ExitCode::from(3) } else { ExitCode::SUCCESS })
}
