"""The sans-IO codec: requests to frames, bytes to responses.

Every message on the wire is a frame: a u32 little-endian length, then one
FlatBuffer of that many bytes (``schemas/quiver.fbs``). This module builds
``ScoreRequest`` frames and splits and decodes ``ScoreResponse`` frames from
byte buffers. It owns no socket, so the blocking client, the asyncio client
and any other event loop share it.

Requests are checked here against the server's documented limits (1 to
``candidates_max`` candidates, context lengths, ``frame_bytes_max``) and
raise ``ValueError`` before a byte is sent: the server would answer
``BadRequest``, or, for an oversized frame, close the connection. Feature
group keys (``Request.groups``) are checked for what holds on every server
(at most 16 groups, named, each one key type, string keys of 1 to 64 UTF-8
bytes); what depends on the server's ``[[groups]]`` (a group's name, scope,
key type, key length limit) only the server can check, and it answers
``BadRequest`` naming the group.

The Python FlatBuffers runtime has no verifier, so decoding a response
catches the errors a malformed buffer raises and reports them as
``ProtocolError``; lengths are bounded before anything is read.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import flatbuffers

from ._generated.quiver.wire import GroupKeys as _group
from ._generated.quiver.wire import ScoreRequest as _req
from ._generated.quiver.wire import ScoreResponse as _resp
from .enums import ExplainSkipped, Reason, Status, Tier
from .errors import ProtocolError, error_for

try:
    import numpy as np
except ImportError:  # numpy is an optional extra
    np = None

FRAME_PREFIX_BYTES = 4
#: Most ``groups`` entries one request may carry (the server's bound on
#: feature groups; ``REQUEST_GROUPS_MAX`` in src/wire/mod.rs).
GROUPS_MAX = 16
#: Longest string key any group accepts, in UTF-8 bytes; a group's own
#: ``key_bytes_max`` may be lower (``KEY_BYTES_MAX`` in the replica format).
KEY_BYTES_MAX = 64
#: Most features one explained candidate lists (``explain_top_k``;
#: ``EXPLAIN_TOP_K_MAX`` in clients/rust/src/wire/mod.rs).
EXPLAIN_TOP_K_MAX = 32
#: Most candidates one request has explained (``EXPLAIN_CANDIDATES_MAX``).
EXPLAIN_CANDIDATES_MAX = 64

#: One group's keys: a bare key (request-scope groups), or a sequence of
#: ints, of strs/bytes, or an integer numpy array.
GroupKeysArg = Union[int, str, bytes, Sequence[int], Sequence[Union[str, bytes]], Any]
#: ``Request.groups``: group name to keys, or (name, keys) pairs in order.
GroupsArg = Union[Mapping, Sequence[Tuple[str, GroupKeysArg]]]


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

    ``groups`` names feature groups and their keys (``GroupKeys`` on the
    wire): a mapping of group name to keys, or (name, keys) pairs. Ints
    (or an integer numpy array) are a u64-keyed group's ids; strs (or
    UTF-8 bytes) a string-keyed group's keys. A request-scope group takes
    one key, which may be given bare; a candidate-scope group one key per
    candidate::

        Request(groups={"card": 42, "device": "f7a9c2", "ad": [1, 2, 3]})

    The groups ``user`` and ``item`` take ``user_id`` and ``item_ids`` when
    ``groups`` does not name them. The candidate count is ``item_ids``'
    length, else the longest key list in ``groups``.

    ``explain_top_k`` asks for reason codes: each explained candidate's
    ``explain_top_k`` features with the largest contribution to its margin
    (0, the default: none; at most ``EXPLAIN_TOP_K_MAX``), of every
    candidate or, with ``explain_candidates_max``, of that many with the
    highest scores (at most ``EXPLAIN_CANDIDATES_MAX`` explained).

    ``rows`` sends the model's input rows instead of keys, for a caller
    that computes its features itself: one row per candidate, each of the
    model's input width (the length of ``features`` in the server's ``GET /models``),
    as a sequence of sequences of floats or a two-dimensional numpy array;
    NaN is a missing value. The server scores them as sent and looks
    nothing up, so such a request sets no ``user_id``, ``item_ids``,
    ``context``, ``context_ids`` or ``groups``.
    """

    user_id: int = 0
    item_ids: Sequence[int] = ()
    context: Sequence[float] = ()
    context_ids: Sequence[int] = ()
    model: str = ""
    budget_us: int = 0
    priority: int = 0
    client_id: int = 0
    request_id: Optional[int] = None
    groups: Optional[GroupsArg] = None
    explain_top_k: int = 0
    explain_candidates_max: int = 0
    rows: Optional[Any] = None


