"""One generated case through one running sidecar, held to the reference (reference.py).

A case's bytes go to the sidecar on a real socket, cut into writes where the case says
(TCP_NODELAY and a pause between writes, so the sidecar reads them apart); vLLM's side is
tests/hostile/fake_vllm.py answering with the case's scripted bytes. Then, for each request:
the outcome is one the reference allows; what reached vLLM is the request's method, target
and body as h11 decoded it, with no hop-by-hop header or trailer field among its headers;
what the client got is valid HTTP/1.1 to h11 and carries vLLM's status and body as h11
decoded them (or the sidecar's own answer, when it refused); the connection is kept or
closed as the outcome says, and when kept the next request on it is answered correctly; a
request on a new connection is too (no connection to vLLM was left out of step); the
counters moved as an independent reading of the same bytes says; no traceback was logged.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.differential import cases, reference
from tests.differential.reference import (
    ACCEPTED,
    ACCEPTED_CLOSED,
    BAD_GATEWAY,
    CUT,
    ERROR_EVENT,
    REFUSED,
    RELAYED,
)
from tests.hostile.conftest import Sidecar
from tests.hostile.fake_vllm import NOT_ALLOWED, FakeVllm, Raw
from tests.vllm_standin import Script, model_list

PAUSE = 0.002  # between two writes of a case: read apart by the sidecar
EXTRA_WAIT = 0.05  # for bytes after a response, written a pause after it
READ_TIMEOUT = 2.5  # the suite's silence timeouts are 1 s: a hang shows within this
# what a client's request must not carry to vLLM: hop-by-hop fields (RFC 9110 section 7.6.1),
# with those its Connection field names, and Expect (answered by the sidecar)
HOP_BY_HOP = {b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding",
              b"upgrade", b"proxy-connection", b"expect"}  # fmt: skip
COUNTED = ("mla_serve_completions_total", "mla_serve_truncated_responses_total",
           "mla_serve_unparsed_events_total")  # fmt: skip
# the finish reason's label, by either of its names (vLLM's own metrics say `finished_reason`)
LABELS = {"finished_reason": "finish_reason"}
ERROR_TAIL = re.compile(rb"(\n\n)?data: (\{.*\})\n\n", re.S)
NUMBERS = count()


@dataclass
class Target:
    """One sidecar configuration under test, and what was read of it so far."""

    name: str
    sidecar: Sidecar
    log_at: int = 0
    # the counters as last read (only the cases move them: the sidecar's own polls do not)
    last: Counter[tuple[str, tuple[tuple[str, str], ...]]] | None = None

    def scrape(self) -> tuple[Counter[tuple[str, tuple[tuple[str, str], ...]]], float]:
        """The counters this harness checks, and the buffered-bytes gauge (the lines of
        /metrics that carry them, read by prometheus_client's parser)."""
        text = httpx.get(f"{self.sidecar.admin}/metrics", timeout=5).text
        lines = "\n".join(line for line in text.splitlines()
                          if line.startswith((*COUNTED, "mla_serve_buffered_bytes")))  # fmt: skip
        counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        buffered = 0.0
        for family in text_string_to_metric_families(lines + "\n"):
            for sample in family.samples:
                if sample.name in COUNTED:
                    labels = {LABELS.get(k, k): v for k, v in sample.labels.items()}
                    counters[(sample.name, tuple(sorted(labels.items())))] = sample.value
                elif sample.name == "mla_serve_buffered_bytes":
                    buffered = sample.value
        return counters, buffered

    def new_log(self) -> str:
        text = Path(self.sidecar.log).read_text(errors="replace")
        new, self.log_at = text[self.log_at :], len(text)
        return new


class Failed(AssertionError):
    pass


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


# -- sending and reading ---------------------------------------------------------------------
def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send(sock: socket.socket, pieces: list[bytes]) -> None:
    for index, piece in enumerate(pieces):
        if index:
            time.sleep(PAUSE)
        try:
            sock.sendall(piece)
        except OSError:  # the sidecar closed it (a refusal): what it sent is read next
            return


def collect(sock: socket.socket, replies: reference.Replies, timeout: float = READ_TIMEOUT) -> None:
    """Read into `replies` until they are complete, the connection ends, or `timeout`."""
    deadline = time.monotonic() + timeout
    while not replies.done and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return
        except OSError:
            data = b""  # reset
        replies.feed(data)


def ended(sock: socket.socket, timeout: float = 1.0) -> bool:
    """Whether the sidecar ends the connection within `timeout` (sending nothing more)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut for cut in cuts if 0 < cut < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


# -- vLLM's scripted answers ------------------------------------------------------------------
def answer(one: cases.Request, raw: str) -> tuple[bytes, int, bytes]:
    """The fake's well-formed answer to a request (its bytes, status, body), vLLM's format."""
    if one.method == "HEAD":
        head = cases.head_bytes(405, "Method Not Allowed", [
            "content-type: application/json", "allow: GET", f"x-fake-id: {raw}",
            f"content-length: {len(NOT_ALLOWED)}"])  # fmt: skip
        return head, 405, b""
    if one.target.startswith(cases.MODELS):
        body = json.dumps(model_list([cases.MODEL], 1000 + next(NUMBERS))).encode()
    else:
        document = one.document or {"model": cases.MODEL, "messages": []}
        document = {key: value for key, value in document.items() if key != "stream"}
        body = json.dumps(Script("answer", document, True, 3).whole()).encode()
    head = cases.head_bytes(200, "OK", ["content-type: application/json", f"x-fake-id: {raw}",
                                        f"content-length: {len(body)}"])  # fmt: skip
    return head + body, 200, body


# -- counting, independently ------------------------------------------------------------------
def counted(
    one: cases.Request, response: reference.Response, outcome: str
) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    """What the sidecar's counters must gain for vLLM's `response` to `one` with `outcome`:
    a classified (chat) response counts each of its choices by finish reason ("error" when
    it has none) when it is a stream, or a whole 200 relayed whole; a response broken off
    after its head is one truncation."""
    out: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    if outcome in (ERROR_EVENT, CUT):
        out[("mla_serve_truncated_responses_total", ())] += 1
    chat = one.method == "POST" and one.target.startswith(cases.CHAT)
    if not chat or outcome == BAD_GATEWAY or response.status is None:
        return out
    kind = next((v for n, v in response.headers if n.lower() == b"content-type"), b"")
    if kind.startswith(b"text/event-stream"):
        choices, model = reference.choices_of_events(response.body)
    elif outcome == RELAYED and response.status == 200:
        document = json.loads(response.body)
        model = document.get("model")
        choices = {c["index"]: c.get("finish_reason") for c in document.get("choices", [])}
    else:
        return out
    for reason in choices.values():
        labels = (("finish_reason", reason or "error"), ("model", model or cases.MODEL))
        out[("mla_serve_completions_total", labels)] += 1
    return out


# -- one case ---------------------------------------------------------------------------------
class Harness:
    def __init__(self, fake: FakeVllm, target: Target) -> None:
        self.fake, self.target = fake, target

    def _seen(self, raw: str) -> list:
        return [seen for seen in self.fake.seen if seen.headers.get("x-fake-raw") == raw]

    def _before(self) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
        if self.target.last is None:
            self.target.last, _ = self.target.scrape()
        return self.target.last

    def _after(
        self,
        before: Counter[tuple[str, tuple[tuple[str, str], ...]]],
        expected: Counter[tuple[str, tuple[tuple[str, str], ...]]],
    ) -> None:
        counters, buffered = self.target.scrape()
        self.target.last = counters
        moved = Counter({key: counters[key] - before[key] for key in counters
                         if counters[key] != before[key]})  # fmt: skip
        expect(moved == +expected, f"counters moved by {dict(moved)}, expected {dict(expected)}")
        expect(buffered == 0, f"{buffered} bytes still counted as buffered")
        log = self.target.new_log()
        expect("Traceback" not in log, log[log.find("Traceback") :][:1200])

    def follow_up(self, sock: socket.socket | None) -> None:
        """A GET /v1/models on `sock` (kept open after the case) and on a new connection:
        each answered with exactly the bytes vLLM sent for it."""
        for use in ([sock] if sock is not None else []) + [None]:
            raw = f"next-{next(NUMBERS)}"
            request = cases.Request("GET", cases.MODELS, framing="none")
            wire, status, body = answer(request, raw)
            self.fake.raw[raw] = Raw([wire])
            conn = use if use is not None else connect(self.target.sidecar.port)
            try:
                send(conn, [request.wire(raw)])
                replies = reference.Replies([b"GET"])
                collect(conn, replies)
            finally:
                del self.fake.raw[raw]
                if use is None:
                    conn.close()
            where = "a new connection" if use is None else "the same connection"
            reply = replies.replies[0] if replies.replies else None
            expect(reply is not None and reply.complete and reply.status == status
                   and reply.body == body,
                   f"the next request on {where}: {replies.error or ''} "
                   f"{reply and (reply.status, reply.body[:60])}")  # fmt: skip
            expect(len(self._seen(raw)) == 1, f"vLLM saw the next request {len(self._seen(raw))}x")

    def requests(self, ones: list[cases.Request], cuts: list[int]) -> None:
        try:
            self._requests(ones, cuts)
        except BaseException as error:
            raise self._failed(error) from None

    def response(self, case: cases.Response) -> None:
        try:
            self._response(case)
        except BaseException as error:
            raise self._failed(error) from None

    def _failed(self, error: BaseException) -> BaseException:
        """A case that failed leaves counters and log lines of its own: read afresh."""
        self.target.last = None
        self.target.new_log()
        return Failed(f"{self.target.name}: {error}") if isinstance(error, Failed) else error

    # -- the client's side ------------------------------------------------------------------
    def _requests(self, ones: list[cases.Request], cuts: list[int]) -> None:
        base = f"{self.target.name}-{next(NUMBERS)}"
        raws = [f"{base}-{index}" for index in range(len(ones))]
        answers = [answer(one, raw) for one, raw in zip(ones, raws, strict=True)]
        for raw, (wire, _, _) in zip(raws, answers, strict=True):
            self.fake.raw[raw] = Raw([wire])
        data = b"".join(one.wire(raw) for one, raw in zip(ones, raws, strict=True))
        read = reference.read_requests(data)
        before = self._before()
        sock = connect(self.target.sidecar.port)
        try:
            send(sock, split(data, cuts))
            replies = reference.Replies([one.method.encode() for one in ones])
            collect(sock, replies)
            expect(replies.error is None, f"the sidecar's bytes are not HTTP/1.1 to h11: "
                                          f"{replies.error}")  # fmt: skip
            expected: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
            kept = True
            for index, one in enumerate(ones):
                accepted = index < len(read.messages)
                keep = accepted and read.messages[index].keep_alive
                allowed = reference.request_outcomes(one.features, accepted, keep)
                seen = self._seen(raws[index])
                reply = replies.replies[index] if index < len(replies.replies) else None
                what = f"request {index} ({sorted(one.features)})"
                if not seen:
                    expect(
                        reply is not None,
                        f"{what}: never answered, never sent to vLLM "
                        f"({replies.early or 'the connection is open'})",
                    )
                    assert reply is not None
                    expect(REFUSED in allowed, f"{what}: refused ({reply.status}), the "
                                               f"reference says {allowed}")  # fmt: skip
                    expect(reply is not None and reply.status >= 400 and reply.complete,
                           f"{what}: no refusal came: {reply} {replies.early or ''}")  # fmt: skip
                    expect(len(replies.replies) == index + 1, f"{what}: answered after refusing")
                    expect(replies.closed or ended(sock), f"{what}: kept after refusing")
                    kept = False
                    break
                message = read.messages[index] if accepted else None
                expect(message is not None, f"{what}: sent to vLLM, h11 refused it: {read.refused}")
                assert message is not None
                expect(allowed & {ACCEPTED, ACCEPTED_CLOSED} != set(),
                       f"{what}: sent to vLLM, the reference says {allowed}")  # fmt: skip
                self._check_forwarded(what, one, message, seen)
                _, status, body = answers[index]
                expect(reply is not None and reply.complete and reply.status == status
                       and reply.body == body,
                       f"{what}: answered {reply and (reply.status, reply.body[:60])} "
                       f"{replies.early or ''}, vLLM sent {status} {body[:60]!r}")  # fmt: skip
                assert reply is not None
                if message.version == b"1.0":
                    expect(reply.header(b"transfer-encoding") is None, f"{what}: chunked to 1.0")
                if one.method == "POST" and one.target.startswith(cases.CHAT):
                    document = json.loads(body)
                    reason = document["choices"][0]["finish_reason"]
                    labels = (("finish_reason", reason), ("model", cases.MODEL))
                    expected[("mla_serve_completions_total", labels)] += 1
                if ACCEPTED not in allowed:  # the connection ends after it
                    last = index == len(replies.replies) - 1
                    expect(last and (replies.closed or ended(sock)), f"{what}: connection kept")
                    kept = False
                    break
            if kept:
                expect(not replies.closed, "the connection was closed after requests h11 keeps")
                self.follow_up(sock)
            else:
                self.follow_up(None)
        finally:
            sock.close()
            for raw in raws:
                self.fake.raw.pop(raw, None)
        self._after(before, expected)

    def _check_forwarded(self, what: str, one: cases.Request, message, seen: list) -> None:
        expect(len(seen) == 1, f"{what}: vLLM saw it {len(seen)} times")
        got = seen[0]
        expect(got.method == message.method.decode(), f"{what}: method {got.method}")
        expect(got.target == message.target.decode("latin-1"), f"{what}: target {got.target}")
        expect(got.body == message.body,
               f"{what}: vLLM got {got.body[:60]!r}, h11 read {message.body[:60]!r}")  # fmt: skip
        sent = {name.lower() for name, _ in message.headers}
        named = {token.strip().lower() for name, value in message.headers
                 if name.lower() == b"connection" for token in value.split(b",")}  # fmt: skip
        leaked = (HOP_BY_HOP | named) & {name.encode() for name in got.headers}
        expect(not leaked, f"{what}: hop-by-hop headers reached vLLM: {leaked}")
        trailers = {name.lower().decode() for name, _ in message.trailers}
        expect(not trailers & set(got.headers), f"{what}: trailer fields reached vLLM")
        for name in sent:
            if name.startswith(b"x-gen-"):
                expect(name.decode() in got.headers, f"{what}: {name!r} not passed on")

    # -- vLLM's side ----------------------------------------------------------------------
    def _response(self, case: cases.Response) -> None:
        one = case.request
        raw = f"{self.target.name}-{next(NUMBERS)}"
        self.fake.raw[raw] = Raw(case.writes, PAUSE, case.close)
        vllm = reference.read_response(one.method.encode(), case.data, case.close)
        kind = next((v for n, v in vllm.headers if n.lower() == b"content-type"), b"")
        stream = (one.method == "POST" and one.target.startswith(cases.CHAT)
                  and kind.startswith(b"text/event-stream"))  # fmt: skip
        allowed = reference.response_outcomes(case.features, vllm, stream)
        if stream and RELAYED in allowed and b"data: [DONE]" not in vllm.body:
            # the stream's own end is [DONE]: without it a stream ended by the connection's
            # end is one that broke off (reference: README.md's exceptions)
            allowed = {ERROR_EVENT}
        before = self._before()
        sock = connect(self.target.sidecar.port)
        try:
            send(sock, [one.wire(raw)])
            replies = reference.Replies([one.method.encode()])
            collect(sock, replies)
            reply = replies.replies[0] if replies.replies else None
            outcome = self._outcome(reply, replies, vllm, stream)
            what = f"{sorted(case.features)}: vLLM sent {case.data[:80]!r}"
            saw = f"{reply and (reply.status, reply.body[:80])}, {replies.error}"
            expect(
                outcome in allowed,
                f"{what}: the client saw {outcome} ({saw}), the reference says {allowed}",
            )
            assert reply is not None
            if outcome == RELAYED:
                expect(reply.header(b"x-fake-id") == b"case", f"{what}: x-fake-id not relayed")
                for name in (b"keep-alive", b"connection"):
                    value = reply.header(name)
                    expect(value in (None, b"close"), f"{what}: vLLM's {name!r} relayed")
            if "extra-data" in case.features:
                # bytes vLLM wrote after the response: they have come (the connection sits
                # idle in the pool) before the next request may take that connection
                time.sleep(EXTRA_WAIT)
            if outcome in (RELAYED, ERROR_EVENT):  # complete: the connection is kept
                expect(not replies.closed, f"{what}: closed after a complete response")
                self.follow_up(sock)
            else:
                self.follow_up(None)
        finally:
            sock.close()
            self.fake.raw.pop(raw, None)
        self._after(before, counted(one, vllm, outcome))

    def _outcome(
        self,
        reply: reference.Reply | None,
        replies: reference.Replies,
        vllm: reference.Response,
        stream: bool,
    ) -> str:
        """Which outcome the client's bytes show, checked against vLLM's as h11 read them."""
        if reply is None:
            return f"no response ({replies.error or 'nothing came'})"
        if reply.status == 502 and vllm.status != 502 and reply.complete:
            error = json.loads(reply.body).get("error", {})
            return BAD_GATEWAY if isinstance(error.get("message"), str) else "a 502 not JSON"
        if reply.status != vllm.status:
            return f"status {reply.status}"
        if not reply.complete:
            if not replies.closed:
                return "a response still open"
            return CUT if vllm.body.startswith(reply.body) else "a cut body that differs"
        if reply.body == vllm.body:
            return RELAYED
        tail = reply.body[len(vllm.body) :]
        match = ERROR_TAIL.fullmatch(tail)
        if stream and reply.body.startswith(vllm.body) and match is not None:
            gap = bool(vllm.body) and not vllm.body.endswith(b"\n\n")
            error = json.loads(match.group(2)).get("error", {})
            if bool(match.group(1)) == gap and error.get("type") == "upstream_error":
                return ERROR_EVENT
        return "a body that differs"
