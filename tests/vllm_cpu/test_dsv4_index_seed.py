"""dsv4-prefill-index-seed on vLLM's own DeepSeek-V4 and V4.1 prefill code.

`_forward_prefill` (FlashMLA) hands `combine_topk_swa_indices` one workspace for the
combined indices of every chunk and step. vLLM's Triton kernel behind it writes each row's
valid entries only (masked stores), so whatever the function does not seed stays from an
earlier chunk, and the sparse prefill kernel reads indices that lie past the chunk's
gathered KV (vLLM issue 55299: illegal memory access with many chunks). Here the prefill,
its chunk plan, the workspace manager and `combine_topk_swa_indices` are vLLM's own; the two
kernels, which need a GPU, stand in: the combine kernel writes what vLLM's writes (the SWA
window of each query token, as its docstring and code lay it out), the sparse prefill keeps
a record of the indices it is handed.
"""

from __future__ import annotations

import importlib

import pytest
import torch

FIX = "dsv4-prefill-index-seed"
WINDOW, MAX_MODEL_LEN, MAX_BATCHED, BLOCK = 128, 4096, 16, 64
PACKAGES = {"deepseek_v4": 1, "deepseek_v41": 0}  # each package's SWA-only compress ratio


def swa_metadata(query_lens: list[int], prefix: int):
    """vLLM's SWA metadata for a step of prefill requests, each after `prefix` tokens."""
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    count, tokens = len(query_lens), sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([prefix + n for n in query_lens], dtype=torch.int32)
    gather = torch.tensor([n + min(prefix, WINDOW - 1) for n in query_lens], dtype=torch.int32)
    metadata = DeepseekSparseSWAMetadata(
        block_table=torch.zeros(count, MAX_MODEL_LEN // BLOCK, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        block_size=BLOCK,
        seq_lens=seq_lens.clone(),
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        num_prefills=count,
        num_prefill_tokens=tokens,
        prefill_seq_lens=seq_lens.clone(),
        prefill_seq_lens_cpu=seq_lens,
        prefill_gather_lens=gather,
        prefill_query_lens_cpu=torch.tensor(query_lens, dtype=torch.int32),
        prefill_window_size=WINDOW,
        prefill_max_model_len=MAX_MODEL_LEN,
        prefill_max_num_batched_tokens=MAX_BATCHED,
    )
    metadata.prefill_swa_indices = torch.zeros(tokens, 1, WINDOW, dtype=torch.int32)
    metadata.prefill_swa_lens = torch.zeros(tokens, dtype=torch.int32)
    return metadata


def combine_kernel(indices, lens, topk, query_start_loc, seq_lens, gather_lens, M, N, **keys):
    """What vLLM's combine kernel writes for an SWA-only layer (TOP_K = 0): per query token,
    its window's positions in the chunk's gathered KV (request b's rows start at M * b, its
    SWA part at N), and the count; every other entry of the row is left as it was."""
    assert keys["TOP_K"] == 0
    base = int(query_start_loc[0])
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]) - base, int(query_start_loc[b + 1]) - base
        seq_len, gather_len = int(seq_lens[b]), int(gather_lens[b])
        for token in range(start, end):
            position = seq_len - (end - start) + token - start
            swa_start = max(position - (keys["WINDOW_SIZE"] - 1), 0)
            count = position - swa_start + 1
            first = M * b + N + swa_start - (seq_len - gather_len)
            indices[token, :count] = torch.arange(first, first + count, dtype=indices.dtype)
            lens[token] = count


class PrefillRecord:
    """Stands for flash_mla_sparse_fwd: keeps each launch's indices, lengths and KV rows."""

    def __init__(self) -> None:
        self.launches: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def __call__(self, **kwargs) -> None:
        indices = kwargs["indices"].squeeze(1).clone()
        self.launches.append((indices, kwargs["topk_length"].clone(), kwargs["kv"].shape[0]))


