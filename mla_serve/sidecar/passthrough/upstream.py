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

A connection's life is explicit (`State`, moved only by `_to`, which refuses a move the
table does not allow): IDLE (no request: new, or in the pool) → AWAITING (a request written,
its response's head not yet in; 1xx heads pass) → BODY (the head handed on, the body being
read) → DONE (the response ended as HTTP says it must) → IDLE again once the read that ended
it is parsed to its last byte, or CLOSED (dropped, never used again) from any state. A
connection goes back to the pool only from DONE, after the whole read: bytes after the
response's end (the head or part of another response, garbage) close it instead
(RFC 9112 section 6.3: nothing may follow a response that was not asked for).

What vLLM may send, and what is refused (`lost`, not retryable: 502 before the head, the
stream's error event after it) with the connection dropped:
- a response head of at most MAX_HEAD_BYTES, and after the head at most as much without a
  byte of body (chunk framing, trailers, which are dropped);
- no transfer coding but `chunked` alone: a body in another coding cannot be passed on as
  plain bytes once the hop-by-hop Transfer-Encoding is dropped (RFC 9112 section 6.1);
- no 101: the pass-through never asks to switch protocols (the client's Upgrade is a
  hop-by-hop header, not forwarded), so a 101 is a response nobody asked for.
The response to a HEAD request ends with its head, whatever length it announces
(RFC 9112 section 6.3, rule 1), and so do 204 and 304 responses.

Connections are kept for reuse after a complete response that allows it, for at most
`keepalive` seconds idle (uvicorn, vLLM's server, closes idle ones after 5 s). A request
written on a reused connection that the server closes before any byte of a response came
back is reported as `retryable`: the server closed it idle, the request was never read.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections.abc import Callable
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
    """The consumer of one response; called from the connection's callbacks. `head` answers
    where the body's pieces go (called with each, as the parser frees it)."""

    def head(self, status: int, headers: Headers) -> Callable[[bytes], object]: ...
    def fed(self) -> None: ...  # after the body pieces of one read: a place to batch writes
    def end(self) -> None: ...
    def may_arm(self, conn: Connection) -> None: ...  # the parser is between two chunks
    def took(self, taken: Taken) -> None: ...  # what the lane took since it was armed
    def lost(self, why: str, retryable: bool) -> None: ...


class State(enum.Enum):
    __hash__ = object.__hash__  # identity, as phases.Phase: the table lookups stay in C

    IDLE = "no request"
    AWAITING = "a request written, its response's head awaited"
    BODY = "the response's body being read"
    DONE = "the response ended"
    CLOSED = "dropped"


# The moves a connection may make; anything else is a bug (`_to` raises).
MOVES: dict[State, frozenset[State]] = {
    State.IDLE: frozenset({State.AWAITING, State.CLOSED}),
    State.AWAITING: frozenset({State.BODY, State.DONE, State.CLOSED}),
    State.BODY: frozenset({State.DONE, State.CLOSED}),
    State.DONE: frozenset({State.IDLE, State.CLOSED}),
    State.CLOSED: frozenset({State.CLOSED}),
}


# The states the per-read code tests, as plain names (no enum attribute lookup per read).
IDLE, AWAITING, BODY, DONE, CLOSED = (
    State.IDLE,
    State.AWAITING,
    State.BODY,
    State.DONE,
    State.CLOSED,
)


class Refusal(Exception):
    """Raised in a parser callback: the response is refused (the message says why); the
    parser stops there (httptools wraps it in HttpParserCallbackError)."""


class Connection(asyncio.Protocol):
    """One connection to vLLM; one request at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.state = IDLE
        self.sink: Sink | None = None
        self.piece: Callable[[bytes], object] | None = None  # the body's consumer, in BODY
        self.headers: Headers = []
        self.head_only = False  # the request was HEAD: its response ends with its head
        self.until_close = False  # a body without length: it ends when the connection does
        self.extra = False  # bytes after the response's end in the read that ended it
        self.fresh_parser = False  # the parser expects more of a response that ended
        self.refusal: str | None = None  # why the response is refused (a callback's finding)
        self.got_bytes = False  # any byte of a response to the current request
        self.head_bytes = 0  # the current response's head in bytes (read, then parsed)
        self.reason = 0  # bytes of its status line's reason phrase
        self.framing = 0  # bytes read since the last body byte, once the head is done
        self.reused = False
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

    @property
    def closed(self) -> bool:
        return self.state is CLOSED

    def _to(self, state: State) -> None:
        if state not in MOVES[self.state]:
            raise RuntimeError(f"vLLM connection: no move from {self.state.name} to {state.name}")
        self.state = state

    # -- used by the consumer ------------------------------------------------------------
    def request(self, payload: bytes, sink: Sink, head_only: bool = False) -> None:
        """Write one request; its response goes to `sink`. `head_only`: a HEAD request."""
        assert self.transport is not None and self.sink is None
        self._to(AWAITING)
        self.disarm()
        if self.fresh_parser:
            self.parser = httptools.HttpResponseParser(self)
            self.fresh_parser = False
        self.sink = sink
        self.head_only = head_only
        self.until_close = self.keep = False
        self.headers = []
        self.got_bytes = self.extra = False
        self.refusal = None
        self.head_bytes = self.reason = self.framing = 0
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
        self.sink = self.piece = None
        self._to(CLOSED)
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # bytes nobody asked for (idle, or after the end): unusable now
            self.abort()
            return
        self.drain()
        self.got_bytes = True
        self.last_read = self.clock()
        in_body = self.state is BODY
        if not in_body:
            self.head_bytes += len(data)
        self.sizes.clear()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(sink, "vLLM switched protocols (101), which the pass-through never asks")
            return
        except httptools.HttpParserError as error:
            why = self.refusal or f"malformed HTTP from vLLM: {error}"
            self._refuse(sink, why)
            return
        if self.state is DONE:  # the response ended in this read
            self._settle()
            return
        if self.head_bytes > MAX_HEAD_BYTES and self.state is AWAITING:
            self._refuse(sink, f"vLLM's response head is over {MAX_HEAD_BYTES >> 10} KiB")
            return
        if in_body:  # after the head, bytes without a body byte (chunk framing, trailers)
            self.framing = 0 if self.sizes else self.framing + len(data)
            if self.framing > MAX_HEAD_BYTES:
                self._refuse(sink, f"vLLM sent over {MAX_HEAD_BYTES >> 10} KiB without a byte "
                                   "of body (chunk framing or trailers)")  # fmt: skip
                return
        if self.sink is not sink:  # the consumer dropped the connection in its callbacks
            return
        sink.fed()
        # Whole chunks whose payloads were the read's body pieces, size for size: the parser
        # was between two chunks before the read and is again (in any other state it would
        # have cut the bytes elsewhere).
        if (
            self.lane is not None
            and in_body
            and self.sizes
            and self.sink is sink
            and lane.frames(data) == self.sizes
        ):
            sink.may_arm(self)

    def _settle(self) -> None:
        """The read that ended the response is parsed whole: the connection goes back to the
        pool, or is dropped (bytes followed the response, or it may not be kept)."""
        sink = self.sink
        self.sink = None
        if sink is not None:
            sink.fed()
        if self.extra or not self.keep or self.closed:
            if not self.closed:
                self.abort()
            return
        self._to(IDLE)
        if self.paused:
            self.resume()
        self.pool.put(self)

    def _refuse(self, sink: Sink, why: str) -> None:
        self.sink = None
        if not self.closed:
            self.abort()
        sink.fed()
        sink.lost(why, False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.drain()
        self.disarm()
        sink, self.sink, self.piece = self.sink, None, None
        state = self.state
        self._to(CLOSED)
        if sink is None or state is DONE:
            return
        if self.until_close and state is BODY:
            sink.end()  # a body delimited by the connection's end is complete now
            return
        why = "the connection closed" if exc is None else f"{type(exc).__name__}: {exc}"
        sink.lost(why, self.reused and not self.got_bytes)

    # -- httptools callbacks (inside feed_data) --------------------------------------------
    def on_message_begin(self) -> None:
        if self.state is DONE:  # another response after the end of this one
            self.extra = True

    def on_status(self, reason: bytes) -> None:
        self.reason += len(reason)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state is AWAITING:  # after the body: trailers, dropped
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.state is not AWAITING:
            self.extra = True
            return
        status = self.parser.get_status_code()
        if status < 200:  # 1xx (101 aside: httptools raises for it): another head follows
            self.headers = []
            self.reason = 0
            return
        self.head_bytes = http1.response_head_size(self.reason, self.headers)
        if self.head_bytes > MAX_HEAD_BYTES:
            self._callback_refuses(f"vLLM's response head is over {MAX_HEAD_BYTES >> 10} KiB")
        chunked = length = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = True
            elif lowered == b"transfer-encoding":
                codings = [coding.strip().lower() for coding in value.split(b",")]
                if codings != [b"chunked"] or chunked:
                    named = value.decode("latin-1")
                    self._callback_refuses(
                        f"vLLM's response has Transfer-Encoding {named!r}, which the "
                        "pass-through does not decode: only chunked"
                    )
                chunked = True
        sink = self.sink
        assert sink is not None
        if self.head_only or status in (204, 304):
            self._to(DONE)
            self.keep = self.parser.should_keep_alive()
            self.fresh_parser = True  # the parser may wait for the body the head announced
            sink.head(status, self.headers)
            if self.sink is sink:
                sink.end()
            return
        self._to(BODY)
        self.until_close = not (chunked or length)
        piece = sink.head(status, self.headers)
        if self.sink is sink:
            self.piece = piece

    def _callback_refuses(self, why: str) -> None:
        self.refusal = why
        raise Refusal(why)

    def on_body(self, body: bytes) -> None:
        piece = self.piece
        if piece is None:  # past the end (a body nobody asked for), or dropped
            self.extra = True
            return
        self.sizes.append(len(body))
        piece(body)

    def on_message_complete(self) -> None:
        state = self.state
        if state is AWAITING:  # a 1xx head
            return
        if state is DONE:
            # a head-only response's parser, when the head announced no body
            self.fresh_parser = False
            return
        if state is not BODY:
            return
        self._to(DONE)
        self.piece = None
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
            if conn.state is IDLE and now - since < self.keepalive:
                conn.reused = True
                return conn
            if not conn.closed:
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
        if conn.state is not IDLE or conn.sink is not None:
            if not conn.closed:
                conn.abort()
            return
        self.idle.append((conn, self.loop.time()))

    def close(self) -> None:
        for conn, _ in self.idle:
            if not conn.closed:
                conn.abort()
        self.idle.clear()
