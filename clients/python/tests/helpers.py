"""Test helpers: the quiver process, demo requests, a fake server.

``QuiverServer`` starts ``quiver serve`` on 127.0.0.1:0 and reads the
address from its "quiver listening on ADDR" line, as the Rust tests'
harness does; ``stop`` ends it by PID. ``FakeServer`` is a scripted
in-process peer for what a real server does only by chance (answers in
reverse order, silence, a closed connection). ``build_replica`` and
``build_linear_model`` make the files of a server with ``[[groups]]``.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import flatbuffers
import pytest

import quiver_client._generated.quiver as _fb_quiver
import quiver_client._generated.quiver.wire as _fb_wire
import quiver_client._generated.quiver.wire.GroupKeys as _fb_group_keys
from quiver_client import FrameReader, Request, Response
from quiver_client._generated.quiver.wire import ScoreRequest as fb_req
from quiver_client._generated.quiver.wire import ScoreResponse as fb_resp

# flatc's Python accessor for a nested table (``ScoreRequest.Groups(j)``)
# imports it by the schema's namespace, ``quiver.wire.GroupKeys``, which
# exists only where the bindings are a top-level package. The client only
# writes GroupKeys; the tests read them back, so they alias the vendored
# modules under that name.
sys.modules.setdefault("quiver", _fb_quiver)
sys.modules.setdefault("quiver.wire", _fb_wire)
sys.modules.setdefault("quiver.wire.GroupKeys", _fb_group_keys)

REPO = Path(__file__).resolve().parents[3]
QUIVER_BIN = Path(os.environ.get("QUIVER_BIN", REPO / "target" / "release" / "quiver"))

# The demo workload ("auction-32", src/loadgen/demo.rs).
USERS = 100_000
ITEMS = 10_000
CONTEXT_LEN = 16
CANDIDATES = 32
BIG_BUDGET_US = 1_000_000
#: Requests per pipelining test.
N = 1000

# The server with feature groups (conftest's ``group_server``): each group's
# rows (key to a one-float row), its default row, and its string key limit
# (None: u64 keys). The rows are far apart, so a score names the rows read.
GROUP_ROWS = {
    "card": ({42: [100.0], 43: [200.0]}, [900.0], None),
    "device": ({"f7a9c2": [10.0], "caf\u00e9-\u2615": [20.0]}, [90.0], 16),
    "ad": ({1: [1.0], 2: [2.0], 3: [3.0]}, [9.0], None),
}
GROUP_BIAS = 0.25
GROUP_CONFIG = """\
backend = "f32"

[[groups]]
name = "card"
scope = "request"

[[groups]]
name = "device"
scope = "request"
key = "string"
key_bytes_max = 16

[[groups]]
name = "ad"
scope = "candidate"
"""


def group_score(card, device, ads) -> List[float]:
    """The group server's scores: card's row + device's row + each ad's
    row + GROUP_BIAS, with each group's default row for an unknown key."""

    def row(group, key):
        rows, default, _ = GROUP_ROWS[group]
        return rows.get(key, default)[0]

    return [f32(row("card", card) + row("device", device) + row("ad", ad) + GROUP_BIAS) for ad in ads]


def numpy_or_skip():
    """numpy, or a skip where it is not installed; CI installs the client's
    ``[numpy]`` extra and sets QUIVER_REQUIRE_NUMPY=1, so there a missing
    numpy fails instead of skipping."""
    if os.environ.get("QUIVER_REQUIRE_NUMPY") == "1":
        import numpy

        return numpy
    return pytest.importorskip("numpy")


def f32(x: float) -> float:
    """``x`` rounded to float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(values) -> List[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def demo_context(seed: int) -> List[float]:
    """16 context floats as the Rust tests' ``demo_request`` builds them, in float32."""
    return [f32(f32(((seed + i) % 7) * f32(0.3)) - f32(0.9)) for i in range(CONTEXT_LEN)]


def demo_request(i: int, request_id: Optional[int] = None) -> Request:
    """Request number ``i``: its own user, 32 items and context, a budget that never binds."""
    return Request(
        user_id=(i * 7919 + 13) % USERS,
        item_ids=[(i * 131 + k * 977) % ITEMS for k in range(CANDIDATES)],
        context=demo_context(i),
        budget_us=BIG_BUDGET_US,
        request_id=request_id,
    )


