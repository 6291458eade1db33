//! `quiver bench`: the load generator.
//!
//! One thread drives every connection with non-blocking sockets and spins:
//! it owns its core (pin it with `taskset`), so a send is never delayed by a
//! sleeping or descheduled sender thread. Two modes:
//!
//! - Open loop (`--rate R`): requests are scheduled at a fixed arrival rate
//!   (uniform spacing or Poisson, seeded) spread round-robin over the
//!   connections, whatever the server does. Latency is measured from each
//!   request's *intended* send time, so a stalled server or a saturated
//!   generator shows up in the tail (coordinated omission corrected).
//! - Closed loop (no `--rate`): each connection keeps `--pipeline` requests
//!   in flight. It measures service time, not latency at a given load, and
//!   says so.
//!
//! The generator reports how busy its own loop was; above ~80% it is close to
//! being the bottleneck and says so.
//!
//! With `--protocol redis` the same schedule sends `GET`s to a Redis
//! instead (`resp`), so the environment's floor is measured by the same
//! generator in the same run.
//!
//! With a priority mix (`--priority-mix 0:0.75,9:0.25`) each request draws
//! its priority from the mix (seeded), and the report breaks latency and
//! statuses down by priority, to see what load shedding keeps for whom.
//!
//! With `tls` the connections speak TLS to a server with `[tls]`
//! (`transport`), so its cost is measured by the same schedule.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::client::Codec;
use crate::loadgen::demo::{IdDist, Ids, SplitMix64, Workload};
use crate::wire::{status_name, tier_name, RequestSpec, Status};

pub mod auction;
pub mod demo;
pub mod fraud;
pub mod nodes;
pub mod plot;
pub mod redis_floor;
mod transport;
pub mod zipf;

use transport::Transport;

/// Most requests one run may schedule, so a typo in `--rate` cannot run away.
pub const REQUESTS_MAX: u64 = 100_000_000;
/// Requests in flight across all connections; bounds the send-time ring.
pub const IN_FLIGHT_MAX: usize = 1 << 20;
/// Longest time to wait for stragglers after the sending phase.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// Length of one interval in the HdrHistogram interval log.
const INTERVAL: Duration = Duration::from_secs(1);
/// Above this fraction of busy loop time the generator may be the bottleneck.
const BUSY_WARN: f64 = 0.8;
/// Most priorities in one mix.
pub const PRIORITY_MIX_MAX: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    Uniform,
    Poisson,
}

/// What the generator speaks to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// Quiver's scoring requests.
    Quiver,
    /// Redis `GET`s of values the bench writes first (the outside floor).
    Redis,
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub addr: String,
    pub protocol: Protocol,
    /// With `Protocol::Redis`: the size of each value.
    pub redis_value_bytes: usize,
    pub duration: Duration,
    pub connections: usize,
    /// Total offered rate in requests per second; `None` for closed loop.
    pub rate: Option<f64>,
    pub arrival: Arrival,
    /// Requests in flight per connection in closed loop.
    pub pipeline: usize,
    pub seed: u64,
    pub candidates: usize,
    /// Context floats per request.
    pub context_len: usize,
    pub unknown_fraction: f64,
    /// Known user ids are 0..users (the served user replica's keys).
    pub users: u64,
    /// Known item ids are 0..items.
    pub items: u64,
    pub user_dist: IdDist,
    pub item_dist: IdDist,
    pub budget_us: u32,
    /// (priority, share) pairs, shares summing to 1; empty sends priority 0.
    pub priority_mix: Vec<(u8, f64)>,
    /// Speak TLS to the server (Quiver with `[tls]`).
    pub tls: Option<crate::tls::ClientTls>,
    /// What the requests are: auction-32's (users, items, context, sized by
    /// the fields above), fraud transactions over five groups, or auctions
    /// of `candidates` ads over the auction example's groups.
    pub workload: WorkloadKind,
}

/// The built-in examples `quiver demo`, `serve --demo` and `bench` know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoWorkload {
    /// Users and items: 32 candidates per request, an MLP (`demo`).
    #[value(name = "auction-32")]
    Auction32,
    /// Card payments over five groups, a LightGBM model (`fraud`).
    Fraud,
    /// Ads whose campaign and advertiser rows are reached through the
    /// links in the replicas: six groups, an MLP (`auction`).
    Auction,
}

/// The request generators a bench can drive.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadKind {
    /// One user and `candidates` items per request (`demo::Workload`).
    Auction32,
    /// One card payment per request over the fraud example's five groups
    /// (`fraud::Transactions`); `candidates`, `context_len` and the
    /// user/item fields do not apply.
    Fraud(fraud::Mix),
    /// One auction per request over the auction example's groups
    /// (`auction::Auctions`): a user, a device, a publisher and
    /// `candidates` ads; `context_len` and the user/item fields do not
    /// apply.
    Auction(auction::Mix),
}

