//! A client over several Quiver nodes: balancing, health, failover and
//! hedged requests ("The Tail at Scale"), on non-blocking sockets driven by
//! one `poll(2)` loop in the caller's thread.
//!
//! Nodes are stateless apart from their replicas, so any node can answer any
//! request, and scoring is read-only, so sending a request twice is safe.
//! [`Cluster::submit`] picks a node by the power of two choices among nodes
//! not ejected: of the two drawn, the one with fewer outstanding requests,
//! unless one node's recent latency is more than twice the other's, when
//! the lower (outstanding + 1) × latency wins. Outstanding requests alone
//! let a slow node that happens to be idle win every tie, which at light
//! load is most picks; the factor of two keeps small differences between
//! healthy nodes from skewing the spread. A node's latency estimate is
//! the median of its last 16 answers (after 5), so one answer caught in a
//! pause does not shun a healthy node; it is forgotten after
//! [`LATENCY_MEMORY`] without an answer, and every 256th pick probes a
//! shunned node, so a node that was slow (or cold) and recovered is tried
//! again. [`Cluster::poll`] moves bytes and hands back
//! completed requests. A node's health comes from its answers: a connection
//! error, a timeout or `Overloaded` is a failure, and `eject_failures`
//! failures in a row eject it for a back-off that doubles (capped, with
//! jitter); afterwards one probe request decides whether it is re-admitted.
//! A request whose node failed is retried once on another node if its budget
//! still allows, else answered as failed with the reason: nothing hangs past
//! its deadline. A request still unanswered after the hedge delay (fixed, or
//! the node's recent p95) is sent to a second node with its remaining budget;
//! the first answer wins. Hedges are limited to a fraction of requests (a
//! token bucket, default 5%), so a slow cluster is not flooded.
//!
//! Limits: at most [`NODES_MAX`] nodes, `connections_per_node` pooled
//! connections each, at most `in_flight_max` outstanding requests overall
//! (`submit` refuses more).
//! Plain TCP only (TLS nodes take `Client`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::client::Codec;
use crate::wire::{RequestSpec, Response, Status};

/// When a request is hedged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Hedge {
    Off,
    /// After this long without an answer.
    After(Duration),
    /// After the first node's recent p95 (fixed `floor` until it has
    /// enough samples, and never below it).
    NodeP95 {
        floor: Duration,
    },
}

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub connections_per_node: usize,
    /// Outstanding requests over all nodes.
    pub in_flight_max: usize,
    /// A request without a budget (0) fails after this long.
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub hedge: Hedge,
    /// Hedges as a fraction of submitted requests, at most.
    pub hedge_fraction: f64,
    /// Consecutive failures that eject a node.
    pub eject_failures: u32,
    pub eject_min: Duration,
    pub eject_max: Duration,
    pub seed: u64,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            connections_per_node: 2,
            in_flight_max: 4096,
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(200),
            hedge: Hedge::Off,
            hedge_fraction: 0.05,
            eject_failures: 3,
            eject_min: Duration::from_millis(50),
            eject_max: Duration::from_secs(5),
            seed: 1,
        }
    }
}

#[derive(Debug, Clone)]
pub enum ClusterError {
    NoNode,
    TooManyNodes(usize),
    Full(usize),
    NodeFailed { node: String, why: String },
    Timeout,
}

impl std::fmt::Display for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterError::NoNode => f.write_str("no node is available (all ejected or unreachable)"),
            ClusterError::TooManyNodes(n) => write!(f, "{n} nodes listed; at most {NODES_MAX}"),
            ClusterError::Full(n) => write!(f, "{n} requests are outstanding, the limit"),
            ClusterError::NodeFailed { node, why } => {
                write!(f, "node {node} failed ({why}) and the budget left no time for a retry")
            }
            ClusterError::Timeout => f.write_str("no answer within the request's budget"),
        }
    }
}

impl std::error::Error for ClusterError {}

/// The balancer's draws (which two nodes to compare, back-off jitter):
/// xorshift64*, seeded by [`ClusterConfig::seed`] so a run can be replayed.
#[derive(Clone, Debug)]
struct Draws {
    state: u64,
}

impl Draws {
    fn new(seed: u64) -> Draws {
        // xorshift's state must not be zero.
        Draws { state: (seed ^ 0x2545_F491_4F6C_DD1D) | 1 }
    }

    fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, n), n > 0.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A submitted request, until [`Cluster::poll`] returns it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

