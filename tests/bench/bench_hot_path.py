"""`make bench`: the pass-through's own Python work per chunk and per request.

In this process, no sockets: every stream vLLM 0.28.0, 0.29.0 and 0.33.0 sent on an H200
(`results/e2e/*/*/recorded_streams.json`) goes through the code the sidecar runs for a
chat request without ASGI (mla_serve/sidecar/fast.py's FastExchange, the runaway guard in its
default `observe` mode): the request side (the client's body taken, checked and made into
the bytes for vLLM: `request_body`, `inspect`, `_request_bytes`), then the response side (the
head, every recorded read through the upstream callbacks `body` and `fed`, the end: the last
bytes, the completion settled and counted). Writes go to a transport that keeps them; the
bytes the client would get are checked against the recording, and the ledger's count against
the streams run (exit 1 when either is off).

Reported, not judged: CPU microseconds per request (request side, response side less its
token chunks) and per token chunk (the reads the byte-exact token match takes): the best of
`--repeats` passes over all streams (the usual figure of a microbenchmark: the others are the
same work plus the machine's interruptions), with the median and the worst beside it. This
is the interpreter's work with warm caches only: no system calls, no event loop turn per
read, no cold wake-up. It says what a change to the hot path saves, without the noise of a
process benchmark; the process benchmarks (bench_replay, the live bench) say what that is
worth.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from mla_serve.sidecar import fast, proxy, upstream
from mla_serve.sidecar.loops import LoopGuard
from mla_serve.sidecar.runaways import Ledger
from mla_serve.sidecar.settings import Settings
from tests.bench.passthrough import replay
from tests.bench.passthrough.replay import RECORDINGS
from tests.hostile.wire import dechunk

ROOT = Path(__file__).resolve().parents[2]
PATH = "/v1/chat/completions"
# The request headers the official openai client sends, less its per-request id.
CLIENT_HEADERS = [
    (b"host", b"127.0.0.1:8080"), (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"), (b"accept", b"application/json"),
    (b"content-type", b"application/json"), (b"user-agent", b"OpenAI/Python 2.8.1"),
    (b"x-stainless-lang", b"python"), (b"x-stainless-package-version", b"2.8.1"),
    (b"x-stainless-os", b"Linux"), (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"), (b"x-stainless-runtime-version", b"3.12.3"),
    (b"authorization", b"Bearer sk-bench"), (b"x-stainless-async", b"async:asyncio"),
    (b"x-stainless-retry-count", b"0"), (b"x-stainless-read-timeout", b"600"),
]  # fmt: skip


class Transport:
    """The client's transport: keeps what is written."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Flow:
    write_paused = False


class ServerState:
    def __init__(self) -> None:
        self.default_headers = [(b"date", b"Tue, 01 Dec 2026 00:00:00 GMT")]


class Protocol:
    """What FastExchange uses of the sidecar's httptools protocol."""

    def __init__(self, loop: asyncio.AbstractEventLoop, body_length: int) -> None:
        self.loop = loop
        self.transport = Transport()
        self.flow = Flow()
        self.server_state = ServerState()
        self.headers = [*CLIENT_HEADERS, (b"content-length", b"%d" % body_length)]
        self.client = ("10.0.0.7", 40312)
        self.scheme = "http"
        self.fast: Any = None
        self.completed = 0

    def on_response_complete(self) -> None:
        self.completed += 1


def load(pattern: str) -> list[dict[str, Any]]:
    """Each recorded stream (replay.load_sets reads the files): the request (asking for
    usage, as the live bench does), vLLM's headers, its reads."""
    streams = []
    for recorded_set in replay.load_sets([str(p) for p in sorted(ROOT.glob(pattern))]):
        for recorded in recorded_set["streams"].values():
            request = {**recorded["request"], "stream_options": {"include_usage": True}}
            headers = recorded["headers"]
            pairs = headers.items() if isinstance(headers, dict) else headers
            streams.append({
                "body": json.dumps(request).encode(),
                "headers": [(k.encode(), v.encode()) for k, v in pairs],
                "reads": [text.encode() for _, text in recorded["chunks"]],
            })  # fmt: skip
    return streams


class VllmTransport:
    """vLLM's side of a connection: keeps what the sidecar writes to it."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def frame(event: bytes) -> bytes:
    """One HTTP/1.1 chunk, as vLLM's uvicorn writes it."""
    return b"%x\r\n%b\r\n" % (len(event), event)


def response_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """vLLM's status line and headers, as its uvicorn writes them."""
    lines = [b"HTTP/1.1 200 OK\r\n", *(b"%s: %s\r\n" % pair for pair in headers), b"\r\n"]
    return b"".join(lines)


class HotPath:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        settings = Settings(vllm_url="http://127.0.0.1:8000")
        registry = self.registry = CollectorRegistry()
        self.ledger = Ledger(registry, "bench_")
        loops = LoopGuard(settings.loop_policy(), registry)
        proxy_settings = proxy.ProxySettings(upstream=settings.vllm_url, upstream_client="direct")
        self.proxy = proxy.Proxy(proxy_settings, self.ledger, loops, registry)
        # vLLM's connection pool, as Proxy.start makes it (nothing connects: no request goes out)
        self.proxy.pool = upstream.Pool(settings.vllm_url, proxy_settings.connect_timeout)
        self.fast = fast.FastPath(self.proxy, None)
        self.loop = loop

    def request(self, stream: dict[str, Any]) -> fast.FastExchange:
        protocol = Protocol(self.loop, len(stream["body"]))
        exchange = fast.FastExchange(self.fast, protocol, PATH, True)
        exchange.request_body(stream["body"])
        request = exchange.request
        proxy.inspect(request, self.proxy.settings.max_json_values, self.proxy.loops, PATH)
        exchange.payload = self.proxy._request_bytes(exchange.scope, PATH, request.body[0])
        request.body.clear()
        self.proxy._release(request)
        return exchange

    def connect(self, exchange: fast.FastExchange) -> upstream.Connection:
        """The request (made by `request`) sent on a pooled connection to vLLM (no socket),
        as request_done sends it; its `data_received` takes vLLM's reads (the C lane's where
        built and the pool's `lane` is on)."""
        pool = self.proxy.pool
        assert pool is not None
        conn = upstream.Connection(pool)
        conn.connection_made(VllmTransport())  # type: ignore[arg-type]
        pool.idle.append((conn, self.loop.time()))
        exchange.reading = False
        exchange._attempt()
        assert exchange.conn is conn
        return conn

    def response(self, exchange: fast.FastExchange, stream: dict[str, Any]) -> None:
        exchange.head(200, stream["headers"])
        for data in stream["reads"]:
            exchange.body(data)
            exchange.fed()
        exchange.complete = exchange.finished = True
        exchange._end()

    def counted(self) -> float:
        """Completions the ledger has counted (every model and finish reason)."""
        return sum(
            sample.value
            for metric in self.registry.collect()
            if metric.name == "bench_completions"
            for sample in metric.samples
            if sample.name == "bench_completions_total"
        )

    def tokens_of(self, stream: dict[str, Any]) -> int:
        """How many of the stream's reads the token match takes (run once, counted)."""
        taken = 0
        original = proxy.token_chunk

        def counting(*args: Any) -> bool | None:
            nonlocal taken
            verdict = original(*args)
            taken += verdict is not None
            return verdict

        proxy.token_chunk = counting
        try:
            self.response(self.request(stream), stream)
        finally:
            proxy.token_chunk = original
        return taken


def timed(fn: Any, items: list[Any]) -> float:
    """CPU microseconds for `fn` over `items`, the garbage collector off (as timeit does)."""
    gc.collect()
    gc.disable()
    try:
        began = time.process_time_ns()
        for item in items:
            fn(item)
        return (time.process_time_ns() - began) / 1e3
    finally:
        gc.enable()


async def measure(streams: list[dict[str, Any]], repeats: int, scale: int) -> dict[str, Any]:
    hot = HotPath(asyncio.get_running_loop())
    problems = []
    before = hot.counted()
    for number, stream in enumerate(streams):  # the bytes the client gets: vLLM's, unchanged
        exchange = hot.request(stream)
        hot.response(exchange, stream)
        wire = b"".join(exchange.protocol.transport.out)
        head, _, body = wire.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or dechunk(body) != b"".join(stream["reads"]):
            problems.append(f"stream {number}: the client's bytes differ from vLLM's")
    if hot.counted() - before != len(streams):
        problems.append(f"the ledger counted {hot.counted() - before:g} of {len(streams)} streams")
    tokens = sum(hot.tokens_of(stream) for stream in streams)
    reads = sum(len(stream["reads"]) for stream in streams)
    batch = streams * scale
    passes: dict[str, list[float]] = {"request": [], "response": []}
    for _ in range(repeats):
        exchanges: list[fast.FastExchange] = []
        keep = exchanges.append
        passes["request"].append(timed(lambda s, keep=keep: keep(hot.request(s)), batch))
        pairs = list(zip(exchanges, batch, strict=True))
        passes["response"].append(timed(lambda pair: hot.response(*pair), pairs))
    n = len(batch)
    # Token chunks against the rest: the same streams with their token reads only, so the
    # response side splits into a part per token chunk and a part per request.
    only_tokens = []
    for stream in streams:
        exchange = hot.request(stream)
        exchange.head(200, stream["headers"])
        token_reads = []
        for data in stream["reads"]:
            head = exchange.head_bytes
            if head is not None and data.startswith(head):
                token_reads.append(data)
            exchange.body(data)
        only_tokens.append((exchange, token_reads))

    def token_pass(_: object) -> None:
        for exchange, token_reads in only_tokens:
            for data in token_reads:
                exchange.body(data)
                exchange.fed()

    per_token = [timed(token_pass, [None] * scale) / (tokens * scale) for _ in range(repeats)]
    per_read = {"python": per_token_read(hot, streams, False, repeats, scale)}
    if per_read["python"][1]:
        problems.append("the Python path's token reads went through the lane")
    if upstream._lane is not None:
        per_read["lane"] = per_token_read(hot, streams, True, repeats, scale)
        if per_read["lane"][1] < 0.5:
            problems.append(f"the lane took only {per_read['lane'][1]:.0%} of the token reads")
    token_us = min(per_token)
    response_us = [t / n for t in passes["response"]]
    rest = [r - token_us * tokens / len(streams) for r in response_us]

    def spread(values: list[float]) -> dict[str, float]:
        return {"best": round(min(values), 2), "median": round(statistics.median(values), 2),
                "max": round(max(values), 2)}  # fmt: skip

    return {
        "streams": len(streams),
        "reads": reads,
        "token_reads": tokens,
        "requests_per_pass": n,
        "repeats": repeats,
        "us_per_request_request_side": spread([t / n for t in passes["request"]]),
        "us_per_request_response_side": spread(response_us),
        "us_per_token_chunk": spread(per_token),
        "us_per_request_response_less_token_chunks": spread(rest),
        # the whole read of a token chunk: Connection.data_received (httptools, the
        # exchange), or the C lane's (_lane.c) where it takes the read
        "us_per_token_read": {way: spread(times) for way, (times, _) in per_read.items()},
        "lane_took": per_read["lane"][1] if "lane" in per_read else None,
        "problems": problems,
    }


def per_token_read(
    hot: HotPath, streams: list[dict[str, Any]], lane: bool, repeats: int, scale: int
) -> tuple[list[float], float]:
    """Microseconds per read of one token chunk through the connection (each stream's
    response read first, the Python path arming the lane as it does), and the share of
    those reads the lane took."""
    pool = hot.proxy.pool
    assert pool is not None
    saved = pool.lane
    pool.lane = lane and upstream._lane is not None
    try:
        setups = []
        for stream in streams:
            exchange = hot.request(stream)
            conn = hot.connect(exchange)
            conn.data_received(response_head([*stream["headers"],
                                              (b"transfer-encoding", b"chunked")]))  # fmt: skip
            token_reads = []
            for data in stream["reads"]:
                head = exchange.head_bytes
                if head is not None and data.startswith(head):
                    token_reads.append(frame(data))
                conn.data_received(frame(data))
            exchange.protocol.transport.out.clear()
            setups.append((conn, token_reads))
        count = sum(len(reads) for _, reads in setups) * scale

        def read_pass(_: object) -> None:
            for conn, token_reads in setups:
                for data in token_reads:
                    conn.data_received(data)

        taken = upstream._lane.taken() if upstream._lane is not None else 0
        times = [timed(read_pass, [None] * scale) / count for _ in range(repeats)]
        taken = (upstream._lane.taken() if upstream._lane is not None else 0) - taken
        return times, round(taken / (count * repeats), 4)
    finally:
        pool.lane = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--recordings", default=RECORDINGS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=int, default=20, help="passes over all streams per repeat")
    args = parser.parse_args(argv)
    streams = load(args.recordings)
    if not streams:
        print(f"no recorded streams under {args.recordings}", file=sys.stderr)
        return 1
    result = asyncio.run(measure(streams, args.repeats, args.scale))
    result["what"] = ("IN-PROCESS, warm caches, no sockets: the pass-through's work on real vLLM "
                      "streams (fast.py's FastExchange, guard observing; token reads also "
                      "through the C lane)")  # fmt: skip
    result["python"] = platform.python_version()
    result["machine"] = platform.machine()
    print(result["what"])
    print(f"{result['streams']} streams, {result['reads']} reads, {result['token_reads']} token "
          f"chunks; Python {result['python']}")  # fmt: skip
    for key in ("us_per_request_request_side", "us_per_request_response_side",
                "us_per_request_response_less_token_chunks", "us_per_token_chunk"):  # fmt: skip
        b = result[key]
        print(f"  {key:45s} best {b['best']:8.2f} us, median {b['median']:.2f}, max {b['max']:.2f}")
    for way, b in result["us_per_token_read"].items():
        took = f" (the lane took {result['lane_took']:.1%} of them)" if way == "lane" else ""
        print(f"  us_per_token_read, {way:6s}                    best {b['best']:8.2f} us, "
              f"median {b['median']:.2f}, max {b['max']:.2f}{took}")  # fmt: skip
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
