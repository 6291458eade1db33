//! Monotonic time and the one `Deadline` value that travels down the request path.
//!
//! Time is microseconds on a monotonic clock, read only through [`Clock`], so
//! tests can substitute a clock they control and drive a request past its
//! deadline at any chosen stage boundary.

use std::cell::Cell;
use std::time::Instant;

/// A source of monotonic time in microseconds since an arbitrary origin.
pub trait Clock {
    fn now_us(&self) -> u64;

    /// Nanoseconds, for stage timings; test clocks may derive it from µs.
    fn now_ns(&self) -> u64 {
        self.now_us() * 1_000
    }

    /// Unix seconds, for what is dated by the wall clock (a Feast row's
    /// event time against its view's ttl); test clocks keep the system's.
    fn unix_s(&self) -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    #[inline]
    fn now_us(&self) -> u64 {
        (**self).now_us()
    }

    #[inline]
    fn now_ns(&self) -> u64 {
        (**self).now_ns()
    }

    #[inline]
    fn unix_s(&self) -> u64 {
        (**self).unix_s()
    }
}

/// The real clock: `std::time::Instant` relative to one process-wide origin,
/// so readings taken on different threads (a shard and the inference stage)
/// compare directly.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    pub fn new() -> MonotonicClock {
        static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        MonotonicClock { origin: *ORIGIN.get_or_init(Instant::now) }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    #[inline]
    fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }
}

/// A clock for tests: time moves only when told to, plus an optional fixed
/// step on every read (to expire a request at the N-th stage boundary).
#[derive(Debug, Default)]
pub struct ManualClock {
    now_us: Cell<u64>,
    step_us: Cell<u64>,
}

impl ManualClock {
    pub fn new(start_us: u64) -> ManualClock {
        ManualClock { now_us: Cell::new(start_us), step_us: Cell::new(0) }
    }

    pub fn advance_us(&self, delta_us: u64) {
        self.now_us.set(self.now_us.get() + delta_us);
    }

    /// Every later `now_us` call advances time by `step_us` after reading it.
    pub fn set_step_us(&self, step_us: u64) {
        self.step_us.set(step_us);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        let now = self.now_us.get();
        self.now_us.set(now + self.step_us.get());
        now
    }
}

/// An absolute point on the monotonic clock by which a response must be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    at_us: u64,
}

impl Deadline {
    /// The deadline of a request read at `read_at_us` with a relative budget.
    pub fn from_budget(read_at_us: u64, budget_us: u32) -> Deadline {
        Deadline { at_us: read_at_us.saturating_add(u64::from(budget_us)) }
    }

    pub fn at_us(self) -> u64 {
        self.at_us
    }

    /// Microseconds left at `now_us`; zero once the deadline has passed.
    pub fn remaining_us(self, now_us: u64) -> u64 {
        self.at_us.saturating_sub(now_us)
    }

    /// True when fewer than `cost_us` microseconds remain at `now_us`: work
    /// expected to take `cost_us` would finish late.
    pub fn cannot_fit(self, now_us: u64, cost_us: u64) -> bool {
        self.remaining_us(now_us) < cost_us.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_arithmetic() {
        let d = Deadline::from_budget(1_000, 500);
        assert_eq!(d.at_us(), 1_500);
        assert_eq!(d.remaining_us(1_200), 300);
        assert_eq!(d.remaining_us(2_000), 0);
        assert!(!d.cannot_fit(1_200, 300));
        assert!(d.cannot_fit(1_200, 301));
        assert!(d.cannot_fit(1_500, 0), "an exhausted budget fits nothing");
        assert_eq!(Deadline::from_budget(u64::MAX - 1, 10).at_us(), u64::MAX);
    }

    #[test]
    fn manual_clock_steps() {
        let c = ManualClock::new(10);
        assert_eq!(c.now_us(), 10);
        c.set_step_us(5);
        assert_eq!(c.now_us(), 10);
        assert_eq!(c.now_us(), 15);
        c.advance_us(100);
        assert_eq!(c.now_us(), 120);
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let c = MonotonicClock::new();
        let a = c.now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(c.now_us() >= a + 1_000);
    }
}
