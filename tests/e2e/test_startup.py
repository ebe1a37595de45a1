"""The sidecar's readiness follows vLLM's: failing while vLLM loads, ready after its /health."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

POLL_SLACK_S = 5.0  # the sidecar polls every 0.5 s; readiness may lag /health by a few polls


@pytest.mark.needs_manifest
def test_readyz_turns_ready_only_after_vllm_health(live: dict[str, Any]) -> None:
    timeline = json.loads(Path(live["timeline"]).read_text())
    healthy = [i for i, sample in enumerate(timeline) if sample["health"] == 200]
    assert healthy, "vLLM's /health never answered 200"
    loading = timeline[: healthy[0]]
    # The order is only shown if the sidecar answered while vLLM was still loading.
    assert any(sample["readyz"] == 503 for sample in loading), timeline[:5]
    early = [sample for sample in loading if sample["readyz"] == 200]
    assert not early, f"/readyz was 200 before vLLM's /health: {early[:3]}"
    ready = next(sample for sample in timeline if sample["readyz"] == 200)
    lag = ready["t"] - timeline[healthy[0]]["t"]
    assert 0 <= lag <= POLL_SLACK_S, f"/readyz turned ready {lag:.1f} s after /health"
