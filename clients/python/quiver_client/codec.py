"""The sans-IO codec: requests to frames, bytes to responses.

Every message on the wire is a frame: a u32 little-endian length, then one
FlatBuffer of that many bytes (``schemas/quiver.fbs``). This module builds
``ScoreRequest`` frames and splits and decodes ``ScoreResponse`` frames from
byte buffers. It owns no socket, so the blocking client, the asyncio client
and any other event loop share it.

Requests are checked here against the server's documented limits (1 to
``candidates_max`` candidates, context lengths, ``frame_bytes_max``) and
raise ``ValueError`` before a byte is sent: the server would answer
``BadRequest``, or, for an oversized frame, close the connection.

The Python FlatBuffers runtime has no verifier, so decoding a response
catches the errors a malformed buffer raises and reports them as
``ProtocolError``; lengths are bounded before anything is read.
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import flatbuffers

from ._generated.quiver.wire import ScoreRequest as _req
from ._generated.quiver.wire import ScoreResponse as _resp
from .enums import Reason, Status, Tier
from .errors import ProtocolError, error_for

try:
    import numpy as np
except ImportError:  # numpy is an optional extra
    np = None

FRAME_PREFIX_BYTES = 4


@dataclass(frozen=True)
class Limits:
    """Limits checked before a request is sent, and on responses.

    The defaults are the server's defaults (``[limits]`` in its config);
    match them to a server configured otherwise.
    """

    candidates_max: int = 256
    context_len_max: int = 256
    #: Largest request frame, excluding the 4-byte length prefix.
    frame_bytes_max: int = 65536
    #: Largest response frame accepted from the server.
    response_frame_bytes_max: int = 1 << 20


DEFAULT_LIMITS = Limits()


@dataclass
class Request:
    """One ScoreRequest: every field the schema has.

    ``item_ids`` and ``context_ids`` take lists of ints or integer numpy
    arrays; ``context`` a list of floats or a numpy array (sent as float32).
    ``request_id`` None lets the client pick a free id.
    """

    user_id: int
    item_ids: Sequence[int]
    context: Sequence[float] = ()
    context_ids: Sequence[int] = ()
    model: str = ""
    budget_us: int = 0
    priority: int = 0
    client_id: int = 0
    request_id: Optional[int] = None


@dataclass
class Response:
    """One ScoreResponse: exactly the schema's fields."""

    request_id: int
    status: Any  # Status
    #: One score per item in request order: a list of floats, or a float32
    #: numpy array when asked for. Empty unless the status is Ok.
    scores: Any
    tier: Any  # Tier
    model_version: int
    server_us: int
    features_missing: int
    error: str
    reason: Any  # Reason
    features_stale: bool

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    def raise_for_status(self) -> "Response":
        """Raises the status's ``QuiverError`` subclass unless Ok; returns self."""
        if not self.ok:
            raise error_for(self)
        return self


def as_request(request: Optional[Union[Request, dict]] = None, **fields: Any) -> Request:
    """A ``Request`` from a Request, a dict of fields, or keyword fields."""
    if request is None:
        return Request(**fields)
    if fields:
        raise TypeError("pass either a request or its fields, not both")
    if isinstance(request, Request):
        return request
    if isinstance(request, dict):
        return Request(**request)
    raise TypeError(f"expected a Request or a dict, got {type(request).__name__}")


def _check_range(name: str, value: Any, bits: int) -> int:
    value = operator.index(value)
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name} = {value} is outside the u{bits} range")
    return value


def _ids(name: str, values: Any) -> Any:
    """A list of u64 ints, or a little-endian uint64 numpy array."""
    if np is not None and isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        if values.dtype.kind == "i" and values.size and values.min() < 0:
            raise ValueError(f"{name} holds a negative id")
        return values.astype("<u8", copy=False)
    return [_check_range(name, v, 64) for v in values]


def _floats(name: str, values: Any) -> Any:
    """A list of floats that fit float32, or a little-endian float32 array."""
    if np is not None and isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {values.shape}")
        if values.dtype.kind not in "fiu":
            raise TypeError(f"{name} must hold numbers, got dtype {values.dtype}")
        with np.errstate(over="ignore"):
            out = values.astype("<f4", copy=False)
        if (np.isinf(out) & ~np.isinf(values)).any():
            raise ValueError(f"{name} holds a value outside the float32 range")
        return out
    out = [float(v) for v in values]
    try:
        struct.pack(f"<{len(out)}f", *out)
    except OverflowError:
        raise ValueError(f"{name} holds a value outside the float32 range") from None
    return out


def _vector(b: flatbuffers.Builder, values: Any, width: int, prepend: Any) -> int:
    if np is not None and isinstance(values, np.ndarray):
        return b.CreateNumpyVector(values)
    b.StartVector(width, len(values), width)
    for v in reversed(values):
        prepend(v)
    return b.EndVector()


