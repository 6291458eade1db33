//! Reason codes on a shard: a served version's [`Explainer`] with the
//! memory one call needs and the measured cost of a candidate, built where
//! the version's backend is built (`registry::build_timed`: on the admin
//! side for a published version, at start-up on the shard), never on the
//! request path.
//!
//! Why beside the backend: the request path explains only when the time
//! left fits, and that rule needs a cost measured before the first request,
//! as the kernel's is. The cost is taken once, on [`PROBE_ROWS`] seeded
//! rows (path-dependent TreeSHAP walks every node of every tree whatever
//! the row, so any row costs about the same), and then follows what
//! requests take ([`Explaining::observe`]). A model the explainer refuses
//! keeps the refusal, so a request that asks gets `not_explainable` at
//! once.

use std::sync::Arc;

use crate::model::explain::{ExplainError, Explainer, Scratch};
use crate::model::Model;
use crate::seeded::SplitMix64;

/// Rows explained at build time to measure a candidate's cost.
pub const PROBE_ROWS: usize = 4;

/// A version's explainer on one shard, or why its model has none.
#[derive(Debug)]
pub enum Explaining {
    Ready(Box<Ready>),
    /// The explainer's refusal (`ExplainError`), as text for logs.
    Refused(String),
}

/// An explainer with its scratch and its cost estimate.
#[derive(Debug)]
pub struct Ready {
    explainer: Explainer,
    scratch: Scratch,
    /// One candidate's contributions, the model's input width.
    contributions: Vec<f64>,
    /// Time to explain one candidate, measured at build, then a running
    /// estimate.
    pub ns_per_candidate: f64,
}

impl Explaining {
    /// Recent requests' weight in the running cost, as the kernel's.
    const WEIGHT_NEW: f64 = 0.05;

    /// Builds `model`'s explainer and times it on [`PROBE_ROWS`] seeded
    /// rows, by the clock `now_ns`.
    pub fn build(model: &Arc<Model>, now_ns: impl Fn() -> u64) -> Explaining {
        let explainer = match Explainer::new(model.clone()) {
            Ok(e) => e,
            Err(e) => return Explaining::Refused(e.to_string()),
        };
        let width = explainer.width();
        let mut ready =
            Ready { scratch: explainer.scratch(), contributions: vec![0.0; width], explainer, ns_per_candidate: 0.0 };
        let mut rng = SplitMix64::new(0x5EED_0E0E);
        let rows: Vec<f32> = (0..PROBE_ROWS * width).map(|_| rng.normal()).collect();
        let started_ns = now_ns();
        for row in rows.chunks_exact(width.max(1)).take(PROBE_ROWS) {
            let Ready { explainer, scratch, contributions, .. } = &mut ready;
            if let Err(e) = explainer.explain(row, scratch, contributions) {
                return Explaining::Refused(e.to_string());
            }
        }
        ready.ns_per_candidate = now_ns().saturating_sub(started_ns) as f64 / PROBE_ROWS as f64;
        Explaining::Ready(Box::new(ready))
    }

    /// Expected time to explain `candidates`, µs; `None` when refused.
    pub fn expected_us(&self, candidates: usize) -> Option<u64> {
        match self {
            Explaining::Ready(r) => Some((r.ns_per_candidate * candidates as f64 / 1_000.0).ceil() as u64),
            Explaining::Refused(_) => None,
        }
    }

    /// Folds the time `elapsed_ns` that explaining `candidates` took into
    /// the running estimate.
    pub fn observe(&mut self, candidates: usize, elapsed_ns: u64) {
        if let Explaining::Ready(r) = self {
            let sample = elapsed_ns as f64 / candidates.max(1) as f64;
            r.ns_per_candidate += (sample - r.ns_per_candidate) * Self::WEIGHT_NEW;
        }
    }
}

impl Ready {
    /// Explains one input `row` and writes its `features.len()` largest
    /// contributions by magnitude to `features` and `values` (ties: the
    /// lower index first); returns the bias. `features` is no longer than
    /// the row. Allocates nothing.
    pub fn top_k(&mut self, row: &[f32], features: &mut [u32], values: &mut [f64]) -> Result<f64, ExplainError> {
        let bias = self.explainer.explain(row, &mut self.scratch, &mut self.contributions)?;
        top_by_magnitude(&self.contributions, features, values);
        Ok(bias)
    }

