//! CPU backends: the f32 oracle and the INT8 kernel.
//!
//! INT8 semantics (shared with future GPU kernels, so written down exactly):
//! weights are symmetric per output channel (`Layer::quantize`); each input
//! row of a layer is quantized on the fly with one symmetric scale,
//! `s_x = max|x| / 127`, `x_q = clamp(round_ties_even(x / s_x), -127, 127)`;
//! the dot product accumulates in i32; the output is
//! `acc as f32 * (s_w[o] * s_x) + bias[o]`, then ReLU where the layer has
//! one. The last layer yields the logit in f32.
//!
//! These are plain loops written so the compiler vectorises them; the
//! hand-tuned kernels come with the models issue.

use super::Backend;
use crate::model::Model;

/// Two activation buffers, ping-ponged between layers, sized at start-up.
struct Activations {
    a: Vec<f32>,
    b: Vec<f32>,
}

impl Activations {
    fn new(model: &Model, rows_max: usize) -> Activations {
        let n = rows_max * model.width_max();
        Activations {
            a: vec![0.0; n],
            b: vec![0.0; n],
        }
    }

    /// Runs every layer over every row: layer 0 reads `x` and writes `a`,
    /// later layers read what the previous one wrote and write the other
    /// buffer. `row_kernel(layer, input_row, output_row)` computes one row.
    fn run(
        &mut self,
        model: &Model,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        mut row_kernel: impl FnMut(&crate::model::Layer, &[f32], &mut [f32]),
    ) {
        let Activations { a, b } = self;
        for (i, l) in model.layers.iter().enumerate() {
            let (src, dst): (&[f32], &mut [f32]) = match i {
                0 => (x, &mut a[..]),
                _ if i % 2 == 1 => (&a[..], &mut b[..]),
                _ => (&b[..], &mut a[..]),
            };
            for r in 0..rows {
                row_kernel(
                    l,
                    &src[r * l.in_dim..(r + 1) * l.in_dim],
                    &mut dst[r * l.out_dim..(r + 1) * l.out_dim],
                );
            }
        }
        let last = if model.layers.len() % 2 == 1 { &a[..] } else { &b[..] };
        out.copy_from_slice(&last[..rows]);
    }
}

/// The f32 backend: the oracle other backends are tested against.
pub struct CpuF32 {
    rows_max: usize,
    act: Activations,
}

impl CpuF32 {
    pub fn new(model: &Model, rows_max: usize) -> CpuF32 {
        CpuF32 {
            rows_max,
            act: Activations::new(model, rows_max),
        }
    }
}

#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums let the compiler keep a full vector of
    // accumulators; the fixed order keeps results reproducible.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8 * 8;
    for (ca, cb) in a[..chunks].chunks_exact(8).zip(b[..chunks].chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut tail = 0.0;
    for (x, y) in a[chunks..].iter().zip(&b[chunks..]) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

impl Backend for CpuF32 {
    fn name(&self) -> &'static str {
        "cpu-f32"
    }

    fn rows_max(&self) -> usize {
        self.rows_max
    }

    fn logits(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(rows <= self.rows_max && x.len() == rows * model.input_dim() && out.len() == rows);
        self.act.run(model, x, rows, out, |l, xr, yr| {
            for (o, y) in yr.iter_mut().enumerate() {
                let v = dot_f32(&l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim], xr) + l.bias[o];
                *y = if l.relu { v.max(0.0) } else { v };
            }
        });
    }
}

/// The INT8 backend.
pub struct CpuInt8 {
    rows_max: usize,
    act: Activations,
    /// One quantized input row.
    xq: Vec<i8>,
}

impl CpuInt8 {
    pub fn new(model: &Model, rows_max: usize) -> CpuInt8 {
        CpuInt8 {
            rows_max,
            act: Activations::new(model, rows_max),
            xq: vec![0; model.width_max()],
        }
    }
}

#[inline]
fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    let mut acc = [0i32; 16];
    let chunks = a.len() / 16 * 16;
    for (ca, cb) in a[..chunks].chunks_exact(16).zip(b[..chunks].chunks_exact(16)) {
        for k in 0..16 {
            acc[k] += i32::from(ca[k]) * i32::from(cb[k]);
        }
    }
    let tail: i32 = a[chunks..]
        .iter()
        .zip(&b[chunks..])
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum();
    acc.iter().sum::<i32>() + tail
}

