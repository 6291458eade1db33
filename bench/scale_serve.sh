#!/usr/bin/env bash
# The server's end-to-end latency against the user population (issue 19):
# for each user count of $ENTITIES (default 1M, the baseline, 10M and 50M)
# x 32 dims, builds a user replica (`cargo bench --bench scale_serve`,
# seeded), serves it with the
# demo's auction-32 model and 10,000-item replica (one shard on core
# $SERVER_CORE, no Redis: the files are served as they are), and drives it
# from core $GEN_CORE with `quiver bench` open loop at $RATE req/s (uniform
# arrivals, latency from each request's intended send time), user ids
# Zipf($ZIPF) over the whole population, item ids uniform over the items:
#
#   cold: the replica's pages evicted from the page cache (posix_fadvise
#         DONTNEED on this file only), the server started on it (its open
#         checks the header and serves; a background thread scans the
#         rows: the start-up time is until it listens), then $COLD of
#         load at once, no warm-up; the server then keeps running;
#   warm: once every size's server runs, $WARMUP of load each, not
#         recorded, then $RUNS runs of $DURATION per size, interleaved
#         (run 1 of every size, then run 2, ...).
#
# Every server stays up until the end, so MemAvailable must hold all the
# files at once: each size is checked against what is left after the
# ones before it.
#
# Storage is f32 where the file fits in MemAvailable with $SPARE_GIB GiB to
# spare, else f16, else the size is skipped with the reason in the results.
# Writes bench/results/scale_serve.jsonl (machine and settings first, then
# one line per build, run and skip) and each run's percentile distribution
# under bench/results/scale_serve/.
#
#   bash bench/scale_serve.sh    (ENTITIES="1000000 10000000" RUNS=3 DURATION=20s ...)
set -euo pipefail
cd "$(dirname "$0")/.."

ENTITIES="${ENTITIES:-1000000 10000000 50000000}"
RATE="${RATE:-10000}"
ZIPF="${ZIPF:-1.1}"
RUNS="${RUNS:-5}"
DURATION="${DURATION:-20s}"
WARMUP="${WARMUP:-5s}"
COLD="${COLD:-10s}"
CONNECTIONS="${CONNECTIONS:-4}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
SPARE_GIB="${SPARE_GIB:-4}"
# The largest file's open pre-faults and verifies ~10 GB: allow minutes.
START_LIMIT_S="${START_LIMIT_S:-600}"
OUT="${OUT:-bench/results/scale_serve.jsonl}"
HGRM_DIR="${HGRM_DIR:-bench/results/scale_serve}"

