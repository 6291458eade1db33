//! The x86 INT8 kernels: AVX-512 VNNI and AVX2 GEMM tiles, their epilogues
//! and quantizers, written with `std::arch` intrinsics; the AMX tiles live
//! in `amx` and share the VNNI packing and epilogue.

use std::arch::x86_64::*;

use super::{PackedLayer, StaticConsts};

/// Round to nearest, ties to even, whatever MXCSR says.
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

/// Narrows 16 i32 lanes to bytes (truncating) and stores the lanes in
/// `m` at `dst`: VPMOVDB into a register, then a masked byte store. The
/// memory form (`_mm512_mask_cvtepi32_storeu_epi8`) is the same
/// operation in more micro-ops on Zen 4; the dynamic INT8 forward of the
/// demo MLP at 32 rows is about 3% faster this way (`bench/kernels.rs`).
///
/// # Safety
/// The caller must enable AVX-512 F/BW/VL, and `dst + i` must be
/// writable for every lane `i` set in `m`.
#[inline(always)]
unsafe fn store_epi8_512(dst: *mut i8, m: __mmask16, v: __m512i) {
    // SAFETY: forwarded to the caller.
    unsafe { _mm_mask_storeu_epi8(dst, m, _mm512_cvtepi32_epi8(v)) }
}

/// `round_clamp(v, lo)` on 16 lanes: `max` maps a NaN lane to `lo`, and
/// the ordered-compare mask then turns it into 0, as `as i8` does; the
/// conversion rounds ties to even. A release test compares it with the
/// scalar rounding for every f32.
///
/// # Safety
/// The caller must enable AVX-512 F.
#[inline(always)]
unsafe fn round_clamp_512(v: __m512, lo: __m512) -> __m512i {
    // SAFETY: register-only intrinsics; the caller enables AVX-512 F.
    unsafe {
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(v, v);
        let c = _mm512_min_ps(_mm512_max_ps(v, lo), _mm512_set1_ps(127.0));
        _mm512_maskz_cvt_roundps_epi32::<RNE>(ordered, c)
    }
}

/// `round_clamp(v, lo)` on 8 lanes, as `round_clamp_512`.
///
/// # Safety
/// The caller must enable AVX2.
#[inline(always)]
unsafe fn round_clamp_256(v: __m256, lo: __m256) -> __m256i {
    // SAFETY: register-only intrinsics; the caller enables AVX2.
    unsafe {
        let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(v, v);
        let c = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(v, lo), _mm256_set1_ps(127.0)), ordered);
        _mm256_cvttps_epi32(_mm256_round_ps::<RNE>(c))
    }
}

/// Eight i32 lanes in [-32768, 32767] as eight i16, in order.
///
/// # Safety
/// The caller must enable AVX2.
#[inline(always)]
unsafe fn narrow_256(q: __m256i) -> __m128i {
    // SAFETY: register-only intrinsics; the caller enables AVX2.
    unsafe { _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)) }
}

/// The mask of the first `lanes` (at most 16) lanes.
#[inline(always)]
fn mask16(lanes: usize) -> __mmask16 {
    if lanes >= 16 {
        !0
    } else {
        (1 << lanes) - 1
    }
}

/// `round_clamp` over a slice with the AVX-512 rounding, for the
/// every-f32 test.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL.
// Its one caller, the every-f32 test, runs only in optimized builds.
#[cfg(all(test, not(debug_assertions)))]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn round_clamp_slice_avx512(v: &[f32], lo: f32, out: &mut [i8]) {
    assert_eq!(v.len(), out.len());
    for (c, o) in v.chunks(16).zip(out.chunks_mut(16)) {
        let m = mask16(c.len());
        // SAFETY: masked loads and stores of `c.len()` elements of
        // slices that long.
        unsafe {
            let q = round_clamp_512(_mm512_maskz_loadu_ps(m, c.as_ptr()), _mm512_set1_ps(lo));
            store_epi8_512(o.as_mut_ptr(), m, q);
        }
    }
}

