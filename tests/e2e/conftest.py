"""The live stack `make e2e` started (tests/e2e/stack.py), as fixtures.

Without MLA_SERVE_E2E_STACK (every run but `make e2e` on a GPU machine) these
tests skip. The test that kills the engine runs last, whatever the file order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.model import MODELS, THINK, THINK_END, Tiny

STACK_ENV = "MLA_SERVE_E2E_STACK"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("kills_engine") is not None)
    path = os.environ.get(STACK_ENV)
    if path and json.loads(Path(path).read_text()).get("state") == "pristine":
        skip = pytest.mark.skip(
            reason="a pristine tree has no fix manifest: never ready, by design"
        )
        for item in items:
            if item.get_closest_marker("needs_manifest"):
                item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kills_engine: ends vLLM; runs after every other test")
    config.addinivalue_line("markers", "needs_manifest: only on a patched (manifest) tree")


@pytest.fixture(scope="session")
def stack() -> dict[str, Any]:
    path = os.environ.get(STACK_ENV)
    if not path:
        pytest.skip("needs the live vLLM stack that `make e2e` starts on a GPU machine")
    return dict(json.loads(Path(path).read_text()))


@pytest.fixture(scope="session")
def live(stack: dict[str, Any]) -> dict[str, Any]:
    """The stack, once it is up (the sidecar ready; for a pristine tree vLLM serving);
    fails fast with vLLM's last words if not."""
    if stack["startup"] not in ("ready", "serving"):
        tail = Path(stack["vllm_log"]).read_text(errors="replace").splitlines()[-40:]
        pytest.fail(f"the stack never became ready ({stack['startup']}):\n" + "\n".join(tail))
    return stack


@pytest.fixture(scope="session")
def tiny(live: dict[str, Any]) -> Tiny:
    """The tiny model the stack serves (model.py)."""
    return MODELS[live["tiny"]]


@pytest.fixture(scope="session")
def never(tiny: Tiny) -> dict[str, int]:
    """logit_bias ruling out every stop token, `</think>` and `<think>`: dummy weights may
    pick them greedily, so thinking-on output never leaves its reasoning and every reply
    reaches the cap, as text (a parser takes a repeated `<think>` for markup, not reasoning:
    the tiny DeepSeek-V4 and GLM-5.3 picked it 16 times in a row)."""
    markup = (tiny.token_id(THINK), tiny.token_id(THINK_END))
    return {str(token): -100 for token in (*tiny.stop_ids, *markup)}


def thinking(tiny: Tiny, on: bool) -> dict[str, Any]:
    """chat_template_kwargs asking `tiny` to think or not, by its template's own switch; a
    model that always thinks (GLM-5.3) gets the `thinking` a client would send, which vLLM
    ignores for it."""
    return {tiny.thinking_switch or "thinking": on}


@pytest.fixture(scope="session")
def vllm_log(live: dict[str, Any]) -> str:
    return Path(live["vllm_log"]).read_text(errors="replace")


@pytest.fixture(scope="session")
def keep() -> Callable[[str, Any], None]:
    """Keep a figure with the results (MLA_SERVE_E2E_RESULTS), as JSON."""

    def write(name: str, value: Any) -> None:
        results = os.environ.get("MLA_SERVE_E2E_RESULTS")
        if results:
            (Path(results) / name).write_text(json.dumps(value, indent=2) + "\n")

    return write


@pytest.fixture(scope="session")
def world(live: dict[str, Any]) -> int:
    """Engine ranks the layout runs: TP x PCP (x PP x DP, 1 here)."""
    parallel = live["layout"]["parallel"]
    return int(parallel["tp"]) * int(parallel["pcp"])


@pytest.fixture(scope="session")
def status(live: dict[str, Any], keep: Callable[[str, Any], None]) -> dict[str, Any]:
    """The sidecar's /status while the engine serves (kept with the results)."""
    document = dict(httpx.get(f"{live['admin_url']}/status", timeout=10).json())
    keep("status.json", document)
    return document
