"""Apply a release's series to a vLLM tree: all or nothing, verified, recorded.

Order of work, so that a failure never leaves a half-patched tree:
1. plan: every patch of the series is applied in memory, in order. A patch that
   does not apply but reverses cleanly is already present and is skipped; one
   that does neither is a conflict naming the fix, the patch and the file.
2. check: the result must compile, and every fix's probe must pass on it.
3. write: changed files are replaced atomically one by one; if any write
   fails, the files already replaced are restored from memory.
4. record: bytecode of the touched files is refreshed and the manifest written.
"""

from __future__ import annotations

import contextlib
import os
import py_compile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.patching import diff, probes
from server.patching.catalog import Catalog, Fix, Series, Status
from server.patching.tree import VllmTree, sha256


class PatchError(Exception):
    """The series cannot be applied; the tree was left as it was."""


@dataclass(frozen=True)
class FixState:
    """A fix on one tree: the catalog's claim, what apply did, what the probe saw."""

    fix: Fix
    status: Status
    action: str  # applied | already-applied | upstream | not-affected
    probe: probes.ProbeResult


@dataclass
class Plan:
    tree: VllmTree
    release: str
    series: Series
    result: dict[str, str | None] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)  # patch files applied by this plan
    present: list[str] = field(default_factory=list)  # patch files found already applied
    diffs: dict[str, list[diff.FileDiff]] = field(default_factory=dict)  # by patch file

    @property
    def pristine(self) -> dict[str, str | None]:
        """Each touched file as the release shipped it: the series undone, last first."""
        texts = dict(self.result)
        for patch in reversed(self.series.patches):
            for file_diff in self.diffs[patch]:
                texts[file_diff.path] = diff.apply(file_diff.reversed(), texts[file_diff.path])
        return texts

    @property
    def changes(self) -> dict[str, str | None]:
        """Files whose text this plan changes on disk."""
        return {p: text for p, text in self.result.items() if text != self.tree.read(p)}

    def states(self, catalog: Catalog) -> list[FixState]:
        patched_tree = self.tree.with_overlay(self.result)
        states = []
        for fix in catalog.fixes:
            claim = fix.on(self.release)
            if claim.status is Status.PATCHED:
                done = all(p in self.present for p in claim.patches)
                action = "already-applied" if done else "applied"
            else:
                action = claim.status.value
            states.append(FixState(fix, claim.status, action, probes.run(fix.id, patched_tree)))
        return states


def plan(tree: VllmTree, catalog: Catalog) -> Plan:
    """Apply the release's series in memory; raise PatchError naming any conflict."""
    release = catalog.release_of(tree.version)
    result = Plan(tree=tree, release=release, series=catalog.series(release))
    for patch in result.series.patches:
        fix = catalog.fix_of_patch(release, patch)
        try:
            file_diffs = diff.parse(result.series.text(patch))
        except diff.DiffError as error:
            raise PatchError(f"fix {fix.id}: {patch} is not a valid patch: {error}") from None
        result.diffs[patch] = file_diffs
        current = {fd.path: _current(result, fd.path) for fd in file_diffs}
        forward = _try_apply(file_diffs, current)
        if isinstance(forward, dict):
            result.result.update(forward)
            result.applied.append(patch)
            continue
        backward = _try_apply([fd.reversed() for fd in file_diffs], current)
        if isinstance(backward, dict):  # already applied: its reverse is clean
            result.result.update(current)
            result.present.append(patch)
            continue
        raise PatchError(f"fix {fix.id}: {patch} does not apply to {tree.root}: {forward}")
    return result


def _current(plan_: Plan, path: str) -> str | None:
    return plan_.result[path] if path in plan_.result else plan_.tree.read(path)


def _try_apply(
    file_diffs: list[diff.FileDiff], current: dict[str, str | None]
) -> dict[str, str | None] | str:
    """New texts of all files, or the reason the patch does not apply."""
    out: dict[str, str | None] = {}
    for file_diff in file_diffs:
        try:
            out[file_diff.path] = diff.apply(
                file_diff, out.get(file_diff.path, current[file_diff.path])
            )
        except diff.HunkMismatch as error:
            return str(error)
        except FileNotFoundError:
            return f"{file_diff.path}: file missing"
    return out


def check(plan_: Plan, catalog: Catalog) -> list[FixState]:
    """The planned tree must compile and pass every probe; else PatchError."""
    for path, text in plan_.changes.items():
        if text is not None and path.endswith(".py"):
            try:
                compile(text, path, "exec")
            except SyntaxError as error:
                raise PatchError(f"{path} would not compile after patching: {error}") from None
    states = plan_.states(catalog)
    failed = [s for s in states if not s.probe.passed]
    if failed:
        lines = "; ".join(f"fix {s.fix.id} ({s.status.value}): {s.probe.detail}" for s in failed)
        raise PatchError(
            f"vLLM {plan_.tree.version} would still lack fixes after the series: {lines}"
        )
    return states


def write(plan_: Plan) -> list[str]:
    """Replace the changed files atomically; on any failure restore what was replaced."""
    changes = plan_.changes
    originals = {path: plan_.tree.read(path) for path in changes}
    done: list[str] = []
    try:
        for path, text in changes.items():
            _replace(plan_.tree.file(path), text)
            done.append(path)
    except OSError as error:
        for path in reversed(done):
            _replace(plan_.tree.file(path), originals[path])
        raise PatchError(
            f"cannot write {error.filename}: {error.strerror}; tree restored"
        ) from None
    for path in done:
        if path.endswith(".py") and changes[path] is not None:
            _recompile(plan_.tree.file(path))
    return done


def _replace(target: Path, text: str | None) -> None:
    if text is None:
        target.unlink(missing_ok=True)
        return
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _recompile(path: Path) -> None:
    """Refresh the interpreter's cached bytecode so no stale .pyc outlives the edit."""
    # A read-only __pycache__ only costs a recompile at import time.
    with contextlib.suppress(py_compile.PyCompileError, OSError):
        py_compile.compile(str(path), doraise=True)


def touched_files(plan_: Plan) -> list[dict[str, Any]]:
    """Every file the series touches, with its hashes before and after the series."""
    rows: list[dict[str, Any]] = []
    pristine = plan_.pristine
    for path in sorted(plan_.result):
        before, after = pristine[path], plan_.result[path]
        patches = [p for p, diffs in plan_.diffs.items() if any(d.path == path for d in diffs)]
        rows.append(
            {
                "path": path,
                "sha256_before": None if before is None else sha256(before.encode()),
                "sha256_after": None if after is None else sha256(after.encode()),
                "patches": patches,
            }
        )
    return rows
