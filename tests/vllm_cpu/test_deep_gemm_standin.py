"""The e2e harness's DeepGEMM stand-in (tests/e2e/standins/deep_gemm) against vLLM's own
torch references of the same kernels (the ones vLLM runs on ROCm without aiter), in the
release tree under test."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

STANDINS = Path(__file__).resolve().parents[1] / "e2e" / "standins"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def standin() -> ModuleType:
    # Loaded from its file under its own name, as the e2e harness installs it; the folder
    # is not put on sys.path, so nothing else in this process can find it by searching.
    package = STANDINS / "deep_gemm"
    spec = importlib.util.spec_from_file_location(
        "deep_gemm", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_gemm"] = module
    spec.loader.exec_module(module)
    assert module.IS_MLA_SERVE_TEST_STANDIN
    return module


@pytest.fixture(scope="module")
def references() -> ModuleType:
    try:
        return importlib.import_module("vllm.v1.attention.ops.rocm_aiter_mla_sparse")
    except ModuleNotFoundError as error:
        pytest.skip(f"this release has no torch reference of the indexer kernels: {error}")


def test_mqa_logits_match_vllms_reference(standin: ModuleType, references: ModuleType) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, heads, dim, keys = 7, 4, 128, 50
    q = torch.randn(rows, heads, dim, generator=generator).to(FP8)
    k = torch.randn(keys, dim, generator=generator).to(FP8)
    k_scale = torch.rand(keys, generator=generator) + 0.5
    weights = torch.randn(rows, heads, generator=generator)
    starts = torch.tensor([0, 0, 3, 5, 10, 0, 20], dtype=torch.int32)
    ends = torch.tensor([5, 9, 20, 50, 11, 1, 49], dtype=torch.int32)
    ours = standin.fp8_fp4_mqa_logits((q, None), (k, k_scale), weights, starts, ends, True)
    theirs = references.fp8_mqa_logits_torch(q, (k, k_scale), weights, starts, ends)
    visible = torch.isfinite(theirs)
    assert torch.equal(visible, torch.isfinite(ours))
    # vLLM's reference multiplies in bf16, the stand-in in fp32: equal to bf16's precision.
    error = (ours[visible] - theirs[visible]).abs().max() / theirs[visible].abs().max()
    assert error < 5e-3


def test_paged_mqa_logits_match_vllms_reference(
    standin: ModuleType, references: ModuleType
) -> None:
    generator = torch.Generator().manual_seed(1)
    batch, heads, dim, block, blocks = 3, 4, 128, 64, 10
    q = torch.randn(batch, 1, heads, dim, generator=generator).to(FP8)
    values = torch.randn(blocks, block * dim, generator=generator).to(FP8).view(torch.uint8)
    scales = (torch.rand(blocks, block, generator=generator) + 0.5).view(torch.uint8)
    cache = torch.cat([values, scales], 1).view(blocks, block, 1, dim + 4)
    tables = torch.tensor([[3, 1, 7, 0], [2, 9, 0, 0], [5, 4, 6, 8]], dtype=torch.int32)
    lengths = torch.tensor([[130], [70], [256]], dtype=torch.int32)
    weights = torch.randn(batch, heads, generator=generator)
    metadata = standin.get_paged_mqa_logits_metadata(lengths, block, 132)
    assert metadata.shape == (133, 2) and metadata.dtype == torch.int32
    ours = standin.fp8_fp4_paged_mqa_logits(
        (q, None), cache, weights, lengths, tables, metadata, 300, clean_logits=False
    )
    theirs = references.fp8_paged_mqa_logits_torch(q, cache, weights, lengths, tables, 300)
    visible = torch.isfinite(theirs)
    assert ours.shape == theirs.shape == (batch, 300)
    assert torch.equal(visible, torch.isfinite(ours))
    assert visible.sum(1).tolist() == [130, 70, 256]
    torch.testing.assert_close(ours[visible], theirs[visible], rtol=1e-4, atol=1e-3)


def test_fp4_queries_are_refused(standin: ModuleType) -> None:
    q = torch.zeros(1, 1, 1, 64, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="stand-in"):
        standin.fp8_fp4_paged_mqa_logits(
            (q, q), torch.zeros(1, 64, 1, 132, dtype=torch.uint8), torch.zeros(1, 1),
            torch.ones(1, 1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32), 64, clean_logits=False,
        )  # fmt: skip
