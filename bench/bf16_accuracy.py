#!/usr/bin/env python3
"""What AMX-BF16 would cost in accuracy on the model zoo: every zoo model
run by onnxruntime (CPU, single thread) in f32, and again with both operands
of every MatMul and Gemm rounded to bf16 (round to nearest even; constant
weights rounded in place, activations through a Cast to BFLOAT16 and back),
the products accumulated in f32 as `tdpbf16ps` does. Compared on 2,048
seeded rows per model (bench/zoo_side_by_side.py's inputs): the largest and
mean absolute difference of the tensor quiver reads.

Why: issue 34 asks where an AMX-BF16 path belongs; its accuracy against f32
on the zoo is half of that answer (docs/KERNELS.md has the other half, the
speeds). Models whose dense math is not a MatMul or Gemm
(logistic_regression's LinearClassifier, scaler_mlp's ai.onnx.ml ops) are
unchanged and show 0.

Run from the repository root on a committed tree:
  pip install numpy onnx onnxruntime
  python3 bench/bf16_accuracy.py
Writes bench/results/bf16_accuracy.json and bf16_accuracy.md (rendered into
docs/BENCHMARKS.md by bench/report.py) and prints the latter.
"""

import json
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import zoo_side_by_side as zoo
from provenance import git_commit, write_results

ROWS = 2048


def bf16_round(a):
    """f32 values rounded to the nearest bf16 (ties to even), as f32."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def to_bf16_operands(model):
    """The model with both operands of each MatMul and Gemm rounded to bf16."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes, casts = [], 0
    for node in g.node:
        if node.op_type in ("MatMul", "Gemm"):
            ins = list(node.input)
            for j, name in enumerate(ins[:2]):
                if name in inits:
                    arr = numpy_helper.to_array(inits[name])
                    if arr.dtype == np.float32:
                        inits[name].CopyFrom(numpy_helper.from_array(bf16_round(arr), name))
                else:
                    half, back = f"bf16_{casts}_half", f"bf16_{casts}_back"
                    casts += 1
                    nodes.append(helper.make_node("Cast", [name], [half], to=TensorProto.BFLOAT16))
                    nodes.append(helper.make_node("Cast", [half], [back], to=TensorProto.FLOAT))
                    ins[j] = back
            del node.input[:]
            node.input.extend(ins)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    return model


def main():
    commit = git_commit()
    if commit.endswith("+dirty"):
        sys.exit(f"bf16_accuracy: the tree is {commit}: commit first, so the figures name what they measured")
    with open(os.path.join(zoo.ZOO, "zoo.json")) as f:
        models = json.load(f)["models"]
    rng = np.random.default_rng(zoo.SEED)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, spec in models.items():
            src, fetch, _ = zoo.fetch_name(onnx.load(os.path.join(zoo.ZOO, spec["file"])), spec)
            f32_path, bf16_path = os.path.join(d, f"{name}.onnx"), os.path.join(d, f"{name}_bf16.onnx")
            onnx.save(src, f32_path)
            f32 = zoo.session(f32_path)
            feeds = zoo.make_feeds(f32, name, ROWS, rng)
            want = f32.run([fetch], feeds)[0].astype(np.float64)
            onnx.save(to_bf16_operands(onnx.load(f32_path)), bf16_path)
            got = zoo.session(bf16_path).run([fetch], feeds)[0].astype(np.float64)
            diff = np.abs(got - want)
            results[name] = {"fetch": fetch, "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                             "max_abs_f32_output": float(np.abs(want).max())}
    report = {"what": "bf16 operands at every MatMul/Gemm, f32 accumulation, against f32; onnxruntime CPU",
              "commit": commit, "rows": ROWS, "seed": zoo.SEED, "onnxruntime": ort.__version__,
              "models": results}
    lines = ["## AMX-BF16's accuracy on the zoo, emulated\n",
             f"Written by `bench/bf16_accuracy.py` (commit `{commit}`; onnxruntime {ort.__version__}): each zoo "
             f"model in f32 against the same model with both operands of every MatMul and Gemm rounded to bf16 "
             f"(round to nearest even) and the products summed in f32, as AMX-BF16 (`tdpbf16ps`) would compute "
             f"them; {ROWS} seeded rows per model. Absolute differences of the tensor quiver reads.\n",
             "| model | output read | max abs diff | mean abs diff | max abs f32 output |",
             "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | `{r['fetch']}` | {r['max_abs']:.2e} | {r['mean_abs']:.2e} | "
                     f"{r['max_abs_f32_output']:.3f} |")
    md = "\n".join(lines) + "\n"
    write_results(zoo.RESULTS, "bf16_accuracy", report, md)


if __name__ == "__main__":
    main()
