"""Summarize a GPU suite run into one JSON file (RESULTS/summary.json).

python -m tests.gpu.report RESULTS   # from the repository root (tests/gpu/run.sh)
"""

from __future__ import annotations

import json
import platform
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "triton"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def cases(junit: Path) -> list[dict[str, str]]:
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                detail = (child.get("message") or "")[:300]
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "detail": detail})  # fmt: skip
    return rows


def main(results: Path) -> int:
    import torch

    runs = {}
    for junit in sorted((results / "runs").glob("junit-*.xml")):
        key = junit.stem.removeprefix("junit-")
        bench = results / "runs" / f"bench-{key}.json"
        upstream = results / "runs" / f"upstream-{key}.json"
        runs[key] = {
            "cases": cases(junit),
            "upstream": json.loads(upstream.read_text())["cases"] if upstream.is_file() else None,
            "bench": json.loads(bench.read_text()) if bench.is_file() else None,
        }
    summary = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": versions(),
        "runs": runs,
    }
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [c["test"] for run in runs.values() for c in run["cases"] if c["outcome"] == "failed"]
    wrong = [
        f"{key}: {c['test']} {c['outcome']} (expected to {c['expect']})"
        for key, run in runs.items()
        for c in run["upstream"] or []
        if not c["ok"]
    ]
    missing_bench = [key for key, run in runs.items() if run["bench"] is None]
    print(f"{len(runs)} tree runs; {len(failed)} failed case(s); {len(wrong)} upstream test(s)"
          f" not as the catalog says; bench missing for {missing_bench or 'none'}")  # fmt: skip
    for line in wrong:
        print("  " + line)
    failed += wrong + missing_bench
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
