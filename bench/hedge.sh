#!/usr/bin/env bash
# Hedged requests across three nodes, one of them slow: what the multi-node
# client (`quiver bench --addr a,b,c`) sees with hedging off, after a fixed
# delay, and after the node's p95, beside three healthy nodes.
#
# Three `quiver serve` processes (one shard each, inference thread, the
# fault hook on), all on core $SERVER_CORE; the third node's inference
# stage is delayed by $SLOW_US µs per batch (POST /faults). The generator
# runs on core $GEN_CORE: open loop at $RATE req/s for $DURATION, budget
# $BUDGET_US µs, 32 candidates. Each setting is run $REPEATS times,
# interleaved; figures are medians over the repeats.
#
# Writes bench/results/hedge.json and bench/results/hedge.md (rendered into
# docs/BENCHMARKS.md by bench/report.py).
#
# usage: bench/hedge.sh
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-3000}"
DURATION="${DURATION:-5s}"
REPEATS="${REPEATS:-3}"
SLOW_US="${SLOW_US:-3000}"
HEDGE_AFTER_US="${HEDGE_AFTER_US:-1500}"
BUDGET_US="${BUDGET_US:-50000}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results
BENCH_NAME=hedge
# shellcheck source=bench/lib.sh
. bench/lib.sh

need taskset util-linux
need curl curl
need_two_cores
bench_setup
mkdir -p "$RESULTS"
printf 'inference = "thread"\nfaults_endpoint = true\n' >"$data/q.toml"

addrs=()
admins=()
for k in 0 1 2; do
    out="$data/serve-$k.out"
    taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --config "$data/q.toml" --listen 127.0.0.1:0 \
        --admin 127.0.0.1:0 --shards 1 --cores "$SERVER_CORE" >"$out" 2>"$data/serve-$k.log" &
    pids+=("$!")
    wait_listening "$out" "$data/serve-$k.log"
    addrs+=("$listen_addr")
    admins+=("$admin_addr")
done
list="$(IFS=,; echo "${addrs[*]}")"
slow() { curl -fsS -X POST "http://${admins[2]}/faults?stage_delay_us=$1" >/dev/null; }
gen() {
    local duration="$1"
    shift
    taskset -c "$GEN_CORE" "$bin" bench --addr "$list" --rate "$RATE" --duration "$duration" \
        --budget-us "$BUDGET_US" --connections 1 --json "$@"
}
gen 1s >/dev/null   # warm up

SETTINGS=(healthy slow-off slow-after slow-p95)
for r in $(seq "$REPEATS"); do
    for s in "${SETTINGS[@]}"; do
        echo "== repeat $r: $s"
        case "$s" in
            healthy) slow 0; gen "$DURATION" >"$data/$s-$r.json" ;;
            slow-off) slow "$SLOW_US"; gen "$DURATION" >"$data/$s-$r.json" ;;
            slow-after) slow "$SLOW_US"; gen "$DURATION" --hedge-after-us "$HEDGE_AFTER_US" >"$data/$s-$r.json" ;;
            slow-p95) slow "$SLOW_US"; gen "$DURATION" --hedge-p95 >"$data/$s-$r.json" ;;
        esac
    done
done
slow 0

python3 - "$data" "$RESULTS" "$REPEATS" "$RATE" "$DURATION" "$SLOW_US" "$HEDGE_AFTER_US" "$BUDGET_US" <<'PY'
import json, os, statistics, subprocess, sys
data, results, repeats, rate, duration, slow_us, after_us, budget_us = sys.argv[1:]
repeats = int(repeats)
settings = {
    "healthy": "three healthy nodes, no hedging",
    "slow-off": f"node 3 slowed by {slow_us} µs a batch, no hedging",
    "slow-after": f"node 3 slowed, hedge after {after_us} µs",
    "slow-p95": "node 3 slowed, hedge after the node's p95",
}
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
med = statistics.median
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "commit": commit,
       "settings": {"rate": float(rate), "duration": duration, "repeats": repeats, "slow_us": int(slow_us),
                    "hedge_after_us": int(after_us), "budget_us": int(budget_us)}, "runs": {}}
