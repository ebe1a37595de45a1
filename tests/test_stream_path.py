"""The pass-through's stream path on odd upstream bytes: a scripted upstream on raw sockets.

The upstream here is a CPU stand-in, not vLLM: it answers every chat request with bytes
fixed by the test (vLLM's chunk format, tests/vllm_standin.py's shapes), cut into HTTP
chunks and TCP writes at the places a parser can get wrong: inside `data:`, between CR
and LF, inside `[DONE]`, inside a chunk's size line, one byte at a time. Through the
sidecar (its own front on httptools, with the C lane and without; through ASGI on uvicorn's
httptools protocol and on h11), the client must get every byte unchanged and the sidecar
must count every completion exactly once.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from mla_serve.sidecar import serve
from mla_serve.sidecar.app import create_app
from mla_serve.sidecar.settings import Settings
from tests.hostile import wire
from tests.hostile.wire import dechunk
from tests.http_server import ServerThread
from tests.scrape import count

MODEL = "glm-5.3-flash"
Plan = list[tuple[bytes, float]]  # raw bytes to write, then seconds to wait


def chunk(delta: dict[str, object], finish: str | None = None, end: bytes = b"\n\n") -> bytes:
    document = {
        "id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }  # fmt: skip
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + end


def usage(end: bytes = b"\n\n") -> bytes:
    document = {
        "id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }  # fmt: skip
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + end


def events(end: bytes = b"\n\n", finish: str = "stop") -> bytes:
    """A whole stream as vLLM sends it (with usage): role, reasoning, content, finish, [DONE]."""
    return b"".join([
        chunk({"role": "assistant", "content": ""}, end=end),
        chunk({"reasoning": "think \u00e9 \\ \"q\""}, end=end),
        chunk({"content": "the answer"}, end=end),
        chunk({"content": ""}, finish, end=end),
        usage(end),
        b"data: [DONE]" + end,
    ])  # fmt: skip


def multiline() -> bytes:
    """Events whose data spans several `data:` lines (joined by LF: still one JSON text), a
    comment, an `event:` field and an `id:` field, as the SSE grammar allows."""
    first = chunk({"content": "multi"})[len(b"data: ") : -2]
    cut = first.index(b',"choices"')
    return (
        chunk({"role": "assistant", "content": ""})
        + b": keep-alive comment\n\n"
        + b"event: message\nid: 1\ndata: "
        + first[:cut]
        + b"\ndata: "
        + first[cut:]
        + b"\n\n"
        + chunk({"content": ""}, "length")
        + usage()
        + b"data: [DONE]\n\n"
    )


def http_chunks(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces if piece)


HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def cuts(body: bytes, *marks: bytes) -> list[bytes]:
    """`body` cut just after the first occurrence of each mark."""
    points = sorted(body.index(mark) + len(mark) for mark in marks)
    return [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


def random_pieces(body: bytes, seed: int, largest: int) -> list[bytes]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(body):
        size = rng.randint(1, largest)
        pieces.append(body[at : at + size])
        at += size
    return pieces


class Scripted:
    """A raw-socket HTTP/1.1 server: each request gets the next plan's writes, in order."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []
        self.requests: list[bytes] = []
        self.written: list[float] = []  # when each plan's last write was taken (monotonic)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Scripted:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                if not path.startswith(b"/v1/chat/completions"):  # the sidecar's own probes
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.requests.append(body)
                close = True
                for data, pause in self.plans.pop(0):
                    if data == b"<close>":
                        break
                    writer.write(data)
                    await writer.drain()
                    await asyncio.sleep(pause)
                else:
                    close = False
                self.written.append(time.monotonic())
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    server = Scripted().start()
    yield server
    server.stop()


