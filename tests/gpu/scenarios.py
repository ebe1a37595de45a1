"""GPU scenarios shared by the tests and the benchmarks.

Each builds real vLLM objects on the GPU and drives them the way the engine
does (capture segments, eager breaks, replays). `python scenarios.py NAME`
runs one in a fresh process, for cases expected to crash the CUDA context.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

NUM_TOKENS, NUM_TOPK, NUM_REQUESTS, BLOCKS_PER_REQ, BLOCK_SIZE = 8, 128, 4, 4, 16


@dataclass
class IndexGroupCase:
    group: Any
    layer: int
    logical: torch.Tensor
    metadata: Any
    expected: torch.Tensor

    def convert(self) -> torch.Tensor:
        return self.group.convert_logical_to_physical_topk(
            self.layer, self.logical, self.metadata, block_stride_rows=None,
            return_valid_counts=False,
        )  # fmt: skip

    def result(self) -> torch.Tensor:
        return self.group.physical_topk_indices[:NUM_TOKENS]


def index_group_case() -> IndexGroupCase:
    """A sparse-MLA index group whose indexer layer produced `logical` topk indices."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    generator = torch.Generator().manual_seed(0)
    logical = torch.randint(
        0, BLOCK_SIZE * BLOCKS_PER_REQ, (NUM_TOKENS, NUM_TOPK), generator=generator,
        dtype=torch.int32,
    ).cuda()  # fmt: skip
    group, layer = SparseMLAIndexGroupBuilder(logical).register_layer(is_index_producing_layer=True)
    req_id = (torch.arange(NUM_TOKENS, dtype=torch.int32) % NUM_REQUESTS).cuda()
    blocks = torch.randperm(NUM_REQUESTS * BLOCKS_PER_REQ, generator=generator)
    block_table = blocks.to(torch.int32).view(NUM_REQUESTS, BLOCKS_PER_REQ).cuda()
    metadata = SimpleNamespace(
        req_id_per_token=req_id, block_table=block_table, block_size=BLOCK_SIZE
    )
    expected = triton_convert_req_index_to_global_index(
        req_id, block_table, logical, BLOCK_SIZE=BLOCK_SIZE, NUM_TOPK_TOKENS=NUM_TOPK
    )
    return IndexGroupCase(group, layer, logical, metadata, expected)


def vllm_config() -> Any:
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cuda"))


