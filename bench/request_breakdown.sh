#!/usr/bin/env bash
# Where an auction-32 request's time goes (issue 34: "the request path's own
# cost ... ≤ 3 µs per request, measured with ids drawn over the whole
# population; find where the time goes before changing anything"), per INT8
# kernel (`amx` and `avx512-vnni`, where the CPU has them), side by side in
# one run:
#
# - in process (criterion, `request breakdown auction-32` in bench/micro.rs,
#   $REPEATS runs on core $GEN_CORE, medians of the runs' medians): the
#   whole `RequestPath::handle` over 65,536 distinct requests (ids uniform
#   over the demo's 100,000 users and 10,000 items), the kernel alone on
#   the same 32 rows, and each stage around it alone: decode and verify,
#   lookups and row assembly, the score cache, the response's encoding, the
#   clock reads and stage timings; the rest of `handle` is what none of
#   those covers (admission, routing, counters, calls between the stages);
# - a profile of that `handle` bench (`perf record -e cycles:u`, where perf
#   is allowed): each symbol's share of its cycles, grouped by stage, which
#   splits the kernel's input quantization from its GEMM;
# - in the server (`quiver serve --demo --kernel K`, one shard on core
#   $SERVER_CORE; `quiver bench`, one connection, 16 requests in flight, on
#   core $GEN_CORE, closed loop, $DURATION per run): the service time (one
#   over the rate), the server's CPU time per request (user and system,
#   /proc/PID/task/*/stat), the `/metrics` stage sums per request, and the
#   syscalls per request (`perf stat -e raw_syscalls:sys_enter`, and which
#   ones from `strace -c -f` over a separate run of $STRACE_DURATION, when
#   strace is installed: it slows the server, so that run's rate is not
#   quoted).
#
# With BASE=<commit>, the micro bench and the server are also built from
# that commit, and the distinct-request `handle` bench (`request path
# auction-32`, in both trees) and the server's closed loop run alternately
# with HEAD's: before/after in one run.
#
# Writes bench/results/request_breakdown.{json,md} (rendered into
# docs/BENCHMARKS.md by bench/report.py); with OUT=NAME, NAME.{json,md}
# instead, headed with the CPU model, so that a second machine kind's
# figures (OUT=request_breakdown_amd) sit beside the first's. Honours CARGO_TARGET_DIR; builds at
# nice 15 (a shared machine).
#
# usage: bench/request_breakdown.sh   (REPEATS=3 DURATION=5s BASE=<commit>)
set -euo pipefail
cd "$(dirname "$0")/.."

REPEATS="${REPEATS:-3}"
DURATION="${DURATION:-5s}"
STRACE_DURATION="${STRACE_DURATION:-2s}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
BASE="${BASE:-}"
RESULTS=bench/results
OUT="${OUT:-request_breakdown}"
TARGET="${CARGO_TARGET_DIR:-$PWD/target}"
KERNELS="amx avx512-vnni"

BENCH_NAME=request_breakdown
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need_two_cores
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain --untracked-files=no -- src bench Cargo.toml Cargo.lock build.rs)" ]; then
    die "commit first (the figures name HEAD, $head)"
fi
work="$(mktemp -d)"
data="$work/data"
pids=()
# The raw results stay in /tmp/request_breakdown.last whatever happens.
trap 'bench_cleanup; rm -rf /tmp/request_breakdown.last; mkdir -p /tmp/request_breakdown.last; cp "$work"/*.txt "$work"/*.report "$work"/server-* /tmp/request_breakdown.last/ 2>/dev/null; rm -rf "$work"' EXIT
mkdir -p "$RESULTS" "$data"

# The micro bench's executable built from the tree $1 into $TARGET.
micro_executable() {
    (cd "$1" && CARGO_TARGET_DIR="$TARGET" QUIVER_NO_FLATC=1 nice -n 15 cargo bench --bench micro --no-run \
        --message-format=json 2>/dev/null) |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "micro" and m.get("executable"):
        print(m["executable"])'
}

