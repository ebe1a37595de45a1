"""vLLM's own code against a tiny model directory, on the CPU; prints one JSON record.

    python -m tests.e2e.cpu_check build MODEL_DIR [SERVE_ARGS ...]
    python -m tests.e2e.cpu_check prefix-cache MODEL_DIR [SERVE_ARGS ...]
    python -m tests.e2e.cpu_check memory MODEL_DIR [SERVE_ARGS ...]
    python -m tests.e2e.cpu_check glm53 MODEL_DIR

Run from the repository root with the release's tree on PYTHONPATH and
VLLM_TARGET_DEVICE=cpu (tests/test_e2e_models.py does). The e2e layouts' vLLM is
0.33.0's; what needs a GPU is `make e2e`'s.

`build`: `vllm serve`'s own argument parser and engine arguments turn the layout's
flags into the engine config (on vLLM's CPU platform, which forces CUDA graphs off),
and the model class vLLM resolves for the architecture on this platform is built on
the meta device. The DeepSeek-V4 attention layer creates CUDA events (and, in its
model, streams) while it is built and records nothing on them then; the CPU build of
torch cannot create them at all, so for the build only they are inert objects.

`prefix-cache`: the same engine config and model, then vLLM's own KV-cache planning on the
model's layers' specs (every group the hybrid cache makes), its engine core's block-size
resolution, and its `Scheduler` with its KV cache manager: three requests go through
chunked prefill and a few decode steps (the model's outputs stand in: one sampled token a
step), and the number of prompt tokens each new request is scheduled with already computed
is its prefix-cache hit. vLLM's CPU platform turns prefix caching and chunked prefill off
for MLA models (platforms/cpu.py); the check turns them back on, as the GPU keeps them.

`glm53`: GLM-5.3's model module imports GLM-4V's image processor, which needs a
torchvision build the CPU torch here has not, so vLLM's model registry cannot inspect
the architecture on this machine and no config of vLLM's is built. What runs without
it: transformers' strict config classes, vLLM's tokenizer loading, its chat-template
path (kwargs filtered as vLLM filters them), the `glm45` reasoning parser and the
`glm47` tool parser.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def engine(model_dir: str, serve_args: list[str]) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """`vllm serve`'s engine config for the model and layout flags, and the model vLLM
    resolves for the architecture, built on the meta device (None where vLLM's CPU platform
    declines its layers: the record says why), inside vLLM's current config and a one-rank
    process group."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.torch_utils import set_default_torch_dtype

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model_dir, *serve_args])
    validate_parsed_serve_args(args)
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()

    class Inert:  # a CUDA event or stream the CPU build of torch cannot create
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    if not torch.cuda.is_available():
        torch.cuda.Event = Inert  # type: ignore[misc,assignment]
        torch.cuda.Stream = Inert  # type: ignore[misc,assignment]
    model_config = config.model_config
    record: dict[str, Any] = {
        "architecture": model_config.architecture,
        "tokenizer_mode": model_config.tokenizer_mode,
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "is_moe": model_config.is_moe,
        "max_model_len": model_config.max_model_len,
        "expert_parallel": config.parallel_config.enable_expert_parallel,
        "reasoning_parser": config.structured_outputs_config.reasoning_parser,
    }
    with tempfile.NamedTemporaryFile() as rendezvous, set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{rendezvous.name}",
            backend="gloo",
        )
        initialize_model_parallel(1)
        model_class, _ = get_model_architecture(model_config)
        record["model_class"] = f"{model_class.__module__}.{model_class.__qualname__}"
        try:  # in the model's dtype, as vLLM's model loader builds it
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = model_class(vllm_config=config)
        except NotImplementedError as refused:  # vLLM's CPU platform declines the layer
            record["refused"] = str(refused)
            model = None
        yield config, model, record


def build(model_dir: str, serve_args: list[str]) -> dict[str, Any]:
    with engine(model_dir, serve_args) as (_, model, record):
        if model is None:
            return record
    record["parameters"] = sum(p.numel() for p in model.parameters())
    record["attention"] = {
        name: {
            "class": type(module).__name__,
            "compress_ratio": getattr(module, "compress_ratio", None),
            "indexer": getattr(module, "indexer", None) is not None,
            "heads": getattr(module, "n_local_heads", getattr(module, "num_local_heads", None)),
        }
        for name, module in model.named_modules()
        if name.endswith(".attn") or name.endswith(".self_attn")
    }
    record["experts"] = {
        name: {
            "routed_experts": module.n_routed_experts,
            "hash_routed": getattr(getattr(module, "gate", None), "tid2eid", None) is not None,
        }
        for name, module in model.named_modules()
        if hasattr(module, "n_routed_experts") and hasattr(module, "gate")
    }
    return record


