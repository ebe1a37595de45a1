"""Weight bytes per GPU rank, estimated from the config the way vLLM 0.33.0 shards it.

Sharding (vllm/models/deepseek_v32, vllm/model_executor/models/deepseek_v2.py,
vllm/model_executor/layers/fused_moe/config.py `FusedMoEParallelConfig.make`):

- Attention: q_b_proj, kv_b_proj (column) and o_proj (row) split over TP; the fused
  q_a/kv_a projection, the norms and the whole indexer are replicated. After loading,
  MLA keeps bf16 copies of kv_b_proj's halves (W_UK_T, W_UV) for the absorbed decode.
- Indexer (only on layers that own one): wq_b quantized like the other linears;
  wk + weights_proj fused and kept bf16 (vLLM builds it with quant_config=None).
- Dense MLP layers and shared experts: split over TP.
- Routed experts: over TP x PCP x DP ranks, either each expert's intermediate dimension
  split across them (TP-flattened MoE) or, with expert parallelism, whole experts
  dealt out (EP size = TP x PCP x DP). PCP and DP replicate everything else.
- Embedding and lm_head: vocab padded to 64 and split over TP; bf16.
- Router: replicated, in `moe_router_dtype` (fp32) or bf16, plus the fp32 score bias.
- KDA (GLM-5.3-Flash linear attention): q/k/v/beta projections and f_b/g_b/o split
  over TP, f_a/g_a replicated; fp32 short-conv weights, dt_bias and A_log.

Not counted: the vision tower of multimodal checkpoints, hyper-connection (mHC) mixing
weights, and buffers vLLM builds at run time (rotary caches, CUDA graphs). The MTP
(next-n) layers count only with `mtp=True` (vLLM loads them for speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_serve.sizing.quant import BF16, ROUTED_EXPERT, Scheme
from mla_serve.sizing.shape import ModelShape

VOCAB_PADDING = 64
PREFIXES = ("model.layers.", "model.language_model.layers.", "language_model.model.layers.")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Parallel:
    tp: int
    pcp: int
    dp: int
    ep: int  # 1, or the expert-parallel group (TP x PCP x DP)

    @property
    def moe_ranks(self) -> int:
        return self.tp * self.pcp * self.dp


class _Counter:
    def __init__(self, shape: ModelShape, scheme: Scheme, parallel: Parallel) -> None:
        self.shape = shape
        self.scheme = scheme
        self.par = parallel
        self.parts: dict[str, int] = {}

    def add(self, part: str, nbytes: int) -> None:
        self.parts[part] = self.parts.get(part, 0) + nbytes

    def linear(self, part: str, layer: int, module: str, n: int, k: int, kind: str = "") -> None:
        names = [f"{prefix}{layer}.{module}" for prefix in PREFIXES]
        fmt = self.scheme.format_for(kind, names)
        self.add(part, fmt.matrix_bytes(n, k))

    def attention(self, layer: int, part: str) -> None:
        s, tp = self.shape, self.par.tp
        heads = s.num_attention_heads // tp
        hidden, attn = s.hidden_size, f"{part}" if part == "mtp" else "attention"
        if s.q_lora_rank is not None:
            self.linear(attn, layer, "self_attn.q_a_proj", s.q_lora_rank, hidden)
            self.linear(
                attn,
                layer,
                "self_attn.q_b_proj",
                heads * (s.qk_nope_head_dim + s.qk_rope_head_dim),
                s.q_lora_rank,
            )
            self.add(attn, 2 * s.q_lora_rank)  # q_a_layernorm
        else:
            self.linear(
                attn,
                layer,
                "self_attn.q_proj",
                heads * (s.qk_nope_head_dim + s.qk_rope_head_dim),
                hidden,
            )
        self.linear(
            attn, layer, "self_attn.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, hidden
        )
        self.linear(
            attn,
            layer,
            "self_attn.kv_b_proj",
            heads * (s.qk_nope_head_dim + s.v_head_dim),
            s.kv_lora_rank,
        )
        self.linear(attn, layer, "self_attn.o_proj", hidden, heads * s.v_head_dim)
        self.add(attn, 2 * s.kv_lora_rank + 2 * 2 * hidden)  # kv_a, input and post-attn norms
        absorbed = "mtp" if part == "mtp" else "absorbed_mla"
        self.add(absorbed, 2 * heads * s.kv_lora_rank * (s.qk_nope_head_dim + s.v_head_dim))
        if layer in s.indexer_layers or part == "mtp":
            idx = "mtp" if part == "mtp" else "indexer"
            q_lora = s.q_lora_rank or hidden
            self.linear(
                idx, layer, "self_attn.indexer.wq_b", s.index_n_heads * s.index_head_dim, q_lora
            )
            self.add(idx, BF16.matrix_bytes(s.index_head_dim + s.index_n_heads, hidden))
            self.add(idx, 2 * 4 * s.index_head_dim)  # k_norm (fp32 LayerNorm)

    def linear_attention(self, layer: int) -> None:
        s, tp = self.shape, self.par.tp
        la = s.linear_attention
        assert la is not None
        proj = la.num_heads * la.head_dim
        part, hidden = "linear_attention", s.hidden_size
        local = (3 * proj + la.num_heads) // tp + 2 * la.head_dim
        self.linear(part, layer, "self_attn.in_proj_qkvbfg_a", local, hidden)
        self.linear(part, layer, "self_attn.f_b_proj", proj // tp, la.head_dim)
        self.linear(part, layer, "self_attn.g_b_proj", proj // tp, la.head_dim)
        self.linear(part, layer, "self_attn.o_proj", hidden, proj // tp)
        conv = 3 * (proj // tp) * la.conv_kernel * 4
        self.add(part, conv + (proj // tp) * 4 + (la.num_heads // tp) * 4 + 2 * 2 * hidden)

    def mlp(self, layer: int, part: str) -> None:
        s, par = self.shape, self.par
        hidden = s.hidden_size
        moe = layer in s.moe_layers or (part == "mtp" and s.n_routed_experts > 0)
        if not moe:
            inter, dense = s.intermediate_size // par.tp, "mtp" if part == "mtp" else "dense_mlp"
            self.linear(dense, layer, "mlp.gate_proj", 2 * inter, hidden)
            self.linear(dense, layer, "mlp.down_proj", hidden, inter)
            return
        names3 = ("router", "shared_experts", "routed_experts")
        router, shared, routed = ("mtp", "mtp", "mtp") if part == "mtp" else names3
        experts = s.n_routed_experts
        self.add(router, experts * hidden * s.router_dtype_bytes + 4 * experts)
        if s.n_shared_experts:
            inter = s.moe_intermediate_size * s.n_shared_experts // par.tp
            self.linear(shared, layer, "mlp.shared_experts.gate_proj", 2 * inter, hidden)
            self.linear(shared, layer, "mlp.shared_experts.down_proj", hidden, inter)
        if par.ep > 1:
            local_experts, inter = _ceil(experts, par.ep), s.moe_intermediate_size
        else:
            local_experts, inter = experts, _ceil(s.moe_intermediate_size, par.moe_ranks)
        names = [f"{p}{layer}.mlp.experts.0.gate_proj" for p in PREFIXES]
        fmt = self.scheme.format_for(ROUTED_EXPERT, names)
        per_expert = fmt.matrix_bytes(2 * inter, hidden) + fmt.matrix_bytes(hidden, inter)
        self.add(routed, local_experts * per_expert)


def weight_bytes(
    shape: ModelShape, scheme: Scheme, parallel: Parallel, *, mtp: bool = False
) -> dict[str, int]:
    """Bytes per rank, by part of the model (the values sum to the estimate)."""
    count = _Counter(shape, scheme, parallel)
    vocab = _ceil(_ceil(shape.vocab_size, VOCAB_PADDING) * VOCAB_PADDING, parallel.tp)
    count.add("embedding", 2 * vocab * shape.hidden_size)
    if not shape.tie_word_embeddings:
        count.add("lm_head", 2 * vocab * shape.hidden_size)
    count.add("norms", 2 * shape.hidden_size)  # final norm
    for layer in range(shape.num_layers):
        if layer in shape.linear_layers:
            count.linear_attention(layer)
        else:
            count.attention(layer, "attention")
        count.mlp(layer, "mlp")
    if mtp:
        for j in range(shape.num_nextn_predict_layers):
            layer = shape.num_layers + j
            count.attention(layer, "mtp")
            count.mlp(layer, "mtp")
            count.add("mtp", BF16.matrix_bytes(shape.hidden_size, 2 * shape.hidden_size))
            count.add("mtp", 3 * 2 * shape.hidden_size)  # enorm, hnorm, shared_head.norm
    return {part: nbytes for part, nbytes in count.parts.items() if nbytes}
