"""The OpenAI pass-through: the official `openai` client → sidecar → stand-in vLLM.

Every hop is a real HTTP server on 127.0.0.1; the stand-in speaks vLLM 0.33.0's
protocol (tests/vllm_standin.py) and produces runaways, answers, tool calls,
slow streams, errors, stalls and disconnects on request.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from pathlib import Path

import httpx
import openai
import pytest

from mla_serve.sidecar.passthrough.runaways import Choice
from tests.scrape import count

MODEL = "glm-5.3-flash"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test-key", max_retries=0, timeout=30)


def ask(text: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def test_non_streamed_answer_passes_through_and_is_counted(sidecar):
    url = sidecar()
    response = client(url).chat.completions.create(**ask("hello", max_tokens=32))
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "word0 word1 word2 word3 word4 "
    assert choice.message.model_extra["reasoning"] == "think0 think1 think2 "
    assert response.usage.completion_tokens_details.reasoning_tokens == 3
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 1
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 0


def test_streamed_answer_arrives_chunk_by_chunk_without_extra_usage(vllm, sidecar):
    vllm.behaviour.token_delay = 0.05
    url = sidecar()
    started = time.monotonic()
    stream = client(url).chat.completions.create(**ask("hello", max_tokens=32), stream=True)
    arrivals, content, reasoning, chunks = [], "", "", []
    for chunk in stream:
        arrivals.append(time.monotonic() - started)
        chunks.append(chunk)
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            reasoning += chunk.choices[0].delta.model_extra.get("reasoning") or ""
    assert content == "word0 word1 word2 word3 word4 "
    assert reasoning == "think0 think1 think2 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)  # not asked for, not shown
    assert vllm.behaviour.requests[-1]["stream_options"] == {"include_usage": True}
    # Forwarded as produced: the first chunk long before the last.
    assert arrivals[0] < arrivals[-1] - 0.3
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 1


def test_usage_the_client_asks_for_is_kept(sidecar):
    url = sidecar()
    stream = client(url).chat.completions.create(
        **ask("hello"), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize("stream", [False, True])
def test_runaways_are_counted_with_their_tokens_and_listed_without_text(sidecar, stream):
    url = sidecar()
    request = ask("[runaway] solve this", max_tokens=64)
    if stream:
        chunks = list(client(url).chat.completions.create(**request, stream=True))
        request_id = chunks[0].id
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        response = client(url).chat.completions.create(**request)
        request_id = response.id
        assert response.choices[0].finish_reason == "length"
        assert response.choices[0].message.content is None
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 1
    assert count(url, "mla_serve_runaway_tokens_total", model=MODEL) == 64
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="length") == 1
    (recent,) = httpx.get(f"{url}/status").json()["runaways"]["recent"]
    assert recent["request_id"] == request_id
    assert recent["completion_tokens"] == 64 and recent["reasoning_tokens"] == 64
    assert "think" not in str(recent) and "solve" not in str(recent)


def test_tool_calls_and_truncated_answers_are_not_runaways(sidecar):
    url = sidecar()
    response = client(url).chat.completions.create(**ask("[tools] weather?"))
    assert response.choices[0].message.tool_calls[0].function.name == "get_weather"
    chunks = list(client(url).chat.completions.create(**ask("[tools] weather?"), stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="tool_calls") == 2
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 0
    truncated = Choice(visible=True, finish_reason="length")
    assert not truncated.runaway
    assert not Choice(tool_calls=True, finish_reason="length").runaway
    assert Choice(finish_reason="length").runaway


def test_completions_endpoint_runaway_is_whitespace_at_the_cap(sidecar):
    url = sidecar()
    response = client(url).completions.create(model=MODEL, prompt="[runaway] x", max_tokens=10)
    assert response.choices[0].finish_reason == "length"
    answer = client(url).completions.create(model=MODEL, prompt="hello", max_tokens=10)
    assert answer.choices[0].text.startswith("word0")
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 1
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 1


def test_status_headers_and_bodies_are_vllms_own(vllm, sidecar):
    url = sidecar()
    for stream in (False, True):
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json=ask("hello", stream=stream),
            headers={"Authorization": "Bearer team-key", "X-Request-Id": f"trace-{stream}"},
        )
        assert response.headers["x-request-id"] == f"trace-{stream}"  # vLLM's, passed back
        assert response.headers["content-type"].startswith(
            "text/event-stream" if stream else "application/json"
        )
        sent = vllm.behaviour.headers[-1]
        assert sent["authorization"] == "Bearer team-key"  # the client's, passed on
        assert sent["x-request-id"] == f"trace-{stream}"
    models = httpx.get(f"{url}/v1/models").json()
    assert models == httpx.get(f"{vllm.url}/v1/models").json() | {"data": models["data"]}
    assert models["data"][0]["owned_by"] == "vllm"
    response = httpx.post(f"{url}/v1/chat/completions", json=ask("[error] boom"))
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "The engine crashed (stand-in)."
    with pytest.raises(openai.InternalServerError):
        client(url).chat.completions.create(**ask("[error] boom"))
    missing = httpx.get(f"{url}/v1/no-such-endpoint")
    assert missing.status_code == 404  # vLLM's answer, passed through


def test_every_response_has_one_date_header(sidecar) -> None:
    """vLLM's server dates its responses, and so does the sidecar's (uvicorn's Date header,
    refreshed every second): a relayed response keeps the sidecar's one only, as nginx does
    (HTTP allows one Date field: RFC 9110 section 6.6.1), streamed or not."""
    url = sidecar()
    answers = [httpx.post(f"{url}/v1/chat/completions", json=ask("hello", stream=stream))
               for stream in (False, True)]  # fmt: skip
    answers.append(httpx.get(f"{url}/v1/models"))  # relayed as it came
    answers.append(httpx.get(f"{url}/v1/no-such-endpoint"))  # vLLM's 404, relayed
    answers.append(httpx.get(f"{url}/v2/models"))  # the sidecar's own 404
    for response in answers:
        dates = response.headers.get_list("date")
        assert len(dates) == 1, (response.request.url, dates)
        assert email.utils.parsedate_to_datetime(dates[0]).tzinfo is not None


def test_bad_requests_get_openai_errors(sidecar):
    url = sidecar(max_body_bytes=1024)
    response = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    too_big = httpx.post(f"{url}/v1/chat/completions", json=ask("x" * 4096))
    assert too_big.status_code == 413


def test_vllm_down_stalled_or_hanging_never_hangs_the_client(vllm, sidecar):
    url = sidecar(upstream_timeout=1.0, stream_idle_timeout=1.0)
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=ask("[stall] wait"), timeout=10)
    assert response.status_code == 504 and time.monotonic() - started < 3
    assert response.json()["error"]["type"] == "upstream_timeout"

    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=ask("[hang] x", stream=True), timeout=10
    ) as stream:
        body = b"".join(stream.iter_bytes())
    assert stream.status_code == 200
    assert b'"type": "upstream_error"' in body and b"sent nothing for 1 s" in body

    vllm.stop()
    response = httpx.post(f"{url}/v1/chat/completions", json=ask("hello"), timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "upstream_unavailable"


def _own_protocol_sidecar(vllm, tmp_path):
    """The sidecar under its own httptools protocol (serve.protocol, as `mla-serve sidecar`
    runs it), where a client's leaving is a callback of the connection."""
    from mla_serve.sidecar import uvicorn_adapter
    from mla_serve.sidecar.app import create_app
    from mla_serve.sidecar.settings import Settings
    from tests.http_server import ServerThread

    settings = Settings(vllm_url=vllm.url, state_dir=tmp_path / "state", poll_interval=0.05)
    app = create_app(settings)
    return ServerThread(app, http=uvicorn_adapter.protocol("httptools", settings, app)).start()


