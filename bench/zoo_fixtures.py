#!/usr/bin/env python3
"""Generates the ONNX "model zoo" fixtures under tests/fixtures/zoo/.

Why: `quiver import` has to reproduce what onnxruntime computes for the
graphs that real exporters write, not only the two hand-picked graphs in
tests/fixtures/onnx/. This script builds nineteen small CTR-style models in the
shapes scikit-learn (through skl2onnx), torch.onnx.export (opset 17, eval
mode) and Keras (through tf2onnx) emit, records onnxruntime's logit for 2048 held-out rows of each, and
writes an index, so `cargo test` can check import parity without Python.

Data: synthetic clicks with a known generating function (the one in
bench/onnx_fixtures.py: user-item affinity, context effects and an
interaction). A row is user (8 floats) | item (8) | context (4), the Quiver
input vector of 20 floats in that order. For deepfm, context columns 2 and 3
hold integer-valued category ids in [0, 50) and the generating function adds
a per-id effect instead of the interaction. Labels are drawn from the
generating function with its logit shifted by RARE_SHIFT, so positives are
rare (about 4%); scikit-learn models are trained on labels drawn the same way.

Models (tests/fixtures/zoo/<name>.onnx):
  skl2onnx (one input X [N, 20], exporter's own names, producer skl2onnx):
    sklearn_mlp          MLPClassifier(32, 16), zipmap off
    sklearn_mlp_zipmap   the same classifier, zipmap on (the default)
    logistic_regression  LogisticRegression: ai.onnx.ml LinearClassifier
    scaler_mlp           Pipeline(StandardScaler, MLPClassifier(16)) on raw
                         features with per-column scales 0.5..20 and offsets
    regression           MLPRegressor(16) on a continuous bid-shading target
  written with onnx.helper in torch.onnx.export's opset-17 form (inputs
  user [batch, 8], item [batch, 8], ctx [batch, 4]; node names /fc1/Gemm ...;
  Linear = Gemm(alpha=1, beta=1, transB=1) with weight [out, in]; literals
  as Constant nodes; seeded He-initialised hidden layers, and the last
  linear map(s) into the logit fitted by LogisticRegression on the hidden
  activations, a random-features model whose logits land in about [-8, 0];
  two_tower's, fitted on unshifted labels since a dot product has no bias,
  in about [-6, 6]):
    torch_bn_mlp, layernorm_mlp, residual_mlp, wide_deep, dcn_v2, deepfm,
    two_tower (inputs user and item only; item is a precomputed item-tower
    output), leaky_tanh, external_data (every initializer in
    external_data.onnx.data), softmax_head (output probabilities [batch, 2]),
    deepfm_ids (deepfm's weights, its category ids as their own int64
    input `ids` [batch, 2] beside `ctx` [batch, 2]: served with the
    request's context_ids; --inputs user=user:8,item=item:8,context=ctx:2,
    context_ids=ids:2, the same 20-column rows as deepfm),
    layernorm_mlp_opset13 (layernorm_mlp's shape at opset 13, where torch
    writes LayerNorm as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div,
    Mul, Add).

  tf2onnx.convert.from_keras (opset 17; inputs user, item, ctx as above;
  tf2onnx's own node names; seeded He-initialised hidden layers, non-trivial
  normalisation parameters, the head fitted as the torch-style ones):
    keras_bn_mlp         Concatenate, Dense(32, relu), BatchNormalization,
                         Dropout, Dense(16, relu), Dense(1, sigmoid)
    keras_ln_residual    Dense(32, tanh-form GELU), LayerNormalization (which
                         tf2onnx writes with Neg and Reciprocal), a residual
                         Dense(32, tanh) added back, Dense(16), LeakyReLU(0.1)
  Their onnxruntime probabilities are checked against Keras's own within
  the tolerance.

Per model, <name>.npy is float32 [2048, D + 2] (D = 20, or 16 for two_tower):
the D input columns, a 0/1 label, and onnxruntime's (CPUExecutionProvider)
logit, read as follows:
  - Sigmoid-headed graphs: the Sigmoid's input, added as an extra graph
    output of an in-memory copy (skl2onnx MLPs: add_result2 / add_result1,
    the input of the output-activation Sigmoid node skl2onnx names Relu2 /
    Relu1).
  - softmax_head: z1 - z0 of the pre-Softmax Gemm output.
  - logistic_regression: an in-memory copy with LinearClassifier's
    post_transform set to NONE gives the raw scores [-s, s] (skl2onnx writes
    both classes for a binary model); the logit is s, the class-1 score.
  - regression: the raw output `variable` itself (no sigmoid).
The label column is always the rare click label: for regression it is drawn
from the click function of the same row (the bid-shading target is not
recorded), for two_tower from a context that is drawn but not an input.
The script asserts that the chosen output of the unmodified graph equals
sigmoid(logit) (class-1 column for [N, 2] outputs) within 1e-5, that
scikit-learn's predict_proba / predict / decision_function agree with
onnxruntime within 1e-5, that every input column changes the logit, and that
every graph passes onnx.checker (opset 17, ir_version 8).

zoo.json indexes the models: file, the `--inputs` mapping string, the
`--output` tensor (null when the graph's only output is the right one),
output_kind (logit | raw), output_form (sigmoid | probabilities2 | logit |
raw: what the chosen output tensor holds), ops (sorted; ai.onnx.ml ops
prefixed), rows, dim, positives, max_abs_logit, data, logit_from (how the
recorded logit was read) and, for external_data, external_data (the file).

skl2onnx's graphs are kept as it writes them (including the duplicate
default-domain opset import it writes for LinearClassifier), except that the
order of the opset imports, which skl2onnx varies from run to run, is fixed
with the default domain first.

Rerun (from the repository root; it is deterministic for these versions):
  pip install numpy==2.4.6 onnx==1.23.2 onnxruntime==1.32.0 \
      scikit-learn==1.9.1 skl2onnx==1.20.0 onnxmltools==1.16.0
  python3 bench/zoo_fixtures.py            # rewrite tests/fixtures/zoo/
  python3 bench/zoo_fixtures.py --check    # regenerate into a temporary
                                           # directory and compare; exits 1
                                           # naming the file that differs
(onnxmltools is pinned with the converter stack; only its version is read.)
BLAS and onnxruntime run single-threaded, which keeps the run cheap and the
trained weights reproducible.
"""

import os

# Before numpy loads: one BLAS thread keeps training cheap and reproducible.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from skl2onnx import to_onnx  # noqa: E402
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.neural_network import MLPClassifier, MLPRegressor  # noqa: E402
from sklearn.pipeline import Pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

