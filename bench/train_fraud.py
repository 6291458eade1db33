#!/usr/bin/env python3
"""Trains the fraud worked example's LightGBM model: the model
`quiver demo --workload fraud` imports and serves (src/loadgen/fraud_model.txt),
and the reference scores tests/demo_workloads.rs checks the import against
(tests/fixtures/fraud_reference.csv).

Why a committed model: the demo must run with no Python. This script is how
that file was made, and how to make it again after the generator changes
(src/loadgen/fraud.rs: populations, rows, the hidden labelling rule).

Regenerate (LightGBM 4.x; `pip install lightgbm`):

    cargo build --release
    target/release/quiver demo --workload fraud --training-set /tmp/fraud.csv --rows 200000
    python3 bench/train_fraud.py /tmp/fraud.csv
    cargo build --release && cargo test --release --test demo_workloads

Input: the CSV the Rust generator writes: a header of the model's input
columns in `--inputs card:4,account:4,device:4,ip:4,merchant:4,context:2`
order, then `label`. Rows are split 80/20 in file order (the generator's
rows are independent draws, so the tail is a fair held-out set).

Training: objective binary, 100 trees, 31 leaves, learning rate 0.1,
min_data_in_leaf 50, one thread, deterministic, fixed seeds: the same CSV
gives the same model file. Prints the held-out AUC; writes the model text
and 256 held-out rows with LightGBM's own probability for each.
"""

import argparse
import csv
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightgbm as lgb  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_ROWS = 256


def auc(scores, labels):
    """Area under the ROC curve by average ranks (ties count one half)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    s = scores[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    pos = labels.sum()
    neg = len(labels) - pos
    return (ranks[labels == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="quiver demo --workload fraud --training-set FILE")
    ap.add_argument("--model-out", default=os.path.join(ROOT, "src/loadgen/fraud_model.txt"))
    ap.add_argument("--reference-out", default=os.path.join(ROOT, "tests/fixtures/fraud_reference.csv"))
    args = ap.parse_args()

    with open(args.csv, newline="") as f:
        header = next(csv.reader(f))
    if header[-1] != "label":
        sys.exit(f"{args.csv}: the last column is {header[-1]!r}, expected 'label'")
    data = np.loadtxt(args.csv, delimiter=",", skiprows=1, dtype=np.float64)
    x, y = data[:, :-1], data[:, -1].astype(np.int32)
    split = int(len(y) * 0.8)
    params = {
        "objective": "binary",
        "num_leaves": 31,
        "learning_rate": 0.1,
        "min_data_in_leaf": 50,
        "num_threads": 1,
        "deterministic": True,
        "force_row_wise": True,
        "seed": 33,
        "bagging_seed": 33,
        "feature_fraction_seed": 33,
        "data_random_seed": 33,
        "verbose": -1,
    }
    train = lgb.Dataset(x[:split], label=y[:split], feature_name=header[:-1], free_raw_data=False)
    booster = lgb.train(params, train, num_boost_round=100)
    p = booster.predict(x[split:], num_threads=1)
    print(
        f"{len(y)} rows, {y.mean():.2%} fraud; held-out {len(y) - split} rows: AUC {auc(p, y[split:]):.4f} "
        f"(base rate {y[split:].mean():.2%})"
    )
    booster.save_model(args.model_out)
    print(f"wrote {args.model_out} ({os.path.getsize(args.model_out)} bytes)")

    ref = x[split : split + REFERENCE_ROWS].astype(np.float32)
    ref_p = booster.predict(ref.astype(np.float64), num_threads=1)
    with open(args.reference_out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header[:-1] + ["label", "lightgbm_probability"])
        for row, label, prob in zip(ref, y[split : split + REFERENCE_ROWS], ref_p):
            w.writerow([repr(float(v)) for v in row] + [int(label), repr(float(prob))])
    print(f"wrote {args.reference_out} ({REFERENCE_ROWS} held-out rows with LightGBM's probabilities)")


if __name__ == "__main__":
    main()
