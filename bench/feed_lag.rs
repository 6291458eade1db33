//! The Redis feed, measured: full-sync throughput, and refresh lag (how long
//! after a feature write to Redis returns does the served replica hold it?).
//!
//! Starts its own `redis-server`, loads `--items` items, times a full sync
//! of them into a file (`--repeats` times), then starts `quiver serve
//! --redis`, writes updates at a steady rate through the contract's
//! publisher and watches the replica file (mapped read-only here: the server
//! updates it in place) until each update appears. The lag runs with the
//! server idle and while it scores a steady load, `--repeats` times each;
//! each line is one run, and the last lines are the medians per percentile.
//!
//!     cargo bench --bench feed_lag [-- --items N --updates N --rate PER_S --score-rate PER_S --repeats N]
//!
//! Deterministic ids and values; the lag includes the publisher's round trip
//! (the write is timed from just before the call), so it is an upper bound.

#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quiver::client::Client;
use quiver::features::feed::Publisher;
use quiver::features::replica::Replica;
use quiver::wire::RequestSpec;
use redis::RedisServer;

const DIM: usize = 32;
const USERS: u64 = 10_000;
/// Scored requests draw their candidates from the first this many items.
const ITEMS_SCORED: u64 = 50_000;

fn vector(id: u64, marker: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM).map(|i| ((id + i as u64 * 13) % 97) as f32 / 97.0).collect();
    v[1] = marker as f32;
    v
}

struct Args {
    items: u64,
    updates: u64,
    rate: u64,
    score_rate: u64,
    repeats: u64,
}

fn args() -> Args {
    let mut a = Args { items: 1_000_000, updates: 10_000, rate: 2_000, score_rate: 2_000, repeats: 3 };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        let n = || w[1].parse().unwrap_or_else(|_| panic!("{} takes a number", w[0]));
        match w[0].as_str() {
            "--items" => a.items = n(),
            "--repeats" => a.repeats = n(),
            "--updates" => a.updates = n(),
            "--rate" => a.rate = n(),
            "--score-rate" => a.score_rate = n(),
            _ => {}
        }
    }
    a
}

struct Server(Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &std::path::Path, redis: &RedisServer) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_quiver"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--shards", "1", "--redis", &redis.url()])
        .arg("--data-dir")
        .arg(dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("quiver serve starts");
    let lines = BufReader::new(child.stdout.take().expect("piped"));
    for line in lines.lines().map_while(Result::ok) {
        if let Some(addr) = line.strip_prefix("quiver listening on ").and_then(|rest| rest.split(' ').next()) {
            return Server(child, addr.to_string());
        }
    }
    let _ = child.wait();
    panic!("server exited before listening");
}

