"""Readers follow the public upstream references (vllm#56825, #50791, #55879, #52492, #51318,
issue #52448): no file of the README, the sidecar, the engine, sizing, the chart or the tests
cites an upstream pull-request digest by the project's internal number ("seed 002")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The patch catalog's own tests name its `seeds` field; they are the catalog's business.
AREAS = ("README.md", "mla_serve/sidecar", "mla_serve/engine", "mla_serve/sizing", "helm",
         "tests", "docker", "results")  # fmt: skip
LEFT_TO_THE_CATALOG = {"tests/test_catalog.py", "tests/test_references.py"}
# "seed 002", "seeds 003/004", "seed-002", "the seed's", "the seeds'", "shared/seeds"
INTERNAL = re.compile(r"\bseeds?[- ]0\d\d|\bseeds'|\bseed's\b|shared/seeds", re.IGNORECASE)


def _files() -> list[Path]:
    found = []
    for area in AREAS:
        path = ROOT / area
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [
            p for p in files
            if p.suffix in (".py", ".md", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".json")
            and str(p.relative_to(ROOT)) not in LEFT_TO_THE_CATALOG
            and not p.name.startswith("test_patch")
        ]  # fmt: skip
    return found


def test_no_internal_seed_numbers():
    cited = {}
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if INTERNAL.search(line):
                cited[f"{path.relative_to(ROOT)}:{number}"] = line.strip()[:100]
    assert cited == {}
