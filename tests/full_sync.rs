//! One full copy of a group (`feed::sync::full_sync`) against a real Redis,
//! over one connection and over several in parallel: the copy equals Redis
//! byte for byte, keys deleted while it runs are ignored, bad data is
//! skipped and counted, and a connection that dies or a server that stops
//! answering fails the copy with an error, promptly, with no thread left.
//!
//! Tests here run one at a time (`SERIAL`): the last one counts the copy's
//! threads in this process, which another test's copy would disturb.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::redis::{redis_entities, RedisServer};
use common::scratch;
use quiver::features::feed::contract::{self, Part};
use quiver::features::feed::sync::{full_sync, RefreshError, SyncTarget};
use quiver::features::feed::{GroupStatus, RedisConn, RedisError, Reply};
use quiver::features::replica::{Replica, ReplicaWriter, Storage};

const DIM: usize = 32;
const EPOCH: u64 = 1_700_000_000_123_456;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn value(id: u64) -> Vec<u8> {
    let v: Vec<f32> = (0..DIM).map(|i| ((id * 7919 + i as u64 * 31) % 100_003) as f32 / 1000.0 - 50.0).collect();
    contract::encode_vector(&v)
}

/// Writes `group:{id}` for `ids` straight with MSET (the copy reads keys, not
/// the stream, so the publish script is not needed), and the group's epoch
/// and counter as the contract names them.
fn load(conn: &mut RedisConn, group: &str, ids: impl Iterator<Item = u64>, seq: u64) {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(2000) {
        let mut mset = vec![b"MSET".to_vec()];
        for &id in chunk {
            mset.push(contract::entity_key(group, id).into_bytes());
            mset.push(value(id));
        }
        assert_eq!(conn.pipeline(&[mset]).unwrap(), vec![Reply::Simple(b"OK".to_vec())]);
    }
    let (epoch, seq) = (EPOCH.to_string(), seq.to_string());
    conn.command(&[b"SET", contract::epoch_key(group).as_bytes(), epoch.as_bytes()]).unwrap();
    conn.command(&[b"SET", contract::seq_key(group).as_bytes(), seq.as_bytes()]).unwrap();
}

/// Every row of the replica file at `path`, by id, as little-endian bytes.
fn replica_rows(path: &Path, group: &str, ids: impl Iterator<Item = u64>) -> HashMap<u64, Vec<u8>> {
    let r = Replica::open(path, group).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = vec![0.0f32; r.dim()];
    let mut rows = HashMap::new();
    for id in ids {
        if r.read_into(id, &mut out) {
            rows.insert(id, contract::encode_vector(&out));
        }
    }
    rows
}

fn target<'a>(
    part: &'a Part,
    path: &'a Path,
    default: &'a [f32],
    connections: usize,
    batch_keys_max: usize,
) -> SyncTarget<'a> {
    SyncTarget { part, path, dim: DIM, storage: Storage::F32, default, batch_keys_max, connections }
}

/// Runs one copy and renames it to `path`.
fn copy(
    redis: &RedisServer,
    path: &Path,
    connections: usize,
    batch_keys_max: usize,
    status: Option<&GroupStatus>,
    progress: &mut dyn FnMut(u64),
) -> Result<ReplicaWriter, RefreshError> {
    let default = [0.0f32; DIM];
    let part = Part::plain("item");
    let t = target(&part, path, &default, connections, batch_keys_max);
    let mut fresh = full_sync(&mut redis.conn(), &redis.config(), &t, status, progress)?;
    fresh.rename_to(path).unwrap();
    Ok(fresh)
}

/// A replica path in a scratch directory that is removed with it: the copies
/// here are tens of MB each.
struct Out(PathBuf);

impl Out {
    fn new(name: &str) -> Out {
        Out(scratch(name).join("item.qrep"))
    }
}

impl Drop for Out {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Names of this process's threads that belong to a full sync.
fn sync_threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .filter(|name| name.starts_with("quiver-sync"))
        .collect()
}