/// As `round_clamp_slice_avx512`, with the AVX2 rounding.
///
/// # Safety
/// The CPU must support AVX2.
// Its one caller, the every-f32 test, runs only in optimized builds.
#[cfg(all(test, not(debug_assertions)))]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn round_clamp_slice_avx2(v: &[f32], lo: f32, out: &mut [i8]) {
    assert_eq!(v.len(), out.len());
    for (c, o) in v.chunks(8).zip(out.chunks_mut(8)) {
        let mut buf = [0f32; 8];
        buf[..c.len()].copy_from_slice(c);
        let mut q = [0i32; 8];
        // SAFETY: loads and stores of 8-element stack arrays.
        unsafe {
            let r = round_clamp_256(_mm256_loadu_ps(buf.as_ptr()), _mm256_set1_ps(lo));
            _mm256_storeu_si256(q.as_mut_ptr().cast(), r);
        }
        for (d, s) in o.iter_mut().zip(q) {
            *d = s as i8;
        }
    }
}

/// Layer 0's static quantization (`super::quantize_static`) into
/// `q + 128` bytes.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_static_avx512(x: &[f32], rows: usize, k: usize, k_pad: usize, inv: f32, xq: &mut [u8]) {
    assert!(x.len() >= rows * k && xq.len() >= rows * k_pad && k <= k_pad);
    let (vinv, lo, flip) = (_mm512_set1_ps(inv), _mm512_set1_ps(-128.0), _mm512_set1_epi32(0x80));
    for r in 0..rows {
        for c in (0..k).step_by(16) {
            let m = mask16(k - c);
            // SAFETY: masked to the `k - c` elements left in row `r`,
            // inside both buffers (asserted above).
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(r * k + c));
                let q = round_clamp_512(_mm512_mul_ps(v, vinv), lo);
                store_epi8_512(xq.as_mut_ptr().add(r * k_pad + c).cast(), m, _mm512_xor_si512(q, flip));
            }
        }
    }
}

/// Layer 0's static quantization into i16.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_static_avx2(x: &[f32], rows: usize, k: usize, k_pad: usize, inv: f32, xq: &mut [i16]) {
    assert!(x.len() >= rows * k && xq.len() >= rows * k_pad && k <= k_pad);
    let (vinv, lo) = (_mm256_set1_ps(inv), _mm256_set1_ps(-128.0));
    let body = k / 8 * 8;
    for r in 0..rows {
        for c in (0..body).step_by(8) {
            // SAFETY: `c + 8 <= k`, inside row `r` of both buffers.
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(r * k + c));
                let q = round_clamp_256(_mm256_mul_ps(v, vinv), lo);
                _mm_storeu_si128(xq.as_mut_ptr().add(r * k_pad + c).cast(), narrow_256(q));
            }
        }
        for c in body..k {
            xq[r * k_pad + c] = i16::from(super::round_clamp(x[r * k + c] * inv, -128.0));
        }
    }
}

