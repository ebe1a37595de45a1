"""A re-sent request is served from vLLM's prefix cache (vllm#42948: DeepSeek-V4-Flash got 0 %
hits on a re-sent request, its hybrid cache groups losing the first blocks' keys).

The same prompt of plain tokens goes to vLLM twice, one after the other; vLLM's own counters
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`) must show the second
request served from the cache but for its last blocks. On the CPU the same is shown with
vLLM's scheduler and KV cache manager over the tiny DeepSeek-V4's layer specs
(tests/test_e2e_models.py, `cpu_check prefix-cache`); here it runs with the real engine.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.model import Tiny
from tests.scrape import samples

BLOCKS = 9  # whole KV blocks in the prompt, as far as the layout's max-model-len allows


def _counters(url: str) -> tuple[float, float]:
    found = samples(url)
    return tuple(  # type: ignore[return-value]
        sum(value for _, value in found.get(name, []))
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    )


def _send(live: dict[str, Any], prompt: list[int]) -> None:
    reply = httpx.post(
        f"{live['vllm_url']}/v1/completions",
        json={
            "model": live["model"],
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=300,
    )
    assert reply.status_code == 200, reply.text[:400]


def _after(url: str, before: tuple[float, float], queries: int) -> tuple[float, float]:
    """The counters once vLLM has counted `queries` more prompt tokens (its stats arrive
    with the engine's next step report)."""
    deadline = time.monotonic() + 20
    while True:
        now = _counters(url)
        if now[0] - before[0] >= queries or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def _block_and_length(log: str) -> tuple[int, int]:
    """vLLM's KV block size (the least common multiple of its cache groups' block sizes,
    which a hybrid model's state pages may raise) and its max-model-len, as it logged them."""
    block = re.findall(r"lcm block sizes (\d+)", log)
    length = re.findall(r"max_seq_len=(\d+)", log)
    assert block and length, "vLLM's log names no block size or max_seq_len"
    return int(block[-1]), int(length[-1])


def test_a_resent_prompt_is_served_from_the_prefix_cache(
    live: dict[str, Any], tiny: Tiny, vllm_log: str, keep: Callable[[str, Any], None]
) -> None:
    block, length = _block_and_length(vllm_log)
    blocks = min(BLOCKS, (length - 8) // block)  # room for the 4 tokens generated
    if blocks < 2:
        reason = (f"vLLM's KV blocks are {block} tokens here (a hybrid model's state page sets "
                  f"them) and max-model-len is {length}: no prompt holds two blocks")  # fmt: skip
        pytest.skip(reason)
    prompt_tokens = blocks * block
    slack = 2 * block  # the last block and one more (an alignment unit of the hybrid groups)
    low = len(tiny.special)
    span = int(tiny.config["vocab_size"]) - len(tiny.added) - low
    prompt = [low + (i * 6007 + 29) % span for i in range(prompt_tokens)]
    url = live["vllm_url"]
    start = _counters(url)
    _send(live, prompt)
    first = _after(url, start, prompt_tokens)
    _send(live, prompt)
    second = _after(url, first, prompt_tokens)
    counted = {
        "first": {"queries": first[0] - start[0], "hits": first[1] - start[1]},
        "again": {"queries": second[0] - first[0], "hits": second[1] - first[1]},
    }
    keep("prefix_cache.json", {"prompt_tokens": prompt_tokens, "block_tokens": block, **counted})
    assert counted["first"]["queries"] >= prompt_tokens, counted  # vLLM counted the request
    assert counted["again"]["hits"] >= prompt_tokens - slack, counted
