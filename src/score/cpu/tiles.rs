//! The f32 dense micro-kernel: register-blocked fused multiply-adds over
//! weights packed once into panels of 16 outputs, `[panel][k][16]`, so each
//! k step of a tile loads whole contiguous vectors of weights and
//! broadcasts one input per row.
//!
//! Every output's sum starts at 0 and adds `x[r][k] · w[o][k]` for k = 0,
//! 1, … in that order with one fused multiply-add per step (exactly
//! rounded), so the AVX-512, AVX2+FMA and baseline builds give the same bits
//! and the f32 backend stays a deterministic oracle; the speed comes from
//! the tile, not from reordering the sum (MLAS keeps the same per-output k
//! order). Tiles per build: AVX-512 F, up to 8 rows × 32 outputs (16 zmm
//! accumulators); AVX2 with FMA, up to 6 rows × 16 outputs (12 ymm); the
//! baseline, up to 4 rows × 16 outputs with `f32::mul_add` (a library call
//! on an x86 CPU without FMA: correct, slow, and only there as the
//! fallback). Leftover rows get a tile of their own height; the last panel
//! is zero padded and only its real outputs are stored.
//!
//! The FP8 backend (decoded E4M3 values, whose products are exact, so the
//! fused and unfused sums agree bit for bit) and the graph executor's f32
//! dense layers share it; each brings its own epilogue, applied to a tile's
//! finished sums.

use super::aligned::AlignedBuf;

/// Outputs per packed panel (one zmm of f32, two ymm).
pub(super) const PANEL: usize = 16;

/// Which instruction-set build of a tiled loop runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest build this CPU runs.
    pub(super) fn best() -> Isa {
        *Isa::available().last().expect("the baseline always runs")
    }

    /// Every build this CPU runs, narrowest first.
    pub(super) fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx2.runs_here() {
                v.push(Isa::Avx2);
            }
            if Isa::Avx512.runs_here() {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    /// Whether this CPU has the features the build is compiled with (AVX2
    /// needs FMA too: the micro-kernel is made of fused multiply-adds).
    pub(super) fn runs_here(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
        }
    }
}

/// A layer's weights packed for the micro-kernel.
pub(super) struct Panels {
    pub k: usize,
    pub n: usize,
    /// `n` rounded up to `PANEL`, divided by it.
    panels: usize,
    /// `[panels][k][PANEL]`, zero padded, 64-byte aligned: each k step of
    /// a panel is one cache line.
    w: AlignedBuf<f32>,
}

impl Panels {
    /// `w(o, k)` for every output `o < n` and input `k < k`.
    pub fn new(k: usize, n: usize, w: impl Fn(usize, usize) -> f32) -> Panels {
        let panels = n.div_ceil(PANEL);
        let mut packed = AlignedBuf::zeroed(panels * k * PANEL);
        let p = packed.as_mut_slice();
        for o in 0..n {
            for kk in 0..k {
                p[(o / PANEL * k + kk) * PANEL + o % PANEL] = w(o, kk);
            }
        }
        Panels { k, n, panels, w: packed }
    }

    /// `y[r][o] = epilogue(Σ_k x[r][k] · w[o][k], bias[o])` for `rows` rows
    /// of `x` (`[rows][k]`) into `y` (`[rows][n]`), each sum a chain of
    /// fused multiply-adds in k order from 0, with the `isa` build of the
    /// micro-kernel (panics if this CPU cannot run it).
    #[inline(always)]
    pub fn rows(
        &self,
        isa: Isa,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        bias: &[f32],
        epilogue: impl Fn(f32, f32) -> f32,
    ) {
        assert!(bias.len() == self.n && x.len() >= rows * self.k && y.len() >= rows * self.n);
        assert!(isa.runs_here(), "{isa:?} build on a CPU without its features");
        match isa {
            Isa::Baseline => portable::rows(self, x, rows, y, bias, &epilogue),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above that this CPU has AVX2 and FMA.
            Isa::Avx2 => unsafe { x86::rows_avx2(self, x, rows, y, bias, &epilogue) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: checked above that this CPU has AVX-512 F.
            Isa::Avx512 => unsafe { x86::rows_avx512(self, x, rows, y, bias, &epilogue) },
        }
    }
}

/// Stores the finished sums of a tile, `sums[r][j]` for output `o0 + j`
/// (row stride `stride`), through the epilogue into `y` rows `r0..r0 +
/// height`, outputs `o0..min(o0 + width, n)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // one tile's coordinates, all needed
fn finish(
    sums: &[f32],
    stride: usize,
    height: usize,
    width: usize,
    r0: usize,
    o0: usize,
    n: usize,
    y: &mut [f32],
    bias: &[f32],
    epilogue: &impl Fn(f32, f32) -> f32,
) {
    let lanes = (n - o0).min(width);
    let bias = &bias[o0..o0 + lanes];
    for (r, s) in sums.chunks_exact(stride).take(height).enumerate() {
        let out = &mut y[(r0 + r) * n + o0..][..lanes];
        for ((v, a), b) in out.iter_mut().zip(s).zip(bias) {
            *v = epilogue(*a, *b);
        }
    }
}

/// Evaluates `$call` with the const `$R` equal to the runtime row count
/// `$rows` (one of the listed), so each tile height is its own
/// monomorphized loop with its sums in registers.
macro_rules! by_rows {
    ($rows:expr, [$($r:literal),+], $R:ident => $call:expr) => {
        match $rows {
            $($r => {
                const $R: usize = $r;
                $call
            })+
            _ => unreachable!("a tile is 1 to the largest listed rows high"),
        }
    };
}

/// The baseline build: plain loops, `f32::mul_add` per product.
mod portable {
    use super::{finish, Panels, PANEL};

