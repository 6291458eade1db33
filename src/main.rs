//! The `quiver` command line: serve, score, bench, and file tools.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use quiver::client::Client;
use quiver::config::Config;
use quiver::features::feed;
use quiver::features::replica::{Replica, ReplicaBuilder, Storage};
use quiver::loadgen::demo;
use quiver::loadgen::{self, BenchOptions};
use quiver::model::Model;
use quiver::score::BackendKind;
use quiver::wire::{reason_name, status_name, tier_name, RequestSpec, Status};
use quiver::Error;

#[derive(Parser)]
#[command(name = "quiver", version, about = "Real-time ML scoring server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve scoring requests.
    Serve(ServeArgs),
    /// Send one scoring request and print the answer.
    Score(ScoreArgs),
    /// Send load to a running server and print rate and latency percentiles.
    Bench(BenchArgs),
    /// Import an ONNX, LightGBM or XGBoost model into a Quiver model file (.qm).
    Import(ImportArgs),
    /// Write a plain-MLP model file (.qm) as ONNX (input `x`, output
    /// `logit`), e.g. to run the same network on onnxruntime.
    ExportOnnx {
        #[arg(long)]
        model: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Time one backend's forward pass on a model file, single thread, at
    /// several batch sizes; one JSON line per batch size (for
    /// bench/ort_side_by_side.py).
    TimeModel {
        #[arg(long)]
        model: PathBuf,
        #[arg(long, value_enum, default_value = "int8")]
        backend: BackendKind,
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,256,1024")]
        rows: Vec<usize>,
        /// Timed calls per batch size (after warm-up); the median is reported.
        #[arg(long, default_value_t = 200)]
        iters: usize,
        /// Rows are one request's candidates (the first row's user and
        /// context columns in every row), scored with `logits_request`, as
        /// the server scores inline.
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
    },
    /// Feature replica files.
    #[command(subcommand)]
    Replica(ReplicaCommand),
    /// Write features to Redis, the source of truth that replicas follow.
    #[command(subcommand)]
    Features(FeaturesCommand),
    /// Watch a running server: per-stage latency, rates and tiers, every second.
    Stats {
        /// The server's admin address.
        #[arg(long, default_value = "127.0.0.1:7412")]
        admin: String,
        #[arg(long, default_value = "1s", value_parser = loadgen::parse_duration)]
        interval: Duration,
        /// Stop after this many tables; 0 runs until interrupted.
        #[arg(long, default_value_t = 0)]
        count: u64,
        /// The admin bearer token file, sent with the request.
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
    /// Draw PNG plots from benchmark output files.
    #[command(subcommand)]
    Plot(PlotCommand),
    /// Write the auction-32 demo files (replicas and model) into a directory.
    Demo {
        #[arg(long, default_value = "quiver-data")]
        data_dir: PathBuf,
        /// Also publish the demo model as versions 1 and 2 of auction-32 in
        /// this registry directory (for `serve --models-dir`: hot swaps to try).
        #[arg(long)]
        models_dir: Option<PathBuf>,
    },
    /// Check the CUDA backend on this machine's GPU: versions, INT8 parity
    /// with the CPU reference, latency. Writes one JSON object.
    #[cfg(feature = "cuda")]
    GpuCheck {
        /// Batch sizes (rows) to check and time.
        #[arg(long, value_delimiter = ',', default_value = "1,31,32,33,255,1024,4096")]
        batches: Vec<usize>,
        /// Timed calls per batch size, after 10 warm-up calls.
        #[arg(long, default_value_t = 200)]
        iters: usize,
        /// Write the JSON here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML config file; flags below override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    listen: Option<String>,
    /// Number of shards (one per core, cores 0..N).
    #[arg(long)]
    shards: Option<usize>,
    /// Explicit cores, e.g. 0,1 (one shard each).
    #[arg(long, value_delimiter = ',')]
    cores: Option<Vec<usize>>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Keep the feature replicas in sync with this Redis
    /// (redis://[user:password@]host:port[/db]); sets `[feed] redis`.
    #[arg(long)]
    redis: Option<String>,
    /// Serve a model registry: <DIR>/<name>/<version>/model.qm.
    #[arg(long)]
    models_dir: Option<PathBuf>,
    /// Generate (once) and serve the built-in auction-32 demo.
    #[arg(long)]
    demo: bool,
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// The onnxruntime library (`onnxruntime_lib`), for versions served
    /// through onnxruntime (a binary built with `--features onnxruntime`).
    #[arg(long)]
    onnxruntime_lib: Option<PathBuf>,
    /// Admin HTTP address (metrics, health, readiness and the controls), or "off".
    #[arg(long)]
    admin: Option<String>,
    /// The bearer token file the admin controls need; sets `admin_token_file`.
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Let the admin token cross the network in plain HTTP when `--admin` is
    /// not loopback; sets `admin_token_over_plaintext`.
    #[arg(long)]
    admin_token_over_plaintext: bool,
    /// A read-only metrics/health listener with no controls; sets `metrics_listen`.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// While not ready: refuse new connections, or answer Overloaded.
    #[arg(long, value_enum)]
    not_ready: Option<quiver::config::NotReadyPolicy>,
    /// Score inline on the shard, or on a dedicated inference thread.
    #[arg(long, value_enum)]
    inference: Option<quiver::config::InferenceMode>,
    /// Protocol floor for benchmarks: verify each request and answer with an
    /// empty Ok response, skipping lookup and model.
    #[arg(long)]
    floor: bool,
    /// Speak TLS on the scoring port with this PEM certificate chain (and
    /// --tls-key); sets `[tls] cert_file`.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The certificate's PEM private key; sets `[tls] key_file`.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

/// How `score` and `bench` reach a scoring port that speaks TLS.
#[derive(clap::Args)]
struct ClientTlsArgs {
    /// Speak TLS, trusting the system's CA certificates (or --tls-ca's).
    #[arg(long)]
    tls: bool,
    /// PEM file of the CA (or the self-signed certificate) to trust; implies --tls.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// Client certificate chain and key (PEM), for a server with `tls.client_ca_file`.
    #[arg(long, requires = "tls_client_key")]
    tls_client_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_client_cert")]
    tls_client_key: Option<PathBuf>,
    /// The name the server's certificate must carry; default: the host of --addr.
    #[arg(long)]
    tls_server_name: Option<String>,
}

impl ClientTlsArgs {
    fn settings(&self) -> Option<quiver::tls::ClientTls> {
        let wanted =
            self.tls || self.tls_ca.is_some() || self.tls_client_cert.is_some() || self.tls_server_name.is_some();
        wanted.then(|| quiver::tls::ClientTls {
            ca_file: self.tls_ca.clone(),
            cert_file: self.tls_client_cert.clone(),
            key_file: self.tls_client_key.clone(),
            server_name: self.tls_server_name.clone(),
        })
    }
}

#[derive(clap::Args)]
struct ScoreArgs {
    #[arg(long, default_value = "127.0.0.1:7411")]
    addr: String,
    #[arg(long)]
    user: u64,
    /// Candidate item ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    items: Vec<u64>,
    /// Context floats, comma-separated (empty means all zeros).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    context: Vec<f32>,
    /// Categorical context ids, comma-separated, for models that embed them
    /// (empty means none: the embeddings' default rows).
    #[arg(long, value_delimiter = ',')]
    context_ids: Vec<u64>,
    /// Time budget in microseconds; 0 uses the server's default.
    #[arg(long, default_value_t = 0)]
    budget_us: u32,
    #[arg(long, default_value = "")]
    model: String,
    #[arg(long, default_value_t = 0)]
    priority: u8,
    #[arg(long, default_value_t = 0)]
    client_id: u32,
    /// Client-side timeout.
    #[arg(long, default_value = "2s", value_parser = loadgen::parse_duration)]
    timeout: Duration,
    #[command(flatten)]
    tls: ClientTlsArgs,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// One node, or several (`a:7411,b:7411,c:7411`): then through the
    /// multi-node client (balancing, failover, hedges), reported per node.
    #[arg(long, default_value = "127.0.0.1:7411")]
    addr: String,
    /// With several nodes: hedge a request unanswered after this long.
    #[arg(long, conflicts_with = "hedge_p95")]
    hedge_after_us: Option<u64>,
    /// With several nodes: hedge after the first node's recent p95 (at
    /// least 100 µs).
    #[arg(long)]
    hedge_p95: bool,
    /// Hedges as a fraction of requests, at most.
    #[arg(long, default_value_t = 0.05)]
    hedge_fraction: f64,
    /// What to send: Quiver scoring requests, or Redis GETs of values the
    /// bench writes first (the outside floor, by the same generator).
    #[arg(long, value_enum, default_value = "quiver")]
    protocol: loadgen::Protocol,
    /// With --protocol redis: bytes in each value.
    #[arg(long, default_value_t = 128)]
    redis_value_bytes: usize,
    #[arg(long, default_value = "10s", value_parser = loadgen::parse_duration)]
    duration: Duration,
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Offered rate in requests/s (open loop); without it, closed loop.
    #[arg(long)]
    rate: Option<f64>,
    /// Open-loop arrival process.
    #[arg(long, value_enum, default_value = "uniform")]
    arrival: loadgen::Arrival,
    /// Requests in flight per connection in closed loop.
    #[arg(long, default_value_t = 8)]
    pipeline: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = demo::CANDIDATES)]
    candidates: usize,
    /// Context floats per request: the model's context width (16 for the
    /// demo; 0 sends none, which the server fills with zeros).
    #[arg(long, default_value_t = demo::CONTEXT_LEN)]
    context_len: usize,
    /// Fraction of user and item ids drawn outside the known ranges.
    #[arg(long, default_value_t = 0.0)]
    unknown_fraction: f64,
    /// Known user ids are 0..N: the served user replica's population
    /// (the demo's by default).
    #[arg(long, default_value_t = demo::USERS)]
    users: u64,
    /// Known item ids are 0..N: the served item replica's population.
    #[arg(long, default_value_t = demo::ITEMS)]
    items: u64,
    /// Draw user and item ids from Zipf(S) instead of uniformly.
    #[arg(long, conflicts_with_all = ["user_zipf", "item_zipf"])]
    zipf: Option<f64>,
    /// Draw user ids from Zipf(S) over --users (items stay uniform unless
    /// --item-zipf).
    #[arg(long)]
    user_zipf: Option<f64>,
    /// Draw item ids from Zipf(S) over --items.
    #[arg(long)]
    item_zipf: Option<f64>,
    #[arg(long, default_value_t = 0)]
    budget_us: u32,
    /// Priorities to send, with shares: `0:0.75,9:0.25` (higher is more
    /// important); the report breaks results down by priority. Default: all 0.
    #[arg(long)]
    priority_mix: Option<String>,
    /// Rate sweep START:STEP:MAX (req/s): open-loop runs of --duration at
    /// rising rates until p99 exceeds --p99-max-us or a request fails.
    #[arg(long)]
    sweep: Option<String>,
    /// Runs per sweep step; the step's figures are the run with the median p99.
    #[arg(long, default_value_t = 1)]
    sweep_repeats: usize,
    /// The p99 bound of a sweep, in microseconds.
    #[arg(long, default_value_t = 1_000)]
    p99_max_us: u64,
    /// Write an HdrHistogram interval log (one histogram per second).
    #[arg(long)]
    histogram_log: Option<PathBuf>,
    /// Write the percentile distribution (HdrHistogram .hgrm text).
    #[arg(long)]
    percentiles: Option<PathBuf>,
    #[command(flatten)]
    tls: ClientTlsArgs,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["onnx", "lightgbm", "xgboost"])))]
