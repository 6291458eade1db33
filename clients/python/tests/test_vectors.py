"""The protocol's golden vectors (``schemas/vectors/``, docs/PROTOCOL.md).

Every response vector decodes, with this client's decoder, to the meaning
its JSON states; every request vector's meaning, encoded by this client,
gives the very bytes the Rust encoder wrote (the two builders add fields in
the same order), and its bytes read back through the generated bindings to
that meaning. The vectors are written by the Rust test
``tests/protocol_vectors.rs``; a missing folder fails here, it is never
skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import quiver_client as q
from helpers import f32_bits, request_groups
from quiver_client._generated.quiver.wire import ExplainSkipped as fb_skipped
from quiver_client._generated.quiver.wire import Reason as fb_reason
from quiver_client._generated.quiver.wire import ScoreRequest as fb_req
from quiver_client._generated.quiver.wire import Status as fb_status
from quiver_client._generated.quiver.wire import Tier as fb_tier

VECTORS = Path(__file__).resolve().parents[3] / "schemas" / "vectors"


def vectors(kind: str):
    """(name, frames of the .bin, frames of the .json) of each vector of ``kind``."""
    found = sorted(VECTORS.glob("*.json"))
    assert found, f"no golden vectors in {VECTORS}"
    out = []
    for path in found:
        doc = json.loads(path.read_text())
        if doc["kind"] != kind:
            continue
        data = path.with_suffix(".bin").read_bytes()
        payloads, used = q.split_frames(data, 1 << 20)
        assert used == len(data), f"{path.name}: trailing bytes"
        assert len(payloads) == len(doc["frames"]), f"{path.name}: frame count"
        out.append(pytest.param(path.stem, data, payloads, doc["frames"], id=path.stem))
    assert out, f"no {kind} vectors in {VECTORS}"
    return out


def enum_value(generated: type, name: str) -> int:
    """The schema's value of enum member ``name`` (flatc spells ``None`` ``None_``)."""
    return getattr(generated, name) if hasattr(generated, name) else getattr(generated, name + "_")


def ids(values):
    return None if values is None else [int(v) for v in values]


def as_request(meaning) -> q.Request:
    groups = None
    if meaning["groups"] is not None:
        groups = [(g["group"], ids(g["ids"]) if g["ids"] is not None else list(g["keys"])) for g in meaning["groups"]]
    return q.Request(
        user_id=int(meaning["user_id"]),
        item_ids=ids(meaning["item_ids"]) or [],
        context=meaning["context"] or [],
        context_ids=ids(meaning["context_ids"]) or [],
        model=meaning["model"] or "",
        budget_us=meaning["budget_us"],
        priority=meaning["priority"],
        client_id=meaning["client_id"],
        groups=groups,
        explain_top_k=meaning.get("explain_top_k", 0),
        explain_candidates_max=meaning.get("explain_candidates_max", 0),
    )


@pytest.mark.parametrize("name,data,payloads,frames", vectors("responses"))
def test_response_vectors_decode_to_their_meaning(name, data, payloads, frames):
    for payload, frame in zip(payloads, frames):
        want = frame["meaning"]
        assert frame["bytes"] == len(payload) + 4
        r = q.decode_response(payload)
        assert r.request_id == int(want["request_id"]), name
        assert int(r.status) == enum_value(fb_status.Status, want["status"]), name
        assert int(r.tier) == enum_value(fb_tier.Tier, want["tier"]), name
        assert int(r.reason) == enum_value(fb_reason.Reason, want["reason"]), name
        assert f32_bits(r.scores) == f32_bits(want["scores"] or []), name
        assert (r.model_version, r.server_us, r.features_missing) == (
            want["model_version"],
            want["server_us"],
            want["features_missing"],
        ), name
        assert r.error == (want["error"] or ""), name
        assert r.features_stale is want["features_stale"], name
        e = r.explanations
        assert int(e.skipped) == enum_value(fb_skipped.ExplainSkipped, want["explain_skipped"]), name
        assert e.candidates == (want["explain_candidates"] or []), name
        assert e.features == (want["explain_features"] or []), name
        assert e.contributions == (want["explain_contributions"] or []), name
        if e.candidates:
            assert e.bias == want["explain_bias"], name
        got = [{"candidate": c, "top": [[f, v] for f, v in top]} for c, top in e.items()]
        assert got == want["explanations"], name


@pytest.mark.parametrize("name,data,payloads,frames", vectors("requests"))
def test_request_vectors_encode_to_the_same_bytes(name, data, payloads, frames):
    encoded = b""
    for frame in frames:
        want = frame["meaning"]
        request = as_request(want)
        if want["server"].startswith("refused"):
            # The server refuses it; this client will not even send it.
            with pytest.raises(ValueError):
                q.encode_request(request, int(want["request_id"]))
            return
        encoded += q.encode_request(request, int(want["request_id"]))
    assert encoded == data, f"{name}: this client's bytes differ from the Rust encoder's"


@pytest.mark.parametrize("name,data,payloads,frames", vectors("requests"))
def test_request_vectors_read_back_to_their_meaning(name, data, payloads, frames):
    for payload, frame in zip(payloads, frames):
        want = frame["meaning"]
        r = fb_req.ScoreRequest.GetRootAs(payload, 0)
        assert r.RequestId() == int(want["request_id"])
        assert r.UserId() == int(want["user_id"])
        assert (r.Model() or b"").decode() == (want["model"] or "")
        assert (r.BudgetUs(), r.Priority(), r.ClientId()) == (want["budget_us"], want["priority"], want["client_id"])
        assert (None if r.ItemIdsIsNone() else [r.ItemIds(i) for i in range(r.ItemIdsLength())]) == ids(
            want["item_ids"]
        )
        context = None if r.ContextIsNone() else [r.Context(i) for i in range(r.ContextLength())]
        assert (None if context is None else f32_bits(context)) == (
            None if want["context"] is None else f32_bits(want["context"])
        )
        assert (None if r.ContextIdsIsNone() else [r.ContextIds(i) for i in range(r.ContextIdsLength())]) == ids(
            want["context_ids"]
        )
        if want["groups"] is None:
            assert r.GroupsIsNone()
        else:
            expected = {g["group"]: ids(g["ids"]) if g["ids"] is not None else g["keys"] for g in want["groups"]}
            assert request_groups(r) == expected
        assert (r.ExplainTopK(), r.ExplainCandidatesMax()) == (want["explain_top_k"], want["explain_candidates_max"])
