//! INT8 GEMM kernels for the CPU INT8 backend, one variant per instruction set.
//!
//! A layer's input rows are quantized together into one activation matrix,
//! multiplied by weights repacked once at construction, and the epilogue is
//! applied to each output tile while its accumulators are still in
//! registers. Every variant reproduces the scalar reference in `super` bit
//! for bit: the integer sums are exact, and the float steps are the same IEEE
//! operations in the same order (`acc as f32 * (s_w * s_x) + bias`, never a
//! fused multiply-add; rounding is round-to-nearest-even on clamped values,
//! NaN to 0).
//!
//! Layouts, chosen so that one vector load fetches the weights a kernel step
//! needs and activations are broadcast:
//! - `Avx512Vnni`: 16 output channels × 4 consecutive k as 64 bytes (one zmm);
//!   K padded to 4, N to 16. `vpdpbusd` multiplies unsigned by signed bytes,
//!   so activations are stored as `x_q + 128` (u8) and `128 * Σ_k w[o][k]`,
//!   precomputed here, is subtracted from each accumulator (for the static
//!   path it is folded into the bias once, at construction). Both sums fit
//!   in i32 for any K up to `WIDTH_MAX` (255 · 127 · 16384 < 2³¹).
//! - `Avx2`: 8 output channels × 2 consecutive k as i16 (32 bytes, one
//!   ymm); K padded to 2, N to 8. Activations are i16; the kernel is
//!   `vpmaddwd` (sign-extended products, exact, never saturating), not
//!   `vpmaddubsw`, which saturates to i16.
//! - `Portable`: 8 output channels per k as i16, N padded to 8, i16
//!   activations, left to the compiler's baseline vectoriser.
//!
//! - `Amx`: the `Avx512Vnni` lines with K padded to 64, which are also the
//!   AMX B-tile layout (16 lines of one channel block = one tile of 16 rows
//!   of k / 4 × 16 channels × 4 bytes); `tdpbusd` on 16 × 64-byte activation
//!   tiles, the sums stored and finished by the VNNI epilogue (`x86::amx`).
//!
//! Padding weights are zero, so whatever sits in the activations' padding
//! columns contributes nothing. This file is the only place in the crate
//! with SIMD intrinsics and inline assembly (the AMX tile instructions).
//!
//! Two activation semantics share the GEMMs; what a tile does with its
//! finished sums is the GEMM's output type (`x86::VnniOut`, `x86::Avx2Out`).
//! Dynamic (uncalibrated models): `forward` quantizes each row with its own
//! scale (a vector max-abs pass, then a vector rounding pass) and the tile
//! applies the float epilogue. Static (calibrated models, `StaticLayers`):
//! the input is quantized once with the calibrated scale, and each hidden
//! layer's tile requantizes its accumulators (bias, scale, ReLU as the lower
//! clamp, rounding) straight into the next layer's activation matrix in the
//! kernel's own format (`q + 128` bytes or i16), so activations go from
//! layer to layer as int8 with no pass in between; only the output layer's
//! tile writes floats. The portable variant keeps a separate requantization
//! pass.

use super::aligned::{AlignedBuf, Plain};
use crate::model::{Layer, StaticInt8Layer};

/// Which INT8 kernel a `CpuInt8` backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Kernel {
    /// The reference: one row and one output at a time, no repacking.
    Scalar,
    /// Register-blocked plain Rust, for any CPU.
    Portable,
    /// `vpmaddwd` on 256-bit vectors.
    Avx2,
    /// `vpdpbusd` on 512-bit vectors.
    Avx512Vnni,
    /// `tdpbusd` on AMX tiles (16 rows × 64 bytes), with the VNNI epilogue.
    Amx,
}

impl Int8Kernel {
    pub const ALL: [Int8Kernel; 5] =
        [Int8Kernel::Scalar, Int8Kernel::Portable, Int8Kernel::Avx2, Int8Kernel::Avx512Vnni, Int8Kernel::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Int8Kernel::Scalar => "scalar",
            Int8Kernel::Portable => "portable",
            Int8Kernel::Avx2 => "avx2",
            Int8Kernel::Avx512Vnni => "avx512-vnni",
            Int8Kernel::Amx => "amx",
        }
    }

    /// Whether this CPU can run the variant.
    pub fn is_available(self) -> bool {
        match self {
            Int8Kernel::Scalar | Int8Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => is_x86_feature_detected!("avx2"),
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            // The epilogue is the VNNI one, so AMX needs AVX-512 as well.
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => Int8Kernel::Avx512Vnni.is_available() && x86::amx::ready(),
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni | Int8Kernel::Amx => false,
        }
    }

    /// The fastest variant this CPU runs. AMX comes first: it runs the
    /// VNNI loop below `AMX_ROWS_MIN` rows and on layer shapes where tiles
    /// do not pay (`amx_tiles_pay`), and its tiles elsewhere, which
    /// measured faster than VNNI there (docs/KERNELS.md).
    pub fn best() -> Int8Kernel {
        [Int8Kernel::Amx, Int8Kernel::Avx512Vnni, Int8Kernel::Avx2, Int8Kernel::Portable]
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(Int8Kernel::Portable)
    }

    /// Output channels per packed weight line and k values per group.
    fn shape(self) -> (usize, usize) {
        match self {
            Int8Kernel::Avx512Vnni | Int8Kernel::Amx => (16, 4),
            Int8Kernel::Avx2 => (8, 2),
            Int8Kernel::Scalar | Int8Kernel::Portable => (8, 1),
        }
    }

    /// What K is padded to: a whole AMX tile row of 64 bytes for `Amx`, one
    /// group for the others.
    fn k_align(self) -> usize {
        match self {
            Int8Kernel::Amx => 64,
            k => k.shape().1,
        }
    }

    /// Whether activations are `x_q + 128` bytes (the `vpdpbusd` /
    /// `tdpbusd` operand) rather than i16.
    fn uses_u8(self) -> bool {
        matches!(self, Int8Kernel::Avx512Vnni | Int8Kernel::Amx)
    }

    /// Rows of activations a kernel may read for `rows` rows: AMX loads
    /// whole tiles of 16 rows, whatever the rows past `rows` hold (their
    /// sums are never stored).
    fn rows_read(self, rows: usize) -> usize {
        match self {
            Int8Kernel::Amx => rows.next_multiple_of(AMX_TILE_ROWS),
            _ => rows,
        }
    }
}

