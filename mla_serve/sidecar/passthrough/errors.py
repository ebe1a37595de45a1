"""The pass-through's own answers, in one place: what each failure is called and returns.

Every answer the sidecar gives instead of vLLM is an OpenAI-style error document, as vLLM's
own are (`error_body`): a request refused before vLLM (`Refused`: its status, message and
type), vLLM unreachable (503), silent until the response deadline (504), or broken before
its head (502) (`upstream_failure`, whose messages name no address of vLLM's), or the
sidecar shutting down (503). After vLLM's head has gone out, a stream that breaks off
ends with an error event (`error_event`); any other body is cut off (the client sees the
connection end, never a clean but short body). Answers to a request not read whole close the
connection (`CLOSING`), and a 503 says when to retry.
"""

from __future__ import annotations

import json

# The sidecar's own answers after which the connection ends: the request was not read whole.
CLOSING = frozenset({408, 413, 431})


class Refused(Exception):
    """A request answered here, before vLLM: status, message, error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def body(self) -> bytes:
        return error_body(self.status, str(self), self.kind)


def why(error: BaseException) -> str:
    """An exception in one line, for a log or an error message: its type and its text."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error document, as vLLM itself returns them."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()


def upstream_failure(kind: str, detail: str) -> Refused:
    """vLLM failed before its response's head: `unreachable` (503: connecting failed, `detail`
    says how), `timeout` (504: no head within `detail` seconds), `broken` (502: the connection
    failed after the request went out, `detail` says how). The message names no address of
    vLLM's: the client has no business with the pod's insides (the sidecar's log has it)."""
    if kind == "unreachable":
        return Refused(503, f"vLLM is not reachable: {detail}", "upstream_unavailable")
    if kind == "timeout":
        return Refused(504, f"vLLM sent no response within {detail} s", "upstream_timeout")
    return Refused(502, f"vLLM failed before responding: {detail}", "upstream_error")


def busy() -> Refused:
    """All request bodies being read at once fill the in-flight budget."""
    return Refused(503, "the sidecar is at its in-flight request body limit; retry", "server_busy")


def error_event(message: str) -> bytes:
    """The SSE event that ends a stream vLLM broke off after its head."""
    return b"data: " + error_body(502, message, "upstream_error") + b"\n\n"


def answer_headers(status: int, length: int, close: bool) -> list[tuple[bytes, bytes]]:
    """The headers of an answer of the sidecar's own (an OpenAI-style JSON error)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % length)]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    if close:
        headers.append((b"connection", b"close"))
    return headers
