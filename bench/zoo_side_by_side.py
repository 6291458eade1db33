#!/usr/bin/env python3
"""Side-by-side CPU timing over the ONNX "model zoo" (tests/fixtures/zoo/):
onnxruntime f32 and onnxruntime INT8 (dynamic quantization by
onnxruntime.quantization.quantize_dynamic) against `quiver time-model`
(int8, f32, fp8) on every zoo model at batch 1, 32 and 256, in one run,
single thread, printing medians and ratios as a Markdown table and writing
them to bench/results/zoo_side_by_side.json (and .md; --json and --md
name others, e.g. zoo_side_by_side_amd.* for the other machine kind's
figures, which bench/report.py renders beside the first's).

Why: issue 3's targets are relative to the runtime users would otherwise
pick, and bench/ort_side_by_side.py checks them on one hand-written MLP
only. This checks them on the graphs real exporters write: at batch 32,
quiver INT8 >= 3x onnxruntime f32 and >= 1.5x onnxruntime INT8 on every zoo
model, and quiver f32 no slower than onnxruntime f32. The script reports
which targets each model meets; it does not tune anything to meet them.

How each side runs:
  onnxruntime: CPUExecutionProvider, intra/inter op threads 1, sequential,
    graph optimizations on (ORT_ENABLE_ALL). Feeds are the inputs the graph
    declares (skl2onnx models: one input X [N, 20]; torch-style: user, item,
    ctx, or user and item for two_tower), seeded normal float32, except
    deepfm's ctx columns 2 and 3, integer category ids in [0, 50) as floats.
    Only the tensor quiver reads is fetched (the index's `output`, else the
    graph's single output; sklearn_mlp_zipmap's `probabilities` is added as
    a graph output), though onnxruntime may still run the rest of the graph.
    Timed through `InferenceSession.run` from Python: the median of the
    per-call wall times after 20 warm-up calls, so its figures include the
    Python call overhead (a few microseconds; it dominates at batch 1).
  onnxruntime INT8: quantize_dynamic (u8 dynamic activations) on a copy of
    the model in which each Gemm with constant weights is rewritten to
    MatMul (+ Add), since quantize_dynamic does not quantize Gemm (its
    integer-op registry is Conv, MatMul, Attention, LSTM, Gather, ...).
    Tried in order: per-channel QInt8 weights, per-channel QUInt8,
    per-tensor QInt8, per-tensor QUInt8; the first whose session loads and
    runs is kept. A model is "n/a" with the reason when every attempt fails,
    or when quantize_dynamic quantizes nothing (logistic_regression's
    ai.onnx.ml LinearClassifier has no MatMul), since timing the unchanged
    f32 graph as INT8 would be misleading.
  quiver: `quiver import` of each model into a temporary directory (no
    calibration: graph models cannot be calibrated yet, so the INT8 backend
    quantizes activations per row, the same dynamic semantics as
    quantize_dynamic), then `quiver time-model --backend int8|f32|fp8
    --rows 1,32,256 --iters N`, the median of N calls of Backend::score
    inside the process on seeded normal inputs (time-model's own; for deepfm
    those are not integer ids).

With --repeats R (default 3) the whole measurement runs R times, models
interleaved; each reported time is the median of the R runs' medians and
each ratio the median of the R runs' ratios. The machine (lscpu), the CPU
affinity and the package versions go into the JSON.

Run from the repository root after `cargo build --release`, pinned to one
core, with nothing else running:
  pip install numpy onnx onnxruntime
  taskset -c 1 python3 bench/zoo_side_by_side.py [--repeats 3] [--iters 200]
      [--iters-256 100] [--rows 1,32,256] [--models a,b]
      [--int8-kernels amx,avx512-vnni]
--int8-kernels adds a quiver INT8 column per forced kernel (`time-model
--kernel K`), so an AMX machine shows amx, avx512-vnni and onnxruntime INT8
side by side in one run (issue 34).
QUIVER_BIN=/path/to/quiver measures that binary instead of
target/release/quiver (a build with another CARGO_TARGET_DIR).
"""

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile

from provenance import git_commit
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The binary measured: QUIVER_BIN names one built elsewhere (another
# CARGO_TARGET_DIR, a worktree's), else the repository's release build.
QUIVER = os.environ.get("QUIVER_BIN") or os.path.join(ROOT, "target", "release", "quiver")
ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")
RESULTS = os.path.join(ROOT, "bench", "results")
SEED = 20_261_215
N_CAT = 50  # deepfm's category ids in ctx columns 2 and 3
WARMUP = 20
TARGET_BATCH = 32
QUANTIZED_OPS = {
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "ConvInteger",
    "QLinearMatMul",
    "DequantizeLinear",
}
QUANTIZABLE = {"MatMul", "Conv", "Gather", "Attention", "LSTM"}  # what quantize_dynamic quantizes here
ATTEMPTS = [
    {"per_channel": True, "weight_type": "QInt8"},
    {"per_channel": True, "weight_type": "QUInt8"},
    {"per_channel": False, "weight_type": "QInt8"},
    {"per_channel": False, "weight_type": "QUInt8"},
]
RUNTIMES = ["ort_f32", "ort_int8", "quiver_int8", "quiver_f32", "quiver_fp8"]
RATIOS = {
    "ort_f32_over_quiver_int8": ("ort_f32", "quiver_int8"),
    "ort_int8_over_quiver_int8": ("ort_int8", "quiver_int8"),
    "ort_f32_over_quiver_f32": ("ort_f32", "quiver_f32"),
}
TARGETS = [  # (key, ratio, threshold, label)
    ("int8_3x_ort_f32", "ort_f32_over_quiver_int8", 3.0, "quiver int8 ≥ 3× ort f32"),
    ("int8_1.5x_ort_int8", "ort_int8_over_quiver_int8", 1.5, "quiver int8 ≥ 1.5× ort int8"),
    ("f32_not_slower_than_ort_f32", "ort_f32_over_quiver_f32", 1.0, "quiver f32 ≥ ort f32"),
]


# ---------------------------------------------------------------- onnxruntime


def session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def fetch_name(model, spec):
    """The tensor quiver reads; added as a graph output where it is an
    intermediate one (sklearn_mlp_zipmap). Returns (model, name, added)."""
    outputs = [o.name for o in model.graph.output]
    name = spec["output"] or (outputs[0] if len(outputs) == 1 else None)
    if name is None:
        raise ValueError(f"no output named in the index and {len(outputs)} graph outputs")
    if name in outputs:
        return model, name, False
    inferred = onnx.shape_inference.infer_shapes(model)
    vi = next((v for v in inferred.graph.value_info if v.name == name), None)
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        vi = helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["batch", None])
    model.graph.output.append(vi)
    return model, name, True


def make_feeds(sess, name, rows, rng):
    feeds = {}
    for i in sess.get_inputs():
        dim = i.shape[1]
        if not isinstance(dim, int):
            raise ValueError(f"input {i.name} has no fixed width: {i.shape}")
        if i.type == "tensor(int64)":
            # Category ids (deepfm_ids' `ids`, the request's context_ids).
            x = rng.integers(0, N_CAT, size=(rows, dim)).astype(np.int64)
        else:
            x = rng.normal(size=(rows, dim)).astype(np.float32)
        if name == "deepfm" and i.name == "ctx":
            x[:, 2:4] = rng.integers(0, N_CAT, size=(rows, 2)).astype(np.float32)
        feeds[i.name] = np.ascontiguousarray(x)
    return feeds


def time_ort(sess, fetch, feeds, iters):
    for _ in range(WARMUP):
        sess.run(fetch, feeds)
    ns = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        sess.run(fetch, feeds)
        ns.append(time.perf_counter_ns() - t)
    return float(np.median(ns)) / 1e3


