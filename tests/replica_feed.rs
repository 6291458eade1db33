//! The feature replica fed from a real Redis: full sync, steady updates while
//! scoring, Redis killed, paused and trimmed, the server killed mid-refresh,
//! and bad data; a source that comes back empty or is reloaded never empties
//! the replica. Every test starts its own `redis-server` and `quiver serve`.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::{redis_entities, RedisServer};
use common::{demo_request, models_only_dir, Server, BIN};
use quiver::admin::{FeedGroupStats, Stats};
use quiver::features::feed::{contract, Publisher, RedisConn, Reply};
use quiver::features::replica::{Replica, ReplicaError};
use quiver::wire::{Status, Tier};

const DIM: usize = 32;

/// A vector that carries its id and generation and a checksum, so any
/// reader can tell a genuine write from a torn or foreign one.
fn vector(id: u64, generation: u64) -> Vec<f32> {
    let mut v: Vec<f32> =
        (0..DIM).map(|i| ((id * 31 + generation * 17 + i as u64 * 7) % 1000) as f32 / 1000.0).collect();
    v[0] = id as f32;
    v[1] = generation as f32;
    v[DIM - 1] = v[..DIM - 1].iter().sum();
    v
}

fn genuine(id: u64, v: &[f32]) -> bool {
    v[0] == id as f32 && v[DIM - 1] == v[..DIM - 1].iter().sum::<f32>()
}

/// A data directory with the demo models and no replica files.
fn serve(dir: &Path, redis: &RedisServer, feed_toml: &str) -> Server {
    let config = dir.join("quiver.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}\"\nblock_ms = 50\n{feed_toml}", redis.url())).unwrap();
    Server::start_with(dir, &["--config", config.to_str().unwrap(), "--shards", "1"])
}

fn get(url: &str) -> (u16, String) {
    common::http_get(url)
}

fn stats(server: &Server) -> Stats {
    server.stats()
}

fn group<'a>(s: &'a Stats, name: &str) -> &'a FeedGroupStats {
    s.feed.iter().find(|g| g.group == name).unwrap_or_else(|| panic!("no feed group {name} in {s:?}"))
}

fn wait_for(server: &Server, what: &str, done: impl Fn(&Stats) -> bool) -> Stats {
    server.wait_stats(what, done)
}

fn redis_seq(conn: &mut RedisConn, group: &str) -> u64 {
    match conn.command(&[b"GET", contract::seq_key(group).as_bytes()]).unwrap() {
        Reply::Bulk(b) => std::str::from_utf8(&b).unwrap().parse().unwrap(),
        Reply::Nil => 0,
        other => panic!("seq: {other:?}"),
    }
}

/// Waits until every group has applied everything Redis has written.
fn wait_caught_up(server: &Server, redis: &RedisServer) -> Stats {
    let mut conn = redis.conn();
    let want: Vec<(&str, u64)> = ["user", "item"].iter().map(|g| (*g, redis_seq(&mut conn, g))).collect();
    wait_for(server, "the replica to catch up", |s| want.iter().all(|(g, seq)| group(s, g).applied_seq == *seq))
}

/// The replica file holds exactly what Redis holds, byte for byte.
fn assert_replica_equals_redis(path: &Path, group: &str, redis: &RedisServer) -> usize {
    let want = redis_entities(&mut redis.conn(), group);
    let r = Replica::open(path, group).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(r.live_rows(), want.len() as u64, "{group}: rows in the replica vs keys in redis");
    let mut out = vec![0.0f32; r.dim()];
    for (id, bytes) in &want {
        assert!(r.read_into(*id, &mut out), "{group}:{id} missing from the replica");
        let got: Vec<u8> = out.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(&got, bytes, "{group}:{id} differs from redis");
    }
    want.len()
}

fn load(redis: &RedisServer, group: &str, ids: std::ops::Range<u64>, generation: u64) {
    let rows: Vec<(u64, Vec<f32>)> = ids.map(|id| (id, vector(id, generation))).collect();
    Publisher::new(redis.conn()).unwrap().put_many(group, &rows, |_, _| {}).unwrap();
}

#[test]
fn full_sync_of_100k_entities_equals_redis_byte_for_byte() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..100_000, 0);
    load(&redis, "user", 0..1000, 0);
    let dir = models_only_dir("feed-full");

    // The command-line sync.
    let out = Command::new(BIN)
        .args(["replica", "sync", "--redis", &redis.url(), "--group", "item", "--dim", "32", "--out"])
        .arg(dir.join("copy.qrep"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("synced 100000 entities"), "{out:?}");
    assert_eq!(assert_replica_equals_redis(&dir.join("copy.qrep"), "item", &redis), 100_000);

    // The server's first start: no replica files, so it syncs before serving.
    let server = serve(&dir, &redis, "");
    server.wait_stderr("full sync from redis before serving");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 100_000);
    assert_eq!(assert_replica_equals_redis(&dir.join("user.qrep"), "user", &redis), 1000);
    let r = server.client().score(&demo_request(1, 7, vec![1, 2, 99_999])).unwrap();
    assert_eq!((r.status, r.features_missing, r.features_stale), (Status::Ok, 0, false));
}

