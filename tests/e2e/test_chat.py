"""Chat completions through the sidecar's pass-through, with the official openai client.

The dummy weights never close their reasoning: with thinking on and a small
max_tokens every choice ends at the cap with reasoning only (a runaway); with
thinking off the same tokens are visible content (a truncated answer, not a
runaway). The sidecar's counters must tell the two apart. A model whose template
has no thinking switch (GLM-5.3) always thinks: vLLM's parser ignores
`thinking: false`, so there every reply at the cap is a runaway.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import thinking as switch
from tests.e2e.model import Tiny
from tests.scrape import count, samples

MAX_TOKENS = 16
QUESTION = "Why do sparse attention kernels need a top-k?"


@pytest.fixture(scope="module")
def client(live: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live['sidecar_url']}/v1", api_key="unused", max_retries=0, timeout=120
    )


def ask(
    client: openai.OpenAI,
    live: dict[str, Any],
    tiny: Tiny,
    never: dict[str, int],
    thinking: bool,
    **extra: Any,
) -> Any:
    return client.chat.completions.create(
        model=live["model"],
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias=never,
        extra_body={"chat_template_kwargs": switch(tiny, thinking)},
        **extra,
    )


def reasoning_of(message: Any) -> str:
    return str((message.model_extra or {}).get("reasoning") or "")  # vLLM 0.33.0's field


def test_non_streaming_chat(
    client: openai.OpenAI, live: dict[str, Any], tiny: Tiny, never: dict[str, int]
) -> None:
    response = ask(client, live, tiny, never, thinking=False)
    (choice,) = response.choices
    assert response.model == live["model"]
    assert choice.finish_reason == "length"
    if tiny.thinking_switch:
        assert choice.message.content and choice.message.content.strip()
    else:  # always thinks: the same tokens are reasoning (test_capped_reasoning), nothing visible
        assert not (choice.message.content or "").strip()
    assert response.usage is not None and response.usage.completion_tokens == MAX_TOKENS


def test_streaming_chat(
    client: openai.OpenAI, live: dict[str, Any], tiny: Tiny, never: dict[str, int]
) -> None:
    chunks = list(ask(client, live, tiny, never, thinking=False, stream=True))
    # The sidecar asked vLLM for usage (to count runaway tokens) and stripped it again:
    # no usage-only chunk reaches a client that did not ask for one.
    assert all(c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    reasoning = "".join(reasoning_of(c.choices[0].delta) for c in chunks)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    if tiny.thinking_switch:
        assert len(chunks) > 2 and text.strip() and not reasoning.strip()
    else:  # always thinks: nothing visible (the reasoning: test_capped_reasoning)
        assert not text.strip()
    assert finish == ["length"]


def test_runaways_are_counted_and_truncated_answers_are_not(
    client: openai.OpenAI, live: dict[str, Any], tiny: Tiny, never: dict[str, int]
) -> None:
    url, model = live["admin_url"], live["model"]
    runaways = count(url, "mla_serve_runaway_completions_total", model=model)
    tokens = count(url, "mla_serve_runaway_tokens_total", model=model)
    truncated = count(url, "mla_serve_completions_total", model=model, finished_reason="length")

    plain = ask(client, live, tiny, never, thinking=True)
    assert not (plain.choices[0].message.content or "").strip()
    assert plain.choices[0].finish_reason == "length"
    streamed = list(ask(client, live, tiny, never, thinking=True, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).strip()
    visible = ask(client, live, tiny, never, thinking=False)
    # A model that always thinks ignores the switch: its "visible" request ran away too.
    expected = 2 if tiny.thinking_switch else 3
    assert bool((visible.choices[0].message.content or "").strip()) == (expected == 2)

    assert count(url, "mla_serve_runaway_completions_total", model=model) == runaways + expected
    assert (
        count(url, "mla_serve_runaway_tokens_total", model=model) == tokens + expected * MAX_TOKENS
    )
    assert (
        count(url, "mla_serve_completions_total", model=model, finished_reason="length")
        == truncated + 3
    )


def test_capped_reasoning_reaches_the_client(
    client: openai.OpenAI,
    live: dict[str, Any],
    tiny: Tiny,
    never: dict[str, int],
    keep: Any,
) -> None:
    """A reply cut at max_tokens inside its reasoning (a runaway) still hands the client its
    reasoning, streamed and not (the runaway guard reads it in the stream). Recorded with
    vLLM's own answer (the ids it rendered and generated, asked through the pass-through)."""
    plain = ask(client, live, tiny, never, thinking=True)
    chunks = list(ask(client, live, tiny, never, thinking=True, stream=True))
    streamed = "".join(reasoning_of(c.choices[0].delta) for c in chunks if c.choices)
    visible = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    message = plain.choices[0].message
    # vLLM's own answer with the ids it rendered and generated: what the parser was given
    body = {
        "model": live["model"], "max_tokens": MAX_TOKENS, "temperature": 0, "logit_bias": never,
        "return_token_ids": True, "messages": [{"role": "user", "content": QUESTION}],
        "chat_template_kwargs": switch(tiny, True),
    }  # fmt: skip
    url = f"{live['sidecar_url']}/v1/chat/completions"  # every request counted by both ledgers
    answer = httpx.post(url, json=body, timeout=120).json()
    keep(
        "capped_reasoning.json",
        {
            "answer_with_ids": answer,
            "reasoning_parser": tiny.reasoning_parser,
            "completion_tokens": plain.usage.completion_tokens if plain.usage else None,
            "non_streamed": {"reasoning": reasoning_of(message), "content": message.content},
            "streamed": {"chunks": len(chunks), "reasoning": streamed, "content": visible},
        },
    )
    assert reasoning_of(message).strip() and streamed.strip(), answer["choices"][0]
    assert not (message.content or "").strip() and not visible.strip()


