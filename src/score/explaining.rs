//! Reason codes on a shard: a served version's [`Explainer`], built once
//! per model version and shared by every shard that serves it ([`Built`],
//! through the registry's [`Explainers`]), with the memory one call needs
//! and the cost estimate held per shard ([`Explaining`]).
//!
//! Why one shared table, built eagerly off the reactor: the quadrature's
//! table of a large ensemble takes hundreds of milliseconds to build and
//! time, which per shard (and per fallback and shadow, which never
//! explain) multiplied a version's load time for nothing. The table is
//! read-only once built, so shards share it behind an `Arc` and keep only
//! their scratch (a walk's vectors, the contributions of one candidate),
//! allocated when the shard builds the version, so the request path
//! allocates nothing (`tests/alloc.rs`). It is built where the version's
//! backends are built: on the admin side before a version is published
//! (`Registry::prebuild`), or at start-up by the first shard that serves
//! the version (the others wait for that build and share it). Building it
//! lazily on the first request that asks was the other choice, and a worse
//! one: built on the reactor it stalls every connection of the shard for
//! the build; handed to a thread, the first requests would be answered
//! without reasons the model can give; and either way the budget rule
//! would have no measured cost for them. Fallbacks and shadows get no
//! explainer at all ([`Explaining::Unused`]): only the primary explains.
//!
//! The cost is taken once, when the table is built, on [`PROBE_ROWS`]
//! seeded rows (path-dependent TreeSHAP walks every node of every tree
//! whatever the row, so any row costs about the same); each shard starts
//! from it and then follows what its requests take
//! ([`Explaining::observe`]). A model the explainer refuses keeps the
//! refusal, so a request that asks gets `not_explainable` at once.

use std::sync::{Arc, Mutex, OnceLock};

use crate::model::explain::{ExplainError, Explainer, Scratch};
use crate::model::Model;
use crate::seeded::SplitMix64;

/// Rows explained at build time to measure a candidate's cost.
pub const PROBE_ROWS: usize = 4;

/// A version's explainer as every shard shares it, with the cost of a
/// candidate measured when it was built; or why the model has none.
#[derive(Clone, Debug)]
pub enum Built {
    Ready {
        explainer: Arc<Explainer>,
        ns_per_candidate: f64,
    },
    /// The explainer's refusal (`ExplainError`), as text for logs.
    Refused(Arc<str>),
}

impl Built {
    /// Builds `model`'s explainer and times it on [`PROBE_ROWS`] seeded
    /// rows, by the clock `now_ns`.
    pub fn build(model: &Arc<Model>, now_ns: impl Fn() -> u64) -> Built {
        let refused = |e: ExplainError| Built::Refused(e.to_string().into());
        let explainer = match Explainer::new(model.clone()) {
            Ok(e) => e,
            Err(e) => return refused(e),
        };
        let width = explainer.width();
        let (mut scratch, mut contributions) = (explainer.scratch(), vec![0.0; width]);
        let mut rng = SplitMix64::new(0x5EED_0E0E);
        let rows: Vec<f32> = (0..PROBE_ROWS * width).map(|_| rng.normal()).collect();
        let started_ns = now_ns();
        for row in rows.chunks_exact(width.max(1)).take(PROBE_ROWS) {
            if let Err(e) = explainer.explain(row, &mut scratch, &mut contributions) {
                return refused(e);
            }
        }
        let ns_per_candidate = now_ns().saturating_sub(started_ns) as f64 / PROBE_ROWS as f64;
        Built::Ready { explainer: Arc::new(explainer), ns_per_candidate }
    }
}

/// The explainers built for the versions served, one per model version,
/// shared by the shards and the admin side (`Registry::explainer`). An
/// entry is made by the first caller for its model, who builds it; a caller
/// for the same model meanwhile waits for that build rather than making a
/// second. The lock is held only to find or add an entry, never while one
/// is built.
#[derive(Debug, Default)]
pub struct Explainers {
    built: Mutex<Vec<Entry>>,
}

type Entry = (Arc<Model>, Arc<OnceLock<Built>>);

impl Explainers {
    /// `model`'s explainer, built (and timed by `now_ns`) on first use.
    /// Entries for models `keep` rejects are dropped first (the registry
    /// keeps those it serves), so the table holds no more than the served
    /// set and the model asked for.
    pub fn get(&self, model: &Arc<Model>, keep: impl Fn(&Arc<Model>) -> bool, now_ns: impl Fn() -> u64) -> Built {
        let (cell, dropped) = {
            let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
            let (kept, dropped): (Vec<Entry>, Vec<Entry>) =
                std::mem::take(&mut *built).into_iter().partition(|(m, _)| Arc::ptr_eq(m, model) || keep(m));
            *built = kept;
            let cell = match built.iter().find(|(m, _)| Arc::ptr_eq(m, model)) {
                Some((_, cell)) => cell.clone(),
                None => {
                    let cell = Arc::new(OnceLock::new());
                    built.push((model.clone(), cell.clone()));
                    cell
                }
            };
            (cell, dropped)
        };
        // A dropped table is freed outside the lock.
        drop(dropped);
        cell.get_or_init(|| Built::build(model, now_ns)).clone()
    }