#[test]
fn ten_thousand_updates_at_a_steady_rate_all_land_while_the_server_scores() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..5000, 0);
    load(&redis, "user", 0..1000, 0);
    let dir = models_only_dir("feed-steady");
    let server = serve(&dir, &redis, "");
    let stop = Arc::new(AtomicBool::new(false));
    let scored = Arc::new(AtomicU64::new(0));
    let scorer = {
        let (stop, scored, mut client) = (stop.clone(), scored.clone(), server.client());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let items: Vec<u64> = (0..32).map(|i| (n * 97 + i * 131) % 5200).collect();
                let r = client.score(&demo_request(n, n % 1000, items)).unwrap();
                assert_eq!(r.status, Status::Ok);
                scored.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // 10,000 updates at 5,000 per second, to existing and new items. Every
    // 500th waits until the server has scored since the last, so scoring
    // and updates overlap however the machine schedules the two.
    let mut publisher = Publisher::new(redis.conn()).unwrap();
    let mut last = HashMap::new();
    let mut scored_before = 0;
    let started = Instant::now();
    for n in 0..10_000u64 {
        let id = (n * 7919) % 6000;
        publisher.put("item", id, &vector(id, n + 1)).unwrap();
        last.insert(id, n + 1);
        if n % 500 == 499 {
            let until = Instant::now() + common::WAIT;
            while scored.load(Ordering::Relaxed) == scored_before {
                assert!(Instant::now() < until, "the server stopped scoring after {scored_before}");
                std::thread::sleep(Duration::from_millis(1));
            }
            scored_before = scored.load(Ordering::Relaxed);
        }
        let due = started + Duration::from_micros(n * 200);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    let s = wait_caught_up(&server, &redis);
    stop.store(true, Ordering::Relaxed);
    scorer.join().unwrap();
    assert!(scored.load(Ordering::Relaxed) >= 20, "the server kept scoring");
    assert_eq!(group(&s, "item").applied, 10_000);
    assert_eq!(group(&s, "item").resyncs, 1, "only the first sync: every update came through the stream");
    assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis);
    let r = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut out = vec![0.0; DIM];
    for (id, generation) in last {
        assert!(r.read_into(id, &mut out));
        assert_eq!(out, vector(id, generation), "item {id}");
    }
}

#[test]
fn redis_killed_mid_stream_then_restarted_converges_with_nothing_lost() {
    let mut redis = RedisServer::start_with(true);
    load(&redis, "item", 0..2000, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-kill-redis");
    let server = serve(&dir, &redis, "backoff_ms_max = 200\n");
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, written, config) = (stop.clone(), written.clone(), redis.config());
        std::thread::spawn(move || {
            let mut n = 0u64;
            let mut publisher = None;
            while !stop.load(Ordering::Relaxed) {
                let p = match &mut publisher {
                    Some(p) => p,
                    None => match RedisConn::connect(&config)
                        .map_err(|e| e.to_string())
                        .and_then(|c| Publisher::new(c).map_err(|e| e.to_string()))
                    {
                        Ok(p) => publisher.insert(p),
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                    },
                };
                let id = n % 3000;
                if p.put("item", id, &vector(id, n + 1)).is_err() {
                    publisher = None;
                    continue;
                }
                n += 1;
                written.store(n, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(300));
            }
        })
    };
    // Writes before the kill and after the restart: counted, not timed.
    let wrote_since = |since: u64| {
        let until = Instant::now() + common::WAIT;
        while written.load(Ordering::Relaxed) < since + 100 {
            assert!(Instant::now() < until, "the writer stalled at {}", written.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wrote_since(0);
    redis.kill();
    std::thread::sleep(Duration::from_millis(400));
    let r = server.client().score(&demo_request(1, 3, vec![1, 2, 3])).unwrap();
    assert_eq!(r.status, Status::Ok, "scores keep flowing from the replica while redis is dead");
    let at_restart = written.load(Ordering::Relaxed);
    redis.restart();
    wrote_since(at_restart);
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let s = wait_caught_up(&server, &redis);
    assert_eq!(group(&s, "item").resyncs, 1, "resumed from its position, no resync: {s:?}");
    assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis);
}

#[test]
fn a_trimmed_stream_or_a_new_epoch_triggers_a_full_resync_that_loses_nothing() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..1000, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-trim");
    // The guard against a source that lost its data is off: this test
    // replaces the data on purpose (the guard has tests of its own below).
    let feed_toml = "check_interval_ms = 100\nresync_shrink_max = 1.0\n";
    let mut server = serve(&dir, &redis, feed_toml);
    wait_caught_up(&server, &redis);
    assert_eq!(server.terminate(), 0);

    // While the server is down: updates, deletes and a trim past its position.
    let mut p = Publisher::new(redis.conn()).unwrap();
    for id in 0..200 {
        p.put("item", id, &vector(id, 5)).unwrap();
    }
    for id in 500..550 {
        p.delete("item", id).unwrap();
    }
    p.conn().unwrap().command(&[b"XTRIM", contract::stream_key("item").as_bytes(), b"MAXLEN", b"10"]).unwrap();
    let server = serve(&dir, &redis, feed_toml);
    server.wait_stderr("replica opened: serving it while it is verified");
    server.wait_stderr("replica verified: catching up");
    let s = wait_caught_up(&server, &redis);
    assert_eq!(group(&s, "item").resyncs, 1, "{s:?}");
    assert_eq!(group(&s, "user").resyncs, 0, "the user stream was intact: {s:?}");
    server.wait_stderr("full resync");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 950);

    // Redis replaced under a running server: a new epoch.
    p.conn().unwrap().command(&[b"FLUSHALL"]).unwrap();
    load(&redis, "item", 10_000..10_100, 1);
    load(&redis, "user", 0..10, 1);
    // Depending on when the refresher looks, it resyncs to the flushed (empty)
    // data first and again for the new epoch, or once for the new epoch.
    let s = wait_for(&server, "a resync for the new epoch", |s| {
        group(s, "item").rows == 100 && group(s, "item").applied_seq == 100
    });
    assert!(group(&s, "item").resyncs >= 2, "{s:?}");
    wait_caught_up(&server, &redis);
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 100);
}

