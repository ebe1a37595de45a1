"""vllm#52492 and #51318 (issue #52448) under real CUDA graphs.

003: the DeepSeek-V4 indexer's short-context decision is taken while a real
graph captures (torch.cuda.is_current_stream_capturing() is true for real); the
captured graph is then replayed for a long prefix. The shortcut runs vLLM's own
`_fill_short_context_topk_indices` Triton kernel; the scoring path after it
needs DeepGEMM's compiled kernels, so a stand-in scores candidates with plain
torch ops (capturable), enough to tell "scored" from "first topk".

004: vLLM's own C128A metadata kernel writes rows that a consumer captured at
one batch shape reads back on replay at another.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import scenarios
from tests.gpu.scenarios import TOPK


def test_indexer_replayed_for_a_long_prefix_selects_scored_candidates(expect, monkeypatch):
    if expect.release != "0.27.1":
        pytest.skip(
            "drives 0.27.1's indexer forward (the only affected release); later releases "
            "carry the fix upstream, proven by the CPU suite and the probe"
        )
    fixed = expect.fixed("dsv4-indexer-capture-shortcut")
    case = scenarios.DSV4IndexerCase(monkeypatch)
    case.capture()
    case.replay_long_prefix()
    selected = case.selected()
    if fixed:  # scored: the candidates nearest the query (position 8001 // 4 = 2000.25)
        assert torch.equal(selected, torch.arange(1745, 2257, device="cuda", dtype=torch.int32))
    else:  # the shortcut baked into the graph: always the first topk
        assert torch.equal(selected, torch.arange(TOPK, device="cuda", dtype=torch.int32))


@pytest.mark.parametrize("capture_len,replay_len", [(20 * 128, 300 * 128)])
def test_c128a_rows_replayed_at_another_batch_read_right(expect, capture_len, replay_len):
    fixed = expect.fixed("dsv4-c128a-capacity-stride")
    from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata

    ratio, capacity, tokens, block = 128, 1024, 4, 2
    table = torch.arange(tokens * 512, dtype=torch.int32, device="cuda").view(tokens, 512)
    decode = torch.full((8, capacity), -9, dtype=torch.int32, device="cuda")
    prefill = torch.full((8, capacity), -9, dtype=torch.int32, device="cuda")
    lens = torch.zeros(8, dtype=torch.int32, device="cuda")
    req = torch.arange(tokens, dtype=torch.int32, device="cuda")
    slots = torch.zeros(tokens, dtype=torch.long, device="cuda")

    def build(seq_len: int) -> torch.Tensor:
        # The width vLLM's 0.27.1 builder derives from the batch's longest sequence.
        width = min(max(1 << max(seq_len // ratio - 1, 0).bit_length(), 128), capacity)
        positions = torch.full((tokens,), seq_len - 1, dtype=torch.long, device="cuda")
        view, _, _ = build_c128a_topk_metadata(
            positions, ratio, tokens, req, table, block, slots, decode, lens, prefill,
            max_compressed_tokens=width,
        )  # fmt: skip
        return view

    captured = build(capture_len)  # metadata built before capture, at capture shape
    out = torch.zeros(tokens, 128, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the sparse decode consumer keeps this view's strides
        out.copy_(captured[:, :128])
    truth = build(replay_len)[:, :128].clone()  # metadata rebuilt for the replayed batch
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], truth[0])  # row 0 always lines up
    assert torch.equal(out[1:], truth[1:]) is fixed