def gemm_to_matmul(model):
    """Rewrites each Gemm whose B is an initializer (transA 0) to MatMul with
    B (transposed if transB, scaled by alpha) and an Add of beta * C, so that
    quantize_dynamic can quantize it. Returns the number rewritten."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes, rewritten = [], 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Gemm" or attrs.get("transA", 0) or node.input[1] not in inits:
            nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
        if attrs.get("transB", 0):
            w = w.T
        w = np.ascontiguousarray(w * np.float32(attrs.get("alpha", 1.0)))
        base = node.name or node.output[0]
        w_name = f"{node.input[1]}__matmul_{rewritten}"
        model.graph.initializer.append(numpy_helper.from_array(w, w_name))
        has_c = len(node.input) > 2 and node.input[2]
        mm_out = f"{node.output[0]}__matmul" if has_c else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], w_name], [mm_out], name=f"{base}__matmul"))
        if has_c:
            c = node.input[2]
            beta = float(attrs.get("beta", 1.0))
            if beta != 1.0:
                if c not in inits:
                    raise ValueError(f"Gemm {base}: beta {beta} with a non-constant C")
                c_val = numpy_helper.to_array(inits[c]).astype(np.float32) * np.float32(beta)
                c = f"{c}__beta_{rewritten}"
                model.graph.initializer.append(numpy_helper.from_array(c_val, c))
            nodes.append(helper.make_node("Add", [mm_out, c], [node.output[0]], name=f"{base}__bias"))
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return rewritten


def quantize(name, src_model, fetch, d, check_feeds, f32_sess):
    """onnxruntime's dynamic INT8 copy of the model: (session, info) or
    (None, info) with info["error"] saying why not."""
    info = {"method": "quantize_dynamic", "attempts": []}
    m = onnx.ModelProto()
    m.CopyFrom(src_model)
    try:
        info["gemm_rewritten_to_matmul"] = gemm_to_matmul(m)
        onnx.checker.check_model(m)
    except Exception as e:  # noqa: BLE001
        info["error"] = f"Gemm→MatMul rewrite failed: {type(e).__name__}: {e}"
        return None, info
    ops_in_graph = sorted({n.op_type for n in m.graph.node})
    if not set(ops_in_graph) & QUANTIZABLE:
        info["error"] = (
            f"nothing quantize_dynamic can quantize: the graph's ops are {', '.join(ops_in_graph)} "
            f"(no {'/'.join(sorted(QUANTIZABLE))})"
        )
    pre = os.path.join(d, f"{name}_matmul.onnx")
    onnx.save(m, pre)
    ref = f32_sess.run([fetch], check_feeds)[0]
    for attempt in ATTEMPTS:
        out = os.path.join(d, f"{name}_int8_{'pc' if attempt['per_channel'] else 'pt'}_{attempt['weight_type']}.onnx")
        try:
            logging.disable(logging.WARNING)  # its "consider pre-processing" advice, once per call
            try:
                quantize_dynamic(
                    pre,
                    out,
                    per_channel=attempt["per_channel"],
                    weight_type=getattr(QuantType, attempt["weight_type"]),
                )
            finally:
                logging.disable(logging.NOTSET)
            q = onnx.load(out)
            ops = {}
            for node in q.graph.node:
                if node.op_type in QUANTIZED_OPS:
                    ops[node.op_type] = ops.get(node.op_type, 0) + 1
            if not ops:
                info["attempts"].append({**attempt, "error": "nothing quantized"})
                info["error"] = info.get("error") or "quantize_dynamic quantized nothing"
                return None, info
            sess = session(out)
            got = sess.run([fetch], check_feeds)[0]
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            info["attempts"].append({**attempt, "error": msg})
            continue
        info["attempts"].append({**attempt, "error": None})
        info.update(attempt)
        info["quantized_ops"] = ops
        info["max_abs_diff_vs_f32_on_256_rows"] = float(np.max(np.abs(np.asarray(got, np.float64) - ref)))
        info["error"] = None
        return sess, info
    info["error"] = (info.get("error") + "; " if info.get("error") else "") + "every quantize_dynamic attempt failed: " + "; ".join(
        f"{'per-channel' if a['per_channel'] else 'per-tensor'} {a['weight_type']}: {a['error']}"
        for a in info["attempts"]
    )
    return None, info


# --------------------------------------------------------------------- quiver


def quiver_import(name, spec, d):
    qm = os.path.join(d, f"{name}.qm")
    cmd = [QUIVER, "import", "--onnx", os.path.join(ZOO, spec["file"]), "--out", qm, "--name", name]
    cmd += ["--version", "1", "--inputs", spec["inputs"]]
    if spec.get("output"):
        cmd += ["--output", spec["output"]]
    if spec.get("output_kind") == "raw":
        cmd += ["--output-kind", "raw"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"quiver import failed: {(p.stderr or p.stdout).strip()[:300]}"
    return qm, None


def time_quiver(qm, backend, rows, iters, kernel=None):
    cmd = [QUIVER, "time-model", "--model", qm, "--backend", backend, "--iters", str(iters)]
    cmd += ["--rows", ",".join(map(str, rows))]
    if kernel:
        cmd += ["--kernel", kernel]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"quiver time-model --backend {backend} {'--kernel ' + kernel if kernel else ''}failed: {(p.stderr or p.stdout).strip()[:300]}")
    out = {}
    for line in p.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            j = json.loads(line)
            out[j["rows"]] = j["median_us"]
    return out


# ------------------------------------------------------------------- reporting


def machine():
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        for key in ("Model name", "CPU(s)", "Core(s) per socket", "Socket(s)", "Thread(s) per core",
                    "Hypervisor vendor", "L2 cache", "L3 cache"):
            if key in fields:
                info[key] = fields[key]
        flags = fields.get("Flags", "").split()
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    except (OSError, subprocess.CalledProcessError) as e:
        info["lscpu_error"] = str(e)
    info["os_cpu_count"] = os.cpu_count()
    info["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return info


def versions():
    v = {"numpy": np.__version__, "onnx": onnx.__version__, "onnxruntime": ort.__version__}
    try:
        p = subprocess.run([QUIVER, "--version"], capture_output=True, text=True)
        v["quiver"] = (p.stdout or p.stderr).strip() or None
    except OSError:
        v["quiver"] = None
    return v


def command_line():
    """This run's command, with the taskset pinning it ran under, if any."""
    cmd = " ".join(["python3", "bench/zoo_side_by_side.py", *sys.argv[1:]])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus and len(cpus) < (os.cpu_count() or 0):
        cmd = f"taskset -c {','.join(map(str, cpus))} {cmd}"
    return cmd


