"""The fallback when the engine plugin is absent: figures from vLLM's startup log.

vLLM logs the configured CUDA graph mode when the engine starts, each downgrade
the backends force ("…; setting cudagraph_mode=PIECEWISE", "Overriding to …"),
and "Graph capturing finished in N secs, took X GiB" per worker. The last word
on the mode wins. Rank comes from the worker prefix vLLM puts on each line
("(Worker_TP1 pid=…)"); lines without one count for rank 0. Two workers writing at once
interleave: a worker's prefix, then another worker's whole line, then the first worker's
message on a line of its own ("(Worker_TP0 pid=1) (Worker_TP1 pid=2) INFO … took X GiB"
followed by "INFO … took Y GiB"). A prefix directly followed by another is such an orphan:
the message after the last prefix is that worker's, and the next capture line without a
prefix belongs to the oldest orphan.
"""

from __future__ import annotations

import copy
import os
import re
import threading
import time
from pathlib import Path
from typing import BinaryIO

from mla_serve.engine.contract import RankRecord

_CONFIG_MODE = re.compile(r"['\"]cudagraph_mode['\"]: <?(?:CUDAGraphMode\.)?([A-Z_]+)")
_CONFIG_SIZES = re.compile(r"['\"]cudagraph_capture_sizes['\"]: \[([0-9, ]*)\]")
_SETTING = re.compile(r"setting cudagraph_mode=([A-Z_]+)")
_OVERRIDE = re.compile(r"Overriding to (?:CUDAGraphMode\.)?([A-Z_]+)")
_EAGER = "Cudagraph is disabled under eager mode"
_CAPTURED = re.compile(r"Graph capturing finished in ([0-9.]+) secs, took (-?[0-9.]+) GiB")
_WORKER = re.compile(r"\(\w*?Worker\w*?_(?:TP|PP|DP|EP|PCP|DCP)?(\d+)")
# A worker prefix whose message was cut off by another worker's prefix.
_ORPHAN = re.compile(
    r"\(\w*?Worker\w*?_(?:TP|PP|DP|EP|PCP|DCP)?(\d+)\w* pid=\d+\) (?=\(\w*?Worker)"
)
_MAX_ORPHANS = 64


def parse(text: str) -> list[RankRecord]:
    """Per-rank figures found in a vLLM log, as the engine plugin's records."""
    parser = Parser()
    for line in text.splitlines():
        parser.feed(line)
    return parser.result()