@contextlib.contextmanager
def piecewise_mode() -> Iterator[None]:
    """A capture stream vLLM tracks, and a forward context in PIECEWISE mode, as in serving."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    with (
        torch.cuda.stream(torch.cuda.Stream()),
        set_forward_context(None, vllm_config(), cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE),
    ):
        yield


def breakable_capture() -> Any:
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    return BreakableCUDAGraphCapture()


def capture_piecewise(case: IndexGroupCase) -> torch.Tensor:
    """Indexer inside a captured segment, conversion in the next eager break, replayed."""
    marker = torch.zeros(1, device="cuda")
    with piecewise_mode():
        capture = breakable_capture()
        with capture:
            marker.add_(1)
            case.group.set_logical_topk_ready(case.layer)  # recorded inside the segment
            capture.add_eager(case.convert)
            marker.add_(1)
        case.group.physical_topk_indices.fill_(-7)
        capture.replay()
        torch.cuda.synchronize()
    return case.result()


@dataclass
class HiSparseCase:
    """vLLM's HiSparseRuntime staging one layer on its group's copy stream.

    The host-cache residency work is replaced by a copy of the request ids the
    method staged on the copy stream: a GPU op ordered by the same stream sync.
    """

    runtime: Any
    ready: torch.Event
    req_id: torch.Tensor
    out: torch.Tensor
    valid_rows: torch.Tensor

    def stage(self) -> None:
        self.runtime._resolve_and_stage_group(
            resident=SimpleNamespace(decode_batch=False),
            req_id_per_token=self.req_id,
            block_table=torch.zeros(NUM_REQUESTS, BLOCKS_PER_REQ, dtype=torch.int32, device="cuda"),
            logical_topk_indices=torch.zeros(
                NUM_TOKENS, NUM_TOPK, dtype=torch.int32, device="cuda"
            ),
            block_size=BLOCK_SIZE,
            return_valid_counts=False,
            shared_rows=slice(0, NUM_TOKENS),
            attention_indices_out=None,
            valid_counts_out=None,
            num_valid_rows=self.valid_rows,
        )

    def expected(self) -> torch.Tensor:
        ids = self.req_id.clone()
        ids[int(self.valid_rows) :] = -1
        return ids


def hisparse_case() -> HiSparseCase:
    from vllm.v1.hisparse import runtime as hisparse

    ready = torch.Event()
    group = hisparse.HiSparseIndexGroup(
        torch.device("cuda"), max_num_reqs=NUM_REQUESTS, region_stride=64,
        max_swap_rows=NUM_TOKENS, top_k=NUM_TOPK, logical_topk_ready=ready,
    )  # fmt: skip
    runtime = object.__new__(hisparse.HiSparseRuntime)
    runtime.index_group = group
    runtime._layer_ready_event = None
    runtime._swap_staged = False
    out = torch.full((NUM_TOKENS,), -9, dtype=torch.int32, device="cuda")
    runtime._resolve_residency = lambda **kw: out.copy_(kw["req_id_per_token"])
    runtime._swap_rows = lambda rows: None
    req_id = (torch.arange(NUM_TOKENS, dtype=torch.int32) % NUM_REQUESTS).cuda()
    valid = torch.tensor(6, dtype=torch.int32, device="cuda")
    return HiSparseCase(runtime, ready, req_id, out, valid)


def capture_hisparse_piecewise(case: HiSparseCase) -> torch.Tensor:
    """Indexer records topk-ready in a segment; staging runs in the next eager break."""
    with piecewise_mode():
        capture = breakable_capture()
        with capture:
            case.req_id.add_(0)
            case.ready.record(torch.cuda.current_stream())  # what the indexer does
            capture.add_eager(case.stage)
        case.out.fill_(-7)
        capture.replay()
        torch.cuda.synchronize()
    return case.out


TOPK, RATIO, TOKENS, CANDIDATES = 512, 4, 4, 4096


class DSV4IndexerCase:
    """vLLM 0.27.1's DeepseekV4Indexer.forward with a stand-in for DeepGEMM scoring."""

    def __init__(self, monkeypatch: Any) -> None:
        from vllm.models.deepseek_v4 import attention

        indexer = object.__new__(attention.DeepseekV4Indexer)
        torch.nn.Module.__init__(indexer)

        def score(hidden: Any, q_quant: torch.Tensor, k: Any, weights: Any) -> torch.Tensor:
            # Prefer the candidates nearest each query's position (capturable torch ops).
            candidates = torch.arange(CANDIDATES, device="cuda").float()
            scores = -((q_quant.float()[:, None] / RATIO) - candidates[None, :]).abs()
            top = torch.topk(scores, TOPK, dim=1).indices.int()
            indexer.topk_indices_buffer[:TOKENS] = top
            return indexer.topk_indices_buffer

        indexer.__dict__.update(
            compressor=lambda *args: None,
            k_cache=SimpleNamespace(prefix="layers.0.indexer.k_cache"),
            compress_ratio=RATIO,
            topk_tokens=TOPK,
            topk_indices_buffer=torch.full((TOKENS, TOPK), -1, dtype=torch.int32, device="cuda"),
            wq_b=lambda qr: (qr, None),
            n_head=1,
            head_dim=8,
            eager_scratch_pool=None,
            use_fp4_kv=False,
            softmax_scale=1.0,
            aux_stream=None,
            ln_events=[torch.cuda.Event(), torch.cuda.Event()],
            indexer_op=score,
        )
        monkeypatch.setattr(
            attention, "fused_indexer_q_rope_quant", lambda positions, *a, **k: (positions, None)
        )
        # Capture-time metadata is short: 1024 // 4 = 256 candidates <= topk 512.
        metadata = SimpleNamespace(max_seq_len=1024, num_decode_tokens=TOKENS, num_prefill_tokens=0)
        context = SimpleNamespace(attn_metadata={"layers.0.indexer.k_cache": metadata})
        monkeypatch.setattr(attention, "get_forward_context", lambda: context)
        self.indexer = indexer
        self.positions = torch.full((TOKENS,), 1000, dtype=torch.long, device="cuda")
        self.hidden = torch.zeros(TOKENS, 8, device="cuda")
        self.graph = torch.cuda.CUDAGraph()

    def forward(self) -> None:
        h = self.hidden
        self.indexer.forward(h, h, h, h, self.positions, SimpleNamespace(cos_sin_cache=None))

    def capture(self) -> None:
        self.forward()  # eager warm-up, as vLLM does before capture
        with torch.cuda.graph(self.graph):
            self.forward()

    def replay_long_prefix(self) -> None:
        self.positions.fill_(8001)  # a cached prefix of 8000 tokens: 2000 candidates
        self.graph.replay()
        torch.cuda.synchronize()

    def selected(self) -> torch.Tensor:
        return self.indexer.topk_indices_buffer[0].sort().values


def main(name: str) -> None:
    if name == "piecewise-without-guard":
        # The pre-fix code path: wait on the event even in piecewise mode.
        from vllm.v1.attention.backends.mla import index_group

        index_group.in_piecewise_cudagraph = lambda: False
        case = index_group_case()
        result = capture_piecewise(case)
        torch.cuda.synchronize()
        print("matches:", bool(torch.equal(result, case.expected)))
        return
    if name == "hisparse-without-guard":
        from vllm.v1.hisparse import runtime as hisparse

        hisparse.in_piecewise_cudagraph = lambda: False
        case = hisparse_case()
        result = capture_hisparse_piecewise(case)
        print("matches:", bool(torch.equal(result, case.expected())))
        return
    raise SystemExit(f"unknown scenario {name}")


if __name__ == "__main__":
    main(sys.argv[1])
