//! Linear layers: `MatMul` and `Gemm` by a constant weight, and the
//! `ai.onnx.ml` `LinearClassifier` (binary) and `LinearRegressor` that
//! skl2onnx writes for scikit-learn's linear models. Each becomes a dense
//! node; a classifier's probability also a sigmoid and the two-class pair.

use onnx_protobuf::NodeProto;

use super::super::builder::{
    act_node, const_vec, dense, expect_const, expect_flat, expect_val, operands, two_class, Builder, Operand, Val,
};
use super::super::proto::{attr_float, attr_floats, attr_int, attr_string, node_err, node_name, tensor_f32};
use super::super::OnnxError;
use super::Output;
use crate::model::graph::Act;

/// `MatMul` of a `[batch, k]` tensor by a constant `[k, n]` weight.
pub(super) fn matmul(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    let weights = out_by_in(&values, k, n, false, 1.0);
    Ok(dense(b, &v, k, n, weights, vec![0.0; n]))
}

/// `Gemm` `alpha · A · B(ᵀ) + beta · C` with `A` computed, `B` and `C`
/// constant: one dense node, `alpha` and `beta` folded into it.
pub(super) fn gemm(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
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
    let weights = out_by_in(&values, k, n, trans_b == 1, alpha);
    let bias = match c {
        Some(c) => const_vec(node, c, n)?.into_iter().map(|y| beta * y).collect(),
        None => vec![0.0f32; n],
    };
    Ok(dense(b, &v, k, n, weights, bias))
}

/// A weight matrix of `k` inputs and `n` outputs as a dense layer stores
/// it, row-major `[n][k]`, times `alpha`: `values` is `[k, n]` as ONNX
/// multiplies it, or `[n, k]` already when `transposed`.
fn out_by_in(values: &[f32], k: usize, n: usize, transposed: bool, alpha: f32) -> Vec<f32> {
    let mut weights = vec![0.0f32; k * n];
    for o in 0..n {
        for i in 0..k {
            let x = if transposed { values[o * k + i] } else { values[i * n + o] };
            weights[o * k + i] = alpha * x;
        }
    }
    weights
}

/// `LinearClassifier` (one class, or the positive class of two) and
/// `LinearRegressor` (one target): a dense row, and for a classifier's
/// probability its sigmoid as the two-class pair. Binds a classifier's
/// scores (output 1; output 0 is the label) or the regressor's value.
pub(super) fn linear_ml<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<Output<'g>, OnnxError> {
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
        2 if post == "SOFTMAX" => ((0..k).map(|i| coef[k + i] - coef[i]).collect(), intercept(1) - intercept(0)),
        2 => (coef[k..].to_vec(), intercept(1)),
        c => return Err(node_err(node, format!("has {c} classes; only binary classifiers are supported"))),
    };
    let z = dense(b, &x, k, 1, weights, vec![bias]);
    if regressor {
        if post != "NONE" {
            return Err(node_err(node, format!("post_transform {post} is not supported for a regressor")));
        }
        return Ok(Output { index: 0, tensor: Operand::Val(z) });
    }
    let out = match post.as_str() {
        "LOGISTIC" | "SOFTMAX" => {
            let p = act_node(b, node, z, Act::Sigmoid)?;
            two_class(b, p)
        }
        "NONE" if classes == 1 => z,
        other => {
            return Err(node_err(node, format!("post_transform {other} is not supported")));
        }
    };
    b.notes.push(format!("{} '{}' as a dense layer", node.op_type, node_name(node)));
    Ok(Output { index: 1, tensor: Operand::Val(out) })
}
