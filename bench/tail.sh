#!/usr/bin/env bash
# Tail latency side by side in one run: Redis GET (the environment's floor),
# Quiver's protocol floor (`serve --floor`) and auction-32 (scored inline, and
# on the inference thread sharing the shard's core), each served on
# core $SERVER_CORE and driven by the same open-loop generator (`quiver bench`,
# `--protocol redis` for Redis) on core $GEN_CORE, at each rate of $RATES,
# $RUNS runs each, interleaved (run 1 of every server, then run 2, ...) so a
# noisy minute of the VM falls on all of them. Writes one JSON per run to
# $OUT and a summary of medians and ratios to Redis ($OUT/tail-summary.json,
# and a table on stdout).
#
# usage: bench/tail.sh     (RUNS=5 DURATION=5s RATES="10000 30000 60000 90000")
#        QUIVER_FLAGS="--inference thread" bench/tail.sh   (extra serve flags)
#        BASE_BIN=/path/to/older/quiver bench/tail.sh      (adds "base":
#            auction-32 served by that binary, for a before/after in one run;
#            BASE_FLAGS are its serve flags, BASE_LABEL says what it is)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-5}"
DURATION="${DURATION:-5s}"
RATES="${RATES:-10000 30000 60000 90000}"
CONNECTIONS="${CONNECTIONS:-4}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
OUT="${OUT:-bench/results/tail}"
QUIVER_FLAGS="${QUIVER_FLAGS:-}"
BASE_BIN="${BASE_BIN:-}"
BASE_FLAGS="${BASE_FLAGS:-}"
BASE_LABEL="${BASE_LABEL:-an earlier build}"
SERVERS="${SERVERS:-redis floor quiver thread${BASE_BIN:+ base}}"

BENCH_NAME=tail
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need redis-server redis-server
need redis-cli redis-tools
need python3 python3
need_two_cores
bench_setup
mkdir -p "$OUT"
rm -f "$OUT"/tail-*.json

declare -A addr
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
taskset -c "$SERVER_CORE" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize no --logfile "$data/redis.log" &
pids+=("$!")
for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
redis-cli -p "$port" ping >/dev/null || die "redis-server did not start"
addr[redis]="127.0.0.1:$port"

# The Quiver servers run for the whole script, one shard each on $SERVER_CORE.
# "thread" is auction-32 scored on the inference thread, which shares
# $SERVER_CORE with the shard (a 2-core box has no spare core for it).
printf 'inference = "thread"\n[stage]\ncore = %s\n' "$SERVER_CORE" >"$data/thread.toml"
for mode in floor quiver thread ${BASE_BIN:+base}; do
    flags=()
    serve_bin="$bin"
    [ "$mode" = floor ] && flags=(--floor)
    # shellcheck disable=SC2206
    [ "$mode" = quiver ] && flags=($QUIVER_FLAGS)
    [ "$mode" = thread ] && flags=(--config "$data/thread.toml")
    [ "$mode" = base ] && serve_bin="$BASE_BIN"
    # shellcheck disable=SC2206
    [ "$mode" = base ] && flags=($BASE_FLAGS)
    taskset -c "$SERVER_CORE" "$serve_bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --cores "$SERVER_CORE" "${flags[@]}" >"$data/$mode.out" 2>"$data/$mode.log" &
    pids+=("$!")
    wait_listening "$data/$mode.out" "$data/$mode.log"
    addr[$mode]="$listen_addr"
done

gen() {
    local server="$1"; shift
    local proto=quiver
    [ "$server" = redis ] && proto=redis
    taskset -c "$GEN_CORE" "$bin" bench --protocol "$proto" --addr "${addr[$server]}" \
        --connections "$CONNECTIONS" --budget-us 1000000 "$@"
}
for server in $SERVERS; do gen "$server" --duration 1s --rate 10000 --json >/dev/null; done   # warm up

for run in $(seq "$RUNS"); do
    for rate in $RATES; do
        for server in $SERVERS; do
            gen "$server" --duration "$DURATION" --rate "$rate" --json >"$OUT/tail-$server-$rate-$run.json" || true
            python3 -c "import json,sys; r=json.load(open(sys.argv[1])); l=r['latency']; print(f'run {sys.argv[2]} {sys.argv[3]:>6} {sys.argv[4]:>6}/s: p50 {l[\"p50_us\"]:>6} p99 {l[\"p99_us\"]:>7} p99.9 {l[\"p999_us\"]:>7} max {l[\"max_us\"]:>7} µs  achieved {r[\"achieved_rate\"]:.0f}', file=sys.stderr)" \
                "$OUT/tail-$server-$rate-$run.json" "$run" "$server" "$rate"
        done
    done
done

python3 - "$OUT" "$RUNS" "$DURATION" "$CONNECTIONS" "$QUIVER_FLAGS" "$BASE_BIN" "$BASE_FLAGS" "$BASE_LABEL" <<'PY'
import glob, json, os, statistics, sys
out, runs, duration, conns, flags, base = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
base_flags, base_label = sys.argv[7], sys.argv[8]
rows = {}
for f in glob.glob(os.path.join(out, "tail-*-*-*.json")):
    server, rate, run = os.path.basename(f)[5:-5].rsplit("-", 2)
    rows.setdefault((server, int(rate)), []).append(json.load(open(f)))
import subprocess
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
summary = {"runs": runs, "duration": duration, "connections": conns, "quiver_flags": flags,
           "base_bin": base or None, "base_flags": base_flags if base else None,
           "base_label": base_label if base else None, "commit": commit, "rates": {}}
keys = ["p50_us", "p99_us", "p999_us", "max_us"]
for (server, rate), rs in sorted(rows.items()):
    med = {k: statistics.median(r["latency"][k] for r in rs) for k in keys}
    med["achieved_rate"] = statistics.median(r["achieved_rate"] for r in rs)
    med["lost"] = sum(r["lost"] for r in rs)
    med["errors"] = sum(len(r["connection_errors"]) for r in rs)
    med["generator_saturated_runs"] = sum(bool(r["generator_saturated"]) for r in rs)
    summary["rates"].setdefault(str(rate), {})[server] = med
print(f"medians of {runs} runs of {duration}, {conns} connections, one core each")
print(f"{'rate':>7} {'server':>7} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'p99/redis':>9} {'p99.9/redis':>11}")
for rate, by in sorted(summary["rates"].items(), key=lambda kv: int(kv[0])):
    base = by.get("redis")
    for server, m in by.items():
        if base:
            m["p99_ratio_to_redis"] = round(m["p99_us"] / max(base["p99_us"], 1), 2)
            m["p999_ratio_to_redis"] = round(m["p999_us"] / max(base["p999_us"], 1), 2)
        print(f"{rate:>7} {server:>7} {m['p50_us']:>7.0f} {m['p99_us']:>7.0f} {m['p999_us']:>7.0f} {m['max_us']:>7.0f}"
              f" {m.get('p99_ratio_to_redis', float('nan')):>9} {m.get('p999_ratio_to_redis', float('nan')):>11}")
json.dump(summary, open(os.path.join(out, "tail-summary.json"), "w"), indent=1, sort_keys=True)
PY
