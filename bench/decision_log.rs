//! The decision-log writer alone, measured: how many auction-32 decisions a
//! second (and how many MB a second of segment files) one writer thread
//! turns into closed LZ4 Arrow IPC segments, and the bytes one decision
//! takes on disk.
//!
//! A producer thread (the shard's side) encodes `--decisions` records of
//! `--candidates` rows of `--row-dim` floats into one ring, waiting when it
//! is full (a shard would drop; here the writer's pace is what is
//! measured); the writer drains it into segments in a scratch directory.
//! Timed from the first record put to the last segment closed (the writer
//! stopped once the producer is done: it drains the ring first). The floats
//! are drawn afresh for every decision, uniform in [-2, 2) with 24 random
//! bits, which LZ4 cannot compress: the bytes per decision are an upper
//! bound (served features repeat; `bench/decision_log.sh` also measures the
//! demo's real ones).
//!
//! Its CPU, beside the rate: the process's CPU time (`getrusage`) less the
//! producer thread's, per decision. The machine's noise moves it far less
//! than the rate, which also waits on the producer. Likewise its page
//! faults (memory malloc gave back to the kernel and took again).
//!
//! Beside it, the shard's side: the mean time of a `ShardLog::put` that
//! took its record (encoding the decision into the ring; what a logged
//! decision costs a shard), timed around each call.
//!
//!     cargo bench --bench decision_log [-- --decisions N --candidates N --row-dim N --json --keep]

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use quiver::decision_log::record::{why, DecisionRef, KeysRef, Middle, Span};
use quiver::decision_log::writer::Writer;
use quiver::decision_log::{LogConfig, LogRings, LogStatus};
use quiver::seeded::SplitMix64;

struct Args {
    decisions: u64,
    candidates: usize,
    row_dim: usize,
    json: bool,
    /// Leave the segments in place (their directory is printed).
    keep: bool,
}

fn args() -> Args {
    let mut a = Args { decisions: 100_000, candidates: 32, row_dim: 80, json: false, keep: false };
    let argv: Vec<String> = std::env::args().collect();
    for (i, arg) in argv.iter().enumerate() {
        let n = || argv.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{arg} takes a number"));
        match arg.as_str() {
            "--decisions" => a.decisions = n(),
            "--candidates" => a.candidates = n() as usize,
            "--row-dim" => a.row_dim = n() as usize,
            "--json" => a.json = true,
            "--keep" => a.keep = true,
            _ => {}
        }
    }
    a
}

