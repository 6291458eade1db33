"""The blocking client against real ``quiver serve`` processes."""

from __future__ import annotations

import json
import struct
import subprocess
import time

import pytest

import quiver_client as q
from helpers import BIG_BUDGET_US, CANDIDATES, N, FakeServer, dead_address, demo_request, f32_bits, same_bits
from helpers import GROUP_ERRORS, GROUP_REQUEST, encode_response, exchange_raw, group_score, numpy_or_skip
from helpers import raw_request_frame, request_groups, thread_batch
from quiver_client._generated.quiver.wire import ScoreRequest as fb_req


def cli_score(quiver_bin, addr: str, req: q.Request) -> dict:
    """``quiver score --json`` for the same request (the Rust client)."""
    args = [
        str(quiver_bin),
        "score",
        "--addr",
        addr,
        "--json",
        "--user",
        str(req.user_id),
        "--items",
        ",".join(map(str, req.item_ids)),
        "--budget-us",
        str(req.budget_us),
        "--model",
        req.model,
        "--priority",
        str(req.priority),
        "--client-id",
        str(req.client_id),
    ]
    if req.context:
        # repr() of a float32 value parses back to exactly that float32.
        args.append("--context=" + ",".join(repr(c) for c in req.context))
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert out.returncode in (0, 2), out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "req, missing",
    [
        (demo_request(0), 0),
        (demo_request(1), 0),
        (demo_request(777), 0),
        (q.Request(user_id=42, item_ids=[1, 2, 3], budget_us=BIG_BUDGET_US), 0),  # no context: zeros
        (q.Request(user_id=10**12, item_ids=[5, 10**9, 9999], budget_us=BIG_BUDGET_US), 2),  # unknown ids
        (q.Request(user_id=7, item_ids=[3, 1, 4, 1, 5], model="auction-32", priority=5, client_id=9), 0),
    ],
    ids=["demo0", "demo1", "demo777", "no-context", "missing-features", "named-model"],
)
def test_scores_equal_the_rust_client_bit_for_bit(server, quiver_bin, req, missing):
    rust = cli_score(quiver_bin, server.addr, req)
    with q.Client(server.addr) as c:
        py = c.score(req)
    # serde_json writes each f32 widened to f64: the digits must be an exact float32.
    assert all(struct.unpack("<f", struct.pack("<f", s))[0] == s for s in rust["scores"])
    assert f32_bits(py.scores) == f32_bits(rust["scores"])
    assert len(py.scores) == len(req.item_ids)
    assert (py.status.name.lower(), py.tier.name.lower(), py.model_version, py.features_missing, py.features_stale) == (
        rust["status"],
        rust["tier"],
        rust["model_version"],
        rust["features_missing"],
        rust["features_stale"],
    )
    assert py.status == q.Status.OK and py.tier == q.Tier.PRIMARY and py.reason == q.Reason.NONE
    assert (py.model_version, py.features_missing) == (1, missing)


def test_numpy_scores_are_the_same_float32s(server, singles):
    np = numpy_or_skip()
    with q.Client(server.addr, as_numpy=True) as c:
        r = c.score(demo_request(3))
        # numpy inputs too
        r2 = c.score(
            q.Request(
                user_id=demo_request(3).user_id,
                item_ids=np.array(demo_request(3).item_ids),
                context=np.array(demo_request(3).context, dtype=np.float32),
                budget_us=BIG_BUDGET_US,
            )
        )
    assert isinstance(r.scores, np.ndarray) and r.scores.dtype == np.float32
    assert r.scores.view(np.uint32).tolist() == f32_bits(singles[3].scores)
    assert r2.scores.view(np.uint32).tolist() == f32_bits(singles[3].scores)


def test_score_many_pipelines_1000_requests(server, singles):
    reqs = [demo_request(i, request_id=50_000 + i) for i in range(N)]
    with q.Client(server.addr, timeout=30) as c:
        started = time.monotonic()
        answers = c.score_many(reqs)
        took = time.monotonic() - started
    assert [a.request_id for a in answers] == [50_000 + i for i in range(N)]
    assert all(a.ok and a.tier == q.Tier.PRIMARY for a in answers)
    assert all(same_bits(a, s) for a, s in zip(answers, singles))
    # Distinct inputs give distinct scores, so a mix-up could not go unnoticed.
    assert len({tuple(a.scores) for a in answers}) == N
    print(f"score_many: {N} requests in {took * 1000:.0f} ms")


