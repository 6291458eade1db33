//! Ops over the feature axis: `ReduceSum` and `ReduceMean` (a `Sum` node),
//! a two-class `Softmax` head (the sigmoid of a logit difference) and the
//! `ai.onnx.ml` `Normalizer` of a two-class probability pair (the
//! identity).

use onnx_protobuf::NodeProto;

use super::super::builder::{
    act_node, affine, dense, expect_const, expect_flat, expect_val, operands, two_class, Builder, Operand, Val,
};
use super::super::proto::{attr_int, attr_ints, attr_string, node_err, node_name, tensor_i64};
use super::super::OnnxError;
use super::Output;
use crate::model::graph::{Act, Op};

pub(super) fn reduce_sum(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    reduce(b, node, false)
}

pub(super) fn reduce_mean(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    reduce(b, node, true)
}

/// The sum over the feature axis (axes from the input of opset 13 or the
/// attribute before it), divided by the width for a `mean`.
fn reduce(b: &mut Builder<'_>, node: &NodeProto, mean: bool) -> Result<Val, OnnxError> {
    let mut ops = operands(b, node, 1..=2)?;
    let axes = if ops.len() == 2 {
        tensor_i64(expect_const(node, ops.remove(1), "axes")?)?
    } else {
        attr_ints(node, "axes").unwrap_or_default()
    };
    let x = expect_val(node, ops.remove(0), "input")?;
    expect_flat(node, &x)?;
    if axes != [1] && axes != [-1] {
        return Err(node_err(node, format!("axes {axes:?}; only a sum over the feature axis (1) is supported")));
    }
    // keepdims or not, the row sum is one value per candidate.
    let sum = b.flat(Op::Sum, vec![x.node], 1);
    if mean {
        let n = b.width(&x) as f32;
        Ok(affine(b, &sum, vec![0.0], vec![1.0 / n], vec![0.0]))
    } else {
        Ok(sum)
    }
}

/// A two-class `Softmax` over a dense layer's two outputs: the positive
/// class's probability `softmax([z0, z1])[1] = sigmoid(z1 − z0)`, one dense
/// row of weight differences, as the two-class pair.
pub(super) fn softmax(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let axis = attr_int(node, "axis", Some(-1))?;
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    let w = expect_flat(node, &x)?;
    if (axis != -1 && axis != 1) || w != 2 {
        return Err(node_err(
            node,
            format!("is a Softmax over {w} values (axis {axis}); only a two-class head is supported"),
        ));
    }
    let Op::Dense { layer, act: Act::None } = &b.nodes[x.node].op else {
        return Err(node_err(node, "follows something other than a dense layer; a two-class Softmax must read one"));
    };
    let k = layer.in_dim;
    let weights: Vec<f32> = (0..k).map(|i| layer.weights_f32[k + i] - layer.weights_f32[i]).collect();
    let bias = vec![layer.bias[1] - layer.bias[0]];
    let src = Val { node: b.nodes[x.node].inputs[0], dims: vec![k], ints: false };
    let z = dense(b, &src, k, 1, weights, bias);
    let p = act_node(b, node, z, Act::Sigmoid)?;
    b.notes.push(format!("two-class Softmax '{}' as the sigmoid of the logit difference", node_name(node)));
    Ok(two_class(b, p))
}

/// `Normalizer` (`ai.onnx.ml`) with L1 norm of a two-class probability
/// pair `[1 − p, p]`, which is the identity; binds output 0.
pub(super) fn normalizer<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<Output<'g>, OnnxError> {
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    let norm = attr_string(node, "norm").unwrap_or_default();
    let pair = matches!(b.nodes[x.node].op, Op::Concat) && b.nodes[x.node].width == 2;
    if norm != "L1" || !pair {
        return Err(node_err(node, "only the L1 normalization of a two-class probability pair is supported"));
    }
    Ok(Output { index: 0, tensor: Operand::Val(x) })
}
