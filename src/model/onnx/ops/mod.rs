//! The op table: every ONNX op the importer reads, by domain and op type,
//! and the function that imports it. `apply` looks a node's op up here,
//! checks its outputs as the entry says and binds what the function
//! returns; everything an op means lives in its family's module
//! (`shape`, `elementwise`, `linear`, `normalize`, `reduce`,
//! `tree_ensemble`). An op not in the table is refused with its name, a
//! hint where one helps, and the list of supported ops.
//!
//! An import function reads its node (attributes, and inputs through the
//! builder's bound tensors and constants) and adds graph nodes to the
//! builder; it never binds a tensor itself: it returns the value of the
//! node's one output (`Import::Value`), or names the output its tensor
//! belongs to (`Import::Output`: a constant, a classifier's scores).

mod elementwise;
mod linear;
mod normalize;
mod reduce;
mod shape;
mod tree_ensemble;

use onnx_protobuf::NodeProto;

use super::builder::{Builder, Operand, Val};
use super::proto::{node_err, node_name};
use super::OnnxError;
use Domain::{Ml, Onnx};

/// The domain an op belongs to: the default one (`""` or `ai.onnx`) or
/// `ai.onnx.ml`, the classical-ML ops of skl2onnx and onnxmltools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Domain {
    Onnx,
    Ml,
}

/// A tensor an `Import::Output` function hands back: output `index` of the
/// node is `tensor`. A node without that output binds nothing (a
/// classifier exported without its scores output).
pub(super) struct Output<'g> {
    pub(super) index: usize,
    pub(super) tensor: Operand<'g>,
}

type ValueFn = for<'g> fn(&mut Builder<'g>, &'g NodeProto) -> Result<Val, OnnxError>;
type OutputFn = for<'g> fn(&mut Builder<'g>, &'g NodeProto) -> Result<Output<'g>, OnnxError>;

/// How an op's import function hands back what it computed.
#[derive(Clone, Copy)]
enum Import {
    /// The value of the node's output 0. `extra_outputs`: whether outputs
    /// after it are allowed (Dropout's mask, a normalization's saved
    /// statistics), which nothing in an inference graph reads: reading one
    /// fails later as unbound. Without it the node must have one output.
    Value { import: ValueFn, extra_outputs: bool },
    /// The tensor of the output it names; the node's outputs are not
    /// checked.
    Output(OutputFn),
}

/// One row of the table.
struct Entry {
    domain: Domain,
    op_type: &'static str,
    import: Import,
}

const fn one(domain: Domain, op_type: &'static str, import: ValueFn) -> Entry {
    Entry { domain, op_type, import: Import::Value { import, extra_outputs: false } }
}

const fn first(domain: Domain, op_type: &'static str, import: ValueFn) -> Entry {
    Entry { domain, op_type, import: Import::Value { import, extra_outputs: true } }
}

const fn named(domain: Domain, op_type: &'static str, import: OutputFn) -> Entry {
    Entry { domain, op_type, import: Import::Output(import) }
}

/// Every op the importer reads, sorted by domain, then op type (`lookup`
/// searches it; a test keeps it sorted and in step with `SUPPORTED_OPS`).
/// `ZipMap` is not here: output selection reads through it.
static OPS: [Entry; 36] = [
    one(Onnx, "Add", elementwise::add),
    first(Onnx, "BatchNormalization", normalize::batch_normalization),
    one(Onnx, "Cast", shape::cast),
    one(Onnx, "Concat", shape::concat),
    named(Onnx, "Constant", shape::constant),
    one(Onnx, "Div", elementwise::div),
    first(Onnx, "Dropout", shape::dropout),
    one(Onnx, "Erf", elementwise::erf),
    one(Onnx, "Flatten", shape::flatten),
    one(Onnx, "Gather", shape::gather),
    one(Onnx, "Gelu", elementwise::gelu),
    one(Onnx, "Gemm", linear::gemm),
    one(Onnx, "Identity", shape::identity),
    first(Onnx, "LayerNormalization", normalize::layer_normalization),
    one(Onnx, "LeakyRelu", elementwise::leaky_relu),
    one(Onnx, "MatMul", linear::matmul),
    one(Onnx, "Mul", elementwise::mul),
    one(Onnx, "Neg", elementwise::neg),
    one(Onnx, "Pow", elementwise::pow),
    one(Onnx, "Reciprocal", elementwise::reciprocal),
    one(Onnx, "ReduceMean", reduce::reduce_mean),
    one(Onnx, "ReduceSum", reduce::reduce_sum),
    one(Onnx, "Relu", elementwise::relu),
    one(Onnx, "Reshape", shape::reshape),
    one(Onnx, "Sigmoid", elementwise::sigmoid),
    one(Onnx, "Slice", shape::slice),
    one(Onnx, "Softmax", reduce::softmax),
    one(Onnx, "Sqrt", elementwise::sqrt),
    one(Onnx, "Sub", elementwise::sub),
    one(Onnx, "Tanh", elementwise::tanh),
    named(Ml, "LinearClassifier", linear::linear_ml),
    named(Ml, "LinearRegressor", linear::linear_ml),
    named(Ml, "Normalizer", reduce::normalizer),
    named(Ml, "Scaler", normalize::scaler),
    named(Ml, "TreeEnsembleClassifier", tree_ensemble::tree_ensemble),
    named(Ml, "TreeEnsembleRegressor", tree_ensemble::tree_ensemble),
];

