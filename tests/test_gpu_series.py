"""tests/gpu/run.sh patches a copy of a tree exactly where mla-serve carries backports.

It used to look for `patches/vllm-<release>/series`, which the catalog redesign removed, so
every GPU run after it tested pristine trees only (found on an H200: four tree runs, none
patched)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mla_serve.patching import catalog

ROOT = Path(__file__).resolve().parents[1]


def _series(release: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.series", release],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done.returncode


@pytest.mark.parametrize("release", catalog.load().releases)
def test_a_patched_copy_exactly_where_a_series_is_carried(release: str) -> None:
    carried = bool(catalog.load().series(release).patches)
    assert _series(release) == (0 if carried else 1)


def test_an_unknown_release_stops_the_run() -> None:
    assert _series("9.9.9") == 2
    script = (ROOT / "tests" / "gpu" / "run.sh").read_text()
    assert "-m tests.gpu.series" in script and "/series" not in script