def same_bits(a: Response, b: Response) -> bool:
    return f32_bits(a.scores) == f32_bits(b.scores)


def thread_batch():
    """1,000 demo requests with an unknown-model request after every 4th.

    In thread mode the bad ones are answered on the shard at once while the
    good ones wait for the inference thread: answers leave out of order.
    """
    reqs, good = [], {}
    for i in range(N):
        rid = 100_000 + 2 * i
        reqs.append(demo_request(i, request_id=rid))
        good[rid] = i
        if i % 4 == 3:
            # The demo requests' budget: with the default (10 ms) a VM pause
            # while 1,000 frames queue answered DeadlineExceeded before the
            # model lookup (seen in CI under load).
            reqs.append(
                Request(user_id=i, item_ids=[1, 2], model="no-such-model", request_id=rid + 1, budget_us=BIG_BUDGET_US)
            )
    return reqs, good


class QuiverServer:
    """A ``quiver serve`` process on a free port."""

    def __init__(self, data_dir: Path, log_path: Path, *extra: str, start_timeout_s: float = 30.0):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                str(QUIVER_BIN),
                "serve",
                "--data-dir",
                str(data_dir),
                "--listen",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--shards",
                "1",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "RUST_LOG": "info"},
        )
        self.addr = self.admin = ""
        lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        try:
            while True:
                line = lines.get(timeout=start_timeout_s)
                if line is None:
                    raise RuntimeError(f"quiver serve exited before listening:\n{self.log()}")
                if line.startswith("quiver admin on "):
                    self.admin = line.split()[-1]
                elif line.startswith("quiver listening on "):
                    self.addr = line.split()[3]
                    break
        except BaseException:
            self.stop()
            raise

    def _pump(self, lines: "queue.Queue[Optional[str]]") -> None:
        # Keeps reading stdout after start-up so the pipe never fills.
        for raw in self.proc.stdout:
            lines.put(raw.decode(errors="replace").strip())
        lines.put(None)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it has not exited within 5 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


def encode_response(
    request_id: int,
    status: int = 0,
    scores=(),
    tier: int = 0,
    model_version: int = 0,
    server_us: int = 0,
    features_missing: int = 0,
    error: str = "",
    reason: int = 0,
    features_stale: bool = False,
) -> bytes:
    """A ScoreResponse frame, as the server would write it."""
    b = flatbuffers.Builder(256)
    err = b.CreateString(error) if error else None
    sc = None
    if scores:
        fb_resp.StartScoresVector(b, len(scores))
        for s in reversed(scores):
            b.PrependFloat32(s)
        sc = b.EndVector()
    fb_resp.Start(b)
    fb_resp.AddRequestId(b, request_id)
    fb_resp.AddStatus(b, status)
    if sc is not None:
        fb_resp.AddScores(b, sc)
    fb_resp.AddTier(b, tier)
    fb_resp.AddModelVersion(b, model_version)
    fb_resp.AddServerUs(b, server_us)
    fb_resp.AddFeaturesMissing(b, features_missing)
    if err is not None:
        fb_resp.AddError(b, err)
    fb_resp.AddReason(b, reason)
    fb_resp.AddFeaturesStale(b, features_stale)
    b.Finish(fb_resp.End(b))
    payload = bytes(b.Output())
    return struct.pack("<I", len(payload)) + payload


def echo_answer(payload: bytes) -> bytes:
    """Answers a request with one score per item: request_id + item_id / 1000."""
    r = fb_req.ScoreRequest.GetRootAs(payload, 0)
    rid = r.RequestId()
    return encode_response(
        rid, scores=[f32(rid + r.ItemIds(j) / 1000) for j in range(r.ItemIdsLength())], model_version=7
    )


