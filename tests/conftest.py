"""Shared test set-up.

`--vllm-tree DIR --vllm-state pristine|patched` select the vLLM tree that the
per-tree suites (tests/vllm_cpu, tests/gpu) import; their `expect` fixture says,
from the fix catalog, whether a fix must show as fixed or buggy in that tree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # helpers import as plain modules (trees, vllm_standin…)
sys.path.insert(1, str(TESTS.parent))

from server.patching import catalog as catalog_  # noqa: E402
from server.patching import tree as tree_  # noqa: E402

CATALOG = catalog_.load()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--vllm-tree", default=None, help="directory containing vllm/")
    parser.addoption("--vllm-state", default=None, choices=("pristine", "patched"))


def pytest_configure(config: pytest.Config) -> None:
    tree = config.getoption("--vllm-tree")
    if tree:
        sys.path.insert(0, str(Path(tree).resolve()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/vllm_cpu runs only in the per-tree child pytest of test_vllm_behaviour.py."""
    if collection_path.name == "vllm_cpu" and config.getoption("--vllm-tree") is None:
        return True
    return None


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
    tree = pytestconfig.getoption("--vllm-tree")
    state = pytestconfig.getoption("--vllm-state")
    if not tree or not state:
        pytest.skip("needs --vllm-tree DIR --vllm-state pristine|patched")
    found = tree_.locate(Path(tree))
    import vllm

    assert Path(vllm.__file__).resolve().is_relative_to(found.root), "imported another vLLM"
    return Expect(CATALOG.release_of(found.version), state)
