#!/usr/bin/env python3
"""Per-request nodes computed once: `quiver time-model` on the auction-32
demo model (and, when given, other .qm files) with rows that are one
request's candidates (`--one-request`: the first row's user and context
columns in every row, scored through `Backend::logits_request`, as the
server scores inline) against independent rows (`Backend::logits`), per
backend, side by side in one run, three runs, medians and ratios.

Why: the f32 backend splits a plain MLP's first layer by input kind and
computes its user and context part once per request; graph models compute
every node that reads only per-request inputs (a user tower) once. This
measures what that saves.

Run from the repository root after `cargo build --release`:
  taskset -c 1 python3 bench/one_request.py [--rows 32] [--iters 5000] [MODEL.qm ...]
Writes bench/results/one_request.md (rendered into docs/BENCHMARKS.md by
bench/report.py) and prints it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from provenance import git_commit

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
QUIVER = os.path.join(ROOT, "target", "release", "quiver")


def time_model(model, backend, rows, iters, one_request):
    cmd = [QUIVER, "time-model", "--model", model, "--backend", backend, "--rows", str(rows), "--iters", str(iters)]
    if one_request:
        cmd.append("--one-request")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["median_us"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("models", nargs="*")
    args = ap.parse_args()
    if not os.path.exists(QUIVER):
        sys.exit(f"{QUIVER} is missing: run cargo build --release first")
    demo = tempfile.mkdtemp(prefix="quiver-one-request-")
    subprocess.run([QUIVER, "demo", "--data-dir", demo], check=True, capture_output=True)
    models = [("auction-32 (demo)", os.path.join(demo, "model.qm"))] + [(os.path.basename(m), m) for m in args.models]
    lines = [
        "## One request's candidates: per-request parts computed once",
        "",
        f"Written by `bench/one_request.py` (commit `{git_commit()}`): `quiver time-model --rows {args.rows}` per "
        f"backend, independent rows (`logits`) against one request's candidates (`--one-request`, "
        f"`logits_request`), alternated in each of {args.repeats} runs; medians of the runs' medians "
        f"({args.iters} calls each), µs per call.",
        "",
        "    taskset -c 1 python3 bench/one_request.py " + " ".join(sys.argv[1:]),
        "",
        "| model | backend | independent rows | one request | saved |",
        "|---|---|---:|---:|---:|",
    ]
    for label, path in models:
        for backend in ["f32", "int8", "fp8"]:
            each, once = [], []
            for _ in range(args.repeats):
                each.append(time_model(path, backend, args.rows, args.iters, False))
                once.append(time_model(path, backend, args.rows, args.iters, True))
            e, o = statistics.median(each), statistics.median(once)
            saved = round(100 * (1 - o / e))
            lines.append(f"| {label} | {backend} | {e:.2f} | {o:.2f} | {saved:d} % |")
    lines.append("")
    lines.append(
        "Only what reads per-request inputs alone is computed once: a plain MLP's first-layer user and "
        "context part on the f32 backend (its INT8 and FP8 paths quantize whole rows, so they score every "
        "row), and on every backend a graph model's nodes of the user and context alone (two-tower's user "
        "tower). A graph whose first layer reads the concatenation of all inputs (Wide&Deep) has nothing to "
        "share: its rows are a control, and their differences (of either sign, up to about 30 % between "
        "processes here) are this machine's run-to-run noise."
    )
    lines.append("")
    text = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "one_request.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
