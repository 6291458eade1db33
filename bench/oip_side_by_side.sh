#!/usr/bin/env bash
# What the Open Inference Protocol (KServe v2) front end costs over the
# FlatBuffers port (issue 39), side by side in one run against one server:
# the demo (auction-32) on one shard on core $SERVER_CORE with both v2
# listeners (`--oip-grpc-listen`, `--oip-http-listen`; the front end's
# thread runs on the housekeeping core, $GEN_CORE on a two-core machine),
# beside a second server with `--floor` (the protocol floor: FlatBuffers
# framing and the reactor, no lookup or scoring), and on core $GEN_CORE,
# for $DURATION seconds per run:
#
#   - floor, flatbuffers: `quiver bench --connections 1 --pipeline N`
#     (closed loop) and `quiver bench --rate $OPEN_RATE` (open loop,
#     latency from each request's intended send time);
#   - v2 gRPC: bench/oip_load.rs, one HTTP/2 connection with N streams in
#     flight, raw tensors (as tritonclient and perf_analyzer send them);
#   - v2 HTTP: bench/oip_load.rs, N HTTP/1.1 connections with one request
#     each, binary tensors (tritonclient.http's default);
#   - perf_analyzer (Triton's own load generator, $PERF_ANALYZER) over v2
#     gRPC and HTTP: `--concurrency-range N:N` (closed loop) and
#     `--request-rate-range $OPEN_RATE` (open loop, constant intervals;
#     latency from each request's actual send), each measured over its own
#     stable windows of $DURATION s (at least three), with its throughput
#     and p50/p99; p99.9 is computed from its `--profile-export-file` over
#     the same windows.
#
# Every request is auction-32 shaped (a user, 32 items, 16 context floats;
# perf_analyzer sends zeros, `--input-data zero`); every v2 answer is
# checked (status, 32 scores; perf_analyzer fails on an error). Runs
# interleave; the figures are medians over $RUNS runs. Writes
# bench/results/oip_side_by_side.{json,md} (rendered into docs/BENCHMARKS.md
# by bench/report.py).
#
# perf_analyzer: PERF_ANALYZER=path (default: perf_analyzer on the PATH;
# README, "Triton's clients against Quiver", says how to get one that runs
# on glibc 2.36); PERF_ANALYZER=off leaves its rows out. PA_STABILITY and
# PA_MAX_TRIALS are its --stability-percentage (10: three windows within
# 10%) and --max-trials (10); a run that does not stabilise fails. OPEN_RATE=
# (empty) leaves the open-loop rows out.
#
# usage: bench/oip_side_by_side.sh     (RUNS=3 DURATION=3 DEPTHS="1 16" OPEN_RATE=10000 RESULTS=bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
DURATION="${DURATION:-3}"
DEPTHS="${DEPTHS:-1 16}"
OPEN_RATE="${OPEN_RATE-10000}"
PERF_ANALYZER="${PERF_ANALYZER:-$(command -v perf_analyzer || true)}"
PA_STABILITY="${PA_STABILITY:-10}"
PA_MAX_TRIALS="${PA_MAX_TRIALS:-10}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
RESULTS="${RESULTS:-bench/results}"

BENCH_NAME=oip_side_by_side
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need_two_cores
if [ "$PERF_ANALYZER" != off ]; then
    [ -n "$PERF_ANALYZER" ] && [ -x "$PERF_ANALYZER" ] \
        || die "perf_analyzer not found: set PERF_ANALYZER=path (README: \"Triton's clients against Quiver\") or PERF_ANALYZER=off"
    pa_version="$("$PERF_ANALYZER" --version 2>&1 | tail -1)"
    [[ "$pa_version" == "Perf Analyzer Version"* ]] || die "$PERF_ANALYZER does not run: $pa_version"
else
    pa_version=off
fi
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

