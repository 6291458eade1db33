//! `quiver stats`: a running server's `/stats.json`, fetched every interval
//! and drawn as a table (redrawn in place on a terminal).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use quiver::loadgen;
use quiver::Error;

use super::bearer;

#[derive(clap::Args)]
pub struct Args {
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

pub fn run(Args { admin, interval, count, token_file }: Args) -> Result<ExitCode, Error> {
    let auth = bearer(token_file.as_deref())?;
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
