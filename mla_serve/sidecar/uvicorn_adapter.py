"""Everything the sidecar knows of uvicorn's and h11's insides, in one place.

The sidecar runs under uvicorn, with its own subclasses of uvicorn's two HTTP protocols and
of its server. They reach into what uvicorn does not document (the protocols' parser,
pipeline, cycle and flow control, `_unset_keepalive_if_required`, `_start_asgi_task`; the
server's main loop and shutdown; h11's trailer state), so they are written for the uvicorn
releases in SUPPORTED_UVICORN (pyproject.toml admits only those; under another, the
sidecar logs it and serves every request through ASGI on h11, which needs none of it).

`LimitedHttpTools` (httptools, what vLLM's image runs): every request held to the sidecar's
limits (limits.py `Rules`); every pass-through request served from the parser's callbacks by
a fronts.TransportFront, without ASGI: a request pipelined behind another waits in
uvicorn's own pipeline until the one before it went out, one with `Expect: 100-continue`
gets its `100 Continue` when its body is wanted, and one that asks to upgrade (`Upgrade:
h2c`, what `curl --http2` sends on http://; `websocket`) is served as HTTP/1.1, as
RFC 9110 section 7.8 lets a server do: the sidecar never switches protocols. The admin
routes go through uvicorn's own cycle and ASGI.

`LimitedH11` (`--http h11`): h11 bounds an incomplete head or trailers itself
(`h11_max_incomplete_event_size`, 431 here) and refuses transfer codings but chunked (501
here); the rest of the rules are added on h11's events; every request through ASGI.

`Server`: uvicorn's server with a tick of one second (the Date header is refreshed once a
second either way) and the sidecar's drain: on SIGTERM `/readyz` turns 503 at once while
both ports keep listening, `/livez` answers and the pass-through serves what is in flight
(new responses close their connections) for up to `--drain-timeout`; what is still open
then is ended (a stream with its error event and last chunk, counted), and only then does
uvicorn close the listeners and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from importlib.metadata import version as installed_version
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import unquote

import h11
import httptools
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mla_serve.sidecar.limits import Limits, Rules
from mla_serve.sidecar.passthrough.exchange import admit
from mla_serve.sidecar.passthrough.fronts import TransportFront, has_body, length_of

if TYPE_CHECKING:
    from mla_serve.sidecar.app import Router
    from mla_serve.sidecar.passthrough.exchange import Headers
    from mla_serve.sidecar.passthrough.service import PassThrough
    from mla_serve.sidecar.settings import Settings

# The uvicorn releases these classes are written for: the lowest tested and the first
# release not yet known. Kept in step with pyproject.toml (tests/test_serve_tick.py).
SUPPORTED_UVICORN = ((0, 54, 0), (0, 55, 0))

log = logging.getLogger("mla_serve.sidecar")


def uvicorn_supported(version: str) -> bool:
    """Whether these classes know this uvicorn release (SUPPORTED_UVICORN)."""
    try:
        release = tuple(int(part) for part in version.split(".")[:3])
    except ValueError:
        return False
    low, high = SUPPORTED_UVICORN
    return low <= release < high


def _path(raw: bytes) -> str:
    """The request's path as uvicorn gives it to ASGI (percent-decoded once); a path that is
    not ASCII is given as it is, for the pass-through's route check to refuse."""
    try:
        path = raw.decode("ascii")
    except UnicodeDecodeError:
        return raw.decode("latin-1")
    return unquote(path) if "%" in path else path