struct ImportArgs {
    /// An ONNX file (MLPs, graph models, tree ensembles; README, "Importing models").
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
    /// the graph input of each.
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

#[derive(Subcommand)]
enum PlotCommand {
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

#[derive(Subcommand)]
enum ReplicaCommand {
    /// Build a replica file from a text input file (see docs/REPLICA.md).
    Build {
        /// Feature group name: `user` or `item`.
        #[arg(long)]
        group: String,
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
        /// How vectors are stored: f32 (exact), f16 or int8 (see docs/REPLICA.md).
        #[arg(long, default_value = "f32", value_parser = parse_storage)]
        storage: Storage,
    },
    /// Full sync of one group from Redis into a replica file, with progress
    /// on stderr (the server does the same when it has no usable file).
    Sync {
        #[arg(long, default_value = "redis://127.0.0.1:6379")]
        redis: String,
        #[arg(long)]
        group: String,
        /// Vector dimension of the group.
        #[arg(long)]
        dim: u32,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "f32", value_parser = parse_storage)]
        storage: Storage,
        /// Connections to copy over (1 to 16): one SCANs, the others MGET in parallel.
        #[arg(long, default_value_t = 4)]
        connections: usize,
        /// The group is stored in this many buckets (as `quiver features
        /// --buckets` wrote it; [feed] buckets must say the same): one file
        /// per bucket beside --out, named as the server names them. Default:
        /// 16 on a cluster, the plain layout (one file) on one node.
        #[arg(long)]
        buckets: Option<u16>,
    },
    /// Verify a replica file and print its header.
    Inspect {
        #[arg(long)]
        group: String,
        #[arg(long)]
        file: PathBuf,
    },
    /// Accept a held resync on a running server: the copy of what Redis has
    /// now replaces the replica's last-known-good rows (see docs/REPLICA.md).
    Accept {
        /// The server's admin address.
        #[arg(long, default_value = "127.0.0.1:7412")]
        admin: String,
        #[arg(long)]
        group: String,
        /// The admin bearer token file (the server's `admin_token_file`).
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum FeaturesCommand {
    /// Set one entity's vector.
    Put {
        #[command(flatten)]
        target: FeedTarget,
        #[arg(long)]
        id: u64,
        /// The vector, comma-separated.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true, required = true)]
        values: Vec<f32>,
    },
    /// Delete entities: the ids given, and those listed in a file.
    Delete {
        #[command(flatten)]
        target: FeedTarget,
        /// Ids to delete, comma-separated.
        #[arg(long, value_delimiter = ',')]
        id: Vec<u64>,
        /// A file of ids to delete, one per line (`#` comments and blank
        /// lines skipped); checked whole before the first delete.
        #[arg(long)]
        ids_from: Option<PathBuf>,
    },
    /// Write every row of a text file (the `replica build` format) to Redis.
    Load {
        #[command(flatten)]
        target: FeedTarget,
        #[arg(long)]
        input: PathBuf,
    },
}

#[derive(clap::Args)]
struct FeedTarget {
    /// redis://[user:password@]host:port[/db], or
    /// redis+cluster://[user:password@]host:port[,host:port...] for a Redis Cluster
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// Write the bucketed layout with this many buckets (hash-tagged keys,
    /// a counter and a stream per bucket: docs/REPLICA.md). The server's
    /// [feed] buckets must say the same. Default: 16 on a cluster, the plain
    /// layout on one node.
    #[arg(long)]
    buckets: Option<u16>,
    /// Feature group, e.g. user or item.
    #[arg(long)]
    group: String,
    /// Approximate bound on the group's change stream (XADD MAXLEN ~).
    #[arg(long, default_value_t = feed::contract::STREAM_MAXLEN_DEFAULT)]
    stream_maxlen: u64,
}

impl FeedTarget {
    fn publisher(&self) -> Result<feed::Publisher, Error> {
        feed::contract::check_group(&self.group).map_err(feed::FeedError::from)?;
        let publisher = match feed::redis_cluster::RedisSource::from_url(&self.redis).map_err(feed::FeedError::from)? {
            feed::redis_cluster::RedisSource::Node(config) => {
                let conn = feed::RedisConn::connect(&config).map_err(feed::FeedError::from)?;
                let plain = feed::Publisher::new(conn).map_err(feed::FeedError::from)?;
                match self.buckets {
                    None => plain,
                    Some(b) => {
                        let layout = feed::contract::Layout::bucketed(b).map_err(feed::FeedError::from)?;
                        plain.with_layout(layout).map_err(feed::FeedError::from)?
                    }
                }
            }
            feed::redis_cluster::RedisSource::Cluster { config, seeds } => {
                let conn = feed::redis_cluster::ClusterConn::connect(&config, &seeds).map_err(feed::FeedError::from)?;
                let buckets = self.buckets.unwrap_or(feed::contract::CLUSTER_BUCKETS_DEFAULT);
                feed::Publisher::cluster(conn, buckets).map_err(feed::FeedError::from)?
            }
        };
        Ok(publisher.with_stream_maxlen(self.stream_maxlen))
    }
}

fn main() -> ExitCode {
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
        Command::Serve(args) => serve(args),
        Command::Score(args) => score(args),
        Command::Bench(args) => bench(args),
        Command::Import(args) => import(args),
        Command::TimeModel { model, backend, rows, iters, one_request, data, onnxruntime_lib } => {
            if let Some(lib) = &onnxruntime_lib {
                quiver::score::configure_onnxruntime(lib);
            }
            time_model(&model, backend, &rows, iters, one_request, data.as_deref())
        }
        Command::Replica(cmd) => replica(cmd),
        Command::Features(cmd) => features(cmd),
        Command::Plot(cmd) => plot(cmd),
        Command::ExportOnnx { model, out } => export_onnx(&model, &out),
        Command::Stats { admin, interval, count, token_file } => stats(&admin, interval, count, token_file.as_deref()),
        Command::Demo { data_dir, models_dir } => demo_cmd(&data_dir, models_dir.as_deref()),
        #[cfg(feature = "cuda")]
        Command::GpuCheck { batches, iters, out } => Ok(gpu_check(&batches, iters, out.as_deref())),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("quiver: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<ExitCode, Error> {
    let mut config = match &args.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(v) = args.listen {
        config.listen = v;
    }
    if let Some(v) = args.shards {
        config.shards = v;
        config.cores.clear();
    }
    if let Some(v) = args.cores {
        config.cores = v;
    }
    if let Some(v) = args.data_dir {
        config.data_dir = v;
    }
    if let Some(v) = args.models_dir {
        config.models_dir = Some(v);
    }
    if let Some(v) = args.backend {
        config.backend = v;
    }
    if let Some(v) = args.onnxruntime_lib {
        config.onnxruntime_lib = Some(v);
    }
    if args.floor {
        config.floor = true;
    }
    if let Some(v) = args.inference {
        config.inference = v;
    }
    if let Some(v) = args.admin_token_file {
        config.admin_token_file = Some(v);
    }
    if args.admin_token_over_plaintext {
        config.admin_token_over_plaintext = true;
    }
    if let Some(v) = args.metrics_listen {
        config.metrics_listen = v;
    }
    if let Some(v) = args.admin {
        config.admin_listen = v;
    }
    if let Some(v) = args.not_ready {
        config.not_ready = v;
    }
    if let Some(url) = args.redis {
        config.feed.get_or_insert_with(Default::default).redis = url;
    }
    if let (Some(cert_file), Some(key_file)) = (args.tls_cert, args.tls_key) {
        let tls = config.tls.get_or_insert_with(|| quiver::tls::ServerTls {
            cert_file: PathBuf::new(),
            key_file: PathBuf::new(),
            client_ca_file: None,
            handshake_timeout_ms: quiver::tls::HANDSHAKE_TIMEOUT_MS_DEFAULT,
            handshakes_per_s_max: quiver::tls::HANDSHAKES_PER_S_MAX_DEFAULT,
            handshake_burst: quiver::tls::HANDSHAKE_BURST_DEFAULT,
        });
        tls.cert_file = cert_file;
        tls.key_file = key_file;
    }
    if args.demo {
        demo::ensure(&config.data_dir)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // A second signal while draining exits at once.
        signal_hook::flag::register_conditional_shutdown(sig, 1, stop.clone())
            .and_then(|_| signal_hook::flag::register(sig, stop.clone()))
            .map_err(|e| Error::Setup(format!("installing signal handlers: {e}")))?;
    }
    quiver::server::run(config, stop, |event| match event {
        quiver::server::Event::Listening { what, addr } => println!("quiver {what} on {addr}"),
        quiver::server::Event::Serving { addr, shards, tls } => {
            println!("quiver listening on {addr} with {shards} shards{}", if tls { " (TLS)" } else { "" })
        }
    })?;
    Ok(ExitCode::SUCCESS)
}

fn score(args: ScoreArgs) -> Result<ExitCode, Error> {
    let spec = RequestSpec {
        request_id: 1,
        model: args.model,
        budget_us: args.budget_us,
        priority: args.priority,
        client_id: args.client_id,
        user_id: args.user,
        item_ids: args.items,
        context: args.context,
        context_ids: args.context_ids,
    };
    let started = Instant::now();
    let tls = args.tls.settings();
    let result = Client::connect_with(&args.addr, args.timeout, tls.as_ref()).and_then(|mut c| c.score(&spec));
    let rtt_us = started.elapsed().as_micros() as u64;
    let resp = match result {
        Ok(r) => r,
        Err(e) => {
            if args.json {
                println!("{}", serde_json::json!({ "error": e.to_string(), "rtt_us": rtt_us }));
            }
            return Err(Error::Setup(e.to_string()));
        }
    };
    if args.json {
        let out = serde_json::json!({
            "request_id": resp.request_id,
            "status": status_name(resp.status),
            "tier": tier_name(resp.tier),
            "reason": reason_name(resp.reason),
            "scores": resp.scores,
            "model_version": resp.model_version,
            "features_missing": resp.features_missing,
            "server_us": resp.server_us,
            "features_stale": resp.features_stale,
            "rtt_us": rtt_us,
            "error": resp.error,
        });
        println!("{out}");
    } else {
        println!(
            "status {}  tier {}{}  model v{}  features missing {}  server {} µs  round trip {} µs",
            status_name(resp.status),
            tier_name(resp.tier),
            if resp.reason == quiver::wire::Reason::None {
                String::new()
            } else {
                format!(" ({})", reason_name(resp.reason))
            },
            resp.model_version,
            resp.features_missing,
            resp.server_us,
            rtt_us
        );
        if !resp.error.is_empty() {
            println!("error: {}", resp.error);
        }
        if resp.features_stale {
            println!("features stale: the replica has not been confirmed current within the server's bound");
        }
        for (item, s) in spec.item_ids.iter().zip(&resp.scores) {
            println!("{item}\t{s:.6}");
        }
    }
    Ok(if resp.status == Status::Ok { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

fn demo_cmd(data_dir: &Path, models_dir: Option<&Path>) -> Result<ExitCode, Error> {
    demo::ensure(data_dir)?;
    if let Some(dir) = models_dir {
        for version in [1, 2] {
            let model = quiver::model::Model { version, ..demo::model() };
            let path = quiver::registry::publish(dir, &model).map_err(|e| Error::Setup(e.to_string()))?;
            println!("published {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn bench(args: BenchArgs) -> Result<ExitCode, Error> {
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        return Err(Error::Setup("--rate must be a positive number".into()));
    }
    if !(0.0..=1.0).contains(&args.unknown_fraction) {
        return Err(Error::Setup("--unknown-fraction must be within 0..=1".into()));
    }
    let dist = |s: Option<f64>| s.map_or(demo::IdDist::Uniform, demo::IdDist::Zipf);
    if args.redis_value_bytes > loadgen::redis_floor::VALUE_BYTES_MAX {
        return Err(Error::Setup(format!("--redis-value-bytes: at most {}", loadgen::redis_floor::VALUE_BYTES_MAX)));
    }
    let addrs: Vec<String> = args.addr.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect();
    let multi = addrs.len() > 1;
    if !multi && (args.hedge_after_us.is_some() || args.hedge_p95) {
        return Err(Error::Setup("hedging needs several nodes: --addr a:7411,b:7411".into()));
    }
    if !(0.0..=1.0).contains(&args.hedge_fraction) {
        return Err(Error::Setup("--hedge-fraction must be within 0..=1".into()));
    }
    if multi && (args.sweep.is_some() || args.tls.settings().is_some() || args.protocol != loadgen::Protocol::Quiver) {
        return Err(Error::Setup("several nodes take plain Quiver load: no --sweep, --tls or --protocol redis".into()));
    }
    let opts = BenchOptions {
        addr: args.addr.clone(),
        protocol: args.protocol,
        redis_value_bytes: args.redis_value_bytes,
        duration: args.duration,
        connections: args.connections.clamp(1, 1024),
        rate: args.rate,
        arrival: args.arrival,
        pipeline: args.pipeline.clamp(1, 4096),
        seed: args.seed,
        candidates: args.candidates.max(1),
        context_len: args.context_len,
        unknown_fraction: args.unknown_fraction,
        users: args.users,
        items: args.items,
        user_dist: dist(args.user_zipf.or(args.zipf)),
        item_dist: dist(args.item_zipf.or(args.zipf)),
        budget_us: args.budget_us,
        priority_mix: match &args.priority_mix {
            Some(mix) => loadgen::parse_priority_mix(mix).map_err(Error::Setup)?,
            None => Vec::new(),
        },
        tls: args.tls.settings(),
    };
    // Checked before any connection, so a bad population or exponent is a
    // start-up error, not a failed run.
    let workload = opts.workload().map_err(|e| Error::Setup(format!("bench: {e}")))?;
    let write_files = |rec: &loadgen::Recording| -> Result<(), Error> {
        let io = |p: &PathBuf, e: std::io::Error| Error::Setup(format!("{}: {e}", p.display()));
        if let Some(p) = &args.histogram_log {
            rec.write_interval_log(p, "quiver").map_err(|e| io(p, e))?;
        }
        if let Some(p) = &args.percentiles {
            rec.write_percentiles(p).map_err(|e| io(p, e))?;
        }
        Ok(())
    };
    if multi {
        let hedge = match (args.hedge_after_us, args.hedge_p95) {
            (Some(us), _) => quiver::client::cluster::Hedge::After(Duration::from_micros(us)),
            (None, true) => quiver::client::cluster::Hedge::NodeP95 { floor: Duration::from_micros(100) },
            (None, false) => quiver::client::cluster::Hedge::Off,
        };
        let nodes = loadgen::nodes::NodesOptions { addrs, hedge, hedge_fraction: args.hedge_fraction };
        let report = loadgen::nodes::run(&opts, &nodes, workload).map_err(|e| Error::Setup(e.to_string()))?;
        if args.json {
            println!("{}", serde_json::to_string(&report).expect("report serialises"));
        } else {
            print!("{report}");
        }
        return Ok(if report.received > 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }
    let Some(sweep) = &args.sweep else {
        let (report, rec) = loadgen::run_recorded(&opts);
        write_files(&rec)?;
        if args.json {
            println!("{}", serde_json::to_string(&report).expect("report serialises"));
        } else {
            print!("{report}");
        }
        return Ok(if report.received > 0 && report.connection_errors.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    };
    let (start, step, max) = loadgen::parse_sweep(sweep).map_err(Error::Setup)?;
    let plan = loadgen::Sweep { start, step, max, repeats: args.sweep_repeats, p99_max_us: args.p99_max_us };
    let summary = loadgen::sweep(&opts, &plan, |rate, report, rec, held| {
        if !args.json {
            eprintln!(
                "offered {rate:>9.0} req/s  achieved {:>9.0}  p50 {:>7} µs  p99 {:>7} µs  p99.9 {:>7} µs  max {:>7} µs  {}",
                report.achieved_rate,
                report.latency.p50_us,
                report.latency.p99_us,
                report.latency.p999_us,
                report.latency.max_us,
                if held { "held" } else { "NOT held" }
            );
        }
        if held {
            write_files(rec)?;
        }
        Ok::<(), Error>(())
    })?;
    let capacity = summary.capacity_rate;
    if args.json {
        println!("{}", serde_json::to_string(&summary).expect("report serialises"));
    } else {
        match capacity {
            Some(r) => println!("capacity at p99 <= {} µs: {r:.0} req/s", args.p99_max_us),
            None => println!("no step held p99 <= {} µs", args.p99_max_us),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The `Authorization` header value for a token file, if one is given.
fn bearer(token_file: Option<&std::path::Path>) -> Result<Option<String>, Error> {
    let Some(path) = token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|e| Error::Setup(format!("{}: {e}", path.display())))?;
    Ok(Some(format!("Bearer {}", text.trim())))
}

fn fetch_stats(agent: &ureq::Agent, url: &str, auth: Option<&str>) -> Result<quiver::admin::Stats, Error> {
    let mut req = agent.get(url);
    if let Some(a) = auth {
        req = req.header("Authorization", a);
    }
    let mut resp = req.call().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    let body = resp.body_mut().read_to_string().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    serde_json::from_str(&body).map_err(|e| Error::Setup(format!("{url}: {e}")))
}

fn stats(admin: &str, interval: Duration, count: u64, token_file: Option<&std::path::Path>) -> Result<ExitCode, Error> {
    let auth = bearer(token_file)?;
    let agent: ureq::Agent = ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(5))).build().into();
    let url = format!("http://{admin}/stats.json");
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut prev: Option<(Instant, quiver::admin::Stats)> = None;
    let mut shown = 0u64;
    loop {
        let now = Instant::now();
        let s = fetch_stats(&agent, &url, auth.as_deref())?;
        let rate = prev.as_ref().map(|(t, p)| {
            let dt = now.duration_since(*t).as_secs_f64().max(1e-9);
            (s.requests.saturating_sub(p.requests)) as f64 / dt
        });
        if tty {
            print!("\x1b[2J\x1b[H");
        }
        print!("{}", quiver::admin::render_stats(&s, rate));
        shown += 1;
        if count > 0 && shown >= count {
            return Ok(ExitCode::SUCCESS);
        }
        println!();
        prev = Some((now, s));
        std::thread::sleep(interval);
    }
}

fn plot(cmd: PlotCommand) -> Result<ExitCode, Error> {
    let split = |arg: &str| -> Result<(String, PathBuf), Error> {
        let (label, file) = arg.split_once('=').ok_or_else(|| Error::Setup(format!("'{arg}': expected LABEL=FILE")))?;
        Ok((label.to_string(), PathBuf::from(file)))
    };
    let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| Error::Setup(format!("{}: {e}", p.display())));
    match cmd {
        PlotCommand::Percentiles { out, title, runs } => {
            let mut series = Vec::new();
            for r in &runs {
                let (label, file) = split(r)?;
                series.push((label, loadgen::parse_percentiles(&read(&file)?)));
            }
            quiver::loadgen::plot::percentiles(&out, &title, &series).map_err(Error::Setup)?;
        }
        PlotCommand::Sweep { out, title, sweeps } => {
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
        PlotCommand::Scale { out, title, y_desc, divide_by, results, fields } => {
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

fn import(args: ImportArgs) -> Result<ExitCode, Error> {
    if let Some(lib) = &args.onnxruntime_lib {
        quiver::score::configure_onnxruntime(lib);
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

fn export_onnx(model: &Path, out: &Path) -> Result<ExitCode, Error> {
    let m = Model::load(model)?;
    let bytes = quiver::model::onnx::export_mlp(&m)?;
    std::fs::write(out, &bytes).map_err(|e| Error::Setup(format!("{}: {e}", out.display())))?;
    let inputs: Vec<String> =
        m.inputs.iter().map(|s| format!("{}:{}", quiver::model::onnx::source_name(s.source), s.dim)).collect();
    println!("wrote {} ({} bytes): input 'x' = {}, output 'logit'", out.display(), bytes.len(), inputs.join(","));
    Ok(ExitCode::SUCCESS)
}

/// Calibrates `model` on the `.npy` set at `path` (with a progress bar) and
/// returns the summary lines (`score::accuracy::calibrate`).
fn calibrate_import(
    model: &mut Model,
    path: &std::path::Path,
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

/// `quiver time-model`: `score::timing::time_model`'s figures as JSON lines.
fn time_model(
    path: &std::path::Path,
    kind: BackendKind,
    rows: &[usize],
    iters: usize,
    one_request: bool,
    data: Option<&std::path::Path>,
) -> Result<ExitCode, Error> {
    let model = Model::load(path)?;
    let rows_from = match data {
        None => None,
        Some(p) => {
            Some(quiver::model::calibrate::read_npy(p).map_err(|e| Error::Setup(format!("{}: {e}", p.display())))?)
        }
    };
    let timings = quiver::score::timing::time_model(&model, kind, rows, iters, one_request, rows_from.as_ref())
        .map_err(|e| Error::Setup(format!("{}: {e}", data.unwrap_or(path).display())))?;
    for t in timings {
        println!("{}", serde_json::to_string(&t).expect("a timing serializes"));
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_storage(s: &str) -> Result<Storage, String> {
    Storage::parse(s).ok_or_else(|| format!("unknown storage '{s}': use f32, f16 or int8"))
}

fn replica(cmd: ReplicaCommand) -> Result<ExitCode, Error> {
    match cmd {
        ReplicaCommand::Build { group, input, out, storage } => {
            if !matches!(group.as_str(), "user" | "item") {
                return Err(Error::Setup(format!("unknown group '{group}': use user or item")));
            }
            let text =
                std::fs::read_to_string(&input).map_err(|e| Error::Setup(format!("{}: {e}", input.display())))?;
            let builder = ReplicaBuilder::from_text(&group, &text, &input.display().to_string())?.storage(storage);
            builder.write(&out)?;
            let r = Replica::open(&out, &group)?;
            println!("wrote {}: group {} dim {} rows {}", out.display(), group, r.dim(), r.header().row_count);
        }
        ReplicaCommand::Sync { redis, group, dim, out, storage, connections, buckets } => {
            if !matches!(group.as_str(), "user" | "item") {
                return Err(Error::Setup(format!("unknown group '{group}': use user or item")));
            }
            if dim == 0 || dim > quiver::features::replica::DIM_MAX {
                return Err(Error::Setup(format!("--dim must be 1 to {}", quiver::features::replica::DIM_MAX)));
            }
            if !(1..=feed::sync::SYNC_CONNECTIONS_MAX).contains(&connections) {
                return Err(Error::Setup(format!("--connections must be 1 to {}", feed::sync::SYNC_CONNECTIONS_MAX)));
            }
            let source = feed::redis_cluster::RedisSource::from_url(&redis).map_err(feed::FeedError::from)?;
            let layout = match (buckets, &source) {
                (None, feed::redis_cluster::RedisSource::Node(_)) => feed::contract::Layout::Plain,
                (None, feed::redis_cluster::RedisSource::Cluster { .. }) => {
                    feed::contract::Layout::bucketed(feed::contract::CLUSTER_BUCKETS_DEFAULT)
                        .map_err(feed::FeedError::from)?
                }
                (Some(b), _) => feed::contract::Layout::bucketed(b).map_err(feed::FeedError::from)?,
            };
            let started = Instant::now();
            let spinner = indicatif::ProgressBar::new_spinner().with_style(
                indicatif::ProgressStyle::with_template("{spinner} {human_pos} entities copied ({per_sec}, {elapsed})")
                    .expect("a valid template"),
            );
            spinner.enable_steady_tick(Duration::from_millis(100));
            let mut progress = |rows: u64| spinner.set_position(rows);
            let default = vec![0.0; dim as usize];
            let target = feed::sync::GroupTarget {
                group: &group,
                layout,
                path: &out,
                dim: dim as usize,
                storage,
                default: &default,
                batch_keys_max: 1000,
                connections,
            };
            let copies = feed::sync::sync_group(&source, &target, &mut progress)?;
            spinner.finish_and_clear();
            let secs = started.elapsed().as_secs_f64();
            let rows: u64 = copies.iter().map(|(_, w)| w.live_rows()).sum();
            for (path, fresh) in &copies {
                println!("{}: {} entities, stream seq {}", path.display(), fresh.live_rows(), fresh.cursor().seq);
            }
            println!(
                "synced {rows} entities of group {group} into {} file{} in {secs:.2} s ({:.0}/s)",
                copies.len(),
                if copies.len() == 1 { "" } else { "s" },
                rows as f64 / secs.max(1e-9),
            );
        }
        ReplicaCommand::Accept { admin, group, token_file } => {
            let url = format!("http://{admin}/replica/{group}/accept");
            let agent: ureq::Agent = ureq::Agent::config_builder()
                .timeout_global(Some(Duration::from_secs(10)))
                .http_status_as_error(false)
                .build()
                .into();
            let mut req = agent.post(&url);
            if let Some(a) = bearer(token_file.as_deref())? {
                req = req.header("Authorization", a);
            }
            let mut resp = req.send_empty().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
            let code = resp.status().as_u16();
            let body = resp.body_mut().read_to_string().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
            let reply: serde_json::Value = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
            return match code {
                200 => {
                    println!("accepted: group {group} now serves {} rows", reply["rows"]);
                    if reply["held"] == true {
                        println!("the next copy from redis is swapped in whatever its size");
                    }
                    Ok(ExitCode::SUCCESS)
                }
                202 => {
                    println!(
                        "requested: the server has not acted on it yet (copying or reconnecting); watch quiver stats"
                    );
                    Ok(ExitCode::SUCCESS)
                }
                _ => Err(Error::Setup(format!(
                    "{url}: {code}: {}",
                    reply["error"].as_str().unwrap_or(&reply.to_string())
                ))),
            };
        }
        ReplicaCommand::Inspect { group, file } => {
            let r = Replica::open(&file, &group)?;
            let h = r.header();
            let c = r.cursor_at_open();
            println!(
                "{}: ok; group {} dim {} storage {:?} rows {} capacity {} index slots {}; redis epoch {} seq {}",
                file.display(),
                h.group,
                h.dim,
                h.storage,
                h.row_count,
                h.row_capacity,
                h.slot_count,
                c.epoch,
                c.seq
            );
            let (entities, bytes) = (r.live_rows(), r.file_bytes());
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            println!(
                "size: {entities} entities, {:.1} MiB file ({:.0} bytes per entity), {:.1} MiB resident when served \
                 (pages are pre-faulted at open; replica_lock locks them)",
                mib(bytes),
                bytes as f64 / entities.max(1) as f64,
                mib(r.resident_bytes())
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn features(cmd: FeaturesCommand) -> Result<ExitCode, Error> {
    let publish_err = |e: feed::PublishError| Error::Feed(e.into());
    match cmd {
        FeaturesCommand::Put { target, id, values } => {
            let mut publisher = target.publisher()?;
            let seq = publisher.put(&target.group, id, &values).map_err(publish_err)?;
            println!("{} seq {seq}", publisher.layout().entity_key(&target.group, id));
        }
        FeaturesCommand::Delete { target, mut id, ids_from } => {
            if let Some(path) = &ids_from {
                id.extend(feed::load::read_ids(path)?);
            }
            match id.as_slice() {
                [] => return Err(Error::Setup("nothing to delete: give --id or --ids-from".into())),
                [one] => {
                    let mut publisher = target.publisher()?;
                    let seq = publisher.delete(&target.group, *one).map_err(publish_err)?;
                    println!("{} deleted, seq {seq}", publisher.layout().entity_key(&target.group, *one));
                }
                many => {
                    let started = Instant::now();
                    let bar = indicatif::ProgressBar::new(many.len() as u64);
                    let seq = target
                        .publisher()?
                        .delete_many(&target.group, many, |done, _| bar.set_position(done as u64))
                        .map_err(publish_err)?;
                    bar.finish_and_clear();
                    println!(
                        "deleted {} entities of group {} in {:.2} s, last seq {seq}",
                        many.len(),
                        target.group,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
        }
        FeaturesCommand::Load { target, input } => {
            let mut publisher = target.publisher()?;
            let summary = feed::load::load_file(&mut publisher, &target.group, &input, load_progress())?;
            if summary.defaults_skipped > 0 {
                eprintln!(
                    "note: skipped {} 'default' line(s): the default vector belongs to the replica, not Redis",
                    summary.defaults_skipped
                );
            }
            eprintln!(
                "loaded {} entities of dim {} into group {} in {:.2} s ({:.0}/s), last seq {}",
                summary.rows,
                summary.dim,
                target.group,
                summary.elapsed_s,
                summary.rows as f64 / summary.elapsed_s.max(1e-9),
                summary.last_seq
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A progress bar on stderr for a long command (import, load); indicatif
/// draws it only when stderr is a terminal.
fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {human_pos}/{human_len} ({percent}%, {per_sec}, eta {eta})",
    )
    .expect("a valid template")
    .progress_chars("=> ");
    indicatif::ProgressBar::new(len).with_style(style).with_message(what.to_string())
}

/// Progress for `features load` on stderr: a bar on a terminal, an occasional
/// plain line otherwise (so logs show the load is alive without flooding them).
fn load_progress() -> impl FnMut(usize, usize) {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bar = progress_bar(0, "loading");
    let mut last: Option<Instant> = None;
    move |done, total| {
        if tty {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
            return;
        }
        let now = Instant::now();
        let finished = done == total;
        if !finished && last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(5)) {
            return;
        }
        if last.is_none() && finished {
            return;
        }
        last = Some(now);
        eprintln!("{done}/{total} entities ({:.0}%)", 100.0 * done as f64 / total.max(1) as f64);
    }
}

/// `quiver gpu-check`: exit 0 when every output matched the CPU reference,
/// 1 when one did not or there is no GPU to check (the JSON says which).
#[cfg(feature = "cuda")]
fn gpu_check(batches: &[usize], iters: usize, out: Option<&std::path::Path>) -> ExitCode {
    let (report, code) = match quiver::score::cuda::gpu_check(batches, iters) {
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
            if let Err(e) = std::fs::write(path, text + "\n") {
                eprintln!("quiver gpu-check: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
        }
        None => println!("{text}"),
    }
    code
}