class FakeServer:
    """A scripted peer. ``batch`` requests are collected, then ``answer``
    turns their payloads into bytes to send (default: echo answers in
    reverse order); returning None closes the connection, and so does
    having answered ``hang_up_after`` batches on it."""

    def __init__(
        self,
        batch: int = 1,
        answer: Optional[Callable[[List[bytes]], Optional[bytes]]] = None,
        hang_up_after: Optional[int] = None,
    ):
        self.batch = batch
        self.hang_up_after = hang_up_after
        self.answer = answer or (lambda payloads: b"".join(echo_answer(p) for p in reversed(payloads)))
        self.requests = 0
        self.connections = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self._sock.getsockname()[1]
        self._conns: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._converse(conn)
            except OSError:  # the client went away, or close() closed the socket
                pass

    def _converse(self, conn: socket.socket) -> None:
        frames = FrameReader(1 << 20)
        held: List[bytes] = []
        answered = 0
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for payload in frames.feed(data):
                self.requests += 1
                held.append(payload)
                if len(held) < self.batch:
                    continue
                out = self.answer(held)
                held = []
                if out is None:
                    return
                conn.sendall(out)
                answered += 1
                if answered == self.hang_up_after:
                    conn.shutdown(socket.SHUT_WR)  # FIN after the answers, before any reset
                    return

    def close(self) -> None:
        self._sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


def dead_address() -> str:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


def request_groups(r) -> Dict[str, Union[List[int], List[str]]]:
    """A decoded ScoreRequest's ``groups``: name to its ids or its string keys.

    Asserts that each entry carries exactly one of the two vectors.
    """
    out: Dict[str, Union[List[int], List[str]]] = {}
    for j in range(r.GroupsLength()):
        g = r.Groups(j)
        assert g.IdsIsNone() != g.KeysIsNone(), "a group carries ids or keys, not both or neither"
        if g.KeysIsNone():
            out[g.Group().decode()] = [g.Ids(i) for i in range(g.IdsLength())]
        else:
            out[g.Group().decode()] = [g.Keys(i).decode() for i in range(g.KeysLength())]
    return out


