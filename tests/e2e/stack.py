"""Start the stack `make e2e` tests: the sidecar, then vLLM behind it; watch the startup.

The sidecar starts first, as in a pod where both containers start together, so
its /readyz is seen failing while vLLM loads and turning ready after vLLM's
/health does. vLLM starts through the image's entrypoint (docker/entrypoint.sh
`serve`: manifest check, then `vllm serve`), with the engine plugin loaded
through its entry point and CUDA graphs on (vLLM's default). Every poll of the
startup (sidecar /readyz first, then vLLM /health, so a readyz 200 seen before
a failing /health is a real violation) goes to timeline.json; where everything
runs goes to stack.json, which tests/e2e reads (MLA_SERVE_E2E_STACK).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-deepseek-v3.2"
VLLM_PORT, SIDECAR_PORT = 8000, 8080
SERVE_FLAGS = (  # what the tiny model needs (see model.py) and what keeps startup short
    "--load-format", "dummy",
    "--max-model-len", "4096",
    "--max-num-seqs", "16",
    "--gpu-memory-utilization", "0.30",
    "--reasoning-parser", "deepseek_v3",
)  # fmt: skip


def status_of(url: str, timeout: float = 1.0) -> int | str:
    """HTTP status of a GET, or the error's name when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError as error:  # URLError (refused, timed out) is one
        return type(getattr(error, "reason", error)).__name__


Engine = subprocess.Popen[bytes]


def start(args: argparse.Namespace, work: Path) -> tuple[dict[str, object], Engine]:
    """Where everything runs (stack.json), and vLLM's process."""
    state_dir, manifest = work / "state", args.vllm_tree / "vllm" / "mla_serve_manifest.json"
    state_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLA_SERVE_STATE_DIR=str(state_dir), MLA_SERVE_MANIFEST=str(manifest))
    vllm_log, sidecar_log = work / "vllm.log", work / "sidecar.log"
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "sidecar", "--host", "127.0.0.1",
         "--port", str(SIDECAR_PORT), "--vllm-url", f"http://127.0.0.1:{VLLM_PORT}",
         "--state-dir", str(state_dir), "--manifest", str(manifest),
         "--vllm-tree", str(args.vllm_tree), "--vllm-log", str(vllm_log),
         "--model", MODEL_NAME, "--poll-interval", "0.5"],
        cwd=ROOT, env=env, stdout=sidecar_log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    engine = subprocess.Popen(
        ["sh", str(ROOT / "docker" / "entrypoint.sh"), "serve", str(args.model),
         "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(VLLM_PORT),
         *SERVE_FLAGS, *args.extra],
        cwd=work, env=env, stdout=vllm_log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the kill test ends all of it
    )  # fmt: skip
    stack: dict[str, object] = {
        "vllm_url": f"http://127.0.0.1:{VLLM_PORT}",
        "sidecar_url": f"http://127.0.0.1:{SIDECAR_PORT}",
        "model": MODEL_NAME,
        "engine_pgid": engine.pid,
        "sidecar_pid": sidecar.pid,
        "vllm_log": str(vllm_log),
        "sidecar_log": str(sidecar_log),
        "state_dir": str(state_dir),
        "vllm_tree": str(args.vllm_tree),
        "serve_flags": [*SERVE_FLAGS, *args.extra],
    }
    return stack, engine


def watch(
    stack: dict[str, object], engine: Engine, timeout: float
) -> tuple[list[dict[str, object]], str]:
    """Poll until the sidecar is ready (and stays so briefly), vLLM dies, or time runs out."""
    timeline: list[dict[str, object]] = []
    began = time.monotonic()
    noted = 0.0
    ready_polls = 0
    while time.monotonic() - began < timeout:
        readyz = status_of(f"{stack['sidecar_url']}/readyz")
        health = status_of(f"{stack['vllm_url']}/health")
        now = time.monotonic() - began
        timeline.append({"t": round(now, 3), "readyz": readyz, "health": health})
        ready_polls += readyz == 200
        if ready_polls >= 8:  # stays ready for a couple of seconds
            return timeline, "ready"
        if engine.poll() is not None:
            return timeline, "vllm exited"
        if now - noted >= 15:
            noted = now
            print(f"  {now:5.0f} s: /health {health}, /readyz {readyz}", flush=True)
        time.sleep(0.25)
    return timeline, f"not ready after {timeout:.0f} s"


def stop(stack: dict[str, object]) -> None:
    for key in ("engine_pgid", "sidecar_pid"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(str(stack[key])), signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-tree", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("extra", nargs="*", help="more `vllm serve` flags")
    args = parser.parse_args()
    for name in ("vllm_tree", "model", "work", "results"):  # vLLM runs in another directory
        setattr(args, name, getattr(args, name).resolve())
    args.results.mkdir(parents=True, exist_ok=True)
    stack, engine = start(args, args.work)
    print(f"started the sidecar and vLLM; logs in {args.work}", flush=True)
    try:
        timeline, outcome = watch(stack, engine, args.timeout)
        stack["startup"] = outcome
        (args.work / "timeline.json").write_text(json.dumps(timeline) + "\n")
        stack["timeline"] = str(args.work / "timeline.json")
        (args.work / "stack.json").write_text(json.dumps(stack, indent=2) + "\n")
        print(f"startup: {outcome} after {timeline[-1]['t']:.0f} s", flush=True)
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             str(ROOT / "tests" / "e2e"), "--junitxml", str(args.results / "junit.xml")],
            cwd=ROOT, env=dict(os.environ, MLA_SERVE_E2E_STACK=str(args.work / "stack.json")),
            check=False,
        )  # fmt: skip
        return tests.returncode
    finally:
        stop(stack)


if __name__ == "__main__":
    sys.exit(main())
