"""HTTP/1.1 framing a hostile client controls: heads, trailers, transfer codings, versions.

Every attack runs on each front (conftest.FRONTS): the fast path (httptools callbacks, no
ASGI), ASGI on httptools, and h11; the fronts' sidecars read request bodies for up to 5 s
of silence, so a refusal within about a second is the head's own timeout at work.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hostile.conftest import (
    FRONTS,
    MEMORY_LIMIT,
    SECONDS,
    TRAILER_BYTES,
    Front,
    Livez,
    RssPeak,
    fronts,
)
from tests.hostile.fake_vllm import HEAD_LIMIT, FakeVllm
from tests.hostile.wire import (
    CONTINUE,
    ask,
    chunked,
    closed_by_peer,
    complete,
    exchange,
    post,
    trickle,
)

MiB = 1 << 20
LIMIT = 32 * 1024  # --max-header-bytes, the default
CHAT = "/v1/chat/completions"
BODY = json.dumps(ask("hi")).encode()


@pytest.fixture(scope="module")
def front(fake: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Front]]:
    with fronts(fake.url, tmp_path_factory.mktemp("framing"), "--body-timeout", "5") as started:
        yield started


def _openai_error(reply, status: int) -> bool:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        reply.status == status
        and error.get("code") == status
        and isinstance(error.get("message"), str)
        and reply.header("connection") == "close"
    )


# -- trailers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FRONTS)
def test_trailers_never_reach_vllm_as_headers(front, fake, attack, name):
    """Trailer fields after the last chunk were appended to the request's headers and sent
    to vLLM: Authorization or any X-* past a front proxy's header policy."""
    check = attack(f"trailers passed on as headers ({name})", "trailers")
    one = front[name]
    trailers = (b"Authorization: Bearer smuggled\r\nX-Smuggled: 1\r\n"
                b"X-Forwarded-For: 6.6.6.6\r\n\r\n")  # fmt: skip
    responses = json.dumps({"model": "glm-5.3-flash", "input": "hi"}).encode()
    for path, body in ((CHAT, BODY), ("/v1/responses", responses)):
        reply = exchange(one.port, chunked(path, body, *one.headers) + trailers)
        seen = fake.last(path.partition("?")[0]).headers
        leaked = sorted({"authorization", "x-smuggled"} & set(seen))
        check.figures[path] = {"status": reply.status, "leaked": leaked}
        check.check(reply.status == 200, f"{path}: {reply.status}")
        check.check(not leaked, f"{path}: vLLM got {leaked}")
        check.check(seen.get("x-forwarded-for") == "127.0.0.1", f"{path}: XFF {seen}")
    check.done()


def _flood_trailers(one: Front, total: int, shape: str, pause: float) -> tuple[int, bool]:
    """A chat request whose trailers are `total` bytes of 1 KiB fields ("fields") or one
    value that never ends ("value"), in 1 MiB writes, until the sidecar closes the
    connection or its RSS is over the chart's limit; (trailer bytes sent, closed)."""
    field = b"X-Flood: " + b"f" * 1013 + b"\r\n"
    piece = field * 1024 if shape == "fields" else b"v" * MiB
    sent = 0
    with socket.create_connection(("127.0.0.1", one.port), timeout=10) as sock:
        sock.sendall(chunked(CHAT, BODY, *one.headers))
        time.sleep(pause)
        try:
            if shape == "value":
                sock.sendall(b"X-Long: ")
            while sent < total:
                sock.sendall(piece)
                sent += len(piece)
                if sent % (64 * MiB) == 0 and one.sidecar.rss() > MEMORY_LIMIT:
                    return sent, False
        except OSError:
            return sent, True
        return sent, closed_by_peer(sock, 5)


@pytest.mark.parametrize("shape", ["fields", "value"])
@pytest.mark.parametrize("name", FRONTS)
def test_trailer_flood_is_bounded(front, attack, name, shape):
    """1 GiB of trailers on one connection grew the sidecar from 62 to 1,459 MiB (fast
    path; ASGI when the client paused 0.3 s before them): now 431 at the head's limit."""
    check = attack(f"{TRAILER_BYTES >> 20} MiB of trailer {shape} on one connection ({name})",
                   "trailers")  # fmt: skip
    one = front[name]
    pause = 0.3 if name != "fast" else 0.0
    with RssPeak(one.sidecar) as rss:
        sent, closed = _flood_trailers(one, TRAILER_BYTES, shape, pause)
    check.figures.update(rss_peak_mib=round(rss.peak / MiB, 1), trailer_mib_sent=sent / MiB)
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(closed, "the connection was not closed")
    check.check(sent < 16 * MiB, f"{sent / MiB:.0f} MiB of trailers accepted")
    after = exchange(one.port, post(CHAT, BODY, *one.headers))
    check.check(after.status == 200, f"not serving after: {after.status}")
    check.done()


