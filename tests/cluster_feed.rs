//! The server following a bucketed group: on one Redis node, and on a real Redis Cluster
//! through a full sync, updates while scoring, a resharding and a master's failover, with
//! the replica equal to what the source holds after each. Every test starts its own
//! `redis-server` processes and `quiver serve`.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis::RedisServer;
use common::redis_cluster::RedisCluster;
use common::{demo_request, models_only_dir, Server};
use quiver::admin::{FeedGroupStats, Stats};
use quiver::features::feed::contract::{encode_vector, Layout};
use quiver::features::feed::redis_cluster::ClusterConn;
use quiver::features::feed::{Publisher, Reply};
use quiver::features::replica::{bucket_path, Replica};
use quiver::wire::Status;

const DIM: usize = 32;

fn vector(id: u64, generation: u64) -> Vec<f32> {
    (0..DIM).map(|i| ((id * 31 + generation * 17 + i as u64 * 7) % 1000) as f32 / 1000.0).collect()
}

fn serve(dir: &Path, url: &str, feed_toml: &str) -> Server {
    let config = dir.join("quiver.toml");
    std::fs::write(&config, format!("[feed]\nredis = \"{url}\"\nblock_ms = 50\n{feed_toml}")).unwrap();
    Server::start_with(dir, &["--config", config.to_str().unwrap(), "--shards", "1"])
}

fn group<'a>(s: &'a Stats, name: &str) -> &'a FeedGroupStats {
    s.feed.iter().find(|g| g.group == name).unwrap_or_else(|| panic!("no feed group {name} in {s:?}"))
}

/// Reads keys wherever they live: one node, or a cluster.
trait Source {
    fn get_many(&mut self, keys: &[String]) -> Vec<Reply>;
}

impl Source for quiver::features::feed::RedisConn {
    fn get_many(&mut self, keys: &[String]) -> Vec<Reply> {
        let cmds: Vec<Vec<Vec<u8>>> = keys.iter().map(|k| vec![b"GET".to_vec(), k.clone().into_bytes()]).collect();
        self.pipeline(&cmds).unwrap()
    }
}

impl Source for ClusterConn {
    fn get_many(&mut self, keys: &[String]) -> Vec<Reply> {
        let cmds: Vec<(Vec<u8>, Vec<Vec<u8>>)> =
            keys.iter().map(|k| (k.clone().into_bytes(), vec![b"GET".to_vec(), k.clone().into_bytes()])).collect();
        self.pipeline(&cmds).unwrap()
    }
}

/// The sum of the group's bucket counters: what the server's `applied_seq` reaches once it
/// holds every change.
fn seq_sum(src: &mut impl Source, layout: Layout, name: &str) -> u64 {
    let keys: Vec<String> = (0..layout.bucket_count()).map(|b| layout.keys(name, b).seq).collect();
    src.get_many(&keys)
        .into_iter()
        .map(|r| match r {
            Reply::Bulk(b) => String::from_utf8(b).unwrap().parse::<u64>().unwrap(),
            Reply::Nil => 0,
            other => panic!("counter: {other:?}"),
        })
        .sum()
}

