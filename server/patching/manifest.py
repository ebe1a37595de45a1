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

from server import __version__
from server.patching import engine, probes
from server.patching.catalog import Catalog
from server.patching.tree import VllmTree, sha256

FILENAME = "mla_serve_manifest.json"
SCHEMA = 1


class ManifestError(Exception):
    """No manifest, or one that cannot be read."""


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
    }


def write(path: Path, document: dict[str, Any]) -> None:
    text = json.dumps(document, indent=2, sort_keys=False) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return  # unchanged: leave the file (and its mtime) alone
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


def read(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}; run `mla-serve patches apply` first") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ManifestError(f"cannot read manifest {path}: {error}") from None
    required = {"schema", "vllm_version", "release", "series", "fixes", "files"}
    if (
        not isinstance(document, dict)
        or document.get("schema") != SCHEMA
        or not (required <= document.keys())
    ):
        raise ManifestError(f"{path} is not an mla-serve manifest (schema {SCHEMA})")
    return document


@dataclass(frozen=True)
class Drift:
    what: str
    detail: str


def changed_files(
    tree: VllmTree, document: dict[str, Any]
) -> list[tuple[str, str | None, str | None]]:
    """(path, sha256 now or None if missing, sha256 the manifest records) of each changed file."""
    changed = []
    for row in document["files"]:
        text = tree.read(row["path"])
        actual = None if text is None else sha256(text.encode())
        if actual != row["sha256_after"]:
            changed.append((row["path"], actual, row["sha256_after"]))
    return changed


def verify(tree: VllmTree, document: dict[str, Any], catalog: Catalog) -> list[Drift]:
    """Everything that no longer matches the manifest; empty when the tree is intact."""
    drifts: list[Drift] = []
    if document["vllm_version"] != tree.version:
        drifts.append(
            Drift(
                "version",
                f"manifest is for vLLM {document['vllm_version']}, tree is {tree.version}",
            )
        )
        return drifts
    series = catalog.series(document["release"])
    if series.digest != document["series"]["digest"]:
        drifts.append(
            Drift(
                "series",
                "this mla-serve carries a different series for "
                f"{document['release']}; run apply again",
            )
        )
    for path, actual, expected in changed_files(tree, document):
        state = "missing" if actual is None else f"sha256 {actual[:12]}…"
        drifts.append(Drift(path, f"{state}, manifest says {str(expected)[:12]}…"))
    for fix in document["fixes"]:
        if fix["id"] not in probes.PROBES:
            drifts.append(Drift(fix["id"], "fix unknown to this mla-serve; run apply again"))
            continue
        result = probes.run(fix["id"], tree)
        if not result.passed:
            drifts.append(Drift(fix["id"], f"probe fails: {result.detail}"))
    return drifts
