#!/usr/bin/env bash
# The stall target of issue 14, measured: one shard on $SERVER_CORE serving
# auction-32 at $RATE req/s for $DURATION (open loop, generator on $GEN_CORE)
# while /metrics is scraped $SCRAPES_PER_S times a second. Prints the reactor
# stalls the shard counted (over reactor.stall_threshold_us, default
# 500 µs), by task, and writes them with the run's latency to $OUT.
#
# usage: bench/stalls.sh      (RATE=30000 DURATION=60s SCRAPES_PER_S=20)
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-30000}"
DURATION="${DURATION:-60s}"
SCRAPES_PER_S="${SCRAPES_PER_S:-20}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
OUT="${OUT:-bench/results/stalls.json}"

die() { echo "stalls: $*" >&2; exit 1; }
command -v curl >/dev/null || die "required tool 'curl' is missing (apt-get install curl)"
command -v taskset >/dev/null || die "required tool 'taskset' is missing (apt-get install util-linux)"
[ "$(nproc)" -ge 2 ] || die "needs at least 2 cores (server and generator on separate cores)"

cargo build --release --quiet
bin=target/release/quiver
data="$(mktemp -d)"
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$data"
}
trap cleanup EXIT
"$bin" demo --data-dir "$data" 2>/dev/null
taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
    --cores "$SERVER_CORE" >"$data/serve.out" 2>"$data/serve.log" &
pids+=("$!")
for _ in $(seq 600); do grep -q "listening on" "$data/serve.out" 2>/dev/null && break; sleep 0.05; done
addr="$(awk '/listening on/ {print $4}' "$data/serve.out")"
admin="$(awk '/admin on/ {print $4}' "$data/serve.out")"
[ -n "$addr" ] && [ -n "$admin" ] || { cat "$data/serve.log"; die "server did not start within 30 s"; }

secs="${DURATION%s}"
(
    end=$(( $(date +%s) + secs ))
    while [ "$(date +%s)" -lt "$end" ]; do
        curl -s -o /dev/null "http://$admin/metrics"
        sleep "$(python3 -c "print(1/$SCRAPES_PER_S)")"
    done
) &
pids+=("$!")
taskset -c "$GEN_CORE" "$bin" bench --addr "$addr" --connections 4 --rate "$RATE" --duration "$DURATION" \
    --budget-us 1000000 --json >"$data/bench.json"
sleep 1.2
curl -s "http://$admin/stats.json" >"$data/stats.json"
grep "reactor stalls" "$data/serve.log" | tail -20 >&2 || true
mkdir -p "$(dirname "$OUT")"
python3 - "$data/bench.json" "$data/stats.json" "$RATE" "$DURATION" "$SCRAPES_PER_S" >"$OUT" <<'PY'
import json, subprocess, sys
bench, stats = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
stall = next(s for s in stats["stages"] if s["stage"] == "stall")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"commit": commit, "rate": float(sys.argv[3]), "duration": sys.argv[4],
                  "scrapes_per_s": float(sys.argv[5]),
                  "stalls_by_task": stats["stalls_by_task"], "stall_lengths_last_10s_us": stall,
                  "latency": bench["latency"], "late_sends": bench["late_sends"],
                  "received": bench["received"], "sent": bench["sent"]}, indent=1))
PY
cat "$OUT"
