"""Replay of vLLM's own recorded streams: an upstream that plays them back, and a client.

    python -m tests.bench.passthrough.replay serve --port P --recordings FILE...
    python -m tests.bench.passthrough.replay load --url URL --recordings FILE...
        --concurrency 16 --requests 64 --pace recorded     (from the repository root)

THIS IS A REPLAY, NOT A vLLM. The upstream answers `POST /v1/chat/completions` with the raw
SSE bytes a real vLLM (0.28.0, 0.29.0, 0.33.0 on an H200) sent, as `tests/e2e/test_chat.py::
test_record_vllms_own_streams` captured them into `recorded_streams.json`: each read of the
body, byte for byte, with its time since the request was sent, and vLLM's response headers
(a fresh `date`). It announces itself in `GET /bench/stats` (`"replay": true`), never as vLLM.

- Which recording: the request header `x-replay-recording: <i>` picks the file (the set),
  the request's `chat_template_kwargs.thinking` and `stream_options.include_usage` the stream
  of that set (each set holds the four combinations). So a proxy that adds `include_usage`
  (the sidecar does, to classify) gets the usage stream vLLM would have sent it.
- Pace: `x-replay-pace: recorded` (default) writes every read at its recorded offset from the
  request's arrival, on the timing of the stream the client asked for (`x-replay-timing:
  thinking,usage`, which proxies pass on): a proxy that asks for usage gets the usage
  stream's bytes at the pace of the client's own stream, so every path sees the same pace
  (the usage stream's reads are mapped onto that timing by position); `unthrottled` writes
  one read per event-loop turn, holding back while the socket's buffer is full (the
  saturation figure).
- Each recorded read goes out as one HTTP chunk (chunked transfer encoding, as uvicorn sends).

The client runs `--requests` streams over `--concurrency` connections, each request the
recorded one (its JSON, with the set header), and checks each answer byte for byte: equal to
the recording, or (for a request without `include_usage` sent through a proxy that asked vLLM
for usage) equal to the usage recording less its usage-only event. It prints one JSON object:
time to first chunk (request sent to the first body bytes), the gaps between a stream's reads,
events received, and the checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.bench.passthrough import upstream as standin  # HTTP framing and the Date clock, shared

# The recorded streams of record (relative to the repository root): each end-to-end stack's
# `recorded_streams.json` under results/e2e (results/README.md).
RECORDINGS = "results/e2e/*/*/recorded_streams.json"

Key = tuple[bool, bool]  # (thinking, include_usage)


def load_sets(paths: list[str]) -> list[dict[str, Any]]:
    """The recording files, each a set of its four streams keyed by (thinking, usage)."""
    sets = []
    for path in paths:
        document = json.loads(Path(path).read_text())
        streams: dict[Key, dict[str, Any]] = {}
        for stream in document["streams"]:
            streams[key_of(stream["request"])] = stream
        if len(streams) != 4:
            raise ValueError(f"{path}: {len(streams)} distinct streams, expected 4")
        sets.append(
            {"file": path, "vllm_version": document.get("vllm_version"), "streams": streams}
        )
    return sets


def key_of(request: dict[str, Any]) -> Key:
    kwargs = request.get("chat_template_kwargs") or {}
    options = request.get("stream_options") or {}
    return bool(kwargs.get("thinking")), bool(options.get("include_usage"))


def timing_key(header: str | None) -> Key:
    """`x-replay-timing: thinking,usage` (each 0 or 1), the client's own request."""
    thinking, _, usage = (header or "").partition(",")
    return thinking == "1", usage == "1"


def paced(count: int, offsets: list[float]) -> list[float]:
    """`count` write times on the recorded `offsets`: read i of n at offset i*(m-1)/(n-1)."""
    if count <= 1 or len(offsets) <= 1:
        return offsets[:1] * count
    last = len(offsets) - 1
    return [offsets[round(i * last / (count - 1))] for i in range(count)]


def body_of(stream: dict[str, Any]) -> bytes:
    return "".join(chunk for _, chunk in stream["chunks"]).encode()


def without_usage(body: bytes) -> bytes:
    """`body` less its usage-only events (`"choices": []` with `usage`): what a proxy that
    asked vLLM for usage on a client's behalf must hand that client."""
    kept = []
    for event in body.split(b"\n\n")[:-1]:
        if event.startswith(b"data: {"):
            chunk = json.loads(event[6:])
            if not chunk.get("choices") and chunk.get("usage"):
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept)


