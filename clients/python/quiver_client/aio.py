"""The asyncio client: concurrent calls pipelined on one connection.

Each ``await client.score(...)`` writes its frame at once and waits on a
future; one reader task reads the answers and resolves each call's future by
``request_id``, so answers may come back in any order and many calls share
the connection (``asyncio.gather`` pipelines them). When the connection
fails, every waiting call gets the error and the next call reconnects.
A call that times out (``TimeoutError``) leaves the connection up; its late
answer, if one comes, is dropped.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

from .client import Address, parse_address
from .codec import DEFAULT_LIMITS, FrameReader, Limits, Request, Response, as_request, decode_response, encode_request
from .codec import require_numpy, response_request_id
from .errors import ConnectionClosed, ProtocolError, QuiverError, error_for

_CHUNK_BYTES = 256 * 1024


class _Call:
    """One call waiting for its answer."""

    __slots__ = ("future", "as_numpy", "sent")

    def __init__(self, future: asyncio.Future, as_numpy: bool):
        self.future, self.as_numpy, self.sent = future, as_numpy, False


class AsyncClient:
    """An asyncio client of one node (``"host:port"``).

    ``timeout`` (seconds) bounds each call, connecting included; ``limits``
    and ``as_numpy`` as for ``Client``; ``tls`` (an ``ssl.SSLContext``) speaks
    TLS, the handshake part of connecting. Use it from one event loop.
    """

    def __init__(
        self,
        addr: Address,
        *,
        timeout: float = 2.0,
        limits: Limits = DEFAULT_LIMITS,
        as_numpy: bool = False,
        tls: Optional[ssl.SSLContext] = None,
    ):
        self.addr = parse_address(addr)
        self.tls = tls
        self.timeout = timeout
        self.limits = limits
        self.as_numpy = as_numpy
        self._writer: Optional[asyncio.StreamWriter] = None
        self._reader_task: Optional[asyncio.Task] = None
        self._pending: Dict[int, _Call] = {}
        # Ids sent and given up on (timeout, cancel): their answers are dropped.
        self._abandoned: Set[int] = set()
        # Created inside the running loop (Python 3.9 binds a lock to a loop).
        self._connect_lock: Optional[asyncio.Lock] = None
        self._write_lock: Optional[asyncio.Lock] = None
        self._next_id = 1

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        """Opens the connection now (calls open it when needed anyway)."""
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
            self._write_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._writer is not None:
                return
            host, port = self.addr
            opened = asyncio.open_connection(host, port, ssl=self.tls, server_hostname=host if self.tls else None)
            reader, writer = await asyncio.wait_for(opened, self.timeout)
            self._writer = writer
            self._reader_task = asyncio.ensure_future(self._read_loop(reader, writer))

    async def close(self) -> None:
        """Closes the connection; calls still waiting get ``ConnectionClosed``."""
        task, writer = self._reader_task, self._writer
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if writer is not None:
            self._shut(writer, ConnectionClosed("the client was closed"))
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def score(
        self,
        request: Optional[Union[Request, dict]] = None,
        /,
        *,
        check: bool = True,
        as_numpy: Optional[bool] = None,
        **fields: Any,
    ) -> Response:
        """Scores one request (a ``Request``, a dict or keyword fields).

        ``check`` raises the status's ``QuiverError`` for a non-Ok answer.
        """
        resp = await self._complete(*self._prepare(as_request(request, **fields), as_numpy))
        return resp.raise_for_status() if check else resp

    async def score_many(
        self, requests: Iterable[Union[Request, dict]], *, check: bool = True, as_numpy: Optional[bool] = None
    ) -> List[Response]:
        """Sends every request at once; answers in request order.

        Every request is checked before the first is sent. With ``check``,
        the first non-Ok answer (in request order) is raised once all are in.
        """
        requests = [as_request(r) for r in requests]
        given = [r.request_id for r in requests if r.request_id is not None]
        if len(set(given)) != len(given):
            raise ValueError("request ids in one call must be distinct")
        prepared: List[Any] = [None] * len(requests)
        try:
            # Given ids first, so no picked id can take one of them.
            for i in sorted(range(len(requests)), key=lambda i: requests[i].request_id is None):
                prepared[i] = self._prepare(requests[i], as_numpy)
        except BaseException:
            for p in prepared:
                if p is not None:
                    del self._pending[p[0]]
            raise
        answers = list(await asyncio.gather(*(self._complete(*p) for p in prepared)))
        if check:
            for resp in answers:
                resp.raise_for_status()
        return answers

    def _prepare(self, req: Request, as_numpy: Optional[bool]) -> Tuple[int, bytes, _Call]:
        """Picks the id, encodes (``ValueError`` on a broken limit) and registers the call."""
        wants_numpy = self.as_numpy if as_numpy is None else as_numpy
        if wants_numpy:
            require_numpy()
        rid = self._assign_id(req)
        frame = encode_request(req, rid, self.limits)
        call = self._pending[rid] = _Call(asyncio.get_running_loop().create_future(), wants_numpy)
        return rid, frame, call

    async def _complete(self, rid: int, frame: bytes, call: _Call) -> Response:
        try:
            return await asyncio.wait_for(self._send(frame, call), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer to request {rid} within {self.timeout} s") from None
        finally:
            if self._pending.get(rid) is call:  # timed out, cancelled or failed
                del self._pending[rid]
                if call.sent:
                    self._abandoned.add(rid)

    def _assign_id(self, req: Request) -> int:
        if req.request_id is not None:
            if req.request_id in self._pending or req.request_id in self._abandoned:
                raise ValueError(f"request id {req.request_id} is still waiting for an answer on this connection")
            return req.request_id
        # Id 0 is left for the server's frame-level rejections.
        while self._next_id in self._pending or self._next_id in self._abandoned or self._next_id == 0:
            self._next_id = (self._next_id + 1) % (1 << 64)
        rid = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 64)
        return rid

    async def _send(self, frame: bytes, call: _Call) -> Response:
        if self._writer is None:
            await self.connect()
        async with self._write_lock:
            writer = self._writer
            if call.future.done():  # its connection failed while it waited to be sent
                return call.future.result()
            if writer is None:
                raise ConnectionClosed("the connection closed before the request was sent")
            call.sent = True
            writer.write(frame)
            await writer.drain()
        return await call.future

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(self.limits.response_frame_bytes_max)
        error: BaseException = ConnectionClosed("the server closed the connection")
        try:
            while True:
                data = await reader.read(_CHUNK_BYTES)
                if not data:
                    break
                for payload in frames.feed(data):
                    self._route(payload)
        except (OSError, ProtocolError, QuiverError) as e:
            error = e
        except asyncio.CancelledError:
            error = ConnectionClosed("the client was closed")
            raise
        finally:
            self._shut(writer, error)

    def _route(self, payload: bytes) -> None:
        rid = response_request_id(payload)
        entry = self._pending.pop(rid, None)
        if entry is None:
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                return
            resp = decode_response(payload)
            if rid == 0 and not resp.ok:
                # A frame-level rejection: the server closes the connection.
                raise error_for(resp)
            raise ProtocolError(f"answer for request {rid}, which is not outstanding")
        resp = decode_response(payload, entry.as_numpy)
        if not entry.future.done():
            entry.future.set_result(resp)

    def _shut(self, writer: asyncio.StreamWriter, error: BaseException) -> None:
        """Closes ``writer``'s connection and fails the calls waiting on it."""
        if self._writer is writer:
            self._writer = None
            self._reader_task = None
            self._abandoned.clear()
            pending, self._pending = self._pending, {}
            for call in pending.values():
                if not call.future.done():
                    call.future.set_exception(error)
        writer.close()