class Parser:
    """The log's figures so far, line by line; the last word on each wins."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.sizes: list[int] = []
        self.ranks: dict[int, tuple[float, int]] = {}  # rank -> capture seconds, bytes
        self.orphans: list[int] = []  # ranks whose message is still to come, oldest first

    def feed(self, line: str) -> None:
        if ") (" in line and (cut := _ORPHAN.findall(line)):
            self.orphans = [*self.orphans, *(int(rank) for rank in cut)][-_MAX_ORPHANS:]
        if "udagraph" not in line and "Overriding" not in line and "Graph capturing" not in line:
            return  # most lines: one scan, no regular expression
        if (found := _CONFIG_MODE.search(line)) is not None:
            self.mode = found.group(1)
        if (found := _CONFIG_SIZES.search(line)) is not None:
            self.sizes = [int(s) for s in found.group(1).replace(" ", "").split(",") if s]
        for pattern in (_SETTING, _OVERRIDE):
            if (found := pattern.search(line)) is not None:
                self.mode = found.group(1)
        if _EAGER in line:
            self.mode = "NONE"
        if "Graph capturing" in line and (found := _CAPTURED.search(line)) is not None:
            owners = _WORKER.findall(line[: found.start()])
            # the prefix right before the message, else the oldest orphan's
            orphan = self.orphans.pop(0) if not owners and self.orphans else 0
            rank = int(owners[-1]) if owners else orphan
            self.ranks[rank] = (float(found.group(1)), int(float(found.group(2)) * (1 << 30)))

    def result(self) -> list[RankRecord]:
        if self.mode is None and not self.ranks:
            return []
        sizes = tuple(self.sizes)
        captures: dict[int, tuple[float, int] | None] = {0: None}
        if self.ranks:
            captures = dict(self.ranks)
        return [
            RankRecord(
                rank=rank,
                cudagraph_mode=self.mode,
                cudagraph_capture_sizes=sizes,
                capture_seconds=None if capture is None else capture[0],
                capture_bytes=None if capture is None else capture[1],
            )
            for rank, capture in sorted(captures.items())
        ]


class LogFile:
    """A vLLM log read incrementally: each `refresh` parses only what was appended.

    The file is followed by offset. When it is replaced (rotation: another inode) or
    shrinks (truncation, `copytruncate`), reading starts again at its beginning; figures
    already found are kept until a newer line replaces them. A line longer than
    `max_line` is skipped. Call `refresh` off the event loop: the first read of a large
    log takes a while.
    """

    def __init__(self, path: Path, max_line: int = 1 << 20, chunk: int = 4 << 20) -> None:
        self.path = path
        self.max_line = max_line
        self.chunk = chunk
        self.parser = Parser()
        self.offset = 0
        self.identity: tuple[int, int] | None = None
        self.partial = b""
        self.tail = b""  # the last bytes read, to notice a file rewritten in place
        self.skipping = False  # inside an over-long line
        self.error: str | None = None
        self._lock = threading.Lock()
        self.figures: list[RankRecord] = []

    def unread(self) -> int | None:
        """Bytes appended since the last read (a stat, no read); None when the file is not
        the one read so far (replaced, truncated, missing) or cannot be looked at."""
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        if (stat.st_dev, stat.st_ino) != self.identity or stat.st_size < self.offset:
            return None
        return stat.st_size - self.offset

    def refresh(self) -> list[RankRecord]:
        with self._lock:
            try:
                self._read()
                self.error = None
            except OSError as error:
                self.error = f"{self.path}: {error.strerror or error}"
            parser = self.parser
            if self.partial and not self.skipping:  # a last line without its newline (yet)
                parser = copy.deepcopy(self.parser)
                parser.feed(self.partial.decode("utf-8", errors="replace"))
            self.figures = parser.result()
            return self.figures

    def _read(self) -> None:
        with self.path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            identity = (stat.st_dev, stat.st_ino)
            if identity != self.identity or stat.st_size < self.offset or not self._same(handle):
                self.identity, self.offset, self.partial, self.skipping = identity, 0, b"", False
                self.tail = b""
            handle.seek(self.offset)
            while True:
                data = handle.read(self.chunk)
                if not data:
                    return
                self.offset += len(data)
                self.tail = (self.tail + data[-64:])[-64:]
                self._lines(data)

    def _same(self, handle: BinaryIO) -> bool:
        """The bytes just before the offset are still those read there: not truncated and
        rewritten past the offset between two refreshes."""
        if not self.tail:
            return True
        handle.seek(self.offset - len(self.tail))
        return handle.read(len(self.tail)) == self.tail

    def _lines(self, data: bytes) -> None:
        """Feed the complete lines of `data` that can matter. Lines are found by searching
        the bytes for the parser's keywords (C speed, GIL released to the event loop between
        chunks), not by splitting and scanning every line in Python."""
        cut = data.rfind(b"\n")
        if cut < 0:
            self.partial += data
        else:
            block = self.partial + data[: cut + 1]
            self.partial = data[cut + 1 :]
            start = 0
            if self.skipping:  # the rest of an over-long line
                start = block.find(b"\n") + 1
                self.skipping = False
            for begin, end in _matching_lines(block, start):
                if end - begin <= self.max_line:
                    self.parser.feed(block[begin:end].decode("utf-8", errors="replace"))
        if len(self.partial) > self.max_line:
            self.partial, self.skipping = b"", True
        time.sleep(0)  # let the event loop's thread run


KEYWORDS = (b"udagraph", b"Overriding", b"Graph capturing")  # every line Parser.feed uses


def _matching_lines(block: bytes, start: int) -> list[tuple[int, int]]:
    """(begin, end) of each line of `block` from `start` holding a keyword, in order."""
    found: set[tuple[int, int]] = set()
    for keyword in KEYWORDS:
        at = block.find(keyword, start)
        while at >= 0:
            begin = block.rfind(b"\n", start, at) + 1 or start
            end = block.find(b"\n", at)
            found.add((max(begin, start), end))
            at = block.find(keyword, end)
    return sorted(found)
