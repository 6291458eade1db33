#!/usr/bin/env bash
# The decision log's cost, in one run: auction-32 served by one shard on
# core $SERVER_CORE with logging off, at 10% and at 100% (one server per
# mode, the same binary and demo data), each driven open loop at $RATE
# requests/s by `quiver bench` on core $GEN_CORE, $RUNS runs each,
# interleaved (run 1 of every server, then run 2, ...) so a noisy minute of
# the machine falls on all of them; the servers not measured are stopped
# (SIGSTOP) during each run, so their timers do not wake on the shard's
# core. Then, from the logging servers: records
# put, dropped (ring full) and written, and the bytes of closed segments
# per decision logged (`quiver log inspect`); and the writer alone (`cargo
# bench --bench decision_log`), before the serving runs and after them:
# decisions/s and MB/s one writer thread turns into segments.
#
# MODES (default "off 10 100"): `off`, `N` (N% logged, the writer
# SCHED_IDLE, the default), `Nn` (N% logged, `writer_priority =
# "normal"`: the writer before it was made SCHED_IDLE, for comparison) or
# `busy` (the control: logging off, and during each of its runs a shell
# busy loop under SCHED_IDLE on $SERVER_CORE, started before the run and
# ended after it: what any idle-priority thread that never sleeps costs
# the shard's tail, with none of the log's work).
# PLACEMENT: `shared` (default: every thread of a server, the log's writer
# included, on $SERVER_CORE, as on a machine with no housekeeping core to
# spare: the writer only gets the time the shard leaves), `housekeeping`
# (the shard on $SERVER_CORE, the writer and the other housekeeping
# threads on $GEN_CORE beside the load generator, which spins: an idle
# writer there gets almost no time) or `own` (the writer and the other
# housekeeping threads on $HOUSEKEEPING_CORE, a core of their own, as
# `quiver serve` places them on a machine with a spare core: the placement
# the issue's cost target is for; needs 3 cores).
#
# The shard's own cost, beside the tails: each run reads the shard's
# threads' run time (/proc/PID/task/TID/schedstat) before and after, over
# the responses received: CPU µs per request, which the machine's noise
# moves far less than it moves p99. SPIN_US sets every server's `[reactor]
# spin_before_park_us` (unset: the server's default). A shard that spins
# between requests leaves an idle writer on its core no time, and its CPU
# counts the spinning; at 0 it parks at once, and its CPU is its work.
#
# Writes $OUT/decision_log.json and decision_log.md, or, with SPIN_US
# unset (shards spinning their default), decision_log_spin.json and .md;
# bench/report.py renders both into docs/BENCHMARKS.md.
#
# On a machine without a Rust toolchain (a lent one, with cores to spare
# for PLACEMENT=own), carry prebuilt executables: QUIVER_BIN (`quiver`,
# bench/lib.sh) and QUIVER_WRITER_BENCH (the `decision_log` bench's, from
# `cargo bench --bench decision_log --no-run`); both may be stripped.
#
# usage: bench/decision_log.sh     (RUNS=3 DURATION=5s RATE=30000 MODES="off 10 100" PLACEMENT=shared)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
DURATION="${DURATION:-5s}"
RATE="${RATE:-30000}"
CONNECTIONS="${CONNECTIONS:-4}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
HOUSEKEEPING_CORE="${HOUSEKEEPING_CORE:-2}"
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
MODES="${MODES:-off 10 100}"
PLACEMENT="${PLACEMENT:-shared}"
SPIN_US="${SPIN_US:-}"
case "$PLACEMENT" in
    shared) server_cores="$SERVER_CORE" ;;
    housekeeping) server_cores="$SERVER_CORE,$GEN_CORE" ;;
    own) server_cores="$SERVER_CORE,$HOUSEKEEPING_CORE" ;;
    *) echo "decision_log: PLACEMENT is shared, housekeeping or own, not '$PLACEMENT'" >&2; exit 1 ;;
esac
for mode in $MODES; do
    [[ "$mode" =~ ^(off|busy|[0-9]+n?)$ ]] || { echo "decision_log: mode '$mode' is off, busy, N or Nn" >&2; exit 1; }
done

