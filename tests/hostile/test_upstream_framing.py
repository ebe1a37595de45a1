"""How the client to vLLM reads a response's framing (RFC 9112 section 6.3), through
`mla-serve sidecar` (real CLI) in front of tests/hostile/fake_vllm.py.

A response ends where its framing says: bytes after it are no response to any request (the
connection to vLLM is dropped), a response to HEAD has no body whatever its Content-Length,
a transfer coding but chunked cannot be relayed as a plain body, and a 101 to a request
that asked for no upgrade is no answer. Each test starts its own sidecar: what these
misbehaviours leave in a pooled connection or in the log is not shared with other tests.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.hostile import wire
from tests.hostile.conftest import FRONTS, Front, fronts
from tests.hostile.fake_vllm import NOT_ALLOWED, FakeVllm
from tests.hostile.wire import CONTINUE, MODEL, ask, complete, exchange, get, post

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def front(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Front]]:
    with fronts(fake.url, tmp_path_factory.mktemp("upstream-framing")) as started:
        yield started


def _chat(text: str) -> bytes:
    return post(CHAT, json.dumps(ask(text)).encode())


def test_bytes_after_a_response_drop_vllms_connection(start_sidecar, fake, attack):
    """vLLM answers a request and, in the same write, sends the head and 10 bytes of a
    response nobody asked for. The client after it, on another connection, must get its own
    response: the sidecar's head (its Date), vLLM's body for it byte for byte, on a new
    connection to vLLM; and the one after that too (none is out of step)."""
    check = attack("vLLM writes a second, unasked response after one", "upstream framing")
    sidecar = start_sidecar(fake.url, "--upstream-timeout", "3")
    first = exchange(sidecar.port, _chat("[extra] a"))
    extra = fake.last(CHAT)
    check.check(first.status == 200 and first.body == fake.sent["[extra]"],
                f"the response itself: {first.status} {first.body[:80]!r}")  # fmt: skip
    replies = []
    for _ in range(2):
        reply = exchange(sidecar.port, _chat("hello"), timeout=6)
        seen = fake.last(CHAT)
        replies.append((reply.status, reply.header("date") is not None, seen.connection))
        check.check(reply.status == 200 and reply.body == fake.sent[""],
                    f"the next client got {reply.status} {reply.body[:80]!r}")  # fmt: skip
        check.check(reply.header("date") is not None, f"not the sidecar's head: {reply.head!r}")
    check.figures.update(replies=replies, extra_connection=extra.connection)
    check.check(all(connection != extra.connection for *_, connection in replies),
                "the connection that carried the unasked bytes was used again")  # fmt: skip
    check.done()


def _read_head(sock: socket.socket, seconds: float) -> bytes:
    """The bytes up to the end of a final response's head (an interim 100 Continue left
    out), or what came within `seconds`."""

    def done(data: bytes) -> bool:
        data = data.removeprefix(CONTINUE)
        return b"\r\n\r\n" in data and not CONTINUE.startswith(data[: len(CONTINUE)])

    return wire.read_until(sock, seconds, done).removeprefix(CONTINUE)


def _more(sock: socket.socket, seconds: float) -> bytes | None:
    """Bytes that come within `seconds` (b"" when none), None when the connection ended."""
    sock.settimeout(seconds)
    try:
        piece = sock.recv(65536)
    except TimeoutError:
        return b""
    except OSError:
        return None
    return piece or None


@pytest.mark.parametrize("name", FRONTS)
def test_head_is_answered_at_once_without_a_body(front, fake, attack, name):
    """HEAD /v1/models: vLLM's head (405, its Content-Length, no body) must come at once,
    not after --stream-idle-timeout (1 s here); the connection is kept and answers the next
    request; nothing is counted as truncated; three HEADs in a row reuse one connection to
    vLLM (none is left behind holding one)."""
    check = attack(f"HEAD /v1/models three times on one connection ({name})", "upstream framing")
    one = front[name]
    extra = "".join(f"{header}\r\n" for header in one.headers)
    truncated = one.sidecar.metric("mla_serve_truncated_responses_total")
    before = len(fake.seen)
    heads = []
    with socket.create_connection(("127.0.0.1", one.port), timeout=5) as sock:
        for _ in range(3):
            started = time.monotonic()
            sock.sendall(f"HEAD /v1/models HTTP/1.1\r\nHost: sidecar\r\n{extra}\r\n".encode())
            head = _read_head(sock, 0.6)
            took = time.monotonic() - started
            after = _more(sock, 0.2)
            heads.append((head[:12].decode("latin-1"), round(took, 2), repr(after)))
            lines = head.lower().split(b"\r\n")
            check.check(head.startswith(b"HTTP/1.1 405") and head.endswith(b"\r\n\r\n"),
                        f"HEAD: {head[:60]!r} after {took:.2f} s")  # fmt: skip
            check.check(b"content-length: %d" % len(NOT_ALLOWED) in lines,
                        f"vLLM's Content-Length not kept: {head!r}")  # fmt: skip
            check.check(after == b"", f"after the head: {after!r} (None: the connection ended)")
            if after is None:
                break
        sock.sendall(get("/v1/models"))
        data = b""
        while not complete(data):
            piece = _more(sock, 3)
            if not piece:
                break
            data += piece
    check.check(data.startswith(b"HTTP/1.1 200") and MODEL.encode() in data,
                f"the request after the HEADs: {data[:60]!r}")  # fmt: skip
    counted = one.sidecar.metric("mla_serve_truncated_responses_total") - truncated
    used = {seen.connection for seen in fake.seen[before:] if seen.method == "HEAD"}
    check.figures.update(heads=heads, truncated=counted, vllm_connections=len(used))
    check.check(counted == 0, f"{counted} HEAD responses counted as truncated")
    check.check(len(used) == 1, f"three HEADs took {len(used)} connections to vLLM")
    check.done()


def test_a_transfer_coding_but_chunked_from_vllm_is_502(start_sidecar, fake, attack):
    """vLLM's response in `Transfer-Encoding: gzip` (not chunked), ended by the connection's
    end: the pass-through cannot relay it as a plain body (RFC 9112 section 6.1); 502."""
    check = attack("vLLM's response in Transfer-Encoding gzip", "upstream framing")
    sidecar = start_sidecar(fake.url)
    reply = exchange(sidecar.port, _chat("[gzipte] x"))
    check.figures.update(status=reply.status, body=reply.body[:80].decode("latin-1"))
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    check.check(reply.status == 502 and isinstance(error, dict), f"{reply.status} {reply.head!r}")
    after = exchange(sidecar.port, _chat("hello"))
    check.check(after.status == 200 and after.body == fake.sent[""], f"after: {after.status}")
    check.done()


def test_a_101_from_vllm_is_502_without_a_traceback(start_sidecar, fake, attack):
    """vLLM answers `101 Switching Protocols` to a request that asked for no upgrade: no
    response the client can be given (502), and no traceback in the sidecar's log."""
    check = attack("vLLM answers 101 to a chat request", "upstream framing")
    sidecar = start_sidecar(fake.url)
    reply = exchange(sidecar.port, _chat("[switch] x"), timeout=5)
    time.sleep(0.2)  # what the loop logs about it
    text = sidecar.log.read_text(errors="replace")
    check.figures.update(status=reply.status, traceback="Traceback" in text)
    check.check(reply.status == 502, f"{reply.status} {reply.head[:60]!r}")
    check.check("Traceback" not in text, text[text.find("Traceback") :][:800])
    after = exchange(sidecar.port, _chat("hello"))
    check.check(after.status == 200 and after.body == fake.sent[""], f"after: {after.status}")
    check.done()
