//! The degradation ladder's parts: the primary's circuit breaker, the
//! ladder's configuration, and the fault hooks tests use to make the
//! primary slow.
//!
//! Rungs, in order: primary model → cached scores (`cache.rs`) → fallback
//! model → static default. The request path steps down when the
//! primary's breaker is open, when the remaining budget is smaller than the
//! primary's expected cost, when the inference stage has no room, or when a
//! handed-off request is still unanswered at its give-up time. Every
//! response says which rung answered (`tier`) and why (`reason`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LadderConfig {
    /// A small model run inline on the shard when the primary cannot
    /// answer in time; default `<data_dir>/fallback.qm` when that exists.
    pub fallback_model: Option<std::path::PathBuf>,
    /// The static default score, the last rung.
    pub default_score: f32,
    /// Per-model static defaults by model name (e.g. a category prior).
    pub default_scores: std::collections::HashMap<String, f32>,
    /// Time kept back for the lower rungs and the write when a handed-off
    /// request is given up on.
    pub reserve_us: u64,
    pub breaker: BreakerConfig,
}

impl Default for LadderConfig {
    fn default() -> Self {
        LadderConfig {
            fallback_model: None,
            default_score: 0.0,
            default_scores: Default::default(),
            reserve_us: 300,
            breaker: BreakerConfig::default(),
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Outcomes remembered (the sliding window).
    pub window: usize,
    /// Failures in the window, as a fraction, that open the breaker.
    pub failure_ratio: f64,
    /// The breaker judges only once the window holds this many outcomes.
    pub min_outcomes: usize,
    /// How long it stays open the first time; doubled on each re-open from
    /// half-open (capped at `open_ms_max`) so a flapping dependency does not
    /// make the breaker flap.
    pub open_ms: u64,
    pub open_ms_max: u64,
    /// Successful probes in half-open that close it again.
    pub probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window: 100,
            failure_ratio: 0.5,
            min_outcomes: 20,
            open_ms: 1_000,
            open_ms_max: 30_000,
            probes: 5,
        }
    }
}

/// Most outcomes a breaker remembers: each shard allocates the window at
/// start-up.
pub const BREAKER_WINDOW_MAX: usize = 1 << 16;

impl LadderConfig {
    pub fn validate(&self) -> Result<(), String> {
        let b = &self.breaker;
        if !(1..=BREAKER_WINDOW_MAX).contains(&b.window) {
            return Err(format!("ladder.breaker.window = {} is outside 1..={BREAKER_WINDOW_MAX}", b.window));
        }
        // The window never holds more than `window` outcomes, so a larger
        // minimum would keep the breaker from ever judging.
        if b.min_outcomes > b.window {
            return Err(format!("ladder.breaker.min_outcomes = {} is outside 0..={}", b.min_outcomes, b.window));
        }
        Ok(())
    }
}

/// The breaker's state, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

