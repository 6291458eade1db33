"""Raw rows (``Request.rows``): a caller that computes its features sends
the model's input rows, which the server scores as sent.

The group server's linear model reads (card, device, ad) and scores their
sum plus ``GROUP_BIAS``, so the rows a keyed request assembles are known
(``GROUP_ROWS``): sent raw, they must score bit for bit the same.
"""

from __future__ import annotations

import pytest

import quiver_client as q
from helpers import BIG_BUDGET_US, GROUP_REQUEST, GROUP_ROWS, f32_bits, numpy_or_skip


def row(group, key):
    rows, default, _ = GROUP_ROWS[group]
    return rows.get(key, default)[0]


def keyed_rows():
    """The rows GROUP_REQUEST assembles, one per ad, in the model's order."""
    card, device = row("card", GROUP_REQUEST["card"]), row("device", GROUP_REQUEST["device"])
    return [[card, device, row("ad", ad)] for ad in GROUP_REQUEST["ad"]]


def test_raw_rows_score_as_the_rows_the_keys_read(group_server):
    with q.Client(group_server.addr) as c:
        keyed = c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US)
        raw = c.score(rows=keyed_rows(), budget_us=BIG_BUDGET_US)
    assert raw.ok and raw.tier == q.Tier.PRIMARY, raw
    assert f32_bits(raw.scores) == f32_bits(keyed.scores)
    # Nothing was looked up: nothing missing.
    assert raw.features_missing == 0


def test_raw_rows_from_numpy_and_explained(group_server):
    np = numpy_or_skip()
    rows = np.array(keyed_rows(), dtype=np.float64)
    with q.Client(group_server.addr) as c:
        r = c.score(rows=rows, budget_us=BIG_BUDGET_US, explain_top_k=3)
    assert r.ok, r
    # The linear model's contributions are the rows themselves.
    for (candidate, top), want in zip(r.explanations.items(), keyed_rows()):
        got = dict(top)
        assert [got[i] for i in range(3)] == want, (candidate, got)


def test_raw_rows_of_the_wrong_width_are_refused_by_the_server(group_server):
    with q.Client(group_server.addr) as c:
        r = c.score(rows=[[1.0, 2.0], [3.0, 4.0]], budget_us=BIG_BUDGET_US, check=False)
    assert r.status == q.Status.BAD_REQUEST
    assert "rows of 3" in r.error, r.error


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"user_id": 4}, "carries no user_id"),
        ({"item_ids": [1]}, "carries no item_ids"),
        ({"context": [0.5]}, "carries no context"),
        ({"groups": {"card": 42}}, "carries no groups"),
    ],
)
def test_raw_rows_beside_keys_are_refused_before_sending(fields, message):
    with pytest.raises(ValueError, match=message):
        q.encode_request(q.Request(rows=[[1.0, 2.0, 3.0]], **fields), 1)


def test_raw_rows_shape_is_checked_before_sending():
    with pytest.raises(ValueError, match="same width"):
        q.encode_request(q.Request(rows=[[1.0, 2.0], [3.0]]), 1)
    with pytest.raises(ValueError, match="at least one row"):
        q.encode_request(q.Request(rows=[]), 1)
    with pytest.raises(ValueError, match="exceed the limit"):
        q.encode_request(q.Request(rows=[[0.0]] * 257), 1)
