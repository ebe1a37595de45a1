from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `tests` helpers import as plain modules (tests/trees.py) without packaging.
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/vllm_cpu runs only in the per-tree child pytest of test_vllm_behaviour.py."""
    if collection_path.name == "vllm_cpu" and config.getoption("--vllm-tree", None) is None:
        return True
    return None
