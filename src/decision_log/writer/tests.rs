//! The writer's tests: segments written, rotated, retained and read back,
//! failures counted without blocking a ring, the writer's priority.

use super::*;
use crate::decision_log::record::{why, DecisionRef, KeysRef, Middle, Span};
use crate::decision_log::{LogRings, RING_BYTES_MIN, SEGMENT_BYTES_MIN};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quiver-declog-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(dir: &Path, retention_bytes_max: u64) -> LogConfig {
    LogConfig {
        dir: Some(dir.to_path_buf()),
        sample_rate: 1.0,
        ring_bytes: RING_BYTES_MIN,
        segment_bytes_max: SEGMENT_BYTES_MIN,
        segment_age_s: 3600,
        retention_bytes_max,
        ..LogConfig::default()
    }
}

const ROWS: usize = 8;
const ROW_DIM: usize = 6;

/// Puts decisions `ids` through shard 0's ring, waiting for room (the
/// test's producer may wait; a shard never does).
fn put_all(rings: &LogRings, ids: std::ops::Range<u64>) {
    put_each(&mut rings.shard(0).unwrap(), ids);
}

/// As [`put_all`], through `log`.
fn put_each(log: &mut crate::decision_log::ShardLog, ids: std::ops::Range<u64>) {
    let spans = [
        Span { name: "user", offset: 0, dim: 2, position: 41 },
        Span { name: "item", offset: 2, dim: 4, position: 42 },
    ];
    for id in ids {
        let x: Vec<f32> = (0..ROWS * ROW_DIM).map(|i| (id as f32) * 0.001 + i as f32).collect();
        let scores: Vec<f32> = (0..ROWS).map(|i| 1.0 / (1.0 + id as f32 + i as f32)).collect();
        let keys = [("user", KeysRef::One(id * 3))];
        let d = DecisionRef {
            request_id: id,
            client_id: 7,
            received_unix_ns: 1_000_000_000 + id as i64,
            budget_us: 5000,
            server_us: 100,
            model: "demo",
            model_version: 1,
            status: 0,
            tier: 0,
            reason: 0,
            features_missing: 0,
            features_stale: false,
            rows: ROWS as u32,
            row_dim: ROW_DIM as u32,
            middle: Middle::Parts { spans: &spans, keys: &keys },
            x: Some(&x),
            scores: Some(&scores),
            why: why::SAMPLE,
            shadow: None,
        };
        let before = log.records;
        while log.records == before {
            log.put(&d);
            if log.records == before {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

#[test]
fn decisions_come_back_whole_from_rotated_segments() {
    let dir = scratch("whole");
    let c = config(&dir, 1 << 40);
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    let n = 3000u64;
    put_all(&rings, 0..n);
    writer.stop();
    let files = segments(&dir);
    assert!(files.len() >= 2, "rotated by size: {files:?}");
    assert!(files.iter().all(|f| f.to_string_lossy().ends_with(SUFFIX)), "no .tmp left: {files:?}");
    // Closed near their size, however many decisions a drain pass took.
    let sizes: Vec<u64> = files.iter().map(|f| f.metadata().unwrap().len()).collect();
    assert!(sizes.iter().all(|&n| n <= 2 * SEGMENT_BYTES_MIN), "{sizes:?}");
    assert_eq!(status.decisions_written.load(Ordering::Relaxed), n);
    assert_eq!(status.rows_written.load(Ordering::Relaxed), n * ROWS as u64);
    assert_eq!(status.segments_closed.load(Ordering::Relaxed), files.len() as u64);
    let mut seen = 0u64;
    for f in &files {
        let summary = crate::decision_log::read::inspect(f).unwrap();
        let names: Vec<&str> = summary.columns.iter().map(|(n, _)| n.as_str()).collect();
        let tail = ["user_key", "user_position", "item_position", "user[0]", "user[1]", "item[0]", "item[1]"];
        assert!(names.ends_with(&[&tail[..], &["item[2]", "item[3]"]].concat()), "{names:?}");
        let mut out = Vec::new();
        let rows = crate::decision_log::read::dump_json(f, &mut out).unwrap();
        assert_eq!(rows, summary.rows);
        for line in String::from_utf8(out).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let id = v["request_id"].as_u64().unwrap();
            let i = v["candidate"].as_u64().unwrap() as usize;
            assert_eq!(i as u64, seen % ROWS as u64, "rows in order");
            assert_eq!(id, seen / ROWS as u64, "decisions in order");
            assert_eq!(v["score"].as_f64().unwrap() as f32, 1.0 / (1.0 + id as f32 + i as f32));
            assert_eq!(v["item[3]"].as_f64().unwrap() as f32, (id as f32) * 0.001 + (i * ROW_DIM + 5) as f32);
            assert_eq!(v["user_key"].as_u64(), Some(id * 3));
            assert_eq!((v["user_position"].as_u64(), v["item_position"].as_u64()), (Some(41), Some(42)));
            assert_eq!((v["tier"].as_str(), v["status"].as_str()), (Some("primary"), Some("ok")));
            assert_eq!(v["received"].as_i64(), Some(1_000_000_000 + id as i64));
            seen += 1;
        }
    }
    assert_eq!(seen, n * ROWS as u64);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until `status` has closed `n` segments.
fn wait_closed(status: &LogStatus, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while status.segments_closed.load(Ordering::Relaxed) < n {
        assert!(Instant::now() < deadline, "{n} segments not closed by age");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_segment_is_closed_by_age_when_its_size_is_far_off() {
    let dir = scratch("age");
    let c = LogConfig { segment_age_s: 1, ..config(&dir, 1 << 40) };
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    let mut log = rings.shard(0).unwrap();
    let opened = Instant::now();
    put_each(&mut log, 0..10);
    wait_closed(&status, 1);
    assert!(opened.elapsed() >= Duration::from_secs(1), "closed before its age");
    // Closed and renamed while the writer runs, with no more decisions.
    let files = segments(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].to_string_lossy().ends_with(SUFFIX), "{files:?}");
    assert_eq!(crate::decision_log::read::inspect(&files[0]).unwrap().decisions, 10);
    put_each(&mut log, 10..20);
    wait_closed(&status, 2);
    writer.stop();
    let files = segments(&dir);
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.iter().all(|f| f.metadata().unwrap().len() < SEGMENT_BYTES_MIN), "closed by age, not size");
    assert_eq!(status.decisions_written.load(Ordering::Relaxed), 20);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn retention_deletes_the_oldest_segments() {
    let dir = scratch("retention");
    let c = config(&dir, 2 * SEGMENT_BYTES_MIN);
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    put_all(&rings, 0..6000);
    writer.stop();
    let closed = status.segments_closed.load(Ordering::Relaxed);
    let deleted = status.segments_deleted.load(Ordering::Relaxed);
    let files = segments(&dir);
    assert!(deleted > 0 && closed == deleted + files.len() as u64, "{closed} closed, {deleted} deleted, {files:?}");
    let sizes: Vec<u64> = files.iter().map(|f| f.metadata().unwrap().len()).collect();
    let newest = *sizes.last().unwrap();
    assert!(sizes.iter().sum::<u64>() <= 2 * SEGMENT_BYTES_MIN + newest, "{sizes:?}");
    // The newest decisions are the ones kept.
    let mut out = Vec::new();
    crate::decision_log::read::dump_json(files.last().unwrap(), &mut out).unwrap();
    let last =
        String::from_utf8(out).unwrap().lines().last().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    assert_eq!(last.unwrap()["request_id"].as_u64(), Some(5999));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A refusal (no rows, fewer keys) between decisions goes in the open
/// segment, its missing columns null: errors do not split segments.
#[test]
fn a_refusal_between_decisions_goes_in_the_open_segment() {
    let dir = scratch("refusal");
    let c = config(&dir, 1 << 40);
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    let mut log = rings.shard(0).unwrap();
    let spans = [Span { name: "user", offset: 0, dim: 2, position: 5 }];
    let (x, scores) = ([0.5f32, 1.5], [0.25f32]);
    let user = [("user", KeysRef::One(3))];
    let ok = DecisionRef {
        request_id: 1,
        model: "m",
        model_version: 1,
        rows: 1,
        row_dim: 2,
        middle: Middle::Parts { spans: &spans, keys: &user },
        x: Some(&x),
        scores: Some(&scores),
        why: why::SAMPLE,
        ..DecisionRef::BLANK
    };
    let refused = DecisionRef {
        request_id: 2,
        model_version: 0,
        status: Status::ModelNotFound.0,
        rows: 0,
        row_dim: 0,
        middle: Middle::Parts { spans: &[], keys: &user },
        x: None,
        scores: None,
        why: why::ERRORS,
        ..ok
    };
    let unread = DecisionRef { request_id: 3, middle: Middle::Parts { spans: &[], keys: &[] }, ..refused };
    for d in [&ok, &refused, &unread, &DecisionRef { request_id: 4, ..ok }] {
        log.put(d);
    }
    writer.stop();
    let files = segments(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let mut out = Vec::new();
    crate::decision_log::read::dump_json(&files[0], &mut out).unwrap();
    let rows: Vec<serde_json::Value> =
        String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let ids: Vec<u64> = rows.iter().map(|v| v["request_id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1, 2, 3, 4]);
    assert_eq!((rows[1]["status"].as_str(), rows[1]["user_key"].as_u64()), (Some("model_not_found"), Some(3)));
    assert!(rows[1]["user[0]"].is_null() && rows[1]["user_position"].is_null() && rows[1]["score"].is_null());
    assert!(rows[2]["user_key"].is_null());
    assert_eq!((rows[3]["user[1]"].as_f64(), rows[3]["user_position"].as_u64()), (Some(1.5), Some(5)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A decision's rows share a value appended once for all of them, and
/// each takes its own where it has one: a request-scope key on every
/// row, a candidate's key on its row (null past the keys given), the
/// shadow's version on every row (null without a shadow).
#[test]
fn every_row_takes_its_own_value_or_the_one_its_decision_shares() {
    use crate::decision_log::record::{request_payload, PAYLOAD_LIMITS};
    use crate::wire::GroupKeySpec;
    let payload = request_payload(vec![
        ("item".into(), GroupKeySpec::Ids(vec![10, 11])),
        ("card".into(), GroupKeySpec::Strs(vec!["c-1".into()])),
    ]);
    let request = crate::wire::decode_request(&payload, &PAYLOAD_LIMITS).unwrap();
    let groups = request.groups();
    let (items, cards) = (groups.get(0).ids().unwrap(), groups.get(1).keys().unwrap());

    let dir = scratch("shared-values");
    let c = config(&dir, 1 << 40);
    let rings = LogRings::new(&c, 1);
    let writer = Writer::start(&c, rings.consumers().unwrap(), Arc::new(LogStatus::default())).unwrap();
    let mut log = rings.shard(0).unwrap();
    let spans = [Span { name: "item", offset: 0, dim: 2, position: 9 }];
    let all = [("user", KeysRef::One(7)), ("item", KeysRef::Ids(items)), ("card", KeysRef::Strs(cards))];
    let x = [0.5f32, 1.5, 2.5, 3.5, 4.5, 5.5];
    let scores = [0.25f32, 0.5, 0.75];
    let d = DecisionRef {
        request_id: 1,
        client_id: 2,
        received_unix_ns: 3,
        budget_us: 4,
        server_us: 5,
        model: "m",
        model_version: 6,
        status: 0,
        tier: 0,
        reason: 0,
        features_missing: 1,
        features_stale: true,
        rows: 3,
        row_dim: 2,
        middle: Middle::Parts { spans: &spans, keys: &all },
        x: Some(&x),
        scores: Some(&scores),
        why: why::SAMPLE | why::SHADOW_DIFF,
        shadow: Some(crate::decision_log::record::ShadowRef { version: 8, scores: &[1.0, 2.0, 3.0] }),
    };
    log.put(&d);
    // Without the card group or a shadow: another layout, so another
    // segment, with no card column.
    let no_card = [all[0], all[1]];
    log.put(&DecisionRef { request_id: 2, middle: Middle::Parts { spans: &spans, keys: &no_card }, shadow: None, ..d });
    writer.stop();
    let files = segments(&dir);
    assert_eq!(files.len(), 2, "{files:?}");
    let mut out = Vec::new();
    for f in &files {
        crate::decision_log::read::dump_json(f, &mut out).unwrap();
    }
    let rows: Vec<serde_json::Value> =
        String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let column = |name: &str| rows.iter().map(|r| r[name].clone()).collect::<Vec<_>>();
    let json = |v: serde_json::Value| v.as_array().unwrap().clone();
    use serde_json::json;
    assert_eq!(column("request_id"), json(json!([1, 1, 1, 2, 2, 2])));
    assert_eq!(column("candidate"), json(json!([0, 1, 2, 0, 1, 2])));
    assert_eq!(column("model_version"), json(json!([6, 6, 6, 6, 6, 6])));
    assert_eq!(column("features_stale"), json(json!([true, true, true, true, true, true])));
    assert_eq!(
        column("always"),
        json(json!(["shadow_diff", "shadow_diff", "shadow_diff", "shadow_diff", "shadow_diff", "shadow_diff"]))
    );
    assert_eq!(column("user_key"), json(json!([7, 7, 7, 7, 7, 7])));
    assert_eq!(column("item_key"), json(json!([10, 11, null, 10, 11, null])));
    assert_eq!(column("card_key"), json(json!(["c-1", "c-1", "c-1", null, null, null])));
    assert_eq!(column("item_position"), json(json!([9, 9, 9, 9, 9, 9])));
    assert_eq!(column("score"), json(json!([0.25, 0.5, 0.75, 0.25, 0.5, 0.75])));
    assert_eq!(column("shadow_version"), json(json!([8, 8, 8, null, null, null])));
    assert_eq!(column("shadow_score"), json(json!([1.0, 2.0, 3.0, null, null, null])));
    assert_eq!(column("item[0]"), json(json!([0.5, 2.5, 4.5, 0.5, 2.5, 4.5])));
    assert_eq!(column("item[1]"), json(json!([1.5, 3.5, 5.5, 1.5, 3.5, 5.5])));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unwritable_directory_is_counted_and_never_blocks_the_ring() {
    let base = scratch("unwritable");
    std::fs::create_dir_all(&base).unwrap();
    // A directory under a regular file cannot be made, even by root.
    let file = base.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let c = config(&file.join("log"), 1 << 40);
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    put_all(&rings, 0..2000);
    writer.stop();
    assert!(status.write_errors.load(Ordering::Relaxed) >= 1);
    assert_eq!(status.dropped_write_error.load(Ordering::Relaxed), 2000);
    assert_eq!(status.decisions_written.load(Ordering::Relaxed), 0);
    let _ = std::fs::remove_dir_all(&base);
}

/// The scheduling policy (`/proc/self/task/<tid>/stat`, field 41) of
/// every thread named `name` in this process.
fn policies_of(name: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis start at 3.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        if let Some(policy) = after.split_whitespace().nth(41 - 3).and_then(|p| p.parse().ok()) {
            out.push(policy);
        }
    }
    out
}

#[test]
fn the_writer_runs_as_sched_idle() {
    let dir = scratch("sched");
    let c = config(&dir, 1 << 40);
    assert_eq!(c.writer_priority, WriterPriority::Idle, "the default");
    let rings = LogRings::new(&c, 1);
    let status = Arc::new(LogStatus::default());
    let writer = Writer::start(&c, rings.consumers().unwrap(), status.clone()).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while !status.writer_idle.load(Ordering::Relaxed) {
        assert!(Instant::now() < until, "the writer never reported SCHED_IDLE");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Every writer of this test binary (tests run side by side) is idle.
    let policies = policies_of("quiver-declog");
    assert!(!policies.is_empty() && policies.iter().all(|&p| p == libc::SCHED_IDLE), "{policies:?}");
    put_all(&rings, 0..10);
    writer.stop();
    assert_eq!(status.decisions_written.load(Ordering::Relaxed), 10);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stamps_are_utc_calendar_times() {
    assert_eq!(utc_stamp(Duration::ZERO), "19700101T000000.000Z");
    // 2026-12-05 09:15:40.123 UTC.
    assert_eq!(utc_stamp(Duration::from_millis(1_796_462_140_123)), "20261205T091540.123Z");
    assert_eq!(utc_stamp(Duration::from_secs(951_782_400)), "20000229T000000.000Z");
}