/// Closed-loop round trips of `n` demo requests; returns the p99 in µs and
/// whether any response was flagged stale.
fn p99_us(server: &Server, n: u64) -> (u64, bool) {
    let mut client = server.client();
    let mut us = Vec::new();
    let mut stale = false;
    for i in 0..n {
        let started = Instant::now();
        let r = client.score(&demo_request(i, i % 100, (0..32).map(|j| (i + j) % 1000).collect())).unwrap();
        us.push(started.elapsed().as_micros() as u64);
        assert_eq!(r.status, Status::Ok);
        // Redis is not on the request path: the primary keeps answering.
        assert_eq!(r.tier, Tier::Primary, "{r:?}");
        stale |= r.features_stale;
    }
    us.sort_unstable();
    (us[us.len() * 99 / 100], stale)
}

#[test]
fn paused_or_dead_redis_leaves_scoring_latency_alone_while_staleness_grows_and_recovers() {
    let mut redis = RedisServer::start_with(true);
    load(&redis, "item", 0..1000, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-pause");
    let server = serve(&dir, &redis, "staleness_max_ms = 300\nbackoff_ms_max = 100\n");
    let (base_p99, stale) = p99_us(&server, 2000);
    assert!(!stale);

    for outage in ["paused", "dead"] {
        if outage == "paused" {
            redis.pause();
        } else {
            redis.kill();
        }
        std::thread::sleep(Duration::from_millis(400));
        // The request path never touches Redis: a paused Redis blocks the
        // refresher for seconds, and none of that may show here. A request
        // that waited on Redis would wait in every attempt; the other tests
        // of this binary share the two cores, and a burst of theirs lands in
        // one attempt's tail (CI saw 2.5 ms once), so the best of three is
        // held to the bound. A CPU hog beside the tests can stretch every
        // attempt's tail, so the bound is at least 100 ms: a request that
        // read through a paused Redis would wait out its 2 s I/O timeout.
        let bound_us = (base_p99 * 4).max(base_p99 + 2000).max(100_000);
        let mut p99s = Vec::new();
        for _ in 0..3 {
            let (p99, stale) = p99_us(&server, 2000);
            assert!(stale, "redis {outage} past the bound: responses are flagged");
            p99s.push(p99);
            if p99 < bound_us {
                break;
            }
        }
        assert!(
            p99s.iter().any(|&p99| p99 < bound_us),
            "redis {outage}: p99 {p99s:?} µs in three attempts, before {base_p99} µs"
        );
        let s = stats(&server);
        assert!(group(&s, "item").staleness_ms >= 300, "{s:?}");
        assert_eq!(get(&format!("http://{}/readyz", server.admin)).0, 200, "policy flag keeps readiness");
        if outage == "paused" {
            redis.resume();
        } else {
            redis.restart();
        }
        wait_for(&server, "staleness to recover", |s| s.feed.iter().all(|g| g.staleness_ms < 300 && g.redis_connected));
        let (_, stale) = p99_us(&server, 10);
        assert!(!stale, "recovered after redis came back {outage}");
    }
    let s = stats(&server);
    assert_eq!(group(&s, "item").resyncs, 1, "persistent redis: resumed both times, no resync");
}

#[test]
fn stale_features_fail_readiness_when_configured() {
    let mut redis = RedisServer::start();
    load(&redis, "item", 0..10, 0);
    load(&redis, "user", 0..10, 0);
    let dir = models_only_dir("feed-ready");
    let server = serve(&dir, &redis, "staleness_max_ms = 200\nstale_policy = \"not_ready\"\n");
    let readyz = || get(&format!("http://{}/readyz", server.admin));
    // The first confirmation that the replica is current comes from the
    // refresher's first round, and a noisy machine can delay a round past
    // the 200 ms bound: wait for readiness rather than expect it at once.
    let wait_ready = |what: &str| {
        let until = Instant::now() + common::WAIT;
        loop {
            let r = readyz();
            if r.0 == 200 {
                break;
            }
            assert!(Instant::now() < until, "readiness never came {what}: {r:?}\n{}", server.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_ready("at start");
    redis.pause();
    let until = Instant::now() + common::WAIT;
    loop {
        let r = readyz();
        if r.0 == 503 {
            assert_eq!(r, (503, "not ready: features stale\n".into()));
            break;
        }
        assert!(Instant::now() < until, "readiness never failed with redis paused: {r:?}\n{}", server.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = server.client().score(&demo_request(1, 1, vec![1, 2])).unwrap();
    assert!(r.status == Status::Ok && r.features_stale, "still serving, flagged");
    redis.resume();
    wait_ready("back");
}

#[test]
fn kill_9_during_heavy_refresh_then_restart_serves_no_garbage() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..20_000, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-kill9");
    let path = dir.join("item.qrep");
    let mut server = serve(&dir, &redis, "checkpoint_interval_ms = 50\n");
    for round in 1..=3u64 {
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (stop, mut p) = (stop.clone(), Publisher::new(redis.conn()).unwrap());
            std::thread::spawn(move || {
                let mut generation = round * 1000;
                while !stop.load(Ordering::Relaxed) {
                    generation += 1;
                    let rows: Vec<(u64, Vec<f32>)> = (0..2000)
                        .map(|i| (generation * 2000 + i) % 25_000)
                        .map(|id| (id, vector(id, generation)))
                        .collect();
                    p.put_many("item", &rows, |_, _| {}).unwrap();
                }
            })
        };
        std::thread::sleep(Duration::from_millis(300 + round * 150));
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();

        // Straight after the kill: the file is consistent or says which rows
        // were mid-write; whatever it serves is a genuine write.
        match Replica::open(&path, "item") {
            Ok(r) => {
                let mut out = vec![0.0; DIM];
                for id in 0..25_000 {
                    if r.read_into(id, &mut out) {
                        assert!(genuine(id, &out), "round {round}: item {id} is garbage: {out:?}");
                    }
                }
            }
            Err(ReplicaError::Torn { rows, .. }) => assert!(rows <= 1, "one writer tears at most one row"),
            Err(e) => panic!("round {round}: {e}"),
        }
        server = serve(&dir, &redis, "checkpoint_interval_ms = 50\n");
        server.wait_stderr("replica opened: serving it while it is verified");
        server.wait_stderr("replica verified: catching up");
        wait_caught_up(&server, &redis);
        assert_replica_equals_redis(&path, "item", &redis);
        let r = server.client().score(&demo_request(round, 1, vec![1, 2, 3])).unwrap();
        assert_eq!(r.status, Status::Ok);
    }
}

#[test]
fn a_row_damaged_on_disk_is_never_served_and_the_file_is_rebuilt_from_redis() {
    let mut redis = RedisServer::start_with(true);
    load(&redis, "item", 0..5000, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-damaged-row");
    let path = dir.join("item.qrep");
    let mut server = serve(&dir, &redis, "check_interval_ms = 100\n");
    wait_caught_up(&server, &redis);
    assert_eq!(server.terminate(), 0);

    // One bit of item 77's vector flipped on disk: only its row's CRC, which
    // a restart no longer reads before serving, can tell.
    let mut bytes = std::fs::read(&path).unwrap();
    let needle: Vec<u8> = vector(77, 0).iter().flat_map(|x| x.to_le_bytes()).collect();
    let at = bytes.windows(needle.len()).position(|w| w == needle).expect("item 77's vector is in the file");
    bytes[at + 8] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();

    // Redis is down: the restart serves from the file alone.
    redis.kill();
    let server = serve(&dir, &redis, "check_interval_ms = 100\n");
    let log = server.wait_stderr("replica is damaged");
    assert!(log.contains("item.qrep: row") && log.contains("key 77"), "{log}");
    assert!(dir.join("item.qrep.damaged").exists(), "set aside for a post-mortem");
    let r = server.client().score(&demo_request(1, 7, vec![76, 77, 78])).unwrap();
    assert_eq!(
        (r.status, r.features_missing),
        (Status::Ok, 1),
        "item 77 is served as unknown, its neighbours as stored"
    );

    // Redis back (with its data): the group is copied again and served whole.
    redis.restart();
    wait_for(&server, "the resync", |s| group(s, "item").resyncs == 1);
    wait_caught_up(&server, &redis);
    assert_eq!(assert_replica_equals_redis(&path, "item", &redis), 5000);
    let r = server.client().score(&demo_request(2, 7, vec![76, 77, 78])).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 0));
}

#[test]
fn bad_data_in_redis_is_skipped_counted_and_named_in_the_log() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..100, 0);
    load(&redis, "user", 0..10, 0);
    let mut c = redis.conn();
    let good = contract::encode_vector(&vector(1, 9));
    // NaN marks a missing value and is served; an infinity is bad data.
    let mut inf = vector(2, 9);
    inf[3] = f32::INFINITY;
    let inf: Vec<u8> = inf.iter().flat_map(|x| x.to_le_bytes()).collect();
    c.command(&[b"SET", b"item:abc", &good]).unwrap();
    c.command(&[b"SET", b"item:5000", b"twelve bytes"]).unwrap();
    c.command(&[b"HSET", b"item:5001", b"f", b"v"]).unwrap();
    c.command(&[b"SET", b"item:5002", &inf]).unwrap();
    let dir = models_only_dir("feed-bad");
    let server = serve(&dir, &redis, "");
    let s = stats(&server);
    assert_eq!((group(&s, "item").skipped, group(&s, "item").rows), (4, 100), "{s:?}");

    // Bad stream entries with valid sequence numbers, then a good write.
    let stream = contract::stream_key("item");
    let mut xadd = |fields: &[&[u8]]| {
        let seq = match c.command(&[b"INCR", contract::seq_key("item").as_bytes()]).unwrap() {
            Reply::Int(n) => n,
            other => panic!("{other:?}"),
        };
        let id = format!("{seq}-0");
        let mut args: Vec<&[u8]> = vec![b"XADD", stream.as_bytes(), id.as_bytes()];
        args.extend_from_slice(fields);
        c.command(&args).unwrap();
    };
    xadd(&[b"k", b"item:6000", b"v", b"short"]);
    xadd(&[b"x", b"y"]);
    xadd(&[b"k", b"item:zzz", b"v", &good]);
    xadd(&[b"k", b"item:6001"]);
    let mut p = Publisher::new(redis.conn()).unwrap();
    p.put("item", 7000, &vector(7000, 1)).unwrap();
    let s = wait_caught_up(&server, &redis);
    assert_eq!(group(&s, "item").skipped, 8, "{s:?}");
    for key in ["item:abc", "item:5000", "item:5001", "item:5002", "item:6000", "item:zzz", "item:6001"] {
        server.wait_stderr(key);
    }
    let r = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut out = vec![0.0; DIM];
    assert!(r.read_into(7000, &mut out), "the refresh went on after bad entries");
    assert_eq!(out, vector(7000, 1));
    assert!(!r.read_into(6000, &mut out) && !r.read_into(5000, &mut out));
}

#[test]
fn the_refresher_authenticates_and_reads_its_database_index() {
    let redis = RedisServer::start_opts(false, &["--requirepass", "s3cret"]);
    let mut db3 = redis.config();
    db3.db = 3;
    let mut p = Publisher::new(RedisConn::connect(&db3).unwrap()).unwrap();
    p.put_many("item", &(0..50).map(|id| (id, vector(id, 3))).collect::<Vec<_>>(), |_, _| {}).unwrap();
    p.put_many("user", &(0..5).map(|id| (id, vector(id, 3))).collect::<Vec<_>>(), |_, _| {}).unwrap();
    // Database 0 holds other data under the same names: it must not be read.
    load(&redis, "item", 1000..1010, 0);
    let dir = models_only_dir("feed-auth");
    let config = dir.join("quiver.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}/3\"\n", redis.url())).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    let s = stats(&server);
    assert_eq!((group(&s, "item").rows, group(&s, "user").rows), (50, 5), "{s:?}");
    p.put("item", 7, &vector(7, 4)).unwrap();
    wait_for(&server, "the update in db 3", |s| group(s, "item").applied_seq == 51);
    let r = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut out = vec![0.0; DIM];
    assert!(r.read_into(7, &mut out) && out == vector(7, 4));
    assert!(!r.read_into(1000, &mut out), "nothing from database 0");
    let metrics = get(&format!("http://{}/metrics", server.admin)).1;
    if let Some(samples) = common::parse_with_prometheus_client(&metrics) {
        let has = |line: &str| samples.iter().any(|s| s == line);
        assert!(has("quiver_replica_rows{group=item} 50"), "{samples:?}");
        assert!(has("quiver_replica_applied_seq{group=item} 51"), "{samples:?}");
        assert!(has("quiver_redis_connected{} 1"), "{samples:?}");
        assert!(samples.iter().any(|s| s.starts_with("quiver_replica_staleness_seconds{group=user} ")), "{samples:?}");
        assert!(has("quiver_replica_change_age_seconds{group=user} inf"), "never changed: {samples:?}");
    }
    let stats = Command::new(BIN).args(["stats", "--admin", &server.admin, "--count", "1"]).output().unwrap();
    let table = String::from_utf8_lossy(&stats.stdout);
    assert!(table.lines().any(|l| l.starts_with("feed item  rows 50  seq 51") && l.ends_with("redis up")), "{table}");
    drop(server);

    // A wrong password is an error at start-up that says so, not a hang.
    let dir = models_only_dir("feed-badauth");
    let url = redis.url().replace("s3cret", "wrong");
    std::fs::write(dir.join("quiver.toml"), format!("[feed]\nredis = \"{url}\"\ninitial_sync_timeout_ms = 500\n"))
        .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--data-dir"])
        .arg(&dir)
        .arg("--config")
        .arg(dir.join("quiver.toml"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("initial sync") && err.to_lowercase().contains("auth"), "{err}");
}

/// Redis restarted without persistence comes back empty: the resync that
/// would empty the replica is held, the last-known-good rows keep serving,
/// flagged stale, until an operator accepts it.
#[test]
fn redis_restarted_empty_holds_the_resync_until_an_operator_accepts_it() {
    let mut redis = RedisServer::start();
    load(&redis, "item", 0..2000, 0);
    load(&redis, "user", 0..500, 0);
    let dir = models_only_dir("feed-held");
    let feed_toml = "check_interval_ms = 100\nstale_policy = \"not_ready\"\nstaleness_max_ms = 60000\n";
    let server = serve(&dir, &redis, feed_toml);
    wait_caught_up(&server, &redis);
    let admin = server.admin.to_string();
    let readyz = || get(&format!("http://{admin}/readyz")).0;
    assert_eq!(readyz(), 200);
    let ask = |n| server.client().score(&demo_request(n, 7, vec![1, 2, 1999])).unwrap();
    let r = ask(1);
    assert_eq!((r.status, r.features_missing, r.features_stale), (Status::Ok, 0, false));

    redis.restart(); // No persistence: it comes back empty.
    let s = wait_for(&server, "both groups held", |s| group(s, "item").resync_held && group(s, "user").resync_held);
    assert_eq!((group(&s, "item").rows, group(&s, "item").held_rows), (2000, 0), "{s:?}");
    assert_eq!(group(&s, "user").rows, 500, "{s:?}");
    let resyncs_at_hold = group(&s, "item").resyncs;
    let r = ask(2);
    assert_eq!(
        (r.status, r.tier, r.features_missing, r.features_stale),
        (Status::Ok, Tier::Primary, 0, true),
        "the last-known-good rows answer, flagged stale"
    );
    assert_eq!(readyz(), 503, "stale_policy = not_ready fails readiness while held");
    let (_, metrics) = get(&format!("http://{admin}/metrics"));
    assert!(metrics.contains("quiver_replica_resync_held{group=\"item\"} 1"), "{metrics}");
    server.wait_stderr("a full resync would drop 2000 of 2000 rows");

    // While redis stands still the hold stays, and nothing is copied again.
    std::thread::sleep(Duration::from_millis(500));
    let s = stats(&server);
    let item = group(&s, "item");
    assert!(item.resync_held, "{s:?}");
    assert_eq!((item.rows, item.resyncs, item.resync_restarts), (2000, resyncs_at_hold, 0), "{s:?}");

    // The operator accepts the item group: its replica becomes what redis
    // has (nothing); the user group stays held.
    let (code, out, err) = common::run_quiver(["replica", "accept", "--admin", &admin, "--group", "item"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("accepted: group item now serves 0 rows"), "{out}");
    let s = stats(&server);
    assert!(!group(&s, "item").resync_held && group(&s, "user").resync_held, "{s:?}");
    assert_eq!(group(&s, "item").rows, 0, "{s:?}");
    server.wait_stderr("held resync accepted by an operator");
    let r = ask(3);
    assert!(r.features_missing >= 3 && r.features_stale, "items gone, user still held: {r:?}");
    let (code, _, err) = common::run_quiver(["replica", "accept", "--admin", &admin, "--group", "item"]);
    assert_ne!(code, 0);
    assert!(err.contains("nothing held for 'item'"), "{err}");
    assert_eq!(common::http_post(&format!("http://{admin}/replica/nope/accept")).0, 404);
    let (code, body) = common::http_post(&format!("http://{admin}/replica/user/accept"));
    assert_eq!(code, 200, "{body}");

    // From here new writes flow into the emptied replicas as usual.
    load(&redis, "item", 0..10, 1);
    load(&redis, "user", 0..10, 1);
    wait_caught_up(&server, &redis);
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 10);
    assert_eq!(assert_replica_equals_redis(&dir.join("user.qrep"), "user", &redis), 10);
    let until = Instant::now() + common::WAIT;
    while readyz() != 200 {
        assert!(Instant::now() < until, "readiness never came back");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// FLUSHALL, then a reload in chunks: the replica keeps its rows through
/// the empty source (held) and the reload (copies made while it runs are
/// thrown away), and takes the reloaded data once it is complete.
#[test]
fn flushall_then_a_reload_never_swaps_in_an_empty_or_partial_table() {
    const N: u64 = 50_000;
    let redis = RedisServer::start();
    load(&redis, "item", 0..N, 0);
    load(&redis, "user", 0..100, 0);
    let dir = models_only_dir("feed-reload");
    let server = serve(&dir, &redis, "check_interval_ms = 100\n");
    wait_caught_up(&server, &redis);
    let stop = AtomicBool::new(false);
    let seen = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut seen = BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                seen.insert(group(&stats(&server), "item").rows);
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        redis.conn().command(&[b"FLUSHALL"]).unwrap();
        wait_for(&server, "the empty source to be held", |s| group(s, "item").resync_held);
        // Half the data, then its chunks written again until the server has
        // thrown away a copy the writes moved under (on any machine, a copy
        // taken while writes go on sees the counter move), then the rest.
        let half = N / 2;
        for start in (0..half).step_by(2000) {
            load(&redis, "item", start..(start + 2000).min(half), 1);
        }
        let until = Instant::now() + common::WAIT;
        for start in (0..half).step_by(2000).cycle() {
            if group(&stats(&server), "item").resync_restarts > 0 {
                break;
            }
            assert!(Instant::now() < until, "no copy was thrown away while the reload went on");
            load(&redis, "item", start..(start + 2000).min(half), 1);
        }
        for start in (half..N).step_by(2000) {
            load(&redis, "item", start..(start + 2000).min(N), 1);
        }
        load(&redis, "user", 0..100, 1);
        // The old data's counter ended where the new one does: wait for the
        // holds to be released, not just for the counters to agree.
        wait_for(&server, "the reloaded copies", |s| !group(s, "item").resync_held && !group(s, "user").resync_held);
        wait_caught_up(&server, &redis);
        stop.store(true, Ordering::Relaxed);
        sampler.join().unwrap()
    });
    assert_eq!(seen, BTreeSet::from([N]), "the item replica only ever held its {N} rows");
    let s = stats(&server);
    assert!(!group(&s, "item").resync_held && !group(&s, "user").resync_held, "{s:?}");
    assert!(group(&s, "item").resync_restarts > 0, "copies made during the reload were thrown away: {s:?}");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), N as usize);
    let r = Replica::open(&dir.join("item.qrep"), "item").unwrap();
    let mut out = vec![0.0; DIM];
    assert!(r.read_into(N - 1, &mut out));
    assert_eq!(out, vector(N - 1, 1), "the reloaded generation");
}

