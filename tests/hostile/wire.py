"""Raw HTTP/1.x on a socket, for requests an HTTP client library refuses to send."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODEL = "glm-5.3-flash"


def ask(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


@dataclass
class Reply:
    status: int | None
    head: bytes
    body: bytes
    closed: bool  # the server closed the connection
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower().encode():
                return value.strip().decode("latin-1")
        return None


def exchange(port: int, data: bytes, timeout: float = 10, pause: float = 0) -> Reply:
    """Send `data` (all of it, or until the server stops reading), read until the server
    closes the connection or `timeout`; parse one response."""
    started = time.monotonic()
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            closed = True
        if pause:
            time.sleep(pause)
        return _read_reply(sock, started, timeout, closed)


def exchange_to_end(port: int, data: bytes, timeout: float = 10) -> Reply:
    """`exchange`, then up to 2 s more for the server to close the connection: `closed` says
    whether it did (`exchange` stops reading at the end of the response)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        closed = False
        try:
            sock.sendall(data)
        except OSError:
            closed = True
        reply = _read_reply(sock, started, timeout, closed)
        if not reply.closed:
            reply.closed = closed_by_peer(sock, 2)
        return reply


def trickle(port: int, head: bytes, drip: bytes, interval: float, timeout: float = 10) -> Reply:
    """Send `head`, then `drip` one byte every `interval` s until the server answers (or
    closes the connection) or `timeout`; parse its response. An interim `100 Continue`
    (the answer to `Expect: 100-continue`) is no answer: the drip goes on."""
    started = time.monotonic()
    closed = False
    interim = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for byte in drip:
            if time.monotonic() - started > timeout:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if select.select([sock], [], [], interval)[0]:  # an answer, or the end
                if interim != b"" or b"100-continue" not in head.lower():
                    break
                interim = sock.recv(len(CONTINUE), socket.MSG_PEEK)
                if interim != CONTINUE:
                    break
                sock.recv(len(CONTINUE))
        return _read_reply(sock, started, timeout, closed)


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def read_until(sock: socket.socket, seconds: float, done: Callable[[bytes], bool]) -> bytes:
    """What `sock` gives until `done(all read so far)`, the peer closes, or `seconds`."""
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not done(data):
        sock.settimeout(left)
        try:
            piece = sock.recv(65536)
        except (TimeoutError, OSError):
            break
        if not piece:
            break
        data += piece
    return data


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the other end closes the connection within `timeout` s: what it still sends
    (an error response) is read and dropped until the end (or a reset) comes."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset: closed with our bytes unread
            return True
    return False


def _read_reply(sock: socket.socket, started: float, timeout: float, closed: bool) -> Reply:
    """Read one response until it is complete, the connection ends, or `timeout` s after
    `started` (however slowly the bytes come)."""
    received = b""
    try:
        while (left := timeout - (time.monotonic() - started)) > 0 or not received:
            sock.settimeout(max(0.1, left))
            piece = sock.recv(65536)
            if not piece:
                closed = True
                break
            received += piece
            if complete(received):
                break
    except TimeoutError:
        pass
    except OSError:
        closed = True
    return _parse(received, closed, time.monotonic() - started)


def complete(data: bytes) -> bool:
    """A whole response: its Content-Length of body, or a chunked body's last chunk."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head.startswith(b"HTTP/1.1 100"):
        return complete(body)
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return body.endswith(b"0\r\n\r\n")


def _parse(data: bytes, closed: bool, seconds: float) -> Reply:
    head, _, body = data.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 100"):
        head, _, body = body.partition(b"\r\n\r\n")
    status = None
    if head.startswith(b"HTTP/"):
        status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    return Reply(status, head, body, closed, seconds)


def dechunk(data: bytes) -> bytes:
    """The payload of a chunked body (up to its last chunk, or as far as it goes)."""
    out, at = [], 0
    while at < len(data):
        end = data.find(b"\r\n", at)
        if end < 0:
            break
        size = int(data[at:end].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[end + 2 : end + 2 + size])
        at = end + 2 + size + 2
    return b"".join(out)


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: sidecar", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def get(path: str, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "Host: sidecar", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(path: str, body: bytes, *headers: str, coding: str = "chunked") -> bytes:
    """A POST with `Transfer-Encoding: {coding}` and `body` as one chunk, up to the last
    chunk's size line: trailer fields, then an empty line, end it."""
    lines = [f"POST {path} HTTP/1.1", "Host: sidecar", "Content-Type: application/json",
             f"Transfer-Encoding: {coding}", *headers]  # fmt: skip
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + b"%x\r\n%s\r\n0\r\n" % (len(body), body)
