"""What each fix costs on the GPU, for one vLLM tree (run by tests/gpu/run.sh).

    python -m tests.gpu.bench_gpu --release R --state S --vllm-tree DIR --out FILE   # repo root

- topk conversion: side stream ordered by the fine-grained event (FULL/eager)
  vs by `wait_stream` (the piecewise fix), vLLM 0.30.0+ index group;
- C128A metadata: build + a consumer reading the rows at the width the tree's builder
  asks for: packed at the batch's width (pristine 0.27.1), the batch's width at the
  capacity stride (upstream's final form: 0.29.0 on, patched 0.27.1), the whole
  capacity (upstream's first form, 0.28.0);
- DeepSeek-V4 indexer during capture: the captured shortcut vs the captured
  scoring path (a torch stand-in for DeepGEMM's scoring), capture and replay.

Medians of CUDA-event timings over repeated runs after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.gpu import scenarios


def gpu_median_us(work: Callable[[], object], runs: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        work()
    torch.cuda.synchronize()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000)
    return round(statistics.median(samples), 2)


def topk_convert() -> dict[str, float]:
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    case = scenarios.index_group_case()

    def step() -> None:
        case.group.set_logical_topk_ready(case.layer)
        case.convert()

    # vLLM tracks the compute stream it is told about (as the engine does).
    with torch.cuda.stream(torch.cuda.Stream()):
        event = gpu_median_us(step)
        with set_forward_context(
            None, scenarios.vllm_config(), cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE
        ):
            stream = gpu_median_us(step)
    return {"wait_event_us": event, "wait_stream_us": stream}


def c128a_builder_width(active: int, capacity: int) -> int:
    """The width this tree's metadata builder passes for a batch: the adaptive one, or the
    whole capacity (upstream's first form, 0.28.0), read from the builder's own code."""
    import inspect

    from vllm.models.deepseek_v4 import sparse_mla

    builder = getattr(sparse_mla, "DeepseekV4SparseMLAMetadataBuilder", None) or (
        sparse_mla.DeepseekV4FlashMLAMetadataBuilder
    )
    source = inspect.getsource(builder._build_c128a_metadata)
    return capacity if "max_compressed_tokens=self.c128a_max_compressed" in source else active


def c128a(fixed: bool) -> dict[str, float | int]:
    from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata

    ratio, capacity, tokens, block, seq_len = 128, 8192, 64, 2, 300 * 128
    width = c128a_builder_width(512, capacity)  # 512: next power of two of 300 rows
    table = torch.arange(tokens * 4096, dtype=torch.int32, device="cuda").view(tokens, 4096)
    decode = torch.zeros((tokens, capacity), dtype=torch.int32, device="cuda")
    prefill = torch.zeros((tokens, capacity), dtype=torch.int32, device="cuda")
    lens = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    req = torch.arange(tokens, dtype=torch.int32, device="cuda")
    slots = torch.zeros(tokens, dtype=torch.long, device="cuda")
    positions = torch.full((tokens,), seq_len - 1, dtype=torch.long, device="cuda")
    sink = torch.zeros(tokens, dtype=torch.int64, device="cuda")

    def build() -> torch.Tensor:
        view, _, _ = build_c128a_topk_metadata(
            positions, ratio, tokens, req, table, block, slots, decode, lens, prefill,
            max_compressed_tokens=width,
        )  # fmt: skip
        return view

    view = build()
    return {
        "width": width,
        "row_stride": view.stride(0),
        "build_us": gpu_median_us(build),
        "consumer_read_us": gpu_median_us(lambda: torch.sum(view, dim=1, out=sink)),
    }


def indexer_capture() -> dict[str, float]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        captures, replays = [], []
        for _ in range(20):
            case = scenarios.DSV4IndexerCase(monkeypatch)
            case.forward()
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.cuda.graph(case.graph):
                case.forward()
            torch.cuda.synchronize()
            captures.append((time.perf_counter() - start) * 1e6)
            replays.append(gpu_median_us(case.graph.replay, runs=50, warmup=5))
    return {
        "capture_us": round(statistics.median(captures), 1),
        "replay_us": round(statistics.median(replays), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--release", required=True)
    parser.add_argument("--state", required=True, choices=("pristine", "patched"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm-tree", type=Path, required=True)
    args = parser.parse_args()
    # Not a bootstrap: the tree under test goes first on the path, as conftest's --vllm-tree
    # does for the GPU suite, so that `vllm` below is that tree's.
    sys.path.insert(0, str(args.vllm_tree.resolve()))
    from tests.vllm_tree import Expect

    expect = Expect(args.release, args.state)
    figures: dict[str, object] = {"release": args.release, "state": args.state}
    benches: list[tuple[str, str, Callable[[bool], object]]] = [
        ("topk_convert", "piecewise-topk-event", lambda fixed: topk_convert()),
        ("c128a_metadata", "dsv4-c128a-capacity-stride", c128a),
    ]
    if args.release == "0.27.1":
        benches.append(
            ("indexer_capture", "dsv4-indexer-capture-shortcut", lambda fixed: indexer_capture())
        )
    for name, fix_id, bench in benches:
        try:
            fixed = expect.fixed(fix_id)
        except pytest.skip.Exception as skipped:
            figures[name] = {"skipped": str(skipped)}
            continue
        figures[name] = {"fixed": fixed, **bench(fixed)}  # type: ignore[dict-item]
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
