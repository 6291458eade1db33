//! `quiver import --lightgbm` and `--xgboost`: gradient-boosted trees from
//! the frameworks' own files (LightGBM's text model, `Booster.save_model`;
//! XGBoost's JSON model, `save_model("m.json")`) into a graph model of one
//! `Trees` node over the input vector.
//!
//! Each format's split rule is translated here into the canonical one of
//! `model::trees` (see there); what a format can express that Quiver does not
//! serve (multiclass, linear trees, ranking and count objectives, DART
//! weights, XGBoost categorical splits) is refused with the reason.
//!
//! The framework's feature names (LightGBM's `feature_names=` line,
//! XGBoost's `learner.feature_names`) go into the model file
//! (`Model::feature_names`): reason codes name features by them, and a
//! name the server could not print or list is refused here rather than
//! served mangled.

use std::path::Path;

use super::graph::{Graph, Node, Op, OutputKind};
use super::onnx::{Imported, InputMapping};
use super::trees::{
    f32_at_most, f32_below, Ensemble, Split, TreeNode, CATEGORY_WORDS_MAX, CATEGORY_WORDS_TOTAL_MAX,
    ENSEMBLE_NODES_MAX, TREES_MAX, TREE_NODES_MAX,
};
use super::{valid_feature_name, InputSegment, Model, ModelError, FEATURE_NAME_BYTES_MAX, MODEL_HEAP_BYTES_MAX};

