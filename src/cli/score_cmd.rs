//! `quiver score`: one scoring request, its answer printed as a table or as
//! one JSON object; exit 2 when the server answered but not `Ok`. With
//! `--explain K`, each explained candidate's K largest feature
//! contributions, named from the server's `GET /models` when `--admin`
//! gives its admin address (by index otherwise).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::client::Client;
use quiver::loadgen;
use quiver::wire::{
    explain_skipped_name, reason_name, status_name, tier_name, ExplainSkipped, GroupKeySpec, RequestSpec, Response,
    Status,
};
use quiver::Error;

use super::ClientTlsArgs;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "127.0.0.1:7411")]
    addr: String,
    /// The request's `user_id` (group `user`).
    #[arg(long, default_value_t = 0)]
    user: u64,
    /// Candidate item ids, comma-separated (group `item`); without them the
    /// candidates are counted by the candidate-scope `--key`s, or are one.
    #[arg(long, value_delimiter = ',')]
    items: Vec<u64>,
    /// A feature group's keys, `GROUP=KEY[,KEY…]` (one key for a
    /// request-scope group, one per candidate otherwise); repeatable. Keys
    /// that all read as u64 are sent as ids, others as strings.
    #[arg(long = "key", value_name = "GROUP=KEYS", value_parser = parse_key)]
    keys: Vec<(String, GroupKeySpec)>,
    /// As `--key`, always sent as string keys (`--str-key store=42`).
    #[arg(long = "str-key", value_name = "GROUP=KEYS", value_parser = parse_str_key)]
    str_keys: Vec<(String, GroupKeySpec)>,
    /// Context floats, comma-separated (empty means all zeros).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
    context: Vec<f32>,
    /// Categorical context ids, comma-separated, for models that embed them
    /// (empty means none: the embeddings' default rows).
    #[arg(long, value_delimiter = ',')]
    context_ids: Vec<u64>,
    /// Raw rows: one candidate's model input row, its floats
    /// comma-separated (`nan` for a missing value); repeatable, one per
    /// candidate, all of the model's input width. The rows are scored as
    /// sent, with nothing looked up, so no `--user`, `--items`, `--key` or
    /// context goes with them.
    #[arg(long = "row", value_name = "FLOATS", value_parser = parse_row, allow_hyphen_values = true)]
    rows: Vec<Vec<f32>>,
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
    /// Reason codes: each explained candidate's K features with the largest
    /// contribution to its margin (0: none; at most 32).
    #[arg(long, value_name = "K", default_value_t = 0)]
    explain: u16,
    /// With --explain, explain only the M highest-scored candidates (0: all;
    /// at most 64 are explained).
    #[arg(long, value_name = "M", default_value_t = 0)]
    explain_candidates: u16,
    /// The server's admin address (`admin_listen` or `metrics_listen`), to
    /// name explained features from `GET /models`; without it they are
    /// printed by index.
    #[arg(long, value_name = "ADDR")]
    admin: Option<String>,
}

