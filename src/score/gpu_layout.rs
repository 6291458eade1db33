//! The host side of the graph and tree kernels (`kernels/graph_nodes.cu`,
//! `kernels/trees.cu`, and `kernels/int8_dense.cu` for a graph's dense
//! layers): how a graph model becomes a fixed list of kernel launches, and
//! how a tree ensemble is packed for the device.
//!
//! Plain data and functions, outside the `cuda` feature: the CUDA backend
//! (`score/cuda.rs`) uploads a [`GraphPlan`]'s parameters once and replays
//! its launches on every call, and `tests/cuda_emulation.rs` replays the
//! very same plan on the CPU emulation of the kernels against the CPU
//! graph executor, so the packing, the argument lists and the launch
//! geometry that would run on a GPU are the ones the tests check.
//!
//! A plan computes every node of every row (the CPU executor computes
//! per-request nodes once per request and copies them, which gives the same
//! numbers). Node `i`'s output lives in its own `[rows_max][width]` f32
//! buffer, as in the CPU executor; the plan's output is the last node's.

use crate::model::graph::{Act, Graph, Op};
use crate::model::trees::{Ensemble, Split};
use crate::model::EmbeddingTable;

use super::gpu_cases::pack_weights;
use super::kernels::{self, KernelSource, DENSE_THREADS};

/// Threads per block of the one-thread-per-value and per-row kernels of
/// `graph_nodes.cu` (its `NODE_THREADS`).
pub const NODE_THREADS: u32 = 128;
/// `trees.cu`'s block: `TREE_ROWS` rows by `TREE_GROUPS` tree groups; the
/// trees go by `TREE_CHUNK` at a time.
pub const TREE_ROWS: u32 = 32;
pub const TREE_GROUPS: u32 = 4;
pub const TREE_CHUNK: usize = 32;
/// `trees.cu`'s node word `y`: feature bits and flags.
pub const TREE_FEATURE_MASK: u32 = 0x00FF_FFFF;
pub const TREE_LEAF: u32 = 1 << 24;
pub const TREE_CATEGORICAL: u32 = 1 << 25;
pub const TREE_MISSING_LEFT: u32 = 1 << 26;
pub const TREE_ZERO_MISSING: u32 = 1 << 27;
/// Most rows one graph launch takes: `dense_f32`'s grid has a row per
/// `blockIdx.y`, which CUDA bounds at 65,535.
pub const GRAPH_ROWS_MAX: usize = 65_535;

/// `graph_nodes.cu`'s activation code and parameter for `act`.
pub fn act_code(act: Act) -> (i32, f32) {
    match act {
        Act::None => (0, 0.0),
        Act::Relu => (1, 0.0),
        Act::LeakyRelu(alpha) => (2, alpha),
        Act::Tanh => (3, 0.0),
        Act::Sigmoid => (4, 0.0),
        Act::GeluErf => (5, 0.0),
        Act::GeluTanh => (6, 0.0),
        Act::Silu => (7, 0.0),
        Act::Erf => (8, 0.0),
        Act::Sqrt => (9, 0.0),
    }
}

/// A tree ensemble as `trees_predict` reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedTrees {
    /// Four words per node (`x` threshold, leaf value or bitset index; `y`
    /// feature and flags; `z` left child; `w` right child), children as
    /// indices into the whole ensemble's nodes.
    pub nodes: Vec<[u32; 4]>,
    /// Tree `t`'s root.
    pub roots: Vec<u32>,
    /// Each categorical split's bitset: its length in words, then the
    /// words. Never empty (one unused word when there is none), so that it
    /// can always be uploaded.
    pub cat: Vec<u32>,
    pub base: f32,
}

