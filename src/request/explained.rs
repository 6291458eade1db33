//! Reason codes on the request path: after the primary's scores, each
//! explained candidate's largest feature contributions, inside the budget.
//!
//! The rule (docs/PROTOCOL.md, "Explanations"): a request that sets
//! `explain_top_k` has its candidates explained (all, or the
//! `explain_candidates_max` with the highest scores) only when the time
//! left before its deadline fits the explained count times the version's
//! cost per candidate (`score::explaining::Explaining`: measured when the
//! version was built, then a running estimate of what requests took);
//! otherwise it answers its scores with `explain_skipped = budget`. A model
//! the explainer refuses answers `not_explainable`, a lower rung
//! `lower_rung`. Both inference modes explain here, on the shard, in
//! `stages::finish`: the inference thread hands back rows and scores, and
//! the shard explains from the rows the job slot still holds.
//!
//! Everything is written into [`Explained`], sized for
//! `EXPLAIN_CANDIDATES_MAX` × `EXPLAIN_TOP_K_MAX` when the shard starts.

use super::versions::Served;
use super::StepDown;
use crate::deadline::Clock;
use crate::metrics::Counters;
use crate::score::explaining::Explaining;
use crate::wire::{ExplainFields, ExplainSkipped, EXPLAIN_CANDIDATES_MAX, EXPLAIN_TOP_K_MAX};

/// The current answer's explanations (what `ExplainFields` borrows).
pub(super) struct Explained {
    pub(super) skipped: ExplainSkipped,
    bias: f64,
    /// Explained candidates, ascending; `n` of them.
    candidates: Vec<u32>,
    n: usize,
    /// `k` per explained candidate.
    features: Vec<u32>,
    contributions: Vec<f64>,
    k: usize,
}

/// What happened when a request asked to be explained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Nothing was asked, or `skipped` says why nothing was explained.
    Skipped,
    /// Explained; `late` when the deadline passed while explaining.
    Explained { late: bool },
}

impl Explained {
    pub(super) fn new() -> Explained {
        Explained {
            skipped: ExplainSkipped::None,
            bias: 0.0,
            candidates: vec![0; EXPLAIN_CANDIDATES_MAX],
            n: 0,
            features: vec![0; EXPLAIN_CANDIDATES_MAX * EXPLAIN_TOP_K_MAX],
            contributions: vec![0.0; EXPLAIN_CANDIDATES_MAX * EXPLAIN_TOP_K_MAX],
            k: 0,
        }
    }

    /// No explanation, and why (`None`: none was asked for).
    pub(super) fn skip(&mut self, why: ExplainSkipped) {
        (self.skipped, self.n, self.k) = (why, 0, 0);
    }

    /// The explanations as the encoder takes them.
    pub(super) fn fields(&self) -> ExplainFields<'_> {
        let pairs = self.n * self.k;
        ExplainFields {
            skipped: self.skipped,
            bias: self.bias,
            candidates: &self.candidates[..self.n],
            features: &self.features[..pairs],
            contributions: &self.contributions[..pairs],
        }
    }

    /// Picks the `n` candidates with the highest `scores` (ties: the lower
    /// index), in ascending order.
    fn choose(&mut self, scores: &[f32], n: usize) {
        let chosen = &mut self.candidates[..n];
        if n == scores.len() {
            chosen.iter_mut().enumerate().for_each(|(i, c)| *c = i as u32);
            return;
        }
        let mut filled = 0;
        for (i, &s) in scores.iter().enumerate() {
            let at = chosen[..filled].iter().position(|&c| s > scores[c as usize]).unwrap_or(filled);
            if at >= n {
                continue;
            }
            let end = filled.min(n - 1);
            chosen.copy_within(at..end, at + 1);
            chosen[at] = i as u32;
            filled = (filled + 1).min(n);
        }
        chosen.sort_unstable();
    }
}

/// Explains the primary's answer to `step` (its input rows `x`, its scores
/// `scores`) with `served`'s explainer into `out`, when asked and when the
/// time left fits; `served` is `None` when the version that scored it is no
/// longer served here. Reads the clock before (the budget check) and after
/// (the cost, and whether the deadline passed). Counts the candidates
/// explained and the budget skips in `counters`.
pub(super) fn explain(
    step: &StepDown,
    x: &[f32],
    scores: &[f32],
    served: Option<&mut Served>,
    clock: &impl Clock,
    out: &mut Explained,
    counters: &mut Counters,
) -> Outcome {
    if step.explain_top_k == 0 {
        out.skip(ExplainSkipped::None);
        return Outcome::Skipped;
    }
    let Some(served) = served else {
        out.skip(ExplainSkipped::Unavailable);
        return Outcome::Skipped;
    };
    let n = usize::from(step.explained);
    let started_ns = clock.now_ns();
    let explaining = &mut served.explaining;
    match explaining.expected_us(n) {
        None => {
            out.skip(ExplainSkipped::NotExplainable);
            return Outcome::Skipped;
        }
        Some(cost_us) if step.deadline.cannot_fit(started_ns / 1_000, cost_us) => {
            counters.explain_skipped_budget += 1;
            out.skip(ExplainSkipped::Budget);
            return Outcome::Skipped;
        }
        Some(_) => {}
    }
    let Explaining::Ready(ready) = &mut *explaining else { unreachable!("a refusal has no expected cost") };
    let row_dim = step.row_dim;
    let k = usize::from(step.explain_top_k).min(ready.width());
    out.choose(&scores[..step.rows], n);
    for (at, &c) in out.candidates[..n].iter().enumerate() {
        let row = &x[c as usize * row_dim..][..row_dim];
        let span = at * k..(at + 1) * k;
        match ready.top_k(row, &mut out.features[span.clone()], &mut out.contributions[span]) {
            Ok(bias) => out.bias = bias,
            // A row of another width than the model's: a layout bug, which
            // the path answers as a model it cannot explain, never a panic.
            Err(_) => {
                out.skip(ExplainSkipped::NotExplainable);
                return Outcome::Skipped;
            }
        }
    }
    (out.skipped, out.n, out.k) = (ExplainSkipped::None, n, k);
    counters.explained_candidates += n as u64;
    let done_ns = clock.now_ns();
    explaining.observe(n, done_ns.saturating_sub(started_ns));
    Outcome::Explained { late: step.deadline.cannot_fit(done_ns / 1_000, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top_scored_candidates_are_chosen_in_request_order() {
        let mut e = Explained::new();
        let scores = [0.2f32, 0.9, 0.5, 0.9, 0.1, 0.7];
        e.choose(&scores, 3);
        assert_eq!(&e.candidates[..3], &[1, 3, 5]);
        e.choose(&scores, 1);
        assert_eq!(&e.candidates[..1], &[1], "a tie goes to the lower index");
        e.choose(&scores, 6);
        assert_eq!(&e.candidates[..6], &[0, 1, 2, 3, 4, 5]);
        e.choose(&scores, 4);
        assert_eq!(&e.candidates[..4], &[1, 2, 3, 5]);
    }
}