fn wait_caught_up(server: &Server, src: &mut impl Source, layout: Layout) -> Stats {
    let want: Vec<(&str, u64)> = ["user", "item"].iter().map(|g| (*g, seq_sum(src, layout, g))).collect();
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let s = server.stats();
        if want.iter().all(|(g, seq)| group(&s, g).applied_seq == *seq) {
            return s;
        }
        assert!(Instant::now() < until, "the replica did not catch up to {want:?}: {s:?}\n{}", server.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every bucket file of the group, read together, holds exactly what the source holds for
/// ids `0..ids`, byte for byte (and nothing else).
fn assert_replica_equals_source(dir: &Path, name: &str, layout: Layout, ids: u64, src: &mut impl Source) -> u64 {
    let tables: Vec<Replica> = (0..layout.bucket_count())
        .map(|b| {
            let path = bucket_path(&dir.join(format!("{name}.qrep")), b);
            Replica::open(&path, name).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        })
        .collect();
    let mut live = 0;
    let mut out = vec![0.0f32; DIM];
    for start in (0..ids).step_by(1000) {
        let batch: Vec<u64> = (start..ids.min(start + 1000)).collect();
        let keys: Vec<String> = batch.iter().map(|&id| layout.entity_key(name, id)).collect();
        for (&id, value) in batch.iter().zip(src.get_many(&keys)) {
            let held = tables[layout.bucket_of(id)].read_into(id, &mut out);
            match value {
                Reply::Bulk(bytes) => {
                    assert!(held, "{name}:{id} missing from the replica");
                    assert_eq!(encode_vector(&out), bytes, "{name}:{id} differs from the source");
                    live += 1;
                }
                Reply::Nil => assert!(!held, "{name}:{id} is in the replica but not in the source"),
                other => panic!("{name}:{id}: {other:?}"),
            }
        }
    }
    assert_eq!(tables.iter().map(Replica::live_rows).sum::<u64>(), live, "{name}: no rows beyond the source's");
    live
}

fn put(p: &mut Publisher, name: &str, ids: std::ops::Range<u64>, generation: u64) {
    let rows: Vec<(u64, Vec<f32>)> = ids.map(|id| (id, vector(id, generation))).collect();
    p.put_many(name, &rows, |_, _| {}).unwrap();
}

/// Scores 32 random items at a time until `stop`, asserting every answer is a full one.
fn scorer(server: &Server, stop: Arc<AtomicBool>, items: u64) -> (std::thread::JoinHandle<()>, Arc<AtomicU64>) {
    let scored = Arc::new(AtomicU64::new(0));
    let mut client = server.client();
    let counted = scored.clone();
    let thread = std::thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let batch: Vec<u64> = (0..32).map(|i| (n * 97 + i * 131) % items).collect();
            let r = client.score(&demo_request(n, n % 1000, batch)).unwrap();
            assert_eq!(r.status, Status::Ok);
            counted.fetch_add(1, Ordering::Relaxed);
        }
    });
    (thread, scored)
}

