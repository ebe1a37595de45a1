"""`pip install mla-serve` in a fresh venv, then `mla-serve sidecar`: what a new user does first.

mla-serve's wheel (built here as the image builds it) is installed with pip into a venv of
its own, with nothing but its declared dependencies (pip's cache makes that quick), and its
sidecar started from there (not from this checkout) in front of the stand-in vLLM
(tests/vllm_standin.py) until /livez answers and a chat request goes through. httptools is
one of its dependencies (the pass-through's parser), so the plain install serves on the
sidecar's own front, with the C lane built into the wheel, on asyncio's loop; with uvloop
added (as in vLLM's image), on uvloop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.http_server import free_port
from tests.vllm_standin import StandIn

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("clean-install")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(where), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = where.glob("mla_serve-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    _pip(where / "venv", str(wheel))
    return where / "venv"


def _pip(venv: Path, *packages: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *packages],
                   check=True)  # fmt: skip


def _imports(venv: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=False).returncode == 0


def _serve(venv: Path, log: Path) -> str:
    """Start the venv's `mla-serve sidecar` in front of the stand-in vLLM, wait for /livez,
    send one chat request through the pass-through, stop it (SIGTERM); its log."""
    vllm = StandIn().start()
    port, admin = free_port(), free_port()
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("MLA_SERVE_", "PYTHON"))}  # fmt: skip
    process = subprocess.Popen(
        [str(venv / "bin" / "mla-serve"), "sidecar", "--host", "127.0.0.1", "--port", str(port),
         "--admin-port", str(admin), "--vllm-url", vllm.url],
        cwd=log.parent, env=environment, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, f"the sidecar exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"/livez never answered: {log.read_text()}"
            try:
                if httpx.get(f"http://127.0.0.1:{admin}/livez").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "glm-5.3-flash", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "stop"
    finally:
        process.terminate()
        process.wait(timeout=15)
        vllm.stop()
    return log.read_text()


def test_the_sidecar_starts_from_a_plain_install(venv: Path, tmp_path: Path) -> None:
    assert _imports(venv, "httptools"), "httptools did not come with the install"
    assert not _imports(venv, "uvloop"), "uvloop came with the install"
    log = _serve(venv, tmp_path / "sidecar.log")
    front = "HTTP front: httptools on asyncio; the pass-through served without ASGI"
    assert f"{front}, token chunks read in C" in log, log
    assert "Traceback" not in log, log


def test_with_uvloop_the_front_runs_on_it(venv: Path, tmp_path: Path) -> None:
    _pip(venv, "uvloop")
    log = _serve(venv, tmp_path / "sidecar.log")
    front = "HTTP front: httptools on uvloop; the pass-through served without ASGI"
    assert f"{front}, token chunks read in C" in log, log


def test_each_profiles_plan_runs_from_the_installed_package(venv: Path, tmp_path: Path) -> None:
    """The chart README's `mla-serve plan` command for each profile (and the defaults), run by
    the installed `mla-serve` in a folder outside the checkout: the model configs come with
    the package (`--model NAME`), no file of this repository is read."""
    from tests.helm.test_helm_profiles_plan import readme_plans

    commands = readme_plans()
    assert {"defaults", "gb300-tp4", "dsv4-flash"} <= set(commands)
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("MLA_SERVE_", "PYTHON"))}  # fmt: skip
    for profile, argv in commands.items():
        assert "--config" not in argv, f"{profile}: plans a file of the checkout"
        result = subprocess.run(
            [str(venv / "bin" / "mla-serve"), *argv, "--format", "json"],
            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{profile}: {result.stderr}"
        assert json.loads(result.stdout)["per_rank"]["kv_budget_bytes"] > 0, profile
