#!/usr/bin/env bash
# Replica scale curves (issue 19): runs `cargo bench --bench scale` for 1M,
# 10M and 50M entities x 32 dims in f32 and f16 storage, unpinned (the
# growth step's reader thread must not share the writer's core), writes bench/results/scale.jsonl (the commit first, then
# one line per case) and plots the curves into docs/bench/scale-*.png; then
# the f32 cases again with huge pages (bench/results/scale-side.jsonl).
#
#   bash bench/scale.sh [ENTITIES (comma-separated)] [LOOKUPS per case]
#
# Needs about 3x the largest file in free memory for the growth step (it is
# skipped, and says so, where that does not fit) and as much free disk in
# $TMPDIR (default /tmp) as the largest file.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH_NAME=scale
# shellcheck source=bench/lib.sh
. bench/lib.sh

entities="${1:-1000000,10000000,50000000}"
lookups="${2:-200000}"
out=bench/results/scale.jsonl
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT

cargo build --release --quiet --bench scale
cargo build --release --quiet
commit="$(python3 -c 'import sys; sys.path.insert(0, "bench"); import provenance; print(provenance.git_commit())')"
{
    echo "{\"commit\": \"$commit\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"mem_total_kib\": $(awk '/MemTotal/ {print $2}' /proc/meminfo), \"cores\": $(nproc), \"loadavg_start\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    cargo bench --quiet --bench scale -- --entities "$entities" --storage f32,f16 --lookups "$lookups" --dir "$dir" \
        --huge-pages off
    # What else ran meanwhile shows in the load average (the tails carry it).
    echo "{\"loadavg_end\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
} > "$out.tmp"
mv "$out.tmp" "$out"

# The same f32 cases with replica_huge_pages = true (MADV_HUGEPAGE: 2 MiB
# page-cache folios), for the side-by-side in the report; separate, so the
# plots below stay one curve per storage at the server's default.
side=bench/results/scale-side.jsonl
{
    echo "{\"commit\": \"$commit\", \"loadavg_start\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
    cargo bench --quiet --bench scale -- --entities "$entities" --storage f32 --lookups "$lookups" --dir "$dir" \
        --huge-pages on
    echo "{\"loadavg_end\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
} > "$side.tmp"
mv "$side.tmp" "$side"

bin=target/release/quiver
"$bin" plot scale --out docs/bench/scale-time.png --title "Replica: build, restart and growth time" \
    --y-desc "seconds" --results "$out" build=build_s "restart (serving)=restart_warm.serving_s" \
    "restart, pages evicted=restart_cold.serving_s" \
    "scan after restart=restart_warm.verify_s" "scan, pages evicted=restart_cold.verify_s" growth=growth.growth_s
"$bin" plot scale --out docs/bench/scale-memory.png --title "Replica: file and resident size" \
    --y-desc "GB" --divide-by 1e9 --results "$out" file=file_bytes resident=resident_serving_bytes
"$bin" plot scale --out docs/bench/scale-lookup.png --title "Replica: one request's rows (1 user + 32 items), p99" \
    --y-desc "µs" --divide-by 1e3 --results "$out" uniform=lookup_uniform.p99_ns zipf=lookup_zipf.p99_ns \
    warm=lookup_warm.p99_ns
echo "scale: wrote $out, $side and docs/bench/scale-{time,memory,lookup}.png"
