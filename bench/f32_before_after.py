#!/usr/bin/env python3
"""The f32 backend before and after a change, in one run: `quiver
time-model --backend f32` of two binaries, alternated call for call
(repeats interleaved), on the demo MLP's shape (80 -> 256 -> ReLU -> 128 ->
ReLU -> 1, bench/ort_side_by_side.py's model, imported with its inputs
user:32,item:32,context:16), and, from the "after" binary in the same run,
the INT8 backend's AMX and AVX-512 VNNI kernels on the same model (dynamic
activations: the model is not calibrated), so the f32 kernel's rate can be
set beside the AMX path's.

Why: issue 34's f32 micro-kernel; a figure from one binary at one time and
another's at another time on this shared machine would differ by more than
the change. Ratios are before / after (above 1: after faster).

Run from the repository root on a committed tree, pinned to one core:
  taskset -c 1 python3 bench/f32_before_after.py --before OLD_BIN --before-commit HASH
      [--after NEW_BIN] [--repeats 3] [--iters 300] [--rows 1,32,256,1024]
--after defaults to QUIVER_BIN or target/release/quiver, built from this
tree. Writes bench/results/f32_before_after.json and f32_before_after.md
(rendered into docs/BENCHMARKS.md by bench/report.py) and prints the latter.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

import ort_side_by_side as demo
from provenance import git_commit, write_results

RESULTS = os.path.join(demo.ROOT, "bench", "results")


def cpu_model():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), None)


def time_model(binary, qm, args, rows, iters):
    cmd = [binary, "time-model", "--model", qm, *args, "--rows", ",".join(map(str, rows)), "--iters", str(iters)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {j["rows"]: (j["median_us"], j["gmac_per_s"]) for j in map(json.loads, out.splitlines())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the quiver binary before the change")
    ap.add_argument("--before-commit", required=True, help="the commit it was built from")
    ap.add_argument("--after", default=demo.QUIVER)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rows", default="1,32,256,1024")
    args = ap.parse_args()
    commit = git_commit()
    if commit.endswith("+dirty"):
        sys.exit(f"f32_before_after: the tree is {commit}: commit first, so the figures name what they measured")
    rows = [int(r) for r in args.rows.split(",")]
    runs = {"before": [], "after": [], "int8-amx": [], "int8-avx512-vnni": []}
    with tempfile.TemporaryDirectory() as d:
        onnx_path = os.path.join(d, "mlp.onnx")
        demo.build_model(onnx_path, np.random.default_rng(0))
        qms = {}
        for side, binary in (("before", args.before), ("after", args.after)):
            qms[side] = os.path.join(d, f"{side}.qm")
            subprocess.run([binary, "import", "--onnx", onnx_path, "--out", qms[side], "--name", "mlp", "--version",
                            "1", "--inputs", "user:32,item:32,context:16"], check=True, capture_output=True)
        for _ in range(args.repeats):
            runs["before"].append(time_model(args.before, qms["before"], ["--backend", "f32"], rows, args.iters))
            runs["after"].append(time_model(args.after, qms["after"], ["--backend", "f32"], rows, args.iters))
            for kernel in ("amx", "avx512-vnni"):
                try:
                    t = time_model(args.after, qms["after"], ["--backend", "int8", "--kernel", kernel], rows, args.iters)
                except subprocess.CalledProcessError:
                    t = {}
                runs[f"int8-{kernel}"].append(t)

    def med(name, n, i):
        vals = [r[n][i] for r in runs[name] if n in r]
        return statistics.median(vals) if vals else None

    table = {str(n): {name: {"us": med(name, n, 0), "gmac_per_s": med(name, n, 1)} for name in runs} for n in rows}
    report = {"what": "quiver time-model medians (µs per call, GMAC/s), median of the repeats; before and after "
                      "alternated in one run", "commit": commit, "before_commit": args.before_commit,
              "before": args.before, "after": args.after, "repeats": args.repeats, "iters": args.iters,
              "cpu": cpu_model(),
              "rows": table, "runs": runs}
    lines = ["## The f32 backend before and after the FMA micro-kernel\n",
             f"Written by `bench/f32_before_after.py` (commit `{commit}`, before: `{args.before_commit}`; "
             f"{report['cpu']}): "
             f"`quiver time-model --backend f32` of both binaries alternated in one run ({args.repeats} repeats of "
             f"{args.iters} calls, medians) on the demo MLP's shape (80 → 256 → 128 → 1, imported with "
             f"user:32,item:32,context:16), single thread; beside it the INT8 backend's AMX and AVX-512 VNNI "
             f"kernels of the after binary on the same model (dynamic activations). µs per call, and GMAC/s.\n",
             "| rows | f32 before | f32 after | before / after | f32 after GMAC/s | int8 amx | int8 avx512-vnni "
             "| int8 amx GMAC/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(v, p=2):
        return f"{v:.{p}f}" if v is not None else "n/a"

    for n in rows:
        t = table[str(n)]
        b, a = t["before"]["us"], t["after"]["us"]
        lines.append(f"| {n} | {fmt(b)} | {fmt(a)} | {fmt(b / a if a else None)}× | {fmt(t['after']['gmac_per_s'], 1)} "
                     f"| {fmt(t['int8-amx']['us'])} | {fmt(t['int8-avx512-vnni']['us'])} "
                     f"| {fmt(t['int8-amx']['gmac_per_s'], 1)} |")
    md = "\n".join(lines) + "\n"
    write_results(RESULTS, "f32_before_after", report, md)


if __name__ == "__main__":
    main()
