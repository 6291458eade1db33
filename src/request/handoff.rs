//! The shard's side of the inference stage: requests waiting for it, the
//! running estimate of its turnaround, completions turned into responses,
//! and give-ups answered from the lower rungs when the stage is too slow.
//!
//! The score cache works as it does inline: the stage's scores fill it when
//! they are returned in time, and a request stepped down after its hand-off
//! looks it up again (each slot keeps its request's item ids), since entries
//! may have come or gone while it waited.

use super::*;

/// A request waiting for the inference stage.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pending {
    pub(super) conn: u32,
    pub(super) step: StepDown,
    /// Its score-cache key, item left 0.
    pub(super) cache_key: Key,
    pub(super) model_version: u32,
    /// The version's place in `served`, valid while `generation` lasts; after
    /// a swap of versions the request is left out of drift counts and shadow
    /// samples (rare, and those are samples anyway).
    pub(super) served: usize,
    pub(super) generation: u64,
    /// For the shadow sample's choice of users.
    pub(super) user_id: u64,
    pub(super) submitted_ns: u64,
    /// When the shard stops waiting and answers from a lower rung.
    pub(super) give_up_ns: u64,
    /// Already answered from a lower rung; the stage's result is dropped.
    pub(super) answered: bool,
}

/// A running estimate of how long the stage takes to hand a job back. It
/// rises faster on slow samples than it falls on fast ones, and halves for
/// every 100 ms without a sample, so that a spell of slowness that made the
/// shard stop sending does not keep it away for ever.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Turnaround {
    ns: f64,
    at_ns: u64,
}

impl Turnaround {
    const HALF_LIFE_NS: f64 = 100e6;

    fn current(&self, now_ns: u64) -> f64 {
        self.ns * 0.5f64.powf(now_ns.saturating_sub(self.at_ns) as f64 / Self::HALF_LIFE_NS)
    }

    pub(super) fn expected_us(&self, now_ns: u64) -> u64 {
        (self.current(now_ns) / 1_000.0) as u64
    }

    pub(super) fn observe(&mut self, sample_ns: u64, now_ns: u64) {
        let cur = self.current(now_ns);
        let s = sample_ns as f64;
        // Up by an eighth of the gap, down by a fiftieth: it settles near a
        // high percentile of recent samples, and one outlier moves it little.
        self.ns = if s > cur { cur + (s - cur) * 0.125 } else { cur + (s - cur) * 0.02 };
        self.at_ns = now_ns;
    }
}

impl<C: Clock> RequestPath<C> {
    /// Sends later requests through the inference stage instead of scoring
    /// them inline.
    pub fn attach_stage(&mut self, stage: ShardEnd) {
        self.pending = (0..stage.slots()).map(|_| None).collect();
        if self.cache.enabled() {
            self.pending_items = vec![0; stage.slots() * self.shared.limits.candidates_max];
        }
        if self.fallback.is_some() {
            self.shadow = vec![0.0; stage.slots() * stage.slot_floats()];
        }
        self.stage = Some(stage);
    }

    /// Takes the next completion from the inference stage, if any.
    /// A stage completion and the slot it returns, if one is waiting.
    pub fn poll_stage(&mut self) -> Option<(Done, SlotToken)> {
        self.stage.as_mut()?.poll()
    }

    /// The stage's bell for this shard (`ShardEnd::take_bell`).
    pub fn take_stage_bell(&mut self) -> Option<std::os::unix::net::UnixStream> {
        self.stage.as_mut()?.take_bell()
    }

    /// See `ShardEnd::will_wait`.
    pub fn stage_will_wait(&self) -> bool {
        self.stage.as_ref().is_some_and(ShardEnd::will_wait)
    }

    /// See `ShardEnd::woke`.
    pub fn stage_woke(&self) {
        if let Some(s) = &self.stage {
            s.woke();
        }
    }