/// The dynamic per-row quantization (`super::quantize_rows`) into
/// `q + 128` bytes: a max-abs pass, then a rounding pass. `max` is
/// exact and `maxps` returns its second operand for a NaN lane, as
/// `f32::max` ignores NaN, so the lane-wise maximum equals the
/// reference's fold.
///
/// Rows go in blocks of 16: every row's maximum first, then the block's
/// scales and their inverses in one vector division each (IEEE
/// division rounds alike in a lane and in a scalar, so the scales are
/// the reference's), then the rounding. Done row by row, each row's
/// reduction and two dependent scalar divisions held its rounding back,
/// about a quarter of this function's time on a 32-row request. Whole
/// groups of 64 values are narrowed by two packs and one permute and
/// stored as one line; a `vpmovdb` per 16 costs twice the shuffle work.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_rows_avx512(
    x: &[f32],
    rows: usize,
    k: usize,
    k_pad: usize,
    xq: &mut [u8],
    sx: &mut [f32],
) {
    assert!(x.len() >= rows * k && xq.len() >= rows * k_pad && sx.len() >= rows && k <= k_pad);
    let (lo, one, zero) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(1.0), _mm512_setzero_ps());
    let (flip, flip_bytes) = (_mm512_set1_epi32(0x80), _mm512_set1_epi8(-128));
    // After the packs, dword 4l + j of the line holds values 4l..4l+3 of
    // vector j; this puts them back at 16j + 4l.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let body = k / 16 * 16;
    let tail = mask16(k - body);
    for r0 in (0..rows).step_by(16) {
        let n = (rows - r0).min(16);
        let mut maxes = [0f32; 16];
        for (i, m) in maxes[..n].iter_mut().enumerate() {
            let row = x[(r0 + i) * k..].as_ptr();
            // Two accumulators: `maxps`'s latency, not its throughput,
            // bounded one.
            let (mut m0, mut m1) = (zero, zero);
            let mut c = 0;
            // SAFETY: `c + 16 <= body <= k` in the loop and the body's
            // last vector; the tail is masked to the `k - body` left.
            unsafe {
                while c + 32 <= body {
                    m0 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row.add(c))), m0);
                    m1 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row.add(c + 16))), m1);
                    c += 32;
                }
                if c < body {
                    m0 = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row.add(c))), m0);
                }
                m1 = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row.add(body))), m1);
            }
            *m = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
        }
        // `if max_abs > 0 { max_abs / 127 } else { 1 }`, then `1 / scale`.
        // SAFETY: a stack array of 16 floats.
        let max_abs = unsafe { _mm512_loadu_ps(maxes.as_ptr()) };
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(max_abs, zero);
        let scale = _mm512_mask_div_ps(one, positive, max_abs, _mm512_set1_ps(127.0));
        let mut invs = [0f32; 16];
        // SAFETY: `n` scales to `sx[r0..r0 + n]`, inside `sx[..rows]`;
        // 16 inverses to a stack array of 16.
        unsafe {
            _mm512_mask_storeu_ps(sx.as_mut_ptr().add(r0), mask16(n), scale);
            _mm512_storeu_ps(invs.as_mut_ptr(), _mm512_div_ps(one, scale));
        }
        for (i, &inv) in invs[..n].iter().enumerate() {
            let (src, dst) = (x[(r0 + i) * k..].as_ptr(), xq[(r0 + i) * k_pad..].as_mut_ptr());
            let vinv = _mm512_set1_ps(inv);
            let mut c = 0;
            // SAFETY: every load and store is inside the row's first
            // `k` values (`c + 64 <= body`, `c + 16 <= body`), the tail
            // masked to the rest; both buffers hold the row (asserted).
            unsafe {
                let q = |at: usize| round_clamp_512(_mm512_mul_ps(_mm512_loadu_ps(src.add(at)), vinv), lo);
                while c + 64 <= body {
                    let ab = _mm512_packs_epi32(q(c), q(c + 16));
                    let cd = _mm512_packs_epi32(q(c + 32), q(c + 48));
                    let line = _mm512_permutexvar_epi32(order, _mm512_packs_epi16(ab, cd));
                    _mm512_storeu_si512(dst.add(c).cast(), _mm512_xor_si512(line, flip_bytes));
                    c += 64;
                }
                while c < body {
                    _mm_storeu_si128(dst.add(c).cast(), _mm512_cvtepi32_epi8(_mm512_xor_si512(q(c), flip)));
                    c += 16;
                }
                let v = _mm512_maskz_loadu_ps(tail, src.add(body));
                let q = round_clamp_512(_mm512_mul_ps(v, vinv), lo);
                store_epi8_512(dst.add(body).cast(), tail, _mm512_xor_si512(q, flip));
            }
        }
    }
}

