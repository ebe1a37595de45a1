"""pytest plugin (`-p upstream_report`) for the upstream suite: writes each test's outcome,
each file's collection result, and why a test failed or a file failed or skipped (the end
of pytest's report) to $MLA_SERVE_UPSTREAM_REPORT as JSON, so that tests/upstream.py reads
them without parsing pytest's text. Upstream's test files run with `--noconftest`, so this
is the only plugin of ours in that pytest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_TESTS: dict[str, str] = {}
_COLLECT: dict[str, str] = {}
_WHY: dict[str, str] = {}  # the end of pytest's report, to read without a rerun on the GPU
WHY_CHARS = 4000


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.nodeid and "::" not in report.nodeid:
        _COLLECT[report.nodeid] = report.outcome  # passed, failed, or skipped (module level)
        if not report.passed:
            _WHY[report.nodeid] = report.longreprtext[-WHY_CHARS:]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    previous = _TESTS.get(report.nodeid)
    if report.failed:
        _TESTS[report.nodeid] = "failed"
        _WHY.setdefault(report.nodeid, f"{report.when}: {report.longreprtext[-WHY_CHARS:]}")
    elif report.skipped and previous != "failed":
        _TESTS[report.nodeid] = "skipped"
    elif report.when == "call" and previous is None:
        _TESTS[report.nodeid] = "passed"


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = os.environ.get("MLA_SERVE_UPSTREAM_REPORT")
    if target:
        recorded = {"tests": _TESTS, "collect": _COLLECT, "why": _WHY}
        Path(target).write_text(json.dumps(recorded, indent=1))
