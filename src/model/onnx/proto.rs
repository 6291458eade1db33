//! Reading the decoded protobuf: a node's name and attributes, constant
//! tensors' dimensions and values, a graph input's width, and the errors
//! that name the node, initializer or input at fault. Every reader checks
//! what the file claims (types, counts, dimension products) before it is
//! used, so a hostile file gets a typed error, never a panic or a huge
//! allocation.

use onnx_protobuf::{attribute_proto::AttributeType, tensor_proto, type_proto};
use onnx_protobuf::{AttributeProto, NodeProto, TensorProto, ValueInfoProto};
use protobuf::Enum as _;

use super::OnnxError;
use crate::model::graph::EMBEDDING_FLOATS_MAX;

/// ONNX `TensorProto.DataType` codes this module reads.
pub(super) const DT_FLOAT: i32 = 1;
pub(super) const DT_INT64: i32 = 7;
pub(super) const DT_INT32: i32 = 6;

pub(super) fn node_name(node: &NodeProto) -> String {
    if node.name.is_empty() {
        format!("<unnamed {} -> {}>", node.op_type, node.output.join(","))
    } else {
        node.name.clone()
    }
}

pub(super) fn node_err(node: &NodeProto, what: impl Into<String>) -> OnnxError {
    OnnxError::Node { node: node_name(node), op: node.op_type.clone(), what: what.into() }
}

pub(super) fn attr<'n>(node: &'n NodeProto, name: &str) -> Option<&'n AttributeProto> {
    node.attribute.iter().find(|a| a.name == name)
}

fn attr_kind_ok(a: &AttributeProto, kind: AttributeType) -> bool {
    matches!(a.type_.enum_value(), Ok(k) if k == kind || k == AttributeType::UNDEFINED)
}

pub(super) fn attr_int(node: &NodeProto, name: &str, default: Option<i64>) -> Result<i64, OnnxError> {
    match attr(node, name) {
        Some(a) if attr_kind_ok(a, AttributeType::INT) => Ok(a.i),
        Some(_) => Err(node_err(node, format!("attribute '{name}' is not an integer"))),
        None => default.ok_or_else(|| node_err(node, format!("attribute '{name}' is missing"))),
    }
}

pub(super) fn attr_float(node: &NodeProto, name: &str, default: f32) -> Result<f32, OnnxError> {
    match attr(node, name) {
        Some(a) if attr_kind_ok(a, AttributeType::FLOAT) => Ok(a.f),
        Some(_) => Err(node_err(node, format!("attribute '{name}' is not a float"))),
        None => Ok(default),
    }
}

pub(super) fn attr_floats(node: &NodeProto, name: &str) -> Vec<f32> {
    attr(node, name).map(|a| a.floats.clone()).unwrap_or_default()
}

pub(super) fn attr_string(node: &NodeProto, name: &str) -> Option<String> {
    attr(node, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

pub(super) fn attr_ints(node: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(node, name).map(|a| a.ints.clone())
}

pub(super) fn dtype_name(code: i32) -> String {
    match tensor_proto::DataType::from_i32(code) {
        Some(t) => format!("{t:?}"),
        None => format!("unknown type {code}"),
    }
}

/// Dimensions of a constant, checked to be non-negative and to fit memory:
/// as many floats as the largest embedding table (values are only ever
/// read from data the file or its external data holds, never made up to
/// fill dimensions; the graph's own limits apply after import).
pub(super) fn tensor_dims(t: &TensorProto) -> Result<(Vec<usize>, usize), OnnxError> {
    let bad = |what: String| OnnxError::Initializer { name: t.name.clone(), what };
    let mut dims = Vec::with_capacity(t.dims.len());
    let mut numel = 1usize;
    for &d in &t.dims {
        let d = usize::try_from(d).map_err(|_| bad(format!("negative dimension in {:?}", t.dims)))?;
        numel = numel
            .checked_mul(d)
            .filter(|n| *n <= EMBEDDING_FLOATS_MAX)
            .ok_or_else(|| bad(format!("dimensions {:?} are too large", t.dims)))?;
        dims.push(d);
    }
    if t.data_location.enum_value() == Ok(tensor_proto::DataLocation::EXTERNAL) {
        return Err(bad("stored in an external data file, which is not supported".into()));
    }
    Ok((dims, numel))
}

/// The number of elements of `dims`, or `None` when it overflows.
pub(super) fn numel(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, d| n.checked_mul(*d))
}

/// A float constant's dimensions and values (from `raw_data` or `float_data`).
pub(super) fn tensor_f32(t: &TensorProto) -> Result<(Vec<usize>, Vec<f32>), OnnxError> {
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

pub(super) fn tensor_i64(t: &TensorProto) -> Result<Vec<i64>, OnnxError> {
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

pub(super) fn tensor_bool(t: &TensorProto) -> Result<bool, OnnxError> {
    let bad = || OnnxError::Initializer { name: t.name.clone(), what: "is not a boolean scalar".into() };
    let v =
        if !t.raw_data.is_empty() { t.raw_data.first().copied().map(i32::from) } else { t.int32_data.first().copied() };
    v.map(|x| x != 0).ok_or_else(bad)
}

/// Width of a `[batch, width]` graph input, and whether it holds integers
/// (INT64 or INT32: categorical ids, mapped to `context_ids`).
pub(super) fn input_width(vi: &ValueInfoProto) -> Result<(usize, bool), OnnxError> {
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