/// Deleting 90% of the keys through the publisher arrives through the
/// stream, one change at a time: applied as it comes, never held.
#[test]
fn a_mass_deletion_through_the_publisher_is_applied_not_held() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..5000, 0);
    load(&redis, "user", 0..10, 0);
    let dir = models_only_dir("feed-mass-delete");
    let server = serve(&dir, &redis, "check_interval_ms = 100\n");
    wait_caught_up(&server, &redis);
    let ids = dir.join("doomed.txt");
    std::fs::write(&ids, (500..5000u64).map(|i| format!("{i}\n")).collect::<String>()).unwrap();
    let url = redis.url();
    let args = |extra: &[&str]| {
        let mut a = vec!["features", "delete", "--redis", url.as_str(), "--group", "item"];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let (code, out, err) = common::run_quiver(args(&["--ids-from", ids.to_str().unwrap()]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("deleted 4500 entities of group item"), "{out}");
    let (code, out, err) = common::run_quiver(args(&["--id", "498,499"]));
    assert_eq!(code, 0, "{out}{err}");
    let s = wait_caught_up(&server, &redis);
    let item = group(&s, "item");
    assert_eq!((item.rows, item.resync_held, item.resyncs), (498, false, 1), "{s:?}");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 498);

    // A bad id file deletes nothing and names its line.
    std::fs::write(&ids, "1\n# a comment\n\nseven\n").unwrap();
    let (code, _, err) = common::run_quiver(args(&["--ids-from", ids.to_str().unwrap()]));
    assert_ne!(code, 0);
    assert!(err.contains("doomed.txt:4") && err.contains("'seven' is not an id"), "{err}");
    let s = wait_caught_up(&server, &redis);
    assert_eq!(group(&s, "item").rows, 498);
}

