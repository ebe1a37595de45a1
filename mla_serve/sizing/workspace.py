"""The FlashInfer sparse-MLA (trtllm-gen) workspace, byte for byte as vLLM sizes it.

Mirrors `compute_trtllm_sparse_mla_workspace_bytes` and `_required_workspace_bytes` in
vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py (vLLM 0.30.0+, and 0.27.1-0.29.0
with mla-serve's dcp-workspace-sizing patch). Under DCP the query is all-gathered across
the DCP group in the head dimension and the kernel is asked for the LSE, so trtllm-gen
carves a softmax-stats slab of sizeof(float2) * heads * tokens * round_up(q_len=1, 256)
+ 1 MiB from the workspace, on top of the base buffer. Without DCP no slab is carved.
"""

from __future__ import annotations

MiB = 1 << 20

DEFAULT_WORKSPACE_BYTES = 394 * MiB
"""vLLM's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE default (vllm/envs.py): 413,138,944 B."""

SOFTMAX_STAT_BYTES = 8  # sizeof(float2)
SOFTMAX_SLOTS_PER_TOKEN = 256  # round_up(q_len=1, 256)
SOFTMAX_GUARD_BYTES = MiB


def workspace_bytes(
    dcp_world_size: int,
    num_heads_per_rank: int,
    max_num_batched_tokens: int,
    base: int = DEFAULT_WORKSPACE_BYTES,
) -> int:
    """What vLLM's `compute_trtllm_sparse_mla_workspace_bytes(base, dcp, heads, tokens)` returns.

    `num_heads_per_rank` is `model_config.get_num_attention_heads(parallel_config)`, i.e.
    `num_attention_heads // tensor_parallel_size` (DCP and PCP do not divide it).
    """
    if dcp_world_size <= 1:
        return base
    softmax = (
        SOFTMAX_STAT_BYTES
        * (num_heads_per_rank * dcp_world_size)
        * max_num_batched_tokens
        * SOFTMAX_SLOTS_PER_TOKEN
        + SOFTMAX_GUARD_BYTES
    )
    return base + softmax


def required_workspace_bytes(
    dcp_world_size: int,
    num_heads_per_rank: int,
    max_num_batched_tokens: int,
    override: int | None = None,
) -> tuple[int, str | None]:
    """The buffer vLLM allocates, and vLLM's warning when an override is too small.

    Mirrors `_required_workspace_bytes` plus the DCP=1 path of `_get_workspace_buffer`:
    an explicit VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE replaces the whole size (it is
    respected even when smaller than the computed one, with a warning); without DCP the
    buffer is that variable's value, 394 MiB by default.
    """
    computed = workspace_bytes(dcp_world_size, num_heads_per_rank, max_num_batched_tokens)
    if override is None:
        return computed, None
    if dcp_world_size > 1 and override < computed:
        return override, (
            f"VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE={override} is below the {computed} bytes "
            f"computed for the sparse MLA workspace with dcp_world_size={dcp_world_size}, "
            f"{num_heads_per_rank} heads/rank and max_num_batched_tokens="
            f"{max_num_batched_tokens}: vLLM respects it, but the trtllm-gen kernel may crash "
            "with a workspace overflow"
        )
    return override, None
