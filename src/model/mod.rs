//! Model v1: an MLP stored in a `.qm` file (`schemas/model.fbs`).
//!
//! The file carries f32 weights (the reference every backend is compared
//! against) and INT8 weights quantized when the file is built, with one
//! symmetric scale per output channel. It also declares the input layout:
//! which slice of the input vector comes from the `user` feature group, which
//! from the `item` group and which from the request context. A model imported
//! with a calibration set also carries [`Calibration`]: per-layer activation
//! ranges, which turn on the static INT8 semantics ([`StaticInt8Layer`]), and
//! the calibration set's score histogram and context input moments, the
//! baselines of drift measures (the `drift` module).
//! Loading maps the file read-only and copies everything but the embedding
//! tables of a graph model into owned, validated arrays; the tables, which
//! can be gigabytes, are served from the mapping (`table`), and a file whose
//! tables are too large to be inline stores them after the FlatBuffer
//! (`Node.table_at`). A file that does not describe a consistent network is
//! refused with the reason.

#[cfg(quiver_flatc_generated)]
#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, mismatched_lifetime_syntaxes, deprecated)]
#[rustfmt::skip]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/model_generated.rs"));
}
#[cfg(not(quiver_flatc_generated))]
#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, mismatched_lifetime_syntaxes, deprecated)]
#[rustfmt::skip]
#[path = "model_generated.rs"]
mod generated;
pub mod calibrate;
pub mod embedding;
pub mod gbdt;
pub mod graph;
pub mod layout;
pub mod onnx;
pub mod onnx_graph;
pub mod trees;

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

pub use embedding::{EmbeddingTable, ModelFile, TableError};
use flatbuffers::{FlatBufferBuilder, InvalidFlatbuffer, VerifierOptions, WIPOffset};
pub use generated::quiver::model as fb;
pub use graph::{Act, Graph, Node, Op, OutputKind};
pub use onnx_graph::{OnnxElement, OnnxGraph, OnnxInput};
use trees::{Ensemble, Split, TreeNode};

/// Most bytes of a model file that loading copies into the heap: all of it
/// but the embedding tables, counted as the FlatBuffers verifier counts
/// (every byte each reference reaches). Also the most an importer reads of
/// its input file.
pub const MODEL_HEAP_BYTES_MAX: usize = 1 << 30;
/// Largest model file accepted: room for `graph::EMBEDDING_FLOATS_MAX`
/// floats of embedding tables (16 GiB) beside `MODEL_HEAP_BYTES_MAX` of the
/// rest, with some to spare. The file is mapped, not read, so this bounds
/// address space, and the load time through the one pass over the tables.
pub const MODEL_MAPPED_BYTES_MAX: u64 = 18 << 30;
const _: () = assert!(
    MODEL_MAPPED_BYTES_MAX
        >= (MODEL_HEAP_BYTES_MAX + 4 * graph::EMBEDDING_FLOATS_MAX + graph::NODES_MAX * TABLE_ALIGN_BYTES) as u64
);
/// Embedding tables of more bytes than this, all together, are written
/// after the FlatBuffer rather than in it: FlatBuffers caps a buffer at
/// 2 GiB, and written apart they are streamed to the file from the model's
/// memory, not copied into the builder first. Smaller ones stay inline,
/// where servers from before `table_at` read them too.
pub const EMBEDDING_INLINE_BYTES_MAX: usize = 64 << 20;
/// Files up to this size are read into memory, not mapped: nothing of them
/// stays mapped, so a file rewritten in place (`cp new.qm model.qm`) cannot
/// touch a served model. Bigger ones hold embedding tables written apart,
/// which stay mapped (shared, paged in as used) and must be replaced by
/// renaming a new file over them.
pub const MODEL_READ_BYTES_MAX: u64 = EMBEDDING_INLINE_BYTES_MAX as u64;
/// The last bytes of a model file: this magic, then the CRC-32 (little
/// endian) of every byte before them. Files written before it have none
/// and load with a warning.
const CHECKSUM_MAGIC: [u8; 4] = *b"QVC1";
const CHECKSUM_TRAILER_BYTES: usize = 8;
/// A table written after the FlatBuffer starts at a multiple of this.
const TABLE_ALIGN_BYTES: usize = 64;
/// Widest layer accepted; bounds per-shard scratch buffers.
pub const WIDTH_MAX: usize = 16_384;
/// Deepest network accepted.
pub const LAYERS_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a Quiver model file: {source}")]
    Invalid {
        path: String,
        #[source]
        source: flatbuffers::InvalidFlatbuffer,
    },
    #[error("{path}: model file is {bytes} bytes, the limit is {MODEL_MAPPED_BYTES_MAX} (MODEL_MAPPED_BYTES_MAX)")]
    TooLarge { path: String, bytes: u64 },
    #[error(
        "{path}: the model besides its embedding tables is over {MODEL_HEAP_BYTES_MAX} bytes \
         (MODEL_HEAP_BYTES_MAX), which loading would copy into memory"
    )]
    HeapTooLarge { path: String },
    #[error("{path}: the embedding table of node {node}: {source}")]
    Table {
        path: String,
        node: usize,
        #[source]
        source: TableError,
    },
    #[error("{path}: not a Quiver model file (file identifier is not QVM1)")]
    Identifier { path: String },
    #[error("model '{name}': {what}")]
    Shape { name: String, what: String },
    #[error(
        "{path}: checksum mismatch (stored {stored:08x}, computed {computed:08x}): the file is damaged or was \
         changed while being read"
    )]
    Checksum { path: String, stored: u32, computed: u32 },
}

/// Where an input segment's values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    User,
    Item,
    Context,
    /// The request's categorical ids, as floats (`schemas/model.fbs`).
    ContextIds,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputSegment {
    pub source: Source,
    pub dim: usize,
}

/// One dense layer. Weights are row-major `[out_dim][in_dim]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub in_dim: usize,
    pub out_dim: usize,
    pub relu: bool,
    pub weights_f32: Vec<f32>,
    pub weights_i8: Vec<i8>,
    pub weight_scales: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Layer {
    /// Builds a layer from f32 weights, quantizing them per output channel:
    /// `scale[o] = max|w[o][*]| / 127`, `w_i8 = round_ties_even(w / scale)`.
    pub fn quantize(in_dim: usize, out_dim: usize, relu: bool, weights_f32: Vec<f32>, bias: Vec<f32>) -> Layer {
        assert_eq!(weights_f32.len(), in_dim * out_dim);
        assert_eq!(bias.len(), out_dim);
        let mut weights_i8 = Vec::with_capacity(weights_f32.len());
        let mut weight_scales = Vec::with_capacity(out_dim);
        for row in weights_f32.chunks_exact(in_dim) {
            let max_abs = row.iter().fold(0.0f32, |m, w| m.max(w.abs()));
            let scale = if max_abs > 0.0 { max_abs / 127.0 } else { 1.0 };
            weight_scales.push(scale);
            weights_i8.extend(row.iter().map(|w| (w / scale).round_ties_even().clamp(-127.0, 127.0) as i8));
        }
        Layer { in_dim, out_dim, relu, weights_f32, weights_i8, weight_scales, bias }
    }
}

/// Probabilities of the calibration set, binned; the baseline a drift
/// measure (PSI) compares live scores with.
#[derive(Clone, Debug, PartialEq)]
pub struct ScoreHistogram {
    /// Ascending, `counts.len() + 1` of them, the first 0 and the last 1.
    pub edges: Vec<f32>,
    /// Rows with `edges[i] <= score < edges[i + 1]`; the last bin includes 1.
    pub counts: Vec<u64>,
}

/// Which INT8 activation semantics a calibrated model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationScales {
    /// One calibrated scale per layer (`Calibration::input_ranges`).
    #[default]
    Static,
    /// Per-row scales, as for an uncalibrated model: chosen when the
    /// calibration set measured them as more accurate, and always for a
    /// graph model.
    Dynamic,
}

/// Max and mean |score − f32 score| over a calibration set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredError {
    pub max: f32,
    pub mean: f32,
}

/// What `quiver import --calibration` measured (`model::calibrate`).
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// How the ranges were chosen, e.g. `max-abs` or `percentile:99.99`.
    pub method: String,
    pub rows: u64,
    /// Per layer, the clipping range of its input activations; the INT8
    /// activation scale is `range / 127`.
    pub input_ranges: Vec<f32>,
    pub scores: ScoreHistogram,
    /// The mean and population variance of each context input over the
    /// calibration set, the baseline of input drift; both empty in files
    /// written before they were stored (no input drift for those).
    pub input_means: Vec<f32>,
    pub input_variances: Vec<f32>,
    /// The INT8 semantics chosen; `Static` in files written before the
    /// choice existed.
    pub activations: ActivationScales,
    /// What each semantics measured on the calibration set, when measured.
    pub static_error: Option<MeasuredError>,
    pub dynamic_error: Option<MeasuredError>,
}

