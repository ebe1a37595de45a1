"""The probe of fix dsv4-indexer-capture-shortcut (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import calls, find_function, parse_module
from mla_serve.patching.tree import VllmTree

DSV4_ATTENTION = "vllm/models/deepseek_v4/attention.py"


@probe("dsv4-indexer-capture-shortcut")
def _dsv4_indexer_capture_shortcut(tree: VllmTree) -> ProbeResult:
    """The short-context shortcut is never taken while a CUDA graph is being captured."""
    module = parse_module(tree, DSV4_ATTENTION)
    forward = find_function(module, "DeepseekV4Indexer.forward") if module else None
    if module is None or forward is None:
        return ProbeResult(True, "no DeepseekV4Indexer in this release (code absent)")
    for node in ast.walk(forward):
        if not isinstance(node, ast.If):
            continue
        attributes = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
        if {"compress_ratio", "topk_tokens"} <= attributes:
            if calls(node.test, "is_current_stream_capturing"):
                return ProbeResult(True, "shortcut skipped during stream capture")
            sites = _indexer_call_sites(module)
            if sites and all(sites.values()):
                return ProbeResult(
                    False,
                    f"{DSV4_ATTENTION}:{node.lineno} shortcut not skipped during capture, but "
                    f"the indexer is called only inside @eager_break_during_capture regions "
                    f"({', '.join(sorted(sites))}), which breakable capture runs eagerly",
                    unreachable=True,
                )
            return ProbeResult(
                False, f"{DSV4_ATTENTION}:{node.lineno} shortcut can be baked into a graph"
            )
    return ProbeResult(False, "DeepseekV4Indexer.forward has no recognizable shortcut condition")


def _indexer_call_sites(module: ast.Module) -> dict[str, bool]:
    """Each function that calls `….indexer(…)`, and whether it is decorated with
    `eager_break_during_capture` (bare, qualified or called)."""
    sites: dict[str, bool] = {}
    for function in ast.walk(module):
        if not isinstance(function, ast.FunctionDef) or not calls(function, "indexer"):
            continue
        names = set()
        for decorator in function.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            names.add(getattr(target, "id", getattr(target, "attr", None)))
        sites[function.name] = "eager_break_during_capture" in names
    return sites
