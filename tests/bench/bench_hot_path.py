"""`make bench`: the pass-through's own Python work per chunk and per request.

In this process, no sockets: every stream vLLM 0.28.0, 0.29.0 and 0.33.0 sent on an H200
(`results/e2e/*/*/recorded_streams.json`) goes through the code the sidecar runs for a
chat request on its own front (passthrough/exchange.py's Exchange with a fronts.TransportFront,
the runaway guard in its default `observe` mode): the request side (the client's body taken,
checked and made into the bytes for vLLM, written on a pooled connection), then the response
side (the head, every recorded read through the upstream callbacks `body` and `fed`, the end:
the last bytes, the completion settled and counted). Writes go to a transport that keeps
them; the bytes the client would get are checked against the recording, and the ledger's
count against the streams run (exit 1 when either is off).

Reported, not judged: CPU microseconds per request (request side, response side less its
token chunks) and per token chunk, the best of `--repeats` passes over all streams (the
usual figure of a microbenchmark: the others are the same work plus the machine's
interruptions), with the median and the worst beside it; and the whole read of one token
chunk through the connection three ways, on the same reads: the Python path as it is (the
stream's token shape, classify.TokenShape), the Python path with msgspec's typed JSON
decoder (a library vLLM's image carries) in place of the shape, and the C lane. This is the
interpreter's work with warm caches only: no system calls, no event loop turn per read, no
cold wake-up. It says what a change to the hot path saves, without the noise of a process
benchmark; the process benchmarks (bench_replay, the live bench) say what that is worth.
`--compare-src DIR` runs another checkout's own bench_hot_path in turn with this one, round
for round (paired), so a before/after is one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from mla_serve.sidecar.guard.loops import LoopGuard
from mla_serve.sidecar.passthrough import lane, upstream
from mla_serve.sidecar.passthrough.exchange import Exchange, admit
from mla_serve.sidecar.passthrough.fronts import TransportFront
from mla_serve.sidecar.passthrough.runaways import Ledger
from mla_serve.sidecar.passthrough.service import PassThrough
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
    """What the transport front uses of the sidecar's httptools protocol (fronts.FrontClient),
    and the request's head as the protocol parsed it."""

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

    def default_headers(self) -> list[tuple[bytes, bytes]]:
        return self.server_state.default_headers

    def front_done(self, front: Any) -> None:
        if self.fast is front:
            self.fast = None
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
    def __init__(self, loop: asyncio.AbstractEventLoop, lane_on: bool = True) -> None:
        settings = Settings(vllm_url="http://127.0.0.1:8000")
        registry = self.registry = CollectorRegistry()
        self.ledger = Ledger(registry, "bench_")
        loops = LoopGuard(settings.loop_policy, registry)
        self.service = PassThrough(settings, self.ledger, loops, registry)
        # vLLM's connection pool, as PassThrough.start makes it (nothing connects: the
        # connections are made here, on transports that keep what is written)
        self.service.pool = upstream.Pool(settings.vllm_url, settings.connect_timeout,
                                          lane_on=lane_on)  # fmt: skip
        self.loop = loop

    def request(self, stream: dict[str, Any]) -> Exchange:
        """The client's request read (its head, then its body, as the protocol hands them on)
        and sent to vLLM on a pooled connection."""
        protocol = Protocol(self.loop, len(stream["body"]))
        front = TransportFront(protocol, keep_alive=True, http10=False)
        exchange = admit(self.service, front, b"POST", PATH, b"", protocol.headers, "10.0.0.7",
                                     b"http", True)  # fmt: skip
        assert exchange is not None
        front.exchange = exchange
        protocol.fast = front
        exchange.begin(len(stream["body"]))
        exchange.take_body(stream["body"])
        exchange.body_done()
        return exchange

    def pooled(self, count: int = 1) -> None:
        """Connections to vLLM (no socket) idle in the pool, one for each next request."""
        pool = self.service.pool
        assert pool is not None
        for _ in range(count):
            conn = upstream.Connection(pool)
            conn.connection_made(VllmTransport())  # type: ignore[arg-type]
            pool.idle.append((conn, self.loop.time()))

    def response(self, exchange: Exchange, stream: dict[str, Any]) -> None:
        """vLLM's response through the connection's callbacks: the head (which answers where
        the body's pieces go), each read's pieces and the batch's write, the end."""
        piece = exchange.head(200, stream["headers"])
        for data in stream["reads"]:
            piece(data)
            exchange.fed()
        exchange.end()

    def counted(self) -> float:
        """Completions the ledger has counted (every model and finish reason)."""
        return sum(
            sample.value
            for metric in self.registry.collect()
            if metric.name == "bench_completions"
            for sample in metric.samples
            if sample.name == "bench_completions_total"
        )


def transport_of(exchange: Exchange) -> Transport:
    return exchange.front.transport  # type: ignore[attr-defined,no-any-return]


