"""The sans-IO codec, without a server: encoding, framing, decoding, limits."""

from __future__ import annotations

import random
import re
import struct

import pytest

import quiver_client as q
from helpers import encode_response, f32, f32_bits, numpy_or_skip, request_groups
from quiver_client._generated.quiver.wire import ScoreRequest as fb_req


def parse(frame: bytes):
    payloads, used = q.split_frames(frame, 1 << 20)
    assert used == len(frame) and len(payloads) == 1
    return fb_req.ScoreRequest.GetRootAs(payloads[0], 0)


def test_request_round_trip_every_field():
    req = q.Request(
        user_id=2**64 - 1,
        item_ids=[0, 1, 2**63],
        context=[0.5, -1.0, 0.1],
        context_ids=[3, 1 << 40],
        model="auction-32",
        budget_us=2**32 - 1,
        priority=255,
        client_id=7,
    )
    r = parse(q.encode_request(req, 99))
    assert (r.RequestId(), r.UserId(), r.Model(), r.BudgetUs(), r.Priority(), r.ClientId()) == (
        99,
        2**64 - 1,
        b"auction-32",
        2**32 - 1,
        255,
        7,
    )
    assert [r.ItemIds(j) for j in range(r.ItemIdsLength())] == [0, 1, 2**63]
    assert [r.Context(j) for j in range(r.ContextLength())] == [0.5, -1.0, f32(0.1)]
    assert [r.ContextIds(j) for j in range(r.ContextIdsLength())] == [3, 1 << 40]


def test_empty_optional_fields_are_left_out_like_the_rust_encoder():
    r = parse(q.encode_request(q.Request(user_id=1, item_ids=[5]), 1))
    assert r.Model() is None
    assert r.ContextIsNone() and r.ContextIdsIsNone() and not r.ItemIdsIsNone()


def test_numpy_inputs_encode_the_same_bytes_as_lists():
    np = numpy_or_skip()
    ctx = [f32(x / 7) for x in range(16)]
    as_list = q.Request(user_id=3, item_ids=[9, 8, 7], context=ctx, context_ids=[1, 2])
    as_np = q.Request(
        user_id=3,
        item_ids=np.array([9, 8, 7], dtype=np.int32),
        context=np.array(ctx),
        context_ids=np.array([1, 2], dtype=np.uint64),
    )
    assert q.encode_request(as_list, 5) == q.encode_request(as_np, 5)
    with pytest.raises(ValueError, match="negative"):
        q.encode_request(q.Request(user_id=1, item_ids=np.array([-1])), 1)
    with pytest.raises(TypeError, match="integers"):
        q.encode_request(q.Request(user_id=1, item_ids=np.array([1.5])), 1)
    with pytest.raises(ValueError, match="float32 range"):
        q.encode_request(q.Request(user_id=1, item_ids=[1], context=np.array([1e39])), 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(item_ids=[]), "at least one candidate"),
        (dict(item_ids=list(range(257))), "257 candidates exceed the limit of 256"),
        (dict(context=[0.0] * 257), "257 context floats exceed"),
        (dict(context_ids=[1] * 257), "257 context ids exceed"),
        (dict(model="m" * 70_000), "exceeds the limit of 65536"),
        (dict(user_id=-1), "user_id"),
        (dict(budget_us=2**32), "budget_us"),
        (dict(priority=256), "priority"),
        (dict(context=[1e39]), "float32 range"),
    ],
)
def test_limits_raise_value_error(change, message):
    fields = dict(user_id=1, item_ids=[1, 2])
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        q.encode_request(q.Request(**fields), 1)


def test_limits_follow_the_configured_server():
    big = q.Request(user_id=1, item_ids=list(range(300)))
    q.encode_request(big, 1, q.Limits(candidates_max=512))
    with pytest.raises(ValueError):
        q.encode_request(q.Request(user_id=1, item_ids=[1, 2, 3]), 1, q.Limits(candidates_max=2))


