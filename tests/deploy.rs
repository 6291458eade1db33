//! The operator's kit is checked against what the server really is:
//! `deploy/quiver.toml` parses and fits `deploy/quiver.service` (cores, stop
//! timeout), every metric the Grafana dashboard and `docs/RUNBOOK.md` name is
//! one a real server exports (with a Redis feed, so the feed's families are
//! there too), every `quiver` command in the runbook parses with the flags it
//! uses, and every admin route it calls exists.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::redis::RedisServer;
use common::{http_get, run_quiver, scratch, Server};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `quiver_*` names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("quiver_") {
        let start = i + at;
        let word_before = start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase() || bytes[end].is_ascii_digit() || bytes[end] == b'_')
        {
            end += 1;
        }
        if !word_before {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

/// What a scrape exports: every family (`# TYPE` line) and sample name.
fn exported(scrape: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in scrape.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if line.starts_with('#') => None,
            None => line.split(['{', ' ']).next(),
        };
        if let Some(n) = name.filter(|n| !n.is_empty()) {
            names.insert(n.to_string());
        }
    }
    names
}

fn scrape_with_feed() -> String {
    let redis = RedisServer::start();
    let dir = scratch("deploy");
    quiver::demo::ensure(&dir).unwrap();
    let config = dir.join("q.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}\"\ninitial_sync_timeout_ms = 5000\n", redis.url())).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    let mut c = server.client();
    c.score(&common::demo_request(1, 7, vec![1, 2, 3])).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    let (status, text) = http_get(&format!("http://{}/metrics", server.admin));
    assert_eq!(status, 200);
    text
}

#[test]
fn the_dashboard_and_the_runbook_name_only_metrics_the_server_exports() {
    let scrape = scrape_with_feed();
    let have = exported(&scrape);
    assert!(have.contains("quiver_replica_staleness_seconds"), "the feed's families are exported:\n{scrape}");
    let dashboard = std::fs::read_to_string(repo("deploy/grafana/quiver.json")).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut exprs = String::new();
    for p in parsed["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            exprs.push_str(t["expr"].as_str().unwrap());
            exprs.push('\n');
        }
    }
    let runbook = std::fs::read_to_string(repo("docs/RUNBOOK.md")).unwrap();
    for (what, text) in [("deploy/grafana/quiver.json", exprs.as_str()), ("docs/RUNBOOK.md", runbook.as_str())] {
        let named = metric_names(text);
        assert!(named.len() >= 10, "{what} names {} metrics", named.len());
        let missing: Vec<&String> = named.iter().filter(|n| !have.contains(*n)).collect();
        assert!(missing.is_empty(), "{what} names metrics the server does not export: {missing:?}");
    }
    // The dashboard covers what an operator needs on one page.
    for family in [
        "quiver_stage_duration_seconds_bucket",
        "quiver_responses_by_tier_total",
        "quiver_step_downs_total",
        "quiver_shed_level",
        "quiver_shard_stalls_total",
        "quiver_replica_staleness_seconds",
        "quiver_replica_resyncs_total",
        "quiver_score_psi",
    ] {
        assert!(exprs.contains(family), "the dashboard has no panel over {family}");
    }
}

#[test]
fn the_production_config_parses_and_fits_the_unit() {
    let config = quiver::config::Config::load(&repo("deploy/quiver.toml")).expect("deploy/quiver.toml parses");
    let unit = std::fs::read_to_string(repo("deploy/quiver.service")).unwrap();
    let value = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("the unit sets {key}"))
            .trim()
            .to_string()
    };
    let stop_s: u64 = value("TimeoutStopSec").trim_end_matches('s').parse().unwrap();
    assert!(stop_s * 1_000 > config.limits.shutdown_grace_ms, "the unit stops before the drain's grace ends");
    let (lo, hi) = value("CPUAffinity").split_once('-').map(|(a, b)| (a.parse().unwrap(), b.parse().unwrap())).unwrap();
    let allowed = |c: &usize| (lo..=hi).contains(c);
    assert!(config.cores.iter().all(allowed), "shard cores {:?} outside CPUAffinity", config.cores);
    let housekeeping = config.reactor.housekeeping_cores.clone().unwrap_or_default();
    assert!(!housekeeping.is_empty() && housekeeping.iter().all(allowed));
    assert!(housekeeping.iter().all(|c| !config.cores.contains(c)), "housekeeping shares a shard's core");
    assert_eq!(value("LimitMEMLOCK"), "infinity", "replica_lock needs the memlock limit");
    assert!(config.replica_lock);
    // ExecStart is a command that parses.
    let exec = value("ExecStart");
    let args: Vec<&str> = exec.split_whitespace().skip(1).collect();
    assert_eq!(&args[..2], ["serve", "--config"]);
    let (code, help, _) = run_quiver(["serve", "--help"]);
    assert_eq!(code, 0);
    assert!(help.contains("--config"));
}

#[test]
fn every_runbook_command_parses_and_every_admin_route_exists() {
    let runbook = std::fs::read_to_string(repo("docs/RUNBOOK.md")).unwrap();
    // Indented command lines, and inline code spans that are whole commands.
    let indented =
        runbook.lines().filter(|l| l.starts_with("    ")).filter_map(|l| l.trim_start().strip_prefix("quiver "));
    let inline = runbook
        .split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|span| span.strip_prefix("quiver "))
        .filter(|span| !span.contains("..."));
    let mut commands = 0;
    for cmd in indented.chain(inline) {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        let path: Vec<&str> = words.iter().copied().take_while(|w| !w.starts_with('-')).collect();
        let (code, help, err) = run_quiver(path.iter().copied().chain(["--help"]));
        assert_eq!(code, 0, "quiver {}: {err}", path.join(" "));
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            assert!(help.contains(flag), "quiver {} has no {flag}:\n{help}", path.join(" "));
        }
        commands += 1;
    }
    assert!(commands >= 5, "{commands} commands in the runbook");
    let mut routes = 0;
    for (i, _) in runbook.match_indices("http://$ADMIN") {
        let rest = &runbook[i + "http://$ADMIN".len()..];
        let url: String = rest.chars().take_while(|c| !c.is_whitespace() && *c != '"' && *c != '`').collect();
        let method = if runbook[..i].rsplit('\n').next().unwrap_or("").contains("-X POST") { "POST" } else { "GET" };
        let route = quiver::admin::route(method, &url);
        assert!(!matches!(route, quiver::admin::Route::Bad { .. }), "{method} {url} is not an admin route");
        routes += 1;
    }
    assert!(routes >= 3, "{routes} admin calls in the runbook");
}