def chunked(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """vLLM's recorded headers with `transfer-encoding: chunked` once (the pass-through
    refuses chunked applied twice, RFC 9112 section 6.1)."""
    if any(name.lower() == b"transfer-encoding" for name, _ in headers):
        return headers
    return [*headers, (b"transfer-encoding", b"chunked")]


def shape_of(exchange: Exchange) -> Any:
    """The stream's token shape as learnt so far (None before it is)."""
    reader = exchange.reader
    return None if reader is None else reader.shape


# msgspec's typed decoder in place of the token shape: a library vLLM's image carries, on the
# same reads (a chunk decoded into these structs, then checked to be a token chunk).
class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    role: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    index: int
    delta: _Delta | None = None
    text: str | None = None
    logprobs: Any = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: Any = None


class MsgspecShape:
    """classify.TokenShape's `match`, by msgspec: (channel, text) of a token chunk."""

    decoder = msgspec.json.Decoder(_Chunk)

    def __init__(self, shape: Any) -> None:
        self.shape = shape

    def match(self, event: bytes) -> tuple[str, str] | None:
        if not event.startswith(b"data: {") or not event.endswith(b"\n\n"):
            return None
        try:
            chunk = self.decoder.decode(event[6:])
        except msgspec.DecodeError:
            return None
        if len(chunk.choices) != 1 or chunk.usage is not None:
            return None
        choice = chunk.choices[0]
        if choice.index != 0 or choice.finish_reason is not None or choice.logprobs is not None:
            return None
        delta = choice.delta
        if delta is None:
            return ("text", choice.text) if choice.text is not None else None
        if delta.role is not None or delta.tool_calls is not None:
            return None
        if delta.content is not None and delta.reasoning is None:
            return "content", delta.content
        if delta.reasoning is not None and delta.content is None:
            return "reasoning", delta.reasoning
        return None


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
    tokens = 0
    for number, stream in enumerate(streams):  # the bytes the client gets: vLLM's, unchanged
        hot.pooled()
        exchange = hot.request(stream)
        piece = exchange.head(200, stream["headers"])
        for data in stream["reads"]:
            shape = shape_of(exchange)
            tokens += shape is not None and shape.match(data) is not None
            piece(data)
            exchange.fed()
        exchange.end()
        wire = b"".join(transport_of(exchange).out)
        head, _, body = wire.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200") or dechunk(body) != b"".join(stream["reads"]):
            problems.append(f"stream {number}: the client's bytes differ from vLLM's")
    if hot.counted() - before != len(streams):
        problems.append(f"the ledger counted {hot.counted() - before:g} of {len(streams)} streams")
    reads = sum(len(stream["reads"]) for stream in streams)
    batch = streams * scale
    passes: dict[str, list[float]] = {"request": [], "response": []}
    for _ in range(repeats):
        exchanges: list[Exchange] = []
        keep = exchanges.append
        hot.pooled(len(batch))
        passes["request"].append(timed(lambda s, keep=keep: keep(hot.request(s)), batch))
        pairs = list(zip(exchanges, batch, strict=True))
        passes["response"].append(timed(lambda pair: hot.response(*pair), pairs))
    n = len(batch)
    # Token chunks against the rest: the same streams with their token reads only, so the
    # response side splits into a part per token chunk and a part per request.
    only_tokens = []
    for stream in streams:
        hot.pooled()
        exchange = hot.request(stream)
        piece = exchange.head(200, stream["headers"])
        token_reads = []
        for data in stream["reads"]:
            shape = shape_of(exchange)
            if shape is not None and shape.match(data) is not None:
                token_reads.append(data)
            piece(data)
            exchange.fed()
        only_tokens.append((exchange, piece, token_reads))

    def token_pass(_: object) -> None:
        for exchange, piece, token_reads in only_tokens:
            for data in token_reads:
                piece(data)
                exchange.fed()

    if not tokens:
        problems.append("no read was taken as a token chunk")
    per_token = [timed(token_pass, [None] * scale) / (max(tokens, 1) * scale)
                 for _ in range(repeats)]  # fmt: skip
    per_read = {"python": per_token_read(streams, "python", repeats, scale)}
    if per_read["python"][1]:
        problems.append("the Python path's token reads went through the lane")
    per_read["msgspec"] = per_token_read(streams, "msgspec", repeats, scale)
    if lane.BUILT:
        per_read["lane"] = per_token_read(streams, "lane", repeats, scale)
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
        # exchange's token shape, or msgspec in its place), or the C lane's (_lane.c)
        "us_per_token_read": {way: spread(times) for way, (times, _) in per_read.items()},
        "lane_took": per_read["lane"][1] if "lane" in per_read else None,
        "problems": problems,
    }


