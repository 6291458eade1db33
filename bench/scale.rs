//! Replica scale curves: how build time, file size, memory, restart time,
//! lookup latency and growth grow with the number of entities (issue 19).
//!
//! For each entity count (`--entities`, default 1M, 10M and 50M) and each
//! storage (`--storage`, default f32 and f16), with 32 dimensions:
//! - build: a fresh file sized for the count, every row written through
//!   the one writer (`ReplicaWriter`), then checkpointed (rows/s, seconds);
//! - size: file bytes, bytes per entity, resident bytes after the build;
//! - restart, as the server runs it at start-up, with the file in the page
//!   cache and again after its pages were evicted (`posix_fadvise(DONTNEED)`),
//!   as after a reboot: `ReplicaWriter::open_deferred` (the time until the
//!   first request can be served), the first request's lookup straight
//!   after it, then `finish_open` (the background scan that checks every
//!   slot and row) timed while a reader thread looks rows up through the
//!   group's handle, as shards do meanwhile;
//! - lookups of one request's rows (one user plus 32 items, through
//!   `read_many_into`, as the request path does): ids uniform over the whole
//!   population (every row a cache and TLB miss: "cold"), Zipf(1.1) ids
//!   (a realistic hot set), and the same 33 ids again and again ("warm").
//!   These run on a file opened read-only and fully verified, so they never
//!   wait for the disk; each kind runs in 5 batches interleaved with the
//!   others, and the median of the batches' p99s is reported beside the p99
//!   of all of them;
//! - steady updates, as the refresher applies a busy stream: 10,000
//!   updates/s to ids uniform over the population for 20 s, in rounds of
//!   10 ms on a fixed schedule, the position checkpointed every 200 ms by a
//!   flusher thread (as the refresher's is); every round's time, every
//!   checkpoint's time, and the bytes this process sent to the disk
//!   (`/proc/self/io` `write_bytes`: the checkpoints' msync) per second
//!   and per update. The file is opened (and verified) first;
//! - growth, as the refresher runs it: the full file grows in the background
//!   (a thread rehashes every row into a file twice the size) while the
//!   refresher's loop keeps applying changes (rounds of 100 updates, then a
//!   poll, which replays a bounded slice of the keys changed during the copy
//!   into the new file and swaps it in when none is left); timed start to swap, with every round's time (the longest is
//!   the refresher's pause), while a reader thread keeps looking up rows
//!   through the group's handle, before the growth and during it; what
//!   held the reader and the refresher back meanwhile (their page faults
//!   and context switches, from `getrusage`) and the machine's reclaim
//!   counters (`/proc/vmstat`). Growth is skipped where the two files would not fit in memory.
//!
//! Each case prints one JSON line; `bench/report.py` renders them.
//!
//!     cargo bench --bench scale [-- --entities 1000000,10000000 --storage f32,f16 --dir PATH --lookups N
//!                                  --huge-pages on|off]
//!
//! `--huge-pages on` maps files of 32 MiB or more with `MADV_HUGEPAGE`
//! (`replica_huge_pages = true`), so their page cache is in 2 MiB folios;
//! off (the server's default) leaves small folios.
//!
//! Seeded: ids and values are deterministic functions of the seed.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use quiver::features::replica::{mem_available_bytes, Cursor, GrowthPhase, Replica, ReplicaWriter, Storage};
use quiver::seeded::SplitMix64;

const DIM: usize = 32;
const ITEMS_PER_REQUEST: usize = 32;
/// Stream changes the growth step applies per refresher round.
const CHANGES_PER_ROUND: u64 = 100;
const SEED: u64 = 19;
/// The steady step's stream: updates per second, for how long, in rounds of
/// how long, checkpointed how often (the refresher's default interval).
const STEADY_UPDATES_PER_S: u64 = 10_000;
const STEADY_S: u64 = 20;
const STEADY_ROUND_MS: u64 = 10;
const STEADY_CHECKPOINT_MS: u64 = 200;
/// Zipf exponent of the "zipf" lookups, as the load asks for.
const ZIPF_S: f64 = 1.1;

