#!/usr/bin/env bash
# Feature lookups before and after feature groups (issue 33: "a string-key
# lookup ≤ 1.5× a u64 one; auction-32 itself no slower than before,
# before/after in one run"). The criterion benches of bench/micro.rs are
# built from the tree at $BASE (default: 36ba651, the commit before feature
# groups) and from HEAD, and the two binaries run alternately $REPEATS
# times on core $CORE, so both see the same machine:
#
# - before and after: `replica 1M x 32 f32` (the auction-32 shape's 1 + 32
#   lookups) and `request path auction-32` (the whole `RequestPath::handle`);
# - after only (the benches did not exist before): `keys 1M x 32 f32`
#   (string keys against u64 keys, the same rows keyed both ways),
#   `request-scope lookups` (the fraud shape: five groups, two by string)
#   and `auction lookups` (the auction shape: 3 request-scope lookups and
#   32 ads × ad, campaign, advertiser through the rows' links, beside the
#   auction-32 shape's 1 + 32 in the same group).
#
# Figures are medians over the repeats of each run's median, in µs.
# Writes bench/results/lookups_before_after.{json,md} (rendered into
# docs/BENCHMARKS.md by bench/report.py); with OUT=NAME, NAME.{json,md}
# instead, headed with the CPU model, so that a second machine kind's
# figures (OUT=lookups_before_after_amd) sit beside the first's.
#
# usage: bench/lookups_before_after.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="${BASE:-36ba651}"
REPEATS="${REPEATS:-3}"
CORE="${CORE:-1}"
RESULTS=bench/results
OUT="${OUT:-lookups_before_after}"
FILTER='replica 1M|request path auction-32|keys 1M|request-scope|auction lookups'

BENCH_NAME=lookups_before_after
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
base="$(git rev-parse --short "$BASE")"
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain -- src bench/micro.rs Cargo.toml Cargo.lock)" ]; then
    die "commit first (the figures name HEAD, $head)"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base" "$RESULTS"
git archive "$base" | tar -x -C "$work/base"

echo "== building the micro bench at $base and at $head"
build_bench_pair micro "$work/base" "$work"

for r in $(seq "$REPEATS"); do
    for side in before after; do
        echo "== repeat $r: $side"
        CRITERION_HOME="$work/criterion-$side" taskset -c "$CORE" "$work/micro-$side" --bench "$FILTER" \
            >"$work/$side-$r.txt" 2>&1 || { cat "$work/$side-$r.txt"; exit 1; }
    done
done

python3 - "$work" "$RESULTS" "$REPEATS" "$base" "$head" "$OUT" <<'PY'
import json, os, re, statistics, sys
work, results, repeats, base, head, out = sys.argv[1:]
repeats = int(repeats)
UNIT = {"ps": 1e-6, "ns": 1e-3, "µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
time_re = re.compile(r"time:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]")

def medians(side, r):
    """Bench name -> median µs, from criterion's report: a name line, then
    (on it or the next line) `time: [lo unit median unit hi unit]`."""
    out, name = {}, None
    for line in open(f"{work}/{side}-{r}.txt"):
        m = time_re.search(line)
        if m and name:
            out[name] = float(m[1]) * UNIT[m[2]]
            name = None
            continue
        head_part = line.split("time:")[0].strip()
        if head_part and "/" in head_part and not head_part.startswith(("Benchmarking", "Found", "Warning")):
            name = head_part
            m = time_re.search(line)
            if m:
                out[name] = float(m[1]) * UNIT[m[2]]
                name = None
    if not out:
        sys.exit(f"lookups_before_after: no criterion figures in {side}-{r}.txt")
    return out

runs = {s: [medians(s, r) for r in range(1, repeats + 1)] for s in ("before", "after")}
def med(side, name):
    vals = [x[name] for x in runs[side] if name in x]
    return statistics.median(vals) if len(vals) == repeats else None

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
names_after = sorted(set(runs["after"][0]))
rows = []
for n in names_after:
    rows.append({"bench": n, "before_us": med("before", n), "after_us": med("after", n)})
for x in rows:
    x["ratio"] = x["after_us"] / x["before_us"] if x["before_us"] and x["after_us"] else None
after = {x["bench"]: x["after_us"] for x in rows}
def pick(part):
    hits = [v for k, v in after.items() if part in k]
    if len(hits) != 1:
        sys.exit(f"lookups_before_after: expected one bench named like '{part}', found {len(hits)}")
    return hits[0]
derived = {
    "string_over_u64_one_by_one": pick("string lookups, one by one") / pick("u64 lookups, one by one"),
    "string_over_u64_batched": pick("string lookups, batched") / pick("u64 lookups, batched"),
    "fraud_shape_over_auction32_lookups": pick("slots then rows prefetched") / pick("batched with prefetch, hit"),
    "auction_shape_over_auction32_lookups": pick("via links") / pick("auction-32 shape: 1 user + 32 items"),
}
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "before": base, "after": head, "repeats": repeats,
       "rows": rows, "derived": derived}
json.dump(res, open(f"{results}/{out}.json", "w"), indent=1, sort_keys=True)
on = "" if out == "lookups_before_after" else f" on {cpu}"
o = [f"## Feature lookups before and after feature groups{on}", ""]
o.append(f"Measured by `bench/lookups_before_after.sh` on {cpu} ({os.cpu_count()} vCPUs): the criterion benches "
         f"of `bench/micro.rs` built at `{base}` (before feature groups) and at `{head}`, run alternately "
         f"{repeats} times on one core. µs per iteration, medians over the repeats of each run's median; "
         "ratio after/before (below 1: faster now); a bench that did not exist before has no before figure.")
o.append("")
o.append("| bench | before (µs) | after (µs) | after/before |")
o.append("|---|---:|---:|---:|")
for x in rows:
    b = f"{x['before_us']:.3f}" if x["before_us"] else "–"
    r = f"{x['ratio']:.3f}" if x["ratio"] else "–"
    o.append(f"| {x['bench']} | {b} | {x['after_us']:.3f} | {r} |")
o.append("")
o.append(f"A string-key lookup costs {derived['string_over_u64_one_by_one']:.2f}× a u64 one one by one and "
         f"{derived['string_over_u64_batched']:.2f}× batched (the issue's target: at most 1.5×; the same 1M rows of "
         "32 floats, keyed by 16-hex-character fingerprints in a group with `key_bytes_max = 16`, whose rows hold "
         "the 16 key bytes and their length beside the u64 row's header). The fraud shape's five "
         "request-scope lookups in five groups, two by string key, prefetched across groups, take "
         f"{derived['fraud_shape_over_auction32_lookups']:.2f}× the auction-32 shape's 1 + 32 batched lookups. "
         "The auction shape's 3 request-scope lookups and 32 ads × (ad, campaign, advertiser), the parents "
         "reached through each row's link (99 lookups), take "
         f"{derived['auction_shape_over_auction32_lookups']:.2f}× the auction-32 shape's 33 in the same group "
         "(`auction lookups`: the auction example's tables, 1M users, devices and ads; the issue's target: at most 3×).")
open(f"{results}/{out}.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