/// A bench's request generator, as [`BenchOptions::workload`] builds it.
#[derive(Clone, Debug)]
pub enum BenchWorkload {
    Auction32(Workload),
    Fraud(fraud::Transactions),
    Auction(auction::Auctions),
}

impl BenchWorkload {
    /// Fills `spec` with the next request, reusing its allocations.
    pub fn fill(&mut self, request_id: u64, spec: &mut RequestSpec) {
        match self {
            BenchWorkload::Auction32(w) => w.fill(request_id, spec),
            BenchWorkload::Fraud(t) => t.fill(request_id, spec),
            BenchWorkload::Auction(a) => a.fill(request_id, spec),
        }
    }
}

impl BenchOptions {
    /// The request generator these options describe, seeded by `seed`;
    /// an error names a population or exponent out of range.
    pub fn workload(&self) -> Result<BenchWorkload, String> {
        if let WorkloadKind::Fraud(mix) = &self.workload {
            let mut t = fraud::Transactions::new(mix, self.seed)?;
            t.unknown_fraction = self.unknown_fraction;
            t.budget_us = self.budget_us;
            return Ok(BenchWorkload::Fraud(t));
        }
        if let WorkloadKind::Auction(mix) = &self.workload {
            let mut a = auction::Auctions::new(mix, self.seed)?;
            a.candidates = self.candidates;
            a.unknown_fraction = self.unknown_fraction;
            a.budget_us = self.budget_us;
            return Ok(BenchWorkload::Auction(a));
        }
        let mut w = Workload::auction32(self.seed);
        w.users = Ids::new(self.user_dist, self.users).map_err(|e| format!("users: {e}"))?;
        w.items = Ids::new(self.item_dist, self.items).map_err(|e| format!("items: {e}"))?;
        w.candidates = self.candidates;
        w.context_len = self.context_len;
        w.unknown_fraction = self.unknown_fraction;
        w.budget_us = self.budget_us;
        Ok(BenchWorkload::Auction32(w))
    }
}

/// What a workload keyed by several groups (`fraud`, `auction`) draws: per
/// group, in its `names` order, a population and a Zipf exponent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupMix<const N: usize> {
    pub names: [&'static str; N],
    /// Known entities per group.
    pub populations: [u64; N],
    /// Zipf exponents per group.
    pub zipf: [f64; N],
}

impl<const N: usize> GroupMix<N> {
    /// `self` with what `quiver bench` was given: `--populations
    /// GROUP=N,…`, then `--zipf S` for every group, then `--group-zipf
    /// GROUP=S,…` over that; an error names the flag and the groups.
    pub fn with_flags(
        mut self,
        populations: Option<&str>,
        zipf: Option<f64>,
        group_zipf: Option<&str>,
    ) -> Result<GroupMix<N>, String> {
        if let Some(text) = populations {
            self.populations = self.parse(text, self.populations).map_err(|e| format!("--populations {e}"))?;
        }
        if let Some(s) = zipf {
            self.zipf = [s; N];
        }
        if let Some(text) = group_zipf {
            self.zipf = self.parse(text, self.zipf).map_err(|e| format!("--group-zipf {e}"))?;
        }
        Ok(self)
    }

    /// Parses `GROUP=V,…` over `base`, one value per group
    /// (`card=1000000,merchant=5000`).
    pub fn parse<T: std::str::FromStr + Copy>(&self, text: &str, base: [T; N]) -> Result<[T; N], String> {
        let mut out = base;
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || format!("'{part}': expected GROUP=VALUE with GROUP one of {}", self.names.join(", "));
            let (name, v) = part.split_once('=').ok_or_else(bad)?;
            let g = self.names.iter().position(|g| *g == name.trim()).ok_or_else(bad)?;
            out[g] = v.trim().parse().map_err(|_| bad())?;
        }
        Ok(out)
    }

    /// Each group's key source, Zipf over its population; an error names
    /// the group.
    pub fn ids(&self) -> Result<[Ids; N], String> {
        let mut ids = Vec::with_capacity(N);
        for (g, (&n, &s)) in self.populations.iter().zip(&self.zipf).enumerate() {
            ids.push(Ids::new(IdDist::Zipf(s), n).map_err(|e| format!("{}: {e}", self.names[g]))?);
        }
        Ok(ids.try_into().unwrap_or_else(|_| unreachable!("one per group")))
    }
}

/// Removes the auction-32 demo's fallback model from `dir`, where a worked
/// example is written: it is served from `<dir>/fallback.qm` when present
/// and reads groups the example does not have, so a directory switched from
/// one demo to the other drops it. Any other file there is the operator's
/// and is left alone.
pub fn drop_demo_fallback(dir: &Path) -> std::io::Result<()> {
    let fallback = dir.join("fallback.qm");
    if crate::model::Model::load(&fallback).is_ok_and(|m| m == demo::fallback_model()) {
        std::fs::remove_file(&fallback)?;
    }
    Ok(())
}

