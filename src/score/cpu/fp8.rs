//! The CPU FP8 E4M3 backend: the bit-exact specification of the FP8 model
//! semantics that `kernels/fp8_dense.cu` states, so the GPU kernel has
//! something to be checked against.
//!
//! Per layer:
//! - weights: one per-tensor scale `s_w = max|w| / 448` (1 for an all-zero
//!   layer), codes `w8 = E4M3(w / s_w)` by `score::e4m3::from_f32`, encoded
//!   once at construction and decoded once through the 256-entry table;
//! - activations: `x8 = E4M3(x · inv_s_x)` with `inv_s_x = f32(1 / s_x)`,
//!   decoded through the table; `s_x = range / 448` from the model's
//!   calibration, or 1 for an uncalibrated model (E4M3 then covers
//!   magnitudes 2⁻⁹ to 448 unscaled, and saturates beyond);
//! - `acc` starts at 0 and adds `x8[k] · w8[o][k]` for k = 0, 1, …, K − 1 in
//!   that order, in f32. Every product of two E4M3 values is exact in f32
//!   (4 + 4 significant bits), so this equals the CUDA kernel's
//!   `acc = fmaf(x, w, acc)` chain: only the additions round;
//! - `y = acc · (s_w · s_x) + bias[o]`, unfused, then ReLU (`max(y, 0)`).
//!
//! Each layer runs over all rows at once: the activations of every row are
//! encoded and decoded into one matrix, then the f32 micro-kernel of
//! `tiles.rs` sums each output with fused multiply-adds in k order from 0
//! (the products being exact, each step rounds only its addition, as above)
//! over the decoded weights packed into panels of 16 outputs. The layer
//! loop is compiled for AVX-512 F, for AVX2 with FMA and for the baseline,
//! and the widest this CPU runs is chosen at construction; every build
//! rounds the same way.

use std::sync::Arc;

use super::super::e4m3 as fp8;
use super::super::{Backend, BackendError, BackendInfo};
use super::executor::{DenseKernel, GraphExec};
use super::tiles::{Isa, Panels};
use crate::model::{Layer, Model};

/// `fp8::to_f32` of every code.
fn decode_table() -> [f32; 256] {
    std::array::from_fn(|c| fp8::to_f32(c as u8))
}

/// One layer's FP8 constants.
pub(super) struct Fp8Layer {
    /// Decoded weight codes packed for the f32 micro-kernel.
    w: Panels,
    relu: bool,
    s_w: f32,
    s_x: f32,
    inv_s_x: f32,
    bias: Vec<f32>,
}

/// The CPU FP8 backend.
pub struct CpuFp8 {
    info: BackendInfo,
    table: [f32; 256],
    layers: Vec<Fp8Layer>,
    isa: Isa,
    /// Decoded activations of every row, and two ping-pong outputs, each
    /// `rows_max × width_max`.
    xd: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    /// The executor of a graph model (its dense nodes in FP8).
    graph: Option<GraphExec<Fp8Dense>>,
    /// Rows with their missing values (NaN) read as 0, `rows_max × input`.
    x_clean: Vec<f32>,
}

impl CpuFp8 {
    pub fn new(model: &Arc<Model>, rows_max: usize) -> CpuFp8 {
        let table = decode_table();
        let ranges = model.calibration.as_ref().map(|c| &c.input_ranges);
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| layer(l, &table, ranges.map_or(1.0, |r| r[i] / fp8::MAX)))
            .collect();
        let graph = model.graph.as_ref().map(|g| {
            let kernel = Fp8Dense { table, xd: vec![0.0; rows_max * g.width_max()], isa: Isa::best() };
            GraphExec::new(g, kernel, rows_max, &model.request_columns())
        });
        let len = rows_max * model.width_max();
        CpuFp8 {
            info: BackendInfo { name: "cpu-fp8", rows_max, model: model.clone() },
            table,
            layers,
            isa: Isa::best(),
            xd: vec![0.0; len],
            a: vec![0.0; len],
            b: vec![0.0; len],
            graph,
            x_clean: Vec::with_capacity(if model.graph.is_none() { rows_max * model.input_dim() } else { 0 }),
        }
    }
}

