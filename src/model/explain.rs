//! Reason codes: each input column's exact contribution to one candidate's
//! margin (the model's output before its sigmoid), plus the bias, such that
//! bias + the sum of the contributions is the margin.
//!
//! Why here and exact: a declined payment must say why, inside the same
//! response, so the attribution is computed by the server from the model it
//! serves, not by a separate explainer that may disagree with it. Tree
//! ensembles get path-dependent TreeSHAP (Lundberg et al. 2018), the
//! attribution LightGBM's `predict(pred_contrib=True)` and XGBoost's
//! `predict(pred_contribs=True)` compute: branches are weighed by each
//! node's cover (`Ensemble::covers`), and the branch a candidate takes is
//! decided by `trees::goes_left`, the rule the model is scored by, so
//! missing values and categorical splits are routed as the model routes
//! them. Everything runs in f64.
//!
//! Two exact algorithms compute it ([`TreeAlgorithm`]); they agree to
//! floating error:
//! - **Quadrature** (the default), so that reason codes fit a request's
//!   budget. For one leaf whose path holds features with merged cover
//!   shares `z` and taken-branch indicators `o`, a feature's Shapley value
//!   is the leaf value times `(o − z)` times the integral over `t` in
//!   [0, 1] of the product, over the path's other features, of
//!   `z (1 − t) + o t` (the Shapley weights are Beta integrals: Owen's
//!   multilinear extension). The integrand is a polynomial of degree below
//!   the tree's depth D, so Gauss–Legendre quadrature at ⌈D/2⌉ points is
//!   exact. At those points (the SIMD lanes) the leaves' products sum up the
//!   tree, so one pass down each tree's nodes, level by level, and one up
//!   its splits yield every contribution, as Linear TreeShap (Yu et al.
//!   2022) does with
//!   polynomials: O(nodes × ⌈D/2⌉) per tree instead of O(leaves × D²). A
//!   feature split on again lower down divides its earlier factor out at
//!   the quadrature points and takes back, over that subtree, what the
//!   earlier edge counted; the two terms cancel exactly, as the quadrature
//!   is linear in the values. Within a level the table holds the nodes by
//!   class (splits, twigs — splits over two leaves —, then leaves; a
//!   feature no edge above splits on, then one that is), so each class
//!   runs in its own loop: the common nodes skip the division that a
//!   repeated feature needs, and a leaf adds its share on the way down and
//!   is never visited again. A twig is finished on the way down with its
//!   two leaves (their sum is known there), so the way up visits only the
//!   splits above the twigs: about half of a full tree's. The per-node
//!   table is built once, when the explainer is: `TABLE_NODE_BYTES` per
//!   tree node.
//! - **Classic**: Algorithm 2 of Lundberg et al. (path arrays, extend and
//!   unwind), one recursive walk per tree: the reference the quadrature is
//!   tested against, and benchmarked beside it.
//!
//! Models that cannot be explained exactly are refused when the explainer
//! is built ([`ExplainError`]), never answered with an approximation: tree
//! ensembles without covers (ONNX `TreeEnsemble*` has none), MLPs, other
//! graphs and onnxruntime-only models.
//!
//! All memory a call needs is allocated by [`Explainer::scratch`], once per
//! explainer: the quadrature's vectors per node of the largest tree and
//! lanes per feature (or the classic path arrays, bounded by the deepest
//! tree).

use std::sync::Arc;

use super::graph::Op;
use super::trees::{goes_left, Ensemble, Split, DEPTH_MAX, ZERO_THRESHOLD};
use super::Model;

/// Path elements the classic TreeSHAP needs for trees of `depth` splits:
/// one path of up to `d + 1` elements per level `d` of the recursion, side
/// by side.
pub fn path_len(depth: usize) -> usize {
    (depth + 2) * (depth + 3) / 2
}

/// The most path elements a scratch holds (trees of `DEPTH_MAX` splits).
pub const PATH_LEN_MAX: usize = (DEPTH_MAX + 2) * (DEPTH_MAX + 3) / 2;

/// Bytes of the quadrature's table per tree node (leaves and splits): the
/// table is this times the ensemble's nodes (and 8 bytes a tree and 20 a
/// level of a tree), so
/// `trees::ENSEMBLE_NODES_MAX` bounds it (384 MiB; the ensemble itself
/// holds 28 bytes a node).
pub const TABLE_NODE_BYTES: usize = 24;

const _: () = assert!(std::mem::size_of::<TableNode>() == TABLE_NODE_BYTES);

/// The `repeat` of a node no edge above repeats, while the table is built.
const NO_NODE: u16 = u16::MAX;

/// Why a model or a row cannot be explained.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExplainError {
    /// ONNX `TreeEnsemble*` has no cover attribute; a LightGBM tree saved
    /// without its count lines and files written before covers were
    /// stored have none either.
    #[error(
        "model '{model}': its tree ensemble carries no node covers (training counts or hessian sums), which \
         TreeSHAP weighs branches by; ONNX tree ensembles have none: import the LightGBM text or XGBoost JSON \
         model to explain it"
    )]
    NoCovers { model: String },
    #[error("model '{model}': tree {tree} node {node} splits but has cover {cover}; TreeSHAP divides by it")]
    ZeroCover { model: String, tree: usize, node: usize, cover: f32 },
    #[error(
        "model '{model}': {kind} cannot be explained exactly (reason codes are computed for tree ensembles \
         and linear models only)"
    )]
    NotExplainable { model: String, kind: String },
    #[error("the row has {got} features; the model '{model}' reads {want}")]
    Width { model: String, want: usize, got: usize },
}

/// How a tree ensemble's contributions are computed. Both are exact
/// path-dependent TreeSHAP (the module header says how).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TreeAlgorithm {
    /// Gauss–Legendre quadrature of the Shapley integral, one pass over
    /// each tree's nodes: O(nodes × ⌈depth/2⌉) per tree. The default.
    Quadrature,
    /// Lundberg et al.'s Algorithm 2: O(leaves × depth²) per tree.
    Classic,
}

impl TreeAlgorithm {
    pub fn name(self) -> &'static str {
        match self {
            TreeAlgorithm::Quadrature => "quadrature",
            TreeAlgorithm::Classic => "classic",
        }
    }
}

/// One element of a classic TreeSHAP path: a feature on the way to the
/// leaf, the share of cover its branch keeps (`zero`), whether the row
/// takes that branch (`one`: 1 or 0), and the permutation weight.
#[derive(Clone, Copy, Debug, Default)]
struct PathElement {
    feature: u32,
    zero: f64,
    one: f64,
    weight: f64,
}

/// The feature of the root's path element, which no split names.
const NO_FEATURE: u32 = u32::MAX;

/// The per-call memory of an explainer, allocated once.
#[derive(Clone, Debug)]
pub struct Scratch {
    path: Vec<PathElement>,
    /// A leaf's unwinding, three rows of `depth + 1` (`leaf`).
    unwinding: Vec<f64>,
    walk: Walk,
}

/// A tree ensemble read through `Input` columns `0..width`, then the
/// model's optional `Affine` of its sum: `(sum − center) · scale + shift`.
#[derive(Debug)]
struct TreeShap {
    model: Arc<Model>,
    /// The graph node holding the ensemble.
    node: usize,
    depth_max: usize,
    scale: f64,
    /// The bias: base plus the trees' expectations, through the affine.
    bias: f64,
    /// The quadrature's table, or `None` for the classic algorithm.
    quadrature: Option<Quadrature>,
}

/// The explainers there are, by model family.
#[derive(Debug)]
enum Method {
    Trees(TreeShap),
    Linear(Linear),
}

/// A model whose margin is `weights · x + constant` (a NaN input read as
/// 0, as the model reads it): contributions `weights[i] · (x[i] −
/// baseline[i])`, bias `weights · baseline + constant`.
#[derive(Debug)]
struct Linear {
    weights: Vec<f64>,
    /// Where the model's first scaler outputs 0 (a StandardScaler's
    /// training mean), or 0 without a scaler.
    baseline: Vec<f64>,
    bias: f64,
}

/// Exact contributions for one model, built once (at load) and shared.
#[derive(Debug)]
pub struct Explainer {
    name: String,
    width: usize,
    method: Method,
}

impl Explainer {
    /// The explainer of `model`, or why it cannot have one. The model is
    /// a validated one (as `Model::load` and the importers return it):
    /// its trees are trees, its features within its input. Tree ensembles
    /// are explained by [`TreeAlgorithm::Quadrature`].
    pub fn new(model: Arc<Model>) -> Result<Explainer, ExplainError> {
        Self::with_tree_algorithm(model, TreeAlgorithm::Quadrature)
    }

    /// As [`Explainer::new`], with tree ensembles explained by `algorithm`.
    pub fn with_tree_algorithm(model: Arc<Model>, algorithm: TreeAlgorithm) -> Result<Explainer, ExplainError> {
        let name = model.name.clone();
        let width = model.input_dim();
        let refuse = |kind: &str| ExplainError::NotExplainable { model: name.clone(), kind: kind.into() };
        if !model.is_native() {
            return Err(refuse("a model served only through onnxruntime"));
        }
        if let Some(linear) = Linear::new(&model) {
            return Ok(Explainer { name, width, method: Method::Linear(linear) });
        }
        let Some(graph) = model.graph.as_ref() else {
            return Err(refuse(&format!("an MLP of {} layers", model.layers.len())));
        };
        let trees = graph.nodes.iter().position(|n| matches!(n.op, Op::Trees(_)));
        let Some(node) = trees else {
            return Err(refuse(&format!(
                "a graph model of {} nodes that is neither linear nor trees",
                graph.nodes.len()
            )));
        };
        let method = Method::Trees(TreeShap::new(&model, node, algorithm).ok_or_else(|| {
            refuse("a graph that does more than a tree ensemble over the input columns (and an affine map of its sum)")
        })??);
        Ok(Explainer { name, width, method })
    }

