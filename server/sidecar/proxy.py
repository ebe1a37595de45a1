"""The OpenAI pass-through: forward `/v1/*` to vLLM, classify what comes back.

Written as a bare ASGI app on aiohttp's client, not FastAPI routes: every SSE
chunk passes through here, and per-chunk overhead is the product. Bytes go
out as they arrive (complete SSE events per upstream read, never the whole
response); status, headers and bodies are vLLM's own.

Classification needs the final usage of a stream. When a client streams without
asking for `stream_options.include_usage`, the request is sent with it and the
usage-only chunk is dropped on the way back, so the client sees what it asked for.

Faults: vLLM unreachable → 503; no response headers within the timeout → 504;
a broken or stalled upstream mid-response → 502 before headers, or an error
event in the stream after them. A client that disconnects cancels the upstream
request, so vLLM aborts it and frees the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from server.sidecar.loops import LoopGuard, ResponseGuard
from server.sidecar.runaways import Completion, Ledger

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLASSIFIED = ("/v1/chat/completions", "/v1/completions")
# Hop-by-hop headers, plus those the client library sets itself for its own request.
NOT_FORWARDED = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
        b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ProxySettings:
    upstream: str
    connect_timeout: float = 5.0
    response_timeout: float = 600.0  # until vLLM's response headers (non-streamed: whole body)
    idle_timeout: float = 300.0  # between two reads of a streamed body
    max_body_bytes: int = 16 * 1024 * 1024


class ClientGone(Exception):
    """The client disconnected; the upstream request is cancelled."""


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error document, as vLLM itself returns them."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


class Proxy:
    def __init__(
        self, settings: ProxySettings, ledger: Ledger, loops: LoopGuard | None = None
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.loops = loops  # the runaway guard (loops.py); None: no loop detection
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
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
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(ClientGone):  # nothing to answer, nobody to answer to
            await self._handle(scope, receive, send)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        body, too_large = await _read_body(receive, self.settings.max_body_bytes)
        if too_large:
            await _respond(
                send, 413, error_body(413, "request body too large", "invalid_request_error")
            )
            return
        path = scope["path"]
        classify = scope["method"] == "POST" and path in CLASSIFIED
        request: dict[str, Any] = {}
        strip_usage = False
        if classify:
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as error:
                message = f"malformed JSON body: {error}"
                await _respond(send, 400, error_body(400, message, "invalid_request_error"))
                return
            changed = self.loops is not None and self.loops.prepare(request)
            if request.get("stream") and not _asks_usage(request):
                request["stream_options"] = {
                    **(request.get("stream_options") or {}),
                    "include_usage": True,
                }
                changed = strip_usage = True
            if changed:
                body = json.dumps(request).encode()
        exchange = self._exchange(scope, body, send, classify, request, strip_usage)
        await _cancel_on_disconnect(exchange, receive)

    async def _exchange(
        self,
        scope: Scope,
        body: bytes,
        send: Send,
        classify: bool,
        request: dict[str, Any],
        strip_usage: bool,
    ) -> None:
        assert self._session is not None
        url = scope["path"] + (
            "?" + scope["query_string"].decode() if scope["query_string"] else ""
        )
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.lower() not in NOT_FORWARDED
        ]
        # A stream's headers come at once and its chunks follow: bound the gaps. A
        # non-streamed answer's headers come at the end: bound the whole wait.
        idle = self.settings.idle_timeout if request.get("stream") else None
        try:
            async with asyncio.timeout(self.settings.response_timeout):
                response = await self._session.request(
                    scope["method"],
                    url,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=self.settings.connect_timeout, sock_read=idle
                    ),
                )
        except TimeoutError:
            message = f"vLLM sent no response within {self.settings.response_timeout:g} s"
            await _respond(send, 504, error_body(504, message, "upstream_timeout"))
            return
        except aiohttp.ClientConnectorError as error:
            message = f"vLLM is not reachable at {self.settings.upstream}: {error.os_error}"
            await _respond(send, 503, error_body(503, message, "upstream_unavailable"))
            return
        except aiohttp.ClientError as error:
            message = f"vLLM failed before responding: {type(error).__name__}: {error}"
            await _respond(send, 502, error_body(502, message, "upstream_error"))
            return
        guard = self.loops.watch(request, scope["path"]) if classify and self.loops else None
        async with response:
            streamed = response.content_type == "text/event-stream"
            if classify and streamed:
                await self._stream(response, send, request.get("model"), strip_usage, guard)
            elif classify and response.status == 200:
                await self._whole(response, send, request.get("model"), guard)
            else:
                await self._relay(response, send)

    async def _whole(
        self,
        response: aiohttp.ClientResponse,
        send: Send,
        model: str | None,
        guard: ResponseGuard | None = None,
    ) -> None:
        try:
            payload = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            message = f"vLLM broke off its response: {type(error).__name__}: {error}"
            await _respond(send, 502, error_body(502, message, "upstream_error"))
            return
        await _start(send, response, len(payload))
        await send({"type": "http.response.body", "body": payload})
        completion = Completion()
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            document = json.loads(payload)
            completion.add_body(document)
            if guard is not None:
                guard.add_body(document)
                guard.settle(completion)
        self.ledger.record(completion, model)

    async def _relay(self, response: aiohttp.ClientResponse, send: Send) -> None:
        await _start(send, response)
        try:
            async for data in response.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except (aiohttp.ClientError, TimeoutError):
            pass  # headers are gone: all that is left is to end the body
        await send({"type": "http.response.body", "body": b""})

    async def _stream(
        self,
        response: aiohttp.ClientResponse,
        send: Send,
        model: str | None,
        strip_usage: bool,
        guard: ResponseGuard | None = None,
    ) -> None:
        await _start(send, response)
        completion = Completion()
        pending = b""
        failure: str | None = None
        try:
            async for data in response.content.iter_any():
                pending += data
                cut = pending.rfind(b"\n\n") + 2
                if cut < 2:
                    continue
                events, pending = pending[:cut], pending[cut:]
                out = _observe(events, completion, strip_usage, guard)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if guard is not None and guard.stopped:
                    break
        except TimeoutError:
            failure = f"vLLM sent nothing for {self.settings.idle_timeout:g} s"
        except aiohttp.ClientError as error:
            failure = f"vLLM broke off the stream: {type(error).__name__}: {error}"
        if guard is not None and guard.stopped:
            # The loop guard ends it: closing the connection makes vLLM abort the request
            # and free its KV cache; the client gets a clean end instead of the rest.
            response.close()
            tail = guard.ending(include_usage=not strip_usage)
        else:
            tail = pending + (b"" if failure is None else _error_event(failure))
        await send({"type": "http.response.body", "body": tail})
        if guard is not None:
            guard.settle(completion)
        self.ledger.record(completion, model)


def _observe(
    events: bytes, completion: Completion, strip_usage: bool, guard: ResponseGuard | None = None
) -> bytes:
    """Feed complete SSE events to the classifier; return the bytes to forward. When the loop
    guard stops the stream, nothing after the chunk that confirmed the loop is forwarded."""
    kept: list[bytes] = []
    dropped = False
    for event in events.split(b"\n\n")[:-1]:
        if event.startswith(b"data: {"):
            try:
                chunk = json.loads(event[6:])
            except ValueError:
                chunk = None
            if isinstance(chunk, dict):
                completion.add_chunk(chunk)
                if guard is not None and guard.add_chunk(chunk):
                    kept.append(event)
                    return b"".join(event + b"\n\n" for event in kept)
                if strip_usage and not chunk.get("choices") and chunk.get("usage"):
                    dropped = True
                    continue
        kept.append(event)
    if not dropped:
        return events
    return b"".join(event + b"\n\n" for event in kept)


def _error_event(message: str) -> bytes:
    return b"data: " + error_body(502, message, "upstream_error") + b"\n\n"


def _asks_usage(request: dict[str, Any]) -> bool:
    options = request.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks), False


async def _cancel_on_disconnect(exchange: Awaitable[None], receive: Receive) -> None:
    """Run the exchange; if the client goes away first, cancel it (closing upstream)."""
    work = asyncio.ensure_future(exchange)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if not work.cancelled() and work.exception() is not None:
        raise work.exception()  # type: ignore[misc]


async def _start(send: Send, response: aiohttp.ClientResponse, length: int | None = None) -> None:
    headers = [(k.lower(), v) for k, v in response.raw_headers if k.lower() not in NOT_FORWARDED]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