PROMPT_TOKENS = 3000
SHARED_TOKENS = 1000  # the third request's prompt shares only its first 1000 tokens
CHUNK_TOKENS = 1024  # the scheduler's token budget: the prompt takes three prefill steps


def prefix_cache(model_dir: str, serve_args: list[str]) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    with engine(model_dir, serve_args) as (config, model, record):
        if model is None:
            return record
        # What the GPU worker reports: every attention layer's spec, and its backends.
        specs: dict[str, Any] = {}
        backends: list[Any] = []
        for name, layer in config.compilation_config.static_forward_context.items():
            if isinstance(layer, AttentionLayerBase):
                spec = layer.get_kv_cache_spec(config)
                if spec is not None:
                    specs[name] = spec
                    if layer.get_attn_backend() not in backends:
                        backends.append(layer.get_attn_backend())
    # On the GPU both stay on (platforms/cpu.py turns them off for MLA models on a CPU).
    config.cache_config.enable_prefix_caching = True
    config.scheduler_config.enable_chunked_prefill = True
    config.scheduler_config.max_num_batched_tokens = CHUNK_TOKENS
    with set_current_vllm_config(config):
        # The engine core's order (v1/engine/core.py, _initialize_kv_caches and __init__).
        layouts = get_supported_kv_cache_layouts(backends)
        resolve_kv_cache_layout(config, [[layout.name for layout in layouts]], specs.values())
        groups = get_global_kv_cache_groups(config, [specs])
        configs = get_kv_cache_configs(config, [specs], [1 << 30], groups)
        kv_cache_config = generate_scheduler_kv_cache_config(configs)
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        cacheable = [
            g.kv_cache_spec.block_size
            for g in kv_cache_config.kv_cache_groups
            if g.kv_cache_spec.prefix_cacheable
        ]
        config.cache_config.block_size = min(cacheable)
        config.validate_block_size()
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
        alignment = resolve_cache_hit_alignment_tokens(
            kv_cache_config, config, block_size, hash_block_size
        )
        for each in (*configs, kv_cache_config):
            each.hash_block_size = hash_block_size
            each.cache_hit_alignment_tokens = alignment
        scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            log_stats=True,
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        init_none_hash(sha256)

        def serve(request_id: str, prompt: list[int]) -> int:
            """The prompt tokens the request is first scheduled with as computed."""
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            scheduler.add_request(
                Request(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=get_request_block_hasher(hash_block_size, sha256),
                )
            )
            hit = -1
            while scheduler.has_requests():
                step = scheduler.schedule()
                for new in step.scheduled_new_reqs:
                    hit = new.num_computed_tokens
                ids = list(step.num_scheduled_tokens)
                sampled = []  # one token for a request whose prompt this step completes
                for rid in ids:
                    request = scheduler.requests[rid]
                    end = request.num_computed_tokens + step.num_scheduled_tokens[rid]
                    sampled.append([5] if end >= request.num_prompt_tokens else [])
                output = ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={rid: i for i, rid in enumerate(ids)},
                    sampled_token_ids=sampled,
                )
                scheduler.update_from_output(step, output)
            return hit

        prompt = [(7 * k) % 1000 + 2 for k in range(PROMPT_TOKENS)]
        # Two more prompts that share only the first SHARED_TOKENS tokens with it.
        other = prompt[:SHARED_TOKENS] + [(11 * k) % 997 + 3 for k in range(PROMPT_TOKENS)]
        third = prompt[:SHARED_TOKENS] + [(13 * k) % 991 + 4 for k in range(PROMPT_TOKENS)]
        record.update(
            groups=[
                [type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, len(g.layer_names)]
                for g in kv_cache_config.kv_cache_groups
            ],
            block_size=block_size,
            hash_block_size=hash_block_size,
            cache_hit_alignment_tokens=alignment,
            prompt_tokens=PROMPT_TOKENS,
            shared_tokens=SHARED_TOKENS,
            hits=[
                serve("first", prompt),
                serve("again", list(prompt)),
                serve("other", other),
                serve("third", third),
            ],
        )
    return record


