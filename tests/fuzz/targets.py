"""Fuzz targets (atheris, libFuzzer underneath): each takes one input of bytes and raises
(a crash, to libFuzzer) when the code under test does what its reference says it must not.

- `frames`: the C lane's `frames(read)`, the test on which a connection to vLLM hands a read
  to the lane: where it answers chunk sizes, httptools (the Python path's parser), between
  two chunks before the read, must give exactly those body pieces and be between two chunks
  again after it; and h11 must read the same payloads.
- `lane`: an armed lane against the Python path, read for read (tests/test_lane.py's
  `same`: the client's bytes, the completion, the runaway guard, every metric, the end):
  the input is vLLM's reads after a stream's first token chunk, split at 0xFF bytes.
- `head_refusal`: http1.head_refusal on a request head drawn from the input: it never
  raises, and its answer is an independent reading's (the version, h11's rule for transfer
  codings, the head's bytes as written counted against the limit, the field count).
- `protocol`: the sidecar's server protocols (serve.py: httptools and h11 with the limits)
  in process, fed the input's bytes in up to three reads: nothing raises out of them, what
  they write is valid HTTP/1.1 to h11, and every request they pass on is one h11 reads at
  the same place, with the same method, target and body bytes (no request is smuggled).
  The first byte picks the protocol and the reads.

`python -m tests.fuzz.run TARGET …` runs one (tests/fuzz/run.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Callable
from typing import Any

import h11
import httptools

from mla_serve.sidecar.passthrough import _lane, http1

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Diverged(AssertionError):
    """The code under test and its reference disagree: a finding."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Diverged(what)


# -- frames ---------------------------------------------------------------------------------
class _Pieces:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.complete = 0
        self.chunk_ends = 0

    def on_body(self, body: bytes) -> None:
        self.sizes.append(len(body))

    def on_chunk_complete(self) -> None:
        self.chunk_ends += 1

    def on_message_complete(self) -> None:
        self.complete += 1


def frames(data: bytes) -> None:
    sizes = _lane.frames(data)
    if sizes is None:
        return  # the Python path's read
    expect(all(size > 0 for size in sizes) and bool(sizes), f"sizes {sizes}")
    pieces = _Pieces()
    parser = httptools.HttpResponseParser(pieces)
    parser.feed_data(HEAD)  # between two chunks: before the first
    try:
        parser.feed_data(data)
    except httptools.HttpParserError as error:
        raise Diverged(f"frames {sizes}, httptools refuses the read: {error}") from None
    expect(pieces.sizes == sizes, f"frames {sizes}, httptools gave {pieces.sizes}")
    expect(pieces.complete == 0 and pieces.chunk_ends == len(sizes),
           f"{pieces.chunk_ends} chunks ended of {len(sizes)}, {pieces.complete} ends")  # fmt: skip
    parser.feed_data(b"0\r\n\r\n")  # between two chunks after it: this ends the body
    expect(pieces.complete == 1 and pieces.sizes == sizes, "not between two chunks after it")
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "vllm")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(HEAD + data + b"0\r\n\r\n")
    payload = []
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            payload.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage | h11.NEED_DATA):  # type: ignore[operator]
            break
    expect(isinstance(event, h11.EndOfMessage), "h11 does not read it as whole chunks")
    at, mine = 0, []
    body = b"".join(payload)
    for size in sizes:
        mine.append(body[at : at + size])
        at += size
    expect(at == len(body), f"h11 read {len(body)} payload bytes, frames {sum(sizes)}")


# -- the lane against the Python path -------------------------------------------------------
_same: Callable[..., int] | None = None
_first: list[bytes] = []


def lane(data: bytes) -> None:
    global _same
    if _same is None:
        from tests import test_lane  # imported under atheris' instrumentation (run.py)

        _same = test_lane.same
        events = test_lane.vllm_stream(test_lane.thinking(2))
        _first.append(test_lane.HEAD + b"".join(test_lane.frame(e) for e in events[:2]))
    reads = [_first[0], *(read for read in data.split(b"\xff") if read)]
    _same(reads, "stop" if data[:1] == b"S" else "observe")


