"""The OpenAI pass-through: forward vLLM's OpenAI routes, classify what comes back.

Written as a bare ASGI app on aiohttp's client (and upstream.py's direct client for
chat and completions), not FastAPI routes: every SSE chunk passes through here, and
per-chunk overhead is the product. Under the sidecar's own httptools protocol the plain
chat and completion requests skip ASGI altogether (fast.py's FastExchange, a subclass of
Exchange here); everything below is shared by both paths. Bytes go
out as they arrive and unchanged (complete SSE events per upstream read, never
the whole response); status, headers and bodies are vLLM's own, less the
hop-by-hop headers a proxy must not pass on and vLLM's Date (the sidecar dates its
responses itself: one Date field, as nginx does).

Only the routes in `routes.OPENAI_ROUTES` (plus `--extra-routes`) are forwarded,
checked on the normalized path; everything else is a 404 here.

The runaway guard (loops.py), when on, sees every chunk of a classified response; in
stop mode it ends a stream whose text loops (closing the upstream connection, so vLLM
aborts the request) with its own final events.

Classification needs the final usage of a stream. When a client streams without
asking for `stream_options.include_usage`, the request is sent with it (spliced
into the client's bytes, not re-serialized) and the usage-only chunk is dropped
on the way back, so the client sees what it asked for.

Memory: a request body is read up to `max_body_bytes`, and all bodies being read
at once share `max_inflight_body_bytes`. A classified body is parsed only when its
count of JSON values is under `max_json_values` (the parsed tree's size is bounded
by it), one at a time on the event loop, and dropped once its three fields are read.
A stream event is buffered up to `max_event_bytes`; a bigger one is forwarded unparsed.

Faults: vLLM unreachable → 503; no response headers within the timeout → 504;
a broken upstream before headers → 502; a body that stalls longer than the idle
timeout, or is cut short, after the headers: an error event ends an SSE stream,
any other body is aborted (the client sees a broken connection, never a clean
but short end). A client that disconnects cancels the upstream request, so vLLM
aborts it and frees the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge
from yarl import URL

from mla_serve.sidecar.guard.loops import LoopGuard, ResponseGuard
from mla_serve.sidecar.passthrough import sse, upstream
from mla_serve.sidecar.passthrough.routes import OPENAI_ROUTES, Routes, normalize
from mla_serve.sidecar.passthrough.runaways import Choice, Completion, Ledger

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("mla_serve.sidecar")

CLASSIFIED = ("/v1/chat/completions", "/v1/completions")
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
# vLLM's Date is not returned: the sidecar's server dates every response it sends (uvicorn's
# Date header, from the same clock as vLLM's in the pod), and HTTP allows one Date field
# (RFC 9110 section 6.6.1); nginx drops the upstream's Date the same way.
NOT_RETURNED = HOP_BY_HOP | {b"content-length", b"date"}
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ProxySettings:
    upstream: str
    connect_timeout: float = 5.0
    response_timeout: float = 600.0  # until vLLM's response headers
    idle_timeout: float = 300.0  # between two reads of any response body
    body_timeout: float = 60.0  # longest gap while reading the client's request body
    body_deadline: float = 300.0  # the whole request body, after its head
    response_deadline: float = 300.0  # a response body that is not a stream, after its head
    max_body_bytes: int = 16 * 1024 * 1024
    max_inflight_body_bytes: int = 64 * 1024 * 1024
    max_json_values: int = 1_000_000
    max_event_bytes: int = 4 * 1024 * 1024
    max_headers: int = 100
    # "direct": chat/completions on upstream.py's client (needs httptools and a plain
    # http:// URL without a path); "aiohttp": everything on aiohttp's client.
    upstream_client: str = "aiohttp"
    lane: bool | None = None  # the direct client's reads of token chunks in C (None: when built)
    routes: tuple[str, ...] = OPENAI_ROUTES
    trusted_proxies: tuple[Network, ...] = ()
    http10_max_response_bytes: int = 16 * 1024 * 1024


def upstream_client(choice: str, url: str) -> str:
    """The client `--upstream-client` (auto, direct, aiohttp) gives for vLLM's URL: direct
    when it can serve it; ValueError when `direct` is asked for and cannot."""
    usable = upstream.AVAILABLE and _plain_http(url)
    if choice == "direct" and not usable:
        raise ValueError(
            "--upstream-client direct needs httptools and a plain http:// --vllm-url without a path"
        )
    if choice == "auto":
        return "direct" if usable else "aiohttp"
    return choice


def _plain_http(url: str) -> bool:
    parts = URL(url)
    return parts.scheme == "http" and parts.path in ("", "/") and not parts.query_string


class ClientGone(Exception):
    """The client disconnected; the upstream request is cancelled."""


class Aborted(Exception):
    """The response was already started and cannot be finished: drop the connection."""


class Refused(Exception):
    """A request answered here, before vLLM: status, message, error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error document, as vLLM itself returns them."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


class ByteBudget:
    """Bytes of request bodies held at once, over all requests."""

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


class ProxyMetrics:
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


