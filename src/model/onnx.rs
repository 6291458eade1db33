//! ONNX import: turns the MLP graphs that standard tools export for CTR and
//! fraud models into a Quiver [`Model`].
//!
//! Training happens elsewhere (scikit-learn, PyTorch, Keras) and ONNX is what
//! those tools write, so this is how a trained model reaches the server. The
//! graph is decoded with `onnx-protobuf` (generated types, pure Rust, no
//! runtime) and evaluated symbolically: graph inputs and their `Concat` become
//! the input layout, `Gemm` or `MatMul` + `Add` become dense layers, `Relu`
//! their activation, and a final `Sigmoid` is dropped because the server
//! applies it on the host. Everything else is refused with the node and the
//! reason rather than approximated, so an imported model computes what the
//! ONNX graph computes or is not imported at all.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use onnx_protobuf::{attribute_proto::AttributeType, tensor_proto, type_proto, Message as _};
use onnx_protobuf::{AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto};
use protobuf::Enum as _;

use super::{InputSegment, Layer, Model, ModelError, Source, MODEL_BYTES_MAX};

/// The ops the importer understands, for error messages.
pub const SUPPORTED_OPS: &str = "Gemm, MatMul, Add (a bias after Gemm/MatMul), Relu, Sigmoid (last op only), \
     Identity, Cast (to float), Flatten and Reshape (of an already flat tensor), Concat (of graph inputs), Constant";

/// ONNX `TensorProto.DataType` codes this module reads.
const DT_FLOAT: i32 = 1;
const DT_INT64: i32 = 7;

#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: file is {bytes} bytes, the limit is {MODEL_BYTES_MAX}")]
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
                other => return Err(bad(format!("'{other}' is not a source; use user, item or context"))),
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

fn source_name(s: Source) -> &'static str {
    match s {
        Source::User => "user",
        Source::Item => "item",
        Source::Context => "context",
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
}

/// An imported model and what the import found, for the summary.
#[derive(Clone, Debug)]
pub struct Imported {
    pub model: Model,
    /// The tensor the model reproduces.
    pub output: String,
    /// Whether that tensor was a Sigmoid of the logit (dropped on import).
    pub sigmoid_dropped: bool,
    /// `(graph input, Quiver segments)` in input-vector order.
    pub layout: Vec<(String, Vec<InputSegment>)>,
    pub producer: String,
}

impl Imported {
    /// Multiply-accumulates per scored row.
    pub fn macs_per_row(&self) -> usize {
        self.model.layers.iter().map(|l| l.in_dim * l.out_dim).sum()
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
        let tail = if self.sigmoid_dropped {
            "its Sigmoid is applied by the server"
        } else {
            "the server applies the sigmoid"
        };
        let _ = writeln!(s, "  output '{}': one logit; {tail}", self.output);
        let _ = write!(s, "  MACs per row: {}", self.macs_per_row());
        s
    }
}

/// Reads, decodes and imports an ONNX file.
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    let p = path.display().to_string();
    let io = |source| OnnxError::Io { path: p.clone(), source };
    let bytes_len = std::fs::metadata(path).map_err(io)?.len();
    if bytes_len > MODEL_BYTES_MAX as u64 {
        return Err(OnnxError::TooLarge { path: p, bytes: bytes_len });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    import_bytes(&bytes, &p, opts)
}

/// Decodes and imports ONNX bytes; `path_for_errors` names them in errors.
pub fn import_bytes(bytes: &[u8], path_for_errors: &str, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    let proto = ModelProto::parse_from_bytes(bytes)
        .map_err(|e| OnnxError::Decode { path: path_for_errors.into(), detail: e.to_string() })?;
    let Some(graph) = proto.graph.as_ref() else {
        return Err(OnnxError::NoGraph { path: path_for_errors.into() });
    };
    let mut imported = import_graph(graph, opts)?;
    imported.producer = if proto.producer_name.is_empty() {
        "an unnamed producer".into()
    } else {
        format!("{} {}", proto.producer_name, proto.producer_version).trim_end().to_string()
    };
    Ok(imported)
}

/// A dense layer under construction; weights row-major `[out][in]`.
#[derive(Clone, Debug)]
struct Draft {
    in_dim: usize,
    out_dim: usize,
    weights: Vec<f32>,
    bias: Vec<f32>,
    relu: bool,
}

/// The value of a non-constant tensor: the graph inputs it reads (in
/// column order), the layers applied so far and whether a Sigmoid ended it.
/// Every such tensor is `[batch, width]`.
#[derive(Debug)]
struct Act {
    layout: Vec<usize>,
    width: usize,
    layers: Vec<Draft>,
    sigmoid: bool,
}

