"""The per-rank engine state file: written by the plugin, read by the sidecar.

One JSON file per engine rank, `rank-<global rank>.json` in the state directory
shared by the vLLM and sidecar containers. Files are replaced atomically, so a
reader never sees a half-written one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = 1
STATE_DIR_ENV = "MLA_SERVE_STATE_DIR"


def path_for(state_dir: Path, rank: int) -> Path:
    return state_dir / f"rank-{rank}.json"


def write(state_dir: Path, state: dict[str, Any]) -> Path:
    """Atomically replace this rank's state file."""
    state_dir.mkdir(parents=True, exist_ok=True)
    target = path_for(state_dir, int(state["rank"]))
    descriptor, temporary = tempfile.mkstemp(dir=state_dir, prefix=".rank-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump({"schema": SCHEMA, **state}, handle, indent=2, sort_keys=True)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def read_all(state_dir: Path) -> list[dict[str, Any]]:
    """Every readable rank file, ordered by rank; unreadable or foreign files are skipped."""
    states = []
    for path in sorted(state_dir.glob("rank-*.json")):
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("schema") == SCHEMA and "rank" in state:
            states.append(state)
    return sorted(states, key=lambda s: int(s["rank"]))