@dataclass
class Request:
    """What the pass-through needs from a classified request; the parsed tree is not kept."""

    stream: bool = False
    model: str | None = None
    strip_usage: bool = False
    guard: ResponseGuard | None = None  # the runaway guard's watch on the response
    body: list[bytes] = field(default_factory=list)  # cleared once sent
    held: int = 0  # bytes of the in-flight body budget it holds


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        ledger: Ledger,
        loops: LoopGuard | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.loops = loops  # the runaway guard (loops.py); None: no loop detection
        self.routes = Routes(settings.routes)
        self.budget = ByteBudget(settings.max_inflight_body_bytes)
        self.metrics = ProxyMetrics(
            registry if registry is not None else CollectorRegistry(), self.budget
        )
        self._session: aiohttp.ClientSession | None = None
        self.pool: upstream.Pool | None = None  # the chat/completions client (upstream.py)

    async def start(self) -> None:
        if self.settings.upstream_client == "direct":
            self.pool = upstream.Pool(
                self.settings.upstream, self.settings.connect_timeout, lane=self.settings.lane
            )
        self._session = aiohttp.ClientSession(
            base_url=self.settings.upstream,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        """The one connection pool to vLLM, shared with the monitor and the canary: their
        requests keep a connection warm for the first client request."""
        assert self._session is not None, "start() first"
        return self._session

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._session is not None:
            await self._session.close()

    def route(self, scope: Scope) -> str | None:
        """The normalized path if the pass-through serves it, else None."""
        path = normalize(scope["path"])
        return path if path is not None and self.routes.allows(path) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = self.route(scope)
        if path is None:
            await self.refuse(send, Refused(404, "no such route", "not_found_error"))
            return
        collector = None
        if scope.get("http_version") == "1.0":
            limit = self.settings.http10_max_response_bytes
            send = collector = Http10Sender(send, limit, self.budget)
        try:
            with contextlib.suppress(ClientGone):  # nothing to answer, nobody to answer to
                try:
                    await self._handle(scope, path, receive, send)
                except Refused as refused:
                    await self.refuse(send, refused)
        finally:
            if collector is not None:
                collector.release()

    async def refuse(self, send: Send, refused: Refused) -> None:
        self.metrics.refused.labels(str(refused.status)).inc()
        body = error_body(refused.status, str(refused), refused.kind)
        await _respond(send, refused.status, body)

    async def _handle(self, scope: Scope, path: str, receive: Receive, send: Send) -> None:
        if len(scope["headers"]) > self.settings.max_headers:
            raise Refused(431, f"more than {self.settings.max_headers} request headers")
        request = Request()
        try:
            await self._read_body(scope, receive, request)
            classify = scope["method"] == "POST" and path in CLASSIFIED
            if classify:
                inspect(request, self.settings.max_json_values, self.loops, path)
            exchange = self._exchange(scope, path, request, send, classify)
            await _cancel_on_disconnect(exchange, receive, send)
        finally:
            self._release(request)

    def _release(self, request: Request) -> None:
        """Drop the body and give its bytes back to the budget (once)."""
        request.body.clear()
        self.budget.give(request.held)
        request.held = 0

    async def _read_body(self, scope: Scope, receive: Receive, request: Request) -> None:
        limit = self.settings.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise Refused(413, f"request body over {limit} bytes")
        loop = asyncio.get_running_loop()
        started = last = loop.time()
        try:
            async with asyncio.timeout(None) as guard:
                while True:
                    guard.reschedule(body_wait(self.settings, started, last))
                    message = await receive()
                    last = loop.time()
                    if message["type"] == "http.disconnect":
                        raise ClientGone
                    chunk = message.get("body", b"")
                    if request.held + len(chunk) > limit:
                        raise Refused(413, f"request body over {limit} bytes")
                    if not self.budget.take(len(chunk)):
                        raise Refused(
                            503, "the sidecar is at its in-flight request body limit; retry",
                            "server_busy",
                        )  # fmt: skip
                    request.held += len(chunk)
                    if chunk:
                        request.body.append(chunk)
                    if not message.get("more_body"):
                        break
        except TimeoutError:
            raise body_late(self.settings, started, last) from None
        if len(request.body) > 1:
            request.body[:] = [b"".join(request.body)]

    async def _exchange(
        self, scope: Scope, path: str, request: Request, send: Send, classify: bool
    ) -> None:
        if classify and self.pool is not None:
            await self._exchange_direct(scope, path, request, send)
            return
        try:
            response = await self._request(scope, path, request, send)
        finally:
            self._release(request)  # vLLM has the body
        if response is None:
            return
        async with response:
            streamed = response.content_type == "text/event-stream"
            if classify and streamed:
                await self._stream(response, send, request)
            else:
                await self._relay(response, send, request if classify else None)

    async def _request(
        self, scope: Scope, path: str, request: Request, send: Send
    ) -> aiohttp.ClientResponse | None:
        assert self._session is not None
        query = scope["query_string"].decode("latin-1")
        url = URL.build(path=path, query_string=query, encoded=True)  # as the client sent it
        try:
            async with asyncio.timeout(self.settings.response_timeout):
                return await self._session.request(
                    scope["method"],
                    url,
                    data=request.body[0] if request.body else b"",
                    headers=self._forward_headers(scope),
                    allow_redirects=False,
                )
        except TimeoutError:
            message = f"vLLM sent no response within {self.settings.response_timeout:g} s"
            await _respond(send, 504, error_body(504, message, "upstream_timeout"))
        except aiohttp.ClientConnectorError as error:
            message = f"vLLM is not reachable at {self.settings.upstream}: {error.os_error}"
            await _respond(send, 503, error_body(503, message, "upstream_unavailable"))
        except aiohttp.ClientError as error:
            message = f"vLLM failed before responding: {type(error).__name__}: {error}"
            await _respond(send, 502, error_body(502, message, "upstream_error"))
        return None

    def _forward_headers(self, scope: Scope) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._forwarded(scope)]

    def _forwarded(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The request headers vLLM gets: the client's less hop-by-hop ones, and
        X-Forwarded-For/-Proto as this sidecar vouches for them."""
        named = _connection_tokens(scope["headers"])
        headers: list[tuple[bytes, bytes]] = []
        forwarded_for: list[bytes] = []
        proto: bytes | None = None
        for key, value in scope["headers"]:
            name = key.lower()
            if name == b"x-forwarded-for":
                forwarded_for.append(value)
            elif name == b"x-forwarded-proto":
                proto = value
            elif name not in NOT_FORWARDED and name not in named and not name.startswith(b"proxy-"):
                headers.append((name, value))
        peer = (scope.get("client") or ("", 0))[0]
        trusted = bool(peer) and self._trusts(peer)
        if peer:
            if forwarded_for and trusted:
                forwarded_for.append(peer.encode("latin-1"))
            else:
                forwarded_for = [peer.encode("latin-1")]
            headers.append((b"x-forwarded-for", b", ".join(forwarded_for)))
        scheme = scope["scheme"].encode("latin-1")
        headers.append((b"x-forwarded-proto", proto if proto and trusted else scheme))
        return headers

    def _request_bytes(self, scope: Scope, path: str, body: bytes) -> bytes:
        """The request as written to vLLM by the direct client (upstream.py)."""
        assert self.pool is not None
        query = scope["query_string"]
        target = path.encode("latin-1") + (b"?" + query if query else b"")
        parts = [scope["method"].encode("latin-1"), b" ", target, b" HTTP/1.1\r\nhost: ",
                 self.pool.authority, b"\r\n"]  # fmt: skip
        for name, value in self._forwarded(scope):
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % len(body))
        parts.append(body)
        return b"".join(parts)

    async def _exchange_direct(self, scope: Scope, path: str, request: Request, send: Send) -> None:
        """A classified request on the direct client: the response is relayed and classified
        from the upstream connection's callbacks (Exchange); this task sends the head, waits,
        and sends what the callbacks could not write themselves."""
        assert self.pool is not None
        payload = self._request_bytes(scope, path, request.body[0] if request.body else b"")
        request.body.clear()  # the bytes are in `payload`; the budget is given back once sent
        exchange = Exchange(self, request, send)
        try:
            await exchange.run(payload)
        finally:
            exchange.close()
            self._release(request)

    def _trusts(self, peer: str) -> bool:
        if not self.settings.trusted_proxies:  # the default: no address to parse
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in network for network in self.settings.trusted_proxies)

    async def _relay(
        self, response: aiohttp.ClientResponse, send: Send, request: Request | None
    ) -> None:
        """Any body but a classified stream, as it comes; a classified 200 is kept to count."""
        keep = request is not None and response.status == 200
        kept: list[bytes] = []
        size = 0
        ends_by = math.inf
        if response.content_type != "text/event-stream":
            ends_by = asyncio.get_running_loop().time() + self.settings.response_deadline
        await _start(send, response, keep_length=True)

        async def each(data: bytes) -> None:
            nonlocal size, keep
            if keep:
                size += len(data)
                if size <= self.settings.max_event_bytes and self.budget.take(len(data)):
                    kept.append(data)
                else:  # too big, or no room now: relayed, not classified
                    keep = False
                    self._forget(kept)
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            try:
                await _pump(response, self.settings, ends_by, each)
            except (aiohttp.ClientError, TimeoutError) as error:
                self.metrics.truncated.inc()
                why = _why(error)
                raise Aborted(f"vLLM's response broke off after its headers: {why}") from None
            await send({"type": "http.response.body", "body": b""})
            if request is None or response.status != 200:
                return
            self._classify_body(kept if keep else None, request)
        finally:
            self._forget(kept)  # the budget back, whatever happened

    async def _stream(self, response: aiohttp.ClientResponse, send: Send, request: Request) -> None:
        await _start(send, response)
        completion = Completion()
        splitter = sse.Splitter(self.settings.max_event_bytes, self.budget.take, self.budget.give)
        done = False
        failure: str | None = None
        strip = request.strip_usage
        loop_guard = request.guard

        one, pieces = self._one, splitter.pieces
        # The read loop is written out here, not handed a callback as in _relay: one
        # coroutine less per chunk on the hottest path.
        guard = _IdleGuard(self.settings, math.inf)
        content, clock = response.content, guard.loop.time
        try:
            while True:
                guard.since = clock()
                guard.waiting = True
                data = await content.readany()
                guard.waiting = False
                if not data:
                    break
                if not pieces and not splitter.skipping and _one_event(data):
                    out = one(data, completion, strip, loop_guard)
                else:
                    out, events, after = splitter.feed(data)
                    if events:
                        observed, finished = self._observe(events, completion, strip, loop_guard)
                        out += observed
                        done = done or finished
                    if loop_guard is None or not loop_guard.stopped:
                        out += after
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if loop_guard is not None and loop_guard.stopped:
                    break
        except asyncio.CancelledError:
            if not guard.timed_out():
                splitter.rest()  # gives its bytes back to the budget
                raise
            failure = guard.failure
        except aiohttp.ClientError as error:
            failure = f"vLLM broke off the stream: {_why(error)}"
        except BaseException:
            splitter.rest()
            raise
        finally:
            guard.handle.cancel()
        if splitter.oversized:
            self.metrics.unparsed.inc(splitter.oversized)
        tail = splitter.rest()
        if loop_guard is not None and loop_guard.stopped:
            # The loop guard ends it: closing the connection makes vLLM abort the request
            # and free its KV cache; the client gets a clean end instead of the rest.
            response.close()
            tail, failure = loop_guard.ending(include_usage=not strip), None
        elif failure is None and not done:
            failure = "vLLM ended the stream without [DONE]"
        await self._end_stream(send, tail, failure, completion, loop_guard, request.model)

    async def _end_stream(
        self,
        send: Send,
        tail: bytes,
        failure: str | None,
        completion: Completion,
        guard: ResponseGuard | None,
        model: str | None,
    ) -> None:
        """The last bytes of a classified stream, with an error event after them when vLLM
        broke it off (`failure`); then the completion settled and counted."""
        await send({"type": "http.response.body", "body": self._last_events(tail, failure)})
        self._settle(completion, guard, model)

    def _last_events(self, tail: bytes, failure: str | None) -> bytes:
        """A stream's last bytes, with an error event after them when it broke off."""
        if failure is not None:
            self.metrics.truncated.inc()
            if tail and not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
                tail += b"\n\n"  # end the partial event, or the error event would join it
            tail += _error_event(failure)
        return tail

    def _settle(
        self, completion: Completion, guard: ResponseGuard | None, model: str | None
    ) -> None:
        """A finished stream: the loop guard's verdict, the completion counted."""
        if guard is not None:
            guard.settle(completion)
        self.ledger.record(completion, model)

    def _classify_body(self, kept: list[bytes] | None, request: Request) -> None:
        """A whole (not streamed) completion: classified and counted, or counted as unparsed
        (`kept` None: the body was too large to keep)."""
        completion = Completion()
        try:
            if kept is None:
                raise ValueError("not kept to classify")
            document = json.loads(b"".join(kept))
            if not isinstance(document, dict):
                raise ValueError("not an object")
            completion.add_body(document)
            if request.guard is not None:
                request.guard.add_body(document)
                request.guard.settle(completion)
        except (ValueError, TypeError, AttributeError, RecursionError):
            self.metrics.unparsed.inc()
            return
        del document
        self.ledger.record(completion, request.model)

    def _forget(self, kept: list[bytes]) -> None:
        self.budget.give(sum(len(piece) for piece in kept))
        kept.clear()

    def _observe(
        self,
        events: bytes,
        completion: Completion,
        strip_usage: bool,
        loop_guard: ResponseGuard | None = None,
    ) -> tuple[bytes, bool]:
        """Feed complete SSE events to the classifier; return the bytes to forward, and
        whether `[DONE]` was among them. When the loop guard stops the stream, nothing after
        the chunk that confirmed the loop is forwarded."""
        if _one_event(events):  # no splitting, no list
            return self._one(events, completion, strip_usage, loop_guard), False
        dropped = False
        done = False
        kept: list[bytes] = []
        for raw, event in sse.split_events(events):
            data = sse.data_of(event)
            if data is None:
                kept.append(raw)
                continue
            if data == b"[DONE]":
                done = True
                kept.append(raw)
                continue
            try:
                chunk = _loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError("not an object")
                completion.add_chunk(chunk)
            except (ValueError, TypeError, AttributeError, RecursionError):
                self.metrics.unparsed.inc()
                kept.append(raw)
                continue
            if loop_guard is not None and loop_guard.add_chunk(chunk):
                kept.append(raw)
                return b"".join(kept), done
            if strip_usage and not chunk.get("choices") and chunk.get("usage"):
                dropped = True
                continue
            kept.append(raw)
        return (b"".join(kept) if dropped else events), done

    def _one(
        self,
        event: bytes,
        completion: Completion,
        strip_usage: bool,
        loop_guard: ResponseGuard | None = None,
    ) -> bytes:
        """One `data: {...}\\n\\n` event: classify it; return it, or nothing if dropped."""
        try:
            chunk = _loads(event[6:])
            if not isinstance(chunk, dict):
                raise ValueError("not an object")
            completion.add_chunk(chunk)
        except (ValueError, TypeError, AttributeError, RecursionError):
            self.metrics.unparsed.inc()
            return event
        if loop_guard is not None and loop_guard.add_chunk(chunk):
            return event
        if strip_usage and not chunk.get("choices") and chunk.get("usage"):
            return b""
        return event


class Exchange:
    """One classified request through the direct client (upstream.py).

    The upstream connection's callbacks (`head`, `body`, `end`, `lost`) do the work: a
    stream's reads are classified as they are parsed and written to the client from the
    same callback, with the chunked framing uvicorn's httptools protocol would give them,
    straight onto its transport: no task switch, no ASGI message per chunk. That needs the
    client's side to be uvicorn's httptools cycle (the sidecar's server), writable, and
    the head already sent; otherwise (h11, HTTP/1.0, a client that reads slower than vLLM
    writes) the bytes wait in `pending` and this request's task sends them through ASGI,
    with vLLM's connection paused while more than `HIGH_WATER` bytes wait. The task sends
    the head and the end, and answers the errors before a head."""

    HIGH_WATER = 64 * 1024

    def __init__(
        self,
        proxy: Proxy,
        request: Request,
        send: Send,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.proxy = proxy
        self.settings = proxy.settings
        self.request = request
        self.send = send
        self.loop = loop or asyncio.get_running_loop()
        self.conn: upstream.Connection | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: upstream.Headers = []
        self.streamed = False
        self.started = False  # the head went to the client
        self.complete = False  # vLLM's response ended as HTTP says it must
        self.broken: str | None = None  # why vLLM's response broke off
        self.retryable = False
        self.idle_failure: str | None = None
        self.finished = False  # nothing more is taken from vLLM
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.batch: list[bytes] = []  # this read's output, direct mode
        self.direct: Any = None  # uvicorn's httptools cycle, once the head of a stream is out
        self.writes = 0  # chunks written straight to the client's transport
        self.idle_handle: asyncio.TimerHandle | None = None
        self.ends_by = math.inf  # a response that is not a stream: response_deadline after its head
        # streams
        self.completion = Completion()
        self.splitter: sse.Splitter | None = None
        self.head_bytes: bytes | None = None  # what this stream's token chunks start with
        self.done = False
        # other bodies of a classified request, kept to classify a 200
        self.keep = False
        self.kept: list[bytes] = []
        self.kept_size = 0

    # -- the upstream connection's callbacks ----------------------------------------------
    def head(self, status: int, headers: upstream.Headers) -> None:
        self.status = status
        self.headers = headers
        self.streamed = _media_type(headers) == b"text/event-stream"
        if self.streamed:
            proxy = self.proxy
            self.splitter = sse.Splitter(
                self.settings.max_event_bytes, proxy.budget.take, proxy.budget.give
            )
        else:
            self.keep = status == 200
            self.ends_by = self.loop.time() + self.settings.response_deadline
        self._wake()

    def body(self, data: bytes) -> None:
        if self.finished:
            return
        head = self.head_bytes
        if head is not None and data.startswith(head) and not self.splitter.pieces:  # type: ignore[union-attr]
            stopped = token_chunk(data, head, self.completion, self.request.guard)
            if stopped is not None:
                self._emit(data)
                if stopped:
                    self._finish(None)
                return
        try:
            out = self._stream_body(data) if self.streamed else self._keep_body(data)
        except Exception as error:  # a bug must end this response, not the connection's loop
            log.exception("classifying a response failed")
            self._finish(f"the sidecar failed on vLLM's response: {_why(error)}")
            return
        if out:
            self._emit(out)
        guard = self.request.guard
        if guard is not None and guard.stopped:
            self._finish(None)

    def end(self) -> None:
        self.complete = True
        self.finished = True
        if self.conn is not None:
            self.conn.release()
            self.conn = None
        self._wake()

    def may_arm(self, conn: upstream.Connection) -> None:
        pass  # the lane writes to the client's transport: the fast path's exchanges only

    def lost(self, why: str, retryable: bool) -> None:
        self.broken = why
        self.retryable = retryable
        self.finished = True
        self.conn = None
        self._wake()

    # -- classification, from the callbacks -------------------------------------------------
    def _stream_body(self, data: bytes) -> bytes:
        splitter = self.splitter
        assert splitter is not None
        request = self.request
        guard = request.guard
        if not splitter.pieces and not splitter.skipping and _one_event(data):
            if self.head_bytes is None:
                self.head_bytes = stream_head(data)
            return self.proxy._one(data, self.completion, request.strip_usage, guard)
        out, events, after = splitter.feed(data)
        if events:
            observed, finished = self.proxy._observe(
                events, self.completion, request.strip_usage, guard
            )
            out += observed
            self.done = self.done or finished
        if guard is None or not guard.stopped:
            out += after
        return out

    def _keep_body(self, data: bytes) -> bytes:
        if self.keep:
            self.kept_size += len(data)
            proxy = self.proxy
            if self.kept_size <= self.settings.max_event_bytes and proxy.budget.take(len(data)):
                self.kept.append(data)
            else:  # too big, or no room now: relayed, not classified
                self.keep = False
                proxy._forget(self.kept)
        return data

    def _emit(self, out: bytes) -> None:
        if self.direct is not None:
            self.batch.append(out)  # written by fed(), once per read of vLLM's socket
            return
        self._queue(out)

    def fed(self) -> None:
        """After one read of vLLM's socket: what it gave, in one write to the client."""
        if not self.batch:
            return
        out = self.batch[0] if len(self.batch) == 1 else b"".join(self.batch)
        self.batch.clear()
        if self.complete:  # vLLM's response ended in this read: one write with the end (_stream)
            self._queue(out)
            return
        cycle = self.direct
        if not self.pending and not cycle.flow.write_paused and not cycle.disconnected:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(out), out))
            self.writes += 1
            return
        self._queue(out)

    def _queue(self, out: bytes) -> None:
        self.pending.append(out)
        self.pending_size += len(out)
        if self.pending_size > self.HIGH_WATER and self.conn is not None:
            self.conn.pause()
        self._wake()

    def _finish(self, failure: str | None) -> None:
        """Take nothing more from vLLM: drop its connection (vLLM aborts the request)."""
        self.finished = True
        if failure is not None and self.broken is None:
            self.broken = failure
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def _first_check(self) -> float:
        """When `_idle_check` first runs after vLLM's head."""
        return min(self.loop.time() + self.settings.idle_timeout, self.ends_by)

    def _idle_check(self) -> None:
        """One timer per response (response_check's rule): ends the body when vLLM has been
        silent for the idle timeout while the sidecar was waiting on it (not while paused),
        or a response that is not a stream is not over by its deadline."""
        self.idle_handle = None
        conn = self.conn
        if self.finished or conn is None:
            return
        failure, when = response_check(
            self.settings, conn.last_read, not conn.paused, self.ends_by, self.loop.time()
        )
        if failure is not None:
            self.idle_failure = failure
            self._finish(failure)
            return
        self.idle_handle = self.loop.call_at(when, self._idle_check)

    # -- the request's task -----------------------------------------------------------------
    async def run(self, payload: bytes) -> None:
        if not await self._request(payload):
            return
        if self.streamed:
            await self._stream()
        else:
            await self._relay()

    async def _request(self, payload: bytes) -> bool:
        """Send the request and wait for the head; answer the client and return False when
        there is none."""
        proxy, settings = self.proxy, self.settings
        assert proxy.pool is not None
        deadline = self.loop.time() + settings.response_timeout
        message: str | None = None
        for _ in range(2):
            self.broken, self.retryable, self.finished = None, False, False
            try:
                async with asyncio.timeout_at(deadline):
                    conn = await proxy.pool.get()
                    self.conn = conn
                    conn.request(payload, self)
                    proxy._release(self.request)  # written: its budget back (once)
                    while not self.status and not self.finished:
                        await self._wait()
            except TimeoutError:
                if self.conn is None:  # connecting timed out
                    message = f"vLLM is not reachable at {settings.upstream}: connect timeout"
                    await _respond(self.send, 503, error_body(503, message, "upstream_unavailable"))
                    return False
                message = f"vLLM sent no response within {settings.response_timeout:g} s"
                await _respond(self.send, 504, error_body(504, message, "upstream_timeout"))
                return False
            except OSError as error:
                message = f"vLLM is not reachable at {settings.upstream}: {error}"
                await _respond(self.send, 503, error_body(503, message, "upstream_unavailable"))
                return False
            if self.status:
                self.idle_handle = self.loop.call_at(self._first_check(), self._idle_check)
                return True
            if not self.retryable:
                break
        message = f"vLLM failed before responding: {self.broken}"
        await _respond(self.send, 502, error_body(502, message, "upstream_error"))
        return False

    async def _head(self, keep_length: bool) -> None:
        headers = returned_headers(self.headers, keep_length)
        await self.send({"type": "http.response.start", "status": self.status, "headers": headers})
        self.started = True
        cycle = _direct_cycle(self.send) if self.streamed else None
        if cycle is not None and cycle.chunked_encoding is True:
            self.direct = cycle

    async def _flush(self) -> None:
        """Send what waits in `pending` through ASGI, then let vLLM's bytes in again."""
        while self.pending:
            out = b"".join(self.pending)
            self.pending.clear()
            self.pending_size = 0
            await self.send({"type": "http.response.body", "body": out, "more_body": True})
        if self.conn is not None:
            self.conn.resume()

    async def _stream(self) -> None:
        proxy, request = self.proxy, self.request
        splitter = self.splitter
        assert splitter is not None
        try:
            await self._head(keep_length=False)
            while not self.finished:
                await self._flush()
                if not self.finished:
                    await self._wait()
        except BaseException:
            splitter.rest()  # gives its bytes back to the budget
            raise
        # What waits (the last read's events, [DONE] among them) goes out with the end of
        # the response: one write where the loop above would make two.
        held = b"".join(self.pending)
        self.pending.clear()
        self.pending_size = 0
        tail, failure = self._last_bytes(held)
        await proxy._end_stream(
            self.send, tail, failure, self.completion, request.guard, request.model
        )

    def _last_bytes(self, held: bytes) -> tuple[bytes, str | None]:
        """After vLLM's stream ended (or was ended): what the client still gets after
        `held`, and why the stream failed, if it did."""
        splitter, request = self.splitter, self.request
        assert splitter is not None
        if splitter.oversized:
            self.proxy.metrics.unparsed.inc(splitter.oversized)
        tail = held + splitter.rest()
        guard = request.guard
        if guard is not None and guard.stopped:
            # The loop guard ended it (_finish closed vLLM's connection, so vLLM aborts the
            # request and frees its KV cache); the client gets a clean end instead of the rest.
            return held + guard.ending(include_usage=not request.strip_usage), None
        if self.idle_failure is not None:
            return tail, self.idle_failure
        if self.broken is not None:
            return tail, f"vLLM broke off the stream: {self.broken}"
        if not self.done:
            return tail, "vLLM ended the stream without [DONE]"
        return tail, None

    async def _relay(self) -> None:
        proxy, request = self.proxy, self.request
        try:
            await self._head(keep_length=True)
            while True:
                await self._flush()
                if self.finished:
                    break
                await self._wait()
            if not self.complete:
                proxy.metrics.truncated.inc()
                why = self.idle_failure or self.broken
                raise Aborted(f"vLLM's response broke off after its headers: {why}")
            await self.send({"type": "http.response.body", "body": b""})
            if self.status != 200:
                return
            proxy._classify_body(self.kept if self.keep else None, request)
        finally:
            proxy._forget(self.kept)

    def close(self) -> None:
        """Whatever happened (the client gone, an error): vLLM's connection dropped unless
        its response ended, the timers stopped, held bytes given back."""
        self.finished = True
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        if self.splitter is not None:
            self.splitter.rest()
        self.proxy._forget(self.kept)
        self.pending.clear()


