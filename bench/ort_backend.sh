#!/usr/bin/env bash
# The onnxruntime backend against the native INT8 and f32 backends on the
# same networks, in one run: what a user gains by staying on the native path.
#
# Models: auction-32 (the demo MLP, exported with `quiver export-onnx` and
# re-imported with --keep-onnx, so one file serves all three backends), and
# two zoo graphs imported with --keep-onnx: torch_bn_mlp (a plain MLP after
# BatchNorm folding) and dcn_v2 (a graph model: cross layers).
#
# Per call: `quiver time-model --one-request` (as the server scores inline)
# at 32 rows and plain batches of 256 rows, median of --iters calls, one
# thread on core $SERVER_CORE.
# End to end: `quiver serve` (one shard on core $SERVER_CORE, inline) with
# each backend, `quiver bench` open loop at $RATE req/s for $DURATION from
# core $GEN_CORE, 32 candidates; p50, p99, p99.9 and max.
# Every (model, backend) pair is measured $REPEATS times, interleaved;
# figures are medians over the repeats. Seeded (the demo data, bench seed 42).
#
# Writes bench/results/ort_backend.json and bench/results/ort_backend.md
# (rendered into docs/BENCHMARKS.md by bench/report.py).
#
# usage: bench/ort_backend.sh   (needs the onnxruntime wheel: ORT_DYLIB_PATH
#        or `pip install onnxruntime==1.32.0`)
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-5000}"
DURATION="${DURATION:-5s}"
REPEATS="${REPEATS:-3}"
ITERS="${ITERS:-400}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results
BENCH_NAME=ort_backend
# shellcheck source=bench/lib.sh
. bench/lib.sh

need taskset util-linux
need_two_cores
if [ -z "${ORT_DYLIB_PATH:-}" ]; then
    ORT_DYLIB_PATH="$(python3 -c 'import glob, os, onnxruntime; print(sorted(glob.glob(os.path.dirname(onnxruntime.__file__) + "/capi/libonnxruntime.so*"))[0])' 2>/dev/null)" \
        || die "no onnxruntime library: set ORT_DYLIB_PATH or pip install onnxruntime==1.32.0"
fi
export ORT_DYLIB_PATH
ort_version="$(python3 -c 'import onnxruntime; print(onnxruntime.__version__)' 2>/dev/null || echo unknown)"

cargo build --release --quiet --features onnxruntime
bin=target/release/quiver
data="$(mktemp -d)"
pids=()
trap bench_cleanup EXIT
mkdir -p "$RESULTS"

# auction-32: the demo's data and model, its model kept for onnxruntime.
"$bin" demo --data-dir "$data/auction-32" >/dev/null 2>&1
"$bin" export-onnx --model "$data/auction-32/model.qm" --out "$data/auction-32.onnx" >/dev/null
mkdir -p "$data/auction-32/models/auction-32/1"
"$bin" import --onnx "$data/auction-32.onnx" --out "$data/auction-32/models/auction-32/1/model.qm" \
    --name auction-32 --version 1 --inputs user:32,item:32,context:16 --keep-onnx >/dev/null
# The zoo graphs read 8-float user and item vectors: seeded replicas of the
# demo's sizes (100,000 users, 10,000 items).
python3 - "$data" <<'PY'
import sys
import numpy as np
rng = np.random.default_rng(20261202)
for group, n in [("user", 100_000), ("item", 10_000)]:
    v = rng.normal(size=(n, 8)).astype(np.float32)
    with open(f"{sys.argv[1]}/{group}s.txt", "w") as f:
        for k in range(n):
            f.write(str(k) + "," + ",".join(f"{x:.6f}" for x in v[k]) + "\n")
PY
for zoo in torch_bn_mlp dcn_v2; do
    mkdir -p "$data/$zoo/models/$zoo/1"
    "$bin" replica build --group user --input "$data/users.txt" --out "$data/$zoo/user.qrep" >/dev/null
    "$bin" replica build --group item --input "$data/items.txt" --out "$data/$zoo/item.qrep" >/dev/null
    "$bin" import --onnx "tests/fixtures/zoo/$zoo.onnx" --out "$data/$zoo/models/$zoo/1/model.qm" --name "$zoo" \
        --version 1 --inputs user=user:8,item=item:8,context=ctx:4 --keep-onnx >/dev/null
done

MODELS=(auction-32 torch_bn_mlp dcn_v2)
BACKENDS=(int8 f32 onnxruntime)
for r in $(seq "$REPEATS"); do
    for m in "${MODELS[@]}"; do
        for b in "${BACKENDS[@]}"; do
            echo "== repeat $r: $m on $b"
            qm="$data/$m/models/$m/1/model.qm"
            taskset -c "$SERVER_CORE" "$bin" time-model --model "$qm" --backend "$b" --rows 32 --iters "$ITERS" \
                --one-request >"$data/call-$m-$b-request-$r.json"
            taskset -c "$SERVER_CORE" "$bin" time-model --model "$qm" --backend "$b" --rows 256 --iters "$ITERS" \
                >"$data/call-$m-$b-batch-$r.json"
            out="$data/serve.out"
            : >"$out"
            ctx=4
            if [ "$m" = auction-32 ]; then ctx=16; fi
            taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data/$m" --models-dir "$data/$m/models" \
                --listen 127.0.0.1:0 --admin off --cores "$SERVER_CORE" --shards 1 --backend "$b" \
                >"$out" 2>"$data/serve-$m-$b-$r.log" &
            server_pid=$!
            pids+=("$server_pid")
            wait_listening "$out" "$data/serve-$m-$b-$r.log"
            if grep -q "library could not be loaded" "$data/serve-$m-$b-$r.log"; then die "onnxruntime did not load for $m"; fi
            taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --duration 1s --pipeline 1 --connections 2 \
                --budget-us 1000000 --context-len "$ctx" --json >/dev/null
            taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --duration "$DURATION" --rate "$RATE" \
                --connections 2 --budget-us 1000000 --context-len "$ctx" --json >"$data/e2e-$m-$b-$r.json"
            kill -TERM "$server_pid"
            wait "$server_pid" || die "server exited non-zero ($m, $b)"
        done
    done