struct Args {
    huge_pages: bool,
    entities: Vec<u64>,
    storages: Vec<Storage>,
    dir: PathBuf,
    lookups: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        huge_pages: false,
        entities: vec![1_000_000, 10_000_000, 50_000_000],
        storages: vec![Storage::F32, Storage::F16],
        dir: std::env::temp_dir().join("quiver-scale"),
        lookups: 200_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--entities" => a.entities = value().split(',').map(|s| s.parse().expect("entity count")).collect(),
            "--storage" => {
                a.storages = value().split(',').map(|s| Storage::parse(s).expect("f32, f16 or int8")).collect()
            }
            "--dir" => a.dir = value().into(),
            "--lookups" => a.lookups = value().parse().expect("lookup count"),
            "--huge-pages" => a.huge_pages = value() == "on",
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// The vector of entity `id`: cheap, deterministic, distinct per id.
fn vector(id: u64, out: &mut [f32]) {
    for (i, x) in out.iter_mut().enumerate() {
        *x = ((id.wrapping_mul(2_654_435_761).wrapping_add(i as u64 * 97)) % 10_007) as f32 / 10_007.0;
    }
}

/// Zipf(s) ranks over 1..=n by inverting the continuous approximation of
/// the distribution's CDF; ranks are scattered over ids by an odd multiplier
/// so the hot set is not the first rows of the file.
struct Zipf {
    n: u64,
    h_n: f64,
}

impl Zipf {
    fn new(n: u64) -> Zipf {
        Zipf { n, h_n: ((n as f64).powf(1.0 - ZIPF_S) - 1.0) / (1.0 - ZIPF_S) }
    }

    fn sample(&self, rng: &mut SplitMix64) -> u64 {
        let u = rng.unit() * self.h_n;
        let x = (1.0 + (1.0 - ZIPF_S) * u).powf(1.0 / (1.0 - ZIPF_S));
        let rank = (x as u64).clamp(1, self.n) - 1;
        rank.wrapping_mul(0x9E37_79B9_7F4A_7C15 | 1) % self.n
    }
}

/// Evicts the file's pages (dirty ones are written back first); pages some
/// mapping still holds stay, so call it with the file closed.
fn flush_and_evict(path: &Path) {
    let f = std::fs::File::open(path).expect("replica file");
    f.sync_all().expect("sync");
    // SAFETY: posix_fadvise only advises the kernel about this descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
}

/// Percentiles in ns of `samples` (sorted here).
fn percentiles(samples: &mut [u64]) -> serde_json::Value {
    if samples.is_empty() {
        return serde_json::Value::Null;
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    serde_json::json!({
        "n": samples.len(), "p50_ns": at(0.5), "p99_ns": at(0.99), "p999_ns": at(0.999),
        "max_ns": samples[samples.len() - 1],
    })
}

/// Batches each kind of lookup is split into, interleaved with the other
/// kinds: a burst of other work on this shared VM lands in one batch of one
/// kind, and the median of the batches' p99s leaves it out.
const LOOKUP_BATCHES: usize = 5;

/// Times `n` lookups of one request's rows with ids from `next_id`.
fn time_lookups(r: &Replica, n: usize, mut next_id: impl FnMut() -> u64) -> Vec<u64> {
    let mut keys = [0u64; 1 + ITEMS_PER_REQUEST];
    let mut rows = [0u32; 1 + ITEMS_PER_REQUEST];
    let mut out = vec![0f32; keys.len() * DIM];
    let mut ns = Vec::with_capacity(n);
    let mut missing = 0;
    for _ in 0..n {
        for k in keys.iter_mut() {
            *k = next_id();
        }
        let t = Instant::now();
        missing += r.read_many_into(&keys, &mut rows, &mut out, &mut []);
        ns.push(t.elapsed().as_nanos() as u64);
    }
    assert_eq!(missing, 0, "every id looked up is in the replica");
    ns
}

/// Percentiles of all the batches' lookups together, plus each batch's p99
/// and their median.
fn batched(batches: Vec<Vec<u64>>) -> serde_json::Value {
    let mut p99s: Vec<u64> =
        batches.iter().map(|b| percentiles(&mut b.clone())["p99_ns"].as_u64().expect("a batch's p99")).collect();
    let mut all: Vec<u64> = batches.into_iter().flatten().collect();
    let mut out = percentiles(&mut all);
    out["p99_batches_ns"] = serde_json::json!(p99s.clone());
    p99s.sort_unstable();
    out["p99_median_ns"] = serde_json::json!(p99s[p99s.len() / 2]);
    out
}

fn case(dir: &Path, n: u64, storage: Storage, lookups_n: usize) -> serde_json::Value {
    let path = dir.join(format!("user-{n}-{storage:?}.qrep").to_lowercase());
    let mut v = vec![0f32; DIM];
    let default = vec![0f32; DIM];

    let t = Instant::now();
    let mut w = ReplicaWriter::create(&path, "user", DIM as u32, storage, n, &default).expect("create");
    for id in 0..n {
        vector(id, &mut v);
        w.upsert(id, &v).expect("upsert");
    }
    w.checkpoint(Cursor { epoch: 1, seq: n, change_unix_ms: 0 }).expect("checkpoint");
    let build_s = t.elapsed().as_secs_f64();
    let file_bytes = w.table().file_bytes();
    let resident_after_build = w.table().resident_bytes();
    drop(w);

    let restart_warm = restart(&path, n, false);
    let restart_cold = restart(&path, n, true);

    let r = Replica::open(&path, "user").expect("open read-only");
    let resident_serving = r.resident_bytes();
    let mut uniform_rng = SplitMix64::new(SEED);
    let zipf = Zipf::new(n);
    let mut zipf_rng = SplitMix64::new(SEED + 1);
    let fixed: Vec<u64> = (0..=ITEMS_PER_REQUEST as u64).map(|i| i * (n / 33)).collect();
    let mut i = 0;
    let per_batch = lookups_n.div_ceil(LOOKUP_BATCHES);
    let (mut uniform, mut zipfian, mut warm) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..LOOKUP_BATCHES {
        uniform.push(time_lookups(&r, per_batch, || uniform_rng.below(n)));
        zipfian.push(time_lookups(&r, per_batch, || zipf.sample(&mut zipf_rng)));
        warm.push(time_lookups(&r, per_batch, || {
            i += 1;
            fixed[i % fixed.len()]
        }));
    }
    let (uniform, zipfian, warm) = (batched(uniform), batched(zipfian), batched(warm));
    drop(r);

    let steady = steady(&path, n);
    let growth = grow(&path, n, file_bytes);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(dir.join(format!("user-{n}-{storage:?}.qrep.grow.tmp").to_lowercase()));
    serde_json::json!({
        "entities": n, "dim": DIM, "storage": format!("{storage:?}").to_lowercase(),
        "build_s": build_s, "build_rows_per_s": n as f64 / build_s,
        "file_bytes": file_bytes, "bytes_per_entity": file_bytes as f64 / n as f64,
        "resident_after_build_bytes": resident_after_build, "resident_serving_bytes": resident_serving,
        "restart_warm": restart_warm, "restart_cold": restart_cold,
        "lookup_uniform": uniform, "lookup_zipf": zipfian, "lookup_warm": warm,
        "steady": steady, "growth": growth,
    })
}

/// Bytes this process has caused to be sent to storage so far.
fn write_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines().find_map(|l| l.strip_prefix("write_bytes: ")).and_then(|v| v.parse().ok()).expect("write_bytes")
}

/// The refresher applying a steady stream of updates (see the header).
fn steady(path: &Path, n: u64) -> serde_json::Value {
    let (mut w, _) = ReplicaWriter::open(path, "user").expect("open");
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Arc<Replica>, Cursor)>(1);
    let flusher = std::thread::spawn(move || {
        let mut checkpoints_ns = Vec::new();
        for (table, cursor) in rx {
            let t = Instant::now();
            table.write_checkpoint(cursor).expect("checkpoint");
            checkpoints_ns.push(t.elapsed().as_nanos() as u64);
        }
        checkpoints_ns
    });
    let per_round = STEADY_UPDATES_PER_S * STEADY_ROUND_MS / 1000;
    let rounds = STEADY_S * 1000 / STEADY_ROUND_MS;
    let mut rng = SplitMix64::new(SEED + 6);
    let mut v = vec![0f32; DIM];
    let (mut rounds_ns, mut late_rounds, mut skipped_checkpoints) = (Vec::new(), 0u64, 0u64);
    let mut seq = n;
    let written_before = write_bytes();
    let t0 = Instant::now();
    let mut last_checkpoint = t0;
    for round in 0..rounds {
        let due = t0 + std::time::Duration::from_millis(round * STEADY_ROUND_MS);
        match due.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => late_rounds += 1,
        }
        let t = Instant::now();
        for _ in 0..per_round {
            let id = rng.below(n);
            vector(id.wrapping_add(seq), &mut v);
            w.upsert(id, &v).expect("update");
            seq += 1;
        }
        w.set_cursor(Cursor { epoch: 1, seq, change_unix_ms: 0 });
        if last_checkpoint.elapsed().as_millis() as u64 >= STEADY_CHECKPOINT_MS {
            // One pending checkpoint at most, as the refresher's channel.
            if tx.try_send((w.table().clone(), w.cursor())).is_err() {
                skipped_checkpoints += 1;
            }
            last_checkpoint = Instant::now();
        }
        rounds_ns.push(t.elapsed().as_nanos() as u64);
    }
    drop(tx);
    let mut checkpoints_ns = flusher.join().expect("flusher");
    let seconds = t0.elapsed().as_secs_f64();
    let written = write_bytes() - written_before;
    let updates = per_round * rounds;
    drop(w);
    serde_json::json!({
        "updates": updates, "seconds": seconds, "updates_per_s": updates as f64 / seconds,
        "round": percentiles(&mut rounds_ns), "late_rounds": late_rounds,
        "checkpoint": percentiles(&mut checkpoints_ns), "checkpoints_skipped": skipped_checkpoints,
        "disk_write_bytes_per_s": written as f64 / seconds, "disk_write_bytes_per_update": written as f64 / updates as f64,
    })
}