/// What one node did, for reports.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct NodeStats {
    pub addr: String,
    /// Attempts sent (first tries, retries and hedges).
    pub sent: u64,
    /// Answers that completed a request.
    pub won: u64,
    pub failures: u64,
    /// Why the node last failed (a connection error, a timeout,
    /// `overloaded`); empty while it never has.
    pub last_failure: String,
    pub ejections: u64,
    pub hedges_sent: u64,
    /// The latency estimate the balancer used last (µs; the median of
    /// recent answers), 0 before it had enough.
    pub latency_us: u64,
}

struct Conn {
    stream: Option<TcpStream>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    /// Wire ids sent on this connection and not yet answered, with when
    /// they were sent: every answer is a latency sample, also one that lost
    /// to a hedge or came after its request's deadline (a slow node's
    /// answers are mostly those).
    in_flight: Vec<(u64, Instant)>,
}

struct Node {
    addr: String,
    resolved: Vec<SocketAddr>,
    conns: Vec<Conn>,
    next_conn: usize,
    outstanding: usize,
    failures_in_row: u32,
    ejected_until: Option<Instant>,
    eject_for: Duration,
    /// Re-admission is on trial: one request decides.
    probing: bool,
    /// Recent answer times (µs), for the p95 hedge delay.
    recent_us: VecDeque<u64>,
    /// The median of the last [`LATENCY_SAMPLES`] answer times (µs), once
    /// there are [`LATENCY_SAMPLES_MIN`], and when the last answer came.
    latency_median_us: Option<f64>,
    last_answer: Option<Instant>,
    stats: NodeStats,
}

impl Node {
    /// The node's recent latency (µs), if it answered within
    /// [`LATENCY_MEMORY`].
    fn latency_us(&self, now: Instant) -> Option<f64> {
        let at = self.last_answer?;
        if now.saturating_duration_since(at) < LATENCY_MEMORY {
            self.latency_median_us
        } else {
            None
        }
    }
}

/// One send of a request to a node.
#[derive(Clone, Copy)]
struct Attempt {
    node: usize,
    wire_id: u64,
}

struct Pending {
    spec: RequestSpec,
    deadline: Instant,
    attempts: Vec<Attempt>,
    hedge_at: Option<Instant>,
    retried: bool,
}

/// Nodes one client spreads over, at most: the balancer keeps the nodes it
/// may pick in a 64-bit mask, so picking allocates nothing.
pub const NODES_MAX: usize = 64;

const RECENT_MAX: usize = 256;
const RECENT_MIN_FOR_P95: usize = 20;

/// How long a latency estimate stands without a new answer. A node that is
/// shunned as slow gets no answers to update it; once this passes it
/// competes on outstanding requests alone until one comes back.
pub const LATENCY_MEMORY: Duration = Duration::from_secs(1);
/// Latencies within this factor of each other count as alike.
const LATENCY_ALIKE_FACTOR: f64 = 2.0;
/// The estimate is the median of this many recent answers, not an average:
/// one answer caught in a pause (a few ms on a VM, at its p99.9) must not
/// shun a healthy node for [`LATENCY_MEMORY`]; a node slow on every answer
/// is shunned after [`LATENCY_SAMPLES_MIN`] of them.
const LATENCY_SAMPLES: usize = 16;
const LATENCY_SAMPLES_MIN: usize = 5;
/// One pick in this many probes a shunned node: 0.4% of requests, under
/// any p99, and often enough that a node shunned while cold is back within
/// a few hundred requests.
const PROBE_PICKS: u64 = 256;

pub struct Cluster {
    config: ClusterConfig,
    nodes: Vec<Node>,
    pending: HashMap<u64, Pending>,
    /// Each pending request's deadline and hedge time, earliest first, as
    /// (when, ticket). An entry stays when its request completes or its
    /// hedge time moves and is checked against the request when it comes
    /// due, so a timer costs O(log n) a request instead of a scan of every
    /// pending request a poll.
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
    /// Wire id → ticket of the attempts outstanding.
    by_wire: HashMap<u64, u64>,
    next_ticket: u64,
    next_wire: u64,
    /// Picks made, for the probes of shunned nodes.
    picks: u64,
    hedge_tokens: f64,
    codec: Codec,
    rng: Draws,
    done: Vec<(Ticket, Result<Response, ClusterError>)>,
    pub hedges: u64,
    /// Hedges that were due but found the hedge budget spent.
    pub hedges_denied: u64,
    pub retries: u64,
}