SEED = 20_261_207
USER_DIM, ITEM_DIM, CTX_DIM = 8, 8, 4
DIM = USER_DIM + ITEM_DIM + CTX_DIM
N_CAT = 50  # category ids in deepfm's context columns 2 and 3
EMB_DIM = 4
RARE_SHIFT = -4.0  # shifts the generating logit so that about 4% are positive
N_TRAIN = 4096
N_HELDOUT = 2048
OPSET = 17
IR_VERSION = 8
TOL = 1e-5
SIZE_LIMIT = 6 * 1024 * 1024
TORCH_PRODUCER = "quiver-zoo-fixtures (torch-style)"
SKL_INPUTS = "user:8,item:8,context:4"
TORCH_INPUTS = "user=user:8,item=item:8,context=ctx:4"
TWO_TOWER_INPUTS = "user=user:8,item=item:8"
IDS_INPUTS = "user=user:8,item=item:8,context=ctx:2,context_ids=ids:2"
EXTERNAL_DATA = "external_data.onnx.data"
# scaler_mlp's raw feature scales and offsets (training and recorded rows).
RAW_SCALE = np.round(np.geomspace(0.5, 20.0, DIM), 3)
RAW_OFFSET = np.round(np.linspace(-30.0, 30.0, DIM), 2)
OUT_DIR = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "zoo")
)
F32 = np.float32


def model_rng(tag):
    """An independent generator per purpose, so adding or changing one model
    leaves the others' fixtures unchanged."""
    return np.random.default_rng([SEED, zlib.crc32(tag.encode())])


CAT_EFFECT = model_rng("category-effects").normal(0.0, 0.8, size=(2, N_CAT))


def click_logit(x, categorical=False):
    """The known generating function (bench/onnx_fixtures.py's), on the
    standard-scale features; deepfm's ids get per-id effects instead."""
    u, v, c = x[:, :USER_DIM], x[:, USER_DIM : USER_DIM + ITEM_DIM], x[:, USER_DIM + ITEM_DIM :]
    affinity = (u.astype(np.float64) * v).sum(axis=1) / np.sqrt(USER_DIM)
    z = 1.5 * affinity + 0.8 * c[:, 0] + 0.3 * np.tanh(u[:, 0] + v[:, 0]) - 0.5
    if categorical:
        ids = c[:, 2:4].astype(np.int64)
        # The id effects add variance; -0.3 keeps the rare-label rate near 4%.
        return z - 0.3 - 0.5 * c[:, 1] + CAT_EFFECT[0, ids[:, 0]] + CAT_EFFECT[1, ids[:, 1]]
    return z - 0.5 * c[:, 1] * c[:, 2]


def draw_rows(rng, n_rows, n_users, n_items, categorical=False):
    """Rows from fresh user and item tables (so held-out rows share no user or
    item with training rows) and per-row contexts."""
    users = rng.normal(size=(n_users, USER_DIM)).astype(F32)
    items = rng.normal(size=(n_items, ITEM_DIM)).astype(F32)
    u_idx = rng.integers(0, n_users, n_rows)
    i_idx = rng.integers(0, n_items, n_rows)
    ctx = rng.normal(size=(n_rows, CTX_DIM)).astype(F32)
    if categorical:
        ctx[:, 2:4] = rng.integers(0, N_CAT, size=(n_rows, 2)).astype(F32)
    return np.ascontiguousarray(np.hstack([users[u_idx], items[i_idx], ctx]), dtype=F32)


def rare_labels(rng, x, categorical=False, shift=RARE_SHIFT):
    p = 1.0 / (1.0 + np.exp(-(click_logit(x, categorical) + shift)))
    return (rng.random(len(x)) < p).astype(np.int64)


def to_raw(x):
    """scaler_mlp's raw feature scale: what the server receives."""
    return np.ascontiguousarray(x.astype(np.float64) * RAW_SCALE + RAW_OFFSET, dtype=F32)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


# ---------------------------------------------------------------- onnxruntime


