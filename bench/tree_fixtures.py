#!/usr/bin/env python3
"""Generates the tree-ensemble fixtures under tests/fixtures/trees/.

Why: Quiver's tree scorer has to reproduce what the frameworks themselves
compute for the models that fraud and risk teams actually ship: LightGBM's
text format (with categorical bitset splits and both missing-value types),
XGBoost's JSON, and the ai.onnx.ml TreeEnsembleClassifier /
TreeEnsembleRegressor graphs that onnxmltools and skl2onnx write. This script
trains eleven small models on one synthetic fraud-like data set, records each
framework's raw score and probability (or value) for 2048 held-out rows, and
writes an index, so `cargo test` can check tree parity without Python.

Data: a seeded synthetic card-fraud table, 20,000 training rows and 2,048
held-out rows drawn independently from the same distribution, F = 12 float32
columns (names in FEATURES):
   0 amount             log-normal transaction amount (median about 33)
   1 account_age_days   gamma-distributed account age, whole days
   2 tx_count_1h        transactions in the last hour: Poisson(0.7), so
                        about half the rows hold an exact 0.0
   3 amount_ratio       amount over the account's usual amount (log-normal)
   4 device_risk        standard normal; NaN in about 10% of the rows,
                        completely at random
   5 log_distance_km    normal, distance between billing and shipping
   6 hour_sin           sin of the local hour angle
   7 velocity_z         standard normal spend-velocity z-score
   8 email_score        standard normal e-mail reputation
   9 card_share         beta(2, 5) share of the card limit used
  10 ip_reputation      standard normal; NaN in about 15% of the rows, and
                        the missingness itself raises the risk
  11 merchant_category  an integer id 0..29 stored as float; category
                        probabilities are uneven and four ids carry a large
                        positive risk effect
The label is drawn from a known logistic generating function (fraud_logit):
main effects of every column, an amount x tx_count interaction, a
velocity x (tx_count > 0) interaction, an ip_reputation effect that a
missing value replaces by a fixed +1.1, device_risk contributing 0 where it
is missing, and the per-category effect; the intercept puts the positive
rate near 7%. The regressors' target is a continuous "loss amount"
(loss_target): log1p(amount) scaled by a sigmoid of the same logit, plus a
category term, an amount_ratio term and Gaussian noise.
The script asserts that the held-out rows hold NaNs in columns 4 and 10,
many exact 0.0 values in column 2 and every category id.

Models (all trained single-threaded with fixed seeds; file in parentheses):
  native formats
    lgb_binary        LightGBM objective=binary, 100 trees, num_leaves 31,
                      max_depth 6, learning_rate 0.1, categorical_feature
                      [11] (categorical bitset splits: num_cat > 0), default
                      use_missing (NaN missing type) (lgb_binary.txt,
                      Booster.save_model)
    lgb_regression    LightGBM objective=regression on the loss target, 50
                      trees, num_leaves 15, learning_rate 0.1, no
                      categorical (lgb_regression.txt)
    lgb_zero_missing  LightGBM binary with zero_as_missing=True, 30 trees,
                      num_leaves 31, no categorical (missing type Zero on
                      some node)
                      (lgb_zero_missing.txt)
    lgb_numeric       LightGBM binary, 100 trees, num_leaves 31, max_depth 6,
                      column 11 treated as numeric (lgb_numeric.txt): the
                      native twin of lgb_binary_onnx
    xgb_binary        XGBoost binary:logistic, 100 trees, max_depth 6, eta
                      0.1, tree_method hist, NaN as missing
                      (xgb_binary.json, Booster.save_model JSON)
    xgb_regression    XGBoost reg:squarederror on the loss target, 50 trees,
                      max_depth 5, eta 0.1 (xgb_regression.json)
  ONNX (one float input X [N, 12]; outputs label and probabilities, or
  variable for the regressor; the converters are asked for target_opset 15,
  skl2onnx for {"": 15, "ai.onnx.ml": 3}, but write the lowest opsets their
  nodes need: ai.onnx.ml 1 throughout, default domain 9 (lgb_binary_onnx),
  none (xgb_binary_onnx), 14 (gbc_onnx), 15 listed twice (hgb_*); onnx_note
  records them)
    lgb_binary_onnx   lgb_numeric through onnxmltools convert_lightgbm
                      (zipmap=False)
    xgb_binary_onnx   xgb_binary through onnxmltools convert_xgboost
    hgb_onnx          scikit-learn HistGradientBoostingClassifier (max_iter
                      100, max_depth 6, NaN as is, no categorical_features,
                      early_stopping off so all 100 iterations are kept)
                      through skl2onnx (zipmap off)
    gbc_onnx          scikit-learn GradientBoostingClassifier (100 trees,
                      max_depth 3), which does not accept NaN: trained and
                      recorded on the data with NaN replaced by -1.0
                      (IMPUTE); skl2onnx, zipmap off
    hgb_regressor_onnx  HistGradientBoostingRegressor (max_iter 50,
                      early_stopping off) on the loss target, through
                      skl2onnx: TreeEnsembleRegressor
  Only the models whose max_depth is named above are depth-limited; the
  others grow leaf-wise to their num_leaves (LightGBM) or max_leaf_nodes 31
  (scikit-learn), so their depth_max is larger.
  skl2onnx 1.20.0's HistGradientBoosting converter passes a Python bool as
  the leaves' nodes_missing_value_tracks_true, which onnx 1.23 rejects; the
  script coerces that one argument to int (_patch_skl2onnx_hist_missing),
  and the graph is otherwise the converter's own.

Per model, <name>.npy is float32 [2048, 12 + 3]: the 12 held-out feature
columns (NaN kept; gbc_onnx: imputed as it was trained), the label (0/1; the
loss target for regressors), `margin` = the native framework's raw score
(LightGBM predict(raw_score=True), XGBoost predict(output_margin=True),
scikit-learn decision_function for classifiers / predict for regressors) and
`score` = for the native formats the framework's own probability (LightGBM
predict, XGBoost predict) or value (regressors: equal to margin), and for the
ONNX models onnxruntime's (CPUExecutionProvider, one thread) class-1
probability (column 1 of `probabilities`) or the regressor's value. LightGBM
and scikit-learn compute in float64 and XGBoost in float32; the table stores
float32. The script asserts that every native probability is sigmoid(margin)
(1e-6), that XGBoost's inplace_predict margin equals its DMatrix margin,
that onnxruntime agrees with the native framework (ORT_TOL, 1e-4), that
every graph passes onnx.checker, that every model's score varies, and that
the classifiers rank the held-out labels (AUC > 0.75; regressors: correlation
with the target > 0.5). It also asserts the features of each native file
that the Rust tests rely on: lgb_binary has categorical splits (num_cat > 0 in some tree,
decision_type bit 0) and NaN missing type ((decision_type >> 2) & 3 == 2) on
some node, lgb_numeric has no categorical split, lgb_zero_missing has
missing type Zero ((decision_type >> 2) & 3 == 1) on some node.

trees.json indexes them (sorted keys, indent 1): features (the 12 names),
columns (the npy layout), versions, and per model: file, format (lightgbm |
xgboost | onnx), inputs (the `--inputs` mapping user:4,item:4,context:4 over
the 12 columns in order), output_kind (logit | raw), output (the ONNX
probability or value tensor; null for native files), dim, data, rows,
positives (classifiers; null for regressors), trees, depth_max (the most
splits on one root-to-leaf path), framework, twin (the same trained model in
the other form: lgb_numeric <-> lgb_binary_onnx, xgb_binary <->
xgb_binary_onnx; else null), imputed_nan (the value NaN was replaced by, or
null), onnx_note (a one-line summary of the graph: op types, opsets, the
TreeEnsemble node's nodes_modes set, post_transform, base_values, whether
nodes_missing_value_tracks_true is present and how many entries are 1, which
attributes are *_as_tensor; null for native files) and ort_vs_native_max_abs
(max |onnxruntime score - native score| over the held-out rows, informative:
ONNX stores thresholds and leaf weights in float32; null for native files).

The ONNX graphs are kept as the converters write them (duplicate opset
imports and ir_version 4 for onnxmltools' LightGBM graph included), except
that the order of the opset imports is fixed (default domain first) and the
graph name is the model name (onnxmltools otherwise picks a random uuid).
Graphs are written with SerializeToString(deterministic=True).

Rerun (from the repository root; it is deterministic for these versions):
  pip install numpy==2.4.6 lightgbm==4.7.0 xgboost-cpu==3.2.0 \
      scikit-learn==1.9.1 onnx==1.23.2 onnxruntime==1.32.0 \
      skl2onnx==1.20.0 onnxmltools==1.16.0
  python3 bench/tree_fixtures.py            # rewrite tests/fixtures/trees/
  python3 bench/tree_fixtures.py --check    # regenerate into a temporary
                                            # directory and compare every
                                            # file byte for byte; exits 1
                                            # naming the file that differs
The script refuses to run with other versions (the files would differ).
Training, BLAS and onnxruntime run single-threaded, which keeps the run
cheap and the trained models reproducible.
"""