/// Packs a validated ensemble for `trees_predict`. Fails (with the node)
/// only where the layout cannot hold the ensemble: a feature index past
/// 24 bits, or more nodes or bitset words than 32-bit indices reach.
pub fn pack_trees(e: &Ensemble) -> Result<PackedTrees, String> {
    if e.nodes.len() > u32::MAX as usize || e.cat_words.len() > (u32::MAX / 2) as usize {
        return Err(format!(
            "{} nodes and {} bitset words do not fit 32-bit indices",
            e.nodes.len(),
            e.cat_words.len()
        ));
    }
    let mut cat = vec![0u32];
    let mut nodes = Vec::with_capacity(e.nodes.len());
    let mut roots = Vec::with_capacity(e.trees());
    for t in 0..e.trees() {
        let root = e.starts[t];
        roots.push(root);
        for (i, n) in e.tree(t).iter().enumerate() {
            let feature_word = |feature: u32| {
                if feature > TREE_FEATURE_MASK {
                    Err(format!("tree {t} node {i} splits on feature {feature}, past the kernel's 24 bits"))
                } else {
                    Ok(feature)
                }
            };
            let (left, right) = (root + n.left, root + n.right);
            nodes.push(match n.split {
                Split::Leaf { value } => [value.to_bits(), TREE_LEAF, 0, 0],
                Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                    let mut y = feature_word(feature)?;
                    if missing_left {
                        y |= TREE_MISSING_LEFT;
                    }
                    if zero_missing {
                        y |= TREE_ZERO_MISSING;
                    }
                    [threshold.to_bits(), y, left, right]
                }
                Split::Categorical { feature, start, len } => {
                    let at = cat.len() as u32;
                    cat.push(len);
                    cat.extend_from_slice(&e.cat_words[start as usize..(start + len) as usize]);
                    [at, feature_word(feature)? | TREE_CATEGORICAL, left, right]
                }
            });
        }
    }
    Ok(PackedTrees { nodes, roots, cat, base: e.base })
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: usize,
}

/// How a launch's grid follows the call's row count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Geometry {
    /// One thread per value of a `[rows][per_row]` tensor.
    PerValue { per_row: usize },
    /// `dense_f32`: `NODE_THREADS` outputs by one row per block.
    RowsByOutputs { n: usize },
    /// `dense_int8`: `rows_per_block` rows by `DENSE_THREADS` outputs per
    /// block, `rows_per_block × k4` bytes of shared memory.
    DenseInt8 { rows_per_block: usize, k4: usize, n: usize },
    /// One thread per row.
    PerRow,
    /// `trees_predict`: `TREE_ROWS` rows by `TREE_GROUPS` groups per block.
    Trees,
}

impl Geometry {
    /// The launch dimensions for `rows` rows (at least 1).
    pub fn dims(self, rows: usize) -> Dims {
        let blocks = |count: usize, per: u32| count.div_ceil(per as usize).max(1) as u32;
        let (grid, block, shared_bytes) = match self {
            Geometry::PerValue { per_row } => ([blocks(rows * per_row, NODE_THREADS), 1, 1], [NODE_THREADS, 1, 1], 0),
            Geometry::RowsByOutputs { n } => ([blocks(n, NODE_THREADS), rows as u32, 1], [NODE_THREADS, 1, 1], 0),
            Geometry::DenseInt8 { rows_per_block, k4, n } => (
                [rows.div_ceil(rows_per_block) as u32, blocks(n, DENSE_THREADS), 1],
                [DENSE_THREADS, 1, 1],
                rows_per_block * k4,
            ),
            Geometry::PerRow => ([blocks(rows, NODE_THREADS), 1, 1], [NODE_THREADS, 1, 1], 0),
            Geometry::Trees => ([blocks(rows, TREE_ROWS), 1, 1], [TREE_ROWS, TREE_GROUPS, 1], 0),
        };
        Dims { grid, block, shared_bytes }
    }
}

/// One kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// The call's input rows (`[rows][input_dim]` f32, NaN for missing).
    Input,
    /// Node `i`'s output buffer (`[rows_max][width]` f32).
    Node(usize),
    /// The plan's parameter `i`, uploaded once.
    Param(usize),
    /// The call's row count times this, as `int`.
    RowsTimes(usize),
    Int(i32),
    Float(f32),
}

/// A constant buffer a plan uploads once.
#[derive(Clone, Debug)]
pub enum Param {
    F32(Vec<f32>),
    I32(Vec<i32>),
    U32(Vec<u32>),
    /// A tree ensemble's nodes, 16 bytes each (`uint4`).
    TreeNodes(Vec<[u32; 4]>),
    /// An embedding table, the model's own (shared, not copied on the host).
    Table(EmbeddingTable),
}

impl Param {
    pub fn bytes(&self) -> usize {
        match self {
            Param::F32(v) => 4 * v.len(),
            Param::I32(v) => 4 * v.len(),
            Param::U32(v) => 4 * v.len(),
            Param::TreeNodes(v) => 16 * v.len(),
            Param::Table(t) => 4 * t.len(),
        }
    }
}

