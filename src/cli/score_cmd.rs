//! `quiver score`: one scoring request, its answer printed as a table or as
//! one JSON object; exit 2 when the server answered but not `Ok`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::client::Client;
use quiver::loadgen;
use quiver::wire::{reason_name, status_name, tier_name, RequestSpec, Status};
use quiver::Error;

use super::ClientTlsArgs;

#[derive(clap::Args)]
pub struct Args {
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

pub fn run(args: Args) -> Result<ExitCode, Error> {
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
