//! The admin endpoint of a real server: metrics, readiness, `quiver stats`.

mod common;

use std::time::{Duration, Instant};

use common::{demo_request, Server, BIN};
use quiver::admin::Stats;
use quiver::wire::Status;

fn get(url: &str) -> (u16, String) {
    common::http_get(url)
}

fn post(url: &str) -> u16 {
    common::http_post(url).0
}

fn stats(server: &Server) -> Stats {
    server.stats()
}

/// Polls until `done(stats)`; shards publish once a second.
fn wait_for(server: &Server, done: impl Fn(&Stats) -> bool) -> Stats {
    let until = Instant::now() + common::WAIT;
    loop {
        let s = stats(server);
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < until, "metrics never converged: {s:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn metrics_parse_and_count_what_was_sent() {
    let server = Server::start(&["--shards", "2"]);
    let mut clients: Vec<_> = (0..4).map(|_| server.client()).collect();
    for i in 0..300u64 {
        let c = &mut clients[(i % 4) as usize];
        let r = c.score(&demo_request(i, i, vec![1, 2, 3, 1_000_000])).unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    let s = wait_for(&server, |s| s.requests == 300);
    assert_eq!(s.by_status["ok"], 300);
    assert_eq!(s.by_tier["primary"], 300);
    assert_eq!(s.candidates_scored, 1_200);
    assert_eq!(s.features_missing, 300);
    assert!(s.ready);
    assert_eq!(s.connections_active, 4);
    let e2e = s.stages.iter().find(|st| st.stage == "end_to_end").unwrap();
    assert_eq!(e2e.count, 300);
    assert!(e2e.p50_us > 0.0 && e2e.p50_us <= e2e.p99_us && e2e.p99_us <= e2e.max_us);

    let (code, text) = get(&format!("http://{}/metrics", server.admin));
    assert_eq!(code, 200);
    assert!(text.contains("quiver_requests_total{status=\"ok\"} 300"), "{text}");
    if let Some(samples) = common::parse_with_prometheus_client(&text) {
        let has = |line: &str| samples.iter().any(|s| s == line);
        assert!(has("quiver_requests_total{status=ok} 300"), "{samples:?}");
        assert!(has("quiver_request_duration_seconds_count{} 300"), "{samples:?}");
        assert!(has("quiver_stage_duration_seconds_count{stage=kernel} 300"), "{samples:?}");
        assert!(has("quiver_request_duration_seconds_bucket{le=+Inf} 300"), "{samples:?}");
        assert!(has("quiver_ready{} 1"), "{samples:?}");
        assert!(samples
            .iter()
            .any(|s| s.starts_with("quiver_stage_duration_window_seconds{quantile=0.99,stage=end_to_end}")));
    }
}

#[test]
fn percentile_gauges_move_when_latency_changes() {
    let server = Server::start(&["--shards", "1"]);
    let mut c = server.client();
    for i in 0..200u64 {
        assert_eq!(c.score(&demo_request(i, i, vec![i % 10_000])).unwrap().status, Status::Ok);
    }
    let before = wait_for(&server, |s| s.requests == 200);
    // The median, not the p99: on a 2-core VM shared with the other tests,
    // one preempted request of the first 200 is their p99 (167 µs for one
    // candidate was seen), and the test is about the window's quantiles
    // following the latency, which the median shows without that noise.
    let kernel = |s: &Stats| s.stages.iter().find(|st| st.stage == "kernel").unwrap().p50_us;
    // The same model over 256 candidates instead of 1: the kernel stage's
    // median over the window must rise with it.
    for i in 0..200u64 {
        let big = demo_request(1_000 + i, i, (0..256).collect());
        assert_eq!(c.score(&big).unwrap().status, Status::Ok);
    }
    let after = wait_for(&server, |s| s.requests == 400);
    assert!(
        kernel(&after) > 4.0 * kernel(&before),
        "kernel p50 {} µs before, {} µs after",
        kernel(&before),
        kernel(&after)
    );
}

#[test]
fn drain_answers_overloaded_and_undrain_recovers() {
    let server = Server::start(&["--shards", "1"]);
    let health = format!("http://{}/healthz", server.admin);
    let ready = format!("http://{}/readyz", server.admin);
    assert_eq!(get(&health).0, 200);
    assert_eq!(get(&ready).0, 200);
    let mut c = server.client();
    assert_eq!(c.score(&demo_request(1, 1, vec![1])).unwrap().status, Status::Ok);

    assert_eq!(post(&format!("http://{}/drain", server.admin)), 200);
    assert_eq!(get(&ready).0, 503);
    assert_eq!(get(&health).0, 200, "alive while not ready");
    let r = c.score(&demo_request(2, 1, vec![1])).unwrap();
    assert_eq!((r.status, r.error.as_str()), (Status::Overloaded, "server is not ready"));
    // New connections are accepted and answered Overloaded under this policy.
    let mut fresh = server.client();
    assert_eq!(fresh.score(&demo_request(3, 1, vec![1])).unwrap().status, Status::Overloaded);

    assert_eq!(post(&format!("http://{}/undrain", server.admin)), 200);
    assert_eq!(get(&ready).0, 200);
    assert_eq!(c.score(&demo_request(4, 1, vec![1])).unwrap().status, Status::Ok);
    assert_eq!(get(&format!("http://{}/nope", server.admin)).0, 404);
}

#[test]
fn drain_with_the_refuse_policy_closes_new_connections() {
    let server = Server::start(&["--shards", "1", "--not-ready", "refuse"]);
    let mut c = server.client();
    assert_eq!(c.score(&demo_request(1, 1, vec![1])).unwrap().status, Status::Ok);
    assert_eq!(post(&format!("http://{}/drain", server.admin)), 200);
    // The open connection is told why; a new one is closed at once.
    assert_eq!(c.score(&demo_request(2, 1, vec![1])).unwrap().status, Status::Overloaded);
    let mut fresh = server.client();
    assert!(fresh.score(&demo_request(3, 1, vec![1])).is_err());
    assert_eq!(post(&format!("http://{}/undrain", server.admin)), 200);
    let mut again = server.client();
    assert_eq!(again.score(&demo_request(4, 1, vec![1])).unwrap().status, Status::Ok);
}

#[test]
fn quiver_stats_prints_a_table() {
    let server = Server::start(&["--shards", "1"]);
    let mut c = server.client();
    for i in 0..50u64 {
        c.score(&demo_request(i, i, vec![1, 2])).unwrap();
    }
    wait_for(&server, |s| s.requests == 50);
    let out = std::process::Command::new(BIN)
        .args(["stats", "--admin", &server.admin, "--count", "2", "--interval", "100ms"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("ready yes  shards 1"), "{text}");
    assert!(text.contains("requests 50"), "{text}");
    assert!(text.contains("status: ok=50"), "{text}");
    for stage in ["decode", "lookup", "kernel", "respond", "end_to_end"] {
        assert!(text.lines().any(|l| l.starts_with(stage)), "{stage} missing:\n{text}");
    }
}

/// POST with an optional bearer token: the status and the body.
fn post_as(url: &str, token: Option<&str>) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into();
    let mut req = agent.post(url);
    if let Some(t) = token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    let mut r = req.send_empty().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

#[test]
fn controls_need_the_token_and_the_metrics_listener_has_none() {
    const TOKEN: &str = "s3cret-admin-token-0123456789";
    let dir = common::scratch("admin-token");
    let token_file = dir.join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let server = Server::start(&[
        "--shards",
        "1",
        "--admin-token-file",
        token_file.to_str().unwrap(),
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let drain = format!("http://{}/drain", server.admin);
    let (code, body) = post_as(&drain, None);
    assert_eq!(code, 401, "{body}");
    assert!(body.contains("Bearer"), "{body}");
    let (code, body) = post_as(&drain, Some("wrong-token-wrong-token"));
    assert_eq!(code, 401);
    assert!(!body.contains("wrong-token"), "a refused token is never echoed: {body}");
    assert_eq!(get(&format!("http://{}/readyz", server.admin)).0, 200, "nothing was drained");
    for path in ["/models/auction-32/rollback", "/undrain", "/replica/item/accept"] {
        assert_eq!(post_as(&format!("http://{}{path}", server.admin), None).0, 401, "{path}");
    }
    assert_eq!(post_as(&drain, Some(TOKEN)).0, 200);
    assert_eq!(get(&format!("http://{}/readyz", server.admin)).0, 503, "drained with the token");
    assert_eq!(post_as(&format!("http://{}/undrain", server.admin), Some(TOKEN)).0, 200);

    // Reads need no token; the refusals are counted, and logged without the token.
    let (code, text) = get(&format!("http://{}/metrics", server.admin));
    assert_eq!(code, 200);
    assert!(text.contains("quiver_admin_unauthorized_total 5"), "{text}");
    // The log reaches the test through its own pipe, after the answers.
    let log = server.wait_stderr("request without a valid bearer token refused");
    assert!(!log.contains(TOKEN) && !log.contains("wrong-token"), "{log}");

    // The metrics listener serves reads and no controls, token or not.
    assert!(!server.metrics.is_empty(), "the server printed its metrics address");
    for path in ["/metrics", "/healthz", "/readyz", "/stats.json"] {
        assert_eq!(get(&format!("http://{}{path}", server.metrics)).0, 200, "{path}");
    }
    let (code, body) = post_as(&format!("http://{}/drain", server.metrics), Some(TOKEN));
    assert_eq!(code, 404, "{body}");
    assert_eq!(get(&format!("http://{}/readyz", server.admin)).0, 200);

    // The CLI sends the token.
    let out = std::process::Command::new(BIN)
        .args(["stats", "--admin", &server.admin, "--count", "1", "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = std::process::Command::new(BIN)
        .args(["replica", "accept", "--admin", &server.admin, "--group", "item"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"), "{out:?}");
    let out = std::process::Command::new(BIN)
        .args(["replica", "accept", "--admin", &server.admin, "--group", "item", "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("409"), "past the token, nothing is held: {out:?}");
}

#[test]
fn controls_on_a_routable_address_without_a_token_refuse_to_start() {
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "0.0.0.0:0", "--shards", "1", "--data-dir"])
        .arg(common::demo_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("admin_listen") && err.contains("admin_token_file"), "{err}");
    let short = common::scratch("admin-short-token").join("t");
    std::fs::write(&short, "short\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--shards", "1", "--admin-token-file"])
        .arg(&short)
        .arg("--data-dir")
        .arg(common::demo_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"), "{out:?}");
}
