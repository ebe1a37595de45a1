"""vLLM's aarch64 wheel (GB200/GB300 Grace nodes) takes the same fix series as the x86_64 one.

The arm64 image installs vLLM's manylinux aarch64 wheel; the series is applied there at build
time. Here the release's aarch64 wheel is fetched (cached in .cache/wheels/aarch64), its
Python code unpacked, the series applied with `mla-serve patches apply` and every fix's probe
run on the result; its Python files are compared with the x86_64 wheel's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mla_serve import cli
from mla_serve.patching import catalog, manifest, wheel
from tests import trees

RELEASE = trees.DEFAULT_RELEASE


def python_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "vllm").rglob("*.py"))
        if "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def arm_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    whl = wheel.fetch(RELEASE, trees.CACHE / "wheels", arch="aarch64")
    assert whl.name.endswith("_aarch64.whl"), whl.name
    tree = tmp_path_factory.mktemp("aarch64") / "tree"
    wheel.unpack(whl, tree, python_only=True)
    return tree


def test_aarch64_python_files_match_the_x86_64_wheel(arm_tree: Path) -> None:
    arm, x86 = python_files(arm_tree), python_files(trees.pristine(RELEASE))
    only_arm, only_x86 = sorted(set(arm) - set(x86)), sorted(set(x86) - set(arm))
    differ = sorted(k for k in set(arm) & set(x86) if arm[k] != x86[k])
    print(
        f"{len(arm)} Python files in the aarch64 wheel; differ: {differ}; "
        f"aarch64 only: {only_arm}; x86_64 only: {only_x86}"
    )
    assert len(arm) > 1000
    assert (differ, only_arm, only_x86) == ([], [], [])


def test_series_applies_to_the_aarch64_wheel_and_every_probe_passes(
    arm_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["patches", "apply", "--target", str(arm_tree)])
    out = capsys.readouterr().out
    assert code == 0, out
    document = json.loads((arm_tree / "vllm" / manifest.FILENAME).read_text())
    assert document["vllm_version"].split("+")[0] == RELEASE
    fixes = {f["id"]: f for f in document["fixes"]}
    assert set(fixes) == {f.id for f in catalog.load().fixes}
    assert all(f["probe"] == "pass" for f in fixes.values()), fixes
    assert cli.main(["patches", "verify", "--target", str(arm_tree)]) == 0
    assert "matches" in capsys.readouterr().out
    code = cli.main(["patches", "status", "--target", str(arm_tree), "--format", "json"])
    status = json.loads(capsys.readouterr().out)
    assert code == 0
    print(json.dumps(status)[:1500])
