"""The OpenAI pass-through: one request to vLLM and its answer back, one state machine.

`PassThrough` holds what every request shares (the settings, the one client to vLLM, the
in-flight byte budget, the metrics, the runaway ledger and guard). Each request is one
`Exchange`, whatever front serves it (fronts.py: the sidecar's own HTTP protocol writing to
its transport, or ASGI for what that front does not take): the front hands it the request's
head and body, the exchange checks the request, sends it to vLLM through the pool
(upstream.py), and is vLLM's response's `Sink`: the head, each piece of the body, the end
or why it broke off come in from the connection's callbacks, are classified here and go out
through the front. The exchange owns everything of one request: the body it holds and the
budget it draws on, the one timer of its deadlines, vLLM's connection, the response's
classification (the completion and its choices, the stream's token shape, the runaway
guard's watch), and what fails and how it is answered (errors.py).

Bytes go out as they arrive and unchanged (the events of each read of vLLM's socket, never
the whole response); status, headers and bodies are vLLM's own, less the hop-by-hop headers
a proxy must not pass on and vLLM's Date (the sidecar's server dates its answers: one Date
field, as nginx does). Only the routes in `routes.OPENAI_ROUTES` (plus `--extra-routes`) are
forwarded, checked on the normalized path.

Classification (classify.py): a chat or completion response is read as it passes. A stream's
token chunks are matched by the stream's token shape (learnt as its first ones pass) without
parsing them whole; other events are parsed whole. With the C lane armed (lane.py), whole
reads of token chunks are taken in C, and what they did is collected here (`took`). The
runaway guard (guard/loops.py), when on, sees every token; in stop mode it ends a looping
stream (closing vLLM's connection, so vLLM aborts the request) with its own final events.
Classification needs a stream's final usage: when a client streams without asking for
`stream_options.include_usage`, the request asks for it and the usage chunk is dropped on the
way back.

Deadlines, one timer per exchange: the request body within `--body-timeout` of silence and
`--body-deadline` in all (408); vLLM's head within `--upstream-timeout` (504); then no silence
in vLLM's body over `--stream-idle-timeout`, and a body that is not a stream whole within
`--response-deadline`. Memory: a request body up to `--max-body-bytes`, all bodies being read
at once within `--max-inflight-body-bytes` (503 past it); an event (or whole response) kept to
classify up to `--max-event-bytes`, else passed on unparsed.

Faults: vLLM unreachable → 503; no response head in time → 504; broken before its head →
502 (once retried when a kept connection was closed under the request); after the head a
stream ends with an error event, any other body is cut off. A client that disconnects drops
vLLM's connection, so vLLM aborts the request and frees the slot; nothing is counted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from mla_serve.sidecar.guard.loops import LoopGuard, ResponseGuard
from mla_serve.sidecar.passthrough import classify, errors, sse, upstream
from mla_serve.sidecar.passthrough.classify import CLASSIFIED, Request, TokenShape
from mla_serve.sidecar.passthrough.errors import Refused
from mla_serve.sidecar.passthrough.routes import Routes, normalize
from mla_serve.sidecar.passthrough.runaways import Choice, Completion, Ledger

if TYPE_CHECKING:
    from mla_serve.sidecar.settings import Settings

log = logging.getLogger("mla_serve.sidecar")

Headers = list[tuple[bytes, bytes]]

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the client library sets for its own request.
HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
    }
)  # fmt: skip
# X-Forwarded-For and -Proto are what uvicorn (so vLLM) believes about the client: set here.
NOT_FORWARDED = HOP_BY_HOP | {
    b"host", b"content-length", b"expect", b"x-forwarded-for", b"x-forwarded-proto"
}  # fmt: skip
# vLLM's Date is not returned: the sidecar's server dates every response it sends (from the
# same clock as vLLM's in the pod), and HTTP allows one Date field (RFC 9110 section 6.6.1);
# nginx drops the upstream's Date the same way.
NOT_RETURNED = HOP_BY_HOP | {b"content-length", b"date"}


class ByteBudget:
    """Bytes of request bodies (and response bytes kept to classify) held at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


