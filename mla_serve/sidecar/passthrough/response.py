"""Reading a chat or completion response as it passes: what it showed, the guard's watch.

A `Reader` is made when vLLM's head of a classified request (classify.CLASSIFIED, POST) is
in; it sees every piece of the body (`feed`), appends the bytes to pass on to the exchange's
batch (unchanged: nothing but a usage chunk asked for here is ever left out, and after the
guard stopped a stream, what followed its stop), and at the end gives a stream's last bytes
(`last`) and counts the completion (`record`).

A stream: its token chunks (nearly every event) are matched by the stream's token shape
(classify.TokenShape, learnt as its first ones pass), without parsing them whole; other
events are split (sse.Splitter, partial events held within the byte budget) and parsed
whole. With the C lane armed (lane.py), whole reads of token chunks are taken in C and what
they did is collected here (`took`); what the lane may take is asked of the runaway guard
(guard/loops.py `ResponseGuard.lane`). A whole body: kept (up to `--max-event-bytes`, within
the budget) and parsed at its end.

What a client sees is decided by one rule, runaways.visible; the C lane is given it per
channel (`lane`) and checks the text as str.isspace does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mla_serve.sidecar.passthrough import classify, errors, sse
from mla_serve.sidecar.passthrough.errors import why
from mla_serve.sidecar.passthrough.runaways import Choice, Completion, visible, visible_channel

if TYPE_CHECKING:
    from mla_serve.sidecar.guard.loops import ResponseGuard
    from mla_serve.sidecar.passthrough.classify import Request, TokenShape
    from mla_serve.sidecar.passthrough.lane import Lane
    from mla_serve.sidecar.passthrough.service import PassThrough
    from mla_serve.sidecar.passthrough.upstream import Taken

# The arguments of _lane.Lane.arm that come from the stream: its shape, and the guard's terms.
LaneArgs = tuple[bytes, tuple[tuple[bytes, str, bool], ...], bytes, str | None, int]
log = logging.getLogger("mla_serve.sidecar")
UNBOUNDED = 1 << 62  # the lane's budget when no detector watches: no checkpoint to reach


class Reader:
    """One classified response as it passes; see the module's docstring."""

    __slots__ = (
        "batch",
        "choice",
        "closed",
        "completion",
        "done",
        "drain",
        "guard",
        "keep",
        "kept",
        "kept_size",
        "ok",
        "request",
        "service",
        "shape",
        "splitter",
        "stop",
        "stream",
    )

    def __init__(
        self,
        service: PassThrough,
        request: Request,
        status: int,
        stream: bool,
        batch: list[bytes],
        stop: Callable[[str | None], None],
    ) -> None:
        self.service = service
        self.stop = stop  # the exchange's: nothing more from vLLM (why, None: the guard)
        self.request = request
        self.guard: ResponseGuard | None = request.guard
        self.stream = stream
        self.batch = batch  # the exchange's: what this read passes on
        self.completion = Completion()
        # a stream
        budget = service.budget
        self.splitter = sse.Splitter(service.settings.max_event_bytes, budget.take, budget.give)
        self.shape: TokenShape | None = None
        self.choice: Choice | None = None  # choice 0, once the stream's shape is learnt
        self.done = False  # [DONE] seen
        # a whole body (a 200), kept to classify
        self.ok = status == 200
        self.keep = not stream and self.ok
        self.kept: list[bytes] = []
        self.kept_size = 0
        self.closed = False  # the exchange is over: a lane still calling gets 0
        self.drain: Callable[[], Taken | None] | None = None  # the armed lane's

    # -- the body ----------------------------------------------------------------------------
    @property
    def consumer(self) -> Callable[[bytes], None]:
        """What takes the body's pieces, as the connection frees them (`feed`, `feed_whole`)."""
        return self.feed if self.stream else self.feed_whole

    def feed_whole(self, data: bytes) -> None:
        """One piece of a body that is not a stream: kept to classify, and to the batch."""
        if self.keep:
            self._keep(data)
        self.batch.append(data)

    def feed(self, data: bytes) -> None:
        """One piece of a stream: its bytes to the batch; the exchange told to stop when the
        guard stops the stream here, or when the reading fails (a bug must end this
        response, not the connection's loop)."""
        try:
            shape = self.shape
            splitter = self.splitter
            if shape is not None and not splitter.pieces and not splitter.skipping:
                found = shape.match(data)
                if found is not None:  # a token chunk: choice 0's visibility, the guard's
                    self.batch.append(data)
                    channel, text = found
                    choice = self.choice
                    if not choice.visible and visible(channel, text):  # type: ignore[union-attr]
                        choice.visible = True  # type: ignore[union-attr]
                    guard = self.guard
                    if guard is not None and guard.add_token(0, channel, text):
                        self.stop(None)
                    return
            if not splitter.pieces and not splitter.skipping and classify.one_event(data):
                out = self._event(data, data[6:], True)
            else:
                out, events, after = splitter.feed(data)
                if events:
                    out += self._events(events)
                guard = self.guard
                if guard is None or not guard.stopped:
                    out += after
            if out:
                self.batch.append(out)
            guard = self.guard
            if guard is not None and guard.stopped:
                self.stop(None)
        except Exception as error:
            log.exception("classifying a response failed")
            self.stop(f"the sidecar failed on vLLM's response: {why(error)}")

    def _events(self, block: bytes) -> bytes:
        """Complete events: each classified; the bytes to pass on (all of them, less a usage
        chunk asked for here, and nothing after the chunk that confirmed a loop to stop)."""
        if classify.one_event(block):
            return self._event(block, block[6:], True)
        kept: list[bytes] = []
        guard = self.guard
        for raw, event in sse.split_events(block):
            data = sse.data_of(event)
            kept.append(self._event(raw, data) if data is not None else raw)
            if guard is not None and guard.stopped:
                break
        return b"".join(kept)

    def _event(self, raw: bytes, data: bytes, whole: bool = False) -> bytes:
        """One event's data: classified; the event's bytes to pass on, or none (a usage
        chunk asked for here)."""
        if data == b"[DONE]":
            self.done = True
            return raw
        try:
            chunk = classify.loads(data)
            if chunk.__class__ is not dict:
                raise ValueError("not an object")
            self.completion.add_chunk(chunk)
        except (ValueError, TypeError, AttributeError, RecursionError):
            self.service.metrics.unparsed.inc()
            return raw
        guard = self.guard
        if guard is not None and guard.add_chunk(chunk):
            return raw
        if self.request.strip_usage and not chunk.get("choices") and chunk.get("usage"):
            return b""
        shape = self.shape
        if (shape is None or not shape.tail) and (whole or classify.one_event(raw)):
            learnt = classify.learn(raw, chunk, first=shape is None)
            if learnt is not None:
                self.shape = learnt
                self.choice = self.completion.choices[0]
        return raw

    def _keep(self, data: bytes) -> None:
        self.kept_size += len(data)
        if self.kept_size <= self.service.settings.max_event_bytes and self.service.budget.take(
            len(data)
        ):
            self.kept.append(data)
        else:  # too big, or no room now: relayed, not classified
            self.keep = False
            self._forget()

    # -- the C lane --------------------------------------------------------------------------
    def lane(self) -> LaneArgs | None:
        """What the C lane is armed with for this stream's next reads (the token shape, each
        key's visibility, the channel whose texts it keeps and the characters until the
        guard's next check); None when the Python path must take them."""
        shape = self.shape
        if shape is None or not shape.tail or self.splitter.pieces:
            return None
        channel: str | None = None
        budget = UNBOUNDED
        guard = self.guard
        if guard is not None:
            terms = guard.lane()
            if terms is None:
                return None
            channel, budget = terms
        head, keys, tail = shape.arm_args()
        shown = tuple((key, name, visible_channel(name)) for key, name in keys)
        return head, shown, tail, channel, budget

    def took(self, taken: Taken) -> int:
        """What the lane took (token chunks written to the client): counted as `feed`
        counts them; the lane's next budget (the guard's, `UNBOUNDED` without one; 0: the
        Python path takes the stream's next tokens)."""
        tokens, shown, texts = taken
        choice = self.choice
        if shown and choice is not None:
            choice.visible = True
        guard = self.guard
        if guard is None:
            return UNBOUNDED
        return guard.took(0, tokens, texts)

    def checkpoint_of(self, lane: Lane) -> Callable[[], int]:
        """The checkpoint `lane` is armed with (`checkpoint`, draining that lane)."""
        self.drain = lane.drain
        return self.checkpoint

    def checkpoint(self) -> int:
        """The lane's texts reached the guard's next check: what it took is counted and the
        detector looks (`took`), after the same token as through `feed`; the next budget,
        or 0 when the Python path takes the stream's next tokens (the exchange told to stop
        when the guard stopped the stream here)."""
        drain = self.drain
        if self.closed or drain is None:
            return 0
        try:
            taken = drain()
            budget = self.took(taken) if taken is not None else self.next_budget()
        except Exception as error:  # a bug must end this response, as in `feed`
            log.exception("classifying a response failed")
            self.stop(f"the sidecar failed on vLLM's response: {why(error)}")
            return 0
        if budget <= 0 and self.stopped:
            self.stop(None)
        return budget

    def next_budget(self) -> int:
        """The lane's budget when it took nothing new (`took`'s answer without a token)."""
        guard = self.guard
        if guard is None:
            return UNBOUNDED
        if guard.stopped:
            return 0
        terms = guard.lane()
        if terms is None or terms[0] is None:
            return 0
        return terms[1]

    @property
    def stopped(self) -> bool:
        return self.guard is not None and self.guard.stopped

    # -- the end -----------------------------------------------------------------------------
    def last(self, held: bytes, why: str | None) -> tuple[bytes, str | None]:
        """A stream's last bytes (`held`: the batch not yet written), with the guard's ending
        when it stopped the stream, else with an error event when the stream did not end as
        vLLM ends one (`why` it broke off, or no [DONE]); and that error (None if none)."""
        splitter = self.splitter
        if splitter.oversized:
            self.service.metrics.unparsed.inc(splitter.oversized)
        tail = held + splitter.rest()
        guard = self.guard
        if guard is not None and guard.stopped:
            # The guard ended it (vLLM's connection is closed, so vLLM aborts the request and
            # frees its KV cache); the client gets a clean end instead of the rest.
            return held + guard.ending(include_usage=not self.request.strip_usage), None
        if why is None:
            if self.done:
                return tail, None
            why = "vLLM ended the stream without [DONE]"
        if tail and not tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
            tail += b"\n\n"  # end the partial event, or the error event would join it
        return tail + errors.error_event(why), why

    def record(self, complete: bool) -> None:
        """Count the completion: a stream's choices as they ended; a whole 200 body when it
        came whole and was kept (else it counts as unparsed)."""
        service = self.service
        if self.stream:
            guard = self.guard
            if guard is not None:
                guard.settle(self.completion)
            service.ledger.record(self.completion, self.request.model)
            return
        if not complete or not self.ok:
            return  # cut off, or not a 200: nothing to count
        completion = Completion()
        try:
            if not self.keep:
                raise ValueError("not kept to classify")
            document = classify.loads(b"".join(self.kept))
            if document.__class__ is not dict:
                raise ValueError("not an object")
            completion.add_body(document)
            guard = self.guard
            if guard is not None:
                guard.add_body(document)
                guard.settle(completion)
        except (ValueError, TypeError, AttributeError, RecursionError):
            service.metrics.unparsed.inc()
            return
        service.ledger.record(completion, self.request.model)

    def close(self) -> None:
        """What is held against the budget given back (a partial event, a kept body)."""
        self.closed = True
        self.splitter.rest()
        self._forget()

    def _forget(self) -> None:
        if self.kept:
            self.service.budget.give(sum(len(piece) for piece in self.kept))
            self.kept.clear()
