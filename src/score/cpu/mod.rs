//! CPU backends: the f32 oracle and the INT8 kernel (FP8 E4M3 in `fp8.rs`).
//!
//! INT8 semantics (shared with the GPU kernels, so written down exactly).
//! Weights are symmetric per output channel (`Layer::quantize`); dot
//! products accumulate in i32. Activations follow one of two semantics,
//! fixed by the model file:
//!
//! - **Static** (the model has a `Calibration`, from `quiver import
//!   --calibration`): layer 0's input is quantized with the calibrated scale
//!   `s_in`, `x_q = clamp(round_ties_even(x · (1 / s_in)), -128, 127)` (the
//!   reciprocal rounded to f32 once, NaN to 0); each hidden layer's output is
//!   requantized in integer form,
//!   `clamp(round_ties_even(f32(acc + bias_q[o]) · scale[o]), lo, 127)` with
//!   ReLU fused as `lo = 0`; the output layer's logit is
//!   `f32(acc + bias_q[o]) · scale[o]`. `bias_q` and `scale` are defined by
//!   `model::StaticInt8Layer`.
//! - **Dynamic** (the fallback for models without calibration, e.g. the
//!   demo model or an import without `--calibration`): each input row of a
//!   layer is quantized on the fly with its own scale, `s_x = max|x| / 127`,
//!   `x_q = clamp(round_ties_even(x / s_x), -127, 127)`; the output is
//!   `acc as f32 * (s_w[o] * s_x) + bias[o]`, then ReLU where the layer has
//!   one, in f32.
//!
//! `Int8Kernel::Scalar` is each definition transcribed one row and one output
//! at a time; it stays as the reference. The other INT8 variants
//! (`int8_gemm`) quantize a whole layer input at once and run a blocked GEMM
//! on weights repacked at construction, and must match the scalar variant
//! bit for bit. The best variant the CPU supports is chosen once, when the
//! backend is built.

mod activation;
mod aligned;
pub mod executor;
pub mod forest;
pub mod fp8;
pub mod int8_gemm;
mod tiles;

pub use fp8::CpuFp8;
pub use int8_gemm::Int8Kernel;
use int8_gemm::{PackedLayer, Scratch, StaticLayers};

use std::sync::Arc;

use super::{Backend, BackendError, BackendInfo};
use crate::model::{round_clamp_i8, Layer, Model, Node, StaticInt8Layer};
use executor::{DenseKernel, F32Tiles, GraphExec};

/// Two activation buffers, ping-ponged between layers, sized at start-up.
struct Activations {
    a: Vec<f32>,
    b: Vec<f32>,
}

impl Activations {
    fn new(model: &Model, rows_max: usize) -> Activations {
        let n = rows_max * model.width_max();
        Activations { a: vec![0.0; n], b: vec![0.0; n] }
    }

    /// Runs every layer: layer 0 reads `x` and writes `a`, later layers read
    /// what the previous one wrote and write the other buffer.
    /// `layer_kernel(index, layer, input, output)` computes one layer for all
    /// rows; `input` is `[rows][in_dim]`, `output` `[rows][out_dim]`.
    fn run_layers(
        &mut self,
        model: &Model,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        mut layer_kernel: impl FnMut(usize, &Layer, &[f32], &mut [f32]),
    ) {
        let Activations { a, b } = self;
        for (i, l) in model.layers.iter().enumerate() {
            let (src, dst): (&[f32], &mut [f32]) = match i {
                0 => (x, &mut a[..]),
                _ if i % 2 == 1 => (&a[..], &mut b[..]),
                _ => (&b[..], &mut a[..]),
            };
            layer_kernel(i, l, &src[..rows * l.in_dim], &mut dst[..rows * l.out_dim]);
        }
        let last = if model.layers.len() % 2 == 1 { &a[..] } else { &b[..] };
        out.copy_from_slice(&last[..rows]);
    }

    /// `run_layers` with a kernel that computes one row at a time:
    /// `row_kernel(layer, input_row, output_row)`.
    fn run(
        &mut self,
        model: &Model,
        x: &[f32],
        rows: usize,
        out: &mut [f32],
        mut row_kernel: impl FnMut(&Layer, &[f32], &mut [f32]),
    ) {
        self.run_layers(model, x, rows, out, |_, l, src, dst| {
            for (xr, yr) in src.chunks_exact(l.in_dim).zip(dst.chunks_exact_mut(l.out_dim)) {
                row_kernel(l, xr, yr);
            }
        });
    }
}

/// The f32 backend: the oracle other backends are tested against. Every
/// model, a v1 MLP included, runs as a graph on the executor's tiled f32
/// dense layers; a v1 MLP's first layer is split by input kind
/// (`Model::to_graph_split`), so that its user and context part is computed
/// once per request (its first-layer sums are grouped differently from the
/// reference pass's, within f32 rounding).
pub struct CpuF32 {
    info: BackendInfo,
    exec: GraphExec<F32Tiles>,
}

impl CpuF32 {
    pub fn new(model: &Arc<Model>, rows_max: usize) -> CpuF32 {
        let exec = GraphExec::new(&model.to_graph_split(), F32Tiles::new(), rows_max, &model.request_columns());
        CpuF32 { info: BackendInfo { name: "cpu-f32", rows_max, model: model.clone() }, exec }
    }

    /// The nodes it runs (`GraphExec::nodes`): the model's graph, or a v1
    /// MLP's split one.
    pub fn nodes(&self) -> &[Node] {
        self.exec.nodes()
    }
}

