"""What each engine rank really runs, and where each figure came from.

Sources, best first: the engine plugin's per-rank state files ("plugin"), then
vLLM's own log lines ("log"); both give `contract.RankRecord`s. The predicted
workspace comes from the sizing model ("sizing model"), fed with the rank's heads,
DCP size and batch cap. A figure no source gives stays `None`, with its source
`None`. Which figures there are is `contract.FIGURES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mla_serve.engine import contract, state, vllm_log
from mla_serve.engine.contract import FigureName, RankRecord
from mla_serve.sizing.workspace import workspace_bytes

FLASHINFER_SPARSE = "FLASHINFER_MLA_SPARSE"


@dataclass(frozen=True)
class Rank:
    record: RankRecord
    origin: str  # where the record came from: "plugin" or "log"
    derived: dict[str, object] = field(default_factory=dict)  # contract.DERIVED figures

    @property
    def rank(self) -> int:
        return self.record.rank

    def value(self, name: FigureName) -> object:
        if name in contract.DERIVED:
            return self.derived.get(name)
        return getattr(self.record, name)

    def source(self, name: FigureName) -> str | None:
        if self.value(name) is None:
            return None
        return contract.DERIVED.get(name, self.origin)


@dataclass(frozen=True)
class Engine:
    ranks: list[Rank]
    refused: list[state.Refused]  # rank files that broke the contract, with the reason


def read(state_dir: Path | None, log: vllm_log.LogFile | None) -> Engine:
    """Every rank's figures; no ranks when neither source has anything yet.

    The log's figures are those of its last `refresh` (done in the background, off the
    event loop): reading them here costs no I/O."""
    refused: list[state.Refused] = []
    if state_dir is not None and state_dir.is_dir():
        reading = state.read_all(state_dir)
        refused = reading.refused
        if reading.records:
            return Engine([_rank(record, "plugin") for record in reading.records], refused)
    if log is not None:
        return Engine([_rank(record, "log") for record in log.figures], refused)
    return Engine([], refused)


def _rank(record: RankRecord, origin: str) -> Rank:
    return Rank(record, origin, {"sparse_mla_workspace_bytes_predicted": _predicted(record)})


def _predicted(record: RankRecord) -> int | None:
    """The sizing model's workspace for ranks that run FlashInfer sparse MLA."""
    backends = record.attention_backends or ()
    heads = record.num_attention_heads_per_rank
    tokens = record.max_num_batched_tokens
    dcp = 1 if record.parallel is None else record.parallel.dcp
    if FLASHINFER_SPARSE not in backends or heads is None or tokens is None:
        return None
    return workspace_bytes(dcp, heads, tokens)