/// One launch of a plan.
#[derive(Clone, Debug)]
pub struct Launch {
    pub source: KernelSource,
    pub entry: &'static str,
    pub geometry: Geometry,
    pub args: Vec<Arg>,
    /// The graph node it computes (part of).
    pub node: usize,
}

/// The precision of a plan's dense layers; every other node runs in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// `dense_f32`: the CPU f32 backend's (and oracle's) numbers.
    F32,
    /// `dense_int8`, dynamic per-row activation scales: the CPU INT8
    /// backend's numbers on a graph model.
    Int8,
}

/// A graph model as a fixed list of launches over per-node buffers.
#[derive(Clone, Debug)]
pub struct GraphPlan {
    pub precision: Precision,
    pub input_dim: usize,
    pub rows_max: usize,
    /// Each node's width: its buffer is `rows_max × width` floats.
    pub widths: Vec<usize>,
    pub params: Vec<Param>,
    pub launches: Vec<Launch>,
}

impl GraphPlan {
    /// The plan of a validated `graph` over `input_dim` input columns for
    /// at most `rows_max` rows. Fails, saying why, where a kernel's limits
    /// do not hold the model at that row count.
    pub fn new(graph: &Graph, input_dim: usize, precision: Precision, rows_max: usize) -> Result<GraphPlan, String> {
        if rows_max == 0 || rows_max > GRAPH_ROWS_MAX {
            return Err(format!("rows_max {rows_max}: the graph kernels take 1 to {GRAPH_ROWS_MAX} rows"));
        }
        let widths: Vec<usize> = graph.nodes.iter().map(|n| n.width).collect();
        if let Some(i) = widths.iter().position(|w| rows_max.checked_mul(*w).is_none_or(|v| v > i32::MAX as usize)) {
            return Err(format!("node {i}: {rows_max} rows of {} values overflow the kernels' int counts", widths[i]));
        }
        let mut plan = GraphPlan {
            precision,
            input_dim,
            rows_max,
            widths: widths.clone(),
            params: Vec::new(),
            launches: Vec::new(),
        };
        for (i, node) in graph.nodes.iter().enumerate() {
            let w = node.width;
            let int = |v: usize| Arg::Int(v as i32);
            let input = |k: usize| Arg::Node(node.inputs[k]);
            let wi = |k: usize| widths[node.inputs[k]];
            let per_value = Geometry::PerValue { per_row: w };
            match &node.op {
                Op::Input { offset } => plan.push(
                    i,
                    kernels::GRAPH_NODES,
                    "graph_input",
                    per_value,
                    vec![Arg::Input, Arg::RowsTimes(1), int(input_dim), int(*offset), int(w), Arg::Node(i)],
                ),
                Op::Dense { layer, act } => {
                    let (k, n) = (layer.in_dim, layer.out_dim);
                    match precision {
                        Precision::F32 => {
                            let mut w_t = vec![0.0f32; k * n];
                            for o in 0..n {
                                for j in 0..k {
                                    w_t[j * n + o] = layer.weights_f32[o * k + j];
                                }
                            }
                            let w_t = plan.param(Param::F32(w_t));
                            let bias = plan.param(Param::F32(layer.bias.clone()));
                            let (code, alpha) = act_code(*act);
                            plan.push(
                                i,
                                kernels::GRAPH_NODES,
                                "dense_f32",
                                Geometry::RowsByOutputs { n },
                                vec![
                                    input(0),
                                    Arg::RowsTimes(1),
                                    int(k),
                                    int(n),
                                    Arg::Param(w_t),
                                    Arg::Param(bias),
                                    Arg::Int(code),
                                    Arg::Float(alpha),
                                    Arg::Node(i),
                                ],
                            );
                        }
                        Precision::Int8 => {
                            let k4 = k.next_multiple_of(4);
                            if n > 65_535 * DENSE_THREADS as usize {
                                return Err(format!("node {i}: {n} outputs exceed dense_int8's grid"));
                            }
                            let rows_per_block = kernels::dense_rows_per_block(k4);
                            let packed = plan.param(Param::I32(pack_weights(layer)));
                            let scales = plan.param(Param::F32(layer.weight_scales.clone()));
                            let bias = plan.param(Param::F32(layer.bias.clone()));
                            plan.push(
                                i,
                                kernels::INT8_DENSE,
                                "dense_int8",
                                Geometry::DenseInt8 { rows_per_block, k4, n },
                                vec![
                                    input(0),
                                    Arg::RowsTimes(1),
                                    int(k),
                                    int(k4),
                                    int(n),
                                    int(rows_per_block),
                                    Arg::Param(packed),
                                    Arg::Param(scales),
                                    Arg::Param(bias),
                                    Arg::Int(i32::from(*act == Act::Relu)),
                                    Arg::Node(i),
                                ],
                            );
                            // Any other activation after, in place, as the
                            // CPU executor applies it after its INT8 kernel.
                            if !matches!(act, Act::None | Act::Relu) {
                                plan.activation(i, Arg::Node(i), *act, w);
                            }
                        }
                    }
                }
                Op::Act(act) => plan.activation(i, input(0), *act, w),
                Op::Add | Op::Sub | Op::Mul | Op::Div => {
                    let op = match node.op {
                        Op::Add => 0,
                        Op::Sub => 1,
                        Op::Mul => 2,
                        _ => 3,
                    };
                    plan.push(
                        i,
                        kernels::GRAPH_NODES,
                        "elementwise",
                        per_value,
                        vec![input(0), input(1), Arg::RowsTimes(1), int(w), int(wi(1)), Arg::Int(op), Arg::Node(i)],
                    );
                }
                Op::Affine { center, scale, shift } => {
                    let c = plan.param(Param::F32(center.clone()));
                    let s = plan.param(Param::F32(scale.clone()));
                    let b = plan.param(Param::F32(shift.clone()));
                    plan.push(
                        i,
                        kernels::GRAPH_NODES,
                        "affine",
                        per_value,
                        vec![
                            input(0),
                            Arg::RowsTimes(1),
                            int(w),
                            Arg::Param(c),
                            Arg::Param(s),
                            Arg::Param(b),
                            Arg::Node(i),
                        ],
                    );
                }
                Op::Concat => {
                    let mut at = 0;
                    for k in 0..node.inputs.len() {
                        plan.push(
                            i,
                            kernels::GRAPH_NODES,
                            "copy_columns",
                            Geometry::PerValue { per_row: wi(k) },
                            vec![input(k), Arg::RowsTimes(1), int(wi(k)), Arg::Node(i), int(w), int(at)],
                        );
                        at += wi(k);
                    }
                }
                Op::LayerNorm { epsilon, scale, shift } => {
                    let s = plan.param(Param::F32(scale.clone()));
                    let b = plan.param(Param::F32(shift.clone()));
                    plan.push(
                        i,
                        kernels::GRAPH_NODES,
                        "layer_norm",
                        Geometry::PerRow,
                        vec![
                            input(0),
                            Arg::RowsTimes(1),
                            int(w),
                            Arg::Float(*epsilon),
                            Arg::Param(s),
                            Arg::Param(b),
                            Arg::Node(i),
                        ],
                    );
                }
                Op::Dot => plan.push(
                    i,
                    kernels::GRAPH_NODES,
                    "row_dot",
                    Geometry::PerRow,
                    vec![input(0), input(1), Arg::RowsTimes(1), int(wi(0)), Arg::Node(i)],
                ),
                Op::Sum => plan.push(
                    i,
                    kernels::GRAPH_NODES,
                    "row_sum",
                    Geometry::PerRow,
                    vec![input(0), Arg::RowsTimes(1), int(wi(0)), Arg::Node(i)],
                ),
                Op::Embedding { dim, rows, table, default } => {
                    let t = plan.param(Param::Table(table.clone()));
                    let d = plan.param(Param::F32(default.clone()));
                    plan.push(
                        i,
                        kernels::GRAPH_NODES,
                        "embedding",
                        per_value,
                        vec![
                            input(0),
                            Arg::RowsTimes(1),
                            int(wi(0)),
                            Arg::Param(t),
                            int(*dim),
                            int(*rows),
                            Arg::Param(d),
                            Arg::Node(i),
                        ],
                    );
                }
                Op::Trees(e) => {
                    let packed = pack_trees(e).map_err(|m| format!("node {i}: {m}"))?;
                    // Trees read the model's input itself, missing values
                    // as NaN, when their input is an Input node (as the CPU
                    // executor does); any other node's output otherwise.
                    let (x, stride, column0) = match graph.nodes[node.inputs[0]].op {
                        Op::Input { offset } => (Arg::Input, input_dim, offset),
                        _ => (input(0), wi(0), 0),
                    };
                    let trees = packed.roots.len();
                    let nodes = plan.param(Param::TreeNodes(packed.nodes));
                    let roots = plan.param(Param::U32(packed.roots));
                    let cat = plan.param(Param::U32(packed.cat));
                    plan.push(
                        i,
                        kernels::TREES,
                        "trees_predict",
                        Geometry::Trees,
                        vec![
                            x,
                            Arg::RowsTimes(1),
                            int(stride),
                            int(column0),
                            Arg::Param(nodes),
                            Arg::Param(roots),
                            int(trees),
                            Arg::Param(cat),
                            Arg::Float(packed.base),
                            Arg::Node(i),
                            Arg::Int(1),
                        ],
                    );
                }
            }
        }
        Ok(plan)
    }

