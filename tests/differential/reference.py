"""The reference model: h11 (a well-kept, pure-Python HTTP/1.1 implementation) reads the same
bytes the sidecar reads, on both of its sides, and says what a correct HTTP/1.1 intermediary
does with them.

- The client's side (`read_requests`): h11 as a server reads what the client sent: each
  request it accepts (method, target, version, headers, the body as it decodes it, whether
  the connection may carry another), then, if it refuses what follows, why.
- vLLM's side (`read_response`): h11 as a client that sent the request reads what vLLM
  answered: the final response (interim 1xx left out), the body as it decodes it, whether it
  is complete, what h11 refused and where, and any bytes after a complete response.
- What the client gets (`Replies`): h11 as a client reads the sidecar's own bytes, which must
  be valid HTTP/1.1 to it, response by response.

Where the sidecar's rule differs from h11's on purpose, `request_outcomes` and
`response_outcomes` say so, each with its RFC reason (the list is in README.md); nothing
else may differ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import h11

Headers = list[tuple[bytes, bytes]]

# What a client can see of one request's fate.
ACCEPTED = "accepted"  # passed to vLLM, its response relayed, the connection kept as h11 says
ACCEPTED_CLOSED = "accepted, then closed"  # passed to vLLM, the connection closed after it
REFUSED = "refused"  # answered by the sidecar (4xx/5xx), never sent to vLLM, closed
# What a client can see of vLLM's response.
RELAYED = "relayed"  # status and body as vLLM sent them
BAD_GATEWAY = "502"  # vLLM's bytes were no response: the sidecar's 502
ERROR_EVENT = "ended with an error event"  # a classified stream broken off after its head
CUT = "cut"  # any other body broken off after its head: the client's connection ends


@dataclass
class Message:
    """One request as h11 (server side) read it."""

    method: bytes
    target: bytes
    version: bytes
    headers: Headers
    body: bytes
    trailers: Headers
    keep_alive: bool  # h11 would read another request on the connection after this one


@dataclass
class Requests:
    messages: list[Message] = field(default_factory=list)
    refused: str | None = None  # h11's error on what followed the accepted ones
    status_hint: int | None = None
    incomplete: bool = False  # bytes of a request h11 still waits on
    starts: list[int] = field(default_factory=lambda: [0])  # where each request begins


def read_requests(data: bytes) -> Requests:
    """Every request of `data` as h11 reads it, answering each with an empty 200 (a 200
    denies an Upgrade, as the sidecar does) before the next."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    out = Requests()
    current: dict[str, Any] | None = None
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as error:
            out.refused, out.status_hint = str(error), error.error_status_hint
            return out
        if isinstance(event, h11.Request):
            current = {"request": event, "body": []}
        elif isinstance(event, h11.Data):
            assert current is not None
            current["body"].append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            assert current is not None
            request = current["request"]
            conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            keep = conn.our_state is h11.DONE and conn.their_state is h11.DONE
            out.messages.append(Message(
                bytes(request.method), bytes(request.target), bytes(request.http_version),
                [(bytes(n), bytes(v)) for n, v in request.headers.raw_items()],
                b"".join(current["body"]), [(bytes(n), bytes(v)) for n, v in event.headers],
                keep,
            ))  # fmt: skip
            current = None
            if not keep:
                return out
            conn.start_next_cycle()
            out.starts.append(len(data) - len(conn.trailing_data[0]))
        else:  # NEED_DATA (or PAUSED): nothing more to read
            out.incomplete = current is not None or bool(conn.trailing_data[0])
            return out


@dataclass
class Response:
    """vLLM's response as h11 (client side) read it."""

    status: int | None = None  # the final response's, None when there was none
    headers: Headers = field(default_factory=list)
    interim: list[int] = field(default_factory=list)
    body: bytes = b""  # decoded, as far as it went
    complete: bool = False
    error: str | None = None
    extra: bytes = b""  # bytes after a complete response


def read_response(method: bytes, data: bytes, closed: bool) -> Response:
    """vLLM's `data` (then its end, when `closed`) to a request of `method`."""
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", "vllm")] + (
        [] if method in (b"GET", b"HEAD") else [("content-length", "0")]
    )
    conn.send(h11.Request(method=method, target="/", headers=headers))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if closed:
        conn.receive_data(b"")
    out = Response()
    body: list[bytes] = []
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as error:
            out.error = str(error)
            break
        if isinstance(event, h11.InformationalResponse):
            out.interim.append(event.status_code)
        elif isinstance(event, h11.Response):
            out.status = event.status_code
            out.headers = [(bytes(n), bytes(v)) for n, v in event.headers.raw_items()]
        elif isinstance(event, h11.Data):
            body.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            out.complete = True
            out.extra = bytes(conn.trailing_data[0])
            break
        else:  # NEED_DATA, PAUSED, ConnectionClosed
            break
    out.body = b"".join(body)
    return out


