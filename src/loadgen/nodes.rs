//! `quiver bench --addr a,b,c`: load across several nodes through the
//! multi-node client (`crate::client::cluster`), so what a bidder with a node list
//! sees is measured: balancing, failover and hedging included.
//!
//! Open loop at `--rate` (uniform arrivals; latency from each request's
//! intended send time, so a stalled client or node is not hidden), or closed
//! loop with `--pipeline` requests outstanding per node. The report gives
//! the overall latency, each node's share and failures, and the hedge and
//! retry rates.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{histogram, latency_of, BenchOptions, Latency};
use crate::client::cluster::{Cluster, ClusterConfig, Hedge, NodeStats};
use crate::loadgen::BenchWorkload;
use crate::wire::{status_name, tier_name, RequestSpec};

/// Requests outstanding at once, at most (an open loop past capacity
/// queues in the client up to this).
const IN_FLIGHT_MAX: usize = 65_536;

/// What the multi-node bench adds to the client's settings.
#[derive(Clone, Debug)]
pub struct NodesOptions {
    pub addrs: Vec<String>,
    pub hedge: Hedge,
    pub hedge_fraction: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct NodesReport {
    pub mode: String,
    pub duration_s: f64,
    pub offered_rate: Option<f64>,
    pub achieved_rate: f64,
    pub sent: u64,
    pub received: u64,
    /// Requests the client answered with an error (no node, timeout, a
    /// failed node past the budget's retry).
    pub failed: BTreeMap<String, u64>,
    pub by_status: BTreeMap<String, u64>,
    pub by_tier: BTreeMap<String, u64>,
    pub latency: Latency,
    pub hedges: u64,
    pub hedge_rate: f64,
    /// Hedges that were due but found the budget (`--hedge-fraction`) spent.
    pub hedges_denied: u64,
    pub retries: u64,
    pub nodes: Vec<NodeStats>,
}

impl std::fmt::Display for NodesReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let l = &self.latency;
        writeln!(f, "{} over {} nodes, {:.1} s", self.mode, self.nodes.len(), self.duration_s)?;
        writeln!(f, "  rate      {:.0} req/s ({} sent, {} answered)", self.achieved_rate, self.sent, self.received)?;
        writeln!(
            f,
            "  latency   p50 {} µs  p99 {} µs  p99.9 {} µs  max {} µs",
            l.p50_us, l.p99_us, l.p999_us, l.max_us
        )?;
        writeln!(
            f,
            "  hedges    {} ({:.2}% of requests, {} more due but over the budget), retries {}",
            self.hedges,
            self.hedge_rate * 100.0,
            self.hedges_denied,
            self.retries
        )?;
        for n in &self.nodes {
            writeln!(
                f,
                "  node {:<21} sent {:>8}  won {:>8}  failures {:>5}  ejections {:>3}  hedges sent {:>6}  latency {:>6} µs",
                n.addr, n.sent, n.won, n.failures, n.ejections, n.hedges_sent, n.latency_us
            )?;
        }
        if !self.failed.is_empty() {
            writeln!(f, "  failed    {:?}", self.failed)?;
        }
        Ok(())
    }
}

/// Runs the bench `opts` describes over `nodes.addrs`, its requests drawn
/// from `workload` (`BenchOptions::workload`).
pub fn run(
    opts: &BenchOptions,
    nodes: &NodesOptions,
    mut workload: BenchWorkload,
) -> Result<NodesReport, crate::client::cluster::ClusterError> {
    let window = opts.pipeline * nodes.addrs.len();
    let config = ClusterConfig {
        connections_per_node: opts.connections.max(1),
        in_flight_max: IN_FLIGHT_MAX,
        hedge: nodes.hedge,
        hedge_fraction: nodes.hedge_fraction,
        seed: opts.seed,
        ..ClusterConfig::default()
    };
    let mut cluster = Cluster::new(&nodes.addrs, config)?;
    let mut spec = RequestSpec::default();
    let mut hist = histogram();
    let (mut by_status, mut by_tier, mut failed) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    // Intended send time of each outstanding ticket (open loop), or its
    // actual one (closed loop).
    let mut started: std::collections::HashMap<u64, Instant> = std::collections::HashMap::new();
    let interval = opts.rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let start = Instant::now();
    let end = start + opts.duration;
    let drain_end = end + Duration::from_secs(2);
    let (mut sent, mut received, mut next_due) = (0u64, 0u64, start);
    loop {
        let now = Instant::now();
        let sending = now < end;
        if !sending && (cluster.outstanding() == 0 || now >= drain_end) {
            break;
        }
        if sending {
            loop {
                let (due, at) = match interval {
                    Some(_) => (next_due <= now, next_due),
                    None => (cluster.outstanding() < window, now),
                };
                if !due || cluster.outstanding() >= IN_FLIGHT_MAX {
                    break;
                }
                sent += 1;
                workload.fill(sent, &mut spec);
                match cluster.submit(&spec) {
                    Ok(t) => {
                        started.insert(t.0, at);
                    }
                    Err(e) => *failed.entry(e.to_string()).or_insert(0u64) += 1,
                }
                if let Some(i) = interval {
                    next_due += i;
                }
            }
        }
        let wait = match interval {
            Some(_) => next_due.saturating_duration_since(Instant::now()).min(Duration::from_millis(5)),
            None => Duration::from_millis(5),
        };
        for (t, r) in cluster.poll(wait) {
            let at = started.remove(&t.0).unwrap_or(start);
            match r {
                Ok(resp) => {
                    received += 1;
                    let _ = hist.record(at.elapsed().as_micros().max(1) as u64);
                    *by_status.entry(status_name(resp.status).to_string()).or_insert(0u64) += 1;
                    *by_tier.entry(tier_name(resp.tier).to_string()).or_insert(0u64) += 1;
                }
                Err(e) => *failed.entry(e.to_string()).or_insert(0u64) += 1,
            }
        }
    }
    let duration_s = opts.duration.as_secs_f64();
    Ok(NodesReport {
        mode: if interval.is_some() { "open loop".into() } else { "closed loop".into() },
        duration_s,
        offered_rate: opts.rate,
        achieved_rate: received as f64 / duration_s,
        sent,
        received,
        failed,
        by_status,
        by_tier,
        latency: latency_of(&hist),
        hedges: cluster.hedges,
        hedge_rate: cluster.hedges as f64 / sent.max(1) as f64,
        hedges_denied: cluster.hedges_denied,
        retries: cluster.retries,
        nodes: cluster.node_stats(),
    })
}
