"""`make e2e-pack`: everything the end-to-end run needs on the GPU machine, in two carries.

build/e2e-pack/
  vllm.tar.xz  the release's tree from its wheel: the Python package, its data,
               DeepGEMM's JIT headers, and the CUDA extension modules the
               sparse-MLA path loads on Hopper, each pruned to sm_90 device code
               (fatbin.py). Left out: the Rust frontend binary (opt-in), and the
               modules of paths this model does not take (FlashAttention-2, MoE,
               SM100's DeepSelect, FlashKDA, QuTLASS)
  wheels/      light cp312 wheels of tests/e2e/wheels.txt, and mla-serve's own
               wheel (its `vllm.general_plugins` entry point loads the plugin)
  model/       the tiny DeepSeek-V3.2 model (model.py)
  cute-dsl.tar.xz  the Python part of NVIDIA's CuTe DSL (see below)
  pack.json    release, sizes, and the device code each module kept
build/e2e-deps/
  cute-dsl-libs.tar.xz  the CuTe DSL's compiled MLIR library and runtime

vLLM's DeepSeek-V3.2 attention imports the CuTe DSL (the release's pinned
`nvidia-cutlass-dsl[cu13]`) on every CUDA GPU, also where it then runs Triton
(Hopper). Its compiled part alone nearly fills a carry (64 MiB with the
repository), so it travels in the run before the main one: `run.sh deps`
unpacks it where the main run finds it, while the machine stays warm.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import carry  # noqa: E402
import fatbin  # noqa: E402
import model  # noqa: E402

from server.patching import wheel  # noqa: E402

ARCH = 90  # the H200
CARRY_LIMIT = 64 * 2**20
EXTENSIONS = (  # loaded on the sparse-MLA path (platform init, FlashMLA, FA3, DeepGEMM)
    "vllm/_C*.so",
    "vllm/_flashmla_C*.so",
    "vllm/_flashmla_extension_C*.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C*.so",
    "vllm/third_party/deep_gemm/_C*.so",
)
LEFT_OUT = ("vllm/vllm-rs", "*/__pycache__/*", "vllm/_moe_C*.so")


def tree(source: Path, archive: Path) -> dict[str, object]:
    """Write the release's tree as a deterministic .tar.xz; what each extension kept."""
    modules: dict[str, object] = {}

    def members() -> Iterator[tuple[str, bytes]]:
        with zipfile.ZipFile(source) as zipped:
            for info in sorted(zipped.infolist(), key=lambda item: item.filename):
                name = info.filename
                if info.is_dir() or any(fnmatch.fnmatch(name, p) for p in LEFT_OUT):
                    continue
                if name.endswith(".so") and not any(fnmatch.fnmatch(name, p) for p in EXTENSIONS):
                    continue
                data = zipped.read(info)
                if name.endswith(".so"):
                    data, zeroed = fatbin.prune(data, ARCH)
                    kept = {f"{'cubin' if kind == fatbin.CUBIN else 'ptx'}_{arch}": size
                            for (kind, arch), size in sorted(fatbin.architectures(data).items())
                            if arch == ARCH}  # fmt: skip
                    modules[name] = {"bytes": len(data), "zeroed": zeroed, "kept": kept}
                    print(f"  {name}: {len(data) >> 20} MiB, {zeroed >> 20} MiB zeroed")
                yield name, data

    write_archive(members(), archive)
    return {"wheel": source.name, "extensions": modules}


