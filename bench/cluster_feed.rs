//! The feed on a Redis Cluster against one Redis (issue 15): the time a
//! server's first sync of `--entities` items takes from a three-master
//! cluster (16 buckets, every master's buckets copied on a thread of its
//! own) and from a single Redis (the plain layout), side by side in one
//! run, `--repeats` times each, interleaved; then the refresh lag (how long
//! after a write to the cluster returns the replica holds it) while updates
//! flow at `--rate` per second: steady, during `redis-cli --cluster reshard`
//! of 4,096 slots (a quarter) from one master to another, and after it.
//!
//! Everything runs on this machine: the Redis processes, the refresher (in
//! process, through `quiver::features::feed::start`, as `quiver serve` starts it) and
//! the publisher. The lag is timed from just before the publisher's call,
//! so it includes its round trip: an upper bound.
//!
//!     cargo bench --bench cluster_feed [-- --entities 1000000 --repeats 3 --rate 2000 --phase-s 3]
//!
//! Each line of output is one JSON object; `bench/report.py` renders them.

#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis;
#[path = "../tests/common/redis_cluster.rs"]
#[allow(dead_code)]
mod redis_cluster;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quiver::features::feed::contract::{encode_vector, Layout};
use quiver::features::feed::redis_cluster::ClusterConn;
use quiver::features::feed::{FeedConfig, GroupSpec, Publisher, RedisConn, Reply};
use redis::RedisServer;
use redis_cluster::RedisCluster;

const DIM: usize = 32;
const GROUP: &str = "item";
const BUCKETS: u16 = 16;
/// Keys per MSET while loading (all of one bucket, so of one slot).
const LOAD_KEYS_PER_MSET: usize = 500;
const LOAD_MSETS_PER_ROUND_TRIP: usize = 16;
const RESHARD_SLOTS: usize = 4096;

struct Args {
    entities: u64,
    repeats: usize,
    rate: u64,
    phase_s: u64,
}