def build_replica(
    quiver_bin: Path,
    out: Path,
    group: str,
    rows: Dict[Union[int, str], Sequence[float]],
    default: Sequence[float],
    key_bytes: Optional[int] = None,
) -> None:
    """A replica file for ``group`` with ``rows`` and the ``default`` row,
    built by ``quiver replica build`` from the text format of
    docs/REPLICA.md; ``quiver replica inspect --group`` then checks the file
    as the server will open it.
    """
    text = out.with_suffix(".txt")
    lines = ["default," + ",".join(repr(float(v)) for v in default)]
    lines += [f"{k}," + ",".join(repr(float(v)) for v in row) for k, row in rows.items()]
    text.write_text("\n".join(lines) + "\n")
    args = [str(quiver_bin), "replica", "build", "--group", group, "--input", str(text), "--out", str(out)]
    if key_bytes is not None:
        args += ["--key-bytes", str(key_bytes)]
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    inspect = subprocess.run(
        [str(quiver_bin), "replica", "inspect", "--group", group, "--file", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert inspect.returncode == 0 and f"rows {len(rows)}" in inspect.stdout, inspect.stdout + inspect.stderr


def build_linear_model(quiver_bin: Path, out: Path, inputs: str, weights: Sequence[float], bias: float) -> None:
    """A model file scoring ``bias + weights · x`` (raw, no sigmoid), ``x``
    being the input row ``inputs`` (``quiver import --inputs``) lays out.

    Built as a one-layer ONNX graph with the ``onnx`` package (CI installs
    it for the model zoo's fixtures) and imported with ``quiver import``.
    """
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    n = len(weights)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["score"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch", 1])],
        [
            helper.make_tensor("w", TensorProto.FLOAT, [n, 1], [float(v) for v in weights]),
            helper.make_tensor("b", TensorProto.FLOAT, [1], [float(bias)]),
        ],
    )
    model = helper.make_model(graph, producer_name="quiver-python-tests", opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = out.with_suffix(".onnx")
    onnx.save(model, str(src))
    done = subprocess.run(
        [str(quiver_bin), "import", "--onnx", str(src), "--out", str(out), "--name", "fraud", "--version", "1",
         "--inputs", inputs, "--output-kind", "raw"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# A request the group server scores: card 42, device "f7a9c2", ads 1, 2, 3.
GROUP_REQUEST = {"card": 42, "device": "f7a9c2", "ad": [1, 2, 3]}

# Requests the group server answers BadRequest, and the start of its error
# text: each check of the request path's keys_by_group and assemble.
GROUP_ERRORS = [
    pytest.param(dict(groups={**GROUP_REQUEST, "shop": 1}), "unknown feature group 'shop'", id="unknown-group"),
    pytest.param(
        dict(groups={**GROUP_REQUEST, "card": "42"}),
        "group 'card' is keyed by u64 ids, the request sends string keys",
        id="strings-for-u64",
    ),
    pytest.param(
        dict(groups={**GROUP_REQUEST, "device": 7}),
        "group 'device' is keyed by strings, the request sends u64 ids",
        id="ids-for-strings",
    ),
    pytest.param(
        dict(groups={**GROUP_REQUEST, "device": "k" * 17}),
        "group 'device': a key of 17 bytes; keys are 1 to 16 bytes",
        id="key-too-long",
    ),
    pytest.param(
        dict(groups={**GROUP_REQUEST, "card": [42, 43]}),
        "group 'card' takes one key per request, the request sends 2",
        id="two-keys-per-request",
    ),
    pytest.param(
        dict(item_ids=[5, 6, 7, 8], groups=GROUP_REQUEST),
        "group 'ad' takes one key per candidate: 3 keys for 4 candidates",
        id="keys-per-candidate",
    ),
    pytest.param(
        dict(groups={"card": 42, "ad": [1, 2]}),
        "the model reads feature group 'device', and the request carries no key for it",
        id="group-missing",
    ),
    pytest.param(
        dict(user_id=42, item_ids=[1, 2]),
        "the model reads feature group 'card', and the request carries no key for it",
        id="old-request",
    ),
]


def raw_request_frame(request_id: int, groups) -> bytes:
    """A ScoreRequest frame with ``groups`` as (name, ids or None, keys or
    None) entries, written as given: what the client refuses to send (a
    group named twice) for the server to answer."""
    b = flatbuffers.Builder(256)
    tables = []
    for name, ids, keys in groups:
        name_at = b.CreateString(name)
        ids_at = keys_at = None
        if ids is not None:
            _fb_group_keys.StartIdsVector(b, len(ids))
            for v in reversed(ids):
                b.PrependUint64(v)
            ids_at = b.EndVector()
        if keys is not None:
            strings = [b.CreateString(k) for k in keys]
            _fb_group_keys.StartKeysVector(b, len(strings))
            for s in reversed(strings):
                b.PrependUOffsetTRelative(s)
            keys_at = b.EndVector()
        _fb_group_keys.Start(b)
        _fb_group_keys.AddGroup(b, name_at)
        if ids_at is not None:
            _fb_group_keys.AddIds(b, ids_at)
        if keys_at is not None:
            _fb_group_keys.AddKeys(b, keys_at)
        tables.append(_fb_group_keys.End(b))
    fb_req.StartGroupsVector(b, len(tables))
    for t in reversed(tables):
        b.PrependUOffsetTRelative(t)
    groups_at = b.EndVector()
    fb_req.Start(b)
    fb_req.AddRequestId(b, request_id)
    fb_req.AddBudgetUs(b, BIG_BUDGET_US)
    fb_req.AddGroups(b, groups_at)
    b.Finish(fb_req.End(b))
    payload = bytes(b.Output())
    return struct.pack("<I", len(payload)) + payload


def exchange_raw(addr: str, frame: bytes, timeout: float = 5.0) -> Response:
    """Sends one frame on a fresh connection and decodes the one answer."""
    from quiver_client import decode_response, parse_address

    reader = FrameReader(1 << 20)
    with socket.create_connection(parse_address(addr), timeout=timeout) as s:
        s.sendall(frame)
        while True:
            data = s.recv(65536)
            assert data, "the server closed the connection without answering"
            payloads = reader.feed(data)
            if payloads:
                assert len(payloads) == 1
                return decode_response(payloads[0])
