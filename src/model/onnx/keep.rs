//! Keeping the ONNX graph in the model file for the onnxruntime backend:
//! beside the native network (`quiver import --keep-onnx`, so a version can
//! be served either way), or instead of it (`--onnxruntime`, for a graph the
//! native compiler refuses).
//!
//! Either way the graph is stored as onnxruntime will read it (external data
//! inlined, the tensor read made a graph output) with its interface: each
//! graph input's columns of the input vector, element type and rank, and the
//! output column. Nothing here interprets the graph's nodes beyond finding
//! what produces the output, so any graph onnxruntime can run imports.

use std::collections::HashSet;

use onnx_protobuf::{type_proto, GraphProto, ModelProto, TypeProto, ValueInfoProto};
use protobuf::{Message as _, MessageField};

use super::external::{inline_external_data, is_external};
use super::mapping::{resolve_mapping, source_name};
use super::proto::{dtype_name, DT_FLOAT, DT_INT32, DT_INT64};
use super::{select_output, ImportOptions, Imported, OnnxError};
use crate::model::onnx_graph::{OnnxElement, OnnxGraph, OnnxInput};
use crate::model::{InputSegment, Model, OutputKind, Source};

/// What an import keeps of the ONNX graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepOnnx {
    /// The native network only (the default).
    No,
    /// The native network, and the graph beside it (`--keep-onnx`).
    Beside,
    /// The graph only, served through onnxruntime (`--onnxruntime`).
    /// `output_kind`: what the output is; `None` decides from the graph (a
    /// probability is returned as is, anything else is a logit).
    Only { output_kind: Option<OutputKind> },
}

/// The element type, rank and width of a graph input as onnxruntime is fed it.
fn input_interface(vi: &ValueInfoProto) -> Result<(OnnxElement, u8, usize), OnnxError> {
    let bad = |what: String| OnnxError::Input { input: vi.name.clone(), what };
    let Some(type_proto::Value::TensorType(t)) = vi.type_.as_ref().and_then(|t| t.value.as_ref()) else {
        return Err(bad("is not a tensor".into()));
    };
    let element = match t.elem_type {
        DT_FLOAT => OnnxElement::Float,
        DT_INT64 => OnnxElement::Int64,
        DT_INT32 => OnnxElement::Int32,
        other => {
            return Err(bad(format!(
                "has element type {}; the server feeds FLOAT, INT64 or INT32 inputs",
                dtype_name(other)
            )))
        }
    };
    let dims = t.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or_default();
    match dims {
        [_] => Ok((element, 1, 1)),
        [_, w] if w.has_dim_value() && w.dim_value() > 0 => {
            let width = usize::try_from(w.dim_value()).map_err(|_| bad("width does not fit".into()))?;
            Ok((element, 2, width))
        }
        [_, _] => Err(bad("has an unknown or zero width; expected [batch, width] with a fixed width".into())),
        other => Err(bad(format!("has rank {}; expected [batch] or [batch, width]", other.len()))),
    }
}

/// The graph inputs onnxruntime must be fed: every input that is not also an
/// initializer (a default the caller may override).
fn fed_inputs(graph: &GraphProto) -> Vec<&ValueInfoProto> {
    let initializers: HashSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    graph.input.iter().filter(|vi| !initializers.contains(vi.name.as_str())).collect()
}

/// `proto` as onnxruntime will read it: external data inlined, and `output`
/// a graph output (a tensor inside the graph, such as the probabilities a
/// ZipMap reads, is not one until it is listed).
fn servable_bytes(proto: &ModelProto, opts: &ImportOptions, output: &str) -> Result<Vec<u8>, OnnxError> {
    let mut proto = proto.clone();
    let graph = proto.graph.as_mut().expect("the caller checked the graph");
    if graph.initializer.iter().any(is_external) {
        *graph = inline_external_data(graph, opts.base_dir.as_deref())?;
    }
    if !graph.output.iter().any(|o| o.name == output) {
        let tensor = type_proto::Tensor { elem_type: DT_FLOAT, ..Default::default() };
        let type_ = TypeProto { value: Some(type_proto::Value::TensorType(tensor)), ..Default::default() };
        graph.output.push(ValueInfoProto {
            name: output.into(),
            type_: MessageField::some(type_),
            ..Default::default()
        });
    }
    proto.write_to_bytes().map_err(|e| OnnxError::Output { what: format!("re-encoding the graph: {e}") })
}

