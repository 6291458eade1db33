//! The shard's reactor against a real server: a server scraped in a loop
//! while its model is swapped keeps answering, with its stall counters in
//! `/metrics`; housekeeping threads run off the shard cores; and
//! `replica_lock` locks the replicas or fails at start naming RLIMIT_MEMLOCK.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{demo_request, http_get, http_post, Server, BIN};
use quiver::wire::Status;

fn config(name: &str, body: &str) -> std::path::PathBuf {
    let path = common::scratch(name).join("quiver.toml");
    std::fs::write(&path, body).unwrap();
    path
}

/// A counter's value in Prometheus text: the sum over the lines of `family`
/// whose labels contain `labels`.
fn counter(text: &str, family: &str, labels: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(family) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[test]
fn scraping_and_model_swaps_keep_answers_flowing_and_stalls_show_in_metrics() {
    let dir = common::scratch("reactor-swap");
    for version in [1, 2] {
        let mut m = quiver::loadgen::demo::model();
        m.version = version;
        quiver::registry::publish(&dir, &m).unwrap();
    }
    // A 1 µs threshold: every round counts, so the counters must move.
    let cfg = config("reactor-swap-cfg", "[reactor]\nstall_threshold_us = 1\n");
    let server =
        Server::start(&["--shards", "1", "--models-dir", dir.to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    let stop = AtomicBool::new(false);
    let answered = AtomicU64::new(0);
    let scrapes = AtomicU64::new(0);
    std::thread::scope(|s| {
        let load = s.spawn(|| {
            let mut c = server.client();
            let mut id = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let spec = demo_request(id, id % 1000, (0..32).map(|i| (id + i) % 5000).collect());
                let r = c.score(&spec).unwrap();
                assert_eq!(r.status, Status::Ok, "request {id} during scrapes and swaps");
                id += 1;
                answered.store(id, Ordering::Relaxed);
            }
        });
        let scraper = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let (code, _) = http_get(&format!("http://{}/metrics", server.admin));
                assert_eq!(code, 200);
                scrapes.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Each swap comes once answers and scrapes have gone on since the
        // last, so every one lands among them, however slow the machine.
        let progressed = |since: (u64, u64)| {
            let until = Instant::now() + common::WAIT;
            loop {
                let now = (answered.load(Ordering::Relaxed), scrapes.load(Ordering::Relaxed));
                if now.0 >= since.0 + 20 && now.1 > since.1 {
                    return now;
                }
                assert!(Instant::now() < until, "answers and scrapes stalled at {now:?}");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        let mut seen = progressed((0, 0));
        for round in 0..8 {
            let (code, body) =
                http_post(&format!("http://{}/models/auction-32/load?version={}", server.admin, 1 + round % 2));
            assert_eq!(code, 200, "{body}");
            seen = progressed(seen);
        }
        stop.store(true, Ordering::Relaxed);
        load.join().unwrap();
        scraper.join().unwrap();
    });
    // Every answer on the board, so the last counts are too.
    let answers = answered.load(Ordering::Relaxed);
    server.wait_stats("every answer published", |s| s.requests >= answers);
    let (_, text) = http_get(&format!("http://{}/metrics", server.admin));
    let connection = counter(&text, "quiver_shard_stalls_total", "task=\"connection\"");
    assert!(connection > 0, "no connection stalls counted at a 1 µs threshold:\n{text}");
    assert!(text.contains("quiver_shard_stalls_total{shard=\"0\",task=\"reactor\"}"), "{text}");
    assert!(counter(&text, "quiver_shard_stall_duration_seconds_count", "") > 0, "{text}");
    // Every swap's backend was built on the admin side; the shard built
    // only what it served at start (the model and the demo's fallback).
    let prebuilt = counter(&text, "quiver_backends_prebuilt", "");
    let on_shard = counter(&text, "quiver_backends_built_on_shard", "");
    assert!(prebuilt >= 7 && on_shard == 2, "prebuilt {prebuilt}, built on the shard {on_shard} after 8 swaps");
    let stats = server.stats();
    assert_eq!(stats.stalls_by_shard.len(), 1);
    assert!(stats.stalls_by_task["connection"] > 0);
    assert!(stats.stages.iter().any(|s| s.stage == "stall"));
    // One read in eight of each connection carries kernel receive stamps.
    let socket_wait = stats.stages.iter().find(|s| s.stage == "socket_wait").expect("a socket_wait stage");
    assert!(socket_wait.count > 0, "no socket_wait recorded: {:?}", stats.stages);
    let end_to_end = stats.stages.iter().find(|s| s.stage == "end_to_end").unwrap();
    assert!(socket_wait.count < end_to_end.count, "sampled, not every frame");
    server.wait_stderr("reactor stalls in the last interval");
}

/// Each thread's name and the cores it may run on, from /proc.
fn thread_cores(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default().trim().to_string();
        let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
        let cores = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|c| c.trim().to_string())
            .unwrap_or_default();
        out.push((comm, cores));
    }
    out
}

#[test]
fn housekeeping_threads_run_off_the_shard_cores() {
    let allowed = quiver::cores::allowed();
    if allowed.len() < 2 {
        // One core: nothing to pin to; the server says so.
        let mut server = Server::start(&["--cores", &allowed[0].to_string()]);
        server.wait_stderr("no spare core for housekeeping");
        assert_eq!(server.terminate(), 0);
        return;
    }
    let (shard_core, spare) = (allowed[0], allowed[1]);
    let cfg = config("reactor-housekeeping", &format!("[reactor]\nhousekeeping_cores = [{spare}]\n"));
    let mut server = Server::start(&["--cores", &shard_core.to_string(), "--config", cfg.to_str().unwrap()]);
    // A shard's executor creates its blocking-thread pool (named after it)
    // before pinning itself, and each pool thread pins itself once it first
    // runs, which on a busy machine can come after the server is ready:
    // until then such a thread still has the main thread's cores. So this
    // waits, boundedly, for every shard thread to sit on the shard core.
    let until = Instant::now() + common::WAIT;
    let threads = loop {
        let threads = thread_cores(server.child.id());
        let shards: Vec<_> = threads.iter().filter(|(name, _)| name.starts_with("quiver-shard")).collect();
        assert!(!shards.is_empty(), "{threads:?}");
        if shards.iter().all(|(_, cores)| *cores == shard_core.to_string()) {
            break threads;
        }
        assert!(Instant::now() < until, "a shard thread is off core {shard_core}: {shards:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    for name in ["quiver-admin", "quiver-metrics"] {
        let (_, cores) = threads.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name}: {threads:?}"));
        assert_eq!(cores, &spare.to_string(), "{name} runs on the housekeeping core");
    }
    server.wait_stderr("housekeeping threads pinned");
    assert_eq!(server.terminate(), 0);
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

fn memlock_soft_bytes() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max locked memory")).expect("a memlock line");
    line.split_whitespace().nth(3).and_then(|v| v.parse().ok()).unwrap_or(u64::MAX)
}

fn vm_locked_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmLck:")).expect("VmLck in /proc status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn replica_lock_locks_the_replicas_in_memory() {
    let cfg = config("reactor-lock", "replica_lock = true\n");
    let bytes: u64 =
        ["user.qrep", "item.qrep"].iter().map(|f| std::fs::metadata(common::demo_dir().join(f)).unwrap().len()).sum();
    // Root (as in CI) holds CAP_IPC_LOCK, which lets the lock succeed
    // whatever the limit; elsewhere the soft limit must cover the replicas,
    // and where it does not, the refusal is what the next test checks.
    if !is_root() && memlock_soft_bytes() < bytes {
        eprintln!("RLIMIT_MEMLOCK is below the demo replicas' {bytes} bytes and this is not root: nothing to lock");
        return;
    }
    let mut server = Server::start(&["--shards", "1", "--config", cfg.to_str().unwrap()]);
    let locked_kb = vm_locked_kb(server.child.id());
    assert!(locked_kb * 1024 >= bytes, "{locked_kb} KiB locked, replicas are {bytes} bytes");
    let mut c = server.client();
    assert_eq!(c.score(&demo_request(1, 7, vec![1, 2, 3])).unwrap().status, Status::Ok);
    assert_eq!(server.terminate(), 0);
}

#[test]
fn replica_lock_beyond_rlimit_memlock_fails_at_start_naming_it() {
    let cfg = config("reactor-lock-low", "replica_lock = true\n");
    let is_root = is_root();
    // Root has CAP_IPC_LOCK, which ignores the limit: drop it first.
    let serve = format!(
        "prlimit --memlock=65536 {BIN} serve --listen 127.0.0.1:0 --admin off --shards 1 --data-dir {} --config {}",
        common::demo_dir().display(),
        cfg.display()
    );
    let out = if is_root {
        Command::new("capsh").args(["--drop=cap_ipc_lock", "--", "-c", &serve]).output()
    } else {
        Command::new("sh").args(["-c", &serve]).output()
    }
    .expect("capsh (libcap2-bin) and prlimit (util-linux) run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a server that cannot lock its replicas must not start: {stderr}");
    assert!(stderr.contains("RLIMIT_MEMLOCK is 65536 bytes"), "{stderr}");
    assert!(stderr.contains("replica_lock = false"), "{stderr}");
}

#[test]
fn a_stage_sharing_the_shard_s_core_answers_through_its_bell() {
    let core = quiver::cores::allowed()[0];
    let cfg = config("reactor-shared-stage", &format!("inference = \"thread\"\n[stage]\ncore = {core}\n"));
    let mut server = Server::start(&["--cores", &core.to_string(), "--config", cfg.to_str().unwrap()]);
    let mut c = server.client();
    // One at a time: each answer comes only once the stage rang the shard,
    // which sleeps on its bell (it does not poll on a shared core).
    for id in 0..300u64 {
        let r = c.score(&demo_request(id, id % 1000, (0..32).map(|i| (id * 7 + i) % 5000).collect())).unwrap();
        assert_eq!(r.status, Status::Ok, "request {id}");
        assert_eq!(r.tier, quiver::wire::Tier::Primary, "request {id} was scored by the stage: {r:?}");
    }
    let stats = server.wait_stats("the stage's 300 requests published", |s| {
        s.stages.iter().any(|st| st.stage == "queue" && st.count >= 300)
    });
    let queue = stats.stages.iter().find(|s| s.stage == "queue").unwrap();
    assert_eq!(queue.count, 300, "every request went through the stage");
    let log = server.wait_stderr("shares_core: true");
    assert!(log.contains("higher priority") || log.contains("could not raise its priority"), "{log}");
    assert_eq!(server.terminate(), 0);
}

#[test]
fn persistent_connections_spread_within_one_of_their_share() {
    const CONNECTIONS: usize = 32;
    const SHARDS: usize = 2;
    let server = Server::start(&["--shards", &SHARDS.to_string()]);
    // Each connection answers one request, so each is being served.
    let mut clients: Vec<_> = (0..CONNECTIONS).map(|_| server.client()).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        let r = c.score(&demo_request(i as u64, i as u64, vec![1, 2, 3])).unwrap();
        assert_eq!(r.status, Status::Ok);
    }
    // Publications are once a second, each shard on its own period.
    let stats = server.wait_stats("every connection published", |s| {
        s.connections_by_shard.len() == SHARDS && s.connections_by_shard.iter().sum::<u64>() >= CONNECTIONS as u64
    });
    let by_shard = stats.connections_by_shard;
    assert_eq!(by_shard.iter().sum::<u64>(), CONNECTIONS as u64, "{by_shard:?}");
    let share = (CONNECTIONS / SHARDS) as u64;
    assert!(by_shard.iter().all(|&n| n.abs_diff(share) <= 1), "{by_shard:?}: each within ±1 of {share}");
    drop(clients);
}