@pytest.fixture(params=["sidecar", "sidecar-python", "httptools", "h11"])
def sidecar(request: pytest.FixtureRequest, scripted: Scripted) -> Iterator[Callable[[], str]]:
    """The sidecar on its own protocol (serve.py: the pass-through without ASGI,
    passthrough/fronts.py, token chunks in C where the lane takes them; and with the lane
    off, every read in Python), and as an ASGI app on uvicorn's two protocols."""
    servers: list[ServerThread] = []

    def start(keep_alive: int = 5, **overrides: Any) -> str:
        if request.param == "sidecar-python":
            overrides.setdefault("lane", "off")
        settings = Settings(vllm_url=scripted.url, poll_interval=0.2, stream_idle_timeout=2.0,
                            **overrides)  # fmt: skip
        app = create_app(settings)
        http: Any = request.param
        if http.startswith("sidecar"):
            http = serve.protocol("httptools", settings, app)
        servers.append(ServerThread(app, http=http, keep_alive=keep_alive).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def stream(url: str, include_usage: bool = True) -> bytes:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if include_usage:
        request["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=20) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def plan_of(body: bytes, pieces: list[bytes], pause: float = 0.002) -> Plan:
    """The head, then each piece as one HTTP chunk in its own TCP write, then the last chunk."""
    assert b"".join(pieces) == body
    return [(HEAD, pause), *((http_chunks([p]), pause) for p in pieces), (b"0\r\n\r\n", 0.0)]


def framing_split(body: bytes, seed: int) -> Plan:
    """HTTP chunks of random sizes whose framing itself (size line, CRLF) is cut across TCP
    writes at random places."""
    wire = HEAD + http_chunks(random_pieces(body, seed, 60)) + b"0\r\n\r\n"
    return [(piece, 0.001) for piece in random_pieces(wire, seed + 1, 25)]


LF = events()
CRLF = events(b"\r\n\r\n")
CASES: dict[str, Plan] = {
    "one event per chunk": plan_of(LF, [e + b"\n\n" for e in LF.split(b"\n\n")[:-1]]),
    "data: split": plan_of(LF, cuts(LF, b"da", b"}\n\nda", b"data:")),
    "LF LF split": plan_of(LF, cuts(LF, b"}\n", b'"the answer"}')),
    "[DONE] split": plan_of(LF, cuts(LF, b"data: [DO", b"[DONE]\n")),
    "CRLF split between CR and LF": plan_of(CRLF, cuts(CRLF, b"}\r", b"}\r\n\r", b"[DONE]\r")),
    "CRLF one byte at a time": plan_of(CRLF, [CRLF[i : i + 1] for i in range(len(CRLF))], 0),
    "LF random pieces": plan_of(LF, random_pieces(LF, 1, 40), 0.001),
    "framing split": framing_split(LF, 5),
    "multi-line events": plan_of(multiline(), random_pieces(multiline(), 2, 30), 0.001),
    "everything in one write": [(HEAD + http_chunks([LF]) + b"0\r\n\r\n", 0.0)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_odd_chunkings_pass_unchanged_and_count_once(sidecar, scripted, case: str) -> None:
    url = sidecar()
    plan = CASES[case]
    body = b"".join(piece for piece, _ in plan).partition(b"\r\n\r\n")[2]
    sent = dechunk(body)
    finish = "length" if case == "multi-line events" else "stop"
    scripted.plans.append(plan)
    received = stream(url)
    assert received == sent
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason=finish) == 1
    assert count(url, "mla_serve_unparsed_events_total") == 0
    assert count(url, "mla_serve_truncated_responses_total") == 0


def test_the_usage_the_sidecar_asked_for_is_dropped_across_odd_reads(sidecar, scripted):
    url = sidecar()
    scripted.plans.append(plan_of(CRLF, random_pieces(CRLF, 3, 7), 0))
    received = stream(url, include_usage=False)
    assert received == CRLF.replace(usage(b"\r\n\r\n"), b"")
    assert json.loads(scripted.requests[-1])["stream_options"] == {"include_usage": True}
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 1


@pytest.mark.parametrize("cut", [b'"the ans', b"data: [DO", b"}\n"])
def test_upstream_closing_mid_event_ends_with_an_error_event(sidecar, scripted, cut: bytes):
    """vLLM's connection closes inside an event (no last chunk): the client gets every byte
    sent, the partial event ended, then an error event; no [DONE]; one truncation counted."""
    url = sidecar()
    sent = LF[: LF.index(cut) + len(cut)]
    scripted.plans.append([*plan_of(sent, random_pieces(sent, 4, 50))[:-1], (b"<close>", 0.0)])
    received = stream(url)
    assert received.startswith(sent)
    rest = received[len(sent) :]
    if not sent.endswith(b"\n\n"):
        assert rest.startswith(b"\n\n")
    error = json.loads(rest.strip().removeprefix(b"data: "))
    assert error["error"]["type"] == "upstream_error"
    assert b"[DONE]\n\n" not in received
    assert count(url, "mla_serve_truncated_responses_total") == 1


def test_a_stream_that_stalls_ends_within_the_idle_timeout(sidecar, scripted):
    url = sidecar()
    first = LF[: LF.index(b"\n\n") + 2]
    scripted.plans.append([(HEAD, 0.0), (http_chunks([first]), 30.0)])
    received = stream(url)
    assert received.startswith(first) and b"sent nothing for 2 s" in received


def test_an_endless_response_head_is_refused_not_buffered(sidecar, scripted):
    """vLLM's head never ends (one header line growing past 64 KiB): the client gets a 502
    at once, not a sidecar buffering it without bound, and the next request is served."""
    url = sidecar()
    pad = [(b"a" * 4096, 0.0) for _ in range(40)]  # 160 KiB of one header's value
    scripted.plans.append([(b"HTTP/1.1 200 OK\r\nx-pad: ", 0.0), *pad, (b"a", 30.0)])
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=request, timeout=20)
    assert response.status_code == 502, response.text
    assert time.monotonic() - started < 10
    assert "Traceback" not in response.text
    scripted.plans.append(plan_of(LF, [LF]))
    assert stream(url) == LF


@pytest.mark.parametrize("http", ["sidecar", "httptools"])
def test_keep_alive_connections_are_reused_and_a_stale_one_is_retried(scripted, http):
    """Three streams in a row on one sidecar; between them the upstream closes the kept
    connection (as uvicorn does after its keep-alive timeout): the next request must not
    fail for it."""
    settings = Settings(vllm_url=scripted.url, poll_interval=30)
    app = create_app(settings)
    protocol = serve.protocol(http, settings, app)
    server = ServerThread(app, http=protocol if http == "sidecar" else http).start()
    try:
        scripted.plans.append(plan_of(LF, [LF]))
        assert stream(server.url) == LF
        scripted.plans.append([*plan_of(LF, [LF]), (b"<close>", 0.0)])  # closed after answer
        assert stream(server.url) == LF
        scripted.plans.append(plan_of(LF, [LF]))
        assert stream(server.url) == LF
        assert count(server.url, "mla_serve_completions_total", model=MODEL,
                     finished_reason="stop") == 3  # fmt: skip
    finally:
        server.stop()


def _ask(stream: bool = True) -> bytes:
    document = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                "stream_options": {"include_usage": True}}  # fmt: skip
    return wire.post("/v1/chat/completions", json.dumps(document).encode())


def _responses(sock: socket.socket, wanted: int, timeout: float = 20) -> list[tuple[bytes, bytes]]:
    """`wanted` whole responses read off one connection, in order: (head, body), a chunked
    body de-chunked. Fewer when the connection closes first."""
    sock.settimeout(timeout)
    data, replies = b"", []
    while len(replies) < wanted:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = None
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is not None and len(rest) >= length:
                replies.append((head, rest[:length]))
                data = rest[length:]
                continue
            end = rest.find(b"\r\n0\r\n\r\n")
            if length is None and (rest.startswith(b"0\r\n\r\n") or end >= 0):
                stop = 5 if rest.startswith(b"0\r\n\r\n") else end + 7
                replies.append((head, dechunk(rest[:stop])))
                data = rest[stop:]
                continue
        more = sock.recv(1 << 16)
        if not more:
            break
        data += more
    return replies


def test_pipelined_requests_are_answered_in_order(sidecar, scripted):
    """Two requests in one write, a third behind them: three streams, in order, counted."""
    url = sidecar()
    for _ in range(3):
        scripted.plans.append(plan_of(LF, cuts(LF, b"da", b"[DONE]")))
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_ask() + _ask())
        time.sleep(0.2)
        sock.sendall(_ask())
        replies = _responses(sock, 3)
    assert [head.split(b" ", 2)[1] for head, _ in replies] == [b"200"] * 3
    assert [body for _, body in replies] == [LF] * 3
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 3