    /// Requests handed to the stage and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.stage.as_ref().map_or(0, ShardEnd::in_flight)
    }

    /// Turns a stage completion into its request's response, appended to
    /// `out`; returns the connection it belongs to, or `None` when the
    /// request was already answered from a lower rung (given up on).
    pub fn complete(&mut self, done: Done, token: SlotToken, out: &mut Vec<u8>) -> Option<u32> {
        let p = self.pending[done.slot as usize].take().expect("a completion matches a pending request");
        let stage = self.stage.as_mut().expect("completions come from the stage");
        self.times.record_ns(Stage::Queue, done.queue_ns);
        let now_ns = self.clock.now_ns();
        let step = p.step;
        let rows = step.rows;
        let outcome = done.outcome;
        let in_time = !p.answered && !step.deadline.cannot_fit(now_ns / 1_000, 0);
        if outcome == Outcome::Scored || outcome == Outcome::Late {
            self.times.record_ns(Stage::Kernel, done.kernel_ns);
        }
        self.turnaround.observe(now_ns.saturating_sub(p.submitted_ns), now_ns);
        let ok = outcome == Outcome::Scored && in_time;
        if ok {
            let data = stage.slot_mut(&token);
            let model = data.model.as_ref().expect("a submitted slot carries its model");
            for (s, l) in self.logits[..rows].iter_mut().zip(&data.logits[..rows]) {
                *s = model.score(*l);
            }
            if p.generation == self.generation {
                // The slot still holds the rows the stage scored, until released.
                let (x, returned) = (&data.x[..rows * step.row_dim], &self.logits[..rows]);
                self.shadow_queue.sample(&self.served, p.served, p.user_id, x, returned, step.row_dim);
            }
        }
        stage.release(token);
        if p.answered {
            return None;
        }
        self.breaker.record(!ok, now_ns);
        match outcome {
            _ if ok => {
                self.respond_ok(&step, Tier::Primary, Reason::None, p.model_version, now_ns, out);
                self.cache_slot_scores(&p, done.slot, now_ns);
                if p.generation == self.generation {
                    if let Some(d) = self.served.get_mut(p.served).and_then(|s| s.drift.as_mut()) {
                        d.record_scores(&self.logits[..rows]);
                    }
                }
            }
            Outcome::Expired if !step.deadline.cannot_fit(now_ns / 1_000, 0) => {
                // The stage saw it could not finish in time; a lower rung may.
                let step = self.recheck_cache(&p, done.slot, now_ns);
                self.step_down_from(&step, Reason::Budget, done.slot, false, out);
            }
            Outcome::Expired => {
                self.fail(step.request_id, Status::DeadlineExceeded, "dropped before the kernel: no time left", out);
            }
            Outcome::Scored | Outcome::Late => {
                self.fail(step.request_id, Status::DeadlineExceeded, "kernel finished past the deadline", out);
            }
            Outcome::Failed => {
                let step = self.recheck_cache(&p, done.slot, now_ns);
                self.step_down_from(&step, Reason::ModelError, done.slot, false, out);
            }
        }
        let done_ns = self.clock.now_ns();
        self.times.record_ns(Stage::Respond, done_ns.saturating_sub(now_ns));
        self.times.record_ns(Stage::EndToEnd, done_ns.saturating_sub(step.read_at_ns));
        Some(p.conn)
    }

    /// Answers, from the lower rungs, every handed-off request still waiting
    /// at its give-up time (its deadline less `ladder.reserve_us`), calling
    /// `deliver(connection, response bytes)` for each. The stage keeps the
    /// job slot until it finishes; its late result is then dropped.
    pub fn give_up_overdue(&mut self, now_ns: u64, deliver: &mut dyn FnMut(u32, &[u8])) {
        if now_ns < self.next_give_up_ns {
            return;
        }
        let mut next = u64::MAX;
        let mut bytes = std::mem::take(&mut self.give_up_bytes);
        for slot in 0..self.pending.len() {
            let Some(p) = self.pending[slot].filter(|p| !p.answered) else {
                continue;
            };
            if p.give_up_ns > now_ns {
                next = next.min(p.give_up_ns);
                continue;
            }
            bytes.clear();
            // A request the stage could not answer in time is a failure for
            // the breaker now, not when its late result finally comes back.
            self.breaker.record(true, now_ns);
            let step = self.recheck_cache(&p, slot as u32, now_ns);
            self.step_down_from(&step, Reason::Budget, slot as u32, false, &mut bytes);
            self.pending[slot].as_mut().expect("checked above").answered = true;
            deliver(p.conn, &bytes);
        }
        self.give_up_bytes = bytes;
        self.next_give_up_ns = next;
    }
}

impl<C: Clock> RequestPath<C> {
    /// Caches the scores in `self.logits` that the stage returned for `p`.
    fn cache_slot_scores(&mut self, p: &Pending, slot: u32, now_ns: u64) {
        if !self.cache.enabled() {
            return;
        }
        let rows = p.step.rows;
        let at = slot as usize * self.shared.limits.candidates_max;
        self.cache.put_all(&p.cache_key, &self.pending_items[at..at + rows], &self.logits[..rows], now_ns);
    }

    /// `p`'s step-down with the cache looked up again at `now_ns`: cached
    /// (scores in `self.cached`) only if every candidate is still there.
    fn recheck_cache(&mut self, p: &Pending, slot: u32, now_ns: u64) -> StepDown {
        let mut step = p.step;
        step.cached = self.cache.enabled();
        if step.cached {
            let at = slot as usize * self.shared.limits.candidates_max;
            for (dst, &item) in self.cached.iter_mut().zip(&self.pending_items[at..at + step.rows]) {
                match self.cache.get(&Key { item, ..p.cache_key }, now_ns) {
                    Some(score) => *dst = score,
                    None => {
                        step.cached = false;
                        break;
                    }
                }
            }
            self.counters.cache_hits = self.cache.hits;
            self.counters.cache_misses = self.cache.misses;
        }
        step
    }
}
