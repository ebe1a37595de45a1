"""Where an exchange meets its client: two thin fronts over the one exchange.

`TransportFront`: on the sidecar's own HTTP protocol (uvicorn's httptools protocol with the
sidecar's limits, sidecar/uvicorn_adapter.py), every pass-through request is handed to an
exchange from the parser's callbacks, without ASGI, and the exchange's answer is written
straight onto the client's transport, in HTTP/1.1 chunked coding as uvicorn would frame it
(HTTP/1.0: as it comes, the connection closed at its end). No scope, task, future or message
per request. A request pipelined behind another waits (`ready` False: its writes are held,
its exchange QUEUED) until the response before it has gone out (`activate`); one with
`Expect: 100-continue` gets its `100 Continue` when its body is wanted. What it needs of its
connection is `FrontClient`, which the adapter's protocol provides.

`AsgiFront`: under h11 (`--http h11`, or a uvicorn release the adapter is not written for),
which has no such callbacks, every request comes through ASGI (`serve`) to the same
exchange; this request's task sends what the exchange's callbacks queue (h11 frames it,
HTTP/1.0 by the connection's end), reads the body, and notices a client that leaves.
Back-pressure both ways: a queue over the high-water mark pauses vLLM, and each send waits
for the client's transport.

Both answer the same way: the exchange decides everything; a front only frames and writes.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from mla_serve.sidecar.passthrough import errors
from mla_serve.sidecar.passthrough.exchange import Exchange, Headers, admit
from mla_serve.sidecar.passthrough.phases import Phase
from mla_serve.sidecar.passthrough.service import PassThrough

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

STATUS_LINE = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
    for status in http.HTTPStatus
}
LAST_CHUNK = b"0\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HIGH_WATER = Exchange.HIGH_WATER


def _status_line(status: int) -> bytes:
    line = STATUS_LINE.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


def length_of(headers: Headers) -> int | None:
    """The request's Content-Length when it is a plain number (others are refused by the
    parser), else None."""
    for name, value in headers:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def has_body(headers: Headers) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


class FrontClient(Protocol):
    """What a transport front needs of the connection it serves (uvicorn_adapter.py): its
    transport and flow control (`flow.write_paused`: the transport is over its high-water
    mark), the server's default headers, and to be told when its response went out."""

    transport: Any
    flow: Any

    def default_headers(self) -> Headers: ...  # the server's Date (and Server) now
    def front_done(self, front: TransportFront) -> None: ...  # its response went out whole