def test_groups_round_trip_with_bare_keys_lists_and_bytes():
    req = q.Request(groups={"card": 42, "device": "f7a9c2", "ad": [1, 2**64 - 1, 3], "shop": [b"s-1", "caf\u00e9"]})
    r = parse(q.encode_request(req, 11))
    assert request_groups(r) == {
        "card": [42],
        "device": ["f7a9c2"],
        "ad": [1, 2**64 - 1, 3],
        "shop": ["s-1", "caf\u00e9"],
    }
    # Groups in the order given; user_id 0 and item_ids left out, as the Rust encoder does.
    assert [r.Groups(j).Group() for j in range(r.GroupsLength())] == [b"card", b"device", b"ad", b"shop"]
    assert (r.RequestId(), r.UserId()) == (11, 0)
    assert r.ItemIdsIsNone() and r.ContextIsNone() and r.Model() is None


def test_groups_beside_the_old_fields_and_as_pairs():
    req = q.Request(7, [5, 6], model="fraud", groups=[("ad", (8, 9)), ("user", [7])])
    r = parse(q.encode_request(req, 1))
    assert (r.UserId(), [r.ItemIds(j) for j in range(r.ItemIdsLength())], r.Model()) == (7, [5, 6], b"fraud")
    assert list(request_groups(r).items()) == [("ad", [8, 9]), ("user", [7])]
    # No groups, or an empty mapping: the field is left out.
    assert parse(q.encode_request(q.Request(1, [5]), 1)).GroupsIsNone()
    assert parse(q.encode_request(q.Request(1, [5], groups={}), 1)).GroupsIsNone()


def test_numpy_group_keys_encode_the_same_bytes_as_lists():
    np = numpy_or_skip()
    as_list = q.Request(groups={"card": 4, "ad": [9, 8, 7], "device": ["a", "b"]})
    as_np = q.Request(
        groups={"card": np.uint64(4), "ad": np.array([9, 8, 7], dtype=np.int32), "device": np.array(["a", "b"])}
    )
    assert q.encode_request(as_list, 5) == q.encode_request(as_np, 5)
    with pytest.raises(ValueError, match="group 'ad' holds a negative id"):
        q.encode_request(q.Request(groups={"ad": np.array([1, -1])}), 1)
    with pytest.raises(TypeError, match="group 'ad': keys must be ints or strings, got dtype bool"):
        q.encode_request(q.Request(groups={"ad": np.array([True, False])}), 1)
    with pytest.raises(ValueError, match="group 'ad' has no keys"):
        q.encode_request(q.Request(groups={"ad": np.array([], dtype=np.uint64)}), 1)
    with pytest.raises(ValueError, match="one-dimensional"):
        q.encode_request(q.Request(groups={"ad": np.array([[1, 2]])}), 1)