/// The dynamic per-row quantization into i16.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_rows_avx2(
    x: &[f32],
    rows: usize,
    k: usize,
    k_pad: usize,
    xq: &mut [i16],
    sx: &mut [f32],
) {
    assert!(x.len() >= rows * k && xq.len() >= rows * k_pad && sx.len() >= rows && k <= k_pad);
    let (lo, abs_mask) = (_mm256_set1_ps(-127.0), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
    let body = k / 8 * 8;
    for r in 0..rows {
        let row = &x[r * k..(r + 1) * k];
        let mut mx = _mm256_setzero_ps();
        for c in (0..body).step_by(8) {
            // SAFETY: `c + 8 <= k`, inside `row`.
            unsafe { mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row.as_ptr().add(c)), abs_mask), mx) };
        }
        let mut lanes = [0f32; 8];
        // SAFETY: a store to an 8-element stack array.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mx) };
        let max_abs = lanes.iter().chain(&row[body..]).fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
        let inv = 1.0 / scale;
        sx[r] = scale;
        let vinv = _mm256_set1_ps(inv);
        for c in (0..body).step_by(8) {
            // SAFETY: `c + 8 <= k`, inside row `r` of both buffers.
            unsafe {
                let q = round_clamp_256(_mm256_mul_ps(_mm256_loadu_ps(row.as_ptr().add(c)), vinv), lo);
                _mm_storeu_si128(xq.as_mut_ptr().add(r * k_pad + c).cast(), narrow_256(q));
            }
        }
        for c in body..k {
            xq[r * k_pad + c] = i16::from(super::round_clamp_127(row[c] * inv));
        }
    }
}

/// What a VNNI tile does with 16 finished channels of one row: `acc` are
/// the raw `vpdpbusd` sums of `x_q + 128` against the weights, for
/// channels `o0..o0 + 16` of row `row`, `mask` covering those below `n`.
pub(super) trait VnniOut {
    /// # Safety
    /// The caller enables AVX-512 F/BW/VL; `row` is below the rows the
    /// output was built for and `o0` is a multiple of 16 below `p.n_pad`.
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, mask: __mmask16, acc: __m512i);
}

/// What an AVX2 tile does with 8 finished channels of one row (`lanes`
/// of them below `n`).
pub(super) trait Avx2Out {
    /// # Safety
    /// As `VnniOut::finish`, with AVX2 and `o0` a multiple of 8.
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, lanes: usize, acc: __m256i);
}

/// The exact i32 sums, into `[rows][n]`.
pub(super) struct Raw(pub *mut i32);

/// The dynamic float epilogue, `acc as f32 * (s_w * s_x) + bias` and
/// ReLU, into `[rows][n]` floats.
pub(super) struct Dynamic<'a> {
    pub sx: &'a [f32],
    pub y: *mut f32,
}

/// The static requantization into the next layer's activation matrix
/// (`[rows][stride]`, `q + 128` bytes for VNNI, i16 for AVX2).
pub(super) struct Requant<'a, T> {
    pub c: &'a StaticConsts,
    pub dst: *mut T,
    pub stride: usize,
}

/// The static output layer: `f32(acc + bias_q) · scale` into
/// `[rows][n]` floats.
pub(super) struct Logits<'a> {
    pub c: &'a StaticConsts,
    pub y: *mut f32,
}

/// # Safety
/// The caller enables AVX-512 F; `o0` is a multiple of 16 below `n_pad`.
#[inline(always)]
unsafe fn corrected_512(p: &PackedLayer, o0: usize, acc: __m512i) -> __m512i {
    // SAFETY: an aligned load of 16 of the `n_pad` corrections.
    unsafe { _mm512_sub_epi32(acc, _mm512_load_si512(p.offset_corr.as_slice().as_ptr().add(o0).cast())) }
}

/// `f32(acc + add) · scale` for 16 channels, the static epilogue's float.
///
/// # Safety
/// As `corrected_512`, for `c`'s `n_pad` constants.
#[inline(always)]
unsafe fn static_value_512(c: &StaticConsts, o0: usize, acc: __m512i) -> __m512 {
    // SAFETY: aligned loads of 16 of the `n_pad` constants.
    unsafe {
        let a = _mm512_add_epi32(acc, _mm512_load_si512(c.add.as_slice().as_ptr().add(o0).cast()));
        _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_load_ps(c.scale.as_slice().as_ptr().add(o0)))
    }
}