BENCH_NAME=decision_log
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need python3 python3
need curl curl
case " $MODES " in *" busy "*) need chrt util-linux ;; esac
need_two_cores
if [ "$PLACEMENT" = own ]; then
    [ "$(nproc)" -ge 3 ] || die "PLACEMENT=own needs 3 cores (shard, generator, housekeeping); this machine has $(nproc)"
    for c in "$SERVER_CORE" "$GEN_CORE"; do
        [ "$c" != "$HOUSEKEEPING_CORE" ] || die "HOUSEKEEPING_CORE must differ from SERVER_CORE and GEN_CORE"
    done
fi
bench_setup
raw="$data/runs"
mkdir -p "$raw"

# The writer alone (`cargo bench --bench decision_log`), before the serving
# runs and again after them: on a 2-vCPU VM it took 1.5 to 3 times the CPU
# per decision after minutes of them (15 to 29 µs in four runs of this
# script, against 9 to 10 µs before them or run alone; a one-second run of
# the script, minutes of shell busy loops on both cores, 1.2 GB written
# and deleted, or 180 s of one demo server serving 30k requests/s did not
# slow it; the cause is not known), so the report gives both.
writer_bench() {
    if [ -n "${QUIVER_WRITER_BENCH:-}" ]; then
        "$QUIVER_WRITER_BENCH" --json >"$1"
    else
        cargo bench --quiet --bench decision_log -- --json >"$1"
    fi
}
writer_bench "$raw/writer.json"

