"""The DeepSeek-V4 runaway fixes (vllm#52492, #51318; issue #52448) on vLLM's own code."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


class ScoringPathEntered(Exception):
    """Raised by the indexer's query projection: the full scoring path was taken."""


def _indexer(module, monkeypatch, *, capturing: bool, max_seq_len: int):
    """A DeepseekV4Indexer with just the state forward() reads before scoring."""
    indexer = object.__new__(module.DeepseekV4Indexer)
    torch.nn.Module.__init__(indexer)
    calls: list[str] = []

    def projection(*args, **kwargs):
        raise ScoringPathEntered

    indexer.__dict__.update(
        compressor=lambda *args: calls.append("compressor"),
        k_cache=SimpleNamespace(prefix="layers.0.indexer.k_cache"),
        compress_ratio=4,
        topk_tokens=512,
        topk_indices_buffer=torch.zeros(8, 512, dtype=torch.int32),
        wq_b=projection,
        weights_proj=projection,
        aux_stream=None,
        ln_events=[None, None],
        eager_scratch_pool=None,
        use_fp4_kv=False,
    )
    metadata = SimpleNamespace(max_seq_len=max_seq_len, num_decode_tokens=0, num_prefill_tokens=0)
    context = SimpleNamespace(attn_metadata={"layers.0.indexer.k_cache": metadata})
    monkeypatch.setattr(module, "get_forward_context", lambda: context)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    return indexer, calls


def _takes_shortcut(module, monkeypatch, *, capturing: bool, max_seq_len: int) -> bool:
    indexer, calls = _indexer(module, monkeypatch, capturing=capturing, max_seq_len=max_seq_len)
    hidden = torch.zeros(0, 16)
    try:
        indexer.forward(hidden, hidden, hidden, hidden, torch.zeros(0, dtype=torch.long), None)
    except ScoringPathEntered:
        return False
    assert calls == ["compressor"]  # the shortcut still builds the k cache
    return True


def test_indexer_scores_while_a_graph_is_being_captured(expect, monkeypatch):
    fixed = expect.fixed("dsv4-indexer-capture-shortcut")
    from vllm.models.deepseek_v4 import attention

    # Capture runs on short dummy metadata: 1024 // 4 = 256 candidates <= 512.
    captured_shortcut = _takes_shortcut(attention, monkeypatch, capturing=True, max_seq_len=1024)
    assert captured_shortcut is (not fixed)


def test_indexer_keeps_the_eager_shortcut_and_scores_long_contexts(expect, monkeypatch):
    expect.fixed("dsv4-indexer-capture-shortcut")
    from vllm.models.deepseek_v4 import attention

    assert _takes_shortcut(attention, monkeypatch, capturing=False, max_seq_len=1024)
    assert not _takes_shortcut(attention, monkeypatch, capturing=False, max_seq_len=8192)


@pytest.mark.parametrize("width", [128, 256])
def test_c128a_metadata_views_keep_the_capacity_row_stride(expect, width):
    fixed = expect.fixed("dsv4-c128a-capacity-stride")
    from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata

    capacity = 1024
    decode = torch.full((8, capacity), -7, dtype=torch.int32)
    prefill = torch.full((8, capacity), -7, dtype=torch.int32)
    global_decode, _, prefill_local = build_c128a_topk_metadata(
        torch.zeros(0, dtype=torch.long),
        128,
        0,
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(0, 1, dtype=torch.int32),
        64,
        torch.zeros(0, dtype=torch.long),
        decode,
        torch.zeros(8, dtype=torch.int32),
        prefill,
        max_compressed_tokens=width,
    )
    if fixed:
        assert global_decode.stride(0) == decode.stride(0) == capacity
        assert prefill_local.stride(0) == prefill.stride(0)
        # Upstream's final form (0.29.0 on, and our 0.27.1 backport) keeps the batch's
        # adaptive width; its first form (0.28.0) hands out the whole capacity width.
        first_form = expect.release == "0.28.0"
        assert (
            global_decode.shape[1] == prefill_local.shape[1] == (capacity if first_form else width)
        )
    else:
        # Packed at this batch's width: a consumer captured at another width
        # reads every row after the first at the wrong offset.
        assert global_decode.stride(0) == width != decode.stride(0)