@dataclass
class Explanations:
    """A response's reason codes (the ``explain_*`` fields).

    ``skipped`` says why there are none although the request asked
    (``ExplainSkipped.NONE`` otherwise). Each explained candidate's margin
    is ``bias`` plus the sum of all its features' contributions, of which
    the largest are listed.
    """

    skipped: Any = ExplainSkipped.NONE  # ExplainSkipped
    bias: float = 0.0
    #: The explained candidates' indices, ascending.
    candidates: List[int] = field(default_factory=list)
    #: ``k`` (feature index, contribution) pairs per explained candidate,
    #: largest |contribution| first, in ``candidates`` order.
    features: List[int] = field(default_factory=list)
    contributions: List[float] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.features) // len(self.candidates) if self.candidates else 0

    def items(self) -> List[Tuple[int, List[Tuple[int, float]]]]:
        """Each explained candidate with its (feature index, contribution) pairs."""
        k = self.k
        return [
            (c, list(zip(self.features[i * k : (i + 1) * k], self.contributions[i * k : (i + 1) * k])))
            for i, c in enumerate(self.candidates)
        ]


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
    #: Reason codes, when the request asked for them.
    explanations: Explanations = field(default_factory=Explanations)

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


def _rows(values: Any, limits: Limits) -> Tuple[Any, int]:
    """Raw rows as one flat float32 sequence and their count."""
    if np is not None and isinstance(values, np.ndarray):
        if values.ndim != 2:
            raise ValueError(f"rows must be two-dimensional (candidates, width), got shape {values.shape}")
        count, width = values.shape
        flat = _floats("rows", np.ascontiguousarray(values).reshape(-1))
    else:
        rows = [list(r) for r in values]
        count = len(rows)
        width = len(rows[0]) if rows else 0
        if any(len(r) != width for r in rows):
            raise ValueError("rows must all have the same width")
        flat = _floats("rows", [v for r in rows for v in r])
    if count == 0 or width == 0:
        raise ValueError("rows must hold at least one row of at least one float")
    if count > limits.candidates_max:
        raise ValueError(f"{count} candidates exceed the limit of {limits.candidates_max}")
    return flat, count


