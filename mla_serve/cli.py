"""The `mla-serve` command: one entry point, one sub-command group per area.

Each area module offers `register(subparsers)`, which sets `run(args) -> int`
on its parsers, and `ERRORS`, the exception types that mean bad input or a
refused operation: those end in a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from mla_serve import __version__
from mla_serve.patching import commands as patching
from mla_serve.sidecar import commands as sidecar
from mla_serve.sizing import commands as sizing

AREAS = (patching, sidecar, sizing)
ERRORS: tuple[type[Exception], ...] = tuple(e for area in AREAS for e in area.ERRORS)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="mla-serve",
        description="Sparse-MLA serving distribution for vLLM: fixes, sidecar, sizing.",
    )
    top.add_argument("--version", action="version", version=f"mla-serve {__version__}")
    areas = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in AREAS:
        area.register(areas)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.run(args)
        return code
    except ERRORS as error:
        print(f"mla-serve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
