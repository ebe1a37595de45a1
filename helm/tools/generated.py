"""Write a generated chart file, or (--check) fail when the checked-in copy is stale."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main(path: Path, build: Callable[[], Any], description: str, generator: str) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = json.dumps(build(), indent=2) + "\n"
    if args.check:
        if path.read_text() != text:
            print(f"{path} is stale: run python {generator}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0
