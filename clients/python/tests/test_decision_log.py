"""The decision log read without Quiver: a server logging every decision
writes Arrow IPC segments that pyarrow opens, one row per candidate, the
scores equal to the answers and the feature columns named; the README's
pandas and Polars examples join them with labels by request id, and its
DuckDB example counts them by tier, each run as written; `quiver log
parquet` rewrites them as Parquet that pyarrow and Spark read, value for
value.

pyarrow, pandas, Polars, DuckDB and PySpark are not dependencies of the
client: where one is missing its test skips, except in CI, which installs
them and sets QUIVER_REQUIRE_PYARROW=1, QUIVER_REQUIRE_PANDAS=1,
QUIVER_REQUIRE_POLARS=1, QUIVER_REQUIRE_DUCKDB=1 and QUIVER_REQUIRE_PYSPARK=1
so that there a missing one fails instead.
"""

from __future__ import annotations

import glob
import importlib
import os
import pathlib
import re
import subprocess

import pytest

import quiver_client as q
from helpers import CANDIDATES, QuiverServer, demo_request, f32_bits


def module_or_skip(name):
    """`name` imported; skipped where it is missing, unless
    QUIVER_REQUIRE_<NAME>=1 says it must be there."""
    if os.environ.get(f"QUIVER_REQUIRE_{name.upper()}") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def pyarrow_or_skip():
    return module_or_skip("pyarrow")


def pandas_or_skip():
    return module_or_skip("pandas")


def log_some(demo_dir, tmp_path, count, first_id):
    """Serves `count` demo requests with every decision logged into
    tmp_path/decisions; returns the answers by request id."""
    log_dir = tmp_path / "decisions"
    config = tmp_path / "quiver.toml"
    config.write_text(f'[log]\ndir = "{log_dir}"\nsample_rate = 1.0\n')
    server = QuiverServer(demo_dir, tmp_path / "serve.log", "--config", str(config))
    try:
        with q.Client(server.addr, timeout=30) as c:
            requests = [demo_request(i, request_id=first_id + i) for i in range(count)]
            answers = {r.request_id: r for r in c.score_many(requests)}
    finally:
        # SIGTERM: the writer closes its segment before the process exits.
        server.stop()
    assert server.proc.returncode == 0, server.log()
    return answers


README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


def readme_block(which=""):
    """The README's Python block after the marker naming this file (and
    `which`, for the Polars and DuckDB ones)."""
    text = README.read_text()
    marker = "<!-- run by clients/python/tests/test_decision_log.py" + (f": {which}" if which else "") + " -->"
    assert marker in text, f"the README's tested example lost its marker {marker}"
    block = re.search(r"```python\n(.*?)```", text[text.index(marker):], re.S).group(1)
    return compile(block, "README.md", "exec")


def log_and_label(demo_dir, tmp_path, monkeypatch):
    """60 decisions logged in tmp_path, the working directory, with a label
    for every other one in labels.csv; returns the answers and the labels,
    by request id."""
    # Request ids above 2^63: a join that went through int64 or float64
    # would lose or mangle them.
    first = 2**63 + 11
    answers = log_some(demo_dir, tmp_path, 60, first)
    labelled = {rid: rid % 3 == 0 for rid in sorted(answers)[::2]}
    (tmp_path / "labels.csv").write_text(
        "request_id,label\n" + "".join(f"{rid},{int(label)}\n" for rid, label in labelled.items())
    )
    monkeypatch.chdir(tmp_path)
    return answers, labelled


def test_the_readme_joins_logged_decisions_with_labels(demo_dir, tmp_path, monkeypatch):
    pyarrow_or_skip()
    pandas_or_skip()
    answers, labelled = log_and_label(demo_dir, tmp_path, monkeypatch)
    scope = {}
    exec(readme_block(), scope)
    train, X, y = scope["train"], scope["X"], scope["y"]
    assert sorted(set(int(r) for r in train["request_id"])) == sorted(labelled)
    assert len(train) == len(labelled) * CANDIDATES and X.shape == (len(train), len(scope["features"]))
    assert "user[0]" in scope["features"] and "context[15]" in scope["features"]
    for row_id, label, candidate, score in zip(train["request_id"], y, train["candidate"], train["score"]):
        rid = int(row_id)
        assert label == int(labelled[rid])
        assert f32_bits([score]) == f32_bits([answers[rid].scores[int(candidate)]])


def test_the_readme_joins_them_in_polars(demo_dir, tmp_path, monkeypatch):
    pl = module_or_skip("polars")
    answers, labelled = log_and_label(demo_dir, tmp_path, monkeypatch)
    scope = {"files": sorted(glob.glob("decisions/decisions-*.arrow"))}
    exec(readme_block("Polars"), scope)
    log, train = scope["log"], scope["train"]
    assert log.schema["request_id"] == pl.UInt64 and log.schema["user[0]"] == pl.Float32
    assert log.schema["received"] == pl.Datetime("ns", "UTC")
    assert sorted(set(train["request_id"].to_list())) == sorted(labelled)
    assert train.height == len(labelled) * CANDIDATES
    for rid, label, candidate, score in train.select("request_id", "label", "candidate", "score").iter_rows():
        assert label == int(labelled[rid])
        assert f32_bits([score]) == f32_bits([answers[rid].scores[candidate]])


