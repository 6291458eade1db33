#!/usr/bin/env bash
# What the Open Inference Protocol (KServe v2) front end costs over the
# FlatBuffers port (issue 39), side by side in one run against one server:
# the demo (auction-32) on one shard on core $SERVER_CORE with both v2
# listeners (`--oip-grpc-listen`, `--oip-http-listen`; the front end's
# thread runs on the housekeeping core, $GEN_CORE on a two-core machine),
# and on core $GEN_CORE, for $DURATION seconds per run, closed loop:
#
#   - flatbuffers: `quiver bench --connections 1 --pipeline N`;
#   - v2 gRPC: bench/oip_load.rs, one HTTP/2 connection with N streams in
#     flight, raw tensors (as tritonclient and perf_analyzer send them);
#   - v2 HTTP: bench/oip_load.rs, N HTTP/1.1 connections with one request
#     each, binary tensors (tritonclient.http's default).
#
# Every request is auction-32 shaped (a user, 32 items, 16 context floats);
# every v2 answer is checked (status, 32 scores). Runs interleave; the
# figures are medians over $RUNS runs. Writes
# bench/results/oip_side_by_side.{json,md} (rendered into docs/BENCHMARKS.md
# by bench/report.py).
#
# usage: bench/oip_side_by_side.sh     (RUNS=3 DURATION=3 DEPTHS="1 16")
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
DURATION="${DURATION:-3}"
DEPTHS="${DEPTHS:-1 16}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS=bench/results

BENCH_NAME=oip_side_by_side
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need_two_cores
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain -- src bench/oip_load.rs proto Cargo.toml Cargo.lock)" ]; then
    head="$head+dirty"
fi
load_start="$(cut -d' ' -f1-3 /proc/loadavg)"
bench_setup
load="$(cargo bench --bench oip_load --no-run --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "oip_load" and m.get("executable"):
        print(m["executable"])')"
[ -x "$load" ] || die "bench/oip_load.rs did not build"

"$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --cores "$SERVER_CORE" \
    --oip-grpc-listen 127.0.0.1:0 --oip-http-listen 127.0.0.1:0 >"$data/serve.out" 2>"$data/serve.log" &
pids+=("$!")
wait_listening "$data/serve.out" "$data/serve.log"
addr="$listen_addr"
grpc="$(awk '/oip-grpc on/ {print $4}' "$data/serve.out")"
http="$(awk '/oip-http on/ {print $4}' "$data/serve.out")"
[ -n "$grpc" ] && [ -n "$http" ] || die "the v2 listeners were not announced"

run_one() {
    local protocol="$1" depth="$2"
    case "$protocol" in
        flatbuffers)
            taskset -c "$GEN_CORE" "$bin" bench --addr "$addr" --connections 1 --pipeline "$depth" \
                --duration "${DURATION}s" --budget-us 100000 --json 2>/dev/null |
                python3 -c 'import json,sys
d = json.load(sys.stdin); l = d["latency"]
assert d["received"] > 0 and not d.get("errors"), d
print(json.dumps({"protocol": "flatbuffers", "inflight": int(sys.argv[1]), "requests": d["received"],
                  "seconds": d["duration_s"], "rate": d["achieved_rate"], "p50_us": l["p50_us"],
                  "p99_us": l["p99_us"], "p999_us": l["p999_us"], "max_us": l["max_us"]}))' "$depth"
            ;;
        grpc) taskset -c "$GEN_CORE" "$load" --protocol grpc --addr "$grpc" --depth "$depth" --seconds "$DURATION" ;;
        http) taskset -c "$GEN_CORE" "$load" --protocol http --addr "$http" --depth "$depth" --seconds "$DURATION" ;;
    esac
}

: >"$data/runs.jsonl"
for r in $(seq "$RUNS"); do
    for depth in $DEPTHS; do
        for protocol in flatbuffers grpc http; do
            echo "== run $r: $protocol, $depth in flight"
            run_one "$protocol" "$depth" | sed "s/^{/{\"run\": $r, /" >>"$data/runs.jsonl" \
                || die "$protocol at $depth in flight failed"
        done
    done
