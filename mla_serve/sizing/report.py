"""`mla-serve plan` text output."""

from __future__ import annotations

from mla_serve.sizing.planning import GiB, Plan

_PARTS = (
    ("routed_experts", "routed experts"),
    ("shared_experts", "shared experts"),
    ("dense_mlp", "dense MLP"),
    ("attention", "MLA projections"),
    ("absorbed_mla", "MLA W_UK/W_UV (bf16)"),
    ("indexer", "indexer"),
    ("linear_attention", "KDA linear attention"),
    ("router", "router"),
    ("embedding", "embedding"),
    ("lm_head", "lm_head"),
    ("norms", "norms"),
    ("mtp", "MTP layers"),
)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def _bytes(nbytes: int) -> str:
    return f"{_gib(nbytes)} ({nbytes:,} B)"


def text(plan: Plan) -> str:
    lay = plan.layout
    shape = plan.shape
    kv = plan.kv
    lines = [
        f"model        {plan.model} ({shape.architecture or shape.model_type})",
        f"layout       TP{lay.tp} PCP{lay.pcp} DCP{lay.dcp} DP{lay.dp} EP{lay.ep}: "
        f"{plan.gpus_per_engine} GPU(s) per engine, {plan.gpus_per_engine * lay.dp} in all; "
        f"max-num-batched-tokens {plan.max_num_batched_tokens}",
        f"attention    {plan.attention_backend}"
        + (" (forced)" if plan.backend_forced else "")
        + f", {plan.heads_per_rank} heads/rank, KV cache {plan.kv_cache_dtype}",
        f"weights      {plan.weight_scheme}"
        if plan.weights_estimated
        else "weights      given (--weights-gib)",
        "",
        "per rank",
        f"  GPU memory        {_gib(lay.gpu_memory_bytes)} x {lay.gpu_memory_utilization} "
        f"= {_gib(plan.usable_bytes)}",
        f"  weights           {_bytes(plan.weights_bytes)}"
        + ("" if plan.weights_estimated else "  (given)"),
    ]
    if plan.weights_estimated:
        for key, label in _PARTS:
            if key in plan.weights_breakdown:
                lines.append(f"    {label:22} {_gib(plan.weights_breakdown[key]):>12}")
    if plan.workspace_allocated:
        lines.append(
            f"  workspace         {_bytes(plan.workspace_bytes)}  "
            f"(FlashInfer trtllm-gen sparse MLA, DCP {lay.dcp})"
        )
    else:
        lines.append(f"  workspace         not allocated ({plan.attention_backend})")
    lines += [
        f"  reserve           {_gib(lay.reserve_bytes)}  (activations, CUDA graphs, NCCL)",
        f"  KV budget         {_bytes(plan.kv_budget_bytes)}",
        f"  KV bytes/token    {float(plan.kv_bytes_per_token):,.1f} B  "
        f"({kv.mla_layers} MLA layers x {kv.mla_bytes_per_layer} B + {kv.indexer_layers} "
        f"indexer layers x {kv.indexer_bytes_per_state} B"
        + (f" / {kv.tokens_per_indexer_state} tokens" if kv.tokens_per_indexer_state > 1 else "")
        + (f", / DCP {kv.dcp})" if kv.dcp > 1 else ")"),
        f"  KV tokens         {plan.kv_tokens:,}",
    ]
    if plan.notes:
        lines.append("")
        lines += [f"note: {note}" for note in plan.notes]
    if plan.warnings:
        lines.append("")
        lines += [f"WARNING: {warning}" for warning in plan.warnings]
    return "\n".join(lines)
