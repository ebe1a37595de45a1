"""Apply a release's series to a vLLM tree: all or nothing, verified, recorded.

Order of work, so that a failure never leaves a half-patched tree:
1. plan: every patch of the series is applied in memory, in order. A patch that
   does not apply but reverses cleanly is already present and is skipped; one
   that does neither is a conflict naming the fix, the patch and the file.
2. check: the result must compile, and every fix's probe must pass on it.
3. write: a journal of every file's original and intended bytes is written and
   fsynced, then the files and the manifest are replaced atomically; an error or a
   signal restores them, and a run killed outright is undone by the next `apply`
   or `repair` from the journal (mla_serve/patching/journal.py).
4. record: bytecode of the touched files is refreshed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_serve.patching import diff, journal, probes
from mla_serve.patching.catalog import Catalog, Fix, Series, Status
from mla_serve.patching.tree import TreeError, VllmTree, sha256


class PatchError(Exception):
    """The series cannot be applied; the tree was left as it was."""


@dataclass(frozen=True)
class FixState:
    """A fix on one tree: the catalog's claim, what apply did, what the probe saw."""

    fix: Fix
    status: Status
    action: str  # applied | already-applied | upstream | not-affected | affected
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


def plan(
    tree: VllmTree, catalog: Catalog, originals: Mapping[str, str | None] | None = None
) -> Plan:
    """Apply the release's series in memory; raise PatchError naming any conflict.

    `originals` (for `repair`): files as the release shipped them, taken in place of their
    text on disk, so that the series is applied to them afresh; the plan's changes are then
    what it takes to turn the files on disk into the series' result.
    """
    release = catalog.release_of(tree.version)
    source = tree if originals is None else tree.with_overlay(originals)
    result = Plan(tree=source, release=release, series=catalog.series(release))
    for patch in result.series.patches:
        fix = catalog.fix_of_patch(release, patch)
        try:
            file_diffs = diff.parse(result.series.text(patch))
        except diff.DiffError as error:
            raise PatchError(f"fix {fix.id}: {patch} is not a valid patch: {error}") from None
        for file_diff in file_diffs:
            try:
                tree.file(file_diff.path)
            except TreeError as error:
                raise TreeError(f"fix {fix.id}: {patch} refused: {error}") from None
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
    result.tree = tree  # changes, states and the journal compare with the files on disk
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
    unproven = [s for s in states if not probes.proves(s.fix.on(plan_.release), s.probe)]
    failed = [s for s in unproven if s.status is not Status.AFFECTED]
    if failed:
        lines = "; ".join(f"fix {s.fix.id} ({s.status.value}): {s.probe.detail}" for s in failed)
        raise PatchError(
            f"vLLM {plan_.tree.version} would still lack fixes after the series: {lines}"
        )
    contradicted = [s for s in unproven if s.status is Status.AFFECTED]
    if contradicted:
        lines = "; ".join(f"fix {s.fix.id}: {s.probe.detail}" for s in contradicted)
        raise PatchError(
            f"the catalog says vLLM {plan_.release} has these bugs (no backport), but the "
            f"probes find them fixed: {lines}"
        )
    return states


def write(plan_: Plan, manifest: tuple[Path, str] | None = None) -> list[str]:
    """Replace the changed files (and write the manifest) as one crash-safe transaction.

    The journal (mla_serve/patching/journal.py) is written before the first file, so a run
    killed at any moment is undone by the next `apply` or `repair`. An error or a signal
    (SIGTERM, SIGINT, SIGHUP) while writing restores every file and raises PatchError.
    The caller holds the tree's lock. Returns the tree files changed.
    """
    tree = plan_.tree
    changes = plan_.changes  # computed once: it compares with the disk
    entries = [
        journal.Entry(path, _bytes(tree.read(path)), _bytes(text)) for path, text in changes.items()
    ]
    if manifest is not None:
        target, text = manifest
        name = _manifest_name(tree, target)
        before = journal.read_bytes(target)
        if before != text.encode():
            entries.append(journal.Entry(name, before, text.encode()))
    if not entries:
        return []
    with journal.SignalGuard() as guard:
        try:
            journal.begin(tree, entries)
            for entry in entries:
                target_path = journal.path_of(tree, entry.name)
                if entry.name in changes:
                    _replace(target_path, changes[entry.name])
                else:
                    journal.replace(target_path, entry.after)
            guard.disarm()
            journal.end(tree)
        except (journal.Interrupted, journal.WriteFailed, OSError) as error:
            guard.disarm()
            raise PatchError(_rolled_back(tree, entries, error)) from None
    done = [e.name for e in entries if e.name in changes]
    for path in done:
        if path.endswith(".py") and changes[path] is not None:
            journal.recompile(tree.file(path))
    return done


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8")


def _manifest_name(tree: VllmTree, target: Path) -> str:
    """The manifest's name in the journal: tree-relative inside the tree, else absolute."""
    absolute = target.absolute()
    if target.is_symlink():  # the image links vllm/mla_serve_manifest.json to /opt/mla-serve
        return str(absolute)
    try:
        return absolute.relative_to(tree.root).as_posix()
    except ValueError:
        return str(absolute)


def _rolled_back(tree: VllmTree, entries: list[journal.Entry], error: BaseException) -> str:
    """Undo the transaction; the one-line message for the error that stopped it."""
    if isinstance(error, journal.Interrupted):
        cause = f"interrupted by {error}"
    elif isinstance(error, journal.WriteFailed):
        cause = str(error)
    else:
        assert isinstance(error, OSError)
        cause = f"cannot write {error.filename or 'a file'}: {error.strerror or error}"
    try:
        journal.roll_back(tree, entries)
    except (journal.JournalError, journal.WriteFailed) as undo:
        return (
            f"{cause}; restoring the tree failed too ({undo}): the journal keeps the "
            "originals, run `mla-serve patches repair` once the cause is fixed"
        )
    return f"{cause}; tree restored"


def _replace(target: Path, text: str | None) -> None:
    journal.replace(target, _bytes(text))


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
