"""The probe of fix piecewise-topk-event (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import (
    called_name,
    calls,
    find_function,
    parse_module,
    with_parents,
)
from mla_serve.patching.tree import VllmTree

INDEX_GROUP = "vllm/v1/attention/backends/mla/index_group.py"
HISPARSE_RUNTIME = "vllm/v1/hisparse/runtime.py"
FORWARD_CONTEXT = "vllm/forward_context.py"


@probe("piecewise-topk-event")
def _piecewise_topk_event(tree: VllmTree) -> ProbeResult:
    """No eager wait on the graph-local `logical_topk_ready` event in piecewise mode."""
    modules = {rel: parse_module(tree, rel) for rel in (INDEX_GROUP, HISPARSE_RUNTIME)}
    users = {
        rel: module
        for rel, module in modules.items()
        if module is not None and any(_is_topk_event(n) for n in ast.walk(module))
    }
    if not users:
        return ProbeResult(True, "no logical_topk_ready event in this release (code absent)")
    forward_context = parse_module(tree, FORWARD_CONTEXT)
    if forward_context is None or find_function(forward_context, "in_piecewise_cudagraph") is None:
        return ProbeResult(False, f"{FORWARD_CONTEXT} has no in_piecewise_cudagraph()")
    for rel, module in users.items():
        for node, parents in with_parents(module):
            if not isinstance(node, ast.Call):
                continue
            name = called_name(node)
            waits = name == "wait_event" and node.args and _is_topk_event(node.args[0])
            if waits and not _guarded_by_not_piecewise(node, parents):
                return ProbeResult(
                    False,
                    f"{rel}:{node.lineno} waits on logical_topk_ready without a "
                    "`not in_piecewise_cudagraph()` guard",
                )
            owner = node.func.value if isinstance(node.func, ast.Attribute) else None
            if name == "record" and owner is not None and _is_topk_event(owner):
                function = next(
                    (p for p in reversed(parents) if isinstance(p, ast.FunctionDef)), None
                )
                checks = calls(function, "in_piecewise_cudagraph") if function else []
                if not any(c.lineno < node.lineno for c in checks):
                    return ProbeResult(
                        False,
                        f"{rel}:{node.lineno} records logical_topk_ready without "
                        "checking in_piecewise_cudagraph() first",
                    )
    return ProbeResult(True, "every logical_topk_ready record/wait is skipped in piecewise mode")


def _is_topk_event(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "logical_topk_ready"


def _guarded_by_not_piecewise(call: ast.Call, parents: list[ast.AST]) -> bool:
    """Inside the body of an `if` whose test says `not in_piecewise_cudagraph()`."""
    chain = [*parents, call]
    for depth, parent in enumerate(parents):
        if not isinstance(parent, ast.If) or chain[depth + 1] not in parent.body:
            continue
        for node in ast.walk(parent.test):
            if (
                isinstance(node, ast.UnaryOp)
                and isinstance(node.op, ast.Not)
                and calls(node.operand, "in_piecewise_cudagraph")
            ):
                return True
    return False
