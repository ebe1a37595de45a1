"""Hostile clients against `mla-serve sidecar` (real CLI: uvicorn + httptools + uvloop).

Every exchange is on 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.hostile.conftest import MEMORY_LIMIT, Livez, RssPeak
from tests.hostile.wire import MODEL, ask, closed_by_peer, complete, exchange, get, post

MiB = 1 << 20


def _openai_error(reply) -> bool:
    try:
        error = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def test_memory_big_json_bodies_in_parallel(sidecar, attack):
    """Item 1: 16 MiB JSON bodies in parallel, dense (many values) and plain (one long
    string); the sidecar must stay under the chart's 512Mi."""
    check = attack("16 MiB JSON bodies x16 in parallel (dense and long-string)", "1")
    dense = json.dumps(ask("x", extra=[{}] * (5 * MiB))).encode()[: 16 * MiB - 10]
    dense = dense[: dense.rfind(b"{}")] + b"{}]}"
    plain = json.dumps(ask("y" * (15 * MiB))).encode()
    under = json.dumps(ask("z", extra=[{}] * 450_000)).encode()  # 900k values: under the cap
    bodies = [dense] * 8 + [plain] * 6 + [under] * 2
    with RssPeak(sidecar) as rss, Livez(sidecar) as livez, ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: exchange(sidecar.port, post("/v1/chat/completions", b)),
                                bodies))  # fmt: skip
    statuses = [r.status for r in replies]
    check.figures.update(statuses=statuses, rss_peak_mib=round(rss.peak / MiB, 1),
                         livez_worst_s=round(livez.worst, 3))  # fmt: skip
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(all(s in (413, 503) for s in statuses[:8]), f"dense bodies: {statuses[:8]}")
    check.check(413 in statuses[:8], "no dense body was refused for its JSON values")
    check.check(all(s in (200, 503) for s in statuses[8:]), f"plain bodies: {statuses[8:]}")
    check.check(200 in statuses[8:], "no plain body got through")
    check.check(all(_openai_error(r) for r in replies if r.status != 200), "non-JSON error")
    check.check(httpx.get(f"{sidecar.admin}/livez").status_code == 200, "livez after")
    check.done()