class TransportFront:
    """One request on the sidecar's own protocol; see the module's docstring."""

    __slots__ = (
        "chunked",
        "client",
        "disconnected",
        "exchange",
        "expect",
        "flow",
        "head_out",
        "http10",
        "keep_alive",
        "over",
        "pending",
        "pending_size",
        "ready",
        "response_complete",
        "transport",
    )

    def __init__(
        self,
        client: FrontClient,
        keep_alive: bool,
        http10: bool,
        ready: bool = True,
        expect: bool = False,
    ) -> None:
        self.client = client
        self.transport = client.transport
        self.flow = client.flow
        self.http10 = http10
        self.ready = ready  # False: behind an earlier response on the connection
        self.expect = expect and not http10  # Expect: 100-continue (HTTP/1.0: ignored)
        self.exchange: Exchange | None = None
        # what uvicorn's protocol reads of a request's cycle
        self.keep_alive = keep_alive and not http10
        self.response_complete = False
        self.disconnected = False
        # the response
        self.chunked = False
        self.head_out: bytes | None = None  # the head, written with the first bytes
        self.pending: list[bytes] = []  # what waits for a client that reads slower
        self.pending_size = 0
        self.over = False  # answered while not ready: complete once activated

    @property
    def direct(self) -> bool:
        """Chunks written now go straight onto the transport, as vLLM framed them."""
        return (
            self.chunked
            and self.head_out is None
            and not self.pending
            and not self.flow.write_paused
            and not self.disconnected
        )

    def transport_write(self) -> Any:
        return self.transport.write

    def wants_body(self) -> None:
        """The exchange reads the body: the client that expects a `100 Continue` gets it."""
        if self.expect and self.ready and not self.disconnected:
            self.expect = False
            self.transport.write(CONTINUE)

    def activate(self) -> None:
        """The response before this one went out: this one's turn on the connection."""
        self.ready = True
        if self.disconnected:
            return
        if self.over:  # answered while it waited
            self._last(b"")
            self._done()
            return
        exchange = self.exchange
        if exchange is not None:
            if exchange.phase is Phase.BODY:
                self.wants_body()
            exchange.front_ready()

    # -- from the exchange ------------------------------------------------------------------
    def start(self, status: int, headers: Headers, length: bool, close: bool) -> None:
        if close:
            self.keep_alive = False
        self.chunked = not length and not self.http10
        if not length and self.http10:
            self.keep_alive = False  # HTTP/1.0: a body without a length ends with the connection
        self.head_out = self._head(status, headers)

    def _head(self, status: int, headers: Headers) -> bytes:
        """Status line and headers as uvicorn would write them: its Date (and Server, when
        on) first, the framing uvicorn would add, `connection: close` when the connection
        ends after this response. vLLM's header names and values came through httptools'
        strict parser: no CR, LF or NUL can be in them."""
        parts = [_status_line(status)]
        for name, value in (*self.client.default_headers(), *headers):
            parts += (name, b": ", value, b"\r\n")
        if self.chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def write(self, data: bytes) -> bool:
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self.head_out is not None:
            data = self.head_out + data
            self.head_out = None
        if self.pending or self.flow.write_paused:
            self.pending.append(data)
            self.pending_size += len(data)
            return self.pending_size > HIGH_WATER
        if not self.disconnected:
            self.transport.write(data)
        return False

    def finish(self, data: bytes) -> None:
        """The last bytes and the end of the response, after what waits (the transport
        buffers them; what waits is at most HIGH_WATER and one read)."""
        if self.chunked:
            data = (b"%x\r\n%b\r\n" % (len(data), data) if data else b"") + LAST_CHUNK
        self._last(data)
        self._done()

    def cut(self) -> None:
        """A started response that cannot be finished: the client sees the connection end."""
        self._last(b"")
        self.response_complete = True
        self.client.front_done(self)
        self.transport.close()

    def answer(self, status: int, body: bytes, close: bool) -> None:
        if close:
            self.keep_alive = False
        self.chunked = False
        headers = errors.answer_headers(status, len(body), False)
        self.head_out = self._head(status, headers)
        self.pending.clear()
        self.pending_size = 0
        if not self.ready:  # behind an earlier response: written when this one's turn comes
            self.pending.append(self.head_out + body)
            self.head_out = None
            self.over = True
            return
        self._last(body)
        self._done()

    def _last(self, data: bytes) -> None:
        if self.head_out is not None:
            data = self.head_out + data
            self.head_out = None
        if self.pending:
            data = b"".join(self.pending) + data
            self.pending.clear()
            self.pending_size = 0
        if data and not self.disconnected:
            self.transport.write(data)

    def _done(self) -> None:
        self.response_complete = True
        if self.disconnected:
            return
        if not self.keep_alive:
            self.transport.close()
        self.client.front_done(self)

    # -- from the protocol ------------------------------------------------------------------
    def client_gone(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        if self.exchange is not None:
            self.exchange.client_gone()

    def paused(self) -> None:
        if self.exchange is not None:
            self.exchange.client_paused()

    def resumed(self) -> None:
        """The transport took its buffer: what waits goes, vLLM is read again."""
        if self.pending and not self.disconnected and self.ready and not self.over:
            out = b"".join(self.pending)
            self.pending.clear()
            self.pending_size = 0
            self.transport.write(out)
        if self.exchange is not None and not self.flow.write_paused:
            self.exchange.client_resumed()


class AsgiFront:
    """One request through ASGI (under h11); see the module's docstring."""

    direct = False  # no transport behind ASGI: nothing is written straight to it
    ready = True  # the server runs a connection's requests one after the other

    def __init__(self, send: Send) -> None:
        self.send = send
        self.exchange: Exchange | None = None
        self.queue: deque[Message] = deque()
        self.queued = 0
        self.waiter: asyncio.Future[None] | None = None
        self.over = False  # the response's last message is queued

    def transport_write(self) -> Any:
        raise AssertionError("no transport behind ASGI")

    def _queue(self, message: Message, size: int = 0) -> bool:
        self.queue.append(message)
        self.queued += size
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return self.queued > HIGH_WATER

    def start(self, status: int, headers: Headers, length: bool, close: bool) -> None:
        if close:
            headers = [*headers, (b"connection", b"close")]
        self._queue({"type": "http.response.start", "status": status, "headers": headers})

    def write(self, data: bytes) -> bool:
        return self._queue({"type": "http.response.body", "body": data, "more_body": True},
                           len(data))  # fmt: skip

    def finish(self, data: bytes) -> None:
        self.over = True
        self._queue({"type": "http.response.body", "body": data})

    def cut(self) -> None:
        self.over = True
        self._queue({"type": "mla_serve.cut"})

    def answer(self, status: int, body: bytes, close: bool) -> None:
        self.over = True
        headers = errors.answer_headers(status, len(body), close)
        self._queue({"type": "http.response.start", "status": status, "headers": headers})
        self._queue({"type": "http.response.body", "body": body})

    async def run(self, receive: Receive) -> None:
        """Send what the exchange queues; read the request's body; notice a client that
        leaves (ASGI's http.disconnect)."""
        exchange = self.exchange
        assert exchange is not None
        loop = asyncio.get_running_loop()
        receiving: asyncio.Task[Message] | None = None
        try:
            while True:
                while self.queue:
                    message = self.queue.popleft()
                    if message["type"] == "mla_serve.cut":
                        raise Aborted("vLLM's response broke off after its headers")
                    self.queued -= len(message.get("body", b""))
                    await self.send(message)
                if self.queued <= HIGH_WATER:
                    exchange.client_resumed()
                if self.over:
                    return
                if receiving is None:
                    receiving = loop.create_task(receive())  # type: ignore[arg-type]
                self.waiter = loop.create_future()
                waits: set[asyncio.Future[Any]] = {self.waiter, receiving}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                self.waiter = None
                if receiving.done():
                    message = receiving.result()
                    receiving = None
                    if message["type"] == "http.disconnect":
                        exchange.client_gone()
                        return
                    exchange.take_body(message.get("body", b""))
                    if not message.get("more_body"):
                        exchange.body_done()
                    else:
                        exchange.waiting_body()
        finally:
            if receiving is not None:
                receiving.cancel()
            if not self.over:  # cancelled (shutdown) or failed: nothing more is sent
                exchange.client_gone()


class Aborted(Exception):
    """A response already started cannot be finished: uvicorn drops the connection."""


class QuietAborts(logging.Filter):
    """uvicorn logs an exception that ends a started response with a traceback; an aborted
    response is an expected outcome, which the exchange has logged in one line already."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, Aborted)


async def serve(service: PassThrough, scope: Scope, receive: Receive, send: Send) -> None:
    """The pass-through as an ASGI app: each request an exchange with an AsgiFront."""
    front = AsgiFront(send)
    request_headers: Headers = list(scope["headers"])
    client = scope.get("client")
    exchange = admit(
            service,
        front, scope["method"].encode("latin-1"), scope["path"], scope["query_string"],
        request_headers, client[0] if client else "", scope["scheme"].encode("latin-1"),
        has_body(request_headers),
    )  # fmt: skip
    if exchange is None:
        for message in front.queue:
            await send(message)
        return
    front.exchange = exchange
    if exchange.begin(length_of(request_headers)):
        exchange.waiting_body()
    await front.run(receive)
