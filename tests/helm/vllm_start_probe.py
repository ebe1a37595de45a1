"""Run inside a vLLM release tree (PYTHONPATH=<tree>:<repo>, VLLM_TARGET_DEVICE=cpu): take a
rendered `vllm serve` command line through vLLM's own start-up configuration path on the CPU,
for a declared target GPU.

stdin:  {"out": FILE, "third_party": DIR (holds vllm/third_party/ from the release's wheel),
         "platform": {"name", "capability": [major, minor], "memory_bytes"},
         "targets": {label: {"argv": [...], "model_dir": DIR, "kv_budget_bytes": int | null,
                             "plan_kv_tokens": int | null}}}
out:    (the file named by the request's "out") {label: {"stage": "ok" | "skipped" | "args" |
                 "config" | "pcp" | "kv", "error": str | null,
                 "facts": {...}, "not_checked": [str, ...]}}

What runs is vLLM's code, unchanged:
1. the serve parser and `AsyncEngineArgs.from_cli_args` (as `vllm serve`),
2. `create_engine_config()` -> `VllmConfig`: the model's `verify_and_update_config` hook
   (vllm/model_executor/models/config.py: GLM-5.2's KV dtype and DCP defaults), the
   parallel, scheduler, cache and compilation checks and the platform's
   `check_and_update_config`; for a sparse-indexer model, `dsa_indexer_uses_fp4`, which
   decides the indexer K-cache format from `attention_config.indexer_kv_dtype` and refuses
   mxfp4 off SM10x,
3. `PCPManager.validate_config` (vllm/v1/worker/gpu/pcp_manager.py), which the model runner
   calls when it builds its PCP manager on each GPU worker,
4. the engine core's KV-cache planning for one rank (`resolve_kv_cache_layout`,
   `get_global_kv_cache_groups`, `adjust_dcp_kv_cache_interleave_size`,
   `get_kv_cache_configs`, whose memory check raises vLLM's "To serve at least one request
   with the model's max seq len" error) on the per-rank budget from `mla-serve plan`. The
   layers' specs are built as the sparse-MLA layers build them: the attention backend from
   vLLM's selector (`get_attn_backend`) on the declared GPU, its KV dtype canonicalization,
   vLLM's spec classes with the layer's arguments (one MLA spec per layer, one indexer spec
   per layer that owns an indexer; which layers do comes from mla_serve.sizing's reading of
   the config, the same rule as vLLM 0.33.0's model code).

The target GPU is declared, not detected: `DeclaredGpu` is vLLM's CUDA platform class
with the device queries (name, compute capability, memory) answered from the request, so
every `current_platform` check in the configuration path sees the target. Four things
stand in for what a CPU lacks, each said where it is done: the compiled CUDA op library
(`vllm._C_stable_libtorch`, which vllm/platforms/cuda.py imports for its op registration;
no configuration step calls an op), Triton (present in vLLM's image; vLLM picks Model
Runner V2 only with it), the modules whose import branches on the platform to load CUDA
kernels (imported before the target is declared), and CUTLASS_MLA's module, which allocates
CUDA memory when imported (made unimportable: the selector records it unavailable, as it
would refuse a sparse model anyway).

Not built here, and said in the report: DeepSeek-V4's compressed-cache specs (its fit is
checked with `mla-serve plan`'s token count instead), and GLM-5.3-Flash's whole configuration
path (vLLM's model inspection imports torchvision, which has no CPU build for this torch).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

NOT_CHECKED = [
    "kernels: the selected attention backend is imported and validated for the declared "
    "compute capability, never run",
    "memory vLLM measures on the GPU (weights as loaded, activation peak, CUDA graph pool, "
    "NCCL buffers): the KV budget is mla-serve plan's estimate",
    "the kernel block size the backend may choose on the GPU (the check uses the "
    "configuration's block size; the difference is under one block per request)",
    "reasoning and tool-call parsers with the model's tokenizer (not shipped): checked by "
    "name in vLLM's parser registries",
    "CUTLASS_MLA (dense MLA, refused for sparse models): its module allocates a CUDA buffer "
    "at import, so the selector sees it as unavailable",
]


UNIMPORTABLE = ("vllm.v1.attention.backends.mla.cutlass_mla",)


def declare(platform: dict[str, Any], third_party: str) -> None:
    import vllm

    # vllm/third_party (pynvml, which vllm/platforms/cuda.py imports) is left out of the
    # Python-only test trees; it comes from the same wheel.
    vllm.__path__.append(str(Path(third_party) / "vllm"))
    # Stand-in: the compiled CUDA op library cannot load without a GPU driver; the
    # configuration path registers no op call.
    ops = types.ModuleType("vllm._C_stable_libtorch")
    ops.__doc__ = "CPU start check: stands for the compiled CUDA ops, which do not load here"
    sys.modules.setdefault("vllm._C_stable_libtorch", ops)
    # CUTLASS_MLA's module allocates a CUDA buffer when imported. It is a dense-MLA backend
    # (its validate_configuration refuses sparse models), tried before the sparse ones in
    # vLLM's SM100 order; None makes its import fail, and the selector records it unavailable.
    for name in UNIMPORTABLE:
        sys.modules[name] = None  # type: ignore[assignment]

    # Imported under the CPU platform: modules that import CUDA kernels at import time when
    # the platform is CUDA (attention utilities via the model loader).
    import vllm.model_executor.model_loader
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    major, minor = platform["capability"]

    class DeclaredGpu(CudaPlatformBase):
        """vLLM's CUDA platform for a declared GPU (CPU start check; no device is opened)."""

        declared = platform

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return str(platform["name"])

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return int(platform["memory_bytes"])

        @classmethod
        def is_fully_connected(cls, device_ids: list[int]) -> bool:
            return True  # one NVLink domain per node (B200 HGX, GB300 tray)

    platforms._current_platform = DeclaredGpu()  # type: ignore[attr-defined]
    # Triton ships in vLLM's CUDA image; vLLM 0.33.0 runs Model Runner V2 (the one with
    # PCP) only where it imports.
    import vllm.config.vllm as vllm_config_module

    vllm_config_module.HAS_TRITON = True  # type: ignore[attr-defined]