impl VnniOut for Raw {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, mask: __mmask16, acc: __m512i) {
        // SAFETY: the store is masked to channels below `n` of a row
        // below `rows`, inside `[rows][n]`.
        unsafe { _mm512_mask_storeu_epi32(self.0.add(row * p.n + o0), mask, corrected_512(p, o0, acc)) }
    }
}

impl VnniOut for Dynamic<'_> {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, mask: __mmask16, acc: __m512i) {
        // SAFETY: aligned loads of the `n_pad` constants; the store as
        // for `Raw`.
        unsafe {
            let a = corrected_512(p, o0, acc);
            let s_w = _mm512_load_ps(p.scales.as_slice().as_ptr().add(o0));
            let bias = _mm512_load_ps(p.bias.as_slice().as_ptr().add(o0));
            let scale = _mm512_mul_ps(s_w, _mm512_set1_ps(self.sx[row]));
            let mut v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), scale), bias);
            if p.relu {
                // `maxps` returns its second operand for NaN, as
                // `f32::max(v, 0.0)` returns 0.0.
                v = _mm512_max_ps(v, _mm512_setzero_ps());
            }
            _mm512_mask_storeu_ps(self.y.add(row * p.n + o0), mask, v);
        }
    }
}

impl VnniOut for Requant<'_, u8> {
    #[inline(always)]
    unsafe fn finish(&self, _: &PackedLayer, row: usize, o0: usize, mask: __mmask16, acc: __m512i) {
        // SAFETY: the store is masked to channels below `n <= stride`
        // of a row below `rows`, inside `[rows][stride]`.
        unsafe {
            let q = round_clamp_512(static_value_512(self.c, o0, acc), _mm512_set1_ps(self.c.lo));
            let dst = self.dst.add(row * self.stride + o0).cast();
            store_epi8_512(dst, mask, _mm512_xor_si512(q, _mm512_set1_epi32(0x80)));
        }
    }
}

impl VnniOut for Logits<'_> {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, mask: __mmask16, acc: __m512i) {
        // SAFETY: as for `Raw`.
        unsafe { _mm512_mask_storeu_ps(self.y.add(row * p.n + o0), mask, static_value_512(self.c, o0, acc)) }
    }
}

/// Stores the first `lanes` of eight 32-bit lanes at `dst`.
///
/// # Safety
/// The caller enables AVX2; `dst` is valid for `lanes` writes.
#[inline(always)]
unsafe fn store_lanes_256<T: Copy>(dst: *mut T, lanes: usize, v: __m256i) {
    // SAFETY: a full store when all 8 fit, otherwise through a stack
    // array of exactly 8 lanes.
    unsafe {
        if lanes == 8 {
            _mm256_storeu_si256(dst.cast(), v);
        } else {
            let mut tmp = [0u32; 8];
            _mm256_storeu_si256(tmp.as_mut_ptr().cast(), v);
            std::ptr::copy_nonoverlapping(tmp.as_ptr().cast::<T>(), dst, lanes);
        }
    }
}

/// `f32(acc + add) · scale` for 8 channels.
///
/// # Safety
/// The caller enables AVX2; `o0` is a multiple of 8 below `n_pad`.
#[inline(always)]
unsafe fn static_value_256(c: &StaticConsts, o0: usize, acc: __m256i) -> __m256 {
    // SAFETY: aligned loads of 8 of the `n_pad` constants.
    unsafe {
        let a = _mm256_add_epi32(acc, _mm256_load_si256(c.add.as_slice().as_ptr().add(o0).cast()));
        _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_load_ps(c.scale.as_slice().as_ptr().add(o0)))
    }
}

