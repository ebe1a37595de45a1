"""The fallback when the engine plugin is absent: figures from vLLM's startup log.

vLLM logs the configured CUDA graph mode when the engine starts, each downgrade
the backends force ("…; setting cudagraph_mode=PIECEWISE", "Overriding to …"),
and "Graph capturing finished in N secs, took X GiB" per worker. The last word
on the mode wins. Rank comes from the worker prefix vLLM puts on each line
("(Worker_TP1 pid=…)"); lines without one count for rank 0.
"""

from __future__ import annotations

import re
from typing import Any

_CONFIG_MODE = re.compile(r"['\"]cudagraph_mode['\"]: <?(?:CUDAGraphMode\.)?([A-Z_]+)")
_CONFIG_SIZES = re.compile(r"['\"]cudagraph_capture_sizes['\"]: \[([0-9, ]*)\]")
_SETTING = re.compile(r"setting cudagraph_mode=([A-Z_]+)")
_OVERRIDE = re.compile(r"Overriding to (?:CUDAGraphMode\.)?([A-Z_]+)")
_EAGER = "Cudagraph is disabled under eager mode"
_CAPTURED = re.compile(r"Graph capturing finished in ([0-9.]+) secs, took ([0-9.]+) GiB")
_WORKER = re.compile(r"\(\w*?Worker\w*?_(?:TP|PP|DP|EP|PCP|DCP)?(\d+)")


def parse(text: str) -> list[dict[str, Any]]:
    """Per-rank figures found in a vLLM log, in the engine plugin's state shape."""
    mode: str | None = None
    sizes: list[int] = []
    ranks: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        if (found := _CONFIG_MODE.search(line)) is not None:
            mode = found.group(1)
        if (found := _CONFIG_SIZES.search(line)) is not None:
            sizes = [int(s) for s in found.group(1).replace(" ", "").split(",") if s]
        for pattern in (_SETTING, _OVERRIDE):
            if (found := pattern.search(line)) is not None:
                mode = found.group(1)
        if _EAGER in line:
            mode = "NONE"
        if (found := _CAPTURED.search(line)) is not None:
            worker = _WORKER.search(line)
            rank = int(worker.group(1)) if worker else 0
            ranks[rank] = {
                "capture_seconds": float(found.group(1)),
                "capture_bytes": int(float(found.group(2)) * (1 << 30)),
            }
    if mode is None and not ranks:
        return []
    return [
        {"rank": rank, "cudagraph_mode": mode, "cudagraph_capture_sizes": sizes, **figures}
        for rank, figures in sorted((ranks or {0: {}}).items())
    ]
