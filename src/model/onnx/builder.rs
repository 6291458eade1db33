//! The graph under construction while an ONNX graph is imported: the
//! nodes made so far, the tensors bound to them and the constants, and the
//! checks and node-making steps every op's import shares (an operand that
//! must be computed or constant, a `[batch, width]` shape, an affine or
//! dense node).

use std::collections::HashMap;

use onnx_protobuf::{NodeProto, TensorProto};

use super::proto::{node_err, tensor_f32};
use super::OnnxError;
use crate::model::graph::{Act, Node as GNode, Op};
use crate::model::Layer;

/// A tensor the interpreter computes: a graph node, the per-row shape it
/// has in ONNX (`[width]` for `[batch, width]`; `[k, d]` for an embedding
/// gather), and whether it was cast to an integer type (embedding indices).
#[derive(Clone, Debug)]
pub(super) struct Val {
    pub(super) node: usize,
    pub(super) dims: Vec<usize>,
    pub(super) ints: bool,
}

/// A node's input: a tensor computed from the graph inputs, or a constant
/// (an initializer or a `Constant` node's value).
pub(super) enum Operand<'g> {
    Val(Val),
    Const(&'g TensorProto),
}

/// The graph under construction: nodes in topological order, the ONNX
/// tensors bound to them, and the constants.
pub(super) struct Builder<'g> {
    pub(super) nodes: Vec<GNode>,
    pub(super) vals: HashMap<String, Val>,
    pub(super) consts: HashMap<&'g str, &'g TensorProto>,
    pub(super) notes: Vec<String>,
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

    pub(super) fn push(&mut self, op: Op, inputs: Vec<usize>, width: usize) -> usize {
        self.nodes.push(GNode { op, inputs, width });
        self.nodes.len() - 1
    }

    pub(super) fn flat(&mut self, op: Op, inputs: Vec<usize>, width: usize) -> Val {
        Val { node: self.push(op, inputs, width), dims: vec![width], ints: false }
    }

    pub(super) fn width(&self, v: &Val) -> usize {
        self.nodes[v.node].width
    }
}

/// The operand as a computed tensor, or an error naming its `role`.
pub(super) fn expect_val(node: &NodeProto, op: Operand<'_>, role: &str) -> Result<Val, OnnxError> {
    match op {
        Operand::Val(v) => Ok(v),
        Operand::Const(t) => Err(node_err(
            node,
            format!("the {role} '{}' is a constant; it must be computed from the graph inputs", t.name),
        )),
    }
}

/// The operand as a constant, or an error naming its `role`.
pub(super) fn expect_const<'g>(node: &NodeProto, op: Operand<'g>, role: &str) -> Result<&'g TensorProto, OnnxError> {
    match op {
        Operand::Const(t) => Ok(t),
        Operand::Val(_) => Err(node_err(
            node,
            format!("the {role} must be an initializer or a Constant, not computed from the inputs"),
        )),
    }
}

/// A `[batch, width]` tensor, or an error naming its shape.
pub(super) fn expect_flat(node: &NodeProto, v: &Val) -> Result<usize, OnnxError> {
    match v.dims[..] {
        [w] => Ok(w),
        _ => {
            Err(node_err(node, format!("reads a [batch, {:?}] tensor; only [batch, width] is supported here", v.dims)))
        }
    }
}

/// The node's operands once it has a number of inputs in `n`; an empty
/// name (an optional input left out) is skipped.
pub(super) fn operands<'g>(
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

/// How many values constant `t` holds when it is a vector (`[w]` or
/// `[1, w]`); 1 for anything else, which `const_vec` then judges.
pub(super) fn const_width(t: &TensorProto) -> usize {
    match t.dims[..] {
        [w] | [1, w] => usize::try_from(w).unwrap_or(1).max(1),
        _ => 1,
    }
}

/// A float constant broadcast to `width` values: a scalar, or exactly
/// `width` values (`[w]` or `[1, w]`).
pub(super) fn const_vec(node: &NodeProto, t: &TensorProto, width: usize) -> Result<Vec<f32>, OnnxError> {
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

/// The affine node `(x − center) · scale + shift` over `v`.
pub(super) fn affine(b: &mut Builder<'_>, v: &Val, center: Vec<f32>, scale: Vec<f32>, shift: Vec<f32>) -> Val {
    let w = b.width(v);
    let node = b.push(Op::Affine { center, scale, shift }, vec![v.node], w);
    Val { node, dims: v.dims.clone(), ints: false }
}

/// A dense node from row-major `[out][in]` f32 weights.
pub(super) fn dense(b: &mut Builder<'_>, v: &Val, k: usize, n: usize, weights: Vec<f32>, bias: Vec<f32>) -> Val {
    let layer = Layer::quantize(k, n, false, weights, bias);
    b.flat(Op::Dense { layer, act: Act::None }, vec![v.node], n)
}

/// The two-class probability tensor `[1 − p, p]` for the positive-class
/// probability node `p`, as classifiers output it; the output selection
/// takes column 1 back out.
pub(super) fn two_class(b: &mut Builder<'_>, p: Val) -> Val {
    let neg = affine(b, &p, vec![0.0], vec![-1.0], vec![1.0]);
    b.flat(Op::Concat, vec![neg.node, p.node], 2)
}

/// The activation node `act(x)`; a LeakyRelu's slope must be finite.
pub(super) fn act_node(b: &mut Builder<'_>, node: &NodeProto, x: Val, act: Act) -> Result<Val, OnnxError> {
    if let Act::LeakyRelu(a) = act {
        if !a.is_finite() {
            return Err(node_err(node, format!("alpha {a} is not finite")));
        }
    }
    let w = b.width(&x);
    let n = b.push(Op::Act(act), vec![x.node], w);
    Ok(Val { node: n, dims: x.dims, ints: false })
}
