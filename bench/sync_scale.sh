#!/usr/bin/env bash
# Full sync from Redis at scale (issue 19): runs `cargo bench --bench
# sync_scale` for 1M, 10M and 20M entities x 32 dims f32, over 1, 4 and 8
# connections side by side, and writes bench/results/sync_scale.jsonl (the
# commit and machine first, then one line per load, copy and probe).
#
#   bash bench/sync_scale.sh [ENTITIES (comma-separated)] [CONNECTIONS (comma-separated)] [REPEATS up to 1M] [REPEATS above]
#
# Starts its own redis-server (no persistence; needs redis-server on PATH).
# A size is skipped, and says why, unless Redis's keys and the replica file
# fit in MemAvailable with 4 GB to spare (20M needs about 9 GB). Replica
# files go to $TMPDIR (default /tmp), as large as 4 GB at 20M.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_NAME=sync_scale
# shellcheck source=bench/lib.sh
. bench/lib.sh
need redis-server redis-server

entities="${1:-1000000,10000000,20000000}"
connections="${2:-1,4,8}"
repeats="${3:-3}"
repeats_big="${4:-1}"
out=bench/results/sync_scale.jsonl
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT

cargo build --release --quiet --bench sync_scale
commit="$(python3 -c 'import sys; sys.path.insert(0, "bench"); import provenance; print(provenance.git_commit())')"
{
    echo "{\"commit\": \"$commit\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc), \"mem_total_kib\": $(awk '/MemTotal/ {print $2}' /proc/meminfo), \"redis\": \"$(redis-server --version | awk '{print $3}' | cut -d= -f2)\", \"load_before\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    cargo bench --quiet --bench sync_scale -- --entities "$entities" --connections "$connections" \
        --repeats "$repeats" --repeats-big "$repeats_big" --dir "$dir"
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "sync_scale: wrote $out"