def _unterminated_value(one: Front, until: float, pause: float, opened: list[int]) -> None:
    """Keep a connection sending one trailer value that never ends, 4 KiB a write, until
    `until`; a connection the sidecar closes is opened again."""
    while time.monotonic() < until:
        opened.append(1)
        try:
            with socket.create_connection(("127.0.0.1", one.port), timeout=5) as sock:
                sock.sendall(chunked(CHAT, BODY, *one.headers))
                time.sleep(pause)
                sock.sendall(b"X-Endless: ")
                while (left := until - time.monotonic()) > 0:
                    sock.settimeout(max(0.05, left))
                    try:
                        sock.sendall(b"e" * 4096)
                    except TimeoutError:
                        continue
        except OSError:
            continue


@pytest.mark.parametrize("name", FRONTS)
def test_unterminated_trailer_values_leave_livez_fast(front, attack, name):
    """Two connections each sending one trailer value that never ends (httptools joined it
    piece by piece): /livez had a 4.4 s median over 20 s. Now each is refused at the head's
    limit; the attacker reconnects for the whole run."""
    check = attack(f"2 unterminated trailer values for {SECONDS:g} s, /livez timed ({name})",
                   "trailers")  # fmt: skip
    one = front[name]
    pause = 0.3 if name != "fast" else 0.0
    before = one.sidecar.rss()
    until = time.monotonic() + SECONDS
    opened: list[int] = []
    senders = [threading.Thread(target=_unterminated_value, args=(one, until, pause, opened))
               for _ in range(2)]  # fmt: skip
    with RssPeak(one.sidecar) as rss, Livez(one.sidecar) as livez:
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
    check.figures.update(seconds=SECONDS, connections=len(opened),
                         livez_median_ms=round(livez.median * 1000, 1),
                         livez_worst_ms=round(livez.worst * 1000, 1),
                         rss_peak_mib=round(rss.peak / MiB, 1),
                         rss_growth_mib=round((rss.peak - before) / MiB, 1))  # fmt: skip
    check.check(livez.median < 0.1, f"/livez median {livez.median * 1000:.0f} ms")
    check.check(livez.failed == 0, f"{livez.failed} /livez requests failed")
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(rss.peak - before < 64 * MiB, f"RSS grew by {(rss.peak - before) / MiB:.0f} MiB")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_trailers_have_the_heads_count_and_time_limits(front, attack, name):
    """--max-headers and --header-timeout watched only the head: 150 trailer fields were
    taken, and trailers trickled for as long as the body timeout allowed (5 s here)."""
    check = attack(f"150 trailer fields; trailers trickled ({name})", "trailers")
    one = front[name]
    fields = b"".join(b"X-T%d: v\r\n" % i for i in range(150)) + b"\r\n"
    many = exchange(one.port, chunked(CHAT, BODY, *one.headers) + fields)
    slow = trickle(one.port, chunked(CHAT, BODY, *one.headers), b"X-Slow: " + b"s" * 60, 0.2)
    message = slow.json()["error"]["message"] if slow.status else ""
    check.figures.update(many=many.status, slow=slow.status, slow_s=round(slow.seconds, 2),
                         slow_message=message)  # fmt: skip
    check.check(_openai_error(many, 431), f"150 trailer fields: {many.status} {many.body[:80]!r}")
    check.check(_openai_error(slow, 408) and "trailers" in message, f"trickled: {slow.status}")
    check.check(slow.seconds < 3, f"trickled trailers ended after {slow.seconds:.1f} s")
    ten = b"".join(b"X-T%d: v\r\n" % i for i in range(10)) + b"\r\n"
    fine = exchange(one.port, chunked(CHAT, BODY, *one.headers) + ten)
    check.check(fine.status == 200, f"10 trailer fields: {fine.status}")
    check.done()


# -- the head limit ------------------------------------------------------------------------------
def _padding(one: Front, size: int) -> int:
    """The X-Pad value length that makes a chat request's line and headers `size` bytes."""
    return size - (len(post(CHAT, BODY, *one.headers, "X-Pad: ")) - len(BODY))


