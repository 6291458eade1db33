//! Every backend over the same oracle cases (ripgrep's `rgtest!` is the
//! model): `oracle_tests!` writes, for each backend this build has, one test
//! per case, and every case compares the backend's scores with
//! `Model::forward_f32_reference`, the specification the f32 backend follows,
//! within that backend's tolerance: plain MLPs (uncalibrated, and calibrated
//! for INT8's static path), graph models from the zoo, a tree ensemble,
//! missing values, and several requests in one call. Row counts run from 1 to
//! `rows_max`.
//!
//! The CUDA backend (feature `cuda`) runs where this machine has a GPU (a
//! driver library and an NVIDIA device node) and must start there; elsewhere
//! its tests say why they skip. onnxruntime (feature `onnxruntime`) runs the
//! zoo models imported with their ONNX graph kept, where the pinned PyPI
//! wheel's library is installed, and says why it skips otherwise. Neither
//! reads the environment.

mod common;

use std::sync::Arc;

use common::zoo::{zoo, Zoo};
use quiver::model::calibrate::{calibrate, Matrix, Method};
use quiver::model::onnx::{import_file_keeping, KeepOnnx};
use quiver::model::trees::{Ensemble, Split, TreeNode};
use quiver::model::{Graph, Model, Node, Op, OutputKind};
use quiver::score::cpu::{CpuF32, CpuFp8, CpuInt8, Int8Kernel};
use quiver::score::Backend;

/// The most rows one call holds; every case runs 1 row and this many.
const ROWS_MAX: usize = 64;
/// Row counts of each case: one, the 4-row tiles' leftovers, and the most.
const ROWS: [usize; 6] = [1, 2, 5, 31, 33, ROWS_MAX];

/// Builds a backend for a model with room for some rows, or says why this
/// machine or this backend cannot run it and gives `None`.
type Make = fn(&Arc<Model>, usize) -> Option<Box<dyn Backend>>;

/// What a case needs to know about a backend.
struct Spec {
    make: Make,
    /// Max |score − reference score| on plain MLPs (cpu/mod.rs's and
    /// cpu/fp8.rs's bounds).
    mlp_tolerance: f32,
    /// The same on plain MLPs calibrated by max-abs (INT8's static path;
    /// FP8 then scales its activations by the calibrated ranges, measured
    /// at most 0.105 here, against 0.067 unscaled).
    calibrated_tolerance: f32,
    /// Max |score − reference score| on the zoo's graph models (the
    /// documented bounds of tests/zoo.rs).
    graph_tolerance: f32,
    /// Whether rows scored together give exactly the numbers of rows scored
    /// alone (every native backend computes each row on its own).
    rows_independent: bool,
    /// Whether a missing value (NaN) reads as 0 (the native semantics;
    /// onnxruntime computes with the NaN).
    missing_reads_as_zero: bool,
}

fn f32_backend(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    Some(Box::new(CpuF32::new(m, rows)))
}

fn int8(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    Some(Box::new(CpuInt8::new(m, rows)))
}

fn int8_scalar(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    Some(Box::new(CpuInt8::with_kernel(m, rows, Int8Kernel::Scalar).expect("the scalar kernel runs everywhere")))
}

fn fp8(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    Some(Box::new(CpuFp8::new(m, rows)))
}

/// The GPU backend where this machine has a GPU; it must start there.
#[cfg(feature = "cuda")]
fn cuda(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    use quiver::score::cuda::{gpu_expected, CudaInt8};
    if m.graph.is_some() {
        eprintln!("SKIPPED cuda on {}: the CUDA backend runs plain MLPs; graph models are served on cpu-int8", m.name);
        return None;
    }
    let (gpu, why) = gpu_expected();
    match CudaInt8::new(m, rows) {
        Ok(b) => {
            assert!(gpu, "{why}, yet the CUDA backend started");
            Some(Box::new(b))
        }
        Err(e) => {
            assert!(!gpu, "{why}, but the CUDA backend did not start: {e}");
            eprintln!("SKIPPED cuda on {}: {why}: {e}", m.name);
            None
        }
    }
}

