"""Server-sent events, split without copying more than needed.

vLLM writes one `data: {json}\\n\\n` event per write, so the fast path is one `rfind` per
read. The general path follows the SSE grammar: lines end in CRLF, LF or CR, and an event
ends at an empty line. Bytes are never rewritten here: callers forward exactly the slices
they are given. A partial event is kept as a list of pieces (linear in its size) and only
up to `limit` bytes; past that it is forwarded as it comes and not parsed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# An empty line: two line terminators in a row. A lone CR must not be the first half of a
# CRLF, or "data: x\r\nmore" would count as an event end.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")


def last_event_end(buffer: bytes) -> int:
    """The index just past the last complete event in `buffer`, or 0 if there is none."""
    if b"\r" not in buffer:
        cut = buffer.rfind(b"\n\n")
        return cut + 2 if cut >= 0 else 0
    end = 0
    for found in _EVENT_END.finditer(buffer):
        end = found.end()
    return end


def first_event_end(buffer: bytes) -> int:
    """The index just past the first event end in `buffer`, or 0 if there is none."""
    if b"\r" not in buffer:
        cut = buffer.find(b"\n\n")
        return cut + 2 if cut >= 0 else 0
    found = _EVENT_END.search(buffer)
    return found.end() if found is not None else 0


def split_events(block: bytes) -> list[tuple[bytes, bytes]]:
    """Complete events in `block` (which ends at an event end): (raw bytes, event text)."""
    if b"\r" not in block:
        raws = block.split(b"\n\n")[:-1]
        return [(raw + b"\n\n", raw) for raw in raws]
    events: list[tuple[bytes, bytes]] = []
    start = 0
    for found in _EVENT_END.finditer(block):
        events.append((block[start : found.end()], block[start : found.start()]))
        start = found.end()
    return events


def data_of(event: bytes) -> bytes | None:
    """The event's data (its `data:` lines joined by LF), or None when it has none."""
    if event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event:
        return event[6:]  # vLLM's shape: one line
    lines = []
    for line in _LINE_END.split(event):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None


class Splitter:
    """Feed reads; get back, in order: bytes to pass on unparsed, complete events to parse
    (and pass on), and bytes to pass on unparsed after them."""

    def __init__(
        self,
        limit: int,
        take: Callable[[int], bool] | None = None,
        give: Callable[[int], None] | None = None,
    ) -> None:
        """`take`/`give`: a byte budget shared with other requests; a partial event that
        does not fit it is forwarded unparsed, like one over `limit`."""
        self.limit = limit
        self.take = take
        self.give = give
        self.pieces: list[bytes] = []
        self.size = 0
        self.skipping = False  # inside an oversized event: forward until its end
        self.tail = b""  # the last 3 bytes held or skipped: an event end may straddle reads
        self.oversized = 0

    def feed(self, data: bytes) -> tuple[bytes, bytes, bytes]:
        if not self.pieces and not self.skipping:
            self.tail = b""
            cut = last_event_end(data)
            if cut == len(data):
                return b"", data, b""
            if cut == 0:
                return self._hold(b"", data)
            return self._hold(b"", data[cut:], data[:cut])
        tail = self.tail
        if self.skipping:
            joined = tail + data
            cut = first_event_end(joined)
            if cut == 0:
                self.tail = joined[-3:]
                return data, b"", b""
            cut = max(cut - len(tail), 0)
            self.skipping = False
            self.pieces.clear()
            self.size, self.tail = 0, b""
            rest = data[cut:]
            inner = last_event_end(rest)
            if inner == 0:
                return self._hold(data[:cut], rest)
            return self._hold(data[:cut], rest[inner:], rest[:inner])
        if last_event_end(tail + data) <= len(tail):
            return self._hold(b"", data)
        buffer = b"".join(self.pieces) + data
        self._drop()
        cut = last_event_end(buffer)
        return self._hold(b"", buffer[cut:], buffer[:cut])

    def _hold(
        self, before: bytes, partial: bytes, events: bytes = b""
    ) -> tuple[bytes, bytes, bytes]:
        after = b""
        over = False
        if partial:
            self.pieces.append(partial)
            self.tail = (self.tail + partial)[-3:]
            if self.take is not None and not self.take(len(partial)):
                over = True
            else:
                self.size += len(partial)
        if over or self.size > self.limit:  # too big to parse: pass it on as it is
            self.oversized += 1
            after = b"".join(self.pieces)
            tail = self.tail
            self._drop()
            self.skipping, self.tail = True, tail
        return before, events, after

    def _drop(self) -> None:
        if self.give is not None and self.size:
            self.give(self.size)
        self.pieces.clear()
        self.size, self.tail = 0, b""

    def rest(self) -> bytes:
        """What is left at the end of the stream (an unterminated event)."""
        left = b"" if self.skipping else b"".join(self.pieces)
        self._drop()
        return left
