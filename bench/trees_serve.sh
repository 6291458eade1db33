#!/usr/bin/env bash
# End to end, a gradient-boosted tree model on the auction-32 request shape
# (one user, 32 candidates, 16 context floats; 80 features a row) beside the
# auction-32 MLP, in one run: `quiver bench --sweep` finds each one's capacity
# at p99 <= $P99_MAX_US µs, open loop, server on core $SERVER_CORE and the
# generator on core $GEN_CORE, as bench/run.sh does for the MLP.
#
# The tree model is LightGBM, 100 trees of depth 6 (num_leaves 64), trained
# here on a seeded synthetic set drawn like the demo's features, imported
# with `quiver import --lightgbm` under the demo model's name so the demo
# requests reach it. Writes bench/results/trees-serve.json.
#
# usage: bench/trees_serve.sh     (SWEEP_DURATION=3s by default)
set -euo pipefail
cd "$(dirname "$0")/.."

SWEEP_DURATION="${SWEEP_DURATION:-3s}"
P99_MAX_US="${P99_MAX_US:-1000}"
CONNECTIONS="${CONNECTIONS:-2}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results

die() { echo "trees_serve: $*" >&2; exit 1; }
command -v taskset >/dev/null || die "taskset is missing (apt-get install util-linux)"
python3 -c 'import lightgbm, numpy' 2>/dev/null || die "needs lightgbm and numpy (pip install lightgbm==4.7.0 numpy)"
[ "$(nproc)" -ge 2 ] || die "needs at least 2 cores (server and generator on separate cores)"

cargo build --release --quiet
bin=target/release/quiver
mkdir -p "$RESULTS"
data="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$data"
}
trap cleanup EXIT

"$bin" demo --data-dir "$data" 2>/dev/null
python3 - "$data/trees.txt" <<'PY'
import sys
import numpy as np
import lightgbm as lgb
rng = np.random.default_rng(20261201)
n, d = 40_000, 80  # user 32 | item 32 | context 16, the demo's layout
x = rng.normal(size=(n, d)).astype(np.float32)
logit = x[:, 0] * x[:, 32] + 0.5 * x[:, 64] - np.abs(x[:, 5]) + 0.3 * x[:, 40] * x[:, 70] - 1.5
y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
params = dict(objective="binary", num_leaves=64, max_depth=6, learning_rate=0.1, min_data_in_leaf=5,
              num_threads=1, deterministic=True, seed=7, verbose=-1)
booster = lgb.train(params, lgb.Dataset(x, y), num_boost_round=100)
booster.save_model(sys.argv[1])
PY
mkdir -p "$data/models/auction-32/1"
"$bin" import --lightgbm "$data/trees.txt" --out "$data/models/auction-32/1/model.qm" --name auction-32 \
    --version 1 --inputs user:32,item:32,context:16 | sed -n '1,8p'

start_quiver() {
    local log="$data/serve-$1.log"; shift
    : >"$data/serve.out"
    taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --cores "$SERVER_CORE" "$@" \
        >"$data/serve.out" 2>"$log" &
    server_pid=$!
    pids+=("$server_pid")
    for _ in $(seq 600); do grep -q "listening on" "$data/serve.out" 2>/dev/null && break; sleep 0.05; done
    addr="$(awk '/listening on/ {print $4}' "$data/serve.out")"
    [ -n "$addr" ] || { cat "$log" "$data/serve.out"; die "server did not start within 30 s"; }
}
stop_quiver() { kill -TERM "$server_pid"; wait "$server_pid" || die "server exited non-zero"; }
gen() { taskset -c "$GEN_CORE" "$bin" bench --addr "$addr" --connections "$CONNECTIONS" --budget-us 1000000 "$@"; }

for model in mlp trees; do
    echo "== sweep: auction-32 scored by the $model model (p99 <= $P99_MAX_US µs)"
    if [ "$model" = mlp ]; then start_quiver mlp; else start_quiver trees --models-dir "$data/models"; fi
    gen --duration 1s --pipeline 1 --json >/dev/null   # warm up
    gen --duration "$SWEEP_DURATION" --sweep "4000:4000:120000" --p99-max-us "$P99_MAX_US" \
        --sweep-repeats 3 --json >"$data/sweep-$model.json"
    stop_quiver
done

python3 - "$data" "$RESULTS/trees-serve.json" <<'PY'
import json, os, subprocess, sys
data, out = sys.argv[1], sys.argv[2]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "commit": commit,
       "model": "LightGBM binary, 100 trees, depth 6, 80 features (auction-32 layout)",
       "settings": {k: os.environ.get(k) for k in ["SWEEP_DURATION", "P99_MAX_US", "CONNECTIONS"]}}
for m in ["mlp", "trees"]:
    s = json.load(open(f"{data}/sweep-{m}.json"))
    res[m] = s
    print(f"{m:>5}: capacity at p99 <= {s['p99_max_us']} µs: {s['capacity_rate']:.0f} req/s")
json.dump(res, open(out, "w"), indent=1, sort_keys=True)
PY
