#!/usr/bin/env bash
# The feed on a Redis Cluster against one Redis (issue 15): runs `cargo
# bench --bench cluster_feed` (first sync of ENTITIES items from a
# three-master cluster and from a single Redis, interleaved, REPEATS times;
# then refresh lag at RATE updates/s steady, during a reshard of a quarter
# of the slots, and after) and writes bench/results/cluster_feed.jsonl (the
# commit and machine first, then one line per copy and per lag phase).
#
#   bash bench/cluster_feed.sh [ENTITIES] [REPEATS] [RATE]
#
# Starts its own redis-server processes (needs redis-server and redis-cli
# on PATH, Redis 7) on free ports, and stops them by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_NAME=cluster_feed
# shellcheck source=bench/lib.sh
. bench/lib.sh
need redis-server redis-server
need redis-cli redis-tools

entities="${1:-1000000}"
repeats="${2:-3}"
rate="${3:-2000}"
out=bench/results/cluster_feed.jsonl

cargo build --release --quiet --bench cluster_feed
commit="$(python3 -c 'import sys; sys.path.insert(0, "bench"); import provenance; print(provenance.git_commit())')"
{
    echo "{\"commit\": \"$commit\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc), \"redis\": \"$(redis-server --version | awk '{print $3}' | cut -d= -f2)\", \"load_before\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    cargo bench --quiet --bench cluster_feed -- --entities "$entities" --repeats "$repeats" --rate "$rate"
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "cluster_feed: wrote $out"