/// A circuit breaker, one per shard per dependency: shard-local, no locks.
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    /// Ring of recent outcomes, `true` = failure.
    outcomes: Vec<bool>,
    next: usize,
    len: usize,
    failures: usize,
    state: BreakerState,
    open_until_ns: u64,
    open_ms: u64,
    probes_sent: u32,
    probes_ok: u32,
    pub trips: u64,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Breaker {
        let window = config.window.max(1);
        Breaker {
            outcomes: vec![false; window],
            next: 0,
            len: 0,
            failures: 0,
            state: BreakerState::Closed,
            open_until_ns: 0,
            open_ms: config.open_ms,
            probes_sent: 0,
            probes_ok: 0,
            trips: 0,
            config,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether a request may go to the dependency now. In half-open only
    /// `probes` requests are let through until their outcomes are known.
    pub fn allow(&mut self, now_ns: u64) -> bool {
        match self.state {
            BreakerState::Closed => true,
            BreakerState::Open if now_ns >= self.open_until_ns => {
                tracing::info!(probes = self.config.probes, "breaker half-open: probing the primary");
                self.state = BreakerState::HalfOpen;
                self.probes_sent = 1;
                self.probes_ok = 0;
                true
            }
            BreakerState::Open => false,
            BreakerState::HalfOpen if self.probes_sent < self.config.probes => {
                self.probes_sent += 1;
                true
            }
            BreakerState::HalfOpen => false,
        }
    }

    /// Records how a request that was let through ended.
    pub fn record(&mut self, failed: bool, now_ns: u64) {
        match self.state {
            BreakerState::HalfOpen if failed => {
                // Back off harder each time the dependency fails its probes.
                self.open_ms = (self.open_ms * 2).min(self.config.open_ms_max.max(self.config.open_ms));
                self.open(now_ns);
            }
            BreakerState::HalfOpen => {
                self.probes_ok += 1;
                if self.probes_ok >= self.config.probes {
                    tracing::info!("breaker closed: the primary answers again");
                    self.state = BreakerState::Closed;
                    self.clear();
                }
            }
            BreakerState::Open => {}
            BreakerState::Closed => {
                if self.len == self.outcomes.len() {
                    self.failures -= usize::from(self.outcomes[self.next]);
                } else {
                    self.len += 1;
                }
                self.outcomes[self.next] = failed;
                self.failures += usize::from(failed);
                self.next = (self.next + 1) % self.outcomes.len();
                if self.len >= self.config.min_outcomes.max(1)
                    && self.failures as f64 >= self.config.failure_ratio * self.len as f64
                {
                    self.open_ms = self.config.open_ms;
                    self.open(now_ns);
                }
                if !failed && self.failures == 0 {
                    // A clean window forgives earlier back-off.
                    self.open_ms = self.config.open_ms;
                }
            }
        }
    }

    fn open(&mut self, now_ns: u64) {
        tracing::warn!(open_ms = self.open_ms, "breaker open: the primary is failing; lower rungs answer");
        self.state = BreakerState::Open;
        self.open_until_ns = now_ns + self.open_ms * 1_000_000;
        self.trips += 1;
        self.clear();
    }

    fn clear(&mut self) {
        self.outcomes.fill(false);
        self.next = 0;
        self.len = 0;
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            window: 10,
            failure_ratio: 0.5,
            min_outcomes: 4,
            open_ms: 100,
            open_ms_max: 400,
            probes: 3,
        })
    }

    #[test]
    fn opens_on_failures_and_closes_after_probes() {
        let mut b = breaker();
        for _ in 0..3 {
            assert!(b.allow(0));
            b.record(true, 0);
        }
        assert_eq!(b.state(), BreakerState::Closed, "too few outcomes to judge");
        b.record(true, 0);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(50 * MS));
        assert!(b.allow(100 * MS), "half-open after open_ms");
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.allow(100 * MS) && b.allow(100 * MS));
        assert!(!b.allow(100 * MS), "only `probes` requests in half-open");
        for _ in 0..3 {
            b.record(false, 101 * MS);
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.trips, 1);
    }

    #[test]
    fn a_flapping_dependency_backs_the_breaker_off() {
        let mut b = breaker();
        for _ in 0..4 {
            b.record(true, 0);
        }
        let mut now = 0;
        let mut open_for = Vec::new();
        // Every probe fails: each re-open lasts twice as long, up to the cap.
        for _ in 0..5 {
            let opened = now;
            while !b.allow(now) {
                now += MS;
            }
            open_for.push((now - opened) / MS);
            b.record(true, now);
        }
        assert_eq!(open_for, vec![100, 200, 400, 400, 400]);
        // A dependency that is fine half the time never closes it: probes
        // must all succeed.
        let mut ok = false;
        for round in 0..20 {
            while !b.allow(now) {
                now += MS;
            }
            b.record(round % 2 == 0, now);
            ok |= b.state() == BreakerState::Closed;
        }
        assert!(!ok, "alternating outcomes never close it: half-open needs every probe to succeed");
    }

    #[test]
    fn successes_keep_it_closed() {
        let mut b = breaker();
        for i in 0..100 {
            assert!(b.allow(i));
            b.record(i % 5 == 0, i);
        }
        assert_eq!(b.state(), BreakerState::Closed, "20% failures is below the ratio");
    }
}
