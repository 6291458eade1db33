#!/usr/bin/env python3
"""Generates the onnxruntime-backend fixtures under tests/fixtures/ort/.

Why: a graph with one op outside the native compiler's set must still be
servable (`quiver import --onnxruntime`, a server built with
`--features onnxruntime`), and its scores must be exactly what onnxruntime
computes in Python for the same rows. These graphs use ops the native path
refuses, written with onnx.helper the way exporters emit them:

  relu6_mlp   inputs `features` [batch, 16] (user 8 | item 8) and `ctx`
              [batch, 4]; Concat, Gemm, Clip(0, 6) (ReLU6, as MobileNet-style
              and quantization-aware exports write it), Gemm, Softplus, Gemm,
              Sigmoid. Output `p` [batch, 1], a probability.
              --inputs user=features:8,item=features:8,context=ctx:4
  hashed_ids  inputs `dense` [batch, 16] (user 8 | item 8) and `ids`
              [batch, 2] int64 (the request's context_ids); Mod 97 (id
              hashing), Gather from a [97, 4] embedding, Flatten, Concat,
              Gemm, Relu, Gemm and a two-class Softmax. Output `probs`
              [batch, 2], read at column 1.
              --inputs user=dense:8,item=dense:8,context_ids=ids:2

Rows come in requests: row r is candidate r % 8 of request r // 8 (32
requests of 8 candidates), so each request's rows share the user and the
context, and a server can be fed them from replicas (user id = request,
item id = row). Per model, <name>.npy is float32 [256, D + 1]: the D input
columns in Quiver's input order (user, item, then context or context_ids,
ids as floats) and onnxruntime's (CPUExecutionProvider, one thread) output
for the row, the probability the server must return bit for bit.

Seeded; the pinned wheels are in .ci/run (onnx, onnxruntime, numpy).
  python3 bench/ort_fixtures.py            # (re)write tests/fixtures/ort/
  python3 bench/ort_fixtures.py --check    # regenerate into a temporary
                                           # directory and compare
"""

import os
import shutil
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "ort")
REQUESTS = 32
CANDIDATES = 8
ROWS = REQUESTS * CANDIDATES


def rows_of(rng, context_cols, ids=False):
    """user 8 | item 8 | context (floats, or integer ids as floats)."""
    users = rng.normal(size=(REQUESTS, 8)).astype(np.float32)
    items = rng.normal(size=(ROWS, 8)).astype(np.float32)
    if ids:
        ctx = rng.integers(0, 10_000, size=(REQUESTS, context_cols)).astype(np.float32)
    else:
        ctx = rng.normal(size=(REQUESTS, context_cols)).astype(np.float32)
    r = np.arange(ROWS)
    return np.concatenate([users[r // CANDIDATES], items, ctx[r // CANDIDATES]], axis=1)


def init(name, array):
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def relu6_mlp(rng):
    w1 = (rng.normal(size=(32, 20)) * 0.4).astype(np.float32)
    w2 = (rng.normal(size=(16, 32)) * 0.3).astype(np.float32)
    w3 = (rng.normal(size=(1, 16)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("Concat", ["features", "ctx"], ["x"], name="/Concat", axis=1),
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="/fc1/Gemm", transB=1),
        helper.make_node("Clip", ["h1", "zero", "six"], ["a1"], name="/act1/Clip"),
        helper.make_node("Gemm", ["a1", "w2", "b2"], ["h2"], name="/fc2/Gemm", transB=1),
        helper.make_node("Softplus", ["h2"], ["a2"], name="/act2/Softplus"),
        helper.make_node("Gemm", ["a2", "w3", "b3"], ["z"], name="/out/Gemm", transB=1),
        helper.make_node("Sigmoid", ["z"], ["p"], name="/Sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "relu6_mlp",
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 16]),
            helper.make_tensor_value_info("ctx", TensorProto.FLOAT, ["batch", 4]),
        ],
        [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["batch", 1])],
        [
            init("w1", w1),
            init("b1", (rng.normal(size=32) * 0.1).astype(np.float32)),
            init("zero", np.array(0.0, np.float32)),
            init("six", np.array(6.0, np.float32)),
            init("w2", w2),
            init("b2", (rng.normal(size=16) * 0.1).astype(np.float32)),
            init("w3", w3),
            init("b3", np.array([-1.0], np.float32)),
        ],
    )
    x = rows_of(rng, 4)
    feeds = lambda rows: {"features": rows[:, :16], "ctx": rows[:, 16:20]}
    return graph, x, feeds, "p", 0, "user=features:8,item=features:8,context=ctx:4"


