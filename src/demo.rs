//! The embedded demo: the "auction-32" reference workload, generated
//! deterministically so `quiver serve --demo` needs no Redis, GPU or download.
//!
//! auction-32: 100,000 users and 10,000 items with 32-float embeddings,
//! 16 context floats per request, an MLP 80 → 256 → ReLU → 128 → ReLU → 1 →
//! sigmoid, and requests that score 32 random candidates for one user.
//! The same seed always produces byte-identical files.

use std::path::{Path, PathBuf};

use crate::model::{InputSegment, Layer, Model, Source};
use crate::replica::{Replica, ReplicaBuilder};
use crate::wire::RequestSpec;

pub const USERS: u64 = 100_000;
pub const ITEMS: u64 = 10_000;
pub const EMBEDDING_DIM: u32 = 32;
pub const CONTEXT_LEN: usize = 16;
pub const CANDIDATES: usize = 32;
pub const HIDDEN: [usize; 2] = [256, 128];
pub const MODEL_NAME: &str = "auction-32";
pub const MODEL_VERSION: u32 = 1;
pub const FALLBACK_NAME: &str = "auction-32-fallback";
const SEED: u64 = 0x5155_4956_4552_0032;

pub use crate::seeded::SplitMix64;

/// Paths of the demo's files inside a data directory.
#[derive(Clone, Debug)]
pub struct DemoFiles {
    pub user: PathBuf,
    pub item: PathBuf,
    pub model: PathBuf,
    pub fallback: PathBuf,
}

impl DemoFiles {
    pub fn in_dir(dir: &Path) -> DemoFiles {
        DemoFiles {
            user: dir.join("user.qrep"),
            item: dir.join("item.qrep"),
            model: dir.join("model.qm"),
            fallback: dir.join("fallback.qm"),
        }
    }
}

fn embeddings(group: &str, count: u64, rng: &mut SplitMix64) -> ReplicaBuilder {
    let mut b = ReplicaBuilder::new(group, EMBEDDING_DIM);
    let mut v = vec![0.0f32; EMBEDDING_DIM as usize];
    for id in 0..count {
        for x in v.iter_mut() {
            *x = rng.normal() * 0.5;
        }
        b.push(id, &v).expect("dimension matches");
    }
    b
}

/// Seeded He-initialised MLP layers of widths `dims` (ReLU on every layer
/// but the last), biases normal with `bias_std`: the demo model's layers,
/// and the random models kernel tests and `quiver gpu-check` score.
pub fn he_layers(rng: &mut SplitMix64, dims: &[usize], bias_std: f32) -> Vec<Layer> {
    dims.windows(2)
        .enumerate()
        .map(|(i, w)| {
            let (n_in, n_out) = (w[0], w[1]);
            let std = (2.0 / n_in as f32).sqrt();
            let weights = (0..n_in * n_out).map(|_| rng.normal() * std).collect();
            let bias = (0..n_out).map(|_| rng.normal() * bias_std).collect();
            Layer::quantize(n_in, n_out, i + 2 < dims.len(), weights, bias)
        })
        .collect()
}

/// An uncalibrated MLP over `dims[0]` context floats with layers from
/// [`he_layers`] (bias std 0.1), for tests and checks that need odd shapes.
pub fn context_mlp(name: &str, seed: u64, dims: &[usize]) -> Model {
    let mut rng = SplitMix64::new(seed);
    Model {
        name: name.into(),
        version: 1,
        inputs: vec![InputSegment { source: Source::Context, dim: dims[0] }],
        layers: he_layers(&mut rng, dims, 0.1),
        calibration: None,
        graph: None,
        onnx: None,
    }
}

/// The demo model with seeded He-initialised weights.
pub fn model() -> Model {
    let mut rng = SplitMix64::new(SEED ^ 0x4d4f_4445_4c00);
    let dim = EMBEDDING_DIM as usize;
    let layers = he_layers(&mut rng, &[dim * 2 + CONTEXT_LEN, HIDDEN[0], HIDDEN[1], 1], 0.05);
    Model {
        name: MODEL_NAME.into(),
        version: MODEL_VERSION,
        inputs: vec![
            InputSegment { source: Source::User, dim },
            InputSegment { source: Source::Item, dim },
            InputSegment { source: Source::Context, dim: CONTEXT_LEN },
        ],
        layers,
        calibration: None,
        graph: None,
        onnx: None,
    }
}

/// The demo's fallback rung: a 16-unit MLP over the same inputs, about 40×
/// cheaper than the primary. Its weights are seeded, not trained: it stands
/// in for the small distilled model a deployment would ship.
pub fn fallback_model() -> Model {
    let mut rng = SplitMix64::new(SEED ^ 0x4641_4c4c);
    let n_in = EMBEDDING_DIM as usize * 2 + CONTEXT_LEN;
    let w1 = (0..n_in * 16).map(|_| rng.normal() * (2.0 / n_in as f32).sqrt()).collect();
    let w2 = (0..16).map(|_| rng.normal() * 0.5).collect();
    Model {
        name: FALLBACK_NAME.into(),
        version: MODEL_VERSION,
        inputs: model().inputs,
        layers: vec![Layer::quantize(n_in, 16, true, w1, vec![0.0; 16]), Layer::quantize(16, 1, false, w2, vec![0.0])],
        calibration: None,
        graph: None,
        onnx: None,
    }
}

fn demo_files_ok(files: &DemoFiles) -> bool {
    let replicas_ok = Replica::open(&files.user, "user").is_ok_and(|r| r.header().row_count == USERS)
        && Replica::open(&files.item, "item").is_ok_and(|r| r.header().row_count == ITEMS);
    replicas_ok
        && Model::load(&files.model).is_ok_and(|m| m == model())
        && Model::load(&files.fallback).is_ok_and(|m| m == fallback_model())
}

/// Creates the demo's files in `dir` unless valid ones are already there.
pub fn ensure(dir: &Path) -> Result<DemoFiles, crate::Error> {
    std::fs::create_dir_all(dir).map_err(|e| crate::Error::Setup(format!("{}: {e}", dir.display())))?;
    let files = DemoFiles::in_dir(dir);
    if demo_files_ok(&files) {
        tracing::info!(dir = %dir.display(), "demo data present");
        return Ok(files);
    }
    tracing::info!(dir = %dir.display(), "generating demo data (auction-32)");
    let mut rng = SplitMix64::new(SEED);
    embeddings("user", USERS, &mut rng).write(&files.user)?;
    embeddings("item", ITEMS, &mut rng).write(&files.item)?;
    model().save(&files.model)?;
    fallback_model().save(&files.fallback)?;
    Ok(files)
}

/// How ids are drawn from a group of `n` known ids.
#[derive(Clone, Debug)]
pub enum IdDist {
    Uniform,
    /// Zipf with exponent `s` over ranks 1..=n; rank r is id r-1, so low ids
    /// are hot. The cumulative table is built once and shared.
    Zipf {
        s: f64,
        cdf: std::sync::Arc<Vec<f64>>,
    },
}

impl IdDist {
    /// Largest group a Zipf table is built for (8 bytes per id).
    pub const ZIPF_IDS_MAX: u64 = 1 << 24;

    pub fn zipf(s: f64, n: u64) -> IdDist {
        assert!(s > 0.0 && s.is_finite(), "Zipf exponent must be positive");
        assert!((1..=Self::ZIPF_IDS_MAX).contains(&n), "Zipf over 1..={} ids", Self::ZIPF_IDS_MAX);
        let mut cdf = Vec::with_capacity(n as usize);
        let mut acc = 0.0;
        for rank in 1..=n {
            acc += 1.0 / (rank as f64).powf(s);
            cdf.push(acc);
        }
        for c in cdf.iter_mut() {
            *c /= acc;
        }
        IdDist::Zipf { s, cdf: std::sync::Arc::new(cdf) }
    }