def test_the_readme_queries_them_in_duckdb(demo_dir, tmp_path, monkeypatch):
    pyarrow_or_skip()
    module_or_skip("duckdb")
    answers, _ = log_and_label(demo_dir, tmp_path, monkeypatch)
    scope = {"files": sorted(glob.glob("decisions/decisions-*.arrow"))}
    exec(readme_block("DuckDB"), scope)
    ((tier, rows, mean_score),) = scope["per_tier"]
    assert (tier, rows) == ("primary", len(answers) * CANDIDATES)
    scores = [s for a in answers.values() for s in a.scores]
    assert abs(mean_score - sum(scores) / len(scores)) < 1e-6


def test_segments_rewritten_as_parquet_read_in_pyarrow_and_spark(demo_dir, tmp_path, quiver_bin):
    pa = pyarrow_or_skip()
    import pyarrow.ipc  # noqa: F401  (the submodule, for pa.ipc)
    import pyarrow.parquet as pq

    # Request ids above 2^63: Spark reads an unsigned 64-bit column as a
    # decimal, which must hold them whole.
    first = 2**63 + 5
    answers = log_some(demo_dir, tmp_path, 40, first)
    segments = sorted((tmp_path / "decisions").glob("decisions-*.arrow"))
    out_dir = tmp_path / "parquet"
    run = subprocess.run([str(quiver_bin), "log", "parquet", *map(str, segments), "--out-dir", str(out_dir)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(s.name[:-len(".arrow")] + ".parquet" for s in segments)
    ipc = pa.concat_tables([pa.ipc.open_file(str(f)).read_all() for f in segments])
    parquet = pa.concat_tables([pq.read_table(str(out_dir / (s.name[:-len(".arrow")] + ".parquet"))) for s in segments])
    assert parquet.column_names == ipc.column_names and parquet.num_rows == len(answers) * CANDIDATES
    # Every value but the receive time's unit (microseconds in Parquet).
    assert parquet.drop_columns(["received"]).equals(ipc.drop_columns(["received"]))
    assert parquet.schema.field("received").type == pa.timestamp("us", tz="UTC")
    want = [t // 1000 for t in ipc.column("received").cast(pa.int64()).to_pylist()]
    assert parquet.column("received").cast(pa.int64()).to_pylist() == want

    module_or_skip("pyspark")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").appName("quiver-decision-log")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    try:
        df = spark.read.parquet(str(out_dir))
        assert "user[0]" in df.columns and "context[15]" in df.columns
        rows = df.select("request_id", "candidate", "score", "tier").collect()
    finally:
        spark.stop()
    assert len(rows) == len(answers) * CANDIDATES
    for row in rows:
        rid = int(row["request_id"])
        assert row["tier"] == "primary"
        assert f32_bits([row["score"]]) == f32_bits([answers[rid].scores[row["candidate"]]]), rid


def test_segments_open_in_pyarrow_and_hold_the_answers(demo_dir, tmp_path):
    pa = pyarrow_or_skip()
    import pyarrow.ipc  # noqa: F401  (the submodule, for pa.ipc)

    log_dir = tmp_path / "decisions"
    config = tmp_path / "quiver.toml"
    config.write_text(f'[log]\ndir = "{log_dir}"\nsample_rate = 1.0\n')
    server = QuiverServer(demo_dir, tmp_path / "serve.log", "--config", str(config))
    try:
        with q.Client(server.addr, timeout=30) as c:
            answers = {r.request_id: r for r in c.score_many([demo_request(i, request_id=500 + i) for i in range(200)])}
    finally:
        # SIGTERM: the writer closes its segment before the process exits.
        server.stop()
    assert server.proc.returncode == 0, server.log()
    files = sorted(log_dir.glob("decisions-*.arrow"))
    assert files, f"no segment in {log_dir}: {list(log_dir.iterdir())}"
    table = pa.concat_tables([pa.ipc.open_file(str(f)).read_all() for f in files])
    names = table.column_names
    for column in ["request_id", "received", "model_version", "tier", "candidate", "score", "user_key", "item_key",
                   "sampled", "always", "shadow_version", "shadow_score"]:
        assert column in names, names
    assert "user[0]" in names and "item[0]" in names and "context[15]" in names, names
    assert table.num_rows == 200 * CANDIDATES
    assert table.schema.field("received").type == pa.timestamp("ns", tz="UTC")
    assert table.schema.field("user[0]").type == pa.float32()
    # Nanosecond times become Python datetimes only through pandas: the
    # columns compared are read without them.
    columns = ["request_id", "candidate", "score", "tier", "status", "sampled", "always", "shadow_score"]
    rows = table.select(columns).to_pylist()
    scores = {}
    for row in rows:
        scores.setdefault(row["request_id"], {})[row["candidate"]] = row["score"]
        assert row["tier"] == "primary" and row["status"] == "ok"
        # Taken by the sample (rate 1), no always rule, no shadow.
        assert row["sampled"] is True and row["always"] is None and row["shadow_score"] is None
    assert sorted(scores) == sorted(answers)
    for rid, answer in answers.items():
        logged = [scores[rid][k] for k in range(CANDIDATES)]
        assert f32_bits(logged) == f32_bits(answer.scores), rid
