"""Tiny models of the families the chart serves, as vLLM 0.33.0 builds them: few layers,
small widths and vocabulary, dummy weights, every figure a kernel fixes kept.

``python -m tests.e2e.model --out DIR [--model NAME] [--heads N]`` writes, offline and
byte-for-byte reproducibly, ``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``
(with a chat template). No weights: vLLM serves them with ``--load-format dummy``; the e2e
layouts (layouts.py) say which profile serves which model.

Each figure below is read off vLLM 0.33.0's own code (paths in the wheel), not guessed.

**deepseek-v3.2** (``DeepseekV32ForCausalLM``, ``deepseek_v32``; the b200 profiles and tp1)

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
  from vLLM's ``deepseek_v32_encoding.encode_messages``, the same text as the template here;
  ``--tokenizer-mode hf`` renders the template instead.
* RoPE ``default``, no yarn; no ``quantization_config`` (bf16); the bf16 (``auto``) KV
  cache is the only one FLASH_ATTN_MLA_SPARSE takes (``fp8_ds_mla`` -> FLASHMLA_SPARSE).
* Block size 64: ``DeepseekV32IndexerBackend.get_supported_kernel_block_sizes``.
* ``<think>``/``</think>`` are added but not special, as in DeepSeek's tokenizer, so the
  ``deepseek_v3`` reasoning parser still finds ``</think>`` in detokenized text.

**deepseek-v4-flash** (``DeepseekV4ForCausalLM``, ``deepseek_v4``; the ``dsv4-flash``
profile). On SM90 the layer is ``DeepseekV4FlashMLAAttention`` (``_select_dsv4_attn_cls``,
models/deepseek_v4/nvidia/model.py: FlashInfer's DSv4 class is SM100's and SM120's).

* ``head_dim=512`` (448 NoPE + 64 RoPE, ``partial_rotary_factor=0.125``): the only size
  ``DeepseekV4SparseMLABackend.get_supported_head_sizes`` and FlashMLA's V4 kernels take
  ("Only head_size_k == 512 (V4 / V4.1) is supported"); decode passes ``head_dim_v=512``.
  The fp8_ds_mla cache row is 448 fp8 NoPE + 64 bf16 RoPE + scales (584 bytes,
  ``DeepseekV4Attention.get_kv_cache_spec``).
* ``num_attention_heads=64``, ``o_groups=8``: FlashMLA's DSv4 decode takes h_q 64 or 128
  (``get_padded_num_q_heads`` pads up to 64; TP2's 32 heads per rank are padded to 64);
  8 heads per ``wo_a`` group is DSv4's at any TP size (``rope_quant_unsupported_reason``,
  nvidia/ops/o_proj.py), and ``o_groups`` must divide by TP.
* ``layer_types``: one layer of each attention kind DSv4 has: ``sliding_attention``
  (compress ratio 0: SWA only), ``compressed_sparse_attention`` (C4A, the only kind with
  an indexer) and ``heavily_compressed_attention`` (C128A); ``compress_rates`` 4 and 128
  are DSv4's (``get_compress_ratios``, transformers_utils/deepseek_v4_utils.py; decode
  raises for any ratio but 1, 4, 128: ``_forward_decode``).
* ``sliding_window=128``, ``index_topk=512``, ``index_n_heads=64``, ``index_head_dim=128``:
  DeepSeek-V4-Flash's. The indexer runs DeepGEMM's SM90 MQA-logits kernels (32 or 64
  heads) over an fp8 K cache of 132 bytes an entry, 128 fp8 and one fp32 scale per 128-wide
  block (``DeepseekV4Indexer``, ``quant_block_size = 128``); C4A attends to the top-512
  compressed entries plus the 128-token window
  (``combined_topk = round_up(top_k + window, 128)``).
* Block size 256: ``DeepseekV4SparseMLABackend.get_supported_kernel_block_sizes``.
* KV cache fp8 (fp8_ds_mla): demanded by the kernel. The FlashMLA layer's block format
  is fp8_ds_mla (``use_fp8_ds_mla_layout``), so ``--kv-cache-dtype auto`` becomes
  ``fp8_ds_mla`` ("Using DeepSeek's fp8_ds_mla KV cache format.",
  ``_resolve_dsv4_kv_cache_dtype``) and sparse FlashMLA decode asserts an fp8 cache.
  Weights stay bf16: with no ``quantization_config`` the output projection takes the
  ``torch.bmm`` path (``deep_gemm_fp8_o_proj``), not DeepGEMM's fp8 einsum.
* ``hidden_size=1024``, ``hc_mult=4`` (DSv4's 4 streams): the TileLang mHC kernels split
  the hidden size over 128-thread blocks (the fused post + pre-norm kernel falls back
  otherwise) and the pre-norm GEMM asserts ``hc_mult * hidden`` a multiple of its 512
  threads, 1024 on its small-tile path (model_executor/kernels/mhc/tilelang_kernels.py).
* MoE, as DSv4 cannot run without it (every layer's FFN is ``DeepseekV4MoE``):
  ``mlp_layer_types`` one ``hash_moe`` layer (routed by the token id through
  ``tid2eid``) and two ``moe``; 16 routed experts (a count ``_moe_C``'s
  ``topk_softplus_sqrt`` is built for; divisible by EP 2), top-6 (DSv4's),
  ``sqrtsoftplus`` scoring with ``noaux_tc`` bias, one shared expert, ``swiglu_limit=10``.
  With ``--enable-expert-parallel`` each rank of TP2 holds 8 experts.
* ``num_nextn_predict_layers=0``: no MTP (the profile runs no speculative decoding).
* Tokenizer mode ``deepseek_v4`` (``ModelConfig`` sets it for the architecture): prompts
  come from ``deepseek_v4_encoding.encode_messages``; ``thinking`` (or ``enable_thinking``)
  picks thinking or chat mode and thinking is the default.

**glm-5.3-flash** (``Glm5NextForCausalLM``, ``glm5_next_text``; the ``gb300-tp4`` profile).
GLM-5.3-Flash ships as ``Glm5NextForConditionalGeneration``, which builds exactly this
class as its ``language_model`` (models/glm5next/common/model.py) next to a vision tower;
the tower needs GLM's image processor files and is not on the sparse-MLA/KDA path, so the
tiny model is the language model.

* ``kv_lora_rank=512``, ``qk_rope_head_dim=0``, ``mla_use_nope=true`` (MLA head size 512):
  GLM-5.3 is NoPE (transformers' ``Glm5NextTextConfig`` rejects RoPE dims). On SM90 the
  sparse backends for 512 are FLASHINFER_MLA_SPARSE_SM90 (first, when FlashInfer >= 0.6.18
  is installed) and FLASHMLA_SPARSE, which takes 512 "only for rope-free (NoPE) models"
  with a bf16 or fp8_ds_mla cache on SM90 (``supports_combination``); FA3's sparse MLA
  takes only 576. ``qk_nope_head_dim=256``, ``v_head_dim=256``: GLM-5.3's.
* ``num_attention_heads=64``: GLM-5.3's; FlashMLA sparse pads prefill heads to 64.
* Indexer: ``index_head_dim=128`` (``fwht128_quant_fp8`` asserts a 128-wide head),
  ``index_n_heads=32`` (DeepGEMM's MQA-logits kernels take 32 or 64; vLLM pads fewer to 32),
  ``index_topk=2048`` with ``index_kpool=4`` (the top-k picks 2048 / 4 = 512 pools; the
  top-k must divide by the pool, ``kpool_compress``), ``index_kpool_always_select_tail``
  true (anything else raises NotImplementedError, ``_validate_supported_config``).
* KDA: ``linear_attn_config`` 64 heads of 128 with a 4-wide convolution and
  ``gate_lower_bound=-5``: on SM90 with bf16, 128-wide heads and a bounded gate the
  prefill runs FlashKDA (``vllm._flashkda_C``; ``_resolve_kda_prefill_backend``), decode
  the Triton ``fused_recurrent_kda``.
* ``layer_types``: three ``linear_attention`` (KDA) and one ``deepseek_sparse_attention``
  (sparse MLA), GLM-5.3's 3:1 rhythm (layer i is MLA when ``i % 4 == 3``).
* ``mhc=true``, ``hc_mult=4``: GLM-5.3's multi-stream residual (TileLang kernels where
  TileLang is installed); ``hidden_size=1024`` as for DSv4.
* MoE: one ``dense`` then ``sparse`` layers, 16 routed experts, top-8 (GLM-5.3's), one
  shared expert, ``sigmoid`` scoring with ``noaux_tc`` and grouped top-k over one group
  (``_moe_C``'s ``grouped_topk``: top-k <= experts per group, at most 32).
* Chat template: written here with the traits vLLM's ``glm45`` parser reads as GLM-5.3's
  (``_glm53_always_thinks``, parser/glm47_moe.py): ``[gMASK]<sop>``, a
  ``Reasoning Effort:`` header, GLM's ``<tool_call>`` / ``<arg_key>`` / ``<arg_value>``
  tool format and no ``enable_thinking`` switch. GLM-5.3 always thinks: the generation
  prompt opens ``<think>`` and vLLM ignores ``thinking: false`` (with a warning).

**glm-5.2** (``GlmMoeDsaForCausalLM``, ``glm_moe_dsa``): GLM-5.x without compression
(every layer full DSA, compress ratio 1), which vLLM runs with the V3.2 model class
(models/deepseek_v32/__init__.py). The figures of V3.2 above hold (head size 576, block
size 64) with GLM-5's own: ``qk_nope_head_dim=192``, ``v_head_dim=256``,
``index_n_heads=32``, MoE after one dense layer (16 experts, top-8, sigmoid grouped top-k).
Its template is GLM-5's, with the ``enable_thinking`` switch.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Final

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

VOCAB_SIZE: Final = 4096  # BPE (specials first) then the added tokens: the last ids
MAX_LEN: Final = 8192
THINK: Final = "<think>"
THINK_END: Final = "</think>"

_BAR, _SP = "\uff5c", "\u2581"  # DeepSeek's fullwidth bar and its "space" (lower 1/8 block)
DS_BOS: Final = f"<{_BAR}begin{_SP}of{_SP}sentence{_BAR}>"
DS_EOS: Final = f"<{_BAR}end{_SP}of{_SP}sentence{_BAR}>"
DS_PAD: Final = f"<{_BAR}{_SP}pad{_SP}{_BAR}>"
DS_USER: Final = f"<{_BAR}User{_BAR}>"
DS_ASSISTANT: Final = f"<{_BAR}Assistant{_BAR}>"
DS_SPECIAL: Final = (DS_BOS, DS_EOS, DS_PAD, DS_USER, DS_ASSISTANT)  # ids 0-4

GLM_EOS: Final = "<|endoftext|>"
GLM_USER: Final = "<|user|>"
GLM_OBSERVATION: Final = "<|observation|>"
GLM_SPECIAL: Final = (
    GLM_EOS, "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", GLM_USER, "<|assistant|>", GLM_OBSERVATION,
)  # fmt: skip
# GLM's tool-call markup: added, not special, so the glm45/glm47 parsers see it in text.
GLM_ADDED: Final = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", THINK, THINK_END,
)  # fmt: skip

# DeepSeek-V3.1 style; `thinking` (or `enable_thinking`) picks the generation prompt's tail.
DS_TEMPLATE: Final = (
    "{{- bos_token -}}"
    "{%- for m in messages if m['role'] == 'system' -%}{{- m['content'] -}}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{- '" + DS_USER + "' + m['content'] -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- '" + DS_ASSISTANT + THINK_END + "' + (m['content'] or '') + '" + DS_EOS + "' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt is defined and add_generation_prompt -%}"
    "{%- if (thinking is defined and thinking) or "
    "(enable_thinking is defined and enable_thinking) -%}"
    "{{- '" + DS_ASSISTANT + THINK + "' -}}"
    "{%- else -%}{{- '" + DS_ASSISTANT + THINK_END + "' -}}{%- endif -%}{%- endif -%}"
)

# GLM's turns and tool calls, shared by both GLM templates: `_GLM_TOOLS` describes the
# tools, `_GLM_TURNS` renders the conversation (earlier turns' reasoning dropped).
_GLM_TOOLS: Final = (
    "{%- if tools -%}<|system|>\n# Tools\nCall a tool as <tool_call>NAME<arg_key>KEY"
    "</arg_key><arg_value>VALUE</arg_value></tool_call>. Available:"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor -%}{%- endif -%}"
)
_GLM_TURNS: Final = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|system|>{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}<|user|>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|></think>{{ m['content'] or '' }}"
    "{%- for call in m['tool_calls'] or [] -%}<tool_call>{{ call['function']['name'] }}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{%- if arguments is mapping -%}{%- for key, value in arguments.items() -%}"
    "<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson }}"
    "</arg_value>{%- endfor -%}{%- else -%}{{ arguments }}{%- endif -%}"
    "</tool_call>{%- endfor -%}"
    "{%- elif m['role'] == 'tool' -%}<|observation|><tool_response>{{ m['content'] }}"
    "</tool_response>{%- endif -%}{%- endfor -%}"
)
# GLM-5.3: always thinks; the effort header takes low/medium/high/max, anything else is max.
GLM53_TEMPLATE: Final = (
    "[gMASK]<sop>"
    "{%- if reasoning_effort is defined and reasoning_effort in "
    "['low', 'medium', 'high', 'max'] -%}{%- set effort = reasoning_effort -%}"
    "{%- else -%}{%- set effort = 'max' -%}{%- endif -%}"
    "<|system|>Reasoning Effort: {{ effort }}" + _GLM_TOOLS + _GLM_TURNS + ""
    "{%- if add_generation_prompt is defined and add_generation_prompt -%}"
    "<|assistant|><think>{%- endif -%}"
)
# GLM-5/5.2: `enable_thinking` (default on) or `thinking` picks the generation prompt's tail.
GLM5_TEMPLATE: Final = (
    "[gMASK]<sop>" + _GLM_TOOLS + _GLM_TURNS + ""
    "{%- if add_generation_prompt is defined and add_generation_prompt -%}"
    "{%- if (enable_thinking is defined and not enable_thinking) or "
    "(thinking is defined and not thinking) -%}<|assistant|></think>"
    "{%- else -%}<|assistant|><think>{%- endif -%}{%- endif -%}"
)


@dataclass(frozen=True)
class Tiny:
    """One tiny model: its config.json, tokenizer layout and what vLLM serves it with."""

    name: str  # the model directory's and layouts' name
    family: str  # the model family it stands for
    config: Mapping[str, Any]  # config.json, 64 attention heads
    special: tuple[str, ...]  # special tokens, ids 0.. as the BPE trainer lays them out
    added: tuple[str, ...]  # added, not special: the last ids
    bos: str | None  # prepended by the tokenizer (DeepSeek) or by the template (GLM)
    eos: str
    pad: str
    chat_template: str
    reasoning_parser: str
    tool_parser: str
    # The chat_template_kwargs key that turns thinking off (False), or None where the model
    # always thinks (GLM-5.3: vLLM's glm45 parser ignores `thinking: false`).
    thinking_switch: str | None = "thinking"
    variants: tuple[int, ...] = (64,)  # attention-head counts the layouts need

    @property
    def served_name(self) -> str:
        return f"tiny-{self.name}"

    def directory(self, heads: int = 64) -> str:
        """The model directory's name in the pack's common/ (one per head count)."""
        return f"model-{self.name}" + ("" if heads == 64 else f"-h{heads}")

    def config_for(self, heads: int = 64) -> dict[str, Any]:
        """`config` with `heads` attention heads (and KV heads where the family has them).

        32 heads is the decode-context-parallel variant: FlashMLA sparse, the backend vLLM
        takes under DCP on Hopper (fp8_ds_mla cache), runs its DCP decode path with fewer
        than 32 heads per rank, i.e. TP2 of 32 heads.
        """
        if heads not in self.variants:
            raise ValueError(f"{self.name} has no {heads}-head variant ({self.variants})")
        out = dict(self.config) | {"num_attention_heads": heads}
        if self.config.get("num_key_value_heads") == self.config["num_attention_heads"]:
            out["num_key_value_heads"] = heads
        return out

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return build_tokenizer(self)

    def token_id(self, text: str) -> int:
        found = self.tokenizer.token_to_id(text)
        if found is None:
            raise KeyError(f"{text!r} is no token of {self.name}")
        return int(found)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every token id vLLM stops at: the config's eos ids."""
        ids = self.config["eos_token_id"]
        return tuple(ids) if isinstance(ids, list) else (int(ids),)

    def tokenizer_config(self) -> dict[str, Any]:
        """What transformers 5's `PreTrainedTokenizerFast` (TokenizersBackend) reads."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **({"bos_token": self.bos} if self.bos else {}),
            "eos_token": self.eos,
            "pad_token": self.pad,
            "add_bos_token": self.bos is not None,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_LEN,
            "chat_template": self.chat_template,
        }

    def write(self, out: Path, heads: int = 64) -> Path:
        """Write the model directory `out` (created if missing) and return it."""
        config = self.config_for(heads)  # refuses a variant the model has not
        out.mkdir(parents=True, exist_ok=True)
        _dump(out / "config.json", config)
        _dump(out / "tokenizer.json", json.loads(self.tokenizer.to_str()))
        _dump(out / "tokenizer_config.json", self.tokenizer_config())
        return out


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


def build_tokenizer(tiny: Tiny) -> Tokenizer:
    """Byte-level BPE trained on `corpus`, with the family's special and added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(tiny.added),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in tiny.special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tiny.added])
    if tiny.bos is not None:
        bos = tiny.special.index(tiny.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tiny.bos} $A", pair=f"{tiny.bos} $A {tiny.bos} $B",
            special_tokens=[(tiny.bos, bos)],
        )  # fmt: skip
    ids = [tok.token_to_id(t) for t in (*tiny.special, *tiny.added)]
    layout = [*range(len(tiny.special)), *range(VOCAB_SIZE - len(tiny.added), VOCAB_SIZE)]
    if ids != layout or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"unexpected tokenizer layout: {ids}, {tok.get_vocab_size()}")
    return tok