fn main() {
    let a = args();
    let dir = std::env::temp_dir().join(format!("quiver-bench-declog-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = LogConfig {
        dir: Some(dir.clone()),
        sample_rate: 1.0,
        ring_bytes: 64 << 20,
        segment_bytes_max: 64 << 20,
        segment_age_s: 3600,
        retention_bytes_max: 1 << 40,
        ..LogConfig::default()
    };
    let rings = LogRings::new(&config, 1);
    let status = Arc::new(LogStatus::default());
    let writer =
        Writer::start(&config, rings.consumers().expect("one writer"), status.clone()).expect("the writer starts");
    let scores: Vec<f32> = (0..a.candidates).map(|i| 1.0 / (2.0 + i as f32)).collect();
    let third = (a.row_dim / 3) as u32;
    let started = Instant::now();
    let process_before = usage(libc::RUSAGE_SELF);
    let producer = {
        let (rings, decisions, candidates, row_dim) = (rings.clone(), a.decisions, a.candidates, a.row_dim);
        std::thread::spawn(move || {
            let mut log = rings.shard(0).expect("shard 0's producer");
            let spans = [
                Span { name: "user", offset: 0, dim: third, position: 7 },
                Span { name: "item", offset: third, dim: third, position: 9 },
                Span { name: "context", offset: 2 * third, dim: row_dim as u32 - 2 * third, position: 0 },
            ];
            let (mut waits, mut put_ns) = (0u64, 0u64);
            // Every decision's floats drawn afresh (a few ns each, beside
            // the writer's tens of µs a decision).
            let mut rng = SplitMix64::new(36);
            let mut x = vec![0.0f32; candidates * row_dim];
            for id in 0..decisions {
                let keys = [("user", KeysRef::One(id % 100_000))];
                for v in x.iter_mut() {
                    *v = ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
                }
                let x = &x;
                let d = DecisionRef {
                    request_id: id,
                    client_id: 1,
                    received_unix_ns: 1_764_900_000_000_000_000 + id as i64 * 33_000,
                    budget_us: 5_000,
                    server_us: 60,
                    model: "auction-32",
                    model_version: 1,
                    status: 0,
                    tier: 0,
                    reason: 0,
                    features_missing: 0,
                    features_stale: false,
                    rows: candidates as u32,
                    row_dim: row_dim as u32,
                    middle: Middle::Parts { spans: &spans, keys: &keys },
                    x: Some(x),
                    scores: Some(&scores),
                    why: why::SAMPLE,
                    shadow: None,
                };
                let before = log.records;
                while log.records == before {
                    let t = Instant::now();
                    log.put(&d);
                    if log.records != before {
                        put_ns += t.elapsed().as_nanos() as u64;
                    } else {
                        waits += 1;
                        std::thread::yield_now();
                    }
                }
            }
            (waits, put_ns, usage(libc::RUSAGE_THREAD))
        })
    };
    let (waits, put_ns, producer) = producer.join().expect("the producer finishes");
    let put_ns_per_decision = put_ns as f64 / a.decisions as f64;
    // Stopping drains the ring and closes the open segment (decisions are
    // counted written as segments close).
    writer.stop();
    assert_eq!(status.decisions_written.load(Relaxed), a.decisions, "every decision written");
    let elapsed_s = started.elapsed().as_secs_f64();
    // The main thread only waits meanwhile: the rest is the writer's.
    let process = usage(libc::RUSAGE_SELF);
    let writer_cpu_us_per_decision = (process.0 - process_before.0 - producer.0) * 1e6 / a.decisions as f64;
    let writer_faults_per_decision = (process.1 - process_before.1 - producer.1) as f64 / a.decisions as f64;
    let bytes = status.bytes_closed.load(Relaxed);
    let rows = status.rows_written.load(Relaxed);
    let segments = status.segments_closed.load(Relaxed);
    if a.keep {
        eprintln!("segments kept in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let per_s = a.decisions as f64 / elapsed_s;
    let mb_per_s = bytes as f64 / elapsed_s / 1e6;
    let bytes_per_decision = bytes as f64 / a.decisions as f64;
    let raw_bytes_per_decision = (a.candidates * a.row_dim * 4 + a.candidates * 4) as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "decisions": a.decisions,
                "candidates": a.candidates,
                "row_dim": a.row_dim,
                "rows": rows,
                "segments": segments,
                "elapsed_s": elapsed_s,
                "decisions_per_s": per_s,
                "rows_per_s": rows as f64 / elapsed_s,
                "file_mb_per_s": mb_per_s,
                "file_bytes_per_decision": bytes_per_decision,
                "float_bytes_per_decision": raw_bytes_per_decision,
                "producer_waits": waits,
                "put_ns_per_decision": put_ns_per_decision,
                "writer_cpu_us_per_decision": writer_cpu_us_per_decision,
                "writer_faults_per_decision": writer_faults_per_decision,
            })
        );
    } else {
        println!(
            "{} decisions of {}x{} floats in {elapsed_s:.2} s: {per_s:.0} decisions/s, {mb_per_s:.1} MB/s of \
             segment files, {bytes_per_decision:.0} bytes per decision ({raw_bytes_per_decision:.0} bytes of \
             floats and scores before compression), {segments} segments; the writer's CPU \
             {writer_cpu_us_per_decision:.1} µs and {writer_faults_per_decision:.2} page faults per decision; a put \
             took {put_ns_per_decision:.0} ns",
            a.decisions, a.candidates, a.row_dim
        );
    }
}

/// CPU time (user and system, in seconds) and page faults of `who` so far.
fn usage(who: libc::c_int) -> (f64, i64) {
    // SAFETY: getrusage writes into the struct it is given.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(who, &mut r) }, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (tv(r.ru_utime) + tv(r.ru_stime), r.ru_minflt + r.ru_majflt)
}
