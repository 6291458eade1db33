#!/usr/bin/env bash
# What a flood of new TLS handshakes does to scoring, side by side in one
# run: auction-32 over TLS, one shard on core $SERVER_CORE, scored open loop
# at $RATE/s by `quiver bench` (sessions opened before the run) on core
# $GEN_CORE, while $FLOODERS Python threads on that core (at nice 19, so the
# generator is not kept waiting) open TLS connections one after another
# (handshake, then close) as fast as they can.
# Three cases per run:
#
#   - quiet:     no flood;
#   - unlimited: the flood, with tls.handshakes_per_s_max too high to bite;
#   - limited:   the flood, with the default tls.handshakes_per_s_max (250/s
#                a shard after a burst of 100).
#
# Per case: p50, p99, p99.9 and max of the scoring requests (latency from the
# intended send time), the handshakes the flood completed (it runs from 0.3 s
# into the measured run to 0.5 s before its end) and the ones the
# server refused (quiver_tls_handshakes_refused_total). Runs interleave
# (every case of run 1, then run 2, ...). Writes one JSON per run and case to
# $OUT, the medians to bench/results/tls_flood.json and their table to
# bench/results/tls_flood.md (rendered into docs/BENCHMARKS.md by
# bench/report.py).
#
# usage: bench/tls_flood.sh     (RUNS=3 DURATION=5s RATE=10000 FLOODERS=4)
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
DURATION="${DURATION:-5s}"
RATE="${RATE:-10000}"
CONNECTIONS="${CONNECTIONS:-4}"
FLOODERS="${FLOODERS:-4}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
OUT="${OUT:-bench/results/tls-flood}"
CASES="quiet unlimited limited"

BENCH_NAME=tls_flood
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need openssl openssl
need python3 python3
need curl curl
need_two_cores
bench_setup
mkdir -p "$OUT"
[ -n "${SUMMARY_ONLY:-}" ] || rm -f "$OUT"/flood-*.json

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -keyout "$data/server.key" -out "$data/server.crt" -subj /CN=localhost \
    -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" -addext "basicConstraints=critical,CA:FALSE" \
    -addext "extendedKeyUsage=serverAuth" 2>/dev/null || die "openssl could not make a certificate"
for case in $CASES; do
    per_s=250
    [ "$case" = unlimited ] && per_s=1000000
    printf '[tls]\ncert_file = "%s"\nkey_file = "%s"\nhandshakes_per_s_max = %s\n' \
        "$data/server.crt" "$data/server.key" "$per_s" >"$data/$case.toml"
done

declare -A pid
start_server() {
    taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --cores "$SERVER_CORE" --config "$data/$1.toml" >"$data/$1.out" 2>"$data/$1.log" &
    pids+=("$!")
    pid[$1]="$!"
    wait_listening "$data/$1.out" "$data/$1.log"
}
stop_server() { kill -TERM "${pid[$1]}"; wait "${pid[$1]}" || true; }

refused() {
    curl -s "http://$admin_addr/metrics" | awk '/^quiver_tls_handshakes_refused_total / {print $2}'
}

# Opens TLS connections until $1 seconds have passed; prints how many
# handshakes completed and how many were refused (closed before one).
flood() {
    # At the lowest priority: the generator on the same core must not wait
    # for the flood's own handshake work, or its latencies would be ours.
    nice -n 19 taskset -c "$GEN_CORE" python3 - "$listen_addr" "$data/server.crt" "$1" "$FLOODERS" <<'PY'
import socket, ssl, sys, threading, time
host, port = sys.argv[1].rsplit(":", 1)
ctx = ssl.create_default_context(cafile=sys.argv[2])
until = time.monotonic() + float(sys.argv[3])
done, failed = [0], [0]
lock = threading.Lock()
def run():
    ok = bad = 0
    while time.monotonic() < until:
        try:
            with socket.create_connection((host, int(port)), timeout=2) as raw:
                with ctx.wrap_socket(raw, server_hostname=host) as s:
                    s.do_handshake()
                    ok += 1
        except (OSError, ssl.SSLError):
            bad += 1
    with lock:
        done[0] += ok
        failed[0] += bad
threads = [threading.Thread(target=run) for _ in range(int(sys.argv[4]))]
for t in threads: t.start()
for t in threads: t.join()
print(done[0], failed[0])
PY
}

COMMIT="$(git rev-parse --short HEAD)"
export COMMIT
seconds="${DURATION%s}"
[ -n "${SUMMARY_ONLY:-}" ] && RUNS=0
for run in $(seq "$RUNS"); do
    for case in $CASES; do
        start_server "$case"
        taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --connections "$CONNECTIONS" --budget-us 1000000 \
            --tls-ca "$data/server.crt" --duration 1s --rate 5000 --json >/dev/null   # warm up
        flooded="0 0"
        # The generator's connections first (the flood would spend the
        # limited server's handshake budget before they were made), then the
        # flood, over all but the last half second of the measured run.
        taskset -c "$GEN_CORE" "$bin" bench --addr "$listen_addr" --connections "$CONNECTIONS" --budget-us 1000000 \
            --tls-ca "$data/server.crt" --duration "$DURATION" --rate "$RATE" --json >"$data/open.json" &
        generator=$!
        if [ "$case" != quiet ]; then
            sleep 0.3
            flood "$(python3 -c "print($seconds - 0.8)")" >"$data/flood.txt"
            flooded="$(cat "$data/flood.txt")"
        fi
        wait "$generator" || die "quiver bench failed in case $case (see $data/$case.log)"
        server_refused="$(refused)"
        python3 - "$OUT/flood-$case-$run.json" "$case" "$run" "$data/open.json" $flooded "$server_refused" "$seconds" <<'PY'
