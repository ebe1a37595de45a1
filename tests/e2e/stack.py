"""One stack `make e2e` tests: the sidecar, then vLLM behind it; watch the startup, run tests/e2e.

The sidecar starts first, as in a pod where both containers start together, so
its /readyz is seen failing while vLLM loads and turning ready after vLLM's
/health does. vLLM starts through the image's entrypoint (docker/entrypoint.sh
`serve`: manifest check, then `vllm serve`), with the engine plugin loaded
through its entry point and CUDA graphs on. Every poll of the startup (sidecar
/readyz first, then vLLM /health, so a readyz 200 seen before a failing /health
is a real violation) goes to timeline.json; where everything runs goes to
stack.json, which tests/e2e reads (MLA_SERVE_E2E_STACK).

A pristine tree (no fix series applied) has no manifest: the entrypoint starts it
with MLA_SERVE_ALLOW_DRIFT=1, the sidecar rightly never turns ready, and the stack
counts as up once vLLM's /health answers 200.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def status_of(url: str, timeout: float = 1.0) -> int | str:
    """HTTP status of a GET, or the error's name when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError as error:  # URLError (refused, timed out) is one
        return type(getattr(error, "reason", error)).__name__


@dataclass
class Stack:
    """One sidecar + vLLM pair: `name` is release-layout-state."""

    name: str
    release: str
    layout: dict[str, Any]
    state: str  # "patched" (series applied, manifest recorded) or "pristine"
    tree: Path  # the directory containing vllm/
    model: Path
    work: Path
    index: int  # ports 8100 + 10 * index: vLLM; + 1: the sidecar's pass-through; + 2: its admin
    gpus: str  # CUDA_VISIBLE_DEVICES
    env: dict[str, str] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)  # before the tree's on PYTHONPATH
    notes: dict[str, Any] = field(default_factory=dict)  # what the results must say
    expect: str = "serves"  # or "fails": a pristine tree where a fixed bug is reachable
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The served model name: the tiny model's (layouts.py)."""
        return str(self.layout["served_model_name"])

    @property
    def vllm_url(self) -> str:
        return f"http://127.0.0.1:{8100 + 10 * self.index}"

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{8101 + 10 * self.index}"

    @property
    def admin_url(self) -> str:
        """/readyz, /status, /metrics: the sidecar's admin port, as the chart runs it."""
        return f"http://127.0.0.1:{8102 + 10 * self.index}"

    def start(self) -> None:
        work, state_dir = self.work, self.work / "state"
        state_dir.mkdir(parents=True, exist_ok=True)
        manifest = self.tree / "vllm" / "mla_serve_manifest.json"
        env = dict(
            os.environ,
            **self.env,
            CUDA_VISIBLE_DEVICES=self.gpus,
            HOME=str(work / "home"),
            MLA_SERVE_STATE_DIR=str(state_dir),
            MLA_SERVE_MANIFEST=str(manifest),
            PYTHONPATH=os.pathsep.join(
                [*self.paths, str(self.tree), os.environ.get("PYTHONPATH", "")]
            ),
        )
        if self.state == "pristine":
            env["MLA_SERVE_ALLOW_DRIFT"] = "1"
        (work / "home").mkdir(exist_ok=True)
        vllm_log, sidecar_log = work / "vllm.log", work / "sidecar.log"
        port = self.vllm_url.rsplit(":", 1)[1]
        self.processes["sidecar"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mla_serve.cli",
                "sidecar",
                "--host",
                "127.0.0.1",
                "--port",
                self.sidecar_url.rsplit(":", 1)[1],
                "--admin-port",
                self.admin_url.rsplit(":", 1)[1],
                "--vllm-url",
                self.vllm_url,
                "--state-dir",
                str(state_dir),
                "--manifest",
                str(manifest),
                "--vllm-tree",
                str(self.tree),
                "--vllm-log",
                str(vllm_log),
                "--model",
                self.model_name,
                "--poll-interval",
                "0.5",
            ],
            cwd=ROOT,
            env=env,
            stdout=sidecar_log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        argv = [
            *self.layout["argv"],
            "--served-model-name",
            self.model_name,
            "--host",
            "127.0.0.1",
            "--port",
            port,
        ]
        self.processes["engine"] = subprocess.Popen(
            ["sh", str(ROOT / "docker" / "entrypoint.sh"), "serve", str(self.model), *argv],
            cwd=work,
            env=env,
            stdout=vllm_log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill test ends all of it
        )
        self.record = {
            "name": self.name,
            "release": self.release,
            "layout": self.layout,
            "state": self.state,
            "gpus": self.gpus,
            "vllm_url": self.vllm_url,
            "sidecar_url": self.sidecar_url,
            "admin_url": self.admin_url,
            "model": self.model_name,
            "tiny": self.layout["model"],
            "model_dir": str(self.model),
            "engine_pgid": self.processes["engine"].pid,
            "sidecar_pid": self.processes["sidecar"].pid,
            "vllm_log": str(vllm_log),
            "sidecar_log": str(sidecar_log),
            "state_dir": str(state_dir),
            "vllm_tree": str(self.tree),
            "serve_argv": argv,
            "env": self.env,
            "python_paths": self.paths,
            "notes": self.notes,
            "expect": self.expect,
            "timeline": str(work / "timeline.json"),
        }

    def watch(self, timeout: float) -> str:
        """Poll until up (and staying so briefly), vLLM dies, or time runs out."""
        timeline: list[dict[str, object]] = []
        began, noted, up_polls = time.monotonic(), 0.0, 0
        outcome = f"not up after {timeout:.0f} s"
        engine = self.processes["engine"]
        while time.monotonic() - began < timeout:
            readyz = status_of(f"{self.admin_url}/readyz")
            health = status_of(f"{self.vllm_url}/health")
            now = time.monotonic() - began
            timeline.append({"t": round(now, 3), "readyz": readyz, "health": health})
            up_polls += (readyz if self.state == "patched" else health) == 200
            if up_polls >= 8:  # stays up for a couple of seconds
                outcome = "ready" if self.state == "patched" else "serving"
                break
            if engine.poll() is not None:
                outcome = f"vllm exited with {engine.returncode}"
                break
            if now - noted >= 30:
                noted = now
                print(f"  {self.name} {now:4.0f} s: /health {health}, /readyz {readyz}", flush=True)
            time.sleep(0.25)
        Path(self.record["timeline"]).write_text(json.dumps(timeline) + "\n")
        self.record["startup"] = outcome
        self.record["startup_s"] = timeline[-1]["t"] if timeline else None
        (self.work / "stack.json").write_text(json.dumps(self.record, indent=2) + "\n")
        print(f"{self.name}: {outcome} after {self.record['startup_s']} s", flush=True)
        return outcome

    def test(self, results: Path) -> int:
        results.mkdir(parents=True, exist_ok=True)
        tests = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                str(ROOT / "tests" / "e2e"),
                "--junitxml",
                str(results / "junit.xml"),
            ],
            cwd=ROOT,
            check=False,
            stdout=(results / "pytest.log").open("wb"),
            stderr=subprocess.STDOUT,
            env=dict(
                os.environ,
                MLA_SERVE_E2E_STACK=str(self.work / "stack.json"),
                MLA_SERVE_E2E_RESULTS=str(results),
            ),
        )
        return tests.returncode

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