/// The ids a run drew, as its report records them.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct IdsReport {
    pub users: u64,
    pub items: u64,
    /// `uniform` or `zipf:S`.
    pub user_dist: String,
    pub item_dist: String,
    /// A fraud or auction run: each keyed group's population, in model
    /// input order (the user and item fields above do not apply).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<(String, u64)>,
    /// A fraud or auction run: how every keyed group's keys were drawn
    /// (`zipf:S`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group_dist: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Latency {
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub p9999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub mode: String,
    #[serde(default = "default_protocol")]
    pub protocol: Protocol,
    pub connections: usize,
    pub duration_s: f64,
    pub offered_rate: Option<f64>,
    pub achieved_rate: f64,
    pub sent: u64,
    pub received: u64,
    pub lost: u64,
    pub connection_errors: Vec<String>,
    pub by_status: BTreeMap<String, u64>,
    pub by_tier: BTreeMap<String, u64>,
    pub latency: Latency,
    /// Open loop: sends that left more than 1 ms after their intended time.
    pub late_sends: u64,
    /// Fraction of the generator loop's time spent doing work (0..=1).
    pub generator_busy: f64,
    /// CPU seconds the generator process used during the run.
    pub generator_cpu_s: f64,
    pub generator_saturated: bool,
    /// With a priority mix: the same figures per priority, keyed by it.
    #[serde(default)]
    pub by_priority: BTreeMap<String, PriorityReport>,
    /// Populations and distributions of the ids sent (Quiver protocol).
    #[serde(default)]
    pub ids: IdsReport,
}

fn default_protocol() -> Protocol {
    Protocol::Quiver
}

/// One priority's share of a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PriorityReport {
    pub sent: u64,
    pub received: u64,
    pub by_status: BTreeMap<String, u64>,
    pub by_tier: BTreeMap<String, u64>,
    pub latency: Latency,
}

/// Parses `P:SHARE,…` (priority 0..=255, positive shares, normalised to 1).
pub fn parse_priority_mix(s: &str) -> Result<Vec<(u8, f64)>, String> {
    let bad = || format!("--priority-mix '{s}': expected PRIORITY:SHARE,... (e.g. 0:0.75,9:0.25)");
    let mut mix = Vec::new();
    for part in s.split(',') {
        let (p, share) = part.split_once(':').ok_or_else(bad)?;
        let p: u8 = p.trim().parse().map_err(|_| bad())?;
        let share: f64 = share.trim().parse().map_err(|_| bad())?;
        if !(share > 0.0 && share.is_finite()) || mix.iter().any(|&(q, _)| q == p) {
            return Err(bad());
        }
        mix.push((p, share));
    }
    if mix.len() > PRIORITY_MIX_MAX {
        return Err(format!("--priority-mix '{s}': at most {PRIORITY_MIX_MAX} priorities"));
    }
    let total: f64 = mix.iter().map(|(_, w)| w).sum();
    Ok(mix.into_iter().map(|(p, w)| (p, w / total)).collect())
}

/// An index into `mix`, drawn by share; `None` for no mix.
fn pick_priority(mix: &[(u8, f64)], rng: &mut SplitMix64) -> Option<usize> {
    if mix.is_empty() {
        return None;
    }
    let u = rng.unit();
    let mut acc = 0.0;
    let i = mix.iter().position(|&(_, w)| {
        acc += w;
        u < acc
    });
    Some(i.unwrap_or(mix.len() - 1))
}

fn latency_of(h: &Histogram<u64>) -> Latency {
    Latency {
        p50_us: h.value_at_quantile(0.50),
        p90_us: h.value_at_quantile(0.90),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        p9999_us: h.value_at_quantile(0.9999),
        max_us: h.max(),
        mean_us: h.mean(),
    }
}

impl BenchReport {
    /// True when every request was answered `Ok` and nothing went wrong.
    pub fn clean(&self) -> bool {
        self.lost == 0
            && self.connection_errors.is_empty()
            && self.received > 0
            && self.by_status.get("ok").copied().unwrap_or(0) == self.received
    }
}

/// What `quiver bench --sweep` reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepReport {
    pub mode: String,
    pub p99_max_us: u64,
    /// Highest offered rate whose run held the bound with every request `Ok`.
    pub capacity_rate: Option<f64>,
    pub steps: Vec<BenchReport>,
}

/// Parses `START:STEP:MAX` (requests per second).
pub fn parse_sweep(s: &str) -> Result<(f64, f64, f64), String> {
    let parts: Vec<f64> = s
        .split(':')
        .map(|p| p.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("--sweep '{s}': expected START:STEP:MAX in requests per second"))?;
    match parts[..] {
        [start, step, max] if start > 0.0 && step > 0.0 && max >= start && (max - start) / step <= 1_000.0 => {
            Ok((start, step, max))
        }
        _ => Err(format!("--sweep '{s}': need 0 < START <= MAX, STEP > 0, at most 1000 steps")),
    }
}

