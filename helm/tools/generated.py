"""Write the chart's generated files, or (--check) fail naming each one that is stale."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "mla-serve"


class GenerationError(Exception):
    """Bad input to a generator: one line, naming the file and line where it can."""


def main(build: Callable[[Path], dict[Path, str]], description: str, generator: str) -> int:
    """Exit status: 0 written (or current), 1 stale under --check, 2 bad input."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    parser.add_argument(
        "--chart", type=Path, default=CHART, help="the chart (default: %(default)s)"
    )
    args = parser.parse_args()
    chart = args.chart.resolve()
    try:
        outputs = build(chart)
    except GenerationError as error:
        print(f"{generator}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{generator}: error: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    stale = [path for path, text in outputs.items() if _read(path) != text]
    if args.check:
        for path in stale:
            print(f"{shown(path)} is stale: run make generate", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path])
        print(f"wrote {shown(path)}")
    return 0


def shown(path: Path) -> str:
    """A path as messages name it: relative to the repository where it lies inside."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None