/// Lag of each update in µs, with the server scoring `score_rate` req/s meanwhile.
fn run(dir: &std::path::Path, redis: &RedisServer, server: &Server, a: &Args, score_rate: u64, pass: u64) -> Vec<u64> {
    let replica = Replica::open(&dir.join("item.qrep"), "item").expect("the server's replica opens read-only");
    let stop = Arc::new(AtomicBool::new(false));
    let scorer = (score_rate > 0).then(|| {
        let (stop, addr) = (stop.clone(), server.1.clone());
        std::thread::spawn(move || {
            let mut client = Client::connect(&addr, Duration::from_secs(5)).expect("client connects");
            let started = Instant::now();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let due = started + Duration::from_nanos(n * 1_000_000_000 / score_rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let spec = RequestSpec {
                    request_id: n,
                    budget_us: 1_000_000,
                    user_id: n % USERS,
                    item_ids: (0..32).map(|i| (n * 131 + i * 977) % ITEMS_SCORED).collect(),
                    context: vec![0.1; quiver::loadgen::demo::CONTEXT_LEN],
                    ..RequestSpec::default()
                };
                client.score(&spec).expect("scores");
                n += 1;
            }
        })
    });
    let sent_ns: Arc<Vec<AtomicU64>> = Arc::new((0..a.updates).map(|_| AtomicU64::new(0)).collect());
    let origin = Instant::now();
    let publisher = {
        let (sent_ns, mut p, updates, rate, items) =
            (sent_ns.clone(), Publisher::new(redis.conn()).expect("publisher"), a.updates, a.rate, a.items);
        std::thread::spawn(move || {
            for n in 0..updates {
                let due = origin + Duration::from_nanos(n * 1_000_000_000 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let id = (n * 7919) % items;
                let at = origin.elapsed().as_nanos() as u64;
                p.put("item", id, &vector(id, pass * updates + n + 1)).expect("put");
                sent_ns[n as usize].store(at.max(1), Ordering::Release);
            }
        })
    };
    let mut lags = Vec::with_capacity(a.updates as usize);
    let mut out = vec![0.0f32; DIM];
    for n in 0..a.updates {
        while sent_ns[n as usize].load(Ordering::Acquire) == 0 {
            std::thread::yield_now();
        }
        let id = (n * 7919) % a.items;
        let marker = (pass * a.updates + n + 1) as f32;
        loop {
            replica.read_into(id, &mut out);
            if out[1] >= marker {
                break;
            }
            std::thread::yield_now();
        }
        let seen = origin.elapsed().as_nanos() as u64;
        lags.push((seen - sent_ns[n as usize].load(Ordering::Relaxed)) / 1_000);
    }
    publisher.join().expect("publisher");
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = scorer {
        s.join().expect("scorer");
    }
    lags
}

/// p50, p90, p99, p99.9 and max of one run's lags.
fn percentiles(mut lags: Vec<u64>) -> [u64; 5] {
    lags.sort_unstable();
    let q = |p: f64| lags[((lags.len() as f64 * p) as usize).min(lags.len() - 1)];
    [q(0.5), q(0.9), q(0.99), q(0.999), lags[lags.len() - 1]]
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn print_lag(label: &str, p: [u64; 5], a: &Args) {
    println!(
        "{{\"run\":\"{label}\",\"updates\":{},\"rate_per_s\":{},\"lag_us\":{{\"p50\":{},\"p90\":{},\"p99\":{},\"p999\":{},\"max\":{}}}}}",
        a.updates, a.rate, p[0], p[1], p[2], p[3], p[4]
    );
}

fn main() {
    let a = args();
    let commit = Command::new("git").args(["rev-parse", "--short", "HEAD"]).output().ok();
    let commit = commit.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    println!("{{\"commit\":\"{commit}\",\"items\":{},\"repeats\":{}}}", a.items, a.repeats);
    let dir = std::env::temp_dir().join(format!("quiver-feed-lag-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    quiver::loadgen::demo::ensure(&dir).expect("demo data");
    for f in ["user.qrep", "item.qrep"] {
        std::fs::remove_file(dir.join(f)).expect("demo replica");
    }
    let redis = RedisServer::start();
    let mut p = Publisher::new(redis.conn()).expect("publisher");
    for (group, count) in [("user", USERS), ("item", a.items.max(ITEMS_SCORED))] {
        for chunk in (0..count).collect::<Vec<u64>>().chunks(100_000) {
            let rows: Vec<(u64, Vec<f32>)> = chunk.iter().map(|&id| (id, vector(id, 0))).collect();
            p.put_many(group, &rows, |_, _| {}).expect("load");
        }
    }

    let mut sync_s = Vec::new();
    for _ in 0..a.repeats {
        let out = dir.join("sync.qrep");
        let part = quiver::features::feed::contract::Part::plain("item");
        let target = quiver::features::feed::sync::SyncTarget {
            part: &part,
            path: &out,
            dim: DIM,
            storage: quiver::features::replica::Storage::F32,
            default: &[0.0; DIM],
            batch_keys_max: 1000,
            // The figure this bench has always recorded; bench/sync_scale.rs
            // measures the parallel copy.
            connections: 1,
        };
        let started = Instant::now();
        let mut fresh =
            quiver::features::feed::sync::full_sync(&mut redis.conn(), &redis.config(), &target, None, &mut |_| {})
                .expect("sync");
        fresh.rename_to(&out).expect("rename");
        let secs = started.elapsed().as_secs_f64();
        println!("{{\"run\":\"full sync\",\"entities\":{},\"seconds\":{secs:.3}}}", fresh.live_rows());
        sync_s.push((secs * 1e6) as u64);
    }
    let sync_us = median(sync_s);
    println!(
        "{{\"median\":\"full sync\",\"entities\":{},\"seconds\":{:.3},\"entities_per_s\":{:.0}}}",
        a.items.max(ITEMS_SCORED),
        sync_us as f64 / 1e6,
        a.items.max(ITEMS_SCORED) as f64 / (sync_us as f64 / 1e6)
    );

    let server = serve(&dir, &redis);
    let mut pass = 0;
    for (label, score_rate) in
        [("idle server".to_string(), 0), (format!("scoring {} req/s", a.score_rate), a.score_rate)]
    {
        let mut runs = Vec::new();
        for _ in 0..a.repeats {
            let p = percentiles(run(&dir, &redis, &server, &a, score_rate, pass));
            pass += 1;
            print_lag(&label, p, &a);
            runs.push(p);
        }
        let med: Vec<u64> = (0..5).map(|i| median(runs.iter().map(|r| r[i]).collect())).collect();
        print_lag(&format!("median of {}: {label}", a.repeats), med.try_into().expect("five"), &a);
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
