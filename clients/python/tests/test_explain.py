"""Reason codes (``explain_top_k``) from the blocking and asyncio clients.

The group server scores ``card + device + ad + GROUP_BIAS`` with a linear
model (``helpers.build_linear_model``), whose exact contributions are the
rows themselves: each candidate's are (card's row, device's row, its ad's
row), the bias ``GROUP_BIAS``, and bias plus all contributions is the score
(a raw margin). The demo server's MLP cannot be explained exactly.
"""

from __future__ import annotations

import asyncio

import pytest

import quiver_client as q
from helpers import BIG_BUDGET_US, GROUP_BIAS, GROUP_ROWS, GROUP_REQUEST, demo_request, f32, group_score


def row(group, key):
    rows, default, _ = GROUP_ROWS[group]
    return rows.get(key, default)[0]


def contributions(card, device, ad):
    """Every feature's contribution, by input column (card, device, ad)."""
    return [row("card", card), row("device", device), row("ad", ad)]


def top(values, k):
    """The k largest by magnitude, ties by the lower index, as the server orders them."""
    order = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    return [(i, values[i]) for i in order[:k]]


def test_every_candidate_is_explained_exactly(group_server):
    with q.Client(group_server.addr) as c:
        r = c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US, explain_top_k=2)
    e = r.explanations
    assert r.ok and e.skipped == q.ExplainSkipped.NONE, r
    assert e.candidates == [0, 1, 2] and e.k == 2 and e.bias == pytest.approx(GROUP_BIAS)
    for (candidate, served), ad, score in zip(e.items(), GROUP_REQUEST["ad"], r.scores):
        phi = contributions(42, "f7a9c2", ad)
        assert served == [(i, pytest.approx(v)) for i, v in top(phi, 2)], candidate
        assert f32(e.bias + sum(phi)) == pytest.approx(score)


def test_the_top_scored_candidates_only(group_server):
    request = dict(groups={"card": 43, "device": "f7a9c2", "ad": [2, 3, 1, 99]}, budget_us=BIG_BUDGET_US)
    with q.Client(group_server.addr) as c:
        r = c.score(**request, explain_top_k=3, explain_candidates_max=2)
    assert r.scores == group_score(43, "f7a9c2", [2, 3, 1, 99])
    # Ad 99 is unknown: its default row (9.0) scores highest, then ad 3.
    assert r.explanations.candidates == [1, 3]
    assert [top[2] for _, top in r.explanations.items()] == [(2, 3.0), (2, 9.0)]


def test_not_asked_is_not_explained_and_an_mlp_is_not_explainable(group_server, server):
    with q.Client(group_server.addr) as c:
        r = c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US)
    assert r.explanations == q.Explanations()
    req = demo_request(3)
    req.explain_top_k = 5
    with q.Client(server.addr) as c:
        r = c.score(req)
    assert r.ok and r.tier == q.Tier.PRIMARY, r
    assert r.explanations.skipped == q.ExplainSkipped.NOT_EXPLAINABLE and r.explanations.candidates == []


def test_limits_are_checked_by_the_client_and_the_server(group_server):
    with pytest.raises(ValueError, match="explain_top_k 33 exceeds the limit of 32"):
        q.encode_request(q.Request(item_ids=[1], explain_top_k=33), 1)
    with pytest.raises(ValueError, match="65 candidates to explain exceed the limit of 64"):
        q.encode_request(q.Request(item_ids=list(range(65)), explain_top_k=1), 1)
    q.encode_request(q.Request(item_ids=list(range(65)), explain_top_k=1, explain_candidates_max=64), 1)
    with q.Client(group_server.addr) as c:
        r = c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US, explain_top_k=32)
    assert r.ok and r.explanations.k == 3, "k is at most the model's width"


def test_asyncio_explains_too(group_server):
    async def main():
        async with q.AsyncClient(group_server.addr) as c:
            return await c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US, explain_top_k=1)

    r = asyncio.run(main())
    assert [top for _, top in r.explanations.items()] == [[(0, pytest.approx(100.0))]] * 3