def session(model_or_path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    src = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def run(model_or_path, feeds, names):
    return session(model_or_path).run(names, feeds)


def with_extra_outputs(model, names):
    """A copy of `model` that also returns the intermediate tensors `names`."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    present = {o.name for o in m.graph.output}
    for n in names:
        if n not in present:
            m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    return m


def feeds_x(x):
    return {"X": np.ascontiguousarray(x, dtype=F32)}


def feeds_three(x):
    return {
        "user": np.ascontiguousarray(x[:, :USER_DIM]),
        "item": np.ascontiguousarray(x[:, USER_DIM : USER_DIM + ITEM_DIM]),
        "ctx": np.ascontiguousarray(x[:, USER_DIM + ITEM_DIM :]),
    }


def feeds_ids(x):
    """deepfm_ids: the numeric context and the category ids as separate
    inputs, the ids as int64 (the request's `context_ids`)."""
    c = USER_DIM + ITEM_DIM
    return {
        "user": np.ascontiguousarray(x[:, :USER_DIM]),
        "item": np.ascontiguousarray(x[:, USER_DIM:c]),
        "ctx": np.ascontiguousarray(x[:, c : c + 2]),
        "ids": np.ascontiguousarray(x[:, c + 2 : c + 4].astype(np.int64)),
    }


def feeds_two(x):
    return {"user": np.ascontiguousarray(x[:, :USER_DIM]), "item": np.ascontiguousarray(x[:, USER_DIM:])}


def logit_col1(outs):
    return outs[0][:, 1]


def logit_flat(outs):
    return outs[0].reshape(-1)


def logit_diff(outs):
    z = outs[0].astype(np.float64)
    return z[:, 1] - z[:, 0]


# ------------------------------------------------------------------ skl2onnx


def train_data(tag, raw=False):
    rng = model_rng(tag)
    x = draw_rows(rng, N_TRAIN, 512, 2048)
    y = rare_labels(rng, x)
    return (to_raw(x) if raw else x), y, x


def fit(est, x, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return est.fit(x, y)


_SHARED_MLP = {}


def shared_mlp():
    """sklearn_mlp and sklearn_mlp_zipmap export this one classifier."""
    if "clf" not in _SHARED_MLP:
        x, y, _ = train_data("sklearn_mlp/train")
        _SHARED_MLP["clf"] = fit(MLPClassifier(hidden_layer_sizes=(32, 16), max_iter=60, random_state=0), x, y)
    return _SHARED_MLP["clf"]


def last_sigmoid_input(model):
    sig = [n for n in model.graph.node if n.op_type == "Sigmoid"]
    assert len(sig) == 1, "expected one Sigmoid in the skl2onnx MLP"
    return sig[0].input[0]


def canonical_opsets(model):
    """skl2onnx lists its opset imports in an order that changes from run to
    run (the default domain first or ai.onnx.ml first); fix it, default
    domain first, so that the files are reproducible. Duplicates, which
    skl2onnx writes for LinearClassifier, are kept as it writes them."""
    ordered = sorted(model.opset_import, key=lambda o: (o.domain not in ("", "ai.onnx"), o.domain))
    ordered = [helper.make_opsetid(o.domain, o.version) for o in ordered]
    del model.opset_import[:]
    model.opset_import.extend(ordered)
    return model


def skl_spec(model, est, output, output_form, logit_names, logit_fn, logit_from, reference, **kw):
    canonical_opsets(model)
    spec = dict(
        model=model,
        est=est,
        inputs=SKL_INPUTS,
        feeds=feeds_x,
        output=output,
        output_form=output_form,
        output_kind="raw" if output_form == "raw" else "logit",
        logit_model=with_extra_outputs(model, logit_names),
        logit_names=logit_names,
        logit_fn=logit_fn,
        logit_from=logit_from,
        reference=reference,
        dim=DIM,
    )
    spec.update(kw)
    return spec


def build_sklearn_mlp():
    clf = shared_mlp()
    x0 = np.zeros((1, DIM), dtype=F32)
    model = to_onnx(clf, x0, options={id(clf): {"zipmap": False}}, target_opset=OPSET)
    z = last_sigmoid_input(model)
    return skl_spec(
        model, clf, "probabilities", "probabilities2", [z], logit_flat,
        f"input of the final Sigmoid ({z}), read as an extra output",
        lambda x: clf.predict_proba(x),
    )


def build_sklearn_mlp_zipmap():
    clf = shared_mlp()
    model = to_onnx(clf, np.zeros((1, DIM), dtype=F32), target_opset=OPSET)
    zipmap = [n for n in model.graph.node if n.op_type == "ZipMap"]
    assert len(zipmap) == 1
    probs = zipmap[0].input[0]
    z = last_sigmoid_input(model)
    return skl_spec(
        model, clf, probs, "probabilities2", [z], logit_flat,
        f"input of the final Sigmoid ({z}), read as an extra output; `output` is the tensor feeding ZipMap",
        lambda x: clf.predict_proba(x),
        zipmap_output=zipmap[0].output[0],
    )


def build_logistic_regression():
    x, y, _ = train_data("logistic_regression/train")
    lr = fit(LogisticRegression(C=1.0, max_iter=200), x, y)
    model = to_onnx(lr, x[:1], options={id(lr): {"zipmap": False}}, target_opset=OPSET)
    lin = [n for n in model.graph.node if n.op_type == "LinearClassifier"]
    assert len(lin) == 1
    raw = onnx.ModelProto()
    raw.CopyFrom(model)
    for node in raw.graph.node:
        if node.op_type == "LinearClassifier":
            for a in node.attribute:
                if a.name == "post_transform":
                    a.s = b"NONE"
    probs = lin[0].output[1]
    spec = skl_spec(
        model, lr, probs, "probabilities2", [probs], logit_col1,
        "class-1 raw score: column 1 of the LinearClassifier's scores in an in-memory copy "
        "with post_transform NONE (skl2onnx writes both classes, [-s, s])",
        lambda x: lr.predict_proba(x),
        decision=lambda x: lr.decision_function(x),
    )
    spec["logit_model"] = raw
    return spec


def build_scaler_mlp():
    x, y, _ = train_data("scaler_mlp/train", raw=True)
    mlp = MLPClassifier(hidden_layer_sizes=(16,), max_iter=80, random_state=0)
    pipe = fit(Pipeline([("scaler", StandardScaler()), ("mlp", mlp)]), x, y)
    model = to_onnx(pipe, x[:1], options={id(mlp): {"zipmap": False}}, target_opset=OPSET)
    z = last_sigmoid_input(model)
    return skl_spec(
        model, pipe, "probabilities", "probabilities2", [z], logit_flat,
        f"input of the final Sigmoid ({z}), read as an extra output",
        lambda x: pipe.predict_proba(x),
        raw=True,
    )


def bid_shading_target(rng, x):
    """A continuous target in (0.2, 0.8): the fraction of the bid to keep."""
    return 0.2 + 0.6 * sigmoid(0.5 * click_logit(x)) + rng.normal(0.0, 0.02, len(x))


def build_regression():
    rng = model_rng("regression/train")
    x = draw_rows(rng, N_TRAIN, 512, 2048)
    t = bid_shading_target(rng, x)
    reg = fit(MLPRegressor(hidden_layer_sizes=(16,), max_iter=80, random_state=0), x, t)
    model = to_onnx(reg, x[:1], target_opset=OPSET)
    assert [o.name for o in model.graph.output] == ["variable"]
    return skl_spec(
        model, reg, None, "raw", ["variable"], logit_flat,
        "the raw output `variable` (no sigmoid)",
        lambda x: reg.predict(x),
    )


# ----------------------------------------------------------- torch-style graphs


class TorchStyle:
    """Writes nodes and names the way torch.onnx.export (TorchScript, opset
    17) does: /scope/Op, /scope/Op_1, ...; outputs <node>_output_0; module
    parameters as initializers named <module>.weight; literals as Constant
    nodes."""

    def __init__(self, w):
        self.w = w
        self.nodes = []
        self.inits = []
        self.used = Counter()

    def _name(self, scope, op):
        base = f"{scope}/{op}"
        k = self.used[base]
        self.used[base] += 1
        return base if k == 0 else f"{base}_{k}"

    def op(self, op, inputs, scope="", out=None, **attrs):
        name = self._name(scope, op)
        out = out or f"{name}_output_0"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def const(self, value, dtype, scope=""):
        name = self._name(scope, "Constant")
        out = f"{name}_output_0"
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype))
        self.nodes.append(helper.make_node("Constant", [], [out], name=name, value=tensor))
        return out

    def init(self, name, arr):
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def param(self, key):
        return self.init(key, self.w[key])

    def linear(self, x, module, scope=None):
        scope = scope if scope is not None else "/" + module
        return self.op(
            "Gemm", [x, self.param(module + ".weight"), self.param(module + ".bias")],
            scope=scope, alpha=1.0, beta=1.0, transB=1,
        )

    def model(self, graph_name, inputs, outputs, opset=None):
        graph = helper.make_graph(self.nodes, graph_name, inputs, outputs, self.inits)
        opset = opset or OPSET
        m = helper.make_model(graph, producer_name=TORCH_PRODUCER, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = IR_VERSION
        return m


def vi(name, dims):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", dims])


THREE_INPUTS = [vi("user", USER_DIM), vi("item", ITEM_DIM), vi("ctx", CTX_DIM)]


def linear_weights(rng, w, module, n_in, n_out, gain=1.0):
    """He-normal weight [out, in] and torch's default uniform bias."""
    w[module + ".weight"] = rng.normal(0.0, gain * math.sqrt(2.0 / n_in), size=(n_out, n_in)).astype(F32)
    bound = 1.0 / math.sqrt(n_in)
    w[module + ".bias"] = rng.uniform(-bound, bound, size=n_out).astype(F32)


def concat_inputs(t):
    return t.op("Concat", ["user", "item", "ctx"], axis=1)


def sigmoid_head(t, logit):
    t.op("Sigmoid", [logit], out="probability")
    return [vi("probability", 1)]


# Each torch-style model: weights(rng) -> dict of float32 parameters, and
# graph(t) -> (graph outputs, logit tensor, the activations the head into the
# logit reads).


def bn_mlp_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 32)
    # Running statistics near what fc1 really produces on unit-variance
    # inputs (mean = bias, var = squared row norm), perturbed so that none is
    # trivial. math.fsum keeps them bit-identical on any machine.
    w1 = w["fc1.weight"].astype(np.float64)
    var = np.array([math.fsum(r * r) for r in w1])
    w["bn.weight"] = rng.uniform(0.5, 1.5, 32).astype(F32)
    w["bn.bias"] = rng.normal(0.0, 0.2, 32).astype(F32)
    w["bn.running_mean"] = (w["fc1.bias"] + rng.normal(0.0, 0.3, 32)).astype(F32)
    w["bn.running_var"] = (var * rng.uniform(0.6, 1.4, 32)).astype(F32)
    linear_weights(rng, w, "fc2", 32, 16)
    linear_weights(rng, w, "fc3", 16, 1)
    return w


def bn_mlp_graph(t):
    x = concat_inputs(t)
    h = t.linear(x, "fc1")
    h = t.op(
        "BatchNormalization",
        [h, t.param("bn.weight"), t.param("bn.bias"), t.param("bn.running_mean"), t.param("bn.running_var")],
        scope="/bn", epsilon=1e-5, momentum=0.9,
    )
    # GELU (approximate='none') as torch writes it below opset 20.
    d = t.op("Div", [h, t.const(1.4142135381698608, F32, "/act")], scope="/act")
    e = t.op("Erf", [d], scope="/act")
    a = t.op("Add", [e, t.const(1.0, F32, "/act")], scope="/act")
    m = t.op("Mul", [h, a], scope="/act")
    g = t.op("Mul", [m, t.const(0.5, F32, "/act")], scope="/act")
    # Opset-13 Dropout with a ratio input and no training_mode: inference.
    g = t.op("Dropout", [g, t.const(0.1, F32, "/dropout")], scope="/dropout")
    h = t.op("Relu", [t.linear(g, "fc2")], scope="/act2")
    z = t.linear(h, "fc3")
    return sigmoid_head(t, z), z, [h]


def layernorm_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 32)
    w["ln.weight"] = rng.uniform(0.5, 1.5, 32).astype(F32)
    w["ln.bias"] = rng.normal(0.0, 0.2, 32).astype(F32)
    linear_weights(rng, w, "fc2", 32, 1)
    return w


