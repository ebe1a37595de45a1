"""The pass-through's header rules: what vLLM gets of a request, what the client gets back.

A proxy passes on neither the hop-by-hop headers (RFC 9110 section 7.6.1) nor those a
Connection header names; it frames the request it writes itself (its Host, its
Content-Length); X-Forwarded-For and -Proto are set here, as this sidecar vouches for them
(`--trusted-proxies`: whose own X-Forwarded-For is appended to rather than replaced).
vLLM's Date is not returned: the sidecar's server dates every response it sends (from the
same clock as vLLM's in the pod), and HTTP allows one Date field (RFC 9110 section 6.6.1);
nginx drops the upstream's Date the same way.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

Headers = list[tuple[bytes, bytes]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
    }
)  # fmt: skip
# X-Forwarded-For and -Proto are what uvicorn (so vLLM) believes about the client: set here.
NOT_FORWARDED = HOP_BY_HOP | {
    b"host", b"content-length", b"expect", b"x-forwarded-for", b"x-forwarded-proto"
}  # fmt: skip
NOT_RETURNED = HOP_BY_HOP | {b"content-length", b"date"}
# Methods whose requests carry no body unless they send one: no Content-Length then.
BODILESS = (b"GET", b"HEAD", b"DELETE", b"OPTIONS")


def tokens(value: bytes) -> set[bytes]:
    """The field names a Connection header's value lists."""
    return {token.strip().lower() for token in value.split(b",") if token.strip()}


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(tokens(value))
    return frozenset(named)


def forwarded(headers: Headers, peer: str, scheme: bytes, trusted: tuple[Network, ...]) -> Headers:
    """The request headers vLLM gets: the client's less hop-by-hop ones (and those its
    Connection header names), and X-Forwarded-For/-Proto as this sidecar vouches for them.
    The names come lowercased: both fronts take them from uvicorn's protocols, which lower
    them (as ASGI requires)."""
    out: Headers = []
    forwarded_for: list[bytes] = []
    proto: bytes | None = None
    named: set[bytes] = set()
    for name, value in headers:
        if name not in NOT_FORWARDED and not name.startswith(b"proxy-"):
            out.append((name, value))
        elif name == b"x-forwarded-for":
            forwarded_for.append(value)
        elif name == b"x-forwarded-proto":
            proto = value
        elif name == b"connection":
            named.update(tokens(value))
    if named:
        out = [pair for pair in out if pair[0] not in named]
    vouched = bool(peer) and trusts(trusted, peer)
    if peer:
        if forwarded_for and vouched:
            forwarded_for.append(peer.encode("latin-1"))
        else:
            forwarded_for = [peer.encode("latin-1")]
        out.append((b"x-forwarded-for", b", ".join(forwarded_for)))
    out.append((b"x-forwarded-proto", proto if proto and vouched else scheme))
    return out


def trusts(trusted: tuple[Network, ...], peer: str) -> bool:
    if not trusted:  # the default: no address to parse
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in network for network in trusted)


def request_bytes(
    method: bytes, target: bytes, authority: bytes, headers: Headers, body: bytes
) -> bytes:
    """The request as written to vLLM: its line, Host, `headers` (already `forwarded`),
    Content-Length when there is a body or the method expects one, the body."""
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", authority, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body or method not in BODILESS:
        parts.append(b"content-length: %d\r\n" % len(body))
    parts += (b"\r\n", body)
    return b"".join(parts)


def returned(headers: Any, keep_length: bool) -> Headers:
    """vLLM's response headers as the client gets them: names lowercased, less hop-by-hop
    ones, those its Connection header names, and vLLM's Date; Content-Length only when
    `keep_length` (a body relayed byte for byte)."""
    named = connection_tokens(headers)
    kept = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in named or (
            lowered in NOT_RETURNED and not (keep_length and lowered == b"content-length")
        ):
            continue
        kept.append((lowered, value))
    return kept


def media_type(headers: Headers) -> bytes:
    """The Content-Type's media type, lowercased."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.partition(b";")[0].strip().lower()
    return b"application/octet-stream"
