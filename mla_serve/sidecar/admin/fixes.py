"""The image's fix manifest, re-verified against the vLLM the engine imports.

A full verification (hashes, series, every fix's probe: the probes parse vLLM's source,
about 0.1-0.2 s of CPU) runs on the first check, whenever one of the files it read has
changed on disk since the last one that verified (inode, size, mtime or ctime: any write or
replacement changes one), after a check that did not verify, and on every `FULL_EVERY`th
check regardless. The checks in between stat those files only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mla_serve.patching import catalog, journal, manifest, tree

FULL_EVERY = 10  # a full verification at least every this many checks (10 min at 60 s)

Stamp = tuple[int, int, int, int] | None  # (inode, size, mtime ns, ctime ns); None: missing


@dataclass(frozen=True)
class FixReport:
    path: Path | None
    checked_at: float | None = None
    verified: bool | None = None  # None: no manifest configured, or it cannot be checked
    error: str | None = None
    drift: tuple[str, ...] = ()
    document: dict[str, Any] = field(default_factory=dict)
    verified_at: float | None = None  # the last full verification (checked_at: the last check)
    watched: tuple[tuple[str, Stamp], ...] = ()  # the files it read, as it found them
    reused: int = 0  # checks since the full verification that found them unchanged

    @property
    def fixes(self) -> list[dict[str, Any]]:
        return list(self.document.get("fixes", []))

    @property
    def vllm_version(self) -> str | None:
        return self.document.get("vllm_version")


def failed(path: Path | None, error: BaseException) -> FixReport:
    """The report when verification itself went wrong: not verified (fail closed)."""
    reason = f"verification failed: {type(error).__name__}: {error}"
    return FixReport(path=path, checked_at=time.time(), verified=False, error=reason)


def check(
    path: Path | None,
    vllm_tree: Path | None = None,
    previous: FixReport | None = None,
    full_every: int = FULL_EVERY,
) -> FixReport:
    """Read and verify the manifest against `vllm_tree` (default: installed); never raises.

    A manifest that cannot be verified here, or a verification that raises (a probe
    failing on drifted code), reports `verified=False` with the reason. With `previous`
    (the last report), a verified one is kept when none of the files it read has changed
    (see the module's docstring)."""
    try:
        if previous is not None and _unchanged(previous, path, full_every):
            return replace(previous, checked_at=time.time(), reused=previous.reused + 1)
        return _check(path, vllm_tree)
    except Exception as error:
        return failed(path, error)


def _stamp(path: Path) -> Stamp:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return (found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


def _unchanged(previous: FixReport, path: Path | None, full_every: int) -> bool:
    if previous.verified is not True or previous.path != path or not previous.watched:
        return False
    if previous.reused + 1 >= full_every:
        return False
    try:
        return all(_stamp(Path(name)) == stamp for name, stamp in previous.watched)
    except OSError:  # cannot stat one: verify in full, which says why
        return False


def _watched(path: Path, found: tree.VllmTree) -> tuple[tuple[str, Stamp], ...]:
    """The manifest, the tree's release file, its journal, and every tree file read."""
    files = [path, found.package / "_version.py", journal.journal_path(found)]
    files += [tree.confine(found.root, relative) for relative in sorted(found.touched)]
    return tuple((str(file), _stamp(file)) for file in files)


def _check(path: Path | None, vllm_tree: Path | None) -> FixReport:
    if path is None:
        return FixReport(path=None, error="no manifest configured (--manifest)")
    now = time.time()
    try:
        document = manifest.read(path)
    except manifest.ManifestError as error:
        return FixReport(path=path, checked_at=now, verified=False, error=str(error))
    try:
        found = tree.locate(vllm_tree)
        started = time.time_ns()
        drifts = manifest.verify(found, document, catalog.load())
    except (tree.TreeError, catalog.CatalogError) as error:
        return FixReport(path, now, False, f"cannot verify here: {error}", (), document)
    watched = _watched(path, found)
    # A file changed during the verification (or within a coarse timestamp's second before
    # it) may have been read in its old state: then the next check verifies in full again.
    racy = any(s is not None and s[3] >= started - 1_000_000_000 for _, s in watched)
    return FixReport(
        path=path,
        checked_at=now,
        verified=not drifts,
        error=None if not drifts else f"{len(drifts)} difference(s) from the manifest",
        drift=tuple(f"{d.what}: {d.detail}" for d in drifts),
        document=document,
        verified_at=now,
        watched=() if racy else watched,
    )