def _without_upgrade(method: bytes, url: bytes, version: str, fields: Headers) -> bytes:
    """A request head as the client sent it, less its Upgrade header and the `upgrade` token
    of its Connection header: what the parser reads again to serve it as HTTP/1.1."""
    parts = [method, b" ", url, b" HTTP/", version.encode("ascii"), b"\r\n"]
    for name, value in fields:
        if name == b"upgrade":
            continue
        if name == b"connection":
            kept = [t for t in value.split(b",") if t.strip().lower() != b"upgrade"]
            if not kept:
                continue
            value = b",".join(kept)
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _request_parser(protocol: Any) -> httptools.HttpRequestParser:
    """httptools' request parser as uvicorn makes it (a response may go out before the next
    request of a pipeline is read), taking any HTTP/x.y version line: the version rules are
    http1.head_refusal's (a higher minor version of 1 read as 1.1, RFC 9112 section 2.3;
    another major 505), not llhttp's 400 for anything but 1.0 and 1.1."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_data_after_close=True, lenient_version=True)
    return parser


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits and the transport front; see the
    module's docstring."""

    limits: ClassVar[Limits]
    router: ClassVar[Router | None] = None  # the pass-through, served without ASGI
    fast: TransportFront | None = None  # the transport front whose response goes out now
    behind: Any = None  # uvicorn's cycle a transport front waits behind
    rules: Rules
    _chunk_empty = False  # a chunk header parsed and no byte of its data yet (see below)
    _upgrade = False  # the head asked to upgrade: served once the parser hands it back

    # -- fronts.FrontClient ----------------------------------------------------------------
    def default_headers(self) -> Headers:
        return self.server_state.default_headers

    def front_done(self, front: TransportFront) -> None:
        """A transport front's response went out whole: the next request's turn."""
        if self.fast is front:
            self.fast = None
        if not self.transport.is_closing():
            self.on_response_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """uvicorn's pipeline holds transport fronts too: one's turn comes here."""
        if type(cycle) is TransportFront:
            self.fast = cycle
            cycle.activate()
            return
        super()._start_asgi_task(cycle, app)

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.parser = _request_parser(self)
        self.rules = Rules(self.limits, transport, self.loop)
        self.rules.open()

    def connection_lost(self, exc: Exception | None) -> None:
        self.rules.close()
        queued: list[Any] = [cycle for cycle, _ in self.pipeline]
        waiting = [self.fast, *(c for c in queued if type(c) is TransportFront)]
        self.fast = None
        for front in waiting:
            if front is not None:
                front.client_gone()
        behind = self.behind
        if behind is not None and not behind.response_complete:  # uvicorn tells its latest only
            behind.disconnected = True
            behind.message_event.set()
        current: Any = self.cycle
        if type(current) is TransportFront:  # uvicorn's own cycle has more to be told
            self.cycle = None  # type: ignore[assignment]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        rules = self.rules
        in_head, sections = rules.in_head, rules.sections
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._served_as_http(data[upgrade.args[0] :])
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")
            return
        if self.parser is None or self.transport.is_closing():
            return
        # Checked after feeding: only a read wholly inside one field section is counted (the
        # fields of one that ended are: Rules.head_complete, trailer); httptools holds at
        # most one read past the limit. A read that ends after a chunk header with no data
        # behind it ended in the last chunk's trailers, or just before a chunk's data (which
        # then ends the section).
        if in_head and rules.in_head and rules.sections == sections:
            if not rules.fed(len(data)):
                return
        elif self._chunk_empty:
            rules.trailers_started()
        reading: Any = self.cycle
        if type(reading) is TransportFront and reading.exchange is not None:
            reading.exchange.waiting_body()

    def _served_as_http(self, rest: bytes) -> None:
        """The parser stopped at an upgrade's head (llhttp reads no body then): the head is
        read again without Upgrade by a new parser, with the rest of the bytes behind it."""
        self._upgrade = False
        head = _without_upgrade(
            self.parser.get_method(), self.url, self.parser.get_http_version(), self.headers
        )
        self.parser = _request_parser(self)
        try:
            self.parser.feed_data(head + rest)
        except httptools.HttpParserUpgrade:  # the head again: refused, not looped on
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (smuggling, bad chunks, NUL bytes): an OpenAI-style JSON 400, as
        every other refusal, instead of uvicorn's plain text."""
        self.rules.refuse(400, msg)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.rules.writing_paused()
        fast = self.fast
        if fast is not None:
            fast.paused()

    def resume_writing(self) -> None:
        self.rules.write_done()
        super().resume_writing()
        fast = self.fast
        if fast is not None:
            fast.resumed()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.transport.is_closing():  # refused: nothing more is served on it
            return
        # A request parsed in the read that ended the one before (served without ASGI, so
        # already answered): not an idle connection, whatever on_response_complete armed.
        self._unset_keepalive_if_required()
        super().on_message_begin()
        if not self.rules.in_head:
            self.rules.head_started()

    def on_header(self, name: bytes, value: bytes) -> None:
        rules = self.rules
        if not rules.in_body:
            super().on_header(name, value)
        elif not self.transport.is_closing():
            rules.trailer(name, value)  # counted, never added to the request's headers

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return
        parser = self.parser
        if parser.should_upgrade():
            self._upgrade = True  # llhttp skips the body and stops: _served_as_http
            return
        if not self.rules.head_complete(
            parser.get_method(), self.url, parser.get_http_version(), self.headers
        ):
            return
        router = self.router
        server = self.server
        if router is not None and router.passes_through(
            server[1] if server and server[1] is not None else 0,
            self.url.partition(b"?")[0].decode("latin-1"),
        ):
            self._front(router.passthrough)
            return
        super().on_headers_complete()

    def _front(self, service: PassThrough) -> None:
        """The request just parsed, served by a transport front (queued in uvicorn's
        pipeline behind a response still going out)."""
        parser = self.parser
        existing: Any = self.cycle
        busy = existing is not None and not existing.response_complete
        front = TransportFront(self, parser.should_keep_alive(),
                               parser.get_http_version() == "1.0", ready=not busy,
                               expect=self.expect_100_continue)  # fmt: skip
        self.cycle = front  # type: ignore[assignment]  # uvicorn reads its response_complete
        if busy:
            self.flow.pause_reading()
            self.pipeline.appendleft((front, None))  # type: ignore[arg-type]
            if type(existing) is not TransportFront:
                self.behind = existing
        else:
            self.fast = front
        request_headers = self.headers
        url = httptools.parse_url(self.url)
        client = self.client
        body = has_body(request_headers)
        exchange = admit(
            service,
            front, parser.get_method(), _path(url.path), url.query or b"", request_headers,
            client[0] if client else "", (self.scheme or "http").encode("latin-1"), body,
        )  # fmt: skip
        if exchange is not None:
            front.exchange = exchange
            if exchange.begin(length_of(request_headers)) and body:
                front.wants_body()

    def on_chunk_header(self) -> None:
        self._chunk_empty = True

    def on_body(self, body: bytes) -> None:
        if self._chunk_empty:
            self._chunk_empty = False
            self.rules.head_done()  # a chunk's data: not trailers after all
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
        if self._upgrade:  # the head of an upgrade, bodiless to llhttp: read again
            return
        self.rules.message_done()
        if self.transport.is_closing():  # refused in its trailers: never served
            return
        cycle: Any = self.cycle
        if type(cycle) is TransportFront:
            if cycle.exchange is not None:
                cycle.exchange.body_done()
            return
        super().on_message_complete()


class LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with the limits; see the module's docstring."""

    limits: ClassVar[Limits]
    rules: Rules

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]
        self.rules = Rules(self.limits, transport, self.loop)
        self.rules.open()

    def connection_lost(self, exc: Exception | None) -> None:
        self.rules.close()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.rules.refuse(400, msg)

    def _next_event(self) -> Any:
        """h11's next event, held to the sidecar's rules before uvicorn sees it; a refused
        request ends the connection (uvicorn is told h11 needs data)."""
        rules = self.rules
        try:
            event = self._h11_next_event()
        except h11.RemoteProtocolError as error:
            if error.error_status_hint == 431:
                rules.refuse(431, f"{rules.section()} over {self.limits.max_header_bytes} bytes")
            elif error.error_status_hint == 501:
                rules.refuse(501, str(error))
            else:
                raise  # uvicorn answers 400 (send_400_response)
            return h11.NEED_DATA
        if isinstance(event, h11.Request):
            version = event.http_version.decode("ascii")
            if not rules.head_complete(event.method, event.target, version, list(event.headers)):
                return h11.NEED_DATA
        elif isinstance(event, h11.EndOfMessage):
            for name, value in event.headers:  # uvicorn drops them; counted here
                if not rules.trailer(name, value):
                    return h11.NEED_DATA
            rules.message_done()
        return event

    def handle_events(self) -> None:
        super().handle_events()
        # h11 reads the trailers after the last chunk (a private attribute: without it,
        # trailers are still bounded by h11 and by the body's timeouts, not by time alone)
        reader = getattr(self.conn, "_reader", None)
        if self.rules.in_body and getattr(reader, "_reading_trailer", False) is True:
            self.rules.trailers_started()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.rules.writing_paused()

    def resume_writing(self) -> None:
        self.rules.write_done()
        super().resume_writing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.rules.head_started()


def protocol(kind: str, settings: Settings, app: Router | None = None) -> type[asyncio.Protocol]:
    """The HTTP protocol class: httptools (as in vLLM's image), or h11. With `app`, the
    pass-through's requests on httptools are served without ASGI; under a uvicorn these
    classes are not written for, h11 (every request through ASGI), said in the log."""
    limits = Limits(settings)
    uvicorn_version = installed_version("uvicorn")
    if kind in ("auto", "httptools"):
        if uvicorn_supported(uvicorn_version):
            attributes = {"limits": limits, "router": app}
            return type("SidecarLimitedHttpTools", (LimitedHttpTools,), attributes)
        low, high = (".".join(map(str, v)) for v in SUPPORTED_UVICORN)
        log.warning("uvicorn %s is not a release the sidecar's HTTP front is written for "
                    "(%s to before %s): serving on h11, every request through ASGI",
                    uvicorn_version, low, high)  # fmt: skip
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
    return f"HTTP front: h11 {where}; every request through ASGI"


class Server(uvicorn.Server):
    """uvicorn's server with a tick of one second instead of a tenth, and the drain (see the
    module's docstring). A signal ends the tick's wait at once (`handle_exit` wakes it):
    SIGTERM starts the drain as promptly as with uvicorn's own loop."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    passthrough: PassThrough | None = None  # what the drain waits for
    drain_timeout = 0.0

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header when % 10 == 0
            await self._sleep(1.0)
            should_exit = await self.on_tick(counter)

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def shutdown(self, sockets: Any = None) -> None:
        await self.drain()
        await super().shutdown(sockets)

    async def drain(self) -> None:
        """Serve what is in flight for up to the drain timeout, the listeners open and
        /readyz 503; then end what is left (PassThrough.close)."""
        service = self.passthrough
        if service is None:
            return
        service.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        if service.live:
            log.info("draining: %d request(s) in flight, for up to %g s",
                     len(service.live), self.drain_timeout)  # fmt: skip
        while service.live and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0)))
            await self.on_tick(0)  # the Date header stays fresh
        if service.live:
            log.warning("drain timeout: ending %d request(s) still open", len(service.live))
        service.close()