def layernorm_graph(t):
    h = t.linear(concat_inputs(t), "fc1")
    h = t.op("LayerNormalization", [h, t.param("ln.weight"), t.param("ln.bias")], scope="/ln", axis=-1, epsilon=1e-5)
    h = t.op("Relu", [h], scope="/act")
    z = t.linear(h, "fc2")
    return sigmoid_head(t, z), z, [h]


def layernorm13_graph(t):
    """layernorm_mlp as torch.onnx.export writes nn.LayerNorm below opset 17:
    ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add (opset 13,
    ReduceMean's axes as an attribute)."""
    h = t.linear(concat_inputs(t), "fc1")
    mean = t.op("ReduceMean", [h], scope="/ln", axes=[-1], keepdims=1)
    d = t.op("Sub", [h, mean], scope="/ln")
    p = t.op("Pow", [d, t.const(2.0, F32, "/ln")], scope="/ln")
    var = t.op("ReduceMean", [p], scope="/ln", axes=[-1], keepdims=1)
    v = t.op("Add", [var, t.const(1e-5, F32, "/ln")], scope="/ln")
    sd = t.op("Sqrt", [v], scope="/ln")
    n = t.op("Div", [d, sd], scope="/ln")
    y = t.op("Mul", [n, t.param("ln.weight")], scope="/ln")
    y = t.op("Add", [y, t.param("ln.bias")], scope="/ln")
    h = t.op("Relu", [y], scope="/act")
    z = t.linear(h, "fc2")
    return sigmoid_head(t, z), z, [h]


def residual_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 32)
    linear_weights(rng, w, "block.fc", 32, 32, gain=0.7)
    linear_weights(rng, w, "fc2", 32, 16)
    linear_weights(rng, w, "fc3", 16, 1)
    return w


def residual_graph(t):
    h = t.op("Relu", [t.linear(concat_inputs(t), "fc1")])
    r = t.op("Relu", [t.linear(h, "block.fc", scope="/block/fc")], scope="/block")
    h = t.op("Add", [h, r])
    h = t.op("Relu", [t.linear(h, "fc2")])
    z = t.linear(h, "fc3")
    return sigmoid_head(t, z), z, [h]


def wide_deep_weights(rng):
    w = {}
    linear_weights(rng, w, "wide", DIM, 1)
    linear_weights(rng, w, "deep.0", DIM, 32)
    linear_weights(rng, w, "deep.2", 32, 16)
    linear_weights(rng, w, "deep.4", 16, 1)
    return w


def wide_deep_graph(t):
    x = concat_inputs(t)
    wide = t.linear(x, "wide")
    h = t.op("Relu", [t.linear(x, "deep.0", scope="/deep/deep.0")], scope="/deep/deep.1")
    h = t.op("Relu", [t.linear(h, "deep.2", scope="/deep/deep.2")], scope="/deep/deep.3")
    deep = t.linear(h, "deep.4", scope="/deep/deep.4")
    z = t.op("Add", [wide, deep])
    return sigmoid_head(t, z), z, [x, h]


def dcn_weights(rng):
    w = {}
    linear_weights(rng, w, "cross.0", DIM, DIM, gain=0.5)
    linear_weights(rng, w, "cross.1", DIM, DIM, gain=0.5)
    linear_weights(rng, w, "fc1", DIM, 16)
    linear_weights(rng, w, "fc2", 16, 1)
    return w


def dcn_graph(t):
    x0 = concat_inputs(t)
    x = x0
    for i in range(2):
        g = t.linear(x, f"cross.{i}", scope=f"/cross.{i}")
        x = t.op("Add", [t.op("Mul", [x0, g]), x])
    h = t.op("Relu", [t.linear(x, "fc1")])
    z = t.linear(h, "fc2")
    return sigmoid_head(t, z), z, [h]


DEEPFM_NUMERIC = USER_DIM + ITEM_DIM + 2


def deepfm_weights(rng):
    w = {}
    w["emb.weight"] = rng.normal(0.0, 1.0, size=(N_CAT, EMB_DIM)).astype(F32)
    w["first_order.weight"] = rng.normal(0.0, 0.5, size=(N_CAT, 1)).astype(F32)
    linear_weights(rng, w, "fc1", DEEPFM_NUMERIC + 2 * EMB_DIM, 32)
    linear_weights(rng, w, "fc2", 32, 1)
    return w