impl Avx2Out for Raw {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, lanes: usize, acc: __m256i) {
        // SAFETY: `lanes` channels below `n` of a row below `rows`.
        unsafe { store_lanes_256(self.0.add(row * p.n + o0), lanes, acc) }
    }
}

impl Avx2Out for Dynamic<'_> {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, lanes: usize, acc: __m256i) {
        // SAFETY: aligned loads of the `n_pad` constants; the store as
        // for `Raw`.
        unsafe {
            let s_w = _mm256_load_ps(p.scales.as_slice().as_ptr().add(o0));
            let bias = _mm256_load_ps(p.bias.as_slice().as_ptr().add(o0));
            let scale = _mm256_mul_ps(s_w, _mm256_set1_ps(self.sx[row]));
            let mut v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), scale), bias);
            if p.relu {
                v = _mm256_max_ps(v, _mm256_setzero_ps());
            }
            store_lanes_256(self.y.add(row * p.n + o0), lanes, _mm256_castps_si256(v));
        }
    }
}

impl Avx2Out for Requant<'_, i16> {
    #[inline(always)]
    unsafe fn finish(&self, _: &PackedLayer, row: usize, o0: usize, lanes: usize, acc: __m256i) {
        // SAFETY: `lanes` i16 below `n <= stride` of a row below `rows`,
        // inside `[rows][stride]`; partial blocks go through a stack
        // array of exactly 8.
        unsafe {
            let q = narrow_256(round_clamp_256(static_value_256(self.c, o0, acc), _mm256_set1_ps(self.c.lo)));
            let dst = self.dst.add(row * self.stride + o0);
            if lanes == 8 {
                _mm_storeu_si128(dst.cast(), q);
            } else {
                let mut tmp = [0i16; 8];
                _mm_storeu_si128(tmp.as_mut_ptr().cast(), q);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, lanes);
            }
        }
    }
}

impl Avx2Out for Logits<'_> {
    #[inline(always)]
    unsafe fn finish(&self, p: &PackedLayer, row: usize, o0: usize, lanes: usize, acc: __m256i) {
        // SAFETY: as for `Raw`.
        unsafe {
            let v = static_value_256(self.c, o0, acc);
            store_lanes_256(self.y.add(row * p.n + o0), lanes, _mm256_castps_si256(v));
        }
    }
}

const VNNI_LANES: usize = 16;
const VNNI_MR: usize = 4;
const VNNI_NB: usize = 4;

/// Rows in blocks of 4, output channels in blocks of 4 × 16: 16 zmm
/// accumulators, so each weight load feeds 4 rows and each activation
/// broadcast feeds 64 channels; 1 to 3 leftover rows get a tile of their
/// own height rather than one row at a time.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI; `p` must be packed for
/// `Avx512Vnni`; `xa` must hold `rows` rows of `p.k_pad` bytes; `out`
/// must be valid for `rows` rows of `p.n` channels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni<O: VnniOut>(p: &PackedLayer, xa: &[u8], rows: usize, out: &O) {
    // SAFETY: the caller's contract.
    unsafe { gemm_vnni_rows(p, xa, 0, rows, out) }
}

/// `gemm_vnni` for rows `r_start..rows` only (the AMX kernel's
/// leftover rows, on the same packed weights).
///
/// # Safety
/// As `gemm_vnni`; `p` may also be packed for `Amx`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemm_vnni_rows<O: VnniOut>(p: &PackedLayer, xa: &[u8], r_start: usize, rows: usize, out: &O) {
    assert!(xa.len() >= rows * p.k_pad && p.w_i8.as_slice().len() == p.n_pad * p.k_pad && r_start <= rows);
    let mut r = r_start;
    // SAFETY (all row blocks): the caller's contract, with every block
    // inside `rows`.
    while r + VNNI_MR <= rows {
        unsafe { row_block_vnni::<VNNI_MR, O>(p, xa, r, out) };
        r += VNNI_MR;
    }
    match rows - r {
        0 => {}
        1 => unsafe { row_block_vnni::<1, O>(p, xa, r, out) },
        2 => unsafe { row_block_vnni::<2, O>(p, xa, r, out) },
        _ => unsafe { row_block_vnni::<3, O>(p, xa, r, out) },
    }
}