@pytest.mark.parametrize("name", FRONTS)
def test_the_head_limit_is_exact_whatever_the_reads(front, fake, attack, name):
    """Heads over --max-header-bytes arriving in one read were served (33 and 40 KiB: 200;
    a 64 KiB head was forwarded to vLLM)."""
    check = attack(f"request heads of 32 KiB, +1 byte, 33, 40 and 64 KiB in one write ({name})",
                   "head")  # fmt: skip
    one = front[name]
    before = len(fake.seen)
    sizes = (LIMIT, LIMIT + 1, 33 * 1024, 40 * 1024, 64 * 1024)
    statuses = {
        size: exchange(
            one.port, post(CHAT, BODY, *one.headers, "X-Pad: " + "p" * _padding(one, size))
        )
        for size in sizes
    }
    check.figures["statuses"] = {size: reply.status for size, reply in statuses.items()}
    check.check(statuses[LIMIT].status == 200, f"a head of exactly {LIMIT}: {statuses[LIMIT]}")
    for size in sizes[1:]:
        check.check(_openai_error(statuses[size], 431), f"{size} bytes: {statuses[size].status}")
    padded = [len(seen.headers.get("x-pad", "")) for seen in fake.seen[before:]]
    check.check(max(padded) == _padding(one, LIMIT), f"vLLM saw heads padded by {padded}")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_a_pipelined_head_is_counted_on_its_own_bytes(front, attack, name):
    """A read that ends one request's head, carries its 40 KiB body and begins the next
    request's head is no read of the next head alone: counted against it, it made a 431."""
    check = attack(f"a head begun behind a 40 KiB body in one read ({name})", "head")
    one = front[name]
    first = post(CHAT, json.dumps(ask("x" * 40_000)).encode(), *one.headers)
    second = post(CHAT, BODY, *one.headers)
    received = b""
    with socket.create_connection(("127.0.0.1", one.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for part in (first[:50], first[50:] + second[:100], second[100:]):
            sock.sendall(part)
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while (final := received.replace(CONTINUE, b"")).count(b"HTTP/1.1 ") < 2 or not complete(
            final.split(b"HTTP/1.1 ")[-1]
        ):
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                piece = sock.recv(65536)
            except OSError:
                break
            if not piece or time.monotonic() > deadline:
                break
            received += piece
    statuses = [int(part[:3]) for part in received.replace(CONTINUE, b"").split(b"HTTP/1.1 ")[1:]]
    check.figures["statuses"] = statuses
    check.check(statuses == [200, 200], f"statuses {statuses}")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_a_request_answered_before_its_body_ends_the_connection(front, attack, name):
    """A request answered before its body came (a 404 for a path not passed through): the
    answer closes the connection, so its body is never read and nothing more is served on
    it (no head whose deadline the body's end could stop)."""
    check = attack(f"a body sent after its request's early answer ({name})", "head")
    one = front[name]
    extra = "".join(f"{header}\r\n" for header in one.headers).encode()
    with socket.create_connection(("127.0.0.1", one.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n" + extra
                     + b"\r\n")  # fmt: skip
        answer = b""
        while not complete(answer.replace(CONTINUE, b"")):
            answer += sock.recv(65536)
        answer = answer.replace(CONTINUE, b"")
        started = time.monotonic()
        with contextlib.suppress(OSError):
            sock.sendall(b"0123456789")
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(5)
        try:
            late = sock.recv(65536)
        except TimeoutError:
            late = b"(nothing)"
        except OSError:  # reset: the connection was closed before the bytes after it came
            late = b""
        took = time.monotonic() - started
    head = answer.partition(b"\r\n\r\n")[0].lower()
    check.figures.update(
        first=answer[:12].decode(), after=late[:12].decode(), seconds=round(took, 2)
    )
    check.check(answer.startswith(b"HTTP/1.1 404"), f"first: {answer[:40]!r}")
    check.check(b"connection: close" in head, "the answer keeps the connection")
    check.check(late == b"" and took < 3, f"after it: {late[:40]!r}, {took:.1f} s")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_vllms_response_head_limit_is_exact(front, attack, name):
    """The client to vLLM counted a response head only while it was incomplete, and took
    the trailers of a chunked response for more of its headers."""
    check = attack(f"vLLM response heads of 64 KiB and 64 KiB + 1, trailers ({name})", "head")
    one = front[name]
    fits = exchange(one.port, post(CHAT, json.dumps(ask("[fullhead] x")).encode(), *one.headers))
    over = exchange(one.port, post(CHAT, json.dumps(ask("[bighead] x")).encode(), *one.headers))
    check.figures.update(fits=fits.status, over=over.status, limit=HEAD_LIMIT)
    check.check(fits.status == 200, f"a head of exactly 64 KiB: {fits.status}")
    check.check(over.status == 502 and "head" in over.json()["error"]["message"],
                f"64 KiB + 1: {over.status} {over.body[:120]!r}")  # fmt: skip
    trailed = exchange(one.port, post(CHAT, json.dumps(ask("[trailers] x")).encode(), *one.headers))
    check.check(trailed.status == 200 and b'"choices"' in trailed.body, f"{trailed.status}")
    check.check(trailed.header("x-upstream-trailer") is None, "vLLM's trailer sent as a header")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_vllms_endless_trailer_is_cut(front, fake, attack, name):
    """vLLM's trailers were dropped but not counted: one trailer value that never ends was
    buffered by the parser until the stream idle timeout (300 s by default)."""
    check = attack(f"vLLM sends one endless trailer value ({name})", "head")
    one = front[name]
    before = fake.trailer_bytes
    with RssPeak(one.sidecar) as rss:
        request = post(CHAT, json.dumps(ask("[endlesstrailer] x")).encode(), *one.headers)
        reply = exchange(one.port, request, timeout=8)
        time.sleep(0.5)
        sent = fake.trailer_bytes - before
        time.sleep(0.5)
        later = fake.trailer_bytes - before
    check.figures.update(trailer_mib=round(sent / MiB, 1), rss_peak_mib=round(rss.peak / MiB, 1),
                         seconds=round(reply.seconds, 2))  # fmt: skip
    check.check(reply.seconds < 5, f"the response ended after {reply.seconds:.1f} s")
    check.check(reply.closed, "a response vLLM never finished was not cut off")
    check.check(later == sent, f"vLLM's connection still read: {sent} then {later} bytes")
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.done()


# -- transfer codings and versions -----------------------------------------------------------------
CODINGS = ("gzip, chunked", "deflate, chunked", "gzip", "identity")


@pytest.mark.parametrize("name", FRONTS)
def test_transfer_codings_but_chunked_are_501(front, fake, attack, name):
    """`Transfer-Encoding: gzip, chunked` was accepted and the compressed body forwarded as
    if plain (RFC 9112 section 6.1: 501)."""
    check = attack(f"Transfer-Encoding {', '.join(CODINGS)} ({name})", "codings")
    one = front[name]
    before = len(fake.seen)
    for coding in CODINGS:
        reply = exchange(one.port, chunked(CHAT, BODY, *one.headers, coding=coding) + b"\r\n")
        check.figures[coding] = reply.status
        check.check(_openai_error(reply, 501), f"{coding}: {reply.status} {reply.body[:80]!r}")
    reached = [seen.target for seen in fake.seen[before:] if seen.target.startswith(CHAT)]
    check.check(not reached, f"vLLM got {reached}")
    fine = exchange(one.port, chunked(CHAT, BODY, *one.headers, coding="Chunked") + b"\r\n")
    check.check(fine.status == 200, f"chunked: {fine.status}")
    check.done()


@pytest.mark.parametrize("name", FRONTS)
def test_http_versions_but_1x_are_505(front, fake, attack, name):
    """An `HTTP/2.0` request line was served as HTTP/1.1."""
    check = attack(f"HTTP/2.0 and HTTP/0.9 request lines ({name})", "versions")
    one = front[name]
    before = len(fake.seen)
    for version in ("2.0", "0.9"):
        reply = exchange(one.port, post(CHAT, BODY, *one.headers, version=version))
        check.figures[version] = reply.status
        check.check(_openai_error(reply, 505), f"HTTP/{version}: {reply.status}")
    reached = [seen.target for seen in fake.seen[before:] if seen.target.startswith(CHAT)]
    check.check(not reached, f"vLLM got {reached}")
    check.done()


def test_no_traceback_after_the_framing_attacks(front, attack):
    check = attack("no traceback in the sidecars' logs after the framing attacks", "trailers")
    for one in (front["fast"], front["h11"]):
        text = Path(one.sidecar.log).read_text(errors="replace")
        check.check("Traceback" not in text, text[text.find("Traceback") :][:800])
        held = one.sidecar.metric("mla_serve_buffered_bytes")
        check.check(held == 0, f"{held} bytes still counted as buffered")
    check.done()
