#!/usr/bin/env bash
# Plain MLPs before and after graph models (issue 12: "plain Dense chains
# keep today's fused INT8 tiles, no regression: criterion before and
# after"). The criterion group `mlp_forward` of bench/kernels.rs (the
# auction-32 MLP, f32, dynamic and static INT8 on every kernel, FP8, at the
# batches it lists) is built from the tree at $BASE (default: the commit
# before graph models, b379cfe^) and from HEAD, and the two binaries run
# alternately $REPEATS times on core $CORE, so both see the same machine.
# Figures are medians over the repeats of each run's median ns per call;
# the ratio is after/before (below 1: faster now).
#
# Writes bench/results/int8_before_after.{json,md} (rendered into
# docs/BENCHMARKS.md by bench/report.py).
#
# usage: bench/int8_before_after.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BASE="${BASE:-b379cfe^}"
REPEATS="${REPEATS:-3}"
CORE="${CORE:-1}"
RESULTS=bench/results

BENCH_NAME=int8_before_after
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
base="$(git rev-parse --short "$BASE")"
head="$(git rev-parse --short HEAD)"
if [ -n "$(git status --porcelain -- src bench/kernels.rs Cargo.toml Cargo.lock)" ]; then
    die "commit first (the figures name HEAD, $head)"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base" "$RESULTS"
git archive "$base" | tar -x -C "$work/base"

echo "== building the kernels bench at $base and at $head"
build_bench_pair kernels "$work/base" "$work"

for r in $(seq "$REPEATS"); do
    for side in before after; do
        echo "== repeat $r: $side"
        CRITERION_HOME="$work/criterion-$side" taskset -c "$CORE" "$work/kernels-$side" --bench mlp_forward \
            >"$work/$side-$r.txt" 2>&1 || { cat "$work/$side-$r.txt"; exit 1; }
    done
done

python3 - "$work" "$RESULTS" "$REPEATS" "$base" "$head" <<'PY'
import json, os, re, statistics, sys
work, results, repeats, base, head = sys.argv[1:]
repeats = int(repeats)
row = re.compile(r"^\| (\S+) \| (\d+) \| ([\d.]+) \|")
def medians(side, r):
    out = {}
    for line in open(f"{work}/{side}-{r}.txt"):
        m = row.match(line)
        if m:
            out[(m[1], int(m[2]))] = float(m[3])
    if not out:
        sys.exit(f"int8_before_after: no summary table in {side}-{r}.txt")
    return out
runs = {s: [medians(s, r) for r in range(1, repeats + 1)] for s in ("before", "after")}
keys = sorted(set(runs["before"][0]) & set(runs["after"][0]))
if not keys:
    sys.exit("int8_before_after: the two benches share no backend and batch")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
res = {"machine": {"cpu": cpu, "cores": os.cpu_count()}, "before": base, "after": head, "repeats": repeats,
       "rows": []}
for k in keys:
    b = statistics.median(x[k] for x in runs["before"])
    a = statistics.median(x[k] for x in runs["after"])
    res["rows"].append({"backend": k[0], "rows": k[1], "before_us": b, "after_us": a, "ratio": a / b,
                        "before_each_us": [x[k] for x in runs["before"]],
                        "after_each_us": [x[k] for x in runs["after"]]})
json.dump(res, open(f"{results}/int8_before_after.json", "w"), indent=1, sort_keys=True)
o = ["## Plain MLPs before and after graph models", ""]
o.append(f"Measured by `bench/int8_before_after.sh` on {cpu} ({os.cpu_count()} vCPUs): the criterion group "
         f"`mlp_forward` of `bench/kernels.rs` (the auction-32 MLP) built at `{base}` (before graph models) and at "
         f"`{head}`, run alternately {repeats} times on one core. µs per call, medians over the repeats of each "
         "run's median; ratio after/before (below 1: faster now).")
o.append("")
o.append("| backend | rows | before (µs) | after (µs) | after/before |")
o.append("|---|---:|---:|---:|---:|")
for x in res["rows"]:
    o.append(f"| {x['backend']} | {x['rows']} | {x['before_us']:.2f} | {x['after_us']:.2f} | {x['ratio']:.3f} |")
ratios = sorted(x["ratio"] for x in res["rows"])
int8 = [x["ratio"] for x in res["rows"] if x["backend"].startswith("int8")]
o.append("")
o.append(f"Over all {len(ratios)} backend and batch pairs the median ratio is {statistics.median(ratios):.3f} "
         f"(range {ratios[0]:.3f} to {ratios[-1]:.3f}); over the INT8 ones, {statistics.median(int8):.3f}.")
open(f"{results}/int8_before_after.md", "w").write("\n".join(o) + "\n")
print("\n".join(o))
PY