    /// How contributions are computed: `treeshap` or `linear`.
    pub fn method(&self) -> &'static str {
        match self.method {
            Method::Trees(_) => "treeshap",
            Method::Linear(_) => "linear",
        }
    }

    /// The algorithm a tree ensemble is explained by (`None` for a linear
    /// model).
    pub fn tree_algorithm(&self) -> Option<TreeAlgorithm> {
        match &self.method {
            Method::Trees(t) if t.quadrature.is_some() => Some(TreeAlgorithm::Quadrature),
            Method::Trees(_) => Some(TreeAlgorithm::Classic),
            Method::Linear(_) => None,
        }
    }

    /// Bytes of the tables built for this explainer beyond the model's own
    /// (the quadrature's per-node table; weights and baseline of a linear
    /// model).
    pub fn table_bytes(&self) -> usize {
        match &self.method {
            Method::Trees(t) => t.quadrature.as_ref().map_or(0, |q| {
                q.nodes.len() * TABLE_NODE_BYTES + 4 * (q.starts.len() + q.tree_levels.len()) + 20 * q.levels.len()
            }),
            Method::Linear(l) => (l.weights.len() + l.baseline.len()) * 8,
        }
    }

    /// The input width a row must have.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The bias: the margin with no feature known (for trees, the expected
    /// value over the training data the covers count).
    pub fn bias(&self) -> f64 {
        match &self.method {
            Method::Trees(t) => t.bias,
            Method::Linear(l) => l.bias,
        }
    }

    /// The memory `explain` needs, for one caller at a time.
    pub fn scratch(&self) -> Scratch {
        let mut scratch = Scratch { path: Vec::new(), unwinding: Vec::new(), walk: Walk::default() };
        if let Method::Trees(t) = &self.method {
            t.fit(&mut scratch);
        }
        scratch
    }

    /// Writes each input column's contribution to `contributions` (one per
    /// column, `width` of them) and returns the bias; the bias plus their
    /// sum is the margin. Allocates nothing (but to grow a scratch another
    /// explainer made).
    pub fn explain(&self, x: &[f32], scratch: &mut Scratch, contributions: &mut [f64]) -> Result<f64, ExplainError> {
        for got in [x.len(), contributions.len()] {
            if got != self.width {
                return Err(ExplainError::Width { model: self.name.clone(), want: self.width, got });
            }
        }
        contributions.fill(0.0);
        match &self.method {
            Method::Trees(t) => {
                t.fit(scratch);
                t.explain(x, scratch, contributions);
                Ok(t.bias)
            }
            Method::Linear(l) => {
                for (i, c) in contributions.iter_mut().enumerate() {
                    let v = if x[i].is_nan() { 0.0 } else { x[i] as f64 };
                    *c = l.weights[i] * (v - l.baseline[i]);
                }
                Ok(l.bias)
            }
        }
    }
}

impl Linear {
    /// `None` unless the model is one dense layer to one output: a v1
    /// model of one layer, or a graph chain `Input(0..width) → Affine* →
    /// Dense(1, no activation) → Affine*` (scalers before, a scaled logit
    /// after).
    fn new(model: &Model) -> Option<Linear> {
        let width = model.input_dim();
        // x ↦ a · x + d elementwise before the dense layer, then its row.
        let (mut a, mut d) = (vec![1.0f64; width], vec![0.0f64; width]);
        let mut baseline = vec![0.0f64; width];
        let (row, dense_bias, after) = match &model.graph {
            None => match model.layers.as_slice() {
                [l] if l.out_dim == 1 && !l.relu => (&l.weights_f32, l.bias[0], &[][..]),
                _ => return None,
            },
            Some(g) => {
                let chained = g.nodes.iter().enumerate().skip(1).all(|(i, n)| n.inputs == [i - 1]);
                match g.nodes.first() {
                    Some(n) if matches!(n.op, Op::Input { offset: 0 }) && n.width == width && chained => {}
                    _ => return None,
                }
                let dense = g.nodes.iter().position(|n| matches!(n.op, Op::Dense { .. }))?;
                for (k, n) in g.nodes[1..dense].iter().enumerate() {
                    let Op::Affine { center, scale, shift } = &n.op else { return None };
                    if [center.len(), scale.len(), shift.len()] != [width; 3] {
                        return None;
                    }
                    for i in 0..width {
                        let (c, s, h) = (center[i] as f64, scale[i] as f64, shift[i] as f64);
                        if k == 0 {
                            baseline[i] = if s != 0.0 { c - h / s } else { c };
                        }
                        // (a x + d − c) s + h
                        (a[i], d[i]) = (a[i] * s, (d[i] - c) * s + h);
                    }
                }
                match &g.nodes[dense].op {
                    Op::Dense { layer, act: super::graph::Act::None } if layer.out_dim == 1 => {
                        (&layer.weights_f32, layer.bias[0], &g.nodes[dense + 1..])
                    }
                    _ => return None,
                }
            }
        };
        let mut weights: Vec<f64> = (0..width).map(|i| row[i] as f64 * a[i]).collect();
        let mut constant = dense_bias as f64 + (0..width).map(|i| row[i] as f64 * d[i]).sum::<f64>();
        for n in after {
            let Op::Affine { center, scale, shift } = &n.op else { return None };
            let (c, s, h) = (*center.first()? as f64, *scale.first()? as f64, *shift.first()? as f64);
            weights.iter_mut().for_each(|w| *w *= s);
            constant = (constant - c) * s + h;
        }
        let bias = constant + weights.iter().zip(&baseline).map(|(w, b)| w * b).sum::<f64>();
        Some(Linear { weights, baseline, bias })
    }
}

impl TreeShap {
    /// `None` when the graph is not `Input(0..width) → Trees → Affine?`.
    fn new(model: &Arc<Model>, node: usize, algorithm: TreeAlgorithm) -> Option<Result<TreeShap, ExplainError>> {
        let graph = model.graph.as_ref()?;
        let trees = &graph.nodes[node];
        let Op::Trees(e) = &trees.op else { return None };
        let input = &graph.nodes[*trees.inputs.first()?];
        if !matches!(input.op, Op::Input { offset: 0 }) || input.width != model.input_dim() {
            return None;
        }
        let (mut center, mut scale, mut shift) = (0.0f64, 1.0f64, 0.0f64);
        match graph.nodes.len() - node {
            1 => {}
            2 => match &graph.nodes[node + 1].op {
                Op::Affine { center: c, scale: s, shift: h } if graph.nodes[node + 1].inputs == [node] => {
                    (center, scale, shift) = (c[0] as f64, s[0] as f64, h[0] as f64);
                }
                _ => return None,
            },
            _ => return None,
        }
        if graph.nodes[..node].iter().any(|n| !matches!(n.op, Op::Input { .. })) {
            return None;
        }
        Some(Self::checked(model, e).map(|expected| {
            let sum = e.base as f64 + expected.iter().sum::<f64>();
            let depth_max = e.depth_max();
            TreeShap {
                model: model.clone(),
                node,
                depth_max,
                scale,
                bias: (sum - center) * scale + shift,
                quadrature: (algorithm == TreeAlgorithm::Quadrature).then(|| Quadrature::new(e, depth_max)),
            }
        }))
    }

    /// Each tree's expected value, once the covers are known to be usable.
    fn checked(model: &Model, e: &Ensemble) -> Result<Vec<f64>, ExplainError> {
        let name = || model.name.clone();
        if !e.has_covers() {
            return Err(ExplainError::NoCovers { model: name() });
        }
        let mut expected = Vec::with_capacity(e.trees());
        for t in 0..e.trees() {
            let start = e.starts[t] as usize;
            let covers = &e.covers[start..e.starts[t + 1] as usize];
            for (i, n) in e.tree(t).iter().enumerate() {
                if !matches!(n.split, Split::Leaf { .. }) && covers[i] <= 0.0 {
                    return Err(ExplainError::ZeroCover { model: name(), tree: t, node: i, cover: covers[i] });
                }
            }
            expected.push(mean(e.tree(t), covers, 0));
        }
        Ok(expected)
    }

    fn ensemble(&self) -> &Ensemble {
        match self.model.graph.as_ref().map(|g| &g.nodes[self.node].op) {
            Some(Op::Trees(e)) => e,
            _ => unreachable!("TreeShap::new checked the node"),
        }
    }

    /// Sizes `scratch` for this ensemble: at once for its own explainer's,
    /// a reallocation for one another explainer made.
    fn fit(&self, scratch: &mut Scratch) {
        match &self.quadrature {
            Some(q) => {
                if !scratch.walk.fits(q) {
                    scratch.walk = Walk::new(q);
                }
            }
            None => {
                if scratch.path.len() < path_len(self.depth_max) {
                    scratch.path.resize(path_len(self.depth_max), PathElement::default());
                    scratch.unwinding.resize(3 * (self.depth_max + 1), 0.0);
                }
            }
        }
    }

    fn explain(&self, x: &[f32], scratch: &mut Scratch, phi: &mut [f64]) {
        let e = self.ensemble();
        match &self.quadrature {
            Some(q) => q.explain(&e.cat_words, x, &mut scratch.walk, phi),
            None => {
                let (path, work) = (&mut scratch.path[..], &mut scratch.unwinding[..]);
                for t in 0..e.trees() {
                    let start = e.starts[t] as usize;
                    let tree = Tree {
                        nodes: e.tree(t),
                        covers: &e.covers[start..e.starts[t + 1] as usize],
                        words: &e.cat_words,
                    };
                    tree.shap(x, phi, path, work, 0, 0, 0, 1.0, 1.0, NO_FEATURE);
                }
            }
        }
        if self.scale != 1.0 {
            phi.iter_mut().for_each(|p| *p *= self.scale);
        }
    }
}

