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
