//! The shard's side of the inference stage ([`InFlight`]): requests waiting
//! for it, the running estimate of its turnaround, completions answered by
//! the same `finish` as an inline request (reading the rows and scores from
//! the job slot), and give-ups answered from the lower rungs when the stage
//! is too slow.
//!
//! Both come back to the connection that owns the request: the shard's
//! poller routes a completion (`poll`) or a give-up (`give_up_overdue`) by
//! job slot, and the connection answers it into its own output
//! (`complete`, `give_up`). A slot's give-up is routed before its
//! completion, never after, so the slot (its kept rows and item ids) is
//! still the request's when the give-up is answered.
//!
//! A request the decision log may record keeps, by slot, its record begun
//! at the hand-off (`logged::Staged`) and the staging bytes of its spans and
//! keys, until its response is written.
//!
//! The score cache works as it does inline: the stage's scores fill it when
//! they are returned in time, and a request stepped down after its hand-off
//! looks it up again (each slot keeps its request's item ids), since entries
//! may have come or gone while it waited.

use std::sync::Arc;

use super::logged::Staged;
use super::policies::Policies;
use super::scratch::{Answer, Inputs};
use super::shadow::ShadowQueue;
use super::stages::{self, Assembled, Ran, Rejection};
use super::versions::{Served, Versions};
use super::{StepDown, Telemetry};
use crate::deadline::Clock;
use crate::features::feed::FeedStatus;
use crate::infer::{Done, Outcome, ShardEnd, SlotToken};
use crate::metrics::Stage;
use crate::model::Model;
use crate::request::cache::ScoreCache;
use crate::wire::{Reason, Status};

/// A request waiting for the inference stage.
#[derive(Clone, Copy)]
struct Pending {
    conn: u32,
    /// What `finish` answers it from, with the scores the stage returns.
    assembled: Assembled,
    submitted_ns: u64,
    /// When the shard stops waiting and answers from a lower rung.
    give_up_ns: u64,
    /// Given up on: answered from a lower rung; the stage's result is dropped.
    answered: bool,
    /// Its completion was routed to its connection: too late to give up.
    routed: bool,
}

/// A running estimate of how long the stage takes to hand a job back. It
/// rises faster on slow samples than it falls on fast ones, and halves for
/// every 100 ms without a sample, so that a spell of slowness that made the
/// shard stop sending does not keep it away for ever.
#[derive(Clone, Copy, Debug, Default)]
struct Turnaround {
    ns: f64,
    at_ns: u64,
}

impl Turnaround {
    const HALF_LIFE_NS: f64 = 100e6;

    fn current(&self, now_ns: u64) -> f64 {
        self.ns * 0.5f64.powf(now_ns.saturating_sub(self.at_ns) as f64 / Self::HALF_LIFE_NS)
    }

    fn expected_us(&self, now_ns: u64) -> u64 {
        (self.current(now_ns) / 1_000.0) as u64
    }

    fn observe(&mut self, sample_ns: u64, now_ns: u64) {
        let cur = self.current(now_ns);
        let s = sample_ns as f64;
        // Up by an eighth of the gap, down by a fiftieth: it settles near a
        // high percentile of recent samples, and one outlier moves it little.
        self.ns = if s > cur { cur + (s - cur) * 0.125 } else { cur + (s - cur) * 0.02 };
        self.at_ns = now_ns;
    }
}

/// Requests on the inference stage, by job slot; empty without a stage.
#[derive(Default)]
pub(super) struct InFlight {
    pub(super) stage: Option<ShardEnd>,
    pending: Vec<Option<Pending>>,
    /// Item ids of handed-off requests, by slot (`rows_max` each), for
    /// `finish` (the cache fill) and a give-up's cache lookup.
    items: Vec<u64>,
    rows_max: usize,
    /// The slot taken for the current request's rows before assembly
    /// (`reserve`), until it is submitted or given back (`unreserve`).
    reserved: Option<SlotToken>,
    /// Jobs submitted whose completion has not been polled yet.
    owed: usize,
    next_give_up_ns: u64,
    turnaround: Turnaround,
    /// By slot, the decision-log record begun at the hand-off, and its
    /// staging bytes (`staged_bytes` each; empty while nothing is logged).
    pub(super) log_staged: Vec<Option<Staged>>,
    log_staging: Vec<u8>,
    staged_bytes: usize,
}

