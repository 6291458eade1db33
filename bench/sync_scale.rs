//! Full sync from Redis at scale (issue 19): entities per second of
//! `feed::sync::full_sync` over one connection and over several, side by
//! side in one run, at 1M, 10M and 20M entities x 32 dims f32, and where the
//! time goes.
//!
//! Starts its own `redis-server` (no persistence), loads the group's keys
//! the way the contract stores them (`item:{id}` = 128 bytes of f32, and
//! the epoch and counter keys; the copy does not read the stream) with
//! pipelined MSETs, growing the same keyspace from one size to the next.
//! Each copy writes a fresh replica file in `--dir`, as a resync does, and
//! is then removed. A size that does not fit in `MemAvailable` with 4 GB to
//! spare is skipped with the reason logged.
//!
//! Per copy it records wall time, the time until the last row was inserted
//! (the rest is the final checkpoint's msync), and CPU seconds: Redis's
//! (from /proc), this process's, and the inserting (calling) thread's, so
//! a copy bound by Redis's one thread, by the fetchers' decoding or by the
//! replica's one writer shows which. The machine's busy cores over the copy
//! say how much other load shared it. Per size it also times the writer
//! alone inserting the same rows from memory: the copy's ceiling.
//!
//!     cargo bench --bench sync_scale [-- --entities 1000000,10000000 --connections 1,4,8
//!                                      --repeats 3 --repeats-big 1 --dir PATH]
//!
//! `--repeats` applies to sizes up to 1M, `--repeats-big` to larger ones.
//! Each line of output is one JSON object; `bench/report.py` renders them.

#[path = "../tests/common/redis.rs"]
#[allow(dead_code)]
mod redis;

use std::path::{Path, PathBuf};
use std::time::Instant;

use quiver::features::feed::sync::{full_sync, SyncTarget};
use quiver::features::feed::{contract, RedisConn, Reply};
use quiver::features::replica::{mem_available_bytes, Cursor, ReplicaWriter, Storage};
use redis::RedisServer;

const DIM: usize = 32;
const GROUP: &str = "item";
/// Keys per MSET, and MSETs per pipelined round trip, while loading.
const LOAD_KEYS_PER_MSET: usize = 1000;
const LOAD_MSETS_PER_ROUND_TRIP: usize = 16;
/// Memory a size leaves free, or it is skipped.
const SPARE_BYTES: u64 = 4 << 30;
/// Redis's memory per key before any is loaded to measure it (jemalloc
/// bins for the 128-byte value, key, dict entry and bucket, rounded up).
const REDIS_BYTES_PER_KEY_GUESS: u64 = 300;
const BATCH_KEYS: usize = 1000;

struct Args {
    entities: Vec<u64>,
    connections: Vec<usize>,
    repeats: usize,
    repeats_big: usize,
    dir: PathBuf,
}

fn parse_args() -> Args {
    let mut a = Args {
        entities: vec![1_000_000, 10_000_000, 20_000_000],
        connections: vec![1, 4, 8],
        repeats: 3,
        repeats_big: 1,
        dir: std::env::temp_dir().join("quiver-sync-scale"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--entities" => a.entities = value().split(',').map(|s| s.parse().expect("entity count")).collect(),
            "--connections" => {
                a.connections = value().split(',').map(|s| s.parse().expect("connection count")).collect()
            }
            "--repeats" => a.repeats = value().parse().expect("repeats"),
            "--repeats-big" => a.repeats_big = value().parse().expect("repeats"),
            "--dir" => a.dir = value().into(),
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    a.entities.sort_unstable();
    a
}

/// The vector of entity `id`: cheap, deterministic, finite, distinct per id.
fn vector(id: u64, out: &mut [f32]) {
    for (i, x) in out.iter_mut().enumerate() {
        *x = ((id.wrapping_mul(2_654_435_761).wrapping_add(i as u64 * 97)) % 10_007) as f32 / 10_007.0;
    }
}

/// Writes entities `from..to` and the group's epoch and counter.
fn load(conn: &mut RedisConn, from: u64, to: u64) {
    let mut v = vec![0f32; DIM];
    let mut id = from;
    while id < to {
        let mut round_trip = Vec::with_capacity(LOAD_MSETS_PER_ROUND_TRIP);
        while id < to && round_trip.len() < LOAD_MSETS_PER_ROUND_TRIP {
            let end = to.min(id + LOAD_KEYS_PER_MSET as u64);
            let mut mset = Vec::with_capacity(1 + 2 * LOAD_KEYS_PER_MSET);
            mset.push(b"MSET".to_vec());
            for i in id..end {
                vector(i, &mut v);
                mset.push(contract::entity_key(GROUP, i).into_bytes());
                mset.push(contract::encode_vector(&v));
            }
            round_trip.push(mset);
            id = end;
        }
        for reply in conn.pipeline(&round_trip).expect("load") {
            assert_eq!(reply, Reply::Simple(b"OK".to_vec()), "MSET");
        }
    }
    let seq = to.to_string();
    conn.command(&[b"SET", contract::epoch_key(GROUP).as_bytes(), b"1700000000000001"]).expect("epoch");
    conn.command(&[b"SET", contract::seq_key(GROUP).as_bytes(), seq.as_bytes()]).expect("counter");
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf only reads a constant of the system.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) as f64 }
}

