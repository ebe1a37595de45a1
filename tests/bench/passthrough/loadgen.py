"""The load generator of bench_passthrough.py, run in its own process (aiohttp on uvloop).

    loadgen.py production --url URL --streams 256 --rate 50 --tokens 1000
    loadgen.py saturation --url URL --streams 64 --tokens 2000 --warmup 2 --window 15
    loadgen.py mix --url URL --requests 10000 --concurrency 32

Each prints one JSON object on stdout. The stand-in upstream (upstream.py) writes every token
as `"<seq>@<t_us> "`, t_us its CLOCK_MONOTONIC microseconds, which this process shares: the
client checks that every stream carries 1..N in order and measures each chunk's delay.

- production: streams start spread over --ramp seconds (seeded), after a warm-up (twice
  --streams concurrent short chats) that opens the keep-alive connections and takes the
  server's chat path through its first requests; per stream, the time to first byte
  (request sent to the first bytes of the body, which carry the role chunk), every gap
  between consecutive token chunks, and each token chunk's delay (arrival minus the
  upstream's write time).
- saturation: --streams unthrottled streams, each replaced when it ends; SSE events counted as
  they arrive, over --window seconds after --warmup.
- mix: the RSS workload: streaming and non-streaming chats, runaways (finish_reason length,
  reasoning only), model listings; every answer is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from typing import Any

import aiohttp

MODEL_DEFAULT = "glm-5.3-flash"
TOKEN = re.compile(rb'"(content|reasoning|reasoning_content)":\s?"(\d+)@(\d+) ')
FINISH = re.compile(rb'"finish_reason":\s?"(\w+)"')
DONE = b"data: [DONE]"
SEPARATOR = re.compile(rb"\r?\n\r?\n")


def now_us() -> int:
    return time.monotonic_ns() // 1000


def chat_body(
    model: str,
    tokens: int,
    rate: float,
    *,
    stream: bool,
    reasoning: int = 0,
    finish: str = "stop",
    usage: bool = False,
    align: str = "stream",
) -> dict[str, Any]:
    directive = f"bench tokens={tokens} rate={rate:g} reasoning={reasoning} finish={finish}"
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "user", "content": f"{directive} align={align}"},
        ],
        "max_tokens": tokens,
        "stream": stream,
    }
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def session(api_key: str) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, force_close=False, keepalive_timeout=120, ttl_dns_cache=None
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60),
        auto_decompress=False,
        headers={"Authorization": f"Bearer {api_key}"},
    )


async def warm_up(client: aiohttp.ClientSession, url: str, model: str, count: int) -> None:
    """`count` concurrent short streamed chats: open as many keep-alive connections (to the
    proxy and, through it, upstream) and take the chat path through its first requests."""

    async def one() -> None:
        body = chat_body(model, 4, 0, stream=True, usage=True)
        async with client.post(f"{url}/v1/chat/completions", json=body) as response:
            await response.read()

    for _ in range(2):
        await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)


def percentiles(values: list[int] | list[float], scale: float = 1e-3) -> dict[str, float]:
    """p50/p99/p99.9/max of microsecond values, in milliseconds."""
    if not values:
        return {}
    data = sorted(values)
    n = len(data)

    def at(q: float) -> float:
        return round(data[min(n - 1, int(q * n))] * scale, 3)

    return {
        "p50_ms": at(0.50),
        "p90_ms": at(0.90),
        "p99_ms": at(0.99),
        "p999_ms": at(0.999),
        "max_ms": round(data[-1] * scale, 3),
        "count": n,
    }


class StreamRecord:
    __slots__ = (
        "delays",
        "done",
        "duplicated",
        "error",
        "finish",
        "first_us",
        "gaps",
        "last_seq",
        "last_us",
        "reordered",
        "seen",
        "sent_us",
        "tokens",
        "usage",
    )

    def __init__(self) -> None:
        self.sent_us = 0
        self.first_us = 0
        self.last_us = 0
        self.last_seq = 0  # the highest sequence number seen
        self.tokens = 0
        self.seen: set[int] = set()
        self.reordered = 0  # came after a higher one
        self.duplicated = 0
        self.gaps: list[int] = []
        self.delays: list[int] = []
        self.finish: str | None = None
        self.usage = False
        self.done = False
        self.error: str | None = None

    def lost(self, expected: int) -> int:
        """Tokens missing: of all `expected` once the stream ended, else of those up to the last."""
        return (expected if self.done else self.last_seq) - len(self.seen)

    def event(self, event: bytes, at: int) -> None:
        if event.startswith(DONE):
            self.done = True
            return
        match = TOKEN.search(event)
        if match is not None:
            seq = int(match.group(2))
            self.tokens += 1
            if seq in self.seen:
                self.duplicated += 1
            elif seq < self.last_seq:
                self.reordered += 1
            self.seen.add(seq)
            if self.last_seq:
                self.gaps.append(at - self.last_us)
            self.last_seq = max(seq, self.last_seq)
            self.last_us = at
            self.delays.append(at - int(match.group(3)))
        finish = FINISH.search(event)
        if finish is not None:
            self.finish = finish.group(1).decode()
        if b'"usage":{' in event:
            self.usage = True


async def read_stream(response: aiohttp.ClientResponse, record: StreamRecord) -> None:
    pending = b""
    async for data in response.content.iter_any():
        at = now_us()
        if not record.first_us:
            record.first_us = at
        pending += data
        if b"\n\n" not in pending and b"\n\r\n" not in pending:
            continue
        *events, pending = SEPARATOR.split(pending)
        for event in events:
            record.event(event, at)


async def production(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    records = [StreamRecord() for _ in range(args.streams)]
    rng = random.Random(args.seed)
    offsets = sorted(rng.uniform(0, args.ramp) for _ in range(args.streams))
    async with session(args.api_key) as client:
        await warm_up(client, url, args.model, args.streams)
        await asyncio.sleep(0.5)
        start = time.monotonic()

        async def one(index: int) -> None:
            record = records[index]
            await asyncio.sleep(max(0.0, start + offsets[index] - time.monotonic()))
            body = chat_body(
                args.model, args.tokens, args.rate, stream=True, usage=True, align=args.align
            )
            record.sent_us = now_us()
            try:
                async with client.post(f"{url}/v1/chat/completions", json=body) as response:
                    if response.status != 200:
                        text = (await response.read())[:300]
                        record.error = f"HTTP {response.status}: {text!r}"
                        return
                    await read_stream(response, record)
            except (aiohttp.ClientError, TimeoutError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"

        tasks = [asyncio.create_task(one(i)) for i in range(args.streams)]
        _, late = await asyncio.wait(tasks, timeout=args.deadline)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        elapsed = time.monotonic() - start
    return summarize_production(args, records, elapsed, len(late))


def summarize_production(
    args: argparse.Namespace, records: list[StreamRecord], elapsed: float, late: int
) -> dict[str, Any]:
    ttfb = [r.first_us - r.sent_us for r in records if r.first_us]
    gaps = [g for r in records for g in r.gaps]
    delays = [d for r in records for d in r.delays]
    errors = Counter(r.error for r in records if r.error)
    complete = [r for r in records if r.done and r.last_seq == args.tokens]
    return {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rate_per_stream": args.rate,
        "ramp_s": args.ramp,
        "align": args.align,
        "elapsed_s": round(elapsed, 2),
        "streams_complete": len(complete),
        "streams_cut_at_deadline": late,
        "streams_failed": sum(errors.values()),
        "errors": dict(errors.most_common(5)),
        "chunks_expected": args.streams * args.tokens,
        "chunks_received": sum(r.tokens for r in records),
        "chunks_lost": sum(r.lost(args.tokens) for r in records),
        "chunks_out_of_order": sum(r.reordered for r in records),
        "chunks_duplicated": sum(r.duplicated for r in records),
        "finish_reasons": dict(Counter(r.finish for r in records if r.done)),
        "usage_chunks": sum(r.usage for r in records),
        "done_markers": sum(r.done for r in records),
        "ttfb": percentiles(ttfb),
        "inter_chunk_gap": percentiles(gaps),
        "chunk_delay": percentiles(delays),
    }


async def saturation(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    window_start = window_end = 0.0
    counted = total = 0
    buckets: Counter[int] = Counter()
    streams_done = 0
    errors: Counter[str] = Counter()
    stop = False

    async def worker() -> None:
        nonlocal counted, total, streams_done
        body = chat_body(args.model, args.tokens, 0, stream=True)
        while not stop:
            try:
                async with client.post(f"{url}/v1/chat/completions", json=body) as response:
                    if response.status != 200:
                        errors[f"HTTP {response.status}"] += 1
                        await response.read()
                        await asyncio.sleep(0.1)
                        continue
                    tail = b""
                    async for data in response.content.iter_any():
                        # SSE events: "data:" lines, one also when split between two reads
                        joined = tail + data
                        events = joined.count(b"data:") - tail.count(b"data:")
                        tail = joined[-4:]
                        total += events
                        now = time.monotonic()
                        if window_start <= now < window_end:
                            counted += events
                            buckets[int(now - window_start)] += events
                        if stop:
                            break
                    streams_done += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1
                await asyncio.sleep(0.1)

    async with session(args.api_key) as client:
        await warm_up(client, url, args.model, args.streams)
        begin = time.monotonic()
        window_start = begin + args.warmup
        window_end = window_start + args.window
        tasks = [asyncio.create_task(worker()) for _ in range(args.streams)]
        await asyncio.sleep(window_start - time.monotonic())
        print("WINDOW START", flush=True)  # the parent reads the proxy's CPU time here
        await asyncio.sleep(window_end - time.monotonic())
        print("WINDOW END", flush=True)
        stop = True
        await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    per_second = [buckets[i] for i in range(int(args.window))]
    return {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "warmup_s": args.warmup,
        "window_s": args.window,
        "events": counted,
        "events_per_s": round(counted / args.window, 1),
        "events_total": total,
        "events_per_s_min_1s": min(per_second) if per_second else 0,
        "events_per_s_max_1s": max(per_second) if per_second else 0,
        "streams_finished": streams_done,
        "errors": dict(errors.most_common(5)),
    }


MIX = (
    "stream",
    "stream",
    "stream",
    "stream",
    "stream-usage",
    "plain",
    "plain",
    "runaway-stream",
    "runaway-plain",
    "models",
)


async def mix(args: argparse.Namespace) -> dict[str, Any]:
    url = args.url.rstrip("/")
    kinds: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    next_index = 0

    async def one(client: aiohttp.ClientSession, index: int) -> None:
        kind = MIX[index % len(MIX)]
        kinds[kind] += 1
        if kind == "models":
            async with client.get(f"{url}/v1/models") as response:
                body = await response.read()
                if response.status != 200 or b'"object":"list"' not in body.replace(b" ", b""):
                    errors[f"{kind}: HTTP {response.status}"] += 1
            return
        runaway = kind.startswith("runaway")
        tokens = 64 if runaway else 32
        stream = kind.startswith(("stream", "runaway-stream"))
        body = chat_body(
            args.model,
            tokens,
            0,
            stream=stream,
            reasoning=tokens if runaway else 8,
            finish="length" if runaway else "stop",
            usage=kind == "stream-usage",
        )
        async with client.post(f"{url}/v1/chat/completions", json=body) as response:
            data = await response.read()
            if response.status != 200:
                errors[f"{kind}: HTTP {response.status}"] += 1
                return
            want = b"length" if runaway else b"stop"
            finish = FINISH.findall(data)
            if want not in finish:
                errors[f"{kind}: finish_reason {finish[-1:]!r}"] += 1
            elif stream and DONE not in data:
                errors[f"{kind}: no [DONE]"] += 1

    async def worker(client: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < args.requests:
            index = next_index
            next_index += 1
            try:
                await one(client, index + args.offset)
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] += 1

    start = time.monotonic()
    async with session(args.api_key) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    elapsed = time.monotonic() - start
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(args.requests / elapsed, 1),
        "kinds": dict(kinds),
        "errors": dict(errors.most_common(5)),
        "failed": sum(errors.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    for name in ("production", "saturation", "mix"):
        mode = modes.add_parser(name)
        mode.add_argument("--url", required=True)
        mode.add_argument("--model", default=MODEL_DEFAULT)
        mode.add_argument("--api-key", default="sk-bench")
    prod = modes.choices["production"]
    prod.add_argument("--streams", type=int, default=256)
    prod.add_argument("--rate", type=float, default=50.0)
    prod.add_argument("--tokens", type=int, default=1000)
    prod.add_argument("--ramp", type=float, default=2.0)
    prod.add_argument("--deadline", type=float, default=60.0)
    prod.add_argument("--seed", type=int, default=4)
    prod.add_argument(
        "--align",
        choices=("stream", "step"),
        default="stream",
        help="stream: each stream on its own clock; step: all on vLLM's decode-step grid",
    )
    sat = modes.choices["saturation"]
    sat.add_argument("--streams", type=int, default=64)
    sat.add_argument("--tokens", type=int, default=2000)
    sat.add_argument("--warmup", type=float, default=2.0)
    sat.add_argument("--window", type=float, default=15.0)
    mixed = modes.choices["mix"]
    mixed.add_argument("--requests", type=int, default=10000)
    mixed.add_argument("--concurrency", type=int, default=32)
    mixed.add_argument("--offset", type=int, default=0)
    args = parser.parse_args()
    import uvloop  # a vLLM dependency, in the test venv

    run = {"production": production, "saturation": saturation, "mix": mix}[args.mode]
    result = uvloop.run(run(args))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
