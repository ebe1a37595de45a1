"""mla_serve.sizing's workspace against vLLM's own `compute_trtllm_sparse_mla_workspace_bytes`.

Runs once per release and state (patched, pristine) in the child pytest started by
tests/test_vllm_behaviour.py: every tree that has the function, upstream or from our
dcp-workspace-sizing patch, must agree with the sizing model byte for byte.
"""

from __future__ import annotations

import importlib
import itertools

import pytest

from mla_serve import sizing

DCP = (1, 2, 4, 8)
HEADS = (16, 32, 64, 128)
TOKENS = (1, 4096, 8192, 32768)


@pytest.fixture
def backend(expect):
    fixed = expect.fixed("dcp-workspace-sizing")
    module = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse")
    if not hasattr(module, "compute_trtllm_sparse_mla_workspace_bytes"):
        assert not fixed, "the fix is claimed but the function is missing"
        pytest.skip(
            f"pristine vLLM {expect.release} has no compute_trtllm_sparse_mla_workspace_bytes "
            "(dcp-workspace-sizing not applied: a fixed 394 MiB buffer)"
        )
    return module


def _base(backend) -> int:
    """The base vLLM adds the slab to: upstream's name, or our 0.27.1-0.29.0 patch's."""
    for name in ("_DEFAULT_WORKSPACE_BUFFER_SIZE", "_BASE_WORKSPACE_BYTES"):
        if hasattr(backend, name):
            return int(getattr(backend, name))
    raise AssertionError("no base workspace constant next to the workspace function")


def test_workspace_matches_vllm_over_the_grid(backend):
    compute = backend.compute_trtllm_sparse_mla_workspace_bytes
    base = _base(backend)
    assert base == sizing.DEFAULT_WORKSPACE_BYTES
    for dcp, heads, tokens in itertools.product(DCP, HEADS, TOKENS):
        assert sizing.workspace_bytes(dcp, heads, tokens) == compute(base, dcp, heads, tokens), (
            dcp,
            heads,
            tokens,
        )
        assert sizing.workspace_bytes(dcp, heads, tokens, base=1 << 20) == compute(
            1 << 20, dcp, heads, tokens
        )


def test_default_base_is_vllms_env_default(backend, monkeypatch):
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    envs = importlib.import_module("vllm.envs")
    assert envs.VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE == sizing.DEFAULT_WORKSPACE_BYTES


def test_override_semantics_match_vllm(backend, backend_log, monkeypatch):
    _, records = backend_log
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    for dcp, heads, tokens in itertools.product((2, 4), (32, 64), (4096, 32768)):
        ours, warning = sizing.required_workspace_bytes(dcp, heads, tokens)
        assert ours == backend._required_workspace_bytes(dcp, heads, tokens)
        assert warning is None
    for override in (1 << 20, 3 << 30, 64 << 30):
        monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(override))
        ours, warning = sizing.required_workspace_bytes(4, 64, 32768, override=override)
        assert ours == backend._required_workspace_bytes(4, 64, 32768) == override
        assert (warning is not None) == (override < 17_594_056_704)
    assert records, "vLLM warns when the override is below the computed size"


def test_dsv4_page_sizes_match_vllms_specs(expect):
    """mla_serve.sizing.dsv4's 256-token pages against vLLM's own MLAAttentionSpec, as DeepSeek-V4's
    compressed layers (584 B fp8_ds_mla states, 576 B alignment) and its ratio-4 indexer
    (132 B states) build theirs."""
    import dataclasses

    import torch

    from mla_serve.sizing import dsv4

    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    fields = {f.name for f in dataclasses.fields(interface.MLAAttentionSpec)}
    if not {"tokens_per_state", "alignment", "state_content_bytes"} <= fields:
        pytest.skip(f"vLLM {expect.release}'s MLAAttentionSpec has no DeepSeek-V4 page fields")
    block = dsv4.PAGE_TOKENS
    for ratio in (4, 128):
        spec = interface.MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=512,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            cache_dtype_str="fp8_ds_mla",
            alignment=576,
            state_content_bytes=dsv4.PACKED_STATE_BYTES,
        )
        ours = dsv4.page_bytes_per_token(ratio, dsv4.PACKED_STATE_BYTES, 576)
        assert ours * block == spec.page_size_bytes, ratio
    indexer = interface.MLAAttentionSpec(
        block_size=block,
        num_kv_heads=1,
        head_size=132,
        dtype=torch.uint8,
        tokens_per_state=4,
        alignment=576,
    )
    assert dsv4.page_bytes_per_token(4, 132, 576) * block == indexer.page_size_bytes