for s in settings:
    runs = [json.load(open(f"{data}/{s}-{r}.json")) for r in range(1, repeats + 1)]
    for r in runs:
        bad = {k: v for k, v in r["by_status"].items() if k != "ok"}
        if r["failed"] or bad:
            sys.exit(f"hedge: {s}: requests not answered Ok: {r['failed']} {bad}")
    lat = lambda k: med([x["latency"][k] for x in runs])
    share = [med([x["nodes"][k]["won"] / max(1, x["received"]) for x in runs]) for k in range(3)]
    sent = [med([x["nodes"][k]["sent"] / max(1, sum(n["sent"] for n in x["nodes"])) for x in runs]) for k in range(3)]
    res["runs"][s] = {"p50_us": lat("p50_us"), "p99_us": lat("p99_us"), "p999_us": lat("p999_us"),
                      "max_us": lat("max_us"), "hedge_rate": med([x["hedge_rate"] for x in runs]),
                      "hedges_denied_rate": med([x["hedges_denied"] / max(1, x["sent"]) for x in runs]),
                      "node_share": share, "node_sent_share": sent,
                      "p99_each": [x["latency"]["p99_us"] for x in runs]}
json.dump(res, open(f"{results}/hedge.json", "w"), indent=1, sort_keys=True)
o = ["## Hedged requests across three nodes", ""]
o.append(f"Measured by `bench/hedge.sh` at `{commit}` on {cpu} ({os.cpu_count()} vCPUs): three `quiver serve` "
         "processes (one shard, inference thread) on core 0, the multi-node client (`quiver bench --addr a,b,c`) on "
         f"core 1, open loop at {float(rate):,.0f} req/s for {duration}, budget {int(budget_us):,} µs, 32 candidates. "
         f"Node 3's inference stage is delayed {slow_us} µs a batch through the fault hook. Medians over {repeats} "
         "interleaved repeats; latency from each request's intended send time.")
o.append("")
o.append("| setting | p50 (µs) | p99 (µs) | p99.9 (µs) | max (µs) | hedges | hedges over budget | sent to node 3 "
         "| answered by node 3 |")
o.append("|---|---|---|---|---|---|---|---|---|")
for s, what in settings.items():
    x = res["runs"][s]
    o.append(f"| {what} | {x['p50_us']:.0f} | {x['p99_us']:.0f} | {x['p999_us']:.0f} | {x['max_us']:.0f} | "
             f"{x['hedge_rate'] * 100:.1f}% | {x['hedges_denied_rate'] * 100:.1f}% | "
             f"{x['node_sent_share'][2] * 100:.1f}% | {x['node_share'][2] * 100:.1f}% |")
o.append("")
h, off, after, p95 = (res["runs"][k] for k in ["healthy", "slow-off", "slow-after", "slow-p95"])
o.append(f"p99 with the slow node, against the healthy cluster's: {off['p99_us'] / h['p99_us']:.2f}x without "
         f"hedging, {after['p99_us'] / h['p99_us']:.2f}x hedging after {after_us} µs, {p95['p99_us'] / h['p99_us']:.2f}x "
         "hedging after the p95 (each repeat's p99 is in `bench/results/hedge.json`). Hedges are capped at 5% of "
         "requests; \"hedges over budget\" are the ones due that the cap refused. \"Sent to node 3\" counts every "
         "attempt the balancer gave it; \"answered by node 3\" the requests its answer completed.")
best = min(after["p99_us"], p95["p99_us"])
if best < 0.9 * off["p99_us"]:
    o.append(f"Hedging brought the p99 with a slow node from {off['p99_us']:,.0f} µs to {best:,.0f} µs "
             f"({off['p99_us'] / best:.2f}x lower); the healthy cluster's is {h['p99_us']:,.0f} µs.")
elif off["node_sent_share"][2] < 0.01:
    o.append(f"Hedging did not lower the p99 further ({off['p99_us']:,.0f} µs without, {best:,.0f} µs at best with): "
             f"the balancer already sends the slow node {off['node_sent_share'][2] * 100:.1f}% of requests, so the "
             "requests it slows lie beyond the p99. What hedging changes is who answers them: node 3 answered "
             f"{off['node_share'][2] * 100:.1f}% of requests without hedging and {after['node_share'][2] * 100:.1f}% "
             f"with hedges after {after_us} µs.")
else:
    o.append(f"Hedging did not bring the p99 down in this run ({off['p99_us']:,.0f} µs without, {best:,.0f} µs at "
             "best with).")
open(f"{results}/hedge.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