enum Operand<'g> {
    Act(Act),
    Const(&'g TensorProto),
}

/// Where the interpreter is: the live activations and the constants.
struct Interp<'g> {
    acts: HashMap<String, Act>,
    consumed: HashSet<String>,
    consts: HashMap<&'g str, &'g TensorProto>,
}

impl<'g> Interp<'g> {
    fn take(&mut self, node: &NodeProto, name: &str) -> Result<Operand<'g>, OnnxError> {
        if let Some(a) = self.acts.remove(name) {
            self.consumed.insert(name.to_string());
            return Ok(Operand::Act(a));
        }
        if let Some(t) = self.consts.get(name) {
            return Ok(Operand::Const(t));
        }
        let what = if self.consumed.contains(name) {
            format!("tensor '{name}' feeds more than one node; only a chain of layers is supported")
        } else {
            format!("tensor '{name}' is not produced by an earlier node, an initializer or a graph input")
        };
        Err(node_err(node, what))
    }
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

/// Dimensions of a constant, checked to be non-negative and to fit memory.
fn tensor_dims(t: &TensorProto) -> Result<(Vec<usize>, usize), OnnxError> {
    let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
    let mut dims = Vec::with_capacity(t.dims.len());
    let mut numel = 1usize;
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| bad(format!("negative dimension in {:?}", t.dims)))?;
        numel = numel
            .checked_mul(d)
            .filter(|n| *n <= MODEL_BYTES_MAX / 4)
            .ok_or_else(|| bad(format!("dimensions {:?} are too large", t.dims)))?;
        dims.push(d);
    }
    if t.data_location.enum_value() == Ok(tensor_proto::DataLocation::EXTERNAL) {
        return Err(bad("stored in an external data file, which is not supported".into()));
    }
    Ok((dims, numel))
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
fn input_width(vi: &ValueInfoProto) -> Result<usize, OnnxError> {
    let bad = |what: &str| OnnxError::Input { input: vi.name.clone(), what: what.into() };
    let Some(type_proto::Value::TensorType(t)) = vi.type_.as_ref().and_then(|t| t.value.as_ref()) else {
        return Err(bad("is not a tensor"));
    };
    if t.elem_type != DT_FLOAT {
        return Err(OnnxError::Input {
            input: vi.name.clone(),
            what: format!("has element type {}; only FLOAT (float32) inputs are supported", dtype_name(t.elem_type)),
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
    usize::try_from(w.dim_value()).map_err(|_| bad("width does not fit"))
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

/// Imports a decoded graph.
pub fn import_graph(graph: &GraphProto, opts: &ImportOptions) -> Result<Imported, OnnxError> {
    let output = select_output(graph, opts)?;

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
    let widths = feature_inputs.iter().map(|vi| input_width(vi)).collect::<Result<Vec<_>, _>>()?;
    let segments = resolve_mapping(&feature_inputs, &widths, &opts.inputs)?;

    let mut interp = Interp { acts: HashMap::new(), consumed: HashSet::new(), consts: initializers };
    for (i, vi) in feature_inputs.iter().enumerate() {
        interp
            .acts
            .insert(vi.name.clone(), Act { layout: vec![i], width: widths[i], layers: Vec::new(), sigmoid: false });
    }
    for (node, _) in graph.node.iter().zip(&needed).filter(|(_, n)| **n) {
        apply(&mut interp, node)?;
    }

    let Some(act) = interp.acts.remove(&output) else {
        return Err(OnnxError::Output { what: format!("'{output}' is a constant, not computed from the inputs") });
    };
    if act.layers.is_empty() {
        return Err(OnnxError::Output { what: format!("'{output}' is not computed by any Gemm or MatMul layer") });
    }
    if act.width != 1 {
        return Err(OnnxError::Output {
            what: format!(
                "'{output}' is {} wide; a Quiver model ends in one logit (width 1), or a Sigmoid of it",
                act.width
            ),
        });
    }
    if act.layers.last().is_some_and(|l| l.relu) {
        return Err(OnnxError::Output {
            what: format!("'{output}' ends in a Relu; the output layer must be linear (a logit) or a Sigmoid of it"),
        });
    }
    let layout: Vec<(String, Vec<InputSegment>)> =
        act.layout.iter().map(|&i| (feature_inputs[i].name.clone(), segments[i].clone())).collect();
    let model = Model {
        name: opts.name.clone(),
        version: opts.version,
        inputs: layout.iter().flat_map(|(_, s)| s.iter().copied()).collect(),
        layers: act
            .layers
            .into_iter()
            .map(|d| Layer::quantize(d.in_dim, d.out_dim, d.relu, d.weights, d.bias))
            .collect(),
        calibration: None,
    };
    model.validate()?;
    Ok(Imported { model, output, sigmoid_dropped: act.sigmoid, layout, producer: String::new() })
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

fn expect_act(node: &NodeProto, op: Operand<'_>, role: &str) -> Result<Act, OnnxError> {
    match op {
        Operand::Act(a) => Ok(a),
        Operand::Const(t) => Err(node_err(
            node,
            format!("the {role} '{}' is a constant; it must be computed from the graph inputs", t.name),
        )),
    }
}

fn expect_const<'g>(node: &NodeProto, op: Operand<'g>, role: &str) -> Result<&'g TensorProto, OnnxError> {
    match op {
        Operand::Const(t) => Ok(t),
        Operand::Act(_) => Err(node_err(
            node,
            format!("the {role} must be an initializer or a Constant, not computed from the inputs"),
        )),
    }
}

/// Ops that leave a `[batch, width]` tensor unchanged are allowed after the
/// final Sigmoid; anything else after it is refused.
fn not_after_sigmoid(node: &NodeProto, a: &Act) -> Result<(), OnnxError> {
    if a.sigmoid {
        return Err(node_err(node, "follows the Sigmoid; a Sigmoid is supported only as the last op"));
    }
    Ok(())
}

fn operands<'g>(
    interp: &mut Interp<'g>,
    node: &NodeProto,
    n: std::ops::RangeInclusive<usize>,
) -> Result<Vec<Operand<'g>>, OnnxError> {
    let count = node.input.len();
    if !n.contains(&count) {
        return Err(node_err(node, format!("has {count} inputs; {}..={} expected", n.start(), n.end())));
    }
    node.input.iter().filter(|s| !s.is_empty()).map(|s| interp.take(node, s)).collect()
}

/// Applies one node to the interpreter state.
fn apply<'g>(interp: &mut Interp<'g>, node: &'g NodeProto) -> Result<(), OnnxError> {
    let op = node.op_type.as_str();
    if !(node.domain.is_empty() || node.domain == "ai.onnx") {
        return Err(OnnxError::UnsupportedOp {
            op: format!("{}::{op}", node.domain),
            node: node_name(node),
            hint: String::new(),
        });
    }
    const HANDLED: [&str; 11] =
        ["Constant", "Identity", "Cast", "Flatten", "Reshape", "Concat", "MatMul", "Gemm", "Add", "Relu", "Sigmoid"];
    if !HANDLED.contains(&op) {
        return Err(unsupported(node));
    }
    if node.output.len() != 1 {
        return Err(node_err(node, format!("has {} outputs; one expected", node.output.len())));
    }
    let out = node.output[0].clone();
    let result = match op {
        "Constant" => {
            let t = attr(node, "value")
                .and_then(|a| a.t.as_ref())
                .ok_or_else(|| node_err(node, "only a Constant with a tensor 'value' attribute is supported"))?;
            interp.consts.insert(node.output[0].as_str(), t);
            return Ok(());
        }
        "Identity" => {
            let mut ops = operands(interp, node, 1..=1)?;
            expect_act(node, ops.remove(0), "input")?
        }
        "Cast" => {
            let to = attr_int(node, "to", None)?;
            if to != i64::from(DT_FLOAT) {
                return Err(node_err(
                    node,
                    format!("casts to {}; only a Cast to FLOAT of a float tensor is supported", dtype_name(to as i32)),
                ));
            }
            let mut ops = operands(interp, node, 1..=1)?;
            expect_act(node, ops.remove(0), "input")?
        }
        "Flatten" => {
            let axis = attr_int(node, "axis", Some(1))?;
            if axis != 1 && axis != -1 {
                return Err(node_err(
                    node,
                    format!("axis {axis}; only axis 1 of a [batch, width] tensor is supported"),
                ));
            }
            let mut ops = operands(interp, node, 1..=1)?;
            expect_act(node, ops.remove(0), "input")?
        }
        "Reshape" => {
            let mut ops = operands(interp, node, 2..=2)?;
            let shape = expect_const(node, ops.remove(1), "shape")?;
            let a = expect_act(node, ops.remove(0), "data input")?;
            let shape = tensor_i64(shape)?;
            let w = a.width as i64;
            let flat = matches!(shape.as_slice(), [-1 | 0, x] if *x == w) || shape.as_slice() == [0, -1];
            if !flat {
                return Err(node_err(
                    node,
                    format!("reshapes [batch, {w}] to {shape:?}; only a reshape that keeps [batch, {w}] is supported"),
                ));
            }
            a
        }
        "Concat" => {
            let axis = attr_int(node, "axis", None)?;
            if axis != 1 && axis != -1 {
                return Err(node_err(node, format!("axis {axis}; only the feature axis (1) is supported")));
            }
            let count = node.input.len();
            let ops = operands(interp, node, 1..=count.max(1))?;
            let mut joined = Act { layout: Vec::new(), width: 0, layers: Vec::new(), sigmoid: false };
            for o in ops {
                let a = expect_act(node, o, "input")?;
                if !a.layers.is_empty() || a.sigmoid {
                    return Err(node_err(
                        node,
                        "concatenates the output of a layer; only graph inputs may be concatenated (into the input vector)",
                    ));
                }
                joined.layout.extend(a.layout);
                joined.width += a.width;
            }
            joined
        }
        "MatMul" => {
            let mut ops = operands(interp, node, 2..=2)?;
            if matches!(ops[0], Operand::Const(_)) {
                return Err(node_err(node, "the weight is the first operand; only activation x weight is supported"));
            }
            let w = expect_const(node, ops.remove(1), "weight")?;
            let mut a = expect_act(node, ops.remove(0), "input")?;
            not_after_sigmoid(node, &a)?;
            let (dims, values) = tensor_f32(w)?;
            let [k, n] = dims[..] else {
                return Err(node_err(node, format!("weight '{}' has shape {dims:?}; [in, out] expected", w.name)));
            };
            if k != a.width {
                return Err(node_err(
                    node,
                    format!("weight '{}' is [{k}, {n}] but its input is {} wide", w.name, a.width),
                ));
            }
            let mut weights = vec![0.0f32; k * n];
            for (r, row) in values.chunks_exact(n.max(1)).enumerate() {
                for (o, v) in row.iter().enumerate() {
                    weights[o * k + r] = *v;
                }
            }
            a.layers.push(Draft { in_dim: k, out_dim: n, weights, bias: vec![0.0; n], relu: false });
            a.width = n;
            a
        }
        "Gemm" => gemm(interp, node)?,
        "Add" => {
            let ops = operands(interp, node, 2..=2)?;
            let (a, c) = match <[Operand<'_>; 2]>::try_from(ops) {
                Ok([Operand::Act(a), Operand::Const(c)]) => (a, c),
                Ok([Operand::Const(c), Operand::Act(a)]) => (a, c),
                _ => return Err(node_err(node, "only the Add of a constant bias to a layer's output is supported")),
            };
            let mut a = a;
            not_after_sigmoid(node, &a)?;
            let Some(last) = a.layers.last_mut() else {
                return Err(node_err(node, "adds a constant to a graph input; it must follow a Gemm or MatMul"));
            };
            if last.relu {
                return Err(node_err(
                    node,
                    "adds a bias after the Relu; only a bias before the activation is supported",
                ));
            }
            let (dims, values) = tensor_f32(c)?;
            let n = last.out_dim;
            let shape_ok = matches!(dims[..], [] | [1] | [1, 1]) || matches!(dims[..], [x] | [1, x] if x == n);
            if !shape_ok {
                return Err(node_err(
                    node,
                    format!("bias '{}' has shape {dims:?}; [{n}], [1, {n}] or a scalar expected", c.name),
                ));
            }
            for (o, b) in last.bias.iter_mut().enumerate() {
                *b += values[if values.len() == 1 { 0 } else { o }];
            }
            a
        }
        "Relu" => {
            let mut ops = operands(interp, node, 1..=1)?;
            let mut a = expect_act(node, ops.remove(0), "input")?;
            not_after_sigmoid(node, &a)?;
            let Some(last) = a.layers.last_mut() else {
                return Err(node_err(node, "applies to a graph input; an activation must follow a Gemm or MatMul"));
            };
            last.relu = true;
            a
        }
        "Sigmoid" => {
            let mut ops = operands(interp, node, 1..=1)?;
            let mut a = expect_act(node, ops.remove(0), "input")?;
            not_after_sigmoid(node, &a)?;
            if a.layers.is_empty() {
                return Err(node_err(node, "applies to a graph input; it must end the network"));
            }
            a.sigmoid = true;
            a
        }
        _ => return Err(unsupported(node)),
    };
    interp.acts.insert(out, result);
    Ok(())
}