/// A new epoch found while the new data is still being loaded: copies made
/// while the counter moves are thrown away, and the one swapped in is the
/// complete data set.
#[test]
fn a_resync_while_redis_is_being_loaded_takes_the_complete_copy() {
    const N: u64 = 50_000;
    let redis = RedisServer::start();
    load(&redis, "item", 0..10, 0);
    load(&redis, "user", 0..10, 0);
    let dir = models_only_dir("feed-settle");
    let server = serve(&dir, &redis, "check_interval_ms = 50\n");
    wait_caught_up(&server, &redis);
    // The data is replaced: a new epoch, then the new rows written back to
    // back, pass after pass, until the server has thrown a copy away: on any
    // machine, a copy taken while the writes go on sees the counter move.
    // One whole pass comes first, so the last copy holds every row.
    redis.conn().command(&[b"DEL", contract::epoch_key("item").as_bytes()]).unwrap();
    let threw_away = Arc::new(AtomicBool::new(false));
    let writer = {
        let (threw_away, conn) = (threw_away.clone(), redis.conn());
        std::thread::spawn(move || {
            let mut p = Publisher::new(conn).unwrap();
            let until = Instant::now() + common::WAIT;
            for (pass, start) in (0..).flat_map(|pass| (0..N).step_by(500).map(move |s| (pass, s))) {
                if pass > 0 && (threw_away.load(Ordering::Relaxed) || Instant::now() > until) {
                    break;
                }
                let rows: Vec<(u64, Vec<f32>)> = (start..start + 500).map(|id| (id, vector(id, 1))).collect();
                p.put_many("item", &rows, |_, _| {}).unwrap();
            }
        })
    };
    wait_for(&server, "a copy thrown away", |s| group(s, "item").resync_restarts > 0);
    threw_away.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let s = wait_for(&server, "the new epoch's copy", |s| group(s, "item").resyncs >= 2 && group(s, "item").rows == N);
    wait_caught_up(&server, &redis);
    assert!(group(&s, "item").resync_restarts > 0, "copies made during the load were thrown away: {s:?}");
    let log = server.wait_stderr("copying again");
    let last_sync = log.lines().rfind(|l| l.contains("full sync done") && l.contains("group=item")).unwrap();
    assert!(last_sync.contains(&format!("rows={N}")), "the copy swapped in was complete: {last_sync}\n{log}");
    assert!(log.contains("copying again"), "{log}");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), N as usize);
}