#[test]
fn copies_over_one_or_many_connections_equal_redis_byte_for_byte() {
    let _serial = serial();
    const N: u64 = 150_000;
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    load(&mut conn, "item", 0..N, 4242);
    // Another group's keys in the same database are not this group's rows.
    load(&mut conn, "user", 0..5000, 7);
    let want = redis_entities(&mut conn, "item");
    assert_eq!(want.len(), N as usize);
    for (connections, batch_keys_max) in [(1, 1000), (2, 100), (4, 1000), (16, 37)] {
        let out = Out::new(&format!("sync-equal-{connections}"));
        let path = &out.0;
        let mut progressed = Vec::new();
        let status = GroupStatus::new("item", 0);
        let fresh =
            copy(&redis, path, connections, batch_keys_max, Some(&status), &mut |rows| progressed.push(rows)).unwrap();
        let cursor = fresh.cursor();
        assert_eq!((cursor.epoch, cursor.seq), (EPOCH, 4242), "checkpointed at the position noted first");
        assert_eq!(fresh.live_rows(), N, "{connections} connections");
        drop(fresh);
        assert_eq!(
            replica_rows(path, "item", 0..N + 10),
            want,
            "{connections} connections, batches of {batch_keys_max}"
        );
        assert!(progressed.windows(2).all(|w| w[0] < w[1]), "progress only advances");
        assert_eq!(progressed.last(), Some(&N));
        assert!(progressed.len() as u64 >= N / batch_keys_max as u64, "progress after every batch");
        assert_eq!(status.sync_rows.load(Ordering::Relaxed), N);
        assert_eq!(status.skipped_total.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn keys_deleted_during_the_copy_are_ignored_not_counted_as_bad_data() {
    let _serial = serial();
    const N: u64 = 120_000;
    let redis = RedisServer::start();
    load(&mut redis.conn(), "item", 0..N, 10);
    for connections in [1, 4] {
        let mut writer = redis.conn();
        // Whatever is left over from the previous round is loaded again.
        load(&mut writer, "item", 0..N, 10);
        let deleted: BTreeSet<u64> = (0..N).filter(|id| id % 3 == 0).collect();
        let mut deleting = Some(deleted.iter().copied().collect::<Vec<u64>>());
        let status = GroupStatus::new("item", 0);
        let out = Out::new(&format!("sync-deleted-{connections}"));
        let path = &out.0;
        // The first batch has been inserted: most keys are still to be read.
        let fresh = copy(&redis, path, connections, 100, Some(&status), &mut |_| {
            if let Some(ids) = deleting.take() {
                for chunk in ids.chunks(1000) {
                    let mut del = vec![b"DEL".to_vec()];
                    del.extend(chunk.iter().map(|&id| contract::entity_key("item", id).into_bytes()));
                    writer.pipeline(&[del]).unwrap();
                }
            }
        })
        .unwrap();
        let rows = fresh.live_rows();
        drop(fresh);
        assert!(deleting.is_none(), "the deletion ran during the copy");
        assert_eq!(status.skipped_total.load(Ordering::Relaxed), 0, "a deleted key is not bad data");
        let got = replica_rows(path, "item", 0..N);
        assert_eq!(got.len() as u64, rows);
        for id in (0..N).filter(|id| !deleted.contains(id)) {
            assert_eq!(got.get(&id), Some(&value(id)), "{connections} connections: item:{id} kept its value");
        }
        let copied_deleted = got.keys().filter(|id| deleted.contains(id)).count();
        assert!(copied_deleted < deleted.len() / 2, "most deleted keys were read after the deletion: {copied_deleted}");
    }
}

#[test]
fn bad_data_is_skipped_and_counted_over_one_or_many_connections() {
    let _serial = serial();
    const N: u64 = 20_000;
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    load(&mut conn, "item", 0..N, 3);
    let inf = contract::encode_vector(&[f32::INFINITY; DIM]);
    let good = value(1);
    for (key, bytes) in
        [(&b"item:abc"[..], &good[..]), (b"item:0042", &good), (b"item:900001", &good[..64]), (b"item:900002", &inf)]
    {
        conn.command(&[b"SET", key, bytes]).unwrap();
    }
    conn.command(&[b"RPUSH", b"item:900003", b"not a string"]).unwrap();
    conn.command(&[b"HSET", b"item:900004", b"f", b"v"]).unwrap();
    for connections in [1, 3] {
        let status = GroupStatus::new("item", 0);
        let out = Out::new(&format!("sync-bad-{connections}"));
        let path = &out.0;
        let fresh = copy(&redis, path, connections, 500, Some(&status), &mut |_| {}).unwrap();
        assert_eq!(fresh.live_rows(), N, "{connections} connections: only the good rows");
        assert_eq!(status.skipped_total.load(Ordering::Relaxed), 6, "{connections} connections");
    }
}

#[test]
fn a_connection_killed_or_a_server_stopped_mid_copy_fails_it_promptly_with_no_thread_left() {
    let _serial = serial();
    const N: u64 = 200_000;
    let mut redis = RedisServer::start();
    load(&mut redis.conn(), "item", 0..N, 1);
    // Kill the connection that last ran the named command: a fetcher's
    // (MGET) or the scanner's (SCAN), the caller's own connection.
    for command in ["mget", "scan"] {
        let mut admin = redis.conn();
        let mut killed = None;
        let out = Out::new(&format!("sync-killed-{command}"));
        let path = &out.0;
        let started = Instant::now();
        let result = copy(&redis, path, 4, 100, None, &mut |_| {
            if killed.is_some() {
                return;
            }
            let list = admin.command(&[b"CLIENT", b"LIST"]).unwrap().into_bytes().unwrap();
            let list = String::from_utf8(list).unwrap();
            let id = list
                .lines()
                .find(|l| l.split(' ').any(|f| f == format!("cmd={command}")))
                .and_then(|l| l.split(' ').find_map(|f| f.strip_prefix("id=")))
                .map(str::to_string);
            if let Some(id) = id {
                admin.command(&[b"CLIENT", b"KILL", b"ID", id.as_bytes()]).unwrap();
                killed = Some(id);
            }
        });
        let elapsed = started.elapsed();
        assert!(killed.is_some(), "no connection ran {command} during the copy");
        match result {
            Err(RefreshError::Redis(RedisError::Closed { .. } | RedisError::Io { .. })) => {}
            Err(other) => panic!("killing the {command} connection: {other}"),
            Ok(w) => panic!("killing the {command} connection: a copy of {} rows", w.live_rows()),
        }
        assert!(elapsed < Duration::from_secs(10), "{command}: the error took {elapsed:?}");
        assert_eq!(sync_threads(), Vec::<String>::new(), "threads left after the failed copy");
    }

    // A server that stops answering: every connection times out.
    let mut config = redis.config();
    config.io_timeout_ms = 300;
    let mut paused = false;
    let out = Out::new("sync-paused");
    let path = &out.0;
    let default = [0.0f32; DIM];
    let part = Part::plain("item");
    let t = target(&part, path, &default, 4, 100);
    let started = Instant::now();
    let mut conn = RedisConn::connect(&config).unwrap();
    let result = full_sync(&mut conn, &config, &t, None, &mut |_| {
        if !paused {
            redis.pause();
            paused = true;
        }
    });
    let elapsed = started.elapsed();
    redis.resume();
    assert!(paused);
    assert!(matches!(result, Err(RefreshError::Redis(RedisError::Timeout { .. }))), "{:?}", result.err());
    assert!(elapsed < Duration::from_secs(5), "the timeout took {elapsed:?}");
    assert_eq!(sync_threads(), Vec::<String>::new(), "threads left after the timed-out copy");
}
