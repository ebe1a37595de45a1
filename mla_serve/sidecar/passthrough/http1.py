"""The HTTP/1.1 rules every request the sidecar serves is held to, and vLLM's response heads.

One place for them: both server protocols (serve.py: httptools, with or without ASGI, and
h11) call `head_refusal` when a request's head is complete, and the client to vLLM
(upstream.py) measures response heads with `response_head_size`. A head's size is counted
on its parsed fields, as a client writes them (`name: value` CRLF each), so the limit is
the same whatever the reads the bytes came in; while a head is incomplete the protocols
count the raw bytes read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

Fields = Iterable[tuple[bytes, bytes]]

VERSIONS = ("1.0", "1.1")
# RFC 9110 section 7.2: Host = uri-host [ ":" port ], uri-host an IP-literal, an IPv4 address
# or a reg-name (unreserved, percent-encoded and sub-delims characters; it may be empty).
_HOST = re.compile(
    rb"(?:\[[0-9A-Za-z._~:!$&'()*+,;=-]+\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(?::[0-9]*)?"
)


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
    it is. HTTP/1.0 and HTTP/1.1 only (505); no Transfer-Encoding in an HTTP/1.0 request
    (400: faulty framing, RFC 9112 section 6.1); no transfer coding but `chunked` alone (501,
    RFC 9112 section 6.1: a body in `gzip, chunked` cannot pass as plain bytes); one Host
    field with a valid value, and one at all in HTTP/1.1 (400, RFC 9112 section 3.2);
    request line and headers of at most `max_bytes`, at most `max_fields` headers (431)."""
    if version not in VERSIONS:
        return 505, f"HTTP/{version} is not supported: the sidecar serves HTTP/1.0 and HTTP/1.1"
    codings: list[bytes] = []
    hosts: list[bytes] = []
    for name, value in fields:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            codings += (coding.strip().lower() for coding in value.split(b","))
        elif lowered == b"host":
            hosts.append(value)
    if codings and version == "1.0":
        return 400, "Transfer-Encoding in an HTTP/1.0 request: its framing cannot be trusted"
    if codings and [coding for coding in codings if coding] != [b"chunked"]:
        named = b", ".join(codings).decode("latin-1")
        return 501, f"Transfer-Encoding {named!r} is not supported: only chunked"
    if request_head_size(method, target, fields) > max_bytes:
        return 431, f"request line and headers over {max_bytes} bytes"
    if len(fields) > max_fields:
        return 431, f"more than {max_fields} request headers"
    if len(hosts) > 1:
        return 400, "more than one Host header"
    if hosts and _HOST.fullmatch(hosts[0].strip(b" \t")) is None:
        return 400, "the Host header is not a valid host"
    if not hosts and version == "1.1":
        return 400, "an HTTP/1.1 request must have a Host header"
    return None
