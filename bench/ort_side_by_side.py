#!/usr/bin/env python3
"""Side-by-side CPU timing: onnxruntime f32 and onnxruntime INT8 (static
quantization by onnxruntime.quantization, per-channel, QOperator) against
`quiver time-model` (int8, f32, fp8) on the same model and batch sizes, in
one run, single thread, printing medians and ratios.

Why: issue 3's targets are relative to the runtime users would otherwise
pick: at batch 32, quiver INT8 >= 3x onnxruntime f32 and >= 1.5x onnxruntime
INT8, single thread.

The model is the demo's shape (80 -> 256 -> ReLU -> 128 -> ReLU -> 1,
Sigmoid), seeded random weights, written with onnx.helper; both sides
quantize it with the same 4096-row calibration set (quiver: max-abs).
onnxruntime is timed through `InferenceSession.run` from Python, so its
figures include the Python call overhead (a few microseconds), which weighs
most at batch 1; quiver's are `Backend::score` inside the process.

Run from the repository root after `cargo build --release`, on a committed
tree (the figures name the commit they measured):
  pip install numpy onnx onnxruntime
  taskset -c 1 python3 bench/ort_side_by_side.py [--iters 200] [--rows 1,8,32,256,1024]
      [--int8-kernels amx,avx512-vnni]   (a quiver INT8 column per forced kernel)
QUIVER_BIN=/path/to/quiver measures that binary instead of
target/release/quiver (a build with another CARGO_TARGET_DIR).
Writes bench/results/ort_side_by_side.json and ort_side_by_side.md (rendered
into docs/BENCHMARKS.md by bench/report.py) and prints the latter.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from provenance import git_commit

DIMS = (80, 256, 128, 1)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The binary measured: QUIVER_BIN names one built elsewhere (another
# CARGO_TARGET_DIR, a worktree's), else the repository's release build.
QUIVER = os.environ.get("QUIVER_BIN") or os.path.join(ROOT, "target", "release", "quiver")


def build_model(path, rng):
    inits, nodes, prev = [], [], "x"
    for i, (k, n) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        w = (rng.normal(size=(n, k)) * np.sqrt(2.0 / k)).astype(np.float32)
        b = (rng.normal(size=n) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [out], name=f"dense{i}", transB=1))
        if i + 2 < len(DIMS):
            nodes.append(helper.make_node("Relu", [out], [out + "_relu"], name=f"relu{i}"))
            out += "_relu"
        prev = out
    nodes.append(helper.make_node("Sigmoid", [prev], ["probability"], name="sigmoid"))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DIMS[0]])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["batch", 1])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)


class Reader(CalibrationDataReader):
    def __init__(self, x):
        self.batches = iter([{"x": x[i : i + 256]} for i in range(0, len(x), 256)])

    def get_next(self):
        return next(self.batches, None)


def time_ort(path, rows, iters, rng):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    out = {}
    for n in rows:
        x = rng.normal(size=(n, DIMS[0])).astype(np.float32)
        for _ in range(10):
            sess.run(None, {"x": x})
        ns = []
        for _ in range(iters):
            t = time.perf_counter_ns()
            sess.run(None, {"x": x})
            ns.append(time.perf_counter_ns() - t)
        out[n] = float(np.median(ns)) / 1e3
    return out


def time_quiver(qm, backend, rows, iters, kernel=None):
    cmd = [QUIVER, "time-model", "--model", qm, "--backend", backend, "--iters", str(iters)]
    cmd += ["--rows", ",".join(map(str, rows))]
    if kernel:
        cmd += ["--kernel", kernel]
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    return {(j := json.loads(line))["rows"]: j["median_us"] for line in lines}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", default="1,8,32,256,1024")
    ap.add_argument("--int8-kernels", default="",
                    help="also time quiver int8 with each of these forced kernels (e.g. amx,avx512-vnni)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    kernels = [k for k in args.int8_kernels.split(",") if k]
    if not os.path.exists(QUIVER):
        sys.exit(f"{QUIVER} not found: run cargo build --release first")
    commit = git_commit()
    if commit.endswith("+dirty") or commit == "unknown":
        sys.exit(f"ort_side_by_side: the tree is {commit}: commit first, so the figures name what they measured")
    rng = np.random.default_rng(20_261_129)
    with tempfile.TemporaryDirectory() as d:
        f32_path, int8_path = os.path.join(d, "mlp.onnx"), os.path.join(d, "mlp_int8.onnx")
        calib_path, qm = os.path.join(d, "calib.npy"), os.path.join(d, "mlp.qm")
        build_model(f32_path, rng)
        calib = rng.normal(size=(4096, DIMS[0])).astype(np.float32)
        np.save(calib_path, calib)
        quantize_static(
            f32_path,
            int8_path,
            Reader(calib),
            quant_format=QuantFormat.QOperator,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        imported = subprocess.run(
            [QUIVER, "import", "--onnx", f32_path, "--out", qm, "--name", "mlp", "--version", "1",
             "--inputs", "user:32,item:32,context:16", "--calibration", calib_path],
            check=True, capture_output=True, text=True,
        )
        # The import measures static and dynamic INT8 on the calibration set
        # and keeps the more accurate (`score::accuracy`): say which ran.
        chosen = sorted({m for m in re.findall(r"layer \d+: runs (\w+)", imported.stdout)})
        t = {
            "ort-f32": time_ort(f32_path, rows, args.iters, rng),
            "ort-int8": time_ort(int8_path, rows, args.iters, rng),
            "quiver-int8": time_quiver(qm, "int8", rows, args.iters),
            "quiver-f32": time_quiver(qm, "f32", rows, args.iters),
            "quiver-fp8": time_quiver(qm, "fp8", rows, args.iters),
        }
        for k in kernels:
            t[f"quiver-int8-{k}"] = time_quiver(qm, "int8", rows, args.iters, k)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    results = {"commit": commit, "onnxruntime": ort.__version__, "iters": args.iters, "int8_kernels": kernels, "quiver_int8_activations": chosen,
               "machine": {"cpu": cpu, "cores": os.cpu_count()}, "median_us": {c: t[c] for c in t}}
    cols = list(t)
    lines = [
        "## The demo MLP side by side with onnxruntime",
        "",
        f"Written by `bench/ort_side_by_side.py` (commit `{commit}`; {cpu}, {os.cpu_count()} cores): the demo's shape "
        f"({' → '.join(map(str, DIMS))}, ReLU between, seeded random weights). onnxruntime {ort.__version__} INT8 is "
        "`quantize_static` (QOperator, per-channel, u8 activations, s8 weights) on the same 4,096-row calibration set "
        "quiver uses (max-abs); `quiver import` measured static and dynamic INT8 on that set and kept "
        f"{' and '.join(chosen) or 'static'} activations (the more accurate there). Single thread on both sides; medians of "
        f"{args.iters} calls, µs per call. onnxruntime is called from Python, so its times include the Python call "
        "overhead (a few µs; it dominates at batch 1).",
        "",
        "| rows | " + " | ".join(cols) + " | ort-f32 / quiver-int8 | ort-int8 / quiver-int8 |"
        + "".join(f" ort-int8 / quiver-int8-{k} |" for k in kernels),
        "|---:|" + "---:|" * (len(cols) + 2 + len(kernels)),
    ]
    for n in rows:
        r1 = t["ort-f32"][n] / t["quiver-int8"][n]
        r2 = t["ort-int8"][n] / t["quiver-int8"][n]
        rk = "".join(f" {t['ort-int8'][n] / t[f'quiver-int8-{k}'][n]:.2f}× |" for k in kernels)
        lines.append(f"| {n} | " + " | ".join(f"{t[c][n]:.2f}" for c in cols) + f" | {r1:.2f}× | {r2:.2f}× |" + rk)
    if kernels:
        lines += ["", "quiver-int8-K is `quiver time-model --backend int8 --kernel K` on the same model file; "
                  "plain quiver-int8 is the kernel `auto` picks on this machine."]
        for n in (32, 256):
            if n in rows:
                lines.append(f"- Issue 34's target at {n} rows, quiver INT8 at least 8× onnxruntime INT8: "
                             + ", ".join(f"{k} {t['ort-int8'][n] / t[f'quiver-int8-{k}'][n]:.2f}×" for k in kernels) + ".")
    if 32 in rows:
        r1 = t["ort-f32"][32] / t["quiver-int8"][32]
        r2 = t["ort-int8"][32] / t["quiver-int8"][32]
        lines += [
            "",
            "Issue 3's targets at batch 32: quiver INT8 at least 3× onnxruntime f32 "
            f"({r1:.2f}×, {'met' if r1 >= 3 else 'not met'}) and 1.5× onnxruntime INT8 "
            f"({r2:.2f}×, {'met' if r2 >= 1.5 else 'not met'}).",
        ]
    text = "\n".join(lines)
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ort_side_by_side.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "ort_side_by_side.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
