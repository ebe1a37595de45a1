"""vllm#52492 (the DeepSeek-V4 indexer shortcut) on vLLM 0.27.1's own CUDA graph capture path,
one mode per process.

`python dsv4_capture.py MODE` (MODE: FULL, PIECEWISE, NONE or the control FULL-SHORT)
prints one JSON line: which candidates the DeepSeek-V4 indexer selects when a step with
a long cached prefix (8000 tokens: 2000 candidates > topk 512) runs after capture.

What is vLLM's own code here, as the V2 model runner (CudaGraphManager.capture) runs it:
- the capture batch's metadata: `prepare_inputs_to_capture` with `full_cudagraph` as the
  runner sets it (FULL: `for_capture=True`, max_seq_len = max_model_len; PIECEWISE: the
  dummy batch's own lengths), through `DefaultModelState.prepare_attn`;
- the layer: the CUDA attention class vLLM's decoder layer instantiates
  (`_select_dsv4_attn_cls` of the CUDA model module, DeepseekV4FlashMLAAttention on the
  H200; `DeepseekV4Attention` itself is abstract), its inherited `attention_impl`
  (decorated with `@eager_break_during_capture` under VLLM_USE_BREAKABLE_CUDAGRAPH=1, which
  vLLM turns on for DeepSeek-V4) calling `DeepseekV4Indexer.forward`;
- the capture: FULL under `torch.cuda.graph` with the forward context in NONE (as the
  runner captures FULL graphs), PIECEWISE through `BreakableCUDAGraphWrapper` (the
  runner's `run_pw_graph`), both on a capture stream as the runner's `graph_capture` sets
  one, NONE eagerly; `set_forward_context` for each step.
Stand-ins, as in scenarios.DSV4IndexerCase: the indexer metadata object carries the
common metadata's max_seq_len (what the DSV4 indexer builder copies), the scoring after
the shortcut is a capturable torch stand-in for DeepGEMM's kernels, and the layer's
other work (q projection, compressor, MLA) is left out. Where the tree lacks vLLM's NVML
binding (the GPU pack's Python-only trees), vLLM runs on UnspecifiedPlatform, which gets
what CudaPlatform would answer (`cuda_platform`). FULL-SHORT captures FULL on a
short metadata, the pattern vllm#52492 fixed: it shows this harness sees the bug.
`run("NONE", device="cpu")` runs the eager step on the CPU (tests/vllm_cpu checks the
harness there up to where CUDA is needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

TOPK, RATIO, TOKENS, CANDIDATES, MAX_MODEL_LEN = 512, 4, 4, 4096, 16384
PREFIX = "layers.0.indexer.k_cache"
MODES = ("FULL", "PIECEWISE", "NONE")


def capture_max_seq_len(full_cudagraph: bool, device: str = "cuda") -> int:
    """The max_seq_len vLLM's V2 runner puts in the capture batch's attention metadata."""
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.model_states import default

    seen: dict[str, Any] = {}

    def build(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {}

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(default, "build_attn_metadata", build)
        state = object.__new__(default.DefaultModelState)
        state.__dict__.update(
            max_model_len=MAX_MODEL_LEN, supports_mm_inputs=False, encoder_cache=None,
            model_config=SimpleNamespace(is_mm_prefix_lm=False),
        )  # fmt: skip
        tables = SimpleNamespace(
            cp_size=1,
            get_dummy_block_tables=lambda n: (),
            get_dummy_slot_mappings=lambda n: torch.zeros(0, n, dtype=torch.int64),
        )
        cudagraph_utils.prepare_inputs_to_capture(
            TOKENS, TOKENS, state, InputBuffers(TOKENS, TOKENS, torch.device(device)), tables,
            [], SimpleNamespace(kv_cache_groups=[]), full_cudagraph=full_cudagraph,
        )  # fmt: skip
    return int(seen["max_seq_len"])


def metadata(max_seq_len: int) -> dict[str, Any]:
    return {PREFIX: SimpleNamespace(max_seq_len=max_seq_len, num_decode_tokens=TOKENS,
                                    num_prefill_tokens=0)}  # fmt: skip


def attention_class(config: Any) -> type:
    """The DeepSeek-V4 attention class vLLM instantiates on CUDA: the CUDA model module's
    DeepseekV4DecoderLayer builds `_select_dsv4_attn_cls(vllm_config)(...)`; the base
    DeepseekV4Attention leaves forward_mqa, _o_proj and get_padded_num_q_heads abstract."""
    from vllm.models.deepseek_v4.nvidia import model

    return model._select_dsv4_attn_cls(config)


def layer(monkeypatch: pytest.MonkeyPatch, config: Any, device: str = "cuda") -> Any:
    """vLLM's DeepSeek-V4 attention layer with its indexer, trimmed to what attention_impl
    runs."""
    from vllm.models.deepseek_v4 import attention

    indexer = object.__new__(attention.DeepseekV4Indexer)
    torch.nn.Module.__init__(indexer)
    buffer = torch.full((TOKENS, TOPK), -1, dtype=torch.int32, device=device)

    def events(count: int) -> list[Any]:
        # Recorded only on aux streams, which the trimmed layer has none of; a CPU
        # build of torch cannot create CUDA events at all.
        return [torch.cuda.Event() if device == "cuda" else None for _ in range(count)]

    def score(hidden: Any, q_quant: torch.Tensor, k: Any, weights: Any) -> torch.Tensor:
        candidates = torch.arange(CANDIDATES, device=device).float()
        scores = -((q_quant.float()[:, None] / RATIO) - candidates[None, :]).abs()
        buffer[:TOKENS] = torch.topk(scores, TOPK, dim=1).indices.int()
        return buffer

    indexer.__dict__.update(
        compressor=lambda *args: None, k_cache=SimpleNamespace(prefix=PREFIX),
        compress_ratio=RATIO, topk_tokens=TOPK, topk_indices_buffer=buffer,
        wq_b=lambda qr: (qr, None), n_head=1, head_dim=8, eager_scratch_pool=None,
        use_fp4_kv=False, softmax_scale=1.0, aux_stream=None,
        ln_events=events(2), indexer_op=score,
    )  # fmt: skip
    monkeypatch.setattr(
        attention, "fused_indexer_q_rope_quant", lambda positions, *a, **k: (positions, None)
    )
    owner = object.__new__(attention_class(config))
    torch.nn.Module.__init__(owner)
    owner.__dict__.update(
        indexer=indexer, compressor=lambda *args: None, aux_stream_list=None,
        ln_events=events(4), n_local_heads=1, head_dim=8,
        wq_b=lambda qr: qr, indexer_rotary_emb=SimpleNamespace(cos_sin_cache=None),
        rotary_emb=None, _fused_qnorm_rope_kv_insert=lambda q, kv, positions, md: q,
        forward_mqa=lambda q, kv, positions, out: out.add_(1),
    )  # fmt: skip
    return owner


def cuda_platform(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None = None,
    pool_handle: Any = None,
) -> str:
    """What the layer selection and BreakableCUDAGraphWrapper ask of vLLM's CUDA platform.

    vLLM detects CUDA through its vendored NVML binding (vllm/third_party/pynvml.py), which
    the GPU pack's Python-only trees leave out: there `current_platform` is vLLM's
    UnspecifiedPlatform, whose device capability is None and whose `graph_pool_handle` is
    None (the wrapper's `get_global_graph_pool()` would call None). Give that platform what
    vLLM's CudaPlatform answers: the device's capability (from torch.cuda unless given) and
    torch.cuda's graph pool handle (CudaPlatform's device_type is "cuda")."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    if current_platform.is_cuda():
        return "CudaPlatform"
    major, minor = capability or torch.cuda.get_device_capability()
    monkeypatch.setattr(
        current_platform, "get_device_capability", lambda *a, **k: DeviceCapability(major, minor)
    )
    handle = pool_handle or torch.cuda.graph_pool_handle
    monkeypatch.setattr(current_platform, "graph_pool_handle", handle, raising=False)
    monkeypatch.setattr(type(current_platform), "_global_graph_pool", None)
    return (
        f"{type(current_platform).__name__} with capability {major}.{minor} and torch.cuda's"
        " graph pool (the tree has no vllm/third_party/pynvml.py)"
    )


