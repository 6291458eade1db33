//! ONNX import: turns the graphs that standard tools export for CTR, fraud
//! and pricing models into a Quiver [`Model`].
//!
//! Training happens elsewhere (scikit-learn, PyTorch, Keras) and ONNX is what
//! those tools write, so this is how a trained model reaches the server. The
//! graph is decoded with `onnx-protobuf` (generated types, pure Rust, no
//! runtime) and interpreted op by op into a `model::graph::Graph`: graph
//! inputs become input slices, `Gemm`/`MatMul` dense nodes, constants in
//! `Add`/`Sub`/`Mul`/`Div`, `BatchNormalization` and `Scaler` affine nodes,
//! and so on; a final `Sigmoid` is dropped because the server applies it on
//! the host, and a two-class probability output is read at its positive
//! class. The exact rewrites of `Graph::simplify` follow (BatchNorm folded
//! into the dense layer before it, activations fused, GELU recognised), and
//! a graph that is then a plain chain of ReLU dense layers is stored as the
//! v1 MLP, which keeps the fused INT8 kernels and calibration. Everything
//! else is refused with the node and the reason rather than approximated, so
//! an imported model computes what the ONNX graph computes or is not
//! imported at all.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use onnx_protobuf::{attribute_proto::AttributeType, tensor_proto, type_proto, Message as _};
use onnx_protobuf::{AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto};
use protobuf::Enum as _;

use super::graph::{Act, Graph, Node as GNode, Op, OutputKind};
use super::{InputSegment, Layer, Model, ModelError, Source, MODEL_HEAP_BYTES_MAX};

mod export;
mod keep;
mod tree_ensemble;
mod wire;

pub use export::export_mlp;
pub use keep::KeepOnnx;

/// The ops the importer understands, for error messages.
pub const SUPPORTED_OPS: &str =
    "Gemm, MatMul, Add, Sub, Mul, Div, Pow (3, 2, 0.5), Neg, Reciprocal, Relu, LeakyRelu, Tanh, Sigmoid, \
     Erf, Gelu, Sqrt, BatchNormalization, LayerNormalization, Softmax (two classes), ReduceSum and ReduceMean \
     (feature axis), Concat, \
     Slice (of a graph input), Gather (embeddings), Identity, Dropout, Cast, Flatten, Reshape, Constant; \
     ai.onnx.ml Scaler, LinearClassifier, LinearRegressor, Normalizer (L1), ZipMap, TreeEnsembleClassifier \
     (binary), TreeEnsembleRegressor";

/// ONNX `TensorProto.DataType` codes this module reads.
const DT_FLOAT: i32 = 1;
const DT_INT64: i32 = 7;
const DT_INT32: i32 = 6;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: file is {bytes} bytes, the limit is {MODEL_HEAP_BYTES_MAX}")]
    TooLarge { path: String, bytes: u64 },
    #[error("{path}: not a valid ONNX file (truncated or corrupt): {detail}")]
    Decode { path: String, detail: String },
    #[error("{path}: the ONNX file holds no graph")]
    NoGraph { path: String },
    #[error("node '{node}': op {op} is not supported{hint}; supported ops: {SUPPORTED_OPS}")]
    UnsupportedOp { op: String, node: String, hint: String },
    #[error("node '{node}' ({op}): {what}")]
    Node { node: String, op: String, what: String },
    #[error("graph input '{input}': {what}")]
    Input { input: String, what: String },
    #[error("initializer '{name}': {what}")]
    Initializer { name: String, what: String },
    #[error("--inputs: {what}")]
    Mapping { what: String },
    #[error("output: {what}")]
    Output { what: String },
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl OnnxError {
    /// Whether the native compiler refused what the graph computes (an op
    /// or a node it does not run), as opposed to a file, input or mapping
    /// problem: such a graph may still run on onnxruntime.
    pub fn is_refusal(&self) -> bool {
        matches!(self, OnnxError::UnsupportedOp { .. } | OnnxError::Node { .. } | OnnxError::Output { .. })
    }
}

/// One entry of `--inputs`: which Quiver source fills the next `dim` columns,
/// optionally naming the ONNX graph input they come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappingEntry {
    pub source: Source,
    pub graph_input: Option<String>,
    pub dim: usize,
}

/// How the ONNX graph inputs map to Quiver input segments.
///
/// Written `user:32,item:32,context:16` (entries take the graph inputs in
/// their declared order, one each; a graph with a single input is split into
/// consecutive segments instead) or `user=u:32,item=i:32,context=c:16`
/// (entries name their graph input; several entries naming the same input
/// split it, in the order written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputMapping {
    pub entries: Vec<MappingEntry>,
}

impl std::str::FromStr for InputMapping {
    type Err = OnnxError;

    fn from_str(s: &str) -> Result<InputMapping, OnnxError> {
        let bad = |what: String| OnnxError::Mapping { what };
        let mut entries = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (left, dim) = part
                .rsplit_once(':')
                .ok_or_else(|| bad(format!("'{part}': expected SOURCE:DIM or SOURCE=INPUT:DIM")))?;
            let dim: usize = dim
                .parse()
                .ok()
                .filter(|d| *d > 0)
                .ok_or_else(|| bad(format!("'{part}': the dimension must be a positive integer")))?;
            let (source, graph_input) = match left.split_once('=') {
                Some((src, input)) if !input.is_empty() => (src, Some(input.to_string())),
                Some(_) => return Err(bad(format!("'{part}': empty graph input name after '='"))),
                None => (left, None),
            };
            let source = match source {
                "user" => Source::User,
                "item" => Source::Item,
                "context" => Source::Context,
                "context_ids" => Source::ContextIds,
                other => return Err(bad(format!("'{other}' is not a source; use user, item, context or context_ids"))),
            };
            if entries.iter().any(|e: &MappingEntry| e.source == source) {
                return Err(bad(format!("{} is mapped more than once", source_name(source))));
            }
            entries.push(MappingEntry { source, graph_input, dim });
        }
        if entries.is_empty() {
            return Err(bad("no entries; e.g. user:32,item:32,context:16".into()));
        }
        let named = entries.iter().filter(|e| e.graph_input.is_some()).count();
        if named != 0 && named != entries.len() {
            return Err(bad("name the graph input in every entry or in none".into()));
        }
        Ok(InputMapping { entries })
    }
}

/// The `--inputs` spelling of a source.
pub fn source_name(s: Source) -> &'static str {
    match s {
        Source::User => "user",
        Source::Item => "item",
        Source::Context => "context",
        Source::ContextIds => "context_ids",
    }
}

/// What `quiver import` needs besides the file.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    pub name: String,
    pub version: u32,
    pub inputs: InputMapping,
    /// The tensor holding the logit or its sigmoid; `None` takes the graph's
    /// only output.
    pub output: Option<String>,
    /// Whether the output is a logit (scores are its sigmoid) or a raw value.
    pub output_kind: OutputKind,
    /// Where external data files (weights beside the `.onnx`) are found;
    /// the ONNX file's folder.
    pub base_dir: Option<std::path::PathBuf>,
}

/// An imported model and what the import found, for the summary.
#[derive(Clone, Debug)]
pub struct Imported {
    pub model: Model,
    /// The tensor the model reproduces.
    pub output: String,
    /// Whether that tensor was a Sigmoid of the logit (dropped on import).
    pub sigmoid_dropped: bool,
    /// The column of that tensor the model reproduces: 1 of a two-class
    /// probability tensor, else 0.
    pub output_column: usize,
    /// `(graph input, Quiver segments)` in input-vector order.
    pub layout: Vec<(String, Vec<InputSegment>)>,
    pub producer: String,
    /// The rewrites made on the way (Dropout removed, BatchNorm folded, …).
    pub rewrites: Vec<String>,
}

impl Imported {
    /// Multiply-accumulates per scored row.
    pub fn macs_per_row(&self) -> usize {
        self.model.macs_per_row()
    }

    /// A human-readable account of the model: layout, layers, cost.
    pub fn summary(&self) -> String {
        let m = &self.model;
        let mut s = String::new();
        let _ = writeln!(s, "model '{}' version {} (from {})", m.name, m.version, self.producer);
        for (input, segs) in &self.layout {
            let parts: Vec<String> = segs.iter().map(|g| format!("{} {}", source_name(g.source), g.dim)).collect();
            let _ = writeln!(s, "  input '{input}': {}", parts.join(", "));
        }
        let _ = writeln!(s, "  input vector: {} floats", m.input_dim());
        for (i, l) in m.layers.iter().enumerate() {
            let act = if l.relu { ", ReLU" } else { "" };
            let _ = writeln!(s, "  layer {i}: {} -> {}{act}", l.in_dim, l.out_dim);
        }
        if let Some(g) = &m.graph {
            let _ = writeln!(s, "  graph model (file v2), {} nodes:", g.nodes.len());
            for (i, n) in g.nodes.iter().enumerate() {
                let reads: Vec<String> = n.inputs.iter().map(|j| j.to_string()).collect();
                let what = match &n.op {
                    Op::Input { offset } => format!("Input columns {offset}..{}", offset + n.width),
                    Op::Dense { layer, act: Act::None } => format!("Dense {} -> {}", layer.in_dim, layer.out_dim),
                    Op::Dense { layer, act } => format!("Dense {} -> {}, {}", layer.in_dim, layer.out_dim, act.name()),
                    Op::Act(a) => a.name(),
                    Op::Embedding { rows, dim, .. } => format!("Embedding {rows} x {dim}"),
                    Op::Trees(e) => format!("Trees ({})", e.describe()),
                    op => op.name().to_string(),
                };
                let reads = if reads.is_empty() { String::new() } else { format!(" of {}", reads.join(", ")) };
                let _ = writeln!(s, "  node {i}: {what}{reads} (width {})", n.width);
            }
        } else if m.is_native() {
            let _ = writeln!(s, "  plain MLP (file v1): fused INT8 kernels, calibration available");
        }
        for r in &self.rewrites {
            let _ = writeln!(s, "  rewrite: {r}");
        }
        let tail = if self.sigmoid_dropped {
            "its Sigmoid is applied by the server"
        } else {
            "the server applies the sigmoid"
        };
        match m.output_kind() {
            OutputKind::Logit => {
                let _ = writeln!(s, "  output '{}': one logit; {tail}", self.output);
            }
            OutputKind::Raw if !m.is_native() => {
                let _ = writeln!(s, "  output '{}': returned as onnxruntime computes it", self.output);
            }
            OutputKind::Raw => {
                let _ = writeln!(s, "  output '{}': one raw value, returned as is", self.output);
            }
        }
        match (&m.onnx, m.is_native()) {
            (Some(o), true) => {
                let _ = writeln!(
                    s,
                    "  backend: native; the ONNX graph is kept ({} bytes) for backend = \"onnxruntime\"",
                    o.bytes.len()
                );
            }
            (Some(o), false) => {
                let _ = writeln!(
                    s,
                    "  backend: onnxruntime (the graph is kept whole, {} bytes; output column {})",
                    o.bytes.len(),
                    o.output_column
                );
            }
            (None, _) => {
                let _ = writeln!(s, "  backend: native");
            }
        }
        if m.is_native() {
            let _ = write!(s, "  MACs per row: {}", self.macs_per_row());
        } else {
            let _ = write!(s, "  MACs per row: not known (onnxruntime runs the graph)");
        }
        s
    }
}