/// A loaded, validated model.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub name: String,
    pub version: u32,
    pub inputs: Vec<InputSegment>,
    pub layers: Vec<Layer>,
    /// `None` for a model imported without a calibration set: the INT8
    /// backend then falls back to dynamic per-row activation scales.
    pub calibration: Option<Calibration>,
    /// A graph model (file v2): `layers` is then empty and the graph is the
    /// network. `None` for the v1 MLP of `layers`.
    pub graph: Option<Graph>,
    /// The ONNX graph kept for the onnxruntime backend: beside the native
    /// network (`--keep-onnx`), or instead of it (`--onnxruntime`, where
    /// `layers` is empty and `graph` is `None`).
    pub onnx: Option<OnnxGraph>,
}

/// Largest |bias| in accumulator units. With |acc| ≤ 128 · 127 · `WIDTH_MAX`
/// < 2²⁸, `acc + bias_q` can never overflow i32.
pub const BIAS_Q_MAX: i32 = 1 << 30;

/// One layer's constants for the static INT8 semantics, derived on the host
/// from the model and its calibration (the CPU kernels and any GPU port use
/// this one function, so they cannot disagree on them).
///
/// With `s_in` this layer's activation scale (`input_ranges[i] / 127`),
/// `s_out` the next layer's, and `s_w[o]` the weight scale of channel `o`:
/// - `bias_q[o] = clamp(round_ties_even(bias[o] / (s_w[o] · s_in)), ±2³⁰)`,
///   the bias in accumulator units (computed in f64);
/// - hidden layer: `scale[o] = f32(s_w[o] · s_in / s_out)` (f64, rounded
///   once) and the output is the int8
///   `clamp(round_ties_even(f32(acc + bias_q[o]) · scale[o]), lo, 127)` with
///   `lo = 0` after a ReLU, -128 without;
/// - output layer: `scale[o] = f32(s_w[o] · s_in)` and the logit is
///   `f32(acc + bias_q[o]) · scale[o]`, in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct StaticInt8Layer {
    /// The activation scale of this layer's input.
    pub in_scale: f32,
    pub bias_q: Vec<i32>,
    pub scale: Vec<f32>,
    /// Whether the output is requantized to int8 (every layer but the last).
    pub requantize: bool,
    /// The requantized output's lower bound: 0 with a fused ReLU, else -128.
    pub lo: i8,
}

/// `clamp(round_ties_even(v), lo, 127)` as the static INT8 semantics define
/// it; NaN gives 0. The kernels compute it without the rounding call.
#[inline]
pub fn round_clamp_i8(v: f32, lo: i8) -> i8 {
    v.round_ties_even().clamp(f32::from(lo), 127.0) as i8
}