/// FP8 dense layers for the graph executor, with an activation scale of 1
/// (as an uncalibrated model runs): the decode table, and the decoded
/// activations of every row, `rows_max × width_max`.
pub(super) struct Fp8Dense {
    table: [f32; 256],
    xd: Vec<f32>,
    isa: Isa,
}

impl DenseKernel for Fp8Dense {
    type Prepared = Fp8Layer;

    fn prepare(&self, l: &Layer) -> Fp8Layer {
        layer(l, &self.table, 1.0)
    }

    fn fuses_relu(&self) -> bool {
        true
    }

    #[inline(always)]
    fn forward(&mut self, l: &Fp8Layer, x: &[f32], rows: usize, y: &mut [f32]) {
        layer_rows(self.isa, l, &self.table, x, rows, &mut self.xd, y);
    }
}

/// One layer's FP8 constants, with activation scale `s_x`.
fn layer(l: &Layer, table: &[f32; 256], s_x: f32) -> Fp8Layer {
    let max_abs = l.weights_f32.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    let s_w = if max_abs > 0.0 { max_abs / fp8::MAX } else { 1.0 };
    let w = Panels::new(l.in_dim, l.out_dim, |o, k| {
        table[usize::from(fp8::from_f32(l.weights_f32[o * l.in_dim + k] / s_w))]
    });
    Fp8Layer { w, relu: l.relu, s_w, s_x, inv_s_x: 1.0 / s_x, bias: l.bias.clone() }
}

/// One layer for `rows` rows: `x` (`[rows][k]`) in, `y` (`[rows][n]`) out,
/// the sums by the `isa` build of the micro-kernel.
#[inline(always)]
fn layer_rows(isa: Isa, l: &Fp8Layer, table: &[f32; 256], x: &[f32], rows: usize, xd: &mut [f32], y: &mut [f32]) {
    let k = l.w.k;
    let xd = &mut xd[..rows * k];
    for (d, v) in xd.iter_mut().zip(&x[..rows * k]) {
        *d = table[usize::from(fp8::from_f32(v * l.inv_s_x))];
    }
    let scale = l.s_w * l.s_x;
    l.w.rows(isa, xd, rows, y, &l.bias, |a, b| {
        let v = a * scale + b;
        if l.relu {
            v.max(0.0)
        } else {
            v
        }
    });
}