    const ROWS: usize = 4;

    #[inline(always)]
    pub(super) fn rows(
        w: &Panels,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        bias: &[f32],
        epilogue: &impl Fn(f32, f32) -> f32,
    ) {
        let k = w.k;
        let mut sums = [0.0f32; ROWS * PANEL];
        let packed = w.w.as_slice();
        for p in 0..w.panels {
            let panel = &packed[p * k * PANEL..(p + 1) * k * PANEL];
            for r0 in (0..rows).step_by(ROWS) {
                let height = (rows - r0).min(ROWS);
                let x = &x[r0 * k..(r0 + height) * k];
                by_rows!(height, [1, 2, 3, 4], R => tile::<R>(panel, x, k, &mut sums));
                finish(&sums, PANEL, height, PANEL, r0, p * PANEL, w.n, y, bias, epilogue);
            }
        }
    }

    /// `R` rows of `x` (`[R][k]`) times one panel (`[k][PANEL]`) into
    /// `sums[r][j]`.
    #[inline(always)]
    fn tile<const R: usize>(panel: &[f32], x: &[f32], k: usize, sums: &mut [f32; ROWS * PANEL]) {
        let mut acc = [[0.0f32; PANEL]; R];
        for kk in 0..k {
            let wk = &panel[kk * PANEL..(kk + 1) * PANEL];
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xv = x[r * k + kk];
                for (a, wv) in acc_r.iter_mut().zip(wk) {
                    *a = xv.mul_add(*wv, *a);
                }
            }
        }
        for (s, a) in sums.chunks_exact_mut(PANEL).zip(&acc) {
            s.copy_from_slice(a);
        }
    }
}

