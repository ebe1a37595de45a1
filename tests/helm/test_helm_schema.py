"""values.schema.json (and the chart's own checks) reject bad values with a readable message."""

from __future__ import annotations

import json
import re
import shutil
import sys
from typing import Any

import helm_python as helm
import pytest

from tests.helm.helm_support import (
    CASES,
    CHART,
    PROFILES_DIR,
    REPO,
    case_values,
    chart,
    documents,
    load_values,
    merge,
    render,
    run,
    vllm_container,
)

GB300 = load_values([PROFILES_DIR / "gb300-tp4.yaml"])
SCHEMA = json.loads((CHART / "values.schema.json").read_text())

# (values on top of the gb300-tp4 profile, lines the error must contain)
SCHEMA_REJECTS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "wrong type": (
        {"parallelism": {"tensor": "4"}},
        ["at '/parallelism/tensor': got string, want integer"],
    ),
    "not a power of two": (
        {"parallelism": {"tensor": 3}},
        ["at '/parallelism/tensor': value must be one of 1, 2, 4, 8, 16, 32, 64"],
    ),
    "misspelt key": (
        {"parallelism": {"tensorParallel": 4}},
        ["at '/parallelism': additional properties 'tensorParallel' not allowed"],
    ),
    "unknown architecture": (
        {"gpu": {"arch": "x86_64"}},
        ["at '/gpu/arch': value must be one of '', 'amd64', 'arm64'"],
    ),
    "GPUs per node": (
        {"gpu": {"perNode": 6}},
        ["at '/gpu/perNode': value must be one of 1, 2, 4, 8"],
    ),
    "utilization above 1": (
        {"vllm": {"gpuMemoryUtilization": 1.5}},
        ["at '/vllm/gpuMemoryUtilization': maximum: got 1.5, want 1"],
    ),
    "unknown CUDA graph mode": (
        {"vllm": {"cudagraphMode": "piecewise"}},
        ["at '/vllm/cudagraphMode': value must be one of 'NONE', 'PIECEWISE'"],
    ),
    "plugins without mla_serve": (
        {"vllm": {"plugins": ["other_plugin"]}},
        ["at '/vllm/plugins/0': value must be 'mla_serve'"],
    ),
    "unknown KV cache dtype": (
        {"vllm": {"kvCacheDtype": "fp4"}},
        ["at '/vllm/kvCacheDtype': value must be one of"],
    ),
    "bad quantity": (
        {"shm": {"sizeLimit": "lots"}},
        ["at '/shm/sizeLimit': 'lots' does not match pattern"],
    ),
    "bad duration": (
        {"monitoring": {"prometheusRule": {"runaways": {"window": "ten minutes"}}}},
        ["at '/monitoring/prometheusRule/runaways/window'"],
    ),
}

