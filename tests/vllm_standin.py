"""A stand-in for a vLLM 0.33.0 OpenAI server, on a real socket on 127.0.0.1.

It speaks vLLM's formats (checked against vLLM's own protocol classes in
tests/vllm_cpu/test_standin_protocol.py): `/health` (200 with an empty body, 503
when the engine is dead), `/v1/models` (vLLM's ModelList), `/version`, `/metrics`,
and `/v1/chat/completions` and `/v1/completions`, streamed (SSE chunks serialized
as vLLM does, `data: [DONE]` last) or not, with `reasoning` in the message or delta
and `usage.completion_tokens_details.reasoning_tokens` as with a reasoning parser.
Tests steer it through `behaviour`; a request's outcome is chosen by its last
user message: "[runaway]", "[tools]", "[error]", "[stall]" (no headers), "[hang]"
(headers, then silence), "[loop:NAME]" / "[legit:NAME]" (a text of the loop guard's corpus,
tests/loop_corpus.py, in its channel, 4 characters a token, cut at max_tokens), else a
normal answer. `/metrics` counts the tokens it generated as vLLM's
`vllm:generation_tokens_total` does. A real vLLM needs a GPU; this
runs anywhere and can fail on purpose.

As a program (`make demo` runs it so), it serves until stopped and says what it is:

    python -m tests.vllm_standin --port 8000 --model glm-5.3-flash
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mla_serve.patching import catalog
from tests.http_server import ServerThread
from tests.loop_corpus import LEGIT, LOOPS
from tests.loop_corpus import stream as tokenize

VERSION = catalog.load().default  # the release the image runs (patches/catalog.toml)


@dataclass
class Behaviour:
    health_status: int = 200
    models: list[str] = field(default_factory=lambda: ["glm-5.3-flash"])
    max_model_len: int = 70000
    delay: float = 0.0  # seconds before every answer
    garbage: bool = False  # /v1/models and /version answer non-JSON
    token_delay: float = 0.0  # seconds between streamed tokens
    answer_tokens: int = 5  # tokens of a normal answer (after 3 reasoning tokens)
    streams_started: int = 0
    streams_cancelled: int = 0  # streams whose client went away before the end
    generated_tokens: int = 0  # completion tokens produced (streamed: as they are sent)
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received
    headers: list[dict[str, str]] = field(default_factory=list)  # their headers
    polled: Counter[str] = field(default_factory=Counter)  # /health, /v1/models, /version asked


def model_list(names: list[str], max_model_len: int) -> dict[str, Any]:
    """vLLM's ModelList / ModelCard / ModelPermission JSON."""
    now = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{index:032x}",
                        "object": "model_permission",
                        "created": now,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for index, name in enumerate(names)
        ],
    }


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{model}",engine="0"}} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{model}",engine="0"}} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{model_name="{model}",engine="0",finished_reason="length"}} 0.0
vllm:request_success_total{{model_name="{model}",engine="0",finished_reason="stop"}} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="{model}",engine="0"}} {generated:.1f}
"""


class StandIn:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        """Served from a thread of the test's process on a free port (`start`, `stop`); `main`
        serves its `app()` as a program instead."""
        self.behaviour = behaviour or Behaviour()
        self._server = ServerThread(self.app(), lifespan="off")
        self.url = self._server.url

    def app(self) -> Starlette:
        # As `vllm serve --enable-request-id-headers` (vLLM's XRequestIdMiddleware).
        return Starlette(
            middleware=[Middleware(XRequestIdMiddleware)],
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/version", self._version),
                Route("/metrics", self._metrics),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ],
        )

    async def _pause(self) -> None:
        if self.behaviour.delay:
            await asyncio.sleep(self.behaviour.delay)

    async def _health(self, request: Request) -> Response:
        self.behaviour.polled["/health"] += 1
        await self._pause()
        return Response(status_code=self.behaviour.health_status)

    async def _models(self, request: Request) -> Response:
        self.behaviour.polled["/v1/models"] += 1
        await self._pause()
        if self.behaviour.garbage:
            return PlainTextResponse("<html>502 Bad Gateway</html>")
        return JSONResponse(model_list(self.behaviour.models, self.behaviour.max_model_len))

    async def _version(self, request: Request) -> Response:
        self.behaviour.polled["/version"] += 1
        await self._pause()
        if self.behaviour.garbage:
            return PlainTextResponse("not json")
        return JSONResponse({"version": VERSION})

    async def _metrics(self, request: Request) -> Response:
        model = self.behaviour.models[0] if self.behaviour.models else "none"
        generated = self.behaviour.generated_tokens
        return PlainTextResponse(VLLM_METRICS.format(model=model, generated=generated))

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        self.behaviour.requests.append(body)
        self.behaviour.headers.append(dict(request.headers))
        await self._pause()
        outcome = _outcome(body, chat)
        if outcome == "error":
            return JSONResponse(
                {
                    "error": {
                        "message": "The engine crashed (stand-in).",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
                status_code=500,
            )
        if outcome == "stall":
            await asyncio.sleep(3600)
        script = Script(outcome, body, chat, self.behaviour.answer_tokens)
        if body.get("stream"):
            return StreamingResponse(self._stream(script), media_type="text/event-stream")
        self.behaviour.generated_tokens += script.tokens
        return JSONResponse(script.whole())

    async def _stream(self, script: Script) -> AsyncIterator[str]:
        self.behaviour.streams_started += 1
        finished = False
        try:
            for chunk in script.chunks():
                if chunk is HANG:
                    await asyncio.sleep(3600)
                if _carries_token(chunk):
                    self.behaviour.generated_tokens += 1  # one token per chunk, as vLLM streams
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
                if self.behaviour.token_delay:
                    await asyncio.sleep(self.behaviour.token_delay)
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.behaviour.streams_cancelled += 1

    def start(self) -> StandIn:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


class XRequestIdMiddleware:
    """Echo the request's X-Request-Id (or a fresh one) on every response, as vLLM does."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("X-Request-Id", uuid.uuid4().hex)

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)


