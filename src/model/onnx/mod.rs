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
//!
//! Here: the import's entry points, output selection and the walk over the
//! nodes the output needs. `ops`: the op table and each op's import, by
//! family; `builder`: the graph under construction; `proto`: reading nodes,
//! attributes and tensors; `mapping`: `--inputs`; `external`: weights in
//! side files; `keep`: the graph kept for onnxruntime; `wire`: the
//! pre-decode walk; `export`: `quiver export-onnx`.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use onnx_protobuf::Message as _;
use onnx_protobuf::{GraphProto, ModelProto, TensorProto, ValueInfoProto};

use super::graph::{Act, Graph, Node as GNode, Op, OutputKind};
use super::{valid_feature_name, InputSegment, Layer, Model, ModelError, Source, MODEL_HEAP_BYTES_MAX};

mod builder;
mod export;
mod external;
mod keep;
mod mapping;
mod ops;
mod proto;
mod wire;

pub use export::export_mlp;
pub use external::EXTERNAL_DATA_BYTES_MAX;
pub use keep::KeepOnnx;
pub use mapping::{source_name, InputMapping, MappingEntry};

use builder::Builder;
use external::{inline_external_data, is_external};
use mapping::resolve_mapping;
use proto::input_width;

/// The ops the importer understands, for error messages.
pub const SUPPORTED_OPS: &str =
    "Gemm, MatMul, Add, Sub, Mul, Div, Pow (3, 2, 0.5), Neg, Reciprocal, Relu, LeakyRelu, Tanh, Sigmoid, \
     Erf, Gelu, Sqrt, BatchNormalization, LayerNormalization, Softmax (two classes), ReduceSum and ReduceMean \
     (feature axis), Concat, \
     Slice (of a graph input), Gather (embeddings), Identity, Dropout, Cast, Flatten, Reshape, Constant; \
     ai.onnx.ml Scaler, LinearClassifier, LinearRegressor, Normalizer (L1), ZipMap, TreeEnsembleClassifier \
     (binary), TreeEnsembleRegressor";

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

impl ImportOptions {
    /// A model named and versioned as asked, reading `layout`'s segments in
    /// order, with no network yet.
    fn model(&self, layout: &[(String, Vec<InputSegment>)]) -> Model {
        Model {
            name: self.name.clone(),
            version: self.version,
            inputs: layout.iter().flat_map(|(_, s)| s.iter().copied()).collect(),
            layers: Vec::new(),
            calibration: None,
            graph: None,
            onnx: None,
            feature_names: input_feature_names(layout),
        }
    }
}

/// The model's column names from its ONNX graph inputs: an input that is
/// one column (a pipeline fed one tensor per feature: `amount`, `hour`)
/// names it; a wider input's columns keep their segment names (`card[3]`),
/// as does an input whose name Quiver cannot list. Empty when no input is
/// one column: every name would be a segment name.
fn input_feature_names(layout: &[(String, Vec<InputSegment>)]) -> Vec<String> {
    let width = |segments: &[InputSegment]| segments.iter().map(|s| s.dim).sum::<usize>();
    if !layout.iter().any(|(name, s)| width(s) == 1 && valid_feature_name(name)) {
        return Vec::new();
    }
    let mut names = Vec::new();
    for (name, segments) in layout {
        if width(segments) == 1 && valid_feature_name(name) {
            names.push(name.clone());
            continue;
        }
        for s in segments {
            names.extend((0..s.dim).map(|k| format!("{}[{k}]", s.source.name())));
        }
    }
    names
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
        if !m.feature_names.is_empty() {
            // The first few: a model may have thousands.
            const SHOWN: usize = 8;
            let names = &m.feature_names;
            let more = names.len().saturating_sub(SHOWN);
            let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
            let _ = writeln!(s, "  feature names kept: {}{tail}", names[..names.len().min(SHOWN)].join(", "));
        }
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
        ops::apply(&mut b, node)?;
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
            let model = Model { layers, ..opts.model(&layout) };
            (layout, model)
        }
        None => {
            let layout: Vec<(String, Vec<InputSegment>)> =
                feature_inputs.iter().zip(&segments).map(|(vi, s)| (vi.name.clone(), s.clone())).collect();
            let model = Model { graph: Some(g), ..opts.model(&layout) };
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

#[cfg(test)]
mod tests {
    use onnx_protobuf::attribute_proto::AttributeType;
    use onnx_protobuf::{tensor_proto, tensor_shape_proto, type_proto, AttributeProto, NodeProto};
    use onnx_protobuf::{TensorShapeProto, TypeProto};

    use super::proto::{DT_FLOAT, DT_INT64};
    use super::*;

    #[test]
    fn one_column_graph_inputs_name_their_column_and_wider_ones_keep_segment_names() {
        let seg = |source, dim| InputSegment { source, dim };
        let wide = vec![("float_input".to_string(), vec![seg(Source::User, 2), seg(Source::Context, 1)])];
        assert!(input_feature_names(&wide).is_empty(), "no one-column input: segment names, nothing stored");
        let mixed = vec![
            ("amount".to_string(), vec![seg(Source::Context, 1)]),
            ("user_emb".to_string(), vec![seg(Source::User, 2)]),
            ("bad\u{7}name".to_string(), vec![seg(Source::Item, 1)]),
        ];
        assert_eq!(input_feature_names(&mixed), ["amount", "user[0]", "user[1]", "item[0]"]);
    }

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
