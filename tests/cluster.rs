//! The multi-node client (`quiver::client::cluster`) against three real server
//! processes on 127.0.0.1: healthy nodes share the traffic, a node killed
//! with SIGKILL mid-run loses no request whose budget allowed a retry, a
//! node answering `Overloaded` is backed off, and a node made slow (its
//! inference stage delayed through the fault hook) gets less traffic while
//! hedges answer for it, within the hedge budget.

mod common;

use std::time::{Duration, Instant};

use common::{demo_request, http_post, scratch, Server};
use quiver::client::cluster::{Cluster, ClusterConfig, Hedge, NodeStats};
use quiver::wire::{Response, Status};

/// The tests run one at a time: each starts three servers, and the spread
/// they measure depends on the nodes being equally fast.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn nodes(extra: &[&str]) -> Vec<Server> {
    (0..3).map(|_| Server::start(&[&["--shards", "1"], extra].concat())).collect()
}

/// Sends `n` demo requests with at most `window` outstanding, calling
/// `between(done)` after each completion; returns every result in order of
/// completion.
fn drive(
    c: &mut Cluster,
    n: u64,
    window: usize,
    mut between: impl FnMut(u64),
) -> Vec<Result<Response, quiver::client::cluster::ClusterError>> {
    let (mut sent, mut out) = (0u64, Vec::new());
    let until = Instant::now() + Duration::from_secs(60);
    while (out.len() as u64) < n {
        while sent < n && c.outstanding() < window {
            sent += 1;
            c.submit(&demo_request(sent, sent % 100_000, (0..8).map(|k| (sent + k) % 10_000).collect())).unwrap();
        }
        for (_, r) in c.poll(Duration::from_millis(20)) {
            out.push(r);
            between(out.len() as u64);
        }
        assert!(Instant::now() < until, "{} of {n} answered in 60 s", out.len());
    }
    out
}

/// Waits until three new servers answer alike. They share core 0 here, and
/// for its first seconds the last one started answers slower (a median of
/// 2-5x the others' in half the runs, whatever its place in the node list;
/// a server alone is not slower when new), which the balancer rightly sees
/// and avoids. After 3 s idle the three were within 3% in 5 runs of 5.
fn settle() {
    std::thread::sleep(Duration::from_secs(3));
}

fn addrs(servers: &[Server]) -> Vec<String> {
    servers.iter().map(|s| s.addr.clone()).collect()
}

fn won(stats: &[NodeStats]) -> Vec<u64> {
    stats.iter().map(|s| s.won).collect()
}

#[test]
fn healthy_nodes_share_the_traffic_evenly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // The three shards share this VM's cores: a shard spinning before it
    // parks takes time from the others, so none spins here.
    let cfg = scratch("cluster-spread").join("q.toml");
    std::fs::write(&cfg, "[reactor]\nspin_before_park_us = 0\n").unwrap();
    let servers = nodes(&["--config", cfg.to_str().unwrap()]);
    let mut c = Cluster::new(&addrs(&servers), ClusterConfig::default()).unwrap();
    // One request per node outstanding.
    settle();
    let results = drive(&mut c, 3_000, 3, |_| {});
    assert!(results.iter().all(|r| r.as_ref().is_ok_and(|r| r.status == Status::Ok && r.scores.len() == 8)));
    let w = won(&c.node_stats());
    let latency: Vec<u64> = c.node_stats().iter().map(|n| n.latency_us).collect();
    eprintln!("spread {w:?}, median latencies (µs) {latency:?}");
    // Within a fifth of an even share: the client weighs nodes by their
    // recent latency, so one whose shard lost its core for a moment to the
    // rest of a busy 2-core machine takes a little less (872 of 3,000 seen
    // in a CI run beside a build); a broken balance is far outside this.
    for n in &w {
        assert!((800..=1200).contains(n), "spread {w:?}, median latencies (µs) {latency:?}");
    }
}

#[test]
fn a_node_killed_mid_run_loses_no_request_that_could_be_retried() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut servers = nodes(&[]);
    let mut c = Cluster::new(&addrs(&servers), ClusterConfig::default()).unwrap();
    let mut victim = Some(servers.remove(1));
    let results = drive(&mut c, 3_000, 24, |done| {
        if done == 1_000 {
            let mut s = victim.take().unwrap();
            s.child.kill().unwrap();
            s.child.wait().unwrap();
        }
    });
    let failed: Vec<_> = results.iter().filter(|r| !r.as_ref().is_ok_and(|r| r.status == Status::Ok)).collect();
    assert!(failed.is_empty(), "{} failed: {:?}", failed.len(), &failed[..failed.len().min(3)]);
    let stats = c.node_stats();
    assert!(stats[1].failures > 0 && stats[1].ejections > 0, "{stats:?}");
    assert!(c.retries > 0, "the killed node's in-flight requests were retried");
    // After the kill the other two took the rest.
    assert!(stats[0].won + stats[2].won >= 2_000, "{stats:?}");
}

