"""dcp-rank-device-tensor on the live engine: no host sync while localizing decode seq_lens.

DCP stacks run with vLLM's own GPU<->CPU sync check in warn mode
(VLLM_GPU_SYNC_CHECK=warn, tests/e2e/matrix.py): once warmup is over, every
synchronizing CUDA operation inside a step is logged as `FILE:LINE: UserWarning:
called a synchronizing CUDA operation`. Without the fix, `get_dcp_local_seq_lens`
turns the DCP rank into a new device tensor on every decode metadata build: a
host-to-device copy, logged at a line inside that function.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.report import sync_warnings


def localizers(tree: Path) -> list[tuple[str, int, int]]:
    """(file under the tree, first line, last line) of each get_dcp_local_seq_lens in it."""
    spans = []
    for path in sorted((tree / "vllm").rglob("*.py")):
        text = path.read_text(errors="replace")
        if "def get_dcp_local_seq_lens" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == "get_dcp_local_seq_lens":
                spans.append((str(path.relative_to(tree)), node.lineno, node.end_lineno or 0))
    return spans


def test_dcp_decode_localization_does_not_sync(
    live: dict[str, Any], keep: Callable[[str, Any], None]
) -> None:
    if int(live["layout"]["parallel"]["dcp"]) < 2:
        pytest.skip("no decode context parallelism in this layout")
    assert live["env"].get("VLLM_GPU_SYNC_CHECK") == "warn"
    tree = Path(live["vllm_tree"])
    spans = localizers(tree)
    assert spans, "the tree has get_dcp_local_seq_lens"
    syncs = sync_warnings(Path(live["vllm_log"]), str(tree))
    keep("gpu_sync_warnings.json", {"localizers": spans, "syncs": syncs})
    # The check is live: vLLM's own DCP prefill metadata reads a device total with .item().
    assert syncs, "vLLM's sync check logged nothing: is it on?"
    inside = {
        where: count
        for where, count in syncs.items()
        for file, first, last in spans
        if where.rsplit(":", 1)[0] == file and first <= int(where.rsplit(":", 1)[1]) <= last
    }
    assert not inside, f"get_dcp_local_seq_lens synchronized with the host: {inside}"