def _unterminated_header(port: int, size: int) -> tuple[int, bool]:
    """Send a header value of `size` bytes that never ends; return (bytes accepted, closed)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
        piece = b"a" * MiB
        try:
            while sent < size:
                sock.sendall(piece)
                sent += len(piece)
        except OSError:
            return sent, True
        return sent, closed_by_peer(sock, 5)


def test_memory_unterminated_64mb_headers(sidecar, attack):
    """Item 1: eight unterminated 64 MB headers at once."""
    check = attack("8 unterminated 64 MB headers at once", "1")
    with RssPeak(sidecar) as rss, Livez(sidecar) as livez, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _unterminated_header(sidecar.port, 64 * MiB), range(8)))
    accepted = max(sent for sent, _ in results)
    check.figures.update(rss_peak_mib=round(rss.peak / MiB, 1), most_accepted_mib=accepted / MiB,
                         livez_worst_s=round(livez.worst, 3))  # fmt: skip
    check.check(rss.peak < MEMORY_LIMIT, f"RSS peak {rss.peak / MiB:.0f} MiB")
    check.check(all(closed for _, closed in results), "a connection was not closed")
    check.check(accepted < 16 * MiB, f"{accepted / MiB:.0f} MiB of header accepted")
    check.check(livez.worst < 1.0 and not livez.failed, f"/livez took {livez.worst:.2f} s")
    ready = httpx.get(f"{sidecar.admin}/readyz")
    check.check(ready.status_code == 200, f"/readyz {ready.status_code} after the attack")
    check.done()


def test_header_size_and_count(sidecar, attack):
    """Item 1: a 1 MB header value, 10,000 headers, 150 small headers."""
    check = attack("1 MB header value; 10,000 headers; 150 headers", "1")
    big = exchange(sidecar.port, get("/v1/models", "X-Big: " + "a" * MiB))
    many = exchange(sidecar.port, get("/v1/models", *(f"X-H{i}: v" for i in range(10_000))))
    count = exchange(sidecar.port, get("/v1/models", *(f"X-H{i}: v" for i in range(150))))
    check.figures.update(big=big.status, many=many.status, count=count.status)
    for name, reply in (("1 MB value", big), ("10,000 headers", many), ("150", count)):
        check.check(reply.status == 431 and _openai_error(reply), f"{name}: {reply.status}")
    ok = exchange(sidecar.port, get("/v1/models", *(f"X-H{i}: v" for i in range(50))))
    check.check(ok.status == 200, f"50 headers refused: {ok.status}")
    check.done()


TRAVERSALS = [
    "/v1/../metrics", "/v1/%2e%2e/sleep", "/v1/../scale_elastic_ep", "/v1/%2E%2E/metrics",
    "/v1/..%2fmetrics", "/v1/%2e%2e%2fsleep", "/v1//../metrics", "/v1/./../collective_rpc",
    "/v1/chat/completions/../../sleep", "/v1/%252e%252e/sleep", "/v1/load_lora_adapter",
    "/v1/../v1/../reset_prefix_cache", "//metrics", "/metrics", "/status", "/readyz",
    "/v1/models/../../pause", "/v1/chat/completions%00", "/sleep?level=1", "/v1%2f..%2fmetrics",
]  # fmt: skip


def test_path_traversal_reaches_no_admin_route(sidecar, fake, attack):
    """Item 3: only vLLM's OpenAI routes, checked after normalization; the rest 404 JSON."""
    check = attack(f"{len(TRAVERSALS)} traversal/admin paths on the pass-through port", "3")
    before = len(fake.seen)
    statuses = {}
    for target in TRAVERSALS:
        for method in ("GET", "POST"):
            data = get(target) if method == "GET" else post(target, b"{}")
            reply = exchange(sidecar.port, data)
            statuses[f"{method} {target}"] = reply.status
            check.check(reply.status == 404 and _openai_error(reply), f"{method} {target}")
            check.check(b"ADMIN-ROUTE-REACHED" not in reply.body, f"{method} {target} leaked")
    reached = [seen.target for seen in fake.seen[before:] if seen.target not in ("/health",
               "/v1/models", "/version")]  # fmt: skip
    check.check(not reached, f"vLLM saw {reached}")
    check.figures["statuses"] = statuses
    models = httpx.get(f"{sidecar.url}/v1/models")
    check.check(models.status_code == 200 and models.json()["data"][0]["id"] == MODEL, "models")
    query = "/v1/models?x=%2F&y=a+b&z=%25"  # the query string goes on as the client wrote it
    check.check(exchange(sidecar.port, get(query)).status == 200, "query refused")
    seen = fake.last("/v1/models?").target
    check.check(seen == query, f"vLLM saw {seen}")
    check.done()


def test_dot_segments_are_counted_on_the_normalized_path(sidecar, fake, attack):
    """Item 3: /v1/./chat/completions and friends are served and counted."""
    check = attack("runaways via /v1/./, //v1//, /v1/chat/../chat/ are counted", "3")
    before = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL)
    targets = ["/v1/./chat/completions", "//v1//chat/completions", "/v1/chat/../chat/completions"]
    for target in targets:
        reply = exchange(sidecar.port, post(target, json.dumps(ask("[runaway]")).encode()))
        check.check(reply.status == 200, f"{target}: {reply.status}")
    counted = sidecar.metric("mla_serve_runaway_completions_total", model=MODEL) - before
    check.figures["counted"] = counted
    check.check(counted == 3, f"{counted} of 3 runaways counted")
    generated = [path for path in fake.paths() if "completions" in path][-3:]
    check.check(generated == ["/v1/chat/completions"] * 3, f"vLLM saw {generated}")
    check.done()


BAD_BODIES = {
    "nested 200k deep": b'{"model": "m", "messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "stream_options list": json.dumps(ask("x", stream=True, stream_options=[1])).encode(),
    "stream_options string": json.dumps(ask("x", stream=True, stream_options="yes")).encode(),
    "include_usage string": json.dumps(
        ask("x", stream=True, stream_options={"include_usage": "yes"})
    ).encode(),
    "stream string": json.dumps(ask("x", stream="yes")).encode(),
    "model number": json.dumps({"model": 5, "messages": []}).encode(),
    "array body": b"[1, 2]",
    "not UTF-8": b'{"model": "\xff\xfe"}',
    "empty": b"",
    "cut JSON": b'{"model": "m", "messages": [',
    "NaN garbage": b"{nope}",
}


