"""dsv4-zero-query-prefill-chunk on vLLM's own DeepSeek-V4 prefill code.

A request in the prefill region with no query tokens in the step (a KV connector still
loading it, a padded request slot) must never reach a sparse prefill kernel as a chunk of
its own: FlashMLA's SM90 kernel aborts on an empty query (vLLM issue 51486). The chunk plan
is vLLM's own (`DeepseekSparseSWAMetadata.get_prefill_chunk_plan`), and so is the prefill
that walks it (`_forward_prefill` of the FlashMLA layer and of its SM120 FlashInfer twin);
only the kernels themselves, which need a GPU, stand in here as a record of what they were
handed (tests/gpu/test_dsv4_prefill.py runs the real FlashMLA kernel).
"""

from __future__ import annotations

import importlib

import pytest
import torch

FIX = "dsv4-zero-query-prefill-chunk"
WINDOW, MAX_MODEL_LEN, MAX_BATCHED, CHUNK = 128, 4096, 16, 4
# Four requests with 4 query tokens after a long prefix fill a chunk's workspace area; a
# fifth with no query tokens (its KV still being loaded) does not fit beside them.
TRAILING = [4, 4, 4, 4, 0]
MANY_TRAILING = [4, 4, 4, 4, 0, 0, 0, 0, 0]
SEQ_LEN = 4000