# -- head_refusal -------------------------------------------------------------------------
# RFC 3986's host (an IP literal, an IPv4 address or a reg-name, which may be empty: `:` and
# `:80` are an empty host with an empty or a given port) and an optional port
_UNRESERVED = rb"A-Za-z0-9\-._~!$&'()*+,;="
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|\[v[0-9A-Fa-f]+\.[" + _UNRESERVED + rb":]+\]|"
                   rb"(?:[" + _UNRESERVED + rb"]|%[0-9A-Fa-f]{2})*)(:[0-9]*)?")  # fmt: skip


def _valid_host(value: bytes) -> bool:
    match = _HOST.fullmatch(value.strip(b" \t"))
    if match is None:
        return False
    literal = match.group(1)
    if literal.startswith(b"[") and not literal.startswith(b"[v"):
        try:
            ipaddress.IPv6Address(literal[1:-1].decode())
        except ValueError:
            return False
    return True


def head_rules(
    method: bytes,
    target: bytes,
    version: str,
    fields: list[tuple[bytes, bytes]],
    max_bytes: int,
    max_fields: int,
) -> dict[int, str]:
    """Every refusal that applies to a head, read independently of http1.py: status -> why."""
    major, dot, minor = version.partition(".")
    if major != "1" or dot != "." or not (minor.isascii() and minor.isdigit()):
        return {505: f"HTTP/{version}"}  # RFC 9110 section 15.6.6
    # a higher minor version is read as 1.1 (RFC 9112 section 2.3)
    out: dict[int, str] = {}
    te = [value for name, value in fields if name.lower() == b"transfer-encoding"]
    # RFC 9112 section 6.3: codings (empty list elements ignored, RFC 9110 section 5.6.1) that
    # do not end in chunked leave the body's length unknown; the sidecar takes chunked alone
    codings = [token.strip().lower() for value in te for token in value.split(b",")]
    codings = [coding for coding in codings if coding]
    if te and codings != [b"chunked"]:
        out[501] = f"codings {codings}"
    written = len(method) + 1 + len(target) + len(b" HTTP/1.1\r\n")
    written += sum(len(name) + 2 + len(value) + 2 for name, value in fields) + 2
    if written > max_bytes or len(fields) > max_fields:
        out[431] = f"{written} bytes, {len(fields)} fields"
    hosts = [value for name, value in fields if name.lower() == b"host"]
    lengths = [value for name, value in fields if name.lower() == b"content-length"]
    if te and version == "1.0":
        out[400] = "Transfer-Encoding in HTTP/1.0 (RFC 9112 section 6.1)"
    elif te and lengths:
        out[400] = "Content-Length and Transfer-Encoding (RFC 9112 section 6.1: MAY reject)"
    elif len(hosts) > 1 or (not hosts and version != "1.0"):
        out[400] = f"{len(hosts)} Host fields (RFC 9112 section 3.2)"
    elif hosts and not _valid_host(hosts[0]) and hosts[0].strip(b" \t"):
        out[400] = f"Host {hosts[0]!r} (RFC 9112 section 3.2)"
    return out


def head_refusal(data: bytes) -> None:
    import atheris

    given = atheris.FuzzedDataProvider(data)
    method = given.PickValueInList([b"GET", b"POST", b"HEAD", b"PUT", b"OPTIONS", b"M-SEARCH"])
    target = b"/" + given.ConsumeBytes(given.ConsumeIntInRange(0, 40)).replace(b" ", b"%20")
    version = given.PickValueInList(["1.0", "1.1", "1.2", "2.0", "0.9", "1", "11", "1.10"])
    fields: list[tuple[bytes, bytes]] = []
    for _ in range(given.ConsumeIntInRange(0, 12)):
        name = given.PickValueInList([b"transfer-encoding", b"Transfer-Encoding", b"host",
                                      b"Host", b"content-length", b"x-a", b"te"])  # fmt: skip
        fields.append((name, given.ConsumeBytes(given.ConsumeIntInRange(0, 30))))
    max_bytes = given.ConsumeIntInRange(20, 2000)
    max_fields = given.ConsumeIntInRange(0, 12)
    check_head(method, target, version, fields, max_bytes, max_fields)


