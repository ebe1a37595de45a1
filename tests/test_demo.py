"""`make demo` as a user runs it, bounded: `python -m tests.demo` until an alert fires, then
Ctrl-C (SIGINT to its process group, as a terminal sends it), and every program it started is
gone.

Real programs on 127.0.0.1: vLLM's CPU stand-in, `mla-serve sidecar` with a patched vLLM 0.33.0
tree and its manifest, Debian's Prometheus with the chart's rendered rules, the `openai` client.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"^  (.+?)\s+(http://127\.0\.0\.1:\d+\S*)$")


def test_make_demo_fires_an_alert_and_stops_on_ctrl_c():
    if shutil.which("prometheus") is None:
        message = "no prometheus binary: .ci/run installs Debian's `prometheus` package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    demo = subprocess.Popen(
        [sys.executable, "-m", "tests.demo", "--timeout", "150"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: list[str] = []
    fired = threading.Event()

    def read() -> None:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line.rstrip("\n"))
            if "an alert fired" in line:
                fired.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert fired.wait(timeout=240), "\n".join(lines[-30:])
        urls = {m.group(1).strip(): m.group(2) for line in lines if (m := URL.match(line))}
        status = httpx.get(urls["status page"], headers={"accept": "text/html"}, timeout=10)
        assert status.status_code == 200 and "verified" in status.text
        metrics = httpx.get(urls["sidecar metrics"], timeout=10).text
        assert "mla_serve_runaway_completions_total{" in metrics and "_created" not in metrics
        alerts = httpx.get(urls["Prometheus alerts"].replace("/alerts", "/api/v1/alerts"))
        firing = {a["labels"]["alertname"] for a in alerts.json()["data"]["alerts"]
                  if a["state"] == "firing"}  # fmt: skip
        assert "MlaServeLengthCapRunaways" in firing or "MlaServeReasoningLoops" in firing
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        assert demo.wait(timeout=60) == 130
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=30)
    reader.join(timeout=10)
    text = "\n".join(lines)
    assert "a CPU stand-in for vLLM 0.33.0's OpenAI server, not vLLM" in text
    assert "manifest verified" in text
    assert re.search(r"alert MlaServeLengthCapRunaways is PENDING", text), text
    assert re.search(r"alert MlaServe\w+ is FIRING", text), text
    assert "`for: 10s`" in text  # the demo says it shortened the rules
    assert set(urls) >= {"OpenAI pass-through (what clients call)", "status page",
                         "sidecar metrics", "Prometheus alerts"}  # fmt: skip
    assert text.rstrip().endswith("stopped: the stand-in, the sidecar and Prometheus")
    for url in urls.values():  # every program it started is gone
        with pytest.raises(httpx.ConnectError):
            httpx.get(url, timeout=5)
    assert "Traceback" not in text
