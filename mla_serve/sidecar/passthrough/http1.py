"""The HTTP/1.1 rules every request the sidecar serves is held to, and vLLM's response heads.

One place for them: both server protocols (serve.py: httptools, with or without ASGI, and
h11) call `head_refusal` when a request's head is complete, and the client to vLLM
(upstream.py) measures response heads with `response_head_size`. A head's size is counted
on its parsed fields, as a client writes them (`name: value` CRLF each), so the limit is
the same whatever the reads the bytes came in; while a head is incomplete the protocols
count the raw bytes read.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable

Fields = Iterable[tuple[bytes, bytes]]

# RFC 9110 section 7.2: Host = uri-host [ ":" port ], uri-host an IP-literal (an IPv6
# address or an IPvFuture, in brackets), an IPv4 address or a reg-name (unreserved,
# percent-encoded and sub-delims characters; it may be empty: RFC 9112 section 3.2).
_SUB = rb"A-Za-z0-9._~!$&'()*+,;=-"
_HOST = re.compile(rb"(\[[^\]]*\]|(?:[" + _SUB + rb"]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?")
_FUTURE = re.compile(rb"v[0-9A-Fa-f]+\.[:" + _SUB + rb"]+", re.I)


def valid_host(value: bytes) -> bool:
    """Whether a Host field's value is `uri-host [":" port]` (RFC 3986 section 3.2.2)."""
    found = _HOST.fullmatch(value.strip(b" \t"))
    if found is None:
        return False
    literal = found.group(1)
    if not literal.startswith(b"["):
        return True
    inner = literal[1:-1]
    if _FUTURE.fullmatch(inner) is not None:
        return True
    try:
        ipaddress.IPv6Address(inner.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def served_version(version: str) -> bool:
    """HTTP/1.x: 1.0, 1.1, and a higher minor version, read as 1.1 (RFC 9112 section 2.3)."""
    major, dot, minor = version.partition(".")
    return major == "1" and dot == "." and minor.isdigit() and minor.isascii()


def fields_size(fields: Fields) -> int:
    """Header (or trailer) fields in bytes, `name: value` CRLF each, and the empty line."""
    return sum(len(name) + len(value) + 4 for name, value in fields) + 2


def request_head_size(method: bytes, target: bytes, fields: Fields) -> int:
    """The request line (`METHOD target HTTP/1.1` CRLF) and the header fields, in bytes."""
    return len(method) + len(target) + 12 + fields_size(fields)


def response_head_size(reason: int, fields: Fields) -> int:
    """The status line (`HTTP/1.1 200 ` and a reason of `reason` bytes, CRLF) and the header
    fields, in bytes."""
    return 15 + reason + fields_size(fields)


def head_refusal(
    method: bytes,
    target: bytes,
    version: str,
    fields: list[tuple[bytes, bytes]],
    max_bytes: int,
    max_fields: int,
) -> tuple[int, str] | None:
    """Why a request whose head is complete is not served, as (status, message); None when
    it is. HTTP/1.x only (505; a minor version above 1 read as 1.1); no Transfer-Encoding in an
    HTTP/1.0 request, nor beside a Content-Length (400: faulty framing, which RFC 9112 section
    6.1 lets a server refuse; request smuggling lives in the gap); no transfer coding but
    `chunked` alone (501, RFC 9112 section 6.1: a body in `gzip, chunked` cannot pass as plain
    bytes); one Host
    field with a valid value, and one at all in HTTP/1.1 (400, RFC 9112 section 3.2);
    request line and headers of at most `max_bytes`, at most `max_fields` headers (431)."""
    if not served_version(version):
        return 505, f"HTTP/{version} is not supported: the sidecar serves HTTP/1.0 and HTTP/1.1"
    codings: list[bytes] = []
    hosts: list[bytes] = []
    length = False
    for name, value in fields:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            codings += (coding.strip().lower() for coding in value.split(b","))
        elif lowered == b"host":
            hosts.append(value)
        elif lowered == b"content-length":
            length = True
    if codings and version == "1.0":
        return 400, "Transfer-Encoding in an HTTP/1.0 request: its framing cannot be trusted"
    if codings and length:
        return 400, "both Content-Length and Transfer-Encoding: the body's framing is ambiguous"
    if codings and [coding for coding in codings if coding] != [b"chunked"]:
        named = b", ".join(codings).decode("latin-1")
        return 501, f"Transfer-Encoding {named!r} is not supported: only chunked"
    if request_head_size(method, target, fields) > max_bytes:
        return 431, f"request line and headers over {max_bytes} bytes"
    if len(fields) > max_fields:
        return 431, f"more than {max_fields} request headers"
    if len(hosts) > 1:
        return 400, "more than one Host header"
    if hosts and not valid_host(hosts[0]):
        return 400, "the Host header is not a valid host"
    if not hosts and version != "1.0":  # 1.1, and a higher minor version read as 1.1
        return 400, "an HTTP/1.1 request must have a Host header"
    return None