done

python3 - "$data/runs.jsonl" "$RESULTS" "$head" "$RUNS" "$DURATION" "$load_start" <<'PY'
import json, os, statistics, sys
runs_path, results, head, repeats, duration, load_start = sys.argv[1:]
load_end = " ".join(open("/proc/loadavg").read().split()[:3])
runs = [json.loads(l) for l in open(runs_path)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
rows = []
for protocol in ["flatbuffers", "grpc", "http"]:
    for depth in sorted({x["inflight"] for x in runs}):
        xs = [x for x in runs if x["protocol"] == protocol and x["inflight"] == depth]
        med = lambda k: statistics.median(x[k] for x in xs)
        rows.append({"protocol": protocol, "inflight": depth, "rate": med("rate"), "p50_us": med("p50_us"),
                     "p99_us": med("p99_us"), "p999_us": med("p999_us"), "runs": len(xs)})
base = {r["inflight"]: r for r in rows if r["protocol"] == "flatbuffers"}
for r in rows:
    r["rate_over_flatbuffers"] = r["rate"] / base[r["inflight"]]["rate"]
    r["p50_over_flatbuffers_us"] = r["p50_us"] - base[r["inflight"]]["p50_us"]
res = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": load_start,
                   "loadavg_at_end": load_end}, "commit": head, "runs": int(repeats),
       "duration_s": float(duration), "rows": rows, "each_run": runs}
json.dump(res, open(f"{results}/oip_side_by_side.json", "w"), indent=1, sort_keys=True)
names = {"flatbuffers": "FlatBuffers (`quiver bench`)", "grpc": "v2 gRPC (`bench/oip_load.rs`)",
         "http": "v2 HTTP, binary tensors (`bench/oip_load.rs`)"}
o = ["## The Open Inference Protocol (KServe v2) beside FlatBuffers", ""]
o.append(f"Measured by `bench/oip_side_by_side.sh` at `{head}` on {cpu} ({os.cpu_count()} vCPUs, shared): one "
         "server with the demo (auction-32) on one shard on core 0 and both v2 listeners, whose front-end thread "
         "runs on the housekeeping core, core 1, beside the load generator; closed loop, "
         f"{duration} s per run, runs interleaved, medians of {repeats} runs. Every request is auction-32 shaped "
         "(a user, 32 items, 16 context floats) and scored by the model. FlatBuffers: one connection with N "
         "requests pipelined. v2 gRPC: one HTTP/2 connection with N streams (raw tensors, as tritonclient and "
         "perf_analyzer send them). v2 HTTP: N HTTP/1.1 connections, one request each (binary tensors, "
         "tritonclient.http's default). Each v2 request is parsed on the front end's thread and sent to the "
         "shard as a FlatBuffers request over loopback, so its latency is FlatBuffers' plus the front end's. "
         f"Load average (1, 5, 15 min) at start {load_start}, at end {load_end}.")
if float(load_start.split()[0]) > os.cpu_count():
    o[-1] += (" The load average was over the core count: other processes held the cores, so the absolute figures "
              "are the contention's as much as Quiver's (the spinning FlatBuffers generator suffers most from it); "
              "the differences within one run are what this table is for.")
o.append("")
o.append("| protocol | in flight | requests/s | × FlatBuffers' rate | p50 µs | p50 over FlatBuffers µs | p99 µs | p99.9 µs |")
o.append("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    o.append(f"| {names[r['protocol']]} | {r['inflight']} | {r['rate']:,.0f} | {r['rate_over_flatbuffers']:.2f} | "
             f"{r['p50_us']:.0f} | {r['p50_over_flatbuffers_us']:+.0f} | {r['p99_us']:.0f} | {r['p999_us']:.0f} |")
o.append("")
o.append("perf_analyzer (PyPI `perf-analyzer`) was not run here: its wheels need glibc 2.38, this machine has 2.36; "
         "the README shows the command for a machine that runs it.")
open(f"{results}/oip_side_by_side.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
