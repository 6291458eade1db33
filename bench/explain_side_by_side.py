#!/usr/bin/env python3
"""Side-by-side single-thread timing of exact path-dependent TreeSHAP:
LightGBM `predict(pred_contrib=True)`, XGBoost `predict(pred_contribs=True)`,
`shap.TreeExplainer` (when installed) and `quiver time-model --explain` on
the same two LightGBM binary classifiers and the same held-out rows, 1 and
32 candidates per call, in one run; writes
bench/results/explain_side_by_side.{json,md} (bench/report.py puts the
Markdown into docs/BENCHMARKS.md).

Why: issue 37 asks for reason codes inside a request's deadline, at most
100 µs per candidate for 100 trees of depth 6 and 1 ms for 500 of depth 8,
and faster than what a team would otherwise call: the frameworks' own
contribution calls and shap. The models are the tree side-by-side's
(bench/trees_side_by_side.py: its seeded data, 28 float32 columns with NaN,
LightGBM binary with num_leaves 2^depth, max_depth = depth), trained here
with its functions.

How each contender runs (OMP_NUM_THREADS=1 before any import, and each
library told to use one thread):
  lightgbm  Booster.predict(x, pred_contrib=True, num_threads=1).
  xgboost   the same trees written as an XGBoost JSON model by
            trees_side_by_side.lgb_to_xgb_json, with each node's
            sum_hessian set to LightGBM's row count (what LightGBM's own
            TreeSHAP weighs by), so both compute the same contributions;
            Booster.predict(DMatrix(x), pred_contribs=True), the DMatrix
            built inside the call.
  shap      shap.TreeExplainer over the same trees given as shap's own tree
            arrays (its "dict" model: children, split features, thresholds,
            default directions, values and LightGBM's counts as
            node_sample_weight), feature_perturbation="tree_path_dependent",
            so shap's own TreeSHAP runs (handed the LightGBM Booster itself,
            shap calls LightGBM's pred_contrib); .shap_values(x).
  quiver    `quiver import --lightgbm`, then `quiver time-model --explain
            --rows 1,32 --data ROWS.npy`: `Explainer::explain` once per
            candidate inside the binary, no Python (`us_per_candidate`).
Python contenders are timed per call with time.perf_counter_ns (so Python
call overhead is included; it is small beside these calls). Each call
explains the next 1 or 32 held-out rows (rotating offsets, the same for
every contender); each cell is the median of the rounds' medians.

Parity: before timing, the contributions of each Python contender on 256
held-out rows are compared with LightGBM's (max abs difference, bias
column included). Quiver's parity with LightGBM and XGBoost is checked by
tests/explain.rs (within 1e-5), not here.

Run from the repository root after `cargo build --release`, pinned to one
core:
  pip install numpy lightgbm==4.7.0 xgboost-cpu==3.2.0 shap
  taskset -c 1 python3 bench/explain_side_by_side.py [--quick]
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from provenance import git_commit, write_results  # noqa: E402
from trees_side_by_side import (  # noqa: E402
    F, SEED, SHAPES, command_line, error_text, lgb_params, lgb_to_xgb_json, machine, make_data, pkg_version,
    tree_structure,
)

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
QUIVER = os.path.join(ROOT, "target", "release", "quiver")
RESULTS = os.path.join(ROOT, "bench", "results")
BATCHES = (1, 32)
PARITY_ROWS = 256
FULL = {"rounds": 3, "min_calls": 5, "min_s": 0.3, "max_s": 2.0, "quiver_iters": 200}
QUICK = {"rounds": 1, "min_calls": 2, "min_s": 0.02, "max_s": 0.3, "quiver_iters": 20}
PYTHON = ["lightgbm", "xgboost", "shap"]
ORDER = PYTHON + ["quiver"]
LABELS = {
    "lightgbm": "lightgbm predict(pred_contrib=True)",
    "xgboost": "xgboost predict(pred_contribs=True)",
    "shap": "shap.TreeExplainer (its own TreeSHAP)",
    "quiver": "quiver Explainer::explain",
}


def log(msg):
    print(f"# {msg}", file=sys.stderr, flush=True)


def bfs_nodes(info):
    """The tree's nodes breadth first, each right child after its left
    sibling: lgb_to_xgb_json's node order."""
    out, queue = [], [info["tree_structure"]]
    while queue:
        node = queue.pop(0)
        out.append(node)
        if "leaf_value" not in node:
            queue += [node["left_child"], node["right_child"]]
    return out


