"""The fix manifest as the engine side reads it: where it lies, its shape, and whether the
files it records still hold the series' result.

`mla_serve.patching.manifest` writes the manifest and verifies a tree against the catalog;
both read it through this module, so the vLLM plugin can check its own process's files
without importing the patch engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILENAME = "mla_serve_manifest.json"
SCHEMA = 1


class ManifestError(Exception):
    """No manifest, or one that cannot be read."""


def read(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}; run `mla-serve patches apply` first") from None
    except (OSError, ValueError, RecursionError) as error:
        reason = getattr(error, "strerror", None) or error
        raise ManifestError(f"cannot read manifest {path}: {reason}") from None
    problem = _shape_problem(document)
    if problem:
        raise ManifestError(f"{path} is not an mla-serve manifest (schema {SCHEMA}): {problem}")
    checked: dict[str, Any] = document
    return checked


def _shape_problem(document: object) -> str | None:
    """What makes a document unusable as a manifest, or None (types, not trust)."""
    required = {"schema", "vllm_version", "release", "series", "fixes", "files"}
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        return f"no schema {SCHEMA}"
    if not required <= document.keys():
        return "missing " + ", ".join(sorted(required - document.keys()))
    if not all(isinstance(document[k], str) for k in ("vllm_version", "release")):
        return "vllm_version and release must be strings"
    series = document["series"]
    if not isinstance(series, dict) or not isinstance(series.get("digest"), str):
        return "series must have a digest"
    if not isinstance(series.get("patches"), list):
        return "series must list its patches"
    fixes, files = document["fixes"], document["files"]
    if not isinstance(fixes, list) or not all(
        isinstance(f, dict) and isinstance(f.get("id"), str) for f in fixes
    ):
        return "fixes must be a list of objects with an id"
    if not isinstance(files, list) or not all(
        isinstance(f, dict)
        and isinstance(f.get("path"), str)
        and isinstance(f.get("sha256_after"), str | None)
        for f in files
    ):
        return "files must be a list of objects with a path and sha256_after"
    for row in files:
        name = row["path"]
        if name.startswith("/") or "\\" in name or ".." in name.split("/"):
            return f"file path {name!r} is not a relative path inside the vLLM tree"
    originals = document.get("originals", {})
    if not isinstance(originals, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in originals.items()
    ):
        return "originals must map file paths to their text"
    return None


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def changed_files(
    document: dict[str, Any], read_file: Callable[[str], bytes | None]
) -> list[tuple[str, str | None, str | None]]:
    """(path, sha256 now or None if missing, sha256 the manifest records) of each file of
    `document` whose bytes, as `read_file(path)` gives them, are not the recorded result."""
    changed = []
    for row in document["files"]:
        data = read_file(row["path"])
        actual = None if data is None else sha256(data)
        if actual != row["sha256_after"]:
            changed.append((row["path"], actual, row["sha256_after"]))
    return changed


def on_disk(root: Path) -> Callable[[str], bytes | None]:
    """A `read_file` for the tree under `root` as it is on disk: None for a file that is
    missing or cannot be read, or whose path leaves `root` (a symbolic link out of it; the
    manifest's shape check has refused absolute and `..` paths already)."""
    base = root.resolve()

    def read_file(relative: str) -> bytes | None:
        path = root / relative
        try:
            if not path.resolve().is_relative_to(base):
                return None
            return path.read_bytes()
        except OSError:
            return None

    return read_file
