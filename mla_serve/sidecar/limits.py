"""The limits a hostile client cannot talk its way past, per port and per connection.

Both server protocols (uvicorn_adapter.py: httptools and h11) hold every request to the same
rules, whatever serves it then: at most `max_header_bytes` of request line and headers and
`max_headers` of them (431), `max_headers` trailer fields and `max_header_bytes` of trailers
(431; the trailers of a chunked body are dropped, never passed on as headers),
`header_timeout` seconds for the head and for the trailers (408), the message rules of
passthrough/http1.py (505, 501, 400); a client that takes none of its response for
`write_timeout` seconds (the transport's buffer over its high-water mark all along) is
disconnected, which aborts its request to vLLM. Every refusal is an OpenAI-style JSON error
with `connection: close`.

Per listening port at most `max_connections` are open, so a flood on the pass-through port
cannot starve the admin port's probes. At the cap a new connection takes the place of the
one that has waited longest for a request head (idle between requests, or sending one
slowly), which is closed, as nginx and Envoy's overload manager shed idle connections; only
when every open connection is inside a request is the new one answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import http
from typing import TYPE_CHECKING, Any

from mla_serve.sidecar.passthrough import errors, http1

if TYPE_CHECKING:
    from mla_serve.sidecar.settings import Settings


def reply(status: int, message: str) -> bytes:
    """A refusal of the protocol layer: an OpenAI-style error, the connection closed."""
    body = errors.error_body(status, message, "invalid_request_error")
    head = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
    head += (b"%s: %s\r\n" % pair for pair in errors.answer_headers(status, len(body), True))
    return b"".join(head) + b"\r\n" + body


class Limits:
    """Shared by every connection of one server: the limits and the open connections."""

    def __init__(self, settings: Settings) -> None:
        self.max_header_bytes = settings.max_header_bytes
        self.header_timeout = settings.header_timeout
        self.max_connections = settings.max_connections
        self.max_headers = settings.max_headers
        self.write_timeout = settings.write_timeout
        self.open: dict[int, int] = {}
        # per port, the connections waiting for a request head, longest-waiting first
        self.waiting: dict[int, dict[Rules, None]] = {}
        self.shed = 0  # connections closed to let a new one in

    def admit(self, port: int) -> bool:
        """Room for one more connection on `port`: at the cap, the connection that has waited
        longest for a head is closed to make it; False when there is none."""
        if self.open.get(port, 0) < self.max_connections:
            return True
        waiting = self.waiting.get(port)
        if not waiting:
            return False
        oldest = next(iter(waiting))
        oldest.shed()
        self.shed += 1
        return self.open.get(port, 0) < self.max_connections


class Rules:
    """One connection's half of the limits (see the module's docstring).

    A request is read in up to two field sections, each held to the same limits (bytes,
    fields, `header_timeout`): its head, and the trailers after a chunked body's last chunk.
    `in_head` is true while either is read (raw bytes counted, the deadline running);
    `in_body` from the end of the head to the end of the message (fields then are
    trailers). Trailer fields are counted and dropped: vLLM ignores them, and passed on as
    headers they would carry `Authorization` or any `X-*` past a front proxy's policy."""

    __slots__ = (
        "counted",
        "head_bytes",
        "head_timer",
        "in_body",
        "in_head",
        "limits",
        "loop",
        "port",
        "sections",
        "trailer_bytes",
        "trailer_fields",
        "transport",
        "write_left",
        "write_timer",
    )

    def __init__(self, limits: Limits, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.limits = limits
        self.transport = transport
        self.loop = loop
        sockname = transport.get_extra_info("sockname")
        self.port = sockname[1] if isinstance(sockname, tuple) else 0
        self.counted = False
        self.head_bytes = 0
        self.sections = 0  # field sections begun on this connection
        self.in_head = True
        self.in_body = False
        self.trailer_fields = 0
        self.trailer_bytes = 0
        self.head_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.write_left = 0

    def open(self) -> bool:
        """Count the connection on its port; False (answered 503, closed) when the port is
        full of connections inside a request."""
        limits = self.limits
        if not limits.admit(self.port):
            self.transport.write(reply(503, "too many open connections"))
            self.transport.close()
            return False
        limits.open[self.port] = limits.open.get(self.port, 0) + 1
        self.counted = True
        self.head_started()
        return True

    def close(self) -> None:
        if self.counted:
            self.counted = False
            self.limits.open[self.port] -= 1
        self.head_done()
        self.write_done()

    def shed(self) -> None:
        """Closed to let a new connection in (Limits.admit): it waited longest for a head."""
        self.close()
        self.transport.close()

    # -- field sections ---------------------------------------------------------------------
    def head_started(self) -> None:
        """A request's head begins (the connection waits for one)."""
        self.in_body = False
        self.section_started()
        self.limits.waiting.setdefault(self.port, {})[self] = None

    def trailers_started(self) -> None:
        """The trailers of a chunked body begin (after its last chunk)."""
        if not self.in_head:
            self.section_started()

    def section_started(self) -> None:
        self.sections += 1
        self.in_head = True
        self.head_bytes = 0
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.limits.header_timeout, self._head_late)

    def head_done(self) -> None:
        """The field section being read (head or trailers) is complete, or nothing is read."""
        self.in_head = False
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        waiting = self.limits.waiting.get(self.port)
        if waiting is not None:
            waiting.pop(self, None)

    def section(self) -> str:
        return "request trailers" if self.in_body else "request line and headers"

    def _head_late(self) -> None:
        self.head_timer = None
        if self.in_head:
            what = "trailers" if self.in_body else "headers"
            timeout = self.limits.header_timeout
            self.refuse(408, f"request {what} not received within {timeout:g} s")

    def refuse(self, status: int, message: str) -> None:
        """Answer the request here (an OpenAI-style JSON error) and end the connection."""
        self.head_done()
        if not self.transport.is_closing():
            self.transport.write(reply(status, message))
            self.transport.close()

    def fed(self, size: int) -> bool:
        """Count the bytes of a read within a field section; False (and answered 431,
        closed) past the limit."""
        if not self.in_head:
            return True
        self.head_bytes += size
        if self.head_bytes <= self.limits.max_header_bytes:
            return True
        self.refuse(431, f"{self.section()} over {self.limits.max_header_bytes} bytes")
        return False

    def head_complete(
        self, method: bytes, target: bytes, version: str, fields: list[tuple[bytes, bytes]]
    ) -> bool:
        """A request's head is parsed: False (answered, closed) when it is not served
        (http1.head_refusal: its size counted on its fields, whatever the reads were)."""
        self.head_done()
        limits = self.limits
        refusal = http1.head_refusal(
            method, target, version, fields, limits.max_header_bytes, limits.max_headers
        )
        if refusal is not None:
            self.refuse(*refusal)
            return False
        self.in_body = True
        self.trailer_fields = self.trailer_bytes = 0
        return True

    def trailer(self, name: bytes, value: bytes) -> bool:
        """A trailer field, never kept: counted against the head's limits; False (answered
        431, closed) past them."""
        self.trailer_fields += 1
        self.trailer_bytes += len(name) + len(value) + 4
        limits = self.limits
        if self.trailer_fields > limits.max_headers:
            self.refuse(431, f"more than {limits.max_headers} request trailer fields")
            return False
        if self.trailer_bytes + 2 > limits.max_header_bytes:
            self.refuse(431, f"request trailers over {limits.max_header_bytes} bytes")
            return False
        return True

    def message_done(self) -> None:
        """The request is read whole (its trailers too). Not a section begun after it: h11
        reads the rest of a request answered early once the next head's deadline runs."""
        if self.in_body:
            self.in_body = False
            self.head_done()

    # -- a client that takes none of its response -----------------------------------------
    def writing_paused(self) -> None:
        """The transport's buffer is over its high-water mark: from now on the client must
        take some of it every `write_timeout` s."""
        if self.write_timer is None:
            self.write_left = self.transport.get_write_buffer_size()
            self.write_timer = self.loop.call_later(self.limits.write_timeout, self._write_late)

    def write_done(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _write_late(self) -> None:
        """`write_timeout` s since the last check: if the client took none of what waits for
        it, the connection is dropped (nothing would reach it), and with it the request to
        vLLM, which frees the slot."""
        self.write_timer = None
        left = self.transport.get_write_buffer_size()
        if left < self.write_left:  # it reads, slowly
            self.write_left = left
            self.write_timer = self.loop.call_later(self.limits.write_timeout, self._write_late)
            return
        self.transport.abort()