impl Cluster {
    /// Nodes `addrs` (host:port each); nothing connects until a request
    /// needs it.
    pub fn new(addrs: &[String], config: ClusterConfig) -> Result<Cluster, ClusterError> {
        if addrs.is_empty() {
            return Err(ClusterError::NoNode);
        }
        if addrs.len() > NODES_MAX {
            return Err(ClusterError::TooManyNodes(addrs.len()));
        }
        let nodes = addrs
            .iter()
            .map(|a| Node {
                addr: a.clone(),
                resolved: a.to_socket_addrs().map(Iterator::collect).unwrap_or_default(),
                conns: (0..config.connections_per_node.max(1))
                    .map(|_| Conn { stream: None, rbuf: Vec::new(), wbuf: Vec::new(), in_flight: Vec::new() })
                    .collect(),
                next_conn: 0,
                outstanding: 0,
                failures_in_row: 0,
                ejected_until: None,
                eject_for: config.eject_min,
                probing: false,
                recent_us: VecDeque::with_capacity(RECENT_MAX),
                latency_median_us: None,
                last_answer: None,
                stats: NodeStats { addr: a.clone(), ..NodeStats::default() },
            })
            .collect();
        Ok(Cluster {
            rng: Draws::new(config.seed),
            config,
            nodes,
            pending: HashMap::new(),
            timers: BinaryHeap::new(),
            by_wire: HashMap::new(),
            next_ticket: 1,
            next_wire: 1,
            picks: 0,
            hedge_tokens: 1.0,
            codec: Codec::default(),
            done: Vec::new(),
            hedges: 0,
            hedges_denied: 0,
            retries: 0,
        })
    }

    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.nodes
            .iter()
            .map(|n| NodeStats { latency_us: n.latency_median_us.map_or(0, |l| l.round() as u64), ..n.stats.clone() })
            .collect()
    }

    /// Requests submitted and not yet returned by `poll`.
    pub fn outstanding(&self) -> usize {
        self.pending.len()
    }

    /// Whether node `i` may take a request now; a node whose ejection has
    /// passed takes one probe.
    fn available(&mut self, i: usize, now: Instant) -> bool {
        let n = &mut self.nodes[i];
        match n.ejected_until {
            Some(t) if now < t => false,
            Some(_) => {
                n.ejected_until = None;
                n.probing = true;
                n.outstanding == 0
            }
            None => !n.probing || n.outstanding == 0,
        }
    }

    /// The lowest latency estimate among the nodes in `mask`.
    fn best_latency_us(&self, mask: u64, now: Instant) -> Option<f64> {
        let known = self.nodes.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0);
        known.filter_map(|(_, n)| n.latency_us(now)).min_by(f64::total_cmp)
    }

    /// Power of two choices (see the module header), skipping the nodes
    /// whose bits `exclude` sets.
    /// Every [`PROBE_PICKS`]th pick goes to the shunned node (over twice the
    /// best latency) that answered longest ago, if any: a node shunned for
    /// answers it gave while cold, or that since recovered, would otherwise
    /// see no request to show it.
    fn pick(&mut self, exclude: u64, now: Instant) -> Option<usize> {
        let mut mask = 0u64;
        for i in 0..self.nodes.len() {
            if exclude & (1 << i) == 0 && self.available(i, now) {
                mask |= 1 << i;
            }
        }
        self.picks += 1;
        if self.picks.is_multiple_of(PROBE_PICKS) {
            if let Some(best) = self.best_latency_us(mask, now) {
                let shunned = (0..self.nodes.len())
                    .filter(|&i| mask & (1 << i) != 0)
                    .filter(|&i| self.nodes[i].latency_us(now).is_some_and(|l| l > LATENCY_ALIKE_FACTOR * best))
                    .min_by_key(|&i| self.nodes[i].last_answer);
                if shunned.is_some() {
                    return shunned;
                }
            }
        }
        // The k-th node of the mask, counting from the lowest.
        let nth = |mut k: u32| {
            let mut m = mask;
            while k > 0 {
                m &= m - 1;
                k -= 1;
            }
            m.trailing_zeros() as usize
        };
        match mask.count_ones() {
            0 => None,
            1 => Some(nth(0)),
            k => {
                let ia = self.rng.below(u64::from(k)) as u32;
                let mut ib = self.rng.below(u64::from(k) - 1) as u32;
                if ib == ia {
                    ib = k - 1;
                }
                let (a, b) = (nth(ia), nth(ib));
                Some(if prefers_second(&self.nodes[a], &self.nodes[b], now) { b } else { a })
            }
        }
    }

    /// Submits `spec`; its answer comes from [`Cluster::poll`].
    pub fn submit(&mut self, spec: &RequestSpec) -> Result<Ticket, ClusterError> {
        if self.pending.len() >= self.config.in_flight_max {
            return Err(ClusterError::Full(self.pending.len()));
        }
        let now = Instant::now();
        let budget =
            if spec.budget_us == 0 { self.config.timeout } else { Duration::from_micros(spec.budget_us.into()) };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.hedge_tokens = (self.hedge_tokens + self.config.hedge_fraction).min(10.0);
        let pending = Pending {
            spec: spec.clone(),
            deadline: now + budget,
            attempts: Vec::new(),
            hedge_at: None,
            retried: false,
        };
        self.timers.push(Reverse((pending.deadline, ticket)));
        self.pending.insert(ticket, pending);
        if let Err(e) = self.send_attempt(ticket, 0, now) {
            self.pending.remove(&ticket);
            return Err(e);
        }
        Ok(Ticket(ticket))
    }

    /// Sends `ticket` to a node not in `exclude`, with the budget left.
    fn send_attempt(&mut self, ticket: u64, exclude: u64, now: Instant) -> Result<(), ClusterError> {
        let mut tried = exclude;
        loop {
            let node = self.pick(tried, now).ok_or(ClusterError::NoNode)?;
            match self.send_to(ticket, node, now) {
                Ok(()) => return Ok(()),
                Err(why) => {
                    self.node_failed(node, &why, now);
                    tried |= 1 << node;
                }
            }
        }
    }

    fn send_to(&mut self, ticket: u64, node: usize, now: Instant) -> Result<(), String> {
        let wire_id = self.next_wire;
        self.next_wire += 1;
        let p = self.pending.get_mut(&ticket).expect("sending a pending request");
        let left_us = p.deadline.saturating_duration_since(now).as_micros().max(1);
        let mut spec = p.spec.clone();
        spec.request_id = wire_id;
        // The remaining budget travels with every attempt.
        spec.budget_us = u32::try_from(left_us).unwrap_or(u32::MAX);
        let n = &mut self.nodes[node];
        let c = n.next_conn % n.conns.len();
        n.next_conn += 1;
        let conn = &mut n.conns[c];
        if conn.stream.is_none() {
            conn.stream = Some(connect(&n.resolved, self.config.connect_timeout).map_err(|e| format!("connect: {e}"))?);
            conn.rbuf.clear();
            conn.wbuf.clear();
        }
        self.codec.encode(&spec, &mut conn.wbuf);
        conn.in_flight.push((wire_id, now));
        flush(conn).map_err(|e| format!("write: {e}"))?;
        n.outstanding += 1;
        n.stats.sent += 1;
        let p = self.pending.get_mut(&ticket).expect("as above");
        if p.attempts.is_empty() {
            p.hedge_at = match self.config.hedge {
                Hedge::Off => None,
                Hedge::After(d) => Some(now + d),
                Hedge::NodeP95 { floor } => Some(now + p95(&n.recent_us).max(floor)),
            };
            if let Some(at) = p.hedge_at {
                self.timers.push(Reverse((at, ticket)));
            }
        }
        p.attempts.push(Attempt { node, wire_id });
        self.by_wire.insert(wire_id, ticket);
        Ok(())
    }

    /// Counts a failure of `node`; ejects it after too many in a row or a
    /// failed probe; closes nothing (the caller does for I/O errors).
    fn node_failed(&mut self, node: usize, why: &str, now: Instant) {
        let n = &mut self.nodes[node];
        n.stats.failures += 1;
        n.stats.last_failure.clear();
        n.stats.last_failure.push_str(why);
        n.failures_in_row += 1;
        if n.probing || n.failures_in_row >= self.config.eject_failures {
            let jitter = 0.75 + 0.5 * self.rng.unit();
            n.ejected_until = Some(now + n.eject_for.mul_f64(jitter));
            n.eject_for = (n.eject_for * 2).min(self.config.eject_max);
            n.probing = false;
            n.stats.ejections += 1;
        }
    }

    fn node_ok(&mut self, node: usize, took: Duration, now: Instant) {
        let n = &mut self.nodes[node];
        n.failures_in_row = 0;
        if n.probing {
            n.probing = false;
            n.eject_for = self.config.eject_min;
        }
        self.observe_latency(node, took, now);
    }

    fn observe_latency(&mut self, node: usize, took: Duration, now: Instant) {
        let best = self.best_latency_us(!(1u64 << node), now);
        let took_us = took.as_micros() as u64;
        let n = &mut self.nodes[node];
        let shunned = matches!((n.latency_us(now), best), (Some(l), Some(b)) if l > LATENCY_ALIKE_FACTOR * b);
        if n.last_answer.is_some_and(|at| now.saturating_duration_since(at) >= LATENCY_MEMORY)
            || (shunned && best.is_some_and(|b| took_us as f64 <= LATENCY_ALIKE_FACTOR * b))
        {
            // Answers from before the gap describe another time; and a
            // shunned node that answers like the others starts afresh
            // rather than wait for its slow answers to age out of the median.
            n.recent_us.clear();
        }
        n.last_answer = Some(now);
        if n.recent_us.len() == RECENT_MAX {
            n.recent_us.pop_front();
        }
        n.recent_us.push_back(took_us);
        n.latency_median_us = (n.recent_us.len() >= LATENCY_SAMPLES_MIN).then(|| {
            let mut last = [0u64; LATENCY_SAMPLES];
            let k = n.recent_us.len().min(LATENCY_SAMPLES);
            for (slot, v) in last.iter_mut().zip(n.recent_us.iter().rev()) {
                *slot = *v;
            }
            let (_, m, _) = last[..k].select_nth_unstable(k / 2);
            *m as f64
        });
    }

    /// Drops connection `c` of `node` after an I/O error: its requests are
    /// retried elsewhere or failed.
    fn conn_failed(&mut self, node: usize, c: usize, why: String, now: Instant) {
        let lost = {
            let conn = &mut self.nodes[node].conns[c];
            conn.stream = None;
            conn.rbuf.clear();
            conn.wbuf.clear();
            std::mem::take(&mut conn.in_flight)
        };
        self.nodes[node].outstanding -= lost.len();
        self.node_failed(node, &why, now);
        for (wire_id, _) in lost {
            if let Some(ticket) = self.by_wire.remove(&wire_id) {
                self.attempt_lost(ticket, wire_id, node, &why, now);
            }
        }
    }

    /// An attempt ended without an answer: retry once elsewhere while
    /// another attempt is not still out and the budget allows, else fail.
    fn attempt_lost(&mut self, ticket: u64, wire_id: u64, node: usize, why: &str, now: Instant) {
        let Some(p) = self.pending.get_mut(&ticket) else { return };
        p.attempts.retain(|a| a.wire_id != wire_id);
        if !p.attempts.is_empty() {
            return;
        }
        let can_retry = !p.retried && now < p.deadline;
        if can_retry {
            p.retried = true;
            self.retries += 1;
            if self.send_attempt(ticket, 1 << node, now).is_ok() {
                return;
            }
        }
        self.pending.remove(&ticket);
        let e = ClusterError::NodeFailed { node: self.nodes[node].addr.clone(), why: why.into() };
        self.done.push((Ticket(ticket), Err(e)));
    }

    fn answered(&mut self, node: usize, c: usize, resp: Response, now: Instant) {
        let wire_id = resp.request_id;
        let conn = &mut self.nodes[node].conns[c];
        let Some(at) = conn.in_flight.iter().position(|(w, _)| *w == wire_id) else {
            self.conn_failed(node, c, format!("answer to request {wire_id}, which it was not sent"), now);
            return;
        };
        let (_, sent) = conn.in_flight.swap_remove(at);
        self.nodes[node].outstanding -= 1;
        let Some(ticket) = self.by_wire.remove(&wire_id) else {
            // An attempt that lost to another, or came after the deadline:
            // its time still says how fast the node is, but not that it is
            // healthy (a late answer does not undo its timeout).
            if resp.status != Status::Overloaded {
                self.observe_latency(node, now - sent, now);
            }
            return;
        };
        if resp.status == Status::Overloaded {
            // Backed off; another attempt still out, or a retry the budget
            // allows, answers instead.
            self.node_failed(node, "overloaded", now);
            let p = self.pending.get_mut(&ticket).expect("as above");
            if p.attempts.len() > 1 || (!p.retried && now < p.deadline) {
                self.attempt_lost(ticket, wire_id, node, "overloaded", now);
                return;
            }
        } else {
            self.node_ok(node, now - sent, now);
        }
        let p = self.pending.remove(&ticket).expect("as above");
        for a in &p.attempts {
            self.by_wire.remove(&a.wire_id);
        }
        self.nodes[node].stats.won += 1;
        let mut resp = resp;
        resp.request_id = p.spec.request_id;
        self.done.push((Ticket(ticket), Ok(resp)));
    }

    /// Moves bytes for up to `wait` (returning early once something
    /// completes) and returns the requests completed since the last call.
    pub fn poll(&mut self, wait: Duration) -> Vec<(Ticket, Result<Response, ClusterError>)> {
        let until = Instant::now() + wait;
        loop {
            let now = Instant::now();
            self.expire_and_hedge(now);
            if !self.done.is_empty() {
                return std::mem::take(&mut self.done);
            }
            let mut fds = Vec::new();
            let mut owners = Vec::new();
            for (i, n) in self.nodes.iter().enumerate() {
                for (c, conn) in n.conns.iter().enumerate() {
                    if let Some(s) = &conn.stream {
                        let mut events = libc::POLLIN;
                        if !conn.wbuf.is_empty() {
                            events |= libc::POLLOUT;
                        }
                        fds.push(libc::pollfd { fd: s.as_raw_fd(), events, revents: 0 });
                        owners.push((i, c));
                    }
                }
            }
            let next_timer = self.next_timer().map_or(until, |t| t.min(until));
            let timeout = next_timer.saturating_duration_since(now);
            let ts = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
            // SAFETY: `fds` is a live array of `fds.len()` pollfd structs; the
            // timeout and the (absent) signal mask are valid for the call.
            let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
            let now = Instant::now();
            if ready > 0 {
                for (fd, &(i, c)) in fds.iter().zip(&owners) {
                    if fd.revents == 0 {
                        continue;
                    }
                    if let Err(why) = self.service(i, c, now) {
                        self.conn_failed(i, c, why, now);
                    }
                }
            }
            if !self.done.is_empty() || now >= until {
                self.expire_and_hedge(now);
                return std::mem::take(&mut self.done);
            }
        }
    }

    /// Reads what connection `c` of `node` has and writes what it owes.
    fn service(&mut self, node: usize, c: usize, now: Instant) -> Result<(), String> {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            let conn = &mut self.nodes[node].conns[c];
            let Some(stream) = conn.stream.as_mut() else { return Ok(()) };
            match stream.read(&mut chunk) {
                Ok(0) => return Err("the node closed the connection".into()),
                Ok(k) => conn.rbuf.extend_from_slice(&chunk[..k]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        loop {
            let conn = &mut self.nodes[node].conns[c];
            let decoded = self.codec.decode(&conn.rbuf).map_err(|e| e.to_string())?;
            let Some((resp, used)) = decoded else { break };
            conn.rbuf.drain(..used);
            self.answered(node, c, resp, now);
            if self.nodes[node].conns[c].stream.is_none() {
                return Ok(());
            }
        }
        flush(&mut self.nodes[node].conns[c]).map_err(|e| format!("write: {e}"))
    }

    fn next_timer(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Fails requests past their deadline and sends the hedges due.
    fn expire_and_hedge(&mut self, now: Instant) {
        while let Some(&Reverse((at, t))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            // Gone or moved: the request completed, or its hedge was reset.
            let Some(p) = self.pending.get_mut(&t) else { continue };
            if now >= p.deadline {
                let p = self.pending.remove(&t).expect("looked up above");
                for a in &p.attempts {
                    self.by_wire.remove(&a.wire_id);
                    // The node still owes the answer; it is dropped when it comes.
                    self.node_failed(a.node, "timeout", now);
                }
                self.done.push((Ticket(t), Err(ClusterError::Timeout)));
                continue;
            }
            if p.hedge_at.is_none_or(|h| now < h) {
                continue;
            }
            p.hedge_at = None;
            if self.hedge_tokens < 1.0 {
                self.hedges_denied += 1;
                continue;
            }
            let exclude = p.attempts.iter().fold(0u64, |m, a| m | 1 << a.node);
            let Some(node) = self.pick(exclude, now) else { continue };
            self.hedge_tokens -= 1.0;
            match self.send_to(t, node, now) {
                Ok(()) => {
                    self.hedges += 1;
                    self.nodes[node].stats.hedges_sent += 1;
                }
                Err(why) => self.node_failed(node, &why, now),
            }
        }
    }

    /// Submits `spec` and waits for its answer (other completions that
    /// arrive meanwhile are kept for the next `poll`).
    pub fn score(&mut self, spec: &RequestSpec) -> Result<Response, ClusterError> {
        let ticket = self.submit(spec)?;
        let mut others = Vec::new();
        let result = loop {
            let mut got = None;
            for (t, r) in self.poll(Duration::from_millis(50)) {
                if t == ticket {
                    got = Some(r);
                } else {
                    others.push((t, r));
                }
            }
            if let Some(r) = got {
                break r;
            }
        };
        self.done.extend(others);
        result
    }
}

/// Whether the power of two choices takes `b` over `a` (ties go to `a`).
fn prefers_second(a: &Node, b: &Node, now: Instant) -> bool {
    let (oa, ob) = (a.outstanding as f64, b.outstanding as f64);
    match (a.latency_us(now), b.latency_us(now)) {
        (Some(la), Some(lb)) if la > LATENCY_ALIKE_FACTOR * lb || lb > LATENCY_ALIKE_FACTOR * la => {
            (ob + 1.0) * lb < (oa + 1.0) * la
        }
        _ => ob < oa,
    }
}

/// The p95 of `recent` (µs), or zero without enough samples.
fn p95(recent: &VecDeque<u64>) -> Duration {
    if recent.len() < RECENT_MIN_FOR_P95 {
        return Duration::ZERO;
    }
    let mut v: Vec<u64> = recent.iter().copied().collect();
    let k = (v.len() * 95).div_ceil(100) - 1;
    let (_, p, _) = v.select_nth_unstable(k);
    Duration::from_micros(*p)
}

fn connect(addrs: &[SocketAddr], timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(ErrorKind::NotFound, "the address did not resolve");
    for a in addrs {
        match TcpStream::connect_timeout(a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Writes what the socket takes now; the rest waits for POLLOUT.
fn flush(conn: &mut Conn) -> std::io::Result<()> {
    let Some(stream) = conn.stream.as_mut() else { return Ok(()) };
    while !conn.wbuf.is_empty() {
        match stream.write(&conn.wbuf) {
            Ok(0) => return Err(std::io::Error::new(ErrorKind::WriteZero, "wrote nothing")),
            Ok(k) => {
                conn.wbuf.drain(..k);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_p95_needs_samples_and_takes_the_high_tail() {
        let mut r: VecDeque<u64> = (1..=10).collect();
        assert_eq!(p95(&r), Duration::ZERO);
        r = (1..=100).collect();
        assert_eq!(p95(&r), Duration::from_micros(95));
    }

    fn node(outstanding: usize, latency_us: f64, answered: Option<Instant>) -> Node {
        Node {
            addr: String::new(),
            resolved: Vec::new(),
            conns: Vec::new(),
            next_conn: 0,
            outstanding,
            failures_in_row: 0,
            ejected_until: None,
            eject_for: Duration::ZERO,
            probing: false,
            recent_us: VecDeque::new(),
            latency_median_us: Some(latency_us),
            last_answer: answered,
            stats: NodeStats::default(),
        }
    }

    #[test]
    fn a_node_over_twice_as_slow_loses_ties_and_a_forgotten_one_competes_again() {
        let now = Instant::now();
        let fresh = Some(now);
        // Alike latencies: outstanding requests decide, ties go to the first.
        assert!(!prefers_second(&node(0, 300.0, fresh), &node(0, 500.0, fresh), now));
        assert!(prefers_second(&node(2, 300.0, fresh), &node(1, 500.0, fresh), now));
        // Ten times slower: idle, it still loses to a fast node with
        // fewer than nine outstanding.
        assert!(prefers_second(&node(0, 4_000.0, fresh), &node(0, 400.0, fresh), now));
        assert!(prefers_second(&node(0, 4_000.0, fresh), &node(8, 400.0, fresh), now));
        assert!(!prefers_second(&node(0, 4_000.0, fresh), &node(10, 400.0, fresh), now));
        assert!(!prefers_second(&node(0, 400.0, fresh), &node(0, 4_000.0, fresh), now));
        // No answer for LATENCY_MEMORY: the estimate no longer counts.
        let later = now + LATENCY_MEMORY;
        assert!(!prefers_second(&node(0, 4_000.0, fresh), &node(0, 400.0, Some(later)), later));
        assert!(!prefers_second(&node(0, 4_000.0, None), &node(0, 400.0, fresh), now));
    }

    #[test]
    fn picks_spread_over_the_nodes_allowed_and_never_an_excluded_one() {
        let addrs: Vec<String> = (0..5).map(|p| format!("127.0.0.1:{}", 1000 + p)).collect();
        let mut c = Cluster::new(&addrs, ClusterConfig::default()).unwrap();
        let now = Instant::now();
        let mut counts = [0u32; 5];
        for _ in 0..30_000 {
            counts[c.pick(0b1010, now).unwrap()] += 1;
        }
        assert_eq!((counts[1], counts[3]), (0, 0), "{counts:?}");
        for i in [0, 2, 4] {
            assert!((9_000..=11_000).contains(&counts[i]), "{counts:?}");
        }
        assert_eq!(c.pick(0b1111, now), Some(4));
        assert_eq!(c.pick(0b11111, now), None);
    }

    #[test]
    fn a_shunned_node_gets_every_256th_pick_and_one_fast_answer_lifts_the_shun() {
        let addrs: Vec<String> = (0..3).map(|p| format!("127.0.0.1:{}", 1000 + p)).collect();
        let mut c = Cluster::new(&addrs, ClusterConfig::default()).unwrap();
        let now = Instant::now();
        for (i, took_us) in [(0, 100), (1, 100), (2, 5_000)] {
            for _ in 0..LATENCY_SAMPLES {
                c.observe_latency(i, Duration::from_micros(took_us), now);
            }
        }
        let mut counts = [0u32; 3];
        for _ in 0..2_560 {
            counts[c.pick(0, now).unwrap()] += 1;
        }
        assert_eq!(counts[2], 10, "{counts:?}");
        // One answer like the others': the old slow ones no longer count.
        c.observe_latency(2, Duration::from_micros(120), now);
        assert_eq!(c.nodes[2].latency_us(now), None);
        let mut counts = [0u32; 3];
        for _ in 0..3_000 {
            counts[c.pick(0, now).unwrap()] += 1;
        }
        assert!(counts[2] > 800, "{counts:?}");
    }

    #[test]
    fn silent_nodes_are_hedged_then_timed_out_at_the_deadline() {
        // Listening sockets nobody accepts from: connects succeed, nothing
        // ever answers.
        let silent: Vec<std::net::TcpListener> =
            (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let addrs: Vec<String> = silent.iter().map(|l| l.local_addr().unwrap().to_string()).collect();
        // Hedge and deadlines 50 ms apart or more: a thread of a busy
        // machine can wait that long to run, but not the 100s of ms here.
        let config = ClusterConfig { hedge: Hedge::After(Duration::from_millis(50)), ..ClusterConfig::default() };
        let mut c = Cluster::new(&addrs, config).unwrap();
        let spec = RequestSpec { item_ids: vec![1], budget_us: 400_000, ..RequestSpec::default() };
        let started = Instant::now();
        let first = c.submit(&spec).unwrap();
        let second = c.submit(&RequestSpec { budget_us: 200_000, ..spec.clone() }).unwrap();
        let mut order = Vec::new();
        while order.len() < 2 {
            for (t, r) in c.poll(Duration::from_millis(100)) {
                assert!(matches!(r, Err(ClusterError::Timeout)), "{r:?}");
                order.push((t, started.elapsed()));
            }
            assert!(started.elapsed() < Duration::from_secs(10), "hung");
        }
        // The shorter budget ends first; each ends at its own deadline.
        assert_eq!((order[0].0, order[1].0), (second, first));
        assert!(order[0].1 >= Duration::from_millis(200) && order[1].1 >= Duration::from_millis(400), "{order:?}");
        // The bucket starts with one hedge and earns a twentieth a request.
        assert_eq!((c.hedges, c.hedges_denied, c.outstanding()), (1, 1, 0));
    }

    #[test]
    fn no_nodes_and_unreachable_nodes_are_errors_not_hangs() {
        assert!(matches!(Cluster::new(&[], ClusterConfig::default()), Err(ClusterError::NoNode)));
        let many: Vec<String> = (0..=NODES_MAX).map(|p| format!("127.0.0.1:{}", 1000 + p)).collect();
        let e = Cluster::new(&many, ClusterConfig::default()).err().expect("over the limit");
        assert_eq!(e.to_string(), "65 nodes listed; at most 64");
        assert!(Cluster::new(&many[..NODES_MAX], ClusterConfig::default()).is_ok());
        // A port nothing listens on (bound, then dropped).
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let mut c = Cluster::new(&[addr], ClusterConfig::default()).unwrap();
        let spec = RequestSpec { item_ids: vec![1], budget_us: 50_000, ..RequestSpec::default() };
        assert!(matches!(c.score(&spec), Err(ClusterError::NoNode)));
    }
}
