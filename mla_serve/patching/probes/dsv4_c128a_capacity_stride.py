"""The probe of fix dsv4-c128a-capacity-stride (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import called_name, calls, find_function, parse_module
from mla_serve.patching.tree import VllmTree

DSV4_SPARSE_MLA = "vllm/models/deepseek_v4/sparse_mla.py"


@probe("dsv4-c128a-capacity-stride")
def _dsv4_c128a_capacity_stride(tree: VllmTree) -> ProbeResult:
    """C128A metadata rows keep the buffers' capacity stride that graphs were captured with."""
    module = parse_module(tree, DSV4_SPARSE_MLA)
    function = find_function(module, "build_c128a_topk_metadata") if module else None
    if module is None or function is None:
        return ProbeResult(True, "no C128A metadata builder in this release (code absent)")
    packed = [c for c in calls(function, "view") if _is_minus_one(c)]
    if packed:
        return ProbeResult(False, f"{DSV4_SPARSE_MLA}:{packed[0].lineno} packs rows with view(-1)")
    strides = _c128a_kernel_row_strides(module)
    if not strides:
        return ProbeResult(False, "no launch of the C128A metadata kernel found")
    for stride in strides:
        if not (
            isinstance(stride, ast.Call)
            and called_name(stride) == "stride"
            and [getattr(a, "value", None) for a in stride.args] == [0]
        ):
            return ProbeResult(
                False, f"{DSV4_SPARSE_MLA}:{stride.lineno} kernel rows not at a buffer's stride(0)"
            )
    return ProbeResult(True, "rows written and read at the buffers' capacity stride")


def _c128a_kernel_row_strides(module: ast.Module) -> list[ast.expr]:
    """The row strides the C128A metadata kernel is launched with, by keyword or position."""
    strides: list[ast.expr] = []
    for call in (n for n in ast.walk(module) if isinstance(n, ast.Call)):
        strides += [
            k.value
            for k in call.keywords
            if k.arg in ("global_decode_stride", "prefill_local_stride")
        ]
        func = call.func
        if (
            isinstance(func, ast.Subscript)
            and isinstance(func.value, ast.Name)
            and func.value.id == "_build_c128a_topk_metadata_kernel"
            and len(call.args) >= 5
        ):
            strides += [call.args[1], call.args[4]]  # (…, decode stride, …, …, prefill stride)
    return strides


def _is_minus_one(call: ast.Call) -> bool:
    return (
        len(call.args) == 1
        and isinstance(call.args[0], ast.UnaryOp)
        and isinstance(call.args[0].op, ast.USub)
        and getattr(call.args[0].operand, "value", None) == 1
    )
