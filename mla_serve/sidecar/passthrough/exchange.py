"""The OpenAI pass-through: one request to vLLM and its answer back, one exchange each.

What every request shares (the settings, the one client to vLLM, the byte budget, the
metrics, the runaway ledger and guard, the drain) is the `PassThrough` (service.py). Each
request is one `Exchange`, whatever front serves it (fronts.py: the sidecar's own HTTP
protocol writing to its transport, or ASGI under h11): the front hands it the request's head
and body, the exchange checks the request, sends it to vLLM through the pool (upstream.py),
and is vLLM's response's `Sink`: the head, each piece of the body, the end or why it broke
off come in from the connection's callbacks and go out through the front.

Its life is a small state machine (phases.py): BODY → (QUEUED) → CONNECTING → SENT →
RELAY → DONE, every move through `phases.move`. What belongs to one job lives beside it:
the header rules (headers.py), the deadlines of each phase (deadlines.py, one timer here),
the reading of a chat or completion response and the runaway guard's watch (response.py),
the series and the byte budget (metrics.py), what fails and how it is answered (errors.py).

Bytes go out as they arrive and unchanged (the events of each read of vLLM's socket, never
the whole response); status, headers and bodies are vLLM's own, less the hop-by-hop headers
a proxy must not pass on and vLLM's Date. Only the routes in `routes.OPENAI_ROUTES` (plus
`--extra-routes`) are forwarded, checked on the normalized path.

Memory: a request body up to `--max-body-bytes`; every copy of a request body held (its
pieces, the body they make, the request written to vLLM until vLLM's head, kept for a retry)
counts against `--max-inflight-body-bytes` while it lives (503 past it); an event (or whole
response) kept to classify up to `--max-event-bytes`, else passed on unparsed.

Faults: vLLM unreachable → 503; no response head in time → 504; broken before its head →
502 (once retried when a kept connection was closed under the request); after the head a
stream ends with an error event, any other body is cut off. A client that disconnects drops
vLLM's connection, so vLLM aborts the request and frees the slot; nothing is counted. The
drain (serve.py): new responses close their connections; at its timeout what is still open
ends as vLLM failing would end it (a stream with its error event), counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from mla_serve.sidecar.passthrough import classify, deadlines, errors, headers, upstream
from mla_serve.sidecar.passthrough.classify import CLASSIFIED, Request
from mla_serve.sidecar.passthrough.errors import Refused, why
from mla_serve.sidecar.passthrough.phases import End, Phase, PhaseError, move
from mla_serve.sidecar.passthrough.response import Reader

if TYPE_CHECKING:
    from mla_serve.sidecar.passthrough.service import Front, PassThrough

log = logging.getLogger("mla_serve.sidecar")

Headers = list[tuple[bytes, bytes]]
RELAY = Phase.RELAY  # tested on every read of vLLM's socket: a plain name, no enum lookup


def admit(
    service: PassThrough,
    front: Front,
    method: bytes,
    raw_path: str,
    query: bytes,
    request_headers: Headers,
    peer: str,
    scheme: bytes,
    has_body: bool,
) -> Exchange | None:
    """The exchange of a request the pass-through serves, or None: a path it does not
    forward, answered 404 through `front` (closing the connection when a body follows)."""
    path = service.route(raw_path)
    if path is None:
        refused = Refused(404, "no such route", "not_found_error")
        service.metrics.refused.labels("404").inc()
        front.answer(404, refused.body(), has_body or service.draining)
        return None
    return Exchange(service, front, method, path, query, request_headers, peer, scheme)


class Exchange:
    """One request through the pass-through and its response; see the module's docstring."""

    __slots__ = (
        "attempts",
        "batch",
        "broken",
        "classified",
        "conn",
        "connecting",
        "deadline",
        "ends_by",
        "failure",
        "front",
        "headers",
        "held",
        "last_body",
        "loop",
        "method",
        "outcome",
        "path",
        "paused",
        "payload",
        "peer",
        "phase",
        "pieces",
        "query",
        "reader",
        "request",
        "scheme",
        "service",
        "settings",
        "shut_down",
        "started",
        "timer",
    )

    HIGH_WATER = 64 * 1024  # bytes waiting for the client past which vLLM is paused

    def __init__(
        self,
        service: PassThrough,
        front: Front,
        method: bytes,
        path: str,
        query: bytes,
        request_headers: Headers,
        peer: str,
        scheme: bytes,
    ) -> None:
        self.service = service
        self.settings = service.settings
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.method = method
        self.path = path
        self.query = query
        self.headers = request_headers
        self.peer = peer
        self.scheme = scheme
        self.classified = method == b"POST" and path in CLASSIFIED
        self.phase = Phase.BODY
        self.outcome: End | None = None
        # the request
        self.pieces: list[bytes] = []  # the request's body so far
        self.held = 0  # bytes of the in-flight budget the request's copies hold
        self.started = self.last_body = self.loop.time()
        self.request: Request | None = None  # what classification keeps of the request
        self.payload = b""  # the request as written to vLLM, kept until vLLM answers
        # vLLM's side
        self.conn: upstream.Connection | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.attempts = 0
        self.deadline = math.inf  # vLLM's head by then
        self.ends_by = math.inf  # a response that is not a stream: over by then
        self.timer: asyncio.TimerHandle | None = None
        # the response
        self.reader: Reader | None = None  # a classified response's reading (response.py)
        self.batch: list[bytes] = []  # this read's output
        self.paused = False  # vLLM's connection paused: the client is behind
        self.broken: str | None = None  # why vLLM's response broke off (the connection)
        self.failure: str | None = None  # why the sidecar ended it (a deadline, the drain)
        self.shut_down = False  # ended by the drain's timeout
        service.live.add(self)

    # -- the request, from the front ----------------------------------------------------------
    def begin(self, length: int | None) -> bool:
        """The request's head is in (its declared Content-Length, if any): False when it is
        refused at once (answered)."""
        settings = self.settings
        if length is not None and length > settings.max_body_bytes:
            return self._refuse(Refused(413, f"request body over {settings.max_body_bytes} bytes"))
        return True

    def waiting_body(self) -> None:
        """After a read of the client's socket left the body incomplete: its deadline (not
        while the request waits behind an earlier response: its connection is not read)."""
        if self.phase is Phase.BODY and self.timer is None and self.front.ready:
            self._arm_timer(deadlines.body_wait(self.settings, self.started, self.last_body))

    def take_body(self, data: bytes) -> None:
        if self.phase is not Phase.BODY or not data:
            return
        self.last_body = self.loop.time()
        size = len(data)
        limit = self.settings.max_body_bytes
        if self.held + size > limit:
            self._refuse(Refused(413, f"request body over {limit} bytes"))
            return
        if not self.service.budget.take(size):
            self._refuse(errors.busy())
            return
        self.held += size
        self.pieces.append(data)

    def body_done(self) -> None:
        """The client's request is complete: check it, send it to vLLM (or queue it behind
        the response its connection is still sending)."""
        if self.phase is not Phase.BODY:
            return
        budget = self.service.budget
        pieces = self.pieces
        if len(pieces) > 1:  # the body they make, counted while both exist
            if not budget.take(self.held):
                self._refuse(errors.busy(), read=True)
                return
            body = b"".join(pieces)
            pieces.clear()
            budget.give(self.held)
        else:
            body = pieces.pop() if pieces else b""
        try:
            payload = self._payload(body)
        except Refused as refused:
            self._refuse(refused, read=True)
            return
        except Exception as error:  # a bug must answer this request, not end the connection
            log.exception("reading a request failed")
            message = f"the sidecar failed: {why(error)}"
            self._answer(500, errors.error_body(500, message, "server_error"), read=True)
            return
        del body
        # The request written to vLLM replaces the body in the budget (it is the body and a
        # head): held until vLLM's head, as a retry may write it again.
        budget.give(self.held)
        budget.used += len(payload)
        self.held = len(payload)
        self.payload = payload
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.front.ready:
            self.phase = move(self.phase, Phase.QUEUED)
            return
        self._dispatch()

    def _payload(self, body: bytes) -> bytes:
        """The request as written to vLLM, its body checked and classified when it is a chat
        or completion (Refused when vLLM would refuse it as malformed)."""
        if self.classified:
            service = self.service
            request = classify.read_request(
                body, self.settings.max_json_values, service.loops, self.path
            )
            body, request.body = request.body, b""  # only the payload keeps the body
            self.request = request
        pool = self.service.pool
        assert pool is not None
        query = self.query
        target = pool.prefix + self.path.encode("latin-1") + (b"?" + query if query else b"")
        service = self.service
        forwarded = headers.forwarded(self.headers, self.peer, self.scheme, service.trusted)
        return headers.request_bytes(self.method, target, pool.authority, forwarded, body)

    def front_ready(self) -> None:
        """The front may write now (the response before it on its connection went out): a
        request read whole goes to vLLM, one still being read has its body's deadlines from
        now on (its connection was not read while it waited)."""
        if self.phase is Phase.QUEUED:
            self._dispatch()
        elif self.phase is Phase.BODY:
            self.started = self.last_body = self.loop.time()
            self.waiting_body()

    def client_gone(self) -> None:
        """The client's connection is lost: vLLM's request is aborted, everything held given
        back; nothing is counted."""
        if self.phase is not Phase.DONE:
            self.phase = move(self.phase, Phase.DONE)
            self.outcome = End.GONE
        self.close()

    def client_paused(self) -> None:
        """The client's transport is over its high-water mark: writes queue in the front."""
        if self.conn is not None:
            self.conn.disarm()

    def client_resumed(self) -> None:
        """The front wrote what waited: vLLM is read again."""
        if self.paused and self.conn is not None:
            self.paused = False
            self.conn.resume()

    # -- vLLM's side ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """The request goes to vLLM: its deadlines start (the timer due no later than the
        response's first check, which its head then keeps)."""
        now = self.loop.time()
        settings = self.settings
        self.deadline = now + settings.upstream_timeout
        self._arm_timer(min(self.deadline, now + settings.stream_idle_timeout,
                            now + settings.response_deadline))  # fmt: skip
        self._attempt()

    def _attempt(self) -> None:
        """Write the request on an idle connection to vLLM, or open one (a task)."""
        self.attempts += 1
        pool = self.service.pool
        assert pool is not None
        conn = pool.take()
        if conn is None:
            self.phase = move(self.phase, Phase.CONNECTING)
            self.connecting = self.loop.create_task(self._connect(pool))
            return
        self._send(conn)

    async def _connect(self, pool: upstream.Pool) -> None:
        try:
            conn = await pool.connect()
        except TimeoutError:
            self._unreachable("connect timeout")
            return
        except OSError as error:  # ssl.SSLError is one; its text names the address: logged
            self._unreachable(error.strerror or type(error).__name__, str(error))
            return
        except Exception as error:  # a bug must answer this request, not vanish in a task
            log.exception("connecting to vLLM failed")
            self._unreachable(type(error).__name__, why(error))
            return
        self.connecting = None
        if self.phase is not Phase.CONNECTING:  # the client left or was answered meanwhile
            pool.put(conn)
            return
        self._send(conn)

    def _send(self, conn: upstream.Connection) -> None:
        self.phase = move(self.phase, Phase.SENT)
        self.conn = conn
        conn.request(self.payload, self, head_only=self.method == b"HEAD")

    def _unreachable(self, detail: str, logged: str | None = None) -> None:
        self.connecting = None
        self._fail("unreachable", detail, logged)

    # -- the one timer ------------------------------------------------------------------------
    def _arm_timer(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(when, self._tick)

    def _tick(self) -> None:
        """Every deadline of the exchange, by phase (deadlines.py)."""
        self.timer = None
        phase = self.phase
        now = self.loop.time()
        settings = self.settings
        if phase is Phase.BODY:
            when = deadlines.body_wait(settings, self.started, self.last_body)
            if now >= when:
                self._refuse(deadlines.body_late(settings, self.started, self.last_body))
                return
            self._arm_timer(when)
        elif phase is Phase.CONNECTING or phase is Phase.SENT:
            if now < self.deadline:
                self._arm_timer(self.deadline)
            elif self.connecting is not None:
                self.connecting.cancel()
                self._unreachable("connect timeout")
            else:
                if self.conn is not None:
                    self.conn.abort()
                    self.conn = None
                self._fail("timeout", f"{settings.upstream_timeout:g}")
        elif phase is Phase.RELAY:
            conn = self.conn
            if conn is None:
                return
            failure, when = deadlines.response_check(
                settings, conn.idle_since(), not conn.paused, self.ends_by, now
            )
            if failure is not None:
                self._stop(failure)
                return
            self._arm_timer(when)

    # -- the connection's callbacks (upstream.Sink) ------------------------------------------
    def head(self, status: int, response_headers: Headers) -> Callable[[bytes], object]:
        """vLLM's head: passed on (its framing the front's); what takes the body's pieces
        (a classified response's reader, else this read's batch: passed on as they are)."""
        self.phase = move(self.phase, Phase.RELAY)
        self._release()  # vLLM is answering: the request's bytes back
        streamed = headers.media_type(response_headers) == b"text/event-stream"
        request = self.request
        reader = None
        if request is not None:
            reader = Reader(self.service, request, status, streamed, self.batch, self._stop)
            self.reader = reader
        settings = self.settings
        if not streamed:
            self.ends_by = self.loop.time() + settings.response_deadline
        returned = headers.returned(response_headers, keep_length=not streamed)
        length = any(name == b"content-length" for name, _ in returned)
        chunked = not length and status not in (204, 304) and self.method != b"HEAD"
        self.front.start(status, returned, not chunked, self.service.draining)
        when = min(self.loop.time() + settings.stream_idle_timeout, self.ends_by)
        timer = self.timer
        if timer is None or timer.when() > when:
            self._arm_timer(when)
        return self.batch.append if reader is None else reader.consumer

    def fed(self) -> None:
        """After one read of vLLM's socket: what it gave, in one write to the client."""
        batch = self.batch
        if not batch or self.phase is not RELAY:
            return
        out = batch[0] if len(batch) == 1 else b"".join(batch)
        batch.clear()
        if self.front.write(out) and self.conn is not None and not self.paused:
            self.paused = True
            self.conn.pause()

    def may_arm(self, conn: upstream.Connection) -> None:
        """vLLM's parser is between two chunks: the lane may take this stream's next reads
        of token chunks, which the reader's feed would take here. Where the lane's texts
        reach the guard's next check it calls the reader's checkpoint."""
        reader = self.reader
        lane = conn.lane
        if reader is None or self.phase is not RELAY or not self.front.direct or lane is None:
            return
        args = reader.lane()
        if args is None:
            return
        head, keys, tail, channel, budget = args
        check = None if channel is None else reader.checkpoint_of(lane)
        lane.arm(head, keys, tail, channel, budget, self.front.transport_write(), conn.clock,
                 check)  # fmt: skip

    def took(self, taken: upstream.Taken) -> None:
        """What the lane took (token chunks written to the client), handed over before a
        read the Python path takes."""
        reader = self.reader
        if reader is not None:
            reader.took(taken)

    def end(self) -> None:
        """vLLM's response ended as HTTP says it must (the connection returns to the pool
        by itself once its read is parsed whole)."""
        self.conn = None
        if self.phase is Phase.RELAY:
            self._end(complete=True)

    def lost(self, why_: str, retryable: bool) -> None:
        self.conn = None
        phase = self.phase
        if phase is Phase.RELAY:
            self.broken = why_
            self._end(complete=False)
        elif phase is Phase.SENT:
            if retryable and self.attempts < 2:
                self._attempt()  # vLLM closed an idle connection as the request went out
            else:
                self._fail("broken", why_)

    # -- the end -------------------------------------------------------------------------------
    def shut(self, why_: str) -> None:
        """The drain timed out with this request still open: a response under way ends as a
        failing vLLM would end it (a stream with its error event, another body cut off), one
        not begun is answered 503; counted."""
        phase = self.phase
        if phase is Phase.DONE:
            return
        self.shut_down = True
        self.service.metrics.drained.inc()
        if phase is Phase.RELAY:
            self._stop(why_)
        else:
            self._answer(503, errors.error_body(503, why_, "server_shutting_down"))

    def _stop(self, failure: str | None) -> None:
        """Take nothing more from vLLM: drop its connection (vLLM aborts the request)."""
        if failure is not None and self.failure is None:
            self.failure = failure
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()
        if self.phase is Phase.RELAY:
            self._end(complete=False)

    def _end(self, complete: bool) -> None:
        """vLLM's response is over (complete, broken off, stopped by the guard, too slow, or
        the drain's end): the last bytes to the client, the completion counted."""
        self.phase = move(self.phase, Phase.DONE)
        self.outcome = End.FINISHED
        batch = self.batch
        out = b"".join(batch)
        batch.clear()
        metrics = self.service.metrics
        reader = self.reader
        if reader is not None and reader.stream:
            broken = self.broken
            cause = self.failure or (f"vLLM broke off the stream: {broken}" if broken else None)
            last, error = reader.last(out, cause)
            self.front.finish(last)
            if error is not None and not self.shut_down:
                metrics.truncated.inc()
            reader.record(complete)
        elif not complete:
            self.outcome = End.CUT
            if out:
                self.front.write(out)
            if not self.shut_down:
                metrics.truncated.inc()
            log.warning("aborted a response: vLLM's response broke off after its headers: %s",
                        self.failure or self.broken)  # fmt: skip
            self.front.cut()
        else:
            self.front.finish(out)
            if reader is not None:
                reader.record(True)
        self.close()

    def _refuse(self, refused: Refused, read: bool = False) -> bool:
        """A request answered here before vLLM (`read`: its body was read whole); False."""
        self.service.metrics.refused.labels(str(refused.status)).inc()
        self._answer(refused.status, refused.body(), read)
        return False

    def _fail(self, kind: str, detail: str, logged: str | None = None) -> None:
        """vLLM failed before its head (errors.upstream_failure): answered here, counted by
        reason; the log names vLLM's address and the whole error (`logged`), the client's
        answer neither."""
        self.service.metrics.failures.labels(kind).inc()
        log.warning("vLLM at %s %s: %s", self.settings.vllm_url, kind, logged or detail)
        refused = errors.upstream_failure(kind, detail)
        self._answer(refused.status, refused.body())

    def _answer(self, status: int, body: bytes, read: bool = False) -> None:
        """A response of the sidecar's own before vLLM's head (`read`: the request's body
        was read whole, though the phase is still BODY)."""
        phase = self.phase
        if phase is Phase.DONE:
            return
        if phase is Phase.RELAY:
            raise PhaseError("an exchange cannot answer itself after vLLM's head went out")
        # the rest of the request is not read: the connection ends with the answer
        unread = phase is Phase.BODY and not read
        self.phase = move(phase, Phase.DONE)
        self.outcome = End.ANSWERED
        self.close()
        close = status in errors.CLOSING or unread or self.service.draining
        self.front.answer(status, body, close)

    def _release(self) -> None:
        """The request's bytes back to the budget (once)."""
        self.pieces.clear()
        self.payload = b""
        self.service.budget.give(self.held)
        self.held = 0

    def close(self) -> None:
        """Whatever happened (the end, the client gone, an error): vLLM's connection dropped
        unless its response ended, the timer stopped, held bytes given back."""
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        conn = self.conn
        if conn is not None:
            self.conn = None
            conn.abort()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.reader is not None:
            self.reader.close()
        self._release()
        self.service.live.discard(self)
