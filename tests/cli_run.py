"""Run the `mla-serve` CLI in-process, as the tests do: exit code, stdout, stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_serve import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """`mla-serve ARGV...` through `cli.main`, with what it printed (captured by capsys)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err
