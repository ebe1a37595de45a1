"""A misbehaving stand-in for vLLM 0.33.0, written on raw sockets so it can break HTTP.

This is a CPU stand-in, not vLLM. Well-formed answers use vLLM's formats from
tests/vllm_standin.py (`Script`: chunks and whole responses as vLLM serializes them,
`model_list`, the 401 body of vLLM's --api-key middleware). Misbehaviours are chosen by
`[flag]` words in the request's last user message (or prompt):

  [runaway]      think until max_tokens, no visible content (counted as a runaway)
  [crlf]         SSE events delimited by CRLF CRLF (legal SSE; vLLM itself uses LF)
  [garbage]      events that are not the expected JSON between vLLM's own
  [negusage]     usage with a negative completion_tokens and a string prompt_tokens
  [bigevent]     one 6 MiB event, written in 64 KiB pieces
  [truncate]     the body is cut short: a chunked stream without its last chunk, or
                 fewer bytes than Content-Length, then the connection closes
  [bodystall]    headers and part of the body, then silence
  [hopheaders]   the response names a header in Connection: and sends hop-by-hop ones
  [retry]        429 with Retry-After
  [slow]         0.1 s between stream events
  [fullhead]     a response head of exactly HEAD_LIMIT bytes (the sidecar's limit for vLLM's)
  [bighead]      a response head of HEAD_LIMIT + 1 bytes, written at once
  [endless]      a stream of token chunks that never ends, written as fast as it is read;
                 a stream cut off by the sidecar is counted in `cut_streams`
  [bodytrickle]  a whole (not streamed) response whose body comes one byte every 0.3 s
  [trailers]     a whole response in one chunk, then trailer fields (X-Upstream-Trailer)
  [endlesstrailer]  a whole response in one chunk, then one trailer value that never ends,
                 written as fast as it is read (its bytes counted in `trailer_bytes`)
  [extra]        a whole response, and in the same write the head and 10 bytes of a second
                 response nobody asked for (`HTTP/1.1 200 OK`, `content-length: 400`)
  [switch]       `101 Switching Protocols` (upgrade: websocket) and a few bytes, then the end
  [gzipte]       `Transfer-Encoding: gzip` without chunked: the body gzipped, ended by the
                 connection's end
  [huge]         a stream of HUGE_BYTES in events of about 64 KiB, then [DONE]
  [oddlabels]    a whole response whose `model` and `finish_reason` are new strings each time

A HEAD request is answered as vLLM's FastAPI routes answer it: `405 Method Not Allowed`
with `allow`, the length of the error document and no body (uvicorn sends none for HEAD).

Scripted responses, for tests that build vLLM's bytes themselves (tests/differential): a
request with the header `x-fake-raw: ID` is answered with `raw[ID]` (`Raw`: its writes,
written with a pause between them, then the connection kept or closed) whatever its route.

Every request's method, target, headers and body are recorded in `seen` (with the number
of the connection it came on); any path that is not one of vLLM's OpenAI routes answers
`ADMIN-ROUTE-REACHED`, so a leak cannot go unseen. Connections are counted as they are
accepted (`connections`) and while they are open (`open_now`).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from tests.vllm_standin import VERSION, Script, model_list

CHUNK = 64 * 1024
HEAD_LIMIT = 64 * 1024  # mla_serve.sidecar.passthrough.upstream.MAX_HEAD_BYTES
OPENAI = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models")
HUGE_BYTES = 200 << 20  # the [huge] stream's size
# FastAPI's answer to a method a route does not take, as vLLM sends it (HEAD: without it)
NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
# the head and first bytes of a response nobody asked for, written after an [extra] one
UNASKED = b"HTTP/1.1 200 OK\r\ncontent-length: 400\r\n\r\n0123456789"


@dataclass
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes = b""
    connection: int = 0  # the number of the connection it came on (1, 2, ...)


@dataclass
class Raw:
    """A scripted response: `writes`, `pause` seconds apart, then the connection closed
    (`close`) or kept for the next request."""

    writes: list[bytes]
    pause: float = 0.0
    close: bool = False


@dataclass
class FakeVllm:
    api_key: str | None = None
    models: list[str] = field(default_factory=lambda: ["glm-5.3-flash"])
    seen: list[Seen] = field(default_factory=list)
    sent: dict[str, bytes] = field(default_factory=dict)  # last body sent per flag set
    sent_all: dict[str, list[bytes]] = field(default_factory=dict)  # every one
    cut_streams: int = 0  # [endless] streams whose connection the sidecar closed
    trailer_bytes: int = 0  # bytes of [endlesstrailer] values written
    raw: dict[str, Raw] = field(default_factory=dict)  # scripted responses by x-fake-raw
    connections: int = 0  # connections accepted
    open_now: int = 0  # connections open now
    port: int = 0

    def start(self) -> FakeVllm:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        if not ready.wait(10):
            raise RuntimeError("fake vLLM did not start")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def paths(self) -> list[str]:
        return [seen.target for seen in self.seen]

    def last(self, prefix: str) -> Seen:
        """The latest request whose target starts with `prefix` (the sidecars' own /health,
        /v1/models and /version polls interleave with the requests under test)."""
        return next(seen for seen in reversed(self.seen) if seen.target.startswith(prefix))

    def connections_of(self, prefix: str) -> set[int]:
        """The connections on which requests whose target starts with `prefix` came."""
        return {seen.connection for seen in self.seen if seen.target.startswith(prefix)}

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        number = self.connections
        try:
            while await self._one(reader, writer, number):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.open_now -= 1
            writer.close()

    async def _one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int = 0
    ) -> bool:
        line = await reader.readline()
        if not line:
            return False
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.seen.append(Seen(method, target, headers, body, number))
        scripted = self.raw.get(headers.get("x-fake-raw", ""))
        if scripted is not None:
            return await _scripted(writer, scripted)
        path = target.partition("?")[0]
        if method == "HEAD":  # FastAPI's 405 for a route that does not take HEAD, no body
            allow = "GET" if path in ("/health", "/version", "/v1/models") else "POST"
            head = _head(
                405,
                "application/json",
                [("allow", allow), ("content-length", str(len(NOT_ALLOWED)))],
            )
            writer.write(head)
            await writer.drain()
            return True
        if path == "/health":
            return await _write(writer, 200, b"", "application/json")
        if path == "/version":
            return await _json(writer, 200, {"version": VERSION})
        key = self.api_key
        if path.startswith("/v1/") and key and headers.get("authorization") != f"Bearer {key}":
            return await _json(writer, 401, {"error": "Unauthorized"})  # vLLM's middleware
        if path == "/v1/models":
            return await _json(writer, 200, model_list(self.models, 70000))
        if path not in OPENAI:
            return await _write(writer, 200, b"ADMIN-ROUTE-REACHED", "text/plain")
        return await self._generate(path, body, writer)

    async def _generate(self, path: str, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        body: dict[str, Any] = json.loads(raw)
        chat = path != "/v1/completions"
        if path == "/v1/responses":
            text = str(body.get("input", ""))
        elif chat:
            text = str((body.get("messages") or [{}])[-1].get("content", ""))
        else:
            text = str(body.get("prompt", ""))
        flags = {word for word in text.split() if word.startswith("[") and word.endswith("]")}
        key = " ".join(sorted(flags))
        if "[retry]" in flags:
            error = {"error": {"message": "busy", "type": "RateLimitError", "param": None,
                               "code": 429}}  # fmt: skip
            return await _json(writer, 429, error, [("Retry-After", "7")])
        script = Script("runaway" if "[runaway]" in flags else "answer", body, chat, 5)
        extra: list[tuple[str, str]] = []
        if "[hopheaders]" in flags:
            extra = [("Connection", "X-Internal"), ("X-Internal", "secret"),
                     ("Keep-Alive", "timeout=5"), ("X-Kept", "yes")]  # fmt: skip
        if "[endless]" in flags:
            return await self._endless(writer, self._events(script, flags))
        if "[switch]" in flags:  # a 101 to a request that asked for no upgrade
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                         b"connection: upgrade\r\n\r\n\x81\x05hello")  # fmt: skip
            await writer.drain()
            return False
        if body.get("stream", path == "/v1/responses"):  # /v1/responses streams unless told
            events = self._events(script, flags)
            if "[huge]" not in flags:  # 200 MiB is not kept
                self.sent[key] = b"".join(events)
                self.sent_all.setdefault(key, []).append(self.sent[key])
            return await self._sse(writer, events, flags, extra)
        whole = script.whole()
        if "[oddlabels]" in flags:  # labels nobody can list in advance
            whole["model"] = f"m-{uuid.uuid4().hex}"
            whole["choices"][0]["finish_reason"] = f"f-{uuid.uuid4().hex}"
        if "[negusage]" in flags:
            whole["usage"]["completion_tokens"] = -5
            whole["usage"]["prompt_tokens"] = "twelve"
        payload = json.dumps(whole).encode()
        self.sent[key] = payload
        if {"[fullhead]", "[bighead]"} & flags:
            size = HEAD_LIMIT + ("[bighead]" in flags)
            return await _write(writer, 200, payload, "application/json", _padded(size, payload))
        if "[endlesstrailer]" in flags:  # one trailer value that never ends
            head = _head(200, "application/json", [("transfer-encoding", "chunked")])
            writer.write(head + b"%x\r\n%s\r\n0\r\nX-Upstream-Trailer: " % (len(payload), payload))
            piece = b"t" * 65536
            try:
                while True:
                    await writer.drain()
                    writer.write(piece)
                    self.trailer_bytes += len(piece)
            except ConnectionError:
                return False
        if "[trailers]" in flags:
            head = _head(200, "application/json", [("transfer-encoding", "chunked")])
            writer.write(head + b"%x\r\n%s\r\n0\r\nX-Upstream-Trailer: 1\r\n\r\n"
                         % (len(payload), payload))  # fmt: skip
            await writer.drain()
            return True
        if "[extra]" in flags:  # the rest of the read: a response nobody asked for
            head = _head(200, "application/json", [("content-length", str(len(payload)))])
            writer.write(head + payload + UNASKED)
            await writer.drain()
            return True
        if "[gzipte]" in flags:  # a transfer coding but chunked, framed by the close
            writer.write(_head(200, "application/json", [("transfer-encoding", "gzip")])
                         + gzip.compress(payload))  # fmt: skip
            await writer.drain()
            return False
        if "[bodytrickle]" in flags:
            writer.write(_head(200, "application/json", [("content-length", str(len(payload)))]))
            for byte in range(len(payload)):
                writer.write(payload[byte : byte + 1])
                await writer.drain()
                await asyncio.sleep(0.3)
            return True
        if "[truncate]" in flags or "[bodystall]" in flags:
            head = _head(200, "application/json", [("content-length", str(len(payload)))])
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            if "[bodystall]" in flags:
                await asyncio.sleep(60)
            return False
        return await _write(writer, 200, payload, "application/json", extra)

    async def _endless(self, writer: asyncio.StreamWriter, events: list[bytes]) -> bool:
        batch = events[1] * (CHUNK // len(events[1]))  # token chunks, one after another
        body = b"%x\r\n%s\r\n" % (len(batch), batch)
        writer.write(_head(200, "text/event-stream", [("transfer-encoding", "chunked")])
                     + b"%x\r\n%s\r\n" % (len(events[0]), events[0]) + body)  # fmt: skip
        try:
            while True:
                await writer.drain()
                writer.write(body)
        except ConnectionError:
            self.cut_streams += 1
            raise

    def _events(self, script: Script, flags: set[str]) -> list[bytes]:
        end = b"\r\n\r\n" if "[crlf]" in flags else b"\n\n"
        events = []
        for chunk in script.chunks():
            if "[negusage]" in flags and chunk.get("usage"):
                chunk["usage"]["completion_tokens"] = -5
                chunk["usage"]["prompt_tokens"] = "twelve"
            events.append(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + end)
        if "[garbage]" in flags:
            events[1:1] = [
                b'data: {"choices": [1]}' + end,
                b'data: {"choices": [{"index": "zero", "delta": {"content": "x"}}]}' + end,
                b'data: {"usage": {"completion_tokens": -3}, "choices": []}' + end,
                b"data: this is not json" + end,
                b"data: [1, 2, 3]" + end,
                b": a comment line" + end,
                b"event: ping" + end[: len(end) // 2] + b"data: {}" + end,
            ]
        if "[bigevent]" in flags:
            big = {"choices": [{"index": 0, "delta": {"reasoning": "z" * (6 << 20)},
                                "finish_reason": None}]}  # fmt: skip
            events.insert(1, b"data: " + json.dumps(big).encode() + end)
        if "[huge]" in flags:  # HUGE_BYTES of ~64 KiB content chunks after the first
            chunk = next(script.chunks())
            chunk["choices"] = [{"index": 0, "delta": {"content": "h" * (CHUNK - 512)},
                                 "logprobs": None, "finish_reason": None}]  # fmt: skip
            event = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + end
            events[1:1] = [event] * (HUGE_BYTES // len(event))
        events.append(b"data: [DONE]" + end)
        return events

    async def _sse(
        self,
        writer: asyncio.StreamWriter,
        events: list[bytes],
        flags: set[str],
        extra: list[tuple[str, str]],
    ) -> bool:
        writer.write(_head(200, "text/event-stream", [("transfer-encoding", "chunked"), *extra]))
        cut = len(events) // 2 if {"[truncate]", "[bodystall]"} & flags else len(events)
        for event in events[:cut]:
            for start in range(0, len(event), CHUNK):
                piece = event[start : start + CHUNK]
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
            if "[slow]" in flags:
                await asyncio.sleep(0.1)
        if "[bodystall]" in flags:
            await asyncio.sleep(60)
            return False
        if "[truncate]" in flags:
            writer.write(b'40\r\ndata: {"partial')  # a chunk that never ends
            await writer.drain()
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


REASONS = {200: "OK", 401: "Unauthorized", 405: "Method Not Allowed", 429: "Too Many Requests"}


async def _scripted(writer: asyncio.StreamWriter, scripted: Raw) -> bool:
    for index, data in enumerate(scripted.writes):
        if index and scripted.pause:
            await asyncio.sleep(scripted.pause)
        writer.write(data)
        await writer.drain()
    return not scripted.close


def _padded(size: int, payload: bytes) -> list[tuple[str, str]]:
    """An `x-pad` header that makes the head of a whole response of `payload` `size` bytes."""
    base = len(_head(200, "application/json", [("content-length", str(len(payload)))]))
    return [("x-pad", "p" * (size - base - len("x-pad: \r\n")))]


def _head(status: int, content_type: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"content-type: {content_type}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _write(
    writer: asyncio.StreamWriter,
    status: int,
    payload: bytes,
    content_type: str,
    extra: list[tuple[str, str]] | None = None,
) -> bool:
    headers = [("content-length", str(len(payload))), *(extra or [])]
    writer.write(_head(status, content_type, headers) + payload)
    await writer.drain()
    return True


async def _json(
    writer: asyncio.StreamWriter,
    status: int,
    document: Any,
    extra: list[tuple[str, str]] | None = None,
) -> bool:
    return await _write(writer, status, json.dumps(document).encode(), "application/json", extra)