def setup_lightgbm(ctx):
    b = ctx["booster"]
    return lambda x: b.predict(x, pred_contrib=True, num_threads=1), {}


def setup_xgboost(ctx):
    import xgboost as xgb

    x, d = ctx["x"], ctx["dir"]
    tmpl = xgb.train({"objective": "binary:logistic", "base_score": 0.5, "max_depth": 1, "nthread": 1, "seed": SEED},
                     xgb.DMatrix(x[:256], label=(x[:256, 0] > 0).astype(np.float32)), num_boost_round=1)
    tpath = os.path.join(d, "xgb_template.json")
    tmpl.save_model(tpath)
    with open(tpath) as f:
        model = lgb_to_xgb_json(ctx["dump"], json.load(f))
    for tree, info in zip(model["learner"]["gradient_booster"]["model"]["trees"], ctx["dump"]["tree_info"]):
        tree["sum_hessian"] = [float(n.get("internal_count", n.get("leaf_count"))) for n in bfs_nodes(info)]
    path = os.path.join(d, f"{ctx['shape']}_xgb.json")
    with open(path, "w") as f:
        json.dump(model, f)
    bst = xgb.Booster(model_file=path)
    bst.set_param({"nthread": 1})
    return lambda x: bst.predict(xgb.DMatrix(x, nthread=1), pred_contribs=True), {
        "model": "the LightGBM trees as XGBoost JSON, sum_hessian = LightGBM's counts"}


def setup_shap(ctx):
    import shap

    trees = []
    for info in ctx["dump"]["tree_info"]:
        nodes = bfs_nodes(info)
        index = {id(n): i for i, n in enumerate(nodes)}
        n = len(nodes)
        left, right, default = (np.full(n, -1, np.int64) for _ in range(3))
        features, thresholds = np.full(n, -2, np.int64), np.zeros(n)
        values, weights = np.zeros((n, 1)), np.zeros(n)
        for i, node in enumerate(nodes):
            if "leaf_value" in node:
                values[i, 0] = float(np.float32(node["leaf_value"]))
                weights[i] = node["leaf_count"]
                continue
            if node["decision_type"] != "<=":
                raise ValueError("categorical split: not converted")
            left[i], right[i] = index[id(node["left_child"])], index[id(node["right_child"])]
            t = float(node["threshold"])
            to_left = bool(node["default_left"]) if node["missing_type"] == "NaN" else 0.0 <= t
            default[i] = left[i] if to_left else right[i]
            features[i], thresholds[i], weights[i] = node["split_feature"], t, node["internal_count"]
        trees.append({"children_left": left, "children_right": right, "children_default": default,
                      "features": features, "thresholds": thresholds, "values": values,
                      "node_sample_weight": weights})
    explainer = shap.TreeExplainer({"trees": trees, "base_offset": 0.0},
                                   feature_perturbation="tree_path_dependent")

    def call(x):
        phi = explainer.shap_values(x)
        return np.concatenate([phi, np.full((len(x), 1), explainer.expected_value)], axis=1)

    return call, {"model": "shap's dict model of the same trees, LightGBM's counts as node_sample_weight"}


SETUPS = {"lightgbm": setup_lightgbm, "xgboost": setup_xgboost, "shap": setup_shap}