    /// The model's input width: the most features a candidate can list.
    pub fn width(&self) -> usize {
        self.explainer.width()
    }

    /// The margin with no feature known.
    pub fn bias(&self) -> f64 {
        self.explainer.bias()
    }
}

/// The `features.len()` entries of `contributions` with the largest
/// magnitude, largest first, ties by the lower index: their indices to
/// `features`, their values to `values`. An insertion into a sorted prefix:
/// k is at most `EXPLAIN_TOP_K_MAX`, so this is the scan of the row and a
/// few moves, with no allocation.
pub fn top_by_magnitude(contributions: &[f64], features: &mut [u32], values: &mut [f64]) {
    let k = features.len().min(contributions.len());
    let mut filled = 0;
    for (i, &c) in contributions.iter().enumerate() {
        let m = c.abs();
        // The first place whose magnitude this one beats; equal ones stay
        // ahead (they have lower indices).
        let at = values[..filled].iter().position(|v| m > v.abs()).unwrap_or(filled);
        if at >= k {
            continue;
        }
        let end = filled.min(k - 1);
        features.copy_within(at..end, at + 1);
        values.copy_within(at..end, at + 1);
        features[at] = i as u32;
        values[at] = c;
        filled = (filled + 1).min(k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: every index sorted by magnitude, then index.
    fn sorted(c: &[f64], k: usize) -> Vec<(u32, f64)> {
        let mut all: Vec<usize> = (0..c.len()).collect();
        all.sort_by(|&a, &b| c[b].abs().total_cmp(&c[a].abs()).then(a.cmp(&b)));
        all.into_iter().take(k).map(|i| (i as u32, c[i])).collect()
    }

    #[test]
    fn the_top_k_are_the_largest_magnitudes_ties_by_lower_index() {
        let mut rng = SplitMix64::new(7);
        for trial in 0..500 {
            let n = 1 + rng.below(40) as usize;
            // Few distinct magnitudes, both signs, so ties are common.
            let c: Vec<f64> = (0..n).map(|_| (rng.below(7) as f64 - 3.0) * 0.5).collect();
            for k in [1, 3, 5, n, n + 3] {
                let k = k.min(n);
                let (mut f, mut v) = (vec![0u32; k], vec![0f64; k]);
                top_by_magnitude(&c, &mut f, &mut v);
                let got: Vec<(u32, f64)> = f.into_iter().zip(v).collect();
                assert_eq!(got, sorted(&c, k), "trial {trial}, k {k}, {c:?}");
            }
        }
    }

    #[test]
    fn a_tree_model_is_measured_and_its_top_k_sum_with_the_rest_to_the_margin() {
        let trees = Arc::new(crate::model::trees::tests::small_explainable());
        // A clock that moves 1,000 ns per reading: the probe reads it twice.
        let tick = std::cell::Cell::new(0u64);
        let built = Explaining::build(&trees, || {
            tick.set(tick.get() + 1_000);
            tick.get()
        });
        let Explaining::Ready(mut ready) = built else { panic!("a tree model with covers was refused") };
        assert_eq!(ready.ns_per_candidate, 1_000.0 / PROBE_ROWS as f64);
        let row = [0.5f32, -1.0, 2.0];
        let (mut f, mut v) = ([0u32; 2], [0f64; 2]);
        let bias = ready.top_k(&row, &mut f, &mut v).unwrap();
        let all = ready.contributions.clone();
        assert_eq!(f.iter().zip(v).map(|(&f, v)| (f, v)).collect::<Vec<_>>(), sorted(&all, 2));
        let margin = bias + all.iter().sum::<f64>();
        let mut out = [0f32];
        trees.forward_f32_reference(&row, 1, &mut out);
        let want = out[0] as f64;
        assert!((margin - want).abs() < 1e-5, "{margin} vs {want}");
    }

    #[test]
    fn an_mlp_is_refused_with_the_explainers_reason() {
        let mlp = Arc::new(crate::loadgen::demo::model());
        let Explaining::Refused(why) = Explaining::build(&mlp, || 0) else { panic!("an MLP was explained") };
        assert!(why.contains("cannot be explained exactly"), "{why}");
        assert_eq!(Explaining::build(&mlp, || 0).expected_us(4), None);
    }
}
