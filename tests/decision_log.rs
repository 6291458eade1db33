//! The decision log end to end against a real `quiver serve`: every
//! decision at sample rate 1, scored on the shard or on the inference
//! thread, comes back from the segments, read with `quiver log dump`, equal
//! to its response, and `quiver log replay` scores the logged rows to the
//! same bits; a decision is found by its request id; refusals before a
//! model is chosen are logged by the errors rule; keyed sampling is sticky
//! and near its rate; `POST /log` changes the rates, the always rules, the
//! shadow threshold and the key group while serving; a full
//! ring drops and counts while every response arrives; `kill -9` leaves
//! only whole segments and `.tmp` ones the next start deletes; an unusable
//! directory is counted and logged while serving goes on; a disk that
//! hangs blocks the writer, never a shard; a shadow
//! version's disagreement over `always_log_shadow_diff` logs the decision,
//! with the shadow's scores; the non_primary rule logs exactly the
//! answers from a lower rung; raw-row requests are logged with the rows
//! sent; a torn or corrupt segment is one clear error from every reader,
//! `quiver log parquet` among them.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{demo_dir, demo_request, http_get, http_post, run_quiver, scratch, Server};
use quiver::wire::{tier_name, RequestSpec, Status};

const REQUESTS: u64 = 10_000;
const CANDIDATES: u64 = 4;

