//! INT8 GEMM kernels for the CPU INT8 backend, one variant per instruction set.
//!
//! A layer's input rows are quantized together into one activation matrix,
//! multiplied by weights repacked once at construction, and the epilogue
//! (scale, bias, ReLU) is applied to each output tile while it is still in
//! registers. Every variant reproduces the scalar reference in `super` bit
//! for bit: the integer sums are exact, and the float steps are the same IEEE
//! operations in the same order (`acc as f32 * (s_w * s_x) + bias`, never a
//! fused multiply-add).
//!
//! Layouts, chosen so that one vector load fetches the weights a kernel step
//! needs and activations are broadcast:
//! - `Avx512Vnni`: 16 output channels × 4 consecutive k as 64 bytes (one zmm);
//!   K padded to 4, N to 16. `vpdpbusd` multiplies unsigned by signed bytes,
//!   so activations are stored as `x_q + 128` (u8) and `128 * Σ_k w[o][k]`,
//!   precomputed here, is subtracted from each accumulator. Both sums fit in
//!   i32 for any K up to `WIDTH_MAX` (255 · 127 · 16384 < 2³¹).
//! - `Avx2`: 8 output channels × 2 consecutive k as i16 (32 bytes, one
//!   ymm); K padded to 2, N to 8. Activations are i16; the kernel is
//!   `vpmaddwd` (sign-extended products, exact, never saturating), not
//!   `vpmaddubsw`, which saturates to i16.
//! - `Portable`: 8 output channels per k as i16, N padded to 8, i16
//!   activations, left to the compiler's baseline vectoriser.
//!
//! Padding weights are zero, so whatever sits in the activations' padding
//! columns contributes nothing. This file is the only place in the crate
//! with SIMD intrinsics.
//!
//! Two activation semantics share the GEMMs. Dynamic (uncalibrated models):
//! `forward` quantizes each row with its own scale and applies the float
//! epilogue in the tile. Static (calibrated models, `StaticLayers`): the
//! input is quantized once with the calibrated scale, every layer's i32
//! accumulators are requantized to int8 straight into the next layer's
//! activation matrix in the kernel's own format (`q + 128` bytes or i16), and
//! only the last layer produces floats. The static requantization runs as a
//! separate pass over each layer's accumulators (compiled with the kernel's
//! instruction set), not yet inside the tile.

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
}

impl Int8Kernel {
    pub const ALL: [Int8Kernel; 4] =
        [Int8Kernel::Scalar, Int8Kernel::Portable, Int8Kernel::Avx2, Int8Kernel::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Int8Kernel::Scalar => "scalar",
            Int8Kernel::Portable => "portable",
            Int8Kernel::Avx2 => "avx2",
            Int8Kernel::Avx512Vnni => "avx512-vnni",
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
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni => false,
        }
    }

    /// The fastest variant this CPU runs.
    pub fn best() -> Int8Kernel {
        [Int8Kernel::Avx512Vnni, Int8Kernel::Avx2, Int8Kernel::Portable]
            .into_iter()
            .find(|k| k.is_available())
            .unwrap_or(Int8Kernel::Portable)
    }

    /// Output channels per packed weight line and k values per group.
    fn shape(self) -> (usize, usize) {
        match self {
            Int8Kernel::Avx512Vnni => (16, 4),
            Int8Kernel::Avx2 => (8, 2),
            Int8Kernel::Scalar | Int8Kernel::Portable => (8, 1),
        }
    }
}

/// A layer's weights and per-channel constants in the layout `kernel` reads.
pub struct PackedLayer {
    kernel: Int8Kernel,
    k: usize,
    n: usize,
    k_pad: usize,
    n_pad: usize,
    relu: bool,
    /// `Avx512Vnni` weights; empty otherwise.
    w_i8: AlignedBuf<i8>,
    /// `Avx2` / `Portable` weights; empty otherwise.
    w_i16: AlignedBuf<i16>,
    /// `128 * Σ_k w[o][k]` for `Avx512Vnni`, zero otherwise; length `n_pad`.
    offset_corr: AlignedBuf<i32>,
    scales: AlignedBuf<f32>,
    bias: AlignedBuf<f32>,
}

