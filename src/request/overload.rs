//! The request path's side of load shedding (`crate::request::shed`): the load a
//! request sees, and the immediate answer to a shed request, given before
//! any lookup or kernel so that shedding costs microseconds.

use super::*;
use crate::request::shed::ShedAnswer;

impl<C: Clock> RequestPath<C> {
    /// Whether a request of `priority` read at `read_at_ns` is shed at
    /// `now_ns`, from this shard's queue: the request's wait in its read
    /// buffer and, handing off, the job-slot fill.
    pub(super) fn shed_now(&mut self, priority: u8, read_at_ns: u64, now_ns: u64) -> bool {
        let fill = self.stage.as_ref().map_or(0.0, |s| s.in_flight() as f64 / s.slots() as f64);
        let load = self.shedder.load(now_ns.saturating_sub(read_at_ns) / 1_000, fill);
        let shed = self.shedder.shed(priority, load, now_ns);
        self.counters.shed_level_milli = (self.shedder.level() * 1_000.0) as u64;
        if shed {
            self.counters.shed_by_band = self.shedder.shed_by_band;
        }
        shed
    }

    /// Answers a shed request as configured: `Overloaded`, or the static
    /// default of model `chosen` with reason `overload`.
    pub(super) fn answer_shed(
        &mut self,
        request_id: u64,
        chosen: usize,
        rows: usize,
        read_at_ns: u64,
        deadline: Deadline,
        out: &mut Vec<u8>,
    ) -> Handled {
        if self.shedder.answer() == ShedAnswer::Overloaded {
            return self.fail(
                request_id,
                Status::Overloaded,
                "shed: over capacity, priority below the shed level",
                out,
            );
        }
        let step = StepDown {
            request_id,
            rows,
            row_dim: 0,
            read_at_ns,
            deadline,
            missing: 0,
            fallback: false,
            cached: false,
            default_score: self.served[chosen].default_score,
        };
        self.logits[..rows].fill(step.default_score);
        let now_ns = self.clock.now_ns();
        self.respond_ok(&step, Tier::Default, Reason::Overload, 0, now_ns, out);
        self.times.record_ns(Stage::EndToEnd, now_ns.saturating_sub(read_at_ns));
        Handled::Answered
    }
}
