"""Read one engine rank's figures from vLLM's own objects.

Every figure is read defensively: a release that lacks an attribute gives
`None` for that figure (and the sidecar shows it as unavailable) rather than an
error. Nothing here allocates GPU memory or synchronizes the device.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from mla_serve.engine import manifest
from mla_serve.engine.contract import ManifestCheck, Parallel, Phase, RankRecord

FLASHINFER_SPARSE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
WORKSPACE = "vllm.v1.worker.workspace"
MANIFEST_ENV = "MLA_SERVE_MANIFEST"


def collect(runner: Any, phase: Phase, capture: tuple[float, int | None] | None) -> RankRecord:
    config = runner.vllm_config
    compilation = config.compilation_config
    parallel = config.parallel_config
    rank, local_rank = _ranks(runner)
    return RankRecord(
        rank=rank,
        local_rank=local_rank,
        pid=os.getpid(),
        host=socket.gethostname(),
        phase=phase,
        updated_at=time.time(),
        vllm_version=_vllm_version(),
        model_runner=type(runner).__module__,
        cudagraph_mode=_name(getattr(compilation, "cudagraph_mode", None)),
        cudagraph_capture_sizes=tuple(
            int(size) for size in getattr(compilation, "cudagraph_capture_sizes", None) or []
        ),
        capture_seconds=None if capture is None else round(capture[0], 3),
        capture_bytes=None if capture is None else capture[1],
        attention_backends=_attention_backends(runner),
        sparse_mla_workspace_bytes=_flashinfer_sparse_workspace(),
        attention_workspace_bytes=_attention_workspace(),
        num_attention_heads_per_rank=_heads_per_rank(config),
        max_num_batched_tokens=_optional_int(
            getattr(config.scheduler_config, "max_num_batched_tokens", None)
        ),
        parallel=Parallel(
            tp=int(getattr(parallel, "tensor_parallel_size", 1)),
            pp=int(getattr(parallel, "pipeline_parallel_size", 1)),
            dp=int(getattr(parallel, "data_parallel_size", 1)),
            pcp=int(getattr(parallel, "prefill_context_parallel_size", 1)),
            dcp=int(getattr(parallel, "decode_context_parallel_size", 1)),
            ep=bool(getattr(parallel, "enable_expert_parallel", False)),
        ),
        manifest=manifest_check(),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _name(value: Any) -> str | None:
    return None if value is None else str(getattr(value, "name", value))


def _ranks(runner: Any) -> tuple[int, int | None]:
    local = getattr(getattr(runner, "device", None), "index", None)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), local
    except Exception:  # noqa: S110 - no process group: a single-rank engine
        pass
    return int(os.environ.get("RANK", local or 0)), local


def _vllm_version() -> str | None:
    module = sys.modules.get("vllm")
    return getattr(module, "__version__", None)


def _attention_backends(runner: Any) -> tuple[str, ...] | None:
    groups = getattr(runner, "attn_groups", None)
    if groups is None:
        return None
    names: set[str] = set()
    for group_list in groups:
        for group in group_list:
            backend = getattr(group, "backend", None)
            if backend is not None:
                names.add(str(backend.get_name()))
    return tuple(sorted(names))


def _flashinfer_sparse_workspace() -> int | None:
    """Bytes of the FlashInfer sparse-MLA workspace, if this rank allocated one."""
    module = sys.modules.get(FLASHINFER_SPARSE)
    buffer = getattr(module, "_fi_sparse_workspace", None)
    if buffer is None:
        return None
    return int(buffer.numel() * buffer.element_size())


def _attention_workspace() -> int | None:
    """Bytes of vLLM's shared attention scratch (`WorkspaceManager`) on this rank.

    Every sparse-MLA backend draws its gathers and the indexer's transients from
    it; graph capture locks it at its final size, so after capture it is what
    the rank holds for the rest of its life. Read from the manager's private
    list, as vLLM exposes no getter; `None` where a release has no manager.
    """
    module = sys.modules.get(WORKSPACE)
    buffers = getattr(getattr(module, "_manager", None), "_current_workspaces", None)
    if buffers is None:
        return None
    return sum(int(b.numel() * b.element_size()) for b in buffers if b is not None)


def _heads_per_rank(config: Any) -> int | None:
    model = getattr(config, "model_config", None)
    if model is None:
        return None
    try:
        return int(model.get_num_attention_heads(config.parallel_config))
    except Exception:
        return None


def manifest_check() -> ManifestCheck | None:
    """Do the files this process imports still match the fix manifest?"""
    vllm_file = getattr(sys.modules.get("vllm"), "__file__", None)
    if not vllm_file:
        return None
    root = Path(vllm_file).resolve().parent.parent
    path = Path(os.environ.get(MANIFEST_ENV) or root / "vllm" / manifest.FILENAME)
    try:
        changed = manifest.changed_files(manifest.read(path), manifest.on_disk(root))
    except manifest.ManifestError:
        return ManifestCheck(path=str(path), files_match=None, mismatched=())
    mismatched = tuple(changed_path for changed_path, _, _ in changed)
    return ManifestCheck(path=str(path), files_match=not mismatched, mismatched=mismatched)
