//! The CPU FP8 E4M3 backend: the bit-exact specification of the FP8 model
//! semantics that `kernels/fp8_dense.cu` states, so the GPU kernel has
//! something to be checked against.
//!
//! Per layer:
//! - weights: one per-tensor scale `s_w = max|w| / 448` (1 for an all-zero
//!   layer), codes `w8 = E4M3(w / s_w)` by `score::fp8::from_f32`, encoded
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
//! The loop runs k outside and 8-wide output blocks inside, so each output
//! keeps its own sequential k order while the compiler vectorises across
//! outputs.

use super::super::fp8;
use super::super::Backend;
use crate::model::Model;

/// `fp8::to_f32` of every code.
fn decode_table() -> [f32; 256] {
    std::array::from_fn(|c| fp8::to_f32(c as u8))
}

/// One layer's FP8 constants.
struct Fp8Layer {
    k: usize,
    n: usize,
    relu: bool,
    /// Decoded weight codes, transposed to `[k][n]`.
    w_t: Vec<f32>,
    s_w: f32,
    s_x: f32,
    inv_s_x: f32,
    bias: Vec<f32>,
}

/// The CPU FP8 backend.
pub struct CpuFp8 {
    rows_max: usize,
    table: [f32; 256],
    layers: Vec<Fp8Layer>,
    /// Decoded activations of one row and two ping-pong outputs.
    xd: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
}

impl CpuFp8 {
    pub fn new(model: &Model, rows_max: usize) -> CpuFp8 {
        let table = decode_table();
        let ranges = model.calibration.as_ref().map(|c| &c.input_ranges);
        let layers = model
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let max_abs = l.weights_f32.iter().fold(0.0f32, |m, w| m.max(w.abs()));
                let s_w = if max_abs > 0.0 { max_abs / fp8::MAX } else { 1.0 };
                let mut w_t = vec![0.0; l.in_dim * l.out_dim];
                for o in 0..l.out_dim {
                    for k in 0..l.in_dim {
                        w_t[k * l.out_dim + o] =
                            table[usize::from(fp8::from_f32(l.weights_f32[o * l.in_dim + k] / s_w))];
                    }
                }
                let s_x = ranges.map_or(1.0, |r| r[i] / fp8::MAX);
                Fp8Layer {
                    k: l.in_dim,
                    n: l.out_dim,
                    relu: l.relu,
                    w_t,
                    s_w,
                    s_x,
                    inv_s_x: 1.0 / s_x,
                    bias: l.bias.clone(),
                }
            })
            .collect();
        let width = model.width_max();
        CpuFp8 { rows_max, table, layers, xd: vec![0.0; width], a: vec![0.0; width], b: vec![0.0; width] }
    }
}

/// One layer for one row: `x` in, `y` out.
fn layer_row(l: &Fp8Layer, table: &[f32; 256], x: &[f32], xd: &mut [f32], y: &mut [f32]) {
    for (d, v) in xd[..l.k].iter_mut().zip(x) {
        *d = table[usize::from(fp8::from_f32(v * l.inv_s_x))];
    }
    let y = &mut y[..l.n];
    y.fill(0.0);
    for (k, &xk) in xd[..l.k].iter().enumerate() {
        for (acc, &w) in y.iter_mut().zip(&l.w_t[k * l.n..(k + 1) * l.n]) {
            *acc += xk * w;
        }
    }
    let scale = l.s_w * l.s_x;
    for (v, b) in y.iter_mut().zip(&l.bias) {
        let out = *v * scale + b;
        *v = if l.relu { out.max(0.0) } else { out };
    }
}

impl Backend for CpuFp8 {
    fn name(&self) -> &'static str {
        "cpu-fp8"
    }

    fn rows_max(&self) -> usize {
        self.rows_max
    }

    fn logits(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(rows <= self.rows_max && x.len() == rows * model.input_dim() && out.len() == rows);
        assert_eq!(model.layers.len(), self.layers.len(), "the backend was built for another model");
        let k0 = model.input_dim();
        for (r, y) in out.iter_mut().enumerate() {
            let CpuFp8 { table, layers, xd, a, b, .. } = self;
            layer_row(&layers[0], table, &x[r * k0..(r + 1) * k0], xd, a);
            for l in &layers[1..] {
                layer_row(l, table, &a[..l.k], xd, b);
                std::mem::swap(a, b);
            }
            *y = a[0];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sigmoid, InputSegment, Layer, Source};

    fn model(seed: u64, dims: &[usize]) -> Model {
        let mut rng = crate::demo::SplitMix64::new(seed);
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let std = (2.0 / w[0] as f32).sqrt();
                let weights = (0..w[0] * w[1]).map(|_| rng.normal() * std).collect();
                let bias = (0..w[1]).map(|_| rng.normal() * 0.1).collect();
                Layer::quantize(w[0], w[1], i + 2 < dims.len(), weights, bias)
            })
            .collect();
        Model {
            name: "fp8".into(),
            version: 1,
            inputs: vec![InputSegment { source: Source::Context, dim: dims[0] }],
            layers,
            calibration: None,
        }
    }

    fn inputs(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::demo::SplitMix64::new(seed);
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
            for rows in [1usize, 31, 33] {
                let mut x = inputs(rows as u64, rows * dims[0]);
                x[0] = 1.0e6; // saturates at 448 · s_x
                if rows > 1 {
                    x[dims[0]] = -0.0;
                }
                let mut got = vec![0.0; rows];
                CpuFp8::new(&m, rows).logits(&m, &x, rows, &mut got);
                let want = transcription(&m, &x, rows);
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "dims {dims:?} calibrated {calibrate} rows {rows}: row {r}");
                }
            }
        }
    }

    #[test]
    fn fp8_stays_close_to_the_reference() {
        let m = model(4, &[80, 256, 128, 1]);
        let rows = 64;
        let x = inputs(5, rows * 80);
        let (mut got, mut want) = (vec![0.0; rows], vec![0.0; rows]);
        CpuFp8::new(&m, rows).logits(&m, &x, rows, &mut got);
        m.forward_f32_reference(&x, rows, &mut want);
        let worst = got.iter().zip(&want).map(|(g, w)| (sigmoid(*g) - sigmoid(*w)).abs()).fold(0.0, f32::max);
        // E4M3 keeps 3 mantissa bits (each value within 1/16 relative), so
        // this is looser than INT8's 0.03 on the same shapes; measured 0.067.
        assert!(worst <= 0.1, "fp8 score differs by {worst}");
    }
}
