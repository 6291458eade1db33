//! Elementwise ops: `Add`, `Sub`, `Mul`, `Div` (of two computed tensors,
//! or of a tensor and a constant, which is an affine node), `Neg`,
//! `Reciprocal`, `Pow` by a constant exponent, and the activations `Relu`,
//! `LeakyRelu`, `Tanh`, `Sigmoid`, `Erf`, `Gelu` and `Sqrt`. Each reads its
//! node and the tensors bound so far, adds the nodes that compute it, and
//! returns the tensor its output names.

use onnx_protobuf::NodeProto;

use super::super::builder::{
    act_node, affine, const_vec, const_width, expect_const, expect_flat, expect_val, operands, Builder, Operand, Val,
};
use super::super::proto::{attr_float, attr_string, node_err, node_name, tensor_f32};
use super::super::OnnxError;
use crate::model::graph::{Act, Op};

pub(super) fn add(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    arithmetic(b, node, &Op::Add)
}

pub(super) fn sub(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    arithmetic(b, node, &Op::Sub)
}

pub(super) fn mul(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    arithmetic(b, node, &Op::Mul)
}

pub(super) fn div(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    arithmetic(b, node, &Op::Div)
}

/// `op` (`Op::Add`, `Sub`, `Mul` or `Div`) of two computed tensors
/// (elementwise, the second may be 1 wide) or of a tensor and a constant
/// (an affine node).
fn arithmetic(b: &mut Builder<'_>, node: &NodeProto, op: &Op) -> Result<Val, OnnxError> {
    let name = node.op_type.as_str();
    let ops = operands(b, node, 2..=2)?;
    let [p, q] = <[Operand<'_>; 2]>::try_from(ops).map_err(|_| node_err(node, "two inputs expected"))?;
    match (p, q) {
        (Operand::Val(x), Operand::Val(y)) => {
            let (wx, wy) = (expect_flat(node, &x)?, expect_flat(node, &y)?);
            let commutes = matches!(op, Op::Add | Op::Mul);
            let (x, y) = if wx == 1 && wy > 1 && commutes { (y, x) } else { (x, y) };
            if b.width(&x) == 1 && b.width(&y) > 1 {
                return Err(node_err(node, format!("{name} of a 1-wide tensor by a wider one is not supported")));
            }
            let (wx, wy) = (b.width(&x), b.width(&y));
            if wx != wy && wy != 1 {
                return Err(node_err(
                    node,
                    format!("its inputs are {wx} and {wy} wide; equal widths or a scalar expected"),
                ));
            }
            Ok(b.flat(op.clone(), vec![x.node, y.node], wx))
        }
        (Operand::Val(x), Operand::Const(c)) | (Operand::Const(c), Operand::Val(x))
            if matches!(op, Op::Mul) && b.width(&x) == 1 && const_width(c) > 1 =>
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
            let identity = if matches!(op, Op::Mul | Op::Div) { c == one } else { c == zero };
            if identity {
                b.notes.push(format!("removed {name} '{}' by an identity constant", node_name(node)));
                return Ok(x);
            }
            Ok(match op {
                Op::Add => affine(b, &x, zero, one, c),
                Op::Sub => affine(b, &x, c, one, zero),
                Op::Mul => affine(b, &x, zero.clone(), c, zero),
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
                Op::Add => affine(b, &x, zero, vec![1.0; w], c),
                Op::Sub => affine(b, &x, zero, vec![-1.0; w], c),
                Op::Mul => affine(b, &x, zero.clone(), c, zero),
                _ => return Err(node_err(node, "divides a constant by a computed tensor, which is not supported")),
            })
        }
        (Operand::Const(_), Operand::Const(_)) => {
            Err(node_err(node, "combines two constants; fold them before export (onnx-simplifier does)"))
        }
    }
}

// tf2onnx writes Keras's LayerNormalization with `Neg` and `Reciprocal`
// (the mean's negation, the reciprocal of the standard deviation).

/// `Neg`: the affine node `-x`.
pub(super) fn neg(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    let w = expect_flat(node, &x)?;
    Ok(affine(b, &x, vec![0.0; w], vec![-1.0; w], vec![0.0; w]))
}

/// `Reciprocal`: ones divided by `x`.
pub(super) fn reciprocal(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    let w = expect_flat(node, &x)?;
    let ones = affine(b, &x, vec![0.0; w], vec![0.0; w], vec![1.0; w]);
    Ok(b.flat(Op::Div, vec![ones.node, x.node], w))
}

/// `Pow` by a constant exponent of 3, 2, 1 or 0.5, as products or `Sqrt`.
pub(super) fn pow(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let mut ops = operands(b, node, 2..=2)?;
    let e = expect_const(node, ops.remove(1), "exponent")?;
    let x = expect_val(node, ops.remove(0), "base")?;
    let w = expect_flat(node, &x)?;
    let (_, e) = tensor_f32(e)?;
    Ok(match e[..] {
        [2.0] => b.flat(Op::Mul, vec![x.node, x.node], w),
        // The cube of the tanh-form GELU as Keras writes it.
        [3.0] => {
            let square = b.flat(Op::Mul, vec![x.node, x.node], w);
            b.flat(Op::Mul, vec![square.node, x.node], w)
        }
        [0.5] => act_node(b, node, x, Act::Sqrt)?,
        [1.0] => x,
        _ => return Err(node_err(node, format!("exponent {e:?}; only 3, 2, 1 and 0.5 are supported"))),
    })
}

pub(super) fn relu(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    activation(b, node, Act::Relu)
}

pub(super) fn leaky_relu(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let act = Act::LeakyRelu(attr_float(node, "alpha", 0.01)?);
    activation(b, node, act)
}

pub(super) fn tanh(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    activation(b, node, Act::Tanh)
}

pub(super) fn sigmoid(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    activation(b, node, Act::Sigmoid)
}

pub(super) fn erf(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    activation(b, node, Act::Erf)
}

pub(super) fn sqrt(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    activation(b, node, Act::Sqrt)
}

/// `Gelu` (opset 20), in its erf form or, with `approximate = "tanh"`, its
/// tanh form. Exporters before it write either form out node by node,
/// which `Graph::simplify` recognises.
pub(super) fn gelu(b: &mut Builder<'_>, node: &NodeProto) -> Result<Val, OnnxError> {
    let act = match attr_string(node, "approximate").as_deref() {
        None | Some("none") => Act::GeluErf,
        Some("tanh") => Act::GeluTanh,
        Some(other) => return Err(node_err(node, format!("approximate = '{other}' is not known"))),
    };
    activation(b, node, act)
}

/// The activation node `act` over the node's one input.
fn activation(b: &mut Builder<'_>, node: &NodeProto, act: Act) -> Result<Val, OnnxError> {
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    act_node(b, node, x, act)
}
