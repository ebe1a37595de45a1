"""The runaway guard against the live engine: the same requests in observe and in stop mode.

The stack's sidecar runs the guard in observe mode (the default); this file starts a second
sidecar in front of the same vLLM with `--loop-action stop`. Greedy decoding on dummy
weights repeats itself, so the same reasoning requests (thinking on; the tokenizer's added
tokens, EOS and `</think>` among them, and every token that is not plain ASCII text ruled
out, so each token streams as one visible chunk) are sent through both, one at a time.
vLLM's own `vllm:generation_tokens_total` then says how many tokens each mode cost, and the
stop sidecar's `mla_serve_loop_tokens_saved_total` must account for the difference. The
difference can only fall short of the saved figure by the tokens vLLM generated between the
sidecar closing the connection and vLLM aborting the request (in flight); the run records
that gap per request.

Everything measured goes to loops.json in the results (MLA_SERVE_E2E_RESULTS), pass or fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.e2e.conftest import thinking
from tests.e2e.model import Tiny
from tests.scrape import count, samples

ROOT = Path(__file__).resolve().parents[2]
STOP_PORT_OFFSET = 5  # beside the stack's own sidecar: several stacks run side by side
MAX_TOKENS = 3000  # of --max-model-len 4096: room for the loop to be confirmed and cut
PROMPTS = (
    "Why do sparse attention kernels need a top-k?",
    "Explain decode context parallelism in one paragraph.",
    "What does a CUDA graph capture?",
)
IN_FLIGHT_PER_REQUEST = 64  # tokens vLLM may generate before it sees the closed connection


def banned_tokens(model_dir: Path) -> dict[str, int]:
    """logit_bias ruling out the tokenizer's added tokens (the special ones, EOS among them,
    and <think>, </think>, the tool-call markup) and every token that does not decode to
    printable ASCII on its own: each token then streams as one chunk of visible text (a
    lone UTF-8 byte would be held back by the detokenizer)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bias = {str(token_id): -100 for token_id in tokenizer.get_added_tokens_decoder()}
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if not text or not all(" " <= c <= "~" for c in text):
            bias[str(token_id)] = -100
    return bias


@pytest.fixture(scope="module")
def stop_sidecar(live: dict[str, Any]) -> Iterator[str]:
    """A second sidecar, in stop mode, in front of the same vLLM."""
    log = Path(live["sidecar_log"]).with_name("sidecar-stop.log")
    port = int(live["sidecar_url"].rsplit(":", 1)[1]) + STOP_PORT_OFFSET
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "mla_serve.cli", "sidecar", "--host", "127.0.0.1",
         "--port", str(port), "--admin-port", str(port), "--vllm-url", live["vllm_url"],
         "--model", live["model"],
         "--loop-action", "stop", "--log-level", "warning"],
        cwd=ROOT, env=dict(os.environ), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/livez", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the stop-mode sidecar did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def generated(vllm_url: str, model: str) -> float:
    found = samples(vllm_url).get("vllm:generation_tokens_total", [])
    return sum(value for labels, value in found if labels.get("model_name") == model)


def settled(vllm_url: str, model: str, timeout: float = 20.0) -> float:
    """vLLM's generated-token count once it stops moving (aborts take a step or two)."""
    last, stable_since = generated(vllm_url, model), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = generated(vllm_url, model)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 1.5:
            break
    return last


def run_one(url: str, model: str, prompt: str, bias: dict[str, int], tiny: Tiny) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logit_bias=bias,
            stream=True,
            extra_body={"chat_template_kwargs": thinking(tiny, True)},
        )
    )
    texts = [
        (c.choices[0].delta.model_extra or {}).get("reasoning") or c.choices[0].delta.content or ""
        for c in chunks
        if c.choices
    ]
    last = chunks[-1]
    marker = (last.model_extra or {}).get("loop_guard")
    return {
        "prompt": prompt,
        "finish_reason": last.choices[0].finish_reason,
        "stop_reason": (last.choices[0].model_extra or {}).get("stop_reason"),
        "loop_guard": marker,
        "text_chunks": sum(1 for text in texts if text),
        "text": "".join(texts),
    }


