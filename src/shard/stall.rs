//! The shard's stall detector: how long its reactor was held by one thing.
//!
//! glommio is cooperative: while one task runs between two awaits, nothing
//! else on the shard runs, its sockets included. Each of the shard's own
//! tasks times its synchronous stretches (`start`/`end`, two clock reads); a
//! stretch over `reactor.stall_threshold_us` is a stall, counted by task and
//! timed. What no task can see (the runtime's own work, a page fault between
//! tasks, the vCPU paused by the hypervisor) shows as a periodic timer that
//! fires late, counted as `StallTask::Reactor`. glommio's own
//! `detect_stalls` was not used: it arms a timerfd (two syscalls) on every
//! task-queue run, and captures backtraces through a signal.
//!
//! Counting only: the collector thread logs them (`crate::metrics`), so no
//! I/O happens on the reactor.

use std::cell::{Cell, RefCell};

use hdrhistogram::Histogram;

use crate::deadline::{Clock, MonotonicClock};
use crate::metrics::{stage_histogram, Counters, StageTimes, StallTask, STALL_TASKS};

/// A shard's stall counts and lengths since its last publication.
/// Shard-local: its cells are not `Sync`, and the shard holds it in an `Rc`.
pub struct StallMeter {
    /// 0: off.
    threshold_ns: u64,
    clock: MonotonicClock,
    by_task: Cell<[u64; STALL_TASKS]>,
    lengths: RefCell<Histogram<u64>>,
    longest: Cell<Option<(StallTask, u64)>>,
}

impl StallMeter {
    pub fn new(threshold_us: u64) -> StallMeter {
        StallMeter {
            threshold_ns: threshold_us.saturating_mul(1_000),
            clock: MonotonicClock::new(),
            by_task: Cell::new([0; STALL_TASKS]),
            lengths: RefCell::new(stage_histogram()),
            longest: Cell::new(None),
        }
    }

    /// The start of a synchronous stretch.
    #[inline]
    pub fn start(&self) -> u64 {
        if self.threshold_ns == 0 {
            0
        } else {
            self.clock.now_ns()
        }
    }

    /// The end of the stretch `task` began at `start_ns`.
    #[inline]
    pub fn end(&self, task: StallTask, start_ns: u64) {
        if self.threshold_ns == 0 {
            return;
        }
        let held_ns = self.clock.now_ns().saturating_sub(start_ns);
        if held_ns > self.threshold_ns {
            self.record(task, held_ns);
        }
    }

    /// A timer due at `due_ns` fired now: lateness over the threshold is a
    /// stall of the reactor.
    pub fn timer_fired(&self, due_ns: u64) {
        if self.threshold_ns == 0 {
            return;
        }
        let late_ns = self.clock.now_ns().saturating_sub(due_ns);
        if late_ns > self.threshold_ns {
            self.record(StallTask::Reactor, late_ns);
        }
    }

    /// Records a stall of `held_ns` by `task`.
    pub fn record(&self, task: StallTask, held_ns: u64) {
        let mut by_task = self.by_task.get();
        by_task[task as usize] += 1;
        self.by_task.set(by_task);
        self.lengths.borrow_mut().saturating_record(held_ns.max(1));
        if self.longest.get().is_none_or(|(_, ns)| held_ns > ns) {
            self.longest.set(Some((task, held_ns)));
        }
    }

    /// Moves the interval's lengths into `times`, sets the totals in
    /// `counters`, and returns the interval's longest stall.
    pub fn drain_into(&self, times: &mut StageTimes, counters: &mut Counters) -> Option<(StallTask, u64)> {
        let mut lengths = self.lengths.borrow_mut();
        if !lengths.is_empty() {
            times.add_stalls(&lengths);
            lengths.reset();
        }
        counters.stalls_by_task = self.by_task.get();
        self.longest.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stretches_over_the_threshold_count() {
        let meter = StallMeter::new(1_000);
        // The clock counts from its first use: let 60 ms pass so the times
        // below are not before it.
        std::thread::sleep(std::time::Duration::from_millis(60));
        let start = meter.start();
        meter.end(StallTask::Connection, start);
        // A 2 ms stretch and a timer 50 ms late: the late timer is longest.
        meter.end(StallTask::Refresh, meter.clock.now_ns() - 2_000_000);
        meter.timer_fired(meter.clock.now_ns() + 1_000_000);
        meter.timer_fired(meter.clock.now_ns() - 50_000_000);
        let mut times = StageTimes::default();
        let mut counters = Counters::default();
        let (task, ns) = meter.drain_into(&mut times, &mut counters).expect("two stalls");
        assert_eq!(task, StallTask::Reactor);
        assert!(ns >= 50_000_000);
        assert_eq!(counters.stalls_by_task[StallTask::Refresh as usize], 1);
        assert_eq!(counters.stalls_by_task[StallTask::Reactor as usize], 1);
        assert_eq!(counters.stalls(), 2);
        // Counts are totals; the longest is per interval.
        assert!(meter.drain_into(&mut times, &mut counters).is_none());
        assert_eq!(counters.stalls(), 2);
    }

    #[test]
    fn a_zero_threshold_turns_it_off() {
        let meter = StallMeter::new(0);
        assert_eq!(meter.start(), 0);
        meter.end(StallTask::Connection, 0);
        meter.timer_fired(0);
        let mut counters = Counters::default();
        assert!(meter.drain_into(&mut StageTimes::default(), &mut counters).is_none());
        assert_eq!(counters.stalls(), 0);
    }
}
