"""vLLM's own code against a tiny model directory, on the CPU; prints one JSON record.

    python -m tests.e2e.cpu_check build MODEL_DIR [SERVE_ARGS ...]
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

`glm53`: GLM-5.3's model module imports GLM-4V's image processor, which needs a
torchvision build the CPU torch here has not, so vLLM's model registry cannot inspect
the architecture on this machine and no config of vLLM's is built. What runs without
it: transformers' strict config classes, vLLM's tokenizer loading, its chat-template
path (kwargs filtered as vLLM filters them), the `glm45` reasoning parser and the
`glm47` tool parser.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any


def build(model_dir: str, serve_args: list[str]) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.argparse_utils import FlexibleArgumentParser

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
        try:
            with torch.device("meta"):
                model = model_class(vllm_config=config)
        except NotImplementedError as refused:  # vLLM's CPU platform declines the layer
            return record | {"refused": str(refused)}
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
    result = build(model_dir, rest) if verb == "build" else glm53(model_dir)
    print("CPU-CHECK " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