class Metrics:
    def __init__(self, registry: CollectorRegistry, budget: ByteBudget) -> None:
        self.buffered = Gauge(
            "mla_serve_buffered_bytes",
            "Bytes the pass-through holds now (request bodies, partial events, bodies kept to "
            "classify), against --max-inflight-body-bytes.",
            registry=registry,
        )
        self.buffered.set_function(lambda: budget.used)
        self.refused = Counter(
            "mla_serve_refused_requests",
            "Requests the pass-through answered itself, by HTTP status.",
            ["code"],
            registry=registry,
        )
        self.unparsed = Counter(
            "mla_serve_unparsed_events",
            "Upstream events or bodies relayed unchanged but not classified (not the JSON "
            "expected, or over --max-event-bytes).",
            registry=registry,
        )
        self.truncated = Counter(
            "mla_serve_truncated_responses",
            "Upstream responses that stalled or broke off after their headers.",
            registry=registry,
        )


class Front(Protocol):
    """Where an exchange's response goes: the client's connection (fronts.py)."""

    @property
    def direct(self) -> bool: ...  # writes go straight onto the client's transport now

    def start(self, status: int, headers: Headers, length: bool) -> None: ...
    def write(self, data: bytes) -> bool: ...  # True: over the high-water mark, pause vLLM
    def finish(self, data: bytes) -> None: ...
    def cut(self) -> None: ...
    def answer(self, status: int, body: bytes, close: bool) -> None: ...
    def transport_write(self) -> Any: ...  # the client transport's write, for the lane


class PassThrough:
    """What every request shares; see the module's docstring."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        loops: LoopGuard | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.loops = loops  # the runaway guard (guard/loops.py); None: no loop detection
        self.routes = Routes(settings.routes)
        self.budget = ByteBudget(settings.max_inflight_body_bytes)
        self.metrics = Metrics(
            registry if registry is not None else CollectorRegistry(), self.budget
        )
        self.trusted = settings.trusted_networks
        self.pool: upstream.Pool | None = None
        self.live: set[Exchange] = set()

    async def start(self) -> None:
        settings = self.settings
        self.pool = upstream.Pool(
            settings.vllm_url, settings.connect_timeout, lane_on=settings.lane_on
        )

    def close(self) -> None:
        """At shutdown, after the drain: what still runs is cut off."""
        for exchange in list(self.live):
            exchange.client_gone()
            exchange.front.cut()
        if self.pool is not None:
            self.pool.close()

    def open(
        self,
        front: Front,
        method: bytes,
        raw_path: str,
        query: bytes,
        headers: Headers,
        peer: str,
        scheme: bytes,
        has_body: bool,
    ) -> Exchange | None:
        """The exchange of a request the pass-through serves, or None: a path it does not
        forward, answered 404 through `front` (closing the connection when a body follows)."""
        path = self.route(raw_path)
        if path is None:
            refused = Refused(404, "no such route", "not_found_error")
            self.metrics.refused.labels("404").inc()
            front.answer(404, refused.body(), has_body)
            return None
        return Exchange(self, front, method, path, query, headers, peer, scheme)

    def route(self, raw_path: str) -> str | None:
        """The normalized path if the pass-through serves it, else None."""
        if raw_path in self.routes.exact:  # already normalized (what clients send)
            return raw_path
        path = normalize(raw_path)
        return path if path is not None and self.routes.allows(path) else None

    def forwarded(self, headers: Headers, peer: str, scheme: bytes) -> Headers:
        """The request headers vLLM gets: the client's less hop-by-hop ones (and those its
        Connection header names), and X-Forwarded-For/-Proto as this sidecar vouches for
        them. The names come lowercased: both fronts take them from uvicorn's protocols, which
        lower them (as ASGI requires)."""
        out: Headers = []
        forwarded_for: list[bytes] = []
        proto: bytes | None = None
        named: set[bytes] = set()
        for name, value in headers:
            if name not in NOT_FORWARDED and not name.startswith(b"proxy-"):
                out.append((name, value))
            elif name == b"x-forwarded-for":
                forwarded_for.append(value)
            elif name == b"x-forwarded-proto":
                proto = value
            elif name == b"connection":
                named.update(_tokens(value))
        if named:
            out = [pair for pair in out if pair[0] not in named]
        trusted = bool(peer) and self._trusts(peer)
        if peer:
            if forwarded_for and trusted:
                forwarded_for.append(peer.encode("latin-1"))
            else:
                forwarded_for = [peer.encode("latin-1")]
            out.append((b"x-forwarded-for", b", ".join(forwarded_for)))
        out.append((b"x-forwarded-proto", proto if proto and trusted else scheme))
        return out

    def _trusts(self, peer: str) -> bool:
        if not self.trusted:  # the default: no address to parse
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.trusted)


def _tokens(value: bytes) -> set[bytes]:
    """The field names a Connection header's value lists."""
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


