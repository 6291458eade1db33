"""The blocking client: one TCP connection per node, pipelined calls, failover.

``Client("host:7411")`` keeps one connection open and reuses it.
``Client(["a:7411", "b:7411"])`` picks the node for each call round-robin
and, when a node cannot be reached or drops the connection, sends what is
still unanswered to the next node (scoring reads and changes nothing, so a
retry is safe). Every call has one timeout for connecting and for its
answers; a call that times out closes its connection (late answers would
otherwise arrive on the next call) and raises ``TimeoutError`` without
trying another node, since its time is spent.

``tls=ssl.create_default_context(cafile=...)`` speaks TLS to servers with
``[tls]``: the handshake completes at connect, within the timeout, so a
certificate problem raises ``ssl.SSLError`` there.

``score_many`` writes every frame and reads every answer on one connection,
reading while it writes so neither side's socket buffer can fill up and
stall the other, and matches answers to requests by ``request_id``: the
server may answer out of order.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .codec import DEFAULT_LIMITS, FrameReader, Limits, Request, Response, as_request, decode_response, encode_request
from .codec import require_numpy, response_request_id
from .errors import AllNodesFailed, ConnectionClosed, ProtocolError, error_for

Address = Union[str, Tuple[str, int]]
_CHUNK_BYTES = 256 * 1024


def parse_address(addr: Address) -> Tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` as ``(host, port)``."""
    if isinstance(addr, tuple):
        return addr[0], int(addr[1])
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


class _Connection:
    """One socket and the bytes read from it that no frame has used yet."""

    def __init__(self, addr: Tuple[str, int], timeout: float, limits: Limits, tls: Optional[ssl.SSLContext]):
        sock = socket.create_connection(addr, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=addr[0])
            except BaseException:
                sock.close()
                raise
        self.sock = sock
        self.sock.setblocking(False)
        self.reader = FrameReader(limits.response_frame_bytes_max)

    def close(self) -> None:
        self.sock.close()

    def exchange(self, frames: Dict[int, bytes], wants_numpy: bool, deadline: float, answers: Dict[int, Response]):
        """Sends ``frames`` (request id to frame) and puts each answer into ``answers``."""
        out = memoryview(b"".join(frames.values()))
        sent = 0
        waiting = set(frames)
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(waiting)} of {len(frames)} answers missing at the call's timeout")
                for _, events in sel.select(left):
                    if events & selectors.EVENT_WRITE:
                        try:
                            sent += self.sock.send(out[sent : sent + _CHUNK_BYTES])
                        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                            pass
                        if sent == len(out):
                            sel.modify(self.sock, selectors.EVENT_READ)
                    if events & selectors.EVENT_READ:
                        try:
                            data = self.sock.recv(_CHUNK_BYTES)
                            # TLS may hold decrypted bytes the selector cannot see.
                            while data and isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                                data += self.sock.recv(_CHUNK_BYTES)
                        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                            continue
                        if not data:
                            raise ConnectionClosed("the server closed the connection")
                        for payload in self.reader.feed(data):
                            rid = response_request_id(payload)
                            resp = decode_response(payload, wants_numpy and rid in waiting)
                            if rid not in waiting:
                                if rid == 0 and not resp.ok:
                                    # A frame-level rejection: the server closes the connection.
                                    raise error_for(resp)
                                raise ProtocolError(f"answer for request {rid}, which is not outstanding")
                            waiting.remove(rid)
                            answers[rid] = resp


