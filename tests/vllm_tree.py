"""Helpers for the per-tree suites (tests/vllm_cpu, tests/gpu): what to expect of a fix in
the tree under test, and lookups of vLLM functions that moved between releases."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

from mla_serve.patching import catalog as catalog_

CATALOG = catalog_.load()


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
        if claim.status is catalog_.Status.AFFECTED:
            return False  # the bug is there, with no backport to apply
        return claim.status is catalog_.Status.UPSTREAM or self.state == "patched"


def mask_dcp_empty_shards() -> Callable[..., None]:
    """vLLM's `mask_dcp_empty_shards_`, wherever the tree's release keeps it."""
    for name in ("vllm.v1.attention.ops.dcp", "vllm.v1.attention.ops.common"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "mask_dcp_empty_shards_"):
            return module.mask_dcp_empty_shards_  # type: ignore[no-any-return]
    raise AssertionError("mask_dcp_empty_shards_ not found")