impl PackedLayer {
    /// Repacks `layer` for `kernel`, which must be a blocked variant this
    /// CPU runs.
    pub fn new(kernel: Int8Kernel, layer: &Layer) -> PackedLayer {
        assert!(kernel != Int8Kernel::Scalar && kernel.is_available());
        let (lanes, group) = kernel.shape();
        let (k, n) = (layer.in_dim, layer.out_dim);
        let (k_pad, n_pad) = (k.next_multiple_of(group), n.next_multiple_of(lanes));
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
        if kernel == Int8Kernel::Avx512Vnni {
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
        }
    }

    /// Quantizes `rows` rows of `x` (`[rows][k]`) and writes the layer's
    /// outputs to `y` (`[rows][n]`).
    pub fn forward(&self, x: &[f32], rows: usize, y: &mut [f32], s: &mut Scratch) {
        assert!(x.len() >= rows * self.k && y.len() >= rows * self.n);
        assert!(rows <= s.sx.len() && rows * self.k_pad <= s.x_len);
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
                // sizes were asserted above, and `gemm` writes only inside
                // `[rows][n]` of `y`.
                unsafe {
                    x86::quantize_rows_avx2(x, rows, k, k_pad, s.x_i16.as_mut_slice(), &mut s.sx);
                    x86::gemm_avx2::<false>(
                        self,
                        s.x_i16.as_slice(),
                        rows,
                        &s.sx,
                        y.as_mut_ptr(),
                        std::ptr::null_mut(),
                    );
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                // SAFETY: `new` checked that the CPU has AVX-512 F/BW/VNNI;
                // sizes as above.
                unsafe {
                    x86::quantize_rows_avx512(x, rows, k, k_pad, s.x_u8.as_mut_slice(), &mut s.sx);
                    x86::gemm_vnni::<false>(self, s.x_u8.as_slice(), rows, &s.sx, y.as_mut_ptr(), std::ptr::null_mut());
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni => unreachable!("PackedLayer::new refuses unavailable kernels"),
        }
    }

    /// The raw i32 accumulators `acc[r][o] = Σ_k xq[r][k] · w[o][k]` for
    /// already-quantized rows `xq` (`[rows][k]`), so tests can compare the
    /// integer part of every variant on its own.
    pub fn accumulate(&self, xq: &[i8], rows: usize, acc: &mut [i32], s: &mut Scratch) {
        assert!(xq.len() >= rows * self.k && acc.len() >= rows * self.n);
        assert!(rows <= s.sx.len() && rows * self.k_pad <= s.x_len);
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
                // SAFETY: as in `forward`; `gemm` writes only inside
                // `[rows][n]` of `acc`.
                unsafe {
                    x86::gemm_avx2::<true>(
                        self,
                        s.x_i16.as_slice(),
                        rows,
                        &s.sx,
                        std::ptr::null_mut(),
                        acc.as_mut_ptr(),
                    );
                }
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                widen_rows(xq, rows, k, k_pad, s.x_u8.as_mut_slice());
                // SAFETY: as in `forward`.
                unsafe {
                    x86::gemm_vnni::<true>(
                        self,
                        s.x_u8.as_slice(),
                        rows,
                        &s.sx,
                        std::ptr::null_mut(),
                        acc.as_mut_ptr(),
                    );
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Int8Kernel::Avx2 | Int8Kernel::Avx512Vnni => unreachable!("PackedLayer::new refuses unavailable kernels"),
        }
    }
}

/// The activation matrix of one layer for the static path, in the layout
/// the kernel reads.
enum ActRef<'a> {
    U8(&'a [u8]),
    I16(&'a [i16]),
}

impl PackedLayer {
    /// Raw accumulators for an activation matrix already in this kernel's
    /// format (`[rows][k_pad]`).
    fn accumulate_prepared(&self, xa: ActRef<'_>, rows: usize, acc: &mut [i32]) {
        assert!(acc.len() >= rows * self.n);
        let no_scales = [0.0f32; 0];
        match (self.kernel, xa) {
            (Int8Kernel::Portable, ActRef::I16(xa)) => {
                assert!(xa.len() >= rows * self.k_pad);
                portable::gemm::<true>(self, xa, rows, &no_scales, &mut [], acc);
            }
            #[cfg(target_arch = "x86_64")]
            (Int8Kernel::Avx2, ActRef::I16(xa)) => {
                // SAFETY: `new` checked AVX2; `gemm_avx2` asserts the
                // activation size and writes `rows * n` accumulators, which
                // `acc` holds (asserted above). RAW mode reads no scales.
                unsafe { x86::gemm_avx2::<true>(self, xa, rows, &no_scales, std::ptr::null_mut(), acc.as_mut_ptr()) }
            }
            #[cfg(target_arch = "x86_64")]
            (Int8Kernel::Avx512Vnni, ActRef::U8(xa)) => {
                // SAFETY: as above, with AVX-512 F/BW/VNNI checked by `new`.
                unsafe { x86::gemm_vnni::<true>(self, xa, rows, &no_scales, std::ptr::null_mut(), acc.as_mut_ptr()) }
            }
            (kernel, _) => unreachable!("{kernel:?}: activation format does not match the kernel"),
        }
    }
}

/// A calibrated model's layers for the static path of a blocked kernel,
/// with the scratch it runs in (sized once for `rows_max` rows).
pub struct StaticLayers {
    kernel: Int8Kernel,
    /// `1 / s_in` of layer 0, rounded to f32 once.
    inv_in_scale: f32,
    layers: Vec<StaticInt8Layer>,
    /// Ping-pong activation matrices, `rows_max × width_max` (padded).
    act_u8: [AlignedBuf<u8>; 2],
    act_i16: [AlignedBuf<i16>; 2],
    acc: Vec<i32>,
}

impl StaticLayers {
    pub fn new(kernel: Int8Kernel, layers: Vec<StaticInt8Layer>, width_max: usize, rows_max: usize) -> StaticLayers {
        assert!(kernel != Int8Kernel::Scalar && kernel.is_available() && !layers.is_empty());
        let len = rows_max * width_max.next_multiple_of(4);
        let (u8_len, i16_len) = if kernel == Int8Kernel::Avx512Vnni { (len, 0) } else { (0, len) };
        StaticLayers {
            kernel,
            inv_in_scale: 1.0 / layers[0].in_scale,
            layers,
            act_u8: [AlignedBuf::zeroed(u8_len), AlignedBuf::zeroed(u8_len)],
            act_i16: [AlignedBuf::zeroed(i16_len), AlignedBuf::zeroed(i16_len)],
            acc: vec![0; rows_max * width_max],
        }
    }

    /// Scores `rows` rows of `x` through `packed` (one per layer, packed for
    /// the same kernel) into `out`, with the static INT8 semantics.
    pub fn logits(&mut self, packed: &[PackedLayer], x: &[f32], rows: usize, out: &mut [f32]) {
        assert_eq!(packed.len(), self.layers.len());
        assert!(out.len() >= rows && rows * packed[0].k <= x.len());
        assert!(packed.iter().all(|p| rows * p.n <= self.acc.len() && rows * p.k_pad <= self.act_len()));
        let kernel = self.kernel;
        let (k0, k0_pad) = (packed[0].k, packed[0].k_pad);
        let inv = self.inv_in_scale;
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `new` checked the CPU features; sizes asserted above.
            Int8Kernel::Avx512Vnni => unsafe {
                x86::quantize_static_avx512(x, rows, k0, k0_pad, inv, self.act_u8[0].as_mut_slice())
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Int8Kernel::Avx2 => unsafe {
                x86::quantize_static_avx2(x, rows, k0, k0_pad, inv, self.act_i16[0].as_mut_slice())
            },
            _ => quantize_static(x, rows, k0, k0_pad, inv, self.act_i16[0].as_mut_slice()),
        }
        for (i, (p, l)) in packed.iter().zip(&self.layers).enumerate() {
            let (cur, next) = (i % 2, 1 - i % 2);
            let acc = &mut self.acc[..rows * p.n];
            let xa = if kernel == Int8Kernel::Avx512Vnni {
                ActRef::U8(self.act_u8[cur].as_slice())
            } else {
                ActRef::I16(self.act_i16[cur].as_slice())
            };
            p.accumulate_prepared(xa, rows, acc);
            if !l.requantize {
                assert_eq!(p.n, 1, "the output layer has one logit");
                for (y, &a) in out[..rows].iter_mut().zip(acc.iter()) {
                    *y = (a + l.bias_q[0]) as f32 * l.scale[0];
                }
                return;
            }
            let stride = packed[i + 1].k_pad;
            match kernel {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `new` checked the CPU features.
                Int8Kernel::Avx512Vnni => unsafe {
                    x86::requantize_avx512(acc, rows, l, stride, self.act_u8[next].as_mut_slice())
                },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Int8Kernel::Avx2 => unsafe {
                    x86::requantize_avx2(acc, rows, l, stride, self.act_i16[next].as_mut_slice())
                },
                _ => requantize(acc, rows, l, stride, self.act_i16[next].as_mut_slice()),
            }
        }
        unreachable!("the last layer returns");
    }

    fn act_len(&self) -> usize {
        self.act_u8[0].as_slice().len().max(self.act_i16[0].as_slice().len())
    }
}

/// Layer 0's input quantization with the calibrated scale:
/// `clamp(round_ties_even(x · inv), -128, 127)`, NaN to 0.
#[inline(always)]
fn quantize_static<T: QuantElem>(x: &[f32], rows: usize, k: usize, k_pad: usize, inv: f32, xq: &mut [T]) {
    for r in 0..rows {
        for (q, v) in xq[r * k_pad..r * k_pad + k].iter_mut().zip(&x[r * k..(r + 1) * k]) {
            *q = T::from_q(round_clamp(v * inv, -128.0));
        }
    }
}

/// Requantizes `[rows][n]` accumulators into the next layer's activation
/// matrix (row stride `stride`), as `model::StaticInt8Layer` defines it.
#[inline(always)]
fn requantize<T: QuantElem>(acc: &[i32], rows: usize, l: &StaticInt8Layer, stride: usize, dst: &mut [T]) {
    let n = l.scale.len();
    let lo = f32::from(l.lo);
    for r in 0..rows {
        let row = &acc[r * n..(r + 1) * n];
        for (o, (d, &a)) in dst[r * stride..r * stride + n].iter_mut().zip(row).enumerate() {
            *d = T::from_q(round_clamp((a + l.bias_q[o]) as f32 * l.scale[o], lo));
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
        let x_len = rows_max * width_max.next_multiple_of(4);
        let (u8_len, i16_len) = match kernel {
            Int8Kernel::Scalar => (0, 0),
            Int8Kernel::Avx512Vnni => (x_len, 0),
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
/// -128..=0, by the same trick as `round_clamp_127`.
#[inline(always)]
pub(super) fn round_clamp(v: f32, lo: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    ((v.clamp(lo, 127.0) + MAGIC) - MAGIC) as i8
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

    use super::{quantize_rows, quantize_static, requantize, PackedLayer};
    use crate::model::StaticInt8Layer;

    /// `quantize_static` compiled with AVX-512, for the VNNI kernel.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_static_avx512(
        x: &[f32],
        rows: usize,
        k: usize,
        k_pad: usize,
        inv: f32,
        xq: &mut [u8],
    ) {
        quantize_static(x, rows, k, k_pad, inv, xq);
    }

    /// `quantize_static` compiled with AVX2.
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
        quantize_static(x, rows, k, k_pad, inv, xq);
    }

    /// `requantize` compiled with AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn requantize_avx512(
        acc: &[i32],
        rows: usize,
        l: &StaticInt8Layer,
        stride: usize,
        dst: &mut [u8],
    ) {
        requantize(acc, rows, l, stride, dst);
    }

    /// `requantize` compiled with AVX2.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn requantize_avx2(
        acc: &[i32],
        rows: usize,
        l: &StaticInt8Layer,
        stride: usize,
        dst: &mut [i16],
    ) {
        requantize(acc, rows, l, stride, dst);
    }

    /// `quantize_rows` compiled with AVX2 so its rounding and conversions
    /// become vector instructions; the arithmetic is unchanged.
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
        quantize_rows(x, rows, k, k_pad, xq, sx);
    }

    /// As `quantize_rows_avx2`, with AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_rows_avx512(
        x: &[f32],
        rows: usize,
        k: usize,
        k_pad: usize,
        xq: &mut [u8],
        sx: &mut [f32],
    ) {
        quantize_rows(x, rows, k, k_pad, xq, sx);
    }

