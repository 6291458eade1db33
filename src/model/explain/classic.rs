//! The classic TreeSHAP ([`super::TreeAlgorithm::Classic`]): Algorithm 2
//! of Lundberg et al., path arrays extended and unwound along one
//! recursive walk per tree. The reference the quadrature is tested
//! against, and benchmarked beside it.

use crate::model::trees::{goes_left, Split, TreeNode, DEPTH_MAX};

/// leaf, the share of cover its branch keeps (`zero`), whether the row
/// takes that branch (`one`: 1 or 0), and the permutation weight.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct PathElement {
    feature: u32,
    zero: f64,
    one: f64,
    weight: f64,
}

/// The feature of the root's path element, which no split names.
pub(super) const NO_FEATURE: u32 = u32::MAX;

/// One tree with its covers and the ensemble's bitsets.
pub(super) struct Tree<'a> {
    pub(super) nodes: &'a [TreeNode],
    pub(super) covers: &'a [f32],
    pub(super) words: &'a [u32],
}

impl Tree<'_> {
    /// TreeSHAP's recursion from node `i`: the path so far is the
    /// `depth + 1` elements at `parent` in `path` (element 0 stands for no
    /// feature); this call's copy goes right after them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn shap(
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
pub(super) fn extend(path: &mut [PathElement], depth: usize, zero: f64, one: f64, feature: u32) {
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
