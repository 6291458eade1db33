//! The CPU executor of graph models (`model::graph`), shared by the f32,
//! INT8 and FP8 backends: generic over a [`DenseKernel`], the dense layers
//! in one backend's precision, which is all that differs between them.
//!
//! The f32 dense layers ([`F32Tiles`]) run the micro-kernel of `tiles.rs`
//! (each output a chain of fused multiply-adds in k order, so every build
//! rounds alike); activations
//! are the vectorisable approximations of `activation.rs`. The whole walk,
//! the kernel's dense layers inlined, is compiled for AVX-512 F, AVX2 and the
//! baseline, and the widest build this CPU runs is chosen at construction.
//!
//! Construction compiles the graph into a fixed schedule the executor owns:
//! every node's tensor gets its own `[rows_max][width]` region of one buffer
//! allocated here, dense layers are prepared by the kernel (its weights then
//! live there only) and tree ensembles compiled, and a call walks the nodes
//! in order without allocating. Nodes that read only per-request input
//! columns (user, context, context ids) are computed once per run of rows
//! that hold the same bits in those columns (one request's candidates), into
//! a compact region of their own, and copied out to every row of the run;
//! each row is computed alone in every node, so this gives the numbers of
//! computing every row. The INT8 kernel (`cpu::Int8Dense`) runs dynamic
//! per-row activation scales, the semantics of `CpuInt8` for an uncalibrated
//! model, through the same kernels; the FP8 one (`fp8::Fp8Dense`) an
//! activation scale of 1, as `CpuFp8` runs an uncalibrated model; every
//! other node runs in f32, the same code for every backend, so the f32
//! backend is the oracle for the rest.

use super::activation;
use super::forest::CompiledTrees;
use super::tiles::{Isa, Panels};
use crate::model::graph::{embedding_index, Act, Graph, Node, Op};
use crate::model::trees::Ensemble;
use crate::model::Layer;

/// Dense layers in one backend's precision: the executor's dense nodes run
/// these, everything else the executor runs itself.
pub trait DenseKernel: Send {
    /// One layer prepared for this kernel (repacked, quantized), at
    /// construction.
    type Prepared: Send;

    /// Prepares `layer`, whose `relu` is set where the node's activation is
    /// ReLU (a kernel that fuses it applies it in `forward`).
    fn prepare(&self, layer: &Layer) -> Self::Prepared;

    /// Whether `forward` applies the ReLU a layer was prepared with.
    fn fuses_relu(&self) -> bool;

    /// `y[r][o] = Σ_k x[r][k] · w[o][k] + bias[o]` in this precision (then
    /// ReLU, where fused) for `rows` rows, `x` `[rows][k]` and `y`
    /// `[rows][n]`, each row computed on its own; scratch is the kernel's
    /// own, sized at construction, so this does not allocate.
    fn forward(&mut self, layer: &Self::Prepared, x: &[f32], rows: usize, y: &mut [f32]);
}

/// The f32 dense layers: weights packed for the micro-kernel of
/// `tiles.rs`, each output a chain of fused multiply-adds in k order (the
/// f32 backend's, and so the oracle's, kernel), run with the widest build
/// this CPU has.
pub struct F32Tiles {
    isa: Isa,
}

impl F32Tiles {
    pub fn new() -> F32Tiles {
        F32Tiles { isa: Isa::best() }
    }
}

impl Default for F32Tiles {
    fn default() -> F32Tiles {
        F32Tiles::new()
    }
}

/// A dense layer's f32 weights packed for the micro-kernel, its bias, and
/// whether ReLU is fused into the tile's epilogue.
pub struct F32Dense {
    w: Panels,
    bias: Vec<f32>,
    relu: bool,
}

impl DenseKernel for F32Tiles {
    type Prepared = F32Dense;

    fn prepare(&self, l: &Layer) -> F32Dense {
        let w = Panels::new(l.in_dim, l.out_dim, |o, k| l.weights_f32[o * l.in_dim + k]);
        F32Dense { w, bias: l.bias.clone(), relu: l.relu }
    }

    /// ReLU is applied to each tile's sums while they are fresh, the same
    /// `max(v, 0)` of the same values as `activation::apply` (a separate
    /// pass over the layer's output cost a few per cent at 256 rows).
    fn fuses_relu(&self) -> bool {
        true
    }

    #[inline(always)]
    fn forward(&mut self, d: &F32Dense, x: &[f32], rows: usize, y: &mut [f32]) {
        if d.relu {
            d.w.rows(self.isa, x, rows, y, &d.bias, |a, b| (a + b).max(0.0));
        } else {
            d.w.rows(self.isa, x, rows, y, &d.bias, |a, b| a + b);
        }
    }
}