impl Backend for CpuF32 {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.info.check(x, rows, out);
        self.exec.run(x, rows, out);
        Ok(())
    }
}

/// A requested INT8 kernel needs CPU features this machine lacks.
#[derive(Debug, thiserror::Error)]
#[error("the {} INT8 kernel needs CPU features this machine lacks", .0.name())]
pub struct KernelUnavailable(pub Int8Kernel);

/// Which INT8 kernel the process's INT8 backends run: `auto`
/// (`Int8Kernel::best`) or one named (`--kernel`, the `kernel` key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum KernelChoice {
    /// The fastest variant this CPU runs (`Int8Kernel::best`).
    #[default]
    Auto,
    /// AMX-INT8 tiles (`tdpbusd`): Intel Sapphire Rapids and later, with
    /// the kernel's tile permission.
    Amx,
    /// AVX-512 VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AVX2 (`vpmaddwd`).
    Avx2,
    /// Plain Rust, any CPU.
    Portable,
}

impl KernelChoice {
    /// The kernel this choice names on this CPU; an unavailable one is an
    /// error, never a silent fallback.
    pub fn resolve(self) -> Result<Int8Kernel, KernelUnavailable> {
        let kernel = match self {
            KernelChoice::Auto => return Ok(Int8Kernel::best()),
            KernelChoice::Amx => Int8Kernel::Amx,
            KernelChoice::Avx512Vnni => Int8Kernel::Avx512Vnni,
            KernelChoice::Avx2 => Int8Kernel::Avx2,
            KernelChoice::Portable => Int8Kernel::Portable,
        };
        if kernel.is_available() {
            Ok(kernel)
        } else {
            Err(KernelUnavailable(kernel))
        }
    }
}

/// The kernel `configure_kernel` forced, as its index in `Int8Kernel::ALL`
/// plus one; 0 for `auto`.
static FORCED_KERNEL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets the kernel every `CpuInt8::new` from now on runs, before any
/// backend is built (as `score::configure_onnxruntime` names its library);
/// returns the kernel chosen. A kernel this CPU lacks is refused and
/// changes nothing.
pub fn configure_kernel(choice: KernelChoice) -> Result<Int8Kernel, KernelUnavailable> {
    let kernel = choice.resolve()?;
    let forced = match choice {
        KernelChoice::Auto => 0,
        _ => 1 + Int8Kernel::ALL.iter().position(|k| *k == kernel).expect("ALL lists every kernel"),
    };
    FORCED_KERNEL.store(forced, std::sync::atomic::Ordering::Relaxed);
    Ok(kernel)
}

/// The kernel `CpuInt8::new` runs: the one `configure_kernel` forced, else
/// `Int8Kernel::best()`.
pub fn configured_kernel() -> Int8Kernel {
    match FORCED_KERNEL.load(std::sync::atomic::Ordering::Relaxed) {
        0 => Int8Kernel::best(),
        i => Int8Kernel::ALL[i - 1],
    }
}

/// The INT8 backend.
pub struct CpuInt8 {
    info: BackendInfo,
    kernel: Int8Kernel,
    act: Activations,
    /// One quantized input row, for the scalar kernel.
    xq: Vec<i8>,
    /// The second quantized row of the scalar static path.
    xq_next: Vec<i8>,
    /// One per model layer; empty for the scalar kernel.
    packed: Vec<PackedLayer>,
    scratch: Scratch,
    /// The static semantics' constants, for a calibrated model.
    statics: Option<Vec<StaticInt8Layer>>,
    /// The blocked kernels' static path; `None` for the scalar kernel or an
    /// uncalibrated model.
    static_layers: Option<StaticLayers>,
    /// The executor of a graph model (its dense nodes dynamic INT8).
    graph: Option<GraphExec<Int8Dense>>,
}

/// Dynamic INT8 dense layers for the graph executor: the semantics of
/// `CpuInt8` on an uncalibrated model, through the same kernels.
struct Int8Dense {
    kernel: Int8Kernel,
    scratch: Scratch,
    /// One quantized input row, for the scalar kernel.
    xq: Vec<i8>,
}

enum Int8Prepared {
    /// The scalar reference, one row at a time, on the layer as it is.
    Scalar(Layer),
    Packed(PackedLayer),
}

impl DenseKernel for Int8Dense {
    type Prepared = Int8Prepared;

    fn prepare(&self, layer: &Layer) -> Int8Prepared {
        match self.kernel {
            Int8Kernel::Scalar => Int8Prepared::Scalar(layer.clone()),
            k => Int8Prepared::Packed(PackedLayer::new(k, layer)),
        }
    }

    /// The blocked kernels fuse ReLU into their epilogue; the scalar
    /// reference leaves it to the executor.
    fn fuses_relu(&self) -> bool {
        self.kernel != Int8Kernel::Scalar
    }

    #[inline(always)]
    fn forward(&mut self, layer: &Int8Prepared, x: &[f32], rows: usize, y: &mut [f32]) {
        match layer {
            Int8Prepared::Scalar(l) => {
                let xq = &mut self.xq[..l.in_dim];
                for (xr, yr) in x.chunks_exact(l.in_dim).zip(y.chunks_exact_mut(l.out_dim)) {
                    let s_x = quantize_row(xr, xq);
                    for (o, v) in yr.iter_mut().enumerate() {
                        let acc = dot_i8(&l.weights_i8[o * l.in_dim..(o + 1) * l.in_dim], xq);
                        *v = acc as f32 * (l.weight_scales[o] * s_x) + l.bias[o];
                    }
                }
            }
            Int8Prepared::Packed(p) => p.forward(x, rows, y, &mut self.scratch),
        }
    }
}