def _media_type(headers: upstream.Headers) -> bytes:
    """The Content-Type's media type, lowercased, as aiohttp's `content_type` gives it."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.partition(b";")[0].strip().lower()
    return b"application/octet-stream"


def _direct_cycle(send: Send) -> Any:
    """uvicorn's httptools request cycle behind `send`, when that is what it is: its
    transport can be written to directly. None for anything else (h11, wrappers)."""
    cycle = getattr(send, "__self__", None)
    if _HTTPTOOLS_CYCLE is None or type(cycle) is not _HTTPTOOLS_CYCLE:
        return None
    return cycle


def _httptools_cycle() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    except ImportError:
        return None
    needed = ("transport", "flow", "disconnected")
    probe = RequestResponseCycle.__init__.__code__.co_names
    return RequestResponseCycle if all(name in probe for name in needed) else None


_HTTPTOOLS_CYCLE = _httptools_cycle()


# vLLM's token chunk, the bulk of every stream, read without parsing it whole. `_HEAD` is
# what all of one stream's token chunks start with (id, object, created, model, the first
# choice's index and delta): learnt from the first chunk of the stream that has it, then
# compared byte for byte. `_TOKEN` is the rest, matched to the end of the event: one
# `content` or `reasoning` string (JSON's string grammar, so the match ends where the string
# does) and null logprobs and finish_reason, nothing else. A chunk that does not match both
# exactly is parsed whole, as every chunk was before.
_STRING = rb'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*'
_HEAD = re.compile(
    rb'data: \{"id":"[^"\\\x00-\x1f]*","object":"chat\.completion\.chunk",'
    rb'"created":(?:0|[1-9][0-9]*),"model":"[^"\\\x00-\x1f]*","choices":\[\{"index":0,'
    rb'"delta":\{"'
)
_TOKEN = re.compile(
    rb'(content|reasoning)":"(' + _STRING + rb')"\},"logprobs":null,"finish_reason":null'
    rb'(?:,"token_ids":null)?\}\](?:,"kv_transfer_params":null)?\}\n\n'
)
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def stream_head(event: bytes) -> bytes | None:
    """The bytes every token chunk of this event's stream starts with, when it has them."""
    found = _HEAD.match(event)
    return found.group(0) if found is not None else None


