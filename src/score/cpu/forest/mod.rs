//! The CPU evaluator of tree ensembles (`model::trees`), built for a batch
//! of a few dozen candidates.
//!
//! Layout: every tree is re-laid breadth first so that a split's two
//! children are adjacent (`right = left + 1`) and a leaf loops to itself
//! (threshold +inf, missing goes left). A node is two 32-bit words: its
//! threshold, and `meta`, which packs the left child's index within the
//! tree (15 bits), the feature (14 bits) and three flags. A row's next node
//! is then `child + right` with no branch, and every row of a tree walks
//! exactly the tree's depth in steps: rows that reach a leaf early stay on
//! it. The SIMD builds gather one step of 8 (AVX2) or 16 (AVX-512) rows at
//! once, three gathers a step (meta, threshold, the feature), and keep
//! several trees and row vectors in flight together so that the gathers'
//! latency overlaps; the scalar build walks four trees at a time for up to
//! eight rows. Measured against the other designs users would pick
//! (lleaves' per-tree compiled branches, treelite, onnxruntime) by
//! `bench/trees_side_by_side.py`.
//!
//! Every build computes `Ensemble::predict_row` bit for bit: the base, then
//! each tree's leaf added in f32 in tree order. Categorical splits whose
//! bitset is one word (categories below 32, LightGBM's usual case) are
//! tested in registers by the AVX2 build, the word held in the node's
//! threshold slot; otherwise the lanes that sit on a categorical split are
//! redone in scalar code after the numeric step.

use crate::model::trees::{category, Ensemble, Split, TREE_NODES_MAX, ZERO_THRESHOLD};

const CHILD_MASK: u32 = (1 << 15) - 1;
const FEATURE_SHIFT: u32 = 15;
const FEATURE_MASK: u32 = (1 << 14) - 1;
const ZERO_MISSING: u32 = 1 << 29;
const CATEGORICAL: u32 = 1 << 30;
/// The sign bit, so SIMD builds read it as a lane mask.
const MISSING_RIGHT: u32 = 1 << 31;
/// The nodes the SIMD builds select from registers instead of gathering:
/// breadth first, the first steps of a walk stay among a tree's first
/// nodes (step s below node 2^(s+1) - 1).
const TOP_NODES: usize = 64;

/// Which build evaluates the trees; chosen once at construction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TreeKernel {
    Scalar,
    Avx2,
    Avx512,
}

impl TreeKernel {
    pub const ALL: [TreeKernel; 3] = [TreeKernel::Scalar, TreeKernel::Avx2, TreeKernel::Avx512];

    pub fn available(self) -> bool {
        match self {
            TreeKernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            TreeKernel::Avx2 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            TreeKernel::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TreeKernel::Scalar => "scalar",
            TreeKernel::Avx2 => "avx2",
            TreeKernel::Avx512 => "avx512",
        }
    }
}

#[derive(Clone, Copy)]
struct Tree {
    /// The tree's first node in the compiled arrays; child indices are
    /// relative to it.
    root: u32,
    depth: u32,
    categorical: bool,
}

/// An ensemble compiled for evaluation: see the module header.
pub struct CompiledTrees {
    kernel: TreeKernel,
    threshold: Vec<f32>,
    meta: Vec<u32>,
    leaf: Vec<f32>,
    /// Per node: the bitset `(start, len)` of a categorical split.
    cat_range: Vec<(u32, u32)>,
    cat_words: Vec<u32>,
    trees: Vec<Tree>,
    base: f32,
    zero_missing: bool,
    /// Every categorical split's bitset is one word (categories below 32):
    /// the AVX2 build then tests it in registers, the word stored in the
    /// node's threshold slot, instead of redoing those lanes in scalar code.
    cat_inline: bool,
    /// The feature columns read lie below this.
    width_min: usize,
}