/// onnxruntime, for a model that keeps its ONNX graph, where the pinned
/// wheel's library is installed.
#[cfg(feature = "onnxruntime")]
fn onnxruntime(m: &Arc<Model>, rows: usize) -> Option<Box<dyn Backend>> {
    if m.onnx.is_none() {
        eprintln!("SKIPPED onnxruntime on {}: no ONNX graph kept (a model built here, not imported)", m.name);
        return None;
    }
    let Some(library) = common::onnxruntime_wheel_library() else {
        eprintln!("SKIPPED onnxruntime: no library (pip install onnxruntime==1.32.0)");
        return None;
    };
    quiver::score::configure_onnxruntime(&library);
    match quiver::score::ort::OrtBackend::new(m, rows) {
        Ok(b) => Some(Box::new(b)),
        Err(e) => {
            eprintln!("SKIPPED onnxruntime on {}: {e}", m.name);
            None
        }
    }
}

/// `rows` seeded normal rows of `dim` floats.
fn inputs(seed: u64, rows: usize, dim: usize) -> Vec<f32> {
    let mut rng = quiver::loadgen::demo::SplitMix64::new(seed);
    (0..rows * dim).map(|_| rng.normal()).collect()
}

/// Plain MLPs at odd sizes (no multiple of a vector width), and the demo
/// model (user, item and context inputs).
fn mlps() -> Vec<Arc<Model>> {
    let mut v: Vec<Model> = [vec![80usize, 256, 128, 1], vec![3, 1], vec![37, 33, 17, 1]]
        .iter()
        .map(|dims| quiver::loadgen::demo::context_mlp("mlp", 11, dims))
        .collect();
    v.push(quiver::loadgen::demo::model());
    v.into_iter().map(Arc::new).collect()
}

/// `model` (80 inputs) reading feature groups whose scopes interleave:
/// a candidate-scope group, a request-scope one, another candidate-scope
/// one, then the context, so the per-request columns are not one run.
fn interleaved_groups(mut model: Model) -> Model {
    use quiver::features::groups::Scope;
    use quiver::model::{GroupName, InputSegment, Source};
    assert_eq!(model.input_dim(), 80);
    let group = |name: &str, scope, dim| InputSegment {
        source: Source::Group { name: GroupName::new(name).unwrap(), scope },
        dim,
    };
    model.name = "interleaved-groups".into();
    model.inputs = vec![
        group("ad", Scope::Candidate, 16),
        group("card", Scope::Request, 16),
        group("creative", Scope::Candidate, 32),
        InputSegment { source: Source::Context, dim: 16 },
    ];
    model
}

/// `model` calibrated by max-abs on 2048 seeded normal rows (so the test
/// rows, drawn alike, rarely leave the ranges): INT8's static path, FP8's
/// calibrated activation scales.
fn calibrated(model: Model) -> Arc<Model> {
    let k = model.input_dim();
    let set = Matrix { rows: 2048, cols: k, data: inputs(77, 2048, k) };
    let c = calibrate(&model, &set, Method::MaxAbs, |_, _| {}).expect("the MLP calibrates");
    Arc::new(Model { calibration: Some(c), name: format!("{}-calibrated", model.name), ..model })
}

/// Graph models of the zoo, imported with their ONNX graph kept (so
/// onnxruntime can run them too), each with its held-out rows: a two-tower
/// model with embeddings, DeepFM over ids, a cross network, Wide&Deep and an
/// MLP with layer norms.
fn graphs() -> Vec<(Arc<Model>, Zoo)> {
    const NAMES: [&str; 5] = ["two_tower", "deepfm_ids", "dcn_v2", "wide_deep", "layernorm_mlp"];
    zoo()
        .into_iter()
        .filter(|z| NAMES.contains(&z.name.as_str()))
        .map(|z| {
            let opts = z.import_options();
            let model = import_file_keeping(&z.file, &opts, KeepOnnx::Beside)
                .unwrap_or_else(|e| panic!("{}: {e}", z.name))
                .model;
            assert!(model.graph.is_some(), "{} is a graph model", z.name);
            (Arc::new(model), z)
        })
        .collect()
}

/// A tree ensemble over six inputs, whose trees send missing values
/// (NaN) both ways.
fn trees() -> Arc<Model> {
    let mut e = Ensemble { base: 0.25, ..Ensemble::default() };
    let split =
        |feature, threshold, missing_left| Split::Numeric { feature, threshold, missing_left, zero_missing: false };
    e.push_tree(&[
        TreeNode { split: split(3, 0.5, false), left: 1, right: 2 },
        TreeNode::leaf(-1.0),
        TreeNode::leaf(1.5),
    ]);
    e.push_tree(&[
        TreeNode { split: split(0, -0.25, true), left: 1, right: 2 },
        TreeNode { split: split(5, 0.0, false), left: 3, right: 4 },
        TreeNode::leaf(0.75),
        TreeNode::leaf(-0.5),
        TreeNode::leaf(0.125),
    ]);
    let nodes = vec![
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 6 },
        Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
    ];
    let base = quiver::loadgen::demo::context_mlp("trees", 1, &[6, 1]);
    let model = Model { layers: Vec::new(), graph: Some(Graph { nodes, output: OutputKind::Logit }), ..base };
    model.validate().expect("a valid tree model");
    Arc::new(model)
}

