//! Tree ensembles (gradient-boosted trees), the `Trees` node of graph
//! models: one leaf per tree summed, plus a base score.
//!
//! Every format Quiver imports (LightGBM text, XGBoost JSON, ONNX
//! `TreeEnsemble*`) is translated into one canonical split semantics, so the
//! evaluators know a single rule and every format's quirks live at import:
//! a numeric split goes left iff `x <= threshold` compared in f32 (a
//! framework's `x < t` becomes `x <= next_down(t)`, and LightGBM's f64
//! thresholds are rounded down to the largest f32 below them, which is exact
//! for f32 features); a missing value (NaN, and with `zero_missing` also
//! `|x| <= 1e-35` as LightGBM's `zero_as_missing` defines it) takes the
//! node's stored direction. A categorical split (LightGBM's bitsets) sends a
//! value left iff its truncation `c >= 0` has bit `c` set; NaN, negative
//! and out-of-range values go right.
//!
//! [`Ensemble::predict_row`] is the specification the serving evaluator
//! (`score::cpu::forest`) is compared with bit for bit: the base, then each
//! tree's leaf, added in f32 in tree order.

/// Most trees in one ensemble.
pub const TREES_MAX: usize = 20_000;
/// Most nodes in one tree (leaves and splits): 16,384 leaves. The
/// evaluator packs a child index, the feature and the flags in 32 bits.
pub const TREE_NODES_MAX: usize = 32_767;
/// Most nodes in one ensemble, all trees together.
pub const ENSEMBLE_NODES_MAX: usize = 1 << 24;
/// Longest root-to-leaf path, in splits; the evaluator walks every tree
/// this many steps at most.
pub const DEPTH_MAX: usize = 64;
/// Most bitset words of one categorical split (categories 0..2^20).
pub const CATEGORY_WORDS_MAX: usize = 1 << 15;
/// Most bitset words of one ensemble, all splits together (64 MiB).
/// Importers copy a bitset per split that names it, so this bounds what a
/// file of a few shared bitsets can grow into.
pub const CATEGORY_WORDS_TOTAL_MAX: usize = 1 << 24;
/// LightGBM's `kZeroThreshold`: with `zero_as_missing`, `|x| <= this` is
/// missing.
pub const ZERO_THRESHOLD: f32 = 1e-35;

/// What one tree node does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Split {
    Leaf {
        value: f32,
    },
    /// Left iff `x <= threshold`; a missing `x` goes left iff `missing_left`.
    Numeric {
        feature: u32,
        threshold: f32,
        missing_left: bool,
        zero_missing: bool,
    },
    /// Left iff `x` truncates to `c >= 0` with bit `c` set in
    /// `cat_words[start..start + len]`.
    Categorical {
        feature: u32,
        start: u32,
        len: u32,
    },
}

/// A node and its children (indices within its tree; unused for leaves).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TreeNode {
    pub split: Split,
    pub left: u32,
    pub right: u32,
}

