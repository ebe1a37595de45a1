"""The pass-through's one client to vLLM: keep-alive HTTP/1.1 on a bare asyncio Protocol.

Every request the pass-through forwards goes through here (httptools' response parser; TLS
when vLLM's URL is https://; the URL's path, if any, in front of every request's). Each
response is handed to its `Sink` (the exchange, exchange.py) from the connection's own
callbacks: the status and headers once, then every piece of the body as the parser frees it
from the transfer coding, then the end, or why it broke off. No stream reader, no task
switch per read: the exchange does its work inside `data_received`. Where the C lane is
built (lane.py), `data_received` is a `Lane`: armed by the exchange for a stream's token
chunks, it takes whole reads of them in C; every other read comes to the Python method here,
which first hands the exchange what the lane took (`Sink.took`).

Bounds on what vLLM sends: a response head of at most MAX_HEAD_BYTES, and after the head at
most as much without a byte of body (chunk framing, trailers, which are dropped); past either
the response is refused (`lost`, not retryable) and the connection dropped.

Connections are kept for reuse after a complete response that allows it, for at most
`keepalive` seconds idle (uvicorn, vLLM's server, closes idle ones after 5 s). A request
written on a reused connection that the server closes before any byte of a response came
back is reported as `retryable`: the server closed it idle, the request was never read.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from mla_serve.sidecar.passthrough import http1, lane

Headers = list[tuple[bytes, bytes]]
Taken = tuple[int, bool, list[str]]  # what the lane took: token chunks, visible, texts

# What vLLM may send before its response's body: status line and headers, in bytes (Envoy's
# default header limit is 60 KiB; aiohttp's 8 KiB a line), counted on the parsed fields once
# the head is complete (http1.response_head_size: the same whatever the reads), on the bytes
# read while it is not. Beyond it the response is refused (502) and the connection dropped:
# httptools would otherwise buffer an endless header line.
MAX_HEAD_BYTES = 64 << 10


class Sink(Protocol):
    """The consumer of one response; called from the connection's callbacks."""

    def head(self, status: int, headers: Headers) -> None: ...
    def body(self, data: bytes) -> None: ...
    def fed(self) -> None: ...  # after the body pieces of one read: a place to batch writes
    def end(self) -> None: ...
    def may_arm(self, conn: Connection) -> None: ...  # the parser is between two chunks
    def took(self, taken: Taken) -> None: ...  # what the lane took since it was armed
    def lost(self, why: str, retryable: bool) -> None: ...


