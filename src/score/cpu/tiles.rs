//! Register-tiled f32 dense layers over weights transposed to `[k][n]`:
//! tiles of `TILE_R` rows × `TILE_N` outputs keep their sums in registers
//! while k runs from 0 up, so each output sums its products in k order (the
//! FP8 contract's order, and reproducible in every instruction-set build)
//! while the compiler vectorises across the 16 outputs. The FP8 backend
//! (decoded E4M3 values) and the graph executor's f32 dense layers share it;
//! each brings its own epilogue, and each compiles its loops per [`Isa`].

/// Outputs per tile (one zmm of f32) and rows per tile.
pub(super) const TILE_N: usize = 16;
pub(super) const TILE_R: usize = 4;

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
    pub(super) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }
}

/// A layer's weights in the tile layout.
pub(super) struct KMajor {
    pub k: usize,
    pub n: usize,
    /// `n` rounded up to `TILE_N`.
    pub n_pad: usize,
    /// `[k][n_pad]`, zero padded.
    pub w_t: Vec<f32>,
}

impl KMajor {
    /// `w(o, k)` for every output `o < n` and input `k < k`.
    pub fn new(k: usize, n: usize, w: impl Fn(usize, usize) -> f32) -> KMajor {
        let n_pad = n.next_multiple_of(TILE_N);
        let mut w_t = vec![0.0; k * n_pad];
        for o in 0..n {
            for kk in 0..k {
                w_t[kk * n_pad + o] = w(o, kk);
            }
        }
        KMajor { k, n, n_pad, w_t }
    }

    /// `y[r][o] = epilogue(Σ_k x[r][k] · w[o][k], bias[o])` for `rows` rows
    /// of `x` (`[rows][k]`) into `y` (`[rows][n]`), the sum in k order from 0.
    #[inline(always)]
    pub fn rows(&self, x: &[f32], rows: usize, y: &mut [f32], bias: &[f32], epilogue: impl Fn(f32, f32) -> f32) {
        assert_eq!(bias.len(), self.n);
        let mut r = 0;
        while r + TILE_R <= rows {
            for o0 in (0..self.n).step_by(TILE_N) {
                self.tile::<TILE_R>(x, r, o0, y, bias, &epilogue);
            }
            r += TILE_R;
        }
        for r in r..rows {
            for o0 in (0..self.n).step_by(TILE_N) {
                self.tile::<1>(x, r, o0, y, bias, &epilogue);
            }
        }
    }

    /// Rows `r0..r0 + R` × outputs `o0..o0 + TILE_N` (those below `n` stored).
    #[inline(always)]
    fn tile<const R: usize>(
        &self,
        x: &[f32],
        r0: usize,
        o0: usize,
        y: &mut [f32],
        bias: &[f32],
        epilogue: &impl Fn(f32, f32) -> f32,
    ) {
        let xs: [&[f32]; R] = std::array::from_fn(|r| &x[(r0 + r) * self.k..(r0 + r + 1) * self.k]);
        let mut acc = [[0.0f32; TILE_N]; R];
        for (kk, w) in self.w_t.chunks_exact(self.n_pad).enumerate() {
            let w: &[f32; TILE_N] = w[o0..o0 + TILE_N].try_into().expect("n_pad is a multiple of TILE_N");
            for (acc_r, x_r) in acc.iter_mut().zip(&xs) {
                let xk = x_r[kk];
                for (a, &wv) in acc_r.iter_mut().zip(w) {
                    *a += xk * wv;
                }
            }
        }
        let lanes = (self.n - o0).min(TILE_N);
        for (r, acc_r) in acc.iter().enumerate() {
            let out = &mut y[(r0 + r) * self.n + o0..][..lanes];
            for ((v, a), b) in out.iter_mut().zip(acc_r).zip(&bias[o0..o0 + lanes]) {
                *v = epilogue(*a, *b);
            }
        }
    }
}
