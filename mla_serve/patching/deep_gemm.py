"""Which DeepGEMM a vLLM tree loads: the copy vLLM vendors, or a separately installed one.

vLLM's wheel vendors DeepGEMM (`vllm/third_party/deep_gemm`), but its wrapper
(`vllm/utils/deep_gemm.py`, `_import_deep_gemm`) imports a top-level `deep_gemm` first, so
that users can pin another version. A pip-installed DeepGEMM older than the vendored one
brings back crashes the vendored copy fixes: DeepSeek-V4's FULL CUDA graph capture with
all-zero indexer lengths reads out of bounds in the SM90 paged-MQA metadata kernel (vLLM
issues 51970 and 53320; the kernel in vLLM 0.33.0's vendored copy returns early). That is a
kernel, not vLLM's Python: no patch can fix it, so `mla-serve patches deep-gemm` says which
one the tree loads and refuses (exit 1) when another shadows the vendored copy; the image's
entrypoint runs it before `vllm serve` and the image build removes such a package.

Nothing is imported: the module is found the way Python's import system would find it on the
tree's path, and the wrapper's import order is read from its syntax tree.
"""

from __future__ import annotations

import argparse
import ast
import importlib.machinery
import importlib.metadata
import sys
from dataclasses import dataclass
from pathlib import Path

from mla_serve.patching import tree as tree_

NAME = "deep_gemm"
VENDORED = "vllm/third_party/deep_gemm/__init__.py"
WRAPPER = "vllm/utils/deep_gemm.py"
ALLOW_ENV = "MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM"
REPORTS = "vLLM issues 51970, 53320"


@dataclass(frozen=True)
class Resolution:
    """Where `import deep_gemm` goes for a tree, and what vLLM's wrapper does with it."""

    version: str  # the tree's vLLM version
    vendored: Path | None  # the vendored package, when the tree ships it
    external: Path | None  # a top-level deep_gemm on the tree's path
    distribution: str | None  # the external one's installed distribution, "name version"
    external_first: bool  # vLLM's wrapper imports a top-level deep_gemm before its own

    @property
    def shadowed(self) -> bool:
        """vLLM will load the external DeepGEMM instead of the copy it vendors."""
        return self.external is not None and self.vendored is not None and self.external_first

    def loads(self) -> str:
        if self.external is not None and (self.external_first or self.vendored is None):
            return f"{self.external} ({self.distribution or 'no installed distribution'})"
        if self.vendored is not None:
            return f"{self.vendored} (vLLM {self.version}'s vendored copy)"
        return "none: the tree vendors no DeepGEMM and none is installed"


def resolve(found: tree_.VllmTree, search: list[str] | None = None) -> Resolution:
    """`search`: the import path vLLM runs with (default: the tree's root, then sys.path)."""
    path = search if search is not None else [str(found.root), *sys.path]
    spec = importlib.machinery.PathFinder.find_spec(NAME, path)
    external = None
    if spec is not None and spec.origin not in (None, "namespace"):
        external = Path(spec.origin).resolve().parent
    vendored = found.root / VENDORED
    return Resolution(
        version=found.version,
        vendored=vendored.parent if vendored.is_file() else None,
        external=external,
        distribution=_distribution(external) if external else None,
        external_first=_imports_external_first(found),
    )


def _distribution(package: Path) -> str | None:
    """The installed distribution that owns the package directory, as "name version"."""
    for dist in importlib.metadata.distributions(path=[str(package.parent)]):
        if any(Path(str(f)).parts[:1] == (package.name,) for f in dist.files or ()):
            return f"{dist.metadata['Name']} {dist.version}"
    return None


def _imports_external_first(found: tree_.VllmTree) -> bool:
    """Whether the wrapper's `importlib.import_module("deep_gemm")` comes before its
    `import_module("vllm.third_party.deep_gemm")` (in every supported release it does)."""
    source = found.read(WRAPPER)
    if source is None:
        return False
    lines: dict[str, int] = {}
    for node in ast.walk(ast.parse(source, filename=WRAPPER)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in (NAME, f"vllm.third_party.{NAME}")
        ):
            lines.setdefault(str(node.args[0].value), node.lineno)
    if NAME not in lines:
        return False
    return lines[NAME] < lines.get(f"vllm.third_party.{NAME}", sys.maxsize)


def report(resolution: Resolution) -> list[str]:
    lines = [f"vLLM {resolution.version} loads DeepGEMM from {resolution.loads()}"]
    if resolution.shadowed:
        lines += [
            f"REFUSED: {resolution.external} shadows the DeepGEMM vLLM {resolution.version} "
            f"vendors ({resolution.vendored}): vLLM's wrapper ({WRAPPER}) imports a top-level "
            f"'{NAME}' first. An older DeepGEMM brings back crashes the vendored copy fixes "
            f"(FULL CUDA graph capture with all-zero indexer lengths, {REPORTS}). Remove it "
            f"(pip uninstall {(resolution.distribution or NAME).split()[0]}), or set "
            f"{ALLOW_ENV}=1 to serve with it anyway.",
        ]
    elif resolution.external is not None:
        lines.append(f"note: {resolution.external} is installed too; vLLM does not load it")
    return lines


def register(actions: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`mla-serve patches deep-gemm`."""
    check = actions.add_parser(
        "deep-gemm",
        help="which DeepGEMM the vLLM tree loads; non-zero when one shadows vLLM's own",
    )
    check.add_argument(
        "--target",
        type=Path,
        metavar="DIR",
        help="directory containing the vllm/ package (default: the installed vLLM)",
    )
    check.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    resolution = resolve(tree_.locate(args.target))
    lines = report(resolution)
    print(lines[0])
    for line in lines[1:]:
        print(line, file=sys.stderr if resolution.shadowed else sys.stdout)
    return 1 if resolution.shadowed else 0
