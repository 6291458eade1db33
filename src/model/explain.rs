//! Reason codes: each input column's exact contribution to one candidate's
//! margin (the model's output before its sigmoid), plus the bias, such that
//! bias + the sum of the contributions is the margin.
//!
//! Why here and exact: a declined payment must say why, inside the same
//! response, so the attribution is computed by the server from the model it
//! serves, not by a separate explainer that may disagree with it. Tree
//! ensembles get path-dependent TreeSHAP (Lundberg et al. 2018, Algorithm
//! 2), the algorithm LightGBM's `predict(pred_contrib=True)` and XGBoost's
//! `predict(pred_contribs=True)` implement: branches are weighed by each
//! node's cover (`Ensemble::covers`), and the branch a candidate takes is
//! decided by `trees::goes_left`, the rule the model is scored by, so
//! missing values and categorical splits are routed as the model routes
//! them. It runs in f64, one scalar walk per tree: the specification
//! before any faster variant.
//!
//! Models that cannot be explained exactly are refused when the explainer
//! is built ([`ExplainError`]), never answered with an approximation: tree
//! ensembles without covers (ONNX `TreeEnsemble*` has none), MLPs, other
//! graphs and onnxruntime-only models.
//!
//! All memory a call needs is allocated by [`Explainer::scratch`], once per
//! explainer: the TreeSHAP path arrays, bounded by the deepest tree.

use std::sync::Arc;

use super::graph::Op;
use super::trees::{goes_left, Ensemble, Split, DEPTH_MAX};
use super::Model;

/// Path elements TreeSHAP needs for trees of `depth` splits: one path of
/// up to `d + 1` elements per level `d` of the recursion, side by side.
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

/// One element of a TreeSHAP path: a feature on the way to the leaf, the
/// share of cover its branch keeps (`zero`), whether the row takes that
/// branch (`one`: 1 or 0), and the permutation weight.
#[derive(Clone, Copy, Debug, Default)]
struct PathElement {
    feature: u32,
    zero: f64,
    one: f64,
    weight: f64,
}

/// The feature of the root's path element, which no split names.
const NO_FEATURE: u32 = u32::MAX;

/// The per-call memory of an explainer (its path arrays), allocated once.
#[derive(Clone, Debug)]
pub struct Scratch {
    path: Vec<PathElement>,
    /// A leaf's unwinding, three rows of `depth + 1` (`leaf`).
    unwinding: Vec<f64>,
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
    /// its trees are trees, its features within its input.
    pub fn new(model: Arc<Model>) -> Result<Explainer, ExplainError> {
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
        let method = Method::Trees(TreeShap::new(&model, node).ok_or_else(|| {
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
        let len = match &self.method {
            Method::Trees(t) => path_len(t.depth_max),
            Method::Linear(_) => 0,
        };
        let depth_max = match &self.method {
            Method::Trees(t) => t.depth_max,
            Method::Linear(_) => 0,
        };
        Scratch { path: vec![PathElement::default(); len], unwinding: vec![0.0; 3 * (depth_max + 1)] }
    }

    /// Writes each input column's contribution to `contributions` (one per
    /// column, `width` of them) and returns the bias; the bias plus their
    /// sum is the margin. Allocates nothing.
    pub fn explain(&self, x: &[f32], scratch: &mut Scratch, contributions: &mut [f64]) -> Result<f64, ExplainError> {
        for got in [x.len(), contributions.len()] {
            if got != self.width {
                return Err(ExplainError::Width { model: self.name.clone(), want: self.width, got });
            }
        }
        contributions.fill(0.0);
        match &self.method {
            Method::Trees(t) => {
                // Only a scratch made by another explainer can be short.
                if scratch.path.len() < path_len(t.depth_max) {
                    scratch.path.resize(path_len(t.depth_max), PathElement::default());
                    scratch.unwinding.resize(3 * (t.depth_max + 1), 0.0);
                }
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
    fn new(model: &Arc<Model>, node: usize) -> Option<Result<TreeShap, ExplainError>> {
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
            TreeShap {
                model: model.clone(),
                node,
                depth_max: e.depth_max(),
                scale,
                bias: (sum - center) * scale + shift,
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

    fn explain(&self, x: &[f32], scratch: &mut Scratch, phi: &mut [f64]) {
        let (path, work) = (&mut scratch.path[..], &mut scratch.unwinding[..]);
        let e = self.ensemble();
        for t in 0..e.trees() {
            let start = e.starts[t] as usize;
            let tree =
                Tree { nodes: e.tree(t), covers: &e.covers[start..e.starts[t + 1] as usize], words: &e.cat_words };
            tree.shap(x, phi, path, work, 0, 0, 0, 1.0, 1.0, NO_FEATURE);
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
        let mut rng = SplitMix64::new(seed);
        let mut e = Ensemble { base: rng.normal() * 0.1, ..Ensemble::default() };
        for _ in 0..trees {
            let mut nodes = vec![TreeNode::leaf(0.0)];
            let mut open = vec![(0usize, 0usize)];
            while let Some((i, d)) = open.pop() {
                if d >= depth || (d > 0 && rng.below(4) == 0) {
                    nodes[i] = TreeNode::leaf(rng.normal());
                    continue;
                }
                let feature = rng.below(WIDTH as u64) as u32;
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
                open.extend([(l, d + 1), (r, d + 1)]);
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
        let mut nodes = vec![
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: WIDTH },
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
            inputs: vec![InputSegment { source: Source::Context, dim: WIDTH }],
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
        (0..WIDTH)
            .map(|_| match rng.below(8) {
                0 => f32::NAN,
                1 => 0.0,
                2 => rng.below(40) as f32,
                _ => rng.normal(),
            })
            .collect()
    }

    #[test]
    fn tree_shap_is_the_shapley_values_of_the_cover_weighted_expectation() {
        let mut rng = SplitMix64::new(37);
        for seed in 0..40 {
            let e = random_ensemble(seed, 1 + seed as usize % 4, 1 + seed as usize % 6);
            let model = tree_model(e.clone(), None);
            let explainer = Explainer::new(model).unwrap();
            let mut scratch = explainer.scratch();
            let mut phi = vec![0.0; WIDTH];
            for _ in 0..20 {
                let x = row(&mut rng);
                let bias = explainer.explain(&x, &mut scratch, &mut phi).unwrap();
                let (want_bias, want) = brute_force(&e, &x);
                assert!((bias - want_bias).abs() <= 1e-9, "seed {seed}: bias {bias} vs {want_bias}");
                for f in 0..WIDTH {
                    assert!((phi[f] - want[f]).abs() <= 1e-9, "seed {seed} x {x:?} feature {f}: {phi:?} vs {want:?}");
                }
                let margin = e.predict_row(&x) as f64;
                let sum = bias + phi.iter().sum::<f64>();
                assert!((sum - margin).abs() <= 1e-5 * (1.0 + margin.abs()), "seed {seed}: {sum} vs {margin}");
            }
        }
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
    fn the_scratch_is_bounded_by_the_deepest_tree() {
        assert_eq!(path_len(0), 3);
        assert_eq!(path_len(DEPTH_MAX), PATH_LEN_MAX);
        let explainer = Explainer::new(tree_model(random_ensemble(9, 4, 6), None)).unwrap();
        assert!(explainer.scratch().path.len() <= path_len(6));
    }
}