impl Model {
    /// Checks that the layers chain, the arrays have the declared sizes, the
    /// output is one logit and every number is finite.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: String| ModelError::Shape { name: self.name.clone(), what };
        if self.inputs.is_empty() {
            return Err(bad("declares no inputs".into()));
        }
        for s in [Source::User, Source::Item, Source::Context, Source::ContextIds] {
            if self.inputs.iter().filter(|i| i.source == s).count() > 1 {
                return Err(bad(format!("declares the {s:?} input more than once")));
            }
        }
        if self.inputs.iter().any(|i| i.dim == 0) {
            return Err(bad("an input segment has dimension 0".into()));
        }
        if let Some(o) = &self.onnx {
            o.validate(self.input_dim()).map_err(bad)?;
        }
        if !self.is_native() && self.onnx.is_some() {
            if let Some(c) = &self.calibration {
                if c.activations != ActivationScales::Dynamic || !c.input_ranges.is_empty() {
                    return Err(bad("is served through onnxruntime and holds static INT8 ranges".into()));
                }
                return validate_calibration_tables(self, c).map_err(bad);
            }
            return Ok(());
        }
        if let Some(g) = &self.graph {
            if !self.layers.is_empty() {
                return Err(bad("has both layers and a graph".into()));
            }
            g.validate(self.input_dim()).map_err(bad)?;
            if let Some(c) = &self.calibration {
                if c.activations != ActivationScales::Dynamic || !c.input_ranges.is_empty() {
                    return Err(bad("is a graph model with static INT8 ranges; graph models run dynamic INT8".into()));
                }
                return validate_calibration_tables(self, c).map_err(bad);
            }
            return Ok(());
        }
        if self.layers.is_empty() || self.layers.len() > LAYERS_MAX {
            return Err(bad(format!("has {} layers; 1 to {LAYERS_MAX} allowed", self.layers.len())));
        }
        let mut width = self.input_dim();
        for (i, l) in self.layers.iter().enumerate() {
            if l.in_dim != width {
                return Err(bad(format!("layer {i} takes {} inputs but receives {width}", l.in_dim)));
            }
            if l.out_dim == 0 || l.out_dim > WIDTH_MAX || l.in_dim > WIDTH_MAX {
                return Err(bad(format!("layer {i} has a width outside 1..={WIDTH_MAX}")));
            }
            let n = l.in_dim * l.out_dim;
            if l.weights_f32.len() != n || l.weights_i8.len() != n {
                return Err(bad(format!("layer {i} weights are not {} x {}", l.out_dim, l.in_dim)));
            }
            if l.weight_scales.len() != l.out_dim || l.bias.len() != l.out_dim {
                return Err(bad(format!("layer {i} scales or bias are not of length {}", l.out_dim)));
            }
            let finite = l.weights_f32.iter().chain(&l.bias).all(|x| x.is_finite());
            let scales_ok = l.weight_scales.iter().all(|s| s.is_finite() && *s > 0.0);
            if !finite || !scales_ok {
                return Err(bad(format!("layer {i} holds a non-finite weight or a non-positive scale")));
            }
            width = l.out_dim;
        }
        if width != 1 {
            return Err(bad(format!("the last layer has {width} outputs; one logit expected")));
        }
        if self.layers.last().is_some_and(|l| l.relu) {
            return Err(bad("the output layer must not have an activation".into()));
        }
        if let Some(c) = &self.calibration {
            if c.input_ranges.len() != self.layers.len() {
                return Err(bad(format!(
                    "calibration has {} activation ranges for {} layers",
                    c.input_ranges.len(),
                    self.layers.len()
                )));
            }
            if !c.input_ranges.iter().all(|r| r.is_finite() && *r > 0.0 && (*r / 127.0) > 0.0) {
                return Err(bad("calibration holds a non-finite or non-positive activation range".into()));
            }
            validate_calibration_tables(self, c).map_err(bad)?;
        }
        Ok(())
    }

    /// The static INT8 constants per layer, or `None` when the model has no
    /// calibration (the INT8 backend then quantizes activations per row).
    pub fn static_int8(&self) -> Option<Vec<StaticInt8Layer>> {
        let c = self.calibration.as_ref().filter(|c| c.activations == ActivationScales::Static)?;
        let s_act: Vec<f32> = c.input_ranges.iter().map(|r| r / 127.0).collect();
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let s_in = s_act[i];
                let requantize = i + 1 < self.layers.len();
                let bias_q = l
                    .bias
                    .iter()
                    .zip(&l.weight_scales)
                    .map(|(&b, &s_w)| {
                        let q = (f64::from(b) / (f64::from(s_w) * f64::from(s_in))).round_ties_even();
                        q.clamp(-f64::from(BIAS_Q_MAX), f64::from(BIAS_Q_MAX)) as i32
                    })
                    .collect();
                let s_out = if requantize { f64::from(s_act[i + 1]) } else { 1.0 };
                let scale =
                    l.weight_scales.iter().map(|&s_w| (f64::from(s_w) * f64::from(s_in) / s_out) as f32).collect();
                StaticInt8Layer { in_scale: s_in, bias_q, scale, requantize, lo: if l.relu { 0 } else { -128 } }
            })
            .collect();
        Some(layers)
    }

    /// Length of the concatenated input vector.
    pub fn input_dim(&self) -> usize {
        self.inputs.iter().map(|s| s.dim).sum()
    }

    /// Widest activation vector, for sizing scratch buffers.
    pub fn width_max(&self) -> usize {
        let graph = self.graph.as_ref().map_or(0, Graph::width_max);
        self.layers.iter().map(|l| l.out_dim).chain([self.input_dim(), graph]).max().unwrap_or(0)
    }

    /// The network as a graph: the graph of a v2 model, or a v1 MLP's layers
    /// as an input node followed by a chain of dense nodes.
    pub fn to_graph(&self) -> Graph {
        if let Some(g) = &self.graph {
            return g.clone();
        }
        let mut nodes = vec![Node { op: Op::Input { offset: 0 }, inputs: vec![], width: self.input_dim() }];
        for (i, l) in self.layers.iter().enumerate() {
            let act = if l.relu { Act::Relu } else { Act::None };
            let layer = Layer { relu: false, ..l.clone() };
            nodes.push(Node { op: Op::Dense { layer, act }, inputs: vec![i], width: l.out_dim });
        }
        Graph { nodes, output: OutputKind::Logit }
    }

    /// For each column of the input vector, whether it holds a per-request
    /// value (user, context, context ids: the same for every candidate).
    pub fn request_columns(&self) -> Vec<bool> {
        self.inputs.iter().flat_map(|s| std::iter::repeat_n(s.source != Source::Item, s.dim)).collect()
    }

    /// For each column of the `ContextIds` segment, the rows of the
    /// embedding table that reads it (an id at or beyond it takes the
    /// default row); `u64::MAX` for a column no embedding reads directly.
    pub fn context_id_rows(&self) -> Vec<u64> {
        let mut at = 0;
        let Some(dim) = self.inputs.iter().find_map(|s| {
            let found = (s.source == Source::ContextIds).then_some(s.dim);
            if found.is_none() {
                at += s.dim;
            }
            found
        }) else {
            return Vec::new();
        };
        let mut rows = vec![u64::MAX; dim];
        if let Some(g) = &self.graph {
            for n in &g.nodes {
                let Op::Embedding { rows: table_rows, .. } = &n.op else { continue };
                let src = &g.nodes[n.inputs[0]];
                let Op::Input { offset } = src.op else { continue };
                for (c, r) in rows.iter_mut().enumerate() {
                    if (offset..offset + src.width).contains(&(at + c)) {
                        *r = (*r).min(*table_rows as u64);
                    }
                }
            }
        }
        rows
    }

    /// The input columns outside the `ContextIds` segment that an
    /// embedding reads directly as row indices (a categorical id sent as a
    /// context float, or stored in a feature group), with the rows of the
    /// smallest table reading each, in column order. A value there that is
    /// not an integer index of the table takes the default row, and the
    /// request path counts it as a missing feature.
    pub fn float_index_columns(&self) -> Vec<(usize, usize)> {
        let mut ids = vec![false; self.input_dim()];
        let mut at = 0;
        for s in &self.inputs {
            if s.source == Source::ContextIds {
                ids[at..at + s.dim].fill(true);
            }
            at += s.dim;
        }
        let mut cols: Vec<(usize, usize)> = Vec::new();
        if let Some(g) = &self.graph {
            for n in &g.nodes {
                let Op::Embedding { rows, .. } = &n.op else { continue };
                let src = &g.nodes[n.inputs[0]];
                let Op::Input { offset } = src.op else { continue };
                for c in (offset..offset + src.width).filter(|c| !ids[*c]) {
                    match cols.iter_mut().find(|(col, _)| *col == c) {
                        Some((_, r)) => *r = (*r).min(*rows),
                        None => cols.push((c, *rows)),
                    }
                }
            }
        }
        cols.sort_unstable();
        cols
    }

    /// `to_graph` with a v1 MLP's first layer split by input kind, for one
    /// request's candidates to compute its per-request columns (user,
    /// context) once: `relu(W_c x_c + (W_r x_r + b))`, where `x_r` are the
    /// per-request columns and `x_c` the candidate's. Exact in real
    /// arithmetic; in f32 the first layer's sums are grouped differently.
    pub fn to_graph_split(&self) -> Graph {
        let request = self.request_columns();
        let first = match self.layers.first() {
            Some(l) if self.graph.is_none() && request.contains(&true) && request.contains(&false) => l,
            _ => return self.to_graph(),
        };
        let mut nodes = Vec::new();
        let (mut shared, mut per_candidate) = (Vec::new(), Vec::new());
        let mut offset = 0;
        for s in &self.inputs {
            let i = nodes.len();
            nodes.push(Node { op: Op::Input { offset }, inputs: vec![], width: s.dim });
            if s.source == Source::Item {
                per_candidate.push((i, offset, s.dim));
            } else {
                shared.push((i, offset, s.dim));
            }
            offset += s.dim;
        }
        let k = first.in_dim;
        let part = |nodes: &mut Vec<Node>, segs: &[(usize, usize, usize)], bias: bool| {
            let input = if segs.len() == 1 {
                segs[0].0
            } else {
                let width = segs.iter().map(|s| s.2).sum();
                nodes.push(Node { op: Op::Concat, inputs: segs.iter().map(|s| s.0).collect(), width });
                nodes.len() - 1
            };
            let cols: Vec<usize> = segs.iter().flat_map(|&(_, at, dim)| at..at + dim).collect();
            let mut w = Vec::with_capacity(cols.len() * first.out_dim);
            for o in 0..first.out_dim {
                w.extend(cols.iter().map(|&c| first.weights_f32[o * k + c]));
            }
            let b = if bias { first.bias.clone() } else { vec![0.0; first.out_dim] };
            let layer = Layer::quantize(cols.len(), first.out_dim, false, w, b);
            nodes.push(Node { op: Op::Dense { layer, act: Act::None }, inputs: vec![input], width: first.out_dim });
            nodes.len() - 1
        };
        let s = part(&mut nodes, &shared, true);
        let c = part(&mut nodes, &per_candidate, false);
        nodes.push(Node { op: Op::Add, inputs: vec![c, s], width: first.out_dim });
        if first.relu {
            let i = nodes.len() - 1;
            nodes.push(Node { op: Op::Act(Act::Relu), inputs: vec![i], width: first.out_dim });
        }
        for l in &self.layers[1..] {
            let i = nodes.len() - 1;
            let act = if l.relu { Act::Relu } else { Act::None };
            nodes.push(Node {
                op: Op::Dense { layer: Layer { relu: false, ..l.clone() }, act },
                inputs: vec![i],
                width: l.out_dim,
            });
        }
        Graph { nodes, output: OutputKind::Logit }
    }

    /// Whether a native backend can run it: a v1 MLP or a graph model. A
    /// model that is only an ONNX graph runs on onnxruntime alone.
    pub fn is_native(&self) -> bool {
        !self.layers.is_empty() || self.graph.is_some()
    }

    /// What the network's output is: a logit for every v1 model.
    pub fn output_kind(&self) -> OutputKind {
        match (&self.graph, &self.onnx) {
            (Some(g), _) => g.output,
            (None, Some(o)) if self.layers.is_empty() => o.output_kind,
            _ => OutputKind::Logit,
        }
    }

    /// The score returned for an output value: its sigmoid for a logit,
    /// the value itself for a raw (regression) output.
    #[inline]
    pub fn score(&self, output: f32) -> f32 {
        match self.output_kind() {
            OutputKind::Logit => sigmoid(output),
            OutputKind::Raw => output,
        }
    }

    /// Multiply-accumulates per scored row.
    pub fn macs_per_row(&self) -> usize {
        let layers: usize = self.layers.iter().map(|l| l.in_dim * l.out_dim).sum();
        layers + self.graph.as_ref().map_or(0, Graph::macs_per_row)
    }

    /// Dimension declared for `source`, if the model reads it.
    pub fn input_dim_of(&self, source: Source) -> Option<usize> {
        self.inputs.iter().find(|s| s.source == source).map(|s| s.dim)
    }

    /// The f32 reference forward pass: `x` holds `rows` input vectors, the
    /// logits go to `out`. Slow and allocating on purpose: it is the
    /// specification, not the serving path.
    pub fn forward_f32_reference(&self, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(self.is_native(), "an onnxruntime-only model has no native specification");
        assert_eq!(x.len(), rows * self.input_dim());
        assert_eq!(out.len(), rows);
        if let Some(g) = &self.graph {
            for (r, y) in out.iter_mut().enumerate() {
                *y = g.forward_row(&x[r * self.input_dim()..(r + 1) * self.input_dim()]);
            }
            return;
        }
        for r in 0..rows {
            let mut act: Vec<f32> = x[r * self.input_dim()..(r + 1) * self.input_dim()].to_vec();
            for l in &self.layers {
                act = (0..l.out_dim)
                    .map(|o| {
                        let w = &l.weights_f32[o * l.in_dim..(o + 1) * l.in_dim];
                        let y = w.iter().zip(&act).map(|(a, b)| a * b).sum::<f32>() + l.bias[o];
                        if l.relu {
                            y.max(0.0)
                        } else {
                            y
                        }
                    })
                    .collect();
            }
            out[r] = act[0];
        }
    }

    /// Maps and validates a model file.
    ///
    /// What this reads: the FlatBuffer's structure (verified without
    /// walking scalar vectors), every byte outside the embedding tables
    /// (copied into owned arrays, at most `MODEL_HEAP_BYTES_MAX`), and every
    /// float of every embedding table once, for the finiteness check, which
    /// brings the tables into the page cache: its time grows with their
    /// size (90 ms for 1.28 GB already cached, 0.6-0.8 s from the disk, on
    /// a 2-core VM). The tables themselves are not copied: the model serves
    /// them from the mapping.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        Model::load_reading_at_most(path, MODEL_READ_BYTES_MAX)
    }

    /// `load`, reading files of at most `read_bytes_max` bytes and mapping
    /// bigger ones.
    fn load_reading_at_most(path: &Path, read_bytes_max: u64) -> Result<Model, ModelError> {
        let p = path.display().to_string();
        let io = |source| ModelError::Io { path: p.clone(), source };
        let file = File::open(path).map_err(io)?;
        // The open file's length, not the path's: a rename between a stat
        // and the open would pair one file's length with another's bytes.
        let bytes_len = file.metadata().map_err(io)?.len();
        if bytes_len > MODEL_MAPPED_BYTES_MAX {
            return Err(ModelError::TooLarge { path: p, bytes: bytes_len });
        }
        if bytes_len < 8 {
            return Err(ModelError::Identifier { path: p });
        }
        if bytes_len <= read_bytes_max {
            let mut bytes = Vec::with_capacity(bytes_len as usize);
            std::io::Read::read_to_end(&mut std::io::Read::take(&file, bytes_len), &mut bytes).map_err(io)?;
            let body = verify_checksum(&bytes, &p)?;
            return Model::parse(body, None, &p);
        }
        // SAFETY: model files are replaced only by renaming a new file over
        // the old one, never truncated or rewritten in place: this crate
        // writes them only through `write_atomically` (temporary file, then
        // rename), and README tells operators to do the same (`mv`, not
        // `cp` over a served file); smaller files, which hold no tables
        // written apart, are read above and never mapped. A rename leaves
        // the inode mapped here untouched, so the mapping stays valid while
        // the old model serves.
        let file = Arc::new(unsafe { ModelFile::map(&file) }.map_err(io)?);
        let body = verify_checksum(file.bytes(), &p)?;
        Model::parse(body, Some(&file), &p)
    }

    /// Validates a model file held in memory; its embedding tables are
    /// copied out (owned), unlike `load`'s.
    pub fn from_bytes(bytes: &[u8], path_for_errors: &str) -> Result<Model, ModelError> {
        Model::parse(verify_checksum(bytes, path_for_errors)?, None, path_for_errors)
    }

    /// `bytes` are all of `file`'s when it is given, and the embedding
    /// tables are then views of it.
    fn parse(bytes: &[u8], file: Option<&Arc<ModelFile>>, path_for_errors: &str) -> Result<Model, ModelError> {
        let p = path_for_errors.to_string();
        // The generated check asserts the buffer holds a root offset and an
        // identifier (8 bytes); a shorter file is simply not a model file.
        if bytes.len() < 8 || !fb::model_buffer_has_identifier(bytes) {
            return Err(ModelError::Identifier { path: p });
        }
        let opts = |max_apparent_size| VerifierOptions {
            max_depth: 8,
            max_tables: 2 + LAYERS_MAX + 16 + 2 * graph::NODES_MAX + 1 + onnx_graph::ONNX_INPUTS_MAX,
            max_apparent_size,
            ignore_missing_null_terminator: false,
        };
        // The verifier counts every byte each reference reaches (a table
        // read twice counts twice) against `max_apparent_size`, in one
        // check per vector: it never walks a scalar vector's elements, so
        // verifying a big table costs nothing. The first pass only makes
        // the buffer safe to read, with a bound no valid file reaches; the
        // second holds the heap parts to MODEL_HEAP_BYTES_MAX, now that the
        // inline tables it may exceed that by are known.
        let invalid = |source| ModelError::Invalid { path: p.clone(), source };
        let loose = usize::try_from(MODEL_MAPPED_BYTES_MAX).unwrap_or(usize::MAX);
        let m = flatbuffers::root_with_opts::<fb::Model>(&opts(loose), bytes).map_err(invalid)?;
        let heap_bound = MODEL_HEAP_BYTES_MAX.saturating_add(inline_table_bytes(&m));
        flatbuffers::root_with_opts::<fb::Model>(&opts(heap_bound), bytes).map_err(|source| match source {
            InvalidFlatbuffer::ApparentSizeTooLarge => ModelError::HeapTooLarge { path: p.clone() },
            source => invalid(source),
        })?;
        let name = m.name().unwrap_or("").to_string();
        let bad = |what: &str| ModelError::Shape { name: name.clone(), what: what.into() };
        let mut inputs = Vec::new();
        for s in m.inputs().unwrap_or_default() {
            let source = match s.source() {
                fb::Source::User => Source::User,
                fb::Source::Item => Source::Item,
                fb::Source::Context => Source::Context,
                fb::Source::ContextIds => Source::ContextIds,
                _ => return Err(bad("an input segment has an unknown source")),
            };
            inputs.push(InputSegment { source, dim: s.dim() as usize });
        }
        let mut layers = Vec::new();
        for l in m.layers().unwrap_or_default() {
            layers.push(layer_from_fb(&l).ok_or_else(|| bad("a layer has an unknown activation"))?);
        }
        let calibration = m.calibration().map(|c| Calibration {
            method: c.method().unwrap_or("").to_string(),
            rows: c.rows(),
            input_ranges: c.input_ranges().map(|v| v.iter().collect()).unwrap_or_default(),
            scores: ScoreHistogram {
                edges: c.scores().and_then(|h| h.edges()).map(|v| v.iter().collect()).unwrap_or_default(),
                counts: c.scores().and_then(|h| h.counts()).map(|v| v.iter().collect()).unwrap_or_default(),
            },
            input_means: c.input_means().map(|v| v.iter().collect()).unwrap_or_default(),
            input_variances: c.input_variances().map(|v| v.iter().collect()).unwrap_or_default(),
            activations: if c.activations() == fb::ActivationScales::Dynamic {
                ActivationScales::Dynamic
            } else {
                ActivationScales::Static
            },
            static_error: measured(c.static_error_max(), c.static_error_mean()),
            dynamic_error: measured(c.dynamic_error_max(), c.dynamic_error_mean()),
        });
        let graph = match m.graph() {
            Some(g) => Some(graph_from_fb(&g, bytes, file).map_err(|e| match e {
                FromFb::Shape(what) => bad(&what),
                FromFb::Table { node, source } => ModelError::Table { path: p.clone(), node, source },
            })?),
            None => None,
        };
        let onnx = match m.onnx() {
            Some(o) => Some(OnnxGraph::from_fb(&o).map_err(|what| bad(&what))?),
            None => None,
        };
        let model = Model { name: name.clone(), version: m.version(), inputs, layers, calibration, graph, onnx };
        model.validate()?;
        Ok(model)
    }

    /// The model file's bytes, as `save` writes them.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_file(&mut out, EMBEDDING_INLINE_BYTES_MAX).expect("writing into a Vec cannot fail");
        out
    }

    /// Writes the model file atomically: a new file renamed over `path`.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        write_atomically(path, |w| self.write_file(w, EMBEDDING_INLINE_BYTES_MAX))
    }

    /// Writes the file: the FlatBuffer, then, when the embedding tables
    /// together are over `inline_bytes_max`, each table at its `table_at`
    /// (zeros between), streamed from the model's memory.
    fn write_file(&self, w: &mut impl Write, inline_bytes_max: usize) -> std::io::Result<()> {
        let mut w = Summing { inner: w, crc: crc32fast::Hasher::new() };
        self.write_body(&mut w, inline_bytes_max)?;
        let crc = w.crc.finalize();
        w.inner.write_all(&CHECKSUM_MAGIC)?;
        w.inner.write_all(&crc.to_le_bytes())
    }

    /// The file before its checksum trailer.
    fn write_body(&self, w: &mut impl Write, inline_bytes_max: usize) -> std::io::Result<()> {
        let (b, tables) = self.encode(inline_bytes_max);
        let head = b.finished_data();
        w.write_all(head)?;
        let mut written = head.len() as u64;
        let mut le = Vec::with_capacity(1 << 16);
        for (at, t) in tables {
            w.write_all(&[0; TABLE_ALIGN_BYTES][..(at - written) as usize])?;
            for chunk in t.chunks(1 << 14) {
                le.clear();
                le.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                w.write_all(&le)?;
            }
            written = at + 4 * t.len() as u64;
        }
        Ok(())
    }

    /// The FlatBuffer and the tables to write after it, by file offset.
    fn encode(&self, inline_bytes_max: usize) -> (FlatBufferBuilder<'static>, Vec<(u64, &[f32])>) {
        let tables: Vec<(usize, &[f32])> = self.graph.as_ref().map_or_else(Vec::new, |g| {
            g.nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| match &n.op {
                    Op::Embedding { table, .. } => Some((i, &**table)),
                    _ => None,
                })
                .collect()
        });
        let bytes: usize = tables.iter().map(|(_, t)| 4 * t.len()).sum();
        if bytes <= inline_bytes_max {
            return (self.build(&[]), Vec::new());
        }
        // Where the tables go depends on the FlatBuffer's length, which does
        // not depend on the offsets' values (a scalar field not at its
        // default takes the same bytes whatever it holds): a first build
        // with placeholders measures it.
        let placeholders: Vec<(usize, u64)> = tables.iter().map(|&(i, _)| (i, u64::MAX)).collect();
        let head_bytes = self.build(&placeholders).finished_data().len();
        let mut at = head_bytes;
        let mut table_at = Vec::with_capacity(tables.len());
        let mut placed = Vec::with_capacity(tables.len());
        for (i, t) in tables {
            at = at.next_multiple_of(TABLE_ALIGN_BYTES);
            table_at.push((i, at as u64));
            placed.push((at as u64, t));
            at += 4 * t.len();
        }
        let b = self.build(&table_at);
        assert_eq!(b.finished_data().len(), head_bytes, "the offsets' values changed the FlatBuffer's length");
        (b, placed)
    }

    /// The FlatBuffer, with the embedding table of each node named in
    /// `table_at` stored at that file offset instead of inline.
    fn build(&self, table_at: &[(usize, u64)]) -> FlatBufferBuilder<'static> {
        let mut b = FlatBufferBuilder::new();
        let inputs: Vec<_> = self
            .inputs
            .iter()
            .map(|s| {
                let source = match s.source {
                    Source::User => fb::Source::User,
                    Source::Item => fb::Source::Item,
                    Source::Context => fb::Source::Context,
                    Source::ContextIds => fb::Source::ContextIds,
                };
                fb::InputSegment::create(&mut b, &fb::InputSegmentArgs { source, dim: s.dim as u32 })
            })
            .collect();
        let layers: Vec<_> = self.layers.iter().map(|l| layer_to_fb(&mut b, l)).collect();
        let graph = self.graph.as_ref().map(|g| graph_to_fb(&mut b, g, table_at));
        let onnx = self.onnx.as_ref().map(|o| o.to_fb(&mut b));
        let calibration = self.calibration.as_ref().map(|c| {
            let edges = Some(b.create_vector(&c.scores.edges));
            let counts = Some(b.create_vector(&c.scores.counts));
            let scores = Some(fb::ScoreHistogram::create(&mut b, &fb::ScoreHistogramArgs { edges, counts }));
            let method = Some(b.create_string(&c.method));
            let input_ranges = Some(b.create_vector(&c.input_ranges));
            // Absent rather than empty, as older writers left them.
            let input_means = (!c.input_means.is_empty()).then(|| b.create_vector(&c.input_means));
            let input_variances = (!c.input_variances.is_empty()).then(|| b.create_vector(&c.input_variances));
            let (static_error_max, static_error_mean) =
                c.static_error.map_or((f32::NAN, f32::NAN), |e| (e.max, e.mean));
            let (dynamic_error_max, dynamic_error_mean) =
                c.dynamic_error.map_or((f32::NAN, f32::NAN), |e| (e.max, e.mean));
            let activations = match c.activations {
                ActivationScales::Static => fb::ActivationScales::Static,
                ActivationScales::Dynamic => fb::ActivationScales::Dynamic,
            };
            fb::Calibration::create(
                &mut b,
                &fb::CalibrationArgs {
                    method,
                    rows: c.rows,
                    input_ranges,
                    scores,
                    input_means,
                    input_variances,
                    activations,
                    static_error_max,
                    static_error_mean,
                    dynamic_error_max,
                    dynamic_error_mean,
                },
            )
        });
        let name = Some(b.create_string(&self.name));
        let inputs = Some(b.create_vector(&inputs));
        let layers = Some(b.create_vector(&layers));
        let root = fb::Model::create(
            &mut b,
            &fb::ModelArgs { name, version: self.version, inputs, layers, calibration, graph, onnx },
        );
        fb::finish_model_buffer(&mut b, root);
        b
    }
}