impl CpuInt8 {
    /// The backend with the configured kernel (`configure_kernel`), by
    /// default the fastest this CPU supports.
    pub fn new(model: &Arc<Model>, rows_max: usize) -> CpuInt8 {
        let kernel = configured_kernel();
        let backend = CpuInt8::with_kernel(model, rows_max, kernel)
            .unwrap_or_else(|e| panic!("the configured INT8 kernel is unavailable: {e}"));
        let amx_tiles = backend
            .amx_tiled_layers()
            .map(|(tiled, of)| format!("{tiled} of {of} per-candidate dense layers (the VNNI loop on the others)"));
        tracing::info!(
            kernel = kernel.name(),
            activations = if backend.is_static() { "static (calibrated)" } else { "dynamic (uncalibrated model)" },
            amx_tiles = amx_tiles.as_deref().unwrap_or("n/a"),
            rows_max,
            "cpu-int8 backend: INT8 kernel chosen"
        );
        backend
    }

    /// For the `Amx` kernel: how many of the dense layers scored per
    /// candidate run AMX tiles (the layer shapes `amx_tiles_pay` accepts),
    /// and how many such layers there are; `None` for the other kernels.
    /// Layers that read only per-request columns run once per request, on
    /// one row, through the VNNI loop whatever their shape.
    pub fn amx_tiled_layers(&self) -> Option<(usize, usize)> {
        if self.kernel != Int8Kernel::Amx {
            return None;
        }
        let packed: Vec<&PackedLayer> = match &self.graph {
            Some(exec) => exec
                .dense_layers()
                .filter(|(_, shared)| !shared)
                .filter_map(|(p, _)| match p {
                    Int8Prepared::Packed(p) => Some(p),
                    Int8Prepared::Scalar(_) => None,
                })
                .collect(),
            None => self.packed.iter().collect(),
        };
        Some((packed.iter().filter(|p| p.uses_tiles()).count(), packed.len()))
    }

    /// The backend running `kernel`, if this CPU supports it.
    pub fn with_kernel(model: &Arc<Model>, rows_max: usize, kernel: Int8Kernel) -> Result<CpuInt8, KernelUnavailable> {
        if !kernel.is_available() {
            return Err(KernelUnavailable(kernel));
        }
        let packed = match kernel {
            Int8Kernel::Scalar => Vec::new(),
            _ => model.layers.iter().map(|l| PackedLayer::new(kernel, l)).collect(),
        };
        let statics = model.static_int8();
        let static_layers = match (&statics, kernel) {
            (Some(s), k) if k != Int8Kernel::Scalar => {
                Some(StaticLayers::new(kernel, s.clone(), &packed, model.width_max(), rows_max))
            }
            _ => None,
        };
        Ok(CpuInt8 {
            info: BackendInfo { name: "cpu-int8", rows_max, model: model.clone() },
            kernel,
            act: Activations::new(model, rows_max),
            xq: vec![0; model.width_max()],
            xq_next: vec![0; model.width_max()],
            packed,
            scratch: Scratch::new(kernel, model.width_max(), rows_max),
            statics,
            static_layers,
            graph: model.graph.as_ref().map(|g| {
                let width_max = g.width_max();
                let dense =
                    Int8Dense { kernel, scratch: Scratch::new(kernel, width_max, rows_max), xq: vec![0; width_max] };
                GraphExec::new(g, dense, rows_max, &model.request_columns())
            }),
        })
    }

    pub fn kernel(&self) -> Int8Kernel {
        self.kernel
    }

    /// The AMX kernel on tiles for every row count (`PackedLayer::tiles_only`).
    #[cfg(test)]
    fn amx_tiles_only(&mut self) {
        self.packed.iter_mut().for_each(PackedLayer::tiles_only);
    }

    /// Whether the model is calibrated, so activations use static scales.
    pub fn is_static(&self) -> bool {
        self.statics.is_some()
    }

