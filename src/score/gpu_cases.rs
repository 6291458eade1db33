//! What `quiver gpu-check` compares on a GPU and `tests/cuda_emulation.rs`
//! compares on the CPU, kept in one place so both check the same cases:
//! the layout the INT8 kernels read their weights in, the seeded models
//! (both INT8 semantics, odd widths, saturating calibrations, k at the
//! width limit) and the input rows with their planted edge cases; the graph
//! and tree models that exercise every node kind of the graph kernels and
//! the tree kernel's split rules, with their input rows. Not
//! behind the `cuda` feature, since the emulation runs in every build.

use std::sync::Arc;

use crate::loadgen::demo::SplitMix64;
use crate::model::calibrate::{calibrate, CalibrationError, Matrix, Method};
use crate::model::trees::{Ensemble, Split, TreeNode};
use crate::model::{Layer, Model};

/// Packs `layer.weights_i8` (`[n][k]`) as both INT8 kernels read them.
pub fn pack_weights(layer: &Layer) -> Vec<i32> {
    let (k, n) = (layer.in_dim, layer.out_dim);
    let kw = k.div_ceil(4);
    let mut words = vec![0i32; kw * n];
    for o in 0..n {
        for j in 0..kw {
            let mut bytes = [0u8; 4];
            for (t, b) in bytes.iter_mut().enumerate() {
                if 4 * j + t < k {
                    *b = layer.weights_i8[o * k + 4 * j + t] as u8;
                }
            }
            words[j * n + o] = i32::from_le_bytes(bytes);
        }
    }
    words
}