def token_chunk(
    event: bytes, head: bytes, completion: Completion, guard: ResponseGuard | None
) -> bool | None:
    """Classify `event` as `Proxy._one` would if it is a token chunk of the stream whose
    head is `head` and the stream's id and model are known (its first chunk was parsed):
    True/False, whether the loop guard stops the stream now; None when it is not one (then
    parse it whole). Choice 0 gets visible content or the loop guard's text, as add_chunk
    would give them: the string is decoded as json.loads decodes it."""
    if completion.id is None or completion.model is None or (guard is not None and not guard.head):
        return None
    found = _TOKEN.fullmatch(event, len(head))
    if found is None:
        return None
    raw = found.group(2)
    try:
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None
    if b"\\" in raw:
        text = _scanstring(text + '"', 0)[0]
    choice = completion.choices.get(0)
    if choice is None:
        choice = completion.choices[0] = Choice()
    content = found.group(1) == b"content"
    if content and not choice.visible and text.strip():
        choice.visible = True
    if guard is None:
        return False
    return guard.add_token(0, "content" if content else "reasoning", text)


# The scanner json.loads ends in (C, when _json is built), made for json's default decoder.
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(data: bytes) -> Any:
    """`json.loads(data)` for one event's data, without its per-call steps in Python
    (encoding detection, two whitespace regexes, three frames): an object in UTF-8, which is
    what vLLM sends, is decoded as json.loads decodes it and scanned by the same scanner.
    Anything else (another encoding, leading whitespace) goes through json.loads itself, so
    the result and the errors (ValueError, RecursionError) are json.loads's."""
    if data[:1] != b"{" or data[1:2] == b"\x00":  # json.detect_encoding's UTF-16/32 cases
        return json.loads(data)
    text = data.decode("utf-8", "surrogatepass")
    try:
        value, end = _SCAN(text, 0)
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    if end != len(text):
        rest = text[end:].lstrip(" \t\n\r")
        if rest:
            raise json.JSONDecodeError("Extra data", text, len(text) - len(rest))
    return value


