//! The CPU executor of graph models (`model::graph`), shared by the f32,
//! INT8 and FP8 backends: only its dense layers differ between them.
//!
//! Construction compiles the graph into a fixed schedule: every node's
//! tensor gets its own `[rows_max][width]` region of one buffer allocated
//! here, dense layers are repacked for the backend's kernel, and a call
//! walks the nodes in order without allocating. Dense nodes run quantized
//! (INT8 with per-row dynamic activation scales, the semantics of
//! `CpuInt8` for an uncalibrated model, through the same kernels; or FP8
//! E4M3 with an activation scale of 1, as `CpuFp8` runs an uncalibrated
//! model); every other node runs in f32, the same code for every backend,
//! so the f32 backend is the oracle for the rest.

use super::fp8::{self as cpu_fp8, Fp8Layer};
use super::int8_gemm::{Int8Kernel, PackedLayer, Scratch};
use super::{dot_f32, dot_i8, quantize_row};
use crate::model::graph::{embedding_index, Act, Graph, Op};
use crate::model::Layer;

/// How the executor runs dense layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseMode {
    F32,
    Int8(Int8Kernel),
    Fp8,
}

enum Dense {
    F32,
    /// The scalar reference of dynamic INT8, one row at a time.
    Int8Scalar,
    Int8(PackedLayer),
    Fp8(Fp8Layer),
}

pub struct GraphExec {
    rows_max: usize,
    nodes: usize,
    /// Where node `i`'s `[rows_max][width]` region starts in `buf`; regions
    /// follow node order, so a node's inputs lie before its own.
    offsets: Vec<usize>,
    widths: Vec<usize>,
    buf: Vec<f32>,
    dense: Vec<Option<Dense>>,
    scratch: Scratch,
    xq: Vec<i8>,
    fp8_table: [f32; 256],
    fp8_xd: Vec<f32>,
}

impl GraphExec {
    pub fn new(graph: &Graph, mode: DenseMode, rows_max: usize) -> GraphExec {
        let widths: Vec<usize> = graph.nodes.iter().map(|n| n.width).collect();
        let mut offsets = Vec::with_capacity(widths.len());
        let mut total = 0;
        for w in &widths {
            offsets.push(total);
            total += rows_max * w;
        }
        let fp8_table = cpu_fp8::decode_table();
        let dense = graph
            .nodes
            .iter()
            .map(|n| match &n.op {
                Op::Dense { layer, act } => Some(match mode {
                    DenseMode::F32 => Dense::F32,
                    DenseMode::Int8(Int8Kernel::Scalar) => Dense::Int8Scalar,
                    // ReLU is fused into the kernels' epilogue; any other
                    // activation runs after, in f32.
                    DenseMode::Int8(k) => Dense::Int8(PackedLayer::new(k, &with_relu(layer, *act == Act::Relu))),
                    DenseMode::Fp8 => Dense::Fp8(cpu_fp8::layer(&with_relu(layer, *act == Act::Relu), &fp8_table, 1.0)),
                }),
                _ => None,
            })
            .collect();
        let width_max = graph.width_max();
        let kernel = match mode {
            DenseMode::Int8(k) => k,
            _ => Int8Kernel::Scalar,
        };
        let fp8_len = if mode == DenseMode::Fp8 { rows_max * width_max } else { 0 };
        GraphExec {
            rows_max,
            nodes: graph.nodes.len(),
            offsets,
            widths,
            buf: vec![0.0; total],
            dense,
            scratch: Scratch::new(kernel, width_max, rows_max),
            xq: vec![0; width_max],
            fp8_table,
            fp8_xd: vec![0.0; fp8_len],
        }
    }

