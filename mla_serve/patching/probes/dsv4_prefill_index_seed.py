"""The probe of fix dsv4-prefill-index-seed (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import find_function, parse_module
from mla_serve.patching.tree import VllmTree

# The DeepSeek-V4 model packages whose FlashMLA prefill hands combine_topk_swa_indices a
# reused workspace (`out=`): V4 (every release), V4.1 (from 0.30.0).
COMBINES = (
    "vllm/models/deepseek_v4/common/ops/cache_utils.py",
    "vllm/models/deepseek_v41/common/ops/cache_utils.py",
)
FUNCTION = "combine_topk_swa_indices"


@probe("dsv4-prefill-index-seed")
def _dsv4_prefill_index_seed(tree: VllmTree) -> ProbeResult:
    """Where combine_topk_swa_indices writes into a caller's workspace, it first fills the
    indices with -1, so no row keeps an earlier chunk's entries past its valid ones."""
    seen = []
    for path in COMBINES:
        module = parse_module(tree, path)
        function = find_function(module, FUNCTION) if module else None
        if function is None:
            continue
        if "out" not in {a.arg for a in (*function.args.args, *function.args.kwonlyargs)}:
            seen.append(f"{path} (allocates its own)")
            continue
        problem = _unseeded(function)
        if problem:
            return ProbeResult(False, f"{path}:{function.lineno} {FUNCTION} {problem}")
        seen.append(path)
    if not seen:
        return ProbeResult(True, f"no {FUNCTION} (code absent)")
    return ProbeResult(True, "the reused index workspace is seeded with -1: " + ", ".join(seen))


def _unseeded(function: ast.FunctionDef) -> str | None:
    """Why the indices taken from `out` may reach the kernel unseeded, or None."""
    names = {
        target.elts[0].id
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name)
        and node.value.id == "out"
        for target in node.targets
        if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)
    }
    if not names:
        return "takes `out` but never unpacks its indices (cannot judge)"
    launches = [
        n.lineno
        for n in ast.walk(function)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id.isupper()
    ]
    seeds = [
        n.lineno
        for n in ast.walk(function)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "fill_"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id in names
        and n.args
        and _is_minus_one(n.args[0])
    ]
    if not seeds:
        return "launches its kernel on the caller's workspace without filling it with -1"
    if launches and min(seeds) > min(launches):
        return f"fills the workspace with -1 only after its kernel (line {min(launches)})"
    return None


def _is_minus_one(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value == -1
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and node.operand.value == 1
    )
