//! The CPU evaluator of tree ensembles (`model::trees`), built for a batch
//! of a few dozen candidates.
//!
//! Layout: every tree is re-laid so that a split's two children are
//! adjacent (`right = left + 1`) and a leaf loops to itself (threshold
//! +inf, missing goes left), so a row's next node is `child[i] + right`
//! with no branch, and every row of a tree walks exactly the tree's depth
//! in steps: rows that reach a leaf early stay on it. Three arrays per node
//! (threshold, feature with flags, left child), indexed by one global node
//! number, so the SIMD builds gather a step of 8 (AVX2) or 16 (AVX-512)
//! rows at once and keep up to four such vectors in flight per tree to hide
//! the gathers' latency. The scalar build runs the same steps on eight rows
//! at a time. Measured against per-tree branchy traversal (the lleaves
//! design) by `bench/trees_side_by_side.py`.
//!
//! Every build computes `Ensemble::predict_row` bit for bit: the base, then
//! each tree's leaf added in f32 in tree order. Trees with categorical
//! splits take the numeric step for all lanes and then redo the lanes that
//! sit on a categorical split in scalar code.

use crate::model::trees::{category, Ensemble, Split, ZERO_THRESHOLD};

const FEATURE_MASK: u32 = (1 << 24) - 1;
const ZERO_MISSING: u32 = 1 << 28;
const CATEGORICAL: u32 = 1 << 29;
const MISSING_RIGHT: u32 = 1 << 30;

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

    pub fn best() -> TreeKernel {
        [TreeKernel::Avx512, TreeKernel::Avx2].into_iter().find(|k| k.available()).unwrap_or(TreeKernel::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            TreeKernel::Scalar => "scalar",
            TreeKernel::Avx2 => "avx2",
            TreeKernel::Avx512 => "avx512",
        }
    }
}

struct Tree {
    root: u32,
    depth: u32,
    categorical: bool,
}

/// An ensemble compiled for evaluation: see the module header.
pub struct CompiledTrees {
    kernel: TreeKernel,
    threshold: Vec<f32>,
    meta: Vec<u32>,
    child: Vec<u32>,
    leaf: Vec<f32>,
    /// Per node: the bitset `(start, len)` of a categorical split.
    cat_range: Vec<(u32, u32)>,
    cat_words: Vec<u32>,
    trees: Vec<Tree>,
    base: f32,
    zero_missing: bool,
    /// The feature columns read must lie below this.
    width_min: usize,
}

impl CompiledTrees {
    /// Compiles a validated ensemble for the best build this CPU runs.
    pub fn new(e: &Ensemble) -> CompiledTrees {
        CompiledTrees::with_kernel(e, TreeKernel::best()).expect("the best kernel is available")
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
            child: Vec::with_capacity(n),
            leaf: Vec::with_capacity(n),
            cat_range: Vec::new(),
            cat_words: e.cat_words.clone(),
            trees: Vec::with_capacity(e.trees()),
            base: e.base,
            zero_missing: false,
            width_min: e.features_used().last().map_or(0, |f| *f as usize + 1),
        };
        let any_cat = e.has_categorical();
        for t in 0..e.trees() {
            let tree = e.tree(t);
            let root = c.threshold.len() as u32;
            // Breadth-first, children placed side by side as their parent is
            // placed: `order[k]` is the tree node at compiled slot root + k.
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
                let here = root + k as u32;
                let (thr, meta, child, leaf, range) = match node.split {
                    Split::Leaf { value } => (f32::INFINITY, 0, here, value, (0, 0)),
                    Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                        c.zero_missing |= zero_missing;
                        let meta = feature
                            | if zero_missing { ZERO_MISSING } else { 0 }
                            | if missing_left { 0 } else { MISSING_RIGHT };
                        (threshold, meta, root + slot[node.left as usize], 0.0, (0, 0))
                    }
                    Split::Categorical { feature, start, len } => {
                        categorical = true;
                        // The numeric step's answer is replaced for these lanes.
                        (f32::INFINITY, feature | CATEGORICAL, root + slot[node.left as usize], 0.0, (start, len))
                    }
                };
                c.threshold.push(thr);
                c.meta.push(meta);
                c.child.push(child);
                c.leaf.push(leaf);
                if any_cat {
                    c.cat_range.push(range);
                }
            }
            c.trees.push(Tree { root, depth: e.depth(t) as u32, categorical });
        }
        Some(c)
    }

    pub fn kernel(&self) -> TreeKernel {
        self.kernel
    }

    /// `out[r]` = the ensemble's value for row `r` of `x` (`rows` rows of
    /// `stride` floats).
    pub fn eval(&self, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) {
        // The last row may end at its last column read: `x` can be a window
        // into a wider input vector.
        let needed = if rows == 0 { 0 } else { (rows - 1) * stride + self.width_min };
        assert!(stride >= self.width_min && x.len() >= needed && out.len() >= rows);
        assert!(rows * stride <= i32::MAX as usize, "gather offsets are 32-bit");
        let done = match self.kernel {
            TreeKernel::Scalar => 0,
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `with_kernel` checked that the CPU has AVX2; offsets
            // stay inside `x` (rows * stride, asserted) and the node arrays
            // (compiled child indices).
            TreeKernel::Avx2 => unsafe { simd::avx2(self, x, stride, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX-512 F.
            TreeKernel::Avx512 => unsafe { simd::avx512(self, x, stride, rows, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => 0,
        };
        self.scalar(x, stride, done, rows, out);
    }

    /// Rows `from..rows`, eight at a time.
    fn scalar(&self, x: &[f32], stride: usize, from: usize, rows: usize, out: &mut [f32]) {
        const R: usize = 8;
        let mut r0 = from;
        while r0 < rows {
            let n = (rows - r0).min(R);
            let mut acc = [self.base; R];
            for tree in &self.trees {
                let mut idx = [tree.root; R];
                for _ in 0..tree.depth {
                    for (r, i) in idx.iter_mut().enumerate().take(n) {
                        *i = self.step(*i, &x[(r0 + r) * stride..], tree.categorical);
                    }
                }
                for r in 0..n {
                    acc[r] += self.leaf[idx[r] as usize];
                }
            }
            out[r0..r0 + n].copy_from_slice(&acc[..n]);
            r0 += n;
        }
    }

    #[inline(always)]
    fn step(&self, i: u32, row: &[f32], categorical: bool) -> u32 {
        let i = i as usize;
        let meta = self.meta[i];
        let x = row[(meta & FEATURE_MASK) as usize];
        let right = if categorical && meta & CATEGORICAL != 0 {
            !self.category_left(i, x)
        } else {
            let missing = x.is_nan() || (meta & ZERO_MISSING != 0 && x.abs() <= ZERO_THRESHOLD);
            if missing {
                meta & MISSING_RIGHT != 0
            } else {
                x > self.threshold[i]
            }
        };
        self.child[i] + right as u32
    }

    fn category_left(&self, i: usize, x: f32) -> bool {
        let (start, len) = self.cat_range[i];
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
mod simd {
    use std::arch::x86_64::*;

    use super::{CompiledTrees, FEATURE_MASK, ZERO_MISSING};
    use crate::model::trees::ZERO_THRESHOLD;

    /// Redoes the lanes in `lanes` (a bit per lane) that stood on a
    /// categorical split: `cur` the nodes before the step, `next` after.
    fn fix_categorical<const L: usize>(
        c: &CompiledTrees,
        x: &[f32],
        stride: usize,
        row0: usize,
        cur: &[u32; L],
        next: &mut [u32; L],
        lanes: u32,
    ) {
        for (l, n) in next.iter_mut().enumerate() {
            if lanes & (1 << l) != 0 {
                let i = cur[l] as usize;
                let v = x[(row0 + l) * stride + (c.meta[i] & FEATURE_MASK) as usize];
                *n = c.child[i] + !c.category_left(i, v) as u32;
            }
        }
    }

    /// Evaluates whole groups of 8 rows; returns how many rows it did.
    ///
    /// # Safety
    /// The CPU has AVX2; `x` holds `rows * stride` floats and every feature
    /// the trees read is below `stride` (`CompiledTrees::eval` asserts both).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(c: &CompiledTrees, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) -> usize {
        let mut r0 = 0;
        while rows - r0 >= 8 {
            let groups = ((rows - r0) / 8).min(4);
            // SAFETY: rows r0..r0 + 8 * groups are in `x` and `out`.
            unsafe {
                match groups {
                    4 => block_avx2::<4>(c, x, stride, r0, out),
                    3 => block_avx2::<3>(c, x, stride, r0, out),
                    2 => block_avx2::<2>(c, x, stride, r0, out),
                    _ => block_avx2::<1>(c, x, stride, r0, out),
                }
            }
            r0 += 8 * groups;
        }
        r0
    }

    /// # Safety
    /// As `avx2`, and rows `r0..r0 + 8N` exist.
    #[target_feature(enable = "avx2")]
    unsafe fn block_avx2<const N: usize>(c: &CompiledTrees, x: &[f32], stride: usize, r0: usize, out: &mut [f32]) {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let stride_v = _mm256_set1_epi32(stride as i32);
        let mut rowbase = [_mm256_setzero_si256(); N];
        for (v, b) in rowbase.iter_mut().enumerate() {
            let first = _mm256_set1_epi32((r0 + 8 * v) as i32);
            *b = _mm256_mullo_epi32(_mm256_add_epi32(first, lane), stride_v);
        }
        let (thr_p, meta_p, child_p, leaf_p) =
            (c.threshold.as_ptr(), c.meta.as_ptr() as *const i32, c.child.as_ptr() as *const i32, c.leaf.as_ptr());
        let xp = x.as_ptr();
        let feature_mask = _mm256_set1_epi32(FEATURE_MASK as i32);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let tiny = _mm256_set1_ps(ZERO_THRESHOLD);
        let mut acc = [_mm256_set1_ps(c.base); N];
        for tree in &c.trees {
            let mut idx = [_mm256_set1_epi32(tree.root as i32); N];
            for _ in 0..tree.depth {
                for v in 0..N {
                    let cur = idx[v];
                    // SAFETY: `cur` holds compiled node indices, in bounds of
                    // the node arrays; feature offsets lie inside `x`.
                    let (meta, thr, child, xv) = unsafe {
                        let meta = _mm256_i32gather_epi32::<4>(meta_p, cur);
                        let thr = _mm256_i32gather_ps::<4>(thr_p, cur);
                        let child = _mm256_i32gather_epi32::<4>(child_p, cur);
                        let off = _mm256_add_epi32(rowbase[v], _mm256_and_si256(meta, feature_mask));
                        (meta, thr, child, _mm256_i32gather_ps::<4>(xp, off))
                    };
                    let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(xv, thr);
                    let mut missing = _mm256_cmp_ps::<_CMP_UNORD_Q>(xv, xv);
                    if c.zero_missing {
                        // Bit 28 of meta to the sign, spread over the lane.
                        let zm = _mm256_castsi256_ps(_mm256_srai_epi32::<31>(_mm256_slli_epi32::<3>(meta)));
                        let small = _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_and_ps(xv, abs_mask), tiny);
                        missing = _mm256_or_ps(missing, _mm256_and_ps(zm, small));
                    }
                    // Bit 30: missing goes right.
                    let mr = _mm256_castsi256_ps(_mm256_srai_epi32::<31>(_mm256_slli_epi32::<1>(meta)));
                    let right = _mm256_castps_si256(_mm256_blendv_ps(gt, mr, missing));
                    // right is all ones (-1) or 0.
                    idx[v] = _mm256_sub_epi32(child, right);
                    if tree.categorical {
                        // Bit 29: categorical.
                        let lanes = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<2>(meta))) as u32;
                        if lanes != 0 {
                            let (mut cur_a, mut next_a) = ([0u32; 8], [0u32; 8]);
                            // SAFETY: 8 lanes to and from 8-element arrays.
                            unsafe {
                                _mm256_storeu_si256(cur_a.as_mut_ptr() as *mut __m256i, cur);
                                _mm256_storeu_si256(next_a.as_mut_ptr() as *mut __m256i, idx[v]);
                            }
                            fix_categorical(c, x, stride, r0 + 8 * v, &cur_a, &mut next_a, lanes);
                            // SAFETY: as above.
                            idx[v] = unsafe { _mm256_loadu_si256(next_a.as_ptr() as *const __m256i) };
                        }
                    }
                }
            }
            for v in 0..N {
                // SAFETY: leaf indices are compiled node indices.
                acc[v] = _mm256_add_ps(acc[v], unsafe { _mm256_i32gather_ps::<4>(leaf_p, idx[v]) });
            }
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: rows r0 + 8v .. r0 + 8v + 8 are in `out`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r0 + 8 * v), *a) };
        }
    }

    /// `avx2` with 16 rows a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; otherwise as `avx2`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(c: &CompiledTrees, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) -> usize {
        let mut r0 = 0;
        while rows - r0 >= 16 {
            let groups = ((rows - r0) / 16).min(4);
            // SAFETY: rows r0..r0 + 16 * groups are in `x` and `out`.
            unsafe {
                match groups {
                    4 => block_avx512::<4>(c, x, stride, r0, out),
                    3 => block_avx512::<3>(c, x, stride, r0, out),
                    2 => block_avx512::<2>(c, x, stride, r0, out),
                    _ => block_avx512::<1>(c, x, stride, r0, out),
                }
            }
            r0 += 16 * groups;
        }
        if rows - r0 >= 8 {
            // SAFETY: the CPU has AVX-512 F, hence AVX2; rows r0..r0 + 8 exist.
            unsafe { block_avx2_from_avx512(c, x, stride, r0, out) };
            r0 += 8;
        }
        r0
    }

    #[target_feature(enable = "avx2")]
    unsafe fn block_avx2_from_avx512(c: &CompiledTrees, x: &[f32], stride: usize, r0: usize, out: &mut [f32]) {
        // SAFETY: the caller's contract.
        unsafe { block_avx2::<1>(c, x, stride, r0, out) }
    }

    /// # Safety
    /// As `avx512`, and rows `r0..r0 + 16N` exist.
    #[target_feature(enable = "avx512f")]
    unsafe fn block_avx512<const N: usize>(c: &CompiledTrees, x: &[f32], stride: usize, r0: usize, out: &mut [f32]) {
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let stride_v = _mm512_set1_epi32(stride as i32);
        let mut rowbase = [_mm512_setzero_si512(); N];
        for (v, b) in rowbase.iter_mut().enumerate() {
            let first = _mm512_set1_epi32((r0 + 16 * v) as i32);
            *b = _mm512_mullo_epi32(_mm512_add_epi32(first, lane), stride_v);
        }
        let (thr_p, meta_p, child_p, leaf_p) =
            (c.threshold.as_ptr(), c.meta.as_ptr() as *const i32, c.child.as_ptr() as *const i32, c.leaf.as_ptr());
        let xp = x.as_ptr();
        let feature_mask = _mm512_set1_epi32(FEATURE_MASK as i32);
        let tiny = _mm512_set1_ps(ZERO_THRESHOLD);
        let zero_bit = _mm512_set1_epi32(ZERO_MISSING as i32);
        let cat_bit = _mm512_set1_epi32(super::CATEGORICAL as i32);
        let right_bit = _mm512_set1_epi32(super::MISSING_RIGHT as i32);
        let one = _mm512_set1_epi32(1);
        let mut acc = [_mm512_set1_ps(c.base); N];
        for tree in &c.trees {
            let mut idx = [_mm512_set1_epi32(tree.root as i32); N];
            for _ in 0..tree.depth {
                for v in 0..N {
                    let cur = idx[v];
                    // SAFETY: as in `block_avx2`.
                    let (meta, thr, child, xv) = unsafe {
                        let meta = _mm512_i32gather_epi32::<4>(cur, meta_p);
                        let thr = _mm512_i32gather_ps::<4>(cur, thr_p);
                        let child = _mm512_i32gather_epi32::<4>(cur, child_p);
                        let off = _mm512_add_epi32(rowbase[v], _mm512_and_si512(meta, feature_mask));
                        (meta, thr, child, _mm512_i32gather_ps::<4>(off, xp))
                    };
                    let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xv, thr);
                    let mut missing = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(xv, xv);
                    if c.zero_missing {
                        let small = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_abs_ps(xv), tiny);
                        missing |= small & _mm512_test_epi32_mask(meta, zero_bit);
                    }
                    let mr = _mm512_test_epi32_mask(meta, right_bit);
                    let right = (gt & !missing) | (mr & missing);
                    idx[v] = _mm512_mask_add_epi32(child, right, child, one);
                    if tree.categorical {
                        let lanes = _mm512_test_epi32_mask(meta, cat_bit) as u32;
                        if lanes != 0 {
                            let (mut cur_a, mut next_a) = ([0u32; 16], [0u32; 16]);
                            // SAFETY: 16 lanes to and from 16-element arrays.
                            unsafe {
                                _mm512_storeu_si512(cur_a.as_mut_ptr() as *mut __m512i, cur);
                                _mm512_storeu_si512(next_a.as_mut_ptr() as *mut __m512i, idx[v]);
                            }
                            fix_categorical(c, x, stride, r0 + 16 * v, &cur_a, &mut next_a, lanes);
                            // SAFETY: as above.
                            idx[v] = unsafe { _mm512_loadu_si512(next_a.as_ptr() as *const __m512i) };
                        }
                    }
                }
            }
            for v in 0..N {
                // SAFETY: leaf indices are compiled node indices.
                acc[v] = _mm512_add_ps(acc[v], unsafe { _mm512_i32gather_ps::<4>(idx[v], leaf_p) });
            }
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: rows r0 + 16v .. r0 + 16v + 16 are in `out`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r0 + 16 * v), *a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::trees::{Ensemble, TreeNode};
    use crate::seeded::SplitMix64;

    /// A random ensemble over `width` features: unbalanced trees of mixed
    /// depth, every missing-value rule, categorical splits if asked.
    pub(crate) fn random_ensemble(seed: u64, trees: usize, depth: usize, width: usize, cats: bool) -> Ensemble {
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
                let split = if cats && rng.below(4) == 0 {
                    let words: Vec<u32> = (0..1 + rng.next_u64() % 3).map(|_| rng.next_u64() as u32).collect();
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
        for (seed, cats) in [(1, false), (2, true), (3, true)] {
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