/// Gives the rows to the inference stage; the response follows from
/// `complete`, or from `give_up` at the give-up time.
pub(super) fn hand_off(
    a: Assembled,
    conn: u32,
    policies: &mut Policies,
    in_flight: &mut InFlight,
    served: &Served,
    inputs: &Inputs,
) -> Result<u32, Rejection> {
    let reserve_us = policies.ladder.reserve_us;
    in_flight.submit(a, conn, &served.model, reserve_us, inputs).map_err(|(step, now_ns)| {
        policies.breaker.record(true, now_ns);
        Rejection::StepDown { step, reason: Reason::Overload }
    })
}

/// The parts of the path a completion or a give-up answers with.
pub(super) struct Parts<'a, C: Clock> {
    pub(super) clock: &'a C,
    pub(super) policies: &'a mut Policies,
    pub(super) versions: &'a mut Versions,
    pub(super) feed: &'a Option<Arc<FeedStatus>>,
    pub(super) cache: &'a mut ScoreCache,
    pub(super) shadows: &'a mut ShadowQueue,
    pub(super) answer: &'a mut Answer,
    pub(super) telemetry: &'a mut Telemetry,
}

impl InFlight {
    /// Sends later requests through `stage`, with room for `rows_max`
    /// candidates per slot.
    pub(super) fn attach(&mut self, stage: ShardEnd, rows_max: usize) {
        self.pending = (0..stage.slots()).map(|_| None).collect();
        self.rows_max = rows_max;
        self.items = vec![0; stage.slots() * rows_max];
        self.next_give_up_ns = u64::MAX;
        self.stage = Some(stage);
    }

    /// Keeps `bytes` of decision-log staging per slot (allocated now, once).
    pub(super) fn keep_log(&mut self, bytes: usize) {
        let slots = self.pending.len();
        if self.staged_bytes != bytes || self.log_staged.len() != slots {
            self.log_staged = vec![None; slots];
            self.log_staging = vec![0; slots * bytes];
            self.staged_bytes = bytes;
        }
    }

    /// Slot `slot`'s staging bytes.
    pub(super) fn staging_mut(&mut self, slot: u32) -> &mut [u8] {
        let n = self.staged_bytes;
        self.log_staging.get_mut(slot as usize * n..).map_or(&mut [], |s| &mut s[..n])
    }

    /// Slot `slot`'s record begun at its hand-off (taken: it is logged
    /// once), its staging bytes and its input rows.
    pub(super) fn take_staged(&mut self, slot: u32) -> Option<(Staged, &[u8], &[f32])> {
        let staged = self.log_staged.get_mut(slot as usize)?.take()?;
        let n = self.staged_bytes;
        let bytes = self.log_staging.get(slot as usize * n..)?.get(..n)?;
        // The stage never writes a slot's rows, and the shard writes them
        // only when it takes the slot for another request, after this.
        Some((staged, bytes, self.stage.as_ref()?.rows_of(slot)))
    }

    /// Takes a job slot for the current request's rows, when a stage is
    /// attached, `floats` input values fit a slot and one is free.
    pub(super) fn reserve(&mut self, floats: usize) {
        assert!(self.reserved.is_none(), "one request's slot is taken at a time");
        if let Some(stage) = self.stage.as_mut().filter(|s| s.fits(floats)) {
            self.reserved = stage.acquire();
        }
    }

    /// The rows of the slot taken by `reserve`, to assemble into.
    pub(super) fn reserved_rows_mut(&mut self) -> Option<&mut [f32]> {
        let token = self.reserved.as_ref()?;
        Some(&mut self.stage.as_mut()?.slot_mut(token).x)
    }

    /// The rows of the slot taken by `reserve`, as assembled.
    pub(super) fn reserved_rows(&self) -> Option<&[f32]> {
        let token = self.reserved.as_ref()?;
        Some(&self.stage.as_ref()?.slot(token).x)
    }

    /// Gives back the slot taken by `reserve` if it was not submitted.
    pub(super) fn unreserve(&mut self) {
        if let (Some(token), Some(stage)) = (self.reserved.take(), self.stage.as_mut()) {
            stage.release(token);
        }
    }

    /// The fill of the job slots, 0..1 (0 without a stage), for shedding.
    pub(super) fn slot_fill(&self) -> f64 {
        self.stage.as_ref().map_or(0.0, |s| s.in_flight() as f64 / s.slots() as f64)
    }

    /// The stage's expected turnaround for `a` when its rows can be handed
    /// off (a stage is attached and they fit a job slot).
    pub(super) fn stage_us(&self, a: &Assembled) -> Option<u64> {
        let fits = self.stage.as_ref().is_some_and(|s| s.fits(a.step.rows * a.step.row_dim));
        fits.then(|| self.turnaround.expected_us(a.at_ns))
    }

