"""Pristine vLLM release trees for tests, unpacked once from the real wheels.

Wheels are cached in .cache/wheels and trees in .cache/trees (both git-ignored),
so only the first run downloads (about 0.3 GB per release of the catalog).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mla_serve.patching import catalog, engine, manifest, tree, wheel

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MLA_SERVE_CACHE", ROOT / ".cache"))
RELEASES = catalog.load().releases
DEFAULT_RELEASE = catalog.load().default
# The releases mla-serve patches (a backport of some fix), oldest first.
PATCHED_RELEASES = tuple(r for r in RELEASES if catalog.load().series(r).patches)


def pristine(release: str) -> Path:
    """The unpacked Python tree of `release`; never modify it (copy with `clone`)."""
    tree = CACHE / "trees" / release
    if not (tree / "vllm" / "__init__.py").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        wheel_path = wheel.fetch(release, CACHE / "wheels")
        wheel.unpack(wheel_path, tree, python_only=True)
    return tree


def clone(release: str, dest: Path) -> Path:
    """A private copy of a pristine tree: hard links, cheap and safe.

    Safe because the engine replaces files (new inodes) instead of writing into
    them; a test that edits a file in place must unlink it first (see `edit`).
    """
    shutil.copytree(pristine(release), dest, copy_function=os.link)
    return dest


def edit(path: Path, text: str) -> None:
    """Change a file of a cloned tree without touching the shared pristine copy."""
    path.unlink()
    path.write_text(text, encoding="utf-8")


def patched(release: str, dest: Path, manifest_path: Path) -> Path:
    """A clone of `release` at `dest` with its fix series applied in-process, its manifest
    written to `manifest_path`; the tree's directory."""
    target = clone(release, dest)
    cat = catalog.load()
    plan = engine.plan(tree.locate(target), cat)
    states = engine.check(plan, cat)
    engine.write(plan)
    manifest.write(manifest_path, manifest.build(plan, states))
    return target
