"""Per-rank memory plan for a sparse-MLA model on a TP/PCP/DCP/DP/EP layout.

KV budget = gpu_memory x utilization - weights - workspace - reserve, the way vLLM's
`determine_available_memory` (vllm/v1/worker/gpu_worker.py) subtracts the non-KV memory
from the requested share of the device; the reserve stands for what vLLM measures at
start-up instead of computing (activation peak of the profile run, CUDA graph pool,
NCCL and cuBLAS buffers). KV tokens = budget / KV bytes per token on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from mla_serve.sizing import backend as backend_
from mla_serve.sizing import dsv4, quant, weights
from mla_serve.sizing.kvcache import KvCache, kv_cache
from mla_serve.sizing.shape import ModelShape, SizingError, from_config
from mla_serve.sizing.workspace import required_workspace_bytes

GiB = 1 << 30

DEFAULT_UTILIZATION = 0.92
"""vLLM's `--gpu-memory-utilization` default (CacheConfig, in every supported release:
tests/test_vllm_facts.py)."""

DEFAULT_RESERVE_BYTES = 8 * GiB
"""Activation peak + CUDA graph pool + non-torch allocations; vLLM measures these."""

WORKSPACE_WARN_FRACTION = 0.25
"""Warn when the workspace takes more than this share of the memory left for KV."""


def default_max_num_batched_tokens(gpu_memory_bytes: int) -> int:
    """vLLM's default for the OpenAI server (EngineArgs.get_batch_defaults, 0.28.0+).

    16384 on GPUs with at least 160 GiB (B200, B300), 8192 from 70 GiB (H100, H200;
    vLLM also keeps A100 and GB10 on the small tier, which a memory size cannot tell),
    2048 below.
    """
    if gpu_memory_bytes >= 160 * GiB:
        return 16384
    if gpu_memory_bytes >= 70 * GiB:
        return 8192
    return 2048


def blackwell_default_kv(shape: ModelShape) -> str:
    """What the model's `verify_and_update_config` hook (vllm/model_executor/models/config.py)
    makes of `--kv-cache-dtype auto` on a compute-capability-10.x GPU: GlmMoeDsaForCausalLM
    (GLM-5.x) sets fp8_e4m3, GLM-5.3-Flash's (Glm5NextModelConfig, sparse layers) sets fp8;
    other models keep auto (bf16)."""
    if shape.architecture == "GlmMoeDsaForCausalLM":
        return "fp8_e4m3"
    if shape.architecture.startswith("Glm5Next") and shape.index_topk:
        return "fp8"
    return "auto"


@dataclass(frozen=True)
class Layout:
    gpu_memory_bytes: int
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    ep: int = 1
    max_num_batched_tokens: int | None = None  # None: vLLM's default for the GPU size
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: what vLLM would pick
    gpu_memory_utilization: float = DEFAULT_UTILIZATION
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    workspace_override_bytes: int | None = None
    weight_dtype: str | None = None
    expert_dtype: str | None = None
    weights_bytes: int | None = None  # replaces the estimate
    mtp: bool = False
    max_model_len: int | None = None  # None: the model's max_position_embeddings (DeepSeek-V4)
    indexer_kv_dtype: str = "auto"  # attention_config.indexer_kv_dtype


@dataclass(frozen=True)
class Plan:
    model: str
    shape: ModelShape
    layout: Layout
    max_num_batched_tokens: int
    heads_per_rank: int
    kv_cache_dtype: str
    kv_cache_dtype_requested: str
    attention_backend: str
    backend_forced: bool
    workspace_allocated: bool
    workspace_bytes: int
    workspace_required_bytes: int
    weights_bytes: int
    weights_estimated: bool
    weights_breakdown: dict[str, int]
    weight_scheme: str
    kv: KvCache
    usable_bytes: int
    kv_budget_bytes: int
    kv_tokens: int
    warnings: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def kv_bytes_per_token(self) -> Fraction:
        return self.kv.bytes_per_token

    @property
    def gpus_per_engine(self) -> int:
        return self.layout.tp * self.layout.pcp

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        per_token = self.kv_bytes_per_token
        return {
            "model": self.model,
            "layout": {
                "tp": lay.tp,
                "pcp": lay.pcp,
                "dcp": lay.dcp,
                "dp": lay.dp,
                "ep": lay.ep,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "kv_cache_dtype": self.kv_cache_dtype,
                "attention_backend": self.attention_backend,
            },
            "per_rank": {
                "workspace_bytes": self.workspace_bytes,
                "weights_bytes": self.weights_bytes,
                "kv_bytes_per_token": _number(per_token),
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_tokens": self.kv_tokens,
                "gpu_memory_bytes": lay.gpu_memory_bytes,
                "reserve_bytes": lay.reserve_bytes,
            },
            "warnings": list(self.warnings),
            "details": {
                "architecture": self.shape.architecture,
                "model_type": self.shape.model_type,
                "gpu_memory_utilization": lay.gpu_memory_utilization,
                "usable_bytes": self.usable_bytes,
                "gpus_per_engine": self.gpus_per_engine,
                "gpus_total": self.gpus_per_engine * lay.dp,
                "heads_per_rank": self.heads_per_rank,
                "attention_backend_forced": self.backend_forced,
                "kv_cache_dtype_requested": self.kv_cache_dtype_requested,
                "workspace_allocated": self.workspace_allocated,
                "workspace_required_bytes": self.workspace_required_bytes,
                "weights_estimated": self.weights_estimated,
                "weight_scheme": self.weight_scheme,
                "weights_breakdown": dict(self.weights_breakdown),
                "kv": {
                    "mla_layers": self.kv.mla_layers,
                    "mla_bytes_per_token_per_layer": self.kv.mla_bytes_per_layer,
                    "indexer_layers": self.kv.indexer_layers,
                    "indexer_bytes_per_state": self.kv.indexer_bytes_per_state,
                    "tokens_per_indexer_state": self.kv.tokens_per_indexer_state,
                    "bytes_per_token_all_ranks": _number(self.kv.bytes_per_token_total),
                    "linear_attention_layers": self.kv.linear_layers,
                    "state_bytes_per_sequence": self.kv.state_bytes_per_sequence,
                },
                "notes": list(self.notes),
            },
        }


def _number(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else round(float(value), 3)


def parallel_layout_error(tp: int, pcp: int, dcp: int) -> str | None:
    """Why vLLM refuses DCP `dcp` on TP `tp` x PCP `pcp`, or None when it accepts it.

    vllm/config/parallel.py (0.33.0): without PCP, DCP reuses the TP ranks (it must divide TP);
    with PCP it must be off, span the PCP axis, or span the whole TP x PCP block. The chart's
    templates/_validate.tpl states the same rule; tests/helm/test_helm_vllm_args.py renders the
    chart over a grid of layouts and requires it, this function and vLLM's ParallelConfig to
    agree.
    """
    if pcp == 1 and tp % dcp:
        return f"--dcp {dcp} must divide --tp {tp} when --pcp is 1"
    if pcp > 1 and dcp not in (1, pcp, tp * pcp):
        valid = sorted({1, pcp, tp * pcp})
        return f"with --pcp {pcp} and --tp {tp}, --dcp must be one of {valid} (got {dcp})"
    return None


def _check_layout(shape: ModelShape, lay: Layout) -> None:
    for name in ("tp", "pcp", "dcp", "dp", "ep"):
        value = getattr(lay, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SizingError(f"--{name} must be a positive integer, got {value!r}")
    if shape.num_attention_heads % lay.tp:
        raise SizingError(
            f"--tp {lay.tp} does not divide num_attention_heads {shape.num_attention_heads}"
        )
    linear = shape.linear_attention
    if linear is not None and linear.num_heads % lay.tp:
        raise SizingError(f"--tp {lay.tp} does not divide the {linear.num_heads} KDA heads")
    layout_error = parallel_layout_error(lay.tp, lay.pcp, lay.dcp)
    if layout_error:
        raise SizingError(layout_error)
    moe_ranks = lay.tp * lay.pcp * lay.dp
    if lay.ep not in (1, moe_ranks):
        valid = "1" if moe_ranks == 1 else f"1 (no expert parallelism) or {moe_ranks}"
        raise SizingError(
            f"--ep {lay.ep}: vLLM's expert-parallel group spans TP x PCP x DP = {moe_ranks} "
            f"rank(s) (--enable-expert-parallel), so --ep must be {valid}"
        )
    if lay.gpu_memory_bytes <= 0:
        raise SizingError("--gpu-memory-gib must be positive")
    if not 0 < lay.gpu_memory_utilization <= 1:
        raise SizingError("--gpu-memory-utilization must be in (0, 1]")
    if lay.reserve_bytes < 0:
        raise SizingError("--reserve-gib must not be negative")
    if lay.max_num_batched_tokens is not None and lay.max_num_batched_tokens < 1:
        raise SizingError("--max-num-batched-tokens must be at least 1")
    if lay.workspace_override_bytes is not None and lay.workspace_override_bytes < 0:
        raise SizingError("--workspace-override-bytes must not be negative")
    if lay.weights_bytes is not None and lay.weights_bytes < 0:
        raise SizingError("--weights-gib must not be negative")
    if lay.kv_cache_dtype not in backend_.KV_CACHE_DTYPES:
        raise SizingError(f"unknown --kv-cache-dtype {lay.kv_cache_dtype!r}")
    if lay.attention_backend is not None and lay.attention_backend not in backend_.BACKENDS:
        raise SizingError(f"unknown --attention-backend {lay.attention_backend!r}")
    for flag, value in (("--weight-dtype", lay.weight_dtype), ("--expert-dtype", lay.expert_dtype)):
        if value is not None and value not in quant.OVERRIDES:
            raise SizingError(f"unknown {flag} {value!r}")


def plan_dsv4(config: dict[str, Any], layout: Layout, name: str = "") -> dsv4.Plan:
    """DeepSeek-V4 (mla_serve/sizing/dsv4.py): its compressed cache and its weights, per rank."""
    shape = dsv4.from_config(config, name)
    for flag in ("tp", "pcp", "dcp", "dp", "ep"):
        value = getattr(layout, flag)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SizingError(f"--{flag} must be a positive integer, got {value!r}")
    if layout.pcp > 1:
        raise SizingError("DeepSeek-V4 with --pcp > 1 is not modelled")
    layout_error = parallel_layout_error(layout.tp, layout.pcp, layout.dcp)
    if layout_error:
        raise SizingError(layout_error)
    if shape.num_attention_heads % layout.tp:
        raise SizingError(
            f"--tp {layout.tp} does not divide num_attention_heads {shape.num_attention_heads}"
        )
    if layout.attention_backend not in (None, backend_.FLASHMLA):
        raise SizingError(
            "DeepSeek-V4 is modelled on its SM100 default path (FLASHMLA_SPARSE); "
            f"--attention-backend {layout.attention_backend} is not"
        )
    warnings: list[str] = []
    notes: list[str] = []
    tokens = layout.max_num_batched_tokens or default_max_num_batched_tokens(
        layout.gpu_memory_bytes
    )
    requested = layout.kv_cache_dtype
    if requested not in ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"):
        raise SizingError(f"DeepSeek-V4's FlashMLA path stores fp8 only, not {requested}")
    # _resolve_dsv4_kv_cache_dtype: the FlashMLA layout turns auto and fp8 into fp8_ds_mla.
    notes.append(
        "vLLM 0.33.0 runs DeepSeek-V4 on SM100 with FlashMLA (fp8_ds_mla, 584 B states) "
        "unless FLASHINFER_MLA_SPARSE_DSV4 is asked for; no FlashInfer workspace is allocated"
    )
    # dsa_indexer_uses_fp4 (v1/attention/backends/mla/indexer.py): "auto" is fp8 on NVIDIA;
    # mxfp4 needs SM10x, the GPUs this plan is for.
    indexer_dtype = "fp8" if layout.indexer_kv_dtype == "auto" else layout.indexer_kv_dtype
    cache = dsv4.cache(shape, "fp8_ds_mla", layout.dcp, indexer_dtype)
    max_model_len = layout.max_model_len or shape.max_position_embeddings
    if max_model_len < 1:
        raise SizingError("give --max-model-len: the config has no max_position_embeddings")
    workspace = dsv4.prefill_workspace_bytes(shape, max_model_len, tokens)
    notes.append(
        f"the FlashMLA prefill gather workspace ({workspace / GiB:.2f} GiB) is what vLLM "
        f"reserves in its warm-up run for max-model-len {max_model_len:,} and "
        f"{tokens} batched tokens; it grows with both"
    )
    if layout.weight_dtype is not None:
        dense = expert = quant.OVERRIDES[layout.weight_dtype]
        scheme = f"{layout.weight_dtype} (override)"
        if layout.expert_dtype is not None:
            expert = quant.OVERRIDES[layout.expert_dtype]
    else:
        dense, expert, scheme = dsv4.formats(shape, layout.expert_dtype)
    breakdown = dsv4.weight_bytes(shape, tp=layout.tp, ep=layout.ep, dense=dense, expert=expert)
    estimated = layout.weights_bytes is None
    weight_total = sum(breakdown.values()) if estimated else int(layout.weights_bytes or 0)
    usable = int(layout.gpu_memory_bytes * layout.gpu_memory_utilization)
    budget = usable - weight_total - workspace - layout.reserve_bytes
    kv_tokens = int(budget / cache.bytes_per_token) if budget > 0 else 0
    if budget < 0:
        warnings.append(
            f"KV budget is negative ({budget / GiB:.2f} GiB): weights {weight_total / GiB:.2f} "
            f"+ workspace {workspace / GiB:.2f} + reserve {layout.reserve_bytes / GiB:.2f} GiB "
            "exceed "
            f"{layout.gpu_memory_utilization} x {layout.gpu_memory_bytes / GiB:.2f} GiB"
        )
    notes.append(
        f"each sequence also holds {cache.bytes_per_sequence / (1 << 20):.1f} MiB per rank "
        "(sliding windows and compressor states), outside kv_bytes_per_token"
    )
    notes.append("the MTP layer is not counted")
    return dsv4.Plan(
        model=shape.name,
        shape=shape,
        tp=layout.tp,
        dcp=layout.dcp,
        dp=layout.dp,
        ep=layout.ep,
        gpu_memory_bytes=layout.gpu_memory_bytes,
        gpu_memory_utilization=layout.gpu_memory_utilization,
        reserve_bytes=layout.reserve_bytes,
        max_num_batched_tokens=tokens,
        kv_cache_dtype="fp8_ds_mla",
        kv_cache_dtype_requested=requested,
        attention_backend=backend_.FLASHMLA,
        max_model_len=max_model_len,
        indexer_kv_dtype=indexer_dtype,
        workspace_bytes=workspace,
        weights_bytes=weight_total,
        weights_estimated=estimated,
        weights_breakdown=breakdown,
        weight_scheme=scheme,
        kv=cache,
        usable_bytes=usable,
        kv_budget_bytes=budget,
        kv_tokens=kv_tokens,
        warnings=tuple(warnings),
        notes=tuple(notes),
    )


def shortfall(result: Plan | dsv4.Plan, layout: Layout) -> str | None:
    """Why no KV cache fits on a rank, and what to change; None when one token fits.

    `mla-serve plan` refuses such a layout with this line (vLLM would refuse to start). A
    config without `quantization_config` has every weight counted as bf16: the usual cause
    is a quantized checkpoint sized from its unquantized config, so the line names the flags
    that give its format.
    """
    if result.kv_tokens > 0:
        return None
    workspace = result.workspace_bytes
    reserve = layout.reserve_bytes
    budget = result.kv_budget_bytes
    left = (
        f"exceed {layout.gpu_memory_utilization} x {layout.gpu_memory_bytes / GiB:.2f} GiB by "
        f"{-budget / GiB:.2f} GiB"
        if budget < 0
        else f"leave {budget:,} B, less than one token's KV cache"
    )
    line = (
        f"no KV cache fits on a rank: weights {result.weights_bytes / GiB:.2f} GiB + workspace "
        f"{workspace / GiB:.2f} + reserve {reserve / GiB:.2f} GiB {left}"
    )
    unquantized = (
        result.weights_estimated
        and not result.shape.quantization
        and layout.weight_dtype is None
        and layout.expert_dtype is None
    )
    if unquantized:
        return (
            f"{line}; the config has no quantization_config, so every weight counts as bf16: "
            "for a quantized checkpoint give its format (--expert-dtype nvfp4 for routed "
            "experts in NVFP4, as in nvidia/GLM-5.2-NVFP4; --weight-dtype for every linear "
            "layer) or its measured size (--weights-gib), or add ranks"
        )
    more = ", lower --max-num-batched-tokens (the workspace)" if workspace else ""
    return (
        f"{line} (weights as {result.weight_scheme}); raise --gpu-memory-utilization, lower "
        f"--reserve-gib to what vLLM measures{more}, or add ranks"
    )


def plan(config: dict[str, Any] | ModelShape, layout: Layout, name: str = "") -> Plan:
    """Size `config` (a parsed config.json, or a ModelShape) on `layout`, per GPU rank."""
    shape = config if isinstance(config, ModelShape) else from_config(config, name)
    _check_layout(shape, layout)
    warnings: list[str] = []
    notes: list[str] = []
    heads = shape.num_attention_heads // layout.tp
    tokens = layout.max_num_batched_tokens or default_max_num_batched_tokens(
        layout.gpu_memory_bytes
    )
    if layout.max_num_batched_tokens is None:
        notes.append(
            f"max_num_batched_tokens {tokens}: vLLM's default for a "
            f"{layout.gpu_memory_bytes / GiB:.0f} GiB GPU (OpenAI server)"
        )

    kv_requested = layout.kv_cache_dtype
    kv = kv_requested
    if kv == "auto":
        kv = quant.kv_cache_dtype_from_config(shape.quantization) or "auto"
        if kv != "auto":
            notes.append(f"--kv-cache-dtype auto resolves to {kv} (the checkpoint's KV scheme)")
        else:
            kv = blackwell_default_kv(shape)
            if kv != "auto":
                notes.append(
                    f"--kv-cache-dtype auto resolves to {kv} on SM10x ({shape.architecture}'s "
                    "config hook in vLLM 0.33.0)"
                )

    choice = backend_.choose(
        shape,
        pcp=layout.pcp,
        dcp=layout.dcp,
        heads_per_rank=heads,
        kv=kv,
        forced=layout.attention_backend,
    )
    if isinstance(choice, str):
        raise SizingError(choice + " (force one with --attention-backend to size it anyway)")
    if choice.rejected:
        warnings.append(
            f"vLLM 0.33.0 refuses --attention-backend {choice.backend}: {choice.rejected}; "
            "figures show what that backend would allocate (as on unpatched 0.27.1-0.29.0)"
        )
    cache_dtype = backend_.cache_dtype(choice.backend, kv)
    if cache_dtype != kv:
        notes.append(f"{choice.backend} stores the {kv} KV cache as {cache_dtype}")

    allocated = choice.backend in backend_.WORKSPACE_BACKENDS
    required, override_warning = required_workspace_bytes(
        layout.dcp, heads, tokens, layout.workspace_override_bytes
    )
    if override_warning and allocated:
        warnings.append(override_warning)
    workspace = required if allocated else 0
    if not allocated:
        notes.append(
            f"{choice.backend} does not allocate the FlashInfer trtllm-gen sparse-MLA workspace"
        )

    if layout.indexer_kv_dtype not in ("auto", "fp8"):
        warnings.append(
            f"indexer_kv_dtype {layout.indexer_kv_dtype} is not what {shape.architecture} "
            "stores: vLLM 0.33.0's DeepSeek-V3.2 / GLM-5.x indexers lay their K cache out as "
            "fp8 (132 B) whatever attention_config.indexer_kv_dtype says (only DeepSeek-V4 "
            "reads it); counted at 132 B"
        )

    scheme = quant.scheme(shape.quantization, layout.weight_dtype, layout.expert_dtype, warnings)
    parallel = weights.Parallel(tp=layout.tp, pcp=layout.pcp, dp=layout.dp, ep=layout.ep)
    breakdown = weights.weight_bytes(shape, scheme, parallel, mtp=layout.mtp)
    estimated = layout.weights_bytes is None
    weight_total = sum(breakdown.values()) if estimated else int(layout.weights_bytes or 0)
    if layout.ep > 1 and shape.n_routed_experts % layout.ep:
        warnings.append(
            f"{shape.n_routed_experts} routed experts do not split evenly over EP {layout.ep}: "
            "the busiest rank is counted"
        )
    if layout.ep == 1 and shape.moe_intermediate_size % parallel.moe_ranks:
        warnings.append(
            f"moe_intermediate_size {shape.moe_intermediate_size} does not split evenly over "
            f"the {parallel.moe_ranks} TP x PCP x DP ranks that shard the experts"
        )

    cache = kv_cache(shape, cache_dtype, tp=layout.tp, dcp=layout.dcp, mtp=layout.mtp)
    usable = int(layout.gpu_memory_bytes * layout.gpu_memory_utilization)
    budget = usable - weight_total - workspace - layout.reserve_bytes
    per_token = cache.bytes_per_token
    kv_tokens = int(budget / per_token) if budget > 0 else 0

    if budget < 0:
        warnings.append(
            f"KV budget is negative ({budget / GiB:.2f} GiB): weights {weight_total / GiB:.2f} "
            f"+ workspace {workspace / GiB:.2f} + reserve {layout.reserve_bytes / GiB:.2f} GiB "
            f"exceed {layout.gpu_memory_utilization} x {layout.gpu_memory_bytes / GiB:.2f} GiB; "
            "vLLM would refuse to start (raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or add ranks)"
        )
    room = budget + workspace  # what the KV cache would get without the workspace
    if workspace and room > 0 and workspace > WORKSPACE_WARN_FRACTION * room:
        warnings.append(
            f"the sparse-MLA workspace ({workspace / GiB:.2f} GiB at max_num_batched_tokens "
            f"{tokens}, DCP {layout.dcp}) takes {100 * workspace / room:.0f}% of the memory "
            "otherwise left for the KV cache; it grows linearly with --max-num-batched-tokens"
        )
    if shape.declared_full_indexers is not None and shape.declared_full_indexers != len(
        shape.indexer_layers
    ):
        warnings.append(
            f"config's indexer_types lists {shape.declared_full_indexers} full indexers, but "
            f"vLLM 0.33.0 builds {len(shape.indexer_layers)} from index_topk_freq/offset"
        )
    if cache.state_bytes_per_sequence:
        notes.append(
            f"{cache.linear_layers} linear-attention (KDA) layers keep "
            f"{cache.state_bytes_per_sequence / (1 << 20):.1f} MiB of recurrent state per "
            "sequence on each rank, outside kv_bytes_per_token"
        )
    if shape.has_vision and estimated:
        notes.append("the vision tower's weights are not counted")
    if shape.num_nextn_predict_layers and not layout.mtp:
        notes.append(
            f"{shape.num_nextn_predict_layers} MTP layer(s) not counted (--mtp counts them)"
        )
    return Plan(
        model=shape.name,
        shape=shape,
        layout=layout,
        max_num_batched_tokens=tokens,
        heads_per_rank=heads,
        kv_cache_dtype=cache_dtype,
        kv_cache_dtype_requested=kv_requested,
        attention_backend=choice.backend,
        backend_forced=choice.forced,
        workspace_allocated=allocated,
        workspace_bytes=workspace,
        workspace_required_bytes=required,
        weights_bytes=weight_total,
        weights_estimated=estimated,
        weights_breakdown=breakdown,
        weight_scheme=scheme.description,
        kv=cache,
        usable_bytes=usable,
        kv_budget_bytes=budget,
        kv_tokens=kv_tokens,
        warnings=tuple(warnings),
        notes=tuple(notes),
    )
