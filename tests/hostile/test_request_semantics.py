"""Request headers with a meaning in HTTP/1.1 itself: Upgrade, Transfer-Encoding in an
HTTP/1.0 request, Host (RFC 9110 section 7.8, RFC 9112 sections 3.2 and 6.1), on each front
(conftest.FRONTS) of `mla-serve sidecar` (real CLI) in front of tests/hostile/fake_vllm.py.

An upgrade the sidecar does not take is ignored: the request is served as any other, its
body relayed, and the request pipelined behind it answered. HTTP/1.0 has no transfer
codings: a 1.0 request with Transfer-Encoding has faulty framing (400, closed). An HTTP/1.1
request has exactly one Host, a valid one (400 otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.hostile import wire
from tests.hostile.conftest import FRONTS, Front, fronts
from tests.hostile.fake_vllm import FakeVllm
from tests.hostile.wire import CONTINUE, MODEL, ask, complete, exchange, exchange_to_end

CHAT = "/v1/chat/completions"
BODY = json.dumps(ask("hi")).encode()


@pytest.fixture(scope="module")
def front(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Front]]:
    with fronts(fake.url, tmp_path_factory.mktemp("request-semantics")) as started:
        yield started


def _openai_error(reply, status: int) -> bool:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return reply.status == status and isinstance(error.get("message"), str)


def _request(lines: list[str], body: bytes = b"") -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _responses(port: int, data: bytes, count: int, timeout: float = 5) -> list[bytes]:
    """Send `data`; read until `count` whole responses came (interim 100s left out), the
    connection ended, or `timeout`; each response's bytes."""
    import socket

    def done(received: bytes) -> bool:
        parts = _split(received.replace(CONTINUE, b""))
        return len(parts) >= count and complete(parts[count - 1])

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = wire.read_until(sock, timeout, done)
    return _split(received.replace(CONTINUE, b""))


def _split(data: bytes) -> list[bytes]:
    return [b"HTTP/1.1 " + part for part in data.split(b"HTTP/1.1 ")[1:]]


def _cases(kinds: dict[str, list[str]]) -> list:
    """(front, kind) for every front and kind."""
    return [
        pytest.param(name, kind, id=f"{kind.replace(' ', '-')}-{name}")
        for name in FRONTS
        for kind in kinds
    ]


UPGRADES = {
    # what `curl --http2 http://…` sends
    "h2c": ["Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
            "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA"],
    "websocket": ["Connection: Upgrade", "Upgrade: websocket",
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"],
}  # fmt: skip


@pytest.mark.parametrize(("name", "upgrade"), _cases(UPGRADES))
def test_an_upgrade_not_taken_is_ignored(front, fake, attack, name, upgrade):
    """A chat POST with `Upgrade: h2c` (or websocket) and a GET pipelined behind it: both
    answered 200, vLLM given the body byte for byte."""
    check = attack(f"POST with Upgrade: {upgrade}, a request pipelined after it ({name})",
                   "request semantics")  # fmt: skip
    one = front[name]
    before = len(fake.seen)
    head = [f"POST {CHAT} HTTP/1.1", "Host: sidecar", "Content-Type: application/json",
            f"Content-Length: {len(BODY)}", *UPGRADES[upgrade]]  # fmt: skip
    after = _request(["GET /v1/models HTTP/1.1", "Host: sidecar"])
    replies = _responses(one.port, _request(head, BODY) + after, 2, timeout=3)
    statuses = [int(reply[9:12]) for reply in replies]
    chats = [seen for seen in fake.seen[before:] if seen.target == CHAT]
    check.figures.update(statuses=statuses)
    check.check(statuses == [200, 200], f"statuses {statuses}: {replies[:1]!r}")
    check.check(len(replies) == 2 and b'"choices"' in replies[0], "no chat answer")
    check.check(len(replies) == 2 and MODEL.encode() in replies[1], "no answer to the GET")
    bodies = [seen.body for seen in chats]
    check.check(bodies == [BODY], f"vLLM got {[body[:40] for body in bodies]}")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_transfer_encoding_in_http10_is_400(front, fake, attack, name):
    """HTTP/1.0 has no transfer codings: a 1.0 request with Transfer-Encoding has faulty
    framing (RFC 9112 section 6.1): 400, the connection closed, nothing sent to vLLM."""
    check = attack(f"Transfer-Encoding: chunked in an HTTP/1.0 request ({name})",
                   "request semantics")  # fmt: skip
    one = front[name]
    before = len(fake.seen)
    head = [f"POST {CHAT} HTTP/1.0", "Host: sidecar", "Content-Type: application/json",
            "Transfer-Encoding: chunked", *one.headers]  # fmt: skip
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
    reply = exchange_to_end(one.port, _request(head, body))
    reached = [seen.target for seen in fake.seen[before:] if seen.target == CHAT]
    check.figures.update(status=reply.status)
    check.check(_openai_error(reply, 400), f"{reply.status} {reply.body[:80]!r}")
    check.check(reply.closed, "the connection was kept")
    check.check(not reached, f"vLLM got {reached}")
    check.done()


HOSTS = {
    "missing": [],
    "twice": ["Host: sidecar", "Host: other"],
    "with a space": ["Host: a b"],
}
# h11 refuses a missing and a second Host itself


@pytest.mark.parametrize(
    ("name", "host"),
    _cases(HOSTS),
)
def test_http11_without_one_valid_host_is_400(front, fake, attack, name, host):
    """An HTTP/1.1 request with no Host, two, or one that is no host[:port] is 400 (RFC
    9112 section 3.2), and vLLM never sees it."""
    check = attack(f"HTTP/1.1 request with Host {host} ({name})", "request semantics")
    one = front[name]
    before = len(fake.seen)
    head = [f"POST {CHAT} HTTP/1.1", *HOSTS[host], "Content-Type: application/json",
            f"Content-Length: {len(BODY)}", *one.headers]  # fmt: skip
    reply = exchange(one.port, _request(head, BODY))
    reached = [seen.target for seen in fake.seen[before:] if seen.target == CHAT]
    check.figures.update(status=reply.status)
    check.check(_openai_error(reply, 400), f"{reply.status} {reply.body[:80]!r}")
    check.check(not reached, f"vLLM got {reached}")
    check.done()
