"""Sizing model: per-rank memory of a sparse-MLA model on a vLLM GPU layout.

`workspace_bytes` is vLLM's `compute_trtllm_sparse_mla_workspace_bytes`, byte for byte;
`plan(config, layout)` adds the weights, the KV cache per token and the KV budget. The
`mla-serve plan` command (mla_serve/sizing/commands.py) prints a plan as text or JSON.
"""

from mla_serve.sizing.planning import (
    DEFAULT_RESERVE_BYTES,
    DEFAULT_UTILIZATION,
    Layout,
    Plan,
    default_max_num_batched_tokens,
    plan,
)
from mla_serve.sizing.shape import ModelShape, SizingError, from_config, load
from mla_serve.sizing.workspace import (
    DEFAULT_WORKSPACE_BYTES,
    required_workspace_bytes,
    workspace_bytes,
)

__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "DEFAULT_UTILIZATION",
    "DEFAULT_WORKSPACE_BYTES",
    "Layout",
    "ModelShape",
    "Plan",
    "SizingError",
    "default_max_num_batched_tokens",
    "from_config",
    "load",
    "plan",
    "required_workspace_bytes",
    "workspace_bytes",
]
