"""The optional canary: a long-prefix prompt sent to vLLM now and then.

The DeepSeek-V4 runaways (vllm#52448, fixed by #52492 and #51318) show under a cached
prefix over 2048 tokens with requests in flight together, so each round sends the
same prompt `concurrency` times at once (the first request caches the prefix for
the others). Its completions are classified like user traffic but counted apart
(`mla_serve_canary_*`), so an alert can tell "the engine produces runaways" from
"users asked for little".
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from mla_serve.sidecar.admin.vllm_monitor import VllmMonitor, auth_headers
from mla_serve.sidecar.guard.loops import LoopConfig, final_loops
from mla_serve.sidecar.passthrough.runaways import Completion, Ledger


@dataclass
class Canary:
    prompt_file: Path
    model: str | None
    interval: float
    concurrency: int
    max_tokens: int
    timeout: float
    ledger: Ledger
    monitor: VllmMonitor
    api_key: str | None = None
    last_round: dict[str, Any] = field(default_factory=dict)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Send rounds through `session` (whose base URL is vLLM's) until cancelled."""
        prompt = self.prompt_file.read_text(encoding="utf-8")
        while True:
            if self.monitor.snapshot.up and (self.model or self.monitor.snapshot.models):
                await self.round(session, prompt)
            await asyncio.sleep(self.interval)

    async def round(self, session: aiohttp.ClientSession, prompt: str) -> None:
        model = self.model or self.monitor.snapshot.models[0]
        outcomes = await asyncio.gather(
            *(self._one(session, model, prompt) for _ in range(self.concurrency))
        )
        self.last_round = {
            "at": time.time(),
            "model": model,
            "requests": self.concurrency,
            "runaways": sum(o for o in outcomes if o is not None),
            "errors": sum(1 for o in outcomes if o is None),
        }

    async def _one(self, session: aiohttp.ClientSession, model: str, prompt: str) -> int | None:
        """Runaways in one canary response, or None when the request failed."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "stream": False,
        }
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with session.post(
                "/v1/chat/completions",
                json=body,
                timeout=timeout,
                headers=auth_headers(self.api_key),
            ) as response:
                payload = await response.read()
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                completion = Completion()
                body = json.loads(payload)
                completion.add_body(body)
                for index in final_loops(body, LoopConfig()):  # the runaway's cause
                    completion.choices[index].loop = True
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError,
                RecursionError):  # fmt: skip
            self.ledger.completions.labels(model, "error").inc()
            return None
        return self.ledger.record(completion, model)
