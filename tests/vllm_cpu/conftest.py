"""Run vLLM's own code from one tree, pristine or patched, on the CPU.

This directory is collected only by its own pytest process, started by
tests/test_vllm_behaviour.py with `--vllm-tree DIR --vllm-state STATE`: a process
can import a single vLLM, so each tree gets one. CPU-only torch is enough for
these functions; `vllm._C` is absent and vLLM says so with a warning.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from server.patching import catalog as catalog_  # noqa: E402
from server.patching import tree as tree_  # noqa: E402

CATALOG = catalog_.load()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--vllm-tree", required=True, help="directory containing vllm/")
    parser.addoption("--vllm-state", required=True, choices=("pristine", "patched"))


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, str(Path(config.getoption("--vllm-tree")).resolve()))


class Expect:
    """What a fix should look like in this tree: fixed, buggy, or code absent."""

    def __init__(self, release: str, state: str) -> None:
        self.release = release
        self.state = state

    def fixed(self, fix_id: str) -> bool:
        """True when the fix must show; skips (recording why) where the code never existed."""
        claim = CATALOG.fix(fix_id).on(self.release)
        if claim.status is catalog_.Status.NOT_AFFECTED:
            pytest.skip(f"vLLM {self.release} is not affected by {fix_id}: {claim.reason}")
        return claim.status is catalog_.Status.UPSTREAM or self.state == "patched"


@pytest.fixture(scope="session")
def expect(pytestconfig: pytest.Config) -> Expect:
    found = tree_.locate(Path(pytestconfig.getoption("--vllm-tree")))
    import vllm

    assert Path(vllm.__file__).resolve().is_relative_to(found.root), "imported another vLLM"
    return Expect(CATALOG.release_of(found.version), pytestconfig.getoption("--vllm-state"))