def hashed_ids(rng):
    table = (rng.normal(size=(97, 4)) * 0.5).astype(np.float32)
    w1 = (rng.normal(size=(16, 24)) * 0.4).astype(np.float32)
    w2 = (rng.normal(size=(2, 16)) * 0.4).astype(np.float32)
    nodes = [
        helper.make_node("Mod", ["ids", "buckets"], ["hashed"], name="/hash/Mod"),
        helper.make_node("Gather", ["table", "hashed"], ["emb"], name="/emb/Gather", axis=0),
        helper.make_node("Flatten", ["emb"], ["emb_flat"], name="/emb/Flatten", axis=1),
        helper.make_node("Concat", ["dense", "emb_flat"], ["x"], name="/Concat", axis=1),
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="/fc1/Gemm", transB=1),
        helper.make_node("Relu", ["h1"], ["a1"], name="/fc1/Relu"),
        helper.make_node("Gemm", ["a1", "w2", "b2"], ["z"], name="/out/Gemm", transB=1),
        helper.make_node("Softmax", ["z"], ["probs"], name="/Softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "hashed_ids",
        [
            helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["batch", 16]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 2]),
        ],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 2])],
        [
            init("buckets", np.array(97, np.int64)),
            init("table", table),
            init("w1", w1),
            init("b1", (rng.normal(size=16) * 0.1).astype(np.float32)),
            init("w2", w2),
            init("b2", np.array([0.5, -0.5], np.float32)),
        ],
    )
    x = rows_of(rng, 2, ids=True)
    feeds = lambda rows: {"dense": rows[:, :16], "ids": rows[:, 16:18].astype(np.int64)}
    return graph, x, feeds, "probs", 1, "user=dense:8,item=dense:8,context_ids=ids:2"


MODELS = {"relu6_mlp": relu6_mlp, "hashed_ids": hashed_ids}


def session(model_bytes):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def generate(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    index = {}
    for i, (name, build) in enumerate(MODELS.items()):
        rng = np.random.default_rng(20261202 + i)
        graph, x, feeds, output, column, inputs = build(rng)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="ort_fixtures")
        model.ir_version = 8
        onnx.checker.check_model(model)
        data = model.SerializeToString()
        with open(os.path.join(out_dir, name + ".onnx"), "wb") as f:
            f.write(data)
        s = session(data)
        # Scored one request at a time, as the server runs them.
        want = np.concatenate(
            [s.run([output], feeds(x[r : r + CANDIDATES]))[0][:, column] for r in range(0, ROWS, CANDIDATES)]
        ).astype(np.float32)
        table = np.concatenate([x, want[:, None]], axis=1).astype(np.float32)
        np.save(os.path.join(out_dir, name + ".npy"), np.ascontiguousarray(table))
        index[name] = {"inputs": inputs, "dim": x.shape[1], "output_column": column}
    with open(os.path.join(out_dir, "ort.json"), "w") as f:
        import json

        json.dump({"models": index, "requests": REQUESTS, "candidates": CANDIDATES}, f, indent=2, sort_keys=True)
        f.write("\n")
    return index


def compare(a_dir, b_dir, index):
    problems = []
    files = ["ort.json"] + [n + ext for n in index for ext in (".onnx", ".npy")]
    for f in files:
        a, b = os.path.join(a_dir, f), os.path.join(b_dir, f)
        if not os.path.exists(a):
            problems.append(f"{f}: missing")
        elif open(a, "rb").read() != open(b, "rb").read():
            problems.append(f"{f}: differs")
    return problems


def main(argv):
    if argv not in ([], ["--check"]):
        print("usage: python3 bench/ort_fixtures.py [--check]", file=sys.stderr)
        return 2
    if argv == ["--check"]:
        tmp = tempfile.mkdtemp(prefix="ort_fixtures.")
        try:
            index = generate(tmp)
            problems = compare(OUT_DIR, tmp, index)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if problems:
            print(f"ort_fixtures: {OUT_DIR} is out of date; rerun python3 bench/ort_fixtures.py:", file=sys.stderr)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        print(f"ort_fixtures: {len(index)} models in {OUT_DIR} match a fresh regeneration")
        return 0
    index = generate(OUT_DIR)
    print(f"wrote {len(index)} models to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
