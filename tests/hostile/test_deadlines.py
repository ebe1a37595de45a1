"""Clients and a vLLM that keep an exchange open without ever breaking a silence timeout.

Each runs on every front (conftest.FRONTS) of sidecars with --body-deadline 2,
--response-deadline 0.8 and --write-timeout 1 (and the suite's 1 s body and stream idle
timeouts, which none of these attacks lets expire).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.hostile.conftest import FRONTS, Front, fronts
from tests.hostile.fake_vllm import FakeVllm
from tests.hostile.wire import MODEL, ask, exchange, post, trickle

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def front(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Front]]:
    flags = ("--body-deadline", "2", "--response-deadline", "0.8", "--write-timeout", "1")
    with fronts(fake.url, tmp_path_factory.mktemp("deadlines"), *flags) as started:
        yield started


@pytest.mark.parametrize("name", FRONTS)
def test_a_trickled_body_ends_at_the_body_deadline(front, attack, name):
    """A body that trickles (a byte within every --body-timeout) held its share of the
    in-flight budget with no total deadline: four such clients held the 64 MiB budget."""
    check = attack(f"request body trickled a byte every 0.4 s ({name})", "deadlines")
    one = front[name]
    body = json.dumps(ask("hi")).encode()
    whole = post(CHAT, body, *one.headers)
    reply = trickle(one.port, whole[: -len(body)], body, 0.4, timeout=8)
    message = reply.json()["error"]["message"] if reply.status else ""
    check.figures.update(status=reply.status, seconds=round(reply.seconds, 2), message=message)
    check.check(reply.status == 408 and "within 2 s" in message, f"{reply.status} {message!r}")
    check.check(reply.header("connection") == "close", "connection not closed")
    check.check(1.8 <= reply.seconds < 4, f"ended after {reply.seconds:.1f} s")
    held = one.sidecar.metric("mla_serve_buffered_bytes")
    check.check(held == 0, f"{held} bytes still held")
    check.done()


@pytest.mark.parametrize("name", [*FRONTS, "unclassified"])
def test_a_trickled_response_ends_at_the_response_deadline(front, fake, attack, name):
    """vLLM (or anything at its address) trickling a whole response's body, a byte within
    every --stream-idle-timeout, kept the exchange (and what it keeps to classify) open
    for as long as it liked. Streams have no such deadline."""
    check = attack(f"vLLM trickles a whole response a byte every 0.3 s ({name})", "deadlines")
    one = front["fast" if name == "unclassified" else name]
    before = one.sidecar.metric("mla_serve_truncated_responses_total")
    if name == "unclassified":  # a route the pass-through relays without classifying it
        data = post(
            "/v1/responses",
            json.dumps({"model": MODEL, "input": "[bodytrickle]", "stream": False}).encode(),
        )
    else:
        data = post(CHAT, json.dumps(ask("[bodytrickle] x")).encode(), *one.headers)
    reply = exchange(one.port, data, timeout=10)
    declared = int(reply.header("content-length") or 0)
    check.figures.update(status=reply.status, seconds=round(reply.seconds, 2),
                         received=len(reply.body), declared=declared)  # fmt: skip
    check.check(reply.status == 200 and reply.closed, f"{reply.status}, closed {reply.closed}")
    check.check(len(reply.body) < declared, "ended as if complete")
    check.check(0.7 <= reply.seconds < 3, f"cut after {reply.seconds:.1f} s")
    cut = one.sidecar.metric("mla_serve_truncated_responses_total") - before
    check.check(cut == 1, f"{cut} truncations counted")
    if name != "unclassified":  # a stream outlives the deadline: 0.1 s an event, about 1.1 s
        path = f"{one.sidecar.url}{CHAT}"
        headers = dict(line.split(": ", 1) for line in one.headers)
        stream = httpx.post(path, json=ask("[slow] hi", stream=True), headers=headers, timeout=10)
        check.check(stream.text.endswith("data: [DONE]\n\n"), f"stream cut: {stream.text[-80:]!r}")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_a_client_that_never_reads_is_disconnected(front, fake, attack, name):
    """A client that never reads kept its exchange, and vLLM's request slot, open without a
    time bound. Now --write-timeout after its buffers fill, the connection is dropped and
    vLLM's request aborted."""
    check = attack(f"a client that never reads an endless stream ({name})", "deadlines")
    one = front[name]
    cut = fake.cut_streams
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", one.port))
    started = time.monotonic()
    try:
        sock.sendall(post(CHAT, json.dumps(ask("[endless] x", stream=True)).encode(), *one.headers))
        while fake.cut_streams == cut and time.monotonic() - started < 15:
            time.sleep(0.05)
        took = time.monotonic() - started
        sock.settimeout(1)
        ended = False
        reading = time.monotonic()
        try:  # what the sidecar had sent, then the end (an open connection streams on)
            while sock.recv(1 << 20) and time.monotonic() - reading < 5:
                pass
            ended = time.monotonic() - reading < 5
        except TimeoutError:
            pass
        except OSError:  # reset
            ended = True
    finally:
        sock.close()
    check.figures.update(seconds_to_abort=round(took, 2))
    check.check(fake.cut_streams == cut + 1, f"vLLM's stream still open after {took:.0f} s")
    check.check(ended, "the client's connection is still open")
    held = one.sidecar.metric("mla_serve_buffered_bytes")
    check.check(held == 0, f"{held} bytes still held")
    check.done()