BENCH_NAME=scale_serve
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need_two_cores
bench_setup
cargo build --release --quiet --bench scale_serve
items="$("$bin" replica inspect --group item --file "$data/item.qrep" | awk '/^size:/ {print $2}')"
[ -n "$items" ] || die "could not read the item count of $data/item.qrep"
# The commit first: removing the last run's distributions below would
# otherwise mark the tree dirty.
commit="$(python3 -c 'import sys; sys.path.insert(0, "bench"); import provenance; print(provenance.git_commit())')"
mkdir -p "$HGRM_DIR"
rm -f "$HGRM_DIR"/*.hgrm
emit() { echo "$1" >>"$OUT.tmp"; echo "$1" >&2; }
: >"$OUT.tmp"
emit "{\"commit\": \"$commit\", \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)\", \"cores\": $(nproc), \"mem_total_kib\": $(awk '/MemTotal/ {print $2}' /proc/meminfo), \"kernel\": \"$(uname -r)\", \"rate\": $RATE, \"zipf\": $ZIPF, \"runs\": $RUNS, \"duration\": \"$DURATION\", \"warmup\": \"$WARMUP\", \"cold\": \"$COLD\", \"connections\": $CONNECTIONS, \"server_core\": $SERVER_CORE, \"gen_core\": $GEN_CORE, \"items\": $items, \"spare_gib\": $SPARE_GIB}"

scale_serve() { cargo bench --quiet --bench scale_serve -- "$@"; }
mem_available() { awk '/MemAvailable/ {print $2 * 1024}' /proc/meminfo; }
cached_bytes() { if command -v fincore >/dev/null; then fincore --bytes --noheadings --output RES "$1" | xargs; else echo null; fi; }
evict() {
    python3 -c 'import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.fsync(fd)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)' "$1"
}
# One generator run against $listen_addr: PHASE N STORAGE SEED DURATION
# PASS; prints its JSON line (the report, tagged, with the server's own
# stage view of its last 10 s and the machine's load averages around it).
gen() {
    local phase="$1" n="$2" storage="$3" seed="$4" duration="$5" pass="$6"
    local tag="$phase-$n-$storage-$pass-$seed"
    local load_before
    load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
    taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --rate "$RATE" --duration "$duration" \
        --connections "$CONNECTIONS" --budget-us 1000000 --seed "$seed" \
        --users "$n" --user-zipf "$ZIPF" --items "$items" \
        --percentiles "$HGRM_DIR/$tag.hgrm" --json >"$data/run.json" || true
    python3 - "$data/run.json" "$admin_addr" "$phase" "$n" "$storage" "$seed" "$pass" "$load_before" <<'PY'
import json, sys, urllib.request
run, admin, phase, n, storage, seed, pass_, load_before = sys.argv[1:9]
text = open(run).read().strip()
report = json.loads(text) if text else {"error": "the generator wrote no report"}
try:
    stats = json.load(urllib.request.urlopen(f"http://{admin}/stats.json", timeout=5))
    stages = {s["stage"]: {k: s[k] for k in ("p50_us", "p99_us", "p999_us")} for s in stats["stages"]
              if s["stage"] in ("socket_wait", "lookup", "kernel", "end_to_end", "stall")}
except OSError as e:
    stages = {"error": str(e)}
load_after = open("/proc/loadavg").read().split()[:3]
print(json.dumps({"phase": phase, "entities": int(n), "storage": storage, "seed": int(seed), "pass": int(pass_),
                  "loadavg_before": [float(x) for x in load_before.split()], "loadavg_after": [float(x) for x in load_after],
                  "report": report, "server_stages_last_10s_us": stages}))
PY
}

# Phase 1, per size: build, evict, start, cold run; the server keeps running.
declare -A addr_of admin_of storage_of
sizes=()
pass=0
for n in $ENTITIES; do
    pass=$((pass + 1))
    storage=""
    avail="$(mem_available)"
    for s in f32 f16; do
        bytes="$(scale_serve plan --entities "$n" --storage "$s")"
        if [ $((bytes + SPARE_GIB * 1024 * 1024 * 1024)) -le "$avail" ]; then storage="$s"; break; fi
    done
    if [ -z "$storage" ]; then
        emit "{\"phase\": \"skipped\", \"entities\": $n, \"pass\": $pass, \"reason\": \"the f16 file needs $bytes bytes and $SPARE_GIB GiB to spare; MemAvailable was $avail\"}"
        continue
    fi
    file="$data/user-$pass-$n-$storage.qrep"
    build="$(scale_serve build --entities "$n" --storage "$storage" --out "$file")"
    evict "$file"
    emit "{\"phase\": \"build\", \"entities\": $n, \"pass\": $pass, \"mem_available_before_bytes\": $avail, \"cached_after_evict_bytes\": $(cached_bytes "$file"), \"build\": $build}"

    printf 'data_dir = "%s"\nuser_features = "%s"\n' "$data" "$file" >"$data/serve-$pass.toml"
    t0="$(date +%s.%N)"
    taskset -c "$SERVER_CORE" "$bin" serve --config "$data/serve-$pass.toml" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --cores "$SERVER_CORE" >"$data/serve-$pass.out" 2>"$data/serve-$pass.log" &
    server=$!
    pids+=("$server")
    wait_listening "$data/serve-$pass.out" "$data/serve-$pass.log" "$START_LIMIT_S"
    start_s="$(python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 3))" "$t0")"
    rss_kib="$(awk '/VmRSS/ {print $2}' "/proc/$server/status")"
    emit "{\"phase\": \"start\", \"entities\": $n, \"storage\": \"$storage\", \"pass\": $pass, \"start_s\": $start_s, \"server_rss_kib\": $rss_kib, \"cached_bytes\": $(cached_bytes "$file")}"
    addr_of[$pass]="$listen_addr"
    admin_of[$pass]="$admin_addr"
    storage_of[$pass]="$storage"
    sizes+=("$pass:$n")
    emit "$(gen cold "$n" "$storage" 100 "$COLD" "$pass")"
done

# Phase 2: warm runs, interleaved (run 1 of every size, then run 2, ...) so
# a noisy minute of the shared machine falls on all sizes alike.
for size in "${sizes[@]}"; do
    pass="${size%%:*}" n="${size#*:}"
    listen_addr="${addr_of[$pass]}" admin_addr="${admin_of[$pass]}"
    gen warmup "$n" "${storage_of[$pass]}" 200 "$WARMUP" "$pass" >/dev/null
done
for run in $(seq "$RUNS"); do
    for size in "${sizes[@]}"; do
        pass="${size%%:*}" n="${size#*:}"
        listen_addr="${addr_of[$pass]}" admin_addr="${admin_of[$pass]}"
        emit "$(gen warm "$n" "${storage_of[$pass]}" "$run" "$DURATION" "$pass")"
    done
done
mv "$OUT.tmp" "$OUT"

python3 - "$OUT" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
warm = {}
for l in lines:
    if l.get("phase") == "warm":
        warm.setdefault((l["pass"], l["entities"], l["storage"]), []).append(l["report"])
base = None
print("medians of the warm runs, µs (latency from intended send time)")
print(f"{'pass':>4} {'users':>11} {'storage':>7} {'achieved':>9} {'p50':>6} {'p99':>7} {'p99.9':>7} {'max':>7} {'p99/1M':>7}")
for (p, n, s), rs in sorted(warm.items()):
    med = lambda k: statistics.median(r["latency"][k] for r in rs)
    if base is None:
        base = med("p99_us")
    print(f"{p:>4} {n:>11,} {s:>7} {statistics.median(r['achieved_rate'] for r in rs):>9,.0f} {med('p50_us'):>6.0f} "
          f"{med('p99_us'):>7.0f} {med('p999_us'):>7.0f} {med('max_us'):>7.0f} {med('p99_us') / base:>7.2f}")
PY
echo "scale_serve: wrote $OUT" >&2
