"""What the sidecar holds for its clients: memory for request bodies and streamed responses,
label values in /metrics, connection slots; `mla-serve sidecar` (real CLI) in front of
tests/hostile/fake_vllm.py, each test with its own sidecar.

Memory is the sidecar process's RSS sampled every 10 ms (conftest.RssPeak) and held to the
chart's limit, 512Mi; label values come from a closed set, whatever clients and vLLM send;
at the connection cap the oldest connections still waiting for their head make room.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hostile.conftest import MEMORY_LIMIT, Livez, RssPeak
from tests.hostile.fake_vllm import HUGE_BYTES
from tests.hostile.wire import MODEL, ask, closed_by_peer, exchange, post

MiB = 1 << 20
CHAT = "/v1/chat/completions"
# The sidecar's defaults for what the suite shortens (conftest.Sidecar): these tests are of
# a sidecar as deployed.
DEFAULTS = ("--body-timeout", "60", "--header-timeout", "30", "--stream-idle-timeout", "300",
            "--upstream-timeout", "600")  # fmt: skip


def test_32_bodies_of_16_mib_stay_under_the_charts_limit(start_sidecar, fake, attack):
    """32 clients each POST a 16 MiB streamed chat body at once, with the default limits
    (16 MiB a body, 64 MiB in flight): every copy of a body the sidecar holds counts against
    the budget, so its RSS stays under 512 MiB; /livez answers within a second meanwhile."""
    check = attack("32 streamed chat bodies of 16 MiB at once, default limits", "memory")
    sidecar = start_sidecar(fake.url, *DEFAULTS)
    sidecar.wait_ready()
    base = len(json.dumps(ask("", stream=True)).encode())
    body = json.dumps(ask("y" * (16 * MiB - base), stream=True)).encode()
    assert len(body) == 16 * MiB
    request = post(CHAT, body)
    with RssPeak(sidecar) as rss, Livez(sidecar) as livez, ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(lambda _: exchange(sidecar.port, request, timeout=60), range(32)))
    statuses = [reply.status for reply in replies]
    check.figures.update(statuses=statuses, rss_peak_mib=round(rss.peak / MiB, 1),
                         livez_worst_s=round(livez.worst, 3))  # fmt: skip
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(livez.worst < 1.0 and not livez.failed, f"/livez took {livez.worst:.2f} s")
    check.check(all(status in (200, 503) for status in statuses), f"statuses {statuses}")
    check.check(200 in statuses, "no body got through")
    held = sidecar.metric("mla_serve_buffered_bytes")
    check.check(held == 0, f"{held} bytes still counted as buffered")
    check.done()


def _slow_http10_stream(port: int, request: bytes, pause: float) -> tuple[int, bytes, bool]:
    """Send `request`, read nothing for `pause` s, then read to the end; (bytes received,
    the last bytes, whether the connection ended)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", port))
    with sock:
        sock.sendall(request)
        time.sleep(pause)
        sock.settimeout(10)
        total, last, ended = 0, b"", False
        try:
            while piece := sock.recv(1 << 20):
                total += len(piece)
                last = (last + piece)[-64:]
            ended = True
        except OSError:
            pass
    return total, last, ended


@pytest.mark.parametrize(
    "front",
    [
        "fast",
        "expect",
        "h11",
    ],
)  # fmt: skip
def test_an_http10_stream_is_relayed_with_back_pressure(start_sidecar, fake, attack, front):
    """An HTTP/1.0 client (no chunked coding: the stream comes as it is, ended by the
    connection's end) of a 200 MiB stream reads nothing for 3 s, then all of it. The
    sidecar reads vLLM only as fast as the client takes the stream: its RSS grows by far
    less than the stream (64 MiB at most), and the client gets it whole (the fake's stream
    is HUGE_BYTES less a part of one ~64 KiB event)."""
    check = attack(f"HTTP/1.0 client of a 200 MiB stream that reads late ({front})", "memory")
    sidecar = start_sidecar(fake.url, *(("--http", "h11") if front == "h11" else ()))
    document = {"model": MODEL, "input": "[huge] x", "stream": True}
    headers = ("Expect: 100-continue",) if front == "expect" else ()
    request = post("/v1/responses", json.dumps(document).encode(), *headers, version="1.0")
    before = sidecar.rss()
    with RssPeak(sidecar) as rss:
        total, last, ended = _slow_http10_stream(sidecar.port, request, 3.0)
    growth = rss.peak - before
    check.figures.update(rss_growth_mib=round(growth / MiB, 1), received_mib=round(total / MiB))
    check.check(growth < 64 * MiB, f"RSS grew by {growth / MiB:.0f} MiB")
    check.check(ended and last.endswith(b"data: [DONE]\n\n"), f"the stream ended {last!r}")
    check.check(total > HUGE_BYTES - (1 << 17), f"{total} bytes received")  # less than an event
    check.done()