/// Publishes `updates` changes to items (every tenth a delete), in batches
/// of 100. With a scorer's count, every tenth batch waits until it has
/// scored since the last, so scoring and updates overlap however the
/// machine schedules them.
fn updater(
    mut p: Publisher,
    items: u64,
    updates: u64,
    generation: u64,
    scored: Option<Arc<AtomicU64>>,
) -> std::thread::JoinHandle<Publisher> {
    std::thread::spawn(move || {
        let mut scored_before = 0;
        for start in (0..updates).step_by(100) {
            if let Some(scored) = scored.as_ref().filter(|_| start % 1000 == 0) {
                let until = Instant::now() + common::WAIT;
                while scored.load(Ordering::Relaxed) == scored_before {
                    assert!(Instant::now() < until, "the server stopped scoring after {scored_before}");
                    std::thread::sleep(Duration::from_millis(1));
                }
                scored_before = scored.load(Ordering::Relaxed);
            }
            let ids: Vec<u64> = (start..start + 100).map(|n| (n * 7919) % items).collect();
            let (dels, puts): (Vec<u64>, Vec<u64>) = ids.iter().partition(|&&id| id % 10 == 3);
            let rows: Vec<(u64, Vec<f32>)> = puts.iter().map(|&id| (id, vector(id, generation))).collect();
            p.put_many("item", &rows, |_, _| {}).unwrap();
            p.delete_many("item", &dels, |_, _| {}).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        p
    })
}

#[test]
fn one_node_bucketed_group_follows_each_bucket_and_resyncs_only_the_one_with_a_gap() {
    let redis = RedisServer::start();
    let layout = Layout::bucketed(4).unwrap();
    let mut p = Publisher::new(redis.conn()).unwrap().with_layout(layout).unwrap();
    put(&mut p, "item", 0..20_000, 0);
    put(&mut p, "user", 0..1000, 0);
    let dir = models_only_dir("bucketed-one-node");
    let server = serve(&dir, &redis.url(), "buckets = 4\ncheck_interval_ms = 200\n");
    let mut conn = redis.conn();
    wait_caught_up(&server, &mut conn, layout);
    assert_eq!(assert_replica_equals_source(&dir, "item", layout, 20_000, &mut conn), 20_000);
    assert_eq!(assert_replica_equals_source(&dir, "user", layout, 1000, &mut conn), 1000);
    assert!(!dir.join("item.qrep").exists(), "a bucketed group has no plain file");
    let r = server.client().score(&demo_request(1, 7, vec![1, 2, 19_999])).unwrap();
    assert_eq!((r.status, r.features_missing, r.features_stale), (Status::Ok, 0, false));

    let stop = Arc::new(AtomicBool::new(false));
    let (scoring, scored) = scorer(&server, stop.clone(), 20_000);
    let p = updater(p, 20_000, 5000, 1, Some(scored.clone())).join().unwrap();
    wait_caught_up(&server, &mut conn, layout);
    stop.store(true, Ordering::Relaxed);
    scoring.join().unwrap();
    assert!(scored.load(Ordering::Relaxed) >= 5);
    assert_replica_equals_source(&dir, "item", layout, 20_000, &mut conn);
    let resyncs_before = group(&server.stats(), "item").resyncs;

    // A new epoch in one bucket: that bucket alone is copied again.
    conn.command(&[b"SET", layout.keys("item", 2).epoch.as_bytes(), b"1"]).unwrap();
    let until = Instant::now() + common::WAIT;
    while group(&server.stats(), "item").resyncs == resyncs_before {
        assert!(Instant::now() < until, "no resync after the epoch change: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(group(&server.stats(), "item").resyncs, resyncs_before + 1, "one bucket, one resync");
    let log = server.wait_stderr("full resync");
    assert!(log.contains("item/2"), "{log}");
    assert_eq!(log.matches("full resync").count(), 1, "no other bucket was copied: {log}");
    assert_replica_equals_source(&dir, "item", layout, 20_000, &mut conn);
    drop(p);

    // A bucket written with another bucket count is refused, loudly.
    conn.command(&[b"SET", layout.keys("item", 1).buckets.unwrap().as_bytes(), b"8"]).unwrap();
    let until = Instant::now() + common::WAIT;
    while !server.stderr().contains("says the group has 8 buckets, 4 are configured") {
        assert!(Instant::now() < until, "the bucket count mismatch went unreported: {}", server.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_cluster_is_followed_through_a_full_sync_updates_while_scoring_and_a_reshard() {
    let cluster = RedisCluster::start(3, 0);
    let seeds = cluster.seeds();
    let url = format!("redis+cluster://{}", seeds.join(","));
    let conn = || ClusterConn::connect(&cluster.config(), &seeds).unwrap();
    let mut p = Publisher::cluster(conn(), 16).unwrap();
    let layout = p.layout();
    put(&mut p, "item", 0..100_000, 0);
    put(&mut p, "user", 0..1000, 0);
    let dir = models_only_dir("cluster-feed");
    let server = serve(&dir, &url, "");
    let mut c = conn();
    wait_caught_up(&server, &mut c, layout);
    assert_eq!(assert_replica_equals_source(&dir, "item", layout, 100_000, &mut c), 100_000);
    assert_eq!(assert_replica_equals_source(&dir, "user", layout, 1000, &mut c), 1000);

    // 10,000 updates while scoring.
    let stop = Arc::new(AtomicBool::new(false));
    let (scoring, scored) = scorer(&server, stop.clone(), 100_000);
    let p = updater(p, 100_000, 10_000, 1, Some(scored.clone())).join().unwrap();
    wait_caught_up(&server, &mut c, layout);
    assert_replica_equals_source(&dir, "item", layout, 100_000, &mut c);

    // A quarter of the slots move from one master to another while updates flow.
    let masters: Vec<String> = c.topology().masters().into_iter().map(String::from).collect();
    let updates = updater(p, 100_000, 10_000, 2, Some(scored.clone()));
    cluster.reshard(&masters[0], &masters[1], 4096);
    updates.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    scoring.join().unwrap();
    assert!(scored.load(Ordering::Relaxed) >= 20, "scored throughout");
    let mut c = conn();
    assert_ne!(
        c.topology().ranges().iter().filter(|r| r.master == masters[0]).map(|r| r.end - r.start + 1).sum::<u16>(),
        5461,
        "the slots moved"
    );
    let s = wait_caught_up(&server, &mut c, layout);
    assert_replica_equals_source(&dir, "item", layout, 100_000, &mut c);
    assert!(!group(&s, "item").resync_held);
    assert!(!server.stderr().contains("full resync"), "a reshard needs no resync: {}", server.stderr());
}

#[test]
fn a_killed_master_is_followed_to_its_promoted_replica_with_nothing_lost() {
    let mut cluster = RedisCluster::start(3, 1);
    let seeds = cluster.seeds();
    let url = format!("redis+cluster://{}", seeds.join(","));
    let config = cluster.config();
    let conn = || ClusterConn::connect(&config, &seeds).unwrap();
    let mut p = Publisher::cluster(conn(), 16).unwrap();
    let layout = p.layout();
    put(&mut p, "item", 0..20_000, 0);
    put(&mut p, "user", 0..1000, 0);
    let dir = models_only_dir("cluster-failover");
    let server = serve(&dir, &url, "");
    let mut c = conn();
    wait_caught_up(&server, &mut c, layout);

    let stop = Arc::new(AtomicBool::new(false));
    let (scoring, scored) = scorer(&server, stop.clone(), 20_000);
    let updates = updater(p, 20_000, 10_000, 1, Some(scored.clone()));
    std::thread::sleep(Duration::from_millis(300));
    let victim = c.topology().masters()[0].to_string();
    cluster.node(&victim).kill();
    updates.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    scoring.join().unwrap();
    assert!(scored.load(Ordering::Relaxed) >= 10, "scored throughout");
    let mut c = conn();
    assert!(!c.topology().masters().contains(&victim.as_str()), "a replica was promoted");
    wait_caught_up(&server, &mut c, layout);
    assert_replica_equals_source(&dir, "item", layout, 20_000, &mut c);
    assert_replica_equals_source(&dir, "user", layout, 1000, &mut c);
}

/// `redis+cluster://` with credentials: the publisher, the first sync (a thread per master)
/// and the stream reads authenticate on every node the topology names, not only the seed;
/// a wrong password is an error at start-up that says so.
#[test]
fn a_cluster_that_asks_for_a_password_is_followed_and_a_wrong_one_is_refused() {
    let cluster = RedisCluster::start_with_password(3, 0, Some("s3cret"));
    let seeds = cluster.seeds();
    let url = format!("redis+cluster://:s3cret@{}", seeds.join(","));
    let conn = || ClusterConn::connect(&cluster.config(), &seeds).unwrap();
    let mut p = Publisher::cluster(conn(), 16).unwrap();
    let layout = p.layout();
    put(&mut p, "item", 0..20_000, 0);
    put(&mut p, "user", 0..1000, 0);
    let dir = models_only_dir("cluster-auth");
    let server = serve(&dir, &url, "");
    let mut c = conn();
    wait_caught_up(&server, &mut c, layout);
    assert_eq!(assert_replica_equals_source(&dir, "item", layout, 20_000, &mut c), 20_000);
    let p = updater(p, 20_000, 2000, 1, None).join().unwrap();
    wait_caught_up(&server, &mut c, layout);
    assert_replica_equals_source(&dir, "item", layout, 20_000, &mut c);
    drop((p, server));

    let mut unauthenticated = cluster.config();
    unauthenticated.password = None;
    assert!(ClusterConn::connect(&unauthenticated, &seeds).is_err(), "no password, no connection");
    let dir = models_only_dir("cluster-badauth");
    let config = dir.join("quiver.toml");
    let url = url.replace("s3cret", "b4d-passw0rd");
    std::fs::write(&config, format!("[feed]\nredis = \"{url}\"\ninitial_sync_timeout_ms = 500\n")).unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--data-dir"])
        .arg(&dir)
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("initial sync") && err.to_lowercase().contains("auth"), "{err}");
    assert!(!err.contains("b4d-passw0rd"), "the password is never printed: {err}");
}

/// `quiver replica sync` with its output: stdout on success, stderr on failure.
fn sync_cli(url: &str, out: &Path, extra: &[&str]) -> Result<String, String> {
    let run = std::process::Command::new(common::BIN)
        .args(["replica", "sync", "--redis", url, "--group", "item", "--dim", "32", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    match run.status.success() {
        true => Ok(String::from_utf8_lossy(&run.stdout).into_owned()),
        false => Err(String::from_utf8_lossy(&run.stderr).into_owned()),
    }
}

fn replica_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("item"))
        .collect();
    names.sort();
    names
}

/// The one-off copy of a bucketed group: every bucket from its master on a cluster (and a
/// server started on those files follows on from their positions, with no full sync), or
/// from one node; a wrong bucket count, or none for a bucketed group, is refused and
/// leaves no file behind.
#[test]
fn quiver_replica_sync_copies_every_bucket_from_a_cluster_or_one_node() {
    let cluster = RedisCluster::start(3, 0);
    let seeds = cluster.seeds();
    let url = format!("redis+cluster://{}", seeds.join(","));
    let conn = || ClusterConn::connect(&cluster.config(), &seeds).unwrap();
    let mut p = Publisher::cluster(conn(), 16).unwrap();
    let layout = p.layout();
    put(&mut p, "item", 0..30_000, 0);
    let gone: Vec<u64> = (0..30_000).step_by(7).collect();
    p.delete_many("item", &gone, |_, _| {}).unwrap();
    put(&mut p, "user", 0..1000, 0);
    let dir = models_only_dir("cli-sync-cluster");
    let stdout = sync_cli(&url, &dir.join("item.qrep"), &[]).unwrap();
    let live = 30_000 - gone.len() as u64;
    assert!(stdout.contains(&format!("synced {live} entities of group item into 16 files")), "{stdout}");
    assert_eq!(replica_files(&dir).len(), 16, "{:?}", replica_files(&dir));
    let mut c = conn();
    assert_eq!(assert_replica_equals_source(&dir, "item", layout, 30_000, &mut c), live);

    // Changes after the copy reach a server started on its files from their positions.
    put(&mut p, "item", 0..500, 1);
    let server = serve(&dir, &url, "");
    wait_caught_up(&server, &mut c, layout);
    assert_replica_equals_source(&dir, "item", layout, 30_000, &mut c);
    let log = server.stderr();
    assert_eq!(log.matches("replica opened").count(), 16, "every item bucket's file was opened: {log}");
    assert!(!log.contains("full resync"), "{log}");
    drop(server);

    // One node, four buckets.
    let redis = RedisServer::start();
    let four = Layout::bucketed(4).unwrap();
    let mut p = Publisher::new(redis.conn()).unwrap().with_layout(four).unwrap();
    put(&mut p, "item", 0..5000, 0);
    let dir = models_only_dir("cli-sync-node");
    let stdout = sync_cli(&redis.url(), &dir.join("item.qrep"), &["--buckets", "4"]).unwrap();
    assert!(stdout.contains("synced 5000 entities of group item into 4 files"), "{stdout}");
    assert_eq!(assert_replica_equals_source(&dir, "item", four, 5000, &mut redis.conn()), 5000);

    // Another count, or none: refused, and nothing written.
    let empty = models_only_dir("cli-sync-refused");
    let err = sync_cli(&redis.url(), &empty.join("item.qrep"), &["--buckets", "8"]).unwrap_err();
    assert!(err.contains("says the group has 4 buckets, 8 are configured"), "{err}");
    let err = sync_cli(&redis.url(), &empty.join("item.qrep"), &[]).unwrap_err();
    assert!(err.contains("stored in 4 buckets: give that bucket count"), "{err}");
    assert_eq!(replica_files(&empty), Vec::<String>::new(), "no file, not even a temporary one");
}