/// A hold outlives the server: restarted while Redis is still empty, it
/// opens its last-known-good file, finds the same empty source, and holds
/// again instead of emptying the replica.
#[test]
fn a_held_resync_is_held_again_after_a_restart() {
    let mut redis = RedisServer::start();
    load(&redis, "item", 0..300, 0);
    load(&redis, "user", 0..30, 0);
    let dir = models_only_dir("feed-held-restart");
    let feed_toml = "check_interval_ms = 100\n";
    let mut server = serve(&dir, &redis, feed_toml);
    wait_caught_up(&server, &redis);
    redis.restart();
    wait_for(&server, "the hold", |s| group(s, "item").resync_held);
    assert_eq!(server.terminate(), 0);

    let server = serve(&dir, &redis, feed_toml);
    server.wait_stderr("replica opened: serving it while it is verified");
    server.wait_stderr("replica verified: catching up");
    let s = wait_for(&server, "the hold after the restart", |s| {
        group(s, "item").resync_held && group(s, "user").resync_held
    });
    assert_eq!((group(&s, "item").rows, group(&s, "user").rows), (300, 30), "{s:?}");
    let r = server.client().score(&demo_request(1, 7, vec![1, 2, 299])).unwrap();
    assert_eq!((r.status, r.features_missing, r.features_stale), (Status::Ok, 0, true));
}

