//! The operator's kit is checked against what the server really is:
//! `deploy/quiver.toml` parses and fits `deploy/quiver.service` (cores, stop
//! timeout), every metric the Grafana dashboard and `docs/RUNBOOK.md` name is
//! one a real server exports (with a Redis feed, so the feed's families are
//! there too; `[feast]`'s, which no such server has, one the exposition
//! encodes), every `quiver` command in the runbook parses with the flags it
//! uses, and every admin route it calls exists.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::redis::RedisServer;
use common::{http_get, http_raw, run_quiver, scratch, Server};

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
    quiver::loadgen::demo::ensure(&dir).unwrap();
    let config = dir.join("q.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}\"\ninitial_sync_timeout_ms = 5000\n", redis.url())).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    let mut c = server.client();
    c.score(&common::demo_request(1, 7, vec![1, 2, 3])).unwrap();
    // Families with per-shard samples appear once the shard has published.
    server.wait_stats("the request published", |s| s.requests >= 1);
    let (status, text) = http_get(&format!("http://{}/metrics", server.admin));
    assert_eq!(status, 200);
    text
}

/// Metric prefixes of sections a server with `[feed]` (and no `[log]`)
/// does not export.
const OPTIONAL_SECTION_PREFIXES: &[&str] = &["quiver_feast_", "quiver_log_"];

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
    // Families of an optional section a `[feed]` server without `[log]`
    // does not have (`[feast]` is not combined with `[feed]`): each must be
    // one the exposition encodes (a counter by its family, without
    // `_total`).
    let exposition = std::fs::read_to_string(repo("src/admin/exposition.rs")).unwrap();
    let optional = |n: &str| {
        OPTIONAL_SECTION_PREFIXES.iter().any(|p| n.starts_with(p))
            && exposition.contains(&format!("\"{}\"", n.strip_suffix("_total").unwrap_or(n)))
    };
    for (what, text) in [("deploy/grafana/quiver.json", exprs.as_str()), ("docs/RUNBOOK.md", runbook.as_str())] {
        let named = metric_names(text);
        assert!(named.len() >= 10, "{what} names {} metrics", named.len());
        let missing: Vec<&String> = named.iter().filter(|n| !have.contains(*n) && !optional(n)).collect();
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

/// `deploy/quiver.toml` as it is, with only what must differ on a test
/// machine changed: paths into `dir`, loopback ports, the local Redis, and
/// the cores (the shard count is set on the command line).
fn production_config_here(dir: &Path, redis: &RedisServer) -> PathBuf {
    let text = std::fs::read_to_string(repo("deploy/quiver.toml")).unwrap();
    let mut config: toml::Table = text.parse().unwrap();
    config.remove("cores");
    config.insert("data_dir".into(), dir.display().to_string().into());
    config.insert("models_dir".into(), dir.join("models").display().to_string().into());
    config.insert("admin_token_file".into(), dir.join("admin.token").display().to_string().into());
    config.insert("metrics_listen".into(), "127.0.0.1:0".into());
    let section = |config: &mut toml::Table, name: &str| config.get_mut(name).unwrap().as_table_mut().unwrap().clone();
    let mut reactor = section(&mut config, "reactor");
    reactor.remove("housekeeping_cores");
    config.insert("reactor".into(), reactor.into());
    let mut ladder = section(&mut config, "ladder");
    ladder.insert("fallback_model".into(), dir.join("fallback.qm").display().to_string().into());
    config.insert("ladder".into(), ladder.into());
    let mut feed = section(&mut config, "feed");
    feed.insert("redis".into(), redis.url().into());
    config.insert("feed".into(), feed.into());
    let path = dir.join("production.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    path
}

/// The production configuration, on a real server, against the hostile
/// clients and files of the hardening work at once: it keeps scoring and
/// answering probes throughout (each case is tested on its own, with its
/// counters, in tests/admin_limits.rs, tests/scoring_limits.rs,
/// tests/registry.rs and tests/replica_feed.rs).
#[test]
fn the_production_config_survives_hostile_clients_and_files() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let redis = RedisServer::start();
    let dir = scratch("deploy-hostile");
    quiver::loadgen::demo::ensure(&dir).unwrap();
    std::fs::write(dir.join("admin.token"), "deploy-test-token-0123456789\n").unwrap();
    let mut model = quiver::loadgen::demo::model();
    model.version = 1;
    quiver::registry::publish(&dir.join("models"), &model).unwrap();
    let config = production_config_here(&dir, &redis);
    let mut server = Server::start_with(
        &dir,
        &["--config", config.to_str().unwrap(), "--shards", "1", "--metrics-listen", "127.0.0.1:0"],
    );
    let spec = common::demo_request(1, 7, vec![1, 2, 3]);
    let mut client = server.client();
    assert_eq!(client.score(&spec).unwrap().status, quiver::wire::Status::Ok);
    let metrics = server.metrics.clone();

    // The network-facing metrics listener: a length that once aborted the
    // process, a declared body never sent, and 600 idle connections.
    let hostile = "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000000000\r\n\r\n";
    assert_eq!(http_raw(&metrics, hostile.as_bytes(), Duration::from_secs(8)).0, Some(413));
    let idle: Vec<_> = (0..600).filter_map(|_| std::net::TcpStream::connect(&metrics).ok()).collect();
    let probe = Instant::now();
    assert_eq!(http_get(&format!("http://{metrics}/readyz")).0, 200);
    assert!(probe.elapsed() < common::PROBE_MAX, "/readyz took {:?}", probe.elapsed());
    drop(idle);
    // The controls: a page in a browser gets nothing without the token.
    let drain = "POST /drain HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(http_raw(&server.admin, drain.as_bytes(), Duration::from_secs(8)).0, Some(401));

    // The scoring port: one host past its 256 connections, and a frame
    // dripped a byte at a time, while a client is served.
    let mut many: Vec<_> = (0..260).filter_map(|_| std::net::TcpStream::connect(&server.addr).ok()).collect();
    let mut drip = std::net::TcpStream::connect(&server.addr).unwrap();
    let _ = drip.write_all(&[0, 0]);
    assert_eq!(client.score(&spec).unwrap().status, quiver::wire::Status::Ok, "the open client is served");
    // Held until the server has accepted past the 256th and refused: closed
    // before that (a busy machine accepts late), none would be over.
    server.wait_metric("quiver_connections_refused_source_full_total", 1);
    many.truncate(0);

    // A damaged model version on disk: refused, the served one stays.
    let mut v2 = quiver::loadgen::demo::model();
    v2.version = 2;
    let mut bytes = v2.to_bytes();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::create_dir_all(dir.join("models").join(&v2.name).join("2")).unwrap();
    std::fs::write(dir.join("models").join(&v2.name).join("2").join("model.qm"), &bytes).unwrap();
    server.wait_stderr("checksum mismatch");
    let r = client.score(&spec).unwrap();
    assert_eq!((r.status, r.model_version), (quiver::wire::Status::Ok, 1));

    // Past all of it: serving, ready, and the refusals counted.
    assert!(server.is_running());
    assert_eq!(http_get(&format!("http://{metrics}/readyz")).0, 200);
    for name in [
        "quiver_admin_requests_rejected_total",
        "quiver_admin_unauthorized_total",
        "quiver_connections_refused_source_full_total",
    ] {
        server.wait_metric(name, 1);
    }
    assert_eq!(server.terminate(), 0);
}