pub struct GraphExec<K: DenseKernel> {
    isa: Isa,
    rows_max: usize,
    input_dim: usize,
    /// The graph's nodes, with dense weights and tree ensembles left out:
    /// they live prepared in `dense` and `trees`.
    nodes: Vec<Node>,
    /// Where node `i`'s `[rows_max][width]` region starts in `buf`; regions
    /// follow node order, so a node's inputs lie before its own.
    offsets: Vec<usize>,
    widths: Vec<usize>,
    /// Nodes that read only per-request input columns.
    shared: Vec<bool>,
    buf: Vec<f32>,
    /// Where a shared node's `[rows_max][width]` compact region (one row
    /// per request) starts in `compact`; unused for the other nodes.
    compact_offsets: Vec<usize>,
    compact: Vec<f32>,
    /// The input columns the shared nodes read, as (offset, width): rows
    /// that agree on them belong to one request.
    request_cols: Vec<(usize, usize)>,
    /// The first row of each request in this call, then `rows`.
    starts: Vec<usize>,
    kernel: K,
    dense: Vec<Option<K::Prepared>>,
    trees: Vec<Option<CompiledTrees>>,
}

impl<K: DenseKernel> GraphExec<K> {
    /// The prepared dense layers, each with whether it reads only
    /// per-request columns (so runs once per request, not per candidate).
    pub fn dense_layers(&self) -> impl Iterator<Item = (&K::Prepared, bool)> + '_ {
        self.dense.iter().zip(&self.shared).filter_map(|(d, &shared)| d.as_ref().map(|d| (d, shared)))
    }

    /// The executor of `graph` with `kernel`'s dense layers, for at most
    /// `rows_max` rows; `request_cols[c]` says whether input column `c`
    /// holds a per-request value (the same for every candidate of a
    /// request), one entry per input column.
    pub fn new(graph: &Graph, kernel: K, rows_max: usize, request_cols: &[bool]) -> GraphExec<K> {
        let input_dim = request_cols.len();
        let widths: Vec<usize> = graph.nodes.iter().map(|n| n.width).collect();
        let mut shared = Vec::with_capacity(graph.nodes.len());
        for n in &graph.nodes {
            let s = match n.op {
                Op::Input { offset } => {
                    request_cols.get(offset..offset + n.width).is_some_and(|c| c.iter().all(|b| *b))
                }
                _ => n.inputs.iter().all(|&j| shared[j]),
            };
            shared.push(s);
        }
        let mut offsets = Vec::with_capacity(widths.len());
        let mut compact_offsets = Vec::with_capacity(widths.len());
        let (mut total, mut compact_total) = (0, 0);
        for (w, s) in widths.iter().zip(&shared) {
            offsets.push(total);
            total += rows_max * w;
            compact_offsets.push(compact_total);
            if *s {
                compact_total += rows_max * w;
            }
        }
        let request_cols = graph
            .nodes
            .iter()
            .zip(&shared)
            .filter_map(|(n, s)| match n.op {
                Op::Input { offset } if *s => Some((offset, n.width)),
                _ => None,
            })
            .collect();
        let dense = graph
            .nodes
            .iter()
            .map(|n| match &n.op {
                // ReLU may be fused into the kernel's epilogue; any other
                // activation runs after, in f32.
                Op::Dense { layer, act } => Some(kernel.prepare(&Layer { relu: *act == Act::Relu, ..layer.clone() })),
                _ => None,
            })
            .collect();
        let trees = graph
            .nodes
            .iter()
            .map(|n| match &n.op {
                Op::Trees(e) => Some(CompiledTrees::new(e)),
                _ => None,
            })
            .collect();
        let nodes = graph
            .nodes
            .iter()
            .map(|n| {
                let op = match &n.op {
                    Op::Dense { layer, act } => Op::Dense {
                        layer: Layer {
                            weights_f32: Vec::new(),
                            weights_i8: Vec::new(),
                            weight_scales: Vec::new(),
                            bias: Vec::new(),
                            ..*layer
                        },
                        act: *act,
                    },
                    Op::Trees(_) => Op::Trees(Ensemble::default()),
                    op => op.clone(),
                };
                Node { op, inputs: n.inputs.clone(), width: n.width }
            })
            .collect();
        GraphExec {
            isa: Isa::best(),
            rows_max,
            input_dim,
            nodes,
            offsets,
            widths,
            shared,
            buf: vec![0.0; total],
            compact_offsets,
            compact: vec![0.0; compact_total],
            request_cols,
            starts: Vec::with_capacity(rows_max + 1),
            kernel,
            dense,
            trees,
        }
    }

    /// The nodes it runs: the graph's, with dense weights and tree
    /// ensembles held in their prepared forms instead; embedding tables
    /// are the model's own (shared, not copied; `model::embedding`).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Runs the graph on `rows` input rows of `x`, one output value per
    /// row to `out`.
    pub fn run(&mut self, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(rows <= self.rows_max && x.len() == rows * self.input_dim && out.len() == rows);
        match self.isa {
            Isa::Baseline => self.walk(x, rows, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::best` chose this build because the CPU has
            // AVX2 and FMA; the function is safe code compiled for them.
            Isa::Avx2 => unsafe { self.walk_avx2(x, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX-512 F.
            Isa::Avx512 => unsafe { self.walk_avx512(x, rows, out) },
        }
    }

    /// Fills `starts` with the first row of every run of rows whose
    /// request columns hold the same bits as the row before, then `rows`.
    /// Bit equality is exact: a run's shared nodes see the same inputs.
    /// Compiled into each build of `walk`; each range of columns is
    /// compared whole, so the comparison vectorises, and the first range
    /// that differs ends the row's.
    #[inline(always)]
    fn split_requests(&mut self, x: &[f32], rows: usize) {
        self.starts.clear();
        if rows == 0 {
            return;
        }
        self.starts.push(0);
        if !self.request_cols.is_empty() {
            let mut previous = &x[..self.input_dim];
            for (r, row) in x.chunks_exact(self.input_dim).enumerate().skip(1) {
                let differs = self.request_cols.iter().any(|&(at, w)| {
                    let bits = previous[at..at + w].iter().zip(&row[at..at + w]);
                    bits.fold(0, |d, (a, b)| d | (a.to_bits() ^ b.to_bits())) != 0
                });
                if differs {
                    self.starts.push(r);
                }
                previous = row;
            }
        }
        self.starts.push(rows);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn walk_avx2(&mut self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.walk(x, rows, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn walk_avx512(&mut self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.walk(x, rows, out);
    }

    #[inline(always)]
    fn walk(&mut self, x: &[f32], rows: usize, out: &mut [f32]) {
        self.split_requests(x, rows);
        let input_dim = self.input_dim;
        // One compact row per request, when that saves work; when every row
        // is its own request, shared nodes are computed in place like any.
        let requests = self.starts.len().saturating_sub(1);
        let by_request = requests < rows;
        let starts = &self.starts;
        for (i, node) in self.nodes.iter().enumerate() {
            let w = node.width;
            let compact = by_request && self.shared[i];
            let (store, offsets) =
                if compact { (&mut self.compact, &self.compact_offsets) } else { (&mut self.buf, &self.offsets) };
            let n = if compact { requests } else { rows };
            let (before, rest) = store.split_at_mut(offsets[i]);
            let y = &mut rest[..n * w];
            let widths = &self.widths;
            let input = |k: usize| {
                let j = node.inputs[k];
                &before[offsets[j]..offsets[j] + n * widths[j]]
            };
            match &node.op {
                Op::Input { offset } => {
                    // A NaN (a missing feature) reads as 0 here; tree
                    // ensembles read the input itself (below).
                    let read = |yr: &mut [f32], xr: &[f32]| {
                        for (o, v) in yr.iter_mut().zip(&xr[*offset..offset + w]) {
                            *o = if v.is_nan() { 0.0 } else { *v };
                        }
                    };
                    if compact {
                        // Each request's first row.
                        for (yr, &at) in y.chunks_exact_mut(w).zip(starts) {
                            read(yr, &x[at * input_dim..(at + 1) * input_dim]);
                        }
                    } else {
                        for (yr, xr) in y.chunks_exact_mut(w).zip(x.chunks_exact(input_dim)) {
                            read(yr, xr);
                        }
                    }
                }
                Op::Dense { act, .. } => {
                    let layer = self.dense[i].as_ref().expect("prepared for every dense node");
                    self.kernel.forward(layer, input(0), n, y);
                    if !(self.kernel.fuses_relu() && *act == Act::Relu) {
                        activation::apply(*act, y);
                    }
                }
                Op::Act(act) => {
                    y.copy_from_slice(input(0));
                    activation::apply(*act, y);
                }
                Op::Add | Op::Sub | Op::Mul | Op::Div => {
                    let (a, b) = (input(0), input(1));
                    let wb = widths[node.inputs[1]];
                    match node.op {
                        Op::Add => elementwise(y, a, b, w, wb, |p, q| p + q),
                        Op::Sub => elementwise(y, a, b, w, wb, |p, q| p - q),
                        Op::Mul => elementwise(y, a, b, w, wb, |p, q| p * q),
                        _ => elementwise(y, a, b, w, wb, |p, q| p / q),
                    }
                }
                Op::Affine { center, scale, shift } => {
                    for (yr, ar) in y.chunks_exact_mut(w).zip(input(0).chunks_exact(w)) {
                        for ((((o, v), c), m), b) in yr.iter_mut().zip(ar).zip(center).zip(scale).zip(shift) {
                            *o = (v - c) * m + b;
                        }
                    }
                }
                Op::Concat => {
                    let mut at = 0;
                    for &j in &node.inputs {
                        let wj = widths[j];
                        let src = &before[offsets[j]..offsets[j] + n * wj];
                        for (yr, sr) in y.chunks_exact_mut(w).zip(src.chunks_exact(wj)) {
                            yr[at..at + wj].copy_from_slice(sr);
                        }
                        at += wj;
                    }
                }
                Op::LayerNorm { epsilon, scale, shift } => {
                    for (yr, ar) in y.chunks_exact_mut(w).zip(input(0).chunks_exact(w)) {
                        let n = w as f32;
                        let mean = lanes_sum(ar, |v| v) / n;
                        let var = lanes_sum(ar, |v| (v - mean) * (v - mean)) / n;
                        let inv = 1.0 / (var + epsilon).sqrt();
                        for (((o, v), m), b) in yr.iter_mut().zip(ar).zip(scale).zip(shift) {
                            *o = (v - mean) * inv * m + b;
                        }
                    }
                }
                Op::Dot => {
                    let wa = widths[node.inputs[0]];
                    for ((o, ar), br) in y.iter_mut().zip(input(0).chunks_exact(wa)).zip(input(1).chunks_exact(wa)) {
                        *o = lanes_dot(ar, br);
                    }
                }
                Op::Sum => {
                    let wa = widths[node.inputs[0]];
                    for (o, ar) in y.iter_mut().zip(input(0).chunks_exact(wa)) {
                        *o = lanes_sum(ar, |v| v);
                    }
                }
                Op::Trees(_) => {
                    let t = self.trees[i].as_ref().expect("built for every Trees node");
                    match self.nodes[node.inputs[0]].op {
                        // Missing values reach the trees as NaN.
                        Op::Input { offset } if compact => {
                            for (yr, &at) in y.chunks_exact_mut(w).zip(starts) {
                                t.eval(&x[at * input_dim + offset..(at + 1) * input_dim], input_dim, 1, yr);
                            }
                        }
                        Op::Input { offset } => t.eval(&x[offset..], input_dim, n, y),
                        _ => t.eval(input(0), widths[node.inputs[0]], n, y),
                    }
                }
                Op::Embedding { dim, rows: table_rows, table, default } => {
                    let table: &[f32] = table;
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
            if compact {
                let y = &self.compact[self.compact_offsets[i]..][..requests * w];
                let dst = &mut self.buf[self.offsets[i]..][..rows * w];
                for (yr, run) in y.chunks_exact(w).zip(starts.windows(2)) {
                    for d in dst[run[0] * w..run[1] * w].chunks_exact_mut(w) {
                        d.copy_from_slice(yr);
                    }
                }
            }
        }
        let last = self.nodes.len() - 1;
        out.copy_from_slice(&self.buf[self.offsets[last]..self.offsets[last] + rows]);
    }
}

/// `y = f(a, b)` elementwise over `[rows][w]`, `b` one wide (broadcast
/// along the row) or `w` wide.
#[inline(always)]
fn elementwise(y: &mut [f32], a: &[f32], b: &[f32], w: usize, wb: usize, f: impl Fn(f32, f32) -> f32) {
    if wb == 1 {
        for ((yr, ar), q) in y.chunks_exact_mut(w).zip(a.chunks_exact(w)).zip(b) {
            for (o, p) in yr.iter_mut().zip(ar) {
                *o = f(*p, *q);
            }
        }
    } else {
        for ((o, p), q) in y.iter_mut().zip(a).zip(b) {
            *o = f(*p, *q);
        }
    }
}

/// `Σ f(v)` in eight interleaved partial sums combined in a fixed order,
/// so the loop vectorises and every build rounds alike. Plain loops, not
/// iterator adaptors, so the body inlines into the executor's builds.
#[inline(always)]
fn lanes_sum(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let whole = v.len() / 8 * 8;
    for c in v[..whole].chunks_exact(8) {
        for k in 0..8 {
            acc[k] += f(c[k]);
        }
    }
    let mut tail = 0.0;
    for &x in &v[whole..] {
        tail += f(x);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `Σ a[i] · b[i]`, summed as `lanes_sum` does.
#[inline(always)]
fn lanes_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let whole = a.len() / 8 * 8;
    for (ca, cb) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut tail = 0.0;
    for (x, y) in a[whole..].iter().zip(&b[whole..]) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
