"""Run the sidecar under uvicorn with limits a hostile client cannot talk its way past.

uvicorn's httptools protocol (what vLLM's image runs: uvicorn[standard]) buffers request
headers without a bound; its h11 protocol has `h11_max_incomplete_event_size`. Both get,
per connection: at most `max_header_bytes` of request line and headers, a deadline of
`header_timeout` seconds for them, and per listening port at most `max_connections` open
connections (past it a new connection gets a 503 and is closed), so a flood on the
pass-through port cannot starve the admin port's probes.

On httptools the pass-through's plain chat and completion requests are served from the
protocol's callbacks without ASGI (fast.py; `LimitedHttpTools.fast_path`).

Both ports are sockets of one uvicorn server (one event loop, one lifespan). SIGTERM
starts a drain: uvicorn stops accepting on both, lets requests in flight finish for up to
`drain_timeout` seconds, then cancels what is left and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import math
import socket
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mla_serve.sidecar import fast
from mla_serve.sidecar.app import create_app
from mla_serve.sidecar.fast import FastExchange, FastPath
from mla_serve.sidecar.proxy import CLIENT_GONE
from mla_serve.sidecar.settings import Settings

log = logging.getLogger("mla_serve.sidecar")


class Limits:
    """Shared by every connection of one server: the limits and the open connections."""

    def __init__(self, max_header_bytes: int, header_timeout: float, max_connections: int) -> None:
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.open: dict[int, int] = {}


def _reply(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None,
                   "code": status}}
    ).encode()  # fmt: skip
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Guard:
    """The per-connection half of the limits, mixed into both protocol classes."""

    limits: ClassVar[Limits]
    transport: Any
    loop: asyncio.AbstractEventLoop

    def _guard_open(self, transport: Any) -> bool:
        """Count the connection on its port; False (and closed) when over the limit."""
        sockname = transport.get_extra_info("sockname")
        self._port = sockname[1] if isinstance(sockname, tuple) else 0
        self._counted = False
        self._head_bytes = 0
        self._in_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        open_now = self.limits.open.get(self._port, 0)
        if open_now >= self.limits.max_connections:
            transport.write(_reply(503, "Service Unavailable", "too many open connections"))
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

    def _head_started(self) -> None:
        self._in_head = True
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_late)

    def _head_done(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            message = f"request headers not received within {self.limits.header_timeout:g} s"
            self.transport.write(_reply(408, "Request Timeout", message))
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (smuggling, bad chunks, NUL bytes): an OpenAI-style JSON 400, as
        every other refusal, instead of uvicorn's plain text."""
        self._head_done()
        if not self.transport.is_closing():
            self.transport.write(_reply(400, "Bad Request", msg))
            self.transport.close()

    def _head_fed(self, size: int) -> bool:
        """Count header bytes; False (and answered 431, closed) past the limit."""
        if not self._in_head:
            return True
        self._head_bytes += size
        if self._head_bytes <= self.limits.max_header_bytes:
            return True
        self._head_done()
        message = f"request line and headers over {self.limits.max_header_bytes} bytes"
        self.transport.write(_reply(431, "Request Header Fields Too Large", message))
        self.transport.close()
        return False


class LimitedHttpTools(_Guard, HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits; the pass-through's chat and completion
    requests served from its callbacks without ASGI (fast.py, when `fast_path` is set), and
    for the requests that do go through ASGI a callback when a client leaves mid-response
    (proxy.CLIENT_GONE on the request's cycle): it cancels that request's exchange without
    a watcher task per request."""

    fast_path: ClassVar[FastPath | None] = None
    fast: FastExchange | None = None  # the request served without ASGI, while it runs

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
        if type(current) is FastExchange:  # uvicorn's own cycle has more to be told
            self.cycle = None  # type: ignore[assignment]
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            gone = getattr(cycle, CLIENT_GONE, None)
            if gone is not None:
                gone()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        in_head = self._in_head
        super().data_received(data)
        # Checked after feeding, so bytes that completed the head (and the body after
        # them) are not counted; httptools holds at most one read past the limit.
        if in_head and self._in_head and self.parser is not None:
            self._head_fed(len(data))
        fast = self.fast
        if fast is not None and fast.reading:
            fast.watch_body()

    def on_message_begin(self) -> None:
        # A request parsed in the read that ended the one before (served without ASGI, so
        # already answered): not an idle connection, whatever on_response_complete armed.
        self._unset_keepalive_if_required()
        super().on_message_begin()
        if not self._in_head:
            self._head_started()

    def on_headers_complete(self) -> None:
        self._head_done()
        path = self.fast_path
        if path is not None and (self.cycle is None or self.cycle.response_complete):
            exchange = path.takes(self)
            if exchange is not None:
                # uvicorn's protocol reads response_complete and keep_alive from its cycle
                self.cycle = self.fast = exchange  # type: ignore[assignment]
                return
        super().on_headers_complete()
        if self.cycle is not None:  # this protocol calls back when the client leaves
            setattr(self.cycle, CLIENT_GONE, None)

    def on_body(self, body: bytes) -> None:
        cycle: Any = self.cycle
        if type(cycle) is FastExchange:
            cycle.request_body(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        cycle: Any = self.cycle
        if type(cycle) is FastExchange:
            cycle.request_done()
            return
        super().on_message_complete()

    def resume_writing(self) -> None:
        super().resume_writing()
        fast = self.fast
        if fast is not None:
            fast.resume_writing()


class LimitedH11(_Guard, H11Protocol):
    """h11 bounds the head itself (`h11_max_incomplete_event_size`); the deadline and the
    connection count are added here."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._guard_open(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_close()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._in_head and self.cycle is not None and not self.cycle.response_complete:
            self._head_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._head_started()


def protocol(
    kind: str, limits: Limits, fast_path: FastPath | None = None
) -> type[asyncio.Protocol]:
    """The HTTP protocol class: httptools when installed (as in vLLM's image), else h11.
    `fast_path`: the pass-through's requests the httptools protocol serves without ASGI."""
    if kind == "auto":
        kind = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if kind == "httptools":
        if fast_path is not None and not fast.compatible(HttpToolsProtocol):
            log.warning("this uvicorn's httptools protocol is not the one the fast path knows: "
                        "chat and completions go through ASGI")  # fmt: skip
            fast_path = None
        attributes = {"limits": limits, "fast_path": fast_path}
        return type("SidecarLimitedHttpTools", (LimitedHttpTools,), attributes)
    return type("SidecarLimitedH11", (LimitedH11,), {"limits": limits})


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


def limits_of(settings: Settings) -> Limits:
    return Limits(settings.max_header_bytes, settings.header_timeout, settings.max_connections)


def run(settings: Settings, log_level: str = "info", http: str = "auto") -> None:
    limits = limits_of(settings)
    sockets = [listen(settings.host, settings.port)]
    if settings.admin_port is not None and settings.admin_port != settings.port:
        sockets.append(listen(settings.admin_host or settings.host, settings.admin_port))
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        http=protocol(http, limits, app.fast),
        loop=loop,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # X-Forwarded-For is the pass-through's business (--trusted-proxies)
        server_header=False,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout),
    )
    Server(config).run(sockets=sockets)