def test_group_limits_at_the_edge_are_accepted():
    keys = {f"g{i}": i for i in range(q.GROUPS_MAX)}
    keys["g0"] = "k" * q.KEY_BYTES_MAX
    keys["g1"] = "\u00e9" * (q.KEY_BYTES_MAX // 2)  # 64 bytes of UTF-8
    keys["g2"] = list(range(256))
    r = parse(q.encode_request(q.Request(groups=keys), 1))
    assert r.GroupsLength() == 16 and request_groups(r)["g1"] == ["\u00e9" * 32]


@pytest.mark.parametrize(
    "groups, error, message",
    [
        ({"ad": [1, "x"]}, TypeError, "group 'ad' mixes int and string keys"),
        ({"": 1}, ValueError, "a group name is empty"),
        ({3: 1}, TypeError, "a group name must be a str, got int"),
        ({"card": True}, TypeError, "group 'card': key True is a bool"),
        ({"ad": [1, False]}, TypeError, "group 'ad': key False is a bool"),
        ({"device": "k" * 65}, ValueError, "group 'device': a key of 65 bytes; keys are 1 to 64 bytes"),
        ({"device": "\u00e9" * 33}, ValueError, "a key of 66 bytes"),
        ({"device": ""}, ValueError, "group 'device': a key of 0 bytes"),
        ({"device": b"\xff\xfe"}, ValueError, "group 'device': key b'\\xff\\xfe' is not UTF-8"),
        ({f"g{i}": 1 for i in range(17)}, ValueError, "17 feature groups exceed the limit of 16"),
        ({"ad": []}, ValueError, "group 'ad' has no keys"),
        ({"ad": [1.5]}, TypeError, "group 'ad': key 1.5 is a float"),
        ({"card": 2.0}, TypeError, "group 'card': keys must be ints, strings or a sequence of them, got float"),
        ({"ad": {1, 2}}, TypeError, "group 'ad': keys must be a sequence"),
        ({"card": -1}, ValueError, "group 'card': key -1 is outside the u64 range"),
        ({"card": 2**64}, ValueError, "outside the u64 range"),
        ({"ad": list(range(257))}, ValueError, "group 'ad' carries 257 keys, above the limit of 256 candidates"),
        ([("card", 1), ("card", 2)], ValueError, "feature group 'card' is named twice"),
        ([("card",)], TypeError, "groups must map group names to keys, or be"),
        ("card", TypeError, "groups must map group names to keys"),
    ],
)
def test_group_keys_are_checked_before_sending(groups, error, message):
    with pytest.raises(error, match=re.escape(message)):
        q.encode_request(q.Request(groups=groups), 1)


def test_group_keys_count_toward_the_frame_limit():
    # 16 groups of 256 keys of 64 bytes: about 300 KB, over the 64 KiB frame.
    big = {f"g{i}": [f"{k:064d}" for k in range(256)] for i in range(16)}
    with pytest.raises(ValueError, match="exceeds the limit of 65536"):
        q.encode_request(q.Request(groups=big), 1)
    frame = q.encode_request(q.Request(groups=big), 1, q.Limits(frame_bytes_max=1 << 20))
    assert len(frame) > 16 * 256 * 64
    assert request_groups(parse(frame))["g15"][255] == f"{255:064d}"


def test_a_request_needs_item_ids_or_groups():
    with pytest.raises(ValueError, match="item_ids is empty and groups names none"):
        q.encode_request(q.Request(), 1)
    with pytest.raises(ValueError, match="at least one candidate"):
        q.encode_request(q.Request(user_id=3, groups={}), 1)
    # The candidate limit holds for item_ids beside groups, too.
    with pytest.raises(ValueError, match="257 candidates"):
        q.encode_request(q.Request(item_ids=list(range(257)), groups={"card": 1}), 1)


def test_response_frames_split_byte_by_byte():
    stream = b"".join(
        encode_response(
            i,
            scores=[0.25 * i, 0.5],
            tier=1,
            model_version=3,
            server_us=12,
            features_missing=1,
            reason=1,
            features_stale=True,
        )
        for i in range(3)
    )
    reader, got = q.FrameReader(), []
    for b in stream:
        got += [q.decode_response(p) for p in reader.feed(bytes([b]))]
    assert reader.pending_bytes == 0
    assert [r.request_id for r in got] == [0, 1, 2]
    r = got[2]
    assert (
        r.status,
        r.scores,
        r.tier,
        r.model_version,
        r.server_us,
        r.features_missing,
        r.error,
        r.reason,
        r.features_stale,
    ) == (q.Status.OK, [0.5, 0.5], q.Tier.CACHED, 3, 12, 1, "", q.Reason.BUDGET, True)


def test_scores_keep_their_float32_bits():
    values = [f32(x) for x in (0.1, 1 / 3, 1e-38, -0.0, 0.999999)]
    payload = encode_response(1, scores=values)[4:]
    assert f32_bits(q.decode_response(payload).scores) == f32_bits(values)
    np = numpy_or_skip()
    arr = q.decode_response(payload, as_numpy=True).scores
    assert arr.dtype == np.float32 and arr.flags.writeable
    assert arr.view(np.uint32).tolist() == f32_bits(values)


def test_bad_prefixes_are_protocol_errors():
    with pytest.raises(q.ProtocolError, match="length prefix 0"):
        q.split_frames(b"\0\0\0\0", 100)
    with pytest.raises(q.ProtocolError, match="exceeds the limit"):
        q.split_frames(struct.pack("<I", 101) + b"x", 100)
    assert q.split_frames(b"\5\0\0", 100) == ([], 0)


def test_unknown_enum_values_read_as_the_schema_says():
    r = q.decode_response(encode_response(1, status=200, tier=99, reason=77)[4:])
    assert (r.status, r.tier, r.reason) == (q.Status.INTERNAL, q.Tier.DEFAULT, q.Reason.NONE)
    with pytest.raises(q.Internal):
        r.raise_for_status()


def test_garbage_responses_raise_protocol_error_or_decode():
    rng = random.Random(7)
    good = encode_response(5, scores=[0.5] * 8, error="x")[4:]
    for n in range(2000):
        if n % 2:
            soup = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 96)))
        else:
            soup = bytearray(good)
            for _ in range(3):
                soup[rng.randrange(len(soup))] = rng.randrange(256)
            soup = bytes(soup[: rng.randrange(1, len(soup) + 1)])
        try:
            q.decode_response(soup)
        except q.ProtocolError:
            pass