def inspect(
    request: Request, max_values: int, loops: LoopGuard | None = None, path: str = ""
) -> None:
    """Check a classified request the way vLLM's protocol would, keep the three fields the
    pass-through needs, and add `stream_options.include_usage` to a stream without it. With
    the runaway guard on: its vLLM-side defaults are set on the request (which is then
    re-encoded) and its watch on the response is made."""
    body = request.body[0] if request.body else b""
    values = body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
    if values > max_values:
        raise Refused(413, f"request body has too many JSON values ({values} > {max_values})")
    try:
        document = json.loads(body)
    except RecursionError:
        raise Refused(400, "malformed JSON body: nested too deeply") from None
    except ValueError as error:
        raise Refused(400, f"malformed JSON body: {error}") from None
    if not isinstance(document, dict):
        raise Refused(400, "malformed JSON body: the body must be a JSON object")
    stream = document.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise Refused(400, "'stream' must be a boolean")
    options = document.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Refused(400, "'stream_options' must be an object")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise Refused(400, "'stream_options.include_usage' must be a boolean")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise Refused(400, "'model' must be a string")
    if loops is not None:
        request.guard = loops.watch(document, path)
        if loops.prepare(document):
            body = json.dumps(document).encode()
    del document
    request.stream = bool(stream)
    request.model = model
    if request.stream and not usage:
        body = _with_usage(body, options)
        request.strip_usage = True
    request.body[:] = [body]


