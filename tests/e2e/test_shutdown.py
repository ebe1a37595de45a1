"""When the engine dies, the sidecar says so within seconds: /readyz fails, vllm_up drops."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.scrape import samples

WITHIN_S = 5.0  # poll interval 0.5 s + probe timeout 2 s, with margin


@pytest.mark.kills_engine
@pytest.mark.needs_manifest
def test_killing_vllm_fails_readyz_and_drops_vllm_up(
    live: dict[str, Any], keep: Callable[[str, Any], None]
) -> None:
    url = live["admin_url"]
    assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    os.killpg(int(live["engine_pgid"]), signal.SIGKILL)  # the API server and its engine core
    killed = time.monotonic()
    seen: dict[str, float] = {}
    while time.monotonic() - killed < 30 and len(seen) < 2:
        if "readyz" not in seen and httpx.get(f"{url}/readyz", timeout=5).status_code == 503:
            seen["readyz"] = time.monotonic() - killed
        if "vllm_up" not in seen and samples(url)["mla_serve_vllm_up"] == [({}, 0.0)]:
            seen["vllm_up"] = time.monotonic() - killed
        time.sleep(0.1)
    keep("shutdown.json", {"seconds_after_kill": seen})
    assert seen.get("readyz", 99) <= WITHIN_S, seen
    assert seen.get("vllm_up", 99) <= WITHIN_S, seen
    # Clients get a prompt error from the pass-through, not a hang.
    began = time.monotonic()
    response = httpx.post(
        f"{live['sidecar_url']}/v1/chat/completions", json={"model": live["model"]}, timeout=30
    )
    assert response.status_code in (502, 503)
    assert time.monotonic() - began < WITHIN_S
