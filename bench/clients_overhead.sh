#!/usr/bin/env bash
# What each client costs (issue 38: "each one's overhead measured:
# closed-loop requests/s and p99 at 1 and 16 in flight against the protocol
# floor, beside the Rust client"), side by side in one run: one protocol
# floor server (`serve --floor`: verify each request, answer an empty Ok)
# on core $SERVER_CORE, and on core $GEN_CORE, one connection each, for
# $DURATION seconds per run, one after another:
#
#   - rust: `quiver bench --connections 1 --pipeline N` (closed loop);
#   - python: bench/clients/py_driver.py (the blocking client at 1 in
#     flight, the asyncio client with N tasks at N);
#   - node: bench/clients/node_driver.mjs (N async loops);
#   - cpp: clients/cpp's bench_client (one call at a time at 1; batches of
#     N through score_many at N, so a request's latency is its batch's).
#
# Every request is the same auction-32-shaped frame (a user, 32 items, 16
# context floats). Runs interleave (run 1 of every client and depth, then
# run 2, ...); the figures are medians over $RUNS runs. Writes
# bench/results/clients_overhead.{json,md} (rendered into docs/BENCHMARKS.md
# by bench/report.py).
#
# usage: bench/clients_overhead.sh     (RUNS=3 DURATION=3 DEPTHS="1 16")
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
DURATION="${DURATION:-3}"
DEPTHS="${DEPTHS:-1 16}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results

BENCH_NAME=clients_overhead
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need node nodejs
need npm npm
need cmake cmake
need_two_cores
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain -- src clients bench/clients Cargo.toml Cargo.lock)" ]; then
    head="$head+dirty"
fi
bench_setup
python3 -c "import quiver_client" 2>/dev/null || die "the Python client is not installed: pip install ./clients/python"
(cd clients/node && npm ci --no-audit --no-fund --loglevel=error && npm run --silent build) \
    || die "clients/node did not build"
cmake -S clients/cpp -B "$data/cpp" -DBUILD_TESTING=OFF >/dev/null || die "clients/cpp did not configure"
cmake --build "$data/cpp" -j2 --target bench_client >/dev/null || die "clients/cpp's bench_client did not build"

taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --cores "$SERVER_CORE" --floor >"$data/floor.out" 2>"$data/floor.log" &
pids+=("$!")
wait_listening "$data/floor.out" "$data/floor.log"
addr="$listen_addr"

run_client() {
    local client="$1" depth="$2"
    case "$client" in
        rust)
            taskset -c "$GEN_CORE" "$bin" bench --addr "$addr" --connections 1 --pipeline "$depth" \
                --duration "${DURATION}s" --budget-us 100000 --json 2>/dev/null |
                python3 -c 'import json,sys
d = json.load(sys.stdin); l = d["latency"]
print(json.dumps({"client": "rust", "inflight": int(sys.argv[1]), "requests": d["received"],
                  "seconds": d["duration_s"], "rate": d["achieved_rate"], "p50_us": l["p50_us"],
                  "p99_us": l["p99_us"], "p999_us": l["p999_us"], "max_us": l["max_us"]}))' "$depth"
            ;;
        python) taskset -c "$GEN_CORE" python3 bench/clients/py_driver.py "$addr" "$depth" "$DURATION" ;;
        node) taskset -c "$GEN_CORE" node bench/clients/node_driver.mjs "$addr" "$depth" "$DURATION" ;;
        cpp) taskset -c "$GEN_CORE" "$data/cpp/bench_client" "$addr" "$depth" "$DURATION" ;;
    esac
}

: >"$data/runs.jsonl"
for r in $(seq "$RUNS"); do
    for depth in $DEPTHS; do
        for client in rust cpp node python; do
            echo "== run $r: $client, $depth in flight"
            run_client "$client" "$depth" | sed "s/^{/{\"run\": $r, /" >>"$data/runs.jsonl" \
                || die "$client at $depth in flight failed"
        done
    done
done

python3 - "$data/runs.jsonl" "$RESULTS" "$head" "$RUNS" "$DURATION" <<'PY'
import json, os, statistics, subprocess, sys
runs_path, results, head, repeats, duration = sys.argv[1:]
runs = [json.loads(l) for l in open(runs_path)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
versions = {
    "python": sys.version.split()[0],
    "node": subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip(),
    "gcc": subprocess.run(["g++", "-dumpfullversion"], capture_output=True, text=True).stdout.strip(),
}
rows = []
for client in ["rust", "cpp", "node", "python"]:
    for depth in sorted({x["inflight"] for x in runs}):
        xs = [x for x in runs if x["client"] == client and x["inflight"] == depth]
        med = lambda k: statistics.median(x[k] for x in xs)
        rows.append({"client": client, "inflight": depth, "rate": med("rate"), "p50_us": med("p50_us"),
                     "p99_us": med("p99_us"), "p999_us": med("p999_us"), "runs": len(xs)})
rust = {r["inflight"]: r for r in rows if r["client"] == "rust"}
for r in rows:
    r["rate_over_rust"] = r["rate"] / rust[r["inflight"]]["rate"]
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "commit": head, "runs": int(repeats),
       "duration_s": float(duration), "versions": versions, "rows": rows, "each_run": runs}
json.dump(res, open(f"{results}/clients_overhead.json", "w"), indent=1, sort_keys=True)
names = {"rust": "Rust (`quiver bench`)", "cpp": "C++ (`clients/cpp`)", "node": "Node.js (`clients/node`)",
         "python": "Python (`clients/python`)"}
o = ["## Client overhead against the protocol floor", ""]
o.append(f"Measured by `bench/clients_overhead.sh` at `{head}` on {cpu} ({os.cpu_count()} vCPUs, shared): one "
         "protocol-floor server (`quiver serve --floor`: each request verified and answered with an empty Ok) on "
         "core 0, each client on core 1 over one connection, closed loop, "
         f"{duration} s per run, runs interleaved, medians of {repeats} runs. The same auction-32-shaped request "
         "(a user, 32 items, 16 context floats) throughout. At 16 in flight the Rust, Node.js and Python clients "
         "keep 16 requests outstanding (Python: its asyncio client, one task per slot); the C++ client sends "
         "batches of 16 through `score_many` and waits for each whole batch, so its latency is the batch's. "
         f"Python {versions['python']}, Node.js {versions['node']}, g++ {versions['gcc']}.")
o.append("")
o.append("| client | in flight | requests/s | × Rust's rate | p50 µs | p99 µs | p99.9 µs |")
o.append("|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    o.append(f"| {names[r['client']]} | {r['inflight']} | {r['rate']:,.0f} | {r['rate_over_rust']:.2f} | "
             f"{r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['p999_us']:.0f} |")
open(f"{results}/clients_overhead.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
