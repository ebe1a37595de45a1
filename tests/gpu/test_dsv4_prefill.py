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


def test_sparse_prefill_ignores_index_entries_past_topk_length(expect, record_property):
    """vllm#55299's question for the kernel (`dsv4-prefill-index-seed`): do the entries of an
    unseeded index workspace past a row's `topk_length` (which vLLM's DeepSeek-V4 prefill
    passes) reach the output? Measured on SM90 (one H200): no. -1 (what the fix seeds), a
    stale index into NaN rows of the KV and one past the KV all leave the output finite, and
    no launch faults. The control names the same NaN row inside the length: a NaN row that
    is read does reach the output, so the finite cases are not a kernel that masks NaN."""
    expect.fixed("dsv4-prefill-index-seed")  # skips where the release has no such workspace
    code, output = run_case("kernel-stale-indices")
    record_property("child_exit", code)
    record_property("child_output_tail", output[-2000:])
    assert code == 0, output
    assert "returned control-in-length finite=False" in output, output
    assert "returned seeded finite=True" in output, output
    if "capability sm90" not in output:
        # SM100's kernel was not measured: the seeded case is the fix's contract there
        return
    assert "returned stale-in-kv finite=True" in output, output
    assert "returned stale-past-kv finite=True" in output, output