pub fn run(args: Args) -> Result<ExitCode, Error> {
    if let Some(row) = args.rows.iter().find(|r| r.len() != args.rows[0].len()) {
        let (first, other) = (args.rows[0].len(), row.len());
        return Err(Error::Setup(format!(
            "--row: every row has the same width; one has {first} floats, another {other}"
        )));
    }
    let row_count = u32::try_from(args.rows.len()).map_err(|_| Error::Setup("--row: too many rows".into()))?;
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
        groups: args.keys.into_iter().chain(args.str_keys).collect(),
        explain_top_k: args.explain,
        explain_candidates_max: args.explain_candidates,
        rows: args.rows.into_iter().flatten().collect(),
        row_count,
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
    // The answer came back: a name lookup that fails only leaves the
    // features by index, said on stderr.
    let names = match (&args.admin, resp.explanations.candidates.is_empty()) {
        (Some(admin), false) => feature_names(admin, &spec.model).unwrap_or_else(|e| {
            eprintln!("warning: features by index: {e}");
            Vec::new()
        }),
        _ => Vec::new(),
    };
    if args.json {
        let mut out = serde_json::json!({
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
        if args.explain > 0 {
            out["explain_skipped"] = explain_skipped_name(resp.explanations.skipped).into();
            out["explanations"] = explanations_json(&resp, &names);
        }
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
        for (at, s) in resp.scores.iter().enumerate() {
            match spec.item_ids.get(at) {
                Some(item) => println!("{item}\t{s:.6}"),
                None => println!("#{at}\t{s:.6}"),
            }
        }
        if args.explain > 0 {
            print!("{}", explanations_text(&resp, &spec.item_ids, &names));
        }
    }
    Ok(if resp.status == Status::Ok { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

/// How long `--admin`'s `GET /models` may take.
const MODELS_TIMEOUT: Duration = Duration::from_secs(5);

/// The input column names of `model` (empty: the only served model) from
/// the admin endpoint's `GET /models`.
fn feature_names(admin: &str, model: &str) -> Result<Vec<String>, Error> {
    let url = format!("http://{admin}/models");
    let agent: ureq::Agent =
        ureq::Agent::config_builder().timeout_global(Some(MODELS_TIMEOUT)).http_status_as_error(false).build().into();
    let mut resp = agent.get(&url).call().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    let code = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    if code != 200 {
        return Err(Error::Setup(format!("{url}: {code}: {}", body.trim())));
    }
    let models: Vec<quiver::registry::ModelStatus> =
        serde_json::from_str(&body).map_err(|e| Error::Setup(format!("{url}: {e}")))?;
    let found = match model {
        "" if models.len() == 1 => models.first(),
        "" => {
            return Err(Error::Setup(format!(
                "{url}: {} models are served; name the one scored with --model to name its features",
                models.len()
            )))
        }
        name => models.iter().find(|m| m.name == name),
    };
    let found = found.ok_or_else(|| Error::Setup(format!("{url}: no model '{model}' is served")))?;
    Ok(found.features.clone())
}

/// The name of input column `index`, when known.
fn name_of(names: &[String], index: u32) -> Option<&str> {
    names.get(index as usize).map(String::as_str)
}

/// `--json`'s `explanations`: per explained candidate its index, the bias
/// and its top features, largest |contribution| first.
fn explanations_json(resp: &Response, names: &[String]) -> serde_json::Value {
    let e = &resp.explanations;
    e.iter()
        .map(|(candidate, top)| {
            let top: Vec<serde_json::Value> = top
                .map(|(index, contribution)| {
                    serde_json::json!({
                        "feature": name_of(names, index),
                        "index": index,
                        "contribution": contribution,
                    })
                })
                .collect();
            serde_json::json!({ "candidate": candidate, "bias": e.bias, "top": top })
        })
        .collect()
}

/// The explanations for a person: why none came, or per candidate its top
/// features, one per line.
fn explanations_text(resp: &Response, items: &[u64], names: &[String]) -> String {
    let e = &resp.explanations;
    if e.skipped != ExplainSkipped::None || e.candidates.is_empty() {
        return format!("explanations: none ({})\n", explain_skipped_name(e.skipped));
    }
    let mut out = format!("explanations (margin = bias {:.6} + the sum of every contribution):\n", e.bias);
    for (candidate, top) in e.iter() {
        match items.get(candidate) {
            Some(item) => out.push_str(&format!("{item} (#{candidate}):\n")),
            None => out.push_str(&format!("#{candidate}:\n")),
        }
        for (index, contribution) in top {
            let name = name_of(names, index).map_or_else(|| format!("feature {index}"), |n| format!("{n} ({index})"));
            out.push_str(&format!("  {contribution:+.6}\t{name}\n"));
        }
    }
    out
}

/// `GROUP=K[,K…]`: ids when every key reads as a u64, else strings.
fn parse_key(text: &str) -> Result<(String, GroupKeySpec), String> {
    let (group, keys) = split_key(text)?;
    match keys.iter().map(|k| k.parse::<u64>()).collect::<Result<Vec<u64>, _>>() {
        Ok(ids) => Ok((group, GroupKeySpec::Ids(ids))),
        Err(_) => Ok((group, GroupKeySpec::Strs(keys))),
    }
}

fn parse_str_key(text: &str) -> Result<(String, GroupKeySpec), String> {
    let (group, keys) = split_key(text)?;
    Ok((group, GroupKeySpec::Strs(keys)))
}

fn split_key(text: &str) -> Result<(String, Vec<String>), String> {
    let (group, keys) = text.split_once('=').ok_or_else(|| format!("'{text}': expected GROUP=KEY[,KEY...]"))?;
    if group.is_empty() || keys.is_empty() {
        return Err(format!("'{text}': expected GROUP=KEY[,KEY...]"));
    }
    Ok((group.to_string(), keys.split(',').map(str::to_string).collect()))
}

/// One `--row`: comma-separated floats, at least one.
fn parse_row(s: &str) -> Result<Vec<f32>, String> {
    let row = s
        .split(',')
        .map(|v| v.trim().parse::<f32>().map_err(|e| format!("'{v}' is not a float: {e}")))
        .collect::<Result<Vec<f32>, String>>()?;
    Ok(row)
}
