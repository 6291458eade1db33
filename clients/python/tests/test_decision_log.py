"""The decision log read without Quiver: a server logging every decision
writes Arrow IPC segments that pyarrow opens, one row per candidate, the
scores equal to the answers and the feature columns named.

pyarrow is not a dependency of the client: where it is missing the test
skips, except in CI, which installs it and sets QUIVER_REQUIRE_PYARROW=1 so
that there a missing pyarrow fails instead.
"""

from __future__ import annotations

import os

import pytest

import quiver_client as q
from helpers import CANDIDATES, QuiverServer, demo_request, f32_bits


def pyarrow_or_skip():
    if os.environ.get("QUIVER_REQUIRE_PYARROW") == "1":
        import pyarrow

        return pyarrow
    return pytest.importorskip("pyarrow")


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
    for column in ["request_id", "received", "model_version", "tier", "candidate", "score", "user_key", "item_key"]:
        assert column in names, names
    assert "user[0]" in names and "item[0]" in names and "context[15]" in names, names
    assert table.num_rows == 200 * CANDIDATES
    assert table.schema.field("received").type == pa.timestamp("ns", tz="UTC")
    assert table.schema.field("user[0]").type == pa.float32()
    # Nanosecond times become Python datetimes only through pandas: the
    # columns compared are read without them.
    rows = table.select(["request_id", "candidate", "score", "tier", "status"]).to_pylist()
    scores = {}
    for row in rows:
        scores.setdefault(row["request_id"], {})[row["candidate"]] = row["score"]
        assert row["tier"] == "primary" and row["status"] == "ok"
    assert sorted(scores) == sorted(answers)
    for rid, answer in answers.items():
        logged = [scores[rid][k] for k in range(CANDIDATES)]
        assert f32_bits(logged) == f32_bits(answer.scores), rid
