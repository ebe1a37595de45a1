"""Run inside a vLLM release tree (PYTHONPATH=<tree>, VLLM_TARGET_DEVICE=cpu): parse the chart's
rendered `vllm serve` arguments with vLLM's own parser and check layouts with its ParallelConfig.

stdin:  {"argvs": {label: [args after `vllm serve`]}, "layouts": [[tp, pcp, dcp], ...]}
stdout: {"parsed": {label: {field: value} | {"error": str}}, "layouts": [null | error, ...]}
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore")

from vllm.config import ParallelConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.common.cli_args import (  # noqa: E402
    make_arg_parser,
    validate_parsed_serve_args,
)
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

FIELDS = (
    "model",
    "served_model_name",
    "tensor_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_batched_tokens",
    "max_cudagraph_capture_size",
    "kv_cache_dtype",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
)


def parse(argv: list[str]) -> dict[str, Any]:
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag  # as `vllm serve MODEL` does
    engine = AsyncEngineArgs.from_cli_args(args)
    out = {name: getattr(engine, name) for name in FIELDS}
    out["served_model_name"] = list(engine.served_model_name or [])
    out["attention_backend"] = getattr(engine.attention_backend, "name", engine.attention_backend)
    out["cudagraph_mode"] = getattr(engine.compilation_config.cudagraph_mode, "name", None)
    out["enforce_eager"] = engine.enforce_eager
    for name in ("headless", "host", "port", "reasoning_parser", "tool_call_parser"):
        out[name] = getattr(args, name, None)
    out["enable_auto_tool_choice"] = args.enable_auto_tool_choice
    return out


def main() -> None:
    request = json.load(sys.stdin)
    parsed: dict[str, Any] = {}
    for label, argv in request["argvs"].items():
        try:
            parsed[label] = parse(argv)
        except BaseException as error:  # argparse exits with SystemExit
            parsed[label] = {"error": f"{type(error).__name__}: {error}"}
    layouts: list[str | None] = []
    for tp, pcp, dcp in request["layouts"]:
        try:
            ParallelConfig(
                tensor_parallel_size=tp,
                prefill_context_parallel_size=pcp,
                decode_context_parallel_size=dcp,
            )
            layouts.append(None)
        except Exception as error:
            layouts.append(str(error).splitlines()[1] if "\n" in str(error) else str(error))
    json.dump({"parsed": parsed, "layouts": layouts}, sys.stdout)


if __name__ == "__main__":
    main()