def check_head(
    method: bytes,
    target: bytes,
    version: str,
    fields: list[tuple[bytes, bytes]],
    max_bytes: int,
    max_fields: int,
) -> None:
    """head_refusal's answer: None when no rule applies, else one of the rules that do (in
    whichever order it checks them)."""
    got = http1.head_refusal(method, target, version, fields, max_bytes, max_fields)
    rules = head_rules(method, target, version, fields, max_bytes, max_fields)
    hosts = [value for name, value in fields if name.lower() == b"host"]
    if len(hosts) == 1 and not hosts[0].strip(b" \t"):
        return  # an empty Host: valid where the target URI has no authority (section 3.2)
    expect(got is None or isinstance(got[1], str), f"{got}")
    expect((got is None) == (not rules), f"the sidecar {got}, the rules {rules}")
    expect(got is None or got[0] in rules, f"the sidecar {got}, the rules {rules}")
    # h11 as a second reading of the codings, where it applies the same rule (it counts an
    # empty list element as a coding: RFC 9110 section 5.6.1 says to ignore them)
    te = [value for name, value in fields if name.lower() == b"transfer-encoding"]
    tokens = [token.strip() for value in te for token in value.split(b",")]
    readable = version in ("1.0", "1.1") and tokens and all(tokens)
    if readable and (verdict := _h11_codings(method, target, fields)) is not None:
        expect((501 in rules) == (verdict == 501), f"h11 says {verdict}, the rules {rules}")


def _h11_codings(method: bytes, target: bytes, fields: list[tuple[bytes, bytes]]) -> int | None:
    """501 when h11 refuses the head's transfer codings, 0 when it takes them, None when h11
    cannot read the head at all (then the parsers refuse it before this check)."""
    if any(re.search(rb"[^\t\x20-\x7e\x80-\xff]", value) for _, value in fields):
        return None  # CR, LF, NUL…: no field value; written, it would be other fields
    head = b"%s %s HTTP/1.1\r\n" % (method, target)
    head += b"".join(b"%s: %s\r\n" % pair for pair in fields)
    if not any(name.lower() == b"host" for name, _ in fields):
        head += b"host: x\r\n"  # h11's Host rule is not this check's
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head + b"\r\n")
    try:
        conn.next_event()
    except h11.RemoteProtocolError as error:
        if "Transfer-Encoding" in str(error):
            return 501
        return None
    return 0


# -- the server protocols in process --------------------------------------------------------
class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(bytes(data))

    def writelines(self, lines: list[bytes]) -> None:
        self.out.extend(bytes(line) for line in lines)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 40000)}.get(
            name, default
        )

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def set_protocol(self, protocol: Any) -> None:
        pass


_protocols: dict[str, tuple[Any, Any, asyncio.AbstractEventLoop]] = {}
_received: list[tuple[bytes, bytes, bytes]] = []


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The application behind the protocol: it reads the body and answers 200."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
    _received.append((scope["method"].encode(), target, body))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b"ok"})


def _protocol_factory() -> Callable[..., Any]:
    """`protocol(kind, settings)`, which makes the sidecar's server protocol classes: in
    uvicorn_adapter.py where there is one, else in serve.py."""
    import importlib

    for name in ("mla_serve.sidecar.uvicorn_adapter", "mla_serve.sidecar.serve"):
        try:
            return importlib.import_module(name).protocol  # type: ignore[no-any-return]
        except (ImportError, AttributeError):
            continue
    raise ImportError("no protocol factory in mla_serve.sidecar")


