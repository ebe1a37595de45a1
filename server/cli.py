"""The `mla-serve` command: one entry point, one sub-command group per area."""

from __future__ import annotations

import argparse
import sys

from server import __version__
from server.patching import catalog, commands


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="mla-serve",
        description="Sparse-MLA serving distribution for vLLM: fixes, sidecar, sizing.",
    )
    top.add_argument("--version", action="version", version=f"mla-serve {__version__}")
    areas = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.register(areas)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.run(args, catalog.load())
        return code
    except commands.ERRORS as error:
        print(f"mla-serve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
