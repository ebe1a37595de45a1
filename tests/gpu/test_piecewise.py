"""vllm#56825 under real CUDA graphs (vLLM 0.30.0+ carries the code and the fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import scenarios


def test_piecewise_capture_converts_right_with_the_guard(expect):
    assert expect.fixed("piecewise-topk-event")
    case = scenarios.index_group_case()
    result = scenarios.capture_piecewise(case)
    assert torch.equal(result, case.expected)


def test_hisparse_copy_stream_stages_right_with_the_guard(expect):
    assert expect.fixed("piecewise-topk-event")
    case = scenarios.hisparse_case()
    result = scenarios.capture_hisparse_piecewise(case)
    assert torch.equal(result, case.expected())


def _run_scenario(name: str) -> str:
    import vllm

    env = os.environ.copy()
    tree = str(Path(vllm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, str(Path(scenarios.__file__)), name],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    output = child.stdout + child.stderr
    assert child.returncode != 0, output
    return output


@pytest.mark.parametrize("scenario", ["piecewise-without-guard", "hisparse-without-guard"])
def test_without_the_guard_the_eager_wait_crashes(expect, scenario):
    """The crash vllm#56825 fixes, reproduced on vLLM's own code with the guard switched off."""
    expect.fixed("piecewise-topk-event")
    assert "invalid argument" in _run_scenario(scenario)


class SpyStream(torch.cuda.Stream):
    """A real side stream that also records which synchronization it is asked for."""

    calls: list[str]

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.calls.append("wait_event")
        super().wait_event(event)

    def wait_stream(self, stream: torch.cuda.Stream) -> None:
        self.calls.append("wait_stream")
        super().wait_stream(stream)


def spy_on(case: scenarios.IndexGroupCase) -> SpyStream:
    spy = SpyStream()
    spy.calls = []
    case.group.side_stream = spy
    return spy


def test_full_graph_and_eager_modes_keep_the_fine_grained_event(expect):
    expect.fixed("piecewise-topk-event")
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import set_forward_context

    eager = scenarios.index_group_case()
    spy = spy_on(eager)
    eager.group.set_logical_topk_ready(eager.layer)
    eager.convert()
    torch.cuda.synchronize()
    assert torch.equal(eager.result(), eager.expected)
    assert spy.calls == ["wait_event"]

    full = scenarios.index_group_case()
    spy = spy_on(full)
    graph = torch.cuda.CUDAGraph()
    with set_forward_context(
        None, scenarios.vllm_config(), cudagraph_runtime_mode=CUDAGraphMode.FULL
    ):
        with torch.cuda.graph(graph):  # record and wait both inside one graph: legal
            full.group.set_logical_topk_ready(full.layer)
            full.convert()
        full.group.physical_topk_indices.fill_(-7)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(full.result(), full.expected)
    assert spy.calls == ["wait_event"]