/// The AVX-512 F and AVX2+FMA builds: accumulators in vector registers,
/// one broadcast per row and k, one aligned load per panel vector and k.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{finish, Panels, PANEL};
    use std::arch::x86_64::*;

    /// AVX-512 tile: up to 8 rows × 2 panels, 16 zmm accumulators.
    const ROWS_512: usize = 8;
    const PANELS_512: usize = 2;
    /// AVX2 tile: up to 6 rows × 1 panel (2 ymm each), 12 ymm accumulators.
    const ROWS_256: usize = 6;

    /// [`Panels::rows`] with the AVX-512 F micro-kernel: panels two at a
    /// time (the last alone when their count is odd), rows eight at a time
    /// under each pair so the pair's weights stay in L1.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn rows_avx512(
        w: &Panels,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        bias: &[f32],
        epilogue: &impl Fn(f32, f32) -> f32,
    ) {
        let k = w.k;
        let packed = w.w.as_slice();
        let mut sums = [0.0f32; ROWS_512 * PANELS_512 * PANEL];
        for p0 in (0..w.panels).step_by(PANELS_512) {
            let wide = (w.panels - p0).min(PANELS_512);
            let panel = &packed[p0 * k * PANEL..(p0 + wide) * k * PANEL];
            for r0 in (0..rows).step_by(ROWS_512) {
                let height = (rows - r0).min(ROWS_512);
                let xs = &x[r0 * k..(r0 + height) * k];
                // SAFETY: `panel` holds `wide` panels of `k · PANEL` values
                // and `xs` `height` rows of `k`, as each tile reads; `sums`
                // is `ROWS_512 × PANELS_512 · PANEL`; AVX-512 F is enabled.
                unsafe {
                    if wide == 2 {
                        by_rows!(height, [1, 2, 3, 4, 5, 6, 7, 8], R => tile_512::<R, 2>(panel, xs, k, &mut sums));
                    } else {
                        by_rows!(height, [1, 2, 3, 4, 5, 6, 7, 8], R => tile_512::<R, 1>(panel, xs, k, &mut sums));
                    }
                }
                let width = wide * PANEL;
                finish(&sums, PANELS_512 * PANEL, height, width, r0, p0 * PANEL, w.n, y, bias, epilogue);
            }
        }
    }

    /// `R` rows of `x` times `P` consecutive panels into `sums[r][j]` (row
    /// stride `PANELS_512 · PANEL`): `R · P` zmm sums, each k step `P`
    /// aligned weight loads, `R` broadcasts and `R · P` fused multiply-adds.
    ///
    /// # Safety
    /// AVX-512 F must be available; `panel` holds at least `P · k · PANEL`
    /// values starting 64-byte aligned, `x` at least `R · k`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn tile_512<const R: usize, const P: usize>(
        panel: &[f32],
        x: &[f32],
        k: usize,
        sums: &mut [f32; ROWS_512 * PANELS_512 * PANEL],
    ) {
        debug_assert!(panel.len() >= P * k * PANEL && x.len() >= R * k);
        // One pointer per row and per panel, indexed by k alone, so each
        // step's addresses need no arithmetic beyond the index.
        let xs: [*const f32; R] = std::array::from_fn(|r| x[r * k..].as_ptr());
        let ws: [*const f32; P] = std::array::from_fn(|p| panel[p * k * PANEL..].as_ptr());
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        for kk in 0..k {
            // SAFETY (all reads): `kk · PANEL + 16 ≤ k · PANEL` past each
            // panel's start and `kk < k` past each row's, by the contract;
            // every weight line starts on a 64-byte boundary (the buffer
            // does and lines are 64 bytes).
            let mut wv = [_mm512_setzero_ps(); P];
            for (v, wp) in wv.iter_mut().zip(&ws) {
                *v = unsafe { _mm512_load_ps(wp.add(kk * PANEL)) };
            }
            for (acc_r, xr) in acc.iter_mut().zip(&xs) {
                let xv = _mm512_set1_ps(unsafe { *xr.add(kk) });
                for (a, wp) in acc_r.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, *wp, *a);
                }
            }
        }
        for (s, acc_r) in sums.chunks_exact_mut(PANELS_512 * PANEL).zip(&acc) {
            for (p, a) in acc_r.iter().enumerate() {
                // SAFETY: `s` is `PANELS_512 · PANEL` long and `p < P ≤
                // PANELS_512`, so 16 values from `p · PANEL` fit.
                unsafe { _mm512_storeu_ps(s.as_mut_ptr().add(p * PANEL), *a) };
            }
        }
    }

    /// [`Panels::rows`] with the AVX2+FMA micro-kernel: one panel at a
    /// time, rows six at a time under it.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn rows_avx2(
        w: &Panels,
        x: &[f32],
        rows: usize,
        y: &mut [f32],
        bias: &[f32],
        epilogue: &impl Fn(f32, f32) -> f32,
    ) {
        let k = w.k;
        let packed = w.w.as_slice();
        let mut sums = [0.0f32; ROWS_256 * PANEL];
        for p in 0..w.panels {
            let panel = &packed[p * k * PANEL..(p + 1) * k * PANEL];
            for r0 in (0..rows).step_by(ROWS_256) {
                let height = (rows - r0).min(ROWS_256);
                let xs = &x[r0 * k..(r0 + height) * k];
                // SAFETY: `panel` is one panel of `k · PANEL` values, `xs`
                // `height` rows of `k`; `sums` is `ROWS_256 × PANEL`; AVX2
                // and FMA are enabled.
                unsafe { by_rows!(height, [1, 2, 3, 4, 5, 6], R => tile_256::<R>(panel, xs, k, &mut sums)) };
                finish(&sums, PANEL, height, PANEL, r0, p * PANEL, w.n, y, bias, epilogue);
            }
        }
    }

    /// `R` rows of `x` times one panel into `sums[r][j]`: `2 · R` ymm sums,
    /// each k step 2 aligned loads, `R` broadcasts, `2 · R` fused
    /// multiply-adds.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `panel` holds at least `k · PANEL`
    /// values starting 64-byte aligned, `x` at least `R · k`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_256<const R: usize>(panel: &[f32], x: &[f32], k: usize, sums: &mut [f32; ROWS_256 * PANEL]) {
        debug_assert!(panel.len() >= k * PANEL && x.len() >= R * k);
        let (w, x) = (panel.as_ptr(), x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for kk in 0..k {
            // SAFETY (all reads): `kk · PANEL + 16 ≤ k · PANEL` and `r · k
            // + kk < R · k` by the contract; lines are 64-byte aligned.
            let wv = unsafe { [_mm256_load_ps(w.add(kk * PANEL)), _mm256_load_ps(w.add(kk * PANEL + 8))] };
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(unsafe { *x.add(r * k + kk) });
                acc_r[0] = _mm256_fmadd_ps(xv, wv[0], acc_r[0]);
                acc_r[1] = _mm256_fmadd_ps(xv, wv[1], acc_r[1]);
            }
        }
        for (s, acc_r) in sums.chunks_exact_mut(PANEL).zip(&acc) {
            // SAFETY: `s` is `PANEL` (16) values long.
            unsafe {
                _mm256_storeu_ps(s.as_mut_ptr(), acc_r[0]);
                _mm256_storeu_ps(s.as_mut_ptr().add(8), acc_r[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeded values in about ±4, with exact zeros, negative zeros and a
    /// few large magnitudes, so sums cancel and round in many ways.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::loadgen::demo::SplitMix64::new(seed);
        (0..n)
            .map(|i| match i % 29 {
                7 => 0.0,
                13 => -0.0,
                19 => rng.normal() * 1.0e4,
                _ => rng.normal(),
            })
            .collect()
    }

    /// The kernel's contract written out one row and one output at a time:
    /// `acc = x · w + acc` by `mul_add` for k = 0, 1, … from 0, then the
    /// epilogue `acc + bias`.
    fn transcription(x: &[f32], w: &[f32], bias: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = Vec::with_capacity(rows * n);
        for r in 0..rows {
            for o in 0..n {
                let mut acc = 0.0f32;
                for kk in 0..k {
                    acc = x[r * k + kk].mul_add(w[o * k + kk], acc);
                }
                y.push(acc + bias[o]);
            }
        }
        y
    }

    fn check(rows: usize, k: usize, n: usize) {
        let seed = (rows * 1_000_003 + k * 1009 + n) as u64;
        let x = values(seed, rows * k);
        let w = values(seed + 1, n * k);
        let bias = values(seed + 2, n);
        let packed = Panels::new(k, n, |o, kk| w[o * k + kk]);
        let want = transcription(&x, &w, &bias, rows, k, n);
        for isa in Isa::available() {
            // NaN-filled, so an output left unwritten cannot pass.
            let mut got = vec![f32::NAN; rows * n];
            packed.rows(isa, &x, rows, &mut got, &bias, |a, b| a + b);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} rows {rows} k {k} n {n}: row {} output {}", i / n, i % n);
            }
        }
    }

    #[test]
    fn every_build_matches_a_fused_multiply_add_chain_in_k_order_bit_for_bit() {
        let available = Isa::available();
        if available.len() < 3 {
            eprintln!("skipped builds: only {available:?} run on this CPU");
        }
        const EDGES: [usize; 10] = [1, 3, 15, 16, 17, 63, 65, 80, 256, 257];
        // Every leftover of the 4-, 6- and 8-row tiles, alone and after
        // whole ones, at every ragged k and n.
        for rows in (1..=17).chain([31, 32, 33]) {
            for k in EDGES {
                for n in EDGES {
                    check(rows, k, n);
                }
            }
        }
        // Many tiles: every k and every n at least once.
        for rows in [255, 256, 1024] {
            for (k, n) in
                [(1, 257), (3, 65), (15, 1), (16, 17), (17, 16), (63, 3), (65, 15), (80, 256), (256, 128), (257, 63)]
            {
                check(rows, k, n);
            }
        }
    }

    #[test]
    fn a_layer_without_inputs_gives_the_epilogue_of_zero() {
        let packed = Panels::new(0, 17, |_, _| unreachable!("no weights"));
        let bias: Vec<f32> = (0..17).map(|o| o as f32).collect();
        for isa in Isa::available() {
            let mut y = vec![f32::NAN; 3 * 17];
            packed.rows(isa, &[], 3, &mut y, &bias, |a, b| a + b);
            for (i, v) in y.iter().enumerate() {
                assert_eq!(*v, (i % 17) as f32, "{isa:?}");
            }
        }
    }
}