    /// Submits the slot `reserve` took, which holds `a`'s rows, to be
    /// answered on connection `conn`; `model` scores it. On no slot taken or
    /// a full ring, the request's step-down and the time, to answer it at
    /// once (the slot then stays taken, for the step-down to read its rows).
    /// Returns the slot it went in.
    pub(super) fn submit(
        &mut self,
        a: Assembled,
        conn: u32,
        model: &Arc<Model>,
        reserve_us: u64,
        inputs: &Inputs,
    ) -> Result<u32, (StepDown, u64)> {
        let step = a.step;
        let (rows, now_ns) = (step.rows, a.at_ns);
        let stage = self.stage.as_mut().expect("route hands off only to an attached stage");
        let Some(token) = self.reserved.take() else {
            return Err((step, now_ns));
        };
        let slot = token.index() as usize;
        stage.slot_mut(&token).rows = rows;
        stage.set_model(&token, model);
        if let Err(token) = stage.submit(token, step.deadline.at_us() * 1_000, now_ns) {
            self.reserved = Some(token);
            return Err((step, now_ns));
        }
        let give_up_ns = (step.deadline.at_us().saturating_sub(reserve_us)) * 1_000;
        self.next_give_up_ns = self.next_give_up_ns.min(give_up_ns);
        let at = slot * self.rows_max;
        self.items[at..at + rows].copy_from_slice(&inputs.candidate_keys[..rows]);
        let pending = Pending { conn, assembled: a, submitted_ns: now_ns, give_up_ns, answered: false, routed: false };
        self.pending[slot] = Some(pending);
        if let Some(staged) = self.log_staged.get_mut(slot) {
            *staged = None;
        }
        self.owed += 1;
        Ok(slot as u32)
    }

    /// The next completion from the stage, with the connection it goes to.
    pub(super) fn poll(&mut self) -> Option<(u32, Done, SlotToken)> {
        let (done, token) = self.stage.as_mut()?.poll()?;
        let p = self.pending[done.slot as usize].as_mut().expect("a completion matches a pending request");
        p.routed = true;
        self.owed -= 1;
        Some((p.conn, done, token))
    }

    /// Jobs the stage still owes a completion: the poller waits for them.
    /// (A slot stays taken after, until its connection answers.)
    pub(super) fn owed(&self) -> usize {
        self.owed
    }

    /// Answers a stage completion into `out` (nothing when the request was
    /// given up on), and gives its slot back; returns whether it answered.
    /// Scored in time, the request is answered by `finish`, as inline.
    pub(super) fn complete<C: Clock>(
        &mut self,
        done: Done,
        token: SlotToken,
        parts: Parts<'_, C>,
        out: &mut Vec<u8>,
    ) -> bool {
        let Parts { clock, policies, versions, feed, cache, shadows, answer, telemetry } = parts;
        let slot = done.slot as usize;
        let p = self.pending[slot].take().expect("a completion matches a pending request");
        let stage = self.stage.as_mut().expect("completions come from the stage");
        telemetry.times.record_ns(Stage::Queue, done.queue_ns);
        let now_ns = clock.now_ns();
        let step = p.assembled.step;
        let rows = step.rows;
        let outcome = done.outcome;
        if outcome == Outcome::Scored || outcome == Outcome::Late {
            telemetry.times.record_ns(Stage::Kernel, done.kernel_ns);
        }
        self.turnaround.observe(now_ns.saturating_sub(p.submitted_ns), now_ns);
        if p.answered {
            stage.release(token);
            return false;
        }
        let ok = outcome == Outcome::Scored && !step.deadline.cannot_fit(now_ns / 1_000, 0);
        policies.breaker.record(!ok, now_ns);
        if ok {
            // The slot still holds the rows the stage scored, until released.
            let model = stage.model(&token).expect("a submitted slot names its model");
            let data = stage.slot(&token);
            for (s, l) in answer.logits[..rows].iter_mut().zip(&data.logits[..rows]) {
                *s = model.score(*l);
            }
            let x = &data.x[..rows * step.row_dim];
            let items = &self.items[slot * self.rows_max..][..rows];
            let ran = Ran { assembled: p.assembled, scored_ns: now_ns };
            stages::finish(ran, x, items, clock, versions, cache, shadows, feed, answer, telemetry, out);
            stage.release(token);
            return true;
        }
        match outcome {
            Outcome::Expired if !step.deadline.cannot_fit(now_ns / 1_000, 0) => {
                // The stage saw it could not finish in time; a lower rung may.
                let step = self.recheck_cache(&p, slot, now_ns, cache, answer, telemetry);
                let x = self.kept_rows(slot, &step);
                let fallback = versions.fallback.as_mut();
                stages::step_down(&step, Reason::Budget, x, clock, fallback, feed, answer, telemetry, out);
            }
            Outcome::Expired => {
                let why = "dropped before the kernel: no time left";
                stages::fail(step.request_id, Status::DeadlineExceeded, why, answer, telemetry, out);
            }
            Outcome::Scored | Outcome::Late => {
                let why = "kernel finished past the deadline";
                stages::fail(step.request_id, Status::DeadlineExceeded, why, answer, telemetry, out);
            }
            Outcome::Failed => {
                let step = self.recheck_cache(&p, slot, now_ns, cache, answer, telemetry);
                let x = self.kept_rows(slot, &step);
                let fallback = versions.fallback.as_mut();
                stages::step_down(&step, Reason::ModelError, x, clock, fallback, feed, answer, telemetry, out);
            }
        }
        // Given back only now: the step-downs above read its rows.
        self.stage.as_mut().expect("completions come from the stage").release(token);
        let done_ns = clock.now_ns();
        telemetry.times.record_ns(Stage::Respond, done_ns.saturating_sub(now_ns));
        telemetry.times.record_ns(Stage::EndToEnd, done_ns.saturating_sub(step.read_at_ns));
        true
    }

