"""`make gpu-pack`: what the GPU machine needs, small enough to carry (64 MiB a run).

For each packed release: the files of its pristine tree that the GPU suite
imports (its import closure, found by importing those modules here on the CPU;
the patched tree is made there by `mla-serve patches apply`), and from its wheel the
compiled FlashMLA kernels with their Python interface (tests/gpu/dsv4_prefill.py runs the
sparse prefill kernel), as one .tar.xz.
Plus the light cp312 wheels of tests/gpu/wheels.txt (tests/carry.py), and upstream's
CUDA tests for the fixes (catalog `gpu`), unchanged from vLLM's sdists, in
upstream-tests/<release>/ (tests/upstream.py reads them there).

    python -m tests.gpu.pack --out build/gpu-pack   # from the repository root
    python -m tests.gpu.pack --releases 0.33.0     # some of them (a pack carries 64 MiB)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from datetime import datetime
from pathlib import Path

from mla_serve.patching import wheel
from tests import carry, trees, upstream

ROOT = Path(__file__).resolve().parents[2]

# The releases we patch, and the default one (patches/catalog.toml), each once.
RELEASES = tuple(dict.fromkeys((*trees.PATCHED_RELEASES, trees.DEFAULT_RELEASE)))
LIMIT_MIB = 56  # leaves room for the repository itself in the 64 MiB a run carries
IMPORTS = (
    "vllm.forward_context",
    "vllm.config",
    "vllm.compilation.breakable_cudagraph",
    "vllm.utils.torch_utils",
    "vllm.v1.attention.backends.utils",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse",
    "vllm.v1.attention.backends.mla.sparse_utils",
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.v1.hisparse.runtime",
    "vllm.v1.attention.ops.common",
    "vllm.v1.attention.ops.dcp",
    "vllm.models.deepseek_v4.attention",
    "vllm.models.deepseek_v4.sparse_mla",
    "vllm.v1.worker.gpu.cudagraph_utils",  # tests/gpu/dsv4_capture.py: the V2 runner's capture
    "vllm.v1.worker.gpu.model_states.default",
    "vllm._custom_ops",
)
EXTRA = (  # whole subtrees on the GPU code paths
    "vllm/v1", "vllm/distributed", "vllm/config", "vllm/compilation", "vllm/platforms",
    "vllm/utils", "vllm/triton_utils", "vllm/model_executor/layers", "vllm/models/deepseek_v4",
    "vllm/model_executor/warmup", "vllm/model_executor/kernels", "vllm/lora",
)  # fmt: skip
CLOSURE = """
import importlib, os, sys
root = os.path.abspath(sys.argv[1])
for name in sys.argv[2:]:
    if name.startswith("tests."):  # upstream's test modules: what they import, if they can
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: S110 (pytest.skip at module level is a BaseException)
            pass
        continue
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if not name.startswith(error.name or "?"):
            raise  # not absent from this release: a real import failure
for module in list(sys.modules.values()):
    path = os.path.abspath(getattr(module, "__file__", None) or "")
    if path.startswith(root + os.sep):
        print("CLOSURE " + os.path.relpath(path, root))
"""


def upstream_gpu_tests() -> dict[str, tuple[str, ...]]:
    """The files of upstream's CUDA tests (catalog `gpu`), per sdist, extracted here."""
    files: dict[str, set[str]] = {}
    for fix in upstream.catalog_.load().fixes:
        tests = fix.upstream_tests
        if tests and tests.gpu:
            files.setdefault(tests.sdist, set()).update(tests.files())
    return {sdist: tuple(sorted(names)) for sdist, names in files.items()}


def closure(release: str) -> list[str]:
    tree = trees.pristine(release)
    modules = [
        name.removesuffix(".py").replace("/", ".")
        for names in upstream_gpu_tests().values()
        for name in names
    ]
    roots = [str(upstream.CACHE / "upstream-tests" / sdist) for sdist in upstream_gpu_tests()]
    # -P: not the working directory first on the path: this repository's package `tests`
    # would shadow upstream's.
    result = subprocess.run(
        [sys.executable, "-P", "-c", CLOSURE, str(tree), *IMPORTS, *modules],
        env={"PYTHONPATH": os.pathsep.join([str(tree), *roots]), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    imported = {
        line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("CLOSURE ")
    }
    # vLLM imports more where Triton and CUDA exist (fused-MoE experts, executors):
    # take every module beside an imported one, and the packages named in EXTRA.
    directories = {str(Path(name).parent) for name in imported}
    files = {
        str(path.relative_to(tree))
        for directory in directories
        for path in (tree / directory).glob("*.py")
    } | imported
    files |= {str(p.relative_to(tree)) for d in EXTRA for p in (tree / d).rglob("*.py")}
    files |= {str(p.relative_to(tree)) for p in tree.glob("vllm-*.dist-info/METADATA")}
    return sorted(files)


def kernels(release: str) -> list[tuple[zipfile.ZipInfo, bytes]]:
    """From the release's wheel: the compiled FlashMLA kernels and their Python interface
    (vllm/third_party is left out of the pure-Python trees)."""
    with zipfile.ZipFile(wheel.fetch(release, trees.CACHE / "wheels")) as archive:
        return [
            (info, archive.read(info))
            for info in archive.infolist()
            if info.filename in ("vllm/_flashmla_C.abi3.so", "vllm/third_party/__init__.py")
            or info.filename.startswith("vllm/third_party/flashmla/")
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-pack")
    parser.add_argument(
        "--releases", nargs="+", default=list(RELEASES), metavar="X.Y.Z",
        help=f"the releases to pack (default: {' '.join(RELEASES)})",
    )  # fmt: skip
    args = parser.parse_args()
    unknown = sorted(set(args.releases) - set(trees.RELEASES))
    if unknown:
        parser.error(f"not a supported release: {', '.join(unknown)}")
    shutil.rmtree(args.out, ignore_errors=True)
    (args.out / "trees").mkdir(parents=True)
    for sdist, names in upstream_gpu_tests().items():  # upstream's CUDA tests, unchanged
        source = upstream.extract(sdist, names)
        for name in (*names, *(str(p.relative_to(source)) for p in source.rglob("__init__.py"))):
            target = args.out / "upstream-tests" / sdist / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, target)
    sizes = {}
    for release in dict.fromkeys(args.releases):
        files = closure(release)
        archive = args.out / "trees" / f"vllm-{release}.tar.xz"
        with tarfile.open(archive, "w:xz") as tar:
            for name in files:
                tar.add(trees.pristine(release) / name, arcname=name)
            for info, data in kernels(release):
                member = tarfile.TarInfo(info.filename)
                member.size, member.mode = len(data), 0o644
                member.mtime = int(datetime(*info.date_time).timestamp())
                tar.addfile(member, io.BytesIO(data))
        sizes[release] = {"files": len(files), "bytes": archive.stat().st_size}
        print(f"vLLM {release}: {len(files)} files, {archive.stat().st_size / 2**20:.1f} MiB")
    carry.wheels(ROOT / "tests" / "gpu" / "wheels.txt", args.out / "wheels")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    (args.out / "pack.json").write_text(json.dumps({"releases": sizes, "bytes": total}, indent=2))
    print(f"pack: {args.out} ({total / 2**20:.1f} MiB; a device run carries at most 64 MiB)")
    if total > LIMIT_MIB * 2**20:
        print(f"error: the pack exceeds {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