import os

# Before numpy loads: one BLAS / OpenMP thread keeps training cheap and reproducible.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

PINNED = {
    "numpy": "2.4.6",
    "lightgbm": "4.7.0",
    "xgboost": "3.2.0",
    "scikit-learn": "1.9.1",
    "onnx": "1.23.2",
    "onnxruntime": "1.32.0",
    "skl2onnx": "1.20.0",
    "onnxmltools": "1.16.0",
}


def _import_pinned():
    """Imports the pinned stack; exits with a clear message when a package is
    missing or has another version (the fixtures would not reproduce)."""
    import importlib

    modules = {
        "numpy": "numpy",
        "lightgbm": "lightgbm",
        "xgboost": "xgboost",
        "scikit-learn": "sklearn",
        "onnx": "onnx",
        "onnxruntime": "onnxruntime",
        "skl2onnx": "skl2onnx",
        "onnxmltools": "onnxmltools",
    }
    problems = []
    for dist, mod in modules.items():
        try:
            got = importlib.import_module(mod).__version__
        except ImportError as e:
            problems.append(f"{dist}: not importable ({e})")
            continue
        if got != PINNED[dist]:
            problems.append(f"{dist}: installed {got}, pinned {PINNED[dist]}")
    if problems:
        print("tree_fixtures: the pinned package versions are required:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        pins = " ".join(f"{'xgboost-cpu' if k == 'xgboost' else k}=={v}" for k, v in PINNED.items())
        print(f"  pip install {pins}", file=sys.stderr)
        sys.exit(2)


_import_pinned()

import lightgbm as lgb  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import xgboost as xgb  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnxmltools import convert_lightgbm, convert_xgboost  # noqa: E402
from onnxmltools.convert.common.data_types import FloatTensorType as MltFloat  # noqa: E402
from skl2onnx import convert_sklearn  # noqa: E402
from skl2onnx.common.data_types import FloatTensorType as SklFloat  # noqa: E402
from sklearn.ensemble import (  # noqa: E402
    GradientBoostingClassifier,
    HistGradientBoostingClassifier,
    HistGradientBoostingRegressor,
)

SEED = 20_260_311
FEATURES = [
    "amount",
    "account_age_days",
    "tx_count_1h",
    "amount_ratio",
    "device_risk",
    "log_distance_km",
    "hour_sin",
    "velocity_z",
    "email_score",
    "card_share",
    "ip_reputation",
    "merchant_category",
]
DIM = len(FEATURES)
INPUTS = "user:4,item:4,context:4"
N_TRAIN = 20_000
N_HELDOUT = 2_048
N_CAT = 30
CAT_COL, NAN4_COL, NAN10_COL, COUNT_COL = 11, 4, 10, 2
NAN4_RATE, NAN10_RATE = 0.10, 0.15
INTERCEPT = -5.0  # puts the positive rate near 7%
IMPUTE = -1.0  # gbc_onnx's replacement for NaN
ORT_TOL = 1e-4  # onnxruntime vs the native framework, probabilities and values
# The same trained model in both forms: native file <-> ONNX graph.
TWINS = {"lgb_numeric": "lgb_binary_onnx", "xgb_binary": "xgb_binary_onnx"}
TWINS.update({v: k for k, v in list(TWINS.items())})
OPSET = 15
ML_OPSET = 3
INPUT_NAME = "X"
SIZE_LIMIT = 4 * 1024 * 1024
OUT_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "trees")
)
F32 = np.float32
LGB_COMMON = {
    "num_threads": 1,
    "deterministic": True,
    "force_row_wise": True,
    "seed": SEED % 100_000,
    "verbose": -1,
}


