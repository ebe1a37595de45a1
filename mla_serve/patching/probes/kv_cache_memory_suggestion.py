"""The probe of fix kv-cache-memory-suggestion (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import find_function, parse_module
from mla_serve.patching.tree import VllmTree

GPU_WORKER = "vllm/v1/worker/gpu_worker.py"
PROFILE = "Worker.determine_available_memory"
SUGGESTION = ("Worker._compile_or_warm_up_model", "Worker.compile_or_warm_up_model")


@probe("kv-cache-memory-suggestion")
def _kv_cache_memory_suggestion(tree: VllmTree) -> ProbeResult:
    """The memory the --kv-cache-memory suggestion leaves to everything but the KV cache
    (`non_kv_cache_memory`) counts CUDA graph memory exactly once: either the captured
    graph pool or the estimate, never both (also not through `peak_activation_memory`)."""
    module = parse_module(tree, GPU_WORKER)
    if module is None:
        return ProbeResult(True, "no GPU worker (code absent)")
    terms = None
    for qualified in SUGGESTION:
        function = find_function(module, qualified)
        terms = _non_kv_terms(function) if function else None
        if terms is not None:
            break
    if terms is None:
        return ProbeResult(True, "no --kv-cache-memory suggestion in this release (code absent)")
    profile = find_function(module, PROFILE)
    peak = _peak_activation(profile) if profile else None
    graph = []
    for term in terms:
        if _graph_memory(term):
            graph.append(ast.unparse(term))
        elif ast.unparse(term) == "self.peak_activation_memory" and peak and _graph_memory(peak):
            graph.append(f"self.peak_activation_memory (= {ast.unparse(peak)})")
    if len(graph) != 1:
        counted = " and ".join(graph) or "nothing"
        return ProbeResult(
            False,
            f"{GPU_WORKER}: the --kv-cache-memory suggestion counts CUDA graph memory "
            f"{len(graph)} times: {counted}",
        )
    return ProbeResult(True, f"the suggestion counts CUDA graph memory once ({graph[0]})")


def _non_kv_terms(function: ast.FunctionDef) -> list[ast.expr] | None:
    """The summands of `non_kv_cache_memory = a + b + …` in the function, or None."""
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "non_kv_cache_memory"
        ):
            return _summands(node.value)
    return None


def _peak_activation(function: ast.FunctionDef) -> ast.expr | None:
    """What `self.peak_activation_memory = …` stores in the profiling step."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "peak_activation_memory"
            for t in node.targets
        ):
            return node.value
    return None


def _summands(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _summands(node.left) + _summands(node.right)
    return [node]


def _graph_memory(node: ast.AST) -> bool:
    """Whether an expression reads a CUDA graph memory figure (estimate or captured pool)."""
    words = [
        n.id if isinstance(n, ast.Name) else n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Name | ast.Attribute)
    ]
    return any("cudagraph" in w or "cuda_graph" in w for w in words)
