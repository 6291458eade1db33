//! The Open Inference Protocol (KServe v2) listeners against the FlatBuffers
//! port of the same server: the real `tritonclient` (gRPC and HTTP) through
//! `tests/oip_tritonclient.py`, and the HTTP/REST API by hand for what a
//! client library hides (its JSON, its binary framing, its limits).

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{demo_request, Server};
use quiver::loadgen::demo;
use serde_json::{json, Value};

fn serve(extra: &[&str]) -> Server {
    let mut args = vec!["--oip-grpc-listen", "127.0.0.1:0", "--oip-http-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let s = Server::start(&args);
    assert!(!s.oip_grpc.is_empty() && !s.oip_http.is_empty(), "no oip listener announced: {}", s.stderr());
    s
}

fn post(url: &str, body: &[u8], headers: &[(&str, &str)]) -> (u16, Vec<u8>, Option<String>) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let mut request = agent.post(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let mut r = request.send(body).unwrap();
    let header_length = r.headers().get("inference-header-content-length").map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), r.body_mut().with_config().limit(64 << 20).read_to_vec().unwrap(), header_length)
}

/// The demo requests both front ends score, with the FlatBuffers client's
/// scores.
fn cases(server: &Server) -> Vec<(quiver::wire::RequestSpec, Vec<f32>)> {
    let mut client = server.client();
    (0..6u64)
        .map(|i| {
            let items: Vec<u64> = (0..(1 + i * 6)).map(|k| (i * 977 + k * 31) % 5000).collect();
            let spec = demo_request(100 + i, i * 131 % 1000, items);
            let r = client.score(&spec).unwrap();
            assert_eq!(r.status, quiver::wire::Status::Ok, "{}", r.error);
            (spec, r.scores)
        })
        .collect()
}

/// Raw-rows requests (the model's input rows, seeded), with the
/// FlatBuffers client's scores: (rows, width, scores).
fn raw_cases(server: &Server) -> Vec<(Vec<f32>, usize, Vec<f32>)> {
    let mut client = server.client();
    let width = demo::model().inputs.iter().map(|s| s.dim).sum::<usize>();
    [1usize, 7, 32]
        .iter()
        .map(|&n| {
            let rows: Vec<f32> = (0..n * width).map(|k| ((k * 7 + n) as f32 * 0.37).sin()).collect();
            let spec = quiver::wire::RequestSpec {
                request_id: 500 + n as u64,
                model: demo::MODEL_NAME.into(),
                budget_us: 1_000_000,
                rows: rows.clone(),
                row_count: n as u32,
                ..Default::default()
            };
            let r = client.score(&spec).unwrap();
            assert_eq!(r.status, quiver::wire::Status::Ok, "{}", r.error);
            (rows, width, r.scores)
        })
        .collect()
}