def model_rng(tag):
    """An independent generator per purpose, so changing one model or draw
    leaves the others unchanged."""
    return np.random.default_rng([SEED, zlib.crc32(tag.encode())])


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


# ------------------------------------------------------------------------ data


def category_tables():
    rng = model_rng("categories")
    effect = rng.normal(0.0, 0.35, N_CAT)
    effect[[3, 11, 17, 26]] += [2.2, 1.6, 1.9, 1.3]  # the risky merchant categories
    weight = rng.uniform(0.4, 1.6, N_CAT)
    return effect, weight / weight.sum()


CAT_EFFECT, CAT_PROB = category_tables()


def fraud_logit(x):
    """The known generating function, on the stored float32 features."""
    x = x.astype(np.float64)
    la = np.log(x[:, 0]) - 3.5
    count = x[:, 2]
    device = np.where(np.isnan(x[:, 4]), 0.0, x[:, 4])
    ip = np.where(np.isnan(x[:, 10]), 1.1, -0.7 * np.nan_to_num(x[:, 10]))
    cat = x[:, CAT_COL].astype(np.int64)
    return (
        INTERCEPT
        + 0.55 * la
        - 0.45 * np.log1p(x[:, 1] / 30.0)
        + 0.40 * count
        + 0.30 * la * count
        + 0.80 * np.log(x[:, 3])
        + 0.60 * device
        + 0.35 * x[:, 5]
        + 0.30 * x[:, 6]
        + 0.50 * x[:, 7] * (count > 0)
        + 0.40 * x[:, 8]
        - 1.50 * (x[:, 9] - 0.28)
        + ip
        + CAT_EFFECT[cat]
        + 1.2  # centres the account-age term
    )


