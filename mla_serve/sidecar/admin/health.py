"""Readiness and startup verdicts, each with the reason a person needs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mla_serve.sidecar.admin.fixes import FixReport
from mla_serve.sidecar.admin.vllm_monitor import VllmSnapshot


@dataclass(frozen=True)
class Verdict:
    ok: bool
    checks: dict[str, dict[str, Any]]

    def body(self) -> dict[str, Any]:
        failing = [name for name, check in self.checks.items() if not check["ok"]]
        return {"status": "ok" if self.ok else "fail", "failing": failing, "checks": self.checks}


def readiness(
    vllm: VllmSnapshot,
    fixes: FixReport,
    model: str | None,
    stale_after: float | None = None,
    monitor_error: str | None = None,
    draining: bool = False,
) -> Verdict:
    """Ready only when vLLM is healthy (checked recently), serves the model, the fixes
    verify, and the sidecar is not draining (SIGTERM came: the pod is going away, so no new
    traffic should be sent its way, while what is in flight is still served)."""
    checks: dict[str, dict[str, Any]] = {}
    if draining:
        checks["draining"] = {"ok": False, "detail": "the sidecar is shutting down (SIGTERM)"}
    age = None if vllm.checked_at is None else time.time() - vllm.checked_at
    if stale_after is not None and age is not None and age > stale_after:
        why = f"vLLM last checked {age:.0f} s ago" + (
            f" (monitor: {monitor_error})" if monitor_error else ""
        )
        checks["vllm_health"] = {"ok": False, "detail": why}
    else:
        checks["vllm_health"] = {
            "ok": vllm.up,
            "detail": "vLLM /health is 200" if vllm.up else (vllm.error or "not checked yet"),
        }
    if model is None:
        listed = bool(vllm.models)
        detail = f"serving {', '.join(vllm.models)}" if listed else "no model listed"
    else:
        listed = model in vllm.models
        detail = f"{model} listed" if listed else f"{model} not in {list(vllm.models)}"
    if vllm.models_error and not listed:
        detail = vllm.models_error
    checks["model_listed"] = {"ok": listed, "detail": detail}
    if fixes.path is None:
        checks["fix_manifest"] = {"ok": True, "detail": "skipped: " + str(fixes.error)}
    else:
        checks["fix_manifest"] = {
            "ok": fixes.verified is True,
            "detail": "verified" if fixes.verified else (fixes.error or "not checked yet"),
            "drift": list(fixes.drift),
        }
    return Verdict(all(c["ok"] for c in checks.values()), checks)


def startup(vllm: VllmSnapshot) -> Verdict:
    """Started once vLLM has answered /health 200; then liveness takes over."""
    detail = "vLLM became healthy" if vllm.ever_healthy else (vllm.error or "not checked yet")
    return Verdict(vllm.ever_healthy, {"vllm_started": {"ok": vllm.ever_healthy, "detail": detail}})
