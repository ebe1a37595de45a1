"""The probe of fix dcp-empty-shard-mask (patches/catalog.toml)."""

from __future__ import annotations

import ast

from mla_serve.patching.probes import ProbeResult, probe
from mla_serve.patching.probes.syntax import called_name, calls, find_function, parse_module
from mla_serve.patching.tree import VllmTree

DCP_OPS = ("vllm/v1/attention/ops/dcp.py", "vllm/v1/attention/ops/common.py")


@probe("dcp-empty-shard-mask")
def _dcp_empty_shard_mask(tree: VllmTree) -> ProbeResult:
    """A DCP rank with no local sequences masks every row instead of indexing seq_lens[-1]."""
    for rel in DCP_OPS:
        module = parse_module(tree, rel)
        function = find_function(module, "mask_dcp_empty_shards_") if module else None
        if function is None:
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.If)
                and _tests_empty(node.test, "seq_lens")
                and any(isinstance(s, ast.Return) for s in node.body)
                and calls(node, "fill_")
            ):
                return ProbeResult(True, f"{rel}: empty seq_lens fills -inf and returns")
        return ProbeResult(False, f"{rel}: mask_dcp_empty_shards_ indexes an empty seq_lens")
    return ProbeResult(True, "no mask_dcp_empty_shards_ in this release (code absent)")


def _tests_empty(test: ast.expr, name: str) -> bool:
    """`name.shape[0] == 0`, `name.numel() == 0` or `not name.numel()`."""
    mentions = any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(test))
    zero = any(
        isinstance(n, ast.Compare)
        and any(isinstance(c, ast.Constant) and c.value == 0 for c in n.comparators)
        for n in ast.walk(test)
    ) or (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not))
    sized = any(
        (isinstance(n, ast.Attribute) and n.attr == "shape")
        or (isinstance(n, ast.Call) and called_name(n) in ("numel", "size"))
        for n in ast.walk(test)
    )
    return mentions and zero and sized
