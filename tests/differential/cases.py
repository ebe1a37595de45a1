"""What the differential harness generates (hypothesis strategies): requests as a client
writes them, and vLLM's responses as raw bytes, each case tagged with the features it has
(`features`), by which the reference's exceptions and the test classes select.

Requests: method and route (a chat completion, /v1/responses with any bytes as its body,
GET or HEAD /v1/models), version, Host lines, framing (Content-Length, chunked with random
chunk sizes, extensions and trailers, both, neither), transfer codings, Upgrade, Expect,
Connection, end-to-end headers, pipelining, and where the bytes are split into writes.
Responses (to a chat completion, streamed or not, /v1/responses, GET or HEAD /v1/models):
status line, interim 1xx, framing (Content-Length, chunked, the connection's end, both),
transfer and content codings, a 101, bytes after a complete response, an early close at
any byte, and where they are split into writes. Bodies are vLLM's own formats
(tests/vllm_standin.py's `Script` and `model_list`); any bytes only on /v1/responses, which
the sidecar relays without reading.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field

from hypothesis import strategies as st

from tests.vllm_standin import Script, model_list

MODEL = "glm-5.3-flash"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MODELS = "/v1/models"
TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
FIELD_VALUE = st.text("abcdefghijklmnopqrstuvwxyz0123456789 ;=,./:-_", max_size=24).map(str.strip)
CONTENT = st.text("abcdefghijklmnopqrstuvwxyz ,.!?é€", max_size=40)


@dataclass
class Request:
    """One request as the client writes it; `wire(raw)` with `x-fake-raw: raw` among its
    headers (the fake's scripted answer to it)."""

    method: str
    target: str
    version: str = "1.1"
    host: list[str] = field(default_factory=lambda: ["Host: sidecar"])
    framing: str = "length"  # length | chunked | length-and-chunked | none
    coding: str = "chunked"  # the Transfer-Encoding value of a chunked body
    body: bytes = b""
    chunks: list[int] = field(default_factory=list)  # chunk sizes of a chunked body
    extension: str = ""  # after each chunk size
    upper_hex: bool = False
    trailers: list[str] = field(default_factory=list)
    headers: list[str] = field(default_factory=list)  # other header lines
    features: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"Request({self.wire('ID')!r})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # hypothesis prints cases so
        printer.text(repr(self))

    @property
    def document(self) -> dict | None:
        return json.loads(self.body) if self.target.partition("?")[0] == CHAT else None

    def wire(self, raw: str) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/{self.version}", *self.host,
                 f"X-Fake-Raw: {raw}", *self.headers]  # fmt: skip
        if self.framing in ("length", "length-and-chunked"):
            lines.append(f"Content-Length: {len(self.body)}")
        if self.framing in ("chunked", "length-and-chunked"):
            lines.append(f"Transfer-Encoding: {self.coding}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
        if self.framing not in ("chunked", "length-and-chunked"):
            return head + self.body
        out, at = [head], 0
        for size in self.chunks:
            number = b"%X" if self.upper_hex else b"%x"
            out.append(number % size + self.extension.encode() + b"\r\n")
            out.append(self.body[at : at + size] + b"\r\n")
            at += size
        out.append(b"0" + self.extension.encode() + b"\r\n")
        out += (f"{line}\r\n".encode() for line in self.trailers)
        out.append(b"\r\n")
        return b"".join(out)


def chunking(draw: st.DrawFn, size: int) -> list[int]:
    """Chunk sizes that add up to `size` (one chunk per 1..size bytes)."""
    sizes, left = [], size
    while left:
        sizes.append(draw(st.integers(1, left)))
        left -= sizes[-1]
    return sizes


@st.composite
def request(
    draw: st.DrawFn,
    route: str | None = None,
    framing: str | None = None,
    stream: bool | None = None,
) -> Request:
    """A request any HTTP/1.1 server takes: a route the sidecar passes, one Host, its body
    framed by Content-Length, chunked (random chunks, extensions, trailers) or nothing."""
    route = route or draw(st.sampled_from([CHAT, CHAT, RESPONSES, MODELS]))
    method = "GET" if route == MODELS else "POST"
    target = route + draw(st.sampled_from(["", "", "?a=1", "?q=%2F&x=a+b"]))
    if route == CHAT:
        stream = draw(st.booleans()) if stream is None else stream
        document: dict = {"model": MODEL, "messages": [{"role": "user", "content": draw(CONTENT)}]}
        if stream:  # with usage asked for: the sidecar sends the body unchanged
            document.update(stream=True, stream_options={"include_usage": True})
        body = json.dumps(document, ensure_ascii=draw(st.booleans())).encode()
    elif route == RESPONSES:
        body = draw(st.binary(max_size=300))
    else:
        body = b""
    framing = framing or ("none" if method == "GET" else draw(st.sampled_from(
        ["length", "length", "chunked", "chunked", "none"] if not body else
        ["length", "chunked"])))  # fmt: skip
    host = draw(st.sampled_from(["sidecar", "127.0.0.1:8080", "localhost", "[::1]:8080",
                                 "api.example.com", "xn--bcher-kva.example"]))  # fmt: skip
    headers = [f"X-Gen-{name}: {value}" for name, value in
               draw(st.lists(st.tuples(TOKEN, FIELD_VALUE), max_size=3))]  # fmt: skip
    headers += draw(st.lists(st.sampled_from([
        "Content-Type: application/json", "Accept: */*", "User-Agent: OpenAI/Python 1.99.0",
        "Authorization: Bearer sk-local", "Accept-Encoding: gzip, deflate",
        "Connection: keep-alive", "Cache-Control: no-cache"]),
        max_size=3, unique=True))  # fmt: skip
    out = Request(method, target, host=[f"Host: {host}"], framing=framing, body=body,
                  headers=headers)  # fmt: skip
    if framing in ("chunked", "length-and-chunked"):
        out.chunks = chunking(draw, len(body)) if body else []
        out.extension = draw(st.sampled_from(["", "", ";a=b", ';name="v x"', ";x"]))
        out.upper_hex = draw(st.booleans())
        out.trailers = [f"X-Trailer-{name}: {value}" for name, value in
                        draw(st.lists(st.tuples(TOKEN, FIELD_VALUE), max_size=2))]  # fmt: skip
    return out


def with_features(one: Request, *features: str) -> Request:
    one.features = one.features | set(features)
    return one


# -- the request classes ---------------------------------------------------------------------
@st.composite
def plain(draw: st.DrawFn) -> list[Request]:
    return [draw(request())]


@st.composite
def closing(draw: st.DrawFn) -> list[Request]:
    """Connection: close, or HTTP/1.0 (with or without keep-alive asked for)."""
    one = draw(request())
    kind = draw(st.sampled_from(["close", "1.0", "1.0 keep-alive"]))
    one.headers = [line for line in one.headers if not line.startswith("Connection")]
    if kind == "close":
        one.headers.append("Connection: close")
    else:
        one.version = "1.0"
        if one.framing == "chunked":
            one.framing = "length"
        if kind == "1.0 keep-alive":
            one.headers.append("Connection: keep-alive")
    return [with_features(one, kind)]


@st.composite
def codings(draw: st.DrawFn) -> list[Request]:
    """Transfer-Encoding spelt in other ways: chunked in capitals, or codings but chunked."""
    one = draw(request(route=draw(st.sampled_from([CHAT, RESPONSES])), framing="chunked"))
    one.coding = draw(st.sampled_from(["Chunked", "CHUNKED", "gzip, chunked", "deflate, chunked",
                                       "identity", "gzip", "chunked, chunked", "br"]))  # fmt: skip
    if one.coding.lower() != "chunked":
        one.body = gzip.compress(one.body) if "gzip" in one.coding else one.body
        one.chunks = chunking(draw, len(one.body)) if one.body else []
    return [with_features(one, "coding")]


@st.composite
def length_and_chunked(draw: st.DrawFn) -> list[Request]:
    one = draw(request(route=draw(st.sampled_from([CHAT, RESPONSES])),
                       framing="length-and-chunked"))  # fmt: skip
    return [with_features(one, "length-and-chunked")]


@st.composite
def major_versions(draw: st.DrawFn) -> list[Request]:
    one = draw(request())
    one.version = draw(st.sampled_from(["2.0", "0.9", "3.0", "2.1"]))
    if one.framing == "chunked":
        one.framing = "length"
    return [with_features(one, "major-version")]


@st.composite
def minor_versions(draw: st.DrawFn) -> list[Request]:
    """HTTP/1.2 to 1.9: a minor version above the one implemented is read as 1.1 (RFC 9112
    section 2.3), as h11 does."""
    one = draw(request())
    one.version = draw(st.sampled_from([f"1.{minor}" for minor in range(2, 10)]))
    return [with_features(one, "minor-version")]


@st.composite
def hosts(draw: st.DrawFn) -> list[Request]:
    """An HTTP/1.1 request without a Host, or with two."""
    one = draw(request())
    one.host = draw(st.sampled_from([[], ["Host: sidecar", "Host: other"],
                                     ["Host: sidecar", "Host: sidecar"]]))  # fmt: skip
    return [with_features(one, "host-count")]


@st.composite
def host_values(draw: st.DrawFn) -> list[Request]:
    """One Host whose value is no uri-host[:port] (RFC 9112 section 3.2, RFC 3986)."""
    one = draw(request())
    value = draw(st.sampled_from(["a b", "a/b", "user@host", "host:port", "ho st:80", "a\tb",
                                  "[::1", "host:80:80", "[::g]:80", "a?b"]))  # fmt: skip
    one.host = [f"Host: {value}"]
    return [with_features(one, "invalid-host")]


@st.composite
def http10_transfer_encoding(draw: st.DrawFn) -> list[Request]:
    framing = draw(st.sampled_from(["chunked", "length-and-chunked"]))
    one = draw(request(route=draw(st.sampled_from([CHAT, RESPONSES])), framing=framing))
    one.version = "1.0"
    return [with_features(one, "http10-transfer-encoding")]


UPGRADE_HEADERS = [
    ["Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c",
     "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA"],
    ["Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
     "Sec-WebSocket-Version: 13"],
    ["Connection: upgrade", "Upgrade: HTTP/2.0"],
    ["Upgrade: h2c"],  # an Upgrade that Connection does not name
]  # fmt: skip


@st.composite
def upgrades(draw: st.DrawFn) -> list[Request]:
    """Upgrade offered: ignored, the request served as any other (RFC 9110 section 7.8), a
    request pipelined behind it answered."""
    one = draw(request())
    one.headers = [line for line in one.headers if not line.startswith("Connection")]
    one.headers += draw(st.sampled_from(UPGRADE_HEADERS))
    after = draw(request(route=MODELS))
    return [with_features(one, "upgrade"), after]


@st.composite
def expects(draw: st.DrawFn) -> list[Request]:
    """Expect: 100-continue, the body sent at once anyway (RFC 9110 section 10.1.1)."""
    one = draw(request(route=draw(st.sampled_from([CHAT, RESPONSES]))))
    one.headers.append(draw(st.sampled_from(["Expect: 100-continue", "Expect: 100-Continue"])))
    return [with_features(one, "expect")]


@st.composite
def pipelined(draw: st.DrawFn) -> list[Request]:
    """Two or three requests written back to back."""
    ones = draw(st.lists(request(), min_size=2, max_size=3))
    for one in ones:
        one.headers = [line for line in one.headers if line != "Connection: close"]
    return [with_features(one, "pipelined") for one in ones]


@st.composite
def heads(draw: st.DrawFn) -> list[Request]:
    """HEAD /v1/models, a GET pipelined after it."""
    one = request(route=MODELS)
    first = draw(one)
    first.method = "HEAD"
    return [with_features(first, "head"), draw(one)]


# -- vLLM's responses ------------------------------------------------------------------------
@dataclass
class Response:
    """vLLM's answer as bytes: `writes` (a pause between them), then the connection closed
    when `close`; `request` is what the client sent."""

    request: Request
    writes: list[bytes]
    close: bool
    features: frozenset[str] = frozenset()

    @property
    def data(self) -> bytes:
        return b"".join(self.writes)

    def __repr__(self) -> str:
        return (f"Response(to {self.request!r}: writes {self.writes!r}, "
                f"{'closed' if self.close else 'kept'})")  # fmt: skip

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))