/// A writer that sums what passes through it.
struct Summing<'w, W: Write> {
    inner: &'w mut W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for Summing<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The file's bytes before its checksum trailer, once the checksum matches;
/// all of them, with a warning, for a file written before checksums (no
/// trailer). Reads every byte, so a mapped file's tables are paged in once.
fn verify_checksum<'b>(bytes: &'b [u8], path: &str) -> Result<&'b [u8], ModelError> {
    let Some(at) = bytes.len().checked_sub(CHECKSUM_TRAILER_BYTES) else {
        return Ok(bytes);
    };
    let (body, trailer) = bytes.split_at(at);
    if trailer[..4] != CHECKSUM_MAGIC {
        tracing::warn!(path, "model file has no checksum (written before Quiver stored one); save it again to add one");
        return Ok(bytes);
    }
    let stored = u32::from_le_bytes(trailer[4..].try_into().expect("four bytes"));
    let computed = crc32fast::hash(body);
    if stored != computed {
        return Err(ModelError::Checksum { path: path.into(), stored, computed });
    }
    Ok(body)
}

/// Writes a model file as a new file renamed over `path`, never in place: a
/// server may have the file at `path` mapped (`Model::load`), and a rename
/// leaves that inode, and its mapping, as they were, where truncating it
/// would make the server's next read of a lost page a SIGBUS. (Streams the
/// file, unlike `replica::write_atomically`, so that gigabytes of tables
/// need no second copy in memory.)
fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), ModelError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".write.tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        write(&mut w)?;
        w.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_all()?;
        std::fs::rename(&tmp, path)?;
        match path.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(|source| ModelError::Io { path: path.display().to_string(), source })
}