/// Scores `rows` rows of `x` on `b` and checks each against the reference
/// within `tolerance` on the score; returns the largest difference.
fn check(b: &mut dyn Backend, x: &[f32], rows: usize, tolerance: f32, what: &str) -> f32 {
    let model = b.model().clone();
    let mut want = vec![0.0; rows];
    model.forward_f32_reference(x, rows, &mut want);
    let mut got = vec![f32::NAN; rows];
    b.score(x, rows, &mut got).unwrap_or_else(|e| panic!("{} on {what}: {e}", b.name()));
    let mut worst = 0.0f32;
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        let (gs, ws) = (model.score(*g), model.score(*w));
        assert!(
            (gs - ws).abs() <= tolerance,
            "{} on {what}, {rows} rows: row {r} scores {gs}, the reference {ws}",
            b.name()
        );
        worst = worst.max((gs - ws).abs());
    }
    worst
}

fn check_mlps(spec: &Spec) {
    for model in mlps() {
        let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { continue };
        for rows in ROWS {
            check(&mut *b, &inputs(rows as u64, rows, model.input_dim()), rows, spec.mlp_tolerance, &model.name);
        }
    }
}

fn check_calibrated_mlps(spec: &Spec) {
    for model in mlps() {
        let model = calibrated((*model).clone());
        let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { continue };
        let mut worst = 0.0f32;
        for rows in ROWS {
            let x = inputs(rows as u64 + 50, rows, model.input_dim());
            worst = worst.max(check(&mut *b, &x, rows, spec.calibrated_tolerance, &model.name));
        }
        eprintln!(
            "{} on {} ({:?}): max |Δ score| {worst:.4}",
            b.name(),
            model.name,
            model.layers.iter().map(|l| l.in_dim).collect::<Vec<_>>()
        );
    }
}

fn check_graphs(spec: &Spec) {
    for (model, z) in graphs() {
        let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { continue };
        for (i, rows) in ROWS.into_iter().enumerate() {
            let at = i * ROWS_MAX * z.dim;
            check(&mut *b, &z.x[at..at + rows * z.dim], rows, spec.graph_tolerance, &model.name);
        }
    }
}

fn check_trees(spec: &Spec) {
    let model = trees();
    let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { return };
    for rows in ROWS {
        let mut x = inputs(rows as u64 + 90, rows, 6);
        // Missing values on the split features, both directions.
        for (r, row) in x.chunks_exact_mut(6).enumerate() {
            match r % 4 {
                1 => row[3] = f32::NAN,
                2 => row[0] = f32::NAN,
                3 => row[5] = f32::NAN,
                _ => {}
            }
        }
        // Trees run the same code on every backend: the reference's
        // numbers exactly.
        check(&mut *b, &x, rows, 0.0, "trees");
    }
}

/// A missing value (NaN) in a dense model's input reads as 0, on every row
/// count.
fn check_missing_values(spec: &Spec) {
    if !spec.missing_reads_as_zero {
        eprintln!("SKIPPED: this backend computes with a missing value (NaN) as the graph does");
        return;
    }
    let models: Vec<Arc<Model>> = mlps().into_iter().chain(graphs().into_iter().map(|(m, _)| m)).collect();
    for model in models {
        let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { continue };
        let dim = model.input_dim();
        for rows in ROWS {
            let mut x = inputs(rows as u64 + 30, rows, dim);
            let mut zeroed = x.clone();
            for i in (0..rows * dim).step_by(7) {
                (x[i], zeroed[i]) = (f32::NAN, 0.0);
            }
            let (mut got, mut want) = (vec![0.0; rows], vec![0.0; rows]);
            b.score(&x, rows, &mut got).unwrap();
            b.score(&zeroed, rows, &mut want).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{} on {}, {rows} rows", b.name(), model.name);
        }
    }
}