def _is_int(value: Any) -> bool:
    """An int-like key (int, numpy integer), not a bool."""
    if isinstance(value, bool) or (np is not None and isinstance(value, np.bool_)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _str_key(group: str, key: Union[str, bytes]) -> str:
    """A string key, checked: 1 to ``KEY_BYTES_MAX`` bytes of UTF-8."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"group '{group}': key {raw!r} is not UTF-8") from None
    n = len(key.encode("utf-8"))
    if not 1 <= n <= KEY_BYTES_MAX:
        raise ValueError(f"group '{group}': a key of {n} bytes; keys are 1 to {KEY_BYTES_MAX} bytes")
    return key


def feast_key(entity_row: Mapping[str, Union[int, str]]) -> str:
    """The string key of a Feast feature view keyed by several entities (a
    composite key), from the entity row as Feast takes it
    (``{"user_id": 23758, "merchant_id": "m-1"}`` is ``"m-1|23758"``): the
    values in the order of their join keys' names (ascending, as Feast
    serializes them), joined by ``|``, an integer in signed decimal, a string
    with ``|`` and ``\\`` escaped by a ``\\`` (docs/FEATURES.md, "Feast").
    A view of one entity is keyed by its value itself: ``ValueError``."""
    if len(entity_row) < 2:
        raise ValueError(
            f"{len(entity_row)} join key(s): a composite key has two or more (a view of one entity is keyed by its value)"
        )
    parts = []
    for name in sorted(entity_row, key=lambda k: k.encode("utf-8")):
        value = entity_row[name]
        if _is_int(value):
            parts.append(str(operator.index(value)))
        elif isinstance(value, str):
            parts.append(value.replace("\\", "\\\\").replace("|", "\\|"))
        else:
            raise TypeError(f"join key '{name}': {type(value).__name__}; Feast join keys are int or str")
    key = "|".join(parts)
    n = len(key.encode("utf-8"))
    if n > KEY_BYTES_MAX:
        raise ValueError(f"the key is {n} bytes, past the {KEY_BYTES_MAX} a string key holds")
    return key


def _group_keys(group: str, keys: Any) -> Tuple[str, Any]:
    """One group's keys as ("ids", u64 list or array) or ("keys", list of str).

    ``TypeError`` for a key that is neither int nor str/bytes (bools
    included) or for ints and strings mixed in one group.
    """
    if isinstance(keys, bool) or (np is not None and isinstance(keys, np.bool_)):
        raise TypeError(f"group '{group}': key {keys!r} is a bool; keys are ints or strings")
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or _is_int(keys):
        keys = [keys]  # one bare key
    if np is not None and isinstance(keys, np.ndarray) and keys.dtype.kind in "iub":
        if keys.dtype.kind == "b":
            raise TypeError(f"group '{group}': keys must be ints or strings, got dtype {keys.dtype}")
        ids = _ids(f"group '{group}'", keys)
        if not len(ids):
            raise ValueError(f"group '{group}' has no keys: a group takes one key, or one per candidate")
        return "ids", ids
    if np is not None and isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(f"group '{group}' keys must be one-dimensional, got shape {keys.shape}")
        keys = keys.tolist()
    if isinstance(keys, (Mapping, set, frozenset)):
        raise TypeError(f"group '{group}': keys must be a sequence (in candidate order), got {type(keys).__name__}")
    try:
        keys = list(keys)
    except TypeError:
        raise TypeError(
            f"group '{group}': keys must be ints, strings or a sequence of them, got {type(keys).__name__}"
        ) from None
    if not keys:
        raise ValueError(f"group '{group}' has no keys: a group takes one key, or one per candidate")
    kinds = set()
    for k in keys:
        if _is_int(k):
            kinds.add("int")
        elif isinstance(k, (str, bytes, bytearray, memoryview)):
            kinds.add("str")
        else:
            raise TypeError(f"group '{group}': key {k!r} is a {type(k).__name__}; keys are ints or strings")
    if len(kinds) > 1:
        raise TypeError(f"group '{group}' mixes int and string keys: a group has one key type")
    if kinds == {"int"}:
        ids = [operator.index(k) for k in keys]
        bad = next((k for k in ids if not 0 <= k < 1 << 64), None)
        if bad is not None:
            raise ValueError(f"group '{group}': key {bad} is outside the u64 range")
        return "ids", ids
    return "keys", [_str_key(group, k) for k in keys]


def _groups(groups: Any, limits: Limits) -> List[Tuple[str, str, Any]]:
    """``Request.groups`` checked: (name, "ids" or "keys", keys) in order."""
    if groups is None:
        return []
    if isinstance(groups, Mapping):
        pairs: Iterable[Any] = groups.items()
    elif isinstance(groups, (str, bytes)):
        raise TypeError("groups must map group names to keys, or be (name, keys) pairs")
    else:
        pairs = groups
    out = []
    seen = set()
    for pair in pairs:
        try:
            name, keys = pair
        except (TypeError, ValueError):
            raise TypeError(f"groups must map group names to keys, or be (name, keys) pairs; got {pair!r}") from None
        if not isinstance(name, str):
            raise TypeError(f"a group name must be a str, got {type(name).__name__}")
        if not name:
            raise ValueError("a group name is empty")
        if name in seen:
            raise ValueError(f"feature group '{name}' is named twice")
        seen.add(name)
        kind, values = _group_keys(name, keys)
        if len(values) > limits.candidates_max:
            raise ValueError(
                f"group '{name}' carries {len(values)} keys, above the limit of {limits.candidates_max} candidates"
            )
        out.append((name, kind, values))
    if len(out) > GROUPS_MAX:
        raise ValueError(f"{len(out)} feature groups exceed the limit of {GROUPS_MAX}")
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

    Like the Rust encoder, ``item_ids`` is written unless it is empty and
    ``groups`` is not, and ``model``, ``context``, ``context_ids`` and
    ``groups`` only when not empty. ``TypeError`` for a field of the wrong
    type (a bool key, ints and strings mixed in one group).
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
    groups = _groups(request.groups, limits)
    rows, row_count = (None, 0)
    if request.rows is not None:
        keyed = [
            ("user_id", user_id != 0),
            ("item_ids", len(items) > 0),
            ("context", len(context) > 0),
            ("context_ids", len(context_ids) > 0),
            ("groups", bool(groups)),
        ]
        for field, present in keyed:
            if present:
                raise ValueError(f"a request with raw rows carries no {field}: the rows are the model's whole input")
        rows, row_count = _rows(request.rows, limits)
    elif len(items) == 0 and not groups:
        raise ValueError("a request needs at least one candidate: item_ids is empty and groups names none")
    if len(items) > limits.candidates_max:
        raise ValueError(f"{len(items)} candidates exceed the limit of {limits.candidates_max}")
    if len(context) > limits.context_len_max:
        raise ValueError(f"{len(context)} context floats exceed the limit of {limits.context_len_max}")
    if len(context_ids) > limits.context_len_max:
        raise ValueError(f"{len(context_ids)} context ids exceed the limit of {limits.context_len_max}")
    top_k = _check_range("explain_top_k", request.explain_top_k, 16)
    explain_candidates_max = _check_range("explain_candidates_max", request.explain_candidates_max, 16)
    if top_k > EXPLAIN_TOP_K_MAX:
        raise ValueError(f"explain_top_k {top_k} exceeds the limit of {EXPLAIN_TOP_K_MAX}")
    if top_k > 0:
        candidates = row_count or len(items) or max([1] + [len(keys) for _, _, keys in groups])
        explained = min(explain_candidates_max, candidates) if explain_candidates_max else candidates
        if explain_candidates_max > EXPLAIN_CANDIDATES_MAX or explained > EXPLAIN_CANDIDATES_MAX:
            raise ValueError(
                f"{explain_candidates_max or explained} candidates to explain exceed the limit of "
                f"{EXPLAIN_CANDIDATES_MAX}: set explain_candidates_max"
            )

    # A first guess at the size; the builder grows past it when needed.
    group_bytes = sum(
        32 + len(name) + (8 * len(keys) if kind == "ids" else sum(8 + len(k.encode()) for k in keys))
        for name, kind, keys in groups
    )
    rows_bytes = 4 * len(rows) if rows is not None else 0
    b = flatbuffers.Builder(
        128 + 8 * len(items) + 4 * len(context) + 8 * len(context_ids) + len(request.model) + group_bytes + rows_bytes
    )
    model = b.CreateString(request.model) if request.model else None
    items_at = _vector(b, items, 8, b.PrependUint64) if len(items) or (not groups and rows is None) else None
    context_at = _vector(b, context, 4, b.PrependFloat32) if len(context) else None
    ids_at = _vector(b, context_ids, 8, b.PrependUint64) if len(context_ids) else None
    groups_at = _encode_groups(b, groups) if groups else None
    rows_at = _vector(b, rows, 4, b.PrependFloat32) if rows is not None else None
    # Fields in the order the Rust encoder's generated `create` adds them
    # (widest first), so both write the same bytes (schemas/vectors).
    _req.Start(b)
    _req.AddUserId(b, user_id)
    _req.AddRequestId(b, request_id)
    _req.AddRowCount(b, row_count)
    if rows_at is not None:
        _req.AddRows(b, rows_at)
    if groups_at is not None:
        _req.AddGroups(b, groups_at)
    if ids_at is not None:
        _req.AddContextIds(b, ids_at)
    if context_at is not None:
        _req.AddContext(b, context_at)
    if items_at is not None:
        _req.AddItemIds(b, items_at)
    _req.AddClientId(b, client_id)
    _req.AddBudgetUs(b, budget_us)
    if model is not None:
        _req.AddModel(b, model)
    _req.AddExplainCandidatesMax(b, explain_candidates_max)
    _req.AddExplainTopK(b, top_k)
    _req.AddPriority(b, priority)
    b.Finish(_req.End(b))
    payload = bytes(b.Output())
    if len(payload) > limits.frame_bytes_max:
        raise ValueError(f"request frame of {len(payload)} bytes exceeds the limit of {limits.frame_bytes_max}")
    return struct.pack("<I", len(payload)) + payload


def _encode_groups(b: flatbuffers.Builder, groups: List[Tuple[str, str, Any]]) -> int:
    """The ``groups`` vector: one GroupKeys table per group, in order."""
    tables = []
    for name, kind, keys in groups:
        name_at = b.CreateString(name)
        if kind == "ids":
            ids_at, keys_at = _vector(b, keys, 8, b.PrependUint64), None
        else:
            strings = [b.CreateString(k) for k in keys]
            b.StartVector(4, len(strings), 4)
            for at in reversed(strings):
                b.PrependUOffsetTRelative(at)
            ids_at, keys_at = None, b.EndVector()
        _group.Start(b)
        if keys_at is not None:
            _group.AddKeys(b, keys_at)
        if ids_at is not None:
            _group.AddIds(b, ids_at)
        _group.AddGroup(b, name_at)
        tables.append(_group.End(b))
    b.StartVector(4, len(tables), 4)
    for at in reversed(tables):
        b.PrependUOffsetTRelative(at)
    return b.EndVector()


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
            explanations=_explanations(r, len(payload)),
        )
    except _MALFORMED as e:
        raise ProtocolError(f"malformed response: {e}") from None


def _explanations(r: Any, payload_bytes: int) -> Explanations:
    """The ``explain_*`` fields, their lengths bounded by the payload's; a
    response whose lengths disagree reads as explaining nothing rather than
    misattributing."""
    skipped = _known(ExplainSkipped, r.ExplainSkipped(), ExplainSkipped.NONE)
    n, pairs = r.ExplainCandidatesLength(), r.ExplainFeaturesLength()
    if n * 4 + pairs * 12 > payload_bytes:
        raise ProtocolError(f"response claims {n} explained candidates and {pairs} features in {payload_bytes} bytes")
    if n == 0 or pairs != r.ExplainContributionsLength() or pairs % n:
        return Explanations(skipped=skipped)
    return Explanations(
        skipped=skipped,
        bias=r.ExplainBias(),
        candidates=[r.ExplainCandidates(i) for i in range(n)],
        features=[r.ExplainFeatures(i) for i in range(pairs)],
        contributions=[r.ExplainContributions(i) for i in range(pairs)],
    )


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
