"""The Makefile's own texts: `make help` lists each target with its variables expanded."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.trees import DEFAULT_RELEASE

ROOT = Path(__file__).resolve().parents[1]


def test_make_help_expands_variables_and_lists_the_readme_commands():
    shown = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "$(" not in shown
    assert f"patched vLLM {DEFAULT_RELEASE} wheel" in shown
    targets = {line.split()[1] for line in shown.splitlines() if line.startswith("  make ")}
    assert {"dist", "test", "demo", "chart"} <= targets