def test_bad_requests_are_400_json(sidecar, attack):
    """Item 9: what vLLM would refuse is a 400 OpenAI error here, never a 500."""
    check = attack(f"{len(BAD_BODIES)} malformed chat bodies (deep nesting, wrong types...)", "9")
    statuses = {}
    for name, body in BAD_BODIES.items():
        for path in ("/v1/chat/completions", "/v1/completions"):
            reply = exchange(sidecar.port, post(path, body))
            statuses[f"{path} {name}"] = reply.status
            check.check(reply.status == 400 and _openai_error(reply), f"{path} {name}")
    check.figures["statuses"] = statuses
    check.check(httpx.get(f"{sidecar.admin}/livez").status_code == 200, "livez")
    check.done()


def test_expect_100_continue(sidecar, attack):
    """Item 7: the client waits for 100 Continue before its body; it must come."""
    check = attack("Expect: 100-continue", "7")
    body = json.dumps(ask("hello")).encode()
    head = post("/v1/chat/completions", b"", "Expect: 100-continue")
    head = head.replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode())
    with socket.create_connection(("127.0.0.1", sidecar.port), timeout=5) as sock:
        sock.sendall(head)
        interim = sock.recv(4096)
        check.check(interim.startswith(b"HTTP/1.1 100"), f"no 100 Continue: {interim[:40]!r}")
        sock.sendall(body)
        data = b""
        while b'"finish_reason":"stop"' not in data and b'"finish_reason": "stop"' not in data:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    check.check(b" 200 " in data.split(b"\r\n")[0], f"answer: {data[:60]!r}")
    check.done()


def test_http10_clients_get_unchunked_responses(sidecar, attack):
    """Item 13: HTTP/1.0 has no chunked encoding: a body comes with its length, or (a
    stream, which has none) as it comes, ended by the connection's end."""
    check = attack("HTTP/1.0 client: streamed and whole answers", "13")
    for stream in (False, True):
        reply = exchange(
            sidecar.port,
            post("/v1/chat/completions", json.dumps(ask("hi", stream=stream)).encode(),
                 version="1.0"),
        )  # fmt: skip
        chunked = (reply.header("transfer-encoding") or "").lower() == "chunked"
        length = reply.header("content-length")
        check.check(reply.status == 200 and not chunked, f"stream={stream}: chunked")
        if length is not None:
            check.check(int(length) == len(reply.body), f"length {length}")
        else:
            check.check(reply.header("connection") == "close" and reply.closed,
                        f"stream={stream}: no length and the connection kept")  # fmt: skip
        if stream:
            check.check(reply.body.rstrip().endswith(b"data: [DONE]"), "stream not complete")
    check.done()


def test_hop_by_hop_and_forwarded_for(sidecar, fake, attack):
    """Item 13: hop-by-hop headers dropped both ways; X-Forwarded-For not spoofable."""
    check = attack("hop-by-hop headers both ways; spoofed X-Forwarded-For", "13")
    reply = exchange(
        sidecar.port,
        post("/v1/chat/completions", json.dumps(ask("[hopheaders] hi")).encode(),
             "Connection: X-Secret, keep-alive", "X-Secret: 1", "Keep-Alive: 300", "TE: trailers",
             "Trailer: X-T", "Proxy-Authorization: Basic eDp5", "Proxy-Foo: 1",
             "X-Forwarded-For: 6.6.6.6", "X-Forwarded-Proto: https", "X-Request-Id: trace-1"),
    )  # fmt: skip
    sent = fake.last("/v1/chat/completions").headers
    leaked = sorted({"x-secret", "keep-alive", "te", "trailer", "proxy-authorization",
                     "proxy-foo", "connection"} & set(sent))  # fmt: skip
    check.figures.update(upstream_xff=sent.get("x-forwarded-for"), leaked_upstream=leaked)
    check.check(not leaked, f"forwarded to vLLM: {leaked}")
    check.check(sent.get("x-forwarded-for") == "127.0.0.1", f"XFF {sent.get('x-forwarded-for')}")
    check.check(sent.get("x-forwarded-proto") == "http", "X-Forwarded-Proto taken from the client")
    check.check(sent.get("x-request-id") == "trace-1", "an end-to-end header was dropped")
    check.check(reply.status == 200, f"status {reply.status}")
    check.check(reply.header("x-internal") is None, "X-Internal (named in Connection) returned")
    check.check(reply.header("keep-alive") is None, "Keep-Alive returned")
    check.check(reply.header("x-kept") == "yes", "an end-to-end response header was dropped")
    check.done()