    /// Runs `graph` (the one this was built for) on `rows` input rows of
    /// `x`, `input_dim` floats each; one output value per row to `out`.
    pub fn run(&mut self, graph: &Graph, x: &[f32], input_dim: usize, rows: usize, out: &mut [f32]) {
        assert_eq!(graph.nodes.len(), self.nodes, "the executor was built for another graph");
        assert!(rows <= self.rows_max && x.len() == rows * input_dim && out.len() == rows);
        for (i, node) in graph.nodes.iter().enumerate() {
            let (before, rest) = self.buf.split_at_mut(self.offsets[i]);
            let w = node.width;
            let y = &mut rest[..rows * w];
            let (offsets, widths) = (&self.offsets, &self.widths);
            let input = |k: usize| {
                let j = node.inputs[k];
                &before[offsets[j]..offsets[j] + rows * widths[j]]
            };
            match &node.op {
                Op::Input { offset } => {
                    for (yr, xr) in y.chunks_exact_mut(w).zip(x.chunks_exact(input_dim)) {
                        yr.copy_from_slice(&xr[*offset..offset + w]);
                    }
                }
                Op::Dense { layer, act } => {
                    let src = input(0);
                    let fused_relu = match self.dense[i].as_ref().expect("built for every dense node") {
                        Dense::F32 => {
                            dense_f32(layer, src, y);
                            false
                        }
                        Dense::Int8Scalar => {
                            dense_int8_scalar(layer, src, y, &mut self.xq);
                            false
                        }
                        Dense::Int8(p) => {
                            p.forward(src, rows, y, &mut self.scratch);
                            true
                        }
                        Dense::Fp8(l) => {
                            cpu_fp8::layer_rows(l, &self.fp8_table, src, rows, &mut self.fp8_xd, y);
                            true
                        }
                    };
                    if !(fused_relu && *act == Act::Relu) {
                        apply(*act, y);
                    }
                }
                Op::Act(act) => {
                    y.copy_from_slice(input(0));
                    apply(*act, y);
                }
                Op::Add | Op::Sub | Op::Mul => {
                    let (a, b) = (input(0), input(1));
                    let wb = widths[node.inputs[1]];
                    for ((yr, ar), br) in y.chunks_exact_mut(w).zip(a.chunks_exact(w)).zip(b.chunks_exact(wb)) {
                        for (c, (o, p)) in yr.iter_mut().zip(ar).enumerate() {
                            let q = br[if wb == 1 { 0 } else { c }];
                            *o = match node.op {
                                Op::Add => p + q,
                                Op::Sub => p - q,
                                _ => p * q,
                            };
                        }
                    }
                }
                Op::Affine { center, scale, shift } => {
                    for (yr, ar) in y.chunks_exact_mut(w).zip(input(0).chunks_exact(w)) {
                        for c in 0..w {
                            yr[c] = (ar[c] - center[c]) * scale[c] + shift[c];
                        }
                    }
                }
                Op::Concat => {
                    let mut at = 0;
                    for &j in &node.inputs {
                        let wj = widths[j];
                        let src = &before[offsets[j]..offsets[j] + rows * wj];
                        for (yr, sr) in y.chunks_exact_mut(w).zip(src.chunks_exact(wj)) {
                            yr[at..at + wj].copy_from_slice(sr);
                        }
                        at += wj;
                    }
                }
                Op::LayerNorm { epsilon, scale, shift } => {
                    for (yr, ar) in y.chunks_exact_mut(w).zip(input(0).chunks_exact(w)) {
                        let n = w as f32;
                        let mean = ar.iter().sum::<f32>() / n;
                        let var = ar.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
                        let inv = 1.0 / (var + epsilon).sqrt();
                        for c in 0..w {
                            yr[c] = (ar[c] - mean) * inv * scale[c] + shift[c];
                        }
                    }
                }
                Op::Dot => {
                    let wa = widths[node.inputs[0]];
                    for ((o, ar), br) in y.iter_mut().zip(input(0).chunks_exact(wa)).zip(input(1).chunks_exact(wa)) {
                        *o = ar.iter().zip(br).map(|(p, q)| p * q).sum();
                    }
                }
                Op::Sum => {
                    let wa = widths[node.inputs[0]];
                    for (o, ar) in y.iter_mut().zip(input(0).chunks_exact(wa)) {
                        *o = ar.iter().sum();
                    }
                }
                Op::Embedding { dim, rows: table_rows, table, default } => {
                    let wa = widths[node.inputs[0]];
                    for (yr, ar) in y.chunks_exact_mut(w).zip(input(0).chunks_exact(wa)) {
                        for (slot, &v) in yr.chunks_exact_mut(*dim).zip(ar) {
                            let row = match embedding_index(v, *table_rows) {
                                Some(r) => &table[r * dim..(r + 1) * dim],
                                None => &default[..],
                            };
                            slot.copy_from_slice(row);
                        }
                    }
                }
            }
        }
        let last = self.nodes - 1;
        out.copy_from_slice(&self.buf[self.offsets[last]..self.offsets[last] + rows]);
    }
}

fn with_relu(layer: &Layer, relu: bool) -> Layer {
    Layer { relu, ..layer.clone() }
}

fn apply(act: Act, y: &mut [f32]) {
    if act != Act::None {
        for v in y {
            *v = act.apply(*v);
        }
    }
}

fn dense_f32(l: &Layer, x: &[f32], y: &mut [f32]) {
    for (xr, yr) in x.chunks_exact(l.in_dim).zip(y.chunks_exact_mut(l.out_dim)) {
        for (o, v) in yr.iter_mut().enumerate() {
            *v = dot_f32(&l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim], xr) + l.bias[o];
        }
    }
}

fn dense_int8_scalar(l: &Layer, x: &[f32], y: &mut [f32], xq: &mut [i8]) {
    let xq = &mut xq[..l.in_dim];
    for (xr, yr) in x.chunks_exact(l.in_dim).zip(y.chunks_exact_mut(l.out_dim)) {
        let s_x = quantize_row(xr, xq);
        for (o, v) in yr.iter_mut().enumerate() {
            let acc = dot_i8(&l.weights_i8[o * l.in_dim..(o + 1) * l.in_dim], xq);
            *v = acc as f32 * (l.weight_scales[o] * s_x) + l.bias[o];
        }
    }
}