/// Node `i`'s expected value: its leaves weighed by cover, as XGBoost's
/// node means (a split's children over its own cover). Recursion depth is
/// the tree's, at most `DEPTH_MAX`.
fn mean(tree: &[super::trees::TreeNode], covers: &[f32], i: usize) -> f64 {
    let n = &tree[i];
    match n.split {
        Split::Leaf { value } => value as f64,
        _ => {
            let (l, r) = (n.left as usize, n.right as usize);
            (mean(tree, covers, l) * covers[l] as f64 + mean(tree, covers, r) * covers[r] as f64) / covers[i] as f64
        }
    }
}

// ---------------------------------------------------------------------------
// The quadrature.

/// One node of the quadrature's table: the ensemble's trees one after
/// another, each breadth first (so a node's parent, a whole level earlier,
/// is done long before it, and the nodes of a level are independent), with
/// what the walk needs of the edge into the node.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct TableNode {
    /// The merged zero fraction of the edge into the node: the product of
    /// the cover shares (child over parent) of every edge on the path that
    /// splits on the same feature, this one included.
    zero: f64,
    /// A leaf's value or a numeric split's threshold (f32 bits), or a
    /// categorical split's first bitset word.
    value: u32,
    /// The split's input column (below `model::WIDTH_MAX`).
    feature: u16,
    /// A categorical split's bitset words (at most `CATEGORY_WORDS_MAX`).
    words: u16,
    /// The parent, within the tree.
    parent: u16,
    /// The node (within the tree) whose incoming edge is the nearest above
    /// that splits on the same feature as this one's, or
    /// `Quadrature::dummy`.
    repeat: u16,
    /// The slot of the feature the parent splits on.
    slot: u16,
    flags: u8,
}

const LEAF: u8 = 1;
const CATEGORICAL: u8 = 2;
const MISSING_LEFT: u8 = 4;
const ZERO_MISSING: u8 = 8;
/// The node is its parent's left child.
const LEFT_CHILD: u8 = 16;
/// A split below the root whose children are both leaves: it is finished
/// on the way down.
const TWIG: u8 = 32;

impl TableNode {
    fn split(&self) -> Split {
        let feature = self.feature as u32;
        if self.flags & CATEGORICAL != 0 {
            Split::Categorical { feature, start: self.value, len: self.words as u32 }
        } else {
            Split::Numeric {
                feature,
                threshold: f32::from_bits(self.value),
                missing_left: self.flags & MISSING_LEFT != 0,
                zero_missing: self.flags & ZERO_MISSING != 0,
            }
        }
    }

    /// `trees::goes_left` of the node's split (anything for a leaf), the
    /// numeric rule without branches: which way the row goes is a coin
    /// toss no branch predictor learns.
    #[inline(always)]
    fn goes_left(&self, x: &[f32], words: &[u32]) -> bool {
        let v = x[self.feature as usize];
        if self.flags & CATEGORICAL != 0 {
            return goes_left(&self.split(), v, words);
        }
        let missing = v.is_nan() | ((self.flags & ZERO_MISSING != 0) & (v.abs() <= ZERO_THRESHOLD));
        (missing & (self.flags & MISSING_LEFT != 0)) | (!missing & (v <= f32::from_bits(self.value)))
    }
}

/// The vector builds the walk is compiled for, the widest the CPU runs
/// chosen once per explainer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Baseline,
    Avx2,
    Avx512,
}

impl Isa {
    /// Every build this CPU runs, narrowest first.
    fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }
}

/// A tree ensemble prepared for the quadrature walk.
#[derive(Debug)]
struct Quadrature {
    nodes: Vec<TableNode>,
    /// Tree `t` is `nodes[starts[t]..starts[t + 1]]` (lone leaves left out).
    starts: Vec<u32>,
    /// Tree `t`'s levels below the root are `levels[tree_levels[t]..
    /// tree_levels[t + 1]]`, each the tree-relative bounds of its nine
    /// classes of node, in table order: splits whose feature no edge above
    /// splits on, splits whose feature one does (`repeat`); twigs (splits
    /// over two leaves) of each kind, first those whose own feature no
    /// edge above splits on, then those whose one does; the twigs' leaves
    /// of the level above (a pair each, in their twigs' order); the other
    /// leaves of each kind; and the level's end. The walk runs each class
    /// in its own loop, so nothing branches on a node's class.
    levels: Vec<[u16; 10]>,
    tree_levels: Vec<u32>,
    /// Each slot's input column: the features the splits read, ascending.
    columns: Vec<u16>,
    /// The most nodes of one tree.
    tree_nodes_max: usize,
    /// The node index that stands for "no edge above of the same
    /// feature" (factor 1, one 1, zero 1): one past the largest tree's.
    dummy: usize,
    /// The Gauss–Legendre points on [0, 1] and their weights, `lanes` each.
    t: Vec<f64>,
    w: Vec<f64>,
    lanes: usize,
    isa: Isa,
}

/// The quadrature points for trees of `depth` splits: at least ⌈depth/2⌉,
/// which integrates the degree-(depth − 1) integrands exactly, rounded up
/// to a vector width the walk is compiled for (4, 8, 16 or 32).
fn lanes_for(depth: usize) -> usize {
    depth.div_ceil(2).max(4).next_power_of_two()
}

/// The `n`-point Gauss–Legendre rule on [0, 1]: points and weights (which
/// sum to 1), exact for polynomials of degree below `2n`. Each point is the
/// Newton iteration's root of the Legendre polynomial `P_n` from the
/// classical first guess.
fn gauss_legendre(n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut t, mut w) = (vec![0.0; n], vec![0.0; n]);
    // P_n(x) and P_n'(x), by the three-term recurrence.
    let legendre = |x: f64| {
        let (mut p0, mut p1) = (1.0f64, x);
        for k in 2..=n {
            let k = k as f64;
            (p0, p1) = (p1, ((2.0 * k - 1.0) * x * p1 - (k - 1.0) * p0) / k);
        }
        (p1, n as f64 * (x * p1 - p0) / (x * x - 1.0))
    };
    for i in 0..n {
        let mut x = (std::f64::consts::PI * (i as f64 + 0.75) / (n as f64 + 0.5)).cos();
        for _ in 0..100 {
            let (p, dp) = legendre(x);
            let step = p / dp;
            x -= step;
            if step.abs() <= 1e-17 {
                break;
            }
        }
        let (_, dp) = legendre(x);
        t[i] = (1.0 - x) / 2.0;
        w[i] = 1.0 / ((1.0 - x * x) * dp * dp);
    }
    (t, w)
}