/// The bytes of the embedding tables stored inline, as the verifier counts
/// them (once per node that reads them).
fn inline_table_bytes(m: &fb::Model<'_>) -> usize {
    let nodes = m.graph().and_then(|g| g.nodes()).unwrap_or_default();
    nodes
        .iter()
        .filter(|n| n.op() == fb::NodeOp::Embedding)
        .map(|n| n.table().map_or(0, |t| 4 * t.len()))
        .fold(0, usize::saturating_add)
}

/// The checks of a calibration's score histogram and context moments that
/// hold for every model kind.
fn validate_calibration_tables(m: &Model, c: &Calibration) -> Result<(), String> {
    let h = &c.scores;
    let edges_ok = h.edges.len() == h.counts.len() + 1
        && h.edges.first() == Some(&0.0)
        && h.edges.last() == Some(&1.0)
        && h.edges.windows(2).all(|w| w[0] < w[1]);
    if !edges_ok {
        return Err("calibration score histogram edges are not ascending from 0 to 1".into());
    }
    let context_dim = m.input_dim_of(Source::Context).unwrap_or(0);
    let moments = c.input_means.len();
    if moments != c.input_variances.len() || (moments != 0 && moments != context_dim) {
        return Err(format!(
            "calibration has {moments} context means and {} variances for {context_dim} context inputs",
            c.input_variances.len()
        ));
    }
    let moments_ok =
        c.input_means.iter().all(|m| m.is_finite()) && c.input_variances.iter().all(|v| v.is_finite() && *v >= 0.0);
    if !moments_ok {
        return Err("calibration holds a non-finite context mean or a bad variance".into());
    }
    let errors_ok = [c.static_error, c.dynamic_error]
        .iter()
        .flatten()
        .all(|e| e.max.is_finite() && e.mean.is_finite() && e.max >= 0.0 && e.mean >= 0.0);
    if !errors_ok {
        return Err("calibration holds a negative or non-finite measured error".into());
    }
    Ok(())
}

fn layer_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, l: &Layer) -> WIPOffset<fb::Layer<'b>> {
    let weights_f32 = Some(b.create_vector(&l.weights_f32));
    let weights_i8 = Some(b.create_vector(&l.weights_i8));
    let weight_scales = Some(b.create_vector(&l.weight_scales));
    let bias = Some(b.create_vector(&l.bias));
    fb::Layer::create(
        b,
        &fb::LayerArgs {
            in_dim: l.in_dim as u32,
            out_dim: l.out_dim as u32,
            activation: if l.relu { fb::Activation::Relu } else { fb::Activation::None },
            weights_f32,
            weights_i8,
            weight_scales,
            bias,
        },
    )
}

/// A v1 layer; `None` for an activation other than None or ReLU.
fn layer_from_fb(l: &fb::Layer<'_>) -> Option<Layer> {
    let relu = match l.activation() {
        fb::Activation::None => false,
        fb::Activation::Relu => true,
        _ => return None,
    };
    Some(Layer {
        in_dim: l.in_dim() as usize,
        out_dim: l.out_dim() as usize,
        relu,
        weights_f32: l.weights_f32().map(|v| v.iter().collect()).unwrap_or_default(),
        weights_i8: l.weights_i8().map(|v| v.iter().collect()).unwrap_or_default(),
        weight_scales: l.weight_scales().map(|v| v.iter().collect()).unwrap_or_default(),
        bias: l.bias().map(|v| v.iter().collect()).unwrap_or_default(),
    })
}

/// A measured error read back; NaN (the schema default) is "not measured".
fn measured(max: f32, mean: f32) -> Option<MeasuredError> {
    (!max.is_nan() && !mean.is_nan()).then_some(MeasuredError { max, mean })
}

fn act_to_fb(a: Act) -> (fb::Activation, f32) {
    match a {
        Act::None => (fb::Activation::None, 0.0),
        Act::Relu => (fb::Activation::Relu, 0.0),
        Act::LeakyRelu(alpha) => (fb::Activation::LeakyRelu, alpha),
        Act::Tanh => (fb::Activation::Tanh, 0.0),
        Act::Sigmoid => (fb::Activation::Sigmoid, 0.0),
        Act::GeluErf => (fb::Activation::GeluErf, 0.0),
        Act::GeluTanh => (fb::Activation::GeluTanh, 0.0),
        Act::Silu => (fb::Activation::Silu, 0.0),
        Act::Erf => (fb::Activation::Erf, 0.0),
        Act::Sqrt => (fb::Activation::Sqrt, 0.0),
    }
}

fn act_from_fb(a: fb::Activation, alpha: f32) -> Option<Act> {
    Some(match a {
        fb::Activation::None => Act::None,
        fb::Activation::Relu => Act::Relu,
        fb::Activation::LeakyRelu => Act::LeakyRelu(alpha),
        fb::Activation::Tanh => Act::Tanh,
        fb::Activation::Sigmoid => Act::Sigmoid,
        fb::Activation::GeluErf => Act::GeluErf,
        fb::Activation::GeluTanh => Act::GeluTanh,
        fb::Activation::Silu => Act::Silu,
        fb::Activation::Erf => Act::Erf,
        fb::Activation::Sqrt => Act::Sqrt,
        _ => return None,
    })
}