REASONS = {200: "OK", 201: "Created", 204: "No Content", 400: "Bad Request",
           404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
           500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


def vllm_error(status: int) -> bytes:
    """vLLM's error document (ErrorResponse)."""
    return json.dumps({"error": {"message": "something went wrong", "type": "BadRequestError",
                                 "param": None, "code": status}}).encode()  # fmt: skip


@st.composite
def payload(draw: st.DrawFn, one: Request) -> tuple[int, str, bytes]:
    """(status, content type, body) vLLM would answer `one` with."""
    if one.method == "HEAD":
        return 405, "application/json", b""
    if one.target.startswith(MODELS):
        size = draw(st.integers(1024, 200_000))
        return 200, "application/json", json.dumps(model_list([MODEL], size)).encode()
    if one.target.startswith(RESPONSES):
        kind = draw(st.sampled_from(["application/octet-stream", "text/event-stream",
                                     "application/json"]))  # fmt: skip
        return 200, kind, draw(st.binary(max_size=400))
    document = one.document
    assert document is not None
    outcome = draw(st.sampled_from(["answer", "answer", "runaway", "tools"]))
    script = Script(outcome, document, True, draw(st.integers(0, 6)))
    if not document.get("stream"):
        status = draw(st.sampled_from([200, 200, 200, 400, 429]))
        if status != 200:
            return status, "application/json", vllm_error(status)
        return 200, "application/json", json.dumps(script.whole()).encode()
    events = [b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
              for chunk in script.chunks()]  # fmt: skip
    return 200, "text/event-stream", b"".join(events) + b"data: [DONE]\n\n"


def head_bytes(status: int, reason: str, headers: list[str], version: str = "1.1") -> bytes:
    return (f"HTTP/{version} {status} {reason}\r\n" + "".join(f"{h}\r\n" for h in headers)
            + "\r\n").encode("latin-1")  # fmt: skip


def writes_of(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut into up to five writes at drawn places."""
    if len(data) < 2:
        return [data]
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=4)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@st.composite
def response(
    draw: st.DrawFn,
    one: Request | None = None,
    framing: str | None = None,
    interim: bool = False,
) -> Response:
    """vLLM's well-formed response to a request (drawn when `one` is None), framed by
    Content-Length, chunked (random chunks, extensions, trailers) or the connection's end;
    its end-to-end headers (`x-fake-id`, and what vLLM sends)."""
    if one is None:
        one = draw(request())
    status, kind, body = draw(payload(one))
    framing = framing or draw(st.sampled_from(["length", "chunked", "close"]))
    if one.method == "HEAD":
        framing = "length"
    headers = [f"content-type: {kind}", "x-fake-id: case", "server: uvicorn",
               "date: Tue, 01 Dec 2026 00:00:00 GMT"]  # fmt: skip
    if status in (405,):
        headers.append("allow: GET")
    headers += draw(st.lists(st.sampled_from(["x-request-id: abc", "Keep-Alive: timeout=5",
                                              "Connection: keep-alive", "cache-control: no-cache",
                                              "X-Mixed-Case: Yes"]),
                             max_size=2, unique=True))  # fmt: skip
    close = framing == "close"
    rest = b""
    if framing == "length":
        size = len(body) if one.method != "HEAD" else draw(st.integers(0, 500))
        headers.append(f"content-length: {size}")
        rest = body
    elif framing == "chunked":
        headers.append("transfer-encoding: chunked")
        extension = draw(st.sampled_from(["", "", ";a=b", ";x"])).encode()
        out, at = [], 0
        for size in chunking(draw, len(body)) if body else []:
            out.append(b"%x%s\r\n%s\r\n" % (size, extension, body[at : at + size]))
            at += size
        trailers = draw(st.lists(st.sampled_from(["x-trailer: 1", "x-other: two"]),
                                 max_size=2, unique=True))  # fmt: skip
        rest = b"".join(out) + b"0\r\n" + b"".join(f"{t}\r\n".encode() for t in trailers) + b"\r\n"
    else:
        rest = body
    prefix = b""
    if interim:
        prefix = b"".join(draw(st.lists(st.sampled_from([
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"]),
            min_size=1, max_size=2)))  # fmt: skip
    reason = draw(st.sampled_from([REASONS.get(status, "Status"), "", "Whatever It Says"]))
    version = draw(st.sampled_from(["1.1", "1.1", "1.0"])) if framing != "chunked" else "1.1"
    data = prefix + head_bytes(status, reason, headers, version) + rest
    features = {framing} | ({"interim"} if interim else set())
    return Response(one, writes_of(draw, data), close or version == "1.0", frozenset(features))


@st.composite
def streams(draw: st.DrawFn) -> Response:
    """A streamed chat completion: as vLLM frames it (an event a chunk, whole chunks a
    write: what the C lane takes where it is on), or framed at random."""
    one = draw(request(route=CHAT, stream=True))
    if not draw(st.booleans()):
        return draw(response(one, framing=draw(st.sampled_from(["chunked", "chunked", "close"]))))
    _, kind, body = draw(payload(one))
    events = [event + b"\n\n" for event in body.split(b"\n\n")[:-1]]
    frames = [b"%x\r\n%s\r\n" % (len(event), event) for event in events] + [b"0\r\n\r\n"]
    head = head_bytes(200, "OK", [f"content-type: {kind}", "x-fake-id: case",
                                  "transfer-encoding: chunked"])  # fmt: skip
    writes = [head]
    while frames:
        take = draw(st.integers(1, 3))
        writes.append(b"".join(frames[:take]))
        frames = frames[take:]
    return Response(one, writes, False, frozenset({"chunked", "by-event"}))


@st.composite
def early_close(draw: st.DrawFn) -> Response:
    """A well-formed response cut at any byte, then the connection's end."""
    whole = draw(response(framing=draw(st.sampled_from(["length", "chunked"]))))
    data = whole.data
    at = draw(st.integers(0, len(data) - 1))
    return Response(whole.request, writes_of(draw, data[:at]), True,
                    whole.features | {"early-close"})  # fmt: skip


@st.composite
def transfer_codings(draw: st.DrawFn) -> Response:
    """Transfer-Encoding gzip, or gzip then chunked: no coding the pass-through can relay as
    the body's bytes."""
    one = draw(request(route=CHAT))
    status, kind, body = draw(payload(one))
    coding = draw(st.sampled_from(["gzip", "gzip, chunked", "deflate"]))
    headers = [f"content-type: {kind}", f"transfer-encoding: {coding}"]
    coded = gzip.compress(body)
    if coding.endswith("chunked"):
        coded = b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded)
    data = head_bytes(status, REASONS.get(status, "Status"), headers) + coded
    return Response(one, writes_of(draw, data), True, frozenset({"transfer-coding"}))


@st.composite
def content_codings(draw: st.DrawFn) -> Response:
    """Content-Encoding gzip: a coding of the content, relayed as it is (RFC 9110 8.4)."""
    one = draw(request(route=RESPONSES))
    body = gzip.compress(draw(st.binary(max_size=300)))
    headers = ["content-type: application/json", "content-encoding: gzip", "x-fake-id: case",
               f"content-length: {len(body)}"]  # fmt: skip
    data = head_bytes(200, "OK", headers) + body
    return Response(one, writes_of(draw, data), False, frozenset({"content-coding"}))


@st.composite
def length_and_chunked_response(draw: st.DrawFn) -> Response:
    whole = draw(response(framing="chunked"))
    data = whole.data
    head, _, rest = data.partition(b"\r\n\r\n")
    data = head + b"\r\ncontent-length: %d\r\n\r\n" % len(rest) + rest
    return Response(whole.request, writes_of(draw, data), False,
                    frozenset({"length-and-chunked"}))  # fmt: skip


@st.composite
def extra_data(draw: st.DrawFn) -> Response:
    """A complete response, and after it, in the same write or the next, bytes that belong
    to no request: garbage, or the head and part of a second response."""
    whole = draw(response(framing=draw(st.sampled_from(["length", "chunked"]))))
    whole.close = False
    extra = draw(st.sampled_from([b"HTTP/1.1 200 OK\r\ncontent-length: 400\r\n\r\n0123456789",
                                  b"garbage\r\n", b"\r\n", b"HTTP/1.1 200 OK\r\n",
                                  b"HTTP/1.1 204 No Content\r\n\r\n"]))  # fmt: skip
    writes = [*whole.writes[:-1], whole.writes[-1] + extra]
    if draw(st.booleans()):
        writes = [*whole.writes, extra]
    return Response(whole.request, writes, False, frozenset({"extra-data"}))


@st.composite
def head_answers(draw: st.DrawFn) -> Response:
    """HEAD /v1/models, answered with a head whose Content-Length is of the body a GET
    would get, and no body (RFC 9112 section 6.3, rule 1)."""
    one = draw(request(route=MODELS))
    one.method = "HEAD"
    status = draw(st.sampled_from([405, 200]))
    size = draw(st.integers(0, 10_000))
    headers = ["content-type: application/json", "x-fake-id: case", f"content-length: {size}"]
    if status == 405:
        headers.append("allow: GET")
    data = head_bytes(status, REASONS[status], headers)
    return Response(one, writes_of(draw, data), False, frozenset({"head"}))


@st.composite
def switching(draw: st.DrawFn) -> Response:
    """101 Switching Protocols to a request that offered no upgrade, then bytes of another
    protocol."""
    one = draw(request(route=draw(st.sampled_from([CHAT, MODELS]))))
    data = (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n"
            b"\r\n" + draw(st.binary(max_size=40)))  # fmt: skip
    return Response(one, writes_of(draw, data), draw(st.booleans()), frozenset({"101"}))
