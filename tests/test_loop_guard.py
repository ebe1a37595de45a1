"""The runaway guard through the real sidecar: the official `openai` client -> sidecar ->
the stand-in vLLM (tests/vllm_standin.py), which streams the texts of tests/loop_corpus.py.

observe (the default) counts loops and lets them run; stop ends a looping stream early,
closes the upstream request (the stand-in sees the disconnect, as vLLM would abort) and
counts the tokens not generated, which equal what the stand-in's own generation counter
did not count; legitimate repetitive output passes untouched in both modes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest

from tests.loop_corpus import LEGIT
from tests.scrape import count, samples

MODEL = "glm-5.3-flash"
MAX_TOKENS = 3000


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=60)


def chat(url: str, text: str, **extra: Any) -> Any:
    return client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], **extra
    )


def histogram(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram for MODEL."""
    found = samples(url)
    total = next(v for labels, v in found[f"{name}_count"] if labels == {"model": MODEL})
    summed = next(v for labels, v in found[f"{name}_sum"] if labels == {"model": MODEL})
    return total, summed


def streamed(url: str, text: str, **extra: Any) -> tuple[list[Any], str, str]:
    chunks = list(chat(url, text, max_tokens=MAX_TOKENS, stream=True, **extra))
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, reasoning, content


def test_observe_counts_a_reasoning_loop_and_lets_it_run(vllm, sidecar):
    url = sidecar()  # --loop-action observe is the default
    chunks, reasoning, _ = streamed(url, "[loop:paragraph] why?")
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(reasoning) == 4 * MAX_TOKENS  # every token, as vLLM sent it
    assert vllm.behaviour.generated_tokens == MAX_TOKENS
    assert count(url, "mla_serve_reasoning_loops_total", model=MODEL, channel="reasoning") == 1
    detections, tokens = histogram(url, "mla_serve_loop_detection_tokens")
    # The prefix (404 characters) and four 429-character units, at 4 characters a token.
    assert detections == 1 and (404 + 4 * 429) / 4 <= tokens <= (404 + 5 * 429) / 4
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 1
    assert count(url, "mla_serve_runaways_by_cause_total", model=MODEL, cause="loop") == 1
    assert count(url, "mla_serve_loop_tokens_saved_total", model=MODEL) == 0
    assert count(url, "mla_serve_loop_stops_total", model=MODEL) == 0


def test_stop_ends_the_stream_early_aborts_upstream_and_counts_the_tokens_saved(vllm, sidecar):
    vllm.behaviour.token_delay = 0.001
    url = sidecar(loop_action="stop")
    chunks, reasoning, content = streamed(url, "[loop:paragraph] why?")
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and content == ""
    assert last.model_extra["stop_reason"] == "loop_detected"
    marker = chunks[-1].model_extra["loop_guard"]
    assert marker["action"] == "stop" and marker["channel"] == "reasoning"
    assert marker["period_chars"] == 429 and marker["repeats"] >= 4
    emitted = marker["completion_tokens"]
    assert emitted == len(chunks) - 2  # every chunk but the role chunk and the stop chunk
    assert len(reasoning) == 4 * emitted and emitted < 700
    assert marker["tokens_saved"] == MAX_TOKENS - emitted
    assert count(url, "mla_serve_loop_tokens_saved_total", model=MODEL) == MAX_TOKENS - emitted
    assert count(url, "mla_serve_loop_stops_total", model=MODEL) == 1
    # The upstream request was closed: the stand-in saw its client go (vLLM aborts there).
    deadline = time.monotonic() + 5
    while vllm.behaviour.streams_cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert vllm.behaviour.streams_cancelled == 1
    generated = vllm.behaviour.generated_tokens
    # What the stand-in produced after the confirming chunk, before it saw the close (a bound
    # loose enough for a loaded machine, far below the 3000 tokens of observe mode).
    assert emitted <= generated <= emitted + MAX_TOKENS // 10
    # The stopped choice still counts as a runaway (no visible answer), caused by a loop.
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 1
    assert count(url, "mla_serve_runaways_by_cause_total", model=MODEL, cause="loop") == 1
    assert count(url, "mla_serve_runaway_tokens_total", model=MODEL) == emitted
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="length") == 1


def test_observe_and_stop_differ_by_the_tokens_saved_on_vllms_own_counter(vllm, sidecar):
    """The CPU twin of tests/e2e/test_loops.py: the same requests in both modes."""
    observe, stop = sidecar(), sidecar(loop_action="stop")
    prompts = ["[loop:phrase] a", "[loop:single_token] b", "[loop:long_paragraph] c"]

    def generated_by(url: str, delay: float) -> float:
        vllm.behaviour.token_delay = delay  # stop: the stand-in paces tokens as an engine does
        before = count(vllm.url, "vllm:generation_tokens_total", model_name=MODEL, engine="0")
        for prompt in prompts:
            streamed(url, prompt)
        time.sleep(0.2)  # let the stand-in notice the closed streams
        return (
            count(vllm.url, "vllm:generation_tokens_total", model_name=MODEL, engine="0") - before
        )

    in_observe, in_stop = generated_by(observe, 0.0), generated_by(stop, 0.001)
    saved = count(stop, "mla_serve_loop_tokens_saved_total", model=MODEL)
    assert in_observe == len(prompts) * MAX_TOKENS
    assert saved > 0.8 * in_observe
    assert 0 <= saved - (in_observe - in_stop) <= 0.1 * saved  # tokens in flight at the close


