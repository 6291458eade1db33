#!/usr/bin/env python3
"""Per-request nodes computed once: `quiver time-model` on the auction-32
demo model (and, when given, other .qm files) with rows that are one
request's candidates (`--one-request`: the first row's user and context
columns in every row, so `Backend::score` computes what reads only them
once, as the server scores a request) against independent rows, per
backend, side by side in one run, three runs, medians and ratios.

Why: the f32 backend splits a plain MLP's first layer by input kind and
computes its user and context part once per request; graph models compute
every node that reads only per-request inputs (a user tower) once. This
measures what that saves.

The models are the demo's auction-32 (`quiver demo`) and the zoo fixtures
named by `--zoo` (tests/fixtures/zoo/, imported here with `quiver import`
as tests/zoo.rs imports them), so every figure comes from models a command
in the repository makes. A tree with uncommitted changes is refused: the
figures name the commit they measured.

Run from the repository root after `cargo build --release`:
  taskset -c 1 python3 bench/one_request.py [--rows 32] [--iters 5000] [--zoo two_tower,wide_deep]
Writes bench/results/one_request.json and one_request.md (rendered into
docs/BENCHMARKS.md by bench/report.py) and prints the latter.
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
ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")


def zoo_import(name, d):
    """`quiver import` of the zoo fixture `name`, with the arguments tests/zoo.rs uses."""
    with open(os.path.join(ZOO, "zoo.json")) as f:
        spec = json.load(f)["models"].get(name)
    if spec is None:
        sys.exit(f"one_request: {name} is not a model of {ZOO}/zoo.json")
    qm = os.path.join(d, f"{name}.qm")
    cmd = [QUIVER, "import", "--onnx", os.path.join(ZOO, spec["file"]), "--out", qm, "--name", name]
    cmd += ["--version", "1", "--inputs", spec["inputs"]]
    if spec.get("output"):
        cmd += ["--output", spec["output"]]
    if spec.get("output_kind") == "raw":
        cmd += ["--output-kind", "raw"]
    subprocess.run(cmd, check=True, capture_output=True)
    return qm


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
    ap.add_argument("--zoo", default="two_tower,wide_deep", help="zoo fixtures to time beside the demo model")
    args = ap.parse_args()
    if not os.path.exists(QUIVER):
        sys.exit(f"{QUIVER} is missing: run cargo build --release first")
    commit = git_commit()
    if commit.endswith("+dirty") or commit == "unknown":
        sys.exit(f"one_request: the tree is {commit}: commit first, so the figures name what they measured")
    work = tempfile.mkdtemp(prefix="quiver-one-request-")
    subprocess.run([QUIVER, "demo", "--data-dir", work], check=True, capture_output=True)
    models = [("auction-32 (demo)", os.path.join(work, "model.qm"))]
    models += [(name, zoo_import(name, work)) for name in args.zoo.split(",") if name]
    results = {"commit": commit, "rows": args.rows, "iters": args.iters, "repeats": args.repeats, "models": []}
    lines = [
        "## One request's candidates: per-request parts computed once",
        "",
        f"Written by `bench/one_request.py` (commit `{commit}`): `quiver time-model --rows {args.rows}` per "
        f"backend, independent rows against one request's candidates (`--one-request`), alternated in each of {args.repeats} runs; medians of the runs' medians "
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
            results["models"].append({"model": label, "backend": backend, "independent_us": each, "one_request_us": once})
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
    with open(os.path.join(ROOT, "bench", "results", "one_request.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", "one_request.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
