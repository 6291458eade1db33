#!/usr/bin/env python3
"""Reason-code cost before and after a change to the explainer, from two runs
of the committed criterion bench (`cargo bench --bench explain`), rendered
as a BENCHMARKS.md section.

Why: the bench measures the benchmark thread's CPU time per explained
candidate (bench/explain.rs); a change to `model::explain` is judged by the
same bench at the commit before it and at its own commit, on the same
machine. This script does not run cargo: it reads the two runs' criterion
output, each preceded by the `uptime` line taken just before it (the load
the run met), so the figures are exactly what criterion printed, and it
writes the section and its results file.

    (uptime; taskset -c 1 cargo bench --bench explain -- quadrature) > before.txt   # at BEFORE
    (uptime; taskset -c 1 cargo bench --bench explain -- quadrature) > after.txt    # at AFTER
    python3 bench/explain_before_after.py before.txt BEFORE after.txt AFTER "CHANGE"

CHANGE is one paragraph saying what the after commit changed and why it is
still exact; it is written under the table's caption.

The two runs' outputs are kept beside it as
bench/results/explain_before_after-COMMIT.txt. Writes
bench/results/explain_before_after.json (both runs' medians and
confidence intervals, the commits, the machine and each run's load) and
bench/results/explain_before_after.md (the section bench/report.py copies
into docs/BENCHMARKS.md). Each run's commit must be clean (no "+dirty").
"""

import json
import os
import re
import sys
import time

UNITS = {"ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}
TIME = re.compile(r"^\s*time:\s*\[([\d.]+) (\S+) ([\d.]+) (\S+) ([\d.]+) (\S+)\]")
LOAD = re.compile(r"load average: ([\d.]+)")


def parse(path):
    """Each benchmark's (lo, median, hi) ns per iteration, from criterion's
    text, and the one-minute load average of the `uptime` line before it."""
    out, name, load = {}, None, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            m = LOAD.search(line)
            if m and load is None:
                load = float(m.group(1))
                continue
            if line.startswith("explain/") and " " not in line.strip():
                name = line.strip()
                continue
            m = TIME.match(line)
            if m and name:
                v = [float(m.group(i)) * UNITS[m.group(i + 1)] for i in (1, 3, 5)]
                out[name] = {"lo_ns": v[0], "median_ns": v[1], "hi_ns": v[2]}
                name = None
    if not out:
        sys.exit(f"{path}: no criterion results (explain/...) in it")
    if load is None:
        sys.exit(f"{path}: no `uptime` line before the run (the load it met)")
    return out, load


def machine():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cpus": os.cpu_count()}


def per_candidate_us(name, e):
    candidates = int(name.rsplit("/", 1)[1])
    return e["median_ns"] / candidates / 1e3, e["lo_ns"] / candidates / 1e3, e["hi_ns"] / candidates / 1e3


def main(argv):
    if len(argv) != 5 or not argv[4].strip():
        sys.exit("usage: explain_before_after.py BEFORE.txt BEFORE_COMMIT AFTER.txt AFTER_COMMIT CHANGE")
    (before, before_load), (after, after_load) = parse(argv[0]), parse(argv[2])
    commits = (argv[1], argv[3])
    for c in commits:
        if not re.fullmatch(r"[0-9a-f]{7,12}", c):
            sys.exit(f"'{c}' is not a clean short commit hash")
    m = machine()
    results = {
        "generated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "taskset -c 1 cargo bench --bench explain -- quadrature",
        "machine": m,
        "before": {"commit": commits[0], "load_average": before_load, "criterion": before},
        "after": {"commit": commits[1], "load_average": after_load, "criterion": after},
        "change": argv[4].strip(),
    }
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "results", "explain_before_after.json"), "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    w = []
    w.append("## Reason codes before and after: the quadrature walk\n")
    w.append(
        f"Written by `bench/explain_before_after.py` ({results['generated']}) from two runs of "
        f"`{results['command']}`: before at commit `{commits[0]}` (load average {before_load:.2f} as it "
        f"started), after at commit `{commits[1]}` (load average {after_load:.2f}). Machine: {m['cpu']}, "
        f"{m['cpus']} CPUs. The figure is the benchmark thread's CPU time (bench/explain.rs), so other "
        "processes' time slices are not counted, but their pressure on the caches and the memory bus is: "
        "compare the load averages.\n"
    )
    w.append(f"The change: {results['change']}\n")
    w.append("| ensemble | candidates per call | before µs / candidate | after µs / candidate | after / before |")
    w.append("|---|---:|---:|---:|---:|")
    for name in sorted(set(before) & set(after)):
        parts = name.split("/")
        b = per_candidate_us(name, before[name])
        a = per_candidate_us(name, after[name])
        w.append(
            f"| {parts[2]} | {parts[4]} | {b[0]:,.1f} ({b[1]:,.1f}–{b[2]:,.1f}) | {a[0]:,.1f} ({a[1]:,.1f}–{a[2]:,.1f}) "
            f"| {a[0] / b[0]:.2f} |"
        )
    w.append("")
    w.append("In parentheses: criterion's 95% confidence interval of the median, per candidate.\n")
    targets = {"100x6": 100.0, "500x8": 1000.0}
    verdicts = []
    for shape, limit in targets.items():
        got = [per_candidate_us(n, after[n])[0] for n in after if n.split("/")[2] == shape]
        if got:
            worst = max(got)
            verdict = "met" if worst <= limit else "not met"
            verdicts.append(f"{shape} within {limit:,.0f} µs: {verdict} here ({worst:,.1f} µs at worst, after)")
    if verdicts:
        w.append("Issue 37's targets per candidate on one core: " + "; ".join(verdicts) + ".\n")
    with open(os.path.join(here, "results", "explain_before_after.md"), "w") as f:
        f.write("\n".join(w))
    print("\n".join(w))


if __name__ == "__main__":
    main(sys.argv[1:])
