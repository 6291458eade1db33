"""The asyncio client, against real servers and the fake one.

Each test runs its own event loop with ``asyncio.run``, so no pytest plugin
is needed.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import quiver_client as q
from helpers import N, FakeServer, demo_request, echo_answer, f32_bits, numpy_or_skip, same_bits, thread_batch
from helpers import BIG_BUDGET_US, GROUP_ERRORS, GROUP_REQUEST, group_score


def test_gather_pipelines_1000_calls_on_one_connection(server, singles):
    async def main():
        async with q.AsyncClient(server.addr, timeout=30) as c:
            writer = c._writer
            answers = await asyncio.gather(*(c.score(demo_request(i, request_id=70_000 + i)) for i in range(N)))
            assert c._writer is writer and c._pending == {}
            return answers

    answers = asyncio.run(main())
    assert [a.request_id for a in answers] == [70_000 + i for i in range(N)]
    assert all(a.ok and a.tier == q.Tier.PRIMARY and same_bits(a, s) for a, s in zip(answers, singles))


def test_thread_mode_answers_match_by_request_id(thread_server, singles):
    reqs, good = thread_batch()

    async def main():
        async with q.AsyncClient(thread_server.addr, timeout=30) as c:
            return await c.score_many(reqs, check=False)

    for req, a in zip(reqs, asyncio.run(main())):
        assert a.request_id == req.request_id
        if req.request_id in good:
            assert a.ok and same_bits(a, singles[good[req.request_id]])
        else:
            assert a.status == q.Status.MODEL_NOT_FOUND


def test_reverse_order_and_numpy():
    np = numpy_or_skip()
    fake = FakeServer(batch=40)

    async def main():
        async with q.AsyncClient(fake.addr, as_numpy=True) as c:
            return await c.score_many([q.Request(user_id=1, item_ids=[i]) for i in range(40)])

    try:
        answers = asyncio.run(main())
    finally:
        fake.close()
    for i, a in enumerate(answers):
        assert isinstance(a.scores, np.ndarray)
        assert a.scores.view(np.uint32).tolist() == f32_bits([a.request_id + i / 1000])


def test_typed_errors_and_limits(server):
    async def main():
        async with q.AsyncClient(server.addr) as c:
            with pytest.raises(q.ModelNotFound) as e:
                await c.score(user_id=1, item_ids=[1], model="nope", request_id=9)
            assert e.value.request_id == 9
            with pytest.raises(q.BadRequest, match="context has 3 floats"):
                await c.score(user_id=1, item_ids=[1], context=[1.0, 2.0, 3.0])
            with pytest.raises(ValueError, match="257 candidates"):
                await c.score(user_id=1, item_ids=list(range(257)))
            r = await c.score(user_id=1, item_ids=[1], model="nope", check=False)
            assert r.status == q.Status.MODEL_NOT_FOUND
            assert (await c.score(user_id=1, item_ids=[1, 2])).ok

    asyncio.run(main())


def test_timeout_then_the_connection_goes_on():
    # The first request gets no answer; later ones are echoed.
    seen = []

    def answer(held):
        seen.append(1)
        return b"" if len(seen) == 1 else b"".join(echo_answer(p) for p in held)

    fake = FakeServer(answer=answer)

    async def main():
        async with q.AsyncClient(fake.addr, timeout=0.3) as c:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await c.score(user_id=1, item_ids=[1])
            assert time.monotonic() - started < 2
            r = await c.score(user_id=1, item_ids=[2])
            assert r.ok and fake.connections == 1

    try:
        asyncio.run(main())
    finally:
        fake.close()


def test_a_closed_connection_fails_waiting_calls_and_reconnects():
    fake = FakeServer(batch=3, answer=lambda held: None)  # hangs up after 3 requests, answering none

    async def main():
        async with q.AsyncClient(fake.addr, timeout=5) as c:
            results = await asyncio.gather(
                *(c.score(user_id=1, item_ids=[i]) for i in range(3)), return_exceptions=True
            )
            assert all(isinstance(r, q.ConnectionClosed) for r in results), results
            fake.answer = lambda held: b"".join(echo_answer(p) for p in held)
            fake.batch = 1
            assert (await c.score(user_id=1, item_ids=[1])).ok
            assert fake.connections == 2

    try:
        asyncio.run(main())
    finally:
        fake.close()


def test_limits_are_checked_before_anything_is_sent():
    fake = FakeServer()

    async def main():
        async with q.AsyncClient(fake.addr) as c:
            with pytest.raises(ValueError, match="257 candidates"):
                await c.score_many(
                    [q.Request(user_id=1, item_ids=[1]), q.Request(user_id=1, item_ids=list(range(257)))]
                )
            assert c._pending == {}
            # Given ids and picked ids mix without clashing.
            answers = await c.score_many(
                [q.Request(user_id=1, item_ids=[1]), q.Request(user_id=1, item_ids=[1], request_id=1)]
            )
            assert [a.request_id for a in answers][1] == 1 and answers[0].request_id != 1

    try:
        asyncio.run(main())
        assert fake.requests == 2
    finally:
        fake.close()


def test_group_keys_pipelined_score_what_their_rows_imply(group_server):
    cards, devices = [42, 43, 7], ["f7a9c2", "caf\u00e9-\u2615", "nobody"]
    cases = [(card, device, [1 + k % 3 for k in range(i % 5 + 1)]) for i, (card, device) in
             enumerate((c, d) for c in cards for d in devices)]

    async def main():
        async with q.AsyncClient(group_server.addr) as c:
            return await asyncio.gather(
                *(c.score(groups={"card": card, "device": device, "ad": ads}, budget_us=BIG_BUDGET_US)
                  for card, device, ads in cases)
            )

    answers = asyncio.run(main())
    for (card, device, ads), a in zip(cases, answers):
        assert a.ok and f32_bits(a.scores) == f32_bits(group_score(card, device, ads)), (card, device, ads, a)
        assert a.features_missing == (card == 7) + (device == "nobody")


@pytest.mark.parametrize("fields, error", GROUP_ERRORS)
def test_group_errors_are_bad_request_with_the_servers_message(group_server, fields, error):
    async def main():
        async with q.AsyncClient(group_server.addr) as c:
            with pytest.raises(q.BadRequest) as e:
                await c.score(budget_us=BIG_BUDGET_US, request_id=78, **fields)
            assert e.value.error.startswith(error), e.value.error
            assert e.value.request_id == 78
            r = await c.score(budget_us=BIG_BUDGET_US, check=False, **fields)
            assert r.status == q.Status.BAD_REQUEST and r.scores == []
            assert (await c.score(groups=GROUP_REQUEST, budget_us=BIG_BUDGET_US)).ok

    asyncio.run(main())


def test_group_keys_are_checked_before_anything_is_sent():
    fake = FakeServer()

    async def main():
        async with q.AsyncClient(fake.addr) as c:
            with pytest.raises(TypeError, match="mixes int and string keys"):
                await c.score(groups={"ad": [1, "x"]})
            with pytest.raises(ValueError, match="a key of 65 bytes"):
                await c.score_many([q.Request(groups={"card": 1}), q.Request(groups={"device": "k" * 65})])
            assert c._pending == {}

    try:
        asyncio.run(main())
        assert fake.requests == 0
    finally:
        fake.close()
