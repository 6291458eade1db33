//! `ai.onnx.ml` `TreeEnsembleClassifier` and `TreeEnsembleRegressor` (what
//! onnxmltools writes for LightGBM and XGBoost and skl2onnx for
//! scikit-learn's gradient boosting) into a `Trees` node.
//!
//! The node tables (`nodes_*`, per tree and node id) become the canonical
//! splits of `model::trees`: `BRANCH_LEQ`/`BRANCH_LT` keep the true branch
//! on the left, `BRANCH_GTE`/`BRANCH_GT` put the false branch there, and a
//! NaN takes the true branch where `nodes_missing_value_tracks_true` says
//! so, the false one otherwise, as onnxruntime does. Thresholds stored as
//! doubles are rounded down to f32 as the canonical rule needs. A binary
//! classifier's positive-class probability is onnxruntime's: the sigmoid of
//! the positive class's summed weights plus its base value.

use std::collections::HashMap;

use onnx_protobuf::{AttributeProto, NodeProto};

use super::super::builder::{act_node, expect_flat, expect_val, operands, two_class, Builder, Operand, Val};
use super::super::proto::{attr, attr_ints, attr_string, node_err, node_name};
use super::super::OnnxError;
use super::Output;
use crate::model::graph::{Act, Op};
use crate::model::trees::{f32_at_most, f32_below_f64, Ensemble, Split, TreeNode, TREES_MAX};

/// Floats of `name`, or of `name_as_tensor` (float or double) as f64.
fn floats_f64(node: &NodeProto, name: &str) -> Result<Option<Vec<f64>>, OnnxError> {
    if let Some(a) = attr(node, name) {
        return Ok(Some(a.floats.iter().map(|v| *v as f64).collect()));
    }
    let Some(a) = attr(node, &format!("{name}_as_tensor")) else { return Ok(None) };
    tensor_values(node, a, name).map(Some)
}

fn tensor_values(node: &NodeProto, a: &AttributeProto, name: &str) -> Result<Vec<f64>, OnnxError> {
    let t = a.t.as_ref().ok_or_else(|| node_err(node, format!("{name}_as_tensor holds no tensor")))?;
    const FLOAT: i32 = 1;
    const DOUBLE: i32 = 11;
    // chunks_exact would drop a ragged tail silently, and with it the
    // values of the last nodes.
    let size = if t.data_type == DOUBLE { 8 } else { 4 };
    if t.raw_data.len() % size != 0 {
        return Err(node_err(
            node,
            format!("{name}_as_tensor has {} bytes of raw data, not a multiple of {size}", t.raw_data.len()),
        ));
    }
    Ok(match (t.data_type, t.raw_data.is_empty()) {
        (FLOAT, true) => t.float_data.iter().map(|v| *v as f64).collect(),
        (FLOAT, false) => {
            t.raw_data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect()
        }
        (DOUBLE, true) => t.double_data.clone(),
        (DOUBLE, false) => {
            t.raw_data.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("chunks of 8"))).collect()
        }
        (other, _) => {
            return Err(node_err(node, format!("{name}_as_tensor has element type {other}; float or double expected")))
        }
    })
}

/// `TreeEnsembleClassifier` (binary: binds its probabilities, output 1;
/// output 0 is the label) or `TreeEnsembleRegressor` (binds its value).
pub(super) fn tree_ensemble<'g>(b: &mut Builder<'g>, node: &'g NodeProto) -> Result<Output<'g>, OnnxError> {
    let x = expect_val(node, operands(b, node, 1..=1)?.remove(0), "input")?;
    let k = expect_flat(node, &x)?;
    let out = ensemble(b, node, x, k)?;
    let index = if node.op_type == "TreeEnsembleClassifier" { 1 } else { 0 };
    Ok(Output { index, tensor: Operand::Val(out) })
}