/// A seeded MLP with the given widths.
pub fn check_model(seed: u64, dims: &[usize]) -> Model {
    let name = format!("check-{}", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x"));
    crate::loadgen::demo::context_mlp(&name, seed, dims)
}

/// `model` calibrated (max-abs over 64 seeded normal rows, as `quiver import
/// --calibration` would), every range then multiplied by `shrink`: below 1,
/// requantized activations saturate at 127 (and -128 without a ReLU).
pub fn check_calibrated(mut model: Model, shrink: f32) -> Result<Model, CalibrationError> {
    let k = model.input_dim();
    let mut rng = SplitMix64::new(77);
    let set = Matrix { rows: 64, cols: k, data: (0..64 * k).map(|_| rng.normal()).collect() };
    let mut c = calibrate(&model, &set, Method::MaxAbs, |_, _| {})?;
    c.input_ranges.iter_mut().for_each(|r| *r *= shrink);
    model.calibration = Some(c);
    model.name = format!("{}-static-{shrink}", model.name);
    Ok(model)
}

/// The models `gpu_check` compares, each with its `rows_max`: uncalibrated
/// ones (dynamic semantics, `dense_int8`) and calibrated ones (static,
/// `dense_int8_static`) at odd widths, a single-layer model (layer 0 is the
/// output layer), a hidden layer without ReLU (requantized to -128), and
/// k = 16384 (three rows per block in shared memory).
pub fn check_models(rows_max: usize) -> Result<Vec<(Arc<Model>, usize)>, CalibrationError> {
    let wide = rows_max.min(255);
    let mut linear_hidden = check_model(45, &[37, 33, 17, 1]);
    linear_hidden.layers[0].relu = false;
    let models = vec![
        (crate::loadgen::demo::model(), rows_max),
        (check_model(41, &[257, 255, 65, 1]), rows_max),
        (check_model(42, &[3, 1]), rows_max),
        (check_model(43, &[crate::model::WIDTH_MAX, 33, 1]), wide),
        (check_calibrated(crate::loadgen::demo::model(), 1.0)?, rows_max),
        (check_calibrated(check_model(44, &[257, 255, 65, 1]), 0.6)?, rows_max),
        (check_calibrated(linear_hidden, 0.5)?, rows_max),
        (check_calibrated(check_model(46, &[3, 1]), 0.3)?, rows_max),
        (check_calibrated(check_model(47, &[crate::model::WIDTH_MAX, 33, 1]), 1.0)?, wide),
    ];
    Ok(models.into_iter().map(|(m, rows)| (Arc::new(m), rows)).collect())
}

/// `rows` seeded normal rows of width `k`, with the edge cases planted in
/// the first rows: all zeros, values near `f32::MAX` (the scale saturates,
/// small values quantize to 0), +inf, -inf, NaN, and a whole NaN row.
pub fn check_inputs(seed: u64, rows: usize, k: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    let mut x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
    let mut row = |r: usize, f: &dyn Fn(&mut [f32])| {
        if r < rows {
            f(&mut x[r * k..(r + 1) * k]);
        }
    };
    row(0, &|v| v.fill(0.0));
    row(1, &|v| {
        v[0] = 3.0e38;
        v[v.len() / 2] = -3.0e38;
    });
    row(2, &|v| v[v.len() - 1] = f32::INFINITY);
    row(3, &|v| v[0] = f32::NEG_INFINITY);
    row(4, &|v| v[v.len() / 3] = f32::NAN);
    row(5, &|v| v.fill(f32::NAN));
    row(6, &|v| v.iter_mut().for_each(|e| *e *= 1.0e-30));
    x
}

/// A seeded tree ensemble of `trees` trees over `width` features, up to 6
/// splits deep: numeric splits with either missing direction, some with
/// zero-as-missing, and categorical splits with bitsets of 1 to 3 words.
/// More than `TREE_CHUNK` trees, so the kernel's leaf buffer is reused.
pub fn check_ensemble(seed: u64, width: usize, trees: usize) -> Ensemble {
    fn grow(rng: &mut SplitMix64, e: &mut Ensemble, nodes: &mut Vec<TreeNode>, depth: usize, width: usize) -> u32 {
        let i = nodes.len();
        nodes.push(TreeNode::leaf(0.0));
        if depth == 0 || rng.below(6) == 0 {
            nodes[i] = TreeNode::leaf(rng.normal() * 0.25);
            return i as u32;
        }
        let feature = rng.below(width as u64) as u32;
        let split = if rng.below(4) == 0 {
            let words: Vec<u32> = (0..1 + rng.below(3)).map(|_| rng.next_u64() as u32).collect();
            let (start, len) = e.push_words(&words);
            Split::Categorical { feature, start, len }
        } else {
            let threshold = if rng.below(8) == 0 { 0.0 } else { rng.normal() };
            Split::Numeric { feature, threshold, missing_left: rng.below(2) == 0, zero_missing: rng.below(4) == 0 }
        };
        let left = grow(rng, e, nodes, depth - 1, width);
        let right = grow(rng, e, nodes, depth - 1, width);
        nodes[i] = TreeNode { split, left, right };
        i as u32
    }
    let mut rng = SplitMix64::new(seed);
    let mut e = Ensemble { base: 0.125, ..Ensemble::default() };
    for _ in 0..trees {
        let mut nodes = Vec::new();
        grow(&mut rng, &mut e, &mut nodes, 6, width);
        e.push_tree(&nodes);
    }
    e
}

/// Graph models covering every node kind the graph kernels run (each
/// activation, as a dense layer's epilogue and as a node; Add, Sub, Mul
/// and Div, with a one-wide second operand too; Concat; Affine; LayerNorm;
/// Dot; Sum; an Embedding gather; tree ensembles over the raw input and
/// over another node), and a tree model over 12 features with 70 trees;
/// each with its `rows_max`.
pub fn check_graph_models(rows_max: usize) -> Vec<(Arc<Model>, usize)> {
    use crate::model::graph::{Act, Graph, Node, Op, OutputKind};
    use crate::model::{InputSegment, Source};
    let mut rng = SplitMix64::new(48);
    let mut dense = |k: usize, n: usize, act: Act| {
        let w: Vec<f32> = (0..k * n).map(|_| rng.normal() * (2.0 / k as f32).sqrt()).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.normal() * 0.1).collect();
        Op::Dense { layer: Layer::quantize(k, n, false, w, b), act }
    };
    let node = |op: Op, inputs: &[usize], width: usize| Node { op, inputs: inputs.to_vec(), width };
    let table: Vec<f32> = (0..5 * 4).map(|i| (i as f32 * 0.37).sin()).collect();
    let ramp = |n: usize, a: f32, b: f32| (0..n).map(|i| a + b * i as f32).collect::<Vec<f32>>();
    let nodes = vec![
        node(Op::Input { offset: 0 }, &[], 8),
        node(Op::Input { offset: 8 }, &[], 2),
        node(Op::Embedding { dim: 4, rows: 5, table: table.into(), default: vec![0.5, -0.5, 0.25, 0.0] }, &[1], 8),
        node(Op::Concat, &[0, 2], 16),
        node(dense(16, 24, Act::GeluErf), &[3], 24),
        node(Op::LayerNorm { epsilon: 1e-5, scale: ramp(24, 0.5, 0.05), shift: ramp(24, -0.3, 0.02) }, &[4], 24),
        node(dense(24, 24, Act::Relu), &[5], 24),
        node(Op::Add, &[6, 5], 24),
        node(
            Op::Affine { center: ramp(24, 0.1, 0.01), scale: ramp(24, 1.5, -0.05), shift: ramp(24, 0.0, 0.03) },
            &[7],
            24,
        ),
        node(Op::Act(Act::Silu), &[8], 24),
        node(dense(24, 8, Act::LeakyRelu(0.1)), &[9], 8),
        node(dense(24, 8, Act::Sigmoid), &[9], 8),
        node(Op::Mul, &[10, 11], 8),
        node(Op::Dot, &[10, 11], 1),
        node(Op::Div, &[12, 13], 8),
        node(Op::Sub, &[12, 14], 8),
        node(Op::Sum, &[15], 1),
        node(Op::Act(Act::Sqrt), &[11], 8),
        node(dense(8, 8, Act::GeluTanh), &[17], 8),
        node(Op::Act(Act::Erf), &[18], 8),
        node(Op::Act(Act::Tanh), &[19], 8),
        node(dense(8, 8, Act::Tanh), &[20], 8),
        node(Op::Trees(check_ensemble(49, 8, 40)), &[21], 1),
        node(Op::Trees(check_ensemble(50, 8, 35)), &[0], 1),
        node(dense(8, 1, Act::None), &[19], 1),
        node(Op::Add, &[16, 22], 1),
        node(Op::Sub, &[25, 23], 1),
        node(Op::Mul, &[26, 24], 1),
    ];
    let graph = Model {
        name: "check-graph".into(),
        version: 1,
        inputs: vec![InputSegment { source: Source::Context, dim: 10 }],
        layers: Vec::new(),
        calibration: None,
        graph: Some(Graph { nodes, output: OutputKind::Logit }),
        onnx: None,
        feature_names: Vec::new(),
    };
    let trees = Model {
        name: "check-trees".into(),
        inputs: vec![InputSegment { source: Source::Context, dim: 12 }],
        graph: Some(Graph {
            nodes: vec![node(Op::Input { offset: 0 }, &[], 12), node(Op::Trees(check_ensemble(51, 12, 70)), &[0], 1)],
            output: OutputKind::Raw,
        }),
        ..graph.clone()
    };
    vec![(Arc::new(graph), rows_max), (Arc::new(trees), rows_max)]
}

