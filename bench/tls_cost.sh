#!/usr/bin/env bash
# What TLS on the scoring port costs, side by side in one run: the protocol
# floor (`serve --floor`) and auction-32, each served over plain TCP and over
# TLS (`--tls-cert/--tls-key`, a P-256 certificate made here with openssl),
# one shard each on core $SERVER_CORE, driven by `quiver bench` (with
# `--tls-ca` for the TLS servers) on core $GEN_CORE. Per run and server:
#
#   - closed loop, $CONNECTIONS connections, one request in flight each, for
#     $DURATION: throughput, and the server's CPU time per request (its
#     threads' run time from /proc, over the requests answered);
#   - open loop at each rate of $RATES for $DURATION: p50, p99, p99.9, max
#     (latency from the intended send time);
#   - connections: $HANDSHAKES new connections one after another (Python;
#     for TLS its ssl client completes a handshake), each closed at once,
#     to two more floor servers, plain and TLS, whose reactors park at once
#     (`spin_before_park_us = 0`: otherwise each of a handshake's round trips
#     adds the default 50 µs of spinning): the server's CPU per connection.
#
# Each server runs only while it is measured (started, warmed up for 1 s,
# measured, stopped), and runs interleave (run 1 of every server, then run
# 2, ...). Writes one JSON
# per run to $OUT, the medians to bench/results/tls_cost.json and their
# table to bench/results/tls_cost.md (rendered into docs/BENCHMARKS.md by
# bench/report.py).
#
# usage: bench/tls_cost.sh     (RUNS=5 DURATION=5s RATES="10000 30000")
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-5}"
DURATION="${DURATION:-5s}"
RATES="${RATES:-10000 30000}"
CONNECTIONS="${CONNECTIONS:-4}"
HANDSHAKES="${HANDSHAKES:-300}"
SERVER_CORE="${SERVER_CORE:-0}"
GEN_CORE="${GEN_CORE:-1}"
OUT="${OUT:-bench/results/tls}"
SERVERS="floor floor-tls quiver quiver-tls"
CONN_SERVERS="conn conn-tls"

BENCH_NAME=tls_cost
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need openssl openssl
need python3 python3
need_two_cores
bench_setup
mkdir -p "$OUT"
[ -n "${SUMMARY_ONLY:-}" ] || rm -f "$OUT"/tls-*.json

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -keyout "$data/server.key" -out "$data/server.crt" -subj /CN=localhost \
    -addext "subjectAltName=DNS:localhost,IP:127.0.0.1" -addext "basicConstraints=critical,CA:FALSE" \
    -addext "extendedKeyUsage=serverAuth" 2>/dev/null || die "openssl could not make a certificate"

printf '[reactor]\nspin_before_park_us = 0\n' >"$data/nospin.toml"
# Each server runs only while it is measured: idle servers on the same
# core would wake it with their timers, into the others' tails.
declare -A addr pid
start_server() {
    local server="$1" flags=()
    case "$server" in floor*) flags+=(--floor) ;; conn*) flags+=(--floor --config "$data/nospin.toml") ;; esac
    case "$server" in *-tls) flags+=(--tls-cert "$data/server.crt" --tls-key "$data/server.key") ;; esac
    taskset -c "$SERVER_CORE" "$bin" serve --data-dir "$data" --listen 127.0.0.1:0 --admin 127.0.0.1:0 \
        --cores "$SERVER_CORE" "${flags[@]}" >"$data/$server.out" 2>"$data/$server.log" &
    pids+=("$!")
    pid[$server]="$!"
    wait_listening "$data/$server.out" "$data/$server.log"
    addr[$server]="$listen_addr"
}
stop_server() { kill -TERM "${pid[$1]}"; wait "${pid[$1]}" || true; }

# CPU time of a process so far, in ns: the sum over its threads of the
# scheduler's run time (/proc/PID/task/*/schedstat; clock ticks would be too
# coarse for a few hundred connections).
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {printf "%d\n", s}'; }

gen() {
    local server="$1"; shift
    local tls=()
    case "$server" in *-tls) tls=(--tls-ca "$data/server.crt") ;; esac
    taskset -c "$GEN_CORE" "$bin" bench --addr "${addr[$server]}" --connections "$CONNECTIONS" \
        --budget-us 1000000 "${tls[@]}" "$@"
}

connections() {
    local tls=0
    case "$1" in *-tls) tls=1 ;; esac
    taskset -c "$GEN_CORE" python3 - "${addr[$1]}" "$data/server.crt" "$HANDSHAKES" "$tls" <<'PY'
import socket, ssl, sys
host, port = sys.argv[1].rsplit(":", 1)
ctx = ssl.create_default_context(cafile=sys.argv[2])
for _ in range(int(sys.argv[3])):
    with socket.create_connection((host, int(port))) as raw:
        if sys.argv[4] == "1":
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.do_handshake()
        else:
            pass
PY
}