def test_thread_mode_pipelined_answers_match_by_request_id(thread_server, singles):
    reqs, good = thread_batch()
    with q.Client(thread_server.addr, timeout=30) as c:
        answers = c.score_many(reqs, check=False)
    for req, a in zip(reqs, answers):
        assert a.request_id == req.request_id
        if req.request_id in good:
            assert a.ok and a.tier == q.Tier.PRIMARY, a
            assert same_bits(a, singles[good[req.request_id]])
        else:
            assert a.status == q.Status.MODEL_NOT_FOUND and a.scores == []
    with pytest.raises(q.ModelNotFound) as e, q.Client(thread_server.addr, timeout=30) as c:
        c.score_many(reqs)
    assert e.value.request_id == reqs[4].request_id  # the first bad one in request order


def test_answers_in_reverse_order_are_matched():
    fake = FakeServer(batch=50)
    try:
        with q.Client(fake.addr) as c:
            answers = c.score_many([q.Request(user_id=1, item_ids=[i, i + 1]) for i in range(50)])
    finally:
        fake.close()
    for i, a in enumerate(answers):
        assert a.scores == [pytest.approx(a.request_id + i / 1000), pytest.approx(a.request_id + (i + 1) / 1000)]


# Statuses for bad input.


def test_unknown_model_is_model_not_found(server):
    with q.Client(server.addr) as c:
        with pytest.raises(q.ModelNotFound) as e:
            c.score(user_id=1, item_ids=[1, 2], model="no-such-model", request_id=31)
        assert (e.value.status, e.value.error, e.value.request_id) == (q.Status.MODEL_NOT_FOUND, "unknown model", 31)
        assert isinstance(e.value, q.QuiverError) and e.value.response.scores == []
        # The connection goes on, and the demo model answers to its name.
        assert c.score(user_id=1, item_ids=[1, 2], model="auction-32").ok


@pytest.mark.parametrize(
    "fields, error",
    [
        (dict(item_ids=list(range(257))), "257 candidates exceed the limit of 256"),
        (dict(item_ids=[1, 2], context=[0.5] * 5), "context has 5 floats, the model takes 16"),
        (dict(item_ids=[1, 2], context=[0.5] * 17), "context has 17 floats, the model takes 16"),
        (dict(item_ids=[1, 2], context_ids=[7]), "context_ids has 1 ids, the model takes 0"),
    ],
)
def test_bad_input_is_bad_request(server, fields, error):
    # Client-side limits raised above the server's so the server sees the request.
    with q.Client(server.addr, limits=q.Limits(candidates_max=8192)) as c:
        with pytest.raises(q.BadRequest) as e:
            c.score(user_id=1, request_id=77, **fields)
        assert (e.value.error, e.value.request_id) == (error, 77)
        assert c.score(user_id=1, item_ids=[1]).ok


def test_budget_zero_means_the_server_default(server, singles):
    req = demo_request(5)
    req.budget_us = 0
    with q.Client(server.addr) as c:
        r = c.score(req)
    assert r.ok and r.tier == q.Tier.PRIMARY and same_bits(r, singles[5])


def test_a_1us_budget_never_gets_the_primary(server):
    """docs/OPERATING.md: a request that cannot make its deadline steps down the ladder;
    only one whose budget is already spent gets DeadlineExceeded."""
    seen = {}
    with q.Client(server.addr) as c:
        for i in range(40):
            try:
                r = c.score(user_id=90_000 + i, item_ids=list(range(i, i + CANDIDATES)), budget_us=1)
                assert r.tier != q.Tier.PRIMARY and r.reason == q.Reason.BUDGET, r
                key = r.tier.name
            except q.DeadlineExceeded as e:
                assert e.response.scores == []
                key = e.error
            seen[key] = seen.get(key, 0) + 1
    print(f"budget_us=1: {seen}")


def test_client_side_limits_raise_before_anything_is_sent():
    fake = FakeServer()
    try:
        with q.Client(fake.addr) as c:
            with pytest.raises(ValueError, match="257 candidates"):
                c.score(user_id=1, item_ids=list(range(257)))
            with pytest.raises(ValueError, match="exceeds the limit of 65536"):
                c.score(user_id=1, item_ids=[1], model="m" * 65_536)
            with pytest.raises(ValueError, match="at least one candidate"):
                c.score_many([q.Request(user_id=1, item_ids=[1]), q.Request(user_id=1, item_ids=[])])
            with pytest.raises(ValueError, match="distinct"):
                c.score_many([q.Request(user_id=1, item_ids=[1], request_id=5)] * 2)
        assert (fake.connections, fake.requests) == (0, 0)
    finally:
        fake.close()


