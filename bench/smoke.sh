#!/usr/bin/env bash
# Starts the demo server, runs one closed-loop and one open-loop `quiver bench`,
# and stops the server. A quick look, not the benchmark suite: figures from it
# are single runs and are not quoted in docs/BENCHMARKS.md.
#
# usage: bench/smoke.sh [duration] [open-loop rate]
set -euo pipefail
cd "$(dirname "$0")/.."
duration="${1:-5s}"
rate="${2:-2000}"
cargo build --release --quiet
bin=target/release/quiver
data="$(mktemp -d)"
out="$(mktemp)"
"$bin" serve --demo --data-dir "$data" --listen 127.0.0.1:0 --shards 1 --cores 0 >"$out" 2>"$data/serve.log" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -rf "$data" "$out"' EXIT
for _ in $(seq 100); do grep -q listening "$out" && break; sleep 0.1; done
addr="$(awk '/listening on/ {print $4}' "$out")"
[ -n "$addr" ] || { cat "$data/serve.log"; exit 1; }
echo "== closed loop, 2 connections, 8 in flight each"
taskset -c 1 "$bin" bench --addr "$addr" --duration "$duration" --connections 2 --pipeline 8
echo "== open loop, ${rate} req/s, 2 connections"
taskset -c 1 "$bin" bench --addr "$addr" --duration "$duration" --connections 2 --rate "$rate"