def _with_usage(body: bytes, options: dict[str, Any] | None) -> bytes:
    """The body with `"stream_options": {..., "include_usage": true}` as its last member.

    JSON parsers keep the last of duplicate keys (Python's, so vLLM's), so appending keeps
    every byte the client sent and wins over its own `stream_options`."""
    member = json.dumps({**(options or {}), "include_usage": True}, separators=(",", ":"))
    end = len(body.rstrip(b" \t\r\n"))
    if end == 0 or body[end - 1 : end] != b"}":  # another encoding (UTF-16/32): rebuild
        document = json.loads(body)
        document["stream_options"] = json.loads(member)
        return json.dumps(document).encode()
    inner = body[: end - 1].rstrip(b" \t\r\n")
    comma = b"" if inner.endswith(b"{") else b","
    return inner + comma + b'"stream_options":' + member.encode() + body[end - 1 :]


def _one_event(data: bytes) -> bool:
    """vLLM's shape: one whole `data: {...}` event of one line, LF-terminated, in one read."""
    return (
        data.startswith(b"data: {")
        and data.find(b"\n") == len(data) - 2
        and data.endswith(b"\n\n")
        and b"\r" not in data
    )


async def _pump(
    response: aiohttp.ClientResponse,
    settings: ProxySettings,
    ends_by: float,
    each: Callable[[bytes], Awaitable[None]],
) -> None:
    """Hand each read of the body to `each`; TimeoutError when vLLM is silent for the idle
    timeout (the clock runs only while waiting on vLLM, not while the client is being
    written to), or the body is not over by `ends_by`."""
    guard = _IdleGuard(settings, ends_by)
    content = response.content
    clock = guard.loop.time
    try:
        while True:
            guard.since = clock()
            guard.waiting = True
            data = await content.readany()
            guard.waiting = False
            if not data:
                return
            await each(data)
    except asyncio.CancelledError:
        if guard.timed_out():
            raise TimeoutError(guard.failure) from None
        raise
    finally:
        guard.handle.cancel()