impl Quadrature {
    /// The table of `e` (a validated ensemble whose splits have positive
    /// covers), trees of at most `depth_max` splits.
    fn new(e: &Ensemble, depth_max: usize) -> Quadrature {
        let used = e.features_used();
        let columns: Vec<u16> = used.iter().map(|&f| f as u16).collect();
        assert!(
            used.iter().all(|&f| f as usize <= u16::MAX as usize) && columns.len() <= u16::MAX as usize + 1,
            "a validated model reads at most WIDTH_MAX columns"
        );
        let mut slot_of = vec![0u16; used.last().map_or(0, |&f| f as usize + 1)];
        for (s, &f) in used.iter().enumerate() {
            slot_of[f as usize] = s as u16;
        }
        let mut nodes: Vec<TableNode> = Vec::with_capacity(e.nodes.len());
        let mut starts = vec![0u32];
        let (mut levels, mut tree_levels) = (Vec::new(), vec![0u32]);
        let mut tree_nodes_max = 0;
        // Per node of the tree at hand, in table order: the split feature
        // (`u32::MAX` for a leaf) and its index in the tree.
        let (mut split_feature, mut in_tree): (Vec<u32>, Vec<usize>) = (Vec::new(), Vec::new());
        // A level's nodes: index in the tree, parent (table order), left.
        let (mut level, mut next) = (Vec::new(), Vec::new());
        let mut built: Vec<(u8, TableNode, usize)> = Vec::new();
        for t in 0..e.trees() {
            let tree = e.tree(t);
            if matches!(tree[0].split, Split::Leaf { .. }) {
                continue; // A lone leaf is all bias.
            }
            let covers = &e.covers[e.starts[t] as usize..e.starts[t + 1] as usize];
            let first = nodes.len();
            split_feature.clear();
            in_tree.clear();
            level.clear();
            level.push((0usize, 0usize, false));
            while !level.is_empty() {
                // Each node of the level, then the level sorted by class
                // (a stable sort: within a class, breadth-first order).
                built.clear();
                for &(i, parent, is_left) in &level {
                    let at = in_tree.len() + built.len();
                    let (mut zero, mut repeat, mut slot) = (1.0f64, NO_NODE, 0);
                    if at > 0 {
                        let feature = split_feature[parent];
                        zero = covers[i] as f64 / covers[in_tree[parent]] as f64;
                        // Up the path: the nearest edge into a node `q`
                        // whose parent splits on the same feature.
                        let mut q = parent;
                        while q != 0 {
                            let above = nodes[first + q].parent as usize;
                            if split_feature[above] == feature {
                                zero *= nodes[first + q].zero;
                                repeat = q as u16;
                                break;
                            }
                            q = above;
                        }
                        slot = slot_of[feature as usize];
                    }
                    let n = &tree[i];
                    let mut flags = if is_left { LEFT_CHILD } else { 0 };
                    let (value, feature, words) = match n.split {
                        Split::Leaf { value } => {
                            flags |= LEAF;
                            (value.to_bits(), 0, 0)
                        }
                        Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                            flags |= if missing_left { MISSING_LEFT } else { 0 };
                            flags |= if zero_missing { ZERO_MISSING } else { 0 };
                            (threshold.to_bits(), feature, 0)
                        }
                        Split::Categorical { feature, start, len } => {
                            flags |= CATEGORICAL;
                            (start, feature, len)
                        }
                    };
                    // Splits, then twigs (below the root, both children
                    // leaves), each plain, then repeated (the twigs' by
                    // their own edge, then by their leaves'); the twigs'
                    // leaves (a twig's pair side by side, in its twig's
                    // order); other leaves, plain, then repeated.
                    let leaf = |c: u32| matches!(tree[c as usize].split, Split::Leaf { .. });
                    let twig = at > 0 && flags & LEAF == 0 && leaf(n.left) && leaf(n.right);
                    // Up the path from the parent: a split on the twig's
                    // own feature above it.
                    let twig_repeated = twig && {
                        let mut q = parent;
                        loop {
                            if split_feature[q] == feature {
                                break true;
                            }
                            if q == 0 {
                                break false;
                            }
                            q = nodes[first + q].parent as usize;
                        }
                    };
                    flags |= if twig { TWIG } else { 0 };
                    let repeated = u8::from(repeat != NO_NODE);
                    let class = if flags & LEAF == 0 {
                        2 * u8::from(twig) + 2 * u8::from(twig_repeated) + repeated
                    } else if at > 0 && nodes[first + parent].flags & TWIG != 0 {
                        6
                    } else {
                        7 + repeated
                    };
                    let node = TableNode {
                        zero,
                        value,
                        feature: feature as u16,
                        words: words as u16,
                        parent: parent as u16,
                        repeat,
                        slot,
                        flags,
                    };
                    built.push((class, node, i));
                }
                built.sort_by_key(|(class, _, _)| *class);
                let at = in_tree.len();
                if at > 0 {
                    // Where each class starts in the level, and its end.
                    let mut bounds = [(at + built.len()) as u16; 10];
                    for class in (0..9u8).rev() {
                        let from = built.iter().position(|(c, _, _)| *c >= class).unwrap_or(built.len());
                        bounds[class as usize] = (at + from) as u16;
                    }
                    levels.push(bounds);
                }
                next.clear();
                for (k, &(_, node, i)) in built.iter().enumerate() {
                    let is_leaf = node.flags & LEAF != 0;
                    split_feature.push(if is_leaf { u32::MAX } else { node.feature as u32 });
                    in_tree.push(i);
                    nodes.push(node);
                    if !is_leaf {
                        next.push((tree[i].left as usize, at + k, true));
                        next.push((tree[i].right as usize, at + k, false));
                    }
                }
                std::mem::swap(&mut level, &mut next);
            }
            starts.push(nodes.len() as u32);
            tree_levels.push(levels.len() as u32);
            tree_nodes_max = tree_nodes_max.max(nodes.len() - first);
        }
        let dummy = tree_nodes_max;
        for n in nodes.iter_mut().filter(|n| n.repeat == NO_NODE) {
            n.repeat = dummy as u16;
        }
        let lanes = lanes_for(depth_max);
        let (t, w) = gauss_legendre(lanes);
        let isa = *Isa::available().last().expect("the baseline always runs");
        Quadrature { nodes, starts, levels, tree_levels, columns, tree_nodes_max, dummy, t, w, lanes, isa }
    }

    /// Adds each column's contribution to `phi`.
    fn explain(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        match self.lanes {
            4 => self.dispatch::<4>(words, x, walk, phi),
            8 => self.dispatch::<8>(words, x, walk, phi),
            16 => self.dispatch::<16>(words, x, walk, phi),
            32 => self.dispatch::<32>(words, x, walk, phi),
            n => unreachable!("lanes_for gives 4, 8, 16 or 32 lanes, not {n}"),
        }
    }

    fn dispatch<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        #[cfg(target_arch = "x86_64")]
        match self.isa {
            // SAFETY: `Isa::available` listed the build only because the
            // CPU has the features it is compiled with.
            Isa::Avx512 => return unsafe { self.walk_avx512::<N>(words, x, walk, phi) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { self.walk_avx2::<N>(words, x, walk, phi) },
            Isa::Baseline => {}
        }
        self.walk::<N>(words, x, walk, phi)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn walk_avx2<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        self.walk::<N>(words, x, walk, phi)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn walk_avx512<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        self.walk::<N>(words, x, walk, phi)
    }

    /// Two passes over each tree, at `N` quadrature points at once.
    ///
    /// Down, level by level: at each node, from the edge into it (feature
    /// i, merged zero `z`, merged one `o`), its factor `f = z (1 − t) + o
    /// t`; the product of the path's factors (each feature's latest; the
    /// weights at the root); `excl`, the parent's product without feature
    /// i's factor `f_a` from the nearest edge above that splits on i (the
    /// dummy's 1 when none does). The node has `scaled = excl · ((o − z)
    /// − (o_a − z_a) f / f_a)` and `grow = f / f_a`. Where no edge above
    /// splits on i, `f_a` is 1 and `o_a − z_a` 0: those nodes skip the
    /// division (most nodes; their own loop, [`Quadrature::levels`]) and
    /// keep neither, as the parent's product times `o − z` and the factor
    /// are kept anyway.
    ///
    /// Up, children before parents: a node's sum `S` (its leaf value, or
    /// its children's sums grown into it) gives feature i `Σ_t scaled · S`
    /// and the parent `grow · S`. A leaf's `S` is its value, known on the
    /// way down, so a leaf adds both there and keeps nothing; a twig's
    /// `S` is its two leaves', so it too is finished there ([`At::twig`]);
    /// the up pass visits the other splits only. The second term of `scaled` takes back what the
    /// edge above counted for this subtree, when i is split on again; a
    /// subtree whose factor is 0 (no row and no training row reaches it)
    /// has `1 / f` read as 0, so it adds nothing. No branch depends on the
    /// row.
    #[inline(always)]
    fn walk<const N: usize>(&self, words: &[u32], x: &[f32], walk: &mut Walk, phi: &mut [f64]) {
        let t: [f64; N] = self.t[..N].try_into().expect("N points");
        let w: [f64; N] = self.w[..N].try_into().expect("N weights");
        let rest: [f64; N] = std::array::from_fn(|k| 1.0 - t[k]);
        let Walk { node, one, coef, left, phi: lanes, .. } = walk;
        let node = node.as_chunks_mut::<N>().0;
        let lanes = &mut lanes.as_chunks_mut::<N>().0[..self.columns.len()];
        lanes.fill([0.0; N]);
        let dummy = self.dummy;
        node[5 * dummy + FACTOR] = [1.0; N];
        (one[dummy], coef[dummy]) = (1.0, 0.0);
        let at = At { t, rest };
        for (tree, bounds) in self.starts.windows(2).enumerate() {
            let nodes = &self.nodes[bounds[0] as usize..bounds[1] as usize];
            let levels = &self.levels[self.tree_levels[tree] as usize..self.tree_levels[tree + 1] as usize];
            node[PRODUCT] = w;
            left[0] = nodes[0].goes_left(x, words);
            // Index loops: an iterator adapter's closure may be compiled
            // apart, without the target features.
            for (l, level) in levels.iter().enumerate() {
                let [a, b, c, d, e, f, twigs_end, g, h, end] = level.map(usize::from);
                for (k, n) in nodes[a..b].iter().enumerate() {
                    at.split::<false>(n, a + k, x, words, node, one, coef, left);
                }
                for (k, n) in nodes[b..c].iter().enumerate() {
                    at.split::<true>(n, b + k, x, words, node, one, coef, left);
                }
                // The twigs' leaves, two a twig, start the next level (a
                // level of twigs has one).
                let pairs = levels.get(l + 1).map_or(end, |next| usize::from(next[6]));
                let pair = |i: usize| &nodes[pairs + 2 * (i - c)..][..2];
                for (k, n) in nodes[c..d].iter().enumerate() {
                    at.twig::<false, false>(n, c + k, pair(c + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[d..e].iter().enumerate() {
                    at.twig::<true, false>(n, d + k, pair(d + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[e..f].iter().enumerate() {
                    at.twig::<false, true>(n, e + k, pair(e + k), x, words, node, one, coef, left, lanes);
                }
                for (k, n) in nodes[f..twigs_end].iter().enumerate() {
                    at.twig::<true, true>(n, f + k, pair(f + k), x, words, node, one, coef, left, lanes);
                }
                for n in &nodes[g..h] {
                    at.leaf::<false>(n, node, one, coef, left, lanes);
                }
                for n in &nodes[h..end] {
                    at.leaf::<true>(n, node, one, coef, left, lanes);
                }
            }
            for level in levels.iter().rev() {
                let [a, b, c, ..] = level.map(usize::from);
                for i in (a..b).rev() {
                    at.up::<false>(&nodes[i], i, node, coef, lanes);
                }
                for i in (b..c).rev() {
                    at.up::<true>(&nodes[i], i, node, coef, lanes);
                }
            }
        }
        for (l, &column) in lanes.iter().zip(&self.columns) {
            phi[column as usize] += l.iter().sum::<f64>();
        }
    }
}

/// A node's vectors in the walk's memory, five per node.
const PRODUCT: usize = 0;
const FACTOR: usize = 1;
const SCALED: usize = 2;
const GROW: usize = 3;
const SUM: usize = 4;

/// The quadrature points of a walk: `t` and `1 − t`.
struct At<const N: usize> {
    t: [f64; N],
    rest: [f64; N],
}

impl<const N: usize> At<N> {
    /// The edge into `n` (module header, [`Quadrature::walk`]): the node's
    /// `f`, `excl`, `grow` and `scaled` vectors and its merged one, `o`.
    /// `REPEAT`: an edge above splits on the same feature (else `f_a` is
    /// 1 and `o_a − z_a` is 0, and nothing is divided).
    #[inline(always)]
    #[allow(clippy::type_complexity)]
    fn edge<const REPEAT: bool>(
        &self,
        n: &TableNode,
        node: &[[f64; N]],
        one: &[f64],
        coef: &[f64],
        left: &[bool],
    ) -> ([f64; N], [f64; N], [f64; N], [f64; N], f64) {
        let (t, rest) = (&self.t, &self.rest);
        let p = n.parent as usize;
        let taken = ((n.flags & LEFT_CHILD != 0) == left[p]) as u8 as f64;
        let z = n.zero;
        let product = node[5 * p + PRODUCT];
        if REPEAT {
            let a = n.repeat as usize;
            let (o, ca) = (taken * one[a], coef[a]);
            let fa = node[5 * a + FACTOR];
            let f: [f64; N] = std::array::from_fn(|k| z * rest[k] + o * t[k]);
            let r: [f64; N] = std::array::from_fn(|k| if fa[k] == 0.0 { 0.0 } else { 1.0 / fa[k] });
            let excl: [f64; N] = std::array::from_fn(|k| product[k] * r[k]);
            let g: [f64; N] = std::array::from_fn(|k| f[k] * r[k]);
            let scaled = std::array::from_fn(|k| excl[k] * ((o - z) - ca * g[k]));
            (f, excl, g, scaled, o)
        } else {
            let o = taken;
            let f: [f64; N] = std::array::from_fn(|k| z * rest[k] + o * t[k]);
            let scaled = std::array::from_fn(|k| product[k] * (o - z));
            (f, product, f, scaled, o)
        }
    }

    /// A split node `i`: its vectors kept for its children and the up
    /// pass, and which way the row goes.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn split<const REPEAT: bool>(
        &self,
        n: &TableNode,
        i: usize,
        x: &[f32],
        words: &[u32],
        node: &mut [[f64; N]],
        one: &mut [f64],
        coef: &mut [f64],
        left: &mut [bool],
    ) {
        let (f, excl, g, scaled, o) = self.edge::<REPEAT>(n, node, one, coef, left);
        let at = 5 * i;
        node[at + PRODUCT] = std::array::from_fn(|k| excl[k] * f[k]);
        node[at + FACTOR] = f;
        if REPEAT {
            node[at + SCALED] = scaled;
            node[at + GROW] = g;
        }
        node[at + SUM] = [0.0; N];
        (one[i], coef[i]) = (o, o - n.zero);
        left[i] = n.goes_left(x, words);
    }

    /// A split `i` on the way up: its sum `S`, complete, times `scaled`
    /// to its feature's lanes and times `grow` to its parent's sum. Where
    /// no edge above splits on the feature, those are the parent's product
    /// times `o − z` and the factor ([`At::edge`]), not stored on the way
    /// down.
    #[inline(always)]
    fn up<const REPEAT: bool>(
        &self,
        n: &TableNode,
        i: usize,
        node: &mut [[f64; N]],
        coef: &[f64],
        lanes: &mut [[f64; N]],
    ) {
        let (slot, to) = (n.slot as usize, 5 * n.parent as usize + SUM);
        let total = node[5 * i + SUM];
        let (s, g) = if REPEAT {
            (node[5 * i + SCALED], node[5 * i + GROW])
        } else {
            let (product, c) = (node[5 * n.parent as usize + PRODUCT], coef[i]);
            (std::array::from_fn(|k| product[k] * c), node[5 * i + FACTOR])
        };
        // Whole vectors in and out, which the compiler keeps in vector
        // registers (a lane at a time, it did not).
        let (into_lanes, into_parent) = (lanes[slot], node[to]);
        lanes[slot] = std::array::from_fn(|k| into_lanes[k] + s[k] * total[k]);
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * total[k]);
    }

    /// A twig `i` (its two leaves, left then right, in `pair`), finished
    /// here. Its leaves share their parent, so their edges share `excl`
    /// and `1 / f_a` (`r`): with `Z` and `O` the sums over the pair of the
    /// leaf value times its `z` and its `o`, they add `excl ((O − Z) −
    /// (o_a − z_a) S)` to the twig's feature's lanes and make the twig's
    /// sum `S = r (Z (1 − t) + O t)`, as [`At::leaf`] would one by one
    /// (`CHILDREN`: an edge above the twig splits on its feature; else `r`
    /// is 1 and `o_a − z_a` is 0). The twig adds `S` times its `scaled`
    /// and `grow` to its parent's feature and sum, as the up pass would.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn twig<const REPEAT: bool, const CHILDREN: bool>(
        &self,
        n: &TableNode,
        i: usize,
        pair: &[TableNode],
        x: &[f32],
        words: &[u32],
        node: &mut [[f64; N]],
        one: &mut [f64],
        coef: &mut [f64],
        left: &[bool],
        lanes: &mut [[f64; N]],
    ) {
        let (t, rest) = (&self.t, &self.rest);
        let (f, excl, g, scaled, o) = self.edge::<REPEAT>(n, node, one, coef, left);
        let (l, r) = (&pair[0], &pair[1]);
        let (vl, vr) = (f32::from_bits(l.value) as f64, f32::from_bits(r.value) as f64);
        let zero = l.zero * vl + r.zero * vr;
        // Which leaf the row takes is the row's: a branch on it is
        // mispredicted half the time (on the 500 x 8 benchmark, 31% of the
        // walk's time).
        // The compiler turns a select after `goes_left`'s own branch
        // (categorical or not) into a branch on the row, so the side is
        // made opaque to it first.
        let go_left = std::hint::black_box(n.goes_left(x, words));
        let taken = std::hint::select_unpredictable(go_left, vl, vr);
        let product: [f64; N] = std::array::from_fn(|k| excl[k] * f[k]);
        let (sum, into_leaves): ([f64; N], [f64; N]) = if CHILDREN {
            // The leaves' `a` may be the twig itself: its edge first.
            node[5 * i + FACTOR] = f;
            (one[i], coef[i]) = (o, o - n.zero);
            let a = l.repeat as usize;
            let (taken, ca, fa) = (taken * one[a], coef[a], node[5 * a + FACTOR]);
            let r: [f64; N] = std::array::from_fn(|k| if fa[k] == 0.0 { 0.0 } else { 1.0 / fa[k] });
            let sum: [f64; N] = std::array::from_fn(|k| r[k] * (zero * rest[k] + taken * t[k]));
            (sum, std::array::from_fn(|k| product[k] * r[k] * ((taken - zero) - ca * sum[k])))
        } else {
            let sum = std::array::from_fn(|k| zero * rest[k] + taken * t[k]);
            (sum, std::array::from_fn(|k| product[k] * (taken - zero)))
        };
        let into_lanes = lanes[l.slot as usize];
        lanes[l.slot as usize] = std::array::from_fn(|k| into_lanes[k] + into_leaves[k]);
        let into_lanes = lanes[n.slot as usize];
        lanes[n.slot as usize] = std::array::from_fn(|k| into_lanes[k] + scaled[k] * sum[k]);
        let to = 5 * n.parent as usize + SUM;
        let into_parent = node[to];
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * sum[k]);
    }

    /// A leaf: its value times `scaled` to its feature's lanes, times
    /// `grow` to its parent's sum; nothing kept.
    #[inline(always)]
    fn leaf<const REPEAT: bool>(
        &self,
        n: &TableNode,
        node: &mut [[f64; N]],
        one: &[f64],
        coef: &[f64],
        left: &[bool],
        lanes: &mut [[f64; N]],
    ) {
        let (_, _, g, scaled, _) = self.edge::<REPEAT>(n, node, one, coef, left);
        let value = f32::from_bits(n.value) as f64;
        let (slot, to) = (n.slot as usize, 5 * n.parent as usize + SUM);
        let (into_lanes, into_parent) = (lanes[slot], node[to]);
        lanes[slot] = std::array::from_fn(|k| into_lanes[k] + scaled[k] * value);
        node[to] = std::array::from_fn(|k| into_parent[k] + g[k] * value);
    }
}

/// The quadrature walk's memory: per node of the largest tree (and the
/// dummy), five vectors of `lanes` values (product, factor, scaled, grow,
/// sum), the edge's merged one and `one − zero`, and which way the row
/// goes; per slot, `lanes` partial contributions.
#[derive(Clone, Debug, Default)]
struct Walk {
    lanes: usize,
    nodes: usize,
    node: Vec<f64>,
    one: Vec<f64>,
    coef: Vec<f64>,
    left: Vec<bool>,
    phi: Vec<f64>,
}

impl Walk {
    fn new(q: &Quadrature) -> Walk {
        // The largest tree's nodes and the dummy after them.
        let nodes = q.tree_nodes_max + 1;
        Walk {
            lanes: q.lanes,
            nodes,
            node: vec![0.0; 5 * q.lanes * nodes],
            one: vec![0.0; nodes],
            coef: vec![0.0; nodes],
            left: vec![false; nodes],
            phi: vec![0.0; q.lanes * q.columns.len()],
        }
    }

    /// Whether it holds what `q`'s walk needs.
    fn fits(&self, q: &Quadrature) -> bool {
        self.lanes == q.lanes && self.nodes > q.dummy && self.phi.len() >= q.lanes * q.columns.len()
    }
}

// ---------------------------------------------------------------------------
// The classic algorithm.

/// One tree with its covers and the ensemble's bitsets.
struct Tree<'a> {
    nodes: &'a [super::trees::TreeNode],
    covers: &'a [f32],
    words: &'a [u32],
}