def encode_request(request: Request, request_id: int, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One request frame (prefix included), or ``ValueError`` if a limit is broken.

    Like the Rust encoder, ``item_ids`` is always written and ``model``,
    ``context`` and ``context_ids`` only when not empty.
    """
    request_id = _check_range("request_id", request_id, 64)
    user_id = _check_range("user_id", request.user_id, 64)
    budget_us = _check_range("budget_us", request.budget_us, 32)
    priority = _check_range("priority", request.priority, 8)
    client_id = _check_range("client_id", request.client_id, 32)
    if not isinstance(request.model, str):
        raise TypeError(f"model must be a str, got {type(request.model).__name__}")
    items = _ids("item_ids", request.item_ids)
    context = _floats("context", request.context)
    context_ids = _ids("context_ids", request.context_ids)
    if len(items) == 0:
        raise ValueError("a request needs at least one candidate: item_ids is empty")
    if len(items) > limits.candidates_max:
        raise ValueError(f"{len(items)} candidates exceed the limit of {limits.candidates_max}")
    if len(context) > limits.context_len_max:
        raise ValueError(f"{len(context)} context floats exceed the limit of {limits.context_len_max}")
    if len(context_ids) > limits.context_len_max:
        raise ValueError(f"{len(context_ids)} context ids exceed the limit of {limits.context_len_max}")

    b = flatbuffers.Builder(128 + 8 * len(items) + 4 * len(context) + 8 * len(context_ids) + len(request.model))
    model = b.CreateString(request.model) if request.model else None
    items_at = _vector(b, items, 8, b.PrependUint64)
    context_at = _vector(b, context, 4, b.PrependFloat32) if len(context) else None
    ids_at = _vector(b, context_ids, 8, b.PrependUint64) if len(context_ids) else None
    _req.Start(b)
    _req.AddRequestId(b, request_id)
    if model is not None:
        _req.AddModel(b, model)
    _req.AddBudgetUs(b, budget_us)
    _req.AddPriority(b, priority)
    _req.AddClientId(b, client_id)
    _req.AddUserId(b, user_id)
    _req.AddItemIds(b, items_at)
    if context_at is not None:
        _req.AddContext(b, context_at)
    if ids_at is not None:
        _req.AddContextIds(b, ids_at)
    b.Finish(_req.End(b))
    payload = bytes(b.Output())
    if len(payload) > limits.frame_bytes_max:
        raise ValueError(f"request frame of {len(payload)} bytes exceeds the limit of {limits.frame_bytes_max}")
    return struct.pack("<I", len(payload)) + payload


def split_frames(buf: Union[bytes, bytearray, memoryview], frame_bytes_max: int) -> Tuple[List[bytes], int]:
    """The complete frames' payloads at the front of ``buf``, and the bytes they use.

    A length prefix of 0 or above ``frame_bytes_max`` cannot be
    resynchronised: ``ProtocolError``, and the connection must be closed.
    """
    payloads = []
    at = 0
    while len(buf) - at >= FRAME_PREFIX_BYTES:
        (n,) = struct.unpack_from("<I", buf, at)
        if n == 0:
            raise ProtocolError("empty frame (length prefix 0) from the server")
        if n > frame_bytes_max:
            raise ProtocolError(f"frame of {n} bytes from the server exceeds the limit of {frame_bytes_max}")
        end = at + FRAME_PREFIX_BYTES + n
        if end > len(buf):
            break
        payloads.append(bytes(buf[at + FRAME_PREFIX_BYTES : end]))
        at = end
    return payloads, at


def _known(kind: Any, value: int, unknown: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        return unknown


# What the FlatBuffers runtime raises when it reads a malformed buffer.
_MALFORMED = (IndexError, struct.error, ValueError, TypeError, OverflowError)


def _root(payload: bytes) -> Any:
    if len(payload) < 8:
        raise ProtocolError(f"response of {len(payload)} bytes is too short to be a FlatBuffer")
    return _resp.ScoreResponse.GetRootAs(payload, 0)


def response_request_id(payload: bytes) -> int:
    """The request_id of a response payload, to route it before decoding it whole."""
    try:
        return _root(payload).RequestId()
    except _MALFORMED as e:
        raise ProtocolError(f"malformed response: {e}") from None


def require_numpy() -> None:
    if np is None:
        raise ImportError("as_numpy=True needs numpy: pip install 'quiver-client[numpy]'")


def decode_response(payload: bytes, as_numpy: bool = False) -> Response:
    """Decodes one response payload (without its length prefix)."""
    if as_numpy:
        require_numpy()
    try:
        r = _root(payload)
        count = r.ScoresLength()
        if count * 4 > len(payload):
            raise ProtocolError(f"response claims {count} scores in {len(payload)} bytes")
        if as_numpy:
            scores = r.ScoresAsNumpy().copy() if count else np.empty(0, dtype=np.float32)
        else:
            scores = [r.Scores(j) for j in range(count)]
        error = r.Error()
        return Response(
            request_id=r.RequestId(),
            status=_known(Status, r.Status(), Status.INTERNAL),
            scores=scores,
            tier=_known(Tier, r.Tier(), Tier.DEFAULT),
            model_version=r.ModelVersion(),
            server_us=r.ServerUs(),
            features_missing=r.FeaturesMissing(),
            error=error.decode("ascii", "replace") if error else "",
            reason=_known(Reason, r.Reason(), Reason.NONE),
            features_stale=r.FeaturesStale(),
        )
    except _MALFORMED as e:
        raise ProtocolError(f"malformed response: {e}") from None


class FrameReader:
    """Accumulates bytes from a stream and yields whole frames' payloads."""

    def __init__(self, frame_bytes_max: int = DEFAULT_LIMITS.response_frame_bytes_max):
        self.frame_bytes_max = frame_bytes_max
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[bytes]:
        self._buf += data
        payloads, used = split_frames(self._buf, self.frame_bytes_max)
        del self._buf[:used]
        return payloads

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
