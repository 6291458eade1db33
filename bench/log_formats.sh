#!/usr/bin/env bash
# The decision log's file format, measured on the demo's real features: a
# server logs every decision of an open-loop auction-32 load into Arrow IPC
# segments (the format it writes), and `cargo bench --bench log_formats`
# encodes those decisions again, in memory, as Arrow IPC (LZ4, as written,
# and uncompressed) and as Parquet (Snappy, Spark's default, and
# uncompressed): CPU time and bytes per decision for each, the cost of the
# encoding alone (the rest of the writer's work is the same for any
# format). Writes $OUT/log_formats.json and $OUT/log_formats.md, which
# bench/report.py copies into docs/BENCHMARKS.md.
#
# usage: bench/log_formats.sh     (RATE=3000 DURATION=5s REPEAT=5 OUT=bench/results)
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-3000}"
DURATION="${DURATION:-5s}"
REPEAT="${REPEAT:-5}"
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"

BENCH_NAME=log_formats
# shellcheck source=bench/lib.sh
. bench/lib.sh
need python3 python3
bench_setup
raw="$data/runs"
mkdir -p "$raw"

printf '[log]\ndir = "%s"\nsample_rate = 1.0\nring_bytes = 268435456\n' "$data/log" >"$data/log.toml"
"$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --shards 1 --config "$data/log.toml" \
    >"$data/serve.out" 2>"$data/serve.log" &
pids+=("$!")
server="$!"
wait_listening "$data/serve.out" "$data/serve.log"
"$bin" bench --addr "$listen_addr" --connections 4 --budget-us 1000000 --duration "$DURATION" --rate "$RATE" \
    --json >"$raw/load.json"
# SIGTERM: the writer closes every segment before the process exits.
kill -TERM "$server"
wait "$server" || die "the logging server did not stop cleanly: $(tail -5 "$data/serve.log")"
pids=()
segments=("$data"/log/decisions-*.arrow)
[ -e "${segments[0]}" ] || die "the server wrote no segment: $(tail -5 "$data/serve.log")"

cargo bench --quiet --bench log_formats -- "${segments[@]}" --repeat "$REPEAT" --json >"$raw/formats.json"

python3 - "$raw" "$OUT" "$RATE" "$DURATION" <<'PY'
import json, os, subprocess, sys
raw, out, rate, duration = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
r = json.load(open(os.path.join(raw, "formats.json")))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown")
load = open("/proc/loadavg").read().split()[:3]
summary = dict(r, commit=commit, cpu=cpu, rate=rate, duration=duration)
json.dump(summary, open(os.path.join(out, "log_formats.json"), "w"), indent=1, sort_keys=True)
base = next(f for f in r["formats"] if f["format"] == "arrow_ipc_lz4")
names = {"arrow_ipc_lz4": "Arrow IPC, LZ4 (what the writer writes)", "arrow_ipc": "Arrow IPC, uncompressed",
         "parquet_snappy": "Parquet, Snappy", "parquet": "Parquet, uncompressed"}
lines = [
    "## Decision log: the file format's cost",
    "",
    f"`bench/log_formats.sh` at `{commit}` on {cpu} ({os.cpu_count()} vCPUs; load average {' '.join(load)} after it). "
    f"A server logged every decision of an open-loop auction-32 load ({rate:,} requests/s for {duration}; the demo's "
    f"real features, 32 candidates, {r['columns']} columns) into {r['segments']} Arrow IPC segment(s); "
    f"`cargo bench --bench log_formats` read those {r['decisions']:,} decisions ({r['rows']:,} rows) back and encoded "
    f"them again in memory in each format, the same batches, fastest of {r['repeat']} passes. The times are the "
    "encoding alone, on one core: the writer's other work (draining the rings, building the columns, writing and "
    "syncing files) is the same for any format.",
    "",
    "| format | CPU µs per decision | / Arrow IPC LZ4 | bytes per decision | / Arrow IPC LZ4 | MB/s out |",
    "|---|---|---|---|---|---|",
]
for f in r["formats"]:
    lines.append(
        f"| {names[f['format']]} | {f['us_per_decision']:.2f} | {f['us_per_decision'] / base['us_per_decision']:.2f} | "
        f"{f['bytes_per_decision']:,.0f} | {f['bytes_per_decision'] / base['bytes_per_decision']:.2f} | "
        f"{f['mb_per_s']:,.0f} |"
    )
open(os.path.join(out, "log_formats.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