def test_an_oversized_frame_is_rejected_by_the_server_and_the_client_reconnects(server):
    """With the client's frame limit raised past the server's (64 KiB), the
    server answers one BadRequest with request_id 0 and closes (docs/PROTOCOL.md); its
    close can also reset the connection before that answer is read."""
    with q.Client(server.addr, limits=q.Limits(frame_bytes_max=1 << 20)) as c:
        try:
            c.score(user_id=1, item_ids=[1], model="m" * 70_000)
            pytest.fail("an oversized frame was answered")
        except q.BadRequest as e:
            assert e.request_id == 0 and "exceeds the limit of 65536" in e.error
        except ConnectionError:
            pass
        assert c.score(user_id=1, item_ids=[1]).ok


# Node lists.


def test_failover_from_a_dead_node(server, singles):
    with q.Client([dead_address(), server.addr], timeout=5) as c:
        for i in range(4):  # round-robin: every other call tries the dead node first
            assert same_bits(c.score(demo_request(i)), singles[i])
        answers = c.score_many([demo_request(i) for i in range(10)])
        assert all(same_bits(a, s) for a, s in zip(answers, singles))


def test_all_nodes_dead_names_each_node():
    dead = [dead_address(), dead_address()]
    with q.Client(dead, timeout=2) as c:
        with pytest.raises(q.AllNodesFailed) as e:
            c.score(user_id=1, item_ids=[1])
    assert isinstance(e.value, ConnectionError)
    assert set(e.value.errors) == set(dead)
    assert all(isinstance(err, ConnectionRefusedError) for err in e.value.errors.values())


def test_a_node_that_drops_the_connection_fails_over_with_what_is_unanswered(server, singles):
    # Answers the first 6 requests (with echo scores), then hangs up.
    half = FakeServer(batch=6, hang_up_after=1)
    try:
        with q.Client([half.addr, server.addr], timeout=5) as c:
            answers = c.score_many([demo_request(i) for i in range(20)])
    finally:
        half.close()
    for i, a in enumerate(answers[:6]):
        echoed = a.request_id + demo_request(i).item_ids[0] / 1000
        assert a.model_version == 7 and a.scores[0] == pytest.approx(echoed)
    assert all(a.ok and a.tier == q.Tier.PRIMARY and same_bits(a, s) for a, s in zip(answers[6:], singles[6:]))


def test_round_robin_spreads_calls_over_the_nodes():
    a, b = FakeServer(), FakeServer()
    try:
        with q.Client([a.addr, b.addr]) as c:
            for _ in range(6):
                c.score(user_id=1, item_ids=[1])
        assert (a.requests, b.requests) == (3, 3)
        assert (a.connections, b.connections) == (1, 1)  # one kept connection per node
    finally:
        a.close()
        b.close()


def test_a_kept_connection_that_died_is_replaced():
    fake = FakeServer(hang_up_after=1)  # closes each connection after one answer, as an idle timeout would
    try:
        with q.Client(fake.addr) as c:
            assert c.score(user_id=1, item_ids=[1]).ok
            time.sleep(0.05)
            assert c.score(user_id=1, item_ids=[1]).ok
        assert fake.connections == 2
    finally:
        fake.close()


def test_timeout_is_per_call_and_not_retried_elsewhere(server):
    silent = FakeServer(answer=lambda held: b"")
    try:
        with q.Client([silent.addr, server.addr], timeout=0.3) as c:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                c.score(user_id=1, item_ids=[1])
            assert time.monotonic() - started < 2
            assert c.score(user_id=1, item_ids=[1]).ok  # next call: the next node
    finally:
        silent.close()


# Feature groups: the server of conftest's ``group_server``.


@pytest.mark.parametrize(
    "groups, card, device, ads, missing",
    [
        (GROUP_REQUEST, 42, "f7a9c2", [1, 2, 3], 0),
        ({"ad": [3, 1], "device": "caf\u00e9-\u2615", "card": [43]}, 43, "caf\u00e9-\u2615", [3, 1], 0),
        ({"card": 42, "device": "caf\u00e9-\u2615".encode(), "ad": 2}, 42, "caf\u00e9-\u2615", [2], 0),
        # Unknown keys read their group's default row, counted as missing.
        ({"card": 7, "device": "nobody", "ad": [1, 99, 3, 100]}, 7, "nobody", [1, 99, 3, 100], 4),
    ],
    ids=["card-device-ads", "any-order", "bytes-key-one-ad", "unknown-keys"],
)
def test_group_keys_score_what_their_rows_imply(group_server, groups, card, device, ads, missing):
    with q.Client(group_server.addr) as c:
        r = c.score(groups=groups, budget_us=BIG_BUDGET_US)
    assert r.ok and r.tier == q.Tier.PRIMARY, r
    assert f32_bits(r.scores) == f32_bits(group_score(card, device, ads))
    assert r.features_missing == missing