def weak_refs(monkeypatch: pytest.MonkeyPatch) -> str:
    """vLLM's weak tensor references come from its compiled `_C` module; where the GPU pack
    does not carry it, the capture keeps strong references instead (same data pointers,
    only the memory lifetime differs)."""
    from vllm.compilation import breakable_cudagraph

    try:
        torch.ops._C.weak_ref_tensor  # noqa: B018
        return "vllm._C"
    except (AttributeError, RuntimeError):
        monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensor", lambda t: t)
        monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensors", lambda t: t)
        return "strong references (no vllm._C)"


class Step(torch.nn.Module):
    """One model step as the runner calls it: captured work around the attention op."""

    def __init__(self, owner: Any, device: str = "cuda") -> None:
        super().__init__()
        self.owner = owner
        self.hidden = torch.zeros(TOKENS, 8, device=device)
        self.out = torch.zeros(TOKENS, 1, 8, device=device)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        h = self.hidden
        self.out.mul_(0)  # captured
        self.owner.attention_impl(h, h, h, h, h, h, positions, self.out)
        return self.out.add_(0)  # captured


@contextlib.contextmanager
def capture_stream() -> Iterator[None]:
    """The stream the runner captures on: CudaGraphManager.capture runs inside vLLM's
    `graph_capture`, which (one rank, no custom all-reduce) makes a new stream wait for the
    current one and makes it current; CUDA refuses to capture on the default stream. The
    runner replays on its own stream after capture: wait for the capture stream's work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def run(mode: str, device: str = "cuda") -> dict[str, Any]:
    from vllm.compilation.breakable_cudagraph import (
        BreakableCUDAGraphWrapper,
        is_breakable_cudagraph_enabled,
    )
    from vllm.config import CUDAGraphMode, DeviceConfig, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    if device != "cuda" and mode != "NONE":
        raise SystemExit(f"mode {mode} captures CUDA graphs: it needs device cuda")
    config = VllmConfig(device_config=DeviceConfig(device=device))
    positions = torch.full((TOKENS,), 1000, dtype=torch.long, device=device)
    long_step = metadata(8002)  # the replayed step: an 8000-token cached prefix
    result: dict[str, Any] = {"mode": mode, "breakable": is_breakable_cudagraph_enabled()}
    with pytest.MonkeyPatch.context() as monkeypatch:
        result["weak_refs"] = weak_refs(monkeypatch)
        if device == "cuda":
            result["platform"] = cuda_platform(monkeypatch)
        step = Step(layer(monkeypatch, config, device), device)
        result["layer_class"] = type(step.owner).__name__
        buffer = step.owner.indexer.topk_indices_buffer
        if mode == "NONE":
            positions.fill_(8001)
            with set_forward_context(long_step, config):
                step(positions)
        elif mode in ("FULL", "FULL-SHORT"):
            seq_len = 1024 if mode == "FULL-SHORT" else capture_max_seq_len(True)
            result["capture_max_seq_len"] = seq_len
            with capture_stream(), set_forward_context(metadata(seq_len), config):
                step(positions)  # warm-up, as CudaGraphManager.capture does
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(positions)
            positions.fill_(8001)
            buffer.fill_(-1)
            with set_forward_context(long_step, config):
                graph.replay()
        elif mode == "PIECEWISE":
            seq_len = capture_max_seq_len(False)
            result["capture_max_seq_len"] = seq_len
            wrapper = BreakableCUDAGraphWrapper(step, config)
            descriptor = BatchDescriptor(num_tokens=TOKENS)
            piecewise = CUDAGraphMode.PIECEWISE
            with capture_stream():
                with set_forward_context(metadata(seq_len), config):
                    step(positions)  # warm-up in NONE
                with set_forward_context(
                    metadata(seq_len), config, cudagraph_runtime_mode=piecewise,
                    batch_descriptor=descriptor,
                ):  # fmt: skip
                    wrapper(positions)  # captures
            capture = wrapper.entries[descriptor].capture
            result["captured"] = capture is not None
            if capture is not None:  # graph segments around the eager attention_impl
                result["graphs"], result["eager_breaks"] = (
                    capture.num_graphs,
                    capture.num_eager_breaks,
                )
            positions.fill_(8001)
            buffer.fill_(-1)
            with set_forward_context(
                long_step, config, cudagraph_runtime_mode=piecewise, batch_descriptor=descriptor
            ):
                wrapper(positions)  # replays
        else:
            raise SystemExit(f"unknown mode {mode}")
        if device == "cuda":
            torch.cuda.synchronize()
        selected = buffer[0].sort().values
    first = torch.arange(TOPK, device=device, dtype=torch.int32)
    scored = torch.arange(1745, 2257, device=device, dtype=torch.int32)
    result["selects"] = (
        "scored" if torch.equal(selected, scored) else "first-topk" if torch.equal(selected, first)
        else f"other {selected[:4].tolist()}..{selected[-4:].tolist()}"
    )  # fmt: skip
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")  # vLLM reads it at import
    print("RESULT " + json.dumps(run(sys.argv[1])))