/// Rows of an AMX tile.
const AMX_TILE_ROWS: usize = 16;

/// `PackedLayer::amx_rows_min` for `Amx`: on the demo model (80 → 256 →
/// 128 → 1, `bench/kernels.rs` at 1 to 32 rows on a shared Xeon VM, family
/// 6 model 207),
/// the VNNI loop was faster up to 8 rows and a tile from about 12 rows on,
/// dynamic and static alike.
const AMX_ROWS_MIN: usize = 12;

/// How the `Amx` kernel chooses, layer by layer, between its tiles and the
/// VNNI loop on the same packed weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxTiles {
    /// Tiles only on layers whose shape they measured faster on
    /// (`amx_tiles_pay`), for calls of `AMX_ROWS_MIN` rows or more: what
    /// serving uses.
    Measured,
    /// Tiles on every layer from `AMX_ROWS_MIN` rows, whatever its shape:
    /// what `bench/amx_shapes.rs` compares with the VNNI loop.
    Always,
}

/// Whether AMX tiles beat the VNNI loop on a dense layer of `k` inputs and
/// `n` outputs. From `cargo bench --bench amx_shapes` (dynamic activations,
/// 16 to 256 rows; docs/KERNELS.md reads its table): below 48 inputs the
/// tiles lost on most shapes (K is padded to a whole 64-byte tile row, and
/// a block's fixed cost, zeroing, storing and reloading four tiles, is not
/// repaid by a few `tdpbusd`); at 32 rows, a request's usual candidate
/// count, they lost up to K = 80 unless N reached 128; from K = 128 they won
/// at almost every shape.
pub fn amx_tiles_pay(k: usize, n: usize) -> bool {
    k >= 128 || (k >= 64 && n >= 128)
}

/// A layer's weights and per-channel constants in the layout `kernel` reads.
pub struct PackedLayer {
    kernel: Int8Kernel,
    k: usize,
    n: usize,
    k_pad: usize,
    n_pad: usize,
    relu: bool,
    /// `Avx512Vnni` and `Amx` weights; empty otherwise.
    w_i8: AlignedBuf<i8>,
    /// `Avx2` / `Portable` weights; empty otherwise.
    w_i16: AlignedBuf<i16>,
    /// `128 * Σ_k w[o][k]` for `Avx512Vnni` and `Amx`, zero otherwise;
    /// length `n_pad`.
    offset_corr: AlignedBuf<i32>,
    scales: AlignedBuf<f32>,
    bias: AlignedBuf<f32>,
    /// `Amx`: fewer rows than this, in a call or left after its whole tiles
    /// of 16, go through the VNNI loop on the same weights, which is faster
    /// there than a mostly empty tile. 0 otherwise, or tiles only.
    amx_rows_min: usize,
}

impl PackedLayer {
    /// Repacks `layer` for `kernel`, which must be a blocked variant this
    /// CPU runs.
    pub fn new(kernel: Int8Kernel, layer: &Layer) -> PackedLayer {
        PackedLayer::with_tiles(kernel, layer, AmxTiles::Measured)
    }

    /// `new`, with the choice of where `Amx` runs its tiles (ignored by the
    /// other kernels).
    pub fn with_tiles(kernel: Int8Kernel, layer: &Layer, tiles: AmxTiles) -> PackedLayer {
        assert!(kernel != Int8Kernel::Scalar && kernel.is_available());
        let (lanes, group) = kernel.shape();
        let (k, n) = (layer.in_dim, layer.out_dim);
        let (k_pad, n_pad) = (k.next_multiple_of(kernel.k_align()), n.next_multiple_of(lanes));
        let w = |o: usize, kk: usize| {
            if o < n && kk < k {
                layer.weights_i8[o * k + kk]
            } else {
                0
            }
        };
        let groups = k_pad / group;
        let mut w_i8 = AlignedBuf::zeroed(0);
        let mut w_i16 = AlignedBuf::zeroed(0);
        let mut offset_corr = AlignedBuf::zeroed(n_pad);
        // The VNNI lines are the AMX B-tile layout too: 16 consecutive
        // groups of one channel block are one tile of 16 rows (k / 4) × 16
        // channels × 4 bytes, at a stride of 64 bytes.
        if kernel.uses_u8() {
            w_i8 = AlignedBuf::zeroed(n_pad * k_pad);
            let dst = w_i8.as_mut_slice();
            for nb in 0..n_pad / lanes {
                for g in 0..groups {
                    for j in 0..lanes {
                        for t in 0..group {
                            dst[((nb * groups + g) * lanes + j) * group + t] = w(nb * lanes + j, g * group + t);
                        }
                    }
                }
            }
            for (o, c) in offset_corr.as_mut_slice()[..n].iter_mut().enumerate() {
                *c = 128 * layer.weights_i8[o * k..(o + 1) * k].iter().map(|&v| i32::from(v)).sum::<i32>();
            }
        } else {
            w_i16 = AlignedBuf::zeroed(n_pad * k_pad);
            let dst = w_i16.as_mut_slice();
            for nb in 0..n_pad / lanes {
                for g in 0..groups {
                    for j in 0..lanes {
                        for t in 0..group {
                            dst[((nb * groups + g) * lanes + j) * group + t] =
                                i16::from(w(nb * lanes + j, g * group + t));
                        }
                    }
                }
            }
        }
        let padded = |v: &[f32]| {
            let mut b = AlignedBuf::zeroed(n_pad);
            b.as_mut_slice()[..n].copy_from_slice(v);
            b
        };
        PackedLayer {
            kernel,
            k,
            n,
            k_pad,
            n_pad,
            relu: layer.relu,
            w_i8,
            w_i16,
            offset_corr,
            scales: padded(&layer.weight_scales),
            bias: padded(&layer.bias),
            amx_rows_min: match (kernel, tiles) {
                (Int8Kernel::Amx, AmxTiles::Always) => AMX_ROWS_MIN,
                (Int8Kernel::Amx, AmxTiles::Measured) if amx_tiles_pay(k, n) => AMX_ROWS_MIN,
                (Int8Kernel::Amx, AmxTiles::Measured) => usize::MAX,
                _ => 0,
            },
        }
    }