/// Rows `r0..r0 + M` across every channel block.
///
/// # Safety
/// As `gemm_vnni`, with `r0 + M <= rows`; only called from `gemm_vnni`,
/// which enables the features it inlines into.
#[inline(always)]
unsafe fn row_block_vnni<const M: usize, O: VnniOut>(p: &PackedLayer, xa: &[u8], r0: usize, out: &O) {
    let blocks = p.n_pad / VNNI_LANES;
    let mut b = 0;
    // SAFETY: the caller's contract, with `b + NB <= blocks` at each call.
    unsafe {
        while b + VNNI_NB <= blocks {
            tile_vnni::<M, VNNI_NB, O>(p, xa, r0, b, out);
            b += VNNI_NB;
        }
        match blocks - b {
            0 => {}
            1 => tile_vnni::<M, 1, O>(p, xa, r0, b, out),
            2 => tile_vnni::<M, 2, O>(p, xa, r0, b, out),
            _ => tile_vnni::<M, 3, O>(p, xa, r0, b, out),
        }
    }
}

/// Rows `r0..r0+M` × channel blocks `b0..b0+NB`, then `out` per row and
/// block while the sums are in registers.
///
/// # Safety
/// As `gemm_vnni`, with the tile inside `rows` × `n_pad / 16`.
#[inline(always)]
unsafe fn tile_vnni<const M: usize, const NB: usize, O: VnniOut>(
    p: &PackedLayer,
    xa: &[u8],
    r0: usize,
    b0: usize,
    out: &O,
) {
    // The weight lines of a block are `k_pad / 4` apart; only the first
    // `k / 4` (rounded up) hold weights: AMX pads K to 64 for its tiles.
    let (groups, used) = (p.k_pad / 4, p.k.div_ceil(4));
    let w = p.w_i8.as_slice().as_ptr();
    let xp = xa.as_ptr();
    // SAFETY: every pointer below stays inside its buffer: weights span
    // `n_pad / 16` blocks of `groups` 64-byte lines, activations `rows`
    // rows of `k_pad` bytes (4 read at `4 * g < k_pad`); `out` gets
    // channel blocks below `n_pad` of rows below `rows`. The CPU
    // features are enabled by the only caller.
    unsafe {
        let mut acc = [[_mm512_setzero_si512(); NB]; M];
        for g in 0..used {
            let mut wv = [_mm512_setzero_si512(); NB];
            for (b, v) in wv.iter_mut().enumerate() {
                *v = _mm512_load_si512(w.add(((b0 + b) * groups + g) * 64).cast());
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xb = _mm512_set1_epi32(xp.add((r0 + r) * p.k_pad + 4 * g).cast::<i32>().read_unaligned());
                for (a, v) in acc_r.iter_mut().zip(&wv) {
                    *a = _mm512_dpbusd_epi32(*a, xb, *v);
                }
            }
        }
        for b in 0..NB {
            let o0 = (b0 + b) * VNNI_LANES;
            let mask = mask16(p.n - o0.min(p.n));
            for (r, acc_r) in acc.iter().enumerate() {
                out.finish(p, r0 + r, o0, mask, acc_r[b]);
            }
        }
    }
}

/// # Safety
/// The CPU must support AVX-512 F/BW/VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn peak_vnni(iterations: u64) -> i32 {
    // Sixteen chains hide the instruction's latency behind its
    // throughput, so the loop measures issue rate, not dependency chains.
    let a = _mm512_set1_epi32(std::hint::black_box(0x0101_0101));
    let b = _mm512_set1_epi32(std::hint::black_box(0x0102_0304));
    let mut acc = [_mm512_setzero_si512(); 16];
    for _ in 0..iterations {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, a, b);
        }
    }
    let sum = acc.iter().fold(_mm512_setzero_si512(), |s, v| _mm512_add_epi32(s, *v));
    _mm512_reduce_add_epi32(sum)
}

