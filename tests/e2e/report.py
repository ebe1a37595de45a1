"""Write summary.json for one end-to-end stack: what ran, on what, and how it went.

Reads the stack's files (stack.json, timeline.json, logs), the /status the tests
kept and pytest's JUnit XML; copies the logs beside them (tests/e2e/matrix.py).
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
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
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
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

    return {
        "vllm_health_200_s": first("health"),
        "sidecar_readyz_200_s": first("readyz"),
        "polls": len(timeline),
    }


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


ERROR = re.compile(r"(?:\b\w*(?:Error|Exception)\b:.*|GPU<->CPU sync detected.*)")


def first_error(log: Path) -> str | None:
    """vLLM's own words for a failure: the first error line of its log, if any."""
    if not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        found = ERROR.search(line)
        if found and " WARNING " not in line and "DeprecationWarning" not in line:
            return found.group(0)[:400]
    return None


SYNC = re.compile(r"(\S+\.py):(\d+): UserWarning: called a synchronizing CUDA operation")


def sync_warnings(log: Path, tree: str) -> dict[str, int]:
    """vLLM's GPU<->CPU sync check (warn mode): how often each file:line synchronized."""
    counts: dict[str, int] = {}
    if log.is_file():
        for found in SYNC.finditer(log.read_text(errors="replace")):
            where = f"{found[1].removeprefix(tree.rstrip('/') + '/')}:{found[2]}"
            counts[where] = counts.get(where, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def write(work: Path, results: Path, stack: dict[str, Any]) -> dict[str, Any]:
    """One stack's summary.json (and logs beside it); its line for matrix.json."""
    results.mkdir(parents=True, exist_ok=True)
    for name in ("vllm.log", "sidecar.log", "timeline.json", "stack.json"):
        if (work / name).is_file():
            shutil.copyfile(work / name, results / name)
    timeline = _json(work / "timeline.json") or []
    status = _json(results / "status.json") or {}
    ranks = status.get("engine", {}).get("ranks", [])
    outcome = tests(results / "junit.xml")
    counts = outcome.get("counts", {})
    up = stack.get("startup") in ("ready", "serving")
    served = up and counts.get("failed", 1) == 0 and counts.get("passed", 0) > 0
    error = first_error(work / "vllm.log")
    verdict = (
        f"served: {counts.get('passed')} passed, 0 failed"
        if served
        else f"failed ({stack.get('startup')}; tests {counts or 'not run'}): {error}"
    )
    summary = {
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "stack": {
            key: stack.get(key)
            for key in (
                "name",
                "release",
                "state",
                "gpus",
                "layout",
                "serve_argv",
                "env",
                "python_paths",
                "notes",
                "expect",
            )
        },
        "model": _json(Path(str(stack.get("model_dir", ""))) / "config.json"),
        "startup": {"outcome": stack.get("startup", "the stack did not start")} | startup(timeline),
        "engine": [
            {name: figure["value"] for name, figure in rank["figures"].items()} for rank in ranks
        ],
        "fixes": status.get("fixes"),
        "after_kill": _json(results / "shutdown.json"),
        "first_error_in_vllm_log": error,
        "gpu_sync_warnings": sync_warnings(work / "vllm.log", str(stack.get("vllm_tree", ""))),
        "tests": outcome,
        "verdict": verdict,
    }
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    expected = stack.get("expect", "serves")
    return {
        "verdict": verdict,
        "expect": expected,
        "as_expected": served if expected == "serves" else not served,
        "ranks": len(ranks),
        "tests": counts,
    }
