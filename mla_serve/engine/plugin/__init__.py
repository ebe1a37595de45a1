"""vLLM engine plugin: each engine rank reports what it really runs.

vLLM calls `register()` in every process through its `vllm.general_plugins`
entry point. The plugin wraps two methods, when their modules are imported:

- `GPUModelRunner.capture_model` (both model runners): times the capture and
  keeps the bytes it returns (vLLM's own measure of graph memory);
- `Worker.compile_or_warm_up_model`: runs last before the rank serves, after
  any backend downgrade of the CUDA graph mode, with or without capture.

After each, the rank's record (`mla_serve.engine.contract.RankRecord`: resolved CUDA
graph mode, capture sizes, time and memory, attention backends, sparse-MLA
workspace, parallel layout, whether its patched files still match the fix
manifest) is written to $MLA_SERVE_STATE_DIR.
With that variable unset the plugin does nothing. Any failure inside it is
logged and swallowed: reporting must never stop vLLM from serving.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mla_serve.engine import state
from mla_serve.engine.contract import Phase
from mla_serve.engine.plugin import imports
from mla_serve.engine.plugin.collect import collect

logger = logging.getLogger(__name__)

_WRAPPED = "__mla_serve_wrapped__"
_CAPTURE = "_mla_serve_capture"  # (seconds, bytes) left on the runner by capture_model

RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")
WORKER = "vllm.v1.worker.gpu_worker"


def register() -> None:
    """vLLM's plugin entry point; safe to call more than once per process."""
    try:
        if not os.environ.get(state.STATE_DIR_ENV):
            return
        for name in RUNNERS:
            imports.when_imported(name, _hook_runner)
        imports.when_imported(WORKER, _hook_worker)
    except Exception:
        logger.exception("mla-serve: plugin registration failed; vLLM continues without it")


def _hook_runner(module: ModuleType) -> None:
    def after_capture(runner: Any, result: Any, elapsed: float, kwargs: dict[str, Any]) -> None:
        if kwargs.get("profile_only"):
            return  # memory profiling pass, not the capture that serves
        captured = result if isinstance(result, int) else None
        setattr(runner, _CAPTURE, (elapsed, captured))
        _report(runner, "captured")

    _wrap(module.GPUModelRunner, "capture_model", after_capture)


def _hook_worker(module: ModuleType) -> None:
    def after_warmup(worker: Any, result: Any, elapsed: float, kwargs: dict[str, Any]) -> None:
        _report(worker.model_runner, "ready")

    _wrap(module.Worker, "compile_or_warm_up_model", after_warmup)


After = Callable[[Any, Any, float, dict[str, Any]], None]


def _wrap(cls: type, name: str, after: After) -> None:
    original = getattr(cls, name)
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        try:
            after(self, result, time.perf_counter() - start, kwargs)
        except Exception:
            logger.exception("mla-serve: could not record engine state after %s", name)
        return result

    setattr(wrapper, _WRAPPED, True)
    setattr(cls, name, wrapper)


def _report(runner: Any, phase: Phase) -> None:
    directory = os.environ.get(state.STATE_DIR_ENV)
    if directory:
        capture = getattr(runner, _CAPTURE, None)
        state.write(Path(directory), collect(runner, phase, capture))