class _IdleGuard:
    """One timer per response body, not one per read (response_check's rule): it cancels
    the reading task only if the current wait on vLLM has lasted the idle timeout, or the
    body is not over by `ends_by`."""

    def __init__(self, settings: ProxySettings, ends_by: float) -> None:
        self.settings = settings
        self.ends_by = ends_by
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.since = self.loop.time()
        self.waiting = False
        self.fired = False
        self.failure = ""
        self.handle = self.loop.call_at(
            min(self.since + settings.idle_timeout, ends_by), self._check
        )

    def timed_out(self) -> bool:
        """In `except CancelledError`: True when this guard, and nothing else, cancelled."""
        return self.fired and self.task.uncancel() == 0

    def _check(self) -> None:
        failure, when = response_check(
            self.settings, self.since, self.waiting, self.ends_by, self.loop.time()
        )
        if failure is not None:
            self.failure = failure
            self.fired = True
            self.task.cancel()
            return
        self.handle = self.loop.call_at(when, self._check)


def response_check(
    settings: ProxySettings, since: float, waiting: bool, ends_by: float, now: float
) -> tuple[str | None, float]:
    """The one rule for a response body after its head, on either client to vLLM: it fails
    when vLLM has been silent for the idle timeout since `since` while the sidecar was
    `waiting` on it, or at `ends_by` (a response that is not a stream: the response
    deadline after its head). (why it failed or None, when to check next)."""
    if now >= ends_by:
        return f"vLLM's response did not end within {settings.response_deadline:g} s", now
    idle = settings.idle_timeout
    if not waiting:
        return None, min(now + idle, ends_by)
    if now - since >= idle:
        return f"vLLM sent nothing for {idle:g} s", now
    return None, min(since + idle, ends_by)


