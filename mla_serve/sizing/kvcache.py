"""KV-cache bytes per token, as vLLM 0.33.0's KV-cache specs lay them out.

- MLA latent cache, per sparse-MLA layer (vllm/model_executor/layers/attention/
  mla_attention.py `get_kv_cache_spec`): one (kv_lora_rank + qk_rope_head_dim)-wide
  vector per token, no separate V; the element size of the cache dtype (2 B for
  auto/bf16, 1 B for fp8/fp8_e4m3), or a packed state of 656 B for fp8_ds_mla (512 fp8
  NoPE + 16 B of fp32 scales + 128 B of bf16 RoPE) and 352 B for nvfp4_ds_mla.
- Indexer K cache, per layer that owns an indexer (vllm/models/deepseek_v32/attention.py
  `DeepseekV32Indexer`): index_head_dim fp8 values + one fp32 scale per 128, i.e.
  128 + 4 = 132 B, stored once per `index_kpool` tokens (GLM-5.3-Flash pools 4).
- Both specs are `dcp_sharded` (the AttentionSpec default): under DCP each rank holds
  1/dcp of every sequence's tokens. MLA has one KV head, so TP does not split it.

Linear-attention (KDA) layers keep a fixed recurrent + conv state per sequence instead,
reported separately (`state_bytes_per_sequence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from mla_serve.sizing.shape import ModelShape

PACKED_STATE_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class KvCache:
    mla_layers: int
    mla_bytes_per_layer: int  # per token
    indexer_layers: int
    indexer_bytes_per_state: int
    tokens_per_indexer_state: int
    dcp: int
    linear_layers: int
    state_bytes_per_sequence: int  # per rank, all linear-attention layers

    @property
    def bytes_per_token_total(self) -> Fraction:
        """One token across all layers, before DCP sharding."""
        indexer = Fraction(
            self.indexer_layers * self.indexer_bytes_per_state, self.tokens_per_indexer_state
        )
        return self.mla_layers * self.mla_bytes_per_layer + indexer

    @property
    def bytes_per_token(self) -> Fraction:
        """Per rank: each DCP rank stores 1/dcp of the tokens."""
        return self.bytes_per_token_total / self.dcp


def element_bytes(cache_dtype: str, model_dtype: str) -> int:
    if cache_dtype in ("fp8", "fp8_e4m3"):
        return 1
    if cache_dtype == "auto" and model_dtype in ("float32", "fp32"):
        return 4
    return 2


def kv_cache(shape: ModelShape, cache_dtype: str, *, tp: int, dcp: int, mtp: bool) -> KvCache:
    """`cache_dtype` is what the layers store (after the backend's canonicalization)."""
    mla = PACKED_STATE_BYTES.get(cache_dtype)
    if mla is None:
        mla = shape.mla_head_size * element_bytes(cache_dtype, shape.dtype)
    extra = shape.num_nextn_predict_layers if mtp else 0  # MTP layers always own an indexer
    indexer = shape.index_head_dim + shape.index_head_dim // INDEXER_QUANT_BLOCK * 4
    state = 0
    linear = shape.linear_attention
    if linear is not None and shape.linear_layers:
        # MambaStateShapeCalculator.kda_state_shape / kda_state_dtype (mamba_utils.py):
        # fp32 recurrent state (heads/tp, d, d) + model-dtype conv state (3*h*d/tp, k-1).
        heads = linear.num_heads // tp
        projection = linear.num_heads * linear.head_dim
        recurrent = heads * linear.head_dim * linear.head_dim * 4
        conv = (3 * projection // tp) * (linear.conv_kernel - 1) * 2
        state = (recurrent + conv) * len(shape.linear_layers)
    return KvCache(
        mla_layers=len(shape.mla_layers) + extra,
        mla_bytes_per_layer=mla,
        indexer_layers=len(shape.indexer_layers) + extra,
        indexer_bytes_per_state=indexer,
        tokens_per_indexer_state=shape.index_kpool,
        dcp=dcp,
        linear_layers=len(shape.linear_layers),
        state_bytes_per_sequence=state,
    )