/// A tmpfs of `mib` MiB mounted over `dir` for the test's life (needs root,
/// as CI and the developers' machines run).
struct SmallDisk {
    dir: std::path::PathBuf,
}

impl SmallDisk {
    /// A data directory named `name` on a tmpfs of `mib` MiB, holding the
    /// demo models and no replica files.
    fn with_models(name: &str, mib: u32) -> SmallDisk {
        let dir = common::scratch(name).join("data");
        std::fs::create_dir_all(&dir).unwrap();
        let disk = SmallDisk::mount(&dir, mib);
        for f in ["model.qm", "fallback.qm"] {
            std::fs::copy(common::demo_dir().join(f), dir.join(f)).unwrap();
        }
        disk
    }

    fn mount(dir: &Path, mib: u32) -> SmallDisk {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("mount(8) runs");
        assert!(out.status.success(), "mounting a small tmpfs (needs root): {out:?}");
        SmallDisk { dir: dir.into() }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

#[test]
fn a_full_disk_during_growth_is_an_error_the_server_survives_and_reports() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..2_000, 0);
    load(&redis, "user", 0..100, 0);
    let disk = SmallDisk::with_models("feed-full-disk", 6);
    let dir = disk.dir.clone();
    let mut server = serve(&dir, &redis, "");
    let before = server.client().score(&demo_request(1, 7, vec![1, 2, 1_999])).unwrap();
    assert_eq!((before.status, before.features_missing), (Status::Ok, 0));

