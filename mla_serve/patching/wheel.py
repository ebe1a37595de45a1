"""Fetch a vLLM release wheel (cached) and unpack it into a tree to patch.

`make dist` and the tests work on an unpacked wheel rather than an installed
vLLM: the tree is exactly the released code, it can be patched without touching
the developer's Python, and it is what the container image installs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path


class WheelError(Exception):
    """The wheel could not be fetched or unpacked."""


ARCHES = ("x86_64", "aarch64")


def fetch(version: str, cache: Path, arch: str = "x86_64") -> Path:
    """The `arch` wheel of vLLM `version` (manylinux), downloaded into `cache` unless there.

    aarch64 wheels (GB200/GB300's Grace) are kept in `cache`/aarch64, apart from the x86_64
    ones the tests and the packs unpack.
    """
    if arch not in ARCHES:
        raise WheelError(f"unknown wheel architecture {arch!r} (one of {', '.join(ARCHES)})")
    if arch != "x86_64":
        cache = cache / arch
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"vllm-{version}-*_{arch}.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        f"manylinux_2_28_{arch}",
        "--progress-bar",
        "on",
        "--dest",
        str(cache),
        f"vllm=={version}",
    ]
    if subprocess.run(command, check=False).returncode != 0:
        raise WheelError(f"pip could not download vllm=={version} (see its output above)")
    found = sorted(cache.glob(pattern))
    if not found:
        raise WheelError(f"pip reported success but no vllm-{version} wheel is in {cache}")
    return found[0]


def unpack(
    wheel: Path,
    dest: Path,
    *,
    python_only: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> None:
    """Extract `wheel` into the new directory `dest` (all or nothing).

    `python_only` leaves out compiled extensions and vendored third-party code,
    which is all the CPU tests need and a fifth of the size.
    """
    if dest.exists() and any(dest.iterdir()):
        raise WheelError(f"{dest} exists and is not empty; remove it or choose another")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if _wanted(m.filename, python_only)]
            step = max(len(members) // 10, 1)
            for count, member in enumerate(members, 1):
                archive.extract(member, staging)
                if count % step == 0 or count == len(members):
                    progress(f"unpacking {wheel.name}: {100 * count // len(members)}%")
        if dest.exists():
            dest.rmdir()
        staging.rename(dest)
    except (OSError, zipfile.BadZipFile) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise WheelError(f"cannot unpack {wheel}: {error}") from None


def _wanted(name: str, python_only: bool) -> bool:
    if not python_only:
        return True
    return not (name.endswith(".so") or name.startswith("vllm/third_party/"))
