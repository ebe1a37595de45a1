"""The results table of record: one row per stack under a results directory (summary.json).

python -m tests.e2e.results_table results/e2e/h200x2   # from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def layout_text(layout: dict[str, Any]) -> str:
    parallel = layout["parallel"]
    parts = [
        f"{axis.upper()}{parallel[axis]}" for axis in ("tp", "pcp", "dcp") if parallel[axis] > 1
    ]
    text = " x ".join(parts) or "TP1"
    # Layouts from before the per-profile tiny models all served the tiny DeepSeek-V3.2.
    return f"{text}, tiny {layout['model']}" if "model" in layout else text


def row(summary: dict[str, Any]) -> str:
    stack = summary["stack"]
    counts = summary["tests"].get("counts", {})
    syncs = summary.get("gpu_sync_warnings") or {}
    notes = []
    if "deep_gemm" in (stack.get("notes") or {}):
        notes.append("DeepGEMM test stand-in")
    if syncs:
        notes.append("host syncs: " + ", ".join(f"{k} x{v}" for k, v in list(syncs.items())[:3]))
    served = summary["verdict"].startswith("served")
    failed = sorted(
        name.rsplit("::", 1)[1]
        for name, case in summary["tests"].get("cases", {}).items()
        if case["outcome"] == "failed"
    )
    if served:
        outcome = "served"
    elif summary["startup"]["outcome"] in ("ready", "serving"):
        outcome = f"{summary['startup']['outcome']}; failed: {', '.join(failed)}"
    else:
        outcome = f"did not start: {summary.get('first_error_in_vllm_log')}"
    return (
        f"| {stack['release']} | `{stack['layout']['profile']}` → {layout_text(stack['layout'])} "
        f"| {stack['state']} | {len(summary['engine'])} | {outcome} "
        f"| {counts.get('passed', 0)}/{counts.get('failed', 0)}/{counts.get('skipped', 0)} "
        f"| {'; '.join(notes)} |"
    )


def main() -> int:
    root = Path(sys.argv[1])
    header = ("release", "profile → layout on H200s", "state", "ranks", "outcome",
              "tests passed/failed/skipped", "notes")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(root.glob("*/summary.json")):
        print(row(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
