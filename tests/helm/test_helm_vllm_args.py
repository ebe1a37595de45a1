"""The chart speaks vLLM 0.33.0 (the image's release): every rendered `vllm serve` command line
is parsed by vLLM's own argument parser into the engine arguments the values ask for, and the
chart's DCP rule is exactly vLLM's ParallelConfig rule and `mla-serve plan`'s.

Runs vLLM's Python code from the release tree (tests/trees.py) on the CPU, in a child process.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

import helm_python as helm
import pytest

from mla_serve.sizing import planning
from tests import trees
from tests.helm.helm_support import (
    CASES,
    HERE,
    PROFILES_DIR,
    case_documents,
    case_values,
    chart,
    load_values,
    merge,
    render,
    run,
    vllm_container,
)

RELEASE = trees.DEFAULT_RELEASE  # Chart.yaml appVersion's vLLM (tests/test_release_facts.py)
SIZES = [1, 2, 4, 8, 16, 32, 64]
LAYOUTS = list(itertools.product(SIZES, SIZES, SIZES))
# Stand-ins for what Kubernetes and LeaderWorkerSet substitute into $(VAR).
ENV = {
    "$(POD_IP)": "10.0.0.7",
    "$(LWS_LEADER_ADDRESS)": "mla-mla-serve-0.mla-mla-serve.serving",
    "$(LWS_WORKER_INDEX)": "1",
}


def command_lines() -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for case in sorted(CASES):
        for doc in case_documents(case):
            if doc["kind"] == "Deployment":
                pods = {"leader": doc["spec"]["template"]}
            elif doc["kind"] == "LeaderWorkerSet":
                lwt = doc["spec"]["leaderWorkerTemplate"]
                pods = {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
            else:
                continue
            for role, pod in pods.items():
                container = vllm_container(pod["spec"])
                assert container["command"] == ["mla-serve-entrypoint", "serve"]
                argv = []
                for arg in container["args"]:
                    for var, value in ENV.items():
                        arg = arg.replace(var, value)
                    argv.append(arg)
                lines[f"{case}/{role}"] = argv
    return lines


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    tree = trees.pristine(RELEASE)
    request = {"argvs": command_lines(), "layouts": LAYOUTS}
    result = run(
        [sys.executable, str(HERE / "vllm_args_probe.py")],
        input=json.dumps(request),
        env={
            **os.environ,
            "PYTHONPATH": str(tree),
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_LOGGING_LEVEL": "ERROR",
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_vllm_parses_every_rendered_command_line(probe: dict[str, Any]) -> None:
    failed = {label: got["error"] for label, got in probe["parsed"].items() if "error" in got}
    assert failed == {}


@pytest.mark.parametrize("label", sorted(command_lines()))
def test_engine_arguments_match_the_values(label: str, probe: dict[str, Any]) -> None:
    case, role = label.split("/")
    values = chart().merge_values(case_values(case))
    p, v = values["parallelism"], values["vllm"]
    got = probe["parsed"][label]
    assert "error" not in got, got.get("error")
    assert got["model"] == values["model"]["name"]
    assert got["served_model_name"] == [values["model"]["servedModelName"] or got["model"]]
    assert got["tensor_parallel_size"] == p["tensor"]
    assert got["prefill_context_parallel_size"] == p["prefillContext"]
    assert got["decode_context_parallel_size"] == p["decodeContext"]
    assert got["pipeline_parallel_size"] == p["pipeline"]
    assert got["data_parallel_size"] == p["data"]
    assert got["enable_expert_parallel"] == p["expert"]
    assert got["gpu_memory_utilization"] == v["gpuMemoryUtilization"]
    assert got["max_model_len"] == v.get("maxModelLen")  # Helm drops null values
    if v.get("maxNumBatchedTokens"):
        assert got["max_num_batched_tokens"] == v["maxNumBatchedTokens"]
    assert got["max_cudagraph_capture_size"] == v.get("maxCudagraphCaptureSize")
    # the chart's own pick: GLM-5.3 on Hopper (test_helm_render.py holds the rule)
    hopper_pick = "FLASH_ATTN_MLA_SPARSE" if case.startswith("hopper-") else None
    assert got["attention_backend"] == (v["attentionBackend"] or hopper_pick)
    assert got["cudagraph_mode"] == v["cudagraphMode"]
    assert (got["reasoning_parser"] or "") == v["reasoningParser"]
    assert (got["tool_call_parser"] or "") == v["toolCallParser"]
    assert got["enable_auto_tool_choice"] == bool(v["toolCallParser"])
    world = p["tensor"] * p["prefillContext"] * p["pipeline"] * p["data"]
    per_node = values["gpu"]["perNode"]
    nodes = 1 if world <= per_node else world // per_node
    assert got["nnodes"] == nodes
    if nodes > 1:
        assert got["node_rank"] == (0 if role == "leader" else 1)
        assert (
            got["master_addr"] == ENV["$(POD_IP)" if role == "leader" else "$(LWS_LEADER_ADDRESS)"]
        )
        assert got["master_port"] == values["multiNode"]["masterPort"]
    assert got["headless"] == (role == "worker")
    if role == "leader":
        assert (got["host"], got["port"]) == ("0.0.0.0", v["port"])


def test_dcp_rule_is_vllms_and_the_plans(probe: dict[str, Any]) -> None:
    """For every (TP, PCP, DCP) of the parallel sizes, the chart (templates/_validate.tpl, on
    render) accepts exactly what vLLM 0.33.0's ParallelConfig accepts and what `mla-serve plan`
    accepts (planning.parallel_layout_error); node size and NVLink rules held out of the way."""
    base = merge(
        load_values([PROFILES_DIR / "gb300-tp4.yaml"]),
        {
            "gpu": {"perNode": 8},
            "multiNode": {"computeDomain": {"enabled": True}},
            "modelCache": {"existingClaim": "shared-weights"},
        },
    )
    disagree = []
    for (tp, pcp, dcp), vllm_error in zip(LAYOUTS, probe["layouts"], strict=True):
        values = merge(
            base, {"parallelism": {"tensor": tp, "prefillContext": pcp, "decodeContext": dcp}}
        )
        try:
            render(values)
            chart_error = None
        except helm.HelmRenderError as error:
            chart_error = str(error)
            assert "decodeContext" in chart_error, (tp, pcp, dcp, chart_error)  # no other rule
        plan_error = planning.parallel_layout_error(tp, pcp, dcp)
        verdicts = (chart_error is None, vllm_error is None, plan_error is None)
        if len(set(verdicts)) > 1:
            disagree.append((tp, pcp, dcp, chart_error, vllm_error, plan_error))
    assert disagree == []
    accepted = sum(error is None for error in probe["layouts"])
    assert 50 < accepted < len(LAYOUTS)  # the probe really ran, and refused some
