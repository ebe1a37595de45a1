"""Identical greedy requests give identical tokens, and decode under CUDA graphs agrees
with a prefill of the same tokens (vllm#41331: DeepSeek-V4 output garbled under CUDA graphs
with concurrent identical requests).

With dummy weights no answer is "right", but greedy decoding is deterministic: N identical
requests in one batch must give N identical token sequences, and each generated token must
be the one a separate prefill of prompt + generated tokens ranks first (or within a near tie
of it), since both compute the same distribution, one through the captured decode graphs and
one through the prefill path. The prompt is longer than the largest captured batch, so the
checking prefill runs outside the decode graphs, and long enough for the compressed and
sparse layers (over 2048 tokens: DeepSeek-V4's C128A rows, V3.2's sparse prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.e2e.model import Tiny

CONCURRENT = 16
GENERATED = 32
# A token the decode picked may trail the prefill's first choice by this much (natural log):
# bf16 through different kernels; a garbled decode picks tokens the prefill ranks far lower.
NEAR_TIE = 0.1


def _prompt(tiny: Tiny, length: int) -> list[int]:
    """`length` plain token ids (no special or added token), the same every run."""
    low = len(tiny.special)
    span = int(tiny.config["vocab_size"]) - len(tiny.added) - low
    return [low + (i * 7919 + 13) % span for i in range(length)]


def _largest_capture(status: dict[str, Any]) -> int:
    """The largest batch any rank captured (vLLM's own figure, as /status reports it)."""
    sizes = [
        size
        for rank in status["engine"]["ranks"]
        for size in (rank["figures"]["cudagraph_capture_sizes"]["value"] or ())
    ]
    assert sizes, "no rank reported its captured batch sizes"
    return max(sizes)


def _max_model_len(argv: list[str]) -> int:
    """--max-model-len from vLLM's command line (the layouts set it)."""
    for i, word in enumerate(argv):
        if word.startswith("--max-model-len="):
            return int(word.split("=", 1)[1])
        if word == "--max-model-len":
            return int(argv[i + 1])
    raise AssertionError(f"no --max-model-len in {argv}")


def _complete(live: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(
        f"{live['sidecar_url']}/v1/completions",
        json={"model": live["model"], "temperature": 0, **body},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text[:400]
    return dict(reply.json())


@pytest.fixture(scope="module")
def prompt(tiny: Tiny, status: dict[str, Any], live: dict[str, Any]) -> list[int]:
    limit = _max_model_len(live["serve_argv"])
    length = max(_largest_capture(status) + 64, 2304)
    return _prompt(tiny, min(length, limit - GENERATED - 16))


def test_identical_greedy_requests_give_identical_tokens(
    live: dict[str, Any], prompt: list[int], keep: Callable[[str, Any], None]
) -> None:
    body = {"prompt": prompt, "max_tokens": GENERATED, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    alone = _complete(live, body)["choices"][0]["token_ids"]
    with ThreadPoolExecutor(CONCURRENT) as pool:
        replies = list(pool.map(lambda _: _complete(live, body), range(CONCURRENT)))
    batched = [reply["choices"][0]["token_ids"] for reply in replies]
    distinct = {tuple(tokens) for tokens in batched}
    same_as_alone = sum(tokens == alone for tokens in batched)
    keep(
        "identical.json",
        {
            "prompt_tokens": len(prompt),
            "concurrent": CONCURRENT,
            "distinct_sequences": len(distinct),
            "equal_to_the_request_alone": same_as_alone,
            "alone": alone,
            "batched": batched,
        },
    )
    assert all(len(tokens) == GENERATED for tokens in batched)
    assert len(distinct) == 1, f"{CONCURRENT} identical requests gave {len(distinct)} sequences"


def test_decode_under_graphs_agrees_with_a_prefill_of_the_same_tokens(
    live: dict[str, Any], prompt: list[int], keep: Callable[[str, Any], None]
) -> None:
    generated = _complete(
        live,
        {"prompt": prompt, "max_tokens": GENERATED, "ignore_eos": True, "return_token_ids": True},
    )["choices"][0]["token_ids"]
    checked = _complete(
        live, {"prompt": prompt + generated, "max_tokens": 1, "prompt_logprobs": 1}
    )["choices"][0]["prompt_logprobs"]
    gaps = []
    for position, token in enumerate(generated, start=len(prompt)):
        ranked = {int(k): v for k, v in checked[position].items()}
        best = max(entry["logprob"] for entry in ranked.values())
        gaps.append(best - ranked[token]["logprob"])
    off = [(i, round(gap, 4)) for i, gap in enumerate(gaps) if gap > NEAR_TIE]
    keep(
        "decode_vs_prefill.json",
        {
            "prompt_tokens": len(prompt),
            "generated": generated,
            "gaps": [round(gap, 5) for gap in gaps],
            "first_choice": sum(gap == 0 for gap in gaps),
            "beyond_near_tie": off,
            "near_tie": NEAR_TIE,
        },
    )
    assert not off, f"decoded tokens the prefill ranks far below its first choice: {off}"