/// Quantizes one row; returns its scale.
#[inline]
pub fn quantize_row(x: &[f32], xq: &mut [i8]) -> f32 {
    let max_abs = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
    let inv = 1.0 / scale;
    for (q, v) in xq.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

impl Backend for CpuInt8 {
    fn name(&self) -> &'static str {
        "cpu-int8"
    }

    fn rows_max(&self) -> usize {
        self.rows_max
    }

    fn logits(&mut self, model: &Model, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(rows <= self.rows_max && x.len() == rows * model.input_dim() && out.len() == rows);
        let xq_all = &mut self.xq;
        self.act.run(model, x, rows, out, |l, xr, yr| {
            let xq = &mut xq_all[..l.in_dim];
            let s_x = quantize_row(xr, xq);
            for (o, y) in yr.iter_mut().enumerate() {
                let acc = dot_i8(&l.weights_i8[o * l.in_dim..(o + 1) * l.in_dim], xq);
                let v = acc as f32 * (l.weight_scales[o] * s_x) + l.bias[o];
                *y = if l.relu { v.max(0.0) } else { v };
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{sigmoid, InputSegment, Layer, Source};
    use crate::score::{build, BackendKind};

    /// A seeded random MLP with odd sizes (not multiples of any vector width).
    fn random_model(seed: u64, dims: &[usize]) -> Model {
        let mut rng = crate::demo::SplitMix64::new(seed);
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let (n_in, n_out) = (w[0], w[1]);
                let std = (2.0 / n_in as f32).sqrt();
                let weights = (0..n_in * n_out).map(|_| rng.normal() * std).collect();
                let bias = (0..n_out).map(|_| rng.normal() * 0.1).collect();
                Layer::quantize(n_in, n_out, i + 2 < dims.len(), weights, bias)
            })
            .collect();
        Model {
            name: "random".into(),
            version: 1,
            inputs: vec![InputSegment {
                source: Source::Context,
                dim: dims[0],
            }],
            layers,
        }
    }

    fn inputs(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::demo::SplitMix64::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    #[test]
    fn every_backend_matches_the_reference() {
        for dims in [vec![80usize, 256, 128, 1], vec![3, 1], vec![37, 33, 17, 1]] {
            let model = random_model(11, &dims);
            for rows in [1usize, 31, 33] {
                let x = inputs(rows as u64, rows * dims[0]);
                let mut want = vec![0.0; rows];
                model.forward_f32_reference(&x, rows, &mut want);
                for (kind, tol) in [(BackendKind::F32, 1e-4f32), (BackendKind::Int8, 0.03)] {
                    let mut backend = build(kind, &model, 64);
                    let mut got = vec![0.0; rows];
                    backend.logits(&model, &x, rows, &mut got);
                    for (g, w) in got.iter().zip(&want) {
                        let (gs, ws) = (sigmoid(*g), sigmoid(*w));
                        assert!(
                            (gs - ws).abs() <= tol,
                            "{} dims {dims:?} rows {rows}: score {gs} vs reference {ws}",
                            backend.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn int8_matches_a_scalar_transcription_exactly() {
        let model = random_model(5, &[19, 7, 1]);
        let x = inputs(9, 19 * 3);
        let mut got = vec![0.0; 3];
        CpuInt8::new(&model, 3).logits(&model, &x, 3, &mut got);
        for r in 0..3 {
            let mut act = x[r * 19..(r + 1) * 19].to_vec();
            for l in &model.layers {
                let max_abs = act.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s_x = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
                let q: Vec<i32> = act
                    .iter()
                    .map(|v| (v * (1.0 / s_x)).round_ties_even().clamp(-127.0, 127.0) as i32)
                    .collect();
                act = (0..l.out_dim)
                    .map(|o| {
                        let acc: i32 = (0..l.in_dim)
                            .map(|i| i32::from(l.weights_i8[o * l.in_dim + i]) * q[i])
                            .sum();
                        let v = acc as f32 * (l.weight_scales[o] * s_x) + l.bias[o];
                        if l.relu {
                            v.max(0.0)
                        } else {
                            v
                        }
                    })
                    .collect();
            }
            assert_eq!(got[r].to_bits(), act[0].to_bits(), "row {r}");
        }
    }

    #[test]
    fn zero_rows_quantize_without_dividing_by_zero() {
        let mut q = [1i8; 4];
        assert_eq!(quantize_row(&[0.0; 4], &mut q), 1.0);
        assert_eq!(q, [0; 4]);
    }
}
