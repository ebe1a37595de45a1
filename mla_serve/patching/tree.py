"""Find a vLLM source tree and tell which release it is.

A tree is the directory that contains the `vllm/` package: site-packages of an
installed vLLM, or an unpacked wheel. The release is read from the package's
own `vllm/_version.py` (written by vLLM's build), never by importing vLLM, so
it works without torch and without side effects.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from mla_serve.engine.manifest import sha256 as sha256  # the one digest of tree files


class TreeError(Exception):
    """No usable vLLM tree where one was asked for."""


@dataclass(frozen=True)
class VllmTree:
    """A tree on disk, optionally seen through pending edits (`overlay`).

    The overlay lets probes judge a series' result before anything is written.
    """

    root: Path
    version: str
    commit: str | None
    overlay: Mapping[str, str | None] = field(default_factory=dict)
    # Every tree path asked for through `file` (and so `read`), shared with the trees made
    # from this one: what a verification depended on (the sidecar re-verifies when one of
    # them changes on disk).
    touched: set[str] = field(default_factory=set, compare=False, repr=False)

    def with_overlay(self, files: Mapping[str, str | None]) -> VllmTree:
        return replace(self, overlay={**self.overlay, **files})

    @property
    def package(self) -> Path:
        return self.root / "vllm"

    def file(self, relative: str) -> Path:
        """The path of a tree file; refuses any path that would leave the tree."""
        path = confine(self.root, relative)
        self.touched.add(relative)
        return path

    def read(self, relative: str) -> str | None:
        """The text of a tree file, or None when the release does not have it."""
        if relative in self.overlay:
            return self.overlay[relative]
        path = self.file(relative)
        if not path.is_file():
            return None
        try:
            data = path.read_bytes()
        except OSError as error:
            raise TreeError(f"cannot read {path}: {error.strerror or error}") from None
        try:
            # Bytes decoded as they are: read_text() would turn CRLF into LF.
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TreeError(
                f"{path} is not UTF-8 text (byte {error.start}: {error.reason})"
            ) from None


def confine(root: Path, relative: str) -> Path:
    """`root / relative`, refused unless it names a place inside `root`.

    Patch files and manifests name tree files by relative POSIX paths. An absolute
    path, a `..` segment, or a symbolic link (of the file or of a directory above it)
    that resolves outside the tree would let a series or a manifest read or write
    elsewhere; each is a TreeError, raised before anything is read or written.
    """
    pure = PurePosixPath(relative)
    if (
        not relative
        or "\0" in relative
        or "\\" in relative
        or pure.is_absolute()
        or any(part in ("..", "") for part in relative.split("/"))
    ):
        raise TreeError(f"path {relative!r} is not a relative path inside the vLLM tree")
    path = root / relative
    base = root.resolve()
    if not path.resolve().is_relative_to(base):
        raise TreeError(f"path {relative!r} leaves the vLLM tree {root} (through a symbolic link)")
    return path


def locate(target: Path | None) -> VllmTree:
    """The tree at `target`, or the vLLM installed in this interpreter."""
    if target is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise TreeError(
                "no vLLM is installed in this Python; pass --target DIR "
                "(the directory that contains the vllm/ package)"
            )
        root = Path(next(iter(spec.submodule_search_locations))).parent
    else:
        root = target.resolve()
        if (root / "__init__.py").is_file() and root.name == "vllm":
            root = root.parent  # tolerate being pointed at the package itself
    if not (root / "vllm" / "__init__.py").is_file():
        raise TreeError(f"{root} does not contain a vllm/ package")
    version, commit = _read_version(root)
    return VllmTree(root=root, version=version, commit=commit)


def _read_version(root: Path) -> tuple[str, str | None]:
    version_file = root / "vllm" / "_version.py"
    if version_file.is_file():
        try:
            values = _assigned_strings(version_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as error:
            raise TreeError(f"cannot read the vLLM release from {version_file}: {error}") from None
        if "__version__" in values:
            return values["__version__"], values.get("__commit_id__")
    for metadata in sorted(root.glob("vllm-*.dist-info/METADATA")):
        try:
            text = metadata.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise TreeError(f"cannot read {metadata}: {error.strerror or error}") from None
        for line in text.splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), None
    raise TreeError(f"cannot tell the vLLM release of {root}: no vllm/_version.py or dist-info")


def _assigned_strings(source: str) -> dict[str, str]:
    """Names bound to string literals, including chained `a = b = "x"`."""
    values: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        if isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    return values
