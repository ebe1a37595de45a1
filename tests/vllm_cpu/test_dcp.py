"""The DCP/PCP fixes (vllm#55879, workspace sizing from #50791) on vLLM's own code: empty DCP
shards, workspace size, rank tensor, PCP+DCP."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.vllm_tree import mask_dcp_empty_shards

GiB = 1 << 30
DEFAULT_WORKSPACE = 394 * 1024 * 1024


def test_empty_dcp_shard_masks_every_row(expect):
    fixed = expect.fixed("dcp-empty-shard-mask")
    mask = mask_dcp_empty_shards()
    lse = torch.zeros(4, 2)
    empty = torch.zeros(0, dtype=torch.int32)
    boundaries = torch.zeros(1, dtype=torch.int32)
    if not fixed:
        with pytest.raises(IndexError):
            mask(lse, empty, boundaries)
        return
    mask(lse, empty, boundaries)
    assert torch.isneginf(lse).all()


def test_non_empty_shards_are_masked_as_before(expect):
    expect.fixed("dcp-empty-shard-mask")  # skips where the function does not exist
    mask = mask_dcp_empty_shards()
    lse = torch.zeros(5, 2)
    # Two sequences: the first holds rows 0-1 with 3 local tokens, the second
    # rows 2-3 with none; row 4 is padding.
    mask(lse, torch.tensor([3, 0], dtype=torch.int32), torch.tensor([0, 2, 4], dtype=torch.int32))
    assert torch.isneginf(lse).all(dim=1).tolist() == [False, False, True, True, True]


def test_workspace_size_is_byte_exact_on_seed_002(expect):
    fixed = expect.fixed("dcp-workspace-sizing")
    backend = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse")
    compute = getattr(backend, "compute_trtllm_sparse_mla_workspace_bytes", None)
    if not fixed:
        assert compute is None  # the release only has the fixed 394 MiB buffer
        return
    assert compute(DEFAULT_WORKSPACE, 4, 64, 4096) == 2_561_671_168  # 2.39 GiB
    assert compute(DEFAULT_WORKSPACE, 4, 64, 32768) == 17_594_056_704  # 16.39 GiB
    assert round(2_561_671_168 / GiB, 2) == 2.39 and round(17_594_056_704 / GiB, 2) == 16.39
    assert compute(DEFAULT_WORKSPACE, 1, 64, 32768) == DEFAULT_WORKSPACE


def test_workspace_override_is_honoured_and_warned_when_too_small(expect, monkeypatch, backend_log):
    if not expect.fixed("dcp-workspace-sizing"):
        pytest.skip("no workspace sizing in the pristine release (see the byte-exact test)")
    backend, records = backend_log
    monkeypatch.delenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", raising=False)
    assert backend._required_workspace_bytes(4, 64, 4096) == 2_561_671_168
    assert not records

    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(3 * GiB))
    assert backend._required_workspace_bytes(4, 64, 4096) == 3 * GiB
    assert not records

    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", str(DEFAULT_WORKSPACE))
    assert backend._required_workspace_bytes(4, 64, 32768) == DEFAULT_WORKSPACE
    message = " ".join(r.getMessage() for r in records)
    assert "VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE" in message and "17594056704" in message


def test_workspace_buffer_grows_to_the_required_size(expect, monkeypatch):
    fixed = expect.fixed("dcp-workspace-sizing")
    backend = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse")
    monkeypatch.setenv("VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE", "4096")
    monkeypatch.setattr(backend, "_fi_sparse_workspace", None)
    cpu = torch.device("cpu")
    if not fixed:
        with pytest.raises(TypeError):  # no way to ask for more than the fixed size
            backend._get_workspace_buffer(cpu, 8192)
        return
    small = backend._get_workspace_buffer(cpu)
    assert small.numel() == 4096
    grown = backend._get_workspace_buffer(cpu, 8192)
    assert grown.numel() == 8192
    assert backend._get_workspace_buffer(cpu) is grown  # reused, never shrunk


def _no_tensor_construction(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.tensor() called on the decode hot path")

    monkeypatch.setattr(torch, "tensor", refuse)


def test_dcp_local_seq_lens_reuses_a_device_rank_tensor(expect, monkeypatch):
    fixed = expect.fixed("dcp-rank-device-tensor")
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq_lens = torch.tensor([0, 1, 5, 8, 13], dtype=torch.int32)
    reference = get_dcp_local_seq_lens(seq_lens, 4, 1, 1)
    rank = torch.tensor(1, dtype=torch.int32)
    _no_tensor_construction(monkeypatch)
    if not fixed:
        with pytest.raises(AssertionError, match="hot path"):
            get_dcp_local_seq_lens(seq_lens, 4, rank, 1)
        return
    assert torch.equal(get_dcp_local_seq_lens(seq_lens, 4, rank, 1), reference)
    assert reference.tolist() == [0, 0, 1, 2, 3]


def test_dcp_rank_tensor_of_the_wrong_kind_is_refused(expect):
    if not expect.fixed("dcp-rank-device-tensor"):
        pytest.skip("the pristine helper takes only int ranks")
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq_lens = torch.tensor([5, 8], dtype=torch.int32)
    with pytest.raises((ValueError, AssertionError)):
        get_dcp_local_seq_lens(seq_lens, 4, torch.tensor([1, 2], dtype=torch.int32), 1)


def test_indexer_decode_localization_builds_no_tensor(expect, monkeypatch):
    """The indexer metadata builder's per-batch path, run on a builder's state."""
    fixed = expect.fixed("dcp-rank-device-tensor")
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder

    builder = object.__new__(DeepseekV32IndexerMetadataBuilder)
    builder.dcp_world_size = 4
    builder.dcp_rank = 1
    builder.cp_kv_cache_interleave_size = 1
    builder.decode_seq_lens_buffer = torch.zeros(16, dtype=torch.int32)
    if fixed:  # what the patched __init__ materializes once
        builder.dcp_rank_tensor = torch.tensor(1, dtype=torch.int32)
    _no_tensor_construction(monkeypatch)
    seq_lens = torch.zeros(16, dtype=torch.int32)
    seq_lens[:3] = torch.arange(11, 14, dtype=torch.int32)
    if not fixed:
        with pytest.raises(AssertionError, match="hot path"):
            builder._dcp_localize_decode_seq_lens(seq_lens[:3], 3, False)
        return
    out = builder._dcp_localize_decode_seq_lens(seq_lens[:3], 3, False)
    assert out.tolist() == [3, 3, 3]  # 11, 12, 13 tokens over 4 ranks, rank 1


def _backend_verdict(pcp: int, dcp: int) -> str | None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
        FlashInferMLASparseTRTLLMBackend,
    )

    parallel = ParallelConfig.__new__(ParallelConfig)
    object.__setattr__(parallel, "prefill_context_parallel_size", pcp)
    object.__setattr__(parallel, "decode_context_parallel_size", dcp)
    config = VllmConfig.__new__(VllmConfig)
    object.__setattr__(config, "parallel_config", parallel)
    object.__setattr__(config, "model_config", None)
    with set_current_vllm_config(config):
        return FlashInferMLASparseTRTLLMBackend.supports_combination(
            576, torch.bfloat16, "auto", 64, True, False, True, False, DeviceCapability(10, 0)
        )


def test_flashinfer_sparse_rejects_pcp_with_dcp_and_names_the_fallback(expect):
    fixed = expect.fixed("pcp-dcp-backend-reject")
    verdict = _backend_verdict(pcp=4, dcp=4)
    if not fixed:
        assert verdict is None  # accepted: the first mixed batch hangs in NCCL
        return
    assert verdict is not None and "FLASHMLA_SPARSE" in verdict
    assert _backend_verdict(pcp=4, dcp=1) is None
    assert _backend_verdict(pcp=1, dcp=4) is None


def test_pcp_dcp_warmup_includes_the_normalized_key(expect, monkeypatch):
    expect.fixed("pcp-dcp-warmup-keys")  # skips on releases without the PCP chunk plan
    from types import SimpleNamespace

    indexer = importlib.import_module("vllm.v1.attention.backends.mla.indexer")
    monkeypatch.setattr(indexer, "get_dcp_group", lambda: SimpleNamespace(rank_in_group=2))
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=4096),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(compress_ratios=None, index_kpool=None),
            hf_config=SimpleNamespace(compress_ratios=None),
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=4,
            prefill_context_parallel_size=2,
            cp_kv_cache_interleave_size=1,
        ),
    )
    keys = indexer.BuildPrefillChunkMetadataKernel().get_warmup_keys(config)
    # Keys hold Triton's specialization of each scalar (1, divisible by 16, other).
    rep = indexer.triton_scalar_specialization_rep
    assert {(k.dcp_rank, k.dcp_world) for k in keys} == {(rep(2), rep(4)), (rep(0), rep(1))}
    assert len({k.input_variant for k in keys}) == 4
