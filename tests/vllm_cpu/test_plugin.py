"""The engine plugin inside each release's real vLLM modules, on the CPU.

vLLM's own plugin loader runs our entry point; the hooks land on the real
model runner and worker classes; MRV1's `capture_model` runs for real when the
resolved mode is NONE (its early return needs no GPU). Capturing actual graphs,
and the figures that come from them, need a GPU: the end-to-end run covers them.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import mla_serve.engine.plugin as plugin
from mla_serve.engine import state

HOOKED = {
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", "capture_model"),
    "vllm.v1.worker.gpu.model_runner": ("GPUModelRunner", "capture_model"),
    "vllm.v1.worker.gpu_worker": ("Worker", "compile_or_warm_up_model"),
}


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv(state.STATE_DIR_ENV, str(directory))
    return directory


def _config(mode: str):
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8]),
    )
    # What the runner's backend check leaves behind, e.g. a downgrade.
    config.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, mode)
    return config


def test_vllms_plugin_loader_installs_the_hooks(expect, state_dir):
    import vllm.plugins

    vllm.plugins.load_general_plugins()  # reads our entry point, calls register()
    for name, (cls, method) in HOOKED.items():
        module = importlib.import_module(name)  # imported after registration
        hooked = getattr(getattr(module, cls), method)
        assert hooked.__mla_serve_wrapped__, name
        plugin.register()  # vLLM may load plugins again: never wrap twice
        assert getattr(getattr(module, cls), method) is hooked
        assert not getattr(hooked.__wrapped__, "__mla_serve_wrapped__", False)


# A fresh process as a vLLM worker starts: vLLM loads its plugins, then imports the model
# runner and the worker (which the hooks wrap), then the rank checks its files against the
# manifest. It prints the mla_serve modules that process holds, and that check.
WORKER_START = """
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
import vllm.v1.worker.gpu_model_runner, vllm.v1.worker.gpu_worker
from mla_serve.engine.plugin.collect import manifest_check
check = manifest_check()
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m == "mla_serve" or m.startswith("mla_serve.")),
    "files_match": None if check is None else check.files_match,
}))
"""


ENGINE = ["mla_serve", "engine"]


def test_a_vllm_worker_loads_none_of_the_patch_engine(expect, state_dir):
    """The plugin's package checks the manifest itself: a worker imports no
    mla_serve.patching (nor sidecar) module, and still knows whether its files match."""
    tree = Path(importlib.import_module("vllm").__file__).resolve().parent.parent
    # The tree under test first (as --vllm-tree puts it), then whatever this run was given.
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *inherited])}
    child = subprocess.run(
        [sys.executable, "-c", WORKER_START],
        capture_output=True, text=True, env=environment, timeout=300, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    assert "mla_serve.engine.plugin" in seen["modules"]  # the plugin did load
    outside = [m for m in seen["modules"] if m.split(".")[:2] not in (["mla_serve"], ENGINE)]
    assert outside == []  # no mla_serve.patching, no sidecar: the engine side only
    assert seen["files_match"] is (True if expect.state == "patched" else None)


def test_real_capture_model_reports_the_resolved_mode(expect, state_dir):
    plugin.register()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.vllm_config = _config("NONE")
    runner.compilation_config = runner.vllm_config.compilation_config
    assert GPUModelRunner.capture_model(runner) == 0  # vLLM's own early return
    (written,) = state.read_all(state_dir).records
    assert written.phase == "captured"
    assert written.cudagraph_mode == "NONE"
    assert written.cudagraph_capture_sizes == (1, 2, 4, 8)
    assert written.capture_bytes == 0 and written.capture_seconds >= 0
    assert written.vllm_version == expect.release
    assert written.parallel.tp == 1
    assert (
        written.max_num_batched_tokens == runner.vllm_config.scheduler_config.max_num_batched_tokens
    )


def test_rank_state_reports_backends_workspace_and_manifest(expect, state_dir, monkeypatch):
    """What the worker hook writes once warm-up is over (warm-up itself needs a GPU)."""
    import torch

    class Backend:
        @staticmethod
        def get_name() -> str:
            return "FLASHMLA_SPARSE"

    runner = SimpleNamespace(
        vllm_config=_config("FULL_AND_PIECEWISE"),
        attn_groups=[[SimpleNamespace(backend=Backend)]],
        device=SimpleNamespace(index=0),
    )
    backend = importlib.import_module("vllm.v1.attention.backends.mla.flashinfer_mla_sparse")
    monkeypatch.setattr(backend, "_fi_sparse_workspace", torch.zeros(4096, dtype=torch.int8))
    # vLLM's own workspace manager, grown by a request for two views, then locked
    # (on CPU: its resize empties the accelerator cache, which a CPU-only torch refuses).
    workspace = importlib.import_module("vllm.v1.worker.workspace")
    monkeypatch.setattr(workspace, "_manager", None)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    workspace.init_workspace_manager(torch.device("cpu"))
    workspace.current_workspace_manager().get_simultaneous(
        ((1000,), torch.float32), ((3, 7), torch.bfloat16)
    )
    workspace.lock_workspace()
    plugin._report(runner, "ready")
    (written,) = state.read_all(state_dir).records
    assert written.phase == "ready"
    assert written.cudagraph_mode == "FULL_AND_PIECEWISE"
    assert written.attention_backends == ("FLASHMLA_SPARSE",)
    assert written.sparse_mla_workspace_bytes == 4096
    assert written.attention_workspace_bytes == 4096 + 256  # each view rounded up to 256 B
    manifest = written.manifest
    assert manifest.path.endswith("mla_serve_manifest.json")
    if expect.state == "patched":
        assert manifest.files_match is True
    else:
        assert manifest.files_match is None  # pristine trees carry no manifest


def test_a_plugin_failure_never_stops_vllm(expect, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv(state.STATE_DIR_ENV, str(blocker / "state"))
    plugin.register()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.vllm_config = _config("NONE")
    runner.compilation_config = runner.vllm_config.compilation_config
    assert GPUModelRunner.capture_model(runner) == 0  # state write failed, vLLM did not


def test_without_a_state_dir_the_plugin_does_nothing(expect, monkeypatch):
    monkeypatch.delenv(state.STATE_DIR_ENV, raising=False)
    for name in HOOKED:
        sys.modules.pop(name, None)
    plugin.register()
    module = importlib.import_module("vllm.v1.worker.gpu_worker")
    assert not getattr(module.Worker.compile_or_warm_up_model, "__mla_serve_wrapped__", False)