def memory(model_dir: str, serve_args: list[str]) -> dict[str, Any]:
    """What of a DeepSeek-V4 rank's memory outside the KV cache vLLM's own code fixes before
    it profiles: the model's parameters and buffers (built on the meta device: their sizes,
    as loading allocates them), and the prefill gather workspace the FlashMLA layers reserve
    in the warm-up dummy run (`DeepseekV4FlashMLAAttention.forward_mqa` without attention
    metadata), run here for each attention layer on a CPU workspace manager; the largest is
    what the shared workspace keeps."""
    import torch
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.v1.worker import workspace

    with engine(model_dir, serve_args) as (config, model, record):
        if model is None:
            return record
        record["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        record["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
        reserved = {}
        # Growing the workspace releases the accelerator's cache, which a CPU does not have.
        torch.accelerator.empty_cache = lambda: None  # type: ignore[assignment]
        for name, module in model.named_modules():
            if not hasattr(module, "compress_ratio") or not hasattr(module, "swa_cache_layer"):
                continue
            layer = object.__new__(flashmla.DeepseekV4FlashMLAAttention)
            torch.nn.Module.__init__(layer)
            for key in ("compress_ratio", "max_model_len", "window_size"):
                setattr(layer, key, getattr(module, key))
            for key in ("max_num_batched_tokens", "max_image_tokens", "topk_indices_buffer"):
                setattr(layer, key, getattr(module, key))
            workspace._manager = None
            workspace.init_workspace_manager(torch.device("cpu"))
            q = torch.zeros(1, 64, module.head_dim, dtype=torch.bfloat16)
            with set_forward_context(None, config):
                layer.forward_mqa(q, None, None, torch.zeros_like(q))  # type: ignore[arg-type]
            (buffer,) = workspace.current_workspace_manager()._current_workspaces
            reserved[name] = 0 if buffer is None else buffer.numel() * buffer.element_size()
        record["prefill_workspace_bytes"] = reserved
        record["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
    return record


def glm53(model_dir: str) -> dict[str, Any]:
    from transformers import AutoConfig
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.glm47_moe import _glm53_always_thinks
    from vllm.reasoning import ReasoningParserManager
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = get_tokenizer(model_dir)
    conversation = [{"role": "user", "content": "Why do sparse attention kernels need a top-k?"}]

    def prompt(**kwargs: Any) -> str:
        return safe_apply_chat_template(
            None,  # type: ignore[arg-type]  # read only when no chat template is given
            tokenizer,
            conversation,  # type: ignore[arg-type]
            chat_template=tokenizer.chat_template,
            tokenize=False,
            add_generation_prompt=True,
            **kwargs,
        )

    request = ChatCompletionRequest(model="tiny", messages=conversation)  # type: ignore[arg-type]
    parsed = {}
    for name, kwargs in (("thinking_off", {"thinking": False}), ("default", {})):
        parser = ReasoningParserManager.get_reasoning_parser("glm45")(
            tokenizer, chat_template_kwargs=kwargs
        )
        parsed[name] = parser.extract_reasoning("step one</think> the answer", request)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    tool_request = ChatCompletionRequest(
        model="tiny",
        messages=conversation,
        tools=[tool],  # type: ignore[arg-type, list-item]
    )
    tools = ToolParserManager.get_tool_parser("glm47")(tokenizer, tools=tool_request.tools)
    calls = tools.extract_tool_calls(
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        tool_request,
    )
    return {
        "config_class": type(config).__name__,
        "model_type": config.model_type,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "layer_types": config.layer_types,
        "linear": [config.linear_num_heads, config.linear_head_dim, config.linear_lower_bound],
        "extra": {key: getattr(config, key, None) for key in ("mhc", "mla_use_nope")},
        "tokenizer": type(tokenizer).__name__,
        "prompt_thinking_off": prompt(thinking=False),
        "prompt_effort_low": prompt(reasoning_effort="low"),
        "always_thinks": _glm53_always_thinks(tokenizer),
        "parsed": parsed,
        "tool_calls": [
            [call.function.name, json.loads(call.function.arguments)] for call in calls.tool_calls
        ],
    }


def main(argv: list[str]) -> int:
    verb, model_dir, *rest = argv
    verbs = {"build": build, "prefix-cache": prefix_cache, "memory": memory}
    result = verbs[verb](model_dir, rest) if verb in verbs else glm53(model_dir)
    print("CPU-CHECK " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