def draw_features(rng, n):
    cols = np.empty((n, DIM), dtype=np.float64)
    cols[:, 0] = np.round(rng.lognormal(3.5, 1.1, n), 2)
    cols[:, 1] = np.floor(rng.gamma(1.5, 250.0, n))
    cols[:, 2] = rng.poisson(0.7, n)
    cols[:, 3] = rng.lognormal(0.0, 0.5, n)
    cols[:, 4] = rng.normal(size=n)
    cols[:, 5] = rng.normal(1.5, 1.0, n)
    cols[:, 6] = np.sin(2.0 * np.pi * rng.integers(0, 24, n) / 24.0)
    cols[:, 7] = rng.normal(size=n)
    cols[:, 8] = rng.normal(size=n)
    cols[:, 9] = rng.beta(2.0, 5.0, n)
    cols[:, 10] = rng.normal(size=n)
    cols[:, 11] = rng.choice(N_CAT, size=n, p=CAT_PROB)
    cols[rng.random(n) < NAN4_RATE, 4] = np.nan
    cols[rng.random(n) < NAN10_RATE, 10] = np.nan
    return np.ascontiguousarray(cols, dtype=F32)


def loss_target(rng, x):
    """The regressors' continuous loss amount, from the same features."""
    x64 = x.astype(np.float64)
    cat = x64[:, CAT_COL].astype(np.int64)
    y = (
        np.log1p(x64[:, 0]) * (0.5 + 2.0 * sigmoid(fraud_logit(x) + 2.5))
        + 0.6 * CAT_EFFECT[cat]
        + 0.8 * np.log(x64[:, 3])
        + rng.normal(0.0, 0.3, len(x))
    )
    return y.astype(F32)


def draw_set(tag, n):
    rng = model_rng(tag)
    x = draw_features(rng, n)
    y = (rng.random(n) < sigmoid(fraud_logit(x))).astype(np.int64)
    loss = loss_target(rng, x)
    return x, y, loss


_DATA = {}


def data():
    if not _DATA:
        xt, yt, lt = draw_set("train", N_TRAIN)
        xh, yh, lh = draw_set("heldout", N_HELDOUT)
        assert np.isnan(xh[:, NAN4_COL]).sum() >= 100, "held-out rows lack NaN in column 4"
        assert np.isnan(xh[:, NAN10_COL]).sum() >= 150, "held-out rows lack NaN in column 10"
        assert (xh[:, COUNT_COL] == 0.0).sum() >= 500, "held-out rows lack exact zeros in column 2"
        assert set(np.unique(xh[:, CAT_COL]).astype(int)) == set(range(N_CAT)), "held-out rows lack a category"
        assert 0.05 <= yt.mean() <= 0.10, f"training positive rate {yt.mean():.3f}"
        _DATA.update(train=(xt, yt, lt), heldout=(xh, yh, lh))
    return _DATA


def impute(x):
    return np.where(np.isnan(x), F32(IMPUTE), x).astype(F32)


# --------------------------------------------------------------- tree shapes


def lgb_shape(booster):
    """(trees, max splits on a root-to-leaf path) of a LightGBM booster."""
    def depth(node):
        if "leaf_index" in node or "leaf_value" in node and "split_index" not in node:
            return 0
        return 1 + max(depth(node["left_child"]), depth(node["right_child"]))

    info = booster.dump_model()["tree_info"]
    return len(info), max(depth(t["tree_structure"]) for t in info)


def lgb_decision_types(text):
    """Every node's decision_type and every tree's num_cat in a LightGBM text model."""
    dts, num_cat = [], []
    for line in text.splitlines():
        if line.startswith("decision_type="):
            dts += [int(v) for v in line.split("=", 1)[1].split()]
        elif line.startswith("num_cat="):
            num_cat.append(int(line.split("=", 1)[1]))
    return dts, num_cat


def xgb_shape(path):
    with open(path) as f:
        trees = json.load(f)["learner"]["gradient_booster"]["model"]["trees"]

    def depth(t, i):
        left, right = t["left_children"][i], t["right_children"][i]
        return 0 if left == -1 else 1 + max(depth(t, left), depth(t, right))

    return len(trees), max(depth(t, 0) for t in trees)


def tree_node(model):
    nodes = [n for n in model.graph.node if n.op_type.startswith("TreeEnsemble")]
    assert len(nodes) == 1, f"expected one TreeEnsemble node, got {[n.op_type for n in nodes]}"
    return nodes[0]


def attr(node, name):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def onnx_attr(node, name):
    """A TreeEnsemble attribute, plain or *_as_tensor (as a list)."""
    v = attr(node, name)
    if v is None:
        t = attr(node, name + "_as_tensor")
        v = None if t is None else numpy_helper.to_array(t).reshape(-1).tolist()
    return v


def onnx_shape(model):
    node = tree_node(model)
    tree_ids = attr(node, "nodes_treeids")
    node_ids = attr(node, "nodes_nodeids")
    modes = [m.decode() if isinstance(m, bytes) else m for m in attr(node, "nodes_modes")]
    true_ids, false_ids = attr(node, "nodes_truenodeids"), attr(node, "nodes_falsenodeids")
    children = {}
    for t, n, m, a, b in zip(tree_ids, node_ids, modes, true_ids, false_ids):
        children[(t, n)] = None if m == "LEAF" else ((t, a), (t, b))

    def depth(key):
        c = children[key]
        return 0 if c is None else 1 + max(depth(c[0]), depth(c[1]))

    roots = sorted(set(tree_ids))
    return len(roots), max(depth((t, 0)) for t in roots)