/// Reads, decodes and imports an ONNX file.
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    import_file_keeping(path, opts, KeepOnnx::No)
}

/// `import_file`, keeping the graph for onnxruntime as `keep` says.
pub fn import_file_keeping(path: &Path, opts: &ImportOptions, keep: KeepOnnx) -> Result<Imported, OnnxError> {
    let p = path.display().to_string();
    let io = |source| OnnxError::Io { path: p.clone(), source };
    let bytes_len = std::fs::metadata(path).map_err(io)?.len();
    if bytes_len > MODEL_HEAP_BYTES_MAX as u64 {
        return Err(OnnxError::TooLarge { path: p, bytes: bytes_len });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    let mut opts = opts.clone();
    if opts.base_dir.is_none() {
        opts.base_dir = Some(path.parent().map_or_else(|| Path::new(".").to_path_buf(), Path::to_path_buf));
    }
    import_bytes_keeping(&bytes, &p, &opts, keep)
}

/// Decodes and imports ONNX bytes; `path_for_errors` names them in errors.
pub fn import_bytes(bytes: &[u8], path_for_errors: &str, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    import_bytes_keeping(bytes, path_for_errors, opts, KeepOnnx::No)
}

/// `import_bytes`, keeping the graph for onnxruntime as `keep` says.
pub fn import_bytes_keeping(
    bytes: &[u8],
    path_for_errors: &str,
    opts: &ImportOptions,
    keep: KeepOnnx,
) -> Result<Imported, OnnxError> {
    let decode_err = |detail: String| OnnxError::Decode { path: path_for_errors.into(), detail };
    // The decoder's runtime recurses without bound on nested groups
    // (RUSTSEC-2024-0437); see wire.rs for why this walk rules that out.
    wire::check(bytes).map_err(decode_err)?;
    let proto = ModelProto::parse_from_bytes(bytes).map_err(|e| decode_err(e.to_string()))?;
    let Some(graph) = proto.graph.as_ref() else {
        return Err(OnnxError::NoGraph { path: path_for_errors.into() });
    };
    let mut imported = match keep {
        KeepOnnx::No => import_graph(graph, opts)?,
        KeepOnnx::Beside => {
            let mut imported = import_graph(graph, opts)?;
            imported.model.onnx = Some(keep::beside(&proto, opts, &imported)?);
            imported.model.validate()?;
            imported
        }
        KeepOnnx::Only { output_kind } => keep::only(&proto, opts, output_kind)?,
    };
    imported.producer = if proto.producer_name.is_empty() {
        "an unnamed producer".into()
    } else {
        format!("{} {}", proto.producer_name, proto.producer_version).trim_end().to_string()
    };
    Ok(imported)
}

fn node_name(node: &NodeProto) -> String {
    if node.name.is_empty() {
        format!("<unnamed {} -> {}>", node.op_type, node.output.join(","))
    } else {
        node.name.clone()
    }
}

fn node_err(node: &NodeProto, what: impl Into<String>) -> OnnxError {
    OnnxError::Node { node: node_name(node), op: node.op_type.clone(), what: what.into() }
}

fn attr<'n>(node: &'n NodeProto, name: &str) -> Option<&'n AttributeProto> {
    node.attribute.iter().find(|a| a.name == name)
}

fn attr_kind_ok(a: &AttributeProto, kind: AttributeType) -> bool {
    matches!(a.type_.enum_value(), Ok(k) if k == kind || k == AttributeType::UNDEFINED)
}

fn attr_int(node: &NodeProto, name: &str, default: Option<i64>) -> Result<i64, OnnxError> {
    match attr(node, name) {
        Some(a) if attr_kind_ok(a, AttributeType::INT) => Ok(a.i),
        Some(_) => Err(node_err(node, format!("attribute '{name}' is not an integer"))),
        None => default.ok_or_else(|| node_err(node, format!("attribute '{name}' is missing"))),
    }
}

fn attr_float(node: &NodeProto, name: &str, default: f32) -> Result<f32, OnnxError> {
    match attr(node, name) {
        Some(a) if attr_kind_ok(a, AttributeType::FLOAT) => Ok(a.f),
        Some(_) => Err(node_err(node, format!("attribute '{name}' is not a float"))),
        None => Ok(default),
    }
}

fn dtype_name(code: i32) -> String {
    match tensor_proto::DataType::from_i32(code) {
        Some(t) => format!("{t:?}"),
        None => format!("unknown type {code}"),
    }
}

/// Dimensions of a constant, checked to be non-negative and to fit memory:
/// as many floats as the largest embedding table (values are only ever
/// read from data the file or its external data holds, never made up to
/// fill dimensions; the graph's own limits apply after import).
fn tensor_dims(t: &TensorProto) -> Result<(Vec<usize>, usize), OnnxError> {
    let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
    let mut dims = Vec::with_capacity(t.dims.len());
    let mut numel = 1usize;
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| bad(format!("negative dimension in {:?}", t.dims)))?;
        numel = numel
            .checked_mul(d)
            .filter(|n| *n <= super::graph::EMBEDDING_FLOATS_MAX)
            .ok_or_else(|| bad(format!("dimensions {:?} are too large", t.dims)))?;
        dims.push(d);
    }
    if t.data_location.enum_value() == Ok(tensor_proto::DataLocation::EXTERNAL) {
        return Err(bad("stored in an external data file, which is not supported".into()));
    }
    Ok((dims, numel))
}

/// The number of elements of `dims`, or `None` when it overflows.
fn numel(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d))
}

/// A float constant's dimensions and values (from `raw_data` or `float_data`).
fn tensor_f32(t: &TensorProto) -> Result<(Vec<usize>, Vec<f32>), OnnxError> {
    let (dims, numel) = tensor_dims(t)?;
    let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
    if t.data_type != DT_FLOAT {
        return Err(bad(format!(
            "element type {} is not supported; weights must be FLOAT (float32)",
            dtype_name(t.data_type)
        )));
    }
    let values: Vec<f32> = if t.raw_data.is_empty() {
        t.float_data.clone()
    } else {
        t.raw_data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let stored = if t.raw_data.is_empty() { values.len() } else { t.raw_data.len() / 4 };
    if stored != numel || !t.raw_data.len().is_multiple_of(4) {
        return Err(bad(format!("holds {stored} values but its dimensions {dims:?} need {numel}")));
    }
    Ok((dims, values))
}

fn tensor_i64(t: &TensorProto) -> Result<Vec<i64>, OnnxError> {
    let (dims, numel) = tensor_dims(t)?;
    let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
    if t.data_type != DT_INT64 {
        return Err(bad(format!("element type {} where INT64 is needed", dtype_name(t.data_type))));
    }
    let values: Vec<i64> = if t.raw_data.is_empty() {
        t.int64_data.clone()
    } else {
        t.raw_data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("chunks of 8"))).collect()
    };
    if values.len() != numel || !t.raw_data.len().is_multiple_of(8) {
        return Err(bad(format!("holds {} values but its dimensions {dims:?} need {numel}", values.len())));
    }
    Ok(values)
}

/// Width of a `[batch, width]` float graph input.
/// Width of a `[batch, width]` graph input, and whether it holds integers
/// (INT64 or INT32: categorical ids, mapped to `context_ids`).
fn input_width(vi: &ValueInfoProto) -> Result<(usize, bool), OnnxError> {
    let bad = |what: &str| OnnxError::Input { input: vi.name.clone(), what: what.into() };
    let Some(type_proto::Value::TensorType(t)) = vi.type_.as_ref().and_then(|t| t.value.as_ref()) else {
        return Err(bad("is not a tensor"));
    };
    let ints = t.elem_type == DT_INT64 || t.elem_type == DT_INT32;
    if t.elem_type != DT_FLOAT && !ints {
        return Err(OnnxError::Input {
            input: vi.name.clone(),
            what: format!(
                "has element type {}; only FLOAT (float32) inputs, and INT64 or INT32 ids, are supported",
                dtype_name(t.elem_type)
            ),
        });
    }
    let Some(shape) = t.shape.as_ref() else {
        return Err(bad("has no shape; expected [batch, width]"));
    };
    if shape.dim.len() != 2 {
        return Err(OnnxError::Input {
            input: vi.name.clone(),
            what: format!("has rank {}; expected [batch, width]", shape.dim.len()),
        });
    }
    let w = &shape.dim[1];
    if !w.has_dim_value() || w.dim_value() <= 0 {
        return Err(bad("has an unknown or zero width; expected [batch, width] with a fixed width"));
    }
    let width = usize::try_from(w.dim_value()).map_err(|_| bad("width does not fit"))?;
    Ok((width, ints))
}

/// Picks the tensor to reproduce.
fn select_output(graph: &GraphProto, opts: &ImportOptions) -> Result<String, OnnxError> {
    if let Some(o) = &opts.output {
        return Ok(o.clone());
    }
    match graph.output.as_slice() {
        [one] => Ok(one.name.clone()),
        outs => {
            let names: Vec<&str> = outs.iter().map(|o| o.name.as_str()).collect();
            let sigmoids: Vec<&str> = graph
                .node
                .iter()
                .filter(|n| n.op_type == "Sigmoid")
                .flat_map(|n| n.output.iter().map(String::as_str))
                .collect();
            let hint = if sigmoids.is_empty() {
                String::new()
            } else {
                format!(" (Sigmoid outputs in this graph: {})", sigmoids.join(", "))
            };
            Err(OnnxError::Output {
                what: format!(
                    "the graph has {} outputs ({}); exactly one is needed, or pass --output with the tensor \
                     that holds the logit or the positive-class probability{hint}",
                    outs.len(),
                    names.join(", ")
                ),
            })
        }
    }
}

