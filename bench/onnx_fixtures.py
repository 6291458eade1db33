#!/usr/bin/env python3
"""Generates the ONNX import fixtures under tests/fixtures/onnx/.

Why: `quiver import` must reproduce what onnxruntime computes for the graphs
standard tools export. This script trains a small CTR-style MLP on synthetic
clicks with a known generating function, exports it twice and records
onnxruntime's outputs on a held-out batch, so `cargo test` can check parity
without Python.

Outputs (all small, committed):
  ctr_sklearn.onnx  scikit-learn MLPClassifier exported by skl2onnx
                    (zipmap off): one input X [batch, 20]; outputs label and
                    probabilities; the positive-class probability is the
                    Sigmoid output named in heldout.json.
  ctr_helper.onnx   the same weights written with onnx.helper in the
                    Concat / Flatten / Gemm(transB=1) / Relu / MatMul+Add /
                    Identity / Gemm(alpha, beta) / Sigmoid style, with three
                    named inputs user_emb [batch, 8], item_emb [batch, 8],
                    ctx [batch, 4].
  heldout.json      held-out users, items and requests (16 requests x 16
                    candidates) and, per model, onnxruntime's logit (the
                    Sigmoid's input, read as an extra graph output) and
                    probability for every (request, candidate) row.
  calibration.npy   16384 rows [16384, 20] float32 from the training
                    distribution, for `quiver import --calibration`.
  auc_heldout.npy   8192 fresh rows [8192, 22] float32: the 20 features, a
                    label drawn with a rare-positive rate (the generating
                    logit shifted by -4, about 4% positives), and
                    onnxruntime's probability for ctr_helper.onnx; for the
                    INT8/FP8 AUC tests.

Rerun (from the repository root; it is deterministic for these versions):
  pip install numpy==2.4.6 onnx==1.23.2 onnxruntime==1.32.0 \
      scikit-learn==1.9.1 skl2onnx==1.20.0
  python3 bench/onnx_fixtures.py
"""

import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from skl2onnx import to_onnx
from sklearn.exceptions import ConvergenceWarning
from sklearn.neural_network import MLPClassifier

SEED = 20_261_129
USER_DIM, ITEM_DIM, CTX_DIM = 8, 8, 4
HIDDEN = (32, 16)
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "onnx")


def click_logit(u, v, c):
    """The known generating function: affinity of user and item embeddings,
    plus context effects and an interaction the MLP has to learn."""
    affinity = (u * v).sum(axis=1) / np.sqrt(USER_DIM)
    return 1.5 * affinity + 0.8 * c[:, 0] - 0.5 * c[:, 1] * c[:, 2] + 0.3 * np.tanh(u[:, 0] + v[:, 0]) - 0.5


def draw(rng, n_users, n_items, n_rows):
    users = rng.normal(size=(n_users, USER_DIM)).astype(np.float32)
    items = rng.normal(size=(n_items, ITEM_DIM)).astype(np.float32)
    u_idx = rng.integers(0, n_users, n_rows)
    i_idx = rng.integers(0, n_items, n_rows)
    ctx = rng.normal(size=(n_rows, CTX_DIM)).astype(np.float32)
    x = np.hstack([users[u_idx], items[i_idx], ctx]).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-click_logit(users[u_idx], items[i_idx], ctx)))
    y = (rng.random(n_rows) < p).astype(np.int64)
    return x, y