impl Tree<'_> {
    /// TreeSHAP's recursion from node `i`: the path so far is the
    /// `depth + 1` elements at `parent` in `path` (element 0 stands for no
    /// feature); this call's copy goes right after them.
    #[allow(clippy::too_many_arguments)]
    fn shap(
        &self,
        x: &[f32],
        phi: &mut [f64],
        path: &mut [PathElement],
        work: &mut [f64],
        i: usize,
        mut depth: usize,
        parent: usize,
        zero: f64,
        one: f64,
        feature: u32,
    ) {
        let at = parent + depth + 1;
        path.copy_within(parent..parent + depth + 1, at);
        extend(&mut path[at..], depth, zero, one, feature);
        let n = &self.nodes[i];
        let split_feature = match n.split {
            Split::Leaf { value } => {
                leaf(&path[at..at + depth + 1], value as f64, work, phi);
                return;
            }
            Split::Numeric { feature, .. } | Split::Categorical { feature, .. } => feature,
        };
        let left = goes_left(&n.split, x[split_feature as usize], self.words);
        let (hot, cold) = if left { (n.left, n.right) } else { (n.right, n.left) };
        let (hot, cold) = (hot as usize, cold as usize);
        let cover = self.covers[i] as f64;
        let hot_zero = self.covers[hot] as f64 / cover;
        let cold_zero = self.covers[cold] as f64 / cover;
        let (mut incoming_zero, mut incoming_one) = (1.0, 1.0);
        // A feature split on again higher up: undo that element, so the
        // feature appears once on the path with both splits' fractions.
        if let Some(k) = (0..=depth).find(|&k| path[at + k].feature == split_feature) {
            incoming_zero = path[at + k].zero;
            incoming_one = path[at + k].one;
            unwind(&mut path[at..], depth, k);
            depth -= 1;
        }
        self.shap(x, phi, path, work, hot, depth + 1, at, hot_zero * incoming_zero, incoming_one, split_feature);
        self.shap(x, phi, path, work, cold, depth + 1, at, cold_zero * incoming_zero, 0.0, split_feature);
    }
}