/// Assigns `--inputs` entries to the graph inputs; returns each input's
/// segments, in column order.
fn resolve_mapping(
    inputs: &[&ValueInfoProto],
    widths: &[usize],
    mapping: &InputMapping,
) -> Result<Vec<Vec<InputSegment>>, OnnxError> {
    let bad = |what: String| OnnxError::Mapping { what };
    let described: Vec<String> =
        inputs.iter().zip(widths).map(|(vi, w)| format!("'{}' [batch, {w}]", vi.name)).collect();
    let described = described.join(", ");
    let mut segments: Vec<Vec<InputSegment>> = vec![Vec::new(); inputs.len()];
    let seg = |e: &MappingEntry| InputSegment { source: e.source, dim: e.dim };
    let named = mapping.entries.iter().all(|e| e.graph_input.is_some());
    if named {
        for e in &mapping.entries {
            let name = e.graph_input.as_deref().expect("all entries are named");
            let i = inputs
                .iter()
                .position(|vi| vi.name == name)
                .ok_or_else(|| bad(format!("the graph has no input '{name}'; its inputs are {described}")))?;
            segments[i].push(seg(e));
        }
    } else if inputs.len() == 1 {
        segments[0] = mapping.entries.iter().map(seg).collect();
    } else if mapping.entries.len() != inputs.len() {
        return Err(bad(format!(
            "{} entries for {} graph inputs ({described}); give one entry per input, in this order",
            mapping.entries.len(),
            inputs.len()
        )));
    } else {
        for (s, e) in segments.iter_mut().zip(&mapping.entries) {
            s.push(seg(e));
        }
    }
    for ((vi, &w), segs) in inputs.iter().zip(widths).zip(&segments) {
        if segs.is_empty() {
            return Err(bad(format!("graph input '{}' is not mapped; its inputs are {described}", vi.name)));
        }
        let total: usize = segs.iter().map(|s| s.dim).sum();
        if total != w {
            let parts: Vec<String> = segs.iter().map(|s| format!("{}:{}", source_name(s.source), s.dim)).collect();
            return Err(bad(format!(
                "graph input '{}' is {w} wide but is mapped to {} = {total}",
                vi.name,
                parts.join(" + ")
            )));
        }
    }
    Ok(segments)
}

/// A tensor the interpreter computes: a graph node, the per-row shape it
/// has in ONNX (`[width]` for `[batch, width]`; `[k, d]` for an embedding
/// gather), and whether it was cast to an integer type (embedding indices).
#[derive(Clone, Debug)]
struct Val {
    node: usize,
    dims: Vec<usize>,
    ints: bool,
}

enum Operand<'g> {
    Val(Val),
    Const(&'g TensorProto),
}

/// The graph under construction: nodes in topological order, the ONNX
/// tensors bound to them, and the constants.
struct Builder<'g> {
    nodes: Vec<GNode>,
    vals: HashMap<String, Val>,
    consts: HashMap<&'g str, &'g TensorProto>,
    notes: Vec<String>,
}

impl<'g> Builder<'g> {
    fn operand(&self, node: &NodeProto, name: &str) -> Result<Operand<'g>, OnnxError> {
        if let Some(v) = self.vals.get(name) {
            return Ok(Operand::Val(v.clone()));
        }
        if let Some(t) = self.consts.get(name) {
            return Ok(Operand::Const(t));
        }
        Err(node_err(
            node,
            format!("tensor '{name}' is not produced by an earlier node, an initializer or a graph input"),
        ))
    }

    fn push(&mut self, op: Op, inputs: Vec<usize>, width: usize) -> usize {
        self.nodes.push(GNode { op, inputs, width });
        self.nodes.len() - 1
    }

    fn flat(&mut self, op: Op, inputs: Vec<usize>, width: usize) -> Val {
        Val { node: self.push(op, inputs, width), dims: vec![width], ints: false }
    }

    fn width(&self, v: &Val) -> usize {
        self.nodes[v.node].width
    }
}

fn expect_val(node: &NodeProto, op: Operand<'_>, role: &str) -> Result<Val, OnnxError> {
    match op {
        Operand::Val(v) => Ok(v),
        Operand::Const(t) => Err(node_err(
            node,
            format!("the {role} '{}' is a constant; it must be computed from the graph inputs", t.name),
        )),
    }
}

fn expect_const<'g>(node: &NodeProto, op: Operand<'g>, role: &str) -> Result<&'g TensorProto, OnnxError> {
    match op {
        Operand::Const(t) => Ok(t),
        Operand::Val(_) => Err(node_err(
            node,
            format!("the {role} must be an initializer or a Constant, not computed from the inputs"),
        )),
    }
}

/// A `[batch, width]` tensor, or an error naming its shape.
fn expect_flat(node: &NodeProto, v: &Val) -> Result<usize, OnnxError> {
    match v.dims[..] {
        [w] => Ok(w),
        _ => {
            Err(node_err(node, format!("reads a [batch, {:?}] tensor; only [batch, width] is supported here", v.dims)))
        }
    }
}

fn operands<'g>(
    b: &Builder<'g>,
    node: &NodeProto,
    n: std::ops::RangeInclusive<usize>,
) -> Result<Vec<Operand<'g>>, OnnxError> {
    let count = node.input.len();
    if !n.contains(&count) {
        return Err(node_err(node, format!("has {count} inputs; {}..={} expected", n.start(), n.end())));
    }
    node.input.iter().filter(|s| !s.is_empty()).map(|s| b.operand(node, s)).collect()
}

/// A float constant broadcast to `width` values: a scalar, or exactly
/// `width` values (`[w]` or `[1, w]`).
/// How many values constant `t` holds when it is a vector (`[w]` or
/// `[1, w]`); 1 for anything else, which `const_vec` then judges.
fn const_width(t: &TensorProto) -> usize {
    match t.dims[..] {
        [w] | [1, w] => usize::try_from(w).unwrap_or(1).max(1),
        _ => 1,
    }
}

fn const_vec(node: &NodeProto, t: &TensorProto, width: usize) -> Result<Vec<f32>, OnnxError> {
    let (dims, values) = tensor_f32(t)?;
    if values.len() == 1 && dims.iter().all(|d| *d == 1) {
        return Ok(vec![values[0]; width]);
    }
    if matches!(dims[..], [x] | [1, x] if x == width) {
        return Ok(values);
    }
    Err(node_err(
        node,
        format!("constant '{}' has shape {dims:?}; a scalar, [{width}] or [1, {width}] expected", t.name),
    ))
}

fn attr_floats(node: &NodeProto, name: &str) -> Vec<f32> {
    attr(node, name).map(|a| a.floats.clone()).unwrap_or_default()
}