    /// Gives up on every handed-off request still waiting at its give-up
    /// time (its deadline less `ladder.reserve_us`) whose completion has
    /// not been routed, calling `route(connection, slot)` for each; the
    /// connection answers it with `give_up`. The stage keeps the job slot
    /// until it finishes; its late result is then dropped.
    pub(super) fn give_up_overdue(&mut self, now_ns: u64, policies: &mut Policies, route: &mut dyn FnMut(u32, u32)) {
        if now_ns < self.next_give_up_ns {
            return;
        }
        let mut next = u64::MAX;
        for (slot, p) in self.pending.iter_mut().enumerate() {
            let Some(p) = p.as_mut().filter(|p| !p.answered && !p.routed) else {
                continue;
            };
            if p.give_up_ns > now_ns {
                next = next.min(p.give_up_ns);
                continue;
            }
            // A request the stage could not answer in time is a failure for
            // the breaker now, not when its late result finally comes back.
            policies.breaker.record(true, now_ns);
            p.answered = true;
            route(p.conn, slot as u32);
        }
        self.next_give_up_ns = next;
    }

    /// Answers the request in `slot`, given up on, from the lower rungs.
    pub(super) fn give_up<C: Clock>(&mut self, slot: u32, parts: Parts<'_, C>, out: &mut Vec<u8>) {
        let Parts { clock, versions, feed, cache, answer, telemetry, .. } = parts;
        let slot = slot as usize;
        let p = self.pending[slot].expect("a give-up comes before its slot's completion");
        assert!(p.answered, "only a request given up on is answered from the lower rungs");
        let step = self.recheck_cache(&p, slot, clock.now_ns(), cache, answer, telemetry);
        let x = self.kept_rows(slot, &step);
        let fallback = versions.fallback.as_mut();
        stages::step_down(&step, Reason::Budget, x, clock, fallback, feed, answer, telemetry, out);
    }

    /// The model input rows of the request in slot `slot`, read in the slot
    /// (the stage may still hold it: it only reads rows), for the fallback.
    fn kept_rows(&self, slot: usize, step: &StepDown) -> &[f32] {
        let stage = self.stage.as_ref().expect("a handed-off request has a stage");
        &stage.rows_of(slot as u32)[..step.rows * step.row_dim]
    }

    /// `p`'s step-down with the cache looked up again at `now_ns`: cached
    /// (scores in `Answer::cached`) only if every candidate is still there.
    fn recheck_cache(
        &self,
        p: &Pending,
        slot: usize,
        now_ns: u64,
        cache: &mut ScoreCache,
        answer: &mut Answer,
        telemetry: &mut Telemetry,
    ) -> StepDown {
        let mut step = p.assembled.step;
        let items = &self.items[slot * self.rows_max..][..step.rows];
        step.cached =
            stages::cached_scores(cache, &p.assembled.cache_key, items, now_ns, &mut answer.cached, telemetry);
        step
    }
}
