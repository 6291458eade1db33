//! The x86-64 builds of the tree evaluator (AVX2 and AVX-512 F): the
//! gather-based steps over row vectors, the register-table steps of a walk's
//! first nodes, and the single-row walk with trees in lanes. The only
//! `unsafe` SIMD code of tree evaluation lives here; each entry point's
//! contract is in its `# Safety` section, checked by `CompiledTrees::eval`.

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
                (c.meta.as_ptr().add(tree.root as usize) as *const i32, c.threshold.as_ptr().add(tree.root as usize))
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
                (c.meta.as_ptr().add(tree.root as usize) as *const i32, c.threshold.as_ptr().add(tree.root as usize))
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
