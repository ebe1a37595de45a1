"""Run the sidecar under uvicorn with limits a hostile client cannot talk its way past.

uvicorn's httptools protocol (what vLLM's image runs: uvicorn[standard]) buffers request
headers and trailers without a bound; its h11 protocol has `h11_max_incomplete_event_size`.
Both get, per connection, the same rules for every request, whatever serves it then (one
`_Guard`, and the message rules of http1.py): at most `max_header_bytes` of request line and
headers and `max_headers` of them (431), `max_headers` trailer fields and `max_header_bytes`
of trailers (431; the trailers of a chunked body are dropped, never passed on as headers),
`header_timeout` seconds for the head and for the trailers (408), HTTP/1.0 or 1.1 (505), no
transfer coding but chunked (501); a client that takes none of its response for
`write_timeout` seconds (the transport's buffer over its high-water mark all along) is
disconnected, which aborts its request to vLLM; and per listening port at most
`max_connections` open connections (past it a new connection gets a 503 and is closed), so a
flood on the pass-through port cannot starve the admin port's probes. Every refusal is an
OpenAI-style JSON error with `connection: close`.

On httptools (the default) the pass-through's requests are served from the protocol's
callbacks without ASGI (passthrough/fronts.py's TransportFront), when this uvicorn is one
the sidecar is written for (`SUPPORTED_UVICORN`; outside it every request goes through ASGI,
with a warning). h11 (`--http h11`) serves everything through ASGI.

Both ports are sockets of one uvicorn server (one event loop, one lifespan). SIGTERM
starts a drain: uvicorn stops accepting on both, lets requests in flight finish for up to
`drain_timeout` seconds, then cancels what is left and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import importlib.util
import logging
import math
import socket
from importlib.metadata import version as installed_version
from types import FrameType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mla_serve.sidecar.app import Router, create_app
from mla_serve.sidecar.passthrough import errors, fronts, http1
from mla_serve.sidecar.passthrough.fronts import TransportFront
from mla_serve.sidecar.settings import Settings

UVLOOP = importlib.util.find_spec("uvloop") is not None
# The uvicorn releases whose httptools protocol the transport front is written for (its
# attributes and methods: `parser`, `url`, `headers`, `pipeline`, `cycle`, `flow`,
# `server_state`, `expect_100_continue`, `on_response_complete`, …), checked by version: the
# lowest tested and the first release not yet known. Kept in step with pyproject.toml.
SUPPORTED_UVICORN = ((0, 54, 0), (0, 55, 0))

log = logging.getLogger("mla_serve.sidecar")


def uvicorn_supported(version: str) -> bool:
    """Whether the transport front knows this uvicorn release (SUPPORTED_UVICORN)."""
    try:
        release = tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        return False
    low, high = SUPPORTED_UVICORN
    return low <= release < high


class Limits:
    """Shared by every connection of one server: the limits and the open connections."""

    def __init__(self, settings: Settings) -> None:
        self.max_header_bytes = settings.max_header_bytes
        self.header_timeout = settings.header_timeout
        self.max_connections = settings.max_connections
        self.max_headers = settings.max_headers
        self.write_timeout = settings.write_timeout
        self.open: dict[int, int] = {}


def _reply(status: int, message: str) -> bytes:
    """A refusal of the protocol layer: an OpenAI-style error, the connection closed."""
    body = errors.error_body(status, message, "invalid_request_error")
    head = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
    head += (b"%s: %s\r\n" % pair for pair in errors.answer_headers(status, len(body), True))
    return b"".join(head) + b"\r\n" + body


class _Guard:
    """The per-connection half of the limits, mixed into both protocol classes.

    A request is read in up to two field sections, each held to the same limits (bytes,
    fields, `header_timeout`): its head, and the trailers after a chunked body's last chunk.
    `_in_head` is true while either is read (raw bytes counted, the deadline running);
    `_in_body` from the end of the head to the end of the message (fields then are
    trailers). Trailer fields are counted and dropped: vLLM ignores them, and passed on as
    headers they would carry `Authorization` or any `X-*` past a front proxy's policy."""

    limits: ClassVar[Limits]
    transport: Any
    loop: asyncio.AbstractEventLoop

    def _guard_open(self, transport: Any) -> bool:
        """Count the connection on its port; False (and closed) when over the limit."""
        sockname = transport.get_extra_info("sockname")
        self._port = sockname[1] if isinstance(sockname, tuple) else 0
        self._counted = False
        self._head_bytes = 0
        self._sections = 0  # field sections begun on this connection
        self._in_head = True
        self._in_body = False
        self._trailer_fields = 0
        self._trailer_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_left = 0
        open_now = self.limits.open.get(self._port, 0)
        if open_now >= self.limits.max_connections:
            transport.write(_reply(503, "too many open connections"))
            transport.close()
            return False
        self.limits.open[self._port] = open_now + 1
        self._counted = True
        self._head_started()
        return True

    def _guard_close(self) -> None:
        if self._counted:
            self._counted = False
            self.limits.open[self._port] -= 1
        self._head_done()
        self._write_done()

    def _head_started(self) -> None:
        """A request's head begins."""
        self._in_body = False
        self._section_started()

    def _trailers_started(self) -> None:
        """The trailers of a chunked body begin (after its last chunk)."""
        if not self._in_head:
            self._section_started()

    def _section_started(self) -> None:
        self._sections += 1
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_late)

    def _head_done(self) -> None:
        """The field section being read (head or trailers) is complete, or nothing is read."""
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _section(self) -> str:
        return "request trailers" if self._in_body else "request line and headers"

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head:
            what = "trailers" if self._in_body else "headers"
            timeout = self.limits.header_timeout
            self._refuse(408, f"request {what} not received within {timeout:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer the request here (an OpenAI-style JSON error) and end the connection."""
        self._head_done()
        if not self.transport.is_closing():
            self.transport.write(_reply(status, message))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (smuggling, bad chunks, NUL bytes): an OpenAI-style JSON 400, as
        every other refusal, instead of uvicorn's plain text."""
        self._refuse(400, msg)

    def _head_fed(self, size: int) -> bool:
        """Count the bytes of a read within a field section; False (and answered 431,
        closed) past the limit."""
        if not self._in_head:
            return True
        self._head_bytes += size
        if self._head_bytes <= self.limits.max_header_bytes:
            return True
        self._refuse(431, f"{self._section()} over {self.limits.max_header_bytes} bytes")
        return False

    def _head_complete(
        self, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]]
    ) -> bool:
        """A request's head is parsed: False (answered, closed) when it is not served
        (http1.head_refusal: its size counted on its fields, whatever the reads were)."""
        self._head_done()
        limits = self.limits
        refusal = http1.head_refusal(
            method, target, version, headers, limits.max_header_bytes, limits.max_headers
        )
        if refusal is not None:
            self._refuse(*refusal)
            return False
        self._in_body = True
        self._trailer_fields = self._trailer_bytes = 0
        return True

    def _trailer(self, name: bytes, value: bytes) -> bool:
        """A trailer field, never kept: counted against the head's limits; False (answered
        431, closed) past them."""
        self._trailer_fields += 1
        self._trailer_bytes += len(name) + len(value) + 4
        limits = self.limits
        if self._trailer_fields > limits.max_headers:
            self._refuse(431, f"more than {limits.max_headers} request trailer fields")
            return False
        if self._trailer_bytes + 2 > limits.max_header_bytes:
            self._refuse(431, f"request trailers over {limits.max_header_bytes} bytes")
            return False
        return True

    def _message_done(self) -> None:
        """The request is read whole (its trailers too). Not a section begun after it: h11
        reads the rest of a request answered early once the next head's deadline runs."""
        if self._in_body:
            self._in_body = False
            self._head_done()

    # -- a client that takes none of its response -----------------------------------------
    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: from now on the client must
        take some of it every `write_timeout` s."""
        super().pause_writing()  # type: ignore[misc]
        if self._write_timer is None:
            self._write_left = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_late)

    def resume_writing(self) -> None:
        self._write_done()
        super().resume_writing()  # type: ignore[misc]

    def _write_done(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_late(self) -> None:
        """`write_timeout` s since the last check: if the client took none of what waits for
        it, the connection is dropped (nothing would reach it), and with it the request to
        vLLM, which frees the slot."""
        self._write_timer = None
        left = self.transport.get_write_buffer_size()
        if left < self._write_left:  # it reads, slowly
            self._write_left = left
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._write_late)
            return
        self.transport.abort()


class LimitedHttpTools(_Guard, HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits; the pass-through's requests served from
    its callbacks without ASGI (fronts.TransportFront), when `passthrough` is set."""

    router: ClassVar[Router | None] = None  # the pass-through is served without ASGI
    fast: TransportFront | None = None  # the request served without ASGI, while it runs

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._guard_open(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_close()
        fast = self.fast
        if fast is not None:
            self.fast = None
            fast.client_gone()
        current: Any = self.cycle
        if type(current) is TransportFront:  # uvicorn's own cycle has more to be told
            self.cycle = None  # type: ignore[assignment]
        super().connection_lost(exc)

    _chunk_empty = False  # a chunk header parsed and no byte of its data yet (see below)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        in_head, sections = self._in_head, self._sections
        super().data_received(data)
        if self.parser is None or self.transport.is_closing():
            return
        # Checked after feeding: only a read wholly inside one field section is counted (the
        # fields of one that ended are: _head_complete, _trailer); httptools holds at most
        # one read past the limit. A read that ends after a chunk header with no data behind
        # it ended in the last chunk's trailers, or just before a chunk's data (which then
        # ends the section).
        if in_head and self._in_head and self._sections == sections:
            if not self._head_fed(len(data)):
                return
        elif self._chunk_empty:
            self._trailers_started()
        fast = self.fast
        if fast is not None and fast.exchange is not None and fast.exchange.reading:
            fast.exchange.waiting_body()

    def on_message_begin(self) -> None:
        if self.transport.is_closing():  # refused: nothing more is served on it
            return
        # A request parsed in the read that ended the one before (served without ASGI, so
        # already answered): not an idle connection, whatever on_response_complete armed.
        self._unset_keepalive_if_required()
        super().on_message_begin()
        if not self._in_head:
            self._head_started()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_body:
            super().on_header(name, value)
        elif not self.transport.is_closing():
            self._trailer(name, value)  # counted, never added to the request's headers

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        parser = self.parser
        if not self._head_complete(
            parser.get_method(), self.url, parser.get_http_version(), self.headers
        ):
            return
        router = self.router
        server = self.server
        if (
            router is not None
            and (self.cycle is None or self.cycle.response_complete)
            and router.passes_through(
                server[1] if server and server[1] is not None else 0,
                self.url.partition(b"?")[0].decode("latin-1"),
            )
        ):
            front = fronts.take(router.passthrough, self)
            if front is not None:
                # uvicorn's protocol reads response_complete and keep_alive from its cycle
                self.cycle = front  # type: ignore[assignment]
                if not front.response_complete:
                    self.fast = front
                return
        super().on_headers_complete()

    def on_chunk_header(self) -> None:
        self._chunk_empty = True

    def on_body(self, body: bytes) -> None:
        if self._chunk_empty:
            self._chunk_empty = False
            self._head_done()  # a chunk's data: not trailers after all
        if self.transport.is_closing():
            return
        cycle: Any = self.cycle
        if type(cycle) is TransportFront:
            if cycle.exchange is not None:
                cycle.exchange.take_body(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._chunk_empty = False
        self._message_done()
        if self.transport.is_closing():  # refused in its trailers: never served
            return
        cycle: Any = self.cycle
        if type(cycle) is TransportFront:
            if cycle.exchange is not None:
                cycle.exchange.body_done()
            return
        super().on_message_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        fast = self.fast
        if fast is not None:
            fast.paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        fast = self.fast
        if fast is not None:
            fast.resumed()


class LimitedH11(_Guard, H11Protocol):
    """h11 bounds the bytes of an incomplete head or trailers itself
    (`h11_max_incomplete_event_size`, 431 here) and refuses transfer codings but chunked
    (501 here); the rest of the rules, the deadlines and the connection count are added
    here, on h11's events (`_next_event`)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]
        self._guard_open(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_close()
        super().connection_lost(exc)

    def _next_event(self) -> Any:
        """h11's next event, held to the sidecar's rules before uvicorn sees it; a refused
        request ends the connection (uvicorn is told h11 needs data)."""
        try:
            event = self._h11_next_event()
        except h11.RemoteProtocolError as error:
            if error.error_status_hint == 431:
                self._refuse(431, f"{self._section()} over {self.limits.max_header_bytes} bytes")
            elif error.error_status_hint == 501:
                self._refuse(501, str(error))
            else:
                raise  # uvicorn answers 400 (send_400_response)
            return h11.NEED_DATA
        if isinstance(event, h11.Request):
            version = event.http_version.decode("ascii")
            if not self._head_complete(event.method, event.target, version, list(event.headers)):
                return h11.NEED_DATA
        elif isinstance(event, h11.EndOfMessage):
            for name, value in event.headers:  # uvicorn drops them; counted here
                if not self._trailer(name, value):
                    return h11.NEED_DATA
            self._message_done()
        return event

    def handle_events(self) -> None:
        super().handle_events()
        # h11 reads the trailers after the last chunk (a private attribute: without it,
        # trailers are still bounded by h11 and by the body's timeouts, not by time alone)
        reader = getattr(self.conn, "_reader", None)
        if self._in_body and getattr(reader, "_reading_trailer", False) is True:
            self._trailers_started()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._head_started()


def protocol(kind: str, settings: Settings, app: Router | None = None) -> type[asyncio.Protocol]:
    """The HTTP protocol class: httptools (as in vLLM's image), or h11. With `app`, the
    pass-through's requests on httptools are served without ASGI, where this uvicorn is one
    the transport front knows (else a warning, and ASGI)."""
    limits = Limits(settings)
    if kind in ("auto", "httptools"):
        router = app
        if router is not None and not uvicorn_supported(installed_version("uvicorn")):
            log.warning("uvicorn %s is not a release the sidecar's HTTP front is written for "
                        "(%s to before %s): every request goes through ASGI",
                        installed_version("uvicorn"), *(".".join(map(str, v))
                                                        for v in SUPPORTED_UVICORN))  # fmt: skip
            router = None
        attributes = {"limits": limits, "router": router}
        return type("SidecarLimitedHttpTools", (LimitedHttpTools,), attributes)
    return type("SidecarLimitedH11", (LimitedH11,), {"limits": limits})


def front_line(http: type[asyncio.Protocol], loop: str, lane: bool) -> str:
    """The log line that says which HTTP front serves."""
    where = f"on {loop}"
    if issubclass(http, LimitedHttpTools):
        if http.router is None:
            return f"HTTP front: httptools {where}; every request through ASGI"
        reads = "in C" if lane else "in Python"
        return (f"HTTP front: httptools {where}; the pass-through served without ASGI, token "
                f"chunks read {reads}")  # fmt: skip
    return f"HTTP front: h11 {where} (--http h11); every request through ASGI"


class Server(uvicorn.Server):
    """uvicorn's server with a tick of one second instead of a tenth: the tick refreshes the
    Date header (once a second either way) and notices `should_exit`, so an idle sidecar
    wakes nine times a second less. A signal ends the wait at once (`handle_exit` wakes it):
    SIGTERM starts the drain as promptly as with uvicorn's own loop."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header when % 10 == 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(settings: Settings, log_level: str = "info", http: str = "auto") -> None:
    sockets = [listen(settings.host, settings.port)]
    if settings.admin_port is not None and settings.admin_port != settings.port:
        sockets.append(listen(settings.admin_host or settings.host, settings.admin_port))
    loop = "uvloop" if UVLOOP else "asyncio"
    app = create_app(settings)
    http_class = protocol(http, settings, app)
    config = uvicorn.Config(
        app,
        http=http_class,
        loop=loop,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # X-Forwarded-For is the pass-through's business (--trusted-proxies)
        server_header=False,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),
    )
    lane = settings.lane_on
    logging.getLogger("uvicorn.error").info(front_line(http_class, loop, lane))  # uvicorn's format
    Server(config).run(sockets=sockets)
