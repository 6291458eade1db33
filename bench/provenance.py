"""Which commit a benchmark measured: the short hash of HEAD, with "+dirty"
when tracked files differ from it, for the reports of bench/*.py."""

import os
import subprocess

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def git_commit():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(results_dir, name, report, md):
    """Writes `name`.json (the raw report) and `name`.md (the section
    bench/report.py copies) into `results_dir`, and prints the section."""
    import json

    out = os.path.join(results_dir, name)
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)
