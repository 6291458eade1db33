"""quiver_client: a Python client for the Quiver scoring server.

Quiver speaks length-prefixed FlatBuffers over TCP (``schemas/quiver.fbs``):
a ``ScoreRequest`` frame in, a ``ScoreResponse`` frame with the same
``request_id`` out, pipelined, answers possibly out of order.

- ``Client``: blocking; one connection per node, ``score`` and pipelined
  ``score_many``, round-robin over a node list with failover.
- ``AsyncClient``: asyncio; concurrent calls pipelined on one connection.
- ``encode_request`` / ``split_frames`` / ``decode_response`` /
  ``FrameReader``: the sans-IO codec both are built on.
- ``QuiverError`` and one subclass per non-Ok status.

    from quiver_client import Client
    with Client("127.0.0.1:7411") as c:
        r = c.score(user_id=42, item_ids=[1, 2, 3], budget_us=5000)
        print(r.scores, r.tier.name, r.model_version)
        # Feature groups by name: one key for a request-scope group, one
        # per candidate for a candidate-scope group.
        r = c.score(groups={"card": 42, "device": "f7a9c2", "ad": [1, 2, 3]})
        # Reason codes: each candidate's five largest feature contributions.
        r = c.score(user_id=42, item_ids=[1, 2, 3], explain_top_k=5)
        for candidate, top in r.explanations.items():
            print(candidate, r.explanations.bias, top)
"""

from .aio import AsyncClient
from .client import Client, parse_address
from .codec import (
    DEFAULT_LIMITS,
    EXPLAIN_CANDIDATES_MAX,
    EXPLAIN_TOP_K_MAX,
    FRAME_PREFIX_BYTES,
    Explanations,
    GROUPS_MAX,
    KEY_BYTES_MAX,
    FrameReader,
    Limits,
    Request,
    Response,
    decode_response,
    encode_request,
    feast_key,
    response_request_id,
    split_frames,
)
from .enums import ExplainSkipped, Reason, Status, Tier
from .errors import (
    AllNodesFailed,
    BadRequest,
    ConnectionClosed,
    DeadlineExceeded,
    Internal,
    ModelNotFound,
    Overloaded,
    ProtocolError,
    QuiverError,
    RateLimited,
    error_for,
)

__all__ = [
    "AllNodesFailed",
    "AsyncClient",
    "BadRequest",
    "Client",
    "ConnectionClosed",
    "DEFAULT_LIMITS",
    "DeadlineExceeded",
    "EXPLAIN_CANDIDATES_MAX",
    "EXPLAIN_TOP_K_MAX",
    "ExplainSkipped",
    "Explanations",
    "FRAME_PREFIX_BYTES",
    "FrameReader",
    "GROUPS_MAX",
    "Internal",
    "KEY_BYTES_MAX",
    "Limits",
    "ModelNotFound",
    "Overloaded",
    "ProtocolError",
    "QuiverError",
    "RateLimited",
    "Reason",
    "Request",
    "Response",
    "Status",
    "Tier",
    "decode_response",
    "encode_request",
    "error_for",
    "feast_key",
    "parse_address",
    "response_request_id",
    "split_frames",
]