#[test]
fn a_node_answering_overloaded_is_backed_off() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let servers = nodes(&[]);
    assert_eq!(http_post(&format!("http://{}/drain", servers[0].admin)).0, 200);
    let mut c = Cluster::new(&addrs(&servers), ClusterConfig::default()).unwrap();
    let results = drive(&mut c, 2_000, 16, |_| {});
    assert!(
        results.iter().all(|r| r.as_ref().is_ok_and(|r| r.status == Status::Ok)),
        "every request retried elsewhere"
    );
    let stats = c.node_stats();
    assert_eq!(stats[0].won, 0, "{stats:?}");
    assert!(stats[0].ejections > 0, "{stats:?}");
    // Ejected with a doubling back-off, it sees a few probes, not a third.
    assert!(stats[0].sent < 200, "the drained node was sent {} of 2,000", stats[0].sent);
}

#[test]
fn a_slow_node_gets_less_traffic_and_hedges_answer_for_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = scratch("cluster-slow").join("q.toml");
    std::fs::write(&cfg, "inference = \"thread\"\nfaults_endpoint = true\n").unwrap();
    let servers = nodes(&["--config", cfg.to_str().unwrap()]);
    // 200 ms a batch: far slower than the other nodes even when a CPU hog
    // beside the test stretches their answers to tens of ms.
    assert_eq!(http_post(&format!("http://{}/faults?stage_delay_us=200000", servers[2].admin)).0, 200);
    let config = ClusterConfig { hedge: Hedge::After(Duration::from_millis(20)), ..ClusterConfig::default() };
    let mut c = Cluster::new(&addrs(&servers), config).unwrap();
    let n = 2_000;
    let results = drive(&mut c, n, 8, |_| {});
    assert!(results.iter().all(|r| r.as_ref().is_ok_and(|r| r.status == Status::Ok)));
    let stats = c.node_stats();
    let w = won(&stats);
    assert!(w[2] * 4 < w[0].min(w[1]), "the slow node answered {w:?}");
    assert!(c.hedges > 0, "requests stuck on the slow node were hedged");
    // The budget: 5% of requests, plus the bucket's start.
    assert!(c.hedges as f64 <= 0.05 * n as f64 + 11.0, "{} hedges for {n} requests", c.hedges);
    let hedge_wins: u64 = stats[..2].iter().map(|s| s.hedges_sent).sum();
    assert!(hedge_wins > 0, "{stats:?}");
}

#[test]
fn quiver_bench_over_several_nodes_reports_each_node_and_the_hedge_rate() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // As in the spread test: three shards share this VM's two cores, and a
    // shard spinning before it parks slows the one beside it past twice the
    // others' latency, which the client then rightly avoids (a CI run saw a
    // node win 12 of 2,000 at 81 µs against 27).
    let cfg = scratch("cluster-bench").join("q.toml");
    std::fs::write(&cfg, "[reactor]\nspin_before_park_us = 0\n").unwrap();
    let servers = nodes(&["--config", cfg.to_str().unwrap()]);
    let list = addrs(&servers).join(",");
    settle();
    // A rate a generator on a busy machine still keeps, and a budget no
    // pause of one exhausts: a node whose answers came past it would be
    // ejected, and the run's requests would fail.
    let (code, out, err) = common::run_quiver([
        "bench",
        "--addr",
        &list,
        "--rate",
        "1000",
        "--duration",
        "1s",
        "--hedge-after-us",
        "2000",
        "--budget-us",
        "1000000",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["mode"], "open loop");
    assert_eq!(r["received"], r["sent"], "{r}");
    assert!(r["sent"].as_u64().unwrap() >= 900, "{r}");
    let nodes = r["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    assert!(nodes.iter().all(|n| n["won"].as_u64().unwrap() > 150), "{r}");
    assert!(r["hedge_rate"].as_f64().unwrap() <= 0.06, "{r}");
    assert!(r["latency"]["p99_us"].as_u64().unwrap() > 0);
    // Hedging needs more than one node.
    let (code, _, err) = common::run_quiver(["bench", "--addr", &servers[0].addr, "--hedge-after-us", "100"]);
    assert_ne!(code, 0);
    assert!(err.contains("several nodes"), "{err}");
}