/// The `Trees` node of the ensemble over `x` (`width` features) and, for a
/// classifier, its sigmoid as the two-class probability pair.
fn ensemble(b: &mut Builder<'_>, node: &NodeProto, x: Val, width: usize) -> Result<Val, OnnxError> {
    let classifier = node.op_type == "TreeEnsembleClassifier";
    let err = |what: String| node_err(node, what);
    let ints = |name: &str| attr_ints(node, name).ok_or_else(|| err(format!("attribute '{name}' is missing")));
    let tree_ids = ints("nodes_treeids")?;
    let node_ids = ints("nodes_nodeids")?;
    let features = ints("nodes_featureids")?;
    let true_ids = ints("nodes_truenodeids")?;
    let false_ids = ints("nodes_falsenodeids")?;
    let values = floats_f64(node, "nodes_values")?.ok_or_else(|| err("attribute 'nodes_values' is missing".into()))?;
    let modes: Vec<String> = attr(node, "nodes_modes")
        .map(|a| a.strings.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect())
        .ok_or_else(|| err("attribute 'nodes_modes' is missing".into()))?;
    let n = tree_ids.len();
    let tracks = attr_ints(node, "nodes_missing_value_tracks_true").unwrap_or_else(|| vec![0; n]);
    if [node_ids.len(), features.len(), true_ids.len(), false_ids.len(), values.len(), modes.len(), tracks.len()]
        .iter()
        .any(|l| *l != n)
    {
        return Err(err("its nodes_* attributes differ in length".into()));
    }

    // Leaf weights: (tree, node) -> weight of the served output.
    let prefix = if classifier { "class" } else { "target" };
    let w_tree = ints(&format!("{prefix}_treeids"))?;
    let w_node = ints(&format!("{prefix}_nodeids"))?;
    let w_id = ints(&format!("{prefix}_ids"))?;
    let w = floats_f64(node, &format!("{prefix}_weights"))?
        .ok_or_else(|| err(format!("attribute '{prefix}_weights' is missing")))?;
    if [w_node.len(), w_id.len(), w.len()].iter().any(|l| *l != w_tree.len()) {
        return Err(err(format!("its {prefix}_* attributes differ in length")));
    }
    let base_values = floats_f64(node, "base_values")?.unwrap_or_default();
    let post = attr_string(node, "post_transform").unwrap_or_else(|| "NONE".into());
    let ids_max = w_id.iter().copied().max().unwrap_or(0);
    let (served_id, base) = if classifier {
        let labels = attr_ints(node, "classlabels_int64s")
            .map(|v| v.len())
            .or_else(|| attr(node, "classlabels_strings").map(|a| a.strings.len()))
            .unwrap_or(0);
        if labels != 2 {
            return Err(err(format!("has {labels} classes; only binary classifiers are supported")));
        }
        if post != "LOGISTIC" {
            return Err(err(format!(
                "post_transform {post} is not supported for a classifier (LOGISTIC, the boosted-trees form, is)"
            )));
        }
        if ids_max == 0 && w.iter().all(|v| *v >= 0.0) {
            // onnxruntime then returns the sum itself as the probability.
            return Err(err("every leaf weight is positive, which onnxruntime reads as a probability, not a \
                            margin; not supported"
                .into()));
        }
        // One score column (class id 0) is the positive class's margin;
        // with two, class 1's column is.
        let id = if ids_max >= 1 { 1 } else { 0 };
        (id, base_values.get(id as usize).copied().unwrap_or(0.0))
    } else {
        let targets = attr(node, "n_targets").map_or(1, |a| a.i);
        if targets != 1 || ids_max != 0 {
            return Err(err(format!("has {targets} targets; only single-target regressors are supported")));
        }
        if post != "NONE" {
            return Err(err(format!("post_transform {post} is not supported for a regressor")));
        }
        (0, base_values.first().copied().unwrap_or(0.0))
    };
    let mut leaf_w: HashMap<(i64, i64), f64> = HashMap::new();
    for k in 0..w_tree.len() {
        if w_id[k] == served_id {
            *leaf_w.entry((w_tree[k], w_node[k])).or_insert(0.0) += w[k];
        }
    }

    // Trees in ascending id; each tree's nodes by id.
    let mut by_tree: std::collections::BTreeMap<i64, HashMap<i64, usize>> = Default::default();
    for k in 0..n {
        if by_tree.entry(tree_ids[k]).or_default().insert(node_ids[k], k).is_some() {
            return Err(err(format!("tree {} has node id {} twice", tree_ids[k], node_ids[k])));
        }
    }
    if by_tree.len() > TREES_MAX {
        return Err(err(format!("has {} trees; the limit is {TREES_MAX}", by_tree.len())));
    }
    let mut e = Ensemble { base: base as f32, ..Ensemble::default() };
    for (&t, ids) in &by_tree {
        let root = *ids.keys().min().expect("a tree has a node");
        let mut order = vec![root];
        let mut slot: HashMap<i64, u32> = HashMap::from([(root, 0)]);
        let mut nodes = Vec::new();
        let mut k = 0;
        while k < order.len() {
            let id = order[k];
            let at = ids[&id];
            let mode = modes[at].as_str();
            if mode == "LEAF" {
                nodes.push(TreeNode::leaf(leaf_w.get(&(t, id)).copied().unwrap_or(0.0) as f32));
                k += 1;
                continue;
            }
            let v = values[at];
            // A float threshold widened to f64 rounds to itself, so one rule
            // serves thresholds stored as floats and as doubles.
            // (threshold, true branch on the left?)
            let (threshold, true_left) = match mode {
                "BRANCH_LEQ" => (f32_at_most(v), true),
                "BRANCH_LT" => (f32_below_f64(v), true),
                "BRANCH_GTE" => (f32_below_f64(v), false),
                "BRANCH_GT" => (f32_at_most(v), false),
                other => {
                    return Err(err(format!(
                        "tree {t} node {id}: mode {other} is not supported (BRANCH_LEQ, BRANCH_LT, BRANCH_GTE, \
                         BRANCH_GT and LEAF are)"
                    )))
                }
            };
            let feature = u32::try_from(features[at]).ok().filter(|f| (*f as usize) < width).ok_or_else(|| {
                err(format!("tree {t} node {id} splits on feature {}, past the input's {width}", features[at]))
            })?;
            let (l, r) = if true_left { (true_ids[at], false_ids[at]) } else { (false_ids[at], true_ids[at]) };
            let mut child = |c: i64| -> Result<u32, OnnxError> {
                if !ids.contains_key(&c) || slot.contains_key(&c) {
                    return Err(err(format!("tree {t} node {id}: child {c} is missing or reached twice")));
                }
                let s = order.len() as u32;
                slot.insert(c, s);
                order.push(c);
                Ok(s)
            };
            let (left, right) = (child(l)?, child(r)?);
            let missing_left = (tracks[at] != 0) == true_left;
            nodes.push(TreeNode {
                split: Split::Numeric { feature, threshold, missing_left, zero_missing: false },
                left,
                right,
            });
            k += 1;
        }
        if order.len() != ids.len() {
            return Err(err(format!("tree {t} has nodes its root does not reach")));
        }
        e.push_tree(&nodes);
    }
    e.validate(width).map_err(err)?;
    let trees = e.trees();
    let mut v = b.flat(Op::Trees(e), vec![x.node], 1);
    if !classifier {
        if attr_string(node, "aggregate_function").is_some_and(|a| a != "SUM") {
            return Err(err("aggregate_function other than SUM is not supported".into()));
        }
        b.notes.push(format!("{} '{}': {trees} trees", node.op_type, node_name(node)));
        return Ok(v);
    }
    v = act_node(b, node, v, Act::Sigmoid)?;
    b.notes.push(format!("{} '{}': {trees} trees, LOGISTIC", node.op_type, node_name(node)));
    Ok(two_class(b, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use onnx_protobuf::TensorProto;

    #[test]
    fn ragged_raw_thresholds_are_refused() {
        let node = NodeProto { op_type: "TreeEnsembleRegressor".into(), ..Default::default() };
        let tensor = |data_type: i32, bytes: usize| AttributeProto {
            t: Some(TensorProto { data_type, raw_data: vec![0; bytes], ..Default::default() }).into(),
            ..Default::default()
        };
        assert_eq!(tensor_values(&node, &tensor(1, 8), "nodes_values").unwrap(), vec![0.0, 0.0]);
        assert_eq!(tensor_values(&node, &tensor(11, 8), "nodes_values").unwrap(), vec![0.0]);
        for (data_type, bytes) in [(1, 7), (11, 12)] {
            let e = tensor_values(&node, &tensor(data_type, bytes), "nodes_values").unwrap_err().to_string();
            assert!(e.contains(&format!("{bytes} bytes of raw data, not a multiple")), "{e}");
        }
    }
}