# Rules across values: templates/_validate.tpl's `fail`, the one place they are written.
TEMPLATE_REJECTS: dict[str, tuple[dict[str, Any], str]] = {
    "eager with a CUDA graph mode": (
        {"vllm": {"enforceEager": True}},
        "vllm.enforceEager captures no CUDA graph: set vllm.cudagraphMode to NONE, "
        "not FULL_AND_PIECEWISE",
    ),
    "TP x PCP larger than the node (GB300 tray)": (
        {"parallelism": {"tensor": 4, "prefillContext": 2}},
        "parallelism: the TP x PCP group (8 GPUs) does not fit one node of gpu.perNode=4 GPUs; "
        "its per-layer collectives need NVLink: reduce it, or enable multiNode.computeDomain",
    ),
    "TP8 on a 4-GPU node": (
        {"parallelism": {"tensor": 8}},
        "parallelism: the TP x PCP group (8 GPUs) does not fit one node of gpu.perNode=4 GPUs",
    ),
    "DCP not dividing TP (no PCP)": (
        {"parallelism": {"tensor": 2, "decodeContext": 4}},
        "parallelism: decodeContext=4 must divide tensor=2 (without PCP, DCP reuses the TP ranks)",
    ),
    "DCP neither PCP nor TP x PCP": (
        {"parallelism": {"tensor": 1, "prefillContext": 4, "decodeContext": 2}},
        "parallelism: with prefillContext=4, decodeContext must be one of 1, 4 "
        "(off, the PCP axis, or TP x PCP); got 2",
    ),
    "DP that splits unevenly over nodes": (
        {"parallelism": {"tensor": 2, "data": 3}},
        "parallelism: TP2 x PCP1 x PP1 x DP3 = 6 GPUs does not split evenly over nodes of "
        "gpu.perNode=4 GPUs",
    ),
    "a2a where PCP and DCP meet (vLLM 0.33.0's PCP manager needs ag_rs)": (
        {
            "parallelism": {"tensor": 1, "prefillContext": 4, "decodeContext": 4},
            "vllm": {"dcpCommBackend": "a2a"},
        },
        "vllm.dcpCommBackend: a2a where PCP and DCP meet (prefillContext=4, decodeContext=4); "
        "vLLM 0.33.0's PCP manager needs ag_rs",
    ),
    "a flag owned by the parallelism block": (
        {"vllm": {"extraArgs": ["--tensor-parallel-size=8"]}},
        "vllm.extraArgs: --tensor-parallel-size is set by parallelism.tensor; "
        "set it there, not in extraArgs",
    ),
    "a ReadWriteOnce cache for two replicas": (
        {"replicaCount": 2},
        "modelCache.create.accessModes [ReadWriteOnce] cannot be mounted by 1 nodes x 2 replicas",
    ),
    "a ReadWriteOnce cache for a multi-node group": (
        {
            "parallelism": {"tensor": 4, "prefillContext": 2},
            "multiNode": {"computeDomain": {"enabled": True}},
        },
        "cannot be mounted by 2 nodes x 1 replicas; use ReadWriteMany",
    ),
    "two scrape objects": (
        {"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}},
        "monitoring.podMonitor and monitoring.serviceMonitor are both enabled",
    ),
    "rolling update settings on Recreate": (
        {"strategy": {"type": "Recreate", "rollingUpdate": {"maxSurge": 0}}},
        "strategy.rollingUpdate only applies to strategy.type RollingUpdate",
    ),
    "sidecar on vLLM's port": (
        {"sidecar": {"port": 8000}},
        "sidecar.port and vllm.port are both 8000",
    ),
    "offline without a cache": (
        {"modelCache": {"enabled": False, "offline": True}},
        "modelCache.offline needs modelCache.enabled",
    ),
}


@pytest.mark.parametrize("name", sorted(SCHEMA_REJECTS))
def test_schema_rejects(name: str) -> None:
    override, expected = SCHEMA_REJECTS[name]
    values = merge(GB300, override)
    with pytest.raises(helm.HelmValuesError) as caught:
        chart().validate_schema(values)
    message = str(caught.value)
    for line in expected:
        assert line in message, f"{name}: {line!r} not in:\n{message}"
    # Installing goes through the same check.
    with pytest.raises(helm.HelmValuesError):
        render(values)
    # And `helm lint` reports it as an error.
    report = helm.lint(str(REPO / "helm" / "mla-serve"), values, strict=True)
    assert any(expected[0] in error for error in report["errors"])


@pytest.mark.parametrize("name", sorted(TEMPLATE_REJECTS))
def test_chart_rejects(name: str) -> None:
    override, expected = TEMPLATE_REJECTS[name]
    values = merge(GB300, override)
    chart().validate_schema(values)  # well-typed: the schema alone cannot tell
    with pytest.raises(helm.HelmRenderError) as caught:
        render(values)
    assert expected in str(caught.value)


@pytest.fixture(scope="module")
def chart_without_schema(tmp_path_factory: pytest.TempPathFactory) -> helm.Chart:
    copy = tmp_path_factory.mktemp("chart") / "mla-serve"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    return helm.Chart.load(str(copy))


@pytest.mark.parametrize("name", sorted(TEMPLATE_REJECTS))
def test_template_checks_hold_without_the_schema(
    name: str, chart_without_schema: helm.Chart
) -> None:
    """helm install --skip-schema-validation still cannot produce a pod vLLM refuses."""
    override, expected = TEMPLATE_REJECTS[name]
    with pytest.raises(helm.HelmRenderError) as caught:
        chart_without_schema.render(merge(GB300, override), name="mla", namespace="serving")
    assert expected in str(caught.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_shipped_values_pass(case: str) -> None:
    chart().validate_schema(case_values(case))


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        (
            {
                "parallelism": {"tensor": 4, "data": 2},
                "modelCache": {"existingClaim": "shared-weights"},
            },
            "TP4 x DP2 on 4-GPU trays: two whole nodes",
        ),
        (
            {
                "parallelism": {"tensor": 4, "prefillContext": 2},
                "multiNode": {"computeDomain": {"enabled": True}},
                "modelCache": {"create": {"accessModes": ["ReadWriteMany"]}},
            },
            "TP x PCP over two trays with multi-node NVLink",
        ),
        ({"parallelism": {"tensor": 1, "prefillContext": 4, "decodeContext": 4}}, "DCP = PCP"),
        ({"parallelism": {"tensor": 2, "prefillContext": 2, "decodeContext": 4}}, "DCP=TPxPCP"),
        ({"parallelism": {"tensor": 4, "decodeContext": 2}}, "DCP inside TP"),
        ({"parallelism": {"tensor": 1, "data": 3}}, "DP3 on one 4-GPU node"),
        (
            {"parallelism": {"tensor": 4, "decodeContext": 4}, "vllm": {"dcpCommBackend": "a2a"}},
            "a2a for DCP without PCP",
        ),
    ],
)
def test_schema_accepts_valid_layouts(override: dict[str, Any], reason: str) -> None:
    values = merge(GB300, override)
    chart().validate_schema(values)
    render(values)


