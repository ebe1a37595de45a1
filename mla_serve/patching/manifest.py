"""The record of what `apply` did to a tree, and the check that it still holds.

The manifest is the single source the image labels, the sidecar's
`mla_serve_fix_info` and the engine plugin read. It carries no timestamp, so
applying to an already-patched tree rewrites it byte for byte identical.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_serve import __version__
from mla_serve.engine import manifest as recorded

# Read as the engine side reads it; re-exported, the patch engine's manifest API is here whole.
from mla_serve.engine.manifest import FILENAME as FILENAME
from mla_serve.engine.manifest import SCHEMA as SCHEMA
from mla_serve.engine.manifest import ManifestError as ManifestError
from mla_serve.engine.manifest import read as read
from mla_serve.patching import diff, engine, journal, probes
from mla_serve.patching.catalog import Catalog, CatalogError, Status
from mla_serve.patching.tree import VllmTree, sha256


def default_path(tree: VllmTree) -> Path:
    """Inside the vllm package, so it travels with the tree it describes."""
    return tree.package / FILENAME


def build(plan: engine.Plan, states: list[engine.FixState]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "tool": "mla-serve",
        "tool_version": __version__,
        "vllm_version": plan.tree.version,
        "vllm_commit": plan.tree.commit,
        "release": plan.release,
        "series": {
            "directory": f"vllm-{plan.release}",
            "patches": list(plan.series.patches),
            "digest": plan.series.digest,
        },
        "fixes": [
            {
                "id": s.fix.id,
                "title": s.fix.title,
                "status": s.status.value,
                "reason": s.fix.on(plan.release).reason,
                "patches": list(s.fix.on(plan.release).patches),
                "probe": s.probe.word,
                "probe_detail": s.probe.detail,
            }
            for s in states
        ],
        "files": engine.touched_files(plan),
        # Each touched file as the release shipped it, for `repair` to restore the series'
        # content of a file changed since (last: the record above stays readable first).
        "originals": {
            path: text for path, text in sorted(plan.pristine.items()) if text is not None
        },
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


def write(path: Path, document: dict[str, Any]) -> None:
    """Write the manifest atomically (unique temporary name, fsynced); ManifestError if not."""
    text = render(document)
    try:
        if path.is_file() and path.read_bytes() == text.encode():
            return  # unchanged: leave the file (and its mtime) alone
        journal.replace(path, text.encode())
    except (OSError, journal.WriteFailed) as error:
        raise ManifestError(str(error)) from None


@dataclass(frozen=True)
class Drift:
    what: str
    detail: str


def changed_files(
    tree: VllmTree, document: dict[str, Any]
) -> list[tuple[str, str | None, str | None]]:
    """(path, sha256 now or None if missing, sha256 the manifest records) of each changed
    file, the tree read through its overlay."""

    def read_file(relative: str) -> bytes | None:
        text = tree.read(relative)
        return None if text is None else text.encode()

    return recorded.changed_files(document, read_file)


def drifted(
    tree: VllmTree, path: Path, *, reverted: bool = True
) -> tuple[dict[str, Any] | None, list[Drift]]:
    """The manifest at `path` and the files of the tree that differ from the series' result
    it records; with `reverted` False, only those that are not the release's original
    either (edited: `apply` would record them as the series' result, so it refuses them,
    while an original, e.g. after vLLM was reinstalled, only needs the series again).

    (None, []) when there is no manifest, or when it is one of another vLLM version (a
    stale record: that vLLM was replaced, and `apply` writes this one's). A manifest that
    cannot be read is a ManifestError: what it records cannot be told.
    """
    if not path.is_file():
        return None, []
    document = read(path)
    if document["vllm_version"] != tree.version:
        return None, []
    before = {row["path"]: row.get("sha256_before") for row in document["files"]}
    drifts = [
        drift
        for drift, actual in _file_drifts(tree, document)
        if reverted or actual != before[drift.what]
    ]
    return document, drifts


def _file_drifts(tree: VllmTree, document: dict[str, Any]) -> list[tuple[Drift, str | None]]:
    """Each file that differs from the manifest's sha256_after, with its sha256 now."""
    drifts = []
    before = {row["path"]: row.get("sha256_before") for row in document["files"]}
    for path, actual, expected in changed_files(tree, document):
        state = "missing" if actual is None else f"sha256 {actual[:12]}…"
        if actual is not None and actual == before[path]:
            state += " (the release's original)"
        drifts.append((Drift(path, f"{state}, manifest says {str(expected)[:12]}…"), actual))
    return drifts


def originals(tree: VllmTree, document: dict[str, Any], catalog: Catalog) -> dict[str, str | None]:
    """Each file the manifest lists that the series touches, as the release shipped it
    (None: it had no such file).

    Taken from the manifest's `originals`, or else recomputed by undoing the series on the
    file as it is now; either must hash to the manifest's `sha256_before`. A ManifestError
    names the files for which neither does (a changed file of a manifest without originals).
    """
    series = catalog.series(catalog.release_of(tree.version))
    diffs = []
    for patch in series.patches:
        try:
            diffs += diff.parse(series.text(patch))
        except diff.DiffError:
            continue  # plan() refuses it, naming the fix
    recorded = document.get("originals", {})
    touched = {file_diff.path for file_diff in diffs}
    found: dict[str, str | None] = {}
    lost = []
    for row in document["files"]:
        name, before = row["path"], row.get("sha256_before")
        if name not in touched:
            continue  # no longer in the series (verify reports it): the plan does not need it
        if before is None:
            found[name] = None
            continue
        candidates = [recorded.get(name), _undone(tree.read(name), name, diffs)]
        text = next((c for c in candidates if c is not None and sha256(c.encode()) == before), None)
        if text is None:
            lost.append(name)
        found[name] = text
    if lost:
        raise ManifestError(
            f"cannot restore {', '.join(lost)}: the manifest records no original and undoing "
            f"the series does not give one; reinstall vLLM {tree.version} (pip install "
            f"--force-reinstall --no-deps vllm=={tree.version}), then run `mla-serve patches "
            "apply`"
        )
    return found


def _undone(text: str | None, name: str, diffs: list[diff.FileDiff]) -> str | None:
    """`text` with each of the series' changes to `name` undone where it is there, last first."""
    for file_diff in reversed([d for d in diffs if d.path == name]):
        try:
            text = diff.apply(file_diff.reversed(), text)
        except (diff.HunkMismatch, FileNotFoundError):
            continue  # not there (or changed): the hash of the result decides
    return text


def verify(tree: VllmTree, document: dict[str, Any], catalog: Catalog) -> list[Drift]:
    """Everything that no longer matches; empty only when the tree is intact.

    The manifest is not trusted: it must agree with this mla-serve's catalog for the
    tree's release (series digest and patches, every fix with its status and patches,
    exactly the files the series touches), the series must be present in the tree,
    every touched file must hash as recorded, and every fix's probe must pass (fail, for a
    fix the release is `affected` by: it has the bug and mla-serve no backport).
    """
    drifts: list[Drift] = []
    pending = journal.journal_path(tree)
    if pending.exists():
        drifts.append(
            Drift(
                "journal", f"an apply was interrupted ({pending}); run `mla-serve patches repair`"
            )
        )
    if document["vllm_version"] != tree.version:
        drifts.append(
            Drift(
                "version",
                f"manifest is for vLLM {document['vllm_version']}, tree is {tree.version}",
            )
        )
        return drifts
    release = catalog.release_of(tree.version)
    if document["release"] != release:
        drifts.append(Drift("release", f"manifest says {document['release']}, tree is {release}"))
    series = catalog.series(release)
    if series.digest != document["series"]["digest"]:
        drifts.append(
            Drift(
                "series",
                f"this mla-serve carries a different series for {release}; run apply again",
            )
        )
    if list(document["series"]["patches"]) != list(series.patches):
        drifts.append(
            Drift(
                "series",
                f"manifest lists patches {document['series']['patches']}, "
                f"the series for {release} has {list(series.patches)}",
            )
        )
    drifts += _fix_drifts(tree, document, catalog, release)
    drifts += _series_drifts(tree, document, catalog)
    return drifts + [drift for drift, _ in _file_drifts(tree, document)]


def _fix_drifts(
    tree: VllmTree, document: dict[str, Any], catalog: Catalog, release: str
) -> list[Drift]:
    """Each catalog fix must be listed with the catalog's status, and its probe must pass."""
    drifts = []
    listed = {row["id"]: row for row in document["fixes"]}
    for fix in catalog.fixes:
        claim = fix.on(release)
        row = listed.get(fix.id)
        if row is None:
            drifts.append(
                Drift(fix.id, f"not in the manifest; the catalog says {claim.status.value}")
            )
        elif row.get("status") != claim.status.value:
            drifts.append(
                Drift(
                    fix.id,
                    f"manifest says {row.get('status')}, the catalog says {claim.status.value} "
                    f"for {release}",
                )
            )
        elif list(row.get("patches") or []) != list(claim.patches):
            drifts.append(Drift(fix.id, f"manifest lists other patches than {list(claim.patches)}"))
        result = probes.run(fix.id, tree)
        if probes.proves(claim, result):
            pass
        elif claim.status is Status.AFFECTED:
            drifts.append(
                Drift(fix.id, f"probe passes, but the catalog says {release} is affected")
            )
        else:
            drifts.append(Drift(fix.id, f"probe fails: {result.detail}"))
    for fix_id in sorted(set(listed) - {f.id for f in catalog.fixes}):
        drifts.append(Drift(fix_id, "fix unknown to this mla-serve; run apply again"))
    return drifts


def _series_drifts(tree: VllmTree, document: dict[str, Any], catalog: Catalog) -> list[Drift]:
    """The series must be present in the tree, and the manifest must list its files."""
    try:
        plan = engine.plan(tree, catalog)
    except engine.PatchError as error:
        return [Drift("series", f"not present in the tree: {error}")]
    except CatalogError as error:
        return [Drift("series", str(error))]
    drifts = []
    if plan.applied:
        drifts.append(
            Drift("series", f"patches not applied to the tree: {', '.join(plan.applied)}")
        )
    touched = set(plan.result)
    recorded = {row["path"] for row in document["files"]}
    for path in sorted(touched - recorded):
        drifts.append(Drift(path, "the series changes this file but the manifest omits it"))
    for path in sorted(recorded - touched):
        drifts.append(Drift(path, "the manifest lists this file but the series does not touch it"))
    return drifts
