"""Unified diffs, parsed and applied in memory with zero fuzz.

Why not `patch` or `git apply`: the engine must check a whole series against the
tree before writing a single byte, including patches that touch the same file one
after another, and must work inside a container image that has neither tool.
Applying to in-memory text gives exactly that. A hunk may move (its context found
at another line, as `git apply` allows), but every context and removed line must
match byte for byte: there is no fuzz.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffError(Exception):
    """A patch file that cannot be parsed."""


class HunkMismatch(Exception):
    """A hunk whose lines are not found in the file: a conflict."""

    def __init__(self, path: str, hunk_index: int, line: int) -> None:
        super().__init__(f"{path}: hunk #{hunk_index + 1} (at line {line}) does not match")
        self.path = path
        self.hunk_index = hunk_index


@dataclass(frozen=True)
class Hunk:
    """One `@@` block: the lines it expects (`old`) and the lines it leaves (`new`)."""

    old_start: int
    old: tuple[str, ...]
    new: tuple[str, ...]

    def reversed(self) -> Hunk:
        return Hunk(self.old_start, self.new, self.old)


@dataclass(frozen=True)
class FileDiff:
    """The hunks of one file, addressed by its path relative to the tree root."""

    path: str
    hunks: tuple[Hunk, ...]
    creates: bool = False
    deletes: bool = False

    def reversed(self) -> FileDiff:
        return FileDiff(
            self.path,
            tuple(h.reversed() for h in self.hunks),
            creates=self.deletes,
            deletes=self.creates,
        )


@dataclass
class _Builder:
    path: str = ""
    creates: bool = False
    deletes: bool = False
    hunks: list[Hunk] = field(default_factory=list)


def _strip_prefix(name: str) -> str:
    name = name.split("\t", 1)[0].strip()
    if name == "/dev/null":
        return name
    return name[2:] if name[:2] in ("a/", "b/") else name


def parse(text: str) -> list[FileDiff]:
    """Parse a unified diff (git or plain `diff -u` style); headers before it are ignored."""
    lines = text.splitlines(keepends=True)
    files: list[FileDiff] = []
    current: _Builder | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if current is not None:
                files.append(_finish(current))
            old_name = _strip_prefix(line[4:])
            new_name = _strip_prefix(lines[i + 1][4:])
            current = _Builder(
                path=old_name if new_name == "/dev/null" else new_name,
                creates=old_name == "/dev/null",
                deletes=new_name == "/dev/null",
            )
            i += 2
            continue
        match = _HUNK_HEADER.match(line)
        if match:
            if current is None:
                raise DiffError(f"line {i + 1}: hunk before any file header")
            hunk, i = _read_hunk(lines, i + 1, match)
            current.hunks.append(hunk)
            continue
        i += 1
    if current is not None:
        files.append(_finish(current))
    if not files:
        raise DiffError("no file changes found")
    return files


def _finish(builder: _Builder) -> FileDiff:
    if not builder.hunks:
        raise DiffError(f"{builder.path}: file header without hunks")
    return FileDiff(builder.path, tuple(builder.hunks), builder.creates, builder.deletes)


def _read_hunk(lines: list[str], i: int, match: re.Match[str]) -> tuple[Hunk, int]:
    old_len = int(match.group(2)) if match.group(2) is not None else 1
    new_len = int(match.group(4)) if match.group(4) is not None else 1
    old: list[str] = []
    new: list[str] = []
    while len(old) < old_len or len(new) < new_len:
        if i >= len(lines):
            raise DiffError(f"hunk at line {match.group(0)} ends early")
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line.startswith("\\"):
            i += 1
            continue
        if tag == " ":
            old.append(body)
            new.append(body)
        elif tag == "-":
            old.append(body)
        elif tag == "+":
            new.append(body)
        elif line in ("\n", "\r\n"):  # an editor stripped the context's leading space
            old.append(line)
            new.append(line)
        else:
            raise DiffError(f"unexpected line in hunk: {line!r}")
        i += 1
    # "\ No newline at end of file" applies to the line just read.
    while i < len(lines) and lines[i].startswith("\\"):
        _drop_trailing_newline(old if lines[i - 1][:1] in " -" else new)
        if lines[i - 1][:1] == " ":
            _drop_trailing_newline(new)
        i += 1
    start = int(match.group(1))
    return Hunk(start, tuple(old), tuple(new)), i


def _drop_trailing_newline(side: list[str]) -> None:
    if side and side[-1].endswith("\n"):
        side[-1] = side[-1][:-1]


def apply(file_diff: FileDiff, original: str | None) -> str | None:
    """Return the file's new text, or raise HunkMismatch; `None` means absent."""
    if file_diff.creates:
        if original is not None:
            raise HunkMismatch(file_diff.path, 0, 0)
        return "".join(file_diff.hunks[0].new)
    if original is None:
        raise FileNotFoundError(file_diff.path)
    lines = original.splitlines(keepends=True)
    offset = 0
    floor = 0  # hunks apply in order and may not overlap
    for index, hunk in enumerate(file_diff.hunks):
        expected = max(hunk.old_start - 1 + offset, 0) if hunk.old else hunk.old_start + offset
        at = _find(lines, hunk.old, expected, floor)
        if at is None:
            raise HunkMismatch(file_diff.path, index, hunk.old_start)
        lines[at : at + len(hunk.old)] = list(hunk.new)
        floor = at + len(hunk.new)
        # Later hunks' line numbers assume earlier ones landed where they said.
        offset = at - (hunk.old_start - 1) + len(hunk.new) - len(hunk.old)
    if file_diff.deletes:
        if lines:
            raise HunkMismatch(file_diff.path, len(file_diff.hunks) - 1, 0)
        return None
    return "".join(lines)


def _find(lines: list[str], block: tuple[str, ...], expected: int, floor: int) -> int | None:
    """The start of `block` in `lines` nearest to `expected`, at or after `floor`."""
    size = len(block)
    last = len(lines) - size
    if last < floor:
        return None
    expected = min(max(expected, floor), last)
    for distance in range(0, max(expected - floor, last - expected) + 1):
        for at in (expected - distance, expected + distance):
            if floor <= at <= last and tuple(lines[at : at + size]) == block:
                return at
    return None
