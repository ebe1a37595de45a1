"""Crash safety for `apply`: a lock per tree, a journal, atomic writes, signal rollback.

A run that changes a tree goes through one transaction:

1. lock: an exclusive `flock` on the tree's `vllm/` directory, taken without waiting; a
   second `apply` or `repair` on the same tree is refused with a clear error.
2. journal: before the first file is replaced, `vllm/.mla_serve_apply.journal` records
   every file the run will write (tree files and the manifest) with its original bytes
   (or its absence) and its intended bytes; it is written to a temporary file, fsynced
   and renamed into place, and the directory is fsynced.
3. write: each file is replaced atomically (a uniquely named temporary file, fsynced,
   renamed over the target). SIGTERM, SIGINT and SIGHUP during this phase raise
   `Interrupted`, and every file is put back from the journal, as on any error.
4. commit: the journal is removed. Until then, any later `apply` or `repair` finds it and
   restores every file to its original bytes (each file is then either the original or
   the intended text, since every replacement is atomic), so a run killed at any moment,
   SIGKILL included, leaves a tree that the next run repairs byte for byte.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import py_compile
import secrets
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from mla_serve.patching.tree import TreeError, VllmTree, confine

JOURNAL = ".mla_serve_apply.journal"
TEMP_MARK = ".mla-serve-tmp-"  # in every temporary file name, so leftovers can be found
SCHEMA = 1
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class JournalError(Exception):
    """The tree is locked by another run, or an interrupted run cannot be repaired."""


class WriteFailed(Exception):
    """A file could not be written; names the file and the reason."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path
        self.reason = reason


class Interrupted(BaseException):
    """A signal arrived while files were being replaced (BaseException, like Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class Entry:
    """One file the transaction writes: `name` is tree-relative, or absolute outside it."""

    name: str
    before: bytes | None
    after: bytes | None


def path_of(tree: VllmTree, name: str) -> Path:
    return Path(name) if Path(name).is_absolute() else tree.file(name)


def journal_path(tree: VllmTree) -> Path:
    return tree.package / JOURNAL


# ---- lock ---------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(tree: VllmTree) -> Iterator[None]:
    """Hold the tree's lock, or refuse at once when another run holds it."""
    try:
        descriptor = os.open(tree.package, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        raise JournalError(f"cannot open {tree.package} to lock it: {error.strerror}") from None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise JournalError(f"cannot lock {tree.package}: {error.strerror}") from None
            raise JournalError(
                f"another mla-serve run is changing {tree.root} (it holds the lock on "
                f"{tree.package}); wait for it to finish and run the command again"
            ) from None
        yield
    finally:
        os.close(descriptor)  # closing the descriptor releases the lock


# ---- atomic files -------------------------------------------------------------------------


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace(target: Path, data: bytes | None, mode: int | None = None) -> None:
    """Make `target` hold `data` (None: absent) atomically, or raise WriteFailed.

    The bytes go to a temporary file with a unique name in the same directory, are
    fsynced, get the target's permissions, and are renamed over the target (a new
    inode: a hard-linked copy of the target elsewhere keeps its bytes).
    """
    try:
        if data is None:
            target.unlink(missing_ok=True)
            _fsync_directory(target.parent)
            return
        if mode is None:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
        temporary = target.with_name(
            f".{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        )
        try:  # from before the file exists: a signal right after open still removes it
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(descriptor, view) :]
                os.fsync(descriptor)
                os.fchmod(descriptor, mode)
            finally:
                os.close(descriptor)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)
    except OSError as error:
        raise WriteFailed(target, error.strerror or str(error)) from None


def read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError as error:
        raise JournalError(f"cannot read {path}: {error.strerror}") from None


def recompile(path: Path) -> None:
    """Refresh cached bytecode so no stale .pyc outlives an edit (best effort)."""
    if path.suffix == ".py" and path.is_file():
        with contextlib.suppress(py_compile.PyCompileError, OSError):
            py_compile.compile(str(path), doraise=True)


# ---- the journal --------------------------------------------------------------------------


