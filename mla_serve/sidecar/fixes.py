"""The image's fix manifest, re-verified against the vLLM the engine imports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_serve.patching import catalog, manifest, tree


@dataclass(frozen=True)
class FixReport:
    path: Path | None
    checked_at: float | None = None
    verified: bool | None = None  # None: no manifest configured, or it cannot be checked
    error: str | None = None
    drift: tuple[str, ...] = ()
    document: dict[str, Any] = field(default_factory=dict)

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


def check(path: Path | None, vllm_tree: Path | None = None) -> FixReport:
    """Read and verify the manifest against `vllm_tree` (default: installed); never raises.

    A manifest that cannot be verified here, or a verification that raises (a probe
    failing on drifted code), reports `verified=False` with the reason."""
    try:
        return _check(path, vllm_tree)
    except Exception as error:
        return failed(path, error)


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
        drifts = manifest.verify(found, document, catalog.load())
    except (tree.TreeError, catalog.CatalogError) as error:
        return FixReport(path, now, False, f"cannot verify here: {error}", (), document)
    return FixReport(
        path=path,
        checked_at=now,
        verified=not drifts,
        error=None if not drifts else f"{len(drifts)} difference(s) from the manifest",
        drift=tuple(f"{d.what}: {d.detail}" for d in drifts),
        document=document,
    )