def deepfm_graph(t):
    def slice_ctx(prefix, start, end):
        # starts / ends / axes as int64 initializers (the opset-10+ inputs).
        args = [t.init(f"{prefix}.{k}", np.array([v], dtype=np.int64)) for k, v in
                (("starts", start), ("ends", end), ("axes", 1))]
        return t.op("Slice", ["ctx", *args])

    num_ctx = slice_ctx("slice_num", 0, 2)
    id_ctx = slice_ctx("slice_ids", 2, 4)
    numeric = t.op("Concat", ["user", "item", num_ctx], axis=1)
    ids = t.op("Cast", [id_ctx], to=TensorProto.INT64)
    return deepfm_tail(t, numeric, ids)


def deepfm_tail(t, numeric, ids):
    """Both DeepFM forms from the numeric features and the int64 ids on:
    embeddings and first-order terms by Gather, then the deep part."""
    emb = t.op("Gather", [t.param("emb.weight"), ids], scope="/emb", axis=0)
    emb_flat = t.op("Reshape", [emb, t.const([-1, 2 * EMB_DIM], np.int64)])
    first = t.op("Gather", [t.param("first_order.weight"), ids], scope="/first_order", axis=0)
    first = t.op("Reshape", [first, t.const([-1, 2], np.int64)])
    first = t.op("ReduceSum", [first, t.const([1], np.int64)], keepdims=1)
    deep_in = t.op("Concat", [numeric, emb_flat], axis=1)
    h = t.op("Relu", [t.linear(deep_in, "fc1")])
    z = t.op("Add", [t.linear(h, "fc2"), first])
    return sigmoid_head(t, z), z, [h]


def deepfm_ids_graph(t):
    """deepfm with its category ids as their own int64 input (`ids`
    [batch, 2]) and two numeric context floats (`ctx` [batch, 2]): no Slice
    or Cast, as a model served with the request's `context_ids` is written."""
    numeric = t.op("Concat", ["user", "item", "ctx"], axis=1)
    return deepfm_tail(t, numeric, "ids")


IDS_GRAPH_INPUTS = [
    helper.make_tensor_value_info("user", TensorProto.FLOAT, ["batch", USER_DIM]),
    helper.make_tensor_value_info("item", TensorProto.FLOAT, ["batch", ITEM_DIM]),
    helper.make_tensor_value_info("ctx", TensorProto.FLOAT, ["batch", 2]),
    helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 2]),
]


def two_tower_weights(rng):
    w = {}
    linear_weights(rng, w, "user_tower.0", USER_DIM, 16)
    linear_weights(rng, w, "user_tower.2", 16, ITEM_DIM)
    return w


def two_tower_graph(t):
    h = t.linear("user", "user_tower.0", scope="/user_tower/user_tower.0")
    h = t.op("Relu", [h], scope="/user_tower/user_tower.1")
    u = t.linear(h, "user_tower.2", scope="/user_tower/user_tower.2")
    z = t.op("ReduceSum", [t.op("Mul", [u, "item"]), t.init("reduce_axes", np.array([1], dtype=np.int64))], keepdims=1)
    return sigmoid_head(t, z), z, [h]


def leaky_tanh_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 32)
    linear_weights(rng, w, "fc2", 32, 16)
    linear_weights(rng, w, "fc3", 16, 1)
    return w


def leaky_tanh_graph(t):
    h = t.op("LeakyRelu", [t.linear(concat_inputs(t), "fc1")], scope="/act1", alpha=0.1)
    h = t.op("Tanh", [t.linear(h, "fc2")], scope="/act2")
    z = t.linear(h, "fc3")
    return sigmoid_head(t, z), z, [h]


def external_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 64)
    linear_weights(rng, w, "fc2", 64, 1)
    return w


def external_graph(t):
    h = t.op("Relu", [t.linear(concat_inputs(t), "fc1")])
    z = t.linear(h, "fc2")
    return sigmoid_head(t, z), z, [h]


def softmax_weights(rng):
    w = {}
    linear_weights(rng, w, "fc1", DIM, 16)
    linear_weights(rng, w, "fc2", 16, 2)
    return w


def softmax_graph(t):
    h = t.op("Relu", [t.linear(concat_inputs(t), "fc1")])
    z = t.linear(h, "fc2")
    t.op("Softmax", [z], out="probabilities", axis=-1)
    return [vi("probabilities", 2)], z, [h]


def dense_head(module):
    """One Gemm(k -> 1) into the logit, fitted on its input activations."""

    def apply(w, coef, b):
        w[module + ".weight"] = coef[None, :]
        w[module + ".bias"] = np.array([b])

    return dict(features=lambda x, acts: acts[0], apply=apply)


def softmax_head_fit(module):
    """Gemm(k -> 2) before Softmax: z1 - z0 = coef . h + b."""

    def apply(w, coef, b):
        w[module + ".weight"] = np.stack([-0.5 * coef, 0.5 * coef])
        w[module + ".bias"] = np.array([-0.5 * b, 0.5 * b])

    return dict(features=lambda x, acts: acts[0], apply=apply)


def wide_deep_head():
    """logit = wide(x) + deep.4(h): one linear model on [x, h]."""

    def apply(w, coef, b):
        w["wide.weight"] = coef[None, :DIM]
        w["wide.bias"] = np.array([0.5 * b])
        w["deep.4.weight"] = coef[None, DIM:]
        w["deep.4.bias"] = np.array([0.5 * b])

    return dict(features=lambda x, acts: np.hstack(acts), apply=apply)


def id_counts(x):
    ids = x[:, DIM - 2 :].astype(np.int64)
    counts = np.zeros((len(x), N_CAT))
    for k in range(2):
        np.add.at(counts, (np.arange(len(x)), ids[:, k]), 1.0)
    return counts


def deepfm_head():
    """logit = fc2(h) + sum over the two ids of first_order[id]."""

    def apply(w, coef, b):
        w["fc2.weight"] = coef[None, :32]
        w["fc2.bias"] = np.array([b])
        w["first_order.weight"] = coef[32:, None]

    return dict(features=lambda x, acts: np.hstack([acts[0], id_counts(x)]), apply=apply)


def two_tower_head():
    """logit = v . (W h + b) = sum_ij v_i W_ij h_j + v . b: linear in the
    outer product v (x) h and v; no intercept to fit."""

    def features(x, acts):
        v = x[:, USER_DIM:].astype(np.float64)
        h = acts[0].astype(np.float64)
        return np.hstack([(v[:, :, None] * h[:, None, :]).reshape(len(x), -1), v])

    def apply(w, coef, b):
        n = ITEM_DIM * 16
        w["user_tower.2.weight"] = coef[:n].reshape(ITEM_DIM, 16)
        w["user_tower.2.bias"] = coef[n:]

    # Labels without the rare shift: a zero-mean dot product has no offset.
    return dict(features=features, apply=apply, intercept=False, label_shift=0.0)


