"""Watch vLLM's `/health`, `/v1/models` and `/version` in the background.

Health endpoints answer from the latest snapshot instead of calling vLLM, so a
slow or hung vLLM can never make a kubelet probe of the sidecar time out, and
`/readyz` costs microseconds. Every call has a hard timeout; anything other
than the expected answer (refused connection, 5xx, garbage JSON) is recorded as
the reason, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MAX_ANSWER = 4 * 1024 * 1024  # a /health, /v1/models or /version answer larger is refused


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    """The Authorization header vLLM's --api-key middleware checks."""
    return None if not api_key else {"Authorization": f"Bearer {api_key}"}


@dataclass(frozen=True)
class VllmSnapshot:
    checked_at: float | None = None
    health_status: int | None = None  # HTTP status of /health, None when unreachable
    error: str | None = None  # why the last /health check failed
    models: tuple[str, ...] = ()
    models_error: str | None = None  # why the last /v1/models check failed
    version: str | None = None
    ever_healthy: bool = False
    healthy_since: float | None = None

    @property
    def up(self) -> bool:
        return self.health_status == 200


@dataclass
class VllmMonitor:
    timeout: float
    interval: float
    api_key: str | None = None  # vLLM's --api-key: /v1/* needs it, /health and /version do not
    model: str | None = None  # the model readiness wants listed (--model), if any
    # /v1/models and /version change only when vLLM restarts or loads/unloads an adapter:
    # asked when /health turns 200, on every check while they are missing (or the model
    # readiness wants is not listed), and otherwise every `refresh_every` checks; /health on
    # every check. vLLM answers each of them on its API server's event loop, beside the
    # streams it serves.
    refresh_every: int = 20
    snapshot: VllmSnapshot = field(default_factory=VllmSnapshot)
    _session: aiohttp.ClientSession | None = None
    _since_refresh: int = 0

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Poll through `session` (whose base URL is vLLM's) until cancelled."""
        self._session = session
        while True:
            await self.check()
            await asyncio.sleep(self.interval)

    async def check(self) -> VllmSnapshot:
        assert self._session is not None
        previous = self.snapshot
        health, error = await self._health()
        models: tuple[str, ...] = ()
        models_error: str | None = "vLLM is not healthy"
        version = previous.version
        if health == 200 and not self._refresh_due(previous):
            models, models_error = previous.models, previous.models_error
            self._since_refresh += 1
        elif health == 200:
            (models, models_error), (version, _) = await asyncio.gather(
                self._models(), self._version()
            )
            self._since_refresh = 1
        now = time.time()
        up = health == 200
        self.snapshot = VllmSnapshot(
            checked_at=now,
            health_status=health,
            error=error,
            models=models,
            models_error=models_error,
            version=version,
            ever_healthy=previous.ever_healthy or up,
            healthy_since=(previous.healthy_since or now) if up else None,
        )
        return self.snapshot

    def _refresh_due(self, previous: VllmSnapshot) -> bool:
        return (
            not previous.up
            or previous.models_error is not None
            or (self.model is not None and self.model not in previous.models)
            or self._since_refresh >= self.refresh_every
        )

    async def _get(self, path: str) -> tuple[int, bytes]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        headers = auth_headers(self.api_key) if path.startswith("/v1/") else None
        async with self._session.get(path, timeout=timeout, headers=headers) as response:
            if response.content_length is not None and response.content_length > MAX_ANSWER:
                raise ValueError(f"{path} answer over {MAX_ANSWER} bytes")
            body = await response.content.read(MAX_ANSWER + 1)
            if len(body) > MAX_ANSWER:
                raise ValueError(f"{path} answer over {MAX_ANSWER} bytes")
            return response.status, body

    async def _json(self, path: str) -> Any:
        status, body = await self._get(path)
        if status == 401:
            raise ValueError("HTTP 401: vLLM wants an API key (--vllm-api-key)")
        if status != 200:
            raise ValueError(f"HTTP {status}")
        return json.loads(body)

    async def _health(self) -> tuple[int | None, str | None]:
        try:
            status, _ = await self._get("/health")
        except TimeoutError:
            return None, f"/health timed out after {self.timeout:g} s"
        except aiohttp.ClientError as error:
            return None, f"/health unreachable: {type(error).__name__}: {error}"
        if status != 200:
            return status, f"/health returned HTTP {status}"
        return 200, None

    async def _models(self) -> tuple[tuple[str, ...], str | None]:
        try:
            data = (await self._json("/v1/models"))["data"]
            return tuple(str(entry["id"]) for entry in data), None
        except TimeoutError:
            return (), f"/v1/models timed out after {self.timeout:g} s"
        except (aiohttp.ClientError, ValueError, KeyError, TypeError, RecursionError) as error:
            return (), f"/v1/models unusable: {type(error).__name__}: {error}"

    async def _version(self) -> tuple[str | None, str | None]:
        try:
            return str((await self._json("/version"))["version"]), None
        except (
            TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError, RecursionError
        ) as error:  # fmt: skip
            return None, f"/version unusable: {error}"