def test_sidecar_and_vllm_count_the_same_finished_requests(live: dict[str, Any]) -> None:
    """Every request of this run went through the pass-through: both ledgers agree."""
    model = live["model"]
    ours = {
        labels["finished_reason"]: value
        for labels, value in samples(live["admin_url"])["mla_serve_completions_total"]
        if labels["model"] == model
    }
    theirs = {
        labels["finished_reason"]: value
        for labels, value in samples(live["vllm_url"])["vllm:request_success_total"]
        if labels.get("model_name") == model and value
    }
    assert ours and ours == theirs


def test_record_vllms_own_streams(
    live: dict[str, Any], keep: Any, tiny: Tiny, never: dict[str, int]
) -> None:
    """vLLM's raw SSE bytes and their arrival times, direct from the engine, kept with the
    results: the recorded streams the CPU replay benchmark plays back (not stand-in bodies)."""
    recorded = []
    for thinking in (False, True):
        for usage in (False, True):
            body: dict[str, Any] = {
                "model": live["model"],
                "messages": [{"role": "user", "content": "Tell me about sparse attention."}],
                "max_tokens": 64, "temperature": 0, "logit_bias": never, "stream": True,
                "chat_template_kwargs": switch(tiny, thinking),
            }  # fmt: skip
            if usage:
                body["stream_options"] = {"include_usage": True}
            began = time.monotonic()
            chunks: list[list[Any]] = []
            with httpx.stream("POST", f"{live['vllm_url']}/v1/chat/completions", json=body,
                              timeout=120) as response:  # fmt: skip
                assert response.status_code == 200
                headers = dict(response.headers)
                for data in response.iter_raw():
                    chunks.append([round(time.monotonic() - began, 6), data.decode()])
            text = "".join(chunk for _, chunk in chunks)
            assert text.rstrip().endswith("data: [DONE]")
            recorded.append({"request": body, "headers": headers, "chunks": chunks})
    keep("recorded_streams.json", {"vllm_version": live["release"], "streams": recorded})
