"""TEST-ONLY STAND-IN for DeepGEMM's sparse-indexer entry points. Not DeepGEMM.

vLLM 0.28.0 and 0.29.0 vendor DeepGEMM as a C++ extension built against the C++
ABI of torch 2.13; it does not load under the GPU machine's torch 2.11, and their
DeepSeek-V3.2 `SparseAttnIndexer` refuses to start on CUDA without DeepGEMM.
`vllm.utils.deep_gemm` prefers an importable top-level `deep_gemm` over the vendored
one, so `tests/e2e/run.sh` puts this directory on PYTHONPATH for those releases
only (never in the image), and the results name it.

It provides the three entry points the indexer calls, written from their documented
semantics (DeepGEMM's docstrings, repeated in vLLM's `vllm/utils/deep_gemm.py`), in
plain torch: no host synchronisation and shapes fixed by the inputs, so vLLM can
capture them in its CUDA graphs like the real kernels. Everything else in the
indexer (quantisation, cache layout, top-k, the DCP merge) stays vLLM's own code.

- ``fp8_fp4_mqa_logits``: ``logits[m, n] = sum_h weights[m, h] *
  relu(q[m, h] . k[n]) * k_scale[n]`` for ``ks[m] <= n < ke[m]``, else -inf.
- ``fp8_fp4_paged_mqa_logits``: the same over a paged indexer cache (per block,
  ``block_size * D`` fp8 values then ``block_size`` fp32 scales, as vLLM's
  ``indexer_k_quant_and_cache`` writes it); row ``j`` of request ``b`` sees
  positions below its context length; ``[B * next_n, max_model_len]`` float32.
- ``get_paged_mqa_logits_metadata``: DeepGEMM's per-SM schedule, shape
  ``[num_sms + 1, 2]`` int32. These kernels compute every row at once and need no
  schedule, so it is returned zero-filled in that shape for vLLM to copy.

Only the FP8 cache is implemented (the tiny model's); an MXFP4 query raises.
"""

from __future__ import annotations

import torch

IS_MLA_SERVE_TEST_STANDIN = True
__version__ = "0+mla-serve-test-standin"

_num_sms: int | None = None


def get_num_sms() -> int:
    if _num_sms is not None:
        return _num_sms
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


def set_num_sms(num_sms: int) -> None:
    global _num_sms
    _num_sms = int(num_sms)


def _fp8_only(q: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    values, scales = q
    if scales is not None:
        raise NotImplementedError("mla-serve's DeepGEMM test stand-in computes FP8 queries only")
    return values


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
) -> torch.Tensor:
    values = _fp8_only(q)  # [M, H, D] fp8
    k, k_scale = kv  # [N, D] fp8, [N] fp32
    rows, heads, _ = values.shape
    keys = k.float() * k_scale.reshape(-1, 1).float()
    logits = torch.zeros(rows, keys.shape[0], dtype=torch.float32, device=values.device)
    for head in range(heads):  # one [M, N] product at a time: memory stays M * N
        scores = values[:, head].float() @ keys.T
        logits += torch.relu(scores) * weights[:, head : head + 1].float()
    positions = torch.arange(keys.shape[0], device=values.device)
    visible = (positions[None, :] >= cu_seqlen_ks[:, None]) & (
        positions[None, :] < cu_seqlen_ke[:, None]
    )
    return logits.masked_fill_(~visible, float("-inf"))


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_size: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor,
    max_model_len: int,
    clean_logits: bool = True,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    values = _fp8_only(q)  # [B, next_n, H, D] fp8
    batch, next_n, heads, dim = values.shape
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    pages = kv_cache.reshape(num_blocks, block_size * (dim + 4))
    keys = pages[:, : block_size * dim].view(values.dtype).unflatten(1, (block_size, dim))
    scales = pages[:, block_size * dim :].view(torch.float32)  # [num_blocks, block_size]
    tables = block_tables if indices is None else block_tables.index_select(0, indices.long())
    tables = tables[:batch].clamp(min=0).long()
    width = tables.shape[1] * block_size
    gathered = keys[tables].reshape(batch, width, dim).float()
    gathered *= scales[tables].reshape(batch, width, 1)
    scores = torch.einsum("bnhd,bld->bnhl", values.float(), gathered)
    logits = (torch.relu(scores) * weights.reshape(batch, next_n, heads, 1).float()).sum(2)
    if context_lens.dim() == 2:
        limits = context_lens.reshape(batch, next_n)
    else:  # one length per request: its last row sees all of it, earlier rows one less each
        offsets = torch.arange(next_n, device=values.device) - (next_n - 1)
        limits = context_lens.reshape(batch, 1) + offsets[None, :]
    positions = torch.arange(width, device=values.device)
    logits.masked_fill_(positions[None, None, :] >= limits[:, :, None], float("-inf"))
    out = torch.full(
        (batch * next_n, max_model_len), float("-inf"), dtype=torch.float32, device=values.device
    )
    kept = min(width, max_model_len)
    out[:, :kept] = logits.reshape(batch * next_n, width)[:, :kept]
    return out
