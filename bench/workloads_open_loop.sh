#!/usr/bin/env bash
# The built-in workloads side by side in open loop (issue 33: "Open loop, one
# shard: both new workloads beside auction-32 at 10k and 30k req/s"): for
# each workload, `quiver demo --workload W` builds it, `quiver serve --demo
# --workload W` serves it on one shard pinned to core $SERVER_CORE, and
# `quiver bench --workload W --rate R` (the open-loop generator: fixed
# arrival times, latency measured from each request's intended send time, so
# coordinated omission is corrected) drives it from core $GEN_CORE over two
# connections, $RUNS runs of $DURATION per rate, alternating workloads
# within each run so both see the same machine.
#
# - auction-32: a user and 32 candidate items (1 + 32 lookups), the INT8 MLP;
# - fraud: one card payment over five request-scope groups (two keyed by
#   strings), the LightGBM model;
# - auction: a user, a device and a publisher, and 32 ads whose campaign and
#   advertiser rows the shard reaches through the replicas' links (3 + 32 × 3
#   lookups), an MLP.
#
# Figures are medians over the runs. Writes
# bench/results/workloads_open_loop.{json,md} (rendered into
# docs/BENCHMARKS.md by bench/report.py).
#
# usage: bench/workloads_open_loop.sh   (RATES="10000 30000" RUNS=3 DURATION=10s)
set -euo pipefail
cd "$(dirname "$0")/.."

RATES="${RATES:-10000 30000}"
RUNS="${RUNS:-3}"
DURATION="${DURATION:-10s}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results
WORKLOADS="auction-32 fraud auction"

BENCH_NAME=workloads_open_loop
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need_two_cores
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain -- src Cargo.toml Cargo.lock)" ]; then
    die "commit first (the figures name HEAD, $head)"
fi
cargo build --release --quiet
bin=target/release/quiver
# bench_cleanup (bench/lib.sh) stops every server in $pids and removes $data.
data="$(mktemp -d)"
work="$data"
pids=()
trap bench_cleanup EXIT
mkdir -p "$RESULTS"

declare -A addr
for w in $WORKLOADS; do
    mkdir -p "$work/$w"
    "$bin" demo --workload "$w" --data-dir "$work/$w/data" >/dev/null 2>&1
    "$bin" serve --demo --workload "$w" --data-dir "$work/$w/data" --listen 127.0.0.1:0 --admin off \
        --shards 1 --cores "$SERVER_CORE" >"$work/$w/out" 2>"$work/$w/log" &
    pids+=($!)
    wait_listening "$work/$w/out" "$work/$w/log"
    addr[$w]="$listen_addr"
done

for r in $(seq "$RUNS"); do
    for rate in $RATES; do
        for w in $WORKLOADS; do
            echo "== run $r: $w at $rate req/s"
            taskset -c "$GEN_CORE" "$bin" bench --addr "${addr[$w]}" --workload "$w" --rate "$rate" \
                --duration "$DURATION" --connections 2 --json >"$work/$w-$rate-$r.json" 2>/dev/null
        done
    done
done

python3 - "$work" "$RESULTS" "$RUNS" "$head" "$RATES" "$WORKLOADS" "$DURATION" <<'PY'
import json, os, statistics, sys
work, results, runs, head, rates, workloads, duration = sys.argv[1:]
runs, rates, workloads = int(runs), [int(r) for r in rates.split()], workloads.split()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
rows = []
for rate in rates:
    for w in workloads:
        each = [json.load(open(f"{work}/{w}-{rate}-{r}.json")) for r in range(1, runs + 1)]
        med = lambda f: statistics.median(f(x) for x in each)
        rows.append({
            "workload": w, "rate": rate,
            "achieved_rate": med(lambda x: x["achieved_rate"]),
            "p50_us": med(lambda x: x["latency"]["p50_us"]),
            "p99_us": med(lambda x: x["latency"]["p99_us"]),
            "p999_us": med(lambda x: x["latency"]["p999_us"]),
            "max_us": med(lambda x: x["latency"]["max_us"]),
            "ok_share": med(lambda x: x["by_status"].get("ok", 0) / max(1, x["sent"])),
            # `connection_errors` lists each error met.
            "lost": sum(x["lost"] + len(x["connection_errors"]) for x in each),
            "generator_saturated": any(x["generator_saturated"] for x in each),
            "each": [x["latency"] for x in each],
        })
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "commit": head, "runs": runs, "duration": duration,
       "rows": rows}
json.dump(res, open(f"{results}/workloads_open_loop.json", "w"), indent=1, sort_keys=True)
o = ["## The built-in workloads in open loop", ""]
o.append(f"Measured by `bench/workloads_open_loop.sh` at `{head}` on {cpu} ({os.cpu_count()} vCPUs): each "
         "workload's demo served by one shard on core 0, `quiver bench --workload W --rate R` (open loop, "
         "latency from each request's intended send time) on core 1 over two connections, "
         f"{runs} runs of {duration} per rate, medians over the runs. auction-32: a user and 32 candidate items "
         "(1 + 32 lookups), the INT8 MLP; fraud: one card payment over five request-scope groups, two keyed by "
         "strings, the LightGBM model; auction: a user, a device and a publisher and 32 ads, each ad's campaign "
         "and advertiser reached through the replicas' links (3 + 32 × 3 lookups), an MLP.")
o.append("")
o.append("| workload | offered (req/s) | achieved (req/s) | p50 (µs) | p99 (µs) | p99.9 (µs) | max (µs) | Ok |")
o.append("|---|---:|---:|---:|---:|---:|---:|---:|")
for x in rows:
    o.append(f"| {x['workload']} | {x['rate']} | {x['achieved_rate']:.0f} | {x['p50_us']:.0f} | {x['p99_us']:.0f} | "
             f"{x['p999_us']:.0f} | {x['max_us']:.0f} | {100 * x['ok_share']:.1f}% |")
notes = []
if any(x["lost"] for x in rows):
    notes.append("Some runs lost requests or connections (see the JSON).")
if any(x["generator_saturated"] for x in rows):
    notes.append("The generator saturated its core in some runs: those rates are lower bounds of what it offered.")
if notes:
    o += [""] + notes
open(f"{results}/workloads_open_loop.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