# perf_analyzer sends no budget over HTTP (its --request-parameter is
# gRPC-only): the default budget is the 100 ms every other generator sends.
printf '[limits]\nbudget_us_default = 100000\n' >"$data/oip.toml"
"$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --cores "$SERVER_CORE" \
    --config "$data/oip.toml" --oip-grpc-listen 127.0.0.1:0 --oip-http-listen 127.0.0.1:0 >"$data/serve.out" 2>"$data/serve.log" &
pids+=("$!")
wait_listening "$data/serve.out" "$data/serve.log"
addr="$listen_addr"
grpc="$(awk '/oip-grpc on/ {print $4}' "$data/serve.out")"
http="$(awk '/oip-http on/ {print $4}' "$data/serve.out")"
[ -n "$grpc" ] && [ -n "$http" ] || die "the v2 listeners were not announced"
"$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --cores "$SERVER_CORE" --floor \
    >"$data/floor.out" 2>"$data/floor.log" &
pids+=("$!")
wait_listening "$data/floor.out" "$data/floor.log"
floor="$listen_addr"

# quiver bench's report as a row: $1 the protocol, $2 the load ("closed N"
# or "open R").
bench_row() {
    python3 -c 'import json,sys
d = json.load(sys.stdin); l = d["latency"]
assert d["received"] > 0 and not d.get("errors"), d
mode, n = sys.argv[2].split()
print(json.dumps({"protocol": sys.argv[1], "mode": mode, "load": int(n), "requests": d["received"],
                  "seconds": d["duration_s"], "rate": d["achieved_rate"], "p50_us": l["p50_us"],
                  "p99_us": l["p99_us"], "p999_us": l["p999_us"], "max_us": l["max_us"]}))' "$1" "$2"
}

# perf_analyzer against the v2 port: $1 grpc or http, $2 the load.
perf_analyzer_row() {
    local protocol="$1" mode="$2" n="$3" url="$grpc" range=(--concurrency-range "$3:$3")
    [ "$protocol" = http ] && url="$http"
    [ "$mode" = open ] && range=(--request-rate-range "$n:$n" --request-distribution constant)
    rm -f "$data/pa.csv" "$data/pa.json"
    taskset -c "$GEN_CORE" "$PERF_ANALYZER" -m auction-32 -u "$url" -i "$protocol" --shape item_ids:32 \
        --input-data zero "${range[@]}" --measurement-interval "$((DURATION * 1000))" \
        --stability-percentage "$PA_STABILITY" --max-trials "$PA_MAX_TRIALS" \
        -f "$data/pa.csv" --profile-export-file "$data/pa.json" >"$data/pa.out" 2>&1 \
        || { tail -20 "$data/pa.out" >&2; return 1; }
    python3 - "$data/pa.csv" "$data/pa.json" "pa-$protocol" "$mode" "$n" <<'PY'
import csv, json, sys
csv_path, export_path, protocol, mode, n = sys.argv[1:]
row = next(csv.DictReader(open(csv_path)))
exp = json.load(open(export_path))["experiments"][-1]
# The export holds the requests of the windows perf_analyzer reported on
# (its last three, the stability window): p99.9 over them.
bounds = exp["window_boundaries"]
lo, hi = bounds[max(0, len(bounds) - 4)], bounds[-1]
lat = sorted(r["response_timestamps"][-1] - r["timestamp"] for r in exp["requests"] if r["response_timestamps"])
assert lat, "perf_analyzer's export has no request"
p999 = lat[min(len(lat) - 1, int(len(lat) * 0.999))] / 1000
print(json.dumps({"protocol": protocol, "mode": mode, "load": int(n), "requests": len(lat),
                  "seconds": (hi - lo) / 1e9, "rate": float(row["Inferences/Second"]),
                  "p50_us": float(row["p50 latency"]), "p99_us": float(row["p99 latency"]),
                  "p999_us": p999, "max_us": lat[-1] / 1000}))
PY
}