/// The full latency record of a run, for files and plots.
pub struct Recording {
    pub total: Histogram<u64>,
    /// One histogram per `INTERVAL`, by response time since the start.
    pub intervals: Vec<Histogram<u64>>,
}

pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("static bounds are valid")
}

struct Conn {
    stream: Transport,
    wbuf: Vec<u8>,
    wsent: usize,
    rbuf: Vec<u8>,
    rfilled: usize,
    in_flight: usize,
    /// Redis answers in order: the ids of this connection's requests in
    /// flight, oldest first.
    fifo: std::collections::VecDeque<u64>,
    broken: bool,
}

/// CPU time of this process so far, from /proc (Linux).
fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let Some(rest) = stat.rsplit(')').next() else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum());
    ticks / 100.0
}

/// The TLS every connection of a run uses, built once.
fn tls_of(opts: &BenchOptions) -> Result<Option<transport::Tls>, String> {
    let Some(tls) = &opts.tls else {
        return Ok(None);
    };
    let config = crate::tls::client_config(tls).map_err(|e| format!("TLS: {e}"))?;
    let name = crate::tls::server_name(&opts.addr, tls).map_err(|e| format!("TLS: {e}"))?;
    Ok(Some(transport::Tls { config, name }))
}

struct Schedule {
    arrival: Arrival,
    interval_ns: f64,
    next_ns: f64,
    rng: SplitMix64,
}

impl Schedule {
    fn advance(&mut self) {
        self.next_ns += match self.arrival {
            Arrival::Uniform => self.interval_ns,
            Arrival::Poisson => -(1.0 - self.rng.unit()).ln() * self.interval_ns,
        };
    }
}

