"""A stand-in for a vLLM 0.33.0 OpenAI server, on a real socket on 127.0.0.1.

It speaks vLLM's formats (checked against vLLM's own protocol classes in
tests/vllm_cpu/test_standin_protocol.py): `/health` (200 with an empty body, 503
when the engine is dead), `/v1/models` (vLLM's ModelList), `/version`, `/metrics`.
Tests steer it through `behaviour`: health status, delays, garbage bodies.
A real vLLM needs a GPU; this runs anywhere and can fail on purpose.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from http_server import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

VERSION = "0.33.0"


@dataclass
class Behaviour:
    health_status: int = 200
    models: list[str] = field(default_factory=lambda: ["glm-5.3-flash"])
    max_model_len: int = 70000
    delay: float = 0.0  # seconds before every answer
    garbage: bool = False  # /v1/models and /version answer non-JSON


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
"""


class StandIn:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self._server = ServerThread(self.app(), lifespan="off")
        self.url = self._server.url

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/version", self._version),
                Route("/metrics", self._metrics),
            ]
        )

    async def _pause(self) -> None:
        if self.behaviour.delay:
            await asyncio.sleep(self.behaviour.delay)

    async def _health(self, request: Request) -> Response:
        await self._pause()
        return Response(status_code=self.behaviour.health_status)

    async def _models(self, request: Request) -> Response:
        await self._pause()
        if self.behaviour.garbage:
            return PlainTextResponse("<html>502 Bad Gateway</html>")
        return JSONResponse(model_list(self.behaviour.models, self.behaviour.max_model_len))

    async def _version(self, request: Request) -> Response:
        await self._pause()
        if self.behaviour.garbage:
            return PlainTextResponse("not json")
        return JSONResponse({"version": VERSION})

    async def _metrics(self, request: Request) -> Response:
        model = self.behaviour.models[0] if self.behaviour.models else "none"
        return PlainTextResponse(VLLM_METRICS.format(model=model))

    def start(self) -> StandIn:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()
