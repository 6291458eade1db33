"""TLS to a server with ``[tls]``: the blocking and asyncio clients with an
``ssl.SSLContext`` get the same answers as over plain TCP, and a certificate
they cannot verify fails at connect."""

from __future__ import annotations

import asyncio
import ssl

import pytest

import quiver_client as q
from helpers import N, demo_request, same_bits


def _context(cafile) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def test_the_blocking_client_scores_over_tls_like_plain_tcp(tls_server, tls_cert, singles):
    with q.Client(tls_server.addr, tls=_context(tls_cert), timeout=10.0) as c:
        assert same_bits(c.score(demo_request(0)), singles[0])
        answers = c.score_many([demo_request(i) for i in range(N)])
    assert all(same_bits(a, b) for a, b in zip(answers, singles))


def test_the_async_client_scores_over_tls_like_plain_tcp(tls_server, tls_cert, singles):
    async def run():
        async with q.AsyncClient(tls_server.addr, tls=_context(tls_cert), timeout=10.0) as c:
            one = await c.score(demo_request(1))
            many = await c.score_many([demo_request(i) for i in range(N)])
        return one, many

    one, many = asyncio.run(run())
    assert same_bits(one, singles[1])
    assert all(same_bits(a, b) for a, b in zip(many, singles))


def test_an_unverifiable_certificate_fails_at_connect(tls_server):
    untrusting = ssl.create_default_context()  # the system's roots never signed the test's certificate
    with q.Client(tls_server.addr, tls=untrusting, timeout=5.0) as c:
        with pytest.raises(q.AllNodesFailed) as failed:
            c.score(demo_request(0))
    assert any(isinstance(e, ssl.SSLCertVerificationError) for e in failed.value.errors.values())

    async def run():
        async with q.AsyncClient(tls_server.addr, tls=untrusting, timeout=5.0):
            pass

    with pytest.raises(ssl.SSLCertVerificationError):
        asyncio.run(run())


def test_a_plain_client_gets_no_answer_from_a_tls_port(tls_server):
    with q.Client(tls_server.addr, timeout=2.0) as c:
        with pytest.raises((ConnectionError, TimeoutError, q.ProtocolError)):
            c.score(demo_request(0))
