"""dsv4-zero-query-prefill-chunk with the real FlashMLA sparse prefill kernel (one H200).

Each case runs in a child process (tests/gpu/dsv4_prefill.py): the kernel aborts the
process on an empty query, which would take this pytest down with it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FIX = "dsv4-zero-query-prefill-chunk"
ROOT = Path(__file__).resolve().parents[2]


def run_case(name: str) -> tuple[int, str]:
    """Exit status and output of `python -m tests.gpu.dsv4_prefill NAME` on this tree."""
    import vllm

    tree = str(Path(vllm.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, "-m", "tests.gpu.dsv4_prefill", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = child.stdout + child.stderr
    if child.returncode == 3 and "NO KERNEL" in output:
        pytest.skip(next(line for line in output.splitlines() if "NO KERNEL" in line))
    return child.returncode, output


def launches(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"^launch rows=(\d+)$", output, re.MULTILINE)]


def test_the_sparse_prefill_kernel_cannot_take_an_empty_query(expect, record_property):
    """The control: what any prefill that launches an empty chunk runs into (vLLM issue
    51486's `phase1.cuh:614` abort on SM90)."""
    expect.fixed(FIX)
    code, output = run_case("kernel-empty-query")
    record_property("child_exit", code)
    record_property("child_output_tail", output[-2000:])
    assert launches(output) == [0], output
    assert code != 0 and "returned" not in output, output


def test_dsv4_prefill_with_a_request_without_query_tokens(expect, record_property):
    fixed = expect.fixed(FIX)
    code, output = run_case("forward-prefill")
    record_property("child_exit", code)
    record_property("child_output_tail", output[-2000:])
    if not fixed:  # the plan's second chunk holds only the request without query tokens
        assert launches(output) == [16, 0], output
        assert code != 0 and "returned" not in output, output
        return
    assert code == 0, output
    assert launches(output) == [16], output  # every query row, in one launch
    assert "output rows=16 zero=True" in output, output