fn parse_args() -> Args {
    let mut a = Args { entities: 1_000_000, repeats: 3, rate: 2000, phase_s: 3 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value")).parse().expect("a number");
        match flag.as_str() {
            "--entities" => a.entities = value(),
            "--repeats" => a.repeats = value() as usize,
            "--rate" => a.rate = value(),
            "--phase-s" => a.phase_s = value(),
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn vector(id: u64, marker: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM).map(|i| ((id * 31 + i as u64 * 7) % 1000) as f32 / 1000.0).collect();
    v[1] = marker as f32;
    v
}

/// Loads `0..n` in `layout` with MSETs (one bucket's keys each), then sets every bucket's
/// epoch, counter and bucket count as the publish script would have left them.
/// Commands, each beside the key that routes it on a cluster.
type Keyed = Vec<(Vec<u8>, Vec<Vec<u8>>)>;

fn load(run: &mut dyn FnMut(Keyed), layout: Layout, n: u64) {
    let mut by_bucket: Vec<Vec<u64>> = vec![Vec::new(); layout.bucket_count()];
    for id in 0..n {
        by_bucket[layout.bucket_of(id)].push(id);
    }
    let mut round_trip = Vec::new();
    for ids in &by_bucket {
        for chunk in ids.chunks(LOAD_KEYS_PER_MSET) {
            let mut mset = vec![b"MSET".to_vec()];
            for &id in chunk {
                mset.push(layout.entity_key(GROUP, id).into_bytes());
                mset.push(encode_vector(&vector(id, 0)));
            }
            round_trip.push((mset[1].clone(), mset));
            if round_trip.len() == LOAD_MSETS_PER_ROUND_TRIP {
                run(std::mem::take(&mut round_trip));
            }
        }
    }
    for (b, ids) in by_bucket.iter().enumerate() {
        let keys = layout.keys(GROUP, b);
        let set =
            |k: &str, v: String| (k.as_bytes().to_vec(), vec![b"SET".to_vec(), k.as_bytes().to_vec(), v.into_bytes()]);
        round_trip.push(set(&keys.epoch, "1700000000000001".into()));
        round_trip.push(set(&keys.seq, ids.len().to_string()));
        if let Some(k) = &keys.buckets {
            round_trip.push(set(k, BUCKETS.to_string()));
        }
    }
    run(round_trip);
}

fn feed_config(url: &str, layout: Layout) -> FeedConfig {
    FeedConfig {
        redis: url.into(),
        buckets: match layout {
            Layout::Plain => None,
            Layout::Bucketed { buckets } => Some(buckets),
        },
        block_ms: 50,
        ..FeedConfig::default()
    }
}

/// A server's first sync into an empty `dir`, timed; the feed is left running for `then`.
fn first_sync<T>(dir: &Path, config: &FeedConfig, then: impl FnOnce(&quiver::features::feed::Feed) -> T) -> (f64, T) {
    std::fs::create_dir_all(dir).expect("scratch dir");
    let spec = GroupSpec::new(GROUP, dir.join("item.qrep"), Some(DIM as u32));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let feed = quiver::features::feed::start(config, &[spec], stop.clone()).expect("first sync");
    let secs = started.elapsed().as_secs_f64();
    let out = then(&feed);
    stop.store(true, Ordering::Relaxed);
    feed.thread.join().expect("refresher thread");
    std::fs::remove_dir_all(dir).expect("remove scratch");
    (secs, out)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

fn phase_line(phase: &str, mut lags_us: Vec<u64>, seconds: f64, a: &Args) -> String {
    lags_us.sort_unstable();
    serde_json::json!({
        "kind": "cluster_lag", "phase": phase, "updates": lags_us.len(), "seconds": seconds, "rate": a.rate,
        "p50_us": percentile(&lags_us, 0.5), "p99_us": percentile(&lags_us, 0.99),
        "p999_us": percentile(&lags_us, 0.999), "max_us": lags_us.last().copied().unwrap_or(0),
    })
    .to_string()
}

/// Updates at `a.rate` per second through the cluster publisher while `phases` run one
/// after another on this thread; every update's lag is filed under the phase it was sent in.
fn lag_during(feed: &quiver::features::feed::Feed, cluster: &RedisCluster, a: &Args) -> Vec<String> {
    let handle = feed.handles[0].clone();
    let updates_max = (a.rate * (a.phase_s * 3 + 120)) as usize;
    let sent_us: Arc<Vec<AtomicU64>> = Arc::new((0..updates_max).map(|_| AtomicU64::new(0)).collect());
    let phase_of: Arc<Vec<AtomicU64>> = Arc::new((0..updates_max).map(|_| AtomicU64::new(0)).collect());
    let (sent, phase) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let publisher = {
        let (sent_us, phase_of, sent, phase, stop) =
            (sent_us.clone(), phase_of.clone(), sent.clone(), phase.clone(), stop.clone());
        let conn = ClusterConn::connect(&cluster.config(), &cluster.seeds()).expect("cluster");
        let (entities, rate) = (a.entities, a.rate);
        std::thread::spawn(move || {
            let mut p = Publisher::cluster(conn, BUCKETS).expect("publisher");
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) && (k as usize) < updates_max {
                let due = Duration::from_micros(k * 1_000_000 / rate);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
                let id = (k * 7919) % entities;
                sent_us[k as usize].store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                phase_of[k as usize].store(phase.load(Ordering::Relaxed), Ordering::Relaxed);
                p.put(GROUP, id, &vector(id, k + 1)).expect("publish");
                k += 1;
                sent.store(k, Ordering::Release);
            }
        })
    };
    let watcher = {
        let (sent_us, phase_of, sent, stop) = (sent_us.clone(), phase_of.clone(), sent.clone(), stop.clone());
        let entities = a.entities;
        std::thread::spawn(move || {
            let mut lags: [Vec<u64>; 3] = Default::default();
            let mut v = vec![0f32; DIM];
            let mut k = 0u64;
            loop {
                if k >= sent.load(Ordering::Acquire) {
                    if stop.load(Ordering::Relaxed) {
                        return lags;
                    }
                    std::hint::spin_loop();
                    continue;
                }
                let id = (k * 7919) % entities;
                // A later update to the same id also shows this one has landed.
                if handle.read_into(id, &mut v) && v[1] >= (k + 1) as f32 {
                    let lag =
                        (t0.elapsed().as_micros() as u64).saturating_sub(sent_us[k as usize].load(Ordering::Relaxed));
                    lags[phase_of[k as usize].load(Ordering::Relaxed) as usize].push(lag);
                    k += 1;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_secs(a.phase_s));
    let steady_s = t0.elapsed().as_secs_f64();
    phase.store(1, Ordering::Relaxed);
    let masters: Vec<String> = {
        let c = ClusterConn::connect(&cluster.config(), &cluster.seeds()).expect("cluster");
        c.topology().masters().into_iter().map(String::from).collect()
    };
    let reshard_started = Instant::now();
    cluster.reshard(&masters[0], &masters[1], RESHARD_SLOTS);
    let reshard_s = reshard_started.elapsed().as_secs_f64();
    phase.store(2, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(a.phase_s));
    stop.store(true, Ordering::Relaxed);
    publisher.join().expect("publisher");
    let [steady, during, after] = watcher.join().expect("watcher");
    vec![
        phase_line("steady", steady, steady_s, a),
        phase_line("reshard", during, reshard_s, a),
        phase_line("after", after, a.phase_s as f64, a),
    ]
}

fn main() {
    let a = parse_args();
    let scratch = std::env::temp_dir().join(format!("quiver-cluster-feed-{}", std::process::id()));
    let single = RedisServer::start();
    let cluster = RedisCluster::start(3, 0);
    let cluster_url = format!("redis+cluster://{}", cluster.seeds().join(","));
    let bucketed = Layout::bucketed(BUCKETS).expect("bucket count");

    let mut conn: RedisConn = single.conn();
    load(
        &mut |cmds| {
            let plain: Vec<Vec<Vec<u8>>> = cmds.into_iter().map(|(_, c)| c).collect();
            conn.pipeline(&plain)
                .expect("load single")
                .iter()
                .for_each(|r| assert!(!matches!(r, Reply::Error(_)), "{r:?}"));
        },
        Layout::Plain,
        a.entities,
    );
    let mut cconn = ClusterConn::connect(&cluster.config(), &cluster.seeds()).expect("cluster");
    load(
        &mut |cmds| {
            cconn
                .pipeline(&cmds)
                .expect("load cluster")
                .iter()
                .for_each(|r| assert!(!matches!(r, Reply::Error(_)), "{r:?}"))
        },
        bucketed,
        a.entities,
    );

    for repeat in 0..a.repeats {
        for (source, url, layout) in
            [("single", single.url(), Layout::Plain), ("cluster", cluster_url.clone(), bucketed)]
        {
            let config = feed_config(&url, layout);
            let (secs, rows) = first_sync(&scratch, &config, |feed| feed.handles[0].live_rows());
            assert_eq!(rows, a.entities, "{source}: every entity copied");
            println!(
                "{}",
                serde_json::json!({
                    "kind": "cluster_sync", "source": source, "repeat": repeat, "entities": a.entities,
                    "masters": if source == "cluster" { 3 } else { 1 }, "buckets": layout.bucket_count(),
                    "seconds": secs, "entities_per_s": a.entities as f64 / secs,
                })
            );
        }
    }

    let config = feed_config(&cluster_url, bucketed);
    let (_, lines) = first_sync(&scratch, &config, |feed| lag_during(feed, &cluster, &a));
    for line in lines {
        println!("{line}");
    }
}
