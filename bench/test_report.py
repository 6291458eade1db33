#!/usr/bin/env python3
"""Tests of bench/report.py's refusals: a copied section whose stated commit
disagrees with its results file, that was measured on a dirty tree, or that
no results file backs, stops the page from rendering (`--check` exits 1 and
names the section); one that agrees passes.

    python3 bench/test_report.py
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.py")


def check(files):
    """`report.py --check` over a results directory holding `files` (name -> text or JSON value)."""
    with tempfile.TemporaryDirectory() as res:
        for name, content in files.items():
            with open(os.path.join(res, name), "w") as f:
                f.write(content if isinstance(content, str) else json.dumps(content))
        p = subprocess.run([sys.executable, REPORT, "--check", res], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr


SECTION = "## Hedged requests\n\nMeasured by `bench/hedge.sh` at `{commit}` on a VM.\n\n| a |\n|---|\n| 1 |\n"


class Refusals(unittest.TestCase):
    def test_a_section_that_agrees_with_its_results_renders(self):
        rc, out = check({"hedge.md": SECTION.format(commit="79fd7b4"), "hedge.json": {"commit": "79fd7b4"}})
        self.assertEqual(rc, 0, out)

    def test_a_stated_commit_its_results_do_not_record_is_refused(self):
        rc, out = check({"hedge.md": SECTION.format(commit="9fae8db"), "hedge.json": {"commit": "79fd7b4"}})
        self.assertEqual(rc, 1, out)
        self.assertIn("hedge.md: states commit 9fae8db, but its results (hedge.json) record 79fd7b4", out)

    def test_a_dirty_tree_is_refused(self):
        rc, out = check({"hedge.md": SECTION.format(commit="79fd7b4+dirty"), "hedge.json": {"commit": "79fd7b4+dirty"}})
        self.assertEqual(rc, 1, out)
        self.assertIn("measured on a dirty tree (79fd7b4+dirty)", out)

    def test_a_section_no_results_file_backs_is_refused(self):
        rc, out = check({"one_request.md": "## One request\n\nAt `8f70ed5`.\n"})
        self.assertEqual(rc, 1, out)
        self.assertIn("one_request.md: no results file backs its figures", out)

    def test_a_section_without_a_commit_is_refused(self):
        rc, out = check({"hedge.md": "## Hedged requests\n\nNo commit here.\n", "hedge.json": {"commit": "79fd7b4"}})
        self.assertEqual(rc, 1, out)
        self.assertIn("hedge.md: states no commit", out)

    def test_a_section_may_name_the_results_it_describes(self):
        text = "<!-- results: criterion-commits.json -->\n## Kernels\n\nThe criterion table, at `61889cf`.\n"
        agrees = check({"ort_side_by_side.md": text, "criterion-commits.json": {"kernels": "61889cf"}})
        self.assertEqual(agrees[0], 0, agrees[1])
        stale = check({"ort_side_by_side.md": text, "criterion-commits.json": {"kernels": "fd29703"}})
        self.assertEqual(stale[0], 1, stale[1])
        self.assertIn("states commit 61889cf, but its results (criterion-commits.json) record fd29703", stale[1])


if __name__ == "__main__":
    unittest.main()
