"""A misbehaving vLLM (tests/hostile/fake_vllm.py) behind `mla-serve sidecar` (real CLI).

Bytes the client receives are compared with what the fake sent.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.hostile.conftest import MEMORY_LIMIT, RssPeak
from tests.hostile.wire import MODEL, ask, exchange, post

MiB = 1 << 20


def _stream(url: str, text: str, usage: bool = True, path: str = "/v1/chat/completions") -> bytes:
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    with httpx.stream("POST", f"{url}{path}", json=ask(text, stream=True, **extra),
                      timeout=30) as response:  # fmt: skip
        return b"".join(response.iter_raw())


def test_unparseable_events_are_relayed_unchanged(sidecar, fake, attack):
    """Item 8: events that are not the expected JSON pass unchanged and are counted."""
    check = attack("garbage SSE events (choices [1], index 'zero', non-JSON)", "8")
    unparsed = sidecar.metric("mla_serve_unparsed_events_total")
    stops = sidecar.metric("mla_serve_completions_total", model=MODEL, finished_reason="stop")
    received = _stream(sidecar.url, "[garbage] hi")
    check.check(received == fake.sent["[garbage]"], "bytes differ from what vLLM sent")
    new_unparsed = sidecar.metric("mla_serve_unparsed_events_total") - unparsed
    check.figures["unparsed_counted"] = new_unparsed
    check.check(new_unparsed == 4, f"{new_unparsed} unparsed events counted, 4 sent")
    stop_now = sidecar.metric("mla_serve_completions_total", model=MODEL, finished_reason="stop")
    check.check(stop_now - stops == 1, "the answer itself was not counted")
    check.done()


def test_negative_and_odd_usage_never_raises(sidecar, fake, attack):
    """Item 8: a negative completion_tokens and a string prompt_tokens."""
    check = attack("negative / non-integer usage counts", "8")
    runaways = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL)
    tokens = sidecar.metric("mla_serve_runaway_tokens_total", model=MODEL)
    received = _stream(sidecar.url, "[runaway] [negusage] x")
    check.check(received == fake.sent["[negusage] [runaway]"], "stream bytes differ")
    whole = httpx.post(f"{sidecar.url}/v1/chat/completions", json=ask("[runaway] [negusage] x"))
    check.check(whole.status_code == 200, f"whole: {whole.status_code}")
    check.check(whole.content == fake.sent["[negusage] [runaway]"], "whole bytes differ")
    counted = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL) - runaways
    check.check(counted == 2, f"{counted} of 2 runaways counted")
    check.check(sidecar.metric("mla_serve_runaway_tokens_total", model=MODEL) == tokens,
                "negative tokens were added")  # fmt: skip
    check.done()


def test_crlf_events_are_parsed(sidecar, fake, attack):
    """Item 8: CRLF-delimited SSE is legal; its runaways count."""
    check = attack("CRLF-delimited SSE events", "8")
    before = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL)
    received = _stream(sidecar.url, "[runaway] [crlf] x")
    check.check(received == fake.sent["[crlf] [runaway]"], "bytes differ")
    stripped = _stream(sidecar.url, "[runaway] [crlf] x", usage=False)
    check.check(b'"usage"' not in stripped and stripped.endswith(b"data: [DONE]\r\n\r\n"),
                "usage chunk not dropped from a CRLF stream")  # fmt: skip
    counted = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL) - before
    check.check(counted == 2, f"{counted} of 2 CRLF runaways counted")
    check.done()


def test_truncated_stream_ends_with_an_error_event(sidecar, fake, attack):
    """Item 8: a stream cut short is surfaced, not ended cleanly."""
    check = attack("upstream stream truncated mid-chunk", "8")
    before = sidecar.metric("mla_serve_truncated_responses_total")
    received = _stream(sidecar.url, "[truncate] hi")
    events = received.split(b"\n\n")
    last = json.loads(events[-2][len(b"data: ") :])
    check.check(last["error"]["type"] == "upstream_error", f"last event {events[-2][:80]!r}")
    check.check(b"[DONE]" not in received, "a [DONE] the upstream never sent")
    check.check(received.startswith(fake.sent["[truncate]"][:200]), "prefix differs")
    after = sidecar.metric("mla_serve_truncated_responses_total") - before
    check.check(after == 1, f"truncations counted: {after}")
    check.done()


def test_truncated_whole_body_aborts_the_connection(sidecar, attack):
    """Item 8: a non-streamed body cut short: the client sees a broken response."""
    check = attack("upstream whole body shorter than its Content-Length", "8")
    before = sidecar.metric("mla_serve_truncated_responses_total")
    reply = exchange(sidecar.port, post("/v1/chat/completions",
                                        json.dumps(ask("[truncate] hi")).encode()))  # fmt: skip
    declared = int(reply.header("content-length") or 0)
    check.figures.update(declared=declared, received=len(reply.body))
    check.check(reply.closed and len(reply.body) < declared, "ended as if complete")
    check.check(reply.header("transfer-encoding") is None, "vLLM's Content-Length replaced")
    with_client = None
    try:
        httpx.post(f"{sidecar.url}/v1/chat/completions", json=ask("[truncate] hi"), timeout=10)
    except httpx.HTTPError as error:
        with_client = type(error).__name__
    check.check(with_client is not None, "httpx saw a complete response")
    check.figures["httpx"] = with_client
    after = sidecar.metric("mla_serve_truncated_responses_total") - before
    check.check(after == 2, f"truncations counted: {after}")
    check.done()


def test_stalled_bodies_end_within_the_idle_timeout(sidecar, attack):
    """Item 7: a body that stalls after its headers, non-streamed and on /v1/responses."""
    check = attack("upstream body stalls after headers (whole, /v1/responses stream)", "7")
    whole = exchange(
        sidecar.port,
        post("/v1/chat/completions", json.dumps(ask("[bodystall] x")).encode()),
        timeout=15,
    )
    responses = exchange(
        sidecar.port,
        post(
            "/v1/responses",
            json.dumps({"model": MODEL, "input": "[bodystall] x", "stream": True}).encode(),
        ),
        timeout=15,
    )
    classified = exchange(sidecar.port, post("/v1/chat/completions", json.dumps(
        ask("[bodystall] x", stream=True)).encode()), timeout=15)  # fmt: skip
    check.figures.update(whole_s=round(whole.seconds, 2), responses_s=round(responses.seconds, 2),
                         stream_s=round(classified.seconds, 2))  # fmt: skip
    for name, reply in (("whole", whole), ("responses", responses), ("stream", classified)):
        check.check(reply.seconds < 5, f"{name} took {reply.seconds:.1f} s (idle timeout 1 s)")
    check.check(whole.closed and len(whole.body) < int(whole.header("content-length") or 0),
                "whole body ended as if complete")  # fmt: skip
    check.check(b"upstream_error" in classified.body, "no error event in the stream")
    check.check(responses.closed and responses.seconds > 0.5, "/v1/responses did not stall")
    check.check(not responses.body.endswith(b"[DONE]\n\n"), "/v1/responses ended cleanly")
    check.done()


def test_oversized_events_pass_through_in_parallel(sidecar, fake, attack):
    """Item 1: a 6 MiB event (over --max-event-bytes) per stream, 6 streams at once."""
    check = attack("6 MiB SSE events x6 streams in parallel", "1")
    unparsed = sidecar.metric("mla_serve_unparsed_events_total")
    with RssPeak(sidecar) as rss, ThreadPoolExecutor(6) as pool:
        received = list(pool.map(lambda _: _stream(sidecar.url, "[bigevent] x"), range(6)))
    check.figures["rss_peak_mib"] = round(rss.peak / MiB, 1)
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(all(r in fake.sent_all["[bigevent]"] for r in received), "bytes differ")
    counted = sidecar.metric("mla_serve_unparsed_events_total") - unparsed
    check.check(counted == 6, f"{counted} oversized events counted, 6 sent")
    check.done()


def test_upstream_errors_are_relayed(sidecar, attack):
    """Held before: a 429 with Retry-After is vLLM's own answer."""
    check = attack("upstream 429 with Retry-After", "8")
    response = httpx.post(f"{sidecar.url}/v1/chat/completions", json=ask("[retry] x"))
    check.check(response.status_code == 429, f"status {response.status_code}")
    check.check(response.headers.get("retry-after") == "7", "Retry-After lost")
    check.done()


def test_no_traceback_after_upstream_faults(sidecar, attack):
    check = attack("no traceback in the sidecar's log after the upstream faults", "8")
    text = sidecar.log.read_text(errors="replace")
    check.check("Traceback" not in text, text[text.find("Traceback") :][:800])
    held = sidecar.metric("mla_serve_buffered_bytes")
    check.check(held == 0, f"{held} bytes still counted as buffered")
    check.done()