/// Reopens the file as the server does at start-up (after evicting its pages
/// when `evict`): the time until it serves, the first request's lookup, and
/// the background scan's time with a reader's lookups during it.
fn restart(path: &Path, n: u64, evict: bool) -> serde_json::Value {
    if evict {
        flush_and_evict(path);
    }
    let t = Instant::now();
    let mut w = ReplicaWriter::open_deferred(path, "user").expect("open");
    let serving_s = t.elapsed().as_secs_f64();
    let handle = w.handle();
    let mut rng = SplitMix64::new(SEED + 4);
    let mut keys = [0u64; 1 + ITEMS_PER_REQUEST];
    let mut rows = [0u32; 1 + ITEMS_PER_REQUEST];
    let mut out = vec![0f32; keys.len() * DIM];
    for k in keys.iter_mut() {
        *k = rng.below(n);
    }
    let t = Instant::now();
    let missing = handle.load().read_many_into(&keys, &mut rows, &mut out, &mut []);
    let first_request_ns = t.elapsed().as_nanos() as u64;
    assert_eq!(missing, 0, "unverified rows that pass their CRC are served");
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, handle) = (stop.clone(), handle.clone());
        std::thread::spawn(move || {
            let mut during = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for k in keys.iter_mut() {
                    *k = rng.below(n);
                }
                let t = Instant::now();
                let missing = handle.load().read_many_into(&keys, &mut rows, &mut out, &mut []);
                during.push(t.elapsed().as_nanos() as u64);
                assert_eq!(missing, 0);
            }
            during
        })
    };
    let t = Instant::now();
    let report = w.finish_open().expect("the scan passes");
    let verify_s = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut during = reader.join().expect("reader");
    assert_eq!(report.live_rows, n);
    serde_json::json!({
        "serving_s": serving_s, "first_request_ns": first_request_ns, "verify_s": verify_s,
        "reader_during_verify": percentiles(&mut during),
    })
}

/// What kept a thread off its work, as the kernel counts it for the calling
/// thread: page faults that read the disk (major), those that did not
/// (minor), and the times it gave up its core (voluntary: it blocked) or
/// had it taken away (involuntary: another thread was scheduled).
#[derive(Clone, Copy, Default)]
struct Waits {
    major_faults: i64,
    minor_faults: i64,
    blocked: i64,
    preempted: i64,
}

impl Waits {
    fn of_this_thread() -> Waits {
        // SAFETY: getrusage writes into the struct it is given.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut r) }, 0, "getrusage");
        Waits { major_faults: r.ru_majflt, minor_faults: r.ru_minflt, blocked: r.ru_nvcsw, preempted: r.ru_nivcsw }
    }

    fn since(self, start: Waits) -> serde_json::Value {
        serde_json::json!({
            "major_faults": self.major_faults - start.major_faults,
            "minor_faults": self.minor_faults - start.minor_faults,
            "blocked": self.blocked - start.blocked,
            "preempted": self.preempted - start.preempted,
        })
    }
}

/// The machine's memory-pressure counters (`/proc/vmstat`): reclaim done by
/// allocating threads themselves (direct), pages read back in that had been
/// evicted (refaults), and all major faults.
const VMSTAT_KEYS: [&str; 4] = ["allocstall_normal", "pgscan_direct", "workingset_refault_file", "pgmajfault"];

fn vmstat() -> [u64; VMSTAT_KEYS.len()] {
    let text = std::fs::read_to_string("/proc/vmstat").expect("/proc/vmstat");
    let mut out = [0u64; VMSTAT_KEYS.len()];
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(key), Some(value)) = (parts.next(), parts.next()) else { continue };
        if let Some(i) = VMSTAT_KEYS.iter().position(|k| *k == key) {
            out[i] = value.parse().expect("a /proc/vmstat count");
        }
    }
    out
}

fn vmstat_since(start: [u64; VMSTAT_KEYS.len()]) -> serde_json::Value {
    let now = vmstat();
    let map: serde_json::Map<String, serde_json::Value> =
        VMSTAT_KEYS.iter().enumerate().map(|(i, k)| (k.to_string(), (now[i] - start[i]).into())).collect();
    serde_json::Value::Object(map)
}

/// Fills the file past its capacity while a reader looks rows up through
/// the handle; returns the growth's time and the reader's slowest lookups.
fn grow(path: &Path, n: u64, file_bytes: u64) -> serde_json::Value {
    // The grown file has twice the rows and slots: it and the old one must
    // both fit in memory, or the measurement is of the disk.
    let needed = file_bytes * 3;
    let available = mem_available_bytes().unwrap_or(0);
    if needed > available {
        return serde_json::json!({"skipped": format!("needs {needed} bytes of memory, {available} available")});
    }
    let (mut w, _) = ReplicaWriter::open(path, "user").expect("open");
    let handle = w.handle();
    let stop = Arc::new(AtomicBool::new(false));
    let growing = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, growing, handle) = (stop.clone(), growing.clone(), handle.clone());
        std::thread::spawn(move || {
            let mut rng = SplitMix64::new(SEED + 3);
            let mut keys = [0u64; 1 + ITEMS_PER_REQUEST];
            let mut rows = [0u32; 1 + ITEMS_PER_REQUEST];
            let mut out = vec![0f32; keys.len() * DIM];
            let (mut before, mut during) = (Vec::new(), Vec::new());
            // This thread's waits from its first lookup during the growth
            // to its first lookup after it.
            let (mut waits_from, mut waits) = (None, serde_json::Value::Null);
            while !stop.load(Ordering::Relaxed) {
                for k in keys.iter_mut() {
                    *k = rng.below(n);
                }
                let g = growing.load(Ordering::Relaxed);
                match (g, waits_from) {
                    (true, None) => waits_from = Some(Waits::of_this_thread()),
                    (false, Some(from)) if waits.is_null() => waits = Waits::of_this_thread().since(from),
                    _ => {}
                }
                let t = Instant::now();
                let table = handle.load();
                let missing = table.read_many_into(&keys, &mut rows, &mut out, &mut []);
                drop(table);
                let ns = t.elapsed().as_nanos() as u64;
                assert_eq!(missing, 0);
                if g { &mut during } else { &mut before }.push(ns);
            }
            (before, during, waits)
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(500));
    // The refresher's loop: a batch of stream changes (updates: the file is
    // full, so an insert would wait for the growth), then a poll, as the
    // refresher polls every round. Its longest round is its pause.
    w.set_grow_ahead(true);
    let mut v = vec![0f32; DIM];
    let mut rng = SplitMix64::new(SEED + 5);
    let (mut rounds_ns, mut changes) = (Vec::new(), 0u64);
    // The longest round in each phase, to tell where a pause comes from:
    // while the copy runs (the stream applied to the old file), while noted
    // keys are replayed, and the round that swaps the copy in.
    let (mut copying_max_ns, mut replaying_max_ns, mut replay_rounds) = (0u64, 0u64, 0u64);
    let mut swap_round_ns = 0u64;
    let (writer_from, machine_from) = (Waits::of_this_thread(), vmstat());
    growing.store(true, Ordering::Relaxed);
    let t = Instant::now();
    loop {
        let round = Instant::now();
        for _ in 0..CHANGES_PER_ROUND {
            let id = rng.below(n);
            vector(id, &mut v);
            w.upsert(id, &v).expect("an update while growing");
        }
        changes += CHANGES_PER_ROUND;
        let swapped = w.poll_growth().expect("growth");
        let ns = round.elapsed().as_nanos() as u64;
        rounds_ns.push(ns);
        if swapped {
            swap_round_ns = ns;
        } else if w.growth_phase() == Some(GrowthPhase::Copying) {
            copying_max_ns = copying_max_ns.max(ns);
        } else {
            replaying_max_ns = replaying_max_ns.max(ns);
            replay_rounds += 1;
        }
        if !w.growing() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let growth_s = t.elapsed().as_secs_f64();
    let (writer_waits, machine) = (Waits::of_this_thread().since(writer_from), vmstat_since(machine_from));
    growing.store(false, Ordering::Relaxed);
    std::thread::sleep(std::time::Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let (mut before, mut during, reader_waits) = reader.join().expect("reader");
    let capacity = w.table().header().row_capacity;
    drop(w);
    serde_json::json!({
        "growth_s": growth_s, "capacity_after": capacity, "changes_during": changes,
        "refresher_round": percentiles(&mut rounds_ns),
        "round_max_copying_ns": copying_max_ns, "round_max_replaying_ns": replaying_max_ns,
        "replay_rounds": replay_rounds, "swap_round_ns": swap_round_ns,
        "reader_before": percentiles(&mut before), "reader_during": percentiles(&mut during),
        "reader_waits": reader_waits, "refresher_waits": writer_waits, "machine": machine,
    })
}

fn main() {
    let args = parse_args();
    quiver::features::replica::huge_pages(args.huge_pages);
    std::fs::create_dir_all(&args.dir).expect("bench directory");
    for &n in &args.entities {
        for &storage in &args.storages {
            let mut line = case(&args.dir, n, storage, args.lookups);
            line["huge_pages"] = serde_json::Value::Bool(args.huge_pages);
            println!("{line}");
        }
    }
}
