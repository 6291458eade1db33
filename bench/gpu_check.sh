#!/usr/bin/env bash
# One prepared check of the CUDA backend on a machine with an NVIDIA GPU
# (written for a few minutes on a lent H100/H200): prints the driver, device
# and NVRTC versions, checks INT8 parity with the CPU scalar reference, bit
# for bit, at batch 1, 31, 32, 33, 255, 1024 and 4096 (zero, saturating, inf
# and NaN rows included) for uncalibrated models (dynamic semantics,
# dense_int8) and calibrated ones (static semantics, dense_int8_static),
# and for a graph model with every node kind and a 70-tree model
# (graph_nodes.cu, trees.cu and dense_int8, against the CPU INT8 backend's
# graph executor), times each batch size after warm-up for the demo model in
# both semantics and for those two
# (p50/p99, host timing around the whole logits call: H2D, kernels, D2H,
# synchronise), and writes it all as one JSON object. Exits non-zero, saying
# why, when there is no GPU or a result differs from the CPU.
#
# usage: bench/gpu_check.sh [out.json]
#   QUIVER_BIN=path  use a prebuilt `quiver` (built with --features cuda)
#                    instead of building one here
#   NVRTC_LIB_DIR    directory holding libnvrtc.so.12, when it is not on the
#                    loader path (default: the nvidia-cuda-nvrtc-cu12 wheel's,
#                    if python3 has it)
#   ITERS            timed calls per batch size (default 200)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results}/gpu-check.json}"
mkdir -p "$(dirname "$out")"

if [ -n "${QUIVER_BIN:-}" ]; then
    bin="$QUIVER_BIN"
else
    cargo build --release --features cuda --quiet
    bin=target/release/quiver
fi
"$bin" gpu-check --help >/dev/null 2>&1 \
    || { echo "gpu_check: $bin has no gpu-check command; build it with --features cuda" >&2; exit 2; }

if [ -z "${NVRTC_LIB_DIR:-}" ] && command -v python3 >/dev/null; then
    site="$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))' 2>/dev/null || true)"
    [ -e "$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] && NVRTC_LIB_DIR="$site/nvidia/cuda_nvrtc/lib"
fi
[ -n "${NVRTC_LIB_DIR:-}" ] && export LD_LIBRARY_PATH="${NVRTC_LIB_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== nvidia-smi"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true
else
    echo "nvidia-smi not found"
fi

echo "== quiver gpu-check (versions, parity, timing) -> $out"
rc=0
"$bin" gpu-check --iters "${ITERS:-200}" --out "$out" || rc=$?
python3 - "$out" <<'PY' || cat "$out"
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    print("no GPU check:", r["error"]); sys.exit(0)
d = r["device"]
print(f"device {d['name']} sm_{d['compute_capability'][0]}{d['compute_capability'][1]}, "
      f"driver {d['driver_version']}, nvrtc {d['nvrtc_version'][0]}.{d['nvrtc_version'][1]}")
for p in r["parity"]:
    print(f"parity {p['activations']:>7} {p['model']:>28} rows {p['rows']:>5}: {p['mismatches']} mismatches"
          + (f" first {p['first_mismatch']}" if p["first_mismatch"] else ""))
for t in r["timing"]:
    print(f"timing {t['activations']:>7} rows {t['rows']:>5}: gpu p50 {t['gpu_p50_us']:9.1f} us p99 {t['gpu_p99_us']:9.1f} us"
          f" | cpu-int8 p50 {t['cpu_int8_p50_us']:9.1f} us")
print("OK" if r["ok"] else "PARITY FAILURE")
PY
exit "$rc"
