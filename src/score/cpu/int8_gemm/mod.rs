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

mod portable;

#[cfg(target_arch = "x86_64")]
mod x86;

/// `round_clamp(v, lo)` over a slice with `kernel`'s vector rounding (the
/// scalar one for the others), so a test can compare each with the
/// reference for every f32.
// Its one caller, the every-f32 test, runs only in optimized builds.
#[cfg(all(test, not(debug_assertions)))]
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