def onnx_note(model):
    """The one-line graph summary that goes into the index (and is printed)."""
    node = tree_node(model)
    ops = sorted({n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in model.graph.node})
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    opsets += f", ir_version {model.ir_version}"
    modes = sorted({m.decode() for m in attr(node, "nodes_modes")})
    post = attr(node, "post_transform")
    post = post.decode() if isinstance(post, bytes) else (post or "NONE (default)")
    base = onnx_attr(node, "base_values")
    base = "absent" if base is None else "[" + ", ".join(f"{float(v):.9g}" for v in base) + "]"
    tracks = attr(node, "nodes_missing_value_tracks_true")
    if tracks is None:
        tracks_s = "nodes_missing_value_tracks_true absent"
    else:
        tracks_s = f"nodes_missing_value_tracks_true present ({sum(1 for v in tracks if v)} of {len(tracks)} are 1)"
    as_tensor = sorted(a.name for a in node.attribute if a.name.endswith("_as_tensor"))
    return (
        f"ops {', '.join(ops)}; opsets {opsets}; {node.op_type} nodes_modes {{{', '.join(modes)}}}; "
        f"post_transform {post}; base_values {base}; {tracks_s}; "
        f"*_as_tensor: {', '.join(as_tensor) if as_tensor else 'none'}"
    )


# ---------------------------------------------------------------- onnxruntime


def session(model):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ort_score(model, x, output):
    out = session(model).run([output], {INPUT_NAME: np.ascontiguousarray(x, dtype=F32)})[0]
    out = np.asarray(out)
    if out.ndim == 2 and out.shape[1] == 2:
        return out[:, 1].astype(np.float64)
    assert out.size == len(x), f"output {output} has shape {out.shape}"
    return out.reshape(-1).astype(np.float64)


def canonical(model, name):
    """Fixes what the converters leave to chance: the order of the opset
    imports (default domain first) and the graph name."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    ordered = sorted(m.opset_import, key=lambda o: (o.domain not in ("", "ai.onnx"), o.domain))
    ordered = [helper.make_opsetid(o.domain, o.version) for o in ordered]
    del m.opset_import[:]
    m.opset_import.extend(ordered)
    m.graph.name = name
    return m


def check_graph(name, model):
    onnx.checker.check_model(model, full_check=True)
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    # onnxmltools writes the lowest opsets its nodes need (ai.onnx.ml 1), not target_opset.
    assert opsets.get("ai.onnx", 1) <= OPSET and opsets.get("ai.onnx.ml") in (1, ML_OPSET), f"{name}: opsets {opsets}"
    assert [i.name for i in model.graph.input] == [INPUT_NAME], f"{name}: inputs {model.graph.input}"
    t = model.graph.input[0].type.tensor_type
    assert t.elem_type == onnx.TensorProto.FLOAT and t.shape.dim[1].dim_value == DIM, f"{name}: input type"


def probability_output(model, classifier):
    names = [o.name for o in model.graph.output]
    want = "probabilities" if classifier else "variable"
    assert want in names, f"graph outputs {names} lack {want}"
    return want


# --------------------------------------------------------------------- models


def lgb_train(params, rounds, categorical):
    xt, yt, lt = data()["train"]
    y = lt if params["objective"] == "regression" else yt
    ds = lgb.Dataset(
        xt, y, feature_name=FEATURES, categorical_feature=[CAT_COL] if categorical else [], free_raw_data=False,
        params={"verbose": -1},
    )
    return lgb.train({**LGB_COMMON, **params}, ds, num_boost_round=rounds)


def lgb_binary():
    return lgb_train({"objective": "binary", "num_leaves": 31, "max_depth": 6, "learning_rate": 0.1}, 100, True)


def lgb_numeric():
    return lgb_train({"objective": "binary", "num_leaves": 31, "max_depth": 6, "learning_rate": 0.1}, 100, False)


def lgb_regression():
    return lgb_train({"objective": "regression", "num_leaves": 15, "learning_rate": 0.1}, 50, False)


def lgb_zero_missing():
    params = {"objective": "binary", "num_leaves": 31, "learning_rate": 0.1, "zero_as_missing": True}
    return lgb_train(params, 30, False)


def xgb_train(params, rounds, regression):
    xt, yt, lt = data()["train"]
    dm = xgb.DMatrix(xt, label=lt if regression else yt, missing=np.nan, nthread=1)
    base = {"tree_method": "hist", "nthread": 1, "seed": SEED % 100_000, "eta": 0.1, "verbosity": 0}
    return xgb.train({**base, **params}, dm, num_boost_round=rounds)


_CACHE = {}


def cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def xgb_binary():
    return cached("xgb_binary", lambda: xgb_train({"objective": "binary:logistic", "max_depth": 6}, 100, False))


def xgb_regression():
    return xgb_train({"objective": "reg:squarederror", "max_depth": 5}, 50, True)


def lgb_numeric_cached():
    return cached("lgb_numeric", lgb_numeric)


SKL_OPSET = {"": OPSET, "ai.onnx.ml": ML_OPSET}


def _patch_skl2onnx_hist_missing():
    """skl2onnx 1.20.0 passes a Python bool (False) as the leaves'
    nodes_missing_value_tracks_true in the HistGradientBoosting converter,
    which onnx 1.23's make_attribute rejects ("Expected an int, got a
    boolean"). Coerce that one argument to int; the graph is otherwise the
    converter's own."""
    from skl2onnx.common import tree_ensemble

    if getattr(tree_ensemble.add_node, "_tree_fixtures_patch", False):
        return
    original = tree_ensemble.add_node

    def add_node(*args, **kwargs):
        if "nodes_missing_value_tracks_true" in kwargs:
            kwargs["nodes_missing_value_tracks_true"] = int(kwargs["nodes_missing_value_tracks_true"])
        return original(*args, **kwargs)

    add_node._tree_fixtures_patch = True
    tree_ensemble.add_node = add_node