def test_an_answer_in_the_read_of_the_next_request_keeps_the_connection(sidecar, scripted):
    """A request the sidecar answers itself (malformed JSON: 400) and a stream behind it in
    the same write: the stream (1.5 s) outlasts the keep-alive timeout (1 s) and still
    arrives whole. (The connection is not idle while the second request runs; a keep-alive
    timer armed by the first answer must not close it.)"""
    url = sidecar(keep_alive=1)
    first = LF[: LF.index(b"\n\n") + 2]
    rest = LF[len(first) :]
    scripted.plans.append([(HEAD + http_chunks([first]), 1.5), (http_chunks([rest]), 0.0),
                           (b"0\r\n\r\n", 0.0)])  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(wire.post("/v1/chat/completions", b"{not json") + _ask())
        replies = _responses(sock, 2)
    assert [head.split(b" ", 2)[1] for head, _ in replies] == [b"400", b"200"]
    assert json.loads(replies[0][1])["error"]["type"] == "invalid_request_error"
    assert replies[1][1] == LF


def test_a_slow_reader_gets_every_byte_and_holds_vllm_back(sidecar, scripted):
    """vLLM sends 24 MiB of events at once; the client reads nothing for 1.5 s, then reads
    slowly. Every byte arrives in order, and the sidecar stopped reading vLLM meanwhile (its
    last write was taken only after the client began reading): the sidecar does not buffer
    a response the client is not taking."""
    url = sidecar()
    events = [chunk({"content": "x" * (64 << 10)}) for _ in range(384)]
    body = chunk({"role": "assistant", "content": ""}) + b"".join(events)
    body += chunk({"content": ""}, "stop") + usage() + b"data: [DONE]\n\n"
    scripted.plans.append([(HEAD, 0.0), *((http_chunks([e]), 0.0) for e in cuts(body, b"xx")),
                           (b"0\r\n\r\n", 0.0)])  # fmt: skip
    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    with sock:
        sock.sendall(_ask())
        time.sleep(1.5)
        reading = time.monotonic()
        sock.settimeout(30)
        wire = bytearray()
        while not wire.endswith(b"\r\n0\r\n\r\n"):
            more = sock.recv(1 << 16)
            assert more, "the connection closed before the response ended"
            wire += more
    head, _, chunked = bytes(wire).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and dechunk(chunked) == body
    assert scripted.written[-1] > reading
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 1