def with_extra_outputs(model, names):
    """A copy of `model` that also returns the tensors `names`, so
    onnxruntime reports the logit under the final Sigmoid."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in names:
        m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 1]))
    return m


def run(model, feeds, names):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(names, feeds)


def helper_model(clf):
    w1, w2, w3 = [w.astype(np.float32) for w in clf.coefs_]
    b1, b2, b3 = [b.astype(np.float32) for b in clf.intercepts_]
    inits = [
        # Gemm with transB=1 stores the weight as [out, in].
        numpy_helper.from_array(np.ascontiguousarray(w1.T), "dense1_w"),
        # float_data rather than raw_data, to cover both encodings.
        helper.make_tensor("dense1_b", TensorProto.FLOAT, [HIDDEN[0]], b1.tolist()),
        numpy_helper.from_array(w2, "dense2_w"),
        numpy_helper.from_array(b2, "dense2_b"),
        # alpha=0.5 and beta=2 are powers of two, so the rescaled weights
        # give bit-identical products.
        numpy_helper.from_array(w3 * np.float32(2.0), "out_w"),
        numpy_helper.from_array(b3 * np.float32(0.5), "out_b"),
    ]
    nodes = [
        helper.make_node("Concat", ["user_emb", "item_emb", "ctx"], ["features"], name="concat_inputs", axis=1),
        helper.make_node("Flatten", ["features"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "dense1_w", "dense1_b"], ["h1_pre"], name="dense1", transB=1),
        helper.make_node("Relu", ["h1_pre"], ["h1"], name="relu1"),
        helper.make_node("MatMul", ["h1", "dense2_w"], ["h2_mm"], name="dense2_matmul"),
        helper.make_node("Add", ["h2_mm", "dense2_b"], ["h2_pre"], name="dense2_bias"),
        helper.make_node("Relu", ["h2_pre"], ["h2"], name="relu2"),
        helper.make_node("Identity", ["h2"], ["h2_id"], name="identity"),
        helper.make_node("Gemm", ["h2_id", "out_w", "out_b"], ["logit"], name="out", alpha=0.5, beta=2.0),
        helper.make_node("Sigmoid", ["logit"], ["probability"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "ctr_mlp",
        [
            helper.make_tensor_value_info("user_emb", TensorProto.FLOAT, ["batch", USER_DIM]),
            helper.make_tensor_value_info("item_emb", TensorProto.FLOAT, ["batch", ITEM_DIM]),
            helper.make_tensor_value_info("ctx", TensorProto.FLOAT, ["batch", CTX_DIM]),
        ],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    model = helper.make_model(
        graph, producer_name="quiver-onnx-fixtures", opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def floats(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).ravel()]


def main():
    rng = np.random.default_rng(SEED)
    x_train, y_train = draw(rng, 512, 2048, 20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=HIDDEN, max_iter=60, random_state=0).fit(x_train, y_train)

    # Held out: fresh users, items and contexts from the same generator.
    users = rng.normal(size=(16, USER_DIM)).astype(np.float32)
    items = rng.normal(size=(64, ITEM_DIM)).astype(np.float32)
    requests = []
    rows = []
    for r in range(16):
        cand = sorted(rng.choice(64, size=16, replace=False).tolist())
        ctx = rng.normal(size=CTX_DIM).astype(np.float32)
        requests.append({"user": r, "items": cand, "context": floats(ctx)})
        for i in cand:
            rows.append(np.concatenate([users[r], items[i], ctx]))
    x = np.stack(rows).astype(np.float32)
    labels = (rng.random(len(x)) < 1 / (1 + np.exp(-click_logit(x[:, :8], x[:, 8:16], x[:, 16:])))).astype(int)

    sk = to_onnx(clf, x[:1], options={id(clf): {"zipmap": False}}, target_opset=17)
    sig = next(n for n in sk.graph.node if n.op_type == "Sigmoid")
    sk_logit, sk_prob = run(with_extra_outputs(sk, [sig.input[0], sig.output[0]]), {"X": x}, [sig.input[0], sig.output[0]])

    hm = helper_model(clf)
    feeds = {"user_emb": x[:, :8], "item_emb": x[:, 8:16], "ctx": x[:, 16:]}
    h_logit, h_prob = run(with_extra_outputs(hm, ["logit"]), feeds, ["logit", "probability"])

    # Both forms are the same network, and both match scikit-learn itself.
    sk_ref = clf.predict_proba(x)[:, 1]
    assert np.abs(sk_prob.ravel() - sk_ref).max() < 1e-5
    assert np.abs(h_prob.ravel() - sk_ref).max() < 1e-5

    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "ctr_sklearn.onnx"), "wb") as f:
        f.write(sk.SerializeToString())
    with open(os.path.join(OUT_DIR, "ctr_helper.onnx"), "wb") as f:
        f.write(hm.SerializeToString())
    heldout = {
        "note": "written by bench/onnx_fixtures.py; rows are requests x candidates in order",
        "versions": {
            "numpy": np.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "skl2onnx": __import__("skl2onnx").__version__,
            "scikit-learn": __import__("sklearn").__version__,
        },
        "users": [floats(u) for u in users],
        "items": [floats(v) for v in items],
        "requests": requests,
        "models": {
            "ctr_sklearn.onnx": {
                "ops": sorted({n.op_type for n in sk.graph.node}),
                "sigmoid_output": sig.output[0],
                "logit": floats(sk_logit),
                "probability": floats(sk_prob),
            },
            "ctr_helper.onnx": {
                "ops": sorted({n.op_type for n in hm.graph.node}),
                "sigmoid_output": "probability",
                "logit": floats(h_logit),
                "probability": floats(h_prob),
            },
        },
    }
    with open(os.path.join(OUT_DIR, "heldout.json"), "w") as f:
        json.dump(heldout, f, indent=1)
        f.write("\n")
    # Drawn after everything above, so the older fixtures stay identical.
    x_cal, _ = draw(rng, 2048, 8192, 16384)
    np.save(os.path.join(OUT_DIR, "calibration.npy"), np.ascontiguousarray(x_cal, dtype=np.float32))
    x_auc, _ = draw(rng, 256, 1024, 8192)
    rare = 1.0 / (1.0 + np.exp(-(click_logit(x_auc[:, :8], x_auc[:, 8:16], x_auc[:, 16:]) - 4.0)))
    y_auc = (rng.random(len(x_auc)) < rare).astype(np.float32)
    feeds = {"user_emb": x_auc[:, :8], "item_emb": x_auc[:, 8:16], "ctx": x_auc[:, 16:]}
    (p_auc,) = run(hm, feeds, ["probability"])
    table = np.hstack([x_auc, y_auc[:, None], p_auc.reshape(-1, 1)]).astype(np.float32)
    np.save(os.path.join(OUT_DIR, "auc_heldout.npy"), np.ascontiguousarray(table))
    print(f"auc_heldout.npy: {int(y_auc.sum())} positives in {len(y_auc)} rows")

    acc = ((h_prob.ravel() > 0.5) == labels).mean()
    print(f"held-out accuracy against sampled labels: {acc:.3f}; files in {os.path.normpath(OUT_DIR)}")


if __name__ == "__main__":
    main()