fn graph_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, g: &Graph, table_at: &[(usize, u64)]) -> WIPOffset<fb::Graph<'b>> {
    let nodes: Vec<_> = g
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let inputs: Vec<u32> = n.inputs.iter().map(|&i| i as u32).collect();
            let inputs = Some(b.create_vector(&inputs));
            let mut args = fb::NodeArgs { inputs, width: n.width as u32, ..Default::default() };
            let floats = |b: &mut FlatBufferBuilder<'b>, v: &[f32]| Some(b.create_vector(v));
            match &n.op {
                Op::Input { offset } => {
                    args.op = fb::NodeOp::Input;
                    args.offset = *offset as u32;
                }
                Op::Dense { layer, act } => {
                    args.op = fb::NodeOp::Dense;
                    args.dense = Some(layer_to_fb(b, layer));
                    (args.activation, args.alpha) = act_to_fb(*act);
                }
                Op::Act(act) => {
                    args.op = fb::NodeOp::Activation;
                    (args.activation, args.alpha) = act_to_fb(*act);
                }
                Op::Add => args.op = fb::NodeOp::Add,
                Op::Sub => args.op = fb::NodeOp::Sub,
                Op::Mul => args.op = fb::NodeOp::Mul,
                Op::Div => args.op = fb::NodeOp::Div,
                Op::Affine { center, scale, shift } => {
                    args.op = fb::NodeOp::Affine;
                    args.center = floats(b, center);
                    args.scale = floats(b, scale);
                    args.shift = floats(b, shift);
                }
                Op::Concat => args.op = fb::NodeOp::Concat,
                Op::LayerNorm { epsilon, scale, shift } => {
                    args.op = fb::NodeOp::LayerNorm;
                    args.epsilon = *epsilon;
                    args.scale = floats(b, scale);
                    args.shift = floats(b, shift);
                }
                Op::Dot => args.op = fb::NodeOp::Dot,
                Op::Sum => args.op = fb::NodeOp::Sum,
                Op::Embedding { dim: _, rows, table, default } => {
                    args.op = fb::NodeOp::Embedding;
                    args.table_rows = *rows as u32;
                    match table_at.iter().find(|(node, _)| *node == i) {
                        Some(&(_, at)) => args.table_at = at,
                        None => args.table = floats(b, table),
                    }
                    args.table_default = floats(b, default);
                }
                Op::Trees(e) => {
                    args.op = fb::NodeOp::Trees;
                    args.trees = Some(ensemble_to_fb(b, e));
                }
            }
            fb::Node::create(b, &args)
        })
        .collect();
    let nodes = Some(b.create_vector(&nodes));
    let output = match g.output {
        OutputKind::Logit => fb::OutputKind::Logit,
        OutputKind::Raw => fb::OutputKind::Raw,
    };
    fb::Graph::create(b, &fb::GraphArgs { nodes, output })
}

/// Why `graph_from_fb` refused a graph.
enum FromFb {
    Shape(String),
    Table { node: usize, source: TableError },
}

impl From<String> for FromFb {
    fn from(what: String) -> FromFb {
        FromFb::Shape(what)
    }
}

/// The graph of a file whose bytes are `bytes`; with `file` (the mapping of
/// those bytes) its embedding tables are views of it, else copies.
fn graph_from_fb(g: &fb::Graph<'_>, bytes: &[u8], file: Option<&Arc<ModelFile>>) -> Result<Graph, FromFb> {
    let output = match g.output() {
        fb::OutputKind::Logit => OutputKind::Logit,
        fb::OutputKind::Raw => OutputKind::Raw,
        _ => return Err(FromFb::Shape("the graph has an unknown output kind".into())),
    };
    let fb_nodes = g.nodes().unwrap_or_default();
    if fb_nodes.len() > graph::NODES_MAX {
        return Err(format!("the graph has {} nodes; the limit is {}", fb_nodes.len(), graph::NODES_MAX).into());
    }
    let mut nodes = Vec::with_capacity(fb_nodes.len());
    for (i, n) in fb_nodes.iter().enumerate() {
        let floats = |v: Option<flatbuffers::Vector<'_, f32>>| v.map(|v| v.iter().collect()).unwrap_or_default();
        let act =
            || act_from_fb(n.activation(), n.alpha()).ok_or_else(|| format!("node {i} has an unknown activation"));
        let width = n.width() as usize;
        let op = match n.op() {
            fb::NodeOp::Input => Op::Input { offset: n.offset() as usize },
            fb::NodeOp::Dense => {
                let layer = n
                    .dense()
                    .and_then(|l| layer_from_fb(&l))
                    .ok_or_else(|| format!("node {i} (Dense) has no layer or an unknown layer activation"))?;
                Op::Dense { layer, act: act()? }
            }
            fb::NodeOp::Activation => Op::Act(act()?),
            fb::NodeOp::Add => Op::Add,
            fb::NodeOp::Sub => Op::Sub,
            fb::NodeOp::Mul => Op::Mul,
            fb::NodeOp::Div => Op::Div,
            fb::NodeOp::Affine => {
                Op::Affine { center: floats(n.center()), scale: floats(n.scale()), shift: floats(n.shift()) }
            }
            fb::NodeOp::Concat => Op::Concat,
            fb::NodeOp::LayerNorm => {
                Op::LayerNorm { epsilon: n.epsilon(), scale: floats(n.scale()), shift: floats(n.shift()) }
            }
            fb::NodeOp::Dot => Op::Dot,
            fb::NodeOp::Sum => Op::Sum,
            fb::NodeOp::Embedding => {
                let default: Vec<f32> = floats(n.table_default());
                let rows = n.table_rows() as usize;
                let table = embedding_table(&n, rows, default.len(), bytes, file).map_err(|e| match e {
                    Some(source) => FromFb::Table { node: i, source },
                    None => FromFb::Shape(format!("node {i} (Embedding) has its table both inline and at table_at")),
                })?;
                Op::Embedding { dim: default.len(), rows, table, default }
            }
            fb::NodeOp::Trees => {
                let e = n.trees().ok_or_else(|| format!("node {i} (Trees) has no ensemble"))?;
                Op::Trees(ensemble_from_fb(&e).map_err(|what| format!("node {i} (Trees): {what}"))?)
            }
            _ => return Err(format!("node {i} has an unknown op").into()),
        };
        let inputs = n.inputs().map(|v| v.iter().map(|x| x as usize).collect()).unwrap_or_default();
        nodes.push(Node { op, inputs, width });
    }
    Ok(Graph { nodes, output })
}

/// An Embedding node's `rows x dim` table, inline or at `table_at`: a view
/// of `file` when given (which `bytes` are all of), else a copy. A node with
/// no table gets an empty one, which validation refuses with the shape it
/// should have had. `Err(None)`: the node has both.
fn embedding_table(
    n: &fb::Node<'_>,
    rows: usize,
    dim: usize,
    bytes: &[u8],
    file: Option<&Arc<ModelFile>>,
) -> Result<EmbeddingTable, Option<TableError>> {
    let (at, floats) = match (n.table(), n.table_at()) {
        (Some(_), 1..) => return Err(None),
        // The verifier checked the vector lies in `bytes`.
        (Some(t), 0) => (t.bytes().as_ptr() as usize - bytes.as_ptr() as usize, t.len()),
        (None, 0) => return Ok(Vec::new().into()),
        (None, at) => {
            let out_of_file = || TableError::OutOfFile {
                at,
                floats: (rows as u64).saturating_mul(dim as u64),
                file_bytes: bytes.len() as u64,
            };
            let at = usize::try_from(at).map_err(|_| out_of_file())?;
            (at, rows.checked_mul(dim).ok_or_else(out_of_file)?)
        }
    };
    match file {
        Some(f) => EmbeddingTable::mapped(f, at, floats),
        None => EmbeddingTable::copied(bytes, at, floats),
    }
    .map_err(Some)
}

const TREE_LEAF: u8 = 1;
const TREE_CATEGORICAL: u8 = 2;
const TREE_MISSING_LEFT: u8 = 4;
const TREE_ZERO_MISSING: u8 = 8;

fn ensemble_to_fb<'b>(b: &mut FlatBufferBuilder<'b>, e: &Ensemble) -> WIPOffset<fb::TreeEnsemble<'b>> {
    let n = e.nodes.len();
    let (mut feature, mut threshold, mut flags) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    let mut cat_ranges = Vec::new();
    for node in &e.nodes {
        let (f, t, fl) = match node.split {
            Split::Leaf { value } => (0, value, TREE_LEAF),
            Split::Numeric { feature, threshold, missing_left, zero_missing } => {
                let fl =
                    if missing_left { TREE_MISSING_LEFT } else { 0 } | if zero_missing { TREE_ZERO_MISSING } else { 0 };
                (feature, threshold, fl)
            }
            Split::Categorical { feature, start, len } => {
                cat_ranges.extend([start, len]);
                (feature, 0.0, TREE_CATEGORICAL)
            }
        };
        feature.push(f);
        threshold.push(t);
        flags.push(fl);
    }
    let left: Vec<u32> = e.nodes.iter().map(|n| n.left).collect();
    let right: Vec<u32> = e.nodes.iter().map(|n| n.right).collect();
    let args = fb::TreeEnsembleArgs {
        tree_starts: Some(b.create_vector(&e.starts)),
        feature: Some(b.create_vector(&feature)),
        threshold: Some(b.create_vector(&threshold)),
        left: Some(b.create_vector(&left)),
        right: Some(b.create_vector(&right)),
        flags: Some(b.create_vector(&flags)),
        cat_ranges: Some(b.create_vector(&cat_ranges)),
        cat_words: Some(b.create_vector(&e.cat_words)),
        base: e.base,
    };
    fb::TreeEnsemble::create(b, &args)
}

