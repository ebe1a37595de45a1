"""A fast stand-in for vLLM 0.33.0's OpenAI server: raw asyncio on uvloop, no framework.

It speaks the wire format of vLLM 0.33.0 byte for byte (checked against vLLM's own pydantic
classes: `ChatCompletionStreamResponse.model_dump_json(exclude_unset=True, ...)` as
`chat_completion_stream_generator` writes it, and `ChatCompletionResponse.model_dump()` as the
non-streaming route answers):

- `GET /health` 200 with an empty body; `GET /v1/models` vLLM's ModelList;
- `POST /v1/chat/completions`, streaming: `text/event-stream` with chunked transfer encoding
  (as uvicorn sends it), the role chunk, one chunk per token (`delta.content`, or
  `delta.reasoning` for reasoning tokens), the last token in the chunk that carries
  `finish_reason` ("stop" or "length"), a usage chunk when `stream_options.include_usage`,
  then `data: [DONE]`; not streaming: one `chat.completion` JSON.

The benchmark steers each request through its last user message, `bench tokens=N rate=R
reasoning=K finish=stop|length`: N tokens, the first K of them reasoning, R tokens/s (0: as
fast as the connection takes them). Every token's text is `"<seq>@<t> "`: its sequence number
(1..N) and the monotonic clock in microseconds when it was written (CLOCK_MONOTONIC is shared
by every process of the machine), so the client checks order and loss and measures each
chunk's delay.

Throttled streams keep their own clock (`align=stream`, the default: token k due k/R after
the request) or follow vLLM's decode steps (`align=step`: one global grid of period 1/R, every
running stream emits its next token at the same grid point, as vLLM sends a whole batch per
step; this stand-in writes such a burst faster than vLLM's API server would).
Unthrottled streams write one token per event-loop turn, each in its own send, and stop while
the socket's buffer is full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from email.utils import formatdate
from typing import Any

from tests import vllm_standin

HEAD_END = b"\r\n\r\n"


def _date() -> bytes:
    return formatdate(usegmt=True).encode()


class Clock:
    """The HTTP Date header, formatted once a second."""

    def __init__(self) -> None:
        self.second = 0
        self.value = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.value = _date()
        return self.value


CLOCK = Clock()


def model_list(model: str, max_model_len: int) -> bytes:
    """vLLM's ModelList, as the CPU stand-in builds it, serialized compactly."""
    return json.dumps(
        vllm_standin.model_list([model], max_model_len), separators=(",", ":")
    ).encode()


def parse_directive(body: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "tokens": int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
        "rate": 0.0,
        "reasoning": 0,
        "finish": "stop",
        "align": "stream",
    }
    messages = body.get("messages") or []
    text = messages[-1].get("content") if messages else None
    if isinstance(text, str) and text.startswith("bench "):
        for item in text.split()[1:]:
            key, _, value = item.partition("=")
            if key in ("tokens", "reasoning"):
                spec[key] = int(value)
            elif key == "rate":
                spec[key] = float(value)
            elif key in ("finish", "align"):
                spec[key] = value
    spec["reasoning"] = min(spec["reasoning"], spec["tokens"])
    return spec


def prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages") or []
    return sum(len(str(m.get("content", "")).split()) + 4 for m in messages)