HANG: dict[str, Any] = {}  # a stream marker: stop sending, keep the connection open


def _carries_token(chunk: dict[str, Any]) -> bool:
    """A chunk with generated text or a tool call (not the role chunk, not the empty end)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("reasoning") or delta.get("content"):
            return True
        if delta.get("tool_calls"):
            return True
    return False


def _outcome(body: dict[str, Any], chat: bool) -> str:
    if chat:
        messages = body.get("messages") or [{}]
        text = str(messages[-1].get("content", ""))
    else:
        text = str(body.get("prompt", ""))
    for outcome in ("runaway", "tools", "error", "stall", "hang"):
        if text.startswith(f"[{outcome}]"):
            return outcome
    for kind, corpus in (("loop", LOOPS), ("legit", LEGIT)):
        name = text[len(kind) + 2 : text.find("]")]
        if text.startswith(f"[{kind}:") and name in corpus:
            return f"{kind}:{name}"
    return "answer"


@dataclass
class Script:
    """One response: reasoning tokens, then visible tokens or a tool call, then finish."""

    outcome: str
    body: dict[str, Any]
    chat: bool
    answer_tokens: int

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = str(self.body.get("model", "glm-5.3-flash"))
        max_tokens = int(self.body.get("max_tokens") or 16)
        if ":" in self.outcome:  # a corpus text, in its channel, cut at max_tokens
            kind, name = self.outcome.split(":")
            channel, text = (LOOPS if kind == "loop" else LEGIT)[name]
            tokens = list(tokenize(text, (4,)))
            self.finish = "length" if len(tokens) > max_tokens else "stop"
            tokens = tokens[:max_tokens]
            in_reasoning = channel == "reasoning" and self.chat
            self.reasoning = tokens if in_reasoning else []
            self.visible = [] if in_reasoning else tokens
        elif self.outcome == "runaway":  # thinks until the cap, never answers
            self.reasoning = [f"think{i} " for i in range(max_tokens)]
            self.visible = []
            self.finish = "length"
        else:
            self.reasoning = [f"think{i} " for i in range(3)]
            self.visible = (
                [] if self.outcome == "tools" else [f"word{i} " for i in range(self.answer_tokens)]
            )
            self.finish = "tool_calls" if self.outcome == "tools" else "stop"
        if not self.chat and ":" not in self.outcome:  # completions have no reasoning channel
            self.visible, self.reasoning = self.visible or [], []
            if self.outcome == "runaway":
                self.visible = ["  " for _ in range(max_tokens)]

    @property
    def tokens(self) -> int:
        return len(self.reasoning) + len(self.visible) + (8 if self.outcome == "tools" else 0)

    def usage(self, whole: bool = False) -> dict[str, Any]:
        """Streamed usage leaves unset fields out; whole responses carry them all."""
        completion = self.tokens
        usage: dict[str, Any] = {
            "prompt_tokens": 12,
            "total_tokens": 12 + completion,
            "completion_tokens": completion,
        }
        if whole:
            usage["prompt_tokens_details"] = None
            usage["completion_tokens_details"] = None
        if self.chat:
            usage["completion_tokens_details"] = {"reasoning_tokens": len(self.reasoning)}
        return usage

    def tool_call(self) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}",
            "type": "function",
            "index": 0,
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": choices, **extra,
        }  # fmt: skip

    def _choice(self, piece: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": piece.get("content", ""), "logprobs": None,
                "finish_reason": finish, "stop_reason": None}  # fmt: skip

    def chunks(self) -> Iterator[dict[str, Any]]:
        if self.chat:
            yield self._chunk([self._choice({"role": "assistant", "content": ""})])
        for token in self.reasoning:
            yield self._chunk([self._choice({"reasoning": token})])
        if self.outcome == "hang":
            yield HANG
        for token in self.visible:
            yield self._chunk([self._choice({"content": token})])
        if self.outcome == "tools":
            yield self._chunk([self._choice({"tool_calls": [self.tool_call()]})])
        yield self._chunk([self._choice({"content": ""}, self.finish)])
        options = self.body.get("stream_options") or {}
        if options.get("include_usage"):
            yield self._chunk([], usage=self.usage())

    def whole(self) -> dict[str, Any]:
        """The response as vLLM's routers send it: the protocol model's full dump."""
        tail = {"routed_experts": None, "weight_versions": None}
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(self.visible) or None,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if self.outcome == "tools":
                call = self.tool_call()
                del call["index"]
                message["tool_calls"] = [call]
            message["reasoning"] = "".join(self.reasoning) or None
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": self.finish, "stop_reason": None, "token_ids": None,
                      **tail}  # fmt: skip
            extra = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        else:
            choice = {"index": 0, "text": "".join(self.visible), "logprobs": None,
                      "finish_reason": self.finish, "stop_reason": None, "token_ids": None,
                      "prompt_logprobs": None, "prompt_token_ids": None, **tail}  # fmt: skip
            extra = {}
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.usage(whole=True),
            **extra,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


BANNER = (
    "vllm_standin: a CPU stand-in for vLLM {version}'s OpenAI server, not vLLM (no model, no "
    "GPU: scripted answers in vLLM's exact formats) on http://{host}:{port}, serving {models}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.vllm_standin",
        description=f"A stand-in for vLLM {VERSION}'s OpenAI server on a CPU: vLLM's routes and "
        "formats, scripted answers. The last user message chooses the outcome: '[runaway]' "
        "(reasoning until max_tokens, no answer), '[loop:NAME]' (a loop of tests/loop_corpus.py), "
        "'[tools]', '[error]', else an ordinary answer.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument(
        "--model", action="append", help="served model name, repeatable (default glm-5.3-flash)"
    )
    parser.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        help="seconds between streamed tokens (default 0)",
    )
    args = parser.parse_args(argv)
    behaviour = Behaviour(token_delay=args.token_delay)
    if args.model:
        behaviour.models = list(args.model)
    app = StandIn(behaviour).app()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    models = ", ".join(behaviour.models)
    print(BANNER.format(version=VERSION, host=args.host, port=args.port, models=models),
          flush=True)  # fmt: skip
    server.run()  # until SIGINT or SIGTERM (uvicorn's own handlers)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