def build_torch(
    name, weights_fn, graph_fn, head, form="sigmoid", categorical=False, two=False, external=False, ids=False,
    opset=None,
):
    """A torch-style graph: seeded He-initialised hidden layers, then the
    last linear map(s) into the logit fitted by LogisticRegression on the
    hidden activations onnxruntime computes for training rows (a
    random-features model: not well trained, but its logits rank clicks)."""
    w = weights_fn(model_rng(name + "/weights"))
    inputs = [vi("user", USER_DIM), vi("item", ITEM_DIM)] if two else IDS_GRAPH_INPUTS if ids else THREE_INPUTS
    feeds = feeds_two if two else feeds_ids if ids else feeds_three
    logit_fn = logit_diff if form == "probabilities2" else logit_flat
    dim = USER_DIM + ITEM_DIM if two else DIM

    def make(weights):
        t = TorchStyle(weights)
        outputs, z, feats = graph_fn(t)
        return t.model("main_graph", inputs, outputs, opset), z, feats

    model, z, feats = make(w)
    rng = model_rng(name + "/train")
    x_fit = draw_rows(rng, N_TRAIN, 512, 2048, categorical)
    y_fit = rare_labels(rng, x_fit, categorical, head.get("label_shift", RARE_SHIFT))
    x_fit = np.ascontiguousarray(x_fit[:, :dim])
    acts = run(with_extra_outputs(model, feats), feeds(x_fit), feats)
    f = head["features"](x_fit, [a.astype(np.float64) for a in acts])
    intercept = head.get("intercept", True)
    lr = fit(LogisticRegression(C=1.0, max_iter=500, fit_intercept=intercept), f, y_fit)
    w = dict(w)
    head["apply"](w, lr.coef_[0], float(lr.intercept_[0]) if intercept else 0.0)
    w = {k: np.asarray(v, dtype=np.float64).astype(F32) for k, v in w.items()}
    model, z, _ = make(w)
    logit_from = (
        f"z1 - z0 of the pre-Softmax tensor {z}, read as an extra output"
        if form == "probabilities2"
        else f"input of the final Sigmoid ({z}), read as an extra output"
    )
    return dict(
        model=model,
        inputs=TWO_TOWER_INPUTS if two else IDS_INPUTS if ids else TORCH_INPUTS,
        feeds=feeds,
        output=None,
        output_form=form,
        output_kind="logit",
        logit_model=with_extra_outputs(model, [z]),
        logit_names=[z],
        logit_fn=logit_fn,
        logit_from=logit_from,
        reference=None,
        dim=dim,
        categorical=categorical,
        external=external,
    )


def torch(name, weights_fn, graph_fn, head, **kw):
    return name, lambda: build_torch(name, weights_fn, graph_fn, head, **kw)


# ---------------------------------------------------------------- keras

KERAS_INPUTS = (("user", USER_DIM), ("item", ITEM_DIM), ("ctx", CTX_DIM))


def keras_bn_mlp(tf):
    """Concatenate, Dense(32, relu), BatchNormalization, Dropout,
    Dense(16, relu), Dense(1, sigmoid) named head."""
    layers = tf.keras.layers
    user, item, ctx = (tf.keras.Input(shape=(d,), name=n) for n, d in KERAS_INPUTS)
    h = layers.Concatenate(name="concat")([user, item, ctx])
    h = layers.Dense(32, activation="relu", name="fc1")(h)
    h = layers.BatchNormalization(name="bn1")(h)
    h = layers.Dropout(0.2, name="drop1")(h)
    h = layers.Dense(16, activation="relu", name="fc2")(h)
    out = layers.Dense(1, activation="sigmoid", name="head")(h)
    return tf.keras.Model([user, item, ctx], out, name="keras_bn_mlp"), h


def keras_ln_residual(tf):
    """Dense(32) with the tanh-form GELU, LayerNormalization, a residual
    Dense(32, tanh) added back, Dense(16), LeakyReLU(0.1), Dense(1, sigmoid)."""
    layers = tf.keras.layers
    user, item, ctx = (tf.keras.Input(shape=(d,), name=n) for n, d in KERAS_INPUTS)
    h = layers.Concatenate(name="concat")([user, item, ctx])
    h = layers.Dense(32, activation=lambda t: tf.keras.activations.gelu(t, approximate=True), name="fc1")(h)
    h = layers.LayerNormalization(name="ln1")(h)
    h = layers.Add(name="residual")([h, layers.Dense(32, activation="tanh", name="fc2")(h)])
    h = layers.LeakyReLU(negative_slope=0.1, name="leaky")(layers.Dense(16, name="fc3")(h))
    out = layers.Dense(1, activation="sigmoid", name="head")(h)
    return tf.keras.Model([user, item, ctx], out, name="keras_ln_residual"), h