if [ -n "$BASE" ]; then
    base="$(git rev-parse --short "$BASE")"
    mkdir -p "$work/base"
    git archive "$base" | tar -x -C "$work/base"
    echo "== building the micro bench and the server at $base"
    built="$(micro_executable "$work/base")"
    [ -x "$built" ] || die "the micro bench at $base did not build"
    cp "$built" "$work/micro-before"
    (cd "$work/base" && CARGO_TARGET_DIR="$TARGET" QUIVER_NO_FLATC=1 nice -n 15 cargo build --release --quiet)
    cp "$TARGET/release/quiver" "$work/quiver-before"
    # One fingerprint for both trees (see build_bench_pair): make cargo
    # build this tree again.
    find src bench build.rs Cargo.toml -type f -exec touch {} +
fi
echo "== building the micro bench and the server at $head"
built="$(micro_executable .)"
[ -x "$built" ] || die "the micro bench of this checkout did not build"
cp "$built" "$work/micro-after"
CARGO_TARGET_DIR="$TARGET" nice -n 15 cargo build --release --quiet
cp "$TARGET/release/quiver" "$work/quiver-after"
bin="$work/quiver-after"
"$bin" demo --data-dir "$data" >/dev/null 2>&1
sides="after"
[ -n "$BASE" ] && sides="before after"
# The measured processes run at nice -10 where allowed: on a shared
# machine, other work on the same core otherwise takes whole time slices
# from them (milliseconds), which a closed loop's rate counts as service
# time. Each is pinned to one core, so the other core stays free. Not a
# real-time class: a server's threads share its core, and a spinning shard
# at SCHED_FIFO or SCHED_RR kept its main thread from printing its address.
rt=()
nice -n -10 true 2>/dev/null && [ "$(nice -n -10 nice)" = -10 ] && rt=(nice -n -10)
RT="${rt[*]:-none}"
export RT

# A BASE without the breakdown group (before this script) runs only the
# distinct-request `handle` of `request path auction-32`, in both trees.
BREAKDOWN='request breakdown auction-32'
HANDLE='request path auction-32/handle, int8, 65536 distinct requests$'
echo "== criterion: $BREAKDOWN ($REPEATS runs)"
for r in $(seq "$REPEATS"); do
    for side in $sides; do
        CRITERION_HOME="$work/criterion-$side" "${rt[@]}" taskset -c "$GEN_CORE" "$work/micro-$side" \
            --bench "$BREAKDOWN|$HANDLE" >"$work/micro-$side-$r.txt" 2>&1 || { cat "$work/micro-$side-$r.txt"; exit 1; }
    done
done

# The profile: user-space cycles of the distinct-request `handle` bench,
# per kernel, each symbol's own share (no children). Every bench group's
# set-up runs before it (the breakdown group is the last), so only the
# samples of the last PROFILE_S - 3 seconds are reported: `handle` alone.
PROFILE_S=15
perf_ok=0
if command -v perf >/dev/null 2>&1 && perf stat -e cycles:u true >/dev/null 2>&1; then
    perf_ok=1
    for k in $KERNELS; do
        grep -q amx_int8 /proc/cpuinfo || [ "$k" != amx ] || continue
        for side in $sides; do
            grep -q "$BREAKDOWN/handle, $k" "$work/micro-$side-1.txt" || continue
            echo "== perf record: handle, $k, $side"
            p="$work/perf-$side-$k"
            # perf itself runs unpinned at the normal priority: beside a
            # real-time bench on one core it would never drain its buffer.
            CRITERION_HOME="$work/criterion-perf" perf record -q -e cycles:u -F 4999 -o "$p.data" -- \
                "${rt[@]}" taskset -c "$GEN_CORE" "$work/micro-$side" --bench \
                "$BREAKDOWN/handle, $k, 65536 distinct requests" --profile-time "$PROFILE_S" \
                >"$p.txt" 2>&1 || { cat "$p.txt"; exit 1; }
            last="$(perf script -i "$p.data" -F time 2>/dev/null | tail -1 | tr -d ' :')"
            first="$(python3 -c "print(f'{float(\"$last\") - $PROFILE_S + 3:.6f}')")"
            perf report -i "$p.data" --time "$first,$last" --no-children --sort symbol --stdio -q \
                2>/dev/null >"$p.report" || true
            rm -f "$p.data"
        done
    done
fi