impl CompiledTrees {
    /// Compiles a validated ensemble for the build that runs it fastest on
    /// this CPU, timed here on a seeded batch of 32 rows: the widest is not
    /// always the fastest (AVX-512 gathers cost twice the AVX2 ones on
    /// AMD Zen 4, where AVX2 wins). Every build gives the same bits.
    pub fn new(e: &Ensemble) -> CompiledTrees {
        let mut c = CompiledTrees::with_kernel(e, TreeKernel::Scalar).expect("the scalar build runs anywhere");
        // The scalar build is the fallback, never the fastest where a SIMD
        // one runs (see `cargo bench --bench trees`); the
        // timing, a few milliseconds for a large ensemble, is for the rest.
        let simd: Vec<TreeKernel> =
            [TreeKernel::Avx2, TreeKernel::Avx512].into_iter().filter(|k| k.available()).collect();
        c.kernel = match simd[..] {
            [] => TreeKernel::Scalar,
            [one] => one,
            _ => c.fastest(&simd),
        };
        c
    }

    fn fastest(&mut self, kernels: &[TreeKernel]) -> TreeKernel {
        const ROWS: usize = 32;
        let stride = self.width_min.max(1);
        let mut rng = crate::seeded::SplitMix64::new(0x7733);
        let x: Vec<f32> =
            (0..ROWS * stride).map(|_| if rng.below(16) == 0 { f32::NAN } else { rng.normal() }).collect();
        let mut out = [0.0f32; ROWS];
        let mut best = (u128::MAX, TreeKernel::Scalar);
        for &k in kernels {
            self.kernel = k;
            self.eval(&x, stride, ROWS, &mut out);
            let ns = (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    self.eval(&x, stride, ROWS, &mut out);
                    t.elapsed().as_nanos()
                })
                .min()
                .unwrap_or(u128::MAX);
            if ns < best.0 {
                best = (ns, k);
            }
        }
        best.1
    }

    /// `None` when this CPU cannot run `kernel`.
    pub fn with_kernel(e: &Ensemble, kernel: TreeKernel) -> Option<CompiledTrees> {
        if !kernel.available() {
            return None;
        }
        let n = e.nodes.len();
        let mut c = CompiledTrees {
            kernel,
            threshold: Vec::with_capacity(n),
            meta: Vec::with_capacity(n),
            leaf: Vec::with_capacity(n),
            cat_range: Vec::new(),
            cat_words: e.cat_words.clone(),
            trees: Vec::with_capacity(e.trees()),
            base: e.base,
            zero_missing: false,
            cat_inline: e.nodes.iter().all(|n| !matches!(n.split, Split::Categorical { len, .. } if len != 1)),
            width_min: e.features_used().last().map_or(0, |f| *f as usize + 1),
        };
        let any_cat = e.has_categorical();
        for t in 0..e.trees() {
            let tree = e.tree(t);
            assert!(tree.len() <= TREE_NODES_MAX, "validated trees fit the packed child index");
            let root = c.threshold.len() as u32;
            // Breadth first, children placed side by side as their parent is
            // placed: `order[k]` is the tree node at compiled slot k.
            let mut order = vec![0usize];
            let mut slot = vec![0u32; tree.len()];
            let mut k = 0;
            while k < order.len() {
                let i = order[k];
                if !matches!(tree[i].split, Split::Leaf { .. }) {
                    slot[tree[i].left as usize] = order.len() as u32;
                    order.push(tree[i].left as usize);
                    slot[tree[i].right as usize] = order.len() as u32;
                    order.push(tree[i].right as usize);
                }
                k += 1;
            }
            let mut categorical = false;
            for (k, &i) in order.iter().enumerate() {
                let node = &tree[i];
                let (thr, meta, leaf, range) = match node.split {
                    Split::Leaf { value } => (f32::INFINITY, k as u32, value, (0, 0)),
                    Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                        c.zero_missing |= zero_missing;
                        let meta = slot[node.left as usize]
                            | feature << FEATURE_SHIFT
                            | if zero_missing { ZERO_MISSING } else { 0 }
                            | if missing_left { 0 } else { MISSING_RIGHT };
                        (threshold, meta, 0.0, (0, 0))
                    }
                    Split::Categorical { feature, start, len } => {
                        categorical = true;
                        // The numeric step's answer is replaced for these lanes.
                        let meta = slot[node.left as usize] | feature << FEATURE_SHIFT | CATEGORICAL;
                        (f32::from_bits(e.cat_words[start as usize]), meta, 0.0, (start, len))
                    }
                };
                c.threshold.push(thr);
                c.meta.push(meta);
                c.leaf.push(leaf);
                if any_cat {
                    c.cat_range.push(range);
                }
            }
            c.trees.push(Tree { root, depth: e.depth(t) as u32, categorical });
        }
        // The SIMD builds read a tree's first `TOP_NODES` nodes as one
        // table, past the end of a small last tree.
        c.threshold.extend([f32::INFINITY; TOP_NODES]);
        c.meta.extend([0; TOP_NODES]);
        Some(c)
    }

    pub fn kernel(&self) -> TreeKernel {
        self.kernel
    }

    /// `out[r]` = the ensemble's value for row `r` of `x` (`rows` rows of
    /// `stride` floats; the last may end at its last column read, so `x`
    /// can be a window into a wider input vector).
    pub fn eval(&self, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) {
        let needed = if rows == 0 { 0 } else { (rows - 1) * stride + self.width_min };
        assert!(stride >= self.width_min && x.len() >= needed && out.len() >= rows);
        assert!(rows * stride <= i32::MAX as usize, "gather offsets are 32-bit");
        let done = match self.kernel {
            TreeKernel::Scalar => 0,
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `with_kernel` checked that the CPU has AVX2; feature
            // offsets stay below `needed` (asserted) and node indices inside
            // each tree (compiled child indices).
            TreeKernel::Avx2 => unsafe { simd::avx2(self, x, stride, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX-512 F.
            TreeKernel::Avx512 => unsafe { simd::avx512(self, x, stride, rows, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => 0,
        };
        #[cfg(target_arch = "x86_64")]
        if self.kernel != TreeKernel::Scalar {
            // Fewer rows than a vector: eight trees to a vector instead.
            for r in done..rows {
                // SAFETY: every SIMD kernel's CPU has AVX2 (AVX-512 F
                // machines all do); row r's features are inside `x`.
                out[r] = unsafe { simd::row_avx2(self, &x[r * stride..]) };
            }
            return;
        }
        self.scalar(x, stride, done, rows, out);
    }

    /// Rows `from..rows`, up to eight at a time, four trees at a time.
    fn scalar(&self, x: &[f32], stride: usize, from: usize, rows: usize, out: &mut [f32]) {
        const R: usize = 8;
        const T: usize = 4;
        let mut r0 = from;
        while r0 < rows {
            let n = (rows - r0).min(R);
            let mut acc = [self.base; R];
            for group in self.trees.chunks(T) {
                let mut idx = [[0u32; R]; T];
                let depth = group.iter().map(|t| t.depth).max().unwrap_or(0);
                for _ in 0..depth {
                    for (tree, idx) in group.iter().zip(idx.iter_mut()) {
                        for (r, i) in idx.iter_mut().enumerate().take(n) {
                            *i = self.step(tree, *i, &x[(r0 + r) * stride..]);
                        }
                    }
                }
                for (tree, idx) in group.iter().zip(&idx) {
                    for r in 0..n {
                        acc[r] += self.leaf[(tree.root + idx[r]) as usize];
                    }
                }
            }
            out[r0..r0 + n].copy_from_slice(&acc[..n]);
            r0 += n;
        }
    }

    /// The node after `i` (within `tree`) for `row`.
    #[inline(always)]
    fn step(&self, tree: &Tree, i: u32, row: &[f32]) -> u32 {
        let at = (tree.root + i) as usize;
        let meta = self.meta[at];
        let x = row[((meta >> FEATURE_SHIFT) & FEATURE_MASK) as usize];
        let right = if tree.categorical && meta & CATEGORICAL != 0 {
            !self.category_left(at, x)
        } else {
            let missing = x.is_nan() || (meta & ZERO_MISSING != 0 && x.abs() <= ZERO_THRESHOLD);
            if missing {
                meta & MISSING_RIGHT != 0
            } else {
                x > self.threshold[at]
            }
        };
        (meta & CHILD_MASK) + right as u32
    }

    fn category_left(&self, at: usize, x: f32) -> bool {
        let (start, len) = self.cat_range[at];
        match category(x) {
            Some(c) => {
                let w = (c / 32) as usize;
                w < len as usize && (self.cat_words[start as usize + w] >> (c % 32)) & 1 == 1
            }
            None => false,
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::trees::{Ensemble, TreeNode};
    use crate::seeded::SplitMix64;

    /// A random ensemble over `width` features: unbalanced trees of mixed
    /// depth, every missing-value rule, and categorical splits of 1 to
    /// `cat_words` bitset words (none for 0).
    pub(crate) fn random_ensemble(seed: u64, trees: usize, depth: usize, width: usize, cat_words: u64) -> Ensemble {
        let mut rng = SplitMix64::new(seed);
        let mut e = Ensemble { base: rng.normal() * 0.1, ..Ensemble::default() };
        for _ in 0..trees {
            let mut nodes: Vec<TreeNode> = Vec::new();
            // (node index, depth) of open leaves to split.
            let mut open = vec![(0usize, 0usize)];
            nodes.push(TreeNode::leaf(0.0));
            while let Some((i, d)) = open.pop() {
                if d >= depth || (d > 1 && rng.below(5) == 0) {
                    nodes[i] = TreeNode::leaf(rng.normal() * 0.3);
                    continue;
                }
                let feature = (rng.next_u64() % width as u64) as u32;
                let split = if cat_words > 0 && rng.below(4) == 0 {
                    let words: Vec<u32> = (0..1 + rng.below(cat_words)).map(|_| rng.next_u64() as u32).collect();
                    let (start, len) = e.push_words(&words);
                    Split::Categorical { feature, start, len }
                } else {
                    Split::Numeric {
                        feature,
                        threshold: rng.normal(),
                        missing_left: rng.below(2) == 0,
                        zero_missing: rng.below(6) == 0,
                    }
                };
                let (l, r) = (nodes.len(), nodes.len() + 1);
                nodes.push(TreeNode::leaf(0.0));
                nodes.push(TreeNode::leaf(0.0));
                nodes[i] = TreeNode { split, left: l as u32, right: r as u32 };
                open.push((l, d + 1));
                open.push((r, d + 1));
            }
            e.push_tree(&nodes);
        }
        e
    }

    fn rows(seed: u64, n: usize, width: usize) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n * width)
            .map(|_| match rng.next_u64() % 10 {
                0 => f32::NAN,
                1 => 0.0,
                2 => (rng.next_u64() % 70) as f32,
                3 => -((rng.next_u64() % 3) as f32) - 0.5,
                _ => rng.normal(),
            })
            .collect()
    }

    #[test]
    fn every_kernel_computes_the_specification_bit_for_bit() {
        // Bitsets of one word take the AVX2 build's in-register test.
        for (seed, cats) in [(1, 0), (2, 3), (3, 3), (4, 1), (5, 1)] {
            let width = 13;
            let e = random_ensemble(seed, 40, 7, width, cats);
            e.validate(width).unwrap();
            let stride = width + 3;
            for n in [1, 7, 8, 9, 16, 31, 32, 33, 64, 77] {
                let x = rows(seed * 100 + n as u64, n, stride);
                let want: Vec<f32> = x.chunks_exact(stride).map(|r| e.predict_row(r)).collect();
                for k in TreeKernel::ALL {
                    let Some(c) = CompiledTrees::with_kernel(&e, k) else { continue };
                    let mut got = vec![0.0; n];
                    c.eval(&x, stride, n, &mut got);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} rows {n} cats {cats}: {got:?} vs {want:?}", k.name());
                }
            }
        }
    }

    #[test]
    fn a_lone_leaf_tree_adds_its_value() {
        let mut e = Ensemble { base: 1.0, ..Ensemble::default() };
        e.push_tree(&[TreeNode::leaf(0.5)]);
        for k in TreeKernel::ALL {
            let Some(c) = CompiledTrees::with_kernel(&e, k) else { continue };
            let mut out = vec![0.0; 20];
            c.eval(&[0.0; 20], 1, 20, &mut out);
            assert!(out.iter().all(|v| *v == 1.5), "{}", k.name());
        }
    }
}