def test_a_chunked_request_body_over_the_limit_is_refused(sidecar, scripted):
    """A body without Content-Length (chunked) that grows past --max-body-bytes: 413 as soon
    as it does, the connection closed; nothing reaches vLLM."""
    url = sidecar(max_body_bytes=4096)
    port = int(url.rsplit(":", 1)[1])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: sidecar\r\n"
            b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head + http_chunks([b"{" + b" " * 3000, b" " * 3000]))
        replies = _responses(sock, 1)
        sock.settimeout(5)
        closed = sock.recv(1) == b""
    assert replies[0][0].split(b" ", 2)[1] == b"413"
    assert b"connection: close" in replies[0][0].lower()
    assert json.loads(replies[0][1])["error"]["message"] == "request body over 4096 bytes"
    assert closed and scripted.requests == []


@pytest.mark.parametrize(
    ("version", "served"),
    [("0.54.0", True), ("0.54.9", True), ("0.53.9", False), ("0.55.0", False), ("1.0", False)],
)
def test_the_own_front_runs_on_the_uvicorn_it_is_written_for(monkeypatch, caplog, version, served):
    """The front that serves without ASGI uses uvicorn's httptools protocol's own attributes:
    on a uvicorn outside the releases it is written for (each bound checked), every request
    goes through ASGI, and the sidecar says so."""
    settings = Settings(vllm_url="http://127.0.0.1:9")
    app = create_app(settings)
    monkeypatch.setattr(serve, "installed_version", lambda name: version)
    with caplog.at_level("WARNING", logger="mla_serve.sidecar"):
        chosen = serve.protocol("httptools", settings, app)
    assert (chosen.router is app) is served  # type: ignore[attr-defined]
    assert ("goes through ASGI" in caplog.text) is not served
    assert serve.uvicorn_supported(version) is served


def test_the_uvicorn_installed_is_one_the_front_is_written_for() -> None:
    from importlib.metadata import version

    assert serve.uvicorn_supported(version("uvicorn")), version("uvicorn")


# -- the token classifier: a token chunk taken by its shape is the same as parsed whole -----


class _Front:
    """A front that keeps what the exchange gives it (the classifier's tests)."""

    direct = False

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def start(self, status: int, headers: list[tuple[bytes, bytes]], length: bool) -> None:
        pass

    def write(self, data: bytes) -> bool:
        self.out.append(data)
        return False

    def finish(self, data: bytes) -> None:
        self.out.append(data)

    def cut(self) -> None:
        pass

    def answer(self, status: int, body: bytes, close: bool) -> None:
        self.out.append(body)

    def transport_write(self) -> Any:
        raise AssertionError


