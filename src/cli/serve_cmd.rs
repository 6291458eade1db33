//! `quiver serve`: the config file, overridden by flags, handed to
//! `server::run` with SIGTERM/SIGINT wired to a drain.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use quiver::config::Config;
use quiver::loadgen::{auction, demo, fraud, DemoWorkload};
use quiver::score::cpu::KernelChoice;
use quiver::score::BackendKind;
use quiver::Error;

#[derive(clap::Args)]
pub struct Args {
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
    /// Generate (once) and serve a built-in example (--workload).
    #[arg(long)]
    demo: bool,
    /// With --demo: auction-32 (the default), fraud or auction, whose
    /// feature groups this sets as `[[groups]]` (no config file needed).
    #[arg(long, value_enum, requires = "demo")]
    workload: Option<DemoWorkload>,
    #[arg(long, value_enum)]
    backend: Option<BackendKind>,
    /// The INT8 kernel (`kernel`): auto picks the fastest this CPU runs;
    /// one it lacks is a start-up error.
    #[arg(long, value_enum)]
    kernel: Option<KernelChoice>,
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
    /// The Open Inference Protocol's gRPC listener; sets `[oip] grpc_listen`.
    #[arg(long)]
    oip_grpc_listen: Option<String>,
    /// The Open Inference Protocol's HTTP/REST listener; sets `[oip] http_listen`.
    #[arg(long)]
    oip_http_listen: Option<String>,
}

pub fn run(args: Args) -> Result<ExitCode, Error> {
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
    if let Some(v) = args.kernel {
        config.kernel = v;
    }
    if let Some(v) = args.onnxruntime_lib {
        config.onnxruntime_lib = Some(v);
    }
    if config.onnxruntime_lib.is_none() {
        config.onnxruntime_lib = super::ort_dylib_path();
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
    if let Some(v) = args.oip_grpc_listen {
        config.oip.grpc_listen = v;
    }
    if let Some(v) = args.oip_http_listen {
        config.oip.http_listen = v;
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
        let workload = args.workload.unwrap_or(DemoWorkload::Auction32);
        match workload {
            DemoWorkload::Fraud => demo_fraud(&mut config)?,
            DemoWorkload::Auction => demo_auction(&mut config)?,
            DemoWorkload::Auction32 => {
                demo::ensure(&config.data_dir)?;
            }
        }
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

/// Sets up the fraud example in `config.data_dir` and serves it: its five
/// groups become `[[groups]]` (a config file's own must be exactly those),
/// and the card keeps a canary choice sticky.
fn demo_fraud(config: &mut Config) -> Result<(), Error> {
    let groups = fraud::groups();
    if !config.groups.is_empty() && config.groups != groups {
        return Err(Error::Setup(
            "--demo --workload fraud configures its own [[groups]] (card, account, device, ip, merchant); drop \
             [[groups]] from the config file"
                .into(),
        ));
    }
    fraud::ensure(&config.data_dir).map_err(|e| Error::Setup(e.to_string()))?;
    config.groups = groups;
    config.canary_group = fraud::CANARY_GROUP.into();
    Ok(())
}

/// Sets up the auction example in `config.data_dir` and serves it: its six
/// groups, ad → campaign → advertiser linked, become `[[groups]]` (a config
/// file's own must be exactly those), and the user keeps a canary choice
/// sticky.
fn demo_auction(config: &mut Config) -> Result<(), Error> {
    let groups = auction::groups();
    if !config.groups.is_empty() && config.groups != groups {
        return Err(Error::Setup(
            "--demo --workload auction configures its own [[groups]] (user, device, publisher, ad, campaign, \
             advertiser); drop [[groups]] from the config file"
                .into(),
        ));
    }
    auction::ensure(&config.data_dir).map_err(|e| Error::Setup(e.to_string()))?;
    config.groups = groups;
    config.canary_group = auction::CANARY_GROUP.into();
    Ok(())
}