impl TreeNode {
    pub fn leaf(value: f32) -> TreeNode {
        TreeNode { split: Split::Leaf { value }, left: 0, right: 0 }
    }
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Ensemble {
    /// Tree `t` is `nodes[starts[t]..starts[t + 1]]`, its root first.
    pub starts: Vec<u32>,
    pub nodes: Vec<TreeNode>,
    pub cat_words: Vec<u32>,
    pub base: f32,
    /// Each node's cover, parallel to `nodes`: what TreeSHAP weighs the
    /// branches by (LightGBM's training row counts, XGBoost's hessian sums).
    /// Empty when the source has none (ONNX `TreeEnsemble*`, files written
    /// before covers were stored): such an ensemble scores but cannot be
    /// explained.
    pub covers: Vec<f32>,
}

/// The largest f32 `<= t`: `x <= t` in f64 is `x <= f32_at_most(t)` for
/// every f32 `x`.
pub fn f32_at_most(t: f64) -> f32 {
    let f = t as f32;
    if f as f64 > t {
        f.next_down()
    } else {
        f
    }
}

/// The largest f32 `< t`: `x < t` is `x <= f32_below(t)` for every f32 `x`.
pub fn f32_below(t: f32) -> f32 {
    t.next_down()
}

/// The largest f32 `< t` for an f64 `t` (exact for an f32 widened to f64).
pub fn f32_below_f64(t: f64) -> f32 {
    let f = f32_at_most(t);
    if f as f64 == t {
        f.next_down()
    } else {
        f
    }
}

/// Whether `x` takes the left branch of `split` (not a leaf).
#[inline]
pub fn goes_left(split: &Split, x: f32, cat_words: &[u32]) -> bool {
    match *split {
        Split::Numeric { threshold, missing_left, zero_missing, .. } => {
            if x.is_nan() || (zero_missing && x.abs() <= ZERO_THRESHOLD) {
                missing_left
            } else {
                x <= threshold
            }
        }
        Split::Categorical { start, len, .. } => match category(x) {
            Some(c) => {
                let word = (c / 32) as usize;
                word < len as usize && (cat_words[start as usize + word] >> (c % 32)) & 1 == 1
            }
            None => false,
        },
        Split::Leaf { .. } => unreachable!("a leaf has no branch"),
    }
}

/// The category a value names: its truncation, when that is a
/// non-negative 32-bit integer.
#[inline]
pub fn category(x: f32) -> Option<u32> {
    (x > -1.0 && x < 2_147_483_648.0).then_some(x as u32)
}

impl Ensemble {
    pub fn trees(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    pub fn tree(&self, t: usize) -> &[TreeNode] {
        &self.nodes[self.starts[t] as usize..self.starts[t + 1] as usize]
    }

    /// Appends a tree (root first, child indices within it).
    pub fn push_tree(&mut self, nodes: &[TreeNode]) {
        if self.starts.is_empty() {
            self.starts.push(0);
        }
        self.nodes.extend_from_slice(nodes);
        self.starts.push(self.nodes.len() as u32);
    }

    /// Appends categorical bitset words; returns their `(start, len)`.
    pub fn push_words(&mut self, words: &[u32]) -> (u32, u32) {
        let start = self.cat_words.len() as u32;
        self.cat_words.extend_from_slice(words);
        (start, words.len() as u32)
    }

    /// The leaf tree `t` gives row `x`.
    #[inline]
    pub fn leaf(&self, t: usize, x: &[f32]) -> f32 {
        let tree = self.tree(t);
        let mut i = 0usize;
        loop {
            let n = &tree[i];
            match n.split {
                Split::Leaf { value } => return value,
                Split::Numeric { feature, .. } | Split::Categorical { feature, .. } => {
                    let left = goes_left(&n.split, x[feature as usize], &self.cat_words);
                    i = if left { n.left } else { n.right } as usize;
                }
            }
        }
    }

    /// The specification: `base`, then every tree's leaf in tree order,
    /// summed in f32.
    pub fn predict_row(&self, x: &[f32]) -> f32 {
        let mut acc = self.base;
        for t in 0..self.trees() {
            acc += self.leaf(t, x);
        }
        acc
    }

    /// Splits on the longest root-to-leaf path of tree `t` (0 for a lone
    /// leaf). Assumes a validated tree.
    pub fn depth(&self, t: usize) -> usize {
        let tree = self.tree(t);
        let mut depth = vec![0usize; tree.len()];
        let mut max = 0;
        // Children come after their parent in a validated tree's walk order,
        // not necessarily in index order, so walk from the root.
        let mut stack = vec![0usize];
        while let Some(i) = stack.pop() {
            max = max.max(depth[i]);
            if !matches!(tree[i].split, Split::Leaf { .. }) {
                for c in [tree[i].left as usize, tree[i].right as usize] {
                    depth[c] = depth[i] + 1;
                    stack.push(c);
                }
            }
        }
        max
    }

    pub fn depth_max(&self) -> usize {
        (0..self.trees()).map(|t| self.depth(t)).max().unwrap_or(0)
    }

    pub fn leaves(&self) -> usize {
        self.nodes.iter().filter(|n| matches!(n.split, Split::Leaf { .. })).count()
    }

    /// The distinct feature columns the splits read, ascending.
    pub fn features_used(&self) -> Vec<u32> {
        let mut f: Vec<u32> = self
            .nodes
            .iter()
            .filter_map(|n| match n.split {
                Split::Numeric { feature, .. } | Split::Categorical { feature, .. } => Some(feature),
                Split::Leaf { .. } => None,
            })
            .collect();
        f.sort_unstable();
        f.dedup();
        f
    }

    /// Whether every node carries its cover (what explanation needs).
    pub fn has_covers(&self) -> bool {
        !self.nodes.is_empty() && self.covers.len() == self.nodes.len()
    }

    pub fn has_categorical(&self) -> bool {
        self.nodes.iter().any(|n| matches!(n.split, Split::Categorical { .. }))
    }

    /// Checks the limits, that every tree is a tree (each node reached
    /// exactly once from its root, so no cycles and no strays), features
    /// below `width`, finite leaves and base, no NaN threshold, bitsets in
    /// bounds. Errors name the tree and node.
    pub fn validate(&self, width: usize) -> Result<(), String> {
        let trees = self.trees();
        if trees == 0 || trees > TREES_MAX {
            return Err(format!("the ensemble has {trees} trees; 1 to {TREES_MAX} allowed"));
        }
        if self.nodes.len() > ENSEMBLE_NODES_MAX {
            return Err(format!("the ensemble has {} nodes; the limit is {ENSEMBLE_NODES_MAX}", self.nodes.len()));
        }
        if self.cat_words.len() > CATEGORY_WORDS_TOTAL_MAX {
            return Err(format!(
                "the ensemble has {} category bitset words; the limit is {CATEGORY_WORDS_TOTAL_MAX}",
                self.cat_words.len()
            ));
        }
        if self.starts[0] != 0
            || self.starts.windows(2).any(|w| w[1] <= w[0])
            || *self.starts.last().expect("trees > 0") as usize != self.nodes.len()
        {
            return Err("tree boundaries are not increasing from 0 to the node count".into());
        }
        if !self.base.is_finite() {
            return Err(format!("the base score {} is not finite", self.base));
        }
        if !self.covers.is_empty() && self.covers.len() != self.nodes.len() {
            return Err(format!("{} node covers for {} nodes", self.covers.len(), self.nodes.len()));
        }
        if let Some(i) = self.covers.iter().position(|c| !(c.is_finite() && *c >= 0.0)) {
            return Err(format!("node {i} of the ensemble has cover {}, not a finite count", self.covers[i]));
        }
        for t in 0..trees {
            let tree = self.tree(t);
            let at = |i: usize, what: String| format!("tree {t} node {i}: {what}");
            if tree.len() > TREE_NODES_MAX {
                return Err(format!("tree {t} has {} nodes; the limit is {TREE_NODES_MAX}", tree.len()));
            }
            let mut seen = vec![false; tree.len()];
            let mut stack = vec![(0usize, 0usize)];
            seen[0] = true;
            while let Some((i, depth)) = stack.pop() {
                let n = &tree[i];
                let feature = match n.split {
                    Split::Leaf { value } => {
                        if !value.is_finite() {
                            return Err(at(i, format!("leaf value {value} is not finite")));
                        }
                        continue;
                    }
                    Split::Numeric { feature, threshold, .. } => {
                        if threshold.is_nan() {
                            return Err(at(i, "its threshold is NaN".into()));
                        }
                        feature
                    }
                    Split::Categorical { feature, start, len } => {
                        let (s, l) = (start as usize, len as usize);
                        if l == 0 || l > CATEGORY_WORDS_MAX || s + l > self.cat_words.len() {
                            return Err(at(i, format!("its category bitset ({l} words at {s}) is out of bounds")));
                        }
                        feature
                    }
                };
                if feature as usize >= width {
                    return Err(at(i, format!("splits on feature {feature}, past the input's {width} features")));
                }
                if depth + 1 > DEPTH_MAX {
                    return Err(format!("tree {t} is deeper than {DEPTH_MAX} splits"));
                }
                for c in [n.left as usize, n.right as usize] {
                    if c >= tree.len() {
                        return Err(at(i, format!("child {c} is past the tree's {} nodes", tree.len())));
                    }
                    if seen[c] {
                        return Err(at(i, format!("child {c} is reached twice (not a tree)")));
                    }
                    seen[c] = true;
                    stack.push((c, depth + 1));
                }
            }
            if let Some(i) = seen.iter().position(|s| !s) {
                return Err(at(i, "is not reached from the root".into()));
            }
        }
        Ok(())
    }

    /// `(trees, depth max, leaves, features used)` for summaries.
    pub fn describe(&self) -> String {
        format!(
            "{} trees, depth {}, {} leaves, {} features used{}",
            self.trees(),
            self.depth_max(),
            self.leaves(),
            self.features_used().len(),
            if self.has_categorical() { ", categorical splits" } else { "" }
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn num(feature: u32, threshold: f32, missing_left: bool, left: u32, right: u32) -> TreeNode {
        TreeNode { split: Split::Numeric { feature, threshold, missing_left, zero_missing: false }, left, right }
    }

    /// Two trees over 3 features: a numeric stump and a categorical split
    /// under a numeric one.
    pub(crate) fn small() -> Ensemble {
        let mut e = Ensemble { base: 0.25, ..Ensemble::default() };
        e.push_tree(&[num(0, 0.5, true, 1, 2), TreeNode::leaf(-1.0), TreeNode::leaf(2.0)]);
        let (start, len) = e.push_words(&[0b1010, 0, 1]);
        e.push_tree(&[
            num(1, -0.25, false, 1, 2),
            TreeNode::leaf(0.125),
            TreeNode { split: Split::Categorical { feature: 2, start, len }, left: 3, right: 4 },
            TreeNode::leaf(0.5),
            TreeNode::leaf(-0.5),
        ]);
        e
    }

    /// `small()` with node covers, as the one node of a graph over 3
    /// context inputs: a tree model the explainer accepts.
    pub(crate) fn small_explainable() -> crate::model::Model {
        use crate::model::{Graph, InputSegment, Model, Node, Op, OutputKind, Source};
        let mut e = small();
        e.covers = vec![10.0, 4.0, 6.0, 10.0, 3.0, 7.0, 2.5, 4.5];
        let graph = Graph {
            nodes: vec![
                Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 3 },
                Node { op: Op::Trees(e), inputs: vec![0], width: 1 },
            ],
            output: OutputKind::Logit,
        };
        let model = Model {
            name: "small_explainable".into(),
            version: 1,
            inputs: vec![InputSegment { source: Source::Context, dim: 3 }],
            layers: Vec::new(),
            calibration: None,
            graph: Some(graph),
            onnx: None,
            feature_names: Vec::new(),
        };
        model.validate().unwrap();
        model
    }

    #[test]
    fn splits_follow_the_canonical_rule() {
        let e = small();
        e.validate(3).unwrap();
        assert_eq!(e.depth_max(), 2);
        assert_eq!(e.leaves(), 5);
        assert_eq!(e.features_used(), vec![0, 1, 2]);
        let p = |x: [f32; 3]| e.predict_row(&x);
        // x0 <= 0.5 left; equal goes left; NaN goes left here.
        assert_eq!(p([0.5, -1.0, 0.0]), 0.25 - 1.0 + 0.125);
        assert_eq!(p([0.6, -1.0, 0.0]), 0.25 + 2.0 + 0.125);
        assert_eq!(p([f32::NAN, -1.0, 0.0]), 0.25 - 1.0 + 0.125);
        // x1 NaN goes right (missing_left false), then the category test:
        // bits 1 and 3 of word 0, bit 0 of word 2 (category 64).
        for (c, left) in [(1.0, true), (3.0, true), (3.9, true), (2.0, false), (64.0, true), (65.0, false)] {
            let want = 0.25 - 1.0 + if left { 0.5 } else { -0.5 };
            assert_eq!(p([0.0, f32::NAN, c]), want, "category {c}");
        }
        // NaN, negative (-1 and below) and past-the-bitset values go right;
        // (-1, 0) truncates to category 0, which is not set.
        for c in [f32::NAN, -1.0, -7.0, 96.0, 1e10, f32::INFINITY, -0.5] {
            assert_eq!(p([0.0, 0.0, c]), 0.25 - 1.0 - 0.5, "category {c}");
        }
    }

    #[test]
    fn zero_as_missing_covers_tiny_values() {
        let mut e = Ensemble::default();
        e.push_tree(&[
            TreeNode {
                split: Split::Numeric { feature: 0, threshold: -1.0, missing_left: true, zero_missing: true },
                left: 1,
                right: 2,
            },
            TreeNode::leaf(1.0),
            TreeNode::leaf(2.0),
        ]);
        e.validate(1).unwrap();
        for x in [0.0, -0.0, 1e-36, -1e-35, f32::NAN] {
            assert_eq!(e.predict_row(&[x]), 1.0, "{x}");
        }
        assert_eq!(e.predict_row(&[1e-30]), 2.0);
        assert_eq!(e.predict_row(&[-2.0]), 1.0);
    }

    #[test]
    fn thresholds_round_to_the_same_decisions() {
        for t in [0.1f64, -0.3, 1e-40, 3.4e38, 1e39, 0.0, 7.0] {
            let f = f32_at_most(t);
            for x in [f, f.next_up(), f.next_down(), t as f32] {
                assert_eq!((x as f64) <= t, x <= f, "t {t} x {x}");
            }
        }
        for t in [0.0f32, 0.1, -2.5, f32::MIN_POSITIVE] {
            let f = f32_below(t);
            assert_eq!(f32_below_f64(t as f64), f);
            for x in [t, t.next_down(), t.next_up(), -0.0] {
                assert_eq!(x < t, x <= f, "t {t} x {x}");
            }
        }
        for t in [0.1f64, -0.3, 1e-40, 1e39] {
            let f = f32_below_f64(t);
            for x in [f, f.next_up(), t as f32] {
                assert_eq!((x as f64) < t, x <= f, "t {t} x {x}");
            }
        }
    }

    #[test]
    fn refusals_name_the_tree_and_node() {
        let ok = small();
        let refused = |edit: &dyn Fn(&mut Ensemble), width: usize| {
            let mut e = ok.clone();
            edit(&mut e);
            e.validate(width).unwrap_err()
        };
        assert!(refused(&|_| {}, 2).contains("tree 1 node 2: splits on feature 2, past the input's 2 features"));
        assert!(refused(&|e| e.nodes[0].right = 1, 3).contains("tree 0 node 0: child 1 is reached twice"));
        assert!(refused(&|e| e.nodes[0].right = 7, 3).contains("child 7 is past the tree's 3 nodes"));
        assert!(refused(&|e| e.nodes[1] = TreeNode::leaf(f32::NAN), 3).contains("leaf value NaN"));
        assert!(refused(&|e| e.cat_words.truncate(1), 3).contains("bitset (3 words at 0) is out of bounds"));
        assert!(refused(&|e| e.base = f32::INFINITY, 3).contains("base score"));
        assert!(refused(&|e| e.covers = vec![1.0; 3], 3).contains("3 node covers for 8 nodes"));
        assert!(refused(&|e| e.covers = vec![-1.0; 8], 3).contains("node 0 of the ensemble has cover -1"));
        assert!(refused(&|e| e.covers = vec![f32::NAN; 8], 3).contains("cover NaN"));
        assert!(refused(&|e| e.cat_words.resize(CATEGORY_WORDS_TOTAL_MAX + 1, 0), 3)
            .contains("16777217 category bitset words; the limit is 16777216"));
        let stray = |e: &mut Ensemble| {
            e.nodes.insert(3, TreeNode::leaf(0.0));
            e.starts = vec![0, 4, 9];
        };
        assert!(refused(&stray, 3).contains("tree 0 node 3: is not reached from the root"));
        let mut deep = Ensemble::default();
        let mut nodes = Vec::new();
        for i in 0..=DEPTH_MAX as u32 {
            nodes.push(num(0, 0.0, true, 2 * i + 1, 2 * i + 2));
            nodes.push(TreeNode::leaf(0.0));
        }
        nodes.push(TreeNode::leaf(0.0));
        // Node 2i's right child is 2i + 2, the next split.
        deep.push_tree(&nodes);
        assert!(deep.validate(1).unwrap_err().contains("deeper than 64"));
    }
}
