"""`make chart`: lint and render of the defaults and every profile, and refusals in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.helm.helm_support import PROFILES, REPO


def _make_chart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.helm.make_chart", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_every_profile_lints_clean_and_renders(tmp_path: Path) -> None:
    result = _make_chart("--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1].startswith(f"{len(PROFILES) + 1} of {len(PROFILES) + 1} clean")
    for name in ["default", *PROFILES]:
        assert any(line.startswith(f"{name}: lint clean; ") for line in lines), name
        docs = [d for d in yaml.safe_load_all((tmp_path / f"{name}.yaml").read_text()) if d]
        assert "Deployment" in {d["kind"] for d in docs}
        assert (tmp_path / f"{name}.NOTES.txt").read_text().startswith("mla-serve ")


def test_refused_values_and_missing_files_say_why(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallelism:\n  tensor: 3\n")
    result = _make_chart("--values", str(bad), "--out", str(tmp_path))
    assert result.returncode == 1
    assert "values: refused: - at '/parallelism/tensor': value must be one of 1, 2, 4" in (
        result.stdout
    )
    missing = _make_chart("--values", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert "Traceback" not in result.stdout + result.stderr + missing.stderr