/// Runs the load, returning the report and the latency record.
pub fn run_recorded(opts: &BenchOptions) -> (BenchReport, Recording) {
    let n_conns = opts.connections.max(1);
    let mut report = BenchReport {
        mode: if opts.rate.is_some() { "open-loop" } else { "closed-loop" }.into(),
        protocol: opts.protocol,
        connections: n_conns,
        duration_s: opts.duration.as_secs_f64(),
        offered_rate: opts.rate,
        achieved_rate: 0.0,
        sent: 0,
        received: 0,
        lost: 0,
        connection_errors: Vec::new(),
        by_status: BTreeMap::new(),
        by_tier: BTreeMap::new(),
        latency: Latency::default(),
        late_sends: 0,
        generator_busy: 0.0,
        generator_cpu_s: 0.0,
        generator_saturated: false,
        by_priority: BTreeMap::new(),
        ids: IdsReport {
            users: opts.users,
            items: opts.items,
            user_dist: opts.user_dist.to_string(),
            item_dist: opts.item_dist.to_string(),
            ..IdsReport::default()
        },
    };
    let by_group = match &opts.workload {
        WorkloadKind::Auction32 => None,
        WorkloadKind::Fraud(mix) => Some((&fraud::GROUPS[..], &mix.populations[..], &mix.zipf[..])),
        WorkloadKind::Auction(mix) => Some((&auction::KEYED[..], &mix.populations[..], &mix.zipf[..])),
    };
    if let Some((names, populations, zipf)) = by_group {
        // No user or item ids are sent: the report names the groups instead.
        report.ids = IdsReport {
            groups: names.iter().map(|g| g.to_string()).zip(populations.iter().copied()).collect(),
            group_dist: names
                .iter()
                .zip(zipf)
                .map(|(g, &s)| format!("{g} {}", IdDist::Zipf(s)))
                .collect::<Vec<_>>()
                .join(", "),
            ..IdsReport::default()
        };
    }
    let mut rec = Recording {
        total: histogram(),
        intervals: (0..(opts.duration + DRAIN_MAX).as_secs() + 2).map(|_| histogram()).collect(),
    };
    let mut workload = match opts.workload() {
        Ok(w) => w,
        Err(e) => {
            report.connection_errors.push(e);
            return (report, rec);
        }
    };
    if opts.protocol == Protocol::Redis {
        if let Err(e) = redis_floor::prepare(&opts.addr, opts.redis_value_bytes) {
            report.connection_errors.push(e);
            return (report, rec);
        }
    }
    let fifo_cap = if opts.protocol == Protocol::Redis { IN_FLIGHT_MAX / n_conns + 1 } else { 0 };
    let tls = match tls_of(opts) {
        Ok(t) => t,
        Err(e) => {
            report.connection_errors.push(e);
            return (report, rec);
        }
    };
    let mut conns = Vec::with_capacity(n_conns);
    for _ in 0..n_conns {
        match Transport::connect(&opts.addr, tls.as_ref()) {
            Ok(stream) => conns.push(Conn {
                stream,
                wbuf: Vec::with_capacity(64 * 1024),
                wsent: 0,
                rbuf: vec![0; 256 * 1024],
                rfilled: 0,
                in_flight: 0,
                fifo: std::collections::VecDeque::with_capacity(fifo_cap),
                broken: false,
            }),
            Err(e) => report.connection_errors.push(e.to_string()),
        }
    }
    if conns.is_empty() {
        return (report, rec);
    }

    let mut schedule = opts.rate.map(|rate| Schedule {
        arrival: opts.arrival,
        interval_ns: 1e9 / rate,
        next_ns: 0.0,
        rng: SplitMix64::new(opts.seed ^ 0xA5A5_A5A5),
    });
    let codec = Codec::default();
    let mut encoder = Codec::default();
    let mut key_scratch = String::with_capacity(64);
    let protocol = opts.protocol;
    let mut send = |c: &mut Conn, seq: u64, spec: &RequestSpec| match protocol {
        Protocol::Quiver => encoder.encode(spec, &mut c.wbuf),
        Protocol::Redis => {
            redis_floor::encode_get(seq, &mut c.wbuf, &mut key_scratch);
            c.fifo.push_back(seq);
        }
    };
    let mut spec = RequestSpec::default();
    // Per priority of the mix: its draw, what was sent and how it came back.
    let mut mix_rng = SplitMix64::new(opts.seed ^ 0x5052_494F);
    let mut by_priority: Vec<(PriorityReport, Histogram<u64>)> =
        opts.priority_mix.iter().map(|_| (PriorityReport::default(), histogram())).collect();
    // Index into the mix of request `id`, by the same ring as `sent_ns`.
    let mut sent_mix = vec![0u8; if opts.priority_mix.is_empty() { 0 } else { IN_FLIGHT_MAX }];
    // Send time (open loop: intended time) of request `id`, in ns since start.
    let mut sent_ns = vec![0u64; IN_FLIGHT_MAX];
    let mask = (IN_FLIGHT_MAX - 1) as u64;
    let (mut seq, mut next_conn, mut in_flight_total) = (0u64, 0usize, 0usize);
    let duration_ns = opts.duration.as_nanos() as u64;
    let drain_end_ns = duration_ns + DRAIN_MAX.as_nanos() as u64;
    let (mut busy_ns, mut loop_start_ns) = (0u64, 0u64);
    let cpu_before = process_cpu_s();
    let start = Instant::now();

    loop {
        let now_ns = start.elapsed().as_nanos() as u64;
        let mut did_work = false;
        let sending = now_ns < duration_ns && seq < REQUESTS_MAX;
        if !sending && (in_flight_total == 0 || now_ns >= drain_end_ns) {
            break;
        }

        // Send what is due.
        if sending {
            match &mut schedule {
                Some(sched) => {
                    while (sched.next_ns as u64) <= now_ns && in_flight_total < IN_FLIGHT_MAX {
                        let due_ns = sched.next_ns as u64;
                        report.late_sends += u64::from(now_ns - due_ns > 1_000_000);
                        let c = next_conn % conns.len();
                        next_conn += 1;
                        if conns[c].broken {
                            sched.advance();
                            continue;
                        }
                        workload.fill(seq, &mut spec);
                        if let Some(i) = pick_priority(&opts.priority_mix, &mut mix_rng) {
                            spec.priority = opts.priority_mix[i].0;
                            sent_mix[(seq & mask) as usize] = i as u8;
                            by_priority[i].0.sent += 1;
                        }
                        send(&mut conns[c], seq, &spec);
                        sent_ns[(seq & mask) as usize] = due_ns;
                        conns[c].in_flight += 1;
                        in_flight_total += 1;
                        seq += 1;
                        sched.advance();
                        did_work = true;
                    }
                }
                None => {
                    for c in conns.iter_mut().filter(|c| !c.broken) {
                        while c.in_flight < opts.pipeline.max(1) && in_flight_total < IN_FLIGHT_MAX {
                            workload.fill(seq, &mut spec);
                            if let Some(i) = pick_priority(&opts.priority_mix, &mut mix_rng) {
                                spec.priority = opts.priority_mix[i].0;
                                sent_mix[(seq & mask) as usize] = i as u8;
                                by_priority[i].0.sent += 1;
                            }
                            send(c, seq, &spec);
                            sent_ns[(seq & mask) as usize] = now_ns;
                            c.in_flight += 1;
                            in_flight_total += 1;
                            seq += 1;
                            did_work = true;
                        }
                    }
                }
            }
        }

        for c in conns.iter_mut().filter(|c| !c.broken) {
            // Flush.
            if let Err(e) = c.stream.flush() {
                report.connection_errors.push(e.to_string());
                c.broken = true;
            }
            while !c.broken && c.wsent < c.wbuf.len() {
                match c.stream.write(&c.wbuf[c.wsent..]) {
                    Ok(n) => {
                        c.wsent += n;
                        did_work = true;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        report.connection_errors.push(e.to_string());
                        c.broken = true;
                        break;
                    }
                }
            }
            if c.wsent == c.wbuf.len() {
                c.wbuf.clear();
                c.wsent = 0;
            }
            // Receive.
            if c.rfilled == c.rbuf.len() {
                c.rbuf.resize(c.rbuf.len() * 2, 0);
            }
            match c.stream.read(&mut c.rbuf[c.rfilled..]) {
                Ok(0) => {
                    report.connection_errors.push("the server closed the connection".into());
                    c.broken = true;
                }
                Ok(n) => {
                    c.rfilled += n;
                    did_work = true;
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => {}
                Err(e) => {
                    report.connection_errors.push(e.to_string());
                    c.broken = true;
                }
            }
            let mut at = 0;
            let recv_ns = start.elapsed().as_nanos() as u64;
            loop {
                // (request id, status name, tier name when answered, bytes used)
                let next = match protocol {
                    Protocol::Quiver => codec.decode(&c.rbuf[at..c.rfilled]).map_err(|e| e.to_string()).map(|r| {
                        r.map(|(resp, used)| {
                            let tier = (resp.status == Status::Ok).then(|| tier_name(resp.tier));
                            (resp.request_id, status_name(resp.status), tier, used)
                        })
                    }),
                    Protocol::Redis => redis_floor::decode(&c.rbuf[at..c.rfilled]).and_then(|r| match r {
                        None => Ok(None),
                        Some((reply, used)) => match c.fifo.pop_front() {
                            Some(id) => Ok(Some((id, reply.name(), None, used))),
                            None => Err("a Redis reply to no request".into()),
                        },
                    }),
                };
                match next {
                    Ok(Some((request_id, status, tier, used))) => {
                        at += used;
                        if request_id >= seq || seq - request_id > IN_FLIGHT_MAX as u64 {
                            report.connection_errors.push(format!("response for unknown request {request_id}"));
                            c.broken = true;
                            break;
                        }
                        let latency_us = (recv_ns.saturating_sub(sent_ns[(request_id & mask) as usize]) / 1_000).max(1);
                        rec.total.saturating_record(latency_us);
                        let slot = ((recv_ns / INTERVAL.as_nanos() as u64) as usize).min(rec.intervals.len() - 1);
                        rec.intervals[slot].saturating_record(latency_us);
                        report.received += 1;
                        *report.by_status.entry(status.into()).or_default() += 1;
                        if let Some(tier) = tier {
                            *report.by_tier.entry(tier.into()).or_default() += 1;
                        }
                        let mix = sent_mix.get((request_id & mask) as usize);
                        if let Some((p, h)) = mix.and_then(|&i| by_priority.get_mut(usize::from(i))) {
                            h.saturating_record(latency_us);
                            p.received += 1;
                            *p.by_status.entry(status.into()).or_default() += 1;
                            if let Some(tier) = tier {
                                *p.by_tier.entry(tier.into()).or_default() += 1;
                            }
                        }
                        c.in_flight = c.in_flight.saturating_sub(1);
                        in_flight_total = in_flight_total.saturating_sub(1);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        report.connection_errors.push(e);
                        c.broken = true;
                        break;
                    }
                }
            }
            c.rbuf.copy_within(at..c.rfilled, 0);
            c.rfilled -= at;
            if c.broken {
                in_flight_total -= c.in_flight.min(in_flight_total);
                c.in_flight = 0;
            }
        }
        if conns.iter().all(|c| c.broken) {
            break;
        }
        let end_ns = start.elapsed().as_nanos() as u64;
        if did_work {
            busy_ns += end_ns - loop_start_ns.max(now_ns);
        }
        loop_start_ns = end_ns;
        std::hint::spin_loop();
    }

    let elapsed = start.elapsed().as_secs_f64().max(1e-9);
    report.generator_cpu_s = process_cpu_s() - cpu_before;
    report.generator_busy = (busy_ns as f64 / 1e9 / elapsed).min(1.0);
    report.sent = seq;
    report.lost = report.sent.saturating_sub(report.received);
    // Wall time from the first scheduled send to the last response.
    report.achieved_rate = report.received as f64 / elapsed;
    // Late sends alone can be the machine pausing the generator (a VM's
    // vCPU descheduled for a few ms); many of them, or a busy loop, mean the
    // generator cannot keep up with the offered rate.
    report.generator_saturated = report.generator_busy > BUSY_WARN || report.late_sends * 100 > report.sent.max(1);
    report.latency = latency_of(&rec.total);
    for (&(priority, _), (mut p, h)) in opts.priority_mix.iter().zip(by_priority) {
        p.latency = latency_of(&h);
        report.by_priority.insert(priority.to_string(), p);
    }
    (report, rec)
}

/// Runs the load and returns the report.
pub fn run(opts: &BenchOptions) -> BenchReport {
    run_recorded(opts).0
}

/// A rate sweep: open-loop runs of `opts` at `start`, `start + step`, ...
/// up to `max` requests/s.
#[derive(Clone, Copy, Debug)]
pub struct Sweep {
    pub start: f64,
    pub step: f64,
    pub max: f64,
    /// Runs per rate; the rate's figures are its run with the median p99,
    /// so one pause of a shared VM does not end the sweep.
    pub repeats: usize,
    /// A rate holds when every run of it was clean (every request `Ok`,
    /// the generator not saturated) and the median run's p99 is within this.
    pub p99_max_us: u64,
}

/// Raises the offered rate until a rate does not hold (or `max`), and
/// returns each rate's median run and the highest rate that held.
/// `on_step` hears each rate, its median run's report and recording, and
/// whether it held; an error from it ends the sweep.
pub fn sweep<E>(
    opts: &BenchOptions,
    sweep: &Sweep,
    mut on_step: impl FnMut(f64, &BenchReport, &Recording, bool) -> Result<(), E>,
) -> Result<SweepReport, E> {
    let mut opts = opts.clone();
    let mut steps = Vec::new();
    let mut capacity = None;
    let mut rate = sweep.start;
    while rate <= sweep.max * (1.0 + 1e-9) && sweep.step > 0.0 {
        opts.rate = Some(rate);
        let mut runs: Vec<_> = (0..sweep.repeats.max(1)).map(|_| run_recorded(&opts)).collect();
        runs.sort_by_key(|(r, _)| r.latency.p99_us);
        let all_clean = runs.iter().all(|(r, _)| r.clean() && !r.generator_saturated);
        let (report, rec) = runs.swap_remove(runs.len() / 2);
        let held = all_clean && report.latency.p99_us <= sweep.p99_max_us;
        on_step(rate, &report, &rec, held)?;
        steps.push(report);
        if !held {
            break;
        }
        capacity = Some(rate);
        rate += sweep.step;
    }
    Ok(SweepReport { mode: "sweep".into(), p99_max_us: sweep.p99_max_us, capacity_rate: capacity, steps })
}

impl Recording {
    /// Writes the HdrHistogram interval log (one histogram per second).
    pub fn write_interval_log(&self, path: &Path, tag: &str) -> std::io::Result<()> {
        use hdrhistogram::serialization::interval_log::{IntervalLogWriterBuilder, Tag};
        use hdrhistogram::serialization::V2DeflateSerializer;
        let mut out = Vec::new();
        let mut serializer = V2DeflateSerializer::new();
        {
            let mut writer = IntervalLogWriterBuilder::new()
                .add_comment("quiver bench: latency in microseconds from intended send time")
                .with_max_value_divisor(1.0)
                .begin_log_with(&mut out, &mut serializer)?;
            for (i, h) in self.intervals.iter().enumerate().filter(|(_, h)| !h.is_empty()) {
                writer
                    .write_histogram(h, INTERVAL * i as u32, INTERVAL, Tag::new(tag))
                    .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
            }
        }
        std::fs::write(path, out)
    }

    /// Writes the percentile distribution in HdrHistogram's `.hgrm` text form.
    pub fn write_percentiles(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, percentile_distribution(&self.total))
    }
}

