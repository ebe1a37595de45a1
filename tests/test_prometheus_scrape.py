"""A real Prometheus (Debian's package) scrapes the sidecar and queries a series back."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mla_serve.engine import state
from mla_serve.sidecar.settings import Settings
from tests.http_server import free_port
from tests.test_sidecar import _plugin_state
from tests.vllm_standin import StandIn


def _prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        message = "no prometheus binary: .ci/run installs Debian's `prometheus` package"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


def test_prometheus_scrapes_the_sidecar(
    tmp_path: Path, vllm: StandIn, serve_sidecar: Callable[[Settings], str]
):
    binary = _prometheus_binary()
    state.write(tmp_path / "state", _plugin_state(0, "FULL_AND_PIECEWISE", None))
    settings = Settings(vllm_url=vllm.url, state_dir=tmp_path / "state", poll_interval=0.2)
    sidecar = httpx.URL(serve_sidecar(settings))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: mla-serve-sidecar\n"
        f"    static_configs:\n      - targets: ['{sidecar.host}:{sidecar.port}']\n"
    )
    prometheus = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        query = f"http://127.0.0.1:{port}/api/v1/query"
        deadline = time.monotonic() + 60
        results: list[dict[str, object]] = []
        while time.monotonic() < deadline and not results:
            time.sleep(0.5)
            try:
                answer = httpx.get(query, params={"query": "mla_serve_cudagraph_mode_info"})
            except httpx.HTTPError:
                continue  # Prometheus still starting
            results = answer.json()["data"]["result"]
        assert results, "Prometheus never scraped mla_serve_cudagraph_mode_info"
        (series,) = results
        assert series["metric"]["mode"] == "FULL_AND_PIECEWISE"
        assert series["metric"]["job"] == "mla-serve-sidecar"
        up = httpx.get(query, params={"query": "mla_serve_vllm_up"}).json()["data"]["result"]
        assert up[0]["value"][1] == "1"
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
