"""kv-cache-memory-suggestion on a real engine start (vLLM issue 57936), pristine and patched.

    python -m tests.e2e.kv_suggestion --store DIR --release 0.33.0 --out FILE   # repo root

On the GPU machine, after `tests/e2e/run.sh unpack` laid out the store: for each state, a
copy of the release's tree (patched by `mla-serve patches apply`, or left pristine) starts
vLLM's engine on the tiny DeepSeek-V3.2 (`common/model-deepseek-v3.2`, dummy weights) with
CUDA graphs and vLLM's memory profiling (no --kv-cache-memory-bytes), on one GPU, one state
after the other (profiling is device-wide). vLLM logs its graph memory estimate, the
captured pool, and its `--kv-cache-memory` suggestion; the suggestion's gap to the KV cache
vLLM allocated in the same run shows whether the estimate is counted twice (pristine: the
suggestion sits about the estimate below what this run uses) or once (patched: off by the
estimate's own error and vLLM's 150 MiB buffer). Writes FILE (JSON: each state's figures and
log lines, the verdict); exit 1 when patched still counts the graph memory twice or a start
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mla_serve.patching import catalog
from tests.e2e.matrix import ROOT, prepare, site_paths
from tests.e2e.model import DEEPSEEK_V32

GiB = 1 << 30
BUFFER_GIB = 150 / 1024  # vLLM's redundancy buffer in the suggestion
START = """
import sys
from vllm import LLM
LLM(model=sys.argv[1], load_format="dummy", max_model_len=4096, max_num_seqs=16,
    gpu_memory_utilization=float(sys.argv[2]))
print("ENGINE STARTED", flush=True)
"""
PATTERNS = {
    "graph_actual_gib": r"CUDA graph pool memory: ([\d.]+) GiB \(actual\)",
    "graph_estimated_gib": r"GiB \(actual\), ([\d.]+) GiB \(estimated\)",
    "peak_activation_gib": r"([\d.]+) GiB for peak activation",
    "suggestion_bytes": r"--kv-cache-memory=(-?\d+)` \([-\d.]+ GiB\) to fit into requested",
    "kv_cache_in_use_gib": r"Current kv cache memory in use is ([\d.]+) GiB",
}


def start(tree: Path, paths: list[str], model: Path, utilization: float) -> dict[str, Any]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree), *paths]),
        HF_HUB_OFFLINE="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
    )
    child = subprocess.run(
        [sys.executable, "-c", START, str(model), str(utilization)],
        cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True, timeout=1200,
        check=False,
    )  # fmt: skip
    log = child.stdout + child.stderr
    figures: dict[str, Any] = {"rc": child.returncode, "started": "ENGINE STARTED" in log}
    for name, pattern in PATTERNS.items():
        match = re.search(pattern, log)
        figures[name] = (
            None if match is None else (int if name.endswith("bytes") else float)(match[1])
        )
    figures["log_lines"] = [
        line[-600:]
        for line in log.splitlines()
        if "kv-cache-memory=" in line
        or "CUDA graph pool memory" in line
        or "Available KV cache memory" in line
    ]
    if not figures["started"]:
        figures["log_tail"] = log[-4000:]
    return figures


def gap(figures: dict[str, Any]) -> float | None:
    """The suggestion less the KV cache this run allocated, in GiB."""
    if figures["suggestion_bytes"] is None or figures["kv_cache_in_use_gib"] is None:
        return None
    return round(figures["suggestion_bytes"] / GiB - figures["kv_cache_in_use_gib"], 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--release", default=catalog.load().default, help="default: %(default)s")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = args.store / "common" / DEEPSEEK_V32.directory()
    paths = site_paths(args.store, args.release)
    states: dict[str, Any] = {}
    for state in ("pristine", "patched"):
        work = Path(tempfile.mkdtemp(prefix=f"kv-suggestion-{state}-"))
        try:
            tree, notes = prepare(args.store, work, args.release, state)
            states[state] = {**notes, **start(tree, paths, model, args.gpu_memory_utilization)}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        states[state]["suggestion_minus_kv_in_use_gib"] = gap(states[state])
        print(state, json.dumps({k: v for k, v in states[state].items() if k != "log_lines"}))
    pristine, patched = states["pristine"], states["patched"]
    estimate, actual = patched["graph_estimated_gib"], patched["graph_actual_gib"]
    ok = bool(
        pristine["started"] and patched["started"] and None not in (estimate, actual)
        and gap(patched) is not None and gap(pristine) is not None
        # once: off by the estimate's error and the buffer (log figures are to 0.01 GiB)
        and abs(gap(patched) - (estimate - actual - BUFFER_GIB)) <= 0.03
    )  # fmt: skip
    verdict = {
        "counted_once_patched": ok,
        "pristine_short_by_gib": (
            None if not ok else round(gap(patched) - gap(pristine), 3)  # about the estimate
        ),
        "graph_estimated_gib": estimate,
    }
    document = {"release": args.release, "repository": str(ROOT), "states": states, **verdict}
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(verdict))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
