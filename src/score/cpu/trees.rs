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
mod simd {
    use std::arch::x86_64::*;

    use super::{CompiledTrees, Tree, CATEGORICAL, CHILD_MASK, FEATURE_MASK, FEATURE_SHIFT, ZERO_MISSING};
    use crate::model::trees::ZERO_THRESHOLD;

    /// Trees walked together by the SIMD builds, per count of row vectors:
    /// eight chains of gathers in flight either way.
    const fn trees_in_flight(vectors: usize) -> usize {
        8 / vectors
    }

    /// Redoes the lanes in `lanes` (a bit per lane) that stood on a
    /// categorical split: `cur` the nodes before the step, `next` after;
    /// `x` starts at the first lane's row.
    fn fix_categorical<const L: usize>(
        c: &CompiledTrees,
        tree: &Tree,
        x: &[f32],
        stride: usize,
        cur: &[u32; L],
        next: &mut [u32; L],
        lanes: u32,
    ) {
        for (l, n) in next.iter_mut().enumerate() {
            if lanes & (1 << l) != 0 {
                let at = (tree.root + cur[l]) as usize;
                let meta = c.meta[at];
                let v = x[l * stride + ((meta >> FEATURE_SHIFT) & FEATURE_MASK) as usize];
                *n = (meta & CHILD_MASK) + !c.category_left(at, v) as u32;
            }
        }
    }

    /// One row, eight trees to a vector (each lane its own tree), four
    /// vectors in flight; the leaves are added in tree order.
    ///
    /// # Safety
    /// The CPU has AVX2; `row` holds every feature the trees read.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn row_avx2(c: &CompiledTrees, row: &[f32]) -> f32 {
        const G: usize = 4;
        let (meta_p, thr_p, leaf_p) = (c.meta.as_ptr() as *const i32, c.threshold.as_ptr(), c.leaf.as_ptr());
        let feature_mask = _mm256_set1_epi32(FEATURE_MASK as i32);
        let child_mask = _mm256_set1_epi32(CHILD_MASK as i32);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let tiny = _mm256_set1_ps(ZERO_THRESHOLD);
        let mut acc = c.base;
        let trees = &c.trees;
        let whole = trees.len() / 8 * 8;
        let mut t0 = 0;
        while t0 < whole {
            let groups = ((whole - t0) / 8).min(G);
            let mut roots = [_mm256_setzero_si256(); G];
            let mut idx = [_mm256_setzero_si256(); G];
            let mut depth = 0;
            for g in 0..groups {
                let r: [i32; 8] = std::array::from_fn(|l| trees[t0 + 8 * g + l].root as i32);
                // SAFETY: eight lanes from an eight-element array.
                roots[g] = unsafe { _mm256_loadu_si256(r.as_ptr() as *const __m256i) };
                idx[g] = roots[g];
                depth = depth.max(trees[t0 + 8 * g..t0 + 8 * g + 8].iter().map(|t| t.depth).max().unwrap_or(0));
            }
            for _ in 0..depth {
                for g in 0..groups {
                    let cur = idx[g];
                    // SAFETY: `cur` holds each lane's tree's node indices;
                    // features are inside `row`.
                    let (meta, thr, xv) = unsafe {
                        let meta = _mm256_i32gather_epi32::<4>(meta_p, cur);
                        let thr = _mm256_i32gather_ps::<4>(thr_p, cur);
                        let feature = _mm256_and_si256(_mm256_srli_epi32::<15>(meta), feature_mask);
                        (meta, thr, _mm256_i32gather_ps::<4>(row.as_ptr(), feature))
                    };
                    let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(xv, thr);
                    let mut missing = _mm256_cmp_ps::<_CMP_UNORD_Q>(xv, xv);
                    if c.zero_missing {
                        let zm = _mm256_castsi256_ps(_mm256_srai_epi32::<31>(_mm256_slli_epi32::<2>(meta)));
                        let small = _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_and_ps(xv, abs_mask), tiny);
                        missing = _mm256_or_ps(missing, _mm256_and_ps(zm, small));
                    }
                    let right = _mm256_blendv_ps(gt, _mm256_castsi256_ps(meta), missing);
                    let right = _mm256_srai_epi32::<31>(_mm256_castps_si256(right));
                    let mut rel = _mm256_sub_epi32(_mm256_and_si256(meta, child_mask), right);
                    if c.cat_inline {
                        rel = categorical_avx2(meta, xv, thr, rel, child_mask);
                    }
                    idx[g] = _mm256_add_epi32(roots[g], rel);
                    let lanes = if c.cat_inline {
                        0
                    } else {
                        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<1>(meta))) as u32
                    };
                    if lanes != 0 {
                        let (mut cur_a, mut next_a) = ([0u32; 8], [0u32; 8]);
                        // SAFETY: 8 lanes to and from 8-element arrays.
                        unsafe {
                            _mm256_storeu_si256(cur_a.as_mut_ptr() as *mut __m256i, cur);
                            _mm256_storeu_si256(next_a.as_mut_ptr() as *mut __m256i, idx[g]);
                        }
                        for (l, n) in next_a.iter_mut().enumerate() {
                            if lanes & (1 << l) != 0 {
                                let at = cur_a[l] as usize;
                                let tree = &trees[t0 + 8 * g + l];
                                let m = c.meta[at];
                                let v = row[((m >> FEATURE_SHIFT) & FEATURE_MASK) as usize];
                                *n = tree.root + (m & CHILD_MASK) + !c.category_left(at, v) as u32;
                            }
                        }
                        // SAFETY: as above.
                        idx[g] = unsafe { _mm256_loadu_si256(next_a.as_ptr() as *const __m256i) };
                    }
                }
            }
            for i in idx.iter().take(groups) {
                let mut leaves = [0.0f32; 8];
                // SAFETY: leaf indices are compiled node indices; 8 lanes
                // to an 8-element array.
                unsafe { _mm256_storeu_ps(leaves.as_mut_ptr(), _mm256_i32gather_ps::<4>(leaf_p, *i)) };
                for v in leaves {
                    acc += v;
                }
            }
            t0 += 8 * groups;
        }
        for tree in &trees[whole..] {
            let mut i = 0;
            for _ in 0..tree.depth {
                i = c.step(tree, i, row);
            }
            acc += c.leaf[(tree.root + i) as usize];
        }
        acc
    }

    /// The entries `idx` selects from the table at `p`, for a step that
    /// stays below node 2^(step + 1) - 1 (at most 63): permutes of 8-entry
    /// registers, blended on the index's bits 3 to 5, instead of a gather
    /// (measured 20% faster than gathering on 100 trees of depth 6).
    ///
    /// # Safety
    /// The CPU has AVX2; `p` is followed by at least 64 readable floats.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn top_avx2(p: *const f32, idx: __m256i, step: u32) -> __m256i {
        // SAFETY: the caller's contract (TOP_NODES entries after every root).
        let load = |k: usize| unsafe { _mm256_castps_si256(_mm256_loadu_ps(p.add(8 * k))) };
        let pick = |t: __m256i| _mm256_permutevar8x32_epi32(t, idx);
        let blend = |a: __m256i, b: __m256i, bit_to_sign: __m256i| {
            _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(a),
                _mm256_castsi256_ps(b),
                _mm256_castsi256_ps(bit_to_sign),
            ))
        };
        let lo = pick(load(0));
        if step < 3 {
            return lo;
        }
        let b3 = _mm256_slli_epi32::<28>(idx);
        let first16 = blend(lo, pick(load(1)), b3);
        if step < 4 {
            return first16;
        }
        let b4 = _mm256_slli_epi32::<27>(idx);
        let second16 = blend(pick(load(2)), pick(load(3)), b3);
        let first32 = blend(first16, second16, b4);
        if step < 5 {
            return first32;
        }
        let third16 = blend(pick(load(4)), pick(load(5)), b3);
        let fourth16 = blend(pick(load(6)), pick(load(7)), b3);
        blend(first32, blend(third16, fourth16, b4), _mm256_slli_epi32::<26>(idx))
    }

    /// `next` with the lanes that stood on a categorical split (meta bit
    /// 30) redone in registers: left iff `x` truncates to a category
    /// `0 <= c < 32` whose bit is set in the one-word bitset held in `thr`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn categorical_avx2(meta: __m256i, xv: __m256, thr: __m256, next: __m256i, child_mask: __m256i) -> __m256i {
        let is_cat = _mm256_srai_epi32::<31>(_mm256_slli_epi32::<1>(meta));
        // NaN compares false, so it is out of range (goes right).
        let in_range = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(xv, _mm256_set1_ps(-1.0)),
            _mm256_cmp_ps::<_CMP_LT_OQ>(xv, _mm256_set1_ps(32.0)),
        );
        // Truncation toward zero: (-1, 0) is category 0.
        let category = _mm256_cvttps_epi32(xv);
        let bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_castps_si256(thr), category), _mm256_set1_epi32(1));
        let left = _mm256_and_si256(_mm256_castps_si256(in_range), _mm256_cmpeq_epi32(bit, _mm256_set1_epi32(1)));
        // right = 1 unless left.
        let cat_next =
            _mm256_add_epi32(_mm256_and_si256(meta, child_mask), _mm256_andnot_si256(left, _mm256_set1_epi32(1)));
        _mm256_blendv_epi8(next, cat_next, is_cat)
    }

    /// Evaluates whole groups of 8 rows; returns how many rows it did.
    ///
    /// # Safety
    /// The CPU has AVX2; `x` holds every row's features (`CompiledTrees::eval`
    /// asserts it).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(c: &CompiledTrees, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) -> usize {
        let mut r0 = 0;
        while rows - r0 >= 8 {
            let groups = ((rows - r0) / 8).min(4);
            // SAFETY: rows r0..r0 + 8 * groups are in `x` and `out`.
            unsafe {
                match groups {
                    4 => rows_avx2::<4, { trees_in_flight(4) }>(c, x, stride, r0, out),
                    3 => rows_avx2::<2, { trees_in_flight(2) }>(c, x, stride, r0, out),
                    2 => rows_avx2::<2, { trees_in_flight(2) }>(c, x, stride, r0, out),
                    _ => rows_avx2::<1, { trees_in_flight(1) }>(c, x, stride, r0, out),
                }
            }
            r0 += 8 * if groups == 3 { 2 } else { groups };
        }
        r0
    }

    /// Rows `r0..r0 + 8V`, `T` trees at a time.
    ///
    /// # Safety
    /// As `avx2`, and those rows exist.
    #[target_feature(enable = "avx2")]
    unsafe fn rows_avx2<const V: usize, const T: usize>(
        c: &CompiledTrees,
        x: &[f32],
        stride: usize,
        r0: usize,
        out: &mut [f32],
    ) {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let stride_v = _mm256_set1_epi32(stride as i32);
        let mut rowbase = [_mm256_setzero_si256(); V];
        for (v, b) in rowbase.iter_mut().enumerate() {
            let first = _mm256_set1_epi32((r0 + 8 * v) as i32);
            *b = _mm256_mullo_epi32(_mm256_add_epi32(first, lane), stride_v);
        }
        let mut acc = [_mm256_set1_ps(c.base); V];
        let mut trees = c.trees.chunks_exact(T);
        for group in &mut trees {
            // SAFETY: the caller's contract.
            unsafe { group_avx2::<V, T>(c, group, x, stride, r0, &rowbase, &mut acc) };
        }
        for tree in trees.remainder().chunks(1) {
            // SAFETY: as above.
            unsafe { group_avx2::<V, 1>(c, tree, x, stride, r0, &rowbase, &mut acc) };
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: rows r0 + 8v .. r0 + 8v + 8 are in `out`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(r0 + 8 * v), *a) };
        }
    }

    /// Walks the `T` trees of `group` for `V` row vectors and adds their
    /// leaves to `acc` in tree order.
    ///
    /// # Safety
    /// As `rows_avx2`; `group` holds `T` trees.
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group_avx2<const V: usize, const T: usize>(
        c: &CompiledTrees,
        group: &[Tree],
        x: &[f32],
        stride: usize,
        r0: usize,
        rowbase: &[__m256i; V],
        acc: &mut [__m256; V],
    ) {
        let xp = x.as_ptr();
        let feature_mask = _mm256_set1_epi32(FEATURE_MASK as i32);
        let child_mask = _mm256_set1_epi32(CHILD_MASK as i32);
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let tiny = _mm256_set1_ps(ZERO_THRESHOLD);
        let mut idx = [[_mm256_setzero_si256(); V]; T];
        let depth = group.iter().map(|t| t.depth).max().unwrap_or(0);
        for step in 0..depth {
            for t in 0..T {
                let tree = &group[t];
                // SAFETY: a tree's nodes lie at root.. in the node arrays,
                // followed by at least TOP_NODES more entries.
                let (meta_p, thr_p) = unsafe {
                    (
                        c.meta.as_ptr().add(tree.root as usize) as *const i32,
                        c.threshold.as_ptr().add(tree.root as usize),
                    )
                };
                for v in 0..V {
                    let cur = idx[t][v];
                    // SAFETY: `cur` holds node indices within the tree
                    // (below 63 for the first six steps); feature offsets
                    // lie inside `x`.
                    let (meta, thr, xv) = unsafe {
                        let (meta, thr) = if step < 6 {
                            let m = _mm256_castsi256_ps(top_avx2(meta_p as *const f32, cur, step));
                            (_mm256_castps_si256(m), _mm256_castsi256_ps(top_avx2(thr_p, cur, step)))
                        } else {
                            (_mm256_i32gather_epi32::<4>(meta_p, cur), _mm256_i32gather_ps::<4>(thr_p, cur))
                        };
                        let feature = _mm256_and_si256(_mm256_srli_epi32::<15>(meta), feature_mask);
                        (meta, thr, _mm256_i32gather_ps::<4>(xp, _mm256_add_epi32(rowbase[v], feature)))
                    };
                    let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(xv, thr);
                    let mut missing = _mm256_cmp_ps::<_CMP_UNORD_Q>(xv, xv);
                    if c.zero_missing {
                        // Bit 29 to the sign, spread over the lane.
                        let zm = _mm256_castsi256_ps(_mm256_srai_epi32::<31>(_mm256_slli_epi32::<2>(meta)));
                        let small = _mm256_cmp_ps::<_CMP_LE_OQ>(_mm256_and_ps(xv, abs_mask), tiny);
                        missing = _mm256_or_ps(missing, _mm256_and_ps(zm, small));
                    }
                    // Missing lanes take meta's sign bit (missing goes right).
                    let right = _mm256_blendv_ps(gt, _mm256_castsi256_ps(meta), missing);
                    let right = _mm256_srai_epi32::<31>(_mm256_castps_si256(right));
                    // right is all ones (-1) or 0.
                    idx[t][v] = _mm256_sub_epi32(_mm256_and_si256(meta, child_mask), right);
                    if tree.categorical && c.cat_inline {
                        idx[t][v] = categorical_avx2(meta, xv, thr, idx[t][v], child_mask);
                    } else if tree.categorical {
                        // Bit 30: categorical.
                        let lanes = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<1>(meta))) as u32;
                        if lanes != 0 {
                            let (mut cur_a, mut next_a) = ([0u32; 8], [0u32; 8]);
                            // SAFETY: 8 lanes to and from 8-element arrays.
                            unsafe {
                                _mm256_storeu_si256(cur_a.as_mut_ptr() as *mut __m256i, cur);
                                _mm256_storeu_si256(next_a.as_mut_ptr() as *mut __m256i, idx[t][v]);
                            }
                            fix_categorical(c, tree, &x[(r0 + 8 * v) * stride..], stride, &cur_a, &mut next_a, lanes);
                            // SAFETY: as above.
                            idx[t][v] = unsafe { _mm256_loadu_si256(next_a.as_ptr() as *const __m256i) };
                        }
                    }
                }
            }
        }
        for t in 0..T {
            // SAFETY: leaf indices lie within the tree.
            let leaf_p = unsafe { c.leaf.as_ptr().add(group[t].root as usize) };
            for v in 0..V {
                // SAFETY: as above.
                acc[v] = _mm256_add_ps(acc[v], unsafe { _mm256_i32gather_ps::<4>(leaf_p, idx[t][v]) });
            }
        }
    }

    /// `avx2` with 16 rows a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; otherwise as `avx2`.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn avx512(c: &CompiledTrees, x: &[f32], stride: usize, rows: usize, out: &mut [f32]) -> usize {
        let mut r0 = 0;
        while rows - r0 >= 16 {
            let groups = ((rows - r0) / 16).min(4);
            // SAFETY: rows r0..r0 + 16 * groups are in `x` and `out`.
            unsafe {
                match groups {
                    4 => rows_avx512::<4, { trees_in_flight(4) }>(c, x, stride, r0, out),
                    3 | 2 => rows_avx512::<2, { trees_in_flight(2) }>(c, x, stride, r0, out),
                    _ => rows_avx512::<1, { trees_in_flight(1) }>(c, x, stride, r0, out),
                }
            }
            r0 += 16 * if groups == 3 { 2 } else { groups };
        }
        if rows - r0 >= 8 {
            // SAFETY: the CPU has AVX2 too (checked by the caller's
            // `TreeKernel::available` for AVX-512 F machines, which all have
            // it); rows r0..r0 + 8 exist.
            unsafe { rows_avx2::<1, { trees_in_flight(1) }>(c, x, stride, r0, out) };
            r0 += 8;
        }
        r0
    }

    /// Rows `r0..r0 + 16V`, `T` trees at a time.
    ///
    /// # Safety
    /// As `avx512`, and those rows exist.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_avx512<const V: usize, const T: usize>(
        c: &CompiledTrees,
        x: &[f32],
        stride: usize,
        r0: usize,
        out: &mut [f32],
    ) {
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let stride_v = _mm512_set1_epi32(stride as i32);
        let mut rowbase = [_mm512_setzero_si512(); V];
        for (v, b) in rowbase.iter_mut().enumerate() {
            let first = _mm512_set1_epi32((r0 + 16 * v) as i32);
            *b = _mm512_mullo_epi32(_mm512_add_epi32(first, lane), stride_v);
        }
        let mut acc = [_mm512_set1_ps(c.base); V];
        let mut trees = c.trees.chunks_exact(T);
        for group in &mut trees {
            // SAFETY: the caller's contract.
            unsafe { group_avx512::<V, T>(c, group, x, stride, r0, &rowbase, &mut acc) };
        }
        for tree in trees.remainder().chunks(1) {
            // SAFETY: as above.
            unsafe { group_avx512::<V, 1>(c, tree, x, stride, r0, &rowbase, &mut acc) };
        }
        for (v, a) in acc.iter().enumerate() {
            // SAFETY: rows r0 + 16v .. r0 + 16v + 16 are in `out`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(r0 + 16 * v), *a) };
        }
    }

    /// `group_avx2` with 16 rows a vector.
    ///
    /// # Safety
    /// As `rows_avx512`; `group` holds `T` trees.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group_avx512<const V: usize, const T: usize>(
        c: &CompiledTrees,
        group: &[Tree],
        x: &[f32],
        stride: usize,
        r0: usize,
        rowbase: &[__m512i; V],
        acc: &mut [__m512; V],
    ) {
        let xp = x.as_ptr();
        let feature_mask = _mm512_set1_epi32(FEATURE_MASK as i32);
        let child_mask = _mm512_set1_epi32(CHILD_MASK as i32);
        let tiny = _mm512_set1_ps(ZERO_THRESHOLD);
        let zero_bit = _mm512_set1_epi32(ZERO_MISSING as i32);
        let cat_bit = _mm512_set1_epi32(CATEGORICAL as i32);
        let zero = _mm512_setzero_si512();
        let one = _mm512_set1_epi32(1);
        let mut idx = [[_mm512_setzero_si512(); V]; T];
        let depth = group.iter().map(|t| t.depth).max().unwrap_or(0);
        for step in 0..depth {
            for t in 0..T {
                let tree = &group[t];
                // SAFETY: as in `group_avx2`.
                let (meta_p, thr_p) = unsafe {
                    (
                        c.meta.as_ptr().add(tree.root as usize) as *const i32,
                        c.threshold.as_ptr().add(tree.root as usize),
                    )
                };
                for v in 0..V {
                    let cur = idx[t][v];
                    // SAFETY: as in `group_avx2`; below 31 for the first
                    // five steps.
                    let (meta, thr, xv) = unsafe {
                        let (meta, thr) = if step < 5 {
                            let (lo, hi) = (
                                _mm512_loadu_si512(meta_p as *const __m512i),
                                _mm512_loadu_si512(meta_p.add(16) as *const __m512i),
                            );
                            let (tlo, thi) = (_mm512_loadu_ps(thr_p), _mm512_loadu_ps(thr_p.add(16)));
                            (_mm512_permutex2var_epi32(lo, cur, hi), _mm512_permutex2var_ps(tlo, cur, thi))
                        } else {
                            (_mm512_i32gather_epi32::<4>(cur, meta_p), _mm512_i32gather_ps::<4>(cur, thr_p))
                        };
                        let feature = _mm512_and_si512(_mm512_srli_epi32::<15>(meta), feature_mask);
                        (meta, thr, _mm512_i32gather_ps::<4>(_mm512_add_epi32(rowbase[v], feature), xp))
                    };
                    let gt = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(xv, thr);
                    let mut missing = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(xv, xv);
                    if c.zero_missing {
                        let small = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(_mm512_abs_ps(xv), tiny);
                        missing |= small & _mm512_test_epi32_mask(meta, zero_bit);
                    }
                    // Meta's sign bit: missing goes right.
                    let mr = _mm512_cmplt_epi32_mask(meta, zero);
                    let right = (gt & !missing) | (mr & missing);
                    let child = _mm512_and_si512(meta, child_mask);
                    idx[t][v] = _mm512_mask_add_epi32(child, right, child, one);
                    if tree.categorical {
                        let lanes = _mm512_test_epi32_mask(meta, cat_bit) as u32;
                        if lanes != 0 {
                            let (mut cur_a, mut next_a) = ([0u32; 16], [0u32; 16]);
                            // SAFETY: 16 lanes to and from 16-element arrays.
                            unsafe {
                                _mm512_storeu_si512(cur_a.as_mut_ptr() as *mut __m512i, cur);
                                _mm512_storeu_si512(next_a.as_mut_ptr() as *mut __m512i, idx[t][v]);
                            }
                            fix_categorical(c, tree, &x[(r0 + 16 * v) * stride..], stride, &cur_a, &mut next_a, lanes);
                            // SAFETY: as above.
                            idx[t][v] = unsafe { _mm512_loadu_si512(next_a.as_ptr() as *const __m512i) };
                        }
                    }
                }
            }
        }
        for t in 0..T {
            // SAFETY: leaf indices lie within the tree.
            let leaf_p = unsafe { c.leaf.as_ptr().add(group[t].root as usize) };
            for v in 0..V {
                // SAFETY: as above.
                acc[v] = _mm512_add_ps(acc[v], unsafe { _mm512_i32gather_ps::<4>(idx[t][v], leaf_p) });
            }
        }
    }
}

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