/// User and system CPU seconds of process `pid`, from /proc.
fn process_cpu_s(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("redis stat");
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks = |i: usize| fields[i].parse::<u64>().expect("a tick count") as f64 / clock_ticks_per_s();
    (ticks(11), ticks(12))
}

/// Redis's user and system CPU seconds while `work` runs, and its wall time.
fn redis_cost(redis: &RedisServer, work: impl FnOnce()) -> (f64, f64, f64) {
    let pid = redis.pid().expect("redis runs");
    let before = process_cpu_s(pid);
    let started = Instant::now();
    work();
    let wall_s = started.elapsed().as_secs_f64();
    let after = process_cpu_s(pid);
    (after.0 - before.0, after.1 - before.1, wall_s)
}

/// What Redis's one thread spends per key on each half of a copy, with
/// nothing else done with the replies: SCAN alone over the keyspace, then
/// MGET alone of the keys it returned, in batches like the copy's.
fn redis_alone(redis: &RedisServer, n: u64) -> Vec<serde_json::Value> {
    let mut conn = redis.conn();
    let mut keys = Vec::with_capacity(n as usize);
    let pattern = format!("{GROUP}:*");
    let count = BATCH_KEYS.to_string();
    let scan = redis_cost(redis, || {
        let mut cursor = b"0".to_vec();
        loop {
            let reply = conn
                .command(&[b"SCAN", &cursor, b"MATCH", pattern.as_bytes(), b"COUNT", count.as_bytes()])
                .expect("SCAN");
            let mut parts = reply.into_array().expect("SCAN reply").into_iter();
            cursor = parts.next().and_then(Reply::into_bytes).expect("cursor");
            keys.extend(
                parts.next().and_then(Reply::into_array).expect("keys").into_iter().filter_map(Reply::into_bytes),
            );
            if cursor == b"0" {
                break;
            }
        }
    });
    let mget = redis_cost(redis, || {
        for batch in keys.chunks(BATCH_KEYS) {
            let mut args: Vec<&[u8]> = vec![b"MGET"];
            args.extend(batch.iter().map(Vec::as_slice));
            conn.command(&args).expect("MGET");
        }
    });
    [("redis SCAN alone", scan), ("redis MGET alone", mget)]
        .into_iter()
        .map(|(case, (user_s, sys_s, wall_s))| {
            serde_json::json!({
                "case": case, "entities": n, "batch_keys": BATCH_KEYS, "wall_s": wall_s,
                "redis_user_cpu_s": user_s, "redis_sys_cpu_s": sys_s,
            })
        })
        .collect()
}

fn rusage_s(who: libc::c_int) -> f64 {
    // SAFETY: getrusage writes into the struct it is given.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(who, &mut r) }, 0, "getrusage");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(r.ru_utime) + tv(r.ru_stime)
}

/// The machine's busy and total CPU ticks so far, from /proc/stat.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let cpu: Vec<u64> =
        stat.lines().next().expect("cpu line").split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    let idle = cpu[3] + cpu.get(4).copied().unwrap_or(0);
    let total: u64 = cpu.iter().take(8).sum();
    (total - idle, total)
}

/// Redis's `used_memory`, bytes.
fn redis_used_bytes(conn: &mut RedisConn) -> u64 {
    let info = conn.command(&[b"INFO", b"memory"]).expect("INFO").into_bytes().expect("INFO text");
    String::from_utf8_lossy(&info)
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory")
}

/// The bytes of a replica file of `n` f32 rows (row header 16 bytes, index
/// slots of 16 bytes, at least twice the rows, a power of two).
fn replica_bytes(n: u64) -> u64 {
    n * (16 + DIM as u64 * 4) + (2 * n).next_power_of_two() * 16
}