    fn param(&mut self, p: Param) -> usize {
        self.params.push(p);
        self.params.len() - 1
    }

    fn push(&mut self, node: usize, source: KernelSource, entry: &'static str, geometry: Geometry, args: Vec<Arg>) {
        self.launches.push(Launch { source, entry, geometry, args, node });
    }

    fn activation(&mut self, node: usize, x: Arg, act: Act, width: usize) {
        let (code, alpha) = act_code(act);
        self.push(
            node,
            kernels::GRAPH_NODES,
            "graph_activation",
            Geometry::PerValue { per_row: width },
            vec![x, Arg::RowsTimes(width), Arg::Int(code), Arg::Float(alpha), Arg::Node(node)],
        );
    }

    /// The node whose buffer holds the output (one value per row).
    pub fn output(&self) -> usize {
        self.widths.len() - 1
    }

    /// Floats of every node buffer together, for `rows_max` rows.
    pub fn node_floats(&self) -> usize {
        self.widths.iter().map(|w| w * self.rows_max).sum()
    }

    /// The kernel files the plan launches, each once.
    pub fn sources(&self) -> Vec<KernelSource> {
        let mut out: Vec<KernelSource> = Vec::new();
        for l in &self.launches {
            if !out.iter().any(|s| s.file == l.source.file) {
                out.push(l.source);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::graph::{Node, OutputKind};
    use crate::model::trees::TreeNode;

    #[test]
    fn the_host_constants_match_the_kernel_sources() {
        let trees = kernels::TREES.source;
        for (name, v) in [
            ("TREE_ROWS", TREE_ROWS as usize),
            ("TREE_GROUPS", TREE_GROUPS as usize),
            ("TREE_CHUNK", TREE_CHUNK),
            ("TREE_DEPTH_MAX", crate::model::trees::DEPTH_MAX),
        ] {
            assert!(trees.contains(&format!("#define {name} {v}\n")), "{name}");
        }
        for (name, bit) in [("LEAF", 24), ("CATEGORICAL", 25), ("MISSING_LEFT", 26), ("ZERO_MISSING", 27)] {
            assert!(trees.contains(&format!("#define TREE_{name} (1u << {bit})\n")), "{name}");
        }
        assert!(trees.contains(&format!("#define TREE_FEATURE_MASK {TREE_FEATURE_MASK:#010X}u\n").replace("0X", "0x")));
        let nodes = kernels::GRAPH_NODES.source;
        assert!(nodes.contains(&format!("#define NODE_THREADS {NODE_THREADS}\n")));
        let acts = [
            ("NONE", Act::None),
            ("RELU", Act::Relu),
            ("LEAKY_RELU", Act::LeakyRelu(0.1)),
            ("TANH", Act::Tanh),
            ("SIGMOID", Act::Sigmoid),
            ("GELU_ERF", Act::GeluErf),
            ("GELU_TANH", Act::GeluTanh),
            ("SILU", Act::Silu),
            ("ERF", Act::Erf),
            ("SQRT", Act::Sqrt),
        ];
        for (name, act) in acts {
            assert!(nodes.contains(&format!("#define ACT_{name} {}\n", act_code(act).0)), "{name}");
        }
    }

    #[test]
    fn trees_pack_with_global_children_and_length_prefixed_bitsets() {
        let e = crate::model::trees::tests::small();
        let p = pack_trees(&e).unwrap();
        assert_eq!(p.roots, vec![0, 3]);
        assert_eq!(p.base, 0.25);
        // Tree 0: a numeric stump, missing left.
        assert_eq!(p.nodes[0], [0.5f32.to_bits(), TREE_MISSING_LEFT, 1, 2]);
        assert_eq!(p.nodes[1], [(-1.0f32).to_bits(), TREE_LEAF, 0, 0]);
        // Tree 1's children are offset by its root (3).
        assert_eq!(p.nodes[3], [(-0.25f32).to_bits(), 1, 4, 5]);
        // Its categorical split points at [len, words...] after the unused word 0.
        assert_eq!(p.nodes[5], [1, 2 | TREE_CATEGORICAL, 6, 7]);
        assert_eq!(p.cat, vec![0, 3, 0b1010, 0, 1]);

        let mut wide = Ensemble::default();
        let split = Split::Numeric { feature: 1 << 24, threshold: 0.0, missing_left: false, zero_missing: true };
        wide.push_tree(&[TreeNode { split, left: 1, right: 2 }, TreeNode::leaf(0.0), TreeNode::leaf(1.0)]);
        assert!(pack_trees(&wide).unwrap_err().contains("feature 16777216, past the kernel's 24 bits"));
    }

    #[test]
    fn launch_geometry_covers_every_row_and_output() {
        for rows in [1usize, 31, 32, 33, 1024, GRAPH_ROWS_MAX] {
            let d = Geometry::Trees.dims(rows);
            assert_eq!(d.block, [TREE_ROWS, TREE_GROUPS, 1]);
            assert!(d.grid[0] as usize * TREE_ROWS as usize >= rows);
            assert!((d.grid[0] as usize - 1) * (TREE_ROWS as usize) < rows);
            let d = Geometry::PerValue { per_row: 37 }.dims(rows);
            assert!(d.grid[0] as usize * NODE_THREADS as usize >= rows * 37);
            let d = Geometry::RowsByOutputs { n: 129 }.dims(rows);
            assert_eq!((d.grid[0], d.grid[1]), (2, rows as u32));
            let d = Geometry::DenseInt8 { rows_per_block: 3, k4: 16384, n: 1 }.dims(rows);
            assert!(d.grid[0] as usize * 3 >= rows && d.shared_bytes == 3 * 16384);
            assert!(d.shared_bytes <= kernels::SHARED_BYTES_DEFAULT_MAX);
        }
    }

    fn tree_graph() -> Graph {
        Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 1 }, inputs: vec![], width: 3 },
                Node { op: Op::Trees(crate::model::trees::tests::small()), inputs: vec![0], width: 1 },
                Node { op: Op::Act(Act::Tanh), inputs: vec![0], width: 3 },
                Node { op: Op::Trees(crate::model::trees::tests::small()), inputs: vec![2], width: 1 },
                Node { op: Op::Add, inputs: vec![1, 3], width: 1 },
            ],
            output: OutputKind::Logit,
        }
    }

    #[test]
    fn a_plan_launches_every_node_into_its_own_buffer() {
        let plan = GraphPlan::new(&tree_graph(), 5, Precision::Int8, 64).unwrap();
        let entries: Vec<&str> = plan.launches.iter().map(|l| l.entry).collect();
        assert_eq!(entries, ["graph_input", "trees_predict", "graph_activation", "trees_predict", "elementwise"]);
        assert_eq!(plan.launches.iter().map(|l| l.node).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        // Trees over an Input node read the raw input (NaN kept) at its
        // columns; trees over another node read that node's buffer.
        assert_eq!(&plan.launches[1].args[..4], &[Arg::Input, Arg::RowsTimes(1), Arg::Int(5), Arg::Int(1)]);
        assert_eq!(&plan.launches[3].args[..4], &[Arg::Node(2), Arg::RowsTimes(1), Arg::Int(3), Arg::Int(0)]);
        assert_eq!(plan.output(), 4);
        assert_eq!(plan.node_floats(), 64 * (3 + 1 + 3 + 1 + 1));
        assert_eq!(plan.sources().len(), 2);
        // Every argument names an existing buffer.
        for l in &plan.launches {
            for a in &l.args {
                match *a {
                    Arg::Node(j) => assert!(j <= l.node),
                    Arg::Param(j) => assert!(j < plan.params.len()),
                    _ => {}
                }
            }
        }
        assert!(GraphPlan::new(&tree_graph(), 5, Precision::F32, GRAPH_ROWS_MAX + 1).unwrap_err().contains("rows_max"));
    }
}