/// The graph kept beside a native import: its inputs in the native model's
/// input order, and the output the native network computes.
pub(super) fn beside(proto: &ModelProto, opts: &ImportOptions, imported: &Imported) -> Result<OnnxGraph, OnnxError> {
    let graph = proto.graph.as_ref().expect("the caller checked the graph");
    let mut inputs = Vec::new();
    for (name, segs) in &imported.layout {
        let vi = graph.input.iter().find(|vi| vi.name == *name).expect("the layout names graph inputs");
        let (element, rank, _) = input_interface(vi)?;
        inputs.push(OnnxInput { name: name.clone(), width: segs.iter().map(|s| s.dim).sum(), element, rank });
    }
    if let Some(unfed) = fed_inputs(graph).iter().find(|vi| !imported.layout.iter().any(|(n, _)| *n == vi.name)) {
        return Err(OnnxError::Input {
            input: unfed.name.clone(),
            what: "is not read by the output the native import reproduces, but onnxruntime needs every graph input; \
                   drop --keep-onnx, or import with --onnxruntime and map it"
                .into(),
        });
    }
    // With the Sigmoid dropped the native network outputs the logit: read
    // the Sigmoid's input when the graph has one, else invert the
    // probability on the way out.
    let mut output = imported.output.clone();
    let mut output_probability = imported.sigmoid_dropped;
    let mut output_column = imported.output_column;
    if imported.sigmoid_dropped && output_column == 0 {
        if let Some(s) = graph.node.iter().find(|n| n.op_type == "Sigmoid" && n.output.first() == Some(&output)) {
            output = s.input[0].clone();
            output_probability = false;
        }
    }
    if imported.model.output_kind() == OutputKind::Raw {
        output_probability = false;
        output_column = imported.output_column;
    }
    Ok(OnnxGraph {
        bytes: servable_bytes(proto, opts, &output)?.into(),
        inputs,
        output,
        output_column,
        output_probability,
        output_kind: imported.model.output_kind(),
    })
}

/// Ops whose output is a probability: a model ending in one returns it as
/// is unless told otherwise.
const PROBABILITY_OPS: &[&str] =
    &["Sigmoid", "Softmax", "LinearClassifier", "TreeEnsembleClassifier", "SVMClassifier", "ZipMap"];

/// A model served only through onnxruntime: the graph's inputs mapped by
/// `--inputs`, the output chosen as for a native import.
pub(super) fn only(
    proto: &ModelProto,
    opts: &ImportOptions,
    output_kind: Option<OutputKind>,
) -> Result<Imported, OnnxError> {
    let graph = proto.graph.as_ref().expect("the caller checked the graph");
    let mut output = select_output(graph, opts)?;
    let mut producer = graph.node.iter().find(|n| n.output.contains(&output));
    if let Some(zm) = producer.filter(|n| n.op_type == "ZipMap") {
        // A ZipMap's maps are for Python callers; the tensor it reads is
        // the probabilities.
        output = zm.input.first().cloned().unwrap_or_default();
        producer = graph.node.iter().find(|n| n.output.contains(&output));
    }
    let Some(producer) = producer else {
        return Err(OnnxError::Output { what: format!("no node produces '{output}'") });
    };
    let fed = fed_inputs(graph);
    if fed.is_empty() {
        return Err(OnnxError::Output { what: "the graph has no inputs to feed".into() });
    }
    let typed = fed.iter().map(|vi| input_interface(vi)).collect::<Result<Vec<_>, _>>()?;
    let widths: Vec<usize> = typed.iter().map(|(_, _, w)| *w).collect();
    let segments = resolve_mapping(&fed, &widths, &opts.inputs)?;
    for ((vi, (element, _, _)), segs) in fed.iter().zip(&typed).zip(&segments) {
        let ids = segs.iter().all(|s| s.source == Source::ContextIds);
        if *element != OnnxElement::Float && !ids {
            return Err(OnnxError::Mapping {
                what: format!("graph input '{}' holds integers; map it to context_ids (categorical ids)", vi.name),
            });
        }
    }
    // A two-class probability tensor is read at its positive class.
    let declared = graph.output.iter().chain(&graph.value_info).find(|o| o.name == output);
    let width = declared.and_then(|o| match o.type_.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t.shape.as_ref().and_then(|s| s.dim.last()).map(|d| d.dim_value()),
        _ => None,
    });
    let output_column = match width {
        Some(2) => 1,
        Some(w) if w > 2 => {
            return Err(OnnxError::Output {
                what: format!("'{output}' is {w} wide; a Quiver model returns one value per candidate"),
            })
        }
        _ => 0,
    };
    let probability = PROBABILITY_OPS.contains(&producer.op_type.as_str()) || output_column == 1;
    let output_kind = output_kind.unwrap_or(if probability { OutputKind::Raw } else { OutputKind::Logit });
    let layout: Vec<(String, Vec<InputSegment>)> =
        fed.iter().zip(&segments).map(|(vi, s)| (vi.name.clone(), s.clone())).collect();
    let inputs = fed
        .iter()
        .zip(&typed)
        .map(|(vi, &(element, rank, width))| OnnxInput { name: vi.name.clone(), width, element, rank })
        .collect();
    let kept = OnnxGraph {
        bytes: servable_bytes(proto, opts, &output)?.into(),
        inputs,
        output: output.clone(),
        output_column,
        output_probability: false,
        output_kind,
    };
    let model = Model { onnx: Some(kept), ..opts.model(&layout) };
    model.validate()?;
    let mapped: Vec<String> = layout
        .iter()
        .map(|(n, s)| {
            let parts: Vec<String> = s.iter().map(|g| format!("{} {}", source_name(g.source), g.dim)).collect();
            format!("'{n}' <- {}", parts.join(", "))
        })
        .collect();
    Ok(Imported {
        model,
        output,
        sigmoid_dropped: false,
        output_column,
        layout,
        producer: String::new(),
        rewrites: vec![format!("kept whole for onnxruntime: {}", mapped.join("; "))],
    })
}
