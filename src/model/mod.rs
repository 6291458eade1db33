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
//! Loading (`codec`, which reads and writes the file) maps the file
//! read-only and copies everything but the embedding tables of a graph
//! model into owned, validated arrays; the tables, which can be gigabytes,
//! are served from the mapping (`embedding`), and a file whose tables are
//! too large to be inline stores them after the FlatBuffer
//! (`Node.table_at`). A file that does not describe a consistent network is
//! refused with the reason (`Model::validate`, here).

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
mod codec;
pub mod embedding;
pub mod explain;
pub mod gbdt;
pub mod graph;
pub mod layout;
pub mod onnx;
pub mod onnx_graph;
pub mod trees;

pub use codec::{EMBEDDING_INLINE_BYTES_MAX, MODEL_HEAP_BYTES_MAX, MODEL_MAPPED_BYTES_MAX, MODEL_READ_BYTES_MAX};
pub use embedding::{EmbeddingTable, ModelFile, TableError};
pub use generated::quiver::model as fb;
pub use graph::{Act, Graph, Node, Op, OutputKind};
pub use onnx_graph::{OnnxElement, OnnxGraph, OnnxInput};

use crate::features::groups::{Scope, GROUPS_MAX};
use crate::features::replica::GROUP_NAME_BYTES_MAX;

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
    /// A named feature group (`[[groups]]`), keyed once per request or
    /// once per candidate as `scope` says.
    Group {
        name: GroupName,
        scope: Scope,
    },
}

impl Source {
    /// The feature group the segment reads: `user` and `item` are groups
    /// like any other; the context is none.
    pub fn group(&self) -> Option<(&str, Scope)> {
        match self {
            Source::User => Some(("user", Scope::Request)),
            Source::Item => Some(("item", Scope::Candidate)),
            Source::Group { name, scope } => Some((name.as_str(), *scope)),
            Source::Context | Source::ContextIds => None,
        }
    }

    /// Whether the segment holds one value per candidate (a candidate-scope
    /// group) rather than one per request, broadcast.
    pub fn per_candidate(&self) -> bool {
        matches!(self.group(), Some((_, Scope::Candidate)))
    }

    /// The name `--inputs` and error messages use.
    pub fn name(&self) -> &str {
        match self {
            Source::Context => "context",
            Source::ContextIds => "context_ids",
            other => other.group().map_or("", |(name, _)| name),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A feature group's name held inline, so a [`Source`] stays `Copy`: at
/// most `GROUP_NAME_BYTES_MAX` bytes, checked by `groups::check_name`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupName {
    len: u8,
    bytes: [u8; GROUP_NAME_BYTES_MAX],
}

impl GroupName {
    pub fn new(name: &str) -> Result<GroupName, String> {
        crate::features::groups::check_name(name)?;
        let mut bytes = [0; GROUP_NAME_BYTES_MAX];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        Ok(GroupName { len: name.len() as u8, bytes })
    }

    pub fn as_str(&self) -> &str {
        // Only `new` writes the bytes, from a `&str` it checked.
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("")
    }
}

impl std::fmt::Debug for GroupName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
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
    /// A name per input column, in row order, as the framework named it
    /// (`quiver import`); empty when it named none, and each column is
    /// then named by its segment ([`Model::feature_names`]).
    pub feature_names: Vec<String>,
}

/// The longest feature name a model file may hold, in bytes.
pub const FEATURE_NAME_BYTES_MAX: usize = 256;

/// Whether `name` may name a feature: 1 to [`FEATURE_NAME_BYTES_MAX`]
/// bytes with no control characters (names are printed by `quiver score`
/// and listed in JSON).
pub fn valid_feature_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= FEATURE_NAME_BYTES_MAX && !name.chars().any(char::is_control)
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
        // A source read twice would be looked up twice for one key; and
        // every group a model reads is a lookup per request, bounded.
        if self.inputs.len() > GROUPS_MAX + 2 {
            return Err(bad(format!("declares {} inputs, at most {}", self.inputs.len(), GROUPS_MAX + 2)));
        }
        for (at, s) in self.inputs.iter().enumerate() {
            if self.inputs[..at].iter().any(|o| o.source.name() == s.source.name()) {
                return Err(bad(format!("declares the {} input more than once", s.source)));
            }
        }
        if self.inputs.iter().any(|i| i.dim == 0) {
            return Err(bad("an input segment has dimension 0".into()));
        }
        if !self.feature_names.is_empty() {
            let (names, width) = (self.feature_names.len(), self.input_dim());
            if names != width {
                return Err(bad(format!("names {names} features but reads {width} input columns")));
            }
            if let Some(n) = self.feature_names.iter().position(|f| !valid_feature_name(f)) {
                return Err(bad(format!(
                    "feature name {n} is empty, over {FEATURE_NAME_BYTES_MAX} bytes or holds a control character"
                )));
            }
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
        self.inputs.iter().flat_map(|s| std::iter::repeat_n(!s.source.per_candidate(), s.dim)).collect()
    }