def test_stop_with_usage_asked_ends_with_usage_then_done(vllm, sidecar):
    url = sidecar(loop_action="stop")
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "[loop:phrase] x"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage_chunk, stop_chunk = json.loads(events[-2]), json.loads(events[-3])
    assert usage_chunk["choices"] == []
    emitted = stop_chunk["loop_guard"]["completion_tokens"]
    assert usage_chunk["usage"] == {
        "prompt_tokens": None,
        "total_tokens": None,
        "completion_tokens": emitted,
    }
    assert stop_chunk["id"] == json.loads(events[0])["id"]  # the same response's chunks


def test_a_loop_in_content_is_stopped_but_is_no_runaway(sidecar):
    url = sidecar(loop_action="stop")
    chunks, _, content = streamed(url, "[loop:content_sentence] help")
    assert chunks[-1].choices[0].finish_reason == "length"
    assert content.startswith("The runaway comes from") and "I hope this helps!" in content
    assert count(url, "mla_serve_reasoning_loops_total", model=MODEL, channel="content") == 1
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 0


@pytest.mark.parametrize("action", ["observe", "stop"])
def test_legitimate_repetition_passes_untouched(vllm, sidecar, action):
    url = sidecar(loop_action=action)
    for name, (channel, text) in LEGIT.items():
        chunks, reasoning, content = streamed(url, f"[legit:{name}] go")
        assert (reasoning if channel == "reasoning" else content) == text, name
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert "mla_serve_reasoning_loops_total" not in samples(url)
    assert vllm.behaviour.streams_cancelled == 0


@pytest.mark.parametrize("action", ["observe", "stop"])
def test_non_streamed_loops_are_counted_from_the_final_text(vllm, sidecar, action):
    url = sidecar(loop_action=action)
    response = chat(url, "[loop:paragraph] why?", max_tokens=MAX_TOKENS)
    assert response.choices[0].finish_reason == "length"  # a whole answer cannot be cut short
    assert count(url, "mla_serve_reasoning_loops_total", model=MODEL, channel="reasoning") == 1
    assert count(url, "mla_serve_runaways_by_cause_total", model=MODEL, cause="loop") == 1
    plain = chat(url, "[runaway] think", max_tokens=64)  # long reasoning, no loop
    assert plain.choices[0].finish_reason == "length"
    assert count(url, "mla_serve_runaways_by_cause_total", model=MODEL, cause="long_reasoning") == 1
    recent = httpx.get(f"{url}/status").json()["runaways"]["recent"]
    assert [runaway["cause"] for runaway in recent] == ["long_reasoning", "loop"]
    legit = chat(url, "[legit:long_reasoning] go", max_tokens=MAX_TOKENS)
    assert legit.choices[0].finish_reason == "stop"
    assert count(url, "mla_serve_reasoning_loops_total", model=MODEL, channel="reasoning") == 1


def test_per_model_action_overrides_the_default(vllm, sidecar):
    stop_here = sidecar(loop_action="off", loop_model_actions=f"other=observe,{MODEL}=stop")
    chunks, _, _ = streamed(stop_here, "[loop:phrase] x")
    assert chunks[-1].choices[0].model_extra["stop_reason"] == "loop_detected"
    off_here = sidecar(loop_model_actions=f"{MODEL}=off")
    chunks, _, _ = streamed(off_here, "[loop:phrase] x")
    assert chunks[-1].choices[0].model_extra.get("stop_reason") is None
    assert "mla_serve_reasoning_loops_total" not in samples(off_here)


def test_completions_endpoint_loops_are_stopped_too(vllm, sidecar):
    url = sidecar(loop_action="stop")
    chunks = list(
        client(url).completions.create(
            model=MODEL, prompt="[loop:content_code_line] x", max_tokens=MAX_TOKENS, stream=True
        )
    )
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.text == ""
    assert chunks[-1].model_extra["loop_guard"]["channel"] == "text"
    assert count(url, "mla_serve_loop_stops_total", model=MODEL) == 1


def test_vllm_side_defaults_are_added_where_missing(vllm, sidecar):
    url = sidecar(
        default_repetition_detection='{"max_pattern_size": 64, "min_count": 8}',
        default_thinking_token_budget=8192,
    )
    chat(url, "hello", max_tokens=8)
    sent = vllm.behaviour.requests[-1]
    assert sent["repetition_detection"] == {"max_pattern_size": 64, "min_count": 8}
    assert sent["thinking_token_budget"] == 8192
    own = {"max_pattern_size": 8, "min_pattern_size": 2, "min_count": 3}
    chat(url, "hello", max_tokens=8, extra_body={"repetition_detection": own})
    assert vllm.behaviour.requests[-1]["repetition_detection"] == own
    bare = sidecar()
    chat(bare, "hello", max_tokens=8)
    assert "repetition_detection" not in vllm.behaviour.requests[-1]
    assert "thinking_token_budget" not in vllm.behaviour.requests[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--loop-action", "halt"], "--loop-action must be one of off, observe, stop"),
        (["--loop-model-actions", "dsv4"], "is not MODEL=ACTION"),
        (["--loop-min-repeats", "1"], "--loop-min-repeats must be at least 2"),
        (["--default-repetition-detection", "{"], "is not JSON"),
        (["--default-repetition-detection", '{"max_pattern_size": 8}'], "min_count"),
        (["--default-thinking-token-budget", "-5"], "must be 0 or more"),
    ],
)
def test_bad_guard_settings_are_one_line_exit_2(flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mla_serve.cli", "sidecar", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr
