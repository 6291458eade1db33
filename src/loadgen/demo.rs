//! The embedded demo: the "auction-32" reference workload, generated
//! deterministically so `quiver serve --demo` needs no Redis, GPU or download.
//!
//! auction-32: 100,000 users and 10,000 items with 32-float embeddings,
//! 16 context floats per request, an MLP 80 → 256 → ReLU → 128 → ReLU → 1 →
//! sigmoid, and requests that score 32 random candidates for one user.
//! The same seed always produces byte-identical files.

use std::path::{Path, PathBuf};

use crate::features::replica::{Replica, ReplicaBuilder, ReplicaError};
use crate::model::{InputSegment, Layer, Model, ModelError, Source};
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
        feature_names: Vec::new(),
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
        feature_names: Vec::new(),
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
        feature_names: Vec::new(),
    }
}

fn demo_files_ok(files: &DemoFiles) -> bool {
    let replicas_ok = Replica::open(&files.user, "user").is_ok_and(|r| r.header().row_count == USERS)
        && Replica::open(&files.item, "item").is_ok_and(|r| r.header().row_count == ITEMS);
    replicas_ok
        && Model::load(&files.model).is_ok_and(|m| m == model())
        && Model::load(&files.fallback).is_ok_and(|m| m == fallback_model())
}

/// Why the demo's files could not be written: the directory, or one of the
/// files in it (each error names its file).
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{}: {source}", dir.display())]
    Dir { dir: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Creates the demo's files in `dir` unless valid ones are already there.
pub fn ensure(dir: &Path) -> Result<DemoFiles, DemoError> {
    std::fs::create_dir_all(dir).map_err(|source| DemoError::Dir { dir: dir.to_path_buf(), source })?;
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

/// How ids are drawn from a group's known ids 0..n.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum IdDist {
    Uniform,
    /// Zipf with this exponent over ranks 1..=n, the ranks spread over the
    /// ids by [`Ids`]' fixed permutation.
    Zipf(f64),
}

impl std::fmt::Display for IdDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IdDist::Uniform => write!(f, "uniform"),
            IdDist::Zipf(s) => write!(f, "zipf:{s}"),
        }
    }
}

/// Largest group ids are drawn from: the sampler's bound, beyond the 2^30
/// rows one replica file holds.
pub const POPULATION_MAX: u64 = crate::loadgen::zipf::RANKS_MAX;

/// Draws ids 0..n by an [`IdDist`]. Constant size whatever n, so a
/// workload over a billion ids costs what one over a thousand does.
#[derive(Clone, Copy, Debug)]
pub struct Ids {
    n: u64,
    zipf: Option<crate::loadgen::zipf::Zipf>,
    /// Zipf rank r is id (r - 1) * stride mod n: a permutation (stride is
    /// coprime with n) that scatters the hot ids over the population, as in
    /// a real one, instead of packing them into the first rows of a file.
    stride: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Candidates tried after the golden-ratio point for a stride coprime with
/// n; the longest run of integers sharing a factor with any n <= 2^32 is a
/// few dozen (Jacobsthal's function).
const STRIDE_TRIES_MAX: u64 = 1024;

impl Ids {
    pub fn new(dist: IdDist, n: u64) -> Result<Ids, String> {
        if !(1..=POPULATION_MAX).contains(&n) {
            return Err(format!("a population of {n} ids: must be 1..={POPULATION_MAX}"));
        }
        let zipf = match dist {
            IdDist::Uniform => None,
            IdDist::Zipf(s) => Some(crate::loadgen::zipf::Zipf::new(s, n).map_err(|e| e.to_string())?),
        };
        // About n / phi apart: neighbouring ranks land far from each other.
        let base = (n as f64 * 0.618_033_988_749_894_8) as u64;
        let stride = (0..STRIDE_TRIES_MAX)
            .map(|d| (base + d) % n)
            .find(|&c| gcd(c, n) == 1)
            .expect("a stride coprime with n within STRIDE_TRIES_MAX");
        Ok(Ids { n, zipf, stride })
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    pub fn draw(&self, rng: &mut SplitMix64) -> u64 {
        match &self.zipf {
            None => rng.below(self.n),
            Some(z) => ((u128::from(z.sample(rng) - 1) * u128::from(self.stride)) % u128::from(self.n)) as u64,
        }
    }
}

/// Generates auction-32 requests (or a variant with other sizes).
#[derive(Clone, Debug)]
pub struct Workload {
    pub candidates: usize,
    pub context_len: usize,
    /// Fraction of ids drawn outside the known ranges.
    pub unknown_fraction: f64,
    pub budget_us: u32,
    pub users: Ids,
    pub items: Ids,
    rng: SplitMix64,
}

impl Workload {
    pub fn auction32(seed: u64) -> Workload {
        Workload {
            candidates: CANDIDATES,
            context_len: CONTEXT_LEN,
            unknown_fraction: 0.0,
            budget_us: 0,
            users: Ids::new(IdDist::Uniform, USERS).expect("the demo's population is valid"),
            items: Ids::new(IdDist::Uniform, ITEMS).expect("the demo's population is valid"),
            rng: SplitMix64::new(seed),
        }
    }