def _series(sidecar) -> list[tuple[str, dict[str, str]]]:
    text = httpx.get(f"{sidecar.admin}/metrics", timeout=5).text
    return [
        (sample.name, dict(sample.labels))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("mla_serve_")
    ]


FINISH_REASONS = {"stop", "length", "tool_calls", "abort", "repetition", "error", "other"}


def test_label_values_are_a_closed_set(start_sidecar, fake, attack):
    """200 streamed chats each naming a new `model`, then 100 whole responses whose `model`
    and `finish_reason` vLLM makes up: /metrics gains a few series, not one per value; a
    model label is one of vLLM's served names or `other`, a finish reason one of vLLM's or
    `other`."""
    check = attack("200 made-up request models; 100 made-up response labels", "labels")
    sidecar = start_sidecar(fake.url)
    sidecar.wait_ready()
    before = _series(sidecar)
    made_up = [f"m-{i}-{uuid.uuid4().hex[:8]}" for i in range(200)]
    for model in made_up:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        reply = exchange(sidecar.port, post(CHAT, json.dumps(body).encode()))
        check.check(reply.status == 200, f"{model}: {reply.status}")
    for _ in range(100):
        reply = exchange(sidecar.port, post(CHAT, json.dumps(ask("[oddlabels] x")).encode()))
        check.check(reply.status == 200, f"odd labels: {reply.status}")
    after = _series(sidecar)
    new = [series for series in after if series not in before]
    models = {labels["model"] for _, labels in new if "model" in labels}
    # the finish reason's label by either name (vLLM's own metrics say finished_reason)
    reasons = {value for _, labels in new for name, value in labels.items()
               if name in ("finish_reason", "finished_reason")}  # fmt: skip
    check.figures.update(series_before=len(before), series_after=len(after),
                         models=len(models), finish_reasons=len(reasons))  # fmt: skip
    check.check(len(after) - len(before) < 50, f"{len(after) - len(before)} new series")
    check.check(models <= set(fake.models) | {"other"}, f"{len(models)} model values")
    check.check(reasons <= FINISH_REASONS, f"finish reasons {sorted(reasons)[:5]}…")
    check.done()


def test_idle_connections_at_the_cap_make_room(start_sidecar, fake, attack):
    """--max-connections 8, all eight taken by connections that never send a byte (and
    --header-timeout 30 s would keep them): a real request still gets served, and the
    oldest idle connection is the one closed to make room."""
    check = attack("8 idle connections at --max-connections 8, then a request", "connections")
    sidecar = start_sidecar(fake.url, "--max-connections", "8", "--header-timeout", "30")
    idle = []
    try:
        for _ in range(8):
            idle.append(socket.create_connection(("127.0.0.1", sidecar.port)))
            time.sleep(0.05)  # in order: the first is the oldest
        time.sleep(0.3)
        reply = exchange(sidecar.port, post(CHAT, json.dumps(ask("hi")).encode()))
        oldest = closed_by_peer(idle[0], 2)
        newest = closed_by_peer(idle[-1], 0.2)
    finally:
        for sock in idle:
            sock.close()
    check.figures.update(status=reply.status, oldest_closed=oldest, newest_closed=newest)
    check.check(reply.status == 200, f"the request got {reply.status}")
    check.check(oldest, "the oldest idle connection was kept")
    check.check(not newest, "the newest idle connection was closed instead of the oldest")
    livez = httpx.get(f"{sidecar.admin}/livez", timeout=5).status_code
    check.check(livez == 200, f"/livez {livez}")
    check.done()