pub(super) mod amx;

const AVX2_LANES: usize = 8;
const AVX2_MR: usize = 4;
const AVX2_NB: usize = 2;

/// Rows in blocks of 4, channels in blocks of 2 × 8: 8 ymm accumulators,
/// leaving room in the 16 ymm registers for weights and broadcasts.
///
/// # Safety
/// The CPU must support AVX2; `p` must be packed for `Avx2`; `xa` must
/// hold `rows` rows of `p.k_pad` i16; `out` must be valid for `rows`
/// rows of `p.n` channels.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn gemm_avx2<O: Avx2Out>(p: &PackedLayer, xa: &[i16], rows: usize, out: &O) {
    assert!(xa.len() >= rows * p.k_pad && p.w_i16.as_slice().len() == p.n_pad * p.k_pad);
    let mut r = 0;
    // SAFETY (all row blocks): the caller's contract, with every block
    // inside `rows`.
    while r + AVX2_MR <= rows {
        unsafe { row_block_avx2::<AVX2_MR, O>(p, xa, r, out) };
        r += AVX2_MR;
    }
    match rows - r {
        0 => {}
        1 => unsafe { row_block_avx2::<1, O>(p, xa, r, out) },
        2 => unsafe { row_block_avx2::<2, O>(p, xa, r, out) },
        _ => unsafe { row_block_avx2::<3, O>(p, xa, r, out) },
    }
}

/// # Safety
/// As `gemm_avx2`, with `r0 + M <= rows`; only called from `gemm_avx2`.
#[inline(always)]
unsafe fn row_block_avx2<const M: usize, O: Avx2Out>(p: &PackedLayer, xa: &[i16], r0: usize, out: &O) {
    let blocks = p.n_pad / AVX2_LANES;
    let mut b = 0;
    // SAFETY: the caller's contract, with `b + NB <= blocks` at each call.
    unsafe {
        while b + AVX2_NB <= blocks {
            tile_avx2::<M, AVX2_NB, O>(p, xa, r0, b, out);
            b += AVX2_NB;
        }
        if b < blocks {
            tile_avx2::<M, 1, O>(p, xa, r0, b, out);
        }
    }
}

/// # Safety
/// As `gemm_avx2`, with the tile inside `rows` × `n_pad / 8`. Only called
/// from `gemm_avx2`, which enables the features it inlines into.
#[inline(always)]
unsafe fn tile_avx2<const M: usize, const NB: usize, O: Avx2Out>(
    p: &PackedLayer,
    xa: &[i16],
    r0: usize,
    b0: usize,
    out: &O,
) {
    let pairs = p.k_pad / 2;
    let w = p.w_i16.as_slice().as_ptr();
    let xp = xa.as_ptr();
    // SAFETY: as in `tile_vnni`, with 32-byte weight lines of 8 channels
    // × 2 k and activation pairs read at `2 * kp < k_pad`.
    unsafe {
        let mut acc = [[_mm256_setzero_si256(); NB]; M];
        for kp in 0..pairs {
            let mut wv = [_mm256_setzero_si256(); NB];
            for (b, v) in wv.iter_mut().enumerate() {
                *v = _mm256_load_si256(w.add(((b0 + b) * pairs + kp) * 16).cast());
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xb = _mm256_set1_epi32(xp.add((r0 + r) * p.k_pad + 2 * kp).cast::<i32>().read_unaligned());
                for (a, v) in acc_r.iter_mut().zip(&wv) {
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(xb, *v));
                }
            }
        }
        for b in 0..NB {
            let o0 = (b0 + b) * AVX2_LANES;
            let lanes = (p.n - o0.min(p.n)).min(AVX2_LANES);
            for (r, acc_r) in acc.iter().enumerate() {
                out.finish(p, r0 + r, o0, lanes, acc_r[b]);
            }
        }
    }
}