    /// Uses Zipf(s) for both users and items.
    pub fn with_zipf(mut self, s: f64) -> Result<Workload, String> {
        self.users = Ids::new(IdDist::Zipf(s), self.users.count())?;
        self.items = Ids::new(IdDist::Zipf(s), self.items.count())?;
        Ok(self)
    }

    fn id(rng: &mut SplitMix64, ids: &Ids, unknown_fraction: f64) -> u64 {
        if unknown_fraction > 0.0 && rng.unit() < unknown_fraction {
            ids.count() + rng.below(u64::from(u32::MAX))
        } else {
            ids.draw(rng)
        }
    }

    /// Fills `spec` with the next request, reusing its allocations.
    pub fn fill(&mut self, request_id: u64, spec: &mut RequestSpec) {
        let rng = &mut self.rng;
        spec.request_id = request_id;
        spec.budget_us = self.budget_us;
        spec.user_id = Self::id(rng, &self.users, self.unknown_fraction);
        spec.item_ids.clear();
        for _ in 0..self.candidates {
            spec.item_ids.push(Self::id(rng, &self.items, self.unknown_fraction));
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
    fn zipf_ids_are_the_ranks_through_a_permutation() {
        let mut w = Workload::auction32(4).with_zipf(1.1).unwrap();
        let mut spec = RequestSpec::default();
        let mut count = vec![0u32; ITEMS as usize];
        for i in 0..2000 {
            w.fill(i, &mut spec);
            for &id in &spec.item_ids {
                count[id as usize] += 1;
            }
        }
        let hot = Ids::new(IdDist::Zipf(1.1), ITEMS).unwrap();
        let rank_id = |r: u64| ((r - 1) * hot.stride % ITEMS) as usize;
        // Rank 1 (id 0) is the most drawn id; ranks 2 and 3 sit far apart.
        assert_eq!(count.iter().enumerate().max_by_key(|&(_, c)| *c).unwrap().0, 0);
        assert!(count[rank_id(2)] > count[rank_id(3)] && count[rank_id(3)] > 0);
        assert!(rank_id(2).abs_diff(rank_id(3)) > ITEMS as usize / 10);
        // Under Zipf(1.1) over 10,000 ids the top 100 ranks draw well over half.
        let top: u32 = (1..=100).map(|r| count[rank_id(r)]).sum();
        assert!(top * 2 > 2000 * CANDIDATES as u32, "{top} of the draws in the top 100 ranks");
    }

    #[test]
    fn the_rank_permutation_is_a_bijection() {
        for n in [1u64, 2, 3, 10, 97, 1000, 1 << 12, 3 * 5 * 7 * 11 * 13] {
            let ids = Ids::new(IdDist::Zipf(1.0), n).unwrap();
            let mut seen = vec![false; n as usize];
            for r in 1..=n {
                let id = ((r - 1) * ids.stride % n) as usize;
                assert!(!seen[id], "n {n}: id {id} twice");
                seen[id] = true;
            }
        }
        assert!(Ids::new(IdDist::Uniform, 0).is_err());
        assert!(Ids::new(IdDist::Uniform, POPULATION_MAX + 1).is_err());
        assert!(Ids::new(IdDist::Zipf(-1.0), 10).is_err());
        // Large populations take no memory of their own.
        assert!(std::mem::size_of::<Ids>() <= 128);
        let big = Ids::new(IdDist::Zipf(1.1), 50_000_000).unwrap();
        let mut rng = SplitMix64::new(1);
        assert!((0..10_000).all(|_| big.draw(&mut rng) < 50_000_000));
    }
}