def cute_dsl(source: Path, python_part: Path, libraries: Path) -> list[str]:
    """Unpacked wheels of the CuTe DSL the release pins, in two archives; their names."""
    with zipfile.ZipFile(source) as zipped:
        metadata = next(n for n in zipped.namelist() if n.endswith(".dist-info/METADATA"))
        pinned = re.search(r"^Requires-Dist: nvidia-cutlass-dsl\[cu13\]==(\S+)$",
                           zipped.read(metadata).decode(), re.MULTILINE)  # fmt: skip
    if pinned is None:
        return []  # releases before the CuTe DSL
    version = pinned.group(1)
    parts = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core")
    wheels = carry.download(*(f"{name}=={version}" for name in parts))
    site_archive(wheels, python_part)
    (compiled,) = carry.download(f"nvidia-cutlass-dsl-libs-cu13=={version}")
    record = libraries.with_suffix(".json")
    if (
        not libraries.is_file()
        or not record.is_file()
        or json.loads(record.read_text()) != [compiled.name]
    ):  # 2 minutes of xz: kept while the wheel is the same
        site_archive([compiled], libraries)
        record.write_text(json.dumps([compiled.name]))
    return sorted(w.name for w in (*wheels, compiled))


def site_archive(wheels: list[Path], archive: Path) -> None:
    """The wheels' files as pip lays them out in site-packages, as a deterministic .tar.xz."""

    def members() -> Iterator[tuple[str, bytes]]:
        for source in wheels:
            with zipfile.ZipFile(source) as zipped:
                for info in sorted(zipped.infolist(), key=lambda item: item.filename):
                    if not info.is_dir():
                        yield info.filename, zipped.read(info)

    write_archive(members(), archive)


def write_archive(members: Iterable[tuple[str, bytes]], archive: Path) -> None:
    """A .tar.xz of `members` with neither times nor owners, so the same input gives the same bytes.

    xz -9e with every core: about a minute for vLLM's tree, two for the CuTe DSL's libraries.
    """
    raw = archive.with_suffix("")
    with tarfile.open(raw, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o755 if name.endswith(".so") else 0o644
            tar.addfile(member, io.BytesIO(data))
    print(f"  {archive.name}: compressing {raw.stat().st_size >> 20} MiB with xz")
    subprocess.run(["xz", "-9e", "-T0", "-f", str(raw)], check=True)


def project_wheel(dest: Path) -> Path:
    """mla-serve's own wheel, built from this checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(ROOT)],
        check=True,
    )
    return next(dest.glob("mla_serve-*.whl"))


def repository_bytes() -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-version", default="0.33.0")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "e2e-pack")
    parser.add_argument("--deps", type=Path, default=ROOT / "build" / "e2e-deps")
    args = parser.parse_args()
    out: Path = args.out
    args.deps.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("wheels/*.whl"), *out.glob("*.tar*")):
        stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    print(f"vLLM {args.vllm_version}: tree and extension modules (sm_{ARCH} device code only)")
    source = wheel.fetch(args.vllm_version, ROOT / ".cache" / "wheels")
    built = tree(source, out / "vllm.tar.xz")
    print("CuTe DSL")
    cute = cute_dsl(source, out / "cute-dsl.tar.xz", args.deps / "cute-dsl-libs.tar.xz")
    print("wheels")
    wheels = carry.wheels(ROOT / "tests" / "e2e" / "wheels.txt", out / "wheels")
    wheels.append(project_wheel(out / "wheels"))
    print("model")
    model.write_model(out / "model")
    repository = repository_bytes()
    sizes = {}
    for carried in (out, args.deps):
        pack = sum(path.stat().st_size for path in carried.rglob("*") if path.is_file())
        sizes[carried.name] = pack + repository
        print(f"pack: {carried} ({pack / 2**20:.1f} MiB; with the repository "
              f"{(pack + repository) / 2**20:.1f} MiB)")  # fmt: skip
    (out / "pack.json").write_text(
        json.dumps(
            {"vllm_version": args.vllm_version, "arch": f"sm_{ARCH}", **built, "cute_dsl": cute,
             "wheels": sorted(w.name for w in wheels), "carry_bytes": sizes},
            indent=2,
        ) + "\n"
    )  # fmt: skip
    if max(sizes.values()) > CARRY_LIMIT:
        print(f"error: a device run carries at most {CARRY_LIMIT >> 20} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