    /// Whether this layer runs AMX tiles for some row counts (an `Amx`
    /// layer whose shape the tiles pay on), rather than only the VNNI loop.
    pub fn uses_tiles(&self) -> bool {
        self.kernel == Int8Kernel::Amx && self.amx_rows_min != usize::MAX
    }

    /// `Amx` on tiles for every row, the VNNI loop for none, so tests reach
    /// the ragged tiles at any row count.
    #[cfg(test)]
    pub(super) fn tiles_only(&mut self) {
        self.amx_rows_min = 0;
    }

    /// Quantizes `rows` rows of `x` (`[rows][k]`) and writes the layer's
    /// outputs to `y` (`[rows][n]`).
    pub fn forward(&self, x: &[f32], rows: usize, y: &mut [f32], s: &mut Scratch) {
        assert!(x.len() >= rows * self.k && y.len() >= rows * self.n);
        assert!(rows <= s.sx.len() && self.kernel.rows_read(rows) * self.k_pad <= s.x_len);
        let (k, k_pad) = (self.k, self.k_pad);
        match self.kernel {
            Int8Kernel::Scalar => unreachable!("PackedLayer::new refuses the scalar kernel"),
            Int8Kernel::Portable => {
                quantize_rows(x, rows, k, k_pad, s.x_i16.as_mut_slice(), &mut s.sx);
                portable::gemm::<false>(self, s.x_i16.as_slice(), rows, &s.sx, y, &mut []);
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => {
                // SAFETY: `new` checked that the CPU has AVX2; the buffer
                // sizes were asserted above, and the output writes only
                // inside `[rows][n]` of `y`.
                unsafe {
                    x86::quantize_rows_avx2(x, rows, k, k_pad, s.x_i16.as_mut_slice(), &mut s.sx);
                    x86::gemm_avx2(self, s.x_i16.as_slice(), rows, &x86::Dynamic { sx: &s.sx, y: y.as_mut_ptr() });
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                // SAFETY: `new` checked that the CPU has AVX-512 F/BW/VL/VNNI;
                // sizes as above.
                unsafe {
                    x86::quantize_rows_avx512(x, rows, k, k_pad, s.x_u8.as_mut_slice(), &mut s.sx);
                    x86::gemm_vnni(self, s.x_u8.as_slice(), rows, &x86::Dynamic { sx: &s.sx, y: y.as_mut_ptr() });
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => {
                // SAFETY: `new` checked AVX-512 F/BW/VL/VNNI and the tile
                // permission; the scratch holds the padded rows the tiles
                // read (asserted above).
                unsafe {
                    x86::quantize_rows_avx512(x, rows, k, k_pad, s.x_u8.as_mut_slice(), &mut s.sx);
                    x86::amx::gemm(self, s.x_u8.as_slice(), rows, &x86::Dynamic { sx: &s.sx, y: y.as_mut_ptr() });
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni | Int8Kernel::Amx => {
                unreachable!("PackedLayer::new refuses unavailable kernels")
            }
        }
    }

    /// The raw i32 accumulators `acc[r][o] = Σ_k xq[r][k] · w[o][k]` for
    /// already-quantized rows `xq` (`[rows][k]`), so tests can compare the
    /// integer part of every variant on its own.
    pub fn accumulate(&self, xq: &[i8], rows: usize, acc: &mut [i32], s: &mut Scratch) {
        assert!(xq.len() >= rows * self.k && acc.len() >= rows * self.n);
        assert!(rows <= s.sx.len() && self.kernel.rows_read(rows) * self.k_pad <= s.x_len);
        let (k, k_pad) = (self.k, self.k_pad);
        match self.kernel {
            Int8Kernel::Scalar => unreachable!("PackedLayer::new refuses the scalar kernel"),
            Int8Kernel::Portable => {
                widen_rows(xq, rows, k, k_pad, s.x_i16.as_mut_slice());
                portable::gemm::<true>(self, s.x_i16.as_slice(), rows, &s.sx, &mut [], acc);
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => {
                widen_rows(xq, rows, k, k_pad, s.x_i16.as_mut_slice());
                // SAFETY: as in `forward`; the output writes only inside
                // `[rows][n]` of `acc`.
                unsafe { x86::gemm_avx2(self, s.x_i16.as_slice(), rows, &x86::Raw(acc.as_mut_ptr())) }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                widen_rows(xq, rows, k, k_pad, s.x_u8.as_mut_slice());
                // SAFETY: as in `forward`.
                unsafe { x86::gemm_vnni(self, s.x_u8.as_slice(), rows, &x86::Raw(acc.as_mut_ptr())) }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => {
                widen_rows(xq, rows, k, k_pad, s.x_u8.as_mut_slice());
                // SAFETY: as in `forward`.
                unsafe { x86::amx::gemm(self, s.x_u8.as_slice(), rows, &x86::Raw(acc.as_mut_ptr())) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni | Int8Kernel::Amx => {
                unreachable!("PackedLayer::new refuses unavailable kernels")
            }
        }
    }
}

/// One layer's constants for the static epilogue, padded to `n_pad` with
/// zeros so whole vectors load them.
struct StaticConsts {
    /// Added to the raw sums: `bias_q[o]`, minus the `x + 128` correction
    /// for VNNI. The subtraction wraps, which is exact: the true sum fits
    /// in i32, so adding it modulo 2³² gives the same value.
    add: AlignedBuf<i32>,
    scale: AlignedBuf<f32>,
    /// The lower clamp: 0 with ReLU, -128 without.
    lo: f32,
    requantize: bool,
}

impl StaticConsts {
    fn new(p: &PackedLayer, l: &StaticInt8Layer) -> StaticConsts {
        assert_eq!(l.bias_q.len(), p.n);
        let mut add = AlignedBuf::zeroed(p.n_pad);
        let corr = p.offset_corr.as_slice();
        for (o, a) in add.as_mut_slice()[..p.n].iter_mut().enumerate() {
            *a = l.bias_q[o].wrapping_sub(corr[o]);
        }
        let mut scale = AlignedBuf::zeroed(p.n_pad);
        scale.as_mut_slice()[..p.n].copy_from_slice(&l.scale);
        StaticConsts { add, scale, lo: f32::from(l.lo), requantize: l.requantize }
    }
}

/// A calibrated model's layers for the static path of a blocked kernel,
/// with the scratch it runs in (sized once for `rows_max` rows).
pub struct StaticLayers {
    kernel: Int8Kernel,
    /// `1 / s_in` of layer 0, rounded to f32 once.
    inv_in_scale: f32,
    layers: Vec<StaticInt8Layer>,
    consts: Vec<StaticConsts>,
    /// Ping-pong activation matrices, `rows_max × width_max` (padded).
    act_u8: [AlignedBuf<u8>; 2],
    act_i16: [AlignedBuf<i16>; 2],
    /// The portable variant's accumulators; empty for the others.
    acc: Vec<i32>,
}

impl StaticLayers {
    /// `packed` are the model's layers packed for `kernel`, one per entry
    /// of `layers`.
    pub fn new(
        kernel: Int8Kernel,
        layers: Vec<StaticInt8Layer>,
        packed: &[PackedLayer],
        width_max: usize,
        rows_max: usize,
    ) -> StaticLayers {
        assert!(kernel != Int8Kernel::Scalar && kernel.is_available() && !layers.is_empty());
        assert!(packed.len() == layers.len() && packed.iter().all(|p| p.kernel == kernel));
        let len = kernel.rows_read(rows_max) * width_max.next_multiple_of(kernel.k_align().max(4));
        let (u8_len, i16_len) = if kernel.uses_u8() { (len, 0) } else { (0, len) };
        let acc_len = if kernel == Int8Kernel::Portable { rows_max * width_max } else { 0 };
        StaticLayers {
            kernel,
            inv_in_scale: 1.0 / layers[0].in_scale,
            consts: packed.iter().zip(&layers).map(|(p, l)| StaticConsts::new(p, l)).collect(),
            layers,
            act_u8: [AlignedBuf::zeroed(u8_len), AlignedBuf::zeroed(u8_len)],
            act_i16: [AlignedBuf::zeroed(i16_len), AlignedBuf::zeroed(i16_len)],
            acc: vec![0; acc_len],
        }
    }

    /// Scores `rows` rows of `x` through `packed` (the layers given to
    /// `new`) into `out`, with the static INT8 semantics.
    pub fn logits(&mut self, packed: &[PackedLayer], x: &[f32], rows: usize, out: &mut [f32]) {
        assert_eq!(packed.len(), self.layers.len());
        assert!(rows * packed[0].k <= x.len());
        assert!(packed.iter().all(|p| self.kernel.rows_read(rows) * p.k_pad <= self.act_len()));
        let last = packed.last().expect("at least one layer");
        assert!(out.len() >= rows * last.n && !self.layers.last().is_some_and(|l| l.requantize));
        assert!(self.layers[..packed.len() - 1].iter().all(|l| l.requantize));
        for (p, next) in packed.iter().zip(&packed[1..]) {
            assert_eq!(p.n, next.k, "layer widths chain");
        }
        let (k0, k0_pad) = (packed[0].k, packed[0].k_pad);
        let inv = self.inv_in_scale;
        match self.kernel {
            Int8Kernel::Scalar => unreachable!("StaticLayers::new refuses the scalar kernel"),
            Int8Kernel::Portable => {
                quantize_static(x, rows, k0, k0_pad, inv, self.act_i16[0].as_mut_slice());
                for (i, (p, l)) in packed.iter().zip(&self.layers).enumerate() {
                    let acc = &mut self.acc[..rows * p.n];
                    let xa = self.act_i16[i % 2].as_slice();
                    portable::gemm::<true>(p, xa, rows, &[], &mut [], acc);
                    if !l.requantize {
                        for (y, &a) in out[..rows].iter_mut().zip(acc.iter()) {
                            *y = (a + l.bias_q[0]) as f32 * l.scale[0];
                        }
                        return;
                    }
                    requantize(acc, rows, l, packed[i + 1].k_pad, self.act_i16[1 - i % 2].as_mut_slice());
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => {
                let [a, b] = &mut self.act_i16;
                // SAFETY: `new` checked AVX2; every activation matrix holds
                // `rows` rows of each layer's `k_pad` (asserted above), the
                // widths chain, so each requantizing output writes the `n`
                // first columns of `rows` rows of stride `next.k_pad >= n`
                // in the other buffer, and the last layer writes `rows * n`
                // floats of `out`.
                unsafe {
                    x86::quantize_static_avx2(x, rows, k0, k0_pad, inv, a.as_mut_slice());
                    for (i, (p, c)) in packed.iter().zip(&self.consts).enumerate() {
                        let (src, dst) = if i % 2 == 0 { (&*a, &mut *b) } else { (&*b, &mut *a) };
                        if c.requantize {
                            let out =
                                x86::Requant { c, dst: dst.as_mut_slice().as_mut_ptr(), stride: packed[i + 1].k_pad };
                            x86::gemm_avx2(p, src.as_slice(), rows, &out);
                        } else {
                            x86::gemm_avx2(p, src.as_slice(), rows, &x86::Logits { c, y: out.as_mut_ptr() });
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                let [a, b] = &mut self.act_u8;
                // SAFETY: as for AVX2, with AVX-512 F/BW/VL/VNNI checked by
                // `new`.
                unsafe {
                    x86::quantize_static_avx512(x, rows, k0, k0_pad, inv, a.as_mut_slice());
                    for (i, (p, c)) in packed.iter().zip(&self.consts).enumerate() {
                        let (src, dst) = if i % 2 == 0 { (&*a, &mut *b) } else { (&*b, &mut *a) };
                        if c.requantize {
                            let out =
                                x86::Requant { c, dst: dst.as_mut_slice().as_mut_ptr(), stride: packed[i + 1].k_pad };
                            x86::gemm_vnni(p, src.as_slice(), rows, &out);
                        } else {
                            x86::gemm_vnni(p, src.as_slice(), rows, &x86::Logits { c, y: out.as_mut_ptr() });
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => {
                let [a, b] = &mut self.act_u8;
                // SAFETY: as for VNNI, with the tile permission checked by
                // `new` and the matrices holding the padded rows the tiles
                // read (asserted above).
                unsafe {
                    x86::quantize_static_avx512(x, rows, k0, k0_pad, inv, a.as_mut_slice());
                    for (i, (p, c)) in packed.iter().zip(&self.consts).enumerate() {
                        let (src, dst) = if i % 2 == 0 { (&*a, &mut *b) } else { (&*b, &mut *a) };
                        if c.requantize {
                            let out =
                                x86::Requant { c, dst: dst.as_mut_slice().as_mut_ptr(), stride: packed[i + 1].k_pad };
                            x86::amx::gemm(p, src.as_slice(), rows, &out);
                        } else {
                            x86::amx::gemm(p, src.as_slice(), rows, &x86::Logits { c, y: out.as_mut_ptr() });
                        }
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni | Int8Kernel::Amx => {
                unreachable!("StaticLayers::new refuses unavailable kernels")
            }
        }
    }

    fn act_len(&self) -> usize {
        self.act_u8[0].as_slice().len().max(self.act_i16[0].as_slice().len())
    }
}

/// Layer 0's input quantization with the calibrated scale:
/// `clamp(round_ties_even(x · inv), -128, 127)`, NaN to 0.
fn quantize_static<T: QuantElem>(x: &[f32], rows: usize, k: usize, k_pad: usize, inv: f32, xq: &mut [T]) {
    for r in 0..rows {
        for (q, v) in xq[r * k_pad..r * k_pad + k].iter_mut().zip(&x[r * k..(r + 1) * k]) {
            *q = T::from_q(round_clamp(v * inv, -128.0));
        }
    }
}

/// Requantizes `[rows][n]` accumulators into the next layer's activation
/// matrix (row stride `stride`), as `model::StaticInt8Layer` defines it.
fn requantize<T: QuantElem>(acc: &[i32], rows: usize, l: &StaticInt8Layer, stride: usize, dst: &mut [T]) {
    let n = l.scale.len();
    let lo = f32::from(l.lo);
    for r in 0..rows {
        let row = acc[r * n..(r + 1) * n].iter().zip(&l.bias_q).zip(&l.scale);
        for (d, ((&a, &b), &s)) in dst[r * stride..r * stride + n].iter_mut().zip(row) {
            *d = T::from_q(round_clamp((a + b) as f32 * s, lo));
        }
    }
}

/// Per-backend scratch: the quantized activation matrix and row scales,
/// sized once for `rows_max` rows of the widest layer.
pub struct Scratch {
    x_u8: AlignedBuf<u8>,
    x_i16: AlignedBuf<i16>,
    /// Elements available in whichever activation buffer the kernel uses.
    x_len: usize,
    sx: Vec<f32>,
}

impl Scratch {
    pub fn new(kernel: Int8Kernel, width_max: usize, rows_max: usize) -> Scratch {
        let x_len = kernel.rows_read(rows_max) * width_max.next_multiple_of(kernel.k_align().max(4));
        let (u8_len, i16_len) = match kernel {
            Int8Kernel::Scalar => (0, 0),
            Int8Kernel::Avx512Vnni | Int8Kernel::Amx => (x_len, 0),
            Int8Kernel::Portable | Int8Kernel::Avx2 => (0, x_len),
        };
        Scratch {
            x_u8: AlignedBuf::zeroed(u8_len),
            x_i16: AlignedBuf::zeroed(i16_len),
            x_len: if kernel == Int8Kernel::Scalar { 0 } else { x_len },
            sx: vec![0.0; rows_max],
        }
    }
}

/// How a quantized activation is stored for a kernel.
pub(super) trait QuantElem: Plain {
    fn from_q(q: i8) -> Self;
}

impl QuantElem for i8 {
    #[inline(always)]
    fn from_q(q: i8) -> i8 {
        q
    }
}

impl QuantElem for i16 {
    #[inline(always)]
    fn from_q(q: i8) -> i16 {
        i16::from(q)
    }
}

impl QuantElem for u8 {
    /// `q + 128` as an unsigned byte, the `vpdpbusd` operand.
    #[inline(always)]
    fn from_q(q: i8) -> u8 {
        (q as u8) ^ 0x80
    }
}

/// Per-row dynamic quantization as the scalar reference defines it, with the
/// rounding done by `round_clamp_127` so it vectorises on any target.
#[inline(always)]
fn quantize_row_into<T: QuantElem>(x: &[f32], xq: &mut [T]) -> f32 {
    let max_abs = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
    let inv = 1.0 / scale;
    for (q, v) in xq.iter_mut().zip(x) {
        *q = T::from_q(round_clamp_127(v * inv));
    }
    scale
}

/// `v.round_ties_even().clamp(-127.0, 127.0) as i8`, without the rounding
/// call: without SSE4.1, `round_ties_even` is a libm call per element.
/// Clamping first is equivalent (the bounds are integers), and adding then
/// subtracting 1.5 · 2²³ rounds any |v| ≤ 127 to an integer with ties to
/// even, because floats near 1.5 · 2²³ are exactly the integers. NaN stays
/// NaN through both steps and converts to 0, as in the reference. A release
/// test checks the equivalence for every f32.
#[inline(always)]
pub(super) fn round_clamp_127(v: f32) -> i8 {
    round_clamp(v, -127.0)
}

/// `v.round_ties_even().clamp(lo, 127.0) as i8` for an integer `lo` in
/// -128..=0, by the same trick as `round_clamp_127`. The rounded sum's
/// bits are `bits(MAGIC) + round(v)` (every value in reach shares MAGIC's
/// exponent), so the integer comes from an integer subtraction rather than
/// a saturating float-to-int cast, which the compiler does not vectorise;
/// NaN, whose bits carry no integer, is selected to 0.
#[inline(always)]
pub(super) fn round_clamp(v: f32, lo: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    let q = (v.clamp(lo, 127.0) + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits()) as i8;
    if v.is_nan() {
        0
    } else {
        q
    }
}

#[inline(always)]
fn quantize_rows<T: QuantElem>(x: &[f32], rows: usize, k: usize, k_pad: usize, xq: &mut [T], sx: &mut [f32]) {
    for r in 0..rows {
        sx[r] = quantize_row_into(&x[r * k..(r + 1) * k], &mut xq[r * k_pad..r * k_pad + k]);
    }
}

fn widen_rows<T: QuantElem>(xq: &[i8], rows: usize, k: usize, k_pad: usize, dst: &mut [T]) {
    for r in 0..rows {
        for (d, &q) in dst[r * k_pad..r * k_pad + k].iter_mut().zip(&xq[r * k..(r + 1) * k]) {
            *d = T::from_q(q);
        }
    }
}

/// The scalar epilogue, written exactly as the reference writes it.
#[inline(always)]
fn epilogue(acc: i32, s_w: f32, s_x: f32, bias: f32, relu: bool) -> f32 {
    let v = acc as f32 * (s_w * s_x) + bias;
    if relu {
        v.max(0.0)
    } else {
        v
    }
}

mod portable {
    use super::{epilogue, PackedLayer};

    const LANES: usize = 8;
    const MR: usize = 4;

    pub(super) fn gemm<const RAW: bool>(
        p: &PackedLayer,
        xa: &[i16],
        rows: usize,
        sx: &[f32],
        y: &mut [f32],
        acc_out: &mut [i32],
    ) {
        let mut r = 0;
        while r + MR <= rows {
            for b in 0..p.n_pad / LANES {
                tile::<MR, RAW>(p, xa, r, b, sx, y, acc_out);
            }
            r += MR;
        }
        for r in r..rows {
            for b in 0..p.n_pad / LANES {
                tile::<1, RAW>(p, xa, r, b, sx, y, acc_out);
            }
        }
    }

    /// The tile's sums, kept out of line so that both epilogues get the
    /// same vectorised loop (inlined into the raw one, the compiler left it
    /// scalar).
    #[inline(never)]
    fn sums<const M: usize>(p: &PackedLayer, xa: &[i16], r0: usize, b: usize) -> [[i32; LANES]; M] {
        let w = &p.w_i16.as_slice()[b * p.k_pad * LANES..(b + 1) * p.k_pad * LANES];
        let xs: [&[i16]; M] = std::array::from_fn(|r| &xa[(r0 + r) * p.k_pad..][..p.k_pad]);
        let mut acc = [[0i32; LANES]; M];
        // Products of two sign-extended i16 become `pmaddwd` on plain SSE2.
        for (kk, wl) in w.chunks_exact(LANES).enumerate() {
            for (acc_r, x_r) in acc.iter_mut().zip(&xs) {
                let x = i32::from(x_r[kk]);
                for (a, &wv) in acc_r.iter_mut().zip(wl) {
                    *a += x * i32::from(wv);
                }
            }
        }
        acc
    }

    #[inline(always)]
    fn tile<const M: usize, const RAW: bool>(
        p: &PackedLayer,
        xa: &[i16],
        r0: usize,
        b: usize,
        sx: &[f32],
        y: &mut [f32],
        acc_out: &mut [i32],
    ) {
        let acc = sums::<M>(p, xa, r0, b);
        let o0 = b * LANES;
        let lanes = (p.n - o0).min(LANES);
        for (r, acc_r) in acc.iter().enumerate() {
            let row = r0 + r;
            for (j, &a) in acc_r[..lanes].iter().enumerate() {
                let o = o0 + j;
                if RAW {
                    acc_out[row * p.n + o] = a;
                } else {
                    y[row * p.n + o] = epilogue(a, p.scales.as_slice()[o], sx[row], p.bias.as_slice()[o], p.relu);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
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
    #[cfg(test)]
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
    #[cfg(test)]
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
    pub(super) unsafe fn quantize_static_avx512(
        x: &[f32],
        rows: usize,
        k: usize,
        k_pad: usize,
        inv: f32,
        xq: &mut [u8],
    ) {
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
    pub(super) unsafe fn quantize_static_avx2(
        x: &[f32],
        rows: usize,
        k: usize,
        k_pad: usize,
        inv: f32,
        xq: &mut [i16],
    ) {
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

    /// The AMX-INT8 GEMM: `tdpbusd` on tiles, the VNNI epilogue on the
    /// stored sums.
    ///
    /// Rust has no stable AMX intrinsics, so the tile instructions are
    /// inline assembly, one instruction per `asm!`. The tile registers are
    /// not a register class the compiler knows or ever uses, so their
    /// contents persist from one `asm!` to the next; every block that
    /// touches memory says so (`readonly` for loads, nothing for the stores
    /// the epilogue then reads), and blocks without `pure` stay in order.
    pub(super) mod amx {
        use std::arch::asm;
        use std::arch::x86_64::*;
        use std::sync::OnceLock;

        use super::{mask16, PackedLayer, VnniOut};

        /// Channels per tile (16 i32 columns of 64 bytes) and rows per tile.
        const LANES: usize = 16;
        const ROWS: usize = super::super::AMX_TILE_ROWS;
        /// Bytes of K per tile step: one 64-byte tile row of activations,
        /// 16 rows of 4 k of weights.
        const K_STEP: usize = 64;

        /// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits
        /// 24 and 25; `is_x86_feature_detected!` names them only on nightly)
        /// and the kernel granted this process the tile data state, which
        /// Linux hands out on request only (`arch_prctl`). Asked once per
        /// process; a refusal is logged once.
        pub(in super::super) fn ready() -> bool {
            static READY: OnceLock<bool> = OnceLock::new();
            *READY.get_or_init(|| {
                if __cpuid(0).eax < 7 {
                    return false;
                }
                let edx = __cpuid_count(7, 0).edx;
                if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 {
                    return false;
                }
                permitted()
            })
        }

        #[cfg(target_os = "linux")]
        fn permitted() -> bool {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a system call with two integer arguments and no
            // memory; it changes only which state the kernel saves for
            // this process.
            let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
            if r != 0 {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "the CPU has AMX but the kernel refused the tile data permission (arch_prctl); \
                     the INT8 backend uses avx512-vnni instead"
                );
            }
            r == 0
        }

        #[cfg(not(target_os = "linux"))]
        fn permitted() -> bool {
            false
        }

        /// `ldtilecfg`'s 64-byte operand: palette 1, tiles 0 to 7 all 16
        /// rows × 64 bytes. Ragged edges are handled outside the tiles
        /// (padded rows, K and channels), so one configuration serves
        /// every shape.
        #[repr(C, align(64))]
        struct TileConfig([u8; 64]);

        const CONFIG: TileConfig = {
            let mut c = [0u8; 64];
            c[0] = 1;
            let mut t = 0;
            while t < 8 {
                // Bytes per row (u16 at 16 + 2t), then rows (u8 at 48 + t).
                c[16 + 2 * t] = K_STEP as u8;
                c[48 + t] = ROWS as u8;
                t += 1;
            }
            TileConfig(c)
        };

        /// The four accumulator tiles of a block, stored for the epilogue:
        /// tile `2i + j` is rows `16i..` × channel block `j`.
        #[repr(C, align(64))]
        struct Sums([[i32; ROWS * LANES]; 4]);

        /// `tileloadd tmm{T}` of 16 rows of 64 bytes, `stride` bytes apart.
        ///
        /// # Safety
        /// A tile configuration is loaded; 16 rows of 64 bytes at `p` with
        /// this stride are readable.
        #[inline(always)]
        unsafe fn load<const T: u8>(p: *const u8, stride: usize) {
            // SAFETY: forwarded to the caller.
            unsafe {
                asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride,
                    options(nostack, readonly, preserves_flags));
            }
        }

        /// `tilestored` of tile `T` (16 rows of 16 i32) at `p`, 64 bytes a row.
        ///
        /// # Safety
        /// A tile configuration is loaded; 1 KiB at `p` is writable.
        #[inline(always)]
        unsafe fn store<const T: u8>(p: *mut i32) {
            // SAFETY: forwarded to the caller.
            unsafe {
                asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) K_STEP,
                    options(nostack, preserves_flags));
            }
        }

        /// # Safety
        /// A tile configuration is loaded.
        #[inline(always)]
        unsafe fn zero<const T: u8>() {
            // SAFETY: register-only; forwarded to the caller.
            unsafe { asm!("tilezero tmm{t}", t = const T, options(nostack, nomem, preserves_flags)) }
        }

        /// `tmm{C} += tmm{A} (u8) · tmm{B} (i8)`, 4 k per i32 lane.
        ///
        /// # Safety
        /// A tile configuration is loaded.
        #[inline(always)]
        unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>() {
            // SAFETY: register-only; forwarded to the caller.
            unsafe {
                asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                    options(nostack, nomem, preserves_flags));
            }
        }

        /// Sums of `MT` × 16 rows from `x` (row stride `k_pad`) against
        /// `NT` channel blocks starting at `w` (block stride `groups` lines
        /// of 64 bytes), over all of K, into `sums`.
        ///
        /// # Safety
        /// A tile configuration is loaded; `x` holds `MT · 16` rows of
        /// `k_pad` bytes, `w` `NT` blocks of `k_pad / 4` lines.
        #[inline(always)]
        unsafe fn block<const MT: usize, const NT: usize>(x: *const u8, k_pad: usize, w: *const i8, sums: &mut Sums) {
            let block_bytes = k_pad * LANES;
            // SAFETY: every load stays inside the caller's rows and blocks:
            // activation tiles at k offsets below `k_pad`, rows below
            // `MT · 16`; weight tiles 16 lines of 64 bytes inside a block.
            unsafe {
                zero::<0>();
                if NT == 2 {
                    zero::<1>();
                }
                if MT == 2 {
                    zero::<2>();
                    if NT == 2 {
                        zero::<3>();
                    }
                }
                for kc in (0..k_pad).step_by(K_STEP) {
                    let w0 = w.add(kc * LANES).cast::<u8>();
                    load::<4>(x.add(kc), k_pad);
                    load::<6>(w0, K_STEP);
                    if NT == 2 {
                        load::<7>(w0.add(block_bytes), K_STEP);
                    }
                    dpbusd::<0, 4, 6>();
                    if NT == 2 {
                        dpbusd::<1, 4, 7>();
                    }
                    if MT == 2 {
                        load::<5>(x.add(ROWS * k_pad + kc), k_pad);
                        dpbusd::<2, 5, 6>();
                        if NT == 2 {
                            dpbusd::<3, 5, 7>();
                        }
                    }
                }
                store::<0>(sums.0[0].as_mut_ptr());
                if NT == 2 {
                    store::<1>(sums.0[1].as_mut_ptr());
                }
                if MT == 2 {
                    store::<2>(sums.0[2].as_mut_ptr());
                    if NT == 2 {
                        store::<3>(sums.0[3].as_mut_ptr());
                    }
                }
            }
        }

        /// Rows in blocks of 32 (two A tiles), channels in blocks of 32 (two
        /// B tiles): four accumulator tiles, so each tile load feeds two
        /// `tdpbusd`. Each block's sums are stored to the stack and each row
        /// of 16 channels goes through `out.finish`, the VNNI epilogue, so
        /// every output is bit for bit the VNNI one. Rows past `rows` in the
        /// last tile are computed from whatever the activation matrix holds
        /// there and never stored. A call of fewer than `p.amx_rows_min`
        /// rows, or that many left after whole tiles, has those rows done
        /// by `gemm_vnni_rows` instead (the same sums, the same epilogue).
        ///
        /// # Safety
        /// The CPU must support AVX-512 F/BW/VL/VNNI and AMX-INT8, and this
        /// process must hold the tile permission (`ready()`); `p` must be
        /// packed for `Amx`; `xa` must hold `rows` rows of `p.k_pad` bytes
        /// (checked: and be readable up to the next multiple of 16 rows);
        /// `out` must be valid for `rows` rows of `p.n` channels.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(in super::super) unsafe fn gemm<O: VnniOut>(p: &PackedLayer, xa: &[u8], rows: usize, out: &O) {
            assert!(p.k_pad.is_multiple_of(K_STEP) && p.n_pad.is_multiple_of(LANES));
            assert!(xa.len() >= rows.next_multiple_of(ROWS) * p.k_pad);
            assert!(p.w_i8.as_slice().len() == p.n_pad * p.k_pad);
            let left = rows % ROWS;
            let tiled = match rows {
                _ if rows < p.amx_rows_min => 0,
                _ if left < p.amx_rows_min => rows - left,
                _ => rows,
            };
            if tiled < rows {
                // SAFETY: the caller's contract covers `gemm_vnni`'s.
                unsafe { super::gemm_vnni_rows(p, xa, tiled, rows, out) };
            }
            if tiled == 0 {
                return;
            }
            let blocks = p.n_pad / LANES;
            let w = p.w_i8.as_slice().as_ptr();
            let mut sums = Sums([[0; ROWS * LANES]; 4]);
            load_config();
            let rows = tiled;
            for r0 in (0..rows).step_by(2 * ROWS) {
                let row_tiles = if rows - r0 > ROWS { 2 } else { 1 };
                let x = xa[r0 * p.k_pad..].as_ptr();
                for b0 in (0..blocks).step_by(2) {
                    let wb = w.wrapping_add(b0 * p.k_pad * LANES);
                    // SAFETY: the configuration is loaded; `row_tiles` tiles
                    // of rows from `r0` end at or below `rows` rounded up to
                    // 16, inside `xa` (asserted); `b0` and the next block
                    // are below `blocks` when two are used.
                    unsafe {
                        match (row_tiles, blocks - b0 > 1) {
                            (2, true) => block::<2, 2>(x, p.k_pad, wb, &mut sums),
                            (2, false) => block::<2, 1>(x, p.k_pad, wb, &mut sums),
                            (_, true) => block::<1, 2>(x, p.k_pad, wb, &mut sums),
                            (_, false) => block::<1, 1>(x, p.k_pad, wb, &mut sums),
                        }
                    }
                    for j in 0..(blocks - b0).min(2) {
                        let o0 = (b0 + j) * LANES;
                        let mask = mask16(p.n - o0.min(p.n));
                        for i in 0..row_tiles {
                            let tile = &sums.0[2 * i + j];
                            for r in 0..(rows - r0 - i * ROWS).min(ROWS) {
                                // SAFETY: an aligned load of one stored row
                                // of 16 sums; the row is below `rows` and the
                                // block below `n_pad`, as `finish` needs.
                                unsafe {
                                    let acc = _mm512_load_si512(tile[r * LANES..].as_ptr().cast());
                                    out.finish(p, r0 + i * ROWS + r, o0, mask, acc);
                                }
                            }
                        }
                    }
                }
            }
        }

        /// Releases this thread's tiles (`tilerelease`: configuration and
        /// data back to their initial state), as other AMX code may between
        /// two calls, so a test can check that the next call configures
        /// them again.
        ///
        /// # Safety
        /// The tile permission is held (`ready()`).
        #[cfg(test)]
        pub(in super::super) unsafe fn release() {
            // SAFETY: no operands; forwarded to the caller.
            unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
        }

        /// Makes `CONFIG` this thread's tile configuration. `ldtilecfg`
        /// costs about 150 ns here (it also zeroes every tile), several
        /// times a small layer's tiles, so the current one is read back
        /// first (`sttilecfg`, about 25 ns) and loaded only when it differs:
        /// on a thread's first call, or after other code on the thread
        /// configured the tiles its own way or released them. The tiles are
        /// not released after a call: the state stays in use, which costs
        /// only the 8 KiB the kernel saves at a context switch.
        #[inline(always)]
        fn load_config() {
            let mut current = TileConfig([0; 64]);
            // SAFETY: `sttilecfg` writes the 64 bytes of `current` (all zero
            // when the tiles are not configured).
            unsafe { asm!("sttilecfg [{}]", in(reg) &mut current, options(nostack, preserves_flags)) };
            if current.0 != CONFIG.0 {
                // SAFETY: the configuration is a 64-byte aligned constant
                // that the CPU accepts (palette 1, 8 tiles within its
                // limits of 16 rows × 64 bytes).
                unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
            }
        }
    }

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
}

/// `round_clamp(v, lo)` over a slice with `kernel`'s vector rounding (the
/// scalar one for the others), so a test can compare each with the
/// reference for every f32.
#[cfg(test)]
pub(super) fn round_clamp_slice(kernel: Int8Kernel, v: &[f32], lo: f32, out: &mut [i8]) {
    assert!(kernel.is_available());
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU features were just checked.
        Int8Kernel::Avx512Vnni | Int8Kernel::Amx => unsafe { x86::round_clamp_slice_avx512(v, lo, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Int8Kernel::Avx2 => unsafe { x86::round_clamp_slice_avx2(v, lo, out) },
        _ => {
            for (o, &x) in out.iter_mut().zip(v) {
                *o = round_clamp(x, lo);
            }
        }
    }
}

/// Releases this thread's AMX tiles, as other AMX code on the thread may;
/// nothing without AMX.
#[cfg(test)]
pub(super) fn release_amx_tiles() {
    #[cfg(target_arch = "x86_64")]
    if Int8Kernel::Amx.is_available() {
        // SAFETY: `is_available` checked the tile permission.
        unsafe { x86::amx::release() }
    }
}

/// Runs `iterations` rounds of 16 independent `vpdpbusd` instructions on
/// register operands, with no memory traffic, and returns a checksum so the
/// work cannot be optimised away; `None` without AVX-512 VNNI. Each round is
/// 16 × 64 = 1024 multiply-accumulates, so timing it gives this core's peak
/// INT8 MAC rate, the yardstick for the GEMM benchmarks.
pub fn vnni_peak_probe(iterations: u64) -> Option<i32> {
    #[cfg(target_arch = "x86_64")]
    if Int8Kernel::Avx512Vnni.is_available() {
        // SAFETY: the CPU features were just checked.
        return Some(unsafe { x86::peak_vnni(iterations) });
    }
    let _ = iterations;
    None
}

/// Multiply-accumulates per `vnni_peak_probe` iteration.
pub const VNNI_PEAK_MACS_PER_ITERATION: u64 = 16 * 64;
