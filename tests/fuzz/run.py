"""Run one fuzz target of tests/fuzz/targets.py under atheris (libFuzzer underneath).

    FUZZ_TARGET=frames .venv/bin/python -m tests.fuzz.run [libFuzzer flags] [corpus dirs]

`FUZZ_TARGET` names the target (an environment variable: libFuzzer takes every argument but
its flags for a corpus folder, and starts itself again with the same arguments to merge).
`FUZZ_LANE`, when set, is a build of the C lane to fuzz instead of the installed one: one
compiled with GCC's `-fsanitize-coverage=trace-cmp` (campaign.py builds it) hands each of its
comparisons to libFuzzer, which then steers inputs towards the bytes the lane compares
against (`-use_value_profile=1`); with AddressSanitizer too (preloaded) a bad read or write
in it is a crash. The code under test is imported at the first input, under atheris'
instrumentation (Python's branches are libFuzzer's coverage), after libFuzzer is loaded (an
instrumented lane needs its hooks).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

LANE = "mla_serve.sidecar.passthrough._lane"
WRAPPER = Path(__file__).with_name("fuzz.sh")  # the command libFuzzer runs to start again


def _load(path: str) -> None:
    """The C lane from `path`, as the module the sidecar imports."""
    loader = importlib.machinery.ExtensionFileLoader(LANE, path)
    spec = importlib.util.spec_from_file_location(LANE, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[LANE] = module


def main() -> None:
    name = os.environ.get("FUZZ_TARGET", "")
    # The instrumented lane resolves libFuzzer's comparison hooks from atheris' core: that
    # must be loaded with its symbols global.
    sys.setdlopenflags(os.RTLD_GLOBAL | os.RTLD_NOW)
    import atheris

    target: list[Callable[[bytes], None]] = []

    def first() -> Callable[[bytes], None]:
        lane = os.environ.get("FUZZ_LANE")
        if lane:
            _load(lane)
        # the code under test, the reference h11 (its parse paths are coverage too) and the
        # targets' own verdicts
        with atheris.instrument_imports(include=["mla_serve", "h11", "tests.fuzz"]):
            from tests.fuzz import targets

            if name == "lane":
                from tests import test_lane  # noqa: F401 - its imports of mla_serve, instrumented
            elif name == "protocol":
                from mla_serve.sidecar import serve  # noqa: F401
        if name not in targets.TARGETS:
            sys.exit(f"FUZZ_TARGET must be one of {', '.join(targets.TARGETS)}, got {name!r}")
        if lane:
            assert targets._lane.__file__ == lane, targets._lane.__file__
        target.append(targets.TARGETS[name])
        return target[0]

    def one(data: bytes) -> None:
        (target[0] if target else first())(data)

    os.environ["FUZZ_PYTHON"] = sys.executable
    atheris.Setup([str(WRAPPER), *sys.argv[1:]], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
