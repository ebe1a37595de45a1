"""Public reports judged fixed in the releases that have the code, on vLLM's own code (the
table in patches/README.md, "Public reports against vLLM 0.30-0.33")."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch


def test_direct_dcp_a2a_combine_falls_back_to_nccl_above_its_buffer(monkeypatch):
    """vLLM issue 52377: the direct symmetric-memory DCP all-to-all sized its buffer for
    decode batches, and a forced-MQA step passed every token of the batch into it. From
    0.29.0 the combine hands batches over the buffer to the NCCL all-to-all."""
    try:
        dcp = importlib.import_module("vllm.v1.attention.ops.dcp")
    except ModuleNotFoundError:
        pytest.skip("no vllm.v1.attention.ops.dcp in this release (0.28.0's direct path is unused)")
    manager = getattr(dcp, "MLADCPManager", None)
    if manager is None or not hasattr(manager, "_direct_workspace_combine"):
        pytest.skip("no direct symmetric-memory DCP all-to-all combine in this release")
    calls: list[tuple[str, int]] = []

    def nccl(output, lse, **kwargs):
        calls.append(("nccl", output.shape[0]))
        return output

    def direct(output, *args):
        calls.append(("direct", output.shape[0]))
        return output

    monkeypatch.setattr(dcp, "dcp_a2a_lse_reduce", nccl)
    workspace = SimpleNamespace(max_num_tokens=4, lse_reduce=direct)
    combine = object.__new__(manager)
    combine.group = object()
    for tokens in (4, 9):
        combine._direct_workspace_combine(
            workspace, torch.zeros(tokens, 2, 8), torch.zeros(tokens, 2), True
        )
    assert calls == [("direct", 4), ("nccl", 9)]
