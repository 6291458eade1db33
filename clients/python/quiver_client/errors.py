"""Exceptions: one per non-Ok status, plus transport failures.

A non-Ok ``ScoreResponse`` raises the ``QuiverError`` subclass for its
status, carrying the status, the server's error text, the request id and
the whole response. Failures below the protocol are the builtin
``ConnectionError`` and ``TimeoutError`` (or subclasses of them), so callers
can treat them like any other socket error.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .enums import Status


class QuiverError(Exception):
    """The server answered with a non-Ok status."""

    status: Any = None

    def __init__(self, status: Any, error: str, request_id: int, response: Any = None):
        super().__init__(f"{Status(status).name.lower()} (request {request_id}): {error or 'no reason given'}")
        self.status = Status(status)
        self.error = error
        self.request_id = request_id
        self.response = response


class DeadlineExceeded(QuiverError):
    """The budget was spent before any rung of the ladder could answer."""


class Overloaded(QuiverError):
    """The server (or this request's priority) was shed, or it is drained."""


class RateLimited(QuiverError):
    """The client_id is over its rate limit."""


class BadRequest(QuiverError):
    """The request broke a server limit or does not fit the model."""


class ModelNotFound(QuiverError):
    """No served model has the requested name."""


class Internal(QuiverError):
    """The server failed, or sent a status this client does not know."""


_BY_STATUS = {
    Status.DEADLINE_EXCEEDED: DeadlineExceeded,
    Status.OVERLOADED: Overloaded,
    Status.RATE_LIMITED: RateLimited,
    Status.BAD_REQUEST: BadRequest,
    Status.MODEL_NOT_FOUND: ModelNotFound,
    Status.INTERNAL: Internal,
}
assert set(_BY_STATUS) == set(Status) - {Status.OK}, "one exception per non-Ok status"


def error_for(response: Any) -> QuiverError:
    """The exception for a non-Ok response."""
    cls = _BY_STATUS.get(response.status, Internal)
    return cls(response.status, response.error, response.request_id, response)


class ProtocolError(Exception):
    """The server sent bytes this client cannot read (a bad frame, an unknown
    request id); the connection is closed."""


class ConnectionClosed(ConnectionError):
    """The server closed the connection before answering."""


class AllNodesFailed(ConnectionError):
    """No node of the list could be reached; ``errors`` says why for each."""

    def __init__(self, errors: List[Tuple[str, BaseException]]):
        super().__init__("no node answered: " + "; ".join(f"{addr}: {e!r}" for addr, e in errors))
        self.errors: Dict[str, BaseException] = dict(errors)