    /// The input columns input drift follows, as (offset, width) in a row,
    /// in order: the context, then every request-scope group (user, card,
    /// device…), then every candidate-scope group (item, ad…), each in input
    /// order. Calibrations written before groups hold the context's moments
    /// alone, and those written before candidate-scope groups were followed
    /// the context's and request-scope groups': both prefixes of these.
    pub fn drift_columns(&self) -> Vec<(usize, usize)> {
        self.drift_segments().into_iter().map(|(at, s)| (at, s.dim)).collect()
    }

    /// A name per input column, in row order: the framework's own, kept at
    /// import (`amount`), or else the segment's source and the column's
    /// place in it, `card[3]`, `context[0]`; what an explanation's feature
    /// index names (`GET /models`, `quiver score --explain`).
    pub fn feature_names(&self) -> Vec<String> {
        if !self.feature_names.is_empty() {
            return self.feature_names.clone();
        }
        self.layout_feature_names()
    }

    /// Each column named by its segment: `card[3]`, `context[0]`.
    pub fn layout_feature_names(&self) -> Vec<String> {
        self.inputs.iter().flat_map(|s| (0..s.dim).map(move |k| format!("{}[{k}]", s.source.name()))).collect()
    }

    /// A name per column of [`Model::drift_columns`]: `context_3`, `card_0`.
    pub fn drift_column_names(&self) -> Vec<String> {
        let segments = self.drift_segments();
        segments.iter().flat_map(|(_, s)| (0..s.dim).map(move |k| format!("{}_{k}", s.source.name()))).collect()
    }

    fn drift_segments(&self) -> Vec<(usize, InputSegment)> {
        let mut at = 0;
        let mut context = Vec::new();
        let mut groups = Vec::new();
        let mut candidates = Vec::new();
        for s in &self.inputs {
            match s.source.group() {
                None if s.source == Source::Context => context.push((at, *s)),
                Some((_, Scope::Request)) => groups.push((at, *s)),
                Some((_, Scope::Candidate)) => candidates.push((at, *s)),
                None => {}
            }
            at += s.dim;
        }
        context.extend(groups);
        context.extend(candidates);
        context
    }

    /// How many of [`Model::drift_columns`]' segments hold one value per
    /// request (the context and the request-scope groups); the rest hold
    /// one per candidate.
    pub fn drift_request_segments(&self) -> usize {
        self.drift_segments().iter().filter(|(_, s)| !s.source.per_candidate()).count()
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
            if s.source.per_candidate() {
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
    // Files from before groups hold the context's moments alone.
    let context_dim = m.input_dim_of(Source::Context).unwrap_or(0);
    // Files from before candidate-scope groups were followed hold the
    // per-request columns' moments alone.
    let drift_columns = m.drift_columns();
    let columns: usize = drift_columns.iter().map(|(_, d)| d).sum();
    let request_columns: usize = drift_columns[..m.drift_request_segments()].iter().map(|(_, d)| d).sum();
    let moments = c.input_means.len();
    if moments != c.input_variances.len() || ![0, context_dim, request_columns, columns].contains(&moments) {
        return Err(format!(
            "calibration has {moments} input means and {} variances for {context_dim} context inputs, \
             {request_columns} per-request inputs and {columns} inputs in all",
            c.input_variances.len()
        ));
    }
    let moments_ok =
        c.input_means.iter().all(|m| m.is_finite()) && c.input_variances.iter().all(|v| v.is_finite() && *v >= 0.0);
    if !moments_ok {
        return Err("calibration holds a non-finite input mean or a bad variance".into());
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
            feature_names: Vec::new(),
        }
    }

    pub(crate) fn calibrated() -> Model {
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
}