    /// Models with an entry (built or being built).
    pub fn len(&self) -> usize {
        self.built.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A version's explainer on one shard, or why it has none.
#[derive(Debug)]
pub enum Explaining {
    Ready(Box<Ready>),
    /// The explainer's refusal (`ExplainError`), as text for logs.
    Refused(Arc<str>),
    /// A fallback or a shadow: never explains, so nothing was built.
    Unused,
}

/// A shared explainer with this shard's scratch and cost estimate.
#[derive(Debug)]
pub struct Ready {
    explainer: Arc<Explainer>,
    scratch: Scratch,
    /// One candidate's contributions, the model's input width.
    contributions: Vec<f64>,
    /// Time to explain one candidate, measured when the explainer was
    /// built, then this shard's running estimate.
    pub ns_per_candidate: f64,
}

impl Explaining {
    /// Recent requests' weight in the running cost, as the kernel's.
    const WEIGHT_NEW: f64 = 0.05;

    /// This shard's use of `built`: its own scratch, allocated here.
    pub fn for_shard(built: &Built) -> Explaining {
        match built {
            Built::Ready { explainer, ns_per_candidate } => Explaining::Ready(Box::new(Ready {
                scratch: explainer.scratch(),
                contributions: vec![0.0; explainer.width()],
                explainer: explainer.clone(),
                ns_per_candidate: *ns_per_candidate,
            })),
            Built::Refused(why) => Explaining::Refused(why.clone()),
        }
    }

    /// Expected time to explain `candidates`, µs; `None` when there is no
    /// explainer.
    pub fn expected_us(&self, candidates: usize) -> Option<u64> {
        match self {
            Explaining::Ready(r) => Some((r.ns_per_candidate * candidates as f64 / 1_000.0).ceil() as u64),
            Explaining::Refused(_) | Explaining::Unused => None,
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

    /// The explainer this shard shares with the others.
    pub fn explainer(&self) -> &Arc<Explainer> {
        &self.explainer
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
        let built = Built::build(&trees, || {
            tick.set(tick.get() + 1_000);
            tick.get()
        });
        let Explaining::Ready(mut ready) = Explaining::for_shard(&built) else {
            panic!("a tree model with covers was refused")
        };
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
        let built = Built::build(&mlp, || 0);
        let Explaining::Refused(why) = Explaining::for_shard(&built) else { panic!("an MLP was explained") };
        assert!(why.contains("cannot be explained exactly"), "{why}");
        assert_eq!(Explaining::for_shard(&built).expected_us(4), None);
        assert_eq!(Explaining::Unused.expected_us(4), None);
    }

    #[test]
    fn a_version_is_built_once_and_shared_by_every_shard_from_any_thread() {
        let trees = Arc::new(crate::model::trees::tests::small_explainable());
        let other = Arc::new(crate::model::trees::tests::small_explainable());
        let table = Explainers::default();
        let builds = std::sync::atomic::AtomicUsize::new(0);
        // Four "shards" ask at once; the clock counts the builds (a build
        // reads it twice).
        let got: Vec<Built> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        table.get(&trees, |_| true, || builds.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u64)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(builds.load(std::sync::atomic::Ordering::Relaxed), 2, "one build, timed once");
        let first = match &got[0] {
            Built::Ready { explainer, .. } => explainer.clone(),
            Built::Refused(why) => panic!("refused: {why}"),
        };
        for b in &got {
            let Built::Ready { explainer, .. } = b else { unreachable!() };
            assert!(Arc::ptr_eq(explainer, &first), "every shard shares one table");
        }
        // Each shard's scratch is its own; the table is not copied.
        let (a, b) = (Explaining::for_shard(&got[0]), Explaining::for_shard(&got[1]));
        let (Explaining::Ready(a), Explaining::Ready(b)) = (a, b) else { unreachable!() };
        assert!(Arc::ptr_eq(a.explainer(), b.explainer()));
        // Another version: built anew; the first, no longer kept, is
        // dropped from the table (the shards' copies live on).
        assert_eq!(table.len(), 1);
        let _ = table.get(&other, |m| Arc::ptr_eq(m, &other), || 0);
        assert_eq!(table.len(), 1);
        assert_eq!(Arc::strong_count(&first), 1 + got.len() + 2, "the table's own entry is gone");
        let _ = table.get(&trees, |_| true, || builds.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as u64);
        assert_eq!(builds.load(std::sync::atomic::Ordering::Relaxed), 4, "a dropped version is built again");
        assert_eq!(table.len(), 2);
    }
}