/// Reads an ensemble; `Graph::validate` checks it as a tree afterwards.
fn ensemble_from_fb(e: &fb::TreeEnsemble<'_>) -> Result<Ensemble, String> {
    let u32s = |v: Option<flatbuffers::Vector<'_, u32>>| v.map(|v| v.iter().collect::<Vec<u32>>()).unwrap_or_default();
    let starts = u32s(e.tree_starts());
    let feature = u32s(e.feature());
    let left = u32s(e.left());
    let right = u32s(e.right());
    let threshold: Vec<f32> = e.threshold().map(|v| v.iter().collect()).unwrap_or_default();
    let flags: Vec<u8> = e.flags().map(|v| v.iter().collect()).unwrap_or_default();
    let cat_ranges = u32s(e.cat_ranges());
    let n = feature.len();
    if [threshold.len(), left.len(), right.len(), flags.len()].iter().any(|l| *l != n) {
        return Err("its per-node arrays differ in length".into());
    }
    if n > trees::ENSEMBLE_NODES_MAX {
        return Err(format!("{n} nodes; the limit is {}", trees::ENSEMBLE_NODES_MAX));
    }
    let mut nodes = Vec::with_capacity(n);
    let mut cats = cat_ranges.chunks_exact(2);
    for i in 0..n {
        let fl = flags[i];
        let split = if fl & TREE_LEAF != 0 {
            Split::Leaf { value: threshold[i] }
        } else if fl & TREE_CATEGORICAL != 0 {
            let r = cats.next().ok_or("a categorical split has no bitset range")?;
            Split::Categorical { feature: feature[i], start: r[0], len: r[1] }
        } else {
            Split::Numeric {
                feature: feature[i],
                threshold: threshold[i],
                missing_left: fl & TREE_MISSING_LEFT != 0,
                zero_missing: fl & TREE_ZERO_MISSING != 0,
            }
        };
        nodes.push(TreeNode { split, left: left[i], right: right[i] });
    }
    if cats.next().is_some() || cat_ranges.len() % 2 != 0 {
        return Err("more bitset ranges than categorical splits".into());
    }
    Ok(Ensemble { starts, nodes, cat_words: u32s(e.cat_words()), base: e.base() })
}