def _state(completion: object, guard: object) -> object:
    watches = {
        index: (w.tokens, w.channel, w.loop, w.finished, w.detector.tail, w.detector.pieces)
        for index, w in guard.watches.items()  # type: ignore[attr-defined]
    }
    return completion, watches, guard.head, guard.looping, guard.stopped  # type: ignore[attr-defined]


def _classify(events: list[bytes], by_shape: bool) -> tuple[object, list[bytes], int]:
    """Each event through a real exchange's response path (the runaway guard in stop mode),
    one event a read: by its token shape where it matches (`by_shape`), or every one
    parsed whole (the shape never learnt)."""
    from prometheus_client import CollectorRegistry

    from mla_serve.sidecar.guard.loops import LoopConfig, LoopGuard, LoopPolicy
    from mla_serve.sidecar.passthrough.exchange import Exchange, PassThrough
    from mla_serve.sidecar.passthrough.runaways import Ledger

    async def run() -> tuple[object, list[bytes], int]:
        registry = CollectorRegistry()
        config = LoopConfig(min_repeats=4, window_chars=512, min_chars=64)
        loops = LoopGuard(LoopPolicy(action="stop", config=config), registry)
        service = PassThrough(Settings(vllm_url="http://127.0.0.1:9"), Ledger(registry, "t_"),
                              loops, registry)  # fmt: skip
        front = _Front()
        exchange = Exchange(service, front, b"POST", "/v1/chat/completions", b"", [], "", b"http")
        exchange.reading = False
        exchange.guard = loops.watch({"model": MODEL, "max_tokens": 10_000}, exchange.path)
        exchange.head(200, [(b"content-type", b"text/event-stream")])
        taken = 0
        for event in events:
            if not by_shape:
                exchange.shape = None
            learnt = exchange.shape
            if learnt is not None and learnt.match(event) is not None:
                taken += 1
            exchange.body(event)
            exchange.fed()
            if exchange.finished:
                break
        state = _state(exchange.completion, exchange.guard)
        exchange.close()
        return state, front.out, taken

    return asyncio.run(run())


def _recorded() -> list[list[bytes]]:
    from pathlib import Path

    from tests.bench.passthrough.replay import RECORDINGS

    streams = []
    for path in sorted(Path(__file__).parents[1].glob(RECORDINGS)):
        for recorded in json.loads(path.read_text())["streams"]:
            streams.append([text.encode() for _, text in recorded["chunks"]])
    return streams


def _token(text: bytes, channel: bytes = b"content", extra: bytes = b"") -> bytes:
    return (
        b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"' + channel + b'":"' + text + b'"},"logprobs":null,'
        b'"finish_reason":null' + extra + b"}]}\n\n"
    )


def _text(text: bytes, extra: bytes = b"") -> bytes:
    """A /v1/completions token chunk as vLLM 0.33.0 serializes it (exclude_unset)."""
    return (
        b'data: {"id":"cmpl-7","object":"text_completion","created":1,"model":"m",'
        b'"choices":[{"index":0,"text":"' + text + b'","logprobs":null,"finish_reason":null,'
        b'"stop_reason":null,"prompt_token_ids":null,"token_ids":null,"weight_versions":null}]'
        + extra
        + b',"kv_transfer_params":null}\n\n'
    )