# -- the replay upstream -----------------------------------------------------------------


class Replayer(standin.Upstream):
    """One connection of the replay upstream (the stand-in's HTTP parsing, replay answers)."""

    server: ReplayServer  # type: ignore[assignment]

    def _handle(self, method: str, path: str, body: bytes) -> None:
        server = self.server
        if path == "/health":
            self._respond("200 OK", None, b"")
        elif path == "/bench/stats":
            stats = {"replay": True, "requests": server.requests, "active_streams": server.active}
            self._respond("200 OK", b"application/json", json.dumps(stats).encode())
        elif path == "/v1/models" and method == "GET":
            self._respond("200 OK", b"application/json", standin.model_list(server.model, 4096))
        elif path == "/v1/chat/completions" and method == "POST":
            try:
                request = json.loads(body)
                chosen = int(self.headers.get("x-replay-recording", server.requests))
            except ValueError:
                self._respond("400 Bad Request", b"application/json", b'{"error":"bad request"}')
                return
            if not request.get("stream"):
                error = b'{"error":"the replay upstream answers streamed chats only"}'
                self._respond("400 Bad Request", b"application/json", error)
                return
            server.requests += 1
            streams = server.sets[chosen % len(server.sets)]["streams"]
            recorded = streams[key_of(request)]
            asked = self.headers.get("x-replay-timing")
            timing = recorded if asked is None else streams[timing_key(asked)]
            pace = self.headers.get("x-replay-pace", "recorded")
            self.busy = True
            self.stream = Playback(self, recorded, timing, pace == "unthrottled")  # type: ignore[assignment]
            server.active += 1
            self.stream.start()
        else:
            error = {"error": {"message": f"Not Found: {path}", "type": "NotFoundError"}}
            self._respond("404 Not Found", b"application/json", json.dumps(error).encode())

    # the stand-in's request parser keeps no headers: keep them here
    def _next_request(self) -> None:
        end = self.buffer.find(standin.HEAD_END)
        self.headers: dict[str, str] = {}
        if end >= 0 and not self.busy:
            for line in bytes(self.buffer[:end]).decode("latin-1").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
        super()._next_request()


class Playback:
    """One recorded stream, written at its recorded pace or as fast as the socket takes it."""

    def __init__(
        self,
        conn: Replayer,
        recorded: dict[str, Any],
        timing: dict[str, Any],
        unthrottled: bool,
    ) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.frames = [standin._frame(text.encode()) for _, text in recorded["chunks"]]
        self.offsets = paced(len(self.frames), [float(at) for at, _ in timing["chunks"]])
        self.headers = recorded["headers"]
        self.unthrottled = unthrottled
        self.next = 0
        self.handle: asyncio.Handle | None = None
        self.waiting = False
        self.t0 = 0.0

    def start(self) -> None:
        transport = self.conn.transport
        assert transport is not None
        head = b"HTTP/1.1 200 OK\r\n"
        for name, value in self.headers.items():
            if name.lower() == "date":
                value = standin.CLOCK.date().decode()
            head += f"{name}: {value}\r\n".encode("latin-1")
        transport.write(head + b"\r\n")
        self.t0 = self.loop.time()
        self._schedule()

    def _schedule(self) -> None:
        if self.unthrottled:
            if self.conn.paused:
                self.waiting = True
            else:
                self.handle = self.loop.call_soon(self._write)
        else:
            self.handle = self.loop.call_at(self.t0 + self.offsets[self.next], self._write)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def resume(self) -> None:
        if self.waiting:
            self.waiting = False
            self.handle = self.loop.call_soon(self._write)

    def _write(self) -> None:
        self.handle = None
        transport = self.conn.transport
        if self.conn.closed or transport is None:
            return
        frame = self.frames[self.next]
        self.next += 1
        if self.next < len(self.frames):
            transport.write(frame)
            self._schedule()
            return
        transport.write(frame + b"0\r\n\r\n")
        self.conn.server.streams_done += 1
        self.conn.stream_done()


class ReplayServer(standin.Server):
    def __init__(self, sets: list[dict[str, Any]]) -> None:
        model = next(iter(sets[0]["streams"].values()))["request"]["model"]
        super().__init__(model)
        self.sets = sets


