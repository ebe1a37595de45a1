"""Each fix's behaviour on vLLM's own code: bug on the pristine tree, fixed after apply.

One child pytest per (release, state) runs tests/vllm_cpu against that tree,
because a Python process can import only one vLLM. Pristine trees of affected
releases must show each bug; patched trees and releases carrying the fix
upstream must not.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mla_serve import cli
from mla_serve.patching import catalog
from tests import trees

CATALOG = catalog.load()
CASES = [(r, "pristine") for r in trees.RELEASES] + [
    (r, "patched") for r in trees.RELEASES if CATALOG.series(r).patches
]


@pytest.mark.parametrize(("release", "state"), CASES)
def test_vllm_code_behaves_as_the_catalog_says(release: str, state: str, tmp_path: Path):
    if importlib.util.find_spec("torch") is None:
        pytest.fail("torch is not installed: run `make test`, which installs the CPU build")
    target = trees.pristine(release)
    if state == "patched":
        target = trees.clone(release, tmp_path / "tree")
        assert cli.main(["patches", "apply", "--target", str(target)]) == 0  # as users do
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "-W",
            "ignore::DeprecationWarning",
            str(Path(__file__).parent / "vllm_cpu"),
            "--vllm-tree",
            str(target),
            "--vllm-state",
            state,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    report = child.stdout + child.stderr
    assert child.returncode == 0, report
    assert " passed" in report, report
