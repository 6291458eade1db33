#!/usr/bin/env bash
# The stall target of issue 14, measured: one shard on $SERVER_CORE serving
# auction-32 at $RATE req/s for $DURATION (open loop, generator on $GEN_CORE)
# while /metrics is scraped $SCRAPES_PER_S times a second and, with
# SWAPS=1, the served model version is swapped every second (the demo model
# published as versions 1 and 2 by `quiver demo --models-dir`). Prints the reactor
# stalls the shard counted (over reactor.stall_threshold_us, default
# 500 µs), by task, and writes them with the run's latency to $OUT.
#
# usage: bench/stalls.sh      (RATE=30000 DURATION=60s SCRAPES_PER_S=20 SWAPS=0)
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-30000}"
DURATION="${DURATION:-60s}"
SCRAPES_PER_S="${SCRAPES_PER_S:-20}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
SWAPS="${SWAPS:-0}"
OUT="${OUT:-bench/results/stalls.json}"

BENCH_NAME=stalls
# shellcheck source=bench/lib.sh
. bench/lib.sh
need curl curl
need python3 python3
need taskset util-linux
need_two_cores
bench_setup
# The shard alone on $SERVER_CORE; the admin thread that answers the scrapes,
# the collector and the scraper itself on $GEN_CORE, beside the generator
# (a 2-core box has no third core for them).
printf '[reactor]\nhousekeeping_cores = [%s]\n' "$GEN_CORE" >"$data/stalls.toml"
models=()
if [ "$SWAPS" = 1 ]; then
    "$bin" demo --data-dir "$data" --models-dir "$data/models" >/dev/null
    models=(--models-dir "$data/models")
fi
"$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --cores "$SERVER_CORE" \
    --config "$data/stalls.toml" "${models[@]}" >"$data/serve.out" 2>"$data/serve.log" &
pids+=("$!")
wait_listening "$data/serve.out" "$data/serve.log"
addr="$listen_addr"
admin="$admin_addr"
[ -n "$admin" ] || die "the server has no admin endpoint"

secs="${DURATION%s}"
# One long-lived scraper process, pinned beside the generator.
taskset -c "$GEN_CORE" python3 - "$admin" "$secs" "$SCRAPES_PER_S" >"$data/scrapes.txt" <<'PY' &
import sys, time, urllib.request
admin, secs, per_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
end, n = time.monotonic() + secs, 0
while time.monotonic() < end:
    urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read()
    n += 1
    time.sleep(1 / per_s)
print(n)
PY
pids+=("$!")
if [ "$SWAPS" = 1 ]; then
    (
        for i in $(seq "$secs"); do
            sleep 1
            curl -s -o /dev/null -X POST "http://$admin/models/auction-32/load?version=$(( 1 + i % 2 ))"
        done
    ) &
    pids+=("$!")
fi
taskset -c "$GEN_CORE" "$bin" bench --addr "$addr" --connections 4 --rate "$RATE" --duration "$DURATION" \
    --budget-us 1000000 --json >"$data/bench.json"
sleep 1.2
curl -s "http://$admin/stats.json" >"$data/stats.json"
grep "reactor stalls" "$data/serve.log" | tail -20 >&2 || true
mkdir -p "$(dirname "$OUT")"
python3 - "$data/bench.json" "$data/stats.json" "$RATE" "$DURATION" "$SCRAPES_PER_S" "$SWAPS" >"$OUT" <<'PY'
import json, subprocess, sys
bench, stats = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
stall = next(s for s in stats["stages"] if s["stage"] == "stall")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"commit": commit, "rate": float(sys.argv[3]), "duration": sys.argv[4],
                  "scrapes_per_s": float(sys.argv[5]), "swaps_per_s": 1.0 if sys.argv[6] == "1" else 0.0,
                  "stalls_by_task": stats["stalls_by_task"], "stall_lengths_last_10s_us": stall,
                  "stages_last_10s_us": {s["stage"]: s for s in stats["stages"]},
                  "latency": bench["latency"], "late_sends": bench["late_sends"],
                  "received": bench["received"], "sent": bench["sent"]}, indent=1))
PY
cat "$OUT"