# The server: one shard, one connection, 16 in flight.
cpu_ticks() { cat /proc/"$1"/task/*/stat | awk '{u += $14; s += $15} END {printf "%d %d\n", u, s}'; }
metrics() { curl -s "http://$1/metrics" || python3 -c 'import sys, urllib.request
print(urllib.request.urlopen("http://" + sys.argv[1] + "/metrics").read().decode())' "$1"; }
serve() {
    local side="$1" k="$2"
    "${rt[@]}" taskset -c "$SERVER_CORE" "$work/quiver-$side" serve --demo --data-dir "$data" --listen 127.0.0.1:0 \
        --admin 127.0.0.1:0 --shards 1 --cores "$SERVER_CORE" --kernel "$k" \
        >"$work/serve.out" 2>"$work/serve.log" &
    spid="$!"
    pids+=("$spid")
    wait_listening "$work/serve.out" "$work/serve.log"
}
unserve() { kill -TERM "$spid"; wait "$spid" || true; }
gen() { "${rt[@]}" taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --connections 1 --pipeline 16 --json "$@"; }
for r in $(seq "$REPEATS"); do
    for k in $KERNELS; do
        grep -q amx_int8 /proc/cpuinfo || [ "$k" != amx ] || continue
        for side in $sides; do
            echo "== server, $side, $k, run $r"
            serve "$side" "$k"
            gen --duration 1s >/dev/null
            f="$work/server-$side-$k-$r"
            metrics "$admin_addr" >"$f.metrics-before"
            cpu_ticks "$spid" >"$f.cpu-before"
            if [ "$perf_ok" = 1 ]; then
                perf stat -x, -e raw_syscalls:sys_enter -p "$spid" -o "$f.perf" &
                ppid="$!"
            fi
            gen --duration "$DURATION" >"$f.json"
            [ "$perf_ok" = 1 ] && { kill -INT "$ppid"; wait "$ppid" || true; }
            cpu_ticks "$spid" >"$f.cpu-after"
            metrics "$admin_addr" >"$f.metrics-after"
            if [ "$r" = 1 ] && command -v strace >/dev/null 2>&1; then
                timeout -s INT 30 strace -c -f -p "$spid" -o "$f.strace" 2>/dev/null &
                tpid="$!"
                sleep 0.5
                gen --duration "$STRACE_DURATION" >"$f.strace.json"
                kill -INT "$tpid" 2>/dev/null || true
                wait "$tpid" || true
            fi
            unserve
        done
    done
done

LOAD="$(cut -d' ' -f1-3 /proc/loadavg)"
export LOAD
# Keeps the raw results of a run whose summary failed.
summary_failed() {
    rm -rf /tmp/request_breakdown.failed
    cp -r "$work" /tmp/request_breakdown.failed
    die "the summary failed; the raw results are in /tmp/request_breakdown.failed"
}
CPU="$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')"
FLAGS="$(grep -o -w -E 'amx_int8|amx_tile|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
export CPU FLAGS
python3 - "$work" "$RESULTS" "$REPEATS" "$head" "${base:-}" "$KERNELS" "$DURATION" "$perf_ok" "$OUT" <<'PY' || summary_failed
import json, os, re, statistics, sys
work, results, repeats, head, base, kernels, duration, perf_ok, out = sys.argv[1:]
repeats, kernels = int(repeats), kernels.split()
UNIT = {"ps": 1e-6, "ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
time_re = re.compile(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]")
TICK_S = os.sysconf("SC_CLK_TCK")

def criterion(path):
    """Bench name -> median µs (criterion's report: a name line, then the
    `time: [lo median hi]` line, or both on one)."""
    out, name = {}, None
    for line in open(path):
        m = time_re.search(line)
        head_part = line.split("time:")[0].strip()
        if head_part and "/" in head_part and not head_part.startswith(("Benchmarking", "Found", "Warning")):
            name = head_part
        if m and name:
            out[name] = float(m[1]) * UNIT[m[2]]
            name = None
    if not out:
        sys.exit(f"request_breakdown: no criterion figures in {path}")
    return out

def med(runs, name):
    vals = [r[name] for r in runs if name in r]
    return statistics.median(vals) if vals else None

G = "request breakdown auction-32/"
HANDLE = "request path auction-32/handle, int8, 65536 distinct requests"
sides = ["before", "after"] if base else ["after"]
runs = {side: [criterion(f"{work}/micro-{side}-{r}.txt") for r in range(1, repeats + 1)] for side in sides}
STAGES = {
    "decode and verify": "decode and verify",
    "lookups and row assembly": "lookups and row assembly",
    "score cache": "score cache: key, look up, fill 32",
    "respond (encode)": "respond: encode 32 scores",
    "clock reads and stage timings": "clock reads and stage timings",
}
# Symbols by stage, first match wins; the patterns name where each stage's
# code lives.
GROUPS = [
    ("input quantization", r"quantiz|round_clamp|max_abs"),
    ("kernel (GEMM, epilogue)", r"int8_gemm|amx|vnni|gemm|PackedLayer|Int8|tdpbusd|score::cpu|executor"),
    ("decode and verify", r"flatbuffers|verif|decode_request|wire::"),
    ("lookups and row assembly", r"replica|Replica|read_many|read_into|assemble|memcpy|memmove"),
    ("score cache", r"cache::|ScoreCache|put_all"),
    ("respond (encode)", r"ResponseEncoder|encode|FlatBufferBuilder"),
    ("clock reads and stage timings", r"hdrhistogram|Histogram|clock_gettime|vdso|Instant|elapsed|now_ns|record_ns"),
    ("request path (admit, route, finish)", r"request::|RequestPath|stages::|admission|policies"),
]
OTHER = "other (criterion loop, libc, runtime)"

def read_profile(path):
    rows = []
    for line in open(path):
        m = re.match(r"\s*([\d.]+)%\s+\[\.\]\s+(.*?)(?:\s+-\s+-)?\s*$", line)
        if m:
            rows.append((float(m[1]), m[2]))
    groups = {g: 0.0 for g, _ in GROUPS}
    groups[OTHER] = 0.0
    for share, sym in rows:
        groups[next((g for g, p in GROUPS if re.search(p, sym)), OTHER)] += share
    return {"groups_pct": groups, "top": [{"pct": s, "symbol": sym[:110]} for s, sym in rows[:12]]}

# Per kernel and side: the whole, the kernel alone, the stages alone. The
# kernel alone includes each layer's dynamic per-row quantization of its
# input; the profile splits it off (its share of the quantization and GEMM
# samples together, applied to the kernel alone): the issue counts the
# quantization as the path's own cost.
inproc, profile = {}, {}
for k in kernels:
    for side in sides:
        handle = med(runs[side], f"{G}handle, {k}, 65536 distinct requests")
        kernel = med(runs[side], f"{G}kernel alone, {k}, 32 rows")
        if handle is None or kernel is None:
            continue
        stages = {st: med(runs[side], G + name) for st, name in STAGES.items()}
        col = f"{k}, {side}" if base else k
        x = {"kernel": k, "side": side, "handle_us": handle, "kernel_us": kernel, "non_kernel_us": handle - kernel,
             "stages_us": stages, "rest_us": handle - kernel - sum(stages.values())}
        path = f"{work}/perf-{side}-{k}.report"
        if perf_ok == "1" and os.path.exists(path):
            profile[col] = read_profile(path)
            g = profile[col]["groups_pct"]
            if g["input quantization"] + g["kernel (GEMM, epilogue)"] > 0:
                q = g["input quantization"] / (g["input quantization"] + g["kernel (GEMM, epilogue)"])
                x["quantization_us"] = kernel * q
                x["gemm_us"] = kernel - x["quantization_us"]
                x["own_cost_us"] = handle - x["gemm_us"]
        inproc[col] = x
cols = list(inproc)
handle_pair = None
if base:
    handle_pair = {"before_us": med(runs["before"], HANDLE), "after_us": med(runs["after"], HANDLE)}
    if handle_pair["before_us"] and handle_pair["after_us"]:
        handle_pair["ratio"] = handle_pair["after_us"] / handle_pair["before_us"]

def metric_sums(path):
    sums, counts = {}, {}
    for line in open(path):
        m = re.match(r'quiver_stage_duration(?:_seconds)?_(sum|count)\{stage="(\w+)"\} (\S+)', line)
        if m:
            (sums if m[1] == "sum" else counts)[m[2]] = float(m[3])
    return sums, counts

def syscalls(path):
    for line in open(path):
        parts = line.strip().split(",")
        if len(parts) > 2 and "raw_syscalls:sys_enter" in parts[2]:
            return float(parts[0]) if parts[0].replace(".", "").isdigit() else None
    return None

def strace_top(path):
    out = []
    for line in open(path):
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m and m[2] != "total":
            out.append((m[2], int(m[1])))
    return sorted(out, key=lambda x: -x[1])

server = {}
for k in kernels:
    for side in sides:
        server_runs = []
        for r in range(1, repeats + 1):
            f = f"{work}/server-{side}-{k}-{r}"
            if not os.path.exists(f + ".json"):
                continue
            b = json.load(open(f + ".json"))
            n = max(b["received"], 1)
            u0, s0 = map(int, open(f + ".cpu-before").read().split())
            u1, s1 = map(int, open(f + ".cpu-after").read().split())
            sb, cb = metric_sums(f + ".metrics-before")
            sa, ca = metric_sums(f + ".metrics-after")
            dn = {st: ca.get(st, 0) - cb.get(st, 0) for st in ca}
            stage_us = {st: (sa[st] - sb.get(st, 0)) * 1e6 / dn[st] for st in sa if dn.get(st)}
            sc = syscalls(f + ".perf") if os.path.exists(f + ".perf") else None
            run = {"rate": b["achieved_rate"], "service_us": 1e6 / b["achieved_rate"],
                   "p50_us": b["latency"]["p50_us"], "p99_us": b["latency"]["p99_us"],
                   "user_us": (u1 - u0) / TICK_S * 1e6 / n, "system_us": (s1 - s0) / TICK_S * 1e6 / n,
                   "stage_us": stage_us, "syscalls": sc / n if sc else None,
                   "lost": b["lost"] + len(b["connection_errors"])}
            if os.path.exists(f + ".strace") and os.path.exists(f + ".strace.json"):
                sj = json.load(open(f + ".strace.json"))
                run["strace_per_request"] = [(name, calls / max(sj["received"], 1))
                                             for name, calls in strace_top(f + ".strace")[:6]]
            server_runs.append(run)
        if not server_runs:
            continue
        m = lambda key: statistics.median(x[key] for x in server_runs if x[key] is not None) \
            if any(x[key] is not None for x in server_runs) else None
        stage_names = sorted(set().union(*(x["stage_us"] for x in server_runs)))
        server[f"{k}/{side}"] = {
            "kernel": k, "side": side, "rate": m("rate"), "service_us": m("service_us"), "p50_us": m("p50_us"),
            "p99_us": m("p99_us"), "user_us": m("user_us"), "system_us": m("system_us"), "syscalls": m("syscalls"),
            "stage_us": {st: statistics.median(x["stage_us"][st] for x in server_runs if st in x["stage_us"])
                         for st in stage_names},
            "strace_per_request": next((x["strace_per_request"] for x in server_runs if "strace_per_request" in x), []),
            "lost": sum(x["lost"] for x in server_runs), "each_service_us": [x["service_us"] for x in server_runs]}

cpu, flags = os.environ["CPU"], os.environ["FLAGS"].strip()
res = {"machine": {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "load": os.environ["LOAD"],
                   "scheduling": os.environ["RT"]}, "commit": head, "base": base or None,
       "repeats": repeats, "duration": duration, "in_process": inproc, "profile": profile, "server": server,
       "handle_before_after": handle_pair}
json.dump(res, open(f"{results}/{out}.json", "w"), indent=1, sort_keys=True)

on = "" if out == "request_breakdown" else f" on {cpu}"
o = [f"## Where an auction-32 request's time goes{on}", ""]
o.append(f"Measured by `bench/request_breakdown.sh` at `{head}` on {cpu} ({os.cpu_count()} vCPUs, shared; "
         f"flags {flags}). In process: criterion's `request breakdown auction-32` group of `bench/micro.rs` "
         f"on one core, {repeats} runs, medians of the runs' medians, over 65,536 distinct requests whose ids are "
         "drawn uniformly over the demo's 100,000 users and 10,000 items (the demo model: dynamic INT8, "
         "80 → 256 → 128 → 1); the kernel alone on the same 32 rows "
         "(assembled from the demo replicas); each stage alone; \"the rest\" is the whole less the kernel and "
         "those stages (admission, routing, counters, the calls between stages, and what the stages cost "
         f"together beyond their sum alone). Load average at the end: {os.environ['LOAD']}; the measured "
         f"processes ran under `{os.environ['RT']}` (so the machine's other work does not take whole "
         "time slices from them).")
o.append("")
def label(col):
    x = inproc[col]
    return f"{x['kernel']}, `{base if x['side'] == 'before' else head}`" if base else x["kernel"]
hdr = " | ".join(label(c) for c in cols)
o.append(f"| per request (µs) | {hdr} |")
o.append("|---|" + "---:|" * len(cols))
def row(name, f):
    o.append(f"| {name} | " + " | ".join(f(inproc[c]) for c in cols) + " |")
f2 = lambda v: "–" if v is None else f"{v:.2f}"
row("whole `handle`", lambda x: f"{x['handle_us']:.2f}")
row("**the path's own cost** (whole − GEMM and epilogue; the issue's measure)",
    lambda x: f"**{f2(x.get('own_cost_us'))}**")
row("&nbsp;&nbsp;input quantization, every layer (kernel alone × its profile share)",
    lambda x: f2(x.get("quantization_us")))
row("GEMM and epilogue (kernel alone less quantization)", lambda x: f2(x.get("gemm_us")))
row("kernel alone (32 rows)", lambda x: f"{x['kernel_us']:.2f}")
row("**not the kernel** (whole − kernel)", lambda x: f"**{x['non_kernel_us']:.2f}**")
for st in STAGES:
    row(f"&nbsp;&nbsp;{st}", lambda x, st=st: f2(x["stages_us"][st]))
row("&nbsp;&nbsp;the rest", lambda x: f"{x['rest_us']:.2f}")
if handle_pair and handle_pair.get("ratio"):
    o.append("")
    o.append(f"Before and after in the same run: `{HANDLE}` (the kernel `auto` picks) built at `{base}`: "
             f"{handle_pair['before_us']:.2f} µs, at `{head}`: {handle_pair['after_us']:.2f} µs "
             f"(after/before {handle_pair['ratio']:.3f}).")
if profile:
    pcols = [c for c in cols if c in profile]
    o.append("")
    o.append("`perf record -e cycles:u` of the `handle` bench, each symbol's own cycles (no children) grouped "
             "by the stage its name places it in, per cent of the bench's cycles (inlined code counts in the "
             "function it was inlined into):")
    o.append("")
    o.append("| profile share (%) | " + " | ".join(label(c) for c in pcols) + " |")
    o.append("|---|" + "---:|" * len(pcols))
    for g in profile[pcols[0]]["groups_pct"]:
        o.append(f"| {g} | " + " | ".join(f"{profile[c]['groups_pct'][g]:.1f}" for c in pcols) + " |")
    for c in pcols:
        o.append("")
        o.append(f"Top symbols ({label(c)}):")
        o.append("")
        o.append("| % | symbol |")
        o.append("|---:|---|")
        for t in profile[c]["top"][:8]:
            o.append(f"| {t['pct']:.1f} | `{t['symbol'].replace('|', '/')}` |")
if server:
    o.append("")
    o.append(f"The server: `quiver serve --demo --kernel K`, one shard on core 0; `quiver bench`, one connection, "
             f"16 requests in flight, closed loop, on core 1, {repeats} runs of {duration}, medians. Service time "
             "is one over the rate; CPU is the server's threads' user and system time per request (clock ticks "
             "from /proc); the stage figures are the `/metrics` sums of `quiver_stage_duration` over the run per "
             "request (decode includes waiting behind the earlier frames of the same read); syscalls per request "
             "from `perf stat -e raw_syscalls:sys_enter` on the server.")
    o.append("")
    o.append("| server | service µs | p50 µs | p99 µs | user µs | system µs | syscalls | decode | lookup | kernel | "
             "respond |")
    o.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, s in server.items():
        label = f"{s['kernel']}" + (f" ({s['side']}: `{base if s['side'] == 'before' else head}`)" if base else "")
        st = s["stage_us"]
        o.append(f"| {label} | {f2(s['service_us'])} | {s['p50_us']:.0f} | {s['p99_us']:.0f} | {f2(s['user_us'])} | "
                 f"{f2(s['system_us'])} | {f2(s['syscalls'])} | {f2(st.get('decode'))} | {f2(st.get('lookup'))} | "
                 f"{f2(st.get('kernel'))} | {f2(st.get('respond'))} |")
    traced = [(key, s) for key, s in server.items() if s["strace_per_request"]]
    if traced:
        o.append("")
        o.append("Which syscalls, per request (`strace -c -f` on the server over a separate, slowed run): " +
                 "; ".join(f"{key}: " + ", ".join(f"{n} {c:.3f}" for n, c in s["strace_per_request"])
                           for key, s in traced) + ".")
    if any(s["lost"] for s in server.values()):
        o.append("")
        o.append("Some server runs lost requests or connections (see the JSON).")
open(f"{results}/{out}.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