/// `check_inputs` for a graph model, with every Embedding fed by an Input
/// node given ids from -1 to the table's rows (both ends out of range,
/// so the default row is read) and a few non-integers and NaNs, and the
/// values of every column scaled by 4 in a quarter of the rows so that
/// categorical splits see categories past the first word.
pub fn check_graph_inputs(model: &Model, seed: u64, rows: usize) -> Vec<f32> {
    use crate::model::graph::Op;
    let k = model.input_dim();
    let mut x = check_inputs(seed, rows, k);
    let mut rng = SplitMix64::new(seed ^ 0xE3B);
    for (r, row) in x.chunks_exact_mut(k).enumerate() {
        if r % 4 == 3 {
            row.iter_mut().for_each(|v| *v *= 4.0);
        }
    }
    let Some(graph) = &model.graph else { return x };
    for n in &graph.nodes {
        let Op::Embedding { rows: table_rows, .. } = n.op else { continue };
        let Op::Input { offset } = graph.nodes[n.inputs[0]].op else { continue };
        let width = graph.nodes[n.inputs[0]].width;
        for row in x.chunks_exact_mut(k) {
            for v in &mut row[offset..offset + width] {
                *v = match rng.below(20) {
                    0 => f32::NAN,
                    1 => 1.5,
                    _ => rng.below(table_rows as u64 + 2) as f32 - 1.0,
                };
            }
        }
    }
    x
}