COMMIT="$(git rev-parse --short HEAD)"
export COMMIT
# SUMMARY_ONLY=1 renders the runs already in $OUT again, measuring nothing.
[ -n "${SUMMARY_ONLY:-}" ] && RUNS=0
for run in $(seq "$RUNS"); do
    for server in $SERVERS; do
        start_server "$server"
        gen "$server" --duration 1s --rate 5000 --json >/dev/null   # warm up
        f="$OUT/tls-$server-$run.json"
        before="$(cpu_ns "${pid[$server]}")"
        gen "$server" --duration "$DURATION" --pipeline 1 --json >"$data/closed.json"
        after="$(cpu_ns "${pid[$server]}")"
        opens=()
        for rate in $RATES; do
            gen "$server" --duration "$DURATION" --rate "$rate" --json >"$data/open-$rate.json"
            opens+=("$data/open-$rate.json")
        done
        python3 - "$f" "$server" "$run" "$before" "$after" "$data/closed.json" "${opens[@]}" <<'PY'
import json, os, sys
(f, server, run, before, after, closed), opens = sys.argv[1:7], sys.argv[7:]
c = json.load(open(closed))
tls = server.endswith("-tls")
out = {
    "server": server, "run": int(run), "commit": os.environ["COMMIT"],
    "closed": {"achieved_rate": c["achieved_rate"], "received": c["received"], "lost": c["lost"],
               "errors": len(c["connection_errors"]), "p50_us": c["latency"]["p50_us"],
               "p99_us": c["latency"]["p99_us"],
               "server_cpu_us_per_request": (int(after) - int(before)) / 1e3 / max(c["received"], 1)},
    "open": {},
}
for path in opens:
    r = json.load(open(path))
    out["open"][str(int(r["offered_rate"]))] = {
        **{k: r["latency"][k] for k in ["p50_us", "p99_us", "p999_us", "max_us"]},
        "achieved_rate": r["achieved_rate"], "lost": r["lost"], "errors": len(r["connection_errors"]),
        "generator_saturated": r["generator_saturated"]}
json.dump(out, open(f, "w"), indent=1, sort_keys=True)
cl = out["closed"]
print(f"run {run} {server:>10}: closed {cl['achieved_rate']:>8.0f}/s {cl['server_cpu_us_per_request']:6.2f} µs CPU/request; "
      + "; ".join(f"{rate}/s p99 {o['p99_us']} µs" for rate, o in out["open"].items()), file=sys.stderr)
PY
        stop_server "$server"
    done
    for server in $CONN_SERVERS; do
        start_server "$server"
        before="$(cpu_ns "${pid[$server]}")"
        start="$(date +%s.%N)"
        connections "$server"
        end="$(date +%s.%N)"
        after="$(cpu_ns "${pid[$server]}")"
        python3 - "$OUT/tls-$server-$run.json" "$server" "$run" "$before" "$after" "$start" "$end" "$HANDSHAKES" <<'PY'
import json, os, sys
f, server, run, before, after, start, end, n = sys.argv[1:9]
n = int(n)
out = {"server": server, "run": int(run), "commit": os.environ["COMMIT"], "connections": n,
       "server_cpu_us_per_connection": (int(after) - int(before)) / 1e3 / n,
       "client_wall_us_per_connection": (float(end) - float(start)) * 1e6 / n}
json.dump(out, open(f, "w"), indent=1, sort_keys=True)
print(f"run {run} {server:>10}: {out['server_cpu_us_per_connection']:.0f} µs CPU a connection", file=sys.stderr)
PY
        stop_server "$server"
    done
done

python3 - "$OUT" "$DURATION" "$CONNECTIONS" "$HANDSHAKES" <<'PY'
import glob, json, os, platform, statistics, subprocess, sys
out, duration, conns, n_hs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
by = {}
for f in glob.glob(os.path.join(out, "tls-*.json")):
    r = json.load(open(f))
    by.setdefault(r["server"], []).append(r)
med = statistics.median
runs = max(r["run"] for rs in by.values() for r in rs)
# The commit measured, as the runs recorded it (a re-render keeps it).
commit = next(iter(by.values()))[0].get("commit") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
summary = {"runs": runs, "duration": duration, "connections": conns, "commit": commit,
           "machine": {"cpu": cpu, "cores": os.cpu_count()}, "servers": {}}
for server, rs in sorted(by.items()):
    if server.startswith("conn"):
        summary["servers"][server] = {
            "cpu_us_per_connection": med(r["server_cpu_us_per_connection"] for r in rs),
            "wall_us_per_connection": med(r["client_wall_us_per_connection"] for r in rs)}
        continue
    cpus = [r["closed"]["server_cpu_us_per_request"] for r in rs]
    s = {"closed_rate": med(r["closed"]["achieved_rate"] for r in rs),
         "cpu_us_per_request": med(cpus), "cpu_us_per_request_min": min(cpus), "cpu_us_per_request_max": max(cpus),
         "lost": sum(r["closed"]["lost"] for r in rs) + sum(o["lost"] for r in rs for o in r["open"].values()),
         "errors": sum(r["closed"]["errors"] for r in rs) + sum(o["errors"] for r in rs for o in r["open"].values()),
         "open": {}}
    for rate in rs[0]["open"]:
        s["open"][rate] = {k: med(r["open"][rate][k] for r in rs) for k in ["p50_us", "p99_us", "p999_us", "max_us"]}
    summary["servers"][server] = s