def swa_metadata(query_lens: list[int], seq_len: int = SEQ_LEN):
    """vLLM's DeepSeek-V4 SWA metadata for a batch of prefill requests only."""
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    count, tokens = len(query_lens), sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = DeepseekSparseSWAMetadata(
        block_table=torch.zeros(count, SEQ_LEN // 64 + 1, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.long),
        block_size=64,
        seq_lens=torch.full((count,), seq_len, dtype=torch.int32),
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts,
        num_prefills=count,
        num_prefill_tokens=tokens,
        prefill_seq_lens=torch.full((count,), seq_len, dtype=torch.int32),
        prefill_seq_lens_cpu=torch.full((count,), seq_len, dtype=torch.int32),
        prefill_gather_lens=torch.full((count,), WINDOW, dtype=torch.int32),
        prefill_query_lens_cpu=torch.tensor(query_lens, dtype=torch.int32),
        prefill_window_size=WINDOW,
        prefill_max_model_len=MAX_MODEL_LEN,
        prefill_max_num_batched_tokens=MAX_BATCHED,
    )
    metadata.prefill_swa_indices = torch.zeros(tokens, 1, WINDOW, dtype=torch.int32)
    metadata.prefill_swa_lens = torch.zeros(tokens, dtype=torch.int32)
    return metadata


def queries_of(metadata, chunk: tuple[int, ...]) -> int:
    starts = metadata.query_start_loc_cpu
    return int(starts[chunk[1]] - starts[chunk[0]])


@pytest.mark.parametrize("compress_ratio", [1, 4, 128])
@pytest.mark.parametrize("query_lens", [TRAILING, MANY_TRAILING], ids=["one", "five"])
def test_prefill_chunk_plan_never_opens_a_chunk_without_query_tokens(
    expect, compress_ratio, query_lens
):
    fixed = expect.fixed(FIX)
    metadata = swa_metadata(query_lens)
    plan = metadata.get_prefill_chunk_plan(compress_ratio=compress_ratio, prefill_chunk_size=CHUNK)
    empty = [chunk for chunk in plan if queries_of(metadata, chunk) == 0]
    if not fixed:
        assert empty, plan  # the bug: a chunk of requests without query tokens
        return
    assert not empty, plan
    # Every request with query tokens is planned exactly once, in order, and each chunk's
    # width holds every request it gathers (those without query tokens inside it too).
    covered = [r for start, end, _, _ in plan for r in range(start, end)]
    assert covered == sorted(set(covered))
    assert {r for r, n in enumerate(query_lens) if n} <= set(covered)
    widths = metadata.get_prefill_chunk_plan(compress_ratio=compress_ratio, prefill_chunk_size=1)
    alone = {start: width for start, _, _, width in widths}
    for start, end, _, width in plan:
        assert all(alone.get(r, 0) <= width for r in range(start, end))


def test_prefill_chunk_plan_unchanged_when_every_request_has_queries(expect):
    expect.fixed(FIX)
    metadata = swa_metadata([4, 4, 4, 4, 4, 4])
    plan = metadata.get_prefill_chunk_plan(compress_ratio=4, prefill_chunk_size=CHUNK)
    assert [(start, end) for start, end, _, _ in plan] == [(0, 4), (4, 6)]


class KernelRecord:
    """Stands for a sparse prefill kernel, which needs a GPU: records the query rows of
    each launch and refuses an empty one, as FlashMLA's SM90 kernel does (it aborts)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, *args, **kwargs) -> None:
        query = kwargs.get("q", kwargs.get("query"))
        self.rows.append(int(query.shape[0]))
        if query.shape[0] == 0:
            raise RuntimeError("Failed to initialize the TMA descriptor (empty query)")


@pytest.fixture
def flashmla_layer(monkeypatch):
    """vLLM's DeepSeek-V4 FlashMLA attention layer, with the state its prefill reads, the
    workspace manager vLLM's runner sets up (on the CPU), and a record for the kernel."""
    module = importlib.import_module("vllm.models.deepseek_v4.nvidia.flashmla")
    workspace = importlib.import_module("vllm.v1.worker.workspace")
    monkeypatch.setattr(workspace, "_manager", None)
    workspace.init_workspace_manager(torch.device("cpu"))
    # Growing the workspace releases the accelerator's cache, which a CPU does not have.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    layer = object.__new__(module.DeepseekV4FlashMLAAttention)
    torch.nn.Module.__init__(layer)
    layer.__dict__.update(
        compress_ratio=1,  # an SWA-only layer: no indexer, no compressed cache
        window_size=WINDOW,
        max_image_tokens=0,
        max_num_batched_tokens=MAX_BATCHED,
        topk_indices_buffer=torch.zeros(MAX_BATCHED, 512, dtype=torch.int32),
        scale=1.0,
        attn_sink=torch.zeros(8),
    )
    kernel = KernelRecord()
    monkeypatch.setattr(module, "flash_mla_sparse_fwd", kernel)
    # The gathers are Triton kernels (a GPU); they write the workspace the kernel reads.
    monkeypatch.setattr(module, "dequantize_and_gather_k_cache", lambda *a, **k: None)
    monkeypatch.setattr(
        module,
        "combine_topk_swa_indices",
        lambda topk, *a, out, **k: (out[0], out[1]),
    )
    return layer, kernel


def run_prefill(layer, metadata) -> None:
    tokens = int(metadata.query_start_loc_cpu[-1])
    q = torch.zeros(tokens, 8, 512, dtype=torch.bfloat16)
    layer._forward_prefill(
        q=q,
        positions=torch.zeros(tokens, dtype=torch.long),
        compressed_k_cache=None,
        swa_k_cache=torch.zeros(1, 64, 584, dtype=torch.uint8),
        output=torch.zeros_like(q),
        attn_metadata=None,
        swa_metadata=metadata,
    )


def test_flashmla_prefill_launches_no_empty_chunk(expect, flashmla_layer):
    fixed = expect.fixed(FIX)
    layer, kernel = flashmla_layer
    metadata = swa_metadata(TRAILING)
    if not fixed:
        with pytest.raises(RuntimeError, match="empty query"):
            run_prefill(layer, metadata)
        assert kernel.rows == [16, 0]
        return
    run_prefill(layer, metadata)
    assert kernel.rows == [16]  # every query row of the step, in one launch


def test_flashmla_prefill_skips_an_empty_chunk_of_any_plan(expect, flashmla_layer, monkeypatch):
    """The prefill's own guard, whatever the planner hands it (upstream's defense in depth)."""
    fixed = expect.fixed(FIX)
    layer, kernel = flashmla_layer
    metadata = swa_metadata(TRAILING)
    plan = [(0, 2, 0, 131), (2, 4, 0, 131), (4, 5, 0, 127)]
    monkeypatch.setattr(type(metadata), "get_prefill_chunk_plan", lambda self, **kwargs: plan)
    if not fixed:
        with pytest.raises(RuntimeError, match="empty query"):
            run_prefill(layer, metadata)
        return
    run_prefill(layer, metadata)
    assert kernel.rows == [8, 8]


def test_flashmla_prefill_of_an_empty_plan_launches_nothing(expect, flashmla_layer, monkeypatch):
    fixed = expect.fixed(FIX)
    layer, kernel = flashmla_layer
    metadata = swa_metadata(TRAILING)
    monkeypatch.setattr(type(metadata), "get_prefill_chunk_plan", lambda self, **kwargs: [])
    if not fixed:
        with pytest.raises(AssertionError, match="chunk plan must be non-empty"):
            run_prefill(layer, metadata)
        return
    run_prefill(layer, metadata)
    assert kernel.rows == []


def test_sm120_flashinfer_prefill_launches_no_empty_chunk(expect, monkeypatch):
    """The SM120 twin chunks by request count (4 a chunk): the fifth request, with no
    query tokens, is a chunk of its own."""
    fixed = expect.fixed(FIX)
    module = importlib.import_module("vllm.models.deepseek_v4.nvidia.flashinfer_sparse")
    layer = object.__new__(module.DeepseekV4FlashInferSM120Attention)
    torch.nn.Module.__init__(layer)
    layer.__dict__.update(
        compress_ratio=1,
        topk_indices_buffer=None,
        scale=1.0,
        attn_sink=torch.zeros(8),
        _prepare_query=lambda q, output: q,
        _as_sparse_cache=lambda cache: cache,
        _get_workspace=lambda device: torch.zeros(1, dtype=torch.uint8),
    )
    kernel = KernelRecord()
    monkeypatch.setattr(module, "flashinfer_trtllm_batch_decode_sparse_mla_dsv4", kernel)
    metadata = swa_metadata(TRAILING)
    q = torch.zeros(16, 8, 512, dtype=torch.bfloat16)
    arguments = dict(
        q=q,
        compressed_k_cache=None,
        swa_k_cache=torch.zeros(1, 64, 584, dtype=torch.uint8),
        output=torch.zeros_like(q),
        attn_metadata=None,
        swa_metadata=metadata,
    )
    if not fixed:
        with pytest.raises(RuntimeError, match="empty query"):
            layer._forward_prefill(**arguments)
        assert kernel.rows == [16, 0]
        return
    layer._forward_prefill(**arguments)
    assert kernel.rows == [16]