def kv_cache_specs(config: Any) -> dict[str, Any]:
    """One rank's KV-cache specs, as the sparse-MLA layers build them: vLLM's backend selector
    on the declared GPU, the backend's KV dtype canonicalization, the layers' spec classes."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

    from mla_serve.sizing import dsv4
    from mla_serve.sizing import shape as sizing_shape

    hf = config.model_config.hf_config.to_dict()
    if dsv4.is_dsv4(hf) or getattr(config.model_config.hf_text_config, "compress_ratios", None):
        raise NotImplementedError("DeepSeek-V4's compressed cache")
    shape = sizing_shape.from_config(hf, "probe")
    if shape.linear_layers:
        raise NotImplementedError("hybrid (linear-attention) layers")
    cache = config.cache_config
    head_size = shape.kv_lora_rank + shape.qk_rope_head_dim
    with set_current_vllm_config(config):
        backend = get_attn_backend(
            head_size,
            config.model_config.dtype,
            cache.cache_dtype,
            use_mla=True,
            use_sparse=True,
            num_heads=shape.num_attention_heads // config.parallel_config.tensor_parallel_size,
        )
    kv_dtype = _canonicalize_sparse_mla_kv_cache_dtype(backend, cache.cache_dtype)
    specs: dict[str, Any] = {}
    for layer in shape.mla_layers:
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=head_size,
            dtype=kv_cache_dtype_str_to_dtype(kv_dtype, config.model_config),
            cache_dtype_str=kv_dtype,
            kv_quant_mode=get_kv_quant_mode(kv_dtype),
            state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_dtype),
            is_index_group_leader=layer in shape.indexer_layers,
        )
    for layer in sorted(shape.indexer_layers):
        specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=shape.index_head_dim + shape.index_head_dim // 128 * 4,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
    return {"specs": specs, "backends": [backend, DeepseekV32IndexerBackend], "kv_dtype": kv_dtype}


def check(target: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    facts: dict[str, Any] = {}
    not_checked = list(NOT_CHECKED)
    result: dict[str, Any] = {"stage": "args", "error": None, "facts": facts}
    result["not_checked"] = not_checked
    try:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(target["argv"])
        validate_parsed_serve_args(args)
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        facts["reasoning_parser"] = args.reasoning_parser
        facts["tool_call_parser"] = args.tool_call_parser
        # By name in vLLM's registries (importing a parser needs its own dependencies).
        reasoning = ReasoningParserManager.list_registered()
        if args.reasoning_parser and args.reasoning_parser not in reasoning:
            raise KeyError(f"Reasoning parser '{args.reasoning_parser}' not found")
        tools = set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)
        if args.tool_call_parser and args.tool_call_parser not in tools:
            raise KeyError(f"Tool parser '{args.tool_call_parser}' not found.")
        # The reasoning config reads token ids from the tokenizer, which is not shipped.
        args.reasoning_parser = None
        args.model = target["model_dir"]
        config_json = json.loads((Path(target["model_dir"]) / "config.json").read_text())
        glm5next = any(a.startswith("Glm5Next") for a in config_json.get("architectures", []))
        if glm5next and importlib.util.find_spec("torchvision") is None:
            # vllm/models/glm5next imports transformers' GLM-4V image processor, which
            # imports torchvision; there is no CPU build of it for this torch here.
            result["stage"] = "skipped"
            result["error"] = (
                "vLLM's configuration path not run: inspecting "
                f"{config_json['architectures'][0]} imports torchvision (not installed)"
            )
            return result
        engine = AsyncEngineArgs.from_cli_args(args)
        result["stage"] = "config"
        config = engine.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        parallel = config.parallel_config
        facts.update(
            dcp_comm_backend=parallel.dcp_comm_backend,
            cache_dtype=config.cache_config.cache_dtype,
            max_model_len=config.model_config.max_model_len,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            cudagraph_mode=config.compilation_config.cudagraph_mode.name,
            use_v2_model_runner=config.use_v2_model_runner,
            indexer_kv_dtype=config.attention_config.indexer_kv_dtype,
        )
        if getattr(config.model_config.hf_text_config, "index_topk", None):
            # The sparse indexer's K-cache format, decided by vLLM's own check on the declared
            # GPU (mxfp4 only on SM10x); DeepSeek-V4's indexer builds its cache from it.
            import vllm.platforms as platforms
            from vllm.v1.attention.backends.mla import indexer

            # The module was imported under the CPU platform (with the model loader, before
            # the target was declared) and bound it then; it reads the declared one here.
            indexer.current_platform = platforms.current_platform  # type: ignore[attr-defined]
            facts["indexer_cache"] = "mxfp4" if indexer.dsa_indexer_uses_fp4(config) else "fp8"
        result["stage"] = "pcp"
        if parallel.prefill_context_parallel_size > 1:
            from vllm.v1.worker.gpu.pcp_manager import PCPManager

            PCPManager.validate_config(config, supports_mm_inputs=False)
        result["stage"] = "kv"
        budget = target.get("kv_budget_bytes")
        if budget is None:
            not_checked.append("vLLM's KV-cache check: mla-serve plan gives no budget here")
        else:
            try:
                built = kv_cache_specs(config)
            except NotImplementedError as missing:
                not_checked.append(
                    f"vLLM's KV-cache check: the probe does not build specs for {missing}; "
                    "mla-serve plan's token count is checked against max_model_len instead"
                )
                tokens = int(target["plan_kv_tokens"])
                facts["plan_kv_tokens"] = tokens
                if tokens < config.model_config.max_model_len:
                    raise ValueError(
                        f"mla-serve plan: {tokens} KV tokens per rank, fewer than "
                        f"max_model_len {config.model_config.max_model_len}"
                    ) from None
            else:
                from vllm.v1.attention.backends.utils import (
                    get_supported_kv_cache_layouts,
                    resolve_kv_cache_layout,
                )
                from vllm.v1.core.kv_cache_planning import (
                    get_global_kv_cache_groups,
                    get_kv_cache_configs,
                )

                facts["attention_backend"] = built["backends"][0].get_name()
                facts["kv_cache_dtype"] = built["kv_dtype"]
                specs = [built["specs"]]
                layouts = get_supported_kv_cache_layouts(built["backends"])
                resolve_kv_cache_layout(
                    config, [[layout.name for layout in layouts]], built["specs"].values()
                )
                groups = get_global_kv_cache_groups(config, specs)
                config.adjust_dcp_kv_cache_interleave_size(groups)
                (kv_config,) = get_kv_cache_configs(config, specs, [int(budget)], groups)
                facts["kv_num_blocks"] = kv_config.num_blocks
                facts["kv_block_size"] = config.cache_config.block_size
        result["stage"] = "ok"
    except BaseException as error:  # argparse exits with SystemExit
        result["error"] = f"{type(error).__name__}: {error}"
        frames = traceback.extract_tb(error.__traceback__)
        result["where"] = [
            f"{f.filename.rsplit('/vllm/', 1)[-1]}:{f.lineno}"
            for f in frames
            if "importlib" not in f.filename
        ][-8:]
    return result


def main() -> None:
    request = json.load(sys.stdin)
    declare(request["platform"], request["third_party"])
    report = {label: check(target) for label, target in request["targets"].items()}
    Path(request["out"]).write_text(json.dumps(report))  # vLLM logs to stdout


if __name__ == "__main__":
    main()
