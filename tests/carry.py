"""What travels to the GPU machine besides the repository: light cp312 wheels.

The GPU machine has Python 3.12, torch, triton and no network. The packs
(tests/gpu/pack.py, tests/e2e/pack.py) download the wheels a requirements file
pins into .cache/gpu-wheels once and copy them into the pack; there they are
installed with `pip install --no-index --no-deps --target`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "gpu-wheels"
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)),
             "manylinux2014_x86_64", "any")  # fmt: skip


def download(*pins: str) -> list[Path]:
    """The cached cp312 wheels of `pins` ("name==version"), downloaded if missing."""
    wanted = {_normal(pin.split("==")[0]): pin.split("==")[1] for pin in pins}
    return _cached(wanted, *pins)


def wheels(requirements: Path, dest: Path) -> list[Path]:
    """Copy the wheels `requirements` pins (following `-r` includes) into `dest`."""
    found = _cached(_names(requirements), "-r", str(requirements))
    dest.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(wheel, dest / wheel.name)) for wheel in found]


def _cached(wanted: dict[str, str], *requirements: str) -> list[Path]:
    """The cached wheels of `wanted`; pip downloads them unless each one is already there."""
    found = [wheel for wheel in sorted(CACHE.glob("*.whl")) if _pinned(wheel, wanted)]
    if {wheel.name.split("-")[0].lower() for wheel in found} != set(wanted):
        _pip_download(*requirements)
        found = [wheel for wheel in sorted(CACHE.glob("*.whl")) if _pinned(wheel, wanted)]
    return found


def _pip_download(*requirements: str) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp",
            *[f"--platform={platform}" for platform in PLATFORMS],
            "-d", str(CACHE), *requirements,
        ],
        check=True,
    )  # fmt: skip


def _pinned(wheel: Path, wanted: dict[str, str]) -> bool:
    name, version = wheel.name.split("-")[:2]
    return wanted.get(name.lower()) == version


def _names(requirements: Path) -> dict[str, str]:
    """Normalized distribution name → pinned version, as wheel file names spell them."""
    pins: dict[str, str] = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins |= _names(requirements.parent / line[3:].strip())
        elif "==" in line:
            name, version = line.split("==", 1)
            pins[_normal(name)] = version.strip()
    return pins


def _normal(name: str) -> str:
    """A distribution name as wheel file names spell it."""
    return name.strip().split("[")[0].lower().replace("-", "_").replace(".", "_")