_patch_skl2onnx_hist_missing()


def skl_onnx(est, name):
    return convert_sklearn(
        est, name, initial_types=[(INPUT_NAME, SklFloat([None, DIM]))], target_opset=SKL_OPSET,
        options={id(est): {"zipmap": False}} if hasattr(est, "predict_proba") else None,
    )


def hgb_classifier():
    xt, yt, _ = data()["train"]
    est = HistGradientBoostingClassifier(max_iter=100, max_depth=6, early_stopping=False, random_state=0)
    return est.fit(xt, yt)


def gbc_classifier():
    xt, yt, _ = data()["train"]
    est = GradientBoostingClassifier(n_estimators=100, max_depth=3, random_state=0)
    return est.fit(impute(xt), yt)


def hgb_regressor():
    xt, _, lt = data()["train"]
    est = HistGradientBoostingRegressor(max_iter=50, early_stopping=False, random_state=0)
    return est.fit(xt, lt)


# ------------------------------------------------------------------ recording


def lgb_framework():
    return f"lightgbm {lgb.__version__}"


def xgb_framework():
    return f"xgboost {xgb.__version__}"


def skl_framework():
    import skl2onnx
    import sklearn

    return f"scikit-learn {sklearn.__version__} via skl2onnx {skl2onnx.__version__}"


def mlt_framework(native):
    import onnxmltools

    return f"{native} via onnxmltools {onnxmltools.__version__}"


def native_lgb(name, build, check_text):
    def make(out_dir):
        booster = build()
        path = os.path.join(out_dir, name + ".txt")
        booster.save_model(path)
        with open(path) as f:
            check_text(name, f.read())
        x, y, loss = data()["heldout"]
        regression = booster.params["objective"] == "regression"
        margin = booster.predict(x, raw_score=True)
        score = booster.predict(x)
        if not regression:
            err = np.abs(score - sigmoid(margin)).max()
            assert err <= 1e-6, f"{name}: predict vs sigmoid(raw_score) differs by {err}"
        trees, depth = lgb_shape(booster)
        return {
            "file": name + ".txt", "format": "lightgbm", "framework": lgb_framework(),
            "regression": regression, "x": x, "label": loss if regression else y,
            "margin": margin, "score": score, "trees": trees, "depth_max": depth,
        }

    return name, make


def native_xgb(name, build):
    def make(out_dir):
        booster = build()
        path = os.path.join(out_dir, name + ".json")
        booster.save_model(path)
        x, y, loss = data()["heldout"]
        regression = json.loads(booster.save_config())["learner"]["objective"]["name"].startswith("reg:")
        dm = xgb.DMatrix(x, missing=np.nan, nthread=1)
        margin = booster.predict(dm, output_margin=True).astype(np.float64)
        score = booster.predict(dm).astype(np.float64)
        inplace = booster.inplace_predict(x, missing=np.nan, predict_type="margin").astype(np.float64)
        assert np.array_equal(inplace, margin), f"{name}: inplace_predict margin differs from DMatrix predict"
        if not regression:
            err = np.abs(score - sigmoid(margin)).max()
            assert err <= 1e-6, f"{name}: predict vs sigmoid(margin) differs by {err}"
        trees, depth = xgb_shape(path)
        return {
            "file": name + ".json", "format": "xgboost", "framework": xgb_framework(),
            "regression": regression, "x": x, "label": loss if regression else y,
            "margin": margin, "score": score, "trees": trees, "depth_max": depth,
        }

    return name, make


