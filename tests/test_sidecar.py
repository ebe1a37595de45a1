"""The sidecar against a stand-in vLLM, both on real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mla_serve.engine import state
from mla_serve.engine.contract import ManifestCheck, Parallel, RankRecord
from mla_serve.sidecar.settings import Settings
from tests import trees
from tests.scrape import samples
from tests.vllm_standin import StandIn


@pytest.fixture
def sidecar(
    vllm: StandIn, tmp_path: Path, serve_sidecar: Callable[[Settings], str]
) -> Callable[..., str]:
    """Start a sidecar in front of the stand-in; returns its URL."""

    def start(**overrides: object) -> str:
        settings = Settings(
            vllm_url=vllm.url,
            state_dir=tmp_path / "state",
            poll_interval=0.05,
            probe_timeout=0.5,
            **overrides,  # type: ignore[arg-type]
        )
        return serve_sidecar(settings)

    return start


def wait_for(
    url: str, predicate: Callable[[httpx.Response], bool], timeout: float = 5
) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(url, timeout=5)
        if predicate(response) or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_ready_only_when_vllm_is_healthy_and_serves_the_model(vllm, sidecar):
    vllm.behaviour.health_status = 503
    url = sidecar(model="glm-5.3-flash")
    assert httpx.get(f"{url}/livez").status_code == 200
    response = wait_for(f"{url}/readyz", lambda r: "HTTP 503" in r.text)
    assert response.status_code == 503
    body = response.json()
    assert "vllm_health" in body["failing"]
    assert body["checks"]["vllm_health"]["detail"] == "/health returned HTTP 503"
    assert httpx.get(f"{url}/startupz").status_code == 503

    vllm.behaviour.health_status = 200
    response = wait_for(f"{url}/readyz", lambda r: r.status_code == 200)
    assert response.status_code == 200, response.text
    assert response.json()["checks"]["model_listed"]["detail"] == "glm-5.3-flash listed"
    assert httpx.get(f"{url}/startupz").status_code == 200

    vllm.behaviour.models = ["another-model"]
    response = wait_for(f"{url}/readyz", lambda r: r.status_code == 503)
    assert response.json()["failing"] == ["model_listed"]


def test_unreachable_slow_or_garbage_vllm_never_hangs_the_sidecar(vllm, sidecar):
    url = sidecar()
    wait_for(f"{url}/readyz", lambda r: r.status_code == 200)

    vllm.behaviour.delay = 3.0  # longer than the 0.5 s probe timeout
    # /health and /v1/models are probed apart: wait for the one this test is about (a
    # snapshot where only /v1/models had timed out yet made this test flaky on a loaded host)
    response = wait_for(f"{url}/readyz", lambda r: "/health timed out" in r.text)
    started = time.monotonic()
    assert httpx.get(f"{url}/readyz", timeout=1).status_code == 503
    assert time.monotonic() - started < 0.5  # answered from the snapshot
    assert "/health timed out after 0.5 s" in response.text

    vllm.behaviour.delay = 0.0
    vllm.behaviour.garbage = True
    response = wait_for(f"{url}/readyz", lambda r: "unusable" in r.text)
    assert response.status_code == 503
    assert "/v1/models unusable" in response.json()["checks"]["model_listed"]["detail"] or (
        "/v1/models unusable" in response.json()["checks"]["vllm_health"]["detail"]
    )

    vllm.stop()
    response = wait_for(f"{url}/readyz", lambda r: "unreachable" in r.text)
    assert response.status_code == 503
    assert httpx.get(f"{url}/livez").status_code == 200
    assert samples(url)["mla_serve_vllm_up"] == [({}, 0.0)]


def _plugin_state(rank: int, mode: str, workspace: int | None) -> RankRecord:
    """A rank record as the engine plugin writes it (see mla_serve/engine/plugin/collect.py)."""
    return RankRecord(
        rank=rank,
        local_rank=rank,
        pid=4242,
        host="node-0",
        phase="ready",
        updated_at=time.time(),
        vllm_version="0.33.0",
        model_runner="vllm.v1.worker.gpu_model_runner",
        cudagraph_mode=mode,
        cudagraph_capture_sizes=(1, 2, 4, 8, 16),
        capture_seconds=12.5,
        capture_bytes=3 * (1 << 30),
        attention_backends=("FLASHINFER_MLA_SPARSE",),
        sparse_mla_workspace_bytes=workspace,
        attention_workspace_bytes=394 << 20,
        num_attention_heads_per_rank=64,
        max_num_batched_tokens=4096,
        parallel=Parallel(tp=1, pp=1, dp=1, pcp=4, dcp=4, ep=False),
        manifest=ManifestCheck("/opt/mla-serve/manifest.json", files_match=True, mismatched=()),
    )


def test_engine_figures_from_the_plugin_with_their_sources(sidecar, tmp_path):
    for rank in range(2):
        state.write(tmp_path / "state", _plugin_state(rank, "FULL_AND_PIECEWISE", 2_561_671_168))
    url = sidecar()
    series = samples(url)
    assert ({"mode": "FULL_AND_PIECEWISE", "rank": "1"}, 1.0) in series[
        "mla_serve_cudagraph_mode_info"
    ]
    assert ({"rank": "0"}, 5.0) in series["mla_serve_cudagraph_capture_sizes"]
    assert ({"rank": "0"}, 12.5) in series["mla_serve_cudagraph_capture_duration_seconds"]
    assert ({"rank": "0"}, float(3 << 30)) in series["mla_serve_cudagraph_capture_memory_bytes"]
    workspace = series["mla_serve_sparse_mla_workspace_bytes"]
    # vllm#50791's sizing: 64 heads per rank, DCP 4, 4096 batched tokens -> 2.39 GiB.
    assert ({"rank": "0", "kind": "actual"}, 2_561_671_168.0) in workspace
    assert ({"rank": "0", "kind": "predicted"}, 2_561_671_168.0) in workspace
    assert ({"rank": "1"}, float(394 << 20)) in series["mla_serve_attention_workspace_bytes"]

    doc = httpx.get(f"{url}/status").json()
    figures = doc["engine"]["ranks"][0]["figures"]
    assert figures["cudagraph_mode"] == {"value": "FULL_AND_PIECEWISE", "source": "plugin"}
    assert figures["sparse_mla_workspace_bytes_predicted"]["source"] == "sizing model"
    page = httpx.get(f"{url}/status", headers={"accept": "text/html"})
    assert page.headers["content-type"].startswith("text/html")
    assert "FULL_AND_PIECEWISE" in page.text and "rank 1" in page.text


WORKER_0 = "(Worker_TP0 pid=311) "
WORKER_1 = "(Worker_TP1 pid=312) "
CAPTURED = "[gpu_model_runner.py:6517] Graph capturing finished in"
VLLM_LOG = "\n".join(
    [
        "INFO 11-29 10:00:00 [core.py:140] Initializing a V1 LLM engine (v0.33.0) with config: "
        "model='zai-org/GLM-5.3-Flash', compilation_config={'mode': 3, 'cudagraph_mode': "
        "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'cudagraph_capture_sizes': [1, 2, 4, 8]}",
        WORKER_0 + "WARNING 11-29 10:01:00 [compilation.py:1418] CUDAGraphMode.FULL_AND_PIECEWISE "
        "is not supported with FlashMLASparse backend (support: UNIFORM_BATCH); "
        "setting cudagraph_mode=PIECEWISE",
        WORKER_0 + f"INFO 11-29 10:02:00 {CAPTURED} 14 secs, took 1.25 GiB",
        WORKER_1 + f"INFO 11-29 10:02:00 {CAPTURED} 15 secs, took 1.50 GiB",
    ]
)


def test_without_the_plugin_figures_come_from_vllms_log(sidecar, tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_LOG)
    url = sidecar(vllm_log=log)
    series = samples(url)
    assert ({"mode": "PIECEWISE", "rank": "1"}, 1.0) in series["mla_serve_cudagraph_mode_info"]
    assert ({"rank": "1"}, 15.0) in series["mla_serve_cudagraph_capture_duration_seconds"]
    assert ({"rank": "0"}, 1.25 * (1 << 30)) in series["mla_serve_cudagraph_capture_memory_bytes"]
    figures = httpx.get(f"{url}/status").json()["engine"]["ranks"][0]["figures"]
    assert figures["cudagraph_mode"] == {"value": "PIECEWISE", "source": "log"}
    assert figures["sparse_mla_workspace_bytes"] == {"value": None, "source": None}


def test_manifest_verification_gates_readiness_and_reports_drift(sidecar, tmp_path):
    path = tmp_path / "manifest.json"
    target = trees.patched("0.29.0", tmp_path / "tree", path)

    url = sidecar(manifest=path, vllm_tree=target)
    response = wait_for(f"{url}/readyz", lambda r: r.status_code == 200)
    assert response.json()["checks"]["fix_manifest"]["detail"] == "verified"
    series = samples(url)
    assert series["mla_serve_manifest_verified"] == [({}, 1.0)]
    fix_info = {labels["fix"]: labels for labels, _ in series["mla_serve_fix_info"]}
    assert fix_info["dcp-empty-shard-mask"] == {
        "fix": "dcp-empty-shard-mask",
        "status": "patched",
        "vllm_version": "0.29.0",
    }
    assert fix_info["piecewise-topk-event"]["status"] == "not-affected"

    edited = target / "vllm/v1/attention/ops/dcp.py"
    trees.edit(edited, edited.read_text() + "# hot fix\n")
    url = sidecar(manifest=path, vllm_tree=target)  # verifies at start-up
    response = wait_for(f"{url}/readyz", lambda r: r.json()["checks"]["fix_manifest"]["drift"])
    check = response.json()["checks"]["fix_manifest"]
    assert check["ok"] is False and any("ops/dcp.py" in line for line in check["drift"])
    assert samples(url)["mla_serve_manifest_verified"] == [({}, 0.0)]


def test_metrics_follow_prometheus_naming(sidecar, tmp_path):
    state.write(tmp_path / "state", _plugin_state(0, "PIECEWISE", None))
    url = sidecar()
    wait_for(f"{url}/readyz", lambda r: r.status_code == 200)
    text = httpx.get(f"{url}/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"mla_serve_vllm_up", "mla_serve_ready", "mla_serve_cudagraph_mode_info"} <= names
    for name in names:
        assert name.startswith("mla_serve_") and ":" not in name
    assert json.loads(httpx.get(f"{url}/status").text)["vllm"]["version"] == "0.33.0"


def test_models_and_version_are_asked_when_they_can_have_changed_not_on_every_check(vllm):
    """/health on every check; /v1/models and /version when vLLM turns healthy, while the
    model readiness wants is not listed, and otherwise every `refresh_every` checks (they
    cost vLLM's API server a request each, beside the streams it serves)."""
    import asyncio

    import aiohttp

    from mla_serve.sidecar.admin.vllm_monitor import VllmMonitor

    async def checks(monitor: VllmMonitor, count: int) -> None:
        async with aiohttp.ClientSession(base_url=vllm.url) as session:
            monitor._session = session
            for _ in range(count):
                await monitor.check()

    polled = vllm.behaviour.polled
    monitor = VllmMonitor(timeout=2, interval=0, refresh_every=20)
    asyncio.run(checks(monitor, 45))
    assert polled == {"/health": 45, "/v1/models": 3, "/version": 3}  # checks 1, 21, 41
    assert monitor.snapshot.models == ("glm-5.3-flash",) and monitor.snapshot.version

    polled.clear()
    vllm.behaviour.health_status = 503
    asyncio.run(checks(monitor, 2))
    vllm.behaviour.health_status = 200
    asyncio.run(checks(monitor, 3))  # turned healthy: asked once, then not
    assert polled == {"/health": 5, "/v1/models": 1, "/version": 1}

    polled.clear()
    wanting = VllmMonitor(timeout=2, interval=0, refresh_every=20, model="not-loaded-yet")
    asyncio.run(checks(wanting, 4))  # not listed: asked every check until it is
    assert polled == {"/health": 4, "/v1/models": 4, "/version": 4}
    vllm.behaviour.models = ["not-loaded-yet"]
    polled.clear()
    asyncio.run(checks(wanting, 4))
    assert polled == {"/health": 4, "/v1/models": 1, "/version": 1}
    assert wanting.snapshot.models == ("not-loaded-yet",)


def test_sidecar_help_states_each_default_once():
    """`mla-serve sidecar --help`: one default per flag, never "(default: any) (default unset)"."""
    import argparse
    import re

    from mla_serve.sidecar import settings as settings_

    parser = argparse.ArgumentParser()
    settings_.add_arguments(parser)
    for action in parser._actions[1:]:
        text = action.help or ""
        said = len(re.findall(r"\((?:default\b|off\))", text))
        assert said == 1, f"{action.option_strings[0]}: {text}"
        assert text.endswith(f"env {settings_.env_of(action.dest)}")
