"""The DCP fixes (vllm#55879) on the GPU: the empty-shard mask and the device rank tensor."""

from __future__ import annotations

import pytest
import torch

from tests.vllm_tree import mask_dcp_empty_shards


def test_empty_dcp_shard_on_the_gpu(expect):
    fixed = expect.fixed("dcp-empty-shard-mask")
    lse = torch.zeros(16, 64, device="cuda")
    empty = torch.zeros(0, dtype=torch.int32, device="cuda")
    boundaries = torch.zeros(1, dtype=torch.int32, device="cuda")
    if not fixed:
        with pytest.raises((IndexError, RuntimeError)):
            mask_dcp_empty_shards()(lse, empty, boundaries)
            torch.cuda.synchronize()
        return
    mask_dcp_empty_shards()(lse, empty, boundaries)
    assert torch.isneginf(lse).all()


def test_decode_localization_makes_no_host_to_device_copy(expect):
    fixed = expect.fixed("dcp-rank-device-tensor")
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder

    builder = object.__new__(DeepseekV32IndexerMetadataBuilder)
    builder.dcp_world_size, builder.dcp_rank, builder.cp_kv_cache_interleave_size = 4, 1, 1
    builder.decode_seq_lens_buffer = torch.zeros(64, dtype=torch.int32, device="cuda")
    if fixed:
        builder.dcp_rank_tensor = torch.tensor(1, dtype=torch.int32, device="cuda")
    seq_lens = torch.arange(11, 75, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing copy now raises
    try:
        if not fixed:
            with pytest.raises(RuntimeError, match="synchroniz"):
                builder._dcp_localize_decode_seq_lens(seq_lens, 64, False)
            return
        out = builder._dcp_localize_decode_seq_lens(seq_lens, 64, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = [(n // 4) + (1 if n % 4 > 1 else 0) for n in range(11, 75)]
    assert out.tolist() == expected
