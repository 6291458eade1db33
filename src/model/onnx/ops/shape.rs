//! Ops that move, relabel or pick data without arithmetic: `Identity`,
//! `Dropout` (the identity at inference), `Cast`, `Flatten`, `Reshape`,
//! `Concat`, `Slice` of a graph input, `Gather` (an embedding lookup) and
//! `Constant`. Each reads its node and the tensors bound so far, and
//! returns the tensor its output names; only `Concat`, `Slice` and
//! `Gather` add a graph node.

use onnx_protobuf::NodeProto;

use super::super::builder::{expect_const, expect_flat, expect_val, operands, Builder, Operand, Val};
use super::super::proto::{
    attr, attr_int, dtype_name, node_err, node_name, numel, tensor_bool, tensor_f32, tensor_i64, DT_FLOAT, DT_INT32,
    DT_INT64,
};
use super::super::OnnxError;
use super::Output;
use crate::model::graph::Op;

/// `Identity`: its input, unchanged.
pub(super) fn identity(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")
}

/// `Dropout` in eval mode: its input, with a rewrite note.
pub(super) fn dropout(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let mut ops = operands(b, node, 1..=3)?;
    if node.input.len() == 3 && !node.input[2].is_empty() {
        let t = expect_const(node, ops.remove(2), "training_mode")?;
        let on = tensor_bool(t)?;
        if on {
            return Err(node_err(node, "training_mode is true; export the model in eval mode"));
        }
    }
    b.notes.push(format!("removed Dropout '{}' (inference is the identity)", node_name(node)));
    expect_val(node, ops.remove(0), "input")
}

/// `Cast` to FLOAT (nothing to do) or to an integer type (marks the tensor
/// as embedding indices).
pub(super) fn cast(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(v)
}

/// `Flatten` that keeps the batch axis: the per-row shape becomes flat.
pub(super) fn flatten(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let axis = attr_int(node, "axis", Some(1))?;
    let mut v = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    if axis != 1 && !(axis == -1 && v.dims.len() == 1) {
        return Err(node_err(node, format!("axis {axis}; only axis 1 (keep the batch) is supported")));
    }
    let total = numel(&v.dims).ok_or_else(|| node_err(node, format!("flattens {:?}, too large", v.dims)))?;
    v.dims = vec![total];
    Ok(v)
}

/// `Reshape` by a constant shape that keeps the batch axis: only the
/// per-row shape changes.
pub(super) fn reshape(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let mut ops = operands(b, node, 2..=2)?;
    let shape = tensor_i64(expect_const(node, ops.remove(1), "shape")?)?;
    let mut v = expect_val(node, ops.remove(0), "data input")?;
    let total = numel(&v.dims).ok_or_else(|| node_err(node, format!("reshapes {:?}, too large", v.dims)))?;
    let shown = if v.dims.len() == 1 { format!("[batch, {}]", total) } else { format!("[batch, {:?}]", v.dims) };
    let refuse = || {
        node_err(
            node,
            format!("reshapes {shown} to {shape:?}; only a reshape that keeps the batch dimension is supported"),
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
    Ok(v)
}

/// `Concat` of `[batch, width]` tensors along the feature axis: a `Concat`
/// node.
pub(super) fn concat(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(b.flat(Op::Concat, inputs, width))
}

/// `Slice` of a graph input's columns, step 1: an `Input` node over the
/// columns it selects.
pub(super) fn slice(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(b.flat(Op::Input { offset: offset + start }, vec![], end - start))
}

/// `Gather` of rows of a constant table by integer indices: an `Embedding`
/// node, `[k, dim]` per candidate for `k` indices.
pub(super) fn gather(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(Val { node: n, dims: vec![k, dim], ints: false })
}

/// `Constant` with a tensor `value`: bound as a constant, like an
/// initializer, for the ops that read constants.
pub(super) fn constant<'g>(_: &mut Builder<'g>, node: &'g NodeProto) -> Result<Output<'g>, OnnxError> {
    let t = attr(node, "value")
        .and_then(|a| a.t.as_ref())
        .ok_or_else(|| node_err(node, "only a Constant with a tensor 'value' attribute is supported"))?;
    Ok(Output { index: 0, tensor: Operand::Const(t) })
}
