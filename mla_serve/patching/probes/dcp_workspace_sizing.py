"""The probe of fix dcp-workspace-sizing (patches/catalog.toml)."""

from __future__ import annotations

import ast
from collections.abc import Callable

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import FLASHINFER_SPARSE, calls, find_function, parse_module
from mla_serve.patching.tree import VllmTree

# The figures reported in vllm#50781 (fixed by vllm#55879, which carries #50791's sizing): 64
# heads per rank, DCP 4, vLLM's 394 MiB default workspace.
REPORTED_WORKSPACE = {4096: 2_561_671_168, 32768: 17_594_056_704}
DEFAULT_WORKSPACE_BYTES = 394 * 1024 * 1024


@probe("dcp-workspace-sizing")
def _dcp_workspace_sizing(tree: VllmTree) -> ProbeResult:
    """The sparse-MLA workspace grows with DCP; vllm#50781's figures come out byte-exact."""
    module = parse_module(tree, FLASHINFER_SPARSE)
    if module is None:
        return ProbeResult(True, "no FlashInfer sparse MLA backend in this release (code absent)")
    function = find_function(module, "compute_trtllm_sparse_mla_workspace_bytes")
    if function is None:
        return ProbeResult(False, "no compute_trtllm_sparse_mla_workspace_bytes(): fixed 394 MiB")
    compute = _isolate(module, function)
    for tokens, expected in REPORTED_WORKSPACE.items():
        got = compute(DEFAULT_WORKSPACE_BYTES, 4, 64, tokens)
        if got != expected:
            return ProbeResult(False, f"DCP4/64 heads/{tokens} tokens gives {got}, not {expected}")
    if compute(DEFAULT_WORKSPACE_BYTES, 1, 64, 32768) != DEFAULT_WORKSPACE_BYTES:
        return ProbeResult(False, "workspace changes without DCP")
    buffer = find_function(module, "_get_workspace_buffer")
    if buffer is None or len(buffer.args.args) < 2:
        return ProbeResult(False, "_get_workspace_buffer() cannot be asked for a minimum size")
    preallocates = any(
        isinstance(node, ast.FunctionDef)
        and node.name == "__init__"
        and calls(node, "_get_workspace_buffer")
        for node in ast.walk(module)
    )
    if not preallocates:
        return ProbeResult(False, "no metadata builder sizes the workspace before capture")
    return ProbeResult(
        True, "DCP-aware size, byte-exact on vllm#50781's figures; preallocated in the builder"
    )


def _isolate(module: ast.Module, function: ast.FunctionDef) -> Callable[..., int]:
    """Run one pure-arithmetic function of a module with its literal constants only."""
    namespace: dict[str, object] = {}
    for node in module.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            if names <= set(namespace):
                statement = ast.Module(body=[node], type_ignores=[])
                exec(compile(statement, "<probe>", "exec"), namespace)  # noqa: S102
    definition = ast.Module(body=[function], type_ignores=[])
    exec(compile(ast.fix_missing_locations(definition), "<probe>", "exec"), namespace)  # noqa: S102
    return namespace[function.name]  # type: ignore[return-value]