/// Adds element `depth` to the path and updates the permutation weights.
fn extend(path: &mut [PathElement], depth: usize, zero: f64, one: f64, feature: u32) {
    path[depth] = PathElement { feature, zero, one, weight: if depth == 0 { 1.0 } else { 0.0 } };
    let inv_d1 = RECIPROCALS[depth + 1];
    for i in (0..depth).rev() {
        path[i + 1].weight += one * path[i].weight * (i + 1) as f64 * inv_d1;
        path[i].weight = zero * path[i].weight * (depth - i) as f64 * inv_d1;
    }
}

/// `1 / n` for the path lengths there are: divisions are most of
/// TreeSHAP's arithmetic otherwise, and slow.
const RECIPROCALS: [f64; DEPTH_MAX + 2] = reciprocals();

const fn reciprocals() -> [f64; DEPTH_MAX + 2] {
    let mut t = [0.0; DEPTH_MAX + 2];
    let mut n = 1;
    while n < DEPTH_MAX + 2 {
        t[n] = 1.0 / n as f64;
        n += 1;
    }
    t
}

/// Removes element `k` from the path (of `depth + 1` elements), undoing
/// its extension.
fn unwind(path: &mut [PathElement], depth: usize, k: usize) {
    let (one, zero) = (path[k].one, path[k].zero);
    let d1 = (depth + 1) as f64;
    let mut next_one = path[depth].weight;
    for i in (0..depth).rev() {
        if one != 0.0 {
            let w = path[i].weight;
            path[i].weight = next_one * d1 / ((i + 1) as f64 * one);
            next_one = w - path[i].weight * zero * (depth - i) as f64 / d1;
        } else {
            path[i].weight = path[i].weight * d1 / (zero * (depth - i) as f64);
        }
    }
    for i in k..depth {
        path[i].feature = path[i + 1].feature;
        path[i].zero = path[i + 1].zero;
        path[i].one = path[i + 1].one;
    }
}