async def serve(host: str, port: int, sets: list[dict[str, Any]]) -> None:
    loop = asyncio.get_running_loop()
    server = ReplayServer(sets)
    listener = await loop.create_server(
        lambda: Replayer(server), host, port, backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with listener:
        await stop.wait()


# -- the client ----------------------------------------------------------------------------


def percentiles(values: list[int]) -> dict[str, float]:
    """p50/p90/p99/max of microsecond values, in milliseconds."""
    if not values:
        return {}
    data = sorted(values)
    n = len(data)

    def at(q: float) -> float:
        return round(data[min(n - 1, int(q * n))] / 1000, 3)

    return {"p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": round(data[-1] / 1000, 3), "count": n}  # fmt: skip


async def load(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    sets = load_sets(args.recordings)
    plan = [(s, key) for key in sorted(sets[0]["streams"]) for s in range(len(sets))]
    expected: dict[tuple[int, Key], bytes] = {}
    stripped: dict[tuple[int, Key], bytes] = {}
    bodies: dict[tuple[int, Key], bytes] = {}
    for index, found in enumerate(sets):
        for key, stream in found["streams"].items():
            expected[index, key] = body_of(stream)
            bodies[index, key] = json.dumps(stream["request"]).encode()
            if not key[1]:
                stripped[index, key] = without_usage(body_of(found["streams"][key[0], True]))
    ttfc: list[int] = []
    gaps: list[int] = []
    checks: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    events = 0
    next_index = 0

    async def one(client: aiohttp.ClientSession, index: int) -> None:
        nonlocal events
        chosen, key = plan[(index + args.offset) % len(plan)]
        headers = {
            "content-type": "application/json",
            "x-replay-recording": str(chosen),
            "x-replay-pace": args.pace,
            "x-replay-timing": f"{int(key[0])},{int(key[1])}",
        }
        sent = time.monotonic_ns()
        last = 0
        parts: list[bytes] = []
        async with client.post(
            f"{args.url}/v1/chat/completions", data=bodies[chosen, key], headers=headers
        ) as response:
            if response.status != 200:
                errors[f"HTTP {response.status}"] += 1
                await response.read()
                return
            async for data in response.content.iter_any():
                at = time.monotonic_ns()
                if last:
                    gaps.append((at - last) // 1000)
                else:
                    ttfc.append((at - sent) // 1000)
                last = at
                parts.append(data)
        body = b"".join(parts)
        events += body.count(b"\n\ndata: ") + 1 if body else 0
        if body == expected[chosen, key]:
            checks["exact"] += 1
        elif body == stripped.get((chosen, key)):
            checks["exact_less_usage_event"] += 1
        else:
            checks["different"] += 1

    async def worker(client: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < args.requests:
            index = next_index
            next_index += 1
            try:
                await one(client, index)
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as client:
        # open the connections (and the proxy's to upstream) before the clock starts
        warm = min(args.concurrency, args.requests)
        await asyncio.gather(*(client.get(f"{args.url}/v1/models") for _ in range(warm)))
        start = time.monotonic()
        workers = [asyncio.create_task(worker(client)) for _ in range(args.concurrency)]
        _, late = await asyncio.wait(workers, timeout=args.deadline)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        elapsed = time.monotonic() - start
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "pace": args.pace,
        "elapsed_s": round(elapsed, 3),
        "completed": sum(checks.values()),
        "cut_at_deadline": len(late),
        "errors": dict(errors),
        "checks": dict(checks),
        "events": events,
        "events_per_s": round(events / elapsed, 1) if elapsed else 0.0,
        "ttfc": percentiles(ttfc),
        "gap": percentiles(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    serving = modes.add_parser("serve")
    serving.add_argument("--host", default="127.0.0.1")
    serving.add_argument("--port", type=int, required=True)
    loading = modes.add_parser("load")
    loading.add_argument("--url", required=True)
    loading.add_argument("--concurrency", type=int, default=16)
    loading.add_argument("--requests", type=int, default=64)
    loading.add_argument("--pace", choices=("recorded", "unthrottled"), default="recorded")
    loading.add_argument("--offset", type=int, default=0)
    loading.add_argument("--deadline", type=float, default=120.0)
    for mode in (serving, loading):
        mode.add_argument("--recordings", nargs="+", required=True)
    args = parser.parse_args()
    import uvloop  # a vLLM dependency, in the test venv

    if args.mode == "serve":
        uvloop.run(serve(args.host, args.port, load_sets(args.recordings)))
        return
    json.dump(uvloop.run(load(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
