"""What each engine rank really runs, and where each figure came from.

Sources, best first: the engine plugin's per-rank state files ("plugin"), then
vLLM's own log lines ("log"). The predicted workspace comes from the sizing
model ("sizing model"), fed with the rank's heads, DCP size and batch cap.
A figure no source gives stays `None`, with its source `None`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_serve.plugin import state
from mla_serve.sidecar import vllm_log
from mla_serve.sizing.workspace import workspace_bytes

FLASHINFER_SPARSE = "FLASHINFER_MLA_SPARSE"
FIGURES = (
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "capture_seconds",
    "capture_bytes",
    "attention_backends",
    "sparse_mla_workspace_bytes",
    "attention_workspace_bytes",
    "parallel",
    "phase",
    "manifest",
)


@dataclass(frozen=True)
class Rank:
    rank: int
    values: dict[str, Any]
    sources: dict[str, str | None]
    predicted_workspace_bytes: int | None

    def get(self, figure: str) -> Any:
        return self.values.get(figure)


def read(state_dir: Path | None, log: vllm_log.LogFile | None) -> list[Rank]:
    """Every rank's figures; empty when neither source has anything yet.

    The log's figures are those of its last `refresh` (done in the background, off the
    event loop): reading them here costs no I/O."""
    if state_dir is not None and state_dir.is_dir():
        ranks = state.read_all(state_dir)
        if ranks:
            return [_rank(raw, "plugin") for raw in ranks]
    if log is not None:
        return [_rank(raw, "log") for raw in log.figures]
    return []


def _rank(raw: dict[str, Any], source: str) -> Rank:
    values = {figure: raw.get(figure) for figure in FIGURES}
    sources = {figure: (source if values[figure] is not None else None) for figure in FIGURES}
    predicted = _predicted_workspace(raw)
    return Rank(int(raw["rank"]), values, sources, predicted)


def _predicted_workspace(raw: dict[str, Any]) -> int | None:
    """The sizing model's figure for ranks that run FlashInfer sparse MLA."""
    backends = raw.get("attention_backends") or []
    heads = raw.get("num_attention_heads_per_rank")
    tokens = raw.get("max_num_batched_tokens")
    dcp = (raw.get("parallel") or {}).get("dcp", 1)
    if FLASHINFER_SPARSE not in backends or heads is None or tokens is None:
        return None
    return workspace_bytes(int(dcp), int(heads), int(tokens))