def test_one_exception_class_per_non_ok_status():
    expected = {
        q.Status.DEADLINE_EXCEEDED: q.DeadlineExceeded,
        q.Status.OVERLOADED: q.Overloaded,
        q.Status.RATE_LIMITED: q.RateLimited,
        q.Status.BAD_REQUEST: q.BadRequest,
        q.Status.MODEL_NOT_FOUND: q.ModelNotFound,
        q.Status.INTERNAL: q.Internal,
    }
    assert set(expected) == set(q.Status) - {q.Status.OK}
    for status, cls in expected.items():
        resp = q.decode_response(encode_response(41, status=status, error="why")[4:])
        err = q.error_for(resp)
        assert type(err) is cls and isinstance(err, q.QuiverError)
        assert (err.status, err.error, err.request_id, err.response) == (status, "why", 41, resp)


def test_enums_mirror_the_generated_bindings():
    from quiver_client._generated.quiver.wire import Reason, Status

    assert q.Status.DEADLINE_EXCEEDED == Status.Status.DeadlineExceeded
    assert q.Reason.NONE == Reason.Reason.None_ and q.Reason.BREAKER_OPEN == Reason.Reason.BreakerOpen
    assert [t.name for t in q.Tier] == ["PRIMARY", "CACHED", "FALLBACK", "DEFAULT"]
    assert len(q.Status) == 7 and len(q.Reason) == 5


def test_without_numpy_lists_still_work_and_as_numpy_says_what_is_missing(monkeypatch):
    import quiver_client.codec as codec

    frame = q.encode_request(q.Request(user_id=3, item_ids=[9, 8], context=[0.5]), 5)
    monkeypatch.setattr(codec, "np", None)
    assert q.encode_request(q.Request(user_id=3, item_ids=[9, 8], context=[0.5]), 5) == frame
    payload = encode_response(1, scores=[0.5])[4:]
    assert q.decode_response(payload).scores == [0.5]
    with pytest.raises(ImportError, match=r"quiver-client\[numpy\]"):
        q.decode_response(payload, as_numpy=True)
    with pytest.raises(ImportError), q.Client("127.0.0.1:1") as c:
        c.score(user_id=1, item_ids=[1], as_numpy=True)


def test_feast_key_is_the_servers_canonical_text():
    # The same rows as the server's and the Rust client's tests (Feast's own
    # keys for them are in src/features/feast/redis_layout.rs).
    assert q.feast_key({"user_id": 23758, "merchant_id": "m-1"}) == "m-1|23758"
    assert q.feast_key({"user_id": -5, "merchant_id": "m-é|x\\"}) == "m-é\\|x\\\\|-5"
    assert q.feast_key({"shop": 7, "user_id": 23758, "b": ""}) == "|7|23758"
    with pytest.raises(ValueError, match="composite key has two or more"):
        q.feast_key({"user_id": 1})
    with pytest.raises(TypeError, match="join key 'a'"):
        q.feast_key({"a": 1.5, "b": 1})
    with pytest.raises(TypeError, match="join key 'a'"):
        q.feast_key({"a": True, "b": 1})
    with pytest.raises(ValueError, match="65 bytes"):
        q.feast_key({"a": "x" * 63, "b": 1})