def prefill_layer(package: str, monkeypatch):
    """The package's FlashMLA attention layer over the CPU workspace manager, with the two
    kernels standing in; None where the tree has no such package."""
    try:
        module = importlib.import_module(f"vllm.models.{package}.nvidia.flashmla")
    except ModuleNotFoundError:
        return None
    cache_utils = importlib.import_module(f"vllm.models.{package}.common.ops.cache_utils")
    workspace = importlib.import_module("vllm.v1.worker.workspace")
    monkeypatch.setattr(workspace, "_manager", None)
    workspace.init_workspace_manager(torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no device cache
    layer = object.__new__(module.DeepseekV4FlashMLAAttention)
    torch.nn.Module.__init__(layer)
    layer.__dict__.update(
        compress_ratio=PACKAGES[package],  # an SWA-only layer: no indexer, no compressed KV
        window_size=WINDOW,
        max_image_tokens=0,
        max_num_batched_tokens=MAX_BATCHED,
        topk_indices_buffer=torch.zeros(MAX_BATCHED, 512, dtype=torch.int32),
        scale=1.0,
        attn_sink=torch.zeros(8),
        _prefill_num_heads=8,  # V4.1 from 0.33.0: the heads its prefill launches
    )
    record = PrefillRecord()
    monkeypatch.setattr(module, "flash_mla_sparse_fwd", record)
    monkeypatch.setattr(module, "dequantize_and_gather_k_cache", lambda *a, **k: None)
    monkeypatch.setattr(cache_utils, "_COMBINE_TOPK_SWA_INDICES_KERNEL", combine_kernel)
    return layer, record


def run_step(layer, metadata) -> None:
    tokens = int(metadata.query_start_loc_cpu[-1])
    q = torch.zeros(tokens, 8, 512, dtype=torch.bfloat16)
    layer._forward_prefill(
        q=q,
        positions=torch.zeros(tokens, dtype=torch.long),
        compressed_k_cache=None,
        swa_k_cache=torch.zeros(1, BLOCK, 584, dtype=torch.uint8),
        output=torch.zeros_like(q),
        attn_metadata=None,
        swa_metadata=metadata,
    )


def stale_entries(indices: torch.Tensor, lengths: torch.Tensor, kv_rows: int) -> int:
    """Entries the kernel is handed past each row's length that are not -1; asserts that the
    valid ones index the chunk's gathered KV."""
    columns = torch.arange(indices.shape[1])
    valid = columns[None, :] < lengths[:, None]
    assert bool(((indices >= 0) & (indices < kv_rows))[valid].all())
    return int((indices[~valid] != -1).sum())


def stale_after_two_steps(layer, record) -> dict[str, int]:
    """A long step (four requests after a 3,996-token prefix: full windows, indices up to
    the fourth request's rows, 523), then a short one (one request after 10 tokens: 14
    gathered rows): what the second step's launch is handed past each row's length."""
    run_step(layer, swa_metadata([4, 4, 4, 4], prefix=3996))
    run_step(layer, swa_metadata([4], prefix=10))
    indices, lengths, kv_rows = record.launches[-1]
    assert lengths.tolist() == [11, 12, 13, 14] and kv_rows == 14
    return {
        "stale": stale_entries(indices, lengths, kv_rows),
        "past the gathered KV": int((indices >= kv_rows).sum()),
    }


def test_the_sparse_prefill_is_handed_no_earlier_chunks_indices(expect, monkeypatch):
    fixed = expect.fixed(FIX)
    shown = {}
    for package in PACKAGES:
        built = prefill_layer(package, monkeypatch)
        if built is not None:
            shown[package] = stale_after_two_steps(*built)
    assert shown, "no DeepSeek-V4 FlashMLA prefill in this tree"
    if fixed:
        assert all(seen["stale"] == 0 for seen in shown.values()), shown
        return
    # The bug: some package's prefill hands the kernel entries past the rows' lengths that
    # are not -1 (whatever the shared workspace held there from the first step: on 0.27.1
    # to 0.29.0 some lie past the 14 gathered rows).
    assert any(seen["stale"] > 0 for seen in shown.values()), shown


@pytest.mark.parametrize("package", list(PACKAGES))
def test_one_step_hands_only_valid_indices_and_minus_one(expect, monkeypatch, package):
    """A first step on a fresh workspace: every row's valid entries index the chunk's KV
    and, where the function seeds the workspace, the rest are -1."""
    expect.fixed(FIX)
    built = prefill_layer(package, monkeypatch)
    if built is None:
        pytest.skip(f"no vllm.models.{package} in this release")
    layer, record = built
    run_step(layer, swa_metadata([4, 4, 4, 4], prefix=3996))
    ((indices, lengths, kv_rows),) = record.launches
    assert lengths.tolist() == [128] * 16
    assert kv_rows == 4 * 131  # four requests of 4 + 127 gathered rows, one chunk
    stale_entries(indices, lengths, kv_rows)
