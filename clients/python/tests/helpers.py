"""Test helpers: the quiver process, demo requests, a fake server.

``QuiverServer`` starts ``quiver serve`` on 127.0.0.1:0 and reads the
address from its "quiver listening on ADDR" line, as the Rust tests'
harness does; ``stop`` ends it by PID. ``FakeServer`` is a scripted
in-process peer for what a real server does only by chance (answers in
reverse order, silence, a closed connection).
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import subprocess
import threading
from pathlib import Path
from typing import Callable, List, Optional

import flatbuffers
import pytest

from quiver_client import FrameReader, Request, Response
from quiver_client._generated.quiver.wire import ScoreRequest as fb_req
from quiver_client._generated.quiver.wire import ScoreResponse as fb_resp

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
