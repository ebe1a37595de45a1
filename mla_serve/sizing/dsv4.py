"""DeepSeek-V4's per-rank memory, as vLLM 0.33.0 lays out its cache (vllm/models/deepseek_v4).

DeepSeek-V4 has no MLA latent cache. Every layer keeps a sliding window of raw KV; layers with
`compress_ratios[l]` = c > 1 also keep one compressed 512-wide state per c tokens, and the
c = 4 layers an indexer K cache per 4 tokens:

- pages of 256 tokens, each rounded up to the spec's alignment (576 B for fp8_ds_mla, 512 B
  for plain rows): a ratio-128 page holds 2 states of 584 B in 1,728 B;
- compressed KV (`DeepseekV4Attention.get_kv_cache_spec`, c > 1): on SM100 vLLM runs the
  FlashMLA path (`_select_dsv4_attn_cls`: FlashInfer only when asked for, or on SM12x), which
  stores fp8_ds_mla states of 584 B (448 B NoPE fp8 + 128 B RoPE bf16 + 8 B scales) per c
  tokens; FlashInfer's path stores plain rows: 512 x 1 B (fp8) or 512 x 2 B (bf16);
- indexer K cache (`DeepseekV4IndexerCache`, c = 4 layers), at `attention_config.indexer_kv_dtype`
  (`dsa_indexer_uses_fp4`): fp8 ("auto"), index_head_dim fp8 values + one fp32 scale per 128,
  i.e. 132 B, or mxfp4 (SM10x only), two values per byte + one UE8M0 scale per 32, i.e. 68 B,
  per 4 tokens;
- per sequence, whatever its length (`DeepseekV4SWACache`, `CompressorStateCache`): the
  sliding window (sliding_window tokens x the KV row, every layer) and the compressors'
  fp32 states (window 2c for c = 4, c for c = 128; width 2 x coff x head_dim, coff = 2 for
  c = 4), plus the c = 4 indexer's own compressor.

All specs are `dcp_sharded` AttentionSpecs with one KV head (`max_tp_shards=1`): TP does not
split them, DCP divides the per-token part. Outside the KV cache, besides the weights: the
prefill gather workspace the FlashMLA layers reserve in vLLM's warm-up dummy run
(`DeepseekV4FlashMLAAttention.forward_mqa` without metadata: per layer a bf16 gather of
PREFILL_CHUNK_SIZE x (ceil(max_model_len / c) + window + max-num-batched-tokens) rows of
head_dim, plus int32 indices and lengths per batched token; the largest layer's is kept, in
the one shared workspace). Weights: vLLM's sharding of the V4 blocks
(replicated fused_wqa_wkv and indexer, wq_b / wo_a column-, wo_b row-parallel, shared expert
over TP, routed experts over EP or TP), fp8 blocks from `quantization_config`, the routed
experts in `expert_dtype` (fp4: MXFP4), embedding and lm_head bf16 over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from mla_serve.sizing import quant
from mla_serve.sizing.shape import SizingError

PACKED_STATE_BYTES = 584  # fp8_ds_mla: 448 NoPE + 128 RoPE + 8 scale bytes
INDEXER_QUANT_BLOCK = 128
MXFP4_BLOCK = 32  # vLLM's MXFP4_BLOCK_SIZE: one UE8M0 scale byte per 32 values
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")  # what DeepSeek-V4's indexer takes (0.33.0)
VOCAB_PADDING = 64
PREFILL_CHUNK_SIZE = 4  # DeepseekV4Attention.PREFILL_CHUNK_SIZE: requests per prefill chunk
TOPK_ALIGNMENT = 128  # the combined top-k + window width is rounded up to this
WORKSPACE_ALIGNMENT = 256  # WorkspaceManager.get_simultaneous rounds each tensor up to it


def is_dsv4(config: dict[str, Any]) -> bool:
    text = config.get("text_config", config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    return "compress_ratios" in text or model_type.startswith("deepseek_v4")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    compress_ratios: tuple[int, ...]  # one per layer (the MTP layers' entries dropped)
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    moe_intermediate_size: int
    hc_mult: int
    vocab_size: int
    tie_word_embeddings: bool
    expert_dtype: str
    quantization: dict[str, Any] | None
    max_position_embeddings: int


def from_config(config: dict[str, Any], name: str = "") -> Shape:
    text = config.get("text_config", config)
    need = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "compress_ratios",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "n_routed_experts",
        "moe_intermediate_size",
        "vocab_size",
    )
    ratios_given = text.get("compress_ratios")
    if ratios_given is None and isinstance(text.get("compress_rates"), dict):
        # transformers' DeepseekV4Config: a type per layer and a ratio per type (vLLM's
        # get_compress_ratios, vllm/transformers_utils/deepseek_v4_utils.py; 0 = window only).
        rates, kinds = text["compress_rates"], text.get("layer_types") or []
        ratios_given = [rates.get(kind, 0) for kind in kinds]
    missing = [key for key in need if key != "compress_ratios" and text.get(key) is None]
    if ratios_given is None:
        missing.append("compress_ratios (or compress_rates with layer_types)")
    if missing:
        raise SizingError(f"DeepSeek-V4 config lacks {', '.join(missing)}")
    layers = int(text["num_hidden_layers"])
    ratios = tuple(int(r) for r in ratios_given)
    if len(ratios) < layers or any(r not in (0, 1, 4, 128) for r in ratios[:layers]):
        raise SizingError(
            f"compress_ratios must give 0, 1, 4 or 128 for each of the {layers} layers"
        )
    return Shape(
        name=name or str(text.get("_name_or_path") or "DeepSeek-V4"),
        hidden_size=int(text["hidden_size"]),
        num_layers=layers,
        num_attention_heads=int(text["num_attention_heads"]),
        head_dim=int(text["head_dim"]),
        q_lora_rank=int(text["q_lora_rank"]),
        o_lora_rank=int(text["o_lora_rank"]),
        o_groups=int(text["o_groups"]),
        compress_ratios=ratios[:layers],
        sliding_window=int(text["sliding_window"]),
        index_n_heads=int(text["index_n_heads"]),
        index_head_dim=int(text["index_head_dim"]),
        index_topk=int(text.get("index_topk") or 0),
        n_routed_experts=int(text["n_routed_experts"]),
        n_shared_experts=int(text.get("n_shared_experts") or 0),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        hc_mult=int(text.get("hc_mult") or 1),
        vocab_size=int(text["vocab_size"]),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        expert_dtype=str(text.get("expert_dtype") or ""),
        quantization=config.get("quantization_config") or text.get("quantization_config"),
        max_position_embeddings=int(text.get("max_position_embeddings") or 0),
    )


@dataclass(frozen=True)
class Cache:
    """One rank's DeepSeek-V4 cache: bytes per token (DCP-divided) and per sequence."""

    kv_row_bytes: int  # one compressed state (or SWA token)
    compressed: dict[int, int]  # compress ratio -> layers
    indexer_layers: int
    indexer_state_bytes: int
    dcp: int
    bytes_per_sequence: int
    alignment: int = 1  # page alignment (576 for fp8_ds_mla)

    @property
    def bytes_per_token_total(self) -> Fraction:
        per_token = sum(
            (
                layers * page_bytes_per_token(ratio, self.kv_row_bytes, self.alignment)
                for ratio, layers in self.compressed.items()
            ),
            Fraction(0),
        )
        indexer = page_bytes_per_token(4, self.indexer_state_bytes, self.alignment)
        return per_token + self.indexer_layers * indexer

    @property
    def bytes_per_token(self) -> Fraction:
        return self.bytes_per_token_total / self.dcp


