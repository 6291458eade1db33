//! Refresh lag: how long after a feature write to Redis returns does the
//! served replica hold it? Starts its own `redis-server` and `quiver serve
//! --redis`, writes updates at a steady rate through the contract's publisher
//! and watches the replica file (mapped read-only here: the server updates it
//! in place) until each update appears. Runs once with the server idle and
//! once while it scores a steady open-loop load, and prints p50/p99/p99.9/max.
//!
//!     cargo bench --bench feed_lag [-- --updates N --rate PER_S --score-rate PER_S]
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
use quiver::feed::Publisher;
use quiver::replica::Replica;
use quiver::wire::RequestSpec;
use redis::RedisServer;

const DIM: usize = 32;
const USERS: u64 = 10_000;
const ITEMS: u64 = 50_000;

fn vector(id: u64, marker: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM).map(|i| ((id + i as u64 * 13) % 97) as f32 / 97.0).collect();
    v[1] = marker as f32;
    v
}

struct Args {
    updates: u64,
    rate: u64,
    score_rate: u64,
}

fn args() -> Args {
    let mut a = Args { updates: 10_000, rate: 2_000, score_rate: 2_000 };
    let argv: Vec<String> = std::env::args().collect();
    for w in argv.windows(2) {
        let n = || w[1].parse().unwrap_or_else(|_| panic!("{} takes a number", w[0]));
        match w[0].as_str() {
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
                    item_ids: (0..32).map(|i| (n * 131 + i * 977) % ITEMS).collect(),
                    context: vec![0.1; quiver::demo::CONTEXT_LEN],
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
        let (sent_ns, mut p, updates, rate) =
            (sent_ns.clone(), Publisher::new(redis.conn()).expect("publisher"), a.updates, a.rate);
        std::thread::spawn(move || {
            for n in 0..updates {
                let due = origin + Duration::from_nanos(n * 1_000_000_000 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let id = (n * 7919) % ITEMS;
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
        let id = (n * 7919) % ITEMS;
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

fn report(label: &str, mut lags: Vec<u64>, a: &Args) {
    lags.sort_unstable();
    let q = |p: f64| lags[((lags.len() as f64 * p) as usize).min(lags.len() - 1)];
    println!(
        "{{\"run\":\"{label}\",\"updates\":{},\"rate_per_s\":{},\"lag_us\":{{\"p50\":{},\"p90\":{},\"p99\":{},\"p999\":{},\"max\":{}}}}}",
        lags.len(),
        a.rate,
        q(0.5),
        q(0.9),
        q(0.99),
        q(0.999),
        lags[lags.len() - 1]
    );
}

fn main() {
    let a = args();
    let dir = std::env::temp_dir().join(format!("quiver-feed-lag-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    quiver::demo::ensure(&dir).expect("demo data");
    for f in ["user.qrep", "item.qrep"] {
        std::fs::remove_file(dir.join(f)).expect("demo replica");
    }
    let redis = RedisServer::start();
    let mut p = Publisher::new(redis.conn()).expect("publisher");
    for (group, count) in [("user", USERS), ("item", ITEMS)] {
        let rows: Vec<(u64, Vec<f32>)> = (0..count).map(|id| (id, vector(id, 0))).collect();
        p.put_many(group, &rows, |_, _| {}).expect("load");
    }
    let server = serve(&dir, &redis);
    report("idle server", run(&dir, &redis, &server, &a, 0, 0), &a);
    report(&format!("scoring {} req/s", a.score_rate), run(&dir, &redis, &server, &a, a.score_rate, 1), &a);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
