//! `quiver bench`: load against one node (closed or open loop, a rate
//! sweep, or Redis GETs as the outside floor) or several through the
//! multi-node client; the report as text or one JSON object.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use quiver::loadgen::{self, BenchOptions};
use quiver::loadgen::{auction, demo, fraud, DemoWorkload};
use quiver::Error;

use super::ClientTlsArgs;

#[derive(clap::Args)]
pub struct Args {
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
    /// What the requests are: auction-32 (a user, --candidates items,
    /// context), fraud (one card payment over the fraud example's five
    /// groups: `quiver serve --demo --workload fraud`) or auction (a user,
    /// a device, a publisher and --candidates ads, whose campaign and
    /// advertiser rows the server joins: `quiver serve --demo --workload
    /// auction`).
    #[arg(long, value_enum, default_value = "auction-32")]
    workload: DemoWorkload,
    /// Fraud and auction: known entities per keyed group, `GROUP=N,…` over
    /// the example's (fraud: card=50000,account=30000,device=40000,
    /// ip=40000,merchant=2000; auction: user=100000,device=50000,
    /// publisher=2000,ad=20000); --zipf sets every group's exponent
    /// (default 1; --group-zipf one group's), --unknown-fraction the share
    /// of keys outside them (fraud: device and IP keys; auction: device
    /// keys and ad ids).
    #[arg(long)]
    populations: Option<String>,
    /// Fraud and auction: Zipf exponents per keyed group, `GROUP=S,…` over
    /// --zipf's (`device=0.8,merchant=1.2`, `ad=1.2`).
    #[arg(long)]
    group_zipf: Option<String>,
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

pub fn run(args: Args) -> Result<ExitCode, Error> {
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
    let workload = match args.workload {
        DemoWorkload::Fraud => {
            if args.user_zipf.is_some() || args.item_zipf.is_some() {
                return Err(Error::Setup("--workload fraud: --zipf sets every group's exponent".into()));
            }
            let mix = fraud::MIX_DEFAULT.with_flags(args.populations.as_deref(), args.zipf, args.group_zipf.as_deref());
            loadgen::WorkloadKind::Fraud(mix.map_err(Error::Setup)?)
        }
        DemoWorkload::Auction => {
            if args.user_zipf.is_some() || args.item_zipf.is_some() {
                return Err(Error::Setup("--workload auction: --zipf sets every group's exponent".into()));
            }
            let mix =
                auction::MIX_DEFAULT.with_flags(args.populations.as_deref(), args.zipf, args.group_zipf.as_deref());
            loadgen::WorkloadKind::Auction(mix.map_err(Error::Setup)?)
        }
        _ if args.populations.is_some() || args.group_zipf.is_some() => {
            return Err(Error::Setup("--populations and --group-zipf are for --workload fraud or auction".into()));
        }
        _ => loadgen::WorkloadKind::Auction32,
    };
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
        workload,
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