def is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def median_or_na(values):
    vals = [x for x in values if is_num(x)]
    return float(np.median(vals)) if vals and len(vals) == len(values) else "n/a"


def fmt(x, suffix=""):
    return f"{x:.2f}{suffix}" if is_num(x) else "n/a"


def markdown(report, on_machine=False):
    """The section; `on_machine` heads it with the CPU model, for a second
    machine kind's results kept beside the first's (--md other than the
    default)."""
    rows, lines = report["settings"]["rows"], []
    m, s = report["machine"], report["settings"]
    on = f" on {m.get('Model name', '?')}" if on_machine else ""
    lines.append(f"## Model zoo side by side with onnxruntime{on}")
    lines.append("")
    lines.append(
        f"Written by `bench/zoo_side_by_side.py` ({report['generated']}, commit `{report.get('commit', '?')}`). "
        f"Machine: {m.get('Model name', '?')}, "
        f"{m.get('CPU(s)', '?')} CPUs ({', '.join(m.get('isa', []))}), affinity {m.get('affinity')}. "
        f"onnxruntime {report['versions']['onnxruntime']}, onnx {report['versions']['onnx']}, "
        f"numpy {report['versions']['numpy']}. Single thread on both sides; each cell is the median of "
        f"{s['repeats']} runs' medians (onnxruntime: {s['iters']} calls, {s['iters_256']} at batch ≥ 256; "
        f"quiver: {s['quiver_iters']} calls), µs per call; each ratio the median of the runs' ratios "
        f"(above 1: quiver faster). onnxruntime is called from Python, so its times include the Python "
        f"call overhead (a few µs; it dominates at batch 1). onnxruntime INT8 is `quantize_dynamic` "
        f"(Gemm rewritten to MatMul first); quiver INT8 is uncalibrated (per-row dynamic activations)."
    )
    lines.append("")
    lines.append("    " + report["command"])
    lines.append("")
    kernels = s.get("int8_kernels", [])
    if kernels:
        lines.append(
            f"quiver int8 (K) is `quiver time-model --backend int8 --kernel K`; plain quiver int8 is the kernel "
            f"`auto` picks on this machine."
        )
        lines.append("")
    heads = ["ort f32", "ort int8", "quiver int8", "quiver f32", "quiver fp8"]
    heads += [f"quiver int8 ({k})" for k in kernels]
    heads += ["ort f32 / q int8", "ort int8 / q int8", "ort f32 / q f32"]
    heads += [f"ort int8 / q int8 ({k})" for k in kernels]
    heads += [f"q int8 ({k}) / q int8 ({kernels[0]})" for k in kernels[1:]]
    lines.append("| model | rows | " + " | ".join(heads) + " |")
    lines.append("|---|" + "---:|" * (len(heads) + 1))
    for name, r in report["models"].items():
        if r.get("error"):
            lines.append(f"| {name} | | n/a: {r['error']} |" + " |" * (len(heads) - 1))
            continue
        for n in rows:
            b = r["batches"][str(n)]
            cells = [fmt(b[f"{k}_us"]) for k in RUNTIMES] + [fmt(b[k], "×") for k in RATIOS]
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    notes = [(n, r["ort_int8"]["error"]) for n, r in report["models"].items()
             if not r.get("error") and r["ort_int8"].get("error")]
    if notes:
        lines.append("")
        for n, e in notes:
            lines.append(f"- {n}: onnxruntime INT8 n/a: {e}")
    lines.append("")
    lines.append(f"Targets at batch {TARGET_BATCH} (issue 3), from the median ratios:")
    lines.append("")
    lines.append("| model | " + " | ".join(t[3] for t in TARGETS) + " |")
    lines.append("|---|" + "---|" * len(TARGETS))
    for name, r in report["models"].items():
        if r.get("error"):
            lines.append(f"| {name} | " + " | ".join("n/a" for _ in TARGETS) + " |")
            continue
        cells = []
        for key, ratio, _, _ in TARGETS:
            t = r["targets"][key]
            if t["met"] is None:
                cells.append("n/a")
            else:
                cells.append(("met" if t["met"] else "**missed**") + f" ({t['ratio']:.2f}×)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    summ = report["summary"]
    for key, _, _, label in TARGETS:
        c = summ[key]
        lines.append(f"- {label}: met on {c['met']} of {c['measured']} models"
                     + (f" (n/a on {c['na']})" if c["na"] else "")
                     + (f"; missed on {', '.join(c['missed'])}" if c["missed"] else ""))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200, help="onnxruntime timed calls per batch below 256")
    ap.add_argument("--iters-256", type=int, default=100, help="onnxruntime timed calls at batch >= 256")
    ap.add_argument("--quiver-iters", type=int, default=None, help="quiver time-model --iters (default --iters)")
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default=None, help="comma-separated subset of the zoo")
    ap.add_argument("--int8-kernels", default="",
                    help="also time quiver int8 with each of these forced kernels (e.g. amx,avx512-vnni), "
                         "side by side in the same run; the second and later are also given over the first")
    ap.add_argument("--json", default=os.path.join(RESULTS, "zoo_side_by_side.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "zoo_side_by_side.md"))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    kernels = [k for k in args.int8_kernels.split(",") if k]
    RUNTIMES.extend(f"quiver_int8_{k}" for k in kernels)
    RATIOS.update({f"ort_int8_over_quiver_int8_{k}": ("ort_int8", f"quiver_int8_{k}") for k in kernels})
    RATIOS.update({f"quiver_int8_{k}_over_quiver_int8_{kernels[0]}": (f"quiver_int8_{k}", f"quiver_int8_{kernels[0]}")
                   for k in kernels[1:]})
    quiver_iters = args.quiver_iters or args.iters
    if not os.path.exists(QUIVER):
        sys.exit(f"{QUIVER} not found: run cargo build --release first")
    with open(os.path.join(ZOO, "zoo.json")) as f:
        zoo = json.load(f)["models"]
    if args.models:
        wanted = args.models.split(",")
        missing = [w for w in wanted if w not in zoo]
        if missing:
            sys.exit(f"not in the zoo: {', '.join(missing)}")
        zoo = {k: v for k, v in zoo.items() if k in wanted}
    started = time.time()
    rng = np.random.default_rng(SEED)
    models, runs = {}, {}
    with tempfile.TemporaryDirectory() as d:
        # Setup: sessions, feeds, quantized copies and .qm files, once.
        setup = {}
        for name, spec in zoo.items():
            entry = {"file": spec["file"], "inputs": spec["inputs"], "output": spec["output"],
                     "output_kind": spec["output_kind"]}
            models[name] = entry
            try:
                src = onnx.load(os.path.join(ZOO, spec["file"]))  # external data resolved beside it
                src, fetch, added = fetch_name(src, spec)
                f32_path = os.path.join(d, f"{name}_f32.onnx")
                onnx.save(src, f32_path)
                entry["ort_fetch"] = fetch + (" (added as a graph output)" if added else "")
                f32 = session(f32_path)
                feeds = {n: make_feeds(f32, name, n, rng) for n in rows}
                check = make_feeds(f32, name, 256, rng)
                int8, qinfo = quantize(name, src, fetch, d, check, f32)
                entry["ort_int8"] = qinfo
                entry["ort_inputs"] = {i.name: i.shape for i in f32.get_inputs()}
            except Exception as e:  # noqa: BLE001
                entry["error"] = f"onnxruntime setup failed: {type(e).__name__}: {e}"
                continue
            qm, err = quiver_import(name, spec, d)
            if err:
                entry["error"] = err
                continue
            setup[name] = (f32, int8, fetch, feeds, qm)
            runs[name] = []
            print(f"# set up {name}: ort int8 "
                  f"{'n/a (' + qinfo['error'] + ')' if qinfo['error'] else qinfo['weight_type'] + (' per-channel' if qinfo['per_channel'] else ' per-tensor')}",
                  file=sys.stderr)
        for rep in range(args.repeats):
            for name, (f32, int8, fetch, feeds, qm) in setup.items():
                t = {k: {} for k in RUNTIMES}
                for n in rows:
                    iters = args.iters_256 if n >= 256 else args.iters
                    t["ort_f32"][n] = time_ort(f32, [fetch], feeds[n], iters)
                    t["ort_int8"][n] = time_ort(int8, [fetch], feeds[n], iters) if int8 else "n/a"
                runs_q = [("int8", None), ("f32", None), ("fp8", None)] + [("int8", k) for k in kernels]
                for backend, kernel in runs_q:
                    key = f"quiver_{backend}" + (f"_{kernel}" if kernel else "")
                    try:
                        q = time_quiver(qm, backend, rows, quiver_iters, kernel)
                        for n in rows:
                            t[key][n] = q.get(n, "n/a")
                    except RuntimeError as e:
                        models[name].setdefault("quiver_errors", {})[key[len("quiver_"):]] = str(e)
                        for n in rows:
                            t[key][n] = "n/a"
                runs[name].append(t)
            print(f"# run {rep + 1}/{args.repeats} done at {time.time() - started:.0f} s", file=sys.stderr)
    for name, rs in runs.items():
        entry = models[name]
        entry["batches"] = {}
        for n in rows:
            per_run = []
            for t in rs:
                cell = {f"{k}_us": t[k][n] for k in RUNTIMES}
                for rk, (num, den) in RATIOS.items():
                    a, b = cell[f"{num}_us"], cell[f"{den}_us"]
                    cell[rk] = a / b if is_num(a) and is_num(b) and b > 0 else "n/a"
                per_run.append(cell)
            b = {f"{k}_us": median_or_na([c[f"{k}_us"] for c in per_run]) for k in RUNTIMES}
            b.update({k: median_or_na([c[k] for c in per_run]) for k in RATIOS})
            b["runs"] = per_run
            entry["batches"][str(n)] = b
        entry["targets"] = {}
        tb = entry["batches"].get(str(TARGET_BATCH))
        for key, ratio, threshold, _ in TARGETS:
            r = tb[ratio] if tb else "n/a"
            entry["targets"][key] = {
                "ratio": r if is_num(r) else None,
                "threshold": threshold,
                "met": bool(r >= threshold) if is_num(r) else None,
            }
    summary = {}
    for key, _, _, _ in TARGETS:
        met = [n for n, e in models.items() if e.get("targets", {}).get(key, {}).get("met") is True]
        missed = [n for n, e in models.items() if e.get("targets", {}).get(key, {}).get("met") is False]
        summary[key] = {"met": len(met), "missed": missed, "measured": len(met) + len(missed),
                        "na": len(models) - len(met) - len(missed)}
    report = {
        "what": "µs per call (median of per-run medians), single thread; ratios = ort time / quiver time "
                "(median of per-run ratios; above 1: quiver faster); onnxruntime times include Python call overhead",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "command": command_line(),
        "wall_s": round(time.time() - started, 1),
        "machine": machine(),
        "versions": versions(),
        "settings": {"rows": rows, "repeats": args.repeats, "iters": args.iters, "iters_256": args.iters_256,
                     "quiver_iters": quiver_iters, "int8_kernels": kernels, "warmup_calls_ort": WARMUP, "seed": SEED,
                     "threads": 1, "ort_provider": "CPUExecutionProvider",
                     "ort_graph_optimization": "ORT_ENABLE_ALL"},
        "targets_at_batch": TARGET_BATCH,
        "summary": summary,
        "models": models,
    }
    md = markdown(report, os.path.basename(args.md) != "zoo_side_by_side.md")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(args.md, "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