def connection_tokens(headers: Any) -> frozenset[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(_tokens(value))
    return frozenset(tokens)


def returned_headers(headers: Any, keep_length: bool) -> Headers:
    """vLLM's response headers as the client gets them: names lowercased, less hop-by-hop
    ones, those its Connection header names, and vLLM's Date; Content-Length only when
    `keep_length` (a body relayed byte for byte)."""
    named = connection_tokens(headers)
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in named or (
            lowered in NOT_RETURNED and not (keep_length and lowered == b"content-length")
        ):
            continue
        kept.append((lowered, value))
    return kept


def media_type(headers: Headers) -> bytes:
    """The Content-Type's media type, lowercased."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.partition(b";")[0].strip().lower()
    return b"application/octet-stream"


def why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Exchange:
    """One request through the pass-through and its response; see the module's docstring."""

    __slots__ = (
        "attempts",
        "batch",
        "broken",
        "choice",
        "chunked",
        "classified",
        "complete",
        "completion",
        "conn",
        "connecting",
        "deadline",
        "done",
        "ended",
        "ends_by",
        "failure",
        "finished",
        "front",
        "guard",
        "headers",
        "held",
        "keep",
        "kept",
        "kept_size",
        "last_body",
        "loop",
        "method",
        "path",
        "paused",
        "payload",
        "peer",
        "query",
        "reading",
        "received",
        "request",
        "retryable",
        "scheme",
        "service",
        "settings",
        "shape",
        "splitter",
        "started",
        "status",
        "streamed",
        "strip_usage",
        "timer",
    )

    HIGH_WATER = 64 * 1024  # bytes waiting for the client past which vLLM is paused

    def __init__(
        self,
        service: PassThrough,
        front: Front,
        method: bytes,
        path: str,
        query: bytes,
        headers: Headers,
        peer: str,
        scheme: bytes,
    ) -> None:
        self.service = service
        self.settings = service.settings
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.peer = peer
        self.scheme = scheme
        self.classified = method == b"POST" and path in CLASSIFIED
        # the request
        self.reading = True  # the client's body is being read
        self.received: list[bytes] = []  # the request's body so far
        self.held = 0  # bytes of the in-flight budget this exchange holds
        self.started = self.last_body = self.loop.time()
        self.request: Request | None = None  # what classification keeps of the request
        self.payload = b""
        # vLLM's side
        self.conn: upstream.Connection | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.attempts = 0
        self.deadline = math.inf  # vLLM's head by then
        self.ends_by = math.inf  # a response that is not a stream: over by then
        self.timer: asyncio.TimerHandle | None = None
        # the response
        self.status = 0
        self.streamed = False
        self.chunked = False  # the client gets it in chunked coding
        self.complete = False  # vLLM's response ended as HTTP says it must
        self.finished = False  # nothing more is taken from vLLM
        self.ended = False  # the client's response is over (or the connection cut)
        self.broken: str | None = None  # why vLLM's response broke off
        self.retryable = False
        self.failure: str | None = None  # a deadline that ended vLLM's body
        self.paused = False  # vLLM's connection paused: the client is behind
        self.batch: list[bytes] = []  # this read's output
        # classification of a chat or completion response
        self.completion = Completion()
        self.guard: ResponseGuard | None = None
        self.strip_usage = False
        self.splitter: sse.Splitter | None = None
        self.shape: TokenShape | None = None
        self.choice: Choice | None = None  # choice 0, once the stream's shape is learnt
        self.done = False  # [DONE] seen
        self.keep = False  # a whole 200 kept to classify
        self.kept: list[bytes] = []
        self.kept_size = 0
        service.live.add(self)

    # -- the request, from the front ----------------------------------------------------------
    def begin(self, length: int | None) -> bool:
        """The request's head is in (its declared Content-Length, if any): False when it is
        refused at once (answered)."""
        settings = self.settings
        if length is not None and length > settings.max_body_bytes:
            return self._refuse(Refused(413, f"request body over {settings.max_body_bytes} bytes"))
        return True

    def waiting_body(self) -> None:
        """After a read of the client's socket left the body incomplete: its deadline."""
        if self.reading and self.timer is None:
            self._arm_timer(body_wait(self.settings, self.started, self.last_body))

    def take_body(self, data: bytes) -> None:
        if not self.reading or not data:
            return
        self.last_body = self.loop.time()
        limit = self.settings.max_body_bytes
        if self.held + len(data) > limit:
            self._refuse(Refused(413, f"request body over {limit} bytes"))
            return
        if not self.service.budget.take(len(data)):
            self._refuse(errors.busy())
            return
        self.held += len(data)
        self.received.append(data)

    def body_done(self) -> None:
        """The client's request is complete: check it, send it to vLLM."""
        if not self.reading:
            return
        self.reading = False
        received = self.received
        body = received[0] if len(received) == 1 else b"".join(received)
        received.clear()
        try:
            if self.classified:
                service = self.service
                self.request = request = classify.read_request(
                    body, self.settings.max_json_values, service.loops, self.path
                )
                body = request.body
                self.guard, self.strip_usage = request.guard, request.strip_usage
            self.payload = self._request_bytes(body)
        except Refused as refused:
            self._refuse(refused)
            return
        except Exception as error:  # a bug must answer this request, not end the connection
            log.exception("reading a request failed")
            self._answer(500, errors.error_body(500, f"the sidecar failed: {why(error)}",
                                                "server_error"))  # fmt: skip
            return
        now = self.loop.time()
        settings = self.settings
        self.deadline = now + settings.upstream_timeout
        # Due no later than the response's first check (set at its head, which then keeps
        # this timer); `_tick` re-arms it by phase.
        self._arm_timer(min(self.deadline, now + settings.stream_idle_timeout,
                            now + settings.response_deadline))  # fmt: skip
        self._attempt()

    def _request_bytes(self, body: bytes) -> bytes:
        """The request as written to vLLM."""
        service = self.service
        pool = service.pool
        assert pool is not None
        query = self.query
        target = pool.prefix + self.path.encode("latin-1") + (b"?" + query if query else b"")
        parts = [self.method, b" ", target, b" HTTP/1.1\r\nhost: ", pool.authority, b"\r\n"]
        for name, value in service.forwarded(self.headers, self.peer, self.scheme):
            parts += (name, b": ", value, b"\r\n")
        if body or self.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            parts.append(b"content-length: %d\r\n" % len(body))
        parts += (b"\r\n", body)
        return b"".join(parts)

    def client_gone(self) -> None:
        """The client's connection is lost: vLLM's request is aborted, everything held given
        back; nothing is counted."""
        self.ended = True
        self.reading = False
        self.close()

    def client_paused(self) -> None:
        """The client's transport is over its high-water mark: writes queue in the front."""
        if self.conn is not None:
            self.conn.disarm()

    def client_resumed(self) -> None:
        """The front wrote what waited: vLLM is read again."""
        if self.paused and self.conn is not None:
            self.paused = False
            self.conn.resume()

    # -- vLLM's side ----------------------------------------------------------------------------
    def _attempt(self) -> None:
        """Write the request on an idle connection to vLLM, or open one (a task)."""
        self.attempts += 1
        self.broken, self.retryable, self.finished = None, False, False
        pool = self.service.pool
        assert pool is not None
        conn = pool.take()
        if conn is None:
            self.connecting = self.loop.create_task(self._connect(pool))
            return
        self._send(conn)

    async def _connect(self, pool: upstream.Pool) -> None:
        try:
            conn = await pool.connect()
        except TimeoutError:
            self._unreachable("connect timeout")
            return
        except OSError as error:  # ssl.SSLError is one
            self._unreachable(str(error))
            return
        except Exception as error:  # a bug must answer this request, not vanish in a task
            log.exception("connecting to vLLM failed")
            self._unreachable(why(error))
            return
        self.connecting = None
        if self.ended:
            conn.abort()
            return
        self._send(conn)

    def _send(self, conn: upstream.Connection) -> None:
        self.conn = conn
        conn.request(self.payload, self)
        self._release()  # written: the body's budget back (once)

    def _unreachable(self, detail: str) -> None:
        self.connecting = None
        self._fail(errors.upstream_failure("unreachable", self.settings.vllm_url, detail))

    # -- the one timer ------------------------------------------------------------------------
    def _arm_timer(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        """Every deadline of the exchange, by phase: the request body (body_wait), vLLM's
        head (the response timeout), vLLM's body (response_check)."""
        self.timer = None
        if self.ended and self.finished:
            return
        now = self.loop.time()
        settings = self.settings
        if self.reading:
            when = body_wait(settings, self.started, self.last_body)
            if now >= when:
                self._refuse(body_late(settings, self.started, self.last_body))
                return
            self._arm_timer(when)
            return
        if not self.status:
            if now < self.deadline:
                self._arm_timer(self.deadline)
                return
            if self.connecting is not None:
                self.connecting.cancel()
                self._unreachable("connect timeout")
                return
            if self.conn is not None:
                self.conn.abort()
                self.conn = None
            timeout = f"{settings.upstream_timeout:g}"
            self._fail(errors.upstream_failure("timeout", settings.vllm_url, timeout))
            return
        conn = self.conn
        if self.finished or conn is None:
            return
        failure, when = response_check(settings, conn.idle_since(), not conn.paused,
                                       self.ends_by, now)  # fmt: skip
        if failure is not None:
            self.failure = failure
            self._stop(failure)
            return
        self._arm_timer(when)

    # -- the connection's callbacks (upstream.Sink) ------------------------------------------
    def head(self, status: int, headers: Headers) -> None:
        self.status = status
        self.streamed = media_type(headers) == b"text/event-stream"
        settings = self.settings
        if self.streamed:
            if self.classified:
                budget = self.service.budget
                self.splitter = sse.Splitter(settings.max_event_bytes, budget.take, budget.give)
        else:
            self.keep = self.classified and status == 200
            self.ends_by = self.loop.time() + settings.response_deadline
        returned = returned_headers(headers, keep_length=not self.streamed)
        length = any(name == b"content-length" for name, _ in returned)
        self.chunked = not length and status not in (204, 304) and self.method != b"HEAD"
        self.front.start(status, returned, not self.chunked)
        when = min(self.loop.time() + settings.stream_idle_timeout, self.ends_by)
        timer = self.timer
        if timer is None or timer.when() > when:
            self._arm_timer(when)

    def body(self, data: bytes) -> None:
        if self.finished:
            return
        shape = self.shape
        splitter = self.splitter
        try:  # a bug must end this response, not the connection's loop
            if shape is not None and not splitter.pieces and not splitter.skipping:  # type: ignore[union-attr]
                found = shape.match(data)
                if (
                    found is not None
                ):  # a token chunk: choice 0 visible on visible text, the guard's token
                    self.batch.append(data)
                    channel, text = found
                    choice = self.choice
                    if channel != "reasoning" and not choice.visible and text.strip():  # type: ignore[union-attr]
                        choice.visible = True  # type: ignore[union-attr]
                    guard = self.guard
                    if guard is not None and guard.add_token(0, channel, text):
                        self._stop(None)
                    return
            if self.splitter is not None:
                out = self._stream_body(data)
            else:
                out = self._keep_body(data) if self.keep else data
        except Exception as error:
            log.exception("classifying a response failed")
            self._stop(f"the sidecar failed on vLLM's response: {why(error)}")
            return
        if out:
            self.batch.append(out)
        guard = self.guard
        if guard is not None and guard.stopped:
            self._stop(None)

    def fed(self) -> None:
        """After one read of vLLM's socket: what it gave, in one write to the client."""
        batch = self.batch
        if not batch or self.ended:
            return
        out = batch[0] if len(batch) == 1 else b"".join(batch)
        batch.clear()
        if self.complete or self.finished:  # the end follows in this read: one write with it
            batch.append(out)
            return
        if self.front.write(out) and self.conn is not None and not self.paused:
            self.paused = True
            self.conn.pause()

    def may_arm(self, conn: upstream.Connection) -> None:
        """vLLM's parser is between two chunks: the lane may take this stream's next reads
        of token chunks, which `body` would take here."""
        shape = self.shape
        if shape is None or not shape.tail or self.finished or self.ended or self.splitter.pieces:  # type: ignore[union-attr]
            return
        front = self.front
        if not front.direct:
            return
        channel: str | None = None
        budget = 1 << 62
        guard = self.guard
        if guard is not None:
            watch = guard.watches.get(0)
            if watch is None or not guard.head or guard.stopped:
                return
            if guard.looping and guard.action == "stop":
                return  # each token decides whether the stream stops: the guard's own path
            if watch.loop is None:
                if not watch.channel:
                    return  # the detector's channel is set by the first text
                channel = watch.channel
                budget = watch.detector.until_check()
        head, keys, tail = shape.arm_args()
        visible = tuple((key, name, name != "reasoning") for key, name in keys)
        assert conn.lane is not None
        conn.lane.arm(head, visible, tail, channel, budget, front.transport_write(),
                      conn.clock, None if channel is None else self.checkpoint)  # fmt: skip

    def checkpoint(self) -> int:
        """The lane's texts reached the guard's next check: what it took is counted and the
        detector looks (guard.took), after the same token as through `body`. The next
        budget, or 0 when the Python path takes the stream's next tokens (the guard stopped
        the stream here, or found its loop, after which no text is kept)."""
        conn = self.conn
        guard = self.guard
        if conn is None or guard is None or self.finished or self.ended:
            return 0
        try:
            conn.drain()  # -> took -> guard.took, which checks
        except Exception as error:  # a bug must end this response, as in `body`
            log.exception("classifying a response failed")
            self._stop(f"the sidecar failed on vLLM's response: {why(error)}")
            return 0
        if guard.stopped:
            self._stop(None)
            return 0
        watch = guard.watches[0]
        if watch.loop is not None:
            return 0
        return watch.detector.until_check()

    def took(self, taken: upstream.Taken) -> None:
        """What the lane took (token chunks written to the client): counted as `_token`
        counts them."""
        tokens, visible, texts = taken
        choice = self.choice
        if visible and choice is not None:
            choice.visible = True
        guard = self.guard
        if guard is not None:
            guard.took(0, tokens, texts)

    def end(self) -> None:
        self.complete = True
        self.finished = True
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.release()
        self._end()

    def lost(self, why_: str, retryable: bool) -> None:
        self.broken = why_
        self.retryable = retryable
        self.finished = True
        self.conn = None
        if self.status:
            self._end()
            return
        if retryable and self.attempts < 2 and not self.ended:
            self._attempt()  # vLLM closed an idle connection as the request went out
            return
        self._fail(errors.upstream_failure("broken", self.settings.vllm_url, why_))

    # -- classification ---------------------------------------------------------------------
    def _stream_body(self, data: bytes) -> bytes:
        splitter = self.splitter
        assert splitter is not None
        if not splitter.pieces and not splitter.skipping and classify.one_event(data):
            return self._event(data, data[6:], True)
        out, events, after = splitter.feed(data)
        if events:
            out += self._events(events)
        guard = self.guard
        if guard is None or not guard.stopped:
            out += after
        return out

    def _events(self, block: bytes) -> bytes:
        """Complete events: each classified; the bytes to pass on (all of them, less a usage
        chunk asked for here, and nothing after the chunk that confirmed a loop to stop)."""
        if classify.one_event(block):
            return self._event(block, block[6:], True)
        kept: list[bytes] = []
        guard = self.guard
        for raw, event in sse.split_events(block):
            data = sse.data_of(event)
            kept.append(self._event(raw, data) if data is not None else raw)
            if guard is not None and guard.stopped:
                break
        return b"".join(kept)

    def _event(self, raw: bytes, data: bytes, whole: bool = False) -> bytes:
        """One event's data: classified; the event's bytes to pass on, or none (a usage
        chunk asked for here)."""
        if data == b"[DONE]":
            self.done = True
            return raw
        try:
            chunk = classify.loads(data)
            if chunk.__class__ is not dict:
                raise ValueError("not an object")
            self.completion.add_chunk(chunk)
        except (ValueError, TypeError, AttributeError, RecursionError):
            self.service.metrics.unparsed.inc()
            return raw
        guard = self.guard
        if guard is not None and guard.add_chunk(chunk):
            return raw
        if self.strip_usage and not chunk.get("choices") and chunk.get("usage"):
            return b""
        shape = self.shape
        if (shape is None or not shape.tail) and (whole or classify.one_event(raw)):
            learnt = classify.learn(raw, chunk, first=shape is None)
            if learnt is not None:
                self.shape = learnt
                self.choice = self.completion.choices[0]
        return raw

    def _keep_body(self, data: bytes) -> bytes:
        self.kept_size += len(data)
        if self.kept_size <= self.settings.max_event_bytes and self.service.budget.take(len(data)):
            self.kept.append(data)
        else:  # too big, or no room now: relayed, not classified
            self.keep = False
            self._forget()
        return data

    def _classify_body(self) -> None:
        """A whole (not streamed) completion: classified and counted, or counted as unparsed
        (too large to keep)."""
        completion = Completion()
        request = self.request
        try:
            if not self.keep:
                raise ValueError("not kept to classify")
            document = classify.loads(b"".join(self.kept))
            if document.__class__ is not dict:
                raise ValueError("not an object")
            completion.add_body(document)
            guard = self.guard
            if guard is not None:
                guard.add_body(document)
                guard.settle(completion)
        except (ValueError, TypeError, AttributeError, RecursionError):
            self.service.metrics.unparsed.inc()
            return
        self.service.ledger.record(completion, request.model if request else None)

    # -- the end -------------------------------------------------------------------------------
    def _stop(self, failure: str | None) -> None:
        """Take nothing more from vLLM: drop its connection (vLLM aborts the request)."""
        self.finished = True
        if failure is not None and self.broken is None:
            self.broken = failure
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()
        if self.status:
            self._end()

    def _end(self) -> None:
        """vLLM's response is over (complete, broken off, stopped by the guard, or too slow):
        the last bytes to the client, the completion counted."""
        if self.ended:
            self.close()
            return
        self.ended = True
        out = b"".join(self.batch)
        self.batch.clear()
        service = self.service
        if self.splitter is not None:
            self.front.finish(self._last_events(out))
            guard = self.guard
            if guard is not None:
                guard.settle(self.completion)
            request = self.request
            service.ledger.record(self.completion, request.model if request else None)
        elif not self.complete:
            if out:
                self.front.write(out)
            service.metrics.truncated.inc()
            log.warning("aborted a response: vLLM's response broke off after its headers: %s",
                        self.failure or self.broken)  # fmt: skip
            self.front.cut()
        else:
            self.front.finish(out)
            if self.classified and self.status == 200:
                self._classify_body()
        self.close()

    def _last_events(self, held: bytes) -> bytes:
        """A stream's last bytes: with the guard's ending when it stopped the stream, with an
        error event when vLLM broke it off or went silent."""
        splitter = self.splitter
        assert splitter is not None
        metrics = self.service.metrics
        if splitter.oversized:
            metrics.unparsed.inc(splitter.oversized)
        tail = held + splitter.rest()
        guard = self.guard
        if guard is not None and guard.stopped:
            # The guard ended it (vLLM's connection is closed, so vLLM aborts the request and
            # frees its KV cache); the client gets a clean end instead of the rest.
            return held + guard.ending(include_usage=not self.strip_usage)
        if self.failure is not None:
            failure: str | None = self.failure
        elif self.broken is not None:
            failure = f"vLLM broke off the stream: {self.broken}"
        elif not self.done:
            failure = "vLLM ended the stream without [DONE]"
        else:
            return tail
        metrics.truncated.inc()
        if tail and not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
            tail += b"\n\n"  # end the partial event, or the error event would join it
        return tail + errors.error_event(failure or "")

    def _refuse(self, refused: Refused) -> bool:
        """A request answered here before vLLM; False."""
        self.service.metrics.refused.labels(str(refused.status)).inc()
        self._answer(refused.status, refused.body())
        return False

    def _fail(self, refused: Refused) -> None:
        """vLLM failed before its head: answered here (not counted as a refusal)."""
        self._answer(refused.status, refused.body())

    def _answer(self, status: int, body: bytes) -> None:
        """A response of the sidecar's own before vLLM's head."""
        if self.ended:
            return
        self.ended = True
        unread = self.reading  # the rest of the request is not read: end the connection
        self.reading = False
        self.close()
        self.front.answer(status, body, status in errors.CLOSING or unread)

    def _release(self) -> None:
        """The request body's bytes back to the budget (once)."""
        self.received.clear()
        self.service.budget.give(self.held)
        self.held = 0

    def _forget(self) -> None:
        self.service.budget.give(sum(len(piece) for piece in self.kept))
        self.kept.clear()

    def close(self) -> None:
        """Whatever happened (the end, the client gone, an error): vLLM's connection dropped
        unless its response ended, the timer stopped, held bytes given back."""
        self.finished = True
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.splitter is not None:
            self.splitter.rest()
        self._forget()
        self._release()
        self.service.live.discard(self)


def response_check(
    settings: Settings, since: float, waiting: bool, ends_by: float, now: float
) -> tuple[str | None, float]:
    """The one rule for a response body after its head: it fails when vLLM has been silent
    for the idle timeout since `since` while the sidecar was `waiting` on it, or at `ends_by`
    (a response that is not a stream: the response deadline after its head). (why it failed
    or None, when to check next)."""
    if now >= ends_by:
        return f"vLLM's response did not end within {settings.response_deadline:g} s", now
    idle = settings.stream_idle_timeout
    if not waiting:
        return None, min(now + idle, ends_by)
    if now - since >= idle:
        return f"vLLM sent nothing for {idle:g} s", now
    return None, min(since + idle, ends_by)


def body_wait(settings: Settings, started: float, last: float) -> float:
    """When reading a request body gives up: a silence of the body timeout since its `last`
    bytes, or the body deadline after its head."""
    return min(last + settings.body_timeout, started + settings.body_deadline)


def body_late(settings: Settings, started: float, last: float) -> Refused:
    """The 408 of a request body not read in time (body_wait)."""
    if started + settings.body_deadline <= last + settings.body_timeout:
        return Refused(408, f"request body not received within {settings.body_deadline:g} s")
    return Refused(408, f"request body stalled for {settings.body_timeout:g} s")
