"""A sparse-MLA (DSA) model's shape, read from its Hugging Face `config.json`.

Covers the DeepSeek-V3.2 family as vLLM 0.33.0 builds it (DeepseekV32ForCausalLM,
GlmMoeDsaForCausalLM: vllm/models/deepseek_v32) and GLM-5.3-Flash's hybrid stack
(Glm5NextForConditionalGeneration: vllm/models/glm5next, KDA linear-attention layers
between the sparse-MLA ones). DeepSeek-V4's compressed attention (`compress_ratios`,
sliding window, 584 B states) is another cache design, sized by mla_serve/sizing/dsv4.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SizingError(Exception):
    """Bad input to the sizing model: a config or layout it cannot size."""


MLA_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


@dataclass(frozen=True)
class LinearAttention:
    """GLM-5.3-Flash's KDA layers (vllm/models/glm5next/common/kda.py)."""

    num_heads: int
    head_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    model_type: str
    architecture: str
    dtype: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    router_dtype_bytes: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    mla_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    moe_layers: frozenset[int]
    indexer_layers: frozenset[int]
    declared_full_indexers: int | None
    num_nextn_predict_layers: int
    linear_attention: LinearAttention | None
    hyper_connections: int
    has_vision: bool
    quantization: dict[str, Any] | None

    @property
    def mla_head_size(self) -> int:
        """Latent cache width per token: kv_lora_rank + qk_rope_head_dim (576 for DSA)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def load(path: Path) -> tuple[dict[str, Any], str]:
    """The config as a dict and a display name (its directory's name)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SizingError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SizingError(f"{path}: is a directory (give the config.json inside it)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SizingError(f"{path}: cannot read: {error}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise SizingError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise SizingError(f"{path}: a model config must be a JSON object")
    name = Path(path).resolve().parent.name if Path(path).name == "config.json" else ""
    return config, name or Path(path).stem


def _int(config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = config.get(key, default)
    if value is None:
        raise SizingError(f"config has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SizingError(f"config field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if text is None:
        return config
    if not isinstance(text, dict):
        raise SizingError("config field 'text_config' must be an object")
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged.update(text)
    return merged


def _indexer_layers(config: dict[str, Any], mla_layers: tuple[int, ...]) -> frozenset[int]:
    """The layers that own an indexer (and its K cache), as vLLM 0.33.0 decides.

    vllm/models/deepseek_v32/attention.py: a layer skips top-k (and builds no indexer)
    when `max(layer - index_skip_topk_offset + 1, 0) % index_topk_freq != 0`, or when
    `index_topk_pattern[layer] == "S"`; the defaults (freq 1) give every layer one.
    """
    freq = _int(config, "index_topk_freq", 1)
    offset = _int(config, "index_skip_topk_offset", 2, minimum=0)
    pattern = config.get("index_topk_pattern")
    if pattern is not None and not isinstance(pattern, str | list):
        raise SizingError("config field 'index_topk_pattern' must be a string or a list")
    owners = set()
    for layer in mla_layers:
        if pattern is None:
            skip = max(layer - offset + 1, 0) % freq != 0
        elif 0 <= layer < len(pattern):
            skip = pattern[layer] == "S"
        else:
            skip = False
        if not skip:
            owners.add(layer)
    return frozenset(owners)


def _layer_kinds(config: dict[str, Any], layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        linear = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    else:
        linear_cfg = config.get("linear_attn_config")
        kda = linear_cfg.get("kda_layers") if isinstance(linear_cfg, dict) else None
        linear = tuple(sorted(i for i in kda if isinstance(i, int))) if kda else ()
    mla = tuple(i for i in range(layers) if i not in set(linear))
    return mla, linear


def _moe_layers(config: dict[str, Any], layers: int, experts: int) -> frozenset[int]:
    types = config.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == layers:
        return frozenset(i for i, kind in enumerate(types) if kind == "sparse")
    if experts == 0:
        return frozenset()
    first_dense = _int(config, "first_k_dense_replace", 0, minimum=0)
    freq = _int(config, "moe_layer_freq", 1)
    return frozenset(i for i in range(layers) if i >= first_dense and i % freq == 0)


def _linear_attention(config: dict[str, Any], linear: tuple[int, ...]) -> LinearAttention | None:
    if not linear:
        return None
    cfg = config.get("linear_attn_config")
    if not isinstance(cfg, dict):
        raise SizingError("config has linear-attention layers but no 'linear_attn_config'")
    return LinearAttention(
        num_heads=_int(cfg, "num_heads"),
        head_dim=_int(cfg, "head_dim"),
        conv_kernel=_int(cfg, "short_conv_kernel_size", 4),
    )


def from_config(config: dict[str, Any], name: str = "") -> ModelShape:
    """Read and check a sparse-MLA model's shape; SizingError names what is missing."""
    text = _text_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    arches = config.get("architectures") or text.get("architectures") or [""]
    architecture = str(arches[0]) if isinstance(arches, list) and arches else ""
    if "compress_ratios" in text or model_type.startswith("deepseek_v4"):
        raise SizingError(
            "DeepSeek-V4 configs (compress_ratios, sliding-window + compressed sparse "
            "attention) are sized by mla_serve.sizing.planning.plan_dsv4 (mla-serve plan "
            "picks it), not by this sparse-MLA shape"
        )
    missing = [key for key in MLA_FIELDS if text.get(key) is None]
    if missing:
        raise SizingError(
            f"not a multi-head latent attention (MLA) config: missing {', '.join(missing)}"
        )
    if text.get("index_topk") is None:
        raise SizingError(
            "not a sparse-MLA (DSA) config: no 'index_topk'; `mla-serve plan` sizes "
            "DeepSeek-V3.2 / GLM-5.x sparse attention"
        )
    layers = _int(text, "num_hidden_layers")
    experts = _int(text, "n_routed_experts", 0, minimum=0)
    mla, linear = _layer_kinds(text, layers)
    declared = text.get("indexer_types")
    declared_full = (
        sum(1 for i, kind in enumerate(declared) if kind == "full" and i in set(mla))
        if isinstance(declared, list) and len(declared) == layers
        else None
    )
    q_lora = text.get("q_lora_rank")
    router_dtype = text.get("moe_router_dtype")
    return ModelShape(
        name=name or model_type or "model",
        model_type=model_type,
        architecture=architecture,
        dtype=str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"),
        hidden_size=_int(text, "hidden_size"),
        num_layers=layers,
        num_attention_heads=_int(text, "num_attention_heads"),
        vocab_size=_int(text, "vocab_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        q_lora_rank=None if q_lora is None else _int(text, "q_lora_rank"),
        kv_lora_rank=_int(text, "kv_lora_rank"),
        qk_nope_head_dim=_int(text, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim", minimum=0),
        v_head_dim=_int(text, "v_head_dim"),
        intermediate_size=_int(text, "intermediate_size", 0, minimum=0),
        moe_intermediate_size=_int(text, "moe_intermediate_size", 0, minimum=0),
        n_routed_experts=experts,
        n_shared_experts=_int(text, "n_shared_experts", 0, minimum=0),
        router_dtype_bytes=4 if router_dtype in ("float32", "fp32") else 2,
        index_n_heads=_int(text, "index_n_heads"),
        index_head_dim=_int(text, "index_head_dim"),
        index_topk=_int(text, "index_topk"),
        index_kpool=_int(text, "index_kpool", 1),
        mla_layers=mla,
        linear_layers=linear,
        moe_layers=_moe_layers(text, layers, experts),
        indexer_layers=_indexer_layers(text, mla),
        declared_full_indexers=declared_full,
        num_nextn_predict_layers=_int(text, "num_nextn_predict_layers", 0, minimum=0),
        linear_attention=_linear_attention(text, linear),
        hyper_connections=_int(text, "hc_mult", 1),
        has_vision=isinstance(config.get("vision_config"), dict),
        quantization=_quantization(config, text),
    )


def _quantization(config: dict[str, Any], text: dict[str, Any]) -> dict[str, Any] | None:
    quant = config.get("quantization_config", text.get("quantization_config"))
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise SizingError("config field 'quantization_config' must be an object")
    return quant
