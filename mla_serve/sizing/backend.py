"""Which sparse-MLA attention backend vLLM 0.33.0 picks on SM100, and what it stores.

Priorities: vllm/platforms/cuda.py `_get_backend_priorities` for device capability 10.x
(B200, GB200, B300, GB300): with a quantized KV cache FLASHINFER_MLA_SPARSE first, then
FLASHMLA_SPARSE; with a bf16 cache FLASHMLA_SPARSE first unless there are at most 16
heads per rank (then FLASH_ATTN_MLA_SPARSE_FA4, FLASHINFER_MLA_SPARSE, FLASHMLA_SPARSE).
Each candidate's `supports_combination` can refuse; the first that accepts is used.

Only the trtllm-gen backends (FLASHINFER_MLA_SPARSE and FLASH_ATTN_MLA_SPARSE_FA4, whose
metadata builder subclasses FlashInfer's) allocate the DCP-sized sparse-MLA workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_serve.sizing.shape import ModelShape

FLASHINFER = "FLASHINFER_MLA_SPARSE"
FLASHMLA = "FLASHMLA_SPARSE"
FA4 = "FLASH_ATTN_MLA_SPARSE_FA4"
BACKENDS = (FLASHINFER, FLASHMLA, FA4)
WORKSPACE_BACKENDS = frozenset({FLASHINFER, FA4})

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla")
QUANTIZED = frozenset({"fp8", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla"})

_FLASHINFER_KV = frozenset({"auto", "float16", "bfloat16", "fp8", "fp8_e4m3"})


@dataclass(frozen=True)
class Choice:
    backend: str
    forced: bool
    refusals: tuple[str, ...]  # why higher-priority backends were passed over
    rejected: str | None  # why vLLM would refuse a forced backend


def rejection(
    backend: str, shape: ModelShape, *, pcp: int, dcp: int, heads_per_rank: int, kv: str
) -> str | None:
    """vLLM 0.33.0's `supports_combination` verdict on SM100 (None: accepted)."""
    if backend == FLASHMLA:
        if shape.mla_head_size == 512:
            return f"{FLASHMLA} supports head_size 512 (no-RoPE MLA) only on SM90, not on SM100"
        return None
    if backend == FA4:
        if kv not in ("auto", "bfloat16"):
            return f"{FA4} supports only a bf16 KV cache, not {kv}"
        if shape.index_topk % 128:
            return f"{FA4} requires index_topk % 128 == 0, got {shape.index_topk}"
        if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (512, 64):
            return f"{FA4} requires (kv_lora_rank, qk_rope_head_dim) == (512, 64)"
        counts = (8, 16, 32, 64) if dcp > 1 else (8, 16, 32, 64, 128)
        if heads_per_rank * dcp not in counts:
            return (
                f"{FA4} requires {counts} gathered query heads, got "
                f"{heads_per_rank} heads/rank x DCP {dcp}"
            )
    if pcp > 1 and dcp > 1:
        return (
            f"{FLASHINFER} does not support combined PCP+DCP (vllm#55879: the LSE "
            f"all-gather hangs); vLLM uses {FLASHMLA}, which gathers each DCP KV shard first"
        )
    if kv == "fp8_ds_mla":
        return f"{FLASHINFER} (SM100) does not support the fp8_ds_mla kv-cache dtype"
    if kv not in _FLASHINFER_KV:
        return f"{FLASHINFER} (SM100) does not support the {kv} kv-cache dtype"
    nope, rope = shape.qk_nope_head_dim, shape.qk_rope_head_dim
    if rope == 0:
        if nope != 256 or shape.kv_lora_rank != 512:
            return (
                "FlashInfer native no-rope MLA requires qk_nope_head_dim=256 and "
                f"kv_lora_rank=512, got {nope} and {shape.kv_lora_rank}"
            )
    elif nope not in (128, 192):
        return f"{FLASHINFER} requires qk_nope_head_dim in [128, 192], got {nope}"
    return None


def priorities(kv: str, heads_per_rank: int) -> tuple[str, ...]:
    if kv in QUANTIZED:
        return (FLASHINFER, FLASHMLA)
    if heads_per_rank <= 16:
        return (FA4, FLASHINFER, FLASHMLA)
    return (FLASHMLA, FLASHINFER)


def choose(
    shape: ModelShape,
    *,
    pcp: int,
    dcp: int,
    heads_per_rank: int,
    kv: str,
    forced: str | None = None,
) -> Choice | str:
    """The backend vLLM would run, or why no sparse backend on SM100 accepts the setup."""
    verdict = {
        name: rejection(name, shape, pcp=pcp, dcp=dcp, heads_per_rank=heads_per_rank, kv=kv)
        for name in BACKENDS
    }
    if forced is not None:
        return Choice(forced, True, (), verdict[forced])
    refusals: list[str] = []
    for name in priorities(kv, heads_per_rank):
        reason = verdict[name]
        if reason is None:
            return Choice(name, False, tuple(refusals), None)
        refusals.append(reason)
    return "no sparse-MLA backend accepts this setup on SM100: " + "; ".join(refusals)


def cache_dtype(backend: str, kv: str) -> str:
    """`_canonicalize_sparse_mla_kv_cache_dtype`: FLASHMLA_SPARSE stores fp8 as fp8_ds_mla."""
    if backend == FLASHMLA and kv in QUANTIZED and kv != "nvfp4_ds_mla":
        return "fp8_ds_mla"
    return kv