/// Rows of three requests in one call (the inference thread's batch: 20
/// candidates, 1, and the rest, each holding its own request's user and
/// context columns) score as each row scored alone; so do one request's
/// rows (a shard's call). Backends that compute the per-request part once
/// must give the same numbers.
fn check_requests(spec: &Spec) {
    let models: Vec<Arc<Model>> = [quiver::loadgen::demo::model(), interleaved_groups(quiver::loadgen::demo::model())]
        .into_iter()
        .map(Arc::new)
        .chain(graphs().into_iter().map(|(m, _)| m))
        .collect();
    for model in models {
        let Some(mut b) = (spec.make)(&model, ROWS_MAX) else { continue };
        let dim = model.input_dim();
        let shared = model.request_columns();
        assert!(shared.iter().any(|s| *s) && !shared.iter().all(|s| *s), "{}: request and item columns", model.name);
        let mut x = inputs(5, ROWS_MAX, dim);
        let first_of = |r: usize| match r {
            0..20 => 0,
            20 => 20,
            _ => 21,
        };
        for r in 0..ROWS_MAX {
            for c in (0..dim).filter(|&c| shared[c]) {
                x[r * dim + c] = x[first_of(r) * dim + c];
            }
        }
        let mut alone = vec![0.0; ROWS_MAX];
        for (r, y) in alone.iter_mut().enumerate() {
            b.score(&x[r * dim..(r + 1) * dim], 1, std::slice::from_mut(y)).unwrap();
        }
        let (mut one, mut three) = (vec![0.0; 20], vec![0.0; ROWS_MAX]);
        b.score(&x[..20 * dim], 20, &mut one).unwrap();
        b.score(&x, ROWS_MAX, &mut three).unwrap();
        if spec.rows_independent {
            assert_eq!(alone[..20], one[..], "{} on {}: one request", b.name(), model.name);
            assert_eq!(alone, three, "{} on {}: three requests", b.name(), model.name);
        } else {
            let worst = alone.iter().zip(&three).map(|(a, t)| (a - t).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-5, "{} on {}: three requests differ from rows alone by {worst}", b.name(), model.name);
        }
    }
}

/// One test per case for each backend named.
macro_rules! oracle_tests {
    ($($backend:ident: $spec:expr;)+) => {$(
        mod $backend {
            use super::*;

            const SPEC: Spec = $spec;

            #[test]
            fn plain_mlps_match_the_reference() {
                check_mlps(&SPEC);
            }

            #[test]
            fn calibrated_mlps_match_the_reference() {
                check_calibrated_mlps(&SPEC);
            }

            #[test]
            fn graph_models_match_the_reference() {
                check_graphs(&SPEC);
            }

            #[test]
            fn tree_ensembles_match_the_reference_exactly() {
                check_trees(&SPEC);
            }

            #[test]
            fn a_missing_value_reads_as_zero() {
                check_missing_values(&SPEC);
            }

            #[test]
            fn requests_in_one_call_score_as_their_rows_alone() {
                check_requests(&SPEC);
            }
        }
    )+};
}

oracle_tests! {
    cpu_f32: Spec { make: f32_backend, mlp_tolerance: 1e-4, calibrated_tolerance: 1e-4, graph_tolerance: 1e-4, rows_independent: true, missing_reads_as_zero: true };
    cpu_int8: Spec { make: int8, mlp_tolerance: 0.03, calibrated_tolerance: 0.03, graph_tolerance: 0.05, rows_independent: true, missing_reads_as_zero: true };
    cpu_int8_scalar: Spec { make: int8_scalar, mlp_tolerance: 0.03, calibrated_tolerance: 0.03, graph_tolerance: 0.05, rows_independent: true, missing_reads_as_zero: true };
    cpu_fp8: Spec { make: fp8, mlp_tolerance: 0.1, calibrated_tolerance: 0.15, graph_tolerance: 0.25, rows_independent: true, missing_reads_as_zero: true };
}

#[cfg(feature = "cuda")]
oracle_tests! {
    cuda_int8: Spec { make: cuda, mlp_tolerance: 0.03, calibrated_tolerance: 0.03, graph_tolerance: 0.05, rows_independent: true, missing_reads_as_zero: true };
}

#[cfg(feature = "onnxruntime")]
oracle_tests! {
    onnxruntime: Spec { make: onnxruntime, mlp_tolerance: 1e-4, calibrated_tolerance: 1e-4, graph_tolerance: 1e-4, rows_independent: false, missing_reads_as_zero: false };
}
