//! Test harness: starts a real `quiver serve` process and talks to it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use quiver::client::Client;
use quiver::features::replica::Replica;
use quiver::loadgen::demo;
use quiver::model::{sigmoid, Model};
use quiver::wire::RequestSpec;

pub mod pki;
pub mod redis;
pub mod redis_cluster;
pub mod zoo;

pub const BIN: &str = env!("CARGO_BIN_EXE_quiver");

/// How long a test waits for a state it expects (a counter published, a
/// line logged, a replica caught up) before it fails. A wait returns as soon
/// as the state holds, so the bound costs nothing when things work: it is
/// set for a machine several times slower than usual (a CPU hog beside the
/// tests, a busy CI host), not for the usual one.
pub const WAIT: Duration = Duration::from_secs(30);

/// How long a probe may take beside connections the test holds open: well
/// under the 5 s in which a listener cuts off a connection that has not sent
/// its whole head or frame (a probe queued behind held connections would wait
/// that long), and far over what a busy machine adds to an answer from a
/// listener that serves the probe at once.
pub const PROBE_MAX: Duration = Duration::from_secs(3);

/// Documented INT8 tolerance: |score_int8 - score_f32| ≤ this (docs/MODELS.md, "Model files").
pub const INT8_SCORE_TOLERANCE: f32 = 0.02;

/// A scratch directory unique to this test process and `name`.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A scratch data directory with the demo's models and no replica files, for a server
/// whose replicas come from Redis.
pub fn models_only_dir(name: &str) -> PathBuf {
    let d = scratch(name);
    for f in ["model.qm", "fallback.qm"] {
        std::fs::copy(demo_dir().join(f), d.join(f)).unwrap();
    }
    d
}

/// The demo data, generated once per test binary.
pub fn demo_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = scratch("demo");
        demo::ensure(&d).unwrap();
        d
    })
}

pub struct Server {
    pub child: Child,
    pub addr: String,
    /// The admin endpoint's address.
    pub admin: String,
    /// The read-only metrics listener's address, when `--metrics-listen` was given.
    pub metrics: String,
    /// The Open Inference Protocol's listeners, when `--oip-*-listen` was given.
    pub oip_grpc: String,
    pub oip_http: String,
    pub stderr: std::sync::Arc<Mutex<String>>,
}

