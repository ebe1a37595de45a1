"""Chat and completion requests served from the sidecar's own protocol callbacks, no ASGI.

Under uvicorn an HTTP request becomes an ASGI scope, a request-response cycle, a task, an
`asyncio.Event` for its body and a dict per message sent; the pass-through then waits on
futures for vLLM's head and end. For the two classified routes, which are nearly all the
traffic, that machinery is most of the sidecar's work per request beyond Envoy's. Here the
sidecar's httptools protocol (serve.LimitedHttpTools) hands such a request to a
`FastExchange` instead: the body is taken from the parser's callbacks, the request is
written to a pooled connection to vLLM (upstream.py) from the callback that completed the
body, and the response goes back to the client from the upstream connection's callbacks,
written straight onto the client's transport. No task, no future, no ASGI message, unless
a new connection to vLLM must be opened (one task for the connect).

Taken only when the request is a plain one (`FastPath.takes`): POST of HTTP/1.1 to exactly
`/v1/chat/completions` or `/v1/completions` (no query, no percent-encoding, no dot
segments), on the pass-through port, without `Expect`, an upgrade, more headers than
`max_headers` or a Content-Length over `max_body_bytes`, not pipelined behind another
request, with the direct upstream client in use. Everything else (and h11, and a server
other than the sidecar's own) takes the ASGI path (proxy.Proxy), which answers the same
way: the refusals, timeouts, error events and counting here are those of proxy.Exchange
and proxy.Proxy, and the tests run both paths.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any

from mla_serve.sidecar.passthrough import upstream
from mla_serve.sidecar.passthrough.proxy import (
    CLASSIFIED,
    CLOSING,
    Exchange,
    Proxy,
    Refused,
    Request,
    _why,
    answer_headers,
    body_late,
    body_wait,
    error_body,
    inspect,
    returned_headers,
)

log = logging.getLogger("mla_serve.sidecar")

TARGETS = {path.encode(): path for path in CLASSIFIED}
STATUS_LINE = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode())
    for status in http.HTTPStatus
}
LAST_CHUNK = b"0\r\n\r\n"


# What FastPath and FastExchange use of uvicorn's httptools protocol (uvicorn 0.54.0 in
# every image lock): the attributes it sets, and the methods called.
PROTOCOL_NAMES = {
    "__init__": ("pipeline", "server_state", "transport", "flow", "server", "client",
                 "scheme", "cycle", "parser", "loop"),
    "on_message_begin": ("url", "expect_100_continue", "headers"),
    "on_header": ("expect_100_continue", "headers"),
}  # fmt: skip
PROTOCOL_METHODS = ("on_response_complete", "_unset_keepalive_if_required", "shutdown")


def compatible(protocol: type) -> bool:
    """Whether `protocol` (uvicorn's HttpToolsProtocol) still has what the fast path uses;
    if not (another uvicorn), the requests go the ASGI path."""
    try:
        for method, names in PROTOCOL_NAMES.items():
            code = getattr(protocol, method).__code__
            if not set(names) <= set(code.co_names):
                return False
    except AttributeError:
        return False
    return all(callable(getattr(protocol, name, None)) for name in PROTOCOL_METHODS)


def _status_line(status: int) -> bytes:
    line = STATUS_LINE.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class FastPath:
    """Decides which requests the protocol serves itself, and starts them."""

    def __init__(self, proxy: Proxy, admin_port: int | None) -> None:
        self.proxy = proxy
        self.admin_port = admin_port
        self.max_headers = proxy.settings.max_headers
        self.max_body = proxy.settings.max_body_bytes
        self.live: set[FastExchange] = set()  # ended at shutdown (close)

    def takes(self, protocol: Any) -> FastExchange | None:
        """A FastExchange for the request whose head `protocol` (uvicorn's httptools
        protocol, in on_headers_complete) has just parsed, or None: the ASGI path."""
        proxy = self.proxy
        path = TARGETS.get(protocol.url)
        if path is None or proxy.pool is None or not proxy.routes.allows(path):
            return None
        parser = protocol.parser
        if (
            parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or protocol.expect_100_continue
            or parser.should_upgrade()
            or protocol.pipeline
        ):
            return None
        server = protocol.server
        if self.admin_port is not None and server is not None and server[1] == self.admin_port:
            return None
        headers = protocol.headers
        if len(headers) > self.max_headers:
            return None
        for name, value in headers:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_body):
                return None
        exchange = FastExchange(self, protocol, path, parser.should_keep_alive())
        self.live.add(exchange)
        return exchange

    def close(self) -> None:
        """At shutdown, after the drain: what is still running is cut off."""
        for exchange in list(self.live):
            exchange.client_gone()
            exchange.transport.close()


class FastExchange(Exchange):
    """One classified request and its response, driven by the two connections' callbacks.

    It also stands in for uvicorn's request-response cycle on the client's protocol
    (`protocol.cycle`): `response_complete`, `keep_alive` and `disconnected` are read and
    set there (pipelining, shutdown, a lost connection)."""

    def __init__(self, fast: FastPath, protocol: Any, path: str, keep_alive: bool) -> None:
        super().__init__(fast.proxy, Request(), _no_send, protocol.loop)
        self.fast = fast
        self.protocol = protocol
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.path = path
        self.scope = {
            "method": "POST",
            "headers": protocol.headers,
            "client": protocol.client,
            "scheme": protocol.scheme,
            "query_string": b"",
        }
        # uvicorn's cycle interface
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        # the request
        self.reading = True  # the client's body is being read
        self.body_started = self.body_at = self.loop.time()
        self.body_timer: asyncio.TimerHandle | None = None
        self.payload = b""
        self.attempts = 0
        self.deadline = 0.0
        self.connecting: asyncio.Task[None] | None = None
        # the response
        self.chunked = False
        self.head_out: bytes | None = None  # the response head, written with the first read
        self.ended = False  # the last bytes are written (or the connection is cut)

    # -- the client's side: the protocol's parser callbacks -------------------------------
    def request_body(self, data: bytes) -> None:
        if not self.reading:
            return
        request, proxy = self.request, self.proxy
        self.body_at = self.loop.time()
        if request.held + len(data) > self.fast.max_body:
            self._refuse(Refused(413, f"request body over {self.fast.max_body} bytes"))
            return
        if not proxy.budget.take(len(data)):
            self._refuse(Refused(503, "the sidecar is at its in-flight request body limit; "
                                 "retry", "server_busy"))  # fmt: skip
            return
        request.held += len(data)
        request.body.append(data)

    def request_done(self) -> None:
        """The client's request is complete: check it, send it to vLLM."""
        if not self.reading:
            return
        self.reading = False
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        request, proxy = self.request, self.proxy
        if len(request.body) > 1:
            request.body[:] = [b"".join(request.body)]
        try:
            inspect(request, proxy.settings.max_json_values, proxy.loops, self.path)
            body = request.body[0] if request.body else b""
            self.payload = proxy._request_bytes(self.scope, self.path, body)
        except Refused as refused:
            self._refuse(refused)
            return
        except Exception as error:  # a bug must answer this request, not end the connection
            log.exception("reading a request failed")
            self._answer(500, error_body(500, f"the sidecar failed: {_why(error)}", "server_error"))
            return
        request.body.clear()  # the bytes are in `payload`; the budget is given back once sent
        self.deadline = self.loop.time() + self.settings.response_timeout
        self.idle_handle = self.loop.call_at(self._next_check(), self._check)
        self._attempt()

    def watch_body(self) -> None:
        """After a read of the client's socket left the body incomplete: its deadline."""
        if self.reading and self.body_timer is None:
            when = body_wait(self.settings, self.body_started, self.body_at)
            self.body_timer = self.loop.call_at(when, self._body_check)

    def _body_check(self) -> None:
        self.body_timer = None
        if not self.reading:
            return
        if self.loop.time() >= body_wait(self.settings, self.body_started, self.body_at):
            self._refuse(body_late(self.settings, self.body_started, self.body_at))
            return
        self.watch_body()

    def client_gone(self) -> None:
        """The client's connection is lost: vLLM's request is aborted, everything held given
        back; nothing is counted (as on the ASGI path)."""
        if self.disconnected:
            return
        self.disconnected = True
        self.reading = False
        self.ended = True
        self.fast.live.discard(self)
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        self.close()
        self.proxy._release(self.request)

    def resume_writing(self) -> None:
        """The client's transport took its buffer: what waits goes, vLLM is read again."""
        if self.pending and not self.ended:
            out = b"".join(self.pending)
            self.pending.clear()
            self.pending_size = 0
            self.transport.write(out)
        if self.conn is not None:
            self.conn.resume()

    # -- vLLM's side ----------------------------------------------------------------------
    def _attempt(self) -> None:
        """Write the request on an idle connection to vLLM, or open one (a task)."""
        self.attempts += 1
        self.broken, self.retryable, self.finished = None, False, False
        conn = self.proxy.pool.take() if self.proxy.pool is not None else None
        if conn is None:
            self.connecting = self.loop.create_task(self._connect())
            return
        self._send(conn)

    async def _connect(self) -> None:
        pool = self.proxy.pool
        assert pool is not None
        try:
            conn = await pool.get()
        except TimeoutError:
            self._unreachable("connect timeout")
            return
        except OSError as error:
            self._unreachable(str(error))
            return
        except Exception as error:  # a bug must answer this request, not vanish in a task
            log.exception("connecting to vLLM failed")
            self._unreachable(_why(error))
            return
        self.connecting = None
        if self.ended:
            conn.abort()
            return
        self._send(conn)

    def _send(self, conn: upstream.Connection) -> None:
        self.conn = conn
        conn.request(self.payload, self)
        self.proxy._release(self.request)  # written: its budget back (once)

    def _next_check(self) -> float:
        if self.status:
            return self._first_check()
        return min(self.deadline, self.loop.time() + self.settings.idle_timeout)

    def _check(self) -> None:
        """One timer per request: vLLM's head within the response timeout, then no gap in
        its body longer than the idle timeout (Exchange._idle_check)."""
        self.idle_handle = None
        if self.ended:
            return
        if self.status:
            self._idle_check()
            return
        if self.loop.time() < self.deadline:
            self.idle_handle = self.loop.call_at(self._next_check(), self._check)
            return
        if self.connecting is not None:
            self.connecting.cancel()
            self._unreachable("connect timeout")
            return
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        message = f"vLLM sent no response within {self.settings.response_timeout:g} s"
        self._answer(504, error_body(504, message, "upstream_timeout"))

    def _unreachable(self, why: str) -> None:
        self.connecting = None
        message = f"vLLM is not reachable at {self.settings.upstream}: {why}"
        self._answer(503, error_body(503, message, "upstream_unavailable"))

    # -- the upstream connection's callbacks (Exchange's, writing to the client) -----------
    def head(self, status: int, headers: upstream.Headers) -> None:
        super().head(status, headers)
        if self.idle_handle is not None:
            self.idle_handle.cancel()
        self.idle_handle = self.loop.call_at(self._next_check(), self._check)
        returned = returned_headers(headers, keep_length=not self.streamed)
        length = any(name == b"content-length" for name, _ in returned)
        self.chunked = not length and status not in (204, 304)
        self.head_out = self._head_bytes(status, returned)
        self.started = True

    def _head_bytes(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """Status line and headers as uvicorn would write them: its Date (and Server, when
        on) first, the framing uvicorn would add, `connection: close` when the connection
        ends after this response. vLLM's header names and values came through httptools'
        strict parser: no CR, LF or NUL can be in them."""
        parts = [_status_line(status)]
        for name, value in (*self.protocol.server_state.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
        if self.chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _emit(self, out: bytes) -> None:
        self.batch.append(out)

    def fed(self) -> None:
        """After one read of vLLM's socket: what it gave, in one write to the client."""
        if self.ended:
            return
        batch = self.batch
        if batch:
            out = batch[0] if len(batch) == 1 else b"".join(batch)
            batch.clear()
            if self.chunked:
                out = b"%x\r\n%b\r\n" % (len(out), out)
        elif self.head_out is None:
            return
        else:
            out = b""
        if self.head_out is not None:
            out = self.head_out + out
            self.head_out = None
        if self.pending or self.flow.write_paused:
            self._queue(out)
            return
        self.transport.write(out)

    def may_arm(self, conn: upstream.Connection) -> None:
        """vLLM's parser is between two chunks: the lane (upstream.py, _lane.c) takes this
        stream's next reads of token chunks, which proxy.token_chunk would take here."""
        head = self.head_bytes
        splitter = self.splitter
        if (
            head is None
            or splitter is None
            or splitter.pieces
            or self.ended
            or self.finished
            or not self.chunked
            or self.head_out is not None
        ):
            return
        completion = self.completion
        choice = completion.choices.get(0)
        if completion.id is None or completion.model is None or choice is None:
            return
        guard = self.request.guard
        watch = None
        check_every = 0
        if guard is not None:
            watch = guard.watches.get(0)
            if watch is None or not guard.head or guard.stopped:
                return
            if guard.looping and guard.action == "stop":
                return  # each token decides whether the stream stops: the guard's own path
            check_every = guard.config.check_every
        conn.arm(self, head, choice, guard, watch, check_every)

    def end(self) -> None:
        super().end()
        self._end()

    def lost(self, why: str, retryable: bool) -> None:
        super().lost(why, retryable)
        if self.status:
            self._end()
            return
        if retryable and self.attempts < 2 and not self.ended:
            self._attempt()  # vLLM closed an idle connection as the request went out
            return
        message = f"vLLM failed before responding: {why}"
        self._answer(502, error_body(502, message, "upstream_error"))

    def _finish(self, failure: str | None) -> None:
        super()._finish(failure)
        if self.status:
            self._end()

    def _wake(self) -> None:
        pass

    # -- the end of the response ------------------------------------------------------------
    def _end(self) -> None:
        """vLLM's response is over (complete, broken off, stopped by the loop guard, or
        silent too long): the last bytes to the client, the completion counted."""
        if not self._ending():
            return
        proxy = self.proxy
        out = b"".join(self.batch)
        self.batch.clear()
        if self.streamed:
            self._end_stream(out)
            return
        if out and self.chunked:
            out = b"%x\r\n%b\r\n" % (len(out), out)
        if not self.complete:
            self._write(out)
            proxy.metrics.truncated.inc()
            why = self.idle_failure or self.broken
            log.warning("aborted a response: vLLM's response broke off after its headers: %s", why)
            proxy._forget(self.kept)
            self._cut()
            return
        self._write(out + LAST_CHUNK if self.chunked else out)
        try:
            if self.status == 200:
                proxy._classify_body(self.kept if self.keep else None, self.request)
        finally:
            proxy._forget(self.kept)
        self._done()

    def _end_stream(self, out: bytes) -> None:
        proxy, request = self.proxy, self.request
        tail = proxy._last_events(*self._last_bytes(out))
        self._write((b"%x\r\n%b\r\n" % (len(tail), tail) if tail else b"") + LAST_CHUNK)
        proxy._settle(self.completion, request.guard, request.model)
        self._done()

    def _ending(self) -> bool:
        """Mark the response as ending, once: False when it already was. Its timer stops."""
        if self.ended:
            return False
        self.ended = True
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        return True

    def _write(self, out: bytes) -> None:
        """The last bytes: after what waits, whatever the client's pace (the transport
        buffers them; what waits is at most HIGH_WATER and one read)."""
        if self.head_out is not None:
            out = self.head_out + out
            self.head_out = None
        if self.pending:
            out = b"".join(self.pending) + out
            self.pending.clear()
            self.pending_size = 0
        if out and not self.disconnected:
            self.transport.write(out)

    def _refuse(self, refused: Refused) -> None:
        self.proxy.metrics.refused.labels(str(refused.status)).inc()
        self._answer(refused.status, error_body(refused.status, str(refused), refused.kind))

    def _answer(self, status: int, body: bytes) -> None:
        """A response of the sidecar's own before vLLM's head (proxy._respond's)."""
        if not self._ending():
            return
        unread = self.reading  # the rest of the request is not read: end the connection
        self.reading = False
        self.close()
        self.proxy._release(self.request)
        if status in CLOSING or unread:
            self.keep_alive = False
        self.chunked = False
        head = self._head_bytes(status, answer_headers(status, len(body)))
        if not self.disconnected:
            self.transport.write(head + body)
        self._done()

    def _cut(self) -> None:
        """A started response that cannot be finished: the client sees the connection end."""
        self.response_complete = True
        self.fast.live.discard(self)
        self.close()
        self.transport.close()

    def _done(self) -> None:
        self.response_complete = True
        self.fast.live.discard(self)
        self.close()
        protocol = self.protocol
        if protocol.fast is self:
            protocol.fast = None
        if self.disconnected:
            return
        if not self.keep_alive:
            self.transport.close()
        protocol.on_response_complete()


async def _no_send(message: Any) -> None:
    raise AssertionError("a FastExchange writes to its transport")