#[test]
fn tritonclient_scores_exactly_what_the_flatbuffers_client_gets() {
    let server = serve(&[]);
    let cases = cases(&server);
    let raw_cases = raw_cases(&server);
    let file = common::scratch("oip-cases").join("cases.json");
    let spec = json!({
        "model": demo::MODEL_NAME,
        "version": "1",
        "cases": cases.iter().map(|(spec, scores)| json!({
            "user_id": spec.user_id,
            "item_ids": spec.item_ids,
            "context": spec.context,
            "score_bits": scores.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "raw_cases": raw_cases.iter().map(|(rows, width, scores)| json!({
            "rows": rows.chunks(*width).collect::<Vec<_>>(),
            "score_bits": scores.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    std::fs::write(&file, serde_json::to_vec(&spec).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oip_tritonclient.py");
    // CI's pinned tritonclient lives in a virtual environment of its own.
    let python = std::env::var("QUIVER_OIP_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .arg(script)
        .args(["--grpc", &server.oip_grpc, "--http", &server.oip_http, "--cases"])
        .arg(&file)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(77) {
        let required = std::env::var("QUIVER_REQUIRE_TRITONCLIENT").is_ok_and(|v| v == "1");
        assert!(!required, "QUIVER_REQUIRE_TRITONCLIENT=1 but tritonclient is not installed: {stdout}");
        eprintln!("SKIPPED: pip install 'tritonclient[grpc,http]' to run the tritonclient checks");
        return;
    }
    assert!(out.status.success(), "tritonclient checks failed:\n{stdout}\n{stderr}\nserver:\n{}", server.stderr());
    let closing = stdout.lines().last().unwrap_or("");
    assert!(closing.ends_with(" passed, 0 failed"), "{stdout}");
    let passed: usize = closing.split(' ').next().unwrap().parse().unwrap();
    assert!(passed >= 60, "fewer checks than written ran: {stdout}");
}

#[test]
fn http_json_and_binary_tensors_score_exactly_and_say_how() {
    let server = serve(&[]);
    let url = format!("http://{}/v2/models/{}/infer", server.oip_http, demo::MODEL_NAME);
    for (spec, want) in cases(&server) {
        // JSON, nested data, the scores as JSON numbers.
        let body = json!({
            "id": "r1",
            "parameters": {"budget_us": 1_000_000, "priority": 1, "client_id": 0},
            "inputs": [
                {"name": "user_id", "datatype": "INT64", "shape": [1], "data": [spec.user_id]},
                {"name": "item_ids", "datatype": "INT64", "shape": [spec.item_ids.len()], "data": spec.item_ids},
                {"name": "context", "datatype": "FP32", "shape": [spec.context.len()], "data": [spec.context]},
            ],
        });
        let (code, bytes, _) = post(&url, &serde_json::to_vec(&body).unwrap(), &[]);
        let r: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(code, 200, "{r}");
        let got: Vec<f32> =
            r["outputs"][0]["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got, want, "JSON scores differ from the FlatBuffers client's");
        assert_eq!(r["id"], "r1");
        assert_eq!(r["outputs"][0]["shape"], json!([want.len()]));
        assert_eq!(r["parameters"]["tier"], "primary");
        assert_eq!(r["parameters"]["features_stale"], false);

        // The binary extension, both ways.
        let raw = |v: Vec<u8>| v;
        let user = raw(spec.user_id.to_le_bytes().to_vec());
        let items: Vec<u8> = spec.item_ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        let context: Vec<u8> = spec.context.iter().flat_map(|f| f.to_le_bytes()).collect();
        let head = json!({
            "inputs": [
                {"name": "user_id", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": user.len()}},
                {"name": "item_ids", "datatype": "INT64", "shape": [spec.item_ids.len()],
                 "parameters": {"binary_data_size": items.len()}},
                {"name": "context", "datatype": "FP32", "shape": [spec.context.len()],
                 "parameters": {"binary_data_size": context.len()}},
            ],
            "outputs": [{"name": "scores", "parameters": {"binary_data": true}}],
        });
        let mut body = serde_json::to_vec(&head).unwrap();
        let json_length = body.len().to_string();
        body.extend(user.iter().chain(&items).chain(&context));
        let (code, bytes, length) = post(&url, &body, &[("Inference-Header-Content-Length", &json_length)]);
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&bytes));
        let length: usize = length.expect("a binary response names its JSON length").parse().unwrap();
        let r: Value = serde_json::from_slice(&bytes[..length]).unwrap();
        assert_eq!(r["outputs"][0]["parameters"]["binary_data_size"], json!(want.len() * 4));
        let got: Vec<f32> = bytes[length..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, want, "binary scores differ from the FlatBuffers client's");
    }
}

/// A bad request: its body, its headers, the status and a word of the error.
type BadCase = (Vec<u8>, Vec<(&'static str, &'static str)>, u16, &'static str);

#[test]
fn http_bad_requests_get_the_protocols_errors_and_the_server_serves_on() {
    let server = serve(&[]);
    let base = format!("http://{}", server.oip_http);
    let url = format!("{base}/v2/models/{}/infer", demo::MODEL_NAME);
    let user = json!({"name": "user_id", "datatype": "INT64", "shape": [1], "data": [3]});
    let items = json!({"name": "item_ids", "datatype": "INT64", "shape": [2], "data": [1, 2]});
    let cases: Vec<BadCase> = vec![
        (b"{not json".to_vec(), vec![], 400, "not JSON"),
        (b"[1, 2]".to_vec(), vec![], 400, "not a JSON object"),
        (serde_json::to_vec(&json!({"inputs": [user]})).unwrap(), vec![], 400, "item_ids"),
        (
            serde_json::to_vec(
                &json!({"inputs": [user, items, {"name": "x", "datatype": "INT64", "shape": [1], "data": [1]}]}),
            )
            .unwrap(),
            vec![],
            400,
            "unexpected inference input 'x'",
        ),
        (
            serde_json::to_vec(
                &json!({"inputs": [user, {"name": "item_ids", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}),
            )
            .unwrap(),
            vec![],
            400,
            "datatype",
        ),
        (
            serde_json::to_vec(
                &json!({"inputs": [user, {"name": "item_ids", "datatype": "INT64", "shape": [3], "data": [1, 2]}]}),
            )
            .unwrap(),
            vec![],
            400,
            "elements",
        ),
        (
            serde_json::to_vec(
                &json!({"inputs": [user, {"name": "item_ids", "datatype": "INT64", "shape": [2, 1], "data": [1, 2]}]}),
            )
            .unwrap(),
            vec![],
            400,
            "shape",
        ),
        (
            serde_json::to_vec(&json!({"inputs": [user, items], "parameters": {"priority": 999}})).unwrap(),
            vec![],
            400,
            "priority",
        ),
        (
            serde_json::to_vec(&json!({"inputs": [user, items]})).unwrap(),
            vec![("Inference-Header-Content-Length", "9999")],
            400,
            "Inference-Header-Content-Length",
        ),
        (
            serde_json::to_vec(&json!({"inputs": [user, items]})).unwrap(),
            vec![("Content-Encoding", "gzip")],
            400,
            "compressed",
        ),
    ];
    for (body, headers, want_code, want_text) in cases {
        let (code, bytes, _) = post(&url, &body, &headers);
        let text = String::from_utf8_lossy(&bytes);
        assert_eq!(code, want_code, "{text}");
        let r: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {text}"));
        let error = r["error"].as_str().unwrap_or_else(|| panic!("no error in {text}"));
        assert!(error.contains(want_text), "{error:?} does not say {want_text:?}");
    }
    // A body declared over oip.message_bytes_max is refused before a byte
    // of it is read.
    let head = format!(
        "POST /v2/models/{}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        demo::MODEL_NAME,
        5 << 20
    );
    let (status, text, _) = common::http_raw(&server.oip_http, head.as_bytes(), common::PROBE_MAX);
    assert_eq!(status, Some(413), "{text}");
    assert!(text.contains("oip.message_bytes_max"), "{text}");
    let (code, _, _) = post(&format!("{base}/v2/models/nope/infer"), b"{}", &[]);
    assert_eq!(code, 404);
    let (code, body) = common::http_get(&format!("{base}/v2/nowhere"));
    assert_eq!(code, 404, "{body}");
    let (code, body) = common::http_get(&format!("{base}/v2/health/ready"));
    assert_eq!((code, body.as_str()), (200, r#"{"ready":true}"#));
    let (code, body) = common::http_get(&format!("{base}/v2/models/{}/versions/7", demo::MODEL_NAME));
    assert_eq!(code, 404, "{body}");
    // Still serving, over the same listener.
    let (code, bytes, _) = post(&url, &serde_json::to_vec(&json!({"inputs": [user, items]})).unwrap(), &[]);
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&bytes));
    // Each inference request counted by its transport and outcome.
    let (_, text) = common::http_get(&format!("http://{}/metrics", server.admin));
    for (protocol, status, want) in [
        ("http", "ok", 1),
        ("http", "invalid_argument", 10),
        ("http", "resource_exhausted", 1),
        ("http", "not_found", 1),
        ("http", "unavailable", 0),
        ("grpc", "ok", 0),
    ] {
        let line = format!("quiver_oip_requests_total{{protocol=\"{protocol}\",status=\"{status}\"}} {want}");
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
}

#[test]
fn a_connection_over_the_limit_is_closed_and_the_held_ones_still_serve() {
    let dir = common::scratch("oip-limits");
    let config = dir.join("quiver.toml");
    std::fs::write(&config, "[oip]\nconnections_max = 4\n").unwrap();
    let server = serve(&["--config", config.to_str().unwrap()]);
    let held: Vec<std::net::TcpStream> =
        (0..4).map(|_| std::net::TcpStream::connect(&server.oip_http).unwrap()).collect();
    let ready = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n";
    // The fifth is closed without an answer.
    let (status, _, closed) = common::http_raw(&server.oip_http, ready, common::PROBE_MAX);
    assert_eq!((status, closed), (None, true));
    // The held ones answer.
    for mut s in held.into_iter().take(1) {
        s.write_all(ready).unwrap();
        let (status, _, _) = common::http_read(&mut s, common::PROBE_MAX);
        assert_eq!(status, Some(200));
    }
}

#[test]
fn oip_beside_tls_is_refused_at_start_up() {
    let (code, _, stderr) = common::run_quiver([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "off",
        "--data-dir",
        common::demo_dir().to_str().unwrap(),
        "--oip-http-listen",
        "127.0.0.1:0",
        "--tls-cert",
        "/nonexistent.crt",
        "--tls-key",
        "/nonexistent.key",
    ]);
    assert_ne!(code, 0);
    assert!(stderr.contains("[oip] with [tls]"), "{stderr}");
}

#[test]
fn feature_group_inputs_score_the_fraud_example_as_the_flatbuffers_client_does() {
    use quiver::loadgen::fraud::{self, Tables, TrainingRows};
    use quiver::wire::GroupKeySpec;
    let dir = common::scratch("oip-fraud");
    let server = Server::start_with(
        &dir,
        &["--demo", "--workload", "fraud", "--shards", "1", "--oip-http-listen", "127.0.0.1:0"],
    );
    let model = fraud::model().unwrap().name;
    let base = format!("http://{}/v2/models/{model}", server.oip_http);
    // The metadata names one input per group, typed by its keys, and the context.
    let (code, body) = common::http_get(&base);
    assert_eq!(code, 200, "{body}");
    let meta: Value = serde_json::from_str(&body).unwrap();
    let inputs: Vec<(String, String, Value)> = meta["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["name"].as_str().unwrap().into(), t["datatype"].as_str().unwrap().into(), t["shape"].clone()))
        .collect();
    let mut client = server.client();
    let mut rows = TrainingRows::new(Tables::generate(), 11);
    for n in 1..=12 {
        let (t, _, _) = rows.next_row();
        let mut spec = t.request(n);
        spec.budget_us = 2_000_000;
        let want = client.score(&spec).unwrap();
        assert_eq!(want.status, quiver::wire::Status::Ok, "{}", want.error);
        let mut tensors: Vec<Value> = spec
            .groups
            .iter()
            .map(|(group, keys)| {
                let (datatype, data) = match keys {
                    GroupKeySpec::Ids(v) => ("INT64", json!(v)),
                    GroupKeySpec::Strs(v) => ("BYTES", json!(v)),
                };
                assert!(
                    inputs.contains(&(group.clone(), datatype.to_string(), json!([1]))),
                    "{group} {datatype} [1] is not in the metadata: {inputs:?}"
                );
                json!({"name": group, "datatype": datatype, "shape": [1], "data": data})
            })
            .collect();
        assert!(inputs.contains(&("context".into(), "FP32".into(), json!([spec.context.len()]))), "{inputs:?}");
        tensors
            .push(json!({"name": "context", "datatype": "FP32", "shape": [spec.context.len()], "data": spec.context}));
        let body = json!({"inputs": tensors, "parameters": {"budget_us": 2_000_000}});
        let (code, bytes, _) = post(&format!("{base}/infer"), &serde_json::to_vec(&body).unwrap(), &[]);
        let r: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(code, 200, "{r}");
        let got: Vec<f32> =
            r["outputs"][0]["data"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got, want.scores, "transaction {n}");
        assert_eq!(r["parameters"]["features_missing"], json!(want.features_missing));
    }
}

/// perf_analyzer, Triton's own load generator: `QUIVER_PERF_ANALYZER`, or
/// `perf_analyzer` on the PATH. None (after saying so) when it is missing;
/// a failure instead under `QUIVER_REQUIRE_PERF_ANALYZER=1`, as in CI.
fn perf_analyzer() -> Option<std::path::PathBuf> {
    let named = std::env::var_os("QUIVER_PERF_ANALYZER").map(std::path::PathBuf::from);
    let found = match &named {
        Some(p) => p.is_file().then(|| p.clone()),
        None => std::env::var_os("PATH")
            .and_then(|path| std::env::split_paths(&path).map(|d| d.join("perf_analyzer")).find(|p| p.is_file())),
    };
    if found.is_none() {
        let required = std::env::var("QUIVER_REQUIRE_PERF_ANALYZER").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "QUIVER_REQUIRE_PERF_ANALYZER=1 but perf_analyzer is missing (QUIVER_PERF_ANALYZER={named:?})"
        );
        eprintln!(
            "SKIPPED: perf_analyzer not found: set QUIVER_PERF_ANALYZER to it (README, \"Triton's clients against Quiver\")"
        );
    }
    found
}

/// One row of perf_analyzer's CSV report (`-f`): a concurrency's
/// throughput and latencies.
#[derive(Debug)]
struct PerfRow {
    concurrency: u64,
    inferences_per_s: f64,
    p50_us: u64,
    p99_us: u64,
}

fn perf_rows(csv: &str) -> Vec<PerfRow> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let column = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name:?} in {csv}"));
    let (c, t, p50, p99) =
        (column("Concurrency"), column("Inferences/Second"), column("p50 latency"), column("p99 latency"));
    lines
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let n = |i: usize| f[i].trim().parse::<f64>().unwrap_or_else(|e| panic!("{e}: {l}"));
            PerfRow { concurrency: n(c) as u64, inferences_per_s: n(t), p50_us: n(p50) as u64, p99_us: n(p99) as u64 }
        })
        .collect()
}

#[test]
fn perf_analyzer_measures_the_v2_port_over_grpc_and_http() {
    let Some(perf_analyzer) = perf_analyzer() else { return };
    // perf_analyzer cannot send `budget_us` over HTTP (its
    // --request-parameter is gRPC-only): a default budget a loaded CI
    // machine meets.
    let dir = common::scratch("oip-perf-analyzer");
    let config = dir.join("quiver.toml");
    std::fs::write(&config, "[limits]\nbudget_us_default = 2000000\n").unwrap();
    let server = serve(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut scored = 0;
    for (protocol, url) in [("grpc", &server.oip_grpc), ("http", &server.oip_http)] {
        let csv = dir.join(format!("{protocol}.csv"));
        // Short windows, and any spread counted as stable: this checks
        // that perf_analyzer runs against Quiver and reports, not how fast
        // a loaded CI machine is (bench/oip_side_by_side.sh measures that).
        let out = Command::new(&perf_analyzer)
            .args(["-m", demo::MODEL_NAME, "-u", url, "-i", protocol])
            .args(["--shape", "item_ids:32", "--input-data", "zero", "--concurrency-range", "1:2"])
            .args(["--measurement-interval", "400", "--stability-percentage", "1000", "--max-trials", "10"])
            .arg("-f")
            .arg(&csv)
            .output()
            .expect("perf_analyzer runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "perf_analyzer -i {protocol} failed ({}):\n{stdout}\n{stderr}\nserver:\n{}",
            out.status,
            server.stderr()
        );
        assert!(stdout.contains("Throughput:") && stdout.contains("p99 latency:"), "{stdout}");
        assert!(!stdout.contains("error") && !stderr.contains("error"), "{stdout}\n{stderr}");
        let report =
            std::fs::read_to_string(&csv).unwrap_or_else(|e| panic!("no report {}: {e}\n{stdout}", csv.display()));
        let rows = perf_rows(&report);
        // One row per concurrency, in the order perf_analyzer sorts them
        // (by throughput, which a noisy machine can invert).
        let mut concurrencies: Vec<_> = rows.iter().map(|r| r.concurrency).collect();
        concurrencies.sort_unstable();
        assert_eq!(concurrencies, [1, 2], "{report}");
        for r in &rows {
            assert!(r.inferences_per_s > 0.0 && r.p50_us > 0 && r.p99_us >= r.p50_us, "{protocol}: {r:?}\n{report}");
        }
        scored += 1;
    }
    assert_eq!(scored, 2);
    // Every request perf_analyzer sent took the FlatBuffers request path
    // and was scored: the shard counted them (it publishes once a second),
    // and answered none with an error.
    let by_status = |text: &str| -> Vec<(String, u64)> {
        text.lines()
            .filter_map(|l| {
                let (status, n) = l.strip_prefix("quiver_requests_total{status=\"")?.split_once("\"} ")?;
                Some((status.to_string(), n.parse().ok()?))
            })
            .collect()
    };
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, text) = common::http_get(&format!("http://{}/metrics", server.admin));
        let counts = by_status(&text);
        assert!(counts.iter().all(|(s, n)| s == "ok" || *n == 0), "{counts:?}");
        if counts.iter().any(|(s, n)| s == "ok" && *n >= 12) {
            break;
        }
        assert!(std::time::Instant::now() < until, "perf_analyzer's requests were not counted: {counts:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // And the front end counted them by transport, every one ok.
    let (_, text) = common::http_get(&format!("http://{}/metrics", server.admin));
    for protocol in ["grpc", "http"] {
        let counts: Vec<(String, u64)> = text
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(&format!("quiver_oip_requests_total{{protocol=\"{protocol}\",status=\""))?;
                let (status, n) = rest.split_once("\"} ")?;
                Some((status.to_string(), n.parse().ok()?))
            })
            .collect();
        assert!(counts.iter().any(|(s, n)| s == "ok" && *n >= 6), "{protocol}: {counts:?}");
        assert!(counts.iter().all(|(s, n)| s == "ok" || *n == 0), "{protocol}: {counts:?}");
    }
}