class Upstream(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False  # a streaming answer is in progress
        self.closed = False
        self.paused = False
        self.stream: Stream | None = None
        self.keep_alive = True

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
            self.server.active -= 1

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.stream is not None:
            self.stream.resume()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next_request()

    # -- requests ---------------------------------------------------------
    def _next_request(self) -> None:
        while not self.busy and not self.closed:
            end = self.buffer.find(HEAD_END)
            if end < 0:
                return
            head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            start = end + 4
            if headers.get("transfer-encoding", "").lower() == "chunked":
                parsed = _dechunk(self.buffer, start)
                if parsed is None:
                    return
                body, consumed = parsed
            else:
                length = int(headers.get("content-length", "0"))
                if len(self.buffer) < start + length:
                    return
                body = bytes(self.buffer[start : start + length])
                consumed = start + length
            del self.buffer[:consumed]
            self.keep_alive = headers.get("connection", "").lower() != "close"
            self._handle(method, path.split("?", 1)[0], body)

    def _respond(self, status: str, content_type: bytes | None, body: bytes) -> None:
        assert self.transport is not None
        head = b"HTTP/1.1 " + status.encode() + b"\r\ndate: " + CLOCK.date()
        head += b"\r\nserver: uvicorn\r\ncontent-length: %d\r\n" % len(body)
        if content_type:
            head += b"content-type: " + content_type + b"\r\n"
        if not self.keep_alive:
            head += b"connection: close\r\n"
        self.transport.write(head + b"\r\n" + body)
        if not self.keep_alive:
            self.transport.close()

    def _handle(self, method: str, path: str, body: bytes) -> None:
        server = self.server
        if path == "/health":
            self._respond("200 OK", None, b"")
        elif path == "/bench/stats":  # the benchmark's own: not part of vLLM's API
            stats = {"requests": server.requests, "active_streams": server.active}
            self._respond("200 OK", b"application/json", json.dumps(stats).encode())
        elif path == "/v1/models" and method == "GET":
            self._respond("200 OK", b"application/json", model_list(server.model, 70000))
        elif path == "/v1/chat/completions" and method == "POST":
            try:
                request = json.loads(body)
            except ValueError:
                self._respond("400 Bad Request", b"application/json", b'{"error":"bad json"}')
                return
            server.requests += 1
            spec = parse_directive(request)
            if request.get("stream"):
                options = request.get("stream_options") or {}
                self.busy = True
                self.stream = Stream(self, spec, bool(options.get("include_usage")), request)
                server.active += 1
                self.stream.start()
            else:
                self._respond("200 OK", b"application/json", full_response(server, spec, request))
        else:
            error = {"error": {"message": f"Not Found: {path}", "type": "NotFoundError"}}
            self._respond("404 Not Found", b"application/json", json.dumps(error).encode())

    def stream_done(self) -> None:
        self.stream = None
        self.server.active -= 1
        self.busy = False
        if not self.keep_alive:
            assert self.transport is not None
            self.transport.close()
            return
        if self.buffer:
            self._next_request()


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    body = bytearray()
    pos = start
    while True:
        line_end = buffer.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(bytes(buffer[pos:line_end]).split(b";")[0], 16)
        pos = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n", pos)
            if trailer_end < 0:
                return None
            return bytes(body), trailer_end + 2
        if len(buffer) < pos + size + 2:
            return None
        body += buffer[pos : pos + size]
        pos += size + 2


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Stream:
    """One streaming answer, token by token."""

    def __init__(
        self, conn: Upstream, spec: dict[str, Any], usage: bool, request: dict[str, Any]
    ) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.tokens: int = spec["tokens"]
        self.reasoning: int = spec["reasoning"]
        self.finish: str = spec["finish"]
        self.rate: float = spec["rate"]
        self.align: str = spec["align"]
        self.usage = usage
        self.prompt_tokens = prompt_tokens(request)
        self.seq = 0
        self.handle: asyncio.Handle | None = None
        self.waiting = False  # unthrottled, stopped by flow control
        server = conn.server
        self.head = (
            f'{{"id":"chatcmpl-{uuid.uuid4().hex}","object":"chat.completion.chunk",'
            f'"created":{int(time.time())},"model":"{server.model}",'
        ).encode()
        self.token_open = self.head + b'"choices":[{"index":0,"delta":{"'

    def start(self) -> None:
        transport = self.conn.transport
        assert transport is not None
        head = b"HTTP/1.1 200 OK\r\ndate: " + CLOCK.date() + b"\r\nserver: uvicorn\r\n"
        head += b"content-type: text/event-stream; charset=utf-8\r\n"
        head += b"transfer-encoding: chunked\r\n\r\n"
        role = self.head + (
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
        )
        transport.write(head + _frame(b"data: " + role + b"\n\n"))
        if self.rate > 0:
            period = 1.0 / self.rate
            now = self.loop.time()
            if self.align == "step":
                # vLLM's decode steps: a global grid; the first token one step after arrival.
                origin = self.conn.server.origin
                self.grid0 = origin + (int((now - origin) / period) + 1) * period
            else:
                self.grid0 = now + period
            self.period = period
            self._schedule()
        else:
            self.handle = self.loop.call_soon(self._burst)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def resume(self) -> None:
        if self.waiting:
            self.waiting = False
            self.handle = self.loop.call_soon(self._burst)

    def _schedule(self) -> None:
        self.handle = self.loop.call_at(self.grid0 + self.seq * self.period, self._tick)

    def _tick(self) -> None:
        if self.conn.closed:
            return
        self._emit()
        if self.seq < self.tokens:
            self._schedule()

    def _burst(self) -> None:
        self.handle = None
        if self.conn.closed:
            return
        self._emit()
        if self.seq < self.tokens:
            if self.conn.paused:
                self.waiting = True
            else:
                self.handle = self.loop.call_soon(self._burst)

    def _emit(self) -> None:
        transport = self.conn.transport
        assert transport is not None
        self.seq += 1
        seq = self.seq
        field = b"reasoning" if seq <= self.reasoning else b"content"
        text = b"%d@%d " % (seq, time.monotonic_ns() // 1000)
        if seq < self.tokens:
            event = (
                b"data: "
                + self.token_open
                + field
                + b'":"'
                + text
                + b'"},"logprobs":null,"finish_reason":null,"token_ids":null}],'
                b'"kv_transfer_params":null}\n\n'
            )
            transport.write(_frame(event))
            return
        event = (
            b"data: "
            + self.token_open
            + field
            + b'":"'
            + text
            + b'"},"logprobs":null,"finish_reason":"'
            + self.finish.encode()
            + b'","stop_reason":null,"token_ids":null,"weight_versions":null}],'
            b'"kv_transfer_params":null}\n\n'
        )
        out = _frame(event)
        if self.usage:
            usage = b'"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,' % (
                self.prompt_tokens,
                self.prompt_tokens + self.tokens,
            )
            usage += b'"completion_tokens":%d}}' % self.tokens
            out += _frame(b"data: " + self.head + usage + b"\n\n")
        out += _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        transport.write(out)
        self.conn.server.streams_done += 1
        self.conn.stream_done()


def full_response(server: Server, spec: dict[str, Any], request: dict[str, Any]) -> bytes:
    """`ChatCompletionResponse.model_dump()` through `JSONResponse`, as vLLM answers."""
    tokens, reasoning = spec["tokens"], spec["reasoning"]
    now = time.monotonic_ns() // 1000
    texts = [f"{seq}@{now} " for seq in range(1, tokens + 1)]
    prompt = prompt_tokens(request)
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": server.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(texts[reasoning:]) or None,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": "".join(texts[:reasoning]) or None,
                },
                "logprobs": None,
                "finish_reason": spec["finish"],
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt,
            "total_tokens": prompt + tokens,
            "completion_tokens": tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    server.streams_done += 1
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class Server:
    def __init__(self, model: str) -> None:
        self.model = model
        self.requests = 0
        self.active = 0  # streams in progress
        self.streams_done = 0
        self.origin = 0.0


async def serve(host: str, port: int, model: str) -> None:
    loop = asyncio.get_running_loop()
    server = Server(model)
    server.origin = loop.time()
    listener = await loop.create_server(
        lambda: Upstream(server), host, port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with listener:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="glm-5.3-flash")
    args = parser.parse_args()
    import uvloop  # a vLLM dependency, in the test venv

    uvloop.run(serve(args.host, args.port, args.model))


if __name__ == "__main__":
    main()