    fn draw(&self, n: u64, rng: &mut SplitMix64) -> u64 {
        match self {
            IdDist::Uniform => rng.below(n),
            IdDist::Zipf { cdf, .. } => {
                let u = rng.unit();
                (cdf.partition_point(|&c| c < u) as u64).min(n - 1)
            }
        }
    }
}

/// Generates auction-32 requests (or a variant with other sizes).
#[derive(Clone, Debug)]
pub struct Workload {
    pub users: u64,
    pub items: u64,
    pub candidates: usize,
    pub context_len: usize,
    /// Fraction of ids drawn outside the known ranges.
    pub unknown_fraction: f64,
    pub budget_us: u32,
    pub user_dist: IdDist,
    pub item_dist: IdDist,
    rng: SplitMix64,
}

impl Workload {
    pub fn auction32(seed: u64) -> Workload {
        Workload {
            users: USERS,
            items: ITEMS,
            candidates: CANDIDATES,
            context_len: CONTEXT_LEN,
            unknown_fraction: 0.0,
            budget_us: 0,
            user_dist: IdDist::Uniform,
            item_dist: IdDist::Uniform,
            rng: SplitMix64::new(seed),
        }
    }

    /// Uses Zipf(s) for both users and items.
    pub fn with_zipf(mut self, s: f64) -> Workload {
        self.user_dist = IdDist::zipf(s, self.users);
        self.item_dist = IdDist::zipf(s, self.items);
        self
    }

    fn id(rng: &mut SplitMix64, dist: &IdDist, known: u64, unknown_fraction: f64) -> u64 {
        if unknown_fraction > 0.0 && rng.unit() < unknown_fraction {
            known + rng.below(u64::from(u32::MAX))
        } else {
            dist.draw(known, rng)
        }
    }

    /// Fills `spec` with the next request, reusing its allocations.
    pub fn fill(&mut self, request_id: u64, spec: &mut RequestSpec) {
        let rng = &mut self.rng;
        spec.request_id = request_id;
        spec.budget_us = self.budget_us;
        spec.user_id = Self::id(rng, &self.user_dist, self.users, self.unknown_fraction);
        spec.item_ids.clear();
        for _ in 0..self.candidates {
            spec.item_ids.push(Self::id(rng, &self.item_dist, self.items, self.unknown_fraction));
        }
        spec.context.clear();
        for _ in 0..self.context_len {
            spec.context.push(rng.normal());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_is_stable() {
        // Pinned outputs: demo files and workloads depend on this sequence.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let mut r = SplitMix64::new(1);
        for _ in 0..1000 {
            assert!(r.below(10) < 10);
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn demo_model_is_deterministic_and_valid() {
        let a = model();
        a.validate().unwrap();
        assert_eq!(a.to_bytes(), model().to_bytes());
        assert_eq!(a.input_dim(), 80);
    }

    #[test]
    fn workload_respects_sizes() {
        let mut w = Workload::auction32(3);
        let mut spec = RequestSpec::default();
        w.fill(1, &mut spec);
        assert_eq!(spec.item_ids.len(), CANDIDATES);
        assert_eq!(spec.context.len(), CONTEXT_LEN);
        assert!(spec.user_id < USERS && spec.item_ids.iter().all(|&i| i < ITEMS));
        w.unknown_fraction = 1.0;
        w.fill(2, &mut spec);
        assert!(spec.user_id >= USERS && spec.item_ids.iter().all(|&i| i >= ITEMS));
    }

    #[test]
    fn zipf_favours_low_ids() {
        let mut w = Workload::auction32(4).with_zipf(1.1);
        let mut spec = RequestSpec::default();
        let (mut hot, mut total) = (0, 0);
        for i in 0..500 {
            w.fill(i, &mut spec);
            hot += spec.item_ids.iter().filter(|&&id| id < 100).count();
            total += spec.item_ids.len();
            assert!(spec.item_ids.iter().all(|&id| id < ITEMS));
        }
        // Under Zipf(1.1) over 10,000 ids the top 1% draw well over half.
        assert!(hot * 2 > total, "{hot} of {total} in the top 100 ids");
    }
}