/// A leaf's share of each feature on its path (of `depth + 1` elements,
/// element 0 the root's): for element k, the path's permutation weight with
/// k unwound, times (one − zero) times the leaf value.
///
/// The unwinding of every k is done at once, level by level, instead of
/// one k after another: the levels are a chain of dependent steps per k,
/// so interleaving the k keeps the pipeline busy (and lets the compiler
/// vectorize over k). `one` is 1 or 0 (a branch taken or not), which
/// splits the recurrence: a taken element unwinds through `next`; an
/// untaken one's sum is the same for every k but for its `zero`.
fn leaf(path: &[PathElement], value: f64, work: &mut [f64], phi: &mut [f64]) {
    let depth = path.len() - 1;
    if depth == 0 {
        return;
    }
    let d1 = (depth + 1) as f64;
    let (zero, rest) = work.split_at_mut(depth + 1);
    let (next, total) = rest.split_at_mut(depth + 1);
    let total = &mut total[..depth + 1];
    for k in 1..=depth {
        zero[k] = path[k].zero;
        next[k] = path[depth].weight;
        total[k] = 0.0;
    }
    let mut untaken = 0.0;
    for i in (0..depth).rev() {
        let up = d1 * RECIPROCALS[i + 1];
        let down = (depth - i) as f64 * RECIPROCALS[depth + 1];
        let weight = path[i].weight;
        untaken += weight * d1 * RECIPROCALS[depth - i];
        for k in 1..=depth {
            let w = next[k] * up;
            total[k] += w;
            next[k] = weight - w * zero[k] * down;
        }
    }
    for (k, el) in path.iter().enumerate().skip(1) {
        let w = if el.one != 0.0 {
            total[k]
        } else if el.zero != 0.0 {
            untaken / el.zero
        } else {
            0.0
        };
        phi[el.feature as usize] += w * (el.one - el.zero) * value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::graph::{Graph, Node, OutputKind};
    use crate::model::tests::tiny;
    use crate::model::trees::TreeNode;
    use crate::model::{InputSegment, Source};
    use crate::seeded::SplitMix64;

    const WIDTH: usize = 5;

    /// A random ensemble over `WIDTH` features, features repeated along
    /// paths, every missing-value rule and categorical splits, with covers
    /// that add up (a leaf's count at random, some 0; a split's the sum).
    fn random_ensemble(seed: u64, trees: usize, depth: usize) -> Ensemble {
        random_ensemble_over(seed, trees, depth, WIDTH, 4, false)
    }

    /// As `random_ensemble`, over `width` features, a split's child ending
    /// in a leaf with probability 1 / `stop`; with `spine`, the leftmost
    /// path always reaches `depth`.
    fn random_ensemble_over(seed: u64, trees: usize, depth: usize, width: usize, stop: u64, spine: bool) -> Ensemble {
        let mut rng = SplitMix64::new(seed);
        let mut e = Ensemble { base: rng.normal() * 0.1, ..Ensemble::default() };
        for _ in 0..trees {
            let mut nodes = vec![TreeNode::leaf(0.0)];
            let mut open = vec![(0usize, 0usize, spine)];
            while let Some((i, d, on_spine)) = open.pop() {
                if d >= depth || (d > 0 && !on_spine && rng.below(stop) == 0) {
                    nodes[i] = TreeNode::leaf(rng.normal());
                    continue;
                }
                let feature = rng.below(width as u64) as u32;
                let split = if rng.below(4) == 0 {
                    let (start, len) = e.push_words(&[rng.next_u64() as u32]);
                    Split::Categorical { feature, start, len }
                } else {
                    Split::Numeric {
                        feature,
                        threshold: rng.normal(),
                        missing_left: rng.below(2) == 0,
                        zero_missing: rng.below(5) == 0,
                    }
                };
                let (l, r) = (nodes.len(), nodes.len() + 1);
                nodes.extend([TreeNode::leaf(0.0), TreeNode::leaf(0.0)]);
                nodes[i] = TreeNode { split, left: l as u32, right: r as u32 };
                open.extend([(l, d + 1, on_spine), (r, d + 1, false)]);
            }
            // Top down (children come after their parent): a split shares
            // its cover between its children, a leaf child sometimes
            // getting none (all rows went the other way).
            let mut covers = vec![0.0f32; nodes.len()];
            covers[0] = 100.0;
            for i in 0..nodes.len() {
                if matches!(nodes[i].split, Split::Leaf { .. }) {
                    continue;
                }
                let (l, r) = (nodes[i].left as usize, nodes[i].right as usize);
                let leaf = |c: usize| matches!(nodes[c].split, Split::Leaf { .. });
                let share = match rng.below(6) {
                    0 if leaf(l) => 0.0,
                    1 if leaf(r) => 1.0,
                    _ => 0.1 + 0.8 * rng.unit() as f32,
                };
                covers[l] = covers[i] * share;
                covers[r] = covers[i] - covers[l];
            }
            e.push_tree(&nodes);
            e.covers.extend(covers);
        }
        e
    }

    fn tree_model(e: Ensemble, affine: Option<(f32, f32, f32)>) -> Arc<Model> {
        tree_model_over(e, affine, WIDTH)
    }

    fn tree_model_over(e: Ensemble, affine: Option<(f32, f32, f32)>, width: usize) -> Arc<Model> {
        let mut nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width },
            Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
        ];
        if let Some((c, s, h)) = affine {
            nodes.push(Node {
                op: Op::Affine { center: vec![c], scale: vec![s], shift: vec![h] },
                inputs: vec![1],
                width: 1,
            });
        }
        let model = Model {
            name: "trees".into(),
            inputs: vec![InputSegment { source: Source::Context, dim: width }],
            layers: Vec::new(),
            calibration: None,
            graph: Some(Graph { nodes, output: OutputKind::Logit }),
            ..tiny()
        };
        model.validate().unwrap();
        Arc::new(model)
    }

    /// E[tree(x) | the features in `known` are x's], the others drawn as
    /// the covers say: the value function path-dependent TreeSHAP takes
    /// the Shapley values of.
    fn conditional(e: &Ensemble, t: usize, i: usize, x: &[f32], known: u32) -> f64 {
        let tree = e.tree(t);
        let covers = &e.covers[e.starts[t] as usize..];
        let n = &tree[i];
        match n.split {
            Split::Leaf { value } => value as f64,
            Split::Numeric { feature, .. } | Split::Categorical { feature, .. } => {
                let (l, r) = (n.left as usize, n.right as usize);
                if known >> feature & 1 == 1 {
                    let left = goes_left(&n.split, x[feature as usize], &e.cat_words);
                    conditional(e, t, if left { l } else { r }, x, known)
                } else {
                    (conditional(e, t, l, x, known) * covers[l] as f64
                        + conditional(e, t, r, x, known) * covers[r] as f64)
                        / covers[i] as f64
                }
            }
        }
    }

    /// Shapley values by their definition, over all 2^WIDTH subsets.
    fn brute_force(e: &Ensemble, x: &[f32]) -> (f64, Vec<f64>) {
        let v = |s: u32| e.base as f64 + (0..e.trees()).map(|t| conditional(e, t, 0, x, s)).sum::<f64>();
        let fact = |n: usize| (1..=n).map(|k| k as f64).product::<f64>();
        let mut phi = vec![0.0; WIDTH];
        for (f, p) in phi.iter_mut().enumerate() {
            for s in 0u32..1 << WIDTH {
                if s >> f & 1 == 1 {
                    continue;
                }
                let k = s.count_ones() as usize;
                *p += fact(k) * fact(WIDTH - k - 1) / fact(WIDTH) * (v(s | 1 << f) - v(s));
            }
        }
        (v(0), phi)
    }

    fn row(rng: &mut SplitMix64) -> Vec<f32> {
        row_of(rng, WIDTH)
    }

    fn row_of(rng: &mut SplitMix64, width: usize) -> Vec<f32> {
        (0..width)
            .map(|_| match rng.below(8) {
                0 => f32::NAN,
                1 => 0.0,
                2 => rng.below(40) as f32,
                _ => rng.normal(),
            })
            .collect()
    }

    const ALGORITHMS: [TreeAlgorithm; 2] = [TreeAlgorithm::Quadrature, TreeAlgorithm::Classic];

    #[test]
    fn tree_shap_is_the_shapley_values_of_the_cover_weighted_expectation() {
        for algorithm in ALGORITHMS {
            let mut rng = SplitMix64::new(37);
            for seed in 0..40 {
                let e = random_ensemble(seed, 1 + seed as usize % 4, 1 + seed as usize % 6);
                let model = tree_model(e.clone(), None);
                let explainer = Explainer::with_tree_algorithm(model, algorithm).unwrap();
                assert_eq!(explainer.tree_algorithm(), Some(algorithm));
                let mut scratch = explainer.scratch();
                let mut phi = vec![0.0; WIDTH];
                for _ in 0..20 {
                    let x = row(&mut rng);
                    let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
                    let (want_bias, want) = brute_force(&e, &x);
                    let at = format!("{algorithm:?} seed {seed} x {x:?}");
                    assert!((bias - want_bias).abs() <= 1e-9, "{at}: bias {bias} vs {want_bias}");
                    for f in 0..WIDTH {
                        assert!((phi[f] - want[f]).abs() <= 1e-9, "{at} feature {f}: {phi:?} vs {want:?}");
                    }
                    let margin = e.predict_row(&x) as f64;
                    let sum = bias + phi.iter().sum::<f64>();
                    assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "{at}: {sum} vs {margin}");
                }
            }
        }
    }

    /// Where the definition is out of reach (dozens of features), the
    /// quadrature against the classic algorithm: deep narrow trees (so
    /// every lane count, features split on again and again), and wide
    /// ones (many distinct features on a path).
    #[test]
    fn the_quadrature_is_the_classic_algorithm_on_deep_and_wide_trees() {
        let mut rng = SplitMix64::new(8);
        let mut lanes_seen = std::collections::BTreeSet::new();
        for (seed, trees, depth, width, stop) in [
            (1, 6, 8, 40, 8),
            (2, 20, 6, 28, 6),
            (3, 4, 16, 30, 3),
            (4, 4, 24, 12, 2),
            (5, 3, 40, 50, 2),
            (6, 3, 64, 64, 2),
            (7, 2, 64, 4, 2),
        ] {
            let e = random_ensemble_over(seed, trees, depth, width, stop, true);
            let model = tree_model_over(e.clone(), None, width);
            let fast = Explainer::new(model.clone()).unwrap();
            let classic = Explainer::with_tree_algorithm(model, TreeAlgorithm::Classic).unwrap();
            let Method::Trees(t) = &fast.method else { unreachable!() };
            lanes_seen.insert(t.quadrature.as_ref().unwrap().lanes);
            let (mut s1, mut s2) = (fast.scratch(), classic.scratch());
            let (mut a, mut b) = (vec![0.0; width], vec![0.0; width]);
            for _ in 0..20 {
                let x = row_of(&mut rng, width);
                let bias = fast.explain(&x, &mut s1, &mut a).unwrap();
                assert_eq!(bias, classic.explain(&x, &mut s2, &mut b).unwrap());
                for f in 0..width {
                    let err = (a[f] - b[f]).abs() / b[f].abs().max(1.0);
                    assert!(err <= 1e-9, "seed {seed} depth {} feature {f}: {} vs {}", e.depth_max(), a[f], b[f]);
                }
                let margin = e.predict_row(&x) as f64;
                let sum = bias + a.iter().sum::<f64>();
                assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "seed {seed}: {sum} vs {margin}");
            }
        }
        assert_eq!(lanes_seen.into_iter().collect::<Vec<_>>(), [4, 8, 16, 32], "every compiled width is exercised");
    }

    /// Every vector build the CPU runs gives the same contributions.
    #[test]
    fn every_vector_build_computes_the_same() {
        let width = 28;
        let e = random_ensemble_over(11, 30, 8, width, 6, false);
        let mut explainer = Explainer::new(tree_model_over(e, None, width)).unwrap();
        let mut scratch = explainer.scratch();
        let mut rng = SplitMix64::new(3);
        let rows: Vec<Vec<f32>> = (0..20).map(|_| row_of(&mut rng, width)).collect();
        let mut want: Vec<Vec<f64>> = Vec::new();
        for isa in Isa::available() {
            let Method::Trees(t) = &mut explainer.method else { unreachable!() };
            t.quadrature.as_mut().unwrap().isa = isa;
            for (r, x) in rows.iter().enumerate() {
                let mut phi = vec![0.0; width];
                explainer.explain(x, &mut scratch, &mut phi).unwrap();
                if isa == Isa::Baseline {
                    want.push(phi);
                    continue;
                }
                for f in 0..width {
                    assert!((phi[f] - want[r][f]).abs() <= 1e-12, "{isa:?} row {r} feature {f}");
                }
            }
        }
    }

    #[test]
    fn gauss_legendre_integrates_polynomials_below_twice_its_points_exactly() {
        for n in [1, 2, 3, 4, 8, 16, 32] {
            let (t, w) = gauss_legendre(n);
            assert!(t.iter().all(|&t| t > 0.0 && t < 1.0), "{n}: {t:?}");
            for j in 0..2 * n {
                let got: f64 = t.iter().zip(&w).map(|(t, w)| w * t.powi(j as i32)).sum();
                let want = 1.0 / (j + 1) as f64;
                assert!((got - want).abs() <= 1e-14, "{n} points, t^{j}: {got} vs {want}");
            }
        }
        assert_eq!([1, 8, 9, 16, 17, 33, 64].map(lanes_for), [4, 4, 8, 8, 16, 32, 32]);
    }

    /// A scratch made by an explainer of other lanes and depth is
    /// reallocated, not misread.
    #[test]
    fn a_scratch_made_by_another_explainer_still_explains() {
        let deep = random_ensemble_over(5, 3, 40, WIDTH, 2, true);
        let shallow = random_ensemble(6, 3, 3);
        let (deep, shallow) =
            (Explainer::new(tree_model(deep, None)).unwrap(), Explainer::new(tree_model(shallow, None)).unwrap());
        let x = row(&mut SplitMix64::new(2));
        let (mut a, mut b) = (vec![0.0; WIDTH], vec![0.0; WIDTH]);
        let mut foreign = shallow.scratch();
        deep.explain(&x, &mut foreign, &mut a).unwrap();
        deep.explain(&x, &mut deep.scratch(), &mut b).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn an_affine_of_the_sum_scales_the_contributions_and_moves_the_bias() {
        let e = random_ensemble(5, 3, 4);
        let (plain, scaled) = (
            Explainer::new(tree_model(e.clone(), None)).unwrap(),
            Explainer::new(tree_model(e, Some((0.5, 2.0, -1.0)))).unwrap(),
        );
        let mut scratch = plain.scratch();
        let (mut a, mut b) = (vec![0.0; WIDTH], vec![0.0; WIDTH]);
        let x = row(&mut SplitMix64::new(1));
        let bias_a = plain.explain(&x, &mut scratch, &mut a).unwrap();
        let bias_b = scaled.explain(&x, &mut scratch, &mut b).unwrap();
        assert_eq!(bias_b, (bias_a - 0.5) * 2.0 - 1.0);
        assert_eq!(b, a.iter().map(|v| v * 2.0).collect::<Vec<_>>());
        assert_eq!(scaled.bias(), bias_b);
    }

    #[test]
    fn models_that_cannot_be_explained_exactly_are_refused_with_the_reason() {
        let mut bare = random_ensemble(3, 2, 3);
        bare.covers.clear();
        let err = Explainer::new(tree_model(bare, None)).unwrap_err();
        assert!(matches!(err, ExplainError::NoCovers { .. }), "{err}");
        assert!(err.to_string().contains("ONNX tree ensembles have none"), "{err}");

        let mut zero = random_ensemble(3, 2, 3);
        zero.covers[0] = 0.0;
        let err = Explainer::new(tree_model(zero, None)).unwrap_err();
        assert_eq!(err, ExplainError::ZeroCover { model: "trees".into(), tree: 0, node: 0, cover: 0.0 });

        let err = Explainer::new(Arc::new(tiny())).unwrap_err();
        assert!(matches!(err, ExplainError::NotExplainable { .. }), "{err}");
        assert!(err.to_string().contains("an MLP of 2 layers cannot be explained exactly"), "{err}");

        let explainer = Explainer::new(tree_model(random_ensemble(3, 2, 3), None)).unwrap();
        let mut scratch = explainer.scratch();
        let err = explainer.explain(&[0.0; 4], &mut scratch, &mut [0.0; WIDTH]).unwrap_err();
        assert_eq!(err, ExplainError::Width { model: "trees".into(), want: 5, got: 4 });
        let err = explainer.explain(&[0.0; 5], &mut scratch, &mut [0.0; 6]).unwrap_err();
        assert_eq!(err, ExplainError::Width { model: "trees".into(), want: 5, got: 6 });
    }

    fn linear_row() -> (Vec<f32>, f32) {
        (vec![0.5, -1.25, 2.0, 0.0, 3.0], -0.75)
    }

    #[test]
    fn a_logistic_regression_explains_as_its_weights_times_the_inputs() {
        let (w, b) = linear_row();
        let model = Model {
            inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
            layers: vec![crate::model::Layer::quantize(WIDTH, 1, false, w.clone(), vec![b])],
            calibration: None,
            ..tiny()
        };
        model.validate().unwrap();
        let explainer = Explainer::new(Arc::new(model)).unwrap();
        let mut scratch = explainer.scratch();
        let mut phi = vec![0.0; WIDTH];
        let x = [1.0, 2.0, f32::NAN, 7.0, -0.5];
        let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
        // No scaler: the baseline is 0, the bias the intercept; a NaN reads
        // as 0, as the model reads it.
        assert_eq!(bias, b as f64);
        assert_eq!(phi, vec![0.5, -2.5, 0.0, 0.0, -1.5]);
    }

    #[test]
    fn a_scaler_pipeline_explains_against_the_scaler_center() {
        let (w, b) = linear_row();
        let center = vec![1.0f32, -2.0, 0.5, 4.0, 0.0];
        let scale = vec![0.5f32, 2.0, 1.0, 0.25, 4.0];
        let nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: WIDTH },
            Node {
                op: Op::Affine { center: center.clone(), scale: scale.clone(), shift: vec![0.0; WIDTH] },
                inputs: vec![0],
                width: WIDTH,
            },
            Node {
                op: Op::Dense {
                    layer: crate::model::Layer::quantize(WIDTH, 1, false, w.clone(), vec![b]),
                    act: crate::model::Act::None,
                },
                inputs: vec![1],
                width: 1,
            },
            Node {
                op: Op::Affine { center: vec![0.0], scale: vec![2.0], shift: vec![0.0] },
                inputs: vec![2],
                width: 1,
            },
        ];
        let graph = Graph { nodes, output: OutputKind::Logit };
        let model = Model {
            inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
            layers: Vec::new(),
            calibration: None,
            graph: Some(graph.clone()),
            ..tiny()
        };
        model.validate().unwrap();
        let explainer = Explainer::new(Arc::new(model)).unwrap();
        let mut scratch = explainer.scratch();
        let mut phi = vec![0.0; WIDTH];
        let mut rng = SplitMix64::new(4);
        for _ in 0..20 {
            let x: Vec<f32> = (0..WIDTH).map(|_| rng.normal() * 3.0).collect();
            let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
            // margin = 2 (w · (x − c) s + b): at x = c it is 2b.
            assert_eq!(bias, 2.0 * b as f64);
            for i in 0..WIDTH {
                let want = 2.0 * w[i] as f64 * scale[i] as f64 * (x[i] as f64 - center[i] as f64);
                assert!((phi[i] - want).abs() <= 1e-12 * (1.0 + want.abs()), "{i}: {} vs {want}", phi[i]);
            }
            let margin = graph.forward_row(&x) as f64;
            let sum = bias + phi.iter().sum::<f64>();
            assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "{sum} vs {margin}");
        }
    }

    #[test]
    fn graphs_that_are_not_linear_nor_trees_are_refused() {
        let (w, b) = linear_row();
        let nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: WIDTH },
            Node {
                op: Op::Dense {
                    layer: crate::model::Layer::quantize(WIDTH, 1, false, w, vec![b]),
                    act: crate::model::Act::None,
                },
                inputs: vec![0],
                width: 1,
            },
            Node { op: Op::Act(crate::model::Act::Tanh), inputs: vec![1], width: 1 },
        ];
        let model = Model {
            inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
            layers: Vec::new(),
            calibration: None,
            graph: Some(Graph { nodes, output: OutputKind::Logit }),
            ..tiny()
        };
        model.validate().unwrap();
        let err = Explainer::new(Arc::new(model)).unwrap_err();
        assert!(err.to_string().contains("a graph model of 3 nodes that is neither linear nor trees"), "{err}");
    }

    #[test]
    fn a_model_served_only_through_onnxruntime_is_refused() {
        use crate::model::{OnnxElement, OnnxGraph, OnnxInput};
        let model = Model {
            inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
            layers: Vec::new(),
            calibration: None,
            graph: None,
            onnx: Some(OnnxGraph {
                bytes: vec![8u8, 1, 2, 3].into(),
                inputs: vec![OnnxInput { name: "x".into(), width: WIDTH, element: OnnxElement::Float, rank: 2 }],
                output: "p".into(),
                output_column: 0,
                output_probability: false,
                output_kind: OutputKind::Logit,
            }),
            ..tiny()
        };
        model.validate().unwrap();
        let err = Explainer::new(Arc::new(model)).unwrap_err();
        assert_eq!(
            err,
            ExplainError::NotExplainable {
                model: "tiny".into(),
                kind: "a model served only through onnxruntime".into()
            }
        );
    }

    #[test]
    fn the_scratch_is_bounded_by_the_deepest_tree_and_the_table_by_the_nodes() {
        assert_eq!(path_len(0), 3);
        assert_eq!(path_len(DEPTH_MAX), PATH_LEN_MAX);
        let e = random_ensemble(9, 4, 6);
        let (depth, nodes) = (e.depth_max(), e.nodes.len());
        let lone_leaves = (0..e.trees()).filter(|&t| e.tree(t).len() == 1).count();
        let model = tree_model(e, None);
        let classic = Explainer::with_tree_algorithm(model.clone(), TreeAlgorithm::Classic).unwrap();
        assert_eq!(classic.scratch().path.len(), path_len(depth));
        assert_eq!(classic.table_bytes(), 0);
        let fast = Explainer::new(model).unwrap();
        let walk = fast.scratch().walk;
        // The nodes of the largest tree and the dummy.
        let Method::Trees(t) = &fast.method else { unreachable!() };
        let q = t.quadrature.as_ref().unwrap();
        assert!(q.tree_nodes_max < 1 << (depth + 1));
        assert_eq!(
            (walk.lanes, walk.nodes, walk.node.len()),
            (4, q.tree_nodes_max + 1, 5 * 4 * (q.tree_nodes_max + 1))
        );
        assert!(walk.phi.len() <= 4 * WIDTH);
        let trees = 4 - lone_leaves;
        // A level of each tree below its root: each tree's depth.
        fn below(tree: &[crate::model::trees::TreeNode], i: usize) -> usize {
            match tree[i].split {
                Split::Leaf { .. } => 0,
                _ => 1 + below(tree, tree[i].left as usize).max(below(tree, tree[i].right as usize)),
            }
        }
        let e = t.ensemble();
        let levels: usize = (0..e.trees()).map(|t| below(e.tree(t), 0)).sum();
        assert_eq!(q.levels.len(), levels);
        assert_eq!(fast.table_bytes(), (nodes - lone_leaves) * TABLE_NODE_BYTES + 8 * (trees + 1) + 20 * levels);
    }

    /// The table's branch-free rule is `trees::goes_left`, missing values,
    /// zero-as-missing and categories included.
    #[test]
    fn the_table_routes_rows_as_the_model_does() {
        let e = random_ensemble_over(12, 40, 6, WIDTH, 4, false);
        let q = Quadrature::new(&e, e.depth_max());
        let mut rng = SplitMix64::new(5);
        let specials = [0.0, -0.0, 1e-36, -1e-36, 1e-30, f32::NAN, -1.0, 3.0, 31.5, 1e10];
        let mut checked = 0;
        for n in q.nodes.iter().filter(|n| n.flags & LEAF == 0) {
            for _ in 0..20 {
                let mut x = row(&mut rng);
                if rng.below(2) == 0 {
                    x[n.feature as usize] = specials[rng.below(specials.len() as u64) as usize];
                }
                let want = goes_left(&n.split(), x[n.feature as usize], &e.cat_words);
                assert_eq!(n.goes_left(&x, &e.cat_words), want, "{:?} x {}", n.split(), x[n.feature as usize]);
                checked += 1;
            }
        }
        let kinds = |f: u8| q.nodes.iter().any(|n| n.flags & f != 0);
        assert!(checked > 1000 && kinds(CATEGORICAL) && kinds(ZERO_MISSING) && kinds(MISSING_LEFT));
    }
}