def test_stop_mode_saves_what_vllm_stops_generating(
    live: dict[str, Any], stop_sidecar: str, keep: Callable[[str, Any], None], tiny: Tiny
) -> None:
    vllm_url, model, observe_url = live["vllm_url"], live["model"], live["sidecar_url"]
    # Metrics: the stack's sidecar on its admin port; the stop-mode one serves both on one.
    admin = {observe_url: live["admin_url"], stop_sidecar: stop_sidecar}
    bias = banned_tokens(Path(live["model_dir"]))
    report: dict[str, Any] = {"max_tokens": MAX_TOKENS, "banned_tokens": len(bias)}
    runs: dict[str, list[dict[str, Any]]] = {}
    cost: dict[str, float] = {}
    loops_before = {
        url: sum(v for _, v in samples(admin[url]).get("mla_serve_reasoning_loops_total", []))
        for url in (observe_url, stop_sidecar)
    }
    saved_before = count(stop_sidecar, "mla_serve_loop_tokens_saved_total", model=model)
    try:
        for mode, url in (("observe", observe_url), ("stop", stop_sidecar)):
            before = settled(vllm_url, model)
            runs[mode] = [run_one(url, model, prompt, bias, tiny) for prompt in PROMPTS]
            cost[mode] = settled(vllm_url, model) - before
        saved = count(stop_sidecar, "mla_serve_loop_tokens_saved_total", model=model) - saved_before
        loops = {
            mode: sum(v for _, v in samples(admin[url]).get("mla_serve_reasoning_loops_total", []))
            - loops_before[url]
            for mode, url in (("observe", observe_url), ("stop", stop_sidecar))
        }
        running = samples(vllm_url).get("vllm:num_requests_running", [])
        report.update(
            generated_tokens=cost,
            vllm_difference=cost["observe"] - cost["stop"],
            sidecar_tokens_saved=saved,
            in_flight=saved - (cost["observe"] - cost["stop"]),
            loops_confirmed=loops,
            requests_running_after=sum(
                v for labels, v in running if labels.get("model_name") == model
            ),
        )
    finally:
        report["runs"] = {
            mode: [{**run, "text": run["text"][:200], "tail": run["text"][-200:]} for run in found]
            for mode, found in runs.items()
        }
        keep("loops.json", report)

    stopped = [run for run in runs["stop"] if run["stop_reason"] == "loop_detected"]
    assert stopped, "no request looped under greedy decoding: see loops.json for the texts"
    # observe: every request ran to max_tokens, and vLLM generated all of them.
    assert all(run["finish_reason"] == "length" for run in runs["observe"])
    assert cost["observe"] == len(PROMPTS) * MAX_TOKENS
    assert loops["observe"] >= len(stopped) and loops["stop"] == len(stopped)
    for run, twin in zip(runs["stop"], runs["observe"], strict=True):
        assert twin["text"].startswith(run["text"])  # greedy: stop relays vLLM's own prefix
        if run in stopped:
            marker = run["loop_guard"]
            assert run["finish_reason"] == "length"
            assert marker["completion_tokens"] == run["text_chunks"]  # a token a chunk
            assert marker["tokens_saved"] == MAX_TOKENS - marker["completion_tokens"]
    assert saved == sum(run["loop_guard"]["tokens_saved"] for run in stopped)
    # vLLM's own counter: stop mode cost fewer tokens, by what the sidecar says it saved
    # minus the tokens in flight when each connection closed.
    difference = cost["observe"] - cost["stop"]
    assert 0 < difference <= saved
    assert saved - difference <= IN_FLIGHT_PER_REQUEST * len(stopped)
    assert report["requests_running_after"] == 0  # aborted: nothing left running on vLLM