def onnx_from_mlt(name, twin, convert, classifier, native_fw):
    """An onnxmltools graph of a native model: margin and native score from
    the native framework, score from onnxruntime."""

    def make(out_dir):
        booster, native_margin, native_score = convert()
        model = canonical(booster, name)
        x, y, _ = data()["heldout"]
        return onnx_entry(name, model, out_dir, x, y, native_margin(x), native_score(x), classifier,
                          mlt_framework(native_fw), twin, None)

    return name, make


def onnx_from_skl(name, build, classifier, imputed):
    def make(out_dir):
        est = build()
        model = canonical(skl_onnx(est, name), name)
        x, y, loss = data()["heldout"]
        if imputed:
            x = impute(x)
        if classifier:
            margin = est.decision_function(x).astype(np.float64)
            native = est.predict_proba(x)[:, 1].astype(np.float64)
        else:
            margin = est.predict(x).astype(np.float64)
            native = margin
        return onnx_entry(name, model, out_dir, x, y if classifier else loss, margin, native, classifier,
                          skl_framework(), None, IMPUTE if imputed else None)

    return name, make


def onnx_entry(name, model, out_dir, x, label, margin, native, classifier, framework, twin, imputed):
    check_graph(name, model)
    output = probability_output(model, classifier)
    with open(os.path.join(out_dir, name + ".onnx"), "wb") as f:
        f.write(model.SerializeToString(deterministic=True))
    score = ort_score(model, x, output)
    gap = float(np.abs(score - native).max())
    assert gap <= ORT_TOL, f"{name}: onnxruntime vs native differs by {gap}"
    if classifier:
        err = np.abs(native - sigmoid(margin)).max()
        assert err <= 1e-6, f"{name}: native probability vs sigmoid(margin) differs by {err}"
    trees, depth = onnx_shape(model)
    note = onnx_note(model)
    print(f"  {name}: {note}")
    return {
        "file": name + ".onnx", "format": "onnx", "framework": framework, "regression": not classifier,
        "x": x, "label": label, "margin": margin, "score": score, "trees": trees, "depth_max": depth,
        "output": output, "onnx_note": note, "ort_vs_native_max_abs": gap, "twin": twin,
        "imputed_nan": imputed,
    }


def check_lgb_binary(name, text):
    dts, num_cat = lgb_decision_types(text)
    assert max(num_cat) > 0, f"{name}: no tree has categorical splits (num_cat)"
    assert any(dt & 1 for dt in dts), f"{name}: no categorical decision_type"
    assert any((dt >> 2) & 3 == 2 for dt in dts), f"{name}: no node with missing type NaN"


def check_lgb_numeric(name, text):
    dts, num_cat = lgb_decision_types(text)
    assert max(num_cat) == 0 and not any(dt & 1 for dt in dts), f"{name}: unexpected categorical split"
    assert any((dt >> 2) & 3 == 2 for dt in dts), f"{name}: no node with missing type NaN"


def check_lgb_zero(name, text):
    dts, num_cat = lgb_decision_types(text)
    assert max(num_cat) == 0, f"{name}: unexpected categorical split"
    assert any((dt >> 2) & 3 == 1 for dt in dts), f"{name}: no node with missing type Zero"


def lgb_onnx():
    booster = lgb_numeric_cached()
    model = convert_lightgbm(
        booster, name="lgb_binary_onnx", initial_types=[(INPUT_NAME, MltFloat([None, DIM]))],
        target_opset=OPSET, zipmap=False,
    )
    return model, (lambda x: booster.predict(x, raw_score=True)), (lambda x: booster.predict(x))


def xgb_onnx():
    booster = xgb_binary()
    model = convert_xgboost(
        booster, name="xgb_binary_onnx", initial_types=[(INPUT_NAME, MltFloat([None, DIM]))],
        target_opset=OPSET,
    )

    def predict(margin):
        return lambda x: booster.predict(xgb.DMatrix(x, missing=np.nan, nthread=1), output_margin=margin).astype(
            np.float64
        )

    return model, predict(True), predict(False)


MODELS = [
    native_lgb("lgb_binary", lgb_binary, check_lgb_binary),
    native_lgb("lgb_regression", lgb_regression, lambda n, t: None),
    native_lgb("lgb_zero_missing", lgb_zero_missing, check_lgb_zero),
    native_lgb("lgb_numeric", lgb_numeric_cached, check_lgb_numeric),
    native_xgb("xgb_binary", xgb_binary),
    native_xgb("xgb_regression", xgb_regression),
    onnx_from_mlt("lgb_binary_onnx", "lgb_numeric", lgb_onnx, True, lgb_framework()),
    onnx_from_mlt("xgb_binary_onnx", "xgb_binary", xgb_onnx, True, xgb_framework()),
    onnx_from_skl("hgb_onnx", hgb_classifier, True, False),
    onnx_from_skl("gbc_onnx", gbc_classifier, True, True),
    onnx_from_skl("hgb_regressor_onnx", hgb_regressor, False, False),
]


def rank_auc(score, y):
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    return (ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def record(name, made, out_dir):
    x, label, margin, score = made["x"], made["label"], made["margin"], made["score"]
    assert x.shape == (N_HELDOUT, DIM) and margin.shape == (N_HELDOUT,) and score.shape == (N_HELDOUT,), name
    assert score.std() > 0.01, f"{name}: scores barely vary (std {score.std()})"
    if made["regression"]:
        assert np.array_equal(margin, made["score"]) or made["format"] == "onnx", f"{name}: value != margin"
        corr = float(np.corrcoef(score, label)[0, 1])
        quality = f"corr vs target {corr:.3f}"
        assert corr > 0.5, f"{name}: {quality}"
    else:
        auc = rank_auc(score, label)
        quality = f"AUC vs labels {auc:.3f}"
        assert auc > 0.75, f"{name}: {quality}"
    table = np.hstack([x, label[:, None].astype(F32), margin[:, None].astype(F32), score[:, None].astype(F32)])
    np.save(os.path.join(out_dir, name + ".npy"), np.ascontiguousarray(table, dtype=F32))
    entry = {
        "file": made["file"],
        "format": made["format"],
        "inputs": INPUTS,
        "output_kind": "raw" if made["regression"] else "logit",
        "output": made.get("output"),
        "dim": DIM,
        "data": name + ".npy",
        "rows": N_HELDOUT,
        "positives": None if made["regression"] else int(label.sum()),
        "trees": int(made["trees"]),
        "depth_max": int(made["depth_max"]),
        "framework": made["framework"],
        "twin": made.get("twin") or TWINS.get(name),
        "imputed_nan": made.get("imputed_nan"),
        "onnx_note": made.get("onnx_note"),
        "ort_vs_native_max_abs": made.get("ort_vs_native_max_abs"),
    }
    gap = entry["ort_vs_native_max_abs"]
    print(
        f"{name:19s} {made['format']:8s} trees {entry['trees']:3d} depth {entry['depth_max']}  "
        f"margin [{margin.min():7.3f}, {margin.max():7.3f}]  {quality}"
        + ("" if gap is None else f"  ort vs native {gap:.3g}")
    )
    return entry


def generate(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    _CACHE.clear()
    models = {}
    for name, make in MODELS:
        models[name] = record(name, make(out_dir), out_dir)
    index = {
        "note": (
            "written by bench/tree_fixtures.py; each <name>.npy is float32 [rows, dim + 3]: the 12 held-out "
            "feature columns (NaN kept, or replaced by imputed_nan), the label (0/1, or the regression target "
            "for output_kind raw), the native framework's raw score (margin) and the score (native formats: the "
            "framework's probability or value; onnx: onnxruntime's class-1 probability or value)"
        ),
        "columns": FEATURES + ["label", "margin", "score"],
        "features": FEATURES,
        "versions": dict(PINNED),
        "models": models,
    }
    with open(os.path.join(out_dir, "trees.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.write("\n")
    return index


def expected_files(index):
    files = {"trees.json"}
    for entry in index["models"].values():
        files.update([entry["file"], entry["data"]])
    return files


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# ---------------------------------------------------------------------- check


def compare(committed, fresh, index):
    problems = []
    expected = expected_files(index)
    present = set(os.listdir(committed)) if os.path.isdir(committed) else set()
    for f in sorted(expected - present):
        problems.append(f"{f}: missing from {committed}")
    for f in sorted(present - expected):
        problems.append(f"{f}: not written by bench/tree_fixtures.py (stale file?)")
    for f in sorted(expected & present):
        with open(os.path.join(committed, f), "rb") as a, open(os.path.join(fresh, f), "rb") as b:
            if a.read() != b.read():
                problems.append(f"{f}: differs from the regenerated file")
    return problems


def main(argv):
    if argv not in ([], ["--check"]):
        print("usage: python3 bench/tree_fixtures.py [--check]", file=sys.stderr)
        return 2
    start = time.monotonic()
    if argv == ["--check"]:
        tmp = tempfile.mkdtemp(prefix="tree_fixtures.")
        try:
            index = generate(tmp)
            problems = compare(OUT_DIR, tmp, index)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if problems:
            print(f"tree_fixtures: {OUT_DIR} is out of date; rerun python3 bench/tree_fixtures.py:", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(
            f"tree_fixtures: {len(index['models'])} models in {OUT_DIR} match a fresh regeneration byte for byte "
            f"({time.monotonic() - start:.1f} s)"
        )
        return 0
    index = generate(OUT_DIR)
    stray = set(os.listdir(OUT_DIR)) - expected_files(index)
    if stray:
        print(f"tree_fixtures: warning: files not written by this script: {sorted(stray)}", file=sys.stderr)
    size = dir_size(OUT_DIR)
    assert size < SIZE_LIMIT, f"{OUT_DIR} is {size} bytes, over {SIZE_LIMIT}"
    print(f"wrote {len(index['models'])} models to {OUT_DIR} ({size / 1e6:.2f} MB, {time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