fn unsupported(node: &NodeProto) -> OnnxError {
    let hint = match node.op_type.as_str() {
        "LeakyRelu" | "Elu" | "Selu" | "Tanh" | "PRelu" | "Softplus" | "Gelu" => {
            " (the .qm format has only ReLU or no activation between layers)"
        }
        "Softmax" => " (a Quiver model outputs one logit; export a single-output binary model)",
        _ => "",
    };
    OnnxError::UnsupportedOp { op: node.op_type.clone(), node: node_name(node), hint: hint.into() }
}

fn gemm(interp: &mut Interp<'_>, node: &NodeProto) -> Result<Act, OnnxError> {
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
    let mut ops = operands(interp, node, 2..=3)?;
    let c = if ops.len() == 3 { Some(expect_const(node, ops.remove(2), "bias C")?) } else { None };
    if matches!(ops[0], Operand::Const(_)) {
        return Err(node_err(node, "A is a constant; only activation x weight is supported"));
    }
    let b = expect_const(node, ops.remove(1), "weight B")?;
    let mut a = expect_act(node, ops.remove(0), "input A")?;
    not_after_sigmoid(node, &a)?;
    let (dims, values) = tensor_f32(b)?;
    let [r, s] = dims[..] else {
        return Err(node_err(node, format!("weight '{}' has shape {dims:?}; a matrix expected", b.name)));
    };
    let (k, n) = if trans_b == 1 { (s, r) } else { (r, s) };
    if k != a.width {
        return Err(node_err(
            node,
            format!(
                "weight '{}' is {dims:?} (transB={trans_b}), taking {k} inputs, but its input is {} wide",
                b.name, a.width
            ),
        ));
    }
    let mut weights = vec![0.0f32; k * n];
    for o in 0..n {
        for i in 0..k {
            let v = if trans_b == 1 { values[o * k + i] } else { values[i * n + o] };
            weights[o * k + i] = alpha * v;
        }
    }
    let mut bias = vec![0.0f32; n];
    if let Some(c) = c {
        let (cdims, cvals) = tensor_f32(c)?;
        let shape_ok = matches!(cdims[..], [] | [1] | [1, 1]) || matches!(cdims[..], [x] | [1, x] if x == n);
        if !shape_ok {
            return Err(node_err(
                node,
                format!("bias '{}' has shape {cdims:?}; [{n}], [1, {n}] or a scalar expected", c.name),
            ));
        }
        for (o, y) in bias.iter_mut().enumerate() {
            *y = beta * cvals[if cvals.len() == 1 { 0 } else { o }];
        }
    }
    a.layers.push(Draft { in_dim: k, out_dim: n, weights, bias, relu: false });
    a.width = n;
    Ok(a)
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
        ImportOptions { name: "t".into(), version: 1, inputs: inputs.parse().unwrap(), output: None }
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

        let e = err(dense(vec![node("LeakyRelu", "leaky", &["h"], "y")], "y"));
        assert!(e.contains("node 'leaky': op LeakyRelu is not supported (the .qm format has only ReLU"), "{e}");
        let e = err(dense(vec![node("Relu", "act", &["h"], "y")], "y"));
        assert!(e.contains("'y' ends in a Relu"), "{e}");
        let e = err(dense(vec![node("Relu", "act", &["h"], "r"), node("Add", "late_bias", &["r", "B"], "y")], "y"));
        assert!(e.contains("node 'late_bias' (Add): adds a bias after the Relu"), "{e}");
        let e = err(dense(vec![node("Sigmoid", "s", &["h"], "p"), node("Relu", "after", &["p"], "y")], "y"));
        assert!(e.contains("node 'after' (Relu): follows the Sigmoid"), "{e}");
        let e = err(dense(vec![node("Add", "twice", &["h", "h"], "y")], "y"));
        assert!(e.contains("feeds more than one node"), "{e}");
        let e = err(dense(vec![], "nowhere"));
        assert!(e.contains("no node produces 'nowhere'"), "{e}");

        let mut ml = dense(vec![node("ZipMap", "zm", &["h"], "y")], "y");
        ml.node[1].domain = "ai.onnx.ml".into();
        assert!(err(ml).contains("op ai.onnx.ml::ZipMap is not supported"));

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
        assert!(e.contains("reshapes [batch, 2] to [1, -1]"), "{e}");
    }

    #[test]
    fn empty_and_garbage_bytes_are_refused() {
        let o = opts("user:2");
        assert!(matches!(import_bytes(b"", "e.onnx", &o), Err(OnnxError::NoGraph { .. })));
        let e = import_bytes(&[0x0a, 0xff, 0xff, 0xff], "g.onnx", &o).unwrap_err();
        assert!(matches!(e, OnnxError::Decode { .. }), "{e}");
    }
}
