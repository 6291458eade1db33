//! Per-feature normalizations: `BatchNormalization` in eval mode and the
//! `ai.onnx.ml` `Scaler` (affine nodes, which `Graph::simplify` may fold
//! into a dense layer), and `LayerNormalization` over the feature axis (a
//! `LayerNorm` node). Their scales and shifts are constants of the file.

use onnx_protobuf::NodeProto;

use super::super::builder::{
    affine, const_vec, expect_const, expect_flat, expect_val, operands, Builder, Operand, Val,
};
use super::super::proto::{attr_float, attr_floats, attr_int, node_err, node_name};
use super::super::OnnxError;
use super::Output;
use crate::model::graph::Op;

/// `BatchNormalization` with its running statistics: the affine node
/// `(x − mean) · γ / √(var + ε) + β`.
pub(super) fn batch_normalization(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(affine(b, &x, mean, scale, beta))
}

/// `LayerNormalization` over the feature axis: a `LayerNorm` node with
/// its constant scale and optional shift.
pub(super) fn layer_normalization(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    Ok(b.flat(Op::LayerNorm { epsilon, scale, shift }, vec![x.node], w))
}

/// `Scaler` (`ai.onnx.ml`): the affine node `(x − offset) · scale`, kept
/// in f32; binds output 0.
pub(super) fn scaler<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<Output<'g>, OnnxError> {
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
    Ok(Output { index: 0, tensor: Operand::Val(v) })
}
