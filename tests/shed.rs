//! Load shedding by priority against a real server, in its own test binary:
//! it offers twice the server's capacity and bounds the high-priority tail,
//! so it must not share the machine's two cores with other flooding tests.

mod common;

use std::time::Duration;

use common::Server;
use quiver::loadgen::{self, Arrival, BenchOptions, BenchReport, PriorityReport};

const LOW: u8 = 0;
const HIGH: u8 = 9;
/// The most a request may carry: each costs the server (f32 backend) about
/// 1 ms and the generator no more than a small one, so the server, not the
/// generator, is the bottleneck even when a CPU hog slows both.
const CANDIDATES: usize = 256;
/// A budget no scheduling pause of a busy machine exhausts: what ends a
/// request here is the shedding, not its deadline.
const BUDGET_US: u32 = 1_000_000;
/// The high class's p99, at most: unshed, the backlog of a 2× overload
/// grows by a second of work per second, so over a 3 s half its p99 nears
/// 3 s; shed, it stays at a few ms on an idle machine, and within this on
/// one with a CPU hog beside the test, whose pauses a generator waiting to
/// send shows as latency (it counts from each request's intended send
/// time): 523 ms was seen beside two parallel builds, over a bound of
/// 500 ms, so the bound is a third of the unshed tail instead.
const HIGH_P99_MAX_US: u64 = 1_000_000;

/// The server's resident memory, from /proc (Linux), in KiB.
fn rss_kib(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn options(addr: &str, duration: Duration, rate: Option<f64>, mix: Vec<(u8, f64)>) -> BenchOptions {
    BenchOptions {
        protocol: quiver::loadgen::Protocol::Quiver,
        redis_value_bytes: 128,
        addr: addr.into(),
        duration,
        connections: 4,
        rate,
        arrival: Arrival::Poisson,
        pipeline: 8,
        seed: 7,
        candidates: CANDIDATES,
        context_len: quiver::loadgen::demo::CONTEXT_LEN,
        unknown_fraction: 0.0,
        users: quiver::loadgen::demo::USERS,
        items: quiver::loadgen::demo::ITEMS,
        user_dist: quiver::loadgen::demo::IdDist::Uniform,
        item_dist: quiver::loadgen::demo::IdDist::Uniform,
        budget_us: BUDGET_US,
        priority_mix: mix,
        tls: None,
        workload: loadgen::WorkloadKind::Auction32,
    }
}

fn class(report: &BenchReport, priority: u8) -> &PriorityReport {
    &report.by_priority[&priority.to_string()]
}

fn count(p: &PriorityReport, status: &str) -> u64 {
    p.by_status.get(status).copied().unwrap_or(0)
}

/// Offered load at twice capacity, three quarters of it at priority 0 and a
/// quarter at priority 9: priority 9 keeps its p99 within a generous bound,
/// priority 0's excess gets `Overloaded` (and far more of it than of 9),
/// nothing is lost, the server keeps running and its memory does not grow.
/// With `[shed] enabled = false` it fails: requests are lost to the backlog
/// and p99 reaches seconds.
#[test]
fn twice_capacity_sheds_the_low_priority_and_the_high_keeps_its_p99() {
    let cfg = common::scratch("shed").join("q.toml");
    std::fs::write(&cfg, "[shed]\nenabled = true\n").unwrap();
    // The f32 backend on 256 candidates keeps the server, not the load
    // generator, the bottleneck: with the INT8 kernels at a few µs per
    // request the server's capacity nears what one generator thread can
    // offer on a 2-core VM, and twice it could not be offered at all.
    let mut server = Server::start(&["--shards", "1", "--backend", "f32", "--config", cfg.to_str().unwrap()]);

    // Capacity: closed loop, 32 requests in flight, at a priority that is
    // never shed (the queue of a closed loop is long by construction).
    let closed = options(&server.addr, Duration::from_secs(1), None, vec![(255, 1.0)]);
    let measured = loadgen::run(&closed);
    assert!(measured.clean(), "{measured}");
    let capacity = measured.achieved_rate;

    // Twice that, in two halves, with the server's memory read after each.
    let offered = options(&server.addr, Duration::from_secs(3), Some(2.0 * capacity), vec![(LOW, 0.75), (HIGH, 0.25)]);
    let first = loadgen::run(&offered);
    let rss_first_kib = rss_kib(&server);
    let second = loadgen::run(&offered);
    let rss_second_kib = rss_kib(&server);
    let context = format!("capacity {capacity:.0} req/s\nfirst half:\n{first}\nsecond half:\n{second}");

    eprintln!("{context}");
    assert!(server.is_running(), "{context}\n{}", server.stderr());
    for half in [&first, &second] {
        assert!(half.connection_errors.is_empty() && half.lost == 0, "{context}");
        let (low, high) = (class(half, LOW), class(half, HIGH));
        // The high class: its tail bounded.
        assert!(high.latency.p99_us <= HIGH_P99_MAX_US, "priority {HIGH} p99 over {HIGH_P99_MAX_US} µs:\n{context}");
        // The low class is shed first: its excess is shed, and the high
        // class mostly served. On a quiet machine the high class is all Ok;
        // on a loaded 2-core VM the generator's catch-up bursts can push the
        // shed level up to band 8-15 for moments, hence a share, not all.
        let shed = count(low, "overloaded");
        assert!(shed * 4 >= low.sent, "under a quarter of priority {LOW} shed:\n{context}");
        assert!(count(high, "ok") * 2 >= high.sent, "under half of priority {HIGH} Ok:\n{context}");
        assert!(
            count(high, "overloaded") * low.sent < shed * high.sent / 2,
            "priority {HIGH} shed at over half priority {LOW}'s share:\n{context}"
        );
        // A few requests a generator catch-up burst delivered late may be
        // past their deadline on arrival; more than 1% would be a backlog.
        let other = |p: &PriorityReport| p.received - count(p, "ok") - count(p, "overloaded");
        assert!(other(low) + other(high) <= half.received / 100, "statuses other than ok/overloaded:\n{context}");
    }
    // Memory: bounded, and not growing from one half to the next.
    assert!(rss_second_kib < 512 * 1024, "RSS {rss_second_kib} KiB\n{context}");
    assert!(rss_second_kib <= rss_first_kib + 16 * 1024, "RSS {rss_first_kib} → {rss_second_kib} KiB\n{context}");

    // The server's own count, by band, once its shard has published.
    let shed_of = |p: u8| count(class(&first, p), "overloaded") + count(class(&second, p), "overloaded");
    let s = server.wait_stats("the shed requests published", |s| {
        s.shed_by_band.values().sum::<u64>() >= shed_of(LOW) + shed_of(HIGH)
    });
    assert_eq!(s.shed_by_band["0"], shed_of(LOW), "{:?}", s.shed_by_band);
    assert_eq!(s.shed_by_band["8-15"], shed_of(HIGH), "{:?}", s.shed_by_band);
    assert_eq!(server.terminate(), 0);
}
