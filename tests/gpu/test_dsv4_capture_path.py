"""vllm#52492 on vLLM 0.27.1's own capture path: FULL, PIECEWISE (breakable) and eager.

Each mode runs in its own process (tests/gpu/dsv4_capture.py), because vLLM decides at
import whether `@eager_break_during_capture` breaks the capture (VLLM_USE_BREAKABLE_CUDAGRAPH,
which vLLM turns on for DeepSeek-V4). A replayed step with an 8000-token cached prefix must
select the scored candidates; the first topk candidates mean the short-context shortcut
was baked into the graph. Expected from 0.27.1's code (catalog, dsv4-indexer-capture-shortcut):
no mode bakes it, pristine or patched. FULL-SHORT (a FULL graph captured on short metadata,
what vllm#52492 fixed) is the control: it must show the bug, so the harness can tell. The run
of record (results/gpu/h200) bears this out: every mode scored, the control selected the first
candidates, on the pristine and the patched tree alike (0.27.1 carries no backport of the fix:
the catalog's verdict).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "dsv4_capture.py"


def _run(mode: str, tree: str) -> dict:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    env["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    child = subprocess.run(
        [sys.executable, str(SCRIPT), mode],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert child.returncode == 0 and lines, child.stdout[-3000:] + child.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture
def tree(expect, pytestconfig) -> str:
    if expect.release != "0.27.1":
        pytest.skip("0.27.1's capture path; later releases carry the fix upstream")
    return str(Path(pytestconfig.getoption("--vllm-tree")).resolve())


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE", "NONE"])
def test_indexer_on_vllms_capture_path_selects_scored_candidates(tree, mode):
    result = _run(mode, tree)
    print(json.dumps(result))
    assert result["breakable"] is True
    if mode == "FULL":
        assert result["capture_max_seq_len"] == 16384  # the runner's max_model_len
    if mode == "PIECEWISE":  # two graph segments around the eager attention_impl
        assert (result["captured"], result["graphs"], result["eager_breaks"]) == (True, 2, 1)
    assert result["selects"] == "scored", result


def test_control_full_graph_on_short_metadata_shows_the_bug(tree):
    """No backport on 0.27.1 (the catalog's verdict, from this file's runs on an H200,
    results/gpu/h200): the control shows the shortcut on both trees."""
    result = _run("FULL-SHORT", tree)
    print(json.dumps(result))
    assert result["selects"] == "first-topk", result