fn attr_string(node: &NodeProto, name: &str) -> Option<String> {
    attr(node, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

fn attr_ints(node: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(node, name).map(|a| a.ints.clone())
}

/// The affine node `(x − center) · scale + shift` over `v`.
fn affine(b: &mut Builder<'_>, v: &Val, center: Vec<f32>, scale: Vec<f32>, shift: Vec<f32>) -> Val {
    let w = b.width(v);
    let node = b.push(Op::Affine { center, scale, shift }, vec![v.node], w);
    Val { node, dims: v.dims.clone(), ints: false }
}

/// A dense node from row-major `[out][in]` f32 weights.
fn dense(b: &mut Builder<'_>, v: &Val, k: usize, n: usize, weights: Vec<f32>, bias: Vec<f32>) -> Val {
    let layer = Layer::quantize(k, n, false, weights, bias);
    b.flat(Op::Dense { layer, act: Act::None }, vec![v.node], n)
}

/// The two-class probability tensor `[1 − p, p]` for the positive-class
/// probability node `p`, as classifiers output it; the output selection
/// takes column 1 back out.
fn two_class(b: &mut Builder<'_>, p: Val) -> Val {
    let neg = affine(b, &p, vec![0.0], vec![-1.0], vec![1.0]);
    b.flat(Op::Concat, vec![neg.node, p.node], 2)
}

/// The erf form of GELU is written out node by node by exporters; `Gelu`
/// (opset 20) names it.
fn act_node(b: &mut Builder<'_>, node: &NodeProto, x: Val, act: Act) -> Result<Val, OnnxError> {
    if let Act::LeakyRelu(a) = act {
        if !a.is_finite() {
            return Err(node_err(node, format!("alpha {a} is not finite")));
        }
    }
    let w = b.width(&x);
    let n = b.push(Op::Act(act), vec![x.node], w);
    Ok(Val { node: n, dims: x.dims, ints: false })
}

/// Applies one node.
fn apply<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<(), OnnxError> {
    let op = node.op_type.as_str();
    let ml = node.domain == "ai.onnx.ml";
    if !(node.domain.is_empty() || node.domain == "ai.onnx" || ml) {
        return Err(OnnxError::UnsupportedOp {
            op: format!("{}::{op}", node.domain),
            node: node_name(node),
            hint: String::new(),
        });
    }
    if ml {
        return apply_ml(b, node);
    }
    if op == "Constant" {
        let t = attr(node, "value")
            .and_then(|a| a.t.as_ref())
            .ok_or_else(|| node_err(node, "only a Constant with a tensor 'value' attribute is supported"))?;
        b.consts.insert(node.output[0].as_str(), t);
        return Ok(());
    }
    const HANDLED: [&str; 29] = [
        "Identity",
        "Dropout",
        "Cast",
        "Flatten",
        "Reshape",
        "Concat",
        "MatMul",
        "Gemm",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "LeakyRelu",
        "Tanh",
        "Sigmoid",
        "Erf",
        "Gelu",
        "Sqrt",
        "Pow",
        "Neg",
        "Reciprocal",
        "BatchNormalization",
        "LayerNormalization",
        "Softmax",
        "ReduceSum",
        "ReduceMean",
        "Slice",
        "Gather",
    ];
    if !HANDLED.contains(&op) {
        return Err(unsupported(node));
    }
    // Dropout's mask and LayerNormalization's statistics are extra outputs
    // nothing in an inference graph reads; reading them fails as unbound.
    let extra_ok = matches!(op, "Dropout" | "LayerNormalization" | "BatchNormalization");
    if node.output.is_empty() || (node.output.len() > 1 && !extra_ok) {
        return Err(node_err(node, format!("has {} outputs; one expected", node.output.len())));
    }
    let out = node.output[0].clone();
    let result: Val = match op {
        "Identity" => expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?,
        "Dropout" => {
            let mut ops = operands(b, node, 1..=3)?;
            if node.input.len() == 3 && !node.input[2].is_empty() {
                let t = expect_const(node, ops.remove(2), "training_mode")?;
                let on = tensor_bool(t)?;
                if on {
                    return Err(node_err(node, "training_mode is true; export the model in eval mode"));
                }
            }
            b.notes.push(format!("removed Dropout '{}' (inference is the identity)", node_name(node)));
            expect_val(node, ops.remove(0), "input")?
        }
        "Cast" => {
            let to = attr_int(node, "to", None)?;
            let mut v = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            match to as i32 {
                DT_FLOAT => {}
                // Indices for Gather: the values stay floats here, and the
                // embedding reads them as integers (or takes its default row).
                DT_INT64 | DT_INT32 => v.ints = true,
                other => {
                    return Err(node_err(
                        node,
                        format!("casts to {}; only casts to FLOAT, INT64 or INT32 are supported", dtype_name(other)),
                    ))
                }
            }
            v
        }
        "Flatten" => {
            let axis = attr_int(node, "axis", Some(1))?;
            let mut v = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            if axis != 1 && !(axis == -1 && v.dims.len() == 1) {
                return Err(node_err(node, format!("axis {axis}; only axis 1 (keep the batch) is supported")));
            }
            let total = numel(&v.dims).ok_or_else(|| node_err(node, format!("flattens {:?}, too large", v.dims)))?;
            v.dims = vec![total];
            v
        }
        "Reshape" => {
            let mut ops = operands(b, node, 2..=2)?;
            let shape = tensor_i64(expect_const(node, ops.remove(1), "shape")?)?;
            let mut v = expect_val(node, ops.remove(0), "data input")?;
            let total = numel(&v.dims).ok_or_else(|| node_err(node, format!("reshapes {:?}, too large", v.dims)))?;
            let shown =
                if v.dims.len() == 1 { format!("[batch, {}]", total) } else { format!("[batch, {:?}]", v.dims) };
            let refuse = || {
                node_err(
                    node,
                    format!(
                        "reshapes {shown} to {shape:?}; only a reshape that keeps the batch dimension is supported"
                    ),
                )
            };
            let Some((&first, rest)) = shape.split_first() else { return Err(refuse()) };
            if first != -1 && first != 0 {
                return Err(refuse());
            }
            let mut dims = Vec::with_capacity(rest.len());
            let mut infer = None;
            for (i, &d) in rest.iter().enumerate() {
                match d {
                    0 => dims.push(*v.dims.get(i).ok_or_else(refuse)?),
                    -1 if infer.is_none() && first == 0 => {
                        infer = Some(i);
                        dims.push(1);
                    }
                    d if d > 0 => dims.push(usize::try_from(d).map_err(|_| refuse())?),
                    _ => return Err(refuse()),
                }
            }
            // Products of the file's dimensions are checked: wrapped, a
            // shape such as [16, 2^60 + 1] would pass for 16 values.
            let known = numel(&dims).ok_or_else(refuse)?;
            if let Some(i) = infer {
                if known == 0 || !total.is_multiple_of(known) {
                    return Err(refuse());
                }
                dims[i] = total / known;
            }
            if dims.is_empty() || numel(&dims) != Some(total) {
                return Err(refuse());
            }
            v.dims = dims;
            v
        }
        "Concat" => {
            let axis = attr_int(node, "axis", None)?;
            let ops = operands(b, node, 1..=node.input.len().max(1))?;
            let mut inputs = Vec::new();
            let mut width = 0;
            for o in ops {
                let v = expect_val(node, o, "input")?;
                width += expect_flat(node, &v)?;
                inputs.push(v.node);
            }
            if axis != 1 && axis != -1 {
                return Err(node_err(node, format!("axis {axis}; only the feature axis (1) is supported")));
            }
            b.flat(Op::Concat, inputs, width)
        }
        "MatMul" => {
            let mut ops = operands(b, node, 2..=2)?;
            if matches!(ops[0], Operand::Const(_)) {
                return Err(node_err(node, "the weight is the first operand; only activation x weight is supported"));
            }
            let w = expect_const(node, ops.remove(1), "weight")?;
            let v = expect_val(node, ops.remove(0), "input")?;
            let width = expect_flat(node, &v)?;
            let (dims, values) = tensor_f32(w)?;
            let [k, n] = dims[..] else {
                return Err(node_err(node, format!("weight '{}' has shape {dims:?}; [in, out] expected", w.name)));
            };
            if k != width {
                return Err(node_err(node, format!("weight '{}' is [{k}, {n}] but its input is {width} wide", w.name)));
            }
            let mut weights = vec![0.0f32; k * n];
            for (r, row) in values.chunks_exact(n.max(1)).enumerate() {
                for (o, x) in row.iter().enumerate() {
                    weights[o * k + r] = *x;
                }
            }
            dense(b, &v, k, n, weights, vec![0.0; n])
        }
        "Gemm" => gemm(b, node)?,
        "Add" | "Sub" | "Mul" | "Div" => binary(b, node)?,
        // tf2onnx writes Keras's LayerNormalization with these (the mean's
        // negation, the reciprocal of the standard deviation).
        "Neg" => {
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            affine(b, &x, vec![0.0; w], vec![-1.0; w], vec![0.0; w])
        }
        "Reciprocal" => {
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            let ones = affine(b, &x, vec![0.0; w], vec![0.0; w], vec![1.0; w]);
            b.flat(Op::Div, vec![ones.node, x.node], w)
        }
        "Pow" => {
            let mut ops = operands(b, node, 2..=2)?;
            let e = expect_const(node, ops.remove(1), "exponent")?;
            let x = expect_val(node, ops.remove(0), "base")?;
            let w = expect_flat(node, &x)?;
            let (_, e) = tensor_f32(e)?;
            match e[..] {
                [2.0] => b.flat(Op::Mul, vec![x.node, x.node], w),
                // The cube of the tanh-form GELU as Keras writes it.
                [3.0] => {
                    let square = b.flat(Op::Mul, vec![x.node, x.node], w);
                    b.flat(Op::Mul, vec![square.node, x.node], w)
                }
                [0.5] => act_node(b, node, x, Act::Sqrt)?,
                [1.0] => x,
                _ => return Err(node_err(node, format!("exponent {e:?}; only 3, 2, 1 and 0.5 are supported"))),
            }
        }
        "Relu" | "LeakyRelu" | "Tanh" | "Sigmoid" | "Erf" | "Gelu" | "Sqrt" => {
            let act = match op {
                "Relu" => Act::Relu,
                "LeakyRelu" => Act::LeakyRelu(attr_float(node, "alpha", 0.01)?),
                "Tanh" => Act::Tanh,
                "Sigmoid" => Act::Sigmoid,
                "Erf" => Act::Erf,
                "Sqrt" => Act::Sqrt,
                _ => match attr_string(node, "approximate").as_deref() {
                    None | Some("none") => Act::GeluErf,
                    Some("tanh") => Act::GeluTanh,
                    Some(other) => return Err(node_err(node, format!("approximate = '{other}' is not known"))),
                },
            };
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            act_node(b, node, x, act)?
        }
        "BatchNormalization" => {
            if attr_int(node, "training_mode", Some(0))? != 0 || node.output.len() > 1 {
                return Err(node_err(node, "runs in training mode; export the model in eval mode"));
            }
            let mut ops = operands(b, node, 5..=5)?;
            let var = expect_const(node, ops.remove(4), "running variance")?;
            let mean = expect_const(node, ops.remove(3), "running mean")?;
            let beta = expect_const(node, ops.remove(2), "bias")?;
            let gamma = expect_const(node, ops.remove(1), "scale")?;
            let x = expect_val(node, ops.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            let eps = attr_float(node, "epsilon", 1e-5)?;
            let (gamma, beta) = (const_vec(node, gamma, w)?, const_vec(node, beta, w)?);
            let (mean, var) = (const_vec(node, mean, w)?, const_vec(node, var, w)?);
            let scale = gamma.iter().zip(&var).map(|(g, v)| g / (v + eps).sqrt()).collect();
            affine(b, &x, mean, scale, beta)
        }
        "LayerNormalization" => {
            let axis = attr_int(node, "axis", Some(-1))?;
            let mut ops = operands(b, node, 2..=3)?;
            let beta = if ops.len() == 3 { Some(expect_const(node, ops.remove(2), "bias B")?) } else { None };
            let gamma = expect_const(node, ops.remove(1), "scale")?;
            let x = expect_val(node, ops.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            if axis != -1 && axis != 1 {
                return Err(node_err(node, format!("axis {axis}; only the feature axis is supported")));
            }
            let epsilon = attr_float(node, "epsilon", 1e-5)?;
            let scale = const_vec(node, gamma, w)?;
            let shift = match beta {
                Some(t) => const_vec(node, t, w)?,
                None => vec![0.0; w],
            };
            b.flat(Op::LayerNorm { epsilon, scale, shift }, vec![x.node], w)
        }
        "Softmax" => {
            let axis = attr_int(node, "axis", Some(-1))?;
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            if (axis != -1 && axis != 1) || w != 2 {
                return Err(node_err(
                    node,
                    format!("is a Softmax over {w} values (axis {axis}); only a two-class head is supported"),
                ));
            }
            // softmax([z0, z1])[1] = sigmoid(z1 - z0): one dense row of weight
            // differences when z comes from a dense layer.
            let Op::Dense { layer, act: Act::None } = &b.nodes[x.node].op else {
                return Err(node_err(
                    node,
                    "follows something other than a dense layer; a two-class Softmax must read one",
                ));
            };
            let k = layer.in_dim;
            let weights: Vec<f32> = (0..k).map(|i| layer.weights_f32[k + i] - layer.weights_f32[i]).collect();
            let bias = vec![layer.bias[1] - layer.bias[0]];
            let src = Val { node: b.nodes[x.node].inputs[0], dims: vec![k], ints: false };
            let z = dense(b, &src, k, 1, weights, bias);
            let p = act_node(b, node, z, Act::Sigmoid)?;
            b.notes.push(format!("two-class Softmax '{}' as the sigmoid of the logit difference", node_name(node)));
            two_class(b, p)
        }
        "ReduceSum" | "ReduceMean" => {
            let mut ops = operands(b, node, 1..=2)?;
            let axes = if ops.len() == 2 {
                tensor_i64(expect_const(node, ops.remove(1), "axes")?)?
            } else {
                attr_ints(node, "axes").unwrap_or_default()
            };
            let x = expect_val(node, ops.remove(0), "input")?;
            expect_flat(node, &x)?;
            if axes != [1] && axes != [-1] {
                return Err(node_err(
                    node,
                    format!("axes {axes:?}; only a sum over the feature axis (1) is supported"),
                ));
            }
            // keepdims or not, the row sum is one value per candidate.
            let sum = b.flat(Op::Sum, vec![x.node], 1);
            if op == "ReduceMean" {
                let n = b.width(&x) as f32;
                affine(b, &sum, vec![0.0], vec![1.0 / n], vec![0.0])
            } else {
                sum
            }
        }
        "Slice" => {
            let mut ops = operands(b, node, 3..=5)?;
            let consts: Vec<Vec<i64>> = ops
                .drain(1..)
                .map(|o| expect_const(node, o, "starts, ends, axes and steps").and_then(tensor_i64))
                .collect::<Result<_, _>>()?;
            let x = expect_val(node, ops.remove(0), "data input")?;
            let w = expect_flat(node, &x)?;
            let (starts, ends) = (&consts[0], &consts[1]);
            let axes = consts.get(2).cloned().unwrap_or_else(|| vec![1]);
            let steps = consts.get(3).cloned().unwrap_or_else(|| vec![1]);
            if starts.len() != 1 || ends.len() != 1 || (axes != [1] && axes != [-1]) || steps != [1] {
                return Err(node_err(node, "only a slice of the feature axis with step 1 is supported"));
            }
            let clamp = |v: i64| if v < 0 { (w as i64 + v).max(0) as usize } else { (v as usize).min(w) };
            let (start, end) = (clamp(starts[0]), clamp(ends[0]));
            if start >= end {
                return Err(node_err(node, format!("selects columns {start}..{end}, which is empty")));
            }
            let Op::Input { offset } = b.nodes[x.node].op else {
                return Err(node_err(node, "slices a computed tensor; only slices of a graph input are supported"));
            };
            b.flat(Op::Input { offset: offset + start }, vec![], end - start)
        }
        "Gather" => {
            let axis = attr_int(node, "axis", Some(0))?;
            let mut ops = operands(b, node, 2..=2)?;
            let idx = expect_val(node, ops.remove(1), "indices")?;
            let table = expect_const(node, ops.remove(0), "data (the embedding table)")?;
            if axis != 0 {
                return Err(node_err(node, format!("axis {axis}; only row lookups (axis 0) are supported")));
            }
            if !idx.ints {
                return Err(node_err(node, "its indices do not come from a Cast to an integer type"));
            }
            let k = expect_flat(node, &idx)?;
            let (dims, values) = tensor_f32(table)?;
            let [rows, dim] = dims[..] else {
                return Err(node_err(node, format!("table '{}' has shape {dims:?}; [rows, dim] expected", table.name)));
            };
            let op = Op::Embedding { dim, rows, table: values.into(), default: vec![0.0; dim] };
            let n = b.push(op, vec![idx.node], k * dim);
            Val { node: n, dims: vec![k, dim], ints: false }
        }
        _ => return Err(unsupported(node)),
    };
    b.vals.insert(out, result);
    Ok(())
}

fn tensor_bool(t: &TensorProto) -> Result<bool, OnnxError> {
    let bad = || OnnxError::Initializer { name: t.name.clone(), what: "is not a boolean scalar".into() };
    let v =
        if !t.raw_data.is_empty() { t.raw_data.first().copied().map(i32::from) } else { t.int32_data.first().copied() };
    v.map(|x| x != 0).ok_or_else(bad)
}

/// `Add`, `Sub`, `Mul`, `Div` of two computed tensors (elementwise, the
/// second may be 1 wide) or of a tensor and a constant (an affine node).
fn binary(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let op = node.op_type.as_str();
    let ops = operands(b, node, 2..=2)?;
    let [p, q] = <[Operand<'_>; 2]>::try_from(ops).map_err(|_| node_err(node, "two inputs expected"))?;
    match (p, q) {
        (Operand::Val(x), Operand::Val(y)) => {
            let (wx, wy) = (expect_flat(node, &x)?, expect_flat(node, &y)?);
            let (x, y) = if wx == 1 && wy > 1 && (op == "Add" || op == "Mul") { (y, x) } else { (x, y) };
            if b.width(&x) == 1 && b.width(&y) > 1 {
                return Err(node_err(node, format!("{op} of a 1-wide tensor by a wider one is not supported")));
            }
            let (wx, wy) = (b.width(&x), b.width(&y));
            if wx != wy && wy != 1 {
                return Err(node_err(
                    node,
                    format!("its inputs are {wx} and {wy} wide; equal widths or a scalar expected"),
                ));
            }
            let gop = match op {
                "Add" => Op::Add,
                "Sub" => Op::Sub,
                "Mul" => Op::Mul,
                _ => Op::Div,
            };
            Ok(b.flat(gop, vec![x.node, y.node], wx))
        }
        (Operand::Val(x), Operand::Const(c)) | (Operand::Const(c), Operand::Val(x))
            if op == "Mul" && b.width(&x) == 1 && const_width(c) > 1 =>
        {
            // A 1-wide tensor times a vector (tf2onnx's LayerNormalization:
            // the reciprocal standard deviation times γ): the tensor repeated
            // to the vector's width, then scaled.
            let w = const_width(c);
            let c = const_vec(node, c, w)?;
            let wide = b.flat(Op::Concat, vec![x.node; w], w);
            Ok(affine(b, &wide, vec![0.0; w], c, vec![0.0; w]))
        }
        (Operand::Val(x), Operand::Const(c)) => {
            let w = expect_flat(node, &x)?;
            let c = const_vec(node, c, w)?;
            let zero = vec![0.0; w];
            let one = vec![1.0; w];
            // Exporters scale a classifier's probabilities by 1 (onnxmltools'
            // LightGBM converter): the identity keeps the tensor's shape
            // visible to the output selection.
            let identity = if matches!(op, "Mul" | "Div") { c == one } else { c == zero };
            if identity {
                b.notes.push(format!("removed {op} '{}' by an identity constant", node_name(node)));
                return Ok(x);
            }
            Ok(match op {
                "Add" => affine(b, &x, zero, one, c),
                "Sub" => affine(b, &x, c, one, zero),
                "Mul" => affine(b, &x, zero.clone(), c, zero),
                _ => {
                    if c.contains(&0.0) {
                        return Err(node_err(node, "divides by a constant that holds 0"));
                    }
                    let inv = c.iter().map(|v| 1.0 / v).collect();
                    affine(b, &x, zero.clone(), inv, zero)
                }
            })
        }
        (Operand::Const(c), Operand::Val(x)) => {
            let w = expect_flat(node, &x)?;
            let c = const_vec(node, c, w)?;
            let zero = vec![0.0; w];
            Ok(match op {
                "Add" => affine(b, &x, zero, vec![1.0; w], c),
                "Sub" => affine(b, &x, zero, vec![-1.0; w], c),
                "Mul" => affine(b, &x, zero.clone(), c, zero),
                _ => return Err(node_err(node, "divides a constant by a computed tensor, which is not supported")),
            })
        }
        (Operand::Const(_), Operand::Const(_)) => {
            Err(node_err(node, "combines two constants; fold them before export (onnx-simplifier does)"))
        }
    }
}

fn gemm(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let trans_a = attr_int(node, "transA", Some(0))?;
    let trans_b = attr_int(node, "transB", Some(0))?;
    let alpha = attr_float(node, "alpha", 1.0)?;
    let beta = attr_float(node, "beta", 1.0)?;
    if trans_a != 0 {
        return Err(node_err(node, "transA=1 is not supported; the input must be [batch, width]"));
    }
    if trans_b != 0 && trans_b != 1 {
        return Err(node_err(node, format!("transB={trans_b}; 0 or 1 expected")));
    }
    let mut ops = operands(b, node, 2..=3)?;
    let c = if ops.len() == 3 { Some(expect_const(node, ops.remove(2), "bias C")?) } else { None };
    if matches!(ops[0], Operand::Const(_)) {
        return Err(node_err(node, "A is a constant; only activation x weight is supported"));
    }
    let w = expect_const(node, ops.remove(1), "weight B")?;
    let v = expect_val(node, ops.remove(0), "input A")?;
    let width = expect_flat(node, &v)?;
    let (dims, values) = tensor_f32(w)?;
    let [r, s] = dims[..] else {
        return Err(node_err(node, format!("weight '{}' has shape {dims:?}; a matrix expected", w.name)));
    };
    let (k, n) = if trans_b == 1 { (s, r) } else { (r, s) };
    if k != width {
        return Err(node_err(
            node,
            format!(
                "weight '{}' is {dims:?} (transB={trans_b}), taking {k} inputs, but its input is {width} wide",
                w.name
            ),
        ));
    }
    let mut weights = vec![0.0f32; k * n];
    for o in 0..n {
        for i in 0..k {
            let x = if trans_b == 1 { values[o * k + i] } else { values[i * n + o] };
            weights[o * k + i] = alpha * x;
        }
    }
    let bias = match c {
        Some(c) => const_vec(node, c, n)?.into_iter().map(|y| beta * y).collect(),
        None => vec![0.0f32; n],
    };
    Ok(dense(b, &v, k, n, weights, bias))
}

/// The `ai.onnx.ml` ops scikit-learn pipelines export through skl2onnx.
fn apply_ml<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<(), OnnxError> {
    match node.op_type.as_str() {
        "Scaler" => {
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let w = expect_flat(node, &x)?;
            let broadcast = |v: Vec<f32>, what: &str| match v.len() {
                1 => Ok(vec![v[0]; w]),
                n if n == w => Ok(v),
                n => Err(node_err(node, format!("{what} has {n} values for {w} features"))),
            };
            let center = broadcast(attr_floats(node, "offset"), "offset")?;
            let scale = broadcast(attr_floats(node, "scale"), "scale")?;
            let v = affine(b, &x, center, scale, vec![0.0; w]);
            b.notes.push(format!("Scaler '{}' kept in f32 ahead of the first dense layer", node_name(node)));
            b.vals.insert(node.output[0].clone(), v);
            Ok(())
        }
        "LinearClassifier" | "LinearRegressor" => {
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let k = expect_flat(node, &x)?;
            let regressor = node.op_type == "LinearRegressor";
            let coef = attr_floats(node, "coefficients");
            let intercepts = attr_floats(node, "intercepts");
            let classes = coef.len().checked_div(k).unwrap_or(0);
            if classes == 0 || coef.len() != classes * k || !(intercepts.is_empty() || intercepts.len() == classes) {
                return Err(node_err(
                    node,
                    format!("has {} coefficients and {} intercepts for {k} features", coef.len(), intercepts.len()),
                ));
            }
            let intercept = |c: usize| intercepts.get(c).copied().unwrap_or(0.0);
            let post = attr_string(node, "post_transform").unwrap_or_else(|| "NONE".into());
            // The positive class's score: class 1 of two, or the only one.
            let (weights, bias) = match classes {
                1 => (coef.clone(), intercept(0)),
                2 if post == "SOFTMAX" => {
                    ((0..k).map(|i| coef[k + i] - coef[i]).collect(), intercept(1) - intercept(0))
                }
                2 => (coef[k..].to_vec(), intercept(1)),
                c => return Err(node_err(node, format!("has {c} classes; only binary classifiers are supported"))),
            };
            let z = dense(b, &x, k, 1, weights, vec![bias]);
            let out = if regressor {
                if post != "NONE" {
                    return Err(node_err(node, format!("post_transform {post} is not supported for a regressor")));
                }
                b.vals.insert(node.output[0].clone(), z);
                return Ok(());
            } else {
                match post.as_str() {
                    "LOGISTIC" | "SOFTMAX" => {
                        let p = act_node(b, node, z, Act::Sigmoid)?;
                        two_class(b, p)
                    }
                    "NONE" if classes == 1 => z,
                    other => {
                        return Err(node_err(node, format!("post_transform {other} is not supported")));
                    }
                }
            };
            b.notes.push(format!("{} '{}' as a dense layer", node.op_type, node_name(node)));
            // Output 0 is the label, output 1 the scores.
            if let Some(scores) = node.output.get(1) {
                b.vals.insert(scores.clone(), out);
            }
            Ok(())
        }
        "TreeEnsembleClassifier" | "TreeEnsembleRegressor" => {
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let k = expect_flat(node, &x)?;
            let out = tree_ensemble::apply(b, node, x, k)?;
            // A classifier's outputs are the label and the probabilities.
            let at = if node.op_type == "TreeEnsembleClassifier" { 1 } else { 0 };
            if let Some(name) = node.output.get(at) {
                b.vals.insert(name.clone(), out);
            }
            Ok(())
        }
        "Normalizer" => {
            // An L1 normalization of [1 - p, p] is the identity.
            let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
            let norm = attr_string(node, "norm").unwrap_or_default();
            let pair = matches!(b.nodes[x.node].op, Op::Concat) && b.nodes[x.node].width == 2;
            if norm != "L1" || !pair {
                return Err(node_err(node, "only the L1 normalization of a two-class probability pair is supported"));
            }
            b.vals.insert(node.output[0].clone(), x);
            Ok(())
        }
        _ => Err(OnnxError::UnsupportedOp {
            op: format!("ai.onnx.ml::{}", node.op_type),
            node: node_name(node),
            hint: String::new(),
        }),
    }
}

fn unsupported(node: &NodeProto) -> OnnxError {
    let hint = match node.op_type.as_str() {
        "Elu" | "Selu" | "PRelu" | "Softplus" | "HardSigmoid" => {
            " (graph activations: Relu, LeakyRelu, Tanh, Sigmoid, Erf, Gelu, Sqrt)"
        }
        "Softmax" => " (a Quiver model outputs one value; a two-class Softmax head is supported)",
        _ => "",
    };
    OnnxError::UnsupportedOp { op: node.op_type.clone(), node: node_name(node), hint: hint.into() }
}

/// Imports a decoded graph. External data (weights in a side file) is read
/// from `opts.base_dir`.
pub fn import_graph(graph: &GraphProto, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    let inlined;
    let graph = if graph.initializer.iter().any(is_external) {
        inlined = inline_external_data(graph, opts.base_dir.as_deref())?;
        &inlined
    } else {
        graph
    };
    let mut output = select_output(graph, opts)?;
    // A ZipMap turns class probabilities into a map for Python callers; the
    // tensor it reads is what the server reproduces.
    if let Some(zm) = graph.node.iter().find(|n| n.op_type == "ZipMap" && n.output.contains(&output)) {
        output = zm.input.first().cloned().unwrap_or_default();
    }

    // Only the nodes the chosen output depends on matter: exporters add label
    // and probability post-processing that the server does not need.
    let producer: HashMap<&str, usize> =
        graph.node.iter().enumerate().flat_map(|(i, n)| n.output.iter().map(move |o| (o.as_str(), i))).collect();
    let initializers: HashMap<&str, &TensorProto> = graph.initializer.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut needed = vec![false; graph.node.len()];
    let mut needed_tensors: HashSet<&str> = HashSet::new();
    let mut stack = vec![output.as_str()];
    while let Some(t) = stack.pop() {
        if !needed_tensors.insert(t) {
            continue;
        }
        if let Some(&i) = producer.get(t) {
            if !needed[i] {
                needed[i] = true;
                stack.extend(graph.node[i].input.iter().map(String::as_str).filter(|s| !s.is_empty()));
            }
        }
    }
    let feature_inputs: Vec<&ValueInfoProto> = graph
        .input
        .iter()
        .filter(|vi| !initializers.contains_key(vi.name.as_str()) && needed_tensors.contains(vi.name.as_str()))
        .collect();
    if !producer.contains_key(output.as_str()) {
        let what = if feature_inputs.iter().any(|vi| vi.name == output) {
            format!("'{output}' is a graph input, not computed by any layer")
        } else {
            let outs: Vec<&str> = graph.output.iter().map(|o| o.name.as_str()).collect();
            format!(
                "no node produces '{output}' (graph outputs: {})",
                if outs.is_empty() { "none".into() } else { outs.join(", ") }
            )
        };
        return Err(OnnxError::Output { what });
    }
    if feature_inputs.is_empty() {
        return Err(OnnxError::Output { what: format!("'{output}' does not depend on any graph input") });
    }
    let typed = feature_inputs.iter().map(|vi| input_width(vi)).collect::<Result<Vec<_>, _>>()?;
    let widths: Vec<usize> = typed.iter().map(|(w, _)| *w).collect();
    let segments = resolve_mapping(&feature_inputs, &widths, &opts.inputs)?;
    for ((vi, (_, ints)), segs) in feature_inputs.iter().zip(&typed).zip(&segments) {
        let ids = segs.iter().all(|s| s.source == Source::ContextIds);
        if *ints && !ids {
            return Err(OnnxError::Mapping {
                what: format!("graph input '{}' holds integers; map it to context_ids (categorical ids)", vi.name),
            });
        }
    }

    let mut b = Builder { nodes: Vec::new(), vals: HashMap::new(), consts: initializers, notes: Vec::new() };
    let mut offset = 0;
    for (vi, &(w, ints)) in feature_inputs.iter().zip(&typed) {
        let mut v = b.flat(Op::Input { offset }, vec![], w);
        v.ints = ints;
        b.vals.insert(vi.name.clone(), v);
        offset += w;
    }
    for (node, _) in graph.node.iter().zip(&needed).filter(|(_, n)| **n) {
        apply(&mut b, node)?;
    }

    let Some(out) = b.vals.get(&output).cloned() else {
        return Err(OnnxError::Output { what: format!("'{output}' is a constant, not computed from the inputs") });
    };
    let mut node = out.node;
    let width = b.nodes[node].width;
    let output_column = usize::from(width == 2);
    if width == 2 {
        // A two-class probability tensor: the positive class is column 1.
        match &b.nodes[node] {
            GNode { op: Op::Concat, inputs, .. } if inputs.len() == 2 && b.nodes[inputs[1]].width == 1 => {
                node = inputs[1];
            }
            _ => {
                return Err(OnnxError::Output {
                    what: format!("'{output}' is 2 wide but is not a two-class probability tensor [1 - p, p]"),
                })
            }
        }
    } else if width != 1 {
        return Err(OnnxError::Output {
            what: format!(
                "'{output}' is {width} wide; a Quiver model ends in one value per candidate (width 1), a Sigmoid \
                 of it, or a two-class probability tensor"
            ),
        });
    }
    let mut sigmoid_dropped = false;
    if opts.output_kind == OutputKind::Logit {
        if let GNode { op: Op::Act(Act::Sigmoid), inputs, .. } = &b.nodes[node] {
            node = inputs[0];
            sigmoid_dropped = true;
        }
    }
    if matches!(b.nodes[node].op, Op::Input { .. }) {
        return Err(OnnxError::Output { what: format!("'{output}' is not computed by any layer") });
    }
    // Nodes after the output cannot feed it.
    b.nodes.truncate(node + 1);
    let input_notes = std::mem::take(&mut b.notes);
    let (g, mut notes) = Graph { nodes: b.nodes, output: opts.output_kind }.simplify();
    notes.splice(0..0, input_notes);

    let (layout, model) = match as_chain(&g, &widths) {
        Some((order, layers)) => {
            let layout: Vec<(String, Vec<InputSegment>)> =
                order.iter().map(|&i| (feature_inputs[i].name.clone(), segments[i].clone())).collect();
            let model = Model {
                name: opts.name.clone(),
                version: opts.version,
                inputs: layout.iter().flat_map(|(_, s)| s.iter().copied()).collect(),
                layers,
                calibration: None,
                graph: None,
                onnx: None,
            };
            (layout, model)
        }
        None => {
            let layout: Vec<(String, Vec<InputSegment>)> =
                feature_inputs.iter().zip(&segments).map(|(vi, s)| (vi.name.clone(), s.clone())).collect();
            let model = Model {
                name: opts.name.clone(),
                version: opts.version,
                inputs: layout.iter().flat_map(|(_, s)| s.iter().copied()).collect(),
                layers: Vec::new(),
                calibration: None,
                graph: Some(g),
                onnx: None,
            };
            (layout, model)
        }
    };
    model.validate()?;
    Ok(Imported { model, output, sigmoid_dropped, output_column, layout, producer: String::new(), rewrites: notes })
}

/// The v1 MLP a graph is, if it is a plain chain: whole graph inputs
/// (concatenated, in the order returned) into dense layers with ReLU or
/// no activation, ending in a linear logit. Such models keep the fused
/// INT8 kernels and the static (calibrated) INT8 path.
fn as_chain(g: &Graph, widths: &[usize]) -> Option<(Vec<usize>, Vec<Layer>)> {
    if g.output != OutputKind::Logit {
        return None;
    }
    let offsets: Vec<usize> = widths.iter().scan(0, |at, w| Some(std::mem::replace(at, *at + w))).collect();
    let whole_input = |n: &GNode| match n.op {
        Op::Input { offset } => offsets.iter().zip(widths).position(|(o, w)| *o == offset && *w == n.width),
        _ => None,
    };
    let mut order = Vec::new();
    let mut i = 0;
    while i < g.nodes.len() {
        match whole_input(&g.nodes[i]) {
            Some(k) => order.push(k),
            None => break,
        }
        i += 1;
    }
    let inputs = i;
    if inputs != widths.len() || inputs == 0 {
        return None;
    }
    let mut prev = if inputs == 1 {
        0
    } else {
        let n = g.nodes.get(i)?;
        if !matches!(n.op, Op::Concat) || n.inputs.len() != inputs {
            return None;
        }
        order = n.inputs.iter().map(|&j| whole_input(&g.nodes[j])).collect::<Option<Vec<_>>>()?;
        i += 1;
        i - 1
    };
    let mut layers = Vec::new();
    for (j, n) in g.nodes.iter().enumerate().skip(i) {
        let Op::Dense { layer, act } = &n.op else { return None };
        if n.inputs != [prev] {
            return None;
        }
        let relu = match act {
            Act::None => false,
            Act::Relu => true,
            _ => return None,
        };
        layers.push(Layer { relu, ..layer.clone() });
        prev = j;
    }
    if layers.is_empty() || layers.last().is_some_and(|l| l.relu) {
        return None;
    }
    Some((order, layers))
}

/// Most bytes of external data all initializers may name together: no
/// more can end up in a model file (`MODEL_MAPPED_BYTES_MAX`).
pub const EXTERNAL_DATA_BYTES_MAX: u64 = super::MODEL_MAPPED_BYTES_MAX;

fn is_external(t: &TensorProto) -> bool {
    t.data_location.enum_value() == Ok(tensor_proto::DataLocation::EXTERNAL)
}

/// A copy of `graph` whose externally stored initializers hold their data
/// inline, read from files next to the model (`location` must be a plain
/// relative path inside `base_dir`).
fn inline_external_data(graph: &GraphProto, base_dir: Option<&Path>) -> Result<GraphProto, OnnxError> {
    let mut g = graph.clone();
    // Every range is checked and summed before any is read: initializers
    // may all name the same large file, and each within the per-tensor
    // bound could still add up to more memory than the machine has.
    let mut ranges = Vec::new();
    let mut total = 0u64;
    for (k, t) in g.initializer.iter().enumerate().filter(|(_, t)| is_external(t)) {
        let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
        let Some(base) = base_dir else {
            return Err(bad("is stored in an external data file; import the model from its file path".into()));
        };
        let entry = |key: &str| t.external_data.iter().find(|e| e.key == key).map(|e| e.value.clone());
        let location = entry("location").ok_or_else(|| bad("external data without a 'location'".into()))?;
        let rel = Path::new(&location);
        let plain = rel.components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain {
            return Err(bad(format!("external data location '{location}' is not a plain relative path")));
        }
        let number = |key: &str| -> Result<Option<u64>, OnnxError> {
            entry(key)
                .map(|v| v.parse::<u64>().map_err(|_| bad(format!("external data {key} '{v}' is not a number"))))
                .transpose()
        };
        let (offset, length) = (number("offset")?.unwrap_or(0), number("length")?);
        let path = base.join(rel);
        let io = |e: std::io::Error| bad(format!("external data file {}: {e}", path.display()));
        let size = std::fs::metadata(&path).map_err(io)?.len();
        let length = length.unwrap_or(size.saturating_sub(offset));
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(bad(format!(
                "external data {}: bytes {offset}..{} are outside its {size} bytes",
                path.display(),
                offset.saturating_add(length)
            )));
        }
        // Read whole into memory: as large as the largest embedding table.
        let bytes_max = 4 * super::graph::EMBEDDING_FLOATS_MAX as u64;
        if length > bytes_max {
            return Err(bad(format!("external data {}: {length} bytes; the limit is {bytes_max}", path.display())));
        }
        total = total.saturating_add(length);
        if total > EXTERNAL_DATA_BYTES_MAX {
            return Err(bad(format!(
                "the initializers' external data adds up to more than {EXTERNAL_DATA_BYTES_MAX} bytes \
                 (EXTERNAL_DATA_BYTES_MAX, the largest model file)"
            )));
        }
        ranges.push((k, path, offset, length));
    }
    for (k, path, offset, length) in ranges {
        let t = &mut g.initializer[k];
        let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
        let io = |e: std::io::Error| bad(format!("external data file {}: {e}", path.display()));
        use std::io::{Read as _, Seek as _};
        let mut f = std::fs::File::open(&path).map_err(io)?;
        f.seek(std::io::SeekFrom::Start(offset)).map_err(io)?;
        let mut data = vec![0u8; length as usize];
        f.read_exact(&mut data).map_err(io)?;
        t.raw_data = data;
        t.external_data.clear();
        t.data_location = tensor_proto::DataLocation::DEFAULT.into();
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::{tensor_shape_proto, TensorShapeProto, TypeProto};

    fn input(name: &str, width: i64) -> ValueInfoProto {
        let mut batch = tensor_shape_proto::Dimension::new();
        batch.set_dim_param("batch".into());
        let mut w = tensor_shape_proto::Dimension::new();
        w.set_dim_value(width);
        let mut shape = TensorShapeProto::new();
        shape.dim = vec![batch, w];
        let mut t = type_proto::Tensor::new();
        t.elem_type = DT_FLOAT;
        t.shape = Some(shape).into();
        let mut tp = TypeProto::new();
        tp.set_tensor_type(t);
        let mut vi = ValueInfoProto::new();
        vi.name = name.into();
        vi.type_ = Some(tp).into();
        vi
    }

    fn output(name: &str) -> ValueInfoProto {
        let mut vi = ValueInfoProto::new();
        vi.name = name.into();
        vi
    }

    fn weight(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
        let mut t = TensorProto::new();
        t.name = name.into();
        t.dims = dims.to_vec();
        t.data_type = DT_FLOAT;
        t.raw_data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        t
    }

    fn node(op: &str, name: &str, inputs: &[&str], out: &str) -> NodeProto {
        let mut n = NodeProto::new();
        n.op_type = op.into();
        n.name = name.into();
        n.input = inputs.iter().map(|s| s.to_string()).collect();
        n.output = vec![out.into()];
        n
    }

    fn with_int(mut n: NodeProto, name: &str, v: i64) -> NodeProto {
        let mut a = AttributeProto::new();
        a.name = name.into();
        a.type_ = AttributeType::INT.into();
        a.i = v;
        n.attribute.push(a);
        n
    }

    fn with_float(mut n: NodeProto, name: &str, v: f32) -> NodeProto {
        let mut a = AttributeProto::new();
        a.name = name.into();
        a.type_ = AttributeType::FLOAT.into();
        a.f = v;
        n.attribute.push(a);
        n
    }

    fn graph(inputs: Vec<ValueInfoProto>, nodes: Vec<NodeProto>, inits: Vec<TensorProto>, out: &str) -> GraphProto {
        let mut g = GraphProto::new();
        g.input = inputs;
        g.node = nodes;
        g.initializer = inits;
        g.output = vec![output(out)];
        g
    }

    fn opts(inputs: &str) -> ImportOptions {
        ImportOptions {
            name: "t".into(),
            version: 1,
            inputs: inputs.parse().unwrap(),
            output: None,
            output_kind: OutputKind::Logit,
            base_dir: None,
        }
    }

    #[test]
    fn mapping_refusals() {
        let err = |s: &str| s.parse::<InputMapping>().unwrap_err().to_string();
        assert!(err("user:3,item=i:4").contains("in every entry or in none"));
        assert!(err("user:3,user:4").contains("user is mapped more than once"));
        assert!(err("user:0").contains("positive integer"));
        assert!(err("users:3").contains("'users' is not a source"));
        assert!(err("user").contains("expected SOURCE:DIM"));
        assert!(err("").contains("no entries"));
        let m: InputMapping = "user=u:3,context=u:1".parse().unwrap();
        assert_eq!(m.entries[1].graph_input.as_deref(), Some("u"));
    }

    #[test]
    fn gemm_trans_b_alpha_beta_fold_into_the_layer() {
        // y = 0.5 * x . B^T + 2 * C with B [1, 2] (transB=1).
        let g = graph(
            vec![input("x", 2)],
            vec![with_float(
                with_float(with_int(node("Gemm", "g", &["x", "B", "C"], "y"), "transB", 1), "alpha", 0.5),
                "beta",
                2.0,
            )],
            vec![weight("B", &[1, 2], &[4.0, -6.0]), weight("C", &[1], &[0.25])],
            "y",
        );
        // Before IR version 4 initializers were listed as graph inputs too;
        // they are weights, not features to map.
        let mut g = g;
        g.input.push(input("B", 2));
        let m = import_graph(&g, &opts("user:2")).unwrap().model;
        assert_eq!(m.layers[0].weights_f32, vec![2.0, -3.0]);
        assert_eq!(m.layers[0].bias, vec![0.5]);

        // transB=0 reads B as [in, out]: a [2, 3] B feeding MatMul to one output.
        let g = graph(
            vec![input("x", 2)],
            vec![
                node("Gemm", "g", &["x", "B"], "h"),
                node("MatMul", "m", &["h", "W"], "y_mm"),
                node("Add", "b", &["bias", "y_mm"], "y"),
            ],
            vec![
                weight("B", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
                weight("W", &[3, 1], &[1.0, 1.0, 1.0]),
                weight("bias", &[1, 1], &[-1.0]),
            ],
            "y",
        );
        let m = import_graph(&g, &opts("user:2")).unwrap().model;
        assert_eq!(m.layers[0].weights_f32, vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(m.layers[1].bias, vec![-1.0]);
        let mut out = [0.0];
        m.forward_f32_reference(&[1.0, 1.0], 1, &mut out);
        assert_eq!(out[0], 5.0 + 7.0 + 9.0 - 1.0);
    }

    #[test]
    fn layout_follows_concat_order_and_positional_mapping_follows_declared_inputs() {
        // Declared order ctx, u; concatenated as u, ctx.
        let g = graph(
            vec![input("ctx", 1), input("u", 2)],
            vec![with_int(node("Concat", "cat", &["u", "ctx"], "x"), "axis", 1), node("Gemm", "g", &["x", "B"], "y")],
            vec![weight("B", &[3, 1], &[1.0, 2.0, 3.0])],
            "y",
        );
        let imported = import_graph(&g, &opts("context:1,user:2")).unwrap();
        assert_eq!(
            imported.model.inputs,
            vec![InputSegment { source: Source::User, dim: 2 }, InputSegment { source: Source::Context, dim: 1 }]
        );
        assert!(imported.summary().contains("input 'u': user 2"));
        let err = import_graph(&g, &opts("user:2,context:1")).unwrap_err().to_string();
        assert!(err.contains("graph input 'ctx' is 1 wide but is mapped to user:2"), "{err}");
    }

    #[test]
    fn refusals_name_the_node_and_the_reason() {
        let dense = |extra: Vec<NodeProto>, out: &str| {
            let mut nodes = vec![node("Gemm", "dense", &["x", "B"], "h")];
            nodes.extend(extra);
            graph(vec![input("x", 2)], nodes, vec![weight("B", &[2, 1], &[1.0, 1.0])], out)
        };
        let err = |g: GraphProto| import_graph(&g, &opts("user:2")).unwrap_err().to_string();

        let e = err(dense(vec![node("Elu", "elu", &["h"], "y")], "y"));
        assert!(e.contains("node 'elu': op Elu is not supported (graph activations:"), "{e}");
        let mut fourth = dense(vec![node("Pow", "fourth", &["h", "four"], "y")], "y");
        fourth.initializer.push(weight("four", &[], &[4.0]));
        let e = err(fourth);
        assert!(e.contains("node 'fourth' (Pow): exponent [4.0]; only 3, 2, 1 and 0.5 are supported"), "{e}");
        let e = err(dense(vec![with_int(node("Softmax", "sm", &["h"], "y"), "axis", 1)], "y"));
        assert!(e.contains("node 'sm' (Softmax): is a Softmax over 1 values"), "{e}");
        let e = err(dense(vec![node("Gather", "emb", &["B", "h"], "y")], "y"));
        assert!(e.contains("node 'emb' (Gather): its indices do not come from a Cast"), "{e}");
        let e = err(dense(vec![], "nowhere"));
        assert!(e.contains("no node produces 'nowhere'"), "{e}");

        let mut ml = dense(vec![node("SVMClassifier", "svm", &["h"], "y")], "y");
        ml.node[1].domain = "ai.onnx.ml".into();
        assert!(err(ml).contains("op ai.onnx.ml::SVMClassifier is not supported"));
        let mut trees = dense(vec![node("TreeEnsembleClassifier", "trees", &["h"], "y")], "y");
        trees.node[1].domain = "ai.onnx.ml".into();
        let e = err(trees);
        assert!(e.contains("node 'trees' (TreeEnsembleClassifier): attribute 'nodes_treeids' is missing"), "{e}");

        let mut int_weights = dense(vec![], "h");
        int_weights.initializer[0].data_type = DT_INT64;
        let e = err(int_weights);
        assert!(e.contains("initializer 'B': element type INT64 is not supported"), "{e}");

        let short = graph(
            vec![input("x", 3)],
            vec![node("MatMul", "mm", &["x", "B"], "y")],
            vec![weight("B", &[2, 1], &[1.0, 1.0])],
            "y",
        );
        let e = import_graph(&short, &opts("user:3")).unwrap_err().to_string();
        assert!(e.contains("node 'mm' (MatMul): weight 'B' is [2, 1] but its input is 3 wide"), "{e}");
    }

    #[test]
    fn reshape_must_keep_the_flat_shape() {
        let mut shape = TensorProto::new();
        shape.name = "shape".into();
        shape.dims = vec![2];
        shape.data_type = DT_INT64;
        shape.int64_data = vec![-1, 2];
        let g = |s: TensorProto| {
            graph(
                vec![input("x", 2)],
                vec![node("Reshape", "r", &["x", "shape"], "x2"), node("MatMul", "mm", &["x2", "B"], "y")],
                vec![weight("B", &[2, 1], &[1.0, 1.0]), s],
                "y",
            )
        };
        assert!(import_graph(&g(shape.clone()), &opts("user:2")).is_ok());
        shape.int64_data = vec![1, -1];
        let e = import_graph(&g(shape), &opts("user:2")).unwrap_err().to_string();
        assert!(e.contains("reshapes [batch, 2] to [1, -1]; only a reshape that keeps the batch"), "{e}");
    }

    #[test]
    fn a_cycle_and_a_bad_external_location_are_refused() {
        // h = Gemm(x + h): a cycle in ONNX shows as a tensor that no
        // earlier node produces.
        let cycle = graph(
            vec![input("x", 2)],
            vec![node("Add", "first", &["x", "h"], "r"), node("Gemm", "dense", &["r", "B"], "h")],
            vec![weight("B", &[2, 1], &[1.0, 1.0])],
            "h",
        );
        let e = import_graph(&cycle, &opts("user:2")).unwrap_err().to_string();
        assert!(e.contains("node 'first' (Add): tensor 'h' is not produced by an earlier node"), "{e}");

        let external = |location: &str| {
            let mut g = graph(
                vec![input("x", 2)],
                vec![node("Gemm", "dense", &["x", "B"], "h")],
                vec![weight("B", &[2, 1], &[1.0, 1.0])],
                "h",
            );
            let t = &mut g.initializer[0];
            t.raw_data.clear();
            t.float_data.clear();
            t.data_location = tensor_proto::DataLocation::EXTERNAL.into();
            let mut e = onnx_protobuf::StringStringEntryProto::new();
            e.key = "location".into();
            e.value = location.into();
            t.external_data.push(e);
            g
        };
        let mut o = opts("user:2");
        let e = import_graph(&external("w.bin"), &o).unwrap_err().to_string();
        assert!(e.contains("initializer 'B': is stored in an external data file"), "{e}");
        let dir = std::env::temp_dir().join(format!("quiver-ext-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        o.base_dir = Some(dir.clone());
        for bad in ["../w.bin", "/etc/passwd"] {
            let e = import_graph(&external(bad), &o).unwrap_err().to_string();
            assert!(e.contains("is not a plain relative path"), "{bad}: {e}");
        }
        let e = import_graph(&external("missing.bin"), &o).unwrap_err().to_string();
        assert!(e.contains("missing.bin"), "{e}");
        std::fs::write(dir.join("short.bin"), [0u8; 4]).unwrap();
        let e = import_graph(&external("short.bin"), &o).unwrap_err().to_string();
        assert!(e.contains("holds 1 values but its dimensions [2, 1] need 2"), "{e}");
        std::fs::write(dir.join("w.bin"), [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
            .unwrap();
        let m = import_graph(&external("w.bin"), &o).unwrap().model;
        assert_eq!(m.layers[0].weights_f32, vec![1.0, 2.0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// RUSTSEC-2024-0437: a megabyte of 0x0B is a million nested groups,
    /// on which the decoder's runtime recursed until the stack overflowed
    /// (this test then took the whole test process down). On a thread with
    /// Rust's default 2 MiB stack it is now a decode error.
    #[test]
    fn nested_groups_are_refused_before_they_reach_the_decoder() {
        let run = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| import_bytes(&[0x0b; 1 << 20], "groups.onnx", &opts("user:2")).map(|_| ()));
        let e = run.unwrap().join().unwrap().unwrap_err().to_string();
        assert!(e.contains("groups.onnx: not a valid ONNX file"), "{e}");
        assert!(e.contains("field 1 of a Model at byte 0 is a group, which ONNX never writes"), "{e}");
    }

    #[test]
    fn reshape_dimensions_that_overflow_are_refused() {
        let mut shape = TensorProto::new();
        shape.name = "shape".into();
        shape.dims = vec![3];
        shape.data_type = DT_INT64;
        // 4 x (2^62 + 1) wraps to 4, the input's width.
        shape.int64_data = vec![0, 4, (1i64 << 62) + 1];
        let g = graph(
            vec![input("x", 4)],
            vec![node("Reshape", "r", &["x", "shape"], "x2"), node("Relu", "relu", &["x2"], "y")],
            vec![shape],
            "y",
        );
        let e = import_graph(&g, &opts("user:4")).unwrap_err().to_string();
        assert!(e.contains("node 'r' (Reshape): reshapes [batch, 4] to [0, 4, 4611686018427387905]"), "{e}");
    }

    /// Each initializer's external data is within the per-tensor bound, but
    /// together they name more than any model file can hold; refused
    /// before a byte is read (the files are sparse).
    #[test]
    fn external_data_is_bounded_in_total_before_it_is_read() {
        let dir = std::env::temp_dir().join(format!("quiver-ext-total-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ten_gib = 10u64 << 30;
        std::fs::File::create(dir.join("big.bin")).unwrap().set_len(ten_gib).unwrap();
        let external = |name: &str| {
            let mut t = weight(name, &[2, 1], &[]);
            t.data_location = tensor_proto::DataLocation::EXTERNAL.into();
            let mut e = onnx_protobuf::StringStringEntryProto::new();
            e.key = "location".into();
            e.value = "big.bin".into();
            t.external_data.push(e);
            t
        };
        let g = graph(
            vec![input("x", 2)],
            vec![node("Gemm", "dense", &["x", "B"], "h")],
            vec![external("B"), external("C")],
            "h",
        );
        let mut o = opts("user:2");
        o.base_dir = Some(dir.clone());
        let e = import_graph(&g, &o).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(e.contains("initializer 'C': the initializers' external data adds up to more than 19327352832"), "{e}");
    }

    #[test]
    fn empty_and_garbage_bytes_are_refused() {
        let o = opts("user:2");
        assert!(matches!(import_bytes(b"", "e.onnx", &o), Err(OnnxError::NoGraph { .. })));
        let e = import_bytes(&[0x0a, 0xff, 0xff, 0xff], "g.onnx", &o).unwrap_err();
        assert!(matches!(e, OnnxError::Decode { .. }), "{e}");
    }
}