def build_keras(name, make):
    """A Keras model exported by tf2onnx.convert.from_keras (opset 17), the
    exporter a Keras user calls: seeded He-initialised hidden layers,
    non-trivial BatchNormalization and LayerNormalization parameters, and
    the head fitted by LogisticRegression on the hidden activations Keras
    computes for training rows, as the torch-style models are."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tf2onnx

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.backend.clear_session()
    model, hidden = make(tf)
    rng = model_rng(name + "/weights")
    weights = []
    for v in model.weights:
        shape, path = tuple(v.shape), v.path
        if path.endswith("kernel"):
            weights.append(rng.normal(0.0, math.sqrt(2.0 / shape[0]), size=shape))
        elif path.endswith("moving_variance"):
            weights.append(rng.uniform(0.5, 2.0, size=shape))
        elif path.endswith("gamma"):
            weights.append(rng.uniform(0.7, 1.3, size=shape))
        else:  # biases, beta, moving_mean
            weights.append(rng.normal(0.0, 0.2, size=shape))
    model.set_weights([w.astype(F32) for w in weights])
    train = model_rng(name + "/train")
    x_fit = draw_rows(train, N_TRAIN, 512, 2048)
    y_fit = rare_labels(train, x_fit)
    feats = tf.keras.Model(model.inputs, hidden)(list(feeds_three(x_fit).values()), training=False)
    lr = fit(LogisticRegression(C=1.0, max_iter=500), np.asarray(feats, dtype=np.float64), y_fit)
    model.get_layer("head").set_weights([lr.coef_[0][:, None].astype(F32), lr.intercept_.astype(F32)])
    spec = tuple(tf.TensorSpec((None, d), tf.float32, name=n) for n, d in KERAS_INPUTS)
    onnx_model, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=OPSET)
    z = last_sigmoid_input(onnx_model)
    return dict(
        model=onnx_model,
        inputs=TORCH_INPUTS,
        feeds=feeds_three,
        output=None,
        output_form="sigmoid",
        output_kind="logit",
        logit_model=with_extra_outputs(onnx_model, [z]),
        logit_names=[z],
        logit_fn=logit_flat,
        logit_from=f"input of the final Sigmoid ({z}), read as an extra output",
        reference=lambda x: model(list(feeds_three(x).values()), training=False).numpy(),
        dim=DIM,
    )


ZOO = [
    ("sklearn_mlp", build_sklearn_mlp),
    ("sklearn_mlp_zipmap", build_sklearn_mlp_zipmap),
    torch("torch_bn_mlp", bn_mlp_weights, bn_mlp_graph, dense_head("fc3")),
    torch("layernorm_mlp", layernorm_weights, layernorm_graph, dense_head("fc2")),
    torch("residual_mlp", residual_weights, residual_graph, dense_head("fc3")),
    torch("wide_deep", wide_deep_weights, wide_deep_graph, wide_deep_head()),
    torch("dcn_v2", dcn_weights, dcn_graph, dense_head("fc2")),
    torch("deepfm", deepfm_weights, deepfm_graph, deepfm_head(), categorical=True),
    torch("two_tower", two_tower_weights, two_tower_graph, two_tower_head(), two=True),
    ("logistic_regression", build_logistic_regression),
    ("scaler_mlp", build_scaler_mlp),
    torch("leaky_tanh", leaky_tanh_weights, leaky_tanh_graph, dense_head("fc3")),
    ("regression", build_regression),
    torch("external_data", external_weights, external_graph, dense_head("fc2"), external=True),
    torch("softmax_head", softmax_weights, softmax_graph, softmax_head_fit("fc2"), form="probabilities2"),
    torch("deepfm_ids", deepfm_weights, deepfm_ids_graph, deepfm_head(), categorical=True, ids=True),
    torch("layernorm_mlp_opset13", layernorm_weights, layernorm13_graph, dense_head("fc2"), opset=13),
    ("keras_bn_mlp", lambda: build_keras("keras_bn_mlp", keras_bn_mlp)),
    ("keras_ln_residual", lambda: build_keras("keras_ln_residual", keras_ln_residual)),
]


# ------------------------------------------------------------------ recording


def op_list(model):
    ops = set()
    for n in model.graph.node:
        ops.add(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}")
    return sorted(ops)


def check_graph(name, model):
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == IR_VERSION, f"{name}: ir_version {model.ir_version}"
    default = {o.version for o in model.opset_import if o.domain in ("", "ai.onnx")}
    want = 13 if name.endswith("_opset13") else OPSET
    assert default == {want}, f"{name}: default-domain opsets {default}"
    assert all(o.domain in ("", "ai.onnx", "ai.onnx.ml") for o in model.opset_import), name


def save_model(spec, path):
    model = onnx.ModelProto()
    model.CopyFrom(spec["model"])
    if not spec.get("external"):
        onnx.save_model(model, path)
        return
    data = os.path.join(os.path.dirname(path), EXTERNAL_DATA)
    if os.path.exists(data):
        os.remove(data)  # onnx appends to an existing data file
    onnx.save_model(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True,
        location=EXTERNAL_DATA, size_threshold=0,
    )
    os.chmod(data, 0o644)  # onnx creates it owner-only
    stored = onnx.load(path, load_external_data=False)
    assert stored.graph.initializer and all(
        t.data_location == TensorProto.EXTERNAL and not t.raw_data for t in stored.graph.initializer
    ), "external_data.onnx still carries initializer data inline"
    onnx.checker.check_model(path, full_check=True)


def heldout(name, spec):
    rng = model_rng(name + "/heldout")
    x = draw_rows(rng, N_HELDOUT, 256, 1024, spec.get("categorical", False))
    y = rare_labels(rng, x, spec.get("categorical", False))
    if spec.get("raw"):
        x = to_raw(x)
    return np.ascontiguousarray(x[:, : spec["dim"]]), y


def logit_of(spec, x):
    outs = run(spec["logit_model"], spec["feeds"](x), spec["logit_names"])
    return np.asarray(spec["logit_fn"](outs), dtype=np.float64)


def chosen_output(spec, model_path, x):
    """The value of the chosen output tensor, as the server would read it:
    from the saved file, with the extra output only where the chosen tensor
    is internal (the one feeding ZipMap)."""
    model = spec["model"]
    graph_outputs = [o.name for o in model.graph.output]
    name = spec["output"] or graph_outputs[0]
    if spec["output"] is None:
        assert len(graph_outputs) == 1
    src = model_path if name in graph_outputs else with_extra_outputs(model, [name])
    return np.asarray(run(src, spec["feeds"](x), [name])[0])


def record(name, spec, out_dir):
    model = spec["model"]
    check_graph(name, model)
    path = os.path.join(out_dir, name + ".onnx")
    save_model(spec, path)
    x, y = heldout(name, spec)
    logit = logit_of(spec, x)
    assert logit.shape == (len(x),), f"{name}: logit shape {logit.shape}"
    out = chosen_output(spec, path, x)
    form = spec["output_form"]
    if form == "raw":
        assert np.abs(out.reshape(-1) - logit).max() <= TOL, f"{name}: output differs from recorded value"
    else:
        p = sigmoid(logit)
        if form == "sigmoid":
            got = out.reshape(-1)
        else:
            assert out.shape == (len(x), 2), f"{name}: probabilities shape {out.shape}"
            assert np.abs(out[:, 0] - (1.0 - p)).max() <= TOL, f"{name}: class-0 probability"
            got = out[:, 1]
        err = np.abs(got - p).max()
        assert err <= TOL, f"{name}: probability vs sigmoid(logit) differs by {err}"
    if spec["reference"] is not None:
        ref = np.asarray(spec["reference"](x))
        ref = ref.reshape(-1) if form == "raw" else ref
        err = np.abs(out.reshape(ref.shape) - ref).max()
        assert err <= TOL, f"{name}: onnxruntime vs scikit-learn differs by {err}"
    if "decision" in spec:
        err = np.abs(logit - spec["decision"](x)).max()
        assert err <= TOL, f"{name}: logit vs decision_function differs by {err}"
    if "zipmap_output" in spec:
        maps = run(model, spec["feeds"](x[:64]), [spec["zipmap_output"]])[0]
        zm = np.array([[m[0], m[1]] for m in maps])
        assert np.abs(zm - out[:64]).max() <= TOL, f"{name}: ZipMap output vs its input tensor"
    # The logits vary, and every input column moves them.
    assert logit.std() > 0.1, f"{name}: logits barely vary (std {logit.std()})"
    base = x[:256]
    z0 = logit_of(spec, base)
    for j in range(spec["dim"]):
        xp = base.copy()
        if spec.get("categorical") and j >= DIM - 2:
            xp[:, j] = (xp[:, j] + 17.0) % N_CAT
        else:
            xp[:, j] = xp[:, j] * 1.5 + 1.0 + 0.05 * abs(RAW_OFFSET[j] if spec.get("raw") else 0.0)
        moved = np.abs(logit_of(spec, xp) - z0).max()
        assert moved > 1e-3, f"{name}: input column {j} does not change the logit ({moved})"
    table = np.hstack([x, y[:, None].astype(F32), logit[:, None].astype(F32)]).astype(F32)
    np.save(os.path.join(out_dir, name + ".npy"), np.ascontiguousarray(table))
    entry = {
        "file": name + ".onnx",
        "inputs": spec["inputs"],
        "output": spec["output"],
        "output_kind": spec["output_kind"],
        "output_form": form,
        "ops": op_list(model),
        "rows": int(len(x)),
        "dim": int(spec["dim"]),
        "positives": int(y.sum()),
        "max_abs_logit": float(np.abs(table[:, -1]).max()),
        "data": name + ".npy",
        "logit_from": spec["logit_from"],
    }
    if spec.get("external"):
        entry["external_data"] = EXTERNAL_DATA
    auc = rank_auc(logit, y)
    print(
        f"{name:20s} positives {entry['positives']:3d}/{len(x)}  logit [{logit.min():6.2f}, {logit.max():6.2f}]"
        f"  AUC vs labels {auc:.3f}  ops {' '.join(entry['ops'])}"
    )
    return entry


def rank_auc(score, y):
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return (ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def versions():
    import skl2onnx
    import sklearn

    try:
        import onnxmltools

        onnxmltools_version = onnxmltools.__version__
    except ImportError:  # pinned alongside, but nothing here needs it
        onnxmltools_version = None
    import tensorflow
    import tf2onnx

    return {
        "numpy": np.__version__,
        "tensorflow": tensorflow.__version__,
        "tf2onnx": tf2onnx.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "scikit-learn": sklearn.__version__,
        "skl2onnx": skl2onnx.__version__,
        "onnxmltools": onnxmltools_version,
    }


def generate(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    models = {}
    for name, build in ZOO:
        models[name] = record(name, build(), out_dir)
    index = {
        "note": (
            "written by bench/zoo_fixtures.py; each <name>.npy is float32 [rows, dim + 2]: the Quiver input "
            "vector (user | item | context; two_tower: user | item), a 0/1 label with rare positives, and "
            "onnxruntime's logit (pre-sigmoid value; z1 - z0 for two-class outputs; the raw value for "
            "output_kind raw); logit_from says how each logit was read"
        ),
        "versions": versions(),
        "models": models,
    }
    with open(os.path.join(out_dir, "zoo.json"), "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    return index


def expected_files(index):
    files = {"zoo.json"}
    for entry in index["models"].values():
        files.update([entry["file"], entry["data"]])
        if "external_data" in entry:
            files.add(entry["external_data"])
    return files


def dir_size(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# ---------------------------------------------------------------------- check


def same_json(a, b, path=""):
    """Differences between two JSON values; floats within TOL."""
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= TOL
        return [] if ok else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: present in only one")
            else:
                out += same_json(a[k], b[k], f"{path}/{k}")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def models_close(path_a, path_b):
    """The same graph, and weights within TOL: a model trained again (the
    scikit-learn MLPs) can differ in the last bits of its weights with the
    BLAS kernels the CPU picks, and that is not a different fixture."""
    a, b = onnx.load(path_a), onnx.load(path_b)
    wa = {i.name: numpy_helper.to_array(i) for i in a.graph.initializer}
    wb = {i.name: numpy_helper.to_array(i) for i in b.graph.initializer}
    if wa.keys() != wb.keys():
        return False
    for k, x in wa.items():
        y = wb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind == "f":
            if not np.abs(x.astype(np.float64) - y).max(initial=0.0) <= TOL:
                return False
        elif not np.array_equal(x, y):
            return False
    for m in (a, b):
        for i in m.graph.initializer:
            for field in ("raw_data", "float_data", "double_data", "int32_data", "int64_data"):
                i.ClearField(field)
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def compare(committed, fresh, index):
    problems = []
    expected = expected_files(index)
    present = set(os.listdir(committed)) if os.path.isdir(committed) else set()
    for f in sorted(expected - present):
        problems.append(f"{f}: missing from {committed}")
    for f in sorted(present - expected):
        problems.append(f"{f}: not written by bench/zoo_fixtures.py (stale file?)")
    for name, entry in index["models"].items():
        f = entry["file"]
        if f in present:
            try:
                a = onnx.load(os.path.join(committed, f)).SerializeToString(deterministic=True)
            except Exception as e:  # a missing or truncated external data file
                problems.append(f"{f}: cannot be loaded ({e})")
            else:
                b = onnx.load(os.path.join(fresh, f)).SerializeToString(deterministic=True)
                if a != b and not models_close(os.path.join(committed, f), os.path.join(fresh, f)):
                    problems.append(f"{f}: model differs from the regenerated one (graph, or weights by more than {TOL})")
        f = entry["data"]
        if f in present:
            a = np.load(os.path.join(committed, f))
            b = np.load(os.path.join(fresh, f))
            d = entry["dim"]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{f}: shape/dtype {a.shape} {a.dtype} != regenerated {b.shape} {b.dtype}")
            elif not np.array_equal(a[:, : d + 1], b[:, : d + 1]):
                problems.append(f"{f}: input or label columns differ from the regenerated ones")
            else:
                err = float(np.abs(a[:, d + 1].astype(np.float64) - b[:, d + 1]).max())
                if not err <= TOL:
                    problems.append(f"{f}: logit column differs by {err:.3g} (> {TOL})")
    if "zoo.json" in present:
        with open(os.path.join(committed, "zoo.json")) as fh:
            old = json.load(fh)
        if old.get("versions") != index["versions"]:
            print(
                f"zoo_fixtures: note: committed versions {old.get('versions')} differ from the "
                f"installed {index['versions']}; comparing the files anyway",
                file=sys.stderr,
            )
        old = {k: v for k, v in old.items() if k != "versions"}
        new = {k: v for k, v in index.items() if k != "versions"}
        problems += [f"zoo.json{p}" for p in same_json(old, new)]
    return problems


def main(argv):
    if argv not in ([], ["--check"]):
        print("usage: python3 bench/zoo_fixtures.py [--check]", file=sys.stderr)
        return 2
    if argv == ["--check"]:
        tmp = tempfile.mkdtemp(prefix="zoo_fixtures.")
        try:
            index = generate(tmp)
            problems = compare(OUT_DIR, tmp, index)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if problems:
            print(f"zoo_fixtures: {OUT_DIR} is out of date; rerun python3 bench/zoo_fixtures.py:", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(f"zoo_fixtures: {len(index['models'])} models in {OUT_DIR} match a fresh regeneration")
        return 0
    index = generate(OUT_DIR)
    stray = set(os.listdir(OUT_DIR)) - expected_files(index)
    if stray:
        print(f"zoo_fixtures: warning: files not written by this script: {sorted(stray)}", file=sys.stderr)
    size = dir_size(OUT_DIR)
    assert size < SIZE_LIMIT, f"{OUT_DIR} is {size} bytes, over {SIZE_LIMIT}"
    print(f"wrote {len(index['models'])} models to {OUT_DIR} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