    const VNNI_LANES: usize = 16;
    const VNNI_MR: usize = 4;
    const VNNI_NB: usize = 4;

    /// Rows in blocks of 4, output channels in blocks of 4 × 16: 16 zmm
    /// accumulators, so each weight load feeds 4 rows and each activation
    /// broadcast feeds 64 channels.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VNNI; `p` must be packed for
    /// `Avx512Vnni`; `xa` must hold `rows` rows of `p.k_pad` bytes; when
    /// `RAW`, `acc` must be valid for `rows * p.n` writes, otherwise `y`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn gemm_vnni<const RAW: bool>(
        p: &PackedLayer,
        xa: &[u8],
        rows: usize,
        sx: &[f32],
        y: *mut f32,
        acc: *mut i32,
    ) {
        assert!(xa.len() >= rows * p.k_pad && (RAW || sx.len() >= rows));
        let blocks = p.n_pad / VNNI_LANES;
        let mut r = 0;
        // SAFETY (all tile calls): the caller's contract, plus `r + M <= rows`
        // and `b + NB <= blocks` at every call.
        while r + VNNI_MR <= rows {
            let mut b = 0;
            while b + VNNI_NB <= blocks {
                unsafe { tile_vnni::<VNNI_MR, VNNI_NB, RAW>(p, xa, r, b, sx, y, acc) };
                b += VNNI_NB;
            }
            for b in b..blocks {
                unsafe { tile_vnni::<VNNI_MR, 1, RAW>(p, xa, r, b, sx, y, acc) };
            }
            r += VNNI_MR;
        }
        for r in r..rows {
            let mut b = 0;
            while b + VNNI_NB <= blocks {
                unsafe { tile_vnni::<1, VNNI_NB, RAW>(p, xa, r, b, sx, y, acc) };
                b += VNNI_NB;
            }
            for b in b..blocks {
                unsafe { tile_vnni::<1, 1, RAW>(p, xa, r, b, sx, y, acc) };
            }
        }
    }

    /// Rows `r0..r0+M` × channel blocks `b0..b0+NB`.
    ///
    /// # Safety
    /// As `gemm_vnni`, with the tile inside `rows` × `n_pad / 16`. Only
    /// called from `gemm_vnni`, which enables the features it inlines into.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_vnni<const M: usize, const NB: usize, const RAW: bool>(
        p: &PackedLayer,
        xa: &[u8],
        r0: usize,
        b0: usize,
        sx: &[f32],
        y: *mut f32,
        acc_out: *mut i32,
    ) {
        let groups = p.k_pad / 4;
        let w = p.w_i8.as_slice().as_ptr();
        let xp = xa.as_ptr();
        // SAFETY: every pointer below stays inside its buffer: weights span
        // `n_pad / 16` blocks of `groups` 64-byte lines, activations `rows`
        // rows of `k_pad` bytes (4 read at `4 * g < k_pad`), the per-channel
        // constants `n_pad` values; stores are masked to the `n` real
        // channels of rows `< rows`. The CPU features are enabled by the
        // only caller.
        unsafe {
            let mut acc = [[_mm512_setzero_si512(); NB]; M];
            for g in 0..groups {
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
                let lanes = (p.n - o0).min(VNNI_LANES);
                let mask: __mmask16 = if lanes == VNNI_LANES { !0 } else { (1 << lanes) - 1 };
                let corr = _mm512_load_si512(p.offset_corr.as_slice().as_ptr().add(o0).cast());
                let s_w = _mm512_load_ps(p.scales.as_slice().as_ptr().add(o0));
                let bias = _mm512_load_ps(p.bias.as_slice().as_ptr().add(o0));
                for (r, acc_r) in acc.iter().enumerate() {
                    let row = r0 + r;
                    let a = _mm512_sub_epi32(acc_r[b], corr);
                    if RAW {
                        _mm512_mask_storeu_epi32(acc_out.add(row * p.n + o0), mask, a);
                    } else {
                        let scale = _mm512_mul_ps(s_w, _mm512_set1_ps(sx[row]));
                        let mut v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), scale), bias);
                        if p.relu {
                            // `maxps` returns its second operand for NaN, as
                            // `f32::max(v, 0.0)` returns 0.0.
                            v = _mm512_max_ps(v, _mm512_setzero_ps());
                        }
                        _mm512_mask_storeu_ps(y.add(row * p.n + o0), mask, v);
                    }
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

    const AVX2_LANES: usize = 8;
    const AVX2_MR: usize = 4;
    const AVX2_NB: usize = 2;

    /// Rows in blocks of 4, channels in blocks of 2 × 8: 8 ymm accumulators,
    /// leaving room in the 16 ymm registers for weights and broadcasts.
    ///
    /// # Safety
    /// The CPU must support AVX2; `p` must be packed for `Avx2`; `xa` must
    /// hold `rows` rows of `p.k_pad` i16; when `RAW`, `acc` must be valid for
    /// `rows * p.n` writes, otherwise `y`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn gemm_avx2<const RAW: bool>(
        p: &PackedLayer,
        xa: &[i16],
        rows: usize,
        sx: &[f32],
        y: *mut f32,
        acc: *mut i32,
    ) {
        assert!(xa.len() >= rows * p.k_pad && (RAW || sx.len() >= rows));
        let blocks = p.n_pad / AVX2_LANES;
        let mut r = 0;
        // SAFETY (all tile calls): the caller's contract, plus `r + M <= rows`
        // and `b + NB <= blocks` at every call.
        while r + AVX2_MR <= rows {
            let mut b = 0;
            while b + AVX2_NB <= blocks {
                unsafe { tile_avx2::<AVX2_MR, AVX2_NB, RAW>(p, xa, r, b, sx, y, acc) };
                b += AVX2_NB;
            }
            for b in b..blocks {
                unsafe { tile_avx2::<AVX2_MR, 1, RAW>(p, xa, r, b, sx, y, acc) };
            }
            r += AVX2_MR;
        }
        for r in r..rows {
            let mut b = 0;
            while b + AVX2_NB <= blocks {
                unsafe { tile_avx2::<1, AVX2_NB, RAW>(p, xa, r, b, sx, y, acc) };
                b += AVX2_NB;
            }
            for b in b..blocks {
                unsafe { tile_avx2::<1, 1, RAW>(p, xa, r, b, sx, y, acc) };
            }
        }
    }

    /// # Safety
    /// As `gemm_avx2`, with the tile inside `rows` × `n_pad / 8`. Only called
    /// from `gemm_avx2`, which enables the features it inlines into.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile_avx2<const M: usize, const NB: usize, const RAW: bool>(
        p: &PackedLayer,
        xa: &[i16],
        r0: usize,
        b0: usize,
        sx: &[f32],
        y: *mut f32,
        acc_out: *mut i32,
    ) {
        let pairs = p.k_pad / 2;
        let w = p.w_i16.as_slice().as_ptr();
        let xp = xa.as_ptr();
        // SAFETY: as in `tile_vnni`, with 32-byte weight lines of 8 channels
        // × 2 k, activation pairs read at `2 * kp < k_pad`, and partial
        // blocks stored through a stack array instead of a masked store.
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
                let lanes = (p.n - o0).min(AVX2_LANES);
                let s_w = _mm256_load_ps(p.scales.as_slice().as_ptr().add(o0));
                let bias = _mm256_load_ps(p.bias.as_slice().as_ptr().add(o0));
                for (r, acc_r) in acc.iter().enumerate() {
                    let row = r0 + r;
                    if RAW {
                        let mut tmp = [0i32; AVX2_LANES];
                        _mm256_storeu_si256(tmp.as_mut_ptr().cast(), acc_r[b]);
                        std::ptr::copy_nonoverlapping(tmp.as_ptr(), acc_out.add(row * p.n + o0), lanes);
                    } else {
                        let scale = _mm256_mul_ps(s_w, _mm256_set1_ps(sx[row]));
                        let mut v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc_r[b]), scale), bias);
                        if p.relu {
                            v = _mm256_max_ps(v, _mm256_setzero_ps());
                        }
                        if lanes == AVX2_LANES {
                            _mm256_storeu_ps(y.add(row * p.n + o0), v);
                        } else {
                            let mut tmp = [0f32; AVX2_LANES];
                            _mm256_storeu_ps(tmp.as_mut_ptr(), v);
                            std::ptr::copy_nonoverlapping(tmp.as_ptr(), y.add(row * p.n + o0), lanes);
                        }
                    }
                }
            }
        }
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
