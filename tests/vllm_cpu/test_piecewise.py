"""vllm#56825 on vLLM's own index group: which sync the topk conversion uses.

On the CPU the CUDA stream and events are stand-ins that record the calls made
on them; the real failure (an eager wait on a graph-local event raising
`CUDA error: invalid argument`) needs a GPU and is covered by the GPU suite.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch


class Recorder:
    """Stands in for a torch.Stream / torch.Event and records what is asked of it."""

    def __init__(self, name: str, log: list[tuple[str, str, object]]) -> None:
        self.name, self.log = name, log

    def record(self, stream: object = None) -> None:
        self.log.append((self.name, "record", stream))

    def wait_event(self, event: object) -> None:
        self.log.append((self.name, "wait_event", getattr(event, "name", event)))

    def wait_stream(self, stream: object) -> None:
        self.log.append((self.name, "wait_stream", getattr(stream, "name", stream)))

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _run_group(monkeypatch, mode_name: str | None) -> list[tuple[str, str, object]]:
    from vllm import forward_context
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.mla import index_group

    log: list[tuple[str, str, object]] = []
    compute = Recorder("compute", log)
    monkeypatch.setattr(index_group, "current_stream", lambda: compute)
    monkeypatch.setattr(
        index_group,
        "triton_convert_req_index_to_global_index",
        lambda *a, **k: log.append(("kernel", "convert", None)),
    )
    context = (
        None
        if mode_name is None
        else SimpleNamespace(cudagraph_runtime_mode=getattr(CUDAGraphMode, mode_name))
    )
    monkeypatch.setattr(forward_context, "_forward_context", context)

    state = {
        "logical_topk_indices": torch.zeros(4, 8, dtype=torch.int32),
        "physical_topk_indices": torch.zeros(4, 8, dtype=torch.int32),
        "valid_topk_counts": torch.zeros(4, dtype=torch.int32),
        "request_ids": torch.zeros(4, dtype=torch.int32),  # 0.30.0 only
        "side_stream": Recorder("side", log),
        "logical_topk_ready": Recorder("logical_topk_ready", log),
        "physical_topk_ready": Recorder("physical_topk_ready", log),
        "has_indexer": True,
    }
    names = {f.name for f in dataclasses.fields(index_group.SparseMLAIndexGroup)}
    group = index_group.SparseMLAIndexGroup(**{k: v for k, v in state.items() if k in names})
    group.set_logical_topk_ready(0)  # the indexer, inside a captured segment
    group._convert_once(  # the consumer, in the following eager break
        0,
        torch.zeros(2, 8, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, 1, dtype=torch.int32),
        64,
        block_stride_rows=None,
        return_valid_counts=False,
    )
    return log


def test_piecewise_capture_never_touches_the_graph_local_event(expect, monkeypatch):
    assert expect.fixed("piecewise-topk-event")  # only releases carrying the code get here
    log = _run_group(monkeypatch, "PIECEWISE")
    assert ("logical_topk_ready", "record", log[0][2]) not in log
    assert ("side", "wait_event", "logical_topk_ready") not in log
    assert ("side", "wait_stream", "compute") in log
    assert log.index(("side", "wait_stream", "compute")) < log.index(("kernel", "convert", None))


@pytest.mark.parametrize("mode", ["FULL", None])
def test_full_and_eager_modes_keep_the_fine_grained_event(expect, monkeypatch, mode):
    expect.fixed("piecewise-topk-event")
    log = _run_group(monkeypatch, mode)
    assert log[0][:2] == ("logical_topk_ready", "record")
    assert ("side", "wait_event", "logical_topk_ready") in log
    assert ("side", "wait_stream", "compute") not in log