def time_calls(fn, windows, budget):
    """Median µs per call of fn(windows[i % len(windows)]) and the calls made."""
    for w in windows[:2]:
        fn(w)
    clock = time.perf_counter_ns
    ns, i, start = [], 0, clock()
    while True:
        w = windows[i % len(windows)]
        t0 = clock()
        fn(w)
        t1 = clock()
        ns.append(t1 - t0)
        i += 1
        if i >= budget["min_calls"] and t1 - start >= budget["min_s"] * 1e9:
            break
        if t1 - start >= budget["max_s"] * 1e9 and i >= 2:
            break
    return statistics.median(ns) / 1e3, i


def quiver_explain(qm, rows_npy, iters):
    p = subprocess.run([QUIVER, "time-model", "--model", qm, "--backend", "f32", "--rows",
                        ",".join(map(str, BATCHES)), "--iters", str(iters), "--data", rows_npy, "--explain"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"time-model --explain failed: {(p.stderr or p.stdout).strip()[-400:]}")
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{") and '"explain"' in line:
            j = json.loads(line)
            out[j["candidates"]] = j
    return out


def run_shape(trees, depth, x_tr, y_tr, x_held, budget, tmp):
    import lightgbm as lgb

    shape = f"{trees}x{depth}"
    log(f"{shape}: training")
    booster = lgb.train(lgb_params(depth), lgb.Dataset(x_tr, y_tr), num_boost_round=trees)
    d = os.path.join(tmp, shape)
    os.makedirs(d, exist_ok=True)
    model_txt = os.path.join(d, "model.txt")
    booster.save_model(model_txt)
    dump = booster.dump_model()
    ctx = {"booster": booster, "dump": dump, "x": x_held, "dir": d, "shape": shape}
    windows = {b: [np.ascontiguousarray(x_held[(i * 97) % (len(x_held) - b):][:b]) for i in range(64)]
               for b in BATCHES}
    want = booster.predict(x_held[:PARITY_ROWS], pred_contrib=True, num_threads=1)
    contenders = {}
    for name in PYTHON:
        try:
            call, info = SETUPS[name](ctx)
            got = np.asarray(call(x_held[:PARITY_ROWS]), np.float64)
            diff = float(np.max(np.abs(got - want)))
            contenders[name] = {"available": True, "info": info, "parity_max_abs_diff": diff, "call": call}
            log(f"{shape} {name}: parity {diff:.1e}")
        except Exception as e:  # noqa: BLE001
            contenders[name] = {"available": False, "error": error_text(e)}
            log(f"{shape} {name}: unavailable: {error_text(e)}")
    rows_npy = os.path.join(d, "rows.npy")
    np.save(rows_npy, x_held)
    qm = os.path.join(d, "model.qm")
    try:
        p = subprocess.run([QUIVER, "import", "--lightgbm", model_txt, "--out", qm, "--name", "trees", "--version",
                            "1", "--inputs", f"context:{F}"], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError((p.stderr or p.stdout).strip()[-400:])
        contenders["quiver"] = {"available": True, "info": {}}
    except Exception as e:  # noqa: BLE001
        contenders["quiver"] = {"available": False, "error": error_text(e)}
    rounds = {name: {b: [] for b in BATCHES} for name in ORDER}
    for r in range(budget["rounds"]):
        for name in ORDER:
            c = contenders[name]
            if not c["available"]:
                continue
            if name == "quiver":
                q = quiver_explain(qm, rows_npy, budget["quiver_iters"])
                for b in BATCHES:
                    rounds[name][b].append(q[b]["us_per_candidate"])
                c["info"]["method"] = q[BATCHES[0]]["explain"]
                continue
            for b in BATCHES:
                us, calls = time_calls(c["call"], windows[b], budget)
                rounds[name][b].append(us / b)
        log(f"{shape} round {r + 1}: " + ", ".join(
            f"{n} {rounds[n][1][-1]:.1f}" for n in ORDER if rounds[n][1]))
    for name in ORDER:
        c = contenders[name]
        c.pop("call", None)
        if c["available"]:
            c["us_per_candidate"] = {str(b): statistics.median(rounds[name][b]) for b in BATCHES}
            c["rounds"] = {str(b): rounds[name][b] for b in BATCHES}
    return {"trees": trees, "depth": depth, "structure": tree_structure(dump), "contenders": contenders}


def fmt_us(x):
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def markdown(report):
    m, v = report["machine"], report["versions"]
    lines = ["## Reason codes side by side: exact TreeSHAP per candidate", ""]
    lines.append(
        f"Written by `bench/explain_side_by_side.py` ({report['generated']}, commit `{report['commit']}`, "
        f"{report['wall_s']:.0f} s). Machine: {m.get('Model name', '?')}, {m.get('CPU(s)', '?')} CPUs, affinity "
        f"{m.get('affinity')}, load average at start {m['loadavg_at_start'][0]:.2f}. lightgbm {v['lightgbm']}, "
        f"xgboost {v['xgboost'] or v['xgboost-cpu']}, shap {v['shap']}, numpy {v['numpy']}.")
    lines.append("")
    lines.append(
        "Single thread; µs per explained candidate (a call's time over its candidates), the median of "
        f"{report['settings']['rounds']} rounds' medians, each call explaining the next 1 or 32 held-out rows of "
        "the tree side-by-side's data. The models are its LightGBM binary classifiers; xgboost and shap run the "
        "same trees with LightGBM's counts as covers, so all compute the same contributions (parity: the max abs "
        "difference from LightGBM's on 256 rows, bias included). Python contenders include the call overhead "
        "(and xgboost the DMatrix); quiver's figure is `time-model --explain` inside its binary "
        "(`Explainer::explain` per candidate; its parity is tests/explain.rs's, within 1e-5).")
    lines.append("")
    lines.append("    " + report["command"])
    lines.append("")
    for key, s in report["shapes"].items():
        st = s["structure"]
        lines.append(f"### {st['trees']} trees, depth {s['depth']} ({key}): {st['leaves_total']:,} leaves")
        lines.append("")
        lines.append("| contender | parity max abs diff | 1 candidate µs | 32 candidates µs / candidate |")
        lines.append("|---|---:|---:|---:|")
        for name in ORDER:
            c = s["contenders"][name]
            if not c["available"]:
                lines.append(f"| {LABELS[name]} | | n/a: {c['error']} | |")
                continue
            parity = "reference" if name == "lightgbm" else (
                "tests/explain.rs" if name == "quiver" else f"{c['parity_max_abs_diff']:.1e}")
            t = c["us_per_candidate"]
            lines.append(f"| {LABELS[name]} | {parity} | {fmt_us(t['1'])} | {fmt_us(t['32'])} |")
        q = s["contenders"]["quiver"]
        if q["available"]:
            lines.append("")
            for name in PYTHON:
                c = s["contenders"][name]
                if c["available"]:
                    r = [c["us_per_candidate"][str(b)] / q["us_per_candidate"][str(b)] for b in BATCHES]
                    lines.append(f"- {name} / quiver: {r[0]:.1f}× at 1 candidate, {r[1]:.1f}× at 32")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, few calls (a smoke run)")
    ap.add_argument("--results", default=RESULTS, help="where explain_side_by_side.{json,md} go")
    args = ap.parse_args()
    budget = QUICK if args.quick else FULL
    start, load = time.time(), os.getloadavg()
    rng = np.random.default_rng(SEED)
    x_tr, y_tr, x_held, _ = make_data(rng)
    shapes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trees, depth in SHAPES:
            shapes[f"{trees}x{depth}"] = run_shape(trees, depth, x_tr, y_tr, x_held, budget, tmp)
    report = {
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "command": command_line().replace("trees_side_by_side.py", "explain_side_by_side.py"),
        "wall_s": time.time() - start,
        "settings": budget,
        "machine": machine(load),
        "versions": {n: pkg_version(n) for n in ("numpy", "lightgbm", "xgboost", "xgboost-cpu", "shap")},
        "shapes": shapes,
    }
    write_results(args.results, "explain_side_by_side", report, markdown(report))


if __name__ == "__main__":
    main()