@dataclass
class Reply:
    """One response of the sidecar's, as h11 (client side) read it."""

    status: int
    headers: Headers
    body: bytes = b""
    complete: bool = False

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n.lower() == name), None)


class Replies:
    """The sidecar's bytes on one connection read by h11 as the client of `methods` (one
    request each, in order): every response, complete or as far as it went, and whether h11
    found them invalid (`error`). h11 speaks HTTP/1.1 as a client: an HTTP/1.0 request's
    response is checked for chunked coding apart (`Harness`)."""

    def __init__(self, methods: list[bytes]) -> None:
        self.methods = methods
        self.conn = h11.Connection(h11.CLIENT)
        self.replies: list[Reply] = []
        self.interim: list[int] = []
        self.error: str | None = None  # the sidecar's bytes are not HTTP/1.1
        self.closed = False  # the sidecar ended the connection
        self.early: str | None = None  # ... before the responses were complete
        self._send()

    def _send(self) -> None:
        method = self.methods[len(self.replies)]
        headers = [("host", "sidecar")]
        if method not in (b"GET", b"HEAD"):
            headers.append(("content-length", "0"))
        self.conn.send(h11.Request(method=method, target="/", headers=headers))
        self.conn.send(h11.EndOfMessage())

    @property
    def done(self) -> bool:
        """Every response is complete, h11 refused one, or the connection ended."""
        whole = len(self.replies) == len(self.methods) and self.replies[-1].complete
        return whole or self.error is not None or self.closed

    def feed(self, data: bytes) -> None:
        """The sidecar's next bytes (b"": the end of the connection)."""
        if self.error is not None or self.closed:
            return
        self.conn.receive_data(data)
        if not data:
            self.closed = True
        self._pump()

    def _pump(self) -> None:
        while self.error is None and self.early is None:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as error:
                if self.closed:
                    self.early = str(error)
                else:
                    self.error = str(error)
                return
            if isinstance(event, h11.InformationalResponse):
                self.interim.append(event.status_code)
            elif isinstance(event, h11.Response):
                headers = [(bytes(n), bytes(v)) for n, v in event.headers.raw_items()]
                self.replies.append(Reply(event.status_code, headers))
            elif isinstance(event, h11.Data):
                self.replies[-1].body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self.replies[-1].complete = True
                if len(self.replies) == len(self.methods):
                    return
                if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                    return  # the server closes after this one: nothing more is read
                self.conn.start_next_cycle()
                self._send()
            else:
                return


# -- the sidecar's rules where they differ from h11's, on purpose -----------------------------
def request_outcomes(features: frozenset[str], accepted: bool, keep_alive: bool) -> set[str]:
    """The outcomes allowed for one generated request with `features` (cases.py), from h11's
    verdict (`accepted`, `keep_alive`) and the sidecar's principled exceptions to it."""
    if "major-version" in features:
        return {REFUSED}  # RFC 9110 section 15.6.6: 505 for a major version it does not serve
    if "http10-transfer-encoding" in features:
        return {REFUSED}  # RFC 9112 section 6.1: faulty framing, respond 400 and close
    if "invalid-host" in features:
        return {REFUSED}  # RFC 9112 section 3.2: an invalid Host field value is 400
    if "length-and-chunked" in features:
        # RFC 9112 section 6.1: MAY reject; processed by Transfer-Encoding it MUST close after
        return {REFUSED, ACCEPTED_CLOSED}
    if not accepted:
        return {REFUSED}
    return {ACCEPTED if keep_alive else ACCEPTED_CLOSED}


def response_outcomes(features: frozenset[str], response: Response, stream: bool) -> set[str]:
    """The outcomes allowed for vLLM's `response` (h11's reading of it) with `features`, to a
    request whose response the sidecar classifies as a stream (`stream`)."""
    if "length-and-chunked" in features:
        # RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length; such a message
        # "ought to be handled as an error": a 502, or relayed by its chunked framing
        return {BAD_GATEWAY, RELAYED}
    if response.status is None:
        return {BAD_GATEWAY}
    if response.complete:
        return {RELAYED}
    return {ERROR_EVENT if stream else CUT}


# -- what the counters must say -----------------------------------------------------------------
def choices_of_events(body: bytes) -> tuple[dict[int, str | None], str | None]:
    """The choices of an SSE stream's complete events: index -> last finish reason; and the
    stream's model."""
    choices: dict[int, str | None] = {}
    model = None
    for event in body.split(b"\n\n")[:-1]:  # the last piece is no complete event
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event[6:])
        model = model or chunk.get("model")
        for choice in chunk.get("choices") or []:
            reason = choice.get("finish_reason")
            if reason is not None or choice["index"] not in choices:
                choices[choice["index"]] = reason
    return choices, model