def _dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_DS_IDS: Final = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_GLM_STOPS: Final = [GLM_SPECIAL.index(t) for t in (GLM_EOS, GLM_USER, GLM_OBSERVATION)]

DEEPSEEK_V32: Final = Tiny(
    name="deepseek-v3.2",
    family="DeepSeek-V3.2",
    config={
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,
        "mlp_layer_types": ["dense"] * 2,
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
        **_DS_IDS,
    },
    special=DS_SPECIAL,
    added=(THINK, THINK_END),
    bos=DS_BOS,
    eos=DS_EOS,
    pad=DS_PAD,
    chat_template=DS_TEMPLATE,
    reasoning_parser="deepseek_v3",
    tool_parser="deepseek_v32",
    variants=(64, 32),
)

DEEPSEEK_V4_FLASH: Final = Tiny(
    name="deepseek-v4-flash",
    family="DeepSeek-V4-Flash",
    config={
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1024,
        "num_hidden_layers": 3,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "sliding_window": 128,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "partial_rotary_factor": 0.125,
        "q_lora_rank": 512,
        "o_groups": 8,
        "o_lora_rank": 512,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "n_routed_experts": 16,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 256,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_LEN,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **_DS_IDS,
    },
    special=DS_SPECIAL,
    added=(THINK, THINK_END),
    bos=DS_BOS,
    eos=DS_EOS,
    pad=DS_PAD,
    chat_template=DS_TEMPLATE,  # for --tokenizer-mode hf; deepseek_v4 encodes itself
    reasoning_parser="deepseek_v4",
    tool_parser="deepseek_v4",
)

