//! The decision log end to end against a real `quiver serve`: every
//! decision at sample rate 1 comes back from the segments, read with
//! `quiver log dump`, equal to its response; `kill -9` leaves only whole
//! segments and `.tmp` ones the next start deletes; an unusable directory is
//! counted and logged while serving goes on.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{demo_request, run_quiver, scratch, Server};
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

#[test]
fn every_decision_comes_back_equal_to_its_response() {
    let dir = scratch("decision-log-all");
    let log_dir = dir.join("decisions");
    let config = config_file(&dir, &log_dir, "");
    let mut server = Server::start(&["--shards", "2", "--config", config.to_str().unwrap()]);
    let specs = specs();
    let mut c = server.client();
    let wall_ns = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as i64;
    let sent_ns = wall_ns();
    let mut responses = Vec::new();
    for chunk in specs.chunks(1000) {
        responses.extend(c.pipeline(chunk, chunk.len()).unwrap());
    }
    let answered_ns = wall_ns();
    assert_eq!(responses.len() as u64, REQUESTS);
    assert!(responses.iter().all(|r| r.status == Status::Ok), "every request answered Ok");
    assert_eq!(server.wait_metric("quiver_log_records_total", REQUESTS), REQUESTS);
    assert_eq!(server.metric("quiver_log_dropped_total{reason=\"ring_full\"}"), 0);
    // SIGTERM: the shards stop, the writer drains the rings and closes
    // every segment.
    assert_eq!(server.terminate(), 0, "{}", server.stderr());

    let mut files: Vec<PathBuf> = std::fs::read_dir(&log_dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.iter().all(|f| f.extension().is_some_and(|e| e == "arrow")), "only closed segments: {files:?}");
    assert!(files.len() >= 2, "rotated by size: {files:?}");
    let mut logged: HashMap<u64, HashMap<u64, Logged>> = HashMap::new();
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
            assert_eq!(v["item_key"].as_u64().map(|k| k < 10_000), Some(true));
            // Received on the wall clock while the test sent (1 ms of slack
            // for the two clocks' readings).
            let received = v["received"].as_i64().unwrap();
            assert!((sent_ns - 1_000_000..=answered_ns + 1_000_000).contains(&received), "{received}");
        }
        let (code, out, err) = run_quiver(["log".as_ref(), "inspect".as_ref(), f.as_os_str()]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("user[0]: Float32") && out.contains("received: "), "{out}");
    }
    assert_eq!(logged.len() as u64, REQUESTS, "every decision logged once");
    for (spec, r) in specs.iter().zip(&responses) {
        let rows = &logged[&r.request_id];
        assert_eq!(rows.len() as u64, CANDIDATES);
        for (k, score) in r.scores.iter().enumerate() {
            let (s, tier, version, context0) = &rows[&(k as u64)];
            assert_eq!(s.to_bits(), score.to_bits(), "request {} candidate {k}", r.request_id);
            assert_eq!((tier.as_str(), *version), (tier_name(r.tier), u64::from(r.model_version)));
            // The input rows as the kernel saw them hold the request's context.
            assert_eq!(*context0, spec.context[0]);
        }
    }
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
    let mut c = server.client();
    let specs = specs();
    c.pipeline(&specs[..3000], 500).unwrap();
    // Closed segments are there before the kill.
    server.wait_metric("quiver_log_segments_total", 2);
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-KILL", &pid]).status().unwrap().success());
    let _ = server.child.wait();
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