@pytest.mark.parametrize("tool", ["gen_values.py", "gen_dashboard.py"])
def test_generated_files_are_current(tool: str) -> None:
    result = run([sys.executable, str(REPO / "helm" / "tools" / tool), "--check"])
    assert result.returncode == 0, result.stderr


def _example(node: dict[str, Any], default: Any) -> list[Any]:
    """Values other than the default that a typed setting renders (a flag) with."""
    if "$ref" in node:
        node = {**SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]], **node}
    kinds = node.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "enum" in node:
        return [value for value in node["enum"] if value not in ("", default)][:1]
    if "boolean" in kinds:
        return [True, False]
    if "integer" in kinds:
        return [64]
    if "string" in kinds and not default:
        return ["x" if re.fullmatch(node.get("pattern", ".*"), "x") else "X"]
    return []


def _vllm_flags(rendered: dict[str, str]) -> set[str]:
    flags = set()
    for doc in documents(rendered):
        if doc["kind"] == "Deployment":
            pods = [doc["spec"]["template"]]
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            pods = [lwt["leaderTemplate"], lwt["workerTemplate"]]
        else:
            continue
        for pod in pods:
            args = vllm_container(pod["spec"])["args"]
            flags |= {arg.split("=", 1)[0] for arg in args if arg.startswith("-")}
    return flags


def test_extra_args_cannot_repeat_a_flag_a_value_sets(chart_without_schema: helm.Chart) -> None:
    """Every flag a typed value renders (each model.* and vllm.* setting tried in turn, and a
    multi-node layout) is refused in vllm.extraArgs: a new typed flag that is not listed in
    mla-serve.ownedFlags fails here."""
    flags = _vllm_flags(render(case_values("multinode-nvl72")))
    for section in ("model", "vllm"):
        for key, node in SCHEMA["properties"][section]["properties"].items():
            for value in _example(node, node.get("default")):
                setting = {key: value}
                if (section, key, value) == ("vllm", "enforceEager", True):
                    setting["cudagraphMode"] = "NONE"  # what _validate.tpl requires with it
                values = merge(GB300, {section: setting})
                rendered = chart_without_schema.render(values, name="mla", namespace="serving")
                flags |= _vllm_flags(rendered)
    assert {"--max-cudagraph-capture-size", "--revision", "--enforce-eager"} <= flags
    unowned = []
    for flag in sorted(flags):
        values = merge(GB300, {"vllm": {"extraArgs": [flag]}})
        try:
            render(values)
            unowned.append(flag)
        except helm.HelmRenderError as error:
            assert f"vllm.extraArgs: {flag} is set by " in str(error), str(error)
    assert unowned == []