fn config_file(dir: &Path, log_dir: &Path, extra: &str) -> PathBuf {
    let path = dir.join("quiver.toml");
    let text = format!(
        "[log]\ndir = \"{}\"\nsample_rate = 1.0\nsegment_bytes_max = 4194304\nretention_bytes_max = 1099511627776\n{extra}",
        log_dir.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// One logged row: score, tier, model version, `context[0]`; by request
/// id and candidate.
type Logged = (f32, String, u64, f32);

fn specs() -> Vec<RequestSpec> {
    (0..REQUESTS)
        .map(|i| {
            let items = (0..CANDIDATES).map(|k| (i * 31 + k * 7919) % 10_000).collect();
            demo_request(1_000_000 + i, (i * 15_485_863) % 100_000, items)
        })
        .collect()
}

/// The closed segments in `log_dir`, in name order.
fn segments(log_dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(log_dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files
}

/// Every row of `files` as `quiver log dump --json` prints it.
fn dump(files: &[PathBuf]) -> Vec<serde_json::Value> {
    let mut rows = Vec::new();
    for f in files {
        let (code, out, err) = run_quiver(["log".as_ref(), "dump".as_ref(), f.as_os_str(), "--json".as_ref()]);
        assert_eq!(code, 0, "{err}");
        rows.extend(out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()));
    }
    rows
}

/// `quiver log replay` of every segment with the demo model: all rows
/// replayed come back bit for bit; returns the rows replayed.
fn replay_all(files: &[PathBuf]) -> u64 {
    let model = demo_dir().join("model.qm");
    let mut rows = 0;
    for f in files {
        let (code, out, err) = run_quiver([
            "log".as_ref(),
            "replay".as_ref(),
            f.as_os_str(),
            "--model".as_ref(),
            model.as_os_str(),
            "--json".as_ref(),
        ]);
        let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|_| panic!("{out}\n{err}"));
        assert_eq!(code, 0, "{f:?}: {r}\n{err}");
        assert_eq!((r["differing"].as_u64(), r["skipped_score_error"].as_u64()), (Some(0), Some(0)), "{r}");
        assert_eq!(r["equal"], r["rows"], "{r}");
        rows += r["rows"].as_u64().unwrap();
    }
    rows
}

#[test]
fn every_decision_comes_back_equal_to_its_response() {
    every_decision_comes_back("decision-log-all", "", REQUESTS);
}

/// The same on the inference thread: the record is begun at the hand-off
/// and finished when the response is written.
#[test]
fn every_decision_scored_on_the_inference_thread_comes_back() {
    every_decision_comes_back("decision-log-thread", "inference = \"thread\"\n", 3_000);
}

/// `requests` decisions at rate 1 come back equal to their responses;
/// `top` is the config's top-level settings.
fn every_decision_comes_back(name: &str, top: &str, requests: u64) {
    let dir = scratch(name);
    let log_dir = dir.join("decisions");
    // Rings that hold every record: what is checked is that records equal
    // the responses, not the writer's pace (it runs as SCHED_IDLE, and a
    // loaded machine may leave it little time until the drain at exit).
    let config = config_file(&dir, &log_dir, "ring_bytes = 67108864\n");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{top}{text}")).unwrap();
    let mut server = Server::start(&["--shards", "2", "--config", config.to_str().unwrap()]);
    let specs: Vec<RequestSpec> = specs().into_iter().take(requests as usize).collect();
    let mut c = server.client();
    let wall_ns = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as i64;
    let sent_ns = wall_ns();
    let mut responses = Vec::new();
    // On the inference thread, fewer in flight than its job slots, so
    // that requests are handed off rather than stepped down for want of a
    // slot.
    let window = if top.contains("thread") { 32 } else { 1000 };
    for chunk in specs.chunks(1000) {
        responses.extend(c.pipeline(chunk, window).unwrap());
    }
    let answered_ns = wall_ns();
    assert_eq!(responses.len() as u64, requests);
    assert!(responses.iter().all(|r| r.status == Status::Ok), "every request answered Ok");
    assert_eq!(server.wait_metric("quiver_log_records_total", requests), requests);
    assert_eq!(server.metric("quiver_log_dropped_total{reason=\"ring_full\"}"), 0);
    if top.contains("thread") {
        // They were scored on the inference thread: each waited in its queue.
        let queued = server.metric("quiver_stage_duration_seconds_count{stage=\"queue\"}");
        assert!(queued >= requests / 2, "{queued} of {requests} handed off");
    }
    // SIGTERM: the shards stop, the writer drains the rings and closes
    // every segment.
    assert_eq!(server.terminate(), 0, "{}", server.stderr());

    let files = segments(&log_dir);
    assert!(files.iter().all(|f| f.extension().is_some_and(|e| e == "arrow")), "only closed segments: {files:?}");
    assert!(files.len() >= 2 || requests < REQUESTS, "rotated by size: {files:?}");
    let mut logged: HashMap<u64, HashMap<u64, Logged>> = HashMap::new();
    // What every row of a decision repeats, by request id.
    let mut shared: HashMap<u64, serde_json::Value> = HashMap::new();
    for f in &files {
        let (code, out, err) = run_quiver(["log".as_ref(), "dump".as_ref(), f.as_os_str(), "--json".as_ref()]);
        assert_eq!(code, 0, "{err}");
        for line in out.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let id = v["request_id"].as_u64().unwrap();
            let row = (
                v["score"].as_f64().unwrap() as f32,
                v["tier"].as_str().unwrap().to_string(),
                v["model_version"].as_u64().unwrap(),
                v["context[0]"].as_f64().unwrap() as f32,
            );
            let fresh = logged.entry(id).or_default().insert(v["candidate"].as_u64().unwrap(), row);
            assert!(fresh.is_none(), "request {id} logged twice");
            let repeated = serde_json::json!([
                v["status"],
                v["reason"],
                v["client_id"],
                v["budget_us"],
                v["server_us"],
                v["features_missing"],
                v["features_stale"],
                v["sampled"],
                v["always"],
            ]);
            assert_eq!(shared.entry(id).or_insert_with(|| repeated.clone()), &repeated, "request {id}'s rows agree");
            assert_eq!(v["item_key"].as_u64().map(|k| k < 10_000), Some(true));
            // Received on the wall clock while the test sent (1 ms of slack
            // for the two clocks' readings).
            let received = v["received"].as_i64().unwrap();
            assert!((sent_ns - 1_000_000..=answered_ns + 1_000_000).contains(&received), "{received}");
        }
        let (code, out, err) = run_quiver(["log".as_ref(), "inspect".as_ref(), f.as_os_str()]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("user[0]: Float32") && out.contains("received: "), "{out}");
        assert!(out.contains("user_position: UInt64") && out.contains("item_position: UInt64"), "{out}");
    }
    assert_eq!(logged.len() as u64, requests, "every decision logged once");
    for (spec, r) in specs.iter().zip(&responses) {
        let rows = &logged[&r.request_id];
        assert_eq!(rows.len() as u64, CANDIDATES);
        let want = serde_json::json!([
            "ok",
            quiver::wire::reason_name(r.reason),
            spec.client_id,
            spec.budget_us,
            r.server_us,
            r.features_missing,
            r.features_stale,
            true,
            null,
        ]);
        assert_eq!(
            shared[&r.request_id], want,
            "request {}: status, reason, client, budget, server time, features missing and stale, why",
            r.request_id
        );
        for (k, score) in r.scores.iter().enumerate() {
            let (s, tier, version, context0) = &rows[&(k as u64)];
            assert_eq!(s.to_bits(), score.to_bits(), "request {} candidate {k}", r.request_id);
            assert_eq!((tier.as_str(), *version), (tier_name(r.tier), u64::from(r.model_version)));
            // The input rows as the kernel saw them hold the request's context.
            assert_eq!(*context0, spec.context[0]);
        }
    }
    // The logged rows scored again give the logged scores, bit for bit:
    // the log holds what the kernel saw.
    let primary = responses.iter().filter(|r| r.tier == quiver::wire::Tier::Primary).count() as u64;
    assert_eq!(replay_all(&files), primary * CANDIDATES);
    // A decision is found by its request id, in the file that holds it.
    let id = responses[requests as usize / 2].request_id;
    let mut found = Vec::new();
    for f in &files {
        let (code, out, err) = run_quiver([
            "log".as_ref(),
            "dump".as_ref(),
            f.as_os_str(),
            "--json".as_ref(),
            "--request-id".as_ref(),
            id.to_string().as_ref(),
        ]);
        assert_eq!(code, 0, "{err}");
        found.extend(out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()));
    }
    assert_eq!(found.len() as u64, CANDIDATES);
    assert!(found.iter().all(|v| v["request_id"].as_u64() == Some(id)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unwritable_directory_is_reported_and_serving_goes_on() {
    let dir = scratch("decision-log-unwritable");
    // A directory under a regular file cannot be made, even by root.
    let file = dir.join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    let config = config_file(&dir, &file.join("decisions"), "");
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    let specs = specs();
    for r in c.pipeline(&specs[..200], 200).unwrap() {
        assert_eq!(r.status, Status::Ok);
    }
    server.wait_metric("quiver_log_write_errors_total", 1);
    server.wait_metric("quiver_log_dropped_total{reason=\"write_error\"}", 200);
    server.wait_stderr("decisions are dropped");
    // Still serving.
    let r = c.score(&specs[300]).unwrap();
    assert_eq!(r.status, Status::Ok);
    assert_eq!(server.terminate(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kill -9` while segments rotate: every `.arrow` file left is whole (it
/// reads back), the open ones are `.tmp`, and the next start deletes those.
#[test]
fn kill_9_leaves_only_whole_segments() {
    let dir = scratch("decision-log-kill");
    let log_dir = dir.join("decisions");
    let config = config_file(&dir, &log_dir, "");
    std::fs::write(
        &config,
        format!(
            "[log]\ndir = \"{}\"\nsample_rate = 1.0\nsegment_bytes_max = 65536\nsegment_age_s = 3600\n",
            log_dir.display()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config]);
    // Traffic flows until the kill, so the writer is mid-segment when it
    // comes; closed segments are there before it.
    let mut c = server.client();
    // The kill ends it: the connection fails.
    let sender = std::thread::spawn(move || {
        let specs = specs();
        let mut sent = 0usize;
        for chunk in specs.chunks(500).cycle() {
            if c.pipeline(chunk, 500).is_err() {
                break;
            }
            sent += chunk.len();
        }
        sent
    });
    server.wait_metric("quiver_log_segments_total", 2);
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let _ = server.child.wait();
    assert!(sender.join().unwrap() >= 500, "traffic flowed before the kill");
    let names: Vec<String> =
        std::fs::read_dir(&log_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let closed: Vec<&String> = names.iter().filter(|n| n.ends_with(".arrow")).collect();
    assert!(closed.len() >= 2, "{names:?}");
    assert!(names.iter().all(|n| n.ends_with(".arrow") || n.ends_with(".arrow.tmp")), "{names:?}");
    for n in &closed {
        let (code, out, err) = run_quiver(["log".as_ref(), "inspect".as_ref(), log_dir.join(n).as_os_str()]);
        assert_eq!(code, 0, "{n}: {err}");
        assert!(out.contains("rows: "), "{out}");
    }
    // A torn file (the open segment, a copy cut short, a footer whose
    // length is past the file) is one clear error from every reader.
    let whole = std::fs::read(log_dir.join(closed[0])).unwrap();
    let mut lying = whole.clone();
    let at = lying.len() - 10;
    lying[at..at + 4].copy_from_slice(&(whole.len() as i32).to_le_bytes());
    let mut torn = vec![("cut.arrow", whole[..whole.len() / 2].to_vec()), ("lying.arrow", lying)];
    for open in names.iter().filter(|n| n.ends_with(".tmp")) {
        let bytes = std::fs::read(log_dir.join(open)).unwrap();
        // A kill between the footer's write and the rename (the fsync
        // between them takes milliseconds) leaves a whole `.tmp`: it reads
        // back, and the next start deletes it all the same.
        if bytes.ends_with(b"ARROW1") {
            let (code, out, err) = run_quiver(["log".as_ref(), "inspect".as_ref(), log_dir.join(open).as_os_str()]);
            assert_eq!(code, 0, "{open} has its footer: {err}");
            assert!(out.contains("rows: "), "{out}");
        } else {
            torn.push(("open.arrow.tmp", bytes));
        }
    }
    let parquet_dir = dir.join("parquet");
    let parquet_dir = parquet_dir.to_str().unwrap();
    for (name, bytes) in torn {
        let f = dir.join(name);
        std::fs::write(&f, bytes).unwrap();
        for cmd in [&["inspect"][..], &["dump", "--json"], &["parquet", "--out-dir", parquet_dir]] {
            let mut args: Vec<&std::ffi::OsStr> = vec!["log".as_ref(), cmd[0].as_ref(), f.as_os_str()];
            args.extend(cmd[1..].iter().map(std::ffi::OsStr::new));
            let (code, out, err) = run_quiver(args);
            assert_eq!(code, 1, "{name} {cmd:?}: {out}{err}");
            assert!(err.contains("not a whole Arrow IPC file") && !err.contains("panicked"), "{name} {cmd:?}: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        }
    }
    // Nothing half written where Parquet copies go; a whole segment's copy
    // is there once asked for.
    assert_eq!(std::fs::read_dir(parquet_dir).unwrap().count(), 0);
    let (code, out, err) = run_quiver([
        "log".as_ref(),
        "parquet".as_ref(),
        log_dir.join(closed[0]).as_os_str(),
        "--out-dir".as_ref(),
        parquet_dir.as_ref(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(" rows)"), "{out}");
    let copies: Vec<_> = std::fs::read_dir(parquet_dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(copies, [std::ffi::OsString::from(closed[0].replace(".arrow", ".parquet"))]);
    // The next start deletes what the killed process left open.
    let had_tmp = names.iter().any(|n| n.ends_with(".tmp"));
    let mut again = Server::start(&["--shards", "1", "--config", config]);
    if had_tmp {
        again.wait_stderr("deleted a decision-log segment left open");
    }
    assert_eq!(again.terminate(), 0);
    let left: Vec<String> =
        std::fs::read_dir(&log_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(left.iter().all(|n| n.ends_with(".arrow")), "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Requests that send the model's input rows themselves (raw rows) are
/// logged with those rows, value for value (a NaN, the missing value, as
/// null in JSON), no keys, and replay to the same bits.
#[test]
fn raw_row_requests_are_logged_with_the_rows_sent() {
    let dir = scratch("decision-log-raw-rows");
    let log_dir = dir.join("decisions");
    let config = config_file(&dir, &log_dir, "");
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let width = quiver::loadgen::demo::model().inputs.iter().map(|s| s.dim).sum::<usize>();
    let sent: Vec<RequestSpec> = (0..100u64)
        .map(|i| {
            let n = 1 + i as usize % 8;
            // Every 13th value missing.
            let rows = (0..n * width)
                .map(|k| {
                    if (k as u64 + i).is_multiple_of(13) {
                        f32::NAN
                    } else {
                        ((k as u64 * 7 + i) as f32 * 0.37).sin()
                    }
                })
                .collect();
            RequestSpec {
                request_id: 8_000_000 + i,
                model: quiver::loadgen::demo::MODEL_NAME.into(),
                budget_us: 1_000_000,
                rows,
                row_count: n as u32,
                ..Default::default()
            }
        })
        .collect();
    let mut c = server.client();
    let responses = c.pipeline(&sent, 100).unwrap();
    assert!(responses.iter().all(|r| r.status == Status::Ok), "{:?}", responses[0]);
    assert_eq!(server.wait_metric("quiver_log_records_total", 100), 100);
    assert_eq!(server.terminate(), 0, "{}", server.stderr());
    let files = segments(&log_dir);
    // The feature columns, in the file's order: the row's order.
    let (code, out, err) = run_quiver(["log".as_ref(), "inspect".as_ref(), files[0].as_os_str()]);
    assert_eq!(code, 0, "{err}");
    let columns: Vec<&str> =
        out.lines().filter_map(|l| l.trim().strip_suffix(": Float32")).filter(|n| n.contains('[')).collect();
    assert_eq!(columns.len(), width, "{out}");
    let rows = dump(&files);
    assert_eq!(rows.len(), sent.iter().map(|s| s.row_count as usize).sum::<usize>());
    for v in &rows {
        let id = v["request_id"].as_u64().unwrap();
        let (spec, r) = sent.iter().zip(&responses).find(|(s, _)| s.request_id == id).unwrap();
        let k = v["candidate"].as_u64().unwrap() as usize;
        assert_eq!(v["score"].as_f64().map(|s| (s as f32).to_bits()), Some(r.scores[k].to_bits()), "{v}");
        for (j, name) in columns.iter().enumerate() {
            let want = spec.rows[k * width + j];
            match v[*name].as_f64() {
                Some(got) => assert_eq!((got as f32).to_bits(), want.to_bits(), "request {id} row {k} {name}"),
                None => assert!(want.is_nan() && v[*name].is_null(), "request {id} row {k} {name}: {}", v[*name]),
            }
        }
        assert!(v["user_key"].is_null() && v["item_key"].is_null(), "no keys: {v}");
    }
    assert_eq!(replay_all(&files), rows.len() as u64);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With only the non_primary rule (sample rate 0), exactly the answers
/// from a lower rung are logged, under that rule, with their tier and
/// reason. On the inference thread a request must leave `reserve_us` for
/// the stage, so a budget below it steps down and one far above it does
/// not.
#[test]
fn answers_from_a_lower_rung_are_logged_by_the_non_primary_rule() {
    use quiver::wire::{reason_name, Tier};
    let dir = scratch("decision-log-non-primary");
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    let text = format!(
        "inference = \"thread\"\n[ladder]\nreserve_us = 40000\n[log]\ndir = \"{}\"\nsample_rate = 0.0\n\
         always = [\"non_primary\"]\n",
        log_dir.display()
    );
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    let mut lower = HashMap::new();
    let mut primary = 0;
    // 100 of each budget.
    for (i, spec) in specs()[..200].iter().enumerate() {
        let budget_us = if i % 2 == 0 { 1_000_000 } else { 20_000 };
        let r = c.score(&RequestSpec { budget_us, ..spec.clone() }).unwrap();
        match (r.status, r.tier) {
            (Status::Ok, Tier::Primary) => primary += 1,
            (Status::Ok, tier) => {
                lower.insert(r.request_id, (tier_name(tier), reason_name(r.reason)));
            }
            // A pause of this VM past the short budget.
            _ => {}
        }
    }
    assert!(primary >= 90 && lower.len() >= 50, "of 100 each: {primary} primary, {} lower", lower.len());
    server.wait_metric("quiver_log_records_total", lower.len() as u64);
    assert_eq!(server.terminate(), 0);
    let rows = dump(&segments(&log_dir));
    let mut logged = HashMap::new();
    for v in &rows {
        let id = v["request_id"].as_u64().unwrap();
        assert_eq!((v["always"].as_str(), v["sampled"].as_bool()), (Some("non_primary"), Some(false)), "{v}");
        let (tier, reason) = (v["tier"].as_str().unwrap(), v["reason"].as_str().unwrap());
        assert_eq!(lower.get(&id), Some(&(tier, reason)), "{v}");
        *logged.entry(id).or_insert(0) += 1;
    }
    assert_eq!(logged.len(), lower.len(), "every lower-rung answer, and nothing else");
    assert!(logged.values().all(|&n| n == CANDIDATES), "{logged:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With only the errors rule, a refusal before any model is chosen is
/// logged: a frame that does not verify (no keys: nothing in it can be
/// read safely), one that verifies but breaks a size limit (its keys read
/// from the verified frame), an unknown model; so is a bad request after
/// the choice; `Ok` answers are not.
#[test]
fn refusals_before_a_model_is_chosen_are_logged_by_the_errors_rule() {
    use std::io::{Read, Write};
    let dir = scratch("decision-log-errors");
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    let text = format!("[limits]\ncandidates_max = 8\n[log]\ndir = \"{}\"\nalways = [\"errors\"]\n", log_dir.display());
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    let specs = specs();
    assert!(c.pipeline(&specs[..100], 100).unwrap().iter().all(|r| r.status == Status::Ok));
    let unknown = RequestSpec { model: "nope".into(), ..specs[100].clone() };
    assert_eq!(c.score(&unknown).unwrap().status, Status::ModelNotFound);
    let short = RequestSpec { context: vec![0.5; 3], ..specs[101].clone() };
    assert_eq!(c.score(&short).unwrap().status, Status::BadRequest);
    // Over `candidates_max`: refused before a model is chosen, its keys
    // still read from the verified frame.
    let wide = demo_request(7_000_001, 4_242, (100..109).collect());
    assert_eq!(c.score(&wide).unwrap().status, Status::BadRequest);
    // A frame that is no FlatBuffer: answered bad_request, request id 0.
    let mut raw = std::net::TcpStream::connect(&server.addr).unwrap();
    raw.write_all(&[8, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4]).unwrap();
    let mut len = [0u8; 4];
    raw.read_exact(&mut len).unwrap();
    assert_eq!(server.wait_metric("quiver_log_records_total", 4), 4);
    assert_eq!(server.terminate(), 0);
    let rows = dump(&segments(&log_dir));
    let by_id = |id: u64| {
        rows.iter().find(|v| v["request_id"].as_u64() == Some(id)).unwrap_or_else(|| panic!("{id}: {rows:?}"))
    };
    let v = by_id(unknown.request_id);
    assert_eq!((v["status"].as_str(), v["model"].as_str()), (Some("model_not_found"), Some("nope")));
    assert_eq!(v["user_key"].as_u64(), Some(unknown.user_id), "{v}");
    assert!(v["score"].is_null() && v["tier"].is_null());
    let v = by_id(short.request_id);
    assert_eq!(v["status"].as_str(), Some("bad_request"));
    let v = by_id(wide.request_id);
    assert_eq!((v["status"].as_str(), v["model"].as_str()), (Some("bad_request"), Some("auction-32")), "{v}");
    assert_eq!((v["user_key"].as_u64(), v["item_key"].as_u64()), (Some(4_242), Some(100)), "{v}");
    assert_eq!(v["client_id"].as_u64(), Some(u64::from(wide.client_id)));
    let v = by_id(0);
    assert_eq!(v["status"].as_str(), Some("bad_request"));
    assert!(v["user_key"].is_null() && v["item_key"].is_null(), "{v}");
    assert_eq!(rows.len(), 4, "{rows:?}");
    // Each says why it was logged: the errors rule, not the sample.
    assert!(rows.iter().all(|v| v["always"].as_str() == Some("errors") && v["sampled"] == false), "{rows:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Keyed by `user`: a user has all of their decisions logged or none, and
/// the share of users logged is within 10% of the rate.
#[test]
fn keyed_sampling_is_sticky_and_near_its_rate() {
    let dir = scratch("decision-log-keyed");
    let log_dir = dir.join("decisions");
    let config = config_file(&dir, &log_dir, "");
    let text = std::fs::read_to_string(&config).unwrap().replace("sample_rate = 1.0", "sample_rate = 0.3");
    std::fs::write(&config, format!("{text}key_group = \"user\"\n")).unwrap();
    let mut server = Server::start(&["--shards", "2", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    let users = 4_000u64;
    // Every user twice, on different request ids, items and contexts.
    let specs: Vec<RequestSpec> =
        (0..2 * users).map(|i| demo_request(50_000_000 + i, i % users, vec![i % 10_000, (i * 7) % 10_000])).collect();
    for chunk in specs.chunks(1000) {
        assert!(c.pipeline(chunk, chunk.len()).unwrap().iter().all(|r| r.status == Status::Ok));
    }
    let records = server.wait_metric("quiver_log_records_total", 1);
    assert_eq!(server.terminate(), 0);
    let rows = dump(&segments(&log_dir));
    let mut per_user: HashMap<u64, std::collections::HashSet<u64>> = HashMap::new();
    for v in &rows {
        per_user.entry(v["user_key"].as_u64().unwrap()).or_default().insert(v["request_id"].as_u64().unwrap());
    }
    assert!(per_user.values().all(|ids| ids.len() == 2), "a sampled user has both decisions logged");
    let share = per_user.len() as f64 / users as f64;
    assert!((share - 0.3).abs() <= 0.03, "{} of {users} users sampled", per_user.len());
    assert!(records >= 2 * per_user.len() as u64 - 2 * per_user.len() as u64 / 10);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POST /log` changes the rates while serving: the default, a model's, a
/// client's; a bad change is refused with why, and changes nothing.
#[test]
fn post_log_changes_the_rates_while_serving() {
    let dir = scratch("decision-log-post");
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    let text = format!("[log]\ndir = \"{}\"\nmodel_sample_rates = {{ typo = 0.5 }}\n", log_dir.display());
    std::fs::write(&config, text).unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    server.wait_stderr("log.model_sample_rates names a model that is not served");
    let url = |q: &str| format!("http://{}/log{q}", server.admin);
    // A rate for a model of no such name is kept and said; values are
    // percent-decoded.
    let (code, body) = http_post(&url("?model=auction-32&sample_rate=0.5"));
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["models_not_served"], serde_json::json!(["typo"]), "{body}");
    let (code, body) = http_post(&url("?model=auction%2D32&sample_rate=none"));
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["model_sample_rates"], serde_json::json!({ "typo": 0.5 }), "{body}");
    let mut c = server.client();
    let specs = specs();
    let send = |c: &mut quiver::client::Client, from: usize, client_id: u32| {
        let batch: Vec<RequestSpec> =
            specs[from..from + 500].iter().map(|s| RequestSpec { client_id, ..s.clone() }).collect();
        assert!(c.pipeline(&batch, 500).unwrap().iter().all(|r| r.status == Status::Ok));
    };
    send(&mut c, 0, 0);
    let (code, body) = http_get(&url(""));
    assert_eq!(code, 200, "{body}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body).unwrap()["sample_rate"].as_f64(), Some(0.0));
    let (code, body) = http_post(&url("?sample_rate=1"));
    assert_eq!(code, 200, "{body}");
    send(&mut c, 500, 0);
    assert_eq!(server.wait_metric("quiver_log_records_total", 500), 500);
    let (code, body) = http_post(&url("?client=9&sample_rate=0"));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"client_sample_rates\":{\"9\":0.0}"), "{body}");
    send(&mut c, 1000, 9);
    let (code, body) = http_post(&url("?sample_rate=1.5"));
    assert_eq!(code, 400);
    assert!(body.contains("sample_rate = 1.5 is outside 0..=1"), "{body}");
    let (code, body) = http_post(&url("?model=&sample_rate=1"));
    assert_eq!(code, 400, "{body}");
    send(&mut c, 1500, 0);
    assert_eq!(server.wait_metric("quiver_log_records_total", 1000), 1000);
    assert_eq!(server.terminate(), 0);
    let rows = dump(&segments(&log_dir));
    let ids: std::collections::HashSet<u64> = rows.iter().map(|v| v["request_id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), 1000);
    assert!(ids.iter().all(|id| (1_000_500..1_001_000).contains(id) || (1_001_500..1_002_000).contains(id)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `POST /log` changes the always rules, the shadow threshold and the key
/// group while serving, several in one call: before it nothing is logged;
/// after it refusals (errors) and shadow disagreements are; then, keyed by
/// user, a user's decisions are all logged or none. A group that cannot
/// key the sample, or a rule of no such name, is refused with why and
/// changes nothing.
#[test]
fn post_log_changes_the_rules_and_the_key_group_while_serving() {
    let dir = scratch("decision-log-post-rules");
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    std::fs::write(&config, format!("[log]\ndir = \"{}\"\n", log_dir.display())).unwrap();
    let mut server = serve_shadowed(&dir, [&demo_version(1, 0.0), &demo_version(2, 1.0)], &config);
    let url = |q: &str| format!("http://{}{q}", server.admin);
    let mut c = server.client();
    let specs = specs();
    // Sequential, so that each shadow scores before the next request.
    let mut send = |range: std::ops::Range<usize>| {
        for s in &specs[range.clone()] {
            assert_eq!(c.score(s).unwrap().status, Status::Ok);
        }
        let unknown = RequestSpec { model: "nope".into(), ..specs[range.end].clone() };
        assert_eq!(c.score(&unknown).unwrap().status, Status::ModelNotFound);
        unknown.request_id
    };
    let before = send(0..50);
    let (code, body) = http_post(&url("/log?always=errors&always_log_shadow_diff=0"));
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((&v["always"], &v["always_log_shadow_diff"]), (&serde_json::json!(["errors"]), &serde_json::json!(0.0)));
    let refused = send(100..150);
    server.wait_metric("quiver_shadow_requests_total", 100);
    assert_eq!(server.wait_metric("quiver_log_records_total", 51), 51);
    let (code, body) = http_post(&url("/log?always=none&always_log_shadow_diff=none&key_group=user&sample_rate=0.5"));
    assert_eq!(code, 200, "{body}");
    for (query, want) in [
        ("key_group=item", "log.key_group = \"item\" is a candidate-scope group"),
        ("key_group=device&sample_rate=1", "log.key_group = \"device\" is not a configured group"),
        ("always=errors,late", "always rule 'late' is not non_primary or errors"),
    ] {
        let (code, why) = http_post(&url(&format!("/log?{query}")));
        assert_eq!(code, 400, "{query}: {why}");
        assert!(why.starts_with(want), "{query}: {why}");
    }
    let (_, now) = http_get(&url("/log"));
    let now: serde_json::Value = serde_json::from_str(&now).unwrap();
    assert_eq!((now["key_group"].as_str(), now["sample_rate"].as_f64()), (Some("user"), Some(0.5)), "{now}");
    // 200 users, each twice, on other request ids and items.
    let users = 200u64;
    let keyed: Vec<RequestSpec> =
        (0..2 * users).map(|i| demo_request(60_000_000 + i, 7_000 + i % users, vec![i % 10_000])).collect();
    assert!(c.pipeline(&keyed, 100).unwrap().iter().all(|r| r.status == Status::Ok));
    assert_eq!(server.terminate(), 0, "{}", server.stderr());
    let rows = dump(&segments(&log_dir));
    let mut by_id: HashMap<u64, Vec<&serde_json::Value>> = HashMap::new();
    for v in &rows {
        by_id.entry(v["request_id"].as_u64().unwrap()).or_default().push(v);
    }
    // Before the change: nothing.
    assert!(specs[..50].iter().all(|s| !by_id.contains_key(&s.request_id)) && !by_id.contains_key(&before));
    // After it: every shadowed decision (the shadow's bias differs) and
    // the refusal, each under its rule.
    for s in &specs[100..150] {
        let rows = by_id.get(&s.request_id).unwrap_or_else(|| panic!("{} not logged", s.request_id));
        assert!(rows.iter().all(|v| v["always"] == "shadow_diff" && v["shadow_version"] == 2), "{rows:?}");
    }
    assert_eq!(by_id[&refused][0]["always"], "errors");
    // Keyed by user: all of a user's decisions or none.
    let mut per_user: HashMap<u64, usize> = HashMap::new();
    for s in &keyed {
        if by_id.contains_key(&s.request_id) {
            *per_user.entry(s.user_id).or_default() += 1;
        }
    }
    assert!(per_user.values().all(|&n| n == 2), "{per_user:?}");
    assert!((40..=160).contains(&per_user.len()), "{} of {users} users sampled at 0.5", per_user.len());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Requests of 64 candidates each: decision records of some 20 KB.
fn wide_specs(n: u64) -> Vec<RequestSpec> {
    (0..n).map(|i| demo_request(1 + i, i % 1000, (0..64).map(|k| (i + k * 13) % 10_000).collect())).collect()
}

const RING_FULL: &str = "quiver_log_dropped_total{reason=\"ring_full\"}";

/// Records put and records dropped for a full ring, once they account for
/// all `decisions` (shards publish once a second); asserts they do within
/// 20 s.
fn logged_or_dropped(server: &Server, decisions: u64) -> (u64, u64) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let (records, full) = loop {
        let (records, full) = (server.metric("quiver_log_records_total"), server.metric(RING_FULL));
        if records + full == decisions || std::time::Instant::now() > until {
            break (records, full);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(records + full, decisions, "every decision logged or counted dropped");
    (records, full)
}

/// A ring far too small for the load: records that do not fit are dropped
/// and counted, and every request is still answered `Ok`; every decision
/// is either in the files or counted dropped.
#[test]
fn a_full_ring_drops_and_counts_while_every_response_arrives() {
    let dir = scratch("decision-log-full");
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    std::fs::write(
        &config,
        format!(
            "[log]\ndir = \"{}\"\nsample_rate = 1.0\nring_bytes = 65536\nsegment_bytes_max = 65536\n",
            log_dir.display()
        ),
    )
    .unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    // 64 candidates: a record of some 20 KB, three to a ring; segments of
    // 64 KiB, each closed with two fsyncs.
    let specs = wide_specs(4_000);
    let mut answered = 0;
    for chunk in specs.chunks(500) {
        let r = c.pipeline(chunk, chunk.len()).unwrap();
        assert!(r.iter().all(|r| r.status == Status::Ok));
        answered += r.len();
    }
    assert_eq!(answered, specs.len());
    let (records, full) = logged_or_dropped(&server, specs.len() as u64);
    assert!(full > 0, "a 64 KiB ring held {records} of {} records of 20 KB", specs.len());
    assert_eq!(server.terminate(), 0);
    let written: std::collections::HashSet<u64> =
        dump(&segments(&log_dir)).iter().map(|v| v["request_id"].as_u64().unwrap()).collect();
    assert_eq!(written.len() as u64, records, "every record in the ring was written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A full disk (a 1 MiB tmpfs, mounted here as root; the test says it is
/// skipped where it cannot mount one) is counted and logged while serving
/// goes on, every request answered `Ok`.
#[test]
fn a_full_disk_is_reported_and_serving_goes_on() {
    let dir = scratch("decision-log-full-disk");
    let small = dir.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "quiver-test-log"])
        .arg(&small)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("SKIPPED a_full_disk_is_reported_and_serving_goes_on: cannot mount a 1 MiB tmpfs (needs root)");
        return;
    }
    /// Unmounts the tmpfs however the test ends.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let unmount = Unmount(small.clone());
    let config = config_file(&dir, &small.join("decisions"), "");
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    let specs = specs();
    // Some 2 KB a decision: 4,000 of them fill 1 MiB several times over.
    for chunk in specs[..4000].chunks(500) {
        assert!(c.pipeline(chunk, chunk.len()).unwrap().iter().all(|r| r.status == Status::Ok));
    }
    server.wait_metric("quiver_log_write_errors_total", 1);
    assert!(server.metric("quiver_log_dropped_total{reason=\"write_error\"}") > 0);
    server.wait_stderr("decisions are dropped");
    assert_eq!(c.score(&specs[5000]).unwrap().status, Status::Ok, "still serving");
    assert_eq!(server.terminate(), 0, "{}", server.stderr());
    drop(unmount);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A disk that hangs: the log's directory on a loop-mounted ext4 image
/// frozen with `fsfreeze` (as root; the test says it is skipped where it
/// cannot make one). The writer blocks in the kernel, the ring fills and
/// drops, counted, and meanwhile every request is answered `Ok` and
/// `/metrics` answers. Thawed, the writer goes on: every decision is in
/// the segments or counted dropped, and the server stops cleanly.
#[test]
fn a_hung_disk_blocks_the_writer_and_never_a_shard() {
    use std::process::{Command, Stdio};
    let dir = scratch("decision-log-hung-disk");
    let (image, mnt) = (dir.join("disk.img"), dir.join("mnt"));
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let quiet = |cmd: &mut Command| cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !quiet(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))
        || !quiet(Command::new("mount").args(["-o", "loop"]).arg(&image).arg(&mnt))
    {
        eprintln!(
            "SKIPPED a_hung_disk_blocks_the_writer_and_never_a_shard: cannot make and loop-mount an ext4 image \
             (needs root, mkfs.ext4 and a loop device)"
        );
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    /// Unmounts the image however the test ends, once the server is gone.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let unmount = Unmount(mnt.clone());
    let log_dir = mnt.join("decisions");
    let config = dir.join("quiver.toml");
    std::fs::write(
        &config,
        // Segments of 64 KiB, closed (and fsynced) every few records, and
        // a writer of the default priority, which the other tests' servers
        // cannot starve: it reaches the frozen disk soon.
        format!(
            "[log]\ndir = \"{}\"\nsample_rate = 1.0\nring_bytes = 1048576\nsegment_bytes_max = 65536\n\
             writer_priority = \"normal\"\n",
            log_dir.display()
        ),
    )
    .unwrap();
    let mut server = Server::start(&["--shards", "1", "--config", config.to_str().unwrap()]);
    let mut c = server.client();
    // 64 candidates: records of some 20 KB, about 50 to the ring.
    let specs = wide_specs(4_000);
    // Before the freeze: 20, which the ring holds whole.
    assert!(c.pipeline(&specs[..20], 20).unwrap().iter().all(|r| r.status == Status::Ok));
    server.wait_metric("quiver_log_records_total", 20);
    /// Thaws the filesystem however the test ends, before the server is
    /// killed: a process blocked on a frozen filesystem cannot exit.
    struct Thaw(PathBuf);
    impl Drop for Thaw {
        fn drop(&mut self) {
            let _ = Command::new("fsfreeze").arg("-u").arg(&self.0).status();
        }
    }
    assert!(quiet(Command::new("fsfreeze").arg("-f").arg(&mnt)), "fsfreeze -f on a mounted ext4 image");
    let thaw = Thaw(mnt.clone());
    // The writer thread blocked in the kernel (state D), waiting on the
    // frozen filesystem.
    let pid = server.child.id();
    let writer_blocked = || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        tasks.flatten().any(|t| {
            std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| stat.contains("(quiver-declog) D"))
        })
    };
    let mut sent = 20;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !writer_blocked() {
        assert!(std::time::Instant::now() < until, "the writer never blocked on the frozen disk");
        if sent + 1100 <= specs.len() {
            let chunk = &specs[sent..sent + 100];
            assert!(c.pipeline(chunk, chunk.len()).unwrap().iter().all(|r| r.status == Status::Ok));
            sent += 100;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The shard is not: a thousand requests or more, every one answered.
    for chunk in specs[sent..].chunks(500) {
        let r = c.pipeline(chunk, chunk.len()).unwrap();
        assert!(r.iter().all(|r| r.status == Status::Ok), "answered while the disk hangs");
    }
    assert!(writer_blocked(), "the writer is still blocked: the disk is still frozen");
    assert!(server.wait_metric(RING_FULL, 1) < specs.len() as u64);
    drop(thaw);
    let (records, _) = logged_or_dropped(&server, specs.len() as u64);
    assert_eq!(server.metric("quiver_log_write_errors_total"), 0, "a hung disk is slow, not failing");
    assert_eq!(server.terminate(), 0, "{}", server.stderr());
    let written: std::collections::HashSet<u64> =
        dump(&segments(&log_dir)).iter().map(|v| v["request_id"].as_u64().unwrap()).collect();
    assert_eq!(written.len() as u64, records, "every record the ring took was written after the thaw");
    assert!((1..=20).all(|id| written.contains(&id)), "the decisions before the freeze");
    drop(server);
    drop(unmount);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The demo model with its output bias shifted by `bias_shift`: the same
/// inputs, other scores.
fn demo_version(version: u32, bias_shift: f32) -> quiver::model::Model {
    let mut m = quiver::loadgen::demo::model();
    m.version = version;
    m.layers.last_mut().unwrap().bias[0] += bias_shift;
    m
}

/// One shard serving `versions` (published under `dir/models`) with
/// `config`: the first answers, the second shadows every request.
fn serve_shadowed(dir: &Path, versions: [&quiver::model::Model; 2], config: &Path) -> Server {
    let models = dir.join("models");
    for m in versions {
        quiver::registry::publish(&models, m).unwrap();
    }
    let server = Server::start(&[
        "--shards",
        "1",
        "--models-dir",
        models.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    let url = |q: String| format!("http://{}/models/auction-32/{q}", server.admin);
    let [served, shadow] = versions.map(|m| m.version);
    assert_eq!(http_post(&url(format!("load?version={served}"))).0, 200);
    assert_eq!(http_post(&url(format!("shadow?version={shadow}&fraction=1"))).0, 200);
    server
}

/// The f32 reference scores of `model` for `spec` on the demo data.
fn reference(model: &quiver::model::Model, spec: &RequestSpec) -> Vec<f32> {
    let (x, _) = common::demo_rows(spec);
    let mut logits = vec![0.0; spec.item_ids.len()];
    model.forward_f32_reference(&x, spec.item_ids.len(), &mut logits);
    logits.into_iter().map(quiver::model::sigmoid).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn shadow_disagreements_over_the_threshold_are_logged() {
    shadow_disagreements("decision-log-shadow", "");
}

/// Scored on the inference thread, the shadow still runs on the shard
/// after the response, and the record waits for it the same way.
#[test]
fn shadow_disagreements_on_the_inference_thread_are_logged() {
    shadow_disagreements("decision-log-shadow-thread", "inference = \"thread\"\n");
}

/// Sample rate 0 and `always_log_shadow_diff` at the median of the
/// requests' reference disagreements between version 1 (served) and
/// version 2 (its shadow, the output bias shifted): exactly the decisions
/// the shadow disagrees with by more are logged, each marked
/// `always = "shadow_diff"`, with the returned and the shadow's scores;
/// the others are not. Served on the f32 backend; requests whose reference
/// disagreement is within rounding of the threshold could go either way,
/// and are not judged.
fn shadow_disagreements(name: &str, top: &str) {
    let dir = scratch(name);
    let (v1, v2) = (demo_version(1, 0.0), demo_version(2, 1.0));
    let specs: Vec<RequestSpec> = specs().into_iter().take(200).collect();
    let want: Vec<f32> = specs.iter().map(|s| max_abs_diff(&reference(&v1, s), &reference(&v2, s))).collect();
    let mut sorted = want.clone();
    sorted.sort_by(f32::total_cmp);
    let threshold = sorted[sorted.len() / 2];
    let log_dir = dir.join("decisions");
    let config = dir.join("quiver.toml");
    let text = format!(
        "{top}backend = \"f32\"\n[log]\ndir = \"{}\"\nsample_rate = 0.0\nalways_log_shadow_diff = {threshold}\n",
        log_dir.display()
    );
    std::fs::write(&config, text).unwrap();
    let mut server = serve_shadowed(&dir, [&v1, &v2], &config);
    let mut c = server.client();
    let mut returned = HashMap::new();
    for spec in &specs {
        let r = c.score(spec).unwrap();
        assert_eq!((r.status, r.model_version), (Status::Ok, 1));
        returned.insert(r.request_id, r.scores);
    }
    // Sequential requests leave the shard time after every write: all are
    // shadowed, and each waiting record finished.
    server.wait_metric("quiver_shadow_requests_total", specs.len() as u64);
    assert_eq!(server.terminate(), 0, "{}", server.stderr());
    let rows = dump(&segments(&log_dir));
    let mut logged: HashMap<u64, Vec<&serde_json::Value>> = HashMap::new();
    for v in &rows {
        logged.entry(v["request_id"].as_u64().unwrap()).or_default().push(v);
    }
    // The f32 backend: scores within rounding of the reference's.
    let margin = 1e-3;
    let mut judged = (0, 0);
    for (spec, want) in specs.iter().zip(&want) {
        let Some(rows) = logged.get(&spec.request_id) else {
            assert!(*want <= threshold + margin, "request {} not logged, disagreeing by {want}", spec.request_id);
            judged.1 += (*want < threshold - margin) as u32;
            continue;
        };
        assert!(*want >= threshold - margin, "request {} logged, disagreeing by {want}", spec.request_id);
        judged.0 += (*want > threshold + margin) as u32;
        assert_eq!(rows.len(), spec.item_ids.len());
        let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap() as f32;
        let scores: Vec<f32> = rows.iter().map(|v| f(v, "score")).collect();
        let shadow: Vec<f32> = rows.iter().map(|v| f(v, "shadow_score")).collect();
        // The returned scores, bit for bit, and the shadow's, over the
        // threshold as the log holds them.
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&scores), bits(&returned[&spec.request_id]));
        assert!(max_abs_diff(&scores, &shadow) > threshold, "{rows:?}");
        for v in rows {
            assert_eq!((v["always"].as_str(), v["sampled"].as_bool()), (Some("shadow_diff"), Some(false)), "{v}");
            assert_eq!((v["shadow_version"].as_u64(), v["model_version"].as_u64()), (Some(2), Some(1)), "{v}");
            assert_eq!(v["user_key"].as_u64(), Some(spec.user_id));
        }
    }
    // Some clearly over the threshold were logged, some clearly under not.
    assert!(judged.0 > 10 && judged.1 > 10, "{judged:?} of {}", specs.len());
    let _ = std::fs::remove_dir_all(&dir);
}