/// HdrHistogram's percentile distribution text (`Value Percentile TotalCount 1/(1-Percentile)`).
pub fn percentile_distribution(h: &Histogram<u64>) -> String {
    let mut s = String::from("       Value     Percentile TotalCount 1/(1-Percentile)\n\n");
    for v in h.iter_quantiles(5) {
        let q = v.quantile_iterated_to();
        let inv = if q < 1.0 { format!("{:14.2}", 1.0 / (1.0 - q)) } else { String::new() };
        s.push_str(&format!(
            "{:12.3} {:14.12} {:10} {inv}\n",
            v.value_iterated_to() as f64,
            q,
            v.count_since_last_iteration()
        ));
    }
    s.push_str(&format!(
        "#[Mean    = {:12.3}, StdDeviation   = {:12.3}]\n#[Max     = {:12.3}, Total count    = {:12}]\n",
        h.mean(),
        h.stdev(),
        h.max() as f64,
        h.len()
    ));
    s
}

/// Parses a percentile distribution written by [`percentile_distribution`]
/// (or any `.hgrm` file) into (percentile, value) points.
pub fn parse_percentiles(text: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let value: f64 = f.next()?.parse().ok()?;
            let q: f64 = f.next()?.parse().ok()?;
            Some((q * 100.0, value))
        })
        .collect()
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.offered_rate {
            Some(r) => writeln!(
                f,
                "open loop: {} connections, offered {r:.0} req/s for {:.1}s; latency from intended send time",
                self.connections, self.duration_s
            )?,
            None => writeln!(
                f,
                "closed loop: {} connections, fixed requests in flight, {:.1}s; latency is service time, not latency at a load",
                self.connections, self.duration_s
            )?,
        }
        writeln!(
            f,
            "achieved {:.0} req/s: {} sent, {} answered, {} lost",
            self.achieved_rate, self.sent, self.received, self.lost
        )?;
        if self.protocol == Protocol::Quiver {
            let i = &self.ids;
            if i.groups.is_empty() {
                writeln!(f, "ids: {} users ({}), {} items ({})", i.users, i.user_dist, i.items, i.item_dist)?;
            } else {
                let groups: Vec<String> = i.groups.iter().map(|(g, n)| format!("{n} {g}s")).collect();
                writeln!(f, "ids: {} ({})", groups.join(", "), i.group_dist)?;
            }
        }
        let l = &self.latency;
        writeln!(
            f,
            "latency µs: p50 {}  p90 {}  p99 {}  p99.9 {}  p99.99 {}  max {}  mean {:.1}",
            l.p50_us, l.p90_us, l.p99_us, l.p999_us, l.p9999_us, l.max_us, l.mean_us
        )?;
        let join = |m: &BTreeMap<String, u64>| m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        writeln!(f, "status: {}", join(&self.by_status))?;
        writeln!(f, "tier: {}", join(&self.by_tier))?;
        writeln!(f, "generator: loop busy {:.0}%, {:.2} CPU s", self.generator_busy * 100.0, self.generator_cpu_s)?;
        if self.late_sends > 0 && !self.generator_saturated {
            writeln!(
                f,
                "note: {} sends left more than 1 ms late (the generator was paused); their latency counts from the intended time",
                self.late_sends
            )?;
        }
        if self.generator_saturated {
            writeln!(
                f,
                "warning: the generator is saturated ({} sends more than 1 ms late, loop busy {:.0}%): the offered rate was not held",
                self.late_sends,
                self.generator_busy * 100.0
            )?;
        }
        for (priority, p) in &self.by_priority {
            let l = &p.latency;
            writeln!(
                f,
                "priority {priority}: {} sent, {} answered; p50 {} µs  p99 {} µs  max {} µs; status: {}",
                p.sent,
                p.received,
                l.p50_us,
                l.p99_us,
                l.max_us,
                join(&p.by_status)
            )?;
        }
        for e in &self.connection_errors {
            writeln!(f, "connection error: {e}")?;
        }
        Ok(())
    }
}

