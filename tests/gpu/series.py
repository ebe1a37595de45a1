"""`python -m tests.gpu.series RELEASE`: exit 0 when mla-serve carries backports for RELEASE
(its series in patches/catalog.toml is not empty), 1 when it carries none, 2 when the catalog
does not know the release. tests/gpu/run.sh patches a copy of a tree only for the former."""

from __future__ import annotations

import sys

from mla_serve.patching import catalog


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.gpu.series RELEASE", file=sys.stderr)
        return 2
    try:
        patches = catalog.load().series(argv[0]).patches
    except catalog.CatalogError as error:
        print(f"tests.gpu.series: {error}", file=sys.stderr)
        return 2
    return 0 if patches else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