    /// The scalar reference of the static semantics, one row at a time.
    fn logits_static_scalar(&mut self, x: &[f32], rows: usize, out: &mut [f32]) {
        let model = &*self.info.model;
        let statics = self.statics.as_ref().expect("called for calibrated models");
        let inv = 1.0 / statics[0].in_scale;
        let k0 = model.input_dim();
        for (r, y) in out[..rows].iter_mut().enumerate() {
            for (q, v) in self.xq.iter_mut().zip(&x[r * k0..(r + 1) * k0]) {
                *q = round_clamp_i8(v * inv, -128);
            }
            for (l, s) in model.layers.iter().zip(statics) {
                let xq = &self.xq[..l.in_dim];
                for o in 0..l.out_dim {
                    let acc = dot_i8(&l.weights_i8[o * l.in_dim..(o + 1) * l.in_dim], xq) + s.bias_q[o];
                    let v = acc as f32 * s.scale[o];
                    if s.requantize {
                        self.xq_next[o] = round_clamp_i8(v, s.lo);
                    } else {
                        *y = v;
                    }
                }
                std::mem::swap(&mut self.xq, &mut self.xq_next);
            }
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
    let tail: i32 = a[chunks..].iter().zip(&b[chunks..]).map(|(&x, &y)| i32::from(x) * i32::from(y)).sum();
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
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// Graph models compute their per-request nodes once per request
    /// (exact: every row is quantized on its own); v1 MLPs score every row.
    fn score(&mut self, x: &[f32], rows: usize, out: &mut [f32]) -> Result<(), BackendError> {
        self.info.check(x, rows, out);
        // The scalar reference of the static semantics (a calibrated MLP).
        if self.graph.is_none() && self.statics.is_some() && self.static_layers.is_none() {
            self.logits_static_scalar(x, rows, out);
            return Ok(());
        }
        let CpuInt8 { info, kernel, act, xq, packed, scratch, static_layers, graph, .. } = self;
        let model = &*info.model;
        if let Some(exec) = graph {
            exec.run(x, rows, out);
        } else if let Some(st) = static_layers {
            st.logits(packed, x, rows, out);
        } else if *kernel != Int8Kernel::Scalar {
            act.run_layers(model, x, rows, out, |i, _, src, dst| {
                packed[i].forward(src, rows, dst, scratch);
            });
        } else {
            act.run(model, x, rows, out, |l, xr, yr| {
                let xq = &mut xq[..l.in_dim];
                let s_x = quantize_row(xr, xq);
                for (o, y) in yr.iter_mut().enumerate() {
                    let acc = dot_i8(&l.weights_i8[o * l.in_dim..(o + 1) * l.in_dim], xq);
                    let v = acc as f32 * (l.weight_scales[o] * s_x) + l.bias[o];
                    *y = if l.relu { v.max(0.0) } else { v };
                }
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Layer;

    /// A seeded random MLP with odd sizes (not multiples of any vector width).
    fn random_model(seed: u64, dims: &[usize]) -> Model {
        crate::loadgen::demo::context_mlp("random", seed, dims)
    }

    /// `model` calibrated (max-abs) on 64 seeded normal rows, every range
    /// then multiplied by `shrink`: below 1, activations saturate often.
    fn calibrated(mut model: Model, shrink: f32) -> Model {
        use crate::model::calibrate::{calibrate, Matrix, Method};
        let k = model.input_dim();
        let set = Matrix { rows: 64, cols: k, data: inputs(77, 64 * k) };
        let mut c = calibrate(&model, &set, Method::MaxAbs, |_, _| {}).unwrap();
        c.input_ranges.iter_mut().for_each(|r| *r *= shrink);
        model.calibration = Some(c);
        model.name = format!("{}-calibrated-{shrink}", model.name);
        model
    }

    /// Calibrated models at odd sizes, one with a hidden layer without ReLU
    /// (so requantized activations reach -128).
    fn calibrated_models() -> Vec<Arc<Model>> {
        let mut linear_hidden = random_model(36, &[37, 33, 17, 1]);
        linear_hidden.layers[0].relu = false;
        vec![
            calibrated(random_model(31, &[80, 256, 128, 1]), 1.0),
            calibrated(random_model(32, &[37, 33, 17, 1]), 0.6),
            calibrated(random_model(33, &[257, 255, 65, 1]), 1.0),
            calibrated(random_model(34, &[1, 7, 1]), 0.3),
            calibrated(linear_hidden, 0.5),
            // Channel blocks that leave 1, 2 and 3 blocks of 16 after the
            // tiles of 4 blocks (80 = 5 · 16, 160 = 10 · 16, 48 = 3 · 16).
            calibrated(random_model(37, &[64, 80, 48, 1]), 0.8),
            calibrated(random_model(38, &[20, 160, 32, 1]), 1.0),
        ]
        .into_iter()
        .map(Arc::new)
        .collect()
    }

    fn inputs(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = crate::loadgen::demo::SplitMix64::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    #[test]
    fn static_int8_matches_a_scalar_transcription_exactly() {
        let model = Arc::new(calibrated(random_model(5, &[19, 7, 5, 1]), 0.5));
        let st = model.static_int8().unwrap();
        let rows = 4;
        let x = inputs(9, 19 * rows);
        let mut got = vec![0.0; rows];
        CpuInt8::with_kernel(&model, rows, Int8Kernel::Scalar).unwrap().score(&x, rows, &mut got).unwrap();
        let mut saturated = 0;
        for r in 0..rows {
            let inv = 1.0 / (model.calibration.as_ref().unwrap().input_ranges[0] / 127.0);
            let mut q: Vec<i32> = x[r * 19..(r + 1) * 19]
                .iter()
                .map(|v| (v * inv).round_ties_even().clamp(-128.0, 127.0) as i32)
                .collect();
            let mut logit = f32::NAN;
            for (l, s) in model.layers.iter().zip(&st) {
                let acc: Vec<i32> = (0..l.out_dim)
                    .map(|o| (0..l.in_dim).map(|i| i32::from(l.weights_i8[o * l.in_dim + i]) * q[i]).sum::<i32>())
                    .collect();
                if s.requantize {
                    q = (0..l.out_dim)
                        .map(|o| {
                            let v = ((acc[o] + s.bias_q[o]) as f32 * s.scale[o]).round_ties_even();
                            let lo = if l.relu { 0.0 } else { -128.0 };
                            v.clamp(lo, 127.0) as i32
                        })
                        .collect();
                    saturated += q.iter().filter(|v| **v == 127).count();
                } else {
                    logit = (acc[0] + s.bias_q[0]) as f32 * s.scale[0];
                }
            }
            assert_eq!(got[r].to_bits(), logit.to_bits(), "row {r}");
        }
        assert!(saturated > 0, "the shrunken ranges exercise saturation");
    }

    #[test]
    fn every_int8_kernel_scores_calibrated_models_bit_for_bit_like_the_scalar_backend() {
        for model in &calibrated_models() {
            let k = model.input_dim();
            let mut scalar = CpuInt8::with_kernel(model, 64, Int8Kernel::Scalar).unwrap();
            assert!(scalar.is_static());
            for kernel in blocked_kernels() {
                let mut backend = CpuInt8::with_kernel(model, 64, kernel).unwrap();
                for rows in TILE_ROWS {
                    let mut x = inputs(rows as u64 + 200, rows * k);
                    // Zero, infinite, NaN and huge inputs in the first rows.
                    x[..k].fill(0.0);
                    if rows > 4 {
                        x[k] = f32::INFINITY;
                        x[2 * k] = f32::NEG_INFINITY;
                        x[3 * k + k / 2] = f32::NAN;
                        x[4 * k] = 3.0e38;
                    }
                    if rows > 6 {
                        // The last column, past any whole vector of inputs.
                        x[6 * k - 1] = f32::NAN;
                    }
                    let (mut want, mut got) = (vec![0.0; rows], vec![0.0; rows]);
                    scalar.score(&x, rows, &mut want).unwrap();
                    backend.score(&x, rows, &mut got).unwrap();
                    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{kernel:?} {} rows {rows}: row {r}", model.name);
                    }
                }
            }
        }
    }

    #[test]
    fn int8_matches_a_scalar_transcription_exactly() {
        let model = Arc::new(random_model(5, &[19, 7, 1]));
        let x = inputs(9, 19 * 3);
        let mut got = vec![0.0; 3];
        CpuInt8::new(&model, 3).score(&x, 3, &mut got).unwrap();
        for r in 0..3 {
            let mut act = x[r * 19..(r + 1) * 19].to_vec();
            for l in &model.layers {
                let max_abs = act.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s_x = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
                let q: Vec<i32> =
                    act.iter().map(|v| (v * (1.0 / s_x)).round_ties_even().clamp(-127.0, 127.0) as i32).collect();
                act = (0..l.out_dim)
                    .map(|o| {
                        let acc: i32 = (0..l.in_dim).map(|i| i32::from(l.weights_i8[o * l.in_dim + i]) * q[i]).sum();
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

    /// A layer with uniformly random INT8 weights, or every weight `fill`.
    fn int8_layer(
        rng: &mut crate::loadgen::demo::SplitMix64,
        k: usize,
        n: usize,
        relu: bool,
        fill: Option<i8>,
    ) -> Layer {
        let weights_i8: Vec<i8> =
            (0..k * n).map(|_| fill.unwrap_or_else(|| (rng.below(255) as i32 - 127) as i8)).collect();
        let weight_scales: Vec<f32> = (0..n).map(|_| 0.001 + rng.unit() as f32 * 0.1).collect();
        let weights_f32 = weights_i8.iter().enumerate().map(|(i, &w)| f32::from(w) * weight_scales[i / k]).collect();
        Layer {
            in_dim: k,
            out_dim: n,
            relu,
            weights_f32,
            weights_i8,
            weight_scales,
            bias: (0..n).map(|_| rng.normal() * 0.1).collect(),
        }
    }

    const KS: [usize; 8] = [1, 3, 17, 63, 64, 65, 80, 257];
    const NS: [usize; 6] = [1, 7, 16, 33, 128, 255];
    const ROWS: [usize; 4] = [1, 31, 32, 33];
    /// Whole-model batch sizes: every leftover of the 4-row tiles (1 to 3
    /// rows, alone and after whole tiles) and a few whole-tile counts.
    const TILE_ROWS: [usize; 11] = [1, 2, 3, 5, 6, 7, 8, 31, 32, 33, 64];

    /// The blocked kernels this CPU runs. Each one it lacks is named once
    /// per test process on stderr, past the harness's capture, so a CI log
    /// shows which paths went untested on that machine.
    fn blocked_kernels() -> Vec<Int8Kernel> {
        static SKIPS: std::sync::Once = std::sync::Once::new();
        SKIPS.call_once(|| {
            use std::io::Write;
            for k in Int8Kernel::ALL.into_iter().filter(|k| !k.is_available()) {
                let _ =
                    writeln!(std::io::stderr(), "skipped: the {} INT8 kernel (not available on this CPU)", k.name());
            }
        });
        Int8Kernel::ALL.into_iter().filter(|k| *k != Int8Kernel::Scalar && k.is_available()).collect()
    }

    /// Names the INT8 kernels this machine runs, and so tests, and those it
    /// skips: `.ci/run` prints these lines after the suite.
    #[test]
    fn isa_paths_tested_on_this_cpu() {
        let (ran, skipped): (Vec<Int8Kernel>, Vec<Int8Kernel>) =
            Int8Kernel::ALL.into_iter().partition(|k| k.is_available());
        let names = |ks: &[Int8Kernel]| match ks {
            [] => "none".to_string(),
            _ => ks.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
        };
        println!("isa: int8 kernels tested against the scalar reference: {}", names(&ran));
        println!("isa: int8 kernels skipped (this CPU lacks them): {}", names(&skipped));
        println!("isa: chosen by auto: {}", Int8Kernel::best().name());
        println!(
            "isa: f32 and fp8 tile builds tested against the mul_add chain: {:?} (served: {:?})",
            tiles::Isa::available(),
            tiles::Isa::best()
        );
        assert!(ran.contains(&Int8Kernel::Scalar) && ran.contains(&Int8Kernel::Portable));
        assert!(ran.contains(&Int8Kernel::best()));
    }

    #[test]
    fn every_int8_kernel_accumulates_exactly_like_the_scalar_dot() {
        let mut rng = crate::loadgen::demo::SplitMix64::new(21);
        let rows_max = 33;
        for kernel in blocked_kernels() {
            let mut scratch = Scratch::new(kernel, 257, rows_max);
            for k in KS {
                for n in NS {
                    // Random values, then the extremes: every weight +127 or
                    // -127 against activations of ±127.
                    for (fill, extreme_x) in [(None, false), (Some(127i8), true), (Some(-127), true)] {
                        let layer = int8_layer(&mut rng, k, n, false, fill);
                        let packed = PackedLayer::new(kernel, &layer);
                        for rows in ROWS {
                            let xq: Vec<i8> = (0..rows * k)
                                .map(|_| match extreme_x {
                                    true if rng.below(2) == 0 => -127,
                                    true => 127,
                                    false => (rng.below(255) as i32 - 127) as i8,
                                })
                                .collect();
                            let mut got = vec![i32::MIN; rows * n];
                            packed.accumulate(&xq, rows, &mut got, &mut scratch);
                            for r in 0..rows {
                                for o in 0..n {
                                    let want = dot_i8(&layer.weights_i8[o * k..(o + 1) * k], &xq[r * k..(r + 1) * k]);
                                    assert_eq!(
                                        got[r * n + o],
                                        want,
                                        "{kernel:?} k {k} n {n} rows {rows} fill {fill:?}: acc[{r}][{o}]"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// One layer by the scalar definition, for rows `[rows][k]`.
    fn scalar_layer(layer: &Layer, x: &[f32], rows: usize) -> Vec<f32> {
        let (k, n) = (layer.in_dim, layer.out_dim);
        let mut xq = vec![0i8; k];
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            let s_x = quantize_row(&x[r * k..(r + 1) * k], &mut xq);
            for o in 0..n {
                let acc = dot_i8(&layer.weights_i8[o * k..(o + 1) * k], &xq);
                let v = acc as f32 * (layer.weight_scales[o] * s_x) + layer.bias[o];
                y[r * n + o] = if layer.relu { v.max(0.0) } else { v };
            }
        }
        y
    }

    #[test]
    fn every_int8_kernel_computes_layers_bit_for_bit_like_the_scalar_reference() {
        let mut rng = crate::loadgen::demo::SplitMix64::new(22);
        for kernel in blocked_kernels() {
            let mut scratch = Scratch::new(kernel, 257, 33);
            for k in KS {
                for n in NS {
                    for (fill, relu) in [(None, true), (None, false), (Some(127i8), false), (Some(-127), true)] {
                        let layer = int8_layer(&mut rng, k, n, relu, fill);
                        let packed = PackedLayer::new(kernel, &layer);
                        for rows in ROWS {
                            let x: Vec<f32> = match fill {
                                None => (0..rows * k).map(|_| rng.normal()).collect(),
                                Some(_) => (0..rows * k).map(|_| if rng.below(2) == 0 { -1.0 } else { 1.0 }).collect(),
                            };
                            let want = scalar_layer(&layer, &x, rows);
                            let mut got = vec![f32::NAN; rows * n];
                            packed.forward(&x, rows, &mut got, &mut scratch);
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "{kernel:?} k {k} n {n} rows {rows} relu {relu}: y[{}][{}] {g} vs {w}",
                                    i / n,
                                    i % n
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_int8_kernel_handles_zero_and_non_finite_rows_like_the_scalar_reference() {
        let mut rng = crate::loadgen::demo::SplitMix64::new(23);
        let (k, n, rows) = (19, 21, 6);
        let mut x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
        x[..k].fill(0.0);
        x[k + 3] = f32::INFINITY;
        x[2 * k + 5] = f32::NEG_INFINITY;
        x[3 * k + 7] = f32::NAN;
        x[4 * k..5 * k].fill(f32::NAN);
        for relu in [false, true] {
            let layer = int8_layer(&mut rng, k, n, relu, None);
            let want = scalar_layer(&layer, &x, rows);
            for kernel in blocked_kernels() {
                let mut got = vec![0.0; rows * n];
                PackedLayer::new(kernel, &layer).forward(&x, rows, &mut got, &mut Scratch::new(kernel, k, rows));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{kernel:?} relu {relu}");
            }
        }
    }

    #[test]
    fn every_int8_kernel_scores_whole_models_bit_for_bit_like_the_scalar_backend() {
        let models = [
            crate::loadgen::demo::model(),
            random_model(31, &[80, 256, 128, 1]),
            random_model(32, &[37, 33, 17, 1]),
            random_model(33, &[257, 255, 65, 1]),
            random_model(34, &[1, 7, 1]),
            random_model(37, &[64, 80, 48, 1]),
        ]
        .map(Arc::new);
        for model in &models {
            let mut scalar = CpuInt8::with_kernel(model, 64, Int8Kernel::Scalar).unwrap();
            for kernel in blocked_kernels() {
                let mut backend = CpuInt8::with_kernel(model, 64, kernel).unwrap();
                assert_eq!(backend.kernel(), kernel);
                for rows in TILE_ROWS {
                    let x = inputs(rows as u64 + 100, rows * model.input_dim());
                    let (mut want, mut got) = (vec![0.0; rows], vec![0.0; rows]);
                    scalar.score(&x, rows, &mut want).unwrap();
                    backend.score(&x, rows, &mut got).unwrap();
                    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(g.to_bits(), w.to_bits(), "{kernel:?} {} rows {rows}: row {r}", model.name);
                    }
                }
            }
        }
    }

    /// Where `Amx` runs its tiles: not on the narrow layers of the zoo's
    /// models (K of 8 to 64 with N up to 64), where they measured slower
    /// than the VNNI loop, but on the demo model's wide ones; a layer off
    /// the rule runs the VNNI loop on the same packed weights.
    #[test]
    fn amx_runs_tiles_only_on_layer_shapes_where_they_pay() {
        use int8_gemm::amx_tiles_pay;
        for (k, n) in [(8, 64), (20, 64), (32, 256), (48, 256), (64, 32), (64, 64), (80, 64)] {
            assert!(!amx_tiles_pay(k, n), "{k} x {n}");
        }
        for (k, n) in [(64, 128), (80, 256), (128, 1), (256, 128), (512, 16)] {
            assert!(amx_tiles_pay(k, n), "{k} x {n}");
        }
        if !Int8Kernel::Amx.is_available() {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: amx not available on this CPU (the rule was checked)");
            return;
        }
        let layer = |k: usize, n: usize| Layer::quantize(k, n, true, vec![0.5; k * n], vec![0.0; n]);
        assert!(!PackedLayer::new(Int8Kernel::Amx, &layer(20, 64)).uses_tiles());
        assert!(PackedLayer::new(Int8Kernel::Amx, &layer(256, 128)).uses_tiles());
        let forced = PackedLayer::with_tiles(Int8Kernel::Amx, &layer(20, 64), int8_gemm::AmxTiles::Always);
        assert!(forced.uses_tiles());
        assert!(!PackedLayer::new(Int8Kernel::Avx512Vnni, &layer(256, 128)).uses_tiles());
        let demo = CpuInt8::with_kernel(&Arc::new(crate::loadgen::demo::model()), 32, Int8Kernel::Amx)
            .expect("amx is available");
        assert_eq!(demo.amx_tiled_layers(), Some((3, 3)));
    }

    /// The AMX kernel at the shapes of its tiles' edges: rows around and
    /// past 16 and 32 (ragged last tiles), K around 64 (one tile row) and N
    /// around 16 (one tile's channels), dynamic and static, against the
    /// scalar reference bit for bit. Other kernels run these shapes too
    /// where they are cheap enough; without AMX the test says so on stderr,
    /// past the test harness's capture, and passes.
    #[test]
    fn amx_matches_the_scalar_reference_at_every_tile_edge() {
        if !Int8Kernel::Amx.is_available() {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: amx not available on this CPU");
            return;
        }
        const ROWS: [usize; 10] = [1, 2, 15, 16, 17, 31, 33, 100, 255, 1024];
        const KS: [usize; 6] = [1, 3, 63, 64, 65, 200];
        const NS: [usize; 5] = [1, 15, 16, 17, 100];
        let kernel = Int8Kernel::Amx;
        let rows_max = 1024;
        let mut rng = crate::loadgen::demo::SplitMix64::new(41);
        let mut scratch = Scratch::new(kernel, 200, rows_max);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        // As the backend runs it (few rows through the VNNI loop), then
        // every row on tiles.
        for tiles_only in [false, true] {
            for (k, n) in KS.into_iter().flat_map(|k| NS.map(|n| (k, n))) {
                // Raw sums: random values, then ±127 everywhere.
                for fill in [None, Some(127i8), Some(-127)] {
                    let layer = int8_layer(&mut rng, k, n, false, fill);
                    let mut packed = PackedLayer::new(kernel, &layer);
                    if tiles_only {
                        packed.tiles_only();
                    }
                    for rows in ROWS {
                        let xq: Vec<i8> = (0..rows * k)
                            .map(|_| match fill {
                                Some(_) if rng.below(2) == 0 => -127,
                                Some(_) => 127,
                                None => (rng.below(255) as i32 - 127) as i8,
                            })
                            .collect();
                        let mut got = vec![i32::MIN; rows * n];
                        packed.accumulate(&xq, rows, &mut got, &mut scratch);
                        for r in 0..rows {
                            for o in 0..n {
                                let want = dot_i8(&layer.weights_i8[o * k..(o + 1) * k], &xq[r * k..(r + 1) * k]);
                                assert_eq!(
                                    got[r * n + o],
                                    want,
                                    "k {k} n {n} rows {rows} fill {fill:?} tiles only {tiles_only}: acc[{r}][{o}]"
                                );
                            }
                        }
                    }
                }
                // Dynamic layers with zero, infinite, NaN and huge rows.
                for relu in [false, true] {
                    let layer = int8_layer(&mut rng, k, n, relu, None);
                    let mut packed = PackedLayer::new(kernel, &layer);
                    if tiles_only {
                        packed.tiles_only();
                    }
                    for rows in ROWS {
                        let mut x = inputs(rng.below(1 << 20), rows * k);
                        x[..k].fill(0.0);
                        let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3.0e38, -3.0e38];
                        for (r, v) in (1..rows).step_by(3).zip(specials.iter().cycle()) {
                            x[r * k + (r * 7) % k] = *v;
                        }
                        let want = scalar_layer(&layer, &x, rows);
                        let mut got = vec![f32::NAN; rows * n];
                        // Now and then released, as other AMX code on the
                        // thread may: the next call configures the tiles.
                        if rows % 2 == 1 {
                            int8_gemm::release_amx_tiles();
                        }
                        packed.forward(&x, rows, &mut got, &mut scratch);
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "dynamic k {k} n {n} rows {rows} relu {relu} tiles only {tiles_only}"
                        );
                    }
                }
                // Static: `n` is a hidden width, requantized between layers;
                // the shrunken ranges saturate.
                let model = Arc::new(calibrated(random_model(k as u64 * 1000 + n as u64, &[k, n, 17, 1]), 0.5));
                let mut scalar = CpuInt8::with_kernel(&model, rows_max, Int8Kernel::Scalar).unwrap();
                let mut amx = CpuInt8::with_kernel(&model, rows_max, kernel).unwrap();
                assert!(amx.is_static());
                if tiles_only {
                    amx.amx_tiles_only();
                }
                for rows in ROWS {
                    let mut x = inputs(rng.below(1 << 20), rows * k);
                    x[..k].fill(0.0);
                    if rows > 3 {
                        x[k] = f32::INFINITY;
                        x[2 * k + k / 2] = f32::NAN;
                        x[3 * k] = f32::NEG_INFINITY;
                    }
                    let (mut want, mut got) = (vec![0.0; rows], vec![0.0; rows]);
                    scalar.score(&x, rows, &mut want).unwrap();
                    amx.score(&x, rows, &mut got).unwrap();
                    assert_eq!(bits(&got), bits(&want), "static k {k} n {n} rows {rows} tiles only {tiles_only}");
                }
            }
        }
    }

    #[test]
    fn unavailable_kernels_are_refused_and_the_chosen_one_is_available() {
        let model = Arc::new(random_model(35, &[3, 1]));
        assert!(Int8Kernel::best().is_available());
        assert_ne!(Int8Kernel::best(), Int8Kernel::Scalar);
        for kernel in Int8Kernel::ALL {
            let built = CpuInt8::with_kernel(&model, 4, kernel);
            assert_eq!(built.is_ok(), kernel.is_available(), "{kernel:?}");
        }
        assert!(Int8Kernel::Scalar.is_available() && Int8Kernel::Portable.is_available());
        // A named kernel resolves to itself where the CPU runs it and is
        // refused where it does not; `auto` is `best`.
        assert_eq!(KernelChoice::Auto.resolve().unwrap(), Int8Kernel::best());
        for (choice, kernel) in [
            (KernelChoice::Amx, Int8Kernel::Amx),
            (KernelChoice::Avx512Vnni, Int8Kernel::Avx512Vnni),
            (KernelChoice::Avx2, Int8Kernel::Avx2),
            (KernelChoice::Portable, Int8Kernel::Portable),
        ] {
            match choice.resolve() {
                Ok(k) => assert!(k == kernel && kernel.is_available(), "{choice:?}"),
                Err(KernelUnavailable(k)) => assert!(k == kernel && !kernel.is_available(), "{choice:?}"),
            }
        }
    }

    /// Every f32 bit pattern, split over the available cores, through the
    /// scalar rounding helpers and each vector kernel's rounding; runs only
    /// in release builds (under a minute there on 2 cores).
    #[cfg(not(debug_assertions))]
    #[test]
    fn the_kernels_rounding_equals_the_reference_rounding_for_every_f32() {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
        let chunk = (1u64 << 32).div_ceil(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    let end = ((t + 1) * chunk).min(1 << 32);
                    for bits in (t * chunk)..end {
                        let v = f32::from_bits(bits as u32);
                        let want = v.round_ties_even().clamp(-127.0, 127.0) as i8;
                        assert_eq!(int8_gemm::round_clamp_127(v), want, "{v:e} ({bits:#x})");
                        for lo in [-128i8, 0] {
                            assert_eq!(
                                int8_gemm::round_clamp(v, f32::from(lo)),
                                round_clamp_i8(v, lo),
                                "{v:e} lo {lo}"
                            );
                        }
                    }
                    // The vector roundings of the x86 kernels (portable
                    // uses the scalar one above, AMX the AVX-512 one), a
                    // chunk of consecutive bit patterns at a time.
                    let kernels: Vec<_> = blocked_kernels()
                        .into_iter()
                        .filter(|k| ![Int8Kernel::Portable, Int8Kernel::Amx].contains(k))
                        .collect();
                    let (mut v, mut want, mut got) = (vec![0f32; 4096], vec![0i8; 4096], vec![0i8; 4096]);
                    for start in ((t * chunk)..end).step_by(4096) {
                        let n = (end - start).min(4096) as usize;
                        for (i, x) in v[..n].iter_mut().enumerate() {
                            *x = f32::from_bits((start + i as u64) as u32);
                        }
                        for lo in [-127i8, -128, 0] {
                            for (w, x) in want[..n].iter_mut().zip(&v[..n]) {
                                *w = round_clamp_i8(*x, lo);
                            }
                            for &kernel in &kernels {
                                int8_gemm::round_clamp_slice(kernel, &v[..n], f32::from(lo), &mut got[..n]);
                                if got[..n] != want[..n] {
                                    let i = (0..n).find(|&i| got[i] != want[i]).unwrap_or(0);
                                    panic!("{kernel:?} lo {lo}: {:e} gives {} not {}", v[i], got[i], want[i]);
                                }
                            }
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn zero_rows_quantize_without_dividing_by_zero() {
        let mut q = [1i8; 4];
        assert_eq!(quantize_row(&[0.0; 4], &mut q), 1.0);
        assert_eq!(q, [0; 4]);
    }
}
