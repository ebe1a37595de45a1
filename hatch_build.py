"""Hatchling build hook: the sidecar's C lane (mla_serve/sidecar/passthrough/_lane.c), compiled.

The lane does the sidecar's per-read work for token chunks in C; without it every
read goes through the Python path, which has the same effects. It uses CPython's stable ABI
(3.11), so one build serves every CPython from 3.11 on: the wheel is tagged
`cp311-abi3-<platform>`, for the platform it was built on (the image builds it in its own
stage, on each architecture it is built for).

`MLA_SERVE_BUILD_LANE`: `auto` (the default: build it when a C compiler works, else a
pure-Python wheel and a warning), `require` (a failed build fails; the image and `make test`
use this), `off` (pure Python).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "mla_serve/sidecar/passthrough/_lane.c"
TARGET = "mla_serve/sidecar/passthrough/_lane.abi3.so"


def compile_lane(root: Path, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile the lane into `out` with the compiler CPython was built with."""
    ldshared = sysconfig.get_config_var("LDSHARED") or "cc -shared"
    include = sysconfig.get_paths()["include"]
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [*shlex.split(ldshared), "-O2", "-fPIC", "-Wall",
               *extra, f"-I{include}", str(root / SOURCE), "-o", str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class LaneBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        mode = os.environ.get("MLA_SERVE_BUILD_LANE", "auto")
        if mode not in ("auto", "require", "off"):
            raise ValueError(f"MLA_SERVE_BUILD_LANE must be auto, require or off, not {mode!r}")
        root = Path(self.root)
        editable = version == "editable"
        # An editable install imports from the source tree; a wheel carries a fresh build.
        out = root / TARGET if editable else root / "build" / "lane" / Path(TARGET).name
        if mode == "off":
            if editable:
                out.unlink(missing_ok=True)
            return
        try:
            compile_lane(root, out)
        except (OSError, subprocess.CalledProcessError) as error:
            output = getattr(error, "stdout", b"") or b""
            why = output.decode(errors="replace").strip() or str(error)
            if mode == "require":
                raise RuntimeError(f"compiling {SOURCE} failed:\n{why}") from error
            print(f"warning: {SOURCE} not built, the sidecar reads in Python: {why}",
                  file=sys.stderr)  # fmt: skip
            if editable:
                out.unlink(missing_ok=True)
            return
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"cp311-abi3-{platform}"
        if not editable:
            build_data["force_include"][str(out)] = TARGET


if __name__ == "__main__":  # `make`: the editable install's lane, rebuilt in place
    here = Path(__file__).resolve().parent
    try:
        compile_lane(here, here / TARGET)
    except subprocess.CalledProcessError as error:
        sys.exit(f"compiling {SOURCE} failed:\n{error.stdout.decode(errors='replace')}")
    print(f"built {TARGET}")