ODD = [
    _token(b"", b"content"),
    _token(b"hello"),
    _token(b"   ", b"content"),
    _token(b"\\u00a0\\u2003", b"content"),  # Unicode spaces: not visible, as str.strip() says
    _token(b'\\n\\t\\\\ \\"q\\" \\/', b"reasoning"),
    _token(b"\\ud83d\\ude00 caf\xc3\xa9", b"content"),
    _token(b"\xff broken utf-8"),  # not UTF-8: parsed whole (and not classified), as before
    _token(b"\xed\xa0\x80 a lone surrogate, surrogatepass"),
    _token(b"x", extra=b',"token_ids":null'),
    _token(b"x", extra=b',"stop_reason":null'),  # another field: parsed whole
    _token(b"tab\there"),  # a raw control character: invalid JSON, parsed whole
    _token(b"\\u12"),  # a bad escape
    _token(b"y", b"tool_calls"),
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":01,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"z"},"logprobs":null,"finish_reason":null}]}\n\n',
    b'data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"a","content":"b"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n',
    _token(b"w").replace(b'"finish_reason":null', b'"finish_reason":"length"'),
    # what follows the string, against the shape the role chunk leads to expect
    _token(b"u", extra=b',"logprobs":null'),  # a repeated null: still a token chunk
    _token(b"u", extra=b',"index":null'),  # the choice's index again, null: parsed whole
    _token(b"u").replace(b"}]}\n\n", b'}],"usage":null}\n\n'),
    _token(b"u").replace(b"}]}\n\n", b'}],"usage":{"total_tokens":1}}\n\n'),
    _token(b"u").replace(b"}]}\n\n", b'}],"model":null}\n\n'),  # the head's model undone
    _token(b"u").replace(b"}]}\n\n", b'}] ,"x":null}\n\n'),
    _token(b"u").replace(b"}]}\n\n", b"}]}\r\n\r\n"),
]


def test_a_chat_streams_first_token_chunk_is_read_by_the_shape_its_role_chunk_gives() -> None:
    """The role chunk (parsed whole) gives the head its token chunks share; the first token
    chunk then settles the tail, so no token chunk of a chat stream is parsed whole. A
    completions stream has no role chunk: its first token chunk teaches the shape."""
    first = _token(b"start").replace(b'{"content":"start"}', b'{"role":"assistant","content":""}')
    tokens = [_token(b"a"), _token(b"b", b"reasoning"), _token(b"c")]
    assert _classify([first, *tokens], by_shape=True)[2] == 3
    texts = [_text(b"a"), _text(b"b"), _text(b"c")]
    assert _classify(texts, by_shape=True)[2] == 2
    # a tail the expected shape must not take: parsed whole, and the shape learnt from it
    usage = _token(b"a").replace(b"}]}\n\n", b'}],"usage":{"total_tokens":1}}\n\n')
    assert _classify([first, usage, *tokens], by_shape=True)[2] == 3


def test_token_chunks_classify_as_parsing_them_whole_does() -> None:
    """Every recorded vLLM stream, then odd token chunks after a real first chunk, then a
    looping text (the guard stops it), for chat and for /v1/completions: taking token
    chunks by the stream's shape leaves the runaway classifier and the loop guard exactly
    where parsing every chunk whole does, and forwards the same bytes."""
    taken = processed = 0
    cases = _recorded()
    first = _token(b"start").replace(b'{"content":"start"}', b'{"role":"assistant","content":""}')
    cases += [[first, odd, _token(b"after", b"reasoning")] for odd in ODD]
    # A stream whose first chunk is not JSON (trailing garbage) but has the head: its id
    # and model stay unknown, so its token chunks are parsed whole (they set them).
    cases.append([first.replace(b"]}\n\n", b"]}x\n\n"), _token(b"a"), _token(b"b")])
    # `"created":01` is not JSON: a head is never learnt from it.
    zero = [e.replace(b'"created":1,', b'"created":01,') for e in (first, _token(b"c"))]
    cases.append([zero[0], _token(b"valid"), zero[1], zero[1]])
    looping = [first] + [_token(b"the same phrase again, ", b"reasoning")] * 40
    cases.append(looping)
    cases.append([first] + [_token(b"ab")] * 80 + [_token(b"", extra=b"")])
    # /v1/completions streams (vLLM 0.33.0's text_completion chunks): no role chunk first
    cases.append([_text(b"once"), _text(b" more"), _text(b"   "), _text(b"\\u00e9")])
    cases.append([_text(b"go")] + [_text(b"round and round, ")] * 40)
    cases.append([_text(b"a"), _text(b"b", extra=b',"usage":null'), _text(b"c")])
    # A head that is not flat (an object before the choices): no shape is expected of it.
    nested = [e.replace(b'"model":"m"', b'"model":{"m":[1]}') for e in (first, _token(b"n"))]
    cases.append([nested[0], nested[1], nested[1]])
    for events in cases:
        by_shape, out, used = _classify(events, by_shape=True)
        assert (by_shape, out) == _classify(events, by_shape=False)[:2], events[:2]
        taken += used
        processed += len(out)
    assert taken > 0.8 * processed  # the shape took (nearly all) vLLM's token chunks
    stopped = _classify(looping, by_shape=True)[0]
    assert stopped[-1] is True  # type: ignore[index]