# The shard's run time and run-queue wait so far, in ns: its executor's
# threads (glommio names them `quiver-shard-0-<n>`, cut to 15 characters).
shard_ns() {
    local t run=0 wait=0 r w
    for t in /proc/"$1"/task/*; do
        case "$(cat "$t/comm" 2>/dev/null)" in
            quiver-shard-0-*)
                read -r r w _ <"$t/schedstat"
                run=$(( run + r )) wait=$(( wait + w )) ;;
        esac
    done
    [ "$run" -gt 0 ] || die "no quiver-shard-0 thread in process $1"
    echo "$run $wait"
}

declare -A addr admin pid_of
logging=()
for mode in $MODES; do
    : >"$data/$mode.toml"
    if [ "$mode" != off ] && [ "$mode" != busy ]; then
        logging+=("$mode")
        rate="$(python3 -c "print(${mode%n} / 100)")"
        priority=idle
        [[ "$mode" == *n ]] && priority=normal
        printf '[log]\ndir = "%s"\nsample_rate = %s\nwriter_priority = "%s"\n' "$data/log-$mode" "$rate" "$priority" \
            >>"$data/$mode.toml"
    fi
    [ -z "$SPIN_US" ] || printf '[reactor]\nspin_before_park_us = %s\n' "$SPIN_US" >>"$data/$mode.toml"
    taskset -c "$server_cores" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --cores "$SERVER_CORE" --config "$data/$mode.toml" >"$data/$mode.out" 2>"$data/$mode.log" &
    pids+=("$!")
    pid_of[$mode]="$!"
    wait_listening "$data/$mode.out" "$data/$mode.log"
    shard_ns "$!" >/dev/null
    addr[$mode]="$listen_addr"
    admin[$mode]="$admin_addr"
done

gen() {
    local mode="$1"; shift
    taskset -c "$GEN_CORE" "$bin" bench --addr "${addr[$mode]}" --connections "$CONNECTIONS" \
        --budget-us 1000000 "$@"
}
for mode in $MODES; do gen "$mode" --duration 1s --rate 10000 --json >/dev/null; done   # warm up

for run in $(seq "$RUNS"); do
    for mode in $MODES; do
        before="$(shard_ns "${pid_of[$mode]}")"
        read -r run_ns wait_ns <<<"$before"
        # The other servers are stopped (SIGSTOP) for the run: an idle
        # server on the shard's core still wakes about 200 times a second
        # (its watcher's and adopter's timers), and any thread that wakes
        # on that core moves the measured shard's p99 (the busy row).
        for other in $MODES; do
            [ "$other" = "$mode" ] || kill -STOP "${pid_of[$other]}"
        done
        busy_pid=
        if [ "$mode" = busy ]; then
            taskset -c "$SERVER_CORE" chrt -i 0 timeout 600 sh -c 'while :; do :; done' &
            busy_pid="$!"
            pids+=("$busy_pid")
        fi
        gen "$mode" --duration "$DURATION" --rate "$RATE" --json >"$raw/$mode-$run.json" || true
        [ -z "$busy_pid" ] || { kill "$busy_pid" 2>/dev/null || true; wait "$busy_pid" 2>/dev/null || true; }
        after="$(shard_ns "${pid_of[$mode]}")"
        read -r run_after wait_after <<<"$after"
        echo "$(( run_after - run_ns )) $(( wait_after - wait_ns ))" >"$raw/$mode-$run.shard_ns"
        # The server's own view of the run: its stage percentiles over the
        # last 10 s, read once the shard has published the run's last
        # interval (each second).
        sleep 1.5
        curl -s "http://${admin[$mode]}/metrics" | grep '^quiver_stage_duration_window_seconds{' \
            >"$raw/$mode-$run.window" || true
        for other in $MODES; do kill -CONT "${pid_of[$other]}"; done
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); l=r['latency']; print(f'run {sys.argv[2]} logging {sys.argv[3]:>3}: p50 {l[\"p50_us\"]:>6} p99 {l[\"p99_us\"]:>7} p99.9 {l[\"p999_us\"]:>7} µs  achieved {r[\"achieved_rate\"]:.0f}/s', file=sys.stderr)" \
            "$raw/$mode-$run.json" "$run" "$mode"
    done
done

# The logging servers' counters, then SIGTERM: the writer closes every
# segment before the process exits.
metric() { curl -s "http://$1/metrics" | awk -v n="$2" '$1 == n {print $2}'; }
for mode in "${logging[@]}"; do
    {
        echo "records $(metric "${admin[$mode]}" quiver_log_records_total)"
        echo "dropped_ring_full $(metric "${admin[$mode]}" 'quiver_log_dropped_total{reason="ring_full"}')"
        echo "writer_idle $(metric "${admin[$mode]}" quiver_log_writer_idle)"
    } >"$raw/counters-$mode.txt"
done
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
pids=()
for mode in "${logging[@]}"; do
    for f in "$data/log-$mode"/decisions-*.arrow; do
        printf '%s %s\n' "$(stat -c %s "$f")" "$("$bin" log inspect "$f" | awk '/^rows:/ {print $4}' | tr -d ',')"
    done >"$raw/segments-$mode.txt"
done

# The writer alone again, after the serving runs, their segments flushed
# first (their writeback would otherwise run beside it).
sync
writer_bench "$raw/writer_after.json"

python3 - "$raw" "$OUT" "$RUNS" "$DURATION" "$RATE" "$CONNECTIONS" "$MODES" "$PLACEMENT" "$SPIN_US" <<'PY'
import json, os, statistics, subprocess, sys
raw, out, runs, duration, rate, conns = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
modes, placement = sys.argv[7].split(), sys.argv[8]
spin_us = int(sys.argv[9]) if sys.argv[9] else None
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown")
load = open("/proc/loadavg").read().split()[:3]
keys = ["p50_us", "p99_us", "p999_us", "max_us"]
servers = {}
for mode in modes:
    rs = [json.load(open(os.path.join(raw, f"{mode}-{r}.json"))) for r in range(1, runs + 1)]
    med = {k: statistics.median(r["latency"][k] for r in rs) for k in keys}
    med["p99_us_runs"] = [r["latency"]["p99_us"] for r in rs]
    med["achieved_rate"] = statistics.median(r["achieved_rate"] for r in rs)
    ns = [list(map(int, open(os.path.join(raw, f"{mode}-{r}.shard_ns")).read().split())) for r in range(1, runs + 1)]
    cpu_us = [n[0] / 1e3 / max(r["received"], 1) for n, r in zip(ns, rs)]
    wait_us = [n[1] / 1e3 / max(r["received"], 1) for n, r in zip(ns, rs)]
    med["shard_cpu_us_per_request"] = round(statistics.median(cpu_us), 3)
    med["shard_cpu_us_per_request_runs"] = [round(c, 3) for c in cpu_us]
    med["shard_wait_us_per_request"] = round(statistics.median(wait_us), 3)
    med["shard_wait_us_per_request_runs"] = [round(w, 3) for w in wait_us]
    med["lost"] = sum(r["lost"] for r in rs)
    def window_us(run, stage):
        for l in open(os.path.join(raw, f"{mode}-{run}.window")):
            if f'stage="{stage}"' in l and 'quantile="0.99"' in l:
                return round(float(l.split()[-1]) * 1e6)
        return None
    for stage in ("socket_wait", "end_to_end"):
        vs = [window_us(r, stage) for r in range(1, runs + 1)]
        read = [v for v in vs if v is not None]
        med[f"server_{stage}_p99_us_runs"] = vs
        med[f"server_{stage}_p99_us"] = statistics.median(read) if read else None
    if mode not in ("off", "busy"):
        c = dict(l.split() for l in open(os.path.join(raw, f"counters-{mode}.txt")))
        segs = [tuple(map(int, l.split())) for l in open(os.path.join(raw, f"segments-{mode}.txt")) if l.strip()]
        bytes_, decisions = sum(s[0] for s in segs), sum(s[1] for s in segs)
        med["records"] = int(float(c.get("records") or 0))
        med["writer_idle"] = int(float(c.get("writer_idle") or 0))
        med["dropped_ring_full"] = int(float(c.get("dropped_ring_full") or 0))
        med["decisions_in_segments"] = decisions
        med["segment_bytes"] = bytes_
        med["bytes_per_decision"] = round(bytes_ / decisions) if decisions else None
    servers[mode] = med
off = servers["off"]["p99_us"] if "off" in servers else None
off_cpu = servers["off"]["shard_cpu_us_per_request"] if "off" in servers else None
for mode in modes:
    if mode != "off" and off is not None:
        servers[mode]["p99_vs_off"] = round(servers[mode]["p99_us"] / max(off, 1), 3)
        servers[mode]["shard_cpu_vs_off"] = round(servers[mode]["shard_cpu_us_per_request"] / max(off_cpu, 1e-9), 3)
writer = json.load(open(os.path.join(raw, "writer.json")))
writer_after = json.load(open(os.path.join(raw, "writer_after.json")))
summary = {"commit": commit, "cpu": cpu, "load_average_after": load, "runs": runs, "duration": duration,
           "rate": rate, "connections": conns, "placement": placement, "spin_before_park_us": spin_us, "servers": servers, "writer": writer,
           "writer_after_serving": writer_after}
name = "decision_log" if spin_us is not None else "decision_log_spin"
json.dump(summary, open(os.path.join(out, f"{name}.json"), "w"), indent=1, sort_keys=True)
lines = [
    "## Decision log: its cost on the shard, the writer's throughput, bytes per decision"
    + ("" if spin_us is not None else " (shards spinning between requests, the default)"),
    "",
    f"`bench/decision_log.sh` at `{commit}` on {cpu} ({os.cpu_count()} vCPUs; load average "
    f"{' '.join(load)} after it). Auction-32 (32 candidates, 80 floats a row), one shard, open loop at {rate:,} "
    f"requests/s, {conns} connections, {runs} interleaved runs of {duration} per server, the other servers stopped "
    "(SIGSTOP) during each; medians of runs. "
    + ("Every thread of a server, the log's writer included, runs on the shard's core (`PLACEMENT=shared`)."
       if placement == "shared" else
       "The writer and the other housekeeping threads run on the load generator's core (`PLACEMENT=housekeeping`)."
       if placement == "housekeeping" else
       "The writer and the other housekeeping threads run on a core of their own (`PLACEMENT=own`).")
    + (" Shards spin the default `spin_before_park_us` before parking." if spin_us is None
       else f" Shards spin {spin_us} µs before parking (`spin_before_park_us`).")
    + " The writer runs as SCHED_IDLE unless the row says `normal`. Shard CPU is the shard's threads' run time "
    "(`/proc/PID/task/TID/schedstat`) over the responses received: "
    + ("its work (it parks when idle), the part of logging's cost the machine's noise hardly moves."
       if spin_us == 0 else "its work and its spinning between requests, so it is not the work alone.")
    + " The shard's run-queue wait (the same file's second field) is the time it was ready to run and "
    "another thread of its core ran instead: what the writer (or anything else) took from it. "
    "The server's p99s are its own `quiver_stage_duration_window` percentiles, read after each run (its last 10 s): "
    "socket wait (from the kernel's receive of a request's bytes to the shard's read of them, every 8th read) "
    "and read to response (the frame's read to its encoded response); the load generator's own delays are not in them.",
    "",
    "| logging | writer | shard CPU µs / request (runs) | CPU / off | shard run-queue wait µs / request (runs) | server p99 µs: socket wait (runs) | server p99 µs: read to response (runs) | p50 µs | p99 µs (runs) | p99.9 µs | p99 / off | achieved /s | records | dropped (ring full) | bytes per decision on disk |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]
def us(v):
    return "–" if v is None else f"{v:,}"
def label(mode):
    return {"off": "off", "busy": "off, and a SCHED_IDLE busy loop on the shard's core"}.get(mode, f"{mode.rstrip('n')}%")
def writer_kind(mode, m):
    if mode in ("off", "busy"):
        return "–"
    if mode.endswith("n"):
        return "normal"
    return "SCHED_IDLE" if m.get("writer_idle") else "idle refused"
for mode in modes:
    m = servers[mode]
    lines.append(
        f"| {label(mode)} | {writer_kind(mode, m)} | {m['shard_cpu_us_per_request']:.2f} "
        f"({', '.join(f'{c:.2f}' for c in m['shard_cpu_us_per_request_runs'])}) | "
        f"{m.get('shard_cpu_vs_off', '–') if mode != 'off' else 1.0} | "
        f"{m['shard_wait_us_per_request']:.2f} ({', '.join(f'{w:.2f}' for w in m['shard_wait_us_per_request_runs'])}) | "
        + " | ".join(f"{us(m[f'server_{st}_p99_us'])} ({', '.join(us(v) for v in m[f'server_{st}_p99_us_runs'])})"
                     for st in ("socket_wait", "end_to_end")) + " | "
        f"{m['p50_us']:.0f} | {m['p99_us']:.0f} ({', '.join(f'{p:,}' for p in m['p99_us_runs'])}) | {m['p999_us']:.0f} | "
        f"{m.get('p99_vs_off', '–') if mode != 'off' else 1.0} | "
        f"{m['achieved_rate']:,.0f} | {m.get('records', '–')} | {m.get('dropped_ring_full', '–')} | "
        f"{m.get('bytes_per_decision') or '–'} |")
short = [label(mode) + ("" if not mode.endswith("n") else " (normal)") for mode in modes
         if servers[mode]["achieved_rate"] < 0.95 * rate]
if short:
    lines += ["", f"**Saturated**: the server with logging {', '.join(short)} answered below 95% of the "
              f"{rate:,}/s offered, so its latencies measure a growing queue, not the log's cost; these p99s "
              "say nothing about the within-5% target. Rerun on a quiet machine."]
lines += [
    "",
    f"The writer alone, before the serving runs (`cargo bench --bench decision_log`: {writer['decisions']:,} decisions of "
    f"{writer['candidates']}x{writer['row_dim']} uniform floats with 24 random bits, drawn afresh per decision, through one ring): "
    f"{writer['decisions_per_s']:,.0f} decisions/s ({writer['rows_per_s']:,.0f} rows/s), "
    f"{writer['file_mb_per_s']:.1f} MB/s of LZ4 Arrow segments, {writer['file_bytes_per_decision']:,.0f} bytes per "
    f"decision ({writer['float_bytes_per_decision']:,.0f} bytes of floats and scores before compression). "
    f"The writer's CPU: {writer['writer_cpu_us_per_decision']:.1f} µs and "
    f"{writer['writer_faults_per_decision']:.2f} page faults per decision (the process's `getrusage` less the "
    "producer thread's). "
    f"The shard's side of it, `ShardLog::put` (encoding one decision into the ring), took "
    f"{writer['put_ns_per_decision']:,.0f} ns a decision (mean over the puts that took their record). "
    f"The same bench after the serving runs: {writer_after['decisions_per_s']:,.0f} decisions/s, "
    f"{writer_after['writer_cpu_us_per_decision']:.1f} µs of the writer's CPU and "
    f"{writer_after['put_ns_per_decision']:,.0f} ns a put per decision.",
    "",
]
open(os.path.join(out, f"{name}.md"), "w").write("\n".join(lines))
print("\n".join(lines))
PY
