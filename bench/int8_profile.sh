#!/usr/bin/env bash
# Where the INT8 kernel's time goes, per ISA path, side by side in one run
# (issue 34: "auction-32 INT8 kernel at 32 rows <= 2.2 us"). For each kernel
# of $KERNELS: `quiver time-model --one-request` on the demo's auction-32
# model at $ROWS rows (the median of $ITERS calls, $REPEATS runs alternating
# the kernels, the median of those), then one `perf record -e cycles:u` of
# a long time-model run whose samples are split by symbol into the dynamic
# activation quantization (`quantize_rows_*`), the GEMM with its epilogue
# (`gemm*`, the AMX tiles or the VNNI loop, and the dequantizing epilogue
# fused into it) and the rest (the layer loop, the output). Each part's
# share times the median gives its microseconds.
#
# Writes bench/results/int8_profile.{json,md} (rendered into
# docs/BENCHMARKS.md by bench/report.py) and prints the latter.
#
# usage: bench/int8_profile.sh   (KERNELS="avx512-vnni amx" ROWS=32 CORE=1)
set -euo pipefail
cd "$(dirname "$0")/.."

KERNELS="${KERNELS:-avx512-vnni amx}"
ROWS="${ROWS:-32}"
ITERS="${ITERS:-5000}"
REPEATS="${REPEATS:-3}"
CORE="${CORE:-1}"
RESULTS=bench/results

BENCH_NAME=int8_profile
# shellcheck source=bench/lib.sh
. bench/lib.sh
need taskset util-linux
need perf linux-perf
if [ -n "$(git status --porcelain -- src Cargo.toml Cargo.lock)" ]; then
    die "commit first (the figures name HEAD)"
fi
bench_setup
mkdir -p "$RESULTS"

for r in $(seq "$REPEATS"); do
    for k in $KERNELS; do
        taskset -c "$CORE" "$bin" time-model --model "$data/model.qm" --backend int8 --kernel "$k" \
            --rows "$ROWS" --iters "$ITERS" --one-request 2>/dev/null >"$data/time-$k-$r.json" \
            || die "time-model --kernel $k failed (does this CPU run it?)"
    done
done
for k in $KERNELS; do
    # About 2 s of samples: enough for shares to settle to a per cent.
    taskset -c "$CORE" perf record -q -e cycles:u -o "$data/perf-$k.data" \
        "$bin" time-model --model "$data/model.qm" --backend int8 --kernel "$k" \
        --rows "$ROWS" --iters 200000 --one-request >/dev/null 2>&1 \
        || die "perf record refused (kernel.perf_event_paranoid is $(cat /proc/sys/kernel/perf_event_paranoid))"
    perf report -i "$data/perf-$k.data" --no-children --sort symbol --stdio 2>/dev/null >"$data/perf-$k.txt"
done

python3 - "$data" "$RESULTS" "$REPEATS" "$ROWS" "$KERNELS" <<'PY'
import json, re, statistics, subprocess, sys
sys.path.insert(0, "bench")
from provenance import git_commit

data, results, repeats, rows, kernels = sys.argv[1:]
repeats, rows, kernels = int(repeats), int(rows), kernels.split()
line_re = re.compile(r"^\s*([0-9.]+)%\s+\[\.\]\s+(.*)$")

def part(symbol):
    if "quantize_rows" in symbol:
        return "quantize"
    if re.search(r"::gemm\w*$", symbol) or "::gemm_" in symbol:
        return "gemm"
    return "rest"

out = {"commit": git_commit(), "rows": rows, "kernels": {}}
out["cpu"] = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
out["flags"] = [f for f in ("amx_tile", "amx_int8", "amx_bf16", "avx512_vnni", "avx512f") if f in flags]
for k in kernels:
    medians = []
    for r in range(1, repeats + 1):
        with open(f"{data}/time-{k}-{r}.json") as f:
            medians += [json.loads(l)["median_us"] for l in f if l.startswith("{")]
    shares = {"quantize": 0.0, "gemm": 0.0, "rest": 0.0}
    for l in open(f"{data}/perf-{k}.txt"):
        m = line_re.match(l)
        if m:
            shares[part(m.group(2).strip())] += float(m.group(1))
    total = sum(shares.values()) or 1.0
    median = statistics.median(medians)
    out["kernels"][k] = {
        "median_us": median,
        "runs_us": medians,
        "share": {p: v / total for p, v in shares.items()},
        "us": {p: median * v / total for p, v in shares.items()},
    }

with open(f"{results}/int8_profile.json", "w") as f:
    json.dump(out, f, indent=1)

o = ["## INT8 kernel: where its time goes (auction-32, dynamic activations)", ""]
o.append(f"`bench/int8_profile.sh` at `{out['commit']}` on {out['cpu']} (flags {' '.join(out['flags'])}): "
         f"`quiver time-model --one-request` on the demo's auction-32 model (80 → 256 → 128 → 1, "
         f"uncalibrated: activations quantized per row) at {rows} rows, one core, the median of {repeats} runs "
         "alternating the kernels; the parts are `perf record` shares of a long run, by symbol, times that median.")
o.append("")
o.append("| kernel | µs per call | quantize activations | GEMM + epilogue | rest |")
o.append("|---|---:|---:|---:|---:|")
for k, v in out["kernels"].items():
    cells = " | ".join(f"{v['us'][p]:.2f} ({100 * v['share'][p]:.0f}%)" for p in ("quantize", "gemm", "rest"))
    o.append(f"| {k} | {v['median_us']:.2f} | {cells} |")
if "amx" in out["kernels"] and "avx512-vnni" in out["kernels"]:
    a, b = out["kernels"]["amx"], out["kernels"]["avx512-vnni"]
    o.append("")
    o.append(f"AMX over VNNI: {b['median_us'] / a['median_us']:.2f}× the whole call, "
             f"{b['us']['gemm'] / a['us']['gemm']:.2f}× the GEMM with its epilogue. The issue's target, "
             f"at most 2.2 µs at 32 rows, is {a['median_us'] / 2.2:.1f}× away; the quantization alone takes "
             f"{a['us']['quantize']:.2f} µs of it.")
o.append("")
with open(f"{results}/int8_profile.md", "w") as f:
    f.write("\n".join(o))
print("\n".join(o))
PY