import json, os, sys
f, case, run, path, done, failed, refused, seconds = sys.argv[1:9]
r = json.load(open(path))
out = {"case": case, "run": int(run), "commit": os.environ["COMMIT"],
       **{k: r["latency"][k] for k in ["p50_us", "p99_us", "p999_us", "max_us"]},
       "offered_rate": r["offered_rate"], "achieved_rate": r["achieved_rate"], "lost": r["lost"],
       "errors": len(r["connection_errors"]), "generator_saturated": r["generator_saturated"],
       "handshakes_per_s": int(done) / (float(seconds) - 0.8), "flood_failures": int(failed),
       "server_refused": int(float(refused or 0))}
json.dump(out, open(f, "w"), indent=1, sort_keys=True)
print(f"run {run} {case:>9}: p99 {out['p99_us']} µs p99.9 {out['p999_us']} µs; "
      f"{out['handshakes_per_s']:.0f} handshakes/s, {out['server_refused']} refused", file=sys.stderr)
PY
        stop_server "$case"
    done
done

python3 - "$OUT" "$DURATION" "$RATE" "$FLOODERS" <<'PY'
import glob, json, os, platform, statistics, sys
out, duration, rate, flooders = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
by = {}
for f in glob.glob(os.path.join(out, "flood-*.json")):
    r = json.load(open(f))
    by.setdefault(r["case"], []).append(r)
if not by:
    sys.exit("tls_flood: no runs in " + out)
med = statistics.median
runs = max(r["run"] for rs in by.values() for r in rs)
commit = next(iter(by.values()))[0]["commit"]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
keys = ["p50_us", "p99_us", "p999_us", "max_us", "handshakes_per_s", "server_refused"]
summary = {"runs": runs, "duration": duration, "rate": rate, "flooders": flooders, "commit": commit,
           "machine": {"cpu": cpu, "cores": os.cpu_count()},
           "cases": {c: {k: med(r[k] for r in rs) for k in keys} | {
               "lost": sum(r["lost"] for r in rs), "errors": sum(r["errors"] for r in rs)} for c, rs in by.items()}}
json.dump(summary, open("bench/results/tls_flood.json", "w"), indent=1, sort_keys=True)
C = summary["cases"]
names = {"quiet": "no flood", "unlimited": "flood, no handshake limit",
         "limited": "flood, tls.handshakes_per_s_max = 250 (default)"}
md = []
w = md.append
w("## A flood of TLS handshakes against scoring")
w("")
w(f"Written by `bench/tls_flood.sh` (commit `{commit}`; {cpu}, {os.cpu_count()} cores): auction-32 over TLS, one "
  f"shard on core 0, scored open loop at {rate:,}/s for {duration} by `quiver bench` (sessions opened before the "
  f"run) on core 1, while {flooders} Python threads on core 1 (at nice 19) open TLS connections one after another (handshake, "
  f"then close) as fast as they can. Latency from the intended send time; runs interleave; medians of {runs} runs.")
w("")
w("| case | handshakes/s completed | refused by the server | p50 µs | p99 µs | p99.9 µs | max µs |")
w("|---|---:|---:|---:|---:|---:|---:|")
for c in ["quiet", "unlimited", "limited"]:
    if c in C:
        s = C[c]
        w(f"| {names[c]} | {s['handshakes_per_s']:,.0f} | {s['server_refused']:,.0f} | {s['p50_us']:,.0f} | "
          f"{s['p99_us']:,.0f} | {s['p999_us']:,.0f} | {s['max_us']:,.0f} |")
w("")
if all(c in C for c in ["quiet", "unlimited", "limited"]):
    q, u, l = C["quiet"], C["unlimited"], C["limited"]
    w(f"- Without a limit the flood took p99 to {u['p99_us'] / max(q['p99_us'], 1):.1f}x and p99.9 to "
      f"{u['p999_us'] / max(q['p999_us'], 1):.1f}x the quiet run's; with the default limit, "
      f"{l['p99_us'] / max(q['p99_us'], 1):.1f}x and {l['p999_us'] / max(q['p999_us'], 1):.1f}x (ratios of medians).")
    try:
        cost = json.load(open("bench/results/tls_cost.json"))["servers"]
        hs_us, conn_us = cost["conn-tls"]["cpu_us_per_connection"], cost["conn"]["cpu_us_per_connection"]
        share = lambda per_s, us: per_s * us / 1e4  # percent of one core
        refused_per_s = l["server_refused"] / (float(duration.rstrip("s")) - 0.8)
        w(f"- The limit held the shard to {l['handshakes_per_s']:,.0f} handshakes/s against "
          f"{u['handshakes_per_s']:,.0f} without it: at the {hs_us:,.0f} µs of server CPU a TLS connection costs "
          f"(`bench/tls_cost.sh`, `tls_cost.json`), about {share(l['handshakes_per_s'], hs_us):.0f}% of the shard's "
          f"core against {share(u['handshakes_per_s'], hs_us):.0f}%. The refused connections still cost an accept "
          f"and a close each ({conn_us:,.0f} µs as plain TCP there), about {refused_per_s:,.0f}/s here, "
          f"{share(refused_per_s, conn_us):.0f}% of the core.")
    except (OSError, KeyError, ValueError):
        pass
    w("- The tail under the flood is about the same with and without the limit. On this 2-core VM the flood's "
      "own client and kernel (loopback TCP) work shares core 1 with the generator, so this run does not separate "
      "the server's part of the tail from the machine's; what the limit is shown to bound is the shard's CPU "
      "spent on handshakes.")
lost = sum(s["lost"] for s in C.values())
errors = sum(s["errors"] for s in C.values())
w(f"- Scoring requests lost over all runs: {lost}; scoring connection errors: {errors}.")
w("")
open("bench/results/tls_flood.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
