#!/usr/bin/env bash
# The fraud worked example under load: builds it (`quiver demo --workload
# fraud`), serves it on one shard (`quiver serve --demo --workload fraud`),
# scores one transaction by hand, then runs one closed-loop and one open-loop
# `quiver bench --workload fraud` (five groups per request, two of them
# string-keyed, a LightGBM model) and stops the server. A quick look at the
# string-key and many-group request path, not the benchmark suite: figures
# from it are single runs and are not quoted in docs/BENCHMARKS.md.
#
# usage: bench/fraud_smoke.sh [duration] [open-loop rate] [zipf exponent]
# (QUIVER_BIN=path/to/quiver uses that binary instead of building one.)
set -euo pipefail
cd "$(dirname "$0")/.."
duration="${1:-5s}"
rate="${2:-2000}"
zipf="${3:-1.0}"
bin="${QUIVER_BIN:-}"
if [ -z "$bin" ]; then
    cargo build --release --quiet
    bin=target/release/quiver
fi
data="$(mktemp -d)"
out="$(mktemp)"
"$bin" demo --workload fraud --data-dir "$data"
"$bin" serve --demo --workload fraud --data-dir "$data" --listen 127.0.0.1:0 --admin off --shards 1 --cores 0 \
    >"$out" 2>"$data/serve.log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$data" "$out"' EXIT
for _ in $(seq 100); do grep -q listening "$out" && break; sleep 0.1; done
addr="$(awk '/listening on/ {print $4}' "$out")"
[ -n "$addr" ] || { cat "$data/serve.log"; exit 1; }
echo "== one transaction (README.md's): card 42, a known device and IP"
"$bin" score --addr "$addr" --key card=42 --key account=7 --str-key device=26c3cb25dcc2fec7 \
    --key ip=27.191.142.146 --key merchant=5 --context 250,3
echo "== closed loop, 2 connections, 8 in flight each, Zipf($zipf) over every group"
taskset -c 1 "$bin" bench --addr "$addr" --workload fraud --zipf "$zipf" --duration "$duration" --connections 2 --pipeline 8
echo "== open loop, ${rate} req/s, 2 connections, 5% new devices and IPs"
taskset -c 1 "$bin" bench --addr "$addr" --workload fraud --zipf "$zipf" --duration "$duration" --connections 2 \
    --rate "$rate" --unknown-fraction 0.05