GLM53_FLASH: Final = Tiny(
    name="glm-5.3-flash",
    family="GLM-5.3-Flash",
    config={
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next_text",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"],
        "mlp_layer_types": ["dense"] + ["sparse"] * 3,
        "indexer_types": ["full"] * 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 512,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0,
        "v_head_dim": 256,
        "mla_use_nope": True,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_kpool": 4,
        "index_kpool_always_select_tail": True,
        "indexer_rope_interleave": True,
        "linear_attn_config": {
            "num_heads": 64,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
        },
        "mhc": True,
        "hc_mult": 4,
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "n_routed_experts": 16,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_router_dtype": "float32",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_LEN,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "eos_token_id": _GLM_STOPS,
        "pad_token_id": 0,
    },
    special=GLM_SPECIAL,
    added=GLM_ADDED,
    bos=None,
    eos=GLM_EOS,
    pad=GLM_EOS,
    chat_template=GLM53_TEMPLATE,
    reasoning_parser="glm45",
    tool_parser="glm47",
    thinking_switch=None,
)

GLM52: Final = Tiny(
    name="glm-5.2",
    family="GLM-5.2",
    config={
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense", "sparse"],
        "indexer_types": ["full"] * 2,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 512,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "n_routed_experts": 16,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_LEN,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": _GLM_STOPS,
        "pad_token_id": 0,
    },
    special=GLM_SPECIAL,
    added=GLM_ADDED,
    bos=None,
    eos=GLM_EOS,
    pad=GLM_EOS,
    chat_template=GLM5_TEMPLATE,
    reasoning_parser="glm45",
    tool_parser="glm47",
    thinking_switch="enable_thinking",
    variants=(64, 32),
)

MODELS: Final = {tiny.name: tiny for tiny in (DEEPSEEK_V32, DEEPSEEK_V4_FLASH, GLM53_FLASH, GLM52)}


def write_all(common: Path) -> list[Path]:
    """Every model directory the layouts may name, each head-count variant, under `common`."""
    return [
        tiny.write(common / tiny.directory(heads), heads)
        for tiny in MODELS.values()
        for heads in tiny.variants
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEEPSEEK_V32.name)
    parser.add_argument("--heads", type=int, default=64, help="attention heads (64 or 32)")
    args = parser.parse_args(argv)
    tiny = MODELS[args.model]
    if args.heads not in tiny.variants:
        parser.error(f"--heads {args.heads}: {tiny.name} is made with {tiny.variants} heads")
    tiny.write(args.out, args.heads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
