#!/usr/bin/env python3
"""The capacity at p99 <= 1 ms of two builds or kernels of auction-32, from
one `bench/tail.sh` rate sweep that served both side by side (its `quiver`
and `base` servers), beside Redis GET at the same rates.

Why: issue 34 asks for the open-loop capacity at p99 <= 1 ms of the AMX
kernel against the AVX-512 VNNI one in the same run (target: at least
2.5x), and for auction-32's p99 at 30k and 60k req/s beside Redis GET's.
A capacity is read off the sweep's discrete rates: the highest offered rate
at which the server's median p99 is at most 1,000 µs, every run achieved
at least 99% of the offered rate and nothing was lost or refused; the true
capacity lies between that rate and the next rate of the sweep. The ratio is
of those highest passing rates, and the bracket gives its bounds.

usage (after the sweep, e.g.
    OUT=bench/results/tail_amx_sweep QUIVER_FLAGS="--kernel amx" BASE_BIN=target/release/quiver \\
        BASE_FLAGS="--kernel avx512-vnni" SERVERS="redis quiver base" \\
        RATES="30000 40000 50000 60000 70000 80000 90000 100000" RUNS=3 bash bench/tail.sh):
  python3 bench/tail_capacity.py bench/results/tail_amx_sweep/tail-summary.json \\
      --quiver-label amx --base-label avx512-vnni [--out bench/results/amx_tail_sweep]
Writes OUT.json and OUT.md (rendered into docs/BENCHMARKS.md by
bench/report.py) and prints the latter.
"""

import argparse
import json
import os

P99_MAX_US = 1000.0
ACHIEVED_MIN = 0.99


def passes(m, rate):
    return (m["p99_us"] <= P99_MAX_US and m["achieved_rate"] >= ACHIEVED_MIN * rate
            and not m.get("lost") and not m.get("errors"))


def capacity(summary, server):
    """(highest passing rate or None, the next swept rate above it or None)."""
    rates = sorted(int(r) for r, by in summary["rates"].items() if server in by)
    ok = [r for r in rates if passes(summary["rates"][str(r)][server], r)]
    best = None
    for r in rates:  # the highest rate below which every rate passed
        if r not in ok:
            break
        best = r
    above = next((r for r in rates if best is None or r > best), None)
    return best, above


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary")
    ap.add_argument("--quiver-label", required=True)
    ap.add_argument("--base-label", required=True)
    ap.add_argument("--out", default="bench/results/amx_tail_sweep")
    args = ap.parse_args()
    s = json.load(open(args.summary))
    flags = open("/proc/cpuinfo").read().split()
    isa = [f for f in ("avx512_vnni", "amx_tile", "amx_int8") if f in flags]
    caps = {k: capacity(s, k) for k in ("quiver", "base")}
    labels = {"quiver": args.quiver_label, "base": args.base_label}
    (q, q_above), (b, b_above) = caps["quiver"], caps["base"]
    ratio = q / b if q and b else None
    # Bounds from the brackets: the true capacities lie in [best, above).
    lo = q / b_above if q and b_above else None
    hi = q_above / b if q_above and b else None
    result = {
        "commit": s.get("commit"),
        "summary_file": os.path.relpath(args.summary),
        "cpu": cpu_model(),
        "isa": isa,
        "rule": f"highest swept rate with median p99 <= {P99_MAX_US:.0f} us, achieved >= {ACHIEVED_MIN:.0%}, none lost",
        "capacity_req_s": {labels[k]: {"passing": v[0], "next_rate": v[1]} for k, v in caps.items()},
        "ratio": ratio,
        "ratio_bounds": [lo, hi],
        "summary": s,
    }
    commit = s.get("commit") or "?"
    lines = [
        f"## AMX against AVX-512 VNNI in the server, open-loop rate sweep ({result['cpu']})",
        "",
        f"<!-- results: {os.path.basename(args.out)}.json -->",
        f"Written by `bench/tail_capacity.py` from one `bench/tail.sh` sweep at commit `{commit}` on {result['cpu']} "
        f"({', '.join(isa)}): auction-32 served with `{s.get('quiver_flags', '')}` ({labels['quiver']}) and with "
        f"`{s.get('base_flags', '')}` ({labels['base']}), and Redis GET, each alone on core 0, driven by the open-loop "
        f"generator on core 1 ({s['connections']} connections, {s['duration']} a run, runs interleaved); medians of "
        f"{s['runs']} runs, µs.",
        "",
        f"| offered req/s | Redis GET p99 | {labels['quiver']} p50 / p99 / p99.9 | {labels['base']} p50 / p99 / p99.9 |",
        "|---:|---:|---|---|",
    ]
    for rate in sorted(int(r) for r in s["rates"]):
        by = s["rates"][str(rate)]
        cell = lambda m: (f"{m['p50_us']:,.0f} / {m['p99_us']:,.0f} / {m['p999_us']:,.0f}"
                          + ("" if passes(m, rate) else " ✗")
                          + (f" ‡{m['generator_saturated_runs']}" if m.get("generator_saturated_runs") else "")) if m else "n/a"
        redis = by.get("redis")
        lines.append(f"| {rate:,} | {redis['p99_us']:,.0f} | {cell(by.get('quiver'))} | {cell(by.get('base'))} |"
                     if redis else f"| {rate:,} | n/a | {cell(by.get('quiver'))} | {cell(by.get('base'))} |")
    lines += ["", f"✗: over p99 {P99_MAX_US:,.0f} µs, short of {ACHIEVED_MIN:.0%} of the offered rate, or lost requests. "
              "‡N: in N runs the generator fell behind its schedule (it reports this; the latencies still count from "
              "the intended send times).", ""]
    for k in ("quiver", "base"):
        best, above = caps[k]
        where = (f"{best:,} req/s" if best else "below the lowest swept rate") + (
            f" (under {above:,})" if above else " (the highest swept rate: at least that)")
        lines.append(f"- Capacity at p99 ≤ 1 ms, {labels[k]}: {where}.")
    if ratio:
        bounds = f"; from the sweep's brackets between {lo:.2f}× and {hi:.2f}×" if lo and hi else ""
        lines.append(f"- {labels['quiver']} over {labels['base']}: {ratio:.2f}×{bounds} (issue 34's target: at least 2.5×).")
    text = "\n".join(lines) + "\n"
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