    // Far more items than the disk holds: growing the file must fail. Before
    // blocks were reserved, the file grew sparse and the first write to a
    // page the disk had no room for was a SIGBUS that ended the process.
    load(&redis, "item", 2_000..60_000, 0);
    let until = Instant::now() + common::WAIT;
    while server.metric("quiver_feed_disk_errors_total") == 0 {
        assert!(server.is_running(), "the server died: {}", server.stderr());
        assert!(Instant::now() < until, "no disk error was reported: {}", server.stderr());
        let r = server.client().score(&demo_request(2, 7, vec![1, 2, 1_999])).unwrap();
        assert_eq!(r.status, Status::Ok);
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = server.wait_stderr("cannot reserve");
    assert!(log.contains("serving the replica as it is"), "{log}");
    // The shards keep serving what the replica holds.
    for i in 0..100 {
        let r = server.client().score(&demo_request(i, 7, vec![1, 2, 1_999])).unwrap();
        assert_eq!((r.status, r.features_missing), (Status::Ok, 0));
    }
    assert!(server.is_running());
    assert_eq!(server.terminate(), 0);
    drop(disk);
}

#[test]
fn a_read_only_data_dir_is_served_stale_instead_of_refused() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..500, 0);
    load(&redis, "user", 0..50, 0);
    let disk = SmallDisk::with_models("feed-read-only", 32);
    let dir = disk.dir.clone();
    let mut first = serve(&dir, &redis, "");
    assert_eq!(first.client().score(&demo_request(1, 7, vec![1, 499])).unwrap().features_missing, 0);
    assert_eq!(first.terminate(), 0);
    let out = Command::new("mount").args(["-o", "remount,ro"]).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    // Redis moves on; the node cannot follow, but it serves what it has.
    load(&redis, "item", 500..600, 0);
    let config = common::scratch("feed-read-only-config").join("quiver.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{}\"\nblock_ms = 50\n", redis.url())).unwrap();
    let server = Server::start_with(&dir, &["--config", config.to_str().unwrap(), "--shards", "1"]);
    let log = server.wait_stderr("the data directory cannot be written");
    assert!(log.contains("serving its replica files as they are"), "{log}");
    let r = server.client().score(&demo_request(2, 7, vec![1, 499, 550])).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 1), "items 0..500 served, 550 unknown");
    drop(server);
    drop(disk);
}

#[test]
fn a_small_group_beside_a_big_one_gets_a_small_file() {
    let redis = RedisServer::start();
    load(&redis, "user", 0..100_000, 0);
    load(&redis, "item", 0..1_000, 0);
    let dir = models_only_dir("feed-sizing");
    let server = serve(&dir, &redis, "");
    assert_eq!(server.client().score(&demo_request(1, 7, vec![1, 999])).unwrap().features_missing, 0);
    let bytes = |g: &str| std::fs::metadata(dir.join(format!("{g}.qrep"))).unwrap().len();
    let (user, item) = (bytes("user"), bytes("item"));
    // Sized by DBSIZE, the item file had room for 175k rows, and now that
    // its blocks are reserved it would take as much disk as the user file.
    assert!(item * 20 < user, "item file {item} bytes beside user file {user}");
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 1_000);
}

#[test]
fn a_resync_on_a_full_disk_is_an_error_the_server_survives_and_completes_once_there_is_room() {
    let redis = RedisServer::start();
    load(&redis, "item", 0..2_000, 0);
    load(&redis, "user", 0..100, 0);
    let disk = SmallDisk::with_models("feed-full-disk-resync", 16);
    let dir = disk.dir.clone();
    // The shrink guard is off: the resync below replaces the data on purpose.
    let mut server = serve(&dir, &redis, "check_interval_ms = 100\nresync_shrink_max = 1.0\n");
    assert_eq!(server.client().score(&demo_request(1, 7, vec![1, 1_999])).unwrap().features_missing, 0);

    // Fill the disk to the last block.
    let junk = dir.join("junk");
    {
        let mut f = std::fs::File::create(&junk).unwrap();
        let block = vec![7u8; 64 * 1024];
        while std::io::Write::write_all(&mut f, &block).is_ok() {}
        let _ = std::io::Write::write_all(&mut f, &[7u8]);
    }
    // Redis replaced under the running server: a new epoch, so a full
    // resync, whose copy has no room.
    let mut p = Publisher::new(redis.conn()).unwrap();
    p.conn().unwrap().command(&[b"FLUSHALL"]).unwrap();
    load(&redis, "item", 10_000..10_100, 1);
    load(&redis, "user", 0..100, 1);
    let until = Instant::now() + common::WAIT;
    while server.metric("quiver_feed_disk_errors_total") == 0 {
        assert!(server.is_running(), "the server died: {}", server.stderr());
        assert!(Instant::now() < until, "no disk error was reported: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    server.wait_stderr("cannot reserve");
    // Meanwhile the shards serve what the replica held.
    let r = server.client().score(&demo_request(2, 7, vec![1, 1_999])).unwrap();
    assert_eq!((r.status, r.features_missing), (Status::Ok, 0));

    // Room again: the resync completes on the refresher's next attempt.
    std::fs::remove_file(&junk).unwrap();
    wait_for(&server, "the resync once there is room", |s| group(s, "item").rows == 100);
    wait_caught_up(&server, &redis);
    assert_eq!(assert_replica_equals_redis(&dir.join("item.qrep"), "item", &redis), 100);
    assert!(server.is_running());
    assert_eq!(server.terminate(), 0);
    drop(disk);
}
