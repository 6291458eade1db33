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
use super::trees::{Ensemble, Split, DEPTH_MAX};
use super::Model;

mod classic;
mod quadrature;
#[cfg(test)]
mod tests;

use classic::{PathElement, Tree, NO_FEATURE};
pub use quadrature::TABLE_NODE_BYTES;
use quadrature::{Quadrature, Walk};

/// Path elements the classic TreeSHAP needs for trees of `depth` splits:
/// one path of up to `d + 1` elements per level `d` of the recursion, side
/// by side.
pub fn path_len(depth: usize) -> usize {
    (depth + 2) * (depth + 3) / 2
}

/// The most path elements a scratch holds (trees of `DEPTH_MAX` splits).
pub const PATH_LEN_MAX: usize = (DEPTH_MAX + 2) * (DEPTH_MAX + 3) / 2;

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
            Method::Trees(t) => t.quadrature.as_ref().map_or(0, Quadrature::table_bytes),
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