def test_group_keys_from_numpy_and_beside_item_ids(group_server):
    np = numpy_or_skip()
    with q.Client(group_server.addr, as_numpy=True) as c:
        r = c.score(groups={"card": np.uint64(43), "device": "f7a9c2", "ad": np.array([3, 2, 1], dtype=np.int64)})
        # item_ids counts the candidates; no group reads them on this server.
        r2 = c.score(item_ids=[70, 80, 90], groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US)
    assert r.scores.view(np.uint32).tolist() == f32_bits(group_score(43, "f7a9c2", [3, 2, 1]))
    assert r2.scores.view(np.uint32).tolist() == f32_bits(group_score(42, "f7a9c2", [1, 2, 3]))


def test_group_scores_equal_the_rust_client(group_server, quiver_bin):
    args = [str(quiver_bin), "score", "--addr", group_server.addr, "--json", "--budget-us", str(BIG_BUDGET_US),
            "--key", "card=42", "--str-key", "device=caf\u00e9-\u2615", "--key", "ad=3,1,2"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    rust = json.loads(out.stdout)
    with q.Client(group_server.addr) as c:
        py = c.score(groups={"card": 42, "device": "caf\u00e9-\u2615", "ad": [3, 1, 2]}, budget_us=BIG_BUDGET_US)
    assert f32_bits(py.scores) == f32_bits(rust["scores"]) == f32_bits(group_score(42, "caf\u00e9-\u2615", [3, 1, 2]))


def test_group_frames_read_as_the_rust_encoder_writes_them(quiver_bin):
    """The fields of a request from ``quiver score --key`` and from this
    client, read back with the bindings, agree (item_ids left out, user_id
    0, each group with its key type)."""
    seen = []

    def answer(held):
        seen.extend(held)
        return b"".join(encode_response(fb_req.ScoreRequest.GetRootAs(p, 0).RequestId(), scores=[0.5] * 3)
                        for p in held)

    fake = FakeServer(answer=answer)
    try:
        out = subprocess.run(
            [str(quiver_bin), "score", "--addr", fake.addr, "--json", "--key", "card=42", "--str-key", "device=7a",
             "--key", "ad=1,2,3"],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        with q.Client(fake.addr) as c:
            c.score(groups={"card": 42, "device": "7a", "ad": [1, 2, 3]}, request_id=1)
    finally:
        fake.close()
    rust, py = (fb_req.ScoreRequest.GetRootAs(p, 0) for p in seen)
    for r in (rust, py):
        assert (r.RequestId(), r.UserId(), r.ItemIdsIsNone(), r.ContextIsNone()) == (1, 0, True, True)
        # (`quiver score` writes its --key groups before its --str-key ones.)
        assert request_groups(r) == {"card": [42], "device": ["7a"], "ad": [1, 2, 3]}


@pytest.mark.parametrize("fields, error", GROUP_ERRORS)
def test_group_errors_are_bad_request_with_the_servers_message(group_server, fields, error):
    with q.Client(group_server.addr) as c:
        with pytest.raises(q.BadRequest) as e:
            c.score(budget_us=BIG_BUDGET_US, request_id=77, **fields)
        assert e.value.error.startswith(error), e.value.error
        assert (e.value.status, e.value.request_id) == (q.Status.BAD_REQUEST, 77)
        # The connection goes on.
        assert c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US).ok


def test_a_group_named_twice_is_bad_request(group_server):
    # The client refuses to send it (ValueError); the frame is written by hand.
    with pytest.raises(ValueError, match="named twice"):
        q.encode_request(q.Request(groups=[("card", 42), ("card", 43)]), 1)
    frame = raw_request_frame(
        5, [("card", [42], None), ("device", None, ["f7a9c2"]), ("ad", [1], None), ("card", [43], None)]
    )
    r = exchange_raw(group_server.addr, frame)
    assert (r.request_id, r.status, r.error) == (5, q.Status.BAD_REQUEST, "feature group 'card' is named twice")
    with pytest.raises(q.BadRequest, match="named twice"):
        r.raise_for_status()
    ok = exchange_raw(group_server.addr, raw_request_frame(6, [("card", [42], None), ("device", None, ["f7a9c2"]),
                                                               ("ad", [1], None)]))
    assert ok.ok and f32_bits(ok.scores) == f32_bits(group_score(42, "f7a9c2", [1]))