class Connection(asyncio.Protocol):
    """One connection to vLLM; one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.headers: Headers = []
        self.informational = False
        self.until_close = False  # a body without length: it ends when the connection does
        self.in_body = False
        self.got_bytes = False  # any byte of a response to the current request
        self.head_bytes = 0  # the current response's head in bytes (read, then parsed)
        self.reason = 0  # bytes of its status line's reason phrase
        self.head_done = False
        self.framing = 0  # bytes read since the last body byte, once the head is done
        self.reused = False
        self.closed = False
        self.paused = False  # reading paused by the consumer (back-pressure)
        self.keep = False
        self.clock = pool.loop.time
        self.last_read = 0.0
        self.sizes: list[int] = []  # the sizes of the body pieces the parser gave this read
        self.lane: lane.Lane | None = None
        if pool.lane:
            # asyncio and uvloop call the protocol's data_received: the lane's, set before
            # the transport exists (uvloop looks it up once, at connection_made).
            self.lane = lane.Lane(self.data_received)  # the method: the lane's fallback
            self.data_received = self.lane  # type: ignore[method-assign]

    # -- used by the consumer ------------------------------------------------------------
    def request(self, payload: bytes, sink: Sink) -> None:
        assert self.transport is not None and self.sink is None
        self.disarm()
        self.sink = sink
        self.headers = []
        self.got_bytes = False
        self.in_body = False
        self.head_bytes = self.reason = self.framing = 0
        self.head_done = False
        self.last_read = self.clock()
        self.transport.write(payload)

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.disarm()
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.last_read = self.clock()
            if not self.closed:
                self.transport.resume_reading()

    def idle_since(self) -> float:
        """The time of the last read of the response, by Python or by the lane."""
        last = self.last_read
        if self.lane is not None:
            return max(last, self.lane.last_read)
        return last

    def disarm(self) -> None:
        """Every read to the Python path (a new consumer, the end of one, back-pressure)."""
        if self.lane is not None:
            self.lane.disarm()

    def drain(self) -> None:
        """Hand the consumer what the lane took since it was armed (nothing when it took
        nothing): before a read the Python path handles, and when the response ends."""
        if self.lane is not None:
            taken = self.lane.drain()
            if taken is not None and self.sink is not None:
                self.sink.took(taken)

    def abort(self) -> None:
        """Drop the connection (vLLM aborts a request whose client went away)."""
        self.drain()
        self.disarm()
        self.sink = None
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def release(self) -> None:
        """After the sink saw `end()`: back to the pool when the response allows it."""
        self.disarm()
        self.sink = None
        if self.paused:
            self.resume()
        self.pool.put(self)

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self.sink is None:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        self.drain()
        self.got_bytes = True
        self.last_read = self.clock()
        sink = self.sink
        head_done = self.head_done
        if not head_done:
            self.head_bytes += len(data)
        self.sizes.clear()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._refuse(sink, f"malformed HTTP from vLLM: {error}")
            return
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse(sink, f"vLLM's response head is over {MAX_HEAD_BYTES >> 10} KiB")
            return
        if head_done:  # after the head, bytes without a body byte (chunk framing, trailers)
            self.framing = 0 if self.sizes else self.framing + len(data)
            if self.framing > MAX_HEAD_BYTES:
                self._refuse(sink, f"vLLM sent over {MAX_HEAD_BYTES >> 10} KiB without a byte "
                                   "of body (chunk framing or trailers)")  # fmt: skip
                return
        sink.fed()
        # Whole chunks whose payloads were the read's body pieces, size for size: the parser
        # was between two chunks before the read and is again (in any other state it would
        # have cut the bytes elsewhere).
        if (
            self.lane is not None
            and head_done
            and self.sizes
            and self.sink is sink
            and lane.frames(data) == self.sizes
        ):
            sink.may_arm(self)

    def _refuse(self, sink: Sink, why: str) -> None:
        self.sink = None
        self.abort()
        sink.fed()
        sink.lost(why, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.drain()
        self.disarm()
        self.closed = True
        sink, self.sink = self.sink, None
        if sink is None:
            return
        if self.until_close and self.in_body:
            sink.end()  # a body delimited by the connection's end is complete now
            return
        why = "the connection closed" if exc is None else f"{type(exc).__name__}: {exc}"
        sink.lost(why, self.reused and not self.got_bytes)

    # -- httptools callbacks ---------------------------------------------------------------
    def on_status(self, reason: bytes) -> None:
        self.reason += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # after the body: trailers, dropped (never a response header)
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: another head follows
            self.informational = True
            self.headers = []
            self.reason = 0
            return
        self.head_bytes = http1.response_head_size(self.reason, self.headers)
        if self.head_bytes > MAX_HEAD_BYTES:  # refused by data_received, after this read
            self.sink = None
            return
        self.in_body = self.head_done = True
        chunked = length = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = True
            elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        self.until_close = not (chunked or length) and status not in (204, 304)
        if self.sink is not None:
            self.sink.head(status, self.headers)

    def on_body(self, body: bytes) -> None:
        self.sizes.append(len(body))
        if self.sink is not None:
            self.sink.body(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.in_body = False
        self.keep = self.parser.should_keep_alive() and not self.until_close
        sink = self.sink
        if sink is not None:
            sink.end()


class Pool:
    """Idle keep-alive connections to one vLLM, newest first."""

    def __init__(
        self, url: str, connect_timeout: float, keepalive: float = 4.0, lane_on: bool = False
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None or parts.query:
            raise ValueError(f"not an http(s):// URL of vLLM: {url}")
        self.host = parts.hostname
        self.tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.tls = ssl.create_default_context()
        self.port = parts.port or (443 if self.tls else 80)
        self.authority = parts.netloc.rpartition("@")[2].encode("latin-1")
        self.prefix = parts.path.rstrip("/").encode("latin-1")  # before every request's path
        self.connect_timeout = connect_timeout
        self.keepalive = keepalive
        self.lane = lane_on and lane.BUILT  # token chunks in C
        self.idle: list[tuple[Connection, float]] = []
        self.loop = asyncio.get_running_loop()

    def take(self) -> Connection | None:
        """An idle connection still fit for reuse, or None."""
        now = self.loop.time()
        while self.idle:
            conn, since = self.idle.pop()
            if not conn.closed and now - since < self.keepalive:
                conn.reused = True
                return conn
            conn.abort()
        return None

    async def connect(self) -> Connection:
        """A new connection (OSError, ssl.SSLError or TimeoutError on failure)."""
        async with asyncio.timeout(self.connect_timeout):
            _, conn = await self.loop.create_connection(
                lambda: Connection(self), self.host, self.port, ssl=self.tls,
                server_hostname=self.host if self.tls else None,
            )  # fmt: skip
        return conn

    def put(self, conn: Connection) -> None:
        if conn.closed or not conn.keep or conn.sink is not None:
            conn.abort()
            return
        self.idle.append((conn, self.loop.time()))

    def close(self) -> None:
        for conn, _ in self.idle:
            conn.abort()
        self.idle.clear()