def _encode(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _decode(text: object) -> bytes | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError("file contents must be base64 text")
    return base64.b64decode(text.encode("ascii"), validate=True)


def _digest(entries: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def begin(tree: VllmTree, entries: list[Entry]) -> None:
    """Write the journal durably (fsynced, renamed, directory fsynced) before any file."""
    rows = [
        {"name": e.name, "before": _encode(e.before), "after": _encode(e.after)} for e in entries
    ]
    document = {
        "schema": SCHEMA,
        "tool": "mla-serve",
        "root": str(tree.root),
        "entries": rows,
        "digest": _digest(rows),
    }
    data = (json.dumps(document) + "\n").encode()
    try:
        replace(journal_path(tree), data, mode=0o644)
    except WriteFailed as error:
        raise JournalError(f"{error}; nothing was changed") from None


def end(tree: VllmTree) -> None:
    """The commit point: once the journal is gone, the run is complete."""
    replace(journal_path(tree), None)


def load(tree: VllmTree, manifest: Path | None) -> list[Entry] | None:
    """The entries of an interrupted run's journal, or None when there is none.

    Tree files must stay inside the tree; the one file allowed outside it is the
    manifest this command was given (a journal cannot name any other outside file).
    """
    path = journal_path(tree)
    raw = read_bytes(path)
    if raw is None:
        return None
    damaged = f"the journal {path} of an interrupted apply is damaged"
    try:
        document = json.loads(raw)
        rows = document["entries"]
        if document.get("schema") != SCHEMA or _digest(rows) != document["digest"]:
            raise ValueError("digest or schema mismatch")
        entries = [Entry(str(r["name"]), _decode(r["before"]), _decode(r["after"])) for r in rows]
    except (ValueError, KeyError, TypeError) as error:
        raise JournalError(f"{damaged} ({error}); restore the tree from its wheel") from None
    for entry in entries:
        if not Path(entry.name).is_absolute():
            try:
                confine(tree.root, entry.name)
            except TreeError as error:
                raise JournalError(f"{damaged}: {error}") from None
        elif manifest is None or Path(entry.name) != manifest.absolute():
            raise JournalError(
                f"the journal {path} restores {entry.name}, outside the tree: run again "
                f"with --manifest {entry.name} if that is the manifest the interrupted apply wrote"
            )
    return entries


def roll_back(tree: VllmTree, entries: list[Entry]) -> list[str]:
    """Put every journaled file back to its original bytes, then drop the journal.

    All files are checked before any is written: each must hold either its original or
    its intended bytes, else nothing is touched and the journal is kept. Returns the
    names of the files restored. Safe to repeat after a crash in the middle.
    """
    current = {e.name: read_bytes(path_of(tree, e.name)) for e in entries}
    foreign = [e.name for e in entries if current[e.name] not in (e.before, e.after)]
    if foreign:
        raise JournalError(
            f"{', '.join(foreign)} changed since the interrupted apply (neither the original "
            f"nor the patched bytes); nothing restored, journal kept at {journal_path(tree)}"
        )
    restored = []
    for entry in reversed(entries):
        if current[entry.name] != entry.before:
            replace(path_of(tree, entry.name), entry.before)
            restored.append(entry.name)
    for name in restored:
        recompile(path_of(tree, name))
    end(tree)
    return restored


def clean_temporaries(tree: VllmTree, names: list[str]) -> int:
    """Remove temporary files a killed run left (under the lock: none is in use)."""
    directories = {tree.package} | {path_of(tree, n).parent for n in names}
    removed = 0
    for directory in directories:
        with contextlib.suppress(OSError):
            for child in directory.iterdir():
                if TEMP_MARK in child.name and child.name.startswith(".") and child.is_file():
                    child.unlink()
                    removed += 1
    return removed


def recover(tree: VllmTree, manifest: Path | None, names: list[str]) -> list[str] | None:
    """Under the lock: undo an interrupted run if its journal is there; clean leftovers.

    `names` are further files whose directories may hold leftover temporaries (the series'
    files). Returns the files restored, or None when no run had been interrupted.
    """
    entries = load(tree, manifest)
    restored = None
    if entries is not None:
        restored = roll_back(tree, entries)
    clean_temporaries(tree, names + [e.name for e in entries or []])
    return restored


# ---- signals ------------------------------------------------------------------------------


class SignalGuard:
    """While armed, SIGTERM/SIGINT/SIGHUP raise `Interrupted` once; later ones are noted.

    The handler disarms itself when it raises, so the rollback that follows cannot be
    interrupted by a second signal. Outside the main thread no handler can be set, and
    the guard does nothing (a signal then ends the process; the journal still repairs).
    """

    def __init__(self) -> None:
        self.armed = False
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self.armed:
            self.armed = False
            raise Interrupted(signum)

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        self.armed = True
        return self

    def disarm(self) -> None:
        self.armed = False

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self.received is not None and self._previous and exc[0] is None:
            # It arrived once the files were complete: deliver it as if we had not caught it.
            os.kill(os.getpid(), self.received)