class Client:
    """A blocking client of one node or a list of nodes.

    ``timeout`` (seconds) bounds each call: connecting and reading its
    answers. ``limits`` are checked before sending (defaults: the server's
    defaults). ``as_numpy=True`` returns scores as float32 numpy arrays.
    ``tls`` (an ``ssl.SSLContext``) speaks TLS to every node, checking each
    node's certificate against its host name.
    Not thread-safe: use one client per thread.
    """

    def __init__(
        self,
        nodes: Union[Address, Sequence[Address]],
        *,
        timeout: float = 2.0,
        limits: Limits = DEFAULT_LIMITS,
        as_numpy: bool = False,
        tls: Optional[ssl.SSLContext] = None,
    ):
        if isinstance(nodes, (str, tuple)):
            nodes = [nodes]
        self.nodes: List[Tuple[str, int]] = [parse_address(n) for n in nodes]
        if not self.nodes:
            raise ValueError("a client needs at least one node")
        self.timeout = timeout
        self.limits = limits
        self.as_numpy = as_numpy
        self.tls = tls
        self._conns: Dict[int, _Connection] = {}
        self._turn = 0
        self._next_id = 1

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes every open connection; the next call opens new ones."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def score(
        self,
        request: Optional[Union[Request, dict]] = None,
        /,
        *,
        check: bool = True,
        as_numpy: Optional[bool] = None,
        **fields: Any,
    ) -> Response:
        """Scores one request, given as a ``Request``, a dict or keyword fields.

        ``check`` raises the status's ``QuiverError`` for a non-Ok answer.
        """
        return self.score_many([as_request(request, **fields)], check=check, as_numpy=as_numpy)[0]

    def score_many(
        self,
        requests: Iterable[Union[Request, dict]],
        *,
        check: bool = True,
        as_numpy: Optional[bool] = None,
    ) -> List[Response]:
        """Pipelines ``requests`` on one connection; answers in request order.

        Requests without a ``request_id`` get free ones; given ids must be
        distinct. With ``check``, the first non-Ok answer (in request order)
        is raised once every answer is in.
        """
        requests = [as_request(r) for r in requests]
        if not requests:
            return []
        wants_numpy = self.as_numpy if as_numpy is None else as_numpy
        if wants_numpy:
            require_numpy()
        ids = self._assign_ids(requests)
        frames = {rid: encode_request(r, rid, self.limits) for rid, r in zip(ids, requests)}
        answers = self._call(frames, wants_numpy)
        out = [answers[rid] for rid in ids]
        if check:
            for resp in out:
                resp.raise_for_status()
        return out

    def _assign_ids(self, requests: List[Request]) -> List[int]:
        given = [r.request_id for r in requests if r.request_id is not None]
        used = set(given)
        if len(used) != len(given):
            raise ValueError("request ids in one call must be distinct")
        ids = []
        for r in requests:
            if r.request_id is None:
                # Id 0 is left for the server's frame-level rejections.
                while self._next_id in used or self._next_id == 0:
                    self._next_id = (self._next_id + 1) % (1 << 64)
                used.add(self._next_id)
                ids.append(self._next_id)
                self._next_id = (self._next_id + 1) % (1 << 64)
            else:
                ids.append(r.request_id)
        return ids

    def _call(self, frames: Dict[int, bytes], wants_numpy: bool) -> Dict[int, Response]:
        deadline = time.monotonic() + self.timeout
        first = self._turn
        self._turn = (self._turn + 1) % len(self.nodes)
        answers: Dict[int, Response] = {}
        errors = []
        for k in range(len(self.nodes)):
            node = (first + k) % len(self.nodes)
            name = "%s:%d" % self.nodes[node]
            # A kept connection may have died since its last call: one more
            # try on a fresh one before moving to the next node.
            for _attempt in range(2):
                reused = node in self._conns
                try:
                    conn = self._connect(node, deadline)
                except OSError as e:  # refused, unreachable, unknown host, connect timeout
                    errors.append((name, e))
                    break
                try:
                    unanswered = {r: f for r, f in frames.items() if r not in answers}
                    conn.exchange(unanswered, wants_numpy, deadline, answers)
                    return answers
                except TimeoutError:
                    self._drop(node)
                    raise
                except OSError as e:  # reset, closed, broken pipe
                    self._drop(node)
                    if not reused:
                        errors.append((name, e))
                        break
                except BaseException:
                    self._drop(node)
                    raise
        raise AllNodesFailed(errors)

    def _connect(self, node: int, deadline: float) -> _Connection:
        conn = self._conns.get(node)
        if conn is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the call's timeout passed before connecting")
            conn = _Connection(self.nodes[node], left, self.limits, self.tls)
            self._conns[node] = conn
        return conn

    def _drop(self, node: int) -> None:
        conn = self._conns.pop(node, None)
        if conn is not None:
            conn.close()