@pytest.mark.parametrize("server", ["uvicorn's protocol", "the sidecar's protocol"])
def test_a_client_disconnect_cancels_the_upstream_request(vllm, sidecar, tmp_path, server):
    vllm.behaviour.token_delay = 0.05
    own = _own_protocol_sidecar(vllm, tmp_path) if server == "the sidecar's protocol" else None
    url = own.url if own is not None else sidecar()
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=ask("[runaway] long", max_tokens=400, stream=True),
        timeout=10,
    ) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 5
    while vllm.behaviour.streams_cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vllm.behaviour.streams_cancelled == 1  # vLLM saw the disconnect: slot freed
    if own is not None:
        own.stop()


def test_counters_are_exact_under_concurrency(sidecar):
    url = sidecar()

    async def run() -> None:
        async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        requests = []
        for index in range(96):
            text = "[runaway] x" if index % 3 == 0 else "hello"
            requests.append(
                async_client.chat.completions.create(
                    **ask(text, max_tokens=20), stream=bool(index % 2)
                )
            )
        results = await asyncio.gather(*requests)
        for result in results:
            if isinstance(result, openai.AsyncStream):
                async for _ in result:
                    pass
        await async_client.close()

    asyncio.run(run())
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 32
    assert count(url, "mla_serve_runaway_tokens_total", model=MODEL) == 32 * 20
    assert count(url, "mla_serve_completions_total", model=MODEL, finished_reason="stop") == 64


def test_canary_runaways_are_counted_apart(vllm, sidecar, tmp_path: Path):
    prompt = tmp_path / "canary.txt"
    prompt.write_text("[runaway] " + "a long shared prefix " * 600)
    url = sidecar(canary_prompt_file=prompt, canary_interval=0.2, canary_concurrency=4,
                  canary_max_tokens=16)  # fmt: skip
    deadline = time.monotonic() + 10
    while count(url, "mla_serve_canary_runaway_completions_total", model=MODEL) < 4:
        assert time.monotonic() < deadline, "no canary round completed"
        time.sleep(0.1)
    assert count(url, "mla_serve_runaway_completions_total", model=MODEL) == 0
    canary = httpx.get(f"{url}/status").json()["canary"]
    assert canary["enabled"] and canary["last_round"]["requests"] == 4
    assert vllm.behaviour.requests[0]["max_tokens"] == 16


def test_metrics_have_no_created_series_and_vllms_label_name(sidecar):
    """Counters and histograms export their samples only (no `_created` twin per series), and
    the finish label is named as vLLM's own (`vllm:request_success_total{finished_reason}`)."""
    url = sidecar()
    client(url).chat.completions.create(**ask("hello", max_tokens=32))
    client(url).chat.completions.create(**ask("[runaway] go", max_tokens=8))
    for _ in client(url).chat.completions.create(
        **ask("[loop:phrase] go", max_tokens=600), stream=True
    ):
        pass  # a loop the guard confirms while it streams: the detection histogram
    text = httpx.get(f"{url}/metrics", timeout=10).text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert any(line.startswith("mla_serve_runaway_completions_total{") for line in series)
    assert any(line.startswith("mla_serve_loop_detection_tokens_bucket{") for line in series)
    assert [line for line in series if "_created" in line.split("{")[0]] == []
    assert 'finished_reason="length"' in text and "finish_reason=" not in text