def per_token_read(
    streams: list[dict[str, Any]], way: str, repeats: int, scale: int
) -> tuple[list[float], float]:
    """Microseconds per read of one token chunk through the connection (each stream's
    response read first, the Python path arming the lane as it does), and the share of
    those reads the lane took. `way`: python, msgspec (its decoder in place of the token
    shape), lane."""
    hot = HotPath(asyncio.get_event_loop(), lane_on=way == "lane")
    setups = []
    for stream in streams:
        hot.pooled()
        exchange = hot.request(stream)
        conn = exchange.conn
        assert conn is not None
        conn.data_received(response_head(chunked(stream["headers"])))
        token_reads = []
        for data in stream["reads"]:
            shape = shape_of(exchange)
            if shape is not None and shape.match(data) is not None:
                token_reads.append(frame(data))
            conn.data_received(frame(data))
        reader = exchange.reader
        if way == "msgspec" and reader is not None and reader.shape is not None:
            reader.shape = MsgspecShape(reader.shape)  # type: ignore[assignment]
        transport_of(exchange).out.clear()
        setups.append((conn, token_reads))
    count = sum(len(reads) for _, reads in setups) * scale

    def read_pass(_: object) -> None:
        for conn, token_reads in setups:
            for data in token_reads:
                conn.data_received(data)

    taken = lane.taken()
    times = [timed(read_pass, [None] * scale) / count for _ in range(repeats)]
    taken = lane.taken() - taken
    return times, round(taken / (count * repeats), 4)


FIGURES = (
    "us_per_request_request_side", "us_per_request_response_side",
    "us_per_request_response_less_token_chunks", "us_per_token_chunk",
)  # fmt: skip


def compare(args: argparse.Namespace) -> int:
    """This checkout's bench and `--compare-src`'s own, one after the other per round, in
    processes of their own (the same Python): each figure's best over the rounds, and the
    ratio this / that per round (its median and range)."""
    other = args.compare_src.resolve()
    if not (other / "tests" / "bench" / "bench_hot_path.py").is_file():
        print(f"--compare-src {other}: no tests/bench/bench_hot_path.py there", file=sys.stderr)
        return 2
    rounds: dict[str, list[dict[str, Any]]] = {"this": [], "that": []}
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.rounds):
            for name, root in (("this", ROOT), ("that", other)):
                out = Path(scratch) / f"{name}-{number}.json"
                subprocess.run(
                    [sys.executable, "-m", "tests.bench.bench_hot_path", "--out", str(out),
                     "--repeats", str(args.repeats), "--scale", str(args.scale)],
                    cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                    check=False, stdout=subprocess.DEVNULL,
                )  # fmt: skip
                rounds[name].append(json.loads(out.read_text()))
    result: dict[str, Any] = {"rounds": args.rounds, "this": str(ROOT), "that": str(other)}
    keys = [*FIGURES, *(f"us_per_token_read/{way}" for way in ("python", "lane"))]
    for key in keys:

        def best(run: dict[str, Any], key: str = key) -> float | None:
            if "/" in key:
                section, way = key.split("/")
                value = run[section].get(way)
                return None if value is None else float(value["best"])
            return float(run[key]["best"])

        pairs = [(best(a), best(b)) for a, b in zip(rounds["this"], rounds["that"], strict=True)]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        if not pairs:
            continue
        ratios = sorted(a / b for a, b in pairs)
        result[key] = {
            "this_best": min(a for a, _ in pairs), "that_best": min(b for _, b in pairs),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        }  # fmt: skip
        figure = result[key]
        print(f"  {key:45s} this {figure['this_best']:7.2f} us, that {figure['that_best']:7.2f} "
              f"us: this/that {figure['ratio_median']:.3f} ({figure['ratio_range'][0]:.3f}-"
              f"{figure['ratio_range'][1]:.3f})")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--recordings", default=RECORDINGS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=int, default=20, help="passes over all streams per repeat")
    parser.add_argument("--compare-src", type=Path, default=None,
                        help="another checkout (its C lane built in place): its bench_hot_path "
                        "and this one's, round for round")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --compare-src")
    args = parser.parse_args(argv)
    if args.compare_src is not None:
        return compare(args)
    streams = load(args.recordings)
    if not streams:
        print(f"no recorded streams under {args.recordings}", file=sys.stderr)
        return 1
    result = asyncio.run(measure(streams, args.repeats, args.scale))
    result["what"] = (
        "IN-PROCESS, warm caches, no sockets: the pass-through's work on real vLLM streams (the "
        "exchange on its own front, guard observing; token reads also with msgspec in place "
        "of the token shape, and through the C lane)"
    )
    result["python"] = platform.python_version()
    result["machine"] = platform.machine()
    print(result["what"])
    print(f"{result['streams']} streams, {result['reads']} reads, {result['token_reads']} token "
          f"chunks; Python {result['python']}")  # fmt: skip
    for key in FIGURES:
        b = result[key]
        print(f"  {key:45s} best {b['best']:8.2f} us, median {b['median']:.2f}, max {b['max']:.2f}")
    for way, b in result["us_per_token_read"].items():
        took = f" (the lane took {result['lane_took']:.1%} of them)" if way == "lane" else ""
        print(f"  us_per_token_read, {way:7s}                   best {b['best']:8.2f} us, "
              f"median {b['median']:.2f}, max {b['max']:.2f}{took}")  # fmt: skip
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