def body_wait(settings: ProxySettings, started: float, last: float) -> float:
    """When reading a request body gives up, on either path (ASGI's, fast.py's): a silence
    of the body timeout since its `last` bytes, or the body deadline after its head."""
    return min(last + settings.body_timeout, started + settings.body_deadline)


def body_late(settings: ProxySettings, started: float, last: float) -> Refused:
    """The 408 of a request body not read in time (body_wait)."""
    if started + settings.body_deadline <= last + settings.body_timeout:
        return Refused(408, f"request body not received within {settings.body_deadline:g} s")
    return Refused(408, f"request body stalled for {settings.body_timeout:g} s")


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _connection_tokens(headers: Any) -> frozenset[bytes]:
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(tokens)


def _error_event(message: str) -> bytes:
    return b"data: " + error_body(502, message, "upstream_error") + b"\n\n"


# The attribute on uvicorn's httptools request cycle where the sidecar's own protocol
# (serve.LimitedHttpTools) looks for a callback when the client's connection is lost.
CLIENT_GONE = "mla_serve_client_gone"


async def _cancel_on_disconnect(
    exchange: Coroutine[Any, Any, None], receive: Receive, send: Send
) -> None:
    """Run the exchange in this task; if the client goes away first, cancel it (closing
    upstream). Under the sidecar's own httptools protocol the connection's loss calls back
    (CLIENT_GONE); elsewhere (h11, another server) one watcher task per request waits for
    ASGI's http.disconnect. The exchange is not a task of its own."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def client_gone() -> None:
        nonlocal gone
        if not gone:
            gone = True
            task.cancel()

    cycle = _direct_cycle(send)
    hooked = cycle is not None and hasattr(cycle, CLIENT_GONE)
    watcher: asyncio.Task[None] | None = None
    if hooked:
        setattr(cycle, CLIENT_GONE, client_gone)
        if cycle.disconnected:  # gone while the body was read: cancelled at the first await
            client_gone()
    else:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            client_gone()

        watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await exchange
    except asyncio.CancelledError:
        if not gone or task.uncancel() > 0:
            raise  # cancelled from outside (shutdown): not ours to swallow
    finally:
        if watcher is not None:
            watcher.cancel()
        elif hooked:
            setattr(cycle, CLIENT_GONE, None)


async def _start(send: Send, response: aiohttp.ClientResponse, keep_length: bool = False) -> None:
    """Send vLLM's status and headers, less hop-by-hop ones. Its Content-Length is kept for
    bodies relayed byte for byte (a short body then cannot pass as complete)."""
    headers = returned_headers(response.raw_headers, keep_length)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})


# The sidecar's own answers after which the connection ends: the request was not read whole.
CLOSING = frozenset({408, 413, 431})


def answer_headers(status: int, length: int) -> list[tuple[bytes, bytes]]:
    """The headers of an answer of the sidecar's own (an OpenAI-style JSON error)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % length)]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return headers


def returned_headers(headers: Any, keep_length: bool) -> list[tuple[bytes, bytes]]:
    """vLLM's response headers as the client gets them: names lowercased, less hop-by-hop
    ones, those its Connection header names, and vLLM's Date; Content-Length only when
    `keep_length` (a body relayed byte for byte)."""
    named = _connection_tokens(headers)
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in named or (
            lowered in NOT_RETURNED and not (keep_length and lowered == b"content-length")
        ):
            continue
        kept.append((lowered, value))
    return kept


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = answer_headers(status, len(body))
    if status in CLOSING:  # the rest of the request is not read: end the connection
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Http10Sender:
    """HTTP/1.0 has no chunked encoding: a response without a length is collected (up to a
    cap, and within the in-flight byte budget) and sent with one. uvicorn's httptools
    protocol would send it chunked."""

    def __init__(self, send: Send, limit: int, budget: ByteBudget) -> None:
        self.send = send
        self.limit = limit
        self.budget = budget
        self.start: Message | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.direct = False
        self.finished = False

    def release(self) -> None:
        self.budget.give(self.size)
        self.size = 0
        self.parts = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if any(name == b"content-length" for name, _ in message.get("headers", [])):
                self.direct = True
                await self.send(message)
            else:
                self.start = message
            return
        if self.direct:
            await self.send(message)
            return
        body = message.get("body", b"")
        if self.size + len(body) > self.limit or not self.budget.take(len(body)):
            if self.start is not None and not self.finished:
                self.finished = True
                status = 503
                error = error_body(status, "the response is too large to send to an HTTP/1.0 "
                                   "client now; use HTTP/1.1", "server_busy")  # fmt: skip
                await _respond(self.send, status, error)
            raise Aborted("an HTTP/1.0 response could not be collected")
        self.size += len(body)
        self.parts.append(body)
        if not message.get("more_body"):
            await self._flush()

    async def _flush(self) -> None:
        if self.start is None or self.finished:
            return
        self.finished = True
        body = b"".join(self.parts)
        headers = [*self.start.get("headers", []), (b"content-length", str(len(body)).encode())]
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


class QuietAborts(logging.Filter):
    """uvicorn logs an exception that ends a started response with a traceback; an aborted
    relay is an expected outcome, logged here as one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, Aborted):
            log.warning("aborted a response: %s", error)
            return False
        return True