#[derive(Debug, thiserror::Error)]
pub enum GbdtError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: file is {bytes} bytes, the limit is {MODEL_HEAP_BYTES_MAX}")]
    TooLarge { path: String, bytes: u64 },
    #[error("{path}: not a valid {format} model (truncated or corrupt?): {what}")]
    Parse { path: String, format: &'static str, what: String },
    #[error("{path}: {what}")]
    Unsupported { path: String, what: String },
    #[error("--inputs: {what}")]
    Mapping { what: String },
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// What a tree-model import needs besides the file.
#[derive(Clone, Debug)]
pub struct GbdtOptions {
    pub name: String,
    pub version: u32,
    pub inputs: InputMapping,
    /// `None`: what the objective says (binary: logit; regression: raw).
    /// `Some(Raw)` on a binary model serves its margin as is.
    pub output_kind: Option<OutputKind>,
}

/// A parsed ensemble and what its objective makes of the sum.
#[derive(Clone, Debug)]
pub struct Parsed {
    pub ensemble: Ensemble,
    pub features: usize,
    pub kind: OutputKind,
    /// The logit is this times the margin (LightGBM's `sigmoid:` parameter).
    pub logit_scale: f32,
    pub objective: String,
    pub producer: String,
    /// The framework's feature names, one per feature; empty when it named
    /// none (or only by its defaults, LightGBM's `Column_0`…).
    pub names: Vec<String>,
}

/// Why a parse failed, before the path is attached.
enum Fail {
    Parse(String),
    Unsupported(String),
}

fn parse_err(what: impl Into<String>) -> Fail {
    Fail::Parse(what.into())
}

fn read(path: &Path) -> Result<String, GbdtError> {
    let p = path.display().to_string();
    let io = |source| GbdtError::Io { path: p.clone(), source };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MODEL_HEAP_BYTES_MAX as u64 {
        return Err(GbdtError::TooLarge { path: p, bytes: len });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    String::from_utf8(bytes).map_err(|_| GbdtError::Parse {
        path: p,
        format: "text",
        what: "the file is not UTF-8 text (an XGBoost .ubj or a binary model? save it as text or JSON)".into(),
    })
}

fn attach(path: &str, format: &'static str, f: Fail) -> GbdtError {
    match f {
        Fail::Parse(what) => GbdtError::Parse { path: path.into(), format, what },
        Fail::Unsupported(what) => GbdtError::Unsupported { path: path.into(), what },
    }
}

/// Reads and imports a LightGBM text model.
pub fn import_lightgbm_file(path: &Path, opts: &GbdtOptions) -> Result<Imported, GbdtError> {
    import_lightgbm_text(&read(path)?, &path.display().to_string(), opts)
}

/// Imports a LightGBM text model already in memory.
pub fn import_lightgbm_text(text: &str, path_for_errors: &str, opts: &GbdtOptions) -> Result<Imported, GbdtError> {
    let parsed = parse_lightgbm(text).map_err(|f| attach(path_for_errors, "LightGBM text", f))?;
    build(parsed, opts, path_for_errors)
}

/// Reads and imports an XGBoost JSON model.
pub fn import_xgboost_file(path: &Path, opts: &GbdtOptions) -> Result<Imported, GbdtError> {
    import_xgboost_text(&read(path)?, &path.display().to_string(), opts)
}

/// Imports an XGBoost JSON model already in memory.
pub fn import_xgboost_text(text: &str, path_for_errors: &str, opts: &GbdtOptions) -> Result<Imported, GbdtError> {
    let parsed = parse_xgboost(text).map_err(|f| attach(path_for_errors, "XGBoost JSON", f))?;
    build(parsed, opts, path_for_errors)
}

/// The model for a parsed ensemble: `Input` of all features, `Trees`, and
/// for a scaled sigmoid an `Affine` of the margin.
pub fn build(parsed: Parsed, opts: &GbdtOptions, path: &str) -> Result<Imported, GbdtError> {
    let bad = |what: String| GbdtError::Mapping { what };
    if opts.inputs.entries.iter().any(|e| e.graph_input.is_some()) {
        return Err(bad("a tree model has one input vector; write SOURCE:DIM entries without '=' names".into()));
    }
    let total: usize = opts.inputs.entries.iter().map(|e| e.dim).sum();
    if total != parsed.features {
        return Err(bad(format!(
            "the entries add up to {total} features but the model has {} (its features in order are split \
             into the segments as written)",
            parsed.features
        )));
    }
    let kind = match (opts.output_kind, parsed.kind) {
        (None, k) => k,
        (Some(OutputKind::Raw), _) => OutputKind::Raw,
        (Some(OutputKind::Logit), OutputKind::Logit) => OutputKind::Logit,
        (Some(OutputKind::Logit), OutputKind::Raw) => {
            return Err(GbdtError::Unsupported {
                path: path.into(),
                what: format!(
                    "objective '{}' gives a raw value, not a logit; drop --output-kind logit",
                    parsed.objective
                ),
            })
        }
    };
    let mut rewrites = Vec::new();
    let mut nodes = vec![
        Node { op: Op::Input { offset: 0 }, inputs: vec![], width: parsed.features },
        Node { op: Op::Trees(parsed.ensemble), inputs: vec![0], width: 1 },
    ];
    if kind == OutputKind::Logit && parsed.logit_scale != 1.0 {
        let s = parsed.logit_scale;
        nodes.push(Node {
            op: Op::Affine { center: vec![0.0], scale: vec![s], shift: vec![0.0] },
            inputs: vec![1],
            width: 1,
        });
        rewrites.push(format!("the logit is {s} x the trees' sum (objective sigmoid:{s})"));
    }
    let inputs: Vec<InputSegment> =
        opts.inputs.entries.iter().map(|e| InputSegment { source: e.source, dim: e.dim }).collect();
    let model = Model {
        name: opts.name.clone(),
        version: opts.version,
        inputs: inputs.clone(),
        layers: Vec::new(),
        calibration: None,
        graph: Some(Graph { nodes, output: kind }),
        onnx: None,
        feature_names: parsed.names,
    };
    model.validate()?;
    Ok(Imported {
        model,
        output: format!("objective {}", parsed.objective),
        sigmoid_dropped: false,
        output_column: 0,
        layout: vec![("features".into(), inputs)],
        producer: parsed.producer,
        rewrites,
    })
}

/// The numbers of a whitespace-separated list, at most `count_max` of
/// them: a line longer than any valid tree could need is refused before it
/// is parsed into a vector several times its size.
fn numbers<T: std::str::FromStr>(s: &str, key: &str, count_max: usize) -> Result<Vec<T>, Fail> {
    let mut out = Vec::new();
    for v in s.split_whitespace() {
        if out.len() == count_max {
            return Err(parse_err(format!("{key} has more than {count_max} values")));
        }
        out.push(v.parse::<T>().map_err(|_| parse_err(format!("{key}: '{v}' is not a number")))?);
    }
    Ok(out)
}

/// Most `key=value` lines in the header or in one tree block. LightGBM
/// writes about 20 of each; the bound keeps a file of millions of short
/// distinct keys from growing a map many times the file's size.
const LIGHTGBM_KEYS_MAX: usize = 256;

/// Parses LightGBM's text model format (the `tree` header, `Tree=N`
/// blocks, `end of trees`).
fn parse_lightgbm(text: &str) -> Result<Parsed, Fail> {
    let mut lines = text.lines().map(str::trim_end);
    if lines.next().map(str::trim) != Some("tree") {
        return Err(parse_err("a LightGBM text model starts with the line 'tree'"));
    }
    let mut header = std::collections::HashMap::new();
    let mut flags = Vec::new();
    let mut blocks: Vec<std::collections::HashMap<&str, &str>> = Vec::new();
    let mut ended = false;
    for line in lines {
        if line == "end of trees" {
            ended = true;
            break;
        }
        if line.starts_with("Tree=") {
            if blocks.len() == TREES_MAX {
                return Err(Fail::Unsupported(format!("the model has more than {TREES_MAX} trees")));
            }
            blocks.push(Default::default());
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let keys = blocks.last().map_or(header.len() + flags.len(), |b| b.len());
        if keys >= LIGHTGBM_KEYS_MAX {
            let place = if blocks.is_empty() { "the header".to_string() } else { format!("tree {}", blocks.len() - 1) };
            return Err(parse_err(format!("{place} has more than {LIGHTGBM_KEYS_MAX} lines")));
        }
        match (line.split_once('='), blocks.last_mut()) {
            (Some((k, v)), Some(b)) => {
                b.insert(k, v);
            }
            (Some((k, v)), None) => {
                header.insert(k, v);
            }
            (None, None) => flags.push(line),
            (None, Some(_)) => return Err(parse_err(format!("unexpected line '{line}' in a tree"))),
        }
    }
    if !ended {
        return Err(parse_err("no 'end of trees' line (the file is truncated)"));
    }
    let unsupported = |w: String| Err(Fail::Unsupported(w));
    let int = |k: &str| -> Result<i64, Fail> {
        header
            .get(k)
            .ok_or_else(|| parse_err(format!("no {k}= line")))?
            .trim()
            .parse()
            .map_err(|_| parse_err(format!("{k} is not an integer")))
    };
    if int("num_class")? != 1 || int("num_tree_per_iteration")? != 1 {
        return unsupported("multiclass models are not supported yet (num_class must be 1)".into());
    }
    if flags.contains(&"average_output") {
        return unsupported("random-forest mode (average_output) is not supported yet".into());
    }
    let max_feature_idx = int("max_feature_idx")?;
    let features = max_feature_idx
        .checked_add(1)
        .and_then(|f| usize::try_from(f).ok())
        .ok_or_else(|| parse_err(format!("max_feature_idx {max_feature_idx} is out of range")))?;
    let objective_line = header.get("objective").copied().unwrap_or("").trim();
    let mut words = objective_line.split_whitespace();
    let objective = words.next().unwrap_or("").to_string();
    let params: Vec<&str> = words.collect();
    let (kind, logit_scale) = match objective.as_str() {
        "binary" => {
            let s = params.iter().find_map(|p| p.strip_prefix("sigmoid:")).unwrap_or("1");
            let s: f32 = s.parse().map_err(|_| parse_err(format!("objective sigmoid '{s}' is not a number")))?;
            if !(s.is_finite() && s > 0.0) {
                return Err(parse_err(format!("objective sigmoid {s} is not positive")));
            }
            (OutputKind::Logit, s)
        }
        "cross_entropy" | "xentropy" => (OutputKind::Logit, 1.0),
        "regression" | "regression_l2" | "l2" | "mean_squared_error" | "mse" | "regression_l1" | "l1" | "huber"
        | "fair" | "quantile" | "mape" => {
            if params.contains(&"sqrt") {
                return unsupported(format!("objective '{objective_line}' (sqrt-transformed labels) is not supported"));
            }
            (OutputKind::Raw, 1.0)
        }
        "" => return Err(parse_err("no objective= line")),
        other => {
            return unsupported(format!(
                "objective '{other}' is not supported (binary, cross_entropy and the regression objectives are; \
                 multiclass, ranking and exp-linked objectives such as poisson are not, yet)"
            ))
        }
    };
    if blocks.is_empty() {
        return Err(parse_err("the model has no trees"));
    }
    let mut e = Ensemble::default();
    // Explanation weighs branches by the training rows that reached them
    // (LightGBM's own pred_contrib reads the same counts); a model saved
    // without them on some tree (hand-written, or from an old writer)
    // scores but is not explainable.
    let mut covers = Some(Vec::new());
    for (t, b) in blocks.iter().enumerate() {
        let at = |what: String| parse_err(format!("tree {t}: {what}"));
        let get = |k: &str| b.get(k).copied().ok_or_else(|| at(format!("no {k}= line")));
        if b.get("is_linear").is_some_and(|v| v.trim() == "1") {
            return unsupported(format!("tree {t} is a linear tree (linear_tree=true), which is not supported"));
        }
        let leaves: usize = get("num_leaves")?.trim().parse().map_err(|_| at("num_leaves is not a number".into()))?;
        // A tree of n leaves has n - 1 splits; bounding n before any array
        // is parsed bounds every array of the tree.
        let leaves_max = TREE_NODES_MAX.div_ceil(2);
        if leaves == 0 || leaves > leaves_max {
            return Err(at(format!("num_leaves {leaves} is outside 1..={leaves_max}")));
        }
        let tree_nodes = 2 * leaves - 1;
        if e.nodes.len() + tree_nodes > ENSEMBLE_NODES_MAX {
            return Err(Fail::Unsupported(format!("the trees have more than {ENSEMBLE_NODES_MAX} nodes in all")));
        }
        let leaf_value: Vec<f64> = numbers(get("leaf_value")?, "leaf_value", leaves)?;
        if leaf_value.len() != leaves {
            return Err(at(format!("{} leaf values for {leaves} leaves", leaf_value.len())));
        }
        let leaf_count: Option<Vec<f64>> = match b.get("leaf_count") {
            Some(v) => Some(numbers(v, "leaf_count", leaves)?).filter(|c: &Vec<f64>| c.len() == leaves),
            None => None,
        };
        if leaves == 1 {
            e.push_tree(&[TreeNode::leaf(leaf_value[0] as f32)]);
            // A lone leaf's value is its expectation, whatever its cover.
            if let Some(c) = covers.as_mut() {
                c.push(leaf_count.map_or(0.0, |l| l[0] as f32));
            }
            continue;
        }
        let splits = leaves - 1;
        let feature: Vec<u32> = numbers(get("split_feature")?, "split_feature", splits)?;
        let threshold: Vec<f64> = numbers(get("threshold")?, "threshold", splits)?;
        let decision: Vec<u8> = numbers(get("decision_type")?, "decision_type", splits)?;
        let left: Vec<i64> = numbers(get("left_child")?, "left_child", splits)?;
        let right: Vec<i64> = numbers(get("right_child")?, "right_child", splits)?;
        if [feature.len(), threshold.len(), decision.len(), left.len(), right.len()].iter().any(|l| *l != splits) {
            return Err(at(format!("the split arrays are not all {splits} long")));
        }
        // Each categorical split has its own bitset, so there are at most as
        // many bitsets as splits; the bound comes before `num_cat + 1`.
        let num_cat: usize = b.get("num_cat").map_or(Ok(0), |v| v.trim().parse()).map_err(|_| at("num_cat".into()))?;
        if num_cat > splits {
            return Err(at(format!("num_cat {num_cat} is more than its {splits} splits")));
        }
        let (bounds, words): (Vec<usize>, Vec<u32>) = if num_cat > 0 {
            (
                numbers(get("cat_boundaries")?, "cat_boundaries", num_cat + 1)?,
                numbers(get("cat_threshold")?, "cat_threshold", num_cat * CATEGORY_WORDS_MAX)?,
            )
        } else {
            (Vec::new(), Vec::new())
        };
        if num_cat > 0
            && (bounds.len() != num_cat + 1
                || bounds[0] != 0
                || bounds.windows(2).any(|w| w[1] < w[0])
                || bounds[num_cat] > words.len())
        {
            return Err(at("cat_boundaries do not index cat_threshold".into()));
        }
        let child = |c: i64| -> Result<u32, Fail> {
            // A leaf is written as !leaf_index (-1 is leaf 0); leaves follow
            // the splits in the node array.
            let i = if c >= 0 {
                usize::try_from(c).ok().filter(|i| *i < splits)
            } else {
                usize::try_from(!c).ok().filter(|l| *l < leaves).map(|l| splits + l)
            };
            i.map(|i| i as u32).ok_or_else(|| at(format!("child {c} is out of range")))
        };
        let mut nodes = Vec::with_capacity(splits + leaves);
        for i in 0..splits {
            let dt = decision[i];
            let split = if dt & 1 != 0 {
                let k = threshold[i];
                if !(k >= 0.0 && k.fract() == 0.0 && (k as usize) < num_cat) {
                    return Err(at(format!("categorical split {i} names bitset {k} of {num_cat}")));
                }
                let k = k as usize;
                let bitset = &words[bounds[k]..bounds[k + 1]];
                if bitset.is_empty() || bitset.len() > CATEGORY_WORDS_MAX {
                    return Err(at(format!(
                        "categorical split {i} has a bitset of {} words; 1 to {CATEGORY_WORDS_MAX} allowed",
                        bitset.len()
                    )));
                }
                // Splits may share a bitset and each gets a copy, so the
                // total is bounded here, before the copy, not by the file.
                if e.cat_words.len() + bitset.len() > CATEGORY_WORDS_TOTAL_MAX {
                    return Err(Fail::Unsupported(format!(
                        "the categorical bitsets have more than {CATEGORY_WORDS_TOTAL_MAX} words in all"
                    )));
                }
                let (start, len) = e.push_words(bitset);
                Split::Categorical { feature: feature[i], start, len }
            } else {
                let t = threshold[i];
                let default_left = dt & 2 != 0;
                let (missing_left, zero_missing) = match (dt >> 2) & 3 {
                    // None: a NaN is read as 0 and compared.
                    0 => (0.0 <= t, false),
                    // Zero: NaN is read as 0, and zero (|x| <= 1e-35) is missing.
                    1 => (default_left, true),
                    2 => (default_left, false),
                    m => return Err(at(format!("split {i} has missing type {m}"))),
                };
                Split::Numeric { feature: feature[i], threshold: f32_at_most(t), missing_left, zero_missing }
            };
            nodes.push(TreeNode { split, left: child(left[i])?, right: child(right[i])? });
        }
        nodes.extend(leaf_value.iter().map(|v| TreeNode::leaf(*v as f32)));
        e.push_tree(&nodes);
        let internal_count: Option<Vec<f64>> = match b.get("internal_count") {
            Some(v) => Some(numbers(v, "internal_count", splits)?).filter(|c: &Vec<f64>| c.len() == splits),
            None => None,
        };
        covers = match (covers, internal_count, leaf_count) {
            // Splits first, then leaves: the order of `nodes`.
            (Some(mut c), Some(i), Some(l)) => {
                c.extend(i.iter().chain(&l).map(|v| *v as f32));
                Some(c)
            }
            _ => None,
        };
    }
    e.covers = covers.unwrap_or_default();
    let version = header.get("version").copied().unwrap_or("?");
    let names: Vec<&str> = header.get("feature_names").map_or(Vec::new(), |l| l.split_whitespace().collect());
    // LightGBM names unnamed columns `Column_<i>`: no names at all.
    let defaults = names.iter().enumerate().all(|(i, n)| *n == format!("Column_{i}"));
    let names = if defaults { Vec::new() } else { names };
    Ok(Parsed {
        ensemble: e,
        features,
        kind,
        logit_scale,
        objective,
        producer: format!("LightGBM text model {version}"),
        names: feature_names(names, features, "feature_names")?,
    })
}

/// A JSON number that is a whole non-negative index (f64 holds every
/// integer up to 2^53 exactly).
fn index(v: f64) -> Option<usize> {
    (v >= 0.0 && v.fract() == 0.0 && v < (1u64 << 53) as f64).then_some(v as usize)
}

/// Parses XGBoost's JSON model (`save_model("m.json")`, XGBoost 1.0 and later).
fn parse_xgboost(text: &str) -> Result<Parsed, Fail> {
    use serde_json::Value;
    let root: Value = serde_json::from_str(text).map_err(|e| parse_err(format!("not JSON: {e}")))?;
    let learner = root.get("learner").ok_or_else(|| parse_err("no 'learner' object (is this an XGBoost model?)"))?;
    let field = |v: &Value, path: &str| -> Result<Value, Fail> {
        let mut cur = v;
        for k in path.split('.') {
            cur = cur.get(k).ok_or_else(|| parse_err(format!("no '{path}'")))?;
        }
        Ok(cur.clone())
    };
    // XGBoost writes its parameters as strings ("5E-1", "[5E-1]" since 3.1).
    let num = |v: &Value, what: &str| -> Result<f64, Fail> {
        let s = match v {
            Value::String(s) => s.trim().trim_start_matches('[').trim_end_matches(']').to_string(),
            Value::Number(n) => n.to_string(),
            _ => return Err(parse_err(format!("{what} is not a number"))),
        };
        if s.contains(',') {
            return Err(Fail::Unsupported(format!("{what} has several values (a multi-output model)")));
        }
        s.parse().map_err(|_| parse_err(format!("{what} '{s}' is not a number")))
    };
    let params = field(learner, "learner_model_param")?;
    let booster = field(learner, "gradient_booster")?;
    let booster_name = booster.get("name").and_then(Value::as_str).unwrap_or("");
    if booster_name != "gbtree" {
        return Err(Fail::Unsupported(format!(
            "booster '{booster_name}' is not supported (gbtree is; dart's tree weights and gblinear are not)"
        )));
    }
    let classes = num(&field(&params, "num_class")?, "num_class")?;
    let targets = params.get("num_target").map_or(Ok(1.0), |v| num(v, "num_target"))?;
    if classes > 1.0 || targets > 1.0 {
        return Err(Fail::Unsupported("multiclass and multi-target models are not supported yet".into()));
    }
    let num_feature = num(&field(&params, "num_feature")?, "num_feature")?;
    let features = index(num_feature).ok_or_else(|| parse_err(format!("num_feature {num_feature} is not a count")))?;
    let base_score = num(&field(&params, "base_score")?, "base_score")?;
    let objective = field(learner, "objective.name")?.as_str().unwrap_or("").to_string();
    // base_score is in the objective's output space; the margin starts at
    // its link: the logit for the logistic objectives.
    let (kind, base) = match objective.as_str() {
        "binary:logistic" | "reg:logistic" => {
            if !(base_score > 0.0 && base_score < 1.0) {
                return Err(parse_err(format!("base_score {base_score} is not a probability")));
            }
            (OutputKind::Logit, (base_score / (1.0 - base_score)).ln())
        }
        "binary:logitraw" => (OutputKind::Logit, base_score),
        "reg:squarederror" | "reg:absoluteerror" | "reg:pseudohubererror" | "reg:linear" => {
            (OutputKind::Raw, base_score)
        }
        other => {
            return Err(Fail::Unsupported(format!(
                "objective '{other}' is not supported (binary:logistic, binary:logitraw, reg:logistic and the \
                 squared, absolute and pseudo-Huber regressions are)"
            )))
        }
    };
    let trees = field(&booster, "model.trees")?;
    let trees = trees.as_array().ok_or_else(|| parse_err("model.trees is not an array"))?;
    if trees.is_empty() {
        return Err(parse_err("the model has no trees"));
    }
    if trees.len() > TREES_MAX {
        return Err(Fail::Unsupported(format!("the model has {} trees; the limit is {TREES_MAX}", trees.len())));
    }
    let mut e = Ensemble { base: base as f32, ..Ensemble::default() };
    // XGBoost's pred_contribs weighs branches by each node's hessian sum;
    // a model without `sum_hessian` on some tree is not explainable.
    let mut covers = Some(Vec::new());
    for (t, tree) in trees.iter().enumerate() {
        let at = |what: String| parse_err(format!("tree {t}: {what}"));
        let arr = |k: &str| -> Result<Vec<f64>, Fail> {
            let v = tree.get(k).and_then(Value::as_array).ok_or_else(|| at(format!("no '{k}' array")))?;
            v.iter()
                .map(|x| match x {
                    Value::Bool(b) => Ok(*b as u8 as f64),
                    _ => x.as_f64().ok_or_else(|| at(format!("'{k}' holds a non-number"))),
                })
                .collect()
        };
        let left = arr("left_children")?;
        let right = arr("right_children")?;
        let feature = arr("split_indices")?;
        let cond = arr("split_conditions")?;
        let default_left = arr("default_left")?;
        let n = left.len();
        if [right.len(), feature.len(), cond.len(), default_left.len()].iter().any(|l| *l != n) || n == 0 {
            return Err(at("its node arrays differ in length".into()));
        }
        if tree.get("split_type").and_then(Value::as_array).is_some_and(|s| s.iter().any(|v| v.as_f64() != Some(0.0))) {
            return Err(Fail::Unsupported(format!("tree {t} has categorical splits, which are not supported yet")));
        }
        if let Some(size) = tree.get("tree_param").and_then(|p| p.get("size_leaf_vector")) {
            if num(size, "size_leaf_vector")? > 1.0 {
                return Err(Fail::Unsupported("vector leaves (multi-target trees) are not supported".into()));
            }
        }
        if n > TREE_NODES_MAX {
            return Err(at(format!("{n} nodes; the limit is {TREE_NODES_MAX}")));
        }
        // Walk from the root, so deleted (unreachable) nodes are left out.
        // A child or feature that is not a whole non-negative number is
        // refused here, not rounded by a cast into some other node or column.
        let mut slot = vec![u32::MAX; n];
        let mut order = vec![0usize];
        slot[0] = 0;
        let mut k = 0;
        while k < order.len() {
            let i = order[k];
            if left[i] >= 0.0 {
                for c in [left[i], right[i]] {
                    match index(c) {
                        Some(c) if c < n && slot[c] == u32::MAX => {
                            slot[c] = order.len() as u32;
                            order.push(c);
                        }
                        _ => return Err(at(format!("node {i} has child {c}, out of range or reached twice"))),
                    }
                }
                if index(feature[i]).is_none_or(|f| f > u32::MAX as usize) {
                    return Err(at(format!("node {i} splits on feature {}, not a column index", feature[i])));
                }
            }
            k += 1;
        }
        let nodes: Vec<TreeNode> = order
            .iter()
            .map(|&i| {
                if left[i] < 0.0 {
                    TreeNode::leaf(cond[i] as f32)
                } else {
                    TreeNode {
                        split: Split::Numeric {
                            feature: feature[i] as u32,
                            // XGBoost goes left iff x < t.
                            threshold: f32_below(cond[i] as f32),
                            missing_left: default_left[i] != 0.0,
                            zero_missing: false,
                        },
                        left: slot[left[i] as usize],
                        right: slot[right[i] as usize],
                    }
                }
            })
            .collect();
        if e.nodes.len() + nodes.len() > ENSEMBLE_NODES_MAX {
            return Err(Fail::Unsupported(format!("the trees have more than {ENSEMBLE_NODES_MAX} nodes in all")));
        }
        e.push_tree(&nodes);
        covers = match (covers, tree.get("sum_hessian")) {
            (Some(mut c), Some(_)) => {
                let hess = arr("sum_hessian")?;
                if hess.len() != n {
                    return Err(at(format!("{} sum_hessian values for {n} nodes", hess.len())));
                }
                c.extend(order.iter().map(|&i| hess[i] as f32));
                Some(c)
            }
            _ => None,
        };
    }
    e.covers = covers.unwrap_or_default();
    let version: Vec<String> = root
        .get("version")
        .and_then(Value::as_array)
        .map(|v| v.iter().map(|x| x.to_string()).collect())
        .unwrap_or_default();
    let names = match learner.get("feature_names") {
        None => Vec::new(),
        Some(Value::Array(a)) => {
            let named = a.iter().map(|v| v.as_str().ok_or_else(|| parse_err("feature_names holds a non-string")));
            named.collect::<Result<Vec<_>, _>>()?
        }
        Some(_) => return Err(parse_err("feature_names is not an array")),
    };
    Ok(Parsed {
        ensemble: e,
        features,
        kind,
        logit_scale: 1.0,
        objective,
        producer: format!("XGBoost JSON model {}", version.join(".")),
        names: feature_names(names, features, "learner.feature_names")?,
    })
}

/// The framework's feature names as the model file keeps them: none, or
/// one per feature, each a name Quiver can print and list.
fn feature_names(names: Vec<&str>, features: usize, key: &str) -> Result<Vec<String>, Fail> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if names.len() != features {
        return Err(parse_err(format!("{key} names {} features, the model has {features}", names.len())));
    }
    if let Some((i, _)) = names.iter().enumerate().find(|(_, n)| !valid_feature_name(n)) {
        return Err(Fail::Unsupported(format!(
            "{key}: feature {i}'s name is empty, over {FEATURE_NAME_BYTES_MAX} bytes or holds a control character; \
             rename it before saving the model"
        )));
    }
    Ok(names.into_iter().map(str::to_string).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LGB: &str = "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nlabel_index=0\nmax_feature_idx=2\n\
objective=binary sigmoid:1\nfeature_names=a b c\n\nTree=0\nnum_leaves=3\nnum_cat=1\nsplit_feature=0 2\n\
threshold=0.5 0\ndecision_type=10 1\nleft_child=1 -1\nright_child=-2 -3\nleaf_value=0.1 -0.2 0.3\n\
cat_boundaries=0 1\ncat_threshold=6\nis_linear=0\nshrinkage=1\n\n\nTree=1\nnum_leaves=1\nnum_cat=0\n\
leaf_value=0.05\nis_linear=0\nshrinkage=1\n\n\nend of trees\n\nparameters:\nend of parameters\n";

    #[test]
    fn lightgbm_text_splits_translate_to_the_canonical_rule() {
        let p = parse_lightgbm(LGB).ok().unwrap();
        assert_eq!(p.features, 3);
        assert_eq!(p.kind, OutputKind::Logit);
        let e = &p.ensemble;
        e.validate(3).unwrap();
        assert_eq!(e.trees(), 2);
        // decision_type 10 = default left (2) | missing type NaN (8).
        assert!(matches!(e.nodes[0].split, Split::Numeric { missing_left: true, zero_missing: false, .. }));
        let f = |x: [f32; 3]| e.predict_row(&x);
        // x0 <= 0.5 goes to the categorical split on x2 (bits 1, 2 left).
        assert_eq!(f([0.5, 0.0, 1.0]), 0.1 + 0.05);
        assert_eq!(f([0.0, 0.0, 2.0]), 0.1 + 0.05);
        assert_eq!(f([0.0, 0.0, 3.0]), 0.3 + 0.05);
        assert_eq!(f([f32::NAN, 0.0, f32::NAN]), 0.3 + 0.05);
        assert_eq!(f([0.6, 0.0, 1.0]), -0.2 + 0.05);
    }

    #[test]
    fn covers_are_the_row_counts_and_hessian_sums_in_node_order() {
        assert!(parse_lightgbm(LGB).ok().unwrap().ensemble.covers.is_empty(), "no counts, no covers");
        let counted = LGB
            .replace("leaf_value=0.1 -0.2 0.3\n", "leaf_value=0.1 -0.2 0.3\nleaf_count=5 7 3\ninternal_count=15 8\n");
        let e = parse_lightgbm(&counted).ok().unwrap().ensemble;
        e.validate(3).unwrap();
        // Tree 0: splits then leaves; tree 1 is a lone leaf without a count.
        assert_eq!(e.covers, vec![15.0, 8.0, 5.0, 7.0, 3.0, 0.0]);
        assert!(e.has_covers());
        let short = counted.replace("internal_count=15 8", "internal_count=15");
        assert!(parse_lightgbm(&short).ok().unwrap().ensemble.covers.is_empty());

        let plain = xgb("binary:logistic", "0.5");
        assert!(parse_xgboost(&plain).ok().unwrap().ensemble.covers.is_empty());
        let hess = plain.replace("\"split_type\"", "\"sum_hessian\": [4.5, 1.25, 3.25], \"split_type\"");
        assert_eq!(parse_xgboost(&hess).ok().unwrap().ensemble.covers, vec![4.5, 1.25, 3.25]);
        let bad = plain.replace("\"split_type\"", "\"sum_hessian\": [4.5], \"split_type\"");
        match parse_xgboost(&bad) {
            Err(Fail::Parse(w)) => assert!(w.contains("1 sum_hessian values for 3 nodes"), "{w}"),
            _ => panic!("accepted a short sum_hessian"),
        }
    }

    #[test]
    fn lightgbm_refusals_say_why() {
        let refused = |text: String| match parse_lightgbm(&text) {
            Err(Fail::Parse(w)) | Err(Fail::Unsupported(w)) => w,
            Ok(_) => panic!("accepted"),
        };
        assert!(refused(LGB.replace("num_class=1", "num_class=3")).contains("multiclass"));
        assert!(refused(LGB.replace("binary sigmoid:1", "lambdarank")).contains("'lambdarank' is not supported"));
        assert!(refused(LGB.replace("binary sigmoid:1", "poisson")).contains("poisson"));
        assert!(refused(LGB.replace("is_linear=0\nshrinkage=1\n\n\nTree=1", "is_linear=1\n\nTree=1"))
            .contains("linear tree"));
        assert!(refused(LGB[..LGB.find("end of trees").unwrap()].to_string()).contains("truncated"));
        assert!(refused(LGB.replace("left_child=1 -1", "left_child=5 -1")).contains("child 5 is out of range"));
        assert!(refused("{\"learner\": {}}".into()).contains("starts with the line 'tree'"));
        assert!(refused(LGB.replace("leaf_value=0.1 -0.2 0.3", "leaf_value=0.1 x 0.3")).contains("'x' is not a number"));
    }

    #[test]
    fn the_frameworks_feature_names_are_kept_and_bad_ones_refused() {
        let names = |p: Result<Parsed, Fail>| match p {
            Ok(p) => Ok(p.names),
            Err(Fail::Parse(w) | Fail::Unsupported(w)) => Err(w),
        };
        assert_eq!(names(parse_lightgbm(LGB)), Ok(vec!["a".to_string(), "b".into(), "c".into()]));
        // LightGBM's own defaults name nothing; no line, no names.
        let defaults = LGB.replace("feature_names=a b c", "feature_names=Column_0 Column_1 Column_2");
        assert_eq!(names(parse_lightgbm(&defaults)), Ok(vec![]));
        assert_eq!(names(parse_lightgbm(&LGB.replace("feature_names=a b c\n", ""))), Ok(vec![]));
        let short = names(parse_lightgbm(&LGB.replace("feature_names=a b c", "feature_names=a b"))).unwrap_err();
        assert!(short.contains("feature_names names 2 features, the model has 3"), "{short}");
        let long = format!("feature_names=a {} c", "x".repeat(FEATURE_NAME_BYTES_MAX + 1));
        let long = names(parse_lightgbm(&LGB.replace("feature_names=a b c", &long))).unwrap_err();
        assert!(long.contains("feature 1's name is empty, over 256 bytes"), "{long}");

        let plain = xgb("binary:logistic", "0.5");
        assert_eq!(names(parse_xgboost(&plain)), Ok(vec![]));
        let named =
            |list: &str| plain.replace("\"learner\": {", &format!("\"learner\": {{\"feature_names\": {list}, "));
        assert_eq!(names(parse_xgboost(&named("[]"))), Ok(vec![]));
        assert_eq!(names(parse_xgboost(&named(r#"["amount", "hour"]"#))), Ok(vec!["amount".into(), "hour".into()]));
        assert!(names(parse_xgboost(&named(r#"["amount"]"#))).unwrap_err().contains("names 1 features"));
        assert!(names(parse_xgboost(&named(r#"["amount", 3]"#))).unwrap_err().contains("non-string"));
        assert!(names(parse_xgboost(&named(r#"["amount", "a\u0007b"]"#))).unwrap_err().contains("control character"));
        assert!(names(parse_xgboost(&named(r#""amount""#))).unwrap_err().contains("not an array"));
    }

    fn xgb(objective: &str, base: &str) -> String {
        format!(
            r#"{{"learner": {{"learner_model_param": {{"base_score": "{base}", "num_class": "0", "num_feature": "2",
            "num_target": "1"}}, "objective": {{"name": "{objective}"}}, "gradient_booster": {{"name": "gbtree",
            "model": {{"trees": [{{"left_children": [1, -1, -1], "right_children": [2, -1, -1],
            "split_indices": [1, 0, 0], "split_conditions": [0.25, -0.5, 0.75], "default_left": [0, 0, 0],
            "split_type": [0, 0, 0]}}]}}}}}}, "version": [3, 2, 0]}}"#
        )
    }

    #[test]
    fn xgboost_json_uses_strict_less_than_and_the_margin_base() {
        let p = parse_xgboost(&xgb("binary:logistic", "[2.5E-1]")).ok().unwrap();
        let e = &p.ensemble;
        e.validate(2).unwrap();
        let base = (0.25f64 / 0.75).ln() as f32;
        assert_eq!(e.base, base);
        // x1 < 0.25 goes left; equal goes right; NaN follows default (right).
        assert_eq!(e.predict_row(&[0.0, 0.2]), base + -0.5);
        assert_eq!(e.predict_row(&[0.0, 0.25]), base + 0.75);
        assert_eq!(e.predict_row(&[0.0, f32::NAN]), base + 0.75);
        let r = parse_xgboost(&xgb("reg:squarederror", "1.5")).ok().unwrap();
        assert_eq!((r.kind, r.ensemble.base), (OutputKind::Raw, 1.5));
        for (text, want) in [
            (xgb("multi:softprob", "0.5"), "multi:softprob"),
            (xgb("binary:logistic", "0.5").replace("gbtree", "dart"), "dart"),
            (xgb("binary:logistic", "0.5").replace("[0, 0, 0]}", "[1, 0, 0]}"), "categorical"),
            (xgb("binary:logistic", "0.5").replace("[1, -1, -1]", "[1, 1, -1]"), "reached twice"),
            ("not json".into(), "not JSON"),
        ] {
            match parse_xgboost(&text) {
                Err(Fail::Parse(w)) | Err(Fail::Unsupported(w)) => assert!(w.contains(want), "{w}"),
                Ok(_) => panic!("accepted {want}"),
            }
        }
    }

    fn lgb_refusal(text: &str) -> String {
        match parse_lightgbm(text) {
            Err(Fail::Parse(w)) | Err(Fail::Unsupported(w)) => w,
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn lightgbm_hostile_counts_are_typed_errors_not_panics() {
        // num_cat + 1 overflowed and bounds[num_cat] indexed past the end.
        let huge_cat = LGB
            .replace("num_cat=1\n", "num_cat=18446744073709551615\n")
            .replace("cat_boundaries=0 1", "cat_boundaries=");
        assert!(lgb_refusal(&huge_cat).contains("num_cat 18446744073709551615 is more than its 2 splits"));
        let huge_idx = LGB.replace("max_feature_idx=2", "max_feature_idx=9223372036854775807");
        assert!(lgb_refusal(&huge_idx).contains("max_feature_idx 9223372036854775807 is out of range"));
        let huge_leaves = LGB.replace("num_leaves=3", "num_leaves=18446744073709551615");
        assert!(lgb_refusal(&huge_leaves).contains("outside 1..=16384"));
        let min_child = LGB.replace("left_child=1 -1", "left_child=1 -9223372036854775808");
        assert!(lgb_refusal(&min_child).contains("child -9223372036854775808 is out of range"));
        let not_from_zero = LGB.replace("cat_boundaries=0 1", "cat_boundaries=1 1");
        assert!(lgb_refusal(&not_from_zero).contains("cat_boundaries do not index"));
        let many_keys: String = (0..300).map(|k| format!("k{k}=0\n")).collect();
        assert!(lgb_refusal(&LGB.replace("label_index=0\n", &many_keys)).contains("the header has more than 256"));
    }

    #[test]
    fn lightgbm_shared_bitsets_are_bounded_before_they_are_copied() {
        // One 32,768-word bitset named by every split of a balanced tree
        // (heap order): each split gets a copy, so 513 of them make
        // 2^24 + 2^15 words from a file of 64 KiB of bitset.
        let model = |splits: usize| {
            let leaves = splits + 1;
            let child = |c: usize| if c < splits { c as i64 } else { !((c - splits) as i64) };
            let list = |f: &dyn Fn(usize) -> String, n: usize| (0..n).map(f).collect::<Vec<_>>().join(" ");
            let words = 1usize << 15;
            format!(
                "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx=0\nobjective=binary \
                 sigmoid:1\n\nTree=0\nnum_leaves={leaves}\nnum_cat=1\nsplit_feature={}\nthreshold={}\n\
                 decision_type={}\nleft_child={}\nright_child={}\nleaf_value={}\ncat_boundaries=0 {words}\n\
                 cat_threshold={}\n\nend of trees\n",
                list(&|_| "0".into(), splits),
                list(&|_| "0".into(), splits),
                list(&|_| "1".into(), splits),
                list(&|i| child(2 * i + 1).to_string(), splits),
                list(&|i| child(2 * i + 2).to_string(), splits),
                list(&|_| "0".into(), leaves),
                list(&|_| "1".into(), words),
            )
        };
        assert_eq!(parse_lightgbm(&model(512)).ok().unwrap().ensemble.cat_words.len(), 1 << 24);
        assert!(lgb_refusal(&model(513)).contains("more than 16777216 words in all"));
    }

    #[test]
    fn xgboost_indices_must_be_whole_and_in_range() {
        let refused = |text: String| match parse_xgboost(&text) {
            Err(Fail::Parse(w)) | Err(Fail::Unsupported(w)) => w,
            Ok(_) => panic!("accepted"),
        };
        let ok = xgb("binary:logistic", "0.5");
        // A cast turned -1 into column 0 and 1.5 into node 1.
        assert!(refused(ok.replace("[1, 0, 0]", "[-1, 0, 0]")).contains("feature -1, not a column index"));
        assert!(refused(ok.replace("[1, -1, -1]", "[1.5, -1, -1]")).contains("child 1.5, out of range"));
        assert!(refused(ok.replace("\"num_feature\": \"2\"", "\"num_feature\": \"-2\"")).contains("not a count"));
    }
}