fn one_copy(redis: &RedisServer, dir: &Path, n: u64, connections: usize, run: usize) -> serde_json::Value {
    let path = dir.join(format!("{GROUP}-{n}.qrep"));
    let default = [0f32; DIM];
    let part = quiver::features::feed::contract::Part::plain(GROUP);
    let target = SyncTarget {
        part: &part,
        path: &path,
        dim: DIM,
        storage: Storage::F32,
        default: &default,
        batch_keys_max: BATCH_KEYS,
        connections,
    };
    let redis_pid = redis.pid().expect("redis runs");
    let mut conn = redis.conn();
    let (redis_cpu, self_cpu, thread_cpu, machine) =
        (process_cpu_s(redis_pid), rusage_s(libc::RUSAGE_SELF), rusage_s(libc::RUSAGE_THREAD), machine_ticks());
    let started = Instant::now();
    let mut last_row_s = 0.0;
    let fresh =
        full_sync(&mut conn, &redis.config(), &target, None, &mut |_| last_row_s = started.elapsed().as_secs_f64())
            .expect("full sync");
    let wall_s = started.elapsed().as_secs_f64();
    let redis_after = process_cpu_s(redis_pid);
    let (redis_user, redis_sys, self_cpu, thread_cpu) = (
        redis_after.0 - redis_cpu.0,
        redis_after.1 - redis_cpu.1,
        rusage_s(libc::RUSAGE_SELF) - self_cpu,
        rusage_s(libc::RUSAGE_THREAD) - thread_cpu,
    );
    let (busy, total) = machine_ticks();
    let machine_busy_cores = (busy - machine.0) as f64 / ((total - machine.1) as f64 / num_cores() as f64).max(1.0);
    let rows = fresh.live_rows();
    assert_eq!(rows, n, "the copy holds every entity");
    fresh.discard();
    serde_json::json!({
        "case": "copy", "entities": n, "dim": DIM, "connections": connections, "run": run,
        "batch_keys": BATCH_KEYS, "wall_s": wall_s, "last_row_s": last_row_s,
        "entities_per_s": n as f64 / wall_s,
        "redis_user_cpu_s": redis_user, "redis_sys_cpu_s": redis_sys, "client_cpu_s": self_cpu, "inserter_cpu_s": thread_cpu,
        "machine_busy_cores": machine_busy_cores,
    })
}

fn num_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The replica's one writer inserting `n` rows from memory into a fresh
/// file sized as a full sync sizes it, then checkpointing: the most a copy
/// can reach, whatever Redis does.
fn writer_only(dir: &Path, n: u64, capacity: u64) -> serde_json::Value {
    let path = dir.join(format!("{GROUP}-{n}-writer.qrep"));
    let default = [0f32; DIM];
    let mut v = vec![0f32; DIM];
    let started = Instant::now();
    let mut w = ReplicaWriter::create(&path, GROUP, DIM as u32, Storage::F32, capacity, &default).expect("create");
    for id in 0..n {
        vector(id, &mut v);
        w.upsert(id, &v).expect("upsert");
    }
    let inserted_s = started.elapsed().as_secs_f64();
    w.checkpoint(Cursor { epoch: 1, seq: n, change_unix_ms: 0 }).expect("checkpoint");
    let wall_s = started.elapsed().as_secs_f64();
    w.discard();
    serde_json::json!({
        "case": "writer only", "entities": n, "dim": DIM, "wall_s": wall_s, "last_row_s": inserted_s,
        "entities_per_s": n as f64 / wall_s,
    })
}

fn main() {
    let args = parse_args();
    std::fs::create_dir_all(&args.dir).expect("bench directory");
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let mut loaded = 0u64;
    let mut redis_bytes_per_key = REDIS_BYTES_PER_KEY_GUESS as f64;
    for &n in &args.entities {
        let redis_more = ((n - loaded) as f64 * redis_bytes_per_key) as u64;
        let needed = redis_more + replica_bytes(n) + SPARE_BYTES;
        let available = mem_available_bytes().unwrap_or(0);
        if needed > available {
            let why = format!(
                "needs {:.1} GB ({:.1} GB more for Redis, {:.1} GB of replica file, 4 GB spare), {:.1} GB available",
                needed as f64 / 1e9,
                redis_more as f64 / 1e9,
                replica_bytes(n) as f64 / 1e9,
                available as f64 / 1e9
            );
            eprintln!("sync_scale: skipping {n} entities: {why}");
            println!("{}", serde_json::json!({"case": "skipped", "entities": n, "why": why}));
            continue;
        }
        let t = Instant::now();
        load(&mut conn, loaded, n);
        let load_s = t.elapsed().as_secs_f64();
        loaded = n;
        let used = redis_used_bytes(&mut conn);
        redis_bytes_per_key = used as f64 / n as f64;
        println!(
            "{}",
            serde_json::json!({"case": "loaded", "entities": n, "load_s": load_s, "redis_used_bytes": used})
        );
        let dbsize = conn.command(&[b"DBSIZE"]).expect("DBSIZE").as_int().expect("an integer") as u64;
        println!("{}", writer_only(&args.dir, n, dbsize));
        for line in redis_alone(&redis, n) {
            println!("{line}");
        }
        let repeats = if n <= 1_000_000 { args.repeats } else { args.repeats_big };
        // Interleaved, so that a change in the machine's other load falls on
        // every connection count alike.
        for run in 0..repeats {
            for &connections in &args.connections {
                println!("{}", one_copy(&redis, &args.dir, n, connections, run));
            }
        }
    }
}