def _protocol(kind: str) -> tuple[Any, Any, asyncio.AbstractEventLoop]:
    if kind not in _protocols:
        import uvicorn

        from mla_serve.sidecar.settings import Settings

        settings = Settings(vllm_url="http://127.0.0.1:9", header_timeout=30, body_timeout=30)
        http = _protocol_factory()(kind, settings)
        limit = settings.max_header_bytes
        config = uvicorn.Config(_echo, http=http, lifespan="off", log_level="critical",
                                h11_max_incomplete_event_size=limit)  # fmt: skip
        config.load()
        _protocols[kind] = (http, config, asyncio.new_event_loop())
    return _protocols[kind]


def protocol(data: bytes) -> None:
    if not data:
        return
    kind = "h11" if data[0] & 1 else "httptools"
    cuts = sorted({data[0] >> 1 & 7, data[0] >> 4})
    data = data[1:]
    http, config, loop = _protocol(kind)
    from uvicorn.server import ServerState

    _received.clear()
    transport = _Transport()
    server = http(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    asyncio.set_event_loop(loop)
    server.connection_made(transport)
    at = 0
    for cut in [*(len(data) * c // 16 for c in cuts), len(data)]:
        if cut > at and not transport.closing:
            server.data_received(data[at:cut])
            at = cut
        for _ in range(4):  # the application's task runs
            loop.run_until_complete(asyncio.sleep(0))
    server.connection_lost(None)
    for _ in range(2):
        loop.run_until_complete(asyncio.sleep(0))
    for handle in list(getattr(loop, "_scheduled", [])):
        handle.cancel()
    _check_protocol(data, b"".join(transport.out), kind)


def _check_protocol(data: bytes, out: bytes, kind: str = "httptools") -> None:
    from tests.differential import reference

    read = reference.read_requests(data)
    for _ in range(64):  # bounded: a turn that changes nothing reads the same again
        if read.refused is None or len(read.starts) <= len(read.messages):
            break  # nothing refused, or the connection ended with the last request read
        start = read.starts[len(read.messages)]
        # RFC 9112 section 2.2: a server SHOULD ignore empty lines before a request line;
        # httptools (llhttp) skips every CR and LF there, h11 refuses them
        rest = data[start:]
        if kind == "httptools" and rest[:1] in (b"\r", b"\n"):
            data = data[:start] + rest.lstrip(b"\r\n")
            read = reference.read_requests(data)
            continue
        # RFC 9112 section 3: a request line's words MAY be split on any whitespace
        # (httptools does): h11, which takes single spaces only, reads it so
        if "illegal request line" not in (read.refused or ""):
            break
        end = data.find(b"\n", start)
        line = data[start:end].rstrip(b"\r")
        words = line.split()
        if len(words) != 3 or end < 0:
            break
        data = data[:start] + b" ".join(words) + data[start + len(line) :]
        read = reference.read_requests(data)
    for index, (method, target, body) in enumerate(_received):
        expect(index < len(read.messages),
               f"request {index} passed on ({method!r} {target!r}), h11 refused it: "
               f"{read.refused}")  # fmt: skip
        message = read.messages[index]
        # ASGI gives the path and the query apart: an empty query's "?" does not come back;
        # a fragment, which no request-target has (RFC 9112 section 3.2), httptools' URL
        # reading leaves out of both, where h11 (and so uvicorn's h11 protocol) keeps the
        # target as sent
        read_target = message.target
        if kind == "httptools":
            read_target = read_target.partition(b"#")[0]
        read_target = read_target.removesuffix(b"?")
        expect((method, target) == (message.method, read_target),
               f"request {index}: {method!r} {target!r}, h11 read {message.method!r} "
               f"{message.target!r}")  # fmt: skip
        expect(body == message.body,
               f"request {index}: body {body[:40]!r}, h11 read {message.body[:40]!r}")  # fmt: skip
    # a response to each request the application got (a HEAD's has no body), and a refusal
    replies = reference.Replies([method for method, _, _ in _received] + [b"GET"])
    replies.feed(out)
    expect(replies.error is None, f"the protocol wrote what h11 cannot read: {replies.error}: "
                                  f"{out[:200]!r}")  # fmt: skip


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frames": frames,
    "lane": lane,
    "head_refusal": head_refusal,
    "protocol": protocol,
}