done

python3 - "$data" "$RESULTS" "$REPEATS" "$RATE" "$DURATION" "$ort_version" <<'PY'
import json, os, statistics, subprocess, sys
data, results, repeats, rate, duration, ort_version = sys.argv[1:]
repeats = int(repeats)
models = ["auction-32", "torch_bn_mlp", "dcn_v2"]
backends = ["int8", "f32", "onnxruntime"]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
med = statistics.median
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "commit": commit, "onnxruntime": ort_version,
       "settings": {"rate": float(rate), "duration": duration, "repeats": repeats}, "models": {}}
for m in models:
    res["models"][m] = {}
    for b in backends:
        req = [json.loads(open(f"{data}/call-{m}-{b}-request-{r}.json").readline()) for r in range(1, repeats + 1)]
        bat = [json.loads(open(f"{data}/call-{m}-{b}-batch-{r}.json").readline()) for r in range(1, repeats + 1)]
        e2e = [json.load(open(f"{data}/e2e-{m}-{b}-{r}.json")) for r in range(1, repeats + 1)]
        lat = lambda k: med([e["latency"][k] for e in e2e])
        res["models"][m][b] = {
            "request_32_us": med([t["median_us"] for t in req]),
            "batch_256_us": med([t["median_us"] for t in bat]),
            "achieved_rate": med([e["achieved_rate"] for e in e2e]),
            "not_ok": sum(n for e in e2e for k, n in e["by_status"].items() if k != "ok"),
            "not_primary": sum(n for e in e2e for k, n in e["by_tier"].items() if k != "primary"),
            "p50_us": lat("p50_us"), "p99_us": lat("p99_us"), "p999_us": lat("p999_us"), "max_us": lat("max_us"),
            "runs": {"request_32_us": [t["median_us"] for t in req], "p99_us": [e["latency"]["p99_us"] for e in e2e]},
        }
bad = [(m, b) for m in models for b in backends if res["models"][m][b]["not_ok"] or res["models"][m][b]["not_primary"]]
if bad:
    sys.exit(f"ort_backend: requests not answered Ok by the primary for {bad}: the figures would not be the model's")
json.dump(res, open(f"{results}/ort_backend.json", "w"), indent=1, sort_keys=True)
o = []
o.append("## onnxruntime as a backend, beside the native ones")
o.append("")
o.append(f"Measured by `bench/ort_backend.sh` at `{commit}` on {cpu} ({os.cpu_count()} vCPUs), onnxruntime "
         f"{ort_version} loaded at run time (feature `onnxruntime`, one intra-op thread). Each model file keeps "
         "its ONNX graph (`--keep-onnx`), so the three backends run the same network; auction-32 is the demo MLP "
         "exported with `quiver export-onnx`. Medians over "
         f"{repeats} interleaved repeats. Per call: `quiver time-model` on core 0, one request of 32 candidates "
         "(`--one-request`, as the server scores inline) and a batch of 256 rows. End to end: one shard on core 0, "
         f"`quiver bench` open loop at {float(rate):,.0f} req/s for {duration} from core 1, 32 candidates.")
o.append("")
o.append("| model | backend | one request, 32 rows (µs) | batch of 256 (µs) | p50 (µs) | p99 (µs) | p99.9 (µs) | max (µs) |")
o.append("|---|---|---|---|---|---|---|---|")
for m in models:
    for b in backends:
        x = res["models"][m][b]
        o.append(f"| {m} | {b} | {x['request_32_us']:.1f} | {x['batch_256_us']:.1f} | {x['p50_us']:.0f} | "
                 f"{x['p99_us']:.0f} | {x['p999_us']:.0f} | {x['max_us']:.0f} |")
o.append("")
o.append("Per call, onnxruntime against the native backends (ratio of medians, one request of 32 rows):")
o.append("")
for m in models:
    x = res["models"][m]
    o.append(f"- {m}: onnxruntime / int8 = {x['onnxruntime']['request_32_us'] / x['int8']['request_32_us']:.1f}x, "
             f"onnxruntime / f32 = {x['onnxruntime']['request_32_us'] / x['f32']['request_32_us']:.1f}x; "
             f"end-to-end p99 onnxruntime / int8 = {x['onnxruntime']['p99_us'] / x['int8']['p99_us']:.2f}x")
o.append("")
o.append("Read the per-call columns for the cost of each backend: the open-loop tails of one shard on this 2-core VM "
         "move between repeats by more than the backends differ at this rate (each repeat's p99 is in "
         "`bench/results/ort_backend.json`). The f32 backend is the reference, not a tuned path; auction-32's "
         "int8 runs its dynamic per-row scales here (the export carries no calibration).")
open(f"{results}/ort_backend.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