impl Server {
    /// Starts `quiver serve` on a free port with the demo data and `extra` flags.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_with(demo_dir(), extra)
    }

    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Server {
        Server::start_with_env(data_dir, extra, &[])
    }

    /// `start`, with extra environment variables for the server process.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_with_env(demo_dir(), extra, env)
    }

    pub fn start_with_env(data_dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("quiver binary starts");
        let stderr = std::sync::Arc::new(Mutex::new(String::new()));
        {
            let mut pipe = child.stderr.take().unwrap();
            let stderr = stderr.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    stderr.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut admin = String::new();
        let mut metrics = String::new();
        let (mut oip_grpc, mut oip_http) = (String::new(), String::new());
        let addr = loop {
            let line = lines.next().and_then(Result::ok).unwrap_or_else(|| {
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(100));
                panic!("server did not start: {}", stderr.lock().unwrap());
            });
            if let Some(a) = line.strip_prefix("quiver admin on ") {
                admin = a.trim().to_string();
                continue;
            }
            if let Some(a) = line.strip_prefix("quiver metrics on ") {
                metrics = a.trim().to_string();
                continue;
            }
            if let Some(a) = line.strip_prefix("quiver oip-grpc on ") {
                oip_grpc = a.trim().to_string();
                continue;
            }
            if let Some(a) = line.strip_prefix("quiver oip-http on ") {
                oip_http = a.trim().to_string();
                continue;
            }
            break line
                .strip_prefix("quiver listening on ")
                .and_then(|rest| rest.split(' ').next())
                .unwrap_or_else(|| panic!("unexpected line: {line}"))
                .to_string();
        };
        Server { child, addr, admin, metrics, oip_grpc, oip_http, stderr }
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.addr, Duration::from_secs(10)).expect("connects")
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Sends SIGTERM and waits for a clean exit; returns the exit code.
    pub fn terminate(&mut self) -> i32 {
        let status = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill(1) runs");
        assert!(status.success());
        let until = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(50));
                return status.code().unwrap_or(-1);
            }
            assert!(Instant::now() < until, "server did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The server's log once it contains `needle`: a line logged after an
    /// event the test saw (a counter in `/stats.json`) reaches the test
    /// through the stderr pipe later. Panics after [`WAIT`] with the log.
    pub fn wait_stderr(&self, needle: &str) -> String {
        let until = Instant::now() + WAIT;
        loop {
            let log = self.stderr();
            if log.contains(needle) {
                return log;
            }
            assert!(Instant::now() < until, "the log never said {needle:?}:\n{log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A counter or gauge with no labels from the admin endpoint's
    /// `/metrics`; panics with the scrape when it is not there.
    pub fn metric(&self, name: &str) -> u64 {
        let (_, text) = http_get(&format!("http://{}/metrics", self.admin));
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// Polls [`Server::metric`] until `name` reaches `at_least` (shards
    /// publish once a second); panics after [`WAIT`]. Returns the value.
    pub fn wait_metric(&self, name: &str, at_least: u64) -> u64 {
        let until = Instant::now() + WAIT;
        loop {
            let v = self.metric(name);
            if v >= at_least {
                return v;
            }
            assert!(Instant::now() < until, "{name} stayed at {v}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The admin endpoint's `/metrics` once it contains `needle` (shards
    /// publish once a second); panics after [`WAIT`] with the last scrape.
    pub fn wait_scrape(&self, needle: &str) -> String {
        let until = Instant::now() + WAIT;
        loop {
            let (_, text) = http_get(&format!("http://{}/metrics", self.admin));
            if text.contains(needle) {
                return text;
            }
            assert!(Instant::now() < until, "/metrics never showed {needle:?}:\n{text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `/stats.json` once `done` holds of it (shards publish once a
    /// second, each on its own period); panics after [`WAIT`] naming `what`,
    /// with the last stats and the log.
    pub fn wait_stats(&self, what: &str, done: impl Fn(&quiver::admin::Stats) -> bool) -> quiver::admin::Stats {
        let until = Instant::now() + WAIT;
        loop {
            let s = self.stats();
            if done(&s) {
                return s;
            }
            assert!(Instant::now() < until, "timed out waiting for {what}: {s:?}\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The admin endpoint's `/stats.json`.
    pub fn stats(&self) -> quiver::admin::Stats {
        let (code, body) = http_get(&format!("http://{}/stats.json", self.admin));
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(5)))
        .build()
        .into()
}

/// GET `url`: the status and the body; an HTTP error status is a result, not a failure.
pub fn http_get(url: &str) -> (u16, String) {
    let mut r = http_agent().get(url).call().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

/// Sends `request` on a new connection and reads until the server closes it
/// or `wait` passes: the status of the first response (if one came), all
/// that was read, and whether the server closed the connection.
pub fn http_raw(addr: &str, request: &[u8], wait: Duration) -> (Option<u16>, String, bool) {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(request).unwrap();
    http_read(&mut s, wait)
}

/// [`http_raw`]'s reading half, on a connection the caller opened.
pub fn http_read(s: &mut std::net::TcpStream, wait: Duration) -> (Option<u16>, String, bool) {
    let until = Instant::now() + wait;
    let mut got = Vec::new();
    let mut closed = false;
    let mut buf = [0u8; 4096];
    while Instant::now() < until {
        s.set_read_timeout(Some(Duration::from_millis(50).max(until.saturating_duration_since(Instant::now()))))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if !got.is_empty() && got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.strip_prefix("HTTP/1.1 ").and_then(|r| r.get(..3)).and_then(|c| c.parse().ok());
    (status, text, closed)
}

/// Parses Prometheus text with the official Python client's parser and
/// returns `name{labels} value` lines. `None` when the parser is not
/// installed (CI installs it and sets QUIVER_REQUIRE_PROMETHEUS_CLIENT=1).
pub fn parse_with_prometheus_client(text: &str) -> Option<Vec<String>> {
    let script = "import sys\nfrom prometheus_client.parser import text_string_to_metric_families as p\n\
                  for f in p(sys.stdin.read()):\n    for s in f.samples:\n        \
                  print(s.name + '{' + ','.join(k+'='+v for k,v in sorted(s.labels.items())) + '} ' + '%g' % s.value)\n";
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    use std::io::Write;
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named 'prometheus_client'") {
        let required = std::env::var("QUIVER_REQUIRE_PROMETHEUS_CLIENT").is_ok_and(|v| v == "1");
        assert!(!required, "QUIVER_REQUIRE_PROMETHEUS_CLIENT=1 but prometheus_client is not installed");
        eprintln!("SKIPPED the prometheus_client parse check: pip install prometheus_client");
        return None;
    }
    assert!(out.status.success(), "the Prometheus parser rejected /metrics: {stderr}\n{text}");
    Some(String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect())
}

/// POST `url` with no body: the status and the body.
pub fn http_post(url: &str) -> (u16, String) {
    let mut r = http_agent().post(url).send_empty().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A demo request: user, items, 16 context floats derived from the id.
pub fn demo_request(request_id: u64, user_id: u64, item_ids: Vec<u64>) -> RequestSpec {
    RequestSpec {
        request_id,
        budget_us: 1_000_000,
        user_id,
        item_ids,
        context: (0..demo::CONTEXT_LEN).map(|i| ((request_id + i as u64) % 7) as f32 * 0.3 - 0.9).collect(),
        ..RequestSpec::default()
    }
}

/// The demo model and replicas of `demo_dir()`, opened once per test binary.
fn demo_files() -> &'static (Model, Replica, Replica) {
    static CACHE: OnceLock<(Model, Replica, Replica)> = OnceLock::new();
    CACHE.get_or_init(|| {
        let data_dir = demo_dir();
        (
            Model::load(&data_dir.join("model.qm")).unwrap(),
            Replica::open(&data_dir.join("user.qrep"), "user").unwrap(),
            Replica::open(&data_dir.join("item.qrep"), "item").unwrap(),
        )
    })
}

/// The input rows the demo data gives `spec` (user, item, context per
/// candidate; zeros for an empty context), read from the replica files
/// directly, and how many of its keys the replicas miss.
pub fn demo_rows(spec: &RequestSpec) -> (Vec<f32>, u16) {
    let (_, user, item) = demo_files();
    let mut missing = 0u16;
    let mut u = vec![0.0; user.dim()];
    missing += u16::from(!user.read_into(spec.user_id, &mut u));
    let mut x = Vec::new();
    for &id in &spec.item_ids {
        let mut v = vec![0.0; item.dim()];
        missing += u16::from(!item.read_into(id, &mut v));
        // Demo layout: user, item, context.
        x.extend_from_slice(&u);
        x.extend_from_slice(&v);
        if spec.context.is_empty() {
            x.extend(std::iter::repeat_n(0.0, demo::CONTEXT_LEN));
        } else {
            x.extend_from_slice(&spec.context);
        }
    }
    (x, missing)
}

/// The f32 reference scores for `spec`, computed from the files directly.
pub fn reference_scores(data_dir: &Path, spec: &RequestSpec) -> (Vec<f32>, u16) {
    assert_eq!(data_dir, demo_dir());
    let (model, _, _) = demo_files();
    let (x, missing) = demo_rows(spec);
    let mut logits = vec![0.0; spec.item_ids.len()];
    model.forward_f32_reference(&x, spec.item_ids.len(), &mut logits);
    (logits.into_iter().map(sigmoid).collect(), missing)
}

/// The area under the ROC curve: the probability that a random positive
/// scores above a random negative, ties counting one half (average ranks).
pub fn auc(scores: &[f32], labels: &[bool]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let mut rank_sum_pos = 0.0f64;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let avg_rank = (i + j) as f64 / 2.0 + 1.0;
        rank_sum_pos += avg_rank * order[i..=j].iter().filter(|&&k| labels[k]).count() as f64;
        i = j + 1;
    }
    let pos = labels.iter().filter(|l| **l).count() as f64;
    let neg = labels.len() as f64 - pos;
    (rank_sum_pos - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

/// Runs the `quiver` binary with `args`; its exit code, stdout and stderr.
pub fn run_quiver<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> (i32, String, String) {
    let o = Command::new(BIN).args(args).output().expect("quiver binary runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Largest |a[i] − b[i]| of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// `backend`'s outputs for every row of `x` (`model.input_dim()` floats a
/// row), scored 256 rows a call.
pub fn logits_in_batches(backend: &mut dyn quiver::score::Backend, model: &Model, x: &[f32]) -> Vec<f32> {
    let dim = model.input_dim();
    let mut out = Vec::new();
    for chunk in x.chunks(256 * dim) {
        let rows = chunk.len() / dim;
        let mut y = vec![0.0; rows];
        backend.score(chunk, rows, &mut y).unwrap();
        out.extend(y);
    }
    out
}

/// Largest |a − b| / max(1, |b|).
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

/// The onnxruntime library of the PyPI wheel Python imports (the pinned
/// one in CI), if it has one.
pub fn onnxruntime_wheel_library() -> Option<PathBuf> {
    Command::new("python3")
        .args([
            "-c",
            "import glob, os, onnxruntime; \
             print(sorted(glob.glob(os.path.dirname(onnxruntime.__file__) + '/capi/libonnxruntime.so*'))[0])",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|p| p.exists())
}