run_one() {
    local protocol="$1" mode="$2" n="$3"
    case "$protocol/$mode" in
        floor/closed | flatbuffers/closed)
            local target="$addr"
            [ "$protocol" = floor ] && target="$floor"
            taskset -c "$GEN_CORE" "$bin" bench --addr "$target" --connections 1 --pipeline "$n" \
                --duration "${DURATION}s" --budget-us 100000 --json 2>/dev/null | bench_row "$protocol" "closed $n"
            ;;
        floor/open | flatbuffers/open)
            local target="$addr"
            [ "$protocol" = floor ] && target="$floor"
            taskset -c "$GEN_CORE" "$bin" bench --addr "$target" --rate "$n" \
                --duration "${DURATION}s" --budget-us 100000 --json 2>/dev/null | bench_row "$protocol" "open $n"
            ;;
        grpc/closed | http/closed)
            taskset -c "$GEN_CORE" "$load" --protocol "$protocol" --addr "$([ "$protocol" = grpc ] && echo "$grpc" || echo "$http")" \
                --depth "$n" --seconds "$DURATION" |
                python3 -c 'import json,sys
d = json.loads(sys.stdin.read()); n = d.pop("inflight")
print(json.dumps({**d, "mode": "closed", "load": n}))'
            ;;
        pa-grpc/*) perf_analyzer_row grpc "$mode" "$n" ;;
        pa-http/*) perf_analyzer_row http "$mode" "$n" ;;
    esac
}

protocols=(floor flatbuffers grpc http)
[ "$PERF_ANALYZER" != off ] && protocols+=(pa-grpc pa-http)
loads=()
for depth in $DEPTHS; do loads+=("closed $depth"); done
[ -n "$OPEN_RATE" ] && loads+=("open $OPEN_RATE")
: >"$data/runs.jsonl"
for r in $(seq "$RUNS"); do
    for l in "${loads[@]}"; do
        for protocol in "${protocols[@]}"; do
            # bench/oip_load.rs has no open loop: perf_analyzer's rows are the v2 ones there.
            [ "${l%% *}" = open ] && { [ "$protocol" = grpc ] || [ "$protocol" = http ]; } && continue
            echo "== run $r: $protocol, $l"
            # shellcheck disable=SC2086 # "closed 16" is two words
            row="$(run_one "$protocol" $l)" || die "$protocol at $l failed"
            echo "$row" | sed "s/^{/{\"run\": $r, /" >>"$data/runs.jsonl"
        done
    done
done

python3 - "$data/runs.jsonl" "$RESULTS" "$head" "$RUNS" "$DURATION" "$load_start" "$pa_version" "$PA_STABILITY" <<'PY'
import json, os, statistics, sys
runs_path, results, head, repeats, duration, load_start, pa_version, pa_stability = sys.argv[1:]
load_end = " ".join(open("/proc/loadavg").read().split()[:3])
runs = [json.loads(l) for l in open(runs_path)]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
order = ["floor", "flatbuffers", "grpc", "http", "pa-grpc", "pa-http"]
loads = sorted({(x["mode"], x["load"]) for x in runs}, key=lambda m: (m[0] != "closed", m[1]))
rows = []
for mode, load in loads:
    for protocol in order:
        xs = [x for x in runs if x["protocol"] == protocol and x["mode"] == mode and x["load"] == load]
        if not xs:
            continue
        med = lambda k: statistics.median(x[k] for x in xs)
        rows.append({"protocol": protocol, "mode": mode, "load": load, "rate": med("rate"), "p50_us": med("p50_us"),
                     "p99_us": med("p99_us"), "p999_us": med("p999_us"), "runs": len(xs)})
base = {(r["mode"], r["load"]): r for r in rows if r["protocol"] == "flatbuffers"}
for r in rows:
    b = base[(r["mode"], r["load"])]
    r["rate_over_flatbuffers"] = r["rate"] / b["rate"]
    r["p50_over_flatbuffers_us"] = r["p50_us"] - b["p50_us"]
res = {"machine": {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": load_start,
                   "loadavg_at_end": load_end}, "commit": head, "runs": int(repeats),
       "duration_s": float(duration), "perf_analyzer": pa_version, "rows": rows, "each_run": runs}
json.dump(res, open(f"{results}/oip_side_by_side.json", "w"), indent=1, sort_keys=True)
names = {"floor": "protocol floor (`serve --floor`, `quiver bench`)", "flatbuffers": "FlatBuffers (`quiver bench`)",
         "grpc": "v2 gRPC (`bench/oip_load.rs`)", "http": "v2 HTTP, binary tensors (`bench/oip_load.rs`)",
         "pa-grpc": "v2 gRPC (perf_analyzer)", "pa-http": "v2 HTTP (perf_analyzer)"}
o = ["## The Open Inference Protocol (KServe v2) beside FlatBuffers", ""]
o.append(f"Measured by `bench/oip_side_by_side.sh` at `{head}` on {cpu} ({os.cpu_count()} vCPUs, shared): one "
         "server with the demo (auction-32) on one shard on core 0 and both v2 listeners, whose front-end thread "
         "runs on the housekeeping core, core 1, beside the load generator, and a second server with `--floor` "
         "(FlatBuffers framing and the reactor, no lookup or scoring) on core 0; "
         f"{duration} s per run, runs interleaved, medians of {repeats} runs. Every request is auction-32 shaped "
         "(a user, 32 items, 16 context floats) and scored by the model. Closed loop, N in flight: FlatBuffers, one "
         "connection with N requests pipelined; v2 gRPC, one HTTP/2 connection with N streams (raw tensors, as "
         "tritonclient and perf_analyzer send them); v2 HTTP, N HTTP/1.1 connections, one request each (binary "
         "tensors, tritonclient.http's default); perf_analyzer, `--concurrency-range N:N`. Open loop: `quiver bench "
         "--rate` (latency from each request's intended send time) and perf_analyzer `--request-rate-range` with "
         "constant intervals (latency from each request's actual send, so a generator that falls behind hides "
         "queueing). perf_analyzer's rows are its own throughput, p50 and p99 over the stable windows it reports "
         f"(at least three of {duration} s within {pa_stability}% of each other, inputs `--input-data zero`), with "
         f"p99.9 from its profile export over the same windows ({pa_version}). Every request has a budget of 100 ms "
         "(perf_analyzer's through the server's `budget_us_default`). Each v2 request is parsed on the front end's thread and sent to the "
         "shard as a FlatBuffers request over loopback, so its latency is FlatBuffers' plus the front end's. "
         f"Load average (1, 5, 15 min) at start {load_start}, at end {load_end}.")
if float(load_start.split()[0]) > os.cpu_count():
    o[-1] += (" The load average was over the core count: other processes held the cores, so the absolute figures "
              "are the contention's as much as Quiver's (the spinning FlatBuffers generator suffers most from it); "
              "the differences within one run are what this table is for.")
o.append("")
o.append("| protocol | load | requests/s | × FlatBuffers' rate | p50 µs | p50 over FlatBuffers µs | p99 µs | p99.9 µs |")
o.append("|---|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    load = f"{r['load']} in flight" if r["mode"] == "closed" else f"open, {r['load']:,}/s offered"
    o.append(f"| {names[r['protocol']]} | {load} | {r['rate']:,.0f} | {r['rate_over_flatbuffers']:.2f} | "
             f"{r['p50_us']:.0f} | {r['p50_over_flatbuffers_us']:+.0f} | {r['p99_us']:.0f} | {r['p999_us']:.0f} |")
o.append("")
if pa_version == "off":
    o.append("perf_analyzer was left out of this run (`PERF_ANALYZER=off`).")
o.append("Triton's own server is not in the table: the only tritonserver binary PyPI offers for this glibc (inside "
         "`nvidia-pytriton` 0.7.0) carries the Python backend alone, so it cannot serve this model as Triton users "
         "would.")
open(f"{results}/oip_side_by_side.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