def test_capture_metadata_of_vllms_v2_runner(expect):
    """The claim behind dsv4-indexer-capture-shortcut's 0.27.1 path, on vLLM's own code:
    FULL graphs are captured on metadata at max_model_len (the scoring path gets captured);
    PIECEWISE ones on the dummy batch's own lengths (the shortcut's condition holds), which
    matters only where the indexer runs inside a captured segment (tests/gpu/dsv4_capture.py
    checks that on the GPU)."""
    if expect.release != "0.27.1":
        pytest.skip("0.27.1's V2 runner (the patched cell under scrutiny)")
    from tests.gpu.dsv4_capture import MAX_MODEL_LEN, capture_max_seq_len

    assert capture_max_seq_len(True, device="cpu") == MAX_MODEL_LEN
    assert capture_max_seq_len(False, device="cpu") == 1  # 4 dummy tokens over 4 requests


def test_capture_harness_builds_the_layer_vllm_instantiates_on_cuda(expect):
    """tests/gpu/dsv4_capture.py builds the DeepSeek-V4 attention class vLLM's CUDA decoder
    layer instantiates (DeepseekV4Attention itself is abstract: the first H200 run failed
    there), its eager step (the layer code the GPU modes capture) selects the scored
    candidates for an 8000-token prefix, and vLLM's BreakableCUDAGraphWrapper can be built
    around it on the platform the GPU pack's tree runs on (no vLLM NVML binding there)."""
    if expect.release != "0.27.1":
        pytest.skip("the harness drives 0.27.1's capture path")
    import inspect

    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    from vllm.platforms import current_platform

    from tests.gpu.dsv4_capture import Step, attention_class, cuda_platform, layer, run

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    pool = object()  # stands for torch.cuda's graph pool handle, which needs CUDA
    for capability, expected in [
        ((9, 0), "DeepseekV4FlashMLAAttention"),  # H200
        ((10, 0), "DeepseekV4FlashMLAAttention"),  # B200, GB300
        ((12, 0), "DeepseekV4FlashInferSM120Attention"),
    ]:
        with pytest.MonkeyPatch.context() as monkeypatch:
            cuda_platform(monkeypatch, capability, pool_handle=lambda: pool)
            chosen = attention_class(config)
            assert chosen.__name__ == expected
            assert issubclass(chosen, DeepseekV4Attention) and not inspect.isabstract(chosen)
            if capability == (9, 0):
                owner = layer(monkeypatch, config, device="cpu")
                assert type(owner) is chosen
                wrapper = BreakableCUDAGraphWrapper(Step(owner, device="cpu"), config)
                assert wrapper.graph_pool is pool

    if not current_platform.is_cuda():  # the tree as packed: vLLM's own platform lacks it
        with pytest.raises(TypeError, match="'NoneType' object is not callable"):
            current_platform.get_global_graph_pool()

    result = run("NONE", device="cpu")
    assert result["layer_class"] == attention_class(config).__name__
    assert result["selects"] == "scored", result


def _indexer_call_sites(source: str) -> dict[str, bool]:
    """DeepseekV4Attention's methods that call its indexer, and whether each is an
    `@eager_break_during_capture` region (run eagerly, not captured, under breakable graphs)."""
    import ast

    owner = next(
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and node.name == "DeepseekV4Attention"
    )
    sites = {}
    for method in owner.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        calls = [
            n
            for n in ast.walk(method)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name | ast.Attribute)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == "indexer"
        ]
        if calls:
            decorators = {getattr(d, "id", getattr(d, "attr", None)) for d in method.decorator_list}
            sites[method.name] = "eager_break_during_capture" in decorators
    return sites


def test_where_the_indexer_runs_under_breakable_capture(expect):
    """0.27.1 calls the indexer only inside an eager-break region (the catalog's path for
    dsv4-indexer-capture-shortcut there); from 0.28.0 (vllm#51430) it is also called from an
    undecorated method that the V2 runner captures: the release where upstream saw the bug."""
    if expect.release not in ("0.27.1", "0.28.0"):
        pytest.skip("the release that moved the indexer (0.28.0) and the one before it")
    from vllm.models.deepseek_v4 import attention

    sites = _indexer_call_sites(Path(attention.__file__).read_text(encoding="utf-8"))
    if expect.release == "0.27.1":
        assert sites == {"attention_impl": True}
    else:
        assert sites.get("_prepare_and_attn") is False
