"""dsv4-zero-query-prefill-chunk on the GPU: vLLM's DeepSeek-V4 FlashMLA prefill with its
own chunk plan, Triton gathers and the real FlashMLA sparse prefill kernel.

FlashMLA's SM90 kernel aborts the process on an empty query (a failed host-side assertion,
`phase1.cuh:614`), so each case runs in a child process and the test reads its exit status
and output: `python -m tests.gpu.dsv4_prefill CASE` from the repository root, with the vLLM
tree under test first on PYTHONPATH.

- `kernel-empty-query`: the kernel alone, handed a query of 0 tokens (the control: what any
  release's prefill triggers when it launches an empty chunk).
- `kernel-stale-indices`: the kernel with entries past each row's `topk_length` set to -1,
  to an index into NaN rows of the KV, and past the KV (vllm#55299: what an unseeded index
  workspace does to the output), and the control: the same NaN rows inside `topk_length`.
- `forward-prefill`: a SWA-only DeepSeek-V4 layer's `_forward_prefill` over a prefill step
  of five requests after a 3,996-token prefix, four with 4 query tokens and one with none
  (its KV still being loaded): the plan puts that one in a chunk of its own.

The compiled kernel comes from the release's wheel (`make gpu-pack` packs
`vllm/_flashmla_C.abi3.so` and `vllm/third_party/flashmla/`); vLLM's platform in the pack is
not CUDA (its NVML binding and `_C` are not packed), so the layer module's kernel name is
bound to the compiled one here, as vLLM's CUDA platform would.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

HEADS, HEAD_DIM, WINDOW, BLOCK = 64, 512, 128, 64
QUERY_LENS, PREFIX = [4, 4, 4, 4, 0], 3996
MAX_BATCHED, MAX_MODEL_LEN = 16, 4096
TOKEN_BYTES = 584  # fp8_ds_mla: 576 bytes of data and 8 of scales per token


def kernel() -> Any:
    """The compiled FlashMLA sparse prefill of the tree under test, or exit 3 saying why."""
    try:
        from vllm.third_party.flashmla.flash_mla_interface import flash_mla_sparse_fwd
    except Exception as error:  # not packed, or does not load under this torch
        print(f"NO KERNEL: {type(error).__name__}: {error}", flush=True)
        raise SystemExit(3) from None
    return flash_mla_sparse_fwd


def kernel_empty_query() -> None:
    fwd = kernel()
    q = torch.zeros(0, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(256, 1, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    indices = torch.zeros(0, 1, 128, dtype=torch.int32, device="cuda")
    print("launch rows=0", flush=True)
    fwd(q=q, kv=kv, indices=indices, sm_scale=1.0, d_v=HEAD_DIM)
    torch.cuda.synchronize()
    print("returned", flush=True)


def kernel_stale_indices() -> None:
    """vllm#55299's question for the kernel: what do index entries past a row's topk_length
    do? vLLM's DeepSeek-V4 prefill passes `topk_length` (combined_lens). Each row has 64
    valid entries into a 256-row KV whose rows 64.. hold NaN (a gather area a chunk did not
    write); the rest of each row is -1 (a seeded workspace), then 200 (an earlier chunk's
    index into this KV), then 1 << 28 (past it). The control names row 200 inside the
    length, to show a NaN row that is read reaches the output."""
    fwd = kernel()
    rows, topk, valid = 16, 128, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)
    kv = torch.randn(256, 1, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)
    kv[valid:] = float("nan")
    print(f"capability sm{''.join(map(str, torch.cuda.get_device_capability()))}", flush=True)
    cases = ((-1, valid, "seeded"), (200, valid, "stale-in-kv"),
             (1 << 28, valid, "stale-past-kv"), (200, valid + 1, "control-in-length"))  # fmt: skip
    for fill, length, name in cases:
        indices = torch.full((rows, 1, topk), fill, dtype=torch.int32, device="cuda")
        indices[:, 0, :valid] = torch.arange(valid, dtype=torch.int32, device="cuda")
        lengths = torch.full((rows,), length, dtype=torch.int32, device="cuda")
        print(f"launch {name} rows={rows}", flush=True)
        out = fwd(q=q, kv=kv, indices=indices, sm_scale=HEAD_DIM**-0.5, d_v=HEAD_DIM,
                  topk_length=lengths)  # fmt: skip
        torch.cuda.synchronize()
        output = out[0] if isinstance(out, (tuple, list)) else out
        print(f"returned {name} finite={bool(torch.isfinite(output).all())}", flush=True)


def forward_prefill() -> None:
    fwd = kernel()
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata
    from vllm.v1.worker.workspace import init_workspace_manager

    def launch(**kwargs: Any) -> Any:
        print(f"launch rows={kwargs['q'].shape[0]}", flush=True)
        return fwd(**kwargs)

    flashmla.flash_mla_sparse_fwd = launch  # what vLLM's CUDA platform binds there
    init_workspace_manager(torch.device("cuda"))
    count, tokens = len(QUERY_LENS), sum(QUERY_LENS)
    starts = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([PREFIX + n for n in QUERY_LENS], dtype=torch.int32)
    gather = torch.tensor([n + min(PREFIX, WINDOW - 1) for n in QUERY_LENS], dtype=torch.int32)
    blocks = (PREFIX + max(QUERY_LENS)) // BLOCK + 1
    metadata = DeepseekSparseSWAMetadata(
        block_table=torch.zeros(count, blocks, dtype=torch.int32, device="cuda"),
        slot_mapping=torch.zeros(tokens, dtype=torch.long, device="cuda"),
        block_size=BLOCK,
        seq_lens=seq_lens.cuda(),
        query_start_loc=starts.cuda(),
        query_start_loc_cpu=starts,
        num_prefills=count,
        num_prefill_tokens=tokens,
        prefill_seq_lens=seq_lens.cuda(),
        prefill_seq_lens_cpu=seq_lens,
        prefill_gather_lens=gather.cuda(),
        prefill_query_lens_cpu=torch.tensor(QUERY_LENS, dtype=torch.int32),
        prefill_window_size=WINDOW,
        prefill_max_model_len=MAX_MODEL_LEN,
        prefill_max_num_batched_tokens=MAX_BATCHED,
    )
    plan = metadata.get_prefill_chunk_plan(compress_ratio=1, prefill_chunk_size=4)
    print(f"plan {plan}", flush=True)
    layer = object.__new__(flashmla.DeepseekV4FlashMLAAttention)
    torch.nn.Module.__init__(layer)
    layer.__dict__.update(
        compress_ratio=1,  # SWA only: no indexer, no compressed cache
        window_size=WINDOW,
        max_image_tokens=0,
        max_num_batched_tokens=MAX_BATCHED,
        topk_indices_buffer=torch.zeros(MAX_BATCHED, 512, dtype=torch.int32, device="cuda"),
        scale=HEAD_DIM**-0.5,
        attn_sink=torch.zeros(HEADS, dtype=torch.float32, device="cuda"),
    )
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator, device="cuda")
    q = q.to(torch.bfloat16)
    output = torch.full_like(q, float("nan"))
    layer._forward_prefill(
        q=q,
        positions=torch.zeros(tokens, dtype=torch.long, device="cuda"),
        compressed_k_cache=None,
        swa_k_cache=torch.zeros(1, BLOCK, TOKEN_BYTES, dtype=torch.uint8, device="cuda"),
        output=output,
        attn_metadata=None,
        swa_metadata=metadata,
    )
    torch.cuda.synchronize()
    # The cache holds zeros: every query row attends to zero values, so its output is 0.
    print(f"output rows={output.shape[0]} zero={bool((output == 0).all())}", flush=True)
    print("returned", flush=True)


CASES = {
    "kernel-empty-query": kernel_empty_query,
    "kernel-stale-indices": kernel_stale_indices,
    "forward-prefill": forward_prefill,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: python -m tests.gpu.dsv4_prefill {'|'.join(CASES)}", file=sys.stderr)
        return 2
    CASES[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