/// Every layer for `rows` rows of `x`; the logits go to `out`.
#[inline(always)]
fn forward(fp: &mut CpuFp8, x: &[f32], rows: usize, out: &mut [f32]) {
    let CpuFp8 { table, layers, xd, a, b, isa, .. } = fp;
    layer_rows(*isa, &layers[0], table, x, rows, xd, a);
    for l in &layers[1..] {
        layer_rows(*isa, l, table, a, rows, xd, b);
        std::mem::swap(a, b);
    }
    out[..rows].copy_from_slice(&a[..rows]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn forward_avx512(fp: &mut CpuFp8, x: &[f32], rows: usize, out: &mut [f32]) {
    forward(fp, x, rows, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn forward_avx2(fp: &mut CpuFp8, x: &[f32], rows: usize, out: &mut [f32]) {
    forward(fp, x, rows, out);
}

impl Backend for CpuFp8 {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// As `CpuInt8`: graph models compute their per-request nodes once per
    /// request (exactly).
    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.info.check(x, rows, out);
        if let Some(exec) = &mut self.graph {
            exec.run(x, rows, out);
            return Ok(());
        }
        assert_eq!(self.layers.last().map(|l| l.w.n), Some(1), "one logit per row");
        // A missing value (NaN) reads as 0, as in graph models' inputs and
        // the INT8 quantizer; the kernels' contract is for finite inputs.
        // The copy lives in `x_clean`, reserved for `rows_max` rows.
        let mut cleaned = None;
        if x.iter().any(|v| v.is_nan()) {
            let mut buf = std::mem::take(&mut self.x_clean);
            buf.clear();
            buf.extend(x.iter().map(|v| if v.is_nan() { 0.0 } else { *v }));
            cleaned = Some(buf);
        }
        let x = cleaned.as_deref().unwrap_or(x);
        match self.isa {
            Isa::Baseline => forward(self, x, rows, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::best` (or a test, from `Isa::available`) chose
            // this build because the CPU has AVX2 and FMA; the function is
            // safe code compiled for them.
            Isa::Avx2 => unsafe { forward_avx2(self, x, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX-512 F.
            Isa::Avx512 => unsafe { forward_avx512(self, x, rows, out) },
        }
        if let Some(buf) = cleaned {
            self.x_clean = buf;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(seed: u64, dims: &[usize]) -> Model {
        crate::loadgen::demo::context_mlp("fp8", seed, dims)
    }

    fn inputs(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::loadgen::demo::SplitMix64::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    /// The contract of `kernels/fp8_dense.cu` transcribed literally: per
    /// output, a `mul_add` chain in k order over values decoded with
    /// `fp8::to_f32`, no table, no transposition.
    fn transcription(m: &Model, x: &[f32], rows: usize) -> Vec<f32> {
        let k0 = m.input_dim();
        (0..rows)
            .map(|r| {
                let mut act = x[r * k0..(r + 1) * k0].to_vec();
                for (i, l) in m.layers.iter().enumerate() {
                    let s_w = l.weights_f32.iter().fold(0.0f32, |a, w| a.max(w.abs())) / 448.0;
                    let s_x = m.calibration.as_ref().map_or(1.0, |c| c.input_ranges[i] / 448.0);
                    let inv = 1.0 / s_x;
                    let xq: Vec<f32> = act.iter().map(|v| fp8::to_f32(fp8::from_f32(v * inv))).collect();
                    act = (0..l.out_dim)
                        .map(|o| {
                            let mut acc = 0.0f32;
                            for (xk, wk) in xq.iter().zip(&l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim]) {
                                acc = xk.mul_add(fp8::to_f32(fp8::from_f32(wk / s_w)), acc);
                            }
                            let y = acc * (s_w * s_x) + l.bias[o];
                            if l.relu {
                                y.max(0.0)
                            } else {
                                y
                            }
                        })
                        .collect();
                }
                act[0]
            })
            .collect()
    }

    #[test]
    fn fp8_matches_the_kernel_contract_bit_for_bit() {
        for (seed, dims, calibrate) in
            [(1, vec![80usize, 256, 128, 1], false), (2, vec![37, 33, 17, 1], true), (3, vec![1, 7, 1], true)]
        {
            let mut m = model(seed, &dims);
            if calibrate {
                use crate::model::calibrate::{calibrate, Matrix, Method};
                let set = Matrix { rows: 64, cols: dims[0], data: inputs(seed + 10, 64 * dims[0]) };
                m.calibration = Some(calibrate(&m, &set, Method::MaxAbs, |_, _| {}).unwrap());
            }
            let m = Arc::new(m);
            // Every leftover of the 4-, 6- and 8-row tiles, alone and after
            // whole ones.
            for rows in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13, 31, 33] {
                let mut x = inputs(rows as u64, rows * dims[0]);
                x[0] = 1.0e6; // saturates at 448 · s_x
                if rows > 1 {
                    x[dims[0]] = -0.0;
                }
                let want = transcription(&m, &x, rows);
                for isa in Isa::available() {
                    let mut backend = CpuFp8::new(&m, rows);
                    backend.isa = isa;
                    let mut got = vec![0.0; rows];
                    backend.score(&x, rows, &mut got).unwrap();
                    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{isa:?} dims {dims:?} calibrated {calibrate} rows {rows}: row {r}"
                        );
                    }
                }
            }
        }
    }
}
