"""A tiny DeepSeek-V3.2 (DSA: MLA + lightning indexer) model directory for vLLM 0.33.0.

``python tests/e2e/model.py --out DIR`` writes, offline and byte-for-byte reproducibly,
``config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with a chat template).
No weights: serve it with dummy ones on one Hopper GPU (CUDA graphs stay on)::

    vllm serve DIR --load-format dummy --reasoning-parser deepseek_v3 \\
        --kv-cache-dtype auto --block-size 64 --max-model-len 8192

Figures a kernel fixes are DeepSeek-V3.2's; only width, depth and vocabulary shrink.

* ``kv_lora_rank=512``, ``qk_rope_head_dim=64`` (head size 576): FLASH_ATTN_MLA_SPARSE,
  first for sparse MLA on SM90 in ``_get_backend_priorities`` (platforms/cuda.py), runs
  FA3's 64-wide q/k + 512-wide ``q_v`` kernel (``FlashAttnMLASparseImpl``); its fallback
  FLASHMLA_SPARSE takes 576 (``FlashMLASparseBackend.get_supported_head_sizes``);
  ``fused_norm_rope`` (models/deepseek_v32/common/kernels.py) takes 512 as a Triton
  ``arange`` width and ``fused_indexer_q_rope_quant`` asserts a 64-wide RoPE cache.
* ``index_head_dim=128``: asserted by ``fused_indexer_q_rope_quant``; the indexer K cache
  holds 128 fp8 + an fp32 scale per 128 (``DeepseekV32Indexer``). ``index_n_heads=64``:
  V3.2's, what DeepGEMM's SM90 ``fp8_mqa_logits`` runs (``SparseAttnIndexer`` needs
  DeepGEMM on CUDA).
* ``index_topk=2048``: the persistent top-k takes 512/1024/2048 (``indexer_topk.py``).
  Prompts over 2048 tokens (of 8192) take the sparse path, shorter ones dense-MHA prefill
  (``_use_dense_mha_prefill``).
* ``num_attention_heads=64``: no padding in FlashMLA sparse (prefill pads to 64, fp8
  decode to 64/128: ``FlashMLASparseImpl``); in FA3's tuned set {16, 32, 64, 128}.
* ``first_k_dense_replace=num_hidden_layers``, ``n_routed_experts=0``: every
  ``DeepseekV32DecoderLayer`` builds ``DeepseekV2MLP``, never ``DeepseekV2MoE`` (no fused
  MoE), and ``ModelConfig.is_moe`` is False. An int, not null: transformers'
  ``DeepseekV3Config``, which vLLM loads for ``deepseek_v32``, is ``@strict``.
* ``model_type="deepseek_v32"`` (``_CONFIG_REGISTRY``, transformers_utils/config.py). The
  architecture sets ``tokenizer_mode="deepseek_v32"`` (``ModelConfig``): chat prompts come
  from vLLM's ``deepseek_v32_encoding.encode_messages``, the same text as ``CHAT_TEMPLATE``;
  ``--tokenizer-mode hf`` renders the template instead.
* RoPE ``default``, no yarn; no ``quantization_config`` (bf16); the bf16 (``auto``) KV
  cache is the only one FLASH_ATTN_MLA_SPARSE takes (``fp8_ds_mla`` -> FLASHMLA_SPARSE).
* Block size 64: ``DeepseekV32IndexerBackend.get_supported_kernel_block_sizes``.

``<think>``/``</think>`` are added but not special, as in DeepSeek's tokenizer, so the
``deepseek_v3`` reasoning parser still finds ``</think>`` in detokenized text.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

_BAR, _SP = "\uff5c", "\u2581"  # DeepSeek's fullwidth bar and its "space" (lower 1/8 block)
BOS: Final = f"<{_BAR}begin{_SP}of{_SP}sentence{_BAR}>"
EOS: Final = f"<{_BAR}end{_SP}of{_SP}sentence{_BAR}>"
PAD: Final = f"<{_BAR}{_SP}pad{_SP}{_BAR}>"
USER: Final = f"<{_BAR}User{_BAR}>"
ASSISTANT: Final = f"<{_BAR}Assistant{_BAR}>"
THINK: Final = "<think>"
THINK_END: Final = "</think>"
SPECIAL: Final = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0-4, as the trainer lays them out
VOCAB_SIZE: Final = 4096  # BPE (incl. SPECIAL) then <think>, </think>: the last two ids
THINK_ID: Final = VOCAB_SIZE - 2
THINK_END_ID: Final = VOCAB_SIZE - 1
NUM_LAYERS: Final = 2
MAX_LEN: Final = 8192

# DeepSeek-V3.1 style; `thinking` (or `enable_thinking`) picks the generation prompt's tail.
CHAT_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- for m in messages if m['role'] == 'system' -%}{{- m['content'] -}}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '" + USER + "' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + THINK_END + "' + (m['content'] or '') + '" + EOS + "' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt is defined and add_generation_prompt -%}"
    "{%- if (thinking is defined and thinking) or "
    "(enable_thinking is defined and enable_thinking) -%}{{- '" + ASSISTANT + THINK + "' -}}"
    "{%- else -%}{{- '" + ASSISTANT + THINK_END + "' -}}{%- endif -%}{%- endif -%}"
)

CONFIG: Final[dict[str, Any]] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": NUM_LAYERS,
    "first_k_dense_replace": NUM_LAYERS,
    "mlp_layer_types": ["dense"] * NUM_LAYERS,
    "n_routed_experts": 0,
    "n_shared_experts": 0,
    "num_experts_per_tok": 0,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "max_position_embeddings": MAX_LEN,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

_TEXT: Final = (
    "Hello! How are you today? I am fine, thank you. What is the capital of France? "
    "Paris is the capital of France. Count from one to ten: one two three four five six "
    "seven eight nine ten. The quick brown fox jumps over the lazy dog. def main() -> int: "
    "return 0  # 0123456789 (){}[]<>=+-*/%.,;:!?'\"\n"
)


def corpus(lines: int = 6000) -> list[str]:
    """Fixed English text plus seeded pseudo-words: enough pairs for every merge."""
    rng = random.Random(32)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    lexicon = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(5000)]
    words = [lexicon[int(len(lexicon) * rng.random() ** 3)] for _ in range(lines * 10)]
    return [_TEXT] * 200 + [" ".join(words[i : i + 10]) for i in range(0, len(words), 10)]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on `corpus`, DeepSeek's markers added as V3.2 has them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - 2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, THINK_END)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    ids = [tok.token_to_id(t) for t in (*SPECIAL, THINK, THINK_END)]
    if ids != [0, 1, 2, 3, 4, THINK_ID, THINK_END_ID] or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"unexpected tokenizer layout: {ids}, {tok.get_vocab_size()}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    """What transformers 5's `PreTrainedTokenizerFast` (TokenizersBackend) reads."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LEN,
        "chat_template": CHAT_TEMPLATE,
    }


def _dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def config(heads: int = 64) -> dict[str, Any]:
    """CONFIG with `heads` attention (and indexer-query) heads.

    32 heads is the decode-context-parallel variant: FlashMLA sparse, the backend vLLM
    takes under DCP on Hopper (fp8_ds_mla cache), runs its DCP decode path with fewer
    than 32 heads per rank, i.e. TP2 of 32 heads.
    """
    return CONFIG | {"num_attention_heads": heads, "num_key_value_heads": heads}


def write_model(out: Path, heads: int = 64) -> Path:
    """Write the model directory `out` (created if missing) and return it."""
    out.mkdir(parents=True, exist_ok=True)
    _dump(out / "config.json", config(heads))
    _dump(out / "tokenizer.json", json.loads(build_tokenizer().to_str()))
    _dump(out / "tokenizer_config.json", tokenizer_config())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--heads", type=int, default=64, help="attention heads (64 or 32)")
    args = parser.parse_args(argv)
    write_model(args.out, args.heads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