PAGE_TOKENS = 256
"""DeepSeek-V4's KV pages hold 256 tokens (vllm/models/deepseek_v4: 64 states at ratio 4)."""


def page_bytes_per_token(ratio: int, state_bytes: int, alignment: int) -> Fraction:
    """A 256-token page's bytes per token: 256 / ratio states, the page rounded up to the
    alignment, as vLLM's `MLAAttentionSpec(tokens_per_state=ratio, alignment=...)` sizes it."""
    states = PAGE_TOKENS // ratio
    page = -(-states * state_bytes // alignment) * alignment
    return Fraction(page, PAGE_TOKENS)


def indexer_state_bytes(shape: Shape, indexer_kv_dtype: str) -> int:
    """One indexer K state: fp8 (vLLM's "auto" for DeepSeek-V4 on NVIDIA) or mxfp4."""
    if indexer_kv_dtype not in INDEXER_KV_DTYPES:
        raise SizingError(
            f"DeepSeek-V4's indexer takes indexer_kv_dtype {', '.join(INDEXER_KV_DTYPES)}, "
            f"not {indexer_kv_dtype!r}"
        )
    if indexer_kv_dtype == "mxfp4":
        return shape.index_head_dim // 2 + shape.index_head_dim // MXFP4_BLOCK
    return shape.index_head_dim + shape.index_head_dim // INDEXER_QUANT_BLOCK * 4


def prefill_workspace_bytes(shape: Shape, max_model_len: int, max_num_batched_tokens: int) -> int:
    """The workspace vLLM 0.33.0 reserves for DeepSeek-V4's FlashMLA prefill in the warm-up
    dummy run, the largest layer's (`forward_mqa` without attention metadata)."""

    def aligned(nbytes: int) -> int:
        return _ceil(nbytes, WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT

    tokens = max_num_batched_tokens
    largest = 0
    for ratio in set(shape.compress_ratios):
        swa_only = ratio <= 1
        compressed = 0 if swa_only else _ceil(max_model_len, ratio)
        rows = compressed + shape.sliding_window + tokens
        top_k = 0 if swa_only else shape.index_topk
        width = _ceil(top_k + shape.sliding_window, TOPK_ALIGNMENT) * TOPK_ALIGNMENT
        largest = max(
            largest,
            aligned(PREFILL_CHUNK_SIZE * rows * shape.head_dim * 2)  # bf16 gathered KV
            + aligned(tokens * width * 4)  # int32 combined indices
            + aligned(tokens * 4),  # int32 lengths
        )
    return largest


def cache(shape: Shape, kv_cache_dtype: str, dcp: int, indexer_kv_dtype: str = "auto") -> Cache:
    """`kv_cache_dtype` as stored: fp8_ds_mla (FlashMLA, SM100's default) or, on FlashInfer's
    path, fp8 / bf16 rows; the indexer at `indexer_kv_dtype`."""
    if kv_cache_dtype == "fp8_ds_mla":
        row = PACKED_STATE_BYTES
    elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
        row = shape.head_dim
    else:
        row = 2 * shape.head_dim
    compressed: dict[int, int] = {}
    for ratio in shape.compress_ratios:
        if ratio > 1:
            compressed[ratio] = compressed.get(ratio, 0) + 1
    c4 = compressed.get(4, 0)
    indexer = indexer_state_bytes(shape, indexer_kv_dtype)
    # Per sequence: the sliding window of every layer, the compressors' fp32 states.
    swa = shape.num_layers * shape.sliding_window * row
    states = 0
    for ratio, layers in compressed.items():
        coff = 2 if ratio == 4 else 1
        window = coff * ratio
        states += layers * window * 2 * coff * shape.head_dim * 4
    states += c4 * 8 * 2 * 2 * shape.index_head_dim * 4  # the c = 4 indexer's compressor
    return Cache(
        kv_row_bytes=row,
        compressed=compressed,
        indexer_layers=c4,
        indexer_state_bytes=indexer,
        dcp=dcp,
        bytes_per_sequence=swa + states,
        alignment=576 if kv_cache_dtype == "fp8_ds_mla" else 512,
    )


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def weight_bytes(
    shape: Shape, *, tp: int, ep: int, dense: quant.WeightFormat, expert: quant.WeightFormat
) -> dict[str, int]:
    """Bytes per rank by part (MTP layers not counted)."""
    h, heads, hd = shape.hidden_size, shape.num_attention_heads, shape.head_dim
    parts: dict[str, int] = {}

    def add(part: str, nbytes: int) -> None:
        parts[part] = parts.get(part, 0) + nbytes

    vocab = _ceil(_ceil(shape.vocab_size, VOCAB_PADDING) * VOCAB_PADDING, tp)
    add("embedding", 2 * vocab * h)
    if not shape.tie_word_embeddings:
        add("lm_head", 2 * vocab * h)
    inter = shape.moe_intermediate_size
    experts_per_rank = _ceil(shape.n_routed_experts, ep) if ep > 1 else shape.n_routed_experts
    expert_shard = 1 if ep > 1 else tp
    for ratio in shape.compress_ratios:
        add("attention", dense.matrix_bytes(shape.q_lora_rank + hd, h))  # fused_wqa_wkv
        add("attention", dense.matrix_bytes(heads * hd // tp, shape.q_lora_rank))  # wq_b
        groups = shape.o_groups
        # wo_a: (heads*hd/groups -> groups*o_lora), the output split over TP
        add("attention", dense.matrix_bytes(groups * shape.o_lora_rank // tp, heads * hd // groups))
        add("attention", dense.matrix_bytes(h, groups * shape.o_lora_rank // tp))  # wo_b
        if ratio > 1:
            coff = 2 if ratio == 4 else 1
            add("compressor", dense.matrix_bytes(2 * coff * hd, h))
        if ratio == 4:
            ih = shape.index_n_heads * shape.index_head_dim
            add("indexer", dense.matrix_bytes(ih, shape.q_lora_rank))  # wq_b, replicated
            add("indexer", 2 * shape.index_n_heads * h)  # weights_proj, bf16
            add("indexer", dense.matrix_bytes(2 * 2 * shape.index_head_dim, h))
        add("routed_experts", experts_per_rank * 3 * expert.matrix_bytes(inter // expert_shard, h))
        if shape.n_shared_experts:
            shared = shape.n_shared_experts * inter // tp
            add("shared_experts", 3 * dense.matrix_bytes(shared, h))
        add("router", 4 * shape.n_routed_experts * h)
        hc = shape.hc_mult
        add("hyper_connections", 2 * 4 * (2 + hc) * hc * hc * h)  # attn + ffn mixers, fp32
    return parts


def formats(
    shape: Shape, expert_dtype: str | None
) -> tuple[quant.WeightFormat, quant.WeightFormat, str]:
    q = shape.quantization or {}
    block = q.get("weight_block_size")
    if q.get("quant_method") == "fp8":
        dense = quant.WeightFormat("fp8", tuple(block) if block else None)
    elif not q:
        dense = quant.WeightFormat("bf16")
    else:
        raise SizingError(
            f"DeepSeek-V4 with quant_method {q.get('quant_method')!r} is not modelled"
        )
    if expert_dtype is not None:
        expert = quant.OVERRIDES[expert_dtype]
    elif shape.expert_dtype == "fp4":
        expert = quant.WeightFormat("mxfp4")
    else:
        expert = dense
    return dense, expert, f"{dense.label}; routed experts {expert.label}"


@dataclass(frozen=True)
class Plan:
    model: str
    shape: Shape
    tp: int
    dcp: int
    dp: int
    ep: int
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    reserve_bytes: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    kv_cache_dtype_requested: str
    attention_backend: str
    max_model_len: int
    indexer_kv_dtype: str
    workspace_bytes: int
    weights_bytes: int
    weights_estimated: bool
    weights_breakdown: dict[str, int]
    weight_scheme: str
    kv: Cache
    usable_bytes: int
    kv_budget_bytes: int
    kv_tokens: int
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def kv_bytes_per_token(self) -> Fraction:
        return self.kv.bytes_per_token

    def to_json(self) -> dict[str, Any]:
        per_token = self.kv_bytes_per_token
        number = int(per_token) if per_token.denominator == 1 else round(float(per_token), 3)
        return {
            "model": self.model,
            "layout": {
                "tp": self.tp,
                "pcp": 1,
                "dcp": self.dcp,
                "dp": self.dp,
                "ep": self.ep,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len,
                "kv_cache_dtype": self.kv_cache_dtype,
                "indexer_kv_dtype": self.indexer_kv_dtype,
                "attention_backend": self.attention_backend,
            },
            "per_rank": {
                "workspace_bytes": self.workspace_bytes,
                "weights_bytes": self.weights_bytes,
                "kv_bytes_per_token": number,
                "kv_budget_bytes": self.kv_budget_bytes,
                "kv_tokens": self.kv_tokens,
                "gpu_memory_bytes": self.gpu_memory_bytes,
                "reserve_bytes": self.reserve_bytes,
            },
            "warnings": list(self.warnings),
            "details": {
                "architecture": "DeepseekV4ForCausalLM",
                "model_type": "deepseek_v4",
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "usable_bytes": self.usable_bytes,
                "gpus_per_engine": self.tp,
                "gpus_total": self.tp * self.dp,
                "kv_cache_dtype_requested": self.kv_cache_dtype_requested,
                "workspace_allocated": True,
                "workspace_required_bytes": self.workspace_bytes,
                "workspace": "FlashMLA prefill gather (reserved in vLLM's warm-up dummy run)",
                "weights_estimated": self.weights_estimated,
                "weight_scheme": self.weight_scheme,
                "weights_breakdown": dict(self.weights_breakdown),
                "kv": {
                    "kv_row_bytes": self.kv.kv_row_bytes,
                    "compressed_layers": {str(k): v for k, v in sorted(self.kv.compressed.items())},
                    "indexer_layers": self.kv.indexer_layers,
                    "indexer_bytes_per_state": self.kv.indexer_state_bytes,
                    "bytes_per_token_all_ranks": float(self.kv.bytes_per_token_total),
                    "state_bytes_per_sequence": self.kv.bytes_per_sequence,
                },
                "notes": list(self.notes),
            },
        }

    def text(self) -> str:
        gib = 1 << 30
        kv = self.kv
        layers = ", ".join(f"{n} at 1/{r}" for r, n in sorted(kv.compressed.items()))
        lines = [
            f"model        {self.model} (DeepseekV4ForCausalLM)",
            f"layout       TP{self.tp} DCP{self.dcp} DP{self.dp} EP{self.ep}: {self.tp} GPU(s) "
            f"per engine, {self.tp * self.dp} in all; max-num-batched-tokens "
            f"{self.max_num_batched_tokens}",
            f"attention    {self.attention_backend}, KV cache {self.kv_cache_dtype}, indexer "
            f"{self.indexer_kv_dtype}",
            f"weights      {self.weight_scheme}"
            if self.weights_estimated
            else "weights      given (--weights-gib)",
            "",
            "per rank",
            f"  GPU memory        {self.gpu_memory_bytes / gib:.2f} GiB x "
            f"{self.gpu_memory_utilization} = {self.usable_bytes / gib:.2f} GiB",
            f"  weights           {self.weights_bytes / gib:.2f} GiB ({self.weights_bytes:,} B)",
        ]
        for part, nbytes in self.weights_breakdown.items():
            lines.append(f"    {part.replace('_', ' '):22} {nbytes / gib:>8.2f} GiB")
        lines += [
            f"  workspace         {self.workspace_bytes / gib:.2f} GiB  (FlashMLA prefill gather "
            f"at max-model-len {self.max_model_len:,})",
            f"  reserve           {self.reserve_bytes / gib:.2f} GiB  "
            "(activations, CUDA graphs, NCCL)",
            f"  KV budget         {self.kv_budget_bytes / gib:.2f} GiB "
            f"({self.kv_budget_bytes:,} B)",
            f"  KV bytes/token    {float(self.kv_bytes_per_token):,.1f} B  (compressed states of "
            f"{kv.kv_row_bytes} B: {layers} tokens; {kv.indexer_layers} indexer layers x "
            f"{kv.indexer_state_bytes} B / 4 tokens"
            + (f"; / DCP {kv.dcp})" if kv.dcp > 1 else ")"),
            f"  per sequence      {kv.bytes_per_sequence / (1 << 20):.1f} MiB (sliding window + "
            "compressor states)",
            f"  KV tokens         {self.kv_tokens:,}",
        ]
        lines += [""] + [f"note: {n}" for n in self.notes] if self.notes else []
        lines += [""] + [f"WARNING: {w}" for w in self.warnings] if self.warnings else []
        return "\n".join(lines)