/// Parses durations like `500ms`, `5s`, `2m`, `250us`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("'{s}' is not a duration like 5s or 500ms"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "m" => n * 60.0,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (us, ms, s, m)")),
    };
    if !secs.is_finite() || !(0.0..=86_400.0).contains(&secs) {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("10us").unwrap(), Duration::from_micros(10));
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("fast").is_err());
    }

    #[test]
    fn priority_mixes() {
        assert_eq!(parse_priority_mix("0:3,9:1").unwrap(), vec![(0, 0.75), (9, 0.25)]);
        assert!(parse_priority_mix("0:1,0:1").is_err(), "a priority twice");
        assert!(parse_priority_mix("256:1").is_err());
        assert!(parse_priority_mix("1:0").is_err());
        assert!(parse_priority_mix("1").is_err());
        let mix = parse_priority_mix("0:0.75,9:0.25").unwrap();
        let mut rng = SplitMix64::new(7);
        let high = (0..100_000).filter(|_| pick_priority(&mix, &mut rng) == Some(1)).count();
        assert!((24_000..26_000).contains(&high), "{high} of 100000 drew priority 9");
        assert_eq!(pick_priority(&[], &mut rng), None);
    }

    #[test]
    fn sweep_specs() {
        assert_eq!(parse_sweep("1000:500:3000").unwrap(), (1000.0, 500.0, 3000.0));
        assert!(parse_sweep("1000:0:3000").is_err());
        assert!(parse_sweep("3000:10:1000").is_err());
        assert!(parse_sweep("1:1:1000000").is_err());
        assert!(parse_sweep("fast").is_err());
    }

    #[test]
    fn poisson_schedule_keeps_the_mean_rate() {
        let mut s = Schedule { arrival: Arrival::Poisson, interval_ns: 1_000.0, next_ns: 0.0, rng: SplitMix64::new(1) };
        for _ in 0..100_000 {
            s.advance();
        }
        let mean = s.next_ns / 100_000.0;
        assert!((mean - 1_000.0).abs() < 15.0, "mean gap {mean} ns");
    }

    #[test]
    fn percentile_file_round_trips() {
        let mut h = histogram();
        for v in 1..=1000u64 {
            h.record(v).unwrap();
        }
        let points = parse_percentiles(&percentile_distribution(&h));
        assert!(points.len() > 10);
        let p50 = points.iter().find(|(q, _)| *q >= 50.0).unwrap().1;
        assert!((495.0..=505.0).contains(&p50), "{p50}");
        assert_eq!(points.last().unwrap().1, 1000.0);
    }
}