def test_slow_headers_and_stalled_bodies_time_out(sidecar, attack):
    """Item 7: a client trickling its head or stalling its body is cut off in bounded time."""
    check = attack("slow headers (slowloris) and a stalled request body", "7")
    head = exchange(sidecar.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", timeout=10)
    body = exchange(sidecar.port, post("/v1/chat/completions", b"x" * 100)[:-90], timeout=10)
    check.figures.update(head_status=head.status, head_s=round(head.seconds, 2),
                         body_status=body.status, body_s=round(body.seconds, 2))  # fmt: skip
    check.check(head.status == 408 and head.seconds < 5, f"head: {head.status} {head.seconds:.1f}")
    check.check(body.status == 408 and body.seconds < 5, f"body: {body.status} {body.seconds:.1f}")
    check.check(_openai_error(body) and _openai_error(head), "not JSON errors")
    # The deadline holds for every head of a keep-alive connection, not only its first: a
    # second head begun 0.7 s after the first response and left unfinished is cut off a
    # whole --header-timeout (1 s) after it began, not earlier and not never.
    with socket.create_connection(("127.0.0.1", sidecar.port), timeout=10) as sock:
        sock.sendall(get("/v1/models"))
        first = b""
        while not complete(first):
            piece = sock.recv(65536)
            if not piece:
                break
            first += piece
        time.sleep(0.7)
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        second = b""
        while b"\r\n\r\n" not in second:
            piece = sock.recv(65536)
            if not piece:
                break
            second += piece
        late = time.monotonic() - started
    check.figures.update(keep_alive_head_s=round(late, 2))
    check.check(first.startswith(b"HTTP/1.1 200"), f"first request: {first[:40]!r}")
    check.check(second.startswith(b"HTTP/1.1 408") and 0.9 <= late < 3,
                f"second head: {second[:40]!r} after {late:.2f} s")  # fmt: skip
    check.done()


def test_request_smuggling_and_oversize(sidecar, attack):
    """Held before; kept so a regression shows: CL+TE, duplicate CL, 100 MB body."""
    check = attack("request smuggling (CL+TE, duplicate CL), NUL byte, a 100 MB body", "1")
    body = json.dumps(ask("hi")).encode()
    smuggle = post("/v1/chat/completions", body, "Transfer-Encoding: chunked")
    double = post("/v1/chat/completions", body, "Content-Length: 5")
    huge = post("/v1/chat/completions", b"", "X-Pad: 1").replace(
        b"Content-Length: 0", f"Content-Length: {100 * MiB}".encode()
    )
    nul = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"
    replies = [exchange(sidecar.port, data) for data in (smuggle, double, huge, nul)]
    statuses = [reply.status for reply in replies]
    check.figures["statuses"] = statuses
    check.check(statuses[:2] == [400, 400], f"smuggling: {statuses[:2]}")
    check.check(statuses[3] == 400, f"NUL in a header: {statuses[3]}")
    check.check(all(_openai_error(r) for r in replies), "a refusal that is not OpenAI JSON")
    check.check(statuses[2] == 413, f"100 MB: {statuses[2]}")
    check.done()


def test_no_traceback_in_the_sidecar_log(sidecar, attack):
    """Everything above: no 500, no traceback."""
    check = attack("no traceback in the sidecar's log after the client attacks", "9")
    text = sidecar.log.read_text(errors="replace")
    check.check("Traceback" not in text, text[text.find("Traceback") :][:800])
    check.check(sidecar.metric("mla_serve_refused_requests_total", code="500") == 0, "a 500")
    held = sidecar.metric("mla_serve_buffered_bytes")
    check.check(held == 0, f"{held} bytes still counted as buffered")
    check.done()