json.dump(summary, open("bench/results/tls_cost.json", "w"), indent=1, sort_keys=True)

names = {"floor": "protocol floor, plain TCP", "floor-tls": "protocol floor, TLS",
         "quiver": "auction-32, plain TCP", "quiver-tls": "auction-32, TLS"}
S = summary["servers"]
rates = sorted(S["floor"]["open"], key=int)
md = []
w = md.append
w("## TLS on the scoring port: its cost per request")
w("")
w(f"Written by `bench/tls_cost.sh` (commit `{commit}`; {cpu}, {os.cpu_count()} cores): the protocol floor "
  "(`serve --floor`) and auction-32, each served over plain TCP and over TLS (`serve --tls-cert/--tls-key`, "
  "a P-256 certificate; rustls's default suite, TLS 1.3 with AES-128-GCM here), one shard each on core 0, "
  "driven by `quiver bench` (`--tls-ca` for TLS; sessions opened before the run) on core 1, "
  f"{conns} connections. Closed loop: one request in flight per connection for {duration}; the server's CPU "
  "per request is its threads' run time (`/proc/PID/task/*/schedstat`) over the requests answered. Open loop: uniform arrivals, "
  f"latency from the intended send time, {duration} per rate. Runs interleave; medians of {runs} runs.")
w("")
w("| server | closed-loop req/s | server CPU µs / request (min–max) | TLS extra µs / request (medians) | "
  + " | ".join(f"{int(r):,}/s p50 · p99 · p99.9 µs" for r in rates) + " |")
w("|---|---:|---:|---:|" + "---:|" * len(rates))
for key in ["floor", "floor-tls", "quiver", "quiver-tls"]:
    s = S[key]
    extra = ""
    if key.endswith("-tls"):
        extra = f"{s['cpu_us_per_request'] - S[key[:-4]]['cpu_us_per_request']:+.2f}"
    cells = [f"{s['open'][r]['p50_us']:,.0f} · {s['open'][r]['p99_us']:,.0f} · {s['open'][r]['p999_us']:,.0f}" for r in rates]
    cpu = f"{s['cpu_us_per_request']:.2f} ({s['cpu_us_per_request_min']:.2f}–{s['cpu_us_per_request_max']:.2f})"
    w(f"| {names[key]} | {s['closed_rate']:,.0f} | {cpu} | {extra} | " + " | ".join(cells) + " |")
w("")
for key in ["floor", "quiver"]:
    p, t = S[key], S[key + "-tls"]
    # (ratios of medians)
    ratios = "; ".join(f"p99 at {int(r):,}/s {t['open'][r]['p99_us'] / max(p['open'][r]['p99_us'], 1):.2f}x" for r in rates)
    w(f"- {names[key].split(',')[0]}: TLS serves {t['closed_rate'] / p['closed_rate']:.2f}x the plain closed-loop "
      f"rate at {t['cpu_us_per_request'] / p['cpu_us_per_request']:.2f}x the CPU per request; {ratios}.")
cp, ct = S["conn"], S["conn-tls"]
w(f"- A new connection costs the server {cp['cpu_us_per_connection']:,.0f} µs of CPU over plain TCP and "
  f"{ct['cpu_us_per_connection']:,.0f} µs with its TLS handshake (X25519 and an ECDSA P-256 signature, run on "
  f"the shard's reactor; {ct['wall_us_per_connection']:,.0f} µs end to end from Python's `ssl`): {n_hs} "
  "connections a run, opened one after another and closed at once, to two floor servers that park at once "
  "(`spin_before_park_us = 0`; with the default 50 µs each round trip of a handshake adds that much spinning). "
  "A cost bidders keeping their connections open pay once; a reconnect storm of N clients costs a shard N times it.")
w("- The open-loop tails of one shard on this VM move between runs, in either direction, by more than TLS's CPU "
  "cost could explain (see \"Tail latency side by side with Redis\" above): the p99 and p99.9 ratios here are "
  "of medians of noisy runs and do not isolate TLS. The server's CPU per request is the cost figure; its "
  "range over the runs (in the table) is the noise to read it against.")
lost = sum(s.get("lost", 0) for s in S.values())
errors = sum(s.get("errors", 0) for s in S.values())
w(f"- Requests lost over all runs: {lost}; connection errors: {errors}.")
w("")
open("bench/results/tls_cost.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