fn lookup(domain: Domain, op_type: &str) -> Option<&'static Entry> {
    OPS.binary_search_by(|e| (e.domain, e.op_type).cmp(&(domain, op_type))).ok().map(|i| &OPS[i])
}

/// Imports one node: looks its op up, checks its outputs, runs the op's
/// import and binds the tensor it returns to the output it belongs to.
pub(super) fn apply<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<(), OnnxError> {
    let domain = match node.domain.as_str() {
        "" | "ai.onnx" => Onnx,
        "ai.onnx.ml" => Ml,
        other => {
            let op = format!("{other}::{}", node.op_type);
            return Err(OnnxError::UnsupportedOp { op, node: node_name(node), hint: String::new() });
        }
    };
    let Some(entry) = lookup(domain, &node.op_type) else { return Err(unsupported(domain, node)) };
    match entry.import {
        Import::Value { import, extra_outputs } => {
            if node.output.is_empty() || (node.output.len() > 1 && !extra_outputs) {
                return Err(node_err(node, format!("has {} outputs; one expected", node.output.len())));
            }
            let v = import(b, node)?;
            b.vals.insert(node.output[0].clone(), v);
        }
        Import::Output(import) => {
            let Output { index, tensor } = import(b, node)?;
            if let Some(name) = node.output.get(index) {
                match tensor {
                    Operand::Val(v) => {
                        b.vals.insert(name.clone(), v);
                    }
                    Operand::Const(t) => {
                        b.consts.insert(name.as_str(), t);
                    }
                }
            }
        }
    }
    Ok(())
}

/// The refusal of an op the table does not hold, with a hint where a
/// supported op may do.
fn unsupported(domain: Domain, node: &NodeProto) -> OnnxError {
    let (op, hint) = match (domain, node.op_type.as_str()) {
        (Onnx, "Elu" | "Selu" | "PRelu" | "Softplus" | "HardSigmoid") => {
            (node.op_type.clone(), " (graph activations: Relu, LeakyRelu, Tanh, Sigmoid, Erf, Gelu, Sqrt)")
        }
        (Onnx, _) => (node.op_type.clone(), ""),
        (Ml, _) => (format!("ai.onnx.ml::{}", node.op_type), ""),
    };
    OnnxError::UnsupportedOp { op, node: node_name(node), hint: hint.into() }
}

#[cfg(test)]
mod tests {
    use super::super::SUPPORTED_OPS;
    use super::*;

    #[test]
    fn the_table_is_sorted_and_each_op_is_in_it_once() {
        for w in OPS.windows(2) {
            let (a, b) = ((w[0].domain, w[0].op_type), (w[1].domain, w[1].op_type));
            assert!(a < b, "{a:?} is not before {b:?}");
        }
        for e in &OPS {
            assert!(std::ptr::eq(lookup(e.domain, e.op_type).unwrap(), e), "{}", e.op_type);
        }
        assert!(lookup(Onnx, "Scaler").is_none() && lookup(Ml, "Add").is_none());
    }

    /// The ops `SUPPORTED_OPS` names (what an unsupported op's error lists):
    /// its words that start with a capital, outside parentheses.
    fn listed() -> Vec<String> {
        let mut depth = 0;
        let outside: String = SUPPORTED_OPS
            .chars()
            .map(|c| {
                depth += i32::from(c == '(') - i32::from(c == ')');
                if depth > 0 || c == ')' {
                    ' '
                } else {
                    c
                }
            })
            .collect();
        outside
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn the_supported_ops_message_names_exactly_the_tables_ops() {
        let mut listed = listed();
        listed.sort_unstable();
        // Output selection reads through a ZipMap; it is never imported.
        let mut table: Vec<String> = OPS.iter().map(|e| e.op_type).chain(["ZipMap"]).map(str::to_string).collect();
        table.sort_unstable();
        assert_eq!(listed, table);
    }
}
