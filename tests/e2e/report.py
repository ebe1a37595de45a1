"""Write summary.json for an end-to-end run: what ran, on what, and how it went.

Reads the stack's files (stack.json, timeline.json, logs), the /status the tests
kept, the pack's pack.json and pytest's JUnit XML; copies the logs beside them.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def versions() -> dict[str, Any]:
    found: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "vllm"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:
            found[name] = f"unavailable: {error}"
    try:
        import torch

        found["gpu"] = torch.cuda.get_device_name(0)
        found["cuda"] = torch.version.cuda
    except Exception as error:
        found["gpu"] = f"unavailable: {error}"
    try:
        found["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as error:
        found["driver"] = f"unavailable: {error}"
    return found


def tests(junit: Path) -> dict[str, Any]:
    if not junit.is_file():
        return {"error": "no JUnit XML: pytest did not run"}
    cases = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (found.get("message") or "").splitlines()[0:1]
        cases[f"{case.get('classname')}::{case.get('name')}"] = {
            "outcome": outcome,
            "seconds": float(case.get("time") or 0),
        } | ({"message": message[0]} if message else {})
    counts = {
        o: sum(c["outcome"] == o for c in cases.values()) for o in ("passed", "failed", "skipped")
    }
    return {"counts": counts, "cases": cases}


def startup(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    def first(key: str) -> float | None:
        return next((sample["t"] for sample in timeline if sample[key] == 200), None)

    return {"vllm_health_200_s": first("health"), "sidecar_readyz_200_s": first("readyz"),
            "polls": len(timeline)}  # fmt: skip


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--pack", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args()
    results = args.results
    stack = _json(args.work / "stack.json") or {}
    timeline = _json(args.work / "timeline.json") or []
    for name in ("vllm.log", "sidecar.log", "timeline.json"):
        if (args.work / name).is_file():
            shutil.copyfile(args.work / name, results / name)
    status = _json(results / "status.json") or {}
    ranks = status.get("engine", {}).get("ranks", [])
    summary = {
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "pack": json.loads((args.pack / "pack.json").read_text()),
        "model": json.loads((args.pack / "model" / "config.json").read_text()),
        "serve_flags": stack.get("serve_flags"),
        "startup": {"outcome": stack.get("startup", "the stack did not start")} | startup(timeline),
        "engine": [
            {name: figure["value"] for name, figure in rank["figures"].items()} for rank in ranks
        ],
        "fixes": status.get("fixes"),
        "after_kill": _json(results / "shutdown.json"),
        "tests": tests(results / "junit.xml"),
    }
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"startup": summary["startup"], "tests": summary["tests"].get("counts")}))
    return 0 if summary["tests"].get("counts", {}).get("failed", 1) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
