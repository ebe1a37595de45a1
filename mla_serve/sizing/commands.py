"""`mla-serve plan`: per-rank memory plan for a sparse-MLA model on a GPU layout."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mla_serve.sizing import backend, dsv4, planning, quant, report, shape

ERRORS: tuple[type[Exception], ...] = (shape.SizingError,)

# Model configs shipped with mla-serve (models/README.md says where each comes from), so a
# profile's plan works from an installed package: `--model GLM-5.2`.
MODELS_DIR = Path(__file__).resolve().parent / "models"


def shipped_models() -> tuple[str, ...]:
    return tuple(sorted(p.parent.name for p in MODELS_DIR.glob("*/config.json")))


def model_config(name: str) -> Path:
    """The shipped config.json of `name` (one of `shipped_models()`)."""
    return MODELS_DIR / name / "config.json"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sub = commands.add_parser(
        "plan",
        help="per-rank memory plan: sparse-MLA workspace, weights, KV budget and tokens",
        description=(
            "Size a sparse-MLA model (DeepSeek-V3.2, GLM-5.x) on a vLLM layout, per GPU rank: "
            "the FlashInfer sparse-MLA workspace (byte-exact with vLLM), the weights, the KV "
            "cache bytes per token and how many tokens fit."
        ),
    )
    source = sub.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the model's Hugging Face config.json",
    )
    source.add_argument(
        "--model",
        choices=shipped_models(),
        help="a model config shipped with mla-serve instead of --config: "
        + ", ".join(shipped_models()),
    )
    sub.add_argument(
        "--gpu-memory-gib",
        type=_number,
        required=True,
        metavar="GIB",
        help="device memory per GPU as vLLM sees it (a B200: 179.06, i.e. 183,359 MiB)",
    )
    for flag, text in (
        ("--tp", "tensor parallel size"),
        ("--pcp", "prefill context parallel size"),
        ("--dcp", "decode context parallel size"),
        ("--dp", "data parallel size"),
        ("--ep", "expert parallel size: 1, or TP x PCP x DP (--enable-expert-parallel)"),
    ):
        sub.add_argument(flag, type=_positive, default=1, metavar="N", help=f"{text} (default 1)")
    sub.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        metavar="N",
        help="scheduler token budget (default: vLLM's for the GPU size: "
        "16384 from 160 GiB, 8192 from 70 GiB, else 2048)",
    )
    sub.add_argument(
        "--kv-cache-dtype",
        choices=backend.KV_CACHE_DTYPES,
        default="auto",
        help="KV cache dtype (default auto: the model dtype, or the checkpoint's KV scheme)",
    )
    sub.add_argument(
        "--indexer-kv-dtype",
        choices=("auto", "fp8", "mxfp4"),
        default="auto",
        help="vLLM's attention_config.indexer_kv_dtype (default auto: fp8); DeepSeek-V4's "
        "indexer K cache takes mxfp4 on SM10x (68 B a state instead of 132)",
    )
    sub.add_argument(
        "--max-model-len",
        type=_positive,
        metavar="N",
        help="--max-model-len (default: the model's max_position_embeddings); sizes "
        "DeepSeek-V4's FlashMLA prefill workspace",
    )
    sub.add_argument(
        "--attention-backend",
        choices=backend.BACKENDS,
        help="force a sparse-MLA backend (default: what vLLM 0.33.0 picks on "
        "SM100; FLASHMLA_SPARSE when PCP and DCP are both on)",
    )
    sub.add_argument(
        "--gpu-memory-utilization",
        type=_number,
        default=planning.DEFAULT_UTILIZATION,
        metavar="U",
        help=f"vLLM's fraction of device memory (default {planning.DEFAULT_UTILIZATION}, vLLM's)",
    )
    sub.add_argument(
        "--reserve-gib",
        type=_number,
        metavar="GIB",
        default=planning.DEFAULT_RESERVE_BYTES / planning.GiB,
        help="activation peak + CUDA graph pool + NCCL/cuBLAS buffers "
        f"(default {planning.DEFAULT_RESERVE_BYTES / planning.GiB:g})",
    )
    sub.add_argument(
        "--workspace-override-bytes",
        type=int,
        metavar="B",
        help="VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE: replaces the computed workspace size",
    )
    sub.add_argument(
        "--weight-dtype",
        choices=tuple(quant.OVERRIDES),
        help="bytes per parameter of every linear layer, instead of the "
        "checkpoint's quantization_config",
    )
    sub.add_argument(
        "--expert-dtype",
        choices=tuple(quant.OVERRIDES),
        help="the routed experts' format (e.g. nvfp4 for an expert-only NVFP4 checkpoint)",
    )
    sub.add_argument(
        "--weights-gib",
        type=_number,
        metavar="GIB",
        help="weights per rank, measured, instead of the estimate",
    )
    sub.add_argument(
        "--mtp", action="store_true", help="count the MTP (next-n) layers: weights and KV cache"
    )
    sub.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text for people (default), or one JSON document (per_rank, layout, warnings, "
        "details)",
    )
    sub.set_defaults(run=run)


def layout_from_args(args: argparse.Namespace) -> planning.Layout:
    weights = None if args.weights_gib is None else int(args.weights_gib * planning.GiB)
    if args.gpu_memory_gib <= 0:
        raise shape.SizingError("--gpu-memory-gib must be positive")
    if args.reserve_gib < 0:
        raise shape.SizingError("--reserve-gib must not be negative")
    return planning.Layout(
        gpu_memory_bytes=int(args.gpu_memory_gib * planning.GiB),
        tp=args.tp,
        pcp=args.pcp,
        dcp=args.dcp,
        dp=args.dp,
        ep=args.ep,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        gpu_memory_utilization=args.gpu_memory_utilization,
        reserve_bytes=int(args.reserve_gib * planning.GiB),
        workspace_override_bytes=args.workspace_override_bytes,
        weight_dtype=args.weight_dtype,
        expert_dtype=args.expert_dtype,
        weights_bytes=weights,
        mtp=args.mtp,
        max_model_len=args.max_model_len,
        indexer_kv_dtype=args.indexer_kv_dtype,
    )


def run(args: argparse.Namespace) -> int:
    config, name = shape.load(args.config if args.model is None else model_config(args.model))
    layout = layout_from_args(args)
    result: planning.Plan | dsv4.Plan
    if dsv4.is_dsv4(config):
        result = planning.plan_dsv4(config, layout, name=name)
    else:
        result = planning.plan(config, layout, name=name)
    refusal = planning.shortfall(result, layout)
    if refusal:
        raise shape.SizingError(refusal)
    if args.format == "json":
        print(json.dumps(result.to_json(), indent=2))
    elif isinstance(result, dsv4.Plan):
        print(result.text())
    else:
        print(report.text(result))
    return 0
