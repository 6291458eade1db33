#!/usr/bin/env python3
"""Side-by-side single-thread CPU timing of gradient-boosted tree ensembles:
LightGBM, XGBoost, onnxruntime, treelite + tl2cgen, lleaves and
`quiver time-model` (f32 and int8 backends) on the same two LightGBM binary
classifiers and the same held-out rows, at batch 1, 32 and 256, in one run,
printing Markdown tables and ratios and writing everything to
bench/results/trees_side_by_side.json.

Why: fraud and risk teams ship tree ensembles, and the runtime they would
otherwise pick for them is LightGBM or XGBoost themselves, onnxruntime on
the converted graph, or a tree compiler (treelite/tl2cgen, lleaves). Quiver's
tree scorer (model::trees, score::cpu::trees) has to be measured against
those, on models of the sizes people train: (a) 100 trees of depth 6 and (b)
500 trees of depth 8. The script reports; it tunes nothing on any side.

Data and models: a seeded synthetic table, 20,000 training rows and 4,096
held-out rows drawn independently, F = 28 float32 columns of mixed kinds
(normal, log-normal, uniform, Poisson counts, heavy-tailed t, small integer
ids stored as numbers; no categorical features, so every contender loads the
models), with about 10% NaN in columns 4, 13 and 22 (the missingness of
column 4 itself raises the label's odds). The label is drawn from a known
logistic function with interactions and thresholds, so deep trees pay.
LightGBM (objective binary, num_leaves = 2^depth, max_depth = depth,
min_data_in_leaf 2, one thread, deterministic, fixed seeds) trains both
models in the script; it prints each model's real tree depths and leaf
counts from dump_model.

How each contender runs (every one single-threaded; OMP_NUM_THREADS=1 is set
before any import):
  lightgbm     Booster(model_file).predict(x, raw_score=True, num_threads=1):
               the margin.
  xgboost      the same LightGBM trees written by this script as an XGBoost
               JSON model (each threshold t becomes the float32 split
               condition c with x <= t <=> x < c for every float32 x; the
               1e300 LightGBM writes for "every number left" becomes FLT_MAX,
               exact but for x = FLT_MAX; NaN goes where LightGBM sends it),
               Booster.inplace_predict(x, predict_type="margin"), nthread 1:
               the margin. (XGBoost 3.x names the margin
               predict_type="margin"; inplace_predict has no output_margin.)
  onnxruntime  onnxmltools convert_lightgbm (zipmap=False; one
               TreeEnsembleClassifier with post_transform LOGISTIC),
               CPUExecutionProvider, intra/inter op threads 1, sequential,
               ORT_ENABLE_ALL; fetches `probabilities` only: the probability
               (one sigmoid per row more than a margin).
  tl2cgen      treelite.frontend.load_lightgbm_model, tl2cgen.export_lib
               (gcc -O3, parallel_comp 4; the 500 x 8 model takes about 2
               minutes to compile, so the library is cached like lleaves'
               binary below), tl2cgen.Predictor(nthread=1),
               predict(DMatrix(x), pred_margin=True): the margin. Timed with
               the DMatrix construction inside the call (a caller holding
               numpy rows pays it) and, as a second row, with the DMatrix
               built outside the timer ("predict only"). A third row is a
               second library compiled with quantize=1 (thresholds replaced
               by bin indices, tl2cgen's documented speed option; default
               0), DMatrix construction included.
  lleaves      lleaves.Model(model_file).compile(raw_score=True, lleaves'
               defaults otherwise: finline=True, fblocksize=34, use_fp64)
               and predict(x, n_jobs=1): the margin; predict copies the
               float32 rows to float64 inside the call. Compiling the 500 x 8
               model with inlining takes 5 to 8 minutes on one core, so the
               binary is cached (--cache, ~/.cache/quiver-bench/trees by
               default; keyed by the model text, the lleaves and llvmlite
               versions, the flags and the host CPU; training is
               deterministic, so the next run finds it), and --quick compiles
               with finline=False instead (labelled so). lleaves 1.3.0 needs
               an llvmlite with the legacy pass manager (0.44.0 has it, 0.50.0
               does not); with another it is reported unavailable.
  quiver       `quiver import --lightgbm`, then `quiver time-model --backend
               f32|int8 --rows 1,32,256 --data ROWS.npy`: the median of N
               calls of Backend::score inside the binary, no Python (its
               figures have no call overhead to subtract): the margin. The
               int8 backend runs tree ensembles with the same code as f32.
Python contenders are timed per call with time.perf_counter_ns around the
call (so Python call overhead, a few µs, is included); the "python floor"
row times an empty call (lambda x: None) with the same loop, for readers to
subtract at batch 1.

Rows and rounds: batch b scores b consecutive held-out rows. "Rotating rows"
(the primary figures): call i starts at the i-th of 1,024 seeded offsets,
the same sequence for every contender, so caches and branch predictors see
varied rows; `quiver time-model --data` rotates too (call k scores the
window of rows at k * b, wrapping, over the same 4,096 held-out rows). Each
round also times every contender on "fixed rows", a block of 256 rows at a
per-round seeded offset scored on every call (quiver: a --data file holding
just that block, which then always scores its first b rows), where caches
and branch predictors learn the rows. Ratios are given for both; the
rotating ones are the primary figures. Each measurement does 10
warm-up calls, then times calls until it has >= 200 calls and >= 0.25 s, or
1 s has passed (with >= 20 calls); its median is the round's figure. Rounds
(5) run every contender once, in a fixed order, and each table cell is the
median of the per-round medians, so machine noise hits all alike.

Parity: before timing, each contender's output on all 4,096 held-out rows
is compared with LightGBM's (margins with margins, onnxruntime's
probability with the sigmoid of LightGBM's margin); the max abs difference
is printed. Quiver's scores are not checked here (no CLI prints them for
arbitrary rows): tests/trees.rs checks its parity with the frameworks.

Run from the repository root after `cargo build --release`, pinned to one
core, with nothing else running (a full run takes under 5 minutes once the
cache holds the compiled models; the first one spends up to 12 minutes more
compiling tl2cgen's and lleaves' 500 x 8 models):
  pip install numpy lightgbm xgboost-cpu onnxruntime onnxmltools onnx \
      treelite tl2cgen lleaves 'llvmlite<0.45'
  taskset -c 1 python3 bench/trees_side_by_side.py [--quick] [--out PATH]
      [--cache DIR | --no-cache]
(writes PATH, default bench/results/trees_side_by_side.json, and the same
tables as Markdown beside it, which bench/report.py puts into
docs/BENCHMARKS.md). lleaves 1.3.0 needs llvmlite < 0.45; to keep a newer
one installed, put 0.44.0 in a folder of its own and prepend it:
  pip install --no-deps --target /tmp/llvmlite044 llvmlite==0.44.0
  PYTHONPATH=/tmp/llvmlite044 taskset -c 1 python3 bench/trees_side_by_side.py
A contender that cannot be imported, set up or run is reported as
unavailable with the error; the others are still timed.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tl2cgen, xgboost and lightgbm use OpenMP

import argparse  # noqa: E402
import hashlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

from provenance import git_commit  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
QUIVER = os.path.join(ROOT, "target", "release", "quiver")
RESULTS = os.path.join(ROOT, "bench", "results")
SEED = 20_261_201
N_TRAIN = 20_000
N_HELD = 4_096
F = 28
NAN_COLS = (4, 13, 22)
NAN_RATE = 0.10
SHAPES = [(100, 6), (500, 8)]  # (trees, depth)
BATCHES = (1, 32, 256)
RATIO_BATCH = 32
N_OFFSETS = 1_024
WARMUP = 10
MIN_CALLS_HARD = 20
FULL = {"rounds": 5, "min_calls": 200, "min_s": 0.25, "max_s": 1.0, "quiver_iters": 400}
QUICK = {"rounds": 1, "min_calls": 30, "min_s": 0.02, "max_s": 0.1, "quiver_iters": 50}
PYTHON = ["lightgbm", "xgboost", "onnxruntime", "tl2cgen", "tl2cgen_predict_only", "tl2cgen_quantize", "lleaves"]
QUIVER_BACKENDS = ["quiver_f32", "quiver_int8"]
ORDER = ["python_floor"] + PYTHON + QUIVER_BACKENDS
MODES = ["rotating", "fixed"]
LABELS = {
    "python_floor": "python floor (empty call)",
    "lightgbm": "lightgbm Booster.predict",
    "xgboost": "xgboost inplace_predict",
    "onnxruntime": "onnxruntime (onnxmltools graph)",
    "tl2cgen": "tl2cgen (DMatrix + predict)",
    "tl2cgen_predict_only": "tl2cgen (predict only)",
    "tl2cgen_quantize": "tl2cgen quantize=1 (DMatrix + predict)",
    "lleaves": "lleaves",
    "quiver_f32": "quiver f32",
    "quiver_int8": "quiver int8",
}
OUTPUTS = {
    "python_floor": "none",
    "lightgbm": "margin",
    "xgboost": "margin",
    "onnxruntime": "probability",
    "tl2cgen": "margin",
    "tl2cgen_predict_only": "margin",
    "tl2cgen_quantize": "margin",
    "lleaves": "margin",
    "quiver_f32": "margin",
    "quiver_int8": "margin",
}


def log(msg):
    print(f"# {msg}", file=sys.stderr, flush=True)


def error_text(e):
    first = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


# ----------------------------------------------------------------------- data


def make_data(rng):
    """Training and held-out rows (float32, NaN in NAN_COLS) and labels."""
    n = N_TRAIN + N_HELD
    x = np.empty((n, F), np.float64)
    x[:, 0:8] = rng.normal(size=(n, 8))
    x[:, 8:12] = rng.lognormal(0.0, 1.0, size=(n, 4))
    x[:, 12:16] = rng.uniform(size=(n, 4))
    x[:, 16:20] = rng.poisson(1.5, size=(n, 4))
    x[:, 20:24] = rng.standard_t(3, size=(n, 4))
    x[:, 24:28] = rng.integers(0, 20, size=(n, 4))
    x = x.astype(np.float32).astype(np.float64)  # the label sees the float32 values
    logit = (
        0.8 * x[:, 0] - 0.6 * x[:, 1] + 0.5 * x[:, 2] * x[:, 3] + np.sin(2.0 * x[:, 4])
        + 0.7 * (x[:, 5] > 0.3) * x[:, 6] + 0.5 * np.log1p(x[:, 8]) - 0.4 * np.sqrt(x[:, 9])
        + 1.2 * (x[:, 12] > 0.7) - 0.9 * (x[:, 13] < 0.2) + 0.6 * x[:, 14] * x[:, 15]
        + 0.3 * np.minimum(x[:, 16], 4) - 0.25 * x[:, 17] * (x[:, 18] > 1)
        + 0.4 * np.tanh(x[:, 20]) - 0.3 * np.clip(x[:, 21] * x[:, 22], -3, 3)
        + 0.08 * ((x[:, 24] * 7 + x[:, 25]) % 11) - 0.05 * x[:, 26] + 0.2 * (x[:, 27] % 3 == 0)
        + 0.3 * x[:, 7] * x[:, 10] - 1.0
    )
    missing = {c: rng.uniform(size=n) < NAN_RATE for c in NAN_COLS}
    logit = logit + 0.9 * missing[NAN_COLS[0]] - np.sin(2.0 * x[:, 4]) * missing[NAN_COLS[0]]
    y = (rng.uniform(size=n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    x = x.astype(np.float32)
    for c, m in missing.items():
        x[m, c] = np.nan
    for c in NAN_COLS:
        assert np.isnan(x[N_TRAIN:, c]).any(), f"held-out column {c} has no NaN"
    return x[:N_TRAIN], y[:N_TRAIN], np.ascontiguousarray(x[N_TRAIN:]), y[N_TRAIN:]


def lgb_params(depth):
    return {
        "objective": "binary",
        "num_leaves": 2**depth,
        "max_depth": depth,
        "learning_rate": 0.05,
        "min_data_in_leaf": 2,
        "min_sum_hessian_in_leaf": 1e-3,
        "lambda_l2": 0.1,
        "feature_fraction": 1.0,
        "bagging_fraction": 1.0,
        "num_threads": 1,
        "deterministic": True,
        "force_row_wise": True,
        "seed": SEED,
        "verbose": -1,
    }


def tree_structure(dump):
    """Per-tree depth and leaf count, and the split kinds, from dump_model()."""
    depths, leaves, missing_types, decision_types = [], [], {}, set()

    def walk(node, depth):
        if "leaf_value" in node:
            return depth, 1
        missing_types[node["missing_type"]] = missing_types.get(node["missing_type"], 0) + 1
        decision_types.add(node["decision_type"])
        dl, nl = walk(node["left_child"], depth + 1)
        dr, nr = walk(node["right_child"], depth + 1)
        return max(dl, dr), nl + nr

    for info in dump["tree_info"]:
        d, n = walk(info["tree_structure"], 0)
        depths.append(d)
        leaves.append(n)
    return {
        "trees": len(depths),
        "max_depth": max(depths),
        "depth_min": min(depths),
        "depth_median": float(np.median(depths)),
        "trees_at_max_depth": sum(d == max(depths) for d in depths),
        "leaves_min": min(leaves),
        "leaves_median": float(np.median(leaves)),
        "leaves_max": max(leaves),
        "leaves_total": sum(leaves),
        "split_missing_types": missing_types,
        "split_decision_types": sorted(decision_types),
    }


# ----------------------------------------------------------- XGBoost from LightGBM


def xgb_condition(t):
    """The float32 c with (x <= t) == (x < c) for every float32 x, t a
    double. LightGBM writes 1e300 for "every number goes left" (NaN is what
    such a split separates): c would be +inf, which JSON cannot hold, so it is
    clamped to FLT_MAX; only x == FLT_MAX itself then goes the other way."""
    with np.errstate(over="ignore"):
        tf = np.float32(t)
        if float(tf) > t:
            tf = np.nextafter(tf, np.float32(-np.inf))
        c = np.nextafter(tf, np.float32(np.inf))
    fmax = float(np.finfo(np.float32).max)
    return min(max(float(c), -fmax), fmax)


def lgb_to_xgb_json(dump, template):
    """The LightGBM model's trees as an XGBoost JSON model (in `template`,
    a one-tree binary:logistic model with base_score 0.5, so margin offset 0)."""
    trees = []
    tree_param = template["learner"]["gradient_booster"]["model"]["trees"][0]["tree_param"]
    for tid, info in enumerate(dump["tree_info"]):
        left, right, parents, feat, cond, dleft, weight = [], [], [], [], [], [], []

        def alloc(parent):
            left.append(-1)
            right.append(-1)
            parents.append(parent)
            feat.append(0)
            cond.append(0.0)
            dleft.append(0)
            weight.append(0.0)
            return len(left) - 1

        # Breadth first, each right child right after its left sibling: XGBoost's
        # predictor steps to LeftChild + (not x < condition).
        queue = [(info["tree_structure"], alloc(2147483647))]
        while queue:
            node, i = queue.pop(0)
            if "leaf_value" in node:
                v = float(np.float32(node["leaf_value"]))
                cond[i], weight[i] = v, v
                continue
            if node["decision_type"] != "<=":
                raise ValueError(f"decision type {node['decision_type']!r} (categorical?) is not converted")
            t = float(node["threshold"])
            if node["missing_type"] == "NaN":
                to_left = bool(node["default_left"])
            elif node["missing_type"] == "None":
                to_left = 0.0 <= t  # LightGBM scores NaN as 0.0 on such a split
            else:
                raise ValueError(f"missing type {node['missing_type']!r} has no XGBoost equivalent")
            feat[i], cond[i], dleft[i] = int(node["split_feature"]), xgb_condition(t), int(to_left)
            left[i], right[i] = alloc(i), alloc(i)
            queue.append((node["left_child"], left[i]))
            queue.append((node["right_child"], right[i]))
        n = len(left)
        trees.append({
            "base_weights": weight, "categories": [], "categories_nodes": [], "categories_segments": [],
            "categories_sizes": [], "default_left": dleft, "id": tid, "left_children": left,
            "loss_changes": [0.0] * n, "parents": parents, "right_children": right, "split_conditions": cond,
            "split_indices": feat, "split_type": [0] * n, "sum_hessian": [1.0] * n,
            "tree_param": {**tree_param, "num_feature": str(F), "num_nodes": str(n), "num_deleted": "0"},
        })
    model = json.loads(json.dumps(template))
    gb = model["learner"]["gradient_booster"]["model"]
    gb["trees"] = trees
    gb["tree_info"] = [0] * len(trees)
    gb["iteration_indptr"] = list(range(len(trees) + 1))
    gb["gbtree_model_param"]["num_trees"] = str(len(trees))
    return model


# --------------------------------------------------------------- contenders


def setup_lightgbm(ctx):
    import lightgbm as lgb

    b = lgb.Booster(model_file=ctx["model_txt"])
    call = lambda x: b.predict(x, raw_score=True, num_threads=1)  # noqa: E731
    return call, None, call(ctx["x"]), {}


def setup_xgboost(ctx):
    import xgboost as xgb

    d, x, y = ctx["dir"], ctx["x"], ctx["y_held"]
    tmpl = xgb.train({"objective": "binary:logistic", "base_score": 0.5, "max_depth": 1, "nthread": 1,
                      "seed": SEED}, xgb.DMatrix(x[:256], label=y[:256]), num_boost_round=1)
    tpath = os.path.join(d, "xgb_template.json")
    tmpl.save_model(tpath)
    with open(tpath) as f:
        template = json.load(f)
    path = os.path.join(d, f"{ctx['shape']}_xgb.json")
    with open(path, "w") as f:
        json.dump(lgb_to_xgb_json(ctx["dump"], template), f)
    bst = xgb.Booster(model_file=path)
    bst.set_param({"nthread": 1})
    call = lambda x: bst.inplace_predict(x, predict_type="margin")  # noqa: E731
    return call, None, call(x), {"model": "the LightGBM trees converted to XGBoost JSON by this script",
                                 "base_score": template["learner"]["learner_model_param"]["base_score"]}


def setup_onnxruntime(ctx):
    import onnx
    import onnxruntime as ort
    from onnxmltools import convert_lightgbm
    from onnxmltools.convert.common.data_types import FloatTensorType

    import lightgbm as lgb

    booster = lgb.Booster(model_file=ctx["model_txt"])
    model = convert_lightgbm(booster, initial_types=[("X", FloatTensorType([None, F]))], target_opset=15,
                             zipmap=False)
    path = os.path.join(ctx["dir"], f"{ctx['shape']}.onnx")
    onnx.save(model, path)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    fetch = "probabilities" if "probabilities" in outputs else outputs[-1]
    inp = sess.get_inputs()[0].name
    call = lambda x: sess.run([fetch], {inp: x})  # noqa: E731
    ops = sorted({n.op_type for n in model.graph.node})
    post = [a.s.decode() for n in model.graph.node for a in n.attribute if a.name == "post_transform"]
    return call, None, call(ctx["x"])[0][:, 1], {
        "fetch": fetch, "ops": ops, "post_transform": post,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
    }


def cache_path(ctx, kind, parts, ext):
    """Where a compiled model is kept between runs (None: not cached), keyed by
    the model text and whatever else shapes the binary."""
    if not ctx["cache"]:
        return None
    with open(ctx["model_txt"], "rb") as f:
        h = hashlib.sha256(f.read())
    for part in parts:
        h.update(b"\0" + str(part).encode())
    os.makedirs(ctx["cache"], exist_ok=True)
    return os.path.join(ctx["cache"], f"{kind}-{ctx['shape']}-{h.hexdigest()[:20]}{ext}")


def keep(src, dst):
    """Copies a freshly compiled binary into the cache, atomically."""
    if dst:
        shutil.copyfile(src, dst + ".partial")
        os.replace(dst + ".partial", dst)


def gcc_version():
    try:
        return subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return None


def setup_tl2cgen(ctx, quantize=False):
    import tl2cgen
    import treelite

    params = {"parallel_comp": 4, **({"quantize": 1} if quantize else {})}
    cached = cache_path(ctx, "tl2cgen", [pkg_version("tl2cgen"), pkg_version("treelite"), gcc_version(),
                                         json.dumps(params, sort_keys=True), platform.machine()], ".so")
    from_cache = bool(cached and os.path.exists(cached))
    t = time.time()
    if from_cache:
        lib = cached
    else:
        log(f"tl2cgen: compiling {ctx['shape']} with gcc (the 500 x 8 model takes about 2 minutes on one core)"
            + (f"; cached at {cached}" if cached else ""))
        tm = treelite.frontend.load_lightgbm_model(ctx["model_txt"])
        lib = os.path.join(ctx["dir"], f"{ctx['shape']}_tl2cgen{'_quantize' if quantize else ''}.so")
        tl2cgen.export_lib(tm, toolchain="gcc", libpath=lib, params=params, nthread=1)
        keep(lib, cached)
    compile_s = time.time() - t
    pred = tl2cgen.Predictor(lib, nthread=1)
    call = lambda x: pred.predict(tl2cgen.DMatrix(x), pred_margin=True)  # noqa: E731
    if not quantize:
        ctx["tl2cgen_predictor"] = pred
    return call, None, call(ctx["x"]).reshape(-1), {
        "params": params, "toolchain": "gcc (tl2cgen's flags: -O3 -fPIC -std=c99)", "compile_s": round(compile_s, 1),
        "from_cache": from_cache, "threshold_type": pred.threshold_type, "leaf_output_type": pred.leaf_output_type,
        "note": "tl2cgen's own treelite may warn that the model comes from a newer treelite; parity is checked",
    }


def setup_tl2cgen_predict_only(ctx):
    import tl2cgen

    pred = ctx.get("tl2cgen_predictor")
    if pred is None:
        raise RuntimeError("tl2cgen is unavailable")
    call = lambda dm: pred.predict(dm, pred_margin=True)  # noqa: E731
    return call, tl2cgen.DMatrix, call(tl2cgen.DMatrix(ctx["x"])).reshape(-1), {
        "note": "DMatrix built outside the timer, one per row block"}


def setup_lleaves(ctx):
    import llvmlite
    import llvmlite.binding as llvm

    import lleaves

    kwargs = {"raw_score": True} if not ctx["quick"] else {"raw_score": True, "finline": False}
    try:
        cpu = llvm.get_host_cpu_name() + " " + llvm.get_host_cpu_features().flatten()
    except Exception:  # noqa: BLE001
        cpu = platform.processor()
    cached = cache_path(ctx, "lleaves", [pkg_version("lleaves"), llvmlite.__version__,
                                         json.dumps(kwargs, sort_keys=True), cpu], ".bin")
    from_cache = bool(cached and os.path.exists(cached))
    fresh = os.path.join(ctx["dir"], f"{ctx['shape']}_lleaves.bin")
    if not from_cache:
        log(f"lleaves: compiling {ctx['shape']} ({kwargs}); with inlining, the 500 x 8 model takes 5 to 8 "
            f"minutes on one core" + (f"; cached at {cached}" if cached else ""))
    m = lleaves.Model(model_file=ctx["model_txt"])
    t = time.time()
    try:
        m.compile(cache=cached if from_cache else fresh, **kwargs)
    except AttributeError as e:
        if "PassManagerBuilder" in str(e):
            import llvmlite

            raise RuntimeError(
                f"{error_text(e)}: lleaves {pkg_version('lleaves')} uses llvmlite's legacy pass manager, which "
                f"llvmlite {llvmlite.__version__} does not have (llvmlite 0.44.0 does: pip install "
                f"'llvmlite<0.45')") from e
        raise
    compile_s = time.time() - t
    if not from_cache:
        keep(fresh, cached)
    call = lambda x: m.predict(x, n_jobs=1)  # noqa: E731
    return call, None, call(ctx["x"]), {
        "compile_kwargs": kwargs, "defaults_otherwise": "fblocksize=34, fcodemodel='large', finline=True, use_fp64=True",
        "compile_s": round(compile_s, 1), "from_cache": from_cache,
    }


SETUPS = {
    "lightgbm": setup_lightgbm,
    "xgboost": setup_xgboost,
    "onnxruntime": setup_onnxruntime,
    "tl2cgen": setup_tl2cgen,
    "tl2cgen_predict_only": setup_tl2cgen_predict_only,
    "tl2cgen_quantize": lambda ctx: setup_tl2cgen(ctx, quantize=True),
    "lleaves": setup_lleaves,
}


def quiver_run(cmd):
    """Runs a quiver command, once more after a failure (the binary may be
    being rebuilt). Returns the completed process, or raises with its error."""
    for attempt in (1, 2):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode == 0:
                return p
            err = (p.stderr or p.stdout).strip()[-400:]
        except OSError as e:
            err = error_text(e)
        if attempt == 1:
            log(f"quiver failed ({err.splitlines()[-1] if err else '?'}); retrying once")
            time.sleep(3)
    raise RuntimeError(f"{' '.join(cmd[1:3])} failed twice: {err}")


def quiver_import(ctx):
    qm = os.path.join(ctx["dir"], f"{ctx['shape']}.qm")
    p = quiver_run([QUIVER, "import", "--lightgbm", ctx["model_txt"], "--out", qm, "--name", "trees",
                    "--version", "1", "--inputs", f"context:{F}"])
    return qm, (p.stdout + p.stderr).strip()


def quiver_time(qm, backend, rows_npy, iters):
    p = quiver_run([QUIVER, "time-model", "--model", qm, "--backend", backend, "--rows",
                    ",".join(map(str, BATCHES)), "--iters", str(iters), "--data", rows_npy])
    out = {}
    for line in p.stdout.splitlines():
        if line.strip().startswith("{"):
            j = json.loads(line)
            out[j["rows"]] = j
    missing = [b for b in BATCHES if b not in out]
    if missing:
        raise RuntimeError(f"time-model printed no line for rows {missing}: {p.stdout[-300:]}")
    return out


# ------------------------------------------------------------------- timing


def time_calls(fn, args, budget):
    """Median µs per call of fn(args[i % len(args)]) and the number of calls."""
    k = len(args)
    for i in range(WARMUP):
        fn(args[i % k])
    clock = time.perf_counter_ns
    min_ns, max_ns, min_calls = int(budget["min_s"] * 1e9), int(budget["max_s"] * 1e9), budget["min_calls"]
    ns = []
    i = 0
    start = clock()
    while True:
        a = args[i % k]
        t0 = clock()
        fn(a)
        t1 = clock()
        ns.append(t1 - t0)
        i += 1
        if i >= min_calls and t1 - start >= min_ns:
            break
        if t1 - start >= max_ns and i >= MIN_CALLS_HARD:
            break
    return statistics.median(ns) / 1e3, i


# ---------------------------------------------------------------- reporting


def pkg_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions():
    v = {"python": platform.python_version()}
    for name in ("numpy", "lightgbm", "xgboost", "xgboost-cpu", "onnx", "onnxruntime", "onnxmltools", "treelite",
                 "tl2cgen", "lleaves", "llvmlite"):
        v[name] = pkg_version(name)
    try:
        import llvmlite  # the one imported, which a PYTHONPATH entry may shadow

        v["llvmlite_imported"] = llvmlite.__version__
    except Exception:  # noqa: BLE001
        pass
    v["gcc"] = gcc_version()
    try:
        p = subprocess.run([QUIVER, "--version"], capture_output=True, text=True)
        v["quiver"] = (p.stdout or p.stderr).strip() or None
    except OSError:
        v["quiver"] = None
    return v


def machine(loadavg_at_start):
    info = {"platform": platform.platform(), "os_cpu_count": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
        for key in ("Model name", "CPU(s)", "Core(s) per socket", "Socket(s)", "Thread(s) per core",
                    "Hypervisor vendor", "L1d cache", "L2 cache", "L3 cache"):
            if key in fields:
                info[key] = fields[key]
        flags = fields.get("Flags", "").split()
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "bmi2") if f in flags]
    except (OSError, subprocess.CalledProcessError) as e:
        info["lscpu_error"] = str(e)
    info["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info["loadavg_at_start"] = list(loadavg_at_start)
    info["loadavg_at_end"] = list(os.getloadavg())
    return info


def command_line():
    cmd = " ".join(["python3", "bench/trees_side_by_side.py", *sys.argv[1:]])
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cpus and len(cpus) < (os.cpu_count() or 0):
        cmd = f"taskset -c {','.join(map(str, cpus))} {cmd}"
    return cmd


def fmt_us(x):
    if not isinstance(x, (int, float)):
        return "n/a"
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def fmt_diff(x):
    return f"{x:.1e}" if isinstance(x, float) else "—"


def label(name, c):
    quick_lleaves = name == "lleaves" and c.get("info", {}).get("compile_kwargs", {}).get("finline") is False
    return LABELS[name] + (" (finline=False: --quick)" if quick_lleaves else "")


def shape_tables(key, s):
    st, lines = s["structure"], []
    lines.append(f"### {st['trees']} trees, depth {s['depth']} ({key})")
    lines.append("")
    lines.append(f"Real trees: max depth {st['max_depth']} ({st['trees_at_max_depth']} of {st['trees']} trees reach it), "
                 f"leaves per tree min/median/max {st['leaves_min']}/{st['leaves_median']:.0f}/{st['leaves_max']} "
                 f"(of {2 ** s['depth']} possible), {st['leaves_total']:,} leaves in all.")
    lines.append("")
    lines.append("Rotating rows (every contender, quiver included, scores new held-out rows on each call):")
    lines.append("")
    lines.append("| contender | output | parity max abs diff | batch 1 µs | batch 32 µs | batch 256 µs | µs/row at 256 |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for name in ORDER:
        c = s["contenders"].get(name)
        if c is None:
            continue
        if not c["available"]:
            lines.append(f"| {label(name, c)} | {OUTPUTS[name]} | | n/a: {c['error']} | | | |")
            continue
        t = c["us"]["rotating"]
        if name == "python_floor":
            cells = [fmt_us(t.get("1")), "", "", ""]
        else:
            v256 = t.get("256")
            cells = [fmt_us(t.get(str(b))) for b in BATCHES] + [f"{v256 / 256:.3f}" if isinstance(v256, float) else "n/a"]
        parity = "not checked (tests/trees.rs)" if name.startswith("quiver") else (
            "reference" if name == "lightgbm" else fmt_diff(c.get("parity_max_abs_diff")))
        lines.append(f"| {label(name, c)} | {OUTPUTS[name]} | {parity} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Fixed rows (every call scores the same block of rows, the same block for every contender in a round):")
    lines.append("")
    lines.append("| contender | batch 1 µs | batch 32 µs | batch 256 µs | µs/row at 256 |")
    lines.append("|---|---:|---:|---:|---:|")
    for name in ORDER:
        c = s["contenders"].get(name)
        if c is None or not c["available"]:
            continue
        t = c["us"]["fixed"]
        if name == "python_floor":
            lines.append(f"| {label(name, c)} | {fmt_us(t.get('1'))} | | | |")
            continue
        v256 = t.get("256")
        per_row = f"{v256 / 256:.3f}" if isinstance(v256, float) else "n/a"
        lines.append(f"| {label(name, c)} | " + " | ".join(fmt_us(t.get(str(b))) for b in BATCHES) + f" | {per_row} |")
    lines.append("")
    r = s.get("ratios", {})
    if r.get("quiver_best"):
        lines.append(f"At batch {RATIO_BATCH}, quiver's best backend is {r['quiver_best']} "
                     f"({fmt_us(r['quiver_best_us'])} µs); other / quiver (above 1: quiver faster):")
        lines.append("")
        for other in ("lleaves", "onnxruntime"):
            o = r.get(other)
            if not o:
                lines.append(f"- {other}: n/a (unavailable)")
                continue
            lines.append(f"- {other}: {o['rotating']:.2f}× on rotating rows, {o['fixed']:.2f}× on fixed rows")
    else:
        lines.append("Quiver unavailable: no ratios.")
    lines.append("")
    return lines


def markdown(report):
    m, v, s = report["machine"], report["versions"], report["settings"]
    lines = ["## Tree ensembles side by side", ""]
    lines.append(
        f"Written by `bench/trees_side_by_side.py` ({report['generated']}, commit `{report['commit']}`, "
        f"{report['wall_s']:.0f} s). Machine: {m.get('Model name', '?')}, {m.get('CPU(s)', '?')} CPUs, "
        f"affinity {m.get('affinity')}, load average at start {m['loadavg_at_start'][0]:.2f}. "
        f"lightgbm {v['lightgbm']}, xgboost {v['xgboost'] or v['xgboost-cpu']}, onnxruntime {v['onnxruntime']}, "
        f"onnxmltools {v['onnxmltools']}, treelite {v['treelite']}, tl2cgen {v['tl2cgen']}, lleaves {v['lleaves']} "
        f"(llvmlite {v.get('llvmlite_imported', v['llvmlite'])}), numpy {v['numpy']}.")
    lines.append("")
    lines.append(
        f"Single thread everywhere; µs per call, each cell the median of {s['rounds']} rounds' medians (per round and "
        f"contender: {WARMUP} warm-up calls, then >= {s['min_calls']} calls and >= {s['min_s']} s, at most "
        f"{s['max_s']} s; quiver: time-model's median of {s['quiver_iters']} calls). Python contenders include "
        f"the Python call overhead (the floor row: an empty call through the same loop); quiver's figures come from "
        f"its own binary, with no Python. Outputs: margins, except onnxruntime's probability (one sigmoid per row "
        f"more). tl2cgen (DMatrix + predict) includes building the DMatrix from the numpy rows, the predict-only row "
        f"builds it outside the timer, and quantize=1 is a second library with tl2cgen's threshold quantization; "
        f"lleaves converts the float32 rows to float64 inside predict. xgboost runs the same LightGBM trees, converted to its JSON format. "
        f"Parity is the max abs difference from LightGBM on the {N_HELD:,} held-out rows (onnxruntime: from the "
        f"sigmoid of LightGBM's margin); quiver's parity is checked by tests/trees.rs, not here.")
    lines.append("")
    lines.append("    " + report["command"])
    lines.append("")
    for key, shape in report["shapes"].items():
        lines.extend(shape_tables(key, shape))
    return "\n".join(lines)


# --------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, few calls, lleaves without inlining (a smoke run)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "trees_side_by_side.json"), help="the JSON report")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                    "quiver-bench", "trees"),
                    help="where the compiled tl2cgen and lleaves models are kept between runs")
    ap.add_argument("--no-cache", action="store_true", help="compile tl2cgen and lleaves afresh, keep nothing")
    args = ap.parse_args()
    budget = QUICK if args.quick else FULL
    started = time.time()
    loadavg_at_start = os.getloadavg()
    rng = np.random.default_rng(SEED)
    x_train, y_train, x_held, y_held = make_data(rng)
    offsets = {b: rng.integers(0, N_HELD - b + 1, size=N_OFFSETS) for b in BATCHES}
    block_offsets = rng.integers(0, N_HELD - max(BATCHES) + 1, size=budget["rounds"])
    rotating = {b: [x_held[o:o + b] for o in offsets[b]] for b in BATCHES}
    report_shapes, live = {}, {}
    quiver_ok = os.path.exists(QUIVER)
    with tempfile.TemporaryDirectory(prefix="trees_side_by_side_") as d:
        # Setup: train, convert, compile and check parity, once per shape.
        try:
            import lightgbm as lgb
        except Exception as e:  # noqa: BLE001
            sys.exit(f"lightgbm is needed to train the models: {error_text(e)}")
        for trees, depth in SHAPES:
            key = f"{trees}x{depth}"
            t = time.time()
            params = lgb_params(depth)
            booster = lgb.train(params, lgb.Dataset(x_train, y_train, params={"feature_pre_filter": False}),
                                num_boost_round=trees)
            train_s = time.time() - t
            model_txt = os.path.join(d, f"{key}.txt")
            booster.save_model(model_txt)
            with open(model_txt, "rb") as f:
                model_sha = hashlib.sha256(f.read()).hexdigest()
            dump = booster.dump_model()
            st = tree_structure(dump)
            ref = booster.predict(x_held, raw_score=True, num_threads=1)
            log(f"{key}: trained in {train_s:.1f} s; max depth {st['max_depth']} ({st['trees_at_max_depth']}/"
                f"{st['trees']} trees), leaves min/median/max {st['leaves_min']}/{st['leaves_median']:.0f}/"
                f"{st['leaves_max']}, {st['leaves_total']} in all; splits {st['split_missing_types']}")
            entry = {"trees": trees, "depth": depth, "lightgbm_params": params, "train_s": round(train_s, 1),
                     "model_sha256": model_sha, "structure": st,
                     "held_out_margin": {"min": float(ref.min()), "max": float(ref.max()),
                                         "mean_probability": float(np.mean(1 / (1 + np.exp(-ref))))},
                     "contenders": {}}
            report_shapes[key] = entry
            ctx = {"shape": key, "dir": d, "model_txt": model_txt, "dump": dump, "x": x_held, "y_held": y_held,
                   "quick": args.quick, "cache": None if args.no_cache else args.cache}
            calls = {"python_floor": (lambda x: None, None)}
            entry["contenders"]["python_floor"] = {"available": True, "output": "none"}
            sig = 1.0 / (1.0 + np.exp(-ref))
            for name in PYTHON:
                c = {"output": OUTPUTS[name]}
                t = time.time()
                try:
                    fn, prep, out, info = SETUPS[name](ctx)
                    out = np.asarray(out, np.float64).reshape(-1)
                    want = sig if OUTPUTS[name] == "probability" else ref
                    c.update(available=True, info=info, setup_s=round(time.time() - t, 1),
                             parity_max_abs_diff=float(np.max(np.abs(out - want))),
                             parity_rows_differing_by_over_1e_5=int(np.sum(np.abs(out - want) > 1e-5)))
                    calls[name] = (fn, prep)
                    log(f"{key}: {name} ready in {time.time() - t:.1f} s; {OUTPUTS[name]} max abs diff from "
                        f"lightgbm {c['parity_max_abs_diff']:.2e}")
                except Exception as e:  # noqa: BLE001
                    c.update(available=False, error=error_text(e), traceback=traceback.format_exc()[-2000:])
                    log(f"{key}: {name} unavailable: {c['error']}")
                entry["contenders"][name] = c
            qm = None
            for name in QUIVER_BACKENDS:
                entry["contenders"][name] = {"output": "margin", "available": False,
                                             "error": f"{QUIVER} not found: cargo build --release"}
            if quiver_ok:
                try:
                    qm, import_log = quiver_import(ctx)
                    for name in QUIVER_BACKENDS:
                        entry["contenders"][name] = {"output": "margin", "available": True,
                                                     "info": {"import_log": import_log.splitlines()[-6:]}}
                except RuntimeError as e:
                    for name in QUIVER_BACKENDS:
                        entry["contenders"][name]["error"] = str(e)
                    log(f"{key}: quiver unavailable: {e}")
            # Argument lists per batch: rotating rows, prepared per contender.
            prepared = {}
            for name, (fn, prep) in calls.items():
                prepared[name] = {b: [prep(v) for v in rotating[b]] if prep else rotating[b] for b in BATCHES}
            live[key] = {"calls": calls, "prepared": prepared, "qm": qm}
            for name, c in entry["contenders"].items():
                c["raw"] = {m: {str(b): [] for b in BATCHES} for m in MODES}
                c["calls_per_round"] = {m: {str(b): [] for b in BATCHES} for m in MODES}
        log(f"set up in {time.time() - started:.0f} s; timing {budget['rounds']} round(s)")

        # Timing: rounds, each contender once per round in ORDER.
        held_npy = os.path.join(d, "held_out.npy")
        np.save(held_npy, np.ascontiguousarray(x_held))
        for r in range(budget["rounds"]):
            o = int(block_offsets[r])
            block = np.ascontiguousarray(x_held[o:o + max(BATCHES)])
            rows_npy = os.path.join(d, f"rows_round{r}.npy")
            np.save(rows_npy, block)
            for key, entry in report_shapes.items():
                lv = live[key]
                for name in ORDER:
                    c = entry["contenders"][name]
                    if not c["available"]:
                        continue
                    if name in QUIVER_BACKENDS:
                        try:
                            for mode, npy in (("rotating", held_npy), ("fixed", rows_npy)):
                                q = quiver_time(lv["qm"], name.split("_")[1], npy, budget["quiver_iters"])
                                for b in BATCHES:
                                    c["raw"][mode][str(b)].append(q[b]["median_us"])
                                    c["calls_per_round"][mode][str(b)].append(q[b]["iters"])
                            c["info"]["backend_name"] = q[BATCHES[0]]["backend"]
                        except RuntimeError as e:
                            c.setdefault("round_errors", []).append(f"round {r}: {e}")
                            log(f"{key}: {name} round {r}: {e}")
                        continue
                    fn, prep = lv["calls"][name]
                    for b in (BATCHES if name != "python_floor" else (1,)):
                        fixed = [block[:b]] if prep is None else [prep(block[:b])]
                        for mode, argl in (("rotating", lv["prepared"][name][b]), ("fixed", fixed)):
                            us, n = time_calls(fn, argl, budget)
                            c["raw"][mode][str(b)].append(us)
                            c["calls_per_round"][mode][str(b)].append(n)
            log(f"round {r + 1}/{budget['rounds']} done at {time.time() - started:.0f} s")

    # Medians and ratios.
    for key, entry in report_shapes.items():
        for name, c in entry["contenders"].items():
            c["us"] = {m: {b: float(np.median(v)) for b, v in c["raw"][m].items() if v} for m in MODES}
            if not any(c["us"][m] for m in MODES) and c["available"]:
                c["available"] = False
                c["error"] = "; ".join(c.get("round_errors", ["no round produced a figure"]))[:600]
        qs = {n: entry["contenders"][n]["us"]["rotating"].get(str(RATIO_BATCH)) for n in QUIVER_BACKENDS
              if entry["contenders"][n]["available"]}
        qs = {n: v for n, v in qs.items() if v}
        ratios = {}
        if qs:
            best = min(qs, key=qs.get)
            ratios = {"batch": RATIO_BATCH, "quiver_best": best, "quiver_best_us": qs[best],
                      "what": "other contender's µs / quiver's best backend's µs; above 1: quiver faster"}
            qbest = entry["contenders"][best]
            for other in ("lleaves", "onnxruntime"):
                oc = entry["contenders"][other]
                if not oc["available"] or str(RATIO_BATCH) not in oc["us"]["rotating"]:
                    continue
                per_round = {m: [a / b for a, b in zip(oc["raw"][m][str(RATIO_BATCH)], qbest["raw"][m][str(RATIO_BATCH)])]
                             for m in MODES}
                ratios[other] = {
                    "rotating": oc["us"]["rotating"][str(RATIO_BATCH)] / qs[best],
                    "fixed": oc["us"]["fixed"][str(RATIO_BATCH)] / qbest["us"]["fixed"][str(RATIO_BATCH)],
                    "per_round": per_round,
                }
        entry["ratios"] = ratios

    report = {
        "what": "µs per call (median of per-round medians), single thread, gradient-boosted tree ensembles; "
                "Python contenders include Python call overhead, quiver's come from its binary",
        "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": git_commit(),
        "command": command_line(),
        "wall_s": round(time.time() - started, 1),
        "machine": machine(loadavg_at_start),
        "versions": versions(),
        "settings": {**budget, "quick": args.quick, "seed": SEED, "train_rows": N_TRAIN, "held_out_rows": N_HELD,
                     "features": F, "nan_columns": list(NAN_COLS), "nan_rate": NAN_RATE, "batches": list(BATCHES),
                     "rotating_offsets": N_OFFSETS, "fixed_block_offsets": [int(o) for o in block_offsets],
                     "warmup_calls": WARMUP, "min_calls_hard": MIN_CALLS_HARD, "threads": 1,
                     "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "notes": [
            "outputs: margins, except onnxruntime's probability (one sigmoid per row more)",
            "rotating: every contender scores new held-out rows on each call (quiver time-model --data rotates "
            "through the held-out set); fixed: one 256-row block per round, the same for every contender",
            "quiver parity is not checked here; tests/trees.rs covers it",
            "xgboost runs the LightGBM trees converted to XGBoost JSON by this script, not a model it trained",
            "tl2cgen: DMatrix construction is inside the timed call; tl2cgen_predict_only builds it outside; "
            "tl2cgen_quantize is a second library compiled with quantize=1",
            "lleaves: predict copies float32 rows to float64 (use_fp64=True, its default)",
        ],
        "shapes": report_shapes,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    md = markdown(report)
    md_path = os.path.splitext(args.out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(md + "\n")
    print(md)
    log(f"wrote {args.out} and {md_path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
