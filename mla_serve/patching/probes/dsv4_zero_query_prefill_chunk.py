"""The probe of fix dsv4-zero-query-prefill-chunk (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import called_name, find_function, parse_module
from mla_serve.patching.tree import VllmTree

SPARSE_SWA = "vllm/v1/attention/backends/mla/sparse_swa.py"
PLANNER = "DeepseekSparseSWAMetadata.get_prefill_chunk_plan"
# The DeepSeek-V4 prefills that launch a sparse kernel per chunk, and that kernel.
PREFILLS = (
    (
        "vllm/models/deepseek_v4/nvidia/flashmla.py",
        "DeepseekV4FlashMLAAttention._forward_prefill",
        "flash_mla_sparse_fwd",
    ),
    (
        "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py",
        "DeepseekV4FlashInferSM120Attention._forward_prefill",
        "flashinfer_trtllm_batch_decode_sparse_mla_dsv4",
    ),
)


@probe("dsv4-zero-query-prefill-chunk")
def _dsv4_zero_query_prefill_chunk(tree: VllmTree) -> ProbeResult:
    """No prefill chunk without query tokens reaches a sparse prefill kernel: the planner
    never opens a chunk at a request without query tokens, and each prefill skips a chunk
    whose query range is empty before it launches the kernel."""
    module = parse_module(tree, SPARSE_SWA)
    planner = find_function(module, PLANNER) if module else None
    if planner is None:
        return ProbeResult(True, "no DeepSeek-V4 prefill chunk planner (code absent)")
    if not _skips_requests_without_queries(planner):
        return ProbeResult(
            False,
            f"{SPARSE_SWA}:{planner.lineno} get_prefill_chunk_plan may open a chunk at a "
            "request without query tokens",
        )
    for path, qualified, kernel in PREFILLS:
        source = parse_module(tree, path)
        prefill = find_function(source, qualified) if source else None
        if prefill is None:
            continue  # this release has no such prefill
        problem = _unguarded_launch(prefill, kernel)
        if problem:
            return ProbeResult(False, f"{path}: {qualified} {problem}")
    return ProbeResult(
        True, "the planner skips requests without query tokens; empty chunks never launch"
    )


def _skips_requests_without_queries(planner: ast.FunctionDef) -> bool:
    """Inside the planner's loop over chunk starts, a test of a query length against zero
    that moves the chunk start on (`continue` or `chunk_start += …`)."""
    for loop in (n for n in ast.walk(planner) if isinstance(n, ast.While)):
        if not _mentions(loop.test, "chunk_start"):
            continue
        for node in ast.walk(loop):
            if (
                isinstance(node, ast.If | ast.While)
                and _zero_query_test(node.test)
                and any(_advances(statement) for statement in node.body)
            ):
                return True
    return False


def _zero_query_test(test: ast.expr) -> bool:
    """`<…query_len…>[…] == 0` (or `<= 0`, `< 1`, `not …`)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _names_query_lengths(test.operand)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    left, right, op = test.left, test.comparators[0], test.ops[0]
    zero = isinstance(right, ast.Constant) and right.value == 0
    one = isinstance(right, ast.Constant) and right.value == 1
    return _names_query_lengths(left) and (
        (zero and isinstance(op, ast.Eq | ast.LtE)) or (one and isinstance(op, ast.Lt))
    )


def _names_query_lengths(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and "query_len" in n.attr)
        or (isinstance(n, ast.Name) and "query_len" in n.id)
        for n in ast.walk(node)
    )


def _advances(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Continue):
        return True
    return (
        isinstance(statement, ast.AugAssign)
        and isinstance(statement.target, ast.Name)
        and statement.target.id == "chunk_start"
    )


def _unguarded_launch(prefill: ast.FunctionDef, kernel: str) -> str | None:
    """Why the prefill may launch `kernel` on a chunk without query tokens, or None."""
    launches = [
        n for n in ast.walk(prefill) if isinstance(n, ast.Call) and called_name(n) == kernel
    ]
    if not launches:
        return f"launches no {kernel} (cannot judge)"
    for assertion in (n for n in ast.walk(prefill) if isinstance(n, ast.Assert)):
        if isinstance(assertion.test, ast.Name) and assertion.test.id == "chunk_plan":
            return f"asserts a non-empty chunk plan (line {assertion.lineno})"
    for loop in (n for n in ast.walk(prefill) if isinstance(n, ast.For)):
        inside = [c for c in launches if any(c is n for n in ast.walk(loop))]
        if not inside:
            continue
        guards = [
            n.lineno
            for n in ast.walk(loop)
            if isinstance(n, ast.If)
            and _empty_range_test(n.test)
            and any(isinstance(s, ast.Continue) for s in n.body)
        ]
        if not guards or min(guards) > min(c.lineno for c in inside):
            return f"launches {kernel} (line {inside[0].lineno}) without skipping an empty chunk"
    return None


def _empty_range_test(test: ast.expr) -> bool:
    """`query_end <= query_start`, `query_start >= query_end`, or `==` of the two."""
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    left, right, op = test.left, test.comparators[0], test.ops[0]
    names = (getattr(left, "id", None), getattr(right, "id", None))
    if names == ("query_end", "query_start"):
        return isinstance(op, ast.LtE | ast.Eq)
    if names == ("query_start", "query_end"):
        return isinstance(op, ast.GtE | ast.Eq)
    return False


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))