/// The logistic function applied on the host to the output logit.
#[inline]
pub fn sigmoid(logit: f32) -> f32 {
    1.0 / (1.0 + (-logit).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny() -> Model {
        Model {
            name: "tiny".into(),
            version: 3,
            inputs: vec![
                InputSegment { source: Source::User, dim: 2 },
                InputSegment { source: Source::Context, dim: 1 },
            ],
            layers: vec![
                Layer::quantize(3, 2, true, vec![1.0, -2.0, 0.5, 0.0, 0.0, 0.0], vec![0.1, 0.2]),
                Layer::quantize(2, 1, false, vec![1.5, -1.0], vec![-0.25]),
            ],
            calibration: None,
            graph: None,
            onnx: None,
        }
    }

    fn calibrated() -> Model {
        Model {
            calibration: Some(Calibration {
                method: "max-abs".into(),
                rows: 4,
                input_ranges: vec![2.0, 1.27],
                scores: ScoreHistogram { edges: vec![0.0, 0.5, 1.0], counts: vec![1, 3] },
                input_means: vec![0.25],
                input_variances: vec![2.0],
                activations: ActivationScales::Static,
                static_error: Some(MeasuredError { max: 0.25, mean: 0.125 }),
                dynamic_error: None,
            }),
            ..tiny()
        }
    }

    #[test]
    fn quantization_is_per_output_channel() {
        let l = &tiny().layers[0];
        assert_eq!(l.weight_scales, vec![2.0 / 127.0, 1.0]);
        assert_eq!(l.weights_i8, vec![64, -127, 32, 0, 0, 0]);
    }

    #[test]
    fn reference_forward_by_hand() {
        let m = tiny();
        let mut out = [0.0];
        m.forward_f32_reference(&[1.0, 0.5, 2.0], 1, &mut out);
        // hidden = relu([1 - 1 + 1 + 0.1, 0.2]) = [1.1, 0.2]; logit = 1.65 - 0.2 - 0.25
        assert!((out[0] - 1.2).abs() < 1e-6, "{}", out[0]);
    }

    #[test]
    fn file_round_trip_and_refusals() {
        let m = tiny();
        let bytes = m.to_bytes();
        assert_eq!(Model::from_bytes(&bytes, "t").unwrap(), m);
        assert!(Model::from_bytes(&bytes[..bytes.len() / 2], "t").is_err());
        assert!(matches!(Model::from_bytes(b"garbage!", "t"), Err(ModelError::Identifier { .. })));

        let mut broken = m.clone();
        broken.layers[1].in_dim = 3;
        let err = Model::from_bytes(&broken.to_bytes(), "t").unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");

        let mut two_outputs = m.clone();
        two_outputs.layers[1] = Layer::quantize(2, 2, false, vec![0.0; 4], vec![0.0; 2]);
        assert!(Model::from_bytes(&two_outputs.to_bytes(), "t").is_err());

        let mut nan = m;
        nan.layers[0].weights_f32[0] = f32::NAN;
        assert!(Model::from_bytes(&nan.to_bytes(), "t").is_err());
    }

    #[test]
    fn calibration_round_trips_and_bad_calibrations_are_refused() {
        let m = calibrated();
        assert_eq!(Model::from_bytes(&m.to_bytes(), "t").unwrap(), m);
        let refused = |edit: &dyn Fn(&mut Calibration)| {
            let mut bad = calibrated();
            edit(bad.calibration.as_mut().unwrap());
            Model::from_bytes(&bad.to_bytes(), "t").unwrap_err().to_string()
        };
        assert!(refused(&|c| c.input_ranges.pop().map(drop).unwrap_or(())).contains("1 activation ranges for 2"));
        assert!(refused(&|c| c.input_ranges[1] = 0.0).contains("non-positive activation range"));
        assert!(refused(&|c| c.input_ranges[0] = f32::INFINITY).contains("non-finite"));
        assert!(refused(&|c| c.scores.edges[1] = 1.0).contains("not ascending"));
        assert!(refused(&|c| c.scores.counts.push(0)).contains("not ascending"));
        assert!(refused(&|c| c.input_means.push(0.0)).contains("2 context means and 1 variances for 1"));
        assert!(refused(&|c| c.input_variances[0] = -1.0).contains("bad variance"));
        assert!(refused(&|c| c.input_means[0] = f32::NAN).contains("non-finite context mean"));
        // A calibration written before the moments were stored still reads.
        let mut older = calibrated();
        let c = older.calibration.as_mut().unwrap();
        (c.input_means, c.input_variances) = (Vec::new(), Vec::new());
        let bytes = older.to_bytes();
        assert!(flatbuffers::root::<fb::Model>(&bytes).unwrap().calibration().unwrap().input_means().is_none());
        assert_eq!(Model::from_bytes(&bytes, "t").unwrap(), older);
    }

    #[test]
    fn static_int8_constants_follow_the_documented_formulas() {
        assert!(tiny().static_int8().is_none());
        let m = calibrated();
        let s = m.static_int8().unwrap();
        let (s0, s1) = (2.0f32 / 127.0, 1.27f32 / 127.0);
        assert_eq!(s[0].in_scale, s0);
        assert!(s[0].requantize && s[0].lo == 0 && !s[1].requantize && s[1].lo == -128);
        let l0 = &m.layers[0];
        for o in 0..2 {
            let acc_unit = f64::from(l0.weight_scales[o]) * f64::from(s0);
            assert_eq!(s[0].bias_q[o], (f64::from(l0.bias[o]) / acc_unit).round_ties_even() as i32);
            assert_eq!(s[0].scale[o], (acc_unit / f64::from(s1)) as f32);
        }
        // Channel 1 has all-zero weights, scale 1: bias 0.2 is 0.2 * 63.5 units.
        assert_eq!(s[0].bias_q[1], 13);
        assert_eq!(s[1].scale[0], (f64::from(m.layers[1].weight_scales[0]) * f64::from(s1)) as f32);
        // A bias far beyond the accumulator range is clamped, not wrapped.
        let mut huge = calibrated();
        huge.layers[1].bias[0] = 1e30;
        assert_eq!(huge.static_int8().unwrap()[1].bias_q[0], BIAS_Q_MAX);
    }

    /// A user vector and two context ids, each read by its own table.
    fn embedded(rows: usize) -> Model {
        let table = |seed: usize| -> EmbeddingTable {
            (0..rows * 3).map(|i| ((i * 7 + seed) % 101) as f32 / 101.0).collect::<Vec<f32>>().into()
        };
        let nodes = vec![
            Node { op: Op::Input { offset: 2 }, inputs: vec![], width: 1 },
            Node {
                op: Op::Embedding { dim: 3, rows, table: table(1), default: vec![0.5; 3] },
                inputs: vec![0],
                width: 3,
            },
            Node { op: Op::Input { offset: 3 }, inputs: vec![], width: 1 },
            Node {
                op: Op::Embedding { dim: 3, rows, table: table(2), default: vec![-0.5; 3] },
                inputs: vec![2],
                width: 3,
            },
            Node { op: Op::Input { offset: 0 }, inputs: vec![], width: 2 },
            Node { op: Op::Concat, inputs: vec![1, 3, 4], width: 8 },
            Node {
                op: Op::Dense { layer: Layer::quantize(8, 1, false, vec![0.25; 8], vec![0.0]), act: Act::None },
                inputs: vec![5],
                width: 1,
            },
        ];
        Model {
            name: "emb".into(),
            version: 1,
            inputs: vec![
                InputSegment { source: Source::User, dim: 2 },
                InputSegment { source: Source::ContextIds, dim: 2 },
            ],
            layers: vec![],
            calibration: None,
            graph: Some(Graph { nodes, output: OutputKind::Logit }),
            onnx: None,
        }
    }

    fn tables(m: &Model) -> Vec<&EmbeddingTable> {
        let nodes = m.graph.as_ref().map_or(&[][..], |g| &g.nodes[..]);
        nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Embedding { table, .. } => Some(table),
                _ => None,
            })
            .collect()
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("quiver-model-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn embedding_tables_round_trip_inline_and_after_the_flatbuffer_and_load_mapped() {
        let m = embedded(1000);
        let dir = scratch("tables");
        for (k, inline_bytes_max) in [usize::MAX, 0].into_iter().enumerate() {
            let mut bytes = Vec::new();
            m.write_file(&mut bytes, inline_bytes_max).unwrap();
            let root = flatbuffers::root::<fb::Model>(&bytes).unwrap();
            let nodes = root.graph().and_then(|g| g.nodes()).unwrap();
            for n in nodes.iter().filter(|n| n.op() == fb::NodeOp::Embedding) {
                if inline_bytes_max == 0 {
                    assert!(n.table().is_none() && n.table_at() > 0 && n.table_at() % TABLE_ALIGN_BYTES as u64 == 0);
                } else {
                    assert!(n.table().is_some() && n.table_at() == 0);
                }
            }
            let copied = Model::from_bytes(&bytes, "t").unwrap();
            assert_eq!(copied, m);
            assert!(tables(&copied).iter().all(|t| !t.is_mapped()));
            // A new file each time: writing over a mapped one in place is
            // exactly what the mapping forbids.
            let path = dir.join(format!("{k}.qm"));
            std::fs::write(&path, &bytes).unwrap();
            // A file this small is read, and nothing of it stays mapped.
            let read = Model::load(&path).unwrap();
            assert_eq!(read, m);
            assert!(tables(&read).iter().all(|t| !t.is_mapped()));
            let loaded = Model::load_reading_at_most(&path, 0).unwrap();
            assert_eq!(loaded, m);
            for t in tables(&loaded) {
                let file = t.file().unwrap();
                assert!(file.bytes().as_ptr_range().contains(&t.as_ptr().cast()), "{t:?}");
                assert_eq!(file.bytes().len(), bytes.len());
                assert_eq!(&bytes[bytes.len() - CHECKSUM_TRAILER_BYTES..][..4], b"QVC1");
            }
            let x = [0.5, -1.0, 999.0, 1000.0, 0.25, 0.75, 3.0, -2.0];
            let (mut want, mut got) = ([0.0; 2], [0.0; 2]);
            m.forward_f32_reference(&x, 2, &mut want);
            loaded.forward_f32_reference(&x, 2, &mut got);
            assert_eq!(want, got);
        }
        // Small tables stay inline, where older servers read them too.
        let mut inline = Vec::new();
        m.write_file(&mut inline, usize::MAX).unwrap();
        assert_eq!(m.to_bytes(), inline);
        let saved = dir.join("saved.qm");
        m.save(&saved).unwrap();
        assert_eq!(std::fs::read(&saved).unwrap(), inline);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tables_after_the_flatbuffer_are_refused_when_the_file_is_short() {
        // Without the checksum trailer (as files from before it), where the
        // table bounds are the only check.
        let m = embedded(1000);
        let mut bytes = Vec::new();
        m.write_body(&mut bytes, 0).unwrap();
        for cut in [4, 3 * 4 * 1000, 3 * 4 * 1000 + 1] {
            let e = Model::from_bytes(&bytes[..bytes.len() - cut], "t").unwrap_err();
            assert!(
                matches!(e, ModelError::Table { node: 3, source: TableError::OutOfFile { floats: 3000, .. }, .. }),
                "{cut}: {e}"
            );
        }
        let e = Model::from_bytes(&bytes[..bytes.len() - 2 * 3 * 4 * 1000], "t").unwrap_err();
        assert!(matches!(e, ModelError::Table { node: 1, .. }), "{e}");
        assert!(e.to_string().contains("node 1"), "{e}");
    }

    #[test]
    fn a_flipped_bit_or_a_cut_is_refused_with_a_typed_error_and_old_files_still_load() {
        let m = embedded(1000);
        for inline_bytes_max in [usize::MAX, 0] {
            let mut bytes = Vec::new();
            m.write_file(&mut bytes, inline_bytes_max).unwrap();
            for at in [0, 9, bytes.len() / 2, bytes.len() - CHECKSUM_TRAILER_BYTES - 1] {
                let mut flipped = bytes.clone();
                flipped[at] ^= 0x10;
                let e = Model::from_bytes(&flipped, "t").unwrap_err();
                assert!(matches!(e, ModelError::Checksum { .. }), "bit {at}: {e}");
                assert!(e.to_string().contains("checksum mismatch"), "{e}");
            }
            // A copy cut short has no trailer, so it is read as an old file:
            // cut within the trailer, the model is all there; cut further,
            // what is missing is refused (never a panic).
            for cut in [1, 8] {
                assert_eq!(Model::from_bytes(&bytes[..bytes.len() - cut], "t").unwrap(), m);
            }
            for cut in [9, 100, bytes.len() / 2, bytes.len() - 7] {
                let e = Model::from_bytes(&bytes[..bytes.len() - cut], "t");
                assert!(e.is_err(), "cut {cut} of {} loaded", bytes.len());
            }
            // A file from before checksums loads.
            let mut old = Vec::new();
            m.write_body(&mut old, inline_bytes_max).unwrap();
            assert_eq!(Model::from_bytes(&old, "t").unwrap(), m);
        }
    }

    #[test]
    fn heap_parts_over_the_limit_are_refused_even_when_the_file_is_small() {
        // One 64 MiB weight vector that 17 dense layers all point at: a small
        // file, but loading would copy 17 x 64 MiB, over MODEL_HEAP_BYTES_MAX.
        let k = 1 << 12;
        let mut b = FlatBufferBuilder::new();
        let weights = b.create_vector(&vec![0.5f32; k * k]);
        let weights_i8 = b.create_vector(&[1i8; 16]);
        let ones = b.create_vector(&vec![1.0f32; k]);
        let layer = fb::Layer::create(
            &mut b,
            &fb::LayerArgs {
                in_dim: k as u32,
                out_dim: k as u32,
                activation: fb::Activation::None,
                weights_f32: Some(weights),
                weights_i8: Some(weights_i8),
                weight_scales: Some(ones),
                bias: Some(ones),
            },
        );
        let nodes: Vec<_> = (0..17)
            .map(|i| {
                let inputs = Some(b.create_vector(&[i as u32]));
                let args = fb::NodeArgs { op: fb::NodeOp::Dense, inputs, dense: Some(layer), ..Default::default() };
                fb::Node::create(&mut b, &args)
            })
            .collect();
        let nodes = Some(b.create_vector(&nodes));
        let graph = Some(fb::Graph::create(&mut b, &fb::GraphArgs { nodes, output: fb::OutputKind::Logit }));
        let name = Some(b.create_string("shared"));
        let root = fb::Model::create(&mut b, &fb::ModelArgs { name, graph, ..Default::default() });
        fb::finish_model_buffer(&mut b, root);
        let bytes = b.finished_data();
        assert!(bytes.len() < MODEL_HEAP_BYTES_MAX / 8);
        let e = Model::from_bytes(bytes, "shared.qm").unwrap_err();
        assert!(matches!(e, ModelError::HeapTooLarge { .. }), "{e}");
        assert!(e.to_string().contains("MODEL_HEAP_BYTES_MAX"), "{e}");
    }

    #[test]
    fn files_without_calibration_read_as_uncalibrated() {
        // The builder omits an absent table, so these bytes are what a writer
        // from before the `calibration` field produced.
        let bytes = tiny().to_bytes();
        assert!(flatbuffers::root::<fb::Model>(&bytes).unwrap().calibration().is_none());
        assert_eq!(Model::from_bytes(&bytes, "old.qm").unwrap().calibration, None);
    }
}
