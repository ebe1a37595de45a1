"""One client process of the live-engine benchmark (tests/e2e/bench.py): the official `openai`
client, async, streaming chat completions in a closed loop.

    python tests/e2e/bench_client.py     # then one JSON command per line on stdin

Each command is `{"url", "model", "concurrency", "bodies", "order", "timeout"}`: `order` lists
which of `bodies` (the keyword arguments of `chat.completions.create`) each request sends;
`concurrency` tasks take the next request when their stream ends. The answer is one JSON line:
per request [time to first token s, time to first chunk s, duration s, chunks, completion
tokens, finish reason, runaway as the client sees it, error or null, gaps between tokens in
microseconds], and the window (monotonic clock, shared by every process of the machine).
`{"quit": true}` ends the process. One client per URL is kept across commands, so rounds
reuse their keep-alive connections. With `"trace": true` each request carries an id in its
body (`user`: `mlasrid` and 32 hex digits) and its record ends with {rid, t0, t_token} (the
call and the first token on the monotonic clock), for the socket timeline (timeline.py).

A token is a chunk whose delta carries content or reasoning (vLLM sends one token a chunk);
the time to first token runs from the call to the first such chunk; the gaps are between
consecutive such chunks of one stream. A runaway is what the sidecar counts as one: finish
reason `length`, no visible (non-whitespace) content, no tool calls.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from typing import Any

import httpx2
import openai

CLIENTS: dict[str, openai.AsyncOpenAI] = {}


def client_for(url: str, timeout: float) -> openai.AsyncOpenAI:
    if url not in CLIENTS:
        # Keep-alive connections for every stream and longer than a round of the other paths.
        limits = httpx2.Limits(
            max_connections=4096, max_keepalive_connections=4096, keepalive_expiry=600
        )
        http = openai.DefaultAsyncHttpx2Client(limits=limits, timeout=timeout)
        CLIENTS[url] = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout,
            http_client=http,
        )  # fmt: skip
    return CLIENTS[url]


async def one(client: openai.AsyncOpenAI, body: dict[str, Any], trace: bool = False) -> list[Any]:
    rid = None
    if trace:
        rid = f"mlasrid{uuid.uuid4().hex}"
        body = dict(body, user=rid)
    began = time.monotonic()
    first_chunk = first_token = last_token = None
    gaps: list[int] = []
    chunks = tokens = 0
    finish: str | None = None
    visible = tool_calls = False
    error: str | None = None
    try:
        stream = await client.chat.completions.create(**body)
        async for chunk in stream:
            now = time.monotonic()
            chunks += 1
            if first_chunk is None:
                first_chunk = now
            for choice in chunk.choices:
                delta = choice.delta
                extra = delta.model_extra or {}
                content = delta.content
                if content or extra.get("reasoning") or extra.get("reasoning_content"):
                    if last_token is None:
                        first_token = now
                    else:
                        gaps.append(round((now - last_token) * 1e6))
                    last_token = now
                if content and content.strip():
                    visible = True
                if delta.tool_calls:
                    tool_calls = True
                if choice.finish_reason:
                    finish = choice.finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # every failure is a result: counted, named, never raised
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    end = time.monotonic()
    runaway = finish == "length" and not visible and not tool_calls
    record = [
        None if first_token is None else first_token - began,
        None if first_chunk is None else first_chunk - began,
        end - began, chunks, tokens, finish, runaway, error, gaps,
    ]  # fmt: skip
    if trace:
        record.append({"rid": rid, "t0": began, "t_token": first_token})
    return record


async def run(command: dict[str, Any]) -> dict[str, Any]:
    client = client_for(command["url"], float(command.get("timeout", 120)))
    bodies = [dict(body, model=command["model"]) for body in command["bodies"]]
    order: list[int] = list(command["order"])
    trace = bool(command.get("trace"))
    records: list[list[Any] | None] = [None] * len(order)
    position = 0

    async def worker() -> None:
        nonlocal position
        while position < len(order):
            index = position
            position += 1
            records[index] = await one(client, bodies[order[index]], trace)

    began = time.monotonic()
    tasks = [worker() for _ in range(min(int(command["concurrency"]), len(order)))]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=float(command.get("deadline", 300)))
        cut = 0
    except TimeoutError:
        cut = sum(record is None for record in records)
    return {
        "began": began,
        "ended": time.monotonic(),
        "records": [record for record in records if record is not None],
        "cut_at_deadline": cut,
    }


def main() -> int:
    try:
        import uvloop

        loop = uvloop.new_event_loop()
        kind = "uvloop"
    except ImportError:
        loop = asyncio.new_event_loop()
        kind = "asyncio"
    asyncio.set_event_loop(loop)
    print(json.dumps({"ready": True, "loop": kind, "openai": openai.__version__}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        answer = loop.run_until_complete(run(command))
        print(json.dumps(answer, separators=(",", ":")), flush=True)
    for client in CLIENTS.values():
        loop.run_until_complete(client.close())
    return 0


if __name__ == "__main__":
    sys.exit(main())
